"""One-sided sampling in one process: ``ReplayClient.sample_now`` over published shards against one Table.

Run: ``python benchmarks/bench_onesided.py [--shards 4] [--capacity 262144] [--reps 5] [--calls 300]``

What ``bench_replay_service.py``'s "1-sided shm" case measures, without the runtime: ``--shards``
tables of ``capacity / shards`` steps each, published in shared memory as a Replay shard publishes
them (``SamplingPublisher`` in a ``BulkOwner``'s regions, the rows' version column kept), mapped by a
``ReplayClient`` in the same process; against one in-process ``Table`` of the whole capacity with the
same sampler, read and fields (the peer of the service benchmark). Both hold episodes of 20-400
steps inserted in 1024-step calls until the ring wrapped twice; a step is obs float32[64] + action
int64 + reward float32 + terminated bool = 269 B; a batch is 256 windows of 32 steps by priority
(``Prioritized(0.6)``). Figures are medians over ``--reps`` repetitions of ``--calls`` batches, the two
sides interleaved; the client's notices are taken and dropped (no shard process counts them here).

Also printed: the least time of a sample of 4 items on both sides (a sample's fixed cost: the Python
around the compiled calls, their dispatch, the checks; the figure to compare when the client's Python
changes, steadier here than the batch's); and, from timers around the client's parts (one more
repetition), the two compiled calls (``SharedShards.figures`` and ``draw``), the liveness checks of
the shards' owners, and the rest (the client's Python).
"""

# ruff: noqa: E402  (thread counts are pinned in the environment before numpy is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, positive_int
from reactor.nodes.messages import ShardMass
from reactor.nodes.replay_client import ReplayClient
from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table, WindowRead
from reactor.replay.shared import SamplingPublisher, SharedArrays, SharedSampling, SharedShards, serve_sample
from reactor.transport._shm import huge_pages_allowed, mapped_kb
from reactor.transport.bulk import BulkOwner

WINDOW, BATCH, ALPHA = 32, 256, 0.6
FEW = 4  # items of the samples that measure a sample's fixed cost
SPECS = [FieldSpec("obs", (64,), torch.float32), FieldSpec("action", (), torch.int64),
         FieldSpec("reward", (), torch.float32), FieldSpec("terminated", (), torch.bool)]


