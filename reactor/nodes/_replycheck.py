"""Checks of what a replay shard sends a requester: its figures (mass, minimum, size, beta), its
drawn items (keys, probabilities, times sampled) and, on the client's message path, its reply as a
whole (``_reply_problem``: its data or its plan of rows, and their layout). The first two are shared
by the client's message path (:mod:`reactor.nodes.replay_client`) and its one-sided samples of shards
on other hosts (:mod:`reactor.nodes._onesided_remote`).

Each check returns what is wrong, in words, or None. A reply that fails one is malformed: the client
drops it and logs why (a peer's message is never fatal), and draws its sample again.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
import torch

from ._shardkeys import KEY_SHARD_BITS
from .messages import ReplayReply, ShardMass, ShardSample

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


#: The numpy dtypes a reply's data may have: those torch.from_numpy takes (in this byte order).
_NUMPY_TO_TORCH = {np.dtype(n): getattr(torch, n) for n in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
    "complex64", "complex128")}


def _what(x: Any) -> str:
    """An array's dtype and shape, or what else ``x`` is (for a message)."""
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, (np.ndarray, torch.Tensor)) else type(x).__name__


def _reply_problem(reply: ReplayReply, asked: int) -> str | None:
    """What is wrong with a shard's answer to a request for ``asked`` items (0: figures only) that
    can be told without its region, or None (its plan of rows is checked once its region is
    attached: :meth:`ReplayClient._plan_layout`)."""
    if not isinstance(reply, (ShardMass, ShardSample)):
        return f"a {type(reply).__name__} is no answer to a request"
    if not isinstance(reply.error, str):
        return f"its error {reply.error!r:.40} is not a str"
    sample = isinstance(reply, ShardSample)
    why = figures_problem(reply.mass, reply.min_mass, reply.size, reply.beta, drew=sample)
    if why or not sample:
        return why
    assert isinstance(reply, ShardSample)
    if asked < 1:
        return "it sent items for a request of none"
    why = items_problem(reply.keys, reply.probabilities, reply.times_sampled, asked=asked, shard=reply.shard)
    if why:
        return why
    if reply.descriptor is not None and not isinstance(reply.descriptor, dict):
        return f"its descriptor is a {type(reply.descriptor).__name__}, not a dict"
    if _bulk_part(reply):
        return None if reply.data is None else "it sent both data and a plan of rows"
    data, n = reply.data, len(reply.keys)
    if not isinstance(data, dict) or not data:
        return f"it sent neither data nor a plan of rows (data: {_what(data)})"
    # Whole episodes (EpisodeRead): their steps one after another, and their `lengths` [n] (a stored field
    # of that name is refused there); every other read: a row per item.
    lengths = data.get("lengths")
    rows = {n}
    if isinstance(lengths, (torch.Tensor, np.ndarray)) and tuple(lengths.shape) == (n,) and not (
            lengths.dtype.is_floating_point if isinstance(lengths, torch.Tensor) else lengths.dtype.kind not in "iu"):
        if n and int(lengths.min()) < 0:
            return "its episode lengths are not all >= 0"
        rows.add(int(lengths.sum()))
    for name, v in data.items():
        if not isinstance(name, str):
            return f"a field name {name!r:.40} is not a str"
        if not (isinstance(v, torch.Tensor) or (isinstance(v, np.ndarray) and v.dtype in _NUMPY_TO_TORCH)) or (
                v.ndim < 1 or v.shape[0] not in rows):
            return (f"its field {name!r:.40} is not a numeric array of length {' or '.join(map(str, sorted(rows)))} "
                    f"(got {_what(v)})")
    return None


def _data_layout(data: dict[str, Any]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """A data reply's fields: name -> (dtype, shape of an item)."""
    return {name: (v.dtype if isinstance(v, torch.Tensor) else _NUMPY_TO_TORCH[v.dtype], tuple(v.shape[1:]))
            for name, v in data.items()}


def _describe(layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> str:
    return "{" + ", ".join(f"{k}: {str(d).removeprefix('torch.')} {list(s)}" for k, (d, s) in sorted(layout.items())) + "}"


def _bulk_part(p: ShardSample) -> bool:
    """Whether the reader gathers this part's rows itself (else its data came in the reply)."""
    return p.rows is not None or p.windows is not None
