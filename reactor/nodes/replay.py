"""The distributed replay service: ``Replay`` shards behind ports, and the ``ReplayClient`` of learners.

**Shards.** A :class:`Replay` reactor owns one :class:`~reactor.replay.Table` (its shard index is its
bank index). Writers (:class:`~reactor.nodes.writer.Writer`, inside actors) send it whole episodes
or chunks (:class:`~reactor.nodes.messages.Steps`); learners send sample requests and priority
updates; it answers on ``replies``. The table configuration is constructor data (every process
rebuilds the graph from the app), the table itself is built in ``startup``.

**Rate limiting across ports.** A request the table's rate limiter does not allow yet is *parked*
and served, in arrival order, as soon as an insert (or a delete) makes it possible; an insert the
limiter holds back (``SampleToInsertRatio``, ``Queue``) is parked the same way until samples make
room. Nothing polls: parked work is retried only when the table changed.

**The end of the data.** A shard that knows how many writers feed its bank (``writers``) counts
their end markers (:attr:`~reactor.nodes.messages.Steps.last`: an actor sends one to every shard
once it has taken its whole step budget). Once every writer has ended and no insert is parked, no
insert can come, and a rate limiter holds for good what it holds now (without inserts, what it
allows only shrinks). So from then on a request it holds is answered with
:class:`~reactor.nodes.messages.Exhausted`, not parked forever: a learner learns that no sample
can come, and a bank of data-parallel learners ends together (``reactor.nodes.learner``). A
writer that sends rows after its marker (its actor was restarted) counts as live again.

**Sharded sampling (exact two-stage).** N shards behave as one table. For a batch of ``B``:

1. the client asks every shard for its *mass* ``M_s`` (the sum of its items' sampler weights:
   ``p_i^alpha`` for Prioritized, one per item for Uniform); a shard answers once it can sample;
2. the client draws per-shard counts ``(c_s) ~ Multinomial(B, M_s / sum_t M_t)`` with its own
   seeded generator and asks each shard for ``c_s`` items; shard ``s`` draws item ``i`` with
   probability ``q_i = w_i / M_s``.

So an item is drawn with probability ``P(i) = (M_s / M) * (w_i / M_s) = w_i / M``: exactly the
single-table distribution over the union of the shards. Importance weights use the global
quantities: ``w_i^IS = (N * P(i))^-beta / max_j (N * P(j))^-beta = (w_i / min_j w_j)^-beta``, with
``min_j w_j`` the smallest positive weight over all shards. With one shard the client skips stage 1.

**Keys** carry their shard in the top bits (:func:`make_keys`, :func:`key_shard`), so priority
updates route to the owner (:meth:`ReplayClient.update_priorities`).

**Determinism.** A shard's answers are a function of the events it handled (in tag order in
deterministic mode) and of its table generator, seeded from the reactor's seeded generator; the
client draws counts from the generator it is given (the learner's ``self.rng``). So the same run
under ``single`` and ``processes`` gives identical samples.

**Checkpoints.** With ``run_dir``, a shard checkpoints its table into ``run_dir/<name>`` (e.g.
``replay-2``), writing in a background thread (``Table.save_in_background``: the lock is held only
for the memory copy): on a :class:`CheckpointRequest`; periodically, at the first change of the
table at or after each multiple of ``checkpoint_period_s`` (checked in the reactions that change it,
so nothing is scheduled and a period never keeps a run alive; a table that has not changed since its
last checkpoint, by ``Table.generation``, is not written again); and, with
``checkpoint_on_shutdown``, once more when the run ends if it changed since. One save at a time: a
due checkpoint waits while the previous one is written. At shutdown a save in progress that does
not hold the latest state is cancelled (it stops within one 16 MiB chunk) and the final one is
written instead. The period is of logical time in deterministic runs, and of wall-clock time since
the shard started in async runs, as async timers and ``--stop-s`` are: there a message's tag is its
sender's, delayed by the link, and nothing makes a shard's tags advance with the run (a learner that
draws one-sidedly steps by zero-delay actions, and actors held back by flow control resume at the tags
of the shards' acknowledgements: an async DQN run's shards saw tags under 0.7 ms for its whole minute,
and wrote no periodic checkpoint). On start (``restore``) the shard loads the newest checkpoint that verifies
(checksums and invariants, ``Table.restore``), falling back to older ones, or starts empty; every
refused checkpoint is logged.

**What survives a crash.** Without a write-ahead log, inserts (and samples, priority updates,
deletes) since the last complete checkpoint are lost when the shard's process dies. With ``wal``,
each Steps message is appended to ``run_dir/<name>/wal/`` and fsynced before its ``InsertAck`` is
sent, and a restore redoes the logged inserts the checkpoint does not hold
(:mod:`reactor.replay.wal`): no acknowledged insert is lost on kill -9; samples, priority updates
and deletes since the checkpoint still are (redone items carry their insert-time priorities).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import math
import numbers
import os
import re
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._errors import PeerLostError, WouldBlock
from .._files import refuse_file_links
from .._graph import plain_name
from .._reactor import Action, Input, Output, Reactor, reaction, shutdown, startup
from .._runclaim import claim_run_dir, release_run_dir
from ..replay import (
    Prioritized,
    Selector,
    StepRead,
    Storage,
    Table,
    TransitionRead,
    WindowRead,
)
from ..replay.shared import SamplingPublisher, SharedArrays
from ..replay.table import claim_fits
from ..transport import bulk as _bulk
from ..transport._shm import HUGE_NBYTES
from ._device import check_memory
from ._onesided_remote import REMOTE_SAMPLE_OP as REMOTE_SAMPLE_OP
from ._replayconfig import _make_limiter, _make_selector, parse_fields, parse_read
from ._shardkeys import _LOCAL_MASK, KEY_SHARD_BITS, _int64_keys, key_local, key_shard, make_keys
from ._shardmemory import ShardMemory
from ._shardmemory import sampling_region_name as sampling_region_name
from ._shardstore import ShardStore
from ._staging import StagedReader
from .messages import (
    CheckpointRequest,
    Delete,
    Exhausted,
    InsertAck,
    ItemUpdate,
    MassRequest,
    PriorityUpdate,
    ReplayControl,
    ReplayReply,
    ReplayRequest,
    SampledKeys,
    SampleRequest,
    ShardMass,
    ShardSample,
    ShardStatistics,
    StatisticsRequest,
    Steps,
)
from .replay_client import REMOTE_READS, ReplayClient

__all__ = [
    "KEY_SHARD_BITS",
    "Replay",
    "ReplayClient",
    "key_local",
    "key_shard",
    "make_keys",
    "parse_fields",
    "parse_read",
]

log = logging.getLogger("reactor.replay")
#: Writers a shard remembers it cannot read the staged rows of (Replay._cannot_stage): ids come from
#: peers, so the oldest is forgotten past it (that writer then stages again, and is refused again).
_MAX_UNSTAGEABLE = 4096


def _to_pinned_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPU tensors (on one device) -> page-locked host copies: one asynchronous copy each, then one
    sync (a pageable ``.to("cpu")`` syncs per field and copies at a fraction of the speed). The pinned
    blocks come from torch's caching host allocator and go back to it when the reply is done with them."""
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
            for k, v in tensors.items()}
    if tensors:
        torch.cuda.current_stream(next(iter(tensors.values())).device).synchronize()
    return host


