"""One-sided samples of shards on another host (their read servers), one at a time and drawn ahead, alone and
between a learner's updates, against one in-process ``Table``.

Run: ``python benchmarks/bench_onesided_remote.py [--shards 4] [--capacity 262144] [--reps 5] [--calls 200]
[--transport ipc|tcp-curve]``

What a learner on another host than its replay shards gets from ``ReplayClient(remote_reads="zmq")``: the
shards (``--shards`` tables of ``capacity / shards`` steps, filled and published as
``benchmarks/bench_onesided.py`` fills them: episodes of 20-400 steps, a step is obs float32[64] + action
int64 + reward float32 + terminated bool = 269 B) live in another process, each behind its bulk zmq read
server serving ``replay_sample`` as a Replay shard's does (``reactor/nodes/_shardmemory.py``,
``_serve_remote_samples``); this process samples them as a reader on another host would, over ipc (a
single-host stand-in for tcp: the same server, client and frames, less the network), or with
``--transport tcp-curve`` over tcp on 127.0.0.1 with CURVE, as links between hosts are. A batch is 256
windows of 32 steps by priority (``Prioritized(0.6)``), 2.21 MB.

Cases, each a median over ``--reps`` repetitions of ``--calls`` batches, the cases interleaved:

- ``asample_now``: one sample at a time (a request to every shard's server, replies awaited, assembled);
- ``drawn ahead``: ``draw_ahead(256, --ahead)`` + ``await next_drawn()``: that many samples' requests out;
- ``learner, 1 at a time`` / ``learner, drawn ahead``: each step takes a batch and then runs an update on
  it (a 3-layer MLP's forward, backward and Adam step over the batch's observations, ``--hidden`` wide:
  a stand-in for a learner's update, the same work in every case), the next batch taken one at a time
  after the update, or drawn ahead (``prefetch`` 1: its requests out before the update, as the
  ``Learner`` keeps them);
- the peer of each: ``Table.sample_nowait(256)`` on one in-process table of the whole capacity (same
  sampler, read and fields), alone and followed by the same update.

torch and numpy are pinned to one thread in both processes; the shards' process is the only other one.
"""

# ruff: noqa: E402  (thread counts are pinned in the environment before numpy is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import asyncio
import multiprocessing as mp
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, positive_int
from benchmarks.bench_onesided import (
    ALPHA,
    BATCH,
    SPECS,
    WINDOW,
    add_shard_args,
    check_shard_args,
    fill,
    published_shard,
)
from reactor.nodes.messages import ShardMass
from reactor.nodes.replay_client import ReplayClient
from reactor.replay import Fifo, MinSize, Prioritized, Storage, Table, WindowRead
from reactor.transport import CurveKeys


def serve_shards(ready: Any, stop: Any, shards: int, per: int, where: str, keys: tuple[bytes, bytes] | None) -> None:
    """The shards' process: ``shards`` filled, published tables behind bulk zmq read servers: on ipc
    sockets in ``where``, or (``keys``: a CURVE key pair) on tcp on 127.0.0.1 with CURVE."""
    torch.set_num_threads(1)

    async def main() -> None:
        rng = np.random.default_rng(0)
        curve = CurveKeys(*keys) if keys else None
        served = [await published_shard(k, per, rng, serve_at="tcp://127.0.0.1:*" if keys else f"ipc://{where}/s{k}.sock",
                                        curve=curve) for k in range(shards)]
        ready.put([(desc, offer) for _owner, desc, offer in served])
        while not stop.is_set():
            await asyncio.sleep(0.05)
        for owner, _d, _o in served:
            await owner.aclose()

    asyncio.run(main())


class Update:
    """A stand-in for a learner's update: an MLP over the batch's observations, forward, backward, Adam."""

    def __init__(self, hidden: int) -> None:
        self.net = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
        self.opt = torch.optim.Adam(self.net.parameters(), lr=1e-4)

    def __call__(self, obs: torch.Tensor) -> None:
        loss = self.net(obs.reshape(-1, 64)).square().mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()


async def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_shard_args(ap, calls=200)
    ap.add_argument("--ahead", type=positive_int, default=4, help="samples drawn ahead in the sampling-only case")
    ap.add_argument("--hidden", type=positive_int, default=32, help="the update's MLP width (its cost per step)")
    ap.add_argument("--transport", choices=("ipc", "tcp-curve"), default="ipc",
                    help="the read servers' sockets: ipc, or tcp on 127.0.0.1 with CURVE (as between hosts)")
    args = ap.parse_args()
    check_shard_args(ap, args)
    torch.set_num_threads(1)
    per = args.capacity // args.shards
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as where:
        ready, stop = spawn.Queue(), spawn.Event()
        keys = CurveKeys.generate() if args.transport == "tcp-curve" else None
        proc = spawn.Process(target=serve_shards, daemon=True,
                             args=(ready, stop, args.shards, per, where, (keys.public, keys.secret) if keys else None))
        proc.start()
        client = ReplayClient(args.shards, rng=np.random.default_rng(1), remote_reads="zmq", bulk=False, curve=keys)
        try:
            for k, (desc, offer) in enumerate(await shards_ready(ready, proc, 300.0)):
                await client._attach(k, desc)
                await client._attach_sampling(k, offer)
                client._figures[k] = ShardMass(k, 0, 0, "", 1.0, 1.0, per, 0.4)  # (as a first reply would say)
            assert client.can_sample_one_sided and not client.can_sample_now, "the shards' offers were not taken"
            peer = Table(Storage(SPECS, per * args.shards), sampler=Prioritized(ALPHA), remover=Fifo(),
                         rate_limiter=MinSize(1), read=WindowRead(WINDOW))
            fill(peer, np.random.default_rng(2), 2 * per * args.shards)
            update = Update(args.hidden)
            await run_cases(client, peer, update, args)
        finally:
            client.close()
            stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()


