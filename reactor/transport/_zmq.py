"""The ZeroMQ adapter: one message endpoint per process, credit-based flow control, CURVE, liveness.

Wire protocol (all framing of payloads is :mod:`reactor.transport.codec`'s):

- Each :class:`Endpoint` binds one ROUTER socket (two with ``local_bind``: tcp for other hosts, ipc
  for its own) and connects one DEALER per peer it sends to. zmq names each connection (its routing
  id); the connection's hello names its endpoint, so the receiving ROUTER knows who sent each
  message; a ROUTER's replies (welcome, credit) go to the senders that connected to it.
- Data flows DEALER -> ROUTER only: ``[codec frame 0 (msgpack, never empty), array frames...]``,
  or a batch of frame-less messages in one frame (``codec.encode_batch``: ``0xc1``, then a msgpack
  array of the messages' frame-0 bytes).
- Control messages start with an empty frame: ``[b"", msgpack([kind, ...])]``. The DEALER opens
  with ``HELLO(proto, name, token, seq)``: ``token`` is 8 random bytes drawn once per endpoint and
  ``seq`` the connection's number there, so that a late hello from an endpoint's earlier try is told
  from its newer one. The ROUTER answers ``WELCOME(proto, name, window, window_nbytes,
  max_message_nbytes)`` and, as the application consumes that sender's messages, ``CREDIT(n,
  nbytes)``. A name is live at one connection at a time, across both ROUTERs: a hello under a name
  whose connection lives is refused (``hellos_refused``: no one takes over a live peer's messages and
  credit), one under a name whose connection has closed (a killed process's, a timed-out try's, a
  disconnected link's) takes the name at once, while the closed connection's messages still unread
  are delivered under it, before the new connection's (which wait for its welcome); one behind a
  connection the same endpoint has left (same token, lower ``seq``: a lingering ``disconnect``'s), or
  behind a full queue (a live peer that reads nothing), waits for it to close, for at most 2 s
  (``_Receiving._hello``).
- Credit: a sender may send while it holds at least one message of credit and a positive byte
  credit; each message costs one message and its size in bytes. The receiver returns credit when its
  application takes messages out of :meth:`Endpoint.recv_batch`, in grants of at least half a window
  (so credit costs one small message per half window, not one per message). A sender therefore
  never has more than ``credit_window`` messages, nor more than ``credit_window_nbytes +
  max_message_nbytes`` bytes, anywhere between its ``send`` and the receiver's application: a slow
  consumer bounds the memory of both sides. A sender that exceeds its credit is dropped (logged).
  Credit counts messages, never batches: a batch of ``k`` messages costs ``k`` messages and the
  sum of their frame-0 sizes (what they would have cost one by one; the batch header is free).
- Coalescing: the first message to a peer in a loop tick is sent at once; the frame-less messages
  (at most ``_BATCH_ITEM_MAX_NBYTES`` each) sent to that peer later in the same tick are held and
  sent as one batch when the tick's callbacks run (``loop.call_soon``), or earlier when the batch
  reaches ``_BATCH_MAX_NBYTES`` (or the peer's ``max_message_nbytes``) or a message with array
  frames must follow it. So a burst pays zmq's per-message cost and the receiver's wake-up once per
  batch, a lone message waits for nothing, and order per peer is kept. Messages with array frames
  are never batched (their frames stay zero-copy).

Readiness is handled with ``loop.add_reader`` on the sockets' ``FD`` (as ``zmq.asyncio`` does
internally, but registered once instead of per wait), and every wake-up drains all ready messages:
one wake-up per batch, not per message. Works on the default asyncio loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio
import zmq.auth.asyncio

from reactor._errors import LinkStateError, PeerLostError, WouldBlock
from reactor._files import check_ipc_bind
from reactor._floodlog import FloodCounts

from ._curve import CurveKeys, _AllowedKeys, _is_local, link_key
from ._zmqreceive import (
    _CONTROL_MAX_NBYTES,
    PROTOCOL_VERSION,
    TOKEN_NBYTES,
    _Receiving,
    _Router,
    _Sender,
    _wake,
    hello_message,
)
from ._zmqsend import _Link, _Sending

__all__ = ["PROTOCOL_VERSION", "CurveKeys", "Endpoint", "EndpointStatistics", "link_key"]

log = logging.getLogger("reactor.transport")
#: An endpoint's ZMTP heartbeats: a connection whose peer is silent this long is closed (a vanished
#: host's, at its peers); until then its name stays taken (no handover).
HEARTBEAT_IVL_S = 1.0
HEARTBEAT_TIMEOUT_S = 5.0

# Frames up to this size are copied into zmq's buffer when sent, larger ones handed over zero-copy.
# pyzmq's default (64 KiB) sends a replay insert's 256 KiB observation frame zero-copy, and each such
# frame is released later by pyzmq's garbage-collector thread, which must take the GIL from the
# sending loop: copying it instead (~25 us) measured 4-5% more cross-process insert throughput
# (bench_replay_service --quick, three alternating pairs, docs/benchmarks.md). Weights and other
# large messages stay zero-copy.
_COPY_THRESHOLD_NBYTES = 1 << 20
_MONITOR_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


# ------------------------------------------------------------------------------------------ state


@dataclass(frozen=True)
class EndpointStatistics:
    """A snapshot of one endpoint's counters (see :meth:`Endpoint.statistics`)."""

    #: Data messages this endpoint sent, and their total size in bytes (each message's own frames:
    #: batch headers are not counted). Sent includes messages held for the tick's batch.
    messages_sent: int
    bytes_sent: int
    #: Batches sent (each carrying two or more of ``messages_sent``).
    batches_sent: int
    #: Data messages accepted from peers (queued or already handed to the application).
    messages_received: int
    bytes_received: int
    #: Batches accepted from peers (each carrying several of ``messages_received``).
    batches_received: int
    #: Messages handed to the application by ``recv_batch``.
    messages_delivered: int
    #: Received messages dropped: undecodable, over ``max_message_nbytes``, from a peer that never
    #: said hello, or beyond the credit the sender held (a protocol violation). A dropped batch
    #: counts the messages its header announces (one if even its header is unreadable).
    dropped_malformed: int
    dropped_too_large: int
    dropped_unknown_peer: int
    dropped_over_credit: int
    #: Decoded messages the application protocol refused (``Endpoint.open(accept=...)``).
    dropped_invalid: int
    #: Senders forgotten because their connection had gone (they said hello, then closed).
    senders_forgotten: int
    #: Hellos refused because a peer of that name is connected (through either socket, with
    #: ``local_bind``): a name is live at one connection at a time (no handover).
    hellos_refused: int
    #: Sends that found no credit (``send_nowait`` raising WouldBlock, or ``send`` having to wait).
    credit_stalls: int
    #: Credit grants sent back to senders.
    credit_grants_sent: int
    #: Messages (and bytes) received but not yet taken by ``recv_batch``, now and at most so far.
    queued_messages: int
    queued_nbytes: int
    max_queued_messages: int
    max_queued_nbytes: int
    #: Peers this endpoint is connected to (sends to), and those lost since.
    peers: tuple[str, ...]
    lost_peers: tuple[str, ...]
    #: Senders this endpoint's ROUTERs know now (said hello, not yet swept: a closed connection's
    #: sender is kept until a sweep, for its messages still unread).
    senders: int

    @property
    def dropped(self) -> int:
        """Every received message dropped, whatever the reason (a correct peer causes none)."""
        return (self.dropped_malformed + self.dropped_too_large + self.dropped_unknown_peer
                + self.dropped_over_credit + self.dropped_invalid)


