"""The host memory replay tables claim, counted over every table of a process or of a run on a host.

A table's rows are filled lazily (its ring is mapped, and pages come as steps are written), so the
memory the host has available when a table is made says nothing of the tables made just before it:
each of a run's shards on one host passed its own check, and together they did not fit, to be ended
by the OOM killer hours later. So every table *claims* what it needs once full (``MemAvailable`` and
free swap, or the memory cgroup's limit: ``available_host_bytes``), in a ledger:

- ``ledger=None``, the tables of this process (a library's): a table must fit in what is available now
  beside what the other live tables of the process have not filled yet (each claim says how much of
  it is filled: ``MemoryClaim.filled``, the table's rows written so far and its sampling state).
- ``ledger=<run id>``, the replay shards of one run on this host, in whichever of its processes: a
  file under the runtime directory (``$REACTOR_RUNTIME_DIR``, else the system's temporary one) holds the
  claims, each with its process's pid and start time, changed only under an exclusive ``flock``. A
  shard must fit alone in what is available now, and with the run's other live claims in what was
  available when the first of them was made (the ledger's *baseline*: the run's shards start together,
  before any has filled anything; a process's fill cannot be read from another). The claims of
  processes that died are dropped at the next claim (a restarted shard's predecessor), the file goes
  with the last claim, and a claim removes the files of other runs whose processes all died (a worker
  that ends with ``os._exit``, or is killed, gives nothing back). A shard claims *before* it allocates
  anything: its shared memory is reserved when made, and would count twice (in the claim, and gone from
  what is available).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._hostmemory import available_host_bytes

__all__ = ["MemoryClaim", "claim_host_memory"]

_GiB = 2**30
_ids = itertools.count()
_lock = threading.Lock()  # the process ledger's (and this process's use of the files)
_live: dict[int, MemoryClaim] = {}  # the process ledger: claim id -> claim
_deferred: list[tuple[str | None, Any]] = []  # claims released, to give back under _lock (MemoryClaim.release)
_LEDGER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class MemoryClaim:
    """Host memory a table holds in its ledger; :meth:`release` gives it back (idempotent).

    Attributes:
        nbytes: what the table needs once full.
        filled: how much of it is in use already (a process ledger's claim: the table sets it, a
            function of no arguments; None: nothing yet).
    """

    __slots__ = ("_key", "_ledger", "filled", "nbytes")

    def __init__(self, nbytes: int, ledger: str | None, key: Any) -> None:
        self.nbytes = nbytes
        self.filled: Callable[[], int] | None = None
        self._ledger = ledger
        self._key = key

    def unfilled(self) -> int:
        """What the table may still take of the host's memory."""
        try:
            done = self.filled() if self.filled is not None else 0
        except Exception:  # noqa: BLE001 - (a table gone meanwhile: its claim is being released)
            done = 0
        return max(0, self.nbytes - done)

    def release(self) -> None:
        """Give the claim back. Safe from a finalizer: where this thread is inside a claim already (a
        collection ran a table's finalizer there), it is given back at the next claim or release."""
        key, self._key = self._key, None
        if key is None:
            return
        _deferred.append((self._ledger, key))
        if _lock.acquire(blocking=False):
            try:
                _release_deferred()
            finally:
                _lock.release()


def _release_deferred() -> None:
    """Give back the claims released so far (``_lock`` held)."""
    while _deferred:
        ledger, key = _deferred.pop()
        if ledger is None:
            _live.pop(key, None)
            continue
        with contextlib.suppress(OSError), _locked_ledger(ledger) as (claims, _):
            claims.pop(key, None)


