"""The page size of the bulk transport's shared memory (reactor/transport/_shm.py, "Pages"): a segment
of 2 MiB or more is advised for transparent huge pages, so where the host's /dev/shm allows them
(huge=advise) the owner's and the readers' mappings are on 2 MiB pages; where it does not (the
default huge=never) the same segment is on 4 KiB pages with the same contents.

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
    print(name, "pmd_kb", pmd_kb(name), "checksum", checksum, "pages", rows * 2048 // 4096)
    reader.close_reader()
    seg.close_owner()
"""


def _run(huge: str) -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace with its own /dev/shm)")
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size=64m,huge={huge} tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable,
         _SCRIPT.format(root=ROOT)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    if proc.returncode != 0 and "huge" in proc.stderr and "mount" in proc.stderr:
        pytest.skip(f"this kernel's tmpfs takes no huge= option: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    allowed, *_rest = proc.stdout.splitlines()
    out["allowed"] = allowed
    for line in _rest:
        name, _, kb, _, checksum, _, pages = line.split()
        out[name] = (int(kb), int(checksum), int(pages))
    assert set(out) == {"allowed", "/rxb.pages.r.big", "/rxb.pages.r.small"}, proc.stdout
    return out


@pytest.mark.timeout(120)
def test_a_large_segment_is_on_huge_pages_for_owner_and_reader_where_dev_shm_allows_them():
    got = _run("advise")
    assert got["allowed"] == "allowed True /dev/shm is mounted with huge=advise", got  # what the benchmarks print
    kb, checksum, pages = got["/rxb.pages.r.big"]
    assert checksum == 7 * pages  # every page read back as written
    # The 8 MiB of data (after a 4 KiB header) hold three whole 2 MiB pages; owner and reader map
    # each with one entry.
    assert kb >= 2 * 3 * 2048, got
    small_kb, small_sum, small_pages = got["/rxb.pages.r.small"]
    assert small_sum == 7 * small_pages and small_kb == 0, got  # under 2 MiB: never advised


@pytest.mark.timeout(120)
def test_under_the_default_mount_the_same_segment_is_on_small_pages_with_the_same_contents():
    got = _run("never")
    assert got["allowed"] == "allowed False /dev/shm is mounted with huge=never", got
    kb, checksum, pages = got["/rxb.pages.r.big"]
    assert checksum == 7 * pages and kb == 0, got


def test_a_shard_with_a_large_ring_says_once_when_dev_shm_keeps_it_on_small_pages(caplog, monkeypatch):
    """The shard's log line (reactor/nodes/replay.py): once a process, only for a ring of 64 MB or
    more, only where huge pages are not allowed, naming why."""
    from reactor.nodes import replay
    from reactor.transport import _shm

    for allowed in (False, True):
        monkeypatch.setattr(replay, "_PAGES_SAID", False)
        monkeypatch.setattr(replay, "huge_pages_allowed", lambda a=allowed: (a, "/dev/shm is mounted with huge=X"))
        caplog.clear()
        with caplog.at_level("INFO", logger="reactor"):
            replay._say_page_size("replay[0]", (64 << 20) - 1)  # small: nothing, and still unsaid
            replay._say_page_size("replay[0]", 300 << 20)
            replay._say_page_size("replay[1]", 300 << 20)  # once a process
        said = [r.getMessage() for r in caplog.records if "pages" in r.getMessage()]
        if allowed:
            assert said == []
        else:
            assert said == ["replay[0]: its 300 MB ring in /dev/shm is on 4 KiB pages (/dev/shm is mounted with "
                            "huge=X); `mount -o remount,huge=advise /dev/shm` puts it on 2 MiB pages, for faster "
                            "window reads (docs/cluster.md, \"Tuning a host\")"]
    # The real answer on this host is one of the two, with its reason.
    assert _shm.huge_pages_allowed()[1].startswith(("/dev/shm is mounted with huge=", "shmem_enabled is", "this kernel"))
