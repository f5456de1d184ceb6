"""Staged inserts (``reactor/nodes/_staging.py``): a writer's flushes for a shard of its host go through a
ring in shared memory, the message says where.

The ring's bookkeeping against a writer that sends every row in its messages (the same steps, the same
messages but for where the rows are), with the region mapped by a shard's own reader; a staged message's
rows are never written over before its ack; the shard refuses a staged word it cannot read (logged,
acknowledged, counted) and keeps serving; and in a run of real processes the shards read what the
writers staged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import shutil
from typing import Any

import numpy as np
import pytest
import torch

from reactor import Graph, Input, Output, Reactor, reaction, run, startup
from reactor.nodes import Replay
from reactor.nodes._staging import MAX_STAGING_NBYTES, StagedReader, Staging, region_name, take_ack
from reactor.nodes.messages import InsertAck, ReplayControl, ShardStatistics, StatisticsRequest, Steps
from reactor.nodes.writer import TransitionPattern, Writer
from reactor.replay import FieldSpec
from tests.nodes.test_writer import FIELDS

OTHER_PID = os.getpid() + 1  # (a shard "in another process": the real one is the end-to-end test's)


def _writer(shards: int) -> Writer:
    return Writer(FIELDS, num_streams=6, pattern=TransitionPattern(n=2, chunk_length=16), num_shards=shards,
                  flush_steps=40)


def _step(rng: np.random.Generator, k: int, n: int) -> tuple[dict, np.ndarray, np.ndarray, dict]:
    step = {"id": np.arange(n) * 1_000_000 + k, "obs": rng.normal(size=(n, 3)).astype(np.float32),
            "action": rng.integers(0, 5, size=n), "reward": rng.normal(size=n).astype(np.float32)}
    term = rng.random(n) < 0.05
    trunc = (rng.random(n) < 0.03) & ~term
    return step, term, trunc, {"obs": rng.normal(size=(n, 3)).astype(np.float32)}


@pytest.fixture
def staging_of():
    made: list[Staging] = []
    readers: list[StagedReader] = []

    def make(writer: Writer, rows_per_shard: int) -> tuple[Staging, StagedReader]:
        st = Staging.open(f"t{secrets.token_hex(6)}", "stage-w", writer.specs, writer.num_shards, rows_per_shard,
                          "test")
        assert st is not None
        writer.use_staging(st)
        made.append(st)
        readers.append(StagedReader())
        return st, readers[-1]

    yield make
    for r in readers:
        r.close()
    for st in made:
        st.close()


def test_staged_flushes_carry_what_messages_carry_through_wraps_and_a_full_ring(staging_of):
    """Two writers fed the same steps, one staging for its shards, one not: every message matches (rows,
    ends, mask, priorities), read back through a shard's reader; a ring whose shard holds its acks back
    fills, and its flushes go in their messages (nothing waits); a staged message's rows are unchanged in
    the region when its ack comes (nothing wrote over them)."""
    a, b = _writer(2), _writer(2)
    st, reader = staging_of(a, 200)  # a flush is 40-60 rows: the ring wraps every few
    for k in range(2):
        a.acknowledged(k, st.host, OTHER_PID)  # (as a shard's ack says: it reads this host's regions)
        a.unacked[k] += 1  # (that ack was for no message of this test)
    rng = np.random.default_rng(3)
    pending: list[list[tuple]] = [[], []]  # per shard, unacked: (seq, staged word, the rows as sent)
    staged = plain = wrapped = 0
    hold_shard0 = range(40, 130)  # steps during which shard 0 acknowledges nothing
    for k in range(160):
        step, term, trunc, final = _step(rng, k, 6)
        prio = rng.uniform(0.1, 2.0, size=6)
        got_a = a.append(step, terminated=term, truncated=trunc, final=final, priorities=prio)
        got_b = b.append(step, terminated=term, truncated=trunc, final=final, priorities=prio)
        assert len(got_a) == len(got_b)
        for ma, mb in zip(got_a, got_b):
            assert (ma.shard, ma.seq) == (mb.shard, mb.seq)
            np.testing.assert_array_equal(ma.episode_end, mb.episode_end)
            assert (ma.item_mask is None) == (mb.item_mask is None)
            if ma.item_mask is not None:
                np.testing.assert_array_equal(ma.item_mask, mb.item_mask)
            np.testing.assert_array_equal(ma.priorities, mb.priorities)
            if ma.staged is None:
                plain += 1
                rows = ma.fields
            else:
                staged += 1
                assert ma.fields == {}
                rows = {n: t.numpy() for n, t in reader.rows(ma.staged).items()}
                wrapped += ma.staged[1] == ma.shard * 200 and st.head[ma.shard] > ma.staged[2]  # (the ring's head again)
            assert set(rows) == set(mb.fields)
            for n in mb.fields:
                np.testing.assert_array_equal(rows[n], mb.fields[n])
            pending[ma.shard].append((ma.seq, ma.staged, {n: np.array(v) for n, v in rows.items()}))
        for shard in (0, 1):  # the shards take what came, one ack per message, in order
            if shard == 0 and k in hold_shard0:
                continue
            while pending[shard]:
                seq, word, sent = pending[shard].pop(0)
                if word is not None:
                    now = {n: t.numpy() for n, t in reader.rows(word).items()}
                    for n in sent:
                        np.testing.assert_array_equal(now[n], sent[n])
                a.acknowledged(shard, st.host, OTHER_PID, seq)
                b.acknowledged(shard)
    assert staged > 10 and plain > 0 and wrapped > 0, (staged, plain, wrapped)  # (shard 0's held acks filled its ring)
    assert st.staged_messages == staged
    assert (st.head == st.tail).all() and not any(st.held)  # every message acknowledged: the rings are free


def test_a_ring_is_used_only_for_a_shard_that_says_it_reads_it_and_a_lost_shards_rows_are_freed(staging_of):
    w = _writer(2)
    st, _ = staging_of(w, 500)
    rng = np.random.default_rng(5)

    def flushes(n: int) -> list:
        out = []
        for k in range(n):
            out += w.append(*_step(rng, k, 6)[:1], terminated=np.zeros(6, bool), truncated=np.ones(6, bool),
                            final={"obs": np.zeros((6, 3), np.float32)})
        return out

    assert all(m.staged is None for m in flushes(30))  # no shard said so yet
    while w.unacked.sum():
        w.acknowledged(int(np.argmax(w.unacked)), "", 0)  # acks of shards that do not read staged rows
    assert all(m.staged is None for m in flushes(30))
    w.acknowledged(0, st.host, os.getpid())  # a shard in this very process: it is handed messages as they are
    assert not st.ok[0]
    w.acknowledged(1, st.host + "x", OTHER_PID)  # another host
    assert not st.ok[1]
    w.acknowledged(0, st.host, OTHER_PID)
    msgs = flushes(30)
    assert any(m.staged is not None for m in msgs if m.shard == 0)
    assert all(m.staged is None for m in msgs if m.shard == 1)
    assert st.head[0] > st.tail[0]
    w.shard_lost(0)  # died: it will read none of them
    assert st.head[0] == st.tail[0] and not st.held[0] and not st.ok[0]
    assert all(m.staged is None for m in flushes(30) if m.shard == 0)  # until its next life says so


def test_a_staging_region_is_bounded_and_its_name_is_a_bulk_name(staging_of):
    big = Writer([FieldSpec("frame", (84, 84, 4), torch.uint8)], num_streams=2, pattern=TransitionPattern(),
                 num_shards=4, flush_steps=512, obs_fields=("frame",))
    st, _ = staging_of(big, 10_000)
    assert st.rows_per_shard == MAX_STAGING_NBYTES // (84 * 84 * 4 * 4)
    assert region_name("actor[3]") == "stage-actor-3"
    long = region_name("x" * 80)
    assert long.startswith("stage-") and len(long) <= 64 and long == region_name("x" * 80)


SHARD_FIELDS = [("obs", (3,), "float32"), ("action", (), "int64")]


class _Sender(Reactor):
    """Sends one shard, in one process, what ``plan(run_id)`` makes: ``(staging, messages)``; then asks
    for the shard's statistics and writes them to ``report`` with the seqs of the acks it got."""

    out = Output(Steps)
    ask = Output(ReplayControl)
    acks = Input(InsertAck)
    stats = Input(ShardStatistics)

    def __init__(self, plan: Any, report: str) -> None:
        self.plan, self.report = plan, report

    @reaction(triggers=[startup], effects=[out, ask])
    def send(self) -> None:
        self.st, msgs = self.plan(self.run_id)
        for m in msgs:
            self.out.send(m)
        self.acked: list[int] = []
        self.hosts: list[bool] = []  # (per ack: whether it says a host, which keeps staging on)
        self.ask.send(StatisticsRequest())

    @reaction(triggers=[acks])
    def take(self, acks: InsertAck) -> None:
        self.acked.append(acks.seq)
        self.hosts.append(bool(acks.host))

    @reaction(triggers=[stats])
    def got(self, stats: ShardStatistics) -> None:
        with open(self.report, "w") as f:
            json.dump({"acks": self.acked, "hosts": self.hosts, "size": stats.size, "parked": stats.parked_steps,
                       "rejected": stats.rejected_steps, "staged": stats.staged_steps}, f)
        self.st.close()


