"""Which run a run directory belongs to, so that a run never writes over another's files.

``run.json`` in the directory names the run that owns it (its run id), and every process of that run
that writes there (its learner, metrics, actors' progress, replay shards) holds a shared ``flock`` on
``run.lock`` for as long as it does. A node claims the directory first thing at its start:

- the directory's own run (a restarted worker, another process of the run): shared lock, and on;
- another run's, or files a training run leaves with no ``run.json`` (a directory from before it
  existed): taken over only by ``resume=True``, and only once no process of that run holds the lock
  (two live runs in one directory interleaved their metrics and replaced each other's weights);
- an empty or new directory: this run's, unless ``resume=True`` (a mistyped run directory to resume
  trained a fresh network without a word).

Each claim is released at its node's shutdown, and what a run left claimed in its process (a shutdown
cut short: a second Ctrl-C, a notebook's stop button) when it ends (:func:`release_run_claims`); the
lock goes with a process that dies. On a file system without ``flock`` (Lustre mounted without it)
``run.json`` alone says whose the directory is, with a warning: two live runs are not told apart there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ._files import read_small_json, replace_small

__all__ = ["RUN_FILE", "RunDirClaim", "check_resumable", "check_run_dir", "claim_run_dir", "release_run_claims",
           "release_run_dir"]

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
#: Files a training run leaves in its directory (one made before run.json existed has only these).
RUN_FILES = ("learner.pt", "metrics.csv", "config.json", "summary.json", "metrics.counters.json")
#: How long a claim waits for another claimant of its own run (which holds the lock exclusively for
#: the moment it writes run.json) before it counts the lock's holder as another live run.
CLAIM_WAIT_S = 10.0

_claims: dict[str, list[Any]] = {}  # real path -> [descriptor, run id, claims in this process]
_claims_lock = threading.Lock()


class RunDirClaim:
    """A node's claim on its run directory; :meth:`release` at its shutdown (idempotent)."""

    __slots__ = ("key",)

    def __init__(self, key: str | None) -> None:
        self.key = key

    def release(self) -> None:
        key, self.key = self.key, None
        if key is None:
            return
        with _claims_lock:
            held = _claims.get(key)
            if held is None:
                return
            held[2] -= 1
            if held[2] == 0:
                del _claims[key]
                os.close(held[0])  # (closing the descriptor releases its lock)


def _missing(run_dir: str | os.PathLike[str]) -> str:
    directory = Path(run_dir)
    where = "" if directory.is_absolute() else (f" (here: {directory.absolute()}; a run over hosts resumes an absolute "
                                                f"run_dir on a shared file system)")
    return (f"resume=True, but run directory {run_dir} does not exist{where}: is the path right? Without resume=True "
            f"a new run starts there")


def _empty(run_dir: str | os.PathLike[str]) -> str:
    return (f"resume=True, but run directory {run_dir} holds no earlier run (no {RUN_FILE}, learner.pt or "
            f"metrics.csv): is the path right? Without resume=True a new run starts there")


def _taken(run_dir: str | os.PathLike[str], owner: str | None) -> str:
    return (f"run directory {run_dir} holds an earlier run ({owner or 'its files'}); a new run there would overwrite "
            f"its weights and metrics. Resume it (--set resume=True; resume=True in Python), or name a new run_dir")


def release_run_claims(run_id: str) -> None:
    """Release every claim run ``run_id`` still holds in this process (its end, on every path)."""
    with _claims_lock:
        for key in [k for k, held in _claims.items() if held[1] == run_id]:
            with contextlib.suppress(OSError):
                os.close(_claims.pop(key)[0])


def release_run_dir(node: Any) -> None:
    """Release the claim a node keeps as ``_run_claim`` (at its shutdown), if it made one."""
    claim = getattr(node, "_run_claim", None)
    if claim is not None:
        claim.release()


def _owner(directory: Path) -> str | None:
    """The run id ``run.json`` names; None where there is none.

    Raises:
        ValueError: a ``run.json`` that is not one (naming the file).
    """
    path = directory / RUN_FILE
    if not path.exists():
        return None
    data = read_small_json(path, 1 << 16)
    if type(data) is not dict or type(data.get("run_id")) is not str:
        raise ValueError(f"{path} is not a run record of reactor's (it names no run_id); remove it, or use another "
                         f"run directory")
    return str(data["run_id"])


