"""A run stopped by a SIGTERM to every one of its processes (tests/integration/test_placements.py): a feeder
inserts items into a bank of Replay shards (``checkpoint_on_shutdown``) until stopped; in the shards' process a
``Closer`` whose shutdown reaction awaits (as a learner's save in a thread does) runs first.

config: ``run_dir`` (the shards' checkpoints; each shard's ``inserted`` mark there says it holds items),
``closed_file`` (the closer's shutdown reaction writes ``stopped_by`` there once its await is over),
``close_s`` (how long it awaits, 1.0), ``shards`` (2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from reactor import Graph, Output, Reactor, Timer, reaction, shutdown
from reactor.nodes import Replay, Steps, shard_key


class Feeder(Reactor):
    tick = Timer(period_s=0.01)
    steps = Output(Steps)

    def __init__(self, shards: int) -> None:
        self.shards, self.seq = shards, 0

    @reaction(triggers=[tick], effects=[steps])
    def feed(self) -> None:
        for shard in range(self.shards):
            ids = np.arange(4, dtype=np.int64) + 4 * self.seq
            self.steps.send(Steps(shard, 0, self.seq, {"id": ids}, np.ones(4, bool)))
        self.seq += 1


class Closer(Reactor):
    def __init__(self, closed_file: str, close_s: float) -> None:
        self.closed_file, self.close_s = closed_file, close_s

    @reaction(triggers=[shutdown])
    async def close(self) -> None:
        await asyncio.sleep(self.close_s)
        Path(self.closed_file).write_text(str(self.stopped_by))


def build(config: dict) -> Graph:
    shards = int(config.get("shards", 2))
    g = Graph()
    g.add(Closer(str(config["closed_file"]), float(config.get("close_s", 1.0))), name="closer")
    replay = g.add(Replay([("id", (), "int64")], 10_000, sampler="uniform", run_dir=str(config["run_dir"]),
                          checkpoint_on_shutdown=True), name="replay", replicas=shards)
    feeder = g.add(Feeder(shards), name="feeder")
    g.connect(feeder.steps, replay.steps, key=shard_key)
    return g
