"""Fixtures of the endpoint tests (tests/transport/test_endpoint*.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest_asyncio
import zmq

from reactor.transport import Endpoint


def _open_fds() -> dict[int, str]:
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
    return fds


@pytest_asyncio.fixture
async def open_endpoint() -> AsyncIterator[Any]:
    """Open endpoints for a test; at teardown close them and check nothing leaked.

    Leaks checked: tasks still pending on the loop, sockets or zmq contexts left open, zmq file
    descriptors not released.
    """
    await (await asyncio.create_subprocess_exec("true")).wait()
    # pyzmq's first zero-copy send starts a process-wide garbage-collector context (and a socket per
    # sending thread); make one now so that the baseline includes their descriptors.
    warm = zmq.Context()
    a, b = warm.socket(zmq.PAIR), warm.socket(zmq.PAIR)
    a.bind("inproc://warm-up")
    b.connect("inproc://warm-up")
    a.send(np.zeros(1 << 17, np.uint8), copy=False)
    b.recv()
    warm.destroy(linger=0)
    fds_before = _open_fds()
    opened: list[Endpoint] = []

    async def factory(name: str, bind: str = "tcp://127.0.0.1:*", **kwargs: Any) -> Endpoint:
        ep = await Endpoint.open(name, bind, **kwargs)
        opened.append(ep)
        return ep

    yield factory
    for ep in opened:
        await ep.aclose()
    await asyncio.sleep(0.05)
    assert asyncio.all_tasks() == {asyncio.current_task()}, "tasks left pending"
    for ep in opened:
        assert all(r.sock.closed for r in ep._routers) and ep._ctx.closed
    # zmq gives every context and socket an eventfd (its mailbox); count those. (Other kinds are not
    # compared: uvloop keeps a socketpair and /dev/null from each subprocess it spawned.)
    leaked = {fd: what for fd, what in _open_fds().items() if fds_before.get(fd) != what and "eventfd" in what}
    assert not leaked, f"zmq file descriptors leaked: {leaked}"
