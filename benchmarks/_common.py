"""What the benchmark scripts share: argument types that refuse a bad value in one line, the one-line
note for a peer that is not installed, and the end of a child process a benchmark started.

A benchmark's figures go to a reader who checks them, so a bad argument (``--reps 0``, a negative size,
a section or peer name that does not exist) is refused by argparse before anything runs, naming the
option, the value and what it takes; never a traceback from deep in a measurement, never a silent
no-op. A child process (a training run, a peer's server) never outlives the benchmark: on a timeout, an
error or Ctrl-C it is asked to stop (SIGINT), then killed, and reaped before the benchmark's temporary
directories are removed (a child still stopping would write its files into them after the removal).
What the runs a benchmark starts log and print goes to a file (:func:`output_to`), its path printed, so
their lines do not land among the figures; an error that ends the benchmark still reaches the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["interruptible", "names_of", "non_negative_int", "output_to", "peer_missing", "positive_float",
           "positive_int", "stop_process"]


def _int(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects an integer >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expects an integer >= {least}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (repetitions, calls, sizes)."""
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (where 0 means none of something; the option's help says what)."""
    return _int(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expects a number > 0, got {text!r}")
    return value


def names_of(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """argparse type: comma-separated names, each one of ``choices``, at least one; in the order given."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            what = f"unknown {', '.join(map(repr, unknown))}" if unknown else f"no name in {text!r}"
            raise argparse.ArgumentTypeError(f"{what}; choose from {','.join(allowed)} (comma-separated)")
        return names

    return parse


def peer_missing(peer: str, exc: BaseException, fix: str) -> str:
    """The one line a benchmark prints when a peer does not load: what, why in a few words, and how to
    get it (``fix``). The other cases still run."""
    if isinstance(exc, ModuleNotFoundError):
        why = f"not installed (no module {exc.name!r})"
    else:
        why = f"did not load ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
    return f"{peer}: {why}; not compared. {fix}"


def stop_process(proc: subprocess.Popen, *, group: bool, grace_s: float = 15.0) -> Any:  # type: ignore[type-arg]
    """End ``proc`` if it still runs, and reap it: SIGINT (a ``reactor run`` then stops cleanly, its
    processes reaped and its shared memory removed; a second SIGINT, as after a Ctrl-C that reached it
    too, stops it at once with the same cleanup), ``grace_s`` to exit, then SIGKILL. A child whose
    output is a pipe is read meanwhile (a full pipe would hold it up).

    Args:
        proc: the child.
        group: the child leads a process group of its own (``start_new_session=True``): signal the
            whole group, so its own children go too.
        grace_s: seconds between SIGINT and SIGKILL.

    Returns:
        What the child still wrote to its ``stdout`` pipe, when it has one and it was read here
        (``None`` otherwise).
    """
    out: list[Any] = [None]

    def wait(timeout_s: float) -> None:
        if proc.stdout is not None and not proc.stdout.closed:
            out[0] = proc.communicate(timeout=timeout_s)[0]
        else:
            proc.wait(timeout=timeout_s)

    def send(sig: int) -> bool:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:  # (gone already)
            return False
        return True

    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None or not send(sig):
            break
        try:
            wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        wait(10.0)  # (reaped; the pipe read to its end)
    except (subprocess.TimeoutExpired, ValueError, OSError):  # (a process in uninterruptible sleep)
        pass
    return out[0]


def interruptible(main: Callable[[], Any], name: str, *, stop_s: float | None = None,
                  overdue: Callable[[], None] | None = None) -> None:
    """Run a benchmark's ``main``: a Ctrl-C ends it with one line and exit status 130 (its ``finally``
    blocks ran on the way out: its children stopped, its temporary directories removed), not
    ``KeyboardInterrupt``'s traceback from wherever the measurement was.

    A Ctrl-C whose ``KeyboardInterrupt`` Python raised where it cannot propagate (a ctypes callback:
    llvmlite's object-cache notice while numba compiles a kernel on its first call; a ``__del__``, a
    weakref callback) was printed as "Exception ignored" and dropped, and the benchmark measured on
    (bench_wal, 1 Ctrl-C in 8 beside two busy loops): such a one is raised again in the code the
    callback returns to (:func:`_redeliver_interrupts`). And a compile it cut short leaves llvmlite
    objects half made, whose ``__del__`` fails at the exit ("'PipelineTuningOptions' object has no
    attribute '_as_parameter_'"): after a Ctrl-C, those (llvmlite's and numba's) are not printed.

    With ``stop_s``, a benchmark that has not ended ``stop_s`` seconds after a SIGINT or SIGTERM reached
    it is ended from a thread of its own (:func:`_end_when_overdue`): where each thread was is printed,
    ``overdue`` ends what the benchmark's cleanup did not (its peer's processes), then the same line and
    status. For a peer whose own shutdown can hang (Ray's, one CI run in many), and for a signal that
    came while the main thread was in a C call that never returned to Python.
    """
    if stop_s is not None:
        _end_when_overdue(name, stop_s, overdue)
    hook = sys.unraisablehook
    sys.unraisablehook = _redeliver_interrupts(hook)
    try:
        main()
    except KeyboardInterrupt:
        sys.unraisablehook = _quiet_compiler_leftovers(hook)
        print(f"{name}: interrupted; what it printed above is partial", file=sys.stderr)
        raise SystemExit(130) from None
    except BaseException:
        sys.unraisablehook = hook
        raise
    sys.unraisablehook = hook


#: How long after the watching thread's turn the guard process ends a benchmark whose interpreter is held.
_GUARD_GRACE_S = 3.0


def _end_when_overdue(name: str, stop_s: float, overdue: Callable[[], None] | None) -> None:
    """A thread that ends this process ``stop_s`` seconds after a SIGINT or SIGTERM, unless it ended;
    and, should that thread not get to run, a guard process that ends it a few seconds later.

    The signal is heard through Python's wakeup descriptor, which the C-level handler writes as the
    signal arrives: the clock starts even when the main thread is in a C call and its Python handler
    (``KeyboardInterrupt``) has not run. The guard (forked here, before the benchmark starts anything)
    reads that descriptor and tells the thread. The thread is a daemon, so an exit in time ends it with
    the process; it keeps watching through ``atexit`` (Ray shuts down there too). Overdue: every thread's
    stack on stderr (faulthandler: no GIL needed beyond its own), ``overdue()``, the one line, and
    ``os._exit`` with the status the signal gives (130 for SIGINT, the signal's number otherwise, as
    SIGTERM's handlers here exit). Written to fd 2 directly: the main thread may hold ``sys.stderr``'s
    lock. The thread needs the GIL after its sleep: a main thread that holds it in a C call (Ray's peer,
    1 CI run in ~27 after this thread was added, printed nothing in 120 s) keeps it from running. So the
    guard, ``_GUARD_GRACE_S`` later, has the process dump its threads' stacks (faulthandler's SIGUSR2
    handler, which needs no GIL), runs ``overdue()`` itself, says so and SIGKILLs it. The guard ignores
    SIGINT and SIGTERM (a Ctrl-C reaches the whole process group) and leaves when the process has ended.
    A later ``signal.set_wakeup_fd`` in this process (uvloop's, an asyncio loop's) replaces the
    descriptor: a benchmark that runs an event loop in its main thread cannot use ``stop_s``."""
    wake_r, wake_w = os.pipe()  # (the signal handler -> the guard)
    told_r, told_w = os.pipe()  # (the guard -> the thread: which signal)
    parent = os.getpid()
    faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
    guard = os.fork()
    if guard == 0:  # the guard process: only system calls, /proc, and overdue()
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.close(wake_w)
            os.close(told_r)
            _guard(name, parent, stop_s + _GUARD_GRACE_S, wake_r, told_w, overdue)
        finally:
            os._exit(0)
    os.close(wake_r)
    os.close(told_w)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    def watch() -> None:
        got = os.read(told_r, 1)
        if not got:
            return  # (the guard ended: no signal will be told)
        sig = got[0]
        time.sleep(stop_s)
        os.write(2, f"{name}: not ended {stop_s:g} s after signal {sig}; where its threads were:\n".encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
        try:
            if overdue is not None:
                overdue()
        finally:
            os.write(2, f"{name}: interrupted; what it printed above is partial\n".encode())
            os._exit(130 if sig == signal.SIGINT else sig)

    threading.Thread(target=watch, name="end-when-overdue", daemon=True).start()


def _guard(name: str, parent: int, after_s: float, wake_r: int, told_w: int,
           overdue: Callable[[], None] | None) -> None:
    """The guard process of :func:`_end_when_overdue`: waits for SIGINT or SIGTERM to reach ``parent``
    (its wakeup descriptor), tells its thread, and ends ``parent`` if it still runs ``after_s`` later."""
    import select

    sig = 0
    while not sig:
        got = os.read(wake_r, 64)
        if not got:
            return  # (the process ended: the descriptor's last holder closed it)
        sig = next((s for s in got if s in (signal.SIGINT, signal.SIGTERM)), 0)
    os.write(told_w, bytes([sig]))
    deadline = time.monotonic() + after_s
    while (left := deadline - time.monotonic()) > 0:
        if select.select([wake_r], [], [], left)[0] and not os.read(wake_r, 64):
            return  # (it ended in time)
    if os.getppid() != parent:
        return
    os.write(2, f"{name}: not ended {after_s:g} s after signal {sig}, its interpreter held (no thread of its "
                f"own could run); where its threads were:\n".encode())
    os.kill(parent, signal.SIGUSR2)
    time.sleep(1.0)  # (its stacks written by its faulthandler)
    try:
        if overdue is not None:
            overdue()
    finally:
        os.write(2, f"{name}: interrupted; what it printed above is partial\n".encode())
        os.kill(parent, signal.SIGKILL)


def _quiet_compiler_leftovers(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """After a Ctrl-C: an ``sys.unraisablehook`` that drops what fails in llvmlite's or numba's own
    finalizers (objects the interrupt cut mid-construction) and hands anything else to ``hook``."""

    def unraisable(args: Any) -> None:
        where = getattr(args.object, "__module__", None) or ""
        if isinstance(where, str) and where.split(".")[0] in ("llvmlite", "numba"):
            return
        hook(args)

    return unraisable


def _redeliver_interrupts(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A ``sys.unraisablehook`` that has a swallowed ``KeyboardInterrupt`` raised again in the main
    thread, and hands anything else to ``hook``.

    Not from the hook itself: an interrupt it raised would be handled inside it, and dropped as the
    hook's own ("Exception ignored in sys.unraisablehook"). The hook's last call hands it to a thread
    (a C queue), which sends SIGINT to the main thread once the GIL is free: the main thread handles
    it at its next check, after the hook (CPython handles pending signals before it lets another
    thread take the GIL, so one that thread sets meanwhile waits for the next check, and the hook has
    none left), and a wait it is in ends with it (``_thread.interrupt_main`` only set a flag: a sleep or
    a wait for a child ran to its end first). Raised in a callback again (the compiler calls back many
    times), it comes back here.
    """
    swallowed: queue.SimpleQueue[None] = queue.SimpleQueue()
    main = threading.main_thread().ident
    assert main is not None

    def redeliver() -> None:
        while True:
            swallowed.get()
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=redeliver, name="redeliver-ctrl-c", daemon=True).start()

    def unraisable(args: Any) -> None:
        if isinstance(args.exc_value, KeyboardInterrupt):
            swallowed.put(None)
            return
        hook(args)

    return unraisable


@contextlib.contextmanager
def output_to(path: str | os.PathLike[str], tail_lines: int = 30) -> Iterator[None]:
    """Within the block, what the runs log goes to ``path`` (appended) instead of among the figures:
    records of Python's logging in this process (a handler on the root logger; loggers' levels are left
    as they are, so are the levels a run passes to its workers) and whatever is written to this
    process's stdout and stderr, fds 1 and 2 themselves, which child processes (a run's local workers and
    fork server, a peer) inherit: a one-host run's Metrics node prints the run's result lines on its
    stdout. The figures, printed here through ``sys.stdout``, still go where stdout went before the block
    (``sys.stdout`` writes to a copy of fd 1 meanwhile).

    On an exception (Ctrl-C included) fds 1 and 2 are the terminal's again before it propagates, and the
    log's last ``tail_lines`` lines are printed there under its path: the traceback, and what the runs
    said before it, are seen where the benchmark ran.
    """
    handler = logging.FileHandler(path)  # (first: a log that cannot be opened changes nothing)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    stdout = sys.stdout
    sys.stdout = open(saved[0], "w", encoding=stdout.encoding, errors=stdout.errors, buffering=1,
                      closefd=False)
    logging.getLogger().addHandler(handler)
    restored = False
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        yield
    except BaseException:
        _restore(saved, stdout, handler)
        restored = True
        with open(path, "rb") as f:
            tail = f.read().decode(errors="replace").splitlines()[-tail_lines:]
        print(f"the runs' log: {os.fspath(path)}; its last {len(tail)} lines:", *tail, sep="\n", file=sys.stderr,
              flush=True)
        raise
    finally:
        if not restored:
            _restore(saved, stdout, handler)


def _restore(saved: tuple[int, int], stdout: Any, handler: logging.Handler) -> None:
    logging.getLogger().removeHandler(handler)
    handler.close()
    sys.stdout.close()  # (the copy's wrapper, flushed; the copy itself is closed below)
    sys.stdout = stdout
    sys.stderr.flush()
    for fd, copy in zip((1, 2), saved, strict=True):
        os.dup2(copy, fd)
        os.close(copy)
