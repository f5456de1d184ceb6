"""Runs over several hosts, for real: daemons in three network namespaces (tests/launch/hosts.py),
the coordinator here or on a daemon, workers on the hosts, CURVE on every link, heartbeats, kills and
a host unplugged from the network."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from reactor import GraphError, WorkerFailedError, run
from reactor.launch._app import build_graph
from reactor.launch._daemon import DaemonClient
from reactor.launch._keys import load_keys
from reactor.launch._placement import resolve_placement
from reactor.launch._rundir import OWNER_FILE, PREFIX, runtime_base
from reactor.transport._zmqreceive import hello_message

from .hosts import Cluster, free_subnet, in_thread, namespaces_available, segments_launched_by, wait_for

ROOT = Path(__file__).resolve().parents[2]
DQN = str(ROOT / "apps" / "dqn.py")
DEMO = str(ROOT / "apps" / "demo_pipeline.py")


@pytest.fixture(scope="module")
def _shared(tmp_path_factory):
    """One three-host cluster for the module's tests (its daemons take ~4 s to start); made again
    if a test left a daemon of it dead."""
    holder: list[Cluster] = []

    def get() -> Cluster:
        if holder and not holder[0].daemons_alive():
            holder.pop().close()
        if not holder:
            holder.append(Cluster(tmp_path_factory.mktemp("cluster")))
        return holder[0]

    yield get
    for c in holder:
        c.close()


@pytest.fixture
def cluster(_shared, monkeypatch):
    """The module's cluster, clean (no worker, no run socket directory of its daemons) and marked:
    its `log`, `new_runs` and `hosted` show only this test's doings."""
    c = _shared()
    monkeypatch.setenv("REACTOR_KEYS", str(c.keys))
    wait_for(lambda: not c.worker_pids() and not _daemon_socket_dirs(c), 30, "the previous test's run to end")
    c.mark()
    yield c
    c.kill_workers()  # (a test that failed mid-run)


# ------------------------------------------------------------------------------ the test clusters' own network


def test_a_test_clusters_subnet_is_one_no_network_of_the_machine_overlaps():
    taken = [ipaddress.ip_network("198.18.0.0/16"), ipaddress.ip_network("198.19.7.0/24")]
    assert free_subnet(3, []) == "198.18.3"
    assert free_subnet(3, taken) == "198.19.0"  # (past the whole of 198.18: the next free /24)
    assert free_subnet(256 + 7, taken) == "198.19.8"
    assert free_subnet(511, [ipaddress.ip_network("198.19.0.0/16")]) == "198.18.0"  # (around the end)
    with pytest.raises(RuntimeError, match="overlaps a network this machine routes"):
        free_subnet(0, [ipaddress.ip_network("198.16.0.0/12")])


def test_the_networks_a_machine_routes_are_read_from_its_routing_tables():
    """In a network namespace of its own with one interface (a veth) holding 198.18.0.1/16, a route to
    198.19.0.0/17 and a catch-all route to 128.0.0.0/1 (a VPN's): the first two are what ``routed_here``
    reads there (with the local and broadcast routes the kernel adds), the catch-all is not, and the
    cluster subnet picked from them overlaps neither."""
    if namespaces_available() is not None:
        pytest.skip(f"no network namespaces here: {namespaces_available()}")
    ns = f"rxr{os.getpid() % 100000}"
    sh = ("ip link add d0 type veth peer name d1 && ip addr add 198.18.0.1/16 dev d0 && ip link set d1 up && "
          "ip link set d0 up && ip route add 198.19.0.0/17 dev d0 && "
          "ip route add 128.0.0.0/1 dev d0 && exec \"$0\" -c \"$1\" \"$2\"")
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from hosts import routed_here, free_subnet; "
            "nets = routed_here(); print(json.dumps([str(n) for n in nets] + [free_subnet(0, nets)]))")
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=30)
    try:
        out = subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", sh, sys.executable, code,
                              str(Path(__file__).parent)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        *nets, picked = json.loads(out.stdout)
        assert "198.18.0.0/16" in nets and "198.19.0.0/17" in nets, nets
        assert "0.0.0.0/0" not in nets and "128.0.0.0/1" not in nets, nets  # (catch-alls are not counted)
        assert picked == "198.19.128", picked  # the first /24 of the range clear of both
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


