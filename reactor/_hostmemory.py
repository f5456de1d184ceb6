"""What memory this host has left for a process of it (stdlib only: the launcher reads it before it
imports torch or numba)."""

from __future__ import annotations

#: The memory cgroup files a container sees of its own cgroup, v2 then v1: its limit, its usage, and
#: the ``memory.stat`` key of its usage that is clean page cache, reclaimed before the OOM killer acts.
_CGROUPS = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
             "inactive_file"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file"))


def available_host_bytes() -> int | None:
    """The memory this process can still fill before the kernel's OOM killer ends it: the host's
    ``MemAvailable`` plus free swap, or less where its memory cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``, as a container sees them) allows less: its limit less its usage
    without its inactive page cache (the working set, as the kubelet counts it; ``MemAvailable``
    counts page cache as available too).

    For refusing a size that cannot fit before it is allocated (a replay capacity with a zero too many
    was killed by the OOM killer after ~20 GB, without a word)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
        avail = info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        return None
    for limit, usage, stat, inactive in _CGROUPS:
        try:
            with open(limit) as f:
                text = f.read().strip()
            if text == "max" or int(text) >= 1 << 60:
                continue
            with open(usage) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        # Page cache is charged to the cgroup that read or wrote it and stays there until the limit
        # presses: a container that wrote checkpoints or logs sat at its limit, "0 bytes available".
        cache = 0
        try:
            with open(stat) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == inactive:
                        cache = int(value)
                        break
        except (OSError, ValueError):
            pass
        avail = min(avail, max(0, int(text) - max(0, used - cache)))
    return avail
