"""Compiled memory primitives shared by the replay and bulk-transport kernels: software prefetch,
raw copy and zero, and memory fences.

These are numba intrinsics, usable only inside ``@numba.njit`` code. They take *addresses*
(``arr.ctypes.data + offset``, int64) rather than arrays, because the kernels that use them copy
whole contiguous byte runs between buffers of different widths (one storage field after another, a
mapped segment into a tensor) and issue prefetches for rows they will read later. They live in the
core so that ``reactor.replay`` and ``reactor.transport``, which may not import each other, share one
copy.

- ``prefetch(addr)``: a hint to start loading the cache line at ``addr`` (``llvm.prefetch``, read,
  high locality). It never faults, so an address past the end of an array is harmless; it retires
  at once, unlike a plain load, so many can be in flight while the core keeps copying.
- ``copy_bytes(dst, src, nbytes)``: ``memcpy`` (``llvm.memcpy``: libc's vectorized copy for large
  runs). The ranges must not overlap.
- ``zero_bytes(dst, nbytes)``: ``memset(dst, 0, nbytes)``.
- ``acquire_fence()`` / ``release_fence()``: LLVM ``fence acquire`` / ``fence release`` (the bulk
  transport's sequence lock; a compiler barrier only on x86-64, a ``dmb``-class barrier on AArch64).
- ``atomic_add(addr, delta)`` / ``atomic_cas(addr, expected, new)``: sequentially consistent
  read-modify-writes of the int64 at ``addr`` (``lock xadd`` / ``lock cmpxchg`` on x86-64); both
  return the value before. Processes that map the same memory take from one counter with them
  (a replay shard's sample budget, :mod:`reactor.replay.shared`).

Two plain-Python helpers sit with them, for the buffers those kernels fill:

- ``numpy_twin(dtype)``: the numpy dtype of a torch dtype, or None (cached).

- ``host_empty(shape, dtype)``: an uninitialized CPU tensor whose memory comes from ``malloc``
  (through numpy) instead of ``torch.empty``'s 64-byte ``posix_memalign``. A reader that returns a
  fresh batch per call (window reads, bulk reads) then gets the same addresses back call after call
  while the caller drops the previous batch, so the kernel writes into lines still in L2; torch's
  aligned allocations of a few hundred KB cycle through ~9 places here, and every batch's first
  writes miss. Dtypes without a numpy twin (bfloat16, ...) fall back to ``torch.empty``.

- ``host_huge_zeros(shape, dtype)``: a zeroed CPU tensor for large, long-lived memory read at random
  (a replay ring's fields): an anonymous mapping advised for transparent huge pages
  (``MADV_HUGEPAGE``) before it is touched, its start on a 2 MiB boundary. Random gathers from
  4 KiB pages miss the TLB on nearly every row (tens of MB of ring, a few thousand TLB entries;
  under virtualization every miss is a two-dimensional page walk); with 2 MiB pages the whole ring
  needs a few dozen entries. The alignment costs address space only: only the data's whole 2 MiB
  pages are advised, so the slack around the data is never touched and never backed (the data's
  last partial huge page is ordinary pages). Below 2 MiB, or where the kernel has no THP (the
  advice is refused, or the platform lacks it), it is a plain ``torch.zeros``; the kernel's THP
  setting ``never`` leaves ordinary pages, with the same contents.

numba's on-disk cache of a kernel notices edits to the kernel's own file only: after changing an
intrinsic here, delete the ``__pycache__`` folders of ``reactor/replay`` and ``reactor/transport``
(or their kernels keep the old code). For the same reason the table's one-call window sample, which
compiles in kernels of two other files, is not cached at all (``reactor/replay/table.py``), and a
module whose cached kernels compile in another file's drops its cache at import when that file is
newer (``drop_stale_cache``: the one-sided reader's, the table's one-kernel insert).

The caller is responsible for every address and length being inside live arrays (the kernels that
use these compute them from validated ring positions and keep the arrays alive for the call).

Example (inside a kernel)::

    @numba.njit
    def first_row_copy(src, dst):
        copy_bytes(dst.ctypes.data, src.ctypes.data, dst.nbytes)
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any

import llvmlite.ir as ir
import numpy as np
import torch
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "acquire_fence",
    "atomic_add",
    "atomic_cas",
    "copy_bytes",
    "drop_stale_cache",
    "host_empty",
    "host_huge_zeros",
    "numpy_twin",
    "prefetch",
    "release_fence",
    "void_pointer",
    "zero_bytes",
]

_I32 = ir.IntType(32)


def _as_ptr(builder: Any, addr: Any) -> Any:
    return builder.inttoptr(addr, cgutils.voidptr_t)


@intrinsic
def prefetch(typingctx: Any, addr: Any) -> Any:
    """Prefetch the cache line holding address ``addr`` for reading (no fault on bad addresses)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        fnty = ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, _I32, _I32, _I32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [cgutils.voidptr_t], fnty)
        # rw = 0 (read), locality = 3 (keep in all cache levels), cache type = 1 (data)
        builder.call(fn, [_as_ptr(builder, args[0]), _I32(0), _I32(3), _I32(1)])
        return context.get_dummy_value()

    return types.void(addr), codegen


