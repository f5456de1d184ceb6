"""The fragment contract (``reactor.algos``' docstring), checked where reactor meets an algorithm's module.

An algorithm of one's own that breaks the contract failed inside reactor, naming nothing of it: an
``act`` returning a numpy array was ``'numpy.ndarray' object has no attribute 'numpy'`` in the actor,
a nested ``policy_weights`` ``'OrderedDict' object has no attribute 'detach'`` in the learner, a
``learn`` returning its metrics alone ``'str' object has no attribute 'items'`` (a dict of two keys
unpacks into two strings), actions of shape [N, 1] an assertion inside the env. Each is refused here
in one line (a ``ValueError`` raised by reactor: a refusal), naming the algorithm, the fragment and
what it must return.

What a module defines is checked when it is loaded (:func:`check_module`); what a fragment returns on
its first call by each node (:func:`check_act`, :func:`check_learn`, :func:`check_policy_weights`), so
the per-step paths pay one flag test.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["algorithm_name", "check_act", "check_config", "check_learn", "check_module", "check_policy_weights",
           "check_state_dict"]

#: Where the contract is written, for every message.
CONTRACT = "the fragment contract: docs/guide.md section 4, reactor.algos' docstring"

#: The functions every algorithm defines (``store`` too, off-policy); ``reset`` is optional.
FRAGMENTS = ("init", "policy_weights", "make_policy", "load_weights", "act", "learn", "state_dict",
             "load_state_dict")


def algorithm_name(module: ModuleType) -> str:
    """The name an app gives for ``module``: ``dqn`` for ``reactor.algos.dqn``, a user's module's own."""
    return module.__name__.removeprefix("reactor.algos.")


def check_module(name: str, module: ModuleType) -> None:
    """Refuse a module that lacks a part of the contract, naming every part missing.

    Raises:
        ValueError: a fragment, ``KIND`` or ``Config`` is missing (or not a function, a class), ``KIND``,
            ``ACTIONS`` or ``OBSERVATIONS`` is not one of its words, or ``Config`` has no ``from_dict``.
    """
    kind = getattr(module, "KIND", None)
    fragments = FRAGMENTS + (("store",) if kind == "off_policy" else ())
    missing = [n for n in ("KIND", "Config") if not hasattr(module, n)]
    missing += [f for f in fragments if not callable(getattr(module, f, None))]
    where = f"algorithm {name!r} ({getattr(module, '__file__', None) or module.__name__})"
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}: every algorithm module defines KIND, Config, "
                         f"{', '.join(FRAGMENTS)} (and store, off-policy) ({CONTRACT})")
    if kind not in ("off_policy", "on_policy"):
        raise ValueError(f"{where}: KIND must be 'off_policy' or 'on_policy', got {kind!r:.80} ({CONTRACT})")
    actions = getattr(module, "ACTIONS", None)
    if actions not in (None, "discrete", "continuous"):
        raise ValueError(f"{where}: ACTIONS must be 'discrete' or 'continuous' (or left out), got {actions!r:.80} "
                         f"({CONTRACT})")
    observations = getattr(module, "OBSERVATIONS", None)
    if observations not in (None, "flat", "box"):
        raise ValueError(f"{where}: OBSERVATIONS must be 'flat' or 'box' (or left out: flat), got "
                         f"{observations!r:.80} ({CONTRACT})")
    config = module.Config
    if not isinstance(config, type) or not callable(getattr(config, "from_dict", None)):
        raise ValueError(f"{where}: its Config must be a class with a from_dict(d) classmethod (reactor makes the "
                         f"Config from a dict of settings): add `@classmethod def from_dict(cls, d): return "
                         f"config_from_dict(cls, d)`, with `from reactor.algos import config_from_dict` ({CONTRACT})")


def check_config(module: ModuleType, config: Any) -> None:
    """Refuse an on-policy algorithm's Config whose ``rollout_length`` is not an int >= 1 (the actors'
    rollouts: one of 0 or -5 was collected as 1 step, silently; the shipped PPO's Config refuses its own).

    Raises:
        ValueError: naming the algorithm, the key and the value.
    """
    if module.KIND != "on_policy":
        return
    name = algorithm_name(module)
    if not hasattr(config, "rollout_length"):
        raise ValueError(f"algorithm {name!r}: an on-policy algorithm's Config has rollout_length (env steps per "
                         f"actor env per update, an int >= 1); {type(config).__qualname__} has none ({CONTRACT})")
    v = config.rollout_length
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"algorithm {name!r}: Config.rollout_length must be an int >= 1 (env steps per actor env "
                         f"per update), got {v!r:.80}")


def check_act(module: ModuleType, out: Any, rows: int, act_space: Any) -> None:
    """Refuse what ``act`` returned for ``rows`` observations unless it is ``(actions, extras)``:
    a tensor of one action per row, shaped as ``act_space`` is (a Discrete space's action a scalar, an
    integer), and a dict of tensors with a row each.

    Raises:
        ValueError: naming the algorithm, what it returned and what it must return.
    """
    import torch

    if not (isinstance(out, tuple) and len(out) == 2):
        raise _refusal(module, f"act must return (actions, extras), a tensor of actions [N, ...] and a dict of tensors; it "
                     f"returned {_what(out)}")
    action, extras = out
    if not isinstance(action, torch.Tensor):
        raise _refusal(module, f"act must return its actions as a torch.Tensor [N, ...], got {_what(action)} "
                     f"(torch.as_tensor makes one)")
    shape = getattr(act_space, "shape", None)
    discrete = type(act_space).__name__ == "Discrete"
    if shape is not None and tuple(action.shape) != (rows, *shape):
        raise _refusal(module, f"act returned actions of shape {tuple(action.shape)} for {rows} observation(s) of an env "
                     f"whose action space is {act_space}: expected {(rows, *shape)}, one action per observation"
                     + (" (a Discrete action is a scalar)" if discrete else ""))
    if discrete and (action.is_floating_point() or action.is_complex()):
        raise _refusal(module, f"act returned actions of {action.dtype} for an env whose action space is {act_space}: "
                     f"discrete actions are integers (.long())")
    bad = _first_bad(extras, lambda k, v: isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() >= 1
                     and v.shape[0] == rows)
    if bad:
        raise _refusal(module, f"act's extras must be a dict of tensors [N, ...] by name (N = {rows}, a row per "
                     f"observation; {{}} for none), got {bad}")


def check_learn(module: ModuleType, out: Any, rows: int | None) -> None:
    """Refuse what ``learn`` returned unless it is ``(metrics, priorities)``: a dict of numbers by
    name, and a tensor of one priority per item of the batch (``rows``; off-policy) or None.

    Raises:
        ValueError: naming the algorithm, what it returned and what it must return.
    """
    import torch

    if not (isinstance(out, tuple) and len(out) == 2):
        raise _refusal(module, f"learn must return (metrics, priorities), a dict of numbers by name and a tensor [B] or None; "
                     f"it returned {_what(out)}" + (" (its metrics alone? return (metrics, None))"
                                                    if isinstance(out, dict) else ""))
    metrics, priorities = out
    bad = _first_bad(metrics, lambda k, v: isinstance(k, str) and _number(v))
    if bad:
        raise _refusal(module, f"learn's metrics must be a dict of numbers by name (each logged; a one-element tensor "
                     f"will do), got {bad}")
    if priorities is None:
        return
    if not isinstance(priorities, torch.Tensor) or (rows is not None and tuple(priorities.shape) != (rows,)):
        raise _refusal(module, f"learn's priorities must be None or a torch.Tensor [B], one per item of the batch"
                     f"{f' (B = {rows})' if rows is not None else ''}, got {_what(priorities)}")


def check_policy_weights(module: ModuleType, weights: Any) -> None:
    """Refuse what ``policy_weights`` returned unless it is a flat dict of tensors by name (what
    actors load, what is hashed and sent).

    Raises:
        ValueError: naming the algorithm, what it returned and what it must return.
    """
    import torch

    bad = _first_bad(weights, lambda k, v: isinstance(k, str) and isinstance(v, torch.Tensor))
    if bad:
        raise ValueError(f"algorithm {algorithm_name(module)!r}: policy_weights must return a flat dict of "
                         f"torch.Tensors by name (a module's state_dict(); several merged under prefixed names), "
                         f"got {bad} ({CONTRACT})")


def check_state_dict(module: ModuleType, state: Any) -> None:
    """Refuse what ``state_dict`` returned unless ``learner.pt`` can hold it and give it back: a dict of
    tensors, numbers, strings, and dicts, lists and tuples of them (the learner's checkpoint is loaded
    with ``weights_only=True``; a Config in it saved without complaint and failed in ``reactor eval``,
    ``load_policy`` or a resume, in torch's cut-off words).

    Raises:
        ValueError: naming the algorithm, where in the state, and what it found.
    """
    import torch

    name = algorithm_name(module)
    if not isinstance(state, dict):
        raise ValueError(f"algorithm {name!r}: state_dict must return a dict of tensors and plain containers (a "
                         f"checkpoint is loaded with weights_only=True), got {_what(state)} ({CONTRACT})")
    plain = (torch.Tensor, bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)

    def walk(x: Any, at: str, depth: int) -> None:
        if isinstance(x, plain):
            return
        if depth < 32 and isinstance(x, dict):
            for k, v in x.items():
                if not isinstance(k, (str, int)):
                    raise ValueError(f"algorithm {name!r}: state_dict holds the key {k!r:.60} ({_type(k)}) at "
                                     f"{at or 'its top'}: learner.pt's dicts take str and int keys ({CONTRACT})")
                walk(v, f"{at}[{k!r:.60}]", depth + 1)
            return
        if depth < 32 and type(x) in (list, tuple):
            for i, v in enumerate(x):
                walk(v, f"{at}[{i}]", depth + 1)
            return
        raise ValueError(f"algorithm {name!r}: state_dict holds {_what(x)} at {at}: learner.pt holds tensors, "
                         f"numbers, strings, and dicts, lists and tuples of them (what torch.load(weights_only=True) "
                         f"gives back); save that value's fields instead ({CONTRACT})")

    walk(state, "", 0)


def _refusal(module: ModuleType, what: str) -> ValueError:
    return ValueError(f"algorithm {algorithm_name(module)!r}: {what} ({CONTRACT})")


def _what(x: Any) -> str:
    """What ``x`` is, for a message: its type (with a module, numpy's and torch's), shape or length."""
    name = _type(x)
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"a {name} of shape {tuple(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {name} of {len(x)}: ({', '.join(_type(v) for v in x[:4])}{', ...' if len(x) > 4 else ''})"
    return f"a {name}"


def _first_bad(x: Any, ok: Callable[[Any, Any], bool]) -> str:
    """What is wrong with ``x``, expected a dict whose every entry is ``ok``: ``_what(x)`` when it is not a
    dict, its first entry that is not ``ok``, or "" when all are."""
    if not isinstance(x, dict):
        return _what(x)
    for k, v in x.items():
        if not ok(k, v):
            return f"a dict with {k!r:.40}: {_what(v)}"
    return ""


def _number(v: Any) -> bool:
    """Whether ``float(v)`` gives a metric: a Python or numpy number, or a one-element array or tensor."""
    import numbers

    import numpy as np
    import torch

    if isinstance(v, (numbers.Real, np.generic)):
        return True
    return (isinstance(v, torch.Tensor) and v.numel() == 1) or (isinstance(v, np.ndarray) and v.size == 1)


def _type(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
