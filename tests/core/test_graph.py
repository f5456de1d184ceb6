"""Graph construction, validation errors (with app-file sites), bank connection modes, rendering."""

from __future__ import annotations

import re

import pytest

from reactor import Graph, GraphError, Input, Output, Reactor, reaction, run, startup
from reactor._graph import MAX_LINKS, MAX_REPLICAS

GOT: list = []


class Src(Reactor):
    out = Output(int)

    def __init__(self, n: int = 4) -> None:
        self.n = n

    @reaction(triggers=[startup], effects=[out])
    def go(self) -> None:
        for k in range(self.n):
            self.out.send(100 * self.bank_index + k)


class Dst(Reactor):
    inp = Input(int, required=True)

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        GOT.append((self.name, inp))


class StrSink(Reactor):
    inp = Input(str)


class Loop(Reactor):
    inp = Input(int)
    out = Output(int)


@pytest.fixture(autouse=True)
def _clear():
    GOT.clear()
    yield
    GOT.clear()


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if marker in line and "_line_of" not in line:
                return i
    raise AssertionError(marker)


def test_unconnected_required_input_names_reactor_port_and_app_line():
    g = Graph()
    g.add(Dst(), name="lonely")  # SITE-lonely
    with pytest.raises(GraphError) as e:
        g.validate()
    line = _line_of("SITE-lonely")
    assert re.search(
        rf"lonely\.inp is a required input of Dst but nothing is connected to it \(.*test_graph\.py:{line}\)",
        str(e.value),
    )


def test_type_mismatch_names_both_ports_and_types():
    g = Graph()
    s = g.add(Src(), name="s")
    k = g.add(StrSink(), name="k")
    g.connect(s.out, k.inp)  # SITE-mismatch
    with pytest.raises(GraphError, match=rf"k\.inp expects str, got int from s\.out \(.*:{_line_of('SITE-mismatch')}\)"):
        g.validate()


def test_zero_delay_cycle_is_rejected_and_a_delay_breaks_it():
    g = Graph()
    a = g.add(Loop(), name="a")
    b = g.add(Loop(), name="b")
    g.connect(a.out, b.inp)
    g.connect(b.out, a.inp)
    with pytest.raises(GraphError, match=r"zero-delay cycle: a\.out -> b\.out -> a"):
        g.validate()
    g2 = Graph()
    a = g2.add(Loop(), name="a")
    b = g2.add(Loop(), name="b")
    g2.connect(a.out, b.inp)
    g2.connect(b.out, a.inp, delay_s=0.001)
    g2.validate()


def test_duplicate_names_are_reported_with_both_sites():
    g = Graph()
    g.add(Src(), name="x")
    g.add(Src(), name="x")
    with pytest.raises(GraphError, match=r"duplicate reactor name 'x': added at .*test_graph\.py:\d+ and again at .*test_graph\.py:\d+"):
        g.validate()


def test_a_reactor_named_like_another_banks_replica_is_refused_naming_both():
    g = Graph()
    g.add(Src(), name="w", replicas=2)
    g.add(Src(), name="w-1")
    with pytest.raises(GraphError, match=r"reactors 'w\[1\]' and 'w-1' have one plain name 'w-1'.*rename 'w-1'"):
        g.validate()
    ok = Graph()
    ok.add(Src(), name="w", replicas=2)
    ok.add(Src(), name="w-2")  # (w has replicas 0 and 1 only)
    ok.validate()


def test_every_problem_is_listed_at_once():
    g = Graph()
    g.add(Dst(), name="d1")
    g.add(Dst(), name="d2")
    with pytest.raises(GraphError) as e:
        g.validate()
    assert "d1.inp" in str(e.value) and "d2.inp" in str(e.value)


def test_connect_rejects_wrong_direction_unknown_mode_and_size_mismatch():
    g = Graph()
    s = g.add(Src(), name="s", replicas=2)
    d = g.add(Dst(), name="d", replicas=3)
    with pytest.raises(GraphError, match=r"connect source d\.inp is an input"):
        g.connect(d.inp, s.out)
    with pytest.raises(GraphError, match=r"unknown connection mode 'scatter'"):
        g.connect(s.out, d.inp, mode="scatter")
    with pytest.raises(GraphError, match=r"one_to_one needs equal bank sizes: s.out has 2, d.inp has 3"):
        g.connect(s.out, d.inp, mode="one_to_one")
    with pytest.raises(GraphError, match=r"has no port 'nope'; its ports: out"):
        s.nope  # noqa: B018
    with pytest.raises(GraphError, match=r"replicas must be an int >= 1, got 0"):
        g.add(Src(), name="z", replicas=0)


