"""Test app: two sources feed a gate that holds its process at startup until a file exists.

The sources finish (their stop time) while the gate still waits, then close their links to it: a
test can then speak to the gate's process under a source's name (a finished, legitimate peer) and
send it anything. The run's digests do not depend on when the gate opens.

config = {"gate_file": path the gate waits for, "ready_file": touched when the gate starts waiting}
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from reactor import Graph, Input, Output, Reactor, Timer, reaction, startup


class Source(Reactor):
    tick = Timer(period_s=0.01)
    out = Output(int)

    @reaction(triggers=[tick], effects=[out])
    def emit(self) -> None:
        self.out.send(int(self.rng.integers(0, 1 << 30)))


class Gate(Reactor):
    inp = Input(int, required=True)
    out = Output(int)

    def __init__(self, gate_file: str = "", ready_file: str = "") -> None:
        self.gate_file = gate_file
        self.ready_file = ready_file

    @reaction(triggers=[startup])
    async def wait_for_the_gate(self) -> None:
        if self.ready_file:
            Path(self.ready_file).touch()
        deadline = time.monotonic() + 120
        while self.gate_file and not Path(self.gate_file).exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    @reaction(triggers=[inp], effects=[out])
    def forward(self, inp: int) -> None:
        self.out.send(inp * 3 + 1)


class Sink(Reactor):
    inp = Input(int, required=True)

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass


def build(config: dict) -> Graph:
    g = Graph(stop_s=0.1)
    src = g.add(Source(), name="source", replicas=2)
    gate = g.add(Gate(str(config.get("gate_file", "")), str(config.get("ready_file", ""))), name="gate")
    sink = g.add(Sink(), name="sink")
    g.connect(src.out, gate.inp, delay_s=0.001)
    g.connect(gate.out, sink.inp, delay_s=0.001)
    return g
