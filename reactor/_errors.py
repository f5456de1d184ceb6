"""The error taxonomy shared by every layer.

Kept small on purpose (trio): each class answers one question a caller has to act on.
"""

from __future__ import annotations


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


__all__ = [
    "DaemonError",
    "FrameTooLargeError",
    "GraphError",
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
