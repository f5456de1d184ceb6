"""Messages of the training nodes (weights, progress reports, rollouts, and the rounds of a bank of
data-parallel learners); msgpack-registered, never pickled."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..transport.codec import register_message

__all__ = ["BankReady", "Report", "Rollout", "Weights"]


@register_message
@dataclass(frozen=True)
class Weights:
    """A policy snapshot from a learner.

    Attributes:
        version: learner updates done when the snapshot was taken (actors report what they act with).
        tensors: parameter name -> CPU tensor (sent as zero-copy frames between processes).
    """

    version: int
    tensors: dict[str, Any]


@register_message
@dataclass(frozen=True)
class Report:
    """Progress from one node: cumulative counters and latest values (e.g. ``env_steps``, ``loss``).

    Attributes:
        source: the reporting instance's name.
        values: name -> number. Counters are cumulative per source; Metrics sums them over sources.
    """

    source: str
    values: dict[str, float]


@register_message
@dataclass(frozen=True)
class Rollout:
    """On-policy data from one actor: ``[T, N, ...]`` tensors plus bootstrap values.

    Attributes:
        actor: the actor's bank index.
        version: the weights version the rollout was collected with.
        data: field -> tensor (``obs``, ``action``, ``reward``, ``terminated``, ``truncated``, the
            algorithm's extras, ``final_obs``: the observation an episode ended on where it ended,
            zeros elsewhere; ``last_obs``).
    """

    actor: int
    version: int
    data: dict[str, Any]


@register_message
@dataclass(frozen=True)
class BankReady:
    """A data-parallel learner's word to its bank (every replica, itself included) on one round.

    Attributes:
        replica: the sender's bank index.
        round: the round, counted from 0 (a replica's k-th batch is its part of round k).
        have: True: the sender holds its batch for the round; False: none will come (the replay
            answered ``Exhausted``), so the bank ends before this round.
    """

    replica: int
    round: int
    have: bool
