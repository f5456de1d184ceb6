"""Atomic, checksummed checkpoint directories: temporary files, fsync, rename, then a completion marker.

Layout under a checkpoint root::

    root/
      ckpt-00000007/           one complete checkpoint
        manifest.json          JSON: the owner's config and scalars, the arrays and a checksum per file
        <array>.npy            one .npy per array (a plain dtype; never an object array)
        COMPLETE               written last: the format and the checksum of manifest.json
      .tmp-ckpt-00000008-...   a save in progress (or one killed midway); never read

A save writes every file into a fresh hidden temporary directory, fsyncs each file and the
directory, renames it to ``ckpt-N`` (atomic on POSIX), fsyncs the root, and only then writes
``COMPLETE`` (itself through a temporary name and a rename). A process killed at any point leaves
every earlier complete checkpoint untouched and loadable, and at most a directory that loading
ignores. After a successful save, all but the latest ``keep`` complete checkpoints, and leftovers of
older saves, are removed.

**Checksums.** Every ``.npy`` file's BLAKE2b-256 digest (of the whole file, header included) is in
the manifest, the manifest's digest is in ``COMPLETE``, and the manifest names its own directory
(``ckpt-N``). :func:`read_checkpoint` verifies the chain before it returns anything, so a flipped
bit, a truncated or extended file, a file copied from another checkpoint, a manifest edited by
hand or a directory renamed to another number raises :class:`CheckpointCorruptError` naming the
file and the directory; it never returns data that differs from what was saved. (BLAKE2b from
``hashlib``: ~1 GB/s on one core here, in the saver's thread; no new dependency.)

Nothing here pickles: arrays are ``.npy`` files read by their header (plain dtypes only) and
everything else is JSON. One saver per root at a time.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._files import open_regular, read_small, writing

__all__ = [
    "CheckpointCancelled",
    "CheckpointCorruptError",
    "complete_checkpoints",
    "latest_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
]

_NAME = re.compile(r"^ckpt-(\d{8,})$")  # (8 digits, and more past 99,999,999: sorted by number)
_TMP = re.compile(r"^\.tmp-ckpt-(\d{8,})-")
MARKER = "COMPLETE"
MANIFEST = "manifest.json"
MAX_MANIFEST_NBYTES = 64 << 20  # (a manifest names arrays and small settings: kilobytes)
#: The first line of ``COMPLETE``; the second is ``manifest.json <digest>``.
FORMAT = "reactor-checkpoint/2"
_DIGEST = "blake2b-256"
_CHUNK = 16 << 20  # bytes hashed and written per call: a cancelled save stops within one chunk
_READ_CHUNK = 1 << 20  # bytes read and then hashed per call by a load (while in the CPU's cache)


class CheckpointCorruptError(ValueError):
    """A checkpoint that fails verification: a checksum mismatch, a truncated, missing or foreign file,
    or content whose invariants do not hold. Its message names the file and the directory."""


class CheckpointCancelled(Exception):
    """:func:`write_checkpoint` stopped because its ``cancel`` event was set (nothing was published)."""


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=32)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _npy_header(arr: np.ndarray) -> bytes:
    bio = io.BytesIO()
    d = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(bio, d)
    except ValueError:  # a header too large for format 1.0
        bio = io.BytesIO()
        np.lib.format.write_array_header_2_0(bio, d)
    return bio.getvalue()


def _write_npy(path: Path, arr: np.ndarray, cancel: threading.Event | None) -> str:
    """Write ``arr`` as a ``.npy`` file, fsync it, and return its digest (hashed from memory as written)."""
    arr = np.ascontiguousarray(arr)
    h = _hasher()
    header = _npy_header(arr)
    data = memoryview(arr.reshape(-1).view(np.uint8)) if arr.size else memoryview(b"")
    with open(path, "wb") as f:
        f.write(header)
        h.update(header)
        for i in range(0, len(data), _CHUNK):
            if cancel is not None and cancel.is_set():
                raise CheckpointCancelled(f"checkpoint save into {str(path.parent)!r} cancelled")
            chunk = data[i : i + _CHUNK]
            h.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    return f"{_DIGEST}:{h.hexdigest()}"


def _numbers(root: Path) -> list[tuple[int, Path, bool]]:
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p, (p / MARKER).is_file()))
    return sorted(out)


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoint directories under ``root``, newest first (not yet verified)."""
    return [p for _, p, ok in reversed(_numbers(Path(root))) if ok]


def incomplete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint directories under ``root`` without ``COMPLETE`` (a save cut short), oldest first."""
    return [p for _, p, ok in _numbers(Path(root)) if not ok]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory under ``root``, or None (not yet verified)."""
    complete = complete_checkpoints(root)
    return complete[0] if complete else None


