"""Reactors: the reaction contract, timers, actions, lifecycle, banks and seeded generators."""

from __future__ import annotations

import re
from typing import Any, Protocol

import numpy as np
import pytest

from reactor import (
    Action,
    Graph,
    Input,
    Output,
    PortError,
    Reactor,
    Timer,
    reaction,
    run,
    shutdown,
    startup,
)
from reactor._tag import Tag

LOG: list = []


class Ticker(Reactor):
    tick = Timer(period_s=0.1, offset_s=0.05)
    out = Output(int)

    def __init__(self) -> None:
        self.k = 0

    @reaction(triggers=[tick], effects=[out])
    def emit(self) -> None:
        self.k += 1
        self.out.send(self.k)


class Recorder(Reactor):
    inp = Input(int)

    @reaction(triggers=[startup])
    def hello(self) -> None:
        LOG.append((self.name, "startup", self.tag))

    @reaction(triggers=[inp])
    def got(self, inp: int) -> None:
        LOG.append((self.name, inp, self.tag))

    @reaction(triggers=[shutdown])
    def bye(self) -> None:
        LOG.append((self.name, "shutdown"))


@pytest.fixture(autouse=True)
def _clear_log():
    LOG.clear()
    yield
    LOG.clear()


def test_timer_fires_at_offset_plus_k_periods_and_zero_delay_lands_one_microstep_later():
    g = Graph(stop_s=0.3)
    t = g.add(Ticker(), name="t")
    r = g.add(Recorder(), name="r")
    g.connect(t.out, r.inp)
    run(g)
    assert LOG == [
        ("r", "startup", Tag(0, 0)),
        ("r", 1, Tag(50_000_000, 1)),
        ("r", 2, Tag(150_000_000, 1)),
        ("r", 3, Tag(250_000_000, 1)),
        ("r", "shutdown"),
    ]


def test_connection_delay_shifts_the_tag_and_resets_the_microstep():
    g = Graph(stop_s=0.1)
    t = g.add(Ticker(), name="t")
    r = g.add(Recorder(), name="r")
    g.connect(t.out, r.inp, delay_s=0.01)
    run(g)
    assert LOG[1] == ("r", 1, Tag(60_000_000, 0))


class Sneaky(Reactor):
    inp = Input(int)
    declared = Output(int)
    undeclared = Output(int)

    @reaction(triggers=[inp], effects=[declared])
    def handle(self, inp: int) -> None:
        self.undeclared.send(inp)


class Once(Reactor):
    out = Output(int)

    @reaction(triggers=[startup], effects=[out])
    def go(self) -> None:
        self.out.send(7)


def test_writing_an_undeclared_output_raises_naming_reactor_reaction_and_port():
    g = Graph()
    o = g.add(Once(), name="once")
    s = g.add(Sneaky(), name="sneaky")
    g.connect(o.out, s.inp)
    with pytest.raises(
        PortError,
        match=r"^sneaky\.handle wrote output 'undeclared', which is not among its declared effects \(declared\); "
        r"add it to effects=\[\.\.\.\]$",
    ):
        run(g)


class _Shaped(Protocol):
    def area(self) -> float: ...


class Typed(Reactor):
    """Sends each value of its ``values`` on ports of several declared types (by the value's slot)."""

    whole = Output(int)
    real = Output(float)
    maybe = Output(int | None)
    listed = Output(list[int])  # a generic alias: not checked
    anything = Output()
    typed_any = Output(Any)  # not checked (its isinstance raised TypeError: every send failed)
    shaped = Output(_Shaped)  # a Protocol that is not runtime_checkable: not checked

    def __init__(self, values: list) -> None:
        self.values = values

    @reaction(triggers=[startup], effects=[whole, real, maybe, listed, anything, typed_any, shaped])
    def go(self) -> None:
        for port, value in self.values:
            getattr(self, port).send(value)


class Taker(Reactor):
    whole = Input(int)
    real = Input(float)
    maybe = Input(int | None)
    listed = Input(list[int])
    anything = Input()
    typed_any = Input(Any)
    shaped = Input(_Shaped)

    @reaction(triggers=[whole, real, maybe, listed, anything, typed_any, shaped])
    def got(self, whole: int, real: float, maybe: int | None, listed: list, anything: object, typed_any: Any,
            shaped: Any) -> None:
        LOG.append((whole, real, maybe, listed, anything, typed_any, shaped))


def _typed(values: list) -> Graph:
    g = Graph()
    t, k = g.add(Typed(values), name="typed"), g.add(Taker(), name="taker")
    for port in ("whole", "real", "maybe", "listed", "anything", "typed_any", "shaped"):
        g.connect(getattr(t, port), getattr(k, port))
    return g


def test_a_value_of_its_ports_type_is_sent_and_any_other_refused_naming_it():
    """The check a value gets where it enters another process is made where it is sent, so a run
    fails alike under every placement (under single the value used to be delivered as is)."""
    LOG.clear()
    run(_typed([("whole", 3), ("real", 2), ("real", np.float64(0.5)), ("maybe", None), ("listed", ["x"]),
                ("anything", object), ("typed_any", "s"), ("shaped", 7)]))
    assert len(LOG) == 8  # (one microstep each)
    assert sorted((i, repr(v)) for row in LOG for i, v in enumerate(row) if v is not None) == [
        (0, "3"), (1, "2"), (1, "np.float64(0.5)"), (3, "['x']"), (4, "<class 'object'>"), (5, "'s'"), (6, "7")]
    for port, value, shown, takes in [("whole", "7", "str '7'", "int"), ("whole", np.int64(7), "int64 np.int64(7)", "int (a numpy scalar: its .item() is the Python value it holds)"),
                                      ("real", True, "bool True", "float"), ("maybe", 1.5, "float 1.5", "int | None"),
                                      ("whole", list(range(100)), "list of 100 items", "int")]:
        with pytest.raises(PortError, match=re.escape(f"typed.go sent {shown} on output {port!r}, which takes {takes}")):
            run(_typed([(port, value)]))


