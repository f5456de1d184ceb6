"""Every benchmark script refuses a bad argument in one argparse line (exit status 2) before it measures,
starts a process or makes a network namespace: never a traceback from deep in a run, a hang, or an
option silently ignored. And a peer that is not installed is one line, the other cases still measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (script, arguments, the error after "<script>: error: ")
BAD = [
    ("bench_replay.py", ["--only", "bogus"],
     "argument --only: unknown 'bogus'; choose from transitions,episodes,arity,drift (comma-separated)"),
    ("bench_replay.py", ["--reps", "0"], "argument --reps: expects an integer >= 1, got '0'"),
    ("bench_bulk.py", ["--rows", "16"], "--rows 16 must exceed --batch x --length = 8192 (the memcpy baseline "
                                        "copies that many rows from a random place of a region of --rows)"),
    ("bench_onesided.py", ["--capacity", "2048"],
     "--capacity 2048 over --shards 4 leaves 512 steps a shard; give at least 8192"),
    ("bench_onesided_remote.py", ["--calls", "0"], "argument --calls: expects an integer >= 1, got '0'"),
    ("bench_replay_service.py", ["--inflight", "0"], "argument --inflight: expects an integer >= 1, got '0'"),
    ("bench_replay_service.py", ["--quick", "--capacity", "8192"],
     "--capacity 8192: must be a multiple of --shards (4), more than a batch's 8192 steps (the memcpy baseline "
     "copies a batch from a random place of a buffer that large), and at least 2 x --flush-steps (2048) a shard"),
    ("bench_messaging.py", ["--reps", "0"], "argument --reps: expects an integer >= 1, got '0'"),
    ("bench_training.py", ["--algos", "dqn,td4"],
     "argument --algos: unknown 'td4'; choose from dqn,ppo,sac (comma-separated)"),
    ("bench_training.py", ["--budget-s", "0"], "argument --budget-s: expects a number > 0, got '0'"),
    ("bench_startstop.py", ["--reps", "0"], "argument --reps: expects an integer >= 1, got '0'"),
    ("bench_wal.py", ["--batches", "-1"], "argument --batches: expects an integer >= 1, got '-1'"),
    ("bench_cluster.py", ["--only", "lost"],
     "argument --only: unknown 'lost'; choose from throughput,kill,cut,restart,startup (comma-separated)"),
    ("bench_cluster.py", ["--settle-s", "0"], "argument --settle-s: expects a number > 0, got '0'"),
    ("peers/ray_peer.py", ["--only", "kill,lost"],
     "argument --only: unknown 'lost'; choose from kill,restart,startup,cut (comma-separated)"),
    ("peers/ray_peer.py", ["--only", "cut"], "--only cut needs --nodes and --cut"),
    ("peers/ray_peer.py", ["--only", "cut", "--nodes", "h1=ns1@198.18.44.1", "--cut", "ns3:p3"],
     "argument --nodes: expects HOST=NAMESPACE@IP,... (at least two), got 'h1=ns1@198.18.44.1'"),
    ("bench_gpu.py", ["--device", "cpu", "--parts", "replay,x"],
     "argument --parts: unknown 'x'; choose from replay,torchrl,replies,learners,transformer (comma-separated)"),
]

# Each script run as `python benchmarks/<script> ARGS` would run it, all in one interpreter (the imports
# once); what each printed last on stderr and its exit status, as JSON.
RUNNER = """
import contextlib, io, json, runpy, sys
out = []
for script, args in json.loads(sys.argv[1]):
    sys.argv = [script, *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(f"benchmarks/{script}", run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    out.append([code, err.getvalue().strip().splitlines()[-1:]])
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_each_benchmark_refuses_a_bad_argument_in_one_line_before_it_starts():
    cases = json.dumps([[script, args] for script, args, _ in BAD])
    proc = subprocess.run([sys.executable, "-c", RUNNER, cases], cwd=ROOT, capture_output=True, text=True,
                          timeout=110, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (script, args, error), (code, last) in zip(BAD, json.loads(proc.stdout.splitlines()[-1]), strict=True):
        assert (code, last) == (2, [f"{Path(script).name}: error: {error}"]), (script, args)


@pytest.mark.timeout(120)
def test_the_episode_benchmark_without_cpprb_says_so_in_one_line_and_measures_ours(tmp_path):
    """Regression: without cpprb (a fresh .venv, before `pip install -e ".[bench]"`), `bench_replay.py
    --only episodes`, the command of docs/benchmarks.md, ended in a ModuleNotFoundError traceback."""
    (tmp_path / "cpprb.py").write_text("raise ModuleNotFoundError(\"No module named 'cpprb'\", name='cpprb')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "benchmarks/bench_replay.py", "--only", "episodes", "--reps", "1",
                           "--calls", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "cpprb: not installed (no module 'cpprb'); not compared. pip install -e '.[bench]' adds it." in lines
    rows = [line.split() for line in lines[lines.index(next(x for x in lines if x.split()[:1] == ["episode"])) + 1:]]
    assert [r[0] for r in rows] == ["1", "32", "256", "4096"]
    assert all(float(r[1]) > 0 and r[2:] == ["-", "-"] for r in rows), rows


@pytest.mark.timeout(120)
def test_the_ray_peer_without_ray_says_so_in_one_line_and_gives_no_figures(tmp_path):
    """bench_cluster.py's Ray peer is optional: without Ray it exits 0 with one line on stderr and
    {"skipped": why} as its figures, which bench_cluster prints as "Ray peer skipped: why" beside ours."""
    (tmp_path / "ray.py").write_text("raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "benchmarks/peers/ray_peer.py", "--only", "kill"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=110, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "[ray peer] Ray peer skipped: not installed (no module 'ray')\n"
    assert json.loads(proc.stdout) == {"skipped": "not installed (no module 'ray')"}
