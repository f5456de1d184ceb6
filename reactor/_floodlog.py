"""Logging the trouble a peer or a stranger can cause at will (a bad frame, a refused request)
without turning a flood of it into a flood of log lines.

One rule, used by the endpoints, the bulk read server and the daemons: the first
:data:`LOGGED_IN_FULL` of a kind are logged in full, then one in :data:`LOGGED_ONE_IN`, with the count
so far. The counters the callers keep still count every one.
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["LOGGED_IN_FULL", "LOGGED_ONE_IN", "FloodCounts", "flood_logged", "flood_tally"]

#: Occurrences of a kind of trouble logged in full.
LOGGED_IN_FULL = 20
#: Past those, one occurrence in this many is logged.
LOGGED_ONE_IN = 1000


def flood_logged(n: int) -> bool:
    """Whether the ``n``-th occurrence (counted from 1) of a kind of trouble is logged."""
    return n <= LOGGED_IN_FULL or n % LOGGED_ONE_IN == 0


def flood_tally(n: int) -> str:
    """What a logged line adds once lines are being left out: how many so far, and the rule."""
    if n <= LOGGED_IN_FULL:
        return ""
    return f" ({n:,} so far; past {LOGGED_IN_FULL}, one in {LOGGED_ONE_IN:,} is logged)"


_OTHERS = object()  # the shared key of the keys past the bound


class FloodCounts:
    """Occurrences per key (a sender, a kind of drop), for :func:`flood_logged`.

    At most ``max_keys`` keys get a count of their own, for the table's life: a stranger who makes up
    a new key per message (a new sender name each time) must not grow the table without end, nor log
    each one in full: new keys past the bound are counted together, under one shared count. A key is
    never forgotten, so a sender that goes away and comes back under its name counts on from where it
    was. (Counts were dropped when their sender's connection had gone: a peer that had used up its lines
    in full got twenty more each time it reconnected and was forgotten, and the places freed let a
    stranger's new names each get twenty, without end. Kept, they cost at most ``max_keys`` entries.)
    """

    __slots__ = ("counts", "max_keys")

    def __init__(self, max_keys: int = 4096) -> None:
        self.counts: dict[Hashable, int] = {}
        self.max_keys = max_keys

    def hit(self, key: Hashable) -> int:
        """Count one occurrence under ``key``; returns the count so far."""
        counts = self.counts
        if key not in counts and len(counts) - (_OTHERS in counts) >= self.max_keys:
            key = _OTHERS
        n = counts[key] = counts.get(key, 0) + 1
        return n
