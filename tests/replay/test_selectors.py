"""Selectors against plain-Python models, PER frequencies, state round trips and errors (issue 3)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from reactor.replay.selectors import Fifo, Lifo, MaxHeap, MinHeap, Prioritized, Selector, Uniform

# Chi-square critical value at significance 0.001, df = 9 (NIST/SEMATECH e-Handbook of Statistical
# Methods, section 1.3.6.7.4, upper critical values of the chi-square distribution).
CHI2_CRIT_DF9_0_001 = 27.877

ALL: dict[str, Callable[[], Selector]] = {
    "Uniform": Uniform,
    "Prioritized": lambda: Prioritized(alpha=0.6, arity=4),
    "Fifo": Fifo,
    "Lifo": Lifo,
    "MaxHeap": MaxHeap,
    "MinHeap": MinHeap,
}


def bound(make: Callable[[], Selector], capacity: int = 16) -> Selector:
    sel = make()
    sel.bind(capacity)
    return sel


def ins(sel: Selector, slots: list[int], prios: list[float]) -> None:
    sel.insert(np.array(slots, dtype=np.int64), np.array(prios, dtype=np.float64))


# ------------------------------------------------------------------------------------------ deterministic order


def test_fifo_selects_oldest_first_and_skips_deleted() -> None:
    sel = bound(Fifo)
    ins(sel, [5, 2, 9], [3.0, 1.0, 2.0])
    ins(sel, [0], [9.0])
    sel.delete(np.array([2]))
    slots, probs = sel.select(10, np.random.default_rng(0))
    assert slots.tolist() == [5, 9, 0]
    assert probs.tolist() == [1.0, 1.0, 1.0]


def test_lifo_selects_newest_first() -> None:
    sel = bound(Lifo)
    ins(sel, [5, 2, 9], [3.0, 1.0, 2.0])
    ins(sel, [0], [9.0])
    assert sel.select(2, np.random.default_rng(0))[0].tolist() == [0, 9]


def test_max_heap_orders_by_priority_then_insertion_order() -> None:
    sel = bound(MaxHeap)
    ins(sel, [1, 2, 3, 4], [2.0, 5.0, 2.0, 1.0])
    assert sel.select(4, np.random.default_rng(0))[0].tolist() == [2, 1, 3, 4]
    sel.update(np.array([4, 4]), np.array([9.0, 2.0]))  # last write wins: 4 ties at 2.0, inserted last
    assert sel.select(4, np.random.default_rng(0))[0].tolist() == [2, 1, 3, 4]


def test_min_heap_orders_by_priority_then_insertion_order() -> None:
    sel = bound(MinHeap)
    ins(sel, [1, 2, 3, 4], [2.0, 5.0, 2.0, 1.0])
    assert sel.select(3, np.random.default_rng(0))[0].tolist() == [4, 1, 3]
    sel.update(np.array([2]), np.array([0.5]))
    assert sel.select(1, np.random.default_rng(0))[0].tolist() == [2]


def test_fifo_and_lifo_ignore_priority_updates() -> None:
    for make, expected in ((Fifo, [1, 2, 3]), (Lifo, [3, 2, 1])):
        sel = bound(make)
        ins(sel, [1, 2, 3], [1.0, 2.0, 3.0])
        sel.update(np.array([3]), np.array([100.0]))
        assert sel.select(3, np.random.default_rng(0))[0].tolist() == expected


# ------------------------------------------------------------------------------------------ stochastic


def test_uniform_draws_present_slots_with_probability_one_over_n() -> None:
    sel = bound(Uniform)
    ins(sel, [3, 7, 11, 12], [1.0, 1.0, 1.0, 1.0])
    sel.delete(np.array([7]))
    slots, probs = sel.select(3000, np.random.default_rng(0))
    assert set(slots.tolist()) == {3, 11, 12}
    assert (probs == 1.0 / 3).all()
    assert sel.min_probability() == 1.0 / 3


def test_prioritized_frequencies_match_p_to_the_alpha_chi_square() -> None:
    prio = np.array([1.0, 2.0, 3.0, 4.0, 0.5, 8.0, 0.25, 5.0, 1.5, 6.0])
    sel = Prioritized(alpha=0.6)
    sel.bind(10)
    sel.insert(np.arange(10), prio)
    rng = np.random.default_rng(2024)
    draws = np.concatenate([sel.select(997, rng)[0] for _ in range(100)])
    counts = np.bincount(draws, minlength=10).astype(np.float64)
    expected_p = prio**0.6 / (prio**0.6).sum()
    stat = float(((counts - counts.sum() * expected_p) ** 2 / (counts.sum() * expected_p)).sum())
    assert stat < CHI2_CRIT_DF9_0_001
    # ... while the plain-priority distribution (alpha ignored) is rejected by the same statistic.
    wrong_p = prio / prio.sum()
    wrong = float(((counts - counts.sum() * wrong_p) ** 2 / (counts.sum() * wrong_p)).sum())
    assert wrong > CHI2_CRIT_DF9_0_001


def test_prioritized_reports_probabilities_and_min_probability() -> None:
    sel = Prioritized(alpha=0.5)
    sel.bind(8)
    ins(sel, [0, 1, 2], [4.0, 16.0, 0.0])
    slots, probs = sel.select(100, np.random.default_rng(0))
    assert set(slots.tolist()) <= {0, 1}, "a zero priority is never drawn"
    np.testing.assert_allclose(probs, np.where(slots == 0, 2.0 / 6.0, 4.0 / 6.0))
    assert sel.min_probability() == pytest.approx(2.0 / 6.0)
    assert len(sel) == 3


def test_prioritized_update_duplicates_last_write_wins() -> None:
    sel = Prioritized(alpha=1.0)
    sel.bind(4)
    ins(sel, [0, 1], [1.0, 1.0])
    sel.update(np.array([0, 1, 0]), np.array([5.0, 3.0, 1.0]))
    np.testing.assert_array_equal(sel.tree.get(np.array([0, 1])), [1.0, 3.0])


def test_prioritized_deleted_slot_is_never_drawn() -> None:
    sel = Prioritized(alpha=1.0)
    sel.bind(4)
    ins(sel, [0, 1, 2], [1.0, 100.0, 1.0])
    sel.delete(np.array([1]))
    assert 1 not in sel.select(500, np.random.default_rng(0))[0].tolist()
    assert len(sel) == 2


# ------------------------------------------------------------------------------------------ state and errors


@pytest.mark.parametrize("name", list(ALL))
def test_state_dict_round_trip_gives_the_same_next_select(name: str) -> None:
    rng = np.random.default_rng(3)
    sel = bound(ALL[name], 64)
    ins(sel, list(range(40)), rng.random(40).tolist())
    sel.delete(np.arange(0, 40, 3))
    sel.update(np.arange(1, 40, 3), rng.random(13))
    ins(sel, [50, 51], [0.3, 0.9])
    state = sel.state_dict()
    for value in state.values():
        assert isinstance(value, (np.ndarray, int, float, str))
    other = bound(ALL[name], 64)
    other.load_state_dict(state)
    a = sel.select(25, np.random.default_rng(11))
    b = other.select(25, np.random.default_rng(11))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert len(other) == len(sel)
    assert other.min_probability() == sel.min_probability()


@pytest.mark.parametrize("name", list(ALL))
def test_binding_twice_raises(name: str) -> None:
    sel = bound(ALL[name], 4)
    with pytest.raises(
        ValueError, match=r"is already bound to a table of capacity 4; a selector belongs to one table"
    ):
        sel.bind(4)


@pytest.mark.parametrize("name", list(ALL))
def test_selecting_from_empty_raises(name: str) -> None:
    sel = bound(ALL[name], 4)
    with pytest.raises(ValueError, match=r"\.select: the selector is empty; insert items first$"):
        sel.select(1, np.random.default_rng(0))


@pytest.mark.parametrize("name", list(ALL))
def test_using_an_unbound_selector_raises(name: str) -> None:
    with pytest.raises(ValueError, match=r"is not bound; call bind\(capacity\) \(Table does\) first$"):
        ALL[name]().insert(np.array([0]), np.array([1.0]))


@pytest.mark.parametrize("name", list(ALL))
def test_clear_empties_but_keeps_binding(name: str) -> None:
    sel = bound(ALL[name], 4)
    ins(sel, [0, 1], [1.0, 2.0])
    sel.clear()
    assert len(sel) == 0
    ins(sel, [2], [1.0])
    assert sel.select(1, np.random.default_rng(0))[0].tolist() == [2]


def test_loading_another_kinds_state_raises_and_keeps_state() -> None:
    sel = bound(Fifo, 4)
    ins(sel, [1], [1.0])
    with pytest.raises(
        ValueError,
        match=r"^Fifo.load_state_dict: the state was saved by a Lifo selector; load it into a Lifo$",
    ):
        sel.load_state_dict(bound(Lifo, 4).state_dict())
    assert sel.select(4, np.random.default_rng(0))[0].tolist() == [1]


def test_prioritized_rejects_negative_alpha() -> None:
    with pytest.raises(ValueError, match=r"^Prioritized alpha must be a finite number >= 0, got -0.5$"):
        Prioritized(alpha=-0.5)


@pytest.mark.parametrize("name", list(ALL))
def test_is_deterministic_flag(name: str) -> None:
    assert ALL[name]().is_deterministic == (name in {"Fifo", "Lifo", "MaxHeap", "MinHeap"})


# ------------------------------------------------------------------------------------------ stateful


class SelectorMachine(RuleBasedStateMachine):
    """A selector against a plain-Python model of (slot -> priority, insertion number)."""

    make: Callable[[], Selector] = Uniform
    capacity = 24

    @initialize()
    def setup(self) -> None:
        self.sel = self.make()
        self.sel.bind(self.capacity)
        self.model: dict[int, tuple[float, int]] = {}
        self.seq = 0

    priorities = st.one_of(st.just(0.0), st.just(1.0), st.floats(1e-3, 1e3))

    @precondition(lambda self: len(self.model) < self.capacity)
    @rule(data=st.data())
    def insert(self, data: st.DataObject) -> None:
        free = [s for s in range(self.capacity) if s not in self.model]
        slots = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=5, unique=True))
        prios = data.draw(st.lists(self.priorities, min_size=len(slots), max_size=len(slots)))
        self.sel.insert(np.array(slots, dtype=np.int64), np.array(prios))
        for s, p in zip(slots, prios):
            self.model[s] = (p, self.seq)
            self.seq += 1

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def update(self, data: st.DataObject) -> None:
        slots = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=6))
        prios = data.draw(st.lists(self.priorities, min_size=len(slots), max_size=len(slots)))
        self.sel.update(np.array(slots, dtype=np.int64), np.array(prios))
        for s, p in zip(slots, prios):
            self.model[s] = (p, self.model[s][1])

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        slots = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        self.sel.delete(np.array(slots, dtype=np.int64))
        for s in slots:
            del self.model[s]

    def expected_order(self) -> list[int] | None:
        return None

    def expected_probability(self, slot: int) -> float:
        raise NotImplementedError

    @precondition(lambda self: len(self.model) > 0)
    @rule(n=st.integers(0, 30), seed=st.integers(0, 2**32 - 1))
    def select(self, n: int, seed: int) -> None:
        order = self.expected_order()
        if order is None and self.total_mass() == 0.0:
            with pytest.raises(ValueError):
                self.sel.select(n, np.random.default_rng(seed))
            return
        slots, probs = self.sel.select(n, np.random.default_rng(seed))
        if order is not None:
            assert slots.tolist() == order[:n]
            assert (probs == 1.0).all()
            return
        assert len(slots) == n
        for s, p in zip(slots.tolist(), probs.tolist()):
            assert s in self.model
            assert p > 0
            assert p == pytest.approx(self.expected_probability(s), rel=1e-9)

    def total_mass(self) -> float:
        return 1.0

    @invariant()
    def length_and_min_probability_match(self) -> None:
        if not hasattr(self, "sel"):
            return
        assert len(self.sel) == len(self.model)
        if not self.model:
            assert self.sel.min_probability() == 0.0
        elif self.expected_order() is not None:
            assert self.sel.min_probability() == 1.0
        else:
            positive = [self.expected_probability(s) for s in self.model if self.expected_probability(s) > 0]
            assert self.sel.min_probability() == pytest.approx(min(positive) if positive else 0.0, rel=1e-9)


class UniformMachine(SelectorMachine):
    make = Uniform

    def expected_probability(self, slot: int) -> float:
        return 1.0 / len(self.model)


class PrioritizedMachine(SelectorMachine):
    make = staticmethod(lambda: Prioritized(alpha=0.7, arity=3))

    def total_mass(self) -> float:
        return math.fsum(p**0.7 for p, _ in self.model.values())

    def expected_probability(self, slot: int) -> float:
        total = self.total_mass()
        return self.model[slot][0] ** 0.7 / total if total > 0 else 0.0


class FifoMachine(SelectorMachine):
    make = Fifo

    def expected_order(self) -> list[int]:
        return sorted(self.model, key=lambda s: self.model[s][1])


class LifoMachine(SelectorMachine):
    make = Lifo

    def expected_order(self) -> list[int]:
        return sorted(self.model, key=lambda s: -self.model[s][1])


class MaxHeapMachine(SelectorMachine):
    make = MaxHeap

    def expected_order(self) -> list[int]:
        return sorted(self.model, key=lambda s: (-self.model[s][0], self.model[s][1]))


class MinHeapMachine(SelectorMachine):
    make = MinHeap

    def expected_order(self) -> list[int]:
        return sorted(self.model, key=lambda s: (self.model[s][0], self.model[s][1]))


_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestUniformStateful = UniformMachine.TestCase
TestUniformStateful.settings = _SETTINGS
TestPrioritizedStateful = PrioritizedMachine.TestCase
TestPrioritizedStateful.settings = _SETTINGS
TestFifoStateful = FifoMachine.TestCase
TestFifoStateful.settings = _SETTINGS
TestLifoStateful = LifoMachine.TestCase
TestLifoStateful.settings = _SETTINGS
TestMaxHeapStateful = MaxHeapMachine.TestCase
TestMaxHeapStateful.settings = _SETTINGS
TestMinHeapStateful = MinHeapMachine.TestCase
TestMinHeapStateful.settings = _SETTINGS
