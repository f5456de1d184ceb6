"""Raw pyzmq moving bench_replay_service.py's one-sided remote sample: the transport's floor for its rows.

The service's ``1-sided tcp`` case asks each of ``servers`` shard processes once (its bulk read server
draws the shard's part and replies with its rows) and waits for every reply: one batch's bytes cross
from ``servers`` processes to the requester, one batch in flight. This peer does the same with nothing
but pyzmq, as its users write it: ``servers`` processes (multiprocessing, spawn), each a ROUTER that
answers any request with ``nbytes / servers`` bytes in one zero-copy frame (made once), and a client
whose DEALERs ask all of them at once and receive every reply (``copy=False``) before the next round.
No draw, no encoding, no check: what it costs to move the bytes.

Transports: ``ipc`` (unix sockets, what a single-host run's read servers bind) and ``tcp`` on
127.0.0.1, each plain or with CURVE (what links between hosts use). Called by
``benchmarks/bench_replay_service.py``; runnable alone:

    python benchmarks/peers/raw_zmq_peer.py [--nbytes 2210000] [--servers 4] [--rounds 200] [--inflight 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from typing import Any


def _server(address: str, nbytes: int, keys: tuple[bytes, bytes] | None, ready: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if keys is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys
    if address.endswith(":*"):
        port = sock.bind_to_random_port(address[: address.rindex(":")])
        address = f"{address[: address.rindex(':')]}:{port}"
    else:
        sock.bind(address)
    ready.put(address)
    payload = zmq.Frame(os.urandom(nbytes))
    while True:
        ident, request = sock.recv_multipart()
        if request == b"stop":
            break
        sock.send_multipart([ident, payload], copy=False)
    sock.close(0)
    ctx.term()


def measure(transport: str, curve: bool, *, nbytes: int = 2_210_000, servers: int = 4, rounds: int = 200,
            reps: int = 3, inflight: int = 1) -> dict[str, float]:
    """Median seconds per round (all ``servers`` replies of ``nbytes`` in all) and the client's CPU
    seconds per round (every thread of this process: zmq's I/O thread included), with ``inflight``
    requests out to each server at all times (the next sent as soon as a reply is in)."""
    import zmq

    spawn = mp.get_context("spawn")
    server_keys = zmq.curve_keypair() if curve else None
    client_keys = zmq.curve_keypair() if curve else None
    with tempfile.TemporaryDirectory(prefix="raw-zmq-peer-") as tmp:
        ready: Any = spawn.Queue()
        procs = []
        for i in range(servers):
            where = f"ipc://{tmp}/s{i}" if transport == "ipc" else "tcp://127.0.0.1:*"
            p = spawn.Process(target=_server, args=(where, nbytes // servers, server_keys, ready), daemon=True)
            p.start()
            procs.append(p)
        ctx = zmq.Context()
        socks = []
        try:
            for _ in procs:
                s = ctx.socket(zmq.DEALER)
                if curve:
                    assert server_keys is not None and client_keys is not None
                    s.curve_serverkey = server_keys[0]
                    s.curve_publickey, s.curve_secretkey = client_keys
                s.connect(ready.get(timeout=60))
                socks.append(s)
            for _ in range(20):  # connections up, buffers warm
                for s in socks:
                    s.send(b"go")
                for s in socks:
                    s.recv(copy=False)
            walls, cpus = [], []
            for _ in range(reps):
                for _ in range(inflight - 1):  # the rounds ahead, out before the timing starts
                    for s in socks:
                        s.send(b"go")
                t, c = time.perf_counter(), time.process_time()
                for _ in range(rounds):
                    for s in socks:
                        s.send(b"go")
                    for s in socks:
                        s.recv(copy=False)
                walls.append((time.perf_counter() - t) / rounds)
                cpus.append((time.process_time() - c) / rounds)
                for _ in range(inflight - 1):
                    for s in socks:
                        s.recv(copy=False)
            for s in socks:
                s.send(b"stop")
        finally:
            for s in socks:
                s.close(0)
            ctx.term()
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return {"s": statistics.median(walls), "cpu_s": statistics.median(cpus)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbytes", type=int, default=2_210_000)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--inflight", type=int, default=1, help="requests out to each server at all times")
    args = ap.parse_args()
    for transport, curve in (("ipc", False), ("tcp", False), ("tcp", True)):
        r = measure(transport, curve, nbytes=args.nbytes, servers=args.servers, rounds=args.rounds,
                    inflight=args.inflight)
        print(f"{transport}{' + CURVE' if curve else ''}: {r['s'] * 1e3:.2f} ms a round, client CPU "
              f"{r['cpu_s'] * 1e3:.2f} ms, {args.nbytes / r['s'] / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
