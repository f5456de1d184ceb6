"""The ZeroMQ endpoint: real sockets, real peer processes, OS-picked ports, bounded waits. Names and
connections (hellos, restarts, reconnects): test_endpoint_names.py.

Every async test here runs on both asyncio and uvloop (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
import zmq.asyncio

from reactor._errors import (
    FrameTooLargeError,
    LinkStateError,
    MalformedFrameError,
    PeerLostError,
    PortClosedError,
    WouldBlock,
)
from reactor._floodlog import FloodCounts, flood_logged
from reactor.transport import CurveKeys, Endpoint, codec, encode, link_key
from reactor.transport._zmqreceive import hello_message

from ._endpoints import WAIT_S, _raw_dealer, _say_hello, bind_address, peer_process


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def sample_message(i: int) -> Any:
    kinds = [
        {"i": i, "tag": (i, 0), "port": "obs"},
        {"i": i, "obs": np.full((84, 84), i % 256, np.uint8)},
        {"i": i, "w": torch.full((300,), float(i), dtype=torch.bfloat16), "mask": torch.ones(5, dtype=torch.bool)},
        {"i": i, "nested": [(1, 2.5, "x"), {"b": b"bytes", "n": None}], "small": np.arange(3, dtype=np.float32)},
    ]
    return kinds[i % len(kinds)]


# ------------------------------------------------------------------------------------ across processes


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
async def test_messages_of_every_kind_cross_processes_intact_and_in_order(open_endpoint, tmp_path, transport):
    ep = await open_endpoint("parent", bind_address(transport, tmp_path, "parent"))
    n = 600
    async with peer_process(
        "echo", name="echo", bind=bind_address(transport, tmp_path, "echo"),
        parent_name="parent", parent_address=ep.address,
    ) as peer:
        await ep.connect("echo", peer.address, timeout_s=WAIT_S)

        async def produce() -> None:
            for i in range(n):
                await ep.send("echo", sample_message(i), timeout_s=WAIT_S)

        producer = asyncio.create_task(produce())
        received: list[Any] = []
        while len(received) < n:
            batch = await ep.recv_batch(timeout_s=WAIT_S)
            assert batch, "timed out waiting for echoes"
            assert {sender for sender, _ in batch} == {"echo"}
            received.extend(msg for _, msg in batch)
        await producer
        for i, msg in enumerate(received):
            assert_same(sample_message(i), msg)
        await ep.send("echo", "stop")
        assert await peer.exit_code() == 0
    stats = ep.statistics()
    assert stats.messages_sent == n + 1 and stats.messages_delivered == n
    assert stats.dropped_malformed == stats.dropped_too_large == stats.dropped_over_credit == 0


@pytest.mark.asyncio
async def test_a_producer_far_faster_than_its_consumer_is_held_to_the_credit_window(open_endpoint):
    """Backpressure (issue 2): the consumer's queue never exceeds its credit window, its memory stays
    bounded while 100x the window's worth of data passes, and nothing is lost or reordered."""
    window, n, payload_nbytes = 8, 320, 256 * 1024
    async with peer_process("slow_sink", name="sink", credit_window=window, n=n, delay_s=0.002, max_n=4) as peer:
        ep = await open_endpoint("producer")
        await ep.connect("sink", peer.address, timeout_s=WAIT_S)
        payload = np.ones(payload_nbytes, np.uint8)
        max_outstanding = 0
        for i in range(n):
            await ep.send("sink", {"i": i, "data": payload}, timeout_s=WAIT_S)
            credit_msgs, _ = ep.credit("sink")
            max_outstanding = max(max_outstanding, window - credit_msgs)
        result = await peer.result()
        assert await peer.exit_code() == 0
    assert result["received"] == n and result["in_order"] and result["dropped"] == 0
    assert result["max_queued_messages"] <= window
    assert result["max_queued_nbytes"] <= window * (payload_nbytes + 1024)
    # 80 MiB went through; the consumer's resident memory grew by far less.
    assert result["rss_growth"] < 16 * 2**20, result
    assert max_outstanding == window  # the producer did run out of credit ...
    assert ep.statistics().credit_stalls > 0  # ... and waited for it


@pytest.mark.asyncio
async def test_a_killed_peer_surfaces_as_peer_lost_on_send_and_wait(open_endpoint):
    ep = await open_endpoint("watcher")
    async with peer_process("idle", name="victim", credit_window=2) as peer:
        await ep.connect("victim", peer.address, timeout_s=WAIT_S)
        ep.send_nowait("victim", 1)
        ep.send_nowait("victim", 2)  # credit now exhausted: the idle peer never reads
        blocked_send = asyncio.create_task(ep.send("victim", 3))
        await asyncio.sleep(0)
        assert not blocked_send.done()
        peer.proc.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(ep.wait_peer_lost(), WAIT_S) == "victim"
        with pytest.raises(PeerLostError, match=r"^peer 'victim' was lost: the connection closed"):
            await asyncio.wait_for(blocked_send, WAIT_S)
        assert await peer.exit_code() == -signal.SIGKILL
    assert ep.lost_peers == {"victim"} and ep.peers == frozenset()
    with pytest.raises(PeerLostError, match=r"^peer 'victim' was lost: "):
        ep.send_nowait("victim", 4)


