"""Test app: a ticker feeding a sink that holds its event loop once (restart policies). The sink touches
``ready_file`` at its start; once ``hold_file`` exists it removes it, touches ``holding_file`` and sleeps
``hold_s`` in a reaction (a long update: no welcome answered meanwhile); it touches ``new_life_file`` when
a value from a restarted ticker (its ``restarts`` > 0) reaches it."""

from __future__ import annotations

import time
from pathlib import Path

from reactor import Graph, Input, Output, Reactor, Timer, reaction, startup


class Ticker(Reactor):
    tick = Timer(period_s=0.05)
    out = Output(int)

    @reaction(triggers=[tick], effects=[out])
    def emit(self) -> None:
        self.out.send(self.restarts)


class Sink(Reactor):
    inp = Input(int, required=True)

    def __init__(self, files: dict[str, str], hold_s: float) -> None:
        self.files = {k: Path(v) for k, v in files.items()}
        self.hold_s = hold_s

    @reaction(triggers=[startup])
    def ready(self) -> None:
        self.files["ready_file"].touch()

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        if inp > 0:
            self.files["new_life_file"].touch()
        hold = self.files["hold_file"]
        if hold.exists():
            hold.unlink()
            self.files["holding_file"].touch()
            time.sleep(self.hold_s)


def build(config: dict) -> Graph:
    g = Graph()
    t = g.add(Ticker(), name="ticker")
    files = {k: str(config[k]) for k in ("ready_file", "hold_file", "holding_file", "new_life_file")}
    g.connect(t.out, g.add(Sink(files, float(config.get("hold_s", 14.0))), name="sink").inp)
    return g
