"""What the replay write-ahead log costs an insert (hardening issue, "replay data that survives").

One insert batch = 256 steps, as a writer's flush sends it, into a Prioritized(0.6) table:

- CartPole-sized steps: obs float32[4], action int64, reward float32, terminated bool (17 B/step);
- Atari-sized steps: obs uint8[84, 84, 4], action int64, reward float32, terminated bool (28,237 B/step).

For each: the median time of ``Table.insert_nowait`` alone; of the insert plus ``WriteAheadLog.append``
(framing, BLAKE2b-128, ``os.writev`` and ``fsync``: what a ``Replay(wal=True)`` shard does before each
``InsertAck``); and, as the reference, a raw ``os.write`` + ``fsync`` of the same number of bytes to an
O_APPEND file on the same filesystem. Reported as inserted steps/s and the ratio with/without log.
Batches are interleaved (without, with, raw) so drift hits all three alike.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_wal.py [--dir DIR] [--reps 5] [--batches 200]
(``--dir``: where the log goes; default a temporary directory under $TMPDIR. fsync cost is the disk's.)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, positive_int  # noqa: E402
from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table, WriteAheadLog  # noqa: E402

torch.set_num_threads(1)
BATCH = 256

KINDS = {
    "cartpole": ((4,), torch.float32),
    "atari-84x84x4-uint8": ((84, 84, 4), torch.uint8),
}


def make_table(obs_shape: tuple[int, ...], dtype: torch.dtype, capacity: int) -> Table:
    specs = [FieldSpec("obs", obs_shape, dtype), FieldSpec("action", (), torch.int64),
             FieldSpec("reward", (), torch.float32), FieldSpec("terminated", (), torch.bool)]
    return Table(Storage(specs, capacity), sampler=Prioritized(0.6), remover=Fifo(), rate_limiter=MinSize(1))


def make_batch(obs_shape: tuple[int, ...], dtype: torch.dtype, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    if dtype == torch.uint8:
        obs = torch.from_numpy(rng.integers(0, 256, size=(BATCH, *obs_shape), dtype=np.uint8))
    else:
        obs = torch.from_numpy(rng.normal(size=(BATCH, *obs_shape)).astype(np.float32))
    fields = {"obs": obs, "action": torch.from_numpy(rng.integers(0, 2, BATCH)),
              "reward": torch.ones(BATCH), "terminated": torch.zeros(BATCH, dtype=torch.bool)}
    return fields, rng.uniform(0.1, 2.0, BATCH)


def bench(kind: str, directory: Path, reps: int, batches: int) -> dict[str, float]:
    shape, dtype = KINDS[kind]
    rng = np.random.default_rng(0)
    data = [make_batch(shape, dtype, rng) for _ in range(8)]
    ends = np.zeros(BATCH, dtype=bool)
    ends[-1] = True
    nbytes = sum(t.numel() * t.element_size() for t in data[0][0].values()) + BATCH * 8 + BATCH
    capacity = 64 * BATCH
    plain, logged = make_table(shape, dtype, capacity), make_table(shape, dtype, capacity)
    wal_dir = directory / f"wal-{kind}"
    wal = WriteAheadLog(wal_dir, 0)
    raw_fd = os.open(directory / f"raw-{kind}.bin", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_TRUNC, 0o644)
    raw_bytes = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()

    def without(i: int) -> None:
        fields, prio = data[i % len(data)]
        plain.insert_nowait(fields, prio, episode_end=ends)

    def with_log(i: int) -> None:
        fields, prio = data[i % len(data)]
        first = logged.storage.step_range[1]
        logged.insert_nowait(fields, prio, episode_end=ends)
        wal.append(first, fields, prio, ends, None)

    def raw(i: int) -> None:
        os.write(raw_fd, raw_bytes)
        os.fsync(raw_fd)

    for i in range(4):  # warm up (numba kernels, page faults of the rings)
        without(i), with_log(i), raw(i)
    times: dict[str, list[float]] = {"without": [], "with": [], "raw": []}
    for _ in range(reps):
        for name, fn in (("without", without), ("with", with_log), ("raw", raw)):
            t0 = time.perf_counter()
            for i in range(batches):
                fn(i)
            times[name].append((time.perf_counter() - t0) / batches)
        wal.rotate(logged.storage.step_range[1])  # as at a checkpoint: keep the log's files small
        wal.drop_before(logged.storage.step_range[1])
        os.ftruncate(raw_fd, 0)
    wal.close()
    os.close(raw_fd)
    shutil.rmtree(wal_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med["nbytes"] = nbytes
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None,
                    help="directory for the log (default: a temporary one, removed at the end; fsync cost is its disk's)")
    ap.add_argument("--reps", type=positive_int, default=5, help="repetitions, medians reported (default 5)")
    ap.add_argument("--batches", type=positive_int, default=200,
                    help=f"inserts of {BATCH} steps per case per repetition (default 200)")
    args = ap.parse_args()
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_wal-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        print(f"batch {BATCH} steps; log in {directory}; medians of {args.reps} x {args.batches} batches")
        print(f"{'steps':<22}{'bytes/batch':>12}{'insert':>12}{'insert+WAL':>12}{'ratio':>8}{'write+fsync':>13}"
              f"{'WAL - insert':>14}")
        for kind in KINDS:
            m = bench(kind, directory, args.reps, args.batches)
            ratio = m["with"] / m["without"]
            print(f"{kind:<22}{int(m['nbytes']):>12}{BATCH / m['without']:>10.0f}/s{BATCH / m['with']:>10.0f}/s"
                  f"{ratio:>7.1f}x{m['raw'] * 1e6:>10.0f} us{(m['with'] - m['without']) * 1e6:>11.0f} us")
    finally:  # (also on Ctrl-C: a temporary directory goes; in --dir, what this run wrote there)
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            for kind in KINDS:
                shutil.rmtree(directory / f"wal-{kind}", ignore_errors=True)
                (directory / f"raw-{kind}.bin").unlink(missing_ok=True)


if __name__ == "__main__":
    interruptible(main, "bench_wal.py")
