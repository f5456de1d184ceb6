"""A Replay shard's configuration from plain values: selectors, rate limiters, read kinds and field specs
given by name or dict (what an app's config file and the command line can say)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..replay import (
    EpisodeRead,
    FieldSpec,
    Fifo,
    Lifo,
    MaxHeap,
    MinHeap,
    MinSize,
    Prioritized,
    Queue,
    RateLimiter,
    SampleToInsertRatio,
    Selector,
    Stack,
    StepRead,
    TransitionRead,
    Uniform,
    WindowRead,
)

__all__ = ["parse_fields", "parse_read"]

_SELECTORS: dict[str, type[Selector]] = {
    c.__name__.lower(): c for c in (Uniform, Prioritized, Fifo, Lifo, MaxHeap, MinHeap)
}
_LIMITERS: dict[str, type[RateLimiter]] = {
    c.__name__.lower(): c for c in (MinSize, SampleToInsertRatio, Queue, Stack)
}
_READS: dict[str, type[Any]] = {c.__name__.lower(): c for c in (StepRead, TransitionRead, WindowRead, EpisodeRead)}


def _split_config(what: str, config: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(config, str):
        return config.lower(), {}
    if isinstance(config, Mapping) and isinstance(config.get("type"), str):
        args = {k: v for k, v in config.items() if k != "type"}
        return config["type"].lower(), args
    raise TypeError(
        f"Replay {what} must be a name like 'prioritized' or a dict like {{'type': 'Prioritized', 'alpha': 0.6}}, "
        f"got {config!r}"
    )


def _make_selector(what: str, config: Any) -> Selector:
    kind, args = _split_config(what, config)
    cls = _SELECTORS.get(kind)
    if cls is None:
        raise ValueError(f"Replay {what}: unknown selector {kind!r}; use one of {sorted(_SELECTORS)}")
    try:
        return cls(**args)
    except (TypeError, ValueError) as e:  # (named: the selector's own message does not say which setting)
        raise type(e)(f"Replay {what} {config!r}: {e}") from None


def _make_limiter(config: Any) -> RateLimiter:
    kind, args = _split_config("rate_limiter", config)
    cls = _LIMITERS.get(kind)
    if cls is None:
        raise ValueError(f"Replay rate_limiter: unknown limiter {kind!r}; use one of {sorted(_LIMITERS)}")
    if isinstance(args.get("error_buffer"), list):
        args["error_buffer"] = tuple(args["error_buffer"])
    try:
        return cls(**args)
    except (TypeError, ValueError) as e:  # (named: the limiter's own message does not say which setting)
        raise type(e)(f"Replay rate_limiter {config!r}: {e}") from None


def parse_fields(fields: Sequence[Any]) -> list[FieldSpec]:
    """Field specs from ``FieldSpec``s, ``(name, shape, dtype)`` tuples or ``{"name", "shape", "dtype"}`` dicts.

    ``dtype`` may be a ``torch.dtype`` or its name (``"float32"``, ``"torch.int64"``).

    Raises:
        ValueError: an entry of another form, or an unknown dtype name.
    """
    out = []
    for f in fields:
        if isinstance(f, FieldSpec):
            out.append(f)
            continue
        if isinstance(f, Mapping):
            name, shape, dtype = f.get("name"), f.get("shape", ()), f.get("dtype", torch.float32)
        elif isinstance(f, (tuple, list)) and 1 <= len(f) <= 3:
            name, shape, dtype = (*f, (), torch.float32)[:3] if len(f) == 1 else (*f, torch.float32)[:3]
        else:
            raise ValueError(f"Replay field {f!r}: give a FieldSpec, (name, shape, dtype) or a dict")
        if isinstance(dtype, str):
            resolved = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(resolved, torch.dtype):
                raise ValueError(f"Replay field {name!r}: unknown dtype {dtype!r}; use a torch dtype name like 'float32'")
            dtype = resolved
        out.append(FieldSpec(name, tuple(shape), dtype))
    return out


def parse_read(read: Any) -> StepRead | TransitionRead | WindowRead | EpisodeRead:
    """A read kind from an instance or a dict like ``{"type": "WindowRead", "length": 32}``."""
    if isinstance(read, (StepRead, TransitionRead, WindowRead, EpisodeRead)):
        return read
    kind, args = _split_config("read", read)
    cls = _READS.get(kind)
    if cls is None:
        raise ValueError(f"Replay read: unknown read kind {kind!r}; use one of {sorted(_READS)}")
    if "next_fields" in args:
        args["next_fields"] = tuple(args["next_fields"])
    return cls(**args)  # type: ignore[no-any-return]
