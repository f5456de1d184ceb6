"""Test app: a filler writes known episodes into N Replay shards; a prober samples them one-sidedly.

config keys (all optional):
    shards (2), episodes (40 per shard), window (8; 0: StepRead), pad ("tail"), transition (0; n > 0:
    TransitionRead(n, 0.9, reward_field="x", next_fields=("id", "x")) instead of windows), sampler ("prioritized"
    or "uniform"), alpha (0.7), beta (0.5), batch_size (64), batches (one-sided batches, 30),
    max_times_sampled (0), limiter ("minsize", or "ratio": SampleToInsertRatio(spi, 1, (0, 1e9)), which
    allows ``floor(inserts * spi)`` samples a shard), spi (100.0), capacity (4096 steps a shard), out (npz path of the prober's record),
    remote (False: the prober maps the shards' memory; True: it acts as a learner on another host, and
    the shards' bulk read servers sample for it), kill_shard (None; a shard: after one one-sided batch
    the prober SIGKILLs that shard's process, waits until it is gone, samples one-sidedly once more at
    once, records what that raised as ``killed`` and stops the run), spoil_shard (None; a shard: after one
    one-sided batch the prober, from this host, writes -1 over that shard's first stored step in its
    published sampling state (its count left settled: corrupt memory), samples one-sidedly once more,
    records what that raised as ``spoiled`` and stops the run).

Each shard gets ``episodes`` episodes of 1..20 steps from one message; a step's ``id`` is
``shard * 1_000_000 + its global step in the shard`` and ``end`` the id one past its episode's last
step; its priority is :func:`priority` of the id. The prober waits until every shard holds every
step, takes one sample through messages (which brings the shards' one-sided offers), then draws
``batches`` batches with ``ReplayClient.sample_now``, sends the notices (those the client returns, then
those it still holds), and waits until the shards' statistics count every draw.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from reactor import Action, Graph, Input, Output, PeerLostError, Reactor, reaction, startup
from reactor.nodes import Replay, ReplayClient, StatisticsRequest, Steps, requester_key, shard_key
from reactor.nodes.messages import ItemUpdate, ReplayControl, ReplayReply, ReplayRequest, ShardStatistics
from reactor.replay import StepRead, TransitionRead, WindowRead

FIELDS = [("id", (), "int64"), ("end", (), "int64"), ("x", (3,), "float32")]
SHARD_IDS = 1_000_000


def priority(ids: np.ndarray) -> np.ndarray:
    """Uneven priorities: three classes by id, a factor 9 apart."""
    return np.array([0.5, 1.5, 4.5])[np.asarray(ids) % 3]


def episodes(shard: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, ends, episode_end flags)`` of the shard's steps."""
    lens = np.random.default_rng(100 + shard).integers(1, 21, size=count)
    n = int(lens.sum())
    ids = shard * SHARD_IDS + np.arange(n, dtype=np.int64)
    stops = np.cumsum(lens)
    ends = np.repeat(shard * SHARD_IDS + stops, lens)
    flags = np.zeros(n, dtype=bool)
    flags[stops - 1] = True
    return ids, ends, flags


class Filler(Reactor):
    placement_role = "actor"
    steps = Output(Steps)

    def __init__(self, shards: int, episodes: int) -> None:
        self.shards = shards
        self.episodes = episodes

    @reaction(triggers=[startup], effects=[steps])
    def fill(self) -> None:
        for shard in range(self.shards):
            ids, ends, flags = episodes(shard, self.episodes)
            x = np.stack([ids, ids + 1, ids + 2], axis=1).astype(np.float32)
            self.steps.send(Steps(shard, -1, 0, {"id": ids, "end": ends, "x": x}, flags, None, priority(ids)))


