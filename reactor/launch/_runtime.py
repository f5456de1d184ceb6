"""Running a graph: ``run(graph, placement=...)``.

This is the launch layer: it sits above the scheduler and the transport. ``single`` runs every
reactor on this event loop; ``processes`` and placement files start one worker process per group
(``reactor/launch/_worker.py``) and coordinate them (``reactor/launch/_coordinator.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .._graph import Graph, plain_scalars
from .._scheduler import ReactorHost, Recorder, Replayer
from .._tag import seconds_to_ns
from ._groups import restart_from_text
from ._result import RunResult
from ._signals import stop_signals

_RUN_COUNTER = itertools.count()
_CLAIMED: set[str] = set()


def new_run_id() -> str:
    """Set a fresh id for the next run (``Reactor.run_id``); worker processes inherit it.

    ``YYYYmmdd-HHMMSS-PID-N-RANDOM``: the second it was made (so ids sort by time), this process's
    pid, a counter of this process's runs, and 32 random bits. Without them two coordinators on two
    machines (containers, whose pids are small and alike) with the same pid in the same second had
    the same id, and shared a run on a daemon that hosted both. It names run directories, shared
    memory segments (``rxb.RUN.REGION.FIELD``, 199 bytes at most with the longest region and field
    names, within Linux's 255) and daemons' hosted runs: at most 64 of ``[A-Za-z0-9_-]`` (34 with a 7-digit pid).

    The CLI calls this before it builds the app's graph, so an app may name its run directory
    after the id (:func:`current_run_id`).
    """
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_RUN_COUNTER)}-{secrets.token_hex(4)}"
    os.environ["REACTOR_RUN_ID"] = run_id
    return run_id


def current_run_id() -> str:
    """The id of the run being built or running (a fresh one if none was set)."""
    return os.environ.get("REACTOR_RUN_ID") or new_run_id()


def claim_run_id() -> str:
    """A run starts: keep the id set for it, or make a new one if an earlier run used it."""
    run_id = os.environ.get("REACTOR_RUN_ID")
    if not run_id or run_id in _CLAIMED:
        run_id = new_run_id()
    _CLAIMED.add(run_id)
    return run_id


def payload_digest(value: Any) -> bytes:
    """The bytes a message contributes to its receiver's digest: its codec frames, concatenated."""
    from ..transport.codec import encode

    return b"".join(bytes(f) for f in encode(value))


def restart_refusal(restart: str | None, deterministic: bool, replay: bool = False, record: bool = False) -> str | None:
    """Why ``restart`` (``run --restart``) contradicts the run's mode, or None: a policy that restarts
    (``on-failure``) holds in async runs that record or replay no trace only; ``never`` contradicts
    nothing. (A recording that went through a restart held only the new life's events: the first life's
    died with its process, and the trace failed its replay as "damaged".)"""
    if restart is None or not (deterministic or replay or record) or restart_from_text(restart).policy == "never":
        return None
    what = "deterministic run" if deterministic else "replay" if replay else "recording"
    why = " (the first life's events die with it: the trace would not replay)" if what == "recording" else ""
    return (f"restart {restart!r}: restart policies hold in async runs (--async) that record or replay no trace: a "
            f"{what}'s schedule cannot take a process that starts over{why}")


def check_settings(graph: Graph | None, *, placement: str, deterministic: bool, record: Any = None, replay: Any = None,
                   restart: str | None = None, hosts: str | None = None) -> None:
    """What ``run`` refuses before anything starts, whatever the placement: settings that contradict
    each other (record and replay, either in deterministic mode, ``--restart`` where nothing restarts; a
    placement or hosts file's restart fields there are said and left aside), and
    for ``single``, settings of multi-process runs and replicas that need a process each. (A
    multi-process placement's own checks come when it is resolved: ``resolve_placement``,
    ``check_lookahead``.) ``reactor submit`` runs them before a job leaves, with ``graph`` None
    (the checks that need it left out) unless ``--check`` built it.

    Raises:
        ValueError: naming the setting and why.
        GraphError: replicas that each need a process, in one (``check_replicas_apart``).
    """
    if record is not None and replay is not None:
        raise ValueError("record and replay are exclusive: a replay run enforces a schedule, it does not make one")
    if (record is not None or replay is not None) and deterministic:
        raise ValueError("record/replay apply to async mode; deterministic runs are reproducible by construction")
    if record is not None:  # (it is written at the end: a path that cannot take it failed after the whole run)
        target = Path(record)
        if target.is_dir():
            raise ValueError(f"record {str(record)!r} is a directory: name the trace file to write")
        if not target.parent.is_dir():
            raise ValueError(f"record {str(record)!r}: its directory {str(target.parent)!r} does not exist")
        if not os.access(target.parent, os.W_OK):
            raise ValueError(f"record {str(record)!r}: its directory {str(target.parent)!r} cannot be written")
    why = restart_refusal(restart, deterministic, replay is not None, record is not None)
    if why is not None:
        raise ValueError(why)
    if placement != "single":
        # (--restart replaces the files' policies)
        if restart is None and (deterministic or replay is not None or record is not None):
            from ._placement import restarting_in_files

            where = restarting_in_files(placement, hosts)
            if where is not None:  # (left aside in silence until a process died; the same file may serve async runs)
                logging.getLogger("reactor").warning(
                    "%s sets restart = \"on-failure\", which this %s leaves aside: restart policies hold in async "
                    "runs (--async) that record or replay no trace, so a process that dies ends this run (--restart "
                    "never says so and silences this)", where,
                    "deterministic run" if deterministic else "replay" if replay is not None else "recording")
        return
    if restart is not None:
        raise ValueError("restart applies to the processes of a multi-process placement; placement 'single' has none")
    if hosts is not None:
        raise ValueError("hosts (a hosts file) places the groups of a multi-process placement; "
                         "placement 'single' has none")
    from ._placement import check_replicas_apart

    if graph is not None:
        check_replicas_apart(graph, {n: "main" for _, _, n in graph.instances()}, placement)


async def run_async(
    graph: Graph,
    *,
    placement: str = "single",
    deterministic: bool = True,
    seed: int = 0,
    stop_s: float | None = None,
    record: str | Path | None = None,
    replay: str | Path | None = None,
    digest: bool = False,
    app: str | None = None,
    config: Mapping[str, Any] | None = None,
    flow_limit: int = 4096,
    hosts: str | None = None,
    with_files: Sequence[str] = (),
    restart: str | None = None,
) -> RunResult:
    """Run ``graph`` to completion on the running event loop. See ``run`` for the arguments."""
    # (from Python, with no command line to type them: deterministic="no" ran deterministic, seed=3.0 another
    # run than seed=3, placement=None was a TypeError from pathlib)
    if not isinstance(placement, (str, os.PathLike)):
        raise ValueError(f"placement must be 'single', 'processes', a distribution policy (actors, colocated, "
                         f"dp-learners) or a placement file's path, got {placement!r:.100}")
    seed, deterministic = plain_scalars(seed), plain_scalars(deterministic)  # (a sweep's np.int64 seed: its int)
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be True or False, got {deterministic!r:.100}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r:.100}")
    placement = os.fspath(placement)
    graph.validate()
    claim_run_id()
    check_settings(graph, placement=placement, deterministic=deterministic, record=record, replay=replay,
                   restart=restart, hosts=hosts)
    if placement != "single" and app is not None and (with_files or replay is not None):
        from ._app import files_to_ship, shipped_files
        from ._forkserver import over_hosts

        # (over hosts they go by name: two of one name, refused now; and past a job's bounds, where they go)
        shipped_files(files_to_ship(app, with_files, replay), bounded=over_hosts(placement, hosts))
    if stop_s is not None and replay is not None:  # (it was ignored in silence)
        raise ValueError("stop_s (--stop-s) does not apply to a replay: it ends where its recording did")
    stop_ns = seconds_to_ns(stop_s, "stop_s") if stop_s is not None else graph.stop_ns
    from ._app import app_label

    label = app_label(app, graph)
    if replay is not None:
        from .._trace import check_config, read_trace

        check_config(read_trace(replay), config, replay, label)
    if placement != "single":
        from ._coordinator import run_processes

        if app is None:  # a graph from a @graph_builder: workers rebuild it from the builder's record
            from ._app import build_graph, builder_app

            app, config = builder_app(graph)
            # The workers build it now, not when the caller did: what the builder refuses now (the run
            # directory of this very graph's earlier run: a notebook's cell run again) is refused here,
            # as under "single", not in every worker (each printed its traceback, and the caller got
            # WorkerFailedError: 'worker exited with status 1').
            build_graph(app, config)

        return await run_processes(
            graph,
            placement=placement,
            deterministic=deterministic,
            seed=seed,
            stop_ns=stop_ns,
            record=record,
            replay=replay,
            digest=digest,
            app=app,
            config=config or {},
            flow_limit=flow_limit,
            hosts=hosts,
            with_files=with_files,
            restart=restart_from_text(restart) if restart is not None else None,
        )
    from .._trace import (
        check_graph,
        failure_line,
        graph_shape,
        no_trace_line,
        read_trace,
        write_failed_trace,
        write_trace,
    )

    if app is None and graph.built_by is not None:  # a script's graph: its directory, as its workers would note it
        from ._app import note_script_dir

        note_script_dir()
    recorder = Recorder() if record is not None else None
    replayer = None
    if replay is not None:
        trace = read_trace(replay)
        check_graph(trace, graph, replay, seed)
        replayer = Replayer(trace["events"])
    names = [n for _, _, n in graph.instances()]
    host = ReactorHost(
        graph,
        names,
        dict.fromkeys(names, "main"),
        seed=seed,
        deterministic=deterministic,
        digest=payload_digest if digest else None,
        stop_ns=stop_ns,
        recorder=recorder,
        replayer=replayer,
    )
    recorded = {"seed": seed, "placement": placement, "graph": graph_shape(graph), "config": config, "app": label}
    try:
        stopped_by = await drive_single(host, stop_ns)
    except Exception as e:
        if recorder is not None:  # (the run a user most needs to replay: it wrote nothing, in silence)
            write_failed_trace(record, {**recorded, "events": recorder.events}, failure_line(e))  # type: ignore[arg-type]
        raise
    except BaseException:
        if recorder is not None:
            no_trace_line(record, "the run was stopped at once (a second Ctrl-C, or its task cancelled)")  # type: ignore[arg-type]
        raise
    if recorder is not None:
        write_trace(record, {**recorded, "events": recorder.events})  # type: ignore[arg-type]
    return RunResult(
        digests=host.digests() if digest else {},
        events={n: s.events for n, s in host.stats.items()},
        placement=placement,
        stopped_by=stopped_by,
    )