async def shards_ready(ready: Any, proc: Any, timeout_s: float) -> list:
    """The shards' descriptors, once their process has filled and published them. Polled, not one
    blocking ``get``: a blocking call held the loop, so a Ctrl-C (which asyncio delivers by cancelling
    this task at its next await, and which ends the shards' process too) hung the benchmark until the
    timeout; and a shards' process that exits early is reported at once.

    Raises:
        SystemExit: the shards' process exited first, or nothing came within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ready.get_nowait()
        except queue.Empty:
            pass
        if not proc.is_alive() and ready.empty():
            raise SystemExit(f"the shards' process exited (code {proc.exitcode}) before its shards were ready; "
                             f"its output above says why")
        if time.monotonic() > deadline:
            raise SystemExit(f"the shards' process was not ready within {timeout_s:.0f} s")
        await asyncio.sleep(0.05)


async def run_cases(client: ReplayClient, peer: Table, update: Update, args: argparse.Namespace) -> None:
    calls = args.calls

    async def remote(depth: int, learn: bool) -> None:
        for i in range(calls):
            if depth == 1:
                batch, _ = await client.asample_now(BATCH)
            else:
                client.draw_ahead(BATCH, min(depth, calls - i))
                batch, _ = await client.next_drawn()
            assert batch is not None, "a one-sided sample declined"
            if learn:
                update(batch.data["obs"])
        client.take_notices()

    async def inproc(learn: bool) -> None:
        for _ in range(calls):
            data, _info = peer.sample_nowait(BATCH)
            if learn:
                update(data["obs"])

    cases = {"asample_now": lambda: remote(1, False), "drawn ahead": lambda: remote(args.ahead, False),
             "in-process": lambda: inproc(False), "learner, 1 at a time": lambda: remote(1, True),
             "learner, drawn ahead": lambda: remote(2, True), "learner, in-process": lambda: inproc(True)}
    for fn in cases.values():  # warm: kernels loaded, connections up, allocator warm
        calls_, calls = calls, 10
        await fn()
        calls = calls_
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu: dict[str, list[float]] = {k: [] for k in cases}
    order = list(cases)
    for rep in range(args.reps):
        for name in order if rep % 2 == 0 else order[::-1]:
            t, c = time.perf_counter(), time.process_time()
            await cases[name]()
            times[name].append((time.perf_counter() - t) / calls)
            cpu[name].append((time.process_time() - c) / calls)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"one-sided samples of {args.shards} shards in another process (bulk zmq read servers over "
          f"{'tcp with CURVE' if args.transport == 'tcp-curve' else 'ipc'}), "
          f"{args.shards} x {args.capacity // args.shards} steps, {BATCH} x {WINDOW}-step windows of 269 B "
          f"({BATCH * WINDOW * 269 / 1e6:.2f} MB); update: MLP 64-{args.hidden}-{args.hidden}-1 over the "
          f"batch's {BATCH * WINDOW} observations, Adam; medians of {args.reps} x {calls}; cpus={os.cpu_count()}")
    rows = [("asample_now", "in-process"), ("drawn ahead", "in-process"),
            ("learner, 1 at a time", "learner, in-process"), ("learner, drawn ahead", "learner, in-process")]
    print(f"{'case':<24} {'ours ms/step':>12} {'client CPU':>10} {'peer ms/step':>12}  {'ours/peer':>9}  peer")
    for ours, theirs in rows:
        print(f"{ours:<24} {med[ours] * 1e3:>12.3f} {statistics.median(cpu[ours]) * 1e3:>10.3f} "
              f"{med[theirs] * 1e3:>12.3f}  {med[theirs] / med[ours]:>9.2f}  Table.sample_nowait"
              f"{' + the same update' if 'learner' in ours else ''}")
    print(f"the update alone: ~{(med['learner, in-process'] - med['in-process']) * 1e3:.3f} ms; drawn ahead the "
          f"learner's step is {med['learner, 1 at a time'] / med['learner, drawn ahead']:.2f}x as fast as one "
          f"sample at a time")


if __name__ == "__main__":
    interruptible(lambda: asyncio.run(main()), "bench_onesided_remote.py")
