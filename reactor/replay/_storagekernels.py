"""The storage's compiled kernels (numba): ring slots, the episode index's appends, windows' valid
ranges and their expansion, and the window copy (one contiguous run per field, prefetched ahead)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from .._native import copy_bytes, full_fence, prefetch, zero_bytes

#: Windows whose source rows ``_nb_copy_windows`` prefetches ahead of the one it copies: measured
#: (256 x 32-step windows of 45 B/step from 2^20 steps) 0: 55 us, 1-4: 46-48 us, 6-32: 48-50 us.
_PREFETCH_WINDOWS = 3


@numba.njit(inline="always")
def _ring_slot(x: int, base: int, base_slot: int, cap: int) -> int:  # pragma: no cover - jit
    """``x % cap`` (Python semantics) given ``base_slot == base % cap``, without a division when
    ``|x - base| < cap`` (every stored step against the first stored one; every window offset): a
    64-bit ``%`` costs ~15-40 cycles, and a window read took six per window. Falls back to ``%``."""
    d = x - base
    if d >= cap or d <= -cap:
        return x % cap
    r = base_slot + d
    r = r - cap if r >= cap else r
    return r + cap if r < 0 else r


@numba.njit(cache=True, nogil=True)
def _nb_index_append(step_ep: np.ndarray, ep_start: np.ndarray, ep_len: np.ndarray, ends: np.ndarray, first: int,
                     eid: int, open_: bool, cap: int) -> int:  # pragma: no cover - jit
    """The episode index of an append of ``len(ends)`` steps from global step ``first``: each step's
    episode id, and each episode's start and length (``eid``: the first step's episode, the open one
    when ``open_``). Returns the next episode id. One pass instead of a cumsum, a segment search and
    two scatters in numpy (an append of 256 one-step episodes: ~20 us of numpy calls)."""
    slot = eid % cap
    if not open_:
        ep_start[slot] = first
        ep_len[slot] = 0
    pos = first % cap
    n = ends.shape[0]
    for i in range(n):
        step_ep[pos] = eid
        ep_len[slot] += 1
        pos += 1
        if pos == cap:
            pos = 0
        if ends[i] and i + 1 < n:
            eid += 1
            slot += 1  # (eid % cap) one on: no 64-bit division per episode (one-step episodes: 256 a call)
            if slot == cap:
                slot = 0
            ep_start[slot] = first + i + 1
            ep_len[slot] = 0
    return eid + 1


@numba.njit(cache=True, nogil=True)
def _nb_plan_append(ends: np.ndarray, next_step: int, next_ep: int, first_step: int, first_ep: int, open_: bool,
                    step_ep: np.ndarray, ep_start: np.ndarray, ep_len: np.ndarray, cap: int,
                    out: np.ndarray) -> int:  # pragma: no cover - jit
    """``Storage.plan_append``'s eviction plan for an append of ``len(ends)`` steps, in one call
    (~3 us of numpy scalars and calls before): ``out`` gets the storage's first step and first
    episode after the append's evictions. Returns 0, or why the append is refused (``plan_append``
    says it): 1, it would leave an open episode of the whole capacity; 2, the open episode would have
    to evict its own start."""
    length = ends.shape[0]
    if not ends[length - 1]:
        tail = length + (ep_len[(next_ep - 1) % cap] if open_ else 0)
        for i in range(length - 1, -1, -1):
            if ends[i]:
                tail = length - 1 - i
                break
        if tail >= cap:
            return 1
    needed = next_step + length - cap  # lowest global step that may remain
    new_first_step, new_first_ep = first_step, first_ep
    if needed > first_step:
        if needed < next_step:
            e = step_ep[needed % cap]
            new_first_ep = e if ep_start[e % cap] == needed else e + 1
        else:
            new_first_ep = next_ep
        if open_ and new_first_ep > next_ep - 1:
            return 2
        new_first_step = ep_start[new_first_ep % cap] if new_first_ep < next_ep else next_step
    out[0] = new_first_step
    out[1] = new_first_ep
    return 0


@numba.njit(cache=True, nogil=True)
def _nb_window_ranges(
    steps: np.ndarray,
    length: int,
    head: bool,
    step_ep: np.ndarray,
    ep_start: np.ndarray,
    ep_len: np.ndarray,
    first_step: int,
    next_step: int,
    first_ep: int,
    pos: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
) -> int:  # pragma: no cover - jit
    """Ring position of each window's first step and its valid range ``[lo, hi)`` within ``[0, length)``.

    Tail padding: the window starts at the step and stops at the episode's end; head padding: it
    ends at the step and starts at the episode's first step. Three passes, each prefetching what
    the next one reads (the step's episode id, then that episode's start and length), so the
    random index lookups overlap instead of paying one cache miss after another.

    Returns -1, or the position of the first step that is not stored (nothing is written then).
    """
    cap = step_ep.shape[0]
    b = steps.shape[0]
    f0 = first_step % cap
    e0 = first_ep % cap
    for j in range(b):
        s = steps[j]
        if s < first_step or s >= next_step:
            return j
        r = _ring_slot(s, first_step, f0, cap)
        pos[j] = r  # the step's ring slot, until the last pass
        prefetch(step_ep.ctypes.data + r * 8)
    for j in range(b):
        e = _ring_slot(step_ep[pos[j]], first_ep, e0, cap)
        lo[j] = e  # the episode's index slot, until the last pass
        prefetch(ep_start.ctypes.data + e * 8)
        prefetch(ep_len.ctypes.data + e * 8)
    for j in range(b):
        s = steps[j]
        e = lo[j]
        start = ep_start[e]
        if head:
            base = s - (length - 1)
            lo[j] = max(0, start - base)
            hi[j] = length
        else:
            base = s
            lo[j] = 0
            hi[j] = min(length, start + ep_len[e] - s)
        pos[j] = _ring_slot(base, first_step, f0, cap)  # in [0, cap) for a negative base too
    return -1


def expand_window_spans(spans: np.ndarray, length: int, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, mask, versions)``, each ``[B, length]``, from :meth:`Storage.window_spans`.

    ``versions`` are the global steps the positions hold, ``rows`` their ring slots
    (``versions % capacity``), ``mask`` False at padding. Equal to :meth:`Storage.plan_windows`
    (plus the versions a sequence-locked reader checks).

    Raises:
        ValueError: ``spans`` is not int64-convertible ``[B, 3]`` with ``0 <= lo < hi <= length``.
    """
    spans = np.asarray(spans)
    if spans.ndim != 2 or spans.shape[1] != 3 or spans.dtype.kind not in "iu":
        raise ValueError(f"window spans must be an integer [B, 3] array, got dtype {spans.dtype} shape {spans.shape}")
    b = spans.shape[0]
    rows = np.empty((b, length), dtype=np.int64)
    versions = np.empty((b, length), dtype=np.int64)
    mask = np.empty((b, length), dtype=np.bool_)
    if _nb_expand_spans(np.ascontiguousarray(spans, dtype=np.int64), int(length), int(capacity), rows, versions, mask) < 0:
        raise ValueError(f"window spans need 0 <= lo < hi <= {length} for every window")
    return rows, mask, versions


