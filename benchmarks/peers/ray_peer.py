"""Ray meeting bench_cluster.py's events: the peer for its kill, restart, startup and lost-host rows.

Run (reactor is not imported here; ``--only cut`` needs root and network namespaces, see below):

    python benchmarks/peers/ray_peer.py [--only kill,restart,startup] [--reps 1] [--settle-s 3] [--json FILE]

The five actors stand for the five worker processes of bench_cluster's DQN run under
``placement="actors"`` (learner, replay-0, replay-1, actor-0, actor-1), written the way a Ray user
writes a DQN loop: an ``EnvActor`` steps two gymnasium CartPole-v1 envs with an epsilon-greedy torch
MLP, a ``ReplayShard`` keeps a numpy ring of 25,000 transitions, a ``Learner`` holds a torch Q-net, its
target and Adam; the driver moves the rollouts to the shards and sampled batches to the learner
(``ray.get`` of each call, a few in flight). Ray runs locally (``ray.init`` with one logical CPU per
actor: Ray's default, this machine's cores, would leave actors pending), its dashboard off, its session
files in this run's temporary directory, and is shut down on every path (an error, Ctrl-C; SIGTERM
meets the handler ``ray.init`` installs, which exits with status 15 through the same ``finally``). Every
process Ray starts inherits a mark in its environment (``REACTOR_RAY_PEER``, the caller's or a new one):
whatever still carries it after ``ray.shutdown()`` is killed and named, and nothing else is touched. A
stop that has not ended 45 s after the signal (``ray.shutdown()`` hung: one CI run in many) is ended
from a thread: every thread's stack printed, the marked processes killed, the same line and status.

- ``kill``: the five actors train ``--settle-s`` seconds; then, with a ``run_for`` call of actor-1
  pending, ``kill -9`` of actor-1's worker process: the seconds until the driver's ``ray.get`` raises
  (``ActorDiedError``, a ``RayActorError``).
- ``restart``: replay-0 made with ``max_restarts=1, max_task_retries=0`` (a call in flight when it
  dies raises: how the driver learns of it; with retries it would just return later) and a
  checkpoint file it rewrites after every insert and loads in ``__init__``; after ``--settle-s`` seconds of training, while the driver samples from it in a loop
  (the learner's calls), ``kill -9`` of its process: the seconds until a sample call raises
  (``detected_s``; None if no call was in flight) and until a sample call succeeds on the new life,
  its ring restored from the file (``running_s``; the restored size is checked).
- ``startup``: ``ray.init`` (``init_s``: once per cluster for a user), then the driver's calls to
  create the five actors until each has answered a first call (``first_s``: right after
  ``ray.init``); the actors killed and five made again (``up_s``: Ray up, the figure to put beside
  a run's start with its daemons up). Each repetition starts Ray anew.
- ``cut`` (the lost host): three Ray nodes in the network namespaces given by ``--nodes`` (``ray start
  --head --block`` in the first, ``ray start --address --block`` in the others, each node given a
  resource named after its host), this driver in the first namespace (Ray wants its driver on a
  node); two actors on the last node, one without restarts and one with ``max_restarts=1`` and a
  soft node affinity (it may come back elsewhere); after ``--settle-s`` s, the link ``--cut NS:DEV``
  set down: the seconds until the first actor's pending ``ray.get`` raises (Ray's defaults declare
  a node dead after its health checks fail: 5 misses, 3 s apart, 10 s timeout), until the second
  one's does, and until a call on the second succeeds again on another node. The link is set up
  again and every node's ``ray start`` stopped (SIGTERM, then SIGKILL) at the end; the cut-off
  node's agents and workers, which outlive it, are killed by their mark. As a user of a multi-node
  Ray on one machine must: every node and the driver share one auth token (``RAY_AUTH_TOKEN``, a
  new one), each node's object store is 500 MB (three of Ray's default, 30% of the memory, do not
  fit in /dev/shm), and the nodes start one after another (``ray start`` gives its raylet 30 s to
  register, which two at once overran on this loaded machine; a node that fails is started again,
  once).

One JSON dict is printed on stdout's last line (and written to ``--json``); progress goes to stderr.
Without Ray the dict is ``{"skipped": "<why>"}`` and the exit status 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import interruptible, names_of, positive_float, positive_int, stop_process  # noqa: E402

SECTIONS = ("kill", "restart", "startup", "cut")
ROLES = ("learner", "replay-0", "replay-1", "actor-0", "actor-1")  # bench_cluster's DQN worker groups
SHARD_CAPACITY = 25_000  # apps/dqn.py's capacity 50,000 over its 2 shards
OBS = 4  # CartPole-v1


# Set in this process's environment (or by its caller) and inherited by every Ray process it starts, local
# or in a namespace (GCS, raylets, agents, workers): how what this run started is found, and only that.
MARK = "REACTOR_RAY_PEER"


def ours(mark: str | None = None, session: int | None = None, spare: int | None = None) -> list[int]:
    """The pids of live processes, but this one and ``spare``, whose environment has ``MARK=mark``
    (default: this run's) or whose session is ``session`` (default: this process's, when it leads one).

    The session too, because the mark alone misses some: Ray's agents rename themselves
    (``ray::DashboardAgent``, by ``setproctitle``), which overwrites the environment ``/proc`` shows,
    and an agent whose raylet was killed lives on ~80 s. Every process Ray starts on this host stays
    in the session of the process that called ``ray.init``, which a caller gives the peer
    (``start_new_session=True``); a peer started from a shell does not lead its session, and then only
    the mark counts (the shell's other processes are not ours)."""
    want = f"{MARK}={mark or os.environ[MARK]}".encode()
    if session is None and mark is None and os.getsid(0) == os.getpid():
        session = os.getpid()
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if int(env.parent.name) in (os.getpid(), spare):
                continue
            with open(env.parent / "stat") as f:
                state, _, _, sid = f.read().rsplit(")", 1)[1].split()[:4]
            if state != "Z" and (int(sid) == session or want in env.read_bytes().split(b"\0")):
                found.append(int(env.parent.name))
        except (OSError, ValueError):  # (gone meanwhile, or not ours to read)
            continue
    return found


def end_ours(mark: str | None = None, session: int | None = None, timeout_s: float = 10.0,
             spare: int | None = None) -> list[int]:
    """SIGKILL what :func:`ours` finds, again until it finds nothing (a process may start between a
    look and the kills: a raylet's agent) or ``timeout_s`` passes; every pid killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while (pids := ours(mark, session, spare)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.1)
    return killed


def log(msg: str) -> None:
    print(f"[ray peer] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ the actors (plain classes;
# ray.remote wraps them once Ray is imported)


def _mlp() -> Any:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(OBS, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 2))


class EnvActor:
    """Two CartPole-v1 envs stepped with an epsilon-greedy Q-net (torch, one thread)."""

    def __init__(self, seed: int) -> None:
        import gymnasium as gym
        import torch

        torch.set_num_threads(1)
        self.envs = [gym.make("CartPole-v1") for _ in range(2)]
        self.obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(self.envs)]
        self.q = _mlp()
        self.rng = np.random.default_rng(seed)

    def pid(self) -> int:
        return os.getpid()

    def run_for(self, seconds: float, most: int = 10**9) -> dict[str, np.ndarray]:
        """Step every env in turn for ``seconds`` (or ``most`` steps each); the transitions."""
        import torch

        rows: list[tuple[np.ndarray, int, float, bool, np.ndarray]] = []
        end = time.monotonic() + seconds
        for _ in range(most):
            for i, env in enumerate(self.envs):
                if self.rng.random() < 0.1:
                    a = int(self.rng.integers(2))
                else:
                    with torch.no_grad():
                        a = int(self.q(torch.as_tensor(self.obs[i])).argmax())
                nxt, r, term, trunc, _ = env.step(a)
                rows.append((self.obs[i], a, float(r), bool(term), nxt))
                self.obs[i] = env.reset()[0] if term or trunc else nxt
            if time.monotonic() >= end:
                break
        obs, act, rew, done, nxt = zip(*rows, strict=True)
        return {"obs": np.array(obs, np.float32), "action": np.array(act, np.int64),
                "reward": np.array(rew, np.float32), "done": np.array(done, bool), "next": np.array(nxt, np.float32)}


class ReplayShard:
    """A ring of transitions; with ``checkpoint``, rewritten to that file after every insert and loaded by
    ``__init__`` when the file exists (how a Ray user makes an actor's restart keep its state)."""

    def __init__(self, capacity: int, checkpoint: str | None = None) -> None:
        self.capacity, self.checkpoint = capacity, checkpoint
        self.cols = {"obs": np.zeros((capacity, OBS), np.float32), "action": np.zeros(capacity, np.int64),
                     "reward": np.zeros(capacity, np.float32), "done": np.zeros(capacity, bool),
                     "next": np.zeros((capacity, OBS), np.float32)}
        self.size_, self.at = 0, 0
        self.rng = np.random.default_rng()
        if checkpoint and os.path.exists(checkpoint):
            with np.load(checkpoint) as f:
                self.size_, self.at = int(f["size"]), int(f["at"])
                for k in self.cols:
                    self.cols[k][: self.size_] = f[k]

    def pid(self) -> int:
        return os.getpid()

    def size(self) -> int:
        return self.size_

    def insert(self, batch: dict[str, np.ndarray]) -> int:
        n = len(batch["action"])
        idx = (self.at + np.arange(n)) % self.capacity
        for k, col in self.cols.items():
            col[idx] = batch[k]
        self.at, self.size_ = (self.at + n) % self.capacity, min(self.size_ + n, self.capacity)
        if self.checkpoint:
            tmp = f"{self.checkpoint}.tmp.npz"
            np.savez(tmp, size=self.size_, at=self.at, **{k: c[: self.size_] for k, c in self.cols.items()})
            os.replace(tmp, self.checkpoint)
        return self.size_

    def sample(self, n: int) -> dict[str, np.ndarray] | None:
        if self.size_ < n:
            return None
        idx = self.rng.integers(self.size_, size=n)
        return {k: c[idx] for k, c in self.cols.items()}


class Learner:
    """Double-DQN updates on sampled batches (torch, one thread)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.q, self.target = _mlp(), _mlp()
        self.target.load_state_dict(self.q.state_dict())
        self.opt = torch.optim.Adam(self.q.parameters(), lr=1e-3)
        self.updates = 0

    def pid(self) -> int:
        return os.getpid()

    def update(self, b: dict[str, np.ndarray]) -> int:
        import torch

        obs, nxt = torch.as_tensor(b["obs"]), torch.as_tensor(b["next"])
        with torch.no_grad():
            best = self.q(nxt).argmax(1, keepdim=True)
            y = torch.as_tensor(b["reward"]) + 0.99 * (~torch.as_tensor(b["done"])) * self.target(nxt).gather(1, best)[:, 0]
        q = self.q(obs).gather(1, torch.as_tensor(b["action"])[:, None])[:, 0]
        loss = torch.nn.functional.smooth_l1_loss(q, y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.updates += 1
        if self.updates % 100 == 0:
            self.target.load_state_dict(self.q.state_dict())
        return self.updates


# ------------------------------------------------------------------------------ Ray, always shut down


class RayPeer:
    """Ray's remote classes and the five actors; ``close()`` shuts Ray down."""

    def __init__(self, ray: Any, tmp: Path, address: str | None = None, node_ip: str | None = None) -> None:
        self.ray = ray
        t0 = time.monotonic()
        if address is None:
            # One logical CPU per actor: Ray's default (this machine's cores) leaves the others pending.
            ray.init(num_cpus=len(ROLES), include_dashboard=False, logging_level="ERROR", log_to_driver=False,
                     _temp_dir=str(tmp / "ray"))
        else:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, _node_ip_address=node_ip)
        self.init_s = time.monotonic() - t0
        self.Env, self.Shard, self.Learner = (ray.remote(c) for c in (EnvActor, ReplayShard, Learner))

    def start(self, checkpoint: str | None = None) -> tuple[dict[str, Any], float]:
        """The five actors, each having answered a first call; the seconds from the first create call."""
        t0 = time.monotonic()
        actors = {"learner": self.Learner.remote(),
                  "replay-0": self.Shard.options(max_restarts=1 if checkpoint else 0, max_task_retries=0).remote(
                      SHARD_CAPACITY, checkpoint),
                  "replay-1": self.Shard.remote(SHARD_CAPACITY),
                  "actor-0": self.Env.remote(0), "actor-1": self.Env.remote(100)}
        self.ray.get([a.pid.remote() for a in actors.values()], timeout=300)
        return actors, time.monotonic() - t0

    def train(self, actors: dict[str, Any], seconds: float) -> int:
        """The driver's DQN loop for ``seconds``: rollouts to the shards, batches to the learner; the updates."""
        ray, shards = self.ray, (actors["replay-0"], actors["replay-1"])
        envs, k, updates = (actors["actor-0"], actors["actor-1"]), 0, 0
        end = time.monotonic() + seconds
        rollouts = {e.run_for.remote(0.05): e for e in envs}
        while time.monotonic() < end:
            done, _ = ray.wait(list(rollouts), num_returns=1, timeout=60)
            if not done:
                raise RuntimeError("no rollout came back within 60 s")
            env = rollouts.pop(done[0])
            ray.get(shards[k % 2].insert.remote(done[0]))
            k += 1
            rollouts[env.run_for.remote(0.05)] = env
            batch = ray.get(shards[k % 2].sample.remote(128))
            if batch is not None:
                updates = ray.get(actors["learner"].update.remote(batch))
        ray.get(list(rollouts), timeout=60)
        return updates

    def kill(self, actors: dict[str, Any]) -> None:
        for a in actors.values():
            self.ray.kill(a)

    def close(self) -> None:
        self.ray.shutdown()


def kill_rep(peer: RayPeer, settle_s: float) -> dict[str, Any]:
    actors, _ = peer.start()
    try:
        updates = peer.train(actors, settle_s)
        victim = peer.ray.get(actors["actor-1"].pid.remote())
        pending = actors["actor-1"].run_for.remote(120.0)
        time.sleep(0.2)  # (the call is running in the actor)
        at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        try:
            peer.ray.get(pending, timeout=120)
            raise RuntimeError("actor-1's call returned after its process was killed")
        except peer.ray.exceptions.GetTimeoutError:
            raise RuntimeError("actor-1's pending call neither raised nor returned within 120 s of the kill") from None
        except peer.ray.exceptions.RayActorError as e:
            s = time.monotonic() - at
            return {"s": s, "error_type": type(e).__name__, "updates": updates}
    finally:
        peer.kill(actors)


def restart_rep(peer: RayPeer, tmp: Path, settle_s: float) -> dict[str, Any]:
    checkpoint = str(tmp / f"replay-0-{time.monotonic_ns()}.npz")
    actors, _ = peer.start(checkpoint)
    shard = actors["replay-0"]
    try:
        updates = peer.train(actors, settle_s)
        size = peer.ray.get(shard.size.remote())
        victim = peer.ray.get(shard.pid.remote())
        killed = threading.Event()
        at = [0.0]

        def kill_soon() -> None:
            time.sleep(0.2)
            at[0] = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            killed.set()

        threading.Thread(target=kill_soon, daemon=True).start()
        detected = running = error = None
        deadline = time.monotonic() + 120
        while running is None:  # the learner's sample calls, one in flight
            if time.monotonic() > deadline:
                raise RuntimeError("replay-0 did not answer within 120 s of its kill")
            try:
                peer.ray.get(shard.sample.remote(128), timeout=120)
                answered = time.monotonic()
                if killed.is_set() and peer.ray.get(shard.pid.remote()) != victim:
                    running = answered - at[0]
            except peer.ray.exceptions.RayActorError as e:
                if detected is None and killed.is_set():
                    detected, error = time.monotonic() - at[0], type(e).__name__
        restored = peer.ray.get(shard.size.remote())
        return {"detected_s": detected, "error_type": error, "running_s": running, "checkpointed": size, "restored": restored,
                "updates": updates}
    finally:
        peer.kill(actors)


# ------------------------------------------------------------------------------ the lost host


def cut_rep(ray: Any, tmp: Path, nodes: list[tuple[str, str, str]], cut: tuple[str, str],
            settle_s: float) -> dict[str, Any]:
    """Ray nodes in ``nodes`` (host, namespace, ip; this process in the first's namespace), two actors on
    the last; the link ``cut`` (namespace, device) set down; what the driver saw."""
    port = 6379
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    peer = None
    try:
        def start_node(i: int) -> subprocess.Popen[bytes]:
            host, ns, ip = nodes[i]
            # (an object store of 500 MB a node: three of Ray's default, 30% of the memory each, do not fit
            # in this one machine's /dev/shm beside the rest; these actors move a few MB)
            cmd = ["start", "--block", "--disable-usage-stats", f"--node-ip-address={ip}", "--num-cpus=2",
                   f"--resources={json.dumps({host: 1})}", f"--object-store-memory={500 * 2**20}"]
            cmd += (["--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={tmp / 'ray'}"] if i == 0
                    else [f"--address={nodes[0][2]}:{port}"])
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, str(Path(sys.executable).parent / "ray"), *cmd],
                                          stdout=sys.stderr, stderr=sys.stderr, env=env))
            return procs[-1]

        _wait_port(nodes[0][2], port, start_node(0), 120)  # the head's GCS up before anyone dials it
        peer = RayPeer(ray, tmp, address=f"{nodes[0][2]}:{port}", node_ip=nodes[0][2])
        # The other nodes one at a time: `ray start` gives its raylet 30 s to register (Ray's constant),
        # which several starting at once on a loaded machine can overrun; one that does is started again.
        for i in range(1, len(nodes)):
            for attempt in (1, 2):
                proc, deadline = start_node(i), time.monotonic() + 120
                while len([n for n in ray.nodes() if n["Alive"]]) <= i and proc.poll() is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                if len([n for n in ray.nodes() if n["Alive"]]) > i:
                    break
                log(f"Ray node {nodes[i][0]} did not come up (try {attempt} of 2; its output is above)")
                if attempt == 2:
                    for f in sorted((tmp / "ray").glob("session_*/logs/raylet*.out")):  # why, for the log
                        log(f"{f.name}'s last lines:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
                    raise RuntimeError(f"Ray node {nodes[i][0]} did not come up twice (their output is above)")
                stop_process(proc, group=False, grace_s=30)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        last = nodes[-1][0]
        node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and last in n["Resources"])
        plain = peer.Env.options(resources={last: 0.1}).remote(0)
        again = peer.Env.options(max_restarts=1, max_task_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id, soft=True)).remote(100)
        pids = ray.get([plain.pid.remote(), again.pid.remote()], timeout=120)
        ray.get([plain.run_for.remote(settle_s), again.run_for.remote(settle_s)], timeout=120 + settle_s)
        pending = {"plain": plain.run_for.remote(600.0), "again": again.run_for.remote(600.0)}
        time.sleep(0.2)
        at = time.monotonic()
        out: dict[str, Any] = {"pids": pids}
        try:  # (the link comes up again on every way out, the set-down's own failure or timeout included)
            subprocess.run(["ip", "-n", cut[0], "link", "set", cut[1], "down"], check=True, timeout=30)
            for name, ref in pending.items():
                try:
                    ray.get(ref, timeout=max(1.0, at + 180 - time.monotonic()))
                    out[f"{name}_s"] = None
                except ray.exceptions.GetTimeoutError:
                    out[f"{name}_s"] = None
                except ray.exceptions.RayActorError as e:
                    out[f"{name}_s"], out[f"{name}_error"] = time.monotonic() - at, type(e).__name__
            deadline = at + 180
            while out.get("again_s") is not None and time.monotonic() < deadline:
                try:
                    ray.get(again.pid.remote(), timeout=max(1.0, deadline - time.monotonic()))
                    out["again_running_s"] = time.monotonic() - at
                    break
                except ray.exceptions.RayActorError:
                    time.sleep(0.05)
        finally:
            subprocess.run(["ip", "-n", cut[0], "link", "set", cut[1], "up"], check=False, timeout=30)
        return out
    finally:
        if peer is not None:
            peer.close()
        for p in reversed(procs):  # ray start --block stops its node's processes on SIGTERM
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            stop_process(p, group=False, grace_s=30)
        left = end_ours()  # a cut-off node's agents and workers outlive its `ray start`
        if left:
            log(f"killed {len(left)} Ray processes the cut-off node's `ray start` left: {left}")


