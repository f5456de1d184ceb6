"""Logical time: tags ``(time_ns, microstep)``.

Logical time is an integer count of nanoseconds so that tags compare exactly on every host and in
every process (floats would let placement change the order of two events). A microstep orders events
that share a time: a zero-delay connection or action delivers at ``(time, microstep + 1)``, so a
message is always strictly later than the event that caused it.
"""

from __future__ import annotations

from typing import NamedTuple

NS_PER_S = 1_000_000_000
FOREVER_NS = 2**62


class Tag(NamedTuple):
    """A point in logical time. Tags order lexicographically: time first, then microstep."""

    time_ns: int
    microstep: int = 0

    def delayed(self, delay_ns: int) -> Tag:
        """The tag a message sent now over a connection with ``delay_ns`` arrives at."""
        if delay_ns > 0:
            return Tag(self.time_ns + delay_ns, 0)
        return Tag(self.time_ns, self.microstep + 1)

    @property
    def time_s(self) -> float:
        return self.time_ns / NS_PER_S

    def __repr__(self) -> str:
        return f"Tag({self.time_ns}ns, {self.microstep})"


ZERO = Tag(0, 0)
NEVER = Tag(FOREVER_NS, 0)


def seconds_to_ns(value_s: float, what: str) -> int:
    """Convert a duration in seconds to integer nanoseconds, rejecting negative and non-finite values and
    those of ``FOREVER_NS`` or more (``--stop-s 1e300`` was an ``OverflowError`` traceback; a time past it
    is past every tag)."""
    if isinstance(value_s, bool) or not isinstance(value_s, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {type(value_s).__name__} {value_s!r}")
    if value_s != value_s or value_s in (float("inf"), float("-inf")) or value_s < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value_s!r}")
    if value_s >= FOREVER_NS / NS_PER_S:
        raise ValueError(f"{what} must be below {FOREVER_NS / NS_PER_S:.4g} seconds (2**62 ns, about 146 years), "
                         f"got {value_s!r}")
    return round(value_s * NS_PER_S)
