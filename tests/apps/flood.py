"""Test app: a producer far faster than its consumer, across processes (backpressure)."""

from __future__ import annotations

import asyncio

import numpy as np

from reactor import Action, Graph, Input, Output, Reactor, reaction, startup


class Flooder(Reactor):
    out = Output(object)
    more = Action()

    def __init__(self, count: int = 2000, nbytes: int = 4096) -> None:
        self.count = count
        self.nbytes = nbytes
        self.k = 0

    @reaction(triggers=[startup, more], effects=[out, more])
    def burst(self) -> None:
        for _ in range(10):
            if self.k == self.count:
                return
            self.out.send({"k": self.k, "pad": np.full(self.nbytes // 8, self.k, dtype=np.int64)})
            self.k += 1
        self.more.schedule()


class SlowConsumer(Reactor):
    inp = Input(object, required=True)

    def __init__(self, delay_s: float = 0.0002) -> None:
        self.delay_s = delay_s
        self.expect = 0

    @reaction(triggers=[inp])
    async def take(self, inp: dict) -> None:
        if inp["k"] != self.expect or int(inp["pad"][-1]) != inp["k"]:
            raise AssertionError(f"expected message {self.expect}, got {inp['k']}: lost or reordered")
        self.expect += 1
        await asyncio.sleep(self.delay_s)


def build(config: dict) -> Graph:
    g = Graph()
    f = g.add(Flooder(int(config.get("count", 2000))), name="flooder")
    c = g.add(SlowConsumer(float(config.get("delay_s", 0.0002))), name="consumer")
    g.connect(f.out, c.inp)
    return g
