"""A table's sampling state published for one-sided readers (``reactor.replay.shared``, issue 21).

A reader draws from the published sum tree (or dense list) and episode index with the table's own
arithmetic; a draw that races the owner's change starts again rather than return a torn result; what it
sees is never older than the owner's last completed change; and garbage in the shared memory gives a
refusal, never an access outside the arrays.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from reactor.replay import (
    FieldSpec,
    Fifo,
    MinSize,
    Prioritized,
    SampleToInsertRatio,
    StepRead,
    Storage,
    Table,
    Uniform,
    WindowRead,
)
from reactor.replay.shared import EMPTY, MOVED, OK, SamplingPublisher, SharedArrays, SharedSampling

CAP = 512


def _plain_arrays() -> SharedArrays:
    return SharedArrays(lambda name, nbytes: np.zeros(nbytes, np.uint8))


def _table(sampler, read, arrays: SharedArrays, cap: int = CAP, **kw) -> Table:
    st = Storage([FieldSpec("id", (), torch.int64), FieldSpec("x", (2,), torch.float32)], cap, index_arrays=arrays)
    return Table(st, sampler=sampler, remover=Fifo(), rate_limiter=MinSize(1), read=read, arrays=arrays, seed=3, **kw)


def _fill(table: Table, pub: SamplingPublisher, rng: np.random.Generator, inserts: int, first_id: int = 0) -> int:
    nid = first_id
    for _ in range(inserts):
        n = int(rng.integers(1, 40))
        ends = rng.random(n) < 0.15
        ends[-1] = True
        ids = np.arange(nid, nid + n)
        nid += n
        pub.begin()
        table.insert_nowait({"id": torch.from_numpy(ids), "x": torch.from_numpy(np.stack([ids, -ids], 1).astype(np.float32))},
                            rng.uniform(0.1, 9.0, n), episode_end=ends)
        pub.end()
    return nid


def _reader(pub: SamplingPublisher, arrays: SharedArrays) -> SharedSampling:
    return SharedSampling(pub.descriptor(), {n: arrays.get(n) for n in arrays.layout()})


@pytest.mark.parametrize("read", [WindowRead(6), WindowRead(6, "head"), StepRead()])
def test_a_one_sided_draw_is_the_tables_own_draw_and_reads_the_same_windows(read):
    """Same uniforms, same slots, keys and probabilities as Table.sample_nowait; the copied windows
    equal the table's read, after evictions wrapped the ring several times."""
    arrays = _plain_arrays()
    table = _table(Prioritized(0.6), read, arrays)
    pub = SamplingPublisher(table, arrays)
    _fill(table, pub, np.random.default_rng(0), 200)  # ~4000 steps into 512: evictions all along
    ss = _reader(pub, arrays)
    seq, mass, low, size = ss.figures()
    assert (mass, low, size) == (table._sampler.tree.total, table._sampler.tree.min, len(table))
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = table._rng.bit_generator.state
    status, plan = ss.draw(seq, rng.random(100))
    assert status == OK
    batch, info = table.sample_nowait(100)
    np.testing.assert_array_equal(plan["keys"], info.keys.numpy())
    np.testing.assert_array_equal(plan["probabilities"], info.probabilities.numpy())
    w = max(ss.window, 1)
    out = {"id": torch.empty((100, w), dtype=torch.int64), "x": torch.empty((100, w, 2))}
    st = table.storage
    mask = np.empty((100, w), bool)
    valid = ss.copy_windows(plan, np.array([st._fields[f].data_ptr() for f in out], np.int64),
                            np.array([8, 8], np.int64), np.array([t.data_ptr() for t in out.values()], np.int64), mask)
    assert valid.all()
    for f in out:
        got = out[f] if ss.window else out[f][:, 0]
        assert torch.equal(got, batch[f])
    if ss.window:
        np.testing.assert_array_equal(mask, batch["mask"].numpy())


@pytest.mark.parametrize("n", [1, 3])
def test_one_sided_transitions_are_the_storages_own_to_the_bit(n):
    """A TransitionRead table is offered as tail windows of n + 1 steps; the reader's transitions of
    its copied windows (shaped rewards: x is [2]) equal Storage.read_transitions for the same keys,
    field for field and bit for bit, episodes' last steps (valid False) and short tails included."""
    from reactor.replay import TransitionRead
    from reactor.replay.shared import transitions_from_windows

    read = TransitionRead(n, 0.9, reward_field="x", next_fields=("id", "x"))
    arrays = _plain_arrays()
    table = _table(Prioritized(0.6), read, arrays)
    pub = SamplingPublisher(table, arrays)
    _fill(table, pub, np.random.default_rng(7), 200)
    ss = _reader(pub, arrays)
    assert ss.window == n + 1 and not ss.head and ss.transition == read
    seq = ss.figures()[0]
    status, plan = ss.draw(seq, np.random.default_rng(8).random(300))
    assert status == OK
    st = table.storage
    out = {"id": torch.empty((300, n + 1), dtype=torch.int64), "x": torch.empty((300, n + 1, 2))}
    mask = np.empty((300, n + 1), bool)
    valid = ss.copy_windows(plan, np.array([st._fields[f].data_ptr() for f in out], np.int64),
                            np.array([8, 8], np.int64), np.array([t.data_ptr() for t in out.values()], np.int64), mask)
    assert valid.all()
    got = transitions_from_windows({**out, "mask": torch.from_numpy(mask)}, read)
    want = st.read_transitions(plan["keys"], n=n, gamma=0.9, reward_field="x", next_fields=("id", "x"))
    assert sorted(got) == sorted(want)
    for f in want:
        assert got[f].dtype == want[f].dtype and torch.equal(got[f], want[f]), f
    assert not want["valid"].all() and want["valid"].any()  # both kinds of items were drawn
    if n > 1:
        d = want["discount"].double()
        assert ((d - 0.9 ** n).abs() < 1e-6).any() and (d > 0.9 ** n + 1e-6).any()  # full and short tails


