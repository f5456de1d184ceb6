"""The bulk layer's zmq client (``reactor/transport/_bulkzmq.py``, ``ZmqClient``) with several requests
out at once, against a ROUTER socket the test answers by hand: every reply reaches its own request's
waiter at once, whoever receives it (a waiter holding the socket for a slower reply, or one cancelled
just as it received another's), also when the connection is lost right after the replies came; late,
duplicate and malformed replies are dropped.

Every async test runs on asyncio and uvloop (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import pytest_asyncio
import zmq
import zmq.asyncio

from reactor._errors import PeerLostError
from reactor.transport._bulkzmq import ZmqClient
from reactor.transport.codec import decode, encode


class Owner:
    """A ROUTER standing in for an owner's read server: it collects requests and answers when told."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[tuple[bytes, dict[str, Any]]] = []

    async def collect(self, n: int) -> None:
        while len(self.requests) < n:
            frames = await asyncio.wait_for(self.sock.recv_multipart(copy=False), 10)
            self.requests.append((frames[0].bytes, decode(frames[1:], max_nbytes=1 << 20)))

    async def answer(self, i: int, reply: Any = None) -> None:
        ident, req = self.requests[i]
        out = {"id": req["id"], "ok": True, "x": req.get("x")} if reply is None else reply
        await self.sock.send_multipart([ident, *(encode(out) if not isinstance(out, bytes) else [out])])


@pytest_asyncio.fixture
async def pair():
    ctx = zmq.asyncio.Context()
    owner = Owner(ctx)
    client = ZmqClient(ctx, owner.address, max_reply_nbytes=1 << 20, heartbeat_ivl_s=1.0, heartbeat_timeout_s=5.0)
    yield owner, client
    client.close()
    owner.sock.close(0)
    ctx.term()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_reply_received_by_the_waiter_holding_the_socket_reaches_its_own_waiter_at_once(pair):
    """B's waiter holds the socket for B's reply, which comes 2 s later; A's reply, which came at once,
    reaches A's waiter at once (not when B's comes, nor at A's deadline)."""
    owner, client = pair
    a, b = client.send({"x": "A"}), client.send({"x": "B"})
    await owner.collect(2)
    wait_b = asyncio.ensure_future(client.reply(b, timeout_s=10, what="B"))
    await asyncio.sleep(0.05)
    assert client.lock.locked()  # (B's waiter holds the socket)
    t0 = time.monotonic()
    wait_a = asyncio.ensure_future(client.reply(a, timeout_s=10, what="A"))
    await owner.answer(0)
    assert (await asyncio.wait_for(wait_a, 1.5))["x"] == "A"
    assert time.monotonic() - t0 < 1.5 and not wait_b.done()
    await owner.answer(1)
    assert (await wait_b)["x"] == "B"
    assert not client._waiting and not client.lock.locked()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_waiter_cancelled_just_as_it_received_anothers_reply_still_hands_it_over(pair):
    owner, client = pair
    a, b = client.send({"x": "A"}), client.send({"x": "B"})
    await owner.collect(2)
    receive = client.sock.recv_multipart

    def cancel_b_when_received(*args: Any, **kw: Any) -> Any:  # (in the tick its receive completes)
        got = receive(*args, **kw)
        got.add_done_callback(lambda f: f.cancelled() or wait_b.cancel())
        return got

    client.sock.recv_multipart = cancel_b_when_received
    wait_b = asyncio.ensure_future(client.reply(b, timeout_s=10, what="B"))
    await asyncio.sleep(0.05)
    await owner.answer(0)  # A's reply, received by B's waiter
    with pytest.raises(asyncio.CancelledError):
        await wait_b
    client.sock.recv_multipart = receive
    assert (await client.reply(a, timeout_s=2, what="A"))["x"] == "A"
    assert not client._waiting and not client.lock.locked()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_replies_that_came_before_the_connection_closed_reach_their_waiters(pair):
    """Three requests answered, a fourth not, then the owner's socket closes: the three replies are
    returned, the fourth fails with PeerLostError as soon as the loss is seen (not at its deadline)."""
    owner, client = pair
    ids = [client.send({"x": i}) for i in range(4)]
    await owner.collect(4)
    for i in range(3):
        await owner.answer(i)
    await asyncio.sleep(0.2)  # (the three replies are in the client's queue)
    owner.sock.close(0)
    deadline = time.monotonic() + 10
    while client.lost is None and time.monotonic() < deadline:  # (the monitor's word of the loss)
        client._mon_future()
        await asyncio.sleep(0.01)
    assert client.lost is not None
    assert [(await client.reply(i, timeout_s=5, what="r"))["x"] for i in ids[:3]] == [0, 1, 2]
    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match="was lost"):
        await client.reply(ids[3], timeout_s=5, what="r")
    assert time.monotonic() - t0 < 2 and not client._waiting


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_late_duplicate_and_malformed_replies_are_dropped_and_each_waiter_gets_its_own(pair):
    owner, client = pair
    with pytest.raises(ValueError, match="no request 12345 waits for its reply"):
        await client.reply(12345, timeout_s=5, what="ghost")
    late = client.send({"x": "late"})
    await owner.collect(1)
    with pytest.raises(PeerLostError, match="did not answer late within 0.2 s"):
        await client.reply(late, timeout_s=0.2, what="late")
    a, b = client.send({"x": "A"}), client.send({"x": "B"})
    await owner.collect(3)
    await owner.answer(0)  # the late one's reply: no one waits for it now
    await owner.answer(1, {"id": True, "ok": True, "x": "a bool id"})
    await owner.answer(1, {"id": b, "ok": True, "x": "B first"})
    await owner.answer(1, {"id": b, "ok": True, "x": "B again"})
    await owner.answer(1, [1, 2, 3])
    await owner.answer(1)
    assert (await client.reply(a, timeout_s=5, what="A"))["x"] == "A"
    assert (await client.reply(b, timeout_s=5, what="B"))["x"] == "B first"
    assert not client._waiting


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_request_given_up_on_ends_its_wait_at_once_and_its_reply_is_dropped(pair):
    """forget(id) while a waiter holds the socket for that reply (its owner went silent): the wait
    ends with PeerLostError at once, not at its deadline; the reply, if it comes, is dropped, and the
    next request gets its own."""
    owner, client = pair
    a = client.send({"x": "A"})
    await owner.collect(1)
    wait_a = asyncio.ensure_future(client.reply(a, timeout_s=20, what="A"))
    await asyncio.sleep(0.05)
    assert client.lock.locked()
    t0 = time.monotonic()
    client.forget(a)
    with pytest.raises(PeerLostError, match=f"request {a} was given up on"):
        await wait_a
    assert time.monotonic() - t0 < 1 and not client.lock.locked()
    await owner.answer(0)
    b = client.send({"x": "B"})
    await owner.collect(2)
    await owner.answer(1)
    assert (await client.reply(b, timeout_s=5, what="B"))["x"] == "B" and not client._waiting
