"""Test app: a source sends one value to a sink; the sink's shutdown reaction raises (as a learner's
final checkpoint that cannot be saved does), the source's writes ``done_file`` (the others still run)."""

from __future__ import annotations

from pathlib import Path

from reactor import Graph, Input, Output, Reactor, reaction, shutdown, startup


class Source(Reactor):
    out = Output(int)

    def __init__(self, done_file: str) -> None:
        self.done_file = done_file

    @reaction(triggers=[startup], effects=[out])
    def emit(self) -> None:
        self.out.send(1)

    @reaction(triggers=[shutdown])
    def done(self) -> None:
        Path(self.done_file).write_text(str(self.stopped_by))


class Sink(Reactor):
    inp = Input(int, required=True)

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass

    @reaction(triggers=[shutdown])
    def save(self) -> None:
        self.state.save()  # (no such attribute: an AttributeError)


def build(config: dict) -> Graph:
    g = Graph()
    src = g.add(Source(str(config["done_file"])), name="source")
    sink = g.add(Sink(), name="sink")
    g.connect(src.out, sink.inp)
    return g