def claim_host_memory(nbytes: int, what: str, *, ledger: str | None = None) -> MemoryClaim:
    """Claim ``nbytes`` of host memory for a table, or refuse it.

    Args:
        nbytes: what the table needs once full.
        what: the table and its need, in words, for the refusal ("a replay table of capacity ... needs ...").
        ledger: None for this process's tables, or a run id: the tables of that run on this host.

    Returns:
        The claim; release it when the table goes (``weakref.finalize``).

    Raises:
        ValueError: it does not fit, alone in what is available now or beside the ledger's live claims
            in what was available when the first of them was made (naming both figures and the fix).
    """
    if ledger is not None and not _LEDGER_NAME.match(ledger):
        raise ValueError(f"a memory ledger is named by a run id (letters, digits, '_', '.', '-'), got {ledger!r:.80}")
    avail = available_host_bytes()
    if avail is None:
        return MemoryClaim(nbytes, None, None)
    if nbytes > avail:
        raise ValueError(f"{what}, and this host has {avail / _GiB:.1f} GiB available (MemAvailable and free swap, or its "
                         f"memory cgroup's limit): lower the capacity, or spread it over more shards on more hosts")
    with _lock:
        _release_deferred()
        if ledger is None:
            others = [c.unfilled() for c in _live.values()]
            if others and nbytes + sum(others) > avail:
                raise ValueError(
                    f"{what}, and the {len(others)} other replay table(s) of this process may still fill "
                    f"{sum(others) / _GiB:.1f} GiB of the {avail / _GiB:.1f} GiB this host has available (MemAvailable "
                    f"and free swap, or its memory cgroup's limit): lower the capacity, or drop a table first")
            key: Any = next(_ids)
            claim = _live[key] = MemoryClaim(nbytes, None, key)
            return claim
        pid = os.getpid()
        start = _start_time(pid)
        key = f"{pid}-{start}-{next(_ids)}"
        with _locked_ledger(ledger) as (claims, baseline):
            if not claims:
                baseline[0] = avail
            _check_together(what, nbytes, [int(c[2]) for c in claims.values()], baseline[0], f"of run {ledger}")
            claims[key] = [pid, start, nbytes]
        _sweep(ledger)
        return MemoryClaim(nbytes, ledger, key)


def _sweep(keep: str, most: int = 64) -> None:
    """Remove the ledgers of other runs whose claims all belong to dead processes (a worker that ends with
    ``os._exit``, or is killed, gives nothing back: its run's file stayed). Best effort: a ledger in use
    (its lock held) is passed over, and at most ``most`` are looked at."""
    with contextlib.suppress(OSError):
        for path in sorted(ledger_dir().glob("*.json"))[:most]:
            if path.stem == keep:
                continue
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError, IndexError):
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    with open(fd, closefd=False) as f:
                        claims = json.loads(f.read() or "{}").get("claims", {})
                    if not any(_alive(int(v[0]), int(v[1])) for v in claims.values()) and \
                            os.stat(path).st_ino == os.fstat(fd).st_ino:
                        os.unlink(path)
                finally:
                    os.close(fd)


def _check_together(what: str, nbytes: int, others: list[int], baseline: int, whose: str) -> None:
    if not others or sum(others) + nbytes <= baseline:
        return
    total = sum(others) + nbytes
    raise ValueError(
        f"{what}, and with the {len(others)} other replay table(s) {whose} on this host that is {total / _GiB:.1f} GiB "
        f"in all once they are full, more than the {baseline / _GiB:.1f} GiB this host had available when the first "
        f"was made (MemAvailable and free swap, or its memory cgroup's limit): lower the capacity, or spread the "
        f"shards over more hosts")


def ledger_dir() -> Path:
    """Where the run ledgers' files are: ``$REACTOR_RUNTIME_DIR`` (else the system's temporary directory)
    ``/rx-replay-memory-<uid>``, mode 0700."""
    base = Path(os.environ.get("REACTOR_RUNTIME_DIR") or tempfile.gettempdir())
    return base / f"rx-replay-memory-{os.getuid()}"


@contextlib.contextmanager
def _locked_ledger(ledger: str) -> Any:
    """The live claims of ``ledger`` (``{key: [pid, start time, nbytes]}``) and its baseline (a one-item
    list), under the file's exclusive lock (and ``_lock``, which the caller holds: two descriptors of one
    process would wait for each other's flock), written back after the body, or the file removed once it
    holds none. A body that raises changes nothing."""
    directory = ledger_dir()
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{ledger}.json"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # (its last claim went, and the file with it, while this waited: open it anew)
                continue
            with open(fd, "r+", closefd=False) as f:
                try:
                    state = json.loads(f.read() or "{}")
                    claims = {str(k): v for k, v in state.get("claims", {}).items() if _alive(int(v[0]), int(v[1]))}
                    baseline = [int(state.get("baseline", 0))]
                except (ValueError, TypeError, AttributeError, IndexError):  # (a damaged file: start anew)
                    claims, baseline = {}, [0]
                try:
                    yield claims, baseline
                finally:
                    if not claims:  # (under the lock: a waiter then finds another inode, or none)
                        os.unlink(path)
                    elif sys.exc_info()[0] is None:
                        f.seek(0)
                        f.truncate()
                        f.write(json.dumps({"baseline": baseline[0], "claims": claims}))
                        f.flush()
            return
        finally:
            os.close(fd)


def _start_time(pid: int) -> int:
    """The start time of process ``pid`` (``/proc/PID/stat`` field 22: tells a reused pid), or -1."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return -1


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        if e.errno != errno.EPERM:
            return False
    return _start_time(pid) == start