@pytest.mark.parametrize("pad", ["tail", "head"])
def test_overwritten_rows_are_reported_invalid_not_returned_as_good(pad):
    """An append that began before the copy ended (here: ran between the draw and the copy) makes
    exactly the windows whose oldest copied row it may have overwritten invalid; the others hold their
    steps (with head padding a window ends at its key: its oldest row is key - 3 + its first valid position)."""
    arrays = _plain_arrays()
    table = _table(Uniform(), WindowRead(4, pad), arrays)
    pub = SamplingPublisher(table, arrays)
    nid = _fill(table, pub, np.random.default_rng(1), 50)
    ss = _reader(pub, arrays)
    status, plan = ss.draw(ss.figures()[0], np.linspace(0, 0.999, 60))
    assert status == OK
    lo, hi = table.storage.step_range
    assert hi - lo > CAP - 40  # the ring is (nearly) full: the next append overwrites its oldest rows
    k = 40
    table.insert_nowait({"id": torch.arange(nid, nid + k), "x": torch.zeros(k, 2)}, np.ones(k), episode_end=True)
    floor = hi + k - CAP  # steps below it: their rows may hold newer steps now
    out = torch.empty((60, 4), dtype=torch.int64)
    mask = np.empty((60, 4), bool)
    valid = ss.copy_windows(plan, np.array([table.storage._fields["id"].data_ptr()], np.int64),
                            np.array([8], np.int64), np.array([out.data_ptr()], np.int64), mask)
    base = plan["keys"] - (3 if pad == "head" else 0)  # the step at window position 0
    oldest = np.array([b + int(np.flatnonzero(m)[0]) for b, m in zip(base, mask)])
    np.testing.assert_array_equal(valid, oldest >= floor)
    assert 0 < valid.sum() < 60
    for j in np.flatnonzero(valid):  # ids are the global steps here: each kept window holds its own steps
        at = np.flatnonzero(mask[j])
        assert out[j, at].tolist() == (base[j] + at).tolist()


def test_a_restore_during_the_copy_makes_the_reader_refuse_every_window_it_copied():
    """A restore rewrites rows in place and lowers the row horizon: a copy that overlapped it (here:
    the restore ran between the draw and the copy) is refused whole (the rewrite count moved), and a
    draw after it reads the restored rows."""
    arrays = _plain_arrays()
    table = _table(Uniform(), WindowRead(4), arrays)
    pub = SamplingPublisher(table, arrays)
    nid = _fill(table, pub, np.random.default_rng(3), 40)
    state = table.state_dict()
    _fill(table, pub, np.random.default_rng(4), 40, first_id=nid)  # the ring moves on past the saved state
    ss = _reader(pub, arrays)
    status, plan = ss.draw(ss.figures()[0], np.linspace(0, 0.999, 60))
    assert status == OK
    pub.begin()
    table.load_state_dict(state)
    pub.end()
    ring = np.array([table.storage._fields["id"].data_ptr()], np.int64)
    out = torch.empty((60, 4), dtype=torch.int64)

    def copy(plan):
        return ss.copy_windows(plan, ring, np.array([8], np.int64), np.array([out.data_ptr()], np.int64),
                               np.empty((60, 4), bool))

    assert not copy(plan).any()
    status, plan = ss.draw(ss.figures()[0], np.linspace(0, 0.999, 60))
    assert status == OK and copy(plan).all()
    assert (out[:, 0] == torch.from_numpy(plan["keys"])).all()  # ids are the global steps


def test_the_row_horizon_never_goes_down_on_an_append():
    """An append that failed half-way keeps what it reserved: a later, lower reservation (the next
    append starts where the storage's next step still is) leaves the horizon where it was."""
    from reactor.replay._storagekernels import _nb_reserve_rows

    horizon = np.zeros(2, np.int64)
    _nb_reserve_rows(horizon, 100)
    _nb_reserve_rows(horizon, 60)
    assert horizon.tolist() == [100, 0]


def test_the_published_arrays_stay_live_through_reset_restore_and_the_owners_other_changes():
    """clear/load re-initialise the sampler's and storage's arrays in place, never elsewhere."""
    arrays = _plain_arrays()
    table = _table(Uniform(), WindowRead(4), arrays)
    pub = SamplingPublisher(table, arrays)
    _fill(table, pub, np.random.default_rng(2), 30)
    state = table.state_dict()
    ss = _reader(pub, arrays)
    pub.begin()
    table.reset()
    pub.end()
    seq, mass, _low, size = ss.figures()
    assert (mass, size) == (0.0, 0)
    assert ss.draw(seq, np.array([0.5]))[0] == EMPTY
    pub.begin()
    table.load_state_dict(state)
    pub.end()
    seq, mass, _low, size = ss.figures()
    assert size == len(table) > 0
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = table._rng.bit_generator.state
    status, plan = ss.draw(seq, rng.random(10))
    _batch, info = table.sample_nowait(10)
    assert status == OK
    # Uniform draws an index per uniform: rng.integers(0, size) vs floor(u * size) differ in arithmetic,
    # so compare membership and probabilities, not the exact picks.
    assert set(plan["keys"].tolist()) <= set(table._keys[table._keys >= 0].tolist())
    np.testing.assert_allclose(plan["probabilities"], 1.0 / len(table))
    assert info.keys.numel() == 10


