"""One-sided sampling from replay shards on the same host (issue 21): ``ReplayClient.sample_now`` draws
from the shards' published sum trees and episode index in shared memory, plans and copies the windows
itself, with no message on the sampling path, and gets a single table's distribution and weights.

Every run here is a real one: Replay shard reactors (their own processes under ``processes``), a filler
that writes known episodes, a prober that samples (``tests/apps/onesided_app.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from pathlib import Path

import numpy as np
import pytest

from reactor import run
from reactor.launch._app import build_graph
from reactor.nodes import _onesided

APP = str(Path(__file__).resolve().parents[1] / "apps" / "onesided_app.py")


def _probe(tmp_path: Path, placement: str = "single", **cfg) -> dict:
    cfg = {"out": str(tmp_path / "probe.npz"), **cfg}
    run(build_graph(APP, cfg), app=APP, config=cfg, placement=placement, deterministic=False)
    with np.load(cfg["out"]) as f:
        return {k: f[k] for k in f.files}


def _items(shards: int, episodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Every stored id and its episode's end, over all shards."""
    from tests.apps.onesided_app import episodes as eps

    parts = [eps(s, episodes)[:2] for s in range(shards)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _check_windows(rec: dict, window: int, pad: str = "tail") -> None:
    """Each item's window holds its episode's steps from (tail) or up to (head) the item, zeros at padding."""
    from tests.apps.onesided_app import SHARD_IDS

    keys = rec["keys"]
    item_ids = (keys >> 48) * SHARD_IDS + (keys & ((1 << 48) - 1))
    all_ids, all_ends = _items(2, 40)
    end_of = dict(zip(all_ids.tolist(), all_ends.tolist()))
    start_of = {}
    for i, e in zip(all_ids.tolist(), all_ends.tolist()):
        start_of.setdefault(e, i)
    for k, ids, mask in zip(item_ids.tolist(), rec["ids"], rec["mask"]):
        t = np.arange(window)
        if pad == "tail":
            want_mask = t < min(window, end_of[k] - k)
            want_ids = np.where(want_mask, k + t, 0)
        else:
            base = k - window + 1
            want_mask = base + t >= start_of[end_of[k]]
            want_ids = np.where(want_mask, base + t, 0)
        np.testing.assert_array_equal(mask, want_mask)
        np.testing.assert_array_equal(ids, want_ids)


@pytest.mark.timeout(120)
def test_a_learner_in_another_process_samples_windows_one_sidedly_with_a_single_tables_distribution(tmp_path):
    """Shards in their own processes; 30 batches of 64 windows drawn with no message; every window
    is its item's episode slice; each item's probability is exactly w_i / M over both shards (a
    single table's), the weights (P / min P)^-beta; the draws follow those probabilities; and the
    shards count every draw from the notices."""
    from tests.apps.onesided_app import priority

    rec = _probe(tmp_path, "processes", batches=30, batch_size=64, alpha=0.7, beta=0.5)
    assert bool(rec["offered"]) and int(rec["one_sided"]) == 30 and int(rec["fallbacks"]) == 0
    assert int(rec["dropped"]) == 0 and len(rec["keys"]) == 30 * 64
    _check_windows(rec, 8)
    ids, _ = _items(2, 40)
    w = priority(ids) ** 0.7
    keys = rec["keys"]
    item_ids = (keys >> 48) * 1_000_000 + (keys & ((1 << 48) - 1))
    w_of = dict(zip(ids.tolist(), w.tolist()))
    want_p = np.array([w_of[i] for i in item_ids.tolist()]) / w.sum()
    np.testing.assert_allclose(rec["probs"], want_p, rtol=1e-12)
    np.testing.assert_allclose(rec["weights"], (want_p / (w.min() / w.sum())) ** -0.5, rtol=1e-6)
    assert set(rec["sizes"].tolist()) == {len(ids)}
    # The draws follow the probabilities: by priority class and by shard (5 sigma).
    n = len(item_ids)
    for c in range(3):
        p = w[ids % 3 == c].sum() / w.sum()
        got = int((item_ids % 3 == c).sum())
        assert abs(got - n * p) < 5 * np.sqrt(n * p * (1 - p)), (c, got, n * p)
    for s in range(2):
        p = w[ids // 1_000_000 == s].sum() / w.sum()
        got = int((item_ids // 1_000_000 == s).sum())
        assert abs(got - n * p) < 5 * np.sqrt(n * p * (1 - p)), (s, got, n * p)
    assert int(rec["sampled"].sum()) == int(rec["draws"])  # the message sample and every one-sided draw
    assert rec["times"].min() >= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window,pad,sampler", [(8, "head", "prioritized"), (0, "tail", "uniform"),
                                                 (5, "tail", "uniform")])
def test_head_padded_windows_steps_and_uniform_samplers_are_sampled_one_sidedly(tmp_path, window, pad, sampler):
    from tests.apps.onesided_app import priority

    rec = _probe(tmp_path, window=window, pad=pad, sampler=sampler, batches=10)
    assert int(rec["one_sided"]) == 10 and int(rec["dropped"]) == 0
    ids, _ = _items(2, 40)
    keys = rec["keys"]
    item_ids = (keys >> 48) * 1_000_000 + (keys & ((1 << 48) - 1))
    if window:
        _check_windows(rec, window, pad)
    else:
        np.testing.assert_array_equal(rec["ids"], item_ids)  # a step read is the item itself
    if sampler == "uniform":
        np.testing.assert_allclose(rec["probs"], 1.0 / len(ids), rtol=1e-12)
        assert (rec["weights"] == 1.0).all()
    else:
        w = priority(ids) ** 0.7
        np.testing.assert_allclose(rec["probs"], priority(item_ids) ** 0.7 / w.sum(), rtol=1e-12)


@pytest.mark.timeout(60)
def test_tables_whose_owner_must_decide_each_draw_are_not_offered_and_sample_through_messages(tmp_path):
    """max_times_sampled (the owner drops items at the draw) keeps the message path: sample_now
    declines and the request still works."""
    rec = _probe(tmp_path, batches=3, max_times_sampled=3)
    assert not bool(rec["offered"]) and int(rec["one_sided"]) == 0 and int(rec["fallbacks"]) == 3
    assert int(rec["sampled"].sum()) == int(rec["draws"]) == 64  # the message sample alone


@pytest.mark.timeout(60)
@pytest.mark.parametrize("remote", [False, True], ids=["shm", "read-server"])
def test_a_rate_limited_shard_is_sampled_one_sidedly_up_to_what_its_limiter_allows_and_no_further(tmp_path, remote):
    """SampleToInsertRatio(0.5) with every step inserted: each shard allows half as many samples as
    it holds steps (~210 each). The message sample and the one-sided draws (this host's, or a read
    server's for a learner on another host) take from one count: the batches come one-sidedly until
    a shard's limiter has too few left, then sample_now declines (messages, which wait for inserts),
    and no shard ever counts more samples than its limiter allows."""
    rec = _probe(tmp_path, "processes", batches=12, limiter="ratio", spi=0.5, remote=remote)
    from tests.apps.onesided_app import episodes

    held = np.array([len(episodes(s, 40)[0]) for s in range(2)])
    allowed = held // 2
    assert bool(rec["offered"]) and int(rec["one_sided"]) >= 3 and int(rec["fallbacks"]) >= 1
    assert int(rec["one_sided"]) + int(rec["fallbacks"]) == 12
    assert (rec["sampled"] <= allowed).all(), (rec["sampled"], allowed)
    # (a draw given up half-way, a shard changing for too long, still counts what it drew)
    assert int(rec["sampled"].sum()) == int(rec["draws"]) >= 64 * (1 + int(rec["one_sided"]))
    assert int(rec["sampled"].sum()) > allowed.sum() - 2 * 64  # the draws stopped for want of samples


@pytest.mark.timeout(60)
@pytest.mark.parametrize("remote", [False, True], ids=["shm", "read-server"])
def test_n_step_transitions_are_sampled_one_sidedly_and_equal_the_storages_own(tmp_path, remote):
    """A TransitionRead bank (3-step returns of a shaped reward) offers its rows: the batches after
    the first come one-sidedly, from this host's memory or a read server, and every item's return,
    discount, valid flag and next fields are what Storage.read_transitions gives for its step (a
    storage filled here with the same episodes), bit for bit."""
    import torch

    from reactor.replay import FieldSpec, Storage
    from tests.apps.onesided_app import FIELDS, episodes

    rec = _probe(tmp_path, "processes", batches=6, transition=3, remote=remote)
    # Most one-sidedly, not all: a draw may decline (its shard changing for too long while a loaded
    # machine slows the reader), and that batch takes the message path. Seen once: 5 of 6, over the read
    # server, in a suite run on 2 workers (the cause not pinned down).
    one_sided, fallbacks = int(rec["one_sided"]), int(rec["fallbacks"])
    assert bool(rec["offered"]) and one_sided + fallbacks == 6 and one_sided >= 4, (one_sided, fallbacks)
    keys = rec["keys"]
    assert len(keys) == one_sided * 64 and int(rec["dropped"]) == 0
    for shard in (0, 1):
        ids, ends, flags = episodes(shard, 40)
        st = Storage([FieldSpec(n, s, getattr(torch, d)) for n, s, d in FIELDS], 4096)
        st.append({"id": torch.from_numpy(ids), "end": torch.from_numpy(ends),
                   "x": torch.from_numpy(np.stack([ids, ids + 1, ids + 2], axis=1).astype(np.float32))}, flags)
        mine = (keys >> 48) == shard
        want = st.read_transitions(keys[mine] & ((1 << 48) - 1), n=3, gamma=0.9, reward_field="x",
                                   next_fields=("id", "x"))
        got = {"id": rec["ids"][mine], "x": rec["x"][mine], "discount": rec["discount"][mine],
               "valid": rec["valid"][mine], "next_id": rec["next_id"][mine], "next_x": rec["next_x"][mine]}
        for f, g in got.items():
            np.testing.assert_array_equal(g, want[f].numpy(), err_msg=f)
        assert mine.any() and not want["valid"].all()


@pytest.mark.timeout(60)
def test_deterministic_runs_keep_the_message_path(tmp_path):
    """A one-sided draw depends on when it reads the shards; a deterministic run must not."""
    cfg = {"out": str(tmp_path / "d.npz"), "batches": 2}
    run(build_graph(APP, cfg), app=APP, config=cfg, deterministic=True)
    with np.load(cfg["out"]) as rec:
        assert not bool(rec["offered"]) and int(rec["one_sided"]) == 0


_OWNED: dict = {}  # a served shard's owner -> (its table, its publisher): a test changes the table


async def _served_shard(tmp_path: Path, k: int, *, shm: bool = False, bad: bool = False, spoil=None):
    """A bulk owner holding a 100-step table (ids 0..99, 10-step episodes, priority 1 + id % 3) whose
    read server serves the one-sided sample op, as a Replay shard's does; its sampling state in a
    region of its own where ``shm`` (for a reader on this host). ``bad``: its replies cut the keys
    short; ``spoil``: its replies are what this function makes of them. Returns (owner, data
    descriptor, sampling offer); ``_OWNED[owner]`` is its (table, publisher)."""
    import torch

    from reactor.nodes.replay import REMOTE_SAMPLE_OP
    from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table, WindowRead
    from reactor.replay.shared import SamplingPublisher, SharedArrays, SharedSampling, serve_sample
    from reactor.transport.bulk import BulkOwner

    backends = ["shm", "zmq"] if shm else ["zmq"]
    # (the run id names the shared memory: one per test process, so parallel workers never share it)
    owner = await BulkOwner.open(f"mixed{os.getpid()}x{k}", backends=backends, zmq_bind=f"ipc://{tmp_path}/s{k}.sock")
    region = f"r{k}"
    if shm:
        arrays = SharedArrays(lambda name, nb: owner.allocate(f"-s-{region}", name, (1, nb), torch.uint8).numpy()[0])
    else:
        arrays = SharedArrays(lambda name, nb: np.zeros(nb, np.uint8))
    st = Storage([FieldSpec("id", (), torch.int64)], 256, allocator=owner.allocator(region), index_arrays=arrays)
    table = Table(st, sampler=Prioritized(), remover=Fifo(), rate_limiter=MinSize(1), arrays=arrays)
    pub = SamplingPublisher(table, arrays, read=WindowRead(4))
    pub.begin()
    table.insert_nowait({"id": torch.arange(100)}, 1.0 + np.arange(100) % 3, episode_end=np.arange(100) % 10 == 9)
    pub.end()
    ss = SharedSampling(pub.descriptor(), {n: arrays.get(n) for n in arrays.layout()})
    fields = [("id", 8, st._fields["id"].data_ptr())]

    def op(req, _t):
        rep = {**serve_sample(ss, req, fields, 1000), "fields": ["id"]}
        if spoil is not None:
            return spoil(rep)
        return {**rep, "keys": rep["keys"][:1]} if bad else rep

    owner.serve_op(REMOTE_SAMPLE_OP, op)
    _OWNED[owner] = (table, pub)
    offer = {"table": pub.descriptor(), "op": REMOTE_SAMPLE_OP, "max_items": 1000}
    desc = owner.descriptor(region)
    if shm:
        offer["region"] = owner.descriptor(f"-s-{region}")
    else:
        desc = {**desc, "host": "another-host"}  # its reader is elsewhere: it reads through the server
    return owner, desc, offer


async def _close(clients, shards) -> None:
    """A test's teardown: the clients' views of the shards' memory and their read connections (as
    ReplayClient.close does, awaited: a zmq connection's close may wait), then the served shards' owners.
    (Closing the reader alone left the sampling regions mapped by the client's views until a garbage
    collection: a later test's check for mappings left by its own reader then failed.)"""
    for c in clients:
        if c is None:
            continue
        c._quiesce()  # (draws ahead read the mappings)
        if c._pool is not None:
            c._pool.shutdown(wait=True)
        reader, c._reader = c._reader, None
        c._group = None
        c._shared.clear()
        c._remote_shared.clear()
        c._regions.clear()
        if reader is not None:
            await reader.aclose()
    for owner, _d, _o in shards:
        _OWNED.pop(owner, None)
        await owner.aclose()
    gc.collect()  # (views a test kept in cycles hold mappings; a later test's check for mappings would see them)


async def _client_of(shards, **kw):
    from reactor.nodes.messages import ShardMass
    from reactor.nodes.replay_client import ReplayClient

    client = ReplayClient(len(shards), rng=np.random.default_rng(0), remote_reads="zmq", **kw)
    for k, (_owner, desc, offer) in enumerate(shards):
        await client._attach(k, desc)
        await client._attach_sampling(k, offer)
        client._figures[k] = ShardMass(k, 0, 0, "", 200.0, 1.0, 100, 0.4)  # (as its first reply would say)
    return client


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("second", ["shm", "remote"])
async def test_a_client_tells_the_shards_of_its_one_sided_draws_every_few_samples_or_when_they_age(tmp_path, second):
    """notice_every=3: two samples return no notice, the third returns one per shard holding the three
    samples' keys of that shard in draw order; a held notice older than NOTICE_MAX_AGE_S goes out with
    the next sample; take_notices hands over what is held (then nothing); a sample that returns no
    batch returns what was held. Shards: two on this host (sample_now), or one here and one behind
    its read server (asample_now's mixed path)."""
    import time

    from reactor.nodes.replay_client import NOTICE_MAX_AGE_S

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, 0, shm=True), await _served_shard(tmp_path, 1, shm=second == "shm")]
        client = await _client_of(shards, notice_every=3)
        assert client.can_sample_now == (second == "shm")

        async def sample() -> tuple[np.ndarray, list]:
            batch, notices = await client.asample_now(40)
            assert batch is not None and len(batch.keys) == 40
            return batch.keys.numpy().copy(), notices

        def by_shard(notices) -> dict[int, np.ndarray]:
            assert len({m.shard for m in notices}) == len(notices)  # one notice per shard
            return {m.shard: np.asarray(m.keys) for m in notices}

        def keys_of(batches: list[np.ndarray], k: int) -> np.ndarray:
            return np.concatenate([b[b >> 48 == k] for b in batches])

        got = [await sample() for _ in range(3)]
        assert [n for _k, n in got[:2]] == [[], []]
        told = by_shard(got[2][1])
        assert sorted(told) == [0, 1]
        for k in (0, 1):
            np.testing.assert_array_equal(told[k], keys_of([b for b, _n in got], k))
        b4, n4 = await sample()
        assert n4 == []
        time.sleep(NOTICE_MAX_AGE_S + 0.02)
        b5, n5 = await sample()  # the 4th sample's notice aged: both go now, two samples short of three
        told = by_shard(n5)
        for k in (0, 1):
            np.testing.assert_array_equal(told[k], keys_of([b4, b5], k))
        b6, n6 = await sample()
        assert n6 == []
        told = by_shard(client.take_notices())
        assert sum(len(v) for v in told.values()) == 40 and client.take_notices() == []
        for k in told:
            np.testing.assert_array_equal(told[k], keys_of([b6], k))
        await sample()
        if second == "remote":  # ~1250 items asked of a server that sends at most 1000: no batch
            b, held = await client.asample_now(2500)
            assert b is None and sum(len(m.keys) for m in held) == 40  # what was held comes with the refusal
            assert client.take_notices() == []
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_that_changes_between_its_figures_and_its_draw_draws_again_and_weighs_by_what_it_used(tmp_path):
    """Two shards on this host; shard 1's owner lowers one priority (its mass and its least weight
    change) after the client read the figures and before shard 1's draw: the draw is made again on
    the new state, shard 1's items report (share from the old figures) x (weight over the new mass),
    and the importance weights are against the least likely item of the figures the draws used
    (shard 0's old, shard 1's new), not of the figures read first."""
    from reactor.replay import Prioritized

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards)
        assert client.can_sample_now
        (_s0, m0, low0, _n0), (_s1, m1, _low1, _n1) = (client._shared[k].table.figures() for k in range(2))
        ss1 = client._shared[1].table
        table1, pub1 = _OWNED[shards[1][0]]
        group = client._ready_plan().group
        real = group.draw
        calls = []

        def changed_first(*args):  # the owner's change lands between the figures and the draws
            if not calls:
                pub1.begin()
                table1.update_priorities(np.array([0]), np.array([0.01]))
                pub1.end()
            calls.append(args[0])
            return real(*args)

        group.draw = changed_first
        n = 300
        batch, _ = client.sample_now(n)
        assert batch is not None and len(batch.keys) == n
        assert len(calls) == 1 and client.one_sided_retries >= 1  # shard 1 moved: drawn again on its new state
        _s, m1_new, low1_new, _n = ss1.figures()
        alpha = Prioritized().alpha
        w1 = (1.0 + np.arange(100) % 3) ** alpha
        w1[0] = 0.01**alpha
        assert m1_new == pytest.approx(w1.sum()) and low1_new == pytest.approx(w1.min())
        share = np.array([m0, m1]) / (m0 + m1)  # the counts were drawn from the figures read first
        keys = batch.keys.numpy()
        shard, local = keys >> 48, keys & ((1 << 48) - 1)
        w0 = (1.0 + np.arange(100) % 3) ** alpha
        want_p = np.where(shard == 0, share[0] * w0[local] / m0, share[1] * w1[local] / m1_new)
        np.testing.assert_allclose(batch.probabilities.numpy(), want_p, rtol=1e-12)
        beta = client._shared[0].table.beta
        min_p = min(share[0] * low0 / m0, share[1] * low1_new / m1_new)
        want_w = np.minimum((want_p / min_p) ** -beta, 1.0).astype(np.float32)
        np.testing.assert_allclose(batch.weights.numpy(), want_w, rtol=1e-6)
        assert batch.weights.numpy().min() < 0.5  # (the least weight moved: the old one would say otherwise)
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_sample_whose_shard_was_mid_change_draws_shard_by_shard_what_the_one_call_draws(tmp_path):
    """The one-call draw over every shard and the path a busy shard takes (its figures waited for, the
    counts and draws shard by shard) give the same batch for the same seed: same keys, probabilities,
    weights, windows and masks."""
    from reactor.replay.shared import BUSY

    shards, clients = [], []
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(3)]
        clients = [await _client_of(shards), await _client_of(shards)]
        busy = clients[1]._ready_plan().group
        busy.figures = lambda *a: BUSY  # as when a shard's count is odd at the first read
        for _ in range(3):
            (b0, _n0), (b1, _n1) = (c.sample_now(200) for c in clients)
            for f in ("keys", "probabilities", "weights", "times_sampled"):
                np.testing.assert_array_equal(getattr(b0, f).numpy(), getattr(b1, f).numpy())
            assert sorted(b0.data) == sorted(b1.data)
            for f in b0.data:
                np.testing.assert_array_equal(b0.data[f].numpy(), b1.data[f].numpy())
            assert len(set((b0.keys.numpy() >> 48).tolist())) == 3
    finally:
        await _close(clients, shards)


