"""The workers of a run on this host (:class:`_LocalWorkers`): started from a fork server or as new
interpreters, recorded for ``reactor status`` when the run is a daemon's job, reaped at the run's end
(SIGTERM, then SIGKILL after one grace for them all: :func:`_reap`), and the shared-memory segments a
killed one left removed (:func:`_cleanup_segments`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._forkserver import (
    DEFAULT_PRELOAD,
    ForkedProcess,
    ForkServer,
    ForkServerError,
    kept_or_new,
    release_kept,
    take_early,
)
from ._groups import Group

log = logging.getLogger("reactor.coordinator")

#: The least memory a worker process takes once up (a fork of the fork server, its own pages only).
#: Measured: 121 MB private for an actor of ``apps/dqn.py``, 151 MB for its learner (torch's state,
#: the app's modules, the reactor runtime); a floor under both, so that a count refused on it could
#: never have run, whatever the app.
WORKER_MEMORY_FLOOR = 64 * 2**20


def worker_memory_error(workers: int, available: int | None, where: str = "this host",
                        floor: int = WORKER_MEMORY_FLOOR) -> str | None:
    """Why ``workers`` more worker processes cannot start ``where`` with ``available`` bytes of memory
    left (``reactor._hostmemory.available_host_bytes``; None: unknown, never refused), or None. A
    placement that asks for more processes than the host can hold (``--set actors=60000``) is refused
    here, before any starts, instead of filling the host until its OOM killer ends what it picks."""
    if available is None or workers * floor <= available:
        return None
    return (f"{workers} worker processes on {where} need at least {_size(workers * floor, up=True)} "
            f"at {_size(floor, up=True)} each, and {where} has {_size(available, up=False)} available "
            f"({_AVAILABLE}): run fewer replicas (--set), put fewer groups on it, or spread the run over hosts")


def spawn_memory_error(available: int | None, floor: int, where: str) -> str | None:
    """Why a daemon starts no worker now (``floor``: its ``--worker-memory-mb``, in bytes) with ``available``
    bytes left on its host (None: unknown, never refused), or None."""
    if available is None or floor <= available:
        return None
    return (f"{where} has {_size(available, up=False)} available ({_AVAILABLE}), less than the "
            f"{_size(floor, up=True)} a worker takes there (its daemon's --worker-memory-mb)")


_AVAILABLE = "MemAvailable and free swap, or its memory cgroup's limit"


def _size(n: int, up: bool) -> str:
    """``n`` bytes in whole MiB (from 10 GiB, GiB to a tenth), rounded up (a need) or down (what a host
    has): said in GiB to a tenth, a need of 64 MiB and 60 MiB available both read "0.1 GiB"."""
    if n >= 10 * 2**30:
        tenths = -(-n * 10 // 2**30) if up else n * 10 // 2**30
        return f"{tenths / 10:.1f} GiB"
    return f"{-(-n // 2**20) if up else n // 2**20} MiB"


class _LocalWorkers:
    """The workers of a run on this host: forked from a fork server (it imports torch and reactor's
    nodes once, while the coordinator sets up: a worker is then up in milliseconds instead of
    importing them anew), or, with ``REACTOR_FORK_SERVER=0`` or when the server fails, started as new
    interpreters (``python -m reactor.launch._worker``). The server is the one ``reactor run`` started
    before it imported the app, else the process's kept server (``kept_or_new``: started by its first
    run and used again by the next ones). Either way a worker's spec goes on its stdin, and it dies
    with the coordinator's process (through the server, which dies with it); the run reaps its own
    workers at its end."""

    settle_s = 0.5  # how long a worker's death may take to show in dead()

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD) -> None:
        self.procs: dict[str, subprocess.Popen[bytes] | ForkedProcess] = {}
        self.lives: dict[str, int] = {}  # workers started per group (more than one: restarts)
        self.forks: ForkServer | None = None
        self.owns_forks = True  # else the process's kept server: left running at the run's end
        early = take_early()  # `reactor run` started one before it imported the app
        if early is not None:
            self.forks = early
        elif os.environ.get("REACTOR_FORK_SERVER", "1") != "0":
            try:
                # from the thread that runs the run: the server dies with it
                self.forks, self.owns_forks = kept_or_new(preload)
            except OSError as e:
                log.warning("no fork server (%s): workers start as new interpreters", e)

    async def ready(self) -> None:
        """Wait for the fork server's imports (before the first start)."""
        if self.forks is None or self.forks.preloaded or self.forks.failed:
            return
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.forks.wait_ready)
        except (ForkServerError, OSError) as e:
            log.warning("%s: workers start as new interpreters", e)
            if not self.owns_forks:
                release_kept(self.forks)
            self.forks.close()  # (a kept one too: it did not start, for any run)
            self.forks = None

    def start(self, group: Group, spec: dict[str, Any]) -> None:
        # The group in the environment, and as the process's name (rx:GROUP, what `ps -e` shows).
        env = {**os.environ, "REACTOR_WORKER_GROUP": group.name, "REACTOR_PARENT_PID": str(os.getpid())}
        cmd = [sys.executable, "-m", "reactor.launch._worker"]
        data = json.dumps(spec).encode()
        if self.forks is not None and self.forks.alive:
            try:
                self.procs[group.name] = self.forks.spawn("worker", argv=cmd, cwd=os.getcwd(), env=env, stdin=data,
                                                          log_path=None, title=f"rx:{group.name}", session=False)
                self._started(group.name)
                return
            except ForkServerError as e:
                log.warning("%s: worker %r starts as a new interpreter", e, group.name)
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
        assert p.stdin is not None
        p.stdin.write(data)
        p.stdin.close()
        self.procs[group.name] = p
        self._started(group.name)

    def _started(self, group: str) -> None:
        """A worker started: a daemon's job (``REACTOR_JOB_DIR`` set) writes its workers, each pid with its
        start time, in ``workers.json`` there, so that ``reactor status`` shows how many are alive (a job's
        local workers are its coordinator's children, not the daemon's: it showed none); a run started by
        ``reactor run`` writes nothing."""
        self.lives[group] = self.lives.get(group, 0) + 1
        jdir = os.environ.get("REACTOR_JOB_DIR")
        if not jdir:
            return
        from .._files import replace_small
        from ..transport._shm import _pid_start_time

        workers = {}
        for name, p in self.procs.items():
            start = p.start if isinstance(p, ForkedProcess) else _pid_start_time(p.pid)
            workers[name] = {"pid": p.pid, "start": start or 0, "restarts": self.lives.get(name, 1) - 1}
        try:
            replace_small(Path(jdir) / "workers.json",
                          json.dumps({"run": os.environ.get("REACTOR_RUN_ID"), "workers": workers}).encode())
        except OSError as e:  # (what status shows; the run goes on)
            log.warning("cannot write the job's workers.json (%s): reactor status will not show its workers", e)

    def dead(self) -> dict[str, tuple[int | None, str]]:
        """The workers that ended: ``(exit status, "")``; ``(None, why)`` for one that ended after its fork
        server, whose status no one could read (a SIGTERM to the whole group ends both: its shutdown
        reactions may well have run, and a status of -SIGTERM said they were cut)."""
        return {name: (None, _UNKNOWN) if getattr(p, "status_unknown", False) else (rc, "")
                for name, p in self.procs.items() if (rc := p.poll()) is not None}

    def kill(self, name: str) -> bool:
        """SIGKILL worker ``name`` now (one held where nothing else ends it); whether it was there to kill."""
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return False
        p.kill()
        return True

    async def reap(self, timeout_s: float) -> None:
        await _reap(self.procs, timeout_s)

    async def close(self) -> None:
        if self.forks is not None:
            if self.owns_forks:
                self.forks.close()
            else:
                release_kept(self.forks)


