"""EnvActor: steps gymnasium environments with the newest weights and streams what it saw.

One actor steps ``num_envs`` environments side by side (a gymnasium vector env) and acts for all of
them with one batched call of the algorithm's ``act`` fragment. Off-policy algorithms: every step
goes to a :class:`~reactor.nodes.writer.Writer`, which cuts items by the algorithm's read kind and
flushes whole episodes or chunks to a replay shard (one message per flush). On-policy algorithms
(PPO): the actor collects ``rollout_length`` steps, sends them to the learner as one
:class:`Rollout`, and waits for the weights that learned from it (synchronous, as PPO wants; the
first rollout waits for the learner's first weights). A rollout carries ``final_obs``: the
observation an episode ended on, where it ended (a truncated episode bootstraps from its value).

**Logical time.** Each vector step is one event, ``step_s`` of logical time after the previous one
(a self-scheduled action). In deterministic mode this is what orders an actor's steps against the
learner's weight broadcasts, so a run is identical under every placement; in async mode the actor
steps as fast as the CPU allows. Weights apply from the first step after they arrive.

**Exploration** comes from the algorithm's ``act(policy, obs, step, generator)``: ``step`` is this
actor's env-step count and ``generator`` its own seeded ``torch.Generator``. Actors may explore
differently: ``explore_scale`` multiplies the step count the schedule sees (an actor with scale
0.5 anneals its exploration twice as slowly). With a ``run_dir``, the schedule goes on over the actor's
lives: it writes the env steps its schedule has seen to ``RUN_DIR/<name>.progress.json`` (``actor-0...``)
at each report, and a restarted actor (``restarts`` > 0) or a resumed run's (``resume``) starts its
schedule from there. (A resumed DQN explored at epsilon 1.0 again, and a resumed TD3 took its
``learning_starts`` random steps again.) The same file keeps the env steps of this run's lives, and a
restarted actor's ``max_env_steps`` counts them (a restarted actor used to take its whole share again:
37,000 env steps in a run of max_env_steps 30,000); a resumed run's budget is on top of the old run's.
Its ``env_steps`` in reports count them too, so Metrics counts only what a new life adds (a report
lost in flight when a life was killed is counted then; without a run directory a new life counts
from 0, and Metrics counts it whole).
"""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path
from typing import Any

import numpy as np

from .._files import read_small_json, replace_small
from .._floodlog import FloodCounts, flood_logged, flood_tally
from .._graph import plain_name
from .._reactor import Action, Input, Output, Reactor, peer_lost, peer_restarted, reaction, shutdown, startup
from .._runclaim import claim_run_dir, release_run_dir
from ._contract import check_act, check_config
from ._registry import denormals_flushed
from ._staging import take_ack
from .messages import InsertAck, Steps
from .train_messages import Report, Rollout, Weights
from .writer import TransitionPattern, WindowPattern, Writer

__all__ = ["EnvActor"]


def writer_pattern(read: Any) -> WindowPattern | TransitionPattern:
    """How an actor's Writer cuts its streams for a table that reads ``read`` (the algorithm's
    ``store(...).read``): windows for a ``WindowRead``, n-step transitions otherwise."""
    if type(read).__name__ == "WindowRead":
        return WindowPattern(read.length, read.pad)
    return TransitionPattern(getattr(read, "n", 1))


