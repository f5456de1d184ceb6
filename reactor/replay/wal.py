"""A write-ahead log of a table's insert batches: acknowledged inserts survive a kill -9.

A checkpoint holds the table as of its snapshot; without a log, inserts after it are lost when the
process dies. With one, every insert batch is appended to the log and fsynced *before* it is
acknowledged, and a restore loads the checkpoint and then redoes the logged inserts it does not
hold. Only inserts are logged: samples (times sampled, the generator), priority updates and deletes
since the checkpoint are not, so redone items carry their insert-time priorities.

**Records.** Each record is one insert batch, framed so that a torn tail (a process killed while
appending) is recognised and ignored::

    magic b"RWAL" | header length u32 | payload length u64 | BLAKE2b-128 of header+payload | header | payload

The header is msgpack: the batch's first global step (``first_step``: the storage's next step
before the insert), each field's torch dtype, shape and byte count, and the byte counts of the
priorities (float64), ``episode_end`` and ``item_mask`` (bool). The payload is those arrays' raw
bytes, in that order. Nothing is pickled.

**Segments.** The log is a directory of segment files ``wal-<first step, 16 digits>.log``. The owner
rotates to a new segment when it snapshots a checkpoint (:meth:`WriteAheadLog.rotate`, named by the
storage's next step at the snapshot), and drops segments every kept checkpoint covers once that
checkpoint is complete (:meth:`WriteAheadLog.drop_before`). A restore redoes the records whose
``first_step`` is at or past the checkpoint's next step, in step order; the first must start exactly
there and each must follow the one before (a gap means lost records, and redoing stops there, logged).
Global step numbers are never reused, so a record says by itself whether a checkpoint holds it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from .._files import read_small
from .checkpoint import _fsync_path as _fsync_dir  # the directory's entry, as a checkpoint's

__all__ = ["WalRecord", "WriteAheadLog", "read_wal", "redo_wal"]

log = logging.getLogger("reactor.replay")

_MAGIC = b"RWAL"
_FRAME = struct.Struct("<4sIQ16s")
_SEGMENT = re.compile(r"^wal-(\d{16})\.log$")
MAX_SEGMENT_READ_NBYTES = 1 << 40  # (a segment is read whole; only a regular file is, not a FIFO or a device)


def _digest(header: bytes, payload: list[memoryview]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(header)
    for part in payload:
        h.update(part)
    return h.digest()


def _as_tensor(x: Any) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(x)))
    return t.detach().cpu().contiguous()


def _bytes_of(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class WalRecord:
    """One logged insert batch (the arguments of ``Table.insert_nowait``) and where it starts."""

    first_step: int
    fields: dict[str, torch.Tensor]
    priorities: np.ndarray | None
    episode_end: np.ndarray
    item_mask: np.ndarray | None

    @property
    def num_steps(self) -> int:
        return int(self.episode_end.shape[0])


class WriteAheadLog:
    """The append side of a table's insert log, in directory ``path`` (created if missing).

    One appender per directory. :meth:`append` returns once the record is on stable storage
    (``os.writev`` then ``fsync``; the segment's directory entry is fsynced when it is created).

    Args:
        path: the log's directory.
        first_step: the storage's next global step: the name of the segment appends go to.
    """

    def __init__(self, path: str | os.PathLike[str], first_step: int) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._fd = -1
        self._segment: Path | None = None
        self.rotate(first_step)

    def rotate(self, first_step: int) -> None:
        """Close the current segment and append to ``wal-<first_step>.log`` from now on (a checkpoint
        snapshot at ``first_step`` covers everything logged before)."""
        seg = self.path / f"wal-{first_step:016d}.log"
        if seg == self._segment:
            return
        self.close()
        if seg.is_file():  # reopened after a restart: cut a torn tail off, or appends would hide behind it
            valid = _valid_length(seg)
            if valid < seg.stat().st_size:
                os.truncate(seg, valid)
        self._fd = os.open(seg, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segment = seg
        _fsync_dir(self.path)

    def append(
        self,
        first_step: int,
        fields: Mapping[str, Any],
        priorities: Any,
        episode_end: Any,
        item_mask: Any,
    ) -> int:
        """Append one insert batch and fsync it; returns the bytes written.

        Args:
            first_step: the global step of the batch's first row (the storage's next step before
                the insert).
            fields, priorities, episode_end, item_mask: as passed to ``Table.insert_nowait``
                (``episode_end`` as a bool ``[L]`` array).

        Raises:
            OSError: the write or the fsync failed (the insert must then not be acknowledged).
        """
        if self._fd < 0:
            raise ValueError(f"write-ahead log {str(self.path)!r} is closed")
        parts: list[memoryview] = []
        spec = []
        for name, value in fields.items():
            t = _as_tensor(value)
            b = _bytes_of(t)
            spec.append([str(name), str(t.dtype).removeprefix("torch."), list(t.shape), b.nbytes])
            parts.append(b)
        extra = []
        for arr, dtype in ((priorities, np.float64), (episode_end, np.bool_), (item_mask, np.bool_)):
            if arr is None:
                extra.append(-1)
                continue
            if isinstance(arr, torch.Tensor):
                arr = arr.detach().cpu().numpy()
            a = np.ascontiguousarray(np.asarray(arr, dtype=dtype))
            extra.append(a.nbytes)
            parts.append(memoryview(a.reshape(-1).view(np.uint8)))
        header = msgpack.packb({"first_step": int(first_step), "fields": spec, "extra": extra})
        payload_len = sum(p.nbytes for p in parts)
        frame = _FRAME.pack(_MAGIC, len(header), payload_len, _digest(header, parts))
        buffers = [frame, header, *[p for p in parts if p.nbytes]]
        total = len(frame) + len(header) + payload_len
        written = os.writev(self._fd, buffers)
        while written < total:  # a short write (rare): finish it with plain writes
            rest = b"".join(bytes(b) for b in buffers)[written:]
            written += os.write(self._fd, rest)
        os.fsync(self._fd)
        return total

    def drop_before(self, first_step: int) -> None:
        """Delete the segments whose records all precede ``first_step`` (every segment but the
        current one that starts before it: a segment ends where the next one starts)."""
        segments = _segments(self.path)
        for (_, seg), nxt in zip(segments, segments[1:] + [(None, None)]):
            if seg == self._segment or nxt[0] is None or nxt[0] > first_step:
                continue
            seg.unlink(missing_ok=True)

    def close(self) -> None:
        """Close the current segment. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._segment = None


