"""Benchmark app: actor-side writers fill N replay shards; two learners time samples; one also inserts.

Driven by ``benchmarks/bench_replay_service.py`` (which documents the figures); the app runs under any
placement, the benchmark uses one process per reactor instance. Every measurement is taken by a
:class:`Bench` replica (the requesting side) in one run, in repetitions that alternate between the
service and its in-process peers (the cases' order flips every repetition) so that load spikes hit
every case alike. ``bench[0]`` runs the plan; ``bench[1]`` is a learner "on another host" that
samples when ``bench[0]`` asks and reports its timings back:

* ``insert``: bench[0] tells every :class:`FillWriter` to write ``round_rows`` more stored rows; each
  steps ``envs`` synthetic env streams through a real :class:`~reactor.nodes.Writer` (window pattern,
  one :class:`~reactor.nodes.Steps` message per flush) to the shards, round-robin. The round ends
  when every writer is done and the shards' statistics count every item the writers sent. The
  first round fills the whole capacity (``insert_cold``).
* ``local_insert``: the same Writer workload into an in-process ``reactor.replay.Table`` (the peer),
  and ``Table.flush()`` at its end: its sum tree's buffered writes are applied in the round, as the
  shards apply theirs in the round (before publishing each insert to one-sided readers). Left to its
  first sample instead, a round's flush (~10-14 ms for 256K rows) landed in the ``inproc`` figure,
  spread over ``calls`` samples: a peer slowed by ~0.5 ms a batch for an insert-to-sample ratio no
  training loop has (thousands of rows a batch).
* ``shm`` / ``msg`` / ``onesided``: ``calls`` batches of ``batch`` windows through a
  :class:`~reactor.nodes.ReplayClient` (exact two-stage sampling), with 1 and ``inflight`` batches
  requested at once (``*_x<inflight>``): ``shm`` (bench[0]) gathers the rows from the shards' shared
  memory itself; ``msg`` (bench[1], ``bulk=False``) gets the windows in the shards' replies, as a
  learner on another host does; ``onesided`` (bench[1], ``remote_reads="zmq"``) gets plans and reads
  the windows from the shards' bulk zmq read servers (the RDMA path's shape). Per batch also: time to the last stage-1 reply, to the last stage-2
  reply, in assembly; the requester's CPU time and context switches.
* ``local``: ``calls`` batches from bench[0]'s client by ``ReplayClient.sample_now`` (one-sided: it
  draws from the shards' published sum trees and copies the windows from their shared memory, with
  no message; the notices of the draws go to the shards on ``updates``), one after another.
* ``local_x<inflight>``: the same drawn ahead, ``inflight`` draws running at once on the client's draw
  threads (``ReplayClient.draw_ahead``/``take_drawn``, two threads on two cores: the draws' compiled
  parts release the GIL), as a learner's ``prefetch`` keeps them while it updates.
* ``remote``: the same from bench[1] ("another host") by ``ReplayClient.asample_now``: one request per
  shard to its bulk zmq read server, whose thread draws from the published state and sends the rows.
* ``remote_x<inflight>``: the same drawn ahead (``ReplayClient.draw_ahead``: ``inflight`` samples'
  requests out at once, each taken by ``await next_drawn()``), as a learner's ``prefetch`` keeps them.
* ``inproc``: ``Table.sample_nowait(batch)`` of the same windows from the in-process table, each batch
  held until the next is drawn (as the client's cases hold theirs, and a learner its batch).
* ``memcpy``: one contiguous single-core copy of a batch's bytes from a random place of a buffer as
  large as the stored data.

config keys: shards (4), writers (4), capacity (steps held over all shards, 1 << 20), envs (64),
window (32), batch (256), reps (5), calls (20), round_rows (rows per writer per repetition; 0: none),
inflight (1), chunk_length (256), flush_steps (1024), notice_every (the clients' ``notice_every``, 64), stage
(1: the writers stage their rows in shared memory for the shards, which read them there; 0: in messages),
ack_every (the writers' ``Writer(ack_every=...)``; 0: its default),
report (the JSON file bench[0] writes at the end).
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time

import numpy as np
import torch

from reactor import Action, Graph, Input, Output, Reactor, reaction, shutdown, startup
from reactor.nodes import (
    Replay,
    ReplayClient,
    StatisticsRequest,
    Steps,
    WindowPattern,
    Writer,
    requester_key,
    shard_key,
    writer_key,
)
from reactor.nodes._staging import take_ack
from reactor.nodes.messages import (
    InsertAck,
    ItemUpdate,
    ReplayControl,
    ReplayReply,
    ReplayRequest,
    ShardMass,
    ShardStatistics,
)
from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table, WindowRead
from reactor.transport._shm import mapped_kb

FIELDS = [("obs", (64,), "float32"), ("action", (), "int64"), ("reward", (), "float32"), ("terminated", (), "bool")]
SPECS = [FieldSpec("obs", (64,), torch.float32), FieldSpec("action", (), torch.int64),
         FieldSpec("reward", (), torch.float32), FieldSpec("terminated", (), torch.bool)]
ROW_NBYTES = 64 * 4 + 8 + 4 + 1  # 269 B a stored step
ALPHA, BETA = 0.6, 0.4
EPISODE_MEAN = 500  # steps; episodes end at random (terminated) with probability 1 / EPISODE_MEAN a step
POOL = 64  # pre-generated steps the synthetic envs cycle through (the writer's work, not the data's)


def run_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this run's other processes by role and thread kind (``writer``,
    ``writer_io``: their zmq I/O threads, ``replay``, ``replay_io``, ``bench``, ``bench_io``), and
    ``switches``: how many times their threads were put on a CPU; read from ``/proc`` (each
    thread's ``schedstat``: nanoseconds on a CPU, and time slices) for the processes that share
    our parent (the workers of one run); empty when we are alone in ours (a single-process run: the
    roles cannot be told apart)."""
    out: dict[str, float] = {}
    parent = os.getppid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
            name, rest = st[st.index("(") + 1 : st.rindex(")")], st[st.rindex(")") + 2 :].split()
            if int(rest[1]) != parent or not name.startswith("rx:"):
                continue
            role = name[3:].rsplit("-", 1)[0]
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    io = f.read().startswith("ZMQbg")
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns, _wait, slices = (int(x) for x in f.read().split()[:3])
                key = role + ("_io" if io else "")
                out[key] = out.get(key, 0.0) + ns / 1e9
                out["switches"] = out.get("switches", 0.0) + slices  # (times each thread was put on a CPU)
        except (OSError, ValueError, IndexError):  # a process or thread that ended meanwhile
            continue
    return out if any(k.startswith("writer") for k in out) else {}


