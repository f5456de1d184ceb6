"""A reaction that never returns (tests/integration/test_placements.py), as an env step or an evaluation
episode that never ends does, holding the run's event loop. It runs Python all along, a few bytecodes every
10 ms (the signals' Python-level handlers run between them), and sleeps between: a spin cost a core for as
long as the tests wait on it (a killed coordinator's orphan: ``ORPHAN_GRACE_S``), and held the loop no more.
``ready_file``: written just before it starts."""

from __future__ import annotations

import time
from pathlib import Path

from reactor import Graph, Reactor, reaction, startup


class Spinner(Reactor):
    def __init__(self, ready_file: str) -> None:
        self.ready_file = ready_file

    @reaction(triggers=[startup])
    def spin(self) -> None:
        Path(self.ready_file).write_text("spinning")
        n = 0
        while True:
            n += 1
            time.sleep(0.01)


def build(config: dict) -> Graph:
    g = Graph()
    g.add(Spinner(str(config["ready_file"])), name="spinner")
    return g
