"""Sequence windows and checkpoints of the replay table (issue 3).

Part 1 -- sequence windows: a Table over 1M steps (obs float32[8], action int64, reward float32,
done bool: 45 bytes/step), Prioritized(alpha=0.6) sampler, WindowRead(32, "tail"). One call =
``table.sample_nowait(256)``: 256 windows of 32 steps drawn by priority, gathered with masks, plus
importance weights. Reported as batches/s and GB/s of gathered output (fields + mask), next to a
single-core memcpy of the same number of bytes, and against TorchRL's PrioritizedSliceSampler when
torchrl imports (it is reported, not fatal, when it does not).

Part 2 -- checkpoint of a ~1 GB table: time the table is held (the snapshot under the lock) vs
the whole save (snapshot + .npy writes + fsync + rename + marker).

Run:  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python benchmarks/bench_replay_windows.py [--quick]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from reactor.replay import (  # noqa: E402
    FieldSpec,
    Fifo,
    MinSize,
    Prioritized,
    Storage,
    Table,
    WindowRead,
)

torch.set_num_threads(1)

SPECS = [FieldSpec("obs", (8,), torch.float32), FieldSpec("action", (), torch.int64),
         FieldSpec("reward", (), torch.float32), FieldSpec("done", (), torch.bool)]


def median_time(fn, reps: int, inner: int) -> float:
    """Median over ``reps`` of the mean seconds per call over ``inner`` calls."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def build_table(capacity: int, rng: np.random.Generator) -> Table:
    t = Table(Storage(SPECS, capacity), sampler=Prioritized(0.6), remover=Fifo(), rate_limiter=MinSize(1),
              read=WindowRead(32, "tail"), beta=0.4)
    chunk = 4096
    done = 0
    while done < capacity:
        n = min(chunk, capacity - done)
        ends = rng.random(n) < 1 / 500  # episodes of ~500 steps
        t.insert_nowait({"obs": torch.from_numpy(rng.normal(size=(n, 8)).astype(np.float32)),
                         "action": torch.from_numpy(rng.integers(0, 4, n)),
                         "reward": torch.from_numpy(rng.normal(size=n).astype(np.float32)),
                         "done": torch.from_numpy(ends)},
                        rng.uniform(0.01, 10.0, n), episode_end=ends)
        done += n
    return t


def bench_windows(quick: bool) -> None:
    rng = np.random.default_rng(0)
    capacity = 1 << 20
    t0 = time.perf_counter()
    table = build_table(capacity, rng)
    print(f"# windows: filled {capacity} steps in {time.perf_counter() - t0:.1f}s; "
          f"fields obs float32[8], action int64, reward float32, done bool = {table.storage.step_nbytes} B/step")
    m = table.storage.memory()
    print(f"# storage memory: data {m.data_nbytes / 2**20:.1f} MiB, index {m.index_nbytes / 2**20:.1f} MiB, "
          f"stored raw {m.stored_nbytes / 2**20:.1f} MiB, data/raw = {m.data_nbytes / m.stored_nbytes:.3f}")
    B, T = 256, 32
    batch, _ = table.sample_nowait(B)
    out_bytes = sum(v.numel() * v.element_size() for v in batch.values())
    reps, inner = (5, 20) if quick else (11, 100)

    def sample() -> None:
        table.sample_nowait(B)

    def update() -> None:
        keys = rng.integers(*table.storage.step_range, B)
        table.update_priorities(keys, rng.uniform(0.01, 10.0, B))

    # Gather alone (same kind of anchors, drawn fresh each call).
    lo, hi = table.storage.step_range
    anchors = [rng.integers(lo, hi, B) for _ in range(64)]
    it = iter(range(10**9))

    def gather() -> None:
        table.storage.read_windows(anchors[next(it) % 64], T, "tail")

    src = torch.empty(out_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)

    def memcpy() -> None:
        dst.copy_(src)

    s_sample = median_time(sample, reps, inner)
    s_gather = median_time(gather, reps, inner)
    s_memcpy = median_time(memcpy, reps, inner)
    gbps = out_bytes / s_sample / 1e9
    mem_gbps = out_bytes / s_memcpy / 1e9
    print(f"# gathered output per batch: {out_bytes} B ({B} x {T} steps x {table.storage.step_nbytes} B + mask)")
    print(f"reactor Table.sample_nowait({B}) windows T={T}: {1 / s_sample:10.0f} batches/s  {gbps:6.2f} GB/s")
    print(f"reactor Storage.read_windows gather only     : {1 / s_gather:10.0f} batches/s  "
          f"{out_bytes / s_gather / 1e9:6.2f} GB/s")
    print(f"memcpy (torch copy_, 1 thread) same bytes     : {1 / s_memcpy:10.0f} copies/s   {mem_gbps:6.2f} GB/s")
    print(f"ratio sample / memcpy = {gbps / mem_gbps:.2f}   gather / memcpy = {s_memcpy / s_gather:.2f}  "
          "(target >= 0.30)")
    s_learn = median_time(lambda: (sample(), update()), reps, inner)
    print(f"reactor learner step (sample {B} windows + update {B}): {1 / s_learn:10.0f} steps/s")
    bench_torchrl(B, T, reps, inner, s_sample)


