"""Test app: a ticker and a sink whose worker processes take ``worker_sleep_s`` to build the graph (an
import or an env's setup that long), so that they are late to say "hello". The process that passes its
own pid as ``parent_pid`` builds it at once."""

from __future__ import annotations

import os
import time

from reactor import Graph, Input, Output, Reactor, Timer, reaction


class Ticker(Reactor):
    tick = Timer(period_s=0.01)
    out = Output(int)

    @reaction(triggers=[tick], effects=[out])
    def emit(self) -> None:
        self.out.send(1)


class Sink(Reactor):
    inp = Input(int, required=True)

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass


def build(config: dict) -> Graph:
    if int(config.get("parent_pid", 0)) not in (0, os.getpid()):
        time.sleep(float(config.get("worker_sleep_s", 0.0)))
    g = Graph()
    g.connect(g.add(Ticker(), name="ticker").out, g.add(Sink(), name="sink").inp)
    return g
