"""The ZeroMQ endpoint's names and connections: a name live at one connection, restarted and reconnecting
senders, hellos under a live name (real sockets, real peer processes, bounded waits; both loops)."""

from __future__ import annotations

import asyncio
import os
import select
import time
from typing import Any

import msgpack
import pytest
import zmq

from reactor._errors import PeerLostError
from reactor.transport import encode
from reactor.transport._zmqreceive import hello_message

from ._endpoints import WAIT_S, _line, bind_address, peer_process


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_a_restarted_sender_is_welcomed_by_a_peer_held_while_its_old_connection_closed(
        open_endpoint, tmp_path, transport):
    """Regression: a ROUTER knew each sender by zmq's routing id, which was the sender's name, with no
    handover. A sender's new life whose connect reached a peer held in a long reaction, while the dead
    life's connection was still attached there, was refused by zmq once the peer ran again, and its hello
    was lost with that connection: the try waited out its whole timeout after the peer was free (a
    restarted worker linked to a busy peer up to ~11 s late). So was a try after an earlier try of the
    same endpoint that timed out. zmq names each connection now: the endpoint keeps each name live at one
    connection, welcomes the new life's try once the dead one's connection has closed, and drops the late
    hello of its timed-out try without counting a refusal."""
    release = tmp_path / "release"
    async with peer_process("held", name="rx", bind=bind_address(transport, tmp_path, "rx"),
                            release=str(release)) as rx:
        ctl = await open_endpoint("ctl")
        await ctl.connect("rx", rx.address, timeout_s=WAIT_S)
        async with peer_process("echo", name="tx", parent_name="rx", parent_address=rx.address) as first_life:
            await ctl.send("rx", "hold")
            await _line(rx, lambda m: m == {"holding": True})
            first_life.proc.kill()  # its connection closes while the peer is held
            await first_life.proc.wait()
        tx = await open_endpoint("tx")  # the new life
        with pytest.raises(PeerLostError, match=r"did not answer within 0.5 s"):
            await tx.connect("rx", rx.address, timeout_s=0.5)  # a try while the peer is held
        connecting = asyncio.ensure_future(tx.connect("rx", rx.address, timeout_s=WAIT_S))
        await asyncio.sleep(0.2)
        release.touch()
        await connecting  # the next try, welcomed once the peer runs again
        await tx.send("rx", "hi")
        await _line(rx, lambda m: m == {"from": "tx", "msg": "hi"})
        await ctl.send("rx", "stats")
        assert await _line(rx, lambda m: "hellos_refused" in m) == {"hellos_refused": 0, "dropped": 0}


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_a_sender_that_reconnects_after_a_lingering_disconnect_has_its_earlier_messages_delivered_first(
        open_endpoint, tmp_path, transport):
    """Regression: the hello of a sender's new connection took its name from the closed one as soon as
    zmq had taken in that close, and the closed connection's sender was forgotten with it, while the
    messages it had sent (``disconnect`` lingers to deliver them) were still unread in the ROUTER's queue:
    they were dropped as a stranger's (``dropped_unknown_peer``). The peer's loop is held while they
    arrive, so they are all unread when the new connection's hello is read."""
    release = tmp_path / "release"
    async with peer_process("held", name="rx", bind=bind_address(transport, tmp_path, "rx"),
                            release=str(release)) as rx:
        ctl = await open_endpoint("ctl")
        await ctl.connect("rx", rx.address, timeout_s=WAIT_S)
        tx = await open_endpoint("tx")
        await tx.connect("rx", rx.address, timeout_s=WAIT_S)
        await ctl.send("rx", "hold")
        await _line(rx, lambda m: m == {"holding": True})
        for i in range(20):
            await tx.send("rx", i)
            tx.flush()  # (one zmq message each, so that the hello comes between them)
        tx.disconnect("rx", linger_s=WAIT_S)
        connecting = asyncio.ensure_future(tx.connect("rx", rx.address, timeout_s=WAIT_S))
        await asyncio.sleep(0.3)  # the first connection closes, its messages unread
        release.touch()
        await connecting
        await tx.send("rx", "after")
        got = [(await _line(rx, lambda m: m.get("from") == "tx"))["msg"] for _ in range(21)]
        assert got == [*range(20), "after"]
        await ctl.send("rx", "stats")
        assert await _line(rx, lambda m: "hellos_refused" in m) == {"hellos_refused": 0, "dropped": 0}


