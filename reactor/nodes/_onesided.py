"""One-sided sampling for :class:`~reactor.nodes.replay_client.ReplayClient` (issue 21): the shards'
published sampling state mapped on this host (:meth:`OneSidedSampling.sample_now`: no message on the
sampling path), or drawn by the read servers of shards on other hosts (:meth:`asample_now`: one round
trip, :mod:`reactor.nodes._onesided_remote`), the draws ahead of a learner's update, and the notices of
the draws, held and sent together.

A mixin: :class:`OneSidedSampling` holds the methods (those of shards on other hosts in its base,
:class:`~reactor.nodes._onesided_remote.RemoteSampling`); ``ReplayClient.__init__`` creates the state
they use (``_shared``, ``_remote_shared``, ``_figures``, ``_regions``, ``_layouts``, ``_capacity``,
``_reader``, ``rng``, ``beta``, the counters and the held notices). The kernels are in
:mod:`reactor.replay.shared`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import FrameTooLargeError, MalformedFrameError, PeerLostError
from .._native import host_empty
from ..replay.shared import BELOW as _BELOW
from ..replay.shared import BUSY as _BUSY
from ..replay.shared import EMPTY as _EMPTY
from ..replay.shared import OK as _OK
from ..replay.shared import ZERO as _ZERO
from ..replay.shared import (
    SharedSampling,
    SharedShards,
    importance_weights,
    least_probability,
    parse_transition,
    plan_shards,
    transitions_from_windows,
)
from ..transport._bulkzmq import mark_seen
from ._onesided_remote import (
    ONE_SIDED_PATIENCE_S,
    REMOTE_SAMPLE_OP,
    RemoteSampling,
    _corrupt,
    _first_bad_mass,
    _RemoteDraw,
    _RemoteShard,
)
from ._shardkeys import KEY_SHARD_BITS
from .messages import SampledBatch, SampledKeys

__all__ = ["NOTICE_MAX_AGE_S", "ONE_SIDED_ERRORS", "REMOTE_SAMPLE_OP", "OneSidedSampling"]

log = logging.getLogger("reactor.replay")

#: What :meth:`ReplayClient.asample_now` raises for a sample that failed (the batch dropped): the
#: errors a shard's read server may answer with, a malformed reply, a lost shard. A learner falls
#: back to messages on any of them; a peer's answer never ends its run.
ONE_SIDED_ERRORS: tuple[type[Exception], ...] = (PeerLostError, MalformedFrameError, FrameTooLargeError, ValueError,
                                                 KeyError, IndexError, TypeError)
#: Held one-sided notices older than this go out with the next sample's, however few samples they
#: count (``ReplayClient(notice_every=...)``).
NOTICE_MAX_AGE_S = 0.05
#: A one-sided sample checks each shard's process (a system call each) at most this often; its memory's
#: state word, which says closed or dead once the run cleaned up after it, at every sample. The rows a
#: draw copies are checked against the ring's writes whoever wrote them: liveness only decides that a
#: dead shard's memory stops being sampled.
_ALIVE_WITHIN_S = 0.001


def _check_transition_fields(read: Any, fields: Any) -> None:
    """Raise ValueError unless the fields a TransitionRead sums and reads ahead (``read``; None:
    nothing to check) are among the data region's ``fields`` (an offer names them: it is checked)."""
    if read is None:
        return
    missing = sorted({read.reward_field, *read.next_fields} - set(fields))
    if missing:
        raise ValueError(f"its transitions read fields {missing} that its data region lacks")


@dataclass
class _SharedShard:
    """A shard's mapped sampling state and what a one-sided copy of its rows needs."""

    table: SharedSampling
    region: str  # the sampling state's bulk region
    data_region: str  # the rows' bulk region
    names: list[str]  # the fields copied, in the order of src_addrs
    src_addrs: np.ndarray
    row_nbytes: np.ndarray


def _ranges(live: list[int], counts: list[int], upto: int) -> list[tuple[int, int, int]]:
    """``(shard, a, b)``: the items ``[a, b)`` of the batch that each of the shards ``live[:upto]``
    with a count drew, in the batch's order (shard by shard from item 0)."""
    out, a = [], 0
    for k, c in zip(live[:upto], counts[:upto]):
        if c:
            out.append((k, a, a + c))
            a += c
    return out