class SyntheticEnvs:
    """``envs`` streams of pre-generated steps: the same per-step work for the service and its peer."""

    def __init__(self, envs: int, rng: np.random.Generator) -> None:
        self.envs = envs
        self.obs = rng.normal(size=(POOL, envs, 64)).astype(np.float32)
        self.action = rng.integers(0, 18, size=(POOL, envs))
        self.reward = rng.normal(size=(POOL, envs)).astype(np.float32)
        self.term = rng.random((POOL, envs)) < 1.0 / EPISODE_MEAN
        self.trunc = np.zeros(envs, dtype=bool)
        self.prio = rng.uniform(0.01, 10.0, size=(POOL, envs))
        # Each stream's first episode ends at a random step, so that streams cut their chunks at different
        # steps (else every stream of every writer flushes at once and the round-robin shards get uneven loads).
        self.first_end = rng.integers(1, 256, size=envs)
        self.k = 0

    def step_into(self, writer: Writer) -> list[Steps]:
        """One step of every stream appended to ``writer``; returns the messages it flushed."""
        i = self.k % POOL
        j = (self.k + 1) % POOL
        term = self.term[i] if self.k >= 256 else self.term[i] | (self.first_end == self.k)
        self.k += 1
        return writer.append({"obs": self.obs[i], "action": self.action[i], "reward": self.reward[i]},
                             terminated=term, truncated=self.trunc, final={"obs": self.obs[j]},
                             priorities=self.prio[i])


