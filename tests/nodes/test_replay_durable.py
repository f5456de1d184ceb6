"""Replay shards' durability in a real run: periodic checkpoints skip an unchanged table and never keep a
run alive; the final checkpoint is written only if something changed; cancelled saves publish nothing."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from reactor import Action, Graph, Input, Output, Reactor, reaction, run, startup
from reactor.nodes import Replay, Steps, requester_key, shard_key
from reactor.nodes.messages import MassRequest, ReplayReply, ReplayRequest, SampleRequest
from reactor.replay import FieldSpec, Fifo, MinSize, Storage, Table, Uniform
from reactor.replay.checkpoint import CheckpointCancelled, complete_checkpoints


class Driver(Reactor):
    """Inserts at 0, 1, 2 ms and at ``late_ms``; otherwise asks the shard for its mass every ms (a
    request that changes nothing) until 40 ms."""

    steps = Output(Steps)
    requests = Output(ReplayRequest)
    replies = Input(ReplayReply)
    go = Action()

    def __init__(self, late_ms: int) -> None:
        self.late_ms = late_ms

    @reaction(triggers=[startup], effects=[go])
    def begin(self) -> None:
        self.go.schedule(0)

    @reaction(triggers=[go], effects=[steps, requests, go])
    def step(self, go: int) -> None:
        if go in (0, 1, 2, self.late_ms):
            self.steps.send(Steps(0, 0, go, {"x": np.full(4, go, dtype=np.int64)}, np.ones(4, dtype=bool)))
        else:
            self.requests.send(MassRequest(0, 0, go))
        if go < 40:
            self.go.schedule(go + 1, delay_s=1e-3)

    @reaction(triggers=[replies])
    def take(self, replies: ReplayReply) -> None:
        pass


def _graph(run_dir, late_ms: int, **replay) -> Graph:
    g = Graph()
    d = g.add(Driver(late_ms), name="driver")
    kw = {"checkpoint_period_s": 5e-3, "checkpoint_on_shutdown": True, "keep_checkpoints": 100, **replay}
    r = g.add(Replay([("x", (), "int64")], 64, run_dir=str(run_dir), **kw), name="replay", replicas=1)
    g.connect(d.steps, r.steps, key=shard_key)
    g.connect(d.requests, r.requests, key=shard_key)
    g.connect(r.replies, d.replies, key=requester_key, delay_s=1e-6)
    return g


@pytest.mark.parametrize("late_ms", [None, 30], ids=["idle-after-start", "one-late-insert"])
def test_periodic_checkpoints_skip_an_unchanged_shard_and_the_final_one_is_not_a_rewrite(tmp_path, late_ms):
    """Regression: an idle shard rewrote the same state every period (8 times here) and once more at the
    end. Now a checkpoint is written only for a change: one after the inserts at 0-2 ms (at the first
    event past 5 ms), at most one more for a late insert (periodic, or the final one when the periodic
    save of the older state was still being written and was cancelled), none for the idle periods; the
    newest holds every insert, and the run ends by itself."""
    r = run(_graph(tmp_path, -1 if late_ms is None else late_ms))
    assert r.stopped_by == "quiescence"
    done = complete_checkpoints(tmp_path / "replay")
    assert 1 <= len(done) <= (1 if late_ms is None else 2), [p.name for p in done]
    newest = Table.load(done[0])
    assert newest.statistics().inserted == (12 if late_ms is None else 16)


STALLED = str(Path(__file__).resolve().parents[1] / "apps" / "stalled_clock.py")


@pytest.mark.parametrize(("period_s", "async_period_s", "periodic"), [(0.02, None, True), (1000.0, 0.02, True),
                                                                     (0.02, 1000.0, False)],
                         ids=["period", "async-period", "async-period-longer"])
def test_an_async_shard_checkpoints_every_period_of_wall_time_though_its_tags_stand_still(tmp_path, period_s,
                                                                                          async_period_s, periodic):
    """Regression: a shard counted checkpoint_period_s in its tag's time, which in an async run is its
    latest sender's tag: a learner drawing one-sidedly steps by zero-delay actions, and actors held back by
    flow control resume at the tags of the shards' acks, so an async DQN run's shards saw tags under 0.7 ms
    for its whole minute and wrote no periodic checkpoint at a 2 ms period (only the final one). In async
    runs the period is wall-clock time since the shard started. Here a writer in its own process sends 400
    messages 5 ms of wall time apart, all at logical time 0: over >= 2 s the shard (period 20 ms, no final
    checkpoint) writes several checkpoints; it wrote none. (A lower bound only: a slower machine takes longer
    and checkpoints more; but a shard that starts late takes what came meanwhile at once: 200 messages, 1 s,
    left a loaded CI machine one checkpoint.) ``async_checkpoint_period_s``, when given, is the period of async runs instead:
    the apps' logical 0.1 s (100,000 env steps of an actor) would be several saves a second of wall time."""
    from reactor.launch._app import build_graph

    cfg = {"run_dir": str(tmp_path), "messages": 400, "pause_s": 0.005, "period_s": period_s,
           "async_period_s": async_period_s}
    res = run(build_graph(STALLED, cfg), app=STALLED, config=cfg, placement="processes", deterministic=False,
              stop_s=300)
    assert res.stopped_by == "quiescence"
    done = complete_checkpoints(tmp_path / "replay")
    if periodic:
        assert len(done) >= 3, [p.name for p in done]
        assert Table.load(done[0]).statistics().inserted <= 400
    else:
        assert done == [], [p.name for p in done]  # (no final one: checkpoint_on_shutdown is off)