class _Plan:
    """What every one-sided sample from one set of mapped shards shares (built once, kept until the
    shards change): their :class:`SharedShards`, the batch's fields and each thread's scratch arrays."""

    __slots__ = ("key", "live", "lost", "group", "shards", "regions", "fields", "window", "item_nbytes", "beta",
                 "local")

    def __init__(self, key: tuple[int, ...], live: list[int], shards: list[_SharedShard],
                 layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], lost: dict[int, str]) -> None:
        self.key, self.live = key, list(live)
        self.lost = lost  # (a copy) the client's lost shards it was made for (OneSidedSampling._ready_plan)
        self.shards = shards  # (kept: their ids stay theirs while the plan stands)
        self.group = SharedShards([(sh.table, sh.src_addrs, sh.row_nbytes) for sh in shards])
        self.group.tags = np.array(live, np.int64) << KEY_SHARD_BITS  # type: ignore[attr-defined]
        self.regions = tuple(sh.data_region for sh in shards)
        first = shards[0]
        self.window = first.table.window
        w = (self.window,) if self.window else ()
        self.fields = [(f, (*w, *layout[f][1]), layout[f][0]) for f in first.names]  # (name, item shape, dtype)
        self.item_nbytes = first.row_nbytes * max(self.window, 1)
        self.beta = max(sh.table.beta for sh in shards)
        self.local = threading.local()  # (draws ahead run on the client's threads at once)

    def scratch(self) -> tuple[np.ndarray, ...]:
        """This thread's small arrays for the compiled calls (per shard: sequence counts, sizes,
        counts; where a draw stopped; masses, lows, shares; the least probability). Not cleared
        between samples: each call writes what it later reads (``SharedShards.figures`` every
        shard's figures and counts, or BUSY, after which the figures are read again shard by
        shard; ``where`` only with MOVED_AT)."""
        got = getattr(self.local, "arrays", None)
        if got is None:
            m = len(self.shards)
            ints, floats = np.zeros(3 * m + 3, np.int64), np.zeros(3 * m + 1, np.float64)
            got = self.local.arrays = (ints[:m], ints[m:2 * m], ints[2 * m:3 * m], ints[3 * m:],
                                       floats[:m], floats[m:2 * m], floats[2 * m:3 * m], floats[3 * m:])
        return got