@pytest.mark.asyncio
async def test_a_senders_newer_connection_is_welcomed_once_its_older_one_has_closed(open_endpoint):
    """A hello from an endpoint's newer connection (its token, a later number) while its older one is still
    open there (``disconnect`` lingers while the last messages go out, and a ``connect`` again follows) is
    held until that one has closed, then welcomed, and what each sent comes in order. It was refused at
    once, as a thief's: the new link waited out its whole timeout."""
    rx = await open_endpoint("rx")
    ctx = zmq.asyncio.Context()
    token = os.urandom(8)
    try:
        old, new = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (old, new):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(rx.address)
        await old.send_multipart([b"", hello_message("tx", token, 0)])
        assert msgpack.unpackb((await asyncio.wait_for(old.recv_multipart(), WAIT_S))[1])[0] == 2  # welcome
        for i in range(5):
            await old.send_multipart(encode(i))
        await new.send_multipart([b"", hello_message("tx", token, 1)])
        await asyncio.sleep(0.3)
        assert await new.poll(0) == 0  # held while the older connection is open
        old.close()
        assert msgpack.unpackb((await asyncio.wait_for(new.recv_multipart(), WAIT_S))[1])[0] == 2
        await new.send_multipart(encode("after"))
        got: list[tuple[str, Any]] = []
        while len(got) < 6:
            got += await rx.recv_batch(timeout_s=WAIT_S)
        assert got == [("tx", i) for i in [*range(5), "after"]]
        assert rx.statistics().hellos_refused == rx.statistics().dropped == 0
    finally:
        ctx.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_sender_swept_with_its_last_messages_unread_still_has_them_delivered(open_endpoint):
    """Regression: a sweep forgot a sender whose connection zmq said had gone (``EHOSTUNREACH``) while its
    last messages were still unread in the ROUTER's queue: they were dropped as a stranger's. Here a new
    connection's hello takes the closed one's name and fills the table to its sweep, read (the endpoint's
    loop held meanwhile) before the closed connection's messages."""
    rx = await open_endpoint("rx")
    ctx = zmq.Context()
    socks = []
    try:
        def dealer() -> zmq.Socket:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(rx.address)
            socks.append(s)
            return s

        async def welcomed(s: zmq.Socket, name: str) -> None:
            s.send_multipart([b"", hello_message(name, os.urandom(8), 0)])
            async with asyncio.timeout(WAIT_S):
                while not s.poll(0):
                    await asyncio.sleep(0.002)
            s.recv_multipart()

        for i in range(62):  # live senders: the table is swept at 64
            await welcomed(dealer(), f"filler-{i}")
        old = dealer()
        await welcomed(old, "tx")
        new = dealer()
        # The loop is held from here: all of it waits in zmq's queues, the new hello first.
        new.send_multipart([b"", hello_message("tx", os.urandom(8), 0)])
        time.sleep(0.1)
        for i in range(5):
            old.send_multipart(encode(i))
        time.sleep(0.1)
        old.close()
        time.sleep(0.2)
        got: list[tuple[str, Any]] = []
        async with asyncio.timeout(WAIT_S):
            while len(got) < 5:
                got += await rx.recv_batch()
        assert got == [("tx", i) for i in range(5)]
        st = rx.statistics()
        assert st.senders_forgotten >= 1 and st.dropped == 0 and st.hellos_refused == 0
    finally:
        for s in socks:
            s.close()
        ctx.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_hello_refused_at_the_local_socket_leaves_the_other_sockets_wakeup_armed(open_endpoint, tmp_path):
    """A hello at the ipc socket under a name connected at tcp is refused after probing that name's
    connection, which is a send on the tcp ROUTER from within the ipc ROUTER's drain. A send processes
    the ROUTER's pending commands, consuming its FD's wake-up: a message that reached the tcp ROUTER just
    before must still be delivered, not wait unseen while its sender waits on our answer."""

    rx = await open_endpoint("rx", local_bind=f"ipc://{tmp_path}/rx")
    far = await open_endpoint("far")
    await far.connect("rx", rx.address, timeout_s=WAIT_S)
    tcp, ipc = rx._routers
    ctx = zmq.Context()
    impostor = ctx.socket(zmq.DEALER)
    impostor.setsockopt(zmq.LINGER, 0)
    impostor.setsockopt(zmq.ROUTING_ID, b"far")
    impostor.connect(rx.local_address)
    loop = asyncio.get_running_loop()
    drain = rx._drain_router

    sent = []

    def drain_while_far_sends(router: Any) -> None:
        if not sent and router.sock.get(zmq.EVENTS) & zmq.POLLIN:  # the impostor's hello is in
            sent.append(True)  # far's message lands while the ipc drain runs (zmq's I/O thread)
            far.send_nowait("rx", "to answer")
            far.flush()
            deadline = time.monotonic() + WAIT_S
            while not select.select([tcp.fd], [], [], 0)[0]:
                assert time.monotonic() < deadline
                time.sleep(0.001)
        drain(router)

    loop.remove_reader(ipc.fd)
    loop.add_reader(ipc.fd, drain_while_far_sends, ipc)
    try:
        waiting = asyncio.ensure_future(rx.recv_batch(timeout_s=WAIT_S))
        await asyncio.sleep(0.1)  # rx waits in recv_batch, both sockets armed
        impostor.send_multipart([b"", hello_message("far", os.urandom(8), 0)])
        t0 = time.monotonic()
        assert await waiting == [("far", "to answer")]
        assert time.monotonic() - t0 < 5
        assert rx.statistics().hellos_refused == 1
    finally:
        loop.remove_reader(ipc.fd)
        loop.add_reader(ipc.fd, drain, ipc)
        impostor.close()
        ctx.term()