@numba.njit(cache=True, nogil=True)
def _nb_expand_spans(
    spans: np.ndarray, length: int, capacity: int, rows: np.ndarray, versions: np.ndarray, mask: np.ndarray
) -> int:  # pragma: no cover - jit
    """:func:`expand_window_spans` in one pass (numpy's version was ~37 us for 64 windows x 32); -1 on a bad span."""
    b = spans.shape[0]
    for i in range(b):
        lo, hi = spans[i, 1], spans[i, 2]
        if lo < 0 or hi <= lo or hi > length:
            return -1
    for i in range(b):
        base, lo, hi = spans[i, 0], spans[i, 1], spans[i, 2]
        for j in range(length):
            k = min(max(j, lo), hi - 1)
            v = base + k
            versions[i, j] = v
            rows[i, j] = v % capacity
            mask[i, j] = lo <= j < hi
    return 0


@numba.njit(cache=True, nogil=True)
def _nb_copy_windows(
    src_addrs: np.ndarray,
    row_nbytes: np.ndarray,
    dst_addrs: np.ndarray,
    capacity: int,
    pos: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
    length: int,
    mask: np.ndarray,
    ahead: int,
) -> None:  # pragma: no cover - jit
    """Copy windows field by field as whole contiguous runs, zero the padding, fill the mask.

    Field ``f`` of window ``j`` goes to address ``dst_addrs[f] + j * length * row_nbytes[f]``
    (``length`` rows of a contiguous ``[B, length, ...]`` output). Its valid rows ``[lo[j], hi[j])`` are one contiguous run of the field's ring
    (two at the ring's end), so a window costs one ``memcpy`` per field instead of one row copy per
    step; the padding rows are zeroed with ``memset``. Each window's runs start at random places in
    a ring much larger than the caches, so while copying window ``j`` the kernel prefetches every
    line of window ``j + ahead``: the misses of several windows are then in flight at
    once (the copy itself is cheap; waiting on memory one window after another was the cost).
    """
    b = pos.shape[0]
    nf = src_addrs.shape[0]
    for j in range(-ahead, b):
        k = j + ahead
        if k < b:
            s = _ring_slot(pos[k] + lo[k], 0, 0, capacity)
            n1 = min(hi[k] - lo[k], capacity - s)
            for f in range(nf):
                rb = row_nbytes[f]
                if rb == 0:
                    continue
                first = src_addrs[f] + s * rb
                for line in range(first & ~63, first + n1 * rb, 64):
                    prefetch(line)
        if j < 0:
            continue
        a = lo[j]
        z = hi[j]
        for t in range(length):
            mask[j, t] = a <= t < z
        s = _ring_slot(pos[j] + a, 0, 0, capacity)
        n = z - a
        n1 = min(n, capacity - s)
        for f in range(nf):
            rb = row_nbytes[f]
            if rb == 0:
                continue
            dst = dst_addrs[f] + j * length * rb
            if a > 0:
                zero_bytes(dst, a * rb)
            copy_bytes(dst + a * rb, src_addrs[f] + s * rb, n1 * rb)
            if n > n1:  # the run wraps around the ring's end
                copy_bytes(dst + (a + n1) * rb, src_addrs[f], (n - n1) * rb)
            if z < length:
                zero_bytes(dst + z * rb, (length - z) * rb)