def test_a_draw_that_races_a_change_is_refused_and_a_stale_sequence_count_too():
    arrays = _plain_arrays()
    table = _table(Prioritized(1.0), StepRead(), arrays)
    pub = SamplingPublisher(table, arrays)
    _fill(table, pub, np.random.default_rng(3), 5)
    ss = _reader(pub, arrays)
    seq = ss.figures()[0]
    pub.begin()  # the owner is mid-change
    assert ss.figures()[0] == -1
    assert ss.draw(seq, np.array([0.2]))[0] == MOVED
    pub.end()
    assert ss.draw(seq, np.array([0.2]))[0] == MOVED  # the state changed since seq
    assert ss.draw(ss.figures()[0], np.array([0.2]))[0] == OK


def test_tables_the_owner_must_decide_for_are_refused_with_the_reason():
    arrays = _plain_arrays()
    st = Storage([FieldSpec("id", (), torch.int64)], 64, index_arrays=arrays)
    t = Table(st, sampler=Fifo(), remover=Fifo(), rate_limiter=MinSize(1), arrays=arrays)
    with pytest.raises(ValueError, match=r"^table 'table' cannot be sampled one-sidedly: its sampler is "
                                         r"Fifo \(one-sided: Uniform or Prioritized\)$"):
        SamplingPublisher(t, arrays)
    arrays = _plain_arrays()
    st = Storage([FieldSpec("id", (), torch.int64)], 64, index_arrays=arrays)
    t = Table(st, sampler=Prioritized(), remover=Fifo(), rate_limiter=MinSize(1), max_times_sampled=2, arrays=arrays)
    with pytest.raises(ValueError, match=r"max_times_sampled=2 \(the owner drops items at the draw\)$"):
        SamplingPublisher(t, arrays)


def _paced_table(arrays: SharedArrays, spi: float = 1.0) -> tuple[Table, SamplingPublisher, SharedSampling]:
    """A table whose limiter allows ``floor(inserts * spi)`` samples, published, and a reader of it."""
    st = Storage([FieldSpec("id", (), torch.int64)], 64, index_arrays=arrays)
    t = Table(st, sampler=Prioritized(), remover=Fifo(), rate_limiter=SampleToInsertRatio(spi, 1, (0.0, 1e9)),
              arrays=arrays)
    pub = SamplingPublisher(t, arrays)
    return t, pub, _reader(pub, arrays)


def _insert(table: Table, pub: SamplingPublisher, n: int) -> None:
    pub.begin()
    table.insert_nowait({"id": torch.arange(n)}, np.ones(n), episode_end=np.ones(n, bool))
    pub.end()


def test_a_rate_limited_table_and_its_readers_take_samples_from_one_count():
    """SampleToInsertRatio(1, min_diff 0): at most as many samples as inserts, over the owner's
    draws and the readers' together; a reader's take never goes past it, the owner's draw then
    waits (WouldBlock), an insert makes room for both; the readers' notices are not counted twice."""
    from reactor import WouldBlock

    arrays = _plain_arrays()
    table, pub, ss = _paced_table(arrays)
    assert not ss.take(1)  # nothing inserted: nothing allowed
    _insert(table, pub, 10)
    assert ss.take(4) and not ss.take(7)  # 4 + 7 > 10
    table.sample_nowait(6)
    with pytest.raises(WouldBlock, match=r"inserts=10, samples=10"):
        table.sample_nowait(1)
    assert not ss.take(1)
    _insert(table, pub, 5)
    assert ss.take(2)
    table.note_sampled(np.arange(6))  # the readers' notices: counted at the take already
    st = table.statistics()
    assert (st.rate_limiter.inserts, st.rate_limiter.samples, st.sampled) == (15, 12, 12)
    table.sample_nowait(3)
    assert table.statistics().rate_limiter.samples == 15 and not ss.take(1)


def test_a_limiter_shared_after_counting_keeps_its_count_and_a_checkpoint_restores_into_the_budget():
    """share() moves the samples counted so far into the budget; load_state_dict and reset write it."""
    arrays = _plain_arrays()
    st = Storage([FieldSpec("id", (), torch.int64)], 64, index_arrays=arrays)
    lim = SampleToInsertRatio(2.0, 1, (0.0, 1e9))
    t = Table(st, sampler=Prioritized(), remover=Fifo(), rate_limiter=lim, arrays=arrays)
    t.insert_nowait({"id": torch.arange(4)}, np.ones(4), episode_end=np.ones(4, bool))
    t.sample_nowait(5)
    pub = SamplingPublisher(t, arrays)
    ss = _reader(pub, arrays)
    assert ss.take(3) and not ss.take(1)  # 8 allowed, 5 counted before sharing
    lim.load_state_dict({"inserts": 10, "samples": 4})
    assert ss.take(16) and not ss.take(1)
    lim.reset()
    assert not ss.take(1) and lim.statistics().samples == 0
    with pytest.raises(ValueError, match="writable contiguous int64"):
        MinSize(1).share(np.zeros(4, np.int32))


def test_a_draw_that_fails_gives_back_what_it_took():
    """A sample that raises after the limiter's take (every priority 0) leaves the count as it was."""
    arrays = _plain_arrays()
    table, pub, ss = _paced_table(arrays)
    pub.begin()
    table.insert_nowait({"id": torch.arange(4)}, np.zeros(4), episode_end=np.ones(4, bool))
    pub.end()
    with pytest.raises(ValueError, match="every priority is 0"):
        table.sample_nowait(2)
    assert table.statistics().rate_limiter.samples == 0 and ss.take(4)


