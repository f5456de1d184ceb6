"""Replay shards behind ports: parking under the rate limiter, bad input, checkpoints, the client.

The graphs come from ``tests/apps/replay_service.py`` (real gymnasium CartPole actors writing through
the Writer, Replay shards, a learner sampling through the ReplayClient).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from reactor import PeerLostError, run
from reactor.launch._app import build_graph
from reactor.nodes import (
    PriorityUpdate,
    Replay,
    ReplayClient,
    SampleRequest,
    ShardMass,
    ShardSample,
    key_local,
    key_shard,
    make_keys,
)
from reactor.nodes.messages import Exhausted, MassRequest


def _npz(path) -> dict:
    """An .npz file's arrays, the file closed (an NpzFile left open warns when a later test collects it)."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


APP = str(Path(__file__).resolve().parents[1] / "apps" / "replay_service.py")


def _run(config: dict, **kw):
    return run(build_graph(APP, config), app=APP, config=config, **kw)


def test_a_sampler_blocked_below_min_size_is_released_by_inserts(tmp_path):
    """Issue 4: the learner asks at t=0; each shard parks the request until it holds min_size items."""
    out = tmp_path / "learner.npz"
    _run({"shards": 2, "actors": 2, "min_size": 120, "batches": 5, "out": str(out)})
    rec = _npz(out)
    assert len(rec["lens"]) == 5
    assert rec["sizes"][0] >= 2 * 120  # the first batch came only once both shards were ready
    assert rec["t_ns"][0] > 0  # ... which took the actors some steps (1 ms of logical time each)


def test_bad_steps_are_refused_logged_and_counted_and_the_shard_keeps_serving(tmp_path, caplog):
    out, stats = tmp_path / "learner.npz", tmp_path / "stats.npz"
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        _run({"source": "bad", "shards": 2, "actors": 2, "batches": 3, "batch_size": 8, "out": str(out),
              "stats_out": str(stats)})
    s = _npz(stats)
    assert s["size"].tolist() == [16, 16]  # the good message of each of the 2 writers, per shard
    assert s["rejected_steps"].tolist() == [2 * 28, 2 * 28]  # 8 + 8 + 8 + 4 rows refused per writer
    msgs = [r.getMessage() for r in caplog.records]
    assert any("refused steps from writer 9 (flush 0): field 'id' has dtype torch.float64, expected torch.int64" in m
               for m in msgs)
    assert any("unknown field(s) ['extra']" in m for m in msgs)
    assert any("episode_end must be a non-empty bool [L] array whose last entry is True" in m for m in msgs)
    rec = _npz(out)
    assert len(rec["lens"]) == 3 and rec["sizes"][0] == 32


@pytest.mark.parametrize("placement", ["single", "processes"])
def test_a_request_held_for_good_is_answered_exhausted_once_every_writer_has_ended(tmp_path, caplog, placement):
    """Replay(writers=N): once each writer has sent its end marker, a request the rate limiter holds
    (here below min size, for good) is answered Exhausted, not parked forever; malformed markers
    are refused, logged and not counted."""
    out, stats = tmp_path / "learner.npz", tmp_path / "stats.npz"
    cfg = {"source": "markers", "shards": 2, "actors": 2, "writers": True, "min_size": 1000, "batches": 3,
           "out": str(out), "stats_out": str(stats)}
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        _run(cfg, placement=placement)
    rec = _npz(out)
    assert bool(rec["exhausted"]) and len(rec["lens"]) == 0
    # Each shard: 8 + 8 (last=np.False_) + 8 (writer True) rows from each of the 2 writers; refused: the
    # marker with rows and the float64 rows after the good marker (neither made its writer live again).
    s = _npz(stats)
    assert s["size"].tolist() == [48, 48] and s["rejected_steps"].tolist() == [32, 32]
    if placement == "single":  # (in processes the shards log in their own processes)
        msgs = [r.getMessage() for r in caplog.records]
        assert any("an end marker (Steps.last) carries no rows: fields {} and an empty episode_end; got fields of "
                   "type dict and episode_end ndarray (8,)" in m for m in msgs), msgs
        assert any("an end marker from writer 99, not a writer id in [0, 2) (Replay(writers=2))" in m for m in msgs)
        assert any("Steps.last must be True or False, got 'yes'" in m for m in msgs)
    # Without the good markers the bad ones count for nothing: the request stays parked to the end.
    _run({**cfg, "good_markers": False, "out": str(tmp_path / "parked.npz")}, placement=placement)
    assert not bool(_npz(tmp_path / "parked.npz")["exhausted"])


def test_a_sampler_draws_what_the_ratio_allows_then_learns_that_no_sample_can_come(tmp_path):
    """Real gym actors end their writers (Writer.end); a SampleToInsertRatio limiter then holds the
    sampler's request for good, and the shards answer Exhausted instead of leaving it parked."""
    out, stats = tmp_path / "learner.npz", tmp_path / "stats.npz"
    cfg = {"shards": 2, "actors": 2, "writers": True, "ratio": 2.0, "error_buffer": 200, "min_size": 50,
           "batches": 10_000, "batch_size": 32, "out": str(out), "stats_out": str(stats)}
    _run(cfg)
    rec, s = _npz(out), _npz(stats)
    assert bool(rec["exhausted"])
    drawn = int(rec["lens"].sum())
    # (the shards also count what one shard drew for the last sample, dropped when another said Exhausted)
    assert 0 < drawn <= int(s["sampled"].sum()) < drawn + 32
    # Each shard allowed at most its ratio of what it holds past min size, plus its error buffer
    # (Reverb's rule); the one that answered Exhausted was within a batch of that.
    limit = 2.0 * (s["inserted"] - 50) + 200
    assert (s["sampled"] <= limit).all() and (s["sampled"] > limit - 32).any(), (s["sampled"], limit)


def test_priority_updates_reach_the_shard_that_owns_each_key(tmp_path):
    """After the first batch its keys get priority 1000 (alpha=1): later batches are mostly those keys.

    The second batch is requested with the masses of the first batch's replies (one-round sampling),
    so its shard shares predate the boost; from the third on they follow it.
    """
    out = tmp_path / "learner.npz"
    _run({"source": "items", "items": 400, "shards": 4, "actors": 1, "min_size": 100, "batches": 7,
          "batch_size": 32, "update": "boost", "out": str(out)})
    rec = _npz(out)
    boosted = set(rec["boosted"].tolist())
    assert len({int(k) for k in key_shard(rec["boosted"])}) > 1  # the boosted keys live on several shards
    later = rec["keys"][rec["lens"][:2].sum():]
    frac = np.isin(later, list(boosted)).mean()
    base = sum(1000.0 for _ in boosted)
    assert frac > 0.9, f"only {frac:.2f} of later draws were boosted keys (expected ~{base / (base + 400 * 5):.2f})"


