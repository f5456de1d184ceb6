"""Bulk transport: one-sided regions that readers gather rows from without the owner's help.

The GEAR idea: a replay shard *owns* its trajectory memory, and a learner *pulls* the rows (steps
of sequence windows) it sampled straight out of it, instead of the shard copying them through its
message queue. Here that is two objects and three backends behind them:

- :class:`BulkOwner` (one per owning process) allocates *regions*: named groups of *fields*, each a
  contiguous ``[rows, *shape]`` tensor (``BulkOwner.allocator(region)`` plugs into
  ``reactor.replay.Storage(..., allocator=...)``). ``descriptor(region)`` returns a small msgpack-able
  dict that tells any reader how to reach it.
- :class:`BulkReader` attaches descriptors and reads rows: ``await reader.read(region, rows)``
  returns ``{field: tensor [*rows.shape, *shape]}``, into caller-provided buffers when given.
  ``read_runs`` takes ``(offset, length)`` runs instead; ``read_checked`` also returns which rows
  were stable under a concurrent writer (the sequence lock, :func:`seqlock_begin`).
- Backends (:func:`choose_backend` picks one from where owner and reader run; apps never name it):

  ========  ===================================================================================
  ``shm``   same host: every field lives in a POSIX shared-memory segment named from (run id,
            region, field); the reader maps it read-only and gathers itself. No socket, no copy
            but the gather into the reader's buffer.
  ``zmq``   between hosts: a server thread in the owner (its own zmq socket, never the owner's
            event loop) gathers the rows and replies with them as zero-copy frames.
  ``rdma``  between hosts with RDMA devices on both: RDMA READ through pyverbs of the row runs,
            region keys exchanged through the zmq server (``reactor/transport/_rdma.py``).
  ========  ===================================================================================

Failure: a reader never silently returns data of a dead owner. ``shm`` segments carry the owner's
pid and generation in a header; a read checks, after gathering, that the owner is alive and the
segment still live, and raises ``PeerLostError`` otherwise. Segments are unlinked on ``aclose()``,
at interpreter exit, and -- after a ``kill -9`` -- by the next owner of the same run or by
:func:`cleanup_stale_segments`. A ``zmq`` reader learns of a dead owner from its connection closing
(or heartbeats stopping) and raises ``PeerLostError`` within a bounded time, never hangs.

GPU: a region field on a CUDA device is served over ``zmq`` only (the server gathers on the device
and stages the rows through host memory); it has no ``shm`` segment, and RDMA registers host memory
only. A CPU field can be pinned (``pin_memory=True``, CUDA present): its shm pages are registered
with CUDA so host-to-device copies from it run at full speed. A CUDA ``out`` buffer given to a read
is filled through a host staging buffer. Only the CPU paths run on machines without CUDA.

Example::

    owner = await BulkOwner.open(run_id)
    storage = Storage(specs, capacity, allocator=owner.allocator("shard0"))
    desc = owner.descriptor("shard0")          # send it to learners over the control plane

    reader = await BulkReader.open()
    await reader.attach(desc)
    rows, mask = storage.plan_windows(keys, 32)  # (done where the index lives)
    batch = await reader.read("shard0", rows)     # {"obs": [B, 32, 64], ...}
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import math
import os
import socket
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import zmq
import zmq.asyncio

from reactor._errors import FrameTooLargeError, MalformedFrameError, PeerLostError, PortClosedError
from reactor._native import host_empty, numpy_twin

from . import _gather, _shm
from ._bulkzmq import (
    REPLY_OVERHEAD_NBYTES,
    REQUEST_OVERHEAD_NBYTES,
    ServedRegion,
    ZmqClient,
    ZmqServer,
    check_runs,
    expand_runs,
    seqlock_mask,
)
from ._zmq import CurveKeys

__all__ = [
    "BACKENDS",
    "VERSION_FIELD",
    "BulkCapabilities",
    "BulkOwner",
    "BulkReader",
    "capabilities",
    "choose_backend",
    "cleanup_stale_segments",
    "coalesce_runs",
    "host_id",
    "seqlock_begin",
    "seqlock_end",
]

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


# ------------------------------------------------------------------------------------------ owner


class _Field:
    __slots__ = ("device", "dtype", "pinned", "row_nbytes", "segment", "shape", "tensor")

    def __init__(
        self, tensor: torch.Tensor, shape: tuple[int, ...], row_nbytes: int, segment: _shm.Segment | None, pinned: bool
    ) -> None:
        self.tensor = tensor
        self.dtype = tensor.dtype
        self.shape = shape
        self.row_nbytes = row_nbytes
        self.segment = segment
        self.device = tensor.device
        self.pinned = pinned


class _Region:
    __slots__ = ("fields", "name", "served")

    def __init__(self, name: str, rows: int, generation: int) -> None:
        self.name = name
        self.fields: dict[str, _Field] = {}
        self.served = ServedRegion(name, rows, generation)


def _region_lookup(regions: dict[str, _Region]) -> Callable[[str], ServedRegion | None]:
    """The zmq server's view of an owner's regions (called from the server thread)."""

    def lookup(region: str) -> ServedRegion | None:
        r = regions.get(region) if isinstance(region, str) else None
        return None if r is None else r.served

    return lookup


class _OwnerState:
    """What releasing an owner needs, apart from the owner (so a finalizer can hold it)."""

    __slots__ = ("closed", "pid", "rdma", "regions", "server")

    def __init__(self, regions: dict[str, _Region]) -> None:
        self.closed = False
        self.pid = os.getpid()
        self.server: ZmqServer | None = None
        self.rdma: Any = None
        self.regions = regions


def _release_owner(state: _OwnerState) -> None:
    """Stop serving, mark every segment closed and unlink it. Runs from ``aclose()``, or when the
    owner is collected, or at interpreter exit (``weakref.finalize``); never in a forked child,
    whose exit must not unlink its parent's segments."""
    if state.closed or os.getpid() != state.pid:
        return
    state.closed = True
    if state.server is not None:
        state.server.stop()
    if state.rdma is not None:
        state.rdma.close()
    for reg in state.regions.values():
        for f in reg.fields.values():
            if f.segment is not None:
                if f.pinned:
                    _cuda_host_unregister(f.tensor)
                f.segment.close_owner()


