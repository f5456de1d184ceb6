"""The daemons' fork server (reactor/launch/_forkserver.py): real forks of a real pre-imported
interpreter; what a child gets (its stdin, environment, directory, output, name, session), how its
end is reported, what a bad request does, and the server's own death."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reactor.launch._app import build_graph
from reactor.launch._forkserver import (
    Forks,
    ForkServer,
    ForkServerError,
    close_kept,
    kept_or_new,
    release_kept,
    workers_here,
)

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    s = ForkServer(["json", "reactor.launch._worker"])
    s.start()
    yield s
    s.close()


def _wait(pred, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not (got := pred()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def test_a_forked_worker_gets_its_spec_environment_directory_log_name_and_session(server, tmp_path):
    assert server.preloaded == ["json", "reactor.launch._worker"] and server.failed == {}
    log = tmp_path / "w.log"
    env = {**os.environ, "REACTOR_WORKER_GROUP": "actor-7", "ONLY_IN_CHILD": "yes"}
    # A worker spec naming an app that is not there: the worker reads it from stdin, says which
    # app it could not find, and exits as a refusal (2).
    spec = {"group": "actor-7", "app": str(tmp_path / "no_such_app.py"), "config": {}}
    p = server.spawn("worker", argv=["w"], cwd=tmp_path, env=env, stdin=json.dumps(spec).encode(), log_path=log,
                     title="rx:actor-7")
    assert _wait(lambda: Path(f"/proc/{p.pid}/comm").exists() and "rx:actor-7" in Path(f"/proc/{p.pid}/comm").read_text()
                 or p.poll() is not None)
    assert p.wait(30) == 2
    text = log.read_text()
    assert "no_such_app.py" in text, text


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_bytes()
        except OSError:
            continue
        if int(text[text.rindex(b")") + 2:].split()[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_a_daemons_job_forks_its_runs_fork_server_from_itself_not_a_new_interpreter(tmp_path):
    """Regression (a soak of a long-lived daemon): a job under `processes` on its daemon's host, its
    coordinator forked from the daemon's fork server (torch imported), started its run's fork server as a
    new interpreter that imported it all again (2.8 s a job). The coordinator forks it from itself: its
    imports are done, and it is still the job's own (a child of the job's coordinator, in its session), not
    the daemon's server that forks every job. (Here the daemon's server imports the command alone.)"""
    ready, out = tmp_path / "ready", tmp_path / "output.log"
    daemons = ForkServer(["reactor.cli", "reactor.launch._worker"])
    daemons.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "REACTOR_FORK_SERVER"}
        job = daemons.spawn("cli", argv=["reactor", "run", str(ROOT / "tests" / "apps" / "forever.py"), "--placement",
                                         "processes", "--verbose", "--set", f"ready_file={str(ready)!r}"],
                            cwd=tmp_path, env=env, log_path=out, title="rx-job")
        assert _wait(lambda: ready.exists() or job.poll() is not None, 60) and job.poll() is None, out.read_text()
        (server,) = _children(job.pid)  # (the job's coordinator has one child: its run's fork server)
        assert Path(f"/proc/{server}/cmdline").read_bytes() == Path(f"/proc/{job.pid}/cmdline").read_bytes()
        workers = sorted(Path(f"/proc/{w}/comm").read_text().strip() for w in _children(server))
        assert workers == ["rx:sink", "rx:ticker-0", "rx:ticker-1"], workers
        assert os.getsid(server) == os.getsid(job.pid) == job.pid  # (the job's session: its stop takes them all)
        assert f"the run's fork server is a fork of this process (pid {server}): reactor.cli, " \
               f"reactor.launch._worker imported already" in out.read_text()
        os.kill(job.pid, signal.SIGTERM)
        assert job.wait(60) == 128 + signal.SIGTERM, out.read_text()[-3000:]
        assert "run ended (signal)" in out.read_text()
        assert _wait(lambda: not Path(f"/proc/{server}").exists(), 10), "the run's fork server outlived its run"
    finally:
        daemons.close()


_PRINTING_APP = '''
from reactor import Graph, Input, Output, Reactor, Timer, reaction

class Producer(Reactor):
    tick = Timer(period_s=0.01)
    number = Output(int)

    @reaction(triggers=[tick], effects=[number])
    def emit(self) -> None:
        self.number.send(7)

class Printer(Reactor):
    number = Input(int, required=True)

    @reaction(triggers=[number])
    def show(self, number: int) -> None:
        print("printer got", number)

def build(config) -> Graph:
    g = Graph(stop_s=0.05)
    g.connect(g.add(Producer(), name="producer").number, g.add(Printer(), name="printer").number)
    return g
'''


def test_a_daemons_jobs_workers_print_to_the_jobs_log(tmp_path):
    """Regression (the README's first app, `reactor submit`ted to a daemon under `processes`): the job failed
    with `OSError: [Errno 22] Invalid argument` at the printer's first print, and its workers died of libuv's
    `uv__close: Assertion fd > STDERR_FILENO`. A worker forked from its run's server, itself forked from the
    job's coordinator, dropped the coordinator's sys.stdout, made with closefd=True: that closed the worker's
    fd 1 and 2, which the worker's sockets then took."""
    (tmp_path / "printing.py").write_text(_PRINTING_APP)
    out = tmp_path / "output.log"
    daemons = ForkServer(["reactor.cli", "reactor.launch._worker"])
    daemons.start()
    try:
        env = {k: v for k, v in os.environ.items() if k != "REACTOR_FORK_SERVER"}
        job = daemons.spawn("cli", argv=["reactor", "run", "printing.py", "--placement", "processes", "--verbose"],
                            cwd=tmp_path, env=env, log_path=out, title="rx-job")
        assert job.wait(90) == 0, out.read_text()[-3000:]
        text = out.read_text()
        assert "the run's fork server is a fork of this process" in text  # (the path under test)
        assert "printer got 7" in text and "run ended (stop_time)" in text, text[-3000:]
    finally:
        daemons.close()


def test_a_child_runs_in_its_own_session_and_directory_and_its_signal_death_is_reported(server, tmp_path):
    # `reactor daemon` with a state directory it cannot make runs until killed: a long-lived child.
    p = server.spawn("cli", argv=["reactor", "keys", "init", str(tmp_path / "k")], cwd=tmp_path, env=dict(os.environ),
                     log_path=tmp_path / "k.log", title="rx-job")
    assert p.wait(30) == 0 and (tmp_path / "k" / "key.pub").exists()  # it ran in the given directory
    q = server.spawn("cli", argv=["reactor", "daemon", "--listen", "tcp://127.0.0.1:*", "--name", "x", "--state-dir",
                                  str(tmp_path / "st"), "--keys", str(tmp_path / "k"), "--no-fork-server"],
                     cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "d.log", title="rx-job")
    assert _wait(lambda: (tmp_path / "st" / "daemon.json").exists()), (tmp_path / "d.log").read_text()
    assert os.getsid(q.pid) == q.pid  # a session of its own: the daemon signals its whole group
    assert os.readlink(f"/proc/{q.pid}/cwd") == str(tmp_path)
    assert q.poll() is None
    q.send_signal(signal.SIGKILL)
    assert q.wait(10) == -signal.SIGKILL


def test_a_childs_path_starts_at_its_own_directory_not_where_the_server_started(tmp_path, monkeypatch):
    """Regression: a daemon's workers had the daemon's starting directory first on their path (the
    server's sys.path[0]), so a stale module there shadowed the one shipped beside the app with
    --with (found as a newcomer ran the guide's custom env over localhost daemons started from the
    checkout). A child's path starts at its own directory, as a new interpreter's `-m` there would."""
    started_in = tmp_path / "typed-reactor-daemon-here"
    started_in.mkdir()
    (started_in / "h25_probe_env.py").write_text('WHERE = "where the daemon was started"\n')
    run_dir = tmp_path / "run"
    (run_dir / "app").mkdir(parents=True)
    (run_dir / "app" / "h25_probe_env.py").write_text('WHERE = "beside the app"\n')
    (run_dir / "app" / "app.py").write_text(
        "import sys\nimport h25_probe_env\nfrom reactor import Graph, Reactor\n"
        "print('probe:', h25_probe_env.WHERE, file=sys.stderr)\n\n"
        "class Idle(Reactor):\n    pass\n\n"
        "def build(config):\n    g = Graph()\n    g.add(Idle(), name='idle')\n    return g\n")
    monkeypatch.chdir(started_in)
    s = ForkServer(["json"])
    s.start()
    try:
        p = s.spawn("cli", argv=["reactor", "graph", str(run_dir / "app" / "app.py")], cwd=run_dir,
                    env=dict(os.environ), log_path=tmp_path / "g.log", title="rx-job")
        assert p.wait(60) == 0, (tmp_path / "g.log").read_text()
    finally:
        s.close()
    assert "probe: beside the app" in (tmp_path / "g.log").read_text()


def test_a_bad_request_is_answered_with_an_error_and_the_server_serves_on(server, tmp_path):
    with pytest.raises(ValueError, match="no fork-server entry 'os:system'"):
        server.spawn("os:system", argv=[], cwd=tmp_path, env={}, log_path=tmp_path / "x", title="x")
    server._req.write(b"{not json\n")
    server._req.write(json.dumps({"id": 999, "entry": "os:system"}).encode() + b"\n")
    assert _wait(lambda: 999 in server._answers)
    assert "no entry 'os:system'" in server._answers.pop(999)["error"]
    p = server.spawn("cli", argv=["reactor", "--help"], cwd=tmp_path, env=dict(os.environ),
                     log_path=tmp_path / "h.log", title="rx-job")
    assert p.wait(30) == 0 and "usage: reactor" in (tmp_path / "h.log").read_text()


def test_a_killed_server_takes_its_workers_and_the_daemon_starts_another(tmp_path):
    forks = Forks(["json"])
    forks.start()
    assert _wait(lambda: forks.state() != "starting") and forks.state().startswith("up")
    app = str(Path(__file__).parents[2] / "apps" / "demo_pipeline.py")
    owner_of = {n: "g" for _, _, n in build_graph(app, {}).instances()}
    spec = {"group": "g", "app": app, "config": {}, "owner_of": owner_of, "coordinator": "tcp://127.0.0.1:9",
            "bind": "tcp://127.0.0.1:*", "max_message_nbytes": 1 << 20, "deterministic": False, "record": False,
            "replay": None}
    # A worker whose coordinator never answers waits: alive until its parent, the server, dies.
    w = forks.spawn("worker", argv=["w"], cwd=tmp_path, env=dict(os.environ), stdin=json.dumps(spec).encode(),
                    log_path=tmp_path / "w.log", title="rx:g")
    assert w is not None and not _wait(lambda: w.poll() is not None, 1.0)
    server = forks.server
    assert server is not None and server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    assert _wait(lambda: w.poll() is not None), "the worker outlived its fork server"
    assert _wait(lambda: not server.alive)
    assert forks.spawn("cli", argv=["reactor", "--help"], cwd=tmp_path, env=dict(os.environ),
                       log_path=tmp_path / "h.log", title="rx-job") is None  # started as a new interpreter instead
    assert _wait(lambda: forks.state().startswith("up")) and forks.server is not server and forks.starts == 2
    forks.close()
    assert Forks(None).spawn("cli", argv=[], cwd=tmp_path, env={}, log_path=tmp_path / "n", title="x") is None
    assert Forks(None).state() == "off: the daemon was started with --no-fork-server"


def test_a_job_that_outlives_its_fork_server_ends_with_its_status_unknown_not_a_failure(tmp_path):
    """A job runs in a session of its own and outlives the server that forked it; its end was then
    reported as exit -15, and the daemon recorded a job that finished well as `failed exit -15`."""
    from reactor.launch._daemon import Daemon
    from reactor.launch._keys import init_keys

    init_keys(tmp_path / "k")
    server = ForkServer(["json"])
    server.start()
    try:
        job = server.spawn("cli", argv=["reactor", "daemon", "--listen", "tcp://127.0.0.1:*", "--name", "x",
                                        "--state-dir", str(tmp_path / "st"), "--keys", str(tmp_path / "k"),
                                        "--no-fork-server"],
                           cwd=tmp_path, env=dict(os.environ), log_path=tmp_path / "d.log", title="rx-job")
        assert _wait(lambda: (tmp_path / "st" / "daemon.json").exists()), (tmp_path / "d.log").read_text()
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGKILL)
        assert _wait(lambda: not server.alive)
        assert job.poll() is None and not job.status_unknown  # it runs on
        os.kill(job.pid, signal.SIGTERM)
        assert _wait(lambda: job.poll() is not None)
        assert job.returncode == -signal.SIGTERM and job.status_unknown
        # The daemon's record of such a job: ended, its status unknown, and why.
        init_keys(tmp_path / "dk")
        daemon = Daemon("tcp://127.0.0.1:0", "h1", tmp_path / "state", tmp_path / "dk", preload=None)
        from reactor.launch._daemon import _Job

        record = {"id": "b" * 16, "app": "a.py", "placement": "single", "state": "running", "pid": job.pid,
                  "pid_start": 1, "submitted_at": 1.0, "ended_at": None, "returncode": None}
        (daemon.state / "jobs" / ("b" * 16)).mkdir(parents=True)
        daemon.jobs["b" * 16] = j = _Job(record, daemon.state / "jobs" / ("b" * 16))
        j.proc = job
        daemon.watch()
        assert record["state"] == "ended" and record["returncode"] is None
        assert record["detail"] == "the fork server that started it died before it ended: its exit status is unknown"
    finally:
        server.close()


