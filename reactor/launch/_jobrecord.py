"""A daemon's job records on disk (``STATE/jobs/ID/``): the record itself (``job.json``, :class:`_Job`) and
its checks, the exit status a job's command writes as it ends (``exit.json``), what its coordinator writes
for ``status`` (``groups.json``, ``workers.json``), and the state directory's lock. Everything here reads
files a job (or a hand) can write: a record that is not what the daemon writes is a problem named, never
an exception in the daemon's loop."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from .._files import open_regular, read_small_json, replace_small
from ..transport._shm import owner_alive
from ._hosting import Proc

#: Where a job's command writes its exit status as it ends (``STATE/jobs/ID/``): the daemon that watches it
#: may not be its parent (a daemon started again after a crash adopts its running jobs) and then has no other
#: way to know it; every such job ended as ``ended``, "its exit status is unknown", however it ended.
EXIT_FILE = "exit.json"
#: The most workers of a job on one host that ``status`` checks (``workers.json``, a file its job writes).
LOCAL_WORKERS_MAX = 4096


#: The ranges of a pid and an exit status as records and answers hold them (a pid of 2**64 - 1 was shown as it came).
PID_MAX = 2**31 - 1
RC_RANGE = (-255, 255)

def _atomic_json(path: Path, obj: Any) -> None:
    replace_small(path, json.dumps(obj, indent=2).encode())  # (never through a link planted at its temporary name)


class _Job:
    def __init__(self, record: dict[str, Any], directory: Path) -> None:
        self.record = record
        self.dir = directory
        self.proc: Proc | None = None
        self.stop_deadline: float | None = None
        self.hurried = False  # (the grace passed: the second SIGTERM was sent, SIGKILL at the new deadline)
        self.unsaved = False  # its record changed and could not be written yet (Daemon._save)

    @property
    def id(self) -> str:
        return str(self.record["id"])

    def save(self) -> None:
        _atomic_json(self.dir / "job.json", self.record)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        pid, start = self.record.get("pid"), self.record.get("pid_start")
        # Without its start time a pid may be anyone's now: a record that lacks one (edited, or
        # /proc unreadable at the job's start) counts as dead, never as a process to signal.
        return bool(pid) and bool(start) and owner_alive(int(pid), int(start), 0)


class _StateLock:
    """An exclusive ``flock`` on ``STATE/daemon.lock``, held until :meth:`release` (or this object goes:
    a daemon object dropped without serving, in a test), or the process ends, however it ends."""

    def __init__(self, state: Path) -> None:
        import fcntl

        path = state / "daemon.lock"
        odd = ValueError(f"{path} is not a regular file: remove it (the daemon makes its lock there)")
        try:  # (O_NONBLOCK: a FIFO there is refused, not waited on; O_NOFOLLOW: a link is refused)
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            if e.errno in (errno.ENXIO, errno.ELOOP):  # a FIFO with no reader, a symbolic link
                raise odd from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(self.fd).st_mode):
                self.release()
                raise odd
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            who = ""
            with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
                held = read_small_json(state / "daemon.json")
                who = f" ({str(held.get('name'))[:64]!r}, pid {int(held.get('pid'))}, on {str(held.get('address'))[:100]})"
            raise ValueError(f"--state-dir {state} is in use by another daemon{who}: give each daemon a state "
                             f"directory of its own") from None

    def release(self) -> None:
        if getattr(self, "fd", -1) >= 0:  # (not if os.open failed in __init__)
            os.close(self.fd)
            self.fd = -1

    __del__ = release


def _number(v: Any) -> float:
    """A record's time for ordering: a job.json edited by hand may hold anything there (what is not
    a finite number orders first)."""
    if type(v) not in (int, float):
        return 0.0
    try:
        f = float(v)
    except OverflowError:
        return 0.0
    return f if math.isfinite(f) else 0.0


def record_job_exit(path: str | os.PathLike[str], returncode: int) -> None:
    """A job's command, as it ends: write its exit status and pid at ``path`` (its ``EXIT_FILE``), whole
    or not at all; a failure to write is no failure of the job (its daemon then says it is unknown)."""
    with contextlib.suppress(OSError):
        replace_small(path, json.dumps({"returncode": returncode, "pid": os.getpid()}).encode())


def _recorded_exit(job: _Job) -> int | None:
    """The exit status ``job``'s command wrote as it ended (:func:`record_job_exit`), or None: none
    written (killed by a signal, a full disk), not its process's, or not an exit status."""
    try:
        got = read_small_json(job.dir / EXIT_FILE)
    except (OSError, ValueError):
        return None
    if type(got) is not dict or got.get("pid") != job.record.get("pid"):
        return None
    rc = got.get("returncode")
    return rc if type(rc) is int and RC_RANGE[0] <= rc <= RC_RANGE[1] else None


def _ended_record(path: Path) -> bool:
    """Whether ``path`` is a readable record of an ended job (one the daemon forgot)."""
    try:
        record = read_small_json(path)  # (a FIFO there would hold the daemon's loop)
    except (OSError, ValueError):
        return False
    return type(record) is dict and record.get("state") not in (None, "running")