def _local_only(bind: str) -> bool:
    """Whether a zmq bind address is reachable from this host only: ipc, inproc, or tcp on a
    loopback IP literal or ``localhost``. Anything else (a wildcard, an interface, a host name,
    ws/wss/tipc/vmci transports) counts as reachable from other hosts."""
    if bind.startswith(("ipc://", "inproc://")):
        return True
    if not bind.startswith("tcp://"):
        return False
    host = bind[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface or a host name
        return False


class BulkOwner:
    """Owns bulk regions in one process and serves them to readers.

    Memory: with the ``shm`` backend offered, every CPU field is a shared-memory segment; otherwise
    plain process memory. Either way the tensors :meth:`allocate` returns are the memory readers
    read: the owner writes them as any tensor (a :class:`reactor.replay.Storage` built with
    :meth:`allocator`), and uses :func:`seqlock_begin`/:func:`seqlock_end` around writes if readers
    use :meth:`BulkReader.read_checked`.

    Serving: ``shm`` readers need nothing from the owner; ``zmq`` (and ``rdma``'s key exchange) is
    served by a thread with its own socket, started by :meth:`open`, never by the owner's event loop.

    Methods are called from the thread that opened the owner.

    Example::

        owner = await BulkOwner.open("run-1")
        obs = owner.allocate("shard0", "obs", (1 << 20, 64), torch.float32)
        desc = owner.descriptor("shard0")
        await owner.aclose()
    """

    def __init__(self, *, _token: object = None) -> None:
        if _token is not _OPEN_TOKEN:
            raise TypeError("use `await BulkOwner.open(run_id, ...)` to create a BulkOwner")

    @classmethod
    async def open(
        cls,
        run_id: str,
        *,
        backends: Sequence[str] | None = None,
        host: str | None = None,
        zmq_bind: str = "tcp://127.0.0.1:*",
        max_request_nbytes: int = 2**20,
        max_reply_nbytes: int = 256 * 2**20,
        heartbeat_ivl_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        curve: CurveKeys | None = None,
    ) -> BulkOwner:
        """Open an owner for ``run_id``: clean the run's stale segments, start the zmq server.

        Args:
            run_id: the run's id (``Reactor.run_id``), 1..64 of ``[A-Za-z0-9_-]``; it scopes
                segment names, so processes of one run agree on them and runs do not collide.
            backends: the backends to offer; default: ``shm`` and ``zmq``, plus ``rdma`` when an
                RDMA device is usable here (:func:`capabilities`).
            host: this host's identity in descriptors (default :func:`host_id`).
            zmq_bind: where the read server listens (use a routable address between hosts).
            max_request_nbytes: the largest read request accepted (runs and expected versions).
            max_reply_nbytes: the largest reply: a read of more rows is refused with
                ``FrameTooLargeError`` (readers split reads).
            heartbeat_ivl_s / heartbeat_timeout_s: zmq heartbeats with readers.
            curve: the job's CURVE key pair: the read server then encrypts its connections and
                admits only readers holding that pair (descriptors carry the server's public
                key). Required when ``zmq_bind`` is reachable from other hosts (a tcp address
                other than loopback): cluster links are never plaintext.

        Returns:
            The owner.

        Raises:
            ValueError: a bad run id, an unknown backend, bad bounds, a routable ``zmq_bind``
                without ``curve``.
            RuntimeError: ``rdma`` asked for with no usable device (reason given).
            OSError: the zmq address cannot be bound.
        """
        _shm.check_name_part("run id", run_id)
        caps = capabilities()
        if backends is None:
            chosen = [b for b in ("shm", "zmq") if b != "shm" or caps.shm] + (["rdma"] if caps.rdma else [])
        else:
            chosen = list(dict.fromkeys(backends))
            for b in chosen:
                if b not in BACKENDS:
                    raise ValueError(f"BulkOwner.open: unknown backend {b!r}; choose from {list(BACKENDS)}")
            if not chosen:
                raise ValueError("BulkOwner.open: backends must name at least one backend")
            if "rdma" in chosen and not caps.rdma:
                raise RuntimeError(f"BulkOwner.open: the rdma backend is not usable here: {caps.rdma_reason}")
            if "shm" in chosen and not caps.shm:
                raise RuntimeError("BulkOwner.open: POSIX shared memory is not usable here (shm_open failed)")
        for arg, value in (("max_request_nbytes", max_request_nbytes), ("max_reply_nbytes", max_reply_nbytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 4096:
                raise ValueError(f"BulkOwner.open: {arg} must be an int >= 4096, got {value!r}")
        if not 0 < heartbeat_ivl_s <= heartbeat_timeout_s:
            raise ValueError(
                f"BulkOwner.open: need 0 < heartbeat_ivl_s <= heartbeat_timeout_s, got "
                f"{heartbeat_ivl_s!r} and {heartbeat_timeout_s!r}"
            )
        if curve is None and ("zmq" in chosen or "rdma" in chosen) and not _local_only(zmq_bind):
            raise ValueError(
                f"BulkOwner.open: the read server would listen on {zmq_bind!r}, reachable from other hosts, "
                f"without encryption; pass curve=CurveKeys(...) (the job's key pair), or bind a loopback or "
                f"ipc address"
            )
        self = cls(_token=_OPEN_TOKEN)
        self._run_id = run_id
        self._backends: tuple[str, ...] = tuple(chosen)
        self._host = host if host is not None else host_id()
        self._generation = time.time_ns()
        self._regions: dict[str, _Region] = {}
        self._closed = False
        self._max_request = max_request_nbytes
        self._max_reply = max_reply_nbytes
        self._heartbeat = (heartbeat_ivl_s, heartbeat_timeout_s)
        self._server: ZmqServer | None = None
        self._rdma: Any = None
        if "shm" in chosen:
            _shm.cleanup_stale(run_id)
        state = _OwnerState(self._regions)
        # The finalizer holds what releasing needs, never the owner: an owner dropped without
        # aclose() is released when collected, and any still open at interpreter exit then.
        self._finalizer = weakref.finalize(self, _release_owner, state)
        try:
            if "zmq" in chosen or "rdma" in chosen:
                self._server = state.server = ZmqServer(
                    _region_lookup(self._regions),  # not a bound method: the thread must not keep the owner
                    zmq_bind,
                    max_request_nbytes=max_request_nbytes,
                    max_reply_nbytes=max_reply_nbytes,
                    heartbeat_ivl_s=heartbeat_ivl_s,
                    heartbeat_timeout_s=heartbeat_timeout_s,
                    name=run_id,
                    curve=curve,
                )
            if "rdma" in chosen:
                from . import _rdma

                self._rdma = state.rdma = _rdma.RdmaOwner()
                assert self._server is not None
                self._server.extra_ops["rdma_connect"] = self._rdma.serve_connect
        except BaseException:
            self._close_now()
            raise
        return self

    # ------------------------------------------------------------------ properties

    @property
    def run_id(self) -> str:
        """The run id segment names are scoped by."""
        return self._run_id

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends this owner offers."""
        return self._backends

    @property
    def generation(self) -> int:
        """This owner's generation: a fresh number per open, carried by descriptors and segments."""
        return self._generation

    @property
    def regions(self) -> tuple[str, ...]:
        """The region names allocated so far."""
        return tuple(self._regions)

    # ------------------------------------------------------------------ allocation

    def allocate(
        self,
        region: str,
        field: str,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> torch.Tensor:
        """Allocate one field of ``region``: a contiguous tensor ``shape = (rows, *row_shape)``.

        The first field fixes the region's row count; every later field must have as many rows.
        The memory is uninitialised (shm segments start zeroed).

        Args:
            region: the region name (1..64 of ``[A-Za-z0-9_-]``, unique in the run).
            field: the field name (same characters; ``_version`` is reserved).
            shape: ``(rows, *row_shape)``.
            dtype: any fixed-size torch dtype (bfloat16 included).
            device: ``"cpu"`` or a CUDA device (served over zmq only, see the module docstring).
            pin_memory: pin the host memory for fast copies to a GPU (needs CUDA).

        Returns:
            The field's tensor (``[rows, *row_shape]``, contiguous, on ``device``).

        Raises:
            PortClosedError: the owner is closed.
            ValueError: a bad name or shape, a field that exists, a row count unlike the region's.
            TypeError: ``dtype`` is not a supported torch dtype.
            RuntimeError: CUDA or pinned memory asked for without CUDA.
            FileExistsError: a live process owns this (run, region, field) segment already.
        """
        if field == VERSION_FIELD:
            raise ValueError(f"field name {VERSION_FIELD!r} is reserved; use allocate_versions(region)")
        return self._allocate(region, field, shape, dtype, device=device, pin_memory=pin_memory)

    def _allocate(
        self, region: str, field: str, shape: Sequence[int], dtype: torch.dtype, *, device: Any, pin_memory: bool
    ) -> torch.Tensor:
        self._check_open()
        _shm.check_name_part("region", region)
        if field != VERSION_FIELD:
            _shm.check_name_part("field", field)
        if not isinstance(dtype, torch.dtype) or dtype not in _DTYPE_NAMES:
            raise TypeError(f"bulk field {region}.{field}: dtype must be one of {sorted(_TORCH_DTYPES)}, got {dtype!r}")
        try:
            shape_t = tuple(int(d) for d in shape)
        except TypeError:
            raise ValueError(f"bulk field {region}.{field}: shape must be a sequence of ints, got {shape!r}") from None
        if not shape_t or any(d < 0 for d in shape_t) or any(isinstance(d, bool) for d in shape):
            raise ValueError(f"bulk field {region}.{field}: shape must be (rows, *row_shape) of ints >= 0, got {shape!r}")
        rows, row_shape = shape_t[0], shape_t[1:]
        reg = self._regions.get(region)
        if reg is not None:
            if field in reg.fields:
                raise ValueError(f"bulk region {region!r} already has a field {field!r}")
            if rows != reg.served.rows:
                raise ValueError(
                    f"bulk field {region}.{field} has {rows} rows, region {region!r} has {reg.served.rows}; "
                    f"every field of a region has one row per slot"
                )
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"bulk field {region}.{field}: device {str(dev)!r} needs CUDA, which is not available here")
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"bulk field {region}.{field}: device must be 'cpu' or 'cuda[:N]', got {str(dev)!r}")
        if pin_memory and (dev.type != "cpu" or not torch.cuda.is_available()):
            raise RuntimeError(
                f"bulk field {region}.{field}: pin_memory=True needs a CPU field and CUDA present; "
                f"use pin_memory=False"
            )
        itemsize = torch.empty((), dtype=dtype).element_size()
        row_nbytes = math.prod(row_shape) * itemsize
        segment = None
        if dev.type == "cuda":
            tensor = torch.empty(shape_t, dtype=dtype, device=dev)
        elif "shm" in self._backends:
            segment = _shm.Segment.create(
                _shm.segment_name(self._run_id, region, field), rows, row_nbytes, self._generation
            )
            if rows * row_nbytes:
                tensor = torch.frombuffer(
                    segment.mm, dtype=torch.uint8, count=rows * row_nbytes, offset=_shm.HEADER_NBYTES
                ).view(dtype).view(shape_t)
            else:
                tensor = torch.empty(shape_t, dtype=dtype)
            if pin_memory and rows * row_nbytes:
                _cuda_host_register(tensor)
        else:
            tensor = torch.empty(shape_t, dtype=dtype, pin_memory=pin_memory)
        if reg is None:
            reg = self._regions[region] = _Region(region, rows, self._generation)
        reg.fields[field] = _Field(tensor, row_shape, row_nbytes, segment, pinned=pin_memory and segment is not None)
        served = dict(reg.served.fields)
        served[field] = (row_nbytes, tensor.data_ptr() if dev.type == "cpu" else None, tensor)
        reg.served.fields = served  # replaced whole: the server thread reads it without a lock
        if self._rdma is not None and dev.type == "cpu" and rows * row_nbytes:
            self._rdma.register(region, field, tensor)
        return tensor

    def allocator(
        self, region: str, *, device: str | torch.device = "cpu", pin_memory: bool = False
    ) -> Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]:
        """A ``(field, shape, dtype) -> tensor`` callable for ``Storage(..., allocator=...)``.

        Example::

            storage = Storage(specs, capacity, allocator=owner.allocator("shard0"))
        """

        def allocate(field: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return self.allocate(region, field, shape, dtype, device=device, pin_memory=pin_memory)

        return allocate

    def serve_op(self, op: str, handler: Callable[[dict[str, Any], Mapping[str, torch.Tensor]], dict[str, Any]]) -> None:
        """Answer requests ``{"op": op, "region", ...}`` on this owner's zmq read server with
        ``handler(request, fields)`` (``fields``: the region's field tensors, the version column
        included), run on the server's thread: work done where the memory is, without the owner's
        event loop (e.g. a replay shard's one-sided sample for readers on other hosts). The request
        comes from the network: the handler validates it (ValueError, TypeError, KeyError,
        IndexError or FrameTooLargeError go back to the reader as that error; the server keeps
        serving). Its reply dict travels as codec frames (numpy arrays zero-copy). Readers call it
        with :meth:`BulkReader.call`.

        Raises:
            ValueError: ``op`` is a built-in op or already served, or this owner has no zmq server
                (no ``"zmq"`` backend).
        """
        if self._server is None:
            raise ValueError(f"bulk owner: serve_op({op!r}) needs a read server ('zmq' or 'rdma' backend); it has "
                             f"{list(self._backends)}")
        if op in ("hello", "read", "rdma_connect") or op in self._server.extra_ops:
            raise ValueError(f"bulk owner: op {op!r} is built in or served already")
        regions = self._regions

        def run(req: dict[str, Any], region: Any) -> dict[str, Any]:
            return handler(req, {n: f.tensor for n, f in regions[region.name].fields.items()})

        self._server.extra_ops[op] = run

    def allocate_versions(self, region: str) -> torch.Tensor:
        """Allocate ``region``'s version column (int64 ``[rows]``, all ``-1``) for the sequence lock.

        The region must already have its fields (the row count comes from them). Write rows between
        :func:`seqlock_begin` and :func:`seqlock_end`; readers use :meth:`BulkReader.read_checked`.

        Raises:
            KeyError: no such region yet.
            ValueError: the region has a version column already.
        """
        reg = self._regions.get(region)
        if reg is None:
            raise KeyError(f"bulk owner has no region {region!r}; allocate its fields first")
        if VERSION_FIELD in reg.fields:
            raise ValueError(f"bulk region {region!r} already has a version column")
        t = self._allocate(region, VERSION_FIELD, (reg.served.rows,), torch.int64, device="cpu", pin_memory=False)
        t.fill_(-1)
        reg.served.versions = t.numpy()
        reg.served.version_field = VERSION_FIELD
        return t

    # ------------------------------------------------------------------ descriptors

    def descriptor(self, region: str) -> dict[str, Any]:
        """Everything a reader needs to attach ``region``: a small msgpack-able dict.

        Keys: ``kind``, ``version``, ``run_id``, ``region``, ``rows``, ``generation``, ``host``,
        ``fields`` (name -> ``{"dtype", "shape", "row_nbytes", "device"}``), ``version_field``
        (or None), and one entry per backend offered for it: ``shm`` (segment names, owner pid),
        ``zmq`` (address and bounds), ``rdma`` (addresses and keys). A descriptor describes the
        fields allocated when it was made; take a new one after allocating more.

        Raises:
            KeyError: no such region.
            PortClosedError: the owner is closed.
        """
        self._check_open()
        reg = self._regions.get(region)
        if reg is None:
            raise KeyError(f"bulk owner has no region {region!r}; it has {sorted(self._regions)}")
        fields = {
            name: {
                "dtype": _DTYPE_NAMES[f.dtype],
                "shape": list(f.shape),
                "row_nbytes": f.row_nbytes,
                "device": str(f.device),
            }
            for name, f in reg.fields.items()
        }
        desc: dict[str, Any] = {
            "kind": _DESCRIPTOR_KIND,
            "version": _DESCRIPTOR_VERSION,
            "run_id": self._run_id,
            "region": region,
            "rows": reg.served.rows,
            "generation": self._generation,
            "host": self._host,
            "fields": fields,
            "version_field": reg.served.version_field,
        }
        on_host = all(f.segment is not None for f in reg.fields.values())
        if "shm" in self._backends and on_host:
            pid, start, ns = _shm.process_identity()
            desc["shm"] = {
                "segments": {name: f.segment.name for name, f in reg.fields.items() if f.segment is not None},
                "pid": pid,
            }
        connect: dict[str, Any] = {}
        if self._server is not None:
            connect = {
                "address": self._server.address,
                "max_request_nbytes": self._max_request,
                "max_reply_nbytes": self._max_reply,
            }
            if self._server.curve_public is not None:
                connect["server_key"] = self._server.curve_public.decode()
        if self._server is not None and "zmq" in self._backends:
            desc["zmq"] = dict(connect)
        if self._rdma is not None and on_host and self._server is not None:
            desc["rdma"] = self._rdma.describe(region, dict(connect))
        return desc

    # ------------------------------------------------------------------ closing

    def _check_open(self) -> None:
        if self._closed:
            raise PortClosedError("this BulkOwner is closed")

    async def aclose(self) -> None:
        """Stop serving and release every region: segments marked closed and unlinked.

        Readers attached to a region get ``PeerLostError`` at their next read. Tensors handed out
        stay valid memory until dropped (an unlinked segment lives while it is mapped), but no
        reader sees them any more. Idempotent.
        """
        if self._closed:
            return
        server = self._server
        if server is not None:
            await asyncio.get_running_loop().run_in_executor(None, server.stop)
        self._close_now()

    def _close_now(self) -> None:
        self._closed = True
        self._finalizer()


def _cuda_host_register(tensor: torch.Tensor) -> None:  # pragma: no cover - needs CUDA
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of a bulk shm segment failed with CUDA error {int(err)}")


def _cuda_host_unregister(tensor: torch.Tensor) -> None:  # pragma: no cover - needs CUDA
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


_OPEN_TOKEN = object()


# ------------------------------------------------------------------------------------------ reader


class _FieldInfo:
    __slots__ = ("dtype", "row_nbytes", "shape")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], row_nbytes: int) -> None:
        self.dtype = dtype
        self.shape = shape
        self.row_nbytes = row_nbytes


