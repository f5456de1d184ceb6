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
import errno
import json
import logging
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ._errors import REFUSALS, GraphError, ReactorError, raised_by_reactor, refusal_line
from .launch._app import blamed_setting, build_graph, parse_overrides


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
    r.add_argument("--hosts", default=None, metavar="FILE",
                   help="a hosts file ([hosts]: daemon addresses) to spread a distribution policy's groups over")
    r.add_argument("--with", dest="files", action="append", default=[], metavar="FILE",
                   help="runs over hosts: a file the app needs beside it, shipped to every host (repeatable)")
    r.add_argument("--keys", default=None, metavar="DIR",
                   help="runs over hosts: your key directory (default: $REACTOR_KEYS or ~/.reactor/keys)")
    r.add_argument("--restart", default=None, metavar="POLICY",
                   help="async multi-process runs: never | on-failure | on-failure:N (at most N restarts per "
                        "process in a row), then ,backoff_s=S ,host_wait_s=S ,reset_after_s=S if wanted "
                        "(on-failure:5,host_wait_s=60; a life of reset_after_s, 600 by default, starts the count "
                        "again), for every group (replaces the placement file's restart fields)")
    r.add_argument("--seed", type=_seed_arg, default=0, help="run seed (default 0)")
    r.add_argument("--stop-s", type=float, default=None,
                   help="end at this logical time in seconds (deterministic, the default: logical time goes at "
                        "the run's own pace, not the wall clock's: 4 s of DQN's took 2 minutes here) or after this "
                        "many wall-clock seconds (--async)")
    r.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="set config fields of the app or its algorithm (--set env=Acrobot-v1 lr=5e-4; repeatable)")
    r.add_argument("--digest", action="store_true", help="print a hash of every message each reactor received")
    r.add_argument("--json", action="store_true", help="print the run result as JSON")
    r.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")

    g = sub.add_parser("graph", help="print an app's topology", description="Print the graph as text and Mermaid.")
    g.add_argument("app", help="path of an app file defining build(config) -> Graph")
    g.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="set config fields of the app or its algorithm, as for run (repeatable)")
    g.add_argument("--format", choices=("text", "mermaid", "both"), default="both",
                   help="text (reactors and links), mermaid (a flowchart), or both (default)")

    t = sub.add_parser("trace", help="inspect trace files", description="Show or compare recorded schedules.")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    ts = tsub.add_parser("show", help="summarize a trace")
    ts.add_argument("trace", help="a trace file (reactor run --async --record)")
    ts.add_argument("--limit", type=_count_arg, default=20, help="events listed per reactor")
    td = tsub.add_parser("diff", help="first divergence per reactor between two traces",
                         description="Print the first divergence per reactor between two traces; exit status 0 "
                                     "when they are identical, 1 when they differ (as diff's).")
    td.add_argument("a", help="a trace file (reactor run --async --record)")
    td.add_argument("b", help="another trace file")

    pl = sub.add_parser("plot", help="plot a run's learning curves",
                        description="Write a PNG of the learning curves in a run directory.")
    pl.add_argument("run_dir", help="a run directory written by a training app (holds metrics.csv)")
    pl.add_argument("-o", "--out", default=None, help="the PNG's path (default RUN_DIR/curves.png)")
    pl.add_argument("--x", choices=("env_steps", "wall"), default="env_steps",
                    help="the x axis: env steps (default) or wall time since training started")
    pl.add_argument("--target", type=_finite_arg, default=None,
                    help="the return to mark (default: the run's target_return from its summary.json)")
    pl.add_argument("--no-target", action="store_true", help="mark no target")

    ev = sub.add_parser("eval", help="play a trained policy", description="Run a run directory's trained policy on "
                        "its env (greedy) and print the mean and std of its episode returns.")
    ev.add_argument("run_dir", help="a run directory written by a training app (holds config.json and learner.pt)")
    ev.add_argument("--episodes", type=int, default=10, help="episodes to play (default 10)")
    ev.add_argument("--seed", type=_seed_arg, default=0, help="the episodes' env seed (default 0)")
    ev.add_argument("--video", default=None, metavar="DIR",
                    help="record each episode as an MP4 in DIR (gymnasium's RecordVideo; pip install 'reactor[video]')")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")

    k = sub.add_parser("keys", help="CURVE keys for daemons and clients")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    ki = ksub.add_parser("init", help="make a key directory: key, key.pub, authorized/")
    ki.add_argument("dir", nargs="?", default=None, help="default: $REACTOR_KEYS or ~/.reactor/keys")

    d = sub.add_parser("daemon", help="host jobs on this machine", description="A long-lived daemon hosting jobs.")
    d.add_argument("--listen", required=True, type=_listen_address, help="tcp://ADDR:PORT (PORT * for any)")
    d.add_argument("--name", required=True, help="this daemon's name (a host name in placements)")
    d.add_argument("--state-dir", required=True, help="where it keeps its jobs, their logs and its own log")
    d.add_argument("--keys", default=None, help="its key directory (default: $REACTOR_KEYS or ~/.reactor/keys)")
    d.add_argument("--advertise", default=None,
                   help="the address other hosts reach this one at (needed when --listen is a wildcard)")
    d.add_argument("--preload", default="",
                   help="more modules its fork server imports once for every worker (comma-separated: "
                        "your environments' packages, say)")
    d.add_argument("--no-fork-server", action="store_true",
                   help="start every worker as a new interpreter (each imports torch anew: seconds more per start)")
    d.add_argument("--keep-ended", type=_count_arg, default=None, metavar="N",
                   help="how many ended jobs (and ended runs hosted for jobs elsewhere) it keeps listing; older "
                        "ones are forgotten, their directories left on disk (default: 200)")
    d.add_argument("--forget-after-s", type=_seconds_arg, default=None, metavar="S",
                   help="an ended job or hosted run past --keep-ended is forgotten no sooner than this long after "
                        "its end (default: 60)")
    d.add_argument("--remove-forgotten", action="store_true",
                   help="remove the directory of each ended job and hosted run it forgets (see --keep-ended and "
                        "--forget-after-s), and those that runs of its earlier lives left, instead of leaving them "
                        "on disk: the state directory stays bounded, the older jobs' files go")
    d.add_argument("--stop-after-runs", dest="stop_after_runs_s", type=_seconds_arg, default=None, metavar="S",
                   help="on SIGTERM, give the coordinators of the runs it hosts up to S seconds to end them (and copy "
                        "their files back) before it ends what is left and stops, rather than ending them at once: "
                        "for daemons that a job's own stop signal reaches with its coordinator (reactor slurm's, "
                        "under scancel)")
    d.add_argument("--die-with-parent", action="store_true",
                   help="end (as on SIGTERM) when the process that started it ends: how a supervisor such as a "
                        "Ray actor runs it")

    def client(parser: argparse.ArgumentParser, submit: bool = False) -> None:
        # (status, logs and stop have no --placement or --hosts to find the daemon in: they need --daemon)
        parser.add_argument("--daemon", default=None, type=_daemon_address,
                            help="the daemon's tcp://HOST:PORT (default: the head host of --placement/--hosts)" if submit
                            else "the tcp://HOST:PORT of the daemon the job was submitted to (reactor submit printed "
                                 "it when it found the daemon in a placement or hosts file)")
        parser.add_argument("--daemon-key", default=None,
                            help="the daemon's key.pub, or its Z85 text (default: as the hosts file says, else your own "
                                 "key: a cluster key)" if submit else "the daemon's key.pub, or its Z85 text (default: "
                                 "your own key: a cluster key)")
        parser.add_argument("--keys", default=None, help="your key directory (default: $REACTOR_KEYS or ~/.reactor/keys)")
        parser.add_argument("--timeout-s", type=_answer_seconds, default=10.0, help="how long to wait for each answer")

    sl = sub.add_parser("slurm", help="run an app on a Slurm allocation: sbatch starts a daemon per node",
                        description="Submit an app to Slurm: one reactor daemon per node (or per task) started by "
                                    "srun with keys made for the job, the app run over them; prints Slurm's job id.")
    sl.add_argument("app", help="path of an app file defining build(config) -> Graph")
    sl.add_argument("--nodes", type=int, default=1, help="nodes to allocate (default 1)")
    sl.add_argument("--tasks-per-node", type=int, default=1, help="daemons per node (default 1)")
    sl.add_argument("--partition", default=None)
    sl.add_argument("--time", dest="time_limit", default=None, help="Slurm's time limit (e.g. 1:00:00)")
    sl.add_argument("--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="ARG",
                    help="another #SBATCH line, e.g. --sbatch-arg=--mem=8G (repeatable)")
    sl.add_argument("--out", default=None, metavar="DIR",
                    help="the job's directory, on a file system every node sees (default ./reactor-slurm/APP-TIME)")
    sl.add_argument("--here", action="store_true",
                    help="inside an allocation (sbatch, salloc): start the daemons and run now")

    ry = sub.add_parser("ray", help="run an app on a Ray cluster: a daemon per Ray node, started as Ray actors",
                        description="Start one reactor daemon per Ray node (actors in a STRICT_SPREAD placement "
                                    "group), run the app over them from here, stop them. Ray starts processes; the "
                                    "data stays on reactor's links.")
    ry.add_argument("app", help="path of an app file defining build(config) -> Graph")
    ry.add_argument("--address", default="auto",
                    help="the Ray cluster: auto (the one this machine belongs to), ray://HOST:PORT, or local "
                         "(start a one-node Ray here) (default auto)")
    ry.add_argument("--nodes", type=int, default=None, help="daemons, one per node (default: every live node)")
    ry.add_argument("--cpus-per-daemon", type=float, default=1.0, help="CPUs each daemon reserves (default 1)")
    ry.add_argument("--max-restarts", type=int, default=3, help="Ray's restarts of a daemon actor that dies")

    k8 = sub.add_parser("k8s", help="Kubernetes manifests: a StatefulSet of daemons and a Job running the app")
    k8sub = k8.add_subparsers(dest="k8s_command", required=True)
    kr = k8sub.add_parser("render", help="print the manifests (kubectl apply -f - takes them)",
                          description="Fill in reactor/launch/kubernetes/: a Secret with a CURVE key pair made now, "
                                      "a StatefulSet of REPLICAS daemons behind a headless Service, the app in a "
                                      "ConfigMap, and a Job that runs it over the daemons.")
    kr.add_argument("app", help="path of an app file defining build(config) -> Graph")
    kr.add_argument("--replicas", type=int, default=3, help="daemons (pods) (default 3)")
    kr.add_argument("--image", default="reactor:latest", help="an image with reactor installed (deploy/Dockerfile; default reactor:latest)")
    kr.add_argument("--name", default="reactor", help="the prefix of every object's name (default reactor)")
    kr.add_argument("--namespace", default="default")
    kr.add_argument("--cpu", default="1", help="each daemon pod's CPU request (default 1)")
    kr.add_argument("--memory", default="2Gi", help="each daemon pod's memory request (default 2Gi)")
    kr.add_argument("--shm-size", default="1Gi", help="each daemon pod's /dev/shm (replay shards) (default 1Gi)")
    kr.add_argument("--out", default=None, metavar="FILE", help="write here instead of stdout")
    for parser in (sl, ry, kr):  # the run's options, as `reactor run` takes them
        parser.add_argument("--placement", default="actors", help="a distribution policy: actors, colocated, dp-learners")
        parser.add_argument("--async", dest="async_", action="store_true", help="as for run: async mode")
        parser.add_argument("--restart", default=None, metavar="POLICY", help="as for run (async runs)")
        parser.add_argument("--seed", type=_seed_arg, default=0, help="run seed (default 0)")
        parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                            help="as for run: config fields of the app or its algorithm (repeatable)")
        parser.add_argument("--with", dest="files", action="append", default=[], metavar="FILE",
                            help="a file the app needs beside it, shipped to every host (repeatable)")

    su = sub.add_parser("submit", help="run an app as a job on a daemon; prints the job id",
                        description="Hand an app to a daemon as a job that runs there without this command "
                                    "(reactor status, logs and stop follow it); prints the job id.")
    su.add_argument("app", help="path of an app file defining build(config) -> Graph (sent with the job)")
    su.add_argument("--placement", default="single", help="as for run; a placement file travels with the job")
    su.add_argument("--hosts", default=None, metavar="FILE", help="as for run; travels with the job")
    su.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                    help="as for run: config fields of the app or its algorithm (repeatable)")
    su.add_argument("--seed", type=_seed_arg, default=0, help="run seed (default 0)")
    su.add_argument("--async", dest="async_", action="store_true", help="as for run: async mode")
    su.add_argument("--restart", default=None, metavar="POLICY", help="as for run (async runs)")
    su.add_argument("--with", dest="files", action="append", default=[], metavar="FILE",
                    help="a file the app needs beside it (repeatable)")
    su.add_argument("--check", action="store_true",
                    help="build the app's graph here first, as `reactor run` would (its config's keys and values, the "
                         "graph, the placement): for an app that runs here too. Without it, only what needs nothing of "
                         "the daemon's host is checked (files, placement name or TOML, the app's syntax, the --set syntax, "
                         "restart) and the --set keys and values, where the app imports here")
    client(su, submit=True)
    st = sub.add_parser("status", help="a daemon's jobs, or one job")
    st.add_argument("job", nargs="?", default=None, type=_job_arg,
                    help="a job id (what submit printed): the job and its groups; none: a line for each of the "
                         "daemon's jobs and each run it hosts workers of")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    client(st)
    lg = sub.add_parser("logs", help="a job's output, or one of its groups' on another host")
    lg.add_argument("job", type=_job_arg, help="a job id (what submit printed)")
    lg.add_argument("group", nargs="?", default=None,
                    help="a group of a job over hosts: its worker's output, from the daemon of its host")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    client(lg)
    sp = sub.add_parser("stop", help="stop a job (SIGTERM to its run, SIGKILL after a grace period)")
    sp.add_argument("job", type=_job_arg, help="a job id (what submit printed)")
    client(sp)
    return p