#: A hostile process on the host: writes ``value`` ("neg": the words negated) over words [a, b) of a
#: segment's data, viewed as ``dtype``, through its own writable mapping.
_SPOIL = """
import sys
import numpy as np
from reactor.transport import _shm
name, dtype, a, b, value = sys.argv[1:]
seg = _shm.Segment.attach(name, writable=True)
words = seg.data.view(np.dtype(dtype))[int(a):int(b)]
words[:] = -words if value == "neg" else np.dtype(dtype).type(value)
seg.close_reader()
"""


def _spoil(run_id: str, region: str, field: str, dtype: str, a: int, b: int, value: str) -> None:
    import subprocess
    import sys

    from reactor.transport import _shm

    subprocess.run([sys.executable, "-c", _SPOIL, _shm.segment_name(run_id, region, field), dtype, str(a), str(b),
                    value], check=True, timeout=60)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("spoil", ["first step below 0", "leaves negative"])
async def test_a_corrupt_settled_state_written_by_another_process_raises_naming_the_shard_never_loops(tmp_path,
                                                                                                         spoil):
    """Another process writes into shard 1's published sampling state (its count left settled): a
    first stored step below 0 (every draw's index check refuses), or every leaf of its sum tree
    negated (every draw's probability check refuses). sample_now, and a draw ahead taken with
    next_drawn, raise MalformedFrameError naming shard 1 (``shard`` 1; ``notices``: shard 0's draws
    made before it): a draw on a state that did not change is refused the same way every time, and
    the redraw loop ran for good (hostile review: the call never returned). The state put back, the
    next sample draws."""
    from reactor._errors import MalformedFrameError
    from reactor.replay.sumtree import _layout

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards)
        assert client.sample_now(8)[0] is not None
        table, pub = _OWNED[shards[1][0]]
        run_id, saved = f"mixed{os.getpid()}x1", {n: pub.arrays.get(n).copy() for n in ("header", "sums")}
        if spoil == "first step below 0":
            _spoil(run_id, "-s-r1", "header", "int64", 1, 2, "-1")
        else:
            offsets, _ = _layout(table.storage.capacity, table._sampler.arity)
            _spoil(run_id, "-s-r1", "sums", "float64", int(offsets[-2]), int(offsets[-1]), "neg")
        assert pub.header[0] % 2 == 0  # (settled)
        for _ in range(3):
            with pytest.raises(MalformedFrameError, match=r"^replay shard 1: its published sampling state \(region "
                               r"'-s-r1'\) is inconsistent under a settled sequence count \d+ \(an index or a "
                               r"probability out of range\): corrupt shared memory; sample through messages$") as e:
                client.sample_now(64)
            assert e.value.shard == 1 and {m.shard for m in e.value.notices} <= {0}
            assert e.value.offer is client._shared[1]  # (the offer it drew under: drop_one_sided's check)
        assert client.draw_ahead(64, 2) == 2
        for _ in range(2):
            with pytest.raises(MalformedFrameError, match=r"^replay shard 1: "):
                await client.next_drawn()
        for n, a in saved.items():
            pub.arrays.get(n)[:] = a
        assert client.sample_now(8)[0] is not None
        # An error of an offer that is no longer the shard's (its last life's, taken after the next life
        # offered: here the offer attached again) drops nothing; the error of the offer now drops it.
        stale = e.value.offer
        client._forget_sampling(1)
        await client._attach_sampling(1, shards[1][2])
        assert client._shared[1] is not stale
        client.drop_one_sided(1, stale)
        assert client.can_sample_now and client.sample_now(8)[0] is not None
        client.drop_one_sided(1, client._shared[1])  # (what a learner does on that error: messages from now on)
        assert not client.can_sample_now and client.sample_now(8)[0] is None
        assert client.draw_ahead(8, 2) == 0
    finally:
        await _close([client], shards)


