"""DeepMind Reverb doing bench_replay_service.py's workload: the peer for its Reverb rows.

Run (in Reverb's own venv, made by ``scripts/setup_reverb_peer.sh``; reactor is not imported here):

    nice -n 10 .venv-reverb/bin/python benchmarks/peers/reverb_peer.py [--quick] [--json FILE]

Reverb is used the way its users use it:

- a ``reverb.Server`` in a process of its own (multiprocessing, spawn), on a port the OS picked,
  reached over gRPC on localhost, with one table: ``Prioritized(0.6)`` sampler, ``Fifo`` remover,
  ``MinSize(1)`` rate limiter, ``max_size`` = capacity items and a signature of 32-step windows of
  steps obs float32[64], action int64, reward float32, terminated bool (269 B a step);
- ``writers`` actor processes with ``envs`` synthetic env streams each (episodes end at random, one in
  500 steps; priorities uniform in [0.01, 10], as in benchmarks/apps/replay_service.py), one
  ``TrajectoryWriter`` per stream (``num_keep_alive_refs`` = window, auto-tuned chunks) that appends
  every step and, once its episode has ``window`` steps, creates an item of the last ``window`` steps
  of every column at every step (stride 1: one item per step, like the service's WindowRead items,
  less the first window-1 steps of each episode, which Reverb's fixed-shape items cannot hold);
  ``end_episode()`` when an episode ends;
- sampling in this (the learner's) process through ``reverb.TrajectoryDataset.from_table_signature``
  (``max_in_flight_samples_per_worker`` = 2 x batch, workers auto) ``.batch(batch)``: tf.data, the way
  Reverb's users feed a learner; also with ``.prefetch(AUTOTUNE)``, and ``Client.sample(batch)`` with
  the samples stacked by numpy (Reverb's docs advise against it for training; printed for reference).

Figures: ``insert_cold``, the first fill of the whole capacity (env steps appended per second, from
the writers' go to the moment every writer's ``flush()`` returned, i.e. the server confirmed every
item); ``insert``, ``round_rows`` more items per writer into the full table (FIFO removal at work);
sampling batches/s (median over ``reps`` repetitions of ``calls`` batches each, after ``warmup``
batches, a fresh iterator per repetition, the cases' order alternating). One JSON dict is printed on
stdout (and written to ``--json``); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter (children inherit it)

TABLE = "windows"
ROW_NBYTES = 64 * 4 + 8 + 4 + 1  # 269 B a step
EPISODE_MEAN = 500
POOL = 64


def log(msg: str) -> None:
    print(f"[reverb peer] {msg}", file=sys.stderr, flush=True)


def signature(window: int):
    import tensorflow as tf

    return {"obs": tf.TensorSpec([window, 64], tf.float32), "action": tf.TensorSpec([window], tf.int64),
            "reward": tf.TensorSpec([window], tf.float32), "terminated": tf.TensorSpec([window], tf.bool)}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(capacity: int, window: int, conn) -> None:
    """The server process: one table, until the parent says stop (or goes away)."""
    import reverb

    table = reverb.Table(name=TABLE, sampler=reverb.selectors.Prioritized(0.6), remover=reverb.selectors.Fifo(),
                         max_size=capacity, rate_limiter=reverb.rate_limiters.MinSize(1),
                         signature=signature(window))
    server = reverb.Server(tables=[table], port=free_port())
    conn.send(server.port)
    try:
        conn.recv()
    except EOFError:
        pass
    server.stop()


def write(address: str, writer_id: int, envs: int, window: int, commands, results) -> None:
    """An actor process: ``envs`` synthetic env streams, one TrajectoryWriter each."""
    import numpy as np
    import reverb

    rng = np.random.default_rng(1000 + writer_id)
    obs = rng.normal(size=(POOL, envs, 64)).astype(np.float32)
    action = rng.integers(0, 18, size=(POOL, envs))
    reward = rng.normal(size=(POOL, envs)).astype(np.float32)
    term = rng.random((POOL, envs)) < 1.0 / EPISODE_MEAN
    prio = rng.uniform(0.01, 10.0, size=(POOL, envs))
    first_end = rng.integers(1, 256, size=envs)  # streams end their first episodes at different steps
    client = reverb.Client(address)
    writers = [client.trajectory_writer(num_keep_alive_refs=window) for _ in range(envs)]
    ep_len = [0] * envs
    history: list = [None] * envs  # each writer's column histories: the same objects for its whole life
    k = 0
    results.put(("ready", writer_id))
    while True:
        cmd = commands.get()
        if cmd is None:
            break
        quota = int(cmd)
        steps = items = episodes = 0
        t0 = time.perf_counter()
        while items < quota:
            i = k % POOL
            ends = term[i] if k >= 256 else term[i] | (first_end == k)
            k += 1
            for e in range(envs):
                w = writers[e]
                w.append({"obs": obs[i, e], "action": action[i, e], "reward": reward[i, e],
                          "terminated": ends[e]})
                ep_len[e] += 1
                if ep_len[e] >= window:
                    h = history[e]
                    if h is None:
                        h = history[e] = w.history
                    w.create_item(TABLE, float(prio[i, e]), {"obs": h["obs"][-window:], "action": h["action"][-window:],
                                                            "reward": h["reward"][-window:],
                                                            "terminated": h["terminated"][-window:]})
                    items += 1
                if ends[e]:
                    w.end_episode(clear_buffers=True)
                    ep_len[e] = 0
                    episodes += 1
            steps += envs
        for w in writers:
            w.flush()
        results.put(("done", writer_id, steps, items, episodes, time.perf_counter() - t0))
    for w in writers:
        w.close()
    client = None


def insert_round(ctx_queues, results, quota: int) -> dict:
    n = len(ctx_queues)
    t0 = time.perf_counter()
    for q in ctx_queues:
        q.put(quota)
    done = [results.get(timeout=900) for _ in range(n)]
    s = time.perf_counter() - t0
    steps = sum(d[2] for d in done)
    items = sum(d[3] for d in done)
    return {"steps": steps, "items": items, "episodes": sum(d[4] for d in done), "s": s,
            "steps_per_s": steps / s, "items_per_s": items / s, "gb_per_s": steps * ROW_NBYTES / s / 1e9,
            "writer_s": [d[5] for d in done]}


def table_info(client) -> dict:
    info = client.server_info()[TABLE]
    return {"current_size": int(info.current_size), "max_size": int(info.max_size),
            "num_episodes": int(info.num_episodes), "num_unique_samples": int(info.num_unique_samples)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 256K-item table and fewer repetitions")
    ap.add_argument("--capacity", type=int, default=None, help="items (= windows, ~ steps) held (default 1M, quick 256K)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--writers", type=int, default=4, help="actor processes")
    ap.add_argument("--envs", type=int, default=64, help="env streams (TrajectoryWriters) per actor process")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each sampling case (default 5, quick 3)")
    ap.add_argument("--calls", type=int, default=None, help="batches timed per repetition (default 20, quick 10)")
    ap.add_argument("--warmup", type=int, default=3, help="batches drawn from a fresh iterator before timing")
    ap.add_argument("--round-rows", type=int, default=None,
                    help="items per writer in the insert round after the fill (default 16K, quick 4K; 0: none)")
    ap.add_argument("--no-client-sample", action="store_true", help="skip the Client.sample case")
    ap.add_argument("--json", default="", help="also write the result here")
    args = ap.parse_args()
    q = args.quick
    capacity = args.capacity or (1 << 18 if q else 1 << 20)
    reps = args.reps or (3 if q else 5)
    calls = args.calls or (10 if q else 20)
    round_rows = args.round_rows if args.round_rows is not None else (1 << 12 if q else 1 << 14)
    batch, window = args.batch, args.window
    t_start = time.perf_counter()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=serve, args=(capacity, window, child), name="reverb-server", daemon=True)
    server.start()
    port = parent.recv()
    address = f"localhost:{port}"
    log(f"server (pid {server.pid}) on {address}")
    results = ctx.Queue()
    queues = [ctx.Queue() for _ in range(args.writers)]
    procs = [ctx.Process(target=write, args=(address, i, args.envs, window, queues[i], results), daemon=True,
                         name=f"reverb-writer-{i}") for i in range(args.writers)]
    for p in procs:
        p.start()

    from importlib.metadata import version

    import numpy as np
    import reverb
    import tensorflow as tf

    for _ in procs:
        assert results.get(timeout=300)[0] == "ready"
    client = reverb.Client(address)
    out: dict = {
        "peer": "reverb", "versions": {"dm-reverb": version("dm-reverb"), "tensorflow": tf.__version__,
                                       "numpy": np.__version__, "python": platform.python_version()},
        "config": {"capacity": capacity, "batch": batch, "window": window, "writers": args.writers,
                   "envs": args.envs, "reps": reps, "calls": calls, "warmup": args.warmup, "round_rows": round_rows,
                   "max_in_flight_samples_per_worker": 2 * batch, "sampler": "Prioritized(0.6)", "remover": "Fifo",
                   "rate_limiter": "MinSize(1)"},
        "cpus": os.cpu_count(),
        "startup_s": time.perf_counter() - t_start,
    }
    log(f"{args.writers} writers x {args.envs} streams ready after {out['startup_s']:.1f} s; filling {capacity} items")
    out["insert_cold"] = insert_round(queues, results, -(-capacity // args.writers))
    out["table_after_fill"] = table_info(client)
    log(f"fill: {out['insert_cold']['steps']} steps in {out['insert_cold']['s']:.1f} s = "
        f"{out['insert_cold']['steps_per_s']:,.0f} steps/s; table {out['table_after_fill']}")
    if round_rows:
        out["insert"] = insert_round(queues, results, round_rows)
        log(f"insert into the full table: {out['insert']['steps']} steps in {out['insert']['s']:.1f} s = "
            f"{out['insert']['steps_per_s']:,.0f} steps/s")
    for qu in queues:
        qu.put(None)
    for p in procs:
        p.join(timeout=60)
    out["table_before_sampling"] = table_info(client)

    def dataset(prefetch: bool):
        ds = reverb.TrajectoryDataset.from_table_signature(server_address=address, table=TABLE,
                                                           max_in_flight_samples_per_worker=2 * batch)
        ds = ds.batch(batch, drop_remainder=True)
        return ds.prefetch(tf.data.AUTOTUNE) if prefetch else ds

    datasets = {"dataset": dataset(False), "dataset_prefetch": dataset(True)}
    keys = list(signature(window))

    def time_dataset(name: str) -> float:
        it = iter(datasets[name])
        for _ in range(args.warmup):
            b = next(it)
        t0 = time.perf_counter()
        for _ in range(calls):
            b = next(it)
        s = time.perf_counter() - t0
        assert tuple(b.data["obs"].shape) == (batch, window, 64), b.data["obs"].shape
        del it
        return s / calls

    def client_batch() -> dict:
        samples = list(client.sample(TABLE, num_samples=batch, emit_timesteps=False, unpack_as_table_signature=True))
        return {k: np.stack([s.data[k] for s in samples]) for k in keys}

    def time_client(_: str) -> float:
        for _ in range(args.warmup):
            b = client_batch()
        t0 = time.perf_counter()
        for _ in range(calls):
            b = client_batch()
        s = time.perf_counter() - t0
        assert b["obs"].shape == (batch, window, 64), b["obs"].shape
        return s / calls

    cases = {"dataset": time_dataset, "dataset_prefetch": time_dataset}
    if not args.no_client_sample:
        cases["client_sample"] = time_client
    per_batch: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(reps):
        order = list(cases) if rep % 2 == 0 else list(reversed(cases))
        for name in order:
            per_batch[name].append(cases[name](name))
        log(f"rep {rep + 1}/{reps}: " + ", ".join(f"{n} {per_batch[n][-1] * 1e3:.1f} ms/batch" for n in cases))
    batch_nbytes = batch * window * ROW_NBYTES
    for name, xs in per_batch.items():
        m = statistics.median(xs)
        out[f"sample_{name}"] = {"s_per_batch": xs, "median_s": m, "batches_per_s": 1 / m,
                                 "gb_per_s": batch_nbytes / m / 1e9}
    out["batch_nbytes"] = batch_nbytes
    parent.send("stop")
    server.join(timeout=30)
    out["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(out, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
