"""RL algorithms as fragments: plain functions over tensors (the MSRL idea).

An algorithm is one module that imports nothing of the runtime (only torch, numpy and the replay
engine's read-kind descriptions). The nodes (``EnvActor``, ``Learner``, ``Evaluator``) call its
fragments; a distribution policy decides where each node runs, so the same algorithm code runs in
one process, across processes, or with data-parallel learners, unchanged.

The fragment contract (every name is required unless marked optional)::

    KIND: "off_policy" | "on_policy"
    ACTIONS: "discrete" | "continuous"    optional: the action spaces it acts in (a gymnasium
                                Discrete or Box); an env of the other kind is refused, naming both
    OBSERVATIONS: "flat" | "box"  optional: the observations it takes, a Box of shape (n,) ("flat",
                                the default: every algorithm here) or of any shape ("box": a CNN's
                                images); an env of others is refused, naming its space
    Config                      frozen dataclass of hyper-parameters, paper defaults, with
                                Config.from_dict(d) -> Config (unknown keys raise ValueError)
    store(obs_space, act_space, config) -> StoreSpec(fields, read)       # off_policy only
        fields: [(name, shape, torch.dtype)] stored per env step; the EnvActor fills "obs",
        "action", "reward", "terminated" (when listed) and act()'s extras by name
        read: how the learner's batches are read (TransitionRead(n, gamma) or WindowRead(T, pad))
    init(obs_space, act_space, config, seed, device="cpu") -> state
                                networks, optimizers, counters; on ``device`` (a torch device: the
                                learner's, e.g. cuda), with any generator ``learn`` draws from made
                                there too. ``device`` is optional for algorithms that only run on CPU
    policy_weights(state) -> {name: tensor}                  what actors and evaluators need
    make_policy(obs_space, act_space, config) -> policy      actor-side object (no optimizer)
    load_weights(policy, weights)                            weights from policy_weights()
    act(policy, obs[N, ...], step, generator, greedy=False) -> (action[N, ...], extras)
        step: the actor's env-step count (exploration schedules); generator: the actor's seeded
        torch.Generator (all randomness of acting comes from it); extras: {name: tensor[N, ...]}
        stored with the step (off-policy) or sent in the rollout (on-policy: log-probs, values)
    learn(state, batch) -> (metrics {name: float}, priorities tensor[B] | None)
        off-policy batch: the read's fields plus "weights" (importance weights, float32[B]);
        on-policy batch: [T, N, ...] tensors from the actors (N = all actors' envs): "obs",
        "action", "reward", "terminated", "truncated", act()'s extras, "final_obs" (the obs an
        episode ended on where it ended, zeros elsewhere: truncations bootstrap from it), plus
        "last_obs" [N, ...] (the obs after the last step)
    state_dict(state) -> dict;  load_state_dict(state, dict)  (networks, optimizers, counters)
    reset(policy, ended: bool ndarray[N])      optional: agents with memory forget ended episodes
    Config.rollout_length                      on_policy: steps per actor per update

The nodes check it (``reactor/nodes/_contract.py``): what a module defines when it is loaded, what a
fragment returns on its first call, each refused in one line naming the fragment.

Algorithms here: ``dqn`` (double Q, dueling, n-step, prioritized), ``ppo``, ``sac``, ``td3``,
``ddpg`` and ``transformer_dqn`` (a causal transformer Q-network over sequence windows).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

__all__ = ["ALGORITHMS", "StoreSpec", "config_from_dict", "get_algorithm", "restore_generator"]

ALGORITHMS = ("dqn", "ppo", "sac", "td3", "ddpg", "transformer_dqn")

C = TypeVar("C")


class StoreSpec(NamedTuple):
    """What an off-policy algorithm stores per step and how its learner reads it back."""

    fields: list[tuple[str, tuple[int, ...], Any]]
    read: Any


def config_from_dict(cls: type[C], d: dict[str, Any]) -> C:
    """``cls(**d)`` for a frozen Config dataclass, each value checked against its default's type.

    An int is accepted where a float is expected, and a list where a tuple is (JSON and msgpack, which
    carry configs to other processes and into config.json, have no tuples); nothing else is converted
    (``"False"`` is not a bool). A float must be finite, alone or in a tuple: no field here means
    anything by a NaN or an infinity (a NaN learning rate trains a NaN network to the run's end).

    Raises:
        ValueError: a key that is not a field of ``cls`` (naming it and the fields), or a value of
            the wrong type or not finite (naming the field, the expected type and the value).
    """
    names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ValueError(f"{cls.__module__}.{cls.__qualname__} has no field {unknown[0]!r}; fields: {sorted(names)}")
    out: dict[str, Any] = {}
    for k, v in d.items():
        default = names[k].default
        want = type(default) if default is not dataclasses.MISSING and default is not None else None
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            try:
                v = float(v)
            except OverflowError:
                raise ValueError(f"{cls.__qualname__}.{k} expects a float, got an int of {v.bit_length()} bits, too large for one") from None
        elif want is tuple and isinstance(v, list):
            v = tuple(v)
        elif want is not None and not isinstance(v, want) or (want is int and isinstance(v, bool)):
            meant = isinstance(v, str) and want is bool and v.lower() in ("true", "false")
            raise ValueError(f"{cls.__qualname__}.{k} expects {want.__name__}, got {v!r}"  # type: ignore[union-attr]
                             + (f" (write {v.capitalize()}: Python's spelling)" if meant else ""))
        if any(isinstance(x, float) and not math.isfinite(x) for x in (v if type(v) in (tuple, list) else (v,))):
            raise ValueError(f"{cls.__qualname__}.{k} expects finite numbers, got {v!r}")
        out[k] = v
    return cls(**out)


def restore_generator(generator: Any, saved: Any) -> bool:
    """Put ``saved`` (a ``get_state()``) into ``generator`` when it is a state of the same kind of
    generator; a CPU generator's state and a CUDA one's differ, so a checkpoint moved between a CPU
    and a GPU learner (or loaded for acting on the CPU) keeps this generator's seeded stream instead.

    Returns:
        True when the state was restored.
    """
    if getattr(saved, "shape", None) != generator.get_state().shape:
        return False
    generator.set_state(saved.cpu())  # a state is a CPU ByteTensor, whichever device the checkpoint was mapped to
    return True


def get_algorithm(name: str) -> ModuleType:
    """The fragment module of a registered algorithm.

    Raises:
        ValueError: ``name`` is not one of :data:`ALGORITHMS`.
    """
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)} "
                         f"(or a module path such as 'mypkg.my_algo')")
    return importlib.import_module(f"{__name__}.{name}")
