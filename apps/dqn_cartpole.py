"""DQN (double Q, dueling heads, n-step returns, prioritized replay) on CartPole-v1.

    reactor run apps/dqn_cartpole.py                       # everything in one process
    reactor run apps/dqn_cartpole.py --placement actors    # learner + evaluator + metrics, 2 actor
                                                           # processes, 2 replay-shard processes

The run stops when the greedy evaluation return reaches ``target_return`` (or at
``max_env_steps``); the run directory holds metrics.csv, TensorBoard logs, summary.json and
curves.png.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reactor import Graph, current_run_id
from reactor.nodes.training import off_policy_graph

CARTPOLE = {"hidden": 256, "lr": 3e-3, "n_step": 5, "target_every": 25, "eps_decay_steps": 8000}
"""CartPole tuning over reactor.algos.dqn.Config (algo_config overrides these). Measured (seeds 0-13, 50k-step
budget, docs/benchmarks.md): with these, every seed reaches 475, at 5k-13k env steps (median 9k); epsilon
falling over 5,000 steps per actor instead gave 5k-23k (median 10k), over 2,500 median 16k; with the Config
defaults (128 units, lr 1e-3, 3-step, target copy every 100 updates) evaluations plateaued at 250-400 and
only 2 of 4 seeds reached 475 within 40k."""


@dataclass(frozen=True)
class Config:
    actors: int = 2
    """Actor processes (under --placement actors) stepping envs_per_actor envs each."""
    envs_per_actor: int = 2
    """CartPole envs each actor steps side by side."""
    shards: int = 2
    """Replay shards (N shards sample like one table)."""
    learners: int = 1
    """Learner replicas (more than one: --placement dp-learners, gradients all-reduced)."""
    batch_size: int = 128
    """Items per learner update."""
    samples_per_insert: float = 32.0
    """Sampled items per inserted step (with batch_size 128: one update per 4 env steps)."""
    min_size: int = 1000
    """Steps stored before learning starts."""
    capacity: int = 50_000
    """Replay capacity in steps, over all shards."""
    eval_every_updates: int = 250
    """Learner updates between greedy evaluations."""
    target_return: float | None = 475.0
    """Stop when an evaluation (10 episodes) reaches this mean return (None: run to max_env_steps;
    only a step budget ends a run at the same point under every placement)."""
    max_env_steps: int = 200_000
    """Stop after this many env steps in all."""
    algo_config: dict = field(default_factory=dict)
    """Overrides of reactor.algos.dqn.Config on top of CARTPOLE, e.g. --set "algo_config={'lr': 5e-4}"."""
    run_dir: str = ""
    """Where logs, checkpoints and the plot go (default runs/dqn_cartpole-RUN_ID)."""
    checkpoint_every: int = 0
    """Learner updates between checkpoints of weights and optimizer state (0: only at the end)."""
    resume: bool = False
    """Start the learner from run_dir/learner.pt and the replay shards from their checkpoints when they
    exist (give the old run's run_dir)."""
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
        algo="dqn", env="CartPole-v1", algo_config={**CARTPOLE, **config.algo_config},
        run_dir=config.run_dir or f"runs/dqn_cartpole-{current_run_id()}",
        actors=config.actors, envs_per_actor=config.envs_per_actor, shards=config.shards,
        learners=config.learners, capacity=config.capacity, min_size=config.min_size,
        samples_per_insert=config.samples_per_insert, batch_size=config.batch_size,
        eval_every_updates=config.eval_every_updates, target_return=config.target_return,
        max_env_steps=config.max_env_steps, checkpoint_every=config.checkpoint_every, resume=config.resume,
        replay_checkpoint_period_s=config.replay_checkpoint_period_s, replay_wal=config.replay_wal,
        live=config.live, title="DQN CartPole-v1",
    )
