"""Test app: every way an event can lead to a message in another process, for promises.

Sends from a startup reaction, a periodic timer, an action with a min_delay scheduled with extra
delay, a zero-delay chain a -> b -> c across processes, an async reaction that sends after an
await, a reaction without effects, and cycles back to the start with delays.
"""

from __future__ import annotations

import asyncio

from reactor import Action, Graph, Input, Output, Reactor, Timer, reaction, startup

M = (1 << 31) - 1


class Head(Reactor):
    tick = Timer(period_s=1e-6)
    back = Input(int)
    out = Output(int)
    far = Output(int)
    later = Action(int, min_delay_s=3e-7)

    def __init__(self) -> None:
        self.s = 1

    @reaction(triggers=[startup], effects=[out, far])
    def start(self) -> None:
        self.out.send(11)
        self.far.send(12)

    @reaction(triggers=[tick], effects=[out, later])
    def step(self) -> None:
        self.s = (self.s * 31 + int(self.rng.integers(0, 1000))) % M
        self.out.send(self.s)
        self.later.schedule(self.s, delay_s=float(self.rng.integers(0, 3)) * 1e-7)

    @reaction(triggers=[later], effects=[far])
    def fire(self, later: int) -> None:
        self.far.send(later ^ self.s)

    @reaction(triggers=[back], effects=[later])
    def got(self, back: int) -> None:
        self.s = (self.s * 7 + back) % M
        if back % 3 == 0:
            self.later.schedule(back)


class Relay(Reactor):
    inp = Input(int)
    fb = Input(int)
    out = Output(int)

    def __init__(self) -> None:
        self.s = 3

    @reaction(triggers=[inp], effects=[out])
    async def relay(self, inp: int) -> None:
        await asyncio.sleep(0)
        self.s = (self.s * 17 + inp) % M
        self.out.send(self.s)

    @reaction(triggers=[fb])
    def absorb(self, fb: int) -> None:
        self.s = (self.s + fb) % M


class Tail(Reactor):
    a = Input(int)
    b = Input(int)
    back = Output(int)
    fb = Output(int)

    def __init__(self) -> None:
        self.s = 5

    @reaction(triggers=[a, b], effects=[back, fb])
    def on(self, a: int | None, b: int | None) -> None:
        v = a if a is not None else b
        self.s = (self.s * 13 + v) % M
        if v % 2:
            self.back.send(self.s)
        else:
            self.fb.send(self.s)


def build(config: dict) -> Graph:
    g = Graph(stop_s=float(config.get("stop_s", 2e-4)))
    head = g.add(Head(), name="head")
    relay = g.add(Relay(), name="relay")
    tail = g.add(Tail(), name="tail")
    g.connect(head.out, relay.inp)  # zero delay, across processes
    g.connect(relay.out, tail.b)  # zero delay: a chain head -> relay -> tail
    g.connect(head.far, tail.a, delay_s=1e-7)
    g.connect(tail.back, head.back, delay_s=4e-7)
    g.connect(tail.fb, relay.fb, delay_s=2e-7)
    return g