#: A corrupt root sum of shard 0 (a word, or a multiple of shard 1's mass), how the error shows it, and
#: whether the total stays above 0 with shard 1's share spoiled (0, or 1,000: every draw of the sound
#: shard refused) or no total is above 0 (taken for "every priority is 0" before).
_CORRUPT_MASSES = {"inf": ("inf", "inf", True), "most of shard 1's, negated": (-0.999, "-[0-9.e+-]+", True),
                   "nan": ("nan", "nan", False), "twice shard 1's, negated": (-2.0, "-[0-9.e+-]+", False)}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mass", list(_CORRUPT_MASSES))
async def test_a_corrupt_mass_is_blamed_on_its_own_shard_not_on_the_one_whose_draws_it_spoiled(tmp_path, mass):
    """Another process writes shard 0's published root sum (its count left settled): inf, or minus most of
    shard 1's mass (the total a thousandth of shard 1's: its share 1,000), so every item falls to shard
    1 with a share of 0 or above 1 and its sound state refuses each draw; or NaN, or minus twice shard 1's
    mass, so that no total is above 0. The MalformedFrameError names shard 0, whose mass is the corrupt
    word: a learner drops the offer it names (drop_one_sided), so shard 0's next life brings one-sided
    draws back. Before, the first two named shard 1 (the sound shard's offer dropped, h26), and the last
    two were taken for "every priority is 0": no batch, no word, every sample (h26). Every mass 0 still
    returns no batch and raises nothing."""
    from reactor._errors import MalformedFrameError

    word, shown, spoils_share = _CORRUPT_MASSES[mass]
    refused = r" \(shard 1's draws on its share were refused\)" if spoils_share else ""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards)
        assert client.sample_now(8)[0] is not None
        if not isinstance(word, str):
            word = repr(word * client._shared[1].table.figures()[1])
        _spoil(f"mixed{os.getpid()}x0", "-s-r0", "sums", "float64", 0, 1, word)
        for _ in range(2):
            with pytest.raises(MalformedFrameError, match=r"^replay shard 0: its published sampling state \(region "
                               rf"'-s-r0'\) is inconsistent: its mass {shown} is not a finite number >= 0{refused}: "
                               r"corrupt shared memory; sample through messages$") as e:
                client.sample_now(64)
            assert e.value.shard == 0 and e.value.offer is client._shared[0]
        _spoil(f"mixed{os.getpid()}x0", "-s-r0", "sums", "float64", 0, 1, "0")
        _spoil(f"mixed{os.getpid()}x1", "-s-r1", "sums", "float64", 0, 1, "0")
        assert client.sample_now(8)[0] is None  # (every mass 0: no batch, no error; held notices handed over)
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_draw_ahead_that_fails_while_its_taker_waits_is_raised_once_and_leaves_the_queue(tmp_path):
    """A draw ahead still running when next_drawn takes it (the taker awaits it) and then failing
    (MalformedFrameError: shard 1's spoiled state): the error is raised once and the draw leaves the
    queue. Before, the error went up from the wait before the draw was taken off the queue, so the next
    take raised it again, and a learner sent its notices (times sampled, the rate limiter's counts) a
    second time (found by CI: a draw_ahead after it found the failed draw still queued)."""
    import threading

    from reactor._errors import MalformedFrameError
    from reactor.nodes._onesided import OneSidedSampling

    shards, client = [], None
    release, started = threading.Event(), threading.Event()
    real = OneSidedSampling.sample_now

    def held(self, n):  # (the draw is running, and fails, only once the taker waits for it)
        started.set()
        release.wait(30)
        return real(self, n)

    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards)
        _spoil(f"mixed{os.getpid()}x1", "-s-r1", "header", "int64", 1, 2, "-1")
        OneSidedSampling.sample_now = held
        assert client.draw_ahead(64, 1) == 1
        assert started.wait(30)
        asyncio.get_running_loop().call_later(0.2, release.set)
        with pytest.raises(MalformedFrameError, match=r"^replay shard 1: ") as e:
            await client.next_drawn()  # (awaited: it is running, none is done, none is left to draw here)
        assert e.value.shard == 1
        assert client.drawn_ahead == 0
        with pytest.raises(LookupError):
            await client.next_drawn()
    finally:
        OneSidedSampling.sample_now = real
        release.set()
        await _close([client], shards)