async def drive_single(host: ReactorHost, stop_ns: int | None) -> str:
    """Run every reactor of ``host`` in this process until the run ends; return why it ended. What the
    run left claimed (a run directory whose node's shutdown was cut short) is released at its end: the
    process, a notebook's kernel, goes on."""
    from .._runclaim import release_run_claims

    try:
        with stop_signals() as signalled:
            return await _drive(host, stop_ns, signalled)
    finally:
        release_run_claims(os.environ.get("REACTOR_RUN_ID", "local"))


async def _drive(host: ReactorHost, stop_ns: int | None, signalled: asyncio.Event) -> str:
    ended = False
    try:
        why = await _drive_until_stop(host, stop_ns, signalled)
        host.stop_reason = why
        ended = True
    except asyncio.CancelledError:
        host.stop_reason = host.stop_reason or "terminated"
        raise
    except KeyboardInterrupt:  # (a second signal while a reaction held the loop: _signals)
        host.stop_reason = "signal"
        raise
    except BaseException:
        host.stop_reason = "failure"
        raise
    finally:
        await host.run_shutdown()
        if not ended and host.shutdown_failure is not None:  # (said, not lost behind the run's own error)
            logging.getLogger("reactor").error("a shutdown reaction failed too", exc_info=host.shutdown_failure)
    if host.shutdown_failure is not None:
        raise host.shutdown_failure
    return why


