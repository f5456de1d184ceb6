"""Distributed replay service benchmark: 4 Replay shards in 4 processes, sampled and filled by real reactors.

Run: ``nice -n 10 python benchmarks/bench_replay_service.py [--quick] [--reps 7] [--calls 20] [--inflight 4]``

One run of ``benchmarks/apps/replay_service.py`` under a placement of one process per reactor
instance (a placement file written by this script): 4 :class:`~reactor.nodes.Replay` shards
(``WindowRead(32)``, ``Prioritized(0.6)``, ``capacity / 4`` steps each), 4 actor-side writers
(:class:`~reactor.nodes.Writer`, 64 synthetic env streams each, one ``Steps`` message per flush)
and two learners: ``bench[0]`` (same host: it gathers the windows from the shards' shared memory)
and ``bench[1]``, a learner "on another host" (``ReplayClient(bulk=False)``, its process listening
on tcp: the shards read the windows and send them in their replies, as they do for any requester
whose host id differs from theirs). A step is obs float32[64] + action int64 + reward float32 +
terminated bool = 269 B; a batch is 256 windows of 32 steps plus the window mask = 2.21 MB.

Everything is measured from the requesting side, in one run, in repetitions that alternate
between the cases (medians printed), each next to its peer measured in the same repetitions:

- ``sample shm``: batches/s of ``ReplayClient.request(256)`` -> batch (exact two-stage sampling:
  4 mass requests, then 4 sample requests; the client gathers), with one batch in flight and with
  ``--inflight`` (a learner's ``prefetch``), against ``reactor.replay.Table.sample_nowait(256)`` on
  an in-process table of the same capacity, sampler and read (the issue's target: >= 50% of it);
  and GB/s against a single-core memcpy of the batch's bytes from a random place of a buffer as
  large as the stored data;
- ``sample tcp``: the same from ``bench[1]`` (the windows travel in the replies, over tcp);
- ``1-sided shm``: ``ReplayClient.sample_now`` (no message on the sampling path), one at a time and
  ``--inflight`` drawn ahead on the client's threads (``draw_ahead``), against the in-process table;
- ``1-sided tcp``: ``bench[1]``'s ``asample_now``: one request to each shard's bulk read server, which
  draws and replies with the rows; one at a time, and ``--inflight`` drawn ahead (``draw_ahead``: that
  many samples' requests out at once, each taken with ``await next_drawn()``). Its host id differs
  from the shards', but in a single-host run its read connections go over ipc (the servers bind
  beside their endpoints); with ``--hosts`` over tcp with CURVE. Printed also against raw pyzmq
  moving the same bytes from as many processes over that transport, with as many rounds in flight
  (``benchmarks/peers/raw_zmq_peer.py``: the floor any zmq design has here), and Reverb (drawn ahead:
  against its dataset with ``prefetch``);
- ``insert``: rounds of ``round_rows`` stored rows per writer (after a first fill of the whole
  capacity, reported apart: first touch of the shared memory), timed from the bench's ``go`` to
  the moment the shards' statistics count every item sent; steps/s (env steps appended by the
  actors) and GB/s (stored rows sent, 269 B each), against one in-process ``Writer`` feeding an
  in-process ``Table`` the same workload (no messages).

Also printed: per batch (one in flight), the time to the last stage-1 reply, to the last stage-2
reply and in assembly (the shm gather included), and the requester's CPU time and context switches;
and the insert rounds' CPU per env step by role (writers, shards, their zmq I/O threads apart; every
thread's ``/proc/.../schedstat``) against the in-process peer's, with the bound that puts on the
insert ratio when every core is busy.
Start-up of the 11 processes dominates the wall time of ``--quick``. torch and numpy are pinned to
one thread in every process.
"""

# ruff: noqa: E402  (thread counts are pinned in the environment before numpy is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, non_negative_int, positive_int
from reactor.launch._app import build_graph
from reactor.launch._runtime import run
from reactor.transport._shm import huge_pages_allowed

APP = str(Path(__file__).resolve().parent / "apps" / "replay_service.py")


@dataclass(frozen=True)
class Row:
    """One line of the table: our figure, the peer's, and ours/peer."""

    section: str
    case: str
    ours: float
    peer: float
    peer_name: str
    unit: str

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer else float("nan")


