"""Data-parallel learners: a replica that never joins an all-reduce is reported, not waited on for 30 min.

Two real processes rendezvous through torch.distributed (gloo, file store) exactly as the learners of
``--placement dp-learners`` do (``_LearnerBank._join_bank``); replica 1 then stops taking
part, as one that died or stopped does.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

REPLICA = r"""
import asyncio, sys, time, types
import torch
import reactor.nodes._learnerbank as L

L.DP_TIMEOUT_S = 3.0
rank, run_dir = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(rank)
net = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
algo = types.SimpleNamespace(state_dict=lambda s: {"net": s["net"].state_dict(), "opt": s["opt"].state_dict()},
                             load_state_dict=lambda s, d: (s["net"].load_state_dict(d["net"]),
                                                           s["opt"].load_state_dict(d["opt"])))
me = types.SimpleNamespace(run_dir=run_dir, run_id="dptimeout", bank_index=rank, bank_size=2, restarts=0,
                           state={"net": net, "opt": opt}, algo=algo, name=f"learner[{rank}]", updates=0,
                           device="cpu", torch_device=torch.device("cpu"), stopped_by=None, deterministic=False)
for method in [m for m, f in vars(L._LearnerBank).items() if callable(f) and not m.startswith("__")]:
    setattr(me, method, types.MethodType(getattr(L._LearnerBank, method), me))
asyncio.run(L._LearnerBank._join_bank(me))
print("joined", float(net.weight.sum()), flush=True)  # replica 0's weights, broadcast to both
if rank == 0:
    net(torch.ones(1, 2)).sum().backward()
    t0 = time.monotonic()
    try:
        opt.step()
        print("stepped", flush=True)
    except L.PeerLostError as e:
        print(f"lost after {time.monotonic() - t0:.1f}s: {e}", flush=True)
    except L._BankLeft as e:
        print(f"left after {time.monotonic() - t0:.1f}s: {e.left}", flush=True)
else:
    if sys.argv[3:] == ["leave"]:  # gone with the run (its shutdown), its process still up
        me.updates = 7
        me._leave_bank()
        time.sleep(3)  # (replica 0 is told within DP_POLL_S; its exit waits for this one's)
    elif sys.argv[3:] == ["die"]:  # joined, then gone without a word: its links close
        import os
        os._exit(0)
    else:
        time.sleep(10)  # joined, but takes no further part
