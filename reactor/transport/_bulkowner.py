"""The owning side of the bulk transport: :class:`BulkOwner` allocates regions and serves them
(see :mod:`reactor.transport.bulk`)."""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from reactor._errors import PortClosedError

from . import _shm
from ._bulkbase import (
    _DESCRIPTOR_KIND,
    _DESCRIPTOR_VERSION,
    _DTYPE_NAMES,
    _OPEN_TOKEN,
    _TORCH_DTYPES,
    BACKENDS,
    VERSION_FIELD,
    capabilities,
    host_id,
)
from ._bulkzmq import (
    ServedRegion,
    ZmqServer,
)
from ._zmq import CurveKeys

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
        return cls._open(run_id, backends=backends, host=host, zmq_bind=zmq_bind, max_request_nbytes=max_request_nbytes,
                         max_reply_nbytes=max_reply_nbytes, heartbeat_ivl_s=heartbeat_ivl_s,
                         heartbeat_timeout_s=heartbeat_timeout_s, curve=curve)

    @classmethod
    def open_shm(cls, run_id: str, *, host: str | None = None) -> BulkOwner:
        """:meth:`open` with the ``shm`` backend only, called without an event loop (a sync reaction):
        regions for readers of this host, no read server. An actor's writer stages its rows for the
        replay shards of its host in one (:mod:`reactor.nodes._staging`).

        Raises:
            ValueError: a bad run id.
            RuntimeError: POSIX shared memory is not usable here.
        """
        return cls._open(run_id, backends=["shm"], host=host)

    @classmethod
    def _open(
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
                tensor = torch.from_numpy(segment.data).view(dtype).view(shape_t)
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

    def page_nbytes(self, region: str) -> tuple[int, int]:
        """``(on 2 MiB pages, in large segments)``: the bytes of ``region``'s fields in shared-memory
        segments of 2 MiB or more (smaller ones stay on 4 KiB pages), and how many of them the kernel
        put on 2 MiB pages (``reactor/transport/_shm.py``, "Pages").

        Raises:
            KeyError: no such region.
        """
        reg = self._regions.get(region)
        if reg is None:
            raise KeyError(f"bulk owner has no region {region!r}")
        large = [(seg.rows * seg.row_nbytes, seg.huge) for f in reg.fields.values()
                 if (seg := f.segment) is not None and _shm.HEADER_NBYTES + seg.rows * seg.row_nbytes >= _shm.HUGE_NBYTES]
        return sum(n for n, huge in large if huge), sum(n for n, _huge in large)

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