class _Attached:
    """A reader's view of one region."""

    __slots__ = (
        "backend", "client", "fields", "generation", "last_start_check", "name", "owner", "rdma",
        "rows", "run_id", "segments", "version_field", "addrs", "versions", "zmq_limits",
    )

    def __init__(self, desc: dict[str, Any], fields: dict[str, _FieldInfo]) -> None:
        self.name: str = desc["region"]
        self.run_id: str = desc["run_id"]
        self.rows: int = desc["rows"]
        self.generation: int = desc["generation"]
        self.version_field: str | None = desc.get("version_field")
        self.fields = fields
        self.backend: str = ""
        self.segments: dict[str, _shm.Segment] = {}
        self.addrs: dict[str, int] = {}  # shm: field -> address of its mapped rows
        self.versions: np.ndarray | None = None  # shm: the mapped version column
        self.owner: tuple[int, int, int] = (0, 0, 0)
        self.last_start_check = 0.0
        self.client: ZmqClient | None = None
        self.zmq_limits: tuple[int, int] = (0, 0)
        self.rdma: Any = None


def _parse_descriptor(desc: Any) -> tuple[dict[str, Any], dict[str, _FieldInfo]]:
    """Validate a descriptor's shape (it may come from the network); return it and its fields."""
    if not isinstance(desc, Mapping) or desc.get("kind") != _DESCRIPTOR_KIND:
        raise ValueError(f"not a bulk region descriptor (from BulkOwner.descriptor): {desc!r:.200}")
    if desc.get("version") != _DESCRIPTOR_VERSION:
        raise ValueError(f"bulk descriptor version {desc.get('version')!r} is not {_DESCRIPTOR_VERSION} (mixed releases?)")
    for key, typ in (("region", str), ("run_id", str), ("rows", int), ("generation", int), ("host", str), ("fields", Mapping)):
        if not isinstance(desc.get(key), typ) or isinstance(desc.get(key), bool):
            raise ValueError(f"bulk descriptor: {key!r} must be a {typ.__name__}, got {desc.get(key)!r:.100}")
    _shm.check_name_part("region", desc["region"])
    _shm.check_name_part("run id", desc["run_id"])
    if desc["rows"] < 0:
        raise ValueError(f"bulk descriptor: rows must be >= 0, got {desc['rows']}")
    fields: dict[str, _FieldInfo] = {}
    for name, spec in desc["fields"].items():
        if not isinstance(name, str) or not isinstance(spec, Mapping):
            raise ValueError(f"bulk descriptor: bad field entry {name!r:.60}")
        dtype = _TORCH_DTYPES.get(spec.get("dtype"))  # type: ignore[arg-type]
        shape = spec.get("shape")
        if dtype is None:
            raise ValueError(f"bulk descriptor: field {name!r} has unknown dtype {spec.get('dtype')!r:.40}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bulk descriptor: field {name!r} has a bad shape {shape!r:.60}")
        row_nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if spec.get("row_nbytes") != row_nbytes:
            raise ValueError(f"bulk descriptor: field {name!r} row_nbytes {spec.get('row_nbytes')!r} != {row_nbytes}")
        fields[name] = _FieldInfo(dtype, tuple(shape), row_nbytes)
    vf = desc.get("version_field")
    if vf is not None and (vf not in fields or fields[vf].dtype != torch.int64 or fields[vf].shape != ()):
        raise ValueError(f"bulk descriptor: version_field {vf!r:.40} is not an int64 scalar field")
    return dict(desc), fields


