"""Replay shards over shared memory: readers gather the windows themselves (the GEAR path).

The shard keeps its storage in POSIX shared memory (``reactor.transport.bulk``) and answers a
requester on its host with ring slots, a window mask and the version (global step) each row must
hold; the requester's ReplayClient gathers straight into the batch and drops items whose rows the
ring overwrote in between.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reactor import Graph, Input, Output, Reactor, reaction, run, startup
from reactor.launch._app import build_graph
from reactor.nodes import Replay, ReplayClient, Steps, requester_key, shard_key
from reactor.nodes.messages import (
    ReplayControl,
    ReplayReply,
    ReplayRequest,
    ShardStatistics,
    StatisticsRequest,
)
from reactor.replay import WindowRead

from ..launch.hosts import segments_launched_by


def _npz(path) -> dict:
    """An .npz file's arrays, the file closed (an NpzFile left open warns when a later test collects it)."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


APP = str(Path(__file__).resolve().parents[1] / "apps" / "replay_service.py")


def _run(config: dict, **kw):
    return run(build_graph(APP, config), app=APP, config=config, **kw)


def test_shared_memory_gathers_equal_the_message_path_bit_for_bit(tmp_path):
    """Deterministic single-process runs, windows read by the shard vs gathered by the learner."""
    before = segments_launched_by()
    cfg = {"source": "gym", "read": "window", "shards": 2, "actors": 2, "min_size": 40, "batches": 8,
           "update": "random"}
    a, b = tmp_path / "message.npz", tmp_path / "shm.npz"
    _run({**cfg, "bulk": False, "out": str(a)}, stop_s=0.2)
    _run({**cfg, "bulk": True, "out": str(b)}, stop_s=0.2)
    ka, kb = _npz(a), _npz(b)
    assert int(ka["gathered"]) == 0 and int(kb["gathered"]) == 8 * 64 and int(kb["dropped"]) == 0
    for name in ("keys", "probs", "weights", "sizes", "digest"):
        np.testing.assert_array_equal(ka[name], kb[name], err_msg=name)
    assert segments_launched_by() == before  # every shard unlinked its segments at shutdown
    # A learner "on another host" (no shared memory) reading one-sidedly through the shards' bulk
    # read servers: the path an RDMA reader takes, with zmq standing in for the verbs.
    r = tmp_path / "remote.npz"
    _run({**cfg, "bulk": True, "remote": "zmq", "out": str(r)}, stop_s=0.2)
    kr = _npz(r)
    assert int(kr["gathered"]) == 8 * 64 and int(kr["dropped"]) == 0
    for name in ("keys", "probs", "weights", "sizes", "digest"):
        np.testing.assert_array_equal(ka[name], kr[name], err_msg=name)
    c = tmp_path / "auto.npz"
    _run({**cfg, "out": str(c)}, stop_s=0.2)
    assert int(_npz(c)["gathered"]) == 0  # auto: off in deterministic runs (Reactor.deterministic)


@pytest.mark.slow
def test_learner_in_another_process_gathers_from_the_shards_shared_memory(tmp_path):
    """Async run, shards and learner in separate processes: windows come through shared memory."""
    before = segments_launched_by()
    out = tmp_path / "learner.npz"
    _run({"source": "gym", "read": "window", "shards": 2, "actors": 1, "min_size": 50, "batches": 10,
          "out": str(out)}, placement="processes", deterministic=False)
    rec = _npz(out)
    assert rec["lens"].sum() + int(rec["dropped"]) == 10 * 64
    assert int(rec["gathered"]) == 10 * 64  # auto: on in async runs
    assert segments_launched_by() == before


@pytest.mark.slow
def test_learner_of_another_host_reads_windows_one_sidedly_over_curve(tmp_path):
    """Async run, every process on tcp (so the run's links, and the shards' read servers, use
    CURVE): a learner without shared memory gets plans and reads the windows from the shards'
    bulk read servers itself, in another process (the RDMA path's shape, zmq standing in)."""
    placement = tmp_path / "placement.toml"
    placement.write_text("\n".join(
        f'[groups.{name}]\nreactors = ["{pattern}"]\nbind = "tcp://127.0.0.1:*"\n'
        for name, pattern in (("learner", "learner"), ("stats", "stats"), ("actors", "actor*"),
                              ("shard0", "replay[[]0]"), ("shard1", "replay[[]1]"))))
    out = tmp_path / "learner.npz"
    before = segments_launched_by()
    res = _run({"source": "gym", "read": "window", "shards": 2, "actors": 1, "min_size": 50, "batches": 10,
                "remote": "zmq", "out": str(out)}, placement=str(placement), deterministic=False)
    rec = _npz(out)
    assert rec["lens"].sum() + int(rec["dropped"]) == 10 * 64
    assert int(rec["gathered"]) == 10 * 64  # every item through a one-sided read, none in a reply
    assert len(res.processes) == 5 and all(s["curve"] for s in res.processes.values())
    assert rec["curve_keys"].tolist() == [True, True]  # both shards' read servers speak CURVE
    assert segments_launched_by() == before


