"""Test app: the learner/replay cycle in miniature, for deterministic runs across processes.

A producer ticks items into a server; a client asks the server for a sample, and on each reply
asks for the next one at once and then "learns" one microstep later (an action), sending a
priority-like update back. The update's link is slower than the request's, so the server can
serve the next request before that update arrives: the pattern whose promises
``ReactorHost.promises`` computes from the reactions' effects.
"""

from __future__ import annotations

import json
import os
import time

from reactor import Action, Graph, Input, Output, Reactor, Timer, reaction, startup

M = (1 << 31) - 1


class Producer(Reactor):
    tick = Timer(period_s=1e-6)
    out = Output(int)

    @reaction(triggers=[tick], effects=[out])
    def step(self) -> None:
        self.out.send(int(self.rng.integers(0, 1 << 20)))


def _log(log_dir: str, name: str, record: list) -> None:
    if log_dir:
        with open(os.path.join(log_dir, f"{name}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


class Server(Reactor):
    items = Input(int)
    requests = Input(int)
    updates = Input(int)
    replies = Output(int)

    def __init__(self, log_dir: str = "") -> None:
        self.total = 0
        self.bias = 1
        self.log_dir = log_dir

    @reaction(triggers=[items])
    def add(self, items: int) -> None:
        self.total = (self.total * 31 + items) % M

    @reaction(triggers=[requests], effects=[replies])
    def serve(self, requests: int) -> None:
        _log(self.log_dir, "serve", [requests, time.monotonic()])
        self.replies.send((requests * 1_000_003 + self.total * 7 + self.bias) % M)

    @reaction(triggers=[updates])
    def absorb(self, updates: int) -> None:
        self.bias = (self.bias * 17 + updates) % M


class Client(Reactor):
    replies = Input(int)
    requests = Output(int)
    updates = Output(int)
    due = Action(int)

    def __init__(self, samples: int = 150, learn_s: float = 0.0, log_dir: str = "") -> None:
        self.samples = samples
        self.n = 0
        self.learn_s = learn_s
        self.log_dir = log_dir

    @reaction(triggers=[startup], effects=[requests])
    def start(self) -> None:
        self.requests.send(0)

    @reaction(triggers=[replies], effects=[requests, due])
    def take(self, replies: int) -> None:
        self.n += 1
        if self.n < self.samples:
            self.requests.send(self.n)
        self.due.schedule(replies)

    @reaction(triggers=[due], effects=[updates])
    def learn(self, due: int) -> None:
        t0 = time.monotonic()
        if self.learn_s:
            time.sleep(self.learn_s)  # a long update: the server may serve the next request meanwhile
        _log(self.log_dir, "learn", [self.n, t0, time.monotonic()])
        self.updates.send((due * 5 + self.n) % M)


def build(config: dict) -> Graph:
    stop_s = config.get("stop_s", 3e-4)  # None: no stop time (with producers=0 the run ends when idle)
    g = Graph(stop_s=None if stop_s is None else float(stop_s))
    producers = int(config.get("producers", 2))
    producer = g.add(Producer(), name="producer", replicas=producers) if producers else None
    log_dir = str(config.get("log_dir", ""))
    server = g.add(Server(log_dir), name="server")
    client = g.add(Client(int(config.get("samples", 150)), float(config.get("learn_s", 0.0)), log_dir),
                   name="client")
    if producer is not None:
        g.connect(producer.out, server.items, delay_s=1e-6)
    g.connect(client.requests, server.requests, delay_s=0.5e-6)
    g.connect(client.updates, server.updates, delay_s=1e-6)
    g.connect(server.replies, client.replies, delay_s=0.5e-6)
    return g