def test_a_cancelled_background_save_publishes_nothing(tmp_path):
    t = Table(Storage([FieldSpec("x", (8,))], 64), sampler=Uniform(), remover=Fifo(), rate_limiter=MinSize(1))
    t.insert_nowait({"x": torch.ones(10, 8)})
    cancel = threading.Event()
    cancel.set()
    fut = t.save_in_background(tmp_path, cancel=cancel)
    with pytest.raises(CheckpointCancelled):
        fut.result(timeout=60)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no temporary directory left


def test_table_generation_moves_with_every_change_of_the_checkpointed_state(tmp_path):
    t = Table(Storage([FieldSpec("x", (2,))], 16), sampler=Uniform(), remover=Fifo(), rate_limiter=MinSize(1))
    seen = [t.generation]

    def moved() -> bool:
        seen.append(t.generation)
        return seen[-1] != seen[-2]

    keys = t.insert_nowait({"x": torch.zeros(4, 2)})
    assert moved()
    t.statistics(), t.state_dict(), len(t)
    t.save(tmp_path)
    assert not moved()  # reading and saving change nothing
    t.sample_nowait(2)
    assert moved()  # times sampled and the generator moved
    t.update_priorities(keys[:2], [2.0, 3.0])
    assert moved()
    t.update_priorities(keys[:0], [])
    assert not moved()
    t.delete(keys[:1])
    assert moved()
    t.reset()
    assert moved()


def test_a_shard_with_a_write_ahead_log_redoes_its_acknowledged_inserts_on_restore(tmp_path):
    """No checkpoint at all (as if the process died before its first): the second run's shard starts
    with the first run's 12 logged steps, redone from the log, then adds its own."""
    run(_graph(tmp_path, -1, checkpoint_period_s=None, checkpoint_on_shutdown=False, wal=True))
    assert complete_checkpoints(tmp_path / "replay") == []
    assert [p.name for p in (tmp_path / "replay" / "wal").iterdir()] == ["wal-0000000000000000.log"]
    run(_graph(tmp_path, -1, checkpoint_period_s=None, wal=True))
    t = Table.load(tmp_path / "replay")
    x = t.state_dict()["storage"]["fields"]["x"]
    assert x.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [0] * 4 + [1] * 4 + [2] * 4


