"""Fragments run with denormals flushed, and the caller's setting survives a run in its process."""

from __future__ import annotations

import numpy as np
import torch

from reactor.nodes._registry import _flushing, denormals_flushed


def test_denormals_are_flushed_inside_and_the_thread_setting_is_restored_after():
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal in float32
    assert not _flushing() and float(tiny * 1.0) > 0
    with denormals_flushed():
        assert _flushing() and float(tiny * 1.0) == 0.0
    assert not _flushing() and float(tiny * 1.0) > 0  # restored: nothing leaks into the caller
    try:
        torch.set_flush_denormal(True)  # a caller who wants it on keeps it on
        with denormals_flushed():
            assert _flushing()
        assert _flushing()
    finally:
        torch.set_flush_denormal(False)
    assert np.float32(1e-39) > 0