@pytest.mark.asyncio
async def test_curve_link_across_processes_with_a_shared_job_key_pair(open_endpoint, tmp_path):
    keys = CurveKeys.generate()
    keys.save(tmp_path / "job.key")
    ep = await open_endpoint("parent", curve=CurveKeys.load(tmp_path / "job.key"))
    async with peer_process(
        "echo", name="echo", keys=str(tmp_path / "job.key"), parent_name="parent", parent_address=ep.address
    ) as peer:
        await ep.connect("echo", peer.address, server_public_key=keys.public, timeout_s=WAIT_S)
        await ep.send("echo", {"secret": np.arange(5000)})
        [(sender, msg)] = await ep.recv_batch(timeout_s=WAIT_S)
        assert sender == "echo" and np.array_equal(msg["secret"], np.arange(5000))
        await ep.send("echo", "stop")
        assert await peer.exit_code() == 0


# ------------------------------------------------------------------------------------ hostile input


@pytest.mark.asyncio
async def test_garbage_truncated_and_oversized_frames_are_dropped_and_the_endpoint_keeps_serving(open_endpoint, caplog):
    limit = 64 * 1024
    server = await open_endpoint("server", max_message_nbytes=limit)
    ctx = zmq.asyncio.Context()

    def raw_dealer(identity: bytes) -> zmq.asyncio.Socket:
        return _raw_dealer(ctx, server.address, identity)

    async def say_hello(s: zmq.asyncio.Socket, name: str) -> None:
        await s.send_multipart([b"", hello_message(name, os.urandom(8), 0)])
        reply = await asyncio.wait_for(s.recv_multipart(), WAIT_S)
        assert reply[0] == b"" and msgpack.unpackb(reply[1])[0] == 2

    def ext(code: int, payload: Any) -> msgpack.ExtType:
        return msgpack.ExtType(code, msgpack.packb(payload))

    caplog.set_level(logging.WARNING, logger="reactor.transport")
    stranger, raw, huge = raw_dealer(b"stranger"), raw_dealer(b"raw"), raw_dealer(b"huge")
    try:
        await stranger.send_multipart([b"no hello"])
        await say_hello(raw, "raw")
        await say_hello(huge, "huge")
        garbage = [
            [b"\xc1\xc1\xc1"],  # not msgpack
            [msgpack.packb({"a": [1, 2, 3]})[:-2]],  # truncated
            [msgpack.packb(ext(1, ["uint8", [100], 1]))],  # refers to a missing frame
            [msgpack.packb(ext(1, ["float64", [100], 1])), b"x" * 10],  # wrong length
            [msgpack.packb(ext(1, ["object", [1], b"12345678"]))],  # dtype not allowed
            [msgpack.packb(ext(4, ["builtins.eval", ["1"]]))],  # unregistered type
            [msgpack.packb(ext(1, ["uint8", [40000], 1])), b"x" * 40000, b"y" * 40000],  # over the limit
            [b""],  # empty control frame with nothing after it
        ]
        for frames in garbage:
            await raw.send_multipart(frames)
        await huge.send_multipart([msgpack.packb(ext(1, ["uint8", [limit + 1], 1])), b"z" * (limit + 1)])
        await raw.send_multipart([msgpack.packb({"still": "served"})])
        got = await server.recv_batch(timeout_s=WAIT_S)
        assert got == [("raw", {"still": "served"})]
        # And a well-behaved endpoint is served as before.
        client = await open_endpoint("client")
        await client.connect("server", server.address, timeout_s=WAIT_S)
        await client.send("server", {"x": (1, 2)})
        assert await server.recv_batch(timeout_s=WAIT_S) == [("client", {"x": (1, 2)})]
    finally:
        ctx.destroy(linger=0)
    stats = server.statistics()
    assert stats.dropped_unknown_peer == 1
    assert stats.dropped_malformed == 7
    assert stats.dropped_too_large == 1  # the frame over MAXMSGSIZE never reached Python
    assert stats.messages_delivered == 2
    messages = [r.getMessage() for r in caplog.records]
    assert any("'raw'" in m and "not valid msgpack" in m for m in messages)
    assert any("b'stranger'" in m and "did not say hello" in m for m in messages)
    # A drop's reason may quote what the peer sent (a codec error, a message's own check): the line is cut
    # (session 74: a 1 MB header made a 5 MB line), the counters and the flood rule as before.
    caplog.clear()
    server._drop_warning("malformed", "endpoint %r: dropped a message from peer %r: %s", "server", "raw",
                         MalformedFrameError("x" * 1_000_000))
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("endpoint 'server': dropped a message from peer 'raw': xxx") and len(line) < 600, len(line)


