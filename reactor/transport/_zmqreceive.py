"""The receiving half of :class:`reactor.transport.Endpoint` (wire protocol: ``_zmq.py``'s notes).

An endpoint receives on one ROUTER, or two (``local_bind``): each wakes the loop through
``add_reader`` and every wake-up drains it into one queue, checking each message (size, credit,
codec, the application's ``accept``) on the way in. Senders are known per ROUTER, by the hello they
sent through it; their welcome, credit grants and sweep probes go back through the same socket.
:meth:`_Receiving.recv_batch` hands messages to the application and returns their credit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from reactor._errors import FrameTooLargeError, MalformedFrameError, PortClosedError
from reactor._floodlog import FloodCounts, flood_logged, flood_tally

from .codec import BATCH_MARKER, batch_header, decode, decode_batch, frames_nbytes

log = logging.getLogger("reactor.transport")

PROTOCOL_VERSION = 3  # 2: batches of frame-less messages; 3: a hello names its endpoint's token and connection
_HELLO, _WELCOME, _CREDIT = 1, 2, 3
_CONTROL_MAX_NBYTES = 4096
#: A hello's endpoint token: random bytes drawn once per endpoint, so that the connections of one endpoint
#: (a link, the tries of a reconnect) are told from another endpoint's under the same name.
TOKEN_NBYTES = 8
_SEQ_MAX = 2**63 - 1
# A hello under a name whose connection its own endpoint has left (same token, a lower number: a lingering
# disconnect's) or takes no message now (the probe finds the queue to it full: a live peer that reads
# nothing) is held and looked at again every _HELD_HELLO_RECHECK_S, for at most _HELD_HELLO_MAX_S, then
# refused. (A closed connection is not held for: zmq says it has gone as soon as it has taken in the close,
# its last messages read or not; _probe.)
_HELD_HELLO_RECHECK_S = 0.02
_HELD_HELLO_MAX_S = 2.0
_HELD_HELLOS_MAX = 1024
_PROBE_FRESH_S = 0.05  # a connection found live this recently is taken as live without another probe
# What a probe of a sender's connection finds (_probe).
_LIVE, _FULL, _GONE = 0, 1, 2
_POLLIN = int(zmq.POLLIN)  # a plain int: `events & zmq.POLLIN` goes through enum.Flag, ~0.5 us a test
_DRAIN_BUDGET = 4096  # messages per wake-up before yielding to the loop (a flood must not starve it)
_MAX_REASON_CHARS = 500  # of a dropped message's reason in the log (it may quote what the peer sent)
# Senders that said hello and went away: the table is swept (each sender probed through the
# ROUTER, which refuses to route to a closed connection) once it has doubled since the last sweep,
# so it stays within twice the live connections at O(1) amortized cost per hello.
_SENDER_SWEEP_MIN = 64


class _Router:
    """One ROUTER an endpoint receives on, and the senders that said hello through it."""

    __slots__ = ("address", "drain_scheduled", "fd", "gone", "senders", "sock", "sweep_at", "welcomes")

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self.sock = sock
        self.fd: int = sock.FD
        self.address: str = sock.get(zmq.LAST_ENDPOINT).decode()
        self.senders: dict[bytes, _Sender] = {}
        # The senders the last sweep forgot: zmq says a connection has gone with its last messages still
        # unread or not (_probe), and those come out under its name.
        self.gone: dict[bytes, _Sender] = {}
        self.drain_scheduled = False
        self.sweep_at = _SENDER_SWEEP_MIN
        # Senders that took the name of a closed connection whose messages came in here: welcomed once a
        # drain has found this socket empty, so that what they send comes after all of those (_hello).
        self.welcomes: list[_Sender] = []


class _Sender:
    """What a ROUTER knows of one peer sending to it: one connection (zmq's routing id for it)."""

    __slots__ = ("ident", "live_at", "name", "queued_msgs", "queued_nbytes", "router", "seq", "token",
                 "ungranted_msgs", "ungranted_nbytes")

    def __init__(self, ident: bytes, name: str, router: _Router, token: bytes, seq: int) -> None:
        self.ident = ident
        self.name = name
        self.router = router  # the ROUTER it said hello through: its credit and probes go back there
        self.token = token  # its endpoint's, and the connection's number there (the hello's)
        self.seq = seq
        self.live_at = -1.0  # when a probe last found its connection live (a flood of hellos probes it once)
        self.queued_msgs = 0
        self.queued_nbytes = 0
        self.ungranted_msgs = 0
        self.ungranted_nbytes = 0


def _wake(fut: asyncio.Future[Any] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def hello_message(name: str, token: bytes, seq: int) -> bytes:
    """A connection's first message's control frame: ``HELLO(proto, name, token, seq)``."""
    return msgpack.packb([_HELLO, PROTOCOL_VERSION, name, token, seq])


def _hello_fields(msg: list[Any] | None) -> tuple[str, bytes, int] | None:
    """``(name, token, seq)`` of a well-formed hello, else None."""
    if (msg is None or msg[0] != _HELLO or len(msg) != 5 or msg[1] != PROTOCOL_VERSION
            or type(msg[2]) is not str or type(msg[3]) is not bytes or len(msg[3]) != TOKEN_NBYTES
            or type(msg[4]) is not int or not 0 <= msg[4] <= _SEQ_MAX):
        return None
    name_b = msg[2].encode()  # (msgpack decoded it as strict UTF-8)
    if not 0 < len(name_b) <= 255 or name_b[0] == 0:
        return None
    return msg[2], msg[3], msg[4]


def _parse_control(frames: list[bytes] | None) -> list[Any] | None:
    if frames is None or len(frames) != 2 or frames[0] != b"" or len(frames[1]) > _CONTROL_MAX_NBYTES:
        return None
    try:
        msg = msgpack.unpackb(frames[1], raw=False)
    except Exception:
        return None
    if type(msg) is not list or not msg or type(msg[0]) is not int:
        return None
    return msg


class _Receiving:
    """The receive side of an endpoint: its ROUTERs, the queue, credit grants and hellos. The state
    is the endpoint's (set up in ``Endpoint.open``)."""

    _accept: Callable[[str, Any], str | None] | None
    _by_name: dict[str, _Sender]
    _closed: bool
    _grant_msgs: int
    _grant_nbytes: int
    _held: dict[str, tuple[_Sender, float]]
    _held_timer: asyncio.TimerHandle | None
    _loop: asyncio.AbstractEventLoop
    _max_nbytes: int
    _max_queued: int
    _max_queued_nbytes: int
    _n: dict[str, int]
    _name: str
    _qmeta: deque[tuple[_Sender, int]]
    _queue: deque[tuple[str, Any]]
    _queued_nbytes: int
    _queued_senders: set[_Sender]
    _recv_waiter: asyncio.Future[None] | None
    _refusals_logged: FloodCounts
    _drops_logged: FloodCounts
    _routers: list[_Router]
    _window: int
    _window_nbytes: int

    def _check_open(self) -> None:
        if self._closed:
            raise PortClosedError(f"Endpoint {self._name!r} is closed")

    async def recv_batch(self, *, max_n: int = 1024, timeout_s: float | None = None) -> list[tuple[str, Any]]:
        """Return every message ready now (up to ``max_n``), waiting for at least one.

        Messages from one sender come in the order it sent them. Taking messages here is what
        returns credit to their senders.

        Args:
            max_n: the most messages to return.
            timeout_s: how long to wait when none is ready; ``0`` polls.

        Returns:
            ``[(sender name, message), ...]``; empty only when ``timeout_s`` passed.

        Raises:
            PortClosedError: the endpoint is (or gets) closed.
            RuntimeError: another task is already waiting in ``recv_batch``.
            ValueError: ``max_n < 1``.
        """
        if not self._queue:
            self._check_open()
            for r in self._routers:
                if r.sock.get(zmq.EVENTS) & _POLLIN:
                    self._drain_router(r)
            if not self._queue:
                if timeout_s is not None and timeout_s <= 0:
                    return []
                if self._recv_waiter is not None:
                    raise RuntimeError("another task is already waiting in recv_batch on this endpoint")
                self._recv_waiter = fut = self._loop.create_future()
                timer = None if timeout_s is None else self._loop.call_later(timeout_s, _wake, fut)
                try:
                    await fut
                finally:
                    self._recv_waiter = None
                    if timer is not None:
                        timer.cancel()
                self._check_open()
                if not self._queue:
                    return []
        if max_n < 1:
            raise ValueError(f"recv_batch: max_n must be >= 1, got {max_n!r}")
        return self._take(max_n)

    def _take(self, max_n: int) -> list[tuple[str, Any]]:
        queue, meta = self._queue, self._qmeta
        grant = self._maybe_grant
        if len(queue) <= max_n:
            out = list(queue)
            queue.clear()
            meta.clear()
            self._queued_nbytes = 0
            senders = self._queued_senders
            self._queued_senders = set()
            for s in senders:
                s.ungranted_msgs += s.queued_msgs
                s.ungranted_nbytes += s.queued_nbytes
                s.queued_msgs = s.queued_nbytes = 0
                grant(s)
        else:
            out = [queue.popleft() for _ in range(max_n)]
            touched = set()
            taken = 0
            for _ in range(max_n):
                s, nb = meta.popleft()
                s.queued_msgs -= 1
                s.queued_nbytes -= nb
                s.ungranted_msgs += 1
                s.ungranted_nbytes += nb
                taken += nb
                touched.add(s)
            self._queued_nbytes -= taken
            for s in touched:
                if s.queued_msgs == 0:
                    self._queued_senders.discard(s)
                grant(s)
        self._n["messages_delivered"] += len(out)
        for r in self._routers:
            self._rearm(r)  # (the grants above were sent on them)
        return out

    def _rearm(self, router: _Router) -> None:
        """Drain ``router`` on the next tick if it holds messages. To call after sending on it outside
        its own drain: a send processes the socket's pending commands, which consumes the FD's edge,
        so messages that arrived just before would otherwise wait, unseen by ``add_reader``, until
        some later command (there may be none: a peer waiting on our answer sends nothing more)."""
        if router.sock.get(zmq.EVENTS) & _POLLIN and not router.drain_scheduled:
            router.drain_scheduled = True
            self._loop.call_soon(self._drain_router, router)

    def _maybe_grant(self, s: _Sender) -> None:
        if s.ungranted_msgs < self._grant_msgs and s.ungranted_nbytes < self._grant_nbytes:
            return
        if s.router.senders.get(s.ident) is not s:  # that sender reconnected since: its credit was reset
            s.ungranted_msgs = s.ungranted_nbytes = 0
            return
        try:
            s.router.sock.send_multipart(
                [s.ident, b"", msgpack.packb([_CREDIT, s.ungranted_msgs, s.ungranted_nbytes])], zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:  # gone (EHOSTUNREACH) or flooded: it will not miss this credit
            log.info("endpoint %r: could not return credit to %r: %s", self._name, s.name, exc)
        s.ungranted_msgs = s.ungranted_nbytes = 0
        self._n["credit_grants_sent"] += 1

    def _drain_router(self, router: _Router) -> None:
        """Read every ready message from ``router`` into the queue (the add_reader callback)."""
        router.drain_scheduled = False
        if self._closed:
            return
        sock = router.sock
        queue, meta = self._queue, self._qmeta
        senders = router.senders
        queued_senders = self._queued_senders
        max_nbytes = self._max_nbytes
        window = self._window
        window_nbytes = self._window_nbytes + max_nbytes
        n = self._n
        before = len(queue)
        added_nbytes = 0
        budget = _DRAIN_BUDGET
        while budget:
            try:
                ident = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            budget -= 1
            if not sock.get(zmq.RCVMORE):
                continue
            head = sock.recv()
            rest = sock.recv_multipart(copy=False) if sock.get(zmq.RCVMORE) else None
            sender = senders.get(ident)
            if not head:
                self._on_control(router, ident, rest)
                continue
            if sender is None and (sender := router.gone.get(ident)) is None:
                n["dropped_unknown_peer"] += 1
                self._drop_warning("unknown", "endpoint %r: dropped a message from %r, which did not say hello first",
                                   self._name, ident[:64])
                continue
            if rest is None:
                if head[0] == BATCH_MARKER:
                    added_nbytes += self._on_batch(sender, head)
                    continue
                frames: list[Any] = [head]
                nbytes = len(head)
            else:
                frames = [head, *rest]
                nbytes = frames_nbytes(frames)
            if (
                sender.queued_msgs + sender.ungranted_msgs >= window
                or sender.queued_nbytes + sender.ungranted_nbytes >= window_nbytes
            ):
                n["dropped_over_credit"] += 1
                self._drop_warning("credit", "endpoint %r: dropped a message from %r, which sent beyond its credit",
                                   self._name, sender.name)
                continue
            try:
                obj = decode(frames, max_nbytes=max_nbytes)
            except (MalformedFrameError, FrameTooLargeError) as exc:
                n["dropped_too_large" if isinstance(exc, FrameTooLargeError) else "dropped_malformed"] += 1
                self._drop_warning("malformed", "endpoint %r: dropped a message from peer %r: %s", self._name,
                                   sender.name, exc)
                sender.ungranted_msgs += 1  # consumed, as far as credit goes
                sender.ungranted_nbytes += nbytes
                self._maybe_grant(sender)
                continue
            if self._accept is not None and not self._accepted(sender.name, obj):
                sender.ungranted_msgs += 1  # consumed, as far as credit goes
                sender.ungranted_nbytes += nbytes
                self._maybe_grant(sender)
                continue
            queue.append((sender.name, obj))
            meta.append((sender, nbytes))
            sender.queued_msgs += 1
            sender.queued_nbytes += nbytes
            queued_senders.add(sender)
            added_nbytes += nbytes
        added = len(queue) - before
        if added:
            n["messages_received"] += added
            n["bytes_received"] += added_nbytes
            self._queued_nbytes += added_nbytes
            if len(queue) > self._max_queued:
                self._max_queued = len(queue)
            if self._queued_nbytes > self._max_queued_nbytes:
                self._max_queued_nbytes = self._queued_nbytes
            _wake(self._recv_waiter)
        if budget and router.welcomes:  # empty now: every message of the closed connections is in the queue
            welcomes, router.welcomes = router.welcomes, []
            for s in welcomes:
                if s.router.senders.get(s.ident) is s:
                    self._welcome(s)
            for r in {s.router for s in welcomes}:
                self._rearm(r)  # (the welcomes were sends after that socket's drain)
        if not budget and not router.drain_scheduled:
            router.drain_scheduled = True
            self._loop.call_soon(self._drain_router, router)

    def _on_batch(self, sender: _Sender, frame: bytes) -> int:
        """Queue the messages of a batch from ``sender`` (or drop it all, logged); return their bytes."""
        n = self._n
        try:
            count, offset = batch_header(frame)
        except MalformedFrameError as exc:
            n["dropped_malformed"] += 1
            self._drop_warning("malformed", "endpoint %r: dropped a batch from peer %r: %s", self._name, sender.name, exc)
            return 0  # its credit cannot be returned: its size in messages is unknown
        nbytes = len(frame) - offset  # the messages' own bytes: what the sender spent
        if (
            sender.queued_msgs + sender.ungranted_msgs + count > self._window
            or sender.queued_nbytes + sender.ungranted_nbytes + nbytes >= self._window_nbytes + self._max_nbytes
        ):
            n["dropped_over_credit"] += count
            self._drop_warning("credit", "endpoint %r: dropped a batch of %d messages from %r, which sent beyond its "
                               "credit", self._name, count, sender.name)
            return 0
        refused: list[str] = []
        try:
            objs = decode_batch(frame, max_nbytes=self._max_nbytes, refused=refused)
        except (MalformedFrameError, FrameTooLargeError) as exc:
            n["dropped_too_large" if isinstance(exc, FrameTooLargeError) else "dropped_malformed"] += count
            self._drop_warning("malformed", "endpoint %r: dropped a batch of %d messages from peer %r: %s", self._name,
                               count, sender.name, exc)
            sender.ungranted_msgs += count  # consumed, as far as credit goes
            sender.ungranted_nbytes += nbytes
            self._maybe_grant(sender)
            return 0
        name = sender.name
        if refused:  # bad messages of a good batch: left out alone, their credit back as consumed
            n["dropped_malformed"] += len(refused)
            self._drop_warning("malformed", "endpoint %r: dropped %d of a batch of %d messages from peer %r: %s",
                               self._name, len(refused), count, name,
                               "; ".join(refused[:3]) + ("; ..." if len(refused) > 3 else ""))
            refused_nbytes = nbytes * len(refused) // count
            sender.ungranted_msgs += len(refused)
            sender.ungranted_nbytes += refused_nbytes
            self._maybe_grant(sender)
            count, nbytes = len(objs), nbytes - refused_nbytes
            if not count:
                return 0
        if self._accept is not None:
            kept = [obj for obj in objs if self._accepted(name, obj)]
            if len(kept) < count:
                n_refused = count - len(kept)  # their credit goes back as consumed; equal shares of the bytes
                refused_nbytes = nbytes * n_refused // count
                sender.ungranted_msgs += n_refused
                sender.ungranted_nbytes += refused_nbytes
                self._maybe_grant(sender)
                objs, count, nbytes = kept, len(kept), nbytes - refused_nbytes
                if not count:
                    return 0
        self._queue.extend([(name, obj) for obj in objs])
        # Credit is per message; a batch does not say how its bytes split among its messages, so each
        # gets an equal share (the last the remainder): once the batch is taken, exactly its bytes
        # have been returned.
        share = nbytes // count
        meta = self._qmeta
        meta.extend([(sender, share)] * (count - 1))
        meta.append((sender, nbytes - share * (count - 1)))
        sender.queued_msgs += count
        sender.queued_nbytes += nbytes
        self._queued_senders.add(sender)
        n["batches_received"] += 1
        return nbytes

    def _accepted(self, sender: str, obj: Any) -> bool:
        """Run the application protocol's check on one decoded message; count and log a refusal."""
        try:
            reason = self._accept(sender, obj)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001 - a checker's bug must not take the endpoint down
            reason = f"the protocol check raised {type(exc).__name__}: {exc}"
        if reason is None:
            return True
        self._n["dropped_invalid"] += 1
        seen = self._refusals_logged.hit(sender)
        if flood_logged(seen):
            log.warning("endpoint %r: refused a message from peer %r: %s%s", self._name, sender,
                        str(reason)[:500], flood_tally(seen))
        return False

    def _drop_warning(self, kind: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Log a dropped message or frame under :func:`~reactor._floodlog.flood_logged`'s rule, per kind
        (unknown sender, over credit, malformed, bad control message, a refused or an earlier hello): a
        flood from a peer, or from a stranger, is not a flood of lines; the counters count all."""
        seen = self._drops_logged.hit(kind)
        if flood_logged(seen):  # (a reason quoting what a peer sent is cut: one line, not megabytes)
            args = tuple(str(a)[:_MAX_REASON_CHARS] if isinstance(a, (str, BaseException)) else a for a in args)
            log.log(level, message + "%s", *args, flood_tally(seen))

    def _sweep_senders(self, router: _Router) -> None:
        """Forget ``router``'s senders whose connection has gone: a ROUTER with ``ROUTER_MANDATORY`` refuses at
        once (``EHOSTUNREACH``) to route to an identity with no live connection, so each idle sender
        is sent an empty credit grant (``CREDIT(0, 0)``, a no-op for a live peer). A sender with
        messages still queued here is kept until they are taken; one forgotten is known until the next
        sweep (``_Router.gone``), for its messages still unread in zmq's queue."""
        senders = router.senders
        gone = [s for s in senders.values() if not s.queued_msgs and self._probe(s) == _GONE]
        for s in gone:  # (their flood counts stay: a sender back under its name counts on, _floodlog)
            self._forget_sender(s)
        router.gone = {s.ident: s for s in gone}
        self._n["senders_forgotten"] += len(gone)
        if gone:
            log.info("endpoint %r: forgot %d senders whose connections had closed", self._name, len(gone))
        router.sweep_at = max(_SENDER_SWEEP_MIN, 2 * len(senders))

    def _forget_sender(self, s: _Sender) -> None:
        if s.router.senders.get(s.ident) is s:
            del s.router.senders[s.ident]
        if self._by_name.get(s.name) is s:
            del self._by_name[s.name]

    @staticmethod
    def _probe(s: _Sender) -> int:
        """Whether ``s``'s connection is live, full or gone: an empty credit grant (a no-op for a live
        peer) is taken on a live connection, and refused at once (``ROUTER_MANDATORY``): with
        ``EHOSTUNREACH`` once zmq has taken in the connection's close (libzmq 4.3: even with its last
        messages still unread here), with ``EAGAIN`` when the queue to a live peer is full (it reads
        nothing)."""
        try:
            s.router.sock.send_multipart([s.ident, b"", msgpack.packb([_CREDIT, 0, 0])], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            return _GONE if exc.errno == zmq.EHOSTUNREACH else _FULL
        return _LIVE

    def _on_control(self, router: _Router, ident: bytes, rest: list[Any] | None) -> None:
        fields = _hello_fields(_parse_control([b"", rest[0].bytes] if rest is not None and len(rest) == 1 else None))
        if fields is None or ident in router.senders:  # (one hello per connection)
            self._n["dropped_malformed"] += 1
            self._drop_warning("control", "endpoint %r: dropped a malformed control message from %r", self._name,
                               ident[:64])
            return
        self._hello(_Sender(ident, fields[0], router, fields[1], fields[2]), time.monotonic())

    def _hello(self, new: _Sender, since: float) -> None:
        """Welcome ``new`` (a connection that said hello), unless its name is live at another connection.

        A name is live at most once, across the endpoint's sockets: zmq names each connection itself, and
        a hello under a name another connection holds is refused (no handover: no one takes over a live
        peer's messages and credit) while that connection lives, and welcomed once it has gone (a killed
        process's, a timed-out try's, a disconnected link's: its sender stays known until swept, for the
        messages it sent that are still unread). One whose queue is full (a live peer that reads nothing),
        or one the same endpoint has left (same token, lower number: a lingering ``disconnect``'s), is
        waited for, a little; while a hello waits, the name is promised to it (another endpoint's hello is
        refused; the same endpoint's newer try takes its place). A hello from an older connection of the
        endpoint that holds the name (a try that timed out, delivered late) is dropped.
        """
        name = new.name
        took_from: _Router | None = None
        held = self._held.get(name)
        if held is not None and held[0] is not new:
            if held[0].token == new.token and held[0].seq > new.seq:
                self._dropped_earlier(name)
                return
            if held[0].token != new.token or held[0].seq == new.seq:  # the name is promised to the held one
                self._refuse(new, held[0].router)
                return
            del self._held[name]  # that endpoint's newer try: it is looked at instead
            self._refuse(held[0], held[0].router)
        holder = self._by_name.get(name)
        if holder is not None:
            if holder.token == new.token and holder.seq > new.seq:
                self._dropped_earlier(name)
                return
            # (an endpoint's newer connection: it has closed the older one, whose last messages may be on the way)
            superseded = holder.token == new.token and holder.seq < new.seq
            now = time.monotonic()
            if now - holder.live_at < _PROBE_FRESH_S:
                state = _LIVE
            else:
                holder.router.sock.get(zmq.EVENTS)  # (zmq takes in the connections' news: closes, acknowledgements)
                state = self._probe(holder)
                if state == _LIVE:
                    holder.live_at = now
                for r in self._routers:
                    self._rearm(r)  # (the probe and the look were sends and reads outside that socket's drain)
            if state == _GONE:
                # Only the name moves: the closed connection's sender stays in its socket's table until
                # swept, as zmq reports a connection gone with its last messages still unread (a
                # disconnect's lingering ones, a killed process's): they come out under its name, before
                # anything the new connection sends, which waits for its welcome, and that waits until a
                # drain of the closed connection's socket has found it empty (zmq took in the close after
                # its last message, so all of them are in by then).
                del self._by_name[name]
                took_from = holder.router
            elif ((state == _LIVE and not superseded) or now - since >= _HELD_HELLO_MAX_S
                  or len(self._held) >= _HELD_HELLOS_MAX):
                self._refuse(new, holder.router)
                return
            else:
                self._held[name] = (new, since)
                if self._held_timer is None:
                    self._held_timer = self._loop.call_later(_HELD_HELLO_RECHECK_S, self._recheck_held)
                return
        router = new.router
        if new.ident in router.senders:  # it said hello again while this one waited, and was welcomed
            self._n["dropped_malformed"] += 1
            return
        # (Re)start this sender's credit: a hello means a new connection, so nothing is in flight.
        router.senders[new.ident] = new
        self._by_name[name] = new
        if len(router.senders) >= router.sweep_at:
            self._sweep_senders(router)
        if took_from is not None:
            took_from.welcomes.append(new)
            if not took_from.drain_scheduled:
                took_from.drain_scheduled = True
                self._loop.call_soon(self._drain_router, took_from)
            return
        self._welcome(new)

    def _welcome(self, new: _Sender) -> None:
        """Send ``new`` its welcome (its window and this endpoint's limits); forget it if it has gone."""
        router = new.router
        try:
            router.sock.send_multipart(
                [
                    new.ident,
                    b"",
                    msgpack.packb(
                        [_WELCOME, PROTOCOL_VERSION, self._name, self._window, self._window_nbytes, self._max_nbytes]
                    ),
                ],
                zmq.NOBLOCK,
            )
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # it has gone since its hello: it holds no name
                self._forget_sender(new)
            log.info("endpoint %r: could not welcome %r: %s", self._name, new.name, exc)

    def _dropped_earlier(self, name: str) -> None:
        self._drop_warning("earlier hello", "endpoint %r: dropped an earlier connection's hello from %r", self._name,
                           name[:100], level=logging.INFO)

    def _refuse(self, new: _Sender, holder_router: _Router) -> None:
        self._n["hellos_refused"] += 1
        self._drop_warning("hello", "endpoint %r: refused a hello from %r at %s: a peer of that name is connected at "
                           "%s", self._name, new.name[:100], new.router.address, holder_router.address)

    def _recheck_held(self) -> None:
        """Look again at the held hellos (the timer's callback)."""
        self._held_timer = None
        if self._closed:
            return
        for new, since in list(self._held.values()):
            if self._held.get(new.name, (None,))[0] is new:
                del self._held[new.name]
                self._hello(new, since)
        if self._held and self._held_timer is None:
            self._held_timer = self._loop.call_later(_HELD_HELLO_RECHECK_S, self._recheck_held)