# ------------------------------------------------------------------------------ the placement side


def _write(tmp_path: Path, text: str, name: str = "p.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_placement_hosts_are_checked_and_policies_spread_over_them(tmp_path):
    graph = build_graph(DQN, {"actors": 2, "shards": 2})
    hosts = _write(tmp_path, '[hosts]\na = "tcp://10.0.0.1:7000"\nb = "tcp://10.0.0.2:7000"\n'
                             'c = { address = "tcp://10.0.0.3:7000", key = "rq3[Tz[Q?ck8gqR(W<4l0qJ^[>fv@X)TnW2c!$)v" }\n',
                   "hosts.toml")
    plan = resolve_placement(graph, "actors", hosts)
    assert [(g.name, g.hosts) for g in plan.groups] == [
        ("learner", ("a",)), ("actor-0", ("b",)), ("actor-1", ("c",)), ("replay-0", ("a",)), ("replay-1", ("b",))]
    assert plan.hosts["c"].key == b"rq3[Tz[Q?ck8gqR(W<4l0qJ^[>fv@X)TnW2c!$)v" and plan.hosts["a"].key is None
    assert plan.settings["heartbeat_timeout_s"] == 3.0
    groups = ('[groups.head]\nreactors = ["learner", "evaluator", "metrics"]\nhost = ["b", "a"]\n'
              '[groups.rest]\nreactors = ["actor*", "replay*"]\n')
    plan = resolve_placement(graph, _write(tmp_path, '[hosts]\na = "tcp://h:1"\nb = "tcp://h:2"\n' + groups))
    assert [(g.name, g.hosts) for g in plan.groups] == [("head", ("b", "a")), ("rest", ("a",))]
    bad = {
        '[hosts]\na = "tcp://h:1"\n' + groups: "names host 'b', which [hosts] lacks",
        '[hosts]\na = "http://h:1"\nb = "tcp://h:2"\n' + groups: "host 'a' needs a daemon address tcp://HOST:PORT",
        groups: "names a host, but there is no [hosts] table",
        '[hosts]\na = { address = "tcp://h:1", key = "nope.pub" }\n' + groups: "host 'a': cannot read its key",
        '[hosts]\na = "tcp://h:1"\nb = "tcp://h:2"\n[cluster]\nheartbeat_timeout_s = 0.1\n' + groups:
            "heartbeat_timeout_s must be a number of seconds",
        '[hosts]\na = "tcp://h:1"\n[groups.x]\nreactors = ["*"]\nhost = "a"\nbind = "tcp://1.2.3.4:*"\n':
            "has both host and bind",
        '[hosts]\na = "tcp://h:1"\n[groups.x]\nreactors = ["*"]\nretries = 3\n': "unknown fields ['retries']",
        '[hosts]\n"a\\n" = "tcp://h:1"\n' + groups: "host name 'a\\n' must match",  # ("$" let a newline end it)
    }
    for text, message in bad.items():
        with pytest.raises(GraphError, match=re.escape(message)):
            resolve_placement(graph, _write(tmp_path, text))
    with pytest.raises(GraphError, match="has its own \\[hosts\\]"):
        resolve_placement(graph, _write(tmp_path, '[hosts]\na = "tcp://h:1"\n' + groups.replace('["b", "a"]', '"a"')),
                          hosts)


def test_a_hosts_file_whose_port_is_not_a_port_is_refused_at_the_terminal_before_the_app_is_imported(tmp_path):
    """Regression (a newcomer's pass): a hosts file with ``tcp://10.0.0.1:70000`` (a typo) was taken; the run
    imported the app and torch, then waited out the heartbeat timeout and said the host "did not answer
    'ping'", naming keys as the likely cause. It is one line naming the port, from ``run`` before the app
    is imported (so are the hosts file's other mistakes)."""
    graph = build_graph(DEMO, {})
    for port in ("70000", "0"):
        with pytest.raises(GraphError, match=f"host 'a': port {port} of tcp://10.0.0.1:{port} is not a port"):
            resolve_placement(graph, "actors", _write(tmp_path, f'[hosts]\na = "tcp://10.0.0.1:{port}"\n', "h.toml"))
    hosts = _write(tmp_path, '[hosts]\na = "tcp://10.0.0.1:7000"\nb = "tcp://10.0.0.2:70000"\n', "hosts.toml")
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", DEMO, "--placement", "actors", "--hosts", hosts],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2 and p.stderr == (f"reactor: hosts file {hosts}: host 'b': port 70000 of "
                                              f"tcp://10.0.0.2:70000 is not a port (1..65535)\n"), p.stderr


