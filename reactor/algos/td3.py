"""TD3: Twin Delayed DDPG (Fujimoto, van Hoof and Meger 2018, "Addressing Function Approximation
Error in Actor-Critic Methods").

Reads top to bottom: config (the authors' defaults), networks, ``act``, ``learn``. DDPG with three
fixes: twin critics with the minimum in the target (clipped double Q), target policy smoothing
(clipped Gaussian noise on the target action), and delayed policy updates (the actor and the
target networks move every ``policy_frequency`` critic updates).

Fragments (``reactor.algos`` contract): ``KIND``, ``Config``, ``store``, ``init``,
``policy_weights``, ``make_policy``, ``load_weights``, ``act``, ``learn``, ``state_dict``,
``load_state_dict``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from . import StoreSpec, restore_generator
from ._common import (
    DeterministicActor,
    QEnsemble,
    adam,
    check_box,
    check_hidden,
    check_positive,
    config_from,
    gaussian_explore,
    polyak_,
    store_transitions,
)

KIND = "off_policy"
ACTIONS = "continuous"


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Config:
    """TD3 hyper-parameters; defaults are the authors' reference implementation (github.com/sfujim/TD3)."""

    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the actor and of each critic."""
    actor_lr: float = 3e-4
    """Adam step size of the actor."""
    critic_lr: float = 3e-4
    """Adam step size of the critics."""
    gamma: float = 0.99
    """Discount."""
    tau: float = 0.005
    """Polyak step of the target networks per delayed update."""
    n_step: int = 1
    """Steps summed into the critic's target (1: the paper's one-step target)."""
    exploration_noise: float = 0.1
    """Std of the Gaussian acting noise, in units of half the action range."""
    policy_noise: float = 0.2
    """Std of the target policy smoothing noise, in units of half the action range."""
    noise_clip: float = 0.5
    """The smoothing noise is clipped to +-noise_clip (same units)."""
    policy_frequency: int = 2
    """Critic updates per actor and target update (the 'delayed' in TD3)."""
    learning_starts: int = 25_000
    """Env steps (per actor) of uniformly random actions before the actor's policy is used."""
    priorities: bool = True
    """learn returns |TD| priorities for prioritized replay (False with a uniform replay: none sent)."""
    priority_eps: float = 1e-3
    """Added to |TD| so no item's priority is zero."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """The defaults overridden by ``d``; unknown keys raise ``ValueError`` naming them."""
        return config_from(cls, d)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", check_hidden(self.hidden, "td3"))
        check_positive(self, "td3 Config", ("actor_lr", "critic_lr", "tau", "n_step", "policy_frequency"))
        if not 0.0 <= self.gamma <= 1.0 or not self.tau <= 1.0:
            raise ValueError(f"td3 Config: gamma and tau must be in [0, 1], got gamma={self.gamma}, tau={self.tau}")
        for name in ("exploration_noise", "policy_noise", "noise_clip", "learning_starts"):
            if getattr(self, name) < 0:
                raise ValueError(f"td3 Config.{name} must be >= 0, got {getattr(self, name)!r}")


def store(obs_space: Any, act_space: Any, config: Config) -> StoreSpec:
    """obs, action (env units), reward, terminated per step; n-step transitions for the learner."""
    return store_transitions(obs_space, act_space, config.n_step, config.gamma)


# ---------------------------------------------------------------------------------------------- networks


@dataclass
class State:
    """Learner state: actor, twin critics, their targets, optimizers, counters, sampling generator."""

    actor: DeterministicActor
    actor_target: DeterministicActor
    critic: QEnsemble
    critic_target: QEnsemble
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer
    config: Config
    generator: torch.Generator
    updates: int = 0


def init(obs_space: Any, act_space: Any, config: Config, seed: int, device: str | torch.device = "cpu") -> State:
    """Networks (seeded by the caller's torch seed), Adam optimizers and the learner's generator, on ``device``."""
    low, high = check_box(act_space, "td3")
    obs_dim, act_dim = int(obs_space.shape[0]), int(low.shape[0])
    actor = DeterministicActor(obs_dim, act_dim, config.hidden, low, high).to(device)
    critic = QEnsemble(obs_dim, act_dim, config.hidden, k=2).to(device)
    return State(
        actor, copy.deepcopy(actor).requires_grad_(False), critic, copy.deepcopy(critic).requires_grad_(False),
        adam(actor.parameters(), config.actor_lr),
        adam(critic.parameters(), config.critic_lr),
        config, torch.Generator(device).manual_seed(seed),
    )


def policy_weights(state: State) -> dict[str, torch.Tensor]:
    """The actor's weights (and its action bounds): all that acting needs."""
    return {k: v.detach().clone() for k, v in state.actor.state_dict().items()}


@dataclass
class Policy:
    """Actor-side object: the actor network and the config (no critics, no optimizer)."""

    actor: DeterministicActor
    config: Config


def make_policy(obs_space: Any, act_space: Any, config: Config) -> Policy:
    low, high = check_box(act_space, "td3")
    return Policy(DeterministicActor(int(obs_space.shape[0]), int(low.shape[0]), config.hidden, low, high), config)


def load_weights(policy: Policy, weights: dict[str, torch.Tensor]) -> None:
    policy.actor.load_state_dict(weights)


# ---------------------------------------------------------------------------------------------- act


def act(policy: Policy, obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Actions ``[N, act_dim]`` in the environment's bounds: ``mu(s)`` when ``greedy``; else uniform
    for the first ``learning_starts`` steps, then ``mu(s)`` plus Gaussian noise, clipped."""
    cfg = policy.config
    return gaussian_explore(policy.actor, obs, step, generator, greedy, cfg.learning_starts,
                            cfg.exploration_noise), {}


# ---------------------------------------------------------------------------------------------- learn


def learn(state: State, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], torch.Tensor | None]:
    """One TD3 update: the critics every call; actor and targets every ``policy_frequency`` calls.

    Returns:
        metrics, and ``|TD| + priority_eps`` per item (mean over the two critics) when
        ``config.priorities``, else None.
    """
    cfg = state.config
    actor, critic = state.actor, state.critic
    obs, reward, discount = batch["obs"].float(), batch["reward"], batch["discount"]
    action = actor.box.to_unit(batch["action"])  # critics see [-1, 1] actions, like the actor's output

    with torch.no_grad():
        next_obs = batch["next_obs"].float()
        # Target policy smoothing: a' = clip(mu'(s') + clip(N(0, policy_noise), +-noise_clip), -1, 1).
        next_a = state.actor_target(next_obs)
        noise = (cfg.policy_noise * torch.randn(next_a.shape, generator=state.generator, device=next_a.device)).clamp(
            -cfg.noise_clip, cfg.noise_clip)
        next_a = (next_a + noise).clamp(-1.0, 1.0)
        # Clipped double Q. Easy to miss: next_terminated (not truncation) stops the bootstrap.
        q_next = state.critic_target(next_obs, next_a).min(dim=0).values
        target = reward + discount * (~batch["next_terminated"]).float() * q_next

    q = critic(obs, action)  # [2, B]
    td = q - target
    critic_loss = (batch["weights"] * td.pow(2)).sum(0).mean()  # importance weights: ones when uniform
    state.critic_opt.zero_grad(set_to_none=True)
    critic_loss.backward()
    state.critic_opt.step()
    metrics = {"critic_loss": float(critic_loss.detach()), "q": float(q.detach().mean())}

    if state.updates % cfg.policy_frequency == 0:
        # Delayed policy update: maximise Q_1(s, mu(s)) (the first critic only, as in the paper).
        # The critic is frozen for this backward: no weight gradients computed for it.
        critic.requires_grad_(False)
        actor_loss = -critic(obs, actor(obs))[0].mean()
        state.actor_opt.zero_grad(set_to_none=True)
        actor_loss.backward()
        state.actor_opt.step()
        critic.requires_grad_(True)
        polyak_(state.actor_target, actor, cfg.tau)
        polyak_(state.critic_target, critic, cfg.tau)
        metrics["actor_loss"] = float(actor_loss.detach())

    state.updates += 1
    if not cfg.priorities:
        return metrics, None
    return metrics, td.detach().abs().mean(0) + cfg.priority_eps


# ---------------------------------------------------------------------------------------------- checkpoint


def state_dict(state: State) -> dict[str, Any]:
    """Networks, optimizers, update count and the generator's state."""
    return {
        "actor": state.actor.state_dict(), "actor_target": state.actor_target.state_dict(),
        "critic": state.critic.state_dict(), "critic_target": state.critic_target.state_dict(),
        "actor_opt": state.actor_opt.state_dict(), "critic_opt": state.critic_opt.state_dict(),
        "updates": state.updates, "generator": state.generator.get_state(),
    }


def load_state_dict(state: State, d: dict[str, Any]) -> None:
    state.actor.load_state_dict(d["actor"])
    state.actor_target.load_state_dict(d["actor_target"])
    state.critic.load_state_dict(d["critic"])
    state.critic_target.load_state_dict(d["critic_target"])
    state.actor_opt.load_state_dict(d["actor_opt"])
    state.critic_opt.load_state_dict(d["critic_opt"])
    state.updates = int(d["updates"])
    restore_generator(state.generator, d["generator"])
