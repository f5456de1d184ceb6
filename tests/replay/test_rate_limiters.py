"""Rate limiters: Reverb's insert/sample pacing, asyncio waits, close and reset (issue 3).

Order in async tests comes from the limiter's own waiting counters (the test yields to the loop
until the waiter is parked), never from sleeping for a while.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from reactor._errors import PortClosedError, WouldBlock
from reactor.replay import FieldSpec, Fifo, Storage, Table, Uniform
from reactor.replay.rate_limiters import (
    MinSize,
    Queue,
    RateLimiter,
    SampleToInsertRatio,
    Stack,
    limiter_from_config,
)


async def parked(limiter: RateLimiter, op: str, count: int = 1) -> None:
    """Yield to the loop until ``count`` callers wait to ``op`` (bounded; no timing)."""
    for _ in range(1000):
        s = limiter.statistics()
        if (s.waiting_inserts if op == "insert" else s.waiting_samples) >= count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"no {op} waiter parked")


# ---------------------------------------------------------------------------- pure limiter maths


def test_min_size_blocks_samples_below_min_size_and_never_inserts():
    lim = MinSize(3)
    assert not lim.can_sample(1, size=2)
    assert lim.can_sample(1, size=3)
    lim.on_insert(10**6)
    assert lim.can_insert(10**6, size=10**6)


def test_sample_to_insert_ratio_keeps_samples_within_the_error_buffer():
    # spi=2, min_size=2, error_buffer=2: offset 4, diff must stay in [2, 6].
    lim = SampleToInsertRatio(samples_per_insert=2.0, min_size=2, error_buffer=2.0)
    assert (lim.min_diff, lim.max_diff) == (2.0, 6.0)
    assert lim.can_insert(2, size=0)  # free until min_size
    lim.on_insert(2)
    assert lim.can_insert(1, size=2)  # diff would be 6
    assert not lim.can_insert(2, size=2)  # diff would be 8
    assert lim.can_sample(2, size=2)  # diff 4 - 2 = 2
    assert not lim.can_sample(3, size=2)  # diff 4 - 3 = 1 < 2
    lim.on_sample(2)
    assert not lim.can_sample(1, size=2)
    assert lim.can_insert(2, size=2)  # (4)*2 - 2 = 6


def test_sample_to_insert_ratio_rejects_a_window_that_could_deadlock():
    with pytest.raises(ValueError, match=r"^error_buffer must be >= max\(1, samples_per_insert\) = 4, got 3"):
        SampleToInsertRatio(samples_per_insert=4.0, min_size=10, error_buffer=3)


def test_an_insert_no_sample_can_ever_make_room_for_is_refused_not_left_waiting():
    """SampleToInsertRatio(8, 4, error_buffer=8) admits at most 2 items an insert past min_size: a third
    waited forever (in a shard, every later writer's insert queued behind it: the run stalled, a hostile
    probe in session 55). Table.insert_nowait and insert now raise ValueError naming the bound."""
    lim = SampleToInsertRatio(samples_per_insert=8.0, min_size=4, error_buffer=8.0)
    assert lim.max_insert() == 2 and MinSize(3).max_insert() == math.inf
    assert lim.never_inserts(4, size=0) is None  # (the free fill)
    lim.on_insert(4)
    assert lim.never_inserts(2, size=4) is None and lim.never_inserts(3, size=4) is not None

    def table() -> Table:
        return Table(Storage([FieldSpec("x", ())], 64), sampler=Uniform(), remover=Fifo(),
                     rate_limiter=SampleToInsertRatio(samples_per_insert=8.0, min_size=4, error_buffer=8.0))

    t = table()
    t.insert_nowait({"x": torch.zeros(4)})
    message = (r"^table 'table': an insert of 3 items can never proceed under SampleToInsertRatio\(.*\): samples can "
               r"take the count to 8 at most \(inserts=4\), leaving the diff at 24, and 3 items x 8 samples each "
               r"take it above max_diff=40 \(at most 2 items an insert, fewer where the ratio's fractions leave less "
               r"room\); insert fewer items at once, or widen the limiter's error_buffer$")
    with pytest.raises(ValueError, match=message):
        t.insert_nowait({"x": torch.zeros(3)})
    with pytest.raises(ValueError, match=message):
        asyncio.run(t.insert({"x": torch.zeros(3)}, timeout_s=5))
    t.sample_nowait(8)
    t.insert_nowait({"x": torch.zeros(2)})
    assert len(t) == 6


def test_never_inserts_is_exact_with_a_fractional_samples_per_insert():
    """Regression (h3): never_inserts checked ``n * spi <= max_diff - min_diff``, but samples move the count
    by whole items, up to ``floor(inserts * spi - min_diff)``, so with a fractional spi the diff may never
    come back down to min_diff. Under spi=1.5 in [0, 3], after one insert and its one allowed sample, an
    insert of 2 (3 samples' worth: "fits") waited forever; Table.insert with no timeout hung. Refused now,
    while the insert of 1 that can proceed does, and after it the insert of 2 waits for samples again."""

    def limiter() -> SampleToInsertRatio:
        return SampleToInsertRatio(samples_per_insert=1.5, min_size=1, error_buffer=(0.0, 3.0))

    t = Table(Storage([FieldSpec("x", ())], 64), sampler=Uniform(), remover=Fifo(), rate_limiter=limiter())
    t.insert_nowait({"x": torch.zeros(1)})
    t.sample_nowait(1)
    message = (r"^table 'table': an insert of 2 items can never proceed under SampleToInsertRatio\(.*\): samples can "
               r"take the count to 1 at most \(inserts=1\), leaving the diff at 0\.5, and 2 items x 1\.5 samples "
               r"each take it above max_diff=3 ")
    with pytest.raises(ValueError, match=message):
        t.insert_nowait({"x": torch.zeros(2)})
    with pytest.raises(ValueError, match=message):  # (was a TimeoutError: the wait never ended)
        asyncio.run(t.insert({"x": torch.zeros(2)}, timeout_s=5))
    t.insert_nowait({"x": torch.zeros(1)})  # (1.5 samples' worth: admitted)
    with pytest.raises(WouldBlock):  # now 2 more samples make room for it
        t.insert_nowait({"x": torch.zeros(2)})
    t.sample_nowait(2)
    t.insert_nowait({"x": torch.zeros(2)})
    assert len(t) == 4


def test_queue_limiter_allows_size_pending_items_each_sampled_once():
    lim = Queue(2)
    assert lim.can_insert(1, size=0)
    lim.on_insert(1)
    lim.on_insert(1)
    assert not lim.can_insert(1, size=2)
    assert lim.can_sample(2, size=2) and not lim.can_sample(3, size=2)
    lim.on_sample(1)
    assert lim.can_insert(1, size=1)


@pytest.mark.parametrize(
    "make",
    [lambda: MinSize(5), lambda: SampleToInsertRatio(1.5, 10, 3.0), lambda: SampleToInsertRatio(2.0, 4, (-1.0, 9.0)),
     lambda: Queue(7), lambda: Stack(3),
     lambda: RateLimiter(samples_per_insert=2.0, min_size_to_sample=1, min_diff=-2.0, max_diff=math.inf)],
    ids=["minsize", "ratio", "ratio-pair", "queue", "stack", "raw"],
)
def test_config_round_trips_to_an_equal_limiter(make):
    a = make()
    b = limiter_from_config(a.config())
    assert type(b) is type(a)
    assert (b.samples_per_insert, b.min_size_to_sample, b.min_diff, b.max_diff) == (
        a.samples_per_insert, a.min_size_to_sample, a.min_diff, a.max_diff)


def test_bad_limiter_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"^min_size_to_sample must be an int >= 1, got 0$"):
        MinSize(0)
    with pytest.raises(ValueError, match=r"^Queue size must be an int >= 1, got 0$"):
        Queue(0)
    with pytest.raises(ValueError, match=r"^samples_per_insert must be finite and > 0, got -1"):
        SampleToInsertRatio(-1.0, 1, 2.0)


# ---------------------------------------------------------------------------- waiting


@pytest.mark.asyncio
async def test_waiter_wakes_when_the_other_side_progresses():
    lim = MinSize(2)
    size = [0]
    task = asyncio.create_task(lim.wait("sample", lambda: lim.can_sample(1, size[0]), str, None))
    await parked(lim, "sample")
    size[0] = 1
    lim.on_insert(1)
    await parked(lim, "sample")  # re-checked and still blocked
    assert not task.done()
    size[0] = 2
    lim.on_insert(1)
    await asyncio.wait_for(task, 10)
    assert lim.statistics().waiting_samples == 0


@pytest.mark.asyncio
async def test_close_releases_pending_waiters_with_port_closed_error():
    lim = MinSize(1)
    tasks = [asyncio.create_task(lim.wait("sample", lambda: lim.can_sample(1, 0), str, None)) for _ in range(3)]
    await parked(lim, "sample", 3)
    lim.close()
    for t in tasks:
        with pytest.raises(PortClosedError, match=r"^sample on a closed table"):
            await asyncio.wait_for(t, 10)


@pytest.mark.asyncio
async def test_zero_timeout_gives_up_with_the_reason():
    lim = MinSize(4)
    with pytest.raises(TimeoutError, match=r"^timed out after 0s: because$"):
        await lim.wait("sample", lambda: lim.can_sample(1, 0), lambda: "because", 0)
    assert lim.statistics().waiting_samples == 0


@pytest.mark.asyncio
async def test_cancelled_waiter_leaves_no_trace():
    lim = MinSize(4)
    task = asyncio.create_task(lim.wait("sample", lambda: lim.can_sample(1, 0), str, None))
    await parked(lim, "sample")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert lim.statistics().waiting_samples == 0
    lim.on_insert(1)  # waking a cancelled waiter's future is harmless


def test_limiter_belongs_to_one_table():
    lim = MinSize(1)
    lim.bind()
    with pytest.raises(ValueError, match=r"^MinSize\(min_size=1\) already belongs to a table"):
        lim.bind()


# ---------------------------------------------------------------------------- through a Table (Reverb's table tests)

SPECS = [FieldSpec("x", (), torch.int64)]


def steps(start: int, n: int = 1) -> dict[str, torch.Tensor]:
    return {"x": torch.arange(start, start + n)}


def table(limiter: RateLimiter, sampler=None, **kw) -> Table:
    return Table(Storage(SPECS, 64), sampler=Fifo() if sampler is None else sampler, remover=Fifo(), rate_limiter=limiter, **kw)


@pytest.mark.asyncio
async def test_sample_blocks_below_min_size_until_enough_inserts():
    t = table(MinSize(3))
    task = asyncio.create_task(t.sample(2))
    await parked(t.rate_limiter, "sample")
    await t.insert(steps(0, 2))
    await parked(t.rate_limiter, "sample")
    assert not task.done()
    await t.insert(steps(2))
    batch, info = await asyncio.wait_for(task, 10)
    assert info.keys.tolist() == [0, 1] and info.table_size == 3


@pytest.mark.asyncio
async def test_samples_per_insert_window_paces_both_sides():
    # spi=2, min_size=1, error_buffer=2: diff = 2*inserts - samples stays in [0, 4].
    t = table(SampleToInsertRatio(2.0, 1, 2.0), sampler=Uniform())
    t.insert_nowait(steps(0))  # free: below min size; diff 2
    t.insert_nowait(steps(1))  # diff 4
    with pytest.raises(WouldBlock, match=r"insert of 1 items would block .* above max_diff=4"):
        t.insert_nowait(steps(2))
    t.sample_nowait(4)  # diff 0
    with pytest.raises(WouldBlock, match=r"sample of 1 items would block .* below min_diff=0"):
        t.sample_nowait(1)
    task = asyncio.create_task(t.sample(2))
    await parked(t.rate_limiter, "sample")
    await t.insert(steps(2))  # diff 2: the waiting sample of 2 may go
    _, info = await asyncio.wait_for(task, 10)
    assert len(info.keys) == 2
    assert t.rate_limiter.statistics().samples == 6


@pytest.mark.asyncio
async def test_queue_table_blocks_the_inserter_when_full_and_serves_fifo():
    t = Table.queue(Storage(SPECS, 64), 2)
    await t.insert(steps(0))
    await t.insert(steps(1))
    ins = asyncio.create_task(t.insert(steps(2)))
    await parked(t.rate_limiter, "insert")
    _, info = await t.sample(1)
    assert info.keys.tolist() == [0]
    assert (await asyncio.wait_for(ins, 10)).tolist() == [2]
    got = [(await t.sample(1))[1].keys.item() for _ in range(2)]
    assert got == [1, 2] and len(t) == 0
    with pytest.raises(WouldBlock):
        t.sample_nowait(1)


@pytest.mark.asyncio
async def test_stack_table_serves_the_newest_first_each_once():
    t = Table.stack(Storage(SPECS, 64), 3)
    for i in range(3):
        await t.insert(steps(i))
    got = [(await t.sample(1))[1].keys.item() for _ in range(3)]
    assert got == [2, 1, 0] and len(t) == 0


@pytest.mark.asyncio
async def test_reset_releases_a_blocked_inserter():
    t = Table.queue(Storage(SPECS, 64), 1)
    await t.insert(steps(0))
    ins = asyncio.create_task(t.insert(steps(1)))
    await parked(t.rate_limiter, "insert")
    t.reset()
    assert (await asyncio.wait_for(ins, 10)).tolist() == [1]
    assert len(t) == 1


@pytest.mark.asyncio
async def test_close_releases_blocked_samplers_and_inserters():
    t = Table.queue(Storage(SPECS, 64), 1)
    s1 = asyncio.create_task(t.sample(1))
    await parked(t.rate_limiter, "sample")
    await t.insert(steps(0))
    await asyncio.wait_for(s1, 10)
    await t.insert(steps(1))
    ins = asyncio.create_task(t.insert(steps(2)))
    await parked(t.rate_limiter, "insert")
    t.close()
    with pytest.raises(PortClosedError, match=r"^insert on a closed table"):
        await asyncio.wait_for(ins, 10)
    with pytest.raises(PortClosedError, match=r"^sample from table 'queue', which was closed by close\(\)$"):
        t.sample_nowait(1)
    with pytest.raises(PortClosedError):
        await t.sample(1)


@pytest.mark.asyncio
async def test_table_sample_timeout_names_the_table_and_the_reason():
    t = table(MinSize(2))
    t.insert_nowait(steps(0))
    with pytest.raises(TimeoutError, match=r"^timed out after 0s: table 'table': sample of 1 items would block"):
        await t.sample(1, timeout_s=0)
    assert len(t) == 1 and t.rate_limiter.statistics().samples == 0


def test_max_times_sampled_frees_items_and_lets_the_limiter_count_samples():
    t = table(MinSize(1), max_times_sampled=1)
    t.insert_nowait(steps(0, 3))
    assert t.sample_nowait(2)[1].keys.tolist() == [0, 1]
    assert t.sample_nowait(2)[1].keys.tolist() == [2]
    with pytest.raises(WouldBlock, match=r"holds 0 items"):
        t.sample_nowait(1)


def test_counts_restored_under_another_ratio_are_rebased_to_its_balance(caplog):
    """A resumed run with another samples_per_insert applied the new ratio to the old counts: at 64 ->
    4, the learner could not sample for ~15x the run's inserts (0 updates); at 4 -> 64, it owed a
    thousand catch-up updates. Under another ratio the samples are set to the new band's centre."""
    old = SampleToInsertRatio(samples_per_insert=64.0, min_size=100, error_buffer=640.0)
    old.on_insert(1000)
    old.on_sample(64_000 - 6_400)  # balanced at the old ratio
    state = old.state_dict()
    same = SampleToInsertRatio(samples_per_insert=64.0, min_size=100, error_buffer=640.0)
    same.load_state_dict(dict(state))
    assert same.statistics().samples == 64_000 - 6_400  # the same ratio: the counts as they were
    new = SampleToInsertRatio(samples_per_insert=4.0, min_size=100, error_buffer=40.0)
    with caplog.at_level("WARNING", logger="reactor.replay"):
        new.load_state_dict(dict(state))
    assert new.statistics().samples == 1000 * 4 - 400  # the new band's centre: 4 * 100
    assert new.can_sample(40, 1000) and new.can_insert(10, 1000)
    assert any("samples_per_insert 64" in r.getMessage() and "balanced" in r.getMessage() for r in caplog.records)
    legacy = SampleToInsertRatio(samples_per_insert=4.0, min_size=100, error_buffer=40.0)
    legacy.load_state_dict({"inserts": 10, "samples": 7})  # a checkpoint that did not record its ratio
    assert legacy.statistics().samples == 7
