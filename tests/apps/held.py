"""A reaction that never returns (tests/integration/test_placements.py): it spins in Python, as an env
step or an evaluation episode that never ends does, holding the run's event loop. ``ready_file``: written
just before it starts spinning."""

from __future__ import annotations

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


def build(config: dict) -> Graph:
    g = Graph()
    g.add(Spinner(str(config["ready_file"])), name="spinner")
    return g