#: A shard's owner in its own process (as _served_shard's, 100 steps): publishes, writes its data
#: descriptor and sampling offer (msgpack) to argv[3], then, once argv[4] exists, begins a change
#: (its count odd), writes argv[5] and waits to be killed.
_MID_CHANGE_SHARD = """
import asyncio, os, sys, time
import msgpack, numpy as np, torch
from reactor.nodes.replay import REMOTE_SAMPLE_OP
from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table, WindowRead
from reactor.replay.shared import SamplingPublisher, SharedArrays
from reactor.transport.bulk import BulkOwner

async def main(run_id, sock, out, go, begun):
    owner = await BulkOwner.open(run_id, backends=["shm", "zmq"], zmq_bind=f"ipc://{sock}")
    arrays = SharedArrays(lambda name, nb: owner.allocate("-s-r1", name, (1, nb), torch.uint8).numpy()[0])
    st = Storage([FieldSpec("id", (), torch.int64)], 256, allocator=owner.allocator("r1"), index_arrays=arrays)
    table = Table(st, sampler=Prioritized(), remover=Fifo(), rate_limiter=MinSize(1), arrays=arrays)
    pub = SamplingPublisher(table, arrays, read=WindowRead(4))
    pub.begin()
    table.insert_nowait({"id": torch.arange(100)}, 1.0 + np.arange(100) % 3, episode_end=np.arange(100) % 10 == 9)
    pub.end()
    offer = {"table": pub.descriptor(), "op": REMOTE_SAMPLE_OP, "max_items": 1000,
             "region": owner.descriptor("-s-r1")}
    with open(out + ".part", "wb") as f:
        f.write(msgpack.packb([owner.descriptor("r1"), offer]))
    os.rename(out + ".part", out)
    while not os.path.exists(go):
        time.sleep(0.01)
    pub.begin()
    open(begun, "w").close()
    time.sleep(600)

asyncio.run(main(*sys.argv[1:]))
"""