def fill(table: Table, rng: np.random.Generator, steps: int, pub: SamplingPublisher | None = None) -> None:
    """``steps`` steps in 1024-step inserts, episodes of 20-400 steps, priorities in [0.1, 1.1)."""
    for _ in range(-(-steps // 1024)):
        lens = np.cumsum(rng.integers(20, 400, size=8))
        ends = np.zeros(1024, bool)
        ends[lens[lens < 1024] - 1] = True
        data = {"obs": torch.randn(1024, 64), "action": torch.zeros(1024, dtype=torch.int64),
                "reward": torch.zeros(1024), "terminated": torch.from_numpy(ends.copy())}
        if pub is not None:
            pub.begin()
        table.insert_nowait(data, rng.random(1024) + 0.1, episode_end=ends)
        if pub is not None:
            pub.end()


async def published_shard(k: int, capacity: int, rng: np.random.Generator, serve_at: str | None = None,
                          curve: object = None) -> tuple[BulkOwner, dict, dict]:
    """A shard's table, filled and published as a Replay shard's; (owner, descriptor, offer). Its memory
    is shared (a reader on this host maps it), or with ``serve_at`` (a zmq address) its bulk read server
    there serves ``replay_sample`` as a Replay shard's does for readers on other hosts (``curve``: the
    job's CurveKeys, which the server then requires, as between hosts)."""
    owner = await BulkOwner.open(f"bench-onesided-{os.getpid()}-{k}", backends=["zmq" if serve_at else "shm"],
                                 **({"zmq_bind": serve_at, "curve": curve} if serve_at else {}))
    region = f"r{k}"
    arrays = (SharedArrays(lambda _name, nb: np.zeros(nb, np.uint8)) if serve_at else
              SharedArrays(lambda name, nb: owner.allocate(f"-s-{region}", name, (1, nb), torch.uint8).numpy()[0]))
    storage = Storage(SPECS, capacity, allocator=owner.allocator(region), index_arrays=arrays)
    versions = owner.allocate_versions(region).numpy()
    table = Table(storage, sampler=Prioritized(ALPHA), remover=Fifo(), rate_limiter=MinSize(1), arrays=arrays)
    pub = SamplingPublisher(table, arrays, read=WindowRead(WINDOW))
    fill(table, rng, 2 * capacity, pub)
    first, nxt = storage.step_range
    held = np.arange(first, nxt)
    versions[held % capacity] = held  # what Replay's inserts leave in the version column
    offer = {"table": pub.descriptor(), "op": "replay_sample", "max_items": 1 << 20}
    if not serve_at:
        return owner, owner.descriptor(region), {**offer, "region": owner.descriptor(f"-s-{region}")}
    published = SharedSampling(pub.descriptor(), {n: arrays.get(n) for n in arrays.layout()})
    fields = [(s.name, storage._fields[s.name][0].numel() * storage._fields[s.name].element_size(),
               storage._fields[s.name].data_ptr()) for s in SPECS]

    def serve(req: dict, _tensors: object) -> dict:
        reply = serve_sample(published, req, fields, 1 << 20)
        reply["fields"] = [f[0] for f in fields]
        return reply

    owner.serve_op("replay_sample", serve)
    owner.kept = (table, pub)  # type: ignore[attr-defined]  # (alive while the server draws from them)
    return owner, {**owner.descriptor(region), "host": "another-host"}, offer


#: Steps a shard holds at least: its inserts are 1024-step calls on top of an open episode of up to 400.
MIN_SHARD_STEPS = 2048


def add_shard_args(ap: argparse.ArgumentParser, calls: int) -> None:
    """The shards' and the timing's options (also ``bench_onesided_remote.py``'s)."""
    ap.add_argument("--shards", type=positive_int, default=4, help="shards (tables) sampled together (default 4)")
    ap.add_argument("--capacity", type=positive_int, default=1 << 18,
                    help=f"steps over all shards (default 256K; at least {MIN_SHARD_STEPS} a shard)")
    ap.add_argument("--reps", type=positive_int, default=5, help="repetitions, medians reported (default 5)")
    ap.add_argument("--calls", type=positive_int, default=calls,
                    help=f"batches of 256 windows per case per repetition (default {calls})")


def check_shard_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.capacity // args.shards < MIN_SHARD_STEPS:
        ap.error(f"--capacity {args.capacity} over --shards {args.shards} leaves {args.capacity // args.shards} "
                 f"steps a shard; give at least {MIN_SHARD_STEPS * args.shards}")


class Timers:
    """Seconds spent in the client's parts, from wrappers around them (one repetition)."""

    def __init__(self, client: ReplayClient) -> None:
        self.kernels = self.alive = 0.0
        figures, draw, alive = SharedShards.figures, SharedShards.draw, client._reader.check_alive_all  # type: ignore[union-attr]

        def timed(fn):  # noqa: ANN001, ANN202
            def call(*a: object) -> int:
                t = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    self.kernels += time.perf_counter() - t
            return call

        def timed_alive(regions: tuple[str, ...], within_s: float = 0.0) -> None:
            t = time.perf_counter()
            try:
                alive(regions, within_s)
            finally:
                self.alive += time.perf_counter() - t

        self.undo = lambda: (setattr(SharedShards, "figures", figures), setattr(SharedShards, "draw", draw),
                             setattr(client._reader, "check_alive_all", alive))  # type: ignore[union-attr]
        SharedShards.figures, SharedShards.draw = timed(figures), timed(draw)  # type: ignore[method-assign]
        client._reader.check_alive_all = timed_alive  # type: ignore[union-attr, method-assign]


async def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    add_shard_args(ap, calls=300)
    ap.add_argument("--ahead", type=positive_int, default=4, help="draws running at once in the drawn-ahead case")
    args = ap.parse_args()
    check_shard_args(ap, args)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    per = args.capacity // args.shards
    shards = [await published_shard(k, per, rng) for k in range(args.shards)]
    client = ReplayClient(args.shards, rng=np.random.default_rng(1), remote_reads="off")
    try:
        for k, (_owner, desc, offer) in enumerate(shards):
            await client._attach(k, desc)
            await client._attach_sampling(k, offer)
            client._figures[k] = ShardMass(k, 0, 0, "", 1.0, 1.0, per, 0.4)  # (as a first reply would say)
        assert client.can_sample_now, "the shards' one-sided offers were not taken"
        peer = Table(Storage(SPECS, per * args.shards), sampler=Prioritized(ALPHA), remover=Fifo(),
                     rate_limiter=MinSize(1), read=WindowRead(WINDOW))
        fill(peer, rng, 2 * per * args.shards)
        for _ in range(30):  # compiled kernels loaded, allocator warm
            client.sample_now(BATCH)
            peer.sample_nowait(BATCH)
        ours, theirs, ahead = [], [], []
        for _ in range(args.reps):
            t = time.perf_counter()
            for _ in range(args.calls):
                client.sample_now(BATCH)
            ours.append((time.perf_counter() - t) / args.calls)
            client.take_notices()
            t = time.perf_counter()
            for i in range(args.calls):  # drawn ahead: --ahead draws running on the client's threads
                client.draw_ahead(BATCH, min(args.ahead, args.calls - i))
                client.take_drawn()
            ahead.append((time.perf_counter() - t) / args.calls)
            client.take_notices()
            t = time.perf_counter()
            for _ in range(args.calls):
                peer.sample_nowait(BATCH)
            theirs.append((time.perf_counter() - t) / args.calls)
        few = []  # the fixed cost of a sample: FEW items (its Python, the calls, the checks; hardly any copy)
        for _ in range(args.reps):
            t = time.perf_counter()
            for _ in range(args.calls):
                client.sample_now(FEW)
            a_ = (time.perf_counter() - t) / args.calls
            client.take_notices()
            t = time.perf_counter()
            for _ in range(args.calls):
                peer.sample_nowait(FEW)
            few.append((a_, (time.perf_counter() - t) / args.calls))
        timers = Timers(client)
        t = time.perf_counter()
        for _ in range(args.calls):
            client.sample_now(BATCH)
        whole = (time.perf_counter() - t) / args.calls
        timers.undo()
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"one-sided sample_now, {args.shards} shards x {per} steps, {BATCH} x {WINDOW}-step windows of 269 B "
              f"({BATCH * WINDOW * 269 / 1e6:.2f} MB), medians of {args.reps} x {args.calls}; cpus={os.cpu_count()}")
        mapped, huge = mapped_kb()
        print(f"  shards' rings: {huge >> 10} of the {mapped >> 10} MiB of shared memory this process maps are on 2 MiB "
              f"pages (reactor/transport/_shm.py, \"Pages\"; /dev/shm: {huge_pages_allowed()[1]}); the in-process "
              f"table's on 2 MiB pages where THP is on "
              f"({Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text().strip()})")
        print(f"  ReplayClient.sample_now   {a * 1e3:.3f} ms/batch")
        print(f"  Table.sample_nowait       {b * 1e3:.3f} ms/batch (one in-process table of {per * args.shards} steps)")
        print(f"  ours / in-process speed   {b / a:.2f}x")
        c = statistics.median(ahead)
        print(f"  drawn ahead, {args.ahead} at a time on {client.draw_threads} threads: {c * 1e3:.3f} ms/batch, "
              f"{b / c:.2f}x of in-process")
        f_ours, f_peer = min(f[0] for f in few), min(f[1] for f in few)
        print(f"  a sample of {FEW} items (its fixed cost; least of {args.reps} x {args.calls}): ours "
              f"{f_ours * 1e6:.1f} us, Table.sample_nowait {f_peer * 1e6:.1f} us")
        k_, l_ = timers.kernels / args.calls, timers.alive / args.calls
        print(f"  parts of sample_now (timed run {whole * 1e3:.3f} ms): the two compiled calls (figures and counts; draws, copies, keys and weights) {k_ * 1e6:.0f} us, "
              f"owners' liveness checks {l_ * 1e6:.0f} us, the rest {(whole - k_ - l_) * 1e6:.0f} us")
    finally:
        client.close()
        for owner, _d, _o in shards:
            await owner.aclose()


if __name__ == "__main__":
    interruptible(lambda: asyncio.run(main()), "bench_onesided.py")