def placement_file(directory: str, shards: int, writers: int, hosts: dict[str, str] | None = None) -> str:
    """One process per reactor instance; bench[1]'s process listens on tcp (a learner on another
    host). With ``hosts`` (``--hosts``: h1, h2 daemons in network namespaces), bench[1] runs on h2
    and every other process on h1: bench[1]'s batches then cross from one host to another."""

    def pattern(node: str, i: int) -> str:
        return f"{node}[[]{i}]"  # fnmatch: "[[]" is a literal "["

    where = (lambda h: f'host = "{h}"\n') if hosts else (lambda h: "")
    lines = ['[groups.bench-0]\nreactors = ["' + pattern("bench", 0) + '"]\n' + where("h1"),
             '[groups.bench-1]\nreactors = ["' + pattern("bench", 1) + '"]\n'
             + (where("h2") if hosts else 'bind = "tcp://127.0.0.1:*"\n')]
    for node, n in (("replay", shards), ("writer", writers)):
        lines += [f'[groups.{node}-{i}]\nreactors = ["{pattern(node, i)}"]\n' + where("h1") for i in range(n)]
    if hosts:
        lines.insert(0, "[hosts]\n" + "".join(f'{h} = "{a}"\n' for h, a in hosts.items()))
    path = os.path.join(directory, "placement.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def run_once(config: dict, hosts: dict[str, str] | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-replay-service-") as tmp:
        os.chmod(tmp, 0o755)
        cfg = {**config, "report": os.path.join(tmp, "report.json")}
        limit_s = cfg.pop("limit_s")  # a bound on the run, in case something hangs
        placement = placement_file(tmp, cfg["shards"], cfg["writers"], hosts)
        t0, began = time.perf_counter(), time.time()
        result = run(build_graph(APP, cfg), placement=placement, app=APP, config=cfg, deterministic=False,
                     stop_s=limit_s)
        wall = time.perf_counter() - t0
        if not os.path.exists(cfg["report"]):
            raise SystemExit(f"the benchmark run ended ({result.stopped_by}) without a report; see the log above")
        with open(cfg["report"]) as f:
            rep = json.load(f)
    if "error" in rep:
        raise SystemExit(f"benchmark run failed: {rep['error']}")
    rep["run_wall_s"] = wall
    rep["startup_s"] = rep["began_at"] - began
    rep["shutdown_s"] = began + wall - rep["finished_at"]
    return rep


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def sample_cases(cfg: dict) -> list[tuple[str, str]]:
    """(report key, section label) of the sampling cases, in print order."""
    depths = sorted({1, cfg["inflight"]})
    return [("local", "1-sided shm")] + [(f"local_x{d}", "1-sided shm") for d in depths if d > 1] + [
        ("remote", "1-sided tcp")] + [(f"remote_x{d}", "1-sided tcp") for d in depths if d > 1] + [
        (name if d == 1 else f"{name}_x{d}", label)
        for name, label in (("shm", "sample shm"), ("msg", "sample tcp"), ("onesided", "1-sided zmq"))
        for d in depths]


def case_of(key: str, cfg: dict) -> str:
    depth = key.split("_x")[1] if "_x" in key else "1"
    return f"{depth} in flight"


def rows_of(rep: dict, cfg: dict) -> list[Row]:
    nbytes = rep["out_nbytes"]
    inproc, memcpy = med(rep["inproc"]), med(rep["memcpy"])
    out = []
    for key, label in sample_cases(cfg):
        s = med(rep[key])
        out.append(Row(label, case_of(key, cfg), 1 / s, 1 / inproc, "in-process Table.sample_nowait", "batch/s"))
        out.append(Row(label, case_of(key, cfg), nbytes / s / 1e9, nbytes / memcpy / 1e9, "memcpy 1 core, same bytes",
                       "GB/s"))
    for key, peer_key, label in (("insert", "local_insert", "insert"), ("insert_cold", "local_insert_cold", "first fill")):
        if not rep.get(key):
            continue
        ours, peer = rep[key], rep[peer_key]
        steps = med([r["appended"] / r["s"] for r in ours])
        peer_steps = med([r["appended"] / r["s"] for r in peer])
        gbs = med([r["rows"] * 269 / r["s"] / 1e9 for r in ours])
        peer_gbs = med([r["rows"] * 269 / r["s"] / 1e9 for r in peer])
        case = f"{cfg['writers']} writers"
        out.append(Row(label, case, steps, peer_steps, "in-process Writer -> Table", "step/s"))
        out.append(Row(label, case, gbs, peer_gbs, "in-process Writer -> Table", "GB/s"))
    return out


