"""The scheduler of one process: delivers events to the reactors this process hosts.

Two modes (docs/architecture.md has the full semantics):

* **deterministic**: one heap of events ordered by ``(tag, destination, kind, rank, seq)``; an event
  runs only when every upstream process has promised nothing earlier (conservative
  synchronization: each inbound peer's *horizon* advances with its messages and its promises).
* **async**: each reactor has an inbox served by its own task, in arrival order; timers follow the
  wall clock. A ``Recorder`` can write what each reactor processed; a ``Replayer`` makes each
  reactor process exactly that sequence again.

Remote delivery is injected (``RemoteSink``): this module knows nothing of sockets.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import hashlib
import heapq
import logging
import re
import secrets
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._errors import ReactorInternalError, TraceMismatchError
from ._graph import Graph, Link
from ._reactor import Action, Input, PeerChange, ReactionSpec, Reactor, Timer
from ._tag import NEVER, Tag

log = logging.getLogger("reactor.scheduler")

# Event kinds, in the order simultaneous events of one reactor are handled.
STARTUP, TIMER, ACTION, INPUT, PEER = 0, 1, 2, 3, 4
KIND_NAMES = {STARTUP: "startup", TIMER: "timer", ACTION: "action", INPUT: "input", PEER: "peer"}
#: Pending events scanned one by one for promises; past this, the earliest one stands for all.
_PROMISE_SCAN_MAX = 256
#: Wall-clock seconds of events one ``run_ready`` call runs before it hands the loop back (after the
#: event under way ends). Its event budget alone did not bound it: 4,096 events of a transformer's
#: updates held the loop for 17 s (minutes with long windows), and Ctrl-C waited that long.
RUN_READY_S = 0.05

_Dist = tuple[int, int]
"""A delay in logical time: ``(ns, 0)`` with ns > 0, or ``(0, microsteps)``; ordered as tuples."""


def _hop(d: _Dist, delay_ns: int) -> _Dist:
    """``d`` followed by one connection or action of ``delay_ns`` (a lower bound: a zero-delay hop
    after a positive delay adds a microstep that the bound leaves out)."""
    if delay_ns > 0:
        return (d[0] + delay_ns, 0)
    return (0, d[1] + 1) if d[0] == 0 else d


def _after(tag: Tag, d: _Dist) -> Tag:
    return Tag(tag.time_ns, tag.microstep + d[1]) if d[0] == 0 else Tag(tag.time_ns + d[0], 0)


class RemoteSink(Protocol):
    """Where messages for reactors of other processes go (implemented by the runtime)."""

    def send_message(self, process: str, link: int, seq: int, tag: Tag, value: Any) -> None: ...

    @property
    def congested(self) -> bool:
        """True while so much is queued for other processes that reactors must pause."""
        ...

    async def wait_drained(self) -> None: ...

    # Optional: ``async def send_all(self) -> None``, what was sent so far handed to the sockets
    # (awaited before a blocking reaction runs).


@dataclass(frozen=True)
class ProcessLink:
    """How this process is reached: what a node opening its own server (e.g. a replay shard's bulk
    read server) binds to and secures it with.

    Attributes:
        bind: the address this process's endpoint listens on (``ipc://...`` or ``tcp://HOST:PORT``;
            ``""`` in a single-process run).
        curve: the run's CURVE key pair (``reactor.transport.CurveKeys``) when links leave the
            host, else None.
    """

    bind: str = ""
    curve: Any = None

    def side_bind(self, name: str) -> str:
        """Where a side server of this process named ``name`` should listen.

        On tcp: the endpoint's interface with an OS-picked port (secure it with ``curve``; a
        wildcard bind such as ``tcp://0.0.0.0:*`` advertises an address other hosts cannot dial, as
        for the endpoint itself). On ipc: a socket next to the endpoint's, in the run's private
        directory; in a single-process run: in a private directory of this process (mode 0700 both:
        no other user connects, where CURVE is off).

        Raises:
            ValueError: ``name`` is not 1..64 of ``[A-Za-z0-9_.-]``.
        """
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"side server name must be 1..64 of [A-Za-z0-9_.-], got {name!r}")
        tag = f"{name}-{secrets.token_hex(4)}"  # two owners of one name never share a socket
        if self.bind.startswith("tcp://"):
            host = self.bind[len("tcp://"):].rsplit(":", 1)[0]
            return f"tcp://{host}:*"
        if self.bind.startswith("ipc://"):
            return f"{self.bind}-{tag}"
        return f"ipc://{_private_dir()}/{tag}"


@functools.lru_cache(maxsize=1)
def _private_dir() -> str:
    """A directory only this process's user can enter, removed at exit (single-process side servers)."""
    path = tempfile.mkdtemp(prefix="reactor-side-")
    atexit.register(shutil.rmtree, path, True)
    return path


@dataclass
class _Route:
    """The links one output port feeds through one declared connection."""

    links: list[Link]
    mode: str
    key: Callable[[Any], int] | None
    src_index: int
    counter: int = 0


