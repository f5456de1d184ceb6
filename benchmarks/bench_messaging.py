"""Messaging benchmark (issue 2): the transport's Endpoint against raw pyzmq, memcpy and Ray.

Run: ``python benchmarks/bench_messaging.py [--reps 5] [--loop uvloop|asyncio] [--no-ray] [--only SECTION]``

Every measurement runs between two real OS processes (spawned), except memcpy. Each figure is the
median over ``--reps`` repetitions taken in this run. Sections live in :data:`SECTIONS`, a registry
of ``name -> function(args) -> list[Row]``: to add one (for example the reactor-level section:
reactor messages between two reactors inproc / ipc / tcp), write a function returning rows and
register it there; ``main`` prints every registered section in one table.
"""

# ruff: noqa: E402  (thread counts are pinned in the environment before numpy is imported)
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse
import asyncio
import logging
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, peer_missing, positive_int  # noqa: E402
from reactor.transport import Endpoint  # noqa: E402

SMALL_N = 50_000
RTT_N = 3_000
RTT_WARMUP = 300


@dataclass(frozen=True)
class Row:
    """One line of the table: our figure, the peer's, and ours/peer (higher is better unless noted)."""

    section: str
    case: str
    ours: float
    peer: float
    peer_name: str
    unit: str
    lower_is_better: bool = False

    @property
    def ratio(self) -> float:
        return self.ours / self.peer if self.peer else float("nan")


def small_message(i: int) -> dict[str, Any]:
    """A ~100-byte control message: a tag tuple, a port name, a sequence number, a value, padding."""
    return {"tag": (i * 1000, 0), "port": "observation", "seq": i, "value": 0.5, "pad": b"p" * 40}


def raw_small_message(i: int) -> bytes:
    return msgpack.packb({"tag": [i * 1000, 0], "port": "observation", "seq": i, "value": 0.5, "pad": b"p" * 40})


def run_loop(coro: Any, loop_name: str) -> Any:
    logging.getLogger("reactor.transport").setLevel(logging.ERROR)  # peers closing is expected here
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


#: Where the ipc sockets go: a directory of this run's own, removed at its end (the sockets' files were
#: left in $TMPDIR, six a run).
IPC_DIR: str | None = None


def addresses(transport: str, tag: str) -> str:
    if transport == "tcp":
        return "tcp://127.0.0.1:*"
    assert IPC_DIR is not None, "main() makes the ipc directory"
    return f"ipc://{IPC_DIR}/{tag}.sock"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ------------------------------------------------------------------------------------------ children


def _child_raw_sender(kind: str, address: str, n: int, payload: str, loop_name: str) -> None:
    """Send n messages as fast as an asyncio sender can: NOBLOCK sends, await POLLOUT when full."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PUSH if kind == "push" else zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(address)
        sync = zmq.Socket.shadow(sock.underlying)
        if payload == "small":
            for i in range(n):
                msg = raw_small_message(i)
                while True:
                    try:
                        sync.send(msg, zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        await sock.poll(flags=zmq.POLLOUT)
        else:
            nbytes = int(payload)
            arr = np.ones(nbytes, np.uint8)
            for _ in range(n):
                await sock.send_multipart([b"hdr", arr], copy=False)
        await asyncio.sleep(0.5)  # let zmq flush before closing
        sock.close()
        ctx.term()

    run_loop(main(), loop_name)


def _child_raw_echo(address: str, loop_name: str) -> None:
    """A ROUTER that echoes every message it gets, draining all ready messages per wake-up."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sync = zmq.Socket.shadow(sock.underlying)
        while True:
            await sock.poll(flags=zmq.POLLIN)
            while True:
                try:
                    ident, body = sync.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if body == b"stop":
                    sock.close()
                    ctx.term()
                    return
                msgpack.unpackb(body)
                sync.send_multipart([ident, body])

    run_loop(main(), loop_name)


def _child_endpoint_sender(address: str, n: int, payload: str, loop_name: str) -> None:
    async def main() -> None:
        ep = await Endpoint.open("sender", "tcp://127.0.0.1:*")
        await ep.connect("receiver", address)
        if payload == "small":
            for i in range(n):
                await ep.send("receiver", small_message(i))
        else:
            import torch

            t = torch.ones(int(payload), dtype=torch.uint8)
            for _ in range(n):
                await ep.send("receiver", {"t": t})
        await ep.wait_peer_lost(timeout_s=60)  # the receiver closes when it has everything
        await ep.aclose()

    run_loop(main(), loop_name)


def _child_endpoint_echo(bind: str, parent_address: str, conn: Any, loop_name: str) -> None:
    async def main() -> None:
        ep = await Endpoint.open("echo", bind)
        conn.send(ep.address)
        await ep.connect("parent", parent_address)
        while True:
            for sender, msg in await ep.recv_batch():
                if msg == "stop":
                    await ep.aclose()
                    return
                ep.send_nowait(sender, msg)

    run_loop(main(), loop_name)


