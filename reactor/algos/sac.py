"""Soft Actor-Critic (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications").

Reads top to bottom: config (the paper's defaults), networks, ``act``, ``learn``. A squashed
Gaussian actor maximises ``Q - alpha * log pi``; twin critics (clipped double Q) learn soft
targets; the temperature ``alpha`` is tuned automatically towards ``target_entropy``
(``-act_dim``); target critics follow by Polyak averaging (``tau``).

Fragments (``reactor.algos`` contract): ``KIND``, ``Config``, ``store``, ``init``,
``policy_weights``, ``make_policy``, ``load_weights``, ``act``, ``learn``, ``state_dict``,
``load_state_dict``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import StoreSpec, restore_generator
from ._common import (
    ActionBox,
    QEnsemble,
    adam,
    check_box,
    check_hidden,
    check_positive,
    config_from,
    mlp,
    polyak_,
    store_transitions,
)

KIND = "off_policy"
ACTIONS = "continuous"


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Config:
    """SAC hyper-parameters; defaults are the paper's (Table 1 of the 2018 applications paper)."""

    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the actor and of each critic."""
    actor_lr: float = 3e-4
    """Adam step size of the actor."""
    critic_lr: float = 3e-4
    """Adam step size of the critics."""
    alpha_lr: float = 3e-4
    """Adam step size of log(alpha), the temperature."""
    gamma: float = 0.99
    """Discount."""
    tau: float = 0.005
    """Polyak step of the target critics per update."""
    n_step: int = 1
    """Steps summed into the critic's target (1: the paper's one-step target)."""
    init_alpha: float = 1.0
    """Starting temperature (tuned from there when autotune is on)."""
    autotune: bool = True
    """Tune alpha towards target_entropy (False: alpha stays init_alpha)."""
    target_entropy: float | None = None
    """Entropy target in nats, measured on the [-1, 1] squashed action (None: -act_dim, the paper's)."""
    learning_starts: int = 5000
    """Env steps (per actor) of uniformly random actions before the actor's policy is used (CleanRL's
    5000; the paper fixes none)."""
    policy_frequency: int = 1
    """Critic updates per actor and temperature update (1: the paper's; CleanRL uses 2)."""
    priorities: bool = True
    """learn returns |TD| priorities for prioritized replay (False with a uniform replay: none sent)."""
    priority_eps: float = 1e-3
    """Added to |TD| so no item's priority is zero."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """The defaults overridden by ``d``; unknown keys raise ``ValueError`` naming them."""
        return config_from(cls, d)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", check_hidden(self.hidden, "sac"))
        check_positive(self, "sac Config", ("actor_lr", "critic_lr", "alpha_lr", "tau", "n_step", "init_alpha",
                                     "policy_frequency"))
        if not 0.0 <= self.gamma <= 1.0 or not self.tau <= 1.0:
            raise ValueError(f"sac Config: gamma and tau must be in [0, 1], got gamma={self.gamma}, tau={self.tau}")
        if self.learning_starts < 0:
            raise ValueError(f"sac Config.learning_starts must be >= 0, got {self.learning_starts}")
        if self.target_entropy is not None and not isinstance(self.target_entropy, (int, float)):
            raise ValueError(f"sac Config.target_entropy must be a number or None, got {self.target_entropy!r}")


def store(obs_space: Any, act_space: Any, config: Config) -> StoreSpec:
    """obs, action (env units), reward, terminated per step; n-step transitions for the learner."""
    return store_transitions(obs_space, act_space, config.n_step, config.gamma)


# ---------------------------------------------------------------------------------------------- networks

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class Actor(nn.Module):
    """Squashed Gaussian policy: ``a = to_env(tanh(mean + std * eps))``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...], low: torch.Tensor,
                 high: torch.Tensor) -> None:
        super().__init__()
        self.trunk = mlp([obs_dim, *hidden, 2 * act_dim])
        self.box = ActionBox(low, high)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean, log_std)`` of the pre-tanh Gaussian."""
        mean, log_std = self.trunk(obs).chunk(2, dim=-1)
        # Soft clamp of log_std into [LOG_STD_MIN, LOG_STD_MAX] (smooth, unlike a hard clamp; CleanRL).
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(log_std) + 1.0)
        return mean, log_std

    def sample(self, obs: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised sample in ``[-1, 1]`` and its log-probability ``[B]``."""
        mean, log_std = self(obs)
        eps = torch.randn(mean.shape, generator=generator, device=mean.device)
        u = mean + log_std.exp() * eps
        a = torch.tanh(u)
        # log N(u; mean, std) - log|d tanh(u)/du|, with log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u))
        # (stable for large |u|, unlike log(1 - a^2 + 1e-6)). Measured on the [-1, 1] action, as in
        # SB3: target_entropy = -act_dim then means the same for every action range.
        log_prob = (-0.5 * eps.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
                    - 2.0 * (math.log(2.0) - u - nn.functional.softplus(-2.0 * u)))
        return a, log_prob.sum(-1)