def test_a_bank_or_a_graph_too_large_to_expand_is_refused_when_it_is_made():
    """Regression (a hostile pass): ``--set actors=100000000000`` (zeros too many) was taken by
    ``Graph.add``, and the run built a list of that many instance names until the OOM killer came; two
    banks of 60,000 round-robin into each other made 3.6e9 links the same way. Now both are refused as
    they are made, naming the count, the bound and the app line."""
    g = Graph()
    with pytest.raises(GraphError, match=rf"replicas must be at most {MAX_REPLICAS:,}, got 10{'0' * 22} "
                                         rf"\(.*test_graph\.py:\d+\)"):
        g.add(Src(), name="s", replicas=10**23)
    g.add(Src(), name="ok", replicas=MAX_REPLICAS)  # (the bound itself is taken)
    s = g.add(Src(), name="s", replicas=1024)
    d = g.add(Dst(), name="d", replicas=1024)
    g.connect(s.out, d.inp, mode="one_to_one")  # 1,024 links
    with pytest.raises(GraphError, match=r"s\.out -> d\.inp \(round_robin\) makes 1,048,576 replica-level links "
                                         r"\(1,024 x 1,024\), the graph 1,049,600 in all, past the 1,048,576"):
        g.connect(s.out, d.inp, mode="round_robin")
    assert len(g.connections) == 1 and len(g.links()) == 1024 and MAX_LINKS == 1 << 20


def _deliveries(mode: str, src_n: int, dst_n: int, **kw) -> dict[str, list[int]]:
    g = Graph()
    s = g.add(Src(4), name="s", replicas=src_n)
    d = g.add(Dst(), name="d", replicas=dst_n)
    g.connect(s.out, d.inp, mode=mode, **kw)
    run(g)
    out: dict[str, list[int]] = {}
    for name, v in GOT:
        out.setdefault(name, []).append(v)
    return {k: sorted(v) for k, v in sorted(out.items())}


def test_broadcast_fan_out_reaches_every_replica():
    got = _deliveries("broadcast", 1, 3)
    assert got == {"d[0]": [0, 1, 2, 3], "d[1]": [0, 1, 2, 3], "d[2]": [0, 1, 2, 3]}


def test_round_robin_spreads_each_sources_messages_starting_at_its_index():
    got = _deliveries("round_robin", 2, 2)
    assert got == {"d[0]": [0, 2, 101, 103], "d[1]": [1, 3, 100, 102]}


def test_one_to_one_pairs_replicas():
    got = _deliveries("one_to_one", 2, 2)
    assert got == {"d[0]": [0, 1, 2, 3], "d[1]": [100, 101, 102, 103]}


def test_keyed_routes_by_key_modulo_bank_size():
    got = _deliveries("keyed", 1, 3, key=lambda v: v)
    assert got == {"d[0]": [0, 3], "d[1]": [1], "d[2]": [2]}


def test_fan_in_from_a_bank_delivers_every_message_once():
    got = _deliveries("broadcast", 3, 1)
    assert got == {"d": [0, 1, 2, 3, 100, 101, 102, 103, 200, 201, 202, 203]}


def test_single_replica_of_a_bank_can_be_connected():
    g = Graph()
    s = g.add(Src(1), name="s", replicas=3)
    d = g.add(Dst(), name="d")
    g.connect(s[2].out, d.inp)
    run(g)
    assert GOT == [("d", 200)]


def test_describe_and_mermaid_show_nodes_banks_and_edges():
    g = Graph()
    s = g.add(Src(), name="s", replicas=2)
    d = g.add(Dst(), name="d")
    g.connect(s.out, d.inp, delay_s=0.5)
    assert "s x2 (Src)" in g.describe()
    assert "s.out -> d.inp  (broadcast, delay 0.5s)" in g.describe()
    m = g.mermaid()
    assert m.startswith("flowchart LR")
    assert 's -->|"out → inp +0.5s"| d' in m


def test_a_reactor_name_that_is_not_a_str_is_a_graph_error():
    """It was re's TypeError ("expected string or bytes-like object") from the name's pattern."""
    class Lone(Reactor):
        pass

    with pytest.raises(GraphError, match=r"^reactor name must be a str, got int 3 \(.*test_graph.py:\d+\)$"):
        Graph().add(Lone(), name=3)  # type: ignore[arg-type]