@pytest.mark.asyncio
async def test_a_flood_of_dropped_frames_is_counted_whole_and_logged_twenty_times_then_one_in_a_thousand(
        open_endpoint, caplog):
    server = await open_endpoint("server")
    ctx = zmq.asyncio.Context()
    caplog.set_level(logging.WARNING, logger="reactor.transport")
    stranger = _raw_dealer(ctx, server.address, b"stranger")
    try:
        for _ in range(2050):
            await stranger.send_multipart([b"no hello"])
        deadline = time.monotonic() + WAIT_S
        while server.statistics().dropped_unknown_peer < 2050 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    finally:
        ctx.destroy(linger=0)
    assert server.statistics().dropped_unknown_peer == 2050
    lines = [r.getMessage() for r in caplog.records if "did not say hello" in r.getMessage()]
    assert len(lines) == 20 + 2  # the first twenty, the 1,000th and the 2,000th
    assert "so far" not in lines[19] and "2,000 so far" in lines[-1]


def test_flood_counts_keep_a_bounded_table_and_count_new_keys_past_it_together() -> None:
    counts = FloodCounts(max_keys=3)
    assert [counts.hit(k) for k in ("a", "b", "a", "c")] == [1, 1, 2, 1]
    assert [counts.hit(f"new-{i}") for i in range(25)] == list(range(1, 26))  # shared past the bound
    assert not flood_logged(21) and flood_logged(20) and flood_logged(3000)
    assert len(counts.counts) <= 4


def test_flood_counts_never_give_a_place_twice() -> None:
    counts = FloodCounts(max_keys=2)
    assert [counts.hit(k) for k in ("peer", "peer", "other")] == [1, 2, 1]
    lines = sum(flood_logged(counts.hit(f"stranger-{i}")) for i in range(2000) for _ in range(20))
    assert lines == 20 + 40  # new names all share one count: twenty in full, then one in a thousand (of 40,000)
    assert counts.hit("peer") == 3 and len(counts.counts) == 3


@pytest.mark.asyncio
async def test_a_peer_back_under_its_name_after_its_sender_was_forgotten_is_not_logged_in_full_again(
        open_endpoint, caplog):
    """Regression (h3): when a sender's connection had gone, the endpoint's sweep dropped its flood count
    (FloodCounts.forget). A peer that had used up its twenty lines in full and reconnected under its name
    once swept was logged in full twenty times more, each time (and a stranger's new names got twenty each,
    without end). Its count now goes on: 25 refusals, then 5 more after the sweep, are 20 lines."""
    server = await open_endpoint("server", accept=lambda sender, obj: None if isinstance(obj, int) else "not an int")
    ctx = zmq.asyncio.Context()
    caplog.set_level(logging.WARNING, logger="reactor.transport")

    async def refused(n: int, total: int) -> None:
        peer = _raw_dealer(ctx, server.address, b"peer")
        await _say_hello(peer, "peer")
        for _ in range(n):
            await peer.send_multipart([msgpack.packb("bad")])
        deadline = time.monotonic() + WAIT_S
        while server.statistics().dropped_invalid < total and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert server.statistics().dropped_invalid == total
        peer.close(linger=0)

    try:
        await refused(25, 25)
        router = server._routers[0]
        deadline = time.monotonic() + WAIT_S
        i = 0
        while b"peer" in router.senders and time.monotonic() < deadline:  # others come and go: the table is swept
            other = _raw_dealer(ctx, server.address, f"other-{i}".encode())
            await _say_hello(other, f"other-{i}")
            other.close(linger=0)
            i += 1
        assert b"peer" not in router.senders and server.statistics().senders_forgotten > 0
        await refused(5, 30)
    finally:
        ctx.destroy(linger=0)
    lines = [r.getMessage() for r in caplog.records if "refused a message from peer 'peer'" in r.getMessage()]
    assert len(lines) == 20, len(lines)


