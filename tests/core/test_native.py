"""reactor._native allocators: host_empty (the replay and bulk readers' fresh batches) and
host_huge_zeros (replay rings and sum trees on transparent huge pages)."""

from __future__ import annotations

import gc
import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from reactor._native import HUGE_PAGE_NBYTES, host_empty, host_huge_zeros
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


def _thp_mode() -> str | None:
    """The kernel's THP setting for anonymous memory ("always", "madvise", "never"), None if absent."""
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not p.exists():
        return None
    return p.read_text().split("[", 1)[1].split("]", 1)[0]


def _mapping_of(addr: int) -> dict[str, int] | None:
    """The /proc/self/smaps entry holding ``addr``: its range and kB counters; None if unmapped."""
    entry: dict[str, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if entry is not None:
                return entry
            if lo <= addr < hi:
                entry = {"start": lo, "end": hi}
        elif entry is not None and head.endswith(":") and line.split()[-1] == "kB":
            entry[head[:-1]] = int(line.split()[1])
    return entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_host_huge_zeros_gives_a_zeroed_writable_tensor_on_a_huge_page_boundary(dtype):
    shape = (HUGE_PAGE_NBYTES // 4 + 3, 5)  # > 2 MiB for every dtype here
    t = host_huge_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_NBYTES == 0
    assert not bool(t.any())
    t[-1] = 1  # the last element is inside the mapping
    assert int(t.count_nonzero()) == 5


def test_host_huge_zeros_below_a_huge_page_is_a_plain_zeroed_tensor():
    t = host_huge_zeros((100, 3), torch.float64)
    assert t.shape == (100, 3) and not bool(t.any())
    t.fill_(2.0)
    assert float(t.sum()) == 600.0


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_host_huge_zeros_lives_as_long_as_a_view_and_is_unmapped_after():
    t = host_huge_zeros((1 << 20,), torch.float64)  # 8 MiB
    view = t[100:200]
    addr = t.data_ptr()
    del t
    gc.collect()
    view.fill_(3.0)  # still mapped: the view holds the mapping
    assert float(view.sum()) == 300.0 and _mapping_of(addr) is not None
    del view
    gc.collect()
    m = _mapping_of(addr)
    assert m is None or m["end"] - m["start"] < (8 << 20), "the 8 MiB mapping is gone"


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="the kernel offers no transparent huge pages")
def test_host_huge_zeros_memory_is_backed_by_huge_pages_when_the_kernel_offers_them():
    t = host_huge_zeros((4 << 20,), torch.float64)  # 32 MiB: 16 huge pages
    t.fill_(1.0)  # fault it in
    m = _mapping_of(t.data_ptr())
    assert m is not None
    assert m.get("AnonHugePages", 0) >= 2048, m  # at least one 2 MiB page (THP may fall back under fragmentation)


def test_a_large_host_storage_keeps_its_fields_on_huge_page_boundaries():
    st = Storage([FieldSpec("obs", (8,), torch.float32), FieldSpec("done", (), torch.bool)], 1 << 20)
    assert st._fields["obs"].data_ptr() % HUGE_PAGE_NBYTES == 0  # 32 MiB: a huge-page ring
    assert st._fields["done"].data_ptr() % 64 == 0  # 1 MiB: a plain tensor


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs THP in madvise mode (under 'always' all memory is huge)")
def test_host_huge_zeros_backs_no_huge_page_past_the_data():
    """Only the data's whole 2 MiB pages are advised: touching the last byte of a tensor of 4 MiB
    less 4 KiB maps one ordinary page there, not a huge page reaching into the mapping's slack (the
    2 MiB of slack always leave room for that huge page, whatever the alignment offset)."""
    t = host_huge_zeros(((4 << 20) - 4096,), torch.uint8)
    t[-1] = 1
    m = _mapping_of(t.data_ptr() + t.numel() - 1)
    # (The tail may share its mapping entry with neighbouring unadvised memory, so Rss says little;
    # in madvise mode unadvised memory never holds huge pages.)
    assert m is not None and m.get("AnonHugePages", 0) == 0, m
    t[0] = 1  # the first 2 MiB are advised: a huge page
    head = _mapping_of(t.data_ptr())
    assert head is not None and head.get("AnonHugePages", 0) == 2048, head
