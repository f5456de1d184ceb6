"""Ctrl-C and SIGTERM as an event a run can wait for (the single-process loop and the coordinator)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

__all__ = ["stop_signals"]


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """Within the block, SIGINT and SIGTERM set the event yielded (where the running loop can take
    signal handlers: the main thread of a Unix process); the handlers go when it ends."""
    loop = asyncio.get_running_loop()
    signalled = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, signalled.set)
            installed.append(sig)
    try:
        yield signalled
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