def _shard_fed(tmp_path, plan: Any, with_hosts: bool = False, **replay_kw: Any) -> dict:
    """Run a Replay shard fed by a :class:`_Sender` with ``plan``; what the sender wrote (``hosts``:
    with ``with_hosts``)."""
    report = tmp_path / "report.json"
    g = Graph()
    sender = g.add(_Sender(plan, str(report)), name="sender")
    shard = g.add(Replay(SHARD_FIELDS, 1000, **replay_kw), name="replay")
    g.connect(sender.out, shard.steps, delay_s=1e-6)
    g.connect(shard.acks, sender.acks, delay_s=1e-6)
    g.connect(sender.ask, shard.control, delay_s=1e-3)
    g.connect(shard.statistics, sender.stats, delay_s=1e-6)
    run(g)
    got = json.loads(report.read_text())
    if not with_hosts:
        del got["hosts"]
    return got


def _staged_episodes(run_id: str, steps: int, episode: int) -> tuple[Staging, list[Steps]]:
    """A one-shard writer that stages every flush: ``steps`` steps of one stream in episodes of
    ``episode``, one message an episode."""
    w = Writer(SHARD_FIELDS, 1, TransitionPattern(), flush_steps=1)
    st = Staging.open(run_id, "stage-sender", w.specs, 1, 64, "sender")
    assert st is not None
    w.use_staging(st)
    st.ok[0] = True
    msgs = []
    for k in range(steps):
        msgs += w.append({"obs": np.full((1, 3), k, np.float32), "action": np.array([k])},
                         terminated=np.array([k % episode == episode - 1]), truncated=np.array([False]),
                         final={"obs": np.zeros((1, 3), np.float32)})
    return st, msgs + w.flush()


