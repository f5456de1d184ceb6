"""The Table's compiled bookkeeping (numba): priorities' checks, an insert's key columns, a sample's
info and the one-call window sample, priority updates' slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numba
import numpy as np

from .._native import drop_stale_cache, prefetch
from ._storagekernels import _nb_append, _nb_read_windows
from .sumtree import _nb_descend

# The one-kernel insert (_nb_insert_host) is cached on disk but compiles in the storage's append
# (_storagekernels.py): a cached copy kept running an old append after that file changed. So this
# module's cache goes when it (or _native.py) is newer.
drop_stale_cache(__file__, Path(__file__).with_name("_storagekernels.py"), Path(__file__).parent.parent / "_native.py")

# Compiled bookkeeping for the hot paths. Each replaces 4-8 numpy calls of a few microseconds each
# (the Table's own overhead was ~80 us per sample before; see docs/benchmarks.md).


@numba.njit(cache=True, nogil=True)
def _nb_first_bad_priority(p: np.ndarray) -> int:  # pragma: no cover - jit
    """The first position whose priority is not finite and >= 0 (NaN included), or -1."""
    for i in range(p.shape[0]):
        x = p[i]
        if not (x >= 0.0 and x < np.inf):
            return i
    return -1


@numba.njit(cache=True, nogil=True)
def _nb_first_unfit(x: np.ndarray, limit: float) -> int:  # pragma: no cover - jit
    """The first position in C order of ``x`` (any shape and layout) whose magnitude is not below
    ``limit`` (NaN included), or -1: with ``limit`` the least magnitude a float dtype rounds to infinity
    (``inf`` for its own dtype), the first value that is not finite in that dtype (``reactor.nodes.writer``'s
    intake check; ~0.2 us a call for a step's values, as given: no view to make)."""
    i = 0
    for v in x.flat:
        if not abs(v) < limit:
            return i
        i += 1
    return -1


@numba.njit(cache=True, nogil=True)
def _nb_evict_and_key(keys: np.ndarray, times: np.ndarray, lo: int, hi: int, first: int, length: int,
                      mask: np.ndarray, cap: int, gone: np.ndarray, new_keys: np.ndarray,
                      new_slots: np.ndarray) -> tuple[int, int]:  # pragma: no cover - jit
    """One insert's key columns in one pass: the items of the evicted steps ``[lo, hi)`` dropped
    (``keys[slot] == step``), then the new items keyed with ``times`` 0: of the ``length`` steps from
    ``first``, those where ``mask`` is set (an empty ``mask``: every step an item). Each new item's
    key and slot go to ``new_keys`` and ``new_slots``.

    The dropped slots go to ``gone``: first those no new item overwrites (their sampler entries
    must be deleted), then those one does (a sampler that replaces on insert needs no delete for
    them). Returns ``(dropped, not overwritten)``."""
    every = mask.shape[0] == 0
    lo_over = first - cap  # an evicted step whose slot the insert writes again: [first - cap, first + length - cap)
    hi_over = first + length - cap
    k = 0
    slot = lo % cap  # then one on per step: no 64-bit division per step
    for step in range(lo, hi):  # not overwritten by an item: listed from the front
        if keys[slot] == step and not (lo_over <= step < hi_over and (every or mask[step - lo_over])):
            keys[slot] = -1
            gone[k] = slot
            k += 1
        slot += 1
        if slot == cap:
            slot = 0
    kept = k
    a = max(lo, lo_over)
    slot = a % cap
    for step in range(a, min(hi, hi_over)):  # overwritten by an item: listed after them
        if keys[slot] == step and (every or mask[step - lo_over]):
            gone[k] = slot
            k += 1
        slot += 1
        if slot == cap:
            slot = 0
    slot = first % cap
    j = 0
    for i in range(length):
        if every or mask[i]:
            keys[slot] = first + i
            times[slot] = 0
            new_keys[j] = first + i
            new_slots[j] = slot
            j += 1
        slot += 1
        if slot == cap:
            slot = 0
    return k, kept


@numba.njit(cache=True, nogil=True)
def _nb_insert_host(
    horizon: np.ndarray, dst: np.ndarray, src: np.ndarray, row_nbytes: np.ndarray, pos0: int, n1: int, length: int,
    step_ep: np.ndarray, ep_start: np.ndarray, ep_len: np.ndarray, ends: np.ndarray, eid: int, open_: bool,
    keys: np.ndarray, times: np.ndarray, lo: int, hi: int, first: int, mask: np.ndarray, cap: int, gone: np.ndarray,
    new_keys: np.ndarray, new_slots: np.ndarray,
    stage_idx: np.ndarray, stage_prio: np.ndarray, staged: int, scaled: np.ndarray, present: np.ndarray,
    out: np.ndarray,
) -> bool:  # pragma: no cover - jit
    """A prioritized insert into host storage in one call (``Table._apply_insert_host``): the rows and
    the episode index (``_nb_append``), the key columns (``_nb_evict_and_key``), then the sampler's
    writes staged in its tree's buffer as ``Prioritized.delete`` and ``insert`` stage them (the
    dropped slots that no new item overwrites to 0, then each new slot to its ``p**alpha`` in
    ``scaled``; the caller made room for them) and its present flags (cleared, then set).

    ``out`` gets the next episode id, the items dropped, those not overwritten, the tree buffer's
    new fill and the change in present slots. False, with nothing written, when a source lies in
    its own field's ring (``_nb_append``'s -1): the caller takes the general path."""
    next_ep = _nb_append(horizon, dst, src, row_nbytes, pos0, n1, length, step_ep, ep_start, ep_len, ends, first,
                         eid, open_, cap)
    if next_ep < 0:
        return False
    dropped, kept = _nb_evict_and_key(keys, times, lo, hi, first, length, mask, cap, gone, new_keys, new_slots)
    s = staged
    change = 0
    for i in range(kept):
        j = gone[i]
        stage_idx[s] = j
        stage_prio[s] = 0.0
        s += 1
        if present[j]:
            present[j] = False
            change -= 1
    for i in range(new_slots.shape[0]):
        j = new_slots[i]
        stage_idx[s] = j
        stage_prio[s] = scaled[i]
        s += 1
        if not present[j]:
            present[j] = True
            change += 1
    out[0] = next_ep
    out[1] = dropped
    out[2] = kept
    out[3] = s
    out[4] = change
    return True


@numba.njit(cache=True, nogil=True)
def _nb_sample_info(
    slots: np.ndarray,
    probs: np.ndarray,
    times: np.ndarray,
    first_step: int,
    capacity: int,
    min_p: float,
    beta: float,
    keys: np.ndarray,
    out_times: np.ndarray,
    weights: np.ndarray,
) -> None:  # pragma: no cover - jit
    """Keys of drawn slots, times-sampled bookkeeping and importance weights, in one pass, into
    ``keys``, ``out_times`` and ``weights`` (allocated by the caller: numpy's ``empty`` costs less
    than boxing arrays a kernel allocated, ~0.4 us each).

    ``key = the stored global step in the slot's residue class`` (slots below ``first_step % cap``
    hold the newer lap); ``times[slot] += 1`` per draw (a slot drawn twice counts twice, and both
    draws report the final count); ``w = min((p / min_p)^-beta, 1)`` as float32, where a
    non-positive ``min_p`` (every present priority is 0 but one was drawn) falls back to the
    draws' own minimum.
    """
    n = slots.shape[0]
    for j in range(n):  # times is 8 B per slot of capacity: the draws' misses in flight together
        prefetch(times.ctypes.data + slots[j] * 8)
    f0 = first_step % capacity
    off = first_step - f0
    for j in range(n):
        s = slots[j]
        keys[j] = s + off + (capacity if s < f0 else 0)
        times[s] += 1
    for j in range(n):
        out_times[j] = times[slots[j]]
    if beta == 0.0:
        weights[:] = 1.0
    else:
        if not min_p > 0.0:
            min_p = probs.min() if n else 1.0
        for j in range(n):
            w = (probs[j] / min_p) ** (-beta)
            weights[j] = w if w < 1.0 else 1.0


# Not cached on disk: it compiles in kernels from sumtree.py and _storagekernels.py, and numba's cache only
# notices edits to this file, so a cached copy would silently keep running an old descent or copy
# after either changed (found in review: the one-call path diverged from the three-call one). The
# price is ~0.4 s of compilation at a process's first one-call sample.
@numba.njit(nogil=True)
def _nb_sample_windows(
    sums: np.ndarray,
    mins: np.ndarray,
    offsets: np.ndarray,
    arity: int,
    uniforms: np.ndarray,
    slots: np.ndarray,
    probs: np.ndarray,
    times: np.ndarray,
    beta: float,
    keys: np.ndarray,
    out_times: np.ndarray,
    weights: np.ndarray,
    length: int,
    head: bool,
    ring: tuple[Any, ...],
    dst_addrs: np.ndarray,
    mask: np.ndarray,
    ahead: int,
) -> int:  # pragma: no cover - jit
    """A prioritized window sample from host memory in one compiled call: the stratified descent
    (``SumTree.sample``'s kernel), keys, times sampled and weights (``_nb_sample_info``, with the
    selector's ``min_probability``: the min tree's root over the total), then the windows
    (``Storage.read_windows``' kernel, on the ring tuple of ``Storage._window_kernel_args``). The
    same draws and bytes as the three calls it replaces; returns ``_nb_read_windows``' result (-1, or
    the first key that is not stored).
    """
    _nb_descend(sums, offsets, arity, uniforms, True, slots, probs)
    min_p = mins[0] / sums[0] if beta != 0.0 else 1.0
    step_ep, first_step = ring[0], ring[3]  # (see Storage._window_kernel_args)
    _nb_sample_info(slots, probs, times, first_step, step_ep.shape[0], min_p, beta, keys, out_times, weights)
    return _nb_read_windows(keys, length, head, ring, dst_addrs, mask, ahead)


@numba.njit(cache=True, nogil=True)
def _nb_check_update(
    keys: np.ndarray, table_keys: np.ndarray, capacity: int, priorities: np.ndarray, slots: np.ndarray
) -> int:  # pragma: no cover - jit
    """Slots of ``keys`` into ``slots``; -1 if every key is present and every priority finite and
    >= 0, else the position of the first unknown key, or ``len(keys) + i`` for a bad priority ``i``."""
    n = keys.shape[0]
    for i in range(n):  # the key column is 8 B per slot of capacity: put every lookup's miss in flight
        prefetch(table_keys.ctypes.data + (keys[i] % capacity) * 8)
    for i in range(n):
        k = keys[i]
        if k < 0:
            return i
        s = k % capacity
        if table_keys[s] != k:
            return i
        slots[i] = s
    for i in range(priorities.shape[0]):
        p = priorities[i]
        if not (p >= 0.0 and p < np.inf):  # also rejects NaN
            return n + i
    return -1
