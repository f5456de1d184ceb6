"""The daemon's side of runs spread over hosts: the worker processes it starts for coordinators
elsewhere (or on this host), and their end.

``spawn`` starts one group's worker (forked from the daemon's fork server, which has imported
torch and reactor's nodes already: ``reactor/launch/_forkserver.py``; else
``python -m reactor.launch._worker``, its spec on stdin) in
``STATE/runs/RUN/`` (its working directory: an app's relative run directory lands there), the app's
files in ``STATE/runs/RUN/app/`` (checked against their sha256), its output in
``STATE/runs/RUN/GROUP.log``, in a process session of its own. The worker's host identity is the
daemon's name (``REACTOR_HOST_ID``): workers of two daemons never try shared memory with each other,
workers of one daemon do. A run is bound to its run key (the public key its coordinator made for it, in
every worker's spec) at its first spawn here, and in ``STATE/runs/RUN/.run-key``: a spawn under its id with
another key (a second run whose id collides) is refused, never taken into it. The fork server's answer is
awaited, the daemon answering meanwhile; the group counts as starting until it comes. The worker binds its
endpoint on the daemon's advertised interface (CURVE) and,
beside it, a plain ipc socket in the run's private socket directory on this host (mode 0700, under
``$REACTOR_RUNTIME_DIR``, removed with the run), which the coordinator gives to the run's other
workers on this daemon instead: links within a host are not encrypted, as in a run on one host.

``workers`` is the coordinator's heartbeat: it renews the run's lease and answers each worker's
pid and exit status. A run whose lease runs out (its coordinator or its host is gone) is ended
here: ``end`` (or the lease) sends SIGTERM to the run's live workers, SIGKILL to their sessions after
``END_GRACE_S``, and once none is left removes the run's shared-memory segments on this host.
The daemon keeps the records of its newest ``keep_ended`` ended runs (``reactor status``, their
workers' logs) and forgets older ones that ended ``FORGET_AFTER_S`` ago or more (their coordinators
have fetched their files by then); their directories stay on disk, marked ``.forgotten``, and such a
run takes no new workers, after a restart of the daemon too. With a :class:`Remover`
(``--remove-forgotten``) a forgotten run's directory is removed instead, and so, in turn, are those
that runs of the daemon's earlier lives left (their workers died with that life; a coordinator that
starts a group again in one takes it back), oldest first, as if they had ended when it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .._errors import DaemonError
from .._files import open_regular, read_small, replace_small
from .._hostmemory import available_host_bytes
from ._daemonclient import DaemonFullError
from ._forkserver import ForkedProcess, Forks
from ._localworkers import WORKER_MEMORY_FLOOR, spawn_memory_error
from ._rundir import open_run_dir, remove_run_dir

Proc = subprocess.Popen[bytes] | ForkedProcess

log = logging.getLogger("reactor.daemon")
END_GRACE_S = 5.0
LOG_CHUNK_NBYTES = 1 << 20  # the most of a log (or a run's file) one answer carries
#: The most files, and bytes of their paths, one ``run_files`` answer lists (:func:`list_run_files`): a
#: run's directory past either is cut there, and the answer says so. (Paths run to 4 KiB each: 100,000
#: of them were an answer of 400 MiB.)
RUN_FILES_MAX = 100_000
RUN_FILES_MAX_NBYTES = 16 << 20
#: How many of the names a coordinator cannot ask for (``_protocol.run_file_path``) a listing shows.
UNFETCHABLE_SHOWN = 3
KEEP_ENDED = 200  # ended jobs (and hosted runs) a daemon keeps listing; older ones are forgotten
FORGET_AFTER_S = 60.0  # an ended job or run is forgotten (past keep_ended) at least this long after its end
FORGOTTEN = ".forgotten"  # the mark of a forgotten run's directory
OWNER_FILE = ".run-key"  # a hosted run's key (run_key), in its directory: a daemon started again knows it
#: A coordinator heartbeats its run's daemons every 0.5 s (``_cluster.HEARTBEAT_S``) until it is done with the
#: run (its files fetched): silent this long after the run ended here, it has let the run go (``let_go``).
COORDINATOR_QUIET_S = 1.5
_JOB_ID_RE = re.compile(r"[0-9a-f]{16}\Z")  # (a job's directory: _daemon's own)

__all__ = ["HostedRuns", "Remover", "check_sha256", "list_run_files", "put_files"]


class Remover:
    """Removes a daemon's forgotten directories (``--remove-forgotten``) in a thread of its own: a run's
    checkpoints may take seconds to unlink, and the daemon's loop answers meanwhile. Each directory is
    first renamed into ``STATE/.removing/`` (at once, on the loop's thread), so that nothing of it is
    read or written at its old path again; what an earlier life left there is removed at the start."""

    def __init__(self, state: Path) -> None:
        self.bin = state / ".removing"
        self.bin.mkdir(mode=0o700, exist_ok=True)
        self._queue: queue.SimpleQueue[Path | None] = queue.SimpleQueue()
        for left in sorted(self.bin.iterdir()):
            self._queue.put(left)
        self._thread = threading.Thread(target=self._remove_queued, name="remover", daemon=True)
        self._thread.start()

    def remove(self, path: Path) -> bool:
        """Take ``path`` away now and remove it soon; False (logged) if it cannot be moved."""
        moved = self.bin / f"{path.parent.name}-{path.name}-{secrets.token_hex(4)}"
        try:
            os.rename(path, moved)
        except FileNotFoundError:
            return True  # (removed already, by hand)
        except OSError as e:
            log.warning("cannot remove %s (%s): it stays", path, e.strerror or e)
            return False
        self._queue.put(moved)
        return True

    def _remove_queued(self) -> None:
        while (path := self._queue.get()) is not None:
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():
                log.warning("could not remove all of %s: what is left stays", path)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread once what is queued is removed (waiting up to ``timeout_s``; what is left is
        removed at the next start)."""
        self._queue.put(None)
        self._thread.join(timeout_s)


def raise_open_files(want: int) -> None:
    """Raise this process's soft limit of open descriptors to its hard one (at most 2**20) where the soft
    one is below ``want``, as a server does (and Ray for its raylet): the processes it starts after
    inherit it. Past the hard limit it stays as it is; an unprivileged process cannot go further."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        top = hard if hard != resource.RLIM_INFINITY else max(want, soft)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(top, 1 << 20)), hard))


def ipv4_of(name: str) -> str | None:
    """The IPv4 address of the network interface ``name`` (None if none, or no such interface)."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(got[20:24])


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (None if none, or not IPv4)."""
    import socket

    try:
        packed = socket.inet_aton(address)
    except OSError:
        return None
    return next((name for _, name in socket.if_nameindex()
                 if (ip := ipv4_of(name)) is not None and socket.inet_aton(ip) == packed), None)


def read_chunk(path: Path, offset: int) -> tuple[bytes, int]:
    """Up to ``LOG_CHUNK_NBYTES`` of ``path`` from ``offset`` (past the end: from the end, nothing; a
    seek past the largest file size the filesystem allows would raise), and the offset after them.

    Raises:
        DaemonError: it cannot be read, or is not a regular file (a FIFO made there by a job's own
            code would hold the daemon's loop in ``open``); the message names it.
    """
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            offset = min(offset, os.fstat(f.fileno()).st_size)
            f.seek(offset)
            data = f.read(LOG_CHUNK_NBYTES)
    except (OSError, ValueError) as e:
        raise DaemonError(f"cannot read {path.name}: {e}") from None
    return data, offset + len(data)


def chunk_problem(offset: int, data: bytes, next_offset: int) -> str | None:
    """What is wrong with a chunk a daemon answered a read from ``offset`` with (``logs``, ``worker_log``,
    ``run_file``: :func:`read_chunk`'s ``data`` and the offset after it), or None. It holds at most
    ``LOG_CHUNK_NBYTES`` and ends where its data does: a reader that went on from an offset that did not
    move (or went back) asked for the same chunk for ever, printing it (the CLI) or writing it until the
    disk filled (the coordinator). The one reading rule of the CLI and the coordinator."""
    if len(data) > LOG_CHUNK_NBYTES:
        return f"the chunk holds {len(data):,} bytes, more than a daemon sends ({LOG_CHUNK_NBYTES:,})"
    if next_offset != offset + len(data):
        return (f"the chunk of {len(data):,} bytes from offset {offset:,} ends at offset {next_offset:,}, not "
                f"{offset + len(data):,}")
    return None


def check_sha256(files: dict[str, bytes], sha256: dict[str, str]) -> None:
    """Refuse a spawn whose files do not match their hashes (:meth:`HostedRuns.spawn`, in a thread)."""
    for name, data in files.items():
        if hashlib.sha256(data).hexdigest() != sha256[name]:
            raise DaemonError(f"file {name!r} does not match its sha256: it was damaged on the way")


def put_files(app_dir: Path, files: dict[str, bytes], sha256: dict[str, str]) -> None:
    """Write a spawn's app files into its run's ``app/`` (in a thread: :meth:`HostedRuns.spawn`). A file of
    the same name from an earlier spawn of the run that holds what its hash says stays; anything else there
    is replaced whole, never written through or waited on (a FIFO, a link: the run's own code may have put
    one there), through a new temporary name each (two spawns of one run may write at once)."""
    for name, data in files.items():
        target = app_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if _holds(target, sha256[name]):
            continue
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise


def _holds(path: Path, sha256: str) -> bool:
    """Whether ``path`` is a regular file (no link) whose bytes have ``sha256``."""
    try:
        if path.is_symlink():
            return False
        fd = open_regular(path)
    except (OSError, ValueError):
        return False
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest() == sha256


def list_run_files(directory: Path, max_files: int = RUN_FILES_MAX, max_nbytes: int = RUN_FILES_MAX_NBYTES,
                   max_visited: int = 4 * RUN_FILES_MAX) -> dict[str, Any]:
    """The files a run's workers wrote in their directory here (their relative run directories:
    metrics, checkpoints, plots), for its coordinator to copy back (``run_files``): every regular file
    under ``directory`` (``STATE/runs/RUN/``) but the shipped app (``app/``), the workers' logs and the
    run's key, no symbolic link followed, in a stable order (each directory's files by name, then its
    subdirectories by name). The daemon calls it in a thread: a directory of 100,000 files held its loop,
    every other client and heartbeat with it, for as long as it took to list. Each directory is read
    (``os.scandir``) only as far as the bound on names visited: ``os.walk`` read one whole (ten million
    names, all held) before the bound could apply.

    Returns:
        ``{"files": [{"path", "size"}, ...], "more": bool, "unfetchable": int, "unfetchable_shown": [...]}``:
        at most ``max_files`` files and ``max_nbytes`` bytes of their paths, from at most ``max_visited``
        names (files and directories, listed or not: a million empty directories or unfetchable names took
        as long) (``more``: the directory holds more, not listed: they stay here); names a ``run_file`` request cannot carry (``run_file_path``:
        a part that starts with ``.``, a character past ``[A-Za-z0-9_.-]``, a path past 4 KiB) are not
        listed but counted, and the first ``UNFETCHABLE_SHOWN`` shown (``ascii``: a name that is not UTF-8
        would not pack).
    """
    from ._protocol import run_file_path

    files: list[dict[str, Any]] = []
    nbytes = unfetchable = visited = 0
    shown: list[str] = []
    stack = [directory]  # (depth first: a directory's subdirectories pushed in reverse order of name)
    while stack:
        here = stack.pop()
        top = here == directory
        entries: list[os.DirEntry[str]] = []
        try:
            with os.scandir(here) as it:  # (read as far as the bound, never a huge directory whole)
                for entry in it:
                    if top and entry.name == "app":
                        continue
                    visited += 1
                    if visited > max_visited:
                        return {"files": files, "more": True, "unfetchable": unfetchable, "unfetchable_shown": shown}
                    entries.append(entry)
        except OSError:  # (removed meanwhile, or unreadable: not listed)
            continue
        dirs = []
        for entry in sorted(entries, key=lambda e: e.name):
            name = entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    dirs.append(here / name)
                    continue
                if (top and (name.endswith(".log") or name == OWNER_FILE)) or name == "run.lock":
                    continue  # (run.lock: a live lock's file, nothing to copy; each host has its own)
                st = entry.stat(follow_symlinks=False)  # (a link, or anything but a file, not listed)
            except FileNotFoundError:  # (removed meanwhile: not listed)
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            rel = str((here / name).relative_to(directory))
            if not run_file_path(rel):
                unfetchable += 1
                if len(shown) < UNFETCHABLE_SHOWN:
                    shown.append(ascii(rel)[:200])
                continue
            if len(files) >= max_files or nbytes + len(rel) > max_nbytes:
                return {"files": files, "more": True, "unfetchable": unfetchable, "unfetchable_shown": shown}
            files.append({"path": rel, "size": st.st_size})
            nbytes += len(rel)
        stack.extend(reversed(dirs))
    return {"files": files, "more": False, "unfetchable": unfetchable, "unfetchable_shown": shown}


def end_processes_in(directory: Path) -> int:
    """SIGKILL every process of this user running reactor (its command line says so) whose working
    directory is ``directory`` or under it, with its process group where it leads one; return how many
    there were. For a job a daemon forked but had not recorded when it was killed (``Daemon._load_jobs``):
    nothing else names its processes (a forked job's command line is its fork server's), but each runs in
    its job's ``app/``, as the workers it starts do."""
    found = 0
    uid = os.getuid()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if entry.stat().st_uid != uid:
                continue
            cwd = Path(os.readlink(entry / "cwd"))
            if cwd != directory and directory not in cwd.parents:
                continue
            if b"reactor" not in (entry / "cmdline").read_bytes():
                continue  # (not the job's: a shell someone opened in its directory, say)
        except OSError:  # (gone meanwhile, or not ours to read)
            continue
        pid = int(entry.name)
        found += 1
        for kill in (os.killpg, os.kill):  # (a job leads its session's group; a worker may lead its own)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)
    return found


def end_unrecorded_jobs(jobs: Path, daemon: str, ids: Iterable[str]) -> None:
    """The jobs of ``ids`` (names in ``jobs``, ``STATE/jobs/``) whose directory holds no record, at a daemon's
    start: their submit was cut short by the daemon's death. Killed after the job was forked, before its
    record was written, a job ran on in its own session, unlisted, never stopped (its client had no id to
    stop it by): its processes are ended and its directory removed, as the submit would have done had it
    failed."""
    for job_id in ids:
        jdir = jobs / job_id
        if not _JOB_ID_RE.match(job_id) or jdir.is_symlink() or not jdir.is_dir() or (jdir / "job.json").exists():
            continue
        ended = end_processes_in(jdir)
        shutil.rmtree(jdir, ignore_errors=True)
        log.warning("%s: job %s was being submitted when the daemon's last life ended, before its record was "
                    "written: %s, and its directory removed (its client was not given its id)", daemon, job_id,
                    f"ended its {ended} process(es)" if ended else "none of its processes ran")


def _feed(pipe: Any, data: bytes) -> None:
    """Write a new worker's spec on its stdin and close it (a thread of its own: :meth:`HostedRuns._popen`)."""
    try:
        pipe.write(data)
    except OSError:  # (the worker died before it read it: its exit says why)
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def run_key(worker: dict[str, Any]) -> str:
    """The run a spawn's worker belongs to, beyond its id: the public half of the run's CURVE key pair,
    which its coordinator makes for it (``""`` where a spec has none)."""
    curve = worker.get("curve")
    public = curve.get("public") if type(curve) is dict else None
    return public if type(public) is str else ""


def _owner_of(directory: Path) -> str | None:
    """The run key recorded in a hosted run's directory (``OWNER_FILE``), or None: none there."""
    try:
        return read_small(directory / OWNER_FILE, 4096).decode(errors="replace")
    except OSError:
        return None


class _Run:
    def __init__(self, run_id: str, directory: Path, lease_s: float) -> None:
        self.id = run_id
        self.owner = ""  # its run key (run_key): a spawn with another is another run's, with the same id
        self.dir = directory
        self.lease_s = lease_s
        self.seen = time.monotonic()
        self.workers: dict[str, Proc] = {}
        self.started: dict[str, float] = {}
        self.lives: dict[str, int] = {}  # workers started per group (more than one: restarts)
        self.ended: dict[str, float] = {}  # when the daemon saw each worker's end
        self.end_deadline: float | None = None
        self.why_ended = ""
        self.cleaned = False
        self.cleaned_at = 0.0  # (monotonic) when its end here was done: the oldest are forgotten first
        self.sockdir: Path | None = None  # its workers' ipc sockets (a short path: ipc's limit is 107 bytes)
        self.starting: set[str] = set()  # groups whose worker the fork server is forking now (HostedRuns.spawn)
        self.sockets = 0  # ipc socket paths given to its workers here (w0, w1, ...: each life a new one)
        self.asking = 0  # its coordinator's requests answered in a thread, not yet answered (let_go waits)


class HostedRuns:
    """The runs' workers this daemon hosts. ``name`` is the daemon's (the workers' host identity);
    ``advertise`` the interface address its workers bind to; ``state`` its state directory."""

    def __init__(self, name: str, advertise: str | None, state: Path, forks: Forks | None = None,
                 keep_ended: int = KEEP_ENDED, forget_after_s: float = FORGET_AFTER_S,
                 remover: Remover | None = None, worker_memory: int = WORKER_MEMORY_FLOOR) -> None:
        self.name = name
        self.worker_memory = worker_memory  # bytes a worker needs available to start (0: not checked)
        self.keep_ended = keep_ended
        self.forget_after_s = forget_after_s
        self.forks = forks
        self.advertise = advertise
        self.root = state / "runs"
        self.root.mkdir(mode=0o700, exist_ok=True)
        self.runs: dict[str, _Run] = {}
        self.remover = remover
        self.started_at = time.monotonic()
        #: (with a remover) the directories that runs of the daemon's earlier lives left, and when each was
        #: last written: ended runs, forgotten (and removed) first
        self.earlier: dict[str, float] = {}
        if remover is not None:
            for d in self.root.iterdir():
                if d.is_symlink() or not d.is_dir():
                    continue  # (none the daemon made)
                if (d / FORGOTTEN).exists():
                    remover.remove(d)
                else:
                    with contextlib.suppress(OSError):
                        self.earlier[d.name] = d.stat().st_mtime

    async def spawn(self, req: dict[str, Any]) -> dict[str, Any]:
        """Start one group's worker of a run (a checked ``spawn`` request); return its pid. The fork
        server's answer is awaited (the daemon answers meanwhile); the group counts as starting
        then, so a second spawn of it is refused and its run's end here waits for it. A run that
        ended meanwhile (its lease ran out) gets the worker's end at once, and the caller an error."""
        # The files' bytes are hashed, read and written in a thread: up to 32 MiB of them held the loop
        # (and a FIFO planted at an app file's path, by the run's own code, held it for good).
        await asyncio.to_thread(check_sha256, req["files"], req["sha256"])
        if self.worker_memory and (why := spawn_memory_error(available_host_bytes(), self.worker_memory,
                                                             f"daemon {self.name!r}'s host")):
            # (a coordinator checks a run's count on each host before it starts any; this is the last word,
            # for runs that fill the host meanwhile: a clear refusal rather than a host its OOM killer works on)
            raise DaemonFullError(f"run {req['run']}: group {req['group']!r} not started: {why}")
        run, group, start = self._prepare(req)  # (the group counts as starting from here)
        try:
            await asyncio.to_thread(put_files, run.dir / "app", req["files"], req["sha256"])
            proc: Proc | None = await self.forks.spawn_async("worker", **start) if self.forks is not None else None
            if proc is None:
                proc = self._popen(start)
        finally:
            run.starting.discard(group)
        run.workers[group] = proc
        run.lives[group] = run.lives.get(group, 0) + 1
        run.started[group] = time.time()
        run.ended.pop(group, None)
        run.seen = time.monotonic()
        if run.end_deadline is not None:  # (ended while it started: ended with the rest)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            raise DaemonError(f"run {run.id} ended on {self.name!r} while its group {group!r} started "
                              f"({run.why_ended}); it takes no new workers")
        log.info("%s: run %s: started group %s (pid %d, %s)", self.name, run.id, group, proc.pid,
                 "forked" if isinstance(proc, ForkedProcess) else "a new interpreter")
        return {"pid": proc.pid, "host": self.name, "dir": str(run.dir)}  # (dir: where its files stay if lost)

    def _prepare(self, req: dict[str, Any]) -> tuple[_Run, str, dict[str, Any]]:
        """:meth:`spawn`'s checks: the run (made at its first spawn), the group (counted as starting when
        this returns), and the worker's start (``Forks.spawn``'s arguments). No file of the app is read or
        written here (:func:`put_files`, in a thread)."""
        if self.advertise is None:
            raise DaemonError(f"daemon {self.name!r} listens on a wildcard address and so cannot tell its workers "
                              f"where other hosts reach them: restart it with --advertise ADDR")
        run = self.runs.get(req["run"])
        owner = run_key(req["worker"])
        if run is None:
            if (self.root / req["run"] / FORGOTTEN).exists():
                raise DaemonError(f"run {req['run']} has ended on {self.name!r}; it takes no new workers")
            if _owner_of(self.root / req["run"]) not in (None, owner):  # (hosted in an earlier life, for another)
                raise DaemonError(self._collision(req["run"]))
            self.earlier.pop(req["run"], None)  # (a run of an earlier life that starts a group here again)
            run = self.runs[req["run"]] = _Run(req["run"], self.root / req["run"], float(req["lease_s"]))
            run.owner = owner
            (run.dir / "app").mkdir(mode=0o700, parents=True, exist_ok=True)
            replace_small(run.dir / OWNER_FILE, owner.encode())
        elif run.owner != owner:
            raise DaemonError(self._collision(run.id))
        if run.end_deadline is not None or run.why_ended:
            raise DaemonError(f"run {run.id} has ended on {self.name!r}; it takes no new workers")
        group = req["group"]
        old = run.workers.get(group)
        if group in run.starting:
            raise DaemonError(f"run {run.id} is starting a worker for group {group!r} here already")
        if old is not None and old.poll() is None:
            raise DaemonError(f"run {run.id} already has a live worker for group {group!r} here (pid {old.pid})")
        run.seen = time.monotonic()
        spec = dict(req["worker"])
        spec["app"] = str(run.dir / "app" / req["app"])
        spec["bind"] = f"tcp://{self.advertise}:*"
        if run.sockdir is None:
            run.sockdir = open_run_dir(run.id)
        spec["local_bind"] = f"ipc://{run.sockdir}/w{run.sockets}"  # a new path for every life
        run.sockets += 1
        env = {**os.environ, "REACTOR_WORKER_GROUP": group, "REACTOR_RUN_ID": run.id,
               "REACTOR_HOST_ID": f"daemon:{self.name}", "REACTOR_PARENT_PID": str(os.getpid())}
        if (ifname := interface_of(self.advertise)) is not None:
            # torch.distributed's gloo picks its interface from the host name, which may not be
            # the one other hosts reach this one at: name it.
            env["GLOO_SOCKET_IFNAME"] = ifname
        run.starting.add(group)
        return run, group, {"argv": [sys.executable, "-m", "reactor.launch._worker"], "cwd": run.dir, "env": env,
                            "stdin": json.dumps(spec).encode(), "log_path": run.dir / f"{group}.log",
                            "title": f"rx:{group}"}

    def _collision(self, run_id: str) -> str:
        return (f"daemon {self.name!r} hosts a run {run_id} of another coordinator (its workers hold another run "
                f"key): two runs have one id, and a daemon never mixes two runs' workers or files; start this run "
                f"again, under another id (REACTOR_RUN_ID, where you set it)")

    @staticmethod
    def _popen(start: dict[str, Any]) -> Proc:
        """A worker started as a new interpreter (no fork server to use), its spec on stdin, which a thread
        writes: the worker reads it once it has started (its imports: seconds), and a spec past the pipe's
        64 KiB held the daemon's loop until then. Started from the loop's thread itself (the worker's
        parent-death signal follows the thread that started it), which lives as long as the daemon."""
        out = os.open(start["log_path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        try:  # (O_NONBLOCK: a FIFO made at the log's path by the run's own code is not waited on)
            if not stat.S_ISREG(os.fstat(out).st_mode):
                raise DaemonError(f"{start['log_path']} is not a regular file: the worker's log cannot go there")
            os.set_blocking(out, True)
            popen = subprocess.Popen(start["argv"], cwd=start["cwd"], stdin=subprocess.PIPE, stdout=out, stderr=out,
                                     env=start["env"], start_new_session=True)
        finally:
            os.close(out)
        assert popen.stdin is not None
        threading.Thread(target=_feed, args=(popen.stdin, start["stdin"]), name="spawn-stdin", daemon=True).start()
        return popen

    def log(self, run_id: str, group: str, offset: int) -> dict[str, Any]:
        """A chunk of a hosted worker's output (``reactor logs JOB GROUP``): its lives all write to
        ``STATE/runs/RUN/GROUP.log``; ``done`` once its latest life has ended."""
        run = self.runs.get(run_id)
        if run is None and (self.root / run_id / FORGOTTEN).exists():
            raise DaemonError(self._no_run(run_id))
        if run is None or group not in run.workers:
            raise DaemonError(f"daemon {self.name!r} hosts no group {group!r} of run {run_id!r}")
        data, offset = read_chunk(run.dir / f"{group}.log", offset)
        return {"data": data, "offset": offset, "done": run.workers[group].poll() is not None}

    def run_dir(self, run_id: str) -> Path:
        """The directory of a run whose files its coordinator asks for (``run_files``, listed by
        :func:`list_run_files` in a thread); its lease renewed."""
        return self._run(run_id).dir

    @contextlib.contextmanager
    def asked(self, run_id: str) -> Any:
        """Around a request of a run's coordinator answered in a thread (``run_files``): the run is not let
        go (``let_go``) while it is answered, and its last word from the coordinator is the answer's end.
        The coordinator asks one request at a time, so its heartbeats wait behind a long listing: a daemon
        stopping after its runs took it for gone 1.5 s into one, ended, and cancelled the answer (its files
        then stayed on a host Slurm was taking down)."""
        run = self._run(run_id)
        run.asking += 1
        try:
            yield run
        finally:
            run.asking -= 1
            run.seen = time.monotonic()

    def run_file(self, run_id: str, path: str, offset: int) -> dict[str, Any]:
        """A chunk of one file that :func:`list_run_files` lists (``path`` relative, checked by the schema)."""
        run = self._run(run_id)
        p = run.dir / path
        if path.split("/")[0] == "app" or p.is_symlink() or not p.is_file() or run.dir.resolve() not in p.resolve().parents:
            raise DaemonError(f"run {run_id!r} has no file {path!r} here")
        data, offset = read_chunk(p, offset)
        return {"data": data, "offset": offset}

    def _run(self, run_id: str) -> _Run:
        """A run its coordinator asks about (its files): the coordinator is not done with it (``let_go``)."""
        run = self.runs.get(run_id)
        if run is None:
            raise DaemonError(self._no_run(run_id))
        run.seen = time.monotonic()
        return run

    def _no_run(self, run_id: str) -> str:
        if (self.root / run_id / FORGOTTEN).exists():
            return (f"daemon {self.name!r} no longer tracks run {run_id!r}: it ended here, and the daemon keeps its "
                    f"newest {self.keep_ended} ended runs (--keep-ended); its files are in {self.root / run_id}")
        return f"daemon {self.name!r} hosts no run {run_id!r}"

    def workers(self, run_id: str) -> dict[str, Any]:
        """A coordinator's heartbeat: renew the run's lease; each worker's pid and exit status."""
        run = self.runs.get(run_id)
        if run is None:
            raise DaemonError(self._no_run(run_id))
        run.seen = time.monotonic()
        return {g: {"pid": p.pid, "returncode": p.poll()} for g, p in run.workers.items()}

    def end(self, run_id: str, why: str = "its coordinator ended it") -> dict[str, Any]:
        """Stop what is left of a run here: SIGTERM now, SIGKILL after ``END_GRACE_S``."""
        run = self.runs.get(run_id)
        if run is None:
            return {}
        if run.end_deadline is None:
            run.end_deadline = time.monotonic() + END_GRACE_S
            run.why_ended = why
            for p in run.workers.values():
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signal.SIGTERM)
        return {g: {"pid": p.pid, "returncode": p.poll()} for g, p in run.workers.items()}

    def watch(self) -> None:
        """Leases, grace periods and cleanup of ended runs; forgetting the oldest past ``keep_ended``."""
        now = time.monotonic()
        cleaned = 0
        for run in self.runs.values():
            for g, p in run.workers.items():
                if p.poll() is not None:
                    run.ended.setdefault(g, time.time())
            live = [p for p in run.workers.values() if p.poll() is None]
            # (with no live worker too: a run whose workers died and whose coordinator is gone would
            # keep its socket directory and segments for the daemon's life)
            if run.end_deadline is None and now - run.seen > run.lease_s:
                log.warning("%s: run %s: no word from its coordinator for %.1f s: ending it here",
                            self.name, run.id, now - run.seen)
                self.end(run.id, f"its coordinator was silent for more than {run.lease_s:.1f} s")
            if run.end_deadline is not None and live and now > run.end_deadline:
                for p in live:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
            if run.end_deadline is not None and not live and not run.starting and not run.cleaned:
                run.cleaned = True
                for p in run.workers.values():  # nothing a worker started outlives it
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)
                self._cleanup_segments(run.id)
                if run.sockdir is not None:
                    remove_run_dir(run.sockdir)
                log.info("%s: run %s ended here (%s)", self.name, run.id, run.why_ended)
                run.cleaned_at = now
            cleaned += run.cleaned
        if cleaned + len(self.earlier) > self.keep_ended:
            self._forget_ended(now)

    def _forget_ended(self, now: float) -> None:
        """Forget the runs that ended here longest ago, past ``keep_ended`` and ``forget_after_s`` after
        their end: their directories stay, marked (a forgotten run takes no new workers), or are removed
        (with a remover; the earlier lives' first, as if they had ended when this one started)."""
        ended = sorted((r for r in self.runs.values() if r.cleaned), key=lambda r: r.cleaned_at)
        excess = len(self.earlier) + len(ended) - self.keep_ended
        if self.remover is not None and now - self.started_at >= self.forget_after_s:
            for run_id in sorted(self.earlier, key=self.earlier.__getitem__)[:max(0, excess)]:
                del self.earlier[run_id]
                excess -= 1
                if self.remover.remove(self.root / run_id):
                    log.info("%s: removed the directory of run %s, hosted in an earlier life (past the newest %d "
                             "ended runs kept)", self.name, run_id, self.keep_ended)
        for run in ended[:max(0, excess)]:
            if now - run.cleaned_at < self.forget_after_s:
                break  # (in order: the rest ended later still)
            del self.runs[run.id]
            if self.remover is not None and self.remover.remove(run.dir):
                log.info("%s: forgot the ended run %s and removed its directory (past the newest %d ended runs "
                         "kept)", self.name, run.id, self.keep_ended)
                continue
            with contextlib.suppress(OSError):
                (run.dir / FORGOTTEN).touch()
            log.info("%s: forgot the ended run %s (past the newest %d ended runs kept); its files stay in %s",
                     self.name, run.id, self.keep_ended, run.dir)

    def _cleanup_segments(self, run_id: str) -> None:
        from ..transport._shm import cleanup_stale

        for seg in cleanup_stale(run_id):
            log.warning("%s: removed the shared-memory segment %s of run %s", self.name, seg, run_id)

    def end_all(self) -> None:
        for run_id in list(self.runs):
            self.end(run_id, "the daemon stopped")

    def let_go(self, now: float) -> bool:
        """Whether every run hosted here has ended here (its coordinator's ``end``, or its lease ran out)
        and its coordinator has let it go: no word from it for ``COORDINATOR_QUIET_S`` (it heartbeats,
        and fetches the run's files, until it is done). ``now``: ``time.monotonic()``."""
        return all(run.cleaned and not run.asking and now - run.seen >= COORDINATOR_QUIET_S for run in self.runs.values())

    def live(self) -> bool:
        """Whether a worker hosted here lives, or is starting."""
        return any(r.starting or any(p.poll() is None for p in r.workers.values()) for r in self.runs.values())

    def describe(self) -> list[dict[str, Any]]:
        """Each hosted run's workers: group, pid, state, uptime of its latest life, and how many
        times it was started again here (``reactor status``)."""
        out = []
        now = time.time()
        for run in self.runs.values():
            for g, p in run.workers.items():
                rc = p.poll()
                out.append({"run": run.id, "group": g, "pid": p.pid, "returncode": rc,
                            "state": "running" if rc is None else "ended",
                            "uptime_s": round(run.ended.get(g, now) - run.started[g], 3), "daemon": self.name,
                            "restarts": run.lives.get(g, 1) - 1})
        return out