def test_a_shard_refuses_a_staged_word_it_cannot_read_keeps_serving_and_counts_the_rows(tmp_path, caplog):
    """Words a writer (or a hostile peer) could send in ``Steps.staged``: each refused with a line naming
    what was wrong, acknowledged (the writer's count stays right), its rows counted as rejected; the good
    one after them is inserted from the region and counted as staged."""
    good: list[Steps] = []

    def plan(run_id: str) -> tuple[Staging, list[Steps]]:
        st, msgs = _staged_episodes(run_id, 6, 6)
        good.append(msgs[0])
        desc, first, rows = msgs[0].staged
        ends = msgs[0].episode_end
        bad = [[desc, first], (desc, first, 10_000), (desc, -1, rows), (desc, float(first), rows),
               ({**desc, "host": "elsewhere/0"}, first, rows), ({**desc, "run_id": "another"}, first, rows),
               ("nope", first, rows)]
        out = [Steps(0, 1, i, {}, ends, staged=word) for i, word in enumerate(bad)]
        out.append(Steps(0, 1, 90, {"obs": np.zeros((len(ends), 3), np.float32)}, ends, staged=msgs[0].staged))
        return st, [*out, Steps(0, 1, 99, {}, ends, msgs[0].item_mask, msgs[0].priorities, staged=msgs[0].staged)]

    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        got = _shard_fed(tmp_path, plan)
    refused = [m for m in caplog.messages if "its staged rows cannot be read" in m]
    assert len(refused) == 8, caplog.messages
    for why in ("staged must be (descriptor, first row, rows)", "outside region", "first row must be an int",
                "not this one", "is of run 'another', not this shard's", "staged descriptor must be a map",
                "not in fields"):
        assert any(why in m for m in refused), (why, refused)
    rows = len(good[0].episode_end)
    items = int(good[0].item_mask.sum())
    assert 0 < items < rows  # (the episode's last observation is a row, not an item)
    assert got == {"acks": [0, 1, 2, 3, 4, 5, 6, 90, 99], "size": items, "parked": 0, "rejected": 8 * rows,
                   "staged": rows}, got


def test_an_ack_of_a_message_this_writer_never_sent_frees_none_of_its_rows(staging_of):
    """A restarted actor's writer numbers its messages from 0 again, and a shard still holding its previous
    life's messages (parked by its rate limiter while the learner was down too) acknowledges them to the new
    life. Such acks, and any whose ``seq`` names no message in flight, free nothing: acks that freed the
    oldest rows whatever they named let the writer write over staged rows the shard had not read yet, which
    it then inserted (another flush's rows, silently)."""
    w = _writer(1)
    st, reader = staging_of(w, 200)  # ~4 flushes of 40-60 rows
    st.ok[0] = True  # (the shard's first ack said it reads staged rows)
    rng = np.random.default_rng(7)
    in_flight: list[tuple] = []  # (message, its rows as sent)
    stale = iter(range(10_001, 10_100))  # seqs of the previous life's messages, parked at the shard
    k = 0
    while len(in_flight) < 12:
        step, term, trunc, final = _step(rng, k, 6)
        k += 1
        for m in w.append(step, terminated=term, truncated=trunc, final=final):
            rows = m.fields if m.staged is None else {n: t.numpy() for n, t in reader.rows(m.staged).items()}
            in_flight.append((m, {n: np.array(v) for n, v in rows.items()}))
            w.acknowledged(0, st.host, OTHER_PID, next(stale))  # the shard takes an old one meanwhile
    assert sum(m.staged is not None for m, _ in in_flight) >= 4
    for m, sent in in_flight:  # the shard reads this life's messages now, in order, and acknowledges each
        if m.staged is not None:
            now = reader.rows(m.staged)
            for n in sent:
                np.testing.assert_array_equal(now[n].numpy(), sent[n], err_msg=f"seq {m.seq}: {n} written over")
        w.acknowledged(0, st.host, OTHER_PID, m.seq)
    assert st.head[0] == st.tail[0] and not st.held[0]


def test_a_rings_staged_rows_are_never_placed_over_rows_in_flight_against_a_reference():
    """Random flush sizes (up to past the ring), end markers, messages in flight when staging begins, acks
    late, stray acks (of no message in flight), lost shards: every staged flush lies in its shard's ring,
    over no row of a staged message not yet acknowledged (a reference list of them)."""
    rng = np.random.default_rng(11)
    specs = [FieldSpec("a", (), torch.int64)]
    for _trial in range(60):
        cap, shards = int(rng.integers(1, 40)), int(rng.integers(1, 4))
        st = Staging.open(f"t{secrets.token_hex(6)}", "stage-w", specs, shards, cap, "test")
        assert st is not None
        try:
            before = rng.integers(0, 3, size=shards)
            st.start([int(b) for b in before])  # (messages sent before staging began)
            seq = 0
            in_flight = [[(None, None)] * int(before[k]) for k in range(shards)]  # per shard: (seq, rows range)
            st.ok[:] = True
            for _ in range(300):
                k, op = int(rng.integers(shards)), rng.random()
                if op < 0.1:
                    st.sent(k, 0)  # an end marker
                    in_flight[k].append((seq, None))
                elif op < 0.5:
                    rows = int(rng.integers(1, cap + 3))
                    word = st.put(k, ["a"], [{"a": np.arange(rows)}], rows)
                    span = None
                    if word is not None:
                        span = (word[1], word[1] + rows)
                        assert word[2] == rows and k * cap <= span[0] and span[1] <= (k + 1) * cap
                        for _, other in in_flight[k]:
                            assert other is None or span[1] <= other[0] or other[1] <= span[0], (span, other)
                    in_flight[k].append((seq, span))
                elif op < 0.85:  # an ack of the oldest few (a coalesced ack covers every message before it)
                    n = min(len(in_flight[k]), int(rng.integers(1, 4)))
                    del in_flight[k][:n]
                    st.acked(k, n, st.host, OTHER_PID)
                elif op < 0.95:
                    st.acked(k, 0, st.host, OTHER_PID)  # a stray ack (of no message in flight: the writer says 0)
                else:
                    st.lost(k)
                    in_flight[k] = []
                    st.ok[k] = True
                seq += 1
        finally:
            st.close()


def test_a_writer_whose_flush_no_bounded_ring_holds_makes_no_region():
    """Large rows over many shards: a ring of 64 MiB / 8 shards holds 297 frames, fewer than one flush of 512,
    so nothing would ever be staged; the region is not made (its memory, reserved when made, was 64 MiB of
    /dev/shm per actor for nothing), and the writer's rows go in its messages."""
    from reactor.nodes._staging import stage_writer
    from reactor.transport._shm import list_segments

    run_id = f"t{secrets.token_hex(6)}"
    w = Writer([FieldSpec("frame", (84, 84, 4), torch.uint8)], num_streams=2, pattern=TransitionPattern(),
               num_shards=8, flush_steps=512, obs_fields=("frame",))
    st = stage_writer(w, run_id, "actor[0]", 8)
    try:
        assert st is None and w.staging is None
        assert list_segments(run_id) == []
    finally:
        if st is not None:
            st.close()
    few = Writer(FIELDS, num_streams=6, pattern=TransitionPattern(n=2, chunk_length=16), num_shards=8, flush_steps=40)
    st = stage_writer(few, run_id, "actor[1]", 8)  # (small rows: a region, its rings for 9 of its largest flushes)
    try:
        assert st is not None and few.staging is st and st.rows_per_shard >= 9 * few.flush_steps
        assert list_segments(run_id)
    finally:
        if st is not None:
            st.close()
    assert list_segments(run_id) == []