def _daemon_address(text: str) -> str:
    """``--daemon``: a tcp://HOST:PORT zmq can connect to (else zmq's own error, as a traceback)."""
    from .launch._protocol import tcp_address_error

    if tcp_address_error(text) is not None:
        hint = f" (tcp://{text}?)" if "://" not in text and ":" in text else ""
        raise argparse.ArgumentTypeError(f"{text!r:.200}: a daemon's address is tcp://HOST:PORT{hint}")
    return text


def _listen_address(text: str) -> str:
    """``daemon --listen``: a tcp://ADDR:PORT a daemon can bind (ADDR ``*`` or PORT ``*`` for any; else
    zmq's EINVAL, as a traceback)."""
    import re

    m = re.match(r"tcp://(\*|\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-]+)?\]|[A-Za-z0-9_.\-]+):(\*|[0-9]{1,5})\Z", text)
    if m is None or (m.group(3) != "*" and int(m.group(3)) > 65535):
        hint = f" (tcp://{text}?)" if "://" not in text and ":" in text else ""
        raise argparse.ArgumentTypeError(f"{text!r:.200}: a daemon listens on tcp://ADDR:PORT (ADDR or PORT * for "
                                          f"any){hint}")
    return text


def _job_arg(text: str) -> str:
    """A job id: the 16 hex digits ``reactor submit`` printed (the daemon's check, said for a user)."""
    from .launch._protocol import _JOB_RE

    if not _JOB_RE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r:.200} is not a job id: a job id is the 16 hex digits `reactor "
                                          f"submit` printed (`reactor status` lists the daemon's jobs)")
    return text


def _daemon_key(path: str) -> bytes:
    """``--daemon-key``: its public key, from a key.pub file or given as its Z85 text (as a hosts file
    takes it; what ``submit``'s hint prints for a key a hosts file gave as text); a file that cannot be
    read (a directory, say) is the user's mistake, named (ValueError: a one-line error)."""
    from .launch._cluster import Z85_KEY_RE
    from .transport import CurveKeys

    if Z85_KEY_RE.match(path) and not Path(path).exists():
        return path.encode()
    try:
        return CurveKeys.load_public(path)
    except FileNotFoundError:
        raise ValueError(f"--daemon-key {path}: no such file, and not a key's 40-character Z85 text either (give the "
                         f"daemon's key.pub, or the text in it)") from None
    except OSError as e:
        raise ValueError(f"--daemon-key {path}: {e.strerror or e}") from None


def _parsed_arg(text: str, convert: Callable[[str], Any], what: str) -> Any:
    """``convert(text)``, or the argument error naming ``what`` was expected."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} expected, got {_cut(text)}") from None


def _cut(text: str) -> str:
    """An argument as its error shows it: its repr, cut in the middle past ~80 characters."""
    return repr(text) if len(text) <= 80 else f"{text[:40]!r}...{text[-30:]!r} ({len(text)} characters)"


def _count_arg(text: str) -> int:
    """``--keep-ended``, ``trace show --limit`` (-1 listed all but one, and said 231 more of 230): an int >= 0."""
    n = _parsed_arg(text, int, "a whole number")
    if n < 0:
        raise argparse.ArgumentTypeError(f"a number >= 0 expected, got {text!r}")
    return n


def _seed_arg(text: str) -> int:
    """``--seed``: an int in [0, 2**63), what a job's record and gymnasium's env seeds take (-5 was
    gymnasium's traceback in ``reactor eval``; 2**70 a msgpack overflow)."""
    if text.strip().isdigit() and len(text.strip()) > 19:  # (int() refuses past 4,300 digits)
        raise argparse.ArgumentTypeError(f"a seed in [0, 2**63) expected, got {_cut(text)}")
    n = _parsed_arg(text, int, "a whole number")
    if not 0 <= n < 2**63:
        raise argparse.ArgumentTypeError(f"a seed in [0, 2**63) expected, got {_cut(text)}")
    return n


def _seconds_arg(text: str) -> float:
    """``--forget-after-s``: finite seconds >= 0."""
    s = _parsed_arg(text, float, "seconds")
    if not 0 <= s < float("inf"):
        raise argparse.ArgumentTypeError(f"finite seconds >= 0 expected, got {text!r}")
    return s


def _finite_arg(text: str) -> float:
    """``plot --target``: a finite number (nan drew no line and said nothing; inf broke the axes)."""
    x = _parsed_arg(text, float, "a number")
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"a finite number expected, got {_cut(text)}")
    return x


def _answer_seconds(text: str) -> float:
    """``--timeout-s``: finite seconds in (0, 1 day] (inf overflowed zmq's poll; nan and -1 never waited)."""
    s = _parsed_arg(text, float, "seconds")
    if not 0 < s <= 86400:
        raise argparse.ArgumentTypeError(f"seconds in (0, 86400] expected, got {text!r}")
    return s


_MESSAGE_CHARS = 2000


def _bounded(msg: str) -> str:
    """An error message cut to ~2,000 characters (a library's message may quote a value given on the
    command line whole: an env name of 3,000 characters came back twice)."""
    if len(msg) <= _MESSAGE_CHARS:
        return msg
    return f"{msg[:_MESSAGE_CHARS - 300]} ... [{len(msg) - _MESSAGE_CHARS + 100} characters cut] ... {msg[-200:]}"


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
    from .launch._runtime import exit_without_teardown

    exit_without_teardown(rc)


def main(argv: Sequence[str] | None = None, *, started: float | None = None) -> int:
    """The ``reactor`` command; ``started``: when the command began (a cluster command that runs
    ``run`` itself passes its own start). A daemon's job (``$REACTOR_JOB_EXIT_FILE`` set) writes its
    exit status there as it ends (``reactor/launch/_daemon.py``: a daemon that is not its parent, one
    started again after a crash, reads it)."""
    exit_file = os.environ.pop("REACTOR_JOB_EXIT_FILE", None)  # (the job's own command: not one it starts)
    if exit_file is None:
        return _main(argv, started)
    from .launch._daemon import record_job_exit

    rc = 1  # (an exception that ends the command: Python's exit status)
    try:
        rc = _main(argv, started)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        raise
    finally:
        record_job_exit(exit_file, rc)
    return rc


def _main(argv: Sequence[str] | None, started: float | None) -> int:
    args = _parser().parse_args(argv)
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
        from .launch._signals import received

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


class _AppCodeError(Exception):
    """The app's own code failed while it was imported or built: ``text`` is what to print."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


@contextlib.contextmanager
def _app_code(app: str) -> Iterator[None]:
    """Around importing and building the app (not its run: a reaction's error is the run's, as under
    every placement): an error of the app's own code becomes :class:`_AppCodeError` (:func:`_app_error`)."""
    try:
        yield
    except Exception as e:
        told = _app_error(e, app)
        if told is None:
            raise
        raise _AppCodeError(told) from e


def _app_error(e: BaseException, app: str | None) -> str | None:
    """What to print for an error raised by the app file's own code (a syntax error, an import it lacks,
    a bug in its ``build``), or None for any other (reactor's own errors name what was wrong in one
    line, and are printed so; an error of reactor itself keeps its whole traceback).

    Printed: the traceback from the app's first frame on (the frames of reactor's command and launcher
    above it say nothing about the user's code), then ``reactor: APP line N, in FUNC: TYPE: message``.
    An error raised in reactor's own code, called from the app (a ``GraphError`` naming the app line,
    a config value refused, or a bug of reactor's), is reactor's: None (its one line, or its whole
    traceback). Only the app's import and build come here (:func:`_app_code`): an error in a
    reaction is the run's, reported alike under every placement."""
    import traceback

    if not app or isinstance(e, BrokenPipeError):  # (the output's reader left: main's quiet end)
        return None
    try:
        path = Path(app).resolve()
    except (OSError, RuntimeError):
        return None
    if isinstance(e, SyntaxError) and e.filename and Path(e.filename).resolve() == path:
        shown = "".join(traceback.format_exception_only(type(e), e)).rstrip()
        return f"{shown}\nreactor: {app} line {e.lineno}: {type(e).__name__}: {_bounded(str(e.msg))}"
    frames = traceback.extract_tb(e.__traceback__)
    mine = [i for i, f in enumerate(frames) if Path(f.filename).resolve() == path]  # (the app's frames)
    if not mine or Path(__file__).resolve().parent in Path(frames[-1].filename).resolve().parents:
        return None  # (not through the app; or raised in reactor's code, called from the app: its checks'
        # message says what, or a bug's whole traceback shows where)
    at = frames[mine[-1]]
    shown = "".join(traceback.format_list(frames[mine[0]:])) + "".join(traceback.format_exception_only(type(e), e))
    message = (str(e).splitlines() or [""])[0]
    return (f"Traceback (the app's frames):\n{shown.rstrip()}\nreactor: {app} line {at.lineno}, in {at.name}: "
            f"{type(e).__name__}{': ' + _bounded(message) if message else ''}")


def _eval(args: argparse.Namespace) -> int:
    """reactor eval RUN_DIR: the trained policy's greedy returns on its env."""
    from .nodes._policy import evaluate_policy, load_policy

    policy = load_policy(args.run_dir)
    returns = evaluate_policy(policy, args.episodes, seed=args.seed, video_dir=args.video)
    if args.json:
        from .nodes.metrics import json_safe

        print(json.dumps(json_safe({"run_dir": str(args.run_dir), "algo": policy.algo, "env": policy.env,
                                    "updates": policy.updates, "episodes": len(returns), "mean": float(returns.mean()),
                                    "std": float(returns.std()), "returns": [float(r) for r in returns]})))
    else:
        print(f"{policy.algo} on {policy.env} ({policy.updates} updates): return {returns.mean():.1f} "
              f"± {returns.std():.1f} over {len(returns)} episodes (min {returns.min():.1f}, max {returns.max():.1f})"
              + (f"; videos in {args.video}" if args.video else ""))
    return 0


def _jobs(args: argparse.Namespace) -> int:
    """keys, daemon, submit, status, logs, stop."""
    from .launch._daemon import Daemon, DaemonClient, DaemonError, job_spec
    from .launch._keys import default_keys_dir, init_keys, load_keys

    keys_dir = getattr(args, "keys", None) or default_keys_dir()
    if args.command == "keys":
        directory = args.dir or default_keys_dir()
        keys = init_keys(directory)
        print(f"made {directory}/key and key.pub ({keys.public.decode()}); add clients' key.pub files to "
              f"{directory}/authorized/")
        return 0
    if args.command == "daemon":
        from .launch._runtime import asyncio_run

        state = Path(args.state_dir)
        if state.exists() and not state.is_dir():
            raise NotADirectoryError(f"--state-dir {state} is a file, not a directory")
        made = not state.exists()
        state.mkdir(parents=True, exist_ok=True)
        import logging.handlers

        # Watched: a log rotated under it (logrotate moves it away) is opened again at its path, not written
        # on in the moved file, nor (once that is deleted) in a file no one sees that still takes the disk.
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                            handlers=[logging.handlers.WatchedFileHandler(state / "daemon.log"),
                                      logging.StreamHandler()])
        from .launch._forkserver import TRAINING_PRELOAD

        if args.die_with_parent:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
            if os.getppid() == 1:
                return 1
        extra = [m.strip() for m in args.preload.split(",") if m.strip()]
        served = False
        try:
            daemon = Daemon(args.listen, args.name, state, keys_dir, advertise=args.advertise,
                            preload=None if args.no_fork_server else [*TRAINING_PRELOAD, *extra],
                            **({} if args.keep_ended is None else {"keep_ended": args.keep_ended}),
                            **({} if args.forget_after_s is None else {"forget_after_s": args.forget_after_s}),
                            remove_forgotten=args.remove_forgotten, stop_after_runs_s=args.stop_after_runs_s)

            def ready(address: str) -> None:
                nonlocal served
                served = True
                if not args.die_with_parent and (why := _volatile_state(state)):  # (a supervised one's goes with it)
                    logging.getLogger("reactor.daemon").warning(
                        "--state-dir %s is %s: the records, logs and files of the jobs kept there will not survive a "
                        "reboot (give a directory on a disk: /var/lib/reactor, say)", state, why)
                print(json.dumps({"address": address, "advertised": daemon.reach, "name": args.name,
                                  "public_key": daemon.keys.public.decode()}), flush=True)

            asyncio_run(daemon.serve(ready))
        except BaseException:
            if made and not served:  # (a port in use, say: no state directory of a daemon that never served)
                _remove_unserved_state(state)
            raise
        return 0
    if args.command == "submit":
        _check_job(args)  # (before keys and the daemon: the job's own mistakes first)
    address, daemon_key = _daemon_of(args, load_keys(keys_dir).public)
    try:
        with DaemonClient(address, daemon_key, load_keys(keys_dir),
                          timeout_s=args.timeout_s) as c:
            if args.command == "submit":
                spec = job_spec(args.app, placement=args.placement, config=parse_overrides(args.overrides),
                                seed=args.seed, async_=args.async_, files=args.files, hosts=args.hosts,
                                restart=args.restart)
                job = c.request("submit", spec)
                print(job)
                if not args.daemon:
                    print(f"on {address}: reactor status {job} --daemon {address}{_key_hint(args, daemon_key, keys_dir)}",
                          file=sys.stderr)
            elif args.command == "status":
                got = c.request("status", args.job)
                rows = got if isinstance(got, list) else [got]
                hosted = c.request("hosted") if args.job is None else []
                if args.json:  # (stable: every job, and every worker hosted here; what the lines below sum up)
                    print(json.dumps(got if args.job is not None else {"jobs": got, "hosted": hosted}, indent=2))
                elif args.job is not None:
                    print(_job_line(got))
                    here = {w["group"]: w for w in c.request("hosted") if w["run"] == got.get("run")}
                    for g, where in sorted((got.get("groups") or {}).items()):
                        print(f"  {_where(g, where)}" + (f"  {_worker_line(here[g])}" if g in here else ""))
                    for w in got.get("workers") or []:  # (a running job on this host alone)
                        print(f"  {w['group']}  {w['state']}  pid {w['pid']}  restarts {w['restarts']}")
                    if got.get("groups"):
                        print(f"  (run {got['run']}; reactor logs {got['id']} GROUP)")
                else:
                    if not rows:  # (it answered: say so, not nothing)
                        print(f"no jobs on the daemon at {address}" + ("; runs it hosts workers of:" if hosted
                                                                        else "; it hosts no workers of runs elsewhere"))
                    for j in rows:
                        print(_job_line(j))
                    jobs_of = {j["run"]: j["id"] for j in rows if j.get("run")}
                    for run, workers in _by_run(hosted).items():
                        print(_run_line(run, workers, jobs_of.get(run)))
            elif args.command == "logs" and args.group is None:
                _print_log(lambda offset: c.request("logs", args.job, offset), args.follow)
            elif args.command == "logs":
                job = c.request("status", args.job)
                groups = job.get("groups") or {}
                if args.group not in groups:
                    raise DaemonError(f"job {args.job} has no group {args.group!r} on a host of its own (it has "
                                      f"{', '.join(sorted(groups)) or _no_groups(job)}); reactor logs {args.job} shows "
                                      f"the job's log")
                where = groups[args.group]
                keys = load_keys(keys_dir)
                host_key = where["key"].encode() if where["key"] else keys.public  # none: the cluster key
                with DaemonClient(where["address"], host_key, keys, timeout_s=args.timeout_s) as w:
                    _print_log(lambda offset: w.request("worker_log", job["run"], args.group, offset), args.follow)
            else:
                j = c.request("stop", args.job)
                if j["state"] == "running":  # (asked to stop: its run stops its workers cleanly, then ends)
                    from .launch._daemon import STOP_GRACE_S

                    print(f"{j['id']}  stopping (asked to stop cleanly; at once if it has not ended {STOP_GRACE_S:g} s "
                          f"after the first request)")
                else:
                    print(f"{j['id']}  {j['state']}")
    except DaemonError as e:
        print(f"reactor: {e}", file=sys.stderr)
        return 1
    return 0


