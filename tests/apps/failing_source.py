"""Test app: a source that raises at its start, whose shutdown reaction then takes ``shutdown_s``
(a failed worker's shutdown that never ends must not keep its run from ending). ``failing_lives``:
only its first that many lives fail (restart policies), the later ones send their value and end.
``refuse``: instead of failing, the source asks reactor to load a policy from that run directory
(``reactor.load_policy``: a path that does not exist is a refusal, reactor's one line), at its start,
or ``refuse_after_s`` into its life (a refusal after a healthy life, from what it met at run time).
``hold``: the failed source's shutdown holds the interpreter in one C call that never returns (its bound's
thread cannot run). ``save_file``: the sink's shutdown, in a run that failed, writes that file over
``save_s`` seconds through ``replacing`` (a survivor's final checkpoint slower than its stop's wait)."""

from __future__ import annotations

import ctypes
import time

from reactor import Graph, Input, Output, Reactor, Timer, load_policy, reaction, shutdown, startup
from reactor._files import replacing


class Source(Reactor):
    out = Output(int)

    def __init__(self, shutdown_s: float, failing_lives: int | None = None, refuse: str = "",
                 refuse_after_s: float = 0.0, hold: bool = False) -> None:
        self.shutdown_s = shutdown_s
        self.failing_lives = failing_lives
        self.refuse = refuse
        self.refuse_after_s = refuse_after_s
        self.hold = hold

    @reaction(triggers=[startup], effects=[out])
    def emit(self) -> None:
        self.began = time.monotonic()
        self.out.send(1)
        if self.refuse and self.refuse_after_s <= 0:
            load_policy(self.refuse)
        elif not self.refuse and (self.failing_lives is None or self.restarts < self.failing_lives):
            raise ValueError("source broke")

    @reaction(triggers=[shutdown])
    def slow(self) -> None:
        if self.stopped_by == "failure":
            time.sleep(self.shutdown_s)
            if self.hold:  # (C, never returning, never letting another thread run, spending no core: held_in_c.py)
                libc = ctypes.PyDLL(None)
                mutex = ctypes.create_string_buffer(64)
                libc.pthread_mutex_lock(mutex)
                libc.pthread_mutex_lock(mutex)


class LateSource(Source):
    """Refuses ``refuse_after_s`` into its life (it ticks until then: the run has no end of its own)."""

    tick = Timer(period_s=0.05)

    @reaction(triggers=[tick])
    def later(self) -> None:
        if self.refuse_after_s <= time.monotonic() - self.began:
            load_policy(self.refuse)


class Sink(Reactor):
    inp = Input(int, required=True)

    def __init__(self, save_file: str = "", save_s: float = 0.0) -> None:
        self.save_file = save_file
        self.save_s = save_s

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass

    @reaction(triggers=[shutdown])
    def save(self) -> None:
        if self.save_file and self.stopped_by == "failure":
            with replacing(self.save_file) as f:
                end = time.monotonic() + self.save_s
                while time.monotonic() < end:
                    f.write(b"x" * 4096)
                    time.sleep(0.01)
                f.write(b"saved whole")


def build(config: dict) -> Graph:
    g = Graph()
    lives = config.get("failing_lives")
    late = config.get("refuse") and float(config.get("refuse_after_s", 0.0)) > 0
    src = g.add((LateSource if late else Source)(float(config.get("shutdown_s", 0.0)), None if lives is None else int(lives),
                       str(config.get("refuse", "")), float(config.get("refuse_after_s", 0.0)),
                       bool(config.get("hold", False))), name="source")
    sink = g.add(Sink(str(config.get("save_file", "")), float(config.get("save_s", 0.0))), name="sink")
    g.connect(src.out, sink.inp)
    return g
