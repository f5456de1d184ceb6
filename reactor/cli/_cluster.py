"""Jobs a cluster engine starts (``reactor slurm``, ``ray``, ``k8s render``): their ``reactor run``
options, and a job's ``--set`` keys and values, checked here before the job is made."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._errors import refusal_line
from ..launch._app import blamed_setting, check_imports_shipped, compile_app, parse_overrides
from ._appcode import _app_code, _bounded, check_given_file


def _cluster_run_args(args: argparse.Namespace) -> list[str]:
    """The ``reactor run`` options of a job a cluster engine starts (slurm, k8s), checked here."""
    from ..launch._groups import restart_from_text
    from ..launch._policies import POLICIES

    if args.placement not in POLICIES:
        raise ValueError(f"--placement {args.placement!r}: a {args.command} job spreads its groups over its daemons "
                         f"with a distribution policy ({', '.join(sorted(POLICIES))})")
    if args.restart:
        restart_from_text(args.restart)
        from ..launch._runtime import restart_refusal

        why = restart_refusal(args.restart, deterministic=not args.async_)
        if why is not None:
            raise ValueError(why)
    overrides = parse_overrides(args.overrides)
    run_args = ["--placement", args.placement, "--seed", str(args.seed)]
    run_args += ["--async"] if args.async_ else []
    run_args += ["--restart", args.restart] if args.restart else []
    for o in args.overrides:
        run_args += ["--set", o]
    for f in args.files:
        check_given_file("--with file", f)
        run_args += ["--with", str(Path(f).resolve())]
    if not Path(args.app).is_file():
        raise FileNotFoundError(f"no app file {args.app}")
    with _app_code(args.app):  # (as submit: not imported, its modules may be the cluster's only; a file that is
        compile_app(args.app)  # not Python failed there, after the allocation)
    # (a module beside the app that does not go with it: its workers failed to import it, after the allocation)
    if note := check_imports_shipped(args.app, args.files, f"a {args.command} job", overrides):
        print(f"reactor: {note}", file=sys.stderr)
    if overrides:
        _check_config_here(args.app, overrides, args.overrides, args.placement)
    return run_args


def _check_config_here(app: str, overrides: dict[str, Any], items: Sequence[str], placement: str | None = None,
                       hosts: str | None = None) -> None:
    """A job's ``--set`` keys and values (``items``, as given; ``overrides``, parsed), checked as ``reactor
    run`` checks them, before the job is made (``reactor submit``, ``k8s render``, ``slurm``): a key the app's
    Config and its algorithm lack, a value of the wrong type (``make_config``), and a value its graph refuses
    (``--set producers=0``: replicas must be an int >= 1), which failed only in the job, after the daemons
    were up. That needs the app imported and its graph built here. An app that does not import here (a
    module only the cluster's image has) is said, and its run checks them there; so is a graph that does
    not build here for another reason than a ``--set`` value (what the refusal blames, :func:`blamed_setting`,
    as ``reactor run`` says it): a file or a device only the job's host has, say. A refusal about a file
    (``OSError``) is never a ``--set`` value's here: the file may be the job's host's. With ``placement``
    (and ``hosts``), a graph that builds is placed as the run would place it, and a placement refusal blamed
    on a ``--set`` value is refused too: ``--set learners=2`` under placement ``single`` or ``actors`` (both
    replicas in one process) was taken, and the job failed in its daemon's log at once.

    Raises:
        AppError: a key or value ``make_config`` refuses.
        GraphError, ValueError: the graph refuses a ``--set`` value (reactor's refusal, blamed on it).
    """
    from .._errors import refusal_class
    from .._graph import Graph
    from ..launch._app import load_app, make_config

    def first_line(e: BaseException) -> str:
        return f"{type(e).__name__}: {_bounded((str(e).splitlines() or [''])[0])}"

    try:
        module = load_app(app)
    except Exception as e:  # noqa: BLE001 - the app's own import, not a mistake of the command line
        print(f"reactor: the --set values were not checked here: the app does not import here ({first_line(e)}); its "
              f"run checks them when it starts", file=sys.stderr)
        return
    config = make_config(module, overrides)
    try:
        graph = module.build(config)
        if isinstance(graph, Graph):
            graph.validate()
    except Exception as e:  # noqa: BLE001 - refused below only where a --set value is what it refuses
        if refusal_class(e) is not None and not isinstance(e, OSError) \
                and blamed_setting(e, refusal_line(e), app, items) is not None:
            raise  # (main says it as reactor run does: "--set producers=0: replicas must be ...")
        print(f"reactor: the --set values were checked against the app's config, not its graph: it does not build "
              f"here ({first_line(e)}); its run builds it when it starts", file=sys.stderr)
        return
    if placement is None or not isinstance(graph, Graph):
        return
    from ..launch._placement import check_replicas_apart, resolve_placement
    from ..launch._policies import POLICIES

    try:
        if placement == "single":
            check_replicas_apart(graph, {n: "main" for _, _, n in graph.instances()}, placement)
        else:  # (a policy's groups are the same over any hosts; a hosts file's keys may be the job's host's)
            resolve_placement(graph, placement, None if placement in POLICIES else hosts)
    except Exception as e:  # noqa: BLE001 - refused here only where a --set value is what it refuses
        if refusal_class(e) is not None and not isinstance(e, OSError) \
                and blamed_setting(e, refusal_line(e), app, items) is not None:
            raise  # (its run refuses it alike, at once, in the job's log)