def test_checkpoints_restore_the_shards_on_the_next_start(tmp_path):
    run_dir = tmp_path / "run"
    stats = tmp_path / "stats.npz"
    cfg = {"shards": 2, "actors": 1, "batches": 2, "run_dir": str(run_dir), "checkpoint_on_shutdown": True,
           "stats_out": str(stats)}
    _run(cfg)
    first = _npz(stats)
    assert first["restored_from"].tolist() == ["", ""]
    for shard in (0, 1):
        assert (run_dir / f"replay-{shard}" / "ckpt-00000001" / "COMPLETE").is_file()
    _run({**cfg, "env_steps": 10})
    second = _npz(stats)
    assert [Path(p).parent.name for p in second["restored_from"]] == ["replay-0", "replay-1"]
    # Restored items plus the second run's own inserts.
    assert (second["inserted"] > first["inserted"]).all()
    assert (second["size"] >= first["size"]).all()


def test_periodic_checkpoints_are_written_in_the_background(tmp_path):
    run_dir = tmp_path / "run"
    _run({"shards": 1, "actors": 1, "batches": 2, "run_dir": str(run_dir), "checkpoint_period_s": 0.05},
         stop_s=0.3)
    done = sorted(p.name for p in (run_dir / "replay").iterdir() if (p / "COMPLETE").is_file())
    assert 1 <= len(done) <= 3  # keep_checkpoints=3 prunes older ones


# ------------------------------------------------------------------------------------ client logic


def test_keys_carry_their_shard():
    keys = make_keys(3, np.array([0, 5, 2**40]))
    assert key_shard(keys).tolist() == [3, 3, 3]
    assert key_local(keys).tolist() == [0, 5, 2**40]


def _mass(shard, rid, mass, size, min_mass=1.0):
    return ShardMass(shard, 0, rid, "", mass, min_mass, size, 0.5)


def test_client_draws_shard_counts_in_proportion_to_mass_and_computes_global_weights():
    client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None)
    reqs = client.request(1000)
    assert [type(r) for r in reqs] == [MassRequest, MassRequest]
    out, batch = client.receive(_mass(0, reqs[0].request, 100.0, 50, min_mass=0.5))
    assert out == [] and batch is None
    out, batch = client.receive(_mass(1, reqs[1].request, 300.0, 50, min_mass=2.0))
    assert all(isinstance(r, SampleRequest) for r in out)
    counts = {r.shard: r.n for r in out}
    assert sum(counts.values()) == 1000 and 180 < counts[0] < 320  # Multinomial(1000, [0.25, 0.75])
    parts = []
    for r in out:
        q = np.full(r.n, 0.01)  # each drawn item: within-shard probability 1%
        parts.append(ShardSample(r.shard, 0, r.request, "", {"x": np.arange(r.n)}, make_keys(r.shard, np.arange(r.n)),
                                 q, np.ones(r.n, np.int64), 100.0 if r.shard == 0 else 300.0, 0.5 if r.shard == 0 else 2.0,
                                 50, 0.5))
    _, batch = client.receive(parts[0])
    assert batch is None
    _, batch = client.receive(parts[1])
    assert batch is not None and len(batch.keys) == 1000 and batch.table_size == 100
    probs = batch.probabilities.numpy()
    # P(i) = w_i / M with w_i = q_i * M_s: 1.0 / 400 on shard 0 and 3.0 / 400 on shard 1.
    np.testing.assert_allclose(probs[: counts[0]], 1.0 / 400)
    np.testing.assert_allclose(probs[counts[0]:], 3.0 / 400)
    # IS weights (w_i / min_j w_j)^-beta with the global min 0.5.
    np.testing.assert_allclose(batch.weights.numpy()[: counts[0]], (1.0 / 0.5) ** -0.5, rtol=1e-6)
    np.testing.assert_allclose(batch.weights.numpy()[counts[0]:], (3.0 / 0.5) ** -0.5, rtol=1e-6)
    assert batch.data["x"].shape == (1000,)


def _part(r, q, mass, min_mass, size=50):
    return ShardSample(r.shard, 0, r.request, "", {"x": np.arange(r.n)}, make_keys(r.shard, np.arange(r.n)),
                       np.full(r.n, q), np.ones(r.n, np.int64), mass, min_mass, size, 0.5)


def test_client_samples_in_one_round_from_the_masses_of_the_last_replies():
    """After the first sample, counts come from the masses the shards last reported; each item's
    probability is the one it was drawn with, (C_s / C) * q_i, even when the masses moved since."""
    client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None)
    first = client.request(100)
    assert [type(r) for r in first] == [MassRequest, MassRequest]  # nothing cached yet
    client.receive(_mass(0, first[0].request, 100.0, 50, min_mass=0.5))
    out, _ = client.receive(_mass(1, first[1].request, 300.0, 50, min_mass=2.0))
    for r in out:
        _, batch = client.receive(_part(r, 0.01, 100.0 if r.shard == 0 else 300.0, 0.5 if r.shard == 0 else 2.0))
    assert batch is not None
    # Second sample: one round, counts ~ Multinomial(1000, [0.25, 0.75]) from the cached masses.
    reqs = client.request(1000)
    assert [type(r) for r in reqs] == [SampleRequest, SampleRequest]
    counts = {r.shard: r.n for r in reqs}
    assert sum(counts.values()) == 1000 and 180 < counts[0] < 320
    # Shard 0's mass doubled meanwhile (priority updates): its items were still drawn with share 0.25.
    by = {r.shard: r for r in reqs}
    assert client.receive(_part(by[0], 0.01, 200.0, 0.5))[1] is None
    _, batch = client.receive(_part(by[1], 0.02, 300.0, 2.0, size=60))
    assert batch is not None and len(batch.keys) == 1000 and batch.table_size == 110
    probs = batch.probabilities.numpy()
    np.testing.assert_allclose(probs[: counts[0]], 0.25 * 0.01)
    np.testing.assert_allclose(probs[counts[0]:], 0.75 * 0.02)
    # Weights against the least likely item anywhere: min(0.25 * 0.5 / 200, 0.75 * 2.0 / 300).
    min_p = min(0.25 * 0.5 / 200, 0.75 * 2.0 / 300)
    np.testing.assert_allclose(batch.weights.numpy()[: counts[0]], (0.25 * 0.01 / min_p) ** -0.5, rtol=1e-6)
    np.testing.assert_allclose(batch.weights.numpy()[counts[0]:], (0.75 * 0.02 / min_p) ** -0.5, rtol=1e-6)
    # Third sample: the reported masses are now 200 / 300, so the share of shard 0 is 0.4.
    reqs = client.request(1)
    assert [type(r) for r in reqs] == [SampleRequest, SampleRequest] and sum(r.n for r in reqs) == 1
    empty = next(r for r in reqs if r.n == 0)  # the shard that drew nothing still answers (figures)
    full = next(r for r in reqs if r.n == 1)
    assert client.receive(_mass(empty.shard, empty.request, 999.0, 7))[1] is None
    _, batch = client.receive(_part(full, 0.5, 200.0 if full.shard == 0 else 300.0, 1.0))
    assert batch is not None and len(batch.keys) == 1
    share = 0.4 if full.shard == 0 else 0.6
    np.testing.assert_allclose(batch.probabilities.numpy(), share * 0.5)


