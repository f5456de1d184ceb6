"""The restart policies of a run's groups, as the coordinator keeps them (:class:`_Restarts`, async runs):
each group's restarts in a row and over the run, its lives' ends, the starts under way and where each
group's endpoint is; and the warning, before a run starts, of what a restarted reactor would start
again without (:func:`_warn_restart_losses`). The session (:mod:`._session`) drives the restarts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from .._errors import REFUSAL_EXIT_STATUS, ReactorInternalError
from .._graph import Graph
from ._groups import Group

log = logging.getLogger("reactor.coordinator")


def _warn_restart_losses(graph: Graph, groups: Sequence[Group]) -> None:
    """Say, before anything starts, each reactor a restart policy covers whose new life would start without
    something (:meth:`Reactor.restart_loses`: a learner with checkpoint_every = 0 learned again from fresh
    weights, in silence)."""
    said = set()
    for g in groups:
        for instance in g.reactors:
            node = instance.split("[", 1)[0]
            if node in said or node not in graph.nodes:
                continue
            said.add(node)
            loses = graph.nodes[node].prototype.restart_loses()
            if loses:
                log.warning("group %r restarts on failure, but %r would start again without %s", g.name, node, loses)


class _Restarts:
    """The restart policies of a run's groups and the restarts under way (async runs).

    A group restarts in three steps: its end is seen (``due``: when to start it again, after its
    backoff), it is started (``trying``: the start's task, which may wait for a host; then
    ``starting``: ``"spawned"``, then ``"hello"`` once it said where it listens and was sent the
    address book), and its ``ready`` is answered with ``start`` while the other workers hear
    ``restarted`` with its new address."""

    def __init__(self, groups: dict[str, Group], restartable: Sequence[str], specs: dict[str, dict[str, Any]],
                 start: Callable[[Group, dict[str, Any]], Awaitable[None]], keys: Any) -> None:
        self.groups = groups
        self.restartable = set(restartable)
        self.specs = specs
        self.start = start
        self.keys = keys
        self.book: dict[str, str] = {}  # group -> its endpoint's address (the latest)
        self.local: dict[str, str | None] = {}  # group -> its endpoint's address for its own host's workers
        self.count: dict[str, int] = {}  # restarts begun in a row, per group (its policy's max_restarts)
        self.lives: dict[str, int] = {}  # restarts begun over the run, per group (a new life's number)
        self.began: dict[str, float] = {}  # group -> when its latest life began running (monotonic)
        self.first_began = time.monotonic()  # (the first lives')
        self.ends: dict[str, list[str]] = {}  # how each of a group's lives ended
        self.due: dict[str, float] = {}
        # group -> its start under way, in a task of its own (a try whose hosts do not answer waits
        # out a ping's timeout for each: the run's messages are not held up meanwhile)
        self.trying: dict[str, asyncio.Future[None]] = {}
        # group -> (when a try of its restart first found no candidate host answering, tries so far)
        self.host_wait: dict[str, tuple[float, int]] = {}
        self.starting: dict[str, str] = {}
        # group -> the hello of its new life that came before its start's task was taken (a forked
        # worker says hello within ~0.1 s, and the task is taken once per supervision round)
        self.early: dict[str, Any] = {}
        # group -> (the live workers still to link to its new life, when to start it regardless)
        self.awaiting: dict[str, tuple[set[str], float]] = {}

    @property
    def pending(self) -> set[str]:
        return set(self.due) | set(self.trying) | set(self.starting)

    @property
    def down(self) -> set[str]:
        """The groups being restarted that have no live process yet (due, or their start under way)."""
        return set(self.due) | set(self.trying)

    async def end_tries(self) -> None:
        """Wait for the starts under way to end (each is bounded by its requests' timeouts). They are
        not cancelled: a request's thread would run on, and the run's reap then shares its daemon
        client across threads. The reap stops any worker they started."""
        if self.trying:
            await asyncio.gather(*self.trying.values(), return_exceptions=True)
        self.trying.clear()

    def address_for(self, group: str, recipient: str, host_of: Mapping[str, str]) -> str:
        """Where ``recipient`` reaches ``group``: at its local (plain ipc) address when both run on
        one daemon's host, else at its endpoint's address (tcp, CURVE, over hosts)."""
        local = self.local.get(group)
        here = host_of.get(recipient)
        return local if local is not None and here is not None and host_of.get(group) == here else self.book[group]

    def book_for(self, recipient: str, host_of: Mapping[str, str]) -> dict[str, str]:
        """The address book as ``recipient`` uses it (see :meth:`address_for`)."""
        return {g: self.address_for(g, recipient, host_of) for g in self.book}

    def life_ended(self, group: str) -> None:
        """``group``'s process ended: a life that ran its policy's ``reset_after_s`` was healthy, and
        the count of its restarts in a row (and so its backoff) starts again."""
        # (a life that never began running, its start not answered yet, ran nothing)
        began = self.began.pop(group, None if group in self.lives else self.first_began)
        ran = 0.0 if began is None else time.monotonic() - began
        policy = self.groups[group].restart if group in self.groups else None
        if policy is not None and ran >= policy.reset_after_s and self.count.get(group):
            log.warning("worker %r ran %.0f s (reset_after_s = %g s) before it ended: its count of restarts in "
                        "a row starts again", group, ran, policy.reset_after_s)
            self.count[group] = 0

    def can_restart(self, group: str) -> bool:
        return group in self.restartable and self.count.get(group, 0) < self.groups[group].restart.max_restarts

    def why_not(self, group: str, refused: bool = False) -> str:
        """Why a group with a restart policy was not started again (empty for "never"); ``refused``: it
        ended with a refusal's exit status."""
        policy = self.groups[group].restart
        if policy.policy != "on-failure":
            return ""
        if group not in self.restartable:
            return f"; group {group!r} was not restarted: restart policies hold in async runs that record or replay no trace"
        if refused:
            return (f"; group {group!r} was not restarted: exit status {REFUSAL_EXIT_STATUS} is a refusal of what the "
                    f"run was given, which a new life is given again")
        healthy = "" if math.isinf(policy.reset_after_s) else f", each after a life shorter than reset_after_s = {policy.reset_after_s:g} s"
        return (f"; group {group!r} had used its {self.count.get(group, 0)} restarts in a row "
                f"(max_restarts = {policy.max_restarts}{healthy}): earlier ends: {'; '.join(self.ends.get(group, []))}")


async def _no_start(group: Group, spec: dict[str, Any]) -> None:
    raise ReactorInternalError(f"no way to start group {group.name!r} again")
