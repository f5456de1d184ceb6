"""Hostile frames into live multi-process runs, and processes killed in them.

Real runs (``reactor run`` in a subprocess), real ipc sockets found in the run's private directory
(``REACTOR_RUNTIME_DIR`` points it into the test's tmp_path), raw ZeroMQ attackers, SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reactor._tag import FOREVER_NS
from reactor.transport._zmqreceive import hello_message
from reactor.transport.codec import encode

from ..runtime_dirs import run_env as _env
from ..runtime_dirs import runtime_dir as _rt
from .test_wire import protocol_messages

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "tests" / "apps"


def _hello(name: str) -> bytes:
    return hello_message(name, os.urandom(8), 0)


def _run(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, **kw) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "reactor.cli", "run", *args], cwd=ROOT,
                            env={**_env(tmp_path), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def _run_dir(tmp_path: Path) -> Path:
    return _wait_for(lambda: next((p for p in _rt(tmp_path).glob("reactor-*") if (p / "coordinator").exists()), None),
                     60, "the run directory")


def _dealer(ctx: zmq.Context, address: str, name: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, name.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDTIMEO, 1000)
    s.connect(address)
    s.send_multipart([b"", _hello(name)])
    return s


def _welcomed(s: zmq.Socket, timeout_ms: int) -> bool:
    if not s.poll(timeout_ms):
        return False
    frames = s.recv_multipart()
    return len(frames) == 2 and msgpack.unpackb(frames[1])[0] == 2


def _garbage(rng: random.Random) -> list[list[bytes]]:
    """Frames that are not messages, messages that are not protocol, and frames too large."""
    return [
        [bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))],
        [b"\xc1" + bytes(rng.getrandbits(8) for _ in range(16))],  # a batch marker over garbage
        [b"\xc1\x93\xc0\xc0\xc0"],  # a batch of three nils
        *[encode(m) for m in (None, 5, [], ["m"], ["m", -1, 0, 0, 0, 0], ("p", 0, 0, 0, 0, 0),
                              ("stop_request",), ("error", "forged"), ("done", {}), ("status", 0, True, 0, 0))],
        [b"", b"\x00" * 5000],  # a control frame too large
        [b"", msgpack.packb([3, -5, 2**40])],  # a credit grant into a ROUTER
    ]


def _digests(out: str) -> dict[str, str]:
    return json.loads(out)["digests"]


#: The environment of a run of a test app that uses no torch: its workers start as new interpreters, without a
#: fork server that would import torch first (seconds of CPU).
_NO_TORCH = {"REACTOR_FORK_SERVER": "0"}


def _gated_reference(tmp_path: Path) -> dict[str, str]:
    """The digests of the gated app run undisturbed under `processes` (its gate not held)."""
    ref = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(APPS / "gated.py"), "--placement",
                          "processes", "--digest", "--json"], cwd=ROOT, env={**_env(tmp_path / "ref"), **_NO_TORCH},
                         capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    return _digests(ref.stdout)


@contextlib.contextmanager
def _gated_run(tmp_path: Path, placement: str):
    """The gated app under ``placement`` (workers as new interpreters: ``_NO_TORCH``), held at its gate while
    the block attacks it: yields a namespace with ``ctx`` (a zmq context) and ``sockets`` (name -> ipc address
    in the run directory). On leaving the block the gate opens and the run ends: ``out``, ``err`` and
    ``returncode`` are set; the process is killed if it outlives the block by an error."""
    gate, ready = tmp_path / "open", tmp_path / "ready"
    proc = _run([str(APPS / "gated.py"), "--placement", placement, "--digest", "--json",
                 "--set", f"gate_file={str(gate)!r}", "--set", f"ready_file={str(ready)!r}"], tmp_path, _NO_TORCH)
    g = types.SimpleNamespace(ctx=zmq.Context(), sockets={}, out="", err="", returncode=None)
    try:
        _wait_for(ready.exists, 60, "the gate to start waiting")
        run_dir = _run_dir(tmp_path)
        g.sockets = {p.name: f"ipc://{p}" for p in run_dir.iterdir() if p.is_socket()}
        yield g
        time.sleep(0.3)
        gate.touch()
        g.out, g.err = proc.communicate(timeout=120)
        g.returncode = proc.returncode
    finally:
        gate.touch()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        g.ctx.destroy(linger=0)


def test_a_live_run_survives_hostile_frames_on_every_socket_and_fuzzed_messages_from_a_finished_peer(tmp_path):
    """The gated app under `processes`: while its gate holds the run, attackers hit every worker's
    and the coordinator's socket (garbage, non-protocol messages, frames past the size bound,
    identities taken from live peers), then a finished source's name is taken over and
    hypothesis-fuzzed messages of every kind are sent under it (the link-ownership, schema and
    promise checks are the only guard then). The run ends as an undisturbed run does: same
    digests of every reactor, exit 0; the refusals are counted."""
    expected = _gated_reference(tmp_path)
    with _gated_run(tmp_path, "processes") as g:
        ctx, sockets = g.ctx, g.sockets
        assert {"coordinator", "gate", "sink", "source-0", "source-1"} <= set(sockets)
        rng = random.Random(7)
        live_names = {"coordinator": "gate", "gate": "coordinator", "sink": "gate", "source-0": "coordinator",
                      "source-1": "coordinator"}
        for target, address in sockets.items():
            for name in ("intruder", live_names.get(target, "intruder")):
                s = _dealer(ctx, address, name)
                for frames in _garbage(rng):
                    s.send_multipart(frames)
                s.close(linger=2000)  # deliver them before closing
        big = _dealer(ctx, sockets["gate"], "big")  # past max_message_nbytes: zmq drops the connection
        big.send(b"\x00" * (64 * 2**20 + 1024))
        big.close(linger=2000)

        # Once source-1 is done it closes its link to the gate: its name is free there.
        def take_over():
            s = _dealer(ctx, sockets["gate"], "source-1")
            if _welcomed(s, 200):
                return s
            s.close()
            return None

        thief = _wait_for(take_over, 30, "source-1 to finish and free its name at the gate")
        forged = [("m", 0, 999, 5, 0, 1), ("m", 1, 999, 5, 0, 1), ("m", 2, 999, FOREVER_NS - 1, 0, 123),
                  ("p", 0, 0, -1, 0, 0), ("m", 9999, 0, 0, 0, 0)]
        for m in forged:
            thief.send_multipart(encode(m))

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(msgs=st.lists(protocol_messages(), min_size=1, max_size=3))
        def fuzz(msgs):
            for m in msgs:
                thief.send_multipart(encode(m))

        fuzz()
        thief.close(linger=2000)
    out, err = g.out, g.err
    assert g.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert result["digests"] == expected
    assert result["dropped"]["gate"] >= len(forged) + 300 // 2, result["dropped"]
    assert result["dropped"]["coordinator"] > 0 and result["dropped"]["sink"] > 0, result["dropped"]
    assert "refused a message from 'source-1'" in err or "refused a message from peer 'source-1'" in err
    assert not list(_rt(tmp_path).glob("reactor-*")), "the run directory was left behind"


def test_in_a_run_with_a_tcp_group_the_plain_ipc_sockets_welcome_a_keyless_stranger_and_drop_all_it_sends(tmp_path):
    """The gated app with the sink's group bound to tcp (so the run has CURVE keys): the groups bound to ipc
    stay plain (their directory is the boundary), so a same-user process without the keys reaches their
    sockets, and everything it sends is refused by the checks (that a tcp endpoint refuses a keyless
    peer: tests/transport/test_endpoint.py). The run ends with the digests of an undisturbed run, the ipc
    workers counted the garbage, and only the sink's endpoint encrypts."""
    placement = tmp_path / "mixed.toml"
    placement.write_text('[groups.source-0]\nreactors = ["source[[]0]"]\n\n[groups.source-1]\nreactors = ["source[[]1]"]\n\n'
                         '[groups.gate]\nreactors = ["gate"]\n\n'
                         '[groups.sink]\nreactors = ["sink"]\nbind = "tcp://127.0.0.1:*"\n')
    expected = _gated_reference(tmp_path)
    with _gated_run(tmp_path, str(placement)) as g:
        assert {"coordinator", "gate", "source-0", "source-1"} <= set(g.sockets) and "sink" not in g.sockets
        rng = random.Random(5)
        for address in (g.sockets["gate"], g.sockets["coordinator"]):
            s = _dealer(g.ctx, address, "intruder")
            assert _welcomed(s, 5000), "a plain ipc endpoint answers a keyless hello"
            for frames in _garbage(rng):
                s.send_multipart(frames)
            s.close(linger=2000)
    assert g.returncode == 0, g.err[-3000:]
    result = json.loads(g.out)
    assert result["digests"] == expected
    assert result["dropped"]["gate"] > 0 and result["dropped"]["coordinator"] > 0, result["dropped"]
    assert {grp: p["curve"] for grp, p in result["processes"].items()} == {
        "source-0": False, "source-1": False, "gate": False, "sink": True}, result["processes"]