_UNKNOWN = "ended after its fork server, so its exit status is unknown"


def _cleanup_segments(run_id: str) -> None:
    """Unlink the shared-memory segments of this run that a killed worker left behind. Every worker of the
    run is reaped by now (all of them ran here), so a segment still being created (no header yet: kept
    for a while when its creator may be alive) is one a worker killed in the act left: it goes too."""
    from ..transport._shm import cleanup_stale

    for name in cleanup_stale(run_id, grace_s=0.0):
        log.warning("removed the shared-memory segment %s of a worker that did not close it", name)


#: After the reaping's SIGTERM, how long the workers left have, together, before SIGKILL.
TERM_GRACE_S = 5.0


async def _reap(procs: dict[str, subprocess.Popen[bytes] | ForkedProcess], timeout_s: float) -> None:
    """Wait for every worker; SIGTERM the ones that outlive ``timeout_s``, and SIGKILL those that
    outlive ``TERM_GRACE_S`` more: one grace for them all (each waited ``TERM_GRACE_S`` in turn, so N
    workers held in a reaction that does not hear SIGTERM took N times as long to reap)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while any(p.poll() is None for p in procs.values()) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    deadline = loop.time() + TERM_GRACE_S
    while any(p.poll() is None for p in procs.values()) and loop.time() < deadline:
        await asyncio.sleep(0.02)
    for p in procs.values():
        if p.poll() is None:
            p.kill()
    for p in procs.values():
        p.wait()
