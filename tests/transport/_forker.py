"""A fork server for the bulk tests' owner processes: ``python -m tests.transport._forker SOCKET_FD``.

Each owner (:mod:`tests.transport._bulk_peer`) started as a new interpreter imports torch, numpy and
the bulk transport anew: ~3.5 s of CPU on a 2-core machine, for ~30 owners in
``tests/transport/test_bulk.py``. This process imports them once and forks each owner from there
(the product's fork server, :mod:`reactor.launch._forkserver`, forks only the runtime's own entries).

It talks to its one client over a ``SOCK_SEQPACKET`` socket pair (one datagram a message, JSON; no
pickle): a request ``{"role", "cfg"}`` carries two file descriptors, the owner's stdin and stdout
(``socket.send_fds``); the answer is ``{"pid": PID}``, and each owner's end is reported as
``{"exit": PID, "rc": CODE}`` (``rc`` as ``Popen.returncode``: minus the signal's number when a signal
ended it); its loop is the product fork server's (:func:`reactor.launch._forkserver.fork_loop`). An owner runs as a new interpreter would: its atexit hooks run when it ends (the
forker's own do not), and it dies with the forker, as the forker dies with its client.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Sequence

from reactor.launch._forkserver import _set_death_signal, fork_loop


def _owner(req: dict, stdin_fd: int, stdout_fd: int, close: list[int]) -> None:
    """The forked child: the owner's role, with the request's pipes as its stdin and stdout; never returns."""
    code = 1
    try:
        _set_death_signal(signal.SIGKILL)
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        atexit._clear()  # the forker's hooks are not the owner's
        os.dup2(stdin_fd, 0)
        os.dup2(stdout_fd, 1)
        os.close(stdin_fd)
        os.close(stdout_fd)
        sys.stdin = io.TextIOWrapper(os.fdopen(0, "rb"))
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb"), write_through=True)
        from tests.transport import _bulk_peer

        _bulk_peer.run(req["role"], req["cfg"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on stderr, as an interpreter would
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # (BulkOwner unlinks the segments of an owner that never closed)
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(sock: socket.socket) -> None:
    from tests.transport import _bulk_peer  # noqa: F401 - the imports every owner would make

    def say(obj: dict) -> None:
        with contextlib.suppress(OSError):
            sock.send(json.dumps(obj).encode())

    def on_request(loop_fds: Sequence[int]) -> bool:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 2)
        if not msg:
            return False  # the client is gone
        req = json.loads(msg)
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            say({"error": f"a request needs 2 file descriptors, got {len(fds)}"})
            return True
        pid = os.fork()
        if pid == 0:
            _owner(req, fds[0], fds[1], [sock.fileno(), *loop_fds])
        for fd in fds:
            os.close(fd)
        say({"pid": pid})
        return True

    fork_loop(sock.fileno(), on_request, lambda pid, rc: say({"exit": pid, "rc": rc}))


if __name__ == "__main__":
    _set_death_signal(signal.SIGKILL)
    serve(socket.socket(fileno=int(sys.argv[1])))