@pytest.mark.asyncio
async def test_a_garbage_batch_is_dropped_and_logged_with_its_peer_and_the_endpoint_keeps_serving(open_endpoint, caplog):
    """A batch whose structure is bad is dropped whole (logged with the peer); a bad message in a good
    batch is dropped alone, the others delivered; dropped messages' credit goes back to the sender
    (one message of credit per message it announced), and a batch announcing more messages than the
    sender's credit is dropped as over credit."""
    server = await open_endpoint("server", credit_window=8)
    ctx = zmq.asyncio.Context()
    caplog.set_level(logging.WARNING, logger="reactor.transport")
    raw = _raw_dealer(ctx, server.address, b"raw")

    def pack(obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    def ext(code: int, payload: Any) -> msgpack.ExtType:
        return msgpack.ExtType(code, pack(payload))

    truncated = b"\xc1\x92" + pack(1)  # announces 2 messages, holds 1
    array_ref = b"\xc1\x91" + pack(ext(1, ["uint8", [4], 1]))  # refers to an array frame: a batch has none
    unregistered = b"\xc1\x91" + pack(ext(4, ["builtins.eval", ["1"]]))
    try:
        await raw.send_multipart([b"", hello_message("raw", os.urandom(8), 0)])
        reply = await asyncio.wait_for(raw.recv_multipart(), WAIT_S)
        assert msgpack.unpackb(reply[1])[0] == 2  # welcome
        for frames in (
            [b"\xc1"],  # no header: its size in messages is unknown
            [truncated],
            [array_ref],
            [unregistered],
            [codec.encode_batch([pack(i) for i in range(9)])],  # 9 messages, the window is 8
            [codec.encode_batch([pack(1), pack(2)]), b"an array frame"],  # a batch with frames is no message
        ):
            await raw.send_multipart(frames)
        await raw.send_multipart([codec.encode_batch([encode({"still": "served"})[0], encode((1, 2))[0]])])
        assert await server.recv_batch(timeout_s=WAIT_S) == [("raw", {"still": "served"}), ("raw", (1, 2))]
        # The 4 messages of the three decodable-header garbage batches were credited back (half a window).
        grant = await asyncio.wait_for(raw.recv_multipart(), WAIT_S)
        assert msgpack.unpackb(grant[1]) == [3, 4, len(truncated) + len(array_ref) + len(unregistered) - 3 * 2]
        # One bad message among good ones: only it is dropped.
        await raw.send_multipart([codec.encode_batch([encode({"ok": 1})[0], pack(ext(99, 0)), encode({"ok": 2})[0]])])
        assert await server.recv_batch(timeout_s=WAIT_S) == [("raw", {"ok": 1}), ("raw", {"ok": 2})]
        # And a well-behaved endpoint is served as before, its burst batched.
        client = await open_endpoint("client")
        await client.connect("server", server.address, timeout_s=WAIT_S)
        for i in range(5):
            client.send_nowait("server", {"i": (i, 0)})
        got: list[Any] = []
        while len(got) < 5:
            batch = await server.recv_batch(timeout_s=WAIT_S)
            assert batch, "timed out waiting for the client's messages"
            got += batch
        assert got == [("client", {"i": (i, 0)}) for i in range(5)]
    finally:
        ctx.destroy(linger=0)
    stats = server.statistics()
    assert stats.dropped_malformed == 1 + 2 + 1 + 1 + 1 + 1
    assert stats.dropped_over_credit == 9
    assert stats.batches_received == 3 and stats.messages_delivered == 9
    messages = [r.getMessage() for r in caplog.records]
    assert any("'raw'" in m and "dropped a batch from peer" in m and "batch header" in m for m in messages)
    assert any("'raw'" in m and "dropped a batch of 2 messages" in m and "not valid msgpack" in m for m in messages)
    assert any("'raw'" in m and "refers to frame 1" in m for m in messages)
    assert any("dropped 1 of a batch of 3 messages from peer 'raw': message 2 of 3: unknown msgpack extension type 99"
               in m for m in messages)
    assert any("'raw'" in m and "batch of 9 messages" in m and "beyond its credit" in m for m in messages)


# ------------------------------------------------------------------------------------ credit, limits, errors


@pytest.mark.asyncio
async def test_send_nowait_raises_would_block_when_credit_runs_out_and_recovers_after_consumption(open_endpoint):
    rx = await open_endpoint("rx", credit_window=4)
    tx = await open_endpoint("tx")
    await tx.connect("rx", rx.address)
    assert tx.credit("rx")[0] == 4
    for i in range(4):
        tx.send_nowait("rx", i)
    with pytest.raises(WouldBlock, match=r"^no credit to send to peer 'rx': it has not yet consumed"):
        tx.send_nowait("rx", 4)
    got: list[Any] = []
    while len(got) < 4:
        got += [m for _, m in await rx.recv_batch(max_n=3, timeout_s=WAIT_S)]
    assert got == [0, 1, 2, 3]
    await asyncio.wait_for(tx.send("rx", 4), WAIT_S)  # credit came back
    assert [m for _, m in await rx.recv_batch(timeout_s=WAIT_S)] == [4]
    assert rx.statistics().max_queued_messages <= 4
    assert tx.statistics().credit_stalls >= 1


@pytest.mark.asyncio
async def test_small_messages_sent_in_one_tick_travel_batched_in_order_around_messages_with_frames(open_endpoint):
    """Coalescing keeps per-peer order, sends array frames apart (zero-copy), and keeps credit per
    message: once all is consumed the sender holds exactly its initial credit again, bytes included."""
    rx = await open_endpoint("rx")
    tx = await open_endpoint("tx")
    await tx.connect("rx", rx.address)
    initial = tx.credit("rx")
    n = initial[0]

    def message(i: int) -> Any:
        if i == 10:
            return {"i": i, "big": b"b" * 20_000}  # frame-less, but too big to be worth batching
        if i == 25:
            return {"i": i, "x": np.arange(50_000)}  # an array frame: never batched
        return {"i": i, "tag": (i, 0)}

    for i in range(n):  # one tick: no await in between
        tx.send_nowait("rx", message(i))
    assert tx.credit("rx")[0] == 0
    got: list[Any] = []
    while len(got) < n:
        batch = await rx.recv_batch(max_n=8, timeout_s=WAIT_S)  # partial takes of batches
        assert batch, f"timed out after {len(got)} messages"
        got += [m for _, m in batch]
    for i, msg in enumerate(got):
        assert_same(message(i), msg)
    assert got[25]["x"].flags.writeable  # a view of the received frame, not a copy of read-only bytes
    # [0] first of the tick, alone; [1..9] batch; [10] alone; [11..24] batch; [25] frames; [26..] batch.
    assert tx.statistics().batches_sent == rx.statistics().batches_received == 3
    assert rx.statistics().messages_received == n and rx.statistics().bytes_received == tx.statistics().bytes_sent

    # Credit returns in grants of half a window: what the sender lacks is exactly what the receiver
    # has taken but not granted yet, in messages and in bytes (batches split among their messages).
    ungranted = rx._by_name["tx"]
    assert ungranted.queued_msgs == ungranted.queued_nbytes == rx.statistics().queued_nbytes == 0
    expected = (initial[0] - ungranted.ungranted_msgs, initial[1] - ungranted.ungranted_nbytes)
    assert ungranted.ungranted_msgs < n // 2  # (more would have been granted)

    async def credit_settled() -> None:
        while tx.credit("rx") != expected:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(credit_settled(), WAIT_S)


@pytest.mark.asyncio
@pytest.mark.parametrize("flush", [True, False])
async def test_flush_sends_what_the_tick_holds_before_the_sender_yields(open_endpoint, flush):
    """A sender about to compute without awaiting flushes: what it held for the end-of-tick batch
    reaches the peer meanwhile. Without flush, only the tick's first message has left."""
    rx = await open_endpoint("rx")
    tx = await open_endpoint("tx")
    await tx.connect("rx", rx.address)
    for i in range(3):  # one tick: [0] goes at once, [1] and [2] are held
        tx.send_nowait("rx", {"i": i})
    if flush:
        tx.flush()
    time.sleep(0.3)  # "computing": the loop does not run, zmq's I/O threads do
    got = [m["i"] for _, m in await rx.recv_batch(timeout_s=WAIT_S)]
    assert got == ([0, 1, 2] if flush else [0])
    tx.flush()  # sends [1] and [2] if they are still held (no-op after the first flush)
    while len(got) < 3:
        got += [m["i"] for _, m in await rx.recv_batch(timeout_s=WAIT_S)]
    assert got == [0, 1, 2]


@pytest.mark.asyncio
async def test_batches_are_split_to_stay_within_the_peers_message_limit(open_endpoint):
    limit = 2048
    rx = await open_endpoint("rx", max_message_nbytes=limit, credit_window=1000, credit_window_nbytes=2**20)
    tx = await open_endpoint("tx")
    await tx.connect("rx", rx.address)
    n = 300
    for i in range(n):
        tx.send_nowait("rx", {"i": i, "pad": b"p" * 80})
    nbytes = tx.statistics().bytes_sent
    got: list[Any] = []
    while len(got) < n:
        batch = await rx.recv_batch(timeout_s=WAIT_S)
        assert batch, f"timed out after {len(got)} messages"
        got += [m["i"] for _, m in batch]
    assert got == list(range(n))
    stats = rx.statistics()
    # A batch over the limit would have been refused by zmq (MAXMSGSIZE) and the link dropped.
    assert stats.batches_received == tx.statistics().batches_sent >= nbytes // limit
    assert stats.dropped_malformed == stats.dropped_too_large == stats.dropped_over_credit == 0


@pytest.mark.asyncio
async def test_disconnect_delivers_what_was_sent_and_is_not_reported_as_a_loss(open_endpoint):
    rx = await open_endpoint("rx")
    tx = await open_endpoint("tx")
    await tx.connect("rx", rx.address)
    for i in range(5):
        tx.send_nowait("rx", i)
    tx.disconnect("rx")
    got: list[Any] = []
    while len(got) < 5:
        got += [m for _, m in await rx.recv_batch(timeout_s=WAIT_S)]
    assert got == [0, 1, 2, 3, 4]
    assert tx.lost_peers == frozenset()
    with pytest.raises(TimeoutError):
        await tx.wait_peer_lost(timeout_s=0.3)
    with pytest.raises(ValueError, match="not connected to peer 'rx'"):
        tx.send_nowait("rx", 5)
    await tx.connect("rx", rx.address)  # and it can connect again
    tx.send_nowait("rx", 6)
    assert [m for _, m in await rx.recv_batch(timeout_s=WAIT_S)] == [6]


@pytest.mark.asyncio
async def test_send_waiting_for_credit_times_out_with_a_clear_error(open_endpoint):
    rx = await open_endpoint("rx", credit_window=1)
    tx = await open_endpoint("tx")
    await tx.connect("rx", rx.address)
    await tx.send("rx", "fills the window")
    with pytest.raises(TimeoutError, match=r"^no credit from peer 'rx' within 0.05 s: it is not consuming$"):
        await tx.send("rx", "waits", timeout_s=0.05)


@pytest.mark.asyncio
async def test_a_message_over_the_peers_limit_is_refused_by_the_sender(open_endpoint):
    rx = await open_endpoint("rx", max_message_nbytes=1000)
    tx = await open_endpoint("tx")
    await tx.connect("rx", rx.address)
    with pytest.raises(FrameTooLargeError, match=r"^message of \d+ bytes exceeds peer 'rx'\'s limit of 1000 bytes"):
        tx.send_nowait("rx", np.zeros(1000))
    assert tx.credit("rx")[0] == 64  # nothing was spent


@pytest.mark.asyncio
async def test_connecting_to_an_address_where_nobody_answers_raises_peer_lost(open_endpoint, tmp_path):
    ep = await open_endpoint("lonely")
    with pytest.raises(PeerLostError, match=r"^peer 'ghost' at ipc://.* did not answer within 0.2 s"):
        await ep.connect("ghost", f"ipc://{tmp_path}/nobody.sock", timeout_s=0.2)
    assert ep.peers == frozenset()


@pytest.mark.asyncio
@pytest.mark.parametrize("curve_local", [False, True])
async def test_a_local_peer_that_closes_during_the_handshake_is_named_gone_and_curve_only_where_it_may_apply(
        open_endpoint, tmp_path, curve_local):
    """A socket that takes the connection and closes it (a restarted peer killed again at once). A run's
    endpoints (curve_local=False: their local links are plain on both sides) said "or it requires CURVE
    (this link has none; ...)" on every such restart (a chaos run, session 56); an endpoint that may serve
    CURVE locally (the default) still says it may be a mismatch."""
    import socket
    import threading

    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "closer.sock"))
    server.listen(16)

    def close_each() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    ep = await open_endpoint("a", f"ipc://{tmp_path}/a.sock", curve_local=curve_local)
    try:
        with pytest.raises(PeerLostError, match=r"closed during the handshake \(E[A-Z]+\): the peer's process exited "
                                                r"or was killed") as caught:
            await ep.connect("b", f"ipc://{tmp_path}/closer.sock", timeout_s=5)
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
    assert ("CURVE" in str(caught.value)) == curve_local, caught.value


