"""Test app: every reactor writes the run id it sees to OUT_DIR/<name>."""

from __future__ import annotations

from pathlib import Path

from reactor import Graph, Input, Output, Reactor, reaction, startup


class Writer(Reactor):
    out = Output(int)
    inp = Input(int)

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    @reaction(triggers=[startup], effects=[out])
    def note(self) -> None:
        Path(self.out_dir, self.name).write_text(self.run_id)
        self.out.send(1)


def build(config: dict) -> Graph:
    g = Graph()
    w = g.add(Writer(str(config["out_dir"])), name="w", replicas=2)
    g.connect(w.out, w.inp, mode="round_robin", delay_s=0.001)
    return g
