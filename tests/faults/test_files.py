"""Files someone else may have written, read by the daemon, the run-directory sweep, the key store and
placements: FIFOs, devices, huge or deeply nested documents, wrong types, links, and a bind address
that names a file. Each is refused naming the file; none hangs, ends a daemon, or deletes anything.
(Found by a hostile probe of the files reactor reads.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reactor._errors import GraphError
from reactor._files import check_ipc_bind, read_small, read_small_json
from reactor.launch._keys import AuthorizedKeys, init_keys

ROOT = Path(__file__).resolve().parents[2]


def test_a_fifo_a_device_and_a_huge_file_are_refused_at_once_naming_them(tmp_path):
    fifo = tmp_path / "record.json"
    os.mkfifo(fifo)  # a plain open waits here for a writer that never comes
    t = time.monotonic()
    with pytest.raises(ValueError, match=rf"^{fifo} is not a regular file$"):
        read_small(fifo, 1024)
    assert time.monotonic() - t < 5
    with pytest.raises(ValueError, match=r"^/dev/zero is not a regular file$"):
        read_small("/dev/zero", 1024)
    big = tmp_path / "big"
    big.write_bytes(b"x" * 2049)
    with pytest.raises(ValueError, match=rf"^{big} holds more than 2048 bytes$"):
        read_small(big, 2048)
    assert read_small(big, 2049) == b"x" * 2049
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"not a JSON document \(RecursionError\)$"):
        read_small_json(deep)
    with pytest.raises(IsADirectoryError):
        read_small_json(tmp_path)


def test_an_ipc_bind_over_a_file_is_refused_and_the_file_kept(tmp_path):
    """libzmq removes what is at an ipc path before binding: a placement's `bind = "ipc://~/thesis.tex"`
    deleted the file and left a socket in its place."""
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    with pytest.raises(FileExistsError, match=r"exists and is not a socket \(binding would delete it\)$"):
        check_ipc_bind(f"ipc://{precious}")
    old = tmp_path / "old.sock"  # a socket an earlier run left: binding there is fine
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(old))
    for address in (f"ipc://{old}", f"ipc://{tmp_path / 'new.sock'}", "ipc://*", "ipc://@abstract", "tcp://127.0.0.1:*"):
        check_ipc_bind(address)
    placement = tmp_path / "p.toml"
    placement.write_text(f'[groups.producers]\nreactors = ["producer*"]\nbind = "ipc://{precious}"\n\n'
                         '[groups.rest]\nreactors = ["squarer*", "collector"]\n')
    from reactor.launch._app import build_graph
    from reactor.launch._placement import resolve

    graph = build_graph(ROOT / "apps" / "demo_pipeline.py", {})
    with pytest.raises(GraphError, match=r"group 'producers': cannot bind .*precious\.txt exists and is not a socket"):
        resolve(graph, str(placement))
    assert precious.read_text() == "keep me"


def test_a_fifo_among_the_authorized_keys_is_skipped_not_waited_on(tmp_path):
    """A FIFO there hung every handshake (the keys are read at each), and SIGTERM with it."""
    init_keys(tmp_path / "k")
    os.mkfifo(tmp_path / "k" / "authorized" / "stuck.pub")
    (tmp_path / "k" / "authorized" / "good.pub").write_text(f"public = {'a' * 40}\n")
    t = time.monotonic()
    got = AuthorizedKeys(tmp_path / "k" / "authorized").keys()
    assert b"a" * 40 in got and len(got) == 2  # good.pub and the directory's own self.pub; not stuck.pub
    assert time.monotonic() - t < 5


def test_a_data_parallel_banks_rendezvous_file_goes_with_a_run_whose_coordinator_was_killed(tmp_path):
    """Regression (an operator's soak): the rendezvous file ``.dist-RUN`` of a data-parallel bank on one host
    (torch's FileStore, in the run directory) stayed after every run, a kill -9 of it too. Its coordinator
    lists it in its socket directory's owner record: the sweep of a dead coordinator's directory (the next
    run's start, a daemon's start, or the daemon whose job it was, as the job ends) removes it; a link
    listed there is not followed. (A coordinator that lives removes it itself: test_training's dp test.)"""
    from reactor.launch._rundir import sweep_stale

    runtime, run_dir = tmp_path / "rt", tmp_path / "run"
    run_dir.mkdir()
    precious = tmp_path / "precious"
    precious.write_text("keep me")
    (run_dir / "link").symlink_to(precious)
    coordinator = ("import sys, time\n"
                   "from pathlib import Path\n"
                   "from reactor.launch._rundir import open_run_dir, rendezvous_file\n"
                   "store = rendezvous_file(sys.argv[1], 'r1')\n"
                   "open_run_dir('r1', remove=[store, Path(sys.argv[1]) / 'link'])\n"
                   "store.write_bytes(b'the bank meets here')\n"
                   "print('up', flush=True)\n"
                   "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", coordinator, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "REACTOR_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(ROOT)})
    try:
        assert p.stdout.readline() == "up\n"
        sweep_stale(runtime)
        assert (run_dir / ".dist-r1").exists() and len(list(runtime.glob("reactor-*"))) == 1  # (its owner lives)
    finally:
        p.kill()
        p.communicate(timeout=30)
    removed = sweep_stale(runtime)
    assert not (run_dir / ".dist-r1").exists() and not list(runtime.glob("reactor-*")), removed
    assert (run_dir / "link").is_symlink() and precious.read_text() == "keep me"


@pytest.mark.parametrize("count", [1, 3, 5])
def test_the_sweep_says_in_one_line_which_segments_of_dead_owners_it_removed(tmp_path, caplog, monkeypatch, count):
    """A killed shard leaves ~10 segments; the sweep at the next run's start logged a warning for each, ten
    lines at the terminal of a run that had nothing to do with it (and past a refusal's one line: CI at
    f5323f5). One line now says how many went, naming the first three; debug names them all. (The segments'
    own removal is ``cleanup_stale``'s, tested with real dead owners in tests/transport; here its answer is
    given, as another test worker's sweep may take real dead segments first.)"""
    import logging

    from reactor.launch import _rundir

    names = [f"/rxb.tdead.r.s{i}" for i in range(count)]
    monkeypatch.setattr(_rundir, "cleanup_stale", lambda: list(names))
    with caplog.at_level(logging.DEBUG, logger="reactor.launch"):
        removed = _rundir.sweep_stale(tmp_path)
    assert removed == names
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "segment" in r.getMessage()]
    head = {1: "removed 1 shared-memory segment of dead owners: /rxb.tdead.r.s0",
            3: "removed 3 shared-memory segments of dead owners: /rxb.tdead.r.s0, /rxb.tdead.r.s1, /rxb.tdead.r.s2",
            5: "removed 5 shared-memory segments of dead owners: /rxb.tdead.r.s0, /rxb.tdead.r.s1, /rxb.tdead.r.s2, "
               "..."}[count]
    assert said == [(logging.WARNING, head), (logging.DEBUG, "the segments removed: " + ", ".join(names))], said


def test_owner_records_that_are_no_process_leave_the_sweep_and_the_run_alone(tmp_path, monkeypatch):
    """A same-user `reactor-*/owner.json` holding pid 1e400, a 100-digit pid or JSON nested 50,000 deep
    made every later multi-process run (and a daemon's start) fail in the sweep with a traceback."""
    from reactor.launch._rundir import sweep_stale

    monkeypatch.setenv("REACTOR_RUNTIME_DIR", str(tmp_path))
    for i, text in enumerate(['{"pid": 1e400, "start_time": 0, "pid_ns": 0}',
                              '{"pid": ' + "9" * 100 + ', "start_time": 0, "pid_ns": 0}',
                              "[" * 50_000, '{"pid": "1", "start_time": 0, "pid_ns": 0}']):
        (tmp_path / f"reactor-bad{i}").mkdir()
        (tmp_path / f"reactor-bad{i}" / "owner.json").write_text(text)
    os.mkfifo(tmp_path / "reactor-fifo")
    (tmp_path / "reactor-fifo2").mkdir()
    os.mkfifo(tmp_path / "reactor-fifo2" / "owner.json")
    removed = sweep_stale(tmp_path)
    assert not [r for r in removed if str(tmp_path) in r]  # none is a record of a dead owner: all kept
    assert len(list(tmp_path.glob("reactor-*"))) == 6


def _daemon_with(tmp_path: Path, records: dict[str, object], groups: object = None):
    from reactor.launch._daemon import Daemon

    keys = tmp_path / "keys"
    if not keys.exists():
        init_keys(keys)
    jobs = tmp_path / "state" / "jobs"
    for job_id, record in records.items():
        (jobs / job_id).mkdir(parents=True, exist_ok=True)
        if record == "fifo":
            os.mkfifo(jobs / job_id / "job.json")
        else:
            (jobs / job_id / "job.json").write_text(record if isinstance(record, str) else json.dumps(record))
        if groups is not None:
            (jobs / job_id / "groups.json").write_text(json.dumps(groups))
    return Daemon("tcp://127.0.0.1:0", "h1", tmp_path / "state", keys, preload=None)


def _record(job_id: str, **over: object) -> dict[str, object]:
    return {"id": job_id, "state": "finished", "app": "a.py", "placement": "single", "pid": 12345,
            "pid_start": 1, "submitted_at": 1.0, "ended_at": 2.0, "returncode": 0, **over}


def test_a_job_record_without_a_start_time_never_has_its_pid_signalled(tmp_path):
    """`"pid": <any process>, "pid_start": 0` was watched as a running job, and `reactor stop` (then the
    grace's SIGKILL to its group) killed that process."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        daemon = _daemon_with(tmp_path, {"a" * 16: _record("a" * 16, state="running", pid=bystander.pid, pid_start=0,
                                                           ended_at=None, returncode=None)})
        job = daemon.jobs["a" * 16]
        assert job.record["state"] == "lost"
        daemon.stop("a" * 16)
        daemon.watch()
        time.sleep(0.3)
        assert bystander.poll() is None
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait()


def test_job_records_of_the_wrong_shape_are_skipped_and_the_daemon_serves_the_rest(tmp_path):
    bad = {"b" * 16: _record("b" * 16, pid="abc"), "c" * 16: '{"id": "' + "c" * 16 + '", "pid": 1e400}',
           "d" * 16: _record("d" * 16, pid=2**70), "e" * 16: "[" * 100_000, "f" * 16: "fifo",
           "0" * 16: _record("0" * 16, app=5, submitted_at="z"), "1" * 16: _record("1" * 16, ended_at=[1]),
           "2" * 16: _record("2" * 16, state=None)}
    t = time.monotonic()
    daemon = _daemon_with(tmp_path, {"a" * 16: _record("a" * 16), **bad})
    assert time.monotonic() - t < 10  # (the FIFO is not waited on)
    assert list(daemon.jobs) == ["a" * 16]
    ok, rows = daemon.handle([1, "status", None])
    assert ok and [r["id"] for r in rows] == ["a" * 16]
    t = time.monotonic()  # asking for the FIFO's job: not waited on (the loop would hang with it)
    with pytest.raises(Exception, match=r"has no job 'f{16}'"):
        daemon.handle([1, "status", "f" * 16])
    assert time.monotonic() - t < 5


def test_a_stopped_jobs_record_that_does_not_say_who_stopped_it_is_listed_plainly_stopped(tmp_path):
    """A record kept from a daemon before records said who asked a job to stop (``stopped_by``) was listed
    ``stopped (by request)``, a guess: its daemon may have stopped it. Now plainly ``stopped``; a record
    that says is listed as it says, and one that says something else is taken as saying nothing."""
    from reactor.cli._jobs import _job_state

    daemon = _daemon_with(tmp_path, {"a" * 16: _record("a" * 16, state="stopped", returncode=143),
                                     "b" * 16: _record("b" * 16, state="stopped", returncode=143, stopped_by="daemon"),
                                     "c" * 16: _record("c" * 16, state="stopped", returncode=-9, stopped_by=7)})
    ok, rows = daemon.handle([1, "status", None])
    assert ok
    lines = {r["id"]: _job_state(r) for r in rows}
    assert lines == {"a" * 16: "stopped", "b" * 16: "stopped (its daemon stopped)",
                     "c" * 16: "stopped, exit -9 (killed by SIGKILL)"}, lines


@pytest.mark.parametrize("groups", [[1, 2], {"run": 5, "groups": [1]}, {"run": "r", "groups": {"g": 5}}])
def test_a_groups_file_of_the_wrong_shape_reads_as_a_job_on_one_host(tmp_path, groups):
    """One such file made `status` fail for every job (AttributeError in the daemon; the client's
    listing raised on `{"groups": [1]}`)."""
    daemon = _daemon_with(tmp_path, {"a" * 16: _record("a" * 16)}, groups=groups)
    ok, rows = daemon.handle([1, "status", None])
    assert ok and rows[0]["id"] == "a" * 16 and "groups" not in rows[0]


def test_a_daemon_on_a_relative_state_directory_runs_its_jobs_in_it(tmp_path, monkeypatch):
    """`reactor daemon --state-dir state` made every job fail: `no app file at 'state/jobs/ID/app/...'`
    (the job runs in its own directory, where the relative path means something else)."""
    from reactor.launch._daemon import Daemon

    init_keys(tmp_path / "keys")
    monkeypatch.chdir(tmp_path)
    daemon = Daemon("tcp://127.0.0.1:0", "h1", "state", tmp_path / "keys", preload=None)
    assert daemon.state == tmp_path / "state" and daemon.state.is_absolute()


def test_a_run_directory_that_links_a_file_elsewhere_is_refused_and_the_file_kept(tmp_path):
    """Resuming a handed-over run directory wrote through its links: summary.json, metrics.csv,
    weights.sha256, the checkpoint's temporary file, a shard's `inserted` counter (left a .npy header)
    and its log segment (truncated) all overwrote the files they pointed at, without a word."""
    from reactor._files import refuse_file_links

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (run / "replay-0").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "thesis.tex").write_text("precious")
    (run / "replay-0" / "inserted").symlink_to(elsewhere / "thesis.tex")
    out = subprocess.run(
        [sys.executable, "-m", "reactor.cli", "run", str(ROOT / "apps" / "dqn.py"), "--set", f"run_dir='{run}'",
         "--set", "live=False", "--set", "resume=True"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        f"reactor: run directory {run / 'replay-0'} holds a symbolic link {run / 'replay-0' / 'inserted'} -> "
        f"{elsewhere / 'thesis.tex'}: a run writes its files in place, and would write through it; remove the link "
        f"(or use another run directory)")
    assert (elsewhere / "thesis.tex").read_text() == "precious"
    # A link to a directory (a shard's checkpoints on another disk) is followed, once, and checked inside.
    (run / "replay-0" / "inserted").unlink()
    (run / "replay-1").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "loop").symlink_to(elsewhere, target_is_directory=True)
    refuse_file_links(run)
    (elsewhere / "summary.json").symlink_to("/etc/hostname")
    with pytest.raises(ValueError, match=r"holds a symbolic link .*summary\.json -> /etc/hostname"):
        refuse_file_links(run)
    refuse_file_links(tmp_path / "not-yet")  # (a new run directory: nothing to check)


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path):
    """A run_dir under a regular file (or in /proc): the replay shard's start failed, and then its shutdown
    tried to checkpoint into the same place and logged a second traceback over the first."""
    (tmp_path / "file").write_text("not a directory")
    out = subprocess.run(
        [sys.executable, "-m", "reactor.cli", "run", str(ROOT / "apps" / "dqn.py"), "--set",
         f"run_dir='{tmp_path / 'file' / 'run'}'", "--set", "live=False"], capture_output=True, text=True, timeout=300,
        cwd=ROOT)
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.strip().splitlines()  # (the first node to make its part of the directory names it)
    assert line.startswith(f"reactor: [Errno 20] Not a directory: '{tmp_path / 'file' / 'run'}"), line


def test_a_replay_checkpoint_with_a_fifo_or_a_device_in_it_is_refused_at_once(tmp_path):
    """A FIFO as a checkpoint's manifest or array hung the shard's start (reading it waits for a writer);
    /dev/zero linked there was read until memory ran out."""
    import numpy as np
    import torch

    from reactor.replay import CheckpointCorruptError, FieldSpec, Fifo, MinSize, Storage, Table, Uniform

    table = Table(Storage([FieldSpec("obs", (2,), torch.float32)], 32), sampler=Uniform(), remover=Fifo(),
                  rate_limiter=MinSize(1))
    table.insert_nowait({"obs": torch.zeros(8, 2)}, np.ones(8))
    for name, make in (("manifest.json", os.mkfifo), ("manifest.json", lambda p: os.symlink("/dev/zero", p)),
                       ("COMPLETE", lambda p: os.symlink("/dev/zero", p))):
        where = Path(table.save(tmp_path / name / make.__name__))
        (where / name).unlink()
        make(where / name)
        t = time.monotonic()
        with pytest.raises((CheckpointCorruptError, FileNotFoundError), match=r"is not a regular file|no complete"):
            Table.load(where)  # (a COMPLETE that is no file: the directory holds no complete checkpoint)
        assert time.monotonic() - t < 10
    where = Path(table.save(tmp_path / "npy"))
    npy = next(where.glob("*.npy"))
    npy.unlink()
    os.mkfifo(npy)
    with pytest.raises(CheckpointCorruptError, match=rf"{npy.name} is not a regular file"):
        Table.load(where)
    from reactor._files import refuse_file_links

    with pytest.raises(ValueError, match=r"which is neither a file nor a directory"):
        refuse_file_links(tmp_path)  # (the FIFOs above)


def _running_job(tmp_path: Path, proc: subprocess.Popen) -> tuple[object, str]:
    """An in-process daemon watching ``proc`` as a job of an earlier life (a record with its start time)."""
    from reactor.transport._shm import _pid_start_time

    job_id = "a" * 16
    daemon = _daemon_with(tmp_path, {job_id: _record(job_id, state="running", pid=proc.pid,
                                                     pid_start=_pid_start_time(proc.pid), ended_at=None,
                                                     returncode=None)})
    assert daemon.jobs[job_id].record["state"] == "running"
    return daemon, job_id


def test_a_job_record_that_cannot_be_written_is_written_at_a_later_watch_and_the_watch_goes_on(tmp_path, caplog):
    """One failed write (a full disk, no descriptors left: a stranger's idle connections can use them up)
    ended the daemon's watch for good: every later job stayed 'running', stops never escalated, and the
    daemon's SIGTERM ended in a traceback with its jobs still running."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        daemon, job_id = _running_job(tmp_path, proc)
        record = daemon.state / "jobs" / job_id / "job.json"
        blocker = record.with_name(".job.json.tmp")
        blocker.mkdir()  # the record's write fails (its temporary file cannot be made): an OSError
        proc.kill()
        proc.wait()
        for _ in range(3):
            daemon._watch_once()
        assert daemon.jobs[job_id].record["state"] == "ended" and daemon.jobs[job_id].unsaved
        assert json.loads(record.read_text())["state"] == "running"  # (not written yet)
        assert sum("cannot write job" in r.getMessage() for r in caplog.records) == 1  # once, not per watch
        ok, rows = daemon.handle([1, "status", None])
        assert ok and rows[0]["state"] == "ended"
        blocker.rmdir()
        daemon._watch_once()
        assert json.loads(record.read_text())["state"] == "ended" and not daemon.jobs[job_id].unsaved
    finally:
        proc.kill()
        proc.wait()


def test_a_job_whose_directory_was_removed_is_not_written_again_at_every_watch(tmp_path, caplog):
    """Regression (a soak of a long-lived daemon): a running job's directory removed by hand (an operator
    clearing STATE/jobs) made its end's record unwritable for good: the daemon tried again at every watch
    (5 a second) and warned once a minute, for the rest of its life."""
    import shutil

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        daemon, job_id = _running_job(tmp_path, proc)
        shutil.rmtree(daemon.state / "jobs" / job_id)
        proc.kill()
        proc.wait()
        for _ in range(3):
            daemon._watch_once()
        job = daemon.jobs[job_id]
        assert job.record["state"] == "ended" and not job.unsaved
        said = [r.getMessage() for r in caplog.records if job_id in r.getMessage() and r.levelname == "WARNING"]
        assert said == [f"h1: job {job_id}'s directory {daemon.state / 'jobs' / job_id} was removed: its record "
                        f"(ended) is kept in memory only, and a restarted daemon will not list it"], said
        ok, row = daemon.handle([1, "status", job_id])
        assert ok and row["state"] == "ended" and row["last_line"] == ""
        assert not (daemon.state / "jobs" / job_id).exists()  # (not made again)
    finally:
        proc.kill()
        proc.wait()


def test_a_link_planted_at_a_records_temporary_name_is_not_written_through(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        daemon, job_id = _running_job(tmp_path, proc)
        victim = tmp_path / "victim.txt"
        victim.write_text("precious")
        record = daemon.state / "jobs" / job_id / "job.json"
        record.with_name(".job.json.tmp").symlink_to(victim)
        daemon.stop(job_id)  # (writes the record: stop_requested)
        assert victim.read_text() == "precious"
        assert not record.is_symlink() and json.loads(record.read_text())["stop_requested"] is True
    finally:
        proc.kill()
        proc.wait()


def test_a_fifo_for_a_jobs_log_is_not_waited_on_by_status_or_logs(tmp_path):
    """A job's own code can make one (its directory is the job's): `status` used to hang the daemon's
    loop in open(), and every client and the watch with it."""
    job_id = "a" * 16
    daemon = _daemon_with(tmp_path, {job_id: _record(job_id)})
    os.mkfifo(daemon.state / "jobs" / job_id / "output.log")
    t = time.monotonic()
    ok, rows = daemon.handle([1, "status", None])
    assert ok and rows[0]["last_line"] == ""
    from reactor.launch._daemon import DaemonError

    with pytest.raises(DaemonError, match=r"^cannot read output.log: .*output.log is not a regular file$"):
        daemon.handle([2, "logs", job_id, 0])  # (answered with the reason: _answer)
    assert time.monotonic() - t < 5


@pytest.mark.parametrize("kind", ["fifo", "link"])
def test_a_daemon_lock_that_is_a_fifo_or_a_link_is_refused_at_once(tmp_path, kind):
    from reactor.launch._daemon import _StateLock

    state = tmp_path / "state"
    state.mkdir()
    if kind == "fifo":
        os.mkfifo(state / "daemon.lock")
    else:
        (tmp_path / "elsewhere").write_text("x")
        (state / "daemon.lock").symlink_to(tmp_path / "elsewhere")
    t = time.monotonic()
    with pytest.raises(ValueError, match=r"daemon.lock is not a regular file: remove it"):
        _StateLock(state)
    assert time.monotonic() - t < 5
    if kind == "link":
        assert (tmp_path / "elsewhere").read_text() == "x"


def test_a_config_too_large_for_a_jobs_command_line_and_record_is_refused_and_leaves_nothing(tmp_path):
    """A 1.2 MB config string made a record the restarted daemon could not read back (the job then ran
    unwatched), and one over 128 KiB failed to start, leaving a job directory without a record."""
    from reactor.launch._daemon import CONFIG_MAX_NBYTES, DaemonError, job_spec

    daemon = _daemon_with(tmp_path, {})
    spec = job_spec(ROOT / "tests" / "apps" / "gated.py", config={"notes": "n" * CONFIG_MAX_NBYTES})
    with pytest.raises(DaemonError, match=r"config is 65,544 bytes as --set values, more than the 65,536 a job takes: "
                                          r"ship large data as a file \(--with\)"):
        asyncio.run(daemon.submit(spec))
    assert not daemon.jobs and not any((daemon.state / "jobs").iterdir())


def test_a_submit_whose_record_cannot_be_written_leaves_no_process_and_no_directory(tmp_path, monkeypatch):
    """The job's process has started when its record is written: a failure there (a full disk) used to
    leave it running, unwatched, in a directory without a record."""
    from reactor.launch._daemon import _Job, job_spec

    daemon = _daemon_with(tmp_path, {})
    started: list[int] = []

    def save(job: _Job) -> None:
        started.append(int(job.record["pid"]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_Job, "save", save)
    with pytest.raises(OSError, match="No space left on device"):
        asyncio.run(daemon.submit(job_spec(ROOT / "tests" / "apps" / "gated.py")))
    assert len(started) == 1 and not daemon.jobs and not any((daemon.state / "jobs").iterdir())
    assert not Path(f"/proc/{started[0]}").exists()  # (killed and reaped: not even a zombie)


def test_a_segment_a_killed_worker_left_half_made_is_removed_when_its_run_is_reaped():
    """A shard SIGKILLed while creating a segment (sized, its header not written yet) left it in /dev/shm:
    such a segment is kept for a while in case its creator lives, and the coordinator's cleanup after
    reaping every worker of the run used that grace too (found in a CI run: `...-s-replay-0.header`)."""
    import uuid

    from reactor.launch._localworkers import _cleanup_segments
    from reactor.transport._shm import HEADER_NBYTES, list_segments

    run_id = f"t-{uuid.uuid4().hex[:12]}"
    path = Path("/dev/shm") / f"rxb.{run_id}.-s-replay-0.header"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, HEADER_NBYTES)  # (all zeros: no magic, no owner)
    finally:
        os.close(fd)
    try:
        assert list_segments(run_id)
        _cleanup_segments(run_id)
        assert not list_segments(run_id) and not path.exists()
    finally:
        path.unlink(missing_ok=True)


def test_the_submit_import_check_reads_an_app_nested_past_pythons_limits_without_failing(tmp_path):
    """The check of an app's unshipped imports (launch/_app.py) read the file's tree by recursion, so an
    app with an expression nested ~2,000 deep ended `reactor submit` in a RecursionError traceback, and one
    the parser itself cannot take (MemoryError) too. Now the first is checked (its unshipped import
    refused), the second left to the compile that says what is wrong with it."""
    from reactor._errors import AppError
    from reactor.launch._app import check_imports_shipped

    (tmp_path / "mysib.py").write_text("X = 1\n")
    deep = tmp_path / "deep.py"
    deep.write_text("import mysib\nx = " + "-" * 2000 + "1\n")
    with pytest.raises(AppError, match=r"mysib \(.*mysib\.py, imported at .*deep\.py line 1\).*--with"):
        check_imports_shipped(deep)
    assert check_imports_shipped(deep, [tmp_path / "mysib.py"]) is None
    unparsable = tmp_path / "unparsable.py"
    unparsable.write_text("import mysib\nx = " + "-" * 100_000 + "1\n")
    assert check_imports_shipped(unparsable) is None
    # ... and the compile says it in one line naming the file (it was a bare MemoryError's traceback)
    from reactor.launch._app import compile_app, load_app

    for load in (compile_app, load_app):
        with pytest.raises(AppError, match=r"unparsable\.py does not compile: it nests deeper than Python's parser"):
            load(unparsable)
