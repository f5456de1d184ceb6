"""Transformer DQN on CartPoleNoVel-v1: CartPole without velocities, solvable only with memory.

    reactor run apps/transformer_dqn_pocartpole.py                       # one process
    reactor run apps/transformer_dqn_pocartpole.py --placement actors    # actors and replay shards
                                                                         # in their own processes
    reactor run apps/transformer_dqn_pocartpole.py --set "algo_config={'window': 1}"   # no memory

A small causal transformer (``reactor.algos.transformer_dqn``) reads the episode's last ``window``
observations; replay serves windows of ``window + 1`` steps. The run stops when the greedy
evaluation return reaches ``target_return`` (or at ``max_env_steps``); the run directory holds
metrics.csv, TensorBoard logs, summary.json and curves.png.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reactor import Graph, current_run_id
from reactor.nodes.training import off_policy_graph


@dataclass(frozen=True)
class Config:
    actors: int = 2
    """Actor processes (under --placement actors) stepping envs_per_actor envs each."""
    envs_per_actor: int = 2
    """CartPoleNoVel envs each actor steps side by side (one transformer call for all)."""
    shards: int = 2
    """Replay shards (N shards sample like one table)."""
    learners: int = 1
    """Learner replicas (more than one: --placement dp-learners, gradients all-reduced)."""
    batch_size: int = 32
    """Windows per learner update (each window trains up to algo_config window positions)."""
    samples_per_insert: float = 16.0
    """Sampled windows per inserted step (with batch_size 32: one update per 2 env steps)."""
    min_size: int = 1000
    """Steps stored before learning starts."""
    capacity: int = 50_000
    """Replay capacity in steps, over all shards."""
    eval_every_updates: int = 250
    """Learner updates between greedy evaluations."""
    target_return: float | None = 400.0
    """Stop when an evaluation (10 episodes) reaches this mean return (None: run to max_env_steps)."""
    max_env_steps: int = 200_000
    """Stop after this many env steps in all."""
    algo_config: dict = field(default_factory=dict)
    """Overrides of reactor.algos.transformer_dqn.Config, e.g. --set "algo_config={'window': 4}"."""
    run_dir: str = ""
    """Where logs, checkpoints and the plot go (default runs/transformer_dqn_pocartpole-RUN_ID)."""
    replay_checkpoint_period_s: float | None = 0.1
    """Logical seconds between background checkpoints of each replay shard (an env step is 1e-6 s: every
    100,000 env steps of each actor; None: only at the end of the run). Unchanged shards are not rewritten."""
    replay_wal: bool = False
    """Log every insert into a replay shard (fsynced) before acknowledging it, so a crashed shard loses none
    (the default loses the inserts since its last checkpoint)."""
    live: bool = True
    """Show live progress."""


def build(config: Config) -> Graph:
    return off_policy_graph(
        algo="transformer_dqn", env="CartPoleNoVel-v1", algo_config=config.algo_config,
        run_dir=config.run_dir or f"runs/transformer_dqn_pocartpole-{current_run_id()}",
        actors=config.actors, envs_per_actor=config.envs_per_actor, shards=config.shards,
        learners=config.learners, capacity=config.capacity, min_size=config.min_size,
        samples_per_insert=config.samples_per_insert, batch_size=config.batch_size,
        eval_every_updates=config.eval_every_updates, target_return=config.target_return,
        max_env_steps=config.max_env_steps, replay_checkpoint_period_s=config.replay_checkpoint_period_s,
        replay_wal=config.replay_wal, live=config.live, title="Transformer DQN CartPoleNoVel-v1",
    )
