"""A small but real algorithm for node tests: linear Q-learning with epsilon-greedy acting.

It follows the fragment contract of ``reactor.algos`` (KIND, Config, store, init, policy_weights,
make_policy, load_weights, act, learn, state_dict, load_state_dict) with nothing else, so the nodes
can be tested quickly and independently of the tuned algorithms.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import torch

from reactor.replay import TransitionRead

KIND = "off_policy"


@dataclass(frozen=True)
class Config:
    lr: float = 0.01
    gamma: float = 0.99
    n_step: int = 2
    epsilon: float = 0.2

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Config:
        names = {f.name for f in fields(cls)}
        return cls(**{k: type(getattr(cls, k))(v) for k, v in d.items() if k in names})


class StoreSpec(NamedTuple):
    fields: list[tuple[str, tuple[int, ...], torch.dtype]]
    read: Any


def store(obs_space: Any, act_space: Any, config: Config) -> StoreSpec:
    return StoreSpec(
        [("obs", tuple(obs_space.shape), torch.float32), ("action", (), torch.int64),
         ("reward", (), torch.float32), ("terminated", (), torch.bool)],
        TransitionRead(config.n_step, config.gamma, next_fields=("obs", "terminated")),
    )


@dataclass
class State:
    q: torch.nn.Linear
    opt: torch.optim.Optimizer
    config: Config
    updates: int = 0


def init(obs_space: Any, act_space: Any, config: Config, seed: int) -> State:
    torch.manual_seed(seed)
    q = torch.nn.Linear(obs_space.shape[0], int(act_space.n))
    return State(q, torch.optim.SGD(q.parameters(), lr=config.lr), config)


def policy_weights(state: State) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.q.state_dict().items()}


def make_policy(obs_space: Any, act_space: Any, config: Config) -> dict[str, Any]:
    return {"q": torch.nn.Linear(obs_space.shape[0], int(act_space.n)), "config": config}


def load_weights(policy: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    policy["q"].load_state_dict(weights)


def act(policy: dict[str, Any], obs: torch.Tensor, step: int, generator: torch.Generator,
        greedy: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.no_grad():
        q = policy["q"](obs.float())
    action = q.argmax(dim=1)
    if not greedy:
        n = q.shape[1]
        explore = torch.rand(len(obs), generator=generator) < policy["config"].epsilon
        action = torch.where(explore, torch.randint(n, (len(obs),), generator=generator), action)
    return action, {}


def learn(state: State, batch: dict[str, torch.Tensor]) -> tuple[dict[str, float], torch.Tensor]:
    q = state.q(batch["obs"]).gather(1, batch["action"].view(-1, 1)).squeeze(1)
    with torch.no_grad():
        nxt = state.q(batch["next_obs"]).max(dim=1).values
        target = batch["reward"] + batch["discount"] * (~batch["next_terminated"]).float() * nxt
    td = target - q
    loss = (batch["weights"] * td.pow(2)).mean()
    state.opt.zero_grad()
    loss.backward()
    state.opt.step()
    state.updates += 1
    return {"loss": float(loss.detach())}, td.abs().detach() + 1e-3


def state_dict(state: State) -> dict[str, Any]:
    return {"q": state.q.state_dict(), "opt": state.opt.state_dict(), "updates": state.updates}


def load_state_dict(state: State, d: dict[str, Any]) -> None:
    state.q.load_state_dict(d["q"])
    state.opt.load_state_dict(d["opt"])
    state.updates = int(d["updates"])
