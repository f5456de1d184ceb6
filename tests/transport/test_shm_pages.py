"""The page size of the bulk transport's shared memory (reactor/transport/_shm.py, "Pages"): every
segment is reserved when it is made, and one of 2 MiB or more is collapsed into 2 MiB pages
(MADV_COLLAPSE, Linux 6.1+) and mapped at 2 MiB-aligned addresses, so the owner's and the readers'
mappings are on 2 MiB pages under any huge= option of /dev/shm (the default huge=never included);
without the collapse (an older kernel) only huge=advise gives them. A /dev/shm too small for a segment
is an error when it is made.

Each case runs in a mount namespace of its own (unshare: a fresh tmpfs on /dev/shm, with the huge=
option of the case), so the host's /dev/shm is never changed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = str(Path(__file__).resolve().parents[2])

# Creates an 8 MiB segment and a 1 MiB one as an owner does, fills them, maps them again as a
# reader and reads every 4 KiB page; prints, per segment, the kB its mappings map with 2 MiB
# entries (/proc/self/smaps: ShmemPmdMapped of the vmas of its file) and the checksum read.
_SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from reactor.transport import _shm
if {no_collapse!r}:
    _shm._MADV_COLLAPSE = 9999  # EINVAL, as on a kernel before 6.1

def pmd_kb(name):
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a vma's first line
            inside = line.rstrip().endswith("/dev/shm" + name)
        elif inside and line.startswith("ShmemPmdMapped:"):
            total += int(head[1])
    return total

print("allowed", *_shm.huge_pages_allowed())
for name, rows in (("/rxb.pages.r.big", 4096), ("/rxb.pages.r.small", 512)):
    seg = _shm.Segment.create(name, rows=rows, row_nbytes=2048, generation=1)
    seg.data[:] = 7
    reader = _shm.Segment.attach(name)
    checksum = int(reader.data[::4096].sum())
    assert not reader.data.flags.writeable  # a reader's mapping stays read-only
    kept = seg.data[-10:]  # an array still viewing the owner's memory after its close
    print(name, "pmd_kb", pmd_kb(name), "checksum", checksum, "pages", rows * 2048 // 4096, "huge", int(seg.huge))
    reader.close_reader()
    seg.close_owner()
    assert int(kept.sum()) == 70 and name not in _shm.list_segments()
"""


