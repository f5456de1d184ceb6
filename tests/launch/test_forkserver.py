"""The daemons' fork server (reactor/launch/_forkserver.py): real forks of a real pre-imported
interpreter; what a child gets (its stdin, environment, directory, output, name, session), how its
end is reported, what a bad request does, and the server's own death."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from reactor.launch._app import build_graph
from reactor.launch._forkserver import Forks, ForkServer

pytestmark = pytest.mark.timeout(120)


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
    # app it could not find, and exits 1.
    spec = {"group": "actor-7", "app": str(tmp_path / "no_such_app.py"), "config": {}}
    p = server.spawn("worker", argv=["w"], cwd=tmp_path, env=env, stdin=json.dumps(spec).encode(), log_path=log,
                     title="rx:actor-7")
    assert _wait(lambda: Path(f"/proc/{p.pid}/comm").exists() and "rx:actor-7" in Path(f"/proc/{p.pid}/comm").read_text()
                 or p.poll() is not None)
    assert p.wait(30) == 1
    text = log.read_text()
    assert "no_such_app.py" in text, text


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
