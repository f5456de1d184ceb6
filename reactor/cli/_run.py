"""``reactor run`` and ``reactor eval``: what ``run`` checks before the app is imported (or, built, before
anything starts), its fork server started early, its stdout kept for the JSON, and the training result
printed at its end; ``eval``'s greedy returns."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._errors import GraphError
from ..launch._app import parse_overrides


def _eval(args: argparse.Namespace) -> int:
    """reactor eval RUN_DIR: the trained policy's greedy returns on its env."""
    from ..nodes._policy import evaluate_policy, load_policy

    policy = load_policy(args.run_dir)
    returns = evaluate_policy(policy, args.episodes, seed=args.seed, video_dir=args.video)
    if args.json:
        from ..nodes.metrics import json_safe

        print(json.dumps(json_safe({"run_dir": str(args.run_dir), "algo": policy.algo, "env": policy.env,
                                    "updates": policy.updates, "episodes": len(returns), "mean": float(returns.mean()),
                                    "std": float(returns.std()), "returns": [float(r) for r in returns]})))
    else:
        from ..nodes.metrics import format_return as r

        print(f"{policy.algo} on {policy.env} ({policy.updates} updates): return {r(returns.mean())} "
              f"± {r(returns.std())} over {len(returns)} episodes (min {r(returns.min())}, max {r(returns.max())})"
              + (f"; videos in {args.video}" if args.video else ""))
    return 0


def _check_devices_here(graph: Any, args: argparse.Namespace) -> None:
    """A run whose processes are all on this host (no hosts file, no placement file naming hosts): a learner's
    CUDA device or a replay's GPU memory that this host cannot give is refused before anything starts, naming
    the ``--set`` item that asked for it. (It was refused in the node's startup, after the workers had started
    and made the run directory.) Over hosts, the node's own host may have the GPU: its startup says."""
    from ..launch._forkserver import over_hosts

    if over_hosts(args.placement, args.hosts):
        return
    if not any(isinstance(v, str) and v.startswith(("cuda", "pinned")) for n in graph.nodes.values()
               for v in (getattr(n.prototype, "device", None), getattr(n.prototype, "memory", None))):
        return  # (nothing asks for a GPU: torch is not imported for the check)
    from ..nodes._device import cuda_refusal

    refused = cuda_refusal(graph)
    if refused is None:
        return
    line, value = refused
    given = [item for item, v in zip(args.overrides, (parse_overrides([o]) for o in args.overrides))
             if list(v.values()) == [value]]
    raise ValueError(f"--set {given[-1]}: {line}" if given else line)


def _training_result(graph: Any, started: float) -> dict[str, Any]:
    """For ``run --json``: a training app's run directory and its ``summary.json`` (the evaluation
    return, the stop reason, the counts), when the graph has a ``Metrics`` node whose summary this
    command wrote here (not an earlier run's; over hosts, once the files came back); else nothing."""
    from ..nodes.metrics import Metrics

    dirs = [Path(n.prototype.run_dir) for n in graph.nodes.values() if isinstance(n.prototype, Metrics)]
    if len(dirs) != 1:
        return {}
    path = dirs[0] / "summary.json"
    try:
        if path.stat().st_mtime < started:
            return {}
        return {"run_dir": str(dirs[0]), "summary": json.loads(path.read_text())}
    except (OSError, ValueError):
        return {}


def _print_training_result(got: dict[str, Any]) -> None:
    """A run over hosts: the lines Metrics printed at its end on its host (into that daemon's log),
    here, from the summary that came back with the run's files."""
    from ..nodes.metrics import eval_age, result_lines

    summary = got.get("summary")
    if not isinstance(summary, dict):
        return
    last, why = summary.get("last_eval_return"), summary.get("stop_reason")
    if last is not None and (not isinstance(last, (int, float)) or isinstance(last, bool)):
        return  # (not a summary Metrics wrote: no line says a return it does not hold, or that none was made)
    plot = Path(got["run_dir"]) / "curves.png"
    print(result_lines(last, why if isinstance(why, str) else "-", got["run_dir"], plot if plot.is_file() else None,
                       eval_age(summary, got["run_dir"])))


@contextlib.contextmanager
def _early_fork_server(args: argparse.Namespace) -> Iterator[None]:
    """A multi-process run on this host: start its fork server before the app is imported, so that
    the server's imports (torch, the nodes) overlap the command's own (measured: 1.5 s sooner to the
    first env step on a 2-core machine; benchmarks/bench_startstop.py). Inside the JSON-only block:
    workers write where the server's stdout points."""
    from ..launch._forkserver import close_early, launch_early, workers_here

    local = workers_here(args.placement, args.hosts)
    if local:
        launch_early()
    try:
        yield
    finally:
        if local:
            close_early()  # not taken: the run never started


def _check_run_options(args: argparse.Namespace) -> None:
    """What ``reactor run`` can check without the app: the files it names, the placement's name, the
    restart policy, the hosts file's hosts.

    Raises:
        FileNotFoundError: the app, a hosts file or a --with file is missing.
        IsADirectoryError: one of them is a directory.
        GraphError: a placement that is neither a known name nor a file, or a bad restart policy.
        AppError: two of the files that go to other hosts would go under one name, or the app imports a module
            from its folder that would not go with it (:func:`~reactor.launch._app.check_imports_shipped`).
    """
    from ..launch._groups import restart_from_text
    from ..launch._policies import POLICIES
    from ._appcode import check_given_file

    for what, path in (("app file", args.app), ("hosts file", args.hosts), *(("--with file", f) for f in args.files)):
        if path is not None:
            check_given_file(what, path)
    from ..launch._app import check_imports_shipped, files_to_ship, shipped_files
    from ..launch._forkserver import over_hosts

    ships = args.command == "submit" or over_hosts(args.placement, args.hosts)  # (one host: nothing goes)
    if args.files:  # (they go beside the app on the other hosts, found by name: a --with ppo.py was run as apps/ppo.py)
        shipped_files(files_to_ship(args.app, args.files, getattr(args, "replay", None)), bounded=ships)
    known = ("single", "processes", *sorted(POLICIES))
    if args.placement not in known and not Path(args.placement).is_file():
        if args.placement.endswith(".toml") or os.sep in args.placement:  # (meant as a file)
            raise FileNotFoundError(f"--placement {args.placement!r}: no placement file there (or use one of "
                                    f"{', '.join(known)})")
        raise GraphError(f"--placement {args.placement!r}: neither one of {', '.join(known)} nor a placement file")
    if args.restart is not None:
        restart_from_text(args.restart)
    if args.hosts is not None:  # (its mistakes at once, not after the app and torch are imported)
        from ..launch._cluster import load_hosts_file

        load_hosts_file(args.hosts, read_keys=args.command == "run")  # (a submitted job's keys may be the daemon's)
    if ships and (note := check_imports_shipped(  # (a module beside the app that does not go with it: its workers
            args.app, args.files, "a submitted job" if args.command == "submit" else "a run over hosts",  # failed)
            parse_overrides(args.overrides))):
        print(f"reactor: {note}", file=sys.stderr)


@contextlib.contextmanager
def _stdout_for_json_only(json_only: bool) -> Iterator[None]:
    """``run --json``: stdout carries the JSON only. While the run runs, file descriptor 1 is the
    stderr's (the app's prints, the live display, and the workers, which inherit it, write there)."""
    if not json_only:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