def test_a_restarted_lifes_writer_counts_no_ack_of_its_last_lifes_messages(staging_of):
    """A restarted actor's writer numbers its messages past its last life's (``first_seq``, the actor's
    ``restarts << 32``): a shard that still held that life's messages (parked) acks them to the new life,
    and those acks free none of its staged rows and leave its count of unacknowledged messages alone (they
    let it send past ``max_unacked`` before)."""
    w = Writer(FIELDS, num_streams=6, pattern=TransitionPattern(n=2, chunk_length=16), num_shards=1,
               flush_steps=40, max_unacked=8, first_seq=1 << 32)
    st, reader = staging_of(w, 400)
    w.acknowledged(0, st.host, OTHER_PID, seq=5)  # the last life's message 5: counts for nothing ...
    assert not st.ok[0] and w.unacked[0] == 0
    st.ok[0] = True  # (... so the shard's say is taken from this life's first ack, here set)
    rng = np.random.default_rng(11)
    msgs = []
    for k in range(40):
        msgs += w.append(*_step(rng, k, 6)[:1], terminated=np.zeros(6, bool), truncated=np.ones(6, bool),
                         final={"obs": np.zeros((6, 3), np.float32)})
    staged = [m for m in msgs if m.staged is not None]
    assert staged and msgs[0].seq == 1 << 32
    held, unacked = [list(h) for h in st.held], w.unacked.copy()
    for old in range(len(msgs) + 8):  # every seq the last life could have used
        w.acknowledged(0, st.host, OTHER_PID, seq=old)
    assert [list(h) for h in st.held] == held and (w.unacked == unacked).all()
    w.acknowledged(0, st.host, OTHER_PID, seq=msgs[0].seq)  # this life's: frees its first
    assert len(st.held[0]) == len(held[0]) - 1 and w.unacked[0] == unacked[0] - 1


def _staged_in_flight(w: Writer, staging_of: Any) -> tuple[Staging, list[Steps]]:
    """Six staged messages of ``w`` in flight to its one shard, the fourth the first that asks for an ack."""
    st, _ = staging_of(w, 2000)
    st.ok[0] = True
    rng = np.random.default_rng(4)
    msgs: list = []
    k = 0
    while len(msgs) < 6:
        msgs += w.append(*_step(rng, k, 6)[:1], terminated=np.zeros(6, bool), truncated=np.ones(6, bool),
                         final={"obs": np.zeros((6, 3), np.float32)})
        k += 1
    assert all(m.staged is not None for m in msgs) and [m.ack for m in msgs[:4]] == [False, False, False, True]
    return st, msgs


def test_an_ack_without_a_seq_counts_its_messages_and_their_rows_go_with_the_next_ack_naming_one(staging_of):
    """The writer says which messages an ack covers, and its staging takes those off its list (one list of
    them: the two kept a list each). An ack without a seq (a user's actor that counts acks itself) counts
    through the oldest message that asked for one, and is no proof of what the shard has read: their rows are
    kept, and freed by the next ack that names a message in flight (the shard read them before it)."""
    w = Writer(FIELDS, num_streams=6, pattern=TransitionPattern(n=2, chunk_length=16), num_shards=1,
               flush_steps=40, max_unacked=8)
    st, msgs = _staged_in_flight(w, staging_of)
    w.acknowledged(0, st.host, OTHER_PID)  # counts through the first asking message: the first four
    assert w.unacked[0] == len(msgs) - 4 and len(st.held[0]) == len(msgs) - 4
    assert st.tail[0] == 0 and st.kept[0] == sum(m.staged[2] for m in msgs[:4])
    w.acknowledged(0, st.host, OTHER_PID, seq=msgs[-1].seq)
    assert w.unacked[0] == 0 and not st.held[0] and st.tail[0] == st.head[0] and st.kept[0] == 0


def test_an_ack_whose_seq_is_malformed_frees_no_staged_rows_the_shard_may_not_have_read(staging_of):
    """An ack whose seq is not an int (a peer's word: ``take_ack`` counts it as none) still counts, but frees
    no staged rows: one that is stray, or the shard's in transit when it died, counted messages whose rows
    the shard had not read, and with them freed the writer wrote its next flushes over them (16cc04f). Here
    as with no message asking in flight, when it cannot be any of theirs."""
    w = Writer(FIELDS, num_streams=6, pattern=TransitionPattern(n=2, chunk_length=16), num_shards=1,
               flush_steps=40, max_unacked=8)
    st, msgs = _staged_in_flight(w, staging_of)
    w.acknowledged(0, st.host, OTHER_PID, seq=msgs[3].seq)  # the shard read the first four
    freed = st.tail[0]
    assert freed == sum(m.staged[2] for m in msgs[:4]) and [m.ack for m in msgs[4:]] == [False, False]
    take_ack(w, 0, 1.5, st.host, OTHER_PID, "unused", "actor[0]", 8)  # no message asking: it is none of theirs
    assert st.tail[0] == freed and st.head[0] - st.tail[0] == sum(m.staged[2] for m in msgs[4:])
    w.acknowledged(0, st.host, OTHER_PID, seq=msgs[-1].seq)  # (a stray one names no message in flight now)
    assert st.tail[0] == freed
    later = w.end()  # the end marker asks: its ack frees what the malformed one counted
    w.acknowledged(0, st.host, OTHER_PID, seq=later[-1].seq)
    assert st.tail[0] == st.head[0] and st.kept[0] == 0 and not st.held[0]