def test_fresh_masses_ask_every_sample_first_and_bad_modes_are_refused():
    client = ReplayClient(2, timeout_s=None, masses="fresh")
    reqs = client.request(4)
    client.receive(_mass(0, reqs[0].request, 1.0, 5))
    out, _ = client.receive(_mass(1, reqs[1].request, 1.0, 5))
    for r in out:
        client.receive(_part(r, 0.2, 1.0, 1.0))
    assert [type(r) for r in client.request(4)] == [MassRequest, MassRequest]
    with pytest.raises(ValueError, match=r"^ReplayClient masses must be 'cached' or 'fresh', got 'stale'$"):
        ReplayClient(2, masses="stale")


def test_remote_reads_settings_reach_the_requests_and_bad_ones_are_refused():
    from reactor.transport.bulk import capabilities

    def asked(**kw):  # one shard: the first request is already a SampleRequest
        (req,) = ReplayClient(1, timeout_s=None, **kw).request(4)
        return req.remote

    assert asked(remote_reads="zmq") == "zmq" and asked() == ""  # default "off": data in the replies
    # auto (the Learner's): RDMA only where a device works (never here, so the replies carry the data)
    assert asked(remote_reads="auto") == ("rdma" if capabilities().rdma else "")
    with pytest.raises(ValueError, match=r"^ReplayClient remote_reads must be one of \['auto', 'zmq', 'off'\], got 'ib'$"):
        ReplayClient(2, remote_reads="ib")
    with pytest.raises(ValueError, match=r"^Replay remote_reads must be one of .* got 'rdma'$"):
        Replay([("id", (), "int64")], 8, remote_reads="rdma")
    client = ReplayClient(2, timeout_s=None, remote_reads="zmq")
    reqs = client.request(4)
    with pytest.raises(RuntimeError, match=r"await client.areceive\(reply\)"):
        client.receive(_mass(0, reqs[0].request, 1.0, 5))
    assert client.in_flight == 1  # refused before touching the sample


def test_a_one_round_sample_whose_shard_is_lost_starts_again_over_the_live_shards():
    now = [0.0]
    client = ReplayClient(3, timeout_s=5.0, skip_lost_shards=True, clock=lambda: now[0], rng=np.random.default_rng(3))
    out = []
    for r in client.request(30):
        out += client.receive(_mass(r.shard, r.request, 1.0, 10))[0]
    for r in out:  # the first sample's stage 2
        client.receive(_part(r, 0.1, 1.0, 1.0, size=10))
    reqs = client.request(30)  # one round from the cached masses
    assert sorted((r.shard, type(r)) for r in reqs) == [(k, SampleRequest) for k in range(3)]
    client.receive(_part(next(r for r in reqs if r.shard == 0), 0.1, 1.0, 1.0, size=10))
    now[0] = 10.0  # shards 1 and 2 never answer: lost; the sample starts again from shard 0 alone
    again = client.check_timeouts()
    assert client.lost.keys() == {1, 2}
    assert [(r.shard, type(r), r.n) for r in again] == [(0, SampleRequest, 30)]
    _, batch = client.receive(_part(again[0], 0.1, 1.0, 1.0, size=10))
    assert batch is not None and len(batch.keys) == 30 and set(key_shard(batch.keys).tolist()) == {0}
    np.testing.assert_allclose(batch.probabilities.numpy(), 0.1)  # shard 0 is now the whole table
    assert batch.table_size == 10


def test_a_shard_without_mass_for_its_count_makes_the_sample_start_again_from_the_others():
    client = ReplayClient(2, rng=np.random.default_rng(5), timeout_s=None)
    out = []
    for r in client.request(10):
        out += client.receive(_mass(r.shard, r.request, 1.0, 5))[0]
    for r in out:
        client.receive(_part(r, 0.2, 1.0, 1.0, size=5))
    reqs = client.request(50)  # one round: both shards asked for items
    by = {r.shard: r for r in reqs}
    assert by[0].n > 0 and by[1].n > 0
    assert client.receive(_mass(0, by[0].request, 0.0, 5, min_mass=float("inf")))[1] is None  # all 0 by now
    again, batch = client.receive(_part(by[1], 0.2, 1.0, 1.0, size=5))
    assert batch is None and {(r.shard, r.n) for r in again} == {(0, 0), (1, 50)}  # shard 0's share is 0 now
    by = {r.shard: r for r in again}
    client.receive(_mass(0, by[0].request, 0.0, 5, min_mass=float("inf")))
    _, batch = client.receive(_part(by[1], 0.2, 1.0, 1.0, size=5))
    assert batch is not None and set(key_shard(batch.keys).tolist()) == {1}
    np.testing.assert_allclose(batch.probabilities.numpy(), 0.2)
    assert batch.table_size == 10