class Prober(Reactor):
    placement_role = "learner"
    requests = Output(ReplayRequest)
    updates = Output(ItemUpdate)
    control = Output(ReplayControl)
    replies = Input(ReplayReply)
    statistics = Input(ShardStatistics)
    poll = Action()

    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.shards = cfg.get("shards", 2)
        self.expected = sum(len(episodes(s, cfg.get("episodes", 40))[0]) for s in range(self.shards))
        self.phase = "filling"
        self.rec: dict[str, list] = {k: [] for k in ("keys", "ids", "mask", "probs", "weights", "times", "sizes")}

    @reaction(triggers=[startup], effects=[control])
    def begin(self) -> None:
        remote = self.cfg.get("remote", False)  # as if on another host: the shards' read servers sample
        self.client = ReplayClient(self.shards, requester=self.bank_index, rng=self.rng, timeout_s=60.0,
                                   bulk=not remote, remote_reads="zmq" if remote else "off",
                                   curve=self.process_link.curve)
        self.stats: dict[int, ShardStatistics] = {}
        self.control.send(StatisticsRequest())

    @reaction(triggers=[poll], effects=[control])
    def ask(self) -> None:
        self.stats = {}
        self.control.send(StatisticsRequest())

    @reaction(triggers=[statistics], effects=[requests, poll])
    def counted(self, statistics: ShardStatistics) -> None:
        self.stats[statistics.shard] = statistics
        if len(self.stats) < self.shards:
            return
        st = [self.stats[k] for k in range(self.shards)]
        if self.phase == "filling":
            if sum(s.num_steps for s in st) < self.expected:
                self.poll.schedule(delay_s=0.01)
                return
            self.phase = "first"
            for m in self.client.request(self.cfg.get("batch_size", 64)):
                self.requests.send(m)
        elif self.phase == "counting":
            if sum(s.sampled for s in st) < self.draws:
                self.poll.schedule(delay_s=0.01)
                return
            self.finish(st)

    @reaction(triggers=[replies], effects=[requests, updates, poll])
    async def take(self, replies: ReplayReply) -> None:
        msgs, batch = await self.client.areceive(replies)
        for m in msgs:
            self.requests.send(m)
        if batch is None:
            return
        self.draws = len(batch.keys)
        self.offered = self.client.can_sample_one_sided
        self.fallbacks = 0
        if self.cfg.get("kill_shard") is not None:
            self._kill_and_sample(int(self.cfg["kill_shard"]))
            return
        if self.cfg.get("spoil_shard") is not None:
            await self._spoil_and_sample(int(self.cfg["spoil_shard"]))
            return
        for _ in range(self.cfg.get("batches", 30)):
            b, notices = await self.client.asample_now(self.cfg.get("batch_size", 64))
            self._tell(notices)
            if b is None:
                self.fallbacks += 1
                continue
            self.rec["keys"].append(b.keys.numpy())
            self.rec["ids"].append(b.data["id"].numpy())
            self.rec["mask"].append(b.data["mask"].numpy() if "mask" in b.data else np.ones(len(b.keys), bool))
            for f in ("x", "discount", "valid", "next_id", "next_x"):
                if f in b.data:
                    self.rec.setdefault(f, []).append(b.data[f].numpy())
            self.rec["probs"].append(b.probabilities.numpy())
            self.rec["weights"].append(b.weights.numpy())
            self.rec["times"].append(b.times_sampled.numpy())
            self.rec["sizes"].append(b.table_size)
        self._tell(self.client.take_notices())  # what the client still holds (it sends every 8 samples' at once)
        self.phase = "counting"
        self.poll.schedule(delay_s=0.01)

    def _kill_and_sample(self, shard: int) -> None:
        """A one-sided batch; SIGKILL ``shard``'s process and wait until it is reaped; one more batch at
        once, with no await between (so no word of the loss can reach the client first)."""
        bs = self.cfg.get("batch_size", 64)
        before, _ = self.client.sample_now(bs)
        pid = self.client._reader._regions[self.client._shared[shard].data_region].owner[0]  # the shard's process
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.005)
        try:
            after = self.client.sample_now(bs)[0]
            killed = f"returned {'a batch' if after is not None else 'no batch'}"
        except PeerLostError as e:
            killed = f"{type(e).__name__}|{getattr(e, 'shard', None)}|{e}"
        np.savez(self.cfg["out"], before=before is not None and len(before.keys) == bs, killed=killed,
                 reaped=not os.path.exists(f"/proc/{pid}"))
        self.request_stop()

    async def _spoil_and_sample(self, shard: int) -> None:
        """A one-sided batch; -1 written over ``shard``'s first stored step in its published state, as a
        hostile process of its host would (no notice is sent meanwhile: the shard's next change would
        publish its header again); one more batch."""
        from reactor import MalformedFrameError
        from reactor.transport import _shm

        bs = self.cfg.get("batch_size", 64)
        before, _ = await self.client.asample_now(bs)
        seg = _shm.Segment.attach(_shm.segment_name(self.run_id, f"-s-replay-{shard}", "header"), writable=True)
        try:
            seg.data.view(np.int64)[1] = -1
        finally:
            seg.close_reader()
        try:
            after = (await self.client.asample_now(bs))[0]
            spoiled = f"returned {'a batch' if after is not None else 'no batch'}"
        except MalformedFrameError as e:
            spoiled = f"{type(e).__name__}|{getattr(e, 'shard', None)}|{e}"
        np.savez(self.cfg["out"], before=before is not None and len(before.keys) == bs, spoiled=spoiled)
        self.client.close()  # (its read connections: a run in the test's process would leave them to the collector)
        self.request_stop()

    def _tell(self, notices: list) -> None:
        """Send one-sided draws' notices to their shards; count the draws they report."""
        for m in notices:
            self.updates.send(m)
        self.draws += sum(len(m.keys) for m in notices)

    def finish(self, st: list[ShardStatistics]) -> None:
        out = {k: np.array(v) if k == "sizes" else (np.concatenate(v) if v else np.zeros(0)) for k, v in
               self.rec.items()}
        np.savez(self.cfg["out"], **out, offered=self.offered, fallbacks=self.fallbacks,
                 one_sided=self.client.one_sided_samples, retries=self.client.one_sided_retries,
                 dropped=self.client.dropped_items, sampled=np.array([s.sampled for s in st]), draws=self.draws)
        self.client.close()
        self.request_stop()