def test_writing_a_port_outside_any_reaction_raises():
    s = Sneaky()
    with pytest.raises(PortError, match=r"written outside a reaction"):
        s.declared.send(1)


def test_reaction_parameter_must_name_a_trigger_or_source():
    with pytest.raises(TypeError, match=r"has parameter 'nope', which names none of its Input or Action"):

        class Bad(Reactor):
            inp = Input(int)

            @reaction(triggers=[inp])
            def handle(self, nope: int) -> None:  # pragma: no cover - never runs
                pass


def test_reaction_trigger_from_another_reactor_class_is_rejected():
    with pytest.raises(TypeError, match=r"is not a port of Thief"):

        class Thief(Reactor):
            @reaction(triggers=[Recorder.inp])
            def handle(self) -> None:  # pragma: no cover - never runs
                pass


class Chain(Reactor):
    """An action re-schedules itself three times; an async reaction awaits between steps."""

    again = Action(int, min_delay_s=0.001)
    out = Output(int)

    @reaction(triggers=[startup], effects=[again])
    def start(self) -> None:
        self.again.schedule(1, delay_s=0.009)

    @reaction(triggers=[again], effects=[again, out])
    async def step(self, again: int) -> None:
        import asyncio

        await asyncio.sleep(0)
        self.out.send(again)
        if again < 3:
            self.again.schedule(again + 1)


def test_actions_and_async_reactions_deliver_at_scheduled_tags():
    g = Graph()
    c = g.add(Chain(), name="c")
    r = g.add(Recorder(), name="r")
    g.connect(c.out, r.inp)
    res = run(g)
    assert [x for x in LOG if isinstance(x[1], int)] == [
        ("r", 1, Tag(10_000_000, 1)),
        ("r", 2, Tag(11_000_000, 1)),
        ("r", 3, Tag(12_000_000, 1)),
    ]
    assert res.stopped_by == "quiescence"


class Dice(Reactor):
    out = Output(int)

    @reaction(triggers=[startup], effects=[out])
    def roll(self) -> None:
        self.out.send(int(self.rng.integers(0, 2**31)))


def _rolls(seed: int, replicas: int = 3) -> list:
    g = Graph()
    d = g.add(Dice(), name="dice", replicas=replicas)
    r = g.add(Recorder(), name="r")
    g.connect(d.out, r.inp)
    run(g, seed=seed)
    return [x[1] for x in LOG if isinstance(x[1], int)]


def test_bank_replicas_get_distinct_seeded_streams_that_depend_on_seed_and_name():
    a = _rolls(1)
    LOG.clear()
    b = _rolls(1)
    LOG.clear()
    c = _rolls(2)
    assert a == b
    assert len(set(a)) == 3
    assert a != c


def test_replica_names_and_indices():
    seen = []

    class Namer(Reactor):
        @reaction(triggers=[startup])
        def hello(self) -> None:
            seen.append((self.name, self.bank_index, self.bank_size))

    g = Graph()
    g.add(Namer(), name="n", replicas=3)
    run(g)
    assert sorted(seen) == [("n[0]", 0, 3), ("n[1]", 1, 3), ("n[2]", 2, 3)]


def test_each_run_gets_fresh_reactor_instances():
    g = Graph(stop_s=0.3)
    t = g.add(Ticker(), name="t")
    r = g.add(Recorder(), name="r")
    g.connect(t.out, r.inp)
    run(g)
    first = list(LOG)
    LOG.clear()
    run(g)
    assert LOG == first


def test_torch_generator_is_seeded_per_reactor():
    import torch

    vals = []

    class T(Reactor):
        @reaction(triggers=[startup])
        def draw(self) -> None:
            vals.append(torch.rand(2, generator=self.torch_rng).tolist())

    g = Graph()
    g.add(T(), name="a")
    run(g, seed=5)
    run(g, seed=5)
    assert vals[0] == vals[1]
    assert np.all(np.array(vals[0]) >= 0)


def test_process_link_names_where_a_side_server_binds():
    import os
    import stat

    from reactor._scheduler import ProcessLink

    assert ProcessLink("tcp://10.1.2.3:5555", None).side_bind("replay-0") == "tcp://10.1.2.3:*"
    ipc = ProcessLink("ipc:///tmp/reactor-x/learner", None).side_bind("replay-0")
    assert re.fullmatch(r"ipc:///tmp/reactor-x/learner-replay-0-[0-9a-f]{8}", ipc)  # the run's private directory
    single = ProcessLink().side_bind("replay-0")  # single process: a private directory of this process
    path = single.removeprefix("ipc://")
    assert single.startswith("ipc://") and stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert ProcessLink().side_bind("replay-0") != single  # two owners of one name never share a socket
    with pytest.raises(ValueError, match=r"side server name must be 1..64 of \[A-Za-z0-9_.-\], got 'a/b'"):
        ProcessLink().side_bind("a/b")
    # a reactor outside any run, and one in a single-process run, get the empty link
    from reactor import Graph, Reactor, reaction, run, startup

    seen = []

    class Probe(Reactor):
        @reaction(triggers=[startup])
        def look(self) -> None:
            seen.append(self.process_link)

    assert Probe().process_link == ProcessLink()
    g = Graph()
    g.add(Probe(), name="p")
    run(g)
    assert seen == [ProcessLink()]
