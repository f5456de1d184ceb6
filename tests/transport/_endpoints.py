"""Helpers of the endpoint tests: peer processes (tests/transport/_peer.py) and raw zmq peers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from reactor.transport._zmqreceive import hello_message

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30  # bound on every wait for another process


class Peer:
    """A child process running tests/transport/_peer.py."""

    def __init__(self, proc: asyncio.subprocess.Process, info: dict[str, Any]) -> None:
        self.proc = proc
        self.address: str = info["address"]

    async def result(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), WAIT_S)
        assert line, f"peer exited without a result (rc={await self.proc.wait()})"
        return json.loads(line)

    async def exit_code(self) -> int:
        return await asyncio.wait_for(self.proc.wait(), WAIT_S)


@contextlib.asynccontextmanager
async def peer_process(role: str, **cfg: Any) -> AsyncIterator[Peer]:
    """Run a peer process; it is always killed (if still running) and reaped on exit."""
    loop = asyncio.get_running_loop()
    cfg.setdefault("loop", "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.transport._peer", role, json.dumps(cfg),
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), WAIT_S)
        assert line, f"peer {role} failed to start (rc={await proc.wait()})"
        yield Peer(proc, json.loads(line))
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.communicate(), WAIT_S)  # reap, and read to EOF so the pipe closes


def bind_address(transport: str, tmp_path: Path, name: str) -> str:
    return "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{tmp_path}/{name}.sock"


def _raw_dealer(ctx: zmq.asyncio.Context, address: str, identity: bytes) -> zmq.asyncio.Socket:
    """A bare DEALER at ``address`` under ``identity``: frames as an attacker sends them."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, identity)
    s.connect(address)
    return s


async def _say_hello(s: zmq.asyncio.Socket, name: str) -> None:
    await s.send_multipart([b"", hello_message(name, os.urandom(8), 0)])
    while True:  # (a sweep's empty credit grant, its probe of every sender, may come first)
        reply = await asyncio.wait_for(s.recv_multipart(), WAIT_S)
        assert reply[0] == b""
        if msgpack.unpackb(reply[1])[0] == 2:
            return


async def _line(peer: Peer, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The next line ``peer`` prints that ``pred`` holds for (the lines before it are skipped)."""
    while not pred(got := await peer.result()):
        pass
    return got
