"""Ready-made reactors (Replay, EnvActor, Learner, Evaluator, Metrics) and their client objects."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .messages import CheckpointRequest as CheckpointRequest
    from .messages import Delete as Delete
    from .messages import Exhausted as Exhausted
    from .messages import InsertAck as InsertAck
    from .messages import MassRequest as MassRequest
    from .messages import PriorityUpdate as PriorityUpdate
    from .messages import SampledBatch as SampledBatch
    from .messages import SampleRequest as SampleRequest
    from .messages import ShardMass as ShardMass
    from .messages import ShardSample as ShardSample
    from .messages import ShardStatistics as ShardStatistics
    from .messages import StatisticsRequest as StatisticsRequest
    from .messages import Steps as Steps
    from .messages import requester_key as requester_key
    from .messages import shard_key as shard_key
    from .messages import writer_key as writer_key
    from .replay import Replay as Replay
    from .replay import ReplayClient as ReplayClient
    from .replay import key_local as key_local
    from .replay import key_shard as key_shard
    from .replay import make_keys as make_keys
    from .writer import TransitionPattern as TransitionPattern
    from .writer import WindowPattern as WindowPattern
    from .writer import Writer as Writer

#: Each public name -> its module (loaded on first use: `reactor plot` and the command line's
#: checks before a run import no torch).
_WHERE = {
    "CheckpointRequest": "messages",
    "Delete": "messages",
    "Exhausted": "messages",
    "InsertAck": "messages",
    "MassRequest": "messages",
    "PriorityUpdate": "messages",
    "SampledBatch": "messages",
    "SampleRequest": "messages",
    "ShardMass": "messages",
    "ShardSample": "messages",
    "ShardStatistics": "messages",
    "StatisticsRequest": "messages",
    "Steps": "messages",
    "requester_key": "messages",
    "shard_key": "messages",
    "writer_key": "messages",
    "Replay": "replay",
    "ReplayClient": "replay",
    "key_local": "replay",
    "key_shard": "replay",
    "make_keys": "replay",
    "TransitionPattern": "writer",
    "WindowPattern": "writer",
    "Writer": "writer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'reactor.nodes' has no attribute {name!r}")
