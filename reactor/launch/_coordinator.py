"""The coordinator of a multi-process run: starts workers, wires them, ends the run, reaps them.

It owns the run's lifecycle and nothing else: messages between reactors never pass through it.
It ends the run when every worker has finished (stop time reached), when one asks to stop, on
SIGINT/SIGTERM, or on quiescence, detected by counting: when every worker reports idle and the
messages sent and received add up, it probes all of them once more, and stops only if the
counts are unchanged (a message in flight would show as a difference). After a restart the counts
need not add up (messages were lost with the dead process): then it stops once every worker has
stayed idle with unchanged counts over probe rounds for :data:`LOST_QUIET_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import (
    REFUSAL_EXIT_STATUS,
    REFUSAL_NAMES,
    REFUSALS,
    PeerLostError,
    ReactorError,
    ReactorInternalError,
    TraceMismatchError,
    WorkerFailedError,
    WouldBlock,
)
from .._graph import Graph
from ..transport._zmq import HEARTBEAT_IVL_S, HEARTBEAT_TIMEOUT_S, link_key
from ._cluster import NoHostAnsweredError, RemoteWorkers, address_towards
from ._forkserver import (
    DEFAULT_PRELOAD,
    ForkedProcess,
    ForkServer,
    ForkServerError,
    kept_or_new,
    preload_for,
    release_kept,
    take_early,
)
from ._groups import Group, Restart
from ._placement import check_lookahead, resolve_placement
from ._protocol import (
    COORDINATOR,
    FAILED_END_S,
    FAILED_SAVE_S,
    CoordinatorProtocol,
    how_worker_ended,
)
from ._result import RunResult
from ._rundir import open_run_dir, remove_run_dir, rendezvous_file, sweep_stale
from ._signals import received, stop_signals

log = logging.getLogger("reactor.coordinator")
START_TIMEOUT_S = 120.0
RECONNECT_TIMEOUT_S = 10.0  # a restarted worker starts at the latest this long after it is ready
EXIT_TIMEOUT_S = 20.0
FAILURE_STOP_S = 3.0  # after a worker failed, how long the others get to run their shutdown reactions
#: A failed worker still there this long past its bound (``FAILED_END_S`` after its failure), writing no
#: checkpoint (its ``("writing", ...)`` words), is held where its bound's thread cannot run (a C call holding
#: the interpreter): it is killed. (Its thread ends it within milliseconds of the bound otherwise.)
HELD_GRACE_S = 2.0
STOPPING_REPORT_S = 5.0  # after a Ctrl-C, how often the workers not yet ended are named
#: After a restart the sums of messages sent and received need not meet again (messages to and from
#: the process that died were lost with it), so they cannot show a message in flight. Then the run is
#: quiescent only once every worker has stayed idle, with no count moving, over probe rounds this long:
#: one round alone once ended a loaded run whose learner was waiting for a reply still in flight.
LOST_QUIET_S = 2.0
#: ... with a probe round at most this often meanwhile (a round takes a millisecond: not hundreds of them)
QUIET_PROBE_S = 0.2


#: What a worker does before each message the coordinator gathers at a run's start (its error, when late).
_STARTING = {
    "hello": "starting: its imports, building the app's graph and opening its endpoint",
    "ready": "building its reactors and connecting to its peers",
}


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
    restart: Restart | None = None,
) -> RunResult:
    from ..transport import Endpoint

    if app is None:
        raise ValueError(
            f"placement {placement!r} needs the app file: workers rebuild the graph from it "
            "(use `reactor run APP --placement ...` or run(graph, app=PATH, config=...))"
        )
    began = asyncio.get_running_loop().time()
    plan = resolve_placement(graph, placement, hosts, restart)
    groups = plan.groups
    # Restart policies hold in async runs that record or replay no trace: a deterministic run's schedule
    # cannot take a process that starts over, nor can a trace (the first life's events die with it);
    # there a failure ends the run, as with "never".
    restartable = sorted(g.name for g in groups if g.restart.policy == "on-failure") \
        if not deterministic and replay is None and record is None else []
    _warn_restart_losses(graph, [g for g in groups if g.name in restartable])
    if deterministic:
        check_lookahead(graph, groups, placement)
    if replay is not None:
        from .._trace import check_graph, read_trace

        check_graph(read_trace(replay), graph, replay, seed)  # fail here, in one line, rather than in every worker
    owner_of = {n: g.name for g in groups for n in g.reactors}
    # Run directories and shared-memory segments left by runs whose coordinator was killed go first.
    sweep_stale()
    run_id = os.environ.get("REACTOR_RUN_ID") or "run"
    # Over hosts, what can fail on the user's side before anything exists (no key pair, a head host's
    # name that does not resolve): first, so that no run directory is left behind by it.
    host_keys = here = None
    if plan.hosts:
        from ._keys import default_keys_dir, load_keys

        host_keys = load_keys(default_keys_dir())
        here = address_towards(plan.hosts[groups[0].hosts[0]].address)
    # A data-parallel bank on this host meets in a file of its run directory: removed at the run's end,
    # whatever ends it (a kill -9 of this process too: by the next sweep of its socket directory).
    dist_files = [] if plan.hosts else _rendezvous_files(graph, run_id)
    sockdir = open_run_dir(run_id, remove=dist_files)
    # Links that may leave the host (any tcp bind, any run over hosts) are encrypted and authenticated
    # with CURVE: one key pair per run, handed to each worker on its stdin, or through its daemon over
    # that daemon's CURVE link (never in the clear); every endpoint of the run bound to tcp, the
    # coordinator's too, then admits only peers holding it. An endpoint bound to ipc (in the run's 0700
    # directory) stays plain, as in a run without tcp (curve_local=False): encrypting a link on the host
    # cost ~0.3 us of CPU a 269-byte step on each side (libsodium at ~0.8 GB/s, docs/benchmarks.md).
    curve = keys = None
    if plan.hosts or any(g.bind is not None and g.bind.startswith("tcp://") for g in groups):
        from ..transport import CurveKeys

        keys = CurveKeys.generate()
        curve = {"public": keys.public.decode(), "secret": keys.secret.decode()}
    workers: _LocalWorkers | RemoteWorkers
    if plan.hosts:
        workers = RemoteWorkers(run_id, plan.hosts, host_keys, plan.settings["heartbeat_timeout_s"])
        app_name = workers.ship(app, with_files, replay)
        bind = f"tcp://{here}:*"
        dist_store = _dist_store(graph, here)
    else:
        workers = _LocalWorkers(preload_for(graph))
        bind = f"ipc://{sockdir}/coordinator"
        dist_store = None
    ep = await Endpoint.open(COORDINATOR, bind, curve=keys, curve_local=False,
                             accept=CoordinatorProtocol(g.name for g in groups))
    loop = asyncio.get_running_loop()
    specs: dict[str, dict[str, Any]] = {}

    async def start(g: Group, spec: dict[str, Any]) -> None:
        if isinstance(workers, RemoteWorkers):
            await workers.start(g, spec, app_name)
        else:
            await workers.ready()
            workers.start(g, spec)

    with stop_signals(watch_held=False) as signalled:  # (no reaction runs here)
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
                    "restartable": restartable,
                    "restarts": 0,
                    "failed_end_s": FAILED_END_S,  # (a failed worker's bound: the coordinator ends a held one past it)
                }
                specs[g.name] = spec
                if isinstance(workers, RemoteWorkers) and replay is not None:
                    spec["replay"] = f"app/{Path(replay).name}"  # shipped beside the app; the worker runs in its parent
                await start(g, spec)
            if isinstance(workers, RemoteWorkers):
                workers.start_heartbeat()
                workers.record_groups()
            session = _Session(ep, workers, [g.name for g in groups], signalled,
                               _Restarts({g.name: g for g in groups}, restartable, specs, start, keys))
            addresses = await session.gather("hello", START_TIMEOUT_S)
            for g in groups:
                await ep.connect(g.name, addresses[g.name][0], server_public_key=link_key(keys, addresses[g.name][0]))
            session.restarts.book = {k: v[0] for k, v in addresses.items()}
            session.restarts.local = {k: v[1] for k, v in addresses.items()}
            for g in groups:
                ep.send_nowait(g.name, ("peers", session.restarts.book_for(g.name, session.host_of)))
            await session.gather("ready", START_TIMEOUT_S)
            for g in groups:
                ep.send_nowait(g.name, ("start",))
            log.info("run started: %d workers ready %.2f s after the coordinator began", len(groups),
                     loop.time() - began)
            deadline = None if deterministic or stop_ns is None or replay is not None else loop.time() + stop_ns / 1e9
            try:
                stopped_by, results = await session.supervise(deadline)
            except Exception as e:
                if record is not None:  # (the run a user most needs to replay: it wrote nothing, in silence)
                    _record_failed_run(record, session, e, {"seed": seed, "placement": placement, "config": config,
                                                            "graph": _graph_shape(graph), "app": _app_label(app, graph)})
                raise
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
                from .._trace import graph_shape, merge_events, write_trace
                from ._app import app_label

                write_trace(record, {"seed": seed, "placement": placement, "events": merge_events(traces),
                                     "graph": graph_shape(graph), "config": config, "app": app_label(app, graph)})
            await workers.reap(EXIT_TIMEOUT_S)
            return RunResult(
                digests=digests,
                events=events,
                placement=placement,
                stopped_by=stopped_by,
                processes={name: res["stats"] for name, res in results.items()},
                dropped={COORDINATOR: ep.statistics().dropped, **{n: res["stats"]["dropped"] for n, res in results.items()}},
                hosts=dict(getattr(workers, "host_of", {})),
                restarts={g: list(ends) for g, ends in session.restarts.ends.items()},
            )
        finally:
            await workers.reap(0.0)
            if isinstance(workers, RemoteWorkers):  # the run's files come to where it was started
                try:
                    await workers.fetch_run_files(Path.cwd())
                except (OSError, ReactorError) as e:
                    log.warning("copying the run's files from its hosts failed: %s", e)
            await workers.close()
            await ep.aclose()
            for f in dist_files:  # (every worker is reaped: no replica meets there again)
                with contextlib.suppress(OSError):
                    f.unlink()
            remove_run_dir(sockdir)
            if isinstance(workers, _LocalWorkers) and workers.procs:
                _cleanup_segments(run_id)


def _graph_shape(graph: Graph) -> dict[str, list[Any]]:
    from .._trace import graph_shape

    return graph_shape(graph)


def _app_label(app: str, graph: Graph) -> str:
    from ._app import app_label

    return app_label(app, graph)


def _record_failed_run(record: Any, session: _Session, error: BaseException, recorded: dict[str, Any]) -> None:
    """A recorded run failed: write its trace up to the failure from every worker's events (the survivors'
    results, the failed worker's ``trace`` word), or say whose are missing (a worker killed, or one that
    failed before it recorded anything): a trace needs every process's events."""
    from .._trace import failure_line, merge_events, no_trace_line, write_failed_trace

    events = {g: session.results[g]["trace"] if g in session.results else session.traces.get(g) for g in session.procs}
    missing = sorted(g for g, ev in events.items() if ev is None)
    line = session.failure or failure_line(error)
    if missing:
        no_trace_line(record, f"the run failed ({line}), and worker{'s' * (len(missing) > 1)} "
                              f"{', '.join(map(repr, missing))} sent no events (killed, or ended before its result "
                              f"came): a trace needs every process's events")
        return
    write_failed_trace(record, {**recorded, "events": merge_events(list(events.values()))}, line)