def _segments(path: Path) -> list[tuple[int, Path]]:
    out = []
    for p in path.iterdir() if path.is_dir() else ():
        m = _SEGMENT.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def _valid_length(seg: Path) -> int:
    """Bytes of ``seg`` up to the end of its last intact record."""
    ends = [end for end, _ in _frames(seg, quiet=True)]
    return ends[-1] if ends else 0


def _records(seg: Path) -> Iterator[WalRecord]:
    for _, rec in _frames(seg, quiet=False):
        yield rec


def _frames(seg: Path, quiet: bool) -> Iterator[tuple[int, WalRecord]]:
    """``(end offset, record)`` of each intact record, stopping at a torn or damaged one (logged
    unless ``quiet``)."""
    try:
        data = read_small(seg, MAX_SEGMENT_READ_NBYTES)
    except ValueError as e:  # a FIFO or a device where a segment should be: nothing to redo from it
        log.warning("%s", e)
        return
    pos = 0
    while pos < len(data):
        why = ""
        if len(data) - pos < _FRAME.size:
            why = "a torn record"
        else:
            magic, hlen, plen, digest = _FRAME.unpack_from(data, pos)
            start = pos + _FRAME.size
            end = start + hlen + plen
            if magic != _MAGIC or end > len(data):
                why = "a torn or damaged record"
            else:
                header = data[start : start + hlen]
                payload = memoryview(data)[start + hlen : end]
                if _digest(header, [payload]) != digest:
                    why = "a record that fails its checksum"
        if why:
            if not quiet:
                log.warning("write-ahead log %s: %s at byte %d; it and the %d bytes after it are ignored",
                            seg, why, pos, len(data) - pos)
            return
        yield end, _decode(header, payload, seg, pos)
        pos = end


