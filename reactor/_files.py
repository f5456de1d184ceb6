"""Reading the small files that records and keys live in, from directories someone else may have
written: a job's record in a daemon's state directory, a run directory's owner record, a key file.

And writing into a run directory someone handed over: a file there that is a symbolic link would
have the run write through it, over the file it points at (:func:`refuse_file_links`). And binding
a ZeroMQ ipc socket: libzmq removes whatever is at the path first, so a bind address
from a placement file could delete any file of the user's (:func:`check_ipc_bind` refuses that).

A plain ``open`` of a FIFO blocks until a writer comes (a daemon that reads one at a handshake or at
its start then hangs), ``/dev/zero`` never ends, and a JSON document nested a hundred thousand deep
raises ``RecursionError``. :func:`read_small` and :func:`read_small_json` refuse all three with an
error that names the file. :func:`replace_small` writes such a file whole or not at all, never
through a link planted at its name.

Writes in progress (:func:`writing`: :func:`replacing`'s, a replay checkpoint's) are known to the
process, so that one that must leave mid-write (a failed worker past its bound) can wait for them a
while, then remove what a cut one leaves (:func:`remove_cut_writes`): the file it replaces is whole. A
worker also says when it begins and ends writing (:func:`watch_writes`), so that its coordinator, which
ends it after a failure, can tell one writing a checkpoint from one held.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["check_ipc_bind", "open_regular", "read_small", "read_small_json", "refuse_file_links",
           "remove_cut_writes", "replace_small", "replacing", "watch_writes", "writes_in_progress", "writing"]

_writes: dict[int, tuple[Path, Path]] = {}  # (a write's id) -> (what it writes into, what it replaces)
_writes_lock = threading.Lock()
_write_ids = itertools.count()


_watch: Callable[[bool], None] | None = None


def watch_writes(callback: Callable[[bool], None] | None) -> None:
    """Call ``callback(True)`` when this process begins writing (no write was in progress) and
    ``callback(False)`` when its last write in progress ends, in the thread that writes, outside any lock
    (None: no more). A worker tells its coordinator so (``_worker``: ``("writing", bool)``)."""
    global _watch
    _watch = callback


_say_lock = threading.Lock()


def _said() -> None:
    """Say whether a write is in progress now: the state read and handed over under one lock, so that the
    last word said, whichever threads began and ended writes meanwhile, is the state now."""
    watch = _watch
    if watch is None:
        return
    with _say_lock:
        with _writes_lock:
            now = bool(_writes)
        with contextlib.suppress(Exception):  # (the word is for the coordinator: never the write's failure)
            watch(now)


@contextlib.contextmanager
def writing(tmp: Path, final: Path) -> Iterator[None]:
    """A write into ``tmp`` (a temporary file or directory) that will replace ``final``, known to this
    process for as long as the block runs (:func:`writes_in_progress`, :func:`watch_writes`)."""
    with _writes_lock:
        key = next(_write_ids)
        _writes[key] = (tmp, final)
        first = len(_writes) == 1
    if first:
        _said()
    try:
        yield
    finally:
        with _writes_lock:
            gone = _writes.pop(key, None) is not None
            last = gone and not _writes
        if last:
            _said()


def writes_in_progress() -> list[Path]:
    """What this process's writes in progress will replace (their ``final``), in the order they began."""
    with _writes_lock:
        return [final for _, final in _writes.values()]


def remove_cut_writes() -> list[Path]:
    """This process leaves now, mid-write (``os._exit``: no ``finally`` runs): remove what its writes in
    progress wrote so far (a cut ``.NAME.tmp`` held as much disk as the file, until the next save), and
    return what each would have replaced (each is whole: the rename never came). Best effort."""
    with _writes_lock:
        cut = list(_writes.values())
        _writes.clear()
    for tmp, _ in cut:
        with contextlib.suppress(OSError):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink()
    return [final for _, final in cut]