def test_sampling_shards_whose_priorities_are_all_zero_is_a_clear_error(tmp_path):
    """Real shards: after the first batch every item's priority is 0; the next sample fails with a
    message saying so (a single table raises too), instead of a shard crashing or a loop."""
    with pytest.raises(Exception, match=r"holds only zero priorities: nothing can be sampled"):
        _run({"source": "items", "items": 8, "shards": 2, "actors": 1, "min_size": 4, "batches": 3,
              "batch_size": 200, "update": "zero", "out": str(tmp_path / "x.npz")})


def test_client_routes_priority_updates_by_key_shard():
    client = ReplayClient(3, timeout_s=None)
    keys = np.concatenate([make_keys(2, [7, 8]), make_keys(0, [1]), make_keys(2, [9])])
    msgs = client.update_priorities(keys, np.array([1.0, 2.0, 3.0, 4.0]))
    assert [type(m) for m in msgs] == [PriorityUpdate, PriorityUpdate]
    by = {m.shard: (key_local(m.keys).tolist(), m.priorities.tolist()) for m in msgs}
    assert by == {0: ([1], [3.0]), 2: ([7, 8, 9], [1.0, 2.0, 4.0])}
    with pytest.raises(ValueError, match=r"^a key names shard 5, outside \[0, 3\): not a key this client sampled$"):
        client.update_priorities(make_keys(5, [1]), [1.0])


def test_a_nan_or_negative_new_priority_is_left_out_and_said_not_sent_to_spoil_its_shards_update(caplog):
    """A NaN priority (a loss gone NaN) went to its shard, which refused the whole update for it: every
    other item of that update kept its old priority, said only in the shard's log (session 55)."""
    import logging

    client = ReplayClient(2, timeout_s=None)
    keys = np.concatenate([make_keys(0, [1, 2]), make_keys(1, [3, 4])])
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        msgs = client.update_priorities(keys, np.array([1.0, np.nan, -1.0, 4.0]))
    by = {m.shard: (key_local(m.keys).tolist(), m.priorities.tolist()) for m in msgs}
    assert by == {0: ([1], [1.0]), 1: ([4], [4.0])}
    assert any("2 of 4 new priorities are not finite and >= 0 (nan first" in m for m in caplog.messages), caplog.messages


def test_client_raises_peer_lost_when_a_shard_does_not_answer_in_time():
    now = [0.0]
    client = ReplayClient(2, timeout_s=5.0, clock=lambda: now[0])
    reqs = client.request(8)
    client.receive(_mass(0, reqs[0].request, 1.0, 1))
    now[0] = 4.0
    assert client.check_timeouts() == []
    now[0] = 6.0
    with pytest.raises(PeerLostError, match=r"^replay shard 1 did not answer request 2 within 5.0s"):
        client.check_timeouts()


def test_client_skipping_lost_shards_redraws_their_share_from_the_live_ones():
    now = [0.0]
    client = ReplayClient(3, timeout_s=5.0, skip_lost_shards=True, clock=lambda: now[0], rng=np.random.default_rng(1))
    reqs = client.request(100)
    client.receive(_mass(0, reqs[0].request, 1.0, 10))
    out, _ = client.receive(_mass(1, reqs[1].request, 1.0, 10))
    assert out == []  # shard 2 has not answered stage 1
    now[0] = 10.0
    out = client.check_timeouts()
    assert client.lost.keys() == {2} and client.live_shards == [0, 1]
    assert {r.shard for r in out} == {0, 1} and sum(r.n for r in out) == 100
    # Stage 2: shard 1 dies too; its items are redrawn from shard 0.
    by = {r.shard: r for r in out}
    now[0] = 11.0
    r0 = by[0]
    client.receive(ShardSample(0, 0, r0.request, "", {"x": np.zeros(r0.n)}, make_keys(0, np.arange(r0.n)),
                               np.full(r0.n, 0.1), np.ones(r0.n, np.int64), 1.0, 1.0, 10, 0.0))
    now[0] = 20.0
    out = client.check_timeouts()
    assert [(r.shard, r.n) for r in out] == [(0, by[1].n)]
    _, batch = client.receive(ShardSample(0, 0, out[0].request, "", {"x": np.zeros(out[0].n)},
                                          make_keys(0, np.arange(out[0].n)), np.full(out[0].n, 0.1),
                                          np.ones(out[0].n, np.int64), 1.0, 1.0, 10, 0.0))
    assert batch is not None and len(batch.keys) == 100 and set(key_shard(batch.keys).tolist()) == {0}


def test_an_exhausted_answer_drops_every_sample_in_flight_and_says_no_sample_can_come():
    client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None)
    first, second = client.request(8), client.request(8)
    assert client.in_flight == 2 and not client.exhausted
    client.receive(_mass(1, first[1].request, 1.0, 10))  # one part of the first sample is in
    out, batch = client.receive(Exhausted(0, 0, second[0].request))
    assert (out, batch) == ([], None)
    assert client.exhausted and client.in_flight == 0  # both samples dropped, not only the one answered
    assert client.receive(_mass(0, first[0].request, 1.0, 10)) == ([], None)  # a late part: ignored
    assert client.receive(_mass(1, second[1].request, 1.0, 10)) == ([], None)


def test_replies_the_client_could_not_have_asked_for_are_dropped_and_logged(caplog):
    """A reply's request and shard must be plain ints (an unhashable one crashed the learner's
    reaction), and an answer, Exhausted above all, must come from the shard that was asked."""
    client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None)
    reqs = client.request(8)
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        assert client.receive(Exhausted(0, 0, [reqs[0].request])) == ([], None)
        assert client.receive(Exhausted(True, 0, reqs[0].request)) == ([], None)
        assert client.receive(Exhausted(1, 0, reqs[0].request)) == ([], None)  # shard 0 was asked
    assert not client.exhausted and client.in_flight == 1
    msgs = [r.getMessage() for r in caplog.records]
    assert any("dropped a Exhausted whose request and shard are not ints" in m for m in msgs)
    assert any(f"dropped a Exhausted for request {reqs[0].request} from shard 1; shard 0 was asked" in m
               for m in msgs)
    client.receive(_mass(0, reqs[0].request, 1.0, 10))  # the real answers still count
    out, _ = client.receive(_mass(1, reqs[1].request, 1.0, 10))
    assert out and sum(r.n for r in out) == 8


