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
import sys
import time
from collections.abc import Iterator

__all__ = ["HELD_S", "received", "stop_signals"]

#: A loop that has not ticked for this long is held by a reaction that does not return.
HELD_S = 2.0
_TICK_S = 0.25

log = logging.getLogger("reactor")
#: The signals the latest block received, in order.
received: list[int] = []


@contextlib.contextmanager
def stop_signals(*, watch_held: bool = True) -> Iterator[asyncio.Event]:
    """Within the block, SIGINT and SIGTERM set the event yielded (where the running loop can take
    signal handlers: the main thread of a Unix process); a second one cancels the task that
    entered the block. The handlers go when it ends. ``watch_held``: where reactions run on this
    loop (a run in one process; not the coordinator), a reaction that holds it is stopped at the
    second signal."""
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

    # A reaction that never returns (an env whose episodes never end, in an evaluation) holds the loop:
    # its handler above never runs, and Ctrl-C and SIGTERM did nothing (only SIGKILL stopped the run).
    # The loop's ticks say when it is held; the signals' Python-level handler, which runs between the
    # held reaction's bytecodes, then says so at the first and stops the run at once at the second.
    ticked = [time.monotonic()]
    ticker: list[asyncio.TimerHandle] = []

    def tick() -> None:
        ticked[0] = time.monotonic()
        ticker[:] = [loop.call_later(_TICK_S, tick)]

    held: list[int] = []

    def on_held_signal(sig: int, frame: object) -> None:
        if time.monotonic() - ticked[0] < HELD_S or len(received) >= 2:
            return  # the loop takes it (on_signal, through its wakeup fd), or it stops at once already
        held.append(sig)
        if len(held) == 1:  # (the loop's handler counts it too, if the loop comes back: a clean stop)
            print(f"{signal.Signals(sig).name}: the run is held in a reaction that has not returned for "
                  f"{time.monotonic() - ticked[0]:.0f} s (an env step or an episode that never ends?): again to stop at "
                  f"once", file=sys.stderr, flush=True)
        else:
            received[:] = [held[0], sig]
            raise KeyboardInterrupt

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
            if watch_held:
                signal.signal(sig, on_held_signal)  # (after the loop's: the wakeup fd stays the loop's)
    if installed and watch_held:
        tick()
    try:
        yield signalled
    finally:
        for h in ticker:
            h.cancel()
        for sig in installed:
            loop.remove_signal_handler(sig)