@dataclass
class State:
    """Learner state: networks, optimizers, temperature, counters and the sampling generator."""

    actor: Actor
    critic: QEnsemble
    critic_target: QEnsemble
    log_alpha: torch.Tensor
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer
    alpha_opt: torch.optim.Optimizer
    target_entropy: float
    config: Config
    generator: torch.Generator
    updates: int = 0


def init(obs_space: Any, act_space: Any, config: Config, seed: int, device: str | torch.device = "cpu") -> State:
    """Networks (seeded by the caller's torch seed), Adam optimizers and the learner's generator, on ``device``."""
    low, high = check_box(act_space, "sac")
    obs_dim, act_dim = int(obs_space.shape[0]), int(low.shape[0])
    actor = Actor(obs_dim, act_dim, config.hidden, low, high).to(device)
    critic = QEnsemble(obs_dim, act_dim, config.hidden).to(device)
    critic_target = copy.deepcopy(critic).requires_grad_(False)
    log_alpha = torch.tensor(math.log(config.init_alpha), requires_grad=True, device=device)
    target_entropy = -float(act_dim) if config.target_entropy is None else float(config.target_entropy)
    return State(
        actor, critic, critic_target, log_alpha,
        adam(actor.parameters(), config.actor_lr),
        adam(critic.parameters(), config.critic_lr),
        adam([log_alpha], config.alpha_lr),
        target_entropy, config, torch.Generator(device).manual_seed(seed),
    )


def policy_weights(state: State) -> dict[str, torch.Tensor]:
    """The actor's weights (and its action bounds): all that acting needs."""
    return {k: v.detach().clone() for k, v in state.actor.state_dict().items()}


@dataclass
class Policy:
    """Actor-side object: the actor network and the config (no critics, no optimizer)."""

    actor: Actor
    config: Config


def make_policy(obs_space: Any, act_space: Any, config: Config) -> Policy:
    low, high = check_box(act_space, "sac")
    return Policy(Actor(int(obs_space.shape[0]), int(low.shape[0]), config.hidden, low, high), config)


def load_weights(policy: Policy, weights: dict[str, torch.Tensor]) -> None:
    policy.actor.load_state_dict(weights)


# ---------------------------------------------------------------------------------------------- act