def test_a_shard_drops_a_request_it_could_not_answer_or_route(caplog):
    """A request whose requester or id is not an int cannot be routed back (requester_key) nor
    matched: the shard drops and logs it before anything else (it used to answer, and the answer's
    routing raised and ended the shard's process)."""
    import types

    shard = types.SimpleNamespace(name="replay[0]")  # the check comes before the shard's table is touched
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        Replay.serve_request(shard, MassRequest(0, [0], 1))
        Replay.serve_request(shard, SampleRequest(0, 0, {"a": 1}, 4))
    msgs = [r.getMessage() for r in caplog.records]
    assert "replay[0] dropped a MassRequest whose requester and request are not ints: ([0], 1)" in msgs
    assert "replay[0] dropped a SampleRequest whose requester and request are not ints: (0, {'a': 1})" in msgs


def test_a_refused_request_raises_with_the_shards_reason():
    client = ReplayClient(1, timeout_s=None)
    (req,) = client.request(4)
    with pytest.raises(RuntimeError, match=r"^replay shard 0 refused a request: replay\[0\]: boom$"):
        client.receive(ShardSample(0, 0, req.request, "replay[0]: boom"))
    assert client.in_flight == 0


def _four(r, **change):
    """A good 4-item ShardSample answering ``r`` (data in the reply), with ``change`` made to it."""
    good = ShardSample(r.shard, 0, r.request, "", {"x": np.arange(4)}, make_keys(r.shard, np.arange(4)),
                       np.full(4, 0.25), np.ones(4, np.int64), 4.0, 1.0, 4, 0.5)
    return dataclasses.replace(good, **change)


@pytest.mark.parametrize(("change", "why"), [
    ({"probabilities": "abc"}, "its probabilities are not a 1-D float64 array of length 4 (got str)"),
    ({"data": {"x": [[1, 2], [3]]}}, "its field 'x' is not a numeric array of length 4 (got list)"),
    ({"data": {"x": np.array(["1.5"] * 4)}}, "its field 'x' is not a numeric array of length 4 (got <U3 (4,))"),
    ({"keys": make_keys(0, np.arange(4))[:1]}, "its probabilities are not a 1-D float64 array of length 1 (got float64 (4,))"),
    ({"keys": make_keys(0, np.arange(1)), "probabilities": np.full(1, 0.25), "times_sampled": np.ones(1, np.int64)},
     "its field 'x' is not a numeric array of length 1 (got int64 (4,))"),
    ({"probabilities": np.full(2, 0.25)}, "its probabilities are not a 1-D float64 array of length 4 (got float64 (2,))"),
    ({"keys": make_keys(0, np.arange(5))}, "it sent 5 items for a request of 4"),
    ({"keys": make_keys(1, np.arange(4))}, "a key is not tagged with shard 0"),
    ({"mass": float("inf")}, "its mass inf is not a finite number > 0 (it drew items)"),
    ({"mass": 0.0}, "its mass 0.0 is not a finite number > 0 (it drew items)"),
    ({"min_mass": float("nan")}, "its min_mass nan is not a number > 0"),
    ({"size": -1}, "its size -1 is not an int >= 0"),
    ({"beta": float("nan")}, "its beta nan is not a finite number >= 0"),
    ({"probabilities": np.full(4, -0.25)}, "probability -0.25 is not in (0, 1]"),
    ({"probabilities": np.full(4, np.nan)}, "probability nan is not in (0, 1]"),
    ({"times_sampled": np.full(4, -1)}, "a times sampled is negative"),
    ({"data": None}, "it sent neither data nor a plan of rows (data: NoneType)"),
    ({"data": {}}, "it sent neither data nor a plan of rows (data: dict)"),
    ({"error": 7}, "its error 7 is not a str"),
    ({"descriptor": "elsewhere"}, "its descriptor is a str, not a dict"),
])
def test_a_malformed_sample_reply_is_dropped_and_logged_and_its_sample_drawn_again(change, why, caplog):
    """Regression (hostile probe): a shard's malformed ShardSample raised into the learner (ValueError,
    a MemoryError) or made a batch whose keys, weights and data disagree, or with NaN weights. Every
    reply is checked where it enters the client: a bad one is dropped, logged naming what was wrong,
    counted, and its sample asked for again; the good answer to that makes the batch."""
    client = ReplayClient(1, timeout_s=None)
    (req,) = client.request(4)
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        again, batch = client.receive(_four(req, **change))
    assert batch is None and [(type(r), r.shard, r.n) for r in again] == [(SampleRequest, 0, 4)]
    assert client.malformed_replies == 1 and client.in_flight == 1
    assert [r.getMessage() for r in caplog.records] == [
        f"replay client 0 dropped a malformed ShardSample from shard 0 (request {req.request}): {why}; the sample "
        f"is drawn again"]
    _, batch = client.receive(_four(again[0]))
    assert batch is not None and len(batch.keys) == len(batch.weights) == len(batch.data["x"]) == 4
    assert np.isfinite(batch.weights.numpy()).all() and client.in_flight == 0


def test_malformed_figures_drop_the_reply_and_a_flood_of_them_is_not_a_flood_of_lines(caplog):
    """A ShardMass with figures that would poison the counts (a NaN or negative mass, a negative size) is
    dropped and the sample starts again; past 20 drops from one shard, one in 1,000 is logged."""
    client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None)
    reqs = client.request(8)
    bad = [ShardMass(0, 0, 0, "", float("nan"), 1.0, 5, 0.5), ShardMass(0, 0, 0, "", -1.0, 1.0, 5, 0.5),
           ShardMass(0, 0, 0, "", 1.0, 0.0, 5, 0.5), ShardMass(0, 0, 0, "", 1.0, 1.0, 2.5, 0.5)]
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        for i in range(25):
            by = {r.shard: r for r in reqs}
            reqs, batch = client.receive(dataclasses.replace(bad[i % 4], request=by[0].request))
            assert batch is None and sorted((type(r), r.shard) for r in reqs) == [(MassRequest, 0), (MassRequest, 1)]
    msgs = [r.getMessage() for r in caplog.records]
    assert client.malformed_replies == 25 and len(msgs) == 20 and client.in_flight == 1
    assert msgs[0].endswith("from shard 0 (request 1): its mass nan is not a finite number >= 0; the sample is drawn again")
    assert msgs[1].endswith("its mass -1.0 is not a finite number >= 0; the sample is drawn again")
    assert msgs[2].endswith("its min_mass 0.0 is not a number > 0; the sample is drawn again")
    assert msgs[3].endswith("its size 2.5 is not an int >= 0; the sample is drawn again")
    out = client.receive(_mass(0, reqs[0].request, 1.0, 5))[0] + client.receive(_mass(1, reqs[1].request, 1.0, 5))[0]
    assert sum(r.n for r in out) == 8