# ------------------------------------------------------------------------------ real runs over hosts


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dqn_over_three_hosts_has_the_weights_of_one_process_and_leaves_nothing(cluster, tmp_path):
    """A seeded DQN run with a step budget: `actors` spread over three hosts (coordinator here, CURVE
    on every link between hosts, plain ipc between two groups of one host, shared memory never across
    hosts) ends with the same weights hash as `single`, and its hosts keep nothing of it."""
    base = {"max_env_steps": 2000, "target_return": None, "live": False}
    one = {**base, "run_dir": str(tmp_path / "single")}
    many = {**base, "run_dir": str(tmp_path / "hosts")}
    run(build_graph(DQN, one), app=DQN, config=one, seed=5)
    before = segments_launched_by()
    r = run(build_graph(DQN, many), app=DQN, config=many, seed=5, placement="actors", hosts=str(cluster.write_hosts()))
    assert r.stopped_by == "quiescence"
    assert r.hosts == {"learner": "h1", "actor-0": "h2", "actor-1": "h3", "replay-0": "h1", "replay-1": "h2"}
    assert all(s["curve"] for s in r.processes.values())  # every endpoint's tcp socket
    # Links between two groups of one host went to the receiver's plain ipc socket, the rest over
    # tcp with CURVE (in this app every group sends to every other group of its host).
    assert {g: s["links_plain"] for g, s in r.processes.items()} == {
        g: sum(o != g and r.hosts[o] == h for o in r.hosts) for g, h in r.hosts.items()}
    assert all(s["links_curve"] >= 2 for s in r.processes.values())
    assert sum(r.dropped.values()) == 0
    assert _weights(tmp_path / "hosts") == _weights(tmp_path / "single")
    cluster.wait_no_workers()
    assert segments_launched_by() <= before  # the hosts' daemons removed the run's shared memory
    wait_for(lambda: not _daemon_socket_dirs(cluster), 10, "the daemons to remove the run's socket directories")
    # Each host ran its groups in its own directory with their logs; its daemon ended the run there.
    for h, groups in {"h1": {"learner", "replay-0"}, "h2": {"actor-0", "replay-1"}, "h3": {"actor-1"}}.items():
        (run_dir,) = cluster.new_runs(h)
        assert {p.stem for p in run_dir.glob("*.log")} == groups
        wait_for(lambda h=h: "ended here (its coordinator ended it)" in cluster.log(h), 10, f"{h} to end the run")
        # Its workers were forked from the daemon's fork server (torch imported there once), and
        # computed what fresh interpreters did.
        log = cluster.log(h)
        assert {f"started group {g} (pid" for g in groups} == set(re.findall(r"started group \S+ \(pid", log))
        assert log.count(", forked)") == len(groups), log


def _daemon_socket_dirs(cluster: Cluster) -> list[Path]:
    """The run socket directories (``reactor/launch/_rundir.py``) the cluster's daemons own."""
    pids = {p.pid for p in cluster.procs.values()}
    out = []
    for d in runtime_base().glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            if json.loads((d / OWNER_FILE).read_text())["pid"] in pids:
                out.append(d)
    return out


