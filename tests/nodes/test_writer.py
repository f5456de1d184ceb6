"""Writer: streams cut into episodes and chunks, read back through a real Table, match the ground truth.

Each test drives N streams with random episode lengths (terminations and truncations), feeds every
flushed Steps message to a real Table with the read kind the pattern is for, samples every item
(Fifo, n = size), and compares each item with what the raw episode says it must be.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from reactor.nodes.writer import TransitionPattern, WindowPattern, Writer
from reactor.replay import FieldSpec, Fifo, MinSize, Storage, Table, TransitionRead, WindowRead

FIELDS = [
    FieldSpec("id", (), torch.int64),
    FieldSpec("obs", (3,), torch.float32),
    FieldSpec("action", (), torch.int64),
    FieldSpec("reward", (), torch.float32),
    FieldSpec("terminated", (), torch.bool),
]


def _drive(writer: Writer, n_streams: int, steps: int, seed: int, p_end: float = 0.08):
    """Step N fake streams; return (messages, episodes). Every episode is closed at the end."""
    rng = np.random.default_rng(seed)
    t = np.zeros(n_streams, dtype=np.int64)
    eps = [[] for _ in range(n_streams)]  # current episode rows per stream
    episodes = []  # (rows list of (id, obs, action, reward), final_obs, terminated)
    msgs = []
    for k in range(steps):
        ids = np.arange(n_streams) * 1_000_000 + k + 1
        obs = rng.normal(size=(n_streams, 3)).astype(np.float32)
        act = rng.integers(0, 5, size=n_streams)
        rew = rng.normal(size=n_streams).astype(np.float32)
        last = k == steps - 1
        term = (rng.random(n_streams) < p_end) & ~last
        trunc = (rng.random(n_streams) < p_end / 2) & ~term
        if last:
            trunc[:] = True
        final = rng.normal(size=(n_streams, 3)).astype(np.float32)
        msgs += writer.append({"id": ids, "obs": obs, "action": act, "reward": rew},
                              terminated=term, truncated=trunc, final={"obs": final})
        for i in range(n_streams):
            eps[i].append((int(ids[i]), obs[i], int(act[i]), float(rew[i])))
            if term[i] or trunc[i]:
                episodes.append((eps[i], final[i], bool(term[i])))
                eps[i] = []
        t += 1
    msgs += writer.flush()
    return msgs, episodes


def _table(read, capacity=100_000) -> Table:
    return Table(Storage(FIELDS, capacity), sampler=Fifo(), remover=Fifo(), rate_limiter=MinSize(1), read=read)


def _insert_all(table: Table, msgs) -> None:
    for m in msgs:
        assert bool(m.episode_end[-1])
        table.insert_nowait(m.fields, m.priorities, episode_end=m.episode_end, item_mask=m.item_mask)


@pytest.mark.parametrize("n,chunk", [(1, 4), (3, 5), (3, 1000), (1, 1)])
def test_transition_items_match_the_episodes_across_chunks_truncations_and_terminals(n, chunk):
    gamma = 0.9
    w = Writer(FIELDS, num_streams=4, pattern=TransitionPattern(n=n, chunk_length=chunk), flush_steps=64)
    msgs, episodes = _drive(w, 4, 300, seed=n * 7 + chunk)
    table = _table(TransitionRead(n, gamma, next_fields=("obs", "terminated")))
    _insert_all(table, msgs)
    expected = {}
    for rows, final, terminated in episodes:
        L = len(rows)
        for t, (rid, obs, act, _) in enumerate(rows):
            m = min(n, L - t)
            ret = sum(gamma**j * rows[t + j][3] for j in range(m))
            nxt = final if t + m == L else rows[t + m][1]
            expected[rid] = (obs, act, ret, gamma**m, nxt, terminated and t + m == L)
    assert len(table) == len(expected)  # every step is an item exactly once
    batch, _ = table.sample_nowait(len(table))
    got_ids = batch["id"].numpy()
    assert sorted(got_ids) == sorted(expected)
    for j, rid in enumerate(got_ids):
        obs, act, ret, disc, nxt, nterm = expected[int(rid)]
        np.testing.assert_array_equal(batch["obs"][j].numpy(), obs)
        assert int(batch["action"][j]) == act
        assert float(batch["reward"][j]) == pytest.approx(ret, rel=1e-5, abs=1e-5)
        assert float(batch["discount"][j]) == pytest.approx(disc, rel=1e-6)
        np.testing.assert_array_equal(batch["next_obs"][j].numpy(), nxt)
        assert bool(batch["next_terminated"][j]) == nterm
        assert bool(batch["valid"][j])


@pytest.mark.parametrize("pad", ["tail", "head"])
@pytest.mark.parametrize("T,chunk", [(4, 3), (6, 20), (1, 2)])
def test_window_items_match_the_episodes(pad, T, chunk):
    w = Writer(FIELDS, num_streams=3, pattern=WindowPattern(T, pad=pad, chunk_length=chunk), flush_steps=50)
    msgs, episodes = _drive(w, 3, 200, seed=T * 11 + chunk)
    table = _table(WindowRead(T, pad))
    _insert_all(table, msgs)
    expected = {}
    for rows, final, _ in episodes:
        # The stored episode: its steps, then the final-observation row (other fields zero).
        ids = [r[0] for r in rows] + [0]
        obs = [r[1] for r in rows] + [final]
        L = len(ids)
        for t in range(L - 1):
            pos = range(t, t + T) if pad == "tail" else range(t - T + 1, t + 1)
            mask = [0 <= p < L for p in pos]
            wid = [ids[p] if ok else 0 for p, ok in zip(pos, mask)]
            wobs = np.stack([obs[p] if ok else np.zeros(3, np.float32) for p, ok in zip(pos, mask)])
            expected[ids[t]] = (wid, wobs, mask)
    assert len(table) == len(expected)
    batch, _ = table.sample_nowait(len(table))
    anchor = 0 if pad == "tail" else T - 1
    got = batch["id"][:, anchor].numpy()
    assert sorted(got) == sorted(expected)
    for j, rid in enumerate(got):
        wid, wobs, mask = expected[int(rid)]
        assert batch["id"][j].tolist() == wid
        np.testing.assert_array_equal(batch["obs"][j].numpy(), wobs)
        assert batch["mask"][j].tolist() == mask


def test_one_message_per_flush_and_round_robin_over_shards():
    w = Writer(FIELDS, num_streams=8, pattern=TransitionPattern(n=1, chunk_length=16), num_shards=3,
               writer_id=4, flush_steps=100)
    msgs, _ = _drive(w, 8, 400, seed=1)
    assert len(msgs) == w.seq
    assert all(m.writer == 4 for m in msgs)
    assert [m.shard for m in msgs] == [(1 + k) % 3 for k in range(len(msgs))]
    sizes = [len(m.episode_end) for m in msgs[:-1]]
    assert min(sizes) >= 100  # a flush carries at least flush_steps rows (the last may be smaller)
    assert len(msgs) < 400 * 8 / 100 + 2  # never one message per step
    assert w.steps_sent == sum(len(m.episode_end) for m in msgs)


def test_fixed_shard_and_inactive_streams_are_not_stored():
    w = Writer(FIELDS, num_streams=2, pattern=TransitionPattern(), num_shards=4, shard=2, flush_steps=1)
    step = {"id": np.array([1, 2]), "obs": np.zeros((2, 3)), "action": np.zeros(2, np.int64), "reward": np.ones(2)}
    no = np.zeros(2, bool)
    w.append(step, terminated=no, truncated=no)
    w.append({**step, "id": np.array([3, 4])}, terminated=no, truncated=no, active=np.array([True, False]))
    msgs = w.append({**step, "id": np.array([5, 6])}, terminated=np.array([True, True]), truncated=no,
                    final={"obs": np.ones((2, 3))})
    assert [m.shard for m in msgs] == [2]
    ids = msgs[0].fields["id"].tolist()
    assert ids == [1, 3, 5, 0, 2, 6, 0]  # stream 1 skipped its inactive step; final rows hold id 0
    assert msgs[0].fields["terminated"].tolist() == [False, False, False, True, False, False, True]
    assert msgs[0].item_mask.tolist() == [True, True, True, False, True, True, False]


def test_bad_steps_raise_clear_errors_and_append_nothing():
    w = Writer(FIELDS, num_streams=2, pattern=TransitionPattern())
    no = np.zeros(2, bool)
    good = {"id": np.array([1, 2]), "obs": np.zeros((2, 3)), "action": np.zeros(2, np.int64), "reward": np.ones(2)}
    with pytest.raises(ValueError, match=r"^Writer\.append: missing field\(s\) \['reward'\]; every step needs "
                                         r"\['id', 'obs', 'action', 'reward'\]$"):
        w.append({k: v for k, v in good.items() if k != "reward"}, terminated=no, truncated=no)
    with pytest.raises(ValueError, match=r"^Writer\.append: unknown field\(s\) \['rew'\]; the table's step fields are "
                                         r"\['id', 'obs', 'action', 'reward'\]$"):
        w.append({**good, "rew": np.ones(2)}, terminated=no, truncated=no)
    with pytest.raises(ValueError, match=r"^Writer\.append: final lacks 'obs' \(obs_fields=\['obs'\]\)$"):
        w.append(good, terminated=np.array([True, False]), truncated=no, final={})
    with pytest.raises(ValueError, match=r"field 'obs' has shape \(2, 4\), expected \(2, 3\)"):
        w.append({**good, "obs": np.zeros((2, 4))}, terminated=no, truncated=no)
    with pytest.raises(ValueError, match=r"an episode ended but final=None"):
        w.append(good, terminated=np.array([True, False]), truncated=no)
    assert w.steps_appended == 0 and w.pending_steps == 0
    with pytest.raises(ValueError, match=r"obs_fields \['pixels'\] are not fields"):
        Writer(FIELDS, num_streams=2, pattern=TransitionPattern(), obs_fields=("pixels",))
    with pytest.raises(ValueError, match=r"WindowPattern pad must be 'head' or 'tail'"):
        WindowPattern(4, pad="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^Writer field 'obs' has dtype torch.bfloat16, which numpy \(the writer's "
                       r"step buffers\) cannot hold; declare the field float16 or float32, in the table and "
                       r"in the writer alike$"):
        Writer([("obs", (3,), "bfloat16"), ("reward", (), "float32")], num_streams=2, pattern=TransitionPattern())


def _steps(n: int, **change):
    good = {"id": np.arange(n) + 1, "obs": np.zeros((n, 3), np.float32), "action": np.zeros(n, np.int64),
            "reward": np.ones(n, np.float32)}
    return {**good, **change}


@pytest.mark.parametrize(("prio", "why"), [
    ([1.0, float("nan"), 2.0, 3.0], "stream 1's priority is nan"),
    ([1.0, 2.0, 3.0, float("inf")], "stream 3's priority is inf"),
    ([-0.5, 1.0, 1.0, 1.0], "stream 0's priority is -0.5"),
])
def test_a_bad_priority_raises_naming_its_stream_before_anything_is_buffered(prio, why):
    """Regression (hostile probe): a NaN, infinite or negative priority reached the shard, which refused
    the whole message for it ("message of 72 rows (64 items) from 4 streams: priority nan at position
    21"): one env's bad priority lost every other stream's items, and only the shard's log said so."""
    w = Writer(FIELDS, num_streams=4, pattern=TransitionPattern(), flush_steps=1)
    no = np.zeros(4, bool)
    with pytest.raises(ValueError, match=rf"^Writer.append: {why}; priorities must be finite and >= 0$"):
        w.append(_steps(4), terminated=no, truncated=no, priorities=np.array(prio))
    assert w.steps_appended == 0 and w.pending_steps == 0 and int(w._len.sum()) == 0
    with pytest.raises(ValueError, match=r"^Writer.append: priorities must be numbers, got dtype <U3$"):
        w.append(_steps(4), terminated=no, truncated=no, priorities=np.array(["1.5"] * 4))
    # An inactive stream's priority is never stored: not checked.
    bad = int(np.flatnonzero(~np.isfinite(prio) | (np.array(prio) < 0))[0])
    w.append(_steps(4), terminated=no, truncated=no, priorities=np.array(prio), active=np.arange(4) != bad)
    msgs = w.append(_steps(4), terminated=np.ones(4, bool), truncated=no, final={"obs": np.zeros((4, 3), np.float32)})
    table = _table(TransitionRead(1, 0.9, next_fields=("obs",)))
    _insert_all(table, msgs)  # (the shard takes every item)
    assert len(table) == 4 + 3


@pytest.mark.parametrize(("change", "error", "why"), [
    ({"action": np.array([1.0, np.nan, 2.0])}, ValueError,
     "field 'action' of stream 1 is nan, which the field's int64 cannot hold exactly; pass whole numbers in "
     "\\[-9223372036854775808, 9223372036854775807\\]$"),
    ({"action": np.array([1.0, 1.0, 2.7])}, ValueError, "field 'action' of stream 2 is 2.7, which the field's int64 "
     "cannot hold exactly"),
    ({"action": np.array([1.0, -np.inf, 2.0])}, ValueError, "field 'action' of stream 1 is -inf, which"),
    ({"action": np.array([1.0, 2.0**63, 2.0])}, ValueError, "field 'action' of stream 1 is 9.223372036854776e\\+18, "
     "which"),
    ({"action": np.array([1, 2, 2**64 - 1], np.uint64)}, ValueError, "field 'action' of stream 2 is "
     "18446744073709551615, which"),
    ({"reward": np.array(["1.5", "1.5", "1.5"])}, ValueError, "field 'reward' of stream 0 is '1.5', in an array of "
     "dtype <U3, not of numbers; the field is float32: pass numbers"),
    ({"reward": np.array([1.0, None, 2.0])}, ValueError, "field 'reward' of stream 1 is None, in an array of dtype "
     "object, not of numbers"),
    ({"obs": np.full((3, 3), 1 + 1j)}, ValueError, "field 'obs' of stream 0 is \\(1\\+1j\\), in an array of dtype "
     "complex128"),
])
def test_a_value_its_field_cannot_hold_exactly_raises_naming_the_stream_and_field(change, error, why):
    """Regression (hostile probe): the step buffers cast silently where the Table demands exact dtypes:
    NaN written to an int64 action was stored as -2**63, 2.7 as 2, the string "1.5" as 1.5. A value
    its field cannot hold exactly raises at append, naming the stream and the field, and nothing is
    buffered; a float field takes any number (rounded to its precision), an int field whole floats."""
    w = Writer(FIELDS, num_streams=3, pattern=TransitionPattern(), flush_steps=1)
    no = np.zeros(3, bool)
    with pytest.raises(error, match=rf"^Writer.append: {why}"):
        w.append(_steps(3, **change), terminated=no, truncated=no)
    assert w.steps_appended == 0 and int(w._len.sum()) == 0
    # What converts exactly is taken: whole floats and narrower ints for the int fields, any number for a float one.
    w.append(_steps(3, action=np.array([1.0, -2.0, 3.0]), id=np.array([4, 5, 6], np.int32), reward=np.arange(3)),
             terminated=no, truncated=no)
    msgs = w.append(_steps(3), terminated=np.ones(3, bool), truncated=no, final={"obs": np.zeros((3, 3))})
    assert msgs[0].fields["action"].tolist()[:2] == [1, 0] and msgs[0].fields["id"].tolist()[0] == 4


@pytest.mark.parametrize(("kw", "why"), [
    ({"terminated": np.array(["False", "False", "False"])}, "terminated must be bool \\[3\\] \\(or 0 and 1\\), got an array of dtype <U5"),
    ({"truncated": np.array([0.0, np.nan, 0.0])}, "truncated of stream 1 is nan; it must be a bool \\(or 0 or 1\\)"),
    ({"active": [1, 1, 2]}, "active of stream 2 is 2; it must be a bool \\(or 0 or 1\\)"),
    ({"terminated": None}, "terminated must be bool \\[3\\], got shape \\(1,\\)"),
    ({"step": {"reward": [[1.0], [2.0, 3.0], [4.0]]}}, "field 'reward' is a list numpy cannot make an array of "
     "\\(setting an array element with a sequence. .*\\); pass an array or tensor \\[N, \\*shape\\]"),
])
def test_every_refusal_of_bad_data_is_a_valueerror_and_a_flag_must_be_a_bool(kw, why):
    """Regression: Writer.append refused a string value or priority with TypeError and NaN with ValueError
    (only a ValueError is a refusal, one line from `reactor run`; a TypeError was a traceback, read as
    reactor's bug), a missing field with KeyError (its message printed in quotes), and a ragged list with
    a TypeError saying "must be an array or tensor, got list". And terminated, truncated and active were
    cast with np.asarray(x, dtype=bool): the string "False" and NaN were True, an episode cut where none
    ended. Each is a ValueError naming what was wrong, and nothing is appended; 0 and 1 are taken."""
    w = Writer(FIELDS, num_streams=3, pattern=TransitionPattern(), flush_steps=1)
    args = {"step": _steps(3), "terminated": np.zeros(3, bool), "truncated": np.zeros(3, bool)}
    args["step"] = {**args["step"], **kw.pop("step", {})}
    with pytest.raises(ValueError, match=rf"^Writer\.append: {why}$"):
        w.append(**{**args, **kw})
    assert w.steps_appended == 0 and int(w._len.sum()) == 0
    w.append(_steps(3), terminated=[0, 0, 0], truncated=np.zeros(3), active=torch.tensor([1, 0, 1]))
    msgs = w.append(_steps(3), terminated=np.ones(3), truncated=[False] * 3, final={"obs": np.zeros((3, 3))})
    assert w.steps_appended == 2 + 3 and sum(int(np.asarray(m.item_mask).sum()) for m in msgs) == 2 + 3
    with pytest.raises(ValueError, match=r"^Writer pattern must be a TransitionPattern or WindowPattern, got 'n3'$"):
        Writer(FIELDS, num_streams=3, pattern="n3")  # type: ignore[arg-type]


def test_an_inexact_final_observation_or_an_inactive_streams_value_is_checked_where_it_is_stored():
    """The final observations are written into the same buffers (checked, for the streams that ended);
    an inactive stream's values are never stored (not checked)."""
    w = Writer([("obs", (2,), "int32"), ("reward", (), "float32")], num_streams=2, pattern=TransitionPattern())
    no = np.zeros(2, bool)
    step = {"obs": np.zeros((2, 2), np.int32), "reward": np.ones(2, np.float32)}
    with pytest.raises(ValueError, match=r"^Writer.append: final 'obs' of stream 1 is 2147483648, which the field's "
                                         r"int32 cannot hold exactly; pass whole numbers in \[-2147483648, 2147483647\]$"):
        w.append(step, terminated=np.array([False, True]), truncated=no,
                 final={"obs": np.array([[0, 2**31], [1, 2**31]], np.int64)})
    assert w.steps_appended == 0
    w.append({**step, "obs": np.array([[0.0, 0.5], [1.0, 1.0]])}, terminated=no, truncated=no,
             active=np.array([False, True]))
    assert w.steps_appended == 1


F32_UNFIT = 2.0**128 - 2.0**103  # (the least float64 that rounds to inf in float32: the midpoint past its largest)


@pytest.mark.parametrize(("change", "why"), [
    ({"obs": np.array([[0.0, 0, 0], [0, 1e39, 0], [0, 0, 0]])}, "field 'obs' of stream 1 is 1e\\+39, which the field's "
     "float32 cannot hold \\(it would be inf there\\); scale it down, or declare the field float64$"),
    ({"reward": np.array([0.0, 0.0, -F32_UNFIT])}, "field 'reward' of stream 2 is -3.4028235677973366e\\+38, which the "
     "field's float32 cannot hold \\(it would be -inf there\\)"),
    ({"reward": np.array([np.nan, 0, 0], np.float32)}, "field 'reward' of stream 0 is nan; replay keeps finite numbers "
     "only \\(every update that samples a NaN or an infinity learns from it: its loss goes NaN\\): fix it in the env, "
     "or wrap the env to clip or replace such values$"),
    ({"obs": np.array([[0, 0, 0], [0, 0, 0], [0, 0, np.inf]], np.float32)}, "field 'obs' of stream 2 is inf; replay keeps"),
    ({"reward": np.array([0.0, np.nan, 0.0])}, "field 'reward' of stream 1 is nan; replay keeps"),
])
def test_a_value_a_float_field_would_not_hold_finite_raises_naming_the_stream_and_field(change, why):
    """Regression (h3): a float field took any number: float64 1e39 went into float32 as inf, in silence,
    and NaN and infinite values (a NaN reward) were stored as given, then sampled into updates (the run
    trained a NaN network to its end). Each raises at append now, naming the stream and the field, and
    nothing is buffered; the largest values that round to finite float32 still go in."""
    w = Writer(FIELDS, num_streams=3, pattern=TransitionPattern(), flush_steps=1)
    no = np.zeros(3, bool)
    with pytest.raises(ValueError, match=rf"^Writer.append: {why}"):
        w.append(_steps(3, **change), terminated=no, truncated=no)
    assert w.steps_appended == 0 and int(w._len.sum()) == 0
    below = np.nextafter(F32_UNFIT, 0)
    w.append(_steps(3, reward=np.array([below, -below, 3.4e38])), terminated=no, truncated=no)
    msgs = w.append(_steps(3), terminated=np.ones(3, bool), truncated=no, final={"obs": np.zeros((3, 3))})
    big = float(np.finfo(np.float32).max)
    assert msgs[0].fields["reward"][::3].tolist() == [big, -big, float(np.float32(3.4e38))]  # (each stream's first step)


def test_a_final_observation_a_float_field_would_not_hold_finite_raises_and_an_inactive_streams_is_not_stored():
    w = Writer([("obs", (2,), "float32"), ("reward", (), "float32")], num_streams=2, pattern=TransitionPattern())
    no = np.zeros(2, bool)
    step = {"obs": np.zeros((2, 2), np.float32), "reward": np.ones(2, np.float32)}
    with pytest.raises(ValueError, match=r"^Writer.append: final 'obs' of stream 1 is -inf; replay keeps finite"):
        w.append(step, terminated=np.array([False, True]), truncated=no,
                 final={"obs": np.array([[np.nan, 0], [0, -np.inf]], np.float32)})  # (stream 0's is not read)
    assert w.steps_appended == 0
    w.append({**step, "reward": np.array([np.nan, 1.0])}, terminated=no, truncated=no, active=np.array([False, True]))
    assert w.steps_appended == 1


def test_flushes_go_to_the_least_loaded_shard_so_one_parking_shard_cannot_hold_the_writer():
    """Regression (flow-control stall): with plain round-robin, an actor held at max_unacked by a shard
    that parks its inserts never fed the other shard, whose sample request waited for exactly those
    inserts. The writer now skips full shards (and is plain round-robin while none is full)."""
    w = Writer([("obs", (2,), "float32"), ("action", (), "int64"), ("reward", (), "float32")], 1,
               WindowPattern(2), num_shards=2, writer_id=0, max_unacked=2, flush_steps=1)
    shards = []
    for _ in range(6):
        for m in w.append({"obs": np.zeros((1, 2), np.float32), "action": np.zeros(1, np.int64),
                           "reward": np.zeros(1, np.float32)},
                          terminated=np.array([True]), truncated=np.array([False]), final={"obs": np.ones((1, 2), np.float32)}):
            shards.append(m.shard)
            if m.shard == 1:
                w.acknowledged(1)  # shard 1 keeps up; shard 0 acknowledges nothing
    assert shards[:4] == [0, 1, 0, 1]  # round-robin while shard 0 has room
    assert shards[4:] == [1] * (len(shards) - 4)  # then only the shard that keeps up
    assert not w.full() and int(w.unacked[0]) == 2
    w.unacked[1] = 2
    assert w.full()
    with pytest.raises(ValueError, match=r"^Writer\.acknowledged: shard must be in \[0, 2\), got 5$"):
        w.acknowledged(5)


def test_end_sends_what_is_ready_then_an_end_marker_to_every_shard_that_is_up_once():
    """A writer's end (its actor took its step budget): the last flush, then a marker per shard, so
    shards that count their bank's writers know no insert will come (Replay(writers=...)). A fixed
    shard's writer still tells every shard: each counts every writer of the bank."""
    w = Writer(FIELDS, num_streams=2, pattern=TransitionPattern(), num_shards=3, writer_id=1, shard=2,
               flush_steps=1000)
    step = {"id": np.array([1, 2]), "obs": np.zeros((2, 3)), "action": np.zeros(2, np.int64), "reward": np.ones(2)}
    no = np.zeros(2, bool)
    w.append(step, terminated=no, truncated=no)
    w.append({**step, "id": np.array([3, 4])}, terminated=np.array([True, False]), truncated=no,
             final={"obs": np.ones((2, 3))})
    w.shard_lost(0)
    msgs = w.end()
    data, markers = msgs[0], msgs[1:]
    assert data.shard == 2 and not data.last and data.fields["id"].tolist() == [1, 3, 0]  # the ended episode only
    assert [(m.shard, m.writer, m.last, m.fields, m.episode_end.shape) for m in markers] == [
        (1, 1, True, {}, (0,)), (2, 1, True, {}, (0,))]  # not shard 0: it is down
    assert [m.seq for m in msgs] == [0, 1, 2]
    assert w.unacked.tolist() == [0, 1, 2]  # markers are acknowledged as any message
    assert w.end() == []
    again = w.shard_restarted(0)  # the shard's new life has not counted this writer: its marker again
    assert [(m.shard, m.last) for m in again] == [(0, True)]
    fresh = Writer(FIELDS, num_streams=2, pattern=TransitionPattern(), num_shards=3)
    assert fresh.shard_restarted(0) == []  # (not ended: nothing to say)


def test_an_actor_drops_an_ack_naming_a_shard_it_does_not_have_instead_of_refusing_the_run(caplog):
    """Regression (the audit of the ValueErrors raised at run time in reactor/nodes): an InsertAck naming a
    shard outside the actor's (a peer's malformed word: the launch protocol checks a message's class, not its
    fields) reached ``Writer.acknowledged``'s ValueError, which ended the run as a refusal, one line blaming
    what the run was given. The actor drops it, logged, and steps on."""
    import logging

    from reactor import Graph, Input, Output, Reactor, reaction, run, startup
    from reactor.nodes.env_actor import EnvActor
    from reactor.nodes.messages import InsertAck, Steps

    class Stray(Reactor):
        out = Output(InsertAck)

        @reaction(triggers=[startup], effects=[out])
        def send(self) -> None:
            self.out.send(InsertAck(0, 7, 0))

    class Sink(Reactor):
        inp = Input(Steps, required=True)

        @reaction(triggers=[inp])
        def take(self, inp: Steps) -> None:
            pass

    g = Graph()
    actor = g.add(EnvActor("dqn", "CartPole-v1", num_shards=2, max_env_steps=64, flush_steps=16), name="actor")
    stray, sink = g.add(Stray(), name="stray"), g.add(Sink(), name="sink")
    g.connect(stray.out, actor.acks, delay_s=1e-6)
    g.connect(actor.steps, sink.inp, delay_s=1e-6)
    with caplog.at_level(logging.WARNING, logger="reactor.actor"):
        result = run(g)
    assert result.events["sink"] > 2, result.events  # (it stepped on to its budget)
    assert "actor dropped an InsertAck naming shard 7, outside [0, 2)" in caplog.messages


def test_a_writer_loads_its_numba_kernel_when_made_not_at_its_first_step():
    """numba's first kernel in a process sets up its compiler context (~0.5 s): an actor's writer pays it
    as it is made (the actor's startup), not at its first step, inside the run's clock. In a fresh
    process, where nothing called the kernel before."""
    code = (
        "import numpy as np\n"
        "from reactor.nodes.writer import Writer, TransitionPattern\n"
        "from reactor.replay._tablekernels import _nb_first_unfit\n"
        "assert not _nb_first_unfit.signatures, _nb_first_unfit.signatures\n"
        "Writer([('obs', (4,), 'float32'), ('action', (), 'int64'), ('reward', (), 'float32')], 2,\n"
        "       TransitionPattern(1))\n"
        "print(len(_nb_first_unfit.signatures))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= 1


def test_a_writer_with_a_float16_field_is_made():
    """The kernel a writer loads as it is made takes float64 values, whatever its fields' dtypes (numba
    has no float16 for it: a float16 field's writer could not be made)."""
    w = Writer([("obs", (4,), "float16"), ("action", (), "int64"), ("reward", (), "float32")], 2, TransitionPattern(1))
    assert w.num_shards == 1


def test_float16_values_are_appended_and_a_nan_among_them_is_named():
    """Regression: float16 values into a float16 field failed inside the finiteness check with numba's
    ``NotImplementedError: float16`` (its kernel has no float16); they are checked as float32 (exact)."""
    w = Writer([("obs", (3,), "float16"), ("action", (), "int64"), ("reward", (), "float32")], 2, TransitionPattern(1))
    step = {"obs": np.ones((2, 3), np.float16), "action": np.zeros(2, np.int64), "reward": np.zeros(2, np.float32)}
    w.append(step, terminated=np.zeros(2, bool), truncated=np.zeros(2, bool))
    bad = dict(step, obs=np.array([[1, 2, 3], [4, np.nan, 6]], np.float16))
    with pytest.raises(ValueError, match=r"field 'obs' of stream 1 is nan"):
        w.append(bad, terminated=np.zeros(2, bool), truncated=np.zeros(2, bool))


def _one_step_flushes(w: Writer, n: int) -> list:
    """``n`` messages from a one-stream writer with ``flush_steps=1``: one a terminal step."""
    out: list = []
    while len(out) < n:
        out += w.append({"obs": np.zeros((1, 2), np.float32), "action": np.zeros(1, np.int64),
                         "reward": np.zeros(1, np.float32)}, terminated=np.array([True]), truncated=np.array([False]),
                        final={"obs": np.ones((1, 2), np.float32)})
    return out


SMALL = [("obs", (2,), "float32"), ("action", (), "int64"), ("reward", (), "float32")]


def test_a_writer_asks_for_an_ack_every_few_messages_and_one_ack_counts_for_every_message_before_it():
    """Coalesced acks: with ``max_unacked=8`` a writer asks each shard for an ack on every 4th message (and on
    the one that fills the shard); the shard's ack of that message counts for the 3 before it too. An ack
    naming no message in flight counts for none, one without a seq for the oldest asking message and those
    before it; end markers always ask; a lost shard's messages count for nothing after."""
    w = Writer(SMALL, 1, WindowPattern(2), num_shards=2, max_unacked=8, flush_steps=1)
    assert w.ack_every == 4
    msgs = _one_step_flushes(w, 16)
    assert [m.shard for m in msgs] == [0, 1] * 8  # round-robin while no shard is full
    asked = {k: [m.seq for m in msgs if m.shard == k and m.ack] for k in (0, 1)}
    seqs = {k: [m.seq for m in msgs if m.shard == k] for k in (0, 1)}
    assert asked == {k: [seqs[k][3], seqs[k][7]] for k in (0, 1)}  # the 4th and the 8th (4th again, and full)
    assert w.unacked.tolist() == [8, 8] and w.full()
    w.acknowledged(0, seq=10**6)  # a seq this writer never sent: counts for none
    w.acknowledged(0, seq=seqs[1][3])  # shard 1's message, named by shard 0: not in flight there
    assert w.unacked.tolist() == [8, 8]
    w.acknowledged(0, seq=asked[0][0])  # the 4th: it and the 3 before it
    assert w.unacked.tolist() == [4, 8] and not w.full()
    w.acknowledged(1)  # no seq: through shard 1's oldest asking message
    assert w.unacked.tolist() == [4, 4]
    w.acknowledged(1, seq=seqs[1][5])  # an ack of a message between two asks (a shard may ack any) counts to it
    assert w.unacked.tolist() == [4, 2]
    w.shard_lost(0)
    w.acknowledged(0, seq=asked[0][1])  # in transit when the shard died: its messages are already lost
    assert w.unacked.tolist() == [0, 2] and w.lost_messages == 4
    assert all(m.ack for m in w.end()[-2:])  # (markers: nothing may follow them)

    assert Writer(SMALL, 1, WindowPattern(2), max_unacked=5).ack_every == 2
    assert Writer(SMALL, 1, WindowPattern(2), max_unacked=3).ack_every == 1
    assert Writer(SMALL, 1, WindowPattern(2)).ack_every == 1  # (no flow control: every message, as staging frees by acks)
    assert all(m.ack for m in _one_step_flushes(Writer(SMALL, 1, WindowPattern(2), max_unacked=8, ack_every=1,
                                                       flush_steps=1), 5))
    for kw, why in (({"ack_every": 0}, "Writer ack_every must be an int >= 1, got 0"),
                    ({"ack_every": True}, "Writer ack_every must be an int >= 1, got True"),
                    ({"max_unacked": 0}, "Writer max_unacked must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=f"^{why}$"):
            Writer(SMALL, 1, WindowPattern(2), **kw)


@pytest.mark.parametrize(("max_unacked", "ack_every"), [(1, None), (2, None), (5, None), (8, None), (3, 10)])
def test_a_writer_held_at_max_unacked_always_has_an_asking_message_in_flight(max_unacked, ack_every):
    """Against shards that acknowledge only the messages that ask, in order, at random moments: whenever
    a shard holds ``max_unacked`` of the writer's messages, one of them asked (so its ack will come and the
    writer is never held for good); the count always equals the messages in flight; every shard gets at
    most one ack per ``ack_every`` messages, plus one per fill (``ack_every`` past ``max_unacked``: only
    the fills ask)."""
    rng = np.random.default_rng(max_unacked)
    w = Writer(SMALL, 1, WindowPattern(2), num_shards=3, max_unacked=max_unacked, flush_steps=1, ack_every=ack_every)
    pending: list[list] = [[], [], []]  # per shard, in order: messages it has not acknowledged (covered by no ack)
    taken = [0, 0, 0]  # how many of those the shard took (its acks of the asking ones not yet delivered)
    acks = sent = 0
    for _ in range(3000):
        if not w.full() and rng.random() < 0.5:
            for m in _one_step_flushes(w, 1):
                pending[m.shard].append(m)
                sent += 1
        k = int(rng.integers(3))
        if taken[k] < len(pending[k]) and rng.random() < 0.4:  # the shard takes its next message
            taken[k] += 1
        if taken[k] and rng.random() < 0.3:  # the acks of what it took arrive, in order
            done = pending[k][:taken[k]]
            for m in done:
                if m.ack:
                    w.acknowledged(k, seq=m.seq)
                    acks += 1
            last = max((i for i, m in enumerate(done) if m.ack), default=-1)
            del pending[k][:last + 1]
            taken[k] -= last + 1
        for s in range(3):
            assert int(w.unacked[s]) == len(pending[s])
            if len(pending[s]) >= max_unacked:
                assert any(m.ack for m in pending[s]), (s, [(m.seq, m.ack) for m in pending[s]])
    assert sent > 300
    assert acks <= sent // w.ack_every + sent // max_unacked + 3
