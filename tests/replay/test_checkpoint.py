"""Checkpoints: atomic saves, keep-latest-N, exact continuation, survival of a SIGKILL mid-save (issue 3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from reactor.replay import (
    FieldSpec,
    Fifo,
    MinSize,
    Prioritized,
    SampleToInsertRatio,
    Storage,
    Table,
    Uniform,
    WindowRead,
)
from reactor.replay.checkpoint import latest_checkpoint, read_checkpoint, write_checkpoint

SPECS = [FieldSpec("obs", (3,), torch.float32), FieldSpec("done", (), torch.bool),
         FieldSpec("half", (2,), torch.bfloat16)]


def make(sampler=None, **kw) -> Table:
    return Table(Storage(SPECS, 64), sampler=Prioritized(0.6) if sampler is None else sampler, remover=Fifo(),
                 rate_limiter=kw.pop("limiter", MinSize(1)), **kw)


def fill(t: Table, n: int = 50, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(0, n, 5):
        t.insert_nowait({"obs": torch.from_numpy(rng.normal(size=(5, 3)).astype(np.float32)),
                         "done": torch.from_numpy(rng.random(5) < 0.5),
                         "half": torch.from_numpy(rng.normal(size=(5, 2))).to(torch.bfloat16)},
                        rng.uniform(0.1, 3.0, 5), episode_end=bool(i % 10))


def draws(t: Table, rounds: int = 5):
    out = []
    for r in range(rounds):
        batch, info = t.sample_nowait(8)
        t.update_priorities(info.keys, np.linspace(0.5, 2.0, len(info.keys)) + r)
        out.append((info.keys.tolist(), info.weights.tolist(), info.times_sampled.tolist(),
                    {k: v.float().tolist() for k, v in batch.items()}))
    return out


@pytest.mark.parametrize("sampler", [lambda: Prioritized(0.7), Uniform], ids=["prioritized", "uniform"])
def test_restored_table_continues_the_identical_sample_sequence(tmp_path, sampler):
    t = make(sampler(), read=WindowRead(4, "tail"), beta=0.6, seed=7,
             limiter=SampleToInsertRatio(2.0, 10, (-1e9, 1e9)))
    fill(t)
    draws(t, 2)
    t.save(tmp_path)
    u = Table.load(tmp_path)
    assert draws(t) == draws(u)
    assert t.statistics().size == u.statistics().size
    assert t.rate_limiter.statistics() == u.rate_limiter.statistics()


def test_restore_from_fills_an_empty_table_in_place_across_the_rings_wrap_and_continues_identically(tmp_path):
    """``Table.restore_from`` reads the rows straight into the table's own storage: here a ring that
    wrapped (150 steps through 64 slots: the saved rows sit in two pieces of the ring), into a table of
    the same configuration; it draws as the saved table and as ``Table.load``'s do."""
    t = make(Prioritized(0.7), read=WindowRead(4, "tail"), beta=0.6, seed=7)
    fill(t, 150)
    draws(t, 2)
    lo, hi = t.storage.step_range
    assert lo % 64 + (hi - lo) > 64  # (the live rows wrap)
    path = t.save(tmp_path)
    u = make(Prioritized(0.7), read=WindowRead(4, "tail"), beta=0.6, seed=7)
    assert u.restore_from(tmp_path) == (path, [])
    v = Table.load(tmp_path)
    assert u.storage.step_range == (lo, hi)
    assert draws(t) == draws(u) == draws(v)


