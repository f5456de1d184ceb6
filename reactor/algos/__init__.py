"""RL algorithms as fragments: plain functions over tensors (the MSRL idea).

An algorithm is one module that imports nothing of the runtime (only torch, numpy and the replay
engine's read-kind descriptions). The nodes (``EnvActor``, ``Learner``, ``Evaluator``) call its
fragments; a distribution policy decides where each node runs, so the same algorithm code runs in
one process, across processes, or with data-parallel learners, unchanged.

The fragment contract (every name is required unless marked optional)::

    KIND: "off_policy" | "on_policy"
    Config                      frozen dataclass of hyper-parameters, paper defaults, with
                                Config.from_dict(d) -> Config (unknown keys raise ValueError)
    store(obs_space, act_space, config) -> StoreSpec(fields, read)       # off_policy only
        fields: [(name, shape, torch.dtype)] stored per env step; the EnvActor fills "obs",
        "action", "reward", "terminated" (when listed) and act()'s extras by name
        read: how the learner's batches are read (TransitionRead(n, gamma) or WindowRead(T, pad))
    init(obs_space, act_space, config, seed) -> state       networks, optimizers, counters
    policy_weights(state) -> {name: tensor}                  what actors and evaluators need
    make_policy(obs_space, act_space, config) -> policy      actor-side object (no optimizer)
    load_weights(policy, weights)                            weights from policy_weights()
    act(policy, obs[N, ...], step, generator, greedy=False) -> (action[N, ...], extras)
        step: the actor's env-step count (exploration schedules); generator: the actor's seeded
        torch.Generator (all randomness of acting comes from it); extras: {name: tensor[N, ...]}
        stored with the step (off-policy) or sent in the rollout (on-policy: log-probs, values)
    learn(state, batch) -> (metrics {name: float}, priorities tensor[B] | None)
        off-policy batch: the read's fields plus "weights" (importance weights, float32[B]);
        on-policy batch: [T, N, ...] tensors from the actors (N = all actors' envs) + "last_obs"
    state_dict(state) -> dict;  load_state_dict(state, dict)  (networks, optimizers, counters)
    reset(policy, ended: bool ndarray[N])      optional: agents with memory forget ended episodes
    Config.rollout_length                      on_policy: steps per actor per update

Algorithms here: ``dqn`` (double Q, dueling, n-step, prioritized), ``ppo``, ``sac``, ``td3``,
``ddpg`` and ``transformer_dqn`` (a causal transformer Q-network over sequence windows).
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

__all__ = ["ALGORITHMS", "StoreSpec", "config_from_dict", "get_algorithm"]

ALGORITHMS = ("dqn", "ppo", "sac", "td3", "ddpg", "transformer_dqn")

C = TypeVar("C")


class StoreSpec(NamedTuple):
    """What an off-policy algorithm stores per step and how its learner reads it back."""

    fields: list[tuple[str, tuple[int, ...], Any]]
    read: Any


def config_from_dict(cls: type[C], d: dict[str, Any]) -> C:
    """``cls(**d)`` for a frozen Config dataclass, with each value coerced to its field's default's type.

    Raises:
        ValueError: a key that is not a field of ``cls`` (naming it and the fields), or a value that
            does not convert.
    """
    names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{cls.__module__}.{cls.__qualname__} has no field {unknown[0]!r}; fields: {sorted(names)}")
    out: dict[str, Any] = {}
    for k, v in d.items():
        default = names[k].default
        if default is dataclasses.MISSING or default is None or isinstance(v, type(default)):
            out[k] = v
            continue
        try:
            out[k] = type(default)(v)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{cls.__qualname__}.{k} expects {type(default).__name__}, got {v!r}") from e
    return cls(**out)


def get_algorithm(name: str) -> ModuleType:
    """The fragment module of a registered algorithm.

    Raises:
        ValueError: ``name`` is not one of :data:`ALGORITHMS`.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)} "
                         f"(or a module path such as 'mypkg.my_algo')")
    return importlib.import_module(f"{__name__}.{name}")