@contextlib.asynccontextmanager
async def _with_shard_in_a_process(tmp_path: Path, *, first_elsewhere: bool = False, **client_kw):
    """Shard 0 served here and shard 1's owner in a process of its own (``_MID_CHANGE_SHARD``), a client
    of both that has drawn one sample of 32: yields ``(client, child, go, begun)`` (touch ``go`` and the
    child begins a change, then writes ``begun``); the child killed and its segments cleaned at the end.
    ``first_elsewhere``: shard 0 is of another host to the client (sampled by its read server)."""
    import subprocess
    import sys

    import msgpack

    from reactor.transport import _shm

    run_id = f"dead{os.getpid()}"
    out, go, begun = tmp_path / "offer", tmp_path / "go", tmp_path / "begun"
    child = subprocess.Popen([sys.executable, "-c", _MID_CHANGE_SHARD, run_id, str(tmp_path / "s1.sock"), str(out),
                              str(go), str(begun)])
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, 0, shm=not first_elsewhere)]
        while not out.exists():
            assert child.poll() is None, f"the shard's process ended with status {child.returncode}"
            await asyncio.sleep(0.01)
        desc, offer = msgpack.unpackb(out.read_bytes())
        client = await _client_of([*shards, (None, desc, offer)], **client_kw)
        assert (await client.asample_now(32))[0] is not None
        yield client, child, go, begun
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=60)
        await _close([client], shards)
        _shm.cleanup_stale(run_id)


#: A dead owner's segments may have been swept by then (another test's, or a daemon's, cleanup of stale
#: segments: CI ran one on the other test worker), which its PeerLostError says too.
_SWEPT = r"(?: \(its segments were cleaned up\))?"


