"""Row gathers and the sequence-lock version checks of the bulk transport (numba kernels).

Rows are fixed-size byte strings. A field's memory is seen as a 2-D array of unsigned words
``[rows, row_nbytes / unit]`` with the widest unit (8, 4, 2 or 1 bytes) that divides the row, and
a gather copies whole rows word by word inside one compiled loop (no Python loop per row). The
kernels release the GIL, so the zmq server thread gathers while the owner's loop runs.

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
from numba import types
from numba.extending import intrinsic

__all__ = [
    "fence_load_versions",
    "gather_rows",
    "load_versions_fence",
    "store_versions",
    "word_unit",
    "words",
]


@intrinsic
def _acquire_fence(typingctx):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("acquire")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _release_fence(typingctx):  # type: ignore[no-untyped-def]  # pragma: no cover - jit
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.fence("release")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(cache=True, nogil=True)
def _gather_rows(src: np.ndarray, rows: np.ndarray, dst: np.ndarray) -> None:  # pragma: no cover - jit
    """``dst[i] = src[rows[i]]`` for 2-D word arrays (rows already checked in range)."""
    w = src.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(w):
            dst[i, j] = src[r, j]


@numba.njit(cache=True, nogil=True)
def _load_versions_fence(versions: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[i] = versions[rows[i]]``, then an acquire fence (later loads stay after these)."""
    for i in range(rows.shape[0]):
        out[i] = versions[rows[i]]
    _acquire_fence()


@numba.njit(cache=True, nogil=True)
def _fence_load_versions(versions: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """An acquire fence (earlier loads stay before), then ``out[i] = versions[rows[i]]``."""
    _acquire_fence()
    for i in range(rows.shape[0]):
        out[i] = versions[rows[i]]


@numba.njit(cache=True, nogil=True)
def _store_versions_then_fence(versions: np.ndarray, rows: np.ndarray, value: int) -> None:  # pragma: no cover
    """``versions[rows] = value``, then a release fence (later stores stay after these)."""
    for i in range(rows.shape[0]):
        versions[rows[i]] = value
    _release_fence()


@numba.njit(cache=True, nogil=True)
def _fence_then_store_versions(versions: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:  # pragma: no cover
    """A release fence (earlier stores become visible first), then ``versions[rows[i]] = values[i]``."""
    _release_fence()
    for i in range(rows.shape[0]):
        versions[rows[i]] = values[i]


def word_unit(row_nbytes: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing ``row_nbytes``."""
    return 8 if row_nbytes % 8 == 0 else 4 if row_nbytes % 4 == 0 else 2 if row_nbytes % 2 == 0 else 1


_WORD_DTYPES = {8: np.dtype(np.uint64), 4: np.dtype(np.uint32), 2: np.dtype(np.uint16), 1: np.dtype(np.uint8)}


def words(flat_bytes: np.ndarray, row_nbytes: int) -> np.ndarray:
    """View a C-contiguous uint8 buffer of whole rows as ``[rows, row_nbytes / unit]`` words."""
    unit = word_unit(row_nbytes)
    n = flat_bytes.shape[0] // row_nbytes if row_nbytes else 0
    return flat_bytes.view(_WORD_DTYPES[unit]).reshape(n, row_nbytes // unit)


def gather_rows(src: np.ndarray, rows: np.ndarray, dst: np.ndarray) -> None:
    """Copy ``src[rows]`` into ``dst`` (word arrays from :func:`words`; ``rows`` int64, in range)."""
    if rows.shape[0] and src.shape[1]:
        _gather_rows(src, rows, dst)


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


def store_versions(versions: np.ndarray, rows: np.ndarray, values: np.ndarray | int) -> None:
    """Writer side of the sequence lock.

    ``values`` an int (normally ``-1``): store it at every row, then a release fence (begin).
    ``values`` an int64 array: a release fence, then store ``values[i]`` at ``rows[i]`` (end).
    """
    if isinstance(values, np.ndarray):
        _fence_then_store_versions(versions, rows, values)
    else:
        _store_versions_then_fence(versions, rows, int(values))
