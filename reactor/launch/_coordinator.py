"""The coordinator of a multi-process run: starts workers, wires them, ends the run, reaps them.

It owns the run's lifecycle and nothing else: messages between reactors never pass through it.
:func:`run_processes` sets a run up (its placement, run directory, keys and the workers' specs), starts
the workers (:mod:`._localworkers` on this host, :class:`~._cluster.RemoteWorkers` over hosts), gathers
them and hands the run to its session (:mod:`._session`: how the run ends, and the restarts by each
group's policy, :mod:`._restarts`); then it collects the results, writes a recorded trace, reaps the
workers and clears what the run leaves (its files fetched from its hosts, its rendezvous files, its run
directory, shared-memory segments a killed worker left).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import GraphError, PeerLostError, ReactorError, TraceMismatchError, WorkerFailedError
from .._graph import Graph
from .._hostmemory import available_host_bytes
from ..transport._zmq import link_key
from ._cluster import RemoteWorkers, address_towards
from ._forkserver import preload_for
from ._groups import Group, Restart
from ._localworkers import _cleanup_segments, _LocalWorkers, worker_memory_error
from ._placement import check_lookahead, resolve_placement, tcp_bind_error
from ._protocol import COORDINATOR, FAILED_END_S, CoordinatorProtocol
from ._restarts import _Restarts, _warn_restart_losses
from ._result import RunResult
from ._rundir import open_run_dir, remove_run_dir, rendezvous_file, sweep_stale
from ._session import _Session
from ._signals import stop_signals

log = logging.getLogger("reactor.coordinator")
START_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 20.0


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
    if not plan.hosts and (why := worker_memory_error(len(groups), available_host_bytes())):
        raise GraphError(f"placement {placement!r}: {why}")
    for g in groups:  # (their workers bind on this host: an address of another is said before any starts)
        if g.bind is not None and (why := tcp_bind_error(g.bind, here=True)):
            raise GraphError(f"placement file {placement}: group {g.name!r} bind {g.bind!r}: {why}")
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
        remote = RemoteWorkers(run_id, plan.hosts, host_keys, plan.settings["heartbeat_timeout_s"])
        try:
            await remote.check_memory(groups)  # (more workers on a host than its memory holds: refused now)
        except BaseException:
            await remote.close()
            raise
    # A data-parallel bank on this host meets in a file of its run directory: removed at the run's end,
    # whatever ends it (a kill -9 of this process too: by the next sweep of its socket directory).
    dist_files = [] if plan.hosts else _rendezvous_files(graph, run_id)
    # What is made for the run from here goes again if the run fails before its endpoint is open (a
    # runtime directory that cannot be written, files that cannot be shipped): the daemon links too.
    sockdir: Path | None = None
    local: _LocalWorkers | None = None
    workers: _LocalWorkers | RemoteWorkers
    # The data-parallel learners' store (over hosts): its server (a listening socket, a thread) lives as long
    # as the object, and torch gives it no close. Dropped on every way out: left in this frame, a failed run's
    # exception kept it serving for as long as the caller kept the exception (a notebook's last error).
    dist_store: Any = None
    try:
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
        if plan.hosts:
            workers = remote
            app_name = workers.ship(app, with_files, replay)
            bind = f"tcp://{here}:*"
            dist_store = _dist_store(graph, here)
        else:
            workers = local = _LocalWorkers(preload_for(graph))
            bind = f"ipc://{sockdir}/coordinator"
            dist_store = None
        ep = await Endpoint.open(COORDINATOR, bind, curve=keys, curve_local=False,
                                 accept=CoordinatorProtocol(g.name for g in groups))
    except BaseException:
        dist_store = None
        if plan.hosts:
            await remote.close()
        elif local is not None:
            await local.close()
        if sockdir is not None:
            remove_run_dir(sockdir)
        raise
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
            # The links, the endpoint and the store go even if the reaping or the copy is cancelled (a second
            # Ctrl-C during a long copy, a caller's timeout): this frame then goes with the error, and what it
            # held open stayed open for as long as the caller kept that.
            try:
                await workers.reap(0.0)
                if isinstance(workers, RemoteWorkers):  # the run's files come to where it was started
                    try:
                        await workers.fetch_run_files(Path.cwd())
                    except (OSError, ReactorError) as e:
                        log.warning("copying the run's files from its hosts failed: %s", e)
            finally:
                try:
                    await workers.close()
                    await ep.aclose()
                finally:
                    dist_store = None  # (every worker is reaped: none meets there again)
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



__all__ = ["PeerLostError", "WorkerFailedError", "run_processes"]
