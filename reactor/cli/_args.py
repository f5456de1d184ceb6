"""The ``reactor`` command's arguments: its parser (every command's options and help text), and the
types that check an argument as it is parsed (a mistake is one line naming what was expected)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


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
    r.add_argument("--keys", default=None, metavar="DIR", type=_path_arg,
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
    ts = tsub.add_parser("show", help="summarize a trace",
                         description="Print a recorded schedule's events, reactor by reactor.")
    ts.add_argument("trace", help="a trace file (reactor run --async --record)")
    ts.add_argument("--limit", type=_count_arg, default=20, help="events listed per reactor (default 20)")
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
    ev.add_argument("--episodes", type=_episodes_arg, default=10, help="episodes to play (default 10, at most 1,000,000)")
    ev.add_argument("--seed", type=_seed_arg, default=0, help="the episodes' env seed (default 0)")
    ev.add_argument("--video", default=None, metavar="DIR",
                    help="record each episode as an MP4 in DIR (gymnasium's RecordVideo; pip install -e '.[video]' in "
                         "reactor's checkout)")
    ev.add_argument("--json", action="store_true", help="print the result as JSON")

    k = sub.add_parser("keys", help="CURVE keys for daemons and clients",
                       description="Make the CURVE keys that daemons and their clients authenticate each other with.")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    ki = ksub.add_parser("init", help="make a key directory: key, key.pub, authorized/",
                         description="Make a key directory: a key pair (key, key.pub) and authorized/, where the "
                                     "key.pub files of the clients and daemons it accepts go.")
    ki.add_argument("dir", nargs="?", default=None, type=_path_arg, help="default: $REACTOR_KEYS or ~/.reactor/keys")

    d = sub.add_parser("daemon", help="host jobs on this machine", description="A long-lived daemon hosting jobs.")
    d.add_argument("--listen", required=True, type=_listen_address, help="tcp://ADDR:PORT (PORT * for any)")
    d.add_argument("--name", required=True, type=_daemon_name, help="this daemon's name (a host name in placements)")
    d.add_argument("--state-dir", required=True, type=_path_arg, help="where it keeps its jobs, their logs and its own log")
    d.add_argument("--keys", default=None, type=_path_arg, help="its key directory (default: $REACTOR_KEYS or ~/.reactor/keys)")
    d.add_argument("--advertise", default=None,
                   help="the address other hosts reach this one at (needed when --listen is a wildcard)")
    d.add_argument("--preload", default="",
                   help="more modules its fork server imports once for every worker (comma-separated: "
                        "your environments' packages, say)")
    d.add_argument("--no-fork-server", action="store_true",
                   help="start every worker as a new interpreter (each imports torch anew: seconds more per start)")
    d.add_argument("--worker-memory-mb", type=_count_arg, default=None, metavar="MB",
                   help="start a run's worker only while this host has at least MB MiB of memory available, and "
                        "refuse a run that puts more workers here than that many MiB each fit in (default: 64, "
                        "the least a worker takes; raise it to what your workers take; 0: no check)")
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
        parser.add_argument("--keys", default=None, type=_path_arg, help="your key directory (default: $REACTOR_KEYS or ~/.reactor/keys)")
        parser.add_argument("--timeout-s", type=_answer_seconds, default=10.0, help="how long to wait for each answer (default 10)")

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
    sl.add_argument("--out", default=None, metavar="DIR", type=_path_arg,
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

    k8 = sub.add_parser("k8s", help="Kubernetes manifests: a StatefulSet of daemons and a Job running the app",
                        description="Kubernetes manifests that run an app over a StatefulSet of reactor daemons.")
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
    st = sub.add_parser("status", help="a daemon's jobs, or one job",
                        description="Print a line for each of a daemon's jobs (and each run it hosts workers of), or "
                                    "one job's line with its groups and workers.")
    st.add_argument("job", nargs="?", default=None, type=_job_arg,
                    help="a job id (what submit printed): the job and its groups; none: a line for each of the "
                         "daemon's jobs and each run it hosts workers of")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    client(st)
    lg = sub.add_parser("logs", help="a job's output, or one of its groups' on another host",
                        description="Print a job's output (its run's lines), or the output of one of its groups' "
                                    "workers from the daemon of that group's host.")
    lg.add_argument("job", type=_job_arg, help="a job id (what submit printed)")
    lg.add_argument("group", nargs="?", default=None,
                    help="a group of a job over hosts: its worker's output, from the daemon of its host")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    client(lg)
    sp = sub.add_parser("stop", help="stop a job (SIGTERM to its run, SIGKILL after a grace period)",
                        description="Ask a daemon to stop a job: its run stops its workers cleanly (their final "
                                    "checkpoints, the summary); a run that has not ended after a grace period is "
                                    "ended at once.")
    sp.add_argument("job", type=_job_arg, help="a job id (what submit printed)")
    client(sp)
    return p


def _daemon_address(text: str) -> str:
    """``--daemon``: a tcp://HOST:PORT zmq can connect to (else zmq's own error, as a traceback)."""
    from ..launch._protocol import tcp_address_error

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


def _daemon_name(text: str) -> str:
    """``daemon --name``: what hosts files and placements call it (their host names' pattern). A name past
    it (``"node 3"``) was taken, and no hosts file could name the daemon: every run that reached it by
    address warned that it "answers under another --name"."""
    from ..launch._cluster import _HOST_RE

    if not _HOST_RE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r:.200}: a daemon's name is what hosts files call it: "
                                          f"{_HOST_RE.pattern.strip('^').removesuffix(chr(92) + 'Z')}")
    return text


def _job_arg(text: str) -> str:
    """A job id: the 16 hex digits ``reactor submit`` printed (the daemon's check, said for a user)."""
    from ..launch._protocol import _JOB_RE

    if not _JOB_RE.match(text):
        raise argparse.ArgumentTypeError(f"{text!r:.200} is not a job id: a job id is the 16 hex digits `reactor "
                                          f"submit` printed (`reactor status` lists the daemon's jobs)")
    return text


def _parsed_arg(text: str, convert: Callable[[str], Any], what: str) -> Any:
    """``convert(text)``, or the argument error naming ``what`` was expected."""
    try:
        return convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} expected, got {_cut(text)}") from None


def _cut(text: str) -> str:
    """An argument as its error shows it: its repr, cut in the middle past ~80 characters."""
    return repr(text) if len(text) <= 80 else f"{text[:40]!r}...{text[-30:]!r} ({len(text)} characters)"


def _path_arg(text: str) -> str:
    """A directory's path: not empty (``--state-dir ""`` was the current directory, ``keys init ""`` and
    ``--keys ""`` the default key directory, each without a word) and without a NUL."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"a path expected, got {text!r:.60}")
    return text


def _count_arg(text: str) -> int:
    """``--keep-ended``, ``trace show --limit`` (-1 listed all but one, and said 231 more of 230): an int >= 0."""
    n = _parsed_arg(text, int, "a whole number")
    if n < 0:
        raise argparse.ArgumentTypeError(f"a number >= 0 expected, got {text!r}")
    return n


def _episodes_arg(text: str) -> int:
    """``eval --episodes``: an int in [1, MAX_EVAL_EPISODES] (10**20 was played for good)."""
    from ..nodes._policy import MAX_EVAL_EPISODES

    n = _parsed_arg(text.strip(), int, "a whole number") if len(text.strip()) <= 19 else None
    if n is None or not 1 <= n <= MAX_EVAL_EPISODES:
        raise argparse.ArgumentTypeError(f"a number of episodes in [1, {MAX_EVAL_EPISODES:,}] expected, got {_cut(text)}")
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