#: Steps messages a writer keeps unacknowledged per shard before it waits, as an actor of the training apps
#: does (``off_policy_graph(max_unacked=8)``).
MAX_UNACKED = 8


def make_writer(envs: int, window: int, num_shards: int, writer_id: int, chunk_length: int, flush_steps: int,
                max_unacked: int | None = None, ack_every: int | None = None) -> Writer:
    return Writer(FIELDS, envs, WindowPattern(window, chunk_length=chunk_length), num_shards=num_shards,
                  writer_id=writer_id, flush_steps=flush_steps, max_unacked=max_unacked, ack_every=ack_every)


class FillWriter(Reactor):
    """An actor that only writes: on each ``go`` it appends steps until ``rows`` more rows went out."""

    placement_role = "actor"
    go = Input(dict)
    acks = Input(InsertAck)
    steps = Output(Steps)
    done = Output(dict)
    burst = Action()

    def __init__(self, num_shards: int, envs: int, window: int, chunk_length: int, flush_steps: int,
                 stage: bool = True, ack_every: int | None = None) -> None:
        self.stage = stage
        self.ack_every = ack_every
        self.num_shards = num_shards
        self.envs = envs
        self.window = window
        self.chunk_length = chunk_length
        self.flush_steps = flush_steps
        self.quota = 0
        self.round = -1

    @reaction(triggers=[startup])
    def begin(self) -> None:
        torch.set_num_threads(1)
        self.writer = make_writer(self.envs, self.window, self.num_shards, self.bank_index, self.chunk_length,
                                  self.flush_steps, MAX_UNACKED, self.ack_every)
        self.held = False  # waiting for an ack (every shard holds MAX_UNACKED of its messages)
        self.src = SyntheticEnvs(self.envs, self.rng)

    @reaction(triggers=[acks], effects=[burst])
    def take_ack(self, acks: InsertAck) -> None:
        """As an actor takes its shards' acks: counted, a held writer let go on; its rows staged in shared
        memory for the shards of its host once one says it reads them (``stage``: off, in the messages)."""
        if self.stage:
            take_ack(self.writer, acks.shard, acks.seq, acks.host, acks.pid, self.run_id, self.name, MAX_UNACKED)
        else:
            self.writer.acknowledged(acks.shard, seq=acks.seq if type(acks.seq) is int else None)
        if self.held and not self.writer.full():
            self.held = False
            self.burst.schedule()

    @reaction(triggers=[shutdown])
    def close_staging(self) -> None:
        """Unlink the staging region, as an actor does (the run's end removed its segments instead, with a
        warning for each)."""
        staging = getattr(self, "writer", None) and self.writer.staging
        if staging is not None:
            staging.close()

    def _staged_rows(self) -> int:
        return 0 if self.writer.staging is None else self.writer.staging.staged_rows

    @reaction(triggers=[go], effects=[burst])
    def start_round(self, go: dict) -> None:
        self.round = int(go["round"])
        self.quota = self.writer.steps_sent + int(go["rows"])
        self.at_start = (self.writer.steps_appended, self.writer.steps_sent, self.writer.items_sent, self.writer.seq,
                         self._staged_rows())
        self.append_cpu = 0.0  # CPU seconds in Writer.append (and the synthetic envs' step) this round
        self.burst.schedule()

    @reaction(triggers=[burst], effects=[steps, done, burst])
    def write(self) -> None:
        w, send = self.writer, self.steps.send
        msgs: list[Steps] = []
        c0 = time.thread_time()  # (a CPU clock read is a system call: one pair a burst, not one a call)
        for _ in range(8):  # a few env steps per event: the loop stays responsive to its sockets
            msgs += self.src.step_into(w)
            if w.steps_sent >= self.quota or w.full():
                break
        self.append_cpu += time.thread_time() - c0
        for m in msgs:
            send(m)
        if w.steps_sent >= self.quota:
            a0, s0, i0, q0, g0 = self.at_start
            self.done.send({"writer": self.bank_index, "round": self.round, "appended": w.steps_appended - a0,
                            "rows": w.steps_sent - s0, "items": w.items_sent - i0, "messages": w.seq - q0,
                            "items_total": w.items_sent, "append_cpu": self.append_cpu,
                            "staged_rows": self._staged_rows() - g0})
            return
        if w.full():
            self.held = True  # (take_ack goes on)
            return
        self.burst.schedule()