def _rendezvous_files(graph: Graph, run_id: str) -> list[Path]:
    """The rendezvous files of the run's data-parallel learner banks on this host (``rendezvous_file``):
    a learner with replicas and a run directory (one without fails at its start, naming it)."""
    return [rendezvous_file(run_dir, run_id) for node in graph.nodes.values()
            if getattr(node.reactor_type, "placement_role", None) == "learner" and node.replicas > 1
            and (run_dir := getattr(node.prototype, "run_dir", None))]


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
        env = {**os.environ, "REACTOR_WORKER_GROUP": group.name}
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
        return {name: (rc, "") for name, p in self.procs.items() if (rc := p.poll()) is not None}

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


def _warn_restart_losses(graph: Graph, groups: Sequence[Group]) -> None:
    """Say, before anything starts, each reactor a restart policy covers whose new life would start without
    something (:meth:`Reactor.restart_loses`: a learner with checkpoint_every = 0 learned again from fresh
    weights, in silence)."""
    said = set()
    for g in groups:
        for instance in g.reactors:
            node = instance.split("[", 1)[0]
            if node in said or node not in graph.nodes:
                continue
            said.add(node)
            loses = graph.nodes[node].prototype.restart_loses()
            if loses:
                log.warning("group %r restarts on failure, but %r would start again without %s", g.name, node, loses)