class OneSidedSampling(RemoteSampling):
    """ReplayClient's one-sided sampling (see the module docstring; its methods are documented on
    :class:`~reactor.nodes.replay_client.ReplayClient`'s page as its own)."""

    _shared: dict[int, _SharedShard]
    _remote_shared: dict[int, _RemoteShard]
    _figures: dict[int, Any]
    _regions: dict[int, tuple[str, int]]
    _layouts: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]
    _capacity: dict[str, int]
    _reader: Any
    _held: dict[int, list[np.ndarray]]
    _held_samples: int
    _held_since: float
    _group: _Plan | None
    _lock: threading.RLock  # the held notices and the counters (draws ahead run on threads)
    _pool: concurrent.futures.ThreadPoolExecutor | None
    _ahead: deque[concurrent.futures.Future]
    _running: set[concurrent.futures.Future]
    _remote_ahead: deque[_RemoteDraw]
    draw_threads: int
    ahead_samples: int
    taker_samples: int
    rng: np.random.Generator
    beta: float | None
    one_sided: bool
    one_sided_samples: int
    one_sided_retries: int
    gathered_items: int
    dropped_items: int
    notice_every: int
    requester: int
    num_shards: int
    live_shards: list[int]

    async def _attach_sampling(self, shard: int, sampling: Any) -> None:
        """Map the sampling state shard ``shard`` publishes (its data region is attached already), or,
        for a shard on another host, note the read server op that samples it."""
        assert self._reader is not None
        data_region = self._regions[shard][0]
        if self._reader.backend(data_region) != "shm":
            table = sampling.get("table") if isinstance(sampling, dict) else None
            if (isinstance(table, dict) and sampling.get("op") == REMOTE_SAMPLE_OP
                    and type(table.get("window")) is int and table["window"] >= 0
                    and isinstance(table.get("beta"), float) and 0 <= table["beta"] < float("inf")
                    and table.get("pad") in ("head", "tail", "")):
                max_items = sampling.get("max_items")
                try:
                    transition = parse_transition(table.get("transition"), table["window"])
                    _check_transition_fields(transition, self._layouts[data_region])
                except ValueError as e:
                    log.warning("replay client %s: shard %d's one-sided sampling offer is unusable (%s); sampling "
                                "it through messages", self.requester, shard, e)
                    return
                self._remote_shared[shard] = _RemoteShard(data_region, int(table["window"]), float(table["beta"]),
                                                          max_items if type(max_items) is int else 1, transition)
            return
        try:
            if not isinstance(sampling, dict) or not isinstance(sampling.get("table"), dict):
                raise ValueError(f"a sampling offer must be {{'table': ..., 'region': ...}}, got {sampling!r:.200}")
            region = await self._reader.attach(sampling.get("region"), backend="shm")  # type: ignore[arg-type]
            raw = self._reader.mapped(region)
            arrays = {}
            for name, spec in sampling["table"].get("arrays", {}).items():
                shape, dtype = tuple(spec[0]), np.dtype(spec[1])
                mem = raw.get(name)
                if mem is None or mem.shape != (1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize):
                    raise ValueError(f"array {name!r} of the offer does not match the region's segment")
                arrays[name] = mem[0].view(dtype).reshape(shape)
            if "budget" in arrays:  # the rate limiter's sample count: this reader takes from it
                arrays["budget"] = self._reader.writable_view(region, "budget")[0].view(arrays["budget"].dtype)
            table = SharedSampling(sampling["table"], arrays)
            data_region = self._regions[shard][0]
            data = self._reader.mapped(data_region)
        except (ValueError, TypeError, KeyError, OSError, PeerLostError) as e:
            log.warning("replay client %s: shard %d's one-sided sampling offer is unusable (%s); sampling it "
                        "through messages", self.requester, shard, e)
            return
        names = [f for f in self._layouts[data_region] if f in data]
        try:
            _check_transition_fields(table.transition, names)
        except ValueError as e:
            log.warning("replay client %s: shard %d's one-sided sampling offer is unusable (%s); sampling it "
                        "through messages", self.requester, shard, e)
            return
        if table.capacity != self._capacity[data_region]:
            log.warning("replay client %s: shard %d's sampling offer does not match its data region; sampling it "
                        "through messages", self.requester, shard)
            return
        self._group = None  # (the shards drawn from change: see _ready_plan)
        self._shared[shard] = _SharedShard(
            table=table, region=region, data_region=data_region, names=names,
            src_addrs=np.array([data[f].ctypes.data for f in names], dtype=np.int64),
            row_nbytes=np.array([data[f][0].nbytes for f in names], dtype=np.int64),
        )

    @property
    def can_sample_one_sided(self) -> bool:
        """Whether every live shard offered one-sided sampling, on this host (its memory mapped) or
        on another (its read server's op), and this client took it (:meth:`asample_now`)."""
        live = self.live_shards
        return (self.one_sided and bool(live) and all(k in self._shared or k in self._remote_shared for k in live)
                and all(k in self._figures for k in live))

    async def asample_now(self, n: int) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """:meth:`sample_now`, also over shards of other hosts: each is asked once, at its bulk read
        server, to draw its count and send the rows (its thread draws from the published state as
        a reader on its host would; the shard's loop takes no part): one round trip per sample,
        to all such shards at once.

        With every live shard on this host this is :meth:`sample_now`. Otherwise the per-shard counts
        come from the shards' latest figures (every reply carries them), and an item's reported
        probability is the one it was drawn with, ``P(i) = (C_s / C) * q_i``, its weight against the
        least likely item anywhere: the message path's one-round sample (``masses="cached"``),
        exact however the figures moved meanwhile. ``(None, [])`` when a shard drew nothing (below
        its min size, no positive priority, or changing for too long): sample with :meth:`request`.

        Raises:
            ValueError: ``n < 1``.
            PeerLostError: a shard's memory or read server is gone; the batch is dropped.
            MalformedFrameError: a read server's reply was malformed, or a shard's published state is
                corrupt (a shard of this host's, as :meth:`sample_now` finds it, or a read server's, which
                it answers so); the batch is dropped. Its ``shard`` and ``offer`` name the shard and the
                offer to drop (:meth:`drop_one_sided`).
            (and any error class a read server answered with: :data:`ONE_SIDED_ERRORS` lists them all)
            (An error from a read server carries ``notices``: the :class:`SampledKeys` of the shards
            that did draw their part, to send as a sample's notices.)
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"sample size n must be an int >= 1, got {n!r}")
        plan = self._ready_plan()
        if plan is not None:
            return self._sample_on(plan, int(n))
        draw = self._start_remote(int(n)) if self.can_sample_one_sided else None
        if draw is None:
            return None, self.take_notices()
        return await self._finish_remote(draw)

    @property
    def can_sample_now(self) -> bool:
        """Whether every live shard offered one-sided sampling and this client mapped it (then
        :meth:`sample_now` draws unless a shard is below its min size or keeps changing)."""
        return self._standing_plan() is not None or self._mapped_live(dict(self.lost)) is not None

    def _standing_plan(self) -> _Plan | None:
        """The plan of the last sample, while the lost shards are still the ones it was made for."""
        plan = self._group  # (one read: a draw on another thread may set it meanwhile)
        return plan if plan is not None and self.one_sided and plan.lost == self.lost else None

    def _mapped_live(self, lost: dict[int, str]) -> list[int] | None:
        """The live shards when ``lost`` are the lost ones, if one-sided sampling is on and every one of
        them is mapped; else None."""
        live = [k for k in range(self.num_shards) if k not in lost]
        return live if self.one_sided and live and all(k in self._shared for k in live) else None

    def _ready_plan(self) -> _Plan | None:
        """The live shards' :class:`_Plan` when every one of them is mapped (:attr:`can_sample_now`),
        else None. The plan of the last sample stands while the lost shards are the ones it was made
        for: the set of mapped shards changes only through :meth:`_attach_sampling` and
        :meth:`_forget_sampling`, which drop it (a sample's check is then one comparison, not a
        pass over the shards). A plan is made from one copy of the lost shards, its live ones
        derived from that copy: the message path may give a shard up on the loop's thread while a
        draw ahead makes a plan on its own, and that plan must not stand for a set it does not
        draw from."""
        plan = self._standing_plan()
        if plan is not None:
            return plan
        lost = dict(self.lost)
        live = self._mapped_live(lost)
        return None if live is None else self._plan_of(live, lost)

    def _forget_sampling(self, shard: int) -> None:
        """Drop a shard's one-sided offer and unmap its sampling region (its successor offers anew)."""
        self._quiesce()  # (a draw ahead reads the mapping: never past its unmapping)
        self._group = None  # (it reaches the shards' arrays by address: never past their unmapping)
        self._remote_shared.pop(shard, None)
        sh = self._shared.pop(shard, None)
        if sh is not None and self._reader is not None and sh.region in self._reader.regions:
            self._reader.detach(sh.region)

    def drop_one_sided(self, shard: int, offer: Any = None) -> None:
        """Sample ``shard`` through messages for the rest of its life: what it offers for one-sided
        draws proved malformed (a :class:`~reactor.MalformedFrameError` naming it, its ``shard``:
        corrupt shared memory, or a read server's garbage), and a draw from it again would fail again,
        each time after the other shards drew (a warning and a wasted draw a batch, alternating with
        a message sample, for the rest of the run). The offer is not taken again from this life of the
        shard (it comes once per generation); its next life offers anew. The draws already ahead finish
        on the offer they began with (those on threads first, waited for here; those out to read
        servers as they are taken). ``offer``: the error's (``MalformedFrameError.offer``, the offer the
        failed draw used): nothing is dropped when the shard's offer now is another (an error of its
        last life taken after its next life offered). Call on the event loop."""
        if offer is not None and self._shared.get(shard) is not offer and self._remote_shared.get(shard) is not offer:
            return
        if shard in self._shared or shard in self._remote_shared:
            log.warning("replay client %s: shard %d is sampled through messages from now on (its one-sided offer "
                        "proved malformed); its next life may offer again", self.requester, shard)
        self._forget_sampling(shard)

    def sample_now(self, n: int) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """Draw ``n`` items now from the shards' shared memory, with no message to any shard (GEAR's
        one-sided sampling); or ``(None, [])`` when that is not possible now: then sample with
        :meth:`request`.

        Possible when every live shard is on this host and offered it (asynchronous runs; a
        Uniform or Prioritized sampler, WindowRead, TransitionRead or StepRead, no
        ``max_times_sampled``: :func:`reactor.replay.shared.why_not_shared`), the offer has arrived
        (with the client's first reply from each shard: the first sample goes through messages),
        every live shard holds at least its rate limiter's min size, and every shard's rate limiter
        allows its count now: the counts are taken from the limiters' shared budgets, all or none,
        before any draw (otherwise :meth:`request` parks as the shards do, until inserts allow it).
        Transitions are the copied windows of ``n + 1`` steps, summed here as the shard would.

        The draw is the two-stage one: the shards' masses are read (each at one moment, under its
        sequence count), the per-shard counts drawn from them, and each shard's items drawn from the
        state its mass came from: then ``P(i) = w_i / sum of the masses`` and the importance weights
        are a single table's. A shard that changed between its figures and its draw draws its
        count again on its new state, and its items report what they were drawn with,
        ``P(i) = (M_s / M) * q_i`` (the one-round message sample's rule: exact as drawn; restarting
        the whole draw instead would favour the counts that finish before a busy shard changes). A
        shard in the middle of a change is waited for; after ~5 ms the call gives up and returns
        ``(None, notices of the draws made)``. What the state may lack: writes the shards have
        not applied yet (updates in flight, see :mod:`reactor.replay.shared`). Items whose rows the
        ring overwrote during the copy are dropped (``dropped_items``), as in a gathered message
        sample.

        Returns:
            ``(batch, notices)``: the batch, and the notices due, to send to the shards (with
            ``key=shard_key``, like priority updates): they count the draws (times sampled,
            statistics; the rate limiter counted them at the take) and wake a shard whose inserts
            wait for samples (such a shard's notices go at once). The client holds each sample's notices until they count
            ``notice_every`` samples (or :data:`NOTICE_MAX_AGE_S`) and then returns them as one
            :class:`SampledKeys` per shard; so most calls return ``[]``. A call that returns no
            batch returns every held notice; :meth:`take_notices` hands them over at any time.

        Raises:
            ValueError: ``n < 1``.
            PeerLostError: a shard's process died (its memory says so, or it died in the middle of a
                change, which a sample waits ~5 ms for); the batch is dropped. Its ``shard`` names the
                shard, its ``notices`` (where any were made) tell the draws made.
            MalformedFrameError: a shard's published state refused a draw without changing (corrupt
                memory: an index or a probability out of range under a settled sequence count); the
                batch is dropped. Its ``shard`` names the shard, its ``notices`` tell the shards drawn
                from before it.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"sample size n must be an int >= 1, got {n!r}")
        plan = self._ready_plan()
        if plan is None:
            return None, self.take_notices()
        return self._sample_on(plan, int(n))

    def _sample_on(self, plan: _Plan, n: int) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """:meth:`sample_now` of ``n`` (checked) items from the shards of ``plan`` (ready)."""
        live, shards, group = plan.live, plan.shards, plan.group
        m = len(live)
        # The batch's memory, filled in place by each shard's compiled draw-and-copy.
        out = {f: host_empty((n, *shape), dt) for f, shape, dt in plan.fields}
        bases = np.array([t.data_ptr() for t in out.values()], dtype=np.int64)
        item_nbytes = plan.item_nbytes
        mask = np.empty((n, max(plan.window, 1)), dtype=np.bool_)
        local = np.empty(n, dtype=np.int64)  # (the draws leave the batch's keys here,
        q = np.empty(n, dtype=np.float64)  # its probabilities here,
        weights = np.empty(n, dtype=np.float32)  # and its importance weights here)
        times = np.empty(n, dtype=np.int64)
        valid = np.empty(n, dtype=np.bool_)
        uniforms = self.rng.random(2 * n)  # (as two calls of n would draw them)
        count_uniforms = uniforms[:n]  # the per-shard counts (plan_shards: a multinomial sample)
        every_uniform = uniforms[n:]  # the draws: shard i's are [a, b) of them
        beta = self.beta if self.beta is not None else plan.beta
        seqs, sizes, counts, where, masses, lows, shares, least = plan.scratch()
        # Every shard's figures and the counts in one compiled call, then every shard's draw in another
        # (the common case; a shard mid-change or changed in between is handled below, shard by shard).
        status = group.figures(count_uniforms, seqs, sizes, masses, lows, counts, shares, least)
        hurry = False  # a shard has inserts waiting for samples: its notices go at once
        if status == _OK:
            took = group.take(counts)  # the shards' rate limiters' samples, all or none
            if took >= 0:
                return None, self.take_notices()  # a limiter holds them back: messages (the shard parks them)
            hurry = took == -2
            status = group.draw(every_uniform, bases, item_nbytes, group.tags, beta, mask, local, q, times, valid,
                                weights, seqs, counts, shares, least, where)
            if status == _OK:  # (the common case: every shard drew on the state of its figures)
                return self._finish_one_sided(n, _ranges(live, counts.tolist(), m), sum(sizes.tolist()), plan, out,
                                              mask, local, q, weights, times, valid, hurry)
        if status == _ZERO:  # every mass 0 (the message path says so), or one is NaN, or the total below 0
            bad = _first_bad_mass(masses.tolist())
            if bad is not None:  # (read under a settled count: corrupt memory, the same at every draw)
                raise _corrupt(live[bad], shards[bad], f": its mass {float(masses[bad])!r} is not a finite number >= 0",
                               self.take_notices())
            return None, self.take_notices()
        if status == _BELOW:  # below a shard's min size (its request parks until ready)
            return None, self.take_notices()
        deadline = time.perf_counter() + ONE_SIDED_PATIENCE_S
        if status == _BUSY:  # a shard was mid-change: its figures waited for here, then the draws
            figs = [self._stable_figures(sh, deadline) for sh in shards]
            if any(f is None for f in figs):  # a shard kept changing: sample through messages, unless
                self._check_alive(plan)  # it died mid-change (its count stays odd for good: say so)
                return None, self.take_notices()
            if any(f[3] < sh.table.min_size for f, sh in zip(figs, shards)):  # type: ignore[index]
                return None, self.take_notices()
            masses = np.array([f[1] for f in figs], dtype=np.float64)  # type: ignore[index]
            lows = np.array([f[2] for f in figs], dtype=np.float64)  # type: ignore[index]
            if plan_shards(count_uniforms, masses, lows, counts, shares, least) != _OK:
                return None, self.take_notices()  # every priority is 0: the message path says so
            took = group.take(counts)
            if took >= 0:
                return None, self.take_notices()
            hurry = took == -2
            start, a = 0, 0
        else:  # MOVED_AT: the shards before where[0] drew, on the state of their figures
            figs = list(zip(seqs.tolist(), masses.tolist(), lows.tolist(), sizes.tolist()))
            start, a = int(where[0]), int(where[1])
        used: list[tuple[int, float, float, int]] = list(figs)  # type: ignore[arg-type]
        drawn = _ranges(live, counts.tolist(), start)
        min_p = float(least[0])
        retried = False
        for i in range(start, m):  # shards the compiled call did not draw (a change, or it waited): one by one
            k, sh, c = live[i], shards[i], int(counts[i])
            if c == 0:
                continue
            b = a + c
            uniforms = every_uniform[a:b]
            share = float(shares[i])
            f = used[i]
            tries = 0
            while True:  # a shard that changed since its figures: its own draw again, on its new state
                # (keys, probabilities and weights of the batch: `local` and `q` come back tagged and scaled)
                status = sh.table.sample_part(f[0], uniforms, sh.src_addrs, sh.row_nbytes,
                                              bases + a * item_nbytes, mask[a:b], local[a:b], q[a:b], times[a:b],
                                              valid[a:b], k << KEY_SHARD_BITS, share, min_p, beta, weights[a:b])
                if status == _OK:
                    break
                self._tally(retries=1)
                retried = True
                tries += 1
                g = self._stable_figures(sh, deadline) if status != _EMPTY else None
                if g is not None and g[0] == f[0]:
                    # Refused on a state that did not change (the count moves at every change, and the
                    # draw checks it last): the published memory is inconsistent, and a draw again
                    # would be refused the same way (it looped here for good: hostile review). Its
                    # own, or the mass of another shard, read as inf or below 0, that made this
                    # shard's share 0 or above 1: that shard is named (its offer is the one to drop).
                    j = _first_bad_mass([u[1] for u in used])
                    if j is None:
                        why = f" under a settled sequence count {f[0]} (an index or a probability out of range)"
                        j = i
                    else:
                        why = (f": its mass {used[j][1]!r} is not a finite number >= 0 (shard {k}'s draws on its "
                               f"share were refused)")
                    raise _corrupt(live[j], shards[j], why, self._notices(drawn, local))  # (notices: as asample_now's)
                if g is None and status != _EMPTY:  # (it died mid-change? as above; its notices go too)
                    try:
                        self._check_alive(plan)
                    except PeerLostError as e:
                        e.notices = self._notices(drawn, local)  # type: ignore[attr-defined]
                        raise
                if g is None or not g[1] > 0 or (tries > 1 and time.perf_counter() > deadline):
                    # No mass left there, or it kept changing (one draw on its new figures at least:
                    # the first call of a process loads the compiled draw, ms): messages (the draws
                    # made count: their notices go now; so do the counts taken and not drawn, at the
                    # limiters: reactor.replay._budget)
                    return None, self.take_notices(self._notices(drawn, local))
                f = g
            used[i] = f
            drawn.append((k, a, b))
            a = b
        if retried:  # the least likely item is the one of the figures the draws used
            min_p = least_probability(shares, np.array([f[1] for f in used]), np.array([f[2] for f in used]))
            weights = importance_weights(q, min_p, beta)
        return self._finish_one_sided(n, drawn, sum(f[3] for f in used), plan, out, mask, local, q, weights, times,
                                      valid, hurry)

    def _plan_of(self, live: list[int], lost: dict[int, str]) -> _Plan:
        """The :class:`_Plan` of shards ``live``, the live ones when ``lost`` (a copy) are the lost
        ones (kept until the shards change)."""
        shards = [self._shared[k] for k in live]
        key = tuple(id(sh) for sh in shards)
        got = self._group  # (one read: a draw on another thread may set it meanwhile)
        if got is None or got.key != key:
            got = self._group = _Plan(key, live, shards, self._layouts[shards[0].data_region], lost)
        elif got.lost != lost:  # (the same shards: lost ones given up on, or back without an offer)
            got.lost = lost
        return got

    def _hold_keys(self, drawn: list[tuple[int, np.ndarray]], hurry: bool = False, gathered: int = 0,
                   dropped: int = 0) -> list[SampledKeys]:
        """A one-sided sample's draws (shard, its keys: arrays no one else holds), held with those not
        told yet; all of them, one notice per shard, once they count ``notice_every`` samples, or the
        oldest is :data:`NOTICE_MAX_AGE_S` old, or ``hurry`` (a shard holds inserts back until it
        hears of samples: its rate limiter's count moved, but the shard checks again only when told).
        ``gathered``: the sample's items, counted with it (and ``dropped``) under the same lock."""
        now = time.perf_counter()
        with self._lock:
            if gathered:
                self.gathered_items += gathered
                self.one_sided_samples += 1
                self.dropped_items += dropped
            self._hold(drawn, now)
            if hurry or self._held_samples >= self.notice_every or now - self._held_since >= NOTICE_MAX_AGE_S:
                return self.take_notices()
        return []

    def _hold(self, drawn: list[tuple[int, np.ndarray]], now: float) -> None:
        """Hold one sample's draws (shard, keys) with those not told yet (the lock held)."""
        if not self._held_samples:
            self._held_since = now
        for k, keys in drawn:
            self._held.setdefault(k, []).append(keys)
        self._held_samples += 1

    def take_notices(self, more: list[SampledKeys] = ()) -> list[SampledKeys]:  # type: ignore[assignment]
        """Every held notice (and ``more``), merged to one :class:`SampledKeys` per shard, to send
        now; the client holds none after. Samples that return no batch (and the errors of
        :meth:`asample_now`) return them this way; an owner that stops sampling one-sidedly sends
        what this returns (the shards count those draws only when told)."""
        with self._lock:
            held = self._held
            self._held, self._held_samples = {}, 0
        for m in more:
            held.setdefault(m.shard, []).append(np.asarray(m.keys))
        return [SampledKeys(k, np.concatenate(ks)) for k, ks in sorted(held.items())]

    def _tally(self, *, gathered: int = 0, samples: int = 0, dropped: int = 0, retries: int = 0) -> None:
        """Add to the counters (under the lock: draws ahead count from their threads)."""
        with self._lock:
            self.gathered_items += gathered
            self.one_sided_samples += samples
            self.dropped_items += dropped
            self.one_sided_retries += retries

    # ---------------------------------------------------------------- draws ahead, on threads

    def draw_ahead(self, n: int, depth: int) -> int:
        """Start :meth:`sample_now` draws of ``n`` items on the client's draw threads until ``depth``
        are running or done and not yet taken by :meth:`next_drawn`; returns how many that is.

        The draws' compiled parts (the descents, the copies) run without the GIL, so a learner's
        next batches are drawn while it updates on this one, and ``draw_threads`` draws at once on
        as many cores. A draw ahead sees the shards' state of its moment: the priority updates of the
        updates made meanwhile (at most ``depth`` of them) are not in it, as with ``depth`` message
        samples in flight.

        With shards of other hosts among the live ones (:meth:`can_sample_one_sided`, not
        :meth:`can_sample_now`; call it on the event loop), a draw ahead is an :meth:`asample_now`
        whose requests go to the read servers now: each server draws and sends its part while this
        process does something else (a learner's update), and :meth:`next_drawn` awaits and
        assembles it (the part of a shard of this host is drawn then). Each server answers its
        requests in order, so ``depth`` of them keep every server busy. Nothing starts while an
        offer is missing, or when no draw could start (as :meth:`asample_now` returning no batch).

        Raises:
            ValueError: ``n < 1`` or ``depth < 0``.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"sample size n must be an int >= 1, got {n!r}")
        if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 0:
            raise ValueError(f"draw_ahead depth must be an int >= 0, got {depth!r}")
        if self._remote_ahead or (not self.can_sample_now and not self._ahead):
            # Shards of other hosts: each draw's requests go to their read servers now, and its replies
            # are taken by next_drawn (draws of the two kinds never wait at once: taken in order).
            while len(self._remote_ahead) < depth and self.can_sample_one_sided and not self.can_sample_now:
                draw = self._start_remote(int(n))
                if draw is None:
                    break
                self._remote_ahead.append(draw)
            return len(self._remote_ahead)
        if self._pool is None and depth and self.can_sample_now:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.draw_threads, thread_name_prefix="reactor-draw")
        while len(self._ahead) < depth and self.can_sample_now:
            fut = self._pool.submit(self.sample_now, int(n))  # type: ignore[union-attr]
            fut.n = int(n)  # type: ignore[attr-defined]  # (for a taker that draws it itself: _help)
            self._running.add(fut)  # (until it is done, taken or not: _quiesce waits for it)
            fut.add_done_callback(self._running.discard)
            self._ahead.append(fut)
        return len(self._ahead)

    @property
    def drawn_ahead(self) -> int:
        """Draws started by :meth:`draw_ahead` and not yet taken."""
        return len(self._ahead) + len(self._remote_ahead)

    async def next_drawn(self) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """A draw ahead's :meth:`sample_now` result: the oldest one done; when none is done, one not
        started yet is drawn here and now, by the caller (:meth:`_help`: the draw threads are busy,
        and a taker that waited for them would leave a core idle), or else the oldest is awaited (the
        loop runs meanwhile). ``(None, [])`` if that draw was dropped while this waited (a shard it
        drew from was lost or restarted: its batch goes, its notices to the other shards are held)
        or taken by :meth:`drain_drawn`. A caller cancelled while it waits leaves the draw to the
        next take. A draw from shards of other hosts is finished here (its replies awaited).

        Raises:
            LookupError: no draw was started (:meth:`draw_ahead`).
            (what :meth:`sample_now` raises, from the draw's thread or here; what :meth:`asample_now`
            raises, for a draw from shards of other hosts)
        """
        if self._remote_ahead:
            return self._taken(await self._remote_result(self._remote_ahead[0]))
        if not self._ahead:
            raise LookupError("next_drawn: no draw ahead was started (draw_ahead)")
        helped = self._help()
        if helped is not None:
            return helped
        fut = self._ahead[0]
        # Shielded, and taken off the queue only once done: a caller cancelled while it waits leaves
        # the draw (its batch, its notices) to the next take. The draw's outcome stays on ``fut`` for
        # that take; the loop's future that mirrors it is left behind by a cancelled caller, and an
        # error left on it would be logged as "never retrieved" when it is collected (a learner
        # cancelled at the end of a run while its shards closed: seen on a loaded machine).
        waiting = asyncio.wrap_future(fut)
        waiting.add_done_callback(mark_seen)
        # (the draw's own error is raised below, once the draw is off the queue: raised from the wait, it
        # left the draw at the head, to be raised again, its notices with it, at the next take)
        with contextlib.suppress(Exception):
            await asyncio.shield(waiting)
        if not (self._ahead and self._ahead[0] is fut):
            return None, []  # dropped meanwhile (its shard lost or restarted: _drop_drawn_of), or drained
        self._ahead.popleft()
        return self._taken(fut.result())

    def take_drawn(self) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """:meth:`next_drawn` for code without an event loop: blocks until the oldest draw ahead is
        done when none is done and none is left to draw here. Not for draws from shards of other
        hosts (RuntimeError: their replies are awaited by :meth:`next_drawn`)."""
        if self._remote_ahead:
            raise RuntimeError("take_drawn: the draws ahead are from shards of other hosts, whose replies are "
                               "awaited: take them with next_drawn")
        if not self._ahead:
            raise LookupError("take_drawn: no draw ahead was started (draw_ahead)")
        helped = self._help()
        if helped is not None:
            return helped
        return self._taken(self._ahead.popleft().result())

    def _help(self) -> tuple[SampledBatch | None, list[SampledKeys]] | None:
        """The taker's share of the draws ahead: the oldest draw done, taken off the queue; or, when
        none is done, the oldest not started yet, taken off the pool's queue and drawn here (counted
        in ``taker_samples``); None when every draw is running (then the taker waits for the oldest).

        Measured (docs/benchmarks.md, session 48): a taker that only waited for the draw threads got
        a batch each 0.17-0.23 ms on 2 cores, one that draws the ones not started 0.126-0.137 ms."""
        for fut in self._ahead:
            if fut.done():
                self._ahead.remove(fut)
                return self._taken(fut.result())
        for fut in self._ahead:
            if fut.cancel():  # (only a draw not started yet can be: none of its work was done)
                self._ahead.remove(fut)
                result = self._taken(self.sample_now(fut.n))  # type: ignore[attr-defined]
                self.taker_samples += result[0] is not None
                return result
        return None

    def _taken(self, result: tuple[SampledBatch | None, list[SampledKeys]]) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """A draw ahead's result as it is taken: a batch counts in ``ahead_samples``."""
        self.ahead_samples += result[0] is not None
        return result

    def drain_drawn(self) -> list[tuple[SampledBatch | None, list[SampledKeys]] | BaseException]:
        """Wait for every draw ahead and take them all, oldest first: each a :meth:`sample_now`
        result or the error it raised. Blocks (a draw takes about a millisecond, or gives up after
        ~5 ms)."""
        out: list[tuple[SampledBatch | None, list[SampledKeys]] | BaseException] = []
        while self._ahead:
            fut = self._ahead.popleft()
            e = fut.exception()
            out.append(e if e is not None else self._taken(fut.result()))
        return out

    async def adrain_drawn(self) -> list[tuple[SampledBatch | None, list[SampledKeys]] | BaseException]:
        """:meth:`drain_drawn`, also of draws from shards of other hosts (their replies awaited)."""
        out = self.drain_drawn()
        while self._remote_ahead:
            try:
                out.append(self._taken(await self._remote_result(self._remote_ahead[0])))
            except ONE_SIDED_ERRORS as e:
                out.append(e)
        return out

    def _quiesce(self) -> None:
        """Wait until no draw ahead is running, taken or not (their results stay for :meth:`next_drawn`)."""
        if self._running:
            concurrent.futures.wait(list(self._running))

    def _drop_drawn_of(self, shard: int) -> None:
        """Draws ahead done (the caller quiesced) that drew from ``shard``, which was lost or restarted,
        are dropped, as a message sample in flight drops its part; their notices to the other shards are
        held, to go with the next (``shard``'s successor does not count its predecessor's draws)."""
        self._ahead = deque(fut for fut in self._ahead if self._keeps(fut, shard))
        # Draws from shards of other hosts still waiting for replies drop their part from ``shard`` when
        # they finish (their batch with it); those finished go as the ones above.
        keep: deque[_RemoteDraw] = deque()
        for draw in self._remote_ahead:
            if draw.task is None or not draw.task.done():
                if shard in draw.live:  # (every live shard set the shares, one with a count of 0 too)
                    draw.dropped.add(shard)
                    for (k, _c), sent in zip(draw.remote, draw.sent):
                        if k == shard and not isinstance(sent, BaseException) and self._reader is not None:
                            self._reader.forget(sent)  # (a wait for its reply ends now: its host may be silent)
                keep.append(draw)
            elif draw.task.cancelled() or self._keeps(draw.task, shard):
                keep.append(draw)
        self._remote_ahead = keep

    def _keeps(self, done: Any, shard: int) -> bool:
        """Whether a finished draw ahead (its future or task) stays after ``shard`` was lost or restarted:
        not when its batch drew from ``shard`` (or it has none); then its notices to the other shards
        are held. Notices to ``shard`` go from those that stay, and from an error's (its successor
        does not count its predecessor's draws)."""
        error = done.exception()
        if error is not None:
            told = getattr(error, "notices", None)
            if isinstance(told, list):
                told[:] = [m for m in told if m.shard != shard]
            return True
        batch, notices = done.result()
        notices[:] = [m for m in notices if m.shard != shard]
        if batch is not None and not bool((batch.keys.numpy() >> KEY_SHARD_BITS == shard).any()):
            return True
        others = [(m.shard, np.asarray(m.keys)) for m in notices]
        if others:
            with self._lock:
                self._hold(others, time.perf_counter())
        return False

    def _stable_figures(self, sh: _SharedShard, deadline: float) -> tuple[int, float, float, int] | None:
        """A shard's figures under a stable sequence count, waiting out a change in progress (tens of
        microseconds); None after ``deadline``."""
        while True:
            f = sh.table.figures()
            if f[0] >= 0:
                return f
            self._tally(retries=1)
            if time.perf_counter() > deadline:
                return None
            time.sleep(0)  # let the shard's process (maybe on this core) finish its change

    @staticmethod
    def _notices(drawn: list[tuple[int, int, int]], keys: np.ndarray) -> list[SampledKeys]:
        """The shards' notices of the draws made (also of a sample given up half-way); ``keys`` are the
        batch's (the draws leave them tagged with their shard)."""
        return [SampledKeys(k, keys[a:b]) for k, a, b in drawn]

    def _check_alive(self, plan: _Plan) -> None:
        """Raise PeerLostError naming the first shard of ``plan`` whose memory says its owner is gone
        (its ``shard`` attribute; the process of each checked at most once a millisecond)."""
        assert self._reader is not None
        try:
            self._reader.check_alive_all(plan.regions, _ALIVE_WITHIN_S)
        except PeerLostError:
            for k, region in zip(plan.live, plan.regions):  # which one
                try:
                    self._reader.check_alive(region)
                except PeerLostError as e:
                    lost = PeerLostError(f"replay shard {k}: its shared memory is gone ({e})")
                    lost.shard = k  # type: ignore[attr-defined]
                    raise lost from e
            raise

    def _finish_one_sided(self, n: int, drawn: list[tuple[int, int, int]], table_size: int, plan: _Plan,
                          out: dict[str, torch.Tensor], mask: np.ndarray, keys: np.ndarray, probs: np.ndarray,
                          weights: np.ndarray, times: np.ndarray, valid: np.ndarray, hurry: bool = False,
                          ) -> tuple[SampledBatch, list[SampledKeys]]:
        """The batch of the drawn items (their keys, probabilities and weights as the draws left them),
        and its notices."""
        told = keys.copy()  # the notices' keys (held: the batch's may be changed in place by its taker)
        try:  # data of a shard found dead is never returned (its process checked each ms)
            self._check_alive(plan)
        except PeerLostError as e:  # (the batch goes; the draws made still count: their notices ride on it)
            e.notices = [SampledKeys(k, told[a:b]) for k, a, b in drawn]  # type: ignore[attr-defined]
            raise
        notices = [(k, told[a:b]) for k, a, b in drawn]
        data: dict[str, torch.Tensor] = out
        if plan.window:
            data["mask"] = torch.from_numpy(mask)
        whole = bool(valid.all())
        if not whole:  # items whose rows the ring overwrote during the copy
            idx = np.flatnonzero(valid)
            data = {k: v.index_select(0, torch.from_numpy(idx)) for k, v in data.items()}
            keys, times, probs, weights = keys[idx], times[idx], probs[idx], weights[idx]
        if plan.shards[0].table.transition is not None:  # n-step transitions of the copied windows
            data = transitions_from_windows(data, plan.shards[0].table.transition)
        batch = SampledBatch(data=data, keys=torch.from_numpy(keys), weights=torch.from_numpy(weights),
                             probabilities=torch.from_numpy(probs), table_size=int(table_size),
                             times_sampled=torch.from_numpy(times))
        return batch, self._hold_keys(notices, hurry, gathered=n, dropped=0 if whole else int((~valid).sum()))
