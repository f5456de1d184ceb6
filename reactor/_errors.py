"""The error taxonomy shared by every layer.

Kept small on purpose (trio): each class answers one question a caller has to act on.
"""

from __future__ import annotations

import os
import sysconfig


class ReactorError(Exception):
    """Base class of every error this package raises on purpose."""


class GraphError(ReactorError):
    """The graph is malformed: a bad connection, a missing input, a cycle, a duplicate name."""


class PortError(ReactorError):
    """A reaction used a port it did not declare, or a port was used wrongly."""


class WouldBlock(ReactorError):
    """An ``*_nowait`` operation could not complete without waiting."""


class PortClosedError(ReactorError):
    """You closed this port, channel or table yourself, and then used it."""


class PeerLostError(ReactorError):
    """The other side failed or went silent; the cause is chained where known."""


class FrameTooLargeError(ReactorError):
    """A frame or message is larger than the configured bound."""


class MalformedFrameError(ReactorError):
    """A frame could not be decoded: truncated, garbage, or of an unregistered type."""


class TraceMismatchError(ReactorError):
    """A replayed run tried to deliver a message the recorded schedule does not allow."""


class WorkerFailedError(ReactorError):
    """A worker process of a multi-process run raised or died; its message or exit status is included."""


class DaemonError(ReactorError):
    """A daemon refused a request, or did not answer; the message says which and why."""


class ReactorInternalError(ReactorError):
    """A bug in reactor itself: please report it with the traceback."""


class LinkStateError(ReactorError, ValueError):
    """An endpoint was asked to use a link it does not have (a send to a peer it is not connected to),
    or to connect a peer it is connected to already: the order of its caller's calls, not a value it
    was given. Raised inside a run, it is reactor's own bug: a failure shown with its traceback, never
    a refusal's one line (``refusal_class``)."""


class AppError(ReactorError):
    """The app file or its configuration is wrong (a one-line message for the command line)."""


#: What refuses a run for what it was given (a setting, a file, a path: its user's to fix), not a
#: failure of the code, when reactor's own code raised it (``raised_by_reactor``): said in one line
#: (``refusal_line``) under every placement. A worker of a
#: multi-process run sends the class's name and that line (``("refused", name, line)``); its
#: coordinator raises the same class, so ``run()`` raises alike wherever the node ran.
REFUSALS: tuple[type[Exception], ...] = (
    AppError, GraphError, MalformedFrameError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
    PermissionError, FileExistsError, ValueError,
)
REFUSAL_NAMES: dict[str, type[Exception]] = {c.__name__: c for c in REFUSALS}
#: The exit status of a process that refused (``reactor run``, a worker that reported a refusal): as
#: systemd's ``RestartPreventExitStatus``, a worker that ends with it is never started again.
REFUSAL_EXIT_STATUS = 2


def refusal_line(e: BaseException) -> str:
    """A refusal's text for its user: a graph's whole list of faults, any other's first line."""
    if isinstance(e, GraphError):
        return str(e).replace("\n", "\n  ")
    return (str(e).splitlines() or [type(e).__name__])[0]


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


def raised_by_reactor(e: BaseException) -> bool:
    """Whether ``e`` was raised by reactor's own code (its innermost frame outside the standard library
    is in this package: ``Path.mkdir`` called by reactor counts as reactor's): a refusal of what it was
    given. One raised in an app's, an algorithm's or an env's code, or in a library they called
    (numpy's "Output array is the wrong shape" from an env's bad observation), is a failure to show
    with its traceback: in one line it named no file and no line."""
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    for path in reversed(frames):
        if path.startswith(_PACKAGE):
            return True
        if "<frozen " in path:  # (os, posixpath, codecs: the standard library's frozen modules)
            continue
        if not path.startswith(_STDLIB) or "site-packages" in path or "dist-packages" in path:
            return False
    return True


def refusal_class(e: BaseException) -> str | None:
    """The name a worker sends for a refusal (its nearest class in ``REFUSALS``, raised by reactor's
    own code), None for a failure."""
    if not raised_by_reactor(e) or isinstance(e, (LinkStateError, ReactorInternalError)):
        return None
    for c in type(e).__mro__:
        if c in REFUSAL_NAMES.values():
            return c.__name__
    return None


__all__ = [
    "AppError",
    "DaemonError",
    "FrameTooLargeError",
    "GraphError",
    "LinkStateError",
    "MalformedFrameError",
    "PeerLostError",
    "PortClosedError",
    "PortError",
    "ReactorError",
    "ReactorInternalError",
    "TraceMismatchError",
    "WorkerFailedError",
    "WouldBlock",
]
