"""Demo app: a bank of producers, a bank of workers and one collector (fan-out, fan-in, timers).

Producers emit seeded random numbers on a timer; workers square them (round-robin from each
producer); the collector sums what it receives and reports the running total on its own timer.
Run it with `reactor run apps/demo_pipeline.py --digest` and compare placements:
`--placement processes` gives the same digests in deterministic mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Action, Graph, Input, Output, Reactor, Timer, reaction, shutdown


@dataclass(frozen=True)
class Config:
    producers: int = 3
    """Replicas in the producer bank."""
    workers: int = 2
    """Replicas in the worker bank."""
    stop_s: float = 0.5
    """Logical time at which the run ends."""


class Producer(Reactor):
    """Emits a seeded random integer on every tick."""

    tick = Timer(period_s=0.01)
    number = Output(int)

    @reaction(triggers=[tick], effects=[number])
    def emit(self) -> None:
        self.number.send(int(self.rng.integers(0, 1000)) + 1000 * self.bank_index)


class Squarer(Reactor):
    """Squares every number; odd results are re-checked one millisecond later (a logical action)."""

    number = Input(int, required=True)
    square = Output(int)
    recheck = Action(int)

    @reaction(triggers=[number], effects=[square, recheck])
    def compute(self, number: int) -> None:
        sq = number * number
        self.square.send(sq)
        if sq % 2:
            self.recheck.schedule(sq, delay_s=0.001)

    @reaction(triggers=[recheck], effects=[square])
    def resend(self, recheck: int) -> None:
        self.square.send(-recheck)


class Collector(Reactor):
    """Sums everything it receives and reports the total periodically."""

    square = Input(int, required=True)
    report = Timer(period_s=0.1, offset_s=0.05)
    total = Output(int)

    def __init__(self) -> None:
        self.sum = 0
        self.count = 0

    @reaction(triggers=[square])
    def add(self, square: int) -> None:
        self.sum += square
        self.count += 1

    @reaction(triggers=[report], effects=[total])
    def publish(self) -> None:
        self.total.send(self.sum)

    @reaction(triggers=[shutdown])
    def summary(self) -> None:
        print(f"{self.name}: {self.count} values, sum {self.sum}")


def build(config: Config) -> Graph:
    graph = Graph(stop_s=config.stop_s)
    producers = graph.add(Producer(), name="producer", replicas=config.producers)
    workers = graph.add(Squarer(), name="squarer", replicas=config.workers)
    collector = graph.add(Collector(), name="collector")
    graph.connect(producers.number, workers.number, mode="round_robin")
    graph.connect(workers.square, collector.square, delay_s=0.002)
    return graph
