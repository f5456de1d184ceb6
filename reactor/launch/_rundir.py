"""The private runtime directory of a multi-process run, and the sweep of those left by dead runs.

A coordinator keeps its run's ipc sockets (its own, each worker's, the shards' read servers) in one
directory of mode 0700 under ``$REACTOR_RUNTIME_DIR`` (default: the system's temporary directory),
named ``reactor-<random>``. It writes ``owner.json`` there first: its pid, the pid's start
time and its pid namespace, so a later process can tell a live run's directory from one whose
coordinator was killed (SIGKILL runs no cleanup). Every coordinator sweeps at start: directories of
dead owners are removed, with the shared-memory segments whose owners are dead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._files import read_small_json
from ..transport._shm import cleanup_stale, owner_alive, process_identity

__all__ = ["open_run_dir", "remove_run_dir", "remove_run_files", "rendezvous_file", "runtime_base", "sweep_stale"]

log = logging.getLogger("reactor.launch")
PREFIX = "reactor-"
OWNER_FILE = "owner.json"


def runtime_base() -> Path:
    """Where run directories go: ``$REACTOR_RUNTIME_DIR``, else the system's temporary directory."""
    return Path(os.environ.get("REACTOR_RUNTIME_DIR") or tempfile.gettempdir())


def rendezvous_file(run_dir: str | os.PathLike[str] | None, run_id: str) -> Path:
    """Where the data-parallel learners of run ``run_id`` on one host meet (torch's ``FileStore``): a file
    in their run directory (relative to the working directory their processes share)."""
    return Path(run_dir or ".").resolve() / f".dist-{run_id}"


def open_run_dir(run_id: str, remove: Sequence[Path] = ()) -> Path:
    """Make this run's private directory (mode 0700) and record this process as its owner, and ``remove``:
    files the run makes elsewhere that outlive no run (a data-parallel bank's rendezvous file). Its owner
    removes them at the run's end; a sweep removes them with the directory of an owner that died.

    Raises:
        OSError: the base directory cannot be written.
    """
    base = runtime_base()
    base.mkdir(parents=True, exist_ok=True)
    # ipc paths are limited to 107 bytes: the name stays short (the run id is in the owner record).
    path = base / f"{PREFIX}{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    pid, start, ns = process_identity()
    tmp = path / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps({"pid": pid, "start_time": start, "pid_ns": ns, "run_id": run_id,
                               "remove": [str(f) for f in remove]}))
    tmp.rename(path / OWNER_FILE)
    return path


def remove_run_dir(path: Path) -> None:
    """Remove a run directory and everything in it (its sockets); missing is fine."""
    shutil.rmtree(path, ignore_errors=True)


def remove_run_files(paths: Any) -> None:
    """Remove what an owner record lists to remove (``open_run_dir``'s ``remove``): regular files only,
    never through a link; missing is fine."""
    for p in paths if type(paths) is list else ():
        with contextlib.suppress(OSError, TypeError, ValueError):
            if stat.S_ISREG(os.lstat(p).st_mode):
                os.unlink(p)
                log.warning("removed %s, left by a run whose coordinator died", p)


def sweep_stale(base: Path | None = None) -> list[str]:
    """Remove the run directories under ``base`` whose owner process is dead, and every shared-memory
    segment of this package whose owner is dead. Directories of live runs, of other users, and
    without a readable owner record are left alone. Returns what was removed (paths and segment
    names), logged: a line per directory, one for all the segments (each named at debug level)."""
    base = runtime_base() if base is None else base
    removed: list[str] = []
    uid = os.getuid()
    try:
        entries = list(os.scandir(base))
    except OSError:
        entries = []
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            owner = read_small_json(Path(entry.path) / OWNER_FILE, 1 << 16)
            pid, start, ns = (owner[k] for k in ("pid", "start_time", "pid_ns"))
            if not (all(type(v) is int for v in (pid, start, ns)) and 0 < pid < 2**31 and 0 <= start < 2**63
                    and 0 <= ns < 2**63):
                raise ValueError("not an owner record")
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, not a run directory, or its owner is still writing it
        if owner_alive(pid, start, ns):
            continue
        remove_run_files(owner.get("remove"))
        remove_run_dir(Path(entry.path))
        removed.append(entry.path)
        log.warning("removed the run directory %s of a dead coordinator (pid %d)", entry.path, pid)
    segments = cleanup_stale()
    if segments:  # (one line: a dead shard's ten segments were ten warnings at an unrelated run's start)
        removed += segments
        log.warning("removed %d shared-memory segment%s of dead owners: %s%s", len(segments),
                    "s" if len(segments) > 1 else "", ", ".join(segments[:3]), ", ..." if len(segments) > 3 else "")
        log.debug("the segments removed: %s", ", ".join(segments))
    return removed