def test_a_checkpoint_of_other_settings_is_refused_naming_the_shard_the_checkpoint_and_what_must_match(tmp_path):
    """A resumed Acrobot run's replay restored into CartPole said only "state field 'obs' has dtype ...
    (518, 6), expected ... (518, 4)": not which shard, which checkpoint, nor what to change (a hostile
    probe of files on disk, session 54)."""
    from reactor.nodes._shardstore import ShardStore

    def table(width: int) -> Table:
        return Table(Storage([FieldSpec("obs", (width,), torch.float32)], 64), sampler=Uniform(), remover=Fifo(),
                     rate_limiter=MinSize(1))

    saved = table(6)
    saved.insert_nowait({"obs": torch.zeros(5, 6)}, np.ones(5), episode_end=True)
    saved.save(tmp_path / "replay-0")
    store = ShardStore("replay[0]", tmp_path / "replay-0", keep=2, period_s=None, wal=False)
    with pytest.raises(ValueError, match=r"^replay\[0\]: cannot restore into this run's replay: checkpoint "
                                         r"'.*replay-0/ckpt-00000001' .*obs.* its env, capacity and prioritized among them"):
        store.open(table(4), restore=True, restarts=0)


def test_a_shard_whose_only_checkpoint_was_cut_short_says_it_starts_empty(tmp_path, caplog):
    """A run killed while its shard saved its first checkpoint left ckpt-N without COMPLETE; the resumed
    shard started empty without a word (files probe, session 54)."""
    import logging
    import os

    from reactor.nodes._shardstore import ShardStore

    def table() -> Table:
        return Table(Storage([FieldSpec("obs", (4,), torch.float32)], 64), sampler=Uniform(), remover=Fifo(),
                     rate_limiter=MinSize(1))

    saved = table()
    saved.insert_nowait({"obs": torch.zeros(5, 4)}, np.ones(5), episode_end=True)
    path = saved.save(tmp_path / "replay-0")
    os.unlink(path / "COMPLETE")  # (a save killed before its last write)
    store = ShardStore("replay[0]", tmp_path / "replay-0", keep=2, period_s=None, wal=False)
    fresh = table()
    with caplog.at_level(logging.WARNING, logger="reactor.replay"):
        store.open(fresh, restore=True, restarts=0)
    assert len(fresh) == 0
    said = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("replay[0]: ") and path.name in said[0], said
    caplog.clear()
    saved.save(tmp_path / "replay-0")  # a complete one beside it: restored, nothing to say
    with caplog.at_level(logging.WARNING, logger="reactor.replay"):
        store.open(restored := table(), restore=True, restarts=0)
    assert len(restored) == 5 and not [r for r in caplog.records if "cut short" in r.getMessage()]


def test_a_shard_store_writes_nothing_in_its_directory_until_its_table_changes(tmp_path):
    """Regression: a shard rewrote its inserted mark when it opened, and wrote an empty final checkpoint at
    its shutdown over a directory with none: a start that another node refused (a resume whose
    ``learner.pt`` does not load) changed the run directory it refused. Now the mark is written at the
    first insert and the final checkpoint only of a table that changed; until the first insert the
    earlier life's mark is the one a restart compares with (its ``lost_steps``)."""
    from reactor.nodes._shardstore import ShardStore

    def table() -> Table:
        return Table(Storage([FieldSpec("obs", (4,), torch.float32)], 64), sampler=Uniform(), remover=Fifo(),
                     rate_limiter=MinSize(1))

    directory = tmp_path / "replay-0"
    directory.mkdir()
    with open(directory / "inserted", "wb") as f:  # an earlier life's mark: 7 steps, and no checkpoint
        np.save(f, np.array([7], dtype=np.int64))
    before = {p.name: (p.read_bytes() if p.is_file() else None, p.stat().st_ino) for p in directory.iterdir()}
    store = ShardStore("replay[0]", directory, keep=2, period_s=None, wal=False)
    store.open(t := table(), restore=True, restarts=0)
    store.close(t, final=True)
    assert {p.name: (p.read_bytes() if p.is_file() else None, p.stat().st_ino) for p in directory.iterdir()} == before
    store = ShardStore("replay[0]", directory, keep=2, period_s=None, wal=False)
    store.open(t := table(), restore=True, restarts=1)
    assert store.lost_steps == 7  # (the earlier life's mark, not one rewritten by a start that did nothing)
    first = t.storage.step_range[1]
    t.insert_nowait({"obs": torch.zeros(5, 4)}, np.ones(5), episode_end=True)
    store.inserted(first, t.storage.step_range[1], {}, None, np.ones(5, dtype=bool), None)
    store.close(t, final=True)
    assert int(np.load(directory / "inserted")[0]) == 5 and len(complete_checkpoints(directory)) == 1


