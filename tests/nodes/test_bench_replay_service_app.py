"""The replay service benchmark's app runs end to end (so the benchmark cannot rot unnoticed).

One async single-process run of ``benchmarks/apps/replay_service.py`` with a small table: the
writers' inserts complete (the shards count every item sent), the same-host learner gathers its
windows from the shards' shared memory (through messages, and one-sidedly from their published sum
trees), the other one gets them in the replies or reads them from the shards' bulk read servers, and
every batch
is whole. No timing is asserted (the figures are the benchmark's business).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import sys
import time
from pathlib import Path

import pytest

from reactor import run
from reactor.launch._app import build_graph

APP = str(Path(__file__).resolve().parents[2] / "benchmarks" / "apps" / "replay_service.py")


def test_benchmark_app_fills_the_shards_and_samples_through_both_paths(tmp_path):
    report = tmp_path / "report.json"
    cfg = {"capacity": 1 << 16, "envs": 8, "reps": 2, "calls": 3, "round_rows": 2048, "inflight": 2,
           "report": str(report)}
    res = run(build_graph(APP, cfg), deterministic=False, stop_s=120)
    assert res.stopped_by == "request"
    rep = json.loads(report.read_text())
    assert "error" not in rep
    full = rep["shards_after_fill"]
    assert all(s["rejected_steps"] == 0 and s["parked_steps"] == 0 for s in full)
    assert sum(s["num_steps"] for s in full) > 0.9 * (1 << 16)  # the first fill filled the shards
    assert len(rep["insert"]) == 2 and len(rep["local_insert"]) == 2
    # One process: the roles' CPU cannot be told apart (None); the in-process peer's is its thread's.
    assert all(r["cpu"] is None for r in rep["insert"])
    assert all(0 < r["cpu"]["bench"] < r["s"] * 1.5 for r in rep["local_insert"])
    for key in ("shm", "shm_x2", "msg", "msg_x2", "onesided", "onesided_x2"):
        assert len(rep[key]) == 2 and rep[f"{key}_items"] == [256.0, 256.0], key  # whole batches
    # One-sided: every batch drawn from the shards' published trees, none fell back to messages.
    assert len(rep["local"]) == 2 and rep["local_items"] == [256.0, 256.0] and rep["local_fallbacks"] == [0, 0]
    # ... also drawn ahead, two at a time on the client's threads
    assert len(rep["local_x2"]) == 2 and rep["local_x2_items"] == [256.0, 256.0]
    assert rep["local_x2_fallbacks"] == [0, 0]
    # ... and by the learner "on another host", through the shards' read servers, one request per shard
    assert len(rep["remote"]) == 2 and rep["remote_items"] == [256.0, 256.0] and rep["remote_fallbacks"] == [0, 0]
    # ... also drawn ahead, two samples' requests out at once
    assert len(rep["remote_x2"]) == 2 and rep["remote_x2_items"] == [256.0, 256.0]
    assert rep["remote_x2_fallbacks"] == [0, 0]
    # bench[0]: 2 reps x 2 depths x 3 batches + warm-up 2 x 3 through messages, and 2 reps x 2 depths x 3
    # + warm-up 2 x 3 one-sided (one at a time, and drawn ahead), all gathered from shared memory
    assert rep["client"] == {"gathered_items": (2 * 2 * 3 + 2 * 3 + 2 * 2 * 3 + 2 * 3) * 256, "dropped_items": 0}
    assert rep["batch_fields_nbytes"] == {"obs": 256 * 32 * 256, "action": 256 * 32 * 8, "reward": 256 * 32 * 4,
                                          "terminated": 256 * 32, "mask": 256 * 32}


def _spin_as(name: str, spin_s: float, ready, stop) -> None:  # noqa: ANN001 - multiprocessing events
    with open("/proc/self/comm", "w") as f:
        f.write(name)
    t0 = time.process_time()
    while time.process_time() - t0 < spin_s:
        pass
    ready.set()
    stop.wait(30)


def _measure(queue) -> None:  # noqa: ANN001
    spec = importlib.util.spec_from_file_location("replay_service_app", APP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    queue.put(mod.run_cpu_s())


def test_the_insert_rounds_cpu_is_read_per_role_from_the_runs_sibling_processes():
    """``run_cpu_s`` (what the benchmark's insert rounds report per role) finds the processes that
    share its parent by their ``rx:`` names and sums their threads' CPU; others are left out."""
    ctx = multiprocessing.get_context("fork")
    stop, queue = ctx.Event(), ctx.Queue()
    spinners = [(ctx.Event(), name, s) for name, s in (("rx:writer-0", 0.3), ("rx:replay-1", 0.1), ("other", 0.2))]
    procs = [ctx.Process(target=_spin_as, args=(name, s, ready, stop)) for ready, name, s in spinners]
    for p in procs:
        p.start()
    try:
        assert all(ready.wait(30) for ready, _, _ in spinners)
        m = ctx.Process(target=_measure, args=(queue,))
        m.start()
        cpu = queue.get(timeout=30)
        m.join(30)
    finally:
        stop.set()
        for p in procs:
            p.join(30)
    assert 0.3 <= cpu["writer"] < 1.0 and 0.1 <= cpu["replay"] < 0.8
    assert set(cpu) <= {"writer", "replay", "writer_io", "replay_io", "switches"}  # "other" is no worker of a run
    assert cpu["switches"] >= 2  # each of the two was put on a CPU at least once


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [1, 0])
def test_writers_in_their_own_processes_stage_their_rows_for_the_shards_of_their_host(tmp_path, stage, caplog):
    """The benchmark's placement (one process per reactor instance, one host): the writers stage their rows
    in shared memory once a shard's ack says it reads them there (reactor/nodes/_staging.py), and the
    shards insert every item from the writers' regions after their first acks; with ``stage`` off, every row
    goes in the messages. Either way every item sent is inserted and none is refused, and the writers unlink
    their regions (the run's end found none to remove)."""
    sys.path.insert(0, str(Path(APP).parents[2]))
    from benchmarks.bench_replay_service import placement_file

    report = tmp_path / "report.json"
    cfg = {"shards": 2, "writers": 2, "capacity": 1 << 15, "envs": 8, "reps": 1, "calls": 2, "round_rows": 4096,
           "inflight": 1, "stage": stage, "report": str(report)}
    placement = placement_file(str(tmp_path), 2, 2)
    with caplog.at_level(logging.WARNING):
        res = run(build_graph(APP, cfg), placement=placement, app=APP, config=cfg, deterministic=False, stop_s=240)
    assert res.stopped_by == "request"
    assert not [m for m in caplog.messages if "shared-memory segment" in m], caplog.messages
    rep = json.loads(report.read_text())
    assert "error" not in rep
    end = rep["shards_end"]
    assert all(s["rejected_steps"] == 0 and s["parked_steps"] == 0 for s in end)
    rounds = rep["insert_cold"] + rep["insert"]
    rows = sum(r["rows"] for r in rounds)
    staged = sum(r["staged_rows"] for r in rounds)
    if stage:
        # A writer's messages before its first acks carry their rows (how many of the cold round's go out
        # before them is timing: all of them, on a loaded host); from then on every row is staged (8 messages
        # in flight a shard, as in the training apps, fit in the rings).
        assert all(s["staged_steps"] > 0 for s in end), end
        assert sum(s["staged_steps"] for s in end) == staged >= sum(r["rows"] for r in rep["insert"]), (staged, rows)
        assert [r["staged_rows"] for r in rep["insert"]] == [r["rows"] for r in rep["insert"]]
    else:
        assert staged == 0 and all(s["staged_steps"] == 0 for s in end)
