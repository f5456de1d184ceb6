"""Test app: the standard off-policy graph with the small linear-Q algorithm (fast node tests)."""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Graph
from reactor.nodes.training import off_policy_graph


@dataclass(frozen=True)
class Config:
    run_dir: str = "/tmp/reactor-train-linear"
    actors: int = 2
    shards: int = 2
    learners: int = 1
    max_env_steps: int = 2000
    colocated: bool = False
    samples_per_insert: float = 8.0
    max_unacked: int = 8


def build(config: Config) -> Graph:
    return off_policy_graph(
        algo="tests.nodes.linear_q", env="CartPole-v1", run_dir=config.run_dir, actors=config.actors,
        shards=config.shards, learners=config.learners, colocated=config.colocated, min_size=200,
        samples_per_insert=config.samples_per_insert, batch_size=32, eval_every_updates=50,
        max_env_steps=config.max_env_steps, capacity=10_000, max_unacked=config.max_unacked, live=False,
    )
