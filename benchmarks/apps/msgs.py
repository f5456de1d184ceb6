"""Benchmark app: a source streams small messages to a sink as fast as the runtime allows."""

from __future__ import annotations

import time

from reactor import Action, Graph, Input, Output, Reactor, reaction, shutdown, startup


class Source(Reactor):
    out = Output(bytes)
    more = Action()

    def __init__(self, count: int = 100_000, burst: int = 100) -> None:
        self.count = count
        self.burst = burst
        self.k = 0
        self.payload = b"x" * 100

    @reaction(triggers=[startup, more], effects=[out, more])
    def emit(self) -> None:
        n = min(self.burst, self.count - self.k)
        send = self.out.send
        p = self.payload
        for _ in range(n):
            send(p)
        self.k += n
        if self.k < self.count:
            self.more.schedule()


class Sink(Reactor):
    inp = Input(bytes, required=True)

    def __init__(self, report: str = "") -> None:
        self.report = report
        self.n = 0
        self.t0 = 0.0

    @reaction(triggers=[inp])
    def take(self, inp: bytes) -> None:
        if self.n == 0:
            self.t0 = time.perf_counter()
        self.n += 1

    @reaction(triggers=[shutdown])
    def done(self) -> None:
        if self.report:
            dt = time.perf_counter() - self.t0
            with open(self.report, "w") as f:
                f.write(f"{self.n} {dt}\n")


def build(config: dict) -> Graph:
    g = Graph()
    s = g.add(Source(int(config.get("count", 100_000)), int(config.get("burst", 100))), name="source")
    k = g.add(Sink(str(config.get("report", ""))), name="sink")
    g.connect(s.out, k.inp)
    return g
