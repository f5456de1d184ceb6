"""Bulk transport benchmark: gather sequence windows from another process's region.

Run: ``python benchmarks/bench_bulk.py [--reps 7] [--rows 1048576] [--batch 256] [--length 32]``

An owner process (spawned: ``--owner`` mode of this file) allocates a region of ``--rows`` rows
(obs float32[64] + action int64 + reward float32 + done bool: 269 bytes a row), fills it, and serves
it over shared memory and over zmq (tcp on 127.0.0.1, as between hosts, and ipc). This process
reads ``--batch`` windows of ``--length`` consecutive rows at fresh random places every call (the
region is far larger than the caches, so no call finds its rows cached) and reports, per case, the
median over ``--reps`` repetitions of ``--calls`` calls:

- ``shm read``: :meth:`BulkReader.read` over shared memory, into preallocated ``out`` buffers;
- ``shm read (alloc)``: the same, letting the reader allocate the result;
- ``shm read_checked``: with the sequence-lock version checks;
- ``zmq tcp`` / ``zmq ipc``: the round trip to the owner's server thread, into ``out`` buffers;
- ``raw pyzmq``: a bare DEALER/ROUTER round trip over tcp returning the same number of bytes from
  a thread of the owner process (no gather, no checks, no asyncio): the transport's ceiling;
- ``in-process Storage.read_windows``: the replay engine gathering the same windows from its own
  private memory in this process (``reactor.replay.Storage``, one long episode): the figure the
  issue's target (>= 50% of in-process) refers to;
- ``memcpy``: one core copying the same number of bytes in one contiguous copy, from a random
  offset of a buffer as large as the region (the floor of any gather of these bytes).

Figures are GB/s of gathered row bytes and the ratio to memcpy in the same run. torch and numpy are
pinned to one thread.
"""

# ruff: noqa: E402  (thread counts are pinned in the environment before numpy is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, positive_int
from reactor.transport.bulk import BulkOwner, BulkReader, seqlock_begin, seqlock_end

FIELDS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "obs": ((64,), torch.float32),
    "action": ((), torch.int64),
    "reward": ((), torch.float32),
    "done": ((), torch.bool),
}
ROW_NBYTES = sum(
    int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dt).element_size() for shape, dt in FIELDS.values()
)


# ------------------------------------------------------------------------------------------ owner


async def owner_main(rows: int, run_id: str, ipc_dir: str, raw_nbytes: int) -> None:
    """The owner process: allocate, fill, print descriptors (tcp and ipc owners), wait for stdin EOF."""
    torch.set_num_threads(1)
    tcp = await BulkOwner.open(run_id, backends=["shm", "zmq"], max_reply_nbytes=1 << 30)
    ipc = await BulkOwner.open(
        run_id + "-ipc", backends=["zmq"], zmq_bind=f"ipc://{ipc_dir}/bulk.sock", max_reply_nbytes=1 << 30
    )
    out = {}
    for name, owner in (("tcp", tcp), ("ipc", ipc)):
        tensors = {f: owner.allocate("region", f, (rows, *shape), dt) for f, (shape, dt) in FIELDS.items()}
        g = torch.Generator().manual_seed(0)
        tensors["obs"].copy_(torch.rand((rows, 64), generator=g))
        tensors["action"].copy_(torch.arange(rows))
        tensors["reward"].copy_(torch.rand(rows, generator=g))
        tensors["done"].copy_(torch.arange(rows) % 100 == 99)
        versions = owner.allocate_versions("region")
        all_rows = np.arange(rows)
        seqlock_begin(versions, all_rows)
        seqlock_end(versions, all_rows, all_rows)
        out[name] = owner.descriptor("region")
    # The raw pyzmq peer: a ROUTER thread answering every request with the same bytes a read moves.
    import threading

    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    payload = np.ones(raw_nbytes, np.uint8)

    def serve_raw() -> None:
        while True:
            ident, msg = router.recv_multipart()
            if msg == b"stop":
                return
            router.send_multipart([ident, payload], copy=False)

    thread = threading.Thread(target=serve_raw, daemon=True)
    thread.start()
    out["raw"] = f"tcp://127.0.0.1:{port}"
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await tcp.aclose()
    await ipc.aclose()


# ------------------------------------------------------------------------------------------ reader


def window_rows(rng: np.random.Generator, rows: int, batch: int, length: int) -> np.ndarray:
    starts = rng.integers(0, rows - length, batch)
    return starts[:, None] + np.arange(length)