async def _killed_in_the_middle_of_a_change(client, child, go, begun) -> None:
    """Let shard 1's process (:func:`_with_shard_in_a_process`) begin a change, then SIGKILL it there: its
    sequence count stays odd for good."""
    import signal

    go.touch()
    while not begun.exists():
        assert child.poll() is None, f"the shard's process ended with status {child.returncode}"
        await asyncio.sleep(0.01)
    assert client._shared[1].table.figures()[0] == -1  # (mid-change)
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=60)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_shard_killed_in_the_middle_of_a_change_makes_a_one_sided_sample_raise_peer_lost_naming_it(tmp_path):
    """Shard 1's owner in its own process begins a change (its sequence count odd) and is killed with
    SIGKILL there: its count stays odd for good. sample_now, after its ~5 ms of patience, raises
    PeerLostError naming shard 1 (``shard`` 1), as a sample that copied from a dead shard does, and
    so does a draw ahead taken with next_drawn: the learner goes back to messages with the reason.
    Before, every sample waited its patience and returned no batch, and its check of the shards'
    processes was never reached (hostile review)."""

    from reactor._errors import PeerLostError

    async with _with_shard_in_a_process(tmp_path) as (client, child, go, begun):
        await _killed_in_the_middle_of_a_change(client, child, go, begun)
        for _ in range(3):
            with pytest.raises(PeerLostError, match=r"^replay shard 1: its shared memory is gone \(bulk region "
                                                    r"'r1': its owner \(pid \d+\) died" + _SWEPT + r"\)$") as e:
                client.sample_now(32)
            assert e.value.shard == 1
        assert client.draw_ahead(32, 2) == 2
        for _ in range(2):
            with pytest.raises(PeerLostError, match=r"^replay shard 1: "):
                await client.next_drawn()


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_mixed_sample_whose_shard_of_this_host_is_found_dead_raises_naming_it_with_the_servers_notices(
        tmp_path):
    """Shard 1 of this host (its owner in a process of its own, killed between changes) and shard 0 of
    another (drawn by its read server), in one sample: shard 1's part is drawn, and the check of its
    owner after the draw raises PeerLostError naming shard 1 (``shard`` 1), carrying the notice of shard
    0's part, which its server drew, as the host path's error carries the notices of its draws. Before,
    that error named no shard and carried no notice: shard 0 never heard of those draws (its times
    sampled; whether its inserts wait for samples)."""
    import signal

    from reactor._errors import PeerLostError

    async with _with_shard_in_a_process(tmp_path, first_elsewhere=True, notice_every=1000) as (client, child, _go,
                                                                                               _begun):
        assert client.can_sample_one_sided and not client.can_sample_now
        client.take_notices()  # (that sample's, held)
        child.send_signal(signal.SIGKILL)  # (waiting for go: between changes)
        child.wait(timeout=60)
        with pytest.raises(PeerLostError, match=r"^replay shard 1: its shared memory is gone \(bulk region 'r1': its "
                                                r"owner \(pid \d+\) died" + _SWEPT + r"\)$") as e:
            await client.asample_now(32)
        assert e.value.shard == 1
        (told,) = e.value.notices
        assert told.shard == 0 and 0 < len(told.keys) < 32 and (np.asarray(told.keys) >> 48 == 0).all()
        assert client.take_notices() == []  # (none left held: each draw told once)


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_mixed_sample_whose_shard_of_this_host_died_in_the_middle_of_a_change_raises_naming_it(tmp_path):
    """As above, shard 1's owner killed in the middle of a change (its count odd for good) instead: its
    part waits its ~5 ms of patience, then its owner is checked and PeerLostError names shard 1, with the
    notice of shard 0's part. Before, the part gave up without a word: no batch and no error at every
    sample until the shard's loss reached the client by other means (the host path checks there since
    the hostile review; a review of the mixed path's dead-shard fix, session 70)."""

    from reactor._errors import PeerLostError

    async with _with_shard_in_a_process(tmp_path, first_elsewhere=True, notice_every=1000) as (client, child, go,
                                                                                               begun):
        client.take_notices()  # (that sample's, held)
        await _killed_in_the_middle_of_a_change(client, child, go, begun)
        with pytest.raises(PeerLostError, match=r"^replay shard 1: its shared memory is gone \(bulk region 'r1': its "
                                                r"owner \(pid \d+\) died" + _SWEPT + r"\)$") as e:
            await client.asample_now(32)
        assert e.value.shard == 1
        (told,) = e.value.notices
        assert told.shard == 0 and 0 < len(told.keys) < 32


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_a_sample_that_drew_from_a_shard_found_dead_after_raises_with_the_notices_of_its_draws(tmp_path):
    """Shard 1's owner in its own process is killed between changes (its state settled): the sample's
    draws all succeed, and the check of the shards' processes after them raises PeerLostError naming
    shard 1; the error carries the notices of the draws made (every item of the dropped batch, shard
    0's among them), as the other errors of a sample do and as the learner sends them: the shards count
    what was drawn from them (times sampled; a shard whose inserts wait for samples hears of them).
    Before, that error carried none: shard 0 was never told of those draws (h26)."""
    import signal

    from reactor._errors import PeerLostError

    async with _with_shard_in_a_process(tmp_path, notice_every=1000) as (client, child, _go, _begun):
        client.take_notices()  # (that sample's, held)
        child.send_signal(signal.SIGKILL)  # (waiting for go: between changes)
        child.wait(timeout=60)
        assert client._shared[1].table.figures()[0] >= 0  # (settled)
        with pytest.raises(PeerLostError, match=r"^replay shard 1: its shared memory is gone") as e:
            client.sample_now(32)
        told = getattr(e.value, "notices", [])
        assert sum(len(m.keys) for m in told) == 32 and 0 in {m.shard for m in told}, told
        for m in told:
            assert (np.asarray(m.keys) >> 48 == m.shard).all()
        assert client.take_notices() == []  # (none left held: each draw told once)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_attached_again_samples_one_sidedly_only_after_an_offer_that_maps_again(tmp_path):
    """A second reply with the data region's descriptor remaps it (as replies to a prefetch of several
    samples do at a learner's start): the shard's old one-sided state, whose row addresses pointed into
    the old mapping, is gone at once; an unusable offer with it leaves the shard to messages (no
    sample reads the old addresses); a good offer maps it again and the draw is whole."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards)
        assert client.can_sample_now and client.sample_now(50)[0] is not None
        _owner, desc, offer = shards[1]
        await client._attach(1, desc)
        await client._attach_sampling(1, {"table": offer["table"], "region": {"bad": "descriptor"}})
        assert 1 not in client._shared and not client.can_sample_now
        b, told = client.sample_now(50)  # (no read of the old mapping)
        assert b is None and sum(len(m.keys) for m in told) == 50  # the first sample's held draws, handed over
        await client._attach(1, desc)
        await client._attach_sampling(1, offer)
        batch, _ = client.sample_now(400)
        assert batch is not None and set((batch.keys.numpy() >> 48).tolist()) == {0, 1}
        ids, local = batch.data["id"].numpy()[:, 0], batch.keys.numpy() & ((1 << 48) - 1)
        np.testing.assert_array_equal(ids, local)  # each window's first row is its item's own step
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_held_notices_of_a_lost_or_restarted_shard_are_dropped_and_the_others_kept(tmp_path):
    """Draws held from shards 0, 1 and 2; shard 1 restarts and shard 2 is lost: the notices handed
    over name shard 0 only, with every key drawn from it."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(3)]
        client = await _client_of(shards, notice_every=100)
        batches = [client.sample_now(60)[0] for _ in range(3)]
        client.shard_restarted(1)
        client.shard_lost(2, "test")
        (told,) = client.take_notices()
        keys = np.concatenate([b.keys.numpy() for b in batches])
        assert told.shard == 0
        np.testing.assert_array_equal(np.asarray(told.keys), keys[keys >> 48 == 0])
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_given_up_on_by_the_message_path_is_not_drawn_from_and_is_again_once_back(tmp_path):
    """The message path gives a silent shard up (``lost``, with ``skip_lost_shards``) without
    unmapping it: the next one-sided sample draws from the other shards only, though the last one
    drew from all three; once the shard counts as live again it is drawn from again."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(3)]
        client = await _client_of(shards)
        first, _ = client.sample_now(300)
        assert first is not None and set((first.keys.numpy() >> 48).tolist()) == {0, 1, 2}
        client.lost[1] = "no answer within 1s"  # (as the message path marks a shard it gives up on)
        for _ in range(5):
            batch, _ = client.sample_now(300)
            assert batch is not None and set((batch.keys.numpy() >> 48).tolist()) == {0, 2}
        del client.lost[1]
        batch, _ = client.sample_now(300)
        assert batch is not None and set((batch.keys.numpy() >> 48).tolist()) == {0, 1, 2}
    finally:
        await _close([client], shards)

@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_given_up_on_while_a_draw_makes_its_plan_is_not_drawn_from_after(tmp_path, monkeypatch):
    """The message path may give a shard up on the loop's thread while a draw ahead, on its own thread,
    makes the plan of the shards it draws from: that plan is for the lost shards it read, so it does
    not stand for the new ones, and the samples after it leave the given-up shard out."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(3)]
        client = await _client_of(shards)
        make = _onesided._Plan.__init__

        def made_while_shard_1_is_given_up(plan, *a, **kw):
            client.lost[1] = "no answer within 1s"  # (the loop's thread, in the middle of the plan's making)
            make(plan, *a, **kw)

        monkeypatch.setattr(_onesided._Plan, "__init__", made_while_shard_1_is_given_up)
        client._group = None
        first, _ = client.sample_now(300)  # (drawn from the shards it read as live: all three)
        monkeypatch.setattr(_onesided._Plan, "__init__", make)
        assert first is not None and set((first.keys.numpy() >> 48).tolist()) == {0, 1, 2}
        for _ in range(5):
            batch, _ = client.sample_now(300)
            assert batch is not None and set((batch.keys.numpy() >> 48).tolist()) == {0, 2}
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_draws_ahead_run_on_the_clients_threads_and_every_draw_is_counted_and_told_once(tmp_path):
    """200 samples drawn ahead, 4 at a time on 2 draw threads, from two shards of this host: each a
    whole batch of the shards' keys, drawn on a thread of the client's ("reactor-draw"), or by the
    taker itself when none was done and one had not started (``taker_samples`` counts those, and
    only those ran on the caller's thread); the counters count 200 samples and 8,000 items, and the
    notices handed over hold every key of every batch once (the threads share the held notices under
    a lock)."""
    import threading
    from collections import Counter

    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards, notice_every=7, draw_threads=2)
        ran_on: Counter[str] = Counter()
        sample_now = client.sample_now

        def spy(n):
            ran_on[threading.current_thread().name] += 1
            return sample_now(n)

        client.sample_now = spy
        keys, told = [], []
        for _ in range(200):
            assert client.draw_ahead(40, 4) == 4 and client.drawn_ahead == 4
            batch, notices = await client.next_drawn() if len(keys) % 2 else client.take_drawn()
            assert batch is not None and len(batch.keys) == 40
            assert set((batch.keys.numpy() & 0xFFFF_FFFF_FFFF).tolist()) <= set(range(100))
            keys.append(batch.keys.numpy().copy())
            told += notices
        for r in client.drain_drawn():  # the 3 still ahead
            assert not isinstance(r, BaseException) and r[0] is not None
            keys.append(r[0].keys.numpy().copy())
            told += r[1]
        told += client.take_notices()
        assert client.drawn_ahead == 0 and client.ahead_samples == 203
        mine = threading.current_thread().name
        assert set(ran_on) <= {mine, "reactor-draw_0", "reactor-draw_1"} and ran_on[mine] == client.taker_samples
        assert sum(ran_on.values()) == 203 and ran_on[mine] < 203  # (some on the draw threads)
        assert client.one_sided_samples == 203 and client.gathered_items == 203 * 40
        all_keys = np.sort(np.concatenate(keys))
        np.testing.assert_array_equal(np.sort(np.concatenate([np.asarray(m.keys) for m in told])), all_keys)
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_lost_while_draws_ahead_run_waits_for_them_and_drops_the_draws_from_it(tmp_path):
    """Draws ahead of 200,000 items, one of them awaited by a take, when shard 1 is lost: the loss waits
    for every running draw (taken or not: its mapping is never unmapped under one), then drops those
    that drew from shard 1 (as a message sample in flight drops its part) and holds their notices to
    shard 0, which the take gets none of: it returns (None, []). The next draws come from shard 0
    alone; close() with draws still ahead drops them and leaves no draw running."""
    import threading

    shards, client, gate = [], None, threading.Event()
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards, draw_threads=4, notice_every=1000)
        sample_now = client.sample_now
        client.sample_now = lambda n: (gate.wait(30), sample_now(n))[1]  # (the draws wait for the gate)
        client.draw_ahead(200_000, 4)
        while not all(f.running() for f in client._ahead):  # (none left for the take to draw)
            await asyncio.sleep(0.001)
        take = asyncio.ensure_future(client.next_drawn())
        await asyncio.sleep(0)  # the take waits on the oldest draw, still running (on a loaded machine
        assert not take.done()  # one used to finish first, and the take got its batch)
        threading.Timer(0.1, gate.set).start()  # (the loss waits for the running draws: they end meanwhile)
        client.shard_lost(1, "test")
        assert not client._running and client.drawn_ahead == 0
        assert await take == (None, [])
        (told,) = client.take_notices()
        keys = np.asarray(told.keys)
        assert told.shard == 0 and (keys >> 48 == 0).all() and 4 * 60_000 < len(keys) < 4 * 140_000
        client.draw_ahead(100, 2)
        batch, _notices = await client.next_drawn()
        assert set(np.unique(batch.keys.numpy() >> 48)) == {0}
        ids, local = batch.data["id"].numpy(), batch.keys.numpy() & 0xFFFF_FFFF_FFFF
        np.testing.assert_array_equal(ids[:, 0], local)  # each window's first row is its item's own
        client.draw_ahead(200_000, 4)
        client.close()
        assert client.drawn_ahead == 0 and client._pool is None and not client._running
    finally:
        gate.set()
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_attached_again_while_draws_ahead_run_is_remapped_only_after_them(tmp_path):
    """A reply carrying shard 1's descriptor again (its data region is mapped anew: _attach) while two
    draws of 1,000,000 items run: the remapping waits for them, and their batches are whole."""
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards, draw_threads=1, notice_every=1000)
        client.draw_ahead(1_000_000, 2)
        await client._attach(1, shards[1][1])
        assert not client._running
        for r in client.drain_drawn():
            assert not isinstance(r, BaseException) and r[0] is not None and len(r[0].keys) == 1_000_000
            ids, local = r[0].data["id"].numpy(), r[0].keys.numpy() & 0xFFFF_FFFF_FFFF
            np.testing.assert_array_equal(ids[:, 0], local)
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_take_cancelled_while_it_waits_leaves_its_draw_to_the_next_take(tmp_path):
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards, draw_threads=1, notice_every=1)
        client.draw_ahead(1_000_000, 1)
        take = asyncio.ensure_future(client.next_drawn())
        await asyncio.sleep(0.001)
        take.cancel()
        with pytest.raises(asyncio.CancelledError):
            await take
        assert client.drawn_ahead == 1
        batch, notices = await client.next_drawn()
        assert batch is not None and len(batch.keys) == 1_000_000
        assert sum(len(m.keys) for m in notices) == 1_000_000  # (notice_every=1: its notices come with it)
    finally:
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_take_cancelled_while_its_draw_fails_leaves_no_error_for_the_loop_to_log(tmp_path):
    """A learner cancelled at the end of a run while its draw ahead fails (its shards closed their
    memory) once left the loop's mirror of that draw holding the error: "Future exception was never
    retrieved", logged with a traceback at the end of runs on a loaded machine. The error stays for
    the next take, and the loop is told nothing."""
    from reactor._errors import PeerLostError

    loop = asyncio.get_running_loop()
    told: list[dict] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: told.append(context))
    shards, client = [], None
    try:
        shards = [await _served_shard(tmp_path, k, shm=True) for k in range(2)]
        client = await _client_of(shards, draw_threads=1, notice_every=1000)
        await shards[1][0].aclose()  # the shard's memory closed: a draw from it fails when it ends
        client.draw_ahead(1_000_000, 1)
        take = asyncio.ensure_future(client.next_drawn())
        await asyncio.sleep(0.001)
        assert not client._ahead[0].done()  # (1,000,000 windows: the draw still runs)
        take.cancel()
        with pytest.raises(asyncio.CancelledError):
            await take
        client._quiesce()
        await asyncio.sleep(0.01)  # (the loop's mirror of the draw takes its outcome)
        assert isinstance(client._ahead[0].exception(), PeerLostError)  # (kept for the next take)
        del take
        client.close()  # (as the learner's shutdown does: the draw is dropped, and its mirror with it)
        gc.collect()
        await asyncio.sleep(0)
        assert not told, [c.get("message") for c in told]
    finally:
        loop.set_exception_handler(before)
        await _close([client], shards)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_draws_ahead_refuse_bad_arguments_and_a_take_with_none_started(tmp_path):
    from reactor.nodes.replay_client import ReplayClient

    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="draw_threads must be an int >= 1"):
            ReplayClient(1, draw_threads=bad)
    client = ReplayClient(1)
    for n, depth, what in ((0, 1, "sample size n"), (4, -1, "depth must be an int >= 0"), (4, 1.0, "depth")):
        with pytest.raises(ValueError, match=what):
            client.draw_ahead(n, depth)
    assert client.draw_ahead(4, 3) == 0  # no shard mapped here: nothing starts
    with pytest.raises(LookupError, match="no draw ahead was started"):
        await client.next_drawn()
    with pytest.raises(LookupError, match="no draw ahead was started"):
        client.take_drawn()


