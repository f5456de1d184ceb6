"""Transformer DQN on a partially observed env: CartPoleNoVel-v1 (CartPole without velocities) by default.

    reactor run apps/transformer_dqn.py                       # one process
    reactor run apps/transformer_dqn.py --placement actors    # actors and replay shards in their own processes
    reactor run apps/transformer_dqn.py --set window=1        # no memory: the agent cannot solve it

A small causal transformer (``reactor.algos.transformer_dqn``) reads the episode's last ``window``
observations; replay serves windows of ``window + 1`` steps. The run stops when the greedy
evaluation return reaches ``target_return`` (or at ``max_env_steps``); the run directory holds
config.json, learner.pt, metrics.csv, TensorBoard logs, summary.json and curves.png.
"""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Graph
from reactor.nodes.apps import OffPolicyAppConfig, off_policy_app_graph
from reactor.nodes.presets import PRESETS as _ALL

ALGO = "transformer_dqn"
PRESETS = _ALL[ALGO]


@dataclass(frozen=True)
class Config(OffPolicyAppConfig):
    """Every field of OffPolicyAppConfig (settable with --set); these change its defaults."""

    env: str = "CartPoleNoVel-v1"
    actors: int = 2
    envs_per_actor: int = 2
    """Envs each actor steps side by side (one transformer call for all)."""
    shards: int = 2
    batch_size: int = 32
    """Windows per learner update (each window trains up to `window` positions)."""
    samples_per_insert: float = 16.0
    """Sampled windows per inserted step (with batch_size 32: one update per 2 env steps)."""
    min_size: int = 1000
    capacity: int = 50_000
    weights_every: int = 10
    max_env_steps: int = 200_000


def build(config: Config) -> Graph:
    return off_policy_app_graph(config, algo=ALGO, name="transformer_dqn", title="Transformer DQN")
