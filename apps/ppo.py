"""PPO (clipped surrogate, GAE) on any discrete-action env: CartPole-v1 by default, with RL-Zoo's tuning.

    reactor run apps/ppo.py                                 # everything in one process
    reactor run apps/ppo.py --placement actors              # learner + evaluator + metrics, 2 actor processes
    reactor run apps/ppo.py --set env=Acrobot-v1 ent_coef=0.01

2 actors x 4 envs. The actors wait for the weights that learned from their rollout (synchronous PPO),
so a seed gives the same run under every placement. The env's preset
(reactor.nodes.presets.PRESETS["ppo"]) goes under your --set values. The run stops when the greedy
evaluation return (10 episodes) reaches ``target_return`` (or at ``max_env_steps``); the run directory
holds config.json, learner.pt, metrics.csv, TensorBoard logs, summary.json and curves.png.
"""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Graph
from reactor.nodes.apps import OnPolicyAppConfig, on_policy_app_graph
from reactor.nodes.presets import PRESETS as _ALL

ALGO = "ppo"
PRESETS = _ALL[ALGO]


@dataclass(frozen=True)
class Config(OnPolicyAppConfig):
    """Actors, evaluation, budgets and logging: OnPolicyAppConfig's fields (all settable with --set)."""

    env: str = "CartPole-v1"


def build(config: Config) -> Graph:
    return on_policy_app_graph(config, algo=ALGO, name="ppo", title="PPO")
