"""What memory this host has left for a process of it (stdlib only: the launcher reads it before it
imports torch or numba)."""

from __future__ import annotations


def available_host_bytes() -> int | None:
    """The memory this process can still fill before the kernel's OOM killer ends it: the host's
    ``MemAvailable`` plus free swap, or less where its memory cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``, as a container sees them) allows less. None where it cannot be read.

    For refusing a size that cannot fit before it is allocated (a replay capacity with a zero too many
    was killed by the OOM killer after ~20 GB, without a word)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
        avail = info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        return None
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f:
                text = f.read().strip()
            if text == "max" or int(text) >= 1 << 60:
                continue
            with open(usage) as f:
                avail = min(avail, max(0, int(text) - int(f.read().strip())))
        except (OSError, ValueError):
            continue
    return avail
