"""Test app: tests/apps/train_linear.py's graph whose evaluator fails at the weights of update
``fail_at`` (a node failing mid-run, after the learner has learned: the run fails, and the learner's
last line must not read as a finished run's)."""

from __future__ import annotations

from dataclasses import dataclass

from reactor import Graph, reaction
from reactor.nodes.evaluator import Evaluator
from reactor.nodes.train_messages import Weights
from reactor.nodes.training import off_policy_graph


@dataclass(frozen=True)
class Config:
    run_dir: str = "/tmp/reactor-failing-eval"
    fail_at: int = 100


class FailingEvaluator(Evaluator):
    fail_at = 100

    @reaction(triggers=[Evaluator.weights], effects=[Evaluator.report])
    def maybe_evaluate(self, weights: Weights) -> None:
        if weights.version >= self.fail_at:
            raise RuntimeError(f"the evaluator broke at update {weights.version}")
        super().maybe_evaluate(weights)


def build(config: Config) -> Graph:
    g = off_policy_graph(
        algo="tests.nodes.linear_q", env="CartPole-v1", run_dir=config.run_dir, actors=1, shards=1, min_size=200,
        batch_size=32, eval_every_updates=50, max_env_steps=100_000, capacity=10_000, live=False,
    )
    FailingEvaluator.fail_at = config.fail_at
    g.nodes["evaluator"].prototype.__class__ = FailingEvaluator
    return g