@dataclass
class ReactorStats:
    events: int = 0
    inputs: int = 0
    digest: Any = field(default_factory=hashlib.sha256)


class ReactorHost:
    """Runs the reactors of one process. Created by the runtime; users never touch it.

    Args:
        graph: the validated graph (every process builds the same one).
        local: full names of the reactor instances hosted here.
        owner_of: full reactor name -> process name, for every instance of the graph.
        seed: the run seed.
        deterministic: the mode (see module docstring).
        remote: delivery for links whose destination lives in another process.
        digest: when given, each reactor's received messages are hashed with it (for tests and
            ``reactor run --digest``): a function from a payload to bytes.
    """

    def __init__(
        self,
        graph: Graph,
        local: list[str],
        owner_of: dict[str, str],
        *,
        seed: int = 0,
        deterministic: bool = True,
        remote: RemoteSink | None = None,
        digest: Callable[[Any], bytes] | None = None,
        stop_ns: int | None = None,
        recorder: Recorder | None = None,
        replayer: Replayer | None = None,
        process: str = "main",
        link: ProcessLink | None = None,
        restarts: int = 0,
    ) -> None:
        self.graph = graph
        self.link = link if link is not None else ProcessLink()
        self.deterministic = deterministic
        self.remote = remote
        self.digest_fn = digest
        self.stop_ns = stop_ns if stop_ns is not None else graph.stop_ns
        self.owner_of = owner_of
        self.process = process
        self.recorder = recorder
        self.replayer = replayer
        self.stop_requested = False
        # Why the run is ending (set before the shutdown reactions run; Reactor.stopped_by):
        # RunResult.stopped_by's words, or "failure" (a reaction or a worker failed) or "terminated"
        # (this process was told to end: SIGTERM).
        self.stop_reason: str | None = None
        self.failure: BaseException | None = None
        self.shutdown_failure: Exception | None = None  # the first shutdown reaction that failed (run_shutdown)
        links = graph.links()
        self.links = links
        local_set = set(local)
        self.reactors: dict[str, Reactor] = {}
        self.rank: dict[str, int] = {}
        for node, i, name in graph.instances():
            if name in local_set:
                r = node.make_instance(i)
                r._attach(self, name, i, node.replicas, seed)
                r.restarts = restarts
                self.reactors[name] = r
                self.rank[name] = len(self.rank)
        missing = local_set - set(self.reactors)
        if missing:
            raise ReactorInternalError(f"placement names reactors not in the graph: {sorted(missing)}")
        self.stats = {n: ReactorStats() for n in self.reactors}
        # Routing: (src instance, src port) -> routes, one per declared connection.
        by_conn: dict[tuple[str, str, int], list[Link]] = {}
        for lk in links:
            by_conn.setdefault((lk.src, lk.src_port, lk.connection), []).append(lk)
        self.routes: dict[tuple[str, str], list[_Route]] = {}
        for (src, port, ci), lks in sorted(by_conn.items(), key=lambda kv: kv[0][2]):
            if src not in local_set:
                continue
            c = graph.connections[ci]
            lks.sort(key=lambda lk: _replica_of(lk.dst))
            r = self.reactors[src]
            self.routes.setdefault((src, port), []).append(_Route(lks, c.mode, c.key, r.bank_index))
        self.link_seq = [0] * len(links)
        # Reactions by trigger, per reactor type.
        self._by_trigger: dict[tuple[type, str], list[ReactionSpec]] = {}
        for t in {type(r) for r in self.reactors.values()}:
            for spec in t._reaction_specs:
                for trig in spec.triggers:
                    self._by_trigger.setdefault((t, trig.name), []).append(spec)
        # (reactor, trigger) pairs that can still run a blocking reaction (see reaction(blocking=True)):
        # inputs only when linked, startup until it ran. Empty, run_ready checks no event for them
        # (a single learner's blocking rendezvous and rounds never run past its startup).
        linked = {(lk.dst, lk.dst_port) for lk in links}
        self._blocking = {(n, trig.name) for n, r in self.reactors.items() for spec in type(r)._reaction_specs
                          if spec.blocking for trig in spec.triggers
                          if not isinstance(trig, Input) or (n, trig.name) in linked}
        self._timers: dict[str, list[Timer]] = {
            n: [s for s in type(r)._port_specs.values() if isinstance(s, Timer)] for n, r in self.reactors.items()
        }
        self._action_rank: dict[tuple[type, str], int] = {}
        for r in self.reactors.values():
            acts = [s for s in type(r)._port_specs.values() if isinstance(s, Action)]
            for i, a in enumerate(acts):
                self._action_rank[(type(r), a.name)] = i
        self._action_seq: dict[tuple[str, str], int] = {}
        # Deterministic state.
        self.heap: list[tuple[Any, ...]] = []
        self.now = Tag(0, 0)
        self.horizons: dict[str, Tag] = {}
        # Async state.
        self._inbox: dict[str, deque[tuple[Any, ...]]] = {n: deque() for n in self.reactors}
        self._wake: dict[str, asyncio.Event] = {}
        self._t0 = time.monotonic_ns()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[object, asyncio.TimerHandle] = {}
        self.busy = 0
        self.sent_count = 0
        self.received_count = 0
        # ... and by process: a worker forgets what it counted with a peer's earlier lives once it links
        # to the next (restart policies: launch/_worker.py, Worker._forget), so the run's sums stay exact.
        # received_from is also the n of deterministic promises (refresh()): those runs never restart.
        self.sent_to: Counter[str] = Counter()
        self.received_from: Counter[str] = Counter()
        self._in_shutdown = False
        # Conditional promises (deterministic mode across processes, see refresh()): per upstream
        # process its latest promise (U, D, n); arrival tags of messages sent to each downstream process
        # that it had not yet received when it last promised (messages received from each: received_from).
        self._cond: dict[str, tuple[Tag, _Dist | None, int]] = {}
        self._recv_min: dict[str, Tag] = {}  # per upstream: earliest tag received since our last promise to it
        self._inflight: dict[str, deque[Tag]] = {}
        self._inflight_base: dict[str, int] = {}
        # In-flight tags are kept only for processes that promise to us (they send to us) and whose
        # promises can be conditional: a peer without a link back never acknowledges, and one whose
        # promise came without a D part never will (D is a property of the graph).
        self._upstream = {owner_of[lk.src] for lk in links if lk.dst in self.reactors and lk.src not in self.reactors}
        self._uncond: set[str] = set()
        self.cond_dirty = False
        self.sent_past_stop = False  # a message tagged after the stop time left this process
        self._reach, self._entry = self._reachability() if remote is not None else ({}, {})
        self._reach_min: dict[str, _Dist] = {}
        for r in self._reach.values():
            for p, d in r.items():
                if p not in self._reach_min or d < self._reach_min[p]:
                    self._reach_min[p] = d
        self.coarse_promises = 0

    # ------------------------------------------------------------------------------------------
    # promises (deterministic mode, across processes)

    def _reachability(self) -> tuple[dict[tuple[str, str], dict[str, _Dist]], dict[str, dict[str, _Dist]]]:
        """How soon what starts at each local trigger can reach each other process.

        The graph is: trigger -> the reactions it starts -> their declared effects (an output port:
        its links, local ones lead on to the destination's trigger; an action: the same reactor's
        trigger, after at least its ``min_delay``). Returns ``reach[(reactor, trigger)][process]``,
        the least delay from an event at that trigger to a message arriving in that process, and
        ``entry[upstream process][process]``, the same from the triggers the upstream process's
        links enter. Effects are enforced at run time (``PortError``), so nothing reaches a process
        faster than this says.
        """
        links_from: dict[tuple[str, str], list[Link]] = {}
        for lk in self.links:
            if lk.src in self.reactors:
                links_from.setdefault((lk.src, lk.src_port), []).append(lk)
        edges: dict[tuple[str, str], list[tuple[tuple[str, str] | str, int]]] = {}
        for name, r in self.reactors.items():
            for spec in type(r)._reaction_specs:
                outs: list[tuple[tuple[str, str] | str, int]] = []
                for eff in spec.effects:
                    if isinstance(eff, Action):
                        outs.append(((name, eff.name), eff.min_delay_ns))
                        continue
                    for lk in links_from.get((name, eff.name), ()):
                        dst = (lk.dst, lk.dst_port) if lk.dst in self.reactors else self.owner_of[lk.dst]
                        outs.append((dst, lk.delay_ns))
                for trig in spec.triggers:
                    if trig.name != "shutdown":  # shutdown outputs are dropped
                        edges.setdefault((name, trig.name), []).extend(outs)
        reach: dict[tuple[str, str], dict[str, _Dist]] = {}
        for start in edges:
            best: dict[tuple[str, str], _Dist] = {start: (0, 0)}
            todo: list[tuple[_Dist, tuple[str, str]]] = [((0, 0), start)]
            got: dict[str, _Dist] = {}
            while todo:
                d, node = heapq.heappop(todo)
                if best[node] < d:
                    continue
                for dst, delay in edges.get(node, ()):
                    nd = _hop(d, delay)
                    if isinstance(dst, str):
                        if dst not in got or nd < got[dst]:
                            got[dst] = nd
                    elif dst not in best or nd < best[dst]:
                        best[dst] = nd
                        heapq.heappush(todo, (nd, dst))
            reach[start] = got
        entry: dict[str, dict[str, _Dist]] = {}
        for lk in self.links:
            if lk.dst in self.reactors and lk.src not in self.reactors:
                e = entry.setdefault(self.owner_of[lk.src], {})
                for p, d in reach.get((lk.dst, lk.dst_port), {}).items():
                    if p not in e or d < e[p]:
                        e[p] = d
        return reach, entry

    def promises(self, peers: list[str]) -> dict[str, Tag]:
        """Deterministic mode: per downstream process, the earliest tag a message from this process
        can still arrive there with (NEVER: none can).

        From the pending events and the upstream horizons, each through what its trigger can
        reach (:meth:`_reachability`): an event whose reactions cannot send to a process does not
        hold that process back. At least ``lower_bound().delayed(min link delay)``.

        This is the plain (unconditional) bound. The worker sends :meth:`refresh`'s conditional
        ``(U, D, n)`` instead, which this equals with its condition spelled out:
        ``promises()[p] == min(U, horizons[p] + D)``.
        """
        best = self._event_bounds(peers)
        for q, h in self.horizons.items():
            if h == NEVER:
                continue
            for p, d in self._entry.get(q, {}).items():
                c = _after(h, d)
                if c < best.get(p, c):
                    best[p] = c
        return best

    def _event_bounds(self, peers: list[str]) -> dict[str, Tag]:
        """Per process, the earliest tag a message caused by a pending local event can arrive there."""
        best = dict.fromkeys(peers, NEVER)
        heap = self.heap
        if len(heap) <= _PROMISE_SCAN_MAX:
            first: dict[tuple[str, str], tuple[int, int]] = {}  # earliest pending tag per trigger
            for ev in heap:
                kind, payload = ev[3], ev[7]
                key = (ev[6], payload[0] if kind >= ACTION else payload.name if kind == TIMER else "startup")
                tag = (ev[0], ev[1])
                if key not in first or tag < first[key]:
                    first[key] = tag
            reach = self._reach
            for key, tag in first.items():
                for p, d in reach.get(key, {}).items():
                    c = _after(Tag(*tag), d)
                    if c < best.get(p, c):
                        best[p] = c
        elif heap:  # a long queue: its earliest event stands for all (a lower bound; counted)
            self.coarse_promises += 1
            head = self.next_tag()
            for p in peers:
                if p in self._reach_min:
                    best[p] = min(best[p], _after(head, self._reach_min[p]))
        return best

    def receive_promise(self, process: str, bound: Tag, dist: _Dist | None, seen: int) -> None:
        """A conditional promise from upstream ``process`` (see :meth:`refresh`): no message from it
        arrives here before ``min(bound, a + dist)``, where ``a`` is the arrival tag there of any of
        our messages after the first ``seen`` (``dist`` None: ``bound`` alone)."""
        self._cond[process] = (bound, dist, seen)
        if dist is None:
            self._uncond.add(process)
            self._inflight.pop(process, None)
        q = self._inflight.get(process)
        if q is not None:
            base = self._inflight_base.get(process, 0)
            while q and base < seen:
                q.popleft()
                base += 1
            self._inflight_base[process] = max(base, seen)
        self.cond_dirty = True

    def refresh(self, peers: list[str]) -> dict[str, tuple[Tag, _Dist | None, int]]:
        """Deterministic mode: raise the upstream horizons as far as the latest promises allow, and
        compute the promise for each downstream process in ``peers``.

        A promise to process ``p`` is *conditional*: ``(U, D, n)`` says no message from here arrives
        at ``p`` before ``min(U, a + D)``, ``a`` being the arrival tag here of any message from ``p``
        after the first ``n`` (those already received are pending events, inside ``U``). ``D`` is the
        least delay from ``p``'s messages entering here to a message arriving back at ``p`` (through
        this process's reactions and links), ``U`` bounds everything else: pending events and every
        other upstream horizon. A process that only answers ``p`` (a replay shard holding a parked
        sample request, a learner waiting for its sample) then holds ``p`` back only as far as ``p``'s
        own next message does, and the two need no exchange of promises per step of logical time.

        Here, for each upstream ``q`` that promised ``(U_q, D_q, n_q)``: its horizon is
        ``min(U_q, a_q + D_q, P_q + D_q)``, with ``a_q`` the earliest arrival tag of our messages it
        had not received and ``P_q`` our own bound on our next message to it, which itself depends
        on the horizons. This is a system of min-plus inequalities whose every cycle adds a positive
        delay; its greatest solution below the constants is a lower bound on the true arrival times
        and is found by relaxing to a fixed point (a few passes). Horizons never move back.

        Returns:
            ``{p: (U, D, n)}`` for each process in ``peers`` (D None: no message from ``p`` can lead
            to one back to ``p``).
        """
        self.cond_dirty = False
        events = self._event_bounds(peers)
        entry = self._entry
        h = dict(self.horizons)
        conds = []
        for q, (bound, dist, _) in self._cond.items():
            c = bound
            if dist is not None:
                fl = self._inflight.get(q)
                if fl:
                    c = min(c, _after(min(fl), dist))
                if q in events:
                    conds.append((q, dist))
            if c > h.get(q, Tag(0, 0)):
                h[q] = c
        full: dict[str, Tag] = {}
        # Without a promise conditional on our own messages the horizons are the promises' bounds:
        # nothing to relax.
        for _ in range(len(h) + len(peers) + 2 if conds else 0):
            full = dict(events)
            for q, hq in h.items():
                if hq == NEVER:
                    continue
                for p, d in entry.get(q, {}).items():
                    if p in full:
                        c = _after(hq, d)
                        if c < full[p]:
                            full[p] = c
            changed = False
            for q, dist in conds:
                if full[q] != NEVER:
                    c = _after(full[q], dist)
                    if c < h[q]:
                        h[q] = c
                        changed = True
            if not changed:
                break
        else:
            if conds:
                raise ReactorInternalError(f"{self.process}: horizons did not settle: {h}")
        hz = self.horizons
        for q, hq in h.items():
            if hq > hz.get(q, Tag(0, 0)):
                hz[q] = hq
        out: dict[str, tuple[Tag, _Dist | None, int]] = {}
        for p in peers:
            u = events[p]
            for q, hq in hz.items():
                if q == p or hq == NEVER:
                    continue
                d = entry.get(q, {}).get(p)
                if d is not None:
                    c = _after(hq, d)
                    if c < u:
                        u = c
            out[p] = (u, entry.get(p, {}).get(p), self.received_from[p])
        return out

    # ------------------------------------------------------------------------------------------
    # called by reactors (through ports)

    def emit(self, reactor: Reactor, port: str, value: Any) -> None:
        if self._in_shutdown:
            return
        routes = self.routes.get((reactor.name, port))
        if not routes:
            return
        tag = reactor.tag
        for route in routes:
            lks = route.links
            if route.mode in ("broadcast", "one_to_one") or len(lks) == 1:
                chosen = lks
            elif route.mode == "round_robin":
                chosen = [lks[(route.src_index + route.counter) % len(lks)]]
                route.counter += 1
            else:
                k = route.key(value)  # type: ignore[misc]
                if isinstance(k, bool) or not isinstance(k, int):
                    raise TypeError(f"key function of {reactor.name}.{port} returned {k!r}; it must return an int")
                chosen = [lks[k % len(lks)]]
            for lk in chosen:
                seq = self.link_seq[lk.index]
                self.link_seq[lk.index] = seq + 1
                at = tag.delayed(lk.delay_ns)
                if lk.dst in self.reactors:
                    self._push(lk.dst, at, INPUT, lk.index, seq, (lk.dst_port, value))
                else:
                    if self.remote is None:
                        raise ReactorInternalError(f"{lk.dst} is not local and no remote sink is configured")
                    self.sent_count += 1
                    proc = self.owner_of[lk.dst]
                    self.sent_to[proc] += 1
                    if self.deterministic:
                        if proc in self._upstream and proc not in self._uncond:
                            fl = self._inflight.get(proc)
                            if fl is None:
                                fl = self._inflight[proc] = deque()
                            fl.append(at)
                        if self.stop_ns is not None and at.time_ns > self.stop_ns:
                            self.sent_past_stop = True
                    self.remote.send_message(proc, lk.index, seq, at, value)

    def schedule_action(self, reactor: Reactor, action: str, value: Any, delay_ns: int) -> None:
        if self._in_shutdown:
            return
        key = (reactor.name, action)
        seq = self._action_seq.get(key, 0)
        self._action_seq[key] = seq + 1
        rank = self._action_rank[(type(reactor), action)]
        at = reactor.tag.delayed(delay_ns)
        if self.deterministic or self.replayer is not None:
            self._push(reactor.name, at, ACTION, rank, seq, (action, value))
        else:
            self._call_later(delay_ns, self._push, reactor.name, at, ACTION, rank, seq, (action, value))

    def request_stop(self, reactor: Reactor) -> None:
        self.stop_requested = True
        if self.deterministic and self.stop_ns is None:
            self.stop_ns = reactor.tag.time_ns
        self._kick()

    # ------------------------------------------------------------------------------------------
    # inbound from other processes

    def deliver_remote(self, link: int, seq: int, tag: Tag, value: Any) -> None:
        lk = self.links[link]
        src = self.owner_of[lk.src]
        self.received_from[src] += 1
        if self.deterministic:
            if tag < self.horizons.get(src, tag):  # promises and messages share one FIFO pipe
                raise ReactorInternalError(
                    f"process {src!r} sent {lk.src}.{lk.src_port} -> {lk.dst}.{lk.dst_port} at {tag} after promising "
                    f"nothing before {self.horizons[src]} (a promise computed too high)")
            m = self._recv_min.get(src)
            if m is None or tag < m:
                self._recv_min[src] = tag
        self.received_count += 1
        self._push(lk.dst, tag, INPUT, link, seq, (lk.dst_port, value))

    def peer_view(self, process: str, bound: Tag, dist: _Dist | None) -> Tag:
        """What ``process`` makes of our last promise ``(bound, dist, n)`` to it, at most: the
        messages we received from it since (see :meth:`promise_sent`) are still in flight for it,
        so it also counts ``their earliest tag + dist``."""
        got = self._recv_min.get(process)
        if dist is None or got is None:
            return bound
        return min(bound, _after(got, dist))

    def promise_sent(self, process: str) -> None:
        """The worker sent ``process`` a promise counting every message received from it so far."""
        self._recv_min.pop(process, None)

    def advance_horizon(self, process: str, tag: Tag) -> None:
        """An unconditional promise from ``process``: nothing from it arrives before ``tag``."""
        if tag > self.horizons.get(process, Tag(0, 0)):
            self.horizons[process] = tag
            self.cond_dirty = True

    # ------------------------------------------------------------------------------------------
    # events

    def _push(self, dst: str, tag: Tag, kind: int, rank: int, seq: int, payload: Any) -> None:
        if self.deterministic:
            heapq.heappush(self.heap, (tag.time_ns, tag.microstep, self.rank[dst], kind, rank, seq, dst, payload))
        else:
            self._inbox[dst].append((tag, kind, rank, seq, payload))
            ev = self._wake.get(dst)
            if ev is not None:
                ev.set()

    def peer_event(self, trigger: str, process: str, reason: str, life: int = -1) -> None:
        """Async mode: tell the local reactors with ``peer_lost`` / ``peer_restarted`` reactions
        (``trigger``) that ``process`` died or came back (its ``life``: :class:`PeerChange`); each
        handles it in its inbox's order."""
        changed = {n for n, p in self.owner_of.items() if p == process}
        for name, r in self.reactors.items():
            if not self._by_trigger.get((type(r), trigger)):
                continue
            links = sorted({(lk.src_port, _replica_of(lk.dst)) for lk in self.links if lk.src == name and lk.dst in changed}
                           | {(lk.dst_port, _replica_of(lk.src)) for lk in self.links if lk.dst == name and lk.src in changed})
            if links:  # only reactors linked to the changed ones hear of it
                self._push(name, self.wall_tag(), PEER, 0, 0, (trigger, PeerChange(trigger, tuple(sorted(changed)), reason,
                                                                                 tuple(links), life)))

    def _seed_events(self) -> None:
        for name in self.reactors:
            self._push(name, Tag(0, 0), STARTUP, 0, 0, None)
            if self.deterministic:
                for i, t in enumerate(self._timers[name]):
                    self._push(name, Tag(t.offset_ns, 0), TIMER, i, 0, t)

    async def _handle(self, name: str, tag: Tag, kind: int, rank: int, seq: int, payload: Any) -> None:
        r = self.reactors[name]
        r.tag = tag
        st = self.stats[name]
        st.events += 1
        if self.recorder is not None:
            self.recorder.record(name, kind, rank, seq)
        t = type(r)
        if kind == INPUT:
            port, value = payload
            st.inputs += 1
            if self.digest_fn is not None:
                st.digest.update(b"%d:%d:%d:%d:" % (tag.time_ns, tag.microstep, rank, seq) if self.deterministic else b"%d:%d:" % (rank, seq))
                st.digest.update(self.digest_fn(value))
            slot = r._inputs[port]
            slot.value, slot.is_present = value, True
            try:
                for spec in self._by_trigger.get((t, port), ()):
                    await self._fire(r, spec)
            finally:
                slot.value, slot.is_present = None, False
        elif kind == TIMER:
            timer: Timer = payload
            if self.deterministic and timer.period_ns > 0:
                self._push(name, Tag(tag.time_ns + timer.period_ns, 0), TIMER, rank, seq + 1, timer)
            for spec in self._by_trigger.get((t, timer.name), ()):
                await self._fire(r, spec)
        elif kind == ACTION:
            action, value = payload
            h = r._actions[action]
            h.value, h.is_present = value, True
            try:
                for spec in self._by_trigger.get((t, action), ()):
                    await self._fire(r, spec)
            finally:
                h.value, h.is_present = None, False
        elif kind == STARTUP:
            for spec in self._by_trigger.get((t, "startup"), ()):
                await self._fire(r, spec)
            self._blocking.discard((name, "startup"))  # (it runs once)
        elif kind == PEER:
            trigger, r.peer_change = payload
            try:
                for spec in self._by_trigger.get((t, trigger), ()):
                    await self._fire(r, spec)
            finally:
                r.peer_change = None

    async def _fire(self, r: Reactor, spec: ReactionSpec) -> None:
        kwargs = {}
        for p in spec.params:
            port = type(r)._port_specs[p]
            if isinstance(port, Input):
                slot = r._inputs[p]
            else:
                slot = r._actions[p]
            kwargs[p] = slot.value if slot.is_present else None
        r._current = spec
        if spec.blocking and self.remote is not None:
            # What this process has sent goes out before the reaction blocks it (async mode: the
            # transport holds small messages to the end of the loop's tick, which a blocking
            # reaction does not reach; a peer waiting for one of them would wait for good).
            sent = getattr(self.remote, "send_all", None)
            if sent is not None:
                await sent()
        try:
            if spec.is_async:
                await spec.func(r, **kwargs)
            else:
                spec.func(r, **kwargs)
        finally:
            r._current = None

    async def run_shutdown(self) -> None:
        """Fire every shutdown reaction once (their outputs are not delivered). One that fails does not
        keep the others from running; the first failure is kept (``shutdown_failure``): the run then
        fails (a learner's final checkpoint that could not be saved ended the run with exit 0)."""
        self._in_shutdown = True
        for name, r in self.reactors.items():
            for spec in self._by_trigger.get((type(r), "shutdown"), ()):
                try:
                    await self._fire(r, spec)
                except Exception as e:
                    if self.shutdown_failure is None:
                        e.add_note(f"(in shutdown reaction {name}.{spec.name})")
                        self.shutdown_failure = e
                    else:
                        log.exception("shutdown reaction %s.%s failed", name, spec.name)
        for h in self._pending.values():
            h.cancel()
        self._pending.clear()

    # ------------------------------------------------------------------------------------------
    # deterministic mode

    def next_tag(self) -> Tag:
        """Tag of the earliest pending local event (NEVER if none)."""
        if not self.heap:
            return NEVER
        return Tag(self.heap[0][0], self.heap[0][1])

    def safe_bound(self) -> Tag:
        """Events strictly earlier than this tag may run: every upstream process is past them."""
        return min(self.horizons.values(), default=NEVER)

    def lower_bound(self) -> Tag:
        """No future output of this process is caused by an event earlier than this tag."""
        return min(self.next_tag(), self.safe_bound())

    def runnable(self) -> bool:
        if not self.heap:
            return False
        head = self.next_tag()
        if self.stop_ns is not None and head.time_ns > self.stop_ns:
            return False
        return head < self.safe_bound()

    def finished(self) -> bool:
        """Deterministic mode: nothing at or before the stop time can still happen here."""
        if self.stop_ns is None:
            return not self.heap and self.safe_bound() == NEVER
        if self.heap and self.next_tag().time_ns <= self.stop_ns:
            return False
        return self.safe_bound().time_ns > self.stop_ns

    async def run_ready(self, budget: int = 4096) -> int:
        """Run up to ``budget`` events that are safe to run; return how many ran.

        Returns early after an event that sent messages to other processes, so that the caller
        promises them the new lower bound before the next event runs: a peer waiting on what was
        just sent need not wait for a long reaction that comes after it (the learner's update
        after the sample request it sent). Returns early, too, before an event that runs a
        blocking reaction (``reaction(blocking=True)``), unless it is the first: the caller
        promises as of its tag before it runs. And once its events have run for ``RUN_READY_S``
        of wall-clock time: the loop then takes a signal (Ctrl-C) or a stop between two events.
        Where it returns changes no event's order, only when the caller looks up.
        """
        n = 0
        heap = self.heap
        deadline = time.monotonic() + RUN_READY_S
        while n < budget and self.runnable():
            if n and self._blocking and self._blocking_next():
                break  # the caller promises first (reaction(blocking=True))
            if n and time.monotonic() > deadline:
                break
            t, m, _, kind, rank, seq, dst, payload = heapq.heappop(heap)
            tag = Tag(t, m)
            self.now = tag
            sent = self.sent_count
            await self._handle(dst, tag, kind, rank, seq, payload)
            n += 1
            if self.sent_count != sent:
                break
        return n

    @property
    def has_blocking(self) -> bool:
        """Whether a reactor of this process has a blocking reaction (``reaction(blocking=True)``)."""
        return bool(self._blocking)

    def _blocking_next(self) -> bool:
        """Whether the earliest pending event runs a blocking reaction."""
        _, _, _, kind, _, _, dst, payload = self.heap[0]
        trigger = "startup" if kind == STARTUP else payload.name if kind == TIMER else payload[0]
        return (dst, trigger) in self._blocking

    # ------------------------------------------------------------------------------------------
    # async mode

    def start_async_timers(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        if self.replayer is not None:
            return
        for name in self.reactors:
            for i, t in enumerate(self._timers[name]):
                self._arm_timer(name, i, t, 0)

    def _arm_timer(self, name: str, idx: int, t: Timer, k: int) -> None:
        assert self._loop is not None
        due_ns = t.offset_ns + k * t.period_ns
        delay = max(0.0, (self._t0 + due_ns - time.monotonic_ns()) / 1e9)

        def fire() -> None:
            self._push(name, Tag(due_ns, 0), TIMER, idx, k, t)
            if t.period_ns > 0 and not self.stop_requested:
                self._arm_timer(name, idx, t, k + 1)

        self._call_later(round(delay * 1e9), fire)

    def _call_later(self, delay_ns: int, fn: Callable[..., None], *args: Any) -> None:
        """Async mode: run ``fn`` after ``delay_ns`` of wall time; pending calls keep the run alive."""
        assert self._loop is not None
        token = object()

        def call() -> None:
            del self._pending[token]
            fn(*args)

        self._pending[token] = self._loop.call_later(delay_ns / 1e9, call)

    def quiescent(self) -> bool:
        """Async mode: no reactor busy, no message queued, no timer or delayed action pending."""
        return self.busy == 0 and not self._pending and self.inboxes_empty()

    def wall_tag(self) -> Tag:
        return Tag(time.monotonic_ns() - self._t0, 0)

    async def serve_reactor(self, name: str, idle: Callable[[], None]) -> None:
        """Async mode: handle ``name``'s inbox in arrival order (or in recorded order when replaying)."""
        inbox = self._inbox[name]
        wake = self._wake.setdefault(name, asyncio.Event())
        replay = self.replayer
        pending: dict[tuple[int, int, int], tuple[Any, ...]] = {}
        timers = self._timers[name]
        while not self.stop_requested:
            if replay is not None:
                expected = replay.next_expected(name)
                if expected is None:
                    replay.mark_done(name)
                    idle()
                    return
                while inbox:
                    ev = inbox.popleft()
                    pending[(ev[1], ev[2], ev[3])] = ev
                if expected[0] == TIMER and expected not in pending:
                    if not 0 <= expected[1] < len(timers):
                        raise TraceMismatchError(f"{name}'s trace names its timer #{expected[1]}, and it has "
                                                 f"{len(timers)}: the trace is damaged, or from another graph")
                    t = timers[expected[1]]
                    pending[expected] = (Tag(t.offset_ns + expected[2] * t.period_ns, 0), TIMER, expected[1], expected[2], t)
                ev = pending.pop(expected, None)
                if ev is None:
                    wake.clear()
                    idle()
                    await wake.wait()
                    continue
                replay.advance(name)
                self.busy += 1
                try:
                    await self._handle(name, ev[0], ev[1], ev[2], ev[3], ev[4])
                finally:
                    self.busy -= 1
                continue
            if not inbox:
                wake.clear()
                idle()
                await wake.wait()
                continue
            remote = self.remote
            if remote is not None and remote.congested:
                await remote.wait_drained()
                continue
            tag, kind, rank, seq, payload = inbox.popleft()
            self.busy += 1
            try:
                await self._handle(name, tag, kind, rank, seq, payload)
            finally:
                self.busy -= 1

    def inboxes_empty(self) -> bool:
        """No message queued for a reactor that will still take one. A replayed reactor at the end of its
        recorded schedule takes none (messages in flight when the recording stopped may still come to it):
        counting its inbox kept a replay that had diverged from ever going quiet, so it hung instead of
        naming who waits for what."""
        done = self.replayer.done if self.replayer is not None else ()
        return not any(q for n, q in self._inbox.items() if q and n not in done)

    def _kick(self) -> None:
        for ev in self._wake.values():
            ev.set()

    def digests(self) -> dict[str, str]:
        return {n: s.digest.hexdigest() for n, s in self.stats.items()}


def _replica_of(name: str) -> int:
    if name.endswith("]"):
        return int(name[name.rindex("[") + 1 : -1])
    return 0


class Recorder:
    """Collects, per reactor, the sequence of events it processed: ``(kind, rank, seq)``."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[int, int, int]]] = {}

    def record(self, name: str, kind: int, rank: int, seq: int) -> None:
        self.events.setdefault(name, []).append((kind, rank, seq))


class Replayer:
    """Hands each reactor the next event its recorded schedule allows.

    Raises ``TraceMismatchError`` when the schedule is impossible: a message expected out of its
    link's order (links are FIFO), or a run that has gone quiet with reactors still waiting for
    events that will never come (a trace from another graph, config or seed).
    """

    def __init__(self, events: dict[str, list[tuple[int, int, int]]]) -> None:
        self.events = {k: [tuple(e) for e in v] for k, v in events.items()}
        self.pos = dict.fromkeys(self.events, 0)
        self.done: set[str] = set()
        self.on_done: Callable[[], None] | None = None
        self._link_next: dict[tuple[str, int], int] = {}

    def next_expected(self, name: str) -> tuple[int, int, int] | None:
        seq = self.events.get(name, [])
        i = self.pos.get(name, 0)
        if i >= len(seq):
            return None
        e = seq[i]
        if e[0] == INPUT:
            want = self._link_next.get((name, e[1]), 0)
            if e[2] != want:
                raise TraceMismatchError(
                    f"{name} expected input #{e[1]} seq {e[2]} at event {i}, but seq {want} of that link comes "
                    f"first (links are FIFO): the trace is damaged"
                )
        return e  # type: ignore[return-value]

    def advance(self, name: str) -> None:
        i = self.pos.get(name, 0)
        e = self.events[name][i]
        if e[0] == INPUT:
            self._link_next[(name, e[1])] = e[2] + 1
        self.pos[name] = i + 1

    def mark_done(self, name: str) -> None:
        self.done.add(name)
        if self.on_done is not None:
            self.on_done()

    def stuck_error(self, names: list[str]) -> TraceMismatchError:
        waiting = []
        for n in names:
            # (at the end of its schedule but not done: its last event raised, a recorded failure replayed)
            if n in self.done or self.pos.get(n, 0) >= len(self.events.get(n, ())):
                continue
            e = self.events[n][self.pos[n]]
            waiting.append(f"{n} waits for {KIND_NAMES[e[0]]} #{e[1]} seq {e[2]} (event {self.pos[n]})")
        return TraceMismatchError(
            "the run went quiet before the recorded schedule was complete (a trace from another graph, "
            "config or seed?): " + "; ".join(waiting)
        )
