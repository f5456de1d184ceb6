"""The ZeroMQ backend of the bulk transport: a read server thread in the owner, a client in readers.

Why a thread and not a task on the owner's event loop: a read is a gather of up to hundreds of MB
done by a GIL-free kernel; on the owner's loop it would stall the owner's reactions for its whole
duration, and the owner's reactions would delay reads. The server thread has its own zmq context
and ROUTER socket, never touches the owner's loop, and reads the owner's field memory directly
(the owner's reactor code is not involved in serving reads at all). It is stopped through an
inproc socket, so ``aclose()`` returns as soon as the current request is answered.

Wire protocol (every message is :mod:`reactor.transport.codec` frames, nothing pickled):

- request ``{"op": "hello", "id", "region", "generation"}`` -> ``{"id", "ok": True, "rows",
  "fields"}``: checks the reader's descriptor still matches the owner (attach).
- request ``{"op": "read", "id", "region", "generation", "fields": [names], "starts": int64[R],
  "lengths": int64[R], "check": bool, "expected": int64[K] | None}`` -> ``{"id", "ok": True,
  "data": [uint8[K * row_nbytes] per field], "valid": bool[K] | None}``: rows are given as runs
  (``starts``, ``lengths``); the reply's data arrays travel as zero-copy frames.
- any error -> ``{"id", "ok": False, "error": class name, "message": text}``; the reader raises
  that class (from an allow-list) with that text. A malformed request is answered the same way
  when it carries an id, else logged and dropped; the server keeps serving.

Sizes are bounded both ways: zmq's ``MAXMSGSIZE`` on the server refuses requests over
``max_request_nbytes`` before they reach Python, and a read whose reply would exceed
``max_reply_nbytes`` is refused with ``FrameTooLargeError`` (readers check first, without a round
trip); a checked read counts the server's per-row version arrays too (:func:`read_nbytes`: a request
of runs without fields made it build 6.9 GB for a 253 MiB reply). The replies zmq still holds for
one reader, unsent, are bounded by ``max_reply_nbytes`` as well: a request that comes while more is
queued for its reader is refused (``ValueError``) until zmq has sent it. A reader that asks and
never reads (a stopped process, a socket that takes nothing) held every reply in the server's memory
until it disconnected, up to zmq's 1,000 queued messages: 145 MB a remote sample.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
import zmq.backend
from zmq.auth.thread import ThreadAuthenticator

from reactor._errors import FrameTooLargeError, MalformedFrameError, PeerLostError
from reactor._files import check_ipc_bind
from reactor._floodlog import flood_logged, flood_tally

from . import _gather
from ._zmq import CurveKeys, _AllowedKeys
from .codec import decode, encode, frames_nbytes

__all__ = ["ZmqClient", "ZmqServer", "mark_seen", "read_nbytes"]

log = logging.getLogger("reactor.transport.bulk")

PROTOCOL = 1
#: Bytes of a reply beyond its data (msgpack header, valid mask): the reply bound allows for it.
REPLY_OVERHEAD_NBYTES = 64 * 1024
#: Replies of at least this many bytes are tracked until zmq has sent them (the unsent bound, above);
#: smaller ones (errors, hellos, small reads) cost the server little even when queued by the thousand.
_TRACKED_REPLY_NBYTES = 64 * 1024
#: Bytes of a request besides its runs and expected versions.
REQUEST_OVERHEAD_NBYTES = 4096
#: Bytes a checked read's server builds a row besides the reply: the row's index and its versions
#: read before and after the gather (int64 each).
CHECK_WORK_NBYTES = 24


def read_nbytes(rows: int, row_nbytes: int, check: bool) -> int:
    """What a read of ``rows`` rows of ``row_nbytes`` bytes (all its fields) costs the owner's server, the
    figure ``max_reply_nbytes`` bounds: its reply's data, and for a checked read the valid mask and the
    version check's per-row arrays (:data:`CHECK_WORK_NBYTES`)."""
    return rows * (row_nbytes + (1 + CHECK_WORK_NBYTES if check else 0))



