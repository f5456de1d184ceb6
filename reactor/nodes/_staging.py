"""Staged inserts: an actor's rows reach the replay shards of its host through shared memory.

A :class:`~reactor.nodes.writer.Writer` sends each flush to a shard as one
:class:`~reactor.nodes.messages.Steps` message. Between two processes of one host, the rows of that
message (~1,200 rows, ~320 kB in the replay benchmark) were copied into a zmq frame, twice by the
kernel's unix socket, handled by both processes' zmq I/O threads, and copied once more into the ring:
~170 ns of CPU a row besides the insert itself (``docs/benchmarks.md``, session 50).

Here the actor keeps a *staging region* (a bulk region, ``shm`` backend only; one ring of rows per
shard) and writes a flush for a shard of its host straight into that shard's ring. The Steps message
then carries no rows, only where they are (:attr:`Steps.staged`: the region's descriptor, the first
row and the row count), with the episode ends, the item mask and the priorities as before. The shard
maps the region read-only (once per writer life, :class:`StagedReader`) and inserts from the mapped
rows; its :class:`~reactor.nodes.messages.InsertAck` frees them. A shard says that it can read this
way by its host id in ``InsertAck.host``; until one has, and for a flush its ring has no room for,
the rows travel in the message as before (the fallback is always there, so staging never holds a
writer back).

What a shard trusts: nothing in a staged message more than in any other. The descriptor is checked
as any bulk descriptor is (names derived from the run id, which must be the shard's, the owner alive,
segment sizes), its region must be a writer's staging region (``stage-...``, never the shard's own
ring), the row range against the region, the rows' dtypes and shapes by the insert's own
checks; the ends, mask and priorities travel in the message and are checked there. A writer that
wrote its ring again before the shard's ack would only spoil its own rows (they are data; the tree
and the index never come from the ring; a shard with a write-ahead log copies them first, so that
its log's record holds, under its checksum, what its table took).
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .._graph import plain_name
from ..transport import bulk as _bulk
from ..transport._shm import check_name_part

log = logging.getLogger("reactor.replay")

#: The most bytes a staging region takes (all its shards' rings): a writer of large rows (images)
#: stages fewer rows, and a flush larger than its ring goes in its message.
MAX_STAGING_NBYTES = 64 * 2**20
#: Staging regions a shard keeps mapped at once (one per writer life it has heard from); past it
#: the one least recently read is let go.
MAX_STAGED_REGIONS = 256
#: How every staging region's name begins (:func:`region_name`); a shard reads staged rows from no other.
STAGE_PREFIX = "stage-"
_MAX_HOST_CHARS = 512  # (an InsertAck's host id: a hostname and a boot id, or a daemon's host name)


class Staging:
    """A writer's staging region: a ring of ``rows_per_shard`` rows per shard, in flush order.

    ``put`` places a flush in a shard's ring (contiguously: a flush that would wrap skips the
    ring's tail) or says there is no room; every message sent to a shard is recorded (``sent``),
    staged or not, with the rows it holds, so that the shard's acks, which come in the order of its
    messages, free what each one held. Which messages an ack covers is the writer's to say
    (``Writer.acknowledged``, from the seq it names and the messages it keeps in flight; the two lists
    hold the same messages in the same order): :meth:`acked` frees the oldest that many. Those an ack
    naming no seq covers leave the list, their rows kept until an ack names a message in flight (a
    guess of which messages a shard has read frees nothing it may not have).
    """

    def __init__(self, owner: Any, region: str, views: dict[str, np.ndarray], num_shards: int,
                 rows_per_shard: int) -> None:
        self.owner = owner
        self.region = region
        self.views = views
        self.descriptor = owner.descriptor(region)
        self.host: str = self.descriptor["host"]
        self.num_shards = num_shards
        self.rows_per_shard = rows_per_shard
        self.ok = np.zeros(num_shards, dtype=bool)  # the shard said it reads this host's regions
        self.head = np.zeros(num_shards, dtype=np.int64)  # rows placed, ever (skips included)
        self.tail = np.zeros(num_shards, dtype=np.int64)  # rows freed by acks, ever
        self.kept = np.zeros(num_shards, dtype=np.int64)  # rows of messages acks without a seq counted, not freed
        # Per message in flight, in order: the rows it holds (0: sent in a message, or before staging began).
        self.held: list[deque[int]] = [deque() for _ in range(num_shards)]
        self.staged_messages = 0
        self.staged_rows = 0

    @classmethod
    def open(cls, run_id: str, name: str, specs: Sequence[Any], num_shards: int, rows_per_shard: int,
             who: str, min_rows: int = 1) -> Staging | None:
        """The region ``name`` of ``run_id`` with a ring of ``rows_per_shard`` rows per shard (fewer
        if that passes :data:`MAX_STAGING_NBYTES`), or None where shared memory cannot be had, or
        where a ring so bounded holds fewer than ``min_rows`` (a flush: it would stage nothing, and
        its memory is reserved when made) (said once, in ``who``'s name: its rows then travel in
        messages)."""
        row_nbytes = max(1, sum(s.step_nbytes for s in specs))
        rows_per_shard = int(min(rows_per_shard, MAX_STAGING_NBYTES // (row_nbytes * num_shards)))
        if rows_per_shard < max(1, min_rows):
            log.info("%s stages no rows in shared memory (a ring of its %d shards holds %d rows of %d bytes in %d MiB, "
                     "fewer than a flush of %d); its rows go to the shards in its messages", who, num_shards,
                     rows_per_shard, row_nbytes, MAX_STAGING_NBYTES >> 20, min_rows)
            return None
        try:
            owner = _bulk.BulkOwner.open_shm(run_id)
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("%s stages no rows in shared memory (%s); its rows go to the shards in its messages", who, e)
            return None
        try:
            views = {}
            for s in specs:
                t = owner.allocate(name, s.name, (rows_per_shard * num_shards, *s.shape), s.dtype)
                views[s.name] = t.numpy()
        except (OSError, ValueError, TypeError) as e:  # (a full /dev/shm: ENOSPC, said now)
            owner._close_now()
            log.warning("%s stages no rows in shared memory (%s); its rows go to the shards in its messages", who, e)
            return None
        return cls(owner, name, views, num_shards, rows_per_shard)

    def put(self, shard: int, names: Sequence[str], parts: Sequence[Mapping[str, np.ndarray]], rows: int) -> Any:
        """Write a flush of ``rows`` rows (``parts``: its segments' field arrays, in order), the writer's
        next message to ``shard``, into ``shard``'s ring; the :attr:`Steps.staged` word, or None (the
        shard has not said it can, or there is no room): then nothing was written. Records the message
        either way (:meth:`sent`)."""
        cap = self.rows_per_shard
        if not self.ok[shard] or rows > cap:
            self.sent(shard, 0)
            return None
        pos = int(self.head[shard] % cap)
        skip = cap - pos if pos + rows > cap else 0
        if int(self.head[shard] - self.tail[shard]) + skip + rows > cap:
            self.sent(shard, 0)
            return None
        first = shard * cap + (0 if skip else pos)
        for n in names:
            dst = self.views[n][first:first + rows]
            if len(parts) == 1:
                dst[...] = parts[0][n]
            else:
                np.concatenate([p[n] for p in parts], out=dst)
        self.head[shard] += skip + rows
        self.sent(shard, skip + rows)
        self.staged_messages += 1
        self.staged_rows += rows
        return (self.descriptor, first, rows)

    def sent(self, shard: int, rows: int) -> None:
        """The writer sent ``shard`` a message holding ``rows`` rows of its ring (0: none)."""
        self.held[shard].append(rows)

    def start(self, sent: Sequence[int]) -> None:
        """Begin with ``sent[k]`` messages already in flight to shard ``k`` (in messages: none holds rows)."""
        for k in range(self.num_shards):
            self.held[k].extend([0] * sent[k])

    def acked(self, shard: int, n: int, host: Any, pid: Any, named: bool = True) -> None:
        """``shard`` acknowledged the oldest ``n`` of this writer's messages in flight to it (the writer
        says how many its ack covers: 0 for a stray one, or one of an earlier life; ``host``: the shard's
        host id, or ""; ``pid``: its process's): frees what they held, and what the messages earlier
        acks counted held (the shard read those first). An ack that names no message (``named``
        False: no seq, or one of another type, from a user's actor or a peer) is no proof of what the
        shard has read: its messages' rows are kept (:attr:`kept`) until one that does."""
        held = self.held[shard]
        rows = 0
        for _ in range(min(n, len(held))):
            rows += held.popleft()
        if named and n:
            self.tail[shard] += rows + self.kept[shard]
            self.kept[shard] = 0
        else:
            self.kept[shard] += rows
        if n:  # (one that counts for no message in flight, a stray or a dead life's, says nothing of the shard now)
            self.ok[shard] = readable(host, pid, self.host)

    def lost(self, shard: int) -> None:
        """``shard``'s process died: what it held is free (it will never read it), and it is not
        staged to until its next life says it can."""
        self.held[shard].clear()
        self.tail[shard] = self.head[shard]
        self.kept[shard] = 0
        self.ok[shard] = False

    def close(self) -> None:
        """Unlink the region (a shard that mapped it keeps its mapping while it reads)."""
        self.owner._close_now()


def readable(host: Any, pid: Any, own_host: str) -> bool:
    """Whether a shard whose ack says ``host``, ``pid`` reads what a writer of ``own_host`` stages:
    the same host id, another process (in one process a message is handed over as it is)."""
    return type(host) is str and host == own_host and type(pid) is int and pid != os.getpid()


def stage_writer(writer: Any, run_id: str, who: str, max_unacked: int | None) -> Staging | None:
    """Give ``writer`` (of the reactor named ``who``) a staging region, its rings sized for
    ``max_unacked`` messages in flight per shard (4 when unbounded) of the largest flush it makes,
    and holding one of ``flush_steps`` rows at least; the staging, or None where it cannot have one
    (said)."""
    largest = writer.flush_steps + writer.before + writer.chunk + writer.after + 1
    staging = Staging.open(run_id, region_name(who), writer.specs, writer.num_shards,
                           (max(1, max_unacked or 4) + 1) * largest, who, min_rows=writer.flush_steps)
    if staging is not None:
        writer.use_staging(staging)
    return staging


def take_ack(writer: Any, shard: int, seq: Any, host: Any, pid: Any, run_id: str, who: str,
             max_unacked: int | None) -> None:
    """An :class:`InsertAck` of message ``seq`` for ``writer`` (of the reactor ``who``), its shard
    already checked: counted, and on the first ack of a shard of this host in another process the
    writer gets its staging region (tried once: a host without shared memory says so once). ``seq``,
    ``host`` and ``pid`` come from a peer: a word of another type counts as none (the ack still counts).
    An ack of a shard that is down (sent by its last life, come after its loss), or one that counts for no
    message in flight (a stray one, or the last life's come after the restart), says nothing of what the
    shard reads now, which may be on another host: the next life's own first ack does."""
    if type(seq) is not int:
        seq = None
    if type(host) is not str or len(host) > _MAX_HOST_CHARS or type(pid) is not int or writer.down[shard]:
        host, pid = "", 0
    counted = writer.acknowledged(shard, host, pid, seq)
    if counted and writer.staging is None and not writer.staging_refused and readable(host, pid, _bulk.host_id()):
        staging = stage_writer(writer, run_id, who, max_unacked)
        if staging is None:
            writer.staging_refused = True
        else:
            staging.ok[shard] = True


def region_name(who: str) -> str:
    """The staging region's name for the reactor instance ``who``: unique in the run, a bulk name
    (a hash of ``who`` where its plain name is not one)."""
    try:
        return check_name_part("region", f"{STAGE_PREFIX}{plain_name(who)}")
    except ValueError:
        return f"{STAGE_PREFIX}{hashlib.sha256(who.encode()).hexdigest()[:32]}"


class StagedReader:
    """A shard's side: maps the staging regions its writers name and hands out their rows (of regions
    of run ``run_id`` only; None: any run's)."""

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id
        #: The shard's own regions (its ring; set once it has them): never read as a writer's, whatever
        #: their names (a shard named ``stage-...`` has a ring named as staging regions are).
        self.own: frozenset[str] = frozenset()
        self._reader: Any = None
        self._regions: dict[str, tuple[Mapping[str, Any], dict[str, torch.Tensor]]] = {}  # region -> descriptor, fields

    def rows(self, staged: Any) -> dict[str, torch.Tensor]:
        """The rows a :attr:`Steps.staged` word names: ``{field: [rows, *shape]}``, views of the
        writer's read-only mapped region (valid while they live: an unlinked region stays mapped for
        them; nothing may write to them).

        Raises:
            ValueError: a malformed word or descriptor, a region that is not a staging region (or is the
                shard's own) or is of another run or host, rows outside it.
            PeerLostError: the region's owner closed it or died before this shard first mapped it.
            OSError: it could not be mapped.
        """
        if not isinstance(staged, (tuple, list)) or len(staged) != 3:
            raise ValueError(f"staged must be (descriptor, first row, rows), got {type(staged).__name__}")
        desc, first, rows = staged
        for what, v in (("first row", first), ("rows", rows)):
            if type(v) is not int:
                raise ValueError(f"staged {what} must be an int, got {type(v).__name__}")
        if not isinstance(desc, Mapping):
            raise ValueError(f"staged descriptor must be a map, got {type(desc).__name__}")
        region = desc.get("region")
        if not (isinstance(region, str) and region.startswith(STAGE_PREFIX)):  # (region_name's: not a shard's ring)
            raise ValueError(f"staged region {region!r:.100} is not a writer's staging region (named stage-...)")
        if region in self.own:  # (mapped again, its memory is not told apart from the ring by address)
            raise ValueError(f"staged region {region!r} is this shard's own region, not a writer's staging region")
        if self.run_id is not None and desc.get("run_id") != self.run_id:  # (its segments' names are derived from it)
            raise ValueError(f"staged region {region!r:.100} is of run {desc.get('run_id')!r:.100}, not this shard's "
                             f"({self.run_id!r})")
        have = self._regions.pop(region, None)
        if have is not None:  # (kept last: the cache lets go of the region least recently read)
            self._regions[region] = have
        if have is None or have[0] != desc:  # (a new life's, or one that says another thing: checked again)
            if self._reader is None:
                self._reader = _bulk.BulkReader.open_shm()
            name = self._reader.attach_shm(desc)
            self._regions.pop(name, None)
            if len(self._regions) >= MAX_STAGED_REGIONS:
                oldest = next(iter(self._regions))
                del self._regions[oldest]
                self._reader.detach(oldest)
            # As tensors, made once a region: the table would make them so at every insert, and torch
            # warns of a read-only array each time (it cannot mark a tensor read-only).
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
                    fields = {n: torch.from_numpy(v) for n, v in self._reader.mapped(name).items()}
            except BaseException:  # (a field torch cannot take: not kept mapped outside the bounded cache)
                self._reader.detach(name)
                raise
            have = self._regions[name] = (desc, fields)
        fields = have[1]
        total = next(iter(fields.values())).shape[0] if fields else 0
        if not (rows >= 1 and 0 <= first and first + rows <= total):
            raise ValueError(f"staged rows [{first}, {first + rows}) are outside region {region!r} of {total} rows")
        return {n: t[first:first + rows] for n, t in fields.items()}

    def close(self) -> None:
        self._regions.clear()
        if self._reader is not None:
            reader, self._reader = self._reader, None
            for name in reader.regions:
                reader.detach(name)
