"""The ``reactor`` command: ``run``, ``graph``, ``trace`` and ``plot``.

Mistakes a user can make at the command line (a wrong path, an app without ``build``, a bad
``--set``, an invalid graph) end with a one-line ``reactor: ...`` message and exit status 2, not a
traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from ._errors import GraphError, MalformedFrameError, ReactorError
from .launch._app import AppError, build_graph, parse_overrides


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reactor", description="Run and inspect reactor apps.")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run an app", description="Run an app file's graph under a placement.")
    r.add_argument("app", help="path of an app file defining build(config) -> Graph")
    r.add_argument(
        "--placement",
        default="single",
        help="single (one process, default), processes (one process per reactor), a distribution policy "
        "(actors, colocated, dp-learners) or a placement file (TOML)",
    )
    mode = r.add_mutually_exclusive_group()
    mode.add_argument("--deterministic", dest="deterministic", action="store_true", default=True,
                      help="deterministic mode: tag-ordered, bit-identical under every placement (default)")
    mode.add_argument("--async", dest="deterministic", action="store_false",
                      help="async mode: deliver messages as they arrive")
    rec = r.add_mutually_exclusive_group()
    rec.add_argument("--record", metavar="TRACE", help="async mode: write the delivery schedule to TRACE")
    rec.add_argument("--replay", metavar="TRACE", help="async mode: enforce the schedule recorded in TRACE")
    r.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    r.add_argument("--stop-s", type=float, default=None,
                   help="end at this logical time (deterministic) or after this many seconds (async)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field of the app (repeatable)")
    r.add_argument("--digest", action="store_true", help="print a hash of every message each reactor received")
    r.add_argument("--json", action="store_true", help="print the run result as JSON")
    r.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")

    g = sub.add_parser("graph", help="print an app's topology", description="Print the graph as text and Mermaid.")
    g.add_argument("app")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    g.add_argument("--format", choices=("text", "mermaid", "both"), default="both")

    t = sub.add_parser("trace", help="inspect trace files", description="Show or compare recorded schedules.")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    ts = tsub.add_parser("show", help="summarize a trace")
    ts.add_argument("trace")
    ts.add_argument("--limit", type=int, default=20, help="events listed per reactor")
    td = tsub.add_parser("diff", help="first divergence per reactor between two traces")
    td.add_argument("a")
    td.add_argument("b")

    pl = sub.add_parser("plot", help="plot a run's learning curves",
                        description="Write a PNG of the learning curves in a run directory.")
    pl.add_argument("run_dir", help="a run directory written by a training app (holds metrics.csv)")
    pl.add_argument("-o", "--out", default=None, help="the PNG's path (default RUN_DIR/curves.png)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (AppError, GraphError, MalformedFrameError, FileNotFoundError, ValueError) as e:
        msg = str(e).replace("\n", "\n  ") if isinstance(e, GraphError) else str(e).splitlines()[0]
        print(f"reactor: {msg}", file=sys.stderr)
        return 2
    except ReactorError as e:
        print(f"reactor: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "graph":
        graph = build_graph(args.app, parse_overrides(args.overrides))
        graph.validate()
        if args.format in ("text", "both"):
            print(graph.describe())
        if args.format == "both":
            print()
        if args.format in ("mermaid", "both"):
            print(graph.mermaid())
        return 0
    if args.command == "plot":
        from .nodes.plot import plot_run

        print(plot_run(args.run_dir, args.out))
        return 0
    if args.command == "trace":
        from ._trace import describe, diff, read_trace

        if args.trace_command == "show":
            print(describe(read_trace(args.trace), limit=args.limit))
            return 0
        lines = diff(read_trace(args.a), read_trace(args.b))
        print("\n".join(lines) if lines else "traces are identical")
        return 1 if lines else 0
    # run
    from .launch._runtime import new_run_id, run

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = parse_overrides(args.overrides)
    new_run_id()  # before build: an app may name its run directory after it
    graph = build_graph(args.app, overrides)
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
    )
    if args.json:
        print(json.dumps({"placement": result.placement, "stopped_by": result.stopped_by,
                          "events": dict(result.events), "digests": dict(result.digests),
                          "processes": {k: dict(v) for k, v in result.processes.items()},
                          "dropped": dict(result.dropped)}, indent=2))
    else:
        total = sum(result.events.values())
        print(f"run ended ({result.stopped_by}): {total} events in {len(result.events)} reactors, "
              f"placement {result.placement}")
        for name, d in sorted(result.digests.items()):
            print(f"  {name}: {d}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
