"""The configs of the standard apps (``apps/*.py``): every field settable with ``--set``, the env by id.

An app file declares ``ALGO``, ``PRESETS`` (``reactor.nodes.presets``) and ``class
Config(OffPolicyAppConfig)`` or ``(OnPolicyAppConfig)``, redeclaring the fields whose defaults it
changes, and builds with :func:`off_policy_app_graph` / :func:`on_policy_app_graph`. When the config
is made from ``--set`` values (``reactor.launch._app.make_config``), the preset of the chosen ``env``
goes under them, and a key that is a field of the algorithm's Config (``lr=3e-4``) goes into
``algo_config``.

``env`` is any registered gymnasium id, or ``"module:Id"`` for an env that ``module`` registers when
imported (gymnasium imports it; every worker does the same, so the module must be importable where
the workers run: installed, on ``PYTHONPATH``, or beside the app file, whose directory is on the
path of every process that loads it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._graph import Graph
from .replay_client import REMOTE_READS
from .training import off_policy_graph, on_policy_graph

__all__ = ["AppConfig", "OffPolicyAppConfig", "OfflineAppConfig", "OnPolicyAppConfig", "off_policy_app_graph",
           "offline_app_graph", "on_policy_app_graph"]


@dataclass(frozen=True)
class AppConfig:
    """What every standard app's Config has: the env, the stop conditions, the algorithm's fields, the
    run directory and checkpoints, the display."""

    env: str = ""
    """The environment: a gymnasium id (``CartPole-v1``) or ``module:Id`` (an env that module registers)."""
    target_return: float | None = None
    """Stop when an evaluation (10 episodes) reaches this mean return (None: run to max_env_steps;
    only a step budget ends a run at the same point under every placement). The env's preset sets it."""
    max_env_steps: int = 100_000
    """Stop after this many env steps in all."""
    algo_config: dict = field(default_factory=dict)
    """The algorithm's Config fields (over the env's preset); --set lr=1e-3 puts lr here too."""
    run_dir: str = ""
    """Where logs, checkpoints, config.json and the plot go (default runs/<app>-<env>-RUN_ID)."""
    checkpoint_every: int = 0
    """Learner updates between checkpoints of weights and optimizer state (0: only at the end)."""
    resume: bool = False
    """Start the learner (and the replay shards, off-policy) from their checkpoints in run_dir when they
    exist (give the old run's run_dir)."""
    live: bool = True
    """Show live progress."""
    device: str = "cpu"
    """Where the learner's networks, optimizers and batches live: cpu, cuda (replica i of dp-learners on GPU
    i mod count) or cuda:N. Actors and the evaluator act on the CPU with host copies of the weights."""
    compile: str = "auto"
    """How the learner runs its learn fragment: auto (on a GPU, torch.compile when measured faster on the run's
    first batches; eager on the CPU), on (always compiled) or off (eager)."""

    @classmethod
    def algorithm_fields(cls, algo: str) -> set[str]:
        """The fields of ``algo``'s Config: ``--set`` keys that go into ``algo_config``."""
        return _algo_fields(algo)

    def __post_init__(self) -> None:
        _at_least(self, 1, "max_env_steps")
        _at_least(self, 0, "checkpoint_every")


