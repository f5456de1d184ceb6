"""Test app: a DAG described by its config (for property tests over random topologies).

config = {"nodes": [[kind, replicas], ...], "edges": [[src, dst, mode, delay_ms], ...], "stop_s": s}
with kinds "tick3", "tick5" (sources on timers) and "mix" (transforms what it receives).
Edges must go from a lower to a higher node index (a DAG).
"""

from __future__ import annotations

from reactor import Action, Graph, Input, Output, Reactor, Timer, reaction


class Mix(Reactor):
    inp = Input(int)
    out = Output(int)
    echo = Action(int)

    @reaction(triggers=[inp], effects=[out, echo])
    def mix(self, inp: int) -> None:
        v = (inp * 1103515245 + int(self.rng.integers(0, 1 << 20))) % (1 << 31)
        self.out.send(v)
        if v % 3 == 0:
            self.echo.schedule(v, delay_s=0.0007)

    @reaction(triggers=[echo], effects=[out])
    def again(self, echo: int) -> None:
        self.out.send(echo ^ 0x5A5A)


class Tick3(Mix):
    tick = Timer(period_s=0.003)

    @reaction(triggers=[tick], effects=[Mix.out])
    def emit(self) -> None:
        self.out.send(int(self.rng.integers(0, 1 << 30)))


class Tick5(Tick3):
    tick = Timer(period_s=0.005, offset_s=0.001)


KINDS = {"mix": Mix, "tick3": Tick3, "tick5": Tick5}


def _key(v: int) -> int:
    return v


def build(config: dict) -> Graph:
    g = Graph(stop_s=float(config.get("stop_s", 0.05)))
    nodes = [g.add(KINDS[kind](), name=f"n{i}", replicas=int(reps)) for i, (kind, reps) in enumerate(config["nodes"])]
    for src, dst, mode, delay_ms in config["edges"]:
        g.connect(nodes[src].out, nodes[dst].inp, mode=mode, delay_s=delay_ms / 1000,
                  key=_key if mode == "keyed" else None)
    return g
