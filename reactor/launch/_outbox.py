"""A worker's outbox: its messages to peers, in order, queued while a peer is out of credit."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from typing import Any

from .._errors import PeerLostError, WouldBlock
from .._tag import Tag

FLOW_LIMIT = 4096  # default for both limits below (run(..., flow_limit=N))
# Outbox: messages queued (out of credit) before this process stops running reactions.
# Async inboxes: queued events before this process stops taking messages from its endpoint.


class Outbox:
    """Sends to peers in order; a peer out of credit queues here and the scheduler pauses."""

    def __init__(self, endpoint: Any, limit: int = FLOW_LIMIT, restartable: frozenset[str] = frozenset()) -> None:
        self.ep = endpoint
        self.limit = limit
        # Restart policies (async runs): the peers whose loss does not end this process. While one
        # is down (lost, not yet back), what is sent to it is dropped and counted.
        self.restartable = restartable
        self.down: set[str] = set()
        self.dropped_to_lost: Counter[str] = Counter()
        self.peak_backlog = 0
        self.queues: dict[str, deque[Any]] = {}
        self.wake = asyncio.Event()
        self.drained = asyncio.Event()  # the backlog fell to half the limit
        self.drained.set()
        self.empty = asyncio.Event()  # nothing is queued at all
        self.empty.set()
        self.backlog = 0
        self.failure: BaseException | None = None

    def send(self, peer: str, msg: Any) -> None:
        if peer in self.down:
            self.dropped_to_lost[peer] += 1
            return
        q = self.queues.setdefault(peer, deque())
        if not q:
            try:
                self.ep.send_nowait(peer, msg)
                return
            except WouldBlock:
                pass
            except PeerLostError:
                if peer not in self.restartable:
                    raise
                self.mark_down(peer)
                self.dropped_to_lost[peer] += 1
                return
        q.append(msg)
        self.backlog += 1
        self.peak_backlog = max(self.peak_backlog, self.backlog)
        self.drained.clear()
        self.empty.clear()
        self.wake.set()

    def send_message(self, process: str, link: int, seq: int, tag: Tag, value: Any) -> None:
        self.send(process, ("m", link, seq, tag.time_ns, tag.microstep, value))

    def mark_down(self, peer: str) -> None:
        """``peer`` died (a restartable one): drop what is queued for it and what is sent to it
        until :meth:`mark_up`."""
        self.down.add(peer)
        q = self.queues.pop(peer, None)
        if q:
            self.dropped_to_lost[peer] += len(q)
            self.backlog -= len(q)
            if self.backlog <= self.limit // 2:
                self.drained.set()
            if self.backlog == 0:
                self.empty.set()

    def mark_up(self, peer: str) -> None:
        self.down.discard(peer)

    @property
    def congested(self) -> bool:
        return self.backlog >= self.limit

    async def send_all(self) -> None:
        """Before a blocking reaction (``reaction(blocking=True)``): wait until nothing is queued
        here, then hand what the endpoint holds for the end of this tick to its sockets."""
        while self.backlog and self.failure is None:
            self.wake.set()
            await self.empty.wait()
        flush = getattr(self.ep, "flush", None)
        if flush is not None:
            flush()

    async def wait_drained(self) -> None:
        """Wait until the backlog is below half the limit (hysteresis: no flapping)."""
        while self.backlog > self.limit // 2 and self.failure is None:
            self.drained.clear()
            self.wake.set()
            await self.drained.wait()

    async def flush_forever(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                for peer, q in list(self.queues.items()):
                    while q:
                        try:
                            await self.ep.send(peer, q[0])
                        except PeerLostError:
                            if peer not in self.restartable:
                                raise
                            self.mark_down(peer)  # drops its queue
                            break
                        q.popleft()
                        self.backlog -= 1
                        if self.backlog <= self.limit // 2:
                            self.drained.set()
                if self.backlog == 0:
                    self.drained.set()
                    self.empty.set()
        except BaseException as e:  # noqa: BLE001 - reported to the main loop, which owns the error
            self.failure = e
            self.drained.set()
            self.empty.set()
            raise