class _Restarts:
    """The restart policies of a run's groups and the restarts under way (async runs).

    A group restarts in three steps: its end is seen (``due``: when to start it again, after its
    backoff), it is started (``trying``: the start's task, which may wait for a host; then
    ``starting``: ``"spawned"``, then ``"hello"`` once it said where it listens and was sent the
    address book), and its ``ready`` is answered with ``start`` while the other workers hear
    ``restarted`` with its new address."""

    def __init__(self, groups: dict[str, Group], restartable: Sequence[str], specs: dict[str, dict[str, Any]],
                 start: Callable[[Group, dict[str, Any]], Awaitable[None]], keys: Any) -> None:
        self.groups = groups
        self.restartable = set(restartable)
        self.specs = specs
        self.start = start
        self.keys = keys
        self.book: dict[str, str] = {}  # group -> its endpoint's address (the latest)
        self.local: dict[str, str | None] = {}  # group -> its endpoint's address for its own host's workers
        self.count: dict[str, int] = {}  # restarts begun in a row, per group (its policy's max_restarts)
        self.lives: dict[str, int] = {}  # restarts begun over the run, per group (a new life's number)
        self.began: dict[str, float] = {}  # group -> when its latest life began running (monotonic)
        self.first_began = time.monotonic()  # (the first lives')
        self.ends: dict[str, list[str]] = {}  # how each of a group's lives ended
        self.due: dict[str, float] = {}
        # group -> its start under way, in a task of its own (a try whose hosts do not answer waits
        # out a ping's timeout for each: the run's messages are not held up meanwhile)
        self.trying: dict[str, asyncio.Future[None]] = {}
        # group -> (when a try of its restart first found no candidate host answering, tries so far)
        self.host_wait: dict[str, tuple[float, int]] = {}
        self.starting: dict[str, str] = {}
        # group -> the hello of its new life that came before its start's task was taken (a forked
        # worker says hello within ~0.1 s, and the task is taken once per supervision round)
        self.early: dict[str, Any] = {}
        # group -> (the live workers still to link to its new life, when to start it regardless)
        self.awaiting: dict[str, tuple[set[str], float]] = {}

    @property
    def pending(self) -> set[str]:
        return set(self.due) | set(self.trying) | set(self.starting)

    @property
    def down(self) -> set[str]:
        """The groups being restarted that have no live process yet (due, or their start under way)."""
        return set(self.due) | set(self.trying)

    async def end_tries(self) -> None:
        """Wait for the starts under way to end (each is bounded by its requests' timeouts). They are
        not cancelled: a request's thread would run on, and the run's reap then shares its daemon
        client across threads. The reap stops any worker they started."""
        if self.trying:
            await asyncio.gather(*self.trying.values(), return_exceptions=True)
        self.trying.clear()

    def address_for(self, group: str, recipient: str, host_of: Mapping[str, str]) -> str:
        """Where ``recipient`` reaches ``group``: at its local (plain ipc) address when both run on
        one daemon's host, else at its endpoint's address (tcp, CURVE, over hosts)."""
        local = self.local.get(group)
        here = host_of.get(recipient)
        return local if local is not None and here is not None and host_of.get(group) == here else self.book[group]

    def book_for(self, recipient: str, host_of: Mapping[str, str]) -> dict[str, str]:
        """The address book as ``recipient`` uses it (see :meth:`address_for`)."""
        return {g: self.address_for(g, recipient, host_of) for g in self.book}

    def life_ended(self, group: str) -> None:
        """``group``'s process ended: a life that ran its policy's ``reset_after_s`` was healthy, and
        the count of its restarts in a row (and so its backoff) starts again."""
        # (a life that never began running, its start not answered yet, ran nothing)
        began = self.began.pop(group, None if group in self.lives else self.first_began)
        ran = 0.0 if began is None else time.monotonic() - began
        policy = self.groups[group].restart if group in self.groups else None
        if policy is not None and ran >= policy.reset_after_s and self.count.get(group):
            log.warning("worker %r ran %.0f s (reset_after_s = %g s) before it ended: its count of restarts in "
                        "a row starts again", group, ran, policy.reset_after_s)
            self.count[group] = 0

    def can_restart(self, group: str) -> bool:
        return group in self.restartable and self.count.get(group, 0) < self.groups[group].restart.max_restarts

    def why_not(self, group: str, refused: bool = False) -> str:
        """Why a group with a restart policy was not started again (empty for "never"); ``refused``: it
        ended with a refusal's exit status."""
        policy = self.groups[group].restart
        if policy.policy != "on-failure":
            return ""
        if group not in self.restartable:
            return f"; group {group!r} was not restarted: restart policies hold in async runs that record or replay no trace"
        if refused:
            return (f"; group {group!r} was not restarted: exit status {REFUSAL_EXIT_STATUS} is a refusal of what the "
                    f"run was given, which a new life is given again")
        healthy = "" if math.isinf(policy.reset_after_s) else f", each after a life shorter than reset_after_s = {policy.reset_after_s:g} s"
        return (f"; group {group!r} had used its {self.count.get(group, 0)} restarts in a row "
                f"(max_restarts = {policy.max_restarts}{healthy}): earlier ends: {'; '.join(self.ends.get(group, []))}")


_HELD = "(by the coordinator: held past its bound)"  # how a failed worker _end_held killed ended
_ABANDONED = {"replay_incomplete": None, "stats": {"dropped": 0}, "events": {},
              "digests": {}, "trace": {}}  # a restart the run's end overtook; a worker the run's SIGTERM ended