class Bench(Reactor):
    """The requesting side. Replica 0 runs the plan (inserts, shm samples, peers) and writes the figures as
    JSON; replica 1 is a learner "on another host": it samples with ``bulk=False`` when replica 0 asks.
    """

    placement_role = "learner"
    go = Output(dict)
    done = Input(dict)
    control = Output(ReplayControl)
    statistics = Input(ShardStatistics)
    requests = Output(ReplayRequest)
    updates = Output(ItemUpdate)  # one-sided samples' notices (SampledKeys)
    replies = Input(ReplayReply)
    cmd = Output(dict)  # between the two replicas: {"to": replica, "op": ...}
    cmd_in = Input(dict)
    poll = Action()

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg

    # ------------------------------------------------------------------ plan

    @reaction(triggers=[startup], effects=[go, control, requests, updates, cmd, poll])
    def begin(self) -> None:
        torch.set_num_threads(1)
        c = self.cfg
        self.shards, self.writers, self.batch = c["shards"], c["writers"], c["batch"]
        self.capacity, self.window, self.envs = c["capacity"], c["window"], c["envs"]
        self.calls, self.inflight = c["calls"], c["inflight"]
        # Replica 0 gathers from the shards' shared memory; replica 1 ("another host") gets the windows
        # in the replies (msg) or reads them one-sidedly from the shards' bulk read servers (onesided).
        mk = functools.partial(ReplayClient, self.shards, requester=self.bank_index, rng=self.rng, timeout_s=120.0,
                               curve=self.process_link.curve, notice_every=c.get("notice_every", 64))
        self.clients = ({"shm": mk(bulk=True, remote_reads="off")} if self.bank_index == 0 else
                        {"msg": mk(bulk=False, remote_reads="off"), "onesided": mk(bulk=False, remote_reads="zmq")})
        self.client = next(iter(self.clients.values()))
        self.block: dict = {}
        if self.bank_index != 0:
            return
        # The in-process peer: one Table of the same capacity, sampler, read and fields.
        self.table = Table(Storage(SPECS, self.capacity), sampler=Prioritized(ALPHA), remover=Fifo(),
                           rate_limiter=MinSize(1), read=WindowRead(self.window, "tail"), beta=BETA)
        self.local_writer = make_writer(self.envs, self.window, 1, 0, c["chunk_length"], c["flush_steps"])
        self.local_src = SyntheticEnvs(self.envs, self.rng)
        self.out_nbytes = self.batch * self.window * (ROW_NBYTES + 1)  # fields + the window mask
        self.big = torch.empty(self.capacity * ROW_NBYTES, dtype=torch.uint8).random_()  # memcpy source
        self.dst = torch.empty(self.out_nbytes, dtype=torch.uint8)
        fill = -(-self.capacity // self.writers)  # rows per writer for the first (cold) fill
        plan: list[tuple] = [("insert", 0, fill), ("local_insert", 0, fill * self.writers), ("stats", "after_fill")]
        depths = sorted({1, self.inflight})
        samples = [(name, d) for name in ("shm", "msg", "onesided") for d in depths]
        plan += [("sample", name, d, 3, False) for name, d in samples] + [("inproc", 3, False), ("memcpy", 3, False)]
        plan += [("local", 1, 3, False), ("remote", 1, 3, False)]  # (after the first replies brought the offers)
        if self.inflight > 1:
            plan += [("local", self.inflight, 3, False), ("remote", self.inflight, 3, False)]
        for r in range(1, c["reps"] + 1):
            rows = c["round_rows"]
            if rows > 0:
                plan += [("insert", r, rows), ("local_insert", r, rows * self.writers)]
            # The cases' order alternates between repetitions: none always runs first after the inserts.
            cases = [("sample", name, d, self.calls, True) for name, d in samples]
            cases += ([("local", self.inflight, self.calls, True), ("remote", self.inflight, self.calls, True)]
                      if self.inflight > 1 else [])
            cases += [("inproc", self.calls, True), ("memcpy", self.calls, True), ("local", 1, self.calls, True),
                      ("remote", 1, self.calls, True)]
            plan += cases if r % 2 else cases[::-1]
        plan.append(("stats", "end"))
        self.plan: list[tuple] | None = plan
        self.results: dict = {}
        self.stats: dict[int, ShardStatistics] = {}
        self.stats_what: str | None = None
        self.items_sent: dict[int, int] = {}
        self.t_start = time.perf_counter()
        self.results["began_at"] = time.time()
        self._advance()

    def _record(self, key: str, value) -> None:
        self.results.setdefault(key, []).append(value)

    def _advance(self) -> None:
        """Run plan entries until one must wait for messages (then a reaction calls this again)."""
        assert self.plan is not None
        while self.plan:
            entry = self.plan.pop(0)
            kind = entry[0]
            if kind == "insert":
                _, rnd, rows = entry
                self.round, self.round_done = rnd, {}
                self.round_t0, self.round_cpu0 = time.perf_counter(), run_cpu_s()
                self.go.send({"round": rnd, "rows": rows})
                return
            if kind == "local_insert":
                self._local_insert(entry[1], entry[2])
            elif kind == "sample":
                _, name, depth, calls, keep = entry
                key = name if depth == 1 else f"{name}_x{depth}"
                if name == "shm":
                    self._start_block(key, depth, calls, keep)
                else:  # the learner "on another host" samples and reports back
                    self.cmd.send({"to": 1, "op": "sample", "key": key, "depth": depth, "calls": calls, "keep": keep})
                return
            elif kind == "inproc":
                _, calls, keep = entry
                t0, batch = time.perf_counter(), None
                for _ in range(calls):
                    # Each batch held until the next is drawn, as a learner's loop holds it and as the
                    # client's cases hold theirs: a batch dropped before the next call would hand that
                    # call the memory it just wrote, still in cache (~8 us of a 0.2 ms batch).
                    batch = self.table.sample_nowait(self.batch)
                dt = time.perf_counter() - t0
                del batch  # (after the clock, as the client's cases free their last batch after theirs)
                if keep:
                    self._record("inproc", dt / calls)
            elif kind == "local":
                self._local_sample(entry[1], entry[2], entry[3])
            elif kind == "remote":  # the learner "on another host" samples through the shards' read servers
                self.cmd.send({"to": 1, "op": "remote", "depth": entry[1], "calls": entry[2], "keep": entry[3]})
                return
            elif kind == "memcpy":
                _, calls, keep = entry
                offs = self.rng.integers(0, self.big.numel() - self.out_nbytes, calls)
                t0 = time.perf_counter()
                for off in offs:
                    self.dst.copy_(self.big[int(off) : int(off) + self.out_nbytes])
                if keep:
                    self._record("memcpy", (time.perf_counter() - t0) / calls)
            elif kind == "stats":
                self.stats_what, self.stats = entry[1], {}
                self.control.send(StatisticsRequest())
                return
        self._finish()

    async def _one_sided_block(self, client: ReplayClient, calls: int,
                               depth: int = 1) -> tuple[float, float, int, list[float]]:
        """``calls`` one-sided samples one after another, or drawn ahead ``depth`` at a time on the
        client's threads (never more than the block still needs): (s per batch, items per batch drawn,
        fallbacks, the per-batch parts: zeros for the message stages, wall s, CPU s, context switches)."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        c0, items, fallbacks = time.process_time(), 0, 0
        t0 = time.perf_counter()
        for i in range(calls):
            if depth == 1:
                batch, notices = await client.asample_now(self.batch)  # (shards of this host: sample_now)
            elif not client.draw_ahead(self.batch, min(depth, calls - i)):  # (none could start: a fallback)
                batch, notices = None, client.take_notices()
            elif client.can_sample_now:  # (shards of this host: a blocking take)
                batch, notices = client.take_drawn()
            else:  # shards of another host: the next draws' requests went out before this one is awaited
                batch, notices = await client.next_drawn()
            for m in notices:
                self.updates.send(m)
            if batch is None:
                fallbacks += 1
            else:
                items += len(batch.keys)
        for m in client.take_notices():  # (the client sends every notice_every samples' notices at once)
            self.updates.send(m)
        dt = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        parts = [0.0, 0.0, dt / calls, (time.process_time() - c0) / calls, (ru1.ru_nvcsw - ru.ru_nvcsw) / calls,
                 (ru1.ru_nivcsw - ru.ru_nivcsw) / calls]
        got = calls - fallbacks
        return dt / calls, items / got if got else 0.0, fallbacks, parts

    def _local_sample(self, depth: int, calls: int, keep: bool) -> None:
        """One-sided samples (ReplayClient.sample_now: no message to any shard), one after another; with
        ``depth`` > 1 drawn ahead on the client's draw threads (ReplayClient.draw_ahead: ``depth`` draws
        running while the oldest is taken, as a learner's prefetch keeps them)."""
        s, items, fallbacks, parts = _at_once(self._one_sided_block(self.clients["shm"], calls, depth))
        key = "local" if depth == 1 else f"local_x{depth}"
        if keep:
            self._record(f"{key}_fallbacks", fallbacks)
            if items:
                self._keep(key, s, items, parts)
            self.results["local_retries"] = self.clients["shm"].one_sided_retries

    async def _remote_sample(self, depth: int, calls: int, keep: bool) -> None:
        """Replica 1: one-sided samples through the shards' bulk read servers (ReplayClient.asample_now:
        one request per shard, drawn by its server thread), one after another; with ``depth`` > 1 drawn
        ahead (ReplayClient.draw_ahead: ``depth`` samples' requests out at once, each taken with
        next_drawn); reported to replica 0."""
        s, items, fallbacks, parts = await self._one_sided_block(self.clients["onesided"], calls, depth)
        key = "remote" if depth == 1 else f"remote_x{depth}"
        self.cmd.send({"to": 0, "op": "sampled", "key": key, "s": s, "items": items, "keep": keep,
                       "parts": parts, "fallbacks": fallbacks})

    # ------------------------------------------------------------------ inserts

    def _local_insert(self, rnd: int, rows: int) -> None:
        w = self.local_writer
        a0, s0 = w.steps_appended, w.steps_sent
        quota = s0 + rows
        t0, c0 = time.perf_counter(), time.thread_time()
        while w.steps_sent < quota:
            for m in self.local_src.step_into(w):
                self.table.insert_nowait(m.fields, m.priorities, episode_end=m.episode_end, item_mask=m.item_mask)
        self.table.flush()
        dt = time.perf_counter() - t0
        self._record("local_insert_cold" if rnd == 0 else "local_insert",
                     {"s": dt, "appended": w.steps_appended - a0, "rows": w.steps_sent - s0,
                      "cpu": {"bench": time.thread_time() - c0}})

    @reaction(triggers=[done], effects=[control])
    def writer_done(self, done: dict) -> None:
        self.round_done[done["writer"]] = done
        self.items_sent[done["writer"]] = done["items_total"]
        if len(self.round_done) == self.writers:  # now wait until the shards hold every item sent
            self.stats = {}
            self.control.send(StatisticsRequest())

    @reaction(triggers=[poll], effects=[control])
    def poll_shards(self) -> None:
        self.stats = {}
        self.control.send(StatisticsRequest())

    @reaction(triggers=[statistics], effects=[go, control, requests, updates, cmd, poll])
    def shard_stats(self, statistics: ShardStatistics) -> None:
        self.stats[statistics.shard] = statistics
        if len(self.stats) < self.shards:
            return
        if self.stats_what is not None:
            what, self.stats_what = self.stats_what, None
            self.results[f"shards_{what}"] = [
                {k: getattr(s, k) for k in ("size", "num_steps", "inserted", "sampled", "rejected_steps",
                                            "parked_steps", "parked_requests", "staged_steps")}
                for s in (self.stats[i] for i in range(self.shards))]
            self._advance()
            return
        rejected = sum(s.rejected_steps for s in self.stats.values())
        if rejected:  # the round would never complete: say why and end the run
            self.results["error"] = f"the shards refused {rejected} steps (see the log): capacity too small?"
            self.plan = []
            self._finish()
            return
        if sum(s.inserted for s in self.stats.values()) < sum(self.items_sent.values()):
            self.poll.schedule(delay_s=0.002)
            return
        dt = time.perf_counter() - self.round_t0
        cpu1 = run_cpu_s()
        d = self.round_done.values()
        rec = {"s": dt, "appended": sum(x["appended"] for x in d), "rows": sum(x["rows"] for x in d),
               "messages": sum(x["messages"] for x in d), "append_cpu": sum(x["append_cpu"] for x in d),
               "staged_rows": sum(x["staged_rows"] for x in d),
               "cpu": {k: v - self.round_cpu0.get(k, 0.0) for k, v in cpu1.items()} if self.round_cpu0 else None}
        self._record("insert_cold" if self.round == 0 else "insert", rec)
        self._advance()

    # ------------------------------------------------------------------ samples (either replica)

    def _start_block(self, key: str, depth: int, calls: int, keep: bool) -> None:
        self.client = self.clients[key.split("_x")[0]]  # one client per case: its request ids are its own
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.block = {"key": key, "depth": depth, "calls": calls, "keep": keep, "issued": 0, "done": 0, "items": 0,
                      "parts": [0.0, 0.0, 0.0], "ru0": (time.process_time(), ru.ru_nvcsw, ru.ru_nivcsw),
                      "t0": time.perf_counter()}
        for _ in range(min(depth, calls)):
            self._request()

    def _request(self) -> None:
        self.block["issued"] += 1
        self.block["t_req"] = time.perf_counter()
        for m in self.client.request(self.batch):
            self.requests.send(m)

    @reaction(triggers=[cmd_in], effects=[go, control, requests, updates, cmd, poll])
    async def command(self, cmd_in: dict) -> None:
        op = cmd_in["op"]
        if op == "sample":  # replica 1
            self._start_block(cmd_in["key"], cmd_in["depth"], cmd_in["calls"], cmd_in["keep"])
        elif op == "remote":  # replica 1
            await self._remote_sample(cmd_in["depth"], cmd_in["calls"], cmd_in["keep"])
        elif op == "sampled":  # replica 0
            if cmd_in["keep"]:
                if "fallbacks" in cmd_in:
                    self._record(f"{cmd_in['key']}_fallbacks", cmd_in["fallbacks"])
                if cmd_in["items"] > 0:
                    self._keep(cmd_in["key"], cmd_in["s"], cmd_in["items"], cmd_in["parts"])
            self._advance()
        elif op == "close":  # replica 1
            for c in self.clients.values():
                c.close()

    @reaction(triggers=[replies], effects=[go, control, requests, updates, cmd, poll])
    async def take(self, replies: ReplayReply) -> None:
        b = self.block
        t0 = time.perf_counter()
        msgs, batch = await self.client.areceive(replies)
        t1 = time.perf_counter()
        # Where a batch's time goes (one batch in flight): stage 1 (masses), stage 2 (samples), assembly.
        if isinstance(replies, ShardMass):
            b["t_mass"] = t0
        elif batch is not None and b["depth"] == 1:
            parts = b["parts"]  # stage 1, stage 2, assembly (+ cpu, nvcsw, nivcsw added at the end)
            parts[0] += b.get("t_mass", b["t_req"]) - b["t_req"]
            parts[1] += t0 - b.get("t_mass", b["t_req"])
            parts[2] += t1 - t0
        for m in msgs:
            self.requests.send(m)
        if batch is None:
            return
        b["done"] += 1
        b["items"] += len(batch.keys)
        if b["issued"] < b["calls"]:
            self._request()
            return
        if b["done"] < b["calls"]:
            return
        s, items = (time.perf_counter() - b["t0"]) / b["calls"], b["items"] / b["calls"]
        ru = resource.getrusage(resource.RUSAGE_SELF)
        # per batch: requester CPU seconds, voluntary and involuntary context switches (this process)
        cpu = [(now - then) / b["calls"] for now, then in zip((time.process_time(), ru.ru_nvcsw, ru.ru_nivcsw), b["ru0"])]
        parts = [x / b["calls"] for x in b["parts"]] + cpu
        if self.bank_index != 0:
            self.cmd.send({"to": 0, "op": "sampled", "key": b["key"], "s": s, "items": items, "keep": b["keep"],
                           "parts": parts})
            return
        if b["keep"]:
            self._keep(b["key"], s, items, parts)
        self.results.setdefault("batch_fields_nbytes",
                                {k: v.numel() * v.element_size() for k, v in batch.data.items()})
        self._advance()

    @reaction(triggers=[shutdown])
    def close_clients(self) -> None:  # the run may end before replica 1 sees "close"
        for c in getattr(self, "clients", {}).values():
            c.close()

    def _keep(self, key: str, s: float, items: float, parts: list[float]) -> None:
        self._record(key, s)
        self._record(f"{key}_items", items)
        self._record(f"{key}_parts", parts)

    # ------------------------------------------------------------------ the end

    def _finish(self) -> None:
        self.results["client"] = {"gathered_items": self.client.gathered_items,
                                  "dropped_items": self.client.dropped_items}
        self.results["out_nbytes"] = self.out_nbytes
        self.results["mapped_kb"] = mapped_kb()  # (the shards' memory this requester maps, and on 2 MiB pages)
        self.results["wall_s"] = time.perf_counter() - self.t_start
        self.results["finished_at"] = time.time()
        self.client.close()
        self.cmd.send({"to": 1, "op": "close"})
        self.plan = None
        if self.cfg.get("report"):
            with open(self.cfg["report"], "w") as f:
                json.dump(self.results, f)
        self.request_stop()


def _at_once(coro):  # noqa: ANN001, ANN202
    """Run a coroutine that never waits (one-sided samples of shards on this host) from sync code."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a one-sided sample of this host's shards waited")


def _to(message: dict) -> int:
    return int(message["to"])


def _coordinator(message: object) -> int:
    return 0  # bench[0] runs the plan


def build(config: dict) -> Graph:
    c = {"shards": 4, "writers": 4, "capacity": 1 << 20, "envs": 64, "window": 32, "batch": 256, "reps": 5,
         "calls": 20, "round_rows": 1 << 16, "inflight": 1, "chunk_length": 256, "flush_steps": 1024, "notice_every": 64,
         "stage": 1, "ack_every": 0, "report": ""}
    c.update(config)
    for k in c:
        if k != "report":
            c[k] = int(c[k])
    if c["capacity"] % c["shards"]:
        raise ValueError(f"capacity {c['capacity']} must be a multiple of shards {c['shards']}")
    g = Graph()
    writers = g.add(FillWriter(c["shards"], c["envs"], c["window"], c["chunk_length"], c["flush_steps"],
                               bool(c["stage"]), c["ack_every"] or None),
                    name="writer", replicas=c["writers"])
    replay = g.add(Replay(FIELDS, c["capacity"] // c["shards"], read=WindowRead(c["window"], "tail"),
                          sampler={"type": "Prioritized", "alpha": ALPHA}, beta=BETA,
                          rate_limiter={"type": "MinSize", "min_size": 1}, remote_reads="zmq"),
                   name="replay", replicas=c["shards"])
    bench = g.add(Bench(c), name="bench", replicas=2)
    g.connect(bench.go, writers.go)
    g.connect(bench.cmd, bench.cmd_in, key=_to, delay_s=0.001)
    # The links back to the bench carry a logical delay (a graph needs one on every cycle); in async runs
    # (the benchmark's) delays only set tags, they never hold a message back.
    g.connect(writers.done, bench.done, key=_coordinator, delay_s=0.001)
    g.connect(writers.steps, replay.steps, key=shard_key)
    g.connect(replay.acks, writers.acks, key=writer_key, delay_s=0.001)
    g.connect(bench.requests, replay.requests, key=shard_key)
    g.connect(bench.updates, replay.updates, key=shard_key)
    g.connect(replay.replies, bench.replies, key=requester_key, delay_s=0.001)
    g.connect(bench.control, replay.control)
    g.connect(replay.statistics, bench.statistics, key=_coordinator, delay_s=0.001)
    return g
