"""The daemon: one long-lived process per machine that hosts the jobs submitted to it.

``reactor daemon --listen tcp://ADDR:PORT --name NAME --state-dir DIR [--keys KEYDIR]`` serves
clients over ZeroMQ with CURVE: it admits only clients whose public key is in ``KEYDIR/authorized``
(``reactor/launch/_keys.py``). Requests and replies are msgpack arrays, ``[id, kind, ...]`` and
``[id, ok, payload]`` (a spawn refused for want of memory: ``[id, False, text, "full"]``); every request is checked against its kind's schema
(``_protocol.DAEMON_KINDS``) and a bad one is answered with an error, or dropped and logged when it
has no usable id. Nothing a client sends is unpickled, and no request or job takes the daemon down.

A job is a ``reactor run`` of the submitted app on this machine, in a process session of its own,
its output in ``STATE/jobs/ID/output.log``, its record in ``STATE/jobs/ID/job.json``. The app's files
travel in the request, each with its sha256 (checked, and recorded: the job id is a hash of the
whole spec). ``stop`` sends SIGTERM to the job's coordinator (it stops its run cleanly and reaps its
workers), then SIGKILL to the job's whole process group after ``STOP_GRACE_S``. The daemon outlives every job; a
daemon restarted on its state directory lists its past jobs, and a job it finds running from an
earlier life it keeps watching (its exit status, not the daemon's child's, is the one the job's command
writes in ``STATE/jobs/ID/exit.json`` as it ends); one that died meanwhile is marked ``lost``, one not yet recorded
ended (``end_unrecorded_jobs``). SIGTERM (or SIGINT) to the daemon stops its running jobs first.

A daemon lives for months and hosts jobs by the thousand: it keeps the records of its newest
``keep_ended`` ended jobs (``--keep-ended``, default ``KEEP_ENDED``) in memory and in ``status``, and
forgets older ones that ended ``forget_after_s`` (``--forget-after-s``, default ``FORGET_AFTER_S``) ago or
more as others end (a restarted daemon lists what its last life listed, reading only those records:
``STATE/jobs.json``); a forgotten job's directory stays on disk, and asking for it says
where, unless the daemon removes what it forgets (``--remove-forgotten``: ``_hosting.Remover``), which
bounds its state directory. Every running job is kept.

A job whose placement names hosts runs its coordinator here and its groups' workers on the daemons
of those hosts, this one among them: the daemon's side of that (``spawn``, ``workers``, ``end``) is
``reactor/launch/_hosting.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio
import zmq.auth.asyncio

from .._errors import DaemonError
from .._files import read_small_json
from .._floodlog import flood_logged, flood_tally
from .._hostmemory import available_host_bytes
from ..transport._shm import _pid_start_time
from ._daemonclient import DaemonClient, DaemonFullError, DaemonKeyError, DaemonSilentError, job_spec
from ._forkserver import TRAINING_PRELOAD, Forks, over_hosts
from ._hosting import (
    END_GRACE_S,
    FORGET_AFTER_S,
    KEEP_ENDED,
    HostedRuns,
    Proc,
    Remover,
    check_sha256,
    end_unrecorded_jobs,
    list_run_files,
    put_files,
    raise_open_files,
    read_chunk,
)
from ._jobrecord import (
    EXIT_FILE,
    _atomic_json,
    _ended_record,
    _Job,
    _job_groups,
    _last_line,
    _local_workers,
    _number,
    _record_problem,
    _recorded_exit,
    _StateLock,
    full_disk_note,
)
from ._keys import AuthorizedKeys
from ._localworkers import WORKER_MEMORY_FLOOR
from ._protocol import check_request
from ._rundir import sweep_stale
from ._version import build_id, python_version

__all__ = ["Daemon", "DaemonClient", "DaemonError", "DaemonFullError", "DaemonKeyError", "DaemonSilentError", "job_spec"]

log = logging.getLogger("reactor.daemon")
MAX_REQUEST_NBYTES = 64 * 2**20
REPLIES_QUEUED_MAX = 32  # replies zmq holds for one client that does not read them
#: The soft limit of open descriptors a daemon raises its own to, up to its hard one (raise_open_files).
DAEMON_OPEN_FILES = 65536
#: The requests that start a process (a job, a worker): answered once the fork server has forked it, the
#: daemon answering other requests meanwhile (``Forks.spawn_async``).
STARTS = ("submit", "spawn")
#: The requests answered from a thread, the daemon answering others meanwhile: listing a run's directory
#: (``run_files``) took seconds for 100,000 files, every other client and heartbeat waiting.
IN_THREAD = ("run_files",)
STOP_GRACE_S = 20.0
#: After the grace: the run's second SIGTERM ("stop at once", its cleanups run), then SIGKILL. Its cleanups
#: wait out the reaping's SIGTERM grace for workers held in a reaction (TERM_GRACE_S here, a host's END_GRACE_S
#: over hosts, 5 s each, and a heartbeat to see them end), then copy the run's files back from its hosts: at 5 s
#: the SIGKILL always came first, and the files of a job over hosts stayed on them (exit status -9).
STOP_HURRY_S = 15.0
WATCH_PERIOD_S = 0.2
#: The most bytes of ``--set KEY=VALUE`` a job's config may come to: its command line carries them (one
#: argument past 128 KiB fails to start) and its record holds them (read back, after a restart, up to 1 MiB).
CONFIG_MAX_NBYTES = 64 * 1024
#: How often the same trouble of the watch loop (a record it cannot write, say) is logged again.
WATCH_WARN_EVERY_S = 60.0
#: The jobs a daemon lists, in ``STATE/`` (``Daemon._read_index``): what its next start reads the records of.
INDEX = "jobs.json"
_JOB_DIR_RE = re.compile(r"[0-9a-f]{16}\Z")


class Daemon:
    """The daemon's state and its serving loop (``await Daemon(...).serve()``)."""

    def __init__(self, listen: str, name: str, state_dir: str | os.PathLike[str], keys_dir: str | os.PathLike[str],
                 advertise: str | None = None, preload: Sequence[str] | None = TRAINING_PRELOAD,
                 keep_ended: int = KEEP_ENDED, forget_after_s: float = FORGET_AFTER_S, remove_forgotten: bool = False,
                 stop_after_runs_s: float | None = None, worker_memory: int = WORKER_MEMORY_FLOOR):
        from ._keys import load_keys

        if type(worker_memory) is not int or worker_memory < 0:
            raise ValueError(f"worker_memory must be bytes, an int >= 0, got {worker_memory!r}")

        if type(keep_ended) is not int or keep_ended < 0:
            raise ValueError(f"keep_ended must be an int >= 0, got {keep_ended!r}")
        if type(forget_after_s) not in (int, float) or not 0 <= forget_after_s < math.inf:
            raise ValueError(f"forget_after_s must be finite seconds >= 0, got {forget_after_s!r}")
        if advertise:
            why = advertise_error(advertise)
            if why is not None:
                raise ValueError(f"--advertise {advertise!r:.200}: {why}")
        if not advertise and _advertised(listen) is None:  # (its own jobs run; workers of runs over hosts do not)
            log.warning("--listen %s is a wildcard, which other hosts cannot dial: runs over hosts will be refused "
                        "their workers here until the daemon is started with --advertise ADDR, the address they "
                        "reach this host at (jobs submitted to it run)", listen)
        self.name = name
        if stop_after_runs_s is not None and (type(stop_after_runs_s) not in (int, float)
                                              or not 0 <= stop_after_runs_s < math.inf):
            raise ValueError(f"stop_after_runs_s must be finite seconds >= 0, got {stop_after_runs_s!r}")
        #: On SIGTERM, its hosted runs get this long to be ended by their coordinators (``_stop_done``); None: none.
        self.stop_after_runs_s = stop_after_runs_s
        self.keep_ended = keep_ended
        self.forget_after_s = float(forget_after_s)
        self.listen = listen
        # Its keys before its state directory is taken: a daemon without a key pair held the lock
        # when it failed, and the command then left the state directory it had made for it.
        self.keys_dir = Path(keys_dir).resolve()
        self.keys = load_keys(keys_dir)
        if (Path(keys_dir) / "authorized").exists():  # (refused here in one line; later, it admits no one, logged)
            AuthorizedKeys(Path(keys_dir) / "authorized").check()
        self.state = Path(state_dir).resolve()  # (a relative one: jobs run in their own directories)
        if self.state.exists() and not self.state.is_dir():
            raise NotADirectoryError(f"--state-dir {self.state} is a file, not a directory")
        self.state.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._held = _StateLock(self.state)  # (for the daemon's life: a second daemon there is refused)
        (self.state / "jobs").mkdir(mode=0o700, exist_ok=True)
        advertise = advertise or _advertised(listen)
        self.advertise = advertise
        self.reach: str | None = None  # where other hosts reach it, once it serves (see serve)
        # The fork server's own environment is what /proc/PID/environ shows of its workers: the
        # host identity they all share.
        self.forks = Forks(preload, {**os.environ, "REACTOR_HOST_ID": f"daemon:{name}"})
        self.remover = Remover(self.state) if remove_forgotten else None
        self.hosted = HostedRuns(name, advertise, self.state, self.forks, keep_ended=keep_ended,
                                 forget_after_s=self.forget_after_s, remover=self.remover, worker_memory=worker_memory)
        sweep_stale()  # the socket directories and segments of runs whose daemon or coordinator died
        self.authorized = AuthorizedKeys(Path(keys_dir) / "authorized")
        self.jobs: dict[str, _Job] = {}
        self._warned: dict[str, float] = {}  # watch loop trouble -> when last logged
        self._stop_phase: str | None = None  # (on SIGTERM: "jobs", then "hosted"; see _stop_done)
        self._later: set[asyncio.Task[None]] = set()  # (serve: the requests answered once done: STARTS, IN_THREAD)
        self._starting = 0  # (the submits and spawns whose process is starting)
        self._stop_deadline = 0.0
        self.refused = 0
        self._index_unsaved = False  # the jobs' index changed and could not be written yet (_save_index)
        self._forgotten_kept = 0  # forgotten jobs whose directories stay (the start's line counts them)
        self._load_jobs()

    # -------------------------------------------------------------------------- jobs on disk

    def _load_jobs(self) -> None:
        """A restarted daemon: its past jobs, as they ended, in the order they were submitted (as
        ``status`` lists them); a running one is watched again, or marked lost if it died while no
        daemon watched it. It reads the records its last life listed (``INDEX``), not every job's: a
        start read all of them, and took longer and more memory with each job the daemon ever ran. With
        no index it can trust (none yet, unreadable, or ``jobs/`` changed after it was written: a
        directory made by another program, or by a submit whose index could not be written) it reads
        them all, as before, and writes one. (A submit lists its job before it makes its directory:
        one cut short by a crash is listed, and ended if it never wrote its record: ``end_unrecorded_jobs``.)"""
        listed = self._read_index()
        if listed is None:
            paths = sorted((self.state / "jobs").glob("*/job.json"))
        else:
            paths = [self.state / "jobs" / job_id / "job.json" for job_id in listed["jobs"]]
            self._forgotten_kept = listed["forgotten"]
        end_unrecorded_jobs(self.state / "jobs", self.name, listed["jobs"] if listed else os.listdir(self.state / "jobs"))
        loaded: list[_Job] = []
        changed = listed is None and bool(paths)  # (a new daemon's empty jobs/ has nothing to index)
        for path in paths:
            if listed is not None and not path.is_file():
                changed = True  # (removed by hand: nothing to list; or its submit cut short: end_unrecorded_jobs)
                continue
            try:
                record = read_small_json(path)
                if (why := _record_problem(record, path.parent.name)) is not None:
                    raise ValueError(why)
                job = _Job(record, path.parent)
            except (OSError, ValueError) as exc:
                log.warning("%s: ignored the unreadable job record %s: %s", self.name, path, exc)
                changed = True
                continue
            if record.get("state") == "running" and record.get("stop_requested") and job.alive():
                job.stop_deadline = time.monotonic() + STOP_GRACE_S  # (asked before the restart: a fresh grace)
            if record.get("state") == "running" and not job.alive():
                if (rc := _recorded_exit(job)) is not None:  # (its command said how it ended, and when)
                    record["returncode"] = rc
                    record["state"] = "stopped" if record.get("stop_requested") else "finished" if rc == 0 else "failed"
                    with contextlib.suppress(OSError):
                        record["ended_at"] = (job.dir / EXIT_FILE).stat().st_mtime
                else:
                    record["state"] = "lost"
                    record["detail"] = "it ended while no daemon watched it (the daemon was down)"
                if record.get("ended_at") is None:  # (submit writes None)
                    record["ended_at"] = time.time()
                self._save(job)
            loaded.append(job)
        loaded.sort(key=lambda j: _number(j.record.get("submitted_at")))
        self.jobs = {j.id: j for j in loaded}
        forgot = self._forget_ended(quiet=True)  # (one line: each was said in the life that forgot it)
        if self.remover is not None and listed is not None:
            # Directories an earlier life left that are not listed: forgotten by a life without
            # --remove-forgotten. (Removed once: a daemon that removes what it forgets leaves none.)
            with os.scandir(self.state / "jobs") as entries:
                for entry in entries:
                    if entry.name not in self.jobs and _JOB_DIR_RE.match(entry.name) and entry.is_dir(follow_symlinks=False):
                        forgot += self.remover.remove(Path(entry.path))
            self._forgotten_kept = 0
        if forgot or changed:
            self._save_index()
        if self.remover is not None and forgot:
            log.info("%s: lists its newest %d ended jobs (--keep-ended); the %d older ones' directories are removed "
                     "from %s", self.name, self.keep_ended, forgot, self.state / "jobs")
        elif self.remover is None and self._forgotten_kept:
            log.info("%s: lists its newest %d ended jobs (--keep-ended); the %d older ones' files stay in %s",
                     self.name, self.keep_ended, self._forgotten_kept, self.state / "jobs")

    def _read_index(self) -> dict[str, Any] | None:
        """The jobs' index (``INDEX``: the ids the daemon lists, in the order they were submitted, and how
        many forgotten jobs' directories stay), or None where it cannot be trusted: missing, unreadable, or
        older than ``jobs/`` (a directory was made or removed there after it was written)."""
        path = self.state / INDEX
        try:
            written = path.stat().st_mtime_ns
            if (self.state / "jobs").stat().st_mtime_ns > written:
                log.info("%s: reads every job record: %s changed after %s was written", self.name,
                         self.state / "jobs", path)
                return None
            got = read_small_json(path, max_nbytes=(1 << 20) + 32 * self.keep_ended)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("%s: reads every job record: its index %s is unreadable (%s)", self.name, path, e)
            return None
        if type(got) is not dict or type(got.get("jobs")) is not list or type(got.get("forgotten")) is not int \
                or got["forgotten"] < 0 or not all(type(j) is str and _JOB_DIR_RE.match(j) for j in got["jobs"]):
            log.warning("%s: reads every job record: its index %s is not what a daemon writes", self.name, path)
            return None
        return got

    def _save_index(self, starting: str | None = None) -> None:
        """Write the jobs' index (``INDEX``), with the job ``starting`` too: a submit lists its job before it
        makes its directory, so a daemon killed in between lists it at its next start (it skips an id
        without a record). One that cannot be written now is written at a later watch (a start meanwhile
        finds ``jobs/`` newer than the index it has, and reads every record)."""
        try:
            _atomic_json(self.state / INDEX, {"jobs": [*self.jobs, *([starting] if starting else [])],
                                              "forgotten": self._forgotten_kept})
        except OSError as e:
            self._index_unsaved = True
            self._warn("index", "%s: cannot write its jobs' index (%s); trying again", self.name, e)
            return
        self._index_unsaved = False
        self._warned.pop("index", None)

    def _forget_ended(self, quiet: bool = False) -> int:
        """Forget the oldest ended jobs past ``keep_ended`` that ended ``forget_after_s`` ago or more
        (a client following one sees its end first); their directories stay on disk. Each is logged
        unless ``quiet``. Returns how many were forgotten."""
        ended = [j for j in self.jobs.values() if j.record.get("state") != "running"]
        if len(ended) <= self.keep_ended:
            return 0
        ended.sort(key=lambda j: (_number(j.record.get("ended_at")), _number(j.record.get("submitted_at"))))
        old = time.time() - self.forget_after_s
        forgot = 0
        for job in ended[:len(ended) - self.keep_ended]:
            if _number(job.record.get("ended_at")) > old:
                break  # (in order: the rest ended later still)
            del self.jobs[job.id]
            forgot += 1
            if self.remover is not None and self.remover.remove(job.dir):
                if not quiet:
                    log.info("%s: forgot the ended job %s and removed its directory (past the newest %d ended "
                             "jobs kept)", self.name, job.id, self.keep_ended)
            else:
                self._forgotten_kept += 1
                if not quiet:
                    log.info("%s: forgot the ended job %s (past the newest %d ended jobs kept); its files stay in %s",
                             self.name, job.id, self.keep_ended, job.dir)
        if forgot and not quiet:
            self._save_index()
        return forgot

    async def submit(self, spec: dict[str, Any]) -> str:
        """Start a job from a checked spec; return its id (a hash of the whole spec and the time). The
        fork server's answer is awaited, and the job's files are hashed and written in a thread: the daemon
        answers other requests meanwhile."""
        try:
            await asyncio.to_thread(check_sha256, spec["files"], spec["sha256"])
        except DaemonError as e:
            raise DaemonError(f"{e}; submit again") from None
        digest = hashlib.sha256(msgpack.packb([spec["app"], sorted(spec["sha256"].items()), spec["config"],
                                               spec["placement"], spec["seed"], spec["async"]])).hexdigest()
        settings = [f"{k}={v!r}" for k, v in spec["config"].items()]
        if sum(len(a.encode()) for a in settings) > CONFIG_MAX_NBYTES:
            # (the job gets them as its command line's --set, and its record must load again after a restart)
            raise DaemonError(f"the job's config is {sum(len(a.encode()) for a in settings):,} bytes as --set values, "
                              f"more than the {CONFIG_MAX_NBYTES:,} a job takes: ship large data as a file (--with)")
        job_id = hashlib.sha256(f"{digest}:{time.time_ns()}:{secrets.token_hex(8)}".encode()).hexdigest()[:16]
        jdir = self.state / "jobs" / job_id
        if jdir.exists():  # (never: the id hashes the time in ns; the cleanup below must not take another's)
            raise DaemonError(f"job {job_id} exists already; submit again")
        started: list[Proc] = []
        try:
            self._save_index(starting=job_id)
            return await self._start_job(spec, job_id, jdir, digest, settings, started)
        except BaseException:  # (a full disk, say): no job left running unrecorded, no directory without a job.json
            self.jobs.pop(job_id, None)
            for proc in started:
                for kill in (os.killpg, os.kill):  # (the group, and the process itself: a forked job may not
                    with contextlib.suppress(ProcessLookupError, PermissionError):  # have made its session yet)
                        kill(proc.pid, signal.SIGKILL)
                with contextlib.suppress(Exception):
                    proc.wait(timeout=5)  # (reaped: no zombie)
            shutil.rmtree(jdir, ignore_errors=True)
            self._save_index()  # (else jobs/ changed after the index, and the next start would read every record)
            raise

    async def _start_job(self, spec: dict[str, Any], job_id: str, jdir: Path, digest: str, settings: list[str],
                         started: list[Proc]) -> str:
        """:meth:`submit`'s work once the spec is checked: the job's files, its process (put in
        ``started`` at once, for the caller to kill if what follows fails) and its record."""
        (jdir / "app").mkdir(mode=0o700, parents=True)
        await asyncio.to_thread(put_files, jdir / "app", spec["files"], spec["sha256"])  # (up to 32 MiB)
        placement = spec["placement"]
        if placement in spec["files"]:
            placement = str(jdir / "app" / placement)
        cmd = [sys.executable, "-m", "reactor.cli", "run", str(jdir / "app" / spec["app"]), "--placement", placement,
               "--seed", str(spec["seed"])]
        if spec["hosts"] is not None:
            cmd += ["--hosts", str(jdir / "app" / spec["hosts"])]
        for name in spec["files"]:
            if name not in (spec["app"], spec["placement"], spec["hosts"]):
                cmd += ["--with", str(jdir / "app" / name)]
        if spec["async"]:
            cmd.append("--async")
        if spec["restart"] is not None:
            cmd += ["--restart", spec["restart"]]
        cmd.append("--verbose")  # the job's log shows when its run started, and its restarts
        for a in settings:
            cmd += ["--set", a]
        # A job over several hosts reaches their daemons with this daemon's key pair.
        env = {**os.environ, "REACTOR_KEYS": str(self.keys_dir), "REACTOR_JOB_DIR": str(jdir),
               "REACTOR_JOB_EXIT_FILE": str(jdir / EXIT_FILE)}
        (jdir / "output.log").touch(mode=0o600)
        proc: Proc | None = await self.forks.spawn_async("cli", argv=["reactor", *cmd[3:]], cwd=jdir / "app", env=env,
                                                         log_path=jdir / "output.log", title="rx-job")
        if proc is None:
            out = open(jdir / "output.log", "wb")  # noqa: SIM115 - the child holds it; closed below
            try:
                proc = subprocess.Popen(cmd, cwd=jdir / "app", stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, env=env)
            finally:
                out.close()
        started.append(proc)
        pid, start = proc.pid, _pid_start_time(proc.pid) or 0
        # (over hosts: a hosts file, or a placement file naming hosts; `reactor logs JOB GROUP` tells its groups apart)
        over = over_hosts(placement, spec["hosts"])
        job = _Job({"id": job_id, "app": spec["app"], "placement": spec["placement"], "config": spec["config"],
                    "restart": spec["restart"], "over_hosts": over, "sha256": spec["sha256"], "spec_sha256": digest,
                    "state": "running", "pid": pid, "pid_start": start, "submitted_at": time.time(), "ended_at": None,
                    "returncode": None, "daemon": self.name}, jdir)
        job.proc = proc
        job.save()
        self.jobs[job_id] = job
        self._save_index()
        log.info("%s: job %s started (pid %d, %s): %s", self.name, job_id, pid,
                 "a new interpreter" if isinstance(proc, subprocess.Popen) else "forked", " ".join(cmd[3:]))
        if self._stop_phase is not None:  # (the daemon began to stop while the job started: stopped with the rest)
            self.stop(job_id, by="daemon")
        return job_id

    def stop(self, job_id: str, by: str = "request") -> dict[str, Any]:
        """Stop a running job cleanly (``by``: who asked, for ``status``: "request", a client's ``stop``; "daemon",
        this daemon stopping). Its run ends on the SIGTERM as a stopped run does (exit 143), which ``status``
        shows as stopped, not as an exit by a signal: that reads as a failure (a SIGTERM from elsewhere)."""
        job = self._job(job_id)
        self.watch()  # a job that has just ended is not signalled (its pid may be reused)
        if job.record["state"] != "running":
            return self.describe(job)
        if job.stop_deadline is not None:  # asked already: stopping (a repeat never escalates to the run's
            return self.describe(job)      # "second signal: at once"; the SIGKILL after the grace still comes)
        job.record["stop_requested"] = True
        job.record["stopped_by"] = by
        self._save(job)  # (the stop goes on if it cannot be written now: it is written at a later watch)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # The run's coordinator only: it stops its workers cleanly and reaps them (SIGTERM to
            # the whole group would make it report their deaths as a failure).
            os.kill(int(job.record["pid"]), signal.SIGTERM)
        job.stop_deadline = time.monotonic() + STOP_GRACE_S
        return self.describe(job)

    def watch(self) -> None:
        """Note jobs that ended; SIGKILL the process group of a stopped job past its grace; forget
        the oldest ended ones past ``keep_ended``."""
        ended = 0
        newly_ended = False
        for job in self.jobs.values():
            if job.record.get("state") != "running":
                ended += 1
                continue
            if job.alive():
                if job.stop_deadline is not None and time.monotonic() > job.stop_deadline:
                    if not job.hurried:  # the run's "stop at once": it still reaps and cleans up
                        job.hurried = True
                        job.stop_deadline = time.monotonic() + STOP_HURRY_S
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.kill(int(job.record["pid"]), signal.SIGTERM)
                    else:
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(int(job.record["pid"]), signal.SIGKILL)
                continue
            rc = job.proc.returncode if job.proc is not None else None
            if getattr(job.proc, "status_unknown", False):  # (its fork server died before it ended)
                rc = None
            if rc is None:  # not our child's (an earlier daemon's), or its parent died: as its command wrote it
                rc = _recorded_exit(job)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(job.record["pid"]), signal.SIGKILL)  # nothing of the job outlives it
            job.record["returncode"] = rc
            job.record["ended_at"] = time.time()
            if job.record.get("stop_requested"):
                job.record["state"] = "stopped"
            elif rc == 0:
                job.record["state"] = "finished"
            elif rc is not None:
                job.record["state"] = "failed"
                if note := full_disk_note(job.dir):
                    job.record["detail"] = note
                    log.warning("%s: job %s failed; %s", self.name, job.id, note)
            elif job.proc is not None:  # forked by a fork server that died before the job ended
                job.record["state"] = "ended"
                job.record["detail"] = "the fork server that started it died before it ended: its exit status is unknown"
            else:  # adopted from an earlier life of the daemon: not our child, no exit status
                job.record["state"] = "ended"
                job.record["detail"] = "it was started by an earlier daemon; its exit status is unknown"
            log.info("%s: job %s %s (exit status %s)", self.name, job.id, job.record["state"], rc)
            job.unsaved = True
            ended += 1
            newly_ended = True
        if newly_ended:  # what a job's run left if it could not clean up (its coordinator killed: SIGKILL after the grace)
            sweep_stale()
        for job in self.jobs.values():
            if job.unsaved:  # (written again at each watch until it can be: a full disk, no descriptors left)
                self._save(job)
        if self._index_unsaved:
            self._save_index()
        if ended > self.keep_ended:
            self._forget_ended()

    def describe(self, job: _Job) -> dict[str, Any]:
        r = job.record
        ended = r.get("ended_at") or time.time()
        return {"id": job.id, "app": r["app"], "placement": r["placement"], "state": r["state"], "pid": r["pid"],
                "uptime_s": round(ended - r["submitted_at"], 3), "returncode": r.get("returncode"),
                "detail": r.get("detail", ""), "last_line": _last_line(job.dir / "output.log"),
                # (who asked a stopped job to stop; None: its record does not say, as one kept from before it did)
                "stopped_by": r.get("stopped_by") if r.get("stopped_by") in ("request", "daemon") else None,
                "over_hosts": r.get("over_hosts") if type(r.get("over_hosts")) is bool else None,
                "daemon": r.get("daemon", self.name), **_job_groups(job.dir),
                **(_local_workers(job.dir) if r["state"] == "running" else {})}

    def logs(self, job_id: str, offset: int) -> dict[str, Any]:
        job = self._job(job_id)
        data, offset = read_chunk(job.dir / "output.log", offset)
        return {"data": data, "offset": offset, "done": job.record["state"] != "running"}

    def _job(self, job_id: str) -> _Job:
        job = self.jobs.get(job_id)
        if job is None:
            if _ended_record(self.state / "jobs" / job_id / "job.json"):
                raise DaemonError(f"daemon {self.name!r} no longer tracks job {job_id!r}: it ended, and the daemon keeps "
                                  f"its newest {self.keep_ended} ended jobs (--keep-ended); its files are in "
                                  f"{self.state / 'jobs' / job_id}")
            raise DaemonError(f"daemon {self.name!r} has no job {job_id!r} (reactor status lists its jobs)")
        return job

    def stop_all(self) -> None:
        for job in self.jobs.values():
            if job.record["state"] == "running":
                self.stop(job.id, by="daemon")

    # -------------------------------------------------------------------------- serving

    def handle(self, msg: Any) -> tuple[bool, Any]:
        """Answer a checked request of a kind answered at once (not one of ``STARTS``)."""
        kind = msg[1]
        if kind == "ping":
            return True, {"name": self.name, "jobs": len(self.jobs), "pid": os.getpid(), "fork_server": self.forks.state(),
                          "reactor": build_id(), "python": python_version(), "memory": available_host_bytes(),
                          "worker_memory": self.hosted.worker_memory}
        if kind == "status":
            if msg[2] is None:
                return True, [self.describe(j) for j in self.jobs.values()]
            return True, self.describe(self._job(msg[2]))
        if kind == "logs":
            return True, self.logs(msg[2], msg[3])
        if kind == "stop":
            return True, self.stop(msg[2])
        if kind == "hosted":
            return True, self.hosted.describe()
        if kind == "workers":
            return True, self.hosted.workers(msg[2])
        if kind == "end":
            return True, self.hosted.end(msg[2])
        if kind == "worker_log":
            return True, self.hosted.log(msg[2], msg[3], msg[4])
        if kind == "run_file":
            return True, self.hosted.run_file(msg[2], msg[3], msg[4])
        raise AssertionError(kind)  # the schema admits no other kind (STARTS: start; IN_THREAD: in_thread)

    async def start(self, msg: Any) -> tuple[bool, Any]:
        """Answer a checked request of one of ``STARTS``: a job or a worker started, its process forked
        while the daemon answers other requests."""
        if self._stop_phase is not None:  # (stop_all has been; none would be stopped)
            raise DaemonError(f"daemon {self.name!r} is stopping: it takes no new jobs or workers")
        self._starting += 1
        try:
            if msg[1] == "submit":
                return True, await self.submit(msg[2])
            return True, await self.hosted.spawn(msg[2])
        finally:
            self._starting -= 1

    async def in_thread(self, msg: Any) -> tuple[bool, Any]:
        """Answer a checked request of one of ``IN_THREAD`` (``run_files``): the run is looked up (its
        lease renewed) here, its directory listed in a thread, bounded (``list_run_files``); while stopping
        too (a run's coordinator copies its files back as it stops)."""
        with self.hosted.asked(msg[2]) as run:
            return True, await asyncio.to_thread(list_run_files, run.dir)

    async def serve(self, ready: Any = None) -> None:
        """Serve until SIGTERM or SIGINT; then stop the running jobs, answering on meanwhile, and end
        the runs hosted here once they have ended (:meth:`_stop_done`)."""
        ctx = zmq.asyncio.Context()
        auth = zmq.auth.asyncio.AsyncioAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=self.authorized)
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_NBYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Replies queued for one client at most (each up to a 1 MiB log chunk): one that asks and never
        # reads gets the rest dropped, instead of the daemon holding ~1 GiB for it (zmq's default 1000).
        sock.setsockopt(zmq.SNDHWM, REPLIES_QUEUED_MAX)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        sock.curve_server = True
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        try:
            try:
                sock.bind(self.listen)
            except zmq.ZMQError as e:  # (a port in use, an address not of this host, a name that does not resolve)
                hint = {errno.EADDRINUSE: " (another daemon or program holds it)",
                        errno.EADDRNOTAVAIL: " (not an address of this host)",
                        errno.ENODEV: " (no interface or host of that name here)",
                        errno.EINVAL: " (a daemon listens on tcp://ADDR:PORT)"}.get(e.errno, "")
                raise OSError(e.errno, f"daemon {self.name!r} cannot listen on {self.listen}: "
                                       f"{zmq.strerror(e.errno)}{hint}") from None
            # Its fork server once the address is its own: a daemon that cannot listen starts none (it
            # would be closed at once, and its cut-short start read as a failure worth a warning). Its
            # descriptors first, which the server, the jobs and the workers it starts inherit: it serves
            # many clients, and a large run's workers each link to their peers (the common soft limit,
            # 1,024, is a tenth of what a 150-host run's links take).
            raise_open_files(DAEMON_OPEN_FILES)
            self.forks.start()
            address = sock.get(zmq.LAST_ENDPOINT).decode()
            # Where other hosts reach it: a wildcard's port at --advertise (what a hosts file takes);
            # None where nothing says (a wildcard without --advertise).
            port = address.rsplit(":", 1)[1]
            self.reach = f"tcp://{self.advertise}:{port}" if self.advertise else None
            _atomic_json(self.state / "daemon.json", {"name": self.name, "address": address, "pid": os.getpid(),
                                                      "public_key": self.keys.public.decode(), "advertised": self.reach})
            if ready is not None:
                ready(address)
            log.info("%s: serving on %s, state in %s", self.name, address, self.state)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            watcher = asyncio.ensure_future(self._watch_forever())
            # Wait by polling, then read without blocking: a recv cancelled by a timeout could lose
            # the request it was taking (one heartbeat in a few was lost that way, in phase with
            # the timeout); a cancelled poll loses nothing.
            plain = zmq.Socket.shadow(sock.underlying)
            try:
                while not self._stop_done(stop):
                    await sock.poll(int(WATCH_PERIOD_S * 1000) if self._stop_phase else 500, zmq.POLLIN)
                    while True:
                        try:
                            frames = plain.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            reply = self._answer(frames)
                        except Exception:  # noqa: BLE001 - no request, however malformed, ends the daemon
                            self.refused += 1
                            if flood_logged(self.refused):
                                log.exception("%s: dropped a request that failed its checks%s", self.name,
                                              flood_tally(self.refused))
                            reply = None
                        if asyncio.iscoroutine(reply):  # (a start: answered when its process is; IN_THREAD)
                            task = asyncio.ensure_future(self._send_when_done(plain, reply))
                            self._later.add(task)
                            task.add_done_callback(self._later.discard)
                        elif reply is not None:
                            with contextlib.suppress(zmq.ZMQError):  # the client left
                                plain.send_multipart(reply, zmq.NOBLOCK)
            finally:
                watcher.cancel()
                for task in self._later:  # (no start once its stop is done: only on the way out of a failure)
                    task.cancel()
                for task in [watcher, *self._later]:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            self._watch_once()
            log.info("%s: stopped", self.name)
        finally:
            self._held.release()
            self.forks.close()
            if self.remover is not None:
                self.remover.close()
            sock.close(linger=0)
            auth.stop()
            ctx.destroy(linger=0)

    def _stop_done(self, stop: asyncio.Event) -> bool:
        """Whether the daemon's stop is done (its serving loop then ends). On SIGTERM it stops its jobs
        while it still answers (a job's coordinator heartbeats the daemons of its run, this one among
        them, ends its workers and fetches its files through them as it stops); once they have ended,
        or their grace and escalation are over, it ends the runs it hosts and answers on until their
        workers are gone (or ``END_GRACE_S`` and a margin have passed). With ``stop_after_runs_s`` it
        first lets their coordinators end them (``HostedRuns.let_go``: a run ended here, by its
        coordinator or its lease, whose coordinator has then gone quiet), for up to that long: the
        daemons of a Slurm job get the SIGTERM of ``scancel`` with the job's coordinator, which stops the
        run cleanly through them and copies its files back (ending the runs at once failed it, its
        hosts lost under it); bounded, so that the daemon still ends what is left and removes its
        shared memory before Slurm's SIGKILL (``reactor slurm`` gives its KillWait less a margin)."""
        if not stop.is_set():
            return False
        now = time.monotonic()
        if self._stop_phase is None:
            log.info("%s: stopping: its running jobs first", self.name)
            self._stop_phase, self._stop_deadline = "jobs", now + STOP_GRACE_S + STOP_HURRY_S + 5
            try:
                self.stop_all()
            except Exception:  # noqa: BLE001 - the runs hosted here are ended all the same
                log.exception("%s: stop_all failed", self.name)
        if self._stop_phase == "jobs":
            if (any(j.record["state"] == "running" for j in self.jobs.values()) or self._starting) \
                    and now < self._stop_deadline:  # (a job starting now is stopped as it starts: _start_job)
                return False
            if self.stop_after_runs_s is not None and not self.hosted.let_go(now):
                log.info("%s: gives the coordinators of the runs it hosts up to %g s to end them", self.name,
                         self.stop_after_runs_s)
            self._stop_phase, self._stop_deadline = "runs", now + (self.stop_after_runs_s or 0.0)
        if self._stop_phase == "runs":
            if not self.hosted.let_go(now) and now < self._stop_deadline:
                return False
            self._stop_phase, self._stop_deadline = "hosted", now + END_GRACE_S + 5
            try:
                self.hosted.end_all()
            except Exception:  # noqa: BLE001 - the daemon stops all the same
                log.exception("%s: ending the runs it hosts failed", self.name)
        return not self.hosted.live() or now >= self._stop_deadline

    @staticmethod
    async def _send_when_done(sock: zmq.Socket[bytes], reply: Coroutine[Any, Any, list[bytes]]) -> None:
        frames = await reply
        with contextlib.suppress(zmq.ZMQError):  # the client left
            sock.send_multipart(frames, zmq.NOBLOCK)

    def _answer(self, frames: list[bytes]) -> list[bytes] | Coroutine[Any, Any, list[bytes]] | None:
        """One request's reply frames; for one of ``STARTS``, a coroutine that returns them once its
        process has started (for one of ``IN_THREAD``, once its thread is done); or None for a frame not
        worth an answer (logged)."""
        if len(frames) != 3 or frames[1] != b"":
            return self._refuse(frames[0] if frames else b"?", f"{len(frames)} frames, expected [id, b'', request]")
        ident, _, body = frames
        try:
            msg = msgpack.unpackb(body, raw=False, strict_map_key=True)  # MAXMSGSIZE bounds it
        except Exception as exc:  # noqa: BLE001 - any undecodable body is the peer's problem
            return self._refuse(ident, f"not msgpack ({type(exc).__name__})")
        why = check_request(msg)
        if why is not None:
            if type(msg) is list and msg and type(msg[0]) is int and 0 <= msg[0] < 2**63:
                self._refuse(ident, why)
                return [ident, b"", msgpack.packb([msg[0], False, f"bad request: {why}"])]
            return self._refuse(ident, why)
        if msg[1] in STARTS or msg[1] in IN_THREAD:
            return self._answer_later(ident, msg)
        try:
            ok, payload = self.handle(msg)
        except DaemonError as exc:
            ok, payload = False, str(exc)
        except Exception as exc:  # noqa: BLE001 - a failing request must not take the daemon down
            ok, payload = False, self._failed(msg[1], exc)
        return [ident, b"", msgpack.packb([msg[0], ok, payload], use_bin_type=True)]

    async def _answer_later(self, ident: bytes, msg: Any) -> list[bytes]:
        try:
            ok, payload = await (self.start(msg) if msg[1] in STARTS else self.in_thread(msg))
        except DaemonFullError as exc:  # (its kind after the text: the coordinator tries the group's next host)
            return [ident, b"", msgpack.packb([msg[0], False, str(exc), "full"], use_bin_type=True)]
        except DaemonError as exc:
            ok, payload = False, str(exc)
        except Exception as exc:  # noqa: BLE001 - a failing request must not take the daemon down
            ok, payload = False, self._failed(msg[1], exc)
        return [ident, b"", msgpack.packb([msg[0], ok, payload], use_bin_type=True)]

    def _failed(self, kind: str, exc: Exception) -> str:
        """Log a request that failed (not refused): the host's trouble (an ``OSError``: a full disk, no
        descriptors left) in one line, each time, a bug with its traceback; return the client's answer.
        (A full disk at submit was a traceback in the daemon's log at every try.)"""
        if not isinstance(exc, OSError):
            log.exception("%s: request %s failed", self.name, kind)
            return f"the daemon failed to {kind}: {type(exc).__name__}: {exc}"
        why = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # (most likely the state directory's: say where that is)
            why += (": its disk is full (or a quota there)" if exc.filename else
                    f": the disk of {self.state} is full (or a quota there)") + ": free space there, then ask again"
        log.warning("%s: could not %s: %s", self.name, kind, why)
        return f"daemon {self.name!r} could not {kind}: {why}"

    def _refuse(self, ident: bytes, why: str) -> None:
        """Count and log a refused request (answered with the reason where it has a usable id)."""
        self.refused += 1
        if flood_logged(self.refused):  # (a flood of garbage is not a flood of lines)
            log.warning("%s: refused a request from %r: %s%s", self.name, ident[:32], why, flood_tally(self.refused))
        return None

    def _save(self, job: _Job) -> bool:
        """Write ``job``'s record; one that cannot be written now is logged (once a minute) and
        written again at the next watch, but not one whose directory was removed (logged, kept in memory).
        Returns whether it was written."""
        try:
            job.save()
        except OSError as e:
            if not job.dir.is_dir():  # (removed by hand: nothing to write into, now or at a later watch)
                job.unsaved = False
                log.warning("%s: job %s's directory %s was removed: its record (%s) is kept in memory only, and a "
                            "restarted daemon will not list it", self.name, job.id, job.dir, job.record["state"])
                return False
            job.unsaved = True
            self._warn(f"save {job.id}", "%s: cannot write job %s's record (%s); trying again", self.name, job.id, e)
            return False
        job.unsaved = False
        self._warned.pop(f"save {job.id}", None)
        return True

    def _warn(self, what: str, message: str, *args: Any) -> None:
        """Log ``message`` unless the same ``what`` was logged in the last ``WATCH_WARN_EVERY_S``."""
        now = time.monotonic()
        if now - self._warned.get(what, -math.inf) >= WATCH_WARN_EVERY_S:
            self._warned[what] = now
            log.warning(message, *args)

    def _watch_once(self) -> None:
        """One round of :meth:`watch` and the hosted runs' watch: whatever fails in it (a record the disk
        cannot take, no descriptors left) is logged, and the next round runs all the same."""
        for part in (self.watch, self.hosted.watch):
            try:
                part()
            except Exception as e:  # noqa: BLE001 - the watch must outlive any one failure
                self._warn(f"watch {part.__qualname__} {type(e).__name__}", "%s: the watch of its jobs failed (%s: %s); "
                           "it goes on", self.name, type(e).__name__, e)

    async def _watch_forever(self) -> None:
        while True:
            self._watch_once()
            await asyncio.sleep(WATCH_PERIOD_S)