_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,), "state": (str,), "app": (str,), "placement": (str,), "pid": (int,), "submitted_at": (int, float),
}
_RECORD_OPTIONAL: dict[str, tuple[type, ...]] = {
    "pid_start": (int,), "ended_at": (int, float, type(None)), "returncode": (int, type(None)), "detail": (str,),
}


def fields_problem(d: dict[str, Any], required: dict[str, tuple[type, ...]], optional: dict[str, tuple[type, ...]],
                   what: str = "it") -> str | None:
    """What is wrong with ``d`` (None: nothing), a dict that must hold the fields of ``required`` and may hold
    those of ``optional``, each of one of its types (``type(v) in types``: a bool is no int), a float finite:
    a job record read from disk here, a daemon's answer in the command line (``cli._jobs``). ``what`` names
    ``d`` in the reason ("it": "its pid is str, not int")."""
    whose = "its" if what == "it" else f"{what}'s"
    for table, needed in ((required, True), (optional, False)):
        for name, types in table.items():
            if name not in d:
                if needed:
                    return f"{what} has no {name}"
                continue
            v = d[name]
            if type(v) not in types:
                return f"{whose} {name} is {type(v).__name__}, not {' or '.join(t.__name__ for t in types)}"
            if type(v) is float and not math.isfinite(v):
                return f"{whose} {name} is {v}"
    return None


def _record_problem(record: Any, job_id: str) -> str | None:
    """What is wrong with a job record read from disk (None: nothing): its id must be its directory's
    name, and the fields ``status`` shows and ``watch`` signals by must have their types and ranges."""
    if type(record) is not dict:
        return "it is not a JSON object"
    if record.get("id") != job_id:
        return "its id is not its directory's name"
    if (why := fields_problem(record, _RECORD_TYPES, _RECORD_OPTIONAL)) is not None:
        return why
    if not 0 < record["pid"] <= PID_MAX or not 0 <= record.get("pid_start", 0) < 2**63:
        return "its pid or start time is out of range"
    return None


def _job_groups(jdir: Path) -> dict[str, Any]:
    """A job over hosts: its run id and where each group runs (``groups.json``, written by the job's
    coordinator), for ``reactor status`` and ``reactor logs JOB GROUP``; {} for a job on one host, or
    for a file that is not what a coordinator writes."""
    try:
        got = read_small_json(jdir / "groups.json")
    except (OSError, ValueError):
        return {}
    groups = got.get("groups") if type(got) is dict else None
    if type(groups) is not dict or not all(
            type(g) is str and type(w) is dict and type(w.get("host")) is str for g, w in groups.items()):
        return {}
    return {"run": got.get("run") if type(got.get("run")) is str else None, "groups": groups}


def _local_workers(jdir: Path) -> dict[str, Any]:
    """A running job on this host alone: its workers (``workers.json``, written by its coordinator as it
    starts each), each group's pid, whether it is alive (its pid with its start time: a reused pid is not
    it) and its restarts, for ``reactor status``; {} for a job over hosts (its groups say where they run),
    before its first worker, or for a file that is not what a coordinator writes."""
    try:
        got = read_small_json(jdir / "workers.json")
    except (OSError, ValueError):
        return {}
    workers = got.get("workers") if type(got) is dict else None
    if type(workers) is not dict or len(workers) > LOCAL_WORKERS_MAX or not all(
            type(g) is str and type(w) is dict and type(w.get("pid")) is int and type(w.get("start")) is int
            and type(w.get("restarts")) is int and 0 < w["pid"] <= PID_MAX and 0 <= w["start"] < 2**63
            for g, w in workers.items()):
        return {}
    return {"workers": [{"group": g, "pid": w["pid"], "restarts": w["restarts"],
                         "state": "running" if w["start"] and owner_alive(w["pid"], w["start"], 0) else "ended"}
                        for g, w in sorted(workers.items())]}


#: Free bytes under which the disk of a failed job's directory counts as full (``full_disk_note``).
FULL_DISK_BYTES = 1 << 20


def full_disk_note(directory: Path) -> str:
    """What ``status`` says of a job that failed while the disk of its directory was full, or "": such a
    job's error could not be written to its ``output.log`` (found empty by a hostile probe, its failure
    said nowhere). Free bytes under :data:`FULL_DISK_BYTES`, or no free inode, count as full; a disk
    that cannot be asked is not said to be full."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= FULL_DISK_BYTES and not (st.f_files and st.f_favail == 0):
        return ""
    what = f"{free} bytes free" if free < FULL_DISK_BYTES else "no inode free"
    return (f"the disk of its directory {directory} was full as it ended ({what}): its output and the files it "
            f"wrote last may be cut short or missing, its error with them; free space there")


def _last_line(path: Path) -> str:
    try:
        with os.fdopen(open_regular(path), "rb") as f:  # (a FIFO there, made by a job, is not waited on)
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except (OSError, ValueError):
        return ""
    return lines[-1][:300] if lines else ""