def print_table(rows: list[Row]) -> None:
    header = f"{'section':<12} {'case':<10} {'ours':>12} {'peer':>12} {'unit':<8} {'ours/peer':>9}  peer"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.section:<12} {r.case:<10} {r.ours:>12,.2f} {r.peer:>12,.2f} {r.unit:<8} {r.ratio:>9.2f}  {r.peer_name}")


# ---------------------------------------------------------------- Reverb peer (self-contained)
# DeepMind Reverb doing the same workload, run by benchmarks/peers/reverb_peer.py in Reverb's own venv
# (scripts/setup_reverb_peer.sh makes .venv-reverb: TensorFlow 2.15, numpy < 2), after our run, in a
# subprocess: its server in a process of its own on localhost gRPC, one TrajectoryWriter per env stream,
# sampled through reverb.TrajectoryDataset(...).batch(batch) (see the script's docstring).

REVERB_PY = Path(__file__).resolve().parents[1] / ".venv-reverb" / "bin" / "python"
REVERB_PEER = Path(__file__).resolve().parent / "peers" / "reverb_peer.py"


def reverb_figures(python: str, cfg: dict, quick: bool) -> dict | None:
    """Run the Reverb peer with our capacity, batch, window, writers and envs; its JSON, or None."""
    import subprocess

    if not Path(python).exists():
        print(f"Reverb peer skipped: no {python} (make it with: bash scripts/setup_reverb_peer.sh)")
        return None
    env = {k: v for k, v in os.environ.items()  # Reverb keeps its own thread counts (we pin ours)
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")}
    with tempfile.TemporaryDirectory(prefix="bench-replay-reverb-") as tmp:
        out = os.path.join(tmp, "reverb.json")
        cmd = [python, str(REVERB_PEER), "--json", out, "--capacity", str(cfg["capacity"]),
               "--batch", str(cfg["batch"]), "--window", str(cfg["window"]), "--writers", str(cfg["writers"]),
               "--envs", str(cfg["envs"]), "--reps", str(cfg["reps"]), "--calls", str(cfg["calls"])]
        print(f"Reverb peer: running {os.path.relpath(REVERB_PEER)} {' '.join(cmd[4:])} ...", flush=True)
        try:
            proc = subprocess.run(cmd + (["--quick"] if quick else []), env=env, capture_output=True, text=True,
                                  timeout=900)
        except subprocess.TimeoutExpired:
            print("Reverb peer: no result within 900 s; skipped")
            return None
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"Reverb peer failed (exit {proc.returncode}); its last output:\n{proc.stderr[-2000:]}")
            return None
        with open(out) as f:
            return json.load(f)


def reverb_rows(rep: dict, cfg: dict, peer: dict) -> list[Row]:
    """Ours / Reverb: sampling one batch in flight (1-sided: from the shards' published trees, on their host
    or through their read servers; shm: gathered after a message round; tcp: windows in the replies) against
    Reverb's TrajectoryDataset batches, and inserts (steps/s) against Reverb's TrajectoryWriters."""
    sample = peer["sample_dataset"]["batches_per_s"]
    out = [Row(label, case_of(key, cfg), 1 / med(rep[key]), sample, "reverb", "batch/s")
           for key, label in (("local", "1-sided shm"), ("remote", "1-sided tcp"), ("shm", "sample shm"),
                              ("msg", "sample tcp")) if rep.get(key)]
    x = cfg["inflight"]
    if rep.get(f"remote_x{x}") and peer.get("sample_dataset_prefetch"):  # ahead, against Reverb's prefetch
        out.append(Row("1-sided tcp", case_of(f"remote_x{x}", cfg), 1 / med(rep[f"remote_x{x}"]),
                       peer["sample_dataset_prefetch"]["batches_per_s"], "reverb, dataset.prefetch", "batch/s"))
    for key, peer_key, label in (("insert", "insert", "insert"), ("insert_cold", "insert_cold", "first fill")):
        if rep.get(key) and peer.get(peer_key):
            ours = med([r["appended"] / r["s"] for r in rep[key]])
            out.append(Row(label, f"{cfg['writers']} writers", ours, peer[peer_key]["steps_per_s"], "reverb", "step/s"))
    return out


