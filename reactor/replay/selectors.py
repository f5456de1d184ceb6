"""Selectors: which items a table samples or removes next (the Reverb set: uniform, prioritized, FIFO, LIFO, heaps).

A selector tracks a set of *slots* (dense ints in ``[0, capacity)``, assigned by the ``Table``) and
their priorities, and answers ``select(n, rng)``. The same classes serve as the table's sampler and
as its remover.

Stochastic selectors draw ``n`` slots with replacement and report each drawn slot's probability:

- :class:`Uniform`: ``P(i) = 1 / N``.
- :class:`Prioritized`: ``P(i) = p_i^alpha / sum_j p_j^alpha`` (Schaul et al., 2016, "Prioritized
  Experience Replay", eq. 1), drawn by stratified descent of a K-ary :class:`~reactor.replay.sumtree.SumTree`.
  The table turns these into importance weights ``w_i = (N * P(i))^-beta / max_j w_j`` (eq. 2, and
  ``max_j w_j = (N * min_j P(j))^-beta``, hence :meth:`Selector.min_probability`).

Deterministic selectors return the first ``min(n, N)`` items of a strict total order, each at most
once, with probability 1.0; ties in priority fall back to insertion order (older first):

- :class:`Fifo` oldest first, :class:`Lifo` newest first,
- :class:`MaxHeap` highest priority first, :class:`MinHeap` lowest first.

Fifo and Lifo keep an insertion log with lazy deletion (``O(1)`` per item); the heaps share one
indexed binary heap compiled with numba (``O(log N)`` per inserted, updated or deleted item;
``O(n log n)`` to read the top ``n`` without removing them). Batches run in one compiled call or a
few numpy operations, never a Python loop per item.

Every ``select`` is a pure function of (selector state, rng state), and :meth:`Selector.state_dict`
captures that state exactly (numpy arrays and scalars only, saved with ``np.savez``, no pickle).

Concurrency: a selector has one owner. The ``Table`` calls it under its own lock; a selector used
outside a table must be serialized by its user. (The ``SumTree`` inside :class:`Prioritized` is
itself thread-safe per call, but a selector's own bookkeeping is not.)

Validation of slots and priorities (range, NaN, negative, infinite, unknown or duplicate slots) is the
table's job, done before anything is mutated; selectors only check that they are bound and non-empty.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numba
import numpy as np

from .sumtree import DEFAULT_ARITY, PriorityOverflowError, SumTree

__all__ = ["Fifo", "Lifo", "MaxHeap", "MinHeap", "Prioritized", "Selector", "Uniform"]


class Selector:
    """Base class of the selectors: which slots to sample or remove next.

    Subclasses implement the storage of the set; see the module docstring for the semantics of each.

    Example:
        >>> sel = Prioritized(alpha=1.0)
        >>> sel.bind(4)
        >>> sel.insert(np.array([0, 1]), np.array([1.0, 3.0]))
        >>> sel.select(2, np.random.default_rng(0))
        (array([0, 1]), array([0.25, 0.75]))
    """

    is_deterministic: ClassVar[bool] = False
    #: An :meth:`insert` of a slot still present replaces it (priority and all), as a delete and an
    #: insert would: an owner may skip the delete of a slot it overwrites in the same step.
    replaces_on_insert: ClassVar[bool] = False
    _kind: ClassVar[str] = "Selector"

    def __init__(self) -> None:
        self._capacity: int | None = None
        self._arrays: Any = None

    # ---------------------------------------------------------------- lifecycle

    def bind(self, capacity: int, arrays: Any = None) -> None:
        """Attach to a table with ``capacity`` slots; called once by ``Table.__init__``.

        ``arrays``: where the selector keeps the state a draw reads, for selectors that readers in
        other processes may sample from (:class:`Uniform`, :class:`Prioritized`; see
        :mod:`reactor.replay.shared`); the others ignore it. None: memory of their own.

        Raises:
            ValueError: already bound (a selector instance belongs to one table), or capacity < 1.
        """
        if self._capacity is not None:
            raise ValueError(
                f"{type(self).__name__} is already bound to a table of capacity {self._capacity}; "
                f"a selector belongs to one table, create a new one"
            )
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"{type(self).__name__}.bind: capacity must be an int >= 1, got {capacity!r}")
        self._capacity = int(capacity)
        self._arrays = arrays
        self._allocate(self._capacity)

    def _allocate(self, capacity: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Apply buffered writes now (:class:`Prioritized` buffers inserts); a no-op for the others."""

    def _bound(self) -> int:
        if self._capacity is None:
            raise ValueError(f"{type(self).__name__} is not bound; call bind(capacity) (Table does) first")
        return self._capacity

    # ---------------------------------------------------------------- operations (overridden)

    def prepare(self, priorities: np.ndarray) -> Any:
        """Check that ``priorities`` (finite, >= 0) can be written, before the owner changes anything.

        Returns:
            What :meth:`insert` / :meth:`update` take as ``prepared`` (None: nothing).

        Raises:
            PriorityOverflowError: the priorities cannot be held (:class:`Prioritized`: a
                ``p**alpha`` or the sum of the tree would overflow float64). Nothing changed.
        """
        return None

    def insert(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        """Add new slots with their priorities; array order is insertion order.

        Args:
            slots: int64[m], distinct slots not present yet.
            priorities: float64[m], finite and >= 0 (validated by the table).
            prepared: :meth:`prepare`'s result for these priorities, if the owner called it.
        """
        raise NotImplementedError

    def update(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        """Change priorities of present slots; a repeated slot keeps its last priority."""
        raise NotImplementedError

    def delete(self, slots: np.ndarray) -> None:
        """Remove present slots (distinct)."""
        raise NotImplementedError

    def select(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Choose slots: see the module docstring.

        Args:
            n: number of items wanted, >= 0.
            rng: the table's generator (deterministic selectors ignore it).

        Returns:
            ``(slots int64[n'], probabilities float64[n'])``; ``n' = n`` for stochastic selectors,
            ``min(n, len(self))`` for deterministic ones.

        Raises:
            ValueError: the selector is empty or unbound, or ``n`` is negative.
        """
        raise NotImplementedError

    def min_probability(self) -> float:
        """Smallest selection probability of a present item that can be selected (0.0 when empty)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def present_slots(self) -> np.ndarray:
        """The slots present now, sorted (int64): for consistency checks of a loaded state."""
        raise NotImplementedError

    def clear(self) -> None:
        """Remove every item (the selector stays bound)."""
        self._allocate(self._bound())

    def state_dict(self) -> dict[str, Any]:
        """The exact state, as numpy arrays, ints, floats and strs."""
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, so the next ``select`` is identical.

        Raises:
            ValueError: the state is for another selector kind or capacity (state left unchanged).
        """
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers

    def _check_select(self, n: int) -> None:
        self._bound()
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"{type(self).__name__}.select: n must be an int >= 0, got {n!r}")
        if len(self) == 0:
            raise ValueError(f"{type(self).__name__}.select: the selector is empty; insert items first")

    def _check_state(self, state: dict[str, Any]) -> None:
        capacity = self._bound()
        kind = str(state.get("kind"))
        if kind != self._kind:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state was saved by a {kind} selector; "
                f"load it into a {kind}"
            )
        if int(state["capacity"]) != capacity:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state is for capacity {int(state['capacity'])}, "
                f"this selector has {capacity}"
            )


# --------------------------------------------------------------------------------------------------
# Uniform


@numba.njit(cache=True, nogil=True)
def _nb_dense_delete(
    dense: np.ndarray, where: np.ndarray, size: int, slots: np.ndarray
) -> int:  # pragma: no cover
    """Swap-remove each slot from the dense array; returns the new size."""
    for i in range(slots.shape[0]):
        s = slots[i]
        k = where[s]
        if k < 0:
            continue
        size -= 1
        moved = dense[size]
        dense[k] = moved
        where[moved] = k
        where[s] = -1
    return size


class Uniform(Selector):
    """Every present item equally likely: ``P(i) = 1 / N``, ``n`` draws with replacement.

    Keeps present slots in a dense array (swap-remove on delete), so a draw is one ``rng.integers``
    and one gather.
    """

    _kind = "Uniform"

    def _allocate(self, capacity: int) -> None:
        if self._arrays is None:
            self._dense = np.zeros(capacity, dtype=np.int64)
        else:  # readers elsewhere draw from the dense array (reactor.replay.shared)
            self._dense = self._arrays("dense", (capacity,), np.int64)
            self._dense.fill(0)
        self._where = np.full(capacity, -1, dtype=np.int64)
        self._size = 0

    def insert(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()
        slots = np.asarray(slots, dtype=np.int64)
        m = slots.shape[0]
        self._dense[self._size : self._size + m] = slots
        self._where[slots] = np.arange(self._size, self._size + m, dtype=np.int64)
        self._size += m

    def update(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()

    def delete(self, slots: np.ndarray) -> None:
        self._bound()
        self._size = int(
            _nb_dense_delete(self._dense, self._where, self._size, np.asarray(slots, dtype=np.int64))
        )

    def select(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_select(n)
        picks = rng.integers(0, self._size, size=n)
        return self._dense[picks], np.full(n, 1.0 / self._size)

    def min_probability(self) -> float:
        return 1.0 / self._size if self._size else 0.0

    def __len__(self) -> int:
        return self._size if self._capacity is not None else 0

    def present_slots(self) -> np.ndarray:
        return np.sort(self._dense[: self._size])

    def state_dict(self) -> dict[str, Any]:
        capacity = self._bound()
        return {"kind": self._kind, "capacity": capacity, "dense": self._dense[: self._size].copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        dense = np.asarray(state["dense"], dtype=np.int64)
        capacity = self._bound()
        if (
            dense.ndim != 1
            or dense.size > capacity
            or (dense.size and (dense.min() < 0 or dense.max() >= capacity))
        ):
            raise ValueError("Uniform.load_state_dict: 'dense' must be distinct slots in [0, capacity)")
        if np.unique(dense).size != dense.size:
            raise ValueError("Uniform.load_state_dict: 'dense' must be distinct slots in [0, capacity)")
        self._allocate(capacity)
        self._dense[: dense.size] = dense
        self._where[dense] = np.arange(dense.size, dtype=np.int64)
        self._size = int(dense.size)


# --------------------------------------------------------------------------------------------------
# Prioritized


@numba.njit(cache=True, nogil=True)
def _nb_mark(present: np.ndarray, slots: np.ndarray, value: bool) -> int:  # pragma: no cover - jit
    """Set ``present[slots]`` to ``value``; how many entries changed (a repeated slot counts once). One
    pass instead of a gather, a count and a scatter (slots in range: the caller checked them)."""
    changed = 0
    for i in range(slots.shape[0]):
        j = slots[i]
        if present[j] != value:
            present[j] = value
            changed += 1
    return changed


class Prioritized(Selector):
    """Proportional prioritization: ``P(i) = p_i^alpha / sum_j p_j^alpha`` (PER, Schaul et al. 2016).

    ``alpha = 0`` is uniform over present items, ``alpha = 1`` fully proportional. Priorities are
    raised to ``alpha`` once, on write, and kept in a :class:`SumTree` (numba backend): a draw is a
    stratified prefix-sum descent, ``O(n log_K N)``. Inserted and deleted priorities are written
    lazily (buffered, applied in one pass before the next select); updates are applied at once.

    A present item with priority 0 (and ``alpha > 0``) has probability 0: it is never drawn, and
    :meth:`min_probability` ignores it (it never needs an importance weight).

    Args:
        alpha: the prioritization exponent, >= 0.
        arity: fan-in of the sum tree (default :data:`~reactor.replay.sumtree.DEFAULT_ARITY`).

    Raises:
        ValueError: alpha negative or not finite.
    """

    _kind = "Prioritized"
    replaces_on_insert = True  # the tree's leaf is overwritten, and insert counts a present slot once

    def __init__(self, alpha: float = 0.6, arity: int | None = None) -> None:
        super().__init__()
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0.0 <= alpha < float("inf"):
            raise ValueError(f"Prioritized alpha must be a finite number >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.arity = DEFAULT_ARITY if arity is None else arity

    def _allocate(self, capacity: int) -> None:
        self._tree = SumTree(capacity, self.arity, arrays=self._arrays)
        self._present = np.zeros(capacity, dtype=np.bool_)
        self._size = 0

    def _scaled(self, priorities: np.ndarray) -> np.ndarray:
        p = np.asarray(priorities, dtype=np.float64)
        if self.alpha == 1.0:
            return p
        if self.alpha > 1.0:  # only then can a finite p**alpha overflow (prepare refuses the inf)
            with np.errstate(over="ignore"):
                return np.power(p, self.alpha)
        return np.power(p, self.alpha)

    def prepare(self, priorities: np.ndarray) -> Any:
        """``(p**alpha, its sum)`` of ``priorities``, checked: each finite, and their sum on top of the
        tree's total finite (a tree whose total is ``inf`` can never be sampled again)."""
        self._bound()
        scaled = self._scaled(priorities)
        try:
            psum = self._tree.check_total(scaled)
        except PriorityOverflowError as e:
            i = e.position
            why = (f"{float(priorities[i])!r} ** alpha={self.alpha} overflows float64"
                   if not np.isfinite(scaled[i]) else f"priorities ** alpha={self.alpha}: {e.why}")
            raise PriorityOverflowError(f"Prioritized: priority at position {i}: {why}", i, why) from None
        return scaled, psum

    def insert(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()
        slots = np.asarray(slots, dtype=np.int64)
        if prepared is None:
            self._tree.update(slots, self._scaled(priorities), lazy=True)
        else:
            self._tree.update_checked(slots, prepared[0], prepared[1], lazy=True)
        self._size += int(_nb_mark(self._present, slots, True))  # (indices checked by the tree above)

    def update(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()
        if prepared is None:
            self._tree.update(slots, self._scaled(priorities))
        else:
            self._tree.update_checked(slots, prepared[0], prepared[1])

    def delete(self, slots: np.ndarray) -> None:
        self._bound()
        slots = np.asarray(slots, dtype=np.int64)
        self._tree.update(slots, np.zeros(slots.shape[0]), lazy=True)
        self._size -= int(_nb_mark(self._present, slots, False))

    def select(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_select(n)
        return self._tree.sample(n, rng)

    def min_probability(self) -> float:
        if self._capacity is None:
            return 0.0
        total = self._tree.total
        return self._tree.min / total if total > 0.0 else 0.0

    def __len__(self) -> int:
        return self._size if self._capacity is not None else 0

    def present_slots(self) -> np.ndarray:
        return np.flatnonzero(self._present)

    def flush(self) -> None:
        self._tree.flush()

    @property
    def tree(self) -> SumTree:
        """The sum tree of ``p^alpha`` (read-only use: writing to it bypasses the bookkeeping)."""
        self._bound()
        return self._tree

    def state_dict(self) -> dict[str, Any]:
        capacity = self._bound()
        tree = self._tree.state_dict()
        return {
            "kind": self._kind,
            "capacity": capacity,
            "alpha": self.alpha,
            "arity": int(tree["arity"]),
            "leaves": tree["leaves"],
            "present": self._present.copy(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        if float(state["alpha"]) != self.alpha:
            raise ValueError(
                f"Prioritized.load_state_dict: the state has alpha={float(state['alpha'])}, this selector "
                f"alpha={self.alpha}; build Prioritized(alpha={float(state['alpha'])})"
            )
        present = np.asarray(state["present"], dtype=np.bool_)
        if present.shape != (self._bound(),):
            raise ValueError("Prioritized.load_state_dict: 'present' must be a bool array of length capacity")
        leaves = np.asarray(state["leaves"])
        if leaves.shape == present.shape and bool(np.any(leaves[~present] != 0.0)):
            raise ValueError(
                f"Prioritized.load_state_dict: slot {int(np.flatnonzero((leaves != 0.0) & ~present)[0])} has a "
                "priority but is not present (an absent slot's leaf is always 0)"
            )
        self._tree.load_state_dict(
            {"capacity": state["capacity"], "arity": state["arity"], "leaves": state["leaves"]}
        )
        self._present = present.copy()
        self._size = int(np.count_nonzero(present))


# --------------------------------------------------------------------------------------------------
# Deterministic selectors: one indexed binary heap ordered by (key, insertion sequence)


@numba.njit(cache=True, inline="always")
def _before(a: int, b: int, key: np.ndarray, seq: np.ndarray) -> bool:  # pragma: no cover - jit
    return key[a] < key[b] or (key[a] == key[b] and seq[a] < seq[b])


@numba.njit(cache=True)
def _sift_up(
    heap: np.ndarray, pos: np.ndarray, key: np.ndarray, seq: np.ndarray, i: int
) -> None:  # pragma: no cover
    s = heap[i]
    while i > 0:
        p = (i - 1) >> 1
        ps = heap[p]
        if _before(s, ps, key, seq):
            heap[i] = ps
            pos[ps] = i
            i = p
        else:
            break
    heap[i] = s
    pos[s] = i


@numba.njit(cache=True)
def _sift_down(
    heap: np.ndarray, pos: np.ndarray, key: np.ndarray, seq: np.ndarray, i: int, size: int
) -> None:  # pragma: no cover - jit
    s = heap[i]
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and _before(heap[c + 1], heap[c], key, seq):
            c += 1
        if _before(heap[c], s, key, seq):
            heap[i] = heap[c]
            pos[heap[i]] = i
            i = c
        else:
            break
    heap[i] = s
    pos[s] = i


@numba.njit(cache=True, nogil=True)
def _nb_heap_insert(
    heap: np.ndarray,
    pos: np.ndarray,
    key: np.ndarray,
    seq: np.ndarray,
    size: int,
    slots: np.ndarray,
    keys: np.ndarray,
    seq0: int,
) -> int:  # pragma: no cover - jit
    for i in range(slots.shape[0]):
        s = slots[i]
        key[s] = keys[i]
        seq[s] = seq0 + i
        if pos[s] >= 0:  # re-insert of a present slot: it becomes the newest, with its new key
            _sift_up(heap, pos, key, seq, pos[s])
            _sift_down(heap, pos, key, seq, pos[s], size)
        else:
            heap[size] = s
            pos[s] = size
            size += 1
            _sift_up(heap, pos, key, seq, size - 1)
    return size


@numba.njit(cache=True, nogil=True)
def _nb_heap_update(
    heap: np.ndarray,
    pos: np.ndarray,
    key: np.ndarray,
    seq: np.ndarray,
    size: int,
    slots: np.ndarray,
    keys: np.ndarray,
) -> None:  # pragma: no cover - jit
    for i in range(slots.shape[0]):
        s = slots[i]
        if pos[s] < 0:
            continue
        key[s] = keys[i]
        _sift_up(heap, pos, key, seq, pos[s])
        _sift_down(heap, pos, key, seq, pos[s], size)


@numba.njit(cache=True, nogil=True)
def _nb_heap_delete(
    heap: np.ndarray, pos: np.ndarray, key: np.ndarray, seq: np.ndarray, size: int, slots: np.ndarray
) -> int:  # pragma: no cover - jit
    for i in range(slots.shape[0]):
        s = slots[i]
        k = pos[s]
        if k < 0:
            continue
        pos[s] = -1
        size -= 1
        if k < size:
            last = heap[size]
            heap[k] = last
            pos[last] = k
            _sift_up(heap, pos, key, seq, k)
            _sift_down(heap, pos, key, seq, pos[last], size)
    return size


@numba.njit(cache=True, nogil=True)
def _nb_heap_top(
    heap: np.ndarray, key: np.ndarray, seq: np.ndarray, size: int, n: int
) -> np.ndarray:  # pragma: no cover
    """The first ``n`` slots in heap order without removing them: best-first search of the heap."""
    n = min(n, size)
    out = np.empty(n, dtype=np.int64)
    if n == 0:
        return out
    frontier = np.empty(2 * n + 1, dtype=np.int64)  # heap positions, itself a binary heap
    m = 1
    frontier[0] = 0
    for k in range(n):
        top = frontier[0]
        out[k] = heap[top]
        m -= 1
        frontier[0] = frontier[m]
        # sift the moved frontier root down
        i = 0
        while True:
            c = 2 * i + 1
            if c >= m:
                break
            if c + 1 < m and _before(heap[frontier[c + 1]], heap[frontier[c]], key, seq):
                c += 1
            if _before(heap[frontier[c]], heap[frontier[i]], key, seq):
                t = frontier[i]
                frontier[i] = frontier[c]
                frontier[c] = t
                i = c
            else:
                break
        for child in (2 * top + 1, 2 * top + 2):
            if child < size:
                frontier[m] = child
                i = m
                m += 1
                while i > 0:
                    p = (i - 1) >> 1
                    if _before(heap[frontier[i]], heap[frontier[p]], key, seq):
                        t = frontier[i]
                        frontier[i] = frontier[p]
                        frontier[p] = t
                        i = p
                    else:
                        break
    return out


class _HeapSelector(Selector):
    """Deterministic selectors: the first items by ``(key, insertion sequence)``; subclasses choose the key."""

    is_deterministic = True

    def _allocate(self, capacity: int) -> None:
        self._heap = np.zeros(capacity, dtype=np.int64)
        self._pos = np.full(capacity, -1, dtype=np.int64)
        self._key = np.zeros(capacity, dtype=np.float64)
        self._seq = np.zeros(capacity, dtype=np.int64)
        self._size = 0
        self._next_seq = 0

    def _keys(self, priorities: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    _uses_priority: ClassVar[bool] = True

    def insert(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()
        slots = np.asarray(slots, dtype=np.int64)
        m = slots.shape[0]
        keys = self._keys(
            np.asarray(priorities, dtype=np.float64), self._next_seq + np.arange(m, dtype=np.int64)
        )
        self._size = int(
            _nb_heap_insert(
                self._heap, self._pos, self._key, self._seq, self._size, slots, keys, self._next_seq
            )
        )
        self._next_seq += m

    def update(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()
        if not self._uses_priority:
            return
        slots = np.asarray(slots, dtype=np.int64)
        keys = self._keys(np.asarray(priorities, dtype=np.float64), self._seq[slots])
        _nb_heap_update(self._heap, self._pos, self._key, self._seq, self._size, slots, keys)

    def delete(self, slots: np.ndarray) -> None:
        self._bound()
        self._size = int(
            _nb_heap_delete(
                self._heap, self._pos, self._key, self._seq, self._size, np.asarray(slots, dtype=np.int64)
            )
        )

    def select(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_select(n)
        slots = _nb_heap_top(self._heap, self._key, self._seq, self._size, n)
        return slots, np.ones(slots.shape[0], dtype=np.float64)

    def min_probability(self) -> float:
        return 1.0 if len(self) else 0.0

    def __len__(self) -> int:
        return self._size if self._capacity is not None else 0

    def present_slots(self) -> np.ndarray:
        return np.sort(self._heap[: self._size])

    def state_dict(self) -> dict[str, Any]:
        capacity = self._bound()
        return {
            "kind": self._kind,
            "capacity": capacity,
            "heap": self._heap[: self._size].copy(),
            "key": self._key.copy(),
            "seq": self._seq.copy(),
            "next_seq": self._next_seq,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        capacity = self._bound()
        heap = np.asarray(state["heap"], dtype=np.int64)
        key = np.asarray(state["key"], dtype=np.float64)
        seq = np.asarray(state["seq"], dtype=np.int64)
        if (
            heap.ndim != 1
            or heap.size > capacity
            or (heap.size and (heap.min() < 0 or heap.max() >= capacity))
            or key.shape != (capacity,)
            or seq.shape != (capacity,)
        ):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'heap' must hold slots in [0, {capacity}) and "
                f"'key'/'seq' must have length {capacity}"
            )
        next_seq = int(state["next_seq"])
        if np.unique(heap).size != heap.size or (heap.size and int(seq[heap].max()) >= next_seq):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'heap' must hold distinct slots whose sequence numbers "
                f"are below next_seq={next_seq}"
            )
        self._allocate(capacity)
        self._heap[: heap.size] = heap
        self._pos[heap] = np.arange(heap.size, dtype=np.int64)
        self._key[:] = key
        self._seq[:] = seq
        self._size = int(heap.size)
        self._next_seq = int(state["next_seq"])


@numba.njit(cache=True, nogil=True)
def _nb_log_scan(
    log_slot: np.ndarray,
    log_seq: np.ndarray,
    seq: np.ndarray,
    head: int,
    tail: int,
    n: int,
    newest_first: bool,
) -> tuple[np.ndarray, int, int]:  # pragma: no cover - jit
    """First ``n`` live entries of the insertion log from the old (or new) end; trims stale ends."""
    out = np.empty(n, dtype=np.int64)
    k = 0
    if newest_first:
        while tail > head and seq[log_slot[tail - 1]] != log_seq[tail - 1]:
            tail -= 1
        i = tail - 1
        while k < n and i >= head:
            if seq[log_slot[i]] == log_seq[i]:
                out[k] = log_slot[i]
                k += 1
            i -= 1
    else:
        while head < tail and seq[log_slot[head]] != log_seq[head]:
            head += 1
        i = head
        while k < n and i < tail:
            if seq[log_slot[i]] == log_seq[i]:
                out[k] = log_slot[i]
                k += 1
            i += 1
    return out[:k], head, tail


class _LogSelector(Selector):
    """Fifo/Lifo: an append-only insertion log with lazy deletion (O(1) per insert and delete).

    ``seq[slot]`` is the insertion number of the slot's current item (-1 when absent); a log entry is
    live when its recorded number still matches. Deleted entries are skipped, trimmed off the ends
    as selects pass them, and compacted away when the log (2 * capacity + 1 entries) fills up.
    A heap would also order these, but a delete in a heap is O(log N) random memory accesses: as a
    table's remover (delete the 256 oldest per insert) it measured ~400 us per batch at 2^20 items.
    """

    is_deterministic = True
    _newest_first: ClassVar[bool] = False

    def _allocate(self, capacity: int) -> None:
        self._log_slot = np.zeros(2 * capacity + 1, dtype=np.int64)
        self._log_seq = np.zeros(2 * capacity + 1, dtype=np.int64)
        self._seq = np.full(capacity, -1, dtype=np.int64)
        self._head = 0
        self._tail = 0
        self._size = 0
        self._next_seq = 0

    def _compact(self) -> None:
        log_slot = self._log_slot[self._head : self._tail]
        log_seq = self._log_seq[self._head : self._tail]
        live = self._seq[log_slot] == log_seq
        m = int(np.count_nonzero(live))
        self._log_slot[:m] = log_slot[live]
        self._log_seq[:m] = log_seq[live]
        self._head, self._tail = 0, m

    def insert(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()
        slots = np.asarray(slots, dtype=np.int64)
        m = slots.shape[0]
        if self._tail + m > self._log_slot.shape[0]:
            self._compact()
        seqs = np.arange(self._next_seq, self._next_seq + m, dtype=np.int64)
        self._size += m - int(np.count_nonzero(self._seq[slots] >= 0))
        self._log_slot[self._tail : self._tail + m] = slots
        self._log_seq[self._tail : self._tail + m] = seqs
        self._seq[slots] = seqs
        self._tail += m
        self._next_seq += m

    def update(self, slots: np.ndarray, priorities: np.ndarray, prepared: Any = None) -> None:
        self._bound()  # order is by insertion only

    def delete(self, slots: np.ndarray) -> None:
        self._bound()
        slots = np.asarray(slots, dtype=np.int64)
        self._size -= int(np.count_nonzero(self._seq[slots] >= 0))
        self._seq[slots] = -1

    def select(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        self._check_select(n)
        slots, self._head, self._tail = _nb_log_scan(
            self._log_slot,
            self._log_seq,
            self._seq,
            self._head,
            self._tail,
            min(n, self._size),
            self._newest_first,
        )
        return slots, np.ones(slots.shape[0], dtype=np.float64)

    def min_probability(self) -> float:
        return 1.0 if len(self) else 0.0

    def __len__(self) -> int:
        return self._size if self._capacity is not None else 0

    def present_slots(self) -> np.ndarray:
        return np.flatnonzero(self._seq >= 0)

    def state_dict(self) -> dict[str, Any]:
        capacity = self._bound()
        self._compact()
        return {
            "kind": self._kind,
            "capacity": capacity,
            "order": self._log_slot[: self._tail].copy(),  # live slots, oldest first
            "seq": self._seq.copy(),
            "next_seq": self._next_seq,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        capacity = self._bound()
        order = np.asarray(state["order"], dtype=np.int64)
        seq = np.asarray(state["seq"], dtype=np.int64)
        if (
            order.ndim != 1
            or order.size > capacity
            or seq.shape != (capacity,)
            or (order.size and (order.min() < 0 or order.max() >= capacity))
        ):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'order' must hold slots in [0, {capacity}) and "
                f"'seq' must have length {capacity}"
            )
        next_seq = int(state["next_seq"])
        live = seq[order]
        if (
            int(np.count_nonzero(seq >= 0)) != order.size
            or bool(np.any(live < 0))
            or bool(np.any(np.diff(live) <= 0))
            or (order.size and int(live[-1]) >= next_seq)
        ):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: 'order' must list every slot with a sequence number "
                f"once, in increasing sequence below next_seq={next_seq}"
            )
        self._allocate(capacity)
        self._log_slot[: order.size] = order
        self._log_seq[: order.size] = seq[order]
        self._seq[:] = seq
        self._tail = int(order.size)
        self._size = int(order.size)
        self._next_seq = int(state["next_seq"])


class Fifo(_LogSelector):
    """First in, first out: ``select(n)`` returns the ``n`` oldest items, oldest first. Priorities are ignored."""

    _kind = "Fifo"


class Lifo(_LogSelector):
    """Last in, first out: ``select(n)`` returns the ``n`` newest items, newest first. Priorities are ignored."""

    _kind = "Lifo"
    _newest_first = True


class MaxHeap(_HeapSelector):
    """Highest priority first; equal priorities in insertion order (older first)."""

    _kind = "MaxHeap"

    def _keys(self, priorities: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        return -priorities


class MinHeap(_HeapSelector):
    """Lowest priority first; equal priorities in insertion order (older first)."""

    _kind = "MinHeap"

    def _keys(self, priorities: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        return priorities.copy()