@numba.njit(cache=True, nogil=True)
def _nb_read_windows(
    steps: np.ndarray,
    length: int,
    head: bool,
    ring: tuple[Any, ...],
    dst_addrs: np.ndarray,
    mask: np.ndarray,
    ahead: int,
) -> int:  # pragma: no cover - jit
    """``_nb_window_ranges`` then ``_nb_copy_windows`` in one compiled call (host ``read_windows``).

    ``ring`` is ``Storage._window_kernel_args()``: ``(step_ep, ep_start, ep_len, first_step,
    next_step, first_ep, src_addrs, row_nbytes)``. One call instead of two, with the ranges' scratch
    arrays allocated here rather than by numpy (an interleaved A/B could not separate the gain from
    noise: a few percent of a ~55 us read of 256 x 32 steps at most). Returns -1, or the position of
    the first step that is not stored (nothing is copied then).
    """
    step_ep, ep_start, ep_len, first_step, next_step, first_ep, src_addrs, row_nbytes = ring
    b = steps.shape[0]
    pos = np.empty(b, dtype=np.int64)
    lo = np.empty(b, dtype=np.int64)
    hi = np.empty(b, dtype=np.int64)
    bad = _nb_window_ranges(
        steps, length, head, step_ep, ep_start, ep_len, first_step, next_step, first_ep, pos, lo, hi
    )
    if bad >= 0:
        return bad
    _nb_copy_windows(src_addrs, row_nbytes, dst_addrs, step_ep.shape[0], pos, lo, hi, length, mask, ahead)
    return -1


@numba.njit(cache=True, nogil=True)
def _nb_reserve_rows(horizon: np.ndarray, upto: int) -> None:  # pragma: no cover - jit
    """The row horizon (``horizon[0]``): steps below ``upto`` may be written from now on. It never
    goes down here (an append that failed half-way keeps what it reserved). A full fence after the
    store: no row store, not even a large copy's non-temporal ones, is visible before it."""
    if upto > horizon[0]:
        horizon[0] = upto
    full_fence()


@numba.njit(cache=True, nogil=True)
def _nb_append(horizon: np.ndarray, dst: np.ndarray, src: np.ndarray, row_nbytes: np.ndarray, pos0: int, n1: int,
               length: int, step_ep: np.ndarray, ep_start: np.ndarray, ep_len: np.ndarray, ends: np.ndarray,
               first: int, eid: int, open_: bool, cap: int) -> int:  # pragma: no cover - jit
    """A host append in one call: the row horizon reserved (``_nb_reserve_rows``), then field ``f``'s
    ``length`` contiguous rows copied from address ``src[f]`` to the ring at ``dst[f]`` (base
    addresses; rows ``pos0 ..`` then, past the ring's end, ``0 ..``: ``n1`` rows before the wrap),
    fields whose ``src`` is 0 left to the caller, then the episode index (``_nb_index_append``,
    whose value it returns). Three kernels and a numpy copy a field before: 5-field inserts of 256
    steps measured ~10 us less here (issue 21). A source inside its own field's ring (a view of the
    storage) is not copied by ``memcpy``: then nothing is written and it returns -1."""
    for f in range(dst.shape[0]):
        s = src[f]
        if s != 0 and s < dst[f] + cap * row_nbytes[f] and s + length * row_nbytes[f] > dst[f]:
            return -1
    _nb_reserve_rows(horizon, first + length)
    for f in range(dst.shape[0]):
        s = src[f]
        if s == 0:
            continue
        nb = row_nbytes[f]
        copy_bytes(dst[f] + pos0 * nb, s, n1 * nb)
        if n1 < length:
            copy_bytes(dst[f], s + n1 * nb, (length - n1) * nb)
    return _nb_index_append(step_ep, ep_start, ep_len, ends, first, eid, open_, cap)


@numba.njit(cache=True, nogil=True)
def _nb_rewrite_begin(horizon: np.ndarray) -> None:  # pragma: no cover - jit
    """Before rows are rewritten in place (a restore): the rewrite count (``horizon[1]``) goes odd,
    then a full fence; a reader that copied any row of the rewrite sees the count changed."""
    horizon[1] += 1
    full_fence()


@numba.njit(cache=True, nogil=True)
def _nb_rewrite_end(horizon: np.ndarray, upto: int) -> None:  # pragma: no cover - jit
    """After the rewrite: the horizon set to ``upto`` (it may go down: the count covers that), then
    the count even again."""
    full_fence()
    horizon[0] = upto
    full_fence()
    horizon[1] += 1