def _children(pid: int) -> dict[str, int]:
    """The worker processes of a coordinator: group -> pid. Forked from the run's fork server (its
    child), a worker is named ``rx:GROUP``; started as a new interpreter, it is the coordinator's
    child with REACTOR_WORKER_GROUP in its environment."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"reactor.launch._forkserver" in cmd:
                for grandchild in Path(f"/proc/{child}/task/{child}/children").read_text().split():
                    try:
                        comm = Path(f"/proc/{grandchild}/comm").read_text().strip()
                    except OSError:
                        continue
                    if comm.startswith("rx:"):
                        out[comm[3:]] = int(grandchild)
                continue
            for item in env:
                if item.startswith(b"REACTOR_WORKER_GROUP="):
                    out[item.split(b"=", 1)[1].decode()] = int(child)
    return out


def _run_id(pid: int) -> str:
    for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if item.startswith(b"REACTOR_RUN_ID="):
            return item.split(b"=", 1)[1].decode()
    raise AssertionError("no REACTOR_RUN_ID in the worker's environment")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:][:1] not in (b"Z", b"X")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("app", "victim"), [
    ("dqn.py", "actor-1"),
    ("dqn.py", "learner"),
    ("transformer_dqn.py", "replay-0"),  # windows: the shards' rings in shared memory
])
def test_a_worker_killed_at_a_random_moment_ends_the_run_with_its_name_and_leaves_nothing_behind(tmp_path, app,
                                                                                              victim):
    """A training app under `actors`, async: SIGKILL one worker at a seeded random moment of its
    training. The run ends at once with an error that names the killed worker and the signal
    first; no worker process, shared-memory segment of the run (a killed shard cannot unlink its
    own) or run directory is left."""
    rng = random.Random(sum(map(ord, victim)))
    proc = _run([f"apps/{app}", "--placement", "actors", "--async", "--set", "live=False",
                 "--set", f"run_dir={str(tmp_path / 'run')!r}", "--set", "max_env_steps=10_000_000",
                 "--set", "target_return=1e9"], tmp_path)
    try:
        workers = _wait_for(lambda: (c := _children(proc.pid)) and len(c) == 5 and c, 240, "five workers")
        run_id = _run_id(workers[victim])
        _wait_for(lambda: (tmp_path / "run" / "metrics.csv").exists(), 240, "training to start")
        time.sleep(rng.uniform(0.2, 3.0))
        segments_before = [p.name for p in Path("/dev/shm").glob(f"rxb.{run_id}.*")]
        os.kill(workers[victim], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert f"worker {victim!r} was killed by SIGKILL before the run ended" in err, err[-3000:]
    assert "CURVE" not in err
    _wait_for(lambda: not any(_alive(p) for p in workers.values()), 20, "every worker to be gone")
    if victim.startswith("replay"):
        assert segments_before, "the shards of a windows app keep their rings in shared memory"
    assert not list(Path("/dev/shm").glob(f"rxb.{run_id}.*"))
    assert not list(_rt(tmp_path).glob("reactor-*"))
    if victim != "learner":  # (Metrics runs beside the learner) The survivors were told why the run ended
        why = json.loads((tmp_path / "run" / "summary.json").read_text())["stop_reason"]
        # (told in the 3 s the survivors get; a learner deep in an update past them is SIGTERMed)
        assert why.startswith(("the run failed", "this node's process was ended from outside")), why


@pytest.mark.timeout(300)
def test_the_run_directory_of_a_killed_coordinator_is_swept_by_the_next_run(tmp_path):
    """SIGKILL of the coordinator runs no cleanup: its workers die with it (PR_SET_PDEATHSIG) but
    its private ipc directory stays. The next multi-process run removes it (its owner is dead) and
    leaves a live run's directory alone."""
    ready = tmp_path / "ready"
    first = _run([str(APPS / "forever.py"), "--placement", "processes", "--set", f"ready_file={str(ready)!r}"],
                 tmp_path, _NO_TORCH)
    live = _run([str(APPS / "forever.py"), "--placement", "processes", "--set",
                 f"ready_file={str(tmp_path / 'ready2')!r}"], tmp_path, _NO_TORCH)
    try:
        _wait_for(lambda: ready.exists() and (tmp_path / "ready2").exists(), 60, "both runs to start")
        dirs = _wait_for(lambda: (d := sorted(_rt(tmp_path).glob("reactor-*"))) and len(d) == 2 and d, 30,
                         "two run directories")
        owner = {json.loads((d / "owner.json").read_text())["pid"]: d for d in dirs}
        os.kill(first.pid, signal.SIGKILL)
        first.communicate(timeout=30)
        stale = owner[first.pid]
        assert stale.exists()
        done = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(APPS / "gated.py"),
                               "--placement", "processes"], cwd=ROOT, env={**_env(tmp_path), **_NO_TORCH},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert not stale.exists()
        assert owner[live.pid].exists()  # a live run's directory is left alone
        assert f"removed the run directory {stale} of a dead coordinator" in done.stderr
    finally:
        for p in (first, live):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_dqn_run_under_actors_under_hostile_frames_on_every_socket_ends_with_the_undisturbed_weights(tmp_path):
    """The main job's shape (learner, 2 actor and 2 shard processes), deterministic with a step
    budget: while it trains, every worker's and the coordinator's socket gets garbage, forged
    control and data messages and takeover attempts. It ends with the same weights, bit for bit, as
    the same run undisturbed, and every process counted what it dropped. (The undisturbed run is the
    one-process placement: a deterministic run's weights do not depend on its placement, as
    tests/nodes/test_training.py asserts, and one process costs a fraction of five; it runs in this process,
    through the API: no interpreter of its own to import torch and tear it down.)"""
    from reactor import run
    from reactor.launch._app import build_graph

    config = {"live": False, "max_env_steps": 4000, "target_return": None}
    ref = {**config, "run_dir": str(tmp_path / "ref")}
    assert run(build_graph(ROOT / "apps" / "dqn.py", ref), seed=3, placement="single").stopped_by == "quiescence"
    args = ["apps/dqn.py", "--seed", "3", "--json", *(f"--set={k}={v!r}" for k, v in config.items()),
            "--placement", "actors"]
    proc = _run([*args, "--set", f"run_dir={str(tmp_path / 'hit')!r}"], tmp_path)
    ctx = zmq.Context()
    rng = random.Random(11)
    try:
        run_dir = _run_dir(tmp_path)
        names = {"coordinator", "learner", "actor-0", "actor-1", "replay-0", "replay-1"}
        sockets = _wait_for(lambda: (s := {p.name: f"ipc://{p}" for p in run_dir.iterdir() if p.name in names})
                            and len(s) == len(names) and s, 240, "every worker's socket")
        # Attack once it trains: every link is up then. A name taken before its owner connects keeps
        # the owner out (the same-user denial of service docs/architecture.md states), which is not
        # what this test is about; the attack landing first failed it once in about six runs.
        _wait_for(lambda: (tmp_path / "hit" / "metrics.csv").exists(), 240, "the run to start")
        for _ in range(3):
            for target, address in sockets.items():
                for name in ("intruder", "coordinator" if target != "coordinator" else "learner", "replay-0"):
                    s = _dealer(ctx, address, name)
                    with contextlib.suppress(zmq.Again):  # the run may be ending: its sockets go
                        for frames in [*_garbage(rng), encode(("m", 0, 0, 0, 0, None))]:
                            s.send_multipart(frames)
                    s.close(linger=2000)
            time.sleep(0.5)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ctx.destroy(linger=0)
    assert proc.returncode == 0, err[-3000:]
    dropped = json.loads(out)["dropped"]  # stdout holds the JSON only (the app's prints go to stderr)
    assert all(dropped[p] > 0 for p in names), dropped
    assert (tmp_path / "hit" / "weights.sha256").read_text() == (tmp_path / "ref" / "weights.sha256").read_text()


@pytest.mark.timeout(60)
def test_workers_that_do_not_hear_sigterm_are_killed_after_one_grace_for_them_all_not_one_each():
    """The reaping's SIGTERM, then SIGKILL ``TERM_GRACE_S`` later: it waited that long for each worker
    in turn, so three workers held in a shutdown reaction (which hears no SIGTERM) took 15 s to reap
    after a failure under `processes`, and a daemon's job stopped at once was killed mid-cleanup."""
    import asyncio

    from reactor.launch._localworkers import TERM_GRACE_S, _reap

    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    procs = {f"w{i}": subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for i in range(3)}
    try:
        for p in procs.values():
            assert p.stdout.readline().strip() == "up"
        t0 = time.monotonic()
        asyncio.run(_reap(procs, 0.0))
        took = time.monotonic() - t0
        assert [p.returncode for p in procs.values()] == [-signal.SIGKILL] * 3
        assert TERM_GRACE_S - 0.1 <= took < TERM_GRACE_S + 3.0, took
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