def _wait_port(ip: str, port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((ip, port)) == 0:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"Ray's head did not listen on {ip}:{port} within {timeout_s:g} s (its output is above)")
        time.sleep(0.2)


# ------------------------------------------------------------------------------ main


# How long a signalled peer has to shut Ray down and end; past it, _overdue ends what is left. An
# interrupted run normally ends within 7 s here (2 cores, 3 busy loops beside it).
STOP_S = 45.0
_TMP: list[Path] = []  # this run's temporary directory, for _overdue
# The peer's pid, taken at import: before interruptible forks its guard process, which runs _overdue too.
_PEER = os.getpid()


def _overdue() -> None:
    """Ended from interruptible's thread (the main thread stuck: in ``ray.shutdown()``, or in a C call
    the signal never left) or from its guard process (the interpreter held): this run's Ray processes
    killed and named, its temporary directory removed. By the peer's session as well as the mark, in
    the guard too, which does not lead that session (an agent's new name hides its mark: by the mark
    alone, 1 CI run in many left DashboardAgent and RuntimeEnvAgent running); the guard spares the peer,
    which it ends itself after this."""
    left = end_ours(session=_PEER if os.getsid(0) == _PEER else None, spare=_PEER)
    os.write(2, f"[ray peer] killed {len(left)} Ray processes left after a stop that did not end: {left}\n"
             .encode())
    for tmp in _TMP:
        shutil.rmtree(tmp, ignore_errors=True)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _nodes(text: str) -> list[tuple[str, str, str]]:
    try:
        out = [(h, ns, ip) for h, rest in (x.split("=", 1) for x in text.split(",")) for ns, ip in [rest.split("@")]]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects HOST=NAMESPACE@IP,... (at least two), got {text!r}") from None
    if len(out) < 2:
        raise argparse.ArgumentTypeError(f"expects HOST=NAMESPACE@IP,... (at least two), got {text!r}")
    return out


