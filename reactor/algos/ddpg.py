"""DDPG: Deep Deterministic Policy Gradient (Lillicrap et al. 2016), with Gaussian exploration.

Reads top to bottom: config, networks, ``act``, ``learn``. A deterministic actor ``mu(s)`` climbs
the gradient of one critic ``Q(s, mu(s))``; the critic learns one-step targets from slowly moving
target copies of both networks (Polyak ``tau``). Defaults are "OurDDPG" of Fujimoto et al. 2018
(the re-tuned DDPG baseline of the TD3 paper: 256-256 networks, Adam 3e-4, batch 256, tau 0.005,
Gaussian noise 0.1 instead of the original Ornstein-Uhlenbeck process), which learns faster than
the 2016 settings (400-300, actor 1e-4, critic 1e-3 with L2 1e-2, batch 64, tau 0.001).

Fragments (``reactor.algos`` contract): ``KIND``, ``Config``, ``store``, ``init``,
``policy_weights``, ``make_policy``, ``load_weights``, ``act``, ``learn``, ``state_dict``,
``load_state_dict``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from . import StoreSpec
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
    """DDPG hyper-parameters; defaults are OurDDPG's (Fujimoto et al. 2018, github.com/sfujim/TD3)."""

    hidden: tuple[int, ...] = (256, 256)
    """Hidden layer widths of the actor and of the critic."""
    actor_lr: float = 3e-4
    """Adam step size of the actor."""
    critic_lr: float = 3e-4
    """Adam step size of the critic."""
    gamma: float = 0.99
    """Discount."""
    tau: float = 0.005
    """Polyak step of the target networks per update."""
    n_step: int = 1
    """Steps summed into the critic's target (1: the paper's one-step target)."""
    exploration_noise: float = 0.1
    """Std of the Gaussian acting noise, in units of half the action range."""
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
        object.__setattr__(self, "hidden", check_hidden(self.hidden, "ddpg"))
        check_positive(self, "ddpg Config", ("actor_lr", "critic_lr", "tau", "n_step"))
        if not 0.0 <= self.gamma <= 1.0 or not self.tau <= 1.0:
            raise ValueError(f"ddpg Config: gamma and tau must be in [0, 1], got gamma={self.gamma}, tau={self.tau}")
        for name in ("exploration_noise", "learning_starts"):
            if getattr(self, name) < 0:
                raise ValueError(f"ddpg Config.{name} must be >= 0, got {getattr(self, name)!r}")


def store(obs_space: Any, act_space: Any, config: Config) -> StoreSpec:
    """obs, action (env units), reward, terminated per step; n-step transitions for the learner."""
    return store_transitions(obs_space, act_space, config.n_step, config.gamma)


# ---------------------------------------------------------------------------------------------- networks


@dataclass
class State:
    """Learner state: actor, critic, their targets, optimizers, counters."""

    actor: DeterministicActor
    actor_target: DeterministicActor
    critic: QEnsemble
    critic_target: QEnsemble
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer
    config: Config
    updates: int = 0


def init(obs_space: Any, act_space: Any, config: Config, seed: int, device: str | torch.device = "cpu") -> State:
    """Networks (seeded by the caller's torch seed) and Adam optimizers, on ``device``. DDPG's learn draws no
    random numbers, so ``seed`` is not used here."""
    low, high = check_box(act_space, "ddpg")
    obs_dim, act_dim = int(obs_space.shape[0]), int(low.shape[0])
    actor = DeterministicActor(obs_dim, act_dim, config.hidden, low, high).to(device)
    critic = QEnsemble(obs_dim, act_dim, config.hidden, k=1).to(device)  # one critic: an ensemble of one
    return State(
        actor, copy.deepcopy(actor).requires_grad_(False), critic, copy.deepcopy(critic).requires_grad_(False),
        adam(actor.parameters(), config.actor_lr),
        adam(critic.parameters(), config.critic_lr),
        config,
    )


def policy_weights(state: State) -> dict[str, torch.Tensor]:
    """The actor's weights (and its action bounds): all that acting needs."""
    return {k: v.detach().clone() for k, v in state.actor.state_dict().items()}


@dataclass
class Policy:
    """Actor-side object: the actor network and the config (no critic, no optimizer)."""

    actor: DeterministicActor
    config: Config


def make_policy(obs_space: Any, act_space: Any, config: Config) -> Policy:
    low, high = check_box(act_space, "ddpg")
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
    """One DDPG update of the critic, the actor and both targets.

    Returns:
        metrics, and ``|TD| + priority_eps`` per item when ``config.priorities``, else None.
    """
    cfg = state.config
    actor, critic = state.actor, state.critic
    obs, reward, discount = batch["obs"].float(), batch["reward"], batch["discount"]
    action = actor.box.to_unit(batch["action"])  # the critic sees [-1, 1] actions, like the actor's output

    with torch.no_grad():
        next_obs = batch["next_obs"].float()
        # y = r + gamma^m * (1 - terminal) * Q'(s', mu'(s')). Easy to miss: next_terminated (not
        # truncation) stops the bootstrap.
        q_next = state.critic_target(next_obs, state.actor_target(next_obs))[0]
        target = reward + discount * (~batch["next_terminated"]).float() * q_next

    q = critic(obs, action)[0]
    td = q - target
    critic_loss = (batch["weights"] * td.pow(2)).mean()  # importance weights: ones when uniform
    state.critic_opt.zero_grad(set_to_none=True)
    critic_loss.backward()
    state.critic_opt.step()

    # Actor: maximise Q(s, mu(s)); the critic is frozen for this backward.
    critic.requires_grad_(False)
    actor_loss = -critic(obs, actor(obs))[0].mean()
    state.actor_opt.zero_grad(set_to_none=True)
    actor_loss.backward()
    state.actor_opt.step()
    critic.requires_grad_(True)

    polyak_(state.actor_target, actor, cfg.tau)
    polyak_(state.critic_target, critic, cfg.tau)
    state.updates += 1
    metrics = {"critic_loss": float(critic_loss.detach()), "actor_loss": float(actor_loss.detach()), "q": float(q.detach().mean())}
    if not cfg.priorities:
        return metrics, None
    return metrics, td.detach().abs() + cfg.priority_eps


# ---------------------------------------------------------------------------------------------- checkpoint


def state_dict(state: State) -> dict[str, Any]:
    """Networks, optimizers and the update count."""
    return {
        "actor": state.actor.state_dict(), "actor_target": state.actor_target.state_dict(),
        "critic": state.critic.state_dict(), "critic_target": state.critic_target.state_dict(),
        "actor_opt": state.actor_opt.state_dict(), "critic_opt": state.critic_opt.state_dict(),
        "updates": state.updates,
    }


def load_state_dict(state: State, d: dict[str, Any]) -> None:
    state.actor.load_state_dict(d["actor"])
    state.actor_target.load_state_dict(d["actor_target"])
    state.critic.load_state_dict(d["critic"])
    state.critic_target.load_state_dict(d["critic_target"])
    state.actor_opt.load_state_dict(d["actor_opt"])
    state.critic_opt.load_state_dict(d["critic_opt"])
    state.updates = int(d["updates"])
