"""Test app: racing producers feed one order-sensitive consumer (for schedules and traces).

Producers emit on timers with different periods; a relay bank forwards with a seeded random
tweak; the consumer folds everything into an order-dependent hash and forwards it to a sink.
In async mode the arrival order at the consumer depends on the OS and the placement; in
deterministic mode it does not. ``fail_at``: the consumer fails at that input, naming its hash so far (a
failure that follows from the order of the events before it).
"""

from __future__ import annotations

import hashlib

from reactor import Graph, Input, Output, Reactor, Timer, reaction


class FastProducer(Reactor):
    tick = Timer(period_s=0.003)
    out = Output(int)

    def __init__(self, count: int = 40) -> None:
        self.count = count
        self.k = 0

    @reaction(triggers=[tick], effects=[out])
    def emit(self) -> None:
        if self.k < self.count:
            self.k += 1
            self.out.send(int(self.rng.integers(0, 1 << 30)) ^ self.bank_index)


class SlowProducer(FastProducer):
    tick = Timer(period_s=0.005, offset_s=0.001)

    @reaction(triggers=[tick], effects=[FastProducer.out])
    def emit(self) -> None:  # same body, another timer
        if self.k < self.count:
            self.k += 1
            self.out.send(int(self.rng.integers(0, 1 << 30)) + 7)


class Relay(Reactor):
    inp = Input(int, required=True)
    out = Output(int)

    @reaction(triggers=[inp], effects=[out])
    def forward(self, inp: int) -> None:
        self.out.send((inp * 31 + int(self.rng.integers(0, 97))) & 0xFFFFFFFF)


class Folder(Reactor):
    inp = Input(int, required=True)
    out = Output(str)

    def __init__(self, fail_at: int = 0) -> None:
        self.h = hashlib.sha256()
        self.fail_at = fail_at
        self.n = 0

    @reaction(triggers=[inp], effects=[out])
    def fold(self, inp: int) -> None:
        self.h.update(inp.to_bytes(8, "little"))
        self.n += 1
        if self.n == self.fail_at:
            raise RuntimeError(f"folder broke at input {self.n}, its hash {self.h.hexdigest()[:16]}")
        self.out.send(self.h.hexdigest()[:16])


class Sink(Reactor):
    inp = Input(str, required=True)

    @reaction(triggers=[inp])
    def take(self, inp: str) -> None:
        pass


def build(config: dict) -> Graph:
    count = int(config.get("count", 40))
    g = Graph(stop_s=config.get("stop_s", 1.0))
    fast = g.add(FastProducer(count), name="fast", replicas=2)
    slow = g.add(SlowProducer(count), name="slow")
    relay = g.add(Relay(), name="relay", replicas=2)
    folder = g.add(Folder(int(config.get("fail_at", 0))), name="folder")
    sink = g.add(Sink(), name="sink")
    g.connect(fast.out, relay.inp, mode="one_to_one")
    g.connect(slow.out, folder.inp, delay_s=config.get("slow_delay_s", 0.0005))
    g.connect(relay.out, folder.inp)
    g.connect(folder.out, sink.inp)
    return g
