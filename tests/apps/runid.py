"""Test app: every reactor writes the run id it sees to OUT_DIR/<name> (``write = "parent"``: its
process's parent pid instead, which it also says on stdout)."""

from __future__ import annotations

import os
from pathlib import Path

from reactor import Graph, Input, Output, Reactor, reaction, startup


class Writer(Reactor):
    out = Output(int)
    inp = Input(int)

    def __init__(self, out_dir: str, write: str = "run_id") -> None:
        self.out_dir = out_dir
        self.write = write

    @reaction(triggers=[startup], effects=[out])
    def note(self) -> None:
        if self.write == "parent":
            Path(self.out_dir, self.name).write_text(str(os.getppid()))
            print(f"{self.name} in pid {os.getpid()}, parent {os.getppid()}", flush=True)
        else:
            Path(self.out_dir, self.name).write_text(self.run_id)
        self.out.send(1)


def build(config: dict) -> Graph:
    g = Graph()
    w = g.add(Writer(str(config["out_dir"]), config.get("write", "run_id")), name="w", replicas=2)
    g.connect(w.out, w.inp, mode="round_robin", delay_s=0.001)
    return g
