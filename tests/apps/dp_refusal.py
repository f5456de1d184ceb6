"""Test app: apps/dqn.py's graph with its data-parallel learner replica ``refusing`` asking, at its start,
for a GPU this host does not have (``device="cuda:99"``: reactor's one-line refusal, as a bank's replica
on a host without the GPUs of the others' hosts would), while the other replicas go on to meet the bank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reactor import Graph
from reactor.nodes.apps import OffPolicyAppConfig, off_policy_app_graph
from reactor.nodes.learner import Learner
from reactor.nodes.presets import PRESETS as _ALL

ALGO = "dqn"
PRESETS = _ALL[ALGO]


@dataclass(frozen=True)
class Config(OffPolicyAppConfig):
    env: str = "CartPole-v1"
    learners: int = 2
    refusing: int = 1
    """The bank index of the replica that refuses."""


class RefusingReplica(Learner):
    refusing = 1

    def _setup(self, algo: str, env: str, algo_config: dict[str, Any] | None) -> None:
        if self.bank_index == self.refusing:
            self.device = "cuda:99"
        super()._setup(algo, env, algo_config)


def build(config: Config) -> Graph:
    g = off_policy_app_graph(config, algo=ALGO, name="dp-refusal", title="DQN")
    RefusingReplica.refusing = config.refusing
    g.nodes["learner"].prototype.__class__ = RefusingReplica
    return g