def _taker(name: str, out) -> None:  # pragma: no cover - runs in the child
    """Take one sample at a time from the budget (words 0-3) while word 4 is 1 (0: not yet, 2: stop)."""
    seg = shared_memory.SharedMemory(name=name)
    words = np.ndarray((5,), np.int64, buffer=seg.buf)
    from reactor.replay._budget import take

    budget = words[:4]
    got = tries = 0
    while words[4] == 0:
        pass
    while words[4] == 1:
        got += take(budget, 1)
        tries += 1
    out.send((got, tries))
    del words, budget
    seg.close()


@pytest.mark.timeout(120)
def test_takers_in_several_processes_never_take_more_than_the_limiter_allows_nor_lose_a_take():
    """Two processes take one sample at a time, without pause, while this one inserts 8 items and
    draws 2 through the table, 20,000 times: the budget's count is exactly the takes that succeeded
    plus the owner's draws, and never above what the inserts allow. (A plain read-then-write instead
    of the compare-and-swap loses takes: the count comes out below the successes.)"""
    from reactor import WouldBlock

    seg = shared_memory.SharedMemory(create=True, size=40)
    try:
        words = np.ndarray((5,), np.int64, buffer=seg.buf)
        words[:] = 0
        budget = words[:4]
        lim = SampleToInsertRatio(1.0, 1, (0.0, 1e9))
        lim.share(budget)
        st = Storage([FieldSpec("id", (), torch.int64)], 1024)
        table = Table(st, sampler=Prioritized(), remover=Fifo(), rate_limiter=lim)
        ctx = mp.get_context("fork")
        pipes = [ctx.Pipe() for _ in range(2)]
        procs = [ctx.Process(target=_taker, args=(seg.name, c)) for _, c in pipes]
        for p in procs:
            p.start()
        own = 0
        try:
            words[4] = 1
            for _ in range(20_000):
                table.insert_nowait({"id": torch.arange(8)}, np.ones(8), episode_end=np.ones(8, bool))
                try:
                    table.sample_nowait(2)
                    own += 2
                except WouldBlock:
                    pass
                assert budget[0] <= lim.statistics().inserts
            words[4] = 2
            got = [parent.recv()[0] for parent, _ in pipes]
        finally:
            words[4] = 2
            for p in procs:
                p.join(30)
        assert all(p.exitcode == 0 for p in procs)
        # The race that loses takes without the compare-and-swap is the two takers' (tens of thousands of
        # takes each); the owner's draws only need to be in the count. Where three busy processes share two
        # slow cores the spinning takers leave the owner few draws (792 in one CI run), so any will do.
        assert min(got) > 1000 and own > 0
        assert int(budget[0]) == sum(got) + own <= lim.statistics().inserts
        del words, budget
    finally:
        seg.close()
        seg.unlink()


@pytest.mark.parametrize("sampler", [Prioritized(0.6), Uniform()], ids=["prioritized", "uniform"])
def test_garbage_in_the_shared_memory_gives_refusals_never_a_wild_access(sampler):
    """A torn or corrupt state (random words over every array the reader reads: the index, the
    times, the header, the tree's sums and minima with padding, NaN and negative values, or the dense
    list) makes draws answer MOVED or EMPTY, or OK with every index inside the arrays; the reader
    never reads outside them (a capacity of 600 leaves padding in every level of an 8-ary tree,
    where a corrupt descent could wander; numba checks no bounds, so a wild read would fault or
    return nonsense positions, which the asserts catch), and the copy into the batch stays in it. An
    OK draw's probabilities are in (0, 1] and its times sampled >= 1: a NaN, negative or inf sum gave
    NaN and negative probabilities (then NaN importance weights, which poison a learner's loss) and
    garbage times a negative count, where the message path refuses such replies (hostile review)."""
    cap = 600
    arrays = _plain_arrays()
    table = _table(sampler, WindowRead(8, "head"), arrays, cap=cap)
    pub = SamplingPublisher(table, arrays)
    _fill(table, pub, np.random.default_rng(4), 40)
    rng = np.random.default_rng(5)
    outcomes = set()
    out = torch.zeros((32, 8), dtype=torch.int64)
    ring = table.storage._fields["id"]
    for trial in range(400):
        for name in ("step_ep", "ep_start", "ep_len", "times", "dense", "row_horizon"):
            if name in arrays.layout():
                a = arrays.get(name)
                a[:] = rng.integers(-(2**62), 2**62, size=a.shape) if trial % 2 else rng.integers(-3, 3 * cap, a.shape)
        if "sums" in arrays.layout():
            for name in ("sums", "mins"):
                a = arrays.get(name)
                a[:] = rng.choice([np.nan, -1.0, 0.0, 1e300, 3.0], size=a.shape) * rng.random(a.shape)
        h = arrays.get("header")
        h[1:5] = rng.integers(-5, 3 * cap, size=4)
        h[0] = 2 * int(rng.integers(0, 100))
        ss = _reader(pub, arrays)
        status, plan = ss.draw(int(h[0]), rng.random(32))
        outcomes.add(status)
        if status == OK:
            assert ((plan["pos"] >= 0) & (plan["pos"] < cap)).all()
            assert ((plan["lo"] >= 0) & (plan["lo"] < plan["hi"]) & (plan["hi"] <= 8)).all()
            p = plan["probabilities"]
            assert ((p > 0) & (p <= 1)).all(), p  # (NaN fails: a batch's weights would be NaN)
            assert (plan["times_sampled"] >= 1).all(), plan["times_sampled"]
            ss.copy_windows(plan, np.array([ring.data_ptr()], np.int64),
                            np.array([8], np.int64), np.array([out.data_ptr()], np.int64), np.empty((32, 8), bool))
    assert MOVED in outcomes


