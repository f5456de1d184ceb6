"""What restoring a replay checkpoint holds in memory and takes, beside the floor of reading its files.

A table of ``--gib`` GiB of rows (float32[256] a row, Prioritized(0.6)) is saved once; then, each in a
fresh process (so the peak is the restore's own): ``Table.load`` (what the offline app and a user
loading a checkpoint do), a shard's restore (``ShardStore.open``: what ``Replay(restore=True)`` does at
a run's resume, into the shard's own empty table), and the floor: the same files read with
``readinto`` into one buffer allocated for them, no checks. Reported: peak RSS over the process's
start (``VmHWM`` after ``clear_refs``, Linux), wall time, and each as a ratio of the floor's.

Run:  python benchmarks/bench_restore.py [--gib 1] [--dir DIR]
(``--dir``: where the checkpoint goes; default a temporary directory under $TMPDIR, removed at the end.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, positive_float  # noqa: E402

ROW = 256  # float32 values a row: 1 KiB


def _table(rows: int):  # noqa: ANN202 (imports torch only where a table is built)
    import torch

    from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table

    return Table(Storage([FieldSpec("obs", (ROW,), torch.float32)], rows), sampler=Prioritized(0.6), remover=Fifo(),
                 rate_limiter=MinSize(1))


def save(directory: Path, rows: int) -> None:
    import numpy as np
    import torch

    t = _table(rows)
    chunk = min(rows, 1 << 16)
    for i in range(0, rows, chunk):
        n = min(chunk, rows - i)
        t.insert_nowait({"obs": torch.full((n, ROW), float(i))}, np.ones(n), episode_end=True)
    t.save(directory)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(how: str, directory: Path, rows: int) -> dict[str, float]:
    """One restore in this (fresh) process: its peak RSS over the start and its wall time."""
    import numpy as np  # noqa: F401 (imported before the start figure, as the restores need it)
    import torch  # noqa: F401

    from reactor.nodes._shardstore import ShardStore
    from reactor.replay import Table
    from reactor.replay.checkpoint import latest_checkpoint

    with open("/proc/self/clear_refs", "w") as f:  # the peak from here (ru_maxrss is the parent's after a fork)
        f.write("5")
    start = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if how == "load":
        n = len(Table.load(directory))
    elif how == "shard":
        t = _table(rows)
        ShardStore("replay", directory, keep=2, period_s=None, wal=False).open(t, restore=True, restarts=0)
        n = len(t)
    else:  # the floor: every file of the checkpoint read into one buffer sized for them
        ckpt = latest_checkpoint(directory)
        assert ckpt is not None
        files = sorted(ckpt.iterdir())
        buf = bytearray(sum(f.stat().st_size for f in files))
        view, at = memoryview(buf), 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                at += fh.readinto(view[at:])
        n = rows
    wall = time.perf_counter() - t0
    peak = _status_kib("VmHWM") - start
    return {"rows": n, "wall_s": wall, "peak_gib": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=positive_float, default=1.0, help="the table's rows in GiB (default 1)")
    ap.add_argument("--dir", default=None, help="where the checkpoint goes (default: a temporary directory)")
    ap.add_argument("--child", choices=("load", "shard", "floor"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = max(1, int(args.gib * 2**30) // (ROW * 4))
    if args.child:
        print(json.dumps(child(args.child, Path(args.dir), rows)))
        return
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_restore-"))
    directory.mkdir(parents=True, exist_ok=True)
    try:
        save(directory, rows)
        got = {}
        for how in ("floor", "load", "shard"):
            p = subprocess.run([sys.executable, __file__, "--child", how, "--dir", str(directory), "--gib", str(args.gib)],
                               capture_output=True, text=True, timeout=1800)
            if p.returncode:
                sys.exit(f"bench_restore: the {how} child failed:\n{p.stderr[-3000:]}")
            got[how] = json.loads(p.stdout.strip().splitlines()[-1])
        floor = got["floor"]
        print(f"{rows:,} rows ({rows * ROW * 4 / 2**30:.2f} GiB of rows); checkpoint in {directory}")
        print(f"{'':<34}{'peak RSS':>10}{'x floor':>9}{'wall':>9}{'x floor':>9}")
        names = {"floor": "floor: the files into one buffer", "load": "Table.load", "shard": "shard restore (Replay)"}
        for how, m in got.items():
            print(f"{names[how]:<34}{m['peak_gib']:>7.2f} GiB{m['peak_gib'] / floor['peak_gib']:>8.2f}x"
                  f"{m['wall_s']:>7.2f} s{m['wall_s'] / floor['wall_s']:>8.2f}x")
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    interruptible(main, "bench_restore.py")