def test_shards_of_different_layouts_are_not_drawn_into_one_batch():
    from reactor.replay.shared import SharedShards

    class State:  # what SharedShards reads of a SharedSampling besides the arrays it checks later
        window, head, transition = 4, False, None

    with pytest.raises(ValueError, match="same fields and row sizes"):
        SharedShards([(State(), np.zeros(2, np.int64), np.array([8, 4])),
                      (State(), np.zeros(2, np.int64), np.array([8, 8]))])


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "8"])
def test_a_client_refuses_a_notice_every_that_is_not_a_positive_int(bad):
    from reactor.nodes.replay_client import ReplayClient

    with pytest.raises(ValueError, match="notice_every must be an int >= 1"):
        ReplayClient(2, notice_every=bad)


def test_a_shards_sampling_region_is_never_another_shards_data_region():
    """The sampling state's region is named from the shard's: a suffix (``a-s``) was the data region of
    a reactor named ``a-s``, whose segments and the reader's attachments then collided. Every name a
    graph accepts, replicated or not, gives a sampling region no reactor name gives; a name past the
    64-character bound gives none (the shard then samples through messages, saying why)."""
    import re

    from reactor._graph import _NAME_RE, plain_name
    from reactor.nodes.replay import sampling_region_name

    rng = np.random.default_rng(21)
    alphabet = np.array(list("ab_-s0"))
    names = ["a", "a-s", "replay", "replay-s", "_x", "s"] + [
        str(rng.choice(list("ab_s"))) + "".join(rng.choice(alphabet, size=int(rng.integers(0, 6)))) for _ in range(300)]
    names = [n for n in names if _NAME_RE.match(n)]
    data = {plain_name(n) for n in names} | {plain_name(f"{n}[{i}]") for n in names for i in range(3)}
    sampling = {sampling_region_name(r) for r in data}
    assert None not in sampling and not sampling & data
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", r) for r in sampling)  # a valid bulk name
    assert sampling_region_name("a" * 61) == "-s-" + "a" * 61 and sampling_region_name("a" * 62) is None