def write_checkpoint(
    root: str | os.PathLike[str],
    manifest: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    *,
    keep: int = 3,
    cancel: threading.Event | None = None,
) -> Path:
    """Write one checkpoint atomically and prune old ones.

    Args:
        root: checkpoint root directory (created if missing).
        manifest: JSON-able mapping; stored as ``manifest.json`` with ``"arrays"`` (name -> file),
            ``"checksums"`` (file -> digest) and ``"checkpoint"`` (the directory's name) added.
        arrays: name -> numpy array (names are identifiers, plain dtypes; no object arrays).
        keep: how many complete checkpoints to keep (>= 1).
        cancel: when set (by another thread), the save stops at the next chunk, removes its
            temporary directory and raises :class:`CheckpointCancelled`; nothing is published.

    Returns:
        The new checkpoint's directory.

    Raises:
        ValueError: ``keep < 1``, a bad array name, or an object array.
        CheckpointCancelled: ``cancel`` was set before the checkpoint was published.
        OSError: the filesystem refused a write (the previous checkpoints stay as they were).
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        if not name.replace(".", "_").isidentifier():
            raise ValueError(f"checkpoint array name {name!r} must be an identifier")
        if arr.dtype.hasobject:
            raise ValueError(f"checkpoint array {name!r} has dtype object; only plain dtypes are saved")
    existing = _numbers(root)
    tmp_numbers = [int(m.group(1)) for p in root.iterdir() if (m := _TMP.match(p.name))]
    number = max([n for n, _, _ in existing] + tmp_numbers + [0]) + 1
    final = root / f"ckpt-{number:08d}"
    tmp = root / f".tmp-ckpt-{number:08d}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    with writing(tmp, final):  # (a worker that must leave mid-save waits for it a while: _worker._leave_by)
        return _save_into(tmp, final, root, arrays, manifest, keep, number, cancel)


def _save_into(tmp: Path, final: Path, root: Path, arrays: dict[str, np.ndarray], manifest: dict[str, Any],
               keep: int, number: int, cancel: threading.Event | None) -> Path:
    try:
        listing, checksums = {}, {}
        for name, arr in arrays.items():
            fname = f"{name}.npy"
            checksums[fname] = _write_npy(tmp / fname, arr, cancel)
            listing[name] = fname
        doc = dict(manifest)
        doc["arrays"] = listing
        doc["checksums"] = checksums
        doc["checkpoint"] = final.name
        body = json.dumps(doc, indent=1, sort_keys=True).encode()
        _write_file(tmp / MANIFEST, body)
        _fsync_path(tmp)
        if cancel is not None and cancel.is_set():
            raise CheckpointCancelled(f"checkpoint save into {str(root)!r} cancelled")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.rename(tmp, final)
    _fsync_path(root)
    digest = _hasher()
    digest.update(body)
    _write_file(final / (MARKER + ".tmp"), f"{FORMAT}\n{MANIFEST} {_DIGEST}:{digest.hexdigest()}\n".encode())
    os.rename(final / (MARKER + ".tmp"), final / MARKER)
    _fsync_path(final)
    _prune(root, keep, number)
    return final


def _prune(root: Path, keep: int, newest: int) -> None:
    complete = [(n, p) for n, p, ok in _numbers(root) if ok]
    for _, p in complete[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for n, p, ok in _numbers(root):
        if not ok and n < newest:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.iterdir():
        m = _TMP.match(p.name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(p, ignore_errors=True)


def _corrupt(path: Path, fname: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"checkpoint {str(path)!r}: {fname} {why}; the checkpoint is refused")


def _read_npy(path: Path, fname: str, expected: str, into: list[memoryview] | None = None) -> np.ndarray | None:
    """Read and verify one ``.npy`` file: its digest, a plain dtype, and exactly the bytes its header
    promises (no pickle, no object arrays). The data are read once, straight into the array; or, with
    ``into`` (writable byte views, in order), straight into those views, and None is returned: the
    file must then hold a flat ``uint8`` array exactly as long as the views together."""
    file = path / fname
    try:
        f = os.fdopen(open_regular(file), "rb")  # (a FIFO never ends its read, nor /dev/zero)
    except OSError as e:
        raise _corrupt(path, fname, f"cannot be read ({e.strerror or e})") from e
    except ValueError:
        raise _corrupt(path, fname, "is not a regular file") from None
    with f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            else:
                raise ValueError(f"unsupported .npy version {version}")
        except Exception as e:  # numpy's header parser raises ValueError, SyntaxError, TokenError...
            raise _corrupt(path, fname, f"has a malformed .npy header ({type(e).__name__}: {e})") from e
        if dtype.hasobject:
            raise _corrupt(path, fname, "holds an object array (never written by reactor)")
        start = f.tell()
        count = int(np.prod(shape, dtype=np.int64))
        size = os.fstat(f.fileno()).st_size
        if count < 0 or size - start != count * dtype.itemsize:
            raise _corrupt(path, fname, f"holds {size - start} data bytes, its header promises {count * dtype.itemsize}")
        arr = None
        if into is None:
            arr = np.empty(count, dtype=dtype)
            into = [memoryview(arr.reshape(-1).view(np.uint8))] if count else []
        else:
            want = sum(len(v) for v in into)
            if dtype != np.uint8 or tuple(shape) != (want,):
                raise _corrupt(path, fname, f"holds {dtype} {tuple(shape)}, the manifest's storage needs uint8 ({want},)")
        f.seek(0)
        h = _hasher()
        h.update(f.read(start))
        got_bytes = 0
        for view in into:
            for i in range(0, len(view), _READ_CHUNK):  # each chunk hashed as it arrives, still in the cache
                chunk = view[i : i + _READ_CHUNK]
                n = f.readinto(chunk)
                got_bytes += n
                if n != len(chunk):
                    raise _corrupt(path, fname, f"ended after {got_bytes} of {count * dtype.itemsize} data bytes")
                h.update(chunk)
    got = f"{_DIGEST}:{h.hexdigest()}"
    if got != expected:
        raise _corrupt(path, fname, f"has checksum {got}, the manifest says {expected}")
    return None if arr is None else arr.reshape(shape, order="F" if fortran else "C")


def read_checkpoint(
    path: str | os.PathLike[str],
    into: Callable[[Path, dict[str, Any]], Mapping[str, list[memoryview]]] | None = None,
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read and verify a checkpoint: a complete ``ckpt-N`` directory, or a root (its newest complete one).

    Verification (before anything is returned): ``COMPLETE`` names this format and the manifest's
    digest; the manifest matches it, names this directory, and lists a digest for every array file;
    every array file matches its digest and holds exactly what its header says.

    Args:
        into: called once the manifest verified, with the checkpoint's directory and its manifest,
            before any array is read: it may return, by array name, writable byte views to read that
            array into (a flat ``uint8`` array as long as the views together, read once, with no copy
            of its own); those arrays are then left out of the result. Their views hold the file's
            bytes only if the call returns: on an error they hold any part of it. It may raise to
            refuse the checkpoint before anything is read. A name it returns that the manifest does not
            list refuses the checkpoint.

    Returns:
        ``(manifest, arrays)``.

    Raises:
        FileNotFoundError: no complete checkpoint there.
        CheckpointCorruptError: verification failed (the message names the file and the directory).
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no complete checkpoint in {str(path)!r} (looked for ckpt-*/{MARKER})")
        path = latest
    try:
        marker = read_small(path / MARKER, 1 << 16).decode("ascii").split("\n")
        body = read_small(path / MANIFEST, MAX_MANIFEST_NBYTES)
    except (OSError, ValueError) as e:  # (UnicodeDecodeError is a ValueError)
        raise _corrupt(path, MARKER, f"or {MANIFEST} cannot be read ({e})") from e
    if len(marker) != 3 or marker[0] != FORMAT or marker[2] != "" or not marker[1].startswith(MANIFEST + " "):
        raise _corrupt(path, MARKER, f"is not a {FORMAT} marker (a checkpoint without checksums, or a damaged marker)")
    h = _hasher()
    h.update(body)
    got, expected = f"{_DIGEST}:{h.hexdigest()}", marker[1][len(MANIFEST) + 1 :]
    if got != expected:
        raise _corrupt(path, MANIFEST, f"has checksum {got}, {MARKER} says {expected}")
    try:
        manifest = json.loads(body)
        listing = manifest.pop("arrays")
        checksums = manifest.pop("checksums")
        own = manifest.pop("checkpoint")
        if not (isinstance(listing, dict) and isinstance(checksums, dict) and isinstance(own, str)
                and all(isinstance(v, str) for v in [*listing.values(), *checksums.values()])):
            raise ValueError("'arrays' and 'checksums' must map names to strings, 'checkpoint' must be a string")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise _corrupt(path, MANIFEST, f"is malformed ({type(e).__name__}: {e})") from e
    if _NAME.match(path.name) and own != path.name:
        raise _corrupt(path, MANIFEST, f"belongs to {own!r}, not to this directory (files moved between checkpoints?)")
    files = set(listing.values())
    if files != set(checksums) or len(files) != len(listing):
        raise _corrupt(path, MANIFEST, f"lists array files {sorted(files)} but checksums for {sorted(checksums)}")
    for fname in listing.values():
        if not isinstance(fname, str) or "/" in fname or fname.startswith(".") or not fname.endswith(".npy"):
            raise _corrupt(path, MANIFEST, f"lists a bad file name {fname!r}")
    sinks = dict(into(path, manifest)) if into is not None else {}
    if unlisted := sorted(sinks.keys() - listing.keys()):
        raise _corrupt(path, MANIFEST, f"lists no array {unlisted[0]!r}")
    arrays = {}
    for name, fname in listing.items():
        got_array = _read_npy(path, fname, str(checksums[fname]), sinks.get(name))
        if got_array is not None:
            arrays[name] = got_array
    return manifest, arrays
