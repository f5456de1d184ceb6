"""A custom environment defined in a test module: a chain of ``length`` cells, walk right to the end.

Importing this module registers ``ReactorChain-v0`` with gymnasium, so ``env=chain_env:ReactorChain-v0``
(gymnasium imports ``chain_env`` first) works in every process that can import it.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np


class Chain(gym.Env):  # type: ignore[misc]
    """Observation: the one-hot cell; actions: 0 left, 1 right; reward 1 on reaching the last cell."""

    def __init__(self, length: int = 6) -> None:
        self.length = length
        self.observation_space = gym.spaces.Box(0.0, 1.0, (length,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.pos = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.length, dtype=np.float32)
        obs[self.pos] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.pos = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.pos = max(0, min(self.length - 1, self.pos + (1 if int(action) == 1 else -1)))
        done = self.pos == self.length - 1
        return self._obs(), float(done), done, False, {}


if "ReactorChain-v0" not in gym.registry:
    gym.register("ReactorChain-v0", entry_point=Chain, max_episode_steps=30)