"""


#: The lines in which replica 0 of ``REPLICA`` says how its update ended.
_VERDICTS = ("stepped", "lost after", "left after")


def _replica_0_lines(proc: subprocess.Popen, until: tuple[str, ...], then) -> list[str]:
    """``proc``'s output lines to its end; ``then()`` runs once a line starts with one of ``until`` (it ends
    what the test no longer needs: replica 0's exit after a peer left waits for the peer's, asleep for
    seconds). ``proc`` is killed if it has not ended within 90 s."""
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(until):
                then()
        return lines
    finally:
        watchdog.cancel()


def _two_replicas(tmp_path, script: str, *extra: str) -> str:
    """Replicas 0 and 1 of ``script`` in two processes; replica 0's output, both reaped (replica 1 killed
    once replica 0 said how its update ended)."""
    procs = [subprocess.Popen([sys.executable, "-c", script, str(rank), str(tmp_path), *extra], cwd=REPO,
                              stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                              text=True) for rank in (0, 1)]
    try:
        out0 = "".join(_replica_0_lines(procs[0], _VERDICTS, procs[1].kill))
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=30)
    return out0


def test_a_replica_that_never_joins_the_all_reduce_raises_peer_lost_within_the_timeout(tmp_path):
    out0 = _two_replicas(tmp_path, REPLICA)
    lines = out0.strip().splitlines()
    joined = [line for line in lines if line.startswith("joined")]
    assert joined, out0
    lost = [line for line in lines if line.startswith("lost after")]
    assert lost, out0
    seconds = float(lost[0].split()[2].rstrip("s:"))
    assert 2.5 <= seconds < 30, lost[0]
    assert ("learner[0]: the other data-parallel learners did not join the gradient all-reduce of update 1 "
            "within 3s (a replica died or hung)") in lost[0]


def test_a_replica_whose_peer_died_says_its_link_broke_not_that_it_waited_out_the_timeout(tmp_path):
    """Regression: a replica whose peer died (its connection closed: gloo fails the all-reduce at once)
    said the others "did not join ... within 60s", as if it had waited the timeout out (a kill -9 of
    one replica over hosts, tests/launch/test_restart.py): a wrong lead for whoever reads why."""
    out0 = _two_replicas(tmp_path, REPLICA.replace("L.DP_TIMEOUT_S = 3.0", "L.DP_TIMEOUT_S = 30.0"), "die")
    lost = [line for line in out0.splitlines() if line.startswith("lost after")]
    assert lost, out0
    assert re.fullmatch(r"lost after [\d.]+s: learner\[0\]: the gradient all-reduce of update 1 failed: a data-parallel "
                        r"learner's link to this one broke \(it died\): .+", lost[0]), lost[0]


def test_a_replica_that_left_with_the_run_ends_the_others_wait_at_once_not_after_the_timeout(tmp_path):
    """Regression: a run of dp-learners that stopped on its evaluation target stopped replica 1
    between rounds while replica 0 was in the next update's all-reduce, which waited DP_TIMEOUT_S
    and failed the run. A replica's shutdown now tells the bank it left (and at which update); a
    waiting all-reduce checks between slices of DP_POLL_S."""
    out0 = _two_replicas(tmp_path, REPLICA.replace("L.DP_TIMEOUT_S = 3.0", "L.DP_TIMEOUT_S = 30.0"), "leave")
    left = [line for line in out0.splitlines() if line.startswith("left after")]
    assert left and left[0].endswith(": {1: 7}"), out0
    assert float(left[0].split()[2].rstrip("s:")) < 15, left[0]  # not the 30 s timeout (15: a loaded machine took over 5)


def test_a_replica_waiting_for_the_others_to_join_says_so_until_they_do(tmp_path):
    """Regression (issue 19): under dp-learners on a loaded machine a run sat at 0 env steps for 225 s
    with no word of what it waited for (the replicas' rendezvous)."""
    waiter = REPLICA.replace("L.DP_TIMEOUT_S = 3.0", "L.DP_TIMEOUT_S = 3.0\nL.DP_WAIT_REPORT_S = 1.0")
    first = subprocess.Popen([sys.executable, "-c", waiter, "0", str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    second = None
    try:
        lines = []
        for line in first.stdout:  # replica 1 is not started yet: replica 0 keeps saying it waits
            lines.append(line)
            if sum("waiting for the other 1 data-parallel learner(s) to join" in x for x in lines) == 3:
                break
        second = subprocess.Popen([sys.executable, "-c", REPLICA, "1", str(tmp_path)], cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = "".join(_replica_0_lines(first, ("joined",), first.kill))  # (its update is not this test's)
    finally:
        for p in (first, second):
            if p is not None:
                p.kill()
                p.communicate(timeout=30)
    text = "".join(lines) + out
    assert (f"learner[0]: waiting for the other 1 data-parallel learner(s) to join (rendezvous: file {tmp_path}/"
            f".dist-dptimeout; no env steps until they do; a learner that has not joined in 600 s ends the run): "
            f"1 s so far") in text, text
    assert "learner[0]: all 2 data-parallel learners joined after" in text and "joined " in text, text


def test_a_replicas_word_on_a_round_is_checked_before_it_counts():
    """Learner.heard takes a BankReady only when a replica could have sent it: malformed words, rounds
    already run or absurdly far ahead, and a second word on one round are dropped, with the reason."""
    from reactor.nodes.learner import _MAX_ROUNDS_AHEAD, _bad_word
    from reactor.nodes.train_messages import BankReady

    heard = {5: {1: True}}

    def bad(word):  # as replica 1 of 2, at round 5, having announced rounds 0..5
        return _bad_word(word, 2, 5, heard, 1, 6)

    assert bad(BankReady(0, 5, True)) == ""
    assert bad(BankReady(0, 7, False)) == ""
    assert bad("hi") == "expected a BankReady, got str"
    assert bad(BankReady(2, 5, True)) == "replica must be an int in [0, 2), got 2"
    assert bad(BankReady(True, 5, True)) == "replica must be an int in [0, 2), got True"
    assert bad(BankReady(0, 4, True)) == (
        f"round must be an int in [5, {5 + _MAX_ROUNDS_AHEAD}) (the rounds not yet run), got 4 from replica 0")
    assert bad(BankReady(0, 5 + _MAX_ROUNDS_AHEAD, True)).startswith("round must be an int in")
    assert bad(BankReady(0, "5", True)).startswith("round must be an int in")
    assert bad(BankReady(0, 5, 1)) == "have must be True or False, got 1"
    assert bad(BankReady(1, 5, False)) == "replica 1 spoke twice on round 5"
    # In this replica's own name, ahead of what it announced (it would take a batch it does not hold).
    assert bad(BankReady(1, 6, True)) == (
        "a word in this replica's name (1) on round 6, which it has not announced (it announced 6)")


def test_a_bank_of_learners_whose_rounds_are_not_wired_fails_at_start_saying_how_to_wire_them(tmp_path, monkeypatch):
    """A Learner bank updates only when every replica hears every replica's word (ready -> bank);
    a graph built without that link would never update, silently: it fails at start instead. (In one
    process, with the placement's check that the replicas have a process each turned off: the check
    of the wiring is the learner's own, wherever it runs.)"""
    import pytest

    from reactor import run
    from reactor.nodes.learner import Learner
    from reactor.nodes.training import off_policy_graph

    monkeypatch.setattr(Learner, "replicas_apart", None)

    g = off_policy_graph(algo="dqn", env="CartPole-v1", run_dir=str(tmp_path), learners=2, max_env_steps=100,
                         live=False)
    g.connections = [c for c in g.connections if c.dst.port != "bank"]
    with pytest.raises(ValueError, match=r"learner\[0\]: a bank of 2 data-parallel learners updates in rounds, and "
                                         r"every replica must hear every replica: connect its `ready` output to its "
                                         r"`bank` input.*; 0 link\(s\) reach this replica's `bank`"):
        run(g)


def test_a_banks_replicas_meet_in_one_life_and_every_new_life_of_a_replica_moves_the_bank_to_the_next():
    """Regression (docs/reliability.md): the rendezvous store outlives the replicas' processes, and
    every life of the bank used the same keys, so a restarted replica's gloo connect read a killed
    replica's old address. Now the replicas agree on a life of the bank (its keys its own): a replica
    started again comes to a newer life than the one it was in, one waiting follows the store's life
    when it moves on, and each says which life of its process came (``restarts``)."""
    import asyncio

    import torch.distributed as dist

    from reactor.nodes._learnerbank import _meet_bank

    bank = dist.PrefixStore("run/learner", dist.HashStore())

    async def lives() -> list:
        def come(i: int, process: int) -> asyncio.Task:
            return asyncio.ensure_future(_meet_bank(bank, i, 3, process, f"learner[{i}]", "a test store"))

        async def until(*keys: str, life: int = 0) -> None:  # (the meeting runs on threads: their order is
            for _ in range(1000):                            # the store's, so the test waits on the store)
                if bank.check(list(keys)) and int(bank.add("life", 0)) >= life:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"the store never held {keys} at life {life}")

        first = await asyncio.gather(*(come(i, 0) for i in range(3)))
        # Replicas 0 and 1 start again (replica 1 died; 0 ended with it) and come to life 1; replica 1 dies
        # there, before replica 2 comes: its next process makes life 2, where replica 0 follows it.
        zero, one = come(0, 1), come(1, 1)
        await until("came/1/0", "came/1/1")
        one.cancel()
        again = come(1, 2)
        await until("came/2/1", life=2)
        second = await asyncio.gather(zero, again, come(2, 1))
        return [first, second]

    first, second = asyncio.run(lives())
    assert first == [(0, {0: 0, 1: 0, 2: 0})] * 3
    assert second == [(2, {0: 1, 1: 2, 2: 1})] * 3


def test_a_replica_waiting_for_its_bank_leaves_when_the_run_stops_or_a_missing_replica_left():
    """A replica that refused or failed at its start never comes to its bank's meeting, and the others
    waited ``DP_JOIN_TIMEOUT_S`` (600 s) for it, past the run's end. A waiting replica leaves as soon as
    the run is ending (its coordinator's stop, heard in async runs), or, watching for it (deterministic
    runs, whose worker hears nothing while the meeting holds its reaction), once a replica that has not
    come says it left (``gone/<i>``); a replica that came and left is no reason."""
    import asyncio

    import pytest
    import torch.distributed as dist

    from reactor.nodes._learnerbank import _meet_bank, _RunStopping

    async def meet(bank: dist.Store, stopping=lambda: False, left_watch=False):
        return await asyncio.wait_for(_meet_bank(bank, 0, 3, 0, "learner[0]", "a test store", stopping,
                                                 left_watch=left_watch), 10)

    bank = dist.PrefixStore("run/learner", dist.HashStore())
    with pytest.raises(_RunStopping, match=r"^learner\[0\]$"):
        asyncio.run(meet(bank, stopping=lambda: True))
    bank = dist.PrefixStore("run/learner", dist.HashStore())
    bank.set("came/0/2", "0")  # replica 2 came; replica 1 left without coming
    bank.set("gone/1", "0")
    with pytest.raises(_RunStopping, match=re.escape("data-parallel learner(s) [1] left (refused or failed at its "
                                                     "start)")):
        asyncio.run(meet(bank, left_watch=True))
    bank = dist.PrefixStore("run/learner", dist.HashStore())
    for key in ("came/0/1", "came/0/2", "gone/1"):  # (had it come, its word would not stop the meeting)
        bank.set(key, "0")
    assert asyncio.run(meet(bank, left_watch=True)) == (0, {0: 0, 1: 0, 2: 0})


def test_a_replica_ends_when_a_replica_of_its_banks_life_dies_and_lets_an_earlier_death_be():
    """A data-parallel replica whose peer replica died cannot take the peer's new life into its group or
    its rounds: it ends (PeerLostError), so that its restart policy starts it again with the bank. It
    used to wait for the dead one's rounds for good. A death it hears of after it joined, of a process
    older than the one that came to its bank's life (the death that began this life: the coordinator's
    word waited while the replica met the others), or of a peer down at its start (life -1), is not its
    bank's, and is let be."""
    import pytest

    from reactor import PeerChange, PeerLostError
    from reactor.nodes.learner import Learner

    learner = Learner("dqn", "CartPole-v1")
    learner.name, learner.bank_index, learner.bank_size = "learner[1]", 1, 2
    learner.dp_life, learner.dp_members = 3, {0: 2, 1: 1}  # replica 0's third process came to the bank's life 3
    for life in (1, -1):
        learner.peer_change = PeerChange("peer_lost", ("learner[0]",), "worker 'learner-0' was killed by SIGKILL",
                                         (("bank", 0), ("ready", 0)), life)
        learner.replica_lost()
    learner.peer_change = PeerChange("peer_lost", ("learner[0]",), "worker 'learner-0' was killed by SIGKILL",
                                     (("bank", 0), ("ready", 0)), 2)
    with pytest.raises(PeerLostError, match=r"^learner\[1\]: data-parallel learner\(s\) \[0\] of the bank's life 3 "
                                            r"died \(worker 'learner-0' was killed by SIGKILL\); a bank starts again "
                                            r"whole, so this replica ends too, for its restart policy to start it "
                                            r"again$"):
        learner.replica_lost()
    learner.peer_change = PeerChange("peer_lost", ("replay[0]",), "worker 'replay-0' was killed by SIGKILL",
                                     (("requests", 0),), 0)
    learner.replica_lost()  # a shard: not the bank's


FORMING = r"""
import asyncio, signal, sys, types
import torch
import reactor.nodes._learnerbank as L

L.DP_TIMEOUT_S = float(sys.argv[2])
net = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
algo = types.SimpleNamespace(state_dict=lambda s: {"net": s["net"].state_dict()},
                             load_state_dict=lambda s, d: s["net"].load_state_dict(d["net"]))
me = types.SimpleNamespace(run_dir=sys.argv[1], run_id="forming", bank_index=0, bank_size=2, restarts=0,
                           state={"net": net, "opt": opt}, algo=algo, name="learner[0]", updates=0, device="cpu",
                           torch_device=torch.device("cpu"), stopped_by=None, deterministic=sys.argv[3] == "1")
for method in [m for m, f in vars(L._LearnerBank).items() if callable(f) and not m.startswith("__")]:
    setattr(me, method, types.MethodType(getattr(L._LearnerBank, method), me))


async def main():
    # The coordinator's stop, as the worker takes it: on this process's loop.
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, lambda: setattr(me, "stopped_by", "signal"))
    try:
        print("joined" if await L._LearnerBank._join_bank(me) else "left", flush=True)
    except L.PeerLostError as e:
        print(f"lost: {e}", flush=True)

asyncio.run(main())
# As a worker leaves (os._exit once its output is flushed): a forming left to run on its daemon thread is
# in gloo's C++ when the process ends, and the interpreter's teardown then aborted it in 1 CI run of ~10
# ("terminate called without an active exception"), after its last line.
from reactor.launch._runtime import exit_without_teardown
exit_without_teardown(0)
"""


def _forming(tmp_path, store: str, timeout_s: float, then, deterministic: bool = False) -> str:
    """Replica 0 of a bank of 2 runs in a process of its own; replica 1 came to the bank's life 0 (its keys
    in the rendezvous store, as one leaves them) and never forms the group: it died, or hangs. Once
    replica 0 came too, past the meeting and forming the group, ``then(bank, proc)`` runs (``bank``: the
    store as the replicas see it). ``store``: ``"file"`` (the run directory's, one host) or ``"tcp"`` (a
    TCP store served here, as a run's coordinator serves it over hosts: its client takes one request at a
    time). ``deterministic``: replica 0's run is (its worker hears no stop while a reaction runs). Returns
    replica 0's output, once it ended (within 30 s), reaped."""
    import datetime
    import os
    import time

    import torch.distributed as dist

    from reactor.launch._rundir import rendezvous_file

    env = dict(os.environ)
    if store == "tcp":
        served = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=60))
        env["REACTOR_DIST_STORE"] = f"127.0.0.1:{served.port}"
    else:
        served = dist.FileStore(str(rendezvous_file(str(tmp_path), "forming")), -1)
        env.pop("REACTOR_DIST_STORE", None)
    bank = dist.PrefixStore("forming/learner", served)
    bank.set("joined/1", "0")
    bank.set("came/0/1", "0")
    proc = subprocess.Popen([sys.executable, "-c", FORMING, str(tmp_path), str(timeout_s), str(int(deterministic))],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not bank.check(["came/0/0"]):  # (set as it meets the others: replica 1 is there already)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        then(bank, proc)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
    return out


STORES = pytest.mark.parametrize("store", ["file", "tcp"])


@STORES
def test_a_replica_forming_its_banks_group_hears_the_runs_stop_and_leaves(tmp_path, store):
    """Regression: the group's forming (``init_process_group``, ``new_group``) and replica 0's state
    broadcast ran on the run's event loop, so a replica whose peer came to the bank's meeting and then
    died or hung held its loop in C for up to ``DP_TIMEOUT_S`` (60 s): its coordinator's stop was not
    heard, nor a SIGTERM, nor anything else its process serves. They run on a thread of their own now,
    and the loop, free, hears the stop: the replica leaves without learning."""
    import signal

    out = _forming(tmp_path, store, 60.0, lambda bank, proc: proc.send_signal(signal.SIGUSR1))
    assert out.splitlines()[-2:] == [
        "learner[0]: the run is ending (signal) before all 2 data-parallel learners joined: this one leaves without "
        "learning, and saves nothing", "left"], out


@STORES
def test_a_replica_forming_its_banks_group_ends_at_once_when_a_peer_started_again_naming_it(tmp_path, store):
    """A replica that came to the bank's life and died before the group formed: its new life moves the
    bank's life on (``_meet_bank``), where the group forming in the old one can never finish. The replica
    forming it waited ``DP_TIMEOUT_S`` in C and failed with torch's "Wait timeout"; it now sees the bank
    move on and ends at once, naming the replica, for its restart policy to bring it to the new life."""
    from reactor.nodes._learnerbank import _raise_life

    def new_life_of_replica_1(bank, proc):
        bank.set("joined/1", "1")
        _raise_life(bank, 1)
        bank.set("came/1/1", "1")

    out = _forming(tmp_path, store, 60.0, new_life_of_replica_1)
    assert out.splitlines()[-1] == (
        "lost: learner[0]: data-parallel learner(s) [1] of the bank's life 0 started again while its "
        "torch.distributed group formed (its process died); a bank starts again whole, so this replica ends too, for "
        "its restart policy to start it again"), out


@STORES
def test_a_banks_group_that_does_not_form_names_the_replica_that_never_began_to_form_it(tmp_path, store):
    """A replica that came to the meeting and hangs (or died, in a run that restarts nothing): the group
    does not form within ``DP_TIMEOUT_S``, and the replica forming it says which replica never came to it,
    not only torch's "Wait timeout"."""
    out = _forming(tmp_path, store, 2.0, lambda bank, proc: None)
    assert re.fullmatch(r"lost: learner\[0\]: the torch\.distributed group of the bank's life 0 did not form "
                        r"\(data-parallel learner\(s\) \[1\] met the bank and never began to form it\): .+",
                        out.splitlines()[-1]), out


def test_a_deterministic_replica_forming_its_banks_group_leaves_when_a_peer_said_it_left(tmp_path):
    """In a deterministic run a replica's worker hears no stop while its reaction runs: a peer that came to
    the meeting and then failed before the group formed (its shutdown writes ``gone/<i>``, as one that
    never met its bank does) left the others forming it for ``DP_TIMEOUT_S``. They see the word and leave."""
    out = _forming(tmp_path, "file", 60.0, lambda bank, proc: bank.set("gone/1", "0"), deterministic=True)
    assert out.splitlines()[-2:] == [
        "learner[0]: data-parallel learner(s) [1] left while the bank's group formed before all 2 data-parallel "
        "learners joined: this one leaves without learning, and saves nothing", "left"], out


def _store_that_never_answers(tmp_path, timeout_s: float, then) -> str:
    """Replica 0 of a bank of 2 (``FORMING``, ``DP_TIMEOUT_S`` = ``timeout_s``) whose run's rendezvous store
    takes its connection and never answers (a TCP server whose host hangs: a listening socket here that
    reads nothing). Once the replica has connected, ``then(proc)`` runs. Returns its output, once it ended
    (within 30 s), reaped."""
    import os
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    env = {**os.environ, "REACTOR_DIST_STORE": f"127.0.0.1:{server.getsockname()[1]}"}
    proc = subprocess.Popen([sys.executable, "-c", FORMING, str(tmp_path), str(timeout_s), "0"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    conn = None
    try:
        server.settimeout(60)
        conn, _ = server.accept()  # (the replica's store client, in its connect: answered never)
        then(proc)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
        if conn is not None:
            conn.close()
        server.close()
    return out


def test_a_replica_whose_rendezvous_store_does_not_answer_hears_the_runs_stop(tmp_path):
    """Regression: the replica's connect to the run's TCP store (``_open_bank``) and the meeting's store
    requests ran on the run's event loop: a store that did not answer held the loop (a connect taken and
    never answered, for good: the store's 600 s timeout does not bound it), and the coordinator's stop, a
    SIGTERM and every reaction of the process with it. They run on a thread the loop awaits now: the
    stop is heard, and the replica leaves."""
    import signal

    out = _store_that_never_answers(tmp_path, 60.0, lambda proc: proc.send_signal(signal.SIGUSR1))
    assert out.splitlines()[-2:] == [
        "learner[0]: the run is ending (signal) before all 2 data-parallel learners joined: this one leaves without "
        "learning, and saves nothing", "left"], out


def test_a_replica_whose_rendezvous_store_does_not_answer_ends_naming_the_store(tmp_path):
    """The wait for the store is bounded (``DP_TIMEOUT_S``) where it is awaited: the replica ends, naming
    itself and the store's address, rather than wait on the store's connect for good."""
    out = _store_that_never_answers(tmp_path, 2.0, lambda proc: None)
    assert re.fullmatch(r"lost: learner\[0\]: the run's rendezvous store \(tcp store 127\.0\.0\.1:\d+\) did not "
                        r"answer within 2 s", out.splitlines()[-1]), out


def test_the_banks_meeting_leaves_the_loop_free_while_a_store_request_waits():
    """Regression: the meeting's store requests (``_meet_bank``) ran on the caller's loop: a store slow to
    answer held it, and every reaction of the process with it. Here a store's requests wait until a task
    on the same loop lets them go; the meeting ends, as the loop was free meanwhile (it blocked for good
    before, until the requests gave up)."""
    import asyncio
    import threading

    import torch.distributed as dist

    from reactor.nodes._learnerbank import _meet_bank

    class Gated:
        """A real store whose requests wait until ``go`` is set (or fail after 10 s)."""

        def __init__(self) -> None:
            self.store, self.go = dist.HashStore(), threading.Event()

        def __getattr__(self, op: str):
            def request(*args):
                if not self.go.wait(10):
                    raise RuntimeError(f"the store's {op} was not let go within 10 s")
                return getattr(self.store, op)(*args)

            return request

    async def meet() -> tuple:
        bank = Gated()
        for i in (1, 2):
            bank.store.set(f"came/0/{i}", "0")
        meeting = asyncio.ensure_future(_meet_bank(bank, 0, 3, 0, "learner[0]", "a test store"))
        await asyncio.sleep(0.05)
        bank.go.set()  # (the loop runs: this task lets the requests go)
        return await asyncio.wait_for(meeting, 30)

    assert asyncio.run(meet()) == (0, {0: 0, 1: 0, 2: 0})
