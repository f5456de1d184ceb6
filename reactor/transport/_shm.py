"""POSIX shared-memory segments of the bulk transport: naming, header, liveness, stale cleanup.

One segment holds one field of one region: ``/rxb.<run id>.<region>.<field>``, so every process
of a run derives the same name from the same three strings. A segment starts with a 4096-byte
header (the data after it is page-aligned) of little-endian uint64 words:

====  ==================  =========================================================================
word  name                meaning
====  ==================  =========================================================================
0     magic               ``b"RXBULK\\x00\\x01"`` (layout version 1)
1     state               1 live, 2 closed by its owner, 3 owner lost (marked by a later cleanup)
2     generation          the owner's generation (a fresh number per :class:`BulkOwner` opened)
3     owner pid
4     owner start time    the pid's start time (``/proc/PID/stat`` field 22): tells a reused pid
5     owner pid ns        inode of the owner's pid namespace (pids compare only inside one)
6     rows                rows in the segment
7     row nbytes          bytes per row (the data is ``rows * row_nbytes`` bytes)
====  ==================  =========================================================================

Pages: a segment of 2 MiB or more is put on 2 MiB pages wherever the kernel can, so that random
window reads of a ring of hundreds of MB do not miss the TLB at nearly every window
(``docs/benchmarks.md``: the one-sided samples of session 48). Without any change to the host:

- every segment's memory is reserved when it is made: its header's page first (faulted in through
  the mapping, ``MADV_POPULATE_WRITE``), then the rest (``posix_fallocate``), so a ``/dev/shm`` too
  small for it is an ENOSPC naming it then, never a SIGBUS at some later write. A large one is
  rounded up to whole 2 MiB pages;
- the owner then asks the kernel to collapse a large one into 2 MiB pages (``MADV_COLLAPSE``, Linux
  6.1+), which, unlike ``MADV_HUGEPAGE``, does not depend on ``/dev/shm``'s ``huge=`` option (most
  distributions mount it ``huge=never``) or on ``shmem_enabled`` (only ``deny`` refuses). Where the
  mount takes advice (``huge=advise``: the way on kernels before 6.1), its pages are faulted in
  through the advised mapping instead, as 2 MiB ones;
- owner and readers map every large segment at a 2 MiB-aligned address (a reservation 2 MiB larger,
  with the file mapped over its aligned part), so each 2 MiB page of the file is one entry of their
  page tables. The kernel aligns a ``/dev/shm`` mapping only where the mount allows huge pages.

Where the kernel can do neither (older than 6.1 under ``huge=never``, no free 2 MiB pages,
``shmem_enabled=deny``), the segment keeps 4 KiB pages with the same contents;
:attr:`Segment.huge` says which the owner got. The header is written (state 0) before the
reservation, which takes about a second a GB: a cleanup meanwhile sees a live owner making it.

Life cycle: the owner creates a segment with ``O_EXCL`` and writes the header (state last); it
sets state 2 and unlinks on ``aclose()`` and at interpreter exit. If the owner dies (``kill -9``),
the next owner of the same name, or :func:`cleanup_stale`, finds the dead pid, sets state 3 and
unlinks. A reader still mapping that memory sees state != 1 (or the dead pid) at its next read and
raises instead of returning data of a dead generation.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import stat
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

try:  # CPython's own binding of shm_open/shm_unlink (what multiprocessing.shared_memory uses)
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX
    _posixshmem = None

__all__ = [
    "HEADER_NBYTES",
    "HUGE_NBYTES",
    "STATE_CLOSED",
    "STATE_LIVE",
    "STATE_LOST",
    "Segment",
    "check_name_part",
    "cleanup_stale",
    "huge_pages_allowed",
    "mapped_kb",
    "owner_alive",
    "process_identity",
    "segment_name",
]

PREFIX = "rxb."
MAGIC = b"RXBULK\x00\x01"
HEADER_NBYTES = 4096
HUGE_NBYTES = 1 << 21  # a segment this large or larger is put on 2 MiB pages (see "Pages" above)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
_MADV_COLLAPSE = 25  # Linux 6.1+ (the generic values; Python 3.11's mmap module names neither)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
STATE_LIVE, STATE_CLOSED, STATE_LOST = 1, 2, 3
_HEADER = struct.Struct("<8s7Q")
_SHM_DIR = "/dev/shm"
_NAME_PART = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: A segment whose header was never completed is left alone this long (its creator may be mid-way).
_UNFINISHED_GRACE_S = 10.0


def check_name_part(kind: str, value: object) -> str:
    """Validate a run id, region or field name used in segment names; return it.

    Raises:
        ValueError: not 1..64 characters of ``[A-Za-z0-9_-]``.
    """
    if not isinstance(value, str) or not _NAME_PART.match(value):
        raise ValueError(
            f"bulk {kind} must be 1..64 characters of letters, digits, '_' or '-' (it names shared "
            f"memory segments), got {value!r:.100}"
        )
    return value


def huge_pages_allowed() -> tuple[bool, str]:
    """Whether a mapping advised for huge pages (``MADV_HUGEPAGE``) gets them when first touched on
    this host, and why: ``shmem_enabled`` of ``force`` or ``deny`` decides for every tmpfs; otherwise
    the ``huge=`` option /dev/shm is mounted with (default ``never``). A segment's own answer is
    :attr:`Segment.huge` (the collapse of "Pages" above does not need this)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            setting = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return False, "this kernel has no transparent huge pages for shared memory"
    if setting is not None and setting.group(1) in ("force", "deny"):
        return setting.group(1) == "force", f"shmem_enabled is {setting.group(1)}"
    huge = "never"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:  # (the last mount on /dev/shm is the one in effect)
                parts = line.split()
                if len(parts) >= 4 and parts[1] == "/dev/shm":
                    opts = dict(o.split("=", 1) if "=" in o else (o, "") for o in parts[3].split(","))
                    huge = opts.get("huge", "never")
    except OSError:
        return False, "/proc/self/mounts is unreadable"
    return huge in ("advise", "within_size", "always"), f"/dev/shm is mounted with huge={huge}"


