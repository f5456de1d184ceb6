"""Table: storage + sampler selector + remover selector + rate limiter + max_times_sampled.

**What an item is.** An item is a reference to one stored step, the *anchor*, with a priority. Its
key is the anchor's global step number (an int64, unique, never reused, increasing with insertion),
so a key also names the storage ring slot ``key % capacity`` where the item's bookkeeping lives.
Each insert appends ``L`` steps to the storage and creates an item on each step (or on the steps
``item_mask`` selects). What a sample *returns* for an item is the table's read kind:

- :class:`StepRead`: the anchor step's fields (a cpprb-style transition buffer stores ``next_obs``
  as a field and reads steps);
- :class:`TransitionRead`: the transition from the anchor with ``next_<f>`` and an n-step return;
- :class:`WindowRead`: a ``[T]`` window that starts (tail padding) or ends (head padding) at the
  anchor, with a validity mask;
- :class:`EpisodeRead`: the anchor's whole episode.

**Items and storage.** The storage keeps steps in a ring and evicts whole oldest episodes; an
evicted step takes its item with it (counted as ``evicted``). The remover bounds the number of
*items* (``max_size``) independently: removing an item frees its priority slot, while its steps
stay readable by the windows/episodes of other items until the ring overwrites them.

**PER maths.** The sampler draws slot ``i`` with probability ``P(i)`` (Prioritized:
``p_i^alpha / sum_j p_j^alpha``). With ``N`` items, the importance weight is
``w_i = (N P(i))^-beta / max_j (N P(j))^-beta = (P(i) / min_j P(j))^-beta``, in ``(0, 1]``.

**Concurrency.** All methods take one lock (so a checkpoint snapshot is consistent and short);
``insert`` and ``sample`` wait for the rate limiter on the caller's asyncio loop, and between the
limiter allowing an operation and the operation there is no ``await``. Bad input raises before
anything changes: the table is then exactly as before the call.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._errors import PortClosedError, ReactorInternalError, WouldBlock
from ._hostmem import MemoryClaim
from ._tablekernels import (
    _nb_check_update,
    _nb_evict_and_key,
    _nb_first_bad_priority,
    _nb_insert_host,
    _nb_sample_info,
    _nb_sample_windows,
)
from ._tablesize import _PHYSICAL_MEMORY as _PHYSICAL_MEMORY
from ._tablesize import _filled_host_nbytes, _item_nbytes
from ._tablesize import claim_fits as claim_fits
from ._tablesize import max_sample as max_sample
from ._tablesize import table_host_nbytes as table_host_nbytes
from ._tablestate import TableState
from .rate_limiters import Queue, RateLimiter, RateLimiterStatistics, Stack
from .reads import EpisodeRead, ReadSpec, StepRead, TransitionRead, WindowRead
from .selectors import Prioritized
from .storage import _PREFETCH_WINDOWS, Storage, StorageMemory
from .sumtree import PriorityOverflowError

if TYPE_CHECKING:
    from .selectors import Selector

__all__ = [
    "EpisodeRead",
    "SampleInfo",
    "StepRead",
    "Table",
    "TableStatistics",
    "TransitionRead",
    "WindowRead",
]


# ---------------------------------------------------------------------------- results


@dataclass(frozen=True)
class SampleInfo:
    """What a sample drew, item by item (same order as the batch).

    Attributes:
        keys: int64 ``[B]``, for :meth:`Table.update_priorities` and :meth:`Table.delete`.
        probabilities: float64 ``[B]``, the sampler's probability of each draw (1.0 for deterministic
            samplers).
        weights: float32 ``[B]``, importance weights ``(P(i)/min_j P(j))^-beta`` in (0, 1].
        table_size: items in the table when the sample was drawn.
        times_sampled: int64 ``[B]``, how often each item has been sampled, this draw included.
    """

    keys: torch.Tensor
    probabilities: torch.Tensor
    weights: torch.Tensor
    table_size: int
    times_sampled: torch.Tensor


@dataclass(frozen=True)
class TableStatistics:
    """A table's state and counters (items unless named otherwise).

    Attributes:
        name: the table's name.
        size: items now.
        max_size: most items held; the remover makes room beyond it.
        num_steps: steps in storage now.
        num_episodes: episodes in storage now.
        inserted: items inserted since construction or reset.
        sampled: items sampled (draws) since construction or reset.
        evicted: items dropped because the storage evicted their step.
        removed: items dropped by the remover.
        expired: items dropped after ``max_times_sampled`` samples.
        deleted: items dropped by :meth:`Table.delete`.
        rate_limiter: the limiter's counters.
        memory: the storage's memory.
    """

    name: str
    size: int
    max_size: int
    num_steps: int
    num_episodes: int
    inserted: int
    sampled: int
    evicted: int
    removed: int
    expired: int
    deleted: int
    rate_limiter: RateLimiterStatistics
    memory: StorageMemory = field(repr=False)


# ---------------------------------------------------------------------------- helpers


def _as_int64(name: str, values: Any) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1 or not (arr.dtype.kind in "iu" or arr.size == 0):
        raise TypeError(f"{name} must be a 1-D array of integers, got dtype {arr.dtype} shape {arr.shape}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"{name}: {int(arr.max())} is past the largest key (2**63 - 1)")  # (it wrapped to -1)
    return arr.astype(np.int64, copy=False)


_INT64_MAX = 2**63 - 1
_NO_MASK = np.empty(0, dtype=np.bool_)  # (_nb_evict_and_key: every step an item)


def _as_float64(values: Any) -> np.ndarray:
    """Priorities as float64; complex ones are refused (numpy kept the real part, with a warning only)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    if np.iscomplexobj(values):
        raise TypeError("priorities must be real numbers, got complex ones")
    return np.asarray(values, dtype=np.float64)