def _sampler_mass(sampler: Selector) -> tuple[float, float]:
    """(sum of item weights, smallest positive item weight) of a table's sampler."""
    if isinstance(sampler, Prioritized):
        tree = sampler.tree
        return tree.total, tree.min
    n = len(sampler)
    return float(n), (1.0 if n else math.inf)


def _known(table: Table, local: np.ndarray) -> np.ndarray:
    """Which keys are still items of ``table`` (bool mask).

    Uses the table's slot->key index (``Table`` has no public membership test yet; keys are
    ``slot = key % capacity``, so this is one gather).
    """
    cap = table.storage.capacity
    index = table._keys  # noqa: SLF001 - see docstring
    return (local >= 0) & (index[local % cap] == local)


# ------------------------------------------------------------------------------------ the shard


class Replay(ShardMemory, Reactor):
    """One replay shard: a Table behind ports (insert, sample, priority update/delete, statistics).

    Ports:
        steps: :class:`Steps` from writers (whole episodes or chunks; one message per flush).
        requests: :class:`MassRequest` / :class:`SampleRequest` from clients; answered on ``replies``.
        updates: :class:`PriorityUpdate` / :class:`Delete` for keys this shard owns.
        control: :class:`CheckpointRequest`, :class:`StatisticsRequest`.
        replies: :class:`ShardMass` / :class:`ShardSample`, routed back by ``requester``.
        acks: :class:`InsertAck` for every Steps message done with (inserted or refused) that asks for
            one (:attr:`Steps.ack`: it counts for that writer's earlier messages too), routed back to its
            writer (``key=writer_key``): writers' flow control.
        statistics: :class:`ShardStatistics`, every ``statistics_period_s`` and on request.

    Semantics: see the module docstring (parking, two-stage sampling, determinism, checkpoints).
    A malformed :class:`Steps` (unknown or missing field, wrong dtype or shape, an open episode at
    its end) is refused whole with a logged error naming the writer and the problem, and counted in
    ``rejected_steps``; the shard keeps serving. A bad request gets a reply carrying ``error``.

    Args:
        fields: the step fields: FieldSpecs, ``(name, shape, dtype)`` or dicts (dtype names allowed).
        capacity: steps the shard's storage ring holds.
        read: what a sample returns per item (StepRead, TransitionRead, WindowRead, EpisodeRead, or a
            dict like ``{"type": "WindowRead", "length": 32}``).
        sampler: selector config: ``"uniform"``, ``{"type": "prioritized", "alpha": 0.6}``, ...
        remover: selector config of the remover (default ``"fifo"``).
        rate_limiter: limiter config: ``{"type": "MinSize", "min_size": 1000}`` (default min size 1),
            ``{"type": "SampleToInsertRatio", "samples_per_insert": 4, "min_size": 1000, "error_buffer": 100}``.
        max_size: most items, in ``[1, capacity]`` (default: capacity); at least the rate limiter's
            min size.
        max_times_sampled: drop an item after this many samples (an int >= 0; 0: never).
        beta: importance-weight exponent reported to clients (finite, >= 0).
        run_dir: directory for checkpoints (``run_dir/<name>``); None disables them.
        checkpoint_period_s: checkpoint at the first table change at or after every multiple of this
            many seconds: of logical time in deterministic runs, of wall-clock time since the shard
            started in async runs (needs ``run_dir``; unchanged tables are not rewritten; nothing is
            scheduled, so it never keeps a run alive).
        async_checkpoint_period_s: in async runs, the period in seconds of wall-clock time instead of
            ``checkpoint_period_s`` (a logical period rarely suits as a wall one: the apps' 0.1 s, every
            100,000 env steps of each actor in a deterministic run, would be several saves a second);
            None: ``checkpoint_period_s`` in both modes. Needs ``run_dir``.
        statistics_period_s: publish statistics this often (None: only on request; keeps the run
            alive: use with a stop time).
        keep_checkpoints: complete checkpoints kept per shard (an int >= 1).
        restore: (True or False) on start, restore from the newest checkpoint in ``run_dir/<name>`` that verifies
            (older ones if it does not; empty if none does), then redo the write-ahead log.
        checkpoint_on_shutdown: when the run ends, write a last checkpoint (synchronously) if the
            table changed since the last one.
        wal: log every Steps message in ``run_dir/<name>/wal/`` (fsynced) before acknowledging it, so
            a restore loses no acknowledged insert (needs ``run_dir``; costs an fsync per message:
            docs/benchmarks.md).
        bulk: keep the storage in shared memory and answer requesters on this host with the rows
            to gather themselves (WindowRead and StepRead tables: the shard never copies the
            windows). A TransitionRead table answers with the transitions and offers its rows for
            one-sided draws, which sum the returns themselves. None (default): on in async runs where shared memory works, off in
            deterministic runs (a reader's gather races the ring, so a dropped overwritten item
            would depend on timing). True forces it on.
        memory: where the shard's trajectory memory lives: ``"host"`` (default), ``"pinned"``
            (page-locked host memory, for fast copies to a GPU learner; with ``bulk`` the shared
            segments themselves are registered with CUDA), or ``"cuda"`` / ``"cuda:N"`` (the ring
            on a GPU: items are gathered there, and replies carry a host copy of each batch; no
            shared-memory path). Pinned and CUDA memory need CUDA on the shard's host: asked for
            without it, the shard fails at start with a message naming the option.
        writers: how many writers (actors) feed this shard's bank, each under its own id in
            ``[0, writers)``: once every one has sent its end marker, a request the rate limiter
            holds is answered :class:`Exhausted` (module docstring). None (default): never; a
            held request waits for inserts.
        remote_reads: one-sided reads by requesters on *other* hosts, when ``bulk`` is on.
            ``"auto"`` (default): offered over RDMA when an RDMA device works here (the reader
            then pulls the rows with RDMA READs; this shard's CPU is not involved), otherwise
            such requesters get the data in the replies. ``"zmq"``: also offered through the
            bulk layer's zmq read server (a thread of this process, on this process's
            interface, CURVE when the run's links are): the copy leaves the shard's loop, for one
            more round trip. ``"off"``: data in the replies for every other host.

    Raises:
        ValueError, TypeError: a malformed configuration (at graph build time).

    Example:
        >>> shards = graph.add(Replay([("obs", (4,), "float32"), ("action", (), "int64"),
        ...                            ("reward", (), "float32"), ("terminated", (), "bool")],
        ...                           capacity=100_000, read=TransitionRead(3, 0.99, next_fields=("obs", "terminated")),
        ...                           sampler={"type": "prioritized", "alpha": 0.6},
        ...                           rate_limiter={"type": "MinSize", "min_size": 1000}),
        ...                    name="replay", replicas=2)
        >>> graph.connect(actors.steps, shards.steps, key=shard_key)
        >>> graph.connect(learner.requests, shards.requests, key=shard_key)
        >>> graph.connect(shards.replies, learner.replies, key=requester_key)
    """

    placement_role = "replay"
    _ack_host = ""  # (set at startup: reactor.nodes._staging)
    _staged: StagedReader | None = None
    #: Writer -> the life (its seq's high word) whose staged rows this shard could not read: its acks
    #: then say no host, which turns that writer's ring for this shard off (set at startup).
    _unstageable: dict[int, int]

    steps = Input(Steps)
    requests = Input(ReplayRequest)
    updates = Input(ItemUpdate)
    control = Input(ReplayControl)
    replies = Output(ReplayReply)
    acks = Output(InsertAck)
    statistics = Output(ShardStatistics)
    tick = Action()

    def __init__(
        self,
        fields: Sequence[Any],
        capacity: int,
        *,
        read: Any = StepRead(),
        sampler: Any = "uniform",
        remover: Any = "fifo",
        rate_limiter: Any = None,
        max_size: int | None = None,
        max_times_sampled: int = 0,
        beta: float = 0.4,
        run_dir: str | None = None,
        checkpoint_period_s: float | None = None,
        async_checkpoint_period_s: float | None = None,
        statistics_period_s: float | None = None,
        keep_checkpoints: int = 3,
        restore: bool = True,
        checkpoint_on_shutdown: bool = False,
        wal: bool = False,
        bulk: bool | None = None,
        memory: str = "host",
        remote_reads: str = "auto",
        writers: int | None = None,
    ) -> None:
        self.specs = parse_fields(fields)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"Replay capacity must be an int >= 1 (steps), got {capacity!r}")
        self.capacity = capacity
        self.read = parse_read(read)
        names = {s.name for s in self.specs}
        if isinstance(self.read, TransitionRead):
            for f in (self.read.reward_field, *self.read.next_fields):
                if f not in names:
                    raise ValueError(f"Replay read {self.read!r} names field {f!r}, not among the fields {sorted(names)}")
        if bulk not in (None, True, False):
            raise ValueError(f"Replay bulk must be None (auto), True or False, got {bulk!r}")
        self.bulk = bulk
        if remote_reads not in REMOTE_READS:
            raise ValueError(f"Replay remote_reads must be one of {list(REMOTE_READS)}, got {remote_reads!r}")
        self.remote_reads = remote_reads
        if not isinstance(memory, str) or not re.fullmatch(r"host|pinned|cuda(:\d+)?", memory):
            raise ValueError(f"Replay memory must be 'host', 'pinned', 'cuda' or 'cuda:N', got {memory!r}")
        if memory.startswith("cuda") and bulk:
            raise ValueError(f"Replay bulk=True needs host memory (shared segments), got memory={memory!r}")
        self.memory = memory
        self.sampler_config = sampler
        self.remover_config = remover
        self.limiter_config = rate_limiter if rate_limiter is not None else {"type": "MinSize", "min_size": 1}
        _make_selector("sampler", sampler)  # fail at build time, not in startup
        _make_selector("remover", remover)
        limiter = _make_limiter(self.limiter_config)
        # What the table would refuse in startup (or a run would find out late) is refused here.
        if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int)
                                     or not 1 <= max_size <= capacity):
            raise ValueError(f"Replay max_size must be None (the capacity) or an int in [1, capacity={capacity}], "
                             f"got {max_size!r}")
        most = capacity if max_size is None else max_size
        if limiter.min_size_to_sample > most:  # (it would park every sample for good)
            raise ValueError(f"Replay rate_limiter {self.limiter_config!r} waits for {limiter.min_size_to_sample} items "
                             f"before a sample, more than the {most} this shard holds (max_size, at most the "
                             f"capacity); lower its min_size or raise the capacity")
        if isinstance(max_times_sampled, bool) or not isinstance(max_times_sampled, int) or max_times_sampled < 0:
            raise ValueError(f"Replay max_times_sampled must be an int >= 0 (0: never), got {max_times_sampled!r}")
        if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"Replay beta must be a finite number >= 0, got {beta!r}")
        if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
            raise ValueError(f"Replay keep_checkpoints must be an int >= 1 (complete checkpoints kept), got "
                             f"{keep_checkpoints!r}")
        for what, flag in (("restore", restore), ("checkpoint_on_shutdown", checkpoint_on_shutdown)):
            if flag not in (True, False):  # (a string is truthy: restore="no" restored)
                raise ValueError(f"Replay {what} must be True or False, got {flag!r}")
        self.max_size = max_size
        self.max_times_sampled = max_times_sampled
        self.beta = float(beta)
        for what, period in (("checkpoint_period_s", checkpoint_period_s),
                             ("async_checkpoint_period_s", async_checkpoint_period_s),
                             ("statistics_period_s", statistics_period_s)):
            if period is not None and not (isinstance(period, (int, float)) and not isinstance(period, bool)
                                           and math.isfinite(period) and period > 0):
                raise ValueError(f"Replay {what} must be a number > 0 or None, got {period!r}")
        for what, period in (("checkpoint_period_s", checkpoint_period_s),
                             ("async_checkpoint_period_s", async_checkpoint_period_s)):
            if period is not None and run_dir is None:
                raise ValueError(f"Replay {what} needs run_dir (where checkpoints go)")
        if wal not in (True, False):
            raise ValueError(f"Replay wal must be True or False, got {wal!r}")
        if wal and run_dir is None:
            raise ValueError("Replay wal=True needs run_dir (where the log goes)")
        self.wal = wal
        self.run_dir = run_dir
        self.checkpoint_period_s = checkpoint_period_s
        self.async_checkpoint_period_s = async_checkpoint_period_s
        self.statistics_period_s = statistics_period_s
        self.keep_checkpoints = keep_checkpoints
        self.restore = restore
        self.checkpoint_on_shutdown = checkpoint_on_shutdown
        if writers is not None and (isinstance(writers, bool) or not isinstance(writers, int) or writers < 1):
            raise ValueError(f"Replay writers must be None or an int >= 1 (the writers feeding the bank), got {writers!r}")
        self.writers = writers
        self.table: Table | None = None

    # ---------------------------------------------------------------- startup

    @reaction(triggers=[startup], effects=[tick])
    async def open_table(self) -> None:
        self._owner: _bulk.BulkOwner | None = None
        self._versions: torch.Tensor | None = None
        self._shared: SharedArrays | None = None
        self._publisher: SamplingPublisher | None = None
        self._sampling: dict[str, Any] | None = None
        on_gpu = self.memory.startswith("cuda")
        check_memory(self.memory, f"Replay {self.name!r}")  # (a ValueError: reactor run prints it as one line)
        # The host memory it needs once full, claimed among this run's tables on this host before anything is
        # allocated (a shared-memory ring is reserved when made, and would count twice): the shards of a host
        # each fitted alone and together did not (the OOM killer, hours later). Given back at shutdown.
        self._memory_claim = claim_fits(None, self.capacity, ledger=None if self.run_id == "local" else self.run_id,
                                        step_nbytes=sum(s.step_nbytes for s in self.specs), on_host=not on_gpu)
        weakref.finalize(self, self._memory_claim.release)
        use_bulk = self.bulk if self.bulk is not None else (not self.reproducible and _bulk.capabilities().shm)
        # Writers of this host stage their rows in shared memory for a shard that says so in its acks
        # (reactor.nodes._staging): where the shard's own memory may be shared, by the same rule.
        self._ack_host = _bulk.host_id() if use_bulk and _bulk.capabilities().shm else ""
        self._unstageable = {}
        self._staged = StagedReader(self.run_id)
        use_bulk = use_bulk and not on_gpu and isinstance(self.read, (WindowRead, StepRead, TransitionRead))
        if use_bulk and self.bulk is None:
            # The ring, its versions and the sampling state in /dev/shm: a mapping larger than what is
            # free there faults when touched (SIGBUS), so a shard that does not fit keeps its memory.
            need = self.capacity * (sum(s.step_nbytes for s in self.specs) + 96)
            need += min(need, (len(self.specs) + 12) * HUGE_NBYTES)  # (large segments: whole 2 MiB pages)
            free = _shm_free_bytes()
            if free is not None and need > free:
                log.warning("%s: its storage (%d MB with the sampling state) does not fit in /dev/shm (%d MB free): "
                            "requesters sample through messages, with the data in the replies", self.name,
                            need >> 20, free >> 20)
                use_bulk = False
        seed = int(self.rng.integers(2**63 - 1))

        def make_table(storage: Storage) -> Table:
            # The table reads only the anchor steps (cheap); the shard applies the read kind itself,
            # or, for a requester that maps the storage, only plans the rows it will gather. Its
            # sampler's state goes in the shared arrays (self._shared) where there are some.
            self._sampler = _make_selector("sampler", self.sampler_config)
            return Table(
                storage,
                sampler=self._sampler,
                remover=_make_selector("remover", self.remover_config),
                rate_limiter=_make_limiter(self.limiter_config),
                max_size=self.max_size,
                max_times_sampled=self.max_times_sampled,
                read=StepRead(),
                beta=self.beta,
                seed=seed,
                name=self.name,
                arrays=self._shared,
                memory_claim=self._memory_claim,
            )

        storage = None
        if use_bulk:
            try:
                storage = await self._open_bulk_storage()
                self._staged.own = frozenset({self._region})  # (its sampling region's "-s-..." is no stage-...)
                self.table = make_table(storage)  # (its sampler's shared arrays are reserved here)
            except OSError as e:
                # /dev/shm filled up since the check above (the shards of a host start at once): the
                # ring's pages are reserved when it is made (reactor/transport/_shm.py, "Pages"), so
                # this is known now, not as a SIGBUS at a later insert.
                if e.errno != errno.ENOSPC or self.bulk is not None:
                    raise
                log.warning("%s: %s; requesters sample through messages, with the data in the replies",
                            self.name, e.strerror)
                if self._owner is not None:
                    await self._owner.aclose()
                self._owner = self._versions = self._shared = None
                storage = None
        if storage is None:
            storage = Storage(self.specs, self.capacity, device=self.memory if on_gpu else "cpu",
                              pin_memory=self.memory == "pinned")
            self.table = make_table(storage)
        self._parked_requests: deque[ReplayRequest] = deque()
        self._parked_steps: deque[Steps] = deque()
        self._said_full = False  # (_say_if_full_below_min_size)
        self._counts = {"rejected_steps": 0, "staged_steps": 0}
        self._ended_writers: set[int] = set()  # writers whose end marker this shard took (Steps.last)
        directory = Path(self.run_dir) / plain_name(self.name) if self.run_dir else None
        if directory is not None:
            refuse_file_links(directory)
            self._run_claim = claim_run_dir(self.run_dir, self.run_id, resume=self.restore,
                                           who=self.name, required=False)
        store = ShardStore(self.name, directory, keep=self.keep_checkpoints, period_s=self._checkpoint_period(),
                           wal=self.wal)
        self._started_ns = time.monotonic_ns()  # (async runs count the checkpoint period from here)
        # (A restarted shard starts from its latest checkpoint.) Kept only once open: a store whose open
        # failed (a run directory that cannot be written) is not checkpointed into at shutdown, which
        # failed again and logged a second traceback over the first.
        store.open(self.table, restore=self.restore or self.restarts > 0, restarts=self.restarts)
        self._store = store
        if self._versions is not None:  # restored rows are readable as written
            lo, hi = storage.step_range
            steps = np.arange(lo, hi, dtype=np.int64)
            _bulk.seqlock_end(self._versions, steps % storage.capacity, steps)
        self._remote_sampling: dict[str, Any] | None = None
        if self._shared is not None:
            self._publisher = SamplingPublisher(self.table, self._shared, read=self.read)
            self._sampling = {"table": self._publisher.descriptor(),
                              "region": self._owner.descriptor(self._sampling_region)}  # type: ignore[union-attr]
            if "zmq" in self._owner.backends or "rdma" in self._owner.backends:  # type: ignore[union-attr]
                self._serve_remote_samples()
        if self.statistics_period_s is not None:
            self._tick_s = self.statistics_period_s
            self._next_stats = self.statistics_period_s
            self._now_s = 0.0
            self.tick.schedule(delay_s=self._tick_s)

    def _checkpoint_period(self) -> float | None:
        """The period this run's mode counts (see ``async_checkpoint_period_s``)."""
        if self.deterministic or self.async_checkpoint_period_s is None:
            return self.checkpoint_period_s
        return self.async_checkpoint_period_s

    def restart_loses(self) -> str:
        if self.run_dir is None:
            return "its steps: with no run_dir it keeps no checkpoint, and starts again empty"
        if self.checkpoint_period_s is None and self.async_checkpoint_period_s is None and not self.wal:
            return ("its steps: with no checkpoint period (and no wal) it checkpoints only at the run's end, and "
                    "starts again empty; set a period (replay_async_checkpoint_period_s) or wal")
        return ""

    # ---------------------------------------------------------------- inserts

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Bracket a reaction that may change the table: requesters that sample one-sidedly never
        read the sampling state half-changed (its sequence count), and see the change once done."""
        pub = self._publisher
        if pub is None:
            yield
            return
        pub.begin()
        try:
            yield
        finally:
            self.table.rate_limiter.set_parked(len(self._parked_steps))  # type: ignore[union-attr]
            pub.end()

    @reaction(triggers=[steps], effects=[replies, acks])
    def insert_steps(self, steps: Steps) -> None:
        with self._changing():
            self._insert_steps(steps)

    def _insert_steps(self, steps: Steps) -> None:
        if not isinstance(steps, Steps):
            self._reject(steps, f"expected a Steps message, got {type(steps).__name__}")
            return
        if self._parked_steps:  # keep writers' order: nothing overtakes a parked insert
            self._parked_steps.append(steps)
            return
        if self._insert(steps):
            self._progress()
            self._checkpoint_if_due()
        else:  # (one that no sample could ever make room for was refused: RateLimiter.never_inserts, exact)
            self._parked_steps.append(steps)

    def _unstaged(self, steps: Steps) -> Steps | None:
        """A staged message with its rows: views of its writer's staging region, which the writer
        keeps until this shard's ack. None if they cannot be read: refused (logged), to be acknowledged
        as any malformed message. Called where the message is inserted, not where it arrives: a refusal
        acknowledged ahead of that writer's parked messages would free their rows (an ack frees what
        the messages before it hold). With a write-ahead log, a copy: the table and the log read them
        once (a writer writing its ring before the ack made the log's record fail its checksum, and a
        restore's redo stop there, losing every writer's later inserts)."""
        try:
            if not isinstance(steps.fields, Mapping) or steps.fields:
                raise ValueError("a staged message carries its rows in its writer's region, not in fields")
            assert self._staged is not None  # (made at startup, before the table)
            rows = self._staged.rows(steps.staged)
        except (ValueError, TypeError, KeyError, OSError, PeerLostError) as e:
            self._reject(steps, f"its staged rows cannot be read: {e}")
            self._cannot_stage(steps)
            return None
        if self._store.logs_inserts:
            rows = {n: t.clone() for n, t in rows.items()}
        return dataclasses.replace(steps, fields=rows, staged=None)

    def _cannot_stage(self, steps: Steps) -> None:
        """The staged rows of ``steps`` could not be read: its writer's acks from this shard say no host
        from now on (for that writer's life), which turns its ring for this shard off, and its next
        flushes bring their rows in their messages. A writer whose region this shard cannot map while
        the two count as one host (another PID namespace sharing /dev/shm: its owner looks dead from
        here; a region denied to this shard's user) would otherwise stage every flush, each refused: all
        its rows to this shard lost. At most the flushes in flight before that ack are."""
        writer, seq = steps.writer, steps.seq
        if type(writer) is not int or type(seq) is not int or not self._ack_host:
            return
        life = seq >> 32
        if self._unstageable.get(writer) == life:
            return
        if len(self._unstageable) >= _MAX_UNSTAGEABLE:  # (writer ids come from peers: bounded)
            del self._unstageable[next(iter(self._unstageable))]
        self._unstageable[writer] = life
        log.warning("%s: writer %d's staged rows cannot be read here; its acks from this shard tell it to send its "
                    "rows in its messages from now on", self.name, writer)

    def _reject(self, steps: Any, why: str) -> None:
        n = 0
        fields = getattr(steps, "fields", None)
        staged = getattr(steps, "staged", None)
        if isinstance(fields, Mapping) and fields:
            first = next(iter(fields.values()))
            n = int(getattr(first, "shape", (0,))[0] if getattr(first, "shape", ()) else 0)
        elif staged is not None and isinstance(getattr(steps, "episode_end", None), np.ndarray):
            n = len(steps.episode_end) if steps.episode_end.ndim == 1 else 0  # (its rows, staged where they are)
        self._counts["rejected_steps"] += n
        log.error(  # (the reason may quote what the writer sent: cut, and the writer's id and flush too)
            "%s refused steps from writer %.40r (flush %.40r): %.500s; the message was dropped, the shard keeps serving",
            self.name, getattr(steps, "writer", "?"), getattr(steps, "seq", "?"), why,
        )

    def _insert(self, steps: Steps) -> bool:
        """Insert a Steps message; False if the rate limiter holds it back (then nothing changed).

        When the message is done with (inserted, or refused as malformed), its writer gets an
        :class:`InsertAck` if it asked (:attr:`Steps.ack`)."""
        if not self._try_insert(steps):
            return False
        self._ack(steps)
        return True

    def _ack(self, steps: Steps) -> None:
        if steps.ack is False:  # (a later message's ack covers it: a shard takes a writer's messages in order)
            return
        if isinstance(steps.writer, int) and not isinstance(steps.writer, bool) and steps.writer >= 0:
            host = self._ack_host
            if host and type(steps.seq) is int and self._unstageable.get(steps.writer) == steps.seq >> 32:
                host = ""  # (this shard cannot read its staged rows: _cannot_stage)
            self.acks.send(InsertAck(steps.writer, self.bank_index, steps.seq if isinstance(steps.seq, int) else -1,
                                     host, os.getpid() if host else 0))

    def _try_insert(self, steps: Steps) -> bool:
        assert self.table is not None
        if steps.shard != self.bank_index:
            self._reject(steps, f"it names shard {steps.shard}, but this is shard {self.bank_index} (a routing bug)")
            return True
        last = steps.last
        if isinstance(last, np.bool_):
            last = bool(last)
        if last is not False:
            self._writer_ended(steps, last)
            return True
        staged = steps.staged is not None
        if staged:
            got = self._unstaged(steps)
            if got is None:
                return True
            steps = got
        try:
            ends = np.asarray(steps.episode_end)
            if ends.dtype != np.bool_ or ends.ndim != 1 or len(ends) == 0 or not bool(ends[-1]):
                raise ValueError(
                    "episode_end must be a non-empty bool [L] array whose last entry is True (a shard interleaves "
                    f"writers, so episodes may not stay open between messages); got {ends.dtype} {ends.shape}"
                    + (f" ending in {bool(ends[-1])}" if ends.ndim == 1 and len(ends) else "")
                )
            first = self.table.storage.step_range[1]
            self._insert_versioned(steps, ends)
        except WouldBlock:
            return False
        except (KeyError, TypeError, ValueError) as e:
            self._reject(steps, str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e))
            return True
        if type(steps.writer) is int:
            self._ended_writers.discard(steps.writer)  # rows after its end marker: its actor was restarted
        if not self._said_full and len(self.table) < self.table.rate_limiter.min_size_to_sample:
            self._say_if_full_below_min_size()
        self._store.inserted(first, self.table.storage.step_range[1], steps.fields, steps.priorities, ends,
                             steps.item_mask)
        if staged:
            self._counts["staged_steps"] += len(ends)
        return True

    def _say_if_full_below_min_size(self) -> None:
        """A ring that evicts while the table holds fewer items than sampling needs never serves a sample
        (steps that are not items, an episode's last observation, a window's context, take room too):
        the run trained nothing and ended 0 updates later with exit 0. Said once."""
        table = self.table
        assert table is not None
        if table.storage.step_range[1] <= table.storage.capacity:  # (past it, the ring has evicted)
            return
        self._said_full = True
        if table.rate_limiter.statistics().samples:  # (it has served: fewer items now is deletes or expiry)
            return
        log.warning("%s: its ring of %d steps is full and evicting at %d items, below the %d its rate limiter needs "
                    "before any sample (steps that are no item, such as each episode's last observation, take room "
                    "too): it may never serve one; lower min_size or raise capacity", self.name,
                    table.storage.capacity, len(table), table.rate_limiter.min_size_to_sample)

    def _writer_ended(self, steps: Steps, last: Any) -> None:
        """Take a writer's end marker (:attr:`Steps.last`); a malformed one is refused and logged."""
        w, fields, ends = steps.writer, steps.fields, steps.episode_end
        if last is not True:
            self._reject(steps, f"Steps.last must be True or False, got {last!r}")
        elif not (isinstance(fields, Mapping) and not fields and (
                (isinstance(ends, np.ndarray) and ends.size == 0) or (isinstance(ends, (list, tuple)) and not ends))):
            self._reject(steps, f"an end marker (Steps.last) carries no rows: fields {{}} and an empty episode_end; "
                                f"got fields of type {type(fields).__name__} and episode_end {type(ends).__name__} "
                                f"{getattr(ends, 'shape', '')}")
        elif self.writers is None:
            log.info("%s: writer %s ended (this shard does not count its bank's writers: Replay(writers=None))",
                     self.name, w)
        elif type(w) is not int or not 0 <= w < self.writers:
            self._reject(steps, f"an end marker from writer {w!r}, not a writer id in [0, {self.writers}) "
                                f"(Replay(writers={self.writers}))")
        else:
            self._ended_writers.add(w)
            if len(self._ended_writers) == self.writers:
                log.info("%s: all %d writers ended; requests its rate limiter holds are answered Exhausted",
                         self.name, self.writers)

    def _exhausted(self) -> bool:
        """No insert can come any more: every writer ended, none of their inserts is parked."""
        return self.writers is not None and len(self._ended_writers) == self.writers and not self._parked_steps

    def _insert_versioned(self, steps: Steps, ends: np.ndarray) -> None:
        """Insert; with shared-memory readers, under the rows' sequence lock (version = global step)."""
        table = self.table
        assert table is not None
        versions = self._versions
        cap = table.storage.capacity
        if versions is None or len(ends) > cap:  # (too long: the insert raises before writing)
            table.insert_nowait(steps.fields, steps.priorities, episode_end=ends, item_mask=steps.item_mask)
            return
        first, n = table.storage.step_range[1], len(ends)
        old = _bulk.seqlock_begin_steps(versions, first, n)
        try:
            table.insert_nowait(steps.fields, steps.priorities, episode_end=ends, item_mask=steps.item_mask)
        except BaseException:
            keep = old >= 0  # nothing was written: put the old versions back
            _bulk.seqlock_end(versions, (np.arange(first, first + n, dtype=np.int64) % cap)[keep], old[keep])
            raise
        _bulk.seqlock_end_steps(versions, first, n)

    # ---------------------------------------------------------------- requests

    @reaction(triggers=[requests], effects=[replies, acks])
    def serve_request(self, requests: ReplayRequest) -> None:
        who = (getattr(requests, "requester", None), getattr(requests, "request", None))
        if not all(type(x) is int for x in who):  # (a reply could not be routed back, nor matched)
            log.error("%s dropped a %s whose requester and request are not ints: %r", self.name,
                      type(requests).__name__, who)
            return
        with self._changing():
            if not self._serve(requests):
                self._parked_requests.append(requests)
                if self._parked_steps:  # one-sided readers' takes may have made room for them since
                    self._progress()  # they parked, and their notices may be held (a replica in its round)
        self._checkpoint_if_due()

    def _serve(self, req: ReplayRequest) -> bool:
        """Answer ``req`` now if the rate limiter allows; False to park it."""
        table = self.table
        assert table is not None
        if req.shard != self.bank_index:
            self._refuse(req, f"it names shard {req.shard}, but this is shard {self.bank_index} (a routing bug)")
            return True
        limiter = table.rate_limiter
        if isinstance(req, MassRequest):
            if not limiter.can_sample(1, len(table)):
                return self._held_for_good(req)
            self._send_figures(req)
            return True
        if isinstance(req, SampleRequest):
            n = req.n
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                self._refuse(req, f"SampleRequest.n must be an int >= 0, got {n!r}")
                return True
            if n == 0:  # a one-round sample that drew no item here: just the current figures, now
                self._send_figures(req)
                return True
            try:
                table.check_sample_size(n)
            except ValueError as e:
                self._refuse(req, f"SampleRequest: {e}")
                return True
            if not limiter.can_sample(n, len(table)):
                return self._held_for_good(req)
            mass, min_mass = _sampler_mass(self._sampler)
            size = len(table)
            if not mass > 0:  # every priority is 0: nothing to draw; the figures tell the client so
                self._send_figures(req)
                return True
            reads_us = self._owner is not None and (
                req.host == self._host_id or (req.remote in ("rdma", "zmq") and req.remote in self._owner.backends))
            # Transitions travel as data (the shard sums the returns); their rows are offered for
            # one-sided draws all the same, which copy the windows and sum the returns themselves.
            bulk = reads_us and not isinstance(self.read, TransitionRead)
            # The anchor steps are the items only for StepRead; the other reads and the bulk plan
            # start from the keys alone.
            try:
                anchors, info = table.sample_nowait(n, read=not bulk and isinstance(self.read, StepRead))
            except WouldBlock:  # one-sided readers took the limiter's last samples since the check
                return self._held_for_good(req)
            keys = info.keys.numpy()
            common = {
                "keys": make_keys(self.bank_index, keys),
                "probabilities": info.probabilities.numpy(),
                "times_sampled": info.times_sampled.numpy(),
                "mass": mass, "min_mass": min_mass, "size": size, "beta": self.beta,
            }
            desc = sampling = None
            if reads_us and req.generation != self._owner.generation:  # (the offer: once per generation)
                desc = self._descriptor
                sampling = self._sampling if req.host == self._host_id else self._remote_sampling
            if not bulk and sampling is None:
                desc = None  # (data in the reply, and nothing to draw one-sidedly: no region to map)
            # Transitions with an offer: the data here, the rows offered for one-sided draws.
            data, plan = (None, self._bulk_plan(keys)) if bulk else (self._read_items(keys, anchors), {})
            self.replies.send(ShardSample(self.bank_index, req.requester, req.request, "", data, descriptor=desc,
                                          sampling=sampling, **plan, **common))
            self._progress_inserts()
            return True
        self._refuse(req, f"unknown request type {type(req).__name__}")
        return True

    def _held_for_good(self, req: ReplayRequest) -> bool:
        """The rate limiter holds ``req``: answered :class:`Exhausted` (True) when no insert can
        come any more, else False (parked)."""
        if not self._exhausted():
            return False
        self.replies.send(Exhausted(self.bank_index, req.requester, req.request))
        return True

    def _send_figures(self, req: ReplayRequest) -> None:
        """Answer ``req`` with this shard's mass, minimum, size and beta (:class:`ShardMass`)."""
        mass, min_mass = _sampler_mass(self._sampler)
        self.replies.send(ShardMass(self.bank_index, req.requester, req.request, "", mass, min_mass,
                                    len(self.table), self.beta))  # type: ignore[arg-type]

    def _read_items(self, keys: np.ndarray, anchors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the read kind returns for ``keys`` (the anchor steps are already read), on the host."""
        st, r = self.table.storage, self.read  # type: ignore[union-attr]
        if isinstance(r, StepRead):
            out = anchors
        elif isinstance(r, WindowRead):
            out = st.read_windows(keys, r.length, r.pad)
        elif isinstance(r, TransitionRead):
            out = st.read_transitions(keys, n=r.n, gamma=r.gamma, reward_field=r.reward_field,
                                      next_fields=r.next_fields)
        else:
            out = st.read_episodes(st.episode_bounds(keys)[0])
        if st.device.type != "cpu":  # gathered on the GPU; messages carry host tensors
            out = _to_pinned_host(out)
        return out

    def _bulk_plan(self, keys: np.ndarray) -> dict[str, Any]:
        """What a reader on this host needs to gather ``keys`` itself: window spans (WindowRead), or
        the steps' ring slots and the version (global step) each must hold (StepRead)."""
        st = self.table.storage  # type: ignore[union-attr]
        if isinstance(self.read, WindowRead):
            return {"windows": st.window_spans(keys, self.read.length, self.read.pad),
                    "window_length": self.read.length}
        return {"rows": keys % st.capacity, "versions": keys.copy()}  # a StepRead key is its global step

    def _refuse(self, req: Any, why: str) -> None:
        log.error("%s refused %s from requester %s: %s", self.name, type(req).__name__, getattr(req, "requester", "?"), why)
        reply_cls = ShardMass if isinstance(req, MassRequest) else ShardSample
        self.replies.send(reply_cls(self.bank_index, int(getattr(req, "requester", 0)), int(getattr(req, "request", -1)),
                                    f"{self.name}: {why}"))

    def _progress_inserts(self) -> None:
        while self._parked_steps and self._insert(self._parked_steps[0]):
            self._parked_steps.popleft()

    def _progress(self) -> None:
        """Serve parked work until nothing more can proceed (each pass follows a table change)."""
        while True:
            before = (len(self._parked_steps), len(self._parked_requests))
            self._progress_inserts()
            if self._parked_requests:
                waiting, self._parked_requests = self._parked_requests, deque()
                for req in waiting:
                    if not self._serve(req):
                        self._parked_requests.append(req)
            if (len(self._parked_steps), len(self._parked_requests)) == before:
                return

    # ---------------------------------------------------------------- updates

    @reaction(triggers=[updates], effects=[replies, acks])
    def update_items(self, updates: ItemUpdate) -> None:
        if isinstance(updates, SampledKeys):  # times sampled (a draw reports them, atomic words) and counters
            self._update_items(updates)
        else:
            with self._changing():
                self._update_items(updates)
        self._checkpoint_if_due()

    def _update_items(self, updates: ItemUpdate) -> None:
        table = self.table
        assert table is not None
        try:
            if updates.shard != self.bank_index:
                raise ValueError(f"it names shard {updates.shard}, but this is shard {self.bank_index}")
            keys = _int64_keys(updates.keys)
            shards = keys >> KEY_SHARD_BITS
            if len(keys) and (shards != self.bank_index).any():
                bad = int(shards[np.argmax(shards != self.bank_index)])
                raise ValueError(f"a key of shard {bad} was sent to shard {self.bank_index}; route by key_shard(keys)")
            local = keys & _LOCAL_MASK
            known = _known(table, local)
            if isinstance(updates, PriorityUpdate):
                p = updates.priorities
                if isinstance(p, torch.Tensor):
                    p = p.detach().cpu().numpy()
                p = np.asarray(p, dtype=np.float64)
                if p.shape != keys.shape:
                    raise ValueError(f"priorities have shape {p.shape}, keys {keys.shape}")
                table.update_priorities(local[known], p[known])
            elif isinstance(updates, Delete):
                if known.any():
                    table.delete(np.unique(local[known]))
                self._progress()
            elif isinstance(updates, SampledKeys):
                table.note_sampled(local)
                if self._parked_steps or self._parked_requests:  # (never with MinSize; bracketed anyway)
                    with self._changing():
                        self._progress()
            else:
                raise TypeError(f"unknown update type {type(updates).__name__}")
        except (KeyError, TypeError, ValueError) as e:
            log.error("%s refused %s: %s; nothing was changed", self.name, type(updates).__name__, e)

    # ---------------------------------------------------------------- control, checkpoints, statistics

    @reaction(triggers=[control], effects=[statistics])
    def on_control(self, control: ReplayControl) -> None:
        if control.shard not in (-1, self.bank_index):
            return
        if isinstance(control, CheckpointRequest):
            self.checkpoint()
        elif isinstance(control, StatisticsRequest):
            self.statistics.send(self.shard_statistics())

    @reaction(triggers=[tick], effects=[statistics, tick])
    def periodic(self) -> None:
        self._now_s += self._tick_s
        eps = 1e-9
        if self._now_s + eps >= self._next_stats:
            self._next_stats += self.statistics_period_s
            self.statistics.send(self.shard_statistics())
        self.tick.schedule(delay_s=self._tick_s)

    def _checkpoint_if_due(self) -> None:
        assert self.table is not None
        self._store.checkpoint_if_due(self.table, self._period_clock_ns())

    def _period_clock_ns(self) -> int:
        """The clock ``checkpoint_period_s`` counts, in ns: the logical time in deterministic runs; in
        async runs the wall clock since the shard started (a shard's tag there is its latest sender's,
        which need not advance: the module docstring, "Checkpoints"). Not the run's schedule either way:
        a checkpoint changes no state a sample or a reply reads."""
        if self.deterministic:
            return self.tag.time_ns
        return time.monotonic_ns() - self._started_ns

    def checkpoint(self, *, only_if_changed: bool = False) -> concurrent.futures.Future[Path] | None:
        """Start a background checkpoint now; None if one is still being written, if there is no
        run_dir, or (``only_if_changed``) if the table has not changed since the newest checkpoint.

        The snapshot is taken before this returns (short, under the table lock); the files are
        written by a thread, atomically (see ``reactor.replay.checkpoint``). With a write-ahead log,
        appends go to a new segment from the snapshot on; older segments are dropped once every
        kept checkpoint holds them.
        """
        if self.table is None:
            return None
        return self._store.checkpoint(self.table, only_if_changed=only_if_changed)

    def shard_statistics(self) -> ShardStatistics:
        """The shard's :class:`ShardStatistics` now."""
        assert self.table is not None
        self._store.collect()
        st = self.table.statistics()
        return ShardStatistics(
            shard=self.bank_index,
            size=st.size,
            num_steps=st.num_steps,
            num_episodes=st.num_episodes,
            inserted=st.inserted,
            sampled=st.sampled,
            evicted=st.evicted,
            removed=st.removed,
            expired=st.expired,
            deleted=st.deleted,
            rejected_steps=self._counts["rejected_steps"],
            parked_requests=len(self._parked_requests),
            parked_steps=sum(_steps_len(s) for s in self._parked_steps),
            checkpoints=self._store.checkpoints,
            restored_from=self._store.restored_from,
            lost_steps=self._store.lost_steps,
            staged_steps=self._counts["staged_steps"],
        )

    @reaction(triggers=[shutdown])
    async def close(self) -> None:
        try:
            await self._close()
        finally:
            release_run_dir(self)
            claim = getattr(self, "_memory_claim", None)
            if claim is not None:
                claim.release()

    async def _close(self) -> None:
        if self._staged is not None:
            self._staged.close()
        if self.table is None:
            return
        owner, self._owner = self._owner, None
        store = getattr(self, "_store", None)  # (none when its start failed: refuse_file_links, an open)
        if store is not None:
            store.close(self.table, final=self.checkpoint_on_shutdown)
        if self._parked_steps:  # (an end of run: the writers have stopped, the steps were never acknowledged)
            log.info("%s: %d Steps messages (%d steps) the rate limiter still held back when the run ended were "
                     "not inserted", self.name, len(self._parked_steps), sum(_steps_len(s) for s in self._parked_steps))
        if owner is not None:
            await owner.aclose()  # unlinks the shared-memory segments


def _steps_len(s: Steps) -> int:
    try:
        return len(s.episode_end)
    except TypeError:
        return 0


def _shm_free_bytes() -> int | None:
    """Bytes free for unprivileged use in /dev/shm, or None if that cannot be read."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
