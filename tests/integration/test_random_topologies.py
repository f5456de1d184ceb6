"""Property test: random DAG topologies give identical results under `single` and `processes`."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reactor import run
from reactor.launch._app import build_graph

DAG = str(Path(__file__).resolve().parents[1] / "apps" / "dag.py")


@st.composite
def dags(draw):
    n = draw(st.integers(2, 4))
    kinds = ["tick3" if i == 0 else draw(st.sampled_from(["mix", "mix", "tick5"])) for i in range(n)]
    reps = [draw(st.integers(1, 2)) for _ in range(n)]
    # Keep the process count small: at most 5 instances in all.
    while sum(reps) > 5:
        reps[reps.index(2)] = 1
    edges = []
    for dst in range(1, n):
        srcs = draw(st.lists(st.integers(0, dst - 1), min_size=1, max_size=2, unique=True))
        for src in srcs:
            modes = ["broadcast", "round_robin", "keyed"] + (["one_to_one"] if reps[src] == reps[dst] else [])
            edges.append([src, dst, draw(st.sampled_from(modes)), draw(st.sampled_from([0, 0, 1, 2]))])
    return {"nodes": [[k, r] for k, r in zip(kinds, reps)], "edges": edges, "stop_s": 0.04}


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(config=dags(), seed=st.integers(0, 2**16))
def test_random_dag_gives_identical_digests_under_single_and_processes(config, seed):
    single = run(build_graph(DAG, config), seed=seed, digest=True)
    multi = run(build_graph(DAG, config), seed=seed, digest=True, placement="processes", app=DAG, config=config)
    assert single.digests == multi.digests
    assert single.events == multi.events
    assert sum(single.events.values()) > len(single.events)  # something beyond startup happened