#: How a worker ends when a SIGTERM reaches it: its own clean exit (128 + 15), killed by it, or of a peer
#: lost to it (3).
_ENDED_BY_SIGTERM = (128 + signal.SIGTERM, -signal.SIGTERM, 3)


def stopping_report(waiting: list[str], received: list[int]) -> str:
    """What a run stopping cleanly after a signal says of the workers it still waits for, naming the
    signal that would stop it at once (``received``: the signals so far; a daemon stops its jobs with
    SIGTERM, a terminal with Ctrl-C)."""
    again = "Ctrl-C" if not received or received[0] == signal.SIGINT else signal.Signals(received[0]).name
    return (f"still stopping: waiting for worker{'s' if len(waiting) > 1 else ''} {', '.join(map(repr, waiting))} "
            f"to end cleanly ({again} again stops at once)")


class _Session:
    def __init__(self, ep: Any, workers: _LocalWorkers | RemoteWorkers, names: list[str],
                 signalled: asyncio.Event, restarts: _Restarts | None = None) -> None:
        self.ep = ep
        self.workers = workers
        self.procs = names
        self.signalled = signalled
        self.restarts = restarts if restarts is not None else _Restarts({}, (), {}, _no_start, None)
        self.status: dict[str, tuple[int, bool, int, int]] = {}
        self.results: dict[str, Any] = {}
        self.epoch = 0
        self.probe_snapshot: tuple[int, int] | None = None
        # (after a restart) when the probe rounds first found everyone idle with these sums, unmoved since
        self.quiet_since: tuple[float, tuple[int, int]] | None = None
        self.lost_quiet_s = LOST_QUIET_S
        self.quiet_probe_s = QUIET_PROBE_S
        self.next_probe_at = 0.0  # (the quiet after a restart: its next probe round, not before)
        self.replay_done: set[str] = set()
        self.ending: dict[str, bool] = {}  # deterministic: worker ended on its own -> events left past the stop
        self.stopped_by: str | None = None
        self.failed: str | None = None  # the worker whose error or refusal ends the run (it waits for "exit")
        self.failed_at = 0.0  # (loop time: when its word came)
        self.failure: str | None = None  # its line (a recorded run's trace keeps it)
        self.traces: dict[str, Any] = {}  # a recording's failed workers: their events ("trace", before their error)
        # Workers' checkpoint writes ("writing" words): those writing now, and when each last stopped.
        self.writing: set[str] = set()
        self.wrote_at: dict[str, float] = {}
        self.failed_lives: dict[str, float] = {}  # failed workers not yet gone -> when their failure came (_held)
        self.killed_held: set[str] = set()

    @property
    def host_of(self) -> Mapping[str, str]:
        """Each group's host over hosts (its daemon's name, the latest life's); empty on one host."""
        return self.workers.host_of if isinstance(self.workers, RemoteWorkers) else {}

    def _check_children(self) -> None:
        r = self.restarts
        # A restart not started yet is still dead; one started and dead again has ended once more.
        dead = {name: (how[0], how[1] or _HELD) if name in self.killed_held else how
                for name, how in self.workers.dead().items() if name not in self.results and name not in r.down}
        if not dead:
            return
        self.killed_held -= set(dead)  # (its next life is another process)
        for name in dead:
            r.starting.pop(name, None)
            r.awaiting.pop(name, None)
            r.life_ended(name)
        if self.stopped_by == "signal" and signal.SIGTERM in received:
            # The SIGTERM that stops the run reached its workers too (a service manager's stop of the
            # whole group, `kill -- -PGID`; Slurm's scancel, its hosts' daemons with them): a worker it
            # ended, or that lost a peer it ended, stopped as asked, and a host lost meanwhile (rc None:
            # its daemon stopped by it, once its wait for us was over) went as asked: the run ends
            # stopped, not failed.
            for name in [n for n in dead if dead[n][0] in _ENDED_BY_SIGTERM or dead[n][0] is None]:
                log.warning("worker %r %s as the run stopped on SIGTERM, which reached it too (a stop of the whole "
                            "process group or job): its shutdown reactions may not have run", name,
                            how_worker_ended(*dead.pop(name)))
                self.results[name] = _ABANDONED
            if not dead:
                return
        if self.stopped_by is not None:
            # The run is ending: a restartable group that ends now (say, a new life that never got
            # going) is not started again, and does not fail a run that reached its end.
            for name in [n for n in dead if n in r.restartable]:
                log.warning("worker %r %s while the run was ending; its last life's results are not in the run's",
                            name, how_worker_ended(*dead.pop(name)))
                self.results[name] = _ABANDONED
            if not dead:
                return
        # A refusal's exit status is never restarted (its "refused" message ends the run first; this is for
        # one whose message did not come).
        fatal = {n: how for n, how in dead.items()
                 if self.stopped_by is not None or not r.can_restart(n) or how[0] == REFUSAL_EXIT_STATUS}
        if fatal:
            notes = "".join(r.why_not(n, refused=fatal[n][0] == REFUSAL_EXIT_STATUS) for n in sorted(fatal))
            raise WorkerFailedError(_describe_exits(fatal) + notes)
        for name, how in sorted(dead.items()):
            self._begin_restart(name, how)

    def _begin_restart(self, name: str, how: tuple[int | None, str], announce: bool = True) -> None:
        """``name`` ended and its policy allows another life: tell the others (unless they know it is
        down already: ``announce``), start it after its backoff."""
        r = self.restarts
        policy = r.groups[name].restart
        k = r.count.get(name, 0)
        ended = how_worker_ended(*how)
        r.ends.setdefault(name, []).append(ended)
        del r.ends[name][:-16]  # (the latest: a run of weeks ends a few hundred times)
        life = r.lives.get(name, 0)  # (the life that ended: its number over the run)
        r.count[name] = k + 1
        r.lives[name] = life + 1
        delay = policy.delay_s(k)
        host = self.workers.host_of.get(name, "") if isinstance(self.workers, RemoteWorkers) else ""
        if how[0] is None and isinstance(self.workers, RemoteWorkers) and host in self.workers.silent_hosts:
            # Lost with a silent host (cut off: its processes may run on): its peers hold its old
            # connections, and so its name, until their heartbeats time out; a new life before that
            # would be refused its name and fail.
            seen = self.workers.last_ok.get(host)
            if seen is not None:
                # (the daemon's last answer may precede the cut by a heartbeat period; zmq checks
                # its timeout once an interval)
                delay = max(delay, seen + HEARTBEAT_TIMEOUT_S + HEARTBEAT_IVL_S + 1.0 - time.monotonic())
        r.due[name] = asyncio.get_running_loop().time() + delay
        self.status.pop(name, None)
        self.probe_snapshot = None
        log.warning("worker %r %s; starting it again in %.1f s (restart %d of at most %d in a row)", name, ended,
                    delay, k + 1, policy.max_restarts)
        if announce:
            self.ep.disconnect(name, linger_s=0)
            self._broadcast(("lost", name, f"worker {name!r} {ended}", life))

    def _advance_restarts(self) -> None:
        """Start the restarts whose backoff is over (each in a task of its own), and take the
        outcomes of the starts that have ended."""
        r = self.restarts
        now = asyncio.get_running_loop().time()
        for name, t in sorted(r.due.items()):
            if self.stopped_by is not None:  # the run ends: this life is not needed
                del r.due[name]
                self.results[name] = _ABANDONED
            elif now >= t:
                del r.due[name]
                r.trying[name] = asyncio.ensure_future(r.start(r.groups[name],
                                                               dict(r.specs[name], restarts=r.lives[name])))
        for name, task in sorted(r.trying.items()):
            if not task.done():
                continue
            del r.trying[name]
            e = task.exception()
            if not isinstance(e, NoHostAnsweredError):  # (a wait for a host is over)
                r.host_wait.pop(name, None)
            if e is None:
                r.starting[name] = "spawned"  # (a hello kept in r.early is answered by _supervise this round)
                continue
            r.early.pop(name, None)  # (a hello of a start that failed is no one's)
            if not isinstance(e, ReactorError):
                raise e
            elif self.stopped_by is not None:  # the run ends: this life is not needed
                self.results[name] = _ABANDONED
            elif isinstance(e, NoHostAnsweredError):
                # Its host's daemon may be coming back (a supervisor such as Ray, Kubernetes or
                # systemd starts it again): ask again, up to host_wait_s; not a restart used.
                self._wait_for_host(name, e)
            else:
                # A host answered but the start failed: a failed life; try again after the next backoff.
                if not r.can_restart(name):
                    raise WorkerFailedError(f"worker {name!r} could not be started again: {e}; its earlier "
                                            f"ends: {'; '.join(r.ends[name])}") from e
                self._begin_restart(name, (None, f"could not be started again: {e}"), announce=False)

    def _wait_for_host(self, name: str, e: NoHostAnsweredError) -> None:
        """A restart of ``name`` found none of its candidate hosts answering: ask them again after
        its policy's retry wait, or end the run once it has waited ``host_wait_s``."""
        r = self.restarts
        policy = r.groups[name].restart
        now = asyncio.get_running_loop().time()
        since, tries = r.host_wait.get(name, (now, 0))
        waited = now - since
        if waited >= policy.host_wait_s:
            raise WorkerFailedError(
                f"worker {name!r} could not be started again: no candidate host answered within host_wait_s = "
                f"{policy.host_wait_s:g} s ({tries + 1} tries): {e}; its earlier ends: {'; '.join(r.ends[name])}") from e
        delay = min(policy.host_retry_s(tries), policy.host_wait_s - waited)
        r.host_wait[name] = (since, tries + 1)
        if isinstance(self.workers, RemoteWorkers):  # (a job's groups.json: `reactor status JOB` shows it)
            self.workers.waiting[name] = (f"waiting for a host: {waited:.0f} s of at most {policy.host_wait_s:g} s, "
                                          f"{tries + 1} tries")
            self.workers.record_groups()
        r.due[name] = now + delay
        log.warning("worker %r waits for a host: %s; asking again in %.1f s (%.0f s of at most %g s waited; "
                    "restart %d of at most %d in a row)", name, e, delay, waited, policy.host_wait_s, r.count[name],
                    policy.max_restarts)

    def _check_awaiting(self) -> None:
        for group in list(self.restarts.awaiting):
            self._release_if_linked(group)

    async def _restart_message(self, peer: str, msg: Any) -> bool:
        """A restarting worker's ``hello`` or ``ready``; True when ``msg`` was one."""
        r = self.restarts
        step = r.starting.get(peer)
        if step == "spawned" and msg[0] == "hello":
            keys = r.keys
            try:
                await self.ep.connect(peer, msg[1], server_public_key=link_key(keys, msg[1]))
            except PeerLostError as e:  # the new life died at once: _check_children sees its end
                log.warning("could not reach the new life of %r: %s", peer, e)
                return True
            r.book[peer], r.local[peer] = msg[1], msg[2]
            # Groups being restarted themselves are left out: it treats them as down until they
            # are back (it hears "restarted" then).
            self.ep.send_nowait(peer, ("peers", {g: a for g, a in r.book_for(peer, self.host_of).items()
                                                 if g == peer or g not in r.down and r.starting.get(g) != "spawned"}))
            r.starting[peer] = "hello"
            return True
        if step == "hello" and msg[0] == "ready":
            if self.stopped_by is not None:
                self._release(peer)
                return True
            # The others link to it first: what it sends at its start must not find them still
            # treating it as down (a restarted learner's first sample requests were answered into
            # the void that way, and the run stalled).
            r.starting[peer] = "reconnecting"
            r.awaiting[peer] = ({n for n in self.procs if n not in self.results and n not in r.pending},
                                asyncio.get_running_loop().time() + RECONNECT_TIMEOUT_S)
            self._broadcast(lambda n: ("restarted", peer, r.address_for(peer, n, self.host_of), r.lives[peer]),
                            skip=peer, starting=True)
            self._release_if_linked(peer)
            return True
        return False

    def _reconnected(self, peer: str, group: str) -> None:
        waiting = self.restarts.awaiting.get(group)
        if waiting is not None:
            waiting[0].discard(peer)
            self._release_if_linked(group)

    def _release_if_linked(self, group: str) -> None:
        waiting, deadline = self.restarts.awaiting[group]
        waiting &= {n for n in self.procs if n not in self.results and n not in self.restarts.pending}
        if not waiting:
            self._release(group)
        elif asyncio.get_running_loop().time() > deadline:
            log.warning("workers %s did not link to restarted %r within %.0f s; starting it anyway",
                        sorted(waiting), group, RECONNECT_TIMEOUT_S)
            self._release(group)

    def _release(self, group: str) -> None:
        """A restarted worker runs: ``start`` (and ``stop`` when the run is ending)."""
        r = self.restarts
        r.starting.pop(group, None)
        r.awaiting.pop(group, None)
        self.ep.send_nowait(group, ("start",))
        if self.stopped_by is not None:
            self.ep.send_nowait(group, ("stop", self.stopped_by))
        else:
            r.began[group] = time.monotonic()
            log.warning("worker %r is running again (restart %d)", group, r.lives[group])

    def _note(self, peer: str, msg: Any) -> None:
        """What a worker says beside its lifecycle: its events (``trace``, a recording's failed worker or a
        survivor, before its error or shutdown) and its checkpoint writes (``writing``)."""
        if msg[0] == "trace":
            self.traces[peer] = msg[1]
        elif msg[0] == "writing":
            if msg[1]:
                self.writing.add(peer)
            else:
                self.writing.discard(peer)
                self.wrote_at[peer] = asyncio.get_running_loop().time()

    def _end_held(self) -> list[str]:
        """Failed workers held past their bound: their bound's thread (``FAILED_END_S`` after the failure,
        ``_worker._leave_after``) ends them within milliseconds, or waits while they write a checkpoint (they
        say so: ``writing``); one still there ``HELD_GRACE_S`` later, writing nothing (or ``HELD_GRACE_S``
        after its last write ended), is held where that thread cannot run (a C call holding the interpreter):
        it is killed, and said, here (it was reaped only ``FAILED_SAVE_S`` and more later, 135 s; under a
        restart policy its group's next life waited for it). Over hosts, where no single worker is killed, it
        is named and the run's reaping ends it. Returns those found held now."""
        now = asyncio.get_running_loop().time()
        dead = self.workers.dead()
        held = []
        for name, at in list(self.failed_lives.items()):
            if name in dead:
                del self.failed_lives[name]
                continue
            if name in self.writing or now < max(at + FAILED_END_S, self.wrote_at.get(name, 0.0)) + HELD_GRACE_S:
                continue
            del self.failed_lives[name]
            held.append(name)
            killed = self.workers.kill(name)
            if killed:
                self.killed_held.add(name)
            log.warning("worker %r did not leave by its bound (%g s after its failure, %g s ago) and writes no "
                        "checkpoint: it is held where its bound cannot end it (a call in C that holds the "
                        "interpreter); %s", name, FAILED_END_S, now - at - FAILED_END_S,
                        "killed (SIGKILL)" if killed else "the run's reaping ends it")
        return held

    async def _batch(self) -> list[tuple[str, Any]]:
        batch = await self.ep.recv_batch(timeout_s=0.2)
        for peer, msg in batch:
            self._note(peer, msg)
        self._end_held()
        for peer, msg in batch:
            if msg[0] in ("refused", "error"):
                # (a result in the same batch is kept: the others' stop waited FAILURE_STOP_S for it)
                self.results.update((p, m[1]) for p, m in batch if m[0] == "done")
                # It waits for our "exit" to leave: at once for a restart, else once the others were told.
                self.failed = peer
                self.failed_at = self.failed_lives[peer] = asyncio.get_running_loop().time()
                if self.stopped_by is None and self.restarts.can_restart(peer):
                    if msg[0] == "refused":
                        # Not restarted (docs/reliability.md, "Refusals are not restarted"): a new life is given
                        # the same settings and files, and refuses again (a refusal from data at run time
                        # after a life past reset_after_s restarted for good, the cause only in this log).
                        log.warning("worker %r refused the run: not started again (a restart policy covers "
                                    "failures; a refusal is what the run was given, and comes again)", peer)
                    else:
                        log.warning("worker %r failed (it will be started again):\n%s", peer, msg[1])
                        self.failed = None
                        with contextlib.suppress(Exception):
                            self.ep.send_nowait(peer, ("exit",))
                        continue
                for other, m in batch:  # (the run's error is this one's: the others' are said)
                    if other != peer and m[0] in ("refused", "error"):
                        self._also_failed(other, m)
            if msg[0] == "refused":  # what the run was given: the same class and line as under `single`
                self.failure = f"{msg[1]}: {msg[2].splitlines()[0] if msg[2] else ''}"
                raise REFUSAL_NAMES[msg[1]](msg[2])
            if msg[0] == "error":
                self.failure = msg[1].splitlines()[0] if msg[1] else "an error"
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
        """Every worker's ``what`` message (``"hello"``, ``"ready"``): peer -> its fields.

        Raises:
            WorkerFailedError: a worker died first, or some did not send it within ``timeout_s``
                (named, with what they were doing).
        """
        got: dict[str, Any] = {}
        try:
            async with asyncio.timeout(timeout_s):
                while len(got) < len(self.procs):
                    if self.signalled.is_set():
                        raise KeyboardInterrupt
                    self._check_children()
                    if self.restarts.pending:  # a worker died before the run started: no restart then
                        name = sorted(self.restarts.pending)[0]
                        raise WorkerFailedError(f"worker {name!r} {self.restarts.ends[name][-1]} before the run "
                                                f"started (restart policies start again only what had started)")
                    for peer, msg in await self._batch():
                        if msg[0] == what:
                            got[peer] = msg[1:]
        except TimeoutError:
            late = sorted(set(self.procs) - set(got))
            doing = _STARTING.get(what, f"sending {what!r}")
            raise WorkerFailedError(
                f"worker{'s' if len(late) > 1 else ''} {', '.join(map(repr, late))} did not finish {doing} within "
                f"{timeout_s:g} s of being asked; the run was stopped before it started"
            ) from None
        return got

    async def supervise(self, deadline: float | None) -> tuple[str, dict[str, Any]]:
        """Run the run to its end (see the module docstring); a worker lost meanwhile ends it with
        ``WorkerFailedError`` naming the worker and how it ended, unless its restart policy starts
        it again."""
        try:
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
        except (WorkerFailedError, *REFUSALS):  # (a refusal: a worker's, raised as its class)
            await self._stop_survivors()
            raise
        finally:
            await self.restarts.end_tries()

    async def _stop_survivors(self) -> None:
        """A worker failed and the run ends: the others are told why and given ``FAILURE_STOP_S`` to
        run their shutdown reactions (a node's last checkpoint and summary, saying that the run
        failed) before the reaping's SIGTERM ends any that have not."""
        self.stopped_by = self.stopped_by or "failure"  # (a stop under way keeps its reason)
        self.ep.expect_departures()
        self._broadcast(("stop", "failure"))
        dead = self.workers.dead()
        live = {n for n in self.procs if n not in self.results and n not in dead and n not in self.restarts.down
                and n != self.failed}
        told: set[str] = set()  # done, then told "exit": waited for (briefly) before the reaping
        loop = asyncio.get_running_loop()
        end = loop.time() + FAILURE_STOP_S
        # A survivor writing a checkpoint (its final one: what the run learned since the last) is waited for, up
        # to FAILED_SAVE_S more, as a failed worker's is (it got FAILURE_STOP_S, then the reaping's TERM_GRACE_S,
        # and a slower write was cut); one that writes nothing by FAILURE_STOP_S is reaped as before.
        save_end = end + FAILED_SAVE_S

        def waited_for(now: float) -> bool:
            """A survivor still writing is, and one whose write ended: FAILURE_STOP_S more from its end, for the
            rest of its shutdown (it was cut between its write's end and its result)."""
            return any(p in self.writing or now < self.wrote_at.get(p, -math.inf) + FAILURE_STOP_S for p in live)

        while live and (loop.time() < end or (waited_for(loop.time()) and loop.time() < save_end)):
            try:
                batch = await self.ep.recv_batch(timeout_s=0.1)
            except Exception:  # noqa: BLE001 - a link going down as the run ends changes nothing here
                break
            for peer, msg in batch:
                self._note(peer, msg)
                if msg[0] == "done":
                    self.results[peer] = msg[1]  # (a recorded run's trace up to the failure takes its events)
                    live.discard(peer)
                    told.add(peer)
                elif msg[0] in ("refused", "error"):  # another failure (in its shutdown, say): said, let go
                    self._also_failed(peer, msg)
                    live.discard(peer)
            live -= set(self.workers.dead())
        # Those that ended cleanly leave now, on their own (STOPPED_FOR_FAILURE_STATUS), not at the reaping's
        # SIGTERM (143: it read as if they had failed too); all at once, once none is still stopping: one told
        # as soon as it was done left while a slower one still sent it its last words, which then failed too.
        for peer in sorted(told):
            with contextlib.suppress(Exception):
                self.ep.send_nowait(peer, ("exit",))
        if self.failed is not None:  # (last: the others have heard why first)
            with contextlib.suppress(Exception):
                self.ep.send_nowait(self.failed, ("exit",))
            told.add(self.failed)
        # The failed worker's own shutdown reactions ran meanwhile; it leaves once they end, and by its own
        # bound at the latest (FAILED_END_S after its failure; while it writes a checkpoint then, FAILED_SAVE_S
        # more: _worker._leave_after), which it is given: the reaping's SIGKILL came 5 s past FAILURE_STOP_S and
        # cut a slow final checkpoint (what the failed life learned since its last one). Those told "exit"
        # are given a moment to be gone before the reaping.

        # One held where its bound's thread cannot run is killed HELD_GRACE_S past its bound (_end_held).
        until = max(end, loop.time() + 1.0)  # (once: a bound re-read each round never came)
        failed_until = until if self.failed is None else max(
            until, self.failed_at + FAILED_END_S + FAILED_SAVE_S + TERM_GRACE_S)  # (the last: its thread's leeway)
        while True:
            left, now = told - set(self.workers.dead()), loop.time()
            if not left or now >= failed_until or (now >= until and self.failed not in left):
                break
            if self.failed in self._end_held() and self.failed not in self.killed_held:
                break  # (over hosts: the reaping ends it)
            try:
                for peer, msg in await self.ep.recv_batch(timeout_s=0.02):
                    self._note(peer, msg)  # (the failed worker's writes)
            except Exception:  # noqa: BLE001 - a link going down as the run ends changes nothing here
                await asyncio.sleep(0.02)
        ended = self.workers.dead()
        for name in sorted(self.procs):  # (-v: how each ended, or that the reaping ends it)
            log.info("worker %r %s%s", name, how_worker_ended(*ended[name]) if name in ended else
                     "has not ended: the reaping stops it",
                     f" {_HELD}" if name in self.killed_held else "")

    def _also_failed(self, peer: str, msg: Any) -> None:
        """A worker's failure after the one that ends the run: logged (it was lost), and let go."""
        log.error("worker %r failed too: %s", peer, msg[2] if msg[0] == "refused" else msg[1])
        with contextlib.suppress(Exception):
            self.ep.send_nowait(peer, ("exit",))

    def _stop(self, why: str) -> None:
        self.stopped_by = why
        self.ep.expect_departures()
        self._broadcast(("stop", why))

    async def _supervise(self, deadline: float | None) -> tuple[str, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        told_at = None  # (a stop by a signal: when the user was last told what it waits for)
        while len(self.results) < len(self.procs):
            if self.signalled.is_set() and self.stopped_by is None:
                self._stop("signal")
                told_at = loop.time()
            if self.stopped_by == "signal" and told_at is not None and loop.time() - told_at >= STOPPING_REPORT_S:
                # A worker may not hear the stop for a while (a reaction blocked in C: a rendezvous,
                # a long update): say which, rather than sit silent after "stopping the run cleanly".
                told_at = loop.time()
                waiting = sorted(n for n in self.procs if n not in self.results)
                log.warning("%s", stopping_report(waiting, received))
            if deadline is not None and self.stopped_by is None and loop.time() >= deadline:
                self._stop("stop_time")
            self._check_children()
            self._advance_restarts()
            for peer in [p for p in self.restarts.early if self.restarts.starting.get(p) == "spawned"]:
                await self._restart_message(peer, self.restarts.early.pop(peer))
            self._check_awaiting()
            for peer, msg in await self._batch():
                kind = msg[0]
                if peer in self.restarts.trying and kind == "hello":
                    # The new life's hello beat its start's task being taken: kept until it is (it was
                    # dropped, no address book was ever sent, and the restarted worker waited forever).
                    self.restarts.early[peer] = msg
                    continue
                if peer in self.restarts.starting and await self._restart_message(peer, msg):
                    continue
                if kind == "reconnected":
                    self._reconnected(peer, msg[1])
                elif kind == "done":
                    self.results[peer] = msg[1]
                elif kind == "status":
                    if peer not in self.restarts.pending:
                        self.status[peer] = (msg[1], msg[2], msg[3], msg[4])
                elif kind == "stop_request" and self.stopped_by is None:
                    self._stop("request")
                elif kind == "ending":
                    self.ending[peer] = msg[1]
                    self.status[peer] = (self.epoch, True, msg[2], msg[3])  # (final: it is not probed again)
                    if self.stopped_by is None and all(n in self.ending or n in self.results for n in self.procs):
                        self._stop("stop_time" if any(self.ending.values()) else "quiescence")
                elif kind == "replay_done":
                    self.replay_done.add(peer)
                    if len(self.replay_done) == len(self.procs) and self.stopped_by is None:
                        self._stop("replay")
            if self.stopped_by is None and self._quiescent():
                self._stop("quiescence")
        # (Set by now on every path: a worker that ended on its own waited for the coordinator's verdict,
        # the union of every worker's "ending", before it sent its result.)
        return self.stopped_by or "quiescence", self.results

    def _quiescent(self) -> bool:
        if self.restarts.pending:
            self.quiet_since = None  # (a restart under way: the quiet after it starts when it is done)
            return False
        # (A deterministic worker that ended on its own waits for the run's reason: idle for good, its
        # final counts in its status, it answers no probe.)
        live = [n for n in self.procs if n not in self.results and n not in self.ending]
        if self.results and len(self.results) == len(self.procs):
            return False
        st = self.status
        if len(st) < len(self.procs) or not all(st[n][1] for n in live):
            self.probe_snapshot = self.quiet_since = None
            return False
        sent = sum(s[2] for s in st.values())
        received = sum(s[3] for s in st.values())
        # After a restart the sums need not meet again (messages to or from a process that died
        # were lost with it): then every worker idle and the counts unchanged over probe rounds
        # for lost_quiet_s is quiescence.
        if sent != received and not self.restarts.lives:
            self.probe_snapshot = None
            return False
        if self.probe_snapshot is None or not all(st[n][0] == self.epoch for n in live):
            if self.probe_snapshot is None:
                if self.quiet_since is not None and time.monotonic() < self.next_probe_at:
                    return False
                self.epoch += 1
                self.probe_snapshot = (sent, received)
                for n in live:
                    try:
                        self.ep.send_nowait(n, ("probe", self.epoch))
                    except (PeerLostError, WouldBlock):
                        # It died (_check_children says how), or it has not taken what we sent it
                        # (a host cut off, not yet declared lost): not quiet; probe again later.
                        self.probe_snapshot = None
                        return False
            return False
        if self.probe_snapshot == (sent, received):
            if self.restarts.lives:
                # The sums cannot show a message in flight now (above; equal sums either: the lost
                # ones may offset one in flight): the same quiet over probe rounds for
                # lost_quiet_s, not one round, ends the run.
                now = time.monotonic()
                if self.quiet_since is None or self.quiet_since[1] != (sent, received):
                    self.quiet_since = (now, (sent, received))
                if now - self.quiet_since[0] < self.lost_quiet_s:
                    self.probe_snapshot = None  # probe again, in a while
                    self.next_probe_at = now + self.quiet_probe_s
                    return False
                if sent > received:
                    log.warning("the run went quiet with %d messages sent and never received: lost with the "
                                "processes that were restarted (or a peer waits on one of them)", sent - received)
                elif received > sent:  # (a killed process's last count of what it sent never came)
                    log.warning("the run went quiet; %d more messages were received than counted as sent: those a "
                                "killed process sent after its last status", received - sent)
            return True
        # Messages moved between the probe and its answers (sums equal again, but not the ones
        # probed): probe again. Keeping the stale snapshot here hung the run forever.
        self.probe_snapshot = None
        return False

    def _broadcast(self, msg: Any, skip: str | None = None, starting: bool = False) -> None:
        """Send ``msg`` to every live worker but ``skip``; with ``starting``, also to restarting
        ones that have their address book (they take it once started). A callable ``msg`` is
        called with each recipient's name for its message."""
        r = self.restarts
        pending = r.down | {g for g, step in r.starting.items() if not starting or step == "spawned"}
        for n in self.procs:
            if n not in self.results and n not in pending and n != skip:
                with contextlib.suppress(Exception):
                    self.ep.send_nowait(n, msg(n) if callable(msg) else msg)


async def _no_start(group: Group, spec: dict[str, Any]) -> None:
    raise ReactorInternalError(f"no way to start group {group.name!r} again")


def _describe_exits(dead: dict[str, tuple[int | None, str]]) -> str:
    """Say which workers ended early and how, the first cause first: a worker lost with its host,
    then one killed by a signal (its peers then exit because they lost it), before one that exited
    with a status of its own. Each ``(exit status or None, where)``; a lost one's ``where`` says how."""
    def rank(n: str) -> tuple[bool, bool, bool, str]:
        rc = dead[n][0]
        return (rc is not None, rc is not None and rc >= 0, rc == 3, n)

    order = sorted(dead, key=rank)
    first, rest = order[0], order[1:]
    text = f"worker {first!r} {how_worker_ended(*dead[first])} before the run ended"
    if rest:
        text += "; then " + ", ".join(f"worker {n!r} {how_worker_ended(*dead[n])}" for n in rest)
    return text


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


__all__ = ["PeerLostError", "WorkerFailedError", "run_processes"]
