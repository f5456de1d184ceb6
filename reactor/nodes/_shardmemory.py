"""A replay shard's memory shared with its requesters: its ring in shared memory (the bulk owner's
region, which the requesters of its host map and read), the sampling state it publishes for one-sided
sampling, and the bulk read server's sampling for requesters on other hosts. The semantics are the
shard's, in the module docstring of ``reactor.nodes.replay``; this module is their mechanics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .._errors import MalformedFrameError
from .._floodlog import flood_logged, flood_tally
from .._graph import plain_name
from ..replay import EpisodeRead, FieldSpec, Selector, StepRead, Storage, TransitionRead, WindowRead
from ..replay.shared import SamplingPublisher, SharedArrays, SharedSampling, serve_sample, why_not_shared
from ..transport import bulk as _bulk
from ..transport._shm import huge_pages_allowed
from ._onesided_remote import REMOTE_SAMPLE_OP
from ._replayconfig import _make_selector

log = logging.getLogger("reactor.replay")


#: The largest reply of one (the items' rows): 192 MiB, inside the read server's reply bound (256 MiB).
_REMOTE_SAMPLE_NBYTES = 192 << 20


_PAGES_SAID = False  # (once a process)
_PAGES_WORTH_SAYING = 64 << 20  # a ring this large read at random misses the TLB on 4 KiB pages


def _say_page_size(name: str, huge_nbytes: int, ring_nbytes: int) -> None:
    """Log once, for a large ring in shared memory not all on 2 MiB pages, what that costs and what
    would give it them (reactor/transport/_shm.py, "Pages")."""
    global _PAGES_SAID
    if _PAGES_SAID or ring_nbytes < _PAGES_WORTH_SAYING or huge_nbytes >= ring_nbytes:
        return
    _PAGES_SAID = True
    allowed, why = huge_pages_allowed()
    hint = ("" if allowed else f"; `mount -o remount,huge=advise /dev/shm` ({why} now) lets rings made later fault "
            f"in 2 MiB pages")
    log.info("%s: %d of its %d MB ring in /dev/shm are on 4 KiB pages: the kernel did not collapse them into 2 MiB "
             "pages (MADV_COLLAPSE needs Linux 6.1 or later and free 2 MiB pages), so window reads miss the TLB "
             "more%s (docs/cluster.md, \"Tuning a host\")", name, (ring_nbytes - huge_nbytes) >> 20,
             ring_nbytes >> 20, hint)


def sampling_region_name(region: str) -> str | None:
    """The bulk region of a shard's published sampling state: ``-s-`` and its data region's name.
    A data region is its reactor's name (``replay[0]`` -> ``replay-0``), which starts with a letter
    or ``_``, so this is never another shard's data region (a suffix could be: ``a`` + ``-s`` is the
    reactor ``a-s``). None where it would pass the 64 characters of a bulk name."""
    name = f"-s-{region}"
    return name if len(name) <= 64 else None


class ShardMemory:
    """The methods of a :class:`~reactor.nodes.replay.Replay` shard that set up its shared memory; the
    state they fill is the shard's."""

    name: str
    run_id: str
    process_link: Any
    specs: list[FieldSpec]
    capacity: int
    read: StepRead | TransitionRead | WindowRead | EpisodeRead
    memory: str
    remote_reads: str
    sampler_config: Any
    max_times_sampled: int
    _owner: _bulk.BulkOwner | None
    _region: str
    _sampling_region: str
    _shared: SharedArrays | None
    _versions: torch.Tensor | None
    _descriptor: Any
    _host_id: Any
    _publisher: SamplingPublisher | None
    _sampling: dict[str, Any] | None
    _remote_sampling: dict[str, Any] | None

    async def _open_bulk_storage(self) -> Storage:
        """The ring in shared memory (its bulk owner, version column and sampling state), which the
        requesters of this host map and read (``self._owner`` is set first: the caller closes it
        on an error).

        Raises:
            OSError: ENOSPC, /dev/shm has no room for a segment of it.
        """
        caps = _bulk.capabilities()
        backends = ["shm"] + (["rdma"] if self.remote_reads != "off" and caps.rdma else [])
        backends += ["zmq"] if self.remote_reads == "zmq" else []
        link = self.process_link
        self._owner = await _bulk.BulkOwner.open(
            self.run_id, backends=backends, zmq_bind=link.side_bind(plain_name(self.name)), curve=link.curve)
        self._region = plain_name(self.name)
        # One-sided sampling: the sampler's state and the episode index live in a second region
        # that requesters on this host map (reactor.replay.shared).
        self._shared = self._shared_arrays(_make_selector("sampler", self.sampler_config))
        storage = Storage(self.specs, self.capacity, pin_memory=self.memory == "pinned",
                          allocator=self._owner.allocator(self._region, pin_memory=self.memory == "pinned"),
                          index_arrays=self._shared)
        self._versions = self._owner.allocate_versions(self._region)
        _say_page_size(self.name, *self._owner.page_nbytes(self._region))
        self._descriptor = self._owner.descriptor(self._region)
        self._host_id = _bulk.host_id()
        return storage

    def _serve_remote_samples(self) -> None:
        """Requesters on other hosts sample this shard in one round trip to its bulk read server,
        whose thread draws and gathers from the published state as a reader here would (the shard's
        loop takes no part)."""
        shared, owner = self._shared, self._owner
        assert shared is not None and owner is not None and self._publisher is not None
        ss = SharedSampling(self._publisher.descriptor(), {n: shared.get(n) for n in shared.layout()})
        # Per item: its rows and mask, keys, probabilities, times, valid flag.
        item_nbytes = (max(1, sum(s.step_nbytes for s in self.specs)) + 1) * max(1, ss.window) + 32
        max_items = max(1, min(64 * self.capacity, _REMOTE_SAMPLE_NBYTES // item_nbytes))
        data_region, name = self._region, self.name
        fields: list[tuple[str, int, int]] = []
        corrupt = [0]  # samples refused for a corrupt published state (counted on the server's thread)

        def sample(request: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
            if request.get("region") != data_region:  # (the server looked up whichever region it names)
                raise ValueError(f"{REMOTE_SAMPLE_OP} samples region {data_region!r} only, not "
                                 f"{request.get('region')!r:.80}")
            if not fields:
                fields.extend((n, t[0].numel() * t.element_size(), t.data_ptr()) for n, t in tensors.items()
                              if n != _bulk.VERSION_FIELD)
            try:
                reply = serve_sample(ss, request, fields, max_items)
            except MalformedFrameError as e:  # (answered to the requester as that error: the server serves on)
                # Its own memory is corrupt, not the request: said here too, where the shard runs.
                corrupt[0] += 1
                if flood_logged(corrupt[0]):
                    log.warning("%s: refused a one-sided sample of a requester on another host: %s%s", name, e,
                                flood_tally(corrupt[0]))
                raise
            reply["fields"] = [f[0] for f in fields]
            return reply

        owner.serve_op(REMOTE_SAMPLE_OP, sample)
        self._remote_sampling = {"table": self._sampling["table"], "op": REMOTE_SAMPLE_OP,  # type: ignore[index]
                                 "max_items": max_items}

    def _shared_arrays(self, sampler: Selector) -> SharedArrays | None:
        """Memory for the table's sampling state in a region of the bulk owner (one segment per
        array), if requesters may sample this table one-sidedly; else None (and why, logged)."""
        why = why_not_shared(sampler, self.read, self.max_times_sampled, capacity=self.capacity)
        region = sampling_region_name(self._region)
        if not why and region is None:
            why = f"its name {self.name!r} is too long for a second bulk region (64 characters in all)"
        if why:
            log.info("%s: requesters sample through messages, not one-sidedly: %s", self.name, why)
            return None
        owner = self._owner
        assert owner is not None and region is not None
        self._sampling_region = region

        def allocate(name: str, nbytes: int) -> np.ndarray:
            return owner.allocate(self._sampling_region, name, (1, nbytes), torch.uint8).numpy()[0]

        return SharedArrays(allocate)
