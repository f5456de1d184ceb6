"""Runs over several hosts: DQN env steps/s over three hosts against one, and the time to detect a killed worker and a lost host.

Run (as root, for the network namespaces): ``python benchmarks/bench_cluster.py [--steps 5000] [--reps 2] [--seed 0] [--solve] [--no-ray]``

The three "hosts" are network namespaces on this machine (``tests/launch/hosts.py``: a veth pair per
host on one bridge, a ``reactor daemon`` in each, one cluster key directory, CURVE on every link).
They share this machine's cores, so the cross-host figure measures what the hosts protocol costs
(tcp + CURVE instead of ipc and shared memory, the daemons, the heartbeats), not added capacity.
Without root or ``ip`` the Cluster falls back to three daemons on loopback (a warning says so) and
the lost-host case is skipped.

- ``throughput``: ``apps/dqn.py`` under ``placement="actors"`` (learner + evaluator +
  metrics, 2 actor processes, 2 replay shards), deterministic mode, one seed, a step budget
  (``max_env_steps``, ``target_return=None``: the same run to the same end in both cases, learning
  on), once over the three hosts (``hosts=`` a hosts file: learner and replay-0 on h1, actor-0 and
  replay-1 on h2, actor-1 on h3; the coordinator in this process) and once on this host (no hosts
  file: ipc and shared memory). Repetitions alternate the two; medians are printed. The figure is
  ``env_steps / wall_s`` of the run's ``summary.json`` (the Metrics node's clock: from its startup,
  after every process is spawned and connected, to the end of the run, the learner's drain
  included); also printed: the slope of the actors' ``env_steps`` reports in ``metrics.csv`` (first
  to last report), the whole ``run()`` call (spawn and teardown included), and every worker's CPU
  time (``RunResult.processes``), which shows where the time goes. Both runs of a repetition must end
  with the same weights hash (printed). Target of the issue: hosts >= 0.8x one host.
- ``kill``: an async DQN run over the hosts with an unreachable step budget, in a thread; once its 5
  workers are up and it has trained ``--settle-s`` seconds, ``kill -9`` of actor-1's process (on
  h3); the figure is the time from the kill to ``run()`` raising ``WorkerFailedError`` (the other
  workers ended by then). Peer: Ray (below), ``kill -9`` of a CartPole actor's worker process with a
  call pending, to the driver's ``ray.get`` raising ``ActorDiedError``; Ray has one actor to report,
  ours tears four more workers down over three daemons before it raises.
- ``lost host``: the same run, then h3 unplugged (its veth down: daemon and worker run on,
  unreachable); the time from the cut to ``run()`` raising, beside the heartbeat timeout (the
  default, 3.0 s, unless ``--heartbeat-timeout-s``), and to the coordinator's ``host h3 is lost``
  warning. The timeout counts from the daemon's last answer (heartbeats every 0.5 s, each waiting
  up to 1 s), which comes before the cut, so the host can be declared lost less than the timeout
  after the cut. Peer: Ray with a node in each namespace (``ray start --head`` on h1, ``ray start
  --address`` on h2 and h3, the driver on h1), an actor on h3, the same link of h3 set down (from its
  namespace's side): the time to the driver's ``ray.get`` raising, under Ray's default node health
  checks (5 misses, 3 s apart, 10 s timeout each: about a minute).
- ``restart``: an async DQN run over the hosts with ``restart = "on-failure"`` (``--backoff-s``,
  default 0.5 s) from a placement file (learner and replay-0 on h1, replay-1 and actor-0 on h2,
  actor-1 on h3 with h2 as its second candidate), ``stop_s`` a fixed time after its start. First
  ``kill -9`` of replay-0's process: the time from the kill to the coordinator's "starting it again"
  warning (detected), and to its "is running again" (the new life restored from the shard's
  checkpoint, every other worker linked to it, ``start`` sent: the learner samples from it from its
  next request on). Then h3 unplugged: the same two times for actor-1, which comes back on h2. The
  lives are forked from the daemons' fork servers. Peer: Ray, a replay-shard actor with
  ``max_restarts=1, max_task_retries=0`` that rewrites a checkpoint file after every insert and loads
  it in ``__init__`` (how Ray users keep an actor's state over a restart), ``kill -9`` while the driver
  samples from it: the time to a sample call raising and to one succeeding on the new life (its ring
  read back from the file; ours also links the new life to its peers and the learner). For the cut:
  Ray's actor with ``max_restarts=1`` and a soft affinity to h3 in the lost-host peer (run once,
  there or here): the time until a call succeeds on another node.
- ``startup``: from ``run()``'s call to every worker ready and sent ``start`` (the coordinator's
  "run started" log line; the first env step follows within one actor step), for the DQN app under
  ``actors`` over the three hosts (workers spawned by the daemons) and on one host (local child
  processes), alternating, ``--reps`` each; the issue's target for submit to the first env step is
  2 s with the daemons up. Peer: Ray, five actors (one per worker group: a learner with torch, two
  numpy replay shards, two CartPole actors with torch and gymnasium, each building its nets, ring or
  envs) from the driver's calls until each has answered a first call, with Ray up (a second set,
  after a first set made right after ``ray.init``); ``ray.init`` itself, which a Ray user pays once
  per cluster, and the first set are printed too. Both our figures (daemons up; one host, its fork
  server started by the run) are put beside the "Ray up" one.
- ``startup`` also measures ``reactor submit`` of the same job over the hosts to h1's daemon, as a
  client sees it: from the request to the job's log saying "run started" (``logs`` polled every
  20 ms), with the daemons' fork servers (workers and the job's coordinator forked from a process
  that has imported torch) and, after the daemons are started again with ``--no-fork-server``,
  without (every process a new interpreter): the issue's figure, target 2 s.
- ``--solve``: also the wall clock to the first greedy evaluation >= 475 in async mode, over the
  hosts and on one host (one seed each; summary.json's evaluations; ``--solve-budget-s`` each).

The Ray peer is ``benchmarks/peers/ray_peer.py`` (its docstring says how each case is measured), run
in a child process per section, in the same run, after ours (``--reps`` repetitions for startup, one
for the others); without Ray, or with ``--no-ray``, each row says "no peer" and why in one line. The
peer and every Ray process it started (each carries a mark in its environment) are gone when it
returns, also on an error or Ctrl-C; any left would be killed and named.

The runs' own log lines (this process's coordinators, the local runs' workers and fork server, the
one-host runs' result lines, which their Metrics node prints on its stdout, the Ray peer's progress and
Ray's output) go to a log file, ``--log`` or a new one in the temporary directory, whose path is printed
first; only the figures are printed. If the benchmark fails, the
log's last lines and the error are printed on stderr.

Everything is torn down at the end, also on an error or Ctrl-C: daemons stopped, processes left in
the namespaces killed, namespaces and bridge deleted (``ip netns list`` shows none of ours).
torch is pinned to one thread in every process.
"""

