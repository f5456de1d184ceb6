"""DQN with double Q-learning, dueling heads, n-step returns and prioritized replay (Rainbow's DQN parts).

Reads top to bottom: config, network, the fragments the nodes call (``store``, ``init``, ``act``,
``learn``), then checkpointing. Papers: Mnih et al. 2015 (DQN), van Hasselt et al. 2016 (double Q),
Wang et al. 2016 (dueling), Schaul et al. 2016 (prioritized replay), Hessel et al. 2018 (n-step in
Rainbow). Prioritized sampling and importance weights happen in the replay shards; ``learn`` only
weights the loss and returns the new priorities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..replay import TransitionRead
from . import StoreSpec, config_from_dict
from ._common import adam, check_counts, check_nonnegative, check_positive, check_unit

KIND = "off_policy"
ACTIONS = "discrete"


@dataclass(frozen=True)
class Config:
    hidden: int = 128
    """Units in each of the two hidden layers."""
    dueling: bool = True
    """Q = V + A - mean(A) (Wang et al. 2016)."""
    double: bool = True
    """Select the next action with the online net, evaluate it with the target net (van Hasselt 2016)."""
    n_step: int = 3
    """Steps summed into the return (the replay read computes it: reward, discount = gamma^m)."""
    gamma: float = 0.99
    """Discount."""
    lr: float = 1e-3
    """Adam learning rate."""
    target_every: int = 100
    """Updates between target-net updates."""
    tau: float = 1.0
    """Target update ``target <- tau * online + (1 - tau) * target`` (1: a hard copy, as in DQN;
    small tau with target_every 1: Polyak averaging)."""
    max_grad_norm: float = 10.0
    """Gradient clipping (global norm); 0 (or less): no clipping (the norm is still reported)."""
    eps_start: float = 1.0
    """Exploration rate at the actor's first step."""
    eps_end: float = 0.02
    """Exploration rate after eps_decay_steps."""
    eps_decay_steps: int = 5_000
    """Actor env steps over which epsilon falls linearly from eps_start to eps_end."""
    priority_eps: float = 1e-3
    """Added to |TD error| so that no item's priority is zero."""

    def __post_init__(self) -> None:
        check_counts(self, "dqn Config", ("hidden", "n_step", "target_every"))
        check_counts(self, "dqn Config", ("eps_decay_steps",), low=0)
        check_unit(self, "dqn Config", ("gamma", "eps_start", "eps_end"))
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"dqn Config.tau must be in (0, 1], got {self.tau!r}")
        check_positive(self, "dqn Config", ("lr", "priority_eps"))
        check_nonnegative(self, "dqn Config", ("max_grad_norm",))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        return config_from_dict(cls, d)


# ------------------------------------------------------------------------------------------ network