class BulkReader:
    """Attaches bulk regions (by descriptor) and reads rows from them.

    Reads are one request for all fields; rows may come in any order and repeat; the result is
    ``{field: [*rows.shape, *row_shape]}``. With ``out``, the rows land in the caller's buffers
    (nothing else is allocated on the shm path). Reads of different regions may run concurrently
    (tasks); reads of regions served by one owner over zmq are serialised on its connection.

    Methods must be called from the event loop the reader was opened on.

    Example::

        reader = await BulkReader.open()
        await reader.attach(desc)
        batch = await reader.read("shard0", rows)           # rows: int64 [B, T]
        batch, valid = await reader.read_checked("shard0", rows, expected=steps)
        await reader.aclose()
    """

    def __init__(self, *, _token: object = None) -> None:
        if _token is not _OPEN_TOKEN:
            raise TypeError("use `await BulkReader.open(...)` to create a BulkReader")

    @classmethod
    async def open(
        cls,
        *,
        host: str | None = None,
        timeout_s: float = 30.0,
        heartbeat_ivl_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        curve: CurveKeys | None = None,
    ) -> BulkReader:
        """Open a reader.

        Args:
            host: this host's identity (default :func:`host_id`); compared with descriptors'.
            curve: the job's CURVE key pair, for owners whose read server requires it (their
                descriptors carry ``server_key``); attaching one without it raises ValueError.
            timeout_s: the longest wait for an owner's reply (zmq); past it the owner counts as lost.
            heartbeat_ivl_s / heartbeat_timeout_s: zmq heartbeats with owners (a silent host is
                detected within ``heartbeat_timeout_s``).

        Raises:
            ValueError: a bad timeout.
        """
        if not timeout_s > 0 or not 0 < heartbeat_ivl_s <= heartbeat_timeout_s:
            raise ValueError(
                f"BulkReader.open: need timeout_s > 0 and 0 < heartbeat_ivl_s <= heartbeat_timeout_s, got "
                f"{timeout_s!r}, {heartbeat_ivl_s!r}, {heartbeat_timeout_s!r}"
            )
        self = cls(_token=_OPEN_TOKEN)
        self._host = host if host is not None else host_id()
        self._timeout_s = float(timeout_s)
        self._heartbeat = (heartbeat_ivl_s, heartbeat_timeout_s)
        self._curve = curve
        self._regions: dict[str, _Attached] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._clients: dict[str, ZmqClient] = {}
        self._closed = False
        return self

    # ------------------------------------------------------------------ attach / detach

    @property
    def regions(self) -> tuple[str, ...]:
        """The attached region names."""
        return tuple(self._regions)

    def backend(self, region: str) -> str:
        """The backend ``region`` was attached with (``"shm"``, ``"zmq"`` or ``"rdma"``).

        Raises:
            KeyError: ``region`` is not attached.
        """
        return self._get(region).backend

    async def attach(self, descriptor: Mapping[str, Any], *, backend: str | None = None) -> str:
        """Attach the region a descriptor describes; return its name.

        The backend is :func:`choose_backend`'s pick among those the descriptor offers; if it fails
        here (e.g. shm of a host that looks the same but does not share memory), the next offered
        one is tried (``shm``, ``rdma``, then ``zmq``). Attaching a region already attached
        replaces it (after an owner restart, attach its new descriptor).

        Args:
            descriptor: from :meth:`BulkOwner.descriptor` (it may have crossed the network).
            backend: force one backend (benchmarks and tests; apps leave it None).

        Returns:
            The region name, as used by :meth:`read`.

        Raises:
            ValueError: a malformed descriptor, or a forced backend it does not offer.
            PeerLostError: the owner is gone (segments unlinked or of another generation, no zmq
                answer within ``timeout_s``).
            PortClosedError: the reader is closed.
        """
        self._check_open()
        desc, fields = _parse_descriptor(descriptor)
        offered = [b for b in BACKENDS if isinstance(desc.get(b), Mapping)]
        if backend is not None:
            if backend not in BACKENDS:
                raise ValueError(f"BulkReader.attach: unknown backend {backend!r}; choose from {list(BACKENDS)}")
            if backend not in offered:
                raise ValueError(
                    f"BulkReader.attach: region {desc['region']!r} is not offered over {backend!r} "
                    f"(offered: {offered})"
                )
            order = [backend]
        else:
            first = choose_backend(
                desc["host"], self._host, owner_rdma="rdma" in offered, reader_rdma="rdma" in offered and capabilities().rdma
            )
            same_host = desc["host"] == self._host
            order = [first] + [b for b in BACKENDS if b != first and b in offered and (b != "shm" or same_host)]
            order = [b for b in order if b in offered]
            if not order:
                raise ValueError(
                    f"BulkReader.attach: region {desc['region']!r} offers {offered or 'no backend'}, none usable "
                    f"from this host (shm needs the owner's host)"
                )
        errors: list[str] = []
        for b in order:
            att = _Attached(desc, fields)
            try:
                if b == "shm":
                    self._attach_shm(att, desc["shm"])
                elif b == "zmq":
                    await self._attach_zmq(att, desc["zmq"])
                else:
                    await self._attach_rdma(att, desc)
            except (OSError, ValueError, PeerLostError, RuntimeError, ImportError) as exc:
                errors.append(f"{b}: {exc}")
                if isinstance(exc, PeerLostError) and b == order[-1]:
                    raise
                continue
            old = self._regions.pop(att.name, None)
            if old is not None:
                self._release(old)
            att.backend = b
            self._regions[att.name] = att
            return att.name
        if any("no segment" in e or "generation" in e for e in errors):
            raise PeerLostError(f"bulk region {desc['region']!r}: {'; '.join(errors)}")
        raise ValueError(f"bulk region {desc['region']!r} could not be attached: {'; '.join(errors)}")

    def _attach_shm(self, att: _Attached, spec: Mapping[str, Any]) -> None:
        segs = spec.get("segments")
        if not isinstance(segs, Mapping) or set(segs) != set(att.fields):
            raise ValueError("bulk descriptor: shm segments do not match its fields")
        try:
            for name, seg_name in segs.items():
                expect = _shm.segment_name(att.run_id, att.name, name)
                if seg_name != expect:
                    raise ValueError(f"bulk descriptor: shm segment of field {name!r} is {seg_name!r}, expected {expect!r}")
                try:
                    seg = _shm.Segment.attach(seg_name)
                except FileNotFoundError:
                    raise PeerLostError(
                        f"no segment {seg_name} of bulk region {att.name!r}: its owner closed it or died"
                    ) from None
                att.segments[name] = seg
                info = att.fields[name]
                if seg.generation != att.generation:
                    raise PeerLostError(
                        f"bulk region {att.name!r}: segment {seg_name} is generation {seg.generation}, the "
                        f"descriptor's is {att.generation} (the owner restarted); get a fresh descriptor"
                    )
                if seg.rows != att.rows or seg.row_nbytes != info.row_nbytes:
                    raise ValueError(
                        f"bulk region {att.name!r}: segment {seg_name} holds {seg.rows} rows of "
                        f"{seg.row_nbytes} bytes, the descriptor says {att.rows} of {info.row_nbytes}"
                    )
                att.addrs[name] = seg.data.ctypes.data
                if name == att.version_field:
                    att.versions = seg.data.view(np.int64)
                att.owner = seg.owner
            self._check_shm_live(att, att.segments, force_start_check=True)
        except BaseException:
            self._release(att)
            raise

    async def _attach_zmq(self, att: _Attached, spec: Mapping[str, Any]) -> None:
        address = spec.get("address")
        max_req, max_rep = spec.get("max_request_nbytes"), spec.get("max_reply_nbytes")
        if not isinstance(address, str) or not isinstance(max_req, int) or not isinstance(max_rep, int):
            raise ValueError("bulk descriptor: zmq entry needs address, max_request_nbytes, max_reply_nbytes")
        server_key = spec.get("server_key")
        if server_key is not None and (not isinstance(server_key, str) or len(server_key) != 40):
            raise ValueError("bulk descriptor: zmq server_key must be a 40-character Z85 public key")
        client = self._clients.get(address)
        if client is None or client.lost is not None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            try:
                client = ZmqClient(
                    self._ctx, address, max_reply_nbytes=max_rep,
                    heartbeat_ivl_s=self._heartbeat[0], heartbeat_timeout_s=self._heartbeat[1],
                    curve=self._curve, server_key=None if server_key is None else server_key.encode(),
                )
            except BaseException:
                self._release(att)
                raise
            old = self._clients.get(address)
            if old is not None and old.users == 0:
                old.close()
            self._clients[address] = client
        att.client = client
        att.zmq_limits = (max_req, max_rep)
        client.users += 1
        try:
            reply = await client.call(
                {"op": "hello", "region": att.name, "generation": att.generation}, timeout_s=self._timeout_s, what="attach"
            )
        except BaseException:
            self._release(att)
            raise
        if reply.get("rows") != att.rows:
            self._release(att)
            raise ValueError(f"bulk region {att.name!r}: the owner says {reply.get('rows')} rows, the descriptor {att.rows}")

    async def _attach_rdma(self, att: _Attached, desc: Mapping[str, Any]) -> None:
        from . import _rdma

        caps = capabilities()
        if not caps.rdma:
            raise RuntimeError(f"rdma not usable here: {caps.rdma_reason}")
        spec = desc["rdma"]
        connect = spec.get("connect") if isinstance(spec, Mapping) else None
        if not isinstance(connect, Mapping):
            raise ValueError("bulk descriptor: rdma entry needs 'connect' (the owner's zmq control address)")
        await self._attach_zmq(att, connect)  # the control connection: hello, then the QP exchange
        try:
            att.rdma = await _rdma.RdmaReader.connect(dict(spec), att, att.client, timeout_s=self._timeout_s)
        except BaseException:
            self._release(att)
            raise

    def mapped(self, region: str) -> dict[str, np.ndarray]:
        """Read-only numpy views of a shm-attached region's fields (``[rows, *shape]``; the version
        column too), for readers that compute on the owner's memory in place (one-sided sampling,
        :mod:`reactor.replay.shared`). The views stay valid while the region is attached; the
        owner may write under them at any time (use its sequence locks), and a view never says the
        owner died: call :meth:`check_alive` after using what was read.

        Raises:
            KeyError: ``region`` is not attached.
            ValueError: it was attached over another backend than ``shm``, or a field's dtype has no
                numpy twin (bfloat16).
        """
        att = self._get(region)
        if att.backend != "shm":
            raise ValueError(f"bulk region {region!r} is attached over {att.backend}, not shm: nothing to map")
        out = {}
        for name, seg in att.segments.items():
            info = att.fields[name]
            twin = numpy_twin(info.dtype)
            if twin is None:
                raise ValueError(f"bulk region {region!r}: field {name!r} is {info.dtype}, which numpy cannot view")
            view = seg.data.view(twin).reshape((att.rows, *info.shape))
            view.flags.writeable = False
            out[name] = view
        return out

    def check_alive(self, region: str) -> None:
        """Raise ``PeerLostError`` if the owner of shm-attached ``region`` closed it or died
        (what every read checks after gathering; for users of :meth:`mapped`).

        Raises:
            KeyError: ``region`` is not attached.
            PeerLostError: the owner is gone.
        """
        att = self._get(region)
        if att.backend == "shm":  # every segment is marked together: one stands for the region
            seg = att.segments.get(att.version_field or "") or next(iter(att.segments.values()), None)
            self._check_shm_live(att, {} if seg is None else {"": seg})

    async def call(self, region: str, op: str, request: Mapping[str, Any]) -> dict[str, Any]:
        """Send ``request`` as op ``op`` for ``region`` (attached over zmq or rdma) to its owner's read server (an
        op the owner serves with :meth:`BulkOwner.serve_op`) and return the reply dict. The reply
        comes from the network: check its shape before use.

        Raises:
            KeyError: ``region`` is not attached.
            ValueError: it is attached over shm (there is no server to ask).
            PeerLostError: the owner is gone or did not answer in time.
            (and the errors the owner's handler answered with)
        """
        att = self._get(region)
        if att.client is None:  # (zmq and rdma attachments talk to the owner's server)
            raise ValueError(f"bulk region {region!r} is attached over {att.backend}, which has no owner's server")
        return await att.client.call({**request, "op": op, "region": att.name, "generation": att.generation},
                                     timeout_s=self._timeout_s, what=op)

    def detach(self, region: str) -> None:
        """Forget ``region`` (unmap its segments, drop its connection when no region uses it).

        Raises:
            KeyError: ``region`` is not attached.
        """
        self._release(self._regions.pop(self._get(region).name))

    def _release(self, att: _Attached) -> None:
        att.addrs = {}
        att.versions = None
        for seg in att.segments.values():
            seg.close_reader()
        att.segments = {}
        if att.rdma is not None:
            att.rdma.close()
            att.rdma = None
        if att.client is not None:
            client, att.client = att.client, None
            client.users -= 1
            if client.users <= 0:
                client.close()
                if self._clients.get(client.address) is client:
                    del self._clients[client.address]

    def _check_open(self) -> None:
        if self._closed:
            raise PortClosedError("this BulkReader is closed")

    def _get(self, region: str) -> _Attached:
        self._check_open()
        att = self._regions.get(region)
        if att is None:
            raise KeyError(f"bulk region {region!r} is not attached; attached: {sorted(self._regions)} (call attach)")
        return att

    async def aclose(self) -> None:
        """Detach everything and close connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for att in self._regions.values():
            self._release(att)
        self._regions.clear()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # ------------------------------------------------------------------ reads

    async def read(
        self,
        region: str,
        rows: Any,
        *,
        fields: Sequence[str] | None = None,
        out: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    ) -> dict[str, Any]:
        """Gather ``rows`` of ``region``: ``{field: [*rows.shape, *row_shape]}``.

        What it waits for: shm: nothing (the gather runs in this thread); zmq: the owner's reply.
        Cancelling a zmq read abandons its reply (a later read skips it). Rows written by the owner
        while they are read may come back torn; use :meth:`read_checked` where that matters.

        Args:
            region: an attached region's name.
            rows: int row numbers (ring slots), any shape, e.g. ``[B, T]`` windows from
                ``Storage.plan_windows``; numpy or a CPU tensor.
            fields: the fields to read (default: all but the version column).
            out: buffers to fill, ``field -> tensor or array`` of shape ``[*rows.shape,
                *row_shape]`` and the field's dtype, C-contiguous; CUDA tensors are filled through
                a host buffer. Must cover exactly the fields read.

        Returns:
            ``field -> tensor`` (the ``out`` buffers themselves where given).

        Raises:
            KeyError: the region is not attached, or has no such field.
            IndexError: a row outside ``[0, rows)`` (named with its position).
            TypeError: rows are not integers.
            ValueError: an ``out`` buffer of the wrong shape, dtype or layout (named).
            FrameTooLargeError: a zmq read larger than the owner's ``max_reply_nbytes``.
            PeerLostError: the owner died or closed the region (never stale data instead).
        """
        data, _ = await self._read(region, rows, None, fields, out, check=False, what="read")
        return data

    async def read_runs(
        self,
        region: str,
        starts: Any,
        lengths: Any,
        *,
        fields: Sequence[str] | None = None,
        out: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    ) -> dict[str, Any]:
        """Gather runs of rows ``[starts[i], starts[i] + lengths[i])``, concatenated: ``[sum(lengths), ...]``.

        The issue's ``(region, offset, length)`` list form of :meth:`read` (same semantics).

        Raises:
            ValueError: negative lengths or mismatched ``starts``/``lengths``.
            IndexError: a run reaching outside ``[0, rows)``.
            (and as :meth:`read`)
        """
        att = self._get(region)
        s = np.ascontiguousarray(np.asarray(starts), dtype=np.int64).ravel()
        n = np.ascontiguousarray(np.asarray(lengths), dtype=np.int64).ravel()
        if s.shape != n.shape:
            raise ValueError(f"read_runs: starts has {s.shape[0]} entries, lengths {n.shape[0]}")
        check_runs(s, n, att.rows, att.name)
        data, _ = await self._read(region, expand_runs(s, n), None, fields, out, check=False, what="read_runs")
        return data

    async def read_checked(
        self,
        region: str,
        rows: Any,
        expected: Any = None,
        *,
        fields: Sequence[str] | None = None,
        out: Mapping[str, torch.Tensor | np.ndarray] | None = None,
    ) -> tuple[dict[str, Any], np.ndarray]:
        """:meth:`read`, plus which rows are consistent under a concurrent writer (sequence lock).

        Loads the region's version column, gathers, loads it again (with fences; see
        :func:`seqlock_begin`) and marks a row valid only if its version was the same both times,
        not ``-1`` (mid-write), and equal to ``expected`` when given. Invalid rows' data is
        whatever the gather saw: drop or re-read them.

        Args:
            expected: int64 version per row (shape of ``rows``), or None to accept any stable one.

        Returns:
            ``(data, valid)``: ``valid`` is bool, shaped like ``rows``.

        Raises:
            ValueError: the region has no version column, or ``expected`` is misshapen.
            (and as :meth:`read`)
        """
        return await self._read(region, rows, expected, fields, out, check=True, what="read_checked")

    async def _read(
        self,
        region: str,
        rows: Any,
        expected: Any,
        fields: Sequence[str] | None,
        out: Mapping[str, Any] | None,
        *,
        check: bool,
        what: str,
    ) -> tuple[dict[str, Any], np.ndarray]:
        att = self._get(region)
        lead = tuple(rows.shape) if hasattr(rows, "shape") else np.shape(rows)
        flat = _int64_rows(rows, f"{what}({region!r})")
        starts, lengths, bad = _gather.runs_of(flat, att.rows)
        if bad >= 0:
            raise IndexError(
                f"{what}({region!r}): row {int(flat[bad])} at position {bad} is out of range [0, {att.rows})"
            )
        names = self._field_names(att, fields, out, what)
        exp: np.ndarray | None = None
        if check:
            if att.version_field is None:
                raise ValueError(
                    f"{what}: bulk region {att.name!r} has no version column; the owner must call "
                    f"allocate_versions({att.name!r}) and write rows under seqlock_begin/seqlock_end"
                )
            if expected is not None:
                e = expected.detach().cpu().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
                if e.shape != tuple(lead) or e.dtype.kind not in "iu":
                    raise ValueError(
                        f"{what}: expected must be integer versions shaped like rows {tuple(lead)}, "
                        f"got {e.dtype} {e.shape}"
                    )
                exp = np.ascontiguousarray(e, dtype=np.int64).ravel()
        results, dsts = self._prepare_out(att, names, tuple(lead), flat.shape[0], out, what)
        if att.backend == "shm":
            valid = self._gather_shm(att, flat, starts, lengths, names, dsts, check, exp)
        elif att.backend == "zmq":
            valid = await self._gather_zmq(att, flat, starts, lengths, names, results, tuple(lead), check, exp, what)
        else:
            valid = await att.rdma.gather(att, flat, starts, lengths, names, dsts, check, exp)
        for res, staging in results.values():
            if staging is not None:  # a CUDA out buffer: filled from host
                res.copy_(staging)
        out_map = {n: r for n, (r, _s) in results.items()}
        return out_map, (valid.reshape(lead) if valid is not None else np.ones(lead, dtype=bool))

    def _field_names(self, att: _Attached, fields: Sequence[str] | None, out: Mapping[str, Any] | None, what: str) -> list[str]:
        if fields is None:
            names = [n for n in att.fields if n != att.version_field]
        else:
            if isinstance(fields, str):
                raise TypeError(f"{what}: fields must be a list of names, got the str {fields!r}")
            names = list(fields)
            for n in names:
                if n not in att.fields:
                    raise KeyError(f"bulk region {att.name!r} has no field {n!r}; it has {sorted(att.fields)}")
        if out is not None:
            missing = [n for n in names if n not in out]
            extra = [n for n in out if n not in names]
            if missing or extra:
                raise ValueError(
                    f"{what}: out must hold exactly the fields read ({names}); "
                    f"missing {missing}, not read {extra}"
                )
        return names

    def _prepare_out(
        self, att: _Attached, names: list[str], lead: tuple[int, ...], k: int, out: Mapping[str, Any] | None, what: str
    ) -> tuple[dict[str, tuple[Any, Any]], dict[str, int]]:
        """Result objects (with a host staging tensor for CUDA buffers) and the address to gather
        each field into. The shape, dtype and contiguity checks here are what makes the raw copies
        into these addresses safe."""
        results: dict[str, tuple[Any, Any]] = {}
        dsts: dict[str, int] = {}
        for n in names:
            info = att.fields[n]
            shape = (*lead, *info.shape)
            if out is None:
                if att.backend == "zmq":  # the reply's own buffers become the result
                    results[n] = (None, None)
                    continue
                t = host_empty(shape, info.dtype)  # malloc'd: the caller's last batch's lines, still cached
                results[n] = (t, None)
                dsts[n] = t.data_ptr()
                continue
            buf = out[n]
            if isinstance(buf, torch.Tensor):
                if buf.dtype != info.dtype or tuple(buf.shape) != shape or not buf.is_contiguous():
                    raise ValueError(
                        f"{what}: out[{n!r}] is a tensor of {tuple(buf.shape)} {buf.dtype} "
                        f"(contiguous={buf.is_contiguous()}); expected a contiguous {shape} {info.dtype}"
                    )
                if buf.device.type == "cpu":
                    results[n] = (buf, None)
                    dsts[n] = buf.data_ptr()
                else:
                    staging = torch.empty(shape, dtype=info.dtype, pin_memory=torch.cuda.is_available())
                    results[n] = (buf, staging)
                    dsts[n] = staging.data_ptr()
            elif isinstance(buf, np.ndarray):
                want = numpy_twin(info.dtype)
                if want is None or buf.dtype != want or buf.shape != shape or not buf.flags.c_contiguous or not buf.flags.writeable:
                    raise ValueError(
                        f"{what}: out[{n!r}] is an array of {buf.shape} {buf.dtype}; expected a writable "
                        f"C-contiguous {shape} {want if want is not None else info.dtype}"
                    )
                results[n] = (buf, None)
                dsts[n] = buf.ctypes.data
            else:
                raise ValueError(f"{what}: out[{n!r}] must be a torch.Tensor or numpy array, got {type(buf).__name__}")
        return results, dsts

    # ------------------------------------------------------------------ shm

    def _check_shm_live(self, att: _Attached, segments: Mapping[str, _shm.Segment], force_start_check: bool = False) -> None:
        for seg in segments.values():
            state = seg.state
            if state != _shm.STATE_LIVE:
                why = "closed it" if state == _shm.STATE_CLOSED else "died (its segments were cleaned up)"
                raise PeerLostError(f"bulk region {att.name!r}: its owner (pid {seg.owner[0]}) {why}")
        now = time.monotonic()
        check_start = force_start_check or now - att.last_start_check > _START_CHECK_PERIOD_S
        if check_start:
            att.last_start_check = now
        pid, start, ns = att.owner
        if not _shm.owner_alive(pid, start, ns, check_start=check_start):
            raise PeerLostError(f"bulk region {att.name!r}: its owner (pid {pid}) died")

    def _gather_shm(
        self, att: _Attached, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, names: list[str],
        dsts: dict[str, int], check: bool, exp: np.ndarray | None,
    ) -> np.ndarray | None:
        live = [n for n in names if att.fields[n].row_nbytes]
        src = np.array([att.addrs[n] for n in live], dtype=np.int64)
        dst = np.array([dsts[n] for n in live], dtype=np.int64)
        rbs = np.array([att.fields[n].row_nbytes for n in live], dtype=np.int64)
        valid = None
        if check:
            versions = att.versions
            assert versions is not None
            v1 = _gather.load_versions_fence(versions, flat)
            _gather.copy_runs(src, att.rows, dst, flat.shape[0], rbs, starts, lengths)
            v2 = _gather.fence_load_versions(versions, flat)
            valid = seqlock_mask(v1, v2, exp)
        else:
            _gather.copy_runs(src, att.rows, dst, flat.shape[0], rbs, starts, lengths)
        # After the gather: data gathered from a dead owner's memory is never returned.
        used = {n: att.segments[n] for n in names}
        if check:
            used[att.version_field] = att.segments[att.version_field]  # type: ignore[index]
        self._check_shm_live(att, used or att.segments)
        return valid

    # ------------------------------------------------------------------ zmq

    async def _gather_zmq(
        self, att: _Attached, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, names: list[str],
        results: dict[str, tuple[Any, Any]], lead: tuple[int, ...], check: bool, exp: np.ndarray | None, what: str,
    ) -> np.ndarray | None:
        client = att.client
        if client is None:
            raise PeerLostError(f"bulk region {att.name!r}: its zmq connection is closed")
        max_req, max_rep = att.zmq_limits
        k = flat.shape[0]
        nbytes = k * (sum(att.fields[n].row_nbytes for n in names) + check)  # (+ the valid mask)
        if nbytes + REPLY_OVERHEAD_NBYTES > max_rep:
            raise FrameTooLargeError(
                f"{what}: {k} rows ({nbytes} bytes) from bulk region {att.name!r} exceed the owner's "
                f"max_reply_nbytes of {max_rep}; read fewer rows per call"
            )
        req_nbytes = 16 * starts.shape[0] + (8 * k if exp is not None else 0) + REQUEST_OVERHEAD_NBYTES
        if req_nbytes > max_req:
            raise FrameTooLargeError(
                f"{what}: the request for {k} rows in {starts.shape[0]} runs ({req_nbytes} bytes) exceeds the "
                f"owner's max_request_nbytes of {max_req}; read fewer rows per call"
            )
        if k == 0 or not names:
            data: list[np.ndarray] = [np.empty(0, np.uint8) for _ in names]
            valid = np.ones(k, dtype=bool) if check else None
        else:
            reply = await client.call(
                {
                    "op": "read", "region": att.name, "generation": att.generation, "fields": names,
                    "starts": starts, "lengths": lengths, "check": check, "expected": exp,
                },
                timeout_s=self._timeout_s,
                what=what,
            )
            data = reply.get("data")  # type: ignore[assignment]
            valid = reply.get("valid")
            if (
                not isinstance(data, list)
                or len(data) != len(names)
                or not all(
                    isinstance(d, np.ndarray) and d.dtype == np.uint8 and d.shape == (k * att.fields[n].row_nbytes,)
                    for d, n in zip(data, names)
                )
                or (check and not (isinstance(valid, np.ndarray) and valid.dtype == np.bool_ and valid.shape == (k,)))
            ):
                raise MalformedFrameError(f"bulk owner of region {att.name!r} sent a reply of the wrong shape")
        for n, d in zip(names, data):
            info = att.fields[n]
            res, staging = results[n]
            if res is None:
                results[n] = (_tensor_from_bytes(d, info.dtype, (*lead, *info.shape)), None)
            elif info.row_nbytes and k:
                np.copyto(_byte_view(staging if staging is not None else res), d)
        return valid


def _byte_view(buf: torch.Tensor | np.ndarray) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor or array."""
    if isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8).numpy()
    return buf.reshape(-1).view(np.uint8)


def _tensor_from_bytes(d: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over the received bytes (no copy) where aligned and writable, else a copy."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if d.size == 0:
        return torch.empty(shape, dtype=dtype)
    if not d.flags.writeable or d.ctypes.data % itemsize:
        d = d.copy()
    return torch.from_numpy(d).view(dtype).view(shape)

