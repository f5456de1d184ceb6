"""PPO: proximal policy optimization with a clipped surrogate and GAE (Schulman et al. 2017).

Synchronous on-policy learning. Every actor steps its envs ``rollout_length`` times with the
newest weights (``act`` samples an action and returns its log-probability and the state's value as
extras), the learner concatenates the rollouts of all actors into ``[T, N, ...]`` tensors and runs
``learn``: generalized advantage estimation (Schulman et al. 2016), then ``epochs`` passes of
shuffled minibatches over the clipped surrogate, a value loss and an entropy bonus. The actors wait
for the weights that learned from their rollout, so every rollout is exactly on-policy.

Read top to bottom: config (paper defaults), networks, ``act``, advantages (``gae``), ``learn``,
state. Easy-to-miss lines are flagged ``NOTE``; the ones that follow Stable-Baselines3 rather than
the paper say so (``SB3``), because the CartPole hyper-parameters we use are RL-Zoo's, tuned for
that implementation.

Discrete action spaces only (a categorical policy); continuous control in this package is SAC, TD3
and DDPG.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from . import config_from_dict, restore_generator
from ._common import check_counts, check_positive, check_unit

__all__ = ["KIND", "Config", "Policy", "State", "act", "advantages", "gae", "init", "learn", "load_state_dict",
           "load_weights", "make_policy", "policy_weights", "state_dict"]

KIND = "on_policy"
ACTIONS = "discrete"


# ------------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class Config:
    """PPO hyper-parameters. Defaults are the paper's MuJoCo settings (Schulman et al. 2017, table 3)
    with Stable-Baselines3's choices where the paper gives none; apps override them per task."""

    rollout_length: int = 2048
    """Env steps per actor env between two updates (T; the paper's horizon)."""
    gamma: float = 0.99
    """Discount factor."""
    gae_lambda: float = 0.95
    """GAE's lambda: 0 is the one-step TD advantage, 1 the Monte Carlo return minus the value."""
    lr: float = 3e-4
    """Adam learning rate (constant)."""
    epochs: int = 10
    """Passes over each rollout."""
    minibatch_size: int = 64
    """Samples per gradient step (the last minibatch of a pass may be smaller)."""
    clip: float = 0.2
    """The surrogate's clip range epsilon: the probability ratio is clipped to [1 - clip, 1 + clip]."""
    clip_value: float = 0.0
    """Clip the value update to this range around the rollout's values (0: no clipping, as in SB3)."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    vf_coef: float = 0.5
    """Weight of the value loss (SB3's default; the paper's c1 = 1 with shared networks)."""
    max_grad_norm: float = 0.5
    """Clip the gradients' global norm to this (0: no clipping). SB3."""
    norm_adv: bool = True
    """Normalize advantages to zero mean and unit variance per minibatch. SB3."""
    hidden: int = 64
    """Units in each of the two tanh hidden layers of the policy and of the value network."""

    def __post_init__(self) -> None:
        check_counts(self, "ppo.Config", ("rollout_length", "epochs", "minibatch_size", "hidden"))
        check_unit(self, "ppo.Config", ("gamma", "gae_lambda"))
        check_positive(self, "ppo.Config", ("lr", "clip"))
        for name in ("clip_value", "ent_coef", "vf_coef", "max_grad_norm"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ppo.Config.{name} must be >= 0, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """``Config(**d)`` with values coerced to the fields' types.

        Raises:
            ValueError: a key that is not a field (naming it and the fields), or a bad value.
        """
        return config_from_dict(cls, d)


# ---------------------------------------------------------------------------------------- networks


def _layer(n_in: int, n_out: int, gain: float) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)  # NOTE: orthogonal init, zero biases (SB3, CleanRL)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(n_in: int, hidden: int, n_out: int, out_gain: float) -> nn.Sequential:
    g = float(np.sqrt(2))
    return nn.Sequential(_layer(n_in, hidden, g), nn.Tanh(), _layer(hidden, hidden, g), nn.Tanh(),
                         _layer(hidden, n_out, out_gain))