async def _drive_until_stop(host: ReactorHost, stop_ns: int | None, signalled: asyncio.Event) -> str:
    if not host.deterministic:
        return await _drive_async(host, stop_ns, signalled)
    host._seed_events()
    while not host.stop_requested and not signalled.is_set():
        ran = await host.run_ready()
        if ran == 0:
            break
        await asyncio.sleep(0)
    return "signal" if signalled.is_set() else "request" if host.stop_requested else (
        "stop_time" if stop_ns is not None and host.heap else "quiescence")


async def _drive_async(host: ReactorHost, stop_ns: int | None, signalled: asyncio.Event) -> str:
    host._seed_events()
    host.start_async_timers()
    done = asyncio.Event()
    reason = ["quiescence"]
    replayer = host.replayer

    stuck: list[BaseException] = []

    def idle() -> None:
        if replayer is not None:
            if all(n in replayer.done for n in host.reactors):
                reason[0] = "replay"
                done.set()
            elif host.quiescent():
                stuck.append(replayer.stuck_error(list(host.reactors)))
                done.set()
            return
        if host.quiescent():
            done.set()

    if replayer is not None:
        replayer.on_done = idle
    tasks = [asyncio.ensure_future(host.serve_reactor(n, idle)) for n in host.reactors]
    waiters = [asyncio.ensure_future(done.wait()), asyncio.ensure_future(signalled.wait())]
    try:
        loop = asyncio.get_running_loop()
        deadline = None if stop_ns is None or replayer is not None else loop.time() + stop_ns / 1e9
        serving: set[asyncio.Future[Any]] = set(tasks)
        waiting: set[asyncio.Future[Any]] = {*tasks, *waiters}
        while True:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            finished, waiting = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for t in finished:
                if t in tasks and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            # A reactor's serving that ended without an error is a replayed reactor at the end of its
            # recorded schedule: the others go on to the ends of theirs (the run once ended there,
            # with the learner's last updates still to come, and no word of it).
            if not finished or not finished <= serving or host.stop_requested:
                break
        if stuck:
            raise stuck[0]
        if not finished:
            reason[0] = "stop_time"
        elif signalled.is_set():
            reason[0] = "signal"
        elif host.stop_requested:
            reason[0] = "request"
        # Let the idle check settle: an idle callback can fire between a message and its wake-up.
    finally:
        host.stop_requested = True
        for t in tasks + waiters:
            t.cancel()
        await asyncio.gather(*tasks, *waiters, return_exceptions=True)
    return reason[0]


