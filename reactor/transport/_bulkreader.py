"""The reading side of the bulk transport: :class:`BulkReader` attaches descriptors and gathers
rows (see :mod:`reactor.transport.bulk`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio

from reactor._errors import FrameTooLargeError, MalformedFrameError, PeerLostError, PortClosedError
from reactor._native import host_empty, numpy_twin

from . import _gather, _shm
from ._bulkbase import (
    _DESCRIPTOR_KIND,
    _DESCRIPTOR_VERSION,
    _OPEN_TOKEN,
    _START_CHECK_PERIOD_S,
    _TORCH_DTYPES,
    BACKENDS,
    _int64_rows,
    capabilities,
    choose_backend,
    host_id,
)
from ._bulkzmq import (
    REPLY_OVERHEAD_NBYTES,
    REQUEST_OVERHEAD_NBYTES,
    ZmqClient,
    check_runs,
    expand_runs,
    read_nbytes,
    seqlock_mask,
)
from ._zmq import CurveKeys

#: zmq I/O threads of a reader's context: a sample over several read servers arrives on several
#: connections at once, and with CURVE each connection's decryption (libsodium, ~0.8 GB/s a core
#: here) runs on its I/O thread; two let two replies decrypt at once (measured: one-sided samples
#: over four servers +10-15% batches/s on a 2-core machine, docs/benchmarks.md).
READER_IO_THREADS = 2
#: Bounds on what a descriptor (it may have crossed the network) may say of a zmq read server.
_ADDRESS_MAX = 1024
_LIMIT_MAX = 1 << 40  # (a size limit past it is a lie: zmq's MAXMSGSIZE is an int64)

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
        "backend", "client", "fields", "generation", "last_alive_check", "last_start_check", "name", "owner", "rdma",
        "rows", "run_id", "segments", "version_field", "addrs", "versions", "zmq_limits", "writable",
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
        self.writable: dict[str, _shm.Segment] = {}  # shm: fields also mapped read-write (writable_view)
        self.addrs: dict[str, int] = {}  # shm: field -> address of its mapped rows
        self.versions: np.ndarray | None = None  # shm: the mapped version column
        self.owner: tuple[int, int, int] = (0, 0, 0)
        self.last_start_check = 0.0
        self.last_alive_check = -1.0  # (monotonic) when its owner process was last found running
        self.client: ZmqClient | None = None
        self.zmq_limits: tuple[int, int] = (0, 0)
        self.rdma: Any = None


def _parse_descriptor(desc: Any) -> tuple[dict[str, Any], dict[str, _FieldInfo]]:
    """Validate a descriptor's shape (it may come from the network); return it and its fields."""
    if not isinstance(desc, Mapping) or desc.get("kind") != _DESCRIPTOR_KIND:
        raise ValueError(f"not a bulk region descriptor (from BulkOwner.descriptor): {desc!r:.200}")
    if desc.get("version") != _DESCRIPTOR_VERSION:
        raise ValueError(f"bulk descriptor version {desc.get('version')!r:.40} is not {_DESCRIPTOR_VERSION} (mixed releases?)")
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
            raise ValueError(f"bulk descriptor: field {name!r:.100} has unknown dtype {spec.get('dtype')!r:.40}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"bulk descriptor: field {name!r:.100} has a bad shape {shape!r:.60}")
        row_nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if spec.get("row_nbytes") != row_nbytes:
            raise ValueError(f"bulk descriptor: field {name!r:.100} row_nbytes {spec.get('row_nbytes')!r:.40} != {row_nbytes}")
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
        return cls._open(host, timeout_s, (heartbeat_ivl_s, heartbeat_timeout_s), curve)

    @classmethod
    def open_shm(cls, *, host: str | None = None) -> BulkReader:
        """A reader opened without an event loop (a sync reaction), for :meth:`attach_shm` and
        :meth:`mapped`: regions of this host only (a replay shard reading the rows its writers
        staged, :mod:`reactor.nodes._staging`)."""
        return cls._open(host, 30.0, (1.0, 5.0), None)

    @classmethod
    def _open(cls, host: str | None, timeout_s: float, heartbeat: tuple[float, float],
              curve: CurveKeys | None) -> BulkReader:
        self = cls(_token=_OPEN_TOKEN)
        self._host = host if host is not None else host_id()
        self._timeout_s = float(timeout_s)
        self._heartbeat = heartbeat
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

    def attach_shm(self, descriptor: Mapping[str, Any]) -> str:
        """:meth:`attach` over ``shm`` only, without an event loop; return the region's name.

        Raises:
            ValueError: a malformed descriptor, one of another host or that offers no ``shm``.
            PeerLostError: the owner closed the region or died (its segments gone or not live).
            OSError: a segment could not be mapped.
            PortClosedError: the reader is closed.
        """
        self._check_open()
        desc, fields = _parse_descriptor(descriptor)
        if not isinstance(desc.get("shm"), Mapping):
            raise ValueError(f"bulk region {desc['region']!r} is not offered over shm")
        if desc["host"] != self._host:
            raise ValueError(f"bulk region {desc['region']!r} is of host {desc['host']!r:.100}, not this one "
                             f"({self._host!r}): shm needs the owner's host")
        att = _Attached(desc, fields)
        self._attach_shm(att, desc["shm"])
        old = self._regions.pop(att.name, None)
        if old is not None:
            self._release(old)
        att.backend = "shm"
        self._regions[att.name] = att
        return att.name

    def _attach_shm(self, att: _Attached, spec: Mapping[str, Any]) -> None:
        segs = spec.get("segments")
        if not isinstance(segs, Mapping) or set(segs) != set(att.fields):
            raise ValueError("bulk descriptor: shm segments do not match its fields")
        try:
            for name, seg_name in segs.items():
                expect = _shm.segment_name(att.run_id, att.name, name)
                if seg_name != expect:
                    raise ValueError(f"bulk descriptor: shm segment of field {name!r:.100} is {seg_name!r:.200}, expected {expect!r}")
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
        if not address.startswith(("tcp://", "ipc://")) or len(address) > _ADDRESS_MAX:
            raise ValueError(f"bulk descriptor: zmq address must be tcp:// or ipc:// (at most {_ADDRESS_MAX} "
                             f"characters), got {address!r:.200}")
        for what, v in (("max_request_nbytes", max_req), ("max_reply_nbytes", max_rep)):
            if type(v) is not int or not 0 < v <= _LIMIT_MAX:
                raise ValueError(f"bulk descriptor: zmq {what} must be an int in 1..{_LIMIT_MAX}, got {v!r:.40}")
        server_key = spec.get("server_key")
        if server_key is not None and (not isinstance(server_key, str) or len(server_key) != 40):
            raise ValueError("bulk descriptor: zmq server_key must be a 40-character Z85 public key")
        client = self._clients.get(address)
        if client is None or client.lost is not None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context(io_threads=READER_IO_THREADS)
            try:
                client = ZmqClient(
                    self._ctx, address, max_reply_nbytes=max_rep,
                    heartbeat_ivl_s=self._heartbeat[0], heartbeat_timeout_s=self._heartbeat[1],
                    curve=self._curve, server_key=None if server_key is None else server_key.encode(),
                )
            except zmq.ZMQError as e:  # (an address or a key zmq refuses: the descriptor's fault)
                self._release(att)
                raise ValueError(f"bulk descriptor: zmq refused address {address!r:.200} or its server key: {e}") from None
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
        except (MalformedFrameError, FrameTooLargeError, KeyError, IndexError, TypeError) as e:
            # (the owner's refusal, "no region" after it closed one, or a reply that is not an answer)
            self._release(att)
            raise ValueError(f"the owner's answer to attach: {type(e).__name__}: {str(e)[:300]}") from None
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

    def writable_view(self, region: str, field: str) -> np.ndarray:
        """A read-write numpy view of one field of a shm-attached region (mapped a second time, with
        write access): for the few words a reader itself writes in its owner's memory, such as the
        sample budget that readers of a replay shard take from atomically
        (:mod:`reactor.replay._budget`). The owner must trust nothing it reads there. The view
        lives as long as the region stays attached.

        Raises:
            KeyError: ``region`` is not attached, or has no field ``field``.
            ValueError: attached over another backend than ``shm``, or the field's dtype has no
                numpy twin.
            PermissionError: this process may not write the segment.
        """
        att = self._get(region)
        if att.backend != "shm":
            raise ValueError(f"bulk region {region!r} is attached over {att.backend}, not shm: nothing to map")
        info = att.fields[field]
        twin = numpy_twin(info.dtype)
        if twin is None:
            raise ValueError(f"bulk region {region!r}: field {field!r} is {info.dtype}, which numpy cannot view")
        seg = att.writable.get(field)
        if seg is None:
            seg = _shm.Segment.attach(att.segments[field].name, writable=True)
            if seg.generation != att.generation or seg.rows != att.rows or seg.row_nbytes != info.row_nbytes:
                seg.close_reader()
                raise PeerLostError(f"bulk region {region!r}: segment of field {field!r} changed since it was "
                                    f"attached (the owner restarted)")
            att.writable[field] = seg
        return seg.data.view(twin).reshape((att.rows, *info.shape))

    def check_alive(self, region: str, within_s: float = 0.0) -> None:
        """Raise ``PeerLostError`` if the owner of shm-attached ``region`` closed it or died
        (what every read checks after gathering; for users of :meth:`mapped`).

        ``within_s``: a check of the owner's process (a system call) that found it running less than
        this long ago stands; the region's state word (closed, or cleaned up after a death) is read
        every time.

        Raises:
            KeyError: ``region`` is not attached.
            PeerLostError: the owner is gone.
        """
        self.check_alive_all((region,), within_s)

    def check_alive_all(self, regions: Sequence[str], within_s: float = 0.0) -> None:
        """:meth:`check_alive` of each of ``regions`` in turn (one clock read for all: a sample's
        shards, checked after every one-sided copy).

        Raises:
            KeyError: a region is not attached.
            PeerLostError: the owner of one is gone (the first found).
        """
        self._check_open()
        now = time.monotonic() if within_s > 0 else 0.0
        for region in regions:
            att = self._regions.get(region) or self._get(region)  # (_get raises, naming the attached ones)
            if att.backend != "shm":
                continue
            seg = att.segments.get(att.version_field or "") or next(iter(att.segments.values()), None)
            if within_s > 0 and now - att.last_alive_check < within_s:  # every segment is marked together
                if seg is not None and seg.state != _shm.STATE_LIVE:
                    self._check_shm_live(att, {"": seg})  # (raises, saying how it ended)
                continue
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
        return await self.reply(self.send_call(region, op, request))

    def send_call(self, region: str, op: str, request: Mapping[str, Any]) -> tuple[Any, int, str]:
        """:meth:`call`'s request, sent now; its reply is awaited with :meth:`reply`, or given up on
        with :meth:`forget` (every call sent gets one of the two). Several may be out at once, to one
        owner or several: an owner's server answers its in order, and serves the next while the
        reader handles the last reply.

        Raises:
            KeyError, ValueError, PeerLostError: as :meth:`call` (a lost connection: at once).
        """
        att = self._get(region)
        if att.client is None:  # (zmq and rdma attachments talk to the owner's server)
            raise ValueError(f"bulk region {region!r} is attached over {att.backend}, which has no owner's server")
        client = att.client
        return client, client.send({**request, "op": op, "region": att.name, "generation": att.generation}), op

    async def reply(self, sent: tuple[Any, int, str], *, deadline: float | None = None) -> dict[str, Any]:
        """The reply to a request :meth:`send_call` sent (raises as :meth:`call`). ``deadline`` (the
        loop's time; default the reader's ``timeout_s`` from now): several replies awaited in turn
        share one."""
        client, req_id, op = sent
        return await client.reply(req_id, timeout_s=self._timeout_s, what=op, deadline=deadline)

    def forget(self, sent: tuple[Any, int, str]) -> None:
        """Give up on a request :meth:`send_call` sent: its reply, if it comes, is dropped."""
        client, req_id, _op = sent
        client.forget(req_id)

    @property
    def timeout_s(self) -> float:
        """How long a reply is waited for."""
        return self._timeout_s

    def detach(self, region: str) -> None:
        """Forget ``region`` (unmap its segments, drop its connection when no region uses it).

        Raises:
            KeyError: ``region`` is not attached.
        """
        self._release(self._regions.pop(self._get(region).name))

    def _release(self, att: _Attached) -> None:
        att.addrs = {}
        att.versions = None
        for seg in (*att.segments.values(), *att.writable.values()):
            seg.close_reader()
        att.segments, att.writable = {}, {}
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
        att.last_alive_check = now

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
        nbytes = read_nbytes(k, sum(att.fields[n].row_nbytes for n in names), check)
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
            valid = reply.get("valid") if check else None  # (unchecked: whatever the owner put there is not read)
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

