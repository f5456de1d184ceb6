"""A K-ary sum tree with a companion min tree: the priority index behind prioritized replay (PAAL).

Layout. The tree is one flat ``float64`` array holding every level contiguously in level order: the
root at position 0, then level 1, then level 2, ..., then the leaves. Level ``l`` has
``ceil(capacity / K**(depth - l))`` live nodes, padded to a multiple of ``K`` so the children of node
``i`` of level ``l`` are always the ``K`` consecutive entries ``offsets[l+1] + i*K ... + K - 1``. A
descent therefore reads one contiguous block of ``K`` doubles per level (at the default ``K = 8``,
one cache line), and the hot top levels stay in cache. A second array of the same layout holds minima.

Semantics.
- Leaf ``i`` holds the priority of slot ``i`` (``0.0`` when unset). Sampling picks slot ``i`` with
  probability ``priority[i] / total``; a slot with priority 0 is never picked.
- :attr:`SumTree.min` is the smallest *positive* leaf (``inf`` when there is none). Zero leaves are
  left out on purpose: they are never sampled, so they never need an importance weight, and counting
  them would make every weight collapse to 0.
- Writes (:meth:`SumTree.update`) are batched; when an index repeats within a batch (or across
  buffered batches) the last write wins.
- Lazy writing: ``update(..., lazy=True)`` only buffers the batch (after validating it). All buffered
  batches are applied in one pass, in call order, right before the next read (``sample``, ``total``,
  ``min``, ``get``, ``state_dict``) or eager ``update``. Inserts are cheap and many small insert
  batches cost one propagation. The buffer is bounded (``STAGE`` writes): a lazy batch that would
  overfill it applies what waits first, so a tree nobody reads (a table only inserted into) holds
  no more than that. The numba backend copies lazy batches into one preallocated stage: no array
  per batch is kept, so an insert-only loop neither grows the heap nor faults in a fresh page a
  batch (measured ~4.5 us a fault on a VM, issue 21). When writes are applied never changes the
  result: every node is a function of the leaves alone (below).

Numerics and the drift bound. Internal nodes are never adjusted by deltas: every write recomputes
each touched parent as the plain left-to-right ``float64`` sum of its ``K`` children. So there is no
accumulated drift at all: after any number of updates each node is bit-identical to a fresh rebuild
from the leaves (the tests check exactly that after millions of updates, and
``benchmarks/bench_replay.py --drift`` after 10^8). Against the exact real sum of the leaves, the
root's error is that of one summation tree of depth ``d`` and fan-in ``K``:
``|total - exact| <= d * (K - 1) * 2**-53 * exact`` (about ``5.4e-15 * exact`` for 2^20 leaves and
``K = 8``: ``d = 7``), independent of how many updates came before.

Backends, behind this one class.
- ``"numba"`` (default, CPU): numpy arrays and ``numba`` kernels, one compiled loop per batch. On CPU
  it measures 5-20x faster than the vectorized torch path (see ``docs/benchmarks.md``).
- ``"torch"``: the same layout as a torch tensor on any ``device`` (CPU or CUDA); batched ops are
  vectorized across the batch, one pass per level, no Python loop per item. Inputs may be numpy
  arrays or tensors; outputs are tensors on ``device``.

Concurrency. A ``SumTree`` is safe to share between threads: every public method holds an internal
lock for its whole duration, so each call is atomic (the numba kernels release the GIL, so without
the lock two threads really could interleave inside a propagation). Compound sequences (read the
total, then sample) are not atomic together; the owner (a selector inside a ``Table``) serializes
those under its own lock.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Literal

import numba
import numpy as np
import torch

from .._native import host_huge_zeros, prefetch

__all__ = ["DEFAULT_ARITY", "PriorityOverflowError", "SumTree"]

#: Default fan-in, chosen by ``benchmarks/bench_replay.py --arity`` (see docs/benchmarks.md).
DEFAULT_ARITY = 8

_INF = math.inf

#: Buffered lazy writes at most (leaf writes, 16 bytes each: 128 KiB, cache-resident): a lazy batch
#: that would pass it applies the buffer first; one larger than it is applied at once.
STAGE = 8192


def _fits(total: float) -> bool:
    """The one test of a tree's total, at every write and at load: finite with a margin, since the
    tree's own summation order (and numpy's, at load) may round a total this close to the float64
    limit up to inf."""
    return total * (1.0 + 1e-12) < _INF
_NO_INDICES = np.empty(0, dtype=np.int64)
_NO_PRIORITIES = np.empty(0, dtype=np.float64)


class PriorityOverflowError(ValueError):
    """Finite priorities that would make a sum tree's total overflow float64 (``inf``: every later
    sample would divide by it). ``position`` is the batch position named (the largest priority, or
    the first that is not finite), ``why`` the arithmetic."""

    def __init__(self, message: str, position: int, why: str) -> None:
        super().__init__(message)
        self.position = position
        self.why = why


# --------------------------------------------------------------------------------------------------
# Layout


def _layout(capacity: int, arity: int) -> tuple[np.ndarray, np.ndarray]:
    """Level offsets and padded level lengths, root first, leaves last (at least one level below root)."""
    live = [capacity]
    while live[-1] > 1 or len(live) == 1:
        live.append(-(-live[-1] // arity))
    live.reverse()  # live[0] == 1 (the root), live[-1] == capacity
    # Every level, the root's included, is padded to a multiple of K: with K a power of two >= 8 every
    # child block then starts on a 64-byte boundary (see _aligned_zeros) and is whole cache lines.
    lengths = [arity] + [live[level - 1] * arity for level in range(1, len(live))]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(lengths)
    return offsets, np.asarray(lengths, dtype=np.int64)


def _aligned_full(size: int, value: float) -> np.ndarray:
    """A float64 array of ``size`` filled with ``value``, its data on a 64-byte (cache line)
    boundary; from 2 MiB up, on transparent huge pages (``host_huge_zeros``: a descent's misses at
    the wide lower levels then skip the TLB misses too)."""
    raw = host_huge_zeros((size,), torch.float64).numpy()
    raw.fill(value)
    return raw


# --------------------------------------------------------------------------------------------------
# numba kernels (CPU backend). All loops are over the batch inside compiled code.


@numba.njit(cache=True, nogil=True)
def _nb_check(
    indices: np.ndarray, priorities: np.ndarray, capacity: int, out_sum: np.ndarray
) -> int:  # pragma: no cover - jit
    """Return -1 if every index is in range and every priority finite and >= 0, else the bad position;
    ``out_sum[0]`` gets the priorities' left-to-right sum (``inf`` when it overflows)."""
    for i in range(indices.shape[0]):
        j = indices[i]
        if j < 0 or j >= capacity:
            return i
    s = 0.0
    for i in range(priorities.shape[0]):
        p = priorities[i]
        if not (p >= 0.0 and p < _INF):  # also rejects NaN
            return indices.shape[0] + i
        s += p
    out_sum[0] = s
    return -1