def _fed_a_word_of_another_region(tmp_path, caplog, other: Any) -> tuple[dict, list[str]]:
    """A real shard fed one staged message whose word names a region ``other(run_id, msgs)`` makes (it
    returns the region, closed after the run, and the message); what the sender saw, and the shard's log.
    Such a message is refused: nothing inserted, its rows counted as rejected, its ack sent."""
    regions: list[Staging] = []
    sent: list[Steps] = []

    def plan(run_id: str) -> tuple[Staging, list[Steps]]:
        st, msgs = _staged_episodes(run_id, 6, 6)
        region, msg = other(run_id, msgs)
        regions.append(region)
        sent.append(msg)
        return st, sent

    try:
        with caplog.at_level(logging.ERROR, logger="reactor.replay"):
            got = _shard_fed(tmp_path, plan)
    finally:
        for region in regions:
            region.close()
    assert got == {"acks": [0], "size": 0, "parked": 0, "rejected": len(sent[0].episode_end), "staged": 0}, got
    return got, [m for m in caplog.messages if "its staged rows cannot be read" in m]


def test_a_shard_refuses_the_staged_rows_of_another_runs_region(tmp_path, caplog):
    """Regression: a staged word naming a region of another run on the host, its descriptor whole (the
    segment names derived from that run's id, its owner live), was mapped and its rows inserted: the
    names were checked against the descriptor's run id, not the shard's. Refused now, naming both."""

    def other_run(run_id: str, msgs: list[Steps]) -> tuple[Staging, Steps]:
        other, theirs = _staged_episodes(f"other{secrets.token_hex(4)}", 6, 6)
        return other, dataclasses.replace(theirs[0], writer=1)

    _, refused = _fed_a_word_of_another_region(tmp_path, caplog, other_run)
    assert any("is of run 'other" in m and "not this shard's" in m for m in refused), refused


def test_a_shard_refuses_staged_rows_of_a_region_of_its_run_that_is_no_staging_region(tmp_path, caplog):
    """A descriptor of another region of the run (a shard's own shared ring, say: mapped again, its memory
    is not told apart from the ring by address, and the insert would copy it over itself) is refused:
    a shard reads rows only from regions named as writers' staging regions are."""

    def ring_of_the_run(run_id: str, msgs: list[Steps]) -> tuple[Staging, Steps]:
        ring = Staging.open(run_id, "ring-replay", Writer(SHARD_FIELDS, 1, TransitionPattern()).specs, 1, 64, "sender")
        assert ring is not None
        _, first, rows = msgs[0].staged
        return ring, dataclasses.replace(msgs[0], staged=(ring.descriptor, first, rows))

    _, refused = _fed_a_word_of_another_region(tmp_path, caplog, ring_of_the_run)
    assert any("'ring-replay' is not a writer's staging region" in m for m in refused), refused


@pytest.mark.parametrize("planted", ["fifo", "another user's file"])
def test_a_shard_refuses_staged_rows_whose_segment_is_a_planted_fifo_or_another_users_file(tmp_path, caplog, planted):
    """Hostile probe (session 74): a segment's name follows from the run id, and /dev/shm is anyone's to
    write. A FIFO put at the name of a staged region's segment held the shard in open() until someone wrote
    to it: its whole loop, every writer's inserts with it. Another user's copy of a live writer's segments
    (its header naming that writer as owner) was mapped and its rows inserted. Both are refused in a line."""
    if planted != "fifo" and os.geteuid() != 0:
        pytest.skip("making a file of another user needs root")

    def planted_region(run_id: str, msgs: list[Steps]) -> tuple[Staging, Steps]:
        region = Staging.open(run_id, "stage-planted", Writer(SHARD_FIELDS, 1, TransitionPattern()).specs, 1, 64,
                              "sender")
        assert region is not None
        desc = region.descriptor
        path = "/dev/shm" + desc["shm"]["segments"]["obs"]
        if planted == "fifo":
            os.unlink(path)
            os.mkfifo(path, 0o666)
        else:
            os.chown(path, 65534, 65534)
        _, first, rows = msgs[0].staged
        return region, dataclasses.replace(msgs[0], staged=(desc, first, rows))

    _, refused = _fed_a_word_of_another_region(tmp_path, caplog, planted_region)
    words = "is not a regular file" if planted == "fifo" else "a file of uid 65534, not of this process's user"
    assert any(words in m for m in refused), refused
    assert all(len(m) < 700 for m in caplog.messages)


def test_a_refused_staged_message_is_acknowledged_after_the_writers_parked_ones_not_ahead(tmp_path):
    """Regression (the staged path's first version): a staged word the shard could not read was refused and
    acknowledged as it arrived, ahead of that writer's earlier messages the rate limiter held (parked); an
    ack frees the rows of the messages before it too, so the writer could write over rows the shard had not
    inserted yet. It is refused where it is inserted now, in the writer's order."""

    def plan(run_id: str) -> tuple[Staging, list[Steps]]:
        st, msgs = _staged_episodes(run_id, 12, 6)
        first, held = msgs[0], msgs[1]  # inserted; parked (the limiter wants samples first)
        bad = Steps(0, 0, held.seq + 1, {}, held.episode_end, staged=(held.staged[0], 10_000, 5))
        return st, [first, held, bad]

    got = _shard_fed(tmp_path, plan, rate_limiter={"type": "SampleToInsertRatio", "samples_per_insert": 1.0,
                                                   "min_size": 1, "error_buffer": 8.0})
    assert got["size"] > 0 and got["parked"] > 0, got  # (the premise: the second message is parked)
    assert got["acks"] == [0] and got["rejected"] == 0, got  # the refusal waits behind it, unacknowledged


