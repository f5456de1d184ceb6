"""The learner's final update count, handed to the run's summary through ``run_dir/learner.json``.

The learner reports its updates every ``report_every`` (100) of them, and a report sent at shutdown is
not delivered (shutdown outputs are dropped), so the summary ``Metrics`` writes at its shutdown counted
the updates of the last report: a run stopped by ``reactor stop``, a signal or its target said "the run
ended at update 300" while the learner had made 353. The learner writes its count here instead, and
``Metrics`` takes it before it writes the summary.

The learner (replica 0 of its bank) holds an exclusive ``flock`` on the file for its whole life, empties
it at its start (a count there is an ended life's, never a live one's), and writes
``{"run_id", "source", "updates"}`` into it at its shutdown, just before it lets the lock go. ``Metrics``
takes a shared lock on it first: it waits for a learner whose shutdown is under way in another process
(the lock goes when that ends), and never for one that is gone: the lock goes with a process that dies.
Where the learner's shutdown is still to come in Metrics' own process (a graph that adds Metrics before
the learner: shutdown reactions run in graph order, and the builders add the learner first) it cannot
wait, and the summary keeps the reported count; so it does on a file system without ``flock`` when the
learner has not written its count yet, and over hosts when the learner's run directory is not Metrics'.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

END_FILE = "learner.json"
#: How long Metrics waits for a live learner's shutdown (its final checkpoint) to end.
END_WAIT_S = 30.0
_POLL_S = 0.01
_MAX_NBYTES = 4096
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)

_held_here: set[str] = set()  # the files this process's learners hold (their shutdown still to come)


class LearnerEnd:
    """A learner's hold on ``run_dir/learner.json``: taken at its start (the file emptied), its count
    written and the hold let go at its shutdown (:meth:`close`)."""

    def __init__(self, run_dir: str | os.PathLike[str], who: str) -> None:
        self.path = Path(run_dir) / END_FILE
        self.key = os.path.realpath(self.path)
        self.fd: int | None = None
        try:  # (never through a link planted at its name)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            logging.getLogger("reactor.learner").warning(
                "%s: cannot open %s (%s): the run's summary will count the updates it reported", who, self.path,
                e.strerror or e)
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:  # (no flock on this file system, or another life holds it still: written all the same)
            if e.errno == errno.EWOULDBLOCK:
                _held_here.add(self.key)
                return
        with contextlib.suppress(OSError):
            os.ftruncate(self.fd, 0)
        _held_here.add(self.key)

    def write(self, run_id: str, source: str, updates: int) -> None:
        """Write the final count (over what is there). One that cannot be written (a full disk) is said, and
        the summary keeps the reported count: it fails no run."""
        if self.fd is None:
            return
        data = json.dumps({"run_id": run_id, "source": source, "updates": updates}).encode()
        try:
            os.ftruncate(self.fd, 0)
            if os.pwrite(self.fd, data, 0) != len(data):
                raise OSError(errno.ENOSPC, "written in part")
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            logging.getLogger("reactor.learner").warning(
                "%s: cannot write its final count to %s (%s): the run's summary counts the updates it reported",
                source, self.path, e.strerror or e)

    def close(self) -> None:
        """Let the file go (idempotent): Metrics, waiting for it, reads the count now."""
        fd, self.fd = self.fd, None
        if fd is not None:
            _held_here.discard(self.key)
            os.close(fd)  # (closing the descriptor releases its lock)


async def learner_end(run_dir: str | os.PathLike[str], run_id: str, wait: bool, who: str) -> tuple[str, int] | None:
    """The ``(source, updates)`` the run's learner wrote at its end in ``run_dir``, or None: no such file,
    an empty one (the learner is live still, or ended before it had a state), another run's, one that is
    not of this shape, or (``wait`` False) one a live learner holds. With ``wait``, a learner whose
    shutdown is under way in another process is waited for, :data:`END_WAIT_S` at most (said when it
    runs out); never one in this process (its shutdown comes after the caller's)."""
    path = Path(run_dir) / END_FILE
    if os.path.realpath(path) in _held_here:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        deadline = time.monotonic() + END_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno in _NO_FLOCK:
                    break
                if e.errno != errno.EWOULDBLOCK:
                    return None
            if not wait:
                return None
            if time.monotonic() >= deadline:
                logging.getLogger("reactor.metrics").warning(
                    "%s: the learner had not ended %g s after this node's shutdown began: the summary counts the "
                    "updates it reported (its own count is in its last line)", who, END_WAIT_S)
                return None
            await asyncio.sleep(_POLL_S)
        data = os.pread(fd, _MAX_NBYTES, 0)
    finally:
        os.close(fd)
    with contextlib.suppress(ValueError):
        record: Any = json.loads(data)
        if (isinstance(record, dict) and record.get("run_id") == run_id and isinstance(record.get("source"), str)
                and type(record.get("updates")) is int and 0 <= record["updates"] < 2**53):
            return record["source"], record["updates"]
    return None