@pytest.mark.asyncio
async def test_a_connect_still_waiting_for_its_welcome_is_not_linked(open_endpoint, tmp_path):
    """A restarted worker retries a peer that did not answer at its start; the coordinator's "restarted" then
    cancels the retry, and its worker asks `linked` whether to connect to the new life. A pending connect
    counted as linked: the worker skipped its connect, the cancelled retry then dropped its link, and the
    shard's next send raised "not connected" (a CI run, session 56: replay-0 "refused the run")."""
    import socket

    server = socket.socket(socket.AF_UNIX)  # takes the connection, never answers zmq's greeting
    server.bind(str(tmp_path / "mute.sock"))
    server.listen(4)
    ep = await open_endpoint("a", f"ipc://{tmp_path}/a.sock", curve_local=False)
    try:
        pending = asyncio.ensure_future(ep.connect("b", f"ipc://{tmp_path}/mute.sock", timeout_s=30))
        await asyncio.sleep(0.3)
        assert not pending.done()
        assert not ep.linked("b")
        ep.disconnect("b", linger_s=0)  # (what the worker does before it connects to the new life)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        assert not ep.linked("b")
    finally:
        server.close()
    b = await open_endpoint("b", f"ipc://{tmp_path}/b.sock")
    await ep.connect("b", b.address)
    assert ep.linked("b")


