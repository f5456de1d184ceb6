"""reactor._native.host_empty: the allocator behind the replay and bulk readers' fresh batches."""

from __future__ import annotations

import platform

import numpy as np
import pytest
import torch

from reactor._native import host_empty
from reactor.replay import FieldSpec, Storage


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.uint8, torch.float16])
def test_host_empty_gives_a_writable_cpu_tensor_of_the_asked_shape_and_dtype(dtype):
    t = host_empty((3, 4, 5), dtype)
    assert t.shape == (3, 4, 5) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    t.fill_(1)
    assert bool((t == 1).all())


def test_host_empty_falls_back_to_torch_for_dtypes_without_a_numpy_twin():
    t = host_empty((2, 3), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
    t.fill_(2.5)
    assert float(t.sum()) == 15.0


def test_tensors_alive_together_never_share_memory():
    a, b = host_empty((1000,), torch.float64), host_empty((1000,), torch.float64)
    a.fill_(1.0)
    b.fill_(2.0)
    assert float(a.sum()) == 1000.0 and float(b.sum()) == 2000.0


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the address reuse is glibc malloc's behaviour")
def test_a_dropped_window_batch_hands_its_memory_to_the_next_one():
    """The point of host_empty: a reader's next batch lands where the dropped one was (still cached)."""
    st = Storage([FieldSpec("obs", (8,), torch.float32), FieldSpec("done", (), torch.bool)], 1 << 14)
    rng = np.random.default_rng(0)
    n = 1 << 14
    st.append({"obs": torch.from_numpy(rng.normal(size=(n, 8)).astype(np.float32)),
               "done": torch.zeros(n, dtype=torch.bool)}, episode_end=rng.random(n) < 0.01)
    lo, hi = st.step_range
    for _ in range(3):  # glibc raises its mmap threshold after the first large free
        st.read_windows(rng.integers(lo, hi, 256), 32)
    addrs = set()
    for _ in range(5):
        batch = st.read_windows(rng.integers(lo, hi, 256), 32)
        addrs.add(batch["obs"].data_ptr())
        del batch
    assert len(addrs) == 1
