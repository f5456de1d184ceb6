"""Transformer DQN: a small causal transformer Q-network trained on sequence windows from replay.

The sequence agent of GEAR's workload (and the R2D2 recipe with attention in place of an LSTM): the
Q-network reads the last ``window`` observations of the current episode and outputs Q-values at
every position; a causal mask makes position ``t`` see only observations ``<= t``. It solves
partially observable tasks such as ``CartPoleNoVel-v1``, where one observation does not show which
way the pole moves but two or more do.

Reading order (CleanRL style): Config, the network, ``store`` (what replay keeps and how it is read),
acting (the per-env history), learning (per-position double-DQN targets), state dicts.

**Where the padding goes, and why acting and learning see the same contexts.** Let ``T = window``.

* Acting keeps, per env, the episode's last ``min(t + 1, T)`` observations *left-aligned* in a
  ``[N, T]`` buffer (oldest at position 0) and acts on the Q-values at the position of the newest
  one. Positions after it hold zeros, and the causal mask keeps them out of what that position sees.
  Once ``T`` observations are held, the buffer slides by one per step.
* Replay windows are read with ``WindowRead(T + 1, pad="tail")``: ``T + 1`` stored steps starting at
  the sampled anchor, with padding only at the tail (after the episode's final-observation row).
  The online network runs on steps ``[0, T)`` of the window; the bootstrap values for steps
  ``[1, T]`` come from a second pass over steps ``[1, T + 1)``. So every Q-value, learned or
  bootstrapped, is computed from a left-aligned context of at most ``T`` observations of one
  episode, as in acting: position ``k`` of a pass sees ``k + 1`` observations, the newest last.
  Tail padding also never touches a valid position (causal), and it keeps the most important
  transition: the last real step of a terminated episode, whose next row (the final observation,
  ``terminated=True``) is stored but never an anchor itself. With head padding (windows ending at
  the anchor) that final row would never appear in a window, and nothing would learn that the
  episode ends.
* ``window=1`` is plain (double) DQN on single observations: both passes see one observation.

Learning (:func:`targets`, :func:`learn`): each position ``k < T`` whose next step is in the window
gets an n-step double-DQN target (fewer steps where the window's stored steps end first) with a
target network; ``terminated`` is True only on a terminated episode's final row, so truncations
bootstrap. The loss is the Huber loss averaged over a window's valid positions, weighted by the
window's importance weight; the priority of a window is R2D2's mix
``eta * max_k |td_k| + (1 - eta) * mean_k |td_k|``.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from reactor.algos import StoreSpec, config_from_dict
from reactor.algos._common import check_counts, check_nonnegative, check_unit
from reactor.replay import WindowRead

KIND = "off_policy"
ACTIONS = "discrete"

__all__ = [
    "KIND", "Config", "Policy", "QTransformer", "State", "act", "init", "learn", "load_state_dict",
    "load_weights", "make_policy", "policy_weights", "reset", "state_dict", "store", "targets",
]


# ---------------------------------------------------------------------------- config


@dataclass(frozen=True)
class Config:
    """Hyper-parameters: tuned on CartPoleNoVel-v1 for a CPU-sized transformer; where R2D2's value
    (Kapturowski et al. 2019, Atari) differs, the field's doc gives it."""

    window: int = 8
    """Context length T: observations the network sees (acting keeps the last T of the episode;
    replay windows are T + 1 steps, so each of the T positions has its next step). 1: plain DQN."""
    d_model: int = 64
    """Transformer width."""
    n_heads: int = 4
    """Attention heads (must divide d_model)."""
    n_layers: int = 2
    """Transformer blocks."""
    d_ff: int = 128
    """Hidden width of each block's MLP."""
    positions: str = "learned"
    """Position encoding added to the observation embedding: "learned" or "sinusoidal"."""
    lr: float = 5e-4
    """Adam learning rate (R2D2: 1e-4)."""
    gamma: float = 0.99
    """Discount (R2D2: 0.997)."""
    n_step: int = 3
    """Steps of reward per target (R2D2: 5), fewer where the window or the episode ends first."""
    double_q: bool = True
    """Double DQN: the online network picks the bootstrap action, the target network values it."""
    target_update_every: int = 250
    """Learner updates between copies of the online network into the target network (R2D2: 2500)."""
    max_grad_norm: float = 10.0
    """Gradient-norm clip (R2D2 uses 40 with larger returns; 0 turns it off)."""
    priority_eta: float = 0.9
    """R2D2's priority mix: eta * max |td| + (1 - eta) * mean |td| over a window's positions."""
    eps_start: float = 1.0
    """Exploration epsilon at the actor's first step."""
    eps_end: float = 0.05
    """Epsilon after eps_decay_steps (and from then on)."""
    eps_decay_steps: int = 2_500
    """Env steps (each actor counts its own) over which epsilon falls linearly to eps_end (R2D2 gives
    each actor a fixed epsilon instead). Easy to miss: with 10k, runs here reached 400 2-4x later."""
    bf16: bool = True
    """bf16 autocast of the learner's forward passes on a GPU (loss and optimizer in float32); no effect on
    the CPU, where learn runs in float32."""

    def __post_init__(self) -> None:
        check_counts(self, "transformer_dqn Config", ("window", "n_step", "d_model", "n_heads", "n_layers", "d_ff",
                                                      "target_update_every", "eps_decay_steps"))
        if self.d_model % self.n_heads:
            raise ValueError(f"transformer_dqn Config.d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}; pick n_heads dividing d_model")
        if self.positions not in ("learned", "sinusoidal"):
            raise ValueError(f"transformer_dqn Config.positions must be 'learned' or 'sinusoidal', "
                             f"got {self.positions!r}")
        check_unit(self, "transformer_dqn Config", ("gamma", "priority_eta"))
        check_nonnegative(self, "transformer_dqn Config", ("max_grad_norm",))
        if not (0.0 <= self.eps_end <= 1.0 and 0.0 <= self.eps_start <= 1.0):
            raise ValueError(f"transformer_dqn Config.eps_start and eps_end must be in [0, 1], "
                             f"got {self.eps_start!r} and {self.eps_end!r}")
        if not self.lr > 0:
            raise ValueError(f"transformer_dqn Config.lr must be > 0, got {self.lr!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        """Config from a dict of overrides.

        Raises:
            ValueError: an unknown key (naming it and the fields) or a bad value.
        """
        return config_from_dict(cls, d)


# ---------------------------------------------------------------------------- network


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        # The causal mask: position t attends to positions <= t only (later steps, and the tail
        # padding behind the newest observation, never reach it).
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class QTransformer(nn.Module):
    """Causal transformer Q-network: ``[B, L, obs_dim]`` observations -> ``[B, L, n_actions]`` Q-values.

    Args:
        obs_dim: observation size (observations are flattened).
        n_actions: discrete actions.
        config: the algorithm's Config (window, widths, depth, position encoding).

    Example:
        >>> net = QTransformer(2, 2, Config(window=4))
        >>> net(torch.zeros(3, 4, 2)).shape
        torch.Size([3, 4, 2])
    """

    def __init__(self, obs_dim: int, n_actions: int, config: Config) -> None:
        super().__init__()
        d = config.d_model
        self.window = config.window
        self.embed = nn.Linear(obs_dim, d)
        if config.positions == "learned":
            self.pos = nn.Parameter(torch.randn(config.window, d) * 0.02)
        else:
            t = torch.arange(config.window, dtype=torch.float32)[:, None]
            freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10_000.0) / d))
            pe = torch.zeros(config.window, d)
            pe[:, 0::2] = torch.sin(t * freq)
            pe[:, 1::2] = torch.cos(t * freq)
            self.register_buffer("pos", pe)
        self.blocks = nn.ModuleList(_Block(d, config.n_heads, config.d_ff) for _ in range(config.n_layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_actions)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        length = obs.shape[1]
        if length > self.window:
            raise ValueError(f"QTransformer got {length} positions, more than its window {self.window}")
        x = self.embed(obs.flatten(2).float()) + self.pos[:length]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _sizes(obs_space: Any, act_space: Any) -> tuple[int, int]:
    if not hasattr(act_space, "n"):
        raise ValueError(f"transformer_dqn needs a discrete action space, got {act_space!r}")
    return math.prod(obs_space.shape), int(act_space.n)


# ---------------------------------------------------------------------------- what replay stores


def store(obs_space: Any, act_space: Any, config: Config) -> StoreSpec:
    """Fields stored per env step, read back as tail-padded windows of ``window + 1`` steps.

    Returns:
        StoreSpec: obs, action, reward, terminated; ``WindowRead(window + 1, pad="tail")``.
    """
    _sizes(obs_space, act_space)
    return StoreSpec(
        [("obs", tuple(obs_space.shape), torch.float32), ("action", (), torch.int64),
         ("reward", (), torch.float32), ("terminated", (), torch.bool)],
        # Easy to miss: T + 1 steps, so that each of the T learned positions has its next step, and
        # tail padding (see the module docstring: head padding would never show a terminal).
        WindowRead(config.window + 1, pad="tail"),
    )


# ---------------------------------------------------------------------------- acting


@dataclass
class Policy:
    """Actor-side state: the network and, per env, the current episode's last ``window`` observations.

    Attributes:
        net: the Q-network (weights from :func:`load_weights`).
        config: the Config.
        obs_dim, n_actions: the (flattened) observation size and the number of actions.
        history: float32 ``[N, window, obs_dim]``, left-aligned (oldest first); allocated on the
            first :func:`act` (N = that call's batch).
        length: int64 ``[N]``, observations held per env (0 after :func:`reset`).
        q: Q-values ``[N, n_actions]`` the last :func:`act` chose from (for inspection).
    """

    net: QTransformer
    config: Config
    obs_dim: int
    n_actions: int
    history: torch.Tensor | None = None
    length: torch.Tensor | None = None
    q: torch.Tensor | None = None


def make_policy(obs_space: Any, act_space: Any, config: Config) -> Policy:
    """The actor's policy: a Q-network and an empty history."""
    obs_dim, n_actions = _sizes(obs_space, act_space)
    return Policy(QTransformer(obs_dim, n_actions, config).eval(), config, obs_dim, n_actions)


def load_weights(policy: Policy, weights: dict[str, torch.Tensor]) -> None:
    """Load the learner's online-network weights (the history is kept: episodes go on)."""
    policy.net.load_state_dict(weights)


def epsilon(config: Config, step: int) -> float:
    """Linear epsilon schedule over the actor's env steps."""
    frac = min(1.0, step / config.eps_decay_steps)
    return config.eps_start + frac * (config.eps_end - config.eps_start)


def act(policy: Policy, obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Append ``obs`` to each env's history and act epsilon-greedily on the newest position's Q.

    Call once per env step: the call *is* the step's entry in the history.

    Args:
        policy: from :func:`make_policy`.
        obs: ``[N, *obs_shape]`` current observations, one per env.
        step: the actor's env-step count (epsilon schedule).
        generator: all of acting's randomness comes from it.
        greedy: no exploration (evaluation).

    Returns:
        (actions int64 ``[N]``, no extras).

    Raises:
        ValueError: ``N`` differs from the number of envs whose history the policy keeps (one
            policy serves one vector env).
    """
    n = obs.shape[0]
    x = obs.reshape(n, -1).float()
    if policy.history is None:
        policy.history = torch.zeros(n, policy.config.window, policy.obs_dim)
        policy.length = torch.zeros(n, dtype=torch.int64)
    hist, length = policy.history, policy.length
    assert length is not None
    if hist.shape[0] != n:
        raise ValueError(f"transformer_dqn.act got {n} observations, but the policy keeps the history of "
                         f"{hist.shape[0]} envs; use one policy per vector env")
    full = length == policy.config.window
    if bool(full.any()):  # slide: drop the oldest observation
        hist[full] = torch.roll(hist[full], shifts=-1, dims=1)
        length[full] -= 1
    rows = torch.arange(n)
    hist[rows, length] = x
    length += 1
    with torch.no_grad():
        q = policy.net(hist)[rows, length - 1]  # the newest observation's position, per env
    policy.q = q
    action = q.argmax(dim=1)
    if not greedy:
        eps = epsilon(policy.config, step)
        explore = torch.rand(n, generator=generator) < eps
        random_action = torch.randint(policy.n_actions, (n,), generator=generator)
        action = torch.where(explore, random_action, action)
    return action, {}


def reset(policy: Policy, ended: Any) -> None:
    """Forget the history of the envs whose episode ended (``ended``: bool ``[N]``)."""
    if policy.history is None:
        return
    assert policy.length is not None
    mask = torch.as_tensor(ended, dtype=torch.bool).reshape(-1)
    if mask.shape[0] != policy.history.shape[0]:
        raise ValueError(f"transformer_dqn.reset got {mask.shape[0]} flags for {policy.history.shape[0]} envs")
    policy.history[mask] = 0.0
    policy.length[mask] = 0


# ---------------------------------------------------------------------------- learning


@dataclass
class State:
    """Learner-side state: online and target networks, optimizer, update counter."""

    q: QTransformer
    target: QTransformer
    opt: torch.optim.Optimizer
    config: Config
    updates: int = 0


def init(obs_space: Any, act_space: Any, config: Config, seed: int, device: str | torch.device = "cpu") -> State:
    """Networks (target = copy of online), Adam, counters; seeded by ``seed``; on ``device``."""
    obs_dim, n_actions = _sizes(obs_space, act_space)
    torch.manual_seed(seed)
    q = QTransformer(obs_dim, n_actions, config).to(device)
    target = copy.deepcopy(q).requires_grad_(False)
    return State(q, target, torch.optim.Adam(q.parameters(), lr=config.lr), config)


def policy_weights(state: State) -> dict[str, torch.Tensor]:
    """The online network's weights (what actors and evaluators load)."""
    return {k: v.detach().clone() for k, v in state.q.state_dict().items()}


def targets(state: State, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position n-step double-DQN targets of a batch of windows (no gradient).

    Position ``k < T`` takes ``m_k = min(n_step, stored - 1 - k)`` rewards (``stored``: the
    window's steps before the tail padding) and bootstraps from step ``k + m_k``::

        y_k = sum_{i < m_k} gamma^i r_{k+i}
              + gamma^m_k (1 - terminated_{k+m_k}) Q_target(ctx_{k+m_k}, argmax_a Q_online(ctx_{k+m_k}, a))

    where ``ctx_j`` is steps ``[1, j]`` of the window (a left-aligned context of at most T
    observations, as in acting). ``terminated`` is True only on a terminated episode's final row,
    so truncations and window ends bootstrap.

    Args:
        state: from :func:`init`.
        batch: ``obs``, ``reward``, ``terminated``, ``mask`` ``[B, T + 1, ...]``.

    Returns:
        (y float32 ``[B, T]``, valid bool ``[B, T]``: the positions that learn, i.e. whose next
        step is in the window; y is meaningless elsewhere).

    Raises:
        ValueError: windows that are not ``window + 1`` steps long.
    """
    c = state.config
    t = c.window
    obs, mask = batch["obs"].float(), batch["mask"].bool()
    if obs.shape[1] != t + 1:
        raise ValueError(f"transformer_dqn.learn expects windows of window + 1 = {t + 1} steps, got "
                         f"{obs.shape[1]} (the replay must read store()'s WindowRead)")
    reward, terminated = batch["reward"].float(), batch["terminated"].bool()
    # Tail padding makes the mask a prefix: `stored` steps, then padding. A position learns iff
    # m_k > 0: this drops the padded positions and the last stored one (no next inside the
    # window), and no reward or flag past the stored steps is ever read.
    stored = mask.sum(dim=1, keepdim=True)
    k = torch.arange(t, device=obs.device)[None, :]
    m = torch.clamp(stored - 1 - k, min=0, max=c.n_step)  # [B, T]
    valid = m > 0
    ret = torch.zeros(obs.shape[0], t, device=obs.device)
    for i in range(c.n_step):  # sum_i gamma^i r_{k+i} for i < m_k
        r_i = F.pad(reward[:, i:], (0, i))[:, :t]
        ret = ret + torch.where(i < m, c.gamma**i * r_i, torch.zeros_like(r_i))
    boot = (k + m).clamp(max=t)  # the step bootstrapped from: in [1, T] where valid
    done = terminated.gather(1, boot)
    with torch.no_grad():
        # Easy to miss: bootstrap values come from a second pass over steps [1, T], so that each is
        # computed from a context of at most T observations, as in acting (one pass over all T + 1
        # steps would value the last step from T + 1 observations, a context never acted on).
        next_target = state.target(obs[:, 1:])
        if c.double_q:
            next_v = next_target.gather(2, state.q(obs[:, 1:]).argmax(dim=2, keepdim=True)).squeeze(2)
        else:
            next_v = next_target.max(dim=2).values
        v = next_v.gather(1, (boot - 1).clamp(min=0))  # pass position j - 1 holds step j
        y = ret + c.gamma**m * (~done).float() * v
    return y, valid


def learn(state: State, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], torch.Tensor]:
    """One update on a batch of windows ``[B, T + 1, ...]``: Huber loss on :func:`targets`.

    The loss averages over each window's valid positions and weights windows by their importance
    weights; the target network copies the online one every ``target_update_every`` updates.

    Args:
        state: from :func:`init`.
        batch: ``obs``, ``action``, ``reward``, ``terminated``, ``mask`` ``[B, T + 1, ...]`` and
            ``weights`` ``[B]`` (importance weights).

    Returns:
        (metrics: loss, q, td, valid; priorities float32 ``[B]``, one per window: R2D2's
        ``eta * max |td| + (1 - eta) * mean |td|`` over its valid positions).

    Raises:
        ValueError: windows that are not ``window + 1`` steps long.
    """
    c = state.config
    with torch.autocast("cuda", torch.bfloat16, enabled=c.bf16 and batch["obs"].is_cuda):
        y, valid = targets(state, batch)
        obs, action = batch["obs"].float()[:, : c.window], batch["action"][:, : c.window].long()
        q_taken = state.q(obs).gather(2, action.unsqueeze(2)).squeeze(2)  # position k: context steps [0, k]
    y, q_taken = y.float(), q_taken.float()
    # torch.where, not a product with the mask: padded positions may hold anything.
    target = torch.where(valid, y, q_taken.detach())
    n_valid = valid.sum(dim=1).clamp(min=1)
    per_window = F.smooth_l1_loss(q_taken, target, reduction="none").sum(dim=1) / n_valid
    loss = (batch["weights"].float() * per_window).mean()

    state.opt.zero_grad(set_to_none=True)
    loss.backward()
    if c.max_grad_norm > 0:
        nn.utils.clip_grad_norm_(state.q.parameters(), c.max_grad_norm)
    state.opt.step()
    state.updates += 1
    if state.updates % c.target_update_every == 0:
        state.target.load_state_dict(state.q.state_dict())

    abs_td = (target - q_taken.detach()).abs()  # zero at invalid positions
    priorities = c.priority_eta * abs_td.max(dim=1).values + (1 - c.priority_eta) * abs_td.sum(dim=1) / n_valid
    metrics = {
        "loss": float(loss.detach()),
        "q": float(q_taken.detach()[valid].mean()) if bool(valid.any()) else 0.0,
        "td": float(abs_td.sum() / valid.sum().clamp(min=1)),
        "valid": float(valid.float().mean()),
    }
    return metrics, priorities + 1e-3  # a floor, so no window stops being sampled


def state_dict(state: State) -> dict[str, Any]:
    """Networks, optimizer and counter (everything :func:`load_state_dict` needs to resume)."""
    return {"q": state.q.state_dict(), "target": state.target.state_dict(), "opt": state.opt.state_dict(),
            "updates": state.updates}


def load_state_dict(state: State, d: dict[str, Any]) -> None:
    """Restore what :func:`state_dict` saved."""
    state.q.load_state_dict(d["q"])
    state.target.load_state_dict(d["target"])
    state.opt.load_state_dict(d["opt"])
    state.updates = int(d["updates"])
