"""Test app: actors (real gymnasium CartPole or fixed items) -> Replay shards -> a sampling learner.

config keys (all optional):
    shards: replay bank size (4)           actors: actor bank size (2)
    source: "gym" | "items" | "bad" | "markers"   gym actors, fixed prioritized items, a malformed
                                           writer, or writers of good rows and malformed end markers
    writers: Replay(writers=actors): shards count their writers' end markers (gym actors then end
             their writers with Writer.end; "markers" writers also send good markers)
    good_markers: "markers" writers end with a good marker too (True)
    ratio, error_buffer: a SampleToInsertRatio limiter (samples per insert) instead of MinSize
    envs, env_steps: vector env size and steps per gym actor (4, 150)
    read: "transition" | "window"          what the table reads (gym source)
    items: number of fixed items (400)     alpha, beta: Prioritized exponents (1.0, 0.5)
    min_size: per-shard MinSize            batches, batch_size: what the learner draws (20, 64)
    update: "none" | "random" | "boost" | "zero"   priority updates after each batch (zero: the first
                                           batch's items get priority 0)
    out: npz path for the learner's record; stats_out: npz path for the shards' statistics
    run_dir, checkpoint_on_shutdown, checkpoint_period_s: replay checkpoints
    timeout_s, skip_lost: the client's shard timeout; die_shard, die_after: a shard that exits
    bulk: Replay(bulk=...) (None: auto)
    memory: Replay(memory=...) ("host")
    remote: "" or "zmq": the learner acts as if on another host (no shared memory) and reads the
                                           windows one-sidedly from the shards' bulk zmq read servers
"""

from __future__ import annotations

import hashlib
import os
import signal

import numpy as np

from reactor import Action, Graph, Input, Output, Reactor, reaction, shutdown, startup
from reactor.nodes import (
    Replay,
    ReplayClient,
    StatisticsRequest,
    Steps,
    TransitionPattern,
    WindowPattern,
    Writer,
    requester_key,
    shard_key,
)
from reactor.nodes.messages import ItemUpdate, ReplayControl, ReplayReply, ReplayRequest, ShardStatistics
from reactor.replay import TransitionRead, WindowRead

GYM_FIELDS = [("obs", (4,), "float32"), ("action", (), "int64"), ("reward", (), "float32"), ("terminated", (), "bool")]
ITEM_FIELDS = [("id", (), "int64")]


def item_priority(ids: np.ndarray) -> np.ndarray:
    """Fixed priorities of the "items" source: uneven across shards (id % shards) and within them."""
    ids = np.asarray(ids, dtype=np.int64)
    return 1.0 + 3.0 * (ids % 4) + (ids % 5) * 0.5


class GymActor(Reactor):
    """Steps a CartPole vector env with seeded random actions and writes through a Writer."""

    placement_role = "actor"
    steps = Output(Steps)
    step = Action()

    def __init__(self, num_shards: int, envs: int = 4, env_steps: int = 150, read: str = "transition",
                 end: bool = False) -> None:
        self.num_shards = num_shards
        self.envs = envs
        self.env_steps = env_steps
        self.read = read
        self.end = end
        self.k = 0

    @reaction(triggers=[startup], effects=[step])
    def open_env(self) -> None:
        import gymnasium as gym

        self.env = gym.make_vec("CartPole-v1", num_envs=self.envs, vectorization_mode="sync")
        self.obs, _ = self.env.reset(seed=int(self.rng.integers(2**31)))
        pattern = TransitionPattern(n=3, chunk_length=16) if self.read == "transition" else WindowPattern(8, chunk_length=16)
        self.writer = Writer(GYM_FIELDS, self.envs, pattern, num_shards=self.num_shards, writer_id=self.bank_index,
                             flush_steps=64)
        self.was_done = np.zeros(self.envs, dtype=bool)
        self.step.schedule(delay_s=0.001)

    @reaction(triggers=[step], effects=[steps, step])
    def act(self) -> None:
        action = self.rng.integers(0, 2, size=self.envs)
        obs2, reward, term, trunc, _ = self.env.step(action)
        active = ~self.was_done  # NEXT_STEP autoreset: this step only reset those envs
        msgs = self.writer.append({"obs": self.obs, "action": action, "reward": reward}, terminated=term,
                                  truncated=trunc, final={"obs": obs2}, active=active)
        self.was_done = (term | trunc) & active
        self.obs = obs2
        self.k += 1
        if self.k == self.env_steps:
            msgs += self.writer.end() if self.end else self.writer.flush()
        for m in msgs:
            self.steps.send(m)
        if self.k < self.env_steps:
            self.step.schedule(delay_s=0.001)


