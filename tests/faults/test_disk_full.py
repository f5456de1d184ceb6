"""A full disk under a run's files (a real tmpfs of a few hundred KiB, mounted for the test; root only).

Found by running the main job with its run directory on a 1.5 MB tmpfs (session 56): the learner's
periodic checkpoint failed the whole run with torch's "unexpected pos" RuntimeError; every failed
write left its ``.NAME.tmp`` behind, holding the full disk's space; ``curves.png`` was left empty and
``summary.json`` cut. Now a checkpoint that cannot be written mid-run is said in one line (at the
first failure and every tenth) and tried again at the next, the files written whole or not at all
keep their last whole version, and only the run's final checkpoints, which hold what the run learned,
fail it, naming the file and what is kept.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from reactor._files import replace_small


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                         text=True, timeout=30)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root only): {got.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with _tmpfs(tmp_path / "disk", "512k") as disk:
        yield disk


def _fill(disk: Path) -> Path:
    """Fill ``disk`` to its last byte with one file; returns it (remove it to free the space)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:  # (unbuffered: nothing left to fail at the close)
        for size in (65536, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
    return filler


def test_a_file_replaced_on_a_full_disk_keeps_its_last_version_and_leaves_no_new_file(small_disk):
    target = small_disk / "summary.json"
    replace_small(target, b'{"old": 1}')
    filler = _fill(small_disk)
    with pytest.raises(OSError) as caught:
        replace_small(target, b"x" * 65536)
    assert caught.value.errno == errno.ENOSPC
    assert target.read_bytes() == b'{"old": 1}'
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "summary.json"]  # no .summary.json.tmp
    filler.unlink()


def test_a_learners_checkpoint_on_a_full_disk_is_said_and_tried_again_and_fails_only_the_runs_end(small_disk, caplog):
    from reactor.nodes.learner import Learner

    learner = Learner("dqn", "CartPole-v1", {"hidden": 64}, run_dir=str(small_disk / "run"), checkpoint_every=1)
    learner._setup(learner.algo_name, learner.env_name, learner.algo_config)
    ckpt = small_disk / "run" / "learner.pt"
    learner.updates = 1
    assert learner._maybe_checkpoint() is not None
    saved = ckpt.read_bytes()
    filler = _fill(small_disk)
    with caplog.at_level(logging.WARNING, logger="reactor.learner"):
        for update in range(2, 14):  # (12 failed tries: said at the 1st and the 11th)
            learner.updates = update
            assert learner._maybe_checkpoint() is None
    said = [m for m in caplog.messages if "cannot save" in m]
    assert len(said) == 2, caplog.messages
    assert said[0] == (f"Learner: cannot save {ckpt} at update 2 (No space left on device; 1 failed tries so far); "
                       f"learner.pt holds the last one saved, at update 1; learning goes on and tries again at the "
                       f"next checkpoint")
    assert "at update 12 (No space left on device; 11 failed tries so far)" in said[1]
    assert ckpt.read_bytes() == saved
    assert sorted(p.name for p in (small_disk / "run").iterdir()) == ["config.json", "learner.json", "learner.pt",
                                                                       "run.json", "run.lock"]
    with pytest.raises(OSError, match=rf"^Learner: cannot save {ckpt} at the run's end \(No space left on device\); "
                                      r"learner.pt holds the last one saved, at update 1$") as caught:
        learner._maybe_checkpoint(force=True)
    assert caught.value.errno == errno.ENOSPC
    filler.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reactor.learner"):
        learner.updates = 14
        assert learner._maybe_checkpoint() is not None
    assert caplog.messages == [f"Learner: saved {ckpt} again at update 14, after 12 failed tries"]
    assert torch.load(ckpt, weights_only=False)["updates"] == 14


def test_a_plot_on_a_full_disk_keeps_the_last_image_whole(small_disk, tmp_path):
    from reactor.nodes.plot import plot_run

    run = small_disk / "run"
    run.mkdir()
    rows = ["wall_s,env_steps,source,name,value"] + [f"{i},{i * 100},evaluator,eval_return,{i * 10.0}" for i in range(50)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    first = plot_run(run)
    image = first.read_bytes()
    assert image[:4] == b"\x89PNG"
    filler = _fill(small_disk)
    with pytest.raises(OSError, match=rf"cannot write {run / 'curves.png'}: No space left on device"):
        plot_run(run, x="wall")  # (another image than the first)
    assert first.read_bytes() == image  # was left empty
    assert sorted(p.name for p in run.iterdir()) == ["curves.png", "metrics.csv"]
    filler.unlink()


def test_a_shards_checkpoints_on_a_full_disk_are_said_in_a_line_and_its_final_one_fails_naming_the_directory(
        small_disk, caplog):
    from reactor.nodes._shardstore import ShardStore
    from reactor.replay import FieldSpec, Fifo, MinSize, Prioritized, Storage, Table

    table = Table(Storage([FieldSpec("x", (64,), torch.float32)], 4096), sampler=Prioritized(0.6), remover=Fifo(),
                  rate_limiter=MinSize(1), seed=1)
    directory = small_disk / "replay-0"
    store = ShardStore("replay[0]", directory, keep=2, period_s=None, wal=False)

    def insert(k: int) -> None:
        ends = np.zeros(64, dtype=bool)
        ends[-1] = True
        table.insert_nowait({"x": torch.full((64, 64), float(k))}, np.ones(64), episode_end=ends)

    insert(0)
    store.checkpoint(table).result(timeout=60)
    store.collect()
    assert store.checkpoints == 1
    before = sorted(os.listdir(directory))
    filler = _fill(small_disk)
    with caplog.at_level(logging.WARNING, logger="reactor.replay"):
        for k in range(1, 12):
            insert(k)
            fut = store.checkpoint(table)
            with contextlib.suppress(Exception):
                fut.result(timeout=60)
            store.collect()
    said = [m for m in caplog.messages if "cannot write a checkpoint" in m]
    assert len(said) == 2 and not [r for r in caplog.records if r.exc_info], caplog.messages  # no tracebacks
    assert said[0] == (f"replay[0]: cannot write a checkpoint in {directory} (No space left on device; 1 failed tries "
                       f"so far); the newest complete one stays, and the shard tries again at its next period")
    assert sorted(os.listdir(directory)) == before  # the first one whole, nothing half-written beside it
    insert(12)
    with pytest.raises(OSError, match=rf"^replay\[0\]: cannot write its final checkpoint in {directory} \(No space "
                                      r"left on device\); the newest complete one there stays$"):
        store.close(table, final=True)
    filler.unlink()
