"""Test app: runs until stopped (a signal): a ticking bank feeding a sink. ``slow_shutdown_s``: the
sink's shutdown reaction takes that long (a clean stop that a second Ctrl-C must cut short)."""

from __future__ import annotations

import time
from pathlib import Path

from reactor import Graph, Input, Output, Reactor, Timer, reaction, shutdown, startup


class Ticker(Reactor):
    tick = Timer(period_s=0.01)
    out = Output(int)

    @reaction(triggers=[tick], effects=[out])
    def emit(self) -> None:
        self.out.send(self.bank_index)


class Sink(Reactor):
    """Touches ``ready_file`` once running, so a test knows when to send its signal."""

    inp = Input(int, required=True)

    def __init__(self, ready_file: str = "", slow_shutdown_s: float = 0.0) -> None:
        self.ready_file = ready_file
        self.slow_shutdown_s = slow_shutdown_s

    @reaction(triggers=[startup])
    def ready(self) -> None:
        if self.ready_file:
            Path(self.ready_file).touch()

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass

    @reaction(triggers=[shutdown])
    def slow(self) -> None:
        time.sleep(self.slow_shutdown_s)


def build(config: dict) -> Graph:
    g = Graph()
    t = g.add(Ticker(), name="ticker", replicas=2)
    sink = Sink(str(config.get("ready_file", "")), float(config.get("slow_shutdown_s", 0.0)))
    g.connect(t.out, g.add(sink, name="sink").inp)
    return g