@numba.njit(cache=True, nogil=True)
def _nb_write(
    sums: np.ndarray,
    mins: np.ndarray,
    offsets: np.ndarray,
    arity: int,
    indices: np.ndarray,
    priorities: np.ndarray,
    stamp: np.ndarray,
    gen: int,
) -> int:  # pragma: no cover - jit
    """Set leaves in order (last write wins), then recompute each touched parent once per level.

    A first pass prefetches, for every index, the lines a write will miss on: the leaf's block of
    ``K`` siblings and its parent's entries in the bottom internal level (sum, min, stamp). Those are
    the levels too large to stay cached (8 MB and 1 MB each for 2^20 leaves); the levels above are a
    few hundred KB and were just touched by this pass's parents. With the misses of the whole batch
    in flight together instead of one item's at a time, an update of 256 random leaves took
    ~30% less (33 -> 23 us, caches flushed between calls); prefetching one more level, or only the
    leaves, measured slower (26 us, 37 us). Each level then visits only the distinct nodes the level
    below touched (kept in place in ``cur``), not one entry per write: a buffered batch of 8,192
    ring slots visits ~1.14 entries a write in all, not one per level.
    """
    depth = offsets.shape[0] - 2
    leaf0 = offsets[depth]
    m = indices.shape[0]
    pbase = offsets[depth - 1]
    for i in range(m):
        parent = indices[i] // arity
        prefetch(sums.ctypes.data + (leaf0 + parent * arity) * 8)
        prefetch(sums.ctypes.data + (pbase + parent) * 8)
        prefetch(mins.ctypes.data + (pbase + parent) * 8)
        prefetch(stamp.ctypes.data + (pbase + parent) * 8)
    cur = np.empty(m, dtype=np.int64)
    for i in range(m):
        j = indices[i]
        sums[leaf0 + j] = priorities[i]
        cur[i] = j
    k = m  # nodes touched on the level below; each level visits only the distinct ones of the last
    for level in range(depth - 1, -1, -1):
        gen += 1
        base = offsets[level]
        cbase = offsets[level + 1]
        out = 0
        for i in range(k):
            parent = cur[i] // arity
            node = base + parent
            if stamp[node] != gen:
                stamp[node] = gen
                _nb_recompute(sums, mins, node, cbase + parent * arity, arity, level == depth - 1)
                cur[out] = parent
                out += 1
        k = out
    return gen


@numba.njit(cache=True, inline="always")
def _nb_recompute(
    sums: np.ndarray, mins: np.ndarray, node: int, c0: int, arity: int, from_leaves: bool
) -> None:  # pragma: no cover - jit
    """Node = left-to-right sum of its children; min = smallest positive leaf below it.

    The min tree has no leaf level: the bottom internal level takes its minima straight from the
    leaves of the sum tree, so a write touches one leaf array, not two (measured ~30% off an update).
    """
    s = 0.0
    mn = _INF
    if from_leaves:
        for c in range(arity):
            v = sums[c0 + c]
            s += v
            if v > 0.0 and v < mn:
                mn = v
    else:
        for c in range(arity):
            s += sums[c0 + c]
            v = mins[c0 + c]
            if v < mn:
                mn = v
    sums[node] = s
    mins[node] = mn