def test_whole_episodes_in_a_reply_are_no_malformed_reply():
    """EpisodeRead's data is every episode's steps one after another and their lengths [n]: the reply
    check took each such reply for malformed (a field not of the keys' length) and drew it again, for
    ever (the review, session 55). A field that is neither n nor the episodes' steps long still is."""
    client = ReplayClient(1, timeout_s=None)
    (req,) = client.request(4)
    episodes = {"x": np.arange(10), "lengths": np.array([1, 2, 3, 4])}
    out, batch = client.receive(_four(req, data=episodes))
    assert out == [] and batch is not None and batch.data["x"].shape[0] == 10 and len(batch.keys) == 4
    (req,) = client.request(4)
    (again,), batch = client.receive(_four(req, data={**episodes, "x": np.arange(9)}))
    assert batch is None and client.malformed_replies == 1


def test_a_shard_whose_every_reply_is_malformed_is_taken_for_lost_not_asked_again_for_ever(monkeypatch):
    """Each malformed reply's sample was drawn again: a shard whose every reply was malformed kept the
    learner spinning with no batch, one log line in a thousand (the review, session 55). Past
    MALFORMED_IN_A_ROW in a row it is lost: PeerLostError, or without it under skip_lost_shards; a
    good reply between resets the count."""
    from reactor.nodes import replay_client

    monkeypatch.setattr(replay_client, "MALFORMED_IN_A_ROW", 5)
    bad = {"probabilities": np.full(4, np.nan)}
    for skip in (False, True):
        client = ReplayClient(1, timeout_s=None, skip_lost_shards=skip)
        (req,) = client.request(4)
        for _ in range(3):
            (req,), _ = client.receive(_four(req, **bad))
        out, batch = client.receive(_four(req))  # a good one: the count starts again
        assert out == [] and batch is not None and len(batch.keys) == 4
        (req,) = client.request(4)
        for _ in range(4):
            (req,), _ = client.receive(_four(req, **bad))
        with pytest.raises(PeerLostError, match=r"^replay shard 0 sent 5 malformed replies in a row \(the last: "
                                                r"probability nan is not in \(0, 1\]\): it is taken for lost$"
                                                if not skip else r"lost"):
            client.receive(_four(req, **bad))
        assert (0 in client.lost) == skip  # (under skip_lost_shards: lost, and with it every shard here)


def test_a_malformed_plan_of_rows_is_dropped_and_the_batch_stays_within_what_was_asked(tmp_path, caplog):
    """Regression (hostile probe): a plan reply's window_length of 10**9 made the client allocate 29.8 GiB
    (MemoryError in the learner); rows outside the shard's region raised into it. A plan is checked
    against its shard's region: its rows inside it, its windows no longer than the region and than
    the shard's first plan (what a batch is allocated from), its arrays of the expected shapes."""
    import asyncio
    import os

    import torch

    from reactor.replay import FieldSpec, Storage
    from reactor.transport.bulk import BulkOwner, capabilities, seqlock_end

    if not capabilities().shm:
        pytest.skip("needs shared memory (a shard's region on this host)")

    async def main():
        owner = await BulkOwner.open(f"malformed{os.getpid()}", backends=["shm"])
        client = ReplayClient(1, timeout_s=None)
        try:
            st = Storage([FieldSpec("id", (), torch.int64)], 16, allocator=owner.allocator("r"))
            st.append({"id": torch.arange(4) + 100}, episode_end=np.arange(4) == 3)
            seqlock_end(owner.allocate_versions("r"), np.arange(4), np.arange(4))  # (rows 0..3 hold steps 0..3)
            desc = owner.descriptor("r")

            def plan(r, windows=((0, 0, 4),) * 4, length=4, **kw):
                return _four(r, data=None, windows=np.array(windows, dtype=np.int64), window_length=length, **kw)

            (req,) = client.request(4)
            bad = [
                (plan(req, descriptor=None), "it sent a plan of rows, but no region of its was attached (no "
                                             "descriptor came)"),
                (plan(req, length=10**9, descriptor=desc), "its window_length 1000000000 is not an int in [1, 16] "
                                                           "(its region's rows)"),
                (plan(req, windows=((0, 0, 5),) * 4), "a window span is not 0 <= lo < hi <= 4"),
                (plan(req, windows=((0, 0, 4),) * 3), "its window spans are not an int64 [4, 3] array (got int64 "
                                                      "(3, 3))"),
                (_four(req, data=None, rows=np.array([0, 1, 2, 16]), versions=np.arange(4)),
                 "a row is outside its region's [0, 16)"),
                (_four(req, data=None, rows=np.arange(4), versions=None),
                 "its versions are not an int64 array shaped like its rows (4,) (got NoneType)"),
                (_four(req, rows=np.arange(4), versions=np.arange(4)), "it sent both data and a plan of rows"),
            ]
            with caplog.at_level(logging.ERROR, logger="reactor.replay"):
                for reply, why in bad:
                    (req,), batch = await client.areceive(dataclasses.replace(reply, request=req.request))
                    assert batch is None and req.n == 4
                    assert caplog.records[-1].getMessage().endswith(f": {why}; the sample is drawn again")
                # A good plan: the shard's windows are 4 long; a later plan's 8 are refused.
                _, batch = await client.areceive(plan(req))
                assert batch is not None and batch.data["id"].tolist() == [[100, 101, 102, 103]] * 4
                (req,) = client.request(4)
                (req,), batch = await client.areceive(plan(req, windows=((0, 0, 8),) * 4, length=8))
                assert batch is None and caplog.records[-1].getMessage().endswith(
                    ": its windows of 8 rows are not the 4 of its earlier plans; the sample is drawn again")
            assert client.malformed_replies == len(bad) + 1
        finally:
            client.close()
            await owner.aclose()

    asyncio.run(main())