# ruff: noqa: E402  (thread counts are pinned in the environment before torch is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import csv
import json
import logging
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import interruptible, names_of, output_to, positive_float, positive_int, stop_process
from benchmarks.peers import ray_peer
from reactor import run
from reactor.launch._app import build_graph
from reactor.launch._coordinator import WorkerFailedError
from tests.launch.hosts import Cluster
from tests.launch.hosts import in_thread as _in_thread
from tests.launch.hosts import wait_for as _wait_for

DQN = str(ROOT / "apps" / "dqn.py")
SECTIONS = ("throughput", "kill", "cut", "restart", "startup")
DEFAULT_HEARTBEAT_S = 3.0  # reactor.launch._placement's default heartbeat_timeout_s
RAY_PEER = ROOT / "benchmarks" / "peers" / "ray_peer.py"
RAY_TIMEOUT_S = 900
RAY_HEALTH = "Ray's node health checks: 5 misses, 3 s apart, 10 s timeout each"  # Ray 2.x defaults


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------ throughput


def throughput_run(run_dir: Path, steps: int, seed: int, hosts: str | None) -> dict[str, Any]:
    """One deterministic DQN run to a step budget; its figures from summary.json and metrics.csv."""
    cfg = {"max_env_steps": steps, "target_return": None, "live": False, "run_dir": str(run_dir)}
    t0 = time.monotonic()
    r = run(build_graph(DQN, cfg), app=DQN, config=cfg, placement="actors", deterministic=True, seed=seed, hosts=hosts)
    call_s = time.monotonic() - t0
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.csv", newline="") as f:
        points = [(float(x["wall_s"]), float(x["env_steps"])) for x in csv.DictReader(f) if x["name"] == "env_steps"]
    slope = float("nan")
    if len(points) >= 2 and points[-1][0] > points[0][0]:
        slope = (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
    return {
        "env_steps": summary["env_steps"], "updates": summary["updates"], "wall_s": summary["wall_s"],
        "startup_s": summary["startup_s"], "rate": summary["env_steps"] / summary["wall_s"], "slope": slope,
        "call_s": call_s, "stopped_by": r.stopped_by, "hosts": dict(r.hosts),
        "cpu_ms": {p: s.get("cpu_ms", 0) for p, s in r.processes.items()},
        "dropped": sum(r.dropped.values()), "weights": (run_dir / "weights.sha256").read_text().strip(),
    }


# ------------------------------------------------------------------------------ detection


def detection_run(cluster: Cluster, run_dir: Path, how: str, settle_s: float) -> dict[str, Any]:
    """An async DQN run over the hosts; kill -9 actor-1 (``how="kill"``) or unplug h3 (``"cut"``);
    the seconds from then until run() raises."""
    cfg = {"max_env_steps": 10**7, "target_return": None, "live": False, "run_dir": str(run_dir)}
    hosts = str(cluster.write_hosts())
    t, box = _in_thread(lambda: run(build_graph(DQN, cfg), app=DQN, config=cfg, placement="actors",
                                    deterministic=False, hosts=hosts))
    t_start = time.monotonic()
    pids = _wait_for(lambda: len(p := cluster.worker_pids()) == 5 and p, 120, "five workers on the hosts")
    up_s = time.monotonic() - t_start
    time.sleep(settle_s)  # training
    if "error" in box or "result" in box:
        raise RuntimeError(f"the run ended before the {how}: {box}")
    lost = _Timeline()
    logging.getLogger("reactor").addHandler(lost)
    try:
        if how == "kill":
            (victim,) = [pid for pid, g in pids.items() if g == "actor-1"]
            os.kill(victim, signal.SIGKILL)
        else:
            cluster.cut("h3")
        at = time.monotonic()
        t.join(120)
    finally:
        logging.getLogger("reactor").removeHandler(lost)
    if t.is_alive():
        raise RuntimeError(f"run() did not end within 120 s of the {how}")
    err = box.get("error")
    return {"s": box["ended_at"] - at, "up_s": up_s, "error_type": type(err).__name__,
            "lost_s": next((t - at for t, m in lost.records if "is lost" in m), None),
            "error": str(err).splitlines()[0] if err else repr(box.get("result")),
            "ok": isinstance(err, WorkerFailedError)}


class _Timeline(logging.Handler):
    """The coordinator's warnings under ``reactor`` in this process, timed (for the ``host ... is lost`` one)."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record.getMessage()))


# ------------------------------------------------------------------------------ time to 475 (optional)


def startup_run(run_dir: Path, hosts: str | None) -> float:
    """Seconds from run()'s call to the coordinator's "run started" (every worker ready)."""
    cfg = {"max_env_steps": 400, "target_return": None, "live": False, "run_dir": str(run_dir)}
    timeline = _Timeline(logging.INFO)
    logger = logging.getLogger("reactor")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(timeline)
    try:
        t0 = time.monotonic()
        run(build_graph(DQN, cfg), app=DQN, config=cfg, placement="actors", deterministic=False, hosts=hosts)
    finally:
        logger.removeHandler(timeline)
        logger.setLevel(old)
    return next(t - t0 for t, m in timeline.records if m.startswith("run started"))


def submit_run(cluster: Cluster, hosts: str) -> dict[str, float]:
    """``reactor submit`` of the DQN app over the three hosts to h1's daemon, as a client does it:
    seconds from the request to the job's log saying "run started" (every worker ready and sent
    ``start``; the actors' first env step follows at once), polled every 20 ms; and the
    coordinator's own figure from its start."""
    from reactor.launch._daemon import DaemonClient, job_spec
    from reactor.launch._keys import load_keys

    cfg = {"max_env_steps": 400, "target_return": None, "live": False}
    spec = job_spec(DQN, placement="actors", hosts=hosts, config=cfg, async_=True)
    keys = load_keys(cluster.keys)
    with DaemonClient(cluster.addresses["h1"], keys.public, keys) as c:
        t0 = time.monotonic()
        job = c.request("submit", spec)
        text, offset = b"", 0
        while b"run started" not in text:
            got = c.request("logs", job, offset)
            text, offset = text + got["data"], got["offset"]
            if got["done"] and b"run started" not in text:
                raise RuntimeError(f"job {job} ended before its run started: {text[-2000:].decode(errors='replace')}")
            time.sleep(0.02)
        seen = time.monotonic() - t0
        _wait_for(lambda: c.request("status", job)["state"] != "running", 120, f"job {job} to end")
    line = next(x for x in text.decode().splitlines() if "run started" in x)
    return {"submit_s": seen, "coordinator_s": float(line.split(" ready ")[1].split(" s ")[0])}


def restart_run(cluster: Cluster, tmp: Path, settle_s: float, backoff_s: float) -> dict[str, Any]:
    """An async DQN run over the hosts with restart on-failure: kill -9 replay-0, later unplug h3;
    the seconds from each to the coordinator's warnings that the group is being started again and
    that it runs again."""
    placement = tmp / "restart.toml"
    placement.write_text(cluster.hosts_toml() + f'[restart]\nrestart = "on-failure"\nbackoff_s = {backoff_s}\n'
                         '[groups.learner]\nreactors = ["learner", "evaluator", "metrics"]\nhost = "h1"\n'
                         '[groups.replay-0]\nreactors = ["replay[[]0]"]\nhost = "h1"\n'
                         '[groups.replay-1]\nreactors = ["replay[[]1]"]\nhost = "h2"\n'
                         '[groups.actor-0]\nreactors = ["actor[[]0]"]\nhost = "h2"\n'
                         '[groups.actor-1]\nreactors = ["actor[[]1]"]\nhost = ["h3", "h2"]\n')
    run_dir = tmp / "restart"
    cfg = {"max_env_steps": 10**7, "target_return": None, "live": False, "run_dir": str(run_dir),
           "replay_async_checkpoint_period_s": 0.05}  # (wall-clock seconds: an async run)
    timeline = _Timeline()
    logging.getLogger("reactor").addHandler(timeline)
    stop_s = 2 * settle_s + 90
    t, box = _in_thread(lambda: run(build_graph(DQN, cfg), app=DQN, config=cfg, placement=str(placement),
                                    deterministic=False, stop_s=stop_s))
    out: dict[str, Any] = {"backoff_s": backoff_s}
    try:
        pids = _wait_for(lambda: len(p := cluster.worker_pids()) == 5 and p, 120, "five workers on the hosts")
        _wait_for(lambda: (run_dir / "metrics.csv").exists(), 120, "training to start")
        for what, group in (("kill", "replay-0"), ("cut", "actor-1")):
            time.sleep(settle_s)
            if "error" in box or "result" in box:
                raise RuntimeError(f"the run ended before the {what}: {box}")
            if what == "kill":
                (victim,) = [pid for pid, g in pids.items() if g == group]
                os.kill(victim, signal.SIGKILL)
            elif cluster.netns:
                cluster.cut("h3")
            else:
                break
            at = time.monotonic()

            def seen(text: str, group: str = group, at: float = at) -> float | None:
                return next((t - at for t, m in timeline.records if t >= at and f"'{group}'" in m and text in m), None)

            _wait_for(lambda: seen("is running again") is not None or "error" in box, 120, f"{group} to run again")
            out[what] = {"group": group, "detected_s": seen("starting it again"), "running_s": seen("is running again")}
    finally:
        t.join(stop_s + 60)
        logging.getLogger("reactor").removeHandler(timeline)
        if cluster.netns:
            cluster.plug("h3")
    if "error" in box:
        raise box["error"]
    out["restarts"] = dict(box["result"].restarts)
    out["hosts"] = dict(box["result"].hosts)
    return out


def solve_run(run_dir: Path, seed: int, hosts: str | None, budget_s: float) -> dict[str, Any]:
    """Async DQN to the app's target (475), stopped at ``budget_s`` (``stop_s``); the wall clock of the first
    evaluation reaching it (None: not reached)."""
    cfg = {"max_env_steps": 10**7, "target_return": 475.0, "live": False, "run_dir": str(run_dir)}
    t, box = _in_thread(lambda: run(build_graph(DQN, cfg), app=DQN, config=cfg, placement="actors",
                                    deterministic=False, seed=seed, hosts=hosts, stop_s=budget_s))
    t.join(budget_s + 60)
    if t.is_alive():
        raise RuntimeError(f"run() did not end within {budget_s + 60:.0f} s")
    if "error" in box:
        raise box["error"]
    summary = json.loads((run_dir / "summary.json").read_text())
    hit = next((e for e in summary["evaluations"] if e["eval_return"] >= 475.0), None)
    return {"wall_s": hit and hit["wall_s"], "env_steps": hit and hit["env_steps"], "total_wall_s": summary["wall_s"]}


# ------------------------------------------------------------------------------ Ray, the peer


def ray_figures(only: str, reps: int, settle_s: float, netns: str | None = None,
                extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """Ray meeting the same event: ``benchmarks/peers/ray_peer.py --only ONLY`` in a child process (in
    the namespace ``netns`` when given), its output on this process's stderr (the runs' log). Returns its
    medians for ``only``, or ``{"no_peer": why}`` with the reason printed in one line. The child and every
    process Ray started for it are gone on return, also after an error or Ctrl-C (each carries a mark in
    its environment: what is left with it is killed, and said)."""
    mark = secrets.token_hex(8)
    cmd = [sys.executable, str(RAY_PEER), "--only", only, "--reps", str(reps), "--settle-s", f"{settle_s:g}", *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, ray_peer.MARK: mark, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, start_new_session=True)
    why, got = None, {}
    try:
        text, _ = proc.communicate(timeout=RAY_TIMEOUT_S)
        lines = text.decode(errors="replace").splitlines()
        if proc.returncode != 0 or not lines:
            why = f"the Ray peer failed (exit {proc.returncode}; its output is in the runs' log)"
        else:
            got = json.loads(lines[-1])
            why = got.get("skipped")
    except subprocess.TimeoutExpired:
        why = f"the Ray peer gave no result within {RAY_TIMEOUT_S} s"
    finally:
        stop_process(proc, group=True)
        left = ray_peer.end_ours(mark, proc.pid)  # (its session: Ray's agents hide their environment)
        if left:
            print(f"  Ray peer: {len(left)} of its processes were left; killed: {left}", flush=True)
    if why is not None:
        print(f"  Ray peer skipped: {why}", flush=True)
        return {"no_peer": why}
    return {**got.get("median", {}).get(only, {}), "reps": got[only], "ray": got["ray"]}


# ------------------------------------------------------------------------------ report


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=positive_int, default=5000,
                    help="env-step budget of a throughput run (default 5000)")
    ap.add_argument("--reps", type=positive_int, default=2,
                    help="throughput and startup repetitions, alternating hosts / one host (medians; default 2)")
    ap.add_argument("--seed", type=int, default=0, help="the runs' seed (default 0)")
    ap.add_argument("--settle-s", type=positive_float, default=3.0,
                    help="training before the kill / the cut (default 3 s)")
    ap.add_argument("--heartbeat-timeout-s", type=positive_float, default=None,
                    help=f"the hosts file's [cluster] heartbeat_timeout_s (default: unset, i.e. {DEFAULT_HEARTBEAT_S})")
    ap.add_argument("--solve", action="store_true", help="also the wall clock to eval return 475 in async mode")
    ap.add_argument("--solve-budget-s", type=positive_float, default=90.0,
                    help="--solve: seconds each run may train (default 90)")
    ap.add_argument("--backoff-s", type=positive_float, default=0.5, help="restart: the groups' backoff_s (default 0.5)")
    ap.add_argument("--only", default=",".join(SECTIONS), type=names_of(SECTIONS),
                    help=f"comma-separated, from {','.join(SECTIONS)} (cut: the lost host; default: all)")
    ap.add_argument("--no-ray", action="store_true", help="measure no Ray peer beside the kill, lost host, restart "
                                                          "and startup figures")
    ap.add_argument("--log", default="", help="where the runs' own log lines go (default: a new "
                                              "bench-cluster-TIME.log in the temporary directory; printed)")
    ap.add_argument("--json", default="", help="also write every figure here")
    args = ap.parse_args()
    only = set(args.only)
    hb = args.heartbeat_timeout_s or DEFAULT_HEARTBEAT_S
    # A SIGTERM ends the benchmark through the finally below (the cluster torn down), like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)

    import torch

    import reactor

    load0 = os.getloadavg()
    t_all = time.monotonic()
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (1 thread), reactor {reactor.__version__}, "
          f"cpus={os.cpu_count()}, load average before {load0[0]:.1f}", flush=True)
    out: dict[str, Any] = {"args": vars(args), "ray": {}}
    log_path = Path(args.log or Path(tempfile.gettempdir()) / f"bench-cluster-{time.strftime('%Y%m%d-%H%M%S')}.log")
    print(f"the runs' own log lines (this process's coordinators, local workers, the Ray peer) go to: {log_path}", flush=True)
    with output_to(log_path):
        with tempfile.TemporaryDirectory(prefix="bench-cluster-") as tmp_s:
            tmp = Path(tmp_s)
            cluster = Cluster(tmp, heartbeat_timeout_s=args.heartbeat_timeout_s)

            def ray_for(section: str, reps: int = 1) -> dict[str, Any]:
                """Ray's figures for ``section`` (once a run: the cut's serve the lost host and the restart)."""
                if section not in out["ray"]:
                    if args.no_ray:
                        out["ray"][section] = {"no_peer": "--no-ray"}
                    elif section != "cut":
                        out["ray"][section] = ray_figures(section, reps, args.settle_s)
                    else:  # three Ray nodes in the hosts' namespaces, the driver on h1; the same link of h3 cut
                        nodes = ",".join(f"{h}={cluster.ns(h)}@{cluster.ips[h]}" for h in cluster.names)
                        link = f"{cluster.ns('h3')}:rx{cluster.tag}p{cluster.names.index('h3') + 1}"  # (hosts.py's)
                        out["ray"][section] = ray_figures(section, reps, args.settle_s, netns=cluster.ns("h1"),
                                                          extra=("--nodes", nodes, "--cut", link))
                return out["ray"][section]  # type: ignore[no-any-return]

            try:
                os.environ["REACTOR_KEYS"] = str(cluster.keys)
                kind = "network namespaces" if cluster.netns else "loopback daemons (no namespaces)"
                print(f"cluster: {len(cluster.names)} hosts as {kind}: "
                      + ", ".join(f"{h} {a}" for h, a in cluster.addresses.items()), flush=True)
                hosts = str(cluster.write_hosts())
                if "throughput" in only:
                    reps: dict[str, list[dict[str, Any]]] = {"hosts": [], "one host": []}
                    print(f"\nthroughput: {DQN} --placement actors, deterministic, seed {args.seed}, "
                          f"max_env_steps {args.steps}, target_return None", flush=True)
                    for i in range(args.reps):
                        order = ("hosts", "one host") if i % 2 == 0 else ("one host", "hosts")
                        for side in order:
                            r = throughput_run(tmp / f"tp-{side.replace(' ', '')}-{i}", args.steps, args.seed,
                                               hosts if side == "hosts" else None)
                            reps[side].append(r)
                            cpu = ", ".join(f"{p} {ms / 1000:.1f}" for p, ms in sorted(r["cpu_ms"].items()))
                            print(f"  rep {i + 1} {side:8s}: {r['rate']:7,.0f} env steps/s ({r['env_steps']} steps, "
                                  f"{r['updates']} updates in {r['wall_s']:.1f} s; csv slope {r['slope']:,.0f}/s; "
                                  f"run() {r['call_s']:.1f} s, startup {r['startup_s']:.1f} s; {r['stopped_by']}, "
                                  f"dropped {r['dropped']}); CPU s: {cpu}", flush=True)
                        a, b = reps["hosts"][-1], reps["one host"][-1]
                        print(f"    same weights: {'yes' if a['weights'] == b['weights'] else 'NO'}; hosts "
                              f"{json.dumps(a['hosts'])}", flush=True)
                    out["throughput"] = reps
                if "kill" in only:
                    print(f"\nkill: async DQN over the hosts, kill -9 of actor-1 (h3) after {args.settle_s:g} s of training",
                          flush=True)
                    r = detection_run(cluster, tmp / "kill", "kill", args.settle_s)
                    print(f"  kill -> run() raised: {r['s']:.2f} s (5 worker processes seen {r['up_s']:.1f} s after run() began); "
                          f"{r['error_type']}: {r['error']}", flush=True)
                    cluster.wait_no_workers()
                    out["kill"] = r
                    if "s" in (p := ray_for("kill")):
                        print(f"  Ray: kill -9 of an actor's worker (CartPole) -> the driver's ray.get raised: "
                              f"{p['s']:.2f} s ({p['reps'][0]['error_type']}; Ray {p['ray']})", flush=True)
                if "cut" in only:
                    if not cluster.netns:
                        print("\nlost host: skipped (unplugging a host needs network namespaces)")
                    else:
                        print(f"\nlost host: async DQN over the hosts, h3 unplugged after {args.settle_s:g} s of training; "
                              f"heartbeat timeout {hb:g} s", flush=True)
                        r = detection_run(cluster, tmp / "cut", "cut", args.settle_s)
                        lost = "-" if r["lost_s"] is None else f"{r['lost_s']:.2f} s"
                        print(f"  cut -> host declared lost (the coordinator's warning): {lost}; -> run() raised: "
                              f"{r['s']:.2f} s (5 worker processes seen {r['up_s']:.1f} s after run() began); "
                              f"{r['error_type']}: {r['error']}", flush=True)
                        out["cut"] = r
                        # h3's daemon ends its orphaned worker when the coordinator's lease runs out.
                        t0 = time.monotonic()
                        try:
                            _wait_for(lambda: not cluster.worker_pids("h3"), 30, "h3's daemon to end its orphan")
                            print(f"  h3's daemon ended its orphaned worker {time.monotonic() - t0:.1f} s after run() "
                                  f"raised", flush=True)
                        except AssertionError as e:
                            print(f"  {e}", flush=True)
                        cluster.plug("h3")
                        if "plain_s" in (p := ray_for("cut")):
                            print(f"  Ray (a node in each namespace, the driver on h1): h3 cut -> an actor's pending "
                                  f"ray.get raised after {p['plain_s']:.2f} s ({RAY_HEALTH})", flush=True)
                if "startup" in only:
                    print("\nstartup: run() -> every worker ready (DQN under actors, async)", flush=True)
                    ups: dict[str, list[float]] = {"hosts": [], "one host": []}
                    for i in range(args.reps):
                        for side in (("hosts", "one host") if i % 2 == 0 else ("one host", "hosts")):
                            ups[side].append(startup_run(tmp / f"up-{side.replace(' ', '')}-{i}",
                                                         hosts if side == "hosts" else None))
                            print(f"  rep {i + 1} {side:8s}: {ups[side][-1]:.2f} s", flush=True)
                    cluster.wait_no_workers()
                    out["startup"] = ups
                    if "up_s" in (p := ray_for("startup", args.reps)):
                        print(f"  Ray, {len(ray_peer.ROLES)} actors (one per worker group) -> each answered a first "
                              f"call: {p['up_s']:.2f} s with Ray up, {p['first_s']:.2f} s right after ray.init, "
                              f"which took {p['init_s']:.2f} s (medians of {args.reps})", flush=True)
                    print("\nsubmit: reactor submit -> the job's run started (DQN under actors over the hosts, async)",
                          flush=True)
                    subs: dict[str, list[dict[str, float]]] = {"forked": [], "new interpreters": []}
                    for side in ("forked", "new interpreters"):
                        if side == "new interpreters":  # the same daemons started again without a fork server
                            cluster.fork_server = False
                            for h in cluster.names:
                                cluster.stop_daemon(h)
                                cluster.start_daemon(h)
                            hosts = str(cluster.write_hosts())
                        for i in range(args.reps):
                            subs[side].append(submit_run(cluster, hosts))
                            print(f"  rep {i + 1} {side:16s}: {subs[side][-1]['submit_s']:.2f} s (coordinator: "
                                  f"{subs[side][-1]['coordinator_s']:.2f} s)", flush=True)
                        cluster.wait_no_workers()
                    out["submit"] = subs
                    cluster.fork_server = True  # as they were, for what follows
                    for h in cluster.names:
                        cluster.stop_daemon(h)
                        cluster.start_daemon(h)
                    for h in cluster.names:
                        cluster.wait_fork_server(h)
                    hosts = str(cluster.write_hosts())
                if "restart" in only:
                    print(f"\nrestart: async DQN over the hosts, restart on-failure with backoff {args.backoff_s:g} s; "
                          f"kill -9 of replay-0 (h1), then h3 unplugged (actor-1 has h2 as its second candidate); "
                          f"heartbeat timeout {hb:g} s", flush=True)
                    r = restart_run(cluster, tmp, args.settle_s, args.backoff_s)
                    for what in ("kill", "cut"):
                        if what in r:
                            x = r[what]
                            print(f"  {what} of {x['group']}: detected after {x['detected_s']:.2f} s, running again "
                                  f"after {x['running_s']:.2f} s", flush=True)
                    print(f"  restarts {json.dumps(r['restarts'])}; hosts at the end {json.dumps(r['hosts'])}", flush=True)
                    cluster.wait_no_workers()
                    out["restart"] = r
                    if "running_s" in (p := ray_for("restart")):
                        det = ("no sample call raised (none was in flight)" if p.get("detected_s") is None
                               else f"a sample call raised after {p['detected_s']:.2f} s")
                        print(f"  Ray: kill -9 of a replay shard actor (max_restarts=1, its ring reloaded from a file "
                              f"in __init__): {det}, one succeeded after {p['running_s']:.2f} s", flush=True)
                    if cluster.netns and "again_running_s" in (p := ray_for("cut")):
                        print(f"  Ray: h3 cut -> an actor with max_restarts=1 answered on another node after "
                              f"{p['again_running_s']:.2f} s", flush=True)
                if args.solve:
                    print(f"\ntime to eval return 475: async, seed {args.seed}", flush=True)
                    out["solve"] = {}
                    for side in ("hosts", "one host"):
                        r = solve_run(tmp / f"solve-{side.replace(' ', '')}", args.seed,
                                      hosts if side == "hosts" else None, args.solve_budget_s)
                        out["solve"][side] = r
                        print(f"  {side:8s}: {r['wall_s'] if r['wall_s'] is None else round(r['wall_s'], 1)} s, "
                              f"{r['env_steps']} env steps", flush=True)
            finally:
                cluster.close()
    left = [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if ns.startswith(f"rx{cluster.tag}")]
    out["load_after"] = os.getloadavg()[0]
    out["total_s"] = time.monotonic() - t_all

    print(f"\nsummary (load average before {load0[0]:.1f}, after {out['load_after']:.1f}; {out['total_s']:.0f} s in all; "
          f"our namespaces left: {left or 'none'})")
    header = f"{'figure':<34} {'ours':>10} {'peer':>10} {'ours/peer':>9}  peer"
    print(header)
    print("-" * len(header))
    if "throughput" in out:
        tp = out["throughput"]
        h, o = med([r["rate"] for r in tp["hosts"]]), med([r["rate"] for r in tp["one host"]])
        hs, os_ = med([r["slope"] for r in tp["hosts"]]), med([r["slope"] for r in tp["one host"]])
        print(f"{'env steps/s, 3 hosts (summary)':<34} {h:>10,.0f} {o:>10,.0f} {h / o:>9.2f}  one host, same run")
        print(f"{'env steps/s, 3 hosts (csv slope)':<34} {hs:>10,.0f} {os_:>10,.0f} {hs / os_:>9.2f}  one host, same run")

    def vs_ray(label: str, ours: float, section: str, key: str, what: str) -> None:
        """Our figure beside Ray's ``key`` of ``section``, as a ratio; or "no peer" and why."""
        p = out["ray"].get(section, {})
        if p.get(key) is not None:
            print(f"{label:<34} {ours:>10.2f} {p[key]:>10.2f} {ours / p[key]:>9.2f}  Ray: {what}")
        else:
            why = p.get("no_peer") or f"Ray's run gave no {key}"
            print(f"{label:<34} {ours:>10.2f} {'-':>10} {'-':>9}  no peer: {why}")

    if "kill" in out:
        vs_ray("kill -9 -> run() raised, s", out["kill"]["s"], "kill", "s",
               f"kill -9 of an actor -> ray.get raised (our heartbeat timeout {hb:g} s)")
    if "cut" in out:
        vs_ray("host cut -> run() raised, s", out["cut"]["s"], "cut", "plain_s",
               f"node cut -> ray.get raised ({RAY_HEALTH}; our heartbeat timeout {hb:g} s)")
    if "startup" in out:
        a, b = med(out["startup"]["hosts"]), med(out["startup"]["one host"])
        print(f"{'run() -> workers ready, 3 hosts, s':<34} {a:>10.2f} {b:>10.2f} {a / b:>9.2f}  one host "
              f"(target 2 s: {'met' if a <= 2.0 else 'NOT met'})")
        vs_ray("run() -> workers ready, 3 hosts, s", a, "startup", "up_s",
               f"{len(ray_peer.ROLES)} actors answered, Ray up (ours: daemons up)")
        vs_ray("run() -> workers ready, 1 host, s", b, "startup", "up_s",
               f"{len(ray_peer.ROLES)} actors answered, Ray up (ours: its fork server started too)")
        if "init_s" in (p := out["ray"].get("startup", {})):
            print(f"{'  (ray.init, once per cluster, s)':<34} {'-':>10} {p['init_s']:>10.2f} {'-':>9}  "
                  f"Ray: actors right after it {p['first_s']:.2f} s")
    if "submit" in out:
        a = med([x["submit_s"] for x in out["submit"]["forked"]])
        b = med([x["submit_s"] for x in out["submit"]["new interpreters"]])
        print(f"{'submit -> run started, 3 hosts, s':<34} {a:>10.2f} {b:>10.2f} {a / b:>9.2f}  daemons without "
              f"a fork server (target 2 s: {'met' if a <= 2.0 else 'NOT met'})")
    if "kill" in out.get("restart", {}):
        x, p = out["restart"]["kill"], out["ray"].get("restart", {})
        det = "-" if p.get("detected_s") is None else f"{p['detected_s']:.2f}"
        vs_ray("shard kill -> running again, s", x["running_s"], "restart", "running_s",
               f"max_restarts=1 shard answered (detected: ours {x['detected_s']:.2f} s, Ray {det} s; our backoff "
               f"{args.backoff_s:g} s)")
    if "cut" in out.get("restart", {}):
        x = out["restart"]["cut"]
        vs_ray("host cut -> actor running on h2, s", x["running_s"], "cut", "again_running_s",
               f"max_restarts=1 actor answered on another node (detected: ours {x['detected_s']:.2f} s)")
    if "solve" in out and all(r["wall_s"] for r in out["solve"].values()):
        a, b = out["solve"]["hosts"]["wall_s"], out["solve"]["one host"]["wall_s"]
        print(f"{'s to eval 475 (async), 3 hosts':<34} {a:>10.1f} {b:>10.1f} {a / b:>9.2f}  one host")
    if "throughput" in out:
        print(f"target: 3 hosts >= 0.8x one host: {h / o:.2f}x -> {'met' if h / o >= 0.8 else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    interruptible(main, "bench_cluster.py")
