"""Atomic checkpoint directories: temporary files, fsync, rename, then a completion marker.

Layout under a checkpoint root::

    root/
      ckpt-00000007/           one complete checkpoint
        manifest.json          JSON: the owner's config and scalars, and the list of arrays
        <array>.npy            one .npy per array (loaded with allow_pickle=False)
        COMPLETE               written last; a directory without it is ignored and later removed
      .tmp-ckpt-00000008-...   a save in progress (or one killed midway); never read

A save writes every file into a fresh hidden temporary directory, fsyncs each file and the
directory, renames it to ``ckpt-N`` (atomic on POSIX), fsyncs the root, and only then writes
``COMPLETE`` (itself through a temporary name and a rename). A process killed at any point leaves
every earlier complete checkpoint untouched and loadable, and at most a directory that loading
ignores. After a successful save, all but the latest ``keep`` complete checkpoints, and leftovers of
older saves, are removed.

Nothing here pickles: arrays go through ``np.save``/``np.load(allow_pickle=False)`` and everything
else through JSON. One saver per root at a time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["latest_checkpoint", "read_checkpoint", "write_checkpoint"]

_NAME = re.compile(r"^ckpt-(\d{8})$")
_TMP = re.compile(r"^\.tmp-ckpt-(\d{8})-")
MARKER = "COMPLETE"
MANIFEST = "manifest.json"


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


def _numbers(root: Path) -> list[tuple[int, Path, bool]]:
    out = []
    for p in root.iterdir() if root.is_dir() else ():
        m = _NAME.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p, (p / MARKER).is_file()))
    return sorted(out)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory under ``root``, or None."""
    complete = [p for _, p, ok in _numbers(Path(root)) if ok]
    return complete[-1] if complete else None


def write_checkpoint(
    root: str | os.PathLike[str], manifest: Mapping[str, Any], arrays: Mapping[str, np.ndarray], *, keep: int = 3
) -> Path:
    """Write one checkpoint atomically and prune old ones.

    Args:
        root: checkpoint root directory (created if missing).
        manifest: JSON-able mapping; stored as ``manifest.json`` with an ``"arrays"`` entry added.
        arrays: name -> numpy array (names are identifiers, plain dtypes; no object arrays).
        keep: how many complete checkpoints to keep (>= 1).

    Returns:
        The new checkpoint's directory.

    Raises:
        ValueError: ``keep < 1``, a bad array name, or an object array.
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
    listing = {}
    for name, arr in arrays.items():
        fname = f"{name}.npy"
        with open(tmp / fname, "wb") as f:
            np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        listing[name] = fname
    doc = dict(manifest)
    doc["arrays"] = listing
    _write_file(tmp / MANIFEST, json.dumps(doc, indent=1, sort_keys=True).encode())
    _fsync_path(tmp)
    os.rename(tmp, final)
    _fsync_path(root)
    _write_file(final / (MARKER + ".tmp"), b"ok\n")
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


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a checkpoint: a complete ``ckpt-N`` directory, or a root (its newest complete one).

    Returns:
        ``(manifest, arrays)``.

    Raises:
        FileNotFoundError: no complete checkpoint there.
        ValueError: the manifest is malformed or lists a file outside the checkpoint.
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        latest = latest_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"no complete checkpoint in {str(path)!r} (looked for ckpt-*/{MARKER})")
        path = latest
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        listing = manifest.pop("arrays")
    except (ValueError, KeyError) as e:
        raise ValueError(f"malformed checkpoint manifest in {str(path)!r}: {e}") from e
    arrays = {}
    for name, fname in listing.items():
        if "/" in fname or fname.startswith("."):
            raise ValueError(f"checkpoint manifest in {str(path)!r} lists a bad file name {fname!r}")
        arrays[name] = np.load(path / fname, allow_pickle=False)
    return manifest, arrays
