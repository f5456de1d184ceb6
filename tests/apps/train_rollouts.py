"""Test app: the standard on-policy graph with the rollout probe (checks what actors send the learner)."""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Graph
from reactor.nodes.training import on_policy_graph


@dataclass(frozen=True)
class Config:
    run_dir: str = "/tmp/reactor-train-rollouts"
    actors: int = 2
    envs_per_actor: int = 2
    max_env_steps: int = 640


def build(config: Config) -> Graph:
    from tests.nodes import rollout_probe

    return on_policy_graph(
        algo="tests.nodes.rollout_probe", env=rollout_probe.ENV, run_dir=config.run_dir, actors=config.actors,
        envs_per_actor=config.envs_per_actor, max_env_steps=config.max_env_steps, eval_every_updates=100,
        eval_episodes=2, live=False,
    )
