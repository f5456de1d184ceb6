"""How a worker process leaves when it cannot stop cleanly: with its parent (``_die_with_parent``), or a
bound past its failure or SIGTERM (``_leave_after``), waiting a while for a checkpoint it is writing."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

from .._files import remove_cut_writes, writes_in_progress
from ._protocol import FAILED_SAVE_S

#: A worker whose parent (its fork server, or the coordinator) died ends this long after at the latest
#: (``_leave_when_orphaned``).
ORPHAN_GRACE_S = 10.0
#: The parent-death signal (``PR_SET_PDEATHSIG``, ``_die_with_parent``). Its handler is libc's ``alarm``
#: itself, which the kernel calls with the signal's number: SIGALRM, whose default action ends the process,
#: comes that many seconds (12: ``ORPHAN_GRACE_S`` and a margin) after the parent's death, with no Python run.
#: A worker held in one C call that keeps the interpreter's lock runs neither its event loop nor the thread
#: that ends an orphan (``_leave_when_orphaned``): it outlived its killed coordinator for good.
DEATH_SIGNAL = signal.SIGUSR2
assert DEATH_SIGNAL > ORPHAN_GRACE_S + 1  # (the alarm after the orphan's own end, which says why)


def _die_with_parent() -> None:
    """End with the parent: a clean stop (a SIGTERM to itself, from ``_leave_when_orphaned``), bounded by
    ``ORPHAN_GRACE_S`` (that thread) and, should no Python run at all, by ``DEATH_SIGNAL``'s alarm (a
    handler of libc's, set with ``signal(2)``: Python's own handlers run only when the interpreter does).
    Costs two system calls and a thread that wakes twice a second. The parent is the one its starter named
    (``REACTOR_PARENT_PID``: the process that started it, or the fork server that forked it), so a parent that
    died while this one started (an interpreter's imports: seconds) is seen too: ``os.getppid()`` then named
    its new parent, and the watch waited on that one for good."""
    named = os.environ.get("REACTOR_PARENT_PID", "")
    parent = int(named) if named.isdigit() else os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, [ctypes.c_int, ctypes.c_void_p]
            # (alarm(unsigned) as a void (*)(int) handler: one int in, a return value the kernel ignores;
            # alarm is async-signal-safe. SA_RESTART: the signal interrupts no system call of the worker.)
            libc.signal(DEATH_SIGNAL, ctypes.cast(libc.alarm, ctypes.c_void_p))
            libc.prctl(1, DEATH_SIGNAL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # (it died before the signal was set: none will come)
            os._exit(1)
    threading.Thread(target=_leave_when_orphaned, args=(parent,), name="parent-watch", daemon=True).start()


def _leave_when_orphaned(parent: int) -> None:
    """Once the parent is gone, a clean stop: a SIGTERM to itself, whose handler runs on the event loop (the
    parent-death signal itself arms ``DEATH_SIGNAL``'s alarm instead). A reaction that never returns (an env
    step that does not end, a spin) holds that loop: such a worker outlived its killed coordinator for good,
    spinning. So the clean stop gets ``ORPHAN_GRACE_S``; then the process ends, a checkpoint it is writing
    then waited for as a failed worker's is (``_leave_after``: a final checkpoint under Slurm's ``scancel``,
    which ends the daemon's fork server, its parent, with the rest, was cut at 10 s). If this thread cannot
    run (the interpreter held in C), the alarm ends it a moment later."""
    while os.getppid() == parent:
        time.sleep(0.5)
    if signal.alarm(0):  # (the parent-death alarm: this thread runs, so it bounds the end; the alarm stays a
        signal.alarm(int(ORPHAN_GRACE_S + FAILED_SAVE_S) + 2)  # backstop, not 2 s past a late thread's check)
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signal.SIGTERM)
    _leave_after(os.environ.get("REACTOR_WORKER_GROUP", "?"), ORPHAN_GRACE_S, FAILED_SAVE_S, 128 + signal.SIGTERM,
                 since=f"its parent's death (pid {parent})")


def _leave_after(group: str, seconds: float, save_s: float, status: int, since: str = "its failure") -> None:
    """A failed (or SIGTERM'd: ``since``) worker's bound (``_leave_by``): ``seconds`` from now it leaves, its
    shutdown reactions left unfinished, unless it is writing a checkpoint then: it waits for the writes in
    progress, at most ``save_s`` more, and leaves once they end (or removes what they wrote so far, and says
    which)."""
    time.sleep(seconds)
    said = f"reactor worker {group}: its shutdown reactions did not end within {seconds:g} s of {since}"
    writes = writes_in_progress()
    if writes:
        if signal.alarm(0):  # (the parent-death alarm, armed: moved past the wait, or it would end it)
            signal.alarm(int(save_s) + 2)
        with contextlib.suppress(OSError):
            os.write(2, (f"{said}; it is writing {', '.join(map(str, writes))}: it waits for that (at most "
                         f"{save_s:g} s more)\n").encode())
        end = time.monotonic() + save_s
        while writes_in_progress() and time.monotonic() < end:
            time.sleep(0.05)
    cut = remove_cut_writes()
    if cut:
        said += (f"; its write of {', '.join(map(str, cut))} did not end within {save_s:g} s more: cut, and what it "
                 f"wrote so far removed (each file holds what it held before)")
    _leave_now(f"{said}; it leaves without them", status)


def _leave_now(message: str, status: int) -> None:
    """End this process at once from a thread of its own, its event loop held by a reaction: ``message``
    on stderr (written to the descriptor: the held thread may hold ``sys.stderr``'s lock), then ``status``."""
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode())
    os._exit(status)
