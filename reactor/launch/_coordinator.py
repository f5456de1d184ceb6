"""The coordinator of a multi-process run: starts workers, wires them, ends the run, reaps them.

It owns the run's lifecycle and nothing else: messages between reactors never pass through it.
It ends the run when every worker has finished (stop time reached), when one asks to stop, on
SIGINT/SIGTERM, or on quiescence, detected by counting: when every worker reports idle and the
messages sent and received add up, it probes all of them once more, and stops only if the
counts are unchanged (a message in flight would show as a difference).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import PeerLostError, ReactorError, TraceMismatchError
from .._graph import Graph
from ._cluster import RemoteWorkers, address_towards
from ._groups import Group
from ._placement import check_lookahead, resolve_placement
from ._protocol import COORDINATOR, CoordinatorProtocol
from ._result import RunResult
from ._rundir import open_run_dir, remove_run_dir, sweep_stale
from ._signals import stop_signals

log = logging.getLogger("reactor.coordinator")
START_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 20.0


class WorkerFailedError(ReactorError):
    """A worker process raised or died; its message or exit status is included."""


async def run_processes(
    graph: Graph,
    *,
    placement: str,
    deterministic: bool,
    seed: int,
    stop_ns: int | None,
    record: Any,
    replay: Any,
    digest: bool,
    app: str | None,
    config: Mapping[str, Any],
    flow_limit: int = 4096,
    hosts: str | None = None,
    with_files: Sequence[str] = (),
) -> RunResult:
    from ..transport import Endpoint

    if app is None:
        raise ValueError(
            f"placement {placement!r} needs the app file: workers rebuild the graph from it "
            "(use `reactor run APP --placement ...` or run(graph, app=PATH, config=...))"
        )
    plan = resolve_placement(graph, placement, hosts)
    groups = plan.groups
    if deterministic:
        check_lookahead(graph, groups, placement)
    if replay is not None:
        from .._trace import read_trace

        read_trace(replay)  # fail here, in one line, rather than in every worker
    owner_of = {n: g.name for g in groups for n in g.reactors}
    # Run directories and shared-memory segments left by runs whose coordinator was killed go first.
    sweep_stale()
    run_id = os.environ.get("REACTOR_RUN_ID") or "run"
    sockdir = open_run_dir(run_id)
    # Links that leave the host (any tcp bind, any run over hosts) are encrypted and authenticated
    # with CURVE: one key pair per run, handed to each worker on its stdin, or through its daemon over
    # that daemon's CURVE link (never in the clear); every endpoint of the run, the coordinator's
    # too, then admits only peers holding it.
    curve = keys = None
    if plan.hosts or any(g.bind is not None and g.bind.startswith("tcp://") for g in groups):
        from ..transport import CurveKeys

        keys = CurveKeys.generate()
        curve = {"public": keys.public.decode(), "secret": keys.secret.decode()}
    workers: _LocalWorkers | RemoteWorkers
    if plan.hosts:
        from ._keys import default_keys_dir, load_keys

        workers = RemoteWorkers(run_id, plan.hosts, load_keys(default_keys_dir()), plan.settings["heartbeat_timeout_s"])
        app_name = workers.ship(app, [*with_files, *([replay] if replay is not None else [])])
        head = plan.hosts[groups[0].hosts[0]]
        here = address_towards(head.address)
        bind = f"tcp://{here}:*"
        dist_store = _dist_store(graph, here)
    else:
        workers = _LocalWorkers()
        bind = f"ipc://{sockdir}/coordinator"
        dist_store = None
    ep = await Endpoint.open(COORDINATOR, bind, curve=keys, accept=CoordinatorProtocol(g.name for g in groups))
    loop = asyncio.get_running_loop()
    with stop_signals() as signalled:
        try:
            for g in groups:
                spec = {
                    "group": g.name,
                    "app": str(Path(app).resolve()),
                    "config": dict(config),
                    "owner_of": owner_of,
                    "bind": g.bind or f"ipc://{sockdir}/{g.name}",
                    "coordinator": ep.address,
                    "deterministic": deterministic,
                    "seed": seed,
                    "stop_ns": stop_ns,
                    "record": record is not None,
                    "replay": str(replay) if replay is not None else None,
                    "digest": digest,
                    "max_message_nbytes": 64 * 2**20,
                    "curve": curve,
                    "flow_limit": flow_limit,
                    "log_level": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
                    "dist_store": f"{here}:{dist_store.port}" if dist_store is not None else None,
                }
                if isinstance(workers, RemoteWorkers):
                    if replay is not None:  # shipped beside the app; the worker runs in the app's parent
                        spec["replay"] = f"app/{Path(replay).name}"
                    await workers.start(g, spec, app_name)
                else:
                    workers.start(g, spec)
            if isinstance(workers, RemoteWorkers):
                workers.start_heartbeat()
            session = _Session(ep, workers, [g.name for g in groups], signalled)
            addresses = await session.gather("hello", START_TIMEOUT_S)
            for g in groups:
                await ep.connect(g.name, addresses[g.name][0], server_public_key=keys.public if keys else None)
            for g in groups:
                ep.send_nowait(g.name, ("peers", {k: v[0] for k, v in addresses.items()}))
            await session.gather("ready", START_TIMEOUT_S)
            for g in groups:
                ep.send_nowait(g.name, ("start",))
            deadline = None if deterministic or stop_ns is None or replay is not None else loop.time() + stop_ns / 1e9
            stopped_by, results = await session.supervise(deadline)
            for g in groups:
                with contextlib.suppress(Exception):
                    ep.send_nowait(g.name, ("exit",))
                ep.disconnect(g.name)  # workers exit now: that is not a lost peer
            events: dict[str, int] = {}
            digests: dict[str, str] = {}
            traces: list[dict[str, Any]] = []
            incomplete = [r["replay_incomplete"] for r in results.values() if r.get("replay_incomplete")]
            if incomplete:
                raise TraceMismatchError("; ".join(incomplete))
            for res in results.values():
                events.update(res["events"])
                digests.update(res["digests"])
                traces.append(res["trace"])
            if record is not None:
                from .._trace import merge_events, write_trace

                write_trace(record, {"seed": seed, "placement": placement, "events": merge_events(traces)})
            await workers.reap(EXIT_TIMEOUT_S)
            return RunResult(
                digests=digests,
                events=events,
                placement=placement,
                stopped_by=stopped_by,
                processes={name: res["stats"] for name, res in results.items()},
                dropped={COORDINATOR: ep.statistics().dropped, **{n: res["stats"]["dropped"] for n, res in results.items()}},
                hosts=dict(getattr(workers, "host_of", {})),
            )
        finally:
            await workers.reap(0.0)
            await workers.close()
            await ep.aclose()
            remove_run_dir(sockdir)
            if isinstance(workers, _LocalWorkers) and workers.procs:
                _cleanup_segments(run_id)


def _dist_store(graph: Graph, here: str) -> Any:
    """Data-parallel learners over hosts rendezvous through a ``torch.distributed`` TCP store that
    the coordinator serves on its interface for the run (on one host: a file in the run directory).
    None when the graph has fewer than two learners."""
    learners = sum(getattr(node.reactor_type, "placement_role", None) == "learner" for node, _, _ in graph.instances())
    if learners < 2:
        return None
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(here.strip("[]"), 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=START_TIMEOUT_S))


class _LocalWorkers:
    """The workers of a run on this host: children of the coordinator."""

    settle_s = 0.5  # how long a worker's death may take to show in dead()

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, group: Group, spec: dict[str, Any]) -> None:
        # The group in the environment: `ps e`, and tests, tell the workers apart by it.
        p = subprocess.Popen([sys.executable, "-m", "reactor.launch._worker"], stdin=subprocess.PIPE,
                             env={**os.environ, "REACTOR_WORKER_GROUP": group.name})
        assert p.stdin is not None
        p.stdin.write(json.dumps(spec).encode())
        p.stdin.close()
        self.procs[group.name] = p

    def dead(self) -> dict[str, tuple[int | None, str]]:
        return {name: (rc, "") for name, p in self.procs.items() if (rc := p.poll()) is not None}

    async def reap(self, timeout_s: float) -> None:
        await _reap(self.procs, timeout_s)

    async def close(self) -> None:
        pass


class _Session:
    def __init__(self, ep: Any, workers: _LocalWorkers | RemoteWorkers, names: list[str],
                 signalled: asyncio.Event) -> None:
        self.ep = ep
        self.workers = workers
        self.procs = names
        self.signalled = signalled
        self.status: dict[str, tuple[int, bool, int, int]] = {}
        self.results: dict[str, Any] = {}
        self.epoch = 0
        self.probe_snapshot: tuple[int, int] | None = None
        self.replay_done: set[str] = set()

    def _check_children(self) -> None:
        dead = {name: how for name, how in self.workers.dead().items() if name not in self.results}
        if dead:
            raise WorkerFailedError(_describe_exits(dead))

    async def _batch(self) -> list[tuple[str, Any]]:
        batch = await self.ep.recv_batch(timeout_s=0.2)
        for peer, msg in batch:
            if msg[0] == "error":
                if msg[1].startswith("PeerLostError"):
                    # It lost a peer: name the peer's end first when it shows within the time
                    # its death takes to be seen (a remote one's, a heartbeat or two).
                    end = asyncio.get_running_loop().time() + self.workers.settle_s
                    while asyncio.get_running_loop().time() < end:
                        dead = {n: how for n, how in self.workers.dead().items() if n not in self.results and n != peer}
                        if dead:
                            first = msg[1].splitlines()[0]
                            raise WorkerFailedError(f"{_describe_exits(dead)}; then worker {peer!r} failed: {first}")
                        await asyncio.sleep(0.02)
                raise WorkerFailedError(f"worker {peer!r} failed:\n{msg[1]}")
        return batch

    async def gather(self, what: str, timeout_s: float) -> dict[str, Any]:
        got: dict[str, Any] = {}
        async with asyncio.timeout(timeout_s):
            while len(got) < len(self.procs):
                if self.signalled.is_set():
                    raise KeyboardInterrupt
                self._check_children()
                for peer, msg in await self._batch():
                    if msg[0] == what:
                        got[peer] = msg[1:]
        return got

    async def supervise(self, deadline: float | None) -> tuple[str, dict[str, Any]]:
        """Run the run to its end (see the module docstring); a worker lost meanwhile ends it with
        ``WorkerFailedError`` naming the worker and how it ended."""
        try:
            return await self._supervise(deadline)
        except PeerLostError as e:
            # Our link to a worker went down (a probe or a stop found it gone): its process has
            # died or is dying. Name it by its exit, the first to die first, not by the link.
            loop = asyncio.get_running_loop()
            end = loop.time() + 5.0
            while loop.time() < end:
                self._check_children()
                await asyncio.sleep(0.02)
            raise WorkerFailedError(f"lost a worker: {e}") from e

    async def _supervise(self, deadline: float | None) -> tuple[str, dict[str, Any]]:
        stopped_by: str | None = None
        loop = asyncio.get_running_loop()
        while len(self.results) < len(self.procs):
            if self.signalled.is_set() and stopped_by is None:
                stopped_by = "signal"
                self._broadcast(("stop",))
            if deadline is not None and stopped_by is None and loop.time() >= deadline:
                stopped_by = "stop_time"
                self._broadcast(("stop",))
            self._check_children()
            for peer, msg in await self._batch():
                kind = msg[0]
                if kind == "done":
                    self.results[peer] = msg[1]
                elif kind == "status":
                    self.status[peer] = (msg[1], msg[2], msg[3], msg[4])
                elif kind == "stop_request" and stopped_by is None:
                    stopped_by = "request"
                    self._broadcast(("stop",))
                elif kind == "replay_done":
                    self.replay_done.add(peer)
                    if len(self.replay_done) == len(self.procs) and stopped_by is None:
                        stopped_by = "replay"
                        self._broadcast(("stop",))
            if stopped_by is None and self._quiescent():
                stopped_by = "quiescence"
                self._broadcast(("stop",))
        if stopped_by is None:  # every worker finished by itself: at the stop time, or with nothing left
            ended = {r.get("ended", "stop_time") for r in self.results.values()}
            stopped_by = "stop_time" if "stop_time" in ended else "quiescence"
        return stopped_by, self.results

    def _quiescent(self) -> bool:
        live = [n for n in self.procs if n not in self.results]
        if self.results and len(self.results) == len(self.procs):
            return False
        st = self.status
        if len(st) < len(self.procs) or not all(st[n][1] for n in live):
            self.probe_snapshot = None
            return False
        sent = sum(s[2] for s in st.values())
        received = sum(s[3] for s in st.values())
        if sent != received:
            self.probe_snapshot = None
            return False
        if self.probe_snapshot is None or not all(st[n][0] == self.epoch for n in live):
            if self.probe_snapshot is None:
                self.epoch += 1
                self.probe_snapshot = (sent, received)
                for n in live:
                    self.ep.send_nowait(n, ("probe", self.epoch))
            return False
        if self.probe_snapshot == (sent, received):
            return True
        # Messages moved between the probe and its answers (sums equal again, but not the ones
        # probed): probe again. Keeping the stale snapshot here hung the run forever.
        self.probe_snapshot = None
        return False

    def _broadcast(self, msg: Any) -> None:
        for n in self.procs:
            if n not in self.results:
                with contextlib.suppress(Exception):
                    self.ep.send_nowait(n, msg)


def _describe_exits(dead: dict[str, tuple[int | None, str]]) -> str:
    """Say which workers ended early and how, the first cause first: a worker lost with its host,
    then one killed by a signal (its peers then exit because they lost it), before one that exited
    with a status of its own. Each ``(exit status or None, where)``; a lost one's ``where`` says how."""
    def how(rc: int | None, where: str) -> str:
        if rc is None:
            return where
        return f"{said(rc)} {where}" if where else said(rc)

    def said(rc: int) -> str:
        if rc < 0:
            try:
                return f"was killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"was killed by signal {-rc}"
        if rc == 3:
            return "exited with status 3 (it lost a peer; its stderr names which)"
        return f"exited with status {rc}"

    def rank(n: str) -> tuple[bool, bool, bool, str]:
        rc = dead[n][0]
        return (rc is not None, rc is not None and rc >= 0, rc == 3, n)

    order = sorted(dead, key=rank)
    first, rest = order[0], order[1:]
    text = f"worker {first!r} {how(*dead[first])} before the run ended"
    if rest:
        text += "; then " + ", ".join(f"worker {n!r} {how(*dead[n])}" for n in rest)
    return text


def _cleanup_segments(run_id: str) -> None:
    """Unlink the shared-memory segments of this run that a killed worker left behind."""
    from ..transport._shm import cleanup_stale

    for name in cleanup_stale(run_id):
        log.warning("removed the shared-memory segment %s of a worker that did not close it", name)


async def _reap(procs: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for every worker; SIGTERM then SIGKILL the ones that outlive ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while any(p.poll() is None for p in procs.values()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


__all__ = ["PeerLostError", "WorkerFailedError", "run_processes"]
