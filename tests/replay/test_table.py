"""Table: items over storage, selectors, removal, validation that leaves state untouched (issue 3)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reactor._errors import WouldBlock
from reactor.replay import (
    EpisodeRead,
    FieldSpec,
    Fifo,
    Lifo,
    MaxHeap,
    MinHeap,
    MinSize,
    Prioritized,
    SampleToInsertRatio,
    StepRead,
    Storage,
    Table,
    TransitionRead,
    Uniform,
    WindowRead,
)

SPECS = [FieldSpec("obs", (2,), torch.float32), FieldSpec("reward", (), torch.float32),
         FieldSpec("step", (), torch.int64)]
SELECTORS = {"uniform": Uniform, "prioritized": lambda: Prioritized(0.6), "fifo": Fifo, "lifo": Lifo,
             "maxheap": MaxHeap, "minheap": MinHeap}
READS = {"step": StepRead(), "transition": TransitionRead(n=2, gamma=0.9), "window": WindowRead(4, "head"),
         "episode": EpisodeRead()}


def steps(start: int, n: int) -> dict[str, torch.Tensor]:
    v = torch.arange(start, start + n)
    return {"obs": torch.stack([v.float(), -v.float()], 1), "reward": v.float(), "step": v}


def make(sampler="fifo", remover="fifo", *, cap=64, limiter=None, read=StepRead(), **kw) -> Table:
    return Table(Storage(SPECS, cap), sampler=SELECTORS[sampler](), remover=SELECTORS[remover](),
                 rate_limiter=limiter or MinSize(1), read=read, **kw)


def fill(t: Table, n_eps: int = 4, length: int = 5, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    start = t.storage.step_range[1]
    for i in range(n_eps):
        t.insert_nowait(steps(start + i * length, length), rng.uniform(0.1, 2.0, length))


def state_equal(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------- basics


def test_insert_returns_keys_that_are_global_steps():
    t = make()
    assert t.insert_nowait(steps(0, 3)).tolist() == [0, 1, 2]
    assert t.insert_nowait(steps(3, 2)).tolist() == [3, 4]
    assert len(t) == 5


def test_flush_applies_the_samplers_buffered_tree_writes_to_its_node_arrays():
    """A Prioritized sampler buffers its tree's writes (applied in one pass at the next sample);
    ``flush`` applies them now, so the node arrays (what a one-sided reader maps) hold them."""
    t = make("prioritized", cap=32)
    prio = np.array([0.5, 1.0, 2.0, 4.0])
    t.insert_nowait(steps(0, 4), prio)
    root = t._sampler._tree._sums  # the node array; [0] the root
    assert root[0] == 0.0  # buffered
    t.flush()
    assert root[0] == pytest.approx(float((prio ** 0.6).sum()))
    t.flush()  # nothing buffered: a no-op
    assert root[0] == pytest.approx(float((prio ** 0.6).sum()))
    make("fifo").flush()  # samplers without buffers: a no-op


def test_item_mask_creates_items_only_on_chosen_steps():
    t = make()
    keys = t.insert_nowait(steps(0, 4), np.array([1.0, np.nan, 2.0, 3.0]),
                           item_mask=np.array([True, False, True, False]))
    assert keys.tolist() == [0, 2] and len(t) == 2 and t.storage.num_steps == 4


def test_sample_returns_batch_and_info_with_keys_probabilities_weights_times():
    t = make("fifo", "fifo")
    t.insert_nowait(steps(0, 4))
    batch, info = t.sample_nowait(3)
    assert batch["step"].tolist() == info.keys.tolist() == [0, 1, 2]
    assert info.probabilities.tolist() == [1.0] * 3 and info.weights.tolist() == [1.0] * 3
    assert info.table_size == 4 and info.times_sampled.tolist() == [1, 1, 1]
    _, info = t.sample_nowait(1)
    assert info.times_sampled.tolist() == [2]


def test_sampling_without_reading_draws_and_books_the_same_items():
    """read=False (a caller that reads the items itself) returns no batch but the same draw, counts
    and expiry as a reading sample from an identical table."""
    a = make("prioritized", "fifo", read=WindowRead(4, "head"), max_times_sampled=3, seed=7)
    b = make("prioritized", "fifo", read=WindowRead(4, "head"), max_times_sampled=3, seed=7)
    fill(a)
    fill(b)
    for _ in range(4):
        batch_a, info_a = a.sample_nowait(8)
        batch_b, info_b = b.sample_nowait(8, read=False)
        assert batch_b == {} and set(batch_a) == {"obs", "reward", "step", "mask"}
        for f in ("keys", "probabilities", "weights", "times_sampled"):
            assert torch.equal(getattr(info_a, f), getattr(info_b, f)), f
    assert state_equal(a.statistics(), b.statistics()) and len(a) == len(b) < 20  # items expired alike


def test_a_slot_drawn_several_times_in_one_sample_counts_every_draw():
    """Regression (issue 3): the compiled sample bookkeeping counts each draw (with replacement) and
    reports the count after the whole draw for every copy; keys come from slots across the ring wrap."""
    t = Table(Storage(SPECS, 4), sampler=Prioritized(alpha=1.0), remover=Fifo(), rate_limiter=MinSize(1))
    t.insert_nowait(steps(0, 3))
    t.insert_nowait(steps(3, 2))  # evicts episode 0: keys 3, 4 live in slots 3, 0
    t.update_priorities([3], [0.0])
    _, info = t.sample_nowait(6)
    assert info.keys.tolist() == [4] * 6 and info.times_sampled.tolist() == [6] * 6
    assert info.weights.tolist() == [1.0] * 6 and t.statistics().sampled == 6


def test_importance_weights_follow_per_maths():
    t = Table(Storage(SPECS, 8), sampler=Prioritized(alpha=1.0), remover=Fifo(), rate_limiter=MinSize(1), beta=0.5)
    t.insert_nowait(steps(0, 2), np.array([1.0, 4.0]))
    _, info = t.sample_nowait(200)
    p = info.probabilities.numpy()
    assert set(np.round(p, 6)) == {0.2, 0.8}
    expect = np.where(np.isclose(p, 0.8), (0.8 / 0.2) ** -0.5, 1.0)
    assert info.weights.numpy() == pytest.approx(expect.astype(np.float32))


def test_max_times_sampled_drops_items_after_that_many_samples():
    t = make("fifo", "fifo", max_times_sampled=2)
    keys = t.insert_nowait(steps(0, 3))
    t.sample_nowait(2)
    _, info = t.sample_nowait(2)
    assert info.times_sampled.tolist() == [2, 2]
    assert len(t) == 1 and t.statistics().expired == 2
    with pytest.raises(KeyError, match=rf"unknown key {int(keys[0])} "):
        t.update_priorities(keys[:1], [1.0])


def test_storage_eviction_removes_the_items_of_evicted_episodes():
    t = make(cap=10)
    t.insert_nowait(steps(0, 4))
    t.insert_nowait(steps(4, 4))
    t.insert_nowait(steps(8, 3))  # evicts episode 0 (steps 0..3) and its items
    assert len(t) == 7 and t.statistics().evicted == 4
    batch, info = t.sample_nowait(7)
    assert info.keys.tolist() == list(range(4, 11))
    with pytest.raises(KeyError, match=r"unknown key 0 in table 'table'"):
        t.delete([0])


def test_remover_bounds_items_while_steps_stay_for_windows():
    t = make("fifo", "fifo", max_size=3, read=WindowRead(3, "head"))
    t.insert_nowait(steps(0, 3), episode_end=False)
    t.insert_nowait(steps(3, 2))
    assert len(t) == 3 and t.statistics().removed == 2
    batch, info = t.sample_nowait(3)
    assert info.keys.tolist() == [2, 3, 4]
    assert batch["step"][0].tolist() == [0, 1, 2]  # removed items' steps are still read


def test_maxheap_remover_keeps_the_highest_priorities():
    t = make("fifo", "minheap", max_size=2)
    t.insert_nowait(steps(0, 2), np.array([5.0, 1.0]))
    t.insert_nowait(steps(2, 1), np.array([3.0]))
    _, info = t.sample_nowait(5)
    assert info.keys.tolist() == [0, 2]


def test_update_priorities_reorders_a_heap_sampler_and_last_duplicate_wins():
    t = make("maxheap", "fifo")
    t.insert_nowait(steps(0, 3), np.array([1.0, 2.0, 3.0]))
    t.update_priorities([0, 0], [9.0, 0.5])
    _, info = t.sample_nowait(1)
    assert info.keys.tolist() == [2]
    t.update_priorities(torch.tensor([0]), torch.tensor([10.0]))
    _, info = t.sample_nowait(1)
    assert info.keys.tolist() == [0]


def test_delete_drops_items_and_reset_empties_the_table_keeping_keys_unique():
    t = make()
    t.insert_nowait(steps(0, 4))
    t.delete([1, 2])
    assert len(t) == 2 and t.statistics().deleted == 2
    t.reset()
    assert len(t) == 0 and t.storage.num_steps == 0
    assert t.insert_nowait(steps(0, 1)).tolist() == [4]


def test_queue_and_stack_tables_sample_each_item_once_in_order():
    q = Table.queue(Storage(SPECS, 16), 3)
    s = Table.stack(Storage(SPECS, 16), 3)
    for tbl in (q, s):
        tbl.insert_nowait(steps(0, 3))
        with pytest.raises(WouldBlock, match=r"insert of 1 items would block under Queue|Stack"):
            tbl.insert_nowait(steps(3, 1))
    assert q.sample_nowait(2)[1].keys.tolist() == [0, 1]
    assert s.sample_nowait(2)[1].keys.tolist() == [2, 1]
    assert len(q) == 1 and len(s) == 1


def test_statistics_is_a_frozen_snapshot():
    t = make()
    t.insert_nowait(steps(0, 3))
    stats = t.statistics()
    with pytest.raises(AttributeError):
        stats.size = 0  # type: ignore[misc]
    assert (stats.size, stats.inserted, stats.num_steps, stats.num_episodes) == (3, 3, 3, 1)


def test_bad_construction_is_named():
    with pytest.raises(ValueError, match=r"^sampler and remover must be two selector instances"):
        f = Fifo()
        Table(Storage(SPECS, 4), sampler=f, remover=f, rate_limiter=MinSize(1))
    with pytest.raises(ValueError, match=r"^max_size must be an int in \[1, storage.capacity=4\], got 5$"):
        make(cap=4, max_size=5)
    with pytest.raises(ValueError, match=r"^TransitionRead names field 'rew'"):
        make(read=TransitionRead(reward_field="rew"))


# ---------------------------------------------------------------------------- bad input leaves the table as it was


BAD_KINDS = ["unknown-field", "missing-field", "shape", "dtype", "nan-priority", "masked-nan-priority", "negative-priority",
             "inf-priority", "unknown-key-update", "unknown-key-delete", "priorities-length", "sample-zero"]


def _bad(kind):
    def field_unknown(t):
        b = steps(100, 2)
        b["extra"] = torch.zeros(2)
        t.insert_nowait(b)

    def field_missing(t):
        b = steps(100, 2)
        del b["reward"]
        t.insert_nowait(b)

    def shape(t):
        b = steps(100, 2)
        b["obs"] = torch.zeros(2, 3)
        t.insert_nowait(b)

    def dtype(t):
        b = steps(100, 2)
        b["step"] = b["step"].int()
        t.insert_nowait(b)

    return {
        "unknown-field": (field_unknown, KeyError, r"unknown field\(s\) \['extra'\]"),
        "missing-field": (field_missing, KeyError, r"missing field\(s\) \['reward'\]"),
        "shape": (shape, ValueError, r"field 'obs' has shape \(2, 3\)"),
        "dtype": (dtype, TypeError, r"field 'step' has dtype torch.int32, expected torch.int64"),
        "nan-priority": (lambda t: t.insert_nowait(steps(100, 2), [1.0, float("nan")]), ValueError,
                         r"priority nan at position 1 is invalid"),
        # (with an item mask: priorities of steps that are no item are ignored, NaN or not; a bad one of an
        # item is named by its position among all the steps)
        "masked-nan-priority": (lambda t: t.insert_nowait(steps(100, 4), [float("nan"), 1.0, 2.0, -1.0],
                                                          item_mask=np.array([False, True, False, True])),
                                ValueError, r"priority -1.0 at position 3 is invalid"),
        "negative-priority": (lambda t: t.update_priorities([3, 4], [1.0, -2.0]), ValueError,
                              r"priority -2.0 at position 1 is invalid"),
        "inf-priority": (lambda t: t.update_priorities([3], [float("inf")]), ValueError,
                         r"priority inf at position 0 is invalid"),
        "unknown-key-update": (lambda t: t.update_priorities([3, 999], [1.0, 1.0]), KeyError, r"unknown key 999"),
        "unknown-key-delete": (lambda t: t.delete([2, -5]), KeyError, r"unknown key -5"),
        "priorities-length": (lambda t: t.update_priorities([3, 4], [1.0]), ValueError,
                              r"priorities must have shape \(2,\), got \(1,\)"),
        "sample-zero": (lambda t: t.sample_nowait(0), ValueError, r"sample size n must be an int >= 1, got 0"),
    }[kind]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("sampler", ["prioritized", "fifo"])
def test_bad_input_raises_a_named_error_and_leaves_the_table_unchanged(kind, sampler):
    t = make(sampler, "fifo")
    fill(t, 2, 4)
    before = t.state_dict()
    call, error, match = _bad(kind)
    with pytest.raises(error, match=match):
        call(t)
    assert state_equal(before, t.state_dict())


def test_sampling_an_empty_table_without_waiting_says_so_and_changes_nothing():
    t = make("prioritized", "fifo")
    before = t.state_dict()
    with pytest.raises(WouldBlock, match=r"^table 'table': sample of 2 items would block under MinSize\(min_size=1\): "
                       r"the table holds 0 items, fewer than min_size_to_sample=1"):
        t.sample_nowait(2)
    assert state_equal(before, t.state_dict())


# ---------------------------------------------------------------------------- matrix


@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("remover", list(SELECTORS))
@pytest.mark.parametrize("sampler", list(SELECTORS))
def test_matrix_read_kind_by_sampler_by_remover(read, sampler, remover):
    t = make(sampler, remover, cap=32, max_size=12, read=READS[read])
    fill(t, n_eps=9, length=5)  # 45 steps: evictions by storage, removals by the remover
    s = t.statistics()
    assert s.size == 12 and s.num_steps <= 32 and s.evicted + s.removed == 45 - 12
    batch, info = t.sample_nowait(6)
    keys = info.keys
    n = len(keys)
    assert n == 6
    if read == "step":
        assert batch["step"].tolist() == keys.tolist()
    elif read == "transition":
        assert batch["step"].tolist() == keys.tolist()
        assert batch["next_obs"].shape == (n, 2)
    elif read == "window":
        assert batch["step"].shape == (n, 4)
        assert batch["step"][:, -1].tolist() == keys.tolist()
        assert batch["mask"][:, -1].all()
    else:
        lens = batch["lengths"].tolist()
        assert lens == [5] * n
        starts = batch["step"].view(n, 5)[:, 0]
        assert ((keys - starts) < 5).all() and ((keys - starts) >= 0).all()
    # The round trip through state_dict gives the same next sample.
    u = make(sampler, remover, cap=32, max_size=12, read=READS[read])
    u.load_state_dict(t.state_dict())
    b1, i1 = t.sample_nowait(5)
    b2, i2 = u.sample_nowait(5)
    assert torch.equal(i1.keys, i2.keys) and torch.equal(i1.weights, i2.weights)
    assert all(torch.equal(b1[k], b2[k]) for k in b1)


# ---------------------------------------------------------------------------- model-based


ORDER = {
    "fifo": lambda items: sorted(items, key=lambda k: k),
    "lifo": lambda items: sorted(items, key=lambda k: -k),
    "maxheap": lambda items: sorted(items, key=lambda k: (-items[k][0], k)),
    "minheap": lambda items: sorted(items, key=lambda k: (items[k][0], k)),
}


class TableModel(RuleBasedStateMachine):
    """A Table with deterministic selectors against a dict of items and a list of episodes."""

    CAP, MAX_SIZE, MAX_TIMES = 16, 10, 3

    def __init__(self) -> None:
        super().__init__()
        self.kind: str | None = None
        self.t: Table | None = None

    def _init(self, kind: str) -> None:
        self.kind = kind
        self.t = Table(Storage([FieldSpec("step", (), torch.int64)], self.CAP), sampler=SELECTORS[kind](),
                       remover=Fifo(), rate_limiter=MinSize(1), max_size=self.MAX_SIZE,
                       max_times_sampled=self.MAX_TIMES)
        self.items: dict[int, list] = {}  # key -> [priority, times]
        self.episodes: list[list[int]] = []
        self.next = 0

    @precondition(lambda self: self.t is None)
    @rule(kind=st.sampled_from(sorted(ORDER)))
    def start(self, kind):
        self._init(kind)

    @precondition(lambda self: self.t is not None)
    @rule(n=st.integers(1, 5), prios=st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.5]), min_size=5, max_size=5))
    def insert(self, n, prios):
        vals = list(range(self.next, self.next + n))
        keys = self.t.insert_nowait({"step": torch.tensor(vals)}, prios[:n]).tolist()
        assert keys == vals
        self.next += n
        # storage: evict whole oldest episodes
        while sum(len(e) for e in self.episodes) + n > self.CAP:
            for k in self.episodes.pop(0):
                self.items.pop(k, None)
        self.episodes.append(vals)
        # remover (Fifo): oldest items beyond max_size
        for k in sorted(self.items)[: max(0, len(self.items) + n - self.MAX_SIZE)]:
            del self.items[k]
        for k, p in zip(vals, prios):
            self.items[k] = [p, 0]

    @precondition(lambda self: self.t is not None and self.items)
    @rule(n=st.integers(1, 6))
    def sample(self, n):
        batch, info = self.t.sample_nowait(n)
        want = ORDER[self.kind](self.items)[:n]
        assert info.keys.tolist() == want
        assert batch["step"].tolist() == want
        for k in want:
            self.items[k][1] += 1
        assert info.times_sampled.tolist() == [self.items[k][1] for k in want]
        for k in want:
            if self.items[k][1] >= self.MAX_TIMES:
                del self.items[k]

    @precondition(lambda self: self.t is not None and self.items)
    @rule(data=st.data(), p=st.sampled_from([0.0, 0.5, 2.0, 7.0]))
    def update(self, data, p):
        k = data.draw(st.sampled_from(sorted(self.items)))
        self.t.update_priorities([k], [p])
        self.items[k][0] = p

    @precondition(lambda self: self.t is not None and self.items)
    @rule(data=st.data())
    def delete(self, data):
        k = data.draw(st.sampled_from(sorted(self.items)))
        self.t.delete([k])
        del self.items[k]

    @precondition(lambda self: self.t is not None)
    @rule()
    def unknown_key_is_refused(self):
        before = self.t.state_dict()
        with pytest.raises(KeyError):
            self.t.update_priorities([self.next + 100], [1.0])
        assert state_equal(before, self.t.state_dict())

    @precondition(lambda self: self.t is not None)
    @rule()
    def reset(self):
        self.t.reset()
        self.items.clear()
        self.episodes.clear()

    @invariant()
    def sizes_match(self):
        if self.t is not None:
            assert len(self.t) == len(self.items)
            assert self.t.storage.num_steps == sum(len(e) for e in self.episodes)


TestTableModel = TableModel.TestCase
TestTableModel.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_threads_inserting_sampling_and_updating_keep_the_table_consistent():
    import threading

    t = make("prioritized", "fifo", cap=256, max_size=100)
    fill(t, 2, 5)
    errors: list[BaseException] = []

    def insert(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for i in range(150):
                t.insert_nowait(steps(10_000 * seed + 5 * i, 5), rng.uniform(0.1, 2.0, 5))
        except BaseException as e:  # reported below
            errors.append(e)

    def sample_and_update(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(150):
                with t._lock:  # sample + update as one learner step (keys may be evicted in between otherwise)
                    _, info = t.sample_nowait(8)
                    t.update_priorities(info.keys, rng.uniform(0.1, 2.0, len(info.keys)))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=f, args=(i,)) for i, f in enumerate([insert, insert, sample_and_update])]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    s = t.statistics()
    assert s.size == 100 == int((t._keys >= 0).sum())
    assert s.inserted - s.evicted - s.removed - s.expired - s.deleted == s.size
    u = make("prioritized", "fifo", cap=256, max_size=100)
    u.load_state_dict(t.state_dict())
    assert torch.equal(t.sample_nowait(16)[1].keys, u.sample_nowait(16)[1].keys)


# ---------------------------------------------------------------------------- one-call windows


@pytest.mark.parametrize(("arity", "pad", "beta", "max_times"), [(8, "tail", 0.4, 0), (8, "head", 0.0, 3),
                                                                  (3, "head", 0.7, 0), (3, "tail", 0.4, 2)])
def test_one_call_window_sample_equals_the_three_call_path(arity, pad, beta, max_times):
    """Prioritized windows from host memory are drawn, counted and copied in one compiled call
    (``_nb_sample_windows``). It must give what select + bookkeeping + read_windows give: the same
    batches and infos, sample after sample, across updates, expiry and eviction (ring of 64)."""
    def build(one_call: bool) -> Table:
        t = Table(Storage(SPECS, 64), sampler=Prioritized(0.6, arity=arity), remover=Fifo(), rate_limiter=MinSize(1),
                  read=WindowRead(5, pad), beta=beta, max_times_sampled=max_times, seed=11)
        assert t._one_call_windows
        t._one_call_windows = one_call
        return t

    fast, slow = build(True), build(False)
    rng = np.random.default_rng(3)
    for rnd in range(30):
        n_new = int(rng.integers(1, 9))
        for t in (fast, slow):
            start = t.storage.step_range[1]
            t.insert_nowait(steps(start, n_new), np.random.default_rng(rnd).uniform(0.0, 2.0, n_new),
                            episode_end=bool(rnd % 3 == 0))
        n = int(rng.integers(1, 40))
        (b1, i1), (b2, i2) = fast.sample_nowait(n), slow.sample_nowait(n)
        assert state_equal(b1, b2) and set(b1) == {"obs", "reward", "step", "mask"}
        for f in ("keys", "probabilities", "weights", "times_sampled"):
            assert torch.equal(getattr(i1, f), getattr(i2, f)), f
        assert i1.table_size == i2.table_size
        if rnd % 4 == 1 and len(fast) > 0:
            keys = i1.keys[: n // 2].unique()
            live = keys[torch.from_numpy(np.isin(keys.numpy(), fast.state_dict()["keys"]))] if max_times else keys
            p = np.random.default_rng(rnd).uniform(0.1, 3.0, len(live))
            fast.update_priorities(live, p)
            slow.update_priorities(live, p)
    assert fast.statistics() == slow.statistics()
    assert state_equal(fast.state_dict(), slow.state_dict())


def test_one_call_window_sample_only_for_prioritized_host_windows_and_zero_priorities_raise_alike():
    assert not make("uniform", read=WindowRead(4))._one_call_windows
    assert not make("prioritized", read=StepRead())._one_call_windows
    t = make("prioritized", read=WindowRead(4))
    assert t._one_call_windows
    t.insert_nowait(steps(0, 4), np.zeros(4))  # items whose priorities are all 0 cannot be drawn
    with pytest.raises(ValueError, match=r"every priority is 0"):
        t.sample_nowait(2)
    assert t.statistics().sampled == 0


_ONE_CALL_PROBE = """
import numpy as np, torch
from reactor.replay import Fifo, FieldSpec, MinSize, Prioritized, Storage, Table, WindowRead
t = Table(Storage([FieldSpec("x", (), torch.float32)], 64), sampler=Prioritized(0.6), remover=Fifo(),
          rate_limiter=MinSize(1), read=WindowRead(4), seed=1)