@dataclass(frozen=True)
class OffPolicyAppConfig(AppConfig):
    """The Config of an off-policy app (DQN, SAC, TD3, DDPG, the transformer agent)."""

    actors: int = 1
    """Actors (each its own process under --placement actors) stepping envs_per_actor envs each."""
    envs_per_actor: int = 1
    """Envs each actor steps side by side."""
    shards: int = 1
    """Replay shards (N shards sample like one table)."""
    learners: int = 1
    """Learner replicas (more than one: --placement dp-learners, gradients all-reduced)."""
    batch_size: int = 256
    """Items per learner update."""
    samples_per_insert: float = 256.0
    """Sampled items per inserted step (with batch_size 256: one update per env step)."""
    min_size: int = 500
    """Steps stored before learning starts."""
    capacity: int = 100_000
    """Replay capacity in steps, over all shards."""
    prioritized: bool = True
    """Prioritized replay (alpha 0.6, beta 0.4) instead of uniform."""
    weights_every: int = 1
    """Learner updates between weight broadcasts to the actors and the evaluator."""
    weights_delay_s: float = 64e-6
    """Logical delay from an update to the actors acting with its weights (an env step is 1e-6 s:
    64 steps). Measured on Pendulum: 1,000 steps of lag slow learning; 10 and 64 do not differ, and
    under --placement actors a longer delay lets an actor run further ahead of the learner's process."""
    eval_every_updates: int = 250
    """Learner updates between greedy evaluations."""
    eval_episodes: int = 10
    """Episodes per evaluation."""
    replay_checkpoint_period_s: float | None = 0.1
    """Logical seconds between background checkpoints of each replay shard in deterministic runs (an env step
    is 1e-6 s: every 100,000 env steps of each actor; None: only at the end of the run). Unchanged shards are
    not rewritten, and a shard writes one at a time."""
    replay_async_checkpoint_period_s: float | None = 30.0
    """Seconds of wall-clock time between background checkpoints of each replay shard in async runs (what a
    shard that dies loses at most without replay_wal); None: replay_checkpoint_period_s, in wall seconds."""
    replay_memory: str = "host"
    """Where each replay shard keeps its steps: host, pinned (page-locked host memory: faster copies to a GPU) or
    cuda / cuda:N (the shard's storage and its window and transition gathers on the GPU)."""
    replay_wal: bool = False
    """Log every insert into a replay shard (fsynced) before acknowledging it, so a crashed shard loses none
    (the default loses the inserts since its last checkpoint)."""
    replay_remote_reads: str = "auto"
    """How a learner samples the replay shards of other hosts: auto (one-sidedly over RDMA where a device
    works, else through messages), zmq (one-sidedly: each shard's read-server thread draws its part and
    sends the rows, drawn ahead while the learner updates) or off (messages)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, 1, "actors", "envs_per_actor", "shards", "learners", "batch_size", "weights_every",
                  "eval_every_updates", "eval_episodes")
        _at_least(self, 0, "min_size")
        _at_least(self, max(1, self.min_size), "capacity")  # (below min_size, learning never starts)
        if self.replay_remote_reads not in REMOTE_READS:
            raise ValueError(f"config key 'replay_remote_reads' must be one of {list(REMOTE_READS)}, "
                             f"got {self.replay_remote_reads!r:.80}")


@dataclass(frozen=True)
class OnPolicyAppConfig(AppConfig):
    """The Config of an on-policy app (PPO): actors send rollouts straight to the learner."""

    actors: int = 2
    """Actor processes (under --placement actors) stepping envs_per_actor envs each."""
    envs_per_actor: int = 4
    """Envs each actor steps side by side."""
    eval_every_updates: int = 4
    """Learner updates between greedy evaluations."""
    eval_episodes: int = 10
    """Episodes per evaluation."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, 1, "actors", "envs_per_actor", "eval_every_updates", "eval_episodes")