@pytest.mark.asyncio
async def test_connecting_under_the_wrong_peer_name_is_refused(open_endpoint):
    b = await open_endpoint("b")
    a = await open_endpoint("a")
    with pytest.raises(ValueError, match=r"^connect\('c'\): the endpoint at tcp://127.0.0.1:\d+ is 'b', not 'c'$"):
        await a.connect("c", b.address)
    with pytest.raises(ValueError, match=r"^Endpoint 'a' is not connected to peer 'c'; call connect"):
        a.send_nowait("c", 1)


@pytest.mark.asyncio
async def test_a_link_used_out_of_order_inside_a_run_is_a_failure_with_its_traceback_not_a_refusal(open_endpoint):
    """A send to a peer not connected, or a second connect, raised by reactor's own code is its bug: a
    worker shows the traceback and exits 1. Both were ValueErrors, which a run takes for a refusal of
    what its user gave it (one line, exit 2, "call connect('c', address) first" as the advice)."""
    from reactor._errors import refusal_class

    a = await open_endpoint("a")
    b = await open_endpoint("b")
    with pytest.raises(LinkStateError) as unlinked:
        a.send_nowait("c", 1)
    await a.connect("b", b.address)
    with pytest.raises(LinkStateError, match=r"^Endpoint 'a' is already connected to peer 'b' at ") as twice:
        await a.connect("b", b.address)
    assert isinstance(unlinked.value, ValueError)  # (what callers catching ValueError still get)
    assert refusal_class(unlinked.value) is None and refusal_class(twice.value) is None
    with pytest.raises(ValueError) as bad_argument:
        await Endpoint.open("x", credit_window=0)
    assert refusal_class(bad_argument.value) == "ValueError"  # (a value its caller gave: still a refusal)


