"""An on-policy probe for node tests: checks every rollout the RolloutLearner hands to ``learn``.

It follows the fragment contract (KIND ``on_policy``) with a uniformly random policy, and its
``learn`` replays each row of the ``[T, N]`` rollout through CartPole's own physics: stepping the
simulator from ``obs[t, n]`` with ``action[t, n]`` must give ``final_obs[t, n]`` where the episode
ended and the next row's observation (``last_obs`` after the last row) where it did not. It counts
rows, terminations, truncations and every disagreement (``bad``) and reports them as metrics, so a
test reads them from the run's metrics.csv.

Importing it registers ``ProbeCartPole-v0``: CartPole truncated after :data:`LIMIT` steps, so most
episodes of the random policy end by truncation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

from reactor.algos import config_from_dict

KIND = "on_policy"
ENV = "ProbeCartPole-v0"
LIMIT = 16

if ENV not in gym.registry:
    gym.register(ENV, entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv", max_episode_steps=LIMIT)


@dataclass(frozen=True)
class Config:
    rollout_length: int = 16

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        return config_from_dict(cls, d)


def init(obs_space: Any, act_space: Any, config: Config, seed: int) -> dict[str, int]:
    return {"rows": 0, "terminated": 0, "truncated": 0, "bad": 0}


def policy_weights(state: dict[str, int]) -> dict[str, torch.Tensor]:
    return {"rows": torch.tensor([state["rows"]])}


def make_policy(obs_space: Any, act_space: Any, config: Config) -> dict[str, Any]:
    return {}


def load_weights(policy: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    pass


def act(policy: dict[str, Any], obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    action = torch.randint(2, (len(obs),), generator=generator)
    return action, ({} if greedy else {"marker": obs[:, 0].clone()})  # an extra must stay beside its obs


def learn(state: dict[str, int], batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], None]:
    obs, action = batch["obs"].double().numpy(), batch["action"].numpy()
    term, trunc = batch["terminated"].numpy(), batch["truncated"].numpy()
    final, marker = batch["final_obs"].double().numpy(), batch["marker"].numpy()
    following = np.concatenate([obs[1:], batch["last_obs"].double().numpy()[None]])
    sim = CartPoleEnv()
    sim.reset(seed=0)
    t_len, n_envs = obs.shape[:2]
    for t in range(t_len):
        for n in range(n_envs):
            sim.state, sim.steps_beyond_terminated = obs[t, n].copy(), None
            after, reward, terminated, _, _ = sim.step(int(action[t, n]))
            ended = bool(term[t, n] or trunc[t, n])
            expected = final[t, n] if ended else following[t, n]
            ok = np.allclose(after, expected, atol=1e-4) and bool(terminated) == bool(term[t, n])
            ok = ok and (ended or not final[t, n].any()) and reward == float(batch["reward"][t, n])
            ok = ok and marker[t, n] == np.float32(obs[t, n, 0])
            state["bad"] += not ok
    state["rows"] += t_len * n_envs
    state["terminated"] += int(term.sum())
    state["truncated"] += int((trunc & ~term).sum())
    return {k: float(v) for k, v in state.items()}, None


def state_dict(state: dict[str, int]) -> dict[str, int]:
    return dict(state)


def load_state_dict(state: dict[str, int], d: dict[str, int]) -> None:
    state.update(d)
