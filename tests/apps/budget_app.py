"""Test app: a shard whose inserts wait for samples, and a reader whose one-sided draws took those
samples without telling the shard (as a data-parallel replica holding its notices through its round).

One Replay shard with ``SampleToInsertRatio(1, 1, (0, 40))``: an insert of ``n`` goes in while
``inserts + n - samples <= 40``, a sample of ``n`` while ``samples + n <= inserts``. A Filler sends
ten messages of ten one-step episodes at once: four go in (40 steps), six park. The Prober waits for
that, samples 5 items through messages (which brings the one-sided offer), draws 25 one-sidedly
(the limiter's count is now 30) and keeps the notices, then asks for 20 through messages: more than
the 10 the limiter allows at 40 inserts. The parked inserts fit since the draws (``50 - 30 <= 40``):
the shard must see that when the request arrives, admit them and answer it. The Prober gives up
after ``patience_s`` and records what came.

config keys: out (npz path), patience_s (5.0).
"""

from __future__ import annotations

import time

import numpy as np

from reactor import Action, Graph, Input, Output, Reactor, reaction, startup
from reactor.nodes import Replay, ReplayClient, StatisticsRequest, Steps, requester_key, shard_key
from reactor.nodes.messages import ItemUpdate, ReplayControl, ReplayReply, ReplayRequest, ShardStatistics
from reactor.replay import StepRead

FIELDS = [("id", (), "int64")]


class Filler(Reactor):
    placement_role = "actor"
    steps = Output(Steps)

    @reaction(triggers=[startup], effects=[steps])
    def fill(self) -> None:
        for m in range(10):
            ids = np.arange(10 * m, 10 * m + 10, dtype=np.int64)
            self.steps.send(Steps(0, -1, m, {"id": ids}, np.ones(10, bool), None, np.ones(10)))


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
        self.phase = "filling"
        self.rec: dict = {}

    @reaction(triggers=[startup], effects=[control])
    def begin(self) -> None:
        self.client = ReplayClient(1, requester=self.bank_index, rng=self.rng, timeout_s=60.0, bulk=True)
        self.control.send(StatisticsRequest())

    @reaction(triggers=[poll], effects=[control])
    def ask(self) -> None:
        self.control.send(StatisticsRequest())

    @reaction(triggers=[statistics], effects=[requests, poll])
    def counted(self, statistics: ShardStatistics) -> None:
        if self.phase == "filling":
            if statistics.num_steps < 40 or statistics.parked_steps < 60:
                self.poll.schedule(delay_s=0.01)
                return
            self.rec["parked_before"] = statistics.parked_steps
            self.phase = "first"
            for m in self.client.request(5):
                self.requests.send(m)
        elif self.phase == "waiting":
            if time.monotonic() < self.deadline:
                self.poll.schedule(delay_s=0.05)
                return
            self.finish(statistics, answered=False)
        elif self.phase == "done":
            self.finish(statistics, answered=True)

    @reaction(triggers=[replies], effects=[requests, control])
    def take(self, replies: ReplayReply) -> None:
        msgs, batch = self.client.receive(replies)
        for m in msgs:
            self.requests.send(m)
        if batch is None:
            return
        if self.phase == "first":
            self.rec["offered"] = self.client.can_sample_now
            drawn, notices = self.client.sample_now(25)
            self.rec["one_sided"] = 0 if drawn is None else len(drawn.keys)
            self.rec["held_back"] = sum(len(m.keys) for m in notices) + sum(
                len(m.keys) for m in self.client.take_notices())  # dropped: never sent
            self.phase = "waiting"
            self.deadline = time.monotonic() + self.cfg.get("patience_s", 5.0)
            for m in self.client.request(20):
                self.requests.send(m)
            self.control.send(StatisticsRequest())
        elif self.phase == "waiting":
            self.rec["answered_items"] = len(batch.keys)
            self.phase = "done"
            self.control.send(StatisticsRequest())

    def finish(self, st: ShardStatistics, answered: bool) -> None:
        if self.phase == "finished":
            return
        self.phase = "finished"
        np.savez(self.cfg["out"], answered=answered, inserted=st.inserted, sampled=st.sampled,
                 parked_steps=st.parked_steps, parked_requests=st.parked_requests,
                 **{k: v for k, v in self.rec.items()})
        self.client.close()
        self.request_stop()


def build(config: dict) -> Graph:
    g = Graph()
    filler = g.add(Filler(), name="filler")
    replay = g.add(Replay(FIELDS, capacity=1024, read=StepRead(), sampler="uniform",
                          rate_limiter={"type": "SampleToInsertRatio", "samples_per_insert": 1.0, "min_size": 1,
                                        "error_buffer": [0.0, 40.0]}), name="replay")
    prober = g.add(Prober(config), name="prober")
    g.connect(filler.steps, replay.steps, key=shard_key)
    g.connect(prober.requests, replay.requests, key=shard_key)
    g.connect(prober.updates, replay.updates, key=shard_key)
    g.connect(prober.control, replay.control)
    g.connect(replay.replies, prober.replies, key=requester_key, delay_s=0.001)
    g.connect(replay.statistics, prober.statistics, delay_s=0.001)
    return g