def _async_dqn(cluster: Cluster, tmp_path: Path, placement: str = "actors", **kw):
    cfg = {"max_env_steps": 10**7, "target_return": None, "live": False, "run_dir": str(tmp_path / "run")}
    return lambda: run(build_graph(DQN, cfg), app=DQN, config=cfg, placement=placement, deterministic=False,
                       hosts=str(cluster.write_hosts()) if placement == "actors" else None, **kw)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_learner_draws_from_a_shard_of_another_host_through_its_read_server_ahead_of_its_updates(cluster, tmp_path):
    """replay_remote_reads="zmq", asynchronous, `actors` over three hosts: the learner (h1) samples
    replay-0 (h1: its shared memory) and replay-1 (h2: its read server draws and sends its part, over
    tcp with CURVE) in one draw per batch, and the next batch is drawn while it updates on this one.
    After the first batches (messages: their replies bring the offers) every batch is one-sided; most
    were drawn during the update before them; the shards counted what was drawn from them."""
    cfg = {"max_env_steps": 4000, "target_return": None, "live": False, "run_dir": str(tmp_path / "run"),
           "replay_remote_reads": "zmq"}
    r = run(build_graph(DQN, cfg), app=DQN, config=cfg, placement="actors", deterministic=False,
            hosts=str(cluster.write_hosts()))
    assert r.stopped_by == "quiescence"
    assert r.hosts["learner"] == "h1" and r.hosts["replay-0"] == "h1" and r.hosts["replay-1"] == "h2"
    last: dict[str, float] = {}
    for row in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]:
        _wall, _steps, source, name, value = row.split(",")
        if source == "learner" and name in ("updates", "one_sided_batches", "drawn_ahead_batches"):
            last[name] = float(value)
    assert last["updates"] > 100 and last["one_sided_batches"] >= 0.9 * last["updates"], last
    assert last["drawn_ahead_batches"] >= 0.5 * last["updates"], last
    cluster.wait_no_workers()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_remote_worker_ends_the_run_naming_it_and_its_host_and_nothing_is_left(cluster, tmp_path):
    t, box = in_thread(_async_dqn(cluster, tmp_path))
    pids = wait_for(lambda: len(p := cluster.worker_pids()) == 5 and p, 120, "five workers on the hosts")
    time.sleep(3)  # training
    (victim,) = [pid for pid, g in pids.items() if g == "actor-1"]
    os.kill(victim, signal.SIGKILL)
    t.join(60)
    assert not t.is_alive()
    err = box.get("error")
    assert isinstance(err, WorkerFailedError), box
    assert str(err).startswith("worker 'actor-1' was killed by SIGKILL on host 'h3' before the run ended"), err
    cluster.wait_no_workers()
    for h in cluster.names:
        wait_for(lambda h=h: "ended here" in cluster.log(h), 10, f"{h} to end the run")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_unplugged_host_is_detected_within_the_heartbeat_timeout_and_its_daemon_ends_the_orphans(tmp_path,
                                                                                                    monkeypatch):
    # Its daemons start every worker as a new interpreter (the path without a fork server).
    c = Cluster(tmp_path, heartbeat_timeout_s=2.0, fork_server=False)
    monkeypatch.setenv("REACTOR_KEYS", str(c.keys))
    try:
        if not c.netns:
            pytest.skip("unplugging a host needs network namespaces")
        t, box = in_thread(_async_dqn(c, tmp_path))
        wait_for(lambda: len(c.worker_pids()) == 5, 120, "five workers on the hosts")
        time.sleep(2)
        c.cut("h3")
        t.join(60)
        err = box.get("error")
        assert isinstance(err, WorkerFailedError), box
        # The first cause named: a worker lost with its host; h3 held actor-1 only.
        assert "worker 'actor-1' was lost with host 'h3'" in str(err), err
        # h3 ran on, cut off: its daemon ends the run's worker there when the lease runs out.
        wait_for(lambda: not c.worker_pids("h3"), 30, "h3's daemon to end the orphaned worker")
        c.plug("h3")
        c.wait_no_workers()
        assert "no word from its coordinator" in (tmp_path / "h3" / "daemon.log").read_text()
        assert "(pid" in (log := (tmp_path / "h1" / "daemon.log").read_text()) and ", forked)" not in log
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_candidate_host_that_is_down_is_passed_over(cluster, tmp_path):
    """A group's candidates in order: the first is a daemon that is not there, the second runs it."""
    placement = tmp_path / "p.toml"
    dead = "tcp://127.0.0.1:9"  # nothing listens on the discard port
    placement.write_text(cluster.hosts_toml({**cluster.addresses, "gone": dead}) +
                         '[groups.head]\nreactors = ["collector"]\nhost = "h1"\n'
                         '[groups.producers]\nreactors = ["producer*"]\nhost = ["gone", "h2"]\n'
                         '[groups.squarers]\nreactors = ["squarer*"]\nhost = "h3"\n')
    r_hosts = run(build_graph(DEMO, {}), app=DEMO, config={}, placement=str(placement), digest=True)
    r_one = run(build_graph(DEMO, {}), digest=True)
    assert r_hosts.hosts == {"head": "h1", "producers": "h2", "squarers": "h3"}
    assert r_hosts.digests == r_one.digests
    cluster.wait_no_workers()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_submit_over_hosts_runs_the_coordinator_on_the_head_daemon(cluster, tmp_path):
    """`reactor submit APP --placement FILE` with no --daemon: the job goes to the head host's daemon,
    whose coordinator places the groups on the three hosts with the daemon's (cluster) key."""
    placement = tmp_path / "cluster.toml"
    placement.write_text(cluster.hosts_toml() + '[groups.head]\nreactors = ["collector"]\nhost = "h2"\n'
                         '[groups.producers]\nreactors = ["producer*"]\nhost = "h1"\n'
                         '[groups.squarers]\nreactors = ["squarer*"]\nhost = "h3"\n')
    cli = [sys.executable, "-m", "reactor.cli"]
    out = subprocess.run([*cli, "submit", DEMO, "--placement", str(placement), "--set", "stop_s=20.0"],
                         env=cluster.env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{16}", job) and cluster.addresses["h2"] in out.stderr
    keys = load_keys(cluster.keys)
    with DaemonClient(cluster.addresses["h2"], keys.public, keys) as c:
        wait_for(lambda: c.request("status", job)["state"] != "running" or None, 240, "the job to end")
        final = c.request("status", job)
        assert final["state"] == "finished", (final, c.request("logs", job, 0)["data"][-3000:])
        assert "run ended (stop_time)" in final["last_line"]
    for h, group in (("h1", "producers"), ("h3", "squarers")):
        assert [(w["group"], w["state"]) for w in cluster.hosted(h)] == [(group, "ended")]
    st = subprocess.run([*cli, "status", "--daemon", cluster.addresses["h1"]], env=cluster.env(),
                        capture_output=True, text=True, timeout=60)
    assert re.search(r"^run \S+  ended  up [\d.]+s  workers 0/1 alive  restarts 0  exits producers 0  on h1$",
                     st.stdout, re.M), st
    # The job's status names where each group ran, with the detail of those its own daemon hosts; a group's
    # output comes from its own host's daemon.
    st = subprocess.run([*cli, "status", job, "--daemon", cluster.addresses["h2"]], env=cluster.env(),
                        capture_output=True, text=True, timeout=60)
    assert re.search(r"\n  head on h2  ended exit 0  pid \d+  up [\d.]+s  restarts 0\n  producers on h1\n"
                     r"  squarers on h3\n  \(run \S+; reactor logs [0-9a-f]{16} GROUP\)\n$", st.stdout), st
    logs = subprocess.run([*cli, "logs", job, "head", "--daemon", cluster.addresses["h2"]], env=cluster.env(),
                          capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0 and re.search(r"^collector: \d+ values, sum \d+$", logs.stdout, re.M), logs
    (head_log,) = [d / "head.log" for d in cluster.new_runs("h2") if (d / "head.log").exists()]
    assert logs.stdout == head_log.read_text()
    bad = subprocess.run([*cli, "logs", job, "nope", "--daemon", cluster.addresses["h2"]], env=cluster.env(),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and f"job {job} has no group 'nope' on a host of its own (it has head, producers, " \
                                   f"squarers)" in bad.stderr, bad
    cluster.wait_no_workers()


def test_a_spawn_from_an_unauthorized_key_is_refused_and_garbage_is_dropped(cluster, tmp_path):
    """The daemon's spawn path: an unknown key never gets an answer (its handshake is refused); malformed
    spawn requests from an authorized one are refused naming the field; the daemon serves on."""
    from reactor.launch._daemon import DaemonKeyError
    from reactor.launch._keys import init_keys

    stranger = init_keys(tmp_path / "stranger")
    keys = load_keys(cluster.keys)
    with DaemonClient(cluster.addresses["h1"], keys.public, stranger, timeout_s=1.5) as c:
        with pytest.raises(DaemonKeyError, match="it refused our key in the CURVE handshake"):
            c.request("ping")
    good = {"run": "r1", "group": "g", "app": "a.py", "files": {"a.py": b"x"},
            "sha256": {"a.py": "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"},
            "worker": {}, "lease_s": 5.0}
    with DaemonClient(cluster.addresses["h1"], keys.public, keys) as c:
        for field, value, message in (("run", "../x", "run: a run id"), ("group", "a/b", "group: a group name"),
                                      ("files", {"../a.py": b"x"}, "not a relative path"),
                                      ("worker", {"x": b"bytes"}, "worker: a worker spec"),
                                      ("lease_s", 0, "lease_s")):
            req = {**good, field: value}
            with pytest.raises(Exception, match=message):
                c.request("spawn", req)
        with pytest.raises(Exception, match="does not match its sha256"):
            c.request("spawn", {**good, "sha256": {"a.py": "0" * 64}})
        with pytest.raises(Exception, match=r"a group name"):
            c.request("worker_log", "r1", "../../etc/passwd", 0)
        with pytest.raises(Exception, match=r"hosts no group 'g' of run 'r1'"):
            c.request("worker_log", "r1", "g", 0)
        for path in ("../../etc/passwd", "/etc/passwd", "a/../../b", ".hidden"):
            with pytest.raises(Exception, match=r"a relative path of \[A-Za-z0-9_.-\] parts"):
                c.request("run_file", "r1", path, 0)
        with pytest.raises(Exception, match=r"hosts no run 'r1'"):
            c.request("run_files", "r1")
        assert c.request("ping")["name"] == "h1"
    assert cluster.hosted("h1") == []  # (nothing of this test's was hosted)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_data_parallel_learners_on_two_hosts_rendezvous_over_tcp_and_match_one_host(cluster, tmp_path, capfd,
                                                                                    monkeypatch):
    """dp-learners over hosts: the replicas join through the coordinator's TCP store (no shared file:
    each host has its own run directory) and end with the weights of the same run on one host. The
    relative run directory's files, written on two hosts, are copied back to where the run started."""
    monkeypatch.chdir(tmp_path)
    cfg = {"max_env_steps": 2500, "target_return": None, "live": False, "learners": 2}
    local = {**cfg, "run_dir": str(tmp_path / "local")}
    run(build_graph(DQN, local), app=DQN, config=local, placement="dp-learners")
    here = re.findall(r"^learner\[(\d)\]: \d+ updates; final weights sha256 ([0-9a-f]{64})$", capfd.readouterr().out,
                      re.M)
    far = {**cfg, "run_dir": "dp"}  # relative: each host's own run directory
    r = run(build_graph(DQN, far), app=DQN, config=far, placement="dp-learners",
            hosts=str(cluster.write_hosts()))
    assert r.hosts["learner-0"] != r.hosts["learner-1"]
    there = []
    for i in (0, 1):
        (log,) = [d / f"learner-{i}.log" for d in cluster.new_runs(r.hosts[f"learner-{i}"])
                  if (d / f"learner-{i}.log").exists()]
        there += re.findall(r"^learner\[(\d)\]: \d+ updates; final weights sha256 ([0-9a-f]{64})$", log.read_text(),
                            re.M)
    assert len(here) == 2 and sorted(there) == sorted(here)
    assert here[0][1] == here[1][1]
    back = tmp_path / "dp"  # the coordinator's working directory is tmp_path
    assert (back / "weights.sha256").read_text().strip() == here[0][1]
    (written,) = [d / "dp" / "metrics.csv" for h in cluster.names for d in cluster.new_runs(h)
                  if (d / "dp" / "metrics.csv").exists()]  # on the host of the metrics' group
    assert (back / "metrics.csv").read_text() == written.read_text()
    assert (back / "replay-0").is_dir() and not (back / "app").exists() and not list(back.glob("*.log"))
    cluster.wait_no_workers()


def _listening_ports(pid: int) -> list[int]:
    """The tcp ports process ``pid`` listens on (in its own network namespace)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = []
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A" and f[9] in inodes:  # LISTEN
                    ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(set(ports))


def _seeded_dqn_over_hosts_in_thread(cluster: Cluster, tmp_path: Path):
    """The attack tests' runs: seeded DQN with a step budget in one process (tmp_path/single, the
    reference), then under `actors` over the cluster's hosts in a thread (tmp_path/hosts); (thread, box)."""
    base = {"max_env_steps": 2000, "target_return": None, "live": False}
    one = {**base, "run_dir": str(tmp_path / "single")}
    many = {**base, "run_dir": str(tmp_path / "hosts")}
    run(build_graph(DQN, one), app=DQN, config=one, seed=5)
    return in_thread(lambda: run(build_graph(DQN, many), app=DQN, config=many, seed=5, placement="actors",
                                 hosts=str(cluster.write_hosts())))


def _weights(run_dir: Path) -> str:
    return (run_dir / "weights.sha256").read_text()


def _attack(address: str, rng: random.Random, ctx: zmq.Context) -> None:
    """Raw garbage, a large blob, and zmq peers without the run's CURVE key speaking garbage and the
    worker protocol's hello, at one tcp address."""
    host, port = address.rsplit(":", 1)
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1) as s:
        s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512))))
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1) as s:
        s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + os.urandom(1 << 20))  # a ZMTP greeting, then 1 MiB
    plain = ctx.socket(zmq.DEALER)
    curved = ctx.socket(zmq.DEALER)
    pub, sec = zmq.curve_keypair()
    curved.curve_publickey, curved.curve_secretkey = pub, sec
    curved.curve_serverkey = zmq.curve_keypair()[0]  # not the run's: the handshake must fail
    for s in (plain, curved):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"learner")  # a real group's name
        s.connect(f"tcp://{address}")
        with contextlib.suppress(zmq.ZMQError):
            s.send_multipart([b"", hello_message("learner", os.urandom(8), 0)], zmq.NOBLOCK)
            s.send_multipart([bytes(rng.getrandbits(8) for _ in range(64))], zmq.NOBLOCK)
    time.sleep(0.05)
    plain.close()
    curved.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_over_hosts_under_garbage_on_every_workers_and_daemons_port_ends_with_the_undisturbed_weights(
        cluster, tmp_path):
    """While a seeded DQN run over three hosts trains, every tcp port its workers listen on (their
    endpoints, the shards' bulk read servers) and every daemon's port get raw garbage, a 1 MiB blob
    after a ZMTP greeting, and zmq peers without the run's CURVE key (plain, and with a wrong server
    key) posing as the learner. None gets past CURVE: the run drops no message, and ends with the
    weights of the same run in one process."""
    t, box = _seeded_dqn_over_hosts_in_thread(cluster, tmp_path)
    pids = wait_for(lambda: len(p := cluster.worker_pids()) == 5 and p, 120, "five workers on the hosts")
    ip_of = {pid: cluster.ips[h] for h in cluster.names for pid in cluster.worker_pids(h)}
    rng = random.Random(7)
    ctx = zmq.Context()
    attacked = set()
    try:
        deadline = time.monotonic() + 120
        while t.is_alive() and time.monotonic() < deadline:
            targets = [a.removeprefix("tcp://") for a in cluster.addresses.values()]
            for pid in pids:
                with contextlib.suppress(OSError):
                    targets += [f"{ip_of[pid]}:{port}" for port in _listening_ports(pid)]
            for address in targets:
                _attack(address, rng, ctx)
                attacked.add(address)
    finally:
        ctx.term()
    t.join(300)
    assert not t.is_alive() and "error" not in box, box
    r = box["result"]
    assert len(attacked) >= 3 + 5, attacked  # every daemon, and at least each worker's endpoint
    assert sum(r.dropped.values()) == 0, r.dropped
    assert _weights(tmp_path / "hosts") == _weights(tmp_path / "single")
    for h in cluster.names:
        with DaemonClient(cluster.addresses[h], load_keys(cluster.keys).public, load_keys(cluster.keys)) as c:
            assert c.request("ping")["name"] == h  # every daemon serves on
    cluster.wait_no_workers()