class Policy(nn.Module):
    """Separate policy (logits) and value networks, as SB3's MlpPolicy for PPO.

    NOTE: the policy head starts at gain 0.01, so the initial policy is near uniform.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int) -> None:
        super().__init__()
        self.pi = _mlp(obs_dim, hidden, n_actions, 0.01)
        self.v = _mlp(obs_dim, hidden, 1, 1.0)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        """V(obs): float32 ``[...]`` for observations ``[..., obs_dim]``."""
        return self.v(obs).squeeze(-1)


def _spaces(obs_space: Any, act_space: Any) -> tuple[int, int]:
    n = getattr(act_space, "n", None)
    if n is None:
        raise ValueError(f"ppo supports discrete action spaces only, got {act_space!r}; "
                         f"use sac, td3 or ddpg for continuous actions")
    shape = tuple(getattr(obs_space, "shape", ()) or ())
    if len(shape) != 1:
        raise ValueError(f"ppo's MLP needs flat observations, got shape {shape!r} from {obs_space!r}; "
                         f"flatten them with gymnasium.wrappers.FlattenObservation")
    return shape[0], int(n)


def make_policy(obs_space: Any, act_space: Any, config: Config) -> Policy:
    """The actor-side networks (no optimizer)."""
    obs_dim, n_actions = _spaces(obs_space, act_space)
    return Policy(obs_dim, n_actions, config.hidden)


def load_weights(policy: Policy, weights: dict[str, torch.Tensor]) -> None:
    """Copy weights from :func:`policy_weights` into ``policy``."""
    policy.load_state_dict(weights)


# --------------------------------------------------------------------------------------------- act


def act(policy: Policy, obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sample actions from the categorical policy (``greedy``: the most probable action).

    Args:
        policy: from :func:`make_policy`.
        obs: observations ``[N, obs_dim]``.
        step: unused (PPO explores by sampling; no schedule).
        generator: all sampling randomness comes from it.
        greedy: evaluation: argmax actions, no extras.

    Returns:
        (action int64 ``[N]``, extras): ``logp`` (float32 ``[N]``, the log-probability of the action)
        and ``value`` (float32 ``[N]``, V(obs)), which ``learn`` reads back from the rollout.
    """
    obs = obs.float()
    with torch.no_grad():
        logits = policy.pi(obs)
        if greedy:
            return logits.argmax(dim=1), {}
        logp_all = torch.log_softmax(logits, dim=1)
        action = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
        logp = logp_all.gather(1, action.unsqueeze(1)).squeeze(1)
        return action, {"logp": logp, "value": policy.value(obs)}


# -------------------------------------------------------------------------------------- advantages


