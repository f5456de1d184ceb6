"""A learner's view of N replay shards as one table: :class:`ReplayClient` (the shard-tagged keys,
from :mod:`reactor.nodes._shardkeys`, are public here too).

The protocol (exact two-stage sampling over the shards, one round from cached masses, gathers from
shared memory or one-sided reads of other hosts' shards) is described in :mod:`reactor.nodes.replay`;
the one-sided sampling (no message on the sampling path) in :mod:`reactor.nodes._onesided`, the
client's mixin, and :mod:`reactor.replay.shared`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._errors import PeerLostError
from .._floodlog import FloodCounts, flood_logged, flood_tally
from .._native import host_empty
from ..replay import expand_window_spans
from ..replay.shared import importance_weights, least_probability
from ..replay.table import _PHYSICAL_MEMORY
from ..transport import _gather as _gatherk
from ..transport import bulk as _bulk
from ._onesided import (  # (the one-sided sampling: ReplayClient's mixin; its names public here)
    NOTICE_MAX_AGE_S,
    ONE_SIDED_ERRORS,
    REMOTE_SAMPLE_OP,
    OneSidedSampling,
    _Plan,
    _SharedShard,
)
from ._onesided_remote import _RemoteDraw, _RemoteShard
from ._replycheck import _bulk_part, _data_layout, _describe, _reply_problem, _what
from ._shardkeys import KEY_SHARD_BITS, _int64_keys, key_local, key_shard, make_keys
from .messages import (
    Delete,
    Exhausted,
    MassRequest,
    PriorityUpdate,
    ReplayReply,
    ReplayRequest,
    SampledBatch,
    SampleRequest,
    ShardMass,
    ShardSample,
)

__all__ = ["KEY_SHARD_BITS", "NOTICE_MAX_AGE_S", "ONE_SIDED_ERRORS", "REMOTE_READS", "REMOTE_SAMPLE_OP", "ReplayClient",
           "key_local", "key_shard", "make_keys"]

log = logging.getLogger("reactor.replay")

#: The ``remote_reads`` settings of :class:`~reactor.nodes.replay.Replay` and :class:`ReplayClient`.
REMOTE_READS = ("auto", "zmq", "off")


#: A shard whose replies are malformed this many times in a row is taken for lost (its samples were
#: drawn again for ever: a learner that got no batch, spinning, with one line in a thousand logged).
MALFORMED_IN_A_ROW = 1000


@dataclass
class _Sample:
    """One batch being assembled from several shards."""

    n: int
    stage: int  # 1: waiting for masses, 2: waiting for items
    want: int  # items the next stage 2 draws
    masses: dict[int, ShardMass] = field(default_factory=dict)
    parts: list[ShardSample] = field(default_factory=list)
    outstanding: dict[int, tuple[int, int]] = field(default_factory=dict)  # wire id -> (shard, items asked)
    total: float = 0.0
    size: int = 0
    min_mass: float = math.inf
    beta: float = 0.0
    deadline: float = math.inf
    shares: dict[int, float] | None = None  # one-round sample: each shard's share of the counts
    empty: bool = False  # a shard asked for items had none to draw (zero mass): start again
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None  # its parts' fields (all alike)


class ReplayClient(OneSidedSampling):
    """A learner's view of N replay shards as one table (pure logic: it never sends anything itself).

    The owner (a learner reactor) sends the messages its methods return on ports connected to the
    shards' ``requests``/``updates`` with ``key=shard_key``, and feeds every reply it receives from
    their ``replies`` (connected back with ``key=requester_key``) to :meth:`receive`.

    Semantics: two-stage sampling (module docstring); several samples may be in flight; batches
    come out in the order their last reply arrives; items of a batch are grouped by shard.

    ``masses="cached"`` (default) makes a sample one round of messages instead of two: the counts are
    drawn from the masses, sizes and minima the shards reported in their latest replies (every reply
    carries them, and every live shard gets a request per sample, ``n=0`` if it drew nothing), so
    only the first sample asks for masses first. Each item's reported probability is the one it was
    actually drawn with, ``P(i) = (C_s / C) * q_i`` (``C_s``: the cached mass its count was drawn
    from; ``q_i``: its probability within the shard now), and the importance weights use those
    probabilities, so they stay exact while priorities change between samples. On data that did not
    change since the last reply this is the single-table distribution. ``masses="fresh"`` asks every
    shard for its mass before each sample (the counts then follow the masses of that moment).
    A shard that has not answered a request within ``timeout_s`` (checked by :meth:`check_timeouts`,
    which the owner calls from a timer, and by :meth:`receive`) raises :class:`PeerLostError`; with
    ``skip_lost_shards=True`` the shard is dropped instead and sampling continues from the live
    shards: the lost shard's share of a batch in flight is redrawn from the others in proportion to
    their masses, which keeps the batch exact over the live shards.
    A shard that answers :class:`~reactor.nodes.messages.Exhausted` (no insert can come, and its
    rate limiter holds the request for good) ends the data: every sample in flight is dropped and
    ``exhausted`` is True from then on.
    A malformed reply (figures that are not finite, probabilities outside (0, 1], more items than
    asked for or arrays of other lengths or dtypes, a plan of rows outside its shard's region or
    windows longer than its earlier ones, a region that cannot be mapped) is dropped and logged
    (the first 20 per shard in full, then one in 1,000: :mod:`reactor._floodlog`), counted in
    ``malformed_replies``, and its sample is drawn again, as when a shard is lost: a peer's
    message never ends the learner. A shard whose region cannot be mapped answers with data from then on.

    Args:
        num_shards: the replay bank's size.
        requester: the owner's bank index (replies are routed back by it).
        rng: numpy Generator for the per-shard counts (use the reactor's ``self.rng``: deterministic).
        beta: importance-weight exponent; None: the shards' own ``beta``.
        timeout_s: how long a shard may take to answer (None: forever). A shard parks a request
            while its rate limiter blocks (e.g. below min size): keep this above that wait.
        skip_lost_shards: continue without a shard that timed out, instead of raising.
        clock: time source for timeouts (seconds).
        masses: ``"cached"`` (one round per sample) or ``"fresh"`` (two rounds), see above.
        bulk: offer to gather rows from shards on this host through shared memory (they decide;
            see ``Replay(bulk=...)``). Items whose rows the ring overwrote before the gather are
            dropped from the batch (counted in ``dropped_items``), never returned torn;
            ``gathered_items`` counts the items read that way.
        remote_reads: how rows of shards on *other* hosts arrive. ``"off"`` (default): inside the
            replies. ``"auto"`` (what the ``Learner`` uses): by RDMA READs when an RDMA device works
            here and the shard offers it (see ``Replay(remote_reads=...)``), else inside the
            replies. ``"zmq"``: from the shards' bulk zmq read servers (shards started with
            ``remote_reads="zmq"``). One-sided reads wait on the network: a client that may do
            them is driven with ``await areceive(reply)`` (``receive`` refuses). A shard whose
            one-sided region cannot be attached from here (e.g. RDMA devices on fabrics that do
            not meet) answers this client with data from then on.
        curve: the run's CURVE key pair (``self.process_link.curve`` in a reactor), for shards whose
            read servers require it.
        one_sided: sample shards on this host one-sidedly when they offer it (:meth:`sample_now`).
        notice_every: one-sided samples whose notices (:class:`SampledKeys`) are held and sent
            together, one message per shard: while its owner samples one-sidedly the shards' times
            sampled lag by at most this many samples, fewer once the oldest held notice is
            :data:`NOTICE_MAX_AGE_S` old at a sample (1: a notice per sample). The notices feed the
            shards' bookkeeping only (times sampled, statistics; the rate limiter's count is taken at
            the draw, and a shard holding inserts back hears at once), and each wakes every shard, so
            the default holds many: 64. An owner that stops sampling one-sidedly sends :meth:`take_notices`.
        draw_threads: threads that run one-sided draws ahead (:meth:`draw_ahead`), made at the first;
            None: one less than the cores, at least 1 and at most 2 (the taker draws too: :meth:`next_drawn`).

    Example:
        >>> client = ReplayClient(2, requester=self.bank_index, rng=self.rng)
        >>> for m in client.request(256): self.requests.send(m)
        >>> # in the reaction on replies:
        >>> msgs, batch = client.receive(reply)
    """

    def __init__(
        self,
        num_shards: int,
        *,
        requester: int = 0,
        rng: np.random.Generator | None = None,
        beta: float | None = None,
        timeout_s: float | None = 60.0,
        skip_lost_shards: bool = False,
        clock: Callable[[], float] = time.monotonic,
        bulk: bool = True,
        masses: str = "cached",
        remote_reads: str = "off",
        curve: Any = None,
        one_sided: bool = True,
        notice_every: int = 64,
        draw_threads: int | None = None,
    ) -> None:
        if masses not in ("cached", "fresh"):
            raise ValueError(f"ReplayClient masses must be 'cached' or 'fresh', got {masses!r}")
        if remote_reads not in REMOTE_READS:
            raise ValueError(f"ReplayClient remote_reads must be one of {list(REMOTE_READS)}, got {remote_reads!r}")
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"ReplayClient num_shards must be an int >= 1, got {num_shards!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"ReplayClient timeout_s must be > 0 or None, got {timeout_s!r}")
        if isinstance(notice_every, bool) or not isinstance(notice_every, int) or notice_every < 1:
            raise ValueError(f"ReplayClient notice_every must be an int >= 1, got {notice_every!r}")
        if draw_threads is not None and (isinstance(draw_threads, bool) or not isinstance(draw_threads, int)
                                         or draw_threads < 1):
            raise ValueError(f"ReplayClient draw_threads must be an int >= 1 or None, got {draw_threads!r}")
        self.num_shards = num_shards
        self.requester = requester
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.beta = beta
        self.timeout_s = timeout_s
        self.skip_lost_shards = skip_lost_shards
        self.clock = clock
        self.lost: dict[int, str] = {}
        self.exhausted = False  # a shard answered Exhausted: no sample can come any more
        self.masses = masses
        self._figures: dict[int, ReplayReply] = {}  # shard -> its latest ShardMass or ShardSample
        self._next_id = 0
        self._samples: dict[int, _Sample] = {}  # wire request id -> the sample it belongs to
        self._host = _bulk.host_id() if bulk and _bulk.capabilities().shm else ""
        # The one-sided backend asked of shards on other hosts ("": data in the replies).
        self._remote = {"zmq": "zmq", "off": ""}.get(remote_reads, "rdma" if _bulk.capabilities().rdma else "")
        self._curve = curve
        self._inline: set[int] = set()  # shards whose one-sided region could not be attached from here
        self._reader: _bulk.BulkReader | None = None
        self._regions: dict[int, tuple[str, int]] = {}  # shard -> (attached region, generation)
        self._layouts: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}  # region -> fields
        self._capacity: dict[str, int] = {}  # region -> rows
        self._versions_field: dict[str, str | None] = {}  # region -> its version column
        # region -> the window length of its first plan: a later plan may not ask for longer windows
        # (the batch is allocated from it: a reply must not make it larger than the request implies)
        self._window_length: dict[str, int] = {}
        self.malformed_replies = 0  # replies dropped as malformed (their samples drawn again)
        self._malformed_in_a_row: dict[int, int] = {}  # shard -> its malformed replies since its last good one
        self._drops_logged = FloodCounts()  # per shard: the drops logged (_flood_log)
        self.dropped_items = 0
        self.gathered_items = 0
        self.one_sided = bool(one_sided)
        self._shared: dict[int, _SharedShard] = {}  # shard -> its published sampling state, mapped
        self._remote_shared: dict[int, _RemoteShard] = {}  # shard of another host -> its sampling op
        self.one_sided_samples = 0  # batches drawn by sample_now
        self.one_sided_retries = 0  # draws started again because a shard changed under them
        self.notice_every = notice_every
        self._held: dict[int, list[np.ndarray]] = {}  # shard -> keys drawn one-sidedly, not yet told
        self._held_samples = 0  # samples whose notices are held
        self._held_since = 0.0  # perf_counter of the oldest of them
        self._group: _Plan | None = None  # see _plan_of
        self._lock = threading.RLock()  # the held notices and the counters, which draws ahead share
        self.draw_threads = draw_threads or max(1, min(2, (os.cpu_count() or 1) - 1))
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # draw_ahead's threads, made at first use
        self._ahead: deque[concurrent.futures.Future] = deque()  # draws ahead not taken, oldest first
        self._running: set[concurrent.futures.Future] = set()  # draws ahead not done, taken or not
        self._remote_ahead: deque[_RemoteDraw] = deque()  # draws from shards of other hosts, requests out
        self.ahead_samples = 0  # batches of draws ahead taken (next_drawn, drain_drawn)
        self.taker_samples = 0  # of those, drawn by their taker itself (not started yet when taken)

    @property
    def live_shards(self) -> list[int]:
        """Shards not given up on."""
        return [s for s in range(self.num_shards) if s not in self.lost]

    @property
    def in_flight(self) -> int:
        """Samples requested and not yet delivered."""
        return len({id(s) for s in self._samples.values()})

    def request(self, n: int) -> list[ReplayRequest]:
        """Start a sample of ``n`` items; returns the messages to send.

        Raises:
            ValueError: ``n < 1``.
            PeerLostError: every shard was lost.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"sample size n must be an int >= 1, got {n!r}")
        return self._begin(int(n), self._require_live())

    def _begin(self, n: int, live: list[int]) -> list[ReplayRequest]:
        """A new sample of ``n`` over the ``live`` shards: one shard's own draw, one round from
        cached masses, or a mass round first."""
        s = _Sample(n, stage=1, want=n)
        if self.num_shards == 1:  # one shard: its own draw is the exact one
            s.stage = 2
            s.deadline = self._deadline()
            return [self._ask(s, 0, n)]
        if self.masses == "cached" and all(k in self._figures for k in live):
            return self._one_round(s, live)
        return self._ask_masses(s, live)

    def _one_round(self, s: _Sample, live: list[int]) -> list[ReplayRequest]:
        """Counts from the shards' latest reported masses; every live shard gets a request (maybe n=0)."""
        figs = [self._figures[k] for k in live]
        masses = np.array([f.mass for f in figs], dtype=np.float64)  # type: ignore[attr-defined]
        sizes = np.array([f.size for f in figs], dtype=np.float64)  # type: ignore[attr-defined]
        share = masses if masses.sum() > 0 else sizes
        if not share.sum() > 0:  # nothing anywhere as far as we know: ask for fresh masses (they park)
            return self._ask_masses(s, live)
        share = share / share.sum()
        counts = self.rng.multinomial(s.want, share)
        s.stage = 2
        s.shares = dict(zip(live, share.tolist()))
        s.deadline = self._deadline()
        return [self._ask(s, k, int(c)) for k, c in zip(live, counts)]

    def _deadline(self) -> float:
        return math.inf if self.timeout_s is None else self.clock() + self.timeout_s

    def _ask(self, s: _Sample, shard: int, n: int) -> ReplayRequest:
        self._next_id += 1
        rid = self._next_id
        s.outstanding[rid] = (shard, n)
        self._samples[rid] = s
        if s.stage == 1:
            return MassRequest(shard, self.requester, rid)
        inline = shard in self._inline  # (its region could not be mapped: asked for data)
        return SampleRequest(shard, self.requester, rid, n, "" if inline else self._host,
                             self._regions.get(shard, ("", 0))[1], "" if inline else self._remote)

    def _ask_masses(self, s: _Sample, shards: list[int]) -> list[ReplayRequest]:
        s.stage = 1
        s.deadline = self._deadline()
        return [self._ask(s, k, 0) for k in shards]

    def _require_live(self) -> list[int]:
        live = self.live_shards
        if not live:
            raise PeerLostError(f"every replay shard was lost: {self.lost}")
        return live

    def receive(self, reply: ReplayReply) -> tuple[list[ReplayRequest], SampledBatch | None]:
        """Take one reply; returns (messages to send, a finished batch or None).

        Replies to unknown requests (e.g. from a shard given up on) are ignored. Gathers from
        shards on this host (shared memory) run here, without waiting.

        Raises:
            RuntimeError: the shard refused the request (its ``error`` text); the sample is dropped.
                Or this client may read other hosts' shards one-sidedly (``remote_reads``): use
                :meth:`areceive`.
            PeerLostError: another shard has timed out (see :meth:`check_timeouts`).
        """
        if self._remote:
            raise RuntimeError(
                f"ReplayClient.receive: this client reads shards of other hosts over {self._remote!r}, which "
                f"waits on the network; call `await client.areceive(reply)` from an async reaction, or pass "
                f"remote_reads='off'"
            )
        return _run_now(self.areceive(reply))

    async def areceive(self, reply: ReplayReply) -> tuple[list[ReplayRequest], SampledBatch | None]:
        """:meth:`receive` for clients that may read other hosts' shards one-sidedly (RDMA, zmq):
        awaits those reads. Same results and errors."""
        if type(reply.request) is not int or type(reply.shard) is not int:
            self._flood_log("unroutable", "replay client %s dropped a %s whose request and shard are not ints: %r",
                            self.requester, type(reply).__name__, (reply.request, reply.shard))
            return self.check_timeouts(), None
        s = self._samples.pop(reply.request, None)
        asked = None if s is None else s.outstanding.pop(reply.request, None)
        if s is not None and asked is not None and asked[0] != reply.shard:  # not the shard asked: not its answer
            s.outstanding[reply.request] = asked
            self._samples[reply.request] = s
            self._flood_log(reply.shard, "replay client %s dropped a %s for request %d from shard %d; shard %d was "
                            "asked", self.requester, type(reply).__name__, reply.request, reply.shard, asked[0])
            return self.check_timeouts(), None
        if s is None or asked is None:
            return self.check_timeouts(), None
        if isinstance(reply, Exhausted):  # no part of any sample in flight may still come from it
            self.exhausted = True
            for smp in {id(x): x for x in self._samples.values()}.values():
                self._drop(smp)
            self._drop(s)
            log.info("replay client %s: shard %d has no sample to give any more (every writer ended); "
                     "samples in flight dropped", self.requester, reply.shard)
            return [], None
        if isinstance(reply.error, str) and reply.error:
            self._drop(s)
            raise RuntimeError(f"replay shard {reply.shard} refused a request: {reply.error}")
        why = _reply_problem(reply, asked[1])
        if why is not None:
            return self._malformed(s, reply, why), None
        out: list[ReplayRequest] = []
        batch = None
        # The figures only (a reply may carry a batch of data: keep none of it alive).
        self._figures[reply.shard] = ShardMass(reply.shard, 0, 0, "", reply.mass, reply.min_mass, reply.size,
                                               reply.beta)
        try:
            batch = await self._take(s, asked, reply, out)
            self._malformed_in_a_row.pop(reply.shard, None)
        except _Malformed as e:
            return self._malformed(s, reply, str(e)), None
        except _RemoteUnusable as e:  # this shard answers with data from now on; draw the sample again
            self._drop(s)
            self._inline.add(e.shard)
            log.warning("replay client %s: %s; shard %d will send data in its replies", self.requester, e, e.shard)
            out.extend(self._begin(s.n, self._require_live()))
        except PeerLostError as e:
            self._drop(s)  # never a part-filled batch: the sample is dropped whole
            shard = getattr(e, "shard", None)
            if not self.skip_lost_shards or shard is None:
                raise
            self.lost[shard] = str(e)
            self._figures.pop(shard, None)
            log.warning("replay client %s: shard %d lost (%s); sampling from the others", self.requester, shard, e)
            out.extend(self._begin(s.n, self._require_live()))
        except BaseException:
            self._drop(s)
            raise
        out.extend(self.check_timeouts())
        return out, batch

    def _malformed(self, s: _Sample, reply: ReplayReply, why: str) -> list[ReplayRequest]:
        """Drop a malformed reply and its sample, say why, and draw the sample again (as when a shard is
        lost, :meth:`shard_lost`; what the other shards drew counts as sampled there). Returns the
        messages to send."""
        self._drop(s)
        self.malformed_replies += 1
        self._flood_log(reply.shard, "replay client %s dropped a malformed %s from shard %d (request %d): %s; the "
                        "sample is drawn again", self.requester, type(reply).__name__, reply.shard, reply.request, why)
        in_a_row = self._malformed_in_a_row[reply.shard] = self._malformed_in_a_row.get(reply.shard, 0) + 1
        if in_a_row >= MALFORMED_IN_A_ROW:  # (drawn again for ever, the learner got no batch and no word why)
            e = PeerLostError(f"replay shard {reply.shard} sent {in_a_row} malformed replies in a row (the last: "
                              f"{why}): it is taken for lost")
            if not self.skip_lost_shards:
                raise e
            self.lost[reply.shard] = str(e)
            self._figures.pop(reply.shard, None)
            log.warning("replay client %s: %s; sampling from the others", self.requester, e)
        out = self._begin(s.n, self._require_live())
        out.extend(self.check_timeouts())
        return out

    def _flood_log(self, key: Any, message: str, *args: Any) -> None:
        """Log a dropped reply under :func:`~reactor._floodlog.flood_logged`'s rule, per shard: a shard
        that floods the client with bad replies is not a flood of lines."""
        seen = self._drops_logged.hit(key)
        if flood_logged(seen):
            log.error(message + "%s", *args, flood_tally(seen))

    async def _take(self, s: _Sample, asked: tuple[int, int], reply: ReplayReply,
                    out: list[ReplayRequest]) -> SampledBatch | None:
        """Fold ``reply`` into its sample ``s``; the finished batch, or None (messages go to ``out``)."""
        batch = None
        if isinstance(reply, ShardMass):
            if s.stage == 2 and asked[1] > 0:  # asked for items, but its priorities are all 0 by now
                s.empty = True
            s.masses[reply.shard] = reply
            if not s.outstanding:
                if s.empty:
                    out.extend(self._start_again(s))
                elif s.shares is not None:
                    batch = await self._assemble(s)
                else:
                    out.extend(self._draw_counts(s))
        elif isinstance(reply, ShardSample):
            if reply.descriptor is not None:
                await self._attach(reply.shard, reply.descriptor)
                if reply.sampling is not None and self.one_sided:
                    await self._attach_sampling(reply.shard, reply.sampling)
            layout = self._plan_layout(reply) if _bulk_part(reply) else _data_layout(reply.data)  # type: ignore[arg-type]
            if s.layout is None:
                s.layout = layout
            elif layout != s.layout:  # (the batch is laid out as its first part: the others must fit)
                raise _Malformed(f"its fields {_describe(layout)} are not those of the batch's other parts "
                                 f"{_describe(s.layout)}")
            s.parts.append(reply)
            if not s.outstanding:
                if s.empty:
                    out.extend(self._start_again(s))
                else:
                    batch = await self._assemble(s)
        return batch

    def _start_again(self, s: _Sample) -> list[ReplayRequest]:
        """A shard had no mass for the items it was asked for: draw the whole sample again from the
        figures just reported (its share is now 0). The items other shards drew are dropped (they
        count as sampled there).

        Raises:
            RuntimeError: no live shard has positive mass (every priority is 0): as a single table,
                nothing can be sampled.
        """
        self._drop(s)
        live = self._require_live()
        if not any(self._figures[k].mass > 0 for k in live if k in self._figures):  # type: ignore[attr-defined]
            raise RuntimeError(
                f"every live replay shard ({live}) holds only zero priorities: nothing can be sampled until "
                f"priorities are updated or items inserted"
            )
        return self._begin(s.n, live)

    def _draw_counts(self, s: _Sample) -> list[ReplayRequest]:
        """Stage 2: counts ~ Multinomial(want, M_s / M) over the shards that answered stage 1."""
        shards = sorted(s.masses)
        masses = np.array([s.masses[k].mass for k in shards], dtype=np.float64)
        sizes = np.array([s.masses[k].size for k in shards], dtype=np.float64)
        s.total = float(masses.sum())
        s.size = int(sizes.sum())
        s.min_mass = min(s.masses[k].min_mass for k in shards)
        s.beta = self.beta if self.beta is not None else max(s.masses[k].beta for k in shards)
        share = masses if s.total > 0 else sizes  # every priority 0: fall back to sizes
        counts = self.rng.multinomial(s.want, share / share.sum())
        s.stage = 2
        s.deadline = self._deadline()
        return [self._ask(s, k, int(c)) for k, c in zip(shards, counts) if c > 0]

    async def _assemble(self, s: _Sample) -> SampledBatch:
        parts = sorted(s.parts, key=lambda p: p.shard)  # stable: a shard's redraws stay in order
        if s.shares is not None:
            probs, weights = self._one_round_weights(s, parts)
        else:
            probs, weights = self._two_stage_weights(s, parts)
        data, keep = await self._gather(parts)
        keys = np.concatenate([np.asarray(p.keys, dtype=np.int64) for p in parts])
        times = np.concatenate([np.asarray(p.times_sampled, dtype=np.int64) for p in parts])
        if keep is not None:  # items whose rows were overwritten before the gather
            self._tally(dropped=int((~keep).sum()))
            idx = np.flatnonzero(keep)
            data = {k: v.index_select(0, torch.from_numpy(idx)) for k, v in data.items()}
            keys, times, probs, weights = keys[idx], times[idx], probs[idx], weights[idx]
        return SampledBatch(
            data=data,
            keys=torch.from_numpy(keys),
            weights=torch.from_numpy(weights),
            probabilities=torch.from_numpy(probs),
            table_size=s.size,
            times_sampled=torch.from_numpy(times),
        )

    def _two_stage_weights(self, s: _Sample, parts: list[ShardSample]) -> tuple[np.ndarray, np.ndarray]:
        if not s.masses:  # one shard, one stage: the shard's own figures at draw time
            p = parts[0]
            s.total, s.size, s.min_mass = p.mass, p.size, p.min_mass
            s.beta = self.beta if self.beta is not None else p.beta
        local_p = [np.asarray(p.probabilities, dtype=np.float64) for p in parts]
        # An item's weight is w_i = q_i * M_s (within-shard probability times its shard's mass at draw
        # time); globally P(i) = w_i / M and the IS weight is (w_i / min_j w_j)^-beta.
        item_w = np.concatenate([lp * p.mass for lp, p in zip(local_p, parts)])
        if s.total > 0:
            probs = item_w / s.total
        else:
            probs = np.concatenate([lp * (p.size / max(s.size, 1)) for lp, p in zip(local_p, parts)])
        min_w = min([s.min_mass] + [p.min_mass for p in parts])
        if s.beta == 0.0 or not (0 < min_w < math.inf):
            weights = np.ones(len(probs), dtype=np.float32)
        else:
            with np.errstate(divide="ignore"):
                weights = np.minimum((item_w / min_w) ** (-s.beta), 1.0).astype(np.float32)
        return probs, weights

    def _one_round_weights(self, s: _Sample, parts: list[ShardSample]) -> tuple[np.ndarray, np.ndarray]:
        """P(i) = share_s * q_i (what each item was drawn with); IS weights against the smallest such P."""
        assert s.shares is not None
        figs: dict[int, Any] = {**s.masses, **{p.shard: p for p in parts}}  # every shard's figures now
        probs = np.concatenate([s.shares[p.shard] * np.asarray(p.probabilities, dtype=np.float64) for p in parts])
        s.size = int(sum(f.size for f in figs.values()))
        beta = self.beta if self.beta is not None else max(f.beta for f in figs.values())
        # The least likely item anywhere: share_s * (its weight / M_s) over shards that can be drawn from.
        ks = list(figs)
        min_p = least_probability(np.array([s.shares[k] for k in ks]), np.array([figs[k].mass for k in ks]),
                                  np.array([figs[k].min_mass for k in ks]))
        return probs, importance_weights(probs, min_p, beta)

    # ---------------------------------------------------------------- bulk gathers (shm, one-sided reads)

    async def _attach(self, shard: int, descriptor: dict[str, Any]) -> None:
        if self._reader is None:
            self._reader = await _bulk.BulkReader.open(curve=self._curve)
        if shard in self._shared or shard in self._remote_shared:
            # Attaching again remaps the data region: the shard's one-sided state (its rows' addresses)
            # goes first, and comes back only with an offer that maps again (_attach_sampling).
            self._forget_sampling(shard)
        # Same host: its shared memory. Another host: the one-sided backend this client asked for
        # (the shard sent a plan only because it offers that one).
        same_host = bool(self._host) and descriptor.get("host") == self._host
        backend = "shm" if same_host else self._remote or "shm"
        try:
            region = await self._reader.attach(descriptor, backend=backend)
        except (RuntimeError, OSError, ImportError, *ONE_SIDED_ERRORS) as e:
            # (a malformed descriptor too: the sample is drawn again, with the data in the replies)
            raise _RemoteUnusable(shard, f"shard {shard}'s region cannot be read over {backend} from here: {e}") from e
        self._regions[shard] = (region, int(descriptor["generation"]))
        self._capacity[region] = int(descriptor["rows"])
        self._window_length.pop(region, None)  # (a new life of the region: its next plan says)
        vf = descriptor.get("version_field")
        self._versions_field[region] = vf
        self._layouts[region] = {
            name: (getattr(torch, f["dtype"]), tuple(f["shape"]))
            for name, f in descriptor["fields"].items() if name != vf
        }

    def _plan_layout(self, p: ShardSample) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The fields a plan reply's items will have once gathered, its plan checked against its
        shard's region (attached by now, if it ever will be).

        Raises:
            _Malformed: rows outside the region, spans outside their windows, windows longer than
                the region holds or than the shard's earlier plans, arrays of other shapes or dtypes,
                or a batch larger than this host's memory.
        """
        n = len(p.keys)
        attached = self._regions.get(p.shard)
        if attached is None:
            raise _Malformed("it sent a plan of rows, but no region of its was attached (no descriptor came)")
        region = attached[0]
        cap = self._capacity[region]
        if self._versions_field.get(region) is None:
            raise _Malformed("its region has no version column to check a plan's rows against")
        mask = None
        if p.windows is not None:
            t, w = p.window_length, p.windows
            if p.rows is not None or p.mask is not None or p.versions is not None:
                raise _Malformed("it sent both window spans and rows")
            if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= cap:
                raise _Malformed(f"its window_length {t!r:.40} is not an int in [1, {cap}] (its region's rows)")
            if not (isinstance(w, np.ndarray) and w.dtype == np.int64 and w.shape == (n, 3)):
                raise _Malformed(f"its window spans are not an int64 [{n}, 3] array (got {_what(w)})")
            if n and not ((w[:, 1] >= 0) & (w[:, 2] > w[:, 1]) & (w[:, 2] <= t)).all():
                raise _Malformed(f"a window span is not 0 <= lo < hi <= {t}")
            lead: tuple[int, ...] = (t,)
        else:
            rows, versions, mask = p.rows, p.versions, p.mask
            if not (isinstance(rows, np.ndarray) and rows.dtype == np.int64 and rows.ndim in (1, 2)
                    and rows.shape[0] == n):
                raise _Malformed(f"its rows are not an int64 [{n}] or [{n}, T] array (got {_what(rows)})")
            if not (isinstance(versions, np.ndarray) and versions.dtype == np.int64 and versions.shape == rows.shape):
                raise _Malformed(f"its versions are not an int64 array shaped like its rows {rows.shape} "
                                 f"(got {_what(versions)})")
            if mask is not None and not (rows.ndim == 2 and isinstance(mask, np.ndarray) and mask.dtype == np.bool_
                                         and mask.shape == rows.shape):
                raise _Malformed(f"its mask is not a bool array shaped like its [{n}, T] rows (got {_what(mask)})")
            if rows.size and (rows.min() < 0 or rows.max() >= cap):
                raise _Malformed(f"a row is outside its region's [0, {cap})")
            lead = tuple(rows.shape[1:])
            t = lead[0] if lead else 0
            if t > cap:
                raise _Malformed(f"its windows of {t} rows are longer than its region's {cap}")
        if lead:  # windows: as long as the shard's first plan said (the batch is allocated from them)
            first = self._window_length.get(region, lead[0])
            if lead[0] != first:
                raise _Malformed(f"its windows of {lead[0]} rows are not the {first} of its earlier plans")
        layout = {name: (dtype, (*lead, *shape)) for name, (dtype, shape) in self._layouts[region].items()}
        if p.windows is not None or mask is not None:
            layout["mask"] = (torch.bool, lead)
        nbytes = n * sum(math.prod(shape) * dtype.itemsize for dtype, shape in layout.values())
        if nbytes > _PHYSICAL_MEMORY:
            raise _Malformed(f"its {n} items would take {nbytes} bytes, more than this host's {_PHYSICAL_MEMORY}")
        if lead:
            self._window_length[region] = lead[0]
        return layout

    async def _gather(self, parts: list[ShardSample]) -> tuple[dict[str, torch.Tensor], np.ndarray | None]:
        """The batch's fields over all parts; bulk parts are gathered straight into the output
        (from shared memory here, or by one-sided reads of another host's shard).

        Returns the data and, if any part was gathered, which items are intact (None: all).
        """
        if not any(_bulk_part(p) for p in parts):
            data: dict[str, torch.Tensor] = {}
            for name in parts[0].data or {}:
                cols = [_tensor(p.data[name]) for p in parts]  # type: ignore[index]
                data[name] = cols[0] if len(cols) == 1 else torch.cat(cols)
            return data, None
        assert self._reader is not None
        lens = [len(p.keys) for p in parts]
        total = sum(lens)
        # Output layout from the first part: a data dict, or the region's fields (+ the window mask).
        layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        plans: list[tuple[np.ndarray, np.ndarray | None, np.ndarray] | None] = []
        for p in parts:
            if not _bulk_part(p):
                plans.append(None)
                for name, t in p.data.items():  # type: ignore[union-attr]
                    tt = _tensor(t)
                    layout.setdefault(name, (tt.dtype, tuple(tt.shape[1:])))
            else:
                region = self._regions[p.shard][0]
                if p.windows is not None:
                    plan = expand_window_spans(p.windows, int(p.window_length), self._capacity[region])
                else:
                    plan = (p.rows, p.mask, p.versions)
                plans.append(plan)
                lead = tuple(np.shape(plan[0])[1:])
                for name, (dtype, shape) in self._layouts[region].items():
                    layout.setdefault(name, (dtype, (*lead, *shape)))
                if plan[1] is not None:
                    layout.setdefault("mask", (torch.bool, lead))
        out = {name: host_empty((total, *shape), dtype) for name, (dtype, shape) in layout.items()}
        keep = np.ones(total, dtype=bool)
        reader = self._reader
        bounds = np.cumsum([0, *lens]).tolist()
        bulk: list[tuple[ShardSample, int, int, tuple[Any, ...], str, list[str]]] = []
        for p, a, b, plan in zip(parts, bounds[:-1], bounds[1:], plans):
            if plan is None:
                for name, t in p.data.items():  # type: ignore[union-attr]
                    out[name][a:b].copy_(_tensor(t))
            else:
                region = self._regions[p.shard][0]
                bulk.append((p, a, b, plan, region, [f for f in self._layouts[region] if f in out]))

        valids: list[Any] = [None] * len(bulk)

        async def read_region(jobs: list[int]) -> None:  # one region's parts in turn: a region's reads never overlap
            for i in jobs:
                p, a, b, plan, region, names = bulk[i]
                try:
                    valids[i] = (await reader.read_checked(region, plan[0], plan[2], fields=names,
                                                           out={f: out[f][a:b] for f in names}))[1]
                except PeerLostError as e:
                    via = reader.backend(region) if region in reader.regions else "bulk"
                    lost = PeerLostError(f"replay shard {p.shard}: its {via} region is gone ({e})")
                    lost.shard = p.shard  # type: ignore[attr-defined]
                    raise lost from e
                except ONE_SIDED_ERRORS as e:  # (a read server's refusal or a reply that is not one, its error
                    # classes: the sample is drawn again, as for a malformed reply, and counts towards the shard's loss)
                    raise _Malformed(f"the read of its region failed: {type(e).__name__}: {str(e)[:300]}") from None

        by_region: dict[str, list[int]] = {}
        for i, job in enumerate(bulk):
            by_region.setdefault(job[4], []).append(i)
        # Shared-memory gathers run here and now; one-sided reads of other hosts' shards at once.
        remote = [jobs for region, jobs in by_region.items() if reader.backend(region) != "shm"]
        for region, jobs in by_region.items():
            if reader.backend(region) == "shm":
                await read_region(jobs)
        if len(remote) == 1:
            await read_region(remote[0])
        elif remote:
            try:
                async with asyncio.TaskGroup() as tg:  # one failing read cancels the others
                    for jobs in remote:
                        tg.create_task(read_region(jobs))
            except BaseExceptionGroup as eg:
                raise eg.exceptions[0] from None
        for (_p, a, b, plan, _region, names), valid in zip(bulk, valids):
            mask = plan[1]
            if mask is not None:
                mask = np.asarray(mask, dtype=bool)
                out["mask"][a:b].numpy()[...] = mask  # numpy: ~10x cheaper than a torch setitem
                pad = np.flatnonzero(~mask)
                if pad.size:  # one compiled pass of memsets over every field (numpy's fancy
                    # assignment, field by field, was ~40 us a shard part; a torch bool mask 190)
                    parts_out = [out[f][a:b] for f in names]
                    _gatherk.zero_rows(np.array([t.data_ptr() for t in parts_out], dtype=np.int64), mask.size,
                                       np.array([t.element_size() * (t[0, 0].numel() if t.dim() > 1 else 1)
                                                 for t in parts_out], dtype=np.int64), pad)
                valid = valid | ~mask
            keep[a:b] = valid.reshape(b - a, -1).all(axis=1)
            self._tally(gathered=b - a)
        return out, (None if keep.all() else keep)

    def close(self) -> None:
        """Release shared-memory mappings (call from the owner's shutdown); held notices are dropped.
        Idempotent."""
        self._quiesce()  # (draws ahead read the mappings)
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        for fut in self._ahead:  # their batches are dropped with the held notices; an error no one expects is said
            e = fut.exception()
            if e is not None and not isinstance(e, ONE_SIDED_ERRORS):
                log.error("replay client %s: a draw ahead, dropped at close, had failed: %r", self.requester, e)
        self._ahead.clear()
        for draw in self._remote_ahead:  # (a finish running stops at its next wait: the reader is closed below)
            if draw.task is not None:
                draw.task.cancel()
        self._remote_ahead.clear()
        reader, self._reader = self._reader, None
        self._group = None  # (its views would keep the sampling regions mapped)
        self._held, self._held_samples = {}, 0
        self._regions.clear()
        self._shared.clear()
        self._remote_shared.clear()
        if reader is not None:
            _run_now(reader.aclose())

    def _drop(self, s: _Sample) -> None:
        for rid in list(s.outstanding):
            self._samples.pop(rid, None)
        s.outstanding.clear()

    def check_timeouts(self) -> list[ReplayRequest]:
        """Give up on shards that did not answer in time; returns messages to send (redraws).

        Raises:
            PeerLostError: a shard did not answer within ``timeout_s`` (and ``skip_lost_shards`` is
                False), or every shard is lost. The message names the shard and the request.
        """
        if self.timeout_s is None or not self._samples:
            return []
        now = self.clock()
        late: dict[int, int] = {}
        for rid, s in self._samples.items():
            if now > s.deadline:
                late.setdefault(s.outstanding[rid][0], rid)
        if not late:
            return []
        if not self.skip_lost_shards:
            shard, rid = min(late.items())
            raise PeerLostError(
                f"replay shard {shard} did not answer request {rid} within {self.timeout_s}s (dead, hung, or "
                f"parked below its rate limiter for that long); pass skip_lost_shards=True to sample from the "
                f"live shards instead"
            )
        for shard in late:
            self.lost[shard] = f"no answer within {self.timeout_s}s"
            self._figures.pop(shard, None)
            log.warning("replay client %s: shard %d lost (no answer within %ss); sampling from the others",
                        self.requester, shard, self.timeout_s)
        return self._redraw_without_lost(self._require_live())

    def shard_lost(self, shard: int, why: str) -> list[ReplayRequest]:
        """``shard``'s process died and is being started again (restart policies, async runs):
        sample from the other shards until :meth:`shard_restarted`; samples in flight redraw its
        share from them. With no shard left, samples in flight are dropped (``in_flight`` falls to
        0) and the owner requests again once one is back. Returns messages to send.

        Raises:
            ValueError: ``shard`` outside ``[0, num_shards)``.
        """
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard_lost: shard must be in [0, {self.num_shards}), got {shard!r}")
        self._quiesce()  # draws ahead end on the state they began with; those that drew from it go
        self._drop_drawn_of(shard)
        self.lost[shard] = why
        self._figures.pop(shard, None)
        self._regions.pop(shard, None)  # its successor owns regions of another generation
        self._forget_sampling(shard)
        self._inline.discard(shard)
        self._held.pop(shard, None)  # draws from its predecessor's state: its successor does not count them
        log.warning("replay client %s: shard %d is down (%s); sampling from the others", self.requester, shard, why)
        live = self.live_shards
        if not live:
            for smp in {id(x): x for x in self._samples.values()}.values():
                self._drop(smp)
            return []
        return self._redraw_without_lost(live)

    def shard_restarted(self, shard: int) -> None:
        """``shard`` is back (restored from its checkpoint, if it had one): sample from it again.

        Raises:
            ValueError: ``shard`` outside ``[0, num_shards)``.
        """
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard_restarted: shard must be in [0, {self.num_shards}), got {shard!r}")
        self._quiesce()
        self._drop_drawn_of(shard)  # (from its predecessor's memory)
        self.lost.pop(shard, None)
        self._figures.pop(shard, None)  # the cached masses are a past life's: one mass round first
        self._regions.pop(shard, None)
        self._forget_sampling(shard)
        self._held.pop(shard, None)  # draws from its predecessor's state: its successor does not count them

    def _redraw_without_lost(self, live: list[int]) -> list[ReplayRequest]:
        """Samples in flight drop what they asked of lost shards and draw it again from ``live``."""
        out: list[ReplayRequest] = []
        for s in {id(s): s for s in self._samples.values()}.values():
            missing = [(rid, n) for rid, (k, n) in s.outstanding.items() if k in self.lost]
            for rid, _ in missing:
                del s.outstanding[rid]
                del self._samples[rid]
            for k in [k for k in s.masses if k in self.lost]:
                del s.masses[k]
            if not missing:
                continue
            if s.shares is not None:  # one round: start the sample again over the live shards
                self._drop(s)
                out.extend(self._begin(s.n, live))
                continue
            if s.stage == 2:
                s.want = sum(n for _, n in missing)
            if s.outstanding:  # stage 1 still waits for others; stage 2 redraws after them
                if s.stage == 2:
                    out.extend(self._redraw_later(s))
                continue
            out.extend(self._draw_counts(s) if s.masses else self._ask_masses(s, live))
        return out

    def _redraw_later(self, s: _Sample) -> list[ReplayRequest]:
        # Other shards still owe items: ask the live shards of stage 1 for the lost share right away.
        if not s.masses:
            return []
        asked = s.outstanding.copy()
        out = self._draw_counts(s)
        s.outstanding.update(asked)
        return out

    def update_priorities(self, keys: Any, priorities: Any) -> list[PriorityUpdate]:
        """Messages setting ``priorities`` of ``keys`` (shard-tagged), one per owning shard.

        Keys of lost shards are skipped.

        A priority that is not finite and >= 0 is left out (its item keeps its priority), said in the
        log: each shard refused a whole update for one.

        Raises:
            ValueError: lengths differ, or a key names a shard outside ``[0, num_shards)``.
        """
        keys = _int64_keys(keys)
        if isinstance(priorities, torch.Tensor):
            priorities = priorities.detach().cpu().numpy()
        p = np.asarray(priorities, dtype=np.float64)
        if p.shape != keys.shape:
            raise ValueError(f"update_priorities: {len(keys)} keys but priorities of shape {p.shape}")
        good = np.isfinite(p) & (p >= 0)
        if not good.all():  # (a shard refused the whole message for one: every item of it kept its old one)
            bad = p[~good]
            self._flood_log("bad priorities", "replay client %s: %d of %d new priorities are not finite and >= 0 "
                            "(%r first: a loss gone NaN?); those items keep their priorities", self.requester,
                            len(bad), len(p), float(bad[0]))
            keys, p = keys[good], p[good]
        return [PriorityUpdate(k, keys[idx], p[idx]) for k, idx in self._by_shard(keys)]

    def delete(self, keys: Any) -> list[Delete]:
        """Messages deleting ``keys`` (shard-tagged), one per owning shard (lost shards skipped)."""
        keys = _int64_keys(keys)
        return [Delete(k, keys[idx]) for k, idx in self._by_shard(keys)]

    def _by_shard(self, keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
        shards = keys >> KEY_SHARD_BITS
        if len(keys) and (shards.min() < 0 or shards.max() >= self.num_shards):
            bad = int(shards[np.argmax((shards < 0) | (shards >= self.num_shards))])
            raise ValueError(f"a key names shard {bad}, outside [0, {self.num_shards}): not a key this client sampled")
        if len(keys) == 0:
            return []
        order = np.argsort(shards, kind="stable")
        bounds = np.flatnonzero(np.diff(shards[order])) + 1
        out = []
        for idx in np.split(order, bounds):
            k = int(shards[idx[0]])
            if k not in self.lost:
                out.append((k, idx))
        return out




class _Malformed(Exception):
    """A shard's reply is malformed (the message says how): the client drops it and draws its sample again."""


class _RemoteUnusable(Exception):
    """A shard's one-sided region could not be attached from here (the client falls back to data)."""

    def __init__(self, shard: int, message: str) -> None:
        super().__init__(message)
        self.shard = shard


def _run_now(coro: Any) -> Any:
    """Run a coroutine that completes without suspending (bulk shm operations never wait).

    The client is pure logic called from synchronous reactions, and the shm paths of
    ``BulkReader`` are ``async`` only for the interface they share with the network backends.
    """
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a bulk operation tried to wait; ReplayClient.receive gathers over shared memory only")


def _tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.asarray(x))
