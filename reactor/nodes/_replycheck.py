"""Checks of what a replay shard sends a requester: its figures (mass, minimum, size, beta) and its
drawn items (keys, probabilities, times sampled). Shared by the client's message path
(:mod:`reactor.nodes.replay_client`) and its one-sided samples of shards on other hosts
(:mod:`reactor.nodes._onesided_remote`).

Each check returns what is wrong, in words, or None. A reply that fails one is malformed: the client
drops it and logs why (a peer's message is never fatal), and draws its sample again.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from ._shardkeys import KEY_SHARD_BITS

__all__ = ["figures_problem", "items_problem"]


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def figures_problem(mass: Any, min_mass: Any, size: Any, beta: Any, *, drew: bool) -> str | None:
    """What is wrong with a shard's figures, or None. ``drew``: they come with items, so the mass
    they were drawn from is positive (a shard with no mass answers with its figures alone)."""
    if not (_real(mass) and math.isfinite(mass) and (mass > 0 if drew else mass >= 0)):
        return f"its mass {mass!r:.40} is not a finite number {'> 0 (it drew items)' if drew else '>= 0'}"
    if not (_real(min_mass) and min_mass > 0):  # (inf: no item has a weight)
        return f"its min_mass {min_mass!r:.40} is not a number > 0"
    if not (isinstance(size, numbers.Integral) and not isinstance(size, bool) and size >= 0):
        return f"its size {size!r:.40} is not an int >= 0"
    if not (_real(beta) and math.isfinite(beta) and beta >= 0):
        return f"its beta {beta!r:.40} is not a finite number >= 0"
    return None


def _array(what: str, a: Any, dtype: type, n: int | None) -> str | None:
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1 or (n is not None and a.shape[0] != n):
        got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        return f"its {what} are not a 1-D {np.dtype(dtype)} array{'' if n is None else f' of length {n}'} (got {got})"
    return None


def items_problem(keys: Any, probabilities: Any, times_sampled: Any, *, asked: int, shard: int | None) -> str | None:
    """What is wrong with a shard's drawn items, or None: int64 keys (tagged with ``shard``; None:
    the shard's own keys, untagged), float64 probabilities in (0, 1], int64 times sampled >= 0, as
    many of each, and no more than the ``asked`` (a deterministic selector may draw fewer)."""
    why = _array("keys", keys, np.int64, None)
    if why:
        return why
    n = keys.shape[0]
    if n > asked:
        return f"it sent {n} items for a request of {asked}"
    why = _array("probabilities", probabilities, np.float64, n) or _array("times sampled", times_sampled, np.int64, n)
    if why:
        return why
    if n == 0:
        return None
    if shard is None:
        if keys.min() < 0 or keys.max() >> KEY_SHARD_BITS:
            return f"a key is outside [0, 2**{KEY_SHARD_BITS})"
    elif not ((keys >> KEY_SHARD_BITS) == shard).all():
        return f"a key is not tagged with shard {shard}"
    if not ((probabilities > 0) & (probabilities <= 1)).all():  # (NaN fails both)
        bad = probabilities[~((probabilities > 0) & (probabilities <= 1))][0]
        return f"probability {float(bad)!r} is not in (0, 1]"
    if times_sampled.min() < 0:
        return "a times sampled is negative"
    return None
