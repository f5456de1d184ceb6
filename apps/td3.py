"""TD3 on any continuous-action env (a 1-d bounded Box): Pendulum-v1 by default.

    reactor run apps/td3.py                                  # everything in one process
    reactor run apps/td3.py --placement actors               # learner + evaluator + metrics in one
                                                            # process, each actor and shard in its own
    reactor run apps/td3.py --set env=MountainCarContinuous-v0 max_env_steps=50000

The env's preset (reactor.nodes.presets.PRESETS["td3"]: Pendulum-v1's tuning) goes under your --set
values. The run stops when the greedy evaluation return (10 episodes) reaches ``target_return`` (or
at ``max_env_steps``); the run directory holds config.json, learner.pt, metrics.csv, TensorBoard
logs, summary.json and curves.png (``reactor eval RUN_DIR`` plays the trained policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Graph
from reactor.nodes.apps import OffPolicyAppConfig, off_policy_app_graph
from reactor.nodes.presets import PRESETS as _ALL

ALGO = "td3"
PRESETS = _ALL[ALGO]


@dataclass(frozen=True)
class Config(OffPolicyAppConfig):
    """Actors, shards, replay, budgets and logging: OffPolicyAppConfig's fields (all settable with --set)."""

    env: str = "Pendulum-v1"


def build(config: Config) -> Graph:
    return off_policy_app_graph(config, algo=ALGO, name="td3", title="TD3")