_MONITOR_SEQ = itertools.count()


# ------------------------------------------------------------------------------------------ endpoint


class Endpoint(_Sending, _Receiving):
    """One process's message endpoint: a ROUTER it receives on, and a DEALER per peer it sends to.

    Messages are anything :func:`reactor.transport.codec.encode` carries. Delivery is reliable and
    in order per (sender, receiver) pair while both live; messages in flight when a peer dies are
    lost. Peers are named; names must be unique among the endpoints that talk to one endpoint.

    All methods must be called from the event loop the endpoint was opened on. ``send`` and
    ``recv_batch`` may run in different tasks; at most one task may wait in ``recv_batch`` at a time.

    A peer that dies (process killed, host gone: detected by the connection closing or by ZMQ
    heartbeats within ``heartbeat_timeout_s``) is reported by :attr:`lost_peers`,
    :meth:`wait_peer_lost`, and ``PeerLostError`` from ``send``/``send_nowait`` to it. An endpoint
    learns of the loss of the peers it is *connected to*: to watch a peer, connect to it.

    Example::

        a = await Endpoint.open("a", "ipc:///tmp/a.sock")
        await a.connect("b", b_address)
        await a.send("b", {"tag": (0, 0), "x": np.ones(3)})
        batch = await b.recv_batch()        # [("a", {...})]
        await a.aclose()
    """

    def __init__(self, *, _token: object = None) -> None:
        if _token is not _OPEN_TOKEN:
            raise TypeError("use `await Endpoint.open(name, bind, ...)` to create an Endpoint")

    # ---------------------------------------------------------------------------- lifecycle

    @classmethod
    async def open(
        cls,
        name: str,
        bind: str = "tcp://127.0.0.1:*",
        *,
        curve: CurveKeys | None = None,
        curve_clients: Collection[bytes] | None = None,
        curve_local: bool = True,
        local_bind: str | None = None,
        max_message_nbytes: int = 64 * 2**20,
        credit_window: int = 64,
        credit_window_nbytes: int | None = None,
        heartbeat_ivl_s: float = HEARTBEAT_IVL_S,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        accept: Callable[[str, Any], str | None] | None = None,
    ) -> Endpoint:
        """Bind an endpoint's ROUTER (two with ``local_bind``) and start serving it on the running loop.

        Args:
            name: this endpoint's identity, as peers see it (1..255 bytes of UTF-8).
            bind: where to listen: ``tcp://HOST:PORT`` (``*`` for an OS-picked port) or
                ``ipc://PATH``. :attr:`address` gives the resolved address to hand to peers.
            curve: this endpoint's key pair. When given, the ROUTER accepts CURVE clients only,
                and ``connect(..., server_public_key=...)`` uses it as client key pair.
            curve_clients: client public keys (Z85) the ROUTER admits; default: only
                ``curve.public`` (every process of a job shares one key pair).
            curve_local: with ``curve``, whether a ROUTER bound to a local address (``ipc://``,
                ``inproc://``) is a CURVE server too (the default), or plain: then only links to
                this endpoint's peers' tcp addresses are encrypted (``connect`` with their key),
                and the local socket's directory permissions are its boundary, as in a run
                without tcp. A ``tcp://`` bind with ``curve`` is always a CURVE server.
            local_bind: beside a ``tcp://`` bind, a second address (``ipc://``, ``inproc://``) to
                receive on, for peers on the same host (:attr:`local_address`); under ``curve``
                it follows ``curve_local``. Messages from both come out of one :meth:`recv_batch`,
                in order per sender and connection; credit goes back through the socket each
                sender came in on.
            max_message_nbytes: the largest message (all frames) accepted or sent; zmq's
                ``MAXMSGSIZE`` is set too, so a larger frame never reaches Python.
            credit_window: messages a sender may have outstanding to this endpoint.
            credit_window_nbytes: bytes a sender may have outstanding (it may overshoot by one
                message); default ``4 * max_message_nbytes``.
            heartbeat_ivl_s: ZMQ heartbeat period on every connection.
            heartbeat_timeout_s: a connection silent this long is closed and its peer lost.
            accept: the application protocol's check, called with ``(sender name, message)`` for
                every decoded message before it is queued; it returns None to accept, else the
                reason to refuse. A refused message is dropped (its credit returned), counted in
                ``dropped_invalid`` and logged with the sender and the reason; the endpoint goes
                on serving. It must not raise (an exception counts as a refusal, logged).

        Returns:
            The open endpoint.

        Raises:
            ValueError: a bad argument (named), or ``curve_clients`` without ``curve``.
            OSError: the address cannot be bound (in use, bad path, bad interface).
        """
        name_b = name.encode() if isinstance(name, str) else None
        if name_b is None or not 0 < len(name_b) <= 255 or name_b[0] == 0:
            raise ValueError(f"Endpoint name must be a str of 1..255 UTF-8 bytes not starting with NUL, got {name!r}")
        for arg, value, low in (
            ("max_message_nbytes", max_message_nbytes, 1),
            ("credit_window", credit_window, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Endpoint.open: {arg} must be an int >= {low}, got {value!r}")
        if credit_window_nbytes is None:
            credit_window_nbytes = 4 * max_message_nbytes
        if isinstance(credit_window_nbytes, bool) or not isinstance(credit_window_nbytes, int) or credit_window_nbytes < 1:
            raise ValueError(f"Endpoint.open: credit_window_nbytes must be an int >= 1, got {credit_window_nbytes!r}")
        if not (0 < heartbeat_ivl_s <= heartbeat_timeout_s):
            raise ValueError(
                f"Endpoint.open: need 0 < heartbeat_ivl_s <= heartbeat_timeout_s, got "
                f"{heartbeat_ivl_s!r} and {heartbeat_timeout_s!r}"
            )
        if curve_clients is not None and curve is None:
            raise ValueError("Endpoint.open: curve_clients needs curve= (this endpoint's own key pair)")

        if accept is not None and not callable(accept):
            raise ValueError(f"Endpoint.open: accept must be callable or None, got {accept!r:.60}")
        if not isinstance(curve_local, bool):
            raise ValueError(f"Endpoint.open: curve_local must be a bool, got {curve_local!r:.60}")
        if not isinstance(bind, str):
            raise ValueError(f"Endpoint.open: bind must be an address str, got {bind!r:.60}")
        if local_bind is not None and (not isinstance(local_bind, str) or not _is_local(local_bind)
                                       or not bind.startswith("tcp://")):
            raise ValueError(f"Endpoint.open: local_bind must be an ipc:// or inproc:// address beside a tcp:// "
                             f"bind, got local_bind={local_bind!r:.80} with bind={bind!r:.80}")
        serve_curve = curve is not None and (curve_local or not _is_local(bind))
        local_curve = curve is not None and curve_local

        self = cls(_token=_OPEN_TOKEN)
        self._loop = asyncio.get_running_loop()
        self._accept = accept
        self._refusals_logged = FloodCounts()  # per sender
        self._drops_logged = FloodCounts()  # per kind of drop (_ReceiveSide._drop_warning)
        self._name = name
        self._name_b = name_b
        self._curve = curve
        self._curve_local = curve_local
        self._max_nbytes = max_message_nbytes
        self._window = credit_window
        self._window_nbytes = credit_window_nbytes
        self._grant_msgs = max(1, credit_window // 2)
        self._grant_nbytes = max(1, credit_window_nbytes // 2)
        self._hb = (int(heartbeat_ivl_s * 1000), int(heartbeat_timeout_s * 1000))
        self._closed = False
        self._queue: deque[tuple[str, Any]] = deque()
        self._qmeta: deque[tuple[_Sender, int]] = deque()
        self._queued_nbytes = 0
        self._max_queued = 0
        self._max_queued_nbytes = 0
        self._queued_senders: set[_Sender] = set()
        self._by_name: dict[str, _Sender] = {}  # the connection each sender's name is live at
        self._held: dict[str, tuple[_Sender, float]] = {}  # hellos waiting for a closing connection
        self._held_timer: asyncio.TimerHandle | None = None
        self._token = os.urandom(TOKEN_NBYTES)  # told in each hello, with the connection's number
        self._link_seq = itertools.count()
        self._recv_waiter: asyncio.Future[None] | None = None
        self._links: dict[str, _Link] = {}
        self._lost: dict[str, str] = {}  # peer -> reason
        self._unreported_lost: deque[str] = deque()
        self._departures_expected = False  # (expect_departures)
        self._lost_waiter: asyncio.Future[None] | None = None
        self._n = dict.fromkeys(
            (
                "messages_sent",
                "bytes_sent",
                "batches_sent",
                "messages_received",
                "bytes_received",
                "batches_received",
                "messages_delivered",
                "dropped_malformed",
                "dropped_too_large",
                "dropped_unknown_peer",
                "dropped_over_credit",
                "dropped_invalid",
                "senders_forgotten",
                "hellos_refused",
                "credit_stalls",
                "credit_grants_sent",
            ),
            0,
        )

        self._ctx = zmq.asyncio.Context()
        self._auth: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._routers: list[_Router] = []
        self._curve_server = serve_curve
        try:
            if serve_curve or (local_bind is not None and local_curve):
                assert curve is not None
                self._auth = zmq.auth.asyncio.AsyncioAuthenticator(self._ctx)
                self._auth.start()
                allowed = [curve.public] if curve_clients is None else list(curve_clients)
                for key in allowed:
                    if not isinstance(key, bytes) or len(key) != 40:
                        raise ValueError(f"Endpoint.open: curve_clients must hold 40-byte Z85 public keys, got {key!r:.60}")
                self._auth.configure_curve_callback("*", credentials_provider=_AllowedKeys(allowed))
            self._bind_router(bind, curve if serve_curve else None)
            if local_bind is not None:
                self._bind_router(local_bind, curve if local_curve else None)
        except BaseException:
            for r in self._routers:
                r.sock.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.destroy(linger=0)
            raise
        self._address = self._routers[0].address
        for r in self._routers:
            self._loop.add_reader(r.fd, self._drain_router, r)
            self._drain_router(r)
        return self

    def _bind_router(self, bind: str, curve: CurveKeys | None) -> None:
        """Bind one more ROUTER at ``bind`` (a CURVE server with ``curve``)."""
        router = self._ctx.socket(zmq.ROUTER, socket_class=zmq.Socket)
        try:
            self._configure(router, self._max_nbytes)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
            # zmq names each connection itself (a DEALER sets no routing id), so it never refuses one;
            # the endpoint keeps each sender's name live at one connection at a time (_Receiving._hello).
            # No handover of a routing id either, should a raw peer set one that is in use.
            router.setsockopt(zmq.ROUTER_HANDOVER, 0)
            if curve is not None:
                router.curve_server = True
                router.curve_secretkey = curve.secret
                router.curve_publickey = curve.public
            check_ipc_bind(bind)
            try:
                router.bind(bind)
            except zmq.ZMQError as exc:
                raise OSError(exc.errno, f"Endpoint {self._name!r} cannot bind {bind!r}: {exc.strerror}") from None
        except BaseException:
            router.close(linger=0)
            raise
        self._routers.append(_Router(router))

    def _configure(self, sock: zmq.Socket[Any], max_msgsize: int) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msgsize)
        hwm = max(1000, 4 * self._window)  # credit keeps queues below this; it only stops a flood
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        ivl, timeout = self._hb
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        sock.setsockopt(zmq.HEARTBEAT_TTL, timeout)

    async def aclose(self) -> None:
        """Close every socket (linger 0: unsent messages are dropped) and the zmq context.

        Messages held for a batch are handed to zmq first.

        Tasks waiting in ``recv_batch``, ``send`` or ``wait_peer_lost`` get ``PortClosedError``.
        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        for r in self._routers:
            loop.remove_reader(r.fd)
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        self._held.clear()
        for link in list(self._links.values()):
            self._flush_before_close(link)
            self._close_link(link)
        self._links.clear()
        for r in self._routers:
            r.sock.close(linger=0)
        _wake(self._recv_waiter)
        _wake(self._lost_waiter)
        if self._auth is not None:
            self._auth.stop()
            # stop() cancels the authenticator's task; let it finish so no task outlives us.
            for _ in range(3):
                await asyncio.sleep(0)
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ---------------------------------------------------------------------------- properties

    @property
    def name(self) -> str:
        """This endpoint's identity."""
        return self._name

    @property
    def address(self) -> str:
        """The resolved address peers connect to (with the OS-picked port, if ``*`` was bound)."""
        return self._address

    @property
    def local_address(self) -> str | None:
        """The address peers on this host may connect to instead (``local_bind``'s), or None."""
        return self._routers[1].address if len(self._routers) > 1 else None

    @property
    def public_key(self) -> bytes | None:
        """This endpoint's CURVE public key (what a client passes as ``server_public_key``)."""
        return None if self._curve is None else self._curve.public

    @property
    def curve_server(self) -> bool:
        """Whether this endpoint's ROUTER at :attr:`address` encrypts: it admits CURVE clients only
        (see ``curve_local``; the ROUTER at :attr:`local_address` follows ``curve_local`` alone)."""
        return self._curve_server

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    @property
    def peers(self) -> frozenset[str]:
        """The peers this endpoint is connected to and has not lost."""
        return frozenset(self._links)

    @property
    def lost_peers(self) -> frozenset[str]:
        """The peers lost since they were connected (cleared for one by a new ``connect``)."""
        return frozenset(self._lost)

    def statistics(self) -> EndpointStatistics:
        """Return a snapshot of the counters (see :class:`EndpointStatistics`)."""
        return EndpointStatistics(
            **self._n,
            queued_messages=len(self._queue),
            queued_nbytes=self._queued_nbytes,
            max_queued_messages=self._max_queued,
            max_queued_nbytes=self._max_queued_nbytes,
            peers=tuple(sorted(self._links)),
            lost_peers=tuple(sorted(self._lost)),
            senders=sum(len(r.senders) for r in self._routers),
        )

    def flush(self) -> None:
        """Send now the messages held for this tick's batches (see the module notes on coalescing).

        For a sender about to compute without awaiting: what it sent so far leaves at once instead
        of when the loop next runs its callbacks. A link whose zmq queue is full keeps its messages
        held (in order), and the end-of-tick callback retries them.
        """
        for link in self._links.values():
            if link.batch and not link.sock.closed:
                try:
                    self._flush(link)
                except WouldBlock:
                    pass

    def credit(self, peer: str) -> tuple[int, int]:
        """The credit held for sending to ``peer``: ``(messages, nbytes)``.

        Raises:
            LinkStateError: not connected to ``peer`` (a ``ValueError``).
        """
        link = self._link(peer)
        return link.credit_msgs, link.credit_nbytes

    def link_encrypted(self, peer: str) -> bool:
        """Whether the link to ``peer`` is CURVE-encrypted (it was connected with its server key).

        Raises:
            LinkStateError: not connected to ``peer`` (a ``ValueError``).
        """
        return self._link(peer).curve

    # ---------------------------------------------------------------------------- connecting

    async def connect(
        self,
        peer: str,
        address: str,
        *,
        server_public_key: bytes | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        """Connect a DEALER to ``peer``'s endpoint at ``address`` and wait for its welcome.

        On return the link holds the peer's initial credit. Connecting again to a lost peer (for
        example a restarted one) replaces the old link and clears it from :attr:`lost_peers`.

        Args:
            peer: the name the peer's endpoint was opened with; checked against its welcome.
            address: the peer's :attr:`address`.
            server_public_key: the peer's CURVE public key (Z85); when given, the link is
                encrypted and authenticated with this endpoint's ``curve`` key pair.
            timeout_s: how long to wait for the welcome.

        Raises:
            PortClosedError: this endpoint is closed.
            LinkStateError: already connected to ``peer`` (a ``ValueError``).
            ValueError: ``server_public_key`` without ``curve`` on
                this endpoint; a malformed address; or the endpoint at ``address`` is not ``peer``.
            PeerLostError: the peer did not answer within ``timeout_s`` or rejected our CURVE key.
        """
        self._check_open()
        old = self._links.get(peer)
        if old is not None:
            raise LinkStateError(f"Endpoint {self._name!r} is already connected to peer {peer!r} at {old.address}")
        if server_public_key is not None and self._curve is None:
            raise ValueError(
                f"connect({peer!r}): server_public_key needs this endpoint's own key pair; "
                f"open it with Endpoint.open(..., curve=CurveKeys...)"
            )
        sock = self._ctx.socket(zmq.DEALER, socket_class=zmq.Socket)
        sock.copy_threshold = _COPY_THRESHOLD_NBYTES
        self._configure(sock, _CONTROL_MAX_NBYTES)  # a DEALER only ever receives control messages
        if server_public_key is not None:
            assert self._curve is not None
            sock.curve_secretkey = self._curve.secret
            sock.curve_publickey = self._curve.public
            sock.curve_serverkey = server_public_key
        # A name never used before in this process: a closed link's monitor address may stay bound
        # for a while, and a new socket can get the closed one's id() (reconnecting to a restarted
        # peer failed with EADDRINUSE that way).
        mon_addr = f"inproc://reactor-monitor-{id(self):x}-{next(_MONITOR_SEQ)}"
        sock.monitor(mon_addr, _MONITOR_EVENTS)
        mon = self._ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        mon.setsockopt(zmq.LINGER, 0)
        mon.connect(mon_addr)
        link = _Link(peer, address, sock, mon, self._loop.create_future())
        link.curve = server_public_key is not None
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            self._close_link(link)
            raise ValueError(f"connect({peer!r}): bad address {address!r}: {exc.strerror}") from None
        self._links[peer] = link
        self._lost.pop(peer, None)
        self._loop.add_reader(link.fd, self._drain_link, link)
        self._loop.add_reader(link.mon_fd, self._drain_monitor, link)
        sock.send_multipart([b"", hello_message(self._name, self._token, next(self._link_seq))], zmq.NOBLOCK)
        # A zmq FD only signals after a read found the socket empty: read both once to arm them.
        self._drain_link(link)
        self._drain_monitor(link)
        try:
            await asyncio.wait_for(asyncio.shield(link.welcomed), timeout_s)
        except TimeoutError:
            self._forget_link(link)
            raise PeerLostError(
                f"peer {peer!r} at {address} did not answer within {timeout_s} s: check that it is "
                f"running at that address{' and that it admits our CURVE key' if server_public_key else ''}"
            ) from None
        except BaseException:
            self._forget_link(link)
            raise

    def linked(self, peer: str) -> bool:
        """Whether a link to ``peer`` is up: connected (its welcome came), not lost, not disconnected."""
        link = self._links.get(peer)
        # (not a connect still waiting for its welcome: a restarted worker's retry of a peer, cancelled by
        # the coordinator's "restarted", was taken for a live link, and its sends then found no link)
        return (link is not None and link.lost_reason is None and link.welcomed.done() and not link.welcomed.cancelled()
                and link.welcomed.exception() is None)

    def disconnect(self, peer: str, *, linger_s: float = 1.0) -> None:
        """Close the link to ``peer`` on purpose: it is not reported as lost.

        Messages already sent (held ones included) are still delivered for up to ``linger_s``
        seconds. Sending to ``peer`` afterwards raises ``LinkStateError`` until :meth:`connect` is
        called again; the peer welcomes that new link once this one's connection has closed, after
        its last messages, waiting for it at most 2 s (a new link refused then waits out its
        ``timeout_s``).
        """
        link = self._links.pop(peer, None)
        if link is None:
            return
        self._flush_before_close(link)
        link.lost_reason = "disconnected"
        self._close_link(link, linger_ms=int(linger_s * 1000))

    def _forget_link(self, link: _Link) -> None:
        if self._links.get(link.name) is link:
            del self._links[link.name]
        self._close_link(link)

    def _flush_before_close(self, link: _Link) -> None:
        """Send what ``link`` holds for its batch before it closes (sent means handed to zmq)."""
        if link.batch and not link.sock.closed:
            try:
                self._flush(link)
            except WouldBlock:
                log.warning(
                    "endpoint %r: dropped %d messages to peer %r at close: zmq's queue to it is full",
                    self._name, len(link.batch), link.name,
                )

    def _close_link(self, link: _Link, linger_ms: int = 0) -> None:
        if link.flush_handle is not None:
            link.flush_handle.cancel()
            link.flush_handle = None
        link.batch = []
        link.batch_nbytes = 0
        if link.sock.closed:
            return
        self._loop.remove_reader(link.fd)
        self._loop.remove_reader(link.mon_fd)
        try:
            link.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        link.sock.close(linger=linger_ms)
        link.mon.close(linger=0)
        for w in link.waiters:
            _wake(w)
        link.waiters.clear()
        if not link.welcomed.done():
            link.welcomed.cancel()

    def _lose(self, link: _Link, reason: str) -> None:
        """Mark ``link``'s peer lost: close the link, fail its waiters, report it once."""
        if link.lost_reason is not None:
            return
        link.lost_reason = reason
        log.log(logging.INFO if self._departures_expected else logging.WARNING, "endpoint %r lost peer %r at %s: %s",
                self._name, link.name, link.address, reason)
        if self._links.get(link.name) is link:
            del self._links[link.name]
            self._lost[link.name] = reason
            self._unreported_lost.append(link.name)
            _wake(self._lost_waiter)
        self._close_link(link)

    def expect_departures(self) -> None:
        """The run is ending: its peers' processes end too, so a peer lost from now on is logged at
        INFO, not as a warning (each survivor of a failed run said it lost the failed one)."""
        self._departures_expected = True

    async def wait_peer_lost(self, *, timeout_s: float | None = None) -> str:
        """Wait until a connected peer is lost; return its name. Each loss is returned once.

        Raises:
            TimeoutError: no peer was lost within ``timeout_s``.
            PortClosedError: the endpoint is (or gets) closed.
        """
        self._check_open()
        while not self._unreported_lost:
            if self._lost_waiter is not None:
                raise RuntimeError("another task is already waiting in wait_peer_lost")
            self._lost_waiter = fut = self._loop.create_future()
            try:
                await asyncio.wait_for(fut, timeout_s)
            finally:
                self._lost_waiter = None
            self._check_open()
        return self._unreported_lost.popleft()


_OPEN_TOKEN = object()