@pytest.mark.parametrize(("kw", "why"), [
    ({"keep_checkpoints": 0}, "Replay keep_checkpoints must be an int >= 1 (complete checkpoints kept), got 0"),
    ({"keep_checkpoints": "3"}, "Replay keep_checkpoints must be an int >= 1 (complete checkpoints kept), got '3'"),
    ({"max_size": 32}, "Replay max_size must be None (the capacity) or an int in [1, capacity=16], got 32"),
    ({"max_size": 0}, "Replay max_size must be None (the capacity) or an int in [1, capacity=16], got 0"),
    ({"max_times_sampled": -1}, "Replay max_times_sampled must be an int >= 0 (0: never), got -1"),
    ({"beta": float("nan")}, "Replay beta must be a finite number >= 0, got nan"),
    ({"beta": "0.4"}, "Replay beta must be a finite number >= 0, got '0.4'"),
    ({"restore": "no"}, "Replay restore must be True or False, got 'no'"),
    ({"checkpoint_on_shutdown": "yes"}, "Replay checkpoint_on_shutdown must be True or False, got 'yes'"),
    ({"checkpoint_period_s": 0}, "Replay checkpoint_period_s must be a number > 0 or None, got 0"),
    ({"async_checkpoint_period_s": float("inf"), "run_dir": "/tmp"},
     "Replay async_checkpoint_period_s must be a number > 0 or None, got inf"),
    ({"async_checkpoint_period_s": True, "run_dir": "/tmp"},
     "Replay async_checkpoint_period_s must be a number > 0 or None, got True"),
    ({"async_checkpoint_period_s": 30.0}, "Replay async_checkpoint_period_s needs run_dir (where checkpoints go)"),
    ({"rate_limiter": {"type": "MinSize", "min_size": 100}},
     "Replay rate_limiter {'type': 'MinSize', 'min_size': 100} waits for 100 items before a sample, more than the 16 "
     "this shard holds (max_size, at most the capacity); lower its min_size or raise the capacity"),
    ({"rate_limiter": {"type": "MinSize", "min_size": 10}, "max_size": 8},
     "Replay rate_limiter {'type': 'MinSize', 'min_size': 10} waits for 10 items before a sample, more than the 8 "
     "this shard holds (max_size, at most the capacity); lower its min_size or raise the capacity"),
    ({"rate_limiter": {"type": "MinSize", "min_size": 0}},
     "Replay rate_limiter {'type': 'MinSize', 'min_size': 0}: min_size_to_sample must be an int >= 1, got 0"),
])
def test_a_bad_setting_is_refused_when_the_shard_is_built_naming_it(kw, why):
    """Regression (hostile probe): these passed the constructor, whose docstring promises errors when the
    graph is built, and failed at run time or in silence: keep_checkpoints=0 logged "keep must be >= 1" at
    every checkpoint and none was ever written (the run still ended "quiescence"); restore="no" restored;
    a MinSize above what the shard can hold parked every sample for good."""
    with pytest.raises(ValueError, match=rf"^{re.escape(why)}$"):
        Replay([("id", (), "int64")], 16, **kw)
    # The edges are taken.
    Replay([("id", (), "int64")], 16, keep_checkpoints=1, max_size=16, max_times_sampled=0, beta=0,
           restore=False, rate_limiter={"type": "MinSize", "min_size": 16})


def test_memory_placement_is_checked_at_build_and_gpu_memory_without_cuda_fails_at_start_naming_it():
    import torch

    from reactor import Graph

    with pytest.raises(ValueError, match=r"^Replay memory must be 'host', 'pinned', 'cuda' or 'cuda:N', got 'gpu'$"):
        Replay([("id", (), "int64")], 8, memory="gpu")
    with pytest.raises(ValueError, match=r"bulk=True needs host memory .* got memory='cuda:1'"):
        Replay([("id", (), "int64")], 8, memory="cuda:1", bulk=True)
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the no-CUDA error cannot happen here")
    for memory in ("pinned", "cuda"):
        g = Graph()
        g.add(Replay([("id", (), "int64")], 8, memory=memory), name="replay")
        with pytest.raises(ValueError, match=rf"Replay 'replay': memory='{memory}' needs CUDA, and "
                                               r"torch.cuda.is_available\(\) is False on this host; use memory='host' "
                                               r"\(the apps' --set replay_memory=host, or leave it out\)$"):
            run(g)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (shard memory on a GPU, pinned)")
def test_shards_in_gpu_or_pinned_memory_sample_exactly_what_host_memory_shards_do(tmp_path):
    cfg = {"source": "gym", "read": "transition", "shards": 2, "actors": 2, "min_size": 40, "batches": 6,
           "update": "random"}
    outs = {}
    for memory in ("host", "pinned", "cuda"):
        out = tmp_path / f"{memory}.npz"
        _run({**cfg, "memory": memory, "out": str(out)}, stop_s=0.2)
        outs[memory] = _npz(out)
    for memory in ("pinned", "cuda"):
        # the same draws; the same bytes from pinned memory (a GPU's n-step sums may round differently)
        for name in ("keys", "probs", "weights") + (("digest",) if memory == "pinned" else ()):
            np.testing.assert_array_equal(outs["host"][name], outs[memory][name], err_msg=f"{memory} {name}")


def _windows_part(r, descriptor):
    """A shard's plan reply (three numbers a window) with the given region descriptor."""
    spans = np.tile(np.array([[0, 0, 4]], dtype=np.int64), (r.n, 1))
    return ShardSample(r.shard, 0, r.request, "", None, make_keys(r.shard, np.arange(r.n)), np.full(r.n, 0.01),
                       np.ones(r.n, np.int64), 1.0, 1.0, 50, 0.5, windows=spans, window_length=4,
                       descriptor=descriptor)