@pytest.mark.parametrize(("text", "here"), [
    ('[groups.all]\nmembers = ["*"]\n', True),
    ('[hosts]\nh1 = "tcp://10.0.0.1:7000"\n', False),
    ('[hosts.h1]\naddress = "tcp://10.0.0.1:7000"\n', False),  # a table per host
    ('hosts = { h1 = "tcp://10.0.0.1:7000" }\n', False),  # an inline table
    ('# no [hosts] here\n[groups.all]\nmembers = ["*"]\n', True),  # the words in a comment
    ('[groups.all\n', False),  # not TOML: the run names the error; no server is started for it
])
def test_workers_start_here_unless_a_hosts_table_or_file_names_other_hosts(tmp_path, text, here):
    """Whether ``reactor run`` and a notebook start a fork server early: the placement file's TOML
    decides (a table of hosts in any of TOML's spellings), not a search for the text "[hosts]"."""
    f = tmp_path / "p.toml"
    f.write_text(text)
    assert workers_here(str(f), None) is here
    assert workers_here("actors", None) is True
    assert workers_here("single", None) is False
    assert workers_here("actors", str(f)) is False  # --hosts FILE


def test_a_wait_for_a_server_that_was_stopped_says_so_and_a_second_wait_returns_at_once():
    """Runs sharing a kept server each wait for it: the second wait does not read the server's pipe
    again, and a wait for one that was stopped (it failed for an earlier waiter) says it is not running."""
    s = ForkServer(["json"])
    s.launch()
    s.wait_ready()
    s.wait_ready()  # (reading the pipe again would block: the server says nothing more)
    assert s.ready and s.preloaded == ["json"]
    s.close()
    stopped = ForkServer(["json"])
    stopped.launch()
    stopped.close()
    with pytest.raises(ForkServerError, match="the fork server is not running"):
        stopped.wait_ready()


