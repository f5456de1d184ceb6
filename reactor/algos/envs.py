"""Environments by name: any gymnasium id, plus the partially observable tasks the sequence agents need.

``CartPoleNoVel-v1`` is gymnasium's CartPole-v1 with the two velocity entries removed from every
observation (cart position and pole angle remain): a memoryless policy cannot tell which way the
pole is moving, so an agent has to infer velocities from the history (the POMDP of GEAR's and
R2D2-style sequence-model experiments). It is registered with gymnasium under the same id, so
``gymnasium.make("CartPoleNoVel-v1")`` works once this module is imported.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["VelocityMasked", "make_env", "make_vector_env"]


class VelocityMasked(gym.ObservationWrapper):  # type: ignore[misc]
    """Keeps only the observation entries ``keep`` (CartPole: position 0 and angle 2)."""

    def __init__(self, env: gym.Env, keep: tuple[int, ...] = (0, 2)) -> None:
        super().__init__(env)
        self.keep = np.asarray(keep, dtype=np.int64)
        box = env.observation_space
        self.observation_space = gym.spaces.Box(box.low[self.keep], box.high[self.keep], dtype=box.dtype)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation[self.keep]


def _cartpole_novel(**kwargs: Any) -> gym.Env:
    return VelocityMasked(gym.make("CartPole-v1", **kwargs))


if "CartPoleNoVel-v1" not in gym.registry:
    gym.register("CartPoleNoVel-v1", entry_point=_cartpole_novel)


def make_env(name: str) -> Any:
    """One environment by gymnasium id (``CartPoleNoVel-v1`` included)."""
    return gym.make(name)


def make_vector_env(name: str, num_envs: int) -> Any:
    """``num_envs`` environments stepped side by side in this process, with same-step autoreset
    (an ended episode's final observation is in ``info["final_obs"]``; the returned one starts the next)."""
    return gym.make_vec(name, num_envs=num_envs, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