def _no_groups(job: dict[str, Any]) -> str:
    """Why a job has no group on a host of its own, for ``reactor logs JOB GROUP``: it runs on one host, or
    it runs over hosts and none of its workers started (yet, or ever: its run failed before)."""
    if not job.get("over_hosts"):  # (False; None: a daemon that does not say, or a record from before it did)
        return ("none: it runs on one host, and its groups write to its own log" if job.get("over_hosts") is False
                else "none: it runs on one host, or none of its workers started")
    if job["state"] == "running":
        return "none yet: it runs over hosts, and none of its workers has started"
    return "none: it ran over hosts, and ended before any of its workers started; its own log says why"


def _key_hint(args: argparse.Namespace, daemon_key: bytes, keys_dir: str | os.PathLike[str]) -> str:
    """The ``--daemon-key`` that ``submit``'s hint needs where the daemon's key is not the client's own
    (a hosts file gave it: each side its own pair); empty for a cluster key. Without it the hinted
    ``reactor status`` waited out its timeout and blamed the keys."""
    import shlex

    from .launch._keys import load_keys

    if daemon_key == load_keys(keys_dir).public:
        return ""
    given = args.daemon_key if args.daemon_key else daemon_key.decode()
    if args.daemon_key and not Path(given).is_absolute() and Path(given).exists():
        given = str(Path(given).resolve())
    return f" --daemon-key {shlex.quote(given)}"


