"""What a replay shard keeps on disk: its checkpoints, its write-ahead log, its inserted mark.

A :class:`~reactor.nodes.replay.Replay` shard with a ``run_dir`` keeps all three in
``run_dir/<name>`` (the reactor's name with ``[i]`` written ``-i``: ``replay-0``); without one it
keeps nothing and every method here does nothing. The semantics (when a checkpoint is written, what
survives a crash) are the shard's, in the module docstring of ``reactor.nodes.replay``; this module
is their mechanics, kept apart from the shard's ports and sampling.

Owned by the shard's loop: no method is thread-safe. A checkpoint's files are written by the
table's background saver (``Table.save_in_background``); this object only starts a save and
collects its outcome.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import stat
import threading
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._files import os_error_in
from ..replay import Table
from ..replay.checkpoint import CheckpointCancelled, complete_checkpoints, incomplete_checkpoints
from ..replay.wal import WriteAheadLog, redo_wal

log = logging.getLogger("reactor.replay")

_MARK_FILE = "inserted"  # the storage's next global step after the latest insert, in the shard's directory


class ShardStore:
    """A shard's checkpoints, write-ahead log and inserted mark in ``directory`` (None: none of them).

    Args:
        name: the shard's reactor name (for the logs).
        directory: ``run_dir/<name>``, or None when the shard has no run_dir.
        keep: complete checkpoints kept (the log keeps what the oldest of them lacks).
        period_s: checkpoint at the first change at or after each multiple of this many seconds of
            the clock :meth:`checkpoint_if_due` is given (the shard's: logical time in deterministic
            runs, wall-clock time since it started in async ones); None: only on request and at shutdown.
        wal: log every insert before it is acknowledged (needs ``directory``).

    Attributes:
        checkpoints: checkpoints written by this life of the shard.
        restored_from: the checkpoint (or log) :meth:`open` restored from; ``""`` if none.
        lost_steps: after a restart, steps the previous life had inserted that the restore lacks
            (-1: unknown, as without a directory).
    """

    def __init__(self, name: str, directory: Path | None, *, keep: int, period_s: float | None, wal: bool) -> None:
        self.name = name
        self.directory = directory
        self.keep = keep
        self.checkpoints = 0
        self.failed_saves = 0  # checkpoints in a row that could not be written (a full disk)
        self.restored_from = ""
        self.lost_steps = 0
        self._want_wal = wal and directory is not None
        self._wal: WriteAheadLog | None = None
        self._mark: np.ndarray | None = None
        self._mark_path: Path | None = None
        self._saving: concurrent.futures.Future[Path] | None = None
        self._saving_at = (0, 0)  # (table generation, storage next step) of the save in progress
        self._cancel = threading.Event()
        self._saved_generation: int | None = None  # the table generation the newest checkpoint holds
        self._marks: deque[int] = deque(maxlen=keep)  # next steps of the kept checkpoints
        self._period_ns = None if period_s is None else max(1, round(period_s * 1e9))
        self._next_ns = self._period_ns

    @property
    def logs_inserts(self) -> bool:
        """Whether inserts go to a write-ahead log (:meth:`inserted` reads their rows again)."""
        return self._want_wal

    def open(self, table: Table, *, restore: bool, restarts: int) -> None:
        """Bring ``table`` (empty) back to what the directory holds when ``restore`` (the newest
        checkpoint that verifies, then the log past it), then open the log and the mark for new
        inserts. A restarted shard (``restarts`` > 0) logs what it restored against what its last
        life had inserted."""
        d = self.directory
        inserted_before = _read_inserted_mark(d) if restore else None
        if d is not None and restore:
            self._restore(table, d)
        if self._saved_generation is None and len(table) == 0 and (d is None or not complete_checkpoints(d)):
            # An empty table over no checkpoint: a final checkpoint only once it changed (every start that
            # failed, a refused resume among them, left an empty ckpt-00000001 in the run directory).
            self._saved_generation = table.generation
        now = table.storage.step_range[1]
        # (written at the first insert: a start that another node refuses left a rewritten mark in the
        # run directory it refused; and until then the earlier life's count is still the one to compare)
        self._mark_path = _check_mark(d)
        if restarts > 0:
            self.lost_steps = -1 if inserted_before is None else max(0, inserted_before - now)
            log.warning("%s restarted (restart %d): %s", self.name, restarts,
                        f"restored {now} of the {inserted_before} steps its last life had inserted: "
                        f"{self.lost_steps} lost" if inserted_before is not None else
                        f"restored {now} steps; the steps its last life inserted are unknown "
                        f"(no run_dir, or another host's)")
        if self._want_wal:
            assert d is not None
            wal_dir = d / "wal"
            if not restore and wal_dir.is_dir():  # a fresh table: an old log is not its history
                for seg in wal_dir.glob("wal-*.log"):
                    seg.unlink()
            self._wal = WriteAheadLog(wal_dir, now)

    def _restore(self, table: Table, root: Path) -> None:
        try:
            self._restore_into(table, root)
        except MemoryError:  # (a MemoryError traceback from inside numpy said nothing of why or what to do)
            ckpts = complete_checkpoints(root)
            size = sum(f.stat().st_size for f in ckpts[0].iterdir() if f.is_file()) if ckpts else 0
            raise ValueError(f"{self.name}: restoring the replay checkpoint in {root} ({size / 2**30:.1f} GiB on disk) "
                             f"ran out of memory (the rows are read into the replay's own memory; its index and sampler state need "
                             f"memory beside it); "
                             f"give this host more memory, or start the shard empty (Replay(restore=False))") from None

    def _restore_into(self, table: Table, root: Path) -> None:
        try:
            path, refusals = table.restore_from(root)
        except ValueError as e:  # (it said what differs, not where, nor what to do)
            raise ValueError(f"{self.name}: cannot restore into this run's replay: {e} (a resumed run's "
                             f"settings, its env, capacity and prioritized among them, must be those it was "
                             f"saved with: config.json beside it has them)") from None
        for why in refusals:
            log.error("%s: %s; trying an older checkpoint", self.name, why)
        if path is not None:
            self.restored_from = str(path)
            self._saved_generation = table.generation
            self._marks.append(table.storage.step_range[1])
            log.info("%s restored %d items from %s", self.name, len(table), path)
        elif refusals:
            log.error("%s: no checkpoint in %s verifies; the shard starts empty", self.name, root)
        if self._want_wal:
            redone, steps_redone = redo_wal(table, root / "wal")
            if redone:
                self.restored_from = self.restored_from or str(root / "wal")
                log.info("%s redid %d logged inserts (%d steps) past the checkpoint", self.name, redone,
                         steps_redone)
        cut_short = [] if self.restored_from else incomplete_checkpoints(root)
        if cut_short:  # (it started empty in silence)
            log.warning("%s: %s holds no complete checkpoint, only %s cut short before its COMPLETE was written "
                        "(the run was killed while saving): the shard starts empty", self.name, root,
                        ", ".join(p.name for p in cut_short))

    def inserted(self, first: int, next_step: int, fields: Mapping[str, Any], priorities: Any, ends: np.ndarray,
                 item_mask: Any) -> None:
        """An insert of the rows from global step ``first`` is in the table (``next_step`` after it):
        on stable storage in the log before its writer is acknowledged (an ``OSError`` fails the
        shard), and counted in the mark."""
        if self._wal is not None:
            self._wal.append(first, fields, priorities, ends, item_mask)
        if self._mark is None and self._mark_path is not None:
            self._mark = _inserted_mark(self._mark_path)
        if self._mark is not None:
            self._mark[0] = next_step

    def checkpoint_if_due(self, table: Table, time_ns: int) -> None:
        """The periodic checkpoint: at the first change at or after each multiple of the period
        (``time_ns``: the shard's clock, which must not go back; a tag in an async run does).

        Called at the end of the reactions that change the table, so nothing is scheduled for it
        (a pending timer would keep a finished run alive). Skipped while the previous save is
        still being written (the next change asks again) and when the table has not changed.
        """
        due = self._next_ns
        if due is None or time_ns < due:
            return
        self.collect()
        if self._saving is not None:
            return
        assert self._period_ns is not None
        self._next_ns = (time_ns // self._period_ns + 1) * self._period_ns
        self.checkpoint(table, only_if_changed=True)

    def checkpoint(self, table: Table, *, only_if_changed: bool = False) -> concurrent.futures.Future[Path] | None:
        """Start a background checkpoint of ``table`` now; None without a directory, while the
        previous save is still being written, or (``only_if_changed``) if the table has not changed
        since the newest checkpoint. With a log, appends go to a new segment from the snapshot on."""
        if self.directory is None:
            return None
        self.collect()
        if self._saving is not None:
            log.warning("%s: checkpoint skipped, the previous one is still being written", self.name)
            return None
        generation = table.generation
        if only_if_changed and generation == self._saved_generation:
            return None
        next_step = table.storage.step_range[1]
        if self._wal is not None:
            self._wal.rotate(next_step)
        self._cancel = threading.Event()
        self._saving_at = (generation, next_step)
        self._saving = table.save_in_background(self.directory, keep=self.keep, cancel=self._cancel)
        return self._saving

    def collect(self, timeout_s: float | None = 0.0) -> None:
        """Take the outcome of the save in progress if it ended within ``timeout_s``: count it and
        drop the log segments every kept checkpoint holds; log a failure."""
        fut = self._saving
        if fut is None:
            return
        try:
            fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            return
        except CheckpointCancelled:
            log.info("%s: a checkpoint in progress was cancelled at shutdown", self.name)
        except Exception as e:
            cause = os_error_in(e)
            if cause is None:
                log.exception("%s: checkpoint failed", self.name)
            else:  # (a full disk: a traceback at every period; one line at the first and every tenth)
                self.failed_saves += 1
                if self.failed_saves % 10 == 1:
                    log.warning("%s: cannot write a checkpoint in %s (%s; %d failed tries so far); the newest complete "
                                "one stays, and the shard tries again at its next period", self.name, self.directory,
                                cause.strerror or cause, self.failed_saves)
        else:
            if self.failed_saves:
                log.warning("%s: wrote a checkpoint again, after %d failed tries", self.name, self.failed_saves)
                self.failed_saves = 0
            self.checkpoints += 1
            self._saved_generation, next_step = self._saving_at
            self._marks.append(next_step)
            if self._wal is not None and len(self._marks) == self._marks.maxlen:
                self._wal.drop_before(self._marks[0])  # the oldest kept checkpoint holds the rest
        self._saving = None

    def close(self, table: Table, *, final: bool) -> None:
        """The run ended: with ``final``, write a last checkpoint (here, synchronously) if the table
        changed since the newest one. A save in progress that holds the latest state is the final
        one (waited for up to 120 s); a stale one is cancelled first (it stops within a chunk)."""
        final = final and self.directory is not None
        if self._saving is not None and not self._saving.done():
            if final and self._saving_at[0] != table.generation:
                self._cancel.set()
            self.collect(timeout_s=120.0)
        self.collect()
        if self._saving is not None:  # a disk stalled for minutes: a second saver would race the first
            log.error("%s: a checkpoint is still being written after 120 s; no final checkpoint", self.name)
        elif final and table.generation != self._saved_generation:
            assert self.directory is not None
            try:
                table.save(self.directory, keep=self.keep)
            except OSError as e:
                err = OSError(f"{self.name}: cannot write its final checkpoint in {self.directory} "
                              f"({e.strerror or e}); the newest complete one there stays")
                err.errno = e.errno
                raise err from e
            self.checkpoints += 1
            self._saved_generation = table.generation
        if self._wal is not None:
            self._wal.close()


def _check_mark(directory: Path | None) -> Path | None:
    """Where a shard's inserted mark goes (None: no directory), checked when the shard opens: the mark
    is written in place, never through a link.

    Raises:
        ValueError: something other than a regular file is there, naming it.
    """
    if directory is None:
        return None
    path = directory / _MARK_FILE
    if path.is_symlink() or (path.exists() and not path.is_file()):  # written in place: never through a link
        raise ValueError(f"{path} is not a regular file (a link, a FIFO, a device): remove it")
    return path


def _inserted_mark(path: Path) -> np.ndarray:
    """A file-backed counter of the steps this shard has inserted, updated after every insert: it
    is in the page cache, so it survives the shard's process being killed (not its host's crash),
    and a restarted shard compares it with what its checkpoint restored (``lost_steps``). Made at
    the shard's first insert (:meth:`ShardStore.inserted`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(1,))


def _read_inserted_mark(directory: Path | None) -> int | None:
    if directory is None:
        return None
    try:
        if not stat.S_ISREG(os.stat(directory / _MARK_FILE).st_mode):  # (a FIFO's load would wait forever)
            return None
        mark = np.load(directory / _MARK_FILE, mmap_mode="r", allow_pickle=False)
        return int(mark[0]) if mark.shape == (1,) and mark.dtype == np.int64 else None
    except (OSError, ValueError, IndexError):
        return None