def run(graph: Graph, **kwargs: Any) -> RunResult:
    """Run ``graph`` to completion, on a fresh event loop (uvloop when installed).

    Args:
        placement: ``"single"`` (one process, the default), ``"processes"`` (one process per reactor
            instance) or the path of a placement file (groups of reactors per process/host).
        deterministic: deterministic mode (default) or async mode (``False``).
        seed: the run seed; every reactor's generators derive from it and its name.
        stop_s: end the run at this logical time (deterministic) or after this many wall-clock
            seconds (async). None: when nothing is left to do.
        record: async mode: write the delivery schedule to this trace file.
        replay: async mode: enforce the schedule recorded in this trace file.
        digest: hash every message each reactor receives (``RunResult.digests``).
        app, config: multi-process placements: the app file and config every worker rebuilds the
            graph from (the CLI passes them). Without them, a graph made by a ``graph_builder``
            (``reactor.nodes.training.off_policy_graph``, say) is rebuilt from its builder and arguments.
        flow_limit: multi-process placements: messages a process may queue towards its peers, and
            (async mode) events it may hold undelivered, before it pushes back.
        hosts: a hosts file (``[hosts]``: daemon addresses) to spread a distribution policy's
            groups over; a placement file may name its hosts itself (``reactor/launch/_cluster.py``).
        with_files: runs over hosts: files the app needs beside it, shipped with it to every host.
        restart: async multi-process runs: every group's restart policy, ``"never"``,
            ``"on-failure"`` or ``"on-failure:N"`` (at most N restarts per group in a row: a life of
            ``reset_after_s``, 600 s by default, starts the count again), then ``",backoff_s=S"``,
            ``",host_wait_s=S"`` and ``",reset_after_s=S"`` if wanted (``"on-failure:5,host_wait_s=60"``), replacing the
            placement's own (a placement file's ``restart`` fields, its ``[restart]`` table).

    Returns:
        RunResult.

    Called where an event loop already runs (a Jupyter notebook's cell), the run gets a loop of its
    own in a thread and this call waits for it; interrupting it (the notebook's stop button) stops
    the run at once, reaping every process it started.

    Raises:
        GraphError: the graph is invalid (raised before anything starts).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # (no loop here, the usual case: the run starts below, outside this block, so that
        pass              # an error of the run is not shown "during handling of" this one)
    else:
        return _run_beside_a_loop(graph, kwargs)
    return asyncio_run(run_async(graph, **kwargs))  # type: ignore[no-any-return]


def _run_beside_a_loop(graph: Graph, kwargs: dict[str, Any]) -> RunResult:
    """``run`` from a thread whose loop is running (a notebook): the run's own loop in a thread."""
    import threading

    _keep_fork_server(graph, kwargs)
    box: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> RunResult:
        box["task"], box["loop"] = asyncio.current_task(), asyncio.get_running_loop()
        started.set()
        return await run_async(graph, **kwargs)

    def target() -> None:
        try:
            box["result"] = asyncio_run(main())
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e
        finally:
            started.set()

    def stop_run() -> None:
        started.wait()
        if "loop" in box:
            box["loop"].call_soon_threadsafe(box["task"].cancel)
        thread.join()

    # The caller's task, when it is cancelled meanwhile: asyncio.run's (and asyncio.Runner's) Ctrl-C
    # cancels its main task rather than raising KeyboardInterrupt, and that task is blocked here, so the
    # cancellation could only land once the run had ended: Ctrl-C did nothing until then.
    caller = asyncio.current_task()
    cancels = caller.cancelling() if caller is not None else 0
    thread = threading.Thread(target=target, name="reactor-run", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
            if caller is not None and caller.cancelling() > cancels:
                stop_run()
                raise asyncio.CancelledError
    except KeyboardInterrupt:
        stop_run()
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


def _keep_fork_server(graph: Graph, kwargs: dict[str, Any]) -> None:
    """Before ``run``'s own thread starts, from the caller's: the process's kept fork server for a
    multi-process run on this host (only the main thread starts one: ``_forkserver.kept_or_new``),
    so that a notebook's runs after its first fork their workers from it too."""
    import threading

    from ._forkserver import kept_or_new, preload_for, release_kept, workers_here

    if (threading.current_thread() is not threading.main_thread() or os.environ.get("REACTOR_FORK_SERVER", "1") == "0"
            or not workers_here(kwargs.get("placement", "single"), kwargs.get("hosts"))):
        return
    try:
        server, _ = kept_or_new(preload_for(graph))
    except OSError:
        return  # the run starts its own, or new interpreters
    release_kept(server)  # (kept, not in use: the run takes it in its thread)


def exit_without_teardown(code: int) -> NoReturn:
    """End this process with ``code`` once its atexit handlers ran and its output is flushed, without the
    interpreter's teardown (``os._exit``): freeing the modules of a process that imported torch took 1.2-4.8 s
    on a 2-core machine (``reactor run`` after a multi-process run; a worker started as a new interpreter,
    which then missed its coordinator's leeway for a survivor and was reaped by SIGTERM). A worker forked
    from a fork server leaves so too (its server's ``os._exit``)."""
    import atexit
    import sys

    atexit._run_exitfuncs()  # (logging's flush, a kept fork server's stop, temporary directories)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed or broken stream: nothing more to say there
            pass
    os._exit(code)


def asyncio_run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
        return asyncio.run(coro)
    return uvloop.run(coro)
