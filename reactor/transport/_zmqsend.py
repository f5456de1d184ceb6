"""The sending half of :class:`reactor.transport.Endpoint` (wire protocol: ``_zmq.py``'s notes).

An endpoint sends through one DEALER per peer (a :class:`_Link`), spending the credit the peer's
ROUTER grants: the first message to a peer in a loop tick goes to zmq at once, small frame-less ones
after it are held and go as one batch at the end of the tick. The link's control messages (welcome,
credit) and its monitor's events (a lost peer, a failed handshake) are read here too.
:meth:`_Sending.send` and :meth:`_Sending.send_nowait` are the application's.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import struct
from collections.abc import Callable
from typing import Any

import zmq

from reactor._errors import FrameTooLargeError, LinkStateError, PeerLostError, WouldBlock

from ._curve import _is_local
from ._zmqreceive import _CREDIT, _POLLIN, _WELCOME, PROTOCOL_VERSION, _parse_control, _wake
from .codec import encode, encode_batch, frames_nbytes

log = logging.getLogger("reactor.transport")

# Coalescing (see _zmq.py's notes). Only small messages are worth batching: above a few KiB the
# per-message cost is the bytes, and joining them into a batch would copy them once more.
_BATCH_ITEM_MAX_NBYTES = 16 * 1024
_BATCH_MAX_NBYTES = 256 * 1024
_BATCH_HEADER_MAX_NBYTES = 6  # marker + msgpack array 32 header
_FLUSH_RETRY_S = 0.001  # a batch that found zmq's queue full (all but impossible) is retried after this
_VANISHED_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNREFUSED, errno.ENOENT, errno.ECONNABORTED})


class _Link:
    """One outgoing connection: a DEALER to a peer's ROUTER, its monitor, and the credit it holds."""

    __slots__ = (
        "address",
        "batch",
        "batch_limit",
        "batch_nbytes",
        "credit_msgs",
        "curve",
        "credit_nbytes",
        "fd",
        "flush_handle",
        "lost_reason",
        "max_message_nbytes",
        "mon",
        "mon_fd",
        "name",
        "sock",
        "waiters",
        "welcomed",
    )

    def __init__(self, name: str, address: str, sock: zmq.Socket[Any], mon: zmq.Socket[Any], welcomed: Any) -> None:
        self.name = name
        self.address = address
        self.sock = sock
        self.mon = mon
        self.fd: int = sock.FD
        self.mon_fd: int = mon.FD
        self.credit_msgs = 0
        self.credit_nbytes = 0
        self.max_message_nbytes = 0
        self.lost_reason: str | None = None
        self.curve = False  # the link is CURVE-encrypted (server_public_key given)
        self.waiters: list[asyncio.Future[None]] = []
        self.welcomed: asyncio.Future[None] = welcomed
        # Coalescing: frame 0 of the messages held for this tick's batch, their size, the most a
        # batch may hold, and the pending end-of-tick flush (set once a message went out this tick).
        self.batch: list[bytes] = []
        self.batch_nbytes = 0
        self.batch_limit = 0
        self.flush_handle: asyncio.Handle | None = None


