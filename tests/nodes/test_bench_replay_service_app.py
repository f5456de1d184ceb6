"""The replay service benchmark's app runs end to end (so the benchmark cannot rot unnoticed).

One async single-process run of ``benchmarks/apps/replay_service.py`` with a small table: the
writers' inserts complete (the shards count every item sent), the same-host learner gathers its
windows from the shards' shared memory (through messages, and one-sidedly from their published sum
trees), the other one gets them in the replies or reads them from the shards' bulk read servers, and
every batch
is whole. No timing is asserted (the figures are the benchmark's business).
"""

from __future__ import annotations

import json
from pathlib import Path

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