def test_a_kept_server_that_a_run_still_uses_is_stopped_only_when_its_last_run_lets_it_go():
    """The main thread's next run needs more than the kept server imports (a learner's modules, say)
    while another thread's run still forks from it: a new server is kept, and the old one stays up
    until that run is done with it (its workers would die with it)."""
    import threading

    close_kept()  # (one an earlier run of this process kept)
    first, owned = kept_or_new(["json"])
    assert not owned
    got = {}
    t = threading.Thread(target=lambda: got.update(zip(("server", "owned"), kept_or_new(["json"]))))
    t.start()
    t.join()
    assert got == {"server": first, "owned": False}  # another thread's run shares it
    second, _ = kept_or_new(["json", "csv"])
    assert second is not first and first.alive and first.users == 2
    release_kept(first)  # the main thread's first run ends
    assert first.alive
    release_kept(first)  # the other thread's run ends
    assert _wait(lambda: not first.alive)
    release_kept(second)
    assert second.alive  # kept for the next run
    close_kept()
    assert _wait(lambda: not second.alive)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_process_keeps_its_fork_server_for_its_next_runs_while_its_directory_and_stdout_hold(tmp_path):
    """One process, nine multi-process runs through the Python API (tests/launch/kept_runs.py): the
    second run's workers are forked by the first run's server; a server that died, a new working
    directory or a new stdout gets a new server (whose workers write to the new stdout); a run from
    another thread uses the kept server while it fits, else a server of its own (gone at its end,
    and not kept); the next run from the main thread keeps a new one, and a run from a notebook's
    cell (in a thread of its own) uses it; none outlives the process."""
    out = subprocess.run([sys.executable, str(Path(__file__).parent / "kept_runs.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    steps = {r["step"]: r for r in map(json.loads, (line for line in out.stdout.splitlines() if line.startswith("{")))}
    parent = {step: r["parents"] for step, r in steps.items()}
    assert all(len(p) == 1 for p in parent.values()), parent  # both workers of a run: one server's
    first, killed, cwd, stdout, thread, again = (parent[s][0] for s in (
        "first", "after-kill", "other-cwd", "other-stdout", "thread-own", "main-again"))
    assert parent["second"] == [first] and steps["first"]["kept"] == first
    assert len({first, killed, cwd, stdout, thread, again}) == 6, parent
    assert parent["thread-kept"] == [stdout] and steps["thread-own"]["kept"] == stdout
    assert parent["notebook"] == [again] and steps["notebook"]["kept"] == again
    # The workers write where the process's stdout points when their server starts.
    lines = re.findall(r"w\[\d\] in pid \d+, parent (\d+)", out.stdout)
    assert sorted(map(int, lines)) == sorted([first] * 4 + [killed] * 2 + [cwd] * 2)
    assert sorted(map(int, re.findall(r"parent (\d+)", (tmp_path / "stdout.txt").read_text()))) == [stdout] * 4
    assert sorted(map(int, re.findall(r"parent (\d+)", (tmp_path / "stdout2.txt").read_text()))) == \
        sorted([thread] * 2 + [again] * 4)
    assert all(_gone(p) for p in (first, killed, cwd, stdout, thread, again))