def test_an_acks_malformed_words_count_as_none_and_the_ack_still_counts(staging_of):
    """``take_ack`` takes an ``InsertAck``'s seq, host and pid from a peer: bytes for the host, a string for the
    pid, a host past 512 characters each count as none (the ack still counts for its message, and turns no
    ring on); an array for the seq (compared with the held seqs, it raised "truth value of an array is
    ambiguous" in the actor's reaction) counts as none: as an ack naming no message, it frees no staged rows.
    (The messages are in flight, as a shard's acks find them: an ack that counts for none turns no ring on
    whatever its words say, and would check nothing of them.)"""
    w = _writer(1)  # (every message asks for an ack)
    st, _ = staging_of(w, 200)
    rng = np.random.default_rng(13)

    def flushes(n: int) -> list[Steps]:
        out: list[Steps] = []
        while len(out) < n:
            out += w.append(*_step(rng, len(out), 6)[:1], terminated=np.zeros(6, bool), truncated=np.ones(6, bool),
                            final={"obs": np.zeros((6, 3), np.float32)})
        return out

    plain = flushes(4)
    assert all(m.staged is None and m.ack for m in plain)
    for m, host, pid in ((plain[0], st.host.encode(), OTHER_PID), (plain[1], st.host, str(OTHER_PID)),
                         (plain[2], "h" * 600, OTHER_PID)):
        take_ack(w, 0, m.seq, host, pid, "unused", "actor[0]", None)
        assert not st.ok[0] and w.unacked[0] == len(plain) - 1 - plain.index(m)
    take_ack(w, 0, plain[3].seq, st.host, OTHER_PID, "unused", "actor[0]", None)  # (well formed: the ring on)
    staged = flushes(2)
    assert st.ok[0] and all(m.staged is not None for m in staged) and w.unacked[0] == len(staged)
    take_ack(w, 0, np.array([m.seq for m in staged]), st.host, OTHER_PID, "unused", "actor[0]", None)
    assert w.unacked[0] == len(staged) - 1 and st.tail[0] == 0 and st.kept[0] == staged[0].staged[2]


def test_a_shard_acknowledges_only_the_messages_that_ask_staged_plain_or_refused(tmp_path):
    """Coalesced acks, against a real shard: of a writer's messages it inserts or refuses, it acknowledges
    those whose ``Steps.ack`` is not False, in order, and nothing for the others (a later ack covers them);
    every message is still inserted (or refused) and counted."""

    made: list[Steps] = []

    def plan(run_id: str) -> tuple[Staging, list[Steps]]:
        st, msgs = _staged_episodes(run_id, 12, 2)  # 6 staged messages of one 2-step episode each
        assert len(msgs) == 6 and all(m.staged is not None for m in msgs)
        made.extend(msgs)
        plain = Steps(0, 0, 50, {"obs": np.ones((2, 3), np.float32), "action": np.zeros(2, np.int64)},
                      np.array([False, True]), ack=False)
        bad = Steps(0, 0, 60, {}, msgs[0].episode_end, staged=(msgs[0].staged[0], 10_000, 2), ack=False)
        bad_asks = dataclasses.replace(bad, seq=61, ack=True)
        asks = [False, False, True, False, True, False]
        out = [dataclasses.replace(m, ack=a) for m, a in zip(msgs, asks)]
        return st, [*out[:3], plain, bad, *out[3:5], bad_asks, out[5]]

    got = _shard_fed(tmp_path, plan)
    assert got["acks"] == [2, 4, 61], got
    rows = [len(m.episode_end) for m in made]
    items = sum(len(m.episode_end) if m.item_mask is None else int(m.item_mask.sum()) for m in made)
    # Every message taken: the 6 staged ones and the plain one inserted, the 2 unreadable ones refused.
    assert (got["staged"], got["rejected"], got["size"]) == (sum(rows), 2 * rows[0], items + 2), got


def test_a_shard_with_a_log_logs_the_staged_rows_it_inserted_whatever_the_writer_writes_meanwhile(tmp_path):
    """Regression: a shard with a write-ahead log (``wal``) logged a staged message's rows from the writer's
    region, read again after the table's copy: a writer writing its ring before the ack (a bug, or a hostile
    peer) made the record's checksum and the bytes written under it differ, and a restore's redo stopped at
    that record, losing every writer's acknowledged inserts after it (not the one writer's own rows). The
    rows are copied once now, and the table and the log take that copy: every record is intact while a
    thread writes the region all along (without the copy, one of 48 records or more failed its checksum)."""
    import threading

    from reactor.replay.wal import read_wal

    fields = [("obs", (4096,), "float32"), ("action", (), "int64")]
    MESSAGES = 48  # noqa: N806
    stop = threading.Event()
    scribbled = [0]
    threads: list[threading.Thread] = []

    def scribble(view: np.ndarray) -> None:
        while not stop.is_set():
            view[...] = 1.0
            view[...] = 2.0
            scribbled[0] += 1

    class Scribbler(_Sender):
        """A :class:`_Sender` whose region a thread writes (``plan`` starts it) until the shard's statistics."""

        @reaction(triggers=[_Sender.stats])
        def got(self, stats: ShardStatistics) -> None:
            stop.set()
            threads[0].join(10)
            super().got(stats)

    def plan(run_id: str) -> tuple[Staging, list[Steps]]:
        w = Writer(fields, 1, TransitionPattern(), flush_steps=1)
        st = Staging.open(run_id, "stage-sender", w.specs, 1, MESSAGES * 33, "sender")
        assert st is not None
        w.use_staging(st)
        st.ok[0] = True
        msgs = []
        for k in range(MESSAGES * 32):  # one 32-step episode (33 rows) a message, 540 kB
            msgs += w.append({"obs": np.full((1, 4096), k, np.float32), "action": np.array([k])},
                             terminated=np.array([k % 32 == 31]), truncated=np.array([False]),
                             final={"obs": np.zeros((1, 4096), np.float32)})
        assert len(msgs) == MESSAGES and all(m.staged is not None for m in msgs)
        threads.append(threading.Thread(target=scribble, args=(st.views["obs"],), daemon=True))
        threads[0].start()
        return st, msgs

    report = tmp_path / "report.json"
    g = Graph()
    node = g.add(Scribbler(plan, str(report)), name="sender")
    shard = g.add(Replay(fields, 2048, run_dir=str(tmp_path / "run"), wal=True), name="replay")
    g.connect(node.out, shard.steps, delay_s=1e-6)
    g.connect(shard.acks, node.acks, delay_s=1e-6)
    g.connect(node.ask, shard.control, delay_s=1e-3)
    g.connect(shard.statistics, node.stats, delay_s=1e-6)
    run(g)
    got = json.loads(report.read_text())
    assert got["staged"] == MESSAGES * 33 and scribbled[0] > 0, got  # (the premise: all staged, written meanwhile)
    records = list(read_wal(tmp_path / "run" / "replay" / "wal", 0))
    assert [r.num_steps for r in records] == [33] * MESSAGES  # every record intact (the redo stops at a damaged one)


