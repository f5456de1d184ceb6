"""Shard-tagged replay keys: ``shard << KEY_SHARD_BITS | the shard table's own key``.

Shared by the client (:mod:`reactor.nodes.replay_client`), its one-sided sampling
(:mod:`reactor.nodes._onesided`) and the shards (:mod:`reactor.nodes.replay`); public through
:mod:`reactor.nodes`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..replay.table import _as_int64

__all__ = ["KEY_SHARD_BITS", "key_local", "key_shard", "make_keys"]

#: Keys are ``shard << KEY_SHARD_BITS | local key``: 2^48 local keys (steps) per shard.
KEY_SHARD_BITS = 48
_LOCAL_MASK = (1 << KEY_SHARD_BITS) - 1


def make_keys(shard: int, local: Any) -> np.ndarray:
    """Shard-tagged keys from a shard index and the shard table's own keys (int64 arrays)."""
    return (np.int64(shard) << KEY_SHARD_BITS) | np.asarray(local, dtype=np.int64)


def key_shard(keys: Any) -> np.ndarray:
    """The shard of each shard-tagged key."""
    return _int64_keys(keys) >> KEY_SHARD_BITS


def key_local(keys: Any) -> np.ndarray:
    """The shard table's own key of each shard-tagged key."""
    return _int64_keys(keys) & _LOCAL_MASK


def _int64_keys(keys: Any) -> np.ndarray:
    """``keys`` (a tensor or array) as a 1-D int64 array; TypeError naming them otherwise."""
    return _as_int64("keys", keys)