def print_reverb(rep: dict, cfg: dict, python: str, quick: bool) -> None:
    if not python or python.lower() == "none":  # (--reverb "" or none: no Reverb rows)
        return
    peer = reverb_figures(python, cfg, quick)
    if peer is None:
        return
    v, c, t = peer["versions"], peer["config"], peer["table_after_fill"]
    fill, ins = peer["insert_cold"], peer.get("insert")
    print(f"Reverb peer: dm-reverb {v['dm-reverb']}, tensorflow {v['tensorflow']}, numpy {v['numpy']}; server in its "
          f"own process (localhost gRPC), table Prioritized(0.6)/Fifo/MinSize(1) of {t['max_size']} items "
          f"({c['window']}-step windows, one per step past an episode's first {c['window'] - 1}); "
          f"{c['writers']} writer processes x {c['envs']} TrajectoryWriters; medians of {c['reps']} reps x "
          f"{c['calls']} batches of {c['batch']}")
    print(f"  sample: TrajectoryDataset.batch {peer['sample_dataset']['batches_per_s']:.1f} batch/s, "
          f"+ prefetch {peer['sample_dataset_prefetch']['batches_per_s']:.1f} batch/s"
          + (f", Client.sample + np.stack {peer['sample_client_sample']['batches_per_s']:.1f} batch/s"
             if "sample_client_sample" in peer else "")
          + f"; insert: first fill {fill['steps_per_s']:,.0f} steps/s ({fill['steps']} steps, {fill['s']:.0f} s)"
          + (f", into the full table {ins['steps_per_s']:,.0f} steps/s ({ins['steps']} steps)" if ins else "")
          + f"; peer run {peer['wall_s']:.0f} s")
    print_table(reverb_rows(rep, cfg, peer))