def _spawn(target: Callable[..., None], *args: Any) -> mp.process.BaseProcess:
    p = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _reap(p: mp.process.BaseProcess) -> None:
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join(5)


# ------------------------------------------------------------------------------------------ sections


async def _raw_rate(kind: str, transport: str, n: int, payload: str, loop_name: str) -> float:
    """Messages (or bytes) per second received from a child, raw pyzmq, draining in batches."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PULL if kind == "push" else zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addresses(transport, f"raw-{kind}"))
    sync = zmq.Socket.shadow(sock.underlying)
    child = _spawn(_child_raw_sender, kind, sock.get(zmq.LAST_ENDPOINT).decode(), n, payload, loop_name)
    got = 0
    t0 = 0.0
    try:
        while got < n:
            await sock.poll(flags=zmq.POLLIN)
            while got < n:
                try:
                    frames = sync.recv_multipart(zmq.NOBLOCK, copy=payload == "small")
                except zmq.Again:
                    break
                if got == 0:
                    t0 = time.perf_counter()
                if payload == "small":
                    msgpack.unpackb(frames[-1])
                else:
                    np.frombuffer(frames[-1].buffer, np.uint8)
                got += 1
        dt = time.perf_counter() - t0
    finally:
        sock.close()
        ctx.term()
        _reap(child)
    return (n - 1) / dt if payload == "small" else (n - 1) * int(payload) / dt


async def _endpoint_rate(transport: str, n: int, payload: str, loop_name: str) -> float:
    # A 64 MiB tensor plus its header is just over the default 64 MiB message limit.
    ep = await Endpoint.open("receiver", addresses(transport, "ep-rx"), max_message_nbytes=2**27)
    child = _spawn(_child_endpoint_sender, ep.address, n, payload, loop_name)
    got = 0
    t0 = None
    try:
        while got < n:
            batch = await ep.recv_batch(timeout_s=60)
            if not batch:
                raise RuntimeError(f"benchmark sender went silent after {got} of {n} messages")
            if t0 is None:
                t0 = time.perf_counter()  # time from the first message on: n - 1 intervals
            got += len(batch)
        dt = time.perf_counter() - t0
    finally:
        await ep.aclose()  # the sender sees us go, and exits
        _reap(child)
    return (n - 1) / dt if payload == "small" else (n - 1) * int(payload) / dt


async def _raw_rtt(transport: str, loop_name: str) -> tuple[float, float]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addresses(transport, "raw-rtt"))
    child = _spawn(_child_raw_echo, sock.get(zmq.LAST_ENDPOINT).decode(), loop_name)
    times = []
    try:
        for i in range(RTT_N + RTT_WARMUP):
            t0 = time.perf_counter()
            await sock.send(raw_small_message(i))
            msgpack.unpackb(await sock.recv())
            if i >= RTT_WARMUP:
                times.append(time.perf_counter() - t0)
        await sock.send(b"stop")
    finally:
        _reap(child)
        sock.close()
        ctx.term()
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


async def _endpoint_rtt(transport: str, loop_name: str) -> tuple[float, float]:
    ep = await Endpoint.open("parent", addresses(transport, "ep-rtt-parent"))
    parent_conn, child_conn = mp.get_context("spawn").Pipe()
    child = _spawn(_child_endpoint_echo, addresses(transport, "ep-rtt-echo"), ep.address, child_conn, loop_name)
    times = []
    try:
        echo_address = parent_conn.recv()
        await ep.connect("echo", echo_address)
        for i in range(RTT_N + RTT_WARMUP):
            t0 = time.perf_counter()
            await ep.send("echo", small_message(i))
            await ep.recv_batch()
            if i >= RTT_WARMUP:
                times.append(time.perf_counter() - t0)
        await ep.send("echo", "stop")
    finally:
        _reap(child)
        await ep.aclose()
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def section_small(args: argparse.Namespace) -> list[Row]:
    """~100 B messages across processes: rate (Endpoint vs raw PUSH/PULL and DEALER/ROUTER) and RTT."""
    rows = []
    for transport in ("ipc", "tcp"):
        ours = [run_loop(_endpoint_rate(transport, SMALL_N, "small", args.loop), args.loop) for _ in range(args.reps)]
        for kind, label in (("push", "raw PUSH/PULL"), ("dealer", "raw DEALER/ROUTER")):
            raw = [run_loop(_raw_rate(kind, transport, SMALL_N, "small", args.loop), args.loop) for _ in range(args.reps)]
            rows.append(Row("small msg rate", transport, median(ours), median(raw), label, "msg/s"))
        ours_rtt = [run_loop(_endpoint_rtt(transport, args.loop), args.loop) for _ in range(args.reps)]
        raw_rtt = [run_loop(_raw_rtt(transport, args.loop), args.loop) for _ in range(args.reps)]
        for q, name in ((0, "p50"), (1, "p99")):
            rows.append(
                Row(
                    f"small msg RTT {name}",
                    transport,
                    median([r[q] for r in ours_rtt]) * 1e6,
                    median([r[q] for r in raw_rtt]) * 1e6,
                    "raw DEALER/ROUTER",
                    "us",
                    lower_is_better=True,
                )
            )
    return rows


def _memcpy_rate(nbytes: int, reps: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(max(5, reps)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / median(times)


def section_bulk(args: argparse.Namespace) -> list[Row]:
    """1 MiB and 64 MiB tensors between processes: Endpoint vs raw pyzmq zero-copy vs memcpy."""
    rows = []
    for nbytes, n in ((2**20, 400), (64 * 2**20, 12)):
        label = f"{nbytes // 2**20} MiB ipc"
        ours = [run_loop(_endpoint_rate("ipc", n, str(nbytes), args.loop), args.loop) for _ in range(args.reps)]
        raw = [run_loop(_raw_rate("push", "ipc", n, str(nbytes), args.loop), args.loop) for _ in range(args.reps)]
        rows.append(Row("bulk tensor", label, median(ours) / 1e9, median(raw) / 1e9, "raw pyzmq zero-copy", "GB/s"))
        rows.append(
            Row("bulk tensor", label, median(ours) / 1e9, _memcpy_rate(nbytes, args.reps) / 1e9, "memcpy 1 core", "GB/s")
        )
    return rows


def section_ray(args: argparse.Namespace) -> list[Row]:
    """Ray 1:1 actor calls (round trip, and pipelined rate) vs Endpoint messages over ipc."""
    try:
        import ray
    except ImportError as e:
        print(peer_missing("Ray", e, "pip install -e '.[bench]' adds it."))
        return []
    # Ray's session files (logs, sockets) go to this run's directory, removed at its end (Ray's default,
    # /tmp/ray, keeps every session's).
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             _temp_dir=os.path.join(IPC_DIR or tempfile.gettempdir(), "ray"))
    try:

        @ray.remote
        class Echo:
            def ping(self, msg: Any) -> Any:
                return msg

        actor = Echo.remote()
        ray.get(actor.ping.remote(0))
        rtts, rates = [], []
        n_rtt, n_rate = 1000, 5000
        for _ in range(args.reps):
            times = []
            for i in range(n_rtt):
                t0 = time.perf_counter()
                ray.get(actor.ping.remote(small_message(i)))
                times.append(time.perf_counter() - t0)
            rtts.append(float(np.percentile(times, 50)))
            t0 = time.perf_counter()
            ray.get([actor.ping.remote(small_message(i)) for i in range(n_rate)])
            rates.append(n_rate / (time.perf_counter() - t0))
    finally:
        ray.shutdown()
    ours_rate = median([run_loop(_endpoint_rate("ipc", SMALL_N, "small", args.loop), args.loop) for _ in range(args.reps)])
    ours_rtt = median([run_loop(_endpoint_rtt("ipc", args.loop), args.loop)[0] for _ in range(args.reps)])
    return [
        Row("vs Ray actor calls", "rate ipc", ours_rate, median(rates), "Ray pipelined calls", "msg/s"),
        Row("vs Ray actor calls", "RTT p50 ipc", ours_rtt * 1e6, median(rtts) * 1e6, "Ray ray.get(call)", "us", True),
    ]


#: The benchmark's sections, printed in this order. Add a section by registering a function here
#: (``args -> list[Row]``); the reactor-level section (two reactors inproc / ipc / tcp) goes here.
SECTIONS: dict[str, Callable[[argparse.Namespace], list[Row]]] = {
    "small": section_small,
    "bulk": section_bulk,
    "ray": section_ray,
}


def print_table(rows: list[Row]) -> None:
    header = f"{'section':<22} {'case':<14} {'ours':>12} {'peer':>12} {'unit':<6} {'ours/peer':>9}  peer"
    print(header)
    print("-" * len(header))
    for r in rows:
        note = " (lower is better)" if r.lower_is_better else ""
        print(
            f"{r.section:<22} {r.case:<14} {r.ours:>12,.2f} {r.peer:>12,.2f} {r.unit:<6} {r.ratio:>9.2f}  {r.peer_name}{note}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=positive_int, default=5, help="repetitions per figure (median reported)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the event loop on both sides (default uvloop)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray section")
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append",
                        help="run only this section (repeat the option for more)")
    args = parser.parse_args()
    global IPC_DIR
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-msg-") as tmp:
        IPC_DIR = tmp
        for name, section in SECTIONS.items():
            if (args.only and name not in args.only) or (name == "ray" and args.no_ray):
                continue
            t0 = time.perf_counter()
            rows += section(args)
            print(f"(section {name}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(f"loop={args.loop} reps={args.reps} python={sys.version.split()[0]} pyzmq={zmq.__version__} "
          f"libzmq={zmq.zmq_version()} cpus={os.cpu_count()}")
    print_table(rows)


if __name__ == "__main__":
    interruptible(main, "bench_messaging.py")
