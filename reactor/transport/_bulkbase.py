"""What the bulk transport's owner and reader share: backends, the descriptor's constants, host ids,
the sequence lock and segment cleanup. The public face is :mod:`reactor.transport.bulk`."""

from __future__ import annotations

import functools
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from . import _gather, _shm

Backend = Literal["shm", "zmq", "rdma"]
#: Every backend, in the order a reader tries those a descriptor offers.
BACKENDS: tuple[Backend, ...] = ("shm", "rdma", "zmq")
#: The name of a region's version column (see :meth:`BulkOwner.allocate_versions`).
VERSION_FIELD = "_version"
_DESCRIPTOR_KIND = "reactor.bulk.region"
_DESCRIPTOR_VERSION = 1
#: How often a shm read also checks the owner's pid start time (pid reuse), besides ``kill(pid, 0)``.
_START_CHECK_PERIOD_S = 1.0

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {d: n for n, d in _TORCH_DTYPES.items()}
#: Passed by ``open`` to the constructors, which refuse to be called directly.
_OPEN_TOKEN = object()


# ------------------------------------------------------------------------------------------ helpers


@dataclass(frozen=True)
class BulkCapabilities:
    """What this process can do, found by trying (never by import alone).

    Attributes:
        shm: POSIX shared memory works here (a segment was created, mapped and unlinked).
        rdma: an RDMA device exists and a verbs context opens on it (pyverbs).
        rdma_reason: why ``rdma`` is False (or the device used when True).
        cuda: ``torch.cuda.is_available()``.
    """

    shm: bool
    rdma: bool
    rdma_reason: str
    cuda: bool