def _attack_local(path: str, rng: random.Random, ctx: zmq.Context) -> None:
    """What a process of the same user on a host can send to a worker's plain ipc socket: raw garbage,
    a zmq peer saying hello under the learner's name (live at that worker's tcp socket when the learner
    is on another host, at this one when it is not), and a newcomer that is welcomed and then sends
    garbage frames and a well-formed reactor message on a link it does not own."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        s.connect(path)
        s.sendall(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 512))))
    for name, msgs in ((b"learner", [[bytes(rng.getrandbits(8) for _ in range(64))]]),
                       (b"mallory", [[bytes(rng.getrandbits(8) for _ in range(64))],
                                     [msgpack.packb(["m", 0, 0, 10, 0, 7])]])):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.ROUTING_ID, name)
        d.connect(f"ipc://{path}")
        with contextlib.suppress(zmq.ZMQError):
            d.send_multipart([b"", hello_message(name.decode(), os.urandom(8), 0)], zmq.NOBLOCK)
            time.sleep(0.02)  # (the welcome, or nothing)
            for m in msgs:
                d.send_multipart(m, zmq.NOBLOCK)
        time.sleep(0.02)
        d.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_what_a_same_host_process_sends_to_the_workers_ipc_sockets_is_refused_and_the_run_ends_undisturbed(
        cluster, tmp_path):
    """The plain ipc socket each worker over hosts binds for its own host's peers (0700 directory: the
    same user's processes are the boundary, as on one host) is attacked throughout a seeded DQN run over
    three hosts, from its start on: garbage, a hello under the learner's name, a newcomer's garbage and a
    message on a link it does not own. The hellos under a name live at a worker's other socket are
    refused (no handover across its two sockets), the rest is dropped and counted, and the run ends with
    the weights of the same run in one process."""
    t, box = _seeded_dqn_over_hosts_in_thread(cluster, tmp_path)
    # Once every link is up: a name taken before its owner connects keeps the owner out (the denial of
    # service docs/architecture.md's trust boundaries state for the same user's processes).
    wait_for(lambda: (tmp_path / "hosts" / "metrics.csv").exists(), 120, "the run to start")
    rng = random.Random(11)
    ctx = zmq.Context()
    attacked = set()
    try:
        deadline = time.monotonic() + 120
        while t.is_alive() and time.monotonic() < deadline:
            for d in _daemon_socket_dirs(cluster):
                for path in d.glob("w*"):
                    _attack_local(str(path), rng, ctx)
                    attacked.add(path)
    finally:
        ctx.term()
    t.join(300)
    assert not t.is_alive() and "error" not in box, box
    r = box["result"]
    assert len(attacked) == 5, attacked  # every worker's ipc socket
    refused = {g: s["hellos_refused"] for g, s in r.processes.items()}
    # The learner is connected at the tcp socket of each worker it sends to on another host.
    assert sum(refused[g] for g in refused if g != "learner" and r.hosts[g] != r.hosts["learner"]) > 0, refused
    assert sum(r.dropped.values()) > 0, r.dropped  # the newcomers' garbage and foreign link, counted
    assert _weights(tmp_path / "hosts") == _weights(tmp_path / "single")
    cluster.wait_no_workers()
