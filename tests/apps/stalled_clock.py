"""Test app: a writer whose logical clock stands still while wall time passes, into one Replay shard.

A learner that draws one-sidedly in an async run steps by zero-delay actions (one microstep each) while
its updates take wall time, and its messages reach the shards with that tag; writers held back by flow
control resume at the tags of the shards' acknowledgements. So in an async DQN run the shards' tags
stayed under a millisecond for its whole minute. This writer does the same, plainly: every ``pause_s``
of wall time (slept in its reaction, as an update takes it) it sends one whole episode to the shard
and schedules its next step with no delay, ``messages`` times, then the run ends.

config keys: run_dir (required), messages (200), pause_s (0.005), period_s (the shard's
checkpoint_period_s, 0.02), async_period_s (its async_checkpoint_period_s, None).
"""

from __future__ import annotations

import time

import numpy as np

from reactor import Action, Graph, Output, Reactor, reaction, startup
from reactor.nodes import Replay, Steps, shard_key


class StalledWriter(Reactor):
    """Sends ``messages`` one-step episodes, ``pause_s`` of wall time apart, at logical time 0."""

    placement_role = "learner"
    steps = Output(Steps)
    again = Action()

    def __init__(self, messages: int, pause_s: float) -> None:
        self.messages = messages
        self.pause_s = pause_s
        self.sent = 0

    @reaction(triggers=[startup, again], effects=[steps, again])
    def step(self) -> None:
        time.sleep(self.pause_s)  # (an update's wall time)
        self.steps.send(Steps(0, 0, self.sent, {"x": np.array([self.sent], np.int64)}, np.ones(1, bool)))
        self.sent += 1
        if self.sent < self.messages:
            self.again.schedule()  # no delay: the next microstep of the same logical time


def build(config: dict) -> Graph:
    g = Graph()
    w = g.add(StalledWriter(int(config.get("messages", 200)), float(config.get("pause_s", 0.005))), name="writer")
    r = g.add(Replay([("x", (), "int64")], 1024, run_dir=str(config["run_dir"]), keep_checkpoints=10_000,
                     checkpoint_period_s=float(config.get("period_s", 0.02)),
                     async_checkpoint_period_s=config.get("async_period_s")), name="replay", replicas=1)
    g.connect(w.steps, r.steps, key=shard_key)
    return g