@functools.lru_cache(maxsize=1)
def capabilities() -> BulkCapabilities:
    """Detect the bulk backends this process can use (cached for the process's life).

    Returns:
        A :class:`BulkCapabilities`.

    Example::

        if not capabilities().rdma:
            print(capabilities().rdma_reason)
    """
    from . import _rdma

    shm_ok = False
    probe = f"/{_shm.PREFIX}probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        seg = _shm.Segment.create(probe, 1, 8, 1)
        seg.close_owner()
        shm_ok = True
    except OSError:
        shm_ok = False
    rdma_ok, reason = _rdma.probe()
    return BulkCapabilities(shm=shm_ok, rdma=rdma_ok, rdma_reason=reason, cuda=torch.cuda.is_available())


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This host's identity for :func:`choose_backend`: ``hostname/boot id``.

    Two processes with the same id run under one kernel (so may share memory); the boot id tells
    apart machines that share a hostname. A worker started by a daemon has the daemon's name for it
    (``REACTOR_HOST_ID``): the daemons of a placement are its hosts.
    """
    if given := os.environ.get("REACTOR_HOST_ID"):
        return given
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # pragma: no cover - not Linux
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def choose_backend(owner_host: str, reader_host: str, *, owner_rdma: bool = False, reader_rdma: bool = False) -> Backend:
    """Pick the bulk backend between an owner and a reader.

    Same host: ``shm``. Different hosts: ``rdma`` if both sides have an RDMA device, else ``zmq``.

    Args:
        owner_host / reader_host: host identities (:func:`host_id`, or the placement's host names).
        owner_rdma / reader_rdma: whether each side has a working RDMA device.

    Returns:
        ``"shm"``, ``"rdma"`` or ``"zmq"``.

    Example::

        choose_backend("a", "a")                                      # "shm"
        choose_backend("a", "b", owner_rdma=True, reader_rdma=True)   # "rdma"
    """
    if owner_host == reader_host:
        return "shm"
    if owner_rdma and reader_rdma:
        return "rdma"
    return "zmq"


def coalesce_runs(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split rows into runs of consecutive rows: ``(starts, lengths)``, in order (vectorized).

    A window batch ``[B, T]`` of ring slots becomes at most ``2 * B`` runs (one, or two where a
    window wraps around the ring's end); the zmq and rdma backends move runs, not single rows.

    Args:
        rows: int64 row numbers, any shape (read in C order).

    Returns:
        ``starts`` and ``lengths``, int64 ``[R]``; ``rows.ravel()`` equals the runs concatenated.

    Example::

        coalesce_runs(np.array([4, 5, 6, 9, 0, 1]))   # ([4, 9, 0], [3, 1, 2])
    """
    flat = np.ascontiguousarray(rows, dtype=np.int64).ravel()
    if flat.shape[0] == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    brk = np.flatnonzero(np.diff(flat) != 1) + 1
    first = np.concatenate((np.zeros(1, np.int64), brk))
    lengths = np.diff(np.concatenate((first, np.array([flat.shape[0]], np.int64))))
    return flat[first], lengths


def _version_array(versions: torch.Tensor | np.ndarray, what: str) -> np.ndarray:
    arr = versions.numpy() if isinstance(versions, torch.Tensor) else versions
    if not isinstance(arr, np.ndarray) or arr.dtype != np.int64 or arr.ndim != 1 or not arr.flags.c_contiguous:
        raise ValueError(f"{what}: versions must be a contiguous 1-D int64 CPU tensor (allocate_versions gives one)")
    if not arr.flags.writeable:
        raise ValueError(f"{what}: versions must be writable (the owner's own column)")
    return arr


def _int64_rows(rows: Any, what: str) -> np.ndarray:
    """``rows`` (numpy, a CPU tensor or a list of ints) as a C-contiguous 1-D int64 array."""
    if isinstance(rows, torch.Tensor):
        rows = rows.detach().cpu().numpy()
    arr = np.asarray(rows)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what}: rows must be integers (int64 ring slots), got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise IndexError(f"{what}: row {int(arr.max())} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)


def _rows_array(rows: Any, n_rows: int, what: str) -> np.ndarray:
    flat = _int64_rows(rows, what)
    if flat.shape[0]:
        bad = (flat < 0) | (flat >= n_rows)
        if bad.any():
            i = int(np.argmax(bad))
            raise IndexError(f"{what}: row {int(flat[i])} at position {i} is out of range [0, {n_rows})")
    return flat


def seqlock_begin(versions: torch.Tensor | np.ndarray, rows: Any) -> None:
    """Writer side of the sequence lock: mark ``rows`` as being written (version ``-1``).

    The protocol, per row: ``seqlock_begin`` (version = -1, then a release fence), write the row's
    fields (any code), ``seqlock_end`` (a release fence, then version = its new value). A reader
    (:meth:`BulkReader.read_checked`) loads the versions, an acquire fence, gathers, an acquire
    fence, loads the versions again, and accepts a row only if both loads agree, are >= 0, and
    equal what it expected. If any data load saw a store of a write, the second version load (after
    it in the reader's order) sees that write's -1 or a later version, never the old one; if the
    first load saw the expected version, every data load comes after that write completed. So an
    accepted row is never torn, provided a row's versions never repeat (use e.g. the global step
    number written to the slot) and only one writer writes a row at a time. The fences come from
    numba kernels (``reactor/transport/_gather.py``); on x86-64 they cost nothing.

    Args:
        versions: the region's version column (int64 ``[rows]``, :meth:`BulkOwner.allocate_versions`).
        rows: the rows about to be written (int array).

    Raises:
        ValueError: ``versions`` is not a writable contiguous int64 CPU column.
        IndexError: a row is out of range.

    Example::

        seqlock_begin(ver, slots); obs[slots] = new_obs; seqlock_end(ver, slots, new_steps)
    """
    arr = _version_array(versions, "seqlock_begin")
    _gather.store_versions(arr, _rows_array(rows, arr.shape[0], "seqlock_begin"), -1)


def seqlock_end(versions: torch.Tensor | np.ndarray, rows: Any, new_versions: Any) -> None:
    """Writer side of the sequence lock: publish ``rows`` with their new versions (>= 0).

    See :func:`seqlock_begin` for the protocol.

    Args:
        versions: the region's version column.
        rows: the rows just written.
        new_versions: one int64 per row (or one int for all), each >= 0 and never used before for
            that row.

    Raises:
        ValueError: a bad column, a negative version, or a length mismatch.
        IndexError: a row is out of range.
    """
    arr = _version_array(versions, "seqlock_end")
    flat = _rows_array(rows, arr.shape[0], "seqlock_end")
    new = np.ascontiguousarray(np.broadcast_to(np.asarray(new_versions, dtype=np.int64), flat.shape))
    if new.shape != flat.shape:  # pragma: no cover - broadcast_to raises first
        raise ValueError("seqlock_end: one version per row")
    if new.shape[0] and int(new.min()) < 0:
        raise ValueError(f"seqlock_end: versions must be >= 0 (-1 means 'being written'), got {int(new.min())}")
    _gather.store_versions(arr, flat, new)


def seqlock_begin_steps(versions: torch.Tensor | np.ndarray, first: int, n: int) -> np.ndarray:
    """:func:`seqlock_begin` for a ring's rows: the ``n`` rows of steps ``first .. first + n - 1``,
    row = step modulo the column's length (a replay shard's append), in one compiled pass and
    without an array of rows. Returns the versions those rows had, for :func:`seqlock_end` to put
    back (where >= 0) if the write fails; :func:`seqlock_end_steps` publishes them.

    Raises:
        ValueError: a bad column, ``first < 0``, or ``n`` outside ``[0, rows]`` (a row would be
            written twice).
    """
    arr = _version_array(versions, "seqlock_begin_steps")
    _check_steps(arr, first, n, "seqlock_begin_steps")
    return _gather.ring_begin(arr, int(first), int(n))


def seqlock_end_steps(versions: torch.Tensor | np.ndarray, first: int, n: int) -> None:
    """:func:`seqlock_end` for the rows :func:`seqlock_begin_steps` opened: each row's new version is
    its step (>= 0, and never used before for that row while steps only grow).

    Raises:
        ValueError: as :func:`seqlock_begin_steps`.
    """
    arr = _version_array(versions, "seqlock_end_steps")
    _check_steps(arr, first, n, "seqlock_end_steps")
    _gather.ring_end(arr, int(first), int(n))


def _check_steps(arr: np.ndarray, first: Any, n: Any, what: str) -> None:
    for name, v in (("first", first), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{what}: {name} must be an int, got {type(v).__name__}")
    if first < 0 or not 0 <= n <= arr.shape[0]:
        raise ValueError(f"{what}: steps [{first}, {first} + {n}) do not fit a ring of {arr.shape[0]} rows "
                         f"(first >= 0, 0 <= n <= rows)")


def cleanup_stale_segments(run_id: str | None = None) -> list[str]:
    """Unlink the shared-memory segments of dead owners (of one run, or of every run).

    A segment is stale when its owner's process is gone (checked by pid and pid start time), when
    its owner closed it but died before unlinking, or when it was never finished (older than 10 s).
    Live owners' segments are left alone. Each stale segment is marked "owner lost" before it is
    unlinked, so a reader still mapping it raises ``PeerLostError`` at its next read. A new
    :class:`BulkOwner` runs this for its run id; a launcher may run it after reaping its workers.

    Args:
        run_id: only this run's segments; None: all of this package's segments on the host.

    Returns:
        The names unlinked (``/rxb.<run>.<region>.<field>``).

    Example::

        cleanup_stale_segments("20260101-120000-4242-0")
    """
    if run_id is not None:
        _shm.check_name_part("run id", run_id)
    return _shm.cleanup_stale(run_id)