def _link(text: str) -> tuple[str, str]:
    ns, _, dev = text.partition(":")
    if not ns or not dev:
        raise argparse.ArgumentTypeError(f"expects NAMESPACE:DEVICE, got {text!r}")
    return ns, dev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="kill,restart,startup", type=names_of(SECTIONS),
                    help=f"comma-separated, from {','.join(SECTIONS)} (default: kill,restart,startup)")
    ap.add_argument("--reps", type=positive_int, default=1, help="repetitions of each section (default 1)")
    ap.add_argument("--settle-s", type=positive_float, default=3.0,
                    help="training before the kill / the cut (default 3 s)")
    ap.add_argument("--nodes", type=_nodes, default=None, help="cut: HOST=NAMESPACE@IP,... (the first: this one's)")
    ap.add_argument("--cut", type=_link, default=None, help="cut: NAMESPACE:DEVICE, the link to set down")
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    if "cut" in args.only and (args.nodes is None or args.cut is None):
        ap.error("--only cut needs --nodes and --cut")
    signal.signal(signal.SIGTERM, _terminate)  # through the finally blocks: Ray shut down
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if "cut" in args.only:  # every node and the driver given the cluster's token, as Ray's token-auth docs say
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    try:
        import ray
    except Exception as e:  # noqa: BLE001 - reported in one line
        why = (f"not installed (no module {e.name!r})" if isinstance(e, ModuleNotFoundError)
               else f"did not load ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
        out: dict[str, Any] = {"skipped": why}
        log(f"Ray peer skipped: {why}")
    else:
        out = {"ray": ray.__version__}
        with tempfile.TemporaryDirectory(prefix="rayp-") as tmp_s:  # (short: Ray's socket paths live under it)
            tmp = Path(tmp_s)
            _TMP.append(tmp)
            try:
                for section in args.only:
                    reps: list[dict[str, Any]] = []
                    for i in range(args.reps):
                        if section == "cut":
                            reps.append(cut_rep(ray, tmp, args.nodes, args.cut, args.settle_s))
                        else:
                            peer = RayPeer(ray, tmp)
                            try:
                                if section == "kill":
                                    reps.append(kill_rep(peer, args.settle_s))
                                elif section == "restart":
                                    reps.append(restart_rep(peer, tmp, args.settle_s))
                                else:
                                    first = peer.start()
                                    peer.kill(first[0])
                                    up = peer.start()
                                    peer.kill(up[0])
                                    reps.append({"init_s": peer.init_s, "first_s": first[1], "up_s": up[1]})
                            finally:
                                peer.close()
                        log(f"{section} rep {i + 1}: {json.dumps(reps[-1])}")
                    out[section] = reps
            finally:  # (also after an error or Ctrl-C)
                ray.shutdown()
                left = end_ours()
                if left:
                    log(f"killed {len(left)} Ray processes left after ray.shutdown(): {left}")
        for section in args.only:
            for key in ("s", "detected_s", "running_s", "init_s", "first_s", "up_s", "plain_s", "again_s",
                        "again_running_s"):
                xs = [r[key] for r in out[section] if r.get(key) is not None]
                if xs:
                    out.setdefault("median", {}).setdefault(section, {})[key] = statistics.median(xs)
    text = json.dumps(out)
    if args.json:
        Path(args.json).write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    os.environ.setdefault(MARK, secrets.token_hex(8))  # (here: the guard interruptible forks needs it too)
    interruptible(main, "ray_peer.py", stop_s=STOP_S, overdue=_overdue)
