"""A daemon's fork server: one Python process that has imported torch, numpy, gymnasium and
reactor's nodes once, and forks the daemon's workers (and its jobs' coordinators) from there.

Why: a worker started as ``python -m reactor.launch._worker`` imports torch anew (about 1.7 s of
CPU on this project's machines), and a run starts several at once; forked from a process that has
imported them, a worker builds its graph within milliseconds. The same idea as
``multiprocessing``'s forkserver, without pickle: requests and answers are JSON lines on two pipes
between the daemon and its own child (no socket, no other user).

The server (``python -m reactor.launch._forkserver PRELOAD_JSON``) imports ``PRELOAD`` (a module that
fails to import is reported and skipped), says ``{"ready": [...]}``, then answers each request
``{"id", "entry", "argv", "cwd", "env", "stdin", "log", "title"}`` with ``{"id", "pid"}`` (or
``{"id", "error"}``) and reports each child's end as ``{"exit": pid, "rc": code}`` (``rc`` as
``Popen.returncode``: minus the signal's number when a signal ended it). It is single-threaded and
starts no thread pool, so forking it is sound; it dies with the daemon (``PR_SET_PDEATHSIG``), and
its children die with it in turn (the workers' own death signal).

A forked child runs ``entry`` (``module:function``, one of :data:`ENTRIES`) in a session of its
own, in ``cwd`` (first on its ``sys.path``, as a new interpreter's ``-m`` there would have it, not the
directory the server started in), with ``env`` as its environment (``os.environ`` and libc's; ``/proc/PID/environ``
still shows the server's, which carries the daemon's ``REACTOR_HOST_ID``), ``stdin`` as
``sys.stdin``, stdout and stderr appended to ``log``, and ``title`` as its process name
(``/proc/PID/comm``: ``ps -e`` shows ``rx:GROUP``). A module read at import time from the
environment sees the daemon's environment, not the request's: the workers' per-run variables are
read at call time.

:class:`ForkServer` is the daemon's handle; :class:`ForkedProcess` has the part of ``Popen``'s
interface the daemon uses (``pid``, ``poll``, ``returncode``, ``send_signal``, ``wait``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import io
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

log = logging.getLogger("reactor.daemon")

#: What a daemon's fork server imports by default: what every worker of the shipped apps imports.
DEFAULT_PRELOAD = ("numpy", "torch", "gymnasium", "reactor.launch._worker", "reactor.nodes", "reactor.replay",
                   "reactor.algos", "reactor.cli")
#: What training runs preload besides: a learner's first torch.optim optimizer imports torch._dynamo
#: (1.0 s on a 2-core machine), Metrics the TensorBoard writer. Neither starts a thread, so forking after
#: them is safe; a run without a learner would only wait longer for its server (+1 s).
TRAINING_PRELOAD = (*DEFAULT_PRELOAD, "torch._dynamo", "torch.utils.tensorboard")
#: The functions a request may name (nothing else is callable through the pipe).
ENTRIES = {"worker": "reactor.launch._worker:main", "cli": "reactor.cli:main"}
START_TIMEOUT_S = 60.0  # the server's imports
SPAWN_TIMEOUT_S = 2.0  # one fork's answer, once its request is sent (a daemon awaits it: Forks.spawn_async)

__all__ = ["DEFAULT_PRELOAD", "TRAINING_PRELOAD", "ForkServer", "ForkServerError", "ForkedProcess", "Forks", "close_early",
           "close_kept", "kept_or_new", "launch_early", "preload_for", "release_kept", "take_early", "workers_here"]


class ForkServerError(RuntimeError):
    """The fork server is not running, or did not answer."""


class ForkedProcess:
    """A process the fork server forked: ``Popen``'s ``pid``/``poll``/``returncode``/``send_signal``/``wait``."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        from ..transport._shm import _pid_start_time  # noqa: PLC0415 (the server's own process never needs it)

        self.start = _pid_start_time(pid) or 0  # (so a reused pid is not taken for this process)
        self.returncode: int | None = None
        #: It ended after its fork server died, so no one read its exit status (``returncode`` then
        #: says -SIGTERM, for callers that only ask whether it ended).
        self.status_unknown = False

    def poll(self) -> int | None:
        if self.returncode is None:
            rc, self.status_unknown = self.server._exit_of(self.pid, self.start)
            self.returncode = rc
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # (reaped by the server, its exit not read yet)
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """The daemon's side: starts the server, sends it requests, collects its children's ends."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, env: dict[str, str] | None = None) -> None:
        self.preload = list(preload)
        self.env = env
        self.proc: subprocess.Popen[bytes] | _ForkedServer | None = None
        self.preloaded: list[str] = []
        self.failed: dict[str, str] = {}
        self._exits: dict[int, int] = {}
        self._children: set[int] = set()
        self._pending: dict[int, Future[dict[str, Any]]] = {}  # spawn requests sent, by id, until answered
        self._answers: dict[int, dict[str, Any]] = {}  # answers to ids no request of ours sent
        self._next = 0
        self._cond = threading.Condition()
        self._dead = False
        self._closing = False
        self.ready = False  # it said so (wait_ready)
        self._ready_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self.users = 0  # (a kept server) the runs using it now
        self.retired = False  # (a kept server) replaced: stopped when its last run lets it go

    def start(self) -> None:
        """Start the server and wait for its imports (raises :class:`ForkServerError` if it fails)."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the server's process. Call it from the thread that lives as long as the server
        should: the server's parent-death signal fires when the thread that started it ends."""
        req_r, req_w = os.pipe()
        ev_r, ev_w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "reactor.launch._forkserver", json.dumps(self.preload),
                                          str(req_r), str(ev_w)], pass_fds=(req_r, ev_w), stdin=subprocess.DEVNULL,
                                         env=self.env)
        finally:
            os.close(req_r)
            os.close(ev_w)
        self._req = os.fdopen(req_w, "wb", buffering=0)
        self._events = os.fdopen(ev_r, "rb")

    def launch_forked(self) -> None:
        """Start the server as a fork of this process, which has imported what it needs already (a daemon's
        job, itself forked from the daemon's server: :func:`launch_early`), instead of a new interpreter that
        imports it all again (2.8 s a job that imports torch). The child keeps no descriptor but its
        standard ones and its two pipes, no logging handler, and Python's path as a new interpreter started
        here would have it; then it serves as :func:`_serve`. Call it where :meth:`launch` would be called,
        from a process with no other thread (a fork keeps only the thread that forks; a lock another held
        would stay held in the child for good).

        Raises:
            OSError: the pipes or the fork failed.
        """
        for stream in (sys.stdout, sys.stderr):  # (what is buffered is written once, by this process)
            with contextlib.suppress(Exception):
                stream.flush()
        req_r, req_w = os.pipe()
        ev_r, ev_w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (req_r, req_w, ev_r, ev_w):
                os.close(fd)
            raise
        if pid == 0:  # the server
            code = 1
            try:
                _close_fds_but(0, 1, 2, req_r, ev_w)
                logging.root.handlers.clear()  # (a worker configures its own: basicConfig does nothing over one)
                logging.root.setLevel(logging.WARNING)
                if sys.path:
                    sys.path[0] = os.getcwd()  # (where a new interpreter's `-m` puts it: the run's directory)
                _serve([m for m in self.preload if m in sys.modules], req_r, ev_w)
                code = 0
            finally:
                os._exit(code)
        os.close(req_r)
        os.close(ev_w)
        self.proc = _ForkedServer(pid)
        self._req = os.fdopen(req_w, "wb", buffering=0)
        self._events = os.fdopen(ev_r, "rb")

    def wait_ready(self) -> None:
        """Wait for the server's imports (any thread; once it has said it is ready, at once: two runs
        sharing a kept server both wait here, and only the first reads the server's answer)."""
        with self._ready_lock:
            if self._closing:  # (it failed to start for an earlier waiter, or was stopped)
                raise ForkServerError("the fork server is not running")
            if not self.ready:
                self._wait_ready()

    def _wait_ready(self) -> None:
        first = self._events.readline()
        try:
            ready = json.loads(first)
        except ValueError:
            ready = None
        if type(ready) is not dict or "ready" not in ready:
            self.close()
            raise ForkServerError(f"the fork server did not start (it said {first[:200]!r})")
        self.preloaded, self.failed = list(ready["ready"]), dict(ready.get("failed", {}))
        self.ready = True
        threading.Thread(target=self._read, name="forkserver-events", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self._dead and self.proc.poll() is None

    def spawn(self, entry: str, *, argv: Sequence[str], cwd: str | os.PathLike[str], env: dict[str, str],
              stdin: bytes = b"", log_path: str | os.PathLike[str] | None, title: str,
              session: bool = True) -> ForkedProcess:
        """Fork a child running ``ENTRIES[entry]``; its output appended to ``log_path`` (None: to
        the server's own stdout and stderr); in a process session of its own if ``session``. Waits
        up to ``SPAWN_TIMEOUT_S`` for the server's answer (:meth:`request` waits for none)."""
        answer = self.request(entry, argv=argv, cwd=cwd, env=env, stdin=stdin, log_path=log_path, title=title,
                              session=session)
        try:
            got = answer.result(timeout=SPAWN_TIMEOUT_S)
        except FutureTimeoutError:
            if answer.cancel():  # (a child it forks after all is stopped: _read)
                raise ForkServerError("the fork server did not answer a spawn request") from None
            got = answer.result()  # (it came meanwhile)
        return self.forked(got)

    def request(self, entry: str, *, argv: Sequence[str], cwd: str | os.PathLike[str], env: dict[str, str],
                stdin: bytes = b"", log_path: str | os.PathLike[str] | None, title: str,
                session: bool = True) -> Future[dict[str, Any]]:
        """Send a spawn request (as :meth:`spawn`) without waiting: the future gets the server's answer
        (``{"pid"}`` or ``{"error"}``: :meth:`forked` makes it a process), or :class:`ForkServerError`
        when the server dies first. Cancelling the future abandons the request: a child the server
        forks for it after all is killed. Blocks only while the request's line does not fit in the
        pipe (the server reads it at once unless it is stuck).

        Raises:
            ValueError: ``entry`` is not one of :data:`ENTRIES`.
            ForkServerError: the server is not running.
        """
        if entry not in ENTRIES:
            raise ValueError(f"no fork-server entry {entry!r}")
        if not self.alive:
            raise ForkServerError("the fork server is not running")
        answer: Future[dict[str, Any]] = Future()
        with self._cond:
            if self._dead:  # (checked under the lock _read fails the pending under: none is left unanswered)
                raise ForkServerError("the fork server is not running")
            self._next += 1
            rid = self._next
            self._pending[rid] = answer
        line = json.dumps({"id": rid, "entry": entry, "argv": list(argv), "cwd": str(cwd), "env": env,
                           "stdin": stdin.decode(), "log": None if log_path is None else str(log_path),
                           "title": title[:15], "session": session}).encode() + b"\n"
        try:
            with self._write_lock:  # (runs in several threads may share a kept server; a line is KBs)
                self._req.write(line)
        except OSError as e:
            with self._cond:
                self._pending.pop(rid, None)
            raise ForkServerError(f"the fork server is gone ({e})") from e
        return answer

    def forked(self, answer: dict[str, Any]) -> ForkedProcess:
        """The process a spawn request's answer names.

        Raises:
            ForkServerError: the answer is the server's error (a fork that failed).
        """
        if "error" in answer:
            raise ForkServerError(f"the fork server could not start it: {answer['error']}")
        return ForkedProcess(self, int(answer["pid"]))

    def _read(self) -> None:
        for raw in self._events:
            try:
                msg = json.loads(raw)
            except ValueError:
                log.warning("the fork server said something unreadable: %r", raw[:200])
                continue
            with self._cond:
                if "exit" in msg:
                    self._exits[int(msg["exit"])] = int(msg["rc"])
                    self._children.discard(int(msg["exit"]))
                elif "id" in msg:
                    if "pid" in msg:
                        self._children.add(int(msg["pid"]))
                        # An earlier child's exit under the same pid that nobody polled is not this one's
                        # (the server answers a spawn before it can report that child's exit).
                        self._exits.pop(int(msg["pid"]), None)
                    answer = self._pending.pop(int(msg["id"]), None)
                    if answer is None:
                        self._answers[int(msg["id"])] = msg
                    elif answer.set_running_or_notify_cancel():
                        answer.set_result(msg)
                    else:  # abandoned (its wait timed out): its caller started it otherwise
                        _kill_child(msg)
                self._cond.notify_all()
        with self._cond:
            self._dead = True
            pending, self._pending = list(self._pending.values()), {}
            self._cond.notify_all()
        for answer in pending:
            if answer.set_running_or_notify_cancel():
                answer.set_exception(ForkServerError("the fork server ended before it answered a spawn request"))
        if self.proc is not None:
            rc = self.proc.wait()
            if not self._closing:
                log.warning("the fork server ended (exit status %s)", rc)

    def _exit_of(self, pid: int, start: int) -> tuple[int | None, bool]:
        """The exit status of the child ``pid`` (started at ``start``, clock ticks since boot) if it
        ended, else None; and whether that status is unknown (it ended after the server died)."""
        with self._cond:
            if pid in self._exits:
                return self._exits.pop(pid), False  # (the ForkedProcess keeps it: a kept server forks for many runs)
            if not self._dead:
                return None, False
        # The server died: a worker it forked dies with it (its parent-death signal) and a job in a
        # session of its own runs on; none is reaped by us, so tell by whether the process still runs
        # (its pid with its start time: a zombie, or a pid reused since, counts as ended).
        from ..transport._shm import owner_alive  # noqa: PLC0415

        if start and owner_alive(pid, start, 0):
            return None, False
        if not start:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return -signal.SIGTERM, True
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    return None, False
        return -signal.SIGTERM, True

    def close(self) -> None:
        """Stop the server (its children get its death signal)."""
        self._closing = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        for f in ("_req", "_events"):
            with contextlib.suppress(AttributeError, OSError):
                getattr(self, f).close()


class _ForkedServer:
    """A fork server forked from this process (:meth:`ForkServer.launch_forked`): the part of ``Popen`` a
    :class:`ForkServer` uses of its process (``pid``, ``poll``, ``wait``, ``kill``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()  # (its reader thread waits for it while close() may)

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # (reaped elsewhere: its status is gone)
                    self.returncode = -signal.SIGKILL
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        return rc

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _close_fds_but(*keep: int) -> None:
    """Close every descriptor of this process but ``keep``."""
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


class Forks:
    """A daemon's fork server over its life: started when the daemon starts, from its main thread
    (the daemon answers meanwhile; a spawn before it is up starts a new interpreter), and started
    again after it dies.
    ``spawn`` returns None when there is none to use (``--no-fork-server``, or it failed to start):
    the daemon then starts the process with ``Popen`` as before, and logs why once."""

    def __init__(self, preload: Sequence[str] | None, env: dict[str, str] | None = None) -> None:
        self.preload = None if preload is None else list(preload)
        self.env = env
        self.server: ForkServer | None = None
        self.why_not = "" if preload is not None else "the daemon was started with --no-fork-server"
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._launched: ForkServer | None = None
        self.starts = 0
        self.closed = False  # (closed by its daemon: a start this cuts short is no trouble worth a warning)
        self._serial: asyncio.Lock | None = None  # (spawn_async: one request with the server at a time)

    def start(self) -> None:
        if self.preload is None:
            return
        with self._lock:
            self._ready.clear()
            self.starts += 1
        server = self._launched = ForkServer(self.preload, self.env)
        try:
            server.launch()  # here: the thread that started it must outlive it (its death signal)
        except OSError as e:
            self.why_not = f"its fork server did not start: {e}"
            log.warning("%s; workers start as new interpreters (slower)", self.why_not)
            self._ready.set()
            return
        threading.Thread(target=self._wait, args=(server,), name="forkserver-start", daemon=True).start()

    def _wait(self, server: ForkServer) -> None:
        try:
            server.wait_ready()
        except (ForkServerError, OSError) as e:
            self.why_not = f"its fork server did not start: {e}"
            if not self.closed:
                log.warning("%s; workers start as new interpreters (slower)", self.why_not)
        else:
            if server.failed:
                log.warning("the fork server could not import %s", "; ".join(f"{k} ({v})" for k, v in server.failed.items()))
            log.info("fork server up (pid %d): %s imported", server.proc.pid if server.proc else -1,
                     ", ".join(server.preloaded))
            self.server = server
        self._ready.set()

    def spawn(self, entry: str, **kw: Any) -> ForkedProcess | None:
        """Fork ``entry`` from the server (``ForkServer.spawn``'s arguments), waiting for its answer;
        None where there is no server to use (the caller starts a new interpreter)."""
        server = self._usable()
        if server is None:
            return None
        try:
            return server.spawn(entry, **kw)
        except ForkServerError as e:
            self._failed(server, e)
            return None

    async def spawn_async(self, entry: str, **kw: Any) -> ForkedProcess | None:
        """:meth:`spawn` from the daemon's event loop, which answers other requests while the server
        forks (0.1-0.2 s a fork of an interpreter that has imported torch, on a loaded host: a daemon
        that waited on its loop for each left its pings unanswered for seconds while it started a
        burst of workers). One request is with the server at a time (it forks one at a time anyway),
        so its pipe never holds more than one and a write never blocks the loop; each waits up to
        ``SPAWN_TIMEOUT_S`` once sent. From the thread that started the server only (its event loop):
        a failed server is started again here, and dies with the thread that started it."""
        if self._serial is None:
            self._serial = asyncio.Lock()
        async with self._serial:
            server = self._usable()
            if server is None:
                return None
            try:
                answer = server.request(entry, **kw)
                got = asyncio.wrap_future(answer)
                try:
                    return server.forked(await asyncio.wait_for(asyncio.shield(got), SPAWN_TIMEOUT_S))
                except TimeoutError:
                    if not answer.cancel():  # (answered meanwhile; else a child it forks after all is killed)
                        return server.forked(await got)
                    raise ForkServerError("the fork server did not answer a spawn request") from None
                except asyncio.CancelledError:  # (the daemon stops): nothing it forks for us outlives the wait
                    if not answer.cancel():
                        answer.add_done_callback(_kill_answered)
                    raise
            except ForkServerError as e:
                self._failed(server, e)
            return None

    def _usable(self) -> ForkServer | None:
        if self.preload is None:
            return None
        if not self._ready.is_set():  # still importing: not worth blocking the daemon's loop for
            return None
        return self.server

    def _failed(self, server: ForkServer, e: ForkServerError) -> None:
        log.warning("%s; starting this one as a new interpreter, and a new fork server", e)
        self.server = None
        server.close()
        self.start()

    def state(self) -> str:
        """``up (pid N)``, ``starting``, or why there is none (``reactor status`` and ``ping`` say it)."""
        if self.preload is None:
            return f"off: {self.why_not}"
        if not self._ready.is_set():
            return "starting"
        server = self.server
        if server is not None and server.alive and server.proc is not None:
            return f"up (pid {server.proc.pid})"
        return f"off: {self.why_not or 'it ended'}"

    def close(self) -> None:
        self.closed = True
        for server in (self._launched, self.server):
            if server is not None:
                server.close()


def _kill_child(msg: dict[str, Any]) -> None:
    """Kill the child a spawn answer names, if it names one (a request whose caller is gone)."""
    if "pid" in msg:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(msg["pid"]), signal.SIGKILL)


def _kill_answered(answer: Future[dict[str, Any]]) -> None:
    """:func:`_kill_child` of a request's answer, once it comes (its caller gave up waiting)."""
    if not answer.cancelled() and answer.exception() is None:
        _kill_child(answer.result())


# ------------------------------------------------------------------------------ the server


def _set_death_signal(sig: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG


def _set_title(title: str) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, title.encode()[:15] + b"\0")  # PR_SET_NAME


def _child(req: dict[str, Any], close_fds: Sequence[int], parent: int) -> None:
    """In the forked child of server ``parent``: become the requested process; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for fd in close_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if req["session"]:
            os.setsid()
        _set_title(req["title"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if req["log"] is not None:  # else the server's own stdout and stderr: its starter's
            out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.close(out)
        os.chdir(req["cwd"])
        # Python's path as a new interpreter's `-m` in that directory would have it: the server's first
        # entry was the directory it started in (a daemon's: wherever `reactor daemon` was typed), which
        # came first on every worker's path, so a stale module there shadowed the one shipped beside the
        # app (--with) and any installed one, and a worker found modules no new interpreter would.
        if sys.path:
            sys.path[0] = os.getcwd()
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ["REACTOR_PARENT_PID"] = str(parent)  # (this server: a worker watches it, _die_with_parent)
        sys.argv = list(req["argv"])
        sys.stdin = io.TextIOWrapper(io.BytesIO(req["stdin"].encode()))
        # closefd=False: the streams this replaces close nothing as they go, nor do these in a child of
        # this child (a daemon's job forks its run's server from itself, and that server its workers: with
        # closefd=True, the job's sys.stdout, dropped here, closed the worker's fd 1 and 2 under it).
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0, closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0, closefd=False), write_through=True)
        module, func = ENTRIES[req["entry"]].split(":")
        try:
            code = getattr(importlib.import_module(module), func)()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0)


def _serve(preload: list[str], req_fd: int, ev_fd: int) -> None:
    _set_death_signal(signal.SIGKILL)
    if os.getppid() == 1:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ok, failed = [], {}
    for name in preload:
        try:
            importlib.import_module(name)
            ok.append(name)
        except Exception as e:  # noqa: BLE001 - a preload that fails is reported, not fatal
            failed[name] = f"{type(e).__name__}: {e}"
    events = os.fdopen(ev_fd, "wb", buffering=0)

    def say(obj: dict[str, Any]) -> None:
        events.write(json.dumps(obj).encode() + b"\n")

    # What a process this server forks has imported already (the module under its own name: this one runs
    # as __main__): a daemon's job forks its run's server from itself (launch_early), not a new interpreter.
    importlib.import_module(__spec__.name if __spec__ is not None else __name__)._served_preload = tuple(ok)
    say({"ready": ok, "failed": failed, "threads": len(os.listdir("/proc/self/task"))})
    buf = b""

    def on_request(loop_fds: Sequence[int]) -> bool:
        nonlocal buf
        chunk = os.read(req_fd, 1 << 20)
        if not chunk:  # the daemon is gone
            return False
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = None
            try:
                req = json.loads(line)
                if req.get("entry") not in ENTRIES:
                    raise ValueError(f"no entry {req.get('entry')!r}")
            except (ValueError, AttributeError) as e:
                say({"id": req.get("id", -1) if isinstance(req, dict) else -1, "error": str(e)})
                continue
            try:
                server = os.getpid()
                pid = os.fork()
            except OSError as e:
                say({"id": req["id"], "error": f"fork failed: {e}"})
                continue
            if pid == 0:
                _child(req, (req_fd, ev_fd, *loop_fds), server)
            say({"id": req["id"], "pid": pid})
        return True

    fork_loop(req_fd, on_request, lambda pid, rc: say({"exit": pid, "rc": rc}))


def fork_loop(fd: int, on_request: Callable[[Sequence[int]], bool], on_exit: Callable[[int, int], None]) -> None:
    """The loop of a single-threaded fork server: wait until ``fd`` is readable or a child has ended
    (SIGCHLD wakes it through a pipe); call ``on_request(loop_fds)`` when ``fd`` is readable (it forks;
    a child closes ``loop_fds``, the loop's own; False: return), and ``on_exit(pid, rc)`` for every
    child reaped (``rc`` as ``Popen.returncode``: minus the signal's number when a signal ended it)."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    loop_fds = (wake_r, wake_w, sel.fileno())
    while True:
        for key, _ in sel.select():
            if key.fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            elif not on_request(loop_fds):
                return
        while True:  # reap every child that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            on_exit(pid, os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))


# ---------------------------------------------------------------------------- a server started early

_early: ForkServer | None = None
#: What this process imported as a fork server, set in the server (:func:`_serve`) and so in every process
#: it forks: empty in any other process.
_served_preload: tuple[str, ...] = ()


def launch_early() -> None:
    """Start a run's fork server now (``reactor run`` does, before it imports the app), so that its
    imports overlap the command's own; the run's local workers take it (:func:`take_early`). From the
    thread that will run the run (the server dies with it). Off with ``REACTOR_FORK_SERVER=0``. It
    preloads :data:`TRAINING_PRELOAD`: the app is not known yet, and training is what the command runs
    most; its extra second is hidden behind the command's own imports."""
    global _early
    if _early is not None or os.environ.get("REACTOR_FORK_SERVER", "1") == "0":
        return
    server = ForkServer(TRAINING_PRELOAD)
    try:
        if _served_preload and _threads() == 1:
            # This process is a fork of a server that has imported them (a daemon's job: its coordinator):
            # its run's server is a fork of it, up at once, where a new interpreter took 2.8 s to import
            # torch again. It is still the run's own (the job's process, session and directory), not the
            # daemon's server, which forks every job's: what one run's workers do leaves no trace in another's.
            server.launch_forked()
            log.info("the run's fork server is a fork of this process (pid %d): %s imported already",
                     server.proc.pid if server.proc else -1, ", ".join(_served_preload))
        else:
            server.launch()
    except OSError as e:
        log.warning("no fork server started early (%s)", e)
        return
    _early = server


def _threads() -> int:
    """This process's threads (Python's and any other), or 0 where /proc cannot say."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def take_early() -> ForkServer | None:
    """The server :func:`launch_early` started, if any and still alive (it is the taker's now)."""
    global _early
    server, _early = _early, None
    if server is not None and server.proc is not None and server.proc.poll() is not None:
        server.close()
        return None
    return server


def close_early() -> None:
    """Close a server started early that no run took (the command ended before its run started)."""
    server = take_early()
    if server is not None:
        server.close()


# ------------------------------------------------------------------ a server kept for the process's next runs
#
# A process that runs several multi-process runs on its host (a sweep or a notebook through the Python
# API, a test session) would otherwise start a fork server per run and wait for its imports each time
# (torch, the nodes: 4-7 s of CPU and 2-4 s before the first worker on a 2-core machine). The process
# keeps the server of its first such run for the next ones. A kept server is used again only while
# what it started with still holds: this process (a fork forgets it), the same working directory (the
# server's sys.path[0], as a new interpreter's would be) and the same files behind stdout and stderr
# (the workers write where the server's point; pytest's capfd, for one, points them elsewhere).
# Otherwise, or once it has died, a new one starts and is kept instead. Like a daemon's server, it
# imported its modules under the environment of the run that started it; each worker gets its own
# run's environment. Only the main thread starts a kept server: the server dies with the thread that
# started it (its parent-death signal), and only the main thread lives as long as the process. A run
# driven from another thread uses the kept server if one fits, else a server of its own that it stops
# at its end (``run()`` in a notebook starts the kept one from the caller's thread first).

_kept: tuple[ForkServer, tuple[Any, ...]] | None = None
_kept_lock = threading.Lock()


def _fd_file(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def workers_here(placement: Any, hosts: Any) -> bool:
    """Whether a run's workers start on this host (a multi-process placement, no hosts named by a
    hosts file or a placement file's ``[hosts]`` table): what ``reactor run``'s early server and a
    notebook's kept server are for."""
    if placement == "single" or hosts is not None:
        return False
    path = Path(str(placement))
    if not path.is_file():
        return True  # a distribution policy by name ("actors", "processes", ...)
    import tomllib

    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False  # the run itself names what is wrong with the file; no server for it
    return "hosts" not in data  # [hosts], [hosts.NAME] or an inline table alike


def over_hosts(placement: Any, hosts: Any) -> bool:
    """Whether a run goes over hosts: a hosts file, or a placement file naming hosts (its ``[hosts]``
    table). (Not the same as ``not workers_here``: a ``single`` run starts no workers anywhere.)"""
    return hosts is not None or (placement != "single" and not workers_here(placement, None))


def preload_for(graph: Any) -> Sequence[str]:
    """What a run's server preloads: a graph with a learner also imports what a learner and Metrics
    import at startup."""
    training = any(n.reactor_type.placement_role == "learner" for n in graph.nodes.values())
    return TRAINING_PRELOAD if training else DEFAULT_PRELOAD


def kept_or_new(preload: Sequence[str]) -> tuple[ForkServer, bool]:
    """A launched fork server for a run on this host that imports at least ``preload``, and whether
    the run owns it (stops it at its end) or it is this process's kept server (the run lets it go
    with :func:`release_kept`). Raises ``OSError`` when no server could be launched."""
    global _kept
    key = (os.getpid(), os.getcwd(), _fd_file(1), _fd_file(2))
    with _kept_lock:
        if _kept is not None:
            server, was = _kept
            if server.alive and was == key and set(preload) <= set(server.preload):
                server.users += 1
                return server, False
        if threading.current_thread() is not threading.main_thread():
            server = ForkServer(preload)
            server.launch()
            return server, True
        if _kept is not None:
            server, _ = _kept
            _kept = None
            preload = list(dict.fromkeys([*server.preload, *preload]))  # the next run may need either
            server.retired = True
            if server.users == 0:
                server.close()  # (else by the last run using it: another thread's, say)
        server = ForkServer(preload)
        server.launch()
        server.users = 1
        _kept = (server, key)
        global _atexit_set
        if not _atexit_set:
            import atexit

            atexit.register(close_kept)
            _atexit_set = True
        return server, False


def release_kept(server: ForkServer) -> None:
    """A run is done with the kept server ``kept_or_new`` gave it: one that was replaced meanwhile
    is stopped once no run uses it."""
    with _kept_lock:
        server.users = max(0, server.users - 1)
        last = server.retired and server.users == 0
    if last:
        server.close()


_atexit_set = False


def close_kept() -> None:
    """Stop the kept server (at exit; the runs it served reaped their workers)."""
    global _kept
    with _kept_lock:
        kept, _kept = _kept, None
    if kept is not None:
        kept[0].close()


def _forget_kept_in_a_fork() -> None:
    """In a fork of this process: the parent's kept server and lock are not the child's."""
    global _kept, _kept_lock
    _kept, _kept_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_kept_in_a_fork)
