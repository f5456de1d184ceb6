"""Restart policies (async runs): a group's process that dies is started again, its peers drop what
they send it meanwhile and link to its new life, shards restore from their checkpoints and count
what they lost, and a group out of restarts ends the run naming every end it had. Real processes,
real sockets, kill -9."""

from __future__ import annotations

import asyncio
import contextlib
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from reactor import GraphError, WorkerFailedError
from reactor.launch._app import build_graph
from reactor.launch._cluster import NoHostAnsweredError
from reactor.launch._daemon import DaemonClient
from reactor.launch._groups import Group, Restart, restart_from_text
from reactor.launch._keys import load_keys
from reactor.launch._placement import resolve_placement
from reactor.launch._restarts import _no_start, _Restarts
from reactor.launch._session import _Session
from reactor.nodes.messages import MassRequest
from reactor.nodes.replay import KEY_SHARD_BITS, ReplayClient
from reactor.nodes.writer import TransitionPattern, Writer
from reactor.replay import FieldSpec
from reactor.replay.checkpoint import latest_checkpoint
from reactor.transport._shm import list_segments

from ..faults.test_live_runs import _alive, _children, _run_id
from ..runtime_dirs import run_env as _env
from ..runtime_dirs import runtime_dir as _rt
from .hosts import Cluster, evaluations, wait_for

ROOT = Path(__file__).resolve().parents[2]
DQN = str(ROOT / "apps" / "dqn.py")
FOREVER = str(ROOT / "tests" / "apps" / "forever.py")


