"""Test app: a reporter's reports reach Metrics (in ``run_dir``) and a witness; a node refuses at its start
only once the witness has heard ``reports`` of them (``witness_file``): a start refused late, after the
other nodes began their work (as a learner whose large checkpoint fails to load after seconds does while
its actors step). The refusal is reactor's own: ``load_policy`` of a run directory that does not exist."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from reactor import Graph, Input, Output, Reactor, Timer, load_policy, reaction, startup
from reactor.nodes.metrics import Metrics
from reactor.nodes.train_messages import Report


class Reporter(Reactor):
    tick = Timer(period_s=0.005)
    out = Output(Report)

    def __init__(self) -> None:
        self.k = 0

    @reaction(triggers=[tick], effects=[out])
    def report(self) -> None:
        self.k += 1
        self.out.send(Report(self.name, {"env_steps": 100.0 * self.k, "episode_return": 1.0}))


class Witness(Reactor):
    """Touches ``path`` once it has heard ``n`` reports."""

    reports = Input(Report, required=True)

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n, self.heard = path, n, 0

    @reaction(triggers=[reports])
    def take(self, reports: Report) -> None:
        self.heard += 1
        if self.heard == self.n:
            Path(self.path).touch()


class LateRefuser(Reactor):
    def __init__(self, witness: str, missing: str) -> None:
        self.witness, self.missing = witness, missing

    @reaction(triggers=[startup])
    async def start(self) -> None:
        deadline = time.monotonic() + 60
        while not Path(self.witness).exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        load_policy(self.missing)


def build(config: dict) -> Graph:
    g = Graph()
    rep = g.add(Reporter(), name="reporter")
    m = g.add(Metrics(str(config["run_dir"]), live=False), name="metrics")
    w = g.add(Witness(str(config["witness_file"]), int(config.get("reports", 3))), name="witness")
    g.add(LateRefuser(str(config["witness_file"]), str(config["missing"])), name="refuser")
    g.connect(rep.out, m.reports)
    g.connect(rep.out, w.reports)
    return g