def mapped_kb() -> tuple[int, int]:
    """``(mapped, on 2 MiB pages)``: kB of bulk segments this process maps now (every mapping of one
    counts), and how many of those kB its page tables map with 2 MiB entries (``/proc/self/smaps``:
    ``Size`` and ``ShmemPmdMapped``); ``(0, 0)`` where that file cannot be read. What the benchmarks
    print: the page size the readers of the shards' rings actually got."""
    kb = _smaps_kb(lambda head: head[-1].startswith("/dev/shm/" + PREFIX), ("Size:", "ShmemPmdMapped:"))
    return kb.get("Size:", 0), kb.get("ShmemPmdMapped:", 0)


def _smaps_kb(keep: Callable[[list[str]], bool], fields: tuple[str, ...]) -> dict[str, int]:
    """The sums of ``fields`` (kB) over this process's mappings whose first line (split) ``keep``
    accepts, from ``/proc/self/smaps``; ``{}`` where that file cannot be read."""
    sums: dict[str, int] = {}
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                    inside = keep(head)
                elif inside and head[0] in fields:
                    sums[head[0]] = sums.get(head[0], 0) + int(head[1])
    except (OSError, ValueError):
        return {}
    return sums


def segment_name(run_id: str, region: str, field: str) -> str:
    """The POSIX shm name (leading ``/``) of one field of one region of a run."""
    return f"/{PREFIX}{run_id}.{region}.{field}"


def _pid_start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot; None if there is no such live process.

    A zombie (killed, not yet reaped by its parent) counts as no process: it will never write again.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 2 (comm) may hold spaces and parentheses: split after its closing parenthesis.
    try:
        rest = stat[stat.rindex(b")") + 2 :].split()
        if rest[0] in (b"Z", b"X"):
            return None
        return int(rest[19])
    except (ValueError, IndexError):  # pragma: no cover - malformed /proc
        return None


_PID_NS: tuple[int, int] = (-1, 0)  # (pid it was read in, namespace inode)


def _pid_namespace() -> int:
    """This process's pid namespace (inode of /proc/self/ns/pid), read once per process: readers
    check owners on every gather, and the stat cost ~0.1 ms a batch."""
    global _PID_NS
    pid = os.getpid()
    if _PID_NS[0] != pid:  # first call, or a forked child (it may have entered another namespace)
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:  # pragma: no cover - no procfs
            ns = 0
        _PID_NS = (pid, ns)
    return _PID_NS[1]


def process_identity() -> tuple[int, int, int]:
    """``(pid, start time, pid namespace)`` of this process, as written in segment headers."""
    pid = os.getpid()
    return pid, _pid_start_time(pid) or 0, _pid_namespace()


