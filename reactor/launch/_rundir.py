"""The private runtime directory of a multi-process run, and the sweep of those left by dead runs.

A coordinator keeps its run's ipc sockets (its own, each worker's, the shards' read servers) in one
directory of mode 0700 under ``$REACTOR_RUNTIME_DIR`` (default: the system's temporary directory),
named ``reactor-<random>``. It writes ``owner.json`` there first: its pid, the pid's start
time and its pid namespace, so a later process can tell a live run's directory from one whose
coordinator was killed (SIGKILL runs no cleanup). Every coordinator sweeps at start: directories of
dead owners are removed, with the shared-memory segments whose owners are dead.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from .._files import read_small_json
from ..transport._shm import cleanup_stale, owner_alive, process_identity

__all__ = ["open_run_dir", "remove_run_dir", "runtime_base", "sweep_stale"]

log = logging.getLogger("reactor.launch")
PREFIX = "reactor-"
OWNER_FILE = "owner.json"


def runtime_base() -> Path:
    """Where run directories go: ``$REACTOR_RUNTIME_DIR``, else the system's temporary directory."""
    return Path(os.environ.get("REACTOR_RUNTIME_DIR") or tempfile.gettempdir())


def open_run_dir(run_id: str) -> Path:
    """Make this run's private directory (mode 0700) and record this process as its owner.

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
    tmp.write_text(json.dumps({"pid": pid, "start_time": start, "pid_ns": ns, "run_id": run_id}))
    tmp.rename(path / OWNER_FILE)
    return path


def remove_run_dir(path: Path) -> None:
    """Remove a run directory and everything in it (its sockets); missing is fine."""
    shutil.rmtree(path, ignore_errors=True)


def sweep_stale(base: Path | None = None) -> list[str]:
    """Remove the run directories under ``base`` whose owner process is dead, and every shared-memory
    segment of this package whose owner is dead. Directories of live runs, of other users, and
    without a readable owner record are left alone. Returns what was removed (paths and segment
    names), each also logged."""
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
        remove_run_dir(Path(entry.path))
        removed.append(entry.path)
        log.warning("removed the run directory %s of a dead coordinator (pid %d)", entry.path, pid)
    for name in cleanup_stale():
        removed.append(name)
        log.warning("removed the shared-memory segment %s of a dead owner", name)
    return removed