def test_garbage_in_one_shard_of_a_group_gives_refusals_never_a_wild_access():
    """Two shards drawn as one batch (SharedShards: figures and counts, then every draw), the second's
    published state overwritten with random words, NaN, negative and huge sums before each try: the
    figures answer OK, BUSY, BELOW or ZERO; the draws OK or MOVED_AT at a shard and an item offset in
    range; an OK batch's keys carry the shards' tags, its probabilities are in (0, 1], its weights
    finite and its times sampled >= 1, and its windows stay inside the batch (guard bytes after it
    are untouched); nothing reads outside the arrays (a wild read faults)."""
    from reactor.replay.shared import BELOW, BUSY, MOVED_AT, ZERO, SharedShards

    cap, n, w = 600, 48, 8
    rng = np.random.default_rng(7)
    tables = []
    for k in range(2):
        arrays = _plain_arrays()
        table = _table(Prioritized(0.6), WindowRead(w), arrays, cap=cap)
        pub = SamplingPublisher(table, arrays)
        _fill(table, pub, np.random.default_rng(10 + k), 40)
        tables.append((table, pub, arrays))
    rows = [np.array([t.storage._fields[f].data_ptr() for f in ("id", "x")], np.int64) for t, _p, _a in tables]
    row_nbytes = np.array([8, 8], np.int64)
    figures_seen, draws_seen = set(), set()
    for trial in range(300):
        bad = tables[1][2]
        for name in ("step_ep", "ep_start", "ep_len", "times"):
            a = bad.get(name)
            a[:] = rng.integers(-(2**62), 2**62, size=a.shape) if trial % 2 else rng.integers(-3, 3 * cap, a.shape)
        for name in ("sums", "mins"):
            a = bad.get(name)
            a[:] = rng.choice([np.nan, -1.0, 0.0, 1e300, np.inf, 3.0], size=a.shape) * rng.random(a.shape)
        h = bad.get("header")
        h[1:5] = rng.integers(-5, 3 * cap, size=4)
        h[0] = 2 * int(rng.integers(0, 100)) + (trial % 7 == 0)  # now and then mid-change (odd)
        group = SharedShards([(_reader(pub, arrays), r, row_nbytes) for (_t, pub, arrays), r in zip(tables, rows)])
        seqs, sizes, counts = (np.zeros(2, np.int64) for _ in range(3))
        masses, lows, shares, least, where = np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(1), np.zeros(3, np.int64)
        status = group.figures(rng.random(n), seqs, sizes, masses, lows, counts, shares, least)
        figures_seen.add(status)
        assert status in (OK, BUSY, BELOW, ZERO)
        if status != OK:
            continue
        assert counts.sum() == n and (counts >= 0).all()
        guard = 0x5A
        batch = np.full((n + 4) * w * 16, guard, np.uint8)  # id then x per window, plus 4 items of guard
        ids, xs = batch[: n * w * 8], batch[n * w * 8 : n * w * 16]
        keys, probs, times = np.empty(n, np.int64), np.empty(n), np.empty(n, np.int64)
        valid, weights, mask = np.empty(n, bool), np.empty(n, np.float32), np.empty((n, w), bool)
        tags = np.array([0, 1 << 48], np.int64)
        status = group.draw(rng.random(n), np.array([ids.ctypes.data, xs.ctypes.data], np.int64),
                            row_nbytes * w, tags, 0.4, mask, keys, probs, times, valid, weights, seqs, counts,
                            shares, least, where)
        draws_seen.add(status)
        assert status in (OK, MOVED_AT)
        assert (batch[n * w * 16 :] == guard).all()  # nothing written past the batch
        if status == MOVED_AT:
            assert where[0] in (0, 1) and 0 <= where[1] <= n
        else:
            assert set((keys[: counts[0]] >> 48).tolist()) <= {0} and set((keys[counts[0] :] >> 48).tolist()) <= {1}
            assert ((probs > 0) & (probs <= 1)).all() and np.isfinite(weights).all(), (probs, weights)
            assert (times >= 1).all(), times
    assert OK in figures_seen and len(figures_seen) >= 2 and MOVED_AT in draws_seen


def _leaves(arrays: SharedArrays, cap: int, arity: int) -> np.ndarray:
    """The leaf level of a published sum tree (padding included)."""
    from reactor.replay.sumtree import _layout

    offsets, _ = _layout(cap, arity)
    return arrays.get("sums")[int(offsets[-2]):int(offsets[-1])]


@pytest.mark.parametrize("spoil", ["root inf", "leaves NaN", "leaves negative", "times negative", "times at the top"])
def test_masses_and_counts_out_of_range_in_a_settled_state_are_refused_not_drawn(spoil):
    """A published state whose index is sound but whose sums or times are not (another process wrote
    them; the sequence count says settled): every draw answers MOVED, never OK with a probability
    outside (0, 1] (an inf root gave 0, NaN leaves NaN, negative leaves negative ones: then NaN
    importance weights, which poison a learner's loss) or a times sampled below 1 (a negative count
    or one that overflows). The message path refuses such replies (``items_problem``); this was the
    one path that passed them on (hostile review)."""
    arrays = _plain_arrays()
    table = _table(Prioritized(0.6), WindowRead(4), arrays)
    pub = SamplingPublisher(table, arrays)
    _fill(table, pub, np.random.default_rng(1), 20)
    if spoil == "root inf":
        arrays.get("sums")[0] = np.inf
    elif spoil.startswith("leaves"):
        leaves = _leaves(arrays, CAP, table._sampler.arity)
        leaves[leaves > 0] = np.nan if spoil.endswith("NaN") else -leaves[leaves > 0]
    else:
        arrays.get("times")[:] = -3 if spoil.endswith("negative") else np.iinfo(np.int64).max
    ss = _reader(pub, arrays)
    seq = ss.figures()[0]
    assert seq >= 0
    rng = np.random.default_rng(2)
    for _ in range(20):
        status, plan = ss.draw(seq, rng.random(16))
        assert status == MOVED, (status, plan["probabilities"], plan["times_sampled"])