def _write(tmp_path: Path, text: str, name: str = "p.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# ------------------------------------------------------------------------------ the placement side


def test_restart_policies_come_from_group_fields_over_the_files_defaults_or_from_the_command_line(tmp_path):
    graph = build_graph(FOREVER, {})
    text = ('[restart]\nrestart = "on-failure"\nmax_restarts = 5\n'
            '[groups.sink]\nreactors = ["sink"]\nbackoff_s = 0.25\n'
            '[groups.tickers]\nreactors = ["ticker*"]\nrestart = "never"\nhost_wait_s = 20\n')
    groups = {g.name: g.restart for g in resolve_placement(graph, _write(tmp_path, text)).groups}
    assert groups == {"sink": Restart("on-failure", 5, 0.25, 300.0), "tickers": Restart("never", 5, 1.0, 20.0)}
    # A distribution policy takes its defaults from the hosts file; --restart replaces them all.
    hosts = _write(tmp_path, '[hosts]\na = "tcp://10.0.0.1:7000"\n[restart]\nrestart = "on-failure"\n', "hosts.toml")
    dqn = build_graph(DQN, {"actors": 2, "shards": 2})
    assert {g.restart for g in resolve_placement(dqn, "actors", hosts).groups} == {Restart("on-failure")}
    assert {g.restart for g in resolve_placement(dqn, "actors", hosts, Restart("never")).groups} == {Restart()}
    assert {g.restart for g in resolve_placement(dqn, "processes").groups} == {Restart()}
    assert restart_from_text("on-failure:7") == Restart("on-failure", 7)
    assert restart_from_text("on-failure:2,host_wait_s=60,backoff_s=0.5") == Restart("on-failure", 2, 0.5, 60.0)
    assert restart_from_text("on-failure,host_wait_s=0") == Restart("on-failure", 3, 1.0, 0.0)
    assert restart_from_text("on-failure,reset_after_s=inf") == Restart("on-failure", reset_after_s=math.inf)
    text = '[restart]\nrestart = "on-failure"\nreset_after_s = inf\n[groups.all]\nreactors = ["*"]\n'
    assert {g.restart for g in resolve_placement(graph, _write(tmp_path, text)).groups} == {
        Restart("on-failure", reset_after_s=math.inf)}
    assert Restart("on-failure", 3, 0.5).delay_s(2) == 2.0 and Restart("on-failure", 9, 10.0).delay_s(5) == 30.0
    # Asking lost hosts again: the backoff doubled per try, within [0.5, 10] s.
    assert [Restart("on-failure", 3, 1.0).host_retry_s(k) for k in range(5)] == [1.0, 2.0, 4.0, 8.0, 10.0]
    assert Restart("on-failure", 3, 0.0).host_retry_s(0) == 0.5


@pytest.mark.parametrize(("text", "message"), [
    ('[groups.all]\nreactors = ["*"]\nrestart = "always"\n',
     "group 'all': restart must be \"never\" or \"on-failure\", got 'always'"),
    ('[groups.all]\nreactors = ["*"]\nmax_restarts = -1\n', "group 'all': max_restarts must be an integer in [0, 1000]"),
    ('[groups.all]\nreactors = ["*"]\nbackoff_s = "1s"\n', "group 'all': backoff_s must be a number of seconds"),
    ('[groups.all]\nreactors = ["*"]\nhost_wait_s = -5\n', "group 'all': host_wait_s must be a number of seconds "
     "in [0, 86400], got -5"),
    ('[restart]\nretries = 3\n[groups.all]\nreactors = ["*"]\n',
     "[restart] takes restart, max_restarts, backoff_s, host_wait_s, reset_after_s only"),
    ('[groups.all]\nreactors = ["*"]\nreset_after_s = 0\n', "group 'all': reset_after_s must be a number of seconds "
     ">= 1 (or inf), got 0"),
    ('[restart]\nmax_restarts = 1.5\n[groups.all]\nreactors = ["*"]\n', "[restart]: max_restarts must be an integer"),
])
def test_a_bad_restart_policy_is_refused_naming_the_field_and_the_value(tmp_path, text, message):
    with pytest.raises(GraphError, match=re.escape(message)):
        resolve_placement(build_graph(FOREVER, {}), _write(tmp_path, text))


@pytest.mark.parametrize("text", ["always", "on-failure:x", "never:2", "on-failure:-1", "", "never,host_wait_s=5",
                                  "on-failure:2,retries=3", "on-failure,host_wait_s", "on-failure,backoff_s=1,backoff_s=2",
                                  "on-failure:2,", "on-failure:", "on-failure:,backoff_s=1", "on-failure:\u00b2"])
def test_a_bad_restart_option_is_refused(text):
    with pytest.raises(GraphError, match=r"use never, on-failure or on-failure:N \(N: the most restarts per group\), "
                                         r"then ,backoff_s=S ,host_wait_s=S ,reset_after_s=S if you want them"):
        restart_from_text(text)


@pytest.mark.parametrize(("text", "message"), [
    ("on-failure:2,host_wait_s=5m", "restart 'on-failure:2,host_wait_s=5m': host_wait_s must be a number of seconds, "
                                    "got '5m'"),
    ("on-failure,host_wait_s=-1", "restart 'on-failure,host_wait_s=-1': host_wait_s must be a number of seconds in "
                                  "[0, 86400], got -1.0"),
    ("on-failure,backoff_s=nan", "restart 'on-failure,backoff_s=nan': backoff_s must be a number of seconds in "
                                 "[0, 3600], got nan"),
    ("on-failure,reset_after_s=0.5", "restart 'on-failure,reset_after_s=0.5': reset_after_s must be a number of "
                                     "seconds >= 1 (or inf), got 0.5"),
])
def test_a_restart_options_bad_value_is_refused_naming_the_field(text, message):
    with pytest.raises(GraphError, match=re.escape(message)):
        restart_from_text(text)


# ------------------------------------------------------------------------------ the nodes' side


def _steps(n_envs: int) -> dict[str, np.ndarray]:
    return {"obs": np.zeros((n_envs, 2), np.float32), "action": np.zeros(n_envs, np.int64),
            "reward": np.zeros(n_envs, np.float32)}


def test_a_writer_sends_nothing_to_a_shard_that_is_down_and_counts_what_it_lost():
    fields = [FieldSpec("obs", (2,), torch.float32), FieldSpec("action", (), torch.int64),
              FieldSpec("reward", (), torch.float32), FieldSpec("terminated", (), torch.bool)]
    w = Writer(fields, 1, TransitionPattern(), num_shards=3, max_unacked=2, flush_steps=1)
    ended = np.ones(1, dtype=bool)

    def flush_one() -> int:
        (m,) = w.append(_steps(1), terminated=ended, truncated=~ended, final={"obs": np.zeros((1, 2), np.float32)})
        return m.shard

    assert [flush_one() for _ in range(3)] == [0, 1, 2]
    w.shard_lost(1)
    assert w.lost_messages == 1 and int(w.unacked[1]) == 0
    assert [flush_one() for _ in range(3)] == [0, 2, 0]  # never shard 1, least loaded first
    assert w.full()  # the live shards hold max_unacked: the down one does not count as room
    w.acknowledged(2)
    assert not w.full() and flush_one() == 2
    w.shard_lost(0)
    w.shard_lost(2)
    assert w.full()  # every shard down: the actor holds
    w.shard_restarted(1)
    assert not w.full() and flush_one() == 1


def test_a_replay_client_samples_from_the_live_shards_and_takes_a_restarted_one_back():
    c = ReplayClient(3, rng=np.random.default_rng(0))
    first = c.request(8)
    assert [(type(m), m.shard) for m in first] == [(MassRequest, 0), (MassRequest, 1), (MassRequest, 2)]
    assert c.shard_lost(1, "killed") == [] and c.in_flight == 1  # the sample waits on shards 0 and 2 only
    assert sorted(m.shard for m in c.request(8)) == [0, 2]
    keys = np.array([1 << KEY_SHARD_BITS, 2 << KEY_SHARD_BITS | 5], dtype=np.int64)
    assert [u.shard for u in c.update_priorities(keys, np.ones(2))] == [2]  # none for the shard that is down
    c.shard_lost(0, "killed")
    c.shard_lost(2, "killed")
    assert c.live_shards == [] and c.in_flight == 0  # nothing can answer: the owner asks again later
    c.shard_restarted(2)
    assert c.live_shards == [2] and [m.shard for m in c.request(8)] == [2]
    with pytest.raises(ValueError, match=r"shard_lost: shard must be in \[0, 3\), got 3"):
        c.shard_lost(3, "x")


def test_a_restarted_on_policy_learner_drops_a_rollout_of_its_last_lifes_weights_instead_of_refusing_it(caplog):
    """A restarted on-policy learner resumes from its checkpoint, older than the weights its last life sent:
    an actor that finished a rollout with those before it heard of the restart sent it to the new life,
    whose "collected with weights 7, expected 5" ValueError, reactor's own, ended the run as a refusal
    (refusals are not restarted). Such a rollout is dropped, said. A learner that never restarted fails on
    one from weights it never sent: reactor's own inconsistency (``ReactorInternalError``, its traceback), not,
    as the ValueError was, a refusal's one line blaming what the run was given (the audit of the ValueErrors
    raised at run time in reactor/nodes)."""
    import logging

    from reactor._errors import ReactorInternalError, refusal_class
    from reactor.nodes.learner import RolloutLearner
    from reactor.nodes.train_messages import Rollout

    learner = RolloutLearner("ppo", "CartPole-v1")
    learner.name, learner.updates = "learner", 5
    rollout = Rollout(0, 7, {"reward": torch.zeros(4, 1)})
    with pytest.raises(ReactorInternalError, match=r"^learner: rollout from actor 0 was collected with weights 7, "
                                                   r"which this learner \(at update 5, restart 0\) never sent ") as e:
        learner.learn(rollout)
    assert refusal_class(e.value) is None
    learner.restarts = 1
    with caplog.at_level(logging.WARNING, logger="reactor.learner"):
        learner.learn(rollout)
    assert learner.pending == {} and [r.getMessage() for r in caplog.records] == [
        "learner: dropped a rollout of actor 0 collected with weights 7 of this learner's last life (it resumed at 5)"]


# ------------------------------------------------------------------------------ the coordinator's side


class _Endpoint:
    """What the coordinator sends, recorded (these decisions need no worker)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def send_nowait(self, peer: str, msg: Any) -> None:
        self.sent.append((peer, msg))

    def disconnect(self, peer: str, linger_s: float = 0) -> None:
        self.sent.append((peer, "disconnected"))


@pytest.mark.parametrize("full", [False, True])
def test_a_restarts_start_runs_beside_the_runs_messages_and_tries_that_find_no_host_use_no_restart(full):
    """A start whose host does not answer (its ping waits out a timeout) runs in a task of its own:
    the coordinator's loop goes on meanwhile, and the group counts as down. A try that found no host
    asks again after the retry wait, its restart count unchanged; past host_wait_s the run ends,
    naming the wait and the hosts. ``full``: every host answered but refused it for want of memory
    (``DaemonFullError``, session 67): waited for the same way (other runs' workers may end), where
    it used a restart at each try."""
    from reactor.launch._daemonclient import DaemonFullError

    why = ("group 'b': no candidate host has the memory to start it: h2: host 'h2' refused 'spawn': ..." if full
           else "group 'b': no candidate host answered: h2: host 'h2' did not answer 'ping'")

    async def main() -> None:
        gate = asyncio.Event()
        tries: list[int] = []

        async def start(group: Group, spec: dict) -> None:
            tries.append(spec["restarts"])
            await gate.wait()  # a ping to a host that does not answer
            gate.clear()
            raise (DaemonFullError if full else NoHostAnsweredError)(why)

        groups = {"a": Group("a", ("a",)),
                  "b": Group("b", ("b",), hosts=("h2",), restart=Restart("on-failure", 1, 0.0, 30.0))}
        r = _Restarts(groups, ["b"], {"a": {}, "b": {}}, start, None)
        s = _Session(_Endpoint(), None, ["a", "b"], asyncio.Event(), r)  # type: ignore[arg-type]
        s._begin_restart("b", (-9, ""), announce=False)  # backoff 0: due now
        s._advance_restarts()
        assert set(r.trying) == {"b"} and r.down == {"b"} and r.pending == {"b"}
        await asyncio.sleep(0.05)
        s._advance_restarts()  # the try still waits; the loop was not held
        assert set(r.trying) == {"b"} and tries == [1]
        gate.set()
        await asyncio.sleep(0.01)
        s._advance_restarts()  # no host: due again after the retry wait, no restart used
        assert not r.trying and r.count == {"b": 1} and r.host_wait["b"][1] == 1
        assert r.due["b"] - asyncio.get_running_loop().time() == pytest.approx(0.5, abs=0.05)
        assert r.can_restart("b") is False  # (max_restarts = 1, used by the death itself)
        r.due["b"] = 0.0
        s._advance_restarts()
        r.host_wait["b"] = (asyncio.get_running_loop().time() - 31.0, 4)  # waited past host_wait_s
        gate.set()
        await asyncio.sleep(0.01)
        with pytest.raises(WorkerFailedError, match=re.escape(
                f"worker 'b' could not be started again: no candidate host {'could start it' if full else 'answered'} "
                f"within host_wait_s = 30 s (5 tries): {why}")):
            s._advance_restarts()
        assert tries == [1, 1]

    asyncio.run(main())


def test_a_workers_exit_status_is_said_in_the_same_words_by_its_coordinator_and_by_reactor_status():
    """The words for a worker's exit status were written twice: the coordinator's (its errors, its log,
    a restarted group's ends) and ``reactor status``'s, and they had drifted (status 143 was "ended by
    SIGTERM" in one and a bare number in the other; 3 named the worker's stderr in one, its log in the
    other). One table says them now (``_protocol``)."""
    from reactor.cli._jobs import _exit_words
    from reactor.launch._protocol import how_worker_ended

    for rc, words in ((1, "failed: its traceback is in its output"),
                      (2, "refused the run: its line is in its output"), (3, "lost a peer: its output names which"),
                      (4, "stopped because the run failed"), (143, "ended by SIGTERM")):
        assert how_worker_ended(rc) == f"exited with status {rc} ({words})"
        assert _exit_words(rc) == f"{rc} ({words})"
    assert how_worker_ended(7, "on host 'h3'") == "exited with status 7 on host 'h3'" and _exit_words(7) == "7"
    assert how_worker_ended(-9) == "was killed by SIGKILL"
    assert how_worker_ended(None, "was lost with host 'h3'") == "was lost with host 'h3'"


def test_a_worker_that_ended_with_a_refusals_exit_status_is_not_started_again():
    """A refusal ends the run at once under a restart policy (the "refused" message: the next test); a
    worker that ended with a refusal's exit status whose message did not reach the coordinator is not
    started again either (systemd's RestartPreventExitStatus), and the error says why."""

    class _Dead:
        def __init__(self, dead: dict) -> None:
            self.now = dead

        def dead(self) -> dict:
            return self.now

    async def main() -> None:
        groups = {g: Group(g, (g,), restart=Restart("on-failure", 3, 0.0)) for g in ("a", "b")}
        r = _Restarts(groups, ["a", "b"], {"a": {}, "b": {}}, _no_start, None)
        s = _Session(_Endpoint(), _Dead({"a": (1, "")}), ["a", "b"], asyncio.Event(), r)  # type: ignore[arg-type]
        s._check_children()  # a failure's status: started again
        assert set(r.due) == {"a"}
        s.workers = _Dead({"b": (2, "")})  # type: ignore[assignment]
        with pytest.raises(WorkerFailedError, match=re.escape(
                "worker 'b' exited with status 2 (refused the run: its line is in its output) before the run ended; group 'b' was "
                "not restarted: exit status 2 is a refusal of what the run was given, which a new life is given again")):
            s._check_children()
        assert "b" not in r.due

    asyncio.run(main())


# ------------------------------------------------------------------------------ real runs


def _checkpointed_steps(shard_dir: Path) -> bool:
    """Whether the shard's newest complete checkpoint (the one a restart restores) holds any step."""
    ckpt = latest_checkpoint(shard_dir)
    try:
        return ckpt is not None and len(np.load(ckpt / "table.keys.npy")) > 0
    except (OSError, ValueError):  # (pruned meanwhile: a newer one is complete)
        return False


def _pid_changed(coordinator: int, group: str, old: int, timeout_s: float, errfile: Path | None = None) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = _children(coordinator).get(group)
        if pid is not None and pid != old and _alive(pid):
            return pid
        time.sleep(0.05)
    raise AssertionError(f"{group} was not started again within {timeout_s} s"
                         + (f": {errfile.read_text()[-3000:]}" if errfile is not None else ""))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_async_dqn_run_survives_kill_9_of_an_actor_a_shard_and_the_learner_and_reaches_475(tmp_path):
    """DQN under `actors`, async, restart on-failure: SIGKILL actor-1, then replay-0, then the
    learner (each at a seeded moment after the one before is back). Each is started again (the shard
    from its checkpoint, counting the steps its last life had inserted past it; the learner from
    its checkpoint), sampling goes on from the live shards meanwhile, and after the last kill the run
    still learns to an evaluation of 475; Ctrl-C then stops it, and nothing of it is left afterwards.
    (No target return: the run cannot end before the kills are done, however fast the machine.)"""
    rng = np.random.default_rng(16)
    run = tmp_path / "run"
    errfile = tmp_path / "stderr.log"
    # (A shard checkpoint a second: the kill of replay-0 waits for one of steps. Every 0.05 s, the saves
    # took about half of the shards' CPU for the whole run.)
    with open(errfile, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reactor.cli", "run", DQN, "--placement", "actors", "--async", "--json",
             "--restart", "on-failure:2", "--set", "live=False", "--set", f"run_dir={str(run)!r}",
             "--set", "replay_async_checkpoint_period_s=1.0", "--set", "checkpoint_every=100",
             "--set", "max_env_steps=400_000", "--set", "target_return=None"],
            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.csv").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = _children(proc.pid)
        assert len(workers) == 5, workers
        run_id = _run_id(workers["actor-0"])
        for victim in ("actor-1", "replay-0", "learner"):
            time.sleep(float(rng.uniform(0.3, 1.0)))
            if victim == "replay-0":  # (restored from a checkpoint, asserted below: on a loaded machine, with two
                # heavy tests at once, the kill once came before the shard's first checkpoint of any step)
                wait_for(lambda: _checkpointed_steps(run / "replay-0"), 120, "replay-0's first checkpoint of steps")
            if victim == "learner":  # (resumed from its checkpoint, asserted below: killed before its first one, it
                # learned again from fresh weights, which the test took)
                wait_for((run / "learner.pt").exists, 120, "the learner's first checkpoint")
            kids = _children(proc.pid)
            assert victim in kids, f"{victim} was not running when its kill came: {errfile.read_text()[-3000:]}"
            old = kids[victim]
            os.kill(old, signal.SIGKILL)
            _pid_changed(proc.pid, victim, old, 120, errfile)
        wait_for(lambda: "worker 'learner' is running again (restart 1)" in errfile.read_text(), 120,
                 "the learner to run again")
        after_kills = len(evaluations(run / "metrics.csv"))  # (every life's rows: a restarted Metrics appends)
        try:
            wait_for(lambda: proc.poll() is None and max(evaluations(run / "metrics.csv")[after_kills:],
                                                         default=0.0) >= 475.0, 600, "an evaluation of 475 after the kills")
        except AssertionError as e:
            raise AssertionError(f"{e}; the evaluations so far: {evaluations(run / 'metrics.csv')}; "
                                 f"{errfile.read_text()[-3000:]}") from None
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the run stops cleanly
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        elif proc.stdout is not None and not proc.stdout.closed:  # (ended early: an unclosed pipe would fail
            proc.stdout.close()  # a later test of this worker as an unraisable ResourceWarning)
    err = errfile.read_text()
    assert proc.returncode == 130, err[-4000:]  # a clean stop at Ctrl-C
    result = json.loads(out)  # stdout holds the JSON only
    assert result["stopped_by"] == "signal", result
    assert result["restarts"] == {v: ["was killed by SIGKILL"] for v in ("actor-1", "replay-0", "learner")}
    lost = re.search(r"replay\[0\] restarted \(restart 1\): restored (\d+) of the (\d+) steps its last life had "
                     r"inserted: (\d+) lost", err)
    assert lost is not None, err[-4000:]
    restored, before, n_lost = map(int, lost.groups())
    assert restored > 0 and before > 0 and n_lost == before - restored  # from a checkpoint, not from scratch
    assert "worker 'learner' is running again (restart 1)" in err
    (resumed,) = re.findall(r"learner resumed from its checkpoint \S+ at update (\d+)", err)  # not from scratch
    assert int(resumed) >= 100, err[-4000:]
    # metrics.csv kept the learner group's first life: its first evaluation, of the untrained weights, and the
    # wall clock going on through the restart (a restarted Metrics used to start the file anew).
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert next(float(r["value"]) for r in rows if r["source"] == "evaluator" and r["name"] == "version") == 0.0
    assert [float(r["wall_s"]) for r in rows] == sorted(float(r["wall_s"]) for r in rows)
    # The run's env steps never went back: not when actor-1 started again from 0, nor when Metrics (in the
    # learner's process) did; they used to drop by actor-1's steps, and to each live source's counter.
    steps = [int(r["env_steps"]) for r in rows]
    assert steps == sorted(steps) and steps[-1] > 0, [s for s, t in zip(steps, steps[1:]) if t < s][:5]
    assert not [p for p in workers.values() if _alive(p)]
    assert not list_segments(run_id)
    assert not list(_rt(tmp_path).glob("reactor-*"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("app", "budget"), [("dqn.py", 4_000), ("ppo.py", 8_192)])
def test_a_restarted_actor_goes_on_to_the_runs_budget_and_not_past_it(tmp_path, app, budget):
    """From a newcomer's pass: SIGKILL of actor-0, restart on-failure. A restarted DQN actor took its
    whole share of max_env_steps again (37,000 env steps in a run of 30,000); a restarted PPO actor
    waited for weights the learner sent only after an update that waited for its rollout, and the run
    went quiet at a fraction of its budget and ended with exit 0."""
    run = tmp_path / "run"
    errfile = tmp_path / "stderr.log"
    with open(errfile, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reactor.cli", "run", str(ROOT / "apps" / app), "--placement", "actors", "--async",
             "--json", "--restart", "on-failure:1", "--set", "live=False", "--set", f"run_dir={str(run)!r}",
             "--set", f"max_env_steps={budget}", "--set", "target_return=None"],
            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        def progress() -> int:  # actor-0's steps, from its progress file (written at each report)
            with contextlib.suppress(OSError, ValueError):
                return int(json.loads((run / "actor-0.progress.json").read_text())["explore_steps"])
            return 0

        # A quarter of its share in or more (its reports come every 1,000 env steps under PPO): a kill at its
        # start would hide an actor that takes its share again.
        wait_for(lambda: progress() >= budget // 8 or proc.poll() is not None, 300, "actor-0 a quarter in")
        kids = _children(proc.pid)
        assert "actor-0" in kids, f"the run ended before the kill: {errfile.read_text()[-3000:]}"
        os.kill(kids["actor-0"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
    finally:
        err = _reaped(proc, errfile)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert result["restarts"] == {"actor-0": ["was killed by SIGKILL"]}, result
    summary = result["summary"]
    # The actors took the run's budget, and no more (an actor's share, in whole vector steps).
    assert budget <= summary["env_steps"] <= budget + 64, (summary, err[-2000:])
    assert summary["stop_reason"].startswith("the actors' env-step budget reached"), summary
    assert not re.search(r"went quiet with -\d+ messages", err), err[-2000:]  # (a count below zero was shown)
    if app == "ppo.py":  # every update ran: the rollout a restarted actor collects again is not counted twice
        from reactor.launch._app import load_app, make_config  # noqa: PLC0415

        c = make_config(load_app(ROOT / "apps" / app), {})
        assert summary["updates"] == budget // (c.actors * c.envs_per_actor * c.algo_config["rollout_length"]), summary


def _submit_job(c: Cluster, tmp_path: Path, app: str, policy_and_groups: str, *sets: str) -> str:
    """Submit ``app`` as an async job to h1's daemon over the cluster's hosts, with the placement
    ``[restart]`` on-failure, then ``policy_and_groups`` (more policy fields and the groups); its id."""
    placement = tmp_path / "p.toml"
    placement.write_text(c.hosts_toml() + '[restart]\nrestart = "on-failure"\n' + policy_and_groups)
    out = subprocess.run([sys.executable, "-m", "reactor.cli", "submit", app, "--placement", str(placement), "--async",
                          "--daemon", c.addresses["h1"], *(a for s in sets for a in ("--set", s))],
                         env=c.env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _forever(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    errfile = tmp_path / "stderr.log"
    ready = tmp_path / "ready"
    with open(errfile, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "reactor.cli", "run", FOREVER, "--placement", "processes",
                                 "--set", f"ready_file={str(ready)!r}", *args], cwd=ROOT, env=_env(tmp_path),
                                stdout=subprocess.DEVNULL, stderr=err, text=True)
    return proc, errfile


def _reaped(proc: subprocess.Popen[str], errfile: Path) -> str:
    """The run's stderr, once it has ended (killed if it had not)."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()
    return errfile.read_text()


def _workers(proc: subprocess.Popen[str], ready: Path, n: int = 3) -> dict[str, int]:
    """The workers once the run has started (the sink's startup touched ``ready``)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        c = _children(proc.pid)
        if len(c) == n and ready.exists():
            return c
        time.sleep(0.05)
    raise AssertionError(f"{n} workers did not start")


@pytest.mark.timeout(300)
def test_a_group_out_of_restarts_in_a_row_ends_the_run_naming_it_and_a_healthy_life_starts_the_count_again(tmp_path):
    """max_restarts counts restarts in a row: a life that ran reset_after_s starts the count again (a run
    of days survived no more than max_restarts failures over its whole length before), a short one not."""
    proc, errfile = _forever(tmp_path, "--async", "--restart", "on-failure:1,reset_after_s=4")
    ready = tmp_path / "ready"

    def next_life(pid: int) -> int:
        new = _pid_changed(proc.pid, "sink", pid, 60, errfile)
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:  # its new life started
            time.sleep(0.05)
        assert proc.poll() is None and all(_alive(first[t]) for t in ("ticker-0", "ticker-1"))  # the run went on
        ready.unlink()
        return new

    try:
        first = _workers(proc, ready)
        # Gone before the kill: the new life may touch it again before _pid_changed sees its pid (when
        # this was removed after, the test waited out the 60 s below now and then).
        ready.unlink()
        os.kill(first["sink"], signal.SIGKILL)
        second = next_life(first["sink"])
        time.sleep(5)  # a healthy life: past reset_after_s
        os.kill(second, signal.SIGKILL)
        third = next_life(second)
        os.kill(third, signal.SIGKILL)  # a short life: its restart would be the second in a row
        proc.communicate(timeout=60)
    finally:
        err = _reaped(proc, errfile)
    assert proc.returncode != 0
    assert "worker 'sink' ran " in err and "(reset_after_s = 4 s) before it ended: its count of restarts in a row starts again" in err
    assert ("reactor: WorkerFailedError: worker 'sink' was killed by SIGKILL before the run ended; group 'sink' had used its 1 "
            "restarts in a row (max_restarts = 1, each after a life shorter than reset_after_s = 4 s): earlier ends: "
            "was killed by SIGKILL; was killed by SIGKILL") in err, err[-3000:]
    assert "worker 'sink' is running again (restart 1)" in err and "worker 'sink' is running again (restart 2)" in err
    assert not any(_alive(p) for p in (*first.values(), second, third))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recording", [False, True], ids=["deterministic", "recording"])
def test_a_placement_files_restart_in_a_deterministic_run_is_said_at_the_start_and_left_aside(tmp_path, recording):
    """Regression (a newcomer's pass, session 54): a placement file's ``restart = "on-failure"`` was left
    aside in a deterministic run without a word until a process died, while ``--restart on-failure`` is
    refused there (the next test). The file's form is left aside (the same file may serve async runs),
    and said when the run starts; a failure then ends the run and says why no restart came. So in an
    async run that records a trace (a restarted worker's first life's events died with it, and the
    trace failed its replay as "damaged")."""
    placement = tmp_path / "placement.toml"
    placement.write_text('[restart]\nrestart = "on-failure"\n[groups.ticker-0]\nreactors = ["ticker[0]"]\n'
                         '[groups.ticker-1]\nreactors = ["ticker[1]"]\n[groups.sink]\nreactors = ["sink"]\n')
    said = (f"placement file {placement}: [restart] sets restart = \"on-failure\", which this "
            f"{'recording' if recording else 'deterministic run'} leaves aside: restart policies hold in async runs "
            f"(--async) that record or replay no trace, so a process that dies ends this run (--restart never says so "
            f"and silences this)")
    mode = ["--async", "--record", str(tmp_path / "t.trace")] if recording else []
    proc, errfile = _forever(tmp_path, "--placement", str(placement), *mode)
    try:
        workers = _workers(proc, tmp_path / "ready")
        assert said in Path(errfile).read_text()  # (said at the start, before anything failed)
        os.kill(workers["ticker-1"], signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        err = _reaped(proc, errfile)
    assert proc.returncode != 0
    assert "worker 'ticker-1' was killed by SIGKILL before the run ended" in err, err[-3000:]
    assert "running again" not in err
    assert "group 'ticker-1' was not restarted: restart policies hold in async runs that record or replay no trace" in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [(), ("--async", "--replay", "x.trace"), ("--async", "--record", "x.trace")],
                         ids=["deterministic", "replay", "record"])
def test_restart_in_a_run_that_cannot_restart_is_refused_before_anything_starts(mode, tmp_path):
    """Regression (a newcomer's pass, session 52): ``--restart`` without ``--async`` was taken and did
    nothing until a process died. And (a newcomer's pass at traces): ``--record`` with ``--restart
    on-failure`` was taken, a worker killed with kill -9 started again, and the trace held its second
    life's events alone: its replay failed in that worker with a traceback, "the trace is damaged"."""
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", FOREVER, "--placement", "processes", *mode,
                        "--restart", "on-failure"], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                       timeout=100)
    what = {(): "deterministic run", "--replay": "replay", "--record": "recording"}[mode[1] if mode else ()]
    why = " (the first life's events die with it: the trace would not replay)" if what == "recording" else ""
    assert p.returncode == 2 and p.stderr == (
        f"reactor: restart 'on-failure': restart policies hold in async runs (--async) that record or replay no trace: "
        f"a {what}'s schedule cannot take a process that starts over{why}\n"), p.stderr
    assert not (tmp_path / "x.trace").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_dqn_job_over_three_hosts_survives_kill_9_of_an_actor_a_shard_the_learner_and_a_daemon_and_reaches_475(
        tmp_path, monkeypatch):
    """DQN submitted (async, restart on-failure) with the learner and replay-0 on h1, actor-0 and
    replay-1 on h2, actor-1 on h3 with h2 as its second candidate. kill -9 of actor-0, of replay-1
    (started again on h2, the shard from its checkpoint) and of the learner (on h1, resumed from its
    checkpoint), then SIGKILL of h3's daemon (its
    worker dies with it; the host is lost and actor-1 starts on h2). After the last of them the job
    still learns to an evaluation of 475; stopped then, its status shows where every group ended up, its
    files come back to the head host's job directory, and nothing is left on any host.

    With ``replay_remote_reads=zmq`` the learner samples replay-1 (another host) one-sidedly through its
    read server, drawn ahead of its updates: replay-1's death ends the draws out to it (the learner
    logs it and samples through messages until the shard is back), and the learner's last life draws
    nearly every batch one-sidedly, most during the update before.

    The job has no target return: it cannot stop before the kills are done, however fast the machine,
    and it evaluates at the app's default period (250 updates). (With a target and evaluations held back
    to every 4,000 updates so that the kills came first, the job ran 8,000-12,000 updates: 130-220 s.)"""
    c = Cluster(tmp_path, heartbeat_timeout_s=2.0)
    monkeypatch.setenv("REACTOR_KEYS", str(c.keys))
    try:
        job = _submit_job(c, tmp_path, DQN, 'backoff_s = 0.5\n'
                          '[groups.learner]\nreactors = ["learner", "evaluator", "metrics"]\nhost = "h1"\n'
                          '[groups.replay-0]\nreactors = ["replay[[]0]"]\nhost = "h1"\n'
                          '[groups.replay-1]\nreactors = ["replay[[]1]"]\nhost = "h2"\n'
                          '[groups.actor-0]\nreactors = ["actor[[]0]"]\nhost = "h2"\n'
                          '[groups.actor-1]\nreactors = ["actor[[]1]"]\nhost = ["h3", "h2"]\n',
                          "live=False", "replay_async_checkpoint_period_s=1.0", "checkpoint_every=100",
                          "target_return=None", "replay_remote_reads=zmq")
        cli = [sys.executable, "-m", "reactor.cli"]
        keys = load_keys(c.keys)
        with DaemonClient(c.addresses["h1"], keys.public, keys) as d:
            def state() -> dict:
                st = d.request("status", job)
                if st["state"] != "running":  # (pytest.fail: an assert's message would be cut short)
                    log = d.request("logs", job, 0)["data"][-6000:].decode(errors="replace")
                    pytest.fail(f"the job is {st['state']} before the test's kills are done: {st}\nits log:\n{log}")
                return st

            def running_again(group: str) -> bool:
                return state() is not None and f"worker {group!r} is running again (restart 1)" in \
                    d.request("logs", job, 0)["data"].decode(errors="replace")

            metrics = wait_for(lambda: state() and list(tmp_path.glob("h1/runs/*/runs/*/metrics.csv")), 240, "training")
            pids = c.worker_pids()
            for victim in ("actor-0", "replay-1", "learner"):
                if victim == "learner":  # (its first life may spend its start compiling: it resumes from a checkpoint)
                    wait_for(lambda: state() and list(tmp_path.glob("h1/runs/*/runs/*/learner.pt")), 240,
                             "the learner's first checkpoint")
                if victim == "replay-1":  # (a shard checkpoint a second, not every 0.05 s, which took about half of
                    # the shards' CPU: it restores from one)
                    wait_for(lambda: state() and any(map(_checkpointed_steps, tmp_path.glob("h2/runs/*/runs/*/replay-1"))),
                             120, "replay-1's first checkpoint of steps")
                (pid,) = [p for p, g in pids.items() if g == victim]
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda victim=victim: running_again(victim), 120, f"{victim} to run again")
            c.stop_daemon("h3", signal.SIGKILL)
            wait_for(lambda: running_again("actor-1"), 120, "actor-1 to run again")
            assert list(c.worker_pids("h2").values()).count("actor-1") == 1
            # (the learner group's lives share this metrics.csv: a restarted Metrics appends)
            (csv_path,) = metrics
            after_kills = len(evaluations(csv_path))
            try:
                wait_for(lambda: state() and max(evaluations(csv_path)[after_kills:], default=0.0) >= 475.0, 600,
                         "an evaluation of 475 after the kills")
            except AssertionError as e:
                raise AssertionError(f"{e}; the evaluations so far: {evaluations(csv_path)}") from None
            d.request("stop", job)
            wait_for(lambda: d.request("status", job)["state"] != "running", 120, "the job to stop")
            final = d.request("status", job)
            text = d.request("logs", job, 0)["data"].decode(errors="replace")
        assert final["state"] == "stopped" and "run ended (signal)" in final["last_line"], (final, text[-4000:])
        learner = subprocess.run([*cli, "logs", job, "learner", "--daemon", c.addresses["h1"]], env=c.env(),
                                 capture_output=True, text=True, timeout=60)  # the metrics' group, on h1
        for group in ("actor-0", "replay-1", "learner", "actor-1"):
            assert f"worker {group!r} is running again (restart 1)" in text, text[-4000:]
        # The learner's second life resumed from its checkpoint, not from scratch.
        (resumed,) = re.findall(r"learner resumed from its checkpoint \S+ at update (\d+)", learner.stdout)
        assert int(resumed) >= 100, learner.stdout[-3000:]
        last = {}  # the learner's last report (its last life's counters; its updates go on from the checkpoint)
        for row in csv.reader(csv_path.read_text().splitlines()[1:]):
            if row[2] == "learner" and row[3] in ("updates", "one_sided_batches", "drawn_ahead_batches"):
                last[row[3]] = float(row[4])
        since = last["updates"] - int(resumed)
        assert since > 200 and last["one_sided_batches"] >= 0.8 * since, (resumed, last)
        assert last["drawn_ahead_batches"] >= 0.5 * since, (resumed, last)
        assert "worker 'actor-1' was lost with host 'h3'" in text
        assert {g: w["host"] for g, w in final["groups"].items()} == {
            "learner": "h1", "replay-0": "h1", "replay-1": "h2", "actor-0": "h2", "actor-1": "h2"}
        (back,) = tmp_path.glob(f"h1/jobs/{job}/app/runs/dqn-CartPole-v1-*")  # copied back to the job's directory
        assert (back / "metrics.csv").is_file() and (back / "replay-1").is_dir()
        c.wait_no_workers()
    finally:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_restart_waits_for_its_only_host_to_come_back_without_using_restarts_and_ends_past_host_wait_s(
        tmp_path, monkeypatch):
    """The forever app submitted over two hosts (async, on-failure, max_restarts = 2), ticker-1's only
    candidate host h2. SIGKILL of h2's daemon (its worker dies with it): the restart finds no host
    answering and asks again, three times and more, where counting such tries as restarts would have
    ended the run at the second; `reactor status JOB` shows the group waiting. h2's daemon comes back
    at its address (as Ray or systemd starts one again) and ticker-1 runs there as restart 1. A second
    SIGKILL, with no daemon coming back, ends the job once host_wait_s (12 s) has passed, naming the
    host and why it did not answer; nothing is left on h1. (No fork server: the app's workers import no
    torch, and each daemon's fork server, h2's new one too, would cost more than the four starts it serves.)"""
    c = Cluster(tmp_path, n=2, heartbeat_timeout_s=2.0, fork_server=False)
    monkeypatch.setenv("REACTOR_KEYS", str(c.keys))
    try:
        ready = tmp_path / "ready"
        job = _submit_job(c, tmp_path, FOREVER, 'max_restarts = 2\nbackoff_s = 0.5\nhost_wait_s = 12\n'
                          '[groups.sink]\nreactors = ["sink"]\nhost = "h1"\n'
                          '[groups.ticker-0]\nreactors = ["ticker[[]0]"]\nhost = "h1"\n'
                          '[groups.ticker-1]\nreactors = ["ticker[[]1]"]\nhost = "h2"\n',
                          f"ready_file={str(ready)!r}")
        cli = [sys.executable, "-m", "reactor.cli"]
        keys = load_keys(c.keys)
        with DaemonClient(c.addresses["h1"], keys.public, keys) as d:
            def log() -> str:
                return d.request("logs", job, 0)["data"].decode(errors="replace")

            def running() -> bool:
                return d.request("status", job)["state"] == "running"

            def status() -> str:
                got = subprocess.run([*cli, "status", job, "--daemon", c.addresses["h1"]], env=c.env(),
                                     capture_output=True, text=True, timeout=60)
                assert got.returncode == 0, got.stderr
                return got.stdout

            wait_for(lambda: ready.exists() and "ticker-1" in c.worker_pids("h2").values(), 120, "the job's workers")
            address = c.addresses["h2"]
            c.stop_daemon("h2", signal.SIGKILL)
            wait_for(lambda: len(re.findall(r"worker 'ticker-1' waits for a host: ", log())) >= 3 or not running(),
                     120, "three tries that found no host answering")
            assert running(), log()[-3000:]
            assert re.search(r"ticker-1 on h2 \(waiting for a host: \d+ s of at most 12 s, \d+ tries\)", status()), \
                status()
            c.start_daemon("h2", address)
            wait_for(lambda: "worker 'ticker-1' is running again (restart 1)" in log() or not running(), 120,
                     "ticker-1 to run again on h2")
            wait_for(lambda: list(c.worker_pids("h2").values()) == ["ticker-1"], 30, "ticker-1's new life on h2")
            assert re.search(r"^  ticker-1 on h2$", status(), re.M), status()  # no longer waiting
            c.stop_daemon("h2", signal.SIGKILL)
            wait_for(lambda: not running(), 120, "the job to end")
            final = d.request("status", job)
            text = log()
        assert final["state"] == "failed", (final, text[-3000:])
        assert "worker 'ticker-1' is running again (restart 1)" in text, text[-3000:]
        assert "(restart 2 of at most 2 in a row)" in text and "restart 3" not in text, text[-3000:]
        assert re.search(r"worker 'ticker-1' could not be started again: no candidate host answered within "
                         r"host_wait_s = 12 s \(\d+ tries\): group 'ticker-1': no candidate host answered: h2: "
                         r"host 'h2' \(tcp://\S+\) did not answer 'ping' within", text), text[-3000:]
        c.wait_no_workers()
    finally:
        c.close()


@pytest.mark.parametrize(("checkpoint_every", "words"), [
    (0, "checkpoint_every = 0 writes learner.pt only at the run's end, so it learns again from fresh weights; "
        "set checkpoint_every=N"),
    (100, "no learner.pt written yet (checkpoint_every = 100), so it learns again from fresh weights"),
])
def test_a_learner_started_again_with_no_checkpoint_says_it_learns_again_from_fresh_weights(
        tmp_path, caplog, checkpoint_every, words):
    """A restarted learner (restart policies) with no learner.pt to resume from started from fresh weights
    in silence: a run's progress lost without a word (a chaos run, session 56: the learner killed before
    its first checkpoint, and by default, checkpoint_every = 0, at any time)."""
    import logging

    from reactor.nodes.learner import Learner

    learner = Learner("dqn", "CartPole-v1", {"hidden": 16}, run_dir=str(tmp_path / "run"),
                      checkpoint_every=checkpoint_every)
    learner.restarts = 1  # (what the scheduler sets in a restarted life)
    with caplog.at_level(logging.WARNING, logger="reactor.learner"):
        learner._setup(learner.algo_name, learner.env_name, learner.algo_config)
    assert learner.updates == 0
    said = [m for m in caplog.messages if "started again (restart 1) without its learning: " in m]
    assert len(said) == 1 and words in said[0], caplog.messages


def test_a_restart_policy_over_a_learner_or_shard_that_would_start_again_empty_is_said_before_the_run_starts(caplog):
    """A restart policy over the main job's learner, with the default checkpoint_every = 0, restarted it from
    fresh weights; over shards with no checkpoint period, empty. Said at the start, naming the setting; a
    learner that checkpoints and shards that do are not named."""
    import logging

    from reactor.launch._restarts import _warn_restart_losses

    def said(overrides: dict[str, Any]) -> list[str]:
        graph = build_graph(DQN, {"live": False, **overrides})
        plan = resolve_placement(graph, "actors", None, restart_from_text("on-failure"))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="reactor.coordinator"):
            _warn_restart_losses(graph, plan.groups)
        return caplog.messages

    got = said({})
    assert got == ["group 'learner' restarts on failure, but 'learner' would start again without its learning: "
                   "checkpoint_every = 0 writes learner.pt only at the run's end, so it learns again from fresh "
                   "weights; set checkpoint_every=N to resume from every N updates"], got
    assert said({"checkpoint_every": 100}) == []
    assert said({"checkpoint_every": 100, "replay_checkpoint_period_s": None}) == []  # (the async period stands)
    got = said({"checkpoint_every": 100, "replay_checkpoint_period_s": None, "replay_async_checkpoint_period_s": None})
    assert [m.split(" would")[0] for m in got] == ["group 'replay-0' restarts on failure, but 'replay'"], got
    assert "set a period (replay_async_checkpoint_period_s) or wal" in got[0]


@pytest.mark.timeout(120)
def test_a_failed_restartable_worker_whose_shutdown_never_ends_leaves_and_its_next_life_runs(tmp_path):
    """A restartable worker that failed is told "exit" at once, but its shutdown reactions run first: one
    that never ended held the process, so its group was never started again, and the run never ended
    (nor did its stop time or a clean stop end it). The failed worker now leaves ``FAILED_END_S`` after
    its failure at the latest, and its next life takes over."""
    from reactor.launch._worker import FAILED_END_S

    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(ROOT / "tests" / "apps" / "failing_source.py"),
                        "--placement", "processes", "--async", "--restart", "on-failure:1,backoff_s=0.1",
                        "--set", "shutdown_s=600", "--set", "failing_lives=1"],
                       capture_output=True, text=True, timeout=100, cwd=ROOT, env=_env(tmp_path))
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert "worker 'source' failed (it will be started again)" in p.stderr
    assert (f"reactor worker source: its shutdown reactions did not end within {FAILED_END_S:g} s of its failure; "
            f"it leaves without them") in p.stderr
    assert "worker 'source' exited with status 1 (failed: its traceback is in its output); starting it again" \
        in p.stderr, p.stderr[-3000:]
    assert "run ended (quiescence)" in p.stdout
    assert took < FAILED_END_S + 50


_SLOW_SAVE = r"""
import sys, threading, time
import torch
import reactor.launch._worker as W
from reactor._files import replacing

ckpt, write_s, save_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
W.FAILED_SAVE_S = save_s
worker = W.Worker.__new__(W.Worker)
worker.group, worker._leaving = "learner", None
worker._leave_by(0.3, 1)  # (failed: its bound starts)
with replacing(ckpt, sync=True) as f:  # its final checkpoint, slower than the bound
    torch.save({"updates": 2, "w": torch.zeros(1000)}, f)
    end = time.monotonic() + write_s
    while time.monotonic() < end:
        f.write(b"x" * 4096)
        time.sleep(0.01)
    # (said within the write: once it ends, the bound's thread, which looks every 0.05 s, may end the process
    # before a print after it is flushed; 1 run in 5 got "WRITTEN" without its newline so)
    print("WRITTEN", flush=True)
threading.Event().wait()  # its other shutdown reactions hang: the bound ends it
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("save_s", [30.0, 0.5], ids=["written", "cut"])
def test_a_failed_worker_past_its_bound_waits_for_the_checkpoint_it_writes_and_a_cut_one_leaves_the_earlier(
        tmp_path, save_s):
    """Regression: a failed worker leaves ``FAILED_END_S`` after its failure (a shutdown reaction may hang),
    and that cut its final checkpoint when the write took longer: the earlier ``learner.pt`` stayed (a
    temporary file and a rename: checked here with the real ``os._exit`` mid-write, the earlier file loads),
    but what the failed life learned since was lost (under a restart policy, to start the next life a few
    seconds sooner), and the partial ``.learner.pt.tmp`` stayed. Now a write in progress at the bound is
    waited for, at most ``FAILED_SAVE_S`` more; one that outlasts that too is cut and its partial file
    removed, said."""
    ckpt = tmp_path / "learner.pt"
    torch.save({"updates": 1, "w": torch.ones(10)}, ckpt)
    p = subprocess.run([sys.executable, "-c", _SLOW_SAVE, str(ckpt), "1.5", str(save_s)], capture_output=True,
                       text=True, timeout=50, cwd=ROOT, env=_env(tmp_path))
    assert p.returncode == 1, p.stderr[-3000:]
    assert (f"reactor worker learner: its shutdown reactions did not end within 0.3 s of its failure; it is writing "
            f"{ckpt}: it waits for that (at most {save_s:g} s more)") in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / ".learner.pt.tmp").exists()
    if save_s > 1.5:  # written whole, then it left
        assert p.stdout == "WRITTEN\n" and p.stderr.strip().endswith("it leaves without them"), p.stderr[-3000:]
        assert ckpt.stat().st_size > 1.5 / 0.01 * 4096 * 0.5  # (the new file, with its tail of padding)
    else:  # cut: the earlier file whole, and the one a resume loads
        assert p.stdout == "" and (f"; its write of {ckpt} did not end within 0.5 s more: cut, and what it wrote so "
                                   f"far removed (each file holds what it held before); it leaves without them") \
            in p.stderr, p.stderr[-3000:]
        assert torch.load(ckpt, weights_only=True)["updates"] == 1


#: A worker's parent: starts it (its pid last), then waits until killed.
_ORPHAN_PARENT = ("import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], *sys.argv[2:], "
                  "str(os.getpid())]); sys.stdin.read()")


_ORPHAN_WORKER = r"""
import os, signal, sys, threading, time
import reactor.launch._leaving as W
from reactor._files import replacing

ckpt, write_s = sys.argv[1], float(sys.argv[2])
W.ORPHAN_GRACE_S = 0.3
W.DEATH_SIGNAL = signal.SIGTRAP  # (its alarm: 5 s, not SIGUSR2's 12; the mechanism is the same)
signal.signal(signal.SIGTERM, lambda *_: None)  # (a worker's loop takes its SIGTERM: a clean stop it begins)
W._die_with_parent()
print("STARTED", flush=True)
while os.getppid() == int(sys.argv[3]):
    time.sleep(0.01)
with replacing(ckpt, sync=True) as f:  # its final checkpoint, slower than its bound and the parent-death alarm
    f.write(b"new")
    end = time.monotonic() + write_s
    while time.monotonic() < end:
        f.write(b"x" * 4096)
        time.sleep(0.01)
    # (said within the write: once it ends, the bound's thread, which looks every 0.05 s, may end the process
    # before a print after it is flushed; 1 run in 5 got "WRITTEN" without its newline so)
    print("WRITTEN", flush=True)
threading.Event().wait()  # its other shutdown reactions hang: the bound ends it
"""


@pytest.mark.timeout(90)
def test_an_orphaned_worker_past_its_bound_waits_for_the_checkpoint_it_writes_past_its_parent_death_alarm(tmp_path):
    """Regression: a worker whose parent died (its coordinator killed; under Slurm's scancel, its daemon's fork
    server ended by the same SIGTERM) left ``ORPHAN_GRACE_S`` after, cutting the final checkpoint it was
    writing then (a failed or SIGTERM'd worker's bound waits for it). It is waited for now, at most
    ``FAILED_SAVE_S`` more, the parent-death alarm (``DEATH_SIGNAL``: 12 s; SIGTRAP's 5 s here) moved past
    the wait: the write here takes 6 s."""
    ckpt = tmp_path / "learner.pt"
    ckpt.write_bytes(b"old")
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT, _ORPHAN_WORKER, str(ckpt), str(signal.SIGTRAP + 1)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env=_env(tmp_path))
    assert parent.stdout.readline() == "STARTED\n"
    parent.kill()  # (kill -9 of its parent: the worker is an orphan, its output still comes here)
    out, err = parent.communicate(timeout=60)  # (once the worker has ended too: it holds the pipes)
    assert out == "WRITTEN\n", err[-3000:]
    assert (f"reactor worker ?: its shutdown reactions did not end within 0.3 s of its parent's death (pid "
            f"{parent.pid}); it is writing {ckpt}: it waits for that (at most 120 s more)") in err, err[-3000:]
    assert err.strip().endswith("it leaves without them"), err[-3000:]
    assert ckpt.read_bytes().startswith(b"new") and not (tmp_path / ".learner.pt.tmp").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after_s", [0.0, 1.5], ids=["at-its-start", "after-a-life-past-reset_after_s"])
def test_a_refusal_under_a_restart_policy_ends_the_run_at_once_with_its_line(tmp_path, after_s):
    """Regression: a refusal (reactor refusing what the run was given: here a run directory that does not
    exist, given to ``reactor.load_policy``) under ``--restart on-failure`` was started again up to
    max_restarts before its class was raised; one that came after a life past reset_after_s (from what
    the node met at run time) restarted for good, and the run ended at its stop time with exit 0, the
    cause only in a warning. A new life is given the same settings and files: a refusal is not restarted,
    whenever it comes (docs/reliability.md), and the run ends with its class and line (exit 2)."""
    missing = tmp_path / "no-such-run"
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(ROOT / "tests" / "apps" / "failing_source.py"),
                        "--placement", "processes", "--async", "--stop-s", "40",
                        "--restart", "on-failure:3,backoff_s=0.1,reset_after_s=1",
                        "--set", f"refuse={str(missing)!r}", "--set", f"refuse_after_s={after_s}"],
                       capture_output=True, text=True, timeout=100, cwd=ROOT, env=_env(tmp_path))
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.splitlines()[-1] == f"reactor: no run directory at {str(missing)!r}", p.stderr[-3000:]
    assert "worker 'source' refused the run: not started again" in p.stderr
    assert "starting it again" not in p.stderr and "running again" not in p.stderr, p.stderr[-3000:]


@pytest.mark.timeout(150)
def test_a_restarted_worker_whose_peer_is_held_at_its_start_links_to_it_once_it_answers(tmp_path):
    """A restarted worker connects to its peers at its start; one held in a reaction longer than the
    connect's 10 s timeout (a long update, a data-parallel rendezvous) answers no welcome, and the new life
    counted it as down for the rest of the run: everything it sent there was dropped (a dp-learners run
    whose learners restarted learned nothing more, exit 0). It asks again until the peer answers."""
    f = {k: tmp_path / k for k in ("ready_file", "hold_file", "holding_file", "new_life_file")}
    proc = subprocess.Popen([sys.executable, "-m", "reactor.cli", "run", str(ROOT / "tests" / "apps" / "held_peer.py"),
                             "--placement", "processes", "--async", "--restart", "on-failure:1,backoff_s=0.1",
                             *[a for k, v in f.items() for a in ("--set", f"{k}={v}")]],
                            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        first = _workers(proc, f["ready_file"], n=2)
        f["hold_file"].touch()
        wait_for(f["holding_file"].exists, 30, "the sink to hold its loop")
        os.kill(first["ticker"], signal.SIGKILL)
        wait_for(f["new_life_file"].exists, 60, "a value from the ticker's new life at the sink")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "restartable peer 'sink' answers now; it is up again here" in err, err[-3000:]
    assert proc.returncode == 130, err[-3000:]


@pytest.mark.timeout(300)
def test_kill_9_of_one_data_parallel_learner_restarts_the_bank_which_learns_on_with_identical_replicas(tmp_path):
    """Regression (docs/reliability.md, the hostile pass over daemons): SIGKILL of learner-1 under
    ``--placement dp-learners --restart on-failure``. The survivor waited for the dead replica's rounds
    for good, and the new learner-1 waited in the rendezvous, whose store held the first life's keys
    (over hosts gloo connected to the killed rank's old address): no update after the restart. Now the
    survivor ends too and restarts, the bank's new lives meet under keys of their own and take replica
    0's state (resumed from its checkpoint), and the run learns on to its budget with both replicas
    holding the same weights."""
    run = tmp_path / "run"
    errfile = tmp_path / "stderr.log"
    with open(errfile, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "reactor.cli", "run", DQN, "--placement", "dp-learners", "--async", "--json",
             "--restart", "on-failure:1,backoff_s=0.1", "--set", "learners=2", "--set", "live=False",
             "--set", f"run_dir={str(run)!r}", "--set", "checkpoint_every=50", "--set", "max_env_steps=4000",
             "--set", "target_return=None"],
            cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        wait_for(lambda: (run / "learner.pt").exists() or proc.poll() is not None, 120, "the bank's first checkpoint")
        kids = _children(proc.pid)
        assert "learner-1" in kids, f"the run ended before the kill: {errfile.read_text()[-3000:]}"
        os.kill(kids["learner-1"], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        err = _reaped(proc, errfile)
    assert proc.returncode == 0, err[-4000:]
    assert json.loads(out)["restarts"] == {"learner-1": ["was killed by SIGKILL"],
                                           "learner-0": ["exited with status 3 (lost a peer: its output names which)"]}
    # The survivor ended (in the all-reduce the dead one left, or on hearing of its death between
    # updates), and the bank's new lives met in its next life.
    assert re.search(r"^reactor worker learner-0: learner\[0\]: (the gradient all-reduce of update \d+ failed: a "
                     r"data-parallel learner's link to this one broke|the other data-parallel learners did not join "
                     r"the gradient all-reduce|data-parallel learner\(s\) \[1\] of the bank's life 0 died)", err, re.M), \
        err[-4000:]
    for i in (0, 1):
        assert f"learner[{i}]: all 2 data-parallel learners joined the bank's life 1" in err, err[-4000:]
    (resumed,) = re.findall(r"^learner\[0\] resumed from its checkpoint \S+ at update (\d+)$", err, re.M)
    assert f"learner[1] took learner[0]'s state at update {resumed}" in err, err[-4000:]
    ends = dict(re.findall(r"^(learner\[\d\]): (\d+ updates; final weights sha256 \w+)$", err, re.M))
    assert set(ends) == {"learner[0]", "learner[1]"} and ends["learner[0]"] == ends["learner[1]"], err[-4000:]
    assert int(ends["learner[0]"].split()[0]) > int(resumed) >= 50, (resumed, ends)  # it learned on after the restart
    # The run's counts of messages sent and received met again after the restart (they ended it): the dead
    # lives' counts left with them (430 more received than sent were said, the run ended on a held quiet).
    assert "the run went quiet" not in err, err[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_9_of_one_data_parallel_learner_over_two_hosts_restarts_the_bank_which_learns_on_to_its_end(tmp_path):
    """``--placement dp-learners --set learners=2`` over two hosts (network namespaces, a daemon in each:
    learner-0 on h1, learner-1 on h2), async, restart on-failure. kill -9 of learner-1 once replica 0 has
    saved a checkpoint: the survivor ends too (its bank's group cannot take the dead one's new life), both
    start again, meet in the bank's next life through the coordinator's TCP store (the store outlives the
    replicas: each life's keys are its own), learner-1 takes replica 0's state (resumed from its checkpoint,
    which only h1's run directory holds) and the run learns on past the kill to its budget, the replicas
    ending with the same weights, the final ones copied back to where the run started."""
    c = Cluster(tmp_path, n=2, heartbeat_timeout_s=2.0)
    errfile = tmp_path / "stderr.log"
    try:
        with open(errfile, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "reactor.cli", "run", DQN, "--placement", "dp-learners", "--hosts",
                 str(c.write_hosts()), "--async", "--json", "--restart", "on-failure:1,backoff_s=0.1",
                 "--set", "learners=2", "--set", "live=False", "--set", "run_dir='dp'", "--set", "checkpoint_every=50",
                 "--set", "max_env_steps=4000", "--set", "target_return=None"],
                cwd=tmp_path, env={**c.env(), "REACTOR_RUNTIME_DIR": str(_rt(tmp_path))}, stdout=subprocess.PIPE,
                stderr=err, text=True)
        try:
            # (relative: each host's own run directory; only replica 0's, on h1, holds learner.pt)
            wait_for(lambda: list(tmp_path.glob("h1/runs/*/dp/learner.pt")) or proc.poll() is not None, 240,
                     "the bank's first checkpoint on h1")
            pids = {g: p for p, g in c.worker_pids().items()}
            assert {"learner-0", "learner-1"} <= set(pids) and proc.poll() is None, errfile.read_text()[-3000:]
            assert set(c.worker_pids("h2").values()) >= {"learner-1"}, c.worker_pids()
            os.kill(pids["learner-1"], signal.SIGKILL)
            out, _ = proc.communicate(timeout=300)
        finally:
            err = _reaped(proc, errfile)
        assert proc.returncode == 0, err[-4000:]
        result = json.loads(out)
        assert result["restarts"] == {
            "learner-1": ["was killed by SIGKILL on host 'h2'"],
            "learner-0": ["exited with status 3 (lost a peer: its output names which) on host 'h1'"]}, result["restarts"]
        logs = {}
        for i, host in ((0, "h1"), (1, "h2")):
            (log,) = [d / f"learner-{i}.log" for d in c.new_runs(host) if (d / f"learner-{i}.log").exists()]
            logs[i] = log.read_text()
        # The survivor ended (in the all-reduce the dead one left, or on hearing of its death between updates),
        # and both new lives met in the bank's next life, over the coordinator's TCP store.
        assert re.search(r"^reactor worker learner-0: learner\[0\]: (the gradient all-reduce of update \d+ failed: a "
                         r"data-parallel learner's link to this one broke|the other data-parallel learners did not join "
                         r"the gradient all-reduce|data-parallel learner\(s\) \[1\] of the bank's life 0 died)", logs[0],
                         re.M), logs[0][-4000:]
        for i in (0, 1):
            assert f"learner[{i}]: all 2 data-parallel learners joined the bank's life 1" in logs[i], logs[i][-4000:]
        (resumed,) = re.findall(r"^learner\[0\] resumed from its checkpoint \S+ at update (\d+)$", logs[0], re.M)
        assert f"learner[1] took learner[0]'s state at update {resumed}" in logs[1], logs[1][-4000:]
        # (each life that ended says so: learner-0's first, failed, one too, at the checkpoint it saved then)
        ends = [re.findall(r"^learner\[\d\]: (\d+) updates; final weights sha256 (\w+)$", logs[i], re.M) for i in (0, 1)]
        assert ends[0] and ends[1] and ends[0][-1] == ends[1][-1], ends
        updates, sha = int(ends[0][-1][0]), ends[0][-1][1]
        assert updates > int(resumed) >= 50, (resumed, updates)  # it learned on after the restart
        summary = result["summary"]
        assert summary["updates"] == updates and summary["env_steps"] >= 4000, summary
        assert (tmp_path / "dp" / "weights.sha256").read_text().strip() == sha  # copied back from h1
        assert "the run went quiet" not in err, err[-4000:]  # (the counts met again after the restart: as on one host)
        c.wait_no_workers()
    finally:
        c.close()