class _RingProbe(Reactor):
    """The ports of a prober of one shard of a 64-step ring of ids, and the fill of the whole ring."""

    steps = Output(Steps)
    requests = Output(ReplayRequest)
    control = Output(ReplayControl)
    replies = Input(ReplayReply)
    statistics = Input(ShardStatistics)

    def __init__(self, out: list) -> None:
        self.out = out
        self.held = None
        self.seq = 0

    def _fill(self, first: int) -> None:
        for e in range(8):  # 8 episodes of 8 steps = the whole 64-step ring
            ids = np.arange(first + 8 * e, first + 8 * e + 8, dtype=np.int64)
            self.steps.send(Steps(0, 0, self.seq, {"id": ids}, np.arange(8) == 7))
            self.seq += 1


_P = _RingProbe


class Prober(_RingProbe):
    """Asks one shard for windows, then overwrites its whole ring before gathering the reply."""

    @reaction(triggers=[startup], effects=[_P.steps, _P.requests])
    def begin(self) -> None:
        self.client = ReplayClient(1, rng=self.rng, timeout_s=None)
        self._fill(0)
        for m in self.client.request(16):
            self.requests.send(m)

    @reaction(triggers=[_P.replies], effects=[_P.steps, _P.control])
    def hold(self, replies: ReplayReply) -> None:
        self.held = replies
        self._fill(1000)  # overwrites every row the reply points at
        self.control.send(StatisticsRequest())  # answered after those inserts

    @reaction(triggers=[_P.statistics])
    def gather(self, statistics: ShardStatistics) -> None:
        _, batch = self.client.receive(self.held)
        self.out.append((batch, self.client.dropped_items, self.client.gathered_items, statistics.inserted))
        self.client.close()


def _run_probe(prober: _RingProbe) -> None:
    """``prober`` against one bulk shard of a 64-step ring of ids (WindowRead(4)), in one process."""
    g = Graph()
    p = g.add(prober, name="prober")
    r = g.add(Replay([("id", (), "int64")], 64, read=WindowRead(4), bulk=True), name="replay")
    g.connect(p.steps, r.steps, key=shard_key)
    g.connect(p.requests, r.requests, key=shard_key)
    g.connect(p.control, r.control, delay_s=0.0005)  # after the steps sent with it (same tag: link order)
    g.connect(r.replies, p.replies, key=requester_key, delay_s=0.001)
    g.connect(r.statistics, p.statistics, delay_s=0.001)
    run(g)


def test_items_whose_rows_the_ring_overwrote_are_dropped_never_returned_torn():
    out: list = []
    _run_probe(Prober(out))
    batch, dropped, gathered, inserted = out[0]
    assert inserted == 128 and gathered == 16
    assert dropped == 16 and len(batch.keys) == 0  # every row was overwritten: nothing torn comes back


class RefusedProber(_RingProbe):
    """Fills the ring, then sends steps the table refuses in the middle of the insert (a NaN priority)
    over the oldest rows, then samples and gathers every item."""

    @reaction(triggers=[startup], effects=[_P.steps, _P.control])
    def begin(self) -> None:
        self.client = ReplayClient(1, rng=self.rng, timeout_s=None)
        self._fill(0)
        prio = np.ones(8)
        prio[5] = np.nan
        self.steps.send(Steps(0, 0, self.seq, {"id": np.arange(64, 72, dtype=np.int64)}, np.arange(8) == 7,
                              priorities=prio))
        self.control.send(StatisticsRequest())

    @reaction(triggers=[_P.statistics], effects=[_P.requests])
    def sample(self, statistics: ShardStatistics) -> None:
        self.stats = statistics
        for m in self.client.request(64):
            self.requests.send(m)

    @reaction(triggers=[_P.replies])
    def gather(self, replies: ReplayReply) -> None:
        _, batch = self.client.receive(replies)
        self.out.append((batch, self.client.dropped_items, self.client.gathered_items, self.stats))
        self.client.close()


def test_a_refused_insert_leaves_the_rows_it_would_have_overwritten_readable():
    """The shard opens the rows' sequence lock before the table's insert; an insert the table refuses
    midway (here a NaN priority) puts their versions back, so readers still gather them whole."""
    out: list = []
    _run_probe(RefusedProber(out))
    batch, dropped, gathered, stats = out[0]
    assert stats.rejected_steps == 8 and stats.inserted == 64
    assert gathered == 64 and dropped == 0
    ids, mask = batch.data["id"].numpy(), batch.data["mask"].numpy()
    assert ids.shape == (64, 4) and (ids[mask] < 64).all()  # the old rows (never the refused 64..71)
