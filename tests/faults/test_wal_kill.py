"""The write-ahead log under kill -9: every insert acknowledged before the kill is there after a restore
(the newest verified checkpoint, then the log redone past it). Torn and damaged records are ignored,
never redone as different data."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from reactor.replay import (
    FieldSpec,
    Fifo,
    MinSize,
    Prioritized,
    Storage,
    Table,
    WriteAheadLog,
    read_wal,
    redo_wal,
)

SPECS = [FieldSpec("x", (256,), torch.float32), FieldSpec("seq", (), torch.int64)]


def make() -> Table:
    return Table(Storage(SPECS, 100_000), sampler=Prioritized(0.6), remover=Fifo(), rate_limiter=MinSize(1), seed=5)


def batch(seq: int) -> tuple[dict, np.ndarray, np.ndarray]:
    n = 1 + seq % 7
    ends = np.zeros(n, dtype=bool)
    ends[-1] = True
    return ({"x": torch.full((n, 256), float(seq)), "seq": torch.full((n,), seq, dtype=torch.int64)},
            np.full(n, 1.0 + seq % 3), ends)


# The shard's protocol (reactor/nodes/replay.py) with a real Table and log: insert, append + fsync, then
# acknowledge; every 25 inserts a background checkpoint, the log rotated at its snapshot and segments
# dropped once every kept checkpoint holds them; samples and priority updates in between.
CHILD = textwrap.dedent(
    """
    import sys
    from collections import deque
    from pathlib import Path
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from tests.faults.test_wal_kill import batch, make
    from reactor.replay import WriteAheadLog
    root = Path(sys.argv[1])
    t = make()
    wal = WriteAheadLog(root / "wal", t.storage.step_range[1])
    saving, marks = None, deque(maxlen=3)
    seq = 0
    while True:
        fields, prio, ends = batch(seq)
        first = t.storage.step_range[1]
        t.insert_nowait(fields, prio, episode_end=ends)
        wal.append(first, fields, prio, ends, None)
        print(f"ACK {seq} {first} {len(ends)}", flush=True)
        if seq % 3 == 2:
            _, info = t.sample_nowait(8)
            t.update_priorities(info.keys, np.linspace(0.5, 2.0, 8))
        if seq % 25 == 24 and (saving is None or saving[0].done()):
            if saving is not None and saving[0].exception() is None:
                marks.append(saving[1])
                if len(marks) == marks.maxlen:
                    wal.drop_before(marks[0])
            wal.rotate(t.storage.step_range[1])
            saving = (t.save_in_background(root, keep=3), t.storage.step_range[1])
        seq += 1
    """
)


@pytest.mark.parametrize("acks", [3, 60, 240])
def test_every_acknowledged_insert_survives_a_sigkill(tmp_path, acks):
    root = tmp_path / "shard"
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), repo], stdout=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    try:
        while len(lines) < acks:
            line = proc.stdout.readline()
            assert line.startswith(b"ACK "), line
            lines.append(line)
        proc.send_signal(signal.SIGKILL)  # wherever it is: mid-insert, mid-append, mid-save
        assert proc.wait(timeout=60) == -signal.SIGKILL
        lines += [ln for ln in proc.stdout.read().splitlines(keepends=True) if ln.endswith(b"\n")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        proc.stdout.close()
    acked = [tuple(int(v) for v in ln.split()[1:]) for ln in lines]
    assert [a[0] for a in acked] == list(range(len(acked)))

    t, _, refusals = Table.restore(root)
    assert refusals == []
    t = make() if t is None else t
    redo_wal(t, root / "wal")
    state = t.state_dict()
    lo = state["storage"]["first_step"]
    assert lo == 0
    keys = set(state["keys"].tolist())
    for seq, first, n in acked:
        rows = slice(first - lo, first - lo + n)
        assert (state["storage"]["fields"]["seq"][rows] == seq).all(), f"acknowledged insert {seq} is lost"
        assert (state["storage"]["fields"]["x"][rows] == float(seq)).all()
        assert set(range(first, first + n)) <= keys
    # and nothing beyond: steps past the last acknowledged insert are at most the one being acknowledged
    last_seq, last_first, last_n = acked[-1]
    assert state["storage"]["next_step"] - (last_first + last_n) <= 7


def _log_three(path) -> list[int]:
    wal = WriteAheadLog(path, 0)
    firsts, step = [], 0
    for seq in range(3):
        fields, prio, ends = batch(seq)
        wal.append(step, fields, prio, ends, None)
        firsts.append(step)
        step += len(ends)
    wal.close()
    return firsts


def test_a_torn_tail_is_ignored_and_cut_off_before_the_next_append(tmp_path, caplog):
    firsts = _log_three(tmp_path)
    seg = tmp_path / "wal-0000000000000000.log"
    whole = seg.stat().st_size
    with open(seg, "ab") as f:  # a fourth append killed midway: its first 40 bytes
        f.write(b"RWAL" + b"\x07" * 36)
    with caplog.at_level(logging.WARNING, logger="reactor.replay"):
        assert [r.first_step for r in read_wal(tmp_path, 0)] == firsts
    assert "a torn or damaged record at byte" in caplog.text
    wal = WriteAheadLog(tmp_path, 0)  # reopening the segment cuts the torn tail off
    assert seg.stat().st_size == whole
    fields, prio, ends = batch(3)
    wal.append(firsts[-1] + 3, fields, prio, ends, None)
    wal.close()
    assert [r.first_step for r in read_wal(tmp_path, 0)] == [*firsts, firsts[-1] + 3]


@pytest.mark.parametrize("where", ["frame", "header", "payload"])
def test_a_damaged_record_stops_the_redo_there_and_is_never_redone_as_other_data(tmp_path, where, caplog):
    firsts = _log_three(tmp_path)
    seg = tmp_path / "wal-0000000000000000.log"
    data = bytearray(seg.read_bytes())
    second = len(data) // 3 + 10  # inside the second record (records are about the same size)
    starts = [i for i in range(len(data)) if data[i : i + 4] == b"RWAL"]
    offset = {"frame": starts[1] + 5, "header": starts[1] + 40, "payload": second + 200}[where]
    data[offset] ^= 0x04
    seg.write_bytes(bytes(data))
    t = make()
    with caplog.at_level(logging.WARNING, logger="reactor.replay"):
        records, steps = redo_wal(t, tmp_path)
    assert records == 1 and t.storage.step_range == (0, firsts[1])  # the first record only
    assert (t.state_dict()["storage"]["fields"]["seq"] == 0).all()
    assert "ignored" in caplog.text


def test_records_a_checkpoint_holds_are_skipped_and_a_gap_stops_the_redo(tmp_path, caplog):
    firsts = _log_three(tmp_path)
    recs = list(read_wal(tmp_path, firsts[1]))
    assert [r.first_step for r in recs] == firsts[1:]
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        assert list(read_wal(tmp_path, firsts[1] + 1)) == []  # no record starts there: lost, logged
    assert f"expected a record starting at step {firsts[1] + 1}" in caplog.text


def test_records_a_redo_did_not_take_are_moved_aside_so_later_appends_are_redone(tmp_path, caplog):
    """Regression: after a redo stopped at a gap, the records past it stayed in the log; the shard's
    next appends followed them, and the next restart's redo stopped at the same gap and lost them."""
    wal = WriteAheadLog(tmp_path, 0)
    wal.append(0, *batch(0)[:3], None)  # one step
    wal.append(10, *batch(1)[:3], None)  # a gap: steps 1..9 were never logged
    wal.close()
    t = make()
    with caplog.at_level(logging.ERROR, logger="reactor.replay"):
        assert redo_wal(t, tmp_path) == (1, 1)
    assert "were moved to wal-0000000000000000.log.stale" in caplog.text
    wal = WriteAheadLog(tmp_path, t.storage.step_range[1])  # the shard logs on from step 1
    fields, prio, ends = batch(2)
    wal.append(1, fields, prio, ends, None)
    wal.close()
    again = make()
    assert redo_wal(again, tmp_path) == (2, 1 + len(ends))  # the first record and the new one
    assert again.storage.step_range == (0, 1 + len(ends))