def _earlier_run(directory: Path) -> bool:
    return any((directory / f).exists() for f in RUN_FILES) or any(directory.glob("replay*"))


def claim_run_dir(run_dir: str | os.PathLike[str], run_id: str, *, resume: bool, who: str,
                  required: bool = True) -> RunDirClaim:
    """Claim ``run_dir`` for run ``run_id`` (see the module's docstring); ``who`` names the node in errors.
    ``required``: with ``resume``, the directory must hold an earlier run (``resume=True``); without,
    ``resume`` only allows taking an earlier run's directory over (a replay shard's ``restore``, on by
    default: it restores a checkpoint where there is one).

    Raises:
        ValueError: the directory is another run's and ``resume`` is not set, is in use by a live
            run, holds no earlier run to resume, or has a ``run.json`` that is not one; each names
            the directory and what to do.
    """
    directory = Path(run_dir)
    if resume and required and not directory.exists():  # (not made: a mistyped path leaves nothing behind)
        raise ValueError(f"{who}: {_missing(run_dir)}")
    directory.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(directory)
    with _claims_lock:
        held = _claims.get(key)
        if held is not None:
            if held[1] != run_id:  # (runs in one process follow one another: an earlier one's claim is a bug)
                raise ValueError(f"{who}: run directory {run_dir} is in use by run {held[1]} in this process")
            held[2] += 1
            return RunDirClaim(key)
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            _claim(fd, directory, run_dir, run_id, resume, required, who)
        except BaseException:
            os.close(fd)
            raise
        _claims[key] = [fd, run_id, 1]
        return RunDirClaim(key)


_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)
_SAID_NO_LOCKS: set[str] = set()


def _flock(fd: int, op: int, directory: Path) -> bool:
    """``flock``; False (said once per directory) where the file system has none."""
    try:
        fcntl.flock(fd, op)
    except BlockingIOError:
        raise
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise
        if str(directory) not in _SAID_NO_LOCKS:
            _SAID_NO_LOCKS.add(str(directory))
            logging.getLogger("reactor.nodes").warning(
                "run directory %s: its file system takes no flock (%s): run.json alone says whose it is, and a "
                "second live run there is not refused", directory, os.strerror(e.errno or 0))
        return False
    return True


def _claim(fd: int, directory: Path, run_dir: Any, run_id: str, resume: bool, required: bool, who: str) -> None:
    deadline = time.monotonic() + CLAIM_WAIT_S
    while True:
        owner = _owner(directory)
        if owner == run_id:
            if not _flock(fd, fcntl.LOCK_SH, directory) or _owner(directory) == run_id:
                return
            fcntl.flock(fd, fcntl.LOCK_UN)  # (another run took it over between the read and the lock)
            continue
        try:
            if not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, directory):
                break  # (no locks here: decide on run.json alone)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise ValueError(f"{who}: run directory {run_dir} is in use by a live run ({owner or 'unnamed'}): two "
                                 f"runs writing one directory overwrite each other's files; stop that run first, or "
                                 f"use another run_dir") from None
            time.sleep(0.05)
            continue
        break
    # No process of any run holds the directory now.
    owner = _owner(directory)
    if owner == run_id:  # (another claimant of this run wrote it in the meantime)
        _flock(fd, fcntl.LOCK_SH, directory)
        return
    earlier = owner is not None or _earlier_run(directory)
    if earlier and not resume:
        raise ValueError(f"{who}: {_taken(run_dir, owner)}")
    if resume and required and not earlier:
        raise ValueError(f"{who}: {_empty(run_dir)}")
    replace_small(directory / RUN_FILE, (json.dumps({"run_id": run_id, "resumed_from": owner}) + "\n").encode())
    _flock(fd, fcntl.LOCK_SH, directory)  # (others of this run may claim now: the conversion is not atomic, so
    # they read run.json again once they hold theirs)