def _as_priorities(values: Any, n: int, mask: np.ndarray | None = None) -> np.ndarray:
    arr = values if isinstance(values, np.ndarray) and values.dtype == np.float64 else _as_float64(values)
    if arr.shape != (n,):
        raise ValueError(f"priorities must have shape ({n},), got {arr.shape}")
    # One compiled pass instead of four numpy calls (an insert's hot path); with a mask, over the items'.
    items = arr if mask is None else arr[mask]
    i = int(_nb_first_bad_priority(items))
    if i >= 0:
        if mask is not None:
            i = int(np.flatnonzero(mask)[i])
        raise ValueError(
            f"priority {float(arr[i])!r} at position {i} is invalid: priorities must be finite and >= 0"
        )
    return items


# ---------------------------------------------------------------------------- table


class Table(TableState):
    """A replay table: items over a step storage, chosen by selectors, paced by a rate limiter.

    Args:
        storage: the step storage (owned by this table from now on).
        sampler: selector that picks items to sample.
        remover: selector that picks items to drop when more than ``max_size`` would be held.
        rate_limiter: when inserts and samples may proceed.
        max_size: most items held (default and upper bound: ``storage.capacity``).
        max_times_sampled: drop an item after it was sampled this many times (0: never).
        read: what a sample returns per item (default :class:`StepRead`).
        beta: importance-weight exponent (>= 0).
        seed: seed of the generator the sampler and remover draw from (part of the state).
        name: for messages and statistics.
        arrays: where the sampler's state and the times-sampled column live:
            ``arrays(name, shape, dtype) -> ndarray``, e.g. memory readers in other processes map to
            sample one-sidedly (:mod:`reactor.replay.shared`). None: memory of its own.
        memory_claim: the host memory the table needs once full, claimed by the caller, who gives it
            back (:func:`claim_fits` with a run's ledger: a replay shard claims before it allocates its
            storage). None: the table claims it among this process's tables, and gives it back when
            it goes.

    Raises:
        ValueError: a value out of range, the same selector as sampler and remover, a selector or
            limiter that already belongs to a table, a read kind that names missing fields, a table
            that cannot fit in this host's memory once full, alone or beside the other tables of
            this process (:func:`claim_fits`).
        TypeError: a component of the wrong type.

    Example:
        >>> t = Table(Storage([FieldSpec("obs", (4,))], 1000), sampler=Prioritized(0.6), remover=Fifo(),
        ...           rate_limiter=MinSize(1))
        >>> keys = t.insert_nowait({"obs": torch.zeros(8, 4)}, priorities=np.ones(8))
        >>> batch, info = t.sample_nowait(4)
    """

    def __init__(
        self,
        storage: Storage,
        *,
        sampler: Selector,
        remover: Selector,
        rate_limiter: RateLimiter,
        max_size: int | None = None,
        max_times_sampled: int = 0,
        read: ReadSpec = StepRead(),
        beta: float = 0.4,
        seed: int = 0,
        name: str = "table",
        arrays: Any = None,
        memory_claim: MemoryClaim | None = None,
    ) -> None:
        from .selectors import Selector

        if not isinstance(storage, Storage):
            raise TypeError(f"storage must be a Storage, got {type(storage).__name__}")
        for what, sel in (("sampler", sampler), ("remover", remover)):
            if not isinstance(sel, Selector):
                raise TypeError(f"{what} must be a Selector (Uniform, Prioritized, ...), got {type(sel).__name__}")
        if sampler is remover:
            raise ValueError("sampler and remover must be two selector instances (e.g. Fifo() and Fifo())")
        if not isinstance(rate_limiter, RateLimiter):
            raise TypeError(f"rate_limiter must be a RateLimiter, got {type(rate_limiter).__name__}")
        cap = storage.capacity
        if max_size is None:
            max_size = cap
        if isinstance(max_size, bool) or not isinstance(max_size, int) or not 1 <= max_size <= cap:
            raise ValueError(f"max_size must be an int in [1, storage.capacity={cap}], got {max_size!r}")
        if isinstance(max_times_sampled, bool) or not isinstance(max_times_sampled, int) or max_times_sampled < 0:
            raise ValueError(f"max_times_sampled must be an int >= 0 (0: unlimited), got {max_times_sampled!r}")
        if not isinstance(read, (StepRead, TransitionRead, WindowRead, EpisodeRead)):
            raise TypeError(f"read must be StepRead, TransitionRead, WindowRead or EpisodeRead, got {read!r}")
        fields = {s.name for s in storage.specs}
        if isinstance(read, TransitionRead):
            if read.n > cap:  # (each sample's work and memory grew with n: 570 MB for 2 items at n=10**7)
                raise ValueError(f"TransitionRead n={read.n} is more than the storage's capacity {cap}: an n-step "
                                 f"return spans at most the steps the ring holds; use n <= {cap}")
            for f in (read.reward_field, *read.next_fields):
                if f not in fields:
                    raise ValueError(f"TransitionRead names field {f!r}, not in the storage fields {sorted(fields)}")
            clash = sorted(fields & {f"next_{f}" for f in read.next_fields} | (fields & {"discount", "valid"}))
            if clash:
                raise ValueError(f"TransitionRead output would overwrite stored field(s) {clash}; rename them")
        if isinstance(read, WindowRead) and "mask" in fields:
            raise ValueError("WindowRead adds a 'mask' output, which clashes with a stored field 'mask'")
        if isinstance(read, EpisodeRead) and "lengths" in fields:
            raise ValueError("EpisodeRead adds a 'lengths' output, which clashes with a stored field 'lengths'")
        if not (math.isfinite(beta) and beta >= 0):
            raise ValueError(f"beta must be finite and >= 0, got {beta!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        # The host memory it needs once full, claimed beside the other tables of its ledger before the trees
        # are written (a caller that claimed it in a run's ledger passes the claim: a replay shard).
        claim = claim_fits(storage, cap) if memory_claim is None else None
        # Claim the components last, so a failed construction leaves them reusable.
        try:
            rate_limiter.bind()
            sampler.bind(cap, arrays)
            remover.bind(cap)
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        if claim is not None:  # (its own claim goes back when the table goes; a caller's, when the caller says)
            weakref.finalize(self, claim.release)
        (claim or memory_claim).filled = _filled_host_nbytes(weakref.ref(self))  # type: ignore[union-attr]
        self._name = name
        self._storage = storage
        self._sampler = sampler
        self._remover = remover
        # Items sit on stored steps, so with max_size == capacity the storage's eviction always makes
        # room first and the remover can never be asked: the table then skips feeding it.
        self._feed_remover = max_size < cap
        self._gone = np.empty(256, dtype=np.int64)  # scratch: the slots an insert's evictions drop
        # A prioritized insert into host storage takes one compiled call (_apply_insert_host).
        self._host_storage = storage.device.type == "cpu"  # (validation then takes the sources' addresses)
        self._host_insert = self._host_storage and type(sampler) is Prioritized and not self._feed_remover
        self._host_out = np.empty(5, dtype=np.int64)
        self._limiter = rate_limiter
        self._max_size = max_size
        self._max_times_sampled = max_times_sampled
        self._read = read
        # Prioritized windows from host memory take one compiled call per sample instead of three
        # (draw, bookkeeping, window copy): ~10 us of the ~87 us of a 256 x 32 sample was spent
        # between the calls (docs/benchmarks.md). Same draws, bytes and bookkeeping.
        self._one_call_windows = (
            type(sampler) is Prioritized
            and isinstance(read, WindowRead)
            and type(storage) is Storage  # a subclass may read windows its own way
            and storage.device.type == "cpu"
        )
        self._beta = float(beta)
        self._seed = int(seed)
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._keys = np.full(cap, -1, dtype=np.int64)  # slot -> key, -1 when empty
        self._times = np.zeros(cap, dtype=np.int64) if arrays is None else arrays("times", (cap,), np.int64)
        self._times.fill(0)  # slot -> times sampled
        self._size = 0
        self._counts = dict.fromkeys(("inserted", "sampled", "evicted", "removed", "expired", "deleted"), 0)
        # Bumped by every change of the state a checkpoint holds (insert, sample: times sampled and
        # the generator move, update, delete, reset, load): an owner compares it to skip rewriting
        # an unchanged table. One integer add per call; never part of the state.
        self._generation = 0
        # The largest sample a call may ask for: beyond it the request is a bug, not a batch, and
        # must not surface as a MemoryError from the output allocation (see check_sample_size).
        self._max_sample = max_sample(cap)
        self._item_nbytes = _item_nbytes(storage, read)
        self._lock = threading.RLock()

    @classmethod
    def queue(cls, storage: Storage, size: int, *, read: ReadSpec = StepRead(), name: str = "queue") -> Table:
        """A FIFO queue: each item sampled once, oldest first, inserts wait when ``size`` are pending."""
        from .selectors import Fifo

        return cls(storage, sampler=Fifo(), remover=Fifo(), rate_limiter=Queue(size), max_size=size,
                   max_times_sampled=1, read=read, name=name)

    @classmethod
    def stack(cls, storage: Storage, size: int, *, read: ReadSpec = StepRead(), name: str = "stack") -> Table:
        """A LIFO stack: each item sampled once, newest first, inserts wait when ``size`` are pending."""
        from .selectors import Lifo

        return cls(storage, sampler=Lifo(), remover=Lifo(), rate_limiter=Stack(size), max_size=size,
                   max_times_sampled=1, read=read, name=name)

    # ------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        """The table's name."""
        return self._name

    @property
    def storage(self) -> Storage:
        """The step storage."""
        return self._storage

    @property
    def max_size(self) -> int:
        """Most items held."""
        return self._max_size

    @property
    def rate_limiter(self) -> RateLimiter:
        """The rate limiter."""
        return self._limiter

    def __len__(self) -> int:
        return self._size

    @property
    def generation(self) -> int:
        """A counter bumped by every change of the checkpointed state (insert, sample, priority update,
        delete, reset, load). Equal values mean an unchanged table: an owner that checkpoints
        periodically skips a table whose generation is the one it saved last. Not part of the state."""
        return self._generation

    @property
    def max_sample(self) -> int:
        """The largest ``n`` :meth:`sample_nowait` accepts (``max(64 * capacity, 65536)``)."""
        return self._max_sample

    # ------------------------------------------------------------------ insert

    def _prepare_insert(
        self, steps: Mapping[str, Any], priorities: Any, item_mask: Any
    ) -> tuple[tuple[int, dict[str, torch.Tensor], list[int]], np.ndarray, np.ndarray | None, int]:
        validated = self._storage._validate(steps, self._host_storage)
        length = validated[0]
        mask = None
        if item_mask is not None:
            if isinstance(item_mask, torch.Tensor):
                item_mask = item_mask.detach().cpu().numpy()
            mask = np.asarray(item_mask)
            if mask.dtype != np.bool_ or mask.shape != (length,):
                raise ValueError(f"item_mask must be a bool array of shape ({length},), got {mask.dtype} {mask.shape}")
        n = length if mask is None else int(np.count_nonzero(mask))
        if priorities is None:
            prio = np.ones(n, dtype=np.float64)
        else:
            prio = _as_priorities(priorities, length, mask)
        if n > self._max_size:
            raise ValueError(f"insert of {n} items exceeds the table's max_size {self._max_size}; split it")
        return validated, prio, mask, n

    def _prepare_priorities(self, prio: np.ndarray, keys: Any, mask: np.ndarray | None = None) -> tuple[Any, Any]:
        """The selectors' :meth:`Selector.prepare` of ``prio``, before anything changes: finite
        priorities whose ``p**alpha`` or sum would overflow are refused with a ValueError naming the
        key (``keys(i)``; None: the ``i``-th item of the next insert, whose ``item_mask`` is ``mask``)
        and the value."""
        try:
            return (self._sampler.prepare(prio), self._remover.prepare(prio) if self._feed_remover else None)
        except PriorityOverflowError as e:
            i = e.position
            key = self._insert_key(i, mask) if keys is None else keys(i)
            raise ValueError(
                f"priority {float(prio[i])!r} for key {key} (position {i}) is refused by table {self._name!r}: "
                f"{e.why}; nothing was changed (scale the priorities down)"
            ) from None

    def _insert_key(self, i: int, mask: np.ndarray | None) -> int:
        """The key the ``i``-th item of the next insert will get (for messages)."""
        return self._storage.step_range[1] + (i if mask is None else int(np.flatnonzero(mask)[i]))

    def insert_nowait(
        self,
        steps: Mapping[str, Any],
        priorities: Any = None,
        *,
        episode_end: bool | np.ndarray | Sequence[bool] = True,
        item_mask: Any = None,
    ) -> torch.Tensor:
        """Append steps and create their items now, or raise WouldBlock.

        Args:
            steps: field name -> ``[L, *shape]`` tensor/array of the spec's dtype, for every field.
            priorities: ``[L]`` priorities, finite and >= 0 (default 1.0); entries where ``item_mask``
                is False are ignored.
            episode_end: True ends the episode at the last step (default), False keeps it open for the
                next insert, or a bool ``[L]`` array marks the steps that end an episode.
            item_mask: bool ``[L]``: create items only on these steps (default: on every step).

        Returns:
            int64 ``[n]`` keys of the new items.

        Raises:
            KeyError: unknown or missing field. TypeError: wrong dtype. ValueError: wrong shape, bad
                priority (the message gives the value and position), a finite priority that would
                overflow the sampler (``p**alpha`` or the sum tree's total past float64; the message
                names the key and the value), too many items for ``max_size``, an open episode that
                would outgrow the storage, more items than the rate limiter's window ever admits at
                once (``RateLimiter.never_inserts``).
            WouldBlock: the rate limiter does not allow it now.
            PortClosedError: the table was closed.
        """
        with self._lock:
            if self._limiter.closed:
                raise PortClosedError(f"insert into table {self._name!r}, which was closed by close()")
            return self._insert_locked(steps, priorities, episode_end, item_mask, admit=True)

    def redo_insert(
        self,
        steps: Mapping[str, Any],
        priorities: Any = None,
        *,
        episode_end: bool | np.ndarray | Sequence[bool] = True,
        item_mask: Any = None,
    ) -> torch.Tensor:
        """Insert as :meth:`insert_nowait` does, but without asking the rate limiter (it admitted the
        original insert): for redoing a write-ahead log after a restore. The limiter still counts it.

        Raises:
            As :meth:`insert_nowait`, except WouldBlock.
        """
        with self._lock:
            return self._insert_locked(steps, priorities, episode_end, item_mask, admit=False)

    def _insert_locked(self, steps: Mapping[str, Any], priorities: Any, episode_end: Any, item_mask: Any, *,
                       admit: bool) -> torch.Tensor:
        """Validate, plan and apply one insert (the lock held); ``admit``: ask the rate limiter first."""
        validated, prio, mask, n = self._prepare_insert(steps, priorities, item_mask)
        plan = self._storage.plan_append(validated[0], episode_end)
        if admit and not self._limiter.can_insert(n, self._size):
            never = self._limiter.never_inserts(n, self._size)
            if never is not None:
                raise ValueError(f"table {self._name!r}: {never}")
            # Before the priorities' pass: a shard retries a parked insert after every change.
            raise WouldBlock(f"table {self._name!r}: " + self._limiter.explain("insert", n, self._size))
        return self._apply_insert(validated, plan, prio, mask, n)

    async def insert(
        self,
        steps: Mapping[str, Any],
        priorities: Any = None,
        *,
        episode_end: bool | np.ndarray | Sequence[bool] = True,
        item_mask: Any = None,
        timeout_s: float | None = None,
    ) -> torch.Tensor:
        """Like :meth:`insert_nowait`, but wait on the running loop while the rate limiter blocks.

        Input is validated before waiting, and read (validated again) when it goes in: a tensor the
        caller changed meanwhile is copied as it is then (a numpy array with negative strides, which
        torch cannot view, is copied at the first check, as it was then). Cancelling the wait inserts
        nothing.

        Raises:
            TimeoutError: ``timeout_s`` passed while blocked (nothing inserted).
            PortClosedError: the table is or gets closed while waiting.
            Others: as :meth:`insert_nowait`.
        """
        with self._lock:
            if self._limiter.closed:
                raise PortClosedError(f"insert into table {self._name!r}, which was closed by close()")
            validated, prio, mask, n = self._prepare_insert(steps, priorities, item_mask)
            self._prepare_priorities(prio, None, mask)
        while True:
            await self._limiter.wait(
                "insert",
                lambda k=n: self._limiter.can_insert(k, self._size) or self._limiter.never_inserts(k, self._size) is not None,
                lambda k=n: f"table {self._name!r}: " + self._limiter.explain("insert", k, self._size),
                timeout_s,
            )
            with self._lock:  # re-check under the lock: another thread may have acted in between
                # The inputs as they are now (the copy reads them now: by address in the one kernel, and
                # a source given new memory or a new shape meanwhile must not be read as it was).
                validated, prio, mask, n = self._prepare_insert(validated[1], priorities, item_mask)
                never = None if self._limiter.can_insert(n, self._size) else self._limiter.never_inserts(n, self._size)
                if never is not None:
                    raise ValueError(f"table {self._name!r}: {never}")
                if self._limiter.can_insert(n, self._size):
                    # (the priorities checked again as it goes in: inserts while this one waited may have
                    # used the tree's headroom)
                    plan = self._storage.plan_append(validated[0], episode_end)
                    return self._apply_insert(validated, plan, prio, mask, n)

    def _drop(self, slots: np.ndarray, counter: str) -> None:
        if len(slots) == 0:
            return
        self._sampler.delete(slots)
        if self._feed_remover:
            self._remover.delete(slots)
        self._keys[slots] = -1
        self._size -= len(slots)
        self._counts[counter] += len(slots)

    def _apply_insert(
        self,
        validated: tuple[int, dict[str, torch.Tensor], list[int]],
        plan: tuple[np.ndarray, np.ndarray, int, int],
        prio: np.ndarray,
        mask: np.ndarray | None,
        n: int,
    ) -> torch.Tensor:
        """An insert validated, planned and admitted: its priorities checked (a refusal changes nothing),
        then the rows, keys and selectors written."""
        if self._host_insert:
            keys = self._apply_insert_host(validated, plan, prio, mask, n)
            if keys is not None:
                return keys
        prepared = self._prepare_priorities(prio, None, mask)
        st = self._storage
        cap = st.capacity
        res = st.append({}, _validated=validated, _plan=plan)
        lo, hi = res.evicted_steps
        if not self._feed_remover and self._sampler.replaces_on_insert:
            return self._apply_insert_fast(res.first_step, res.num_steps, lo, hi, prio, n, mask, prepared[0])
        if hi > lo:
            old = np.arange(lo, hi, dtype=np.int64)
            slots = old % cap
            self._drop(slots[self._keys[slots] == old], "evicted")
        excess = self._size + n - self._max_size
        if excess > 0:
            self._drop(self._select_distinct(self._remover, excess), "removed")
        offs = np.arange(res.num_steps, dtype=np.int64)
        keys = res.first_step + (offs if mask is None else offs[mask])
        p0 = res.first_step % cap
        if mask is None and p0 + n <= cap:  # contiguous slots: slice writes
            slots = offs + p0
            self._keys[p0 : p0 + n] = keys
            self._times[p0 : p0 + n] = 0
        else:
            slots = keys % cap
            self._keys[slots] = keys
            self._times[slots] = 0
        if n:
            self._sampler.insert(slots, prio, prepared[0])
            if self._feed_remover:
                self._remover.insert(slots, prio, prepared[1])
        self._size += n
        self._counts["inserted"] += n
        self._generation += 1
        self._limiter.on_insert(n)
        return torch.from_numpy(keys)

    def _apply_insert_host(self, validated: tuple[int, dict[str, torch.Tensor], list[int]], plan: tuple[int, np.ndarray, int, int],
                           prio: np.ndarray, mask: np.ndarray | None, n: int) -> torch.Tensor | None:
        """The priorities' checks, the storage's append and :meth:`_apply_insert_fast` with few Python
        calls around one compiled call (``_nb_insert_host``), for a :class:`Prioritized` sampler over host
        storage (``_host_insert``) and sources whose bytes the kernel copies (a nonzero address from
        :meth:`Storage._validate`): the same state as the general path. ``p**alpha`` is checked and
        summed as it is staged (``SumTree._stage_checked``). None, with nothing changed, where the kernel
        does not apply (a source that is not a contiguous CPU tensor or of a complex field, or in its own
        ring; more writes than the tree's buffer holds) or the priorities are refused: the caller takes
        the general path (which refuses them, naming the key and the value)."""
        st = self._storage
        length, _, addresses = validated
        if 0 in addresses:
            return None
        sampler = self._sampler
        scaled = sampler._scaled(prio)
        if not scaled.flags.c_contiguous:  # (alpha 1: the caller's own strided priorities)
            scaled = np.ascontiguousarray(scaled)
        src = np.array(addresses, dtype=np.int64)
        lo, hi = st._first_step, plan[2]  # the steps the append evicts
        span = max(hi - lo, 0)
        gone = self._gone
        if gone.shape[0] < span:
            gone = self._gone = np.empty(max(span, 2 * gone.shape[0]), dtype=np.int64)
        keys, slots = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        first = st._next_step
        tree, out = sampler._tree, self._host_out
        with tree._lock:
            bound = tree._bound
            try:
                fill = tree._stage_checked(scaled, span + n)
            except PriorityOverflowError:  # (nothing changed: the general path refuses it, naming the key)
                return None
            if fill < 0 or not _nb_insert_host(
                *st._kernel_append_args(length, plan, src), self._keys, self._times, lo, hi, first,
                _NO_MASK if mask is None else mask, st.capacity, gone, keys, slots, tree._stage_idx, tree._stage_prio,
                fill, scaled, sampler._present, out,
            ):
                # (declined: the general path raises the bound by the batch, which must not count twice;
                # the old bound still bounds the total, the buffer applied or not)
                tree._bound = bound
                return None
            tree._staged = int(out[3])
        next_ep, dropped, _, _, change = out.tolist()
        st._appended(first + length, next_ep, bool(plan[1][-1]), hi, plan[3])
        sampler._size += change
        self._size += n - dropped
        self._counts["evicted"] += dropped
        self._counts["inserted"] += n
        self._generation += 1
        self._limiter.on_insert(n)
        return torch.from_numpy(keys)

    def _apply_insert_fast(self, first: int, length: int, lo: int, hi: int, prio: np.ndarray, n: int,
                           mask: np.ndarray | None, prepared: Any) -> torch.Tensor:
        """:meth:`_apply_insert` for the common case (no remover to feed, a sampler that replaces a
        slot on insert): the evictions and the key columns in one compiled pass, and no sampler
        delete for the slots the insert's items overwrite at once. The same state as the general
        path (tests/replay/test_table.py checks both against each other)."""
        cap = self._storage.capacity
        gone = self._gone
        if gone.shape[0] < max(hi - lo, 0):
            gone = self._gone = np.empty(max(hi - lo, 2 * gone.shape[0]), dtype=np.int64)
        keys, slots = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        dropped, kept = _nb_evict_and_key(self._keys, self._times, lo, hi, first, length,
                                          _NO_MASK if mask is None else mask, cap, gone, keys, slots)
        if kept:
            self._sampler.delete(gone[:kept])
        if dropped:
            self._size -= dropped
            self._counts["evicted"] += dropped
        if n:
            self._sampler.insert(slots, prio, prepared)
        self._size += n
        self._counts["inserted"] += n
        self._generation += 1
        self._limiter.on_insert(n)
        return torch.from_numpy(keys)  # not torch.arange: its dispatch cost 6 us, a tenth of the insert

    def _select_distinct(self, selector: Selector, k: int) -> np.ndarray:
        """k distinct slots from ``selector`` (stochastic selectors draw with replacement: redraw). A
        remover must make room: what a prioritized one cannot draw (every priority left is 0, or
        nearly all its mass is on fewer than k items) is taken from the other live items, oldest
        first. (It raised after the insert's steps were stored: every retry added rows and evicted.)"""
        if selector.is_deterministic:
            slots, _ = selector.select(k, self._rng)
            return np.asarray(slots[:k], dtype=np.int64)
        chosen = np.empty(0, dtype=np.int64)
        for _ in range(32):
            try:
                more, _ = selector.select(k - len(chosen), self._rng)
            except ValueError:  # (no mass left to draw from)
                break
            chosen = np.concatenate([chosen, np.asarray(more, dtype=np.int64)])
            _, first = np.unique(chosen, return_index=True)
            chosen = chosen[np.sort(first)]
            if len(chosen) >= k:
                return chosen[:k]
        live = np.flatnonzero(self._keys >= 0)
        live = live[~np.isin(live, chosen)]
        rest = live[np.argsort(self._keys[live], kind="stable")[: k - len(chosen)]]
        return np.concatenate([chosen, rest])

    # ------------------------------------------------------------------ sample

    def check_sample_size(self, n: int) -> None:
        """Raise ValueError (naming ``n`` and the limit) unless ``n`` is a sample size this table can
        ever serve: an int from 1 to ``max_sample`` whose batch fits in this host's memory."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"sample size n must be an int >= 1, got {n!r}")
        if n > self._max_sample:
            raise ValueError(
                f"sample size n={int(n)} is out of range for table {self._name!r}: at most max_sample="
                f"{self._max_sample} (64 draws per slot of capacity {self._storage.capacity}); ask for a batch"
            )
        nbytes = int(n) * self._item_nbytes
        if nbytes > _PHYSICAL_MEMORY:
            raise ValueError(
                f"sample size n={int(n)} is out of range for table {self._name!r}: its batch would take "
                f"{nbytes} bytes, more than this host's {_PHYSICAL_MEMORY} bytes of memory "
                f"(at most n={_PHYSICAL_MEMORY // self._item_nbytes} here)"
            )

    def flush(self) -> None:
        """Apply the sampler's buffered writes now (a :class:`Prioritized` sampler buffers its tree's
        writes: the next sample applies them anyway, in one pass). For a caller that wants that
        work done before a sample it times or off its sampling path, as a replay shard does
        before it publishes its tree to one-sided readers."""
        with self._lock:
            self._sampler.flush()

    def sample_nowait(self, n: int, *, read: bool = True) -> tuple[dict[str, torch.Tensor], SampleInfo]:
        """Draw ``n`` items now, or raise WouldBlock.

        Stochastic samplers draw ``n`` times with replacement; deterministic ones return the first
        ``min(n, size)`` items in their order. Items reaching ``max_times_sampled`` are dropped after
        being read.

        Args:
            n: items to draw (>= 1).
            read: False to skip reading the items (the batch is then ``{}``): for a caller that reads
                them itself from ``info.keys`` before the table changes (the replay shard's
                shared-memory path, whose readers gather the rows). Everything else (selection,
                times sampled, expiry, the rate limiter) is the same.

        Returns:
            ``(batch, info)``: the batch as the table's read kind defines it, and a :class:`SampleInfo`.

        Raises:
            ValueError: ``n < 1``, or ``n`` out of range: above :attr:`max_sample`, or a batch larger
                than the host's memory (the message names ``n`` and the limit).
            WouldBlock: the rate limiter does not allow it now (an empty table never allows it).
            PortClosedError: the table was closed.
        """
        self.check_sample_size(n)
        with self._lock:
            if self._limiter.closed:
                raise PortClosedError(f"sample from table {self._name!r}, which was closed by close()")
            if not self._limiter.take(n, self._size):
                raise WouldBlock(f"table {self._name!r}: " + self._limiter.explain("sample", n, self._size))
            return self._sample_taken(int(n), read)

    async def sample(self, n: int, *, timeout_s: float | None = None) -> tuple[dict[str, torch.Tensor], SampleInfo]:
        """Like :meth:`sample_nowait`, but wait on the running loop while the rate limiter blocks.

        Raises:
            TimeoutError: ``timeout_s`` passed while blocked (nothing sampled).
            PortClosedError: the table is or gets closed while waiting.
            ValueError: ``n < 1`` or out of range (as :meth:`sample_nowait`).
        """
        self.check_sample_size(n)
        while True:
            await self._limiter.wait(
                "sample",
                lambda: self._limiter.can_sample(n, self._size),
                lambda: f"table {self._name!r}: " + self._limiter.explain("sample", n, self._size),
                timeout_s,
            )
            with self._lock:  # re-check under the lock: another thread may have acted in between
                if self._limiter.take(n, self._size):
                    return self._sample_taken(int(n), True)

    def _read_batch(self, keys: np.ndarray) -> dict[str, torch.Tensor]:
        st, r = self._storage, self._read
        if isinstance(r, StepRead):  # keys of live items are stored steps: skip read_steps' range check
            return st._gather(keys)
        if isinstance(r, WindowRead):
            return st.read_windows(keys, r.length, r.pad)
        if isinstance(r, TransitionRead):
            return st.read_transitions(
                keys, n=r.n, gamma=r.gamma, reward_field=r.reward_field, next_fields=r.next_fields
            )
        eps = st.episode_bounds(keys)[0]
        return st.read_episodes(eps)

    def _sample_taken(self, n: int, read: bool) -> tuple[dict[str, torch.Tensor], SampleInfo]:
        """:meth:`_sample_now` after the limiter's :meth:`~RateLimiter.take`; a draw that fails gives
        back what it took."""
        try:
            return self._sample_now(n, read=read)
        except BaseException:
            self._limiter.on_sample(0)
            raise

    def _sample_now(self, n: int, read: bool = True) -> tuple[dict[str, torch.Tensor], SampleInfo]:
        if read and self._one_call_windows:
            drawn = self._sample_windows_now(n)
            if drawn is not None:
                return drawn
        size = self._size
        slots, probs = self._sampler.select(n, self._rng)
        slots = np.asarray(slots, dtype=np.int64)
        probs = np.asarray(probs, dtype=np.float64)
        # An item's key is the one stored global step in its slot's residue class: no lookup needed.
        min_p = float(self._sampler.min_probability()) if self._beta != 0.0 else 1.0
        k = slots.shape[0]
        keys, times, weights = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.float32)
        _nb_sample_info(
            slots, probs, self._times, self._storage.step_range[0], self._storage.capacity, min_p, self._beta,
            keys, times, weights,
        )
        batch = self._read_batch(keys) if read else {}
        return self._finish_sample(batch, slots, probs, keys, times, weights, size)

    def _sample_windows_now(self, n: int) -> tuple[dict[str, torch.Tensor], SampleInfo] | None:
        """:meth:`_sample_now` for a Prioritized sampler reading host windows, in one compiled call;
        None (nothing drawn) when every priority is 0, for the selector to raise its error."""
        sums, mins, offsets, arity = self._sampler.tree.kernel_arrays()  # type: ignore[attr-defined]
        if not sums[0] > 0.0:
            return None
        size = self._size
        st, r = self._storage, self._read
        length = r.length  # type: ignore[union-attr]
        uniforms = self._rng.random(n)  # what the selector's select(n) would draw
        slots, probs = np.empty(n, np.int64), np.empty(n, np.float64)
        keys, times, weights = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.float32)
        batch, dst_addrs, mask = st._window_outputs(n, length)
        bad = _nb_sample_windows(
            sums, mins, offsets, arity, uniforms, slots, probs, self._times, self._beta, keys, times, weights,
            length, r.pad == "head", st._window_kernel_args(), dst_addrs, mask, _PREFETCH_WINDOWS,  # type: ignore[union-attr]
        )
        if bad >= 0:
            raise ReactorInternalError(
                f"table {self._name!r} drew key {int(keys[bad])}, which the storage does not hold "
                f"(stored steps {st.step_range})"
            )
        batch["mask"] = torch.from_numpy(mask)
        return self._finish_sample(batch, slots, probs, keys, times, weights, size)

    def _finish_sample(
        self,
        batch: dict[str, torch.Tensor],
        slots: np.ndarray,
        probs: np.ndarray,
        keys: np.ndarray,
        times: np.ndarray,
        weights: np.ndarray,
        size: int,
    ) -> tuple[dict[str, torch.Tensor], SampleInfo]:
        """Expire items at ``max_times_sampled``, count the draws, and wrap the info as tensors."""
        if self._max_times_sampled:
            done = np.unique(slots[times >= self._max_times_sampled])
            self._drop(done, "expired")
        self._counts["sampled"] += len(slots)
        self._generation += 1
        self._limiter.on_sample(len(slots))
        info = SampleInfo(
            keys=torch.from_numpy(keys),
            probabilities=torch.from_numpy(probs),
            weights=torch.from_numpy(weights),
            table_size=size,
            times_sampled=torch.from_numpy(times),
        )
        return batch, info

    # ------------------------------------------------------------------ update / delete / reset

    def _slots_of(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        k = _as_int64("keys", keys)
        slots = k % self._storage.capacity
        bad = (k < 0) | (self._keys[slots] != k)
        if bad.any():
            missing = k[bad]
            raise KeyError(
                f"unknown key {int(missing[0])} in table {self._name!r} ({len(missing)} of {len(k)} keys "
                "unknown): never inserted, or already evicted, removed, expired or deleted"
            )
        return k, slots

    def note_sampled(self, keys: Any) -> int:
        """Count draws that readers elsewhere made from this table's published state (one-sided
        sampling, :mod:`reactor.replay.shared`): each key still held gets one more times-sampled
        (a key drawn twice, twice), and the statistics and the rate limiter count every draw (a
        limiter whose count is shared with the readers counted them when they drew: it is only
        woken). A key no longer held (evicted or deleted since the draw) counts as a draw and
        changes no item; one that reaches ``max_times_sampled`` expires, as a draw here makes it.

        Returns:
            The draws counted.

        Raises:
            TypeError: ``keys`` is not a 1-D integer array.
        """
        k = _as_int64("keys", keys)
        with self._lock:
            slots = k % self._storage.capacity
            held = (k >= 0) & (self._keys[slots] == k)
            np.add.at(self._times, slots[held], 1)
            if self._max_times_sampled:  # (as a draw here would: past it an item's count broke every checkpoint)
                at = slots[held]
                self._drop(np.unique(at[self._times[at] >= self._max_times_sampled]), "expired")
            self._counts["sampled"] += len(k)
            self._generation += 1
            self._limiter.on_noticed(len(k))
        return len(k)

    def update_priorities(self, keys: Any, priorities: Any) -> None:
        """Set the priority of existing items (duplicated keys: the last priority wins).

        Raises:
            KeyError: a key is not in the table (the message names it); nothing is updated.
            ValueError: a priority is NaN, infinite or negative, or the lengths differ, or finite
                priorities would overflow the sampler (``p**alpha``, or the sum tree's total, past
                float64: the message names the key and the value); nothing is updated.
        """
        with self._lock:
            k = _as_int64("keys", keys)
            if isinstance(priorities, np.ndarray) and priorities.dtype == np.float64:
                p = priorities
            else:
                p = _as_float64(priorities)
            if p.shape != k.shape:
                raise ValueError(f"priorities must have shape ({len(k)},), got {p.shape}")
            slots = np.empty(len(k), dtype=np.int64)
            if _nb_check_update(k, self._keys, self._storage.capacity, p, slots) >= 0:
                self._slots_of(k)  # raises KeyError for an unknown key (the full message), else
                _as_priorities(p, len(k))  # raises ValueError naming the bad priority
                raise ReactorInternalError("Table.update_priorities: the compiled and numpy checks disagree")
            if len(k):
                prepared = self._prepare_priorities(p, lambda i: int(k[i]))
                self._sampler.update(slots, p, prepared[0])
                if self._feed_remover:
                    self._remover.update(slots, p, prepared[1])
                self._generation += 1

    def delete(self, keys: Any) -> None:
        """Drop items by key (their steps stay in storage until the ring overwrites them).

        Raises:
            KeyError: a key is not in the table; nothing is deleted.
        """
        with self._lock:
            _, slots = self._slots_of(keys)
            self._drop(np.unique(slots), "deleted")
            self._generation += 1
            self._limiter.notify()

    def reset(self) -> None:
        """Drop every item and step, zero the counters and the rate limiter; keys keep counting up.

        Pending inserts re-check (and may proceed); pending samples keep waiting for new items.
        """
        with self._lock:
            self._storage.reset()
            self._sampler.clear()
            self._remover.clear()
            self._keys.fill(-1)
            self._times.fill(0)
            self._size = 0
            self._counts = dict.fromkeys(self._counts, 0)
            self._generation += 1
            self._limiter.reset()

    def close(self) -> None:
        """Refuse further inserts and samples; pending ones raise PortClosedError. Idempotent."""
        self._limiter.close()

    def statistics(self) -> TableStatistics:
        """A snapshot of sizes and counters."""
        with self._lock:
            return TableStatistics(
                name=self._name,
                size=self._size,
                max_size=self._max_size,
                num_steps=self._storage.num_steps,
                num_episodes=self._storage.num_episodes,
                rate_limiter=self._limiter.statistics(),
                memory=self._storage.memory(),
                **self._counts,
            )
