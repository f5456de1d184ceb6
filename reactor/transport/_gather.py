"""Row gathers and the sequence-lock version checks of the bulk transport (numba kernels).

Rows are fixed-size byte strings. A read's rows are first cut into *runs* of consecutive rows
(:func:`runs_of`, which also checks them, in one pass), and every run of every field is copied
with one ``memcpy`` (:func:`copy_runs`) while the first lines of the runs a few places ahead are
prefetched. A window batch ``[B, T]`` is then ``B`` copies per field rather than ``B * T``. The
kernels take addresses, so a caller passes any buffer (a mapped segment, a tensor, a zmq reply)
without building array views, and they release the GIL, so the zmq server thread gathers while the
owner's loop runs.

Memory ordering (the sequence lock, see :func:`reactor.transport.bulk.seqlock_begin`): the
kernels that load or store versions carry explicit LLVM fences, emitted with a numba intrinsic:

- writer: ``version[r] = -1`` stores, then a *release* fence; the row's data is written; then a
  *release* fence and ``version[r] = new`` stores. A release fence orders every earlier load and
  store before every later store, so no data store can become visible before the ``-1``, and the
  new version cannot become visible before the data.
- reader: ``v1 = version[rows]`` loads, then an *acquire* fence; the data loads; then an
  *acquire* fence and ``v2 = version[rows]`` loads. An acquire fence orders every earlier load
  before every later load and store, so the data loads happen after ``v1`` and before ``v2``.

On x86-64 (TSO) both fences compile to nothing but a compiler barrier (the hardware already keeps
stores in order and loads in order); on AArch64 they become ``dmb ishst``/``dmb ishld``-class
barriers. Aligned 8-byte loads and stores are single-copy atomic on both, so a version itself is
never torn.
"""

from __future__ import annotations

import numba
import numpy as np

from .._native import acquire_fence, copy_bytes, prefetch, release_fence, zero_bytes

__all__ = [
    "copy_runs",
    "zero_rows",
    "fence_load_versions",
    "load_versions_fence",
    "runs_of",
    "store_versions",
    "ring_begin",
    "ring_end",
]


#: Runs ahead of the one being copied whose source lines are prefetched.
PREFETCH_AHEAD = 8
#: Bytes prefetched at the start of each run: the hardware prefetcher follows a long run by itself
#: (measured on 256 windows x 32 rows of a 1M-row region: 64..128 B ahead of 8 runs was as fast as
#: any larger setting, and 2-5x faster than no prefetch).
_PREFETCH_NBYTES = 128


@numba.njit(cache=True, nogil=True)
def _copy_runs(
    src_addrs: np.ndarray,
    src_rows: int,
    dst_addrs: np.ndarray,
    dst_rows: int,
    row_nbytes: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    ahead: int,
) -> int:  # pragma: no cover - jit
    """For every run j and field f: copy rows ``[starts[j], starts[j] + lengths[j])`` of field f to
    the next rows of its destination, one ``memcpy`` per (run, field). Returns the rows copied, or
    -1 (copying nothing) if a run leaves ``[0, src_rows)`` or the runs exceed ``dst_rows``.

    Runs start at random places of regions much larger than the caches; a copy that waits on its
    first lines before the next one starts leaves the memory system idle. So while copying run j
    the kernel prefetches the first lines of run ``j + ahead`` of every field: the misses of several
    runs are in flight at once.
    """
    nf = src_addrs.shape[0]
    r = starts.shape[0]
    total = 0
    for j in range(r):
        if lengths[j] < 0 or starts[j] < 0 or starts[j] > src_rows - lengths[j]:
            return -1
        total += lengths[j]
    if total > dst_rows:
        return -1
    out_row = 0
    for j in range(-ahead, r):
        k = j + ahead
        if k < r:
            for f in range(nf):
                rb = row_nbytes[f]
                first = src_addrs[f] + starts[k] * rb
                end = first + min(lengths[k] * rb, _PREFETCH_NBYTES)
                line = first & ~63
                while line < end:
                    prefetch(line)
                    line += 64
        if j < 0:
            continue
        n = lengths[j]
        for f in range(nf):
            rb = row_nbytes[f]
            if rb:
                copy_bytes(dst_addrs[f] + out_row * rb, src_addrs[f] + starts[j] * rb, n * rb)
        out_row += n
    return total