class _Filler(Reactor):
    """Sends ``n`` chunks of 4 rows, 3 of them items (as an episode's last observation is none)."""

    steps = Output(Steps)
    go = Action()

    def __init__(self, n: int) -> None:
        self.n = n

    @reaction(triggers=[startup], effects=[go])
    def begin(self) -> None:
        self.go.schedule(0)

    @reaction(triggers=[go], effects=[steps, go])
    def step(self, go: int) -> None:
        self.steps.send(Steps(0, 0, go, {"x": np.full(4, go, dtype=np.int64)}, np.ones(4, dtype=bool),
                              item_mask=np.array([True, True, True, False])))
        if go + 1 < self.n:
            self.go.schedule(go + 1, delay_s=1e-3)


def test_a_shard_full_below_its_min_size_says_it_may_never_serve_a_sample(caplog):
    """`reactor run apps/dqn.py --set capacity=3000 min_size=3000 ...` trained nothing and ended with exit 0:
    the ring of 3,000 steps never held 3,000 items (each episode's last observation is a step but no item).
    The shard now says so once, when its ring has wrapped without a sample served."""
    import logging

    def said(capacity: int, min_size: int) -> list[str]:
        caplog.clear()
        g = Graph()
        d = g.add(_Filler(8), name="filler")
        r = g.add(Replay([("x", (), "int64")], capacity, rate_limiter={"type": "MinSize", "min_size": min_size}),
                  name="replay", replicas=1)
        g.connect(d.steps, r.steps, key=shard_key)
        with caplog.at_level(logging.WARNING, logger="reactor.replay"):
            run(g)
        return [m for m in caplog.messages if "may never serve" in m]

    lines = said(16, 16)
    assert len(lines) == 1 and lines[0].startswith("replay: its ring of 16 steps is full and evicting at 12 items, "
                                                   "below the 16"), lines
    assert said(16, 12) == []  # (it holds 12 items: enough)


_RESTORE_UNDER_A_LIMIT = """
import resource, sys
from pathlib import Path
import numpy as np, torch
from reactor.nodes._shardstore import ShardStore
from reactor.replay import FieldSpec, Fifo, MinSize, Storage, Table, Uniform
from reactor.replay.checkpoint import complete_checkpoints

def table():
    return Table(Storage([FieldSpec("obs", (256,), torch.float32)], 1 << 16), sampler=Uniform(), remover=Fifo(),
                 rate_limiter=MinSize(1))

saved = table()
saved.insert_nowait({"obs": torch.arange(1 << 16, dtype=torch.float32)[:, None].expand(-1, 256)}, np.ones(1 << 16),
                    episode_end=True)
path = saved.save(sys.argv[1])
del saved
fresh = table()  # (its 64 MiB of rows are in the address space already)
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (int(sys.argv[2]) << 20), resource.RLIM_INFINITY))
try:
    ShardStore("replay[0]", Path(sys.argv[1]), keep=2, period_s=None, wal=False).open(fresh, restore=True, restarts=0)
    rows = fresh.storage.read_windows(np.array([0, 777, 65535]), 1, "tail")["obs"]
    print("restored", len(fresh), rows[:, 0, 0].tolist(), bool((rows == rows[:, :, :1]).all()))
except ValueError as e:
    print(e)
assert complete_checkpoints(sys.argv[1]) == [path]
"""


