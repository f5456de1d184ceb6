"""Ctrl-C and SIGTERM as an event a run can wait for (the single-process loop and the coordinator).

The first SIGINT or SIGTERM asks for a clean stop: the event is set, the run ends its reactors'
shutdown reactions and reaps its processes. A second one stops at once: the task that entered
the block is cancelled, so the run's cleanups (reaping every child, removing its shared memory)
still run but its reactors' shutdown does not. :data:`received` keeps the signals, for the
command's exit status (128 + the first one's number: 130 for Ctrl-C).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

__all__ = ["received", "stop_signals"]

log = logging.getLogger("reactor")
#: The signals the latest block received, in order.
received: list[int] = []


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """Within the block, SIGINT and SIGTERM set the event yielded (where the running loop can take
    signal handlers: the main thread of a Unix process); a second one cancels the task that
    entered the block. The handlers go when it ends."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    signalled = asyncio.Event()
    received.clear()

    def on_signal(sig: int) -> None:
        received.append(sig)
        if not signalled.is_set():
            log.warning("%s: stopping the run cleanly (again to stop at once)", signal.Signals(sig).name)
            signalled.set()
        elif len(received) == 2 and task is not None:
            log.warning("%s again: stopping at once", signal.Signals(sig).name)
            task.cancel()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
    try:
        yield signalled
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
