"""Test app: runs until stopped (a signal): a ticking bank feeding a sink. ``slow_shutdown_s``: the
sink's shutdown reaction takes that long (a clean stop that a second Ctrl-C must cut short);
``stopped_file``: the sink's shutdown reaction writes there why the run ended (``Reactor.stopped_by``);
``once``: the bank sends one value each at startup instead (the run then ends with nothing left)."""

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


class Once(Reactor):
    out = Output(int)

    @reaction(triggers=[startup], effects=[out])
    def emit(self) -> None:
        self.out.send(self.bank_index)


class Sink(Reactor):
    """Touches ``ready_file`` once running, so a test knows when to send its signal."""

    inp = Input(int, required=True)

    def __init__(self, ready_file: str = "", slow_shutdown_s: float = 0.0, stopped_file: str = "") -> None:
        self.ready_file = ready_file
        self.slow_shutdown_s = slow_shutdown_s
        self.stopped_file = stopped_file

    @reaction(triggers=[startup])
    def ready(self) -> None:
        if self.ready_file:
            Path(self.ready_file).touch()

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass

    @reaction(triggers=[shutdown])
    def slow(self) -> None:
        if self.stopped_file:
            Path(self.stopped_file).write_text(str(self.stopped_by))
        time.sleep(self.slow_shutdown_s)


def build(config: dict) -> Graph:
    g = Graph()
    t = g.add(Once() if config.get("once") else Ticker(), name="ticker", replicas=2)
    sink = Sink(str(config.get("ready_file", "")), float(config.get("slow_shutdown_s", 0.0)),
                str(config.get("stopped_file", "")))
    g.connect(t.out, g.add(sink, name="sink").inp)
    return g
