"""PPO (clipped surrogate, GAE) on CartPole-v1, with RL-Zoo's tuned hyper-parameters.

    reactor run apps/ppo_cartpole.py                       # everything in one process
    reactor run apps/ppo_cartpole.py --placement actors    # learner + evaluator + metrics, 2 actor processes

8 envs in all (2 actors x 4 envs), 32 steps each per update (256 samples), 20 epochs of one
minibatch. The actors wait for the weights that learned from their rollout (synchronous PPO), so
a seed gives the same run under every placement. The run stops when the greedy evaluation return
(10 episodes) reaches ``target_return`` (or at ``max_env_steps``); the run directory holds
metrics.csv, TensorBoard logs, summary.json and curves.png.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reactor import Graph, current_run_id
from reactor.nodes.training import on_policy_graph

#: RL-Zoo's hyper-parameters for PPO on CartPole-v1 (rl-baselines3-zoo hyperparams/ppo.yml; the
#: linear decays of lr and clip there are held constant here: they barely move in the ~15k steps
#: a solve takes out of the zoo's 100k).
CARTPOLE = {"rollout_length": 32, "gamma": 0.98, "gae_lambda": 0.8, "lr": 1e-3, "epochs": 20,
            "minibatch_size": 256, "clip": 0.2, "ent_coef": 0.0}


@dataclass(frozen=True)
class Config:
    actors: int = 2
    """Actor processes (under --placement actors) stepping envs_per_actor envs each."""
    envs_per_actor: int = 4
    """CartPole envs each actor steps side by side."""
    eval_every_updates: int = 4
    """Learner updates between greedy evaluations."""
    eval_episodes: int = 10
    """Episodes per evaluation (stepped side by side)."""
    target_return: float | None = 475.0
    """Stop when an evaluation reaches this mean return (None: run to max_env_steps; only a step
    budget ends a run at the same point under every placement)."""
    max_env_steps: int = 100_000
    """Stop after this many env steps in all."""
    algo_config: dict = field(default_factory=dict)
    """Overrides of CARTPOLE (reactor.algos.ppo.Config fields), e.g. --set "algo_config={'lr': 5e-4}"."""
    run_dir: str = ""
    """Where logs, checkpoints and the plot go (default runs/ppo_cartpole-RUN_ID)."""
    checkpoint_every: int = 0
    """Learner updates between checkpoints of weights and optimizer state (0: only at the end)."""
    resume: bool = False
    """Start the learner from run_dir/learner.pt when it exists (give the old run's run_dir)."""
    live: bool = True
    """Show live progress."""


def build(config: Config) -> Graph:
    return on_policy_graph(
        algo="ppo", env="CartPole-v1", algo_config={**CARTPOLE, **config.algo_config},
        run_dir=config.run_dir or f"runs/ppo_cartpole-{current_run_id()}",
        actors=config.actors, envs_per_actor=config.envs_per_actor,
        eval_every_updates=config.eval_every_updates, eval_episodes=config.eval_episodes,
        target_return=config.target_return, max_env_steps=config.max_env_steps,
        checkpoint_every=config.checkpoint_every, resume=config.resume, live=config.live, title="PPO CartPole-v1",
    )
