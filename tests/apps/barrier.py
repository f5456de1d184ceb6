"""Test app: two reactors that meet at a barrier outside the graph (files), as data-parallel
learners meet in a rendezvous and in each update's all-reduce (``reaction(blocking=True)``).

``left`` and ``right`` are linked both ways (1 ms). Each waits in a blocking startup until the
other has started (``startup_barrier``), and both meet at 5 ms in a blocking reaction. Only
``left`` has an event before that (``early``, at 1 ms, which sends nothing), so it may run ``early``
and ``meet`` in one go once ``right`` has promised past 5 ms: unless ``left`` promises before it
blocks, ``right`` can never reach 5 ms. Each side writes ``<dir>/<name>.json``: what it met.

config keys: dir (where the barrier files go), wait_s (how long a side waits at a barrier, 20),
startup_barrier (True), early (``left`` has its 1 ms event, True), meet_s (when they meet, 0.005).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from reactor import Action, Graph, Input, Output, Reactor, reaction, shutdown, startup


class Side(Reactor):
    inp = Input(int)
    out = Output(int)
    early = Action()
    meet = Action()

    def __init__(self, other: str, directory: str, wait_s: float, startup_barrier: bool, early_event: bool,
                 meet_s: float = 0.005) -> None:
        self.other, self.dir, self.wait_s, self.meet_s = other, Path(directory), wait_s, meet_s
        self.startup_barrier, self.early_event = startup_barrier, early_event
        self.met: dict[str, bool] = {}

    def _barrier(self, what: str) -> None:
        (self.dir / f"{what}-{self.name}").touch()
        deadline = time.monotonic() + self.wait_s
        while not (self.dir / f"{what}-{self.other}").exists():
            if time.monotonic() > deadline:
                self.met[what] = False
                return
            time.sleep(0.01)
        self.met[what] = True

    @reaction(triggers=[startup], effects=[early, meet], blocking=True)
    def start(self) -> None:
        if self.startup_barrier:
            self._barrier("start")
        if self.early_event:
            self.early.schedule(delay_s=0.001)
        self.meet.schedule(delay_s=self.meet_s)

    @reaction(triggers=[early], effects=[out])
    def first(self) -> None:
        pass  # could send; sends nothing

    @reaction(triggers=[meet], effects=[out], blocking=True)
    def together(self) -> None:
        self._barrier("meet")

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass

    @reaction(triggers=[shutdown])
    def save(self) -> None:
        (self.dir / f"{self.name}.json").write_text(json.dumps(self.met))


def build(config: dict) -> Graph:
    d, wait_s = config["dir"], float(config.get("wait_s", 20.0))
    barrier, meet_s = bool(config.get("startup_barrier", True)), float(config.get("meet_s", 0.005))
    g = Graph()
    left = g.add(Side("right", d, wait_s, barrier, early_event=bool(config.get("early", True)), meet_s=meet_s),
                 name="left")
    right = g.add(Side("left", d, wait_s, barrier, early_event=False, meet_s=meet_s), name="right")
    g.connect(left.out, right.inp, delay_s=0.001)
    g.connect(right.out, left.inp, delay_s=0.001)
    return g