# ---------------------------------------------------------------- end of the Reverb peer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 256K-step table and fewer repetitions (well under a minute)")
    ap.add_argument("--reps", type=positive_int, default=None, help="repetitions (median reported; default 7, quick 3)")
    ap.add_argument("--calls", type=positive_int, default=None,
                    help="batches per case per repetition (default 20, quick 10)")
    ap.add_argument("--shards", type=int, default=4, help="replay shards, one process each (>= 2; default 4)")
    ap.add_argument("--flush-steps", type=positive_int, default=1024,
                    help="rows per Steps message of each writer (Writer flush_steps; the in-process peer's too)")
    ap.add_argument("--writers", type=int, default=4, help="writer processes (>= 2; default 4)")
    ap.add_argument("--capacity", type=positive_int, default=None,
                    help="steps held over all shards, a multiple of --shards (default 1M, quick 256K)")
    ap.add_argument("--inflight", type=positive_int, default=4,
                    help="also measure with this many batches requested at once (a learner's prefetch); 1: only 1")
    ap.add_argument("--round-rows", type=non_negative_int, default=None,
                    help="rows per writer per insert repetition (default 64K, quick 16K; 0: no insert repetitions)")
    ap.add_argument("--notice-every", type=positive_int, default=64,
                    help="one-sided samples whose notices the clients send together (ReplayClient(notice_every=...))")
    ap.add_argument("--no-stage", action="store_true",
                    help="the writers send every row in their Steps messages (default: they stage rows in shared "
                         "memory for the shards of their host, reactor/nodes/_staging.py)")
    ap.add_argument("--ack-every", type=non_negative_int, default=0,
                    help="the writers ask a shard for an ack every this many messages (Writer(ack_every=...); "
                         "0: the writer's default, max_unacked // 2 = 4; 1: every message)")
    ap.add_argument("--json", default="", help="also write the raw report (every repetition) here")
    ap.add_argument("--hosts", action="store_true",
                    help="run over two hosts in network namespaces (as root): bench[1] on h2, the rest on h1, "
                         "so 'sample tcp' is a learner on another host sampling remote shards")
    ap.add_argument("--reverb", default=str(REVERB_PY),
                    help="python of a venv with dm-reverb, for the Reverb peer's rows (default .venv-reverb's; \"\" or none: skip)")
    args = ap.parse_args()
    if args.shards < 2 or args.writers < 2:
        ap.error("--shards and --writers must be >= 2 (the placement names replicas by index)")
    q = args.quick
    capacity = args.capacity or (1 << 18 if q else 1 << 20)
    batch_steps = 256 * 32  # a batch: 256 windows of 32 steps
    if capacity % args.shards or capacity <= batch_steps or capacity // args.shards < 2 * args.flush_steps:
        ap.error(f"--capacity {capacity}: must be a multiple of --shards ({args.shards}), more than a batch's "
                 f"{batch_steps} steps (the memcpy baseline copies a batch from a random place of a buffer that "
                 f"large), and at least 2 x --flush-steps ({2 * args.flush_steps}) a shard")
    cfg = {
        "shards": args.shards, "writers": args.writers, "envs": 64, "window": 32, "batch": 256,
        "capacity": capacity,
        "reps": args.reps or (3 if q else 7),
        "calls": args.calls or (10 if q else 20),
        "round_rows": args.round_rows if args.round_rows is not None else (1 << 14 if q else 1 << 16),
        "inflight": args.inflight,
        "notice_every": args.notice_every,
        "flush_steps": args.flush_steps,
        "stage": 0 if args.no_stage else 1,
        "ack_every": args.ack_every,
        "limit_s": 120.0 if q else 600.0,
    }
    load = os.getloadavg()
    if args.hosts:
        from tests.launch.hosts import Cluster

        with tempfile.TemporaryDirectory(prefix="bench-replay-hosts-") as ctmp:
            cluster = Cluster(Path(ctmp), n=2)
            try:
                os.environ["REACTOR_KEYS"] = str(cluster.keys)
                print(f"hosts: {'network namespaces' if cluster.netns else 'loopback daemons (no namespaces)'}: "
                      + ", ".join(f"{h} {a}" for h, a in cluster.addresses.items()), flush=True)
                rep = run_once(dict(cfg), dict(cluster.addresses))
            finally:
                cluster.close()
    else:
        rep = run_once(dict(cfg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    size = [s["size"] for s in rep["shards_after_fill"]]
    steps = [s["num_steps"] for s in rep["shards_after_fill"]]
    lat = {k: med(rep[k]) * 1e3 for k in ("local", "remote", "shm", "msg", "onesided", "inproc", "memcpy")}
    print(f"replay service{' (--quick settings)' if q else ''}: {cfg['shards']} shards x {cfg['capacity'] // cfg['shards']} steps in {cfg['shards']} processes "
          f"(stored steps {sum(steps)}, items {sum(size)}); batch {cfg['batch']} windows x {cfg['window']} steps "
          f"x 269 B + mask = {rep['out_nbytes'] / 1e6:.2f} MB; "
          f"medians of {cfg['reps']} reps x {cfg['calls']} batches; one-sided notices every {cfg['notice_every']} "
          f"samples; cpus={os.cpu_count()}, load average before "
          f"{load[0]:.1f}, after {os.getloadavg()[0]:.1f}; run {rep['run_wall_s']:.0f} s (start-up {rep['startup_s']:.0f} s, "
          f"measuring {rep['wall_s']:.0f} s, shutdown {rep['shutdown_s']:.0f} s)")
    mapped, huge = rep["mapped_kb"]
    print(f"shards' rings: {huge >> 10} of the {mapped >> 10} MiB of the shards' memory the requester maps are on 2 MiB "
          f"pages (reactor/transport/_shm.py, \"Pages\"; /dev/shm: {huge_pages_allowed()[1]}); the in-process table's "
          f"on 2 MiB pages where THP is on ({Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()})")
    print(f"ms/batch, 1 in flight: 1-sided shm {lat['local']:.2f} (fell back to messages "
          f"{sum(rep['local_fallbacks'])} times, {rep.get('local_retries', 0)} draws started again)  "
          f"1-sided tcp {lat['remote']:.2f} (fell back {sum(rep['remote_fallbacks'])} times)  "
          f"shm {lat['shm']:.2f}  tcp {lat['msg']:.2f}  1-sided zmq {lat['onesided']:.2f}  "
          f"in-process {lat['inproc']:.2f}  "
          f"memcpy {lat['memcpy']:.3f}; items/batch shm {med(rep['shm_items']):.1f} tcp {med(rep['msg_items']):.1f} "
          f"(dropped, rows overwritten: {rep['client']['dropped_items']})")
    for key, label in sample_cases(cfg):
        p = [med([x[i] for x in rep[f"{key}_parts"]]) for i in range(6)]
        stages = (f"stage 1 (masses) {p[0] * 1e3:.2f} ms, stage 2 (samples) {p[1] * 1e3:.2f} ms, "
                  f"assembly{' + gather' if 'msg' not in key else ''} {p[2] * 1e3:.2f} ms; "
                  if "_x" not in key and key not in ("local", "remote") else "")
        print(f"  {label}, {case_of(key, cfg)}: {med(rep[key]) * 1e3:.2f} ms/batch: {stages}requester CPU "
              f"{p[3] * 1e3:.2f} ms, context switches {p[4]:.1f} voluntary + {p[5]:.1f} forced")
    print_table(rows_of(rep, cfg))
    inproc = med(rep["inproc"])
    x = cfg["inflight"]
    for key, target, what in (("local", 0.8, "one-sided, 1 in flight"),
                              (f"local_x{x}", 1.0, f"one-sided, {x} drawn ahead on the client's threads"),
                              (f"shm_x{x}", 1.0, f"messages, {x} in flight"), ("remote", 0.5, "one-sided tcp"),
                              (f"remote_x{x}", 0.5, f"one-sided tcp, {x} drawn ahead"),
                              ("msg", 0.5, "messages over tcp")):
        if key in rep:
            r = inproc / med(rep[key])
            print(f"target (issue 21): {key} ({what}) >= {target:.0%} of in-process: {r:.0%} -> "
                  f"{'met' if r >= target else 'NOT met'}")
    print_insert_cpu(rep, cfg)
    print_raw_zmq(rep, cfg, args.hosts, q)
    print_reverb(rep, cfg, args.reverb, q)


def print_insert_cpu(rep: dict, cfg: dict) -> None:
    """Where the insert rounds' CPU went, per env step appended (medians over the rounds): each role's
    processes (their main threads and their zmq I/O threads apart) against the in-process peer's one
    thread. With every core busy, ours/peer in rate is at most cores x peer CPU / our CPU."""
    ours = [r for r in rep.get("insert", []) if r.get("cpu")]
    peer = rep.get("local_insert", [])
    if not ours or not peer:
        return
    keys = sorted({k for r in ours for k in r["cpu"]} - {"switches"})
    switches = med([r["cpu"].get("switches", 0.0) / r["messages"] for r in ours])
    per = {k: med([r["cpu"].get(k, 0.0) / r["appended"] for r in ours]) * 1e9 for k in keys}
    total = med([sum(v for k, v in r["cpu"].items() if k != "switches") / r["appended"] for r in ours]) * 1e9
    peer_ns = med([r["cpu"]["bench"] / r["appended"] for r in peer]) * 1e9
    append_ns = med([r["append_cpu"] / r["appended"] for r in ours]) * 1e9
    cores = min(os.cpu_count() or 1, cfg["writers"] + cfg["shards"])
    parts = ", ".join(f"{k.replace('_io', ' zmq I/O')} {v:.0f}" + (f" (appending {append_ns:.0f})" if k == "writer" else "")
                      for k, v in per.items())
    print(f"insert CPU per env step (/proc schedstat, medians over {len(ours)} rounds): {parts}; {total:.0f} ns in all "
          f"against the in-process peer's {peer_ns:.0f} ns on one thread: {total / peer_ns:.2f}x, so at most "
          f"{cores * peer_ns / total:.2f}x its rate on {cores} busy cores; {switches:.1f} times a thread was put on a CPU "
          f"per Steps message; rows staged in shared memory: "
          f"{med([r.get('staged_rows', 0) / max(1, r['rows']) for r in ours]):.0%}")


def print_raw_zmq(rep: dict, cfg: dict, hosts: bool, quick: bool) -> None:
    """The remote one-sided sample against raw pyzmq moving the same bytes from as many processes
    (benchmarks/peers/raw_zmq_peer.py), over the transport the run's read connections used: ipc in a
    single-host run (the shards' read servers bind next to their endpoints), tcp with CURVE over hosts."""
    from benchmarks.peers.raw_zmq_peer import measure

    transport, curve = ("tcp", True) if hosts else ("ipc", False)
    nbytes = rep["out_nbytes"]
    what = f"raw pyzmq {transport}{' + CURVE' if curve else ''}"
    rows = []
    for key in ("remote", f"remote_x{cfg['inflight']}"):
        if key not in rep:
            continue
        depth = int(key.split("_x")[1]) if "_x" in key else 1
        raw = measure(transport, curve, nbytes=nbytes, servers=cfg["shards"], rounds=50 if quick else 200,
                      inflight=depth)
        ours = med(rep[key])
        print(f"{what}: {cfg['shards']} server processes reply {nbytes / cfg['shards'] / 1e3:.0f} kB each to a "
              f"request, {depth} round(s) in flight: {raw['s'] * 1e3:.2f} ms a round (client CPU "
              f"{raw['cpu_s'] * 1e3:.2f} ms); 1-sided tcp {ours * 1e3:.2f} ms a batch (the same bytes, drawn, "
              f"checked and assembled)")
        rows.append(Row("1-sided tcp", case_of(key, cfg), 1 / ours, 1 / raw["s"], what + ", same bytes", "batch/s"))
    print_table(rows)


if __name__ == "__main__":
    interruptible(main, "bench_replay_service.py")