def _decode(header: bytes, payload: memoryview, seg: Path, pos: int) -> WalRecord:
    try:
        h = msgpack.unpackb(header)
        fields, off = {}, 0
        for name, dtype, shape, nbytes in h["fields"]:
            raw = bytearray(payload[off : off + nbytes])
            off += nbytes
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            t = torch.frombuffer(raw, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
            fields[name] = t.view(dt).reshape(shape)
        extra = []
        for nbytes, dtype in zip(h["extra"], (np.float64, np.bool_, np.bool_)):
            if nbytes < 0:
                extra.append(None)
                continue
            extra.append(np.frombuffer(bytearray(payload[off : off + nbytes]), dtype=dtype))
            off += nbytes
        if off != len(payload) or extra[1] is None:
            raise ValueError("the payload does not match its header")
        return WalRecord(int(h["first_step"]), fields, extra[0], extra[1], extra[2])
    except (ValueError, KeyError, TypeError, RuntimeError, msgpack.UnpackException) as e:
        # The checksum matched, so the writer wrote this: a bug, not a torn write.
        raise ValueError(f"write-ahead log {seg}: the record at byte {pos} is malformed ({e})") from e


def read_wal(path: str | os.PathLike[str], from_step: int) -> Iterator[WalRecord]:
    """The logged insert batches that start at or after global step ``from_step``, in order, stopping
    at a gap (logged: those records are lost) or at a torn or damaged record (logged; ignored).

    Records before ``from_step`` (a checkpoint holds them) are skipped.
    """
    expected = from_step
    for _, seg in _segments(Path(path)):
        for rec in _records(seg):
            if rec.first_step + rec.num_steps <= from_step:
                continue
            if rec.first_step != expected:
                log.error("write-ahead log %s: expected a record starting at step %d, found one at %d; the "
                          "records from there on are not redone (lost)", path, expected, rec.first_step)
                return
            yield rec
            expected = rec.first_step + rec.num_steps


def redo_wal(table: Any, path: str | os.PathLike[str]) -> tuple[int, int]:
    """Redo the logged inserts ``table`` does not hold (those from its storage's next step on), in order.

    Each goes through ``Table.redo_insert`` (the rate limiter admitted the original). A record the
    table refuses (a log from another configuration) stops the redo, logged.

    Returns:
        ``(records, steps)`` redone.
    """
    records = steps = 0
    for rec in read_wal(path, table.storage.step_range[1]):
        try:
            table.redo_insert(rec.fields, rec.priorities, episode_end=rec.episode_end, item_mask=rec.item_mask)
        except (KeyError, TypeError, ValueError) as e:
            log.error("write-ahead log %s: the record at step %d does not fit table %r (%s); it and the records "
                      "after it are not redone", path, rec.first_step, table.name, e)
            break
        records += 1
        steps += rec.num_steps
    _set_aside_beyond(Path(path), table.storage.step_range[1])
    return records, steps


def _set_aside_beyond(path: Path, next_step: int) -> None:
    """Move the records past ``next_step`` (those a redo did not take: after a gap or a refused
    record) out of the log, into ``<segment>.stale`` (logged). Left in place, the log the shard
    appends to next, from ``next_step``, would follow them, and the next restart's redo would stop
    at them again and lose every later, valid record. The records up to ``next_step`` stay: no
    checkpoint may hold them yet."""
    for _, seg in _segments(path):
        cut = None
        prev_end = 0
        for end, rec in _frames(seg, quiet=True):
            if rec.first_step + rec.num_steps > next_step:
                cut = prev_end
                break
            prev_end = end
        if cut is None:
            continue
        with open(seg, "r+b") as f:
            f.seek(cut)
            Path(f"{seg}.stale").write_bytes(f.read())
            f.truncate(cut)
            os.fsync(f.fileno())
        if cut == 0:
            seg.unlink()
        log.error("write-ahead log %s: the records from byte %d on (past step %d, not redone) were moved to %s",
                  seg, cut, next_step, f"{seg.name}.stale")