class EnvActor(Reactor):
    """Steps ``num_envs`` gymnasium environments with an algorithm's ``act`` fragment.

    Ports:
        weights: newest policy weights (from the learner); applied from the next step.
        acks: :class:`InsertAck` from the shards (connected back with ``key=writer_key``), counted
            against ``max_unacked``.
        steps: :class:`Steps` for the replay shards (off-policy), keyed by shard.
        rollouts: :class:`Rollout` for the learner (on-policy).
        report: :class:`Report` (``env_steps``, ``episodes``, ``episode_return``, ``version``).

    Args:
        algo: algorithm name (``reactor.algos``).
        env: environment name (``reactor.algos.envs``).
        algo_config: overrides of the algorithm's Config.
        num_envs: environments stepped side by side.
        num_shards: the replay bank's size (off-policy).
        colocated_shard: send every flush to this shard (the actor's own, under ``colocated``); None:
            round-robin over the shards.
        step_s: logical time between two vector steps.
        flush_steps: rows per writer flush (one message each).
        report_every: vector steps between two reports.
        max_env_steps: this actor stops stepping after this many env steps (None: never); then
            (off-policy) its writer sends what is ready and an end marker to every shard
            (``Writer.end``), so shards that count their writers know no insert will come.
        explore_scale: factor on the step count the exploration schedule sees.
        max_unacked: off-policy flow control: stop stepping while every shard it may write to holds
            this many of its Steps messages unacknowledged (connect ``acks``; the writer skips full
            shards), so a rate limiter holding inserts back holds this actor
            back instead of letting the shards park its steps without bound.
            None: no flow control (``acks`` need not be connected).
        run_dir: where the exploration schedule's progress is kept over the actor's lives ("": not kept).
        resume: the run goes on from its run directory's checkpoints: the schedule from where it was.
    """

    placement_role = "actor"

    weights = Input(Weights)
    acks = Input(InsertAck)
    steps = Output(Steps)
    rollouts = Output(Rollout)
    report = Output(Report)
    tick = Action()

    def __init__(
        self,
        algo: str,
        env: str,
        algo_config: dict[str, Any] | None = None,
        *,
        num_envs: int = 1,
        num_shards: int = 1,
        colocated_shard: bool = False,
        step_s: float = 1e-6,
        flush_steps: int = 256,
        report_every: int = 250,
        max_env_steps: int | None = None,
        explore_scale: float = 1.0,
        max_unacked: int | None = None,
        run_dir: str = "",
        resume: bool = False,
    ) -> None:
        for what, v in (("num_envs", num_envs), ("num_shards", num_shards), ("flush_steps", flush_steps),
                        ("report_every", report_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EnvActor {what} must be an int >= 1, got {v!r}")
        if isinstance(step_s, bool) or not isinstance(step_s, numbers.Real) or not step_s > 0:
            raise ValueError(f"EnvActor step_s must be a number of seconds > 0, got {step_s!r:.100}")
        if max_unacked is not None and (isinstance(max_unacked, bool) or not isinstance(max_unacked, int)
                                        or max_unacked < 1):
            raise ValueError(f"EnvActor max_unacked must be None or an int >= 1, got {max_unacked!r}")
        self.algo_name = algo
        self.env_name = env
        self.algo_config = dict(algo_config or {})
        self.num_envs = num_envs
        self.num_shards = num_shards
        self.colocated_shard = colocated_shard
        self.step_s = step_s
        self.flush_steps = flush_steps
        self.report_every = report_every
        self.max_env_steps = max_env_steps
        self.explore_scale = explore_scale
        self.max_unacked = max_unacked
        self.run_dir = run_dir
        self.resume = resume
        self.explore_base = 0  # env steps an earlier life's schedule saw (RUN_DIR/<name>.progress.json)
        self.run_base = 0  # env steps this run's earlier lives of this actor took (the same file)
        self._rollout_version: int | None = None  # on-policy: the weights version of the last rollout sent
        self._resent_version: int | None = None  # ... by this actor's last life (a restart: see take_weights)
        self._progress_failed = False
        self.held = False  # stepping paused by flow control
        self._bad_acks = FloodCounts()  # (take_ack: malformed ones dropped, logged by the flood rule)
        self.env_steps = 0
        self.episodes = 0
        self.version = -1
        self.waiting_for: int | None = None  # on-policy: the weights version we wait for

    # ---------------------------------------------------------------- startup

    @reaction(triggers=[startup], effects=[tick])
    def open_envs(self) -> None:
        import torch

        from ._registry import configure_torch, load_algorithm, make_vector_env

        configure_torch()
        self.algo = algo = load_algorithm(self.algo_name)
        self.config = algo.Config.from_dict(self.algo_config)
        self.env = make_vector_env(self.env_name, self.num_envs)
        obs_space, act_space = self.env.single_observation_space, self.env.single_action_space
        with torch.random.fork_rng():  # the policy's initial weights: seeded, and no one else's stream moves
            torch.manual_seed(int(self.rng.integers(2**63 - 1)))
            self.policy = algo.make_policy(obs_space, act_space, self.config)
        self.obs, _ = self.env.reset(seed=int(self.rng.integers(2**31)))
        self.ep_return = np.zeros(self.num_envs)
        self.recent_returns: list[float] = []
        self.on_policy = algo.KIND == "on_policy"
        self._act_checked = False  # (what act returns is checked on its first call: _contract)
        if self.on_policy:
            check_config(algo, self.config)  # (a rollout_length of 0 was collected as 1 step)
            self.rollout_length = self.config.rollout_length
            self.buf: dict[str, list[Any]] = {}
            self.waiting_for = 0  # the first rollout is collected with the learner's first weights
        else:
            spec = algo.store(obs_space, act_space, self.config)
            self.writer = Writer(
                [(n, tuple(shape), dtype) for n, shape, dtype in spec.fields],
                self.num_envs,
                writer_pattern(spec.read),
                num_shards=self.num_shards,
                writer_id=self.bank_index,
                shard=self.bank_index % self.num_shards if self.colocated_shard else None,
                max_unacked=self.max_unacked,
                flush_steps=self.flush_steps,
                first_seq=self.restarts << 32,  # (acks of an earlier life's messages then count for nothing)
            )
        if self.run_dir:
            self._run_claim = claim_run_dir(self.run_dir, self.run_id, resume=self.resume,
                                            who=self.name)
            self.progress = Path(self.run_dir) / f"{plain_name(self.name)}.progress.json"
            if self.resume or self.restarts > 0:
                saved = _saved_progress(self.progress)
                self.explore_base = saved["explore_steps"]
                if self.restarts > 0 and saved["run_id"] == self.run_id:  # (not a resumed run's, nor another's)
                    self.run_base = saved["run_steps"]
                    self._resent_version = saved["rollout_version"]
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        if self.waiting_for is None:
            self.tick.schedule(delay_s=self.step_s)

    # ---------------------------------------------------------------- weights

    @reaction(triggers=[weights], effects=[tick])
    def take_weights(self, weights: Weights) -> None:
        if weights.version <= self.version:
            return
        self.algo.load_weights(self.policy, weights.tensors)
        self.version = weights.version
        if self._resent_version is not None:
            # A restarted on-policy actor collects again the rollouts of versions its last life had sent
            # but the learner had not learned on yet (it sends its weights again when the actor is back):
            # their steps are not counted twice against the budget.
            again = self._resent_version - weights.version + 1
            if self.on_policy and again > 0:
                self.run_base = max(0, self.run_base - again * self.rollout_length * self.num_envs)
            self._resent_version = None
        if self.waiting_for is not None and weights.version >= self.waiting_for:
            self.waiting_for = None
            self.tick.schedule(delay_s=self.step_s)

    @reaction(triggers=[acks], effects=[tick])
    def take_ack(self, acks: InsertAck) -> None:
        if not hasattr(self, "writer"):  # on-policy actors have no writer: nothing to count
            return
        shard = acks.shard
        if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < self.writer.num_shards:
            # A peer's malformed word: dropped and logged, as a shard does a bad message (Writer.acknowledged's
            # ValueError ended the run as a refusal of what its user had given it).
            n = self._bad_acks.hit("shard")
            if flood_logged(n):
                logging.getLogger("reactor.actor").warning(
                    "%s dropped an InsertAck naming shard %r, outside [0, %d)%s", self.name, shard,
                    self.writer.num_shards, flood_tally(n))
            return
        take_ack(self.writer, shard, acks.seq, acks.host, acks.pid, self.run_id, self.name, self.max_unacked)
        if self.held and not self._over_limit():
            self.held = False
            self.tick.schedule(delay_s=self.step_s)

    @reaction(triggers=[peer_lost, peer_restarted], effects=[tick, steps])
    def peers_changed(self) -> None:
        """A shard's or the learner's process died or came back (restart policies, async runs).
        Shards: write to the others meanwhile; resume stepping if that was all that held this
        actor. The learner: take its weights again whatever their version (it resumed from its
        checkpoint, which may be older than the weights this actor holds)."""
        change = self.peer_change
        if change is None:
            return
        if change.event == "peer_restarted" and change.indices("weights"):
            self.version = -1
            if self.waiting_for is not None:  # (on-policy: a learner back from an older checkpoint never
                self.waiting_for = 0          # sends the version waited for; the weights it sends will do)
        if not hasattr(self, "writer"):
            return
        for shard in change.indices("steps"):
            if change.event == "peer_restarted":
                for m in self.writer.shard_restarted(shard):  # (its end marker again, once it has ended)
                    self.steps.send(m)
            else:
                self.writer.shard_lost(shard)
        if self.held and not self._over_limit():
            self.held = False
            self.tick.schedule(delay_s=self.step_s)

    def _over_limit(self) -> bool:
        """Every shard this actor may write to holds max_unacked of its messages unacknowledged."""
        return not self.on_policy and self.writer.full()

    # ---------------------------------------------------------------- stepping

    @reaction(triggers=[tick], effects=[tick, steps, rollouts, report])
    def step(self) -> None:
        import torch

        if self.waiting_for is not None:
            return
        if self.max_env_steps is not None and self.run_base + self.env_steps >= self.max_env_steps:
            if not self.on_policy:  # what is ready goes out (open episodes stay incomplete), then the end markers
                for m in self.writer.end():
                    self.steps.send(m)
            self._report()
            return
        obs = self.obs
        explore_step = int((self.explore_base + self.env_steps) * self.explore_scale)
        with torch.no_grad(), denormals_flushed():
            acted = self.algo.act(self.policy, torch.as_tensor(obs), explore_step, self.torch_rng)
        if not self._act_checked:
            check_act(self.algo, acted, self.num_envs, self.env.single_action_space)
            self._act_checked = True
        action, extras = acted
        act_np = action.numpy()
        next_obs, reward, terminated, truncated, info = self.env.step(act_np)
        ended = terminated | truncated
        self.env_steps += self.num_envs
        self.ep_return += reward
        if self.on_policy:
            final_obs = np.zeros_like(next_obs)  # the obs an episode ended on (truncations bootstrap from it)
            if ended.any():
                final_obs[ended] = np.stack(info["final_obs"][ended])
            self._collect(obs, act_np, reward, terminated, truncated, extras, next_obs, final_obs)
        else:
            final = None
            if ended.any():
                final_obs = next_obs.copy()
                final_obs[ended] = np.stack(info["final_obs"][ended])
                final = {"obs": final_obs}
            step = {"obs": obs, "action": act_np, "reward": reward}
            for k, v in extras.items():
                step[k] = v.numpy()
            for m in self.writer.append(step, terminated=terminated, truncated=truncated, final=final):
                self.steps.send(m)
        if ended.any():
            done = np.flatnonzero(ended)
            self.episodes += len(done)
            self.recent_returns.extend(self.ep_return[done].tolist())
            self.recent_returns = self.recent_returns[-20:]
            self.ep_return[done] = 0.0
            if hasattr(self.algo, "reset"):
                self.algo.reset(self.policy, ended)
        self.obs = next_obs
        if (self.env_steps // self.num_envs) % self.report_every == 0:
            self._report()
        if self._over_limit():
            self.held = True  # take_ack resumes
        elif self.waiting_for is None:
            self.tick.schedule(delay_s=self.step_s)

    def _report(self) -> None:
        values = {"env_steps": float(self.run_base + self.env_steps), "episodes": float(self.episodes),
                  "version": float(self.version)}
        if self.recent_returns:
            values["episode_return"] = float(np.mean(self.recent_returns))
        self.report.send(Report(self.name, values))
        if self.run_dir:
            try:
                replace_small(self.progress, json.dumps({
                    "format": 1, "explore_steps": self.explore_base + self.env_steps,
                    "run_steps": self.run_base + self.env_steps, "run_id": self.run_id,
                    "rollout_version": self._rollout_version, **self._sent()}).encode())
            except OSError as e:
                if not self._progress_failed:  # (once: it is tried at every report)
                    self._progress_failed = True
                    logging.getLogger("reactor.actor").warning(
                        "%s: cannot save %s (a restart of this actor will explore from its schedule's start): %s",
                        self.name, self.progress, e)

    def _staging(self) -> Any:
        """The writer's staging region (reactor.nodes._staging), or None (none yet, or no writer)."""
        writer = getattr(self, "writer", None)
        return None if writer is None else writer.staging

    def _sent(self) -> dict[str, int]:
        """What this life sent its shards, for its progress file (read by no restart): ``Steps`` messages
        and rows, and those of them it staged in shared memory (reactor/nodes/_staging.py)."""
        writer, staging = getattr(self, "writer", None), self._staging()
        return {"sent_messages": 0 if writer is None else writer.seq - writer.first_seq,
                "sent_rows": 0 if writer is None else writer.steps_sent,
                "staged_messages": 0 if staging is None else int(staging.staged_messages),
                "staged_rows": 0 if staging is None else int(staging.staged_rows)}

    def _collect(self, obs: np.ndarray, action: np.ndarray, reward: np.ndarray, terminated: np.ndarray,
                 truncated: np.ndarray, extras: dict[str, Any], next_obs: np.ndarray,
                 final_obs: np.ndarray) -> None:
        import torch

        row = {"obs": obs, "action": action, "reward": reward.astype(np.float32),
               "terminated": terminated, "truncated": truncated, "final_obs": final_obs}
        row.update({k: v.numpy() for k, v in extras.items()})
        for k, v in row.items():
            self.buf.setdefault(k, []).append(np.asarray(v))
        if len(self.buf["obs"]) < self.rollout_length:
            return
        data = {k: torch.as_tensor(np.stack(v)) for k, v in self.buf.items()}
        data["last_obs"] = torch.as_tensor(next_obs)
        self.buf = {}
        self.rollouts.send(Rollout(self.bank_index, self.version, data))
        self._rollout_version = self.version
        self.waiting_for = self.version + 1
        self._report()  # exact env-step counts at each update (Metrics logs evaluations against them)


    @reaction(triggers=[shutdown])
    def give_up_run_dir(self) -> None:
        try:
            staging = self._staging()
            if staging is not None:
                staging.close()
        finally:
            release_run_dir(self)

def _saved_progress(path: Path) -> dict[str, Any]:
    """What an earlier life saved in ``path`` (:meth:`EnvActor._report`): ``explore_steps`` (the env
    steps its exploration schedule saw), ``run_steps`` (those its run's lives took), ``run_id`` (that
    run's) and ``rollout_version`` (on-policy: the weights version of its last rollout sent). None or 0
    where there is no such file, and with a warning where it is not one of that shape (a file of before
    ``run_steps``: none of them)."""
    none: dict[str, Any] = {"explore_steps": 0, "run_steps": 0, "run_id": None, "rollout_version": None}
    if not path.exists():
        return none
    try:
        data = read_small_json(path)
        if not isinstance(data, dict) or data.get("format") != 1:
            raise ValueError(f"{path}: not an actor's progress file (format 1)")
        got = {**none, **{k: data[k] for k in none if k in data}}
        ints = (got["explore_steps"], got["run_steps"]) + (() if got["rollout_version"] is None else (got["rollout_version"],))
        if any(type(v) is not int or not 0 <= v < 2**53 for v in ints) or not (
                got["run_id"] is None or type(got["run_id"]) is str):
            raise ValueError(f"{path}: not an actor's progress file (format 1 with explore_steps and run_steps, "
                             f"ints >= 0)")
    except (OSError, ValueError) as e:
        logging.getLogger("reactor.actor").warning("exploration starts from its schedule's start: %s", e)
        return none
    return got