@numba.njit(cache=True, nogil=True)
def _nb_rebuild(
    sums: np.ndarray, mins: np.ndarray, offsets: np.ndarray, arity: int
) -> None:  # pragma: no cover
    """Recompute every internal node from the leaves, with the same summation order as ``_nb_write``."""
    depth = offsets.shape[0] - 2
    for level in range(depth - 1, -1, -1):
        base = offsets[level]
        cbase = offsets[level + 1]
        for node in range((offsets[level + 2] - cbase) // arity):  # live nodes only, not the padding
            _nb_recompute(sums, mins, base + node, cbase + node * arity, arity, level == depth - 1)


#: Queries descended together by the sample kernels (see ``_descend``); 64 ~ 256 < 16 (us per draw).
_SAMPLE_GROUP = 64


@numba.njit(inline="always")
def _descend(
    sums: np.ndarray,
    offsets: np.ndarray,
    arity: int,
    uniforms: np.ndarray,
    stratified: bool,
    out_idx: np.ndarray,
    out_prob: np.ndarray,
) -> None:  # pragma: no cover - jit
    """Prefix-sum descent for each query; query j targets ``(j + u_j) / n * total`` when stratified.

    The scan of a block is branch-free: it takes the running sums of the ``K`` children and counts
    those ``<= u`` (the torch backend's arithmetic: both draw the same leaves wherever their node
    sums agree bit for bit; torch's ``block.sum`` may round differently for very wide-ranging
    priorities). The old scan broke out of its loop at the chosen child, and with fresh uniforms
    that exit mispredicts about once per level: ~10 ns per level per query, measured the same on a
    4 KB tree as on a 9 MB one, so the descent was bound by branches, not by memory. A block whose
    sum rounds below ``u`` (nothing counted short of ``K``) takes its last positive child, a rare
    branch.

    Memory: queries descend in groups, one level at a time, and every query's child block is
    prefetched before the group scans that level, so below the cached top levels the group's misses
    are in flight together. Inlined into its callers so that a constant ``arity`` unrolls the scan
    (``_nb_descend``: about 2x the generic scan's speed at the default arity).

    A node whose children would lie past its level (only a corrupt tree can lead there: a padding
    child is 0 and never taken) ends its query with index -1 and probability 0; callers that read
    trees from memory they do not own check for it (``reactor.replay.shared``).
    """
    depth = offsets.shape[0] - 2
    n = uniforms.shape[0]
    total = sums[0]
    group = _SAMPLE_GROUP
    node = np.zeros(group, dtype=np.int64)
    us = np.empty(group, dtype=np.float64)
    for g0 in range(0, n, group):
        gn = min(group, n - g0)
        for q in range(gn):
            j = g0 + q
            us[q] = (j + uniforms[j]) * (total / n) if stratified else uniforms[j] * total
            node[q] = 0
        for level in range(1, depth + 1):
            base = offsets[level]
            if level >= 3:  # levels 1-2 are a few lines, always cached
                for q in range(gn):
                    prefetch(sums.ctypes.data + (base + node[q] * arity) * 8)
            for q in range(gn):
                if node[q] < 0:
                    continue
                u = us[q]
                c0 = base + node[q] * arity
                if c0 + arity > offsets[level + 1]:  # a padding child was taken: a corrupt tree only
                    node[q] = -1  # (memory another process writes, reactor.replay.shared): no wild read
                    continue
                acc = 0.0
                before = 0.0
                chosen = 0
                for c in range(arity):
                    acc += sums[c0 + c]
                    le = acc <= u
                    before = acc if le else before
                    chosen += le
                if chosen == arity:  # rounding pushed u past the block: take its last positive child
                    chosen = arity - 1
                    while chosen > 0 and not sums[c0 + chosen] > 0.0:
                        chosen -= 1
                    u = sums[c0 + chosen]
                else:
                    u -= before
                us[q] = u
                node[q] = node[q] * arity + chosen
        leaf0 = offsets[depth]
        for q in range(gn):
            out_idx[g0 + q] = node[q]
            out_prob[g0 + q] = sums[leaf0 + node[q]] / total if node[q] >= 0 else 0.0


@numba.njit(cache=True, nogil=True)
def _nb_descend(
    sums: np.ndarray,
    offsets: np.ndarray,
    arity: int,
    uniforms: np.ndarray,
    stratified: bool,
    out_idx: np.ndarray,
    out_prob: np.ndarray,
) -> None:  # pragma: no cover - jit
    """Stratified or i.i.d. draws by prefix-sum descent (``_descend``), its scan unrolled at the
    default arity 8 (a compile-time constant there: about 2x the generic scan's speed). Called by
    ``SumTree.sample`` and by compiled owners (see ``SumTree.kernel_arrays``)."""
    if arity == 8:
        _descend(sums, offsets, 8, uniforms, stratified, out_idx, out_prob)
    else:
        _descend(sums, offsets, arity, uniforms, stratified, out_idx, out_prob)


# --------------------------------------------------------------------------------------------------
# The public class


Backend = Literal["numba", "torch"]



def _not_finite(priorities: Any, bad: int) -> PriorityOverflowError:
    """The refusal of ``priorities[bad]``, not a finite priority >= 0 (check_total's and _stage_checked's)."""
    why = f"{float(priorities[bad])!r} is not a finite priority >= 0"
    return PriorityOverflowError(f"SumTree priority at position {bad}: {why}", bad, why)

class SumTree:
    """A K-ary sum tree over ``capacity`` leaves with batched writes, stratified sampling and a min.

    See the module docstring for layout, lazy writing, the drift bound and the concurrency model.

    Args:
        capacity: number of leaves (slots ``0 .. capacity - 1``), >= 1.
        arity: fan-in ``K`` of every internal node, >= 2. The default was chosen by benchmark.
        backend: ``"numba"`` (numpy arrays, CPU) or ``"torch"`` (tensors on ``device``).
        device: torch device for the ``"torch"`` backend (default CPU); must be None for ``"numba"``.
        arrays: where the nodes live (numba backend): ``arrays(name, shape, dtype) -> ndarray``, e.g.
            :class:`~reactor.replay.shared.SharedArrays` (memory other processes map, for one-sided
            sampling: the tree then keeps its sums in ``"sums"`` and its minima in ``"mins"``).
            None: memory of its own.

    Raises:
        ValueError: capacity < 1, arity < 2, an unknown backend, or a device (or ``arrays``) with the
            other backend.

    Example:
        >>> tree = SumTree(8)
        >>> tree.update(np.array([1, 5]), np.array([1.0, 3.0]))
        >>> tree.total, tree.min
        (4.0, 1.0)
        >>> tree.sample(4, np.random.default_rng(0))[0]
        array([1, 5, 5, 5])
    """

    def __init__(
        self,
        capacity: int,
        arity: int = DEFAULT_ARITY,
        *,
        backend: Backend = "numba",
        device: torch.device | str | None = None,
        arrays: Any = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"SumTree capacity must be an int >= 1, got {capacity!r}")
        if isinstance(arity, bool) or not isinstance(arity, (int, np.integer)) or arity < 2:
            raise ValueError(f"SumTree arity must be an int >= 2, got {arity!r}")
        if backend not in ("numba", "torch"):
            raise ValueError(f"SumTree backend must be 'numba' or 'torch', got {backend!r}")
        if backend == "numba" and device is not None:
            raise ValueError(
                f"SumTree device={device!r} needs backend='torch'; the numba backend lives in host memory"
            )
        if backend == "torch" and arrays is not None:
            raise ValueError("SumTree arrays= needs backend='numba' (the torch backend keeps its nodes in tensors)")
        self._capacity = int(capacity)
        self._arity = int(arity)
        self._backend: Backend = backend
        self._offsets, self._lengths = _layout(self._capacity, self._arity)
        self._depth = len(self._lengths) - 1
        self._leaf0 = int(self._offsets[self._depth])
        size = int(self._offsets[-1])
        self._lock = threading.Lock()
        self._pending_idx: list[torch.Tensor] = []  # (torch backend; numba stages in the arrays below)
        self._pending_prio: list[torch.Tensor] = []
        self._pending_n = 0
        self._staged = 0
        # An upper bound of the total once the buffered writes are applied: the total at the last
        # flush plus every priority written since (a write replaces a leaf >= 0, so it adds at most
        # its value). A write is refused when even the exact total plus its sum is not finite.
        self._bound = 0.0
        self._sum_out = np.zeros(1)
        if backend == "numba":
            if arrays is None:
                self._sums = _aligned_full(size, 0.0)
                self._mins = _aligned_full(self._leaf0, _INF)  # internal nodes only (see _nb_recompute)
            else:  # (memory that may hold an earlier tree's nodes: start from empty)
                self._sums = arrays("sums", (size,), np.float64)
                self._sums.fill(0.0)
                self._mins = arrays("mins", (self._leaf0,), np.float64)
                self._mins.fill(_INF)
            self._stamp = np.zeros(self._leaf0, dtype=np.int64)
            self._gen = 0
            self._stage_idx = np.empty(STAGE, dtype=np.int64)
            self._stage_prio = np.empty(STAGE, dtype=np.float64)
        else:
            self._device = torch.device(device if device is not None else "cpu")
            self._tsums = torch.zeros(size, dtype=torch.float64, device=self._device)
            self._tmins = torch.full((self._leaf0,), _INF, dtype=torch.float64, device=self._device)
            self._toffsets = [int(o) for o in self._offsets]
            # Live nodes per level (root 1, ..., leaves capacity): the rest of a level is padding.
            self._tlive = [int(n) // self._arity for n in self._lengths[1:]] + [self._capacity]
            self._tarange = torch.arange(self._arity, device=self._device)

    # ---------------------------------------------------------------- properties

    @property
    def capacity(self) -> int:
        """Number of leaves."""
        return self._capacity

    @property
    def arity(self) -> int:
        """Fan-in ``K`` of every internal node."""
        return self._arity

    @property
    def depth(self) -> int:
        """Number of levels below the root (leaves are at this level)."""
        return self._depth

    @property
    def backend(self) -> Backend:
        """``"numba"`` or ``"torch"``."""
        return self._backend

    @property
    def total(self) -> float:
        """Sum of all leaves (applies buffered writes first)."""
        with self._lock:
            self._flush()
            return float(self._sums[0]) if self._backend == "numba" else float(self._tsums[0].item())

    @property
    def min(self) -> float:
        """Smallest positive leaf, ``inf`` if no leaf is positive (applies buffered writes first)."""
        with self._lock:
            self._flush()
            return float(self._mins[0]) if self._backend == "numba" else float(self._tmins[0].item())

    # ---------------------------------------------------------------- writes

    def update(self, indices: Any, priorities: Any, *, lazy: bool = False) -> None:
        """Set the leaves ``indices`` to ``priorities``; a repeated index keeps its last value.

        Args:
            indices: 1-D integer array (numpy or torch) of leaf indices in ``[0, capacity)``.
            priorities: 1-D float array of the same length, finite and >= 0.
            lazy: buffer the batch and apply it before the next read (insert-time priorities).

        Raises:
            ValueError: not 1-D, lengths differ, an index out of range, a priority negative, NaN or
                infinite, or priorities whose sum on top of the total overflows float64 (the total
                would be ``inf`` and every later sample would fail). The tree (and its buffer) is
                left unchanged.
        """
        with self._lock:
            idx, prio = self._validate(indices, priorities, copy=lazy and self._backend == "torch")
            self._buffer(idx, prio, lazy)

    def _buffer(self, idx: Any, prio: Any, lazy: bool) -> None:
        """Buffer a validated batch (``lazy``) or apply it now with what waits before it (caller holds
        the lock; ``_bound`` already counts the batch). Applying buffered writes early keeps
        ``_bound`` an upper bound of the total: the writes and their order are unchanged."""
        m = int(idx.shape[0])
        if self._backend == "torch":
            self._pending_idx.append(idx)
            self._pending_prio.append(prio)
            self._pending_n += m
            if not lazy:
                self._flush()
            elif self._pending_n > STAGE:
                self._write_pending()
            return
        s = self._staged
        if not lazy or s + m > STAGE:
            if s:
                self._write_pending()
                s = 0
            if not lazy or m > STAGE:
                if m:
                    self._gen = _nb_write(
                        self._sums, self._mins, self._offsets, self._arity, idx, prio, self._stamp, self._gen
                    )
                if not lazy:
                    self._bound = float(self._sums[0])
                return
        self._stage_idx[s : s + m] = idx
        self._stage_prio[s : s + m] = prio
        self._staged = s + m

    def _validate(self, indices: Any, priorities: Any, copy: bool) -> tuple[Any, Any]:
        if self._backend == "numba":
            idx = _as_numpy(indices, np.int64, "indices")
            prio = _as_numpy(priorities, np.float64, "priorities")
        else:
            idx = _as_tensor(indices, torch.int64, self._device, "indices")
            prio = _as_tensor(priorities, torch.float64, self._device, "priorities")
        if idx.ndim != 1 or prio.ndim != 1:
            raise ValueError(
                f"SumTree.update: indices and priorities must be 1-D, got shapes "
                f"{tuple(idx.shape)} and {tuple(prio.shape)}"
            )
        if idx.shape[0] != prio.shape[0]:
            raise ValueError(
                f"SumTree.update: {idx.shape[0]} indices but {prio.shape[0]} priorities; pass one priority per index"
            )
        if self._backend == "numba":
            bad = int(_nb_check(idx, prio, self._capacity, self._sum_out))
            if bad >= 0:
                if bad < idx.shape[0]:
                    self._raise_index(int(idx[bad]), bad)
                k = bad - idx.shape[0]
                self._raise_priority(float(prio[k]), k)
            self._bound = self._headroom(float(self._sum_out[0]), prio)
            if copy:  # a lazy batch outlives the call: the caller may reuse its arrays meanwhile
                idx, prio = idx.copy(), prio.copy()
        else:
            if idx.numel():
                bad_idx = (idx < 0) | (idx >= self._capacity)
                if bool(bad_idx.any()):
                    k = int(torch.nonzero(bad_idx)[0, 0])
                    self._raise_index(int(idx[k]), k)
                bad_p = ~((prio >= 0) & (prio < _INF))
                if bool(bad_p.any()):
                    k = int(torch.nonzero(bad_p)[0, 0])
                    self._raise_priority(float(prio[k]), k)
                self._bound = self._headroom(self._torch_sum(prio), prio)
            if copy:
                idx, prio = idx.clone(), prio.clone()
        return idx, prio

    def _torch_sum(self, prio: torch.Tensor) -> float:
        # Left to right, as the numba check sums (and as check_total predicts).
        return float(torch.cumsum(prio, 0)[-1].item()) if prio.numel() else 0.0

    def _headroom(self, psum: float, prio: Any) -> float:
        """The bound after writing priorities summing to ``psum``; raises ValueError (changing
        nothing the caller can observe: at most the buffered writes get applied) if it overflows
        even on top of the exact total. Caller holds the lock."""
        bound = self._bound + psum
        if _fits(bound):
            return bound
        self._flush()  # the bound may be loose: apply the buffer, then ask again with the exact total
        total = self._bound
        bound = total + psum
        if _fits(bound):
            return bound
        k = int(np.argmax(prio)) if self._backend == "numba" else int(torch.argmax(prio).item())
        why = f"the batch sums to {psum!r} on top of a total of {total!r}: the total would be inf"
        raise PriorityOverflowError(
            f"SumTree priority {float(prio[k])!r} at position {k} would overflow the tree ({why}); "
            "the total must stay finite (float64)", k, why,
        )

    def update_checked(self, indices: np.ndarray, priorities: np.ndarray, psum: float, *, lazy: bool = False) -> None:
        """:meth:`update` for priorities that :meth:`check_total` accepted (numba backend): ``priorities``
        is the float64 array it checked, unchanged, and ``psum`` what it returned. Skips the second
        pass over the priorities; the indices are still checked, and the total's bound still applied.

        Raises:
            ValueError: as :meth:`update`; the tree is left unchanged.
        """
        if self._backend != "numba":
            self.update(indices, priorities, lazy=lazy)
            return
        with self._lock:
            idx = indices
            if not (type(idx) is np.ndarray and idx.dtype == np.int64 and idx.flags.c_contiguous):
                idx = _as_numpy(indices, np.int64, "indices")
            if idx.ndim != 1 or idx.shape != priorities.shape:
                raise ValueError(
                    f"SumTree.update_checked: {idx.shape} indices but {priorities.shape} priorities; pass one per index"
                )
            bad = int(_nb_check(idx, _NO_PRIORITIES, self._capacity, self._sum_out))
            if bad >= 0:
                self._raise_index(int(idx[bad]), bad)
            self._bound = self._headroom(psum, priorities)
            self._buffer(idx, priorities, lazy)

    def _stage_room(self, m: int, psum: float, priorities: np.ndarray) -> int:
        """For a caller that writes ``m`` lazy writes straight into the buffer (``Table``'s one-kernel
        insert; numba backend, the lock held), priorities that :meth:`check_total` accepted summing to
        ``psum``: the bound raised as :meth:`update_checked` raises it (PriorityOverflowError as it), and
        room made for them (the buffer applied first if they would overfill it). Returns the buffer's
        fill, where the caller writes from; -1, with nothing changed, for more writes than the buffer
        holds. The caller sets ``_staged`` to the fill after its writes."""
        if m > STAGE:
            return -1
        self._bound = self._headroom(psum, priorities)
        if self._staged + m > STAGE:
            self._write_pending()
        return self._staged

    def _stage_checked(self, priorities: np.ndarray, m: int) -> int:
        """:meth:`check_total` and :meth:`_stage_room` in one (numba backend, the lock held): for
        ``m`` lazy writes of which those of ``priorities`` (float64, C-contiguous) are the nonzero
        ones. Returns the buffer's fill, or -1 with nothing changed where :meth:`_stage_room` makes
        no room; raises :class:`PriorityOverflowError` (nothing changed) for a priority that is not
        finite and >= 0, or a total that would overflow."""
        bad = int(_nb_check(_NO_INDICES, priorities, self._capacity, self._sum_out))
        if bad >= 0:
            raise _not_finite(priorities, bad)
        return self._stage_room(m, float(self._sum_out[0]), priorities)

    def check_total(self, priorities: Any) -> float:
        """Raise :class:`PriorityOverflowError` if :meth:`update` with ``priorities`` would be refused
        for a value that is not finite (or negative) or for making the total overflow; otherwise
        change nothing.

        For owners that must refuse a write before they change anything of their own (a ``Table``
        checks, then appends its steps, then writes the tree): with the same writes in between
        (deletes write zeros), the later :meth:`update` with these priorities then succeeds.
        """
        with self._lock:
            if self._backend == "numba":
                prio = priorities
                if not (type(prio) is np.ndarray and prio.dtype == np.float64 and prio.flags.c_contiguous):
                    prio = _as_numpy(priorities, np.float64, "priorities")
                bad = int(_nb_check(_NO_INDICES, prio, self._capacity, self._sum_out))
                psum = float(self._sum_out[0])
            else:
                prio = _as_tensor(priorities, torch.float64, self._device, "priorities")
                finite = (prio >= 0) & (prio < _INF)
                bad = -1 if bool(finite.all()) else int(torch.nonzero(~finite)[0, 0])
                psum = self._torch_sum(prio)
            if bad >= 0:
                raise _not_finite(prio, bad)
            self._headroom(psum, prio)
            return psum

    def _raise_index(self, value: int, position: int) -> None:
        raise ValueError(
            f"SumTree index {value} at position {position} is out of range [0, {self._capacity}); "
            f"indices must address existing leaves"
        )

    def _raise_priority(self, value: float, position: int) -> None:
        raise ValueError(
            f"SumTree priority {value!r} at position {position} is invalid; priorities must be finite and >= 0"
        )

    def flush(self) -> None:
        """Apply buffered writes now (a reader of the node arrays in another process sees only
        applied ones: see :mod:`reactor.replay.shared`)."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        """Apply buffered writes in one pass (caller holds the lock); the bound becomes the total."""
        self._write_pending()
        self._bound = self._root()

    def _write_pending(self) -> None:
        """Apply the buffered writes in one pass, leaving ``_bound`` alone (caller holds the lock)."""
        if self._backend == "numba":
            s = self._staged
            if s:
                self._staged = 0
                self._gen = _nb_write(self._sums, self._mins, self._offsets, self._arity, self._stage_idx[:s],
                                      self._stage_prio[:s], self._stamp, self._gen)
            return
        if not self._pending_n:
            self._pending_idx.clear()
            self._pending_prio.clear()
            return
        if len(self._pending_idx) == 1:
            idx, prio = self._pending_idx[0], self._pending_prio[0]
        else:
            idx, prio = torch.cat(self._pending_idx), torch.cat(self._pending_prio)
        self._pending_idx.clear()
        self._pending_prio.clear()
        self._pending_n = 0
        self._torch_write(idx, prio)

    def _torch_write(self, idx: torch.Tensor, prio: torch.Tensor) -> None:
        # Last write wins: keep the last occurrence of each index (a stable sort keeps call order).
        order = torch.argsort(idx, stable=True)
        sidx = idx[order]
        keep = torch.ones_like(sidx, dtype=torch.bool)
        keep[:-1] = sidx[1:] != sidx[:-1]
        self.write_async(sidx[keep], prio[order][keep])  # leaves distinct now: each ancestor from its children

    def _root(self) -> float:
        return float(self._sums[0]) if self._backend == "numba" else float(self._tsums[0].item())

    def clear(self) -> None:
        """Set every leaf to 0 and drop buffered writes."""
        with self._lock:
            self._pending_idx.clear()
            self._pending_prio.clear()
            self._pending_n = self._staged = 0
            self._bound = 0.0
            if self._backend == "numba":
                self._sums.fill(0.0)
                self._mins.fill(_INF)
            else:
                self._tsums.fill_(0.0)
                self._tmins.fill_(_INF)

    # ---------------------------------------------------------------- reads

    def get(self, indices: Any) -> Any:
        """Current priorities of leaves ``indices`` (applies buffered writes first).

        Raises:
            ValueError: not 1-D or an index out of range.
        """
        with self._lock:
            self._flush()
            if self._backend == "numba":
                idx = _as_numpy(indices, np.int64, "indices")
                ok = idx.ndim == 1 and (idx.size == 0 or (idx.min() >= 0 and idx.max() < self._capacity))
                leaves = self._sums
            else:
                idx = _as_tensor(indices, torch.int64, self._device, "indices")
                ok = idx.ndim == 1 and (idx.numel() == 0 or bool(((idx >= 0) & (idx < self._capacity)).all()))
                leaves = self._tsums
            if idx.ndim != 1:
                raise ValueError(f"SumTree.get: indices must be 1-D, got shape {tuple(idx.shape)}")
            if not ok:
                bad = [int(i) for i in idx.tolist() if not 0 <= i < self._capacity][0]
                raise ValueError(f"SumTree.get: index {bad} is out of range [0, {self._capacity})")
            return leaves[self._leaf0 + idx]

    def kernel_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``(sums, mins, offsets, arity)`` with buffered writes applied, for an owner that descends
        the tree in its own compiled code (the ``Table``'s one-call window sample, through
        ``_nb_descend``).

        The layout is the module docstring's: ``sums[0]`` is the total and ``mins[0]`` the smallest
        positive leaf. The arrays are the tree's own: the caller reads them only, and only while it
        keeps every writer out (a ``Table`` holds its lock; its selector's tree has no other writer).

        Raises:
            ValueError: the tree has the torch backend (its nodes are a tensor).
        """
        if self._backend != "numba":
            raise ValueError("SumTree.kernel_arrays: the torch backend keeps its nodes in a tensor; use sample()")
        with self._lock:
            self._flush()
        return self._sums, self._mins, self._offsets, self._arity

    def sample(self, n: int, rng: Any, *, stratified: bool = True) -> tuple[Any, Any]:
        """Draw ``n`` leaves with probability proportional to their priority.

        Stratified (the PER recipe): the mass ``[0, total)`` is cut into ``n`` equal segments and
        query ``j`` takes a uniform point in segment ``j``; every drawn leaf still has marginal
        probability ``p_i / total`` per draw on average, with lower variance than i.i.d. draws.
        The indices come out in leaf order. The result is a pure function of the tree and ``rng``.

        Args:
            n: number of draws, >= 0.
            rng: a ``np.random.Generator`` (both backends: uniforms are drawn on the host) or,
                for the torch backend, a ``torch.Generator`` on the tree's device.
            stratified: False for i.i.d. draws.

        Returns:
            ``(indices int64[n], probabilities float64[n])``: numpy arrays (numba) or tensors (torch).

        Raises:
            ValueError: ``n`` negative, or the total is 0 (nothing to sample).
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"SumTree.sample: n must be an int >= 0, got {n!r}")
        with self._lock:
            self._flush()
            total = float(self._sums[0]) if self._backend == "numba" else float(self._tsums[0].item())
            if not total > 0.0:
                raise ValueError("SumTree.sample: every priority is 0; write a positive priority first")
            if self._backend == "numba":
                uniforms = rng.random(n)
                out_idx = np.empty(n, dtype=np.int64)
                out_prob = np.empty(n, dtype=np.float64)
                _nb_descend(self._sums, self._offsets, self._arity, uniforms, stratified, out_idx, out_prob)
                return out_idx, out_prob
            return self._torch_sample(n, rng, stratified, total)

    def _torch_sample(
        self, n: int, rng: Any, stratified: bool, total: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(rng, np.random.Generator):
            uniforms = torch.from_numpy(rng.random(n)).to(self._device)
        else:
            uniforms = torch.rand(n, dtype=torch.float64, device=self._device, generator=rng)
        if stratified:
            u = (torch.arange(n, device=self._device, dtype=torch.float64) + uniforms) * (total / max(n, 1))
        else:
            u = uniforms * total
        node = self._torch_descend(u)
        return node, self._tsums[self._toffsets[self._depth] + node] / total

    def _torch_descend(self, u: torch.Tensor) -> torch.Tensor:
        """The leaf holding each point ``u`` of the mass, level by level (batched, on the device)."""
        node = torch.zeros(u.shape[0], dtype=torch.int64, device=self._device)
        last_col = self._arity - 1
        for level in range(1, self._depth + 1):
            block = self._tsums[self._toffsets[level] + node[:, None] * self._arity + self._tarange]
            csum = torch.cumsum(block, dim=1)
            chosen = (csum <= u[:, None]).sum(dim=1)
            over = chosen > last_col
            # Rounding pushed u past the block: take its last positive child.
            last_pos = last_col - torch.argmax(torch.flip(block > 0, dims=[1]).to(torch.int8), dim=1)
            chosen = torch.where(over, last_pos, chosen)
            before = torch.where(
                chosen > 0,
                torch.gather(csum, 1, (chosen - 1).clamp_min(0)[:, None])[:, 0],
                torch.zeros_like(u),
            )
            u = torch.where(over, torch.gather(block, 1, chosen[:, None])[:, 0], u - before)
            # (every priority 0, sample_async's case: the descent would walk into a level's padding)
            node = (node * self._arity + chosen).clamp_(max=self._tlive[level] - 1)
        return node

    # ---------------------------------------------------------------- device-resident use (no host sync)

    def sample_async(self, n: int, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`sample` (stratified) for the torch backend without a host sync: the total stays a
        tensor on the device, so a GPU tree draws while the host runs ahead (GEAR's sampling where the
        data lives). Buffered (lazy) writes are not applied here: use :meth:`write_async` with it.

        Returns:
            ``(indices int64[n], probabilities float64[n])`` on the tree's device. The caller
            guarantees a positive total (every leaf 0 draws leaf 0 with probability 0).
        """
        if self._backend != "torch":
            raise ValueError("SumTree.sample_async needs backend='torch' (the numba backend samples on the host)")
        dev = self._device
        total = self._tsums[0]
        uniforms = torch.rand(n, dtype=torch.float64, device=dev, generator=generator)
        u = (torch.arange(n, device=dev, dtype=torch.float64) + uniforms) * (total / max(n, 1))
        node = self._torch_descend(u)
        return node, self._tsums[self._toffsets[self._depth] + node] / total.clamp_min(1e-300)

    def write_async(self, indices: torch.Tensor, priorities: torch.Tensor) -> None:
        """Set leaves to priorities on the device without a host sync or a check (the caller's
        priorities are finite and >= 0: :class:`reactor.replay.device.DeviceReplay` guarantees it).
        A leaf written twice in one call takes one of its values. Every ancestor is recomputed from
        its children, level by level; a node reached twice gets the same sum both times."""
        if self._backend != "torch":
            raise ValueError("SumTree.write_async needs backend='torch'")
        self._tsums[self._toffsets[self._depth] + indices] = priorities.to(torch.float64)
        nodes = indices
        for level in range(self._depth - 1, -1, -1):
            nodes = nodes // self._arity
            children = self._toffsets[level + 1] + nodes[:, None] * self._arity + self._tarange
            block = self._tsums[children]
            self._tsums[self._toffsets[level] + nodes] = block.sum(dim=1)
            if level == self._depth - 1:
                block = torch.where(block > 0, block, torch.full_like(block, _INF))
            else:
                block = self._tmins[children]
            self._tmins[self._toffsets[level] + nodes] = block.amin(dim=1)

    def total_tensor(self) -> torch.Tensor:
        """The total as a 0-d tensor on the device (torch backend; no host sync)."""
        if self._backend != "torch":
            raise ValueError("SumTree.total_tensor needs backend='torch'")
        return self._tsums[0]

    def leaves_async(self, indices: torch.Tensor) -> torch.Tensor:
        """Leaves ``indices`` as a tensor on the device (torch backend; no check, no host sync)."""
        if self._backend != "torch":
            raise ValueError("SumTree.leaves_async needs backend='torch'")
        return self._tsums[self._toffsets[self._depth] + indices]

    def device_layout(self) -> tuple[torch.Tensor, list[int], int, int, list[int]]:
        """``(node sums, level offsets, arity, depth, live nodes per level)`` of the torch backend: what a
        kernel that walks the tree itself (reactor.replay._devicekernels) reads. The sums are the live
        tensor."""
        if self._backend != "torch":
            raise ValueError("SumTree.device_layout needs backend='torch'")
        return self._tsums, list(self._toffsets), self._arity, self._depth, list(self._tlive)

    def min_tensor(self) -> torch.Tensor:
        """The smallest positive leaf as a 0-d tensor on the device (torch backend; no host sync)."""
        if self._backend != "torch":
            raise ValueError("SumTree.min_tensor needs backend='torch'")
        return self._tmins[0] if self._leaf0 > 0 else self._tsums[0]

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Capacity, arity and the leaves (numpy float64) after applying buffered writes.

        Internal nodes are not saved: they are a pure function of the leaves, so
        :meth:`load_state_dict` rebuilds them bit for bit.
        """
        with self._lock:
            self._flush()
            if self._backend == "numba":
                leaves = self._sums[self._leaf0 : self._leaf0 + self._capacity].copy()
            else:
                leaves = self._tsums[self._leaf0 : self._leaf0 + self._capacity].cpu().numpy().copy()
            return {"capacity": self._capacity, "arity": self._arity, "leaves": leaves}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the leaves saved by :meth:`state_dict` and rebuild the internal nodes.

        Raises:
            ValueError: capacity or arity differ from this tree's, or the leaves are malformed.
                The tree is left unchanged.
        """
        capacity, arity = int(state["capacity"]), int(state["arity"])
        if capacity != self._capacity or arity != self._arity:
            raise ValueError(
                f"SumTree.load_state_dict: state is for capacity={capacity}, arity={arity} but this tree has "
                f"capacity={self._capacity}, arity={self._arity}; build a matching tree"
            )
        leaves = np.asarray(state["leaves"], dtype=np.float64)
        if leaves.shape != (self._capacity,) or not bool(np.all((leaves >= 0) & (leaves < _INF))):
            raise ValueError(
                f"SumTree.load_state_dict: leaves must be {self._capacity} finite values >= 0, "
                f"got shape {leaves.shape}"
            )
        with np.errstate(over="ignore"):
            total = float(np.sum(leaves))
        if not _fits(total):
            raise ValueError(
                f"SumTree.load_state_dict: the leaves sum to {total!r}; the total must stay "
                "well inside float64 (a state no tree could have reached)"
            )
        with self._lock:
            self._pending_idx.clear()
            self._pending_prio.clear()
            self._pending_n = self._staged = 0
            if self._backend == "numba":
                self._sums.fill(0.0)
                self._mins.fill(_INF)
                self._sums[self._leaf0 : self._leaf0 + self._capacity] = leaves
                _nb_rebuild(self._sums, self._mins, self._offsets, self._arity)
            else:
                self._tsums.fill_(0.0)
                self._tmins.fill_(_INF)
                self._torch_write(
                    torch.arange(self._capacity, device=self._device),
                    torch.from_numpy(leaves).to(self._device),
                )
            self._bound = self._root()

    def check_invariants(self) -> None:
        """Verify every internal node equals a fresh recompute from the leaves, bit for bit.

        For tests and debugging (O(capacity)).

        Raises:
            AssertionError: a node differs, naming the first one.
        """
        with self._lock:
            self._flush()
            if self._backend == "numba":
                sums, mins = self._sums.copy(), self._mins.copy()
            else:
                sums, mins = self._tsums.cpu().numpy().copy(), self._tmins.cpu().numpy().copy()
        ref_s, ref_m = sums.copy(), mins.copy()
        _nb_rebuild(ref_s, ref_m, self._offsets, self._arity)
        n = self._leaf0  # internal nodes; the min tree has no leaf level
        if self._backend == "numba":
            sum_bad = ref_s[:n] != sums[:n]
        else:  # torch reductions may sum in another order: allow the documented bound
            tol = self._depth * (self._arity - 1) * 2.0**-52 * np.abs(ref_s[:n])
            sum_bad = np.abs(ref_s[:n] - sums[:n]) > tol
        bad = np.flatnonzero(sum_bad | (ref_m != mins))
        if bad.size:
            k = int(bad[0])
            raise AssertionError(
                f"SumTree node {k}: sum {sums[k]!r} vs recomputed {ref_s[k]!r}, min {mins[k]!r} vs {ref_m[k]!r}"
            )

    def __repr__(self) -> str:
        return f"SumTree(capacity={self._capacity}, arity={self._arity}, backend={self._backend!r})"


def _as_numpy(x: Any, dtype: type, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype != dtype:
        if dtype is np.int64 and arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"SumTree {what} must be integers, got dtype {arr.dtype}")
        arr = arr.astype(dtype)
    return np.ascontiguousarray(arr)


def _as_tensor(x: Any, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if dtype == torch.int64 and t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise ValueError(f"SumTree {what} must be integers, got dtype {t.dtype}")
    return t.to(device=device, dtype=dtype)
