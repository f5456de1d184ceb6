"""One-sided sampling from replay shards on other hosts (issue 21): ``ReplayClient.asample_now`` asks each
such shard's bulk read server once to draw its count from the state the shard publishes; draws ahead
keep those requests out while a learner updates; a sample may mix shards of this host and of others.

Every shard here is a real one behind a real read server (zmq sockets; runs in their own processes
where a test runs an app). The helpers are the same-host tests' (``test_replay_onesided.py``).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.nodes.test_replay_onesided import (
    _OWNED,
    _check_windows,
    _client_of,
    _close,
    _items,
    _probe,
    _served_shard,
)


@pytest.mark.timeout(120)
def test_a_learner_on_another_host_samples_in_one_round_trip_to_the_shards_read_servers(tmp_path):
    """Shards in their own processes offer their read servers' sample op to a learner "on another
    host" (no shared memory, remote_reads='zmq'): each batch is one request per shard, drawn by the
    server thread from the published tree; every window is its episode's slice, each probability is
    the one it was drawn with (the shard's share of the cached masses times its probability there:
    on unchanged data, w_i / M), and the shards count every draw."""
    from tests.apps.onesided_app import priority

    rec = _probe(tmp_path, "processes", batches=20, batch_size=64, remote=True)
    assert bool(rec["offered"]) and int(rec["one_sided"]) == 20 and int(rec["fallbacks"]) == 0
    assert len(rec["keys"]) == 20 * 64 and int(rec["dropped"]) == 0
    _check_windows(rec, 8)
    ids, _ = _items(2, 40)
    keys = rec["keys"]
    item_ids = (keys >> 48) * 1_000_000 + (keys & ((1 << 48) - 1))
    w = priority(ids) ** 0.7
    np.testing.assert_allclose(rec["probs"], priority(item_ids) ** 0.7 / w.sum(), rtol=1e-12)
    np.testing.assert_allclose(rec["weights"], (rec["probs"] / (w.min() / w.sum())) ** -0.5, rtol=1e-6)
    assert int(rec["sampled"].sum()) == int(rec["draws"])


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_read_servers_sample_op_refuses_malformed_requests_and_keeps_serving(tmp_path):
    """Requests from the network: a bad n or seed is answered with an error naming it; the server
    thread survives every one and the next good request is served."""
    import torch

    from reactor.nodes.replay import REMOTE_SAMPLE_OP
    from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table, WindowRead
    from reactor.replay.shared import SamplingPublisher, SharedArrays, SharedSampling, serve_sample
    from reactor.transport.bulk import BulkOwner, BulkReader

    owner = await BulkOwner.open("sampleop", backends=["zmq"], zmq_bind=f"ipc://{tmp_path}/s.sock")
    reader = await BulkReader.open()
    try:
        arrays = SharedArrays(lambda name, nb: np.zeros(nb, np.uint8))
        st = Storage([FieldSpec("id", (), torch.int64)], 256, allocator=owner.allocator("r"), index_arrays=arrays)
        table = Table(st, sampler=Prioritized(), remover=Fifo(), rate_limiter=MinSize(1), arrays=arrays)
        pub = SamplingPublisher(table, arrays, read=WindowRead(4))
        pub.begin()
        table.insert_nowait({"id": torch.arange(100)}, np.ones(100), episode_end=np.arange(100) % 10 == 9)
        pub.end()
        ss = SharedSampling(pub.descriptor(), {n: arrays.get(n) for n in arrays.layout()})
        fields = [("id", 8, st._fields["id"].data_ptr())]
        owner.serve_op(REMOTE_SAMPLE_OP, lambda req, _t: serve_sample(ss, req, fields, 1000))
        region = await reader.attach(owner.descriptor("r"), backend="zmq")
        for bad, why in (({"n": -1, "seed": 1}, r"n must be an int in \[0, 1000\], got -1"),
                         ({"n": 10**9, "seed": 1}, r"n must be an int in \[0, 1000\]"),
                         ({"n": "8", "seed": 1}, r"n must be an int"), ({"n": 8}, r"seed must be an int"),
                         ({"n": 8, "seed": -5}, r"seed must be an int in \[0, 2\*\*64\)")):
            with pytest.raises(ValueError, match=why):
                await reader.call(region, REMOTE_SAMPLE_OP, bad)
        rep = await reader.call(region, REMOTE_SAMPLE_OP, {"n": 8, "seed": 3})
        assert rep["n"] == 8 and rep["valid"].all() and rep["size"] == 100
        ids = rep["data"][0].view(np.int64).reshape(8, 4)
        np.testing.assert_array_equal(ids[:, 0], rep["keys"])  # each window starts at its item
        with pytest.raises(ValueError, match=r"^bulk owner: op 'read' is built in or served already$"):
            owner.serve_op("read", lambda req, t: {})
    finally:
        await reader.aclose()
        await owner.aclose()



@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_when_one_read_server_fails_a_sample_the_shards_that_drew_are_still_told(tmp_path):
    """A one-sided sample over two remote shards where shard 1's server answers malformed: the batch
    is dropped with an error naming shard 1, and the error carries the notice of shard 0's draw (its
    times sampled and rate limiter count must not lose it); the learner sends such notices."""
    from reactor._errors import MalformedFrameError
    from reactor.nodes.messages import SampledKeys

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, bad=k == 1) for k in range(2)]
        client = await _client_of(shards)
        assert client.can_sample_one_sided and not client.can_sample_now
        with pytest.raises(MalformedFrameError, match="replay shard 1's read server sent a malformed sample reply") as e:
            await client.asample_now(64)
        (notice,) = e.value.notices
        assert isinstance(notice, SampledKeys) and notice.shard == 0 and len(notice.keys) > 0
        assert (np.asarray(notice.keys) >> 48 == 0).all()  # shard 0's keys only
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize(("spoil", "why"), [
    (lambda rep: {**rep, "probabilities": np.full_like(rep["probabilities"], np.nan)}, "probability nan is not in (0, 1]"),
    (lambda rep: {**rep, "probabilities": rep["probabilities"] * 1e3}, "is not in (0, 1]"),
    (lambda rep: {**rep, "keys": -1 - rep["keys"]}, "a key is outside [0, 2**48)"),
    (lambda rep: {**rep, "mass": -5.0}, "its mass -5.0 is not a finite number > 0 (it drew items)"),
    (lambda rep: {**rep, "min": float("nan")}, "its min_mass nan is not a number > 0"),
])
async def test_a_read_servers_reply_with_bad_figures_or_items_is_malformed_and_none_of_it_is_kept(tmp_path, spoil, why):
    """Regression (hostile probe): a read server's reply was checked for its arrays' shapes only; a NaN or
    out-of-range probability made NaN weights, a negative key a key of another shard (the learner's
    priority update then raised), and its figures were cached as they came (a negative mass made the
    next sample's multinomial raise in the learner). Such a reply fails the sample like any malformed
    one (the learner falls back to messages), and its figures are not kept."""
    import re

    from reactor._errors import MalformedFrameError

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, spoil=spoil if k == 1 else None) for k in range(2)]
        client = await _client_of(shards)
        kept = client._figures[1]
        with pytest.raises(MalformedFrameError, match=r"^replay shard 1's read server sent a malformed sample reply: "
                                                       rf".*{re.escape(why)}$"):
            await client.asample_now(64)
        if why.startswith("its"):
            assert client._figures[1] is kept
        assert client.request(64)  # (the counts of the next sample come from figures that make sense)
    finally:
        await _close([client], shards)


async def _served_by(shards, at_least: list[int]) -> list[int]:
    """Wait (bounded) until each shard's read server has served ``at_least`` requests; their counts."""
    deadline = asyncio.get_running_loop().time() + 30
    while (any(o._server.served < n for (o, _d, _f), n in zip(shards, at_least))
           and asyncio.get_running_loop().time() < deadline):
        await asyncio.sleep(0.005)
    return [o._server.served for o, _d, _f in shards]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_draws_ahead_from_shards_of_another_host_are_drawn_by_their_servers_before_they_are_taken(tmp_path):
    """Two shards of another host: draw_ahead(40, 3) sends three samples' requests at once, and both
    read servers draw and send all three while nothing awaits them. 50 takes (each topping the draws
    up to 3 again) and the drain of the 2 left give 52 whole batches of the shards' keys, and their
    notices hold every key of every batch once. A blocking take of such draws is refused."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k) for k in range(2)]
        client = await _client_of(shards, notice_every=7)
        assert client.can_sample_one_sided and not client.can_sample_now
        before = [o._server.served for o, _d, _f in shards]
        assert client.draw_ahead(40, 3) == 3 and client.drawn_ahead == 3
        assert await _served_by(shards, [n + 3 for n in before]) == [n + 3 for n in before]
        with pytest.raises(RuntimeError, match="shards of other hosts.*next_drawn"):
            client.take_drawn()
        keys, told = [], []
        for _ in range(50):
            assert client.draw_ahead(40, 3) == 3
            batch, notices = await client.next_drawn()
            assert batch is not None and len(batch.keys) == 40
            local = batch.keys.numpy() & 0xFFFF_FFFF_FFFF
            assert set(local.tolist()) <= set(range(100))
            np.testing.assert_array_equal(batch.data["id"].numpy()[:, 0], local)  # its window's first row
            keys.append(batch.keys.numpy().copy())
            told += notices
        for r in await client.adrain_drawn():  # the 2 still out
            assert not isinstance(r, BaseException) and r[0] is not None
            keys.append(r[0].keys.numpy().copy())
            told += r[1]
        told += client.take_notices()
        assert client.drawn_ahead == 0 and client.ahead_samples == 52 and client.one_sided_samples == 52
        assert len(keys) == 52 and {int(k) for k in np.unique(np.concatenate(keys) >> 48)} == {0, 1}
        np.testing.assert_array_equal(np.sort(np.concatenate([np.asarray(m.keys) for m in told])),
                                      np.sort(np.concatenate(keys)))
        assert not any(c._waiting for c in client._reader._clients.values())  # (nothing left waiting)
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_lost_while_draws_from_other_hosts_are_out_drops_their_batches_and_holds_the_others_notices(
        tmp_path):
    """Three draws out over two shards of another host, the oldest finished but not taken (its take was
    cancelled) and two waiting for replies, when shard 1 is lost: the finished one is dropped at once
    (what shard 0 drew for it is held for shard 0), the two others as their takes come: no batch,
    shard 1's parts told to no one, shard 0's handed over as notices. The next draws come from shard
    0 alone."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k) for k in range(2)]
        client = await _client_of(shards, notice_every=1000)
        assert client.draw_ahead(40, 3) == 3
        take = asyncio.ensure_future(client.next_drawn())
        await asyncio.sleep(0)
        take.cancel()
        with pytest.raises(asyncio.CancelledError):
            await take
        oldest = client._remote_ahead[0]
        await asyncio.wait_for(asyncio.shield(oldest.task), 30)  # finished, not taken
        assert client.drawn_ahead == 3
        client.shard_lost(1, "test")
        assert client.drawn_ahead == 2  # (the finished one: dropped now; the others when taken)
        told = []
        for _ in range(2):
            batch, notices = await client.next_drawn()
            assert batch is None
            told += notices
        told += client.take_notices()
        assert {m.shard for m in told} == {0}
        keys = np.concatenate([np.asarray(m.keys) for m in told])
        assert (keys >> 48 == 0).all() and 0 < len(keys) < 3 * 40
        client.draw_ahead(40, 1)
        batch, _notices = await client.next_drawn()
        assert set(np.unique(batch.keys.numpy() >> 48).tolist()) == {0} and len(batch.keys) == 40
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_lost_with_no_count_in_draws_from_other_hosts_still_ends_them_with_the_others_notices(tmp_path):
    """Three shards of another host, shard 2 with no mass (a count of 0 in every draw, its share still
    in every probability): lost while two draws are out, each take gives no batch and hands over
    the notices of what shards 0 and 1 drew for it, 40 keys a draw (found by a review: the draw's
    finish looked shard 2 up and raised KeyError, and those notices were lost)."""
    from reactor.nodes.messages import ShardMass

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k) for k in range(3)]
        client = await _client_of(shards, notice_every=1000)
        client._figures[2] = ShardMass(2, 0, 0, "", 0.0, 0.0, 100, 0.4)
        assert client.draw_ahead(40, 2) == 2
        client.shard_lost(2, "test")
        for _ in range(2):
            batch, notices = await client.next_drawn()
            assert batch is None and {m.shard for m in notices} <= {0, 1}
            assert sum(len(m.keys) for m in notices) == 40
        assert client.drawn_ahead == 0
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_draws_from_other_hosts_out_when_a_shards_offer_is_dropped_finish_with_its_part_and_notices(tmp_path):
    """Three draws out over two shards of another host when shard 1's offer is dropped
    (drop_one_sided, as on a malformed reply of its server): shard 1 is alive and its server has drawn
    or draws their parts, so the three take whole batches of both shards, and their notices hold
    every key of them, shard 1's too (as the draws on threads already queued finish on the offer
    they began with); no draw starts after. Before, each take raised KeyError (the offer, looked up
    at the finish, was gone): no batch, and what shard 1's server drew was told to no one (h26)."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k) for k in range(2)]
        client = await _client_of(shards, notice_every=1000)
        assert client.draw_ahead(40, 3) == 3
        client.drop_one_sided(1)
        keys, told = [], []
        for _ in range(3):
            batch, notices = await client.next_drawn()
            assert batch is not None and len(batch.keys) == 40
            keys.append(batch.keys.numpy().copy())
            told += notices
        told += client.take_notices()
        assert {int(k) for k in np.unique(np.concatenate(keys) >> 48)} == {0, 1}
        np.testing.assert_array_equal(np.sort(np.concatenate([np.asarray(m.keys) for m in told])),
                                      np.sort(np.concatenate(keys)))
        assert not client.can_sample_one_sided and client.draw_ahead(40, 3) == 0
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("waiting", [False, True], ids=["before-the-take", "while-the-take-waits"])
async def test_a_draw_from_other_hosts_does_not_wait_for_the_reply_of_a_shard_lost_meanwhile(tmp_path, waiting):
    """Shard 1's read server hangs (its host went silent) with a draw out; shard 1 is lost before the
    take, or while the take waits for its reply: the take ends at once, without the batch and with
    shard 0's notices, instead of waiting for shard 1's reply (its connection's loss, or the reader's
    timeout); the reply that comes later is dropped."""
    import threading

    from reactor.nodes.replay import REMOTE_SAMPLE_OP

    shards, client, go = [], None, threading.Event()
    try:
        shards = [await _served_shard(tmp_path, k) for k in range(2)]
        ops = shards[1][0]._server.extra_ops
        serve = ops[REMOTE_SAMPLE_OP]
        ops[REMOTE_SAMPLE_OP] = lambda req, region: (go.wait(30), serve(req, region))[1]
        client = await _client_of(shards, notice_every=1000)
        served = shards[0][0]._server.served
        assert client.draw_ahead(40, 1) == 1
        take = None
        if waiting:  # the take has shard 0's reply and waits for shard 1's
            take = asyncio.ensure_future(client.next_drawn())
            await _served_by(shards[:1], [served + 1])
            await asyncio.sleep(0.3)
            assert not take.done()
        t0 = asyncio.get_running_loop().time()
        client.shard_lost(1, "test")
        batch, notices = await asyncio.wait_for(take or client.next_drawn(), 5)
        assert asyncio.get_running_loop().time() - t0 < 2
        assert batch is None and {m.shard for m in notices} == {0} and 0 < len(notices[0].keys) < 40
        go.set()
        await asyncio.sleep(0.2)  # (shard 1's late reply arrives, and is dropped)
        assert not any(c._waiting for c in client._reader._clients.values())
    finally:
        go.set()
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_takes_of_draws_from_other_hosts_get_each_draw_once_and_a_cancelled_take_leaves_it(tmp_path):
    """Draws from shards of another host, as the draws on threads: two takes waiting at once get the
    draw and (None, []); a take cancelled in the tick its draw finishes leaves it to the next take;
    close() under a waiting take ends it with (None, [])."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k) for k in range(2)]
        client = await _client_of(shards, notice_every=1)
        client.draw_ahead(40, 1)
        first, second = asyncio.ensure_future(client.next_drawn()), asyncio.ensure_future(client.next_drawn())
        (batch, notices), (none, nothing) = await first, await second
        assert batch is not None and len(batch.keys) == 40 and sum(len(m.keys) for m in notices) == 40
        assert none is None and nothing == [] and client.ahead_samples == 1
        client.draw_ahead(40, 1)
        take = asyncio.ensure_future(client.next_drawn())
        await asyncio.sleep(0)
        draw = client._remote_ahead[0]
        draw.task.add_done_callback(lambda _t: take.cancel())  # (cancelled in the tick the draw finishes)
        with pytest.raises(asyncio.CancelledError):
            await take
        assert draw.task.done() and client.drawn_ahead == 1
        batch, notices = await client.next_drawn()
        assert batch is not None and len(batch.keys) == 40 and sum(len(m.keys) for m in notices) == 40
        client.draw_ahead(40, 1)
        take = asyncio.ensure_future(client.next_drawn())
        await asyncio.sleep(0)
        client.close()
        assert await take == (None, [])
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_sample_over_a_shard_on_this_host_and_one_on_another_takes_each_part_its_own_way(tmp_path):
    """Shard 0 on this host (its memory mapped: drawn here), shard 1 on "another host" (drawn by its read
    server): one batch with both shards' items, each window its episode's steps from the item on, each
    item's probability (share of its shard) x (its priority over the shard's mass), and one notice
    per shard, held by the client until it is asked for it."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, 0, shm=True), await _served_shard(tmp_path, 1)]
        client = await _client_of(shards)
        assert client.can_sample_one_sided and not client.can_sample_now
        assert 0 in client._shared and 1 in client._remote_shared
        n = 400
        batch, notices = await client.asample_now(n)
        assert batch is not None and len(batch.keys) == n
        keys = batch.keys.numpy()
        shard_of, local = keys >> 48, keys & ((1 << 48) - 1)
        assert set(shard_of.tolist()) == {0, 1} and 120 < (shard_of == 0).sum() < 280  # ~even shares
        ids, mask = batch.data["id"].numpy(), batch.data["mask"].numpy()
        t = np.arange(4)
        want_mask = t[None, :] < np.minimum(4, 10 - local % 10)[:, None]
        np.testing.assert_array_equal(mask, want_mask)
        np.testing.assert_array_equal(ids, np.where(want_mask, local[:, None] + t, 0))
        from reactor.replay import Prioritized

        w = (1.0 + np.arange(100) % 3) ** Prioritized().alpha  # each item's weight in its shard's tree
        np.testing.assert_allclose(batch.probabilities.numpy(), 0.5 * w[local] / w.sum())
        assert notices == []  # held: the client tells the shards every notice_every samples
        notices = client.take_notices()
        assert sorted(m.shard for m in notices) == [0, 1]
        np.testing.assert_array_equal(np.concatenate([m.keys for m in notices]), keys)  # (grouped by shard)
        assert client.one_sided_samples == 1
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_an_error_class_a_read_server_answers_with_is_one_the_learner_falls_back_on(tmp_path):
    """A read server that answers a sample with an error (a TypeError here, as a handler's check would
    send): the client raises it, with the other shard's notice, and it is one of ONE_SIDED_ERRORS,
    the errors on which a learner falls back to messages; no answer of a peer may end the run."""
    from reactor.nodes.replay_client import ONE_SIDED_ERRORS
    from reactor.transport._bulkzmq import _ERRORS

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k) for k in range(2)]

        def refuse(req, _t):
            raise TypeError("sample request: this server refuses")

        shards[1][0]._server.extra_ops["replay_sample"] = lambda req, region: refuse(req, None)
        client = await _client_of(shards)
        with pytest.raises(TypeError, match="this server refuses") as e:
            await client.asample_now(64)
        assert isinstance(e.value, ONE_SIDED_ERRORS) and [m.shard for m in e.value.notices] == [0]
        assert all(issubclass(cls, ONE_SIDED_ERRORS) for cls in _ERRORS.values())  # every class a server may answer
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_mixed_sample_whose_remote_part_is_refused_by_its_limiter_takes_nothing_here(tmp_path):
    """The read server's shard allows no sample now (its budget's count at its bound): the sample
    goes to messages, and the shard of this host in the same sample neither counts nor draws
    anything (its part would have been dropped with the batch)."""
    shards = [await _served_shard(tmp_path, 60, shm=True), await _served_shard(tmp_path, 61)]
    client = await _client_of(shards)
    try:
        local, remote = (_OWNED[owner][1].budget for owner, *_ in shards)
        remote[1] = int(remote[0])  # allowed = taken: nothing more until an insert
        for _ in range(3):
            before = int(local[0])
            batch, notices = await client.asample_now(64)
            assert batch is None and notices == [] and int(local[0]) == before
        remote[1] = int(remote[0]) + 1000
        batch, _ = await client.asample_now(64)
        assert batch is not None and int(local[0]) > before
    finally:
        await _close([client], shards)


#: Words another process writes into a shard's published sampling state, its count left settled (as the
#: host path's tests do: tests/nodes/test_replay_onesided.py): the array, its dtype, the words (None: the
#: sum tree's leaves), the value ("neg": negated), and how the error says it.
_SETTLED_SPOILS = {
    "first step below 0": ("header", "int64", (1, 2), "-1", "settled"),
    "leaves negative": ("sums", "float64", None, "neg", "settled"),
    "mass inf": ("sums", "float64", (0, 1), "inf", "inf"),
    "mass nan": ("sums", "float64", (0, 1), "nan", "nan"),
    "mass negative": ("sums", "float64", (0, 1), "-5.0", "-5.0"),
}


def _spoil_settled(shard, k: int, spoil: str) -> tuple[str, dict]:
    """Spoil served shard ``k``'s published state (``_served_shard(..., shm=True)``'s) from another
    process as ``_SETTLED_SPOILS[spoil]`` says; returns what the error says after "is inconsistent" and
    the arrays as they were (to put back)."""
    import os
    import re

    from reactor.replay.sumtree import _layout
    from tests.nodes.test_replay_onesided import _spoil

    table, pub = _OWNED[shard[0]]
    field, dtype, words, value, shown = _SETTLED_SPOILS[spoil]
    saved = {n: pub.arrays.get(n).copy() for n in ("header", "sums")}
    if words is None:
        offsets, _ = _layout(table.storage.capacity, table._sampler.arity)
        words = (int(offsets[-2]), int(offsets[-1]))
    _spoil(f"mixed{os.getpid()}x{k}", f"-s-r{k}", field, dtype, *words, value)
    assert pub.header[0] % 2 == 0  # (settled)
    why = (r" under a settled sequence count \d+ \(an index or a probability out of range\)" if shown == "settled"
           else rf": its mass {re.escape(shown)} is not a finite number >= 0")
    return why, saved


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spoil", list(_SETTLED_SPOILS))
async def test_a_corrupt_settled_state_of_a_mixed_samples_shard_of_this_host_raises_naming_it(tmp_path, spoil):
    """A sample over shard 0 of this host (drawn from its memory) and shard 1 of another (drawn by its
    read server), when another process has spoiled shard 0's published state, its count left settled:
    asample_now, and a draw ahead taken with next_drawn, raise MalformedFrameError naming shard 0, as the
    host path does (``shard`` 0, ``offer`` its offer: what drop_one_sided drops; ``notices``: shard 1's
    part, which its server drew). Before, the local part's draw gave up after its patience or took the
    mass for "nothing to draw": no batch, without a word, at every sample (h26's open item). The state
    put back, the next sample draws."""
    from reactor._errors import MalformedFrameError

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, 0, shm=True), await _served_shard(tmp_path, 1)]
        client = await _client_of(shards, notice_every=1000)
        assert client.can_sample_one_sided and not client.can_sample_now
        assert (await client.asample_now(64))[0] is not None
        client.take_notices()
        why, saved = _spoil_settled(shards[0], 0, spoil)
        for _ in range(2):
            with pytest.raises(MalformedFrameError, match=rf"^replay shard 0: its published sampling state \(region "
                               rf"'-s-r0'\) is inconsistent{why}: corrupt shared memory; sample through messages$") as e:
                await client.asample_now(64)
            assert e.value.shard == 0 and e.value.offer is client._shared[0]
            (told,) = e.value.notices  # shard 1's part, drawn by its server before shard 0's
            assert told.shard == 1 and 0 < len(told.keys) < 64 and (np.asarray(told.keys) >> 48 == 1).all()
        assert client.draw_ahead(64, 2) == 2
        for _ in range(2):
            with pytest.raises(MalformedFrameError, match=r"^replay shard 0: ") as e:
                await client.next_drawn()
            assert e.value.shard == 0
        assert client.drawn_ahead == 0
        for n, a in saved.items():
            _OWNED[shards[0][0]][1].arrays.get(n)[:] = a
        assert (await client.asample_now(64))[0] is not None
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spoil", list(_SETTLED_SPOILS))
async def test_a_read_server_drawing_from_a_corrupt_settled_state_of_its_shard_answers_an_error_naming_it(
        tmp_path, spoil):
    """Shard 1 of another host, its published state spoiled by another process of its host (its count
    left settled): its read server answers the sample with a MalformedFrameError naming the corruption,
    and asample_now (and a draw ahead) raises it naming shard 1 (``shard`` 1, ``offer`` its offer:
    what drop_one_sided drops; ``notices``: shard 0's part, which its server drew). The server keeps
    serving: the state put back, the next sample draws. Before, the server's draw gave up after its
    patience and answered "nothing drawn" (n=0), which the client took for nothing to draw: no batch,
    without a word, at every sample (an inf mass the same; a NaN or negative mass was refused only by
    the client's check of the reply's figures)."""
    from reactor._errors import MalformedFrameError

    shards, client = [], None
    try:
        owner, desc, offer = await _served_shard(tmp_path, 1, shm=True)  # (its state in shared memory: spoilable)
        shards = [await _served_shard(tmp_path, 0),
                  (owner, {**desc, "host": "another-host"}, {n: v for n, v in offer.items() if n != "region"})]
        client = await _client_of(shards, notice_every=1000)
        assert set(client._remote_shared) == {0, 1} and not client._shared
        assert (await client.asample_now(64))[0] is not None
        client.take_notices()
        why, saved = _spoil_settled(shards[1], 1, spoil)
        served = owner._server.served
        for _ in range(2):
            with pytest.raises(MalformedFrameError, match=rf"^replay shard 1's read server: its published sampling "
                               rf"state is inconsistent{why}: corrupt shared memory; sample through messages$") as e:
                await client.asample_now(64)
            assert e.value.shard == 1 and e.value.offer is client._remote_shared[1]
            (told,) = e.value.notices
            assert told.shard == 0 and 0 < len(told.keys) < 64 and (np.asarray(told.keys) >> 48 == 0).all()
        assert client.draw_ahead(64, 2) == 2
        for _ in range(2):
            with pytest.raises(MalformedFrameError, match=r"^replay shard 1's read server: ") as e:
                await client.next_drawn()
            assert e.value.shard == 1
        assert owner._server.refused >= 4 and owner._server.served == served  # (answered, each an error)
        for n, a in saved.items():
            _OWNED[owner][1].arrays.get(n)[:] = a
        assert (await client.asample_now(64))[0] is not None
    finally:
        await _close([client], shards)


@pytest.mark.timeout(120)
def test_a_replay_shards_read_server_answers_a_sample_from_its_corrupt_state_with_an_error_and_says_so(tmp_path,
                                                                                                       caplog):
    """Real Replay shards with read servers, a prober sampling them as from another host: after one batch
    the prober writes -1 over shard 1's first stored step in its published state (its count left
    settled). Its next sample raises MalformedFrameError naming shard 1 (``shard`` 1: a learner drops
    that offer), from the shard's read server's answer, and the shard logs what it refused. Before, the
    server answered "nothing drawn" and the sample returned no batch, without a word."""
    import logging

    from reactor import run
    from reactor.launch._app import build_graph
    from tests.nodes.test_replay_onesided import APP

    out = tmp_path / "probe.npz"
    cfg = {"out": str(out), "remote": True, "spoil_shard": 1, "batch_size": 64}
    with caplog.at_level(logging.WARNING):
        run(build_graph(APP, cfg), app=APP, config=cfg, placement="single", deterministic=False)
    with np.load(out) as f:
        assert bool(f["before"])
        spoiled = str(f["spoiled"])
    assert spoiled.startswith("MalformedFrameError|1|replay shard 1's read server: its published sampling state is "
                              "inconsistent under a settled sequence count "), spoiled
    said = [r.getMessage() for r in caplog.records if "refused a one-sided sample" in r.getMessage()]
    assert said and said[0].startswith("replay[1]: refused a one-sided sample of a requester on another host: its "
                                       "published sampling state is inconsistent under a settled sequence count "), said