def gae(reward: torch.Tensor, value: torch.Tensor, next_value: torch.Tensor, terminated: torch.Tensor,
        ended: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """Generalized advantage estimates over a ``[T, N]`` rollout.

    ``delta[t] = reward[t] + gamma * (1 - terminated[t]) * next_value[t] - value[t]`` and
    ``A[t] = delta[t] + gamma * lam * (1 - ended[t]) * A[t + 1]``, with ``A[T] = 0``.

    Args:
        reward, value: float ``[T, N]``: the reward of step t and V(s_t).
        next_value: float ``[T, N]``: V of the observation step t led to. NOTE: where an episode
            ended that is the episode's *final* observation (not the next episode's first), so a
            truncated step (time limit) bootstraps from it.
        terminated: bool ``[T, N]``: the episode reached a terminal state at step t (no bootstrap).
        ended: bool ``[T, N]``: terminated or truncated at step t (the advantage stops there).
        gamma, lam: discount and GAE lambda.

    Returns:
        float32 ``[T, N]`` advantages; the value targets are ``advantages + value``.
    """
    not_term = (~terminated).float()
    not_ended = (~ended).float()
    delta = reward + gamma * not_term * next_value - value
    adv = torch.zeros_like(delta)
    last = torch.zeros_like(delta[0])
    for t in range(delta.shape[0] - 1, -1, -1):
        last = delta[t] + gamma * lam * not_ended[t] * last
        adv[t] = last
    return adv


def advantages(policy: Policy, batch: dict[str, torch.Tensor], config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and value targets of a rollout (see :func:`learn` for ``batch``).

    V of what each step led to is the next row's ``value``, V(``last_obs``) after the last row, and
    V(``final_obs``) where an episode ended at that step, computed with ``policy`` (the weights the
    rollout was collected with: PPO's learner is synchronous).

    Returns:
        (advantages, returns): float32 ``[T, N]``; ``returns = advantages + value``.
    """
    value = batch["value"].float()
    terminated = batch["terminated"].bool()
    ended = terminated | batch["truncated"].bool()
    with torch.no_grad():
        next_value = torch.cat([value[1:], policy.value(batch["last_obs"].float()).unsqueeze(0)])
        if ended.any():
            # NOTE: where an episode ended, the next row is the *next* episode's first observation;
            # a truncated episode (CartPole-v1's 500-step limit) bootstraps from its final one.
            next_value[ended] = policy.value(batch["final_obs"].float()[ended])
        adv = gae(batch["reward"].float(), value, next_value, terminated, ended, config.gamma, config.gae_lambda)
    return adv, adv + value


# ------------------------------------------------------------------------------------------- learn


@dataclass
class State:
    """The learner's side: networks, optimizer, the minibatch shuffler and counters."""

    config: Config
    policy: Policy
    opt: torch.optim.Optimizer
    generator: torch.Generator
    updates: int = 0


def init(obs_space: Any, act_space: Any, config: Config, seed: int, device: str | torch.device = "cpu") -> State:
    """Networks (seeded by ``seed``) and the Adam optimizer, on ``device``."""
    torch.manual_seed(seed)
    policy = make_policy(obs_space, act_space, config).to(device)
    # NOTE: eps 1e-5 (SB3, CleanRL; torch's default is 1e-8). fused: one kernel for all parameters.
    opt = torch.optim.Adam(policy.parameters(), lr=config.lr, eps=1e-5, fused=True)
    return State(config, policy, opt, torch.Generator(device).manual_seed(seed))


def policy_weights(state: State) -> dict[str, torch.Tensor]:
    """The networks' parameters (policy and value: the actors report values with their actions)."""
    return {k: v.detach().clone() for k, v in state.policy.state_dict().items()}


_FIELDS = ("obs", "action", "reward", "terminated", "truncated", "logp", "value", "final_obs", "last_obs")


def learn(state: State, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], None]:
    """One PPO update on a rollout: advantages, then ``epochs`` passes of minibatch gradient steps.

    Args:
        state: from :func:`init`.
        batch: ``[T, N, ...]`` tensors ``obs``, ``action``, ``reward``, ``terminated``,
            ``truncated``, ``logp`` and ``value`` (from :func:`act`), ``final_obs`` (the final
            observation where an episode ended at that step, anything elsewhere), and ``last_obs``
            ``[N, ...]`` (the observation after the rollout's last step).

    Returns:
        (metrics, None): ``policy_loss``, ``value_loss``, ``entropy`` and ``approx_kl`` (of the last
        minibatch), ``clip_fraction`` (of the last pass) and ``explained_variance`` (of the rollout's
        values); no priorities.

    Raises:
        ValueError: a field is missing from ``batch``.
    """
    missing = [k for k in _FIELDS if k not in batch]
    if missing:
        raise ValueError(f"ppo.learn: the rollout lacks {missing}; it has {sorted(batch)}")
    c, net = state.config, state.policy
    adv, ret = advantages(net, batch, c)
    obs = batch["obs"].float()
    b_obs = obs.reshape(-1, obs.shape[-1])
    b_action, b_logp = batch["action"].reshape(-1).long(), batch["logp"].float().reshape(-1)
    b_adv, b_ret, b_value = adv.reshape(-1), ret.reshape(-1), batch["value"].float().reshape(-1)
    n = b_obs.shape[0]
    mb = min(c.minibatch_size, n)
    params = list(net.parameters())
    clipped = torch.zeros((), device=b_obs.device)
    for epoch in range(c.epochs):
        # One minibatch holding the whole rollout needs no shuffle (RL-Zoo's CartPole setting).
        perm = torch.randperm(n, generator=state.generator, device=state.generator.device) if mb < n else None
        for start in range(0, n, mb):
            idx: torch.Tensor | slice = perm[start : start + mb] if perm is not None else slice(None)
            m_obs, m_adv, m_ret = b_obs[idx], b_adv[idx], b_ret[idx]
            logp_all = torch.log_softmax(net.pi(m_obs), dim=1)
            logp = logp_all.gather(1, b_action[idx].unsqueeze(1)).squeeze(1)
            if c.norm_adv and len(m_adv) > 1:  # NOTE: per minibatch, after the returns were taken (SB3)
                m_adv = (m_adv - m_adv.mean()) / (m_adv.std() + 1e-8)
            log_ratio = logp - b_logp[idx]
            ratio = log_ratio.exp()
            # The clipped surrogate (paper eq. 7), negated into a loss.
            pg_loss = torch.max(-m_adv * ratio, -m_adv * ratio.clamp(1 - c.clip, 1 + c.clip)).mean()
            v = net.value(m_obs)
            if c.clip_value > 0:
                v_clipped = b_value[idx] + (v - b_value[idx]).clamp(-c.clip_value, c.clip_value)
                v_loss = torch.max((v - m_ret) ** 2, (v_clipped - m_ret) ** 2).mean()
            else:
                v_loss = ((v - m_ret) ** 2).mean()
            loss = pg_loss + c.vf_coef * v_loss
            if c.ent_coef > 0:  # at 0 the bonus would only add work to the backward pass
                loss = loss - c.ent_coef * _entropy(logp_all)
            state.opt.zero_grad(set_to_none=True)
            loss.backward()
            if c.max_grad_norm > 0:
                nn.utils.clip_grad_norm_(params, c.max_grad_norm, foreach=True)
            state.opt.step()
            if epoch == c.epochs - 1:
                clipped += ((ratio.detach() - 1).abs() > c.clip).sum()
    state.updates += 1
    with torch.no_grad():
        approx_kl = float(((ratio - 1) - log_ratio).mean())  # of the last minibatch (Schulman's k3)
        var = float(b_ret.var())
        explained = float("nan") if var == 0 else 1.0 - float((b_ret - b_value).var()) / var
        entropy = float(_entropy(logp_all))
    return {"policy_loss": pg_loss.item(), "value_loss": v_loss.item(), "entropy": entropy,
            "approx_kl": approx_kl, "clip_fraction": float(clipped) / n, "explained_variance": explained}, None


def _entropy(logp_all: torch.Tensor) -> torch.Tensor:
    """Mean entropy of categorical distributions given as log-probabilities ``[B, A]``."""
    return -(logp_all.exp() * logp_all).sum(1).mean()


# ------------------------------------------------------------------------------------------- state


def state_dict(state: State) -> dict[str, Any]:
    """Networks, optimizer, the shuffler's state and the update count (an exact resume).

    A snapshot: copies, not views of the live tensors (torch's own ``state_dict`` returns views, and
    an optimizer loading them in the same process would share its moments with this one).
    """
    return copy.deepcopy({"policy": state.policy.state_dict(), "opt": state.opt.state_dict(),
                          "generator": state.generator.get_state(), "updates": state.updates})


def load_state_dict(state: State, d: dict[str, Any]) -> None:
    """Restore what :func:`state_dict` saved."""
    state.policy.load_state_dict(d["policy"])
    state.opt.load_state_dict(d["opt"])
    restore_generator(state.generator, d["generator"])
    state.updates = int(d["updates"])