def test_an_ack_a_lost_shard_sent_before_it_died_does_not_turn_staging_on_for_its_next_life(staging_of):
    """Regression: an ack in transit when a shard died, taken after ``shard_lost``, said the dead life's host
    and pid, and turned the shard's ring on again (``Staging.ok``): the writer staged its first flushes for
    the next life before that life said it reads this host's regions (on another candidate host it cannot:
    they were refused, their rows lost). Such an ack counts as one naming no host now, as does one taken
    while the shard is down, and one taken after its restart counts for no message in flight and turns
    nothing on; the next life's own ack turns staging on."""
    w = _writer(2)
    st, _ = staging_of(w, 500)
    rng = np.random.default_rng(5)

    def flushes(n: int) -> list[Steps]:
        out = []
        for k in range(n):
            out += w.append(*_step(rng, k, 6)[:1], terminated=np.zeros(6, bool), truncated=np.ones(6, bool),
                            final={"obs": np.zeros((6, 3), np.float32)})
        return out

    plain = [m for m in flushes(10) if m.shard == 0]
    assert plain and all(m.staged is None for m in plain)  # (until the shard's first ack says it reads them)
    take_ack(w, 0, plain[-1].seq, st.host, OTHER_PID, "unused", "actor[0]", None)
    sent = [m for m in flushes(10) if m.shard == 0]
    assert sent and all(m.staged is not None for m in sent)
    w.shard_lost(0)
    take_ack(w, 0, sent[-1].seq, st.host, OTHER_PID, "unused", "actor[0]", None)  # the dead life's, late
    assert not st.ok[0]
    w.shard_restarted(0)
    take_ack(w, 0, sent[0].seq, st.host, OTHER_PID, "unused", "actor[0]", None)  # later still: after the restart
    assert not st.ok[0]  # (it counts for no message in flight: it says nothing of the next life)
    after = [m for m in flushes(10) if m.shard == 0]
    assert after and all(m.staged is None for m in after)  # until the next life says so
    take_ack(w, 0, after[0].seq, st.host, OTHER_PID + 1, "unused", "actor[0]", None)
    assert st.ok[0] and any(m.staged is not None for m in flushes(10) if m.shard == 0)


def test_a_shards_cache_of_mapped_regions_lets_go_of_the_one_least_recently_read(monkeypatch):
    """Past ``MAX_STAGED_REGIONS`` a shard unmaps a region; the one read least recently, not the one
    attached first: a writer whose region it reads on every message is never remapped (the cache let go
    by attach order, so past the bound every active writer's region was mapped again and again)."""
    import reactor.nodes._staging as staging_module

    monkeypatch.setattr(staging_module, "MAX_STAGED_REGIONS", 2)
    run_id = f"t{secrets.token_hex(6)}"
    specs = Writer(SHARD_FIELDS, 1, TransitionPattern()).specs
    rings = [Staging.open(run_id, f"stage-w{k}", specs, 1, 8, "test") for k in range(3)]
    reader = StagedReader(run_id)
    try:
        words = [(st.descriptor, 0, 4) for st in rings if st is not None]
        assert len(words) == 3
        for k in (0, 1, 0, 2):  # region 0 read again after region 1 was attached
            reader.rows(words[k])
        assert sorted(reader._regions) == ["stage-w0", "stage-w2"]
        assert sorted(reader._reader.regions) == ["stage-w0", "stage-w2"]  # (unmapped too, not only forgotten)
    finally:
        reader.close()
        for st in rings:
            if st is not None:
                st.close()


def test_a_shard_whose_ring_is_named_as_a_staging_region_refuses_staged_rows_of_its_own_ring(tmp_path, caplog):
    """A shard named ``stage-...`` has a ring whose region is named as writers' staging regions are: the name
    check let a staged word naming that ring through (its descriptor cut to the row fields, as a peer can
    make it), and the shard mapped its own ring again and inserted rows of it (the one kernel's own-ring
    check compares addresses and misses a second mapping). A shard refuses its own regions by name."""
    own: dict[str, Any] = {}

    class Recorded(Replay):
        async def _open_bulk_storage(self) -> Any:  # (the sender runs in this process: it takes the descriptor)
            storage = await super()._open_bulk_storage()
            own["desc"] = self._descriptor
            return storage

    class OwnRingSender(Reactor):
        out = Output(Steps)
        ask = Output(ReplayControl)
        acks = Input(InsertAck)
        stats = Input(ShardStatistics)

        @reaction(triggers=[startup], effects=[ask])
        def start(self) -> None:
            self.st, self.msgs = _staged_episodes(self.run_id, 6, 6)
            self.got_stats = 0
            self.ask.send(StatisticsRequest())  # (its answer: the shard is up, its ring made)

        @reaction(triggers=[stats], effects=[out, ask])
        def got(self, stats: ShardStatistics) -> None:
            self.got_stats += 1
            if self.got_stats == 1:
                keep = [n for n, _, _ in SHARD_FIELDS]
                d = dict(own["desc"])
                d["fields"] = {n: d["fields"][n] for n in keep}
                d["shm"] = {**d["shm"], "segments": {n: d["shm"]["segments"][n] for n in keep}}
                d["version_field"] = None
                _, first, rows = self.msgs[0].staged
                self.out.send(dataclasses.replace(self.msgs[0], staged=(d, first, rows)))
                self.ask.send(StatisticsRequest())
                return
            with open(report, "w") as f:
                json.dump({"size": stats.size, "rejected": stats.rejected_steps, "staged": stats.staged_steps}, f)
            self.st.close()

    report = tmp_path / "report.json"
    g = Graph()
    sender = g.add(OwnRingSender(), name="sender")
    shard = g.add(Recorded(SHARD_FIELDS, 1000, bulk=True), name="stage-replay")
    g.connect(sender.out, shard.steps, delay_s=1e-6)
    g.connect(shard.acks, sender.acks, delay_s=1e-6)
    g.connect(sender.ask, shard.control, delay_s=1e-3)
    g.connect(shard.statistics, sender.stats, delay_s=1e-6)
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        run(g)
    got = json.loads(report.read_text())
    assert own["desc"]["region"] == "stage-replay"  # (the premise: its ring passes the name check)
    assert got == {"size": 0, "rejected": 7, "staged": 0}, got
    assert any("its staged rows cannot be read" in m and "'stage-replay' is this shard's own region" in m
               for m in caplog.messages), caplog.messages