@dataclass
class _Unsent:
    """Replies to one reader that zmq may still hold unsent: their trackers and sizes, oldest first."""

    queue: deque[tuple[zmq.MessageTracker, int]] = field(default_factory=deque)
    nbytes: int = 0


_ERRORS: dict[str, type[Exception]] = {
    "KeyError": KeyError,
    "ValueError": ValueError,
    "IndexError": IndexError,
    "TypeError": TypeError,
    "FrameTooLargeError": FrameTooLargeError,
    "MalformedFrameError": MalformedFrameError,
    "PeerLostError": PeerLostError,
}


class ServedRegion:
    """What the server needs of one region: its rows, generation and per-field byte views."""

    __slots__ = ("fields", "generation", "name", "rows", "version_field", "versions")

    def __init__(self, name: str, rows: int, generation: int) -> None:
        self.name = name
        self.rows = rows
        self.generation = generation
        #: field -> (row_nbytes, address of the rows or None for a CUDA field, tensor); the dict is
        #: replaced whole, never mutated (the server thread reads it without a lock)
        self.fields: dict[str, tuple[int, int | None, Any]] = {}
        self.version_field: str | None = None
        self.versions: np.ndarray | None = None


def expand_runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Rows of runs ``[starts[i], starts[i] + lengths[i])``, concatenated (vectorized)."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total, dtype=np.int64)


def _gather_fields(
    entries: list[tuple[int, int | None, Any]], rows: int, starts: np.ndarray, lengths: np.ndarray, total: int
) -> list[np.ndarray]:
    """Gather runs of rows of several fields into fresh uint8 arrays ``[total * row_nbytes]``."""
    outs = [np.empty(total * rb, dtype=np.uint8) for rb, _a, _t in entries]
    host = [i for i, (rb, addr, _t) in enumerate(entries) if addr is not None and rb]
    _gather.copy_runs(
        np.array([entries[i][1] for i in host], dtype=np.int64),
        rows,
        np.array([outs[i].ctypes.data for i in host], dtype=np.int64),
        total,
        np.array([entries[i][0] for i in host], dtype=np.int64),
        starts,
        lengths,
    )
    for i, (_rb, addr, tensor) in enumerate(entries):
        if addr is None:  # a device (CUDA) field: gather there, stage through host memory
            import torch

            idx = torch.from_numpy(expand_runs(starts, lengths)).to(tensor.device)
            got = tensor.index_select(0, idx).contiguous().cpu()
            outs[i] = got.reshape(-1).view(torch.uint8).numpy() if got.numel() else np.empty(0, np.uint8)
    return outs