def open_regular(path: str | os.PathLike[str]) -> int:
    """A blocking read-only descriptor of the regular file at ``path`` (a link is followed); the
    caller closes it. The open itself does not wait, so a FIFO is refused rather than waited on.

    Raises:
        OSError: it cannot be opened (missing, a directory: IsADirectoryError, no permission).
        ValueError: it is not a regular file (a FIFO, a device, a socket); the message names it.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise ValueError(f"{os.fspath(path)} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: str | os.PathLike[str], max_nbytes: int) -> bytes:
    """The bytes of the regular file at ``path`` (:func:`open_regular`), at most ``max_nbytes``.

    Raises:
        OSError: as :func:`open_regular`, or it cannot be read.
        ValueError: it is not a regular file, or holds more than ``max_nbytes`` bytes; the message
            names the file.
    """
    fd = open_regular(path)
    try:
        chunks, total = [], 0
        while chunk := os.read(fd, min(1 << 20, max_nbytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_nbytes:
                raise ValueError(f"{os.fspath(path)} holds more than {max_nbytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_small_json(path: str | os.PathLike[str], max_nbytes: int = 1 << 20) -> Any:
    """The JSON document in the regular file at ``path`` (:func:`read_small`).

    Raises:
        OSError: as :func:`read_small`.
        ValueError: as :func:`read_small`, or it is not UTF-8 JSON, or it is nested too deep to
            parse; the message names the file.
    """
    data = read_small(path, max_nbytes)
    try:
        return json.loads(data.decode())
    except (ValueError, RecursionError) as e:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"{Path(path)}: not a JSON document ({type(e).__name__})") from None


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str], sync: bool = False) -> Iterator[BinaryIO]:
    """A file to write ``path``'s new content into, put at ``path`` whole when the block ends: a new
    file beside it (``.NAME.tmp``, created afresh, so a link planted there is not written through),
    renamed over ``path`` (which replaces a link at ``path`` rather than writing through it). A reader
    sees the old file or the new one; with ``sync``, the data is on disk before the rename. A block
    that raises (or a write, a sync or the rename that fails: a full disk) leaves ``path`` as it was
    and removes the new file (it was left, holding the full disk's space).

    Raises:
        OSError: the file cannot be written or renamed (a full disk, a directory in the way).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with writing(tmp, path), os.fdopen(fd, "wb") as f:
            yield f
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError with an errno that ``e`` is, or that it was raised from or while handling (a full
    disk that a library says in its own words: torch's zip writer raises a RuntimeError after the
    write's ENOSPC); None if none is."""
    seen: set[int] = set()
    at: BaseException | None = e
    while at is not None and id(at) not in seen and len(seen) < 16:
        if isinstance(at, OSError) and at.errno is not None:
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None


def replace_small(path: str | os.PathLike[str], data: bytes, sync: bool = False) -> None:
    """Put ``data`` at ``path`` whole (:func:`replacing`)."""
    with replacing(path, sync) as f:
        f.write(data)


def check_ipc_bind(address: str) -> None:
    """Refuse to bind ZeroMQ at ``ipc://PATH`` where ``PATH`` is something other than a socket
    (libzmq unlinks the path before binding: a file there would be deleted). A socket left by an
    earlier run, a wildcard (``ipc://*``) and Linux's abstract names (``ipc://@name``) pass, and so
    does every other transport.

    Raises:
        FileExistsError: ``PATH`` exists and is not a socket; the message names it.
    """
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://"):]
    if not path or path == "*" or path.startswith("@"):
        return
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # nothing there (or nothing we may look at: the bind says so)
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"cannot bind {address!r}: {path} exists and is not a socket (binding would delete it)")


def _links(entry: os.DirEntry[str]) -> int:
    """Hard links of a directory entry; 1 for one gone since the listing (a temporary file renamed,
    a checkpoint pruned meanwhile: another process of the run may be writing there)."""
    try:
        return entry.stat(follow_symlinks=False).st_nlink
    except FileNotFoundError:
        return 1


def refuse_file_links(directory: str | os.PathLike[str], max_entries: int = 100_000) -> None:
    """Refuse a run directory that holds a symbolic link to anything but a directory, a FIFO, a
    device, a socket, or a file with more than one hard link, at any depth
    (links to directories are followed, each once: a user may keep a shard's checkpoints on another
    disk). A run writes its files in place (a checkpoint's temporary file, ``metrics.csv``, a shard's
    counter and log segments): through such a link it would overwrite or truncate the file it names.
    Nothing to check where ``directory`` does not exist yet.

    Raises:
        ValueError: naming the first such link and what it points at.
    """
    seen: set[tuple[int, int]] = set()
    todo, n = [os.fspath(directory)], 0
    while todo:
        here = todo.pop()
        try:
            st = os.stat(here)
            entries = list(os.scandir(here))
        except (FileNotFoundError, NotADirectoryError):
            continue
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        for e in entries:
            n += 1
            if n > max_entries:
                return  # (a directory this large is no run directory of ours: its own checks apply)
            if e.is_symlink():
                if e.is_dir():  # (follows the link)
                    todo.append(e.path)
                    continue
                raise ValueError(f"run directory {os.fspath(directory)} holds a symbolic link {e.path} -> "
                                 f"{os.readlink(e.path)}: a run writes its files in place, and would write through "
                                 f"it; remove the link (or use another run directory)")
            if e.is_dir(follow_symlinks=False):
                todo.append(e.path)
            elif not e.is_file(follow_symlinks=False):  # a FIFO (its open waits for ever), a device, a socket
                raise ValueError(f"run directory {os.fspath(directory)} holds {e.path}, which is neither a file nor "
                                 f"a directory: a run reads and writes only its own files there; remove it")
            elif (links := _links(e)) > 1:  # (cp -al: a copy that shares its files)
                raise ValueError(f"run directory {os.fspath(directory)} holds {e.path}, a file with {links} hard links: "
                                 f"a run writes its files in place, and would change every other copy (a directory "
                                 f"copied with cp -al, or kept by a hard-linked backup such as rsync --link-dest); copy it "
                                 f"with cp -r instead")
