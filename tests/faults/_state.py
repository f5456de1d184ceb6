"""Bitwise comparison of table states, shared by the fault-injection tests."""

from __future__ import annotations

import numpy as np
import torch


def bitwise_equal(a, b) -> bool:
    """True when two ``Table.state_dict()`` values are equal bit for bit (NaN payloads and -0.0 included)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return np.float64(a).tobytes() == np.float64(b).tobytes()
    return type(a) is type(b) and a == b