@dataclass(frozen=True)
class OfflineAppConfig(AppConfig):
    """The Config of an offline app: a learner on an earlier run's replay checkpoints, an evaluator."""

    source: str = ""
    """The earlier run's run_dir: its replay shards' checkpoints (replay-<i>/) are the data."""
    batch_size: int = 32
    """Windows per update."""
    updates: int = 2000
    """Learner updates to run in all: a resumed run counts the earlier run's (raise it to go on from them)."""
    eval_every_updates: int = 500
    """Learner updates between greedy evaluations."""
    eval_episodes: int = 10
    """Episodes per evaluation."""
    prioritized: bool = True
    """Prioritized windows (alpha 0.6, beta 0.4) instead of uniform."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _at_least(self, 1, "batch_size", "updates", "eval_every_updates", "eval_episodes")


def _at_least(config: Any, low: int, *names: str) -> None:
    """Raise ``ValueError`` naming the first of ``names`` whose int value in ``config`` is below ``low``
    (a zero actors' count was a ZeroDivisionError traceback; a capacity below min_size a run that
    never learned)."""
    for name in names:
        v = getattr(config, name)
        if isinstance(v, int) and not isinstance(v, bool) and v < low:
            why = f" (min_size, the steps stored before learning starts, is {config.min_size})" \
                if name == "capacity" and low > 1 else ""
            raise ValueError(f"config key {name!r} must be >= {low}, got {v}{why}")


def _run_dir(config: Any, name: str) -> str:
    from ..launch._runtime import current_run_id

    env = config.env.replace(":", "_").replace("/", "_")
    if getattr(config, "resume", False) and not config.run_dir:  # (a new run's new directory holds nothing to resume)
        raise ValueError("resume=True needs run_dir: the directory of the run to resume (e.g. --set resume=True "
                         "run_dir=runs/dqn-CartPole-v1-RUN_ID)")
    if config.run_dir and Path(config.run_dir).exists() and not Path(config.run_dir).is_dir():
        raise ValueError(f"run_dir {config.run_dir!r} is a file, not a directory: give a new path, or an earlier "
                         f"run's directory to resume it")
    return config.run_dir or f"runs/{name}-{env}-{current_run_id()}"


def _check_env(config: Any) -> None:
    if not isinstance(config.env, str) or not config.env:
        raise ValueError("no environment: set env to a gymnasium id, e.g. --set env=CartPole-v1")


def off_policy_app_graph(config: OffPolicyAppConfig, *, algo: str, name: str, title: str) -> Graph:
    """The graph of an off-policy app: :func:`~reactor.nodes.training.off_policy_graph` from its Config.

    Args:
        algo: the algorithm (``"dqn"``, ``"sac"``, ... or a module path).
        name: the app's name, for the default run directory ``runs/<name>-<env>-RUN_ID``.
        title: the live display's title (the env id follows it).
    """
    _check_env(config)
    algo_config = dict(config.algo_config)
    if "priorities" in _algo_fields(algo):  # learn returns |TD| priorities only when they are sampled by
        algo_config = {"priorities": config.prioritized, **algo_config}
    return off_policy_graph(
        algo=algo, env=config.env, algo_config=algo_config, run_dir=_run_dir(config, name),
        actors=config.actors, envs_per_actor=config.envs_per_actor, shards=config.shards,
        learners=config.learners, capacity=config.capacity, min_size=config.min_size,
        prioritized=config.prioritized, samples_per_insert=config.samples_per_insert,
        batch_size=config.batch_size, weights_every=config.weights_every, weights_delay_s=config.weights_delay_s,
        eval_every_updates=config.eval_every_updates, eval_episodes=config.eval_episodes,
        target_return=config.target_return, max_env_steps=config.max_env_steps, checkpoint_every=config.checkpoint_every,
        resume=config.resume, replay_checkpoint_period_s=config.replay_checkpoint_period_s,
        replay_async_checkpoint_period_s=config.replay_async_checkpoint_period_s,
        replay_wal=config.replay_wal, replay_memory=config.replay_memory,
        replay_remote_reads=config.replay_remote_reads, device=config.device,
        compile=config.compile, live=config.live, title=f"{title} {config.env}",
        app_config=dataclasses.asdict(config),
    )


def on_policy_app_graph(config: OnPolicyAppConfig, *, algo: str, name: str, title: str) -> Graph:
    """The graph of an on-policy app: :func:`~reactor.nodes.training.on_policy_graph` from its Config."""
    _check_env(config)
    return on_policy_graph(
        algo=algo, env=config.env, algo_config=dict(config.algo_config), run_dir=_run_dir(config, name),
        actors=config.actors, envs_per_actor=config.envs_per_actor,
        eval_every_updates=config.eval_every_updates, eval_episodes=config.eval_episodes,
        target_return=config.target_return, max_env_steps=config.max_env_steps,
        checkpoint_every=config.checkpoint_every, resume=config.resume, device=config.device,
        compile=config.compile, live=config.live, title=f"{title} {config.env}",
        app_config=dataclasses.asdict(config),
    )


def offline_app_graph(config: OfflineAppConfig, *, algo: str, name: str, title: str,
                      algo_config: dict[str, Any] | None = None) -> Graph:
    """An :class:`~reactor.nodes.offline.OfflineLearner` on ``config.source``, an evaluator, metrics.

    Args:
        algo: a window algorithm (``"transformer_dqn"``).
        name, title: the default run directory's name, the live display's title.
        algo_config: the algorithm's fields under ``config.algo_config`` (an app's model size).

    Raises:
        ValueError: no source, or a field out of range (naming it), before anything starts.
    """
    from .evaluator import Evaluator
    from .metrics import Metrics
    from .offline import OfflineLearner

    _check_env(config)
    if not config.source:
        raise ValueError("no source: set source to an earlier run's run_dir (its replay-<i>/ checkpoints are the "
                         "data), e.g. --set source=runs/transformer_dqn-CartPoleNoVel-v1-RUN_ID")
    merged = {**(algo_config or {}), **config.algo_config}
    run_dir = _run_dir(config, name)
    from .._runclaim import check_run_dir
    from ..launch._runtime import current_run_id

    here, source = Path(run_dir).resolve(), Path(config.source).resolve()
    if here == source or source in here.parents:
        raise ValueError(f"run_dir {run_dir!r} is the offline source {config.source!r} or inside it: the offline run "
                         f"would write over the run it learns from; name another run_dir")
    check_run_dir(run_dir, current_run_id(), resume=config.resume, algo=algo, env=config.env,
                  layout={"source": config.source})
    g = Graph()
    learner = g.add(OfflineLearner(algo, config.env, merged, source=config.source, batch_size=config.batch_size,
                                   max_updates=config.updates, weights_every=config.eval_every_updates,
                                   run_dir=run_dir, checkpoint_every=config.checkpoint_every, resume=config.resume,
                                   app_config=dataclasses.asdict(config), device=config.device,
                                   compile=config.compile, alpha=0.6 if config.prioritized else 0.0,
                                   beta=0.4 if config.prioritized else 0.0), name="learner")
    evaluator = g.add(Evaluator(algo, config.env, merged, every_updates=config.eval_every_updates,
                                episodes=config.eval_episodes), name="evaluator")
    metrics = g.add(Metrics(run_dir, target_return=config.target_return, live=config.live,
                            title=f"{title} {config.env}", resume=config.resume, update_budget=config.updates),
                    name="metrics")
    g.connect(learner.weights, evaluator.weights)
    for src in (learner.report, evaluator.report):
        g.connect(src, metrics.reports, delay_s=1e-6)
    return g


def _algo_fields(algo: str) -> set[str]:
    from ._registry import load_algorithm

    return {f.name for f in dataclasses.fields(load_algorithm(algo).Config)}