class _Sending:
    """The send side of an endpoint: its links, their credit and batches. The state is the
    endpoint's (set up in ``Endpoint.open`` and ``Endpoint.connect``)."""

    _curve_local: bool
    _links: dict[str, _Link]
    _loop: asyncio.AbstractEventLoop
    _lost: dict[str, str]
    _n: dict[str, int]
    _name: str
    _check_open: Callable[[], None]
    _lose: Callable[[_Link, str], None]

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            self._check_open()
            if peer in self._lost:
                raise PeerLostError(f"peer {peer!r} was lost: {self._lost[peer]}")
            raise LinkStateError(
                f"Endpoint {self._name!r} is not connected to peer {peer!r}; call connect({peer!r}, address) first"
            )
        return link

    def send_nowait(self, peer: str, obj: Any) -> None:
        """Send ``obj`` to ``peer`` now, or raise ``WouldBlock`` if that link has no credit.

        The message is queued in zmq and written by its I/O thread; arrays are sent zero-copy
        (see :func:`~reactor.transport.codec.encode`: do not modify them afterwards). The first
        message to ``peer`` in a loop tick goes to zmq at once; small frame-less messages sent to
        it later in the same tick are held and go as one batch when the loop next runs its
        callbacks, that is when the sending task awaits: a task that sends and then computes
        without awaiting holds them that long. Their credit is spent at once either way.

        Raises:
            LinkStateError: not connected to ``peer`` (a ``ValueError``).
            PeerLostError: ``peer`` was lost.
            PortClosedError: this endpoint is closed.
            WouldBlock: the link has no credit: the peer has not consumed enough yet.
            FrameTooLargeError: the encoded message exceeds the peer's ``max_message_nbytes``.
            TypeError: ``obj`` holds something the codec does not carry.
        """
        link = self._links.get(peer)
        if link is None:
            link = self._link(peer)  # raises the right error
        if link.credit_msgs <= 0 or link.credit_nbytes <= 0:
            self._drain_link(link)  # a grant may be waiting unread
            if link.lost_reason is not None:
                raise PeerLostError(f"peer {peer!r} was lost: {link.lost_reason}")
            if link.credit_msgs <= 0 or link.credit_nbytes <= 0:
                self._n["credit_stalls"] += 1
                raise WouldBlock(
                    f"no credit to send to peer {peer!r}: it has not yet consumed the messages already sent; "
                    f"await send() to wait for credit"
                )
        self._send_frames(link, encode(obj))

    async def send(self, peer: str, obj: Any, *, timeout_s: float | None = None) -> None:
        """Send ``obj`` to ``peer``, waiting for credit if the link has none.

        Cancelling the wait sends nothing. Messages sent by one task arrive in order.

        Raises:
            TimeoutError: no credit arrived within ``timeout_s``.
            ValueError, PeerLostError, PortClosedError, FrameTooLargeError, TypeError: as
                :meth:`send_nowait`.
        """
        link = self._links.get(peer)
        if link is None:
            link = self._link(peer)  # raises the right error
        if link.credit_msgs <= 0 or link.credit_nbytes <= 0:
            await self._wait_credit(link, timeout_s)
        self._send_frames(link, encode(obj))

    async def _wait_credit(self, link: _Link, timeout_s: float | None) -> None:
        self._drain_link(link)
        if link.credit_msgs > 0 and link.credit_nbytes > 0:
            return
        self._n["credit_stalls"] += 1
        deadline = None if timeout_s is None else self._loop.time() + timeout_s
        while link.credit_msgs <= 0 or link.credit_nbytes <= 0:
            if link.lost_reason is not None:
                raise PeerLostError(f"peer {link.name!r} was lost: {link.lost_reason}")
            self._check_open()
            fut: asyncio.Future[None] = self._loop.create_future()
            link.waiters.append(fut)
            try:
                if deadline is None:
                    await fut
                else:
                    remaining = deadline - self._loop.time()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"no credit from peer {link.name!r} within {timeout_s} s: it is not consuming"
                        )
                    await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                raise TimeoutError(
                    f"no credit from peer {link.name!r} within {timeout_s} s: it is not consuming"
                ) from None
            finally:
                if fut in link.waiters:
                    link.waiters.remove(fut)
        if link.lost_reason is not None:
            raise PeerLostError(f"peer {link.name!r} was lost: {link.lost_reason}")

    def _send_frames(self, link: _Link, frames: list[Any]) -> None:
        """Send one encoded message now, or hold it for this tick's batch; spend its credit."""
        single = len(frames) == 1
        nbytes = len(frames[0]) if single else frames_nbytes(frames)
        if nbytes > link.max_message_nbytes:
            raise FrameTooLargeError(
                f"message of {nbytes} bytes exceeds peer {link.name!r}'s limit of "
                f"{link.max_message_nbytes} bytes (its max_message_nbytes)"
            )
        if single and link.flush_handle is not None and nbytes <= _BATCH_ITEM_MAX_NBYTES:
            # Not the first message to this peer this tick: hold it for the end-of-tick batch.
            if link.batch_nbytes + nbytes > link.batch_limit and link.batch:
                self._flush(link)  # full: send what is held now, start a new batch
            link.batch.append(frames[0])
            link.batch_nbytes += nbytes
        else:
            if link.batch:
                self._flush(link)  # order: what is held goes first
            try:
                if single:
                    link.sock.send(frames[0], zmq.NOBLOCK)
                else:
                    link.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # the zmq queue is full; credit makes this all but impossible
                self._n["credit_stalls"] += 1
                raise WouldBlock(f"zmq send queue to peer {link.name!r} is full") from None
            if link.waiters:
                self._recheck_link(link)
            if link.flush_handle is None:
                link.flush_handle = self._loop.call_soon(self._flush_soon, link)
        link.credit_msgs -= 1
        link.credit_nbytes -= nbytes
        n = self._n
        n["messages_sent"] += 1
        n["bytes_sent"] += nbytes

    def _flush(self, link: _Link) -> None:
        """Send the messages held on ``link`` as one zmq message (a lone one as itself).

        Raises:
            WouldBlock: zmq's queue to the peer is full; the messages stay held.
        """
        batch = link.batch
        try:
            link.sock.send(batch[0] if len(batch) == 1 else encode_batch(batch), zmq.NOBLOCK)
        except zmq.Again:
            self._n["credit_stalls"] += 1
            raise WouldBlock(f"zmq send queue to peer {link.name!r} is full") from None
        if len(batch) > 1:
            self._n["batches_sent"] += 1
        link.batch = []
        link.batch_nbytes = 0
        if link.waiters:  # typically: the sender ran out of credit, and this is the end-of-tick flush
            self._recheck_link(link)

    def _recheck_link(self, link: _Link) -> None:
        """Read a grant that came in while we sent on ``link``'s socket.

        zmq's FD is edge-triggered and a send may consume its edge (zmq_getsockopt(3), ZMQ_FD), so a
        grant that arrived meanwhile would not wake the loop, nor the tasks waiting for it.
        """
        if link.sock.get(zmq.EVENTS) & _POLLIN:
            self._drain_link(link)

    def _flush_soon(self, link: _Link) -> None:
        """End of the tick for ``link`` (a ``call_soon`` callback): send what it holds."""
        link.flush_handle = None
        if not link.batch or link.sock.closed:
            return
        try:
            self._flush(link)
        except WouldBlock:  # keep holding (order) and try again shortly
            link.flush_handle = self._loop.call_later(_FLUSH_RETRY_S, self._flush_soon, link)

    def _drain_link(self, link: _Link) -> None:
        """Read the control messages a peer's ROUTER sent back on ``link`` (welcome, credit)."""
        sock = link.sock
        woke = False
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError:  # closed under us
                return
            msg = _parse_control(frames)
            if msg is None:
                log.warning("endpoint %r: dropped a malformed control message from peer %r", self._name, link.name)
                self._n["dropped_malformed"] += 1
                continue
            kind = msg[0]
            if kind == _CREDIT and len(msg) == 3 and _nonneg_ints(msg[1:]):
                link.credit_msgs += msg[1]
                link.credit_nbytes += msg[2]
                woke = True
            elif kind == _WELCOME and len(msg) == 6 and msg[1] == PROTOCOL_VERSION and _nonneg_ints(msg[3:]):
                if link.welcomed.done():
                    continue
                if msg[2] != link.name:
                    link.welcomed.set_exception(
                        ValueError(
                            f"connect({link.name!r}): the endpoint at {link.address} is {msg[2]!r:.100}, "
                            f"not {link.name!r}"
                        )
                    )
                    continue
                link.credit_msgs, link.credit_nbytes, link.max_message_nbytes = msg[3], msg[4], msg[5]
                link.batch_limit = min(msg[5], _BATCH_MAX_NBYTES) - _BATCH_HEADER_MAX_NBYTES
                link.welcomed.set_result(None)
                woke = True
            else:
                log.warning("endpoint %r: dropped an unexpected control message %.200r from peer %r", self._name, msg,
                            link.name)
                self._n["dropped_malformed"] += 1
        if woke and link.waiters:
            for w in link.waiters:
                _wake(w)

    def _drain_monitor(self, link: _Link) -> None:
        mon = link.mon
        while not mon.closed:
            try:
                frames = mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            event, value = struct.unpack("=Hi", frames[0])
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason = f"it rejected our CURVE key (ZAP status {value})"
            elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in _VANISHED_ERRNOS:
                # The connection broke during the handshake. On a link that was up, that is zmq
                # reconnecting to a peer whose process went away: a plain loss, whatever the
                # security settings. On a new link it may also be a security mismatch (a server
                # drops a client whose mechanism it does not take the same way).
                why = f"its connection was closed during the handshake ({errno.errorcode.get(value, value)})"
                if link.welcomed.done():
                    reason = f"the peer vanished: {why}; its process was killed or exited"
                elif not link.curve and not self._curve_local and _is_local(link.address):
                    # A run's local links are plain on both sides (curve_local=False): no security
                    # mismatch to suggest (it was said on every restarted peer killed again at once).
                    reason = f"{why}: the peer's process exited or was killed"
                else:
                    reason = (
                        f"{why}: the peer's process exited or was killed, or "
                        + ("it does not admit this run's CURVE key" if link.curve
                           else "it requires CURVE (this link has none; check that both sides use CURVE or neither does)")
                    )
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                detail = errno.errorcode.get(value, f"code {value:#x}")
                reason = (
                    f"the security handshake failed (zmq event {event:#x}, {detail}): "
                    + ("check that the peer uses this run's CURVE keys" if link.curve
                       else "the peer may require CURVE (this link has none; check that both sides use CURVE or neither does)")
                )
            elif event == zmq.EVENT_DISCONNECTED:
                if not link.welcomed.done():
                    continue  # still connecting: zmq retries
                reason = "the connection closed (process exited, or heartbeats timed out)"
            else:
                continue
            if not link.welcomed.done():
                link.welcomed.set_exception(PeerLostError(f"peer {link.name!r} at {link.address}: {reason}"))
                return
            self._lose(link, reason)
            return


def _nonneg_ints(values: list[Any]) -> bool:
    return all(type(v) is int and v >= 0 for v in values)