def test_a_checkpoint_restored_under_another_samples_per_insert_starts_balanced_under_the_new_ratio(tmp_path, caplog):
    """A resumed run with another samples_per_insert (or window) restores a shard's checkpoint whose limiter
    counts were made under the old ratio: counted under the new one they starved the learner (8 -> 1 here:
    the 50 inserts allowed 50 samples and 400 were counted, so none until 350 more inserts) or flooded it.
    Rebased (``RateLimiter.load_state_dict``): the inserts are kept, the samples set so the diff sits at the
    new window's centre, half the window each way (the same as a fresh table at its balance: the old
    ratio's debt or credit is the old run's, and says nothing of the new); said in one warning naming both
    ratios. The same ratio restores the counts as they were. Through the checkpoint files (restore_from)."""
    t = make(limiter=SampleToInsertRatio(8.0, 10, 80.0))
    rng = np.random.default_rng(0)
    for _ in range(10):  # 5 steps an episode, sampled as far as the ratio allows after each
        t.insert_nowait({"obs": torch.from_numpy(rng.normal(size=(5, 3)).astype(np.float32)),
                         "done": torch.zeros(5, dtype=torch.bool), "half": torch.zeros(5, 2, dtype=torch.bfloat16)},
                        np.ones(5), episode_end=True)
        while t.rate_limiter.can_sample(8, len(t)):
            t.sample_nowait(8)
    before = t.rate_limiter.statistics()
    assert (before.inserts, before.samples) == (50, 400)  # (8 * 50 - samples down to min_diff = 8 * 10 - 80 = 0)
    t.save(tmp_path)
    same = make(limiter=SampleToInsertRatio(8.0, 10, 80.0))
    same.restore_from(tmp_path)
    assert same.rate_limiter.statistics() == before
    u = make(limiter=SampleToInsertRatio(1.0, 10, 10.0))  # window [0, 20] around 1 * 10
    with caplog.at_level("WARNING", logger="reactor.replay"):
        u.restore_from(tmp_path)
    assert len(u) == len(t) and u.storage.step_range == t.storage.step_range
    assert (u.rate_limiter.statistics().inserts, u.rate_limiter.statistics().samples) == (50, 50 - 10)
    lim = u.rate_limiter
    assert lim.can_sample(10, len(u)) and not lim.can_sample(11, len(u))  # diff 10: down to 0
    assert lim.can_insert(10, len(u)) and not lim.can_insert(11, len(u))  # and up to 20
    said = [r.getMessage() for r in caplog.records if "rate limiter" in r.getMessage()]
    assert said == ["rate limiter: the checkpoint's counts were made at samples_per_insert 8 (diff in [0, 160]), and "
                    "this table's is 1 (in [0, 20]): its 50 inserts count as balanced under the new ratio"], said


def test_restore_from_refuses_a_table_that_holds_steps_and_a_checkpoint_of_other_fields_names_them(tmp_path):
    """A restore into a table that holds data would overwrite it; a checkpoint of other fields is the
    run's settings, not a damaged checkpoint: it is neither passed over for an older one nor half-read."""
    t = make()
    fill(t)
    t.save(tmp_path / "ok")
    busy = make()
    fill(busy, 5)
    with pytest.raises(ValueError, match=r"restore_from fills an empty table; this one holds 5 steps"):
        busy.restore_from(tmp_path / "ok")
    other = Table(Storage([FieldSpec("obs", (4,), torch.float32)], 64), sampler=Prioritized(0.6), remover=Fifo(),
                  rate_limiter=MinSize(1))
    with pytest.raises(ValueError, match=r"holds fields \[\('obs', \[3\], 'torch.float32'\), .*this table "
                                         r"\[\('obs', \[4\], 'torch.float32'\)\]"):
        other.restore_from(tmp_path / "ok")
    assert len(other) == 0 and other.storage.step_range == (0, 0)
    # Another sampler (Uniform's state for Prioritized's): the checkpoint is fine, the table is not its.
    uniform = make(Uniform())
    with pytest.raises(ValueError, match=r"^checkpoint '.*ckpt-00000001' does not fit this table: "):
        uniform.restore_from(tmp_path / "ok")
    assert len(uniform) == 0


_LOAD_UNDER_A_LIMIT = """
import resource, sys
import numpy as np, torch
from reactor.replay import FieldSpec, Fifo, MinSize, Storage, Table, Uniform

t = Table(Storage([FieldSpec("obs", (256,), torch.float32)], 1 << 16), sampler=Uniform(), remover=Fifo(),
          rate_limiter=MinSize(1))
t.insert_nowait({"obs": torch.arange(1 << 16, dtype=torch.float32)[:, None].expand(-1, 256)}, np.ones(1 << 16),
                episode_end=True)
t.save(sys.argv[1])
del t
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (80 << 20), resource.RLIM_INFINITY))  # 64 MiB of rows, 16 MiB more
u = Table.load(sys.argv[1])
print(len(u), u.storage.read_windows(np.array([3, 65535]), 1, "tail")["obs"][:, 0, 0].tolist())
"""