@intrinsic
def void_pointer(typingctx: Any, addr: Any) -> Any:
    """Integer address ``addr`` as a ``void*``, for ``numba.carray(void_pointer(a), n, dtype)``: a view
    of memory the caller keeps mapped (no ownership, no bounds: the caller's sizes are trusted)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return _as_ptr(builder, args[0])

    return types.voidptr(addr), codegen


@intrinsic
def copy_bytes(typingctx: Any, dst: Any, src: Any, nbytes: Any) -> Any:
    """``memcpy(dst, src, nbytes)`` on integer addresses (non-overlapping)."""
    if not all(isinstance(a, types.Integer) for a in (dst, src, nbytes)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, s, n = args
        cgutils.raw_memcpy(builder, _as_ptr(builder, d), _as_ptr(builder, s), n, 1)
        return context.get_dummy_value()

    return types.void(dst, src, nbytes), codegen


@intrinsic
def zero_bytes(typingctx: Any, dst: Any, nbytes: Any) -> Any:
    """``memset(dst, 0, nbytes)`` on an integer address."""
    if not all(isinstance(a, types.Integer) for a in (dst, nbytes)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d, n = args
        cgutils.memset(builder, _as_ptr(builder, d), n, 0)
        return context.get_dummy_value()

    return types.void(dst, nbytes), codegen


@intrinsic
def acquire_fence(typingctx: Any) -> Any:
    """An acquire fence: earlier loads are ordered before every later load and store."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("acquire")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def release_fence(typingctx: Any) -> Any:
    """A release fence: every earlier load and store is ordered before every later store."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("release")
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def full_fence(typingctx: Any) -> Any:
    """A sequentially consistent fence (``mfence`` on x86-64): every earlier load and store, the
    non-temporal stores of a large ``memcpy`` included, is ordered before every later one."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


_I64 = ir.IntType(64)


def _as_i64_ptr(builder: Any, addr: Any) -> Any:
    return builder.inttoptr(addr, _I64.as_pointer())


@intrinsic
def atomic_add(typingctx: Any, addr: Any, delta: Any) -> Any:
    """``*addr += delta`` on the int64 at integer address ``addr``, atomically (sequentially
    consistent); returns the value before."""
    if not (isinstance(addr, types.Integer) and isinstance(delta, types.Integer)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        d = context.cast(builder, args[1], signature.args[1], types.int64)
        return builder.atomic_rmw("add", _as_i64_ptr(builder, args[0]), d, "seq_cst")

    return types.int64(addr, delta), codegen


@intrinsic
def atomic_cas(typingctx: Any, addr: Any, expected: Any, new: Any) -> Any:
    """If the int64 at integer address ``addr`` is ``expected``, store ``new`` there, atomically
    (sequentially consistent); returns the value found (``== expected`` when the store happened)."""
    if not all(isinstance(a, types.Integer) for a in (addr, expected, new)):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        e = context.cast(builder, args[1], signature.args[1], types.int64)
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        pair = builder.cmpxchg(_as_i64_ptr(builder, args[0]), e, v, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return types.int64(addr, expected, new), codegen


def drop_stale_cache(module_file: str, *deps: Path) -> None:
    """Remove the numba disk cache of ``module_file``'s kernels if a file they compile in (``deps``) is
    newer: numba's cache notices edits to the kernel's own file only, so a cached kernel would keep
    running the other file's old code. Called at the module's import, before a kernel is looked up.
    Only numba's default place (``__pycache__`` beside the module) is checked: with ``NUMBA_CACHE_DIR``
    set, clear that directory after editing such a file."""
    here = Path(module_file)
    try:
        newest = max(p.stat().st_mtime for p in deps)
        for f in (here.parent / "__pycache__").glob(f"{here.stem}.*.nb[ic]"):
            if f.stat().st_mtime < newest:
                f.unlink(missing_ok=True)
    except OSError:  # a read-only install: its files do not change either
        pass


_NUMPY_TWINS: dict[torch.dtype, Any] = {}


def numpy_twin(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The numpy dtype of torch ``dtype`` (None when numpy has none: bfloat16, ...). Cached."""
    twin = _NUMPY_TWINS.get(dtype, False)
    if twin is False:
        try:
            twin = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # no numpy equivalent
            twin = None
        _NUMPY_TWINS[dtype] = twin
    return twin


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` and ``dtype`` over ``malloc``'d memory (see above).

    The tensor owns its numpy buffer (it cannot be ``resize_``d, like any ``torch.from_numpy`` tensor).
    """
    twin = numpy_twin(dtype)
    if twin is None:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(shape, twin))


HUGE_PAGE_NBYTES = 1 << 21  # x86-64 and AArch64 (4 KiB base pages) transparent huge page size


def host_huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of ``shape`` and ``dtype`` on transparent huge pages where the kernel
    offers them (see above); a plain ``torch.zeros`` below 2 MiB or without ``MADV_HUGEPAGE``.

    The tensor is a view into an anonymous mapping that lives as long as the tensor (or any view of
    it) does. Like any tensor over foreign memory, it cannot be ``resize_``d.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE_NBYTES or advice is None:
        return torch.zeros(shape, dtype=dtype)
    # Private (MAP_SHARED, the default, would make it shmem, whose THP setting is separate)
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE_NBYTES, flags=mmap.MAP_PRIVATE)  # anonymous, zero-filled
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % HUGE_PAGE_NBYTES
    # Advise only the whole huge pages of the data, before the first touch (faults then map whole
    # 2 MiB pages): a huge page over the data's tail would also back the slack after it.
    try:
        mm.madvise(advice, start, nbytes // HUGE_PAGE_NBYTES * HUGE_PAGE_NBYTES)
    except OSError:  # a kernel built without THP refuses the advice: ordinary pages
        pass
    return whole[start : start + nbytes].view(dtype).view(shape)