class ZmqServer:
    """Serves reads of an owner's regions from a thread with its own zmq socket.

    Args:
        lookup: ``region name -> ServedRegion | None`` (called from the server thread).
        bind: zmq address to bind (``tcp://HOST:*`` or ``ipc://PATH``).
        max_request_nbytes / max_reply_nbytes: the bounds described in the module docstring.
        heartbeat_ivl_s / heartbeat_timeout_s: zmq heartbeats on reader connections.
        curve: the server's CURVE key pair: connections are then encrypted, and only clients whose
            public key is in ``curve_clients`` (default: ``curve.public``, one key pair per job)
            get through the handshake (ZAP, in a thread of this server's context).
    """

    def __init__(
        self,
        lookup: Callable[[str], ServedRegion | None],
        bind: str,
        *,
        max_request_nbytes: int,
        max_reply_nbytes: int,
        heartbeat_ivl_s: float,
        heartbeat_timeout_s: float,
        name: str,
        curve: CurveKeys | None = None,
        curve_clients: Collection[bytes] | None = None,
    ) -> None:
        self._lookup = lookup
        self._max_request = max_request_nbytes
        self._max_reply = max_reply_nbytes
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_request_nbytes)
        self._router.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl_s * 1000))
        self._router.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        self._router.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout_s * 1000))
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._auth: ThreadAuthenticator | None = None
        self.curve_public: bytes | None = None
        try:
            if curve is not None:
                self._auth = ThreadAuthenticator(self._ctx)
                self._auth.start()
                self._auth.configure_curve_callback(
                    "*", credentials_provider=_AllowedKeys([curve.public] if curve_clients is None else curve_clients)
                )
                self._router.curve_server = True
                self._router.curve_secretkey = curve.secret
                self._router.curve_publickey = curve.public
                self.curve_public = curve.public
            check_ipc_bind(bind)
            self._router.bind(bind)
        except (zmq.ZMQError, FileExistsError) as exc:  # a bad address, a file there, or no CURVE: release everything
            self._router.close(0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            raise OSError(f"bulk zmq server cannot start on {bind!r}: {exc}") from None
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop_addr = f"inproc://bulk-stop-{id(self)}"
        self._stop_rx = self._ctx.socket(zmq.PAIR)
        self._stop_rx.bind(self._stop_addr)
        self._stop_tx = self._ctx.socket(zmq.PAIR)
        self._stop_tx.setsockopt(zmq.LINGER, 0)
        self._stop_tx.connect(self._stop_addr)
        self.served = 0
        self.refused = 0
        #: Replies zmq may still hold unsent, per reader (its routing id); ``_unsent_nbytes`` forgets the sent.
        self._unsent: dict[bytes, _Unsent] = {}
        #: further ops (e.g. the rdma key exchange): name -> handler(request, region) -> reply fields
        self.extra_ops: dict[str, Callable[[dict[str, Any], ServedRegion], dict[str, Any]]] = {}
        self._thread = threading.Thread(target=self._run, name=f"bulk-server-{name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        """Stop the thread (after the request in hand) and release the sockets. Idempotent."""
        if self._ctx.closed:
            return
        if threading.current_thread() is self._thread:  # (a finalizer run by GC in this thread)
            self._stop_tx.send(b"stop")
            return
        if self._thread.is_alive():
            self._stop_tx.send(b"stop")
            self._thread.join()
        self._stop_tx.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._stop_rx in ready:
                    return
                for _ in range(64):  # drain what is ready, then look at the stop socket again
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
        except Exception:  # pragma: no cover - a bug; readers then see PeerLostError
            log.exception("bulk zmq server thread failed")
        finally:
            self._router.close(0)
            self._stop_rx.close(0)

    # ------------------------------------------------------------------ requests

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            return
        ident = frames[0].bytes
        req_id: Any = None
        try:
            req = decode(frames[1:], max_nbytes=self._max_request)
            if type(req) is not dict:
                raise MalformedFrameError(f"a bulk request must be a dict, got {type(req).__name__}")
            req_id = req.get("id")
            unsent = self._unsent_nbytes(ident)
            if unsent > self._max_reply:
                raise ValueError(f"bulk server: {unsent} bytes of earlier replies to this reader are still unsent, "
                                 f"over the owner's max_reply_nbytes of {self._max_reply}: the reader does not take "
                                 f"them; read the replies before asking for more")
            reply = self._serve(req)
            self.served += 1
        except Exception as exc:  # noqa: BLE001 - no request, however it fails, ends the server's thread
            self.refused += 1
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            if not isinstance(exc, (KeyError, ValueError, IndexError, TypeError, FrameTooLargeError,
                                    MalformedFrameError)) and flood_logged(self.refused):
                # (not one of the checks' own refusals: a value that broke something it should not have)
                log.warning("bulk server: a request from %r failed unforeseen%s", ident[:32],
                            flood_tally(self.refused), exc_info=True)
            if req_id is None:
                if flood_logged(self.refused):
                    log.warning("bulk server: dropped a request without an id from %r: %.300s%s",
                                ident[:32], msg, flood_tally(self.refused))
                return
            reply = {"id": req_id, "ok": False, "error": type(exc).__name__, "message": str(msg)[:300]}
        try:
            out = encode(reply)
        except (TypeError, ValueError) as exc:  # an id of a type we cannot echo
            log.warning("bulk server: could not encode a reply to %r: %s", ident[:32], exc)
            return
        nbytes = frames_nbytes(out)
        try:
            if nbytes < _TRACKED_REPLY_NBYTES:
                self._router.send_multipart([ident, *out], zmq.NOBLOCK, copy=False)
            else:
                tracker = self._router.send_multipart([ident, *out], zmq.NOBLOCK, copy=False, track=True)
                unsent = self._unsent.setdefault(ident, _Unsent())
                unsent.queue.append((tracker, nbytes))
                unsent.nbytes += nbytes
        except zmq.ZMQError as exc:  # the reader is gone or flooded: it will time out or see the loss
            log.info("bulk server: could not reply to %r: %s", ident[:32], exc)
        if (self.served + self.refused) % 1024 == 0:
            for who in list(self._unsent):  # (readers gone: zmq dropped their queues, so their replies count as sent)
                self._unsent_nbytes(who)

    def _unsent_nbytes(self, ident: bytes) -> int:
        """Bytes of replies to reader ``ident`` that zmq still holds (a reader's replies leave in order)."""
        unsent = self._unsent.get(ident)
        if unsent is None:
            return 0
        queue = unsent.queue
        while queue and queue[0][0].done:
            unsent.nbytes -= queue.popleft()[1]
        if not queue:
            del self._unsent[ident]
            return 0
        return unsent.nbytes

    def _serve(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        region = self._lookup(req.get("region"))  # type: ignore[arg-type]
        if region is None:
            raise KeyError(f"bulk owner has no region {req.get('region')!r:.100}")
        generation = req.get("generation")
        if type(generation) is not int:
            raise ValueError(f"a bulk request's 'generation' must be an int, got {type(generation).__name__}")
        if generation != region.generation:
            raise PeerLostErrorReply(
                f"bulk region {region.name!r} is generation {region.generation}, the reader's descriptor "
                f"has {req.get('generation')!r:.40} (the owner restarted); get a fresh descriptor"
            )
        if op == "hello":
            return {"id": req["id"], "ok": True, "rows": region.rows, "fields": sorted(region.fields)}
        if op != "read":
            handler = self.extra_ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ValueError(f"unknown bulk request op {op!r:.40}")
            return {**handler(req, region), "id": req["id"], "ok": True}
        names = req.get("fields")
        if type(names) is not list or not all(type(n) is str for n in names):
            raise ValueError("bulk read: 'fields' must be a list of field names")
        fields = region.fields
        for n in names:
            if n not in fields:
                raise KeyError(f"bulk region {region.name!r} has no field {n!r:.100}; it has {sorted(fields)}")
        starts, lengths = req.get("starts"), req.get("lengths")
        if not (
            isinstance(starts, np.ndarray)
            and isinstance(lengths, np.ndarray)
            and starts.dtype == np.int64
            and lengths.dtype == np.int64
            and starts.shape == lengths.shape
            and starts.ndim == 1
        ):
            raise ValueError("bulk read: 'starts' and 'lengths' must be int64 arrays of one shape [R]")
        check_runs(starts, lengths, region.rows, region.name)
        total = int(lengths.sum())
        check = req.get("check", False)
        if type(check) is not bool:
            raise ValueError(f"bulk read: 'check' must be a bool, got {type(check).__name__}")
        nbytes = read_nbytes(total, sum(fields[n][0] for n in names), check)
        if nbytes + REPLY_OVERHEAD_NBYTES > self._max_reply:
            raise FrameTooLargeError(
                f"bulk read of {total} rows ({nbytes} bytes) from region {region.name!r} exceeds the owner's "
                f"max_reply_nbytes of {self._max_reply}; read fewer rows per call"
            )
        expected = req.get("expected")
        if expected is not None and not (
            isinstance(expected, np.ndarray) and expected.dtype == np.int64 and expected.shape == (total,)
        ):
            raise ValueError(f"bulk read: 'expected' must be an int64 array of {total} versions")
        entries = [fields[n] for n in names]
        if not check:
            return {
                "id": req["id"], "ok": True, "data": _gather_fields(entries, region.rows, starts, lengths, total), "valid": None
            }
        versions = region.versions
        if versions is None:
            raise ValueError(f"bulk region {region.name!r} has no version column (owner: allocate_versions)")
        rows = expand_runs(starts, lengths)
        v1 = _gather.load_versions_fence(versions, rows)
        data = _gather_fields(entries, region.rows, starts, lengths, total)
        v2 = _gather.fence_load_versions(versions, rows)
        return {"id": req["id"], "ok": True, "data": data, "valid": seqlock_mask(v1, v2, expected)}


class PeerLostErrorReply(ValueError):
    """Raised in the server for a stale generation; travels to the reader as ``PeerLostError``."""


_ERRORS["PeerLostErrorReply"] = PeerLostError


def seqlock_mask(v1: np.ndarray, v2: np.ndarray, expected: np.ndarray | None) -> np.ndarray:
    """Rows whose version was stable across the gather, not mid-write, and as expected."""
    valid = (v1 == v2) & (v1 >= 0)
    if expected is not None:
        valid &= v1 == expected
    return valid


def check_runs(starts: np.ndarray, lengths: np.ndarray, rows: int, region: str) -> None:
    """Raise ``IndexError``/``ValueError`` naming the first bad run (vectorized checks)."""
    if starts.shape[0] == 0:
        return
    bad = (lengths < 0) | (starts < 0) | (starts > rows - lengths)
    if bad.any():
        i = int(np.argmax(bad))
        if lengths[i] < 0:
            raise ValueError(f"bulk run {i} of region {region!r} has length {int(lengths[i])} < 0")
        raise IndexError(
            f"bulk run {i} of region {region!r}: rows [{int(starts[i])}, {int(starts[i]) + int(lengths[i])}) "
            f"are out of range [0, {rows})"
        )


# ---------------------------------------------------------------------------------------- client


class ZmqClient:
    """A reader's connection to one owner's server: a DEALER, its monitor, and the requests sent on it.

    Several requests may be out at once (:meth:`send` each, then :meth:`reply` for each): the
    server answers them in order, one at a time, so a reader's next request is served while it
    handles the last reply. One waiter receives at a time (a lock, taken in order) and hands each
    reply it receives to its request's waiter (a future per request), which returns at once; a
    reply to a request no one waits for any more (it timed out) is dropped. A connection that
    closes (the owner's process died, or heartbeats timed out) marks the client lost for good: the
    replies already received still reach their waiters, every other waiting and later request
    raises ``PeerLostError``, and the reader must attach a fresh descriptor.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        *,
        max_reply_nbytes: int,
        heartbeat_ivl_s: float,
        heartbeat_timeout_s: float,
        curve: CurveKeys | None = None,
        server_key: bytes | None = None,
    ) -> None:
        if server_key is not None and curve is None:  # (checked before any socket exists)
            raise ValueError(
                f"bulk owner at {address} requires CURVE: open the reader with curve=CurveKeys(...) "
                f"(the job's key pair)"
            )
        self.address = address
        self.max_reply_nbytes = max_reply_nbytes
        self.sock = ctx.socket(zmq.DEALER)
        if server_key is not None and curve is not None:  # the server speaks CURVE: encrypt, show our pair
            self.sock.curve_secretkey = curve.secret
            self.sock.curve_publickey = curve.public
            self.sock.curve_serverkey = server_key
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_reply_nbytes + REPLY_OVERHEAD_NBYTES)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout_s * 1000))
        self.mon = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self.lock = asyncio.Lock()  # held by the one waiter that receives (reply)
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # request sent -> its reply, once received
        self._mon: asyncio.Future[Any] | None = None
        self.lost: str | None = None
        self.connected = False
        self.next_id = 1
        self.users = 0  # attached regions using this client

    def _mon_future(self) -> asyncio.Future[Any]:
        """The pending wait for the next monitor event (one, kept across calls); a finished one is
        handled first and replaced."""
        fut = self._mon
        if fut is not None and fut.done():
            if not fut.cancelled() and fut.exception() is None:
                self._on_event(fut.result())
            fut = None
        if fut is None:
            fut = self._mon = self.mon.recv_multipart()
        return fut

    def close(self) -> None:
        if self._mon is not None:
            self._mon.cancel()
            self._mon = None
        if self.sock.closed:
            return
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:  # pragma: no cover
            pass
        self.mon.close(0)
        self.sock.close(0)

    def _on_event(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != 6:
            return
        event, _value = struct.unpack("=Hi", frames[0])
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED and self.lost is None:
            self.lost = "the connection closed (its process exited, or heartbeats timed out)"

    def _lost_error(self) -> PeerLostError:
        return PeerLostError(f"bulk owner at {self.address} was lost: {self.lost}")

    async def call(self, request: dict[str, Any], *, timeout_s: float, what: str) -> dict[str, Any]:
        """Send one request and return its decoded reply (errors in the reply are raised):
        :meth:`send`, then :meth:`reply`.

        Raises:
            PeerLostError: the connection closed, or no reply came within ``timeout_s``.
            (and any allow-listed error class the server answered with)
        """
        return await self.reply(self.send(request), timeout_s=timeout_s, what=what)

    def send(self, request: dict[str, Any]) -> int:
        """Send one request now (``request["id"]`` is set to a fresh id, returned); its reply is
        waited for with :meth:`reply` (or given up on with :meth:`forget`): every sent request gets
        one of the two (either forgets the id).

        Raises:
            PeerLostError: the connection closed.
        """
        self._mon_future()
        if self.lost is not None:
            raise self._lost_error()
        req_id = self.next_id
        self.next_id += 1
        request["id"] = req_id
        # (zmq.asyncio sends now when it can, else queues it after the others, in order; an error is
        # the socket's closing, which the reply's wait reports)
        self.sock.send_multipart(encode(request), copy=False).add_done_callback(mark_seen)
        self._waiting[req_id] = asyncio.get_running_loop().create_future()
        return req_id

    async def reply(self, req_id: int, *, timeout_s: float, what: str, deadline: float | None = None) -> dict[str, Any]:
        """The reply to request ``req_id`` (:meth:`send`), decoded; errors in it are raised. Whoever
        receives it (this wait, or another holding the socket) hands it over at once. ``deadline``
        (the loop's time; default ``timeout_s`` from now): when the wait gives up.

        Raises:
            ValueError: no request ``req_id`` is waiting for its reply.
            PeerLostError: the connection closed, or no reply came within ``timeout_s``.
            (and any allow-listed error class the server answered with)
        """
        fut = self._waiting.get(req_id)
        if fut is None:
            raise ValueError(f"bulk owner at {self.address}: no request {req_id!r} waits for its reply")
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + timeout_s
        try:
            while not fut.done():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise self._late(what, timeout_s)
                self._mon_future()
                if self.lost is not None and not self.lock.locked():
                    self._drain_queued()  # (replies that came before the connection closed are theirs)
                    if fut.done():
                        break
                    raise self._lost_error()
                if not self.lock.locked():  # (taken without a wait)
                    await self.lock.acquire()
                else:  # wait for the socket, or for the holder to hand this reply over
                    acq = asyncio.ensure_future(self.lock.acquire())
                    try:
                        await asyncio.wait((acq, fut), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                    except BaseException:
                        self._let_go(acq)
                        raise
                    if fut.done() or not acq.done():
                        self._let_go(acq)
                        continue
                try:
                    await self._receive_until(fut, deadline, what, timeout_s)
                finally:
                    self.lock.release()
            reply = fut.result()
        finally:
            self._waiting.pop(req_id, None)
        if reply.get("ok") is True:
            return reply
        error, message = reply.get("error"), reply.get("message")
        if reply.get("ok") is not False or type(error) is not str or type(message) is not str:
            raise MalformedFrameError(f"bulk owner at {self.address} sent a reply that is neither a result nor an "
                                      f"error (ok={reply.get('ok')!r:.40}, error={error!r:.60})")
        cls = _ERRORS.get(error, MalformedFrameError)
        raise cls(message[:300])  # (a server cuts its own at 300: a longer one is not a server's)

    def forget(self, req_id: int) -> None:
        """Give up on request ``req_id`` (:meth:`send`): its reply is dropped if it comes, and a wait
        for it (:meth:`reply`) ends now with ``PeerLostError``."""
        fut = self._waiting.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(PeerLostError(f"bulk owner at {self.address}: request {req_id} was given up on"))

    def _let_go(self, acq: asyncio.Future[Any]) -> None:
        """Give up a wait for the socket's lock: cancelled if pending, released if it was taken."""
        if not acq.done():
            acq.cancel()  # (a cancelled Lock.acquire never holds the lock, and wakes the next waiter)
        elif not acq.cancelled() and acq.exception() is None:
            self.lock.release()

    async def _receive_until(self, fut: asyncio.Future[Any], deadline: float, what: str, timeout_s: float) -> None:
        """Receive replies (handing each to its request's waiter) until ``fut`` has its own; the
        caller holds the lock."""
        loop = asyncio.get_running_loop()
        while not fut.done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._late(what, timeout_s)
            # Replies already here are taken without an event-loop round (those that came before a
            # loss are theirs; garbage fails this wait, unless the connection is gone anyway).
            self._drain_queued(quiet=self.lost is not None)
            if fut.done():
                return
            if self.lost is not None:
                raise self._lost_error()
            recv = self.sock.recv_multipart(copy=False)
            mon = self._mon_future()
            try:  # (fut: a reply given up on ends the wait)
                await asyncio.wait((recv, mon, fut), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            except BaseException:  # cancelled: a reply received meanwhile still goes to its waiter
                if recv.done() and not recv.cancelled() and recv.exception() is None:
                    self._keep(recv.result(), quiet=True)
                raise
            finally:
                if not recv.done():  # cancelled or timed out: a stale recv must not eat a later reply
                    recv.cancel()
            if mon.done():
                self._mon_future()  # handles the event, arms the next wait
            if recv.cancelled() or not recv.done():
                continue
            self._keep(recv.result())

    def _keep(self, frames: list[Any], quiet: bool = False) -> None:
        """A received reply, decoded and handed to its request's waiter; a late reply (to a request
        no one waits for any more) or a malformed one is dropped (``quiet``) or raised."""
        try:
            reply = decode(frames, max_nbytes=self.max_reply_nbytes + REPLY_OVERHEAD_NBYTES)
        except (MalformedFrameError, FrameTooLargeError) as exc:
            if quiet:
                log.warning("bulk owner at %s sent a bad reply: %s", self.address, exc)
                return
            raise MalformedFrameError(f"bulk owner at {self.address} sent a bad reply: {exc}") from None
        rid = reply.get("id") if type(reply) is dict else None
        waiter = self._waiting.get(rid) if type(rid) is int else None
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    def _drain_queued(self, quiet: bool = True) -> None:
        """The replies already received (also on a lost connection), handed to their waiters; the
        caller holds the lock, or no one does (no asyncio receive is pending). ``quiet``: as :meth:`_keep`."""
        recv = zmq.backend.Socket.recv  # (the socket's own, not the asyncio wrapper's: what is queued, now)
        for _ in range(64 * 1024):
            try:
                frames = [recv(self.sock, zmq.NOBLOCK, copy=False)]
                while self.sock.getsockopt(zmq.RCVMORE):
                    frames.append(recv(self.sock, zmq.NOBLOCK, copy=False))
            except zmq.ZMQError:  # (nothing more, or the socket is closed)
                return
            self._keep(frames, quiet=quiet)

    def _late(self, what: str, timeout_s: float) -> PeerLostError:
        return PeerLostError(f"bulk owner at {self.address} did not answer {what} within {timeout_s} s "
                             f"(it is gone or stuck)")


def mark_seen(fut: Any) -> None:
    """Mark a done future's error as retrieved, as a done callback, where its outcome is taken from
    elsewhere (a failed send shows in its reply's wait; a draw's outcome in its take): the loop then
    logs no "exception was never retrieved" when it is collected."""
    if not fut.cancelled():
        fut.exception()