class _LyingReadServer:
    """A read server of another host (a real pyzmq ROUTER on tcp, in a thread) that answers ``mode``'s lie."""

    def __init__(self, mode):
        import threading

        import zmq

        from reactor.transport.codec import decode, encode

        self.mode, self.ctx = mode, zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.stop = threading.Event()

        def serve():
            poller = zmq.Poller()
            poller.register(self.sock, zmq.POLLIN)
            while not self.stop.is_set():
                if not poller.poll(50):
                    continue
                frames = self.sock.recv_multipart()
                req = decode(frames[1:], max_nbytes=1 << 24)
                if req.get("op") == "hello" and mode.startswith("read_"):
                    answer = encode({"id": req["id"], "ok": True, "rows": 1000, "fields": ["ver", "x"]})
                elif mode in ("hello_junk", "read_junk"):
                    answer = [b"\xc1 not msgpack"]
                elif mode == "read_short":  # one byte short of the rows asked
                    k = int(np.sum(req["lengths"]))
                    answer = encode({"id": req["id"], "ok": True, "data": [np.zeros(4 * k - 1, np.uint8)],
                                     "valid": np.ones(k, bool)})
                elif mode == "read_neither":  # neither a result nor an error, a 1 MB message
                    answer = encode({"id": req["id"], "ok": 1, "error": None, "message": "x" * 1_000_000})
                else:  # an error of the allow-list: a region the server does not have (or no longer)
                    answer = encode({"id": req["id"], "ok": False, "error": "KeyError", "message": "no region"})
                self.sock.send_multipart([frames[0], *answer])

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def descriptor(self, region):
        d = {"kind": "reactor.bulk.region", "version": 1, "run_id": "lying", "region": region, "rows": 1000,
             "generation": 1, "host": "elsewhere", "version_field": "ver",
             "fields": {"x": {"dtype": "float32", "shape": [], "row_nbytes": 4, "device": "cpu"},
                        "ver": {"dtype": "int64", "shape": [], "row_nbytes": 8, "device": "cpu"}},
             "zmq": {"address": f"tcp://127.0.0.1:{self.port}", "max_request_nbytes": 1 << 20,
                     "max_reply_nbytes": 1 << 20}}
        if self.mode == "desc_huge_limit":
            d["zmq"]["max_reply_nbytes"] = 2**63
        elif self.mode == "desc_negative_limit":
            d["zmq"]["max_reply_nbytes"] = -5
        elif self.mode == "desc_bad_address":
            d["zmq"]["address"] = "bogus://x"
        elif self.mode == "desc_bad_key":
            d["zmq"]["server_key"] = "\u00e9" * 40  # (40 characters, not Z85: zmq refuses it)
        return d

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.mark.parametrize("mode", ["hello_error", "hello_junk", "desc_huge_limit", "desc_negative_limit",
                                  "desc_bad_address", "desc_bad_key", "read_junk", "read_short", "read_neither"])
def test_a_read_server_of_another_host_that_lies_never_fails_the_learner(mode, caplog):
    """A hostile probe (session 75): a remote shard's read server that refused the attach, answered it
    with junk, or a descriptor with a size limit past int64, a negative one, an address or a key zmq
    refuses, raised KeyError, MalformedFrameError, OverflowError or ZMQError out of ``areceive``: the
    learner's reaction failed and the run with it. Now a region that cannot be attached makes that shard
    send data in its replies (the sample drawn again), and a read answered with junk, short rows or a
    reply that is neither result nor error drops the sample, which is drawn again, counted as malformed."""
    import asyncio

    server = _LyingReadServer(mode)

    async def main():
        client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None, bulk=False, remote_reads="zmq")
        try:
            first = client.request(100)
            await client.areceive(_mass(0, first[0].request, 1.0, 50))
            reqs, _ = await client.areceive(_mass(1, first[1].request, 1.0, 50))
            by = {r.shard: r for r in reqs}
            with caplog.at_level(logging.WARNING, logger="reactor.replay"):
                again, batch = await client.areceive(_windows_part(by[0], server.descriptor("r0")))
                if mode.startswith("read_"):  # attached: the reads happen once both parts are in
                    assert again == [] and batch is None
                    again, batch = await client.areceive(_windows_part(by[1], server.descriptor("r1")))
            assert batch is None
            if mode.startswith("read_"):
                assert client.malformed_replies == 1 and {r.shard for r in again} == {0, 1}
                assert any("the read of its region failed" in r.getMessage() for r in caplog.records)
                assert max(len(r.getMessage()) for r in caplog.records) < 2000
            else:
                assert {r.shard: r.remote for r in again} == {0: "", 1: "zmq"}  # shard 0 sends data from now on
                assert any("shard 0's region cannot be read over zmq from here" in r.getMessage()
                           for r in caplog.records)
        finally:
            client.close()

    try:
        asyncio.run(main())
    finally:
        server.close()


def test_a_failed_attach_drops_the_whole_sample_and_the_shard_falls_back_to_data(caplog):
    """A region that cannot be attached (a bad descriptor) never fails the learner: the sample is
    dropped whole (another shard's late part must not complete it with half the items) and drawn
    again, and that shard is asked for data in its replies from then on."""
    import asyncio

    from reactor.transport.bulk import host_id

    async def main():
        # Same host (shared memory).
        client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None)
        first = client.request(100)
        await client.areceive(_mass(0, first[0].request, 1.0, 50))
        reqs, _ = await client.areceive(_mass(1, first[1].request, 1.0, 50))
        by = {r.shard: r for r in reqs}
        with caplog.at_level(logging.WARNING, logger="reactor.replay"):
            again, batch = await client.areceive(_windows_part(by[0], {"kind": "junk", "host": host_id()}))
        assert batch is None and {r.shard: r.host for r in again} == {0: "", 1: client._host}
        assert any("shard 0's region cannot be read over shm from here: not a bulk region descriptor" in r.getMessage()
                   for r in caplog.records)
        assert await client.areceive(_part(by[1], 0.01, 1.0, 1.0)) == ([], None)  # ignored, no short batch
        parts = [await client.areceive(_part(r, 0.01, 1.0, 1.0)) for r in again]
        assert len(next(b for _, b in parts if b is not None).keys) == 100
        client.close()

        # Another host, one-sided reads asked for: the shard's region cannot be attached from here, so the
        # sample is drawn again and that shard sends data from now on; the batch is whole.
        client = ReplayClient(2, rng=np.random.default_rng(0), timeout_s=None, bulk=False, remote_reads="zmq")
        first = client.request(100)
        await client.areceive(_mass(0, first[0].request, 1.0, 50))
        reqs, _ = await client.areceive(_mass(1, first[1].request, 1.0, 50))
        assert {r.remote for r in reqs} == {"zmq"}
        by = {r.shard: r for r in reqs}
        again, batch = await client.areceive(_windows_part(by[0], {"kind": "junk", "host": "elsewhere"}))
        assert batch is None and {r.shard: r.remote for r in again} == {0: "", 1: "zmq"}
        assert await client.areceive(_part(by[1], 0.01, 1.0, 1.0)) == ([], None)  # the dropped sample's
        parts = [await client.areceive(_part(r, 0.01, 1.0, 1.0)) for r in again]
        batch = next(b for _, b in parts if b is not None)
        assert len(batch.keys) == 100
        client.close()

    asyncio.run(main())
