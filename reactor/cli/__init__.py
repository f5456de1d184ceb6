"""The ``reactor`` command: ``run``, ``graph``, ``trace``, ``plot``, ``eval``; ``keys``, ``daemon``, ``submit``,
``status``, ``logs`` and ``stop`` for jobs on daemons.

Mistakes a user can make at the command line (a wrong path, an app without ``build``, a bad
``--set``, an invalid graph) end with a one-line ``reactor: ...`` message and exit status 2, not a
traceback. An error of the app file's own code (a syntax error, a missing import, a bug in its
``build``) shows the app's frames only, then one line naming the file and line (exit status 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import errno
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from .._errors import REFUSALS, ReactorError, raised_by_reactor, refusal_line
from ..launch._app import blamed_setting, build_graph, parse_overrides
from ._appcode import _app_code, _AppCodeError, _bounded
from ._args import _parser
from ._cluster import _cluster_run_args
from ._jobs import _jobs
from ._run import (
    _check_devices_here,
    _check_run_options,
    _early_fork_server,
    _eval,
    _print_training_result,
    _stdout_for_json_only,
    _training_result,
)

#: Whether this command's process may leave without the interpreter's teardown (:func:`entry`): set by a
#: multi-process ``run``, whose reactors ran in its workers, not here.
_NO_TEARDOWN = False


def entry() -> None:
    """The ``reactor`` command's process (the console script, ``python -m reactor.cli``): :func:`main`, then
    its exit status. After a multi-process run it leaves without the interpreter's teardown once its atexit
    handlers ran and its output is flushed (``os._exit``, as the workers and a daemon's forked jobs leave):
    freeing the modules of a process that imported torch took 1.2-4.8 s here after the run had ended and
    said so (measured on a 2-core machine: the command's largest cost after a failed run, whose coordinator
    is done ~1.5 s after the failure). Its reactors ran in the workers, so no object of theirs waits for the
    teardown to flush or close a file. An error out of :func:`main` (a traceback), and every other command
    (a ``single`` run's reactors, ``eval``'s envs), take the interpreter's usual way out."""
    rc = main()
    if not _NO_TEARDOWN:
        sys.exit(rc)
    from ..launch._runtime import exit_without_teardown

    exit_without_teardown(rc)


def main(argv: Sequence[str] | None = None, *, started: float | None = None) -> int:
    """The ``reactor`` command; ``started``: when the command began (a cluster command that runs
    ``run`` itself passes its own start). A daemon's job (``$REACTOR_JOB_EXIT_FILE`` set) writes its
    exit status there as it ends (``reactor/launch/_daemon.py``: a daemon that is not its parent, one
    started again after a crash, reads it)."""
    exit_file = os.environ.pop("REACTOR_JOB_EXIT_FILE", None)  # (the job's own command: not one it starts)
    if exit_file is None:
        return _main(argv, started)
    from ..launch._jobrecord import record_job_exit

    rc = 1  # (an exception that ends the command: Python's exit status)
    try:
        rc = _main(argv, started)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        record_job_exit(exit_file, rc)
    return rc


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, parsed. An option the command does not take (``reactor run app.py --sett lr=1``) is
    its command's error, with its usage and the option it is close to: argparse left it to the top parser,
    whose usage lists the commands, not the option that was meant."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = parser
        while chosen := next((a for a in sub._actions if isinstance(a, argparse._SubParsersAction)), None):
            sub = chosen.choices[getattr(args, chosen.dest)]  # (reactor trace show: its own parser's)
        options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
        near = next((difflib.get_close_matches(x.partition("=")[0], options, n=1) for x in extra
                     if x.startswith("--")), [])
        sub.error(f"unrecognized arguments: {' '.join(extra)}{f' (did you mean {near[0]}?)' if near else ''}")
    return args


def _main(argv: Sequence[str] | None, started: float | None) -> int:
    args = _parse(argv)
    args.started = started if started is not None else time.time()
    try:
        return _dispatch(args)
    except _AppCodeError as e:  # the app's own code failed (importing it, or its build): its frames, then one line
        print(e.text, file=sys.stderr)
        return _failed(args, 2, e.text.rstrip().splitlines()[-1] if e.text.strip() else "the app failed", quiet=True)
    # (A path the user gave that cannot be used, a run_dir under a file or without permission among them,
    # is one line too: NotADirectoryError, PermissionError, ... were tracebacks.)
    except REFUSALS as e:  # (raised here, or by a worker of the run: its coordinator raises the same class)
        if not raised_by_reactor(e):  # (the app's, an algorithm's or an env's code: where, then what)
            traceback.print_exception(e, file=sys.stderr)
            return _failed(args, 1, f"reactor: the run failed: {type(e).__name__}: "
                                    f"{_bounded((str(e).splitlines() or [''])[0])}")
        line = refusal_line(e)
        if blamed := blamed_setting(e, line, getattr(args, "app", None), getattr(args, "overrides", [])):
            line = f"--set {blamed}: {line}"  # (a value of the command line refused where the app uses it)
        return _failed(args, 2, f"reactor: {_bounded(line)}")
    except ReactorError as e:
        return _failed(args, 1, f"reactor: {type(e).__name__}: {_bounded(str(e))}")
    except BrokenPipeError:  # the output's reader left (`reactor graph APP | head`): stop quietly, as cat does
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit's flush)
        return 128 + signal.SIGPIPE
    except OSError as e:  # a path too long or looping, a /dev/shm without room: the user's to fix
        if e.errno not in (errno.ENAMETOOLONG, errno.ELOOP, errno.ENOSPC, errno.EROFS, errno.EADDRINUSE,
                           errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL):  # (the last four: a daemon's --listen)
            raise
        return _failed(args, 2, f"reactor: {_bounded(str(e))}")
    except (KeyboardInterrupt, asyncio.CancelledError):  # before a run, or a second signal during one
        from ..launch._signals import received

        rc = 128 + (received[0] if received else signal.SIGINT)
        if len(received) >= 2:
            return _failed(args, rc, f"reactor: stopped at once ({signal.Signals(received[-1]).name} twice); every "
                                     f"process and shared-memory segment of the run reaped")
        if received:  # (one signal while its workers started: a run not yet started stops at once; it said "twice")
            return _failed(args, rc, f"reactor: stopped before the run started ({signal.Signals(received[0]).name}); "
                                     f"every process and shared-memory segment of the run reaped")
        return _failed(args, rc, "", quiet=True)


def _failed(args: argparse.Namespace, rc: int, message: str, *, quiet: bool = False) -> int:
    """Say why the command failed on stderr and, under ``--json``, as ``{"error", "exit_status"}`` on stdout
    (a script reading it got nothing from a failed run); return ``rc``."""
    if not quiet:
        print(message, file=sys.stderr)
    if getattr(args, "json", False):
        with contextlib.suppress(OSError):
            print(json.dumps({"error": message.removeprefix("reactor: ") or "stopped", "exit_status": rc}), flush=True)
    return rc


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "slurm":
        return _slurm(args)
    if args.command == "ray":
        from ..launch._ray import here as ray_here

        if args.nodes is not None and args.nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {args.nodes}")
        run_args = _cluster_run_args(args)
        return ray_here(str(Path(args.app).resolve()), run_args, address=None if args.address == "local" else args.address,
                        nodes=args.nodes, cpus_per_daemon=args.cpus_per_daemon, max_restarts=args.max_restarts,
                        run_app=lambda a: main(a, started=args.started))
    if args.command == "k8s":
        from ..launch._k8s import render

        text = render(args.app, _cluster_run_args(args), replicas=args.replicas, image=args.image, name=args.name,
                      namespace=args.namespace, files=args.files, cpu=args.cpu, memory=args.memory,
                      shm_size=args.shm_size)
        if args.out:
            try:
                Path(args.out).write_text(text)
            except OSError as e:  # (was "[Errno 2] No such file or directory: ...", naming no option)
                raise ValueError(f"--out {args.out}: cannot write the manifests there ({e.strerror})") from None
            print(f"wrote {args.out}: kubectl apply -f {args.out}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    if args.command in ("keys", "daemon", "submit", "status", "logs", "stop"):
        return _jobs(args)
    if args.command == "graph":
        with _app_code(args.app):
            graph = build_graph(args.app, parse_overrides(args.overrides))
        graph.validate()
        if args.format in ("text", "both"):
            print(graph.describe())
        if args.format == "both":
            print()
        if args.format in ("mermaid", "both"):
            print(graph.mermaid())
        return 0
    if args.command == "eval":
        return _eval(args)
    if args.command == "plot":
        from ..nodes.plot import plot_run

        target = None if args.no_target else (args.target if args.target is not None else "summary")
        print(plot_run(args.run_dir, args.out, x=args.x, target=target))
        return 0
    if args.command == "trace":
        from .._trace import describe, diff, read_trace

        if args.trace_command == "show":
            print(describe(read_trace(args.trace), limit=args.limit))
            return 0
        lines = diff(read_trace(args.a), read_trace(args.b))
        print("\n".join(lines) if lines else "traces are identical")
        return 1 if lines else 0
    # run
    # Its processes inherit the command's start: summary.json reports the whole command's time.
    os.environ["REACTOR_COMMAND_T0"] = repr(args.started)
    if args.keys is not None:  # (as $REACTOR_KEYS: the coordinator loads the pair it talks to daemons with)
        os.environ["REACTOR_KEYS"] = args.keys
    from ..launch._runtime import new_run_id, run

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = parse_overrides(args.overrides)
    _check_run_options(args)  # before the app (and torch) is imported: a typo fails at once
    new_run_id()  # before build: an app may name its run directory after it
    global _NO_TEARDOWN
    _NO_TEARDOWN = args.placement != "single"  # (entry: no reactor runs in this process)
    with _stdout_for_json_only(args.json), _early_fork_server(args):
        with _app_code(args.app):
            graph = build_graph(args.app, overrides)
        _check_devices_here(graph, args)
        result = run(
            graph,
            placement=args.placement,
            deterministic=args.deterministic,
            seed=args.seed,
            stop_s=args.stop_s,
            record=args.record,
            replay=args.replay,
            digest=args.digest,
            app=args.app,
            config=overrides,
            hosts=args.hosts,
            with_files=args.files,
            restart=args.restart,
        )
    if args.json:
        print(json.dumps({"placement": result.placement, "stopped_by": result.stopped_by,
                          "events": dict(result.events), "digests": dict(result.digests),
                          "processes": {k: dict(v) for k, v in result.processes.items()},
                          "dropped": dict(result.dropped), "hosts": dict(result.hosts),
                          "restarts": dict(result.restarts), **_training_result(graph, args.started)}, indent=2))
    else:
        if result.hosts:  # the training result: Metrics printed it on its host, into that daemon's log
            _print_training_result(_training_result(graph, args.started))
        total = sum(result.events.values())
        print(f"run ended ({result.stopped_by}): {total} events in {len(result.events)} reactors, "
              f"placement {result.placement}")
        for name, d in sorted(result.digests.items()):
            print(f"  {name}: {d}")
    if result.stopped_by == "signal":  # a clean stop by Ctrl-C (130) or SIGTERM (143), as shells expect
        from ..launch._signals import received

        return 128 + (received[0] if received else signal.SIGINT)
    return 0


def _slurm(args: argparse.Namespace) -> int:
    """reactor slurm: submit the job (or, --here, run it inside the allocation)."""
    from ..launch._slurm import here, submit

    if args.nodes < 1 or args.tasks_per_node < 1:
        raise ValueError(f"--nodes and --tasks-per-node must be at least 1, got {args.nodes} and {args.tasks_per_node}")
    run_args = _cluster_run_args(args)
    app = str(Path(args.app).resolve())
    out = Path(args.out) if args.out else Path("reactor-slurm") / f"{Path(args.app).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.here:
        return here(app, run_args, out, args.tasks_per_node, lambda a: main(a, started=args.started))
    job = submit(app, run_args, out.resolve(), nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                 partition=args.partition, time_limit=args.time_limit, sbatch_args=args.sbatch_args)
    print(job)
    print(f"slurm job {job}: squeue -j {job}; its output in {out.resolve()}/slurm-{job}.out; "
          f"scancel --batch --signal=TERM {job} stops it cleanly (its files come back here), scancel {job} at once",
          file=sys.stderr)
    return 0