class QNetwork(nn.Module):
    """MLP torso with a dueling (or plain) Q head."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: int, dueling: bool) -> None:
        super().__init__()
        self.torso = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.dueling = dueling
        self.advantage = nn.Linear(hidden, n_actions)
        self.value = nn.Linear(hidden, 1) if dueling else None

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        # The layers' functions on their parameters, not the submodules' __call__ (hook checks each): the
        # same kernels on the same tensors, so the same bits, with ~13% less time per act on 2-10
        # observations, where Python is most of it (docs/benchmarks.md, session 61).
        first, _, second, _ = self.torso
        h = F.relu(F.linear(F.relu(F.linear(obs, first.weight, first.bias)), second.weight, second.bias))
        a = F.linear(h, self.advantage.weight, self.advantage.bias)
        if self.value is None:
            return a
        v = F.linear(h, self.value.weight, self.value.bias)
        return v + a - a.mean(dim=-1, keepdim=True)  # identifiable: mean advantage is 0


def _network(obs_space: Any, act_space: Any, config: Config) -> QNetwork:
    if getattr(act_space, "n", None) is None:
        raise ValueError(f"dqn needs a discrete action space, got {act_space}")
    return QNetwork(int(obs_space.shape[0]), int(act_space.n), config.hidden, config.dueling)


# ------------------------------------------------------------------------------------------ fragments


def store(obs_space: Any, act_space: Any, config: Config) -> StoreSpec:
    """Per step: observation, action, reward, terminated; read back as n-step transitions."""
    return StoreSpec(
        [("obs", tuple(obs_space.shape), torch.float32), ("action", (), torch.int64),
         ("reward", (), torch.float32), ("terminated", (), torch.bool)],
        TransitionRead(config.n_step, config.gamma, next_fields=("obs", "terminated")),
    )


@dataclass
class State:
    q: QNetwork
    target: QNetwork
    opt: torch.optim.Optimizer
    config: Config
    updates: int = 0


def init(obs_space: Any, act_space: Any, config: Config, seed: int, device: str | torch.device = "cpu") -> State:
    """Networks (seeded by ``seed``) and the optimizer, on ``device``."""
    torch.manual_seed(seed)
    q = _network(obs_space, act_space, config).to(device)
    target = _network(obs_space, act_space, config).to(device)
    target.load_state_dict(q.state_dict())
    target.requires_grad_(False)
    return State(q, target, adam(q.parameters(), config.lr), config)  # fused: ~20% of an update saved


def policy_weights(state: State) -> dict[str, torch.Tensor]:
    return dict(state.q.state_dict())


def make_policy(obs_space: Any, act_space: Any, config: Config) -> dict[str, Any]:
    return {"q": _network(obs_space, act_space, config), "config": config}


def load_weights(policy: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    policy["q"].load_state_dict(weights)


def epsilon(config: Config, step: int) -> float:
    """Linear decay from eps_start to eps_end over eps_decay_steps actor steps."""
    frac = min(1.0, step / max(1, config.eps_decay_steps))
    return config.eps_start + frac * (config.eps_end - config.eps_start)


def act(policy: dict[str, Any], obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Epsilon-greedy actions for a batch of observations (greedy: argmax Q)."""
    q = policy["q"](obs.float())
    action = q.argmax(dim=1)
    if greedy:
        return action, {}
    n = len(obs)
    # Draw both random tensors every step, whatever epsilon is: the generator's stream then does not
    # depend on the schedule, so runs differing only in epsilon stay comparable.
    explore = torch.rand(n, generator=generator) < epsilon(policy["config"], step)
    random_action = torch.randint(q.shape[1], (n,), generator=generator)
    return torch.where(explore, random_action, action), {}


def learn(state: State, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], torch.Tensor]:
    """One double-DQN update on a prioritized batch of n-step transitions.

    Target: ``y = R^(n) + gamma^m (1 - terminated') Q_target(s', argmax_a Q(s', a))`` where the replay
    read already summed the n rewards (``reward``) and gives ``discount = gamma^m`` (m < n when the
    episode ended first). ``next_terminated`` is True only at true terminals, so truncated episodes
    (CartPole's 500-step limit) still bootstrap: an easy line to get wrong.
    """
    c = state.config
    q_all = state.q(batch["obs"])
    q = q_all.gather(1, batch["action"].view(-1, 1)).squeeze(1)
    with torch.no_grad():
        next_obs = batch["next_obs"]
        next_target = state.target(next_obs)
        if c.double:
            next_action = state.q(next_obs).argmax(dim=1, keepdim=True)
            next_q = next_target.gather(1, next_action).squeeze(1)
        else:
            next_q = next_target.max(dim=1).values
        alive = (~batch["next_terminated"]).float()
        y = batch["reward"] + batch["discount"] * alive * next_q
    td = y - q
    valid = batch["valid"].float() if "valid" in batch else torch.ones_like(td)
    # Importance weights correct the bias of prioritized sampling (PER eq. 2).
    loss = (batch["weights"] * valid * nn.functional.smooth_l1_loss(q, y, reduction="none")).sum() / valid.sum().clamp(min=1)
    state.opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(state.q.parameters(), c.max_grad_norm if c.max_grad_norm > 0 else math.inf)
    state.opt.step()
    state.updates += 1
    if state.updates % c.target_every == 0:
        with torch.no_grad():
            for t, p in zip(state.target.parameters(), state.q.parameters()):
                t.lerp_(p, c.tau)  # tau = 1: an exact copy
    priorities = td.detach().abs() * valid + c.priority_eps
    return {"loss": float(loss.detach()), "q": float(q.detach().mean()), "grad_norm": float(grad_norm)}, priorities


# ------------------------------------------------------------------------------------------ checkpoints


def state_dict(state: State) -> dict[str, Any]:
    return {"q": state.q.state_dict(), "target": state.target.state_dict(), "opt": state.opt.state_dict(),
            "updates": state.updates}


def load_state_dict(state: State, d: dict[str, Any]) -> None:
    state.q.load_state_dict(d["q"])
    state.target.load_state_dict(d["target"])
    state.opt.load_state_dict(d["opt"])
    state.updates = int(d["updates"])