def build(config: dict) -> Graph:
    shards = config.get("shards", 2)
    window = config.get("window", 8)
    limiter = ({"type": "MinSize", "min_size": 1} if config.get("limiter", "minsize") == "minsize" else
               {"type": "SampleToInsertRatio", "samples_per_insert": config.get("spi", 100.0), "min_size": 1,
                "error_buffer": [0.0, 1e9]})
    sampler = ({"type": "prioritized", "alpha": config.get("alpha", 0.7)} if config.get("sampler", "prioritized") ==
               "prioritized" else "uniform")
    g = Graph()
    filler = g.add(Filler(shards, config.get("episodes", 40)), name="filler")
    read = WindowRead(window, config.get("pad", "tail")) if window else StepRead()
    if config.get("transition"):
        read = TransitionRead(config["transition"], 0.9, reward_field="x", next_fields=("id", "x"))
    replay = g.add(Replay(FIELDS, capacity=config.get("capacity", 4096), read=read, sampler=sampler, rate_limiter=limiter, beta=config.get("beta", 0.5),
                          max_times_sampled=config.get("max_times_sampled", 0),
                          remote_reads="zmq" if config.get("remote") else "auto",
                          bulk=True if config.get("transition") else None), name="replay", replicas=shards)
    prober = g.add(Prober(config), name="prober")
    g.connect(filler.steps, replay.steps, key=shard_key)
    g.connect(prober.requests, replay.requests, key=shard_key)
    g.connect(prober.updates, replay.updates, key=shard_key)
    g.connect(prober.control, replay.control)
    g.connect(replay.replies, prober.replies, key=requester_key, delay_s=0.001)
    g.connect(replay.statistics, prober.statistics, delay_s=0.001)
    return g
