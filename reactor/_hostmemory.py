"""What memory this host has left for a process of it (stdlib only: the launcher reads it before it
imports torch or numba)."""

from __future__ import annotations

#: Where a memory controller is mounted, v2 then v1, and its files in each cgroup directory: the limit,
#: the usage, and the ``memory.stat`` key of its usage that is clean page cache, reclaimed before the
#: OOM killer acts.
_MOUNTS = (("/sys/fs/cgroup", "memory.max", "memory.current", "inactive_file"),
           ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def _own_cgroups() -> tuple[str, str]:
    """This process's v2 and v1 memory cgroup paths (``/proc/self/cgroup``), "" where it has none."""
    v2 = v1 = ""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                hid, controllers, path = line.rstrip("\n").split(":", 2)
                if hid == "0" and not controllers:
                    v2 = path
                elif "memory" in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def _cgroup_dirs(mount: str, path: str) -> list[str]:
    """The cgroup directories whose limits hold for a process in ``path``: its own, then each parent,
    up to the mount's root (a container sees its own cgroup there; one started by systemd with
    ``MemoryMax=``, or nested in another, has it below). A path outside the mount's view (``/..``)
    leaves only the root."""
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        parts = []
    return [f"{mount}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)] + [mount]


def _cgroup_available(directory: str, limit: str, usage: str, inactive: str) -> int | None:
    """What a cgroup directory's limit leaves: the limit less the usage without its inactive page cache
    (the working set, as the kubelet counts it); None where it sets no limit, or cannot be read."""
    try:
        with open(f"{directory}/{limit}") as f:
            text = f.read().strip()
        if text == "max" or int(text) >= 1 << 60:
            return None
        with open(f"{directory}/{usage}") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return None
    # Page cache is charged to the cgroup that read or wrote it and stays there until the limit
    # presses: a container that wrote checkpoints or logs sat at its limit, "0 bytes available".
    cache = 0
    try:
        with open(f"{directory}/memory.stat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive:
                    cache = int(value)
                    break
    except (OSError, ValueError):
        pass
    return max(0, int(text) - max(0, used - cache))


def available_host_bytes() -> int | None:
    """The memory this process can still fill before the kernel's OOM killer ends it: the host's
    ``MemAvailable`` plus free swap, or less where a memory cgroup it is in (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``: its own, or any above it, as ``/proc/self/cgroup`` names them)
    allows less: that limit less the cgroup's usage without its inactive page cache (the working
    set, as the kubelet counts it; ``MemAvailable`` counts page cache as available too).

    For refusing a size that cannot fit before it is allocated (a replay capacity with a zero too many
    was killed by the OOM killer after ~20 GB, without a word)."""
    try:
        with open("/proc/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f if ":" in line)}
        avail = info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        return None
    for (mount, limit, usage, inactive), path in zip(_MOUNTS, _own_cgroups()):
        for directory in _cgroup_dirs(mount, path):
            got = _cgroup_available(directory, limit, usage, inactive)
            if got is not None:
                avail = min(avail, got)
    return avail