def test_a_group_whose_one_mass_is_inf_refuses_the_other_shards_items_of_probability_0():
    """Two shards drawn as one batch, shard 0's root sum inf (its figures' mass): the total is inf, so
    shard 1's share is 0 and every item falls to it; its items would report probability 0 (weight
    1). The draw answers MOVED_AT at shard 1 instead: a probability outside (0, 1] is never
    returned (hostile review)."""
    from reactor.replay.shared import MOVED_AT, SharedShards

    cap, n, w = CAP, 16, 4
    parts = []
    for k in range(2):
        arrays = _plain_arrays()
        table = _table(Prioritized(0.6), WindowRead(w), arrays, cap=cap)
        pub = SamplingPublisher(table, arrays)
        _fill(table, pub, np.random.default_rng(20 + k), 20)
        if k == 0:
            arrays.get("sums")[0] = np.inf
        parts.append((_reader(pub, arrays), np.array([table.storage._fields["id"].data_ptr()], np.int64),
                      np.array([8], np.int64)))
    group = SharedShards(parts)
    seqs, sizes, counts = (np.zeros(2, np.int64) for _ in range(3))
    masses, lows, shares, least, where = np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(1), np.zeros(3, np.int64)
    rng = np.random.default_rng(3)
    assert group.figures(rng.random(n), seqs, sizes, masses, lows, counts, shares, least) == OK
    assert counts.tolist() == [0, n] and shares[1] == 0.0
    ids = np.empty(n * w, np.int64)
    keys, probs, times = np.empty(n, np.int64), np.empty(n), np.empty(n, np.int64)
    valid, weights, mask = np.empty(n, bool), np.empty(n, np.float32), np.empty((n, w), bool)
    status = group.draw(rng.random(n), np.array([ids.ctypes.data], np.int64), np.array([8 * w], np.int64),
                        np.array([0, 1 << 48], np.int64), 0.4, mask, keys, probs, times, valid, weights, seqs, counts,
                        shares, least, where)
    assert status == MOVED_AT and where.tolist() == [1, 0, MOVED], (status, probs)


def test_windows_as_long_as_the_ring_are_sampled_and_longer_ones_are_refused():
    """A head-padded window of the whole ring wraps around it (the version check too); a window
    longer than the ring cannot be planned one-sidedly and the table is not offered."""
    arrays = _plain_arrays()
    table = _table(Prioritized(1.0), WindowRead(16, "head"), arrays, cap=16)
    pub = SamplingPublisher(table, arrays)
    for first in range(0, 40, 8):  # five 8-step episodes into a 16-step ring: it wraps twice
        pub.begin()
        table.insert_nowait({"id": torch.arange(first, first + 8), "x": torch.zeros(8, 2)}, np.ones(8),
                            episode_end=True)
        pub.end()
    ss = _reader(pub, arrays)
    status, plan = ss.draw(ss.figures()[0], np.linspace(0.01, 0.99, 8))
    assert status == OK
    out = torch.zeros((8, 16), dtype=torch.int64)
    mask = np.empty((8, 16), bool)
    valid = ss.copy_windows(plan, np.array([table.storage._fields["id"].data_ptr()], np.int64),
                            np.array([8], np.int64), np.array([out.data_ptr()], np.int64), mask)
    assert valid.all()
    ref = table.storage.read_windows(plan["keys"], 16, "head")
    assert torch.equal(out, ref["id"]) and np.array_equal(mask, ref["mask"].numpy())
    arrays = _plain_arrays()
    longer = _table(Prioritized(1.0), WindowRead(17), arrays, cap=16)
    with pytest.raises(ValueError, match=r"its windows \(17 steps\) are longer than its storage \(16 steps\)$"):
        SamplingPublisher(longer, arrays)


def test_a_corrupt_or_mismatched_descriptor_is_refused_by_name():
    """A descriptor of the wrong kind, a field of the wrong type, arrays that do not fit it, or a beta
    that is not a finite number >= 0 (NaN made every importance weight NaN; the message path's
    figures check refuses it: hostile review) is refused, naming what is wrong."""
    arrays = _plain_arrays()
    table = _table(Prioritized(0.6), WindowRead(8), arrays)
    pub = SamplingPublisher(table, arrays)
    desc = pub.descriptor()
    mapped = {n: arrays.get(n) for n in arrays.layout()}
    with pytest.raises(ValueError, match=r"^not a one-sided sampling descriptor"):
        SharedSampling({**desc, "kind": "x"}, mapped)
    with pytest.raises(ValueError, match=r"^one-sided sampling descriptor: 'capacity' must be of type int, got '512'$"):
        SharedSampling({**desc, "capacity": "512"}, mapped)
    for beta in (float("nan"), -0.5, float("inf")):  # (the weights of every draw NaN, or above 1: hostile review)
        with pytest.raises(ValueError, match=rf"^one-sided sampling descriptor: beta {beta!r} is not a finite number >= 0$"):
            SharedSampling({**desc, "beta": beta}, mapped)
    with pytest.raises(ValueError, match=r"^one-sided sampling: array 'sums' is float64\(592,\), expected float64\(1184,\)$"):
        SharedSampling({**desc, "capacity": 2 * CAP}, {**mapped, "step_ep": np.zeros(2 * CAP, np.int64),
                                                        "ep_start": np.zeros(2 * CAP, np.int64),
                                                        "ep_len": np.zeros(2 * CAP, np.int64),
                                                        "times": np.zeros(2 * CAP, np.int64)})


