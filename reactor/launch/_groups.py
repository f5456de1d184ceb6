"""Process groups: what a placement resolves to (one group, one process). Shared by the placement
parser and the distribution policies, so neither imports the other's module for it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .._errors import GraphError
from .._graph import plain_name

__all__ = ["RESTART_FIELDS", "Group", "Restart", "group_name", "parse_restart", "restart_from_text"]

#: The fields of a restart policy, in a group's table or a placement's ``[restart]`` defaults.
RESTART_FIELDS = ("restart", "max_restarts", "backoff_s", "host_wait_s", "reset_after_s")


@dataclass(frozen=True)
class Restart:
    """What the coordinator does when a group's process ends before the run does.

    Attributes:
        policy: ``"never"`` (the run ends, naming the group) or ``"on-failure"`` (start it again,
            async runs that record or replay no trace only: elsewhere the run ends with the error).
        max_restarts: restarts allowed in a row; one more failure ends the run. A life that ran
            ``reset_after_s`` before it ended was healthy: the count (and the backoff) starts again
            after it, so a run of days survives a failure now and then, and a crash loop still ends it.
        backoff_s: the wait before the first restart, doubled for each later one (at most 30 s).
        host_wait_s: over hosts, how long one restart waits for a candidate host to answer (a
            lost host's daemon that its supervisor, such as Ray, Kubernetes or systemd, starts
            again), trying every backoff (at most 10 s); tries that found no host do not count
            as restarts. Past it the run ends, naming the hosts and why each did not answer.
        reset_after_s: how long a life must have run for its end to start the count of restarts
            in a row afresh (10 minutes, as Kubernetes resets a container's backoff); ``inf``: the
            count holds over the whole run.
    """

    policy: str = "never"
    max_restarts: int = 3
    backoff_s: float = 1.0
    host_wait_s: float = 300.0
    reset_after_s: float = 600.0

    def delay_s(self, restarts_so_far: int) -> float:
        """The wait before restart number ``restarts_so_far + 1``."""
        return min(30.0, self.backoff_s * 2.0**restarts_so_far)

    def host_retry_s(self, tries_so_far: int) -> float:
        """The wait before asking the candidate hosts again, after ``tries_so_far`` found none."""
        return min(10.0, max(0.5, self.backoff_s * 2.0**tries_so_far))


NEVER_RESTART = Restart()


@dataclass(frozen=True)
class Group:
    """One process of a multi-process run."""

    name: str
    reactors: tuple[str, ...]
    bind: str | None = None  # None: ipc in a private directory
    hosts: tuple[str, ...] = ()  # candidate hosts (a placement's [hosts] names), in order; () local
    restart: Restart = NEVER_RESTART


def group_name(instance: str) -> str:
    """A process group name for one reactor instance (``actor[3]`` -> ``actor-3``)."""
    return plain_name(instance)


def parse_restart(raw: dict[str, Any], where: str, base: Restart = NEVER_RESTART) -> Restart:
    """The restart policy a table's ``restart``, ``max_restarts``, ``backoff_s``, ``host_wait_s``
    and ``reset_after_s`` give, each missing field taken from ``base``.

    Raises:
        GraphError: a field of the wrong type or out of range, naming ``where`` and the field.
    """
    policy = raw.get("restart", base.policy)
    if policy not in ("never", "on-failure"):
        raise GraphError(f"{where}: restart must be \"never\" or \"on-failure\", got {policy!r}")
    n = raw.get("max_restarts", base.max_restarts)
    if type(n) is not int or not 0 <= n <= 1000:
        raise GraphError(f"{where}: max_restarts must be an integer in [0, 1000], got {n!r}")
    b = raw.get("backoff_s", base.backoff_s)
    if type(b) not in (int, float) or not 0 <= b <= 3600:
        raise GraphError(f"{where}: backoff_s must be a number of seconds in [0, 3600], got {b!r}")
    w = raw.get("host_wait_s", base.host_wait_s)
    if type(w) not in (int, float) or not 0 <= w <= 86400:
        raise GraphError(f"{where}: host_wait_s must be a number of seconds in [0, 86400], got {w!r}")
    h = raw.get("reset_after_s", base.reset_after_s)
    if type(h) not in (int, float) or not 1 <= h <= math.inf:  # (inf: the count holds over the run)
        raise GraphError(f"{where}: reset_after_s must be a number of seconds >= 1 (or inf), got {h!r}")
    return Restart(policy, n, float(b), float(w), float(h))


def restart_from_text(text: str) -> Restart:
    """``reactor run --restart``: ``never``, ``on-failure`` or ``on-failure:N`` (N: max_restarts),
    then, for on-failure, any of ``,backoff_s=S``, ``,host_wait_s=S`` and ``,reset_after_s=S``
    (seconds), e.g. ``on-failure:5,host_wait_s=60``.

    Raises:
        GraphError: anything else, naming it (a value out of its range names the field).
    """
    usage = (f"restart {text!r}: use never, on-failure or on-failure:N (N: the most restarts per group), "
             f"then ,backoff_s=S ,host_wait_s=S ,reset_after_s=S if you want them")
    head, *extras = text.split(",")
    policy, colon, n = head.partition(":")
    if policy not in ("never", "on-failure") or (colon and (not (n.isascii() and n.isdigit()) or policy == "never")) or (
            extras and policy == "never"):
        raise GraphError(usage)
    raw: dict[str, Any] = {"restart": policy, **({"max_restarts": int(n)} if n else {})}
    for item in extras:
        key, eq, value = item.partition("=")
        if not eq or key not in ("backoff_s", "host_wait_s", "reset_after_s") or key in raw:
            raise GraphError(usage)
        try:
            raw[key] = float(value)
        except ValueError:
            raise GraphError(f"restart {text!r}: {key} must be a number of seconds, got {value!r}") from None
    return parse_restart(raw, f"restart {text!r}")