def bench_torchrl(B: int, T: int, reps: int, inner: int, ours_s: float) -> None:
    try:
        import torchrl  # noqa: F401
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedSliceSampler, TensorDictReplayBuffer
    except Exception as e:  # report and go on: the peer is optional
        print(f"peer TorchRL PrioritizedSliceSampler: did not load: {type(e).__name__}: {str(e)[:300]}")
        return
    try:
        n = 1 << 20
        rng = np.random.default_rng(1)
        ends = torch.from_numpy(rng.random(n) < 1 / 500)
        episode = torch.cumsum(ends.long(), 0)
        data = TensorDict({"obs": torch.randn(n, 8), "action": torch.randint(0, 4, (n,)),
                           "reward": torch.randn(n), "done": ends, "episode": episode}, batch_size=[n])
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n),
                                    sampler=PrioritizedSliceSampler(max_capacity=n, alpha=0.6, beta=0.4,
                                                                    slice_len=T, traj_key="episode",
                                                                    strict_length=False),
                                    batch_size=B * T)
        rb.extend(data)
        rb.sample()
        s = median_time(rb.sample, reps, max(1, inner // 10))
        print(f"peer TorchRL PrioritizedSliceSampler {B}x{T}: {1 / s:10.0f} batches/s; ratio ours/peer = {s / ours_s:.2f}")
    except Exception as e:
        print(f"peer TorchRL PrioritizedSliceSampler: failed to run: {type(e).__name__}: {str(e)[:300]}")


def bench_checkpoint(quick: bool) -> None:
    width = 256 if not quick else 32  # obs float32[256] = 1 KiB/step; 1M steps = 1 GiB
    capacity = 1 << 20
    specs = [FieldSpec("obs", (width,), torch.float32)]
    t = Table(Storage(specs, capacity), sampler=Prioritized(0.6), remover=Fifo(), rate_limiter=MinSize(1))
    chunk = torch.ones(1 << 16, width)
    for _ in range(capacity >> 16):
        t.insert_nowait({"obs": chunk}, np.ones(1 << 16), episode_end=True)
    size_gb = t.storage.memory().stored_nbytes / 1e9
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=os.environ.get("BENCH_CKPT_DIR"))
    try:
        holds, totals, allocs = [], [], []
        for _ in range(3 if not quick else 2):
            t0 = time.perf_counter()
            buffers = t.storage.snapshot_buffers()  # allocated and paged in without the lock
            ta = time.perf_counter()
            state = t.state_dict(_buffers=buffers)  # the part that holds the table's lock
            t1 = time.perf_counter()
            allocs.append(ta - t0)
            t._write(state, root, keep=1)
            t2 = time.perf_counter()
            del state
            holds.append(t1 - ta)
            totals.append(t2 - t0)
        h, tot = statistics.median(holds), statistics.median(totals)
        print(f"checkpoint of a {size_gb:.2f} GB table: lock held {h * 1e3:.0f} ms (snapshot copy), "
              f"buffers paged in without the lock {statistics.median(allocs) * 1e3:.0f} ms, "
              f"whole save {tot * 1e3:.0f} ms (alloc + copy + write + fsync + rename + marker); "
              f"held/total = {h / tot:.2f}")
        t0 = time.perf_counter()
        Table.load(root)
        print(f"load of the same checkpoint: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and a small checkpoint")
    ap.add_argument("--skip-checkpoint", action="store_true")
    args = ap.parse_args()
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, numpy {np.__version__}")
    bench_windows(args.quick)
    if not args.skip_checkpoint:
        bench_checkpoint(args.quick)


if __name__ == "__main__":
    main()
