"""DQN (double Q, dueling heads, n-step returns, prioritized replay) on any discrete-action env.

    reactor run apps/dqn.py                                  # CartPole-v1, everything in one process
    reactor run apps/dqn.py --placement actors               # learner + evaluator + metrics, 2 actor
                                                             # processes, 2 replay-shard processes
    reactor run apps/dqn.py --set env=Acrobot-v1 lr=5e-4     # another env; an algorithm field directly

The env's preset (reactor.nodes.presets.PRESETS["dqn"]: CartPole-v1's tuning) goes under your
--set values. The run stops when the greedy evaluation return reaches ``target_return`` (or at
``max_env_steps``); the run directory holds config.json, learner.pt, metrics.csv, TensorBoard logs,
summary.json and curves.png (``reactor eval RUN_DIR`` plays the trained policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Graph
from reactor.nodes.apps import OffPolicyAppConfig, off_policy_app_graph
from reactor.nodes.presets import PRESETS as _ALL

ALGO = "dqn"
PRESETS = _ALL[ALGO]


@dataclass(frozen=True)
class Config(OffPolicyAppConfig):
    """Every field of OffPolicyAppConfig (settable with --set); these change its defaults."""

    env: str = "CartPole-v1"
    actors: int = 2
    envs_per_actor: int = 2
    shards: int = 2
    batch_size: int = 128
    samples_per_insert: float = 32.0
    """Sampled items per inserted step (with batch_size 128: one update per 4 env steps)."""
    min_size: int = 1000
    capacity: int = 50_000
    weights_every: int = 10
    max_env_steps: int = 200_000


def build(config: Config) -> Graph:
    return off_policy_app_graph(config, algo=ALGO, name="dqn", title="DQN")