t.insert_nowait({"x": torch.arange(40, dtype=torch.float32)}, np.ones(40), episode_end=True)
a = t.sample_nowait(8)[0]["mask"]
u = Table(Storage([FieldSpec("x", (), torch.float32)], 64), sampler=Prioritized(0.6), remover=Fifo(),
          rate_limiter=MinSize(1), read=WindowRead(4), seed=1)
u.insert_nowait({"x": torch.arange(40, dtype=torch.float32)}, np.ones(40), episode_end=True)
u._one_call_windows = False
b = u.sample_nowait(8)[0]["mask"]
print(int(a.sum()), int(b.sum()))
"""


_ONE_KERNEL_INSERT_PROBE = """
from reactor.replay import StepRead
from reactor.replay._tablekernels import _nb_insert_host
got = []
for one_kernel in (True, False):
    t = Table(Storage([FieldSpec("x", (), torch.float32)], 64), sampler=Prioritized(0.6), remover=Fifo(),
              rate_limiter=MinSize(1), read=StepRead())
    t._host_insert = one_kernel
    t.insert_nowait({"x": torch.arange(1, 41, dtype=torch.float32)}, np.ones(40))
    got.append(int(t.storage.read_steps(np.arange(40))["x"].sum()))
print(*got, len(_nb_insert_host.signatures))
"""


def test_the_kernels_compiled_in_from_the_storage_kernels_follow_an_edit_of_them(tmp_path: Path):
    """Regression (issue 3, review; then the one-kernel insert): the one-call sample compiles in the storage's
    kernels (_storagekernels.py) and sumtree.py's, the one-kernel insert (``_nb_insert_host``) the storage's
    append (``_nb_append``), and numba's disk cache only notices edits to the cached function's own file. A
    cached one-call kernel kept running the old window copy after the storage's kernels changed, and a
    cached insert would have kept the old append (``drop_stale_cache``). Edit a copy of the package between
    two processes and check that every path sees both edits.

    The copy takes the package's caches along (``copytree`` keeps the files' times, which numba's index
    checks): the first process then loads every cached kernel, as a user's does, and only the kernels
    the edits touch compile in the second (one process for both kernels: each compile is seconds here).
    A kernel cached on disk would be loaded stale in the second process, and caught."""
    pkg = tmp_path / "reactor"
    shutil.copytree(Path(__file__).resolve().parents[2] / "reactor", pkg)

    def run() -> list[int]:
        out = subprocess.run([sys.executable, "-c", _ONE_CALL_PROBE + _ONE_KERNEL_INSERT_PROBE], cwd=tmp_path,
                             capture_output=True, text=True, timeout=240,
                             env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr
        return [int(v) for v in out.stdout.split()]

    first = run()
    assert first[0] == first[1] > 0 and first[2:] == [820, 820, 1]  # valid window positions; rows; the one kernel ran
    storage_py = pkg / "replay" / "_storagekernels.py"
    src = storage_py.read_text()
    for old, new in (("mask[j, t] = a <= t < z", "mask[j, t] = False"),
                     ("copy_bytes(dst[f] + pos0 * nb, s, n1 * nb)", "copy_bytes(dst[f] + pos0 * nb, s, 0)")):
        assert old in src
        src = src.replace(old, new)
    storage_py.write_text(src)
    assert run() == [0, 0, 0, 0, 1]  # both sample paths mask every window, both insert paths copy no row


class _PrioritizedDeleteFirst(Prioritized):
    """Prioritized without the fast insert paths: the table deletes every evicted slot first."""

    replaces_on_insert = False


def _three_insert_paths(cap: int, max_times_sampled: int = 0) -> list[Table]:
    """Tables that differ only in their insert path: the one-kernel host insert (``_nb_insert_host``),
    the storage's append then ``_apply_insert_fast``, and the general path (every evicted slot deleted
    first)."""
    tables = [Table(Storage(SPECS, cap), sampler=sel, remover=Fifo(), rate_limiter=MinSize(1), seed=3,
                    max_times_sampled=max_times_sampled, read=StepRead())
              for sel in (Prioritized(0.6), Prioritized(0.6), _PrioritizedDeleteFirst(0.6))]
    assert tables[0]._host_insert and not tables[2]._host_insert
    tables[1]._host_insert = False
    return tables


def _assert_same_tables(tables: list[Table]) -> None:
    # (first, as a read flushes it: the bound of the tree's total, which an insert the one kernel
    # declined must not raise twice)
    assert len({t._sampler._tree._bound for t in tables}) == 1
    for t in tables[1:]:
        assert len(t) == len(tables[0])
        assert t.statistics() == tables[0].statistics()
        np.testing.assert_array_equal(t._keys, tables[0]._keys)
        np.testing.assert_array_equal(t._times, tables[0]._times)
        _assert_same_state(t.storage.state_dict(), tables[0].storage.state_dict(), "storage")
        _assert_same_state(t.state_dict()["sampler"], tables[0].state_dict()["sampler"], "sampler")


def _assert_same_state(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert np.array_equal(np.asarray(a), np.asarray(b)), where


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("max_times_sampled", [0, 3])
def test_the_fast_insert_paths_leave_the_state_the_general_path_leaves(max_times_sampled, masked):
    """Regression (issue 21): an insert whose evictions drop items and whose steps overwrite their slots
    skips the sampler's delete of those slots (Prioritized replaces on insert) and keys the columns in one
    compiled pass; with host storage and contiguous sources, the append and all of that are one kernel
    (``_nb_insert_host``). Inserts of 1-200 steps with episodes of 1 to 700 steps (open ones too) into a
    small ring, samples (expiring items at max_times_sampled) and priority updates between them: the three
    tables hold the same rows, items, priorities, counters and statistics, and draw the same samples.
    ``masked``: items on some steps only (``item_mask``, as a writer's window pattern sends), so an evicted
    item's slot may take a step that is no item (it must be deleted) and an item's slot may have held none.
    Some inserts come from strided sources (a transposed view: the one kernel declines them, the append
    copies them field by field)."""
    rng = np.random.default_rng(7)
    tables = _three_insert_paths(512, max_times_sampled)
    took = _count_one_kernel_inserts(tables[0])
    step = open_len = 0
    for i in range(400):
        n = int(rng.integers(1, 200))  # with at most 256 steps left open: an episode fits the 512-step ring
        ep = int(rng.choice([1, 7, 64, 300, 700]))
        ends = (np.arange(step, step + n) + 1) % ep == 0
        obs = torch.from_numpy(rng.standard_normal((n, 2)).astype(np.float32))
        if i % 5 == 4:
            obs = torch.from_numpy(rng.standard_normal((2, n)).astype(np.float32)).T
        steps = {"obs": obs, "reward": torch.from_numpy(rng.standard_normal(n).astype(np.float32)),
                 "step": torch.arange(step, step + n)}
        prio = rng.random(n) + 0.01
        tail = n - 1 - int(np.flatnonzero(ends)[-1]) if ends.any() else n + open_len  # the episode left open
        if tail > 256:  # an open episode must fit the ring: end it here
            ends[-1], tail = True, 0
        open_len = tail
        mask = rng.random(n) < 0.6 if masked else None
        keys = [t.insert_nowait(steps, prio, episode_end=ends, item_mask=mask) for t in tables]
        for k in keys[1:]:
            torch.testing.assert_close(k, keys[0], rtol=0, atol=0)
        step += n
        if len(tables[0]) and rng.random() < 0.5:
            got = [t.sample_nowait(32)[1] for t in tables]
            for g in got[1:]:
                np.testing.assert_array_equal(np.asarray(g.keys), np.asarray(got[0].keys))
                np.testing.assert_array_equal(np.asarray(g.probabilities), np.asarray(got[0].probabilities))
            sampled = np.asarray(got[0].keys)
            live = np.unique(sampled[np.isin(sampled, tables[0]._keys)])
            if live.size:
                upd = rng.random(live.size) + 0.01
                for t in tables:
                    t.update_priorities(live, upd)
        assert len(tables[0]) == len(tables[1]) == len(tables[2])
        assert tables[0].statistics() == tables[1].statistics() == tables[2].statistics()
    _assert_same_tables(tables)
    assert took == [320, 80]  # (the one kernel took every insert but the strided ones)


def _count_one_kernel_inserts(table: Table) -> list[int]:
    """How many of ``table``'s inserts the one kernel took, and how many it declined (updated in place)."""
    took, one = [0, 0], table._apply_insert_host

    def counted(*args: Any) -> Any:
        keys = one(*args)
        took[keys is None] += 1
        return keys

    table._apply_insert_host = counted  # type: ignore[method-assign]
    return took


def test_the_one_kernel_insert_fills_the_trees_buffer_and_declines_what_it_cannot_take():
    """The one-kernel insert writes the sampler's lazy writes straight into the sum tree's buffer: many
    inserts with no sample between fill it past its size (``STAGE``: it must be applied first, not
    overrun), one insert larger than it goes the general way, and a source that is a view of the table's
    own ring (overlapping memory: no byte copy) is declined with nothing changed. After each, the same
    state as the other two paths, and the tree equal to one rebuilt from its leaves."""
    from reactor.replay.sumtree import STAGE

    tables = _three_insert_paths(1 << 14)
    step = 0
    for n in [100] * 200 + [STAGE + 100, 7, 300]:  # 20,000 lazy writes, then one batch over the buffer's size
        for t in tables:
            t.insert_nowait(steps(step, n), np.linspace(0.1, 2.0, n), episode_end=True)
        step += n
        assert tables[0]._sampler.tree._staged <= STAGE
    _assert_same_tables(tables)
    for t in tables:  # from a view of the ring's own rows (the storage's field tensors)
        ring = t.storage._fields
        src = {k: ring[k][10:60] for k in ("obs", "reward", "step")}
        t.insert_nowait(src, np.full(50, 0.5), episode_end=True)
    _assert_same_tables(tables)
    for t in tables:
        t._sampler.tree.flush()
        t._sampler.tree.check_invariants()
    got = [t.sample_nowait(64)[1] for t in tables]
    for g in got[1:]:
        np.testing.assert_array_equal(np.asarray(g.keys), np.asarray(got[0].keys))


@pytest.mark.parametrize("one_kernel", [True, False])
def test_an_insert_that_waited_copies_its_sources_as_they_are_when_it_goes_in(one_kernel):
    """An insert the rate limiter held back copies its tensors' rows when it goes in: a source given
    new memory meanwhile (``set_``) is read from there, not from the address the first validation took
    (the one kernel copies by address; the old memory may be freed by then), one whose shape changed
    meanwhile is refused, nothing changed, and an ``item_mask`` changed meanwhile is read as it is."""

    async def main() -> None:
        t = Table(Storage(SPECS, 64), sampler=Prioritized(0.6), remover=Fifo(),
                  rate_limiter=SampleToInsertRatio(2.0, 1, 2.0), read=StepRead())
        t._host_insert = one_kernel
        t.insert_nowait(steps(0, 1))
        t.insert_nowait(steps(1, 1))  # the next insert waits for samples
        base = torch.full((2, 2), -1.0)  # (kept: the memory the first validation saw stays readable)
        src = {"obs": base.view(2, 2), "reward": torch.zeros(2), "step": torch.arange(2, 4)}
        ins = asyncio.ensure_future(t.insert(src, np.ones(2)))
        for _ in range(100):
            await asyncio.sleep(0)
        assert not ins.done()
        src["obs"].set_(torch.full((2, 2), 7.0))  # new memory, same shape
        t.sample_nowait(4)
        assert (await asyncio.wait_for(ins, 10)).tolist() == [2, 3]
        assert t.storage.read_steps(np.array([2, 3]))["obs"].eq(7.0).all()

        grown = torch.zeros(2, 2)  # (the limiter holds this one back too)
        ins = asyncio.ensure_future(t.insert({"obs": grown, "reward": torch.zeros(2), "step": torch.arange(4, 6)}))
        for _ in range(100):
            await asyncio.sleep(0)
        assert not ins.done()
        grown.resize_(3, 2)
        before = t.storage.step_range
        t.sample_nowait(4)
        with pytest.raises(ValueError, match="field 'reward' has 2 steps but field 'obs' has 3"):
            await asyncio.wait_for(ins, 10)
        assert t.storage.step_range == before

        t.insert_nowait(steps(4, 2))
        mask = np.array([True, False])
        ins = asyncio.ensure_future(t.insert(steps(6, 2), item_mask=mask))
        for _ in range(100):
            await asyncio.sleep(0)
        assert not ins.done()
        mask[1] = True  # two items now: keyed as two (the kernels write as many as the mask says)
        t.sample_nowait(4)
        assert (await asyncio.wait_for(ins, 10)).tolist() == [6, 7]
        assert len(t) == 8

    asyncio.run(main())


def test_a_prioritized_remover_with_no_mass_left_removes_the_oldest_zero_priority_items():
    """Every priority 0 (or nearly all the mass on fewer items than must go): the remover raised after
    the insert's steps were stored, so each retry added rows and evicted older ones (a hostile probe,
    session 55). It now takes the rest from the other live items, oldest first."""
    t = make("uniform", "prioritized", cap=32, max_size=4)
    t.insert_nowait(steps(0, 4), np.zeros(4))
    keys = t.insert_nowait(steps(4, 1), [0.0])
    assert len(t) == 4 and sorted(t.state_dict()["keys"][t.state_dict()["keys"] >= 0]) == [1, 2, 3, 4]
    assert keys.tolist() == [4]
    t = make("uniform", "prioritized", cap=32, max_size=4)
    t.insert_nowait(steps(0, 4), [0.0, 0.0, 0.0, 1.0])
    t.insert_nowait(steps(4, 2), [1.0, 1.0])
    live = sorted(int(k) for k in t.state_dict()["keys"] if k >= 0)
    assert len(live) == 4 and {4, 5} <= set(live) and 3 not in live  # the massive one first, then the oldest


def test_draws_noted_from_elsewhere_expire_items_at_max_times_sampled_and_checkpoints_stay_loadable(tmp_path):
    """A peer's SampledKeys counted an item past max_times_sampled without expiring it, and every later
    checkpoint was refused on load (times_sampled out of range): a restore lost the acknowledged inserts
    (a hostile probe, session 55)."""
    t = make("uniform", "fifo", cap=16, max_times_sampled=2)
    t.insert_nowait(steps(0, 4), np.ones(4))
    assert t.note_sampled(np.array([1, 1, 1, 1, 1, 2])) == 6
    assert len(t) == 3 and t.statistics().expired == 1 and 1 not in t.state_dict()["keys"].tolist()
    t.save(tmp_path)
    assert len(Table.load(tmp_path)) == 3


def test_an_n_step_read_longer_than_the_ring_is_refused_and_its_return_counts_in_a_batchs_memory():
    """TransitionRead(n=10**7) on a 16-step table took 570 MB and 2.6 s for a sample of 2, and the
    sample-size check counted 57 bytes an item whatever n (a hostile probe, session 55)."""
    with pytest.raises(ValueError, match=r"^TransitionRead n=65 is more than the storage's capacity 64: .*use n <= 64"):
        make(cap=64, read=TransitionRead(n=65))
    small, large = make(cap=1 << 16, read=TransitionRead(n=1)), make(cap=1 << 16, read=TransitionRead(n=1 << 16))
    assert large._item_nbytes - small._item_nbytes >= ((1 << 16) - 1) * 16


def test_out_of_range_capacity_seed_keys_and_complex_priorities_are_named():
    """Each gave an error that named nothing (OverflowError, "expected non-negative integer"), a key
    wrapped to -1, or a complex priority cut to its real part with a warning (a hostile probe, session 55)."""
    with pytest.raises(ValueError, match=r"^Storage capacity must be an int in \[1, 2\*\*40\] \(steps\), got 4611"):
        Storage(SPECS, 2**62)
    with pytest.raises(ValueError, match=r"^seed must be an int in \[0, 2\*\*64\), got -1$"):
        make(seed=-1)
    t = make("prioritized", cap=16)
    t.insert_nowait(steps(0, 2), np.ones(2))
    with pytest.raises(ValueError, match=r"^keys: 18446744073709551615 is past the largest key"):
        t.update_priorities(np.array([2**64 - 1], dtype=np.uint64), [1.0])
    for call in (lambda: t.update_priorities(np.array([0]), np.array([1 + 2j])),
                 lambda: t.insert_nowait(steps(2, 1), np.array([1j]))):
        with pytest.raises(TypeError, match=r"^priorities must be real numbers, got complex ones$"):
            call()
    assert len(t) == 2


def test_a_table_that_cannot_fit_in_this_hosts_memory_once_full_is_refused_before_its_trees_are_written():
    """`--set capacity=1000000000` (a zero too many) was ended by the OOM killer after ~20 GB of sum trees,
    with no word (exit 137; the OOM killer picks the largest process, which may not be the run's). The
    capacity is twice what fits in the memory available now; its rows' ring is allocated lazily, so only the
    refusal costs anything."""
    from reactor._hostmemory import available_host_bytes

    avail = available_host_bytes()
    assert avail is not None and avail > 0  # (Linux: /proc/meminfo)
    capacity = 2 * avail // 84 + 1
    storage = Storage([FieldSpec("x", (), torch.float32)], capacity)
    with pytest.raises(ValueError, match=rf"^a replay table of capacity {capacity:,} steps needs about [0-9.]+ GiB once "
                                         r"full \(4 B a step of rows and ~80 B a slot of sampling state\), and this "
                                         r"host has [0-9.]+ GiB available .*: lower the capacity"):
        Table(storage, sampler=Prioritized(0.6), remover=Fifo(), rate_limiter=MinSize(1))


def _big_table(share: float, name: str) -> Table:
    """A table whose rows are ``share`` of the host's available memory once full: two steps of one wide
    field (its ring is mapped, never touched here)."""
    from reactor._hostmemory import available_host_bytes

    width = int(share * available_host_bytes()) // 2
    return Table(Storage([FieldSpec("x", (width,), torch.uint8)], 2), sampler=Prioritized(0.6), remover=Fifo(),
                 rate_limiter=MinSize(1), name=name)


def test_tables_of_one_process_that_fit_alone_but_not_together_are_refused_at_the_one_that_does_not_fit():
    """Regression (h3): the check was per table, against the memory available when each was made; a
    table's rows are filled lazily, so two tables of 60% of it each both passed, to meet the OOM killer
    once filled. A table must fit beside what the process's other live tables may still fill."""
    import gc

    first = _big_table(0.6, "first")
    with pytest.raises(ValueError, match=r"^a replay table of capacity 2 steps needs about [0-9.]+ GiB once full \(\d+ B a "
                                         r"step of rows and ~80 B a slot of sampling state\), and the \d+ other replay "
                                         r"table\(s\) of this process may still fill [0-9.]+ GiB of the [0-9.]+ GiB this "
                                         r"host has available .*: lower the capacity, or drop a table first$"):
        _big_table(0.6, "second")
    del first
    gc.collect()
    assert len(_big_table(0.6, "third")) == 0  # the first's claim went with it


def test_replay_tables_of_one_run_on_a_host_are_counted_together_across_processes(monkeypatch, tmp_path):
    """Regression (h3): each replay shard of a run checked its own table against the host's available
    memory, in its own process; every shard of a host fitted alone, and all of them did not. Claims in a
    run's ledger (a file of the host's, under an exclusive flock) are counted together: a shard's process
    holds 60% of the memory, and another's 60% is refused; another run's is not; once the first process is
    gone (SIGKILL: no cleanup), another run's claim removes its ledger, and a ledger's file goes with its
    last claim."""
    import multiprocessing
    import os
    import signal

    from reactor._hostmemory import available_host_bytes
    from reactor.replay._hostmem import ledger_dir
    from reactor.replay.table import claim_fits

    monkeypatch.setenv("REACTOR_RUNTIME_DIR", str(tmp_path))
    run = f"h3-test-{os.getpid()}"
    step = int(0.6 * available_host_bytes()) // 1000

    def hold(ready) -> None:  # (a shard's process: claims, says so, and waits to be killed)
        claim_fits(None, 1000, ledger=run, step_nbytes=step)
        ready.send(True)
        signal.pause()

    here, there = multiprocessing.get_context("fork").Pipe()
    shard = multiprocessing.get_context("fork").Process(target=hold, args=(there,), daemon=True)
    shard.start()
    try:
        assert here.poll(30) and here.recv()
        with pytest.raises(ValueError, match=rf"^a replay table of capacity 1,000 steps needs about [0-9.]+ GiB once "
                                             rf"full .*, and with the 1 other replay table\(s\) of run {run} on this host "
                                             rf"that is [0-9.]+ GiB in all once they are full, more than the [0-9.]+ GiB "
                                             rf"this host had available when the first was made .*: lower the capacity, "
                                             rf"or spread the shards over more hosts$"):
            claim_fits(None, 1000, ledger=run, step_nbytes=step)
        claim_fits(None, 1000, ledger=run + "-other", step_nbytes=step).release()
    finally:
        os.kill(shard.pid, signal.SIGKILL)
        shard.join(30)
    other = claim_fits(None, 1000, ledger=run + "-other", step_nbytes=step)
    assert not (ledger_dir() / f"{run}.json").exists()  # another run's claim swept the file: its process died
    claim = claim_fits(None, 1000, ledger=run, step_nbytes=step)
    assert (ledger_dir() / f"{run}.json").exists()
    claim.release()
    other.release()
    assert not list(ledger_dir().iterdir())