class ItemActor(Reactor):
    """Inserts fixed one-step items (ids with known priorities), a few per message, over time."""

    placement_role = "actor"
    steps = Output(Steps)
    step = Action()

    def __init__(self, num_shards: int, items: int, actors: int) -> None:
        self.num_shards = num_shards
        self.items = items
        self.actors = actors
        self.seq = 0

    @reaction(triggers=[startup], effects=[step])
    def begin(self) -> None:
        ids = np.arange(self.items, dtype=np.int64)
        ids = ids[(ids // self.num_shards) % self.actors == self.bank_index]
        self.batches = [ids[ids % self.num_shards == s] for s in range(self.num_shards)]
        self.step.schedule(delay_s=0.001)

    @reaction(triggers=[step], effects=[steps, step])
    def send(self) -> None:
        for shard, ids in enumerate(self.batches):
            take, self.batches[shard] = ids[:10], ids[10:]
            if len(take):
                self.steps.send(Steps(shard, self.bank_index, self.seq, {"id": take}, np.ones(len(take), bool), None,
                                      item_priority(take)))
        self.seq += 1
        if any(len(b) for b in self.batches):
            self.step.schedule(delay_s=0.001)


class BadWriter(Reactor):
    """Sends malformed Steps (wrong dtype, unknown field, open episode, wrong shard), then good ones."""

    placement_role = "actor"
    steps = Output(Steps)

    def __init__(self, num_shards: int) -> None:
        self.num_shards = num_shards

    @reaction(triggers=[startup], effects=[steps])
    def send(self) -> None:
        ids = np.arange(8, dtype=np.int64) + 100 * self.bank_index
        ends = np.ones(8, bool)
        for shard in range(self.num_shards):
            self.steps.send(Steps(shard, 9, 0, {"id": ids.astype(np.float64)}, ends))  # wrong dtype
            self.steps.send(Steps(shard, 9, 1, {"id": ids, "extra": ids}, ends))  # unknown field
            self.steps.send(Steps(shard, 9, 2, {"id": ids}, np.zeros(8, bool)))  # leaves an episode open
            self.steps.send(Steps(shard, 9, 3, {"id": ids[:4]}, ends))  # length mismatch with episode_end
            self.steps.send(Steps(shard, 9, 4, {"id": ids + 1000 * (shard + 1)}, ends))  # good


class MarkerWriter(Reactor):
    """Sends 8 good rows to every shard and 8 more marked ``last=np.False_`` (a numpy bool: rows, not
    a marker), then malformed end markers (rows in a marker, an unknown writer id, a ``last`` that
    is no bool) and, with ``good``, a good one followed by a refused rows message of its own and 8
    good rows under writer id ``True`` (neither may count as the writer coming back)."""

    placement_role = "actor"
    steps = Output(Steps)

    def __init__(self, num_shards: int, good: bool) -> None:
        self.num_shards = num_shards
        self.good = good

    @reaction(triggers=[startup], effects=[steps])
    def send(self) -> None:
        ids = np.arange(8, dtype=np.int64) + 100 * self.bank_index
        ends, none = np.ones(8, bool), np.zeros(0, bool)
        me = self.bank_index
        for shard in range(self.num_shards):
            self.steps.send(Steps(shard, me, 0, {"id": ids + 1000 * shard}, ends))  # good rows
            self.steps.send(Steps(shard, me, 5, {"id": ids + 1000 * shard + 10}, ends, last=np.False_))
            self.steps.send(Steps(shard, me, 1, {"id": ids}, ends, last=True))  # a marker with rows
            self.steps.send(Steps(shard, 99, 2, {}, none, last=True))  # a writer the bank does not have
            self.steps.send(Steps(shard, me, 3, {}, none, last="yes"))  # type: ignore[arg-type]
            if self.good:
                self.steps.send(Steps(shard, me, 4, {}, none, last=True))
                self.steps.send(Steps(shard, me, 6, {"id": ids.astype(np.float64)}, ends))  # refused: wrong dtype
                self.steps.send(Steps(shard, True, 7, {"id": ids + 1000 * shard + 20}, ends))  # type: ignore[arg-type]


class Sampler(Reactor):
    """Draws ``batches`` batches through a ReplayClient, optionally updating priorities; records them."""

    placement_role = "learner"
    requests = Output(ReplayRequest)
    updates = Output(ItemUpdate)
    control = Output(ReplayControl)
    replies = Input(ReplayReply)
    check = Action()

    def __init__(self, num_shards: int, batch_size: int, batches: int, update: str = "none", out: str = "",
                 timeout_s: float | None = None, skip_lost: bool = False, masses: str = "cached",
                 remote: str = "") -> None:
        self.num_shards = num_shards
        self.remote = remote
        self.masses = masses
        self.batch_size = batch_size
        self.batches = batches
        self.update = update
        self.out = out
        self.timeout_s = timeout_s
        self.skip_lost = skip_lost
        self.record: dict[str, list] = {k: [] for k in ("keys", "ids", "probs", "weights", "sizes", "t_ns",
                                                        "curve_keys")}
        self.digest = hashlib.sha256()
        self.boosted: set[int] = set()
        self.error = ""
        self.stats_asked = False

    @reaction(triggers=[startup], effects=[requests, check])
    def begin(self) -> None:
        self.client = ReplayClient(self.num_shards, requester=self.bank_index, rng=self.rng,
                                   timeout_s=self.timeout_s, skip_lost_shards=self.skip_lost, masses=self.masses,
                                   bulk=not self.remote, remote_reads=self.remote or "auto",
                                   curve=self.process_link.curve)
        for m in self.client.request(self.batch_size):
            self.requests.send(m)
        if self.timeout_s is not None:
            self.check.schedule(delay_s=0.2)

    @reaction(triggers=[check], effects=[requests, check])
    def check_timeouts(self) -> None:
        try:
            for m in self.client.check_timeouts():
                self.requests.send(m)
        except Exception as e:  # noqa: BLE001 - recorded for the test
            self.error = f"{type(e).__name__}: {e}"
            self.request_stop()
            return
        if len(self.record["keys"]) < self.batches:
            self.check.schedule(delay_s=0.2)

    @reaction(triggers=[replies], effects=[requests, updates, control])
    async def take(self, replies: ReplayReply) -> None:
        desc = getattr(replies, "descriptor", None)
        if desc is not None and self.remote:  # which read servers this client reached, and whether over CURVE
            self.record["curve_keys"].append(bool(desc.get(self.remote, {}).get("server_key")))
        msgs, batch = await self.client.areceive(replies)
        for m in msgs:
            self.requests.send(m)
        if batch is None:
            if self.client.exhausted and not self.stats_asked:  # no sample can come: the shards' figures now
                self.stats_asked = True
                self.control.send(StatisticsRequest())
            return
        r = self.record
        r["keys"].append(batch.keys.numpy().copy())
        r["ids"].append(batch.data["id"].numpy().copy() if "id" in batch.data else batch.keys.numpy().copy())
        r["probs"].append(batch.probabilities.numpy().copy())
        r["weights"].append(batch.weights.numpy().copy())
        r["sizes"].append(batch.table_size)
        r["t_ns"].append(self.tag.time_ns)
        for name in sorted(batch.data):
            self.digest.update(batch.data[name].numpy().tobytes())
        if self.update == "random":
            p = self.rng.random(len(batch.keys)) + 0.01
            for m in self.client.update_priorities(batch.keys, p):
                self.updates.send(m)
        elif self.update == "zero" and len(r["keys"]) == 1:  # every sampled item's priority to 0
            for m in self.client.update_priorities(batch.keys, np.zeros(len(batch.keys))):
                self.updates.send(m)
        elif self.update == "boost" and len(r["keys"]) == 1:
            self.boosted = set(batch.keys.tolist())
            for m in self.client.update_priorities(batch.keys, np.full(len(batch.keys), 1000.0)):
                self.updates.send(m)
        if len(r["keys"]) < self.batches:
            for m in self.client.request(self.batch_size):
                self.requests.send(m)
        else:
            self.control.send(StatisticsRequest())

    @reaction(triggers=[shutdown])
    def save(self) -> None:
        self.client.close()
        if not self.out:
            return
        r = self.record
        cat = {k: np.concatenate(v) if v and isinstance(v[0], np.ndarray) else np.asarray(v) for k, v in r.items()}
        lens = np.array([len(k) for k in r["keys"]], dtype=np.int64)
        np.savez(self.out, lens=lens, digest=np.frombuffer(self.digest.digest(), np.uint8),
                 gathered=np.array(self.client.gathered_items), dropped=np.array(self.client.dropped_items),
                 boosted=np.array(sorted(self.boosted), dtype=np.int64), error=np.array(self.error),
                 exhausted=np.array(self.client.exhausted), **cat)


class StatsSink(Reactor):
    """Keeps the latest ShardStatistics of each shard; saves them at shutdown."""

    statistics = Input(ShardStatistics)

    def __init__(self, out: str = "") -> None:
        self.out = out
        self.latest: dict[int, ShardStatistics] = {}

    @reaction(triggers=[statistics])
    def keep(self, statistics: ShardStatistics) -> None:
        self.latest[statistics.shard] = statistics

    @reaction(triggers=[shutdown])
    def save(self) -> None:
        if self.out:
            names = ("size", "num_steps", "inserted", "sampled", "rejected_steps", "parked_requests", "checkpoints")
            shards = sorted(self.latest)
            arrays = {n: np.array([getattr(self.latest[s], n) for s in shards]) for n in names}
            restored = np.array([self.latest[s].restored_from for s in shards])
            np.savez(self.out, shards=np.array(shards), restored_from=restored, **arrays)


class DyingReplay(Replay):
    """A Replay shard that kills its own process after answering ``die_after`` requests (a crash)."""

    def __init__(self, *args, die_shard: int = -1, die_after: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.die_shard = die_shard
        self.die_after = die_after
        self.answered = 0

    @reaction(triggers=[Replay.requests], effects=[Replay.replies])
    def serve_request(self, requests) -> None:
        if self.bank_index == self.die_shard and self.answered >= self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        self.answered += 1
        super().serve_request(requests)


def build(config: dict) -> Graph:
    c = dict(config)
    shards = int(c.get("shards", 4))
    actors = int(c.get("actors", 2))
    source = c.get("source", "gym")
    read_kind = c.get("read", "transition")
    g = Graph()
    if source == "gym":
        fields = GYM_FIELDS
        read = TransitionRead(3, 0.99, next_fields=("obs", "terminated")) if read_kind == "transition" else WindowRead(8)
        sampler = {"type": "Prioritized", "alpha": float(c.get("alpha", 0.6))}
        writers = g.add(GymActor(shards, int(c.get("envs", 4)), int(c.get("env_steps", 150)), read_kind,
                                 end=bool(c.get("writers"))), name="actor", replicas=actors)
    elif source == "items":
        fields = ITEM_FIELDS
        read = None
        sampler = {"type": "Prioritized", "alpha": float(c.get("alpha", 1.0))}
        writers = g.add(ItemActor(shards, int(c.get("items", 400)), actors), name="actor", replicas=actors)
    elif source == "markers":
        fields = ITEM_FIELDS
        read = None
        sampler = "uniform"
        writers = g.add(MarkerWriter(shards, bool(c.get("good_markers", True))), name="actor", replicas=actors)
    else:
        fields = ITEM_FIELDS
        read = None
        sampler = "uniform"
        writers = g.add(BadWriter(shards), name="actor", replicas=actors)
    kwargs = {"read": read} if read is not None else {}
    die = int(c.get("die_shard", -1))
    replay_cls = DyingReplay if die >= 0 else Replay
    extra = {"die_shard": die, "die_after": int(c.get("die_after", 0))} if die >= 0 else {}
    replay = g.add(
        replay_cls(
            fields, int(c.get("capacity", 10_000)), sampler=sampler, beta=float(c.get("beta", 0.5)),
            rate_limiter={"type": "MinSize", "min_size": int(c.get("min_size", 1))} if c.get("ratio") is None else {
                "type": "SampleToInsertRatio", "samples_per_insert": float(c["ratio"]),
                "min_size": int(c.get("min_size", 1)), "error_buffer": float(c.get("error_buffer", 200))},
            writers=actors if c.get("writers") else None,
            run_dir=c.get("run_dir"), checkpoint_on_shutdown=bool(c.get("checkpoint_on_shutdown", False)),
            checkpoint_period_s=c.get("checkpoint_period_s"), bulk=c.get("bulk"),
            remote_reads=c.get("remote") or "auto", memory=c.get("memory", "host"), **kwargs, **extra,
        ),
        name="replay", replicas=shards,
    )
    learner = g.add(Sampler(shards, int(c.get("batch_size", 64)), int(c.get("batches", 20)), c.get("update", "none"),
                            c.get("out", ""), c.get("timeout_s"), bool(c.get("skip_lost", False)),
                            c.get("masses", "cached"), c.get("remote", "")), name="learner")
    stats = g.add(StatsSink(c.get("stats_out", "")), name="stats")
    g.connect(writers.steps, replay.steps, key=shard_key)
    g.connect(learner.requests, replay.requests, key=shard_key)
    g.connect(learner.updates, replay.updates, key=shard_key)
    g.connect(learner.control, replay.control)
    g.connect(replay.replies, learner.replies, key=requester_key, delay_s=0.001)  # breaks the request loop
    g.connect(replay.statistics, stats.statistics)
    return g
