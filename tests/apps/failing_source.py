"""Test app: a source that raises at its start, whose shutdown reaction then takes ``shutdown_s``
(a failed worker's shutdown that never ends must not keep its run from ending). ``failing_lives``:
only its first that many lives fail (restart policies), the later ones send their value and end."""

from __future__ import annotations

import time

from reactor import Graph, Input, Output, Reactor, reaction, shutdown, startup


class Source(Reactor):
    out = Output(int)

    def __init__(self, shutdown_s: float, failing_lives: int | None = None) -> None:
        self.shutdown_s = shutdown_s
        self.failing_lives = failing_lives

    @reaction(triggers=[startup], effects=[out])
    def emit(self) -> None:
        self.out.send(1)
        if self.failing_lives is None or self.restarts < self.failing_lives:
            raise ValueError("source broke")

    @reaction(triggers=[shutdown])
    def slow(self) -> None:
        if self.stopped_by == "failure":
            time.sleep(self.shutdown_s)


class Sink(Reactor):
    inp = Input(int, required=True)

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass


def build(config: dict) -> Graph:
    g = Graph()
    lives = config.get("failing_lives")
    src = g.add(Source(float(config.get("shutdown_s", 0.0)), None if lives is None else int(lives)), name="source")
    sink = g.add(Sink(), name="sink")
    g.connect(src.out, sink.inp)
    return g
