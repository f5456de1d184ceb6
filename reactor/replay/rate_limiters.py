"""Rate limiters: when a table lets inserts and samples proceed (Reverb's semantics, on asyncio).

A limiter counts the items inserted and sampled since the last reset and keeps the *diff*
``inserts * samples_per_insert - samples`` inside ``[min_diff, max_diff]``:

- an insert of ``n`` items may proceed if the table will hold no more than ``min_size_to_sample``
  items after it (inserts are free until sampling may start), or if
  ``(inserts + n) * samples_per_insert - samples <= max_diff``;
- a sample of ``n`` items may proceed if the table holds at least ``min_size_to_sample`` items and
  ``inserts * samples_per_insert - (samples + n) >= min_diff``, checked in its integer form
  ``samples + n <= floor(inserts * samples_per_insert - min_diff)`` (the form a shared budget's
  takers check: the same counts allow the same samples either way).

The concrete limiters fix the four numbers:

=======================================================  =====  ============  ========================  ========================
limiter                                                  spi    min size      min_diff                  max_diff
=======================================================  =====  ============  ========================  ========================
``MinSize(m)``                                           1      m             -inf                      +inf
``SampleToInsertRatio(spi, m, error_buffer=e)``          spi    m             spi*m - e                 spi*m + e
``Queue(size)`` / ``Stack(size)``                        1      1             0                         size
=======================================================  =====  ============  ========================  ========================

So ``SampleToInsertRatio`` lets samples run ahead of or behind ``spi`` samples per insert by at most
``e`` samples, and ``Queue`` lets each insert be sampled exactly once, with at most ``size`` waiting.

Shared counting: a table that readers in other processes sample one-sidedly keeps its limiter's
sample count in shared memory (:meth:`RateLimiter.share`, the budget of :mod:`reactor.replay._budget`):
the owner's draws and every reader's take their samples from it by compare-and-swap, so the bound
``inserts * samples_per_insert - samples >= min_diff`` holds over all of them at once, exactly.

Waiting: :meth:`RateLimiter.wait` parks the caller on the event loop until the condition holds; every
change of the counters (insert, sample, delete, reset) wakes every waiter, which re-checks. ``close()``
wakes them with :class:`~reactor._errors.PortClosedError`. The owner (a :class:`~reactor.replay.Table`)
checks and acts with no ``await`` in between, so a woken caller never acts on a stale check.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import PortClosedError
from ._budget import ALLOWED, BUDGET_WORDS, PARKED, TAKEN, UNLIMITED, add, set_count, take

__all__ = [
    "MinSize",
    "Queue",
    "RateLimiter",
    "RateLimiterStatistics",
    "SampleToInsertRatio",
    "Stack",
]


@dataclass(frozen=True)
class RateLimiterStatistics:
    """Counters of a rate limiter since its last reset.

    Attributes:
        inserts: items inserted.
        samples: items sampled.
        waiting_inserts: callers now waiting to insert.
        waiting_samples: callers now waiting to sample.
        closed: whether :meth:`RateLimiter.close` was called.
    """

    inserts: int
    samples: int
    waiting_inserts: int
    waiting_samples: int
    closed: bool


class RateLimiter:
    """Keeps ``inserts * samples_per_insert - samples`` within ``[min_diff, max_diff]``.

    Prefer the named subclasses; this class takes the four numbers directly.

    Args:
        samples_per_insert: target samples per inserted item (> 0).
        min_size_to_sample: the table must hold this many items before any sample (>= 1).
        min_diff: lower bound of the diff a sample may leave.
        max_diff: upper bound of the diff an insert may leave (>= min_diff).

    Raises:
        ValueError: a bound out of range (message names it and the value).
    """

    def __init__(
        self, *, samples_per_insert: float, min_size_to_sample: int, min_diff: float, max_diff: float
    ) -> None:
        if not (math.isfinite(samples_per_insert) and samples_per_insert > 0):
            raise ValueError(f"samples_per_insert must be finite and > 0, got {samples_per_insert!r}")
        if isinstance(min_size_to_sample, bool) or not isinstance(min_size_to_sample, int) or min_size_to_sample < 1:
            raise ValueError(f"min_size_to_sample must be an int >= 1, got {min_size_to_sample!r}")
        if math.isnan(min_diff) or math.isnan(max_diff) or min_diff > max_diff:
            raise ValueError(f"need min_diff <= max_diff, got min_diff={min_diff!r} max_diff={max_diff!r}")
        self.samples_per_insert = float(samples_per_insert)
        self.min_size_to_sample = int(min_size_to_sample)
        self.min_diff = float(min_diff)
        self.max_diff = float(max_diff)
        self._inserts = 0
        self._own_samples = 0
        self._budget: np.ndarray | None = None  # the shared sample count (share), else _own_samples
        self._taken = 0  # samples take() took ahead of the on_sample that counts them
        self._closed = False
        self._waiters: list[asyncio.Future[None]] = []
        self._waiting = {"insert": 0, "sample": 0}
        self._bound = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ config

    def config(self) -> dict[str, Any]:
        """JSON-able constructor arguments, with ``"type"`` naming the class (used by checkpoints)."""
        return {
            "type": "RateLimiter",
            "samples_per_insert": self.samples_per_insert,
            "min_size_to_sample": self.min_size_to_sample,
            "min_diff": self.min_diff,
            "max_diff": self.max_diff,
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "type")
        return f"{type(self).__name__}({args})"

    def bind(self) -> None:
        """Claim this limiter for one table.

        Raises:
            ValueError: it already belongs to a table.
        """
        if self._bound:
            raise ValueError(f"{self!r} already belongs to a table; create one rate limiter per table")
        self._bound = True

    # ------------------------------------------------------------------ shared counting

    @property
    def _samples(self) -> int:
        b = self._budget
        return self._own_samples if b is None else int(b[TAKEN])

    @_samples.setter
    def _samples(self, value: int) -> None:
        if self._budget is None:
            self._own_samples = value
        else:
            set_count(self._budget, value, self._allowed())

    def share(self, budget: np.ndarray) -> None:
        """Count samples in ``budget`` from now on: int64 words (:mod:`reactor.replay._budget`) in
        memory that readers in other processes map writable and take their one-sided draws from.
        The count so far moves there; the limiter writes ``allowed`` after every insert.

        A reader can write those words: one that writes them wrongly skews this limiter's pacing
        (its inserts and samples may run ahead or stall), nothing else (the docs' trust boundaries).
        :meth:`reset` and :meth:`load_state_dict` set the count: call them while no reader takes
        (:mod:`reactor.replay._budget` says what a take racing them may do).

        Raises:
            ValueError: ``budget`` is not a writable contiguous int64 array of at least 4 words.
        """
        if (not isinstance(budget, np.ndarray) or budget.dtype != np.int64 or budget.ndim != 1
                or budget.shape[0] < BUDGET_WORDS or not budget.flags.c_contiguous or not budget.flags.writeable):
            raise ValueError(f"a sample budget is a writable contiguous int64 array of at least {BUDGET_WORDS} "
                             f"words, got {budget!r:.80}")
        samples = self._samples
        self._budget = budget
        budget[PARKED] = 0
        self._samples = samples

    def _allowed(self) -> int:
        """The most samples the counters allow now (the budget's ``allowed`` word)."""
        x = self._inserts * self.samples_per_insert - self.min_diff
        if not x < UNLIMITED:
            return UNLIMITED
        return math.floor(x) if x > -UNLIMITED else -UNLIMITED

    def set_parked(self, n: int) -> None:
        """Tell the budget's readers that ``n`` inserts wait for samples (they then send their
        notices at once: the owner re-checks the inserts when they arrive)."""
        if self._budget is not None and self._budget[PARKED] != n:
            self._budget[PARKED] = n

    def take(self, n: int, size: int) -> bool:
        """Whether a sample of ``n`` items from a table of ``size`` may proceed now, as
        :meth:`can_sample`; with a shared budget, the ``n`` samples are taken from it at the same
        time (atomically: no reader takes them meanwhile), and the :meth:`on_sample` that follows
        counts only what it draws beyond them (or gives back what it drew less)."""
        if self._budget is None:
            return self.can_sample(n, size)
        if size < self.min_size_to_sample or not take(self._budget, n):
            return False
        self._taken += n
        return True

    # ------------------------------------------------------------------ conditions

    def can_insert(self, n: int, size: int) -> bool:
        """Whether inserting ``n`` items into a table of ``size`` items may proceed now."""
        if size + n <= self.min_size_to_sample:
            return True
        return (self._inserts + n) * self.samples_per_insert - self._samples <= self.max_diff

    def never_inserts(self, n: int, size: int) -> str | None:
        """Why an insert of ``n`` items into a table of ``size`` items can never proceed, or None.

        Exact for the counts now, if no other insert goes first: past the free fill, only samples can
        make room, and they can take the count no further than the limit a sample checks,
        ``floor(inserts * samples_per_insert - min_diff)`` (none at all while the table holds fewer than
        ``min_size_to_sample`` items); an insert that would still take the diff above ``max_diff`` there
        never proceeds. (Such an insert waited forever, and a shard's held every later writer's behind
        it. The integer limit is why ``n * samples_per_insert <= max_diff - min_diff`` is not enough
        with a fractional ``samples_per_insert``: samples can lower the diff to ``min_diff`` plus the
        fraction of ``inserts * samples_per_insert - min_diff`` at best.) What could still admit it:
        another, smaller insert first (it moves that fraction, and fills the table to
        ``min_size_to_sample``), or deletes that take the table back under ``min_size_to_sample - n``.
        """
        if size + n <= self.min_size_to_sample:
            return None
        most = self._samples
        if size >= self.min_size_to_sample:
            most = max(most, self._allowed())
        if (self._inserts + n) * self.samples_per_insert - most <= self.max_diff:  # (can_insert's test, at most)
            return None
        if size < self.min_size_to_sample:
            why = (f"the table holds {size} items, fewer than min_size_to_sample={self.min_size_to_sample}, so no "
                   f"sample can make room, and {n} items take it past the free fill")
        else:
            why = (f"samples can take the count to {most} at most (inserts={self._inserts}), leaving the diff at "
                   f"{self._inserts * self.samples_per_insert - most:g}, and {n} items x {self.samples_per_insert:g} "
                   f"samples each take it above max_diff={self.max_diff:g}")
        return (f"an insert of {n} items can never proceed under {self!r}: {why} (at most {self.max_insert()} items "
                f"an insert, fewer where the ratio's fractions leave less room); insert fewer items at once, or widen "
                f"the limiter's error_buffer")

    def max_insert(self) -> int | float:
        """The most items one insert can hold once the free fill is over (inf: no bound)."""
        width = self.max_diff - self.min_diff
        if self.samples_per_insert <= 0 or math.isinf(width):
            return math.inf
        return int(width // self.samples_per_insert)

    def can_sample(self, n: int, size: int) -> bool:
        """Whether sampling ``n`` items from a table of ``size`` items may proceed now."""
        if size < self.min_size_to_sample:
            return False
        # The rule's integer form, the one every taker of a shared budget checks: whether the limiter
        # is shared or not, the same counts allow the same samples.
        return self._samples + n <= self._allowed()

    def explain(self, op: str, n: int, size: int) -> str:
        """Why ``op`` of ``n`` items would block, in words (for WouldBlock and timeouts)."""
        diff = self._inserts * self.samples_per_insert - self._samples
        if op == "sample" and size < self.min_size_to_sample:
            why = f"the table holds {size} items, fewer than min_size_to_sample={self.min_size_to_sample}"
        elif op == "sample":
            why = f"it would take the diff {diff:g} - {n} below min_diff={self.min_diff:g}"
        else:
            why = f"it would take the diff {diff:g} + {n}*{self.samples_per_insert:g} above max_diff={self.max_diff:g}"
        return (
            f"{op} of {n} items would block under {self!r}: {why} "
            f"(inserts={self._inserts}, samples={self._samples}, size={size})"
        )

    # ------------------------------------------------------------------ counters

    def on_insert(self, n: int) -> None:
        """Count ``n`` inserted items and wake waiters."""
        self._inserts += n
        if self._budget is not None:
            self._budget[ALLOWED] = self._allowed()
        self.notify()

    def on_sample(self, n: int) -> None:
        """Count ``n`` sampled items and wake waiters (with a shared budget, the samples a
        :meth:`take` took before count among them)."""
        if self._budget is None:
            self._own_samples += n
        else:
            more, self._taken = n - self._taken, 0
            if more:  # draws beyond what take() took (or what it took and was not drawn)
                add(self._budget, more)
        self.notify()

    def on_noticed(self, n: int) -> None:
        """Count ``n`` items that readers elsewhere drew (their notices came, after the draws) and wake
        waiters; with a shared budget they were counted when the readers took them: only wake."""
        if self._budget is None:
            self._own_samples += n
        self.notify()

    def reset(self) -> None:
        """Zero the counters (the table was emptied) and wake waiters to re-check."""
        self._inserts = 0
        self._samples = 0
        self.notify()

    def statistics(self) -> RateLimiterStatistics:
        """Counters now."""
        return RateLimiterStatistics(
            inserts=self._inserts,
            samples=self._samples,
            waiting_inserts=self._waiting["insert"],
            waiting_samples=self._waiting["sample"],
            closed=self._closed,
        )

    def state_dict(self) -> dict[str, Any]:
        """Counters, for checkpoints, and the ratio and band they were counted under."""
        return {"inserts": self._inserts, "samples": self._samples, "samples_per_insert": self.samples_per_insert,
                "min_diff": self.min_diff, "max_diff": self.max_diff}

    def load_state_dict(self, state: dict[str, Any], warn: bool = True) -> None:
        """Restore counters from :meth:`state_dict` (``warn``: log a rebase; off for a check's scratch copy). Counted under another ratio or band (a resumed run
        with another ``samples_per_insert``), the samples are set to the new band's centre for the
        inserts kept: the old counts under the new ratio starved the learner (0 updates) or flooded it
        (a thousand catch-up updates)."""
        self._inserts = int(state["inserts"])
        self._samples = int(state["samples"])
        was = tuple(state.get(k) for k in ("samples_per_insert", "min_diff", "max_diff"))
        now = (self.samples_per_insert, self.min_diff, self.max_diff)
        if None not in was and tuple(map(float, was)) != now and math.isfinite(self.min_diff + self.max_diff):
            centre = (self.min_diff + self.max_diff) / 2
            self._samples = max(0, math.floor(self._inserts * self.samples_per_insert - centre))
            if warn:
                logging.getLogger("reactor.replay").warning(
                    "rate limiter: the checkpoint's counts were made at samples_per_insert %g (diff in [%g, %g]), "
                    "and this table's is %g (in [%g, %g]): its %d inserts count as balanced under the new ratio",
                    was[0], was[1], was[2], *now, self._inserts)
        self.notify()

    # ------------------------------------------------------------------ waiting

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Refuse every later wait and release every pending one with PortClosedError."""
        self._closed = True
        self.notify()

    def notify(self) -> None:
        """Wake every waiter so it re-checks its condition (safe from any thread)."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for fut in waiters:
            loop = fut.get_loop()
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                if not fut.done():
                    fut.set_result(None)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(_set_if_pending, fut)

    async def wait(self, op: str, cond: Callable[[], bool], describe: Callable[[], str], timeout_s: float | None) -> None:
        """Wait on the running loop until ``cond()`` holds.

        Args:
            op: "insert" or "sample" (for statistics and messages).
            cond: re-checked after every counter change; no ``await`` separates its True from return.
            describe: the reason it blocks, for the timeout message.
            timeout_s: give up after this many seconds; ``None`` waits forever.

        Raises:
            PortClosedError: the limiter is or becomes closed.
            TimeoutError: ``timeout_s`` passed first.
        """
        if timeout_s is not None and not (timeout_s >= 0):
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s!r}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        self._waiting[op] += 1
        try:
            while True:
                if self._closed:
                    raise PortClosedError(f"{op} on a closed table: it was closed by close()")
                if cond():
                    return
                fut: asyncio.Future[None] = loop.create_future()
                with self._lock:
                    self._waiters.append(fut)
                if deadline is None:
                    await fut
                    continue
                remaining = deadline - loop.time()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    await asyncio.wait_for(fut, remaining)
                except TimeoutError:
                    if self._closed:
                        raise PortClosedError(f"{op} on a closed table: it was closed by close()") from None
                    if cond():
                        return
                    raise TimeoutError(f"timed out after {timeout_s}s: {describe()}") from None
        finally:
            self._waiting[op] -= 1


def _set_if_pending(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class MinSize(RateLimiter):
    """Block samples until the table holds ``min_size`` items; never block inserts.

    Args:
        min_size: items needed before sampling (>= 1).

    Example:
        >>> MinSize(1000)
    """

    def __init__(self, min_size: int = 1) -> None:
        super().__init__(
            samples_per_insert=1.0, min_size_to_sample=min_size, min_diff=-math.inf, max_diff=math.inf
        )
        self.min_size = min_size

    def config(self) -> dict[str, Any]:
        return {"type": "MinSize", "min_size": self.min_size}


class SampleToInsertRatio(RateLimiter):
    """Hold the samples-per-insert ratio near ``samples_per_insert``, within ``error_buffer`` samples.

    With ``offset = samples_per_insert * min_size``: ``min_diff = offset - error_buffer`` and
    ``max_diff = offset + error_buffer``. Inserts are free until ``min_size`` items are stored.

    Args:
        samples_per_insert: target samples per inserted item (> 0).
        min_size: items needed before sampling (>= 1).
        error_buffer: allowed deviation in samples; at least ``max(1, samples_per_insert)``, since a
            narrower window can leave neither side able to proceed. A ``(min_diff, max_diff)`` pair
            sets the bounds directly.

    Raises:
        ValueError: a value out of range (named in the message).

    Example:
        >>> SampleToInsertRatio(samples_per_insert=4.0, min_size=1000, error_buffer=100.0)
    """

    def __init__(
        self, samples_per_insert: float, min_size: int, error_buffer: float | tuple[float, float]
    ) -> None:
        if isinstance(error_buffer, tuple):
            min_diff, max_diff = float(error_buffer[0]), float(error_buffer[1])
        else:
            need = max(1.0, float(samples_per_insert))
            if not (error_buffer >= need):
                raise ValueError(
                    f"error_buffer must be >= max(1, samples_per_insert) = {need:g}, got {error_buffer!r}; "
                    "a narrower window can deadlock inserts and samples"
                )
            offset = float(samples_per_insert) * min_size
            min_diff, max_diff = offset - float(error_buffer), offset + float(error_buffer)
        super().__init__(
            samples_per_insert=samples_per_insert, min_size_to_sample=min_size, min_diff=min_diff, max_diff=max_diff
        )
        self.min_size = min_size
        self.error_buffer = error_buffer

    def config(self) -> dict[str, Any]:
        eb = list(self.error_buffer) if isinstance(self.error_buffer, tuple) else self.error_buffer
        return {
            "type": "SampleToInsertRatio",
            "samples_per_insert": self.samples_per_insert,
            "min_size": self.min_size,
            "error_buffer": eb,
        }


class Queue(RateLimiter):
    """Each item may be sampled once, and at most ``size`` items wait: FIFO-queue pacing.

    Use with a Fifo sampler and remover and ``max_times_sampled=1`` (see :meth:`Table.queue`).

    Args:
        size: most items waiting to be sampled (>= 1).
    """

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{type(self).__name__} size must be an int >= 1, got {size!r}")
        super().__init__(samples_per_insert=1.0, min_size_to_sample=1, min_diff=0.0, max_diff=float(size))
        self.size = size

    def config(self) -> dict[str, Any]:
        return {"type": type(self).__name__, "size": self.size}


class Stack(Queue):
    """The :class:`Queue` limiter, for LIFO tables (see :meth:`Table.stack`).

    Args:
        size: most items waiting to be sampled (>= 1).
    """


_LIMITERS: dict[str, type[RateLimiter]] = {
    "RateLimiter": RateLimiter,
    "MinSize": MinSize,
    "SampleToInsertRatio": SampleToInsertRatio,
    "Queue": Queue,
    "Stack": Stack,
}


def limiter_from_config(config: dict[str, Any]) -> RateLimiter:
    """Build a limiter from :meth:`RateLimiter.config` output.

    Raises:
        ValueError: an unknown ``"type"``.
    """
    cfg = dict(config)
    kind = cfg.pop("type", None)
    if kind not in _LIMITERS:
        raise ValueError(f"unknown rate limiter type {kind!r}; known: {sorted(_LIMITERS)}")
    if kind == "SampleToInsertRatio" and isinstance(cfg.get("error_buffer"), list):
        cfg["error_buffer"] = tuple(cfg["error_buffer"])
    return _LIMITERS[kind](**cfg)