def owner_alive(pid: int, start_time: int, pid_ns: int, *, check_start: bool = True) -> bool:
    """Whether the process that wrote a header still runs.

    A pid in another pid namespace cannot be checked from here: it counts as alive (the header's
    state word then carries the news of its death, set by whoever cleans up).
    """
    if pid <= 0:
        return False
    if pid_ns and pid_ns != _pid_namespace():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    if check_start and os.path.isdir("/proc/self"):
        now = _pid_start_time(pid)
        if now is None or (start_time and now != start_time):
            return False  # a zombie, or the pid was reused by another process
    return True


def _shm_open(name: str, flags: int, mode: int = 0o600) -> int:
    if _posixshmem is not None:
        return int(_posixshmem.shm_open(name, flags, mode))
    return os.open(_SHM_DIR + name, flags, mode)  # pragma: no cover


def _shm_unlink(name: str) -> bool:
    """Unlink; False if it was already gone."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink(name)
        else:  # pragma: no cover
            os.unlink(_SHM_DIR + name)
    except FileNotFoundError:
        return False
    return True


def _libc() -> Any:
    """libc's mmap and madvise through ctypes (what Python's mmap module cannot ask: a fixed address,
    and advice it does not name) on Linux, or None (another system, or no such libc)."""
    global _LIBC
    if _LIBC is None and not sys.platform.startswith("linux"):
        _LIBC = False
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_long]
            lib.madvise.restype = ctypes.c_int
            lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _LIBC = lib
        except (OSError, AttributeError):  # pragma: no cover - not a POSIX libc
            _LIBC = False
    return _LIBC or None


_LIBC: Any = None
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)


def _address(mm: mmap.mmap) -> int:
    view = np.frombuffer(mm, dtype=np.uint8, count=1)  # (its export ends with it)
    return int(view.ctypes.data)


def _map(fd: int, size: int, writable: bool) -> tuple[mmap.mmap, int]:
    """Map the first ``size`` bytes of ``fd`` shared: ``(mm, offset)``, the segment's first byte at
    ``mm[offset]``. A segment of 2 MiB or more is mapped at a 2 MiB-aligned address (see "Pages"):
    ``mm`` is then an anonymous reservation 2 MiB larger than the segment, which owns the whole range
    (closing it unmaps the file's mapping too), with the file mapped over its aligned part. Read-only
    unless ``writable``; a read-only mapping's buffer, and every array over it, is read-only too."""
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    lib = _libc() if size >= HUGE_NBYTES else None
    if lib is None:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot), 0
    # MAP_NORESERVE: the reservation's own pages are never touched (the slack) or replaced (the rest).
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0)
    reserved = mmap.mmap(-1, size + HUGE_NBYTES, flags, prot)
    start = _address(reserved)
    offset = -start % HUGE_NBYTES
    got = lib.mmap(start + offset, size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != start + offset:  # pragma: no cover - MAP_FIXED over our own reservation does not fail
        reserved.close()
        return mmap.mmap(fd, size, mmap.MAP_SHARED, prot), 0
    return reserved, offset


def _no_room(name: str, size: int) -> OSError:
    return OSError(errno.ENOSPC, f"shared memory segment {name!r} needs {-(-size >> 20)} MiB and /dev/shm has "
                                 f"no room for it (see `df -h /dev/shm`)")


def _reserve_header(name: str, fd: int, mm: mmap.mmap, offset: int, size: int) -> None:
    """Reserve the page of a new segment's header (faulted in through the mapping, so that under a
    mount that takes advice a large one's first 2 MiB page is huge like the rest).

    Raises:
        OSError: ENOSPC, ``/dev/shm`` has no room left.
    """
    lib = _libc()
    if lib is not None:
        if lib.madvise(_address(mm) + offset, HEADER_NBYTES, _MADV_POPULATE_WRITE) == 0:
            return
        if ctypes.get_errno() in (errno.EFAULT, errno.ENOMEM):  # (no page to be had: a SIGBUS, written to)
            raise _no_room(name, size)
    _fallocate(name, fd, HEADER_NBYTES, size)  # (a kernel before 5.14)


def _fallocate(name: str, fd: int, nbytes: int, size: int) -> None:
    """Reserve the first ``nbytes`` of segment ``name`` (of ``size`` bytes) in ``/dev/shm``. Where the
    file system cannot (EOPNOTSUPP and the like) its pages come at first touch, as without this.

    Raises:
        OSError: ENOSPC, no room for them (the segment's name and size in the message).
    """
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _no_room(name, size) from None


def _reserve(name: str, fd: int, mm: mmap.mmap, offset: int, size: int) -> bool:
    """Reserve a new segment's pages, and put one of 2 MiB or more (advised ``MADV_HUGEPAGE`` by the
    caller) on 2 MiB pages (see "Pages"); whether all of it is on 2 MiB pages now.

    Raises:
        OSError: ENOSPC, ``/dev/shm`` has no room for the segment (its name and size in the message).
    """
    lib = _libc()
    large = size >= HUGE_NBYTES
    if large and lib is not None and huge_pages_allowed()[0]:
        # The mount takes advice (the caller gave it before its first touch): fault the pages in
        # through the advised mapping, as 2 MiB ones (Linux 5.14+; EFAULT when /dev/shm is full, then
        # ENOSPC below). Not under huge=never: 4 KiB pages faulted in here cost more than
        # posix_fallocate's, and the collapse below replaces them all the same.
        lib.madvise(_address(mm) + offset, size, _MADV_POPULATE_WRITE)
    _fallocate(name, fd, size, size)
    if not large or lib is None:
        return False
    start = _address(mm) + offset
    for _attempt in range(5):  # (EAGAIN: a page was busy, locked or migrating; again, after a yield)
        if lib.madvise(start, size, _MADV_COLLAPSE) == 0:
            return True
        if ctypes.get_errno() != errno.EAGAIN:
            break
        os.sched_yield()
    # No collapse (a kernel before 6.1, no free 2 MiB pages): huge all the same where the mount took
    # the advice above, as the page tables say.
    return _pmd_mapped_kb(start) << 10 >= size


def _pmd_mapped_kb(start: int) -> int:
    """kB of the mapping of this process that starts at address ``start`` mapped with 2 MiB entries
    (``/proc/self/smaps``, ``ShmemPmdMapped``); 0 where that cannot be read."""
    return _smaps_kb(lambda head: int(head[0].split("-")[0], 16) == start, ("ShmemPmdMapped:",)).get(
        "ShmemPmdMapped:", 0)


class Segment:
    """One mapped segment: its header words and its data bytes.

    The owner maps read-write; a reader maps read-only (it can never corrupt the owner's memory),
    but for a segment of words it writes itself (``attach(writable=True)``: a shared counter, which
    its owner treats as untrusted).
    """

    __slots__ = ("data", "header", "huge", "mm", "name", "offset", "row_nbytes", "rows", "writable")

    def __init__(self, name: str, mm: mmap.mmap, writable: bool, offset: int = 0) -> None:
        self.name = name
        self.mm = mm
        self.offset = offset  # where the segment starts in ``mm`` (see _map)
        self.writable = writable
        #: Whether the owner put the segment on 2 MiB pages (see "Pages"); False for a reader.
        self.huge = False
        # uint64 words of the header; index 1 (state) is read on every read, as one aligned load.
        self.header: np.ndarray = np.frombuffer(mm, dtype=np.uint64, count=8, offset=offset)
        self.rows = int(self.header[6])
        self.row_nbytes = int(self.header[7])
        nbytes = self.rows * self.row_nbytes
        self.data: np.ndarray = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset + HEADER_NBYTES)

    # ------------------------------------------------------------------ owner side

    @classmethod
    def create(cls, name: str, rows: int, row_nbytes: int, generation: int) -> Segment:
        """Create ``name`` (removing a stale one left by a dead owner) and write its header.

        Raises:
            FileExistsError: a live process owns a segment of that name.
        """
        size = HEADER_NBYTES + rows * row_nbytes
        for _attempt in range(3):
            try:
                fd = _shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR)
            except FileExistsError:
                foreign = _foreign(name)
                if foreign is not None:
                    raise FileExistsError(f"shared memory segment {name!r} cannot be made: what is at its name is "
                                          f"{foreign} (left alone); remove it, or run under another run id") from None
                holder = _stale_reason(name, grace_s=0.0)
                if holder is None:
                    info = read_header(name)
                    pid = info["pid"] if info else "?"
                    raise FileExistsError(
                        f"shared memory segment {name!r} is owned by live process {pid}: two owners "
                        f"in one run registered the same region; give each region a unique name"
                    ) from None
                _mark_lost_and_unlink(name)
                continue
            mm = None
            try:
                if size >= HUGE_NBYTES:
                    size = -(-size // HUGE_NBYTES) * HUGE_NBYTES  # whole 2 MiB pages (see "Pages")
                os.ftruncate(fd, size)
                mm, offset = _map(fd, size, writable=True)
                if size >= HUGE_NBYTES and _MADV_HUGEPAGE is not None:
                    try:  # before the first touch (the header below), where the mount takes advice
                        mm.madvise(_MADV_HUGEPAGE, offset, size)
                    except OSError:
                        pass
                # The header first, state 0 ("being created"): reserving and collapsing a large
                # segment takes seconds, and a cleanup meanwhile (another shard's start, a daemon's)
                # must see a live owner making it, not a file without a header past its grace. Its
                # page is reserved before it is written (a full /dev/shm: ENOSPC, not SIGBUS).
                _reserve_header(name, fd, mm, offset, size)
                pid, start, ns = process_identity()
                mm[offset: offset + _HEADER.size] = _HEADER.pack(MAGIC, 0, generation, pid, start, ns, rows,
                                                                 row_nbytes)
                huge = _reserve(name, fd, mm, offset, size)
            except BaseException:
                os.close(fd)
                _shm_unlink(name)
                if mm is not None:
                    mm.close()
                raise
            os.close(fd)
            seg = cls(name, mm, writable=True, offset=offset)
            seg.huge = huge
            seg.header[1] = STATE_LIVE  # last: a header with state 0 is "being created"
            return seg
        raise FileExistsError(f"could not create shared memory segment {name!r}: it keeps reappearing")

    def close_owner(self, state: int = STATE_CLOSED) -> None:
        """Mark the segment closed (readers stop), unlink its name, and unmap it if nothing uses it."""
        if self.mm.closed:
            return
        self.header[1] = state
        _shm_unlink(self.name)
        self._unmap()

    # ------------------------------------------------------------------ reader side

    @classmethod
    def attach(cls, name: str, *, writable: bool = False) -> Segment:
        """Map an existing segment read-only (``writable``: read-write, for the few words a reader
        writes itself, such as a shared counter).

        Raises:
            FileNotFoundError: no segment of that name.
            ValueError: not a bulk segment (bad magic or size), not a regular file, or not this user's.
        """
        # O_NONBLOCK: a FIFO planted at a segment's name (its name is known from the run id, and /dev/shm
        # is anyone's to write) held the opening process in open() until someone wrote to it: a shard's whole
        # loop, from a staged insert naming it. Then only this user's regular files are mapped (another
        # user's file under the name of a region, with a header naming a live owner, was mapped and read).
        fd = _shm_open(name, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            foreign = _not_ours(st)
            if foreign is not None:
                raise ValueError(f"shared memory segment {name!r} is {foreign}, not a segment of this user's runs")
            size = st.st_size
            if size < HEADER_NBYTES:
                raise ValueError(f"shared memory segment {name!r} is {size} bytes, smaller than a header")
            mm, offset = _map(fd, size, writable)
        finally:
            os.close(fd)
        if mm[offset: offset + 8] != MAGIC:
            mm.close()
            raise ValueError(f"shared memory segment {name!r} is not a reactor bulk segment (bad magic)")
        seg = cls(name, mm, writable=writable, offset=offset)
        if HEADER_NBYTES + seg.rows * seg.row_nbytes > size:
            seg.close_reader()
            raise ValueError(f"shared memory segment {name!r} is shorter than its header says")
        return seg

    def close_reader(self) -> None:
        """Unmap (if no array still views the memory; otherwise the mapping goes with the last view)."""
        self._unmap()

    def _unmap(self) -> None:
        self.header = np.zeros(8, dtype=np.uint64)  # not views: the mapping can close now
        self.data = np.empty(0, dtype=np.uint8)
        try:
            self.mm.close()
        except BufferError:  # tensors handed out still view it; it is unmapped when they die
            pass

    # ------------------------------------------------------------------ header fields

    @property
    def state(self) -> int:
        return int(self.header[1])

    @property
    def generation(self) -> int:
        return int(self.header[2])

    @property
    def owner(self) -> tuple[int, int, int]:
        h = self.header
        return int(h[3]), int(h[4]), int(h[5])


def _not_ours(st: os.stat_result) -> str | None:
    """What a file is when it is not a regular file of this process's user (so no segment of its runs),
    else None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file (something else was put at its name)"
    if st.st_uid != os.geteuid():
        return f"a file of uid {st.st_uid}, not of this process's user ({os.geteuid()})"
    return None


def _open_own(name: str, flags: int) -> int | None:
    """An open descriptor of segment ``name`` if it is a regular file of this process's user, else None
    (absent, or something else at its name: see :meth:`Segment.attach`; a FIFO named like a segment held
    every run's start in the sweep of dead runs' segments)."""
    try:
        fd = _shm_open(name, flags | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:  # pragma: no cover
        os.close(fd)
        return None
    if _not_ours(st) is not None:
        os.close(fd)
        return None
    return fd


def read_header(name: str) -> dict[str, Any] | None:
    """The header of segment ``name`` as a dict, or None if absent, unfinished or not ours (another
    user's file, or no regular file)."""
    fd = _open_own(name, os.O_RDONLY)
    if fd is None:
        return None
    try:
        raw = os.pread(fd, _HEADER.size, 0)
        mtime = os.fstat(fd).st_mtime
    except OSError:  # pragma: no cover
        return None
    finally:
        os.close(fd)
    if len(raw) < _HEADER.size:
        return {"magic": False, "mtime": mtime}
    magic, state, gen, pid, start, ns, rows, row_nbytes = _HEADER.unpack(raw)
    return {
        "magic": magic == MAGIC,
        "state": state,
        "generation": gen,
        "pid": pid,
        "start": start,
        "ns": ns,
        "rows": rows,
        "row_nbytes": row_nbytes,
        "mtime": mtime,
    }


def _foreign(name: str) -> str | None:
    """What is at segment ``name`` if it is not a regular file of this process's user (without opening
    it), else None (ours, or nothing there)."""
    try:
        return _not_ours(os.lstat(_SHM_DIR + name))
    except OSError:
        return None


def _stale_reason(name: str, grace_s: float) -> str | None:
    """Why segment ``name`` is stale (dead owner, unfinished, closed), or None if a live owner holds it
    or it is not this user's to remove (:func:`_foreign`)."""
    if _foreign(name) is not None:
        return None
    info = read_header(name)
    if info is None:
        return "gone"
    if not info["magic"]:
        # Being created (the header is written right after the segment is sized): leave it for a while.
        if time.time() - info["mtime"] < grace_s:
            return None
        return "never finished"
    if info["state"] == 0:  # being created by the process it names (reserving a large one takes seconds)
        return None if owner_alive(info["pid"], info["start"], info["ns"]) else "never finished"
    if info["state"] != STATE_LIVE:
        return "closed"
    if not owner_alive(info["pid"], info["start"], info["ns"]):
        return f"owner pid {info['pid']} is dead"
    return None


def _mark_lost_and_unlink(name: str) -> None:
    """Tell readers still mapping ``name`` that its owner is gone (state 3), then unlink it (only a
    regular file of this user: another user's, or something else at its name, is left alone)."""
    fd = _open_own(name, os.O_RDWR)
    if fd is None:
        return
    try:
        if os.fstat(fd).st_size >= HEADER_NBYTES:
            mm = mmap.mmap(fd, HEADER_NBYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            try:
                if mm[:8] == MAGIC:
                    mm[8:16] = struct.pack("<Q", STATE_LOST)
            finally:
                mm.close()
    finally:
        os.close(fd)
    _shm_unlink(name)


def list_segments(run_id: str | None = None) -> list[str]:
    """Names (with leading ``/``) of this package's segments, of one run or of all runs (Linux)."""
    prefix = PREFIX if run_id is None else f"{PREFIX}{run_id}."
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:  # pragma: no cover - no /dev/shm (not Linux)
        return []
    return sorted("/" + e for e in entries if e.startswith(prefix))


def cleanup_stale(run_id: str | None = None, *, grace_s: float = _UNFINISHED_GRACE_S) -> list[str]:
    """Unlink segments whose owner is dead (or that were closed or never finished); return their names.

    Segments of live owners are left alone. Each stale segment is marked "owner lost" before it is
    unlinked, so a reader still mapping it fails at its next read instead of reading on.
    """
    removed = []
    for name in list_segments(run_id):
        if _stale_reason(name, grace_s) is not None:
            _mark_lost_and_unlink(name)
            removed.append(name)
    return removed