def act(policy: Policy, obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Actions ``[N, act_dim]`` in the environment's bounds.

    ``greedy``: ``to_env(tanh(mean))``, deterministic. Otherwise uniform random actions for the
    first ``learning_starts`` steps, then a sample of the squashed Gaussian; all randomness from
    ``generator``.
    """
    actor = policy.actor
    with torch.no_grad():
        if not greedy and step < policy.config.learning_starts:
            return actor.box.uniform(len(obs), generator), {}
        obs = obs.float()
        if greedy:
            mean, _ = actor(obs)
            a = torch.tanh(mean)
        else:
            a, _ = actor.sample(obs, generator)
        # tanh keeps a in [-1, 1]; the clip only guards the float rounding of the affine map.
        return actor.box.clip(actor.box.to_env(a)), {}


# ---------------------------------------------------------------------------------------------- learn


def learn(state: State, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], torch.Tensor | None]:
    """One SAC update: critics every call; actor and temperature every ``policy_frequency`` calls.

    Returns:
        metrics, and ``|TD| + priority_eps`` per item (mean over the two critics) when
        ``config.priorities``, else None.
    """
    cfg, gen = state.config, state.generator
    actor, critic, box = state.actor, state.critic, state.actor.box
    obs, reward, discount = batch["obs"].float(), batch["reward"], batch["discount"]
    action = box.to_unit(batch["action"])  # the critics see [-1, 1] actions, like the actor's output
    alpha = state.log_alpha.detach().exp()

    # Soft target: r + gamma^m * (1 - terminal) * (min_i Q'_i(s', a') - alpha * log pi(a'|s')), a' ~ pi(s').
    # Easy to miss: the terminal mask is next_terminated (True only at true terminals), so episodes cut
    # by the time limit (Pendulum's 200 steps) still bootstrap.
    with torch.no_grad():
        next_obs = batch["next_obs"].float()
        next_a, next_logp = actor.sample(next_obs, gen)
        q_next = state.critic_target(next_obs, next_a).min(dim=0).values - alpha * next_logp
        target = reward + discount * (~batch["next_terminated"]).float() * q_next

    q = critic(obs, action)  # [2, B]
    td = q - target
    # Importance weights correct prioritized sampling (all ones under uniform replay).
    critic_loss = 0.5 * (batch["weights"] * td.pow(2)).sum(0).mean()
    state.critic_opt.zero_grad(set_to_none=True)
    critic_loss.backward()
    state.critic_opt.step()
    metrics = {"critic_loss": float(critic_loss.detach()), "q": float(q.detach().mean()), "alpha": float(alpha)}

    if state.updates % cfg.policy_frequency == 0:
        # Actor: minimise alpha * log pi(a|s) - min_i Q_i(s, a), a reparameterised. The critic is
        # frozen for this backward (no weight gradients computed for it, and none left behind).
        a, logp = actor.sample(obs, gen)
        critic.requires_grad_(False)
        q_pi = critic(obs, a).min(dim=0).values
        actor_loss = (alpha * logp - q_pi).mean()
        loss = actor_loss
        if cfg.autotune:
            # Temperature: raise alpha while the entropy is below target, lower it above. Its loss
            # shares no parameter with the actor's (logp detached here, alpha detached there), so
            # one backward serves both: the same gradients as two, for the cost of one.
            loss = loss - (state.log_alpha * (logp.detach() + state.target_entropy)).mean()
            state.alpha_opt.zero_grad(set_to_none=True)
        state.actor_opt.zero_grad(set_to_none=True)
        loss.backward()
        state.actor_opt.step()
        if cfg.autotune:
            state.alpha_opt.step()
        critic.requires_grad_(True)
        metrics["actor_loss"] = float(actor_loss.detach())
        metrics["entropy"] = float(-logp.detach().mean())

    polyak_(state.critic_target, critic, cfg.tau)
    state.updates += 1
    if not cfg.priorities:
        return metrics, None
    return metrics, td.detach().abs().mean(0) + cfg.priority_eps


# ---------------------------------------------------------------------------------------------- checkpoint


def state_dict(state: State) -> dict[str, Any]:
    """Networks, optimizers, temperature, update count and the generator's state."""
    return {
        "actor": state.actor.state_dict(), "critic": state.critic.state_dict(),
        "critic_target": state.critic_target.state_dict(), "log_alpha": state.log_alpha.detach().clone(),
        "actor_opt": state.actor_opt.state_dict(), "critic_opt": state.critic_opt.state_dict(),
        "alpha_opt": state.alpha_opt.state_dict(), "updates": state.updates,
        "generator": state.generator.get_state(),
    }


def load_state_dict(state: State, d: dict[str, Any]) -> None:
    state.actor.load_state_dict(d["actor"])
    state.critic.load_state_dict(d["critic"])
    state.critic_target.load_state_dict(d["critic_target"])
    with torch.no_grad():
        state.log_alpha.copy_(d["log_alpha"])
    state.actor_opt.load_state_dict(d["actor_opt"])
    state.critic_opt.load_state_dict(d["critic_opt"])
    state.alpha_opt.load_state_dict(d["alpha_opt"])
    state.updates = int(d["updates"])
    restore_generator(state.generator, d["generator"])
