"""The client side of a daemon: ``DaemonClient`` (one request at a time over CURVE, with a socket monitor
that says how far a failed request's connection got) and ``job_spec`` (what ``reactor submit`` sends).

The daemon itself is ``reactor/launch/_daemon.py``; its protocol is ``_protocol.DAEMON_KINDS``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.utils.monitor

from .._errors import AppError, DaemonError
from .._reactor import show_value as _show
from ..transport import CurveKeys
from ._app import shipped_files

__all__ = ["DaemonClient", "DaemonFullError", "DaemonKeyError", "DaemonSilentError", "job_spec"]


class DaemonSilentError(DaemonError):
    """A daemon did not answer in time. ``reached`` says how far the connection to it got, which the
    message says too: ``"nothing"`` (no TCP connection: a wrong address, no daemon running, the host
    unreachable), ``"tcp"`` (a TCP connection, but the CURVE handshake did not complete: a daemon
    stopped or overloaded, or no reactor daemon there), ``"handshake"`` (the daemon admitted our key,
    then answered late: overloaded or stopped, or the network to it cut since); ``"refused"`` for :class:`DaemonKeyError`. ``why``
    is the message's reason alone."""

    def __init__(self, message: str, reached: str = "nothing", why: str = "") -> None:
        super().__init__(message)
        self.reached = reached
        self.why = why or message


class DaemonFullError(DaemonError):
    """A daemon refused to start a worker because its host has less memory available than a worker
    takes there (its ``--worker-memory-mb``): another candidate host may take the group. On the wire,
    a refusal's reply carries the kind ``"full"`` after its text (``[id, False, text, "full"]``)."""


class DaemonKeyError(DaemonSilentError):
    """The CURVE handshake with a daemon failed: it does not admit our key (not in its ``authorized/``),
    or the key we hold for it is not its own. Raised as soon as ZeroMQ reports it, not after a timeout."""


def _key_files_named(path: str | Path) -> list[str]:
    """The key files a placement or hosts file's ``[hosts]`` names by a relative path (``key =
    "h2.pub"``, read beside the file): a submitted job ships them with the file, at the same relative
    paths (they were left behind: the job failed on the daemon, "cannot read its key"). Absolute paths
    and Z85 keys stay as they are; a file that does not parse names none (its own check says why)."""
    import tomllib

    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return []
    base, out = Path(path).parent, []
    hosts = data.get("hosts")
    for entry in hosts.values() if isinstance(hosts, dict) else ():
        text = entry.get("key") if isinstance(entry, dict) else None
        if not isinstance(text, str) or Path(text).is_absolute() or ".." in Path(text).parts:
            continue
        if (base / text).is_file():
            out.append(Path(text).as_posix())
    return out


def job_spec(app: str | os.PathLike[str], *, placement: str = "single", config: dict[str, Any] | None = None,
             seed: int = 0, async_: bool = False, files: Sequence[str | os.PathLike[str]] = (),
             hosts: str | os.PathLike[str] | None = None, restart: str | None = None) -> dict[str, Any]:
    """What ``reactor submit`` sends: the app file and the files it names (``--with``), by content and
    sha256, and the run's settings. A placement that names a file here travels with it, and so does
    a hosts file (``--hosts``), each with the key files its ``[hosts]`` names by a relative path. ``restart``: as ``reactor run --restart`` (``on-failure:N``).

    Raises:
        FileNotFoundError: a file is missing.
        GraphError: ``restart`` is not a policy.
        AppError: two different files would go under one name (:func:`~reactor.launch._app.shipped_files`),
            or the files are what a daemon refuses (a name past ``[A-Za-z0-9_.-]``, too many, too large).
    """
    if restart is not None:
        from ._groups import restart_from_text

        restart_from_text(restart)
    app = Path(app)
    entries: list[tuple[str, str | os.PathLike[str], str | None]] = [("the app", app, None)]
    entries += [("--with file", f, None) for f in files]
    shipped = []
    if Path(placement).is_file():
        entries.append(("the placement file", placement, None))
        shipped.append(Path(placement))
        placement = Path(placement).name
    hosts_name = None
    if hosts is not None:
        entries.append(("the hosts file", hosts, None))
        shipped.append(Path(hosts))
        hosts_name = Path(hosts).name
    for path in shipped:  # (the key files their hosts name beside them go along, at the same paths)
        entries += [("a key file", path.parent / rel, rel) for rel in _key_files_named(path)]
    # (by name, each once: two files of one name were one, the last given: a --with ppo.py replaced the app)
    names = {n: p.read_bytes() for n, p in shipped_files(entries).items()}
    sums = {n: hashlib.sha256(d).hexdigest() for n, d in names.items()}
    from ._protocol import _files

    if (why := _files(names, sums, app.name)) is not None:  # (what the daemon would refuse, said before it is sent)
        raise AppError(f"the job's files cannot be sent as they are: {why}")
    return {"app": app.name, "files": names, "sha256": sums,
            "config": dict(config or {}), "placement": placement, "hosts": hosts_name, "seed": seed, "async": async_,
            "restart": restart}