def test_table_load_holds_the_rows_once(tmp_path):
    """``Table.load`` read every array (the rows among them) and then copied the rows into a table of its
    own: twice a checkpoint's rows at once. Now they are read straight into its storage, so 16 MiB past
    a 64 MiB checkpoint's rows is enough."""
    p = subprocess.run([sys.executable, "-c", _LOAD_UNDER_A_LIMIT, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == "65536 [3.0, 65535.0]\n", p.stdout


@pytest.mark.parametrize("filled_first", [False, True], ids=["never-filled", "reset"])
def test_an_empty_tables_checkpoint_loads(tmp_path, filled_first):
    """An empty table's checkpoint (a shard that had no data yet, or one reset) was refused by its own
    loader as corrupt (torch cannot view numpy's empty array, stride 0, as another dtype), so the
    shard's next restore fell back to an older checkpoint, or to nothing."""
    t = make()
    if filled_first:
        fill(t)
        t.reset()
    t.save(tmp_path)
    u = Table.load(tmp_path)
    assert len(u) == 0 and u.storage.step_range == t.storage.step_range
    fill(u, 10)
    assert len(u) == 10 and u.sample_nowait(4)[1].keys.shape == (4,)


def test_save_keeps_only_the_latest_n_complete_checkpoints(tmp_path):
    t = make()
    fill(t)
    paths = [t.save(tmp_path, keep=2) for _ in range(4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [paths[2].name, paths[3].name]
    assert latest_checkpoint(tmp_path) == paths[3]


def test_checkpoint_numbers_past_eight_digits_are_listed_and_the_newest_is_taken(tmp_path):
    """A checkpoint numbered past 99,999,999 (ckpt-100000000) was never listed: the next restore took an
    older one, and pruning removed the newest (hostile probe of files on disk, session 54)."""
    t = make()
    fill(t)
    (tmp_path / "ckpt-99999999").mkdir()  # a stray directory, so the next number takes nine digits
    newest = t.save(tmp_path, keep=2)
    assert newest.name == "ckpt-100000000"
    assert latest_checkpoint(tmp_path) == newest
    after = t.save(tmp_path, keep=2)
    assert after.name == "ckpt-100000001" and newest.exists() and latest_checkpoint(tmp_path) == after


def test_checkpoint_without_completion_marker_is_ignored(tmp_path):
    t = make()
    fill(t)
    good = t.save(tmp_path)
    fill(t, 10, seed=1)
    newer = t.save(tmp_path)
    (newer / "COMPLETE").unlink()  # as if the saver died just before the marker
    assert latest_checkpoint(tmp_path) == good
    assert len(Table.load(tmp_path)) == 50


def test_load_from_a_directory_without_checkpoints_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^no complete checkpoint in '.*' \(looked for ckpt-\*/COMPLETE\)$"):
        Table.load(tmp_path)


def test_checkpoint_files_are_npy_and_json_loadable_without_pickle(tmp_path):
    t = make()
    fill(t)
    path = t.save(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "reactor.replay.Table/1"
    for f in path.glob("*.npy"):
        np.load(f, allow_pickle=False)
    manifest2, arrays = read_checkpoint(path)
    assert set(arrays) == set(manifest["arrays"])


def test_checkpoint_writer_rejects_object_arrays(tmp_path):
    with pytest.raises(ValueError, match=r"^checkpoint array 'x' has dtype object"):
        write_checkpoint(tmp_path, {}, {"x": np.array([object()])})
    assert latest_checkpoint(tmp_path) is None


def test_background_save_snapshots_before_later_inserts(tmp_path):
    t = make()
    fill(t, 20)
    fut = t.save_in_background(tmp_path)
    fill(t, 10, seed=3)  # after the snapshot: not in the checkpoint
    path = fut.result(timeout=60)
    assert len(Table.load(path)) == 20 and len(t) == 30


CHILD = textwrap.dedent(
    """
    import sys, numpy as np, torch
    from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table
    root = sys.argv[1]
    t = Table(Storage([FieldSpec("obs", (1024,), torch.float32)], 4096), sampler=Prioritized(0.6),
              remover=Fifo(), rate_limiter=MinSize(1))
    t.insert_nowait({"obs": torch.ones(100, 1024)}, np.ones(100))
    t.save(root, keep=100)
    print("SAVED", flush=True)
    t.insert_nowait({"obs": torch.full((4000, 1024), 2.0)}, np.ones(4000))
    while True:  # keep saving until killed
        t.save(root, keep=100)
    """
)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout.readline().strip() == b"SAVED"
        # Wait (bounded) until a second save is under way: its temporary directory exists.
        for _ in range(200000):
            if any(p.name.startswith(".tmp-ckpt-") for p in root.iterdir()):
                break
        else:
            pytest.fail("the child never started its second save")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()
    t = Table.load(root)
    assert len(t) in (100, 4100)  # the first checkpoint, or a later complete one; never a torn one
    first = Table.load(Path(root) / "ckpt-00000001")
    assert len(first) == 100
    assert first.sample_nowait(1)[0]["obs"].eq(1.0).all()


def test_a_foreign_checkpoint_newest_under_the_root_is_passed_over_for_the_tables_own(tmp_path):
    """A complete, verified checkpoint that is not a table's (another owner's format) is refused as a
    damaged one is, by Table.restore and restore_from alike: the older table checkpoint is taken."""
    t = make()
    fill(t)
    good = t.save(tmp_path)
    write_checkpoint(tmp_path, {"format": "someone.else/1"}, {"x": np.zeros(3)})
    for restore in (lambda: Table.restore(tmp_path)[1:], lambda: make().restore_from(tmp_path)):
        path, refusals = restore()
        assert path == good and len(refusals) == 1 and "holds no reactor.replay.Table checkpoint" in refusals[0]
