"""What a sample returns for an item: the read kinds of a :class:`~reactor.replay.Table`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["EpisodeRead", "ReadSpec", "StepRead", "TransitionRead", "WindowRead"]


@dataclass(frozen=True)
class StepRead:
    """Sample the anchor step: field -> ``[B, *shape]``."""


@dataclass(frozen=True)
class TransitionRead:
    """Sample n-step transitions from the anchor (see :meth:`Storage.read_transitions`).

    Attributes:
        n: steps summed into the return (>= 1).
        gamma: discount in [0, 1].
        reward_field: the field holding per-step rewards.
        next_fields: fields also read at the bootstrap step, returned as ``next_<f>``.
    """

    n: int = 1
    gamma: float = 0.99
    reward_field: str = "reward"
    next_fields: tuple[str, ...] = ("obs",)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"TransitionRead n must be an int >= 1, got {self.n!r}")
        if not (0.0 <= self.gamma <= 1.0):
            raise ValueError(f"TransitionRead gamma must be in [0, 1], got {self.gamma!r}")
        object.__setattr__(self, "next_fields", tuple(self.next_fields))


@dataclass(frozen=True)
class WindowRead:
    """Sample fixed-length windows ``[B, length, ...]`` plus ``mask`` (see :meth:`Storage.read_windows`).

    Attributes:
        length: window length T (>= 1).
        pad: "tail" (window starts at the anchor) or "head" (window ends at the anchor).
    """

    length: int
    pad: Literal["head", "tail"] = "tail"

    def __post_init__(self) -> None:
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"WindowRead length must be an int >= 1, got {self.length!r}")
        if self.pad not in ("head", "tail"):
            raise ValueError(f"WindowRead pad must be 'head' or 'tail', got {self.pad!r}")


@dataclass(frozen=True)
class EpisodeRead:
    """Sample the anchor's whole episode: fields concatenated ``[sum(lengths), ...]`` plus ``lengths``."""


ReadSpec = StepRead | TransitionRead | WindowRead | EpisodeRead
_READS: dict[str, type[Any]] = {c.__name__: c for c in (StepRead, TransitionRead, WindowRead, EpisodeRead)}