@pytest.mark.asyncio
async def test_curve_admits_an_allowed_client_key_and_rejects_another(open_endpoint):
    server_keys, good, bad = CurveKeys.generate(), CurveKeys.generate(), CurveKeys.generate()
    server = await open_endpoint("server", curve=server_keys, curve_clients=[good.public])
    ok = await open_endpoint("ok", curve=good)
    await ok.connect("server", server.address, server_public_key=server_keys.public, timeout_s=WAIT_S)
    await ok.send("server", "hello")
    assert await server.recv_batch(timeout_s=WAIT_S) == [("ok", "hello")]
    intruder = await open_endpoint("intruder", curve=bad)
    with pytest.raises(PeerLostError, match=r"^peer 'server' at .*: it rejected our CURVE key \(ZAP status 400\)$"):
        await intruder.connect("server", server.address, server_public_key=server_keys.public, timeout_s=WAIT_S)
    plain = await open_endpoint("plain")
    with pytest.raises(PeerLostError, match=r"^peer 'server' at .*: .*(it requires|the peer may require) CURVE \(this link has none; check that both sides use CURVE"):
        await plain.connect("server", server.address, timeout_s=WAIT_S)
    assert server.statistics().messages_delivered == 1


@pytest.mark.asyncio
async def test_with_curve_local_off_an_ipc_endpoint_is_plain_and_a_tcp_one_still_requires_the_key(open_endpoint, tmp_path):
    """A run's key pair on every endpoint, ``curve_local=False`` (what the launcher opens): the ipc-bound
    endpoint admits a plain link (its directory is the boundary) and the tcp-bound one admits only
    CURVE clients holding the pair; ``link_key`` picks the key by the address."""
    keys = CurveKeys.generate()
    local = await open_endpoint("local", f"ipc://{tmp_path}/local", curve=keys, curve_local=False)
    remote = await open_endpoint("remote", curve=keys, curve_local=False)
    assert (local.curve_server, remote.curve_server) == (False, True)
    assert link_key(keys, local.address) is None and link_key(keys, remote.address) == keys.public
    assert link_key(None, remote.address) is None
    client = await open_endpoint("client", curve=keys)
    await client.connect("local", local.address, server_public_key=link_key(keys, local.address), timeout_s=WAIT_S)
    await client.connect("remote", remote.address, server_public_key=link_key(keys, remote.address), timeout_s=WAIT_S)
    await client.send("local", "a")
    await client.send("remote", "b")
    assert await local.recv_batch(timeout_s=WAIT_S) == [("client", "a")]
    assert await remote.recv_batch(timeout_s=WAIT_S) == [("client", "b")]
    plain = await open_endpoint("plain")
    await plain.connect("local", local.address, timeout_s=WAIT_S)  # no key: admitted on ipc
    with pytest.raises(PeerLostError, match=r"(it requires|the peer may require) CURVE"):
        await plain.connect("remote", remote.address, timeout_s=WAIT_S)
    with pytest.raises(ValueError, match=r"^Endpoint.open: curve_local must be a bool, got 'no'$"):
        await Endpoint.open("x", curve=keys, curve_local="no")
    # The default stays encrypted on ipc too.
    strict = await open_endpoint("strict", f"ipc://{tmp_path}/strict", curve=keys)
    assert strict.curve_server
    with pytest.raises(PeerLostError, match=r"(it requires|the peer may require) CURVE"):
        await plain.connect("strict", strict.address, timeout_s=WAIT_S)


@pytest.mark.asyncio
async def test_an_endpoint_with_a_local_bind_serves_plain_ipc_and_curve_tcp_with_credit_per_socket(open_endpoint,
                                                                                                   tmp_path):
    """What a worker over hosts opens: tcp (CURVE) for other hosts and a plain ipc ROUTER beside it
    for its own host. Both feed one ``recv_batch``; a plain client is refused on tcp; each sender's
    credit comes back through the socket it came in on, over many windows (a grant sent through
    the other socket finds no route, and that sender would stall)."""
    keys = CurveKeys.generate()
    rx = await open_endpoint("rx", curve=keys, curve_local=False, local_bind=f"ipc://{tmp_path}/rx",
                             credit_window=4)
    assert rx.address.startswith("tcp://") and rx.local_address == f"ipc://{tmp_path}/rx"
    assert rx.curve_server
    near = await open_endpoint("near")
    far = await open_endpoint("far", curve=keys)
    await near.connect("rx", rx.local_address, timeout_s=WAIT_S)
    await far.connect("rx", rx.address, server_public_key=keys.public, timeout_s=WAIT_S)
    assert (near.link_encrypted("rx"), far.link_encrypted("rx")) == (False, True)
    with pytest.raises(PeerLostError, match=r"(it requires|the peer may require) CURVE"):
        await (await open_endpoint("stranger")).connect("rx", rx.address, timeout_s=WAIT_S)
    got: dict[str, list[int]] = {"near": [], "far": []}

    async def send(tx: Endpoint) -> None:
        for i in range(50):  # 12 windows of 4: credit must come back, each time through its socket
            await tx.send("rx", i, timeout_s=WAIT_S)

    senders = asyncio.gather(send(near), send(far))
    while sum(map(len, got.values())) < 100:
        for who, msg in await rx.recv_batch(max_n=3, timeout_s=WAIT_S):
            got[who].append(msg)
    await senders
    assert got == {"near": list(range(50)), "far": list(range(50))}
    stats = rx.statistics()
    assert stats.senders == 2 and stats.dropped == 0 and stats.credit_grants_sent >= 2 * 12
    assert stats.hellos_refused == 0
    with pytest.raises(ValueError, match=r"^Endpoint 'near' is not connected to peer 'x'"):
        near.link_encrypted("x")
    # No handover across the two sockets: while "far" is connected over tcp, a process on the host
    # naming itself "far" at the ipc socket gets no welcome (counted); once far has gone, it may.
    impostor = await open_endpoint("far")
    with pytest.raises(PeerLostError, match=r"did not answer within 0.5 s"):
        await impostor.connect("rx", rx.local_address, timeout_s=0.5)
    assert rx.statistics().hellos_refused == 1
    await far.aclose()
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:  # (until rx's ROUTER has seen far's connection close)
        try:
            await impostor.connect("rx", rx.local_address, timeout_s=0.5)
            break
        except PeerLostError:
            assert asyncio.get_running_loop().time() < deadline, "the name stayed taken after its peer left"
    await impostor.send("rx", "back")
    assert await rx.recv_batch(timeout_s=WAIT_S) == [("far", "back")]
    for bad, bind in (("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"), (f"ipc://{tmp_path}/y", f"ipc://{tmp_path}/z"),
                      (5, "tcp://127.0.0.1:*")):
        with pytest.raises(ValueError, match=r"^Endpoint.open: local_bind must be an ipc:// or inproc:// address "
                                             r"beside a tcp:// bind, got local_bind="):
            await Endpoint.open("y", bind, local_bind=bad)
    # A local address that cannot be bound: refused by name, and nothing is left open (the
    # fixture's check of zmq's file descriptors).
    with pytest.raises(OSError, match=r"^\[Errno 2\] Endpoint 'y' cannot bind 'ipc://.*/no/such/x'"):
        await Endpoint.open("y", local_bind=f"ipc://{tmp_path}/no/such/x")


