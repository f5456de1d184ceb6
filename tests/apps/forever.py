"""Test app: runs until stopped (a signal): a ticking bank feeding a sink."""

from __future__ import annotations

from pathlib import Path

from reactor import Graph, Input, Output, Reactor, Timer, reaction, startup


class Ticker(Reactor):
    tick = Timer(period_s=0.01)
    out = Output(int)

    @reaction(triggers=[tick], effects=[out])
    def emit(self) -> None:
        self.out.send(self.bank_index)


class Sink(Reactor):
    """Touches ``ready_file`` once running, so a test knows when to send its signal."""

    inp = Input(int, required=True)

    def __init__(self, ready_file: str = "") -> None:
        self.ready_file = ready_file

    @reaction(triggers=[startup])
    def ready(self) -> None:
        if self.ready_file:
            Path(self.ready_file).touch()

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass


def build(config: dict) -> Graph:
    g = Graph()
    t = g.add(Ticker(), name="ticker", replicas=2)
    g.connect(t.out, g.add(Sink(str(config.get("ready_file", ""))), name="sink").inp)
    return g