#: What the client's socket monitor reports (``ZMQ_EVENT_*``): how far its connection got, and each
#: connect that failed (refused: ZeroMQ tries again in ``RECONNECT_IVL``).
_LINK_EVENTS = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_CONNECT_RETRIED)
#: Why a request found nothing listening (``refused_after_s``), after the address.
REFUSED_WHY = ("every TCP connect failed at once (refused: nothing listens on that port; or the host is unknown or "
               "unreachable): check the address and port, and that the daemon runs there")
#: A connect failure older than this leaves ``refused_after_s`` out of it: a connect now under way (a lost
#: SYN waits a second for its retransmit) is not a refused one. ZeroMQ retries every 0.1 s.
_RETRIED_FRESH_S = 0.5
#: The largest answer a client takes (``MAXMSGSIZE``: ZeroMQ ends the connection on a larger frame before
#: any of it reaches Python; a frame of 300 MB of junk took 660 MB of memory). A daemon's largest answer
#: with a bound is ``run_files``'s (``_hosting.RUN_FILES_MAX_NBYTES`` of paths, 16 MiB, and ~2.3 MiB of the
#: rest), a log chunk 1 MiB (``LOG_CHUNK_NBYTES``); ``status`` of all its jobs has none but their number
#: (~1-3 KiB a job: the 200 ended ones kept and hundreds running are a few MiB). 64 MiB, the daemon's own
#: bound on a request (``_daemon.MAX_REQUEST_NBYTES``), holds each of them several times over.
MAX_ANSWER_NBYTES = 64 << 20
#: Why a request ends when ZeroMQ ended the connection after the handshake and does not connect again
#: (what it does for a frame over ``MAXMSGSIZE``, or one that breaks its protocol; a daemon that stopped
#: or restarted is connected to again, at once, and waited for).
DROPPED_WHY = (f"it completed the CURVE handshake, then sent a frame ZeroMQ refused and ended the connection for: "
               f"an answer over {MAX_ANSWER_NBYTES >> 20} MiB (more than a daemon ever answers), or one that is not "
               f"ZeroMQ's framing (no reactor daemon of this version there?)")
#: How long after such an end a request waits for ZeroMQ to connect again (at once, as a daemon that
#: stopped is connected to again) before it takes the end for one after a refused frame.
_DROPPED_AFTER_S = 1.0
#: How many requests that ended without their answer a client keeps the ids of (an answer that comes
#: later is dropped without a word; one to any other id it sent is a reply that is no answer).
_UNANSWERED_KEPT = 1024