@pytest.mark.asyncio
async def test_recv_batch_returns_empty_after_its_timeout(open_endpoint):
    ep = await open_endpoint("ep")
    assert await ep.recv_batch(timeout_s=0.01) == []
    assert await ep.recv_batch(timeout_s=0) == []


@pytest.mark.asyncio
async def test_aclose_wakes_a_waiting_receiver_with_port_closed(open_endpoint):
    ep = await open_endpoint("ep")
    waiting = asyncio.create_task(ep.recv_batch())
    await asyncio.sleep(0)
    await ep.aclose()
    with pytest.raises(PortClosedError, match=r"^Endpoint 'ep' is closed$"):
        await asyncio.wait_for(waiting, WAIT_S)
    with pytest.raises(PortClosedError):
        await ep.connect("x", "tcp://127.0.0.1:1")


@pytest.mark.asyncio
async def test_a_restarted_peer_can_be_connected_again_under_the_same_name(open_endpoint):
    tx = await open_endpoint("tx")
    first = await open_endpoint("rx")
    await tx.connect("rx", first.address)
    await first.aclose()
    assert await asyncio.wait_for(tx.wait_peer_lost(), WAIT_S) == "rx"
    second = await open_endpoint("rx")
    await tx.connect("rx", second.address)
    assert tx.lost_peers == frozenset() and tx.peers == {"rx"}
    await tx.send("rx", "again")
    assert await second.recv_batch(timeout_s=WAIT_S) == [("tx", "again")]


@pytest.mark.asyncio
async def test_open_rejects_bad_arguments_and_unbindable_addresses(open_endpoint):
    with pytest.raises(ValueError, match=r"^Endpoint name must be a str of 1..255 UTF-8 bytes"):
        await Endpoint.open("")
    with pytest.raises(ValueError, match=r"^Endpoint.open: credit_window must be an int >= 1, got 0$"):
        await Endpoint.open("x", credit_window=0)
    with pytest.raises(ValueError, match=r"^Endpoint.open: curve_clients needs curve="):
        await Endpoint.open("x", curve_clients=[b"k" * 40])
    taken = await open_endpoint("taken")
    with pytest.raises(OSError, match=r"cannot bind 'tcp://127.0.0.1:\d+': Address already in use"):
        await Endpoint.open("x", taken.address)


# ------------------------------------------------------------------------------------ keys


def test_curve_keys_round_trip_through_files_and_refuse_mismatched_halves(tmp_path):
    keys = CurveKeys.generate()
    keys.save(tmp_path / "k")
    keys.save_public(tmp_path / "k.pub")
    assert CurveKeys.load(tmp_path / "k") == keys
    assert CurveKeys.load_public(tmp_path / "k.pub") == keys.public
    assert oct((tmp_path / "k").stat().st_mode & 0o777) == "0o600"
    assert "secret=<hidden>" in repr(keys) and keys.secret.decode() not in repr(keys)
    with pytest.raises(FileExistsError):
        keys.save(tmp_path / "k")
    with pytest.raises(ValueError, match=r"a key pair file needs 'public = \.\.\.' and 'secret = \.\.\.' lines$"):
        CurveKeys.load(tmp_path / "k.pub")
    with pytest.raises(ValueError, match=r"^CurveKeys.public does not belong to CurveKeys.secret"):
        CurveKeys(public=CurveKeys.generate().public, secret=keys.secret)
