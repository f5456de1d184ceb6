"""Sharded replay across real processes: N shards sample like one table, deterministically.

Every run here starts real worker processes (ZeroMQ over ipc) through the runtime; the apps are in
``tests/apps/replay_service.py``. Deterministic runs need a stop time: the learner <-> shard
request loop keeps promising logical time forward while idle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from reactor import run
from reactor.launch._app import build_graph
from reactor.replay import FieldSpec, MinSize, Prioritized, StepRead, Storage, Table, Uniform


def _npz(path) -> dict:
    """An .npz file's arrays, the file closed (an NpzFile left open warns when a later test collects it)."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


APP = str(Path(__file__).resolve().parents[1] / "apps" / "replay_service.py")


def _run(config: dict, **kw):
    return run(build_graph(APP, config), app=APP, config=config, **kw)


def _chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularized upper incomplete gamma function."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _single_table(items: int, alpha: float, beta: float, seed: int = 0) -> Table:
    from tests.apps.replay_service import item_priority  # noqa: PLC0415 - the app's priorities

    ids = np.arange(items, dtype=np.int64)
    t = Table(Storage([FieldSpec("id", (), torch.int64)], items), sampler=Prioritized(alpha), remover=Uniform(),
              rate_limiter=MinSize(1), read=StepRead(), beta=beta, seed=seed)
    t.insert_nowait({"id": ids}, item_priority(ids), episode_end=np.ones(items, bool))
    return t


@pytest.mark.slow
@pytest.mark.parametrize("masses", ["cached", "fresh"])
def test_four_shards_in_four_processes_sample_like_one_table(tmp_path, masses):
    """Issue 4: frequencies over 4 shards in 4 processes match one table holding the same data (chi-square).

    Also exact: each draw's reported probability and importance weight equal what the single table
    reports for that item (global total, global min). Both protocols: one round per sample from the
    masses of the shards' last replies ("cached"), and a mass round before each sample ("fresh").
    """
    items, batches, bs = 400, 100, 256
    out = tmp_path / "learner.npz"
    res = _run({"source": "items", "items": items, "shards": 4, "actors": 1, "min_size": items // 4,
                "batches": batches, "batch_size": bs, "alpha": 1.0, "beta": 0.5, "out": str(out), "masses": masses},
               placement="processes", stop_s=0.3)
    assert {f"replay-{i}" for i in range(4)} <= set(res.processes)
    rec = _npz(out)
    assert rec["lens"].tolist() == [bs] * batches
    assert (rec["sizes"] == items).all()
    ids = rec["ids"]

    single = _single_table(items, alpha=1.0, beta=0.5)
    draws, info = single.sample_nowait(len(ids))
    p_single = np.zeros(items)
    w_single = np.zeros(items)
    p_single[draws["id"].numpy()] = info.probabilities.numpy()
    w_single[draws["id"].numpy()] = info.weights.numpy()
    assert (p_single > 0).all()  # 102400 draws reach every item

    # Exactness of the reported figures.
    np.testing.assert_allclose(rec["probs"], p_single[ids], rtol=1e-9)
    np.testing.assert_allclose(rec["weights"], w_single[ids], rtol=1e-6)

    # Goodness of fit against the single table's distribution ...
    counts = np.bincount(ids, minlength=items)
    expected = p_single * len(ids)
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert _chi2_sf(stat, items - 1) > 1e-3, f"chi-square {stat:.1f} on {items - 1} dof"
    # ... and homogeneity with the single table's own draws of the same size.
    c2 = np.bincount(draws["id"].numpy(), minlength=items)
    both = counts + c2
    e1, e2 = both * counts.sum() / (2 * counts.sum()), both * c2.sum() / (2 * c2.sum())
    stat2 = float(((counts - e1) ** 2 / e1 + (c2 - e2) ** 2 / e2).sum())
    assert _chi2_sf(stat2, items - 1) > 1e-3, f"homogeneity chi-square {stat2:.1f} on {items - 1} dof"


def test_one_item_samples_leave_a_shard_out_and_still_report_exact_probabilities(tmp_path):
    """Batches of 1 from 2 shards in 2 processes: every one-round sample sends one shard n=0, which
    must answer at once with its figures; the reported probabilities and weights stay the single
    table's, and the draws follow its distribution."""
    items, batches = 40, 200
    out = tmp_path / "learner.npz"
    _run({"source": "items", "items": items, "shards": 2, "actors": 1, "min_size": items // 2,
          "batches": batches, "batch_size": 1, "alpha": 1.0, "beta": 0.5, "out": str(out)},
         placement="processes", stop_s=0.3)
    rec = _npz(out)
    assert rec["lens"].tolist() == [1] * batches
    single = _single_table(items, alpha=1.0, beta=0.5)
    draws, info = single.sample_nowait(4000)
    p_single = np.zeros(items)
    w_single = np.zeros(items)
    p_single[draws["id"].numpy()] = info.probabilities.numpy()
    w_single[draws["id"].numpy()] = info.weights.numpy()
    ids = rec["ids"]
    np.testing.assert_allclose(rec["probs"], p_single[ids], rtol=1e-9)
    np.testing.assert_allclose(rec["weights"], w_single[ids], rtol=1e-6)
    assert len(set((ids % 2).tolist())) == 2  # both shards were drawn from


@pytest.mark.slow
def test_deterministic_samples_are_identical_under_single_and_processes(tmp_path):
    """Gym actors, 2 shards, a learner updating priorities: the same samples wherever each runs."""
    cfg = {"shards": 2, "actors": 2, "min_size": 50, "batches": 15, "update": "random"}
    a, b = tmp_path / "single.npz", tmp_path / "processes.npz"
    ra = _run({**cfg, "out": str(a)}, stop_s=0.15, digest=True)
    rb = _run({**cfg, "out": str(b)}, stop_s=0.15, digest=True, placement="processes")
    ka, kb = _npz(a), _npz(b)
    assert ka["lens"].tolist() == [64] * 15
    for name in ("keys", "probs", "weights", "sizes", "t_ns", "digest"):
        np.testing.assert_array_equal(ka[name], kb[name], err_msg=name)
    assert ra.digests == rb.digests
