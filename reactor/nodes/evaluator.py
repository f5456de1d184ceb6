"""Evaluator: greedy evaluation episodes with the newest weights, every so many learner updates."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .._reactor import Input, Output, Reactor, reaction, startup
from ._contract import check_act
from ._registry import denormals_flushed
from .train_messages import Report, Weights

__all__ = ["Evaluator", "evaluate"]


#: The most steps an evaluation episode runs: an env that never ends one (no terminal state and no
#: max_episode_steps) held the run in its evaluation for good, with nothing on the screen.
EVAL_MAX_STEPS = 100_000
#: The most envs an evaluation steps side by side; more episodes run in rounds of this many
#: (``reactor eval --episodes 100000`` made 100,000 envs at once: gigabytes, minutes before a step).
EVAL_WIDTH = 64


def evaluate(algo: Any, policy: Any, env: Any, episodes: int, seed: int, max_steps: int = EVAL_MAX_STEPS) -> np.ndarray:
    """Run ``episodes`` greedy episodes in the vectorized ``env``, its ``num_envs`` side by side (one
    round, or rounds of as many: episode ``i`` is reset with seed ``seed + i`` either way); return their
    returns.

    Each sub-env runs exactly one episode a round (steps after its episode ended are not counted), cut
    after ``max_steps`` steps (said in the log).
    """
    width = int(env.num_envs)
    rounds = [_evaluate_round(algo, policy, env, width, seed + start, max_steps) for start in range(0, episodes, width)]
    return np.concatenate(rounds)[:episodes]


def _evaluate_round(algo: Any, policy: Any, env: Any, episodes: int, seed: int, max_steps: int) -> np.ndarray:
    """One greedy episode in each of the ``episodes`` sub-envs of ``env``."""
    import torch

    obs, _ = env.reset(seed=seed)
    if hasattr(algo, "reset"):  # agents with memory (the transformer) start every episode afresh
        algo.reset(policy, np.ones(episodes, dtype=bool))
    returns = np.zeros(episodes, dtype=np.float64)
    running = np.ones(episodes, dtype=bool)
    gen = torch.Generator().manual_seed(seed)
    steps = 0
    while running.any():
        if steps == max_steps:
            logging.getLogger("reactor.evaluator").warning(
                "%d of %d evaluation episode(s) ran %d steps without ending: cut there, their returns so far counted "
                "(does the env ever end an episode? register it with max_episode_steps)", int(running.sum()),
                episodes, max_steps)
            break
        with torch.no_grad(), denormals_flushed():
            acted = algo.act(policy, torch.as_tensor(obs), 0, gen, greedy=True)
        if steps == 0:  # (an evaluation's first step: what act returns, checked)
            check_act(algo, acted, episodes, env.single_action_space)
        action, _ = acted
        obs, reward, terminated, truncated, _ = env.step(action.numpy())
        returns += np.where(running, reward, 0.0)
        running &= ~(terminated | truncated)
        steps += 1
    return returns


class Evaluator(Reactor):
    """Evaluates the policy greedily every ``every_updates`` learner updates; reports ``eval_return``.

    Args:
        algo: algorithm name (``reactor.algos``).
        env: environment name (``reactor.algos.envs``).
        algo_config: overrides of the algorithm's Config.
        every_updates: evaluate the first weights whose version reaches each multiple of this.
        episodes: episodes per evaluation (run side by side in a vector env, at most ``EVAL_WIDTH`` at once).
    """

    weights = Input(Weights, required=True)
    report = Output(Report)

    def __init__(self, algo: str, env: str, algo_config: dict[str, Any] | None = None,
                 every_updates: int = 1000, episodes: int = 10) -> None:
        if every_updates < 1 or episodes < 1:
            raise ValueError(f"Evaluator: every_updates and episodes must be >= 1, got {every_updates}, {episodes}")
        self.algo_name = algo
        self.env_name = env
        self.algo_config = dict(algo_config or {})
        self.every_updates = every_updates
        self.episodes = episodes
        self.next_version = 0
        self.evaluations = 0

    @reaction(triggers=[startup])
    def open_env(self) -> None:
        from ._registry import configure_torch, load_algorithm, make_vector_env

        configure_torch()
        self.algo = load_algorithm(self.algo_name)
        self.config = self.algo.Config.from_dict(self.algo_config)
        self.env = make_vector_env(self.env_name, min(self.episodes, EVAL_WIDTH))
        import torch

        with torch.random.fork_rng():  # the policy's initial weights: seeded, and no one else's stream moves
            torch.manual_seed(int(self.rng.integers(2**63 - 1)))
            self.policy = self.algo.make_policy(
                self.env.single_observation_space, self.env.single_action_space, self.config
            )

    @reaction(triggers=[weights], effects=[report])
    def maybe_evaluate(self, weights: Weights) -> None:
        if weights.version < self.next_version:
            return
        self.next_version = (weights.version // self.every_updates + 1) * self.every_updates
        self.algo.load_weights(self.policy, weights.tensors)
        seed = int(self.rng.integers(2**31))
        returns = evaluate(self.algo, self.policy, self.env, self.episodes, seed)
        self.evaluations += 1
        self.report.send(Report(self.name, {"eval_return": float(returns.mean()),
                                            "eval_return_min": float(returns.min()),
                                            "version": float(weights.version)}))