def test_a_writer_makes_no_staging_region_on_an_ack_that_counts_for_no_message_in_flight():
    """``take_ack`` makes a writer's staging region on the first ack of a shard of its host only when that ack
    counts for a message in flight: a restarted shard's last life's ack, taken after the restart, said the
    dead life's host and pid, and the new region's ring for that shard was turned on for a next life that
    may be on another host (as ``Staging.acked`` no longer does for a writer that has its region)."""
    from reactor.transport import bulk

    w = _writer(2)
    run_id = f"t{secrets.token_hex(6)}"
    rng = np.random.default_rng(3)
    sent: list[Steps] = []
    for k in range(10):
        sent += w.append(*_step(rng, k, 6)[:1], terminated=np.zeros(6, bool), truncated=np.ones(6, bool),
                         final={"obs": np.zeros((6, 3), np.float32)})
    old = [m for m in sent if m.shard == 0]
    assert old and all(m.staged is None for m in old)
    w.shard_lost(0)
    w.shard_restarted(0)
    try:
        take_ack(w, 0, old[-1].seq, bulk.host_id(), OTHER_PID, run_id, "actor[0]", None)  # the last life's, late
        assert w.staging is None and not w.staging_refused
        new = [m for m in w.append(*_step(rng, 10, 6)[:1], terminated=np.zeros(6, bool), truncated=np.ones(6, bool),
                                   final={"obs": np.zeros((6, 3), np.float32)}) if m.shard == 0]
        new += [m for m in w.flush() if m.shard == 0]
        assert new
        take_ack(w, 0, new[-1].seq, bulk.host_id(), OTHER_PID + 1, run_id, "actor[0]", None)  # the next life's
        assert w.staging is not None and w.staging.ok[0] and not w.staging.ok[1]
    finally:
        if w.staging is not None:
            w.staging.close()


#: A writer's staging region (argv: run id), made by a process with a /dev/shm of its own: prints its
#: descriptor as JSON and holds the region until its stdin closes.
_OWN_SHM_REGION = """
import json, sys
import numpy as np
from reactor.nodes._staging import Staging
from reactor.nodes.writer import TransitionPattern, Writer
w = Writer([("obs", (3,), "float32"), ("action", (), "int64")], 1, TransitionPattern(), flush_steps=1)
st = Staging.open(sys.argv[1], "stage-other", w.specs, 1, 64, "other")
st.views["obs"][:] = 1.0
print(json.dumps(st.descriptor), flush=True)
sys.stdin.read()
st.close()
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_a_shard_that_cannot_read_a_writers_staged_rows_tells_it_to_send_them_in_its_messages(tmp_path, caplog):
    """A writer with a /dev/shm of its own (a container's: two containers of a Kubernetes pod share a
    hostname and the kernel's boot id, so the same host id, and each has its own /dev/shm unless a
    memory volume is mounted there): the shard cannot find its region, so its staged flush is refused,
    and every ack of that writer's life from then on says no host, which turns the writer's ring for
    this shard off (its flushes then carry their rows). Before, the acks kept saying the host: the
    writer staged every flush, each one refused, all its rows to this shard lost. The writer's next
    life (seq's high word) is trusted again."""
    import subprocess
    import sys

    procs = []

    def plan(run_id: str) -> tuple[Staging, list[Steps]]:
        st, msgs = _staged_episodes(run_id, 12, 3)  # 4 staged messages, seqs 0-3, of this process's region
        p = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                              'mount -t tmpfs tmpfs /dev/shm && exec "$0" -c "$1" "$2"', sys.executable,
                              _OWN_SHM_REGION, run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(p)
        theirs = json.loads(p.stdout.readline())
        assert theirs["host"] == st.host  # (the premise: the same host id, another /dev/shm)
        ends = np.array([False, False, True])
        namespaced = Steps(0, 0, 0, {}, ends, staged=(theirs, 0, 3))
        plain = Steps(0, 0, 1, {"obs": np.zeros((3, 3), np.float32), "action": np.zeros(3, np.int64)}, ends)
        later = [dataclasses.replace(m, seq=(1 << 32) + m.seq) for m in msgs[2:]]  # (the next life's)
        return st, [namespaced, plain, *later]

    try:
        with caplog.at_level(logging.WARNING, logger="reactor.replay"):
            got = _shard_fed(tmp_path, plan, with_hosts=True, bulk=True)
    finally:
        for p in procs:
            p.communicate(timeout=30)
    assert got["acks"] == [0, 1, (1 << 32) + 2, (1 << 32) + 3], got
    assert got["hosts"] == [False, False, True, True], got
    assert got["rejected"] == 3 and got["staged"] == 8, got  # (the plain one and the next life's two inserted)
    assert sum("writer 0's staged rows cannot be read here" in m for m in caplog.messages) == 1, caplog.messages