def _restore_under_a_limit(tmp_path: Path, headroom_mib: int) -> str:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _RESTORE_UNDER_A_LIMIT, str(tmp_path / "replay-0"), str(headroom_mib)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_a_restore_reads_the_rows_into_the_replays_own_memory_so_a_checkpoint_restores_where_it_was_saved(tmp_path):
    """A shard restored a checkpoint through two more copies of its rows (the verified arrays, a table
    of the checkpoint's own, then its state_dict), so a replay that fit a host's memory, and saved
    there, could not be restored there. Now the rows go straight from the files into the shard's
    storage: 16 MiB of address space past a fresh 64 MiB replay restores all of it, exactly."""
    out = _restore_under_a_limit(tmp_path, 16)
    assert out == "restored 65536 [0.0, 777.0, 65535.0] True\n", out


def test_a_restore_that_runs_out_of_memory_is_one_line_and_leaves_the_checkpoint_for_the_next(tmp_path):
    """Under a memory limit a restore's ENOMEM was taken for a damaged checkpoint: the shard started
    empty, and its next saves would prune the good checkpoints (a probe, session 55). Now it is one
    line saying what it needs, the checkpoint kept."""
    out = _restore_under_a_limit(tmp_path, 2)
    assert out.startswith("replay[0]: restoring the replay checkpoint in ") and "ran out of memory" in out, out


class _Deadlocker(Reactor):
    """Inserts 1 item, samples 1, then inserts 2 (which SampleToInsertRatio(1.5, 1, (0, 3)) can never
    admit: no sample is allowed to make room), then 1 more."""

    steps = Output(Steps)
    requests = Output(ReplayRequest)
    replies = Input(ReplayReply)
    go = Action()

    @reaction(triggers=[startup], effects=[go])
    def begin(self) -> None:
        self.go.schedule(0)

    @reaction(triggers=[go], effects=[steps, requests, go])
    def step(self, go: int) -> None:
        if go == 1:
            self.requests.send(SampleRequest(0, 0, 1, 1))
        else:
            n = {0: 1, 2: 2, 3: 1}[go]
            self.steps.send(Steps(0, 0, go, {"x": np.full(n, go, dtype=np.int64)}, np.ones(n, dtype=bool)))
        if go < 3:
            self.go.schedule(go + 1, delay_s=1e-3)

    @reaction(triggers=[replies])
    def take(self, replies: ReplayReply) -> None:
        pass


def test_an_insert_no_sample_can_ever_make_room_for_is_refused_by_the_shard_not_parked_for_good(caplog):
    """RateLimiter.never_inserts reasoned with the diff's real bound; with a fractional samples_per_insert
    the integer rule of samples can leave an insert that nothing admits (the review, session 55): the
    shard parked it for good, and every later insert behind it. It now refuses it (logged, acked): the
    shard's own check then, the limiter's exact one since (h3)."""
    import logging

    g = Graph()
    d = g.add(_Deadlocker(), name="driver")
    limiter = {"type": "SampleToInsertRatio", "samples_per_insert": 1.5, "min_size": 1, "error_buffer": [0.0, 3.0]}
    r = g.add(Replay([("x", (), "int64")], 64, rate_limiter=limiter), name="replay", replicas=1)
    g.connect(d.steps, r.steps, key=shard_key)
    g.connect(d.requests, r.requests, key=shard_key)
    g.connect(r.replies, d.replies, key=requester_key, delay_s=1e-6)
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        run(g)
    said = [m for m in caplog.messages if "an insert of 2 items can never proceed" in m]
    assert len(said) == 1 and "flush 2" in said[0], caplog.messages
