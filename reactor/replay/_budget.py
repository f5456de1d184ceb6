"""A rate limiter's sample budget in shared memory: the compiled takes of samples.

A table sampled one-sidedly (:mod:`reactor.replay.shared`) keeps its rate limiter's sample count
where the readers can take from it (:meth:`RateLimiter.share <reactor.replay.RateLimiter.share>`):
four int64 words,

====  ==========  ==================================================================================
word  name        meaning
====  ==========  ==================================================================================
0     taken       samples counted since the limiter's counters were last set (every path's draws)
1     allowed     the most ``taken`` may reach now (``floor(inserts * spi - min_diff)``; the owner
                  writes it after every insert)
2     parked      inserts the owner holds back for want of samples (a reader then tells it at once)
3     (spare)
====  ==========  ==================================================================================

Whoever samples ``n`` items first takes them: ``taken`` goes from ``t`` to ``t + n`` by one
compare-and-swap, if ``t + n <= allowed``. So the owner's own draws (a sample request) and every
reader's one-sided draws count in one place, and the limiter's bound holds across all of them
exactly: none can take what another took. A stale ``allowed`` is never too large (it only grows
between the owner's settings of the counters, :func:`set_count`), so a reader that read it before
an insert only takes less.

``taken`` never goes down but when the owner sets the counters (a reset, a restore) or gives back
what its own draw took and did not draw (on its own thread, where no insert runs meanwhile), and in
one case on a reader's side: :func:`take_all` across several shards that finds one short gives back
what it took from the others a moment before (a pre-check first makes that rare: only a taker
racing it between the two passes). An insert that the owner admits in that moment counted those
samples: the limiter's ``max_diff`` can be passed by at most one such batch per reader, until the
next sample. A reader's draw that fails after its take keeps the count (the samples count as
drawn): the count never moves back under an insert's check for longer than that moment.

Setting the counters (:func:`set_count`: a reset, a restore) closes ``allowed`` first, so a reader
that looks then takes nothing; one whose compare-and-swap was already under way when the count was
set to the value it had read (the same number: a reset to 0 of a count at 0) still gets through
against the old ``allowed``. Set the counters while no reader takes: a replay shard restores before
it publishes its state, and never resets.
"""

from __future__ import annotations

import numba
import numpy as np

from .._native import atomic_add, atomic_cas, full_fence, void_pointer

__all__ = ["ALLOWED", "BUDGET_WORDS", "PARKED", "TAKEN", "UNLIMITED", "add", "set_count", "take", "take_all"]

TAKEN, ALLOWED, PARKED = 0, 1, 2
BUDGET_WORDS = 4
#: ``allowed`` of a limiter that never holds samples back (no sum of counts reaches it).
UNLIMITED = 1 << 62


@numba.njit(cache=True, nogil=True)
def _nb_take(addr: int, n: int) -> bool:  # pragma: no cover - jit
    words = numba.carray(void_pointer(addr), 4, np.int64)
    t = words[0]
    while True:
        if n < 0 or t > UNLIMITED or t + n > words[1]:  # (a count past UNLIMITED: garbage, never taken from)
            return False
        seen = atomic_cas(addr, t, t + n)
        if seen == t:
            return True
        t = seen


@numba.njit(cache=True, nogil=True)
def _nb_take_all(addrs: np.ndarray, counts: np.ndarray) -> int:  # pragma: no cover - jit
    """Take ``counts[s]`` from budget ``addrs[s]`` for every s (0 addresses and counts skipped).
    Returns -1, or -2 if some budget taken from has parked inserts, or the first s whose budget
    lacked its count (what was taken before it is given back)."""
    for s in range(addrs.shape[0]):  # a look first: a budget short now is refused before any take
        if counts[s] != 0 and addrs[s] != 0:
            words = numba.carray(void_pointer(addrs[s]), 4, np.int64)
            if words[0] + counts[s] > words[1]:
                return s
    waiting = False
    for s in range(addrs.shape[0]):
        if counts[s] == 0 or addrs[s] == 0:
            continue
        if not _nb_take(addrs[s], counts[s]):
            for r in range(s):
                if counts[r] != 0 and addrs[r] != 0:
                    atomic_add(addrs[r], -counts[r])
            return s
        if numba.carray(void_pointer(addrs[s]), 4, np.int64)[2] > 0:
            waiting = True
    return -2 if waiting else -1


@numba.njit(cache=True, nogil=True)
def _nb_add(addr: int, n: int) -> None:  # pragma: no cover - jit
    atomic_add(addr, n)


@numba.njit(cache=True, nogil=True)
def _nb_set_count(addr: int, taken: int, allowed: int) -> None:  # pragma: no cover - jit
    words = numba.carray(void_pointer(addr), 4, np.int64)
    words[1] = -UNLIMITED  # no take while the count changes under it
    full_fence()
    words[0] = taken
    full_fence()
    words[1] = allowed


def take(budget: np.ndarray, n: int) -> bool:
    """Take ``n`` samples from ``budget`` (its ``taken`` word moved by ``n``), if ``taken + n`` stays
    within ``allowed``; False (nothing taken) otherwise."""
    return bool(_nb_take(budget.ctypes.data, int(n)))


def add(budget: np.ndarray, n: int) -> None:
    """Move ``budget``'s ``taken`` word by ``n`` (either sign), atomically, whatever ``allowed`` says:
    the owner's draws counted after the fact, or what its own take took and did not draw."""
    _nb_add(budget.ctypes.data, int(n))


def set_count(budget: np.ndarray, taken: int, allowed: int) -> None:
    """Set both counts (a reset, a restore): ``allowed`` is closed first, so no reader takes against
    the old ``allowed`` with the new count or the other way round."""
    _nb_set_count(budget.ctypes.data, int(taken), int(allowed))


def take_all(addrs: np.ndarray, counts: np.ndarray) -> int:
    """:func:`take` from several budgets (int64 addresses; 0 skips) all or none: -1 when every one
    had its count (-2: and one of them has inserts parked), else the index of the first that did
    not (nothing is kept taken)."""
    return int(_nb_take_all(addrs, counts))