# ------------------------------------------------------------------------- across processes

_TABLE = 256
DRAWS = 1024  # per read: long enough that a change often starts during the descent (the check after it)


class _Segments:
    """An owner process's named shared segments (``prefix`` + name), unlinked together."""

    def __init__(self, prefix: str) -> None:
        self.prefix, self.segments = prefix, []

    def buffer(self, name: str, nbytes: int) -> memoryview:
        seg = shared_memory.SharedMemory(name=f"{self.prefix}{name}", create=True, size=max(nbytes, 1))
        self.segments.append(seg)
        return seg.buf

    def zeros(self, name: str, nbytes: int) -> np.ndarray:
        """What SharedArrays allocates with: a zeroed byte array in a new segment."""
        arr = np.ndarray((nbytes,), np.uint8, buffer=self.buffer(name, nbytes))
        arr[:] = 0
        return arr

    def unlink(self) -> None:
        for seg in self.segments:
            seg.close()
            seg.unlink()


@contextlib.contextmanager
def _owner_process(target, prefix: str):
    """``target(prefix, pipe, done segment's name)`` in a forked process: yields ``(pipe, done, its
    descriptor)``; at the end sets ``done[1]``, says "bye", reaps it and checks its exit code. The
    body drops its views of the owner's segments and closes them itself (before this ends)."""
    done_seg = shared_memory.SharedMemory(create=True, size=16)
    done = np.ndarray((2,), np.int64, buffer=done_seg.buf)
    done[:] = 0
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=target, args=(prefix, child, done_seg.name))
    proc.start()
    try:
        assert parent.poll(60)
        yield parent, done, parent.recv()
    finally:
        done[1] = 1
        parent.send("bye")
        proc.join(30)
        done_seg.close()
        done_seg.unlink()
    assert proc.exitcode == 0


def _attach(prefix: str, segs: list, name: str) -> memoryview:
    seg = shared_memory.SharedMemory(name=f"{prefix}{name}")
    segs.append(seg)
    return seg.buf


def _owner(prefix: str, ready, done_name: str) -> None:  # pragma: no cover - runs in the child
    """Version v = 1, 2, ... until the reader sets done[1]: one change that leaves exactly one positive
    priority, at slot v % 256 (with a new step inserted every 7th version, evicting the oldest), then
    done[0] = v, then a short pause."""
    segments = _Segments(prefix)
    arrays = SharedArrays(segments.zeros)
    st = Storage([FieldSpec("id", (), torch.int64)], _TABLE, index_arrays=arrays)
    table = Table(st, sampler=Prioritized(1.0), remover=Fifo(), rate_limiter=MinSize(1), arrays=arrays)
    table.insert_nowait({"id": torch.arange(_TABLE)}, np.zeros(_TABLE), episode_end=np.ones(_TABLE, bool))
    pub = SamplingPublisher(table, arrays)
    done_seg = shared_memory.SharedMemory(name=done_name)
    done = np.ndarray((2,), np.int64, buffer=done_seg.buf)
    ready.send(pub.descriptor())
    ready.recv()  # the reader has mapped everything
    v = 0
    while not done[1]:
        v += 1
        pub.begin()
        if v % 7 == 0:
            table.insert_nowait({"id": torch.tensor([v])}, np.zeros(1), episode_end=True)
        lo, hi = st.step_range
        keys = np.arange(lo, hi)
        p = np.zeros(len(keys))
        p[keys % _TABLE == v % _TABLE] = 1.0
        table.update_priorities(keys, p)
        pub.end()
        done[0] = v
        # A pause between changes (~0.1 ms with the sleep's granularity): without it, on 2 cores nearly
        # every read meets a change in progress and 200 accepted draws took 10-40 s.
        time.sleep(1e-5)
    ready.recv()
    del done, arrays, table, st, pub
    done_seg.close()
    segments.unlink()


@pytest.mark.timeout(120)
def test_a_reader_in_another_process_never_sees_a_torn_tree_nor_one_older_than_the_last_completed_change():
    """The owner changes its tree over and over (one positive leaf each time, moving); a reader in
    this process draws 1,024 at a time throughout, until 200 draws were accepted and one read met a
    change in progress. Every accepted draw is one snapshot (all 1,024 draws hit the same leaf), and
    that leaf belongs to a change no older than the last one completed before the read began, and no
    newer than the one in progress when it ended. (With 16 a draw, removing the draw's check of the
    sequence count after its descent went unnoticed: a change rarely began inside so short a descent.
    With 1,024 it fails, "a torn draw".)"""
    prefix = f"rxtest{np.random.default_rng().integers(1 << 30)}_"
    segs: list[shared_memory.SharedMemory] = []
    with _owner_process(_owner, prefix) as (parent, done, desc):
        ss: SharedSampling | None = None
        mapped: dict | None = None
        try:
            mapped = {name: np.ndarray(tuple(shape), np.dtype(dtype), buffer=_attach(prefix, segs, name))
                      for name, (shape, dtype) in desc["arrays"].items()}
            ss = SharedSampling(desc, mapped)
            ss.draw(ss.figures()[0], np.array([0.5]))  # compiled before the owner starts
            parent.send("go")
            ok = moved = 0
            rng = np.random.default_rng(0)
            deadline = time.monotonic() + 60
            # Until 200 draws were accepted, at least one read met a change in progress (on a loaded
            # machine the owner may be off the CPU for the first 200: the retry path must have run) and the
            # owner made more than 200 changes.
            while (ok < 200 or moved == 0 or int(done[0]) <= 200) and time.monotonic() < deadline:
                before = int(done[0])
                seq, mass, _low, _size = ss.figures()
                if seq < 0:
                    moved += 1
                    continue
                status, plan = ss.draw(seq, rng.random(DRAWS))
                after = int(done[0])
                if status != OK:
                    moved += 1
                    continue
                ok += 1
                slots = plan["slots"]
                assert (slots == slots[0]).all(), "a torn draw: leaves of two versions"
                assert mass == 1.0
                fresh = {v % _TABLE for v in range(max(before, 1), after + 2)}
                assert int(slots[0]) in fresh, (int(slots[0]), before, after)
            assert ok >= 200 and moved > 0 and int(done[0]) > 200, (ok, moved, int(done[0]))
        finally:
            ss = mapped = None  # drop the views before the mappings close
            for seg in segs:
                seg.close()


