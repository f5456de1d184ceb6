"""``available_host_bytes`` inside a real memory cgroup, as a container sees its own (as root: a child
cgroup of this process's, bind-mounted where a container finds its cgroup, in a mount namespace of its
own)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]

# In the cgroup: writes a file (clean page cache, charged to the cgroup), then says what the function
# finds and the cgroup's own limit and usage.
PROBE = r"""
import json, os, sys
from reactor._hostmemory import available_host_bytes
limit, usage, path, mib = sys.argv[1:]
with open(path, "wb") as f:
    for _ in range(int(mib)):
        f.write(os.urandom(1 << 20))
    f.flush()
    os.fsync(f.fileno())
print(json.dumps({"available": available_host_bytes(), "limit": int(open(limit).read().strip()),
                  "usage": int(open(usage).read().strip())}))
"""


def _own_memory_cgroup() -> tuple[Path, str, str, str] | None:
    """This process's memory cgroup directory, where a container sees its own, and its limit and usage
    files; or None."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] == "memory"), None)
    if v1 is not None and Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        return Path("/sys/fs/cgroup/memory" + v1), "/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
    v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2 is not None and controllers.exists() and "memory" in controllers.read_text().split():
        return Path("/sys/fs/cgroup" + v2), "/sys/fs/cgroup", "memory.max", "memory.current"
    return None


@contextlib.contextmanager
def _cgroup_of(limit_bytes: int) -> Iterator[tuple[Path, str, str, str]]:
    """A new child of this process's memory cgroup limited to ``limit_bytes``: its directory, where a
    container sees its own cgroup, and its limit and usage files (skips where none can be made);
    removed after (its processes must have ended)."""
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup controller here")
    parent, mount_at, limit, usage = found
    cg = parent / f"reactor-test-{uuid.uuid4().hex[:12]}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        try:
            (cg / limit).write_text(str(limit_bytes))
        except OSError as e:  # (v2: a cgroup with processes may not give its children controllers)
            pytest.skip(f"cannot limit a memory cgroup here: {e}")
        yield cg, mount_at, limit, usage
    finally:
        cg.rmdir()  # (its processes ended: empty; their page cache goes to the parent)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_a_containers_page_cache_is_not_counted_as_memory_it_cannot_have(tmp_path):
    """A container whose cgroup holds clean page cache (checkpoints, logs, a dataset read) is charged for
    it up to its limit: limit - usage said it had nearly nothing left, and its daemon refused every
    worker, its runs and a replay table their memory, though the kernel reclaims that cache first.
    Counted as the kubelet counts a working set, the cache is available."""
    with _cgroup_of(256 * MiB) as (cg, mount_at, limit, usage):
        # Join the cgroup, then see it where a container sees its own; 160 MiB of page cache in 256.
        script = (f'echo $$ > {cg}/cgroup.procs && mount --bind {cg} {mount_at} && '
                  f'exec "$0" -c "$1" {mount_at}/{limit} {mount_at}/{usage} {tmp_path / "cache"} 160')
        try:
            got = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                                  sys.executable, PROBE], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
        finally:
            (tmp_path / "cache").unlink(missing_ok=True)
    assert got.returncode == 0, got.stderr
    said = json.loads(got.stdout)
    assert said["limit"] == 256 * MiB
    assert said["limit"] - said["usage"] < 128 * MiB, said  # the cache was charged to it
    assert said["available"] > 200 * MiB, said  # ... and counts as available


NESTED_PROBE = r"""
import json
from reactor._hostmemory import available_host_bytes
print(json.dumps({"available": available_host_bytes()}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_the_limit_of_a_cgroup_below_the_mounts_root_holds(tmp_path):
    """A process whose memory cgroup is below the controller's mount root (started by systemd with
    ``MemoryMax=``, or in a cgroup nested in another, no namespace of its own) was judged by the root's
    files only, which set no limit: a 256 MiB cgroup was said to have the host's ~20 GiB, and a replay
    capacity or a run's workers past it were taken until its OOM killer acted. Its own limit, and every
    parent's, now hold."""
    with _cgroup_of(256 * MiB) as (cg, _mount_at, _limit, _usage):
        got = subprocess.run(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" -c "$1"', sys.executable,
                              NESTED_PROBE], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert got.returncode == 0, got.stderr
    said = json.loads(got.stdout)
    assert 0 < said["available"] <= 256 * MiB, said