@pytest.mark.timeout(120)
def test_a_one_sided_sample_from_a_shard_killed_with_sigkill_raises_peer_lost_naming_it(tmp_path):
    """Shards in their own processes: a one-sided batch, then SIGKILL of shard 1's process and, once it is
    reaped, one more one-sided sample at once (before any word of the loss can reach the client): it
    raises PeerLostError naming the shard (its ``shard`` attribute, which a learner falls back on),
    never a batch with the dead shard's rows. The run goes on (restart policy) and ends."""
    out = tmp_path / "probe.npz"
    cfg = {"out": str(out), "kill_shard": 1, "batch_size": 64}
    run(build_graph(APP, cfg), app=APP, config=cfg, placement="processes", deterministic=False, restart="on-failure")
    with np.load(out) as f:
        assert bool(f["before"]) and bool(f["reaped"])
        killed = str(f["killed"])
    assert killed.startswith("PeerLostError|1|replay shard 1: its shared memory is gone (bulk region "), killed
    assert "died" in killed, killed


@pytest.mark.timeout(60)
def test_a_request_the_limiter_holds_lets_in_inserts_that_one_sided_draws_made_room_for(tmp_path):
    """Inserts parked for want of samples; a reader then drew 25 one-sidedly (the limiter's count
    moved) and kept the notices; its next request, for more than the limiter allows, makes the
    shard check its parked inserts again: they go in, and the request is answered (before the
    shard did that, nothing more ever happened: both waited for each other)."""
    from reactor.launch._app import build_graph as build

    app = str(Path(__file__).resolve().parents[1] / "apps" / "budget_app.py")
    cfg = {"out": str(tmp_path / "budget.npz"), "patience_s": 10.0}
    run(build(app, cfg), app=app, config=cfg, placement="processes", deterministic=False)
    with np.load(cfg["out"]) as f:
        rec = {k: f[k] for k in f.files}
    assert int(rec["parked_before"]) == 60 and bool(rec["offered"]) and int(rec["one_sided"]) == 25
    assert int(rec["held_back"]) == 25  # the draws' notices: never sent
    assert bool(rec["answered"]) and int(rec["answered_items"]) == 20
    # In goes what the limiter allows at 50 samples (inserts + 10 - 50 <= 40: 90), no more.
    assert int(rec["inserted"]) == 90 and int(rec["parked_steps"]) == 10 and int(rec["parked_requests"]) == 0
    assert int(rec["sampled"]) == 5 + 20  # the table counts the notices it got: the message samples only


_SMALL_SHM = """
import sys
sys.path.insert(0, {root!r})
from tests.nodes.test_replay_onesided import _probe
from pathlib import Path
rec = _probe(Path({tmp!r}), "processes", batches=3, capacity=200_000)
print("offered", bool(rec["offered"]), "one_sided", int(rec["one_sided"]), "fallbacks", int(rec["fallbacks"]),
      "draws", int(rec["draws"]), "sampled", int(rec["sampled"].sum()))
"""


@pytest.mark.timeout(120)
def test_a_shard_whose_storage_does_not_fit_in_dev_shm_keeps_its_memory_and_answers_with_data(tmp_path):
    """In a mount namespace whose /dev/shm is a 4 MB tmpfs, shards of 200,000 steps (~25 MB each in
    shared memory) would fault when their rows were touched: they keep their storage in their own
    memory instead, say why, offer no one-sided sampling, and every sample comes through messages
    with the data in the replies."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace with its own /dev/shm)")
    root = str(Path(__file__).resolve().parents[2])
    script = _SMALL_SHM.format(root=root, tmp=str(tmp_path))
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, script],
        capture_output=True, text=True, timeout=100, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "does not fit in /dev/shm" in proc.stderr
    assert "offered False one_sided 0 fallbacks 3 draws 64 sampled 64" in proc.stdout, proc.stdout + proc.stderr[-2000:]


_FILLED_SHM = """
import sys
sys.path.insert(0, {root!r})
from reactor.nodes import replay
from tests.nodes.test_replay_onesided import _probe
from pathlib import Path
replay._shm_free_bytes = lambda: 1 << 40  # (as if /dev/shm filled up after the shard's check: other shards)
if {fill_after_ring!r}:  # and, for the first shard, only once its ring was made (its sampler's arrays come after)
    opened = replay.Replay._open_bulk_storage

    async def open_then_fill(self):
        storage = await opened(self)
        if not Path("/dev/shm/filler").exists():
            import os
            fd = os.open("/dev/shm/filler", os.O_CREAT | os.O_WRONLY)
            st = os.statvfs("/dev/shm")
            os.posix_fallocate(fd, 0, st.f_bavail * st.f_frsize)  # every page left
            st = os.statvfs("/dev/shm")
            print("free after filling", st.f_bavail * st.f_frsize)
        return storage

    replay.Replay._open_bulk_storage = open_then_fill
rec = _probe(Path({tmp!r}), "single", batches=3, capacity={capacity})
print("offered", bool(rec["offered"]), "one_sided", int(rec["one_sided"]), "fallbacks", int(rec["fallbacks"]),
      "draws", int(rec["draws"]), "sampled", int(rec["sampled"].sum()))
"""


@pytest.mark.timeout(120)
def test_a_shard_that_finds_no_room_in_dev_shm_when_it_reserves_its_ring_keeps_its_memory(tmp_path):
    """The ring's pages are reserved when it is made (reactor/transport/_shm.py, "Pages"): a /dev/shm
    that filled up after the shard's check of its free space (here the check is told there is
    room) refuses the reservation with ENOSPC, and the shard keeps its storage in its own memory,
    says why, and answers every sample through messages; before, the ring was made sparse and the
    shard died of SIGBUS at the insert that touched a page /dev/shm had no room for."""
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace with its own /dev/shm)")
    root = str(Path(__file__).resolve().parents[2])
    for fill_after_ring, size, capacity in ((False, "4m", 200_000), (True, "256m", 400_000)):
        # (first: the ring's own first segment finds no room; then: the ring fits, and the sampler's
        # shared arrays, made with the table after it, find none: that crashed the run before)
        script = _FILLED_SHM.format(root=root, tmp=str(tmp_path), fill_after_ring=fill_after_ring, capacity=capacity)
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, script],
            capture_output=True, text=True, timeout=100, cwd=root)
        assert proc.returncode == 0, proc.stderr[-3000:]
        said = [line for line in proc.stderr.splitlines() if "has no room for it" in line]
        assert len(said) == 2 and all("requesters sample through messages" in line for line in said), proc.stderr[-3000:]
        if fill_after_ring:
            assert "free after filling 0" in proc.stdout, proc.stdout
            assert any("-s-replay-0." in line for line in said), said  # a segment of the sampling state
        assert "offered False one_sided 0 fallbacks 3 draws 64 sampled 64" in proc.stdout, \
            proc.stdout + proc.stderr[-2000:]


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_shard_holding_inserts_back_hears_of_a_samples_draws_at_once_on_every_path(tmp_path):
    """A shard that parks inserts for want of samples (its budget's third word) is told of a sample's
    draws with that sample, not notice_every samples later: all shards on this host (sample_now),
    and a sample mixing a shard here with one behind its read server (asample_now: the server
    says so in its reply)."""
    for remote in (False, True):
        shards = [await _served_shard(tmp_path, 50 + 2 * remote, shm=True),
                  await _served_shard(tmp_path, 51 + 2 * remote, shm=not remote)]
        client = await _client_of(shards, notice_every=8)
        try:
            budgets = [_OWNED[owner][1].budget for owner, *_ in shards]
            b, notices = await client.asample_now(64)
            assert b is not None and notices == [] and client._held_samples == 1  # held, as usual
            for budget in budgets:
                budget[2] = 1  # the shard parked an insert (RateLimiter.set_parked)
            b, notices = await client.asample_now(64)
            assert b is not None and client._held_samples == 0
            assert sum(len(m.keys) for m in notices) == 128  # both samples' draws, at once
        finally:
            await _close([client], shards)