@numba.njit(cache=True, nogil=True)
def _runs_of(rows: np.ndarray, n_rows: int, starts: np.ndarray, lengths: np.ndarray) -> int:  # pragma: no cover
    """Cut ``rows`` into maximal runs of consecutive rows; return their count, or ``-(i + 1)`` if
    ``rows[i]`` is the first row outside ``[0, n_rows)``."""
    r = -1
    prev = -2
    for i in range(rows.shape[0]):
        x = rows[i]
        if x < 0 or x >= n_rows:
            return -(i + 1)
        if x == prev + 1:
            lengths[r] += 1
        else:
            r += 1
            starts[r] = x
            lengths[r] = 1
        prev = x
    return r + 1


@numba.njit(cache=True, nogil=True)
def _load_versions_fence(versions: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[i] = versions[rows[i]]``, then an acquire fence (later loads stay after these)."""
    for i in range(rows.shape[0]):
        out[i] = versions[rows[i]]
    acquire_fence()


@numba.njit(cache=True, nogil=True)
def _fence_load_versions(versions: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """An acquire fence (earlier loads stay before), then ``out[i] = versions[rows[i]]``."""
    acquire_fence()
    for i in range(rows.shape[0]):
        out[i] = versions[rows[i]]


@numba.njit(cache=True, nogil=True)
def _store_versions_then_fence(versions: np.ndarray, rows: np.ndarray, value: int) -> None:  # pragma: no cover
    """``versions[rows] = value``, then a release fence (later stores stay after these)."""
    for i in range(rows.shape[0]):
        versions[rows[i]] = value
    release_fence()


@numba.njit(cache=True, nogil=True)
def _fence_then_store_versions(versions: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:  # pragma: no cover
    """A release fence (earlier stores become visible first), then ``versions[rows[i]] = values[i]``."""
    release_fence()
    for i in range(rows.shape[0]):
        versions[rows[i]] = values[i]


def runs_of(rows: np.ndarray, n_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(starts, lengths, bad)``: the runs of int64 ``rows`` (C-contiguous, 1-D), or ``bad >= 0``:
    the position of the first row outside ``[0, n_rows)`` (then the runs are meaningless)."""
    k = rows.shape[0]
    starts = np.empty(k, dtype=np.int64)
    lengths = np.empty(k, dtype=np.int64)
    n = _runs_of(rows, n_rows, starts, lengths)
    if n < 0:
        return starts[:0], lengths[:0], -n - 1
    return starts[:n], lengths[:n], -1


def copy_runs(
    src_addrs: np.ndarray,
    src_rows: int,
    dst_addrs: np.ndarray,
    dst_rows: int,
    row_nbytes: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
) -> None:
    """Gather runs of rows of several fields (int64 arrays of addresses and row sizes, one entry a
    field): every source holds ``src_rows`` rows, every destination ``dst_rows``.

    The caller keeps every buffer alive for the call. The runs are checked against both bounds in
    the kernel before anything is copied.

    Raises:
        IndexError: a run outside the sources, or more rows than the destinations hold (a bug in
            the caller: readers validate rows before).
    """
    if starts.shape[0] == 0 or src_addrs.shape[0] == 0:
        return
    if _copy_runs(src_addrs, src_rows, dst_addrs, dst_rows, row_nbytes, starts, lengths, PREFETCH_AHEAD) < 0:
        raise IndexError(f"copy_runs: runs outside [0, {src_rows}) or over {dst_rows} destination rows")


def load_versions_fence(versions: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Read ``versions[rows]`` (int64), then an acquire fence: the first read of a sequence lock."""
    out = np.empty(rows.shape[0], dtype=np.int64)
    _load_versions_fence(versions, rows, out)
    return out


def fence_load_versions(versions: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """An acquire fence, then read ``versions[rows]``: the second read of a sequence lock."""
    out = np.empty(rows.shape[0], dtype=np.int64)
    _fence_load_versions(versions, rows, out)
    return out


@numba.njit(cache=True, nogil=True)
def _ring_begin(versions: np.ndarray, first: int, n: int, old: np.ndarray) -> None:  # pragma: no cover
    """``old[i] = versions[(first + i) % len]``, that version set to -1, for ``i < n``; then a release fence."""
    cap = versions.shape[0]
    s = first % cap
    for i in range(n):
        old[i] = versions[s]
        versions[s] = -1
        s += 1
        if s == cap:
            s = 0
    release_fence()


@numba.njit(cache=True, nogil=True)
def _ring_end(versions: np.ndarray, first: int, n: int) -> None:  # pragma: no cover
    """A release fence, then ``versions[(first + i) % len] = first + i`` for ``i < n``."""
    release_fence()
    cap = versions.shape[0]
    s = first % cap
    for i in range(n):
        versions[s] = first + i
        s += 1
        if s == cap:
            s = 0


def ring_begin(versions: np.ndarray, first: int, n: int) -> np.ndarray:
    """Writer side of the sequence lock for the ``n`` ring rows of steps ``first, first + 1, ...``
    (row = step modulo the column's length): their versions set to -1, then a release fence.
    Returns the versions they had (for :func:`store_versions` to put back if the write fails)."""
    old = np.empty(n, dtype=np.int64)
    _ring_begin(versions, first, n, old)
    return old


def ring_end(versions: np.ndarray, first: int, n: int) -> None:
    """A release fence, then each of those rows' version set to its step: :func:`ring_begin`'s end."""
    _ring_end(versions, first, n)


def store_versions(versions: np.ndarray, rows: np.ndarray, values: np.ndarray | int) -> None:
    """Writer side of the sequence lock.

    ``values`` an int (normally ``-1``): store it at every row, then a release fence (begin).
    ``values`` an int64 array: a release fence, then store ``values[i]`` at ``rows[i]`` (end).
    """
    if isinstance(values, np.ndarray):
        _fence_then_store_versions(versions, rows, values)
    else:
        _store_versions_then_fence(versions, rows, int(values))


@numba.njit(cache=True, nogil=True)
def _zero_rows(dst_addrs: np.ndarray, dst_rows: int, row_nbytes: np.ndarray, positions: np.ndarray) -> int:  # pragma: no cover
    """``memset`` row ``positions[i]`` of every destination field to zero; -1 if a position is out of range."""
    for i in range(positions.shape[0]):
        if positions[i] < 0 or positions[i] >= dst_rows:
            return -1
    for f in range(dst_addrs.shape[0]):
        rb = row_nbytes[f]
        for i in range(positions.shape[0]):
            zero_bytes(dst_addrs[f] + positions[i] * rb, rb)
    return 0


def zero_rows(dst_addrs: np.ndarray, dst_rows: int, row_nbytes: np.ndarray, positions: np.ndarray) -> None:
    """Zero rows ``positions`` (int64) of several destination fields (int64 addresses and row sizes,
    each holding ``dst_rows`` rows): a window batch's padding, in one compiled pass.

    The caller keeps the buffers alive for the call.

    Raises:
        IndexError: a position outside ``[0, dst_rows)`` (checked before anything is written).
    """
    if positions.shape[0] == 0 or dst_addrs.shape[0] == 0:
        return
    if _zero_rows(dst_addrs, dst_rows, row_nbytes, np.ascontiguousarray(positions, dtype=np.int64)) < 0:
        raise IndexError(f"zero_rows: a position outside [0, {dst_rows})")