def _run(huge: str, no_collapse: bool = False) -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace with its own /dev/shm)")
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size=64m,huge={huge} tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable,
         _SCRIPT.format(root=ROOT, no_collapse=no_collapse)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    if proc.returncode != 0 and "huge" in proc.stderr and "mount" in proc.stderr:
        pytest.skip(f"this kernel's tmpfs takes no huge= option: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    allowed, *_rest = proc.stdout.splitlines()
    out["allowed"] = allowed
    for line in _rest:
        name, _, kb, _, checksum, _, pages, _, huge = line.split()
        out[name] = (int(kb), int(checksum), int(pages), huge == "1")
    assert set(out) == {"allowed", "/rxb.pages.r.big", "/rxb.pages.r.small"}, proc.stdout
    return out


def _collapses() -> bool:
    """Whether this kernel has MADV_COLLAPSE (6.1+) for shared memory (shmem_enabled=deny refuses it)."""
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    try:
        deny = "[deny]" in Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return False
    return (major, minor) >= (6, 1) and not deny


@pytest.mark.timeout(120)
def test_a_large_segment_is_on_huge_pages_for_owner_and_reader_where_dev_shm_allows_them():
    got = _run("advise")
    assert got["allowed"] == "allowed True /dev/shm is mounted with huge=advise", got  # what the benchmarks print
    kb, checksum, pages, _huge = got["/rxb.pages.r.big"]
    assert checksum == 7 * pages  # every page read back as written
    # The 8 MiB of data (after a 4 KiB header) make 5 whole 2 MiB pages (the segment is rounded up to
    # whole ones); owner and reader map each with one entry.
    assert kb == 2 * 5 * 2048, got
    small_kb, small_sum, small_pages, small_huge = got["/rxb.pages.r.small"]
    assert small_sum == 7 * small_pages and small_kb == 0 and not small_huge, got  # under 2 MiB: 4 KiB pages


@pytest.mark.timeout(120)
def test_under_the_default_mount_a_large_segment_is_collapsed_into_huge_pages_with_the_same_contents():
    """Regression (issue 21): under huge=never (most distributions' /dev/shm) the shards' rings were on
    4 KiB pages, and one-sided window samples ran ~0.1x slower against an in-process table."""
    got = _run("never")
    assert got["allowed"] == "allowed False /dev/shm is mounted with huge=never", got
    kb, checksum, pages, huge = got["/rxb.pages.r.big"]
    assert checksum == 7 * pages, got
    if _collapses():
        assert huge and kb == 2 * 5 * 2048, got
    else:  # an older kernel: the same contents on 4 KiB pages
        assert not huge and kb == 0, got


@pytest.mark.timeout(120)
def test_a_segment_larger_than_dev_shm_is_refused_when_made_not_a_sigbus_later():
    """Its pages are reserved when it is made: a /dev/shm of 4 MiB refuses an 8 MiB segment with ENOSPC
    naming it, leaves nothing behind, and still takes a small one."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace with its own /dev/shm)")
    script = f"""
import errno, sys
sys.path.insert(0, {ROOT!r})
from reactor.transport import _shm
try:
    _shm.Segment.create("/rxb.full.r.big", rows=4096, row_nbytes=2048, generation=1)
except OSError as e:
    print("refused", e.errno == errno.ENOSPC, e.strerror)
print("left", _shm.list_segments())
small = _shm.Segment.create("/rxb.full.r.small", rows=512, row_nbytes=2048, generation=1)
small.data[:] = 1
print("small", int(small.data.sum()))
small.close_owner()
"""
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs -o size=4m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable, script],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "refused True shared memory segment '/rxb.full.r.big' needs 10 MiB and /dev/shm has no room for it "
        "(see `df -h /dev/shm`)",
        "left []",
        f"small {512 * 2048}",
    ], proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("huge", ["advise", "never"])
def test_without_a_collapse_only_a_mount_that_takes_advice_gives_huge_pages(huge):
    """A kernel before 6.1 (no MADV_COLLAPSE: its advice value made invalid here): under huge=advise the
    pages are faulted in through the advised mapping, as 2 MiB ones, and the segment says so; under
    huge=never they stay 4 KiB. Regression: reserving them with posix_fallocate first, which tmpfs
    serves without seeing the advice, kept them on 4 KiB pages under huge=advise too."""
    got = _run(huge, no_collapse=True)
    kb, checksum, pages, is_huge = got["/rxb.pages.r.big"]
    assert checksum == 7 * pages, got
    if huge == "advise":
        assert is_huge and kb == 2 * 5 * 2048, got
    else:
        assert not is_huge and kb == 0, got


_MISALIGNED = """
import sys, types, mmap
sys.path.insert(0, {root!r})
import numpy as np
from reactor.transport import _shm
# Kernels 6.7+ align an anonymous mapping whose length is a multiple of 2 MiB, so the reservation's
# offset is 0 there; 12 KiB more makes the kernel place it anywhere, as older kernels do.
shim = types.SimpleNamespace(**{{k: getattr(mmap, k) for k in dir(mmap) if k.isupper()}})
shim.mmap = lambda fd, n, *a, **k: mmap.mmap(fd, n + (12288 if fd == -1 else 0), *a, **k)
_shm.mmap = shim
seg = _shm.Segment.create("/rxb.mis.r.big", rows=4096, row_nbytes=2048, generation=1)
seg.data.view(np.int64)[:] = np.arange(4096 * 256)
reader = _shm.Segment.attach("/rxb.mis.r.big")
same = bool((reader.data.view(np.int64) == np.arange(4096 * 256)).all())
print("offsets", seg.offset > 0, reader.offset > 0, "same", same, "aligned",
      (reader.data.ctypes.data - 4096) % (2 << 20) == 0, "mapped", *_shm.mapped_kb())
reader.close_reader()
seg.close_owner()
"""


def test_a_segment_mapped_into_a_reservation_that_is_not_aligned_reads_back_what_was_written():
    """The segment starts `offset` bytes into its reservation; a reader and the owner find each other's
    bytes, at a 2 MiB-aligned address, on 2 MiB pages where the kernel collapses."""
    proc = subprocess.run([sys.executable, "-c", _MISALIGNED.format(root=ROOT)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[:8] == ["offsets", "True", "True", "same", "True", "aligned", "True", "mapped"], proc.stdout
    mapped, huge = int(words[8]), int(words[9])
    assert mapped == 2 * 10 * 1024  # two mappings of 10 MiB (8 MiB of rows and the header, in whole 2 MiB)
    assert huge == (mapped if _collapses() else 0), proc.stdout


def test_a_segment_being_made_by_a_live_owner_is_not_stale_however_long_it_takes(tmp_path):
    """Reserving and collapsing a ring of GBs takes seconds; a cleanup meanwhile (another shard's
    start, a daemon's) saw a file whose header was not written yet past its 10 s grace and unlinked
    it under its owner. The header now comes first, with state 0: a live owner's is kept at any age;
    a dead owner's is removed."""
    from reactor.transport import _shm

    name = f"/rxb.making{os.getpid()}.r.big"
    seg = _shm.Segment.create(name, rows=1024, row_nbytes=4096, generation=1)
    try:
        seg.header[1] = 0  # as during its reservation
        os.utime(f"/dev/shm{name}", (1, 1))  # made long ago
        assert _shm.cleanup_stale(f"making{os.getpid()}") == [] and name in _shm.list_segments()
        seg.header[3] = 2**22 + 7  # an owner pid that is not running
        assert _shm.cleanup_stale(f"making{os.getpid()}") == [name] and name not in _shm.list_segments()
    finally:
        seg.close_owner()


def test_a_shard_with_a_large_ring_says_once_when_it_is_not_on_huge_pages(caplog, monkeypatch):
    """The shard's log line (reactor/nodes/_shardmemory.py): once a process, only for a ring of 64 MB or
    more, only where part of it is on 4 KiB pages; with the remount hint where the mount refuses advice."""
    from reactor.nodes import _shardmemory
    from reactor.transport import _shm

    big = 300 << 20
    for allowed in (False, True):
        monkeypatch.setattr(_shardmemory, "_PAGES_SAID", False)
        monkeypatch.setattr(_shardmemory, "huge_pages_allowed", lambda a=allowed: (a, "/dev/shm is mounted with huge=X"))
        caplog.clear()
        with caplog.at_level("INFO", logger="reactor"):
            _shardmemory._say_page_size("replay[0]", 0, (64 << 20) - 1)  # small: nothing, and still unsaid
            _shardmemory._say_page_size("replay[0]", big, big)  # all on 2 MiB pages: nothing
            _shardmemory._say_page_size("replay[0]", big - (100 << 20), big)
            _shardmemory._say_page_size("replay[1]", 0, big)  # once a process
        said = [r.getMessage() for r in caplog.records if "pages" in r.getMessage()]
        hint = "" if allowed else ("; `mount -o remount,huge=advise /dev/shm` (/dev/shm is mounted with huge=X now) "
                                   "lets rings made later fault in 2 MiB pages")
        assert said == [f"replay[0]: 100 of its 300 MB ring in /dev/shm are on 4 KiB pages: the kernel did not "
                        f"collapse them into 2 MiB pages (MADV_COLLAPSE needs Linux 6.1 or later and free 2 MiB "
                        f"pages), so window reads miss the TLB more{hint} (docs/cluster.md, \"Tuning a host\")"]
    # The real answer on this host is one of the two, with its reason.
    assert _shm.huge_pages_allowed()[1].startswith(("/dev/shm is mounted with huge=", "shmem_enabled is", "this kernel"))