def check_resumable(run_dir: str | os.PathLike[str], algo: str, env: str, who: str,
                    app_config: dict[str, Any] | None = None) -> None:
    """A resumed run is the same training as the earlier one in its directory: the same algorithm and
    env (its ``config.json`` names them), learned online or offline alike (``app_config``'s ``source``:
    the offline app's). Resuming another app's directory wrote this run's rows into that app's metrics
    and its config over that app's (the offline app's into the online transformer's, each sharing its
    algorithm and env). And the same replay shards (each keeps its own
    checkpoints: with another count, none was restored, and the learner waited on an empty replay); other
    actors are said (each keeps its own exploration schedule: new ones start theirs anew). Nothing to
    check where there is no config.json.

    Raises:
        ValueError: naming both runs' algorithm and env or shards, or the unreadable config.json.
    """
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return
    try:
        earlier = read_small_json(path, 1 << 20)
    except (OSError, ValueError) as e:
        raise ValueError(f"{who}: cannot resume: {e}") from None
    if type(earlier) is not dict or not (isinstance(earlier.get("algo"), str) and isinstance(earlier.get("env"), str)):
        return  # (not a learner's config.json: the learner's own load says what is wrong)
    if (earlier["algo"], earlier["env"]) != (algo, env):
        raise ValueError(f"{who}: cannot resume run directory {run_dir}: it holds a run of {earlier.get('algo')!r} on "
                         f"{earlier.get('env')!r} (its config.json), and this run is {algo!r} on {env!r}; name "
                         f"another run_dir")
    before = earlier.get("app_config")
    if app_config is None or type(before) is not dict:
        return
    if ("source" in before) != ("source" in app_config):  # (transformer_dqn learns online and offline alike)
        kind = "an offline run (it learned from an earlier run's replay)" if "source" in before else "an online run"
        raise ValueError(f"{who}: cannot resume run directory {run_dir}: it holds {kind} of {algo!r} on {env!r} (its "
                         f"config.json), and this run {'learns offline' if 'source' in app_config else 'trains online'}; "
                         f"name another run_dir")
    if "shards" in app_config and before.get("shards", app_config["shards"]) != app_config["shards"]:
        raise ValueError(f"{who}: cannot resume run directory {run_dir} with shards={app_config['shards']}: its run had "
                         f"shards={before['shards']}, and each shard restores its own checkpoints; resume with "
                         f"--set shards={before['shards']}")
    if "actors" in app_config and before.get("actors", app_config["actors"]) != app_config["actors"]:
        logging.getLogger("reactor.nodes").warning(
            "resuming %s with actors=%s; its run had actors=%s: each actor's exploration schedule is kept per actor, "
            "and an actor without one starts its schedule anew", run_dir, app_config["actors"], before["actors"])


def check_run_dir(run_dir: str | os.PathLike[str], run_id: str, *, resume: bool, algo: str, env: str,
                  layout: dict[str, Any]) -> None:
    """What a training graph's builder checks of its ``run_dir`` where the run starts, before any process
    does: a resume's :func:`check_resumable` (``layout``: the graph's ``shards`` and ``actors``), and a
    new run's directory holding an earlier run. The nodes' claims decide in the end; this is said first,
    and it is the check of a run over hosts, whose relative run directory is made on each host afresh
    and copied back over this one at the end. A directory this run holds (a worker rebuilding the
    graph) passes.

    Raises:
        ValueError: as :func:`check_resumable`, or the earlier run, naming it.
    """
    directory = Path(run_dir)
    try:
        if resume:  # (under a multi-process placement each node refused it in its own worker: tracebacks)
            if not directory.is_dir():
                raise ValueError(_missing(run_dir))
            if _owner(directory) is None and not _earlier_run(directory):
                raise ValueError(_empty(run_dir))
            check_resumable(directory, algo, env, "resume=True", layout)
            return
        if not directory.is_dir():
            return
        owner = _owner(directory)
        earlier = owner is not None or _earlier_run(directory)
    except OSError:
        return  # (a path the system refuses, a name too long: the nodes' claims say what is wrong with it)
    except ValueError:
        if resume:
            raise
        return  # (a run.json that is not one: as above)
    if owner != run_id and earlier:
        raise ValueError(_taken(run_dir, owner))