_ADVERTISE_RE = re.compile(r"(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-]+)?\]|[A-Za-z0-9_.\-]+)\Z")


def advertise_error(advertise: str) -> str | None:
    """Why ``--advertise`` cannot be where this daemon's workers bind (``tcp://ADVERTISE:*``) and
    other hosts reach them, or None. It is a host name or an IP address of this host (``[v6]``),
    not an address with a scheme or a port: ``tcp://10.0.0.3:7000`` was taken, and every worker of
    a run over hosts then died at its bind, the run saying only "exited with status 1"."""
    if not _ADVERTISE_RE.match(advertise) or advertise.strip("[]") in ("*", "0.0.0.0", "::"):
        return ("it is the host name or IP address other hosts reach this one at (10.0.0.3, node3, [fd00::3]), "
                "without tcp:// or a port: its workers bind there")
    host = advertise.strip("[]").split("%")[0] if advertise.startswith("[") else advertise
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"it does not resolve here ({getattr(e, 'strerror', None) or e}): its workers bind there"
    family, _, _, _, sockaddr = infos[0]
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(sockaddr[:1] + (0,) + tuple(sockaddr[2:]))
    except OSError as e:
        return f"not an address of this host ({e.strerror or e}): its workers bind there"
    return None


def _advertised(listen: str) -> str | None:
    """The interface a daemon's workers bind to: its listen address's host; None for a wildcard
    (other hosts cannot dial it: a daemon listening on one is refused without ``--advertise``)."""
    host = listen[len("tcp://"):].rsplit(":", 1)[0] if listen.startswith("tcp://") else ""
    if host in ("", "*", "0.0.0.0", "[::]", "::"):
        return None
    return _interface_address(host) or host


def _interface_address(name: str) -> str | None:
    """The IPv4 address of the interface ``name`` (``--listen tcp://eth0:0``), or None if it is no interface
    of this host or has none: the daemon printed ``tcp://eth0:PORT`` as where other hosts reach it, which
    a hosts file takes and no other host resolves."""
    from ._hosting import ipv4_of

    if name not in {n for _, n in socket.if_nameindex()}:
        return None
    return ipv4_of(name)
