"""Test app: each reactor writes its process's parent pid to OUT_DIR/<name> and says it on stdout."""

from __future__ import annotations

import os
from pathlib import Path

from reactor import Graph, Input, Output, Reactor, reaction, startup


class Note(Reactor):
    out = Output(int)
    inp = Input(int)

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    @reaction(triggers=[startup], effects=[out])
    def note(self) -> None:
        Path(self.out_dir, self.name).write_text(str(os.getppid()))
        print(f"{self.name} in pid {os.getpid()}, parent {os.getppid()}", flush=True)
        self.out.send(1)


def build(config: dict) -> Graph:
    g = Graph()
    n = g.add(Note(str(config["out_dir"])), name="n", replicas=2)
    g.connect(n.out, n.inp, mode="round_robin", delay_s=0.001)
    return g
