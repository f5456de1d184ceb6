"""SumTree: batched writes, lazy writing, stratified sampling, numerics, errors, threads (issue 3)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from reactor.replay.sumtree import STAGE, SumTree

BACKENDS = ["numba", "torch"]

# Chi-square critical values at significance 0.001 (upper tail), from the standard table
# (NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4): df -> critical value.
CHI2_CRIT_0_001 = {7: 24.322, 9: 27.877}


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def as_np(x: object) -> np.ndarray:
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def drift_bound(tree: SumTree, exact: float) -> float:
    return tree.depth * (tree.arity - 1) * 2.0**-52 * exact + 1e-300


# ------------------------------------------------------------------------------------------ basics


@pytest.mark.parametrize("backend", BACKENDS)
def test_total_min_and_get_reflect_written_leaves(backend: str) -> None:
    tree = SumTree(10, 3, backend=backend)
    tree.update(np.array([0, 4, 9]), np.array([2.0, 0.5, 1.5]))
    assert tree.total == 4.0
    assert tree.min == 0.5
    np.testing.assert_array_equal(as_np(tree.get(np.array([9, 1, 4]))), [1.5, 0.0, 0.5])


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_ignores_zero_leaves_and_is_inf_when_nothing_is_positive(backend: str) -> None:
    tree = SumTree(5, 2, backend=backend)
    assert tree.min == math.inf
    tree.update(np.array([1, 2]), np.array([0.0, 3.0]))
    assert tree.min == 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_duplicate_indices_in_one_batch_last_write_wins(backend: str) -> None:
    tree = SumTree(8, 2, backend=backend)
    tree.update(np.array([3, 5, 3, 3, 5]), np.array([1.0, 2.0, 7.0, 4.0, 0.25]))
    np.testing.assert_array_equal(as_np(tree.get(np.array([3, 5]))), [4.0, 0.25])
    assert tree.total == 4.25
    tree.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_lazy_batches_apply_in_call_order_before_the_next_read(backend: str) -> None:
    tree = SumTree(8, 4, backend=backend)
    tree.update(np.array([1, 2]), np.array([1.0, 2.0]), lazy=True)
    tree.update(np.array([2, 6]), np.array([5.0, 1.0]), lazy=True)
    assert tree.total == 7.0
    # An eager write after a lazy one to the same index is later, so it wins.
    tree.update(np.array([6]), np.array([9.0]), lazy=True)
    tree.update(np.array([6]), np.array([3.0]))
    np.testing.assert_array_equal(as_np(tree.get(np.array([1, 2, 6]))), [1.0, 5.0, 3.0])


def test_lazy_batch_is_copied_so_caller_may_reuse_its_arrays() -> None:
    tree = SumTree(4, 2)
    idx, prio = np.array([0, 1]), np.array([1.0, 2.0])
    tree.update(idx, prio, lazy=True)
    idx[:] = 3
    prio[:] = 100.0
    assert tree.total == 3.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_lazy_batches_past_the_buffers_bound_give_the_tree_eager_writes_give(backend: str) -> None:
    """Lazy batches that overfill the bounded buffer (STAGE writes) apply what waits early; one
    larger than the buffer is applied at once. Neither changes a leaf, a node or the order in
    which repeated indices win."""
    rng = np.random.default_rng(11)
    cap = 3 * STAGE
    lazy, eager = SumTree(cap, 8, backend=backend), SumTree(cap, 8, backend=backend)
    sizes = [256] * (STAGE // 256 - 1) + [300, 5, STAGE + 7, 1, 0, 2 * STAGE, 64]
    for m in sizes:
        idx = rng.integers(0, cap // 2, m)  # repeats within and across batches: the last write wins
        prio = rng.random(m)
        lazy.update(idx, prio, lazy=True)
        eager.update(idx, prio)
    np.testing.assert_array_equal(as_np(lazy.get(np.arange(cap))), as_np(eager.get(np.arange(cap))))
    assert lazy.total == eager.total and lazy.min == eager.min
    lazy.check_invariants()


def test_an_insert_only_tree_holds_a_bounded_buffer() -> None:
    """A tree nobody reads (a table only inserted into) keeps at most STAGE buffered writes: 2,000
    lazy batches of 256 add no memory that grows with their number (they kept 8 MB before)."""
    import tracemalloc

    tree = SumTree(1 << 16, 16)
    prio = np.ones(256)
    tree.update(np.arange(256), prio, lazy=True)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(2000):
            tree.update(np.arange(256) + (k * 256) % (1 << 16), prio * (k % 7 + 1), lazy=True)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"{grown} bytes kept by 2,000 lazy batches"
    assert tree.total == float(sum(k % 7 + 1 for k in range(2000 - 256, 2000)) * 256)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_past_the_float64_total_is_refused_after_the_buffer_applied_early(backend: str) -> None:
    """The overflow check stays exact when a full buffer is applied in the middle of lazy writes: the
    bound it keeps still counts every buffered priority."""
    tree = SumTree(2 * STAGE, 8, backend=backend)
    tree.update(np.arange(STAGE - 10), np.zeros(STAGE - 10), lazy=True)  # nearly fills the buffer
    tree.update(np.arange(100) + STAGE, np.full(100, 1e306), lazy=True)  # overfills it: applied early
    with pytest.raises(ValueError, match="overflow"):
        tree.update(np.arange(80) + STAGE + 200, np.full(80, 1e306), lazy=True)
    assert tree.total == pytest.approx(1e308, rel=1e-12)
    np.testing.assert_array_equal(as_np(tree.get(np.arange(80) + STAGE + 200)), np.zeros(80))


@pytest.mark.parametrize("backend", BACKENDS)
def test_capacity_one_tree_samples_its_only_leaf(backend: str) -> None:
    tree = SumTree(1, backend=backend)
    tree.update(np.array([0]), np.array([2.0]))
    idx, prob = tree.sample(3, np.random.default_rng(0))
    np.testing.assert_array_equal(as_np(idx), [0, 0, 0])
    np.testing.assert_array_equal(as_np(prob), [1.0, 1.0, 1.0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_never_draws_zero_priority_leaves_and_reports_p_over_total(backend: str) -> None:
    rng = np.random.default_rng(1)
    tree = SumTree(1000, 16, backend=backend)
    prio = rng.random(1000) * (rng.random(1000) < 0.3)
    tree.update(np.arange(1000), prio)
    idx, prob = tree.sample(5000, rng)
    idx, prob = as_np(idx), as_np(prob)
    assert (prio[idx] > 0).all()
    np.testing.assert_allclose(prob, prio[idx] / prio.sum(), rtol=1e-12)
    assert (np.diff(idx) >= 0).all(), "stratified draws come out in leaf order"


def test_numba_and_torch_backends_draw_the_same_indices_from_the_same_rng() -> None:
    rng = np.random.default_rng(2)
    prio = rng.random(5000)
    trees = [SumTree(5000, 8, backend=b) for b in BACKENDS]
    for t in trees:
        t.update(np.arange(5000), prio)
    a, b = (as_np(t.sample(2048, np.random.default_rng(3))[0]) for t in trees)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arity", [3, 8])
def test_numba_and_torch_backends_agree_for_the_unrolled_and_the_generic_descent(arity: int) -> None:
    """Arity 8 runs the unrolled scan, others the generic one; both match the torch arithmetic,
    zero leaves included."""
    rng = np.random.default_rng(5)
    prio = rng.random(3000) * (rng.random(3000) < 0.5)
    trees = [SumTree(3000, arity, backend=b) for b in BACKENDS]
    for t in trees:
        t.update(np.arange(3000), prio)
    for stratified in (True, False):
        a, b = (as_np(t.sample(4096, np.random.default_rng(6), stratified=stratified)[0]) for t in trees)
        np.testing.assert_array_equal(a, b)
        assert (prio[a] > 0).all()


@pytest.mark.parametrize("arity", [3, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_rounded_past_a_block_takes_its_last_positive_child(backend: str, arity: int) -> None:
    """A target at (or by rounding past) the total counts every child of each block: the descent
    then takes the last child with positive priority, never a zero leaf or the padding."""
    from reactor.replay import sumtree as stm

    prio = np.zeros(50)
    prio[[3, 17, 20]] = [1.0, 2.0, 0.5]  # leaf 20 is the last positive one; 21..49 and padding are 0
    tree = SumTree(50, arity, backend=backend)
    tree.update(np.arange(50), prio)
    if backend == "numba":  # the kernels themselves, with a uniform of exactly 1 (u == total)
        idx, prob = np.empty(1, np.int64), np.empty(1)
        stm._nb_descend(tree._sums, tree._offsets, arity, np.array([1.0]), False, idx, prob)
        assert idx[0] == 20 and prob[0] == 0.5 / 3.5
    # Through the public API: the last stratum's draws never land past the last positive leaf.
    draws = as_np(tree.sample(10_000, np.random.default_rng(7))[0])
    assert set(np.unique(draws)) <= {3, 17, 20} and draws[-1] == 20


@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_frequencies_match_priorities_chi_square(backend: str, stratified: bool) -> None:
    prio = np.array([1.0, 2.0, 3.0, 4.0, 0.5, 8.0, 0.25, 5.0, 1.5, 6.0])
    tree = SumTree(10, 3, backend=backend)
    tree.update(np.arange(10), prio)
    rng = np.random.default_rng(1234)
    draws = np.concatenate([as_np(tree.sample(1000, rng, stratified=stratified)[0]) for _ in range(100)])
    counts = np.bincount(draws, minlength=10).astype(np.float64)
    assert chi_square(counts, prio / prio.sum()) < CHI2_CRIT_0_001[9]


def test_chi_square_check_rejects_a_wrong_distribution() -> None:
    """Guards the test above: the same statistic flags sampling proportional to p instead of p**0.5."""
    prio = np.array([1.0, 2.0, 3.0, 4.0, 0.5, 8.0, 0.25, 5.0, 1.5, 6.0])
    tree = SumTree(10, 3)
    tree.update(np.arange(10), prio)
    draws = np.concatenate([tree.sample(1000, np.random.default_rng(i))[0] for i in range(20)])
    counts = np.bincount(draws, minlength=10).astype(np.float64)
    assert chi_square(counts, np.sqrt(prio) / np.sqrt(prio).sum()) > CHI2_CRIT_0_001[9]


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("indices", "priorities", "message"),
    [
        ([0, 1], [1.0], r"^SumTree.update: 2 indices but 1 priorities; pass one priority per index$"),
        (
            [[0, 1]],
            [[1.0, 2.0]],
            r"^SumTree.update: indices and priorities must be 1-D, got shapes \(1, 2\) and \(1, 2\)$",
        ),
        (
            [0, 8],
            [1.0, 1.0],
            r"^SumTree index 8 at position 1 is out of range \[0, 8\); indices must address existing leaves$",
        ),
        ([-1], [1.0], r"^SumTree index -1 at position 0 is out of range \[0, 8\)"),
        (
            [0, 1],
            [1.0, -2.0],
            r"^SumTree priority -2.0 at position 1 is invalid; priorities must be finite and >= 0$",
        ),
        ([0], [float("nan")], r"^SumTree priority nan at position 0 is invalid"),
        ([0], [float("inf")], r"^SumTree priority inf at position 0 is invalid"),
        ([0.5], [1.0], r"^SumTree indices must be integers"),
    ],
)
def test_bad_update_raises_and_leaves_tree_and_buffer_unchanged(
    backend: str, indices: list, priorities: list, message: str
) -> None:
    tree = SumTree(8, 2, backend=backend)
    tree.update(np.array([2]), np.array([3.0]))
    tree.update(np.array([4]), np.array([1.0]), lazy=True)
    with pytest.raises(ValueError, match=message):
        tree.update(np.array(indices), np.array(priorities), lazy=True)
    with pytest.raises(ValueError, match=message):
        tree.update(np.array(indices), np.array(priorities))
    assert tree.total == 4.0
    np.testing.assert_array_equal(as_np(tree.get(np.arange(8))), [0, 0, 3.0, 0, 1.0, 0, 0, 0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_get_out_of_range_raises(backend: str) -> None:
    tree = SumTree(8, 2, backend=backend)
    with pytest.raises(ValueError, match=r"^SumTree.get: index 9 is out of range \[0, 8\)$"):
        tree.get(np.array([1, 9]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_an_all_zero_tree_raises(backend: str) -> None:
    tree = SumTree(8, backend=backend)
    with pytest.raises(
        ValueError, match=r"^SumTree.sample: every priority is 0; write a positive priority first$"
    ):
        tree.sample(4, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"^SumTree.sample: n must be an int >= 0, got -1$"):
        tree.sample(-1, np.random.default_rng(0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 0}, r"^SumTree capacity must be an int >= 1, got 0$"),
        ({"capacity": 4, "arity": 1}, r"^SumTree arity must be an int >= 2, got 1$"),
        ({"capacity": 4, "backend": "cupy"}, r"^SumTree backend must be 'numba' or 'torch', got 'cupy'$"),
        ({"capacity": 4, "device": "cpu"}, r"^SumTree device='cpu' needs backend='torch'"),
    ],
)
def test_bad_construction_raises(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SumTree(**kwargs)


# ------------------------------------------------------------------------------------------ state


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_dict_round_trip_gives_the_same_next_sample(backend: str) -> None:
    rng = np.random.default_rng(5)
    tree = SumTree(3000, 4, backend=backend)
    for _ in range(20):
        tree.update(rng.integers(0, 3000, 200), rng.random(200))
    tree.update(np.array([7]), np.array([2.0]), lazy=True)
    state = tree.state_dict()
    copy = SumTree(3000, 4, backend=backend)
    copy.load_state_dict(state)
    a = tree.sample(500, np.random.default_rng(9))
    b = copy.sample(500, np.random.default_rng(9))
    np.testing.assert_array_equal(as_np(a[0]), as_np(b[0]))
    np.testing.assert_array_equal(as_np(a[1]), as_np(b[1]))
    assert tree.total == copy.total


def test_load_state_dict_with_other_shape_raises_and_keeps_state() -> None:
    tree = SumTree(16, 4)
    tree.update(np.array([1]), np.array([1.0]))
    with pytest.raises(ValueError, match=r"^SumTree.load_state_dict: state is for capacity=8, arity=4 but"):
        tree.load_state_dict(SumTree(8, 4).state_dict())
    assert tree.total == 1.0


# ------------------------------------------------------------------------------------------ numerics


def _hammer_updates(tree: SumTree, rng: np.random.Generator, total_updates: int, batch: int) -> None:
    for _ in range(total_updates // batch):
        idx = rng.integers(0, tree.capacity, batch)
        # Priorities over many orders of magnitude: the hardest case for incremental sum trees.
        prio = rng.random(batch) * 10.0 ** rng.integers(-6, 7, batch)
        tree.update(idx, prio)


def test_many_random_updates_leave_every_node_identical_to_a_rebuild() -> None:
    rng = np.random.default_rng(7)
    tree = SumTree(1 << 14, 16)
    _hammer_updates(tree, rng, 2_000_000, 1 << 14)
    tree.check_invariants()
    leaves = tree.state_dict()["leaves"]
    exact = math.fsum(leaves.tolist())
    assert abs(tree.total - exact) <= drift_bound(tree, exact)
    assert tree.min == leaves[leaves > 0].min()


@pytest.mark.slow
def test_a_hundred_million_updates_stay_within_the_drift_bound() -> None:
    """Issue 3's bar: 10^8 random updates (in batches of 2^20), then an exact recompute.

    Every node must equal a fresh rebuild bit for bit, and the total must be within the documented
    bound of the exactly rounded sum (``math.fsum``). About 15 s here.
    """
    rng = np.random.default_rng(8)
    tree = SumTree(1 << 20, 16)
    _hammer_updates(tree, rng, 100 * (1 << 20), 1 << 20)
    tree.check_invariants()
    leaves = tree.state_dict()["leaves"]
    exact = math.fsum(leaves.tolist())
    assert abs(tree.total - exact) <= drift_bound(tree, exact)


def test_torch_backend_stays_within_the_drift_bound_after_many_updates() -> None:
    rng = np.random.default_rng(9)
    tree = SumTree(1 << 12, 8, backend="torch")
    _hammer_updates(tree, rng, 200_000, 1 << 12)
    tree.check_invariants()
    leaves = tree.state_dict()["leaves"]
    exact = math.fsum(leaves.tolist())
    assert abs(tree.total - exact) <= drift_bound(tree, exact)


# ------------------------------------------------------------------------------------------ threads


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_hammering_insert_sample_update_keep_the_tree_consistent(backend: str) -> None:
    capacity = 4096
    tree = SumTree(capacity, 8, backend=backend)
    tree.update(np.arange(capacity), np.ones(capacity))
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            start.wait()
            for step in range(300):
                idx = rng.integers(0, capacity, 64)
                prio = rng.random(64) + 0.01  # always positive, so every leaf stays samplable
                if step % 3 == 0:
                    tree.update(idx, prio, lazy=True)  # "insert"
                elif step % 3 == 1:
                    tree.update(idx, prio)
                else:
                    drawn, prob = tree.sample(128, rng)
                    assert (as_np(prob) > 0).all()
                    assert ((as_np(drawn) >= 0) & (as_np(drawn) < capacity)).all()
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    tree.check_invariants()
    leaves = tree.state_dict()["leaves"]
    assert (leaves > 0).all()
    exact = math.fsum(leaves.tolist())
    assert abs(tree.total - exact) <= drift_bound(tree, exact)


# ------------------------------------------------------------------------------------------ stateful


class SumTreeMachine(RuleBasedStateMachine):
    """The tree against a dict model: leaves, lazy buffer semantics, total, min, get and sample."""

    backend = "numba"

    @initialize(capacity=st.integers(1, 40), arity=st.sampled_from([2, 3, 4, 16]))
    def setup(self, capacity: int, arity: int) -> None:
        self.tree = SumTree(capacity, arity, backend=self.backend)
        self.model = [0.0] * capacity

    @rule(data=st.data(), lazy=st.booleans())
    def update(self, data: st.DataObject, lazy: bool) -> None:
        cap = len(self.model)
        idx = data.draw(st.lists(st.integers(0, cap - 1), max_size=12))
        prio = data.draw(
            st.lists(
                st.one_of(st.just(0.0), st.floats(1e-6, 1e6)),
                min_size=len(idx),
                max_size=len(idx),
            )
        )
        self.tree.update(np.array(idx, dtype=np.int64), np.array(prio, dtype=np.float64), lazy=lazy)
        for i, p in zip(idx, prio):
            self.model[i] = p

    @rule(data=st.data())
    def bad_update_changes_nothing(self, data: st.DataObject) -> None:
        cap = len(self.model)
        bad = data.draw(st.sampled_from(["index", "priority"]))
        idx = np.array([0, cap if bad == "index" else 0])
        prio = np.array([1.0, -1.0 if bad == "priority" else 1.0])
        with pytest.raises(ValueError):
            self.tree.update(idx, prio, lazy=data.draw(st.booleans()))

    @precondition(lambda self: sum(self.model) > 0)
    @rule(n=st.integers(0, 50), seed=st.integers(0, 2**32 - 1))
    def sample(self, n: int, seed: int) -> None:
        idx, prob = self.tree.sample(n, np.random.default_rng(seed))
        idx, prob = as_np(idx), as_np(prob)
        assert idx.shape == (n,) and prob.shape == (n,)
        total = math.fsum(self.model)
        for i, p in zip(idx.tolist(), prob.tolist()):
            assert self.model[i] > 0
            assert p == pytest.approx(self.model[i] / total, rel=1e-9)

    @invariant()
    def matches_model(self) -> None:
        if not hasattr(self, "tree"):
            return
        exact = math.fsum(self.model)
        assert abs(self.tree.total - exact) <= drift_bound(self.tree, exact)
        positive = [p for p in self.model if p > 0]
        assert self.tree.min == (min(positive) if positive else math.inf)
        np.testing.assert_array_equal(as_np(self.tree.get(np.arange(len(self.model)))), self.model)
        self.tree.check_invariants()


class TorchSumTreeMachine(SumTreeMachine):
    backend = "torch"


TestSumTreeStateful = SumTreeMachine.TestCase
TestSumTreeStateful.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestTorchSumTreeStateful = TorchSumTreeMachine.TestCase
TestTorchSumTreeStateful.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