def _remove_unserved_state(state: Path) -> None:
    """Remove the state directory this command made for a daemon that failed before it served: only
    what such a daemon puts there, and only if no other daemon holds its lock (one started on the same
    new directory meanwhile); anything else found there keeps the directory."""
    import fcntl

    try:
        fd = os.open(state / "daemon.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        pass  # (it failed before it took its lock)
    except OSError:
        return
    else:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(state / "daemon.lock")
        except OSError:  # (BlockingIOError: another daemon's now: leave it all)
            return
        finally:
            os.close(fd)
    for name in ("daemon.log", "daemon.json"):
        with contextlib.suppress(OSError):
            if (state / name).is_file() and not (state / name).is_symlink():
                os.unlink(state / name)
    for name in ("jobs", "runs", ".removing", ""):
        with contextlib.suppress(OSError):
            os.rmdir(state / name)  # (only if empty)


def _volatile_state(state: Path) -> str | None:
    """Why a daemon's state directory would not outlive a reboot, in words: on a file system kept in
    memory (tmpfs, ramfs: /dev/shm, a /tmp mounted so), or under /tmp (cleared at boot on many systems,
    and by systemd-tmpfiles of what is untouched for 10 days); None for any other."""
    path = state.resolve()
    mounts: list[tuple[str, str]] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3:  # (a space in a mount point is written \040)
                mounts.append((fields[1].replace("\\040", " "), fields[2]))
    under = [(m, kind) for m, kind in mounts if path == Path(m) or Path(m) in path.parents]
    if under:
        mount, kind = max(under, key=lambda u: len(u[0]))
        if kind in ("tmpfs", "ramfs"):
            return f"on a {kind} at {mount} (kept in memory)"
    if path == Path("/tmp") or Path("/tmp") in path.parents:
        return "under /tmp (cleared at boot on many systems)"
    return None


def _where(group: str, where: dict[str, Any]) -> str:
    """A job's group in ``reactor status JOB``: its host, and a restart's wait for one."""
    return f"{group} on {where['host']}" + (f" ({where['waiting']})" if where.get("waiting") else "")


def _job_line(j: dict[str, Any]) -> str:
    """One job in ``reactor status``: id, state and exit status, age, app, and where its groups run."""
    rc = "" if j["returncode"] is None else f" exit {j['returncode']}"
    groups = j.get("groups") or {}
    spread = (f"  {len(groups)} group{'s' * (len(groups) != 1)} on {len({w['host'] for w in groups.values()})} "
              f"host{'s' * (len({w['host'] for w in groups.values()}) != 1)}" if groups else "")
    if local := j.get("workers"):  # (a running job on its daemon's host alone: its coordinator's workers)
        spread = (f"  workers {sum(w['state'] == 'running' for w in local)}/{len(local)} alive  restarts "
                  f"{sum(w['restarts'] for w in local)}")
    return (f"{j['id']}  {j['state']}{rc}  {j['app']} --placement {j['placement']}  pid {j['pid']}  "
            f"up {j['uptime_s']:.1f}s  on {j['daemon']}{spread}  | {j['last_line']}")


def _exit_words(rc: int, short: bool = False) -> str:
    """An exit status with what it says of a reactor worker: "4 (stopped because the run failed)"
    (143, SIGTERM's, read as a failure of its own); ``short``: the words before the colon."""
    from .launch._protocol import worker_exit_words

    words = worker_exit_words(rc)
    if short:
        words = words.split(":")[0]
    return f"{rc} ({words})" if words else str(rc)


def _worker_line(w: dict[str, Any]) -> str:
    """One hosted worker in ``reactor status JOB``."""
    rc = "" if w["returncode"] is None else f" exit {_exit_words(w['returncode'])}"
    return f"{w['state']}{rc}  pid {w['pid']}  up {w['uptime_s']:.1f}s  restarts {w.get('restarts', 0)}"


def _by_run(hosted: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The workers a daemon hosts (``hosted``), by run, in its order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for w in hosted:
        out.setdefault(w["run"], []).append(w)
    return out


def _run_line(run: str, workers: list[dict[str, Any]], job: str | None) -> str:
    """One run a daemon hosts workers of, in ``reactor status``: one line however many workers (it was a
    line a worker: 800 lines for the 200 ended runs a daemon keeps): running while one of them runs, its
    age (its oldest worker's), workers alive of all, restarts, and the exit statuses of the first ended."""
    alive = sum(w["returncode"] is None for w in workers)
    ended = [w for w in workers if w["returncode"] is not None]
    exits = ", ".join(f"{w['group']} {_exit_words(w['returncode'], short=True)}" for w in ended[:3]) + (f" +{len(ended) - 3}" if len(ended) > 3
                                                                                else "")
    return (f"run {run}  {'running' if alive else 'ended'}  up {max(w['uptime_s'] for w in workers):.1f}s  "
            f"workers {alive}/{len(workers)} alive  restarts {sum(w.get('restarts', 0) for w in workers)}"
            f"{f'  exits {exits}' if exits else ''}  on {workers[0]['daemon']}"
            f"{f'  (job {job}; reactor status {job})' if job else ''}")


def _print_log(read: Any, follow: bool) -> None:
    """Print a log chunk by chunk (``read(offset)`` -> data, offset, done): to its end as it is now, or
    with ``follow``, on until the job is done. (One answer carries at most ``LOG_CHUNK_NBYTES``: the log
    of a job that printed more was cut there, mid-line and without a word, its end never shown.)"""
    offset = 0
    while True:
        got = read(offset)
        sys.stdout.buffer.write(got["data"])
        sys.stdout.flush()
        offset = got["offset"]
        if not got["data"] and (got["done"] or not follow):
            break
        if not got["data"]:
            time.sleep(0.2)


def _daemon_of(args: argparse.Namespace, own_key: bytes) -> tuple[str, bytes]:
    """The daemon a job command talks to: ``--daemon``, else the head host of the placement file
    or hosts file (its first group's first host, else the first host listed); with its key:
    ``--daemon-key`` if given, else the hosts file's, else ``own_key`` (a cluster key)."""
    from .launch._cluster import head_host

    given = _daemon_key(args.daemon_key) if args.daemon_key else None
    if args.daemon:
        return args.daemon, given or own_key
    source = getattr(args, "hosts", None) or getattr(args, "placement", None)
    if not source or not Path(source).is_file():
        raise ValueError("which daemon? give --daemon tcp://HOST:PORT (or, to submit, a placement or --hosts file "
                         "naming [hosts])")
    host = head_host(source)
    return host.address, given or host.key or own_key


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "slurm":
        return _slurm(args)
    if args.command == "ray":
        from .launch._ray import here as ray_here

        if args.nodes is not None and args.nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {args.nodes}")
        run_args = _cluster_run_args(args)
        return ray_here(str(Path(args.app).resolve()), run_args, address=None if args.address == "local" else args.address,
                        nodes=args.nodes, cpus_per_daemon=args.cpus_per_daemon, max_restarts=args.max_restarts,
                        run_app=lambda a: main(a, started=args.started))
    if args.command == "k8s":
        from .launch._k8s import render

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
        from .nodes.plot import plot_run

        target = None if args.no_target else (args.target if args.target is not None else "summary")
        print(plot_run(args.run_dir, args.out, x=args.x, target=target))
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
    # Its processes inherit the command's start: summary.json reports the whole command's time.
    os.environ["REACTOR_COMMAND_T0"] = repr(args.started)
    if args.keys is not None:  # (as $REACTOR_KEYS: the coordinator loads the pair it talks to daemons with)
        os.environ["REACTOR_KEYS"] = args.keys
    from .launch._runtime import new_run_id, run

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
        from .launch._signals import received

        return 128 + (received[0] if received else signal.SIGINT)
    return 0


def _check_devices_here(graph: Any, args: argparse.Namespace) -> None:
    """A run whose processes are all on this host (no hosts file, no placement file naming hosts): a learner's
    CUDA device or a replay's GPU memory that this host cannot give is refused before anything starts, naming
    the ``--set`` item that asked for it. (It was refused in the node's startup, after the workers had started
    and made the run directory.) Over hosts, the node's own host may have the GPU: its startup says."""
    from .launch._forkserver import workers_here

    if args.hosts is not None or (args.placement != "single" and not workers_here(args.placement, None)):
        return
    if not any(isinstance(v, str) and v.startswith(("cuda", "pinned")) for n in graph.nodes.values()
               for v in (getattr(n.prototype, "device", None), getattr(n.prototype, "memory", None))):
        return  # (nothing asks for a GPU: torch is not imported for the check)
    from .nodes._device import cuda_refusal

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
    from .nodes.metrics import Metrics

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
    from .nodes.metrics import eval_age, result_lines

    summary = got.get("summary")
    if not isinstance(summary, dict):
        return
    last, why = summary.get("last_eval_return"), summary.get("stop_reason")
    plot = Path(got["run_dir"]) / "curves.png"
    print(result_lines(last if isinstance(last, (int, float)) and not isinstance(last, bool) else None,
                       why if isinstance(why, str) else "-", got["run_dir"], plot if plot.is_file() else None,
                       eval_age(summary, got["run_dir"])))


@contextlib.contextmanager
def _early_fork_server(args: argparse.Namespace) -> Iterator[None]:
    """A multi-process run on this host: start its fork server before the app is imported, so that
    the server's imports (torch, the nodes) overlap the command's own (measured: 1.5 s sooner to the
    first env step on a 2-core machine; benchmarks/bench_startstop.py). Inside the JSON-only block:
    workers write where the server's stdout points."""
    from .launch._forkserver import close_early, launch_early, workers_here

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
        GraphError: a placement that is neither a known name nor a file, or a bad restart policy.
        AppError: two of the files that go to other hosts would go under one name.
    """
    from .launch._groups import restart_from_text
    from .launch._policies import POLICIES

    for what, path in (("app file", args.app), ("hosts file", args.hosts), *(("--with file", f) for f in args.files)):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"no {what} at {path!r}")
    if args.files:  # (they go beside the app on the other hosts, found by name: a --with ppo.py was run as apps/ppo.py)
        from .launch._app import files_to_ship, shipped_files

        shipped_files(files_to_ship(args.app, args.files, getattr(args, "replay", None)))
    known = ("single", "processes", *sorted(POLICIES))
    if args.placement not in known and not Path(args.placement).is_file():
        if args.placement.endswith(".toml") or os.sep in args.placement:  # (meant as a file)
            raise FileNotFoundError(f"--placement {args.placement!r}: no placement file there (or use one of "
                                    f"{', '.join(known)})")
        raise GraphError(f"--placement {args.placement!r}: neither one of {', '.join(known)} nor a placement file")
    if args.restart is not None:
        restart_from_text(args.restart)
    if args.hosts is not None:  # (its mistakes at once, not after the app and torch are imported)
        from .launch._cluster import load_hosts_file

        load_hosts_file(args.hosts, read_keys=args.command == "run")  # (a submitted job's keys may be the daemon's)


def _check_job(args: argparse.Namespace) -> None:
    """What ``reactor submit`` checks before the job leaves. Always what needs nothing of the daemon's
    host: the files exist, the placement is a policy or a TOML file that parses (the hosts file too),
    the hosts its groups name are in its hosts, the app file compiles, ``--set`` parses, the restart
    policy and the mode agree, ``--hosts`` and ``--restart`` have a multi-process placement; and the ``--set``
    keys and values, as ``reactor k8s render`` and ``reactor slurm`` check them (:func:`_check_config_here`:
    an app that does not import here, or whose graph does not build here but for a ``--set`` value, is
    said and goes). With ``--check`` its graph is built here as ``reactor run`` would, whatever fails.

    Raises:
        (what ``reactor run`` raises for the same mistakes, before anything starts)
    """
    from .launch._placement import _read_toml, check_hosts_named
    from .launch._runtime import check_settings

    _check_run_options(args)
    overrides = parse_overrides(args.overrides)
    for what, path in (("placement file", args.placement if Path(args.placement).is_file() else None),
                       ("hosts file", args.hosts)):
        if path is not None:
            _read_toml(path, what)
    deterministic = not args.async_
    # (the settings' checks that need no graph: a restart policy the mode cannot hold, --hosts or --restart
    # with placement single)
    check_settings(None, placement=args.placement, deterministic=deterministic, restart=args.restart,
                   hosts=args.hosts)
    check_hosts_named(args.placement, args.hosts)
    with _app_code(args.app):
        compile(Path(args.app).read_bytes(), args.app, "exec")
    if not args.check:
        if overrides:  # (a bad one refused here, not in the job's log after its daemon started it)
            _check_config_here(args.app, overrides, args.overrides)
        return
    from .launch._groups import restart_from_text
    from .launch._placement import check_lookahead, resolve_placement

    with _app_code(args.app):
        graph = build_graph(args.app, overrides)
    graph.validate()
    check_settings(graph, placement=args.placement, deterministic=deterministic, restart=args.restart,
                   hosts=args.hosts)
    if args.placement != "single":
        plan = resolve_placement(graph, args.placement, args.hosts,
                                 restart_from_text(args.restart) if args.restart is not None else None)
        if deterministic:
            check_lookahead(graph, plan.groups, args.placement)


def _cluster_run_args(args: argparse.Namespace) -> list[str]:
    """The ``reactor run`` options of a job a cluster engine starts (slurm, k8s), checked here."""
    from .launch._groups import restart_from_text
    from .launch._policies import POLICIES

    if args.placement not in POLICIES:
        raise ValueError(f"--placement {args.placement!r}: a {args.command} job spreads its groups over its daemons "
                         f"with a distribution policy ({', '.join(sorted(POLICIES))})")
    if args.restart:
        restart_from_text(args.restart)
        from .launch._runtime import restart_refusal

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
        if not Path(f).is_file():
            raise FileNotFoundError(f"--with {f}: no such file")
        run_args += ["--with", str(Path(f).resolve())]
    if not Path(args.app).is_file():
        raise FileNotFoundError(f"no app file {args.app}")
    with _app_code(args.app):  # (as submit: not imported, its modules may be the cluster's only; a file that is
        compile(Path(args.app).read_bytes(), args.app, "exec")  # not Python failed there, after the allocation)
    if overrides:
        _check_config_here(args.app, overrides, args.overrides)
    return run_args


def _check_config_here(app: str, overrides: dict[str, Any], items: Sequence[str]) -> None:
    """A job's ``--set`` keys and values (``items``, as given; ``overrides``, parsed), checked as ``reactor
    run`` checks them, before the job is made (``reactor submit``, ``k8s render``, ``slurm``): a key the app's
    Config and its algorithm lack, a value of the wrong type (``make_config``), and a value its graph refuses
    (``--set producers=0``: replicas must be an int >= 1), which failed only in the job, after the daemons
    were up. That needs the app imported and its graph built here. An app that does not import here (a
    module only the cluster's image has) is said, and its run checks them there; so is a graph that does
    not build here for another reason than a ``--set`` value (what the refusal blames, :func:`blamed_setting`,
    as ``reactor run`` says it): a file or a device only the job's host has, say. A refusal about a file
    (``OSError``) is never a ``--set`` value's here: the file may be the job's host's.

    Raises:
        AppError: a key or value ``make_config`` refuses.
        GraphError, ValueError: the graph refuses a ``--set`` value (reactor's refusal, blamed on it).
    """
    from ._errors import refusal_class
    from ._graph import Graph
    from .launch._app import load_app, make_config

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


def _slurm(args: argparse.Namespace) -> int:
    """reactor slurm: submit the job (or, --here, run it inside the allocation)."""
    from .launch._slurm import here, submit

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


if __name__ == "__main__":  # pragma: no cover
    entry()