_RING, _W, _X = 4096, 32, 16  # the torn-rows test: ring steps, window, floats per row beside the id


def _inserting_owner(prefix: str, ready, done_name: str) -> None:  # pragma: no cover - runs in the child
    """Appends 64-step episodes (id = global step, x = id in every float) as fast as it can, each
    inside the publisher's bracket as a Replay shard's inserts are, until the reader sets done[1];
    done[0] counts the appends. Every field and index array lives in a named shared segment."""
    segments = _Segments(prefix)

    def field(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(segments.buffer(f"field-{name}", n), dtype=dtype).view(shape)

    arrays = SharedArrays(segments.zeros)
    st = Storage([FieldSpec("id", (), torch.int64), FieldSpec("x", (_X,), torch.float32)], _RING,
                 index_arrays=arrays, allocator=field)
    table = Table(st, sampler=Uniform(), remover=Fifo(), rate_limiter=MinSize(1), read=WindowRead(_W), arrays=arrays)
    pub = SamplingPublisher(table, arrays)
    done_seg = shared_memory.SharedMemory(name=done_name)
    done = np.ndarray((2,), np.int64, buffer=done_seg.buf)
    for _ in range(_RING // 64):  # full before the reader starts
        ids = torch.arange(st.step_range[1], st.step_range[1] + 64)
        pub.begin()
        table.insert_nowait({"id": ids, "x": ids[:, None].float().expand(64, _X)}, np.ones(64), episode_end=True)
        pub.end()
    ready.send(pub.descriptor())
    ready.recv()
    v = 0
    while not done[1]:
        ids = torch.arange(st.step_range[1], st.step_range[1] + 64)
        pub.begin()
        table.insert_nowait({"id": ids, "x": ids[:, None].float().expand(64, _X)}, np.ones(64), episode_end=True)
        pub.end()
        v += 1
        done[0] = v
    ready.recv()
    del done, arrays, table, st, pub
    done_seg.close()
    segments.unlink()


@pytest.mark.timeout(120)
def test_windows_copied_while_another_process_overwrites_the_ring_are_never_accepted_torn():
    """The owner process overwrites its 4,096-step ring 64 steps at a time without pause; this process
    samples 1,024 windows of 32 steps at a time without any lock on the rows. Every window accepted as
    valid holds consecutive steps from its key and, in each row, an x equal to that row's id (a row
    caught between the two fields' writes would differ); some windows were refused (an append
    overlapped the copy: the row horizon's check ran for real)."""
    prefix = f"rxrows{np.random.default_rng().integers(1 << 30)}_"
    segs: list[shared_memory.SharedMemory] = []
    with _owner_process(_inserting_owner, prefix) as (parent, done, desc):
        ss = mapped = ring_id = ring_x = None
        try:
            mapped = {name: np.ndarray(tuple(shape), np.dtype(dtype), buffer=_attach(prefix, segs, name))
                      for name, (shape, dtype) in desc["arrays"].items()}
            ss = SharedSampling(desc, mapped)
            ring_id = np.ndarray((_RING,), np.int64, buffer=_attach(prefix, segs, "field-id"))
            ring_x = np.ndarray((_RING, _X), np.float32, buffer=_attach(prefix, segs, "field-x"))
            n = 1024
            ids, xs = np.empty((n, _W), np.int64), np.empty((n, _W, _X), np.float32)
            mask = np.empty((n, _W), np.bool_)
            keys, probs = np.empty(n, np.int64), np.empty(n)
            times, valid = np.empty(n, np.int64), np.empty(n, np.bool_)
            src = np.array([ring_id.ctypes.data, ring_x.ctypes.data], np.int64)
            rows = np.array([8, 4 * _X], np.int64)
            dst = np.array([ids.ctypes.data, xs.ctypes.data], np.int64)
            parent.send("go")
            rng = np.random.default_rng(0)
            accepted = refused = 0
            deadline = time.monotonic() + 60
            while (accepted < 20_000 or refused == 0 or int(done[0]) < 100) and time.monotonic() < deadline:
                seq = ss.figures()[0]
                if seq < 0 or ss.sample_into(seq, rng.random(n), src, rows, dst, mask, keys, probs, times, valid) != OK:
                    continue
                refused += int((~valid).sum())
                for j in np.flatnonzero(valid):
                    m = int(mask[j].sum())
                    assert (ids[j, :m] == keys[j] + np.arange(m)).all(), "a torn window: rows of other steps"
                    assert (xs[j, :m] == ids[j, :m, None]).all(), "a torn row: its fields from two writes"
                    accepted += 1
            assert accepted >= 20_000 and refused > 0 and int(done[0]) >= 100, (accepted, refused, int(done[0]))
        finally:
            ss = mapped = ring_id = ring_x = None  # drop the views before the mappings close
            for seg in segs:
                seg.close()