class DaemonClient:
    """Requests to one daemon: ``DaemonClient(address, daemon_key, keys).request("status", None)``.

    A socket monitor follows the connection, so that a request that fails says how far it got: no
    TCP connection, a CURVE handshake that did not complete, a daemon that admitted our key and then
    answered late (:class:`DaemonSilentError`), or a handshake the daemon refused
    (:class:`DaemonKeyError`, at once: a key a daemon does not admit waits no timeout out). The next
    request after a refusal connects again, with a new handshake: once the operator has admitted our
    key (or the right daemon key is in place), the same client goes on.

    What comes back is a peer's message, taken no further than it holds: a frame over
    :data:`MAX_ANSWER_NBYTES` ends the connection in ZeroMQ (a request then fails at once, and the next
    one connects again), and a reply that is no answer (junk, a request id never sent) is dropped and
    counted, the error that ends the request naming it. Its payload's shape is the caller's to check.

    Args:
        address: the daemon's ``tcp://HOST:PORT``.
        daemon_key: the daemon's public key (its ``key.pub``), Z85.
        keys: this client's key pair; the daemon must list its public half in ``authorized/``.
        timeout_s: how long to wait for each answer.
        who: how errors name the daemon (default ``the daemon at ADDRESS``).
        refused_after_s: give a request up (:class:`DaemonSilentError`, ``reached == "nothing"``) once every
            TCP connect during this long of it failed at once (refused, or the host unknown), before
            ``timeout_s``: the command line's, where a wrong port waited the whole timeout out to say
            nothing listened there. Only while this client has never connected: one that has (a daemon
            restarting, ``logs -f`` over an outage) waits ``timeout_s`` out. None (the runtime's
            clients): always wait ``timeout_s`` out.
    """

    def __init__(self, address: str, daemon_key: bytes, keys: CurveKeys, timeout_s: float = 10.0,
                 who: str | None = None, refused_after_s: float | None = None, ctx: zmq.Context | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.refused_after_s = refused_after_s
        self.ever_connected = False  # some connection of this client got through (refused_after_s is then off)
        self.unanswered: set[int] = set()  # requests that ended without their answer (it may come late)
        self.who = who or f"the daemon at {address}"
        self.daemon_key = daemon_key
        self.public = keys.public
        self._keys = keys
        # (given: a coordinator's links to its hosts share one, whose threads and descriptors each of a few
        # hundred hosts' clients took for its own: EMFILE at 150 hosts under the common 1,024 descriptors)
        self._own_ctx = ctx is None
        self.ctx = zmq.Context() if ctx is None else ctx
        try:
            self._connect()
        except DaemonError:
            if self._own_ctx:
                self.ctx.destroy(linger=0)
            raise
        self.next_id = 1

    def _connect(self) -> None:
        """A new socket (and its monitor) connecting to the daemon.

        Raises:
            DaemonError: ZeroMQ refused the daemon's key (not a CURVE public key's 40 characters of Z85) or
                its address (not one it connects to: ``bogus://x``); both can come in a daemon's answer
                (a job's groups, for ``reactor logs JOB GROUP``), where ``zmq.ZMQError`` ended the command
                in a traceback.
        """
        try:  # (no descriptor left, or a context closed meanwhile: a DaemonError too, not ZeroMQ's own)
            self.sock = self.ctx.socket(zmq.DEALER)
        except zmq.ZMQError as e:
            raise DaemonError(f"{self.who} cannot be asked: no socket to it ({zmq.strerror(e.errno)})") from None
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_NBYTES)
        self.link = "nothing"  # how far the connection is now: "nothing", "tcp", "handshake"
        self.retried_at: float | None = None  # the last connect that failed, while none got through since
        self.refused: tuple[int, int] | None = None  # the last handshake failure since the last success
        self.closed_in_handshake = False  # the peer closed the last connection in its handshake (_follow_link)
        self.connected_since_retry = False  # (whether a connect got through since ZeroMQ last retried)
        self.dropped_at: float | None = None  # ZeroMQ ended a connection after its handshake, to connect no more
        key = self.daemon_key[:60].decode(errors="replace")
        step, monitor = f"its key {key!r} is not a CURVE public key (40 characters of Z85)", None
        try:
            self.sock.curve_secretkey = self._keys.secret
            self.sock.curve_publickey = self._keys.public
            self.sock.curve_serverkey = self.daemon_key
            monitor = self.sock.get_monitor_socket(_LINK_EVENTS)  # (before connect: its first events count)
            step = f"its address {self.address[:200]!r} is not one ZeroMQ connects to"
            self.sock.connect(self.address)
        except zmq.ZMQError as e:
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.disable_monitor()
                monitor.close(linger=0)
            self.sock.close(linger=0)
            raise DaemonError(f"{self.who} cannot be asked: {step} ({zmq.strerror(e.errno)})") from None
        self.monitor = monitor
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def _close_socket(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)

    def request(self, kind: str, *fields: Any, timeout_s: float | None = None) -> Any:
        """Send one request and return its payload (waiting ``timeout_s``, default the client's).

        Raises:
            DaemonKeyError: the CURVE handshake failed (our key is not admitted, or the daemon's key
                is not the one given), as soon as that is known; the next request tries a new handshake.
            DaemonSilentError: no answer within ``timeout_s``, saying how far the connection got, and how
                many replies came that were no answer (:func:`_answer_of`: junk, a request id we never
                sent), the first one's flaw; or (``refused_after_s``) every connect failing at once for that
                long; or ZeroMQ ended the connection on a frame over ``MAX_ANSWER_NBYTES`` (:data:`DROPPED_WHY`).
            DaemonError: the daemon refused the request (its reason).
        """
        rid = self.next_id
        self.next_id += 1
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._follow_link()
        if self.refused is not None or self.dropped_at is not None:
            # ZeroMQ does not connect again after a refused handshake: every later request failed at
            # once ("takes no more requests"), even after the operator admitted our key, until the
            # caller made a new client. A new connection, with a new handshake, is what asking again means.
            # (Nor after it ended one on a frame it refused: every later request waited its timeout out.)
            self._close_socket()
            self._connect()
        try:
            self.sock.send_multipart([b"", msgpack.packb([rid, kind, *fields], use_bin_type=True)], flags=zmq.NOBLOCK)
        except zmq.Again as e:
            raise DaemonSilentError(f"{self.who} takes no more requests (not reachable)") from e
        try:
            return self._answer(rid, kind, timeout_s)
        except DaemonSilentError:  # (its answer may come yet, late: the next request drops it, not as junk)
            self.unanswered.add(rid)
            if len(self.unanswered) > _UNANSWERED_KEPT:
                self.unanswered.discard(min(self.unanswered))
            raise

    def _answer(self, rid: int, kind: str, timeout_s: float) -> Any:
        """The answer to request ``rid`` (sent), as :meth:`request` returns it and raises."""
        started = time.monotonic()
        deadline = started + timeout_s
        self._follow_link()
        junk, first_flaw = 0, ""  # replies that were no answer (dropped, and said if no answer comes)
        while (left := deadline - time.monotonic()) > 0 and self.refused is None:
            if self._refusing():  # (every connect failing at once: no answer can come; events read after each poll)
                assert self.refused_after_s is not None
                if (wait := started + self.refused_after_s - time.monotonic()) <= 0:
                    raise DaemonSilentError(f"{self.who} did not answer {kind!r}: {REFUSED_WHY}", "nothing", REFUSED_WHY)
                left = min(left, wait)
            if self.dropped_at is not None:  # (ended on a frame ZeroMQ refused: no answer can come on this socket)
                if (wait := self.dropped_at + _DROPPED_AFTER_S - time.monotonic()) <= 0:
                    raise DaemonSilentError(f"{self.who} did not answer {kind!r}: {DROPPED_WHY}", "handshake",
                                            DROPPED_WHY)
                left = min(left, wait)
            ready = dict(self.poller.poll(int(left * 1000) + 1))
            if self.monitor in ready:
                self._follow_link()
            if self.sock not in ready:
                continue
            reply, flaw = _answer_of(self.sock.recv_multipart(), rid, self.unanswered)
            if flaw is not None:
                junk, first_flaw = junk + 1, first_flaw or flaw
                continue
            if reply is None:
                continue  # a late answer to an earlier request
            if not reply[1]:
                raise (DaemonFullError if reply[3:] == ["full"] else DaemonError)(str(reply[2]))
            return reply[2]
        if self.refused is not None:
            raise self._key_error()
        if junk:  # (what came is said, not "answered late": a daemon of another version, or no reactor daemon)
            said = "once with a reply that is not an answer: it" if junk == 1 else \
                f"{junk} times with replies that are not answers: the first"
            why = f"it answered {said} {first_flaw} (no reactor daemon of this version there?)"
            raise DaemonSilentError(f"{self.who} did not answer {kind!r} within {timeout_s:.1f} s: {why}", self.link,
                                    why)
        why = {"nothing": "nothing there accepted a TCP connection (check the address and port, and that the daemon "
                          "runs there)",
               "tcp": "it accepted a TCP connection but did not complete the CURVE handshake (a daemon that is stopped "
                      "or overloaded, or no reactor daemon)",
               "handshake": "it completed the CURVE handshake (it admits our key) but answered late: it is overloaded "
                            "or stopped, or the network to it was cut since"}[self.link]
        raise DaemonSilentError(f"{self.who} did not answer {kind!r} within {timeout_s:.1f} s: {why}", self.link, why)

    def _follow_link(self) -> None:
        """Take the monitor's events so far: how far the connection is (``link``), and a failed handshake."""
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECT_RETRIED:  # (a connect failed: refused, or its host unknown or unreachable)
                self.dropped_at = None  # (ZeroMQ connects again: the end was no refused frame)
                if not self.connected_since_retry:  # (a connect refused: the listener is gone, it refused no key)
                    self.closed_in_handshake = False
                self.connected_since_retry = False
                if self.link == "nothing":
                    self.retried_at = time.monotonic()
            elif kind == zmq.EVENT_CONNECTED:
                self.link, self.retried_at, self.ever_connected = "tcp", None, True
                self.connected_since_retry = True
            elif kind == zmq.EVENT_DISCONNECTED:
                # (after the handshake: a daemon that stopped, which ZeroMQ connects to again at once, a
                # CONNECT_RETRIED; or a frame it refused, over MAXMSGSIZE, after which it never does)
                self.dropped_at = time.monotonic() if self.link == "handshake" else None
                self.link = "nothing"
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.link, self.refused, self.closed_in_handshake = "handshake", None, False
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and not self.closed_in_handshake:
                # The peer closed the connection in its handshake: a daemon that does not hold the key we gave
                # for it does, at every connect (ZeroMQ's next one 0.1 s on), and so does a listener that went
                # away meanwhile (a daemon that stopped or restarted), whose next connect is refused. So it is
                # a key error at the second in a row (a stopped listener's, taken for one at the first, waited
                # out no timeout: 1 test run in 2 on a quiet machine).
                self.closed_in_handshake = True
            else:  # a handshake failed (its event and ZeroMQ's code)
                self.refused = (int(kind), int(event["value"]))

    def _refusing(self) -> bool:
        """Whether connects are failing at once now (the last one failed lately, none got through since),
        and this client gives up on that (``refused_after_s``, never connected)."""
        return (self.refused_after_s is not None and not self.ever_connected and self.link == "nothing"
                and self.retried_at is not None and time.monotonic() - self.retried_at < _RETRIED_FRESH_S)

    def _key_error(self) -> DaemonKeyError:
        assert self.refused is not None
        kind, code = self.refused
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (f"it refused our key in the CURVE handshake: its authorized/ does not hold our key.pub, public = "
                   f"{self.public.decode(errors='replace')} (the daemon's log names the key it rejected)")
        else:
            detail = ("the daemon closed the connection" if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                      else f"a protocol error, ZMTP code {code:#x}")
            why = (f"the CURVE handshake failed ({detail}): the key given for the daemon there, "
                   f"{self.daemon_key.decode(errors='replace')}, is most likely not its key.pub (check --daemon-key, "
                   f"the hosts file's key for it, or REACTOR_KEYS for a cluster key), or no reactor daemon listens there")
        return DaemonKeyError(f"{self.who}: {why}", "refused", why)

    def close(self) -> None:
        self._close_socket()
        if self._own_ctx:
            self.ctx.destroy(linger=0)

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer_of(frames: list[bytes], rid: int, unanswered: set[int]) -> tuple[list[Any] | None, str | None]:
    """A reply's ``[id, ok, payload]`` (or ``[id, False, text, "full"]``) if it answers request ``rid``;
    ``(None, None)`` for the late answer of a request in ``unanswered`` (it ended without it: taken out);
    ``(None, flaw)`` for a reply that is no answer (not two frames, not msgpack, not that list, the id of
    no request, or of one answered already), the flaw in words. Such replies were dropped without a word:
    a daemon that sent only those was said to have "answered late: it is overloaded or stopped"."""
    if len(frames) != 2 or frames[0] != b"":
        return None, (f"came in {len(frames)} frames, not 2" if len(frames) != 2 else "has a first frame that is not "
                      "empty")
    try:
        reply = msgpack.unpackb(frames[1], raw=False)
    except Exception as e:  # noqa: BLE001 - junk is no answer, whatever its flaw
        return None, f"is not msgpack ({type(e).__name__}{': ' + str(e)[:80] if str(e) else ''})"
    if type(reply) is not list or len(reply) not in (3, 4):
        return None, f"is {_show(reply)}, not [request id, ok, payload]"
    if type(reply[0]) is not int or (reply[0] != rid and reply[0] not in unanswered):
        return None, f"has the request id {_show(reply[0])}, " + (
            "whose answer came already" if type(reply[0]) is int and 0 < reply[0] < rid else
            "which this client never sent")
    if type(reply[1]) is not bool:
        return None, f"has an ok of {_show(reply[1])}, not a bool"
    if reply[0] != rid:
        unanswered.discard(reply[0])
        return None, None
    return reply, None