async def measure(args: argparse.Namespace, descs: dict[str, Any]) -> list[tuple[str, float]]:
    b, t, rows = args.batch, args.length, args.rows
    nbytes = b * t * ROW_NBYTES
    rng = np.random.default_rng(1)
    readers = {}
    for case, desc, backend in (("shm", descs["tcp"], "shm"), ("tcp", descs["tcp"], "zmq"), ("ipc", descs["ipc"], "zmq")):
        r = await BulkReader.open()
        await r.attach(desc, backend=backend)
        readers[case] = r
    out = {f: torch.empty((b, t, *shape), dtype=dt) for f, (shape, dt) in FIELDS.items()}
    # memcpy baseline: one contiguous copy of the same number of bytes, from a random offset of a
    # buffer as large as the region (so it is not cached either).
    big = np.ones(rows * ROW_NBYTES, dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)

    def memcpy_call() -> None:
        off = int(rng.integers(0, big.shape[0] - nbytes))
        np.copyto(dst, big[off : off + nbytes])

    import zmq

    from reactor.replay.storage import FieldSpec, Storage

    zctx = zmq.Context()
    raw = zctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(descs["raw"])

    def raw_call() -> None:
        raw.send(b"x")
        raw.recv(copy=False)

    storage = Storage([FieldSpec(f, shape, dt) for f, (shape, dt) in FIELDS.items()], capacity=rows)
    g = torch.Generator().manual_seed(0)
    storage.append(
        {
            "obs": torch.rand((rows, 64), generator=g),
            "action": torch.arange(rows),
            "reward": torch.rand(rows, generator=g),
            "done": torch.zeros(rows, dtype=torch.bool),
        },
        episode_end=True,
    )

    cases: dict[str, Any] = {
        "memcpy (1 core, same bytes)": memcpy_call,
        "shm read -> out": lambda: readers["shm"].read("region", window_rows(rng, rows, b, t), out=out),
        "shm read (alloc)": lambda: readers["shm"].read("region", window_rows(rng, rows, b, t)),
        "shm read_checked -> out": lambda: readers["shm"].read_checked(
            "region", window_rows(rng, rows, b, t), out=out
        ),
        "zmq tcp -> out": lambda: readers["tcp"].read("region", window_rows(rng, rows, b, t), out=out),
        "zmq ipc -> out": lambda: readers["ipc"].read("region", window_rows(rng, rows, b, t), out=out),
        "raw pyzmq tcp (same bytes)": raw_call,
        "in-process Storage.read_windows": lambda: storage.read_windows(rng.integers(0, rows - t, b), t),
    }
    results: dict[str, list[float]] = {c: [] for c in cases}
    for fn in cases.values():  # warm-up (numba kernels, connections)
        res = fn()
        if asyncio.iscoroutine(res):
            await res
    for _rep in range(args.reps):
        for case, fn in cases.items():  # interleaved rep by rep, so load spikes hit every case alike
            t0 = time.perf_counter()
            for _ in range(args.calls):
                res = fn()
                if asyncio.iscoroutine(res):
                    await res
            results[case].append((time.perf_counter() - t0) / args.calls)
    for r in readers.values():
        await r.aclose()
    raw.send(b"stop")
    raw.close(0)
    zctx.term()
    return [(case, nbytes / statistics.median(ts) / 1e9) for case, ts in results.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=positive_int, default=7, help="repetitions, medians reported (default 7)")
    ap.add_argument("--calls", type=positive_int, default=20, help="reads per case per repetition (default 20)")
    ap.add_argument("--rows", type=positive_int, default=1 << 20,
                    help="rows of the owner's region, 269 B each (default 1M: 269 MB; more than --batch x --length)")
    ap.add_argument("--batch", type=positive_int, default=256, help="windows per read (default 256)")
    ap.add_argument("--length", type=positive_int, default=32, help="rows per window (default 32)")
    ap.add_argument("--owner", nargs=2, metavar=("RUN_ID", "IPC_DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rows <= args.batch * args.length:
        ap.error(f"--rows {args.rows} must exceed --batch x --length = {args.batch * args.length} (the memcpy "
                 f"baseline copies that many rows from a random place of a region of --rows)")
    torch.set_num_threads(1)
    if args.owner:
        asyncio.run(owner_main(args.rows, *args.owner, args.batch * args.length * ROW_NBYTES))
        return
    run_id = f"bench-{os.getpid()}"
    with tempfile.TemporaryDirectory() as ipc_dir:
        proc = subprocess.Popen(
            [sys.executable, __file__, "--rows", str(args.rows), "--batch", str(args.batch), "--length",
             str(args.length), "--owner", run_id, ipc_dir],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"owner process failed (rc={proc.wait()})")
            rows = asyncio.run(measure(args, json.loads(line)))
            proc.stdin.close()
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    b, t = args.batch, args.length
    print(
        f"bulk gather: {b} windows x {t} rows x {ROW_NBYTES} B/row (obs float32[64] + action + reward + done) "
        f"= {b * t * ROW_NBYTES / 2**20:.2f} MiB per call, from a {args.rows}-row region "
        f"({args.rows * ROW_NBYTES / 2**20:.0f} MiB) in another process; medians of {args.reps} reps x {args.calls} calls"
    )
    base = rows[0][1]
    by_case = dict(rows)
    # Each bulk case also against its natural peer: shm against the in-process gather (the issue's
    # target), zmq against a bare pyzmq round trip of the same bytes.
    peers = {"shm": "in-process Storage.read_windows", "zmq": "raw pyzmq tcp (same bytes)"}
    print(f"{'case':32s} {'GB/s':>8s} {'vs memcpy':>10s} {'ms/call':>9s}  vs peer")
    for case, gbs in rows:
        peer = peers.get(case.split()[0])
        vs_peer = f"{gbs / by_case[peer]:.2f}x {peer}" if peer else ""
        print(f"{case:32s} {gbs:8.2f} {gbs / base:9.2f}x {b * t * ROW_NBYTES / gbs / 1e6:9.3f}  {vs_peer}")


if __name__ == "__main__":
    interruptible(main, "bench_bulk.py")
