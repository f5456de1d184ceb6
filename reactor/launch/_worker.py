"""A worker process of a multi-process run: hosts one placement group's reactors.

Started by the coordinator as ``python -m reactor.launch._worker`` with its spec as JSON on stdin. It
rebuilds the graph from the app file (the same ``build(config)`` in every process), opens its
endpoint, reports its address, connects to the processes it sends to, and runs its reactors until
the run ends. It dies with its parent (``_die_with_parent``: held in C too), and stops at once on SIGTERM,
its shutdown reactions run (``Worker.on_sigterm``).

Wire messages (msgpack through ``reactor.transport``), worker <-> worker:
    ("m", link, seq, time_ns, microstep, value)   a message for a reactor of the receiver
    ("p", time_ns, microstep, d_ns, d_micro, n)   a promise: nothing arrives before min(U, a + D), a
                                                   the arrival there of any of the receiver's messages
                                                   after the first n (d_ns -1: U alone); see
                                                   ReactorHost.refresh
worker -> coordinator: ("hello", address, local_address), ("status", epoch, idle, sent, received), ("stop_request",),
    ("ending", stop_pending, sent, received) (deterministic: it ended on its own, with its final
    counts; answered with "stop" and the run's reason), ("done", result), ("error", text) (a failure: its
    traceback), ("refused", class_name, line) (a refusal, _errors.REFUSALS: one line), ("reconnected", group),
    ("trace", events) (a recording worker's events before its "error" or "refused": the run's trace up to its failure),
    ("writing", bool) (it began writing a checkpoint, or its last write in progress ended)
coordinator -> worker: ("peers", {group: address}), ("start",), ("probe", epoch), ("stop", why), ("exit",),
    ("lost", group, reason, life), ("restarted", group, address, restarts)   (restart policies, async runs)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import resource
import signal
import sys
import threading
import time
import traceback
from typing import Any

from .._errors import (
    REFUSAL_EXIT_STATUS,
    FrameTooLargeError,
    GraphError,
    PeerLostError,
    refusal_class,
    refusal_line,
)
from .._files import watch_writes
from .._scheduler import ProcessLink, ReactorHost, Recorder, Replayer
from .._tag import NEVER, Tag
from ._app import build_graph
from ._leaving import DEATH_SIGNAL as DEATH_SIGNAL
from ._leaving import ORPHAN_GRACE_S as ORPHAN_GRACE_S
from ._leaving import _die_with_parent, _leave_after
from ._outbox import FLOW_LIMIT, Outbox
from ._protocol import COORDINATOR, FAILED_END_S, FAILED_SAVE_S, STOPPED_FOR_FAILURE_STATUS, WorkerProtocol

log = logging.getLogger("reactor.worker")
#: A bind's failures that are its address's (the placement's), by errno, with what to do about it.
_BIND_REFUSED = {
    errno.EADDRINUSE: "another program, or another group of this run, holds it: give the group another address",
    errno.EADDRNOTAVAIL: "no interface of this host has that address",
    errno.ENAMETOOLONG: "a socket's path holds at most 107 bytes: a shorter group name, or a shorter "
                        "REACTOR_RUNTIME_DIR",
}
#: A worker's status reports to the coordinator (idle, sent, received: quiescence detection) go
#: out at most this often. Reporting after every message cost a coordinator wake-up
#: per message on every worker; the delay only postpones the end of a quiet run by as much.
STATUS_INTERVAL_S = 0.02
#: ... and a busy worker's, while it stays busy in the same probe epoch, at most this often: the
#: coordinator ends a run only when every worker says it is idle, so a busy one's counts are not read
#: (ten busy workers reporting every 20 ms cost each a zmq wake-up and the coordinator 500 a second).
#: Turning idle or busy, and answering a probe, still go out within STATUS_INTERVAL_S.
BUSY_STATUS_INTERVAL_S = 0.25
#: Deterministic mode: a promise on links with delay D > 0 goes out once grown by D / this.
_PROMISE_QUANTUM_DIV = 4
#: How long a worker whose reaction failed waits for the coordinator's "exit" (its FAILURE_STOP_S and more).
FAILED_EXIT_WAIT_S = 5.0
#: A worker stopping on SIGTERM ends this long after it at the latest (``Worker.on_sigterm``), its shutdown
#: reactions left unfinished, a checkpoint it is writing then waited for as a failed worker's is
#: (``_leave_after``). Within Slurm's ``KillWait`` (30 s by default): ``scancel`` signals every process of a
#: job at once, and the workers' shutdown reactions (a shard's final checkpoint, Metrics' summary) run in it.
TERM_END_S = 10.0


def status_interval(last: tuple[Any, ...] | None, status: tuple[Any, ...], min_interval_s: float) -> float:
    """How long after the last status report (``last``: ``(epoch, idle, sent, received)``, or None) the
    next, ``status``, may go: :data:`BUSY_STATUS_INTERVAL_S` while the worker was and is busy in the
    same epoch (its counts are read only once it says it is idle), else ``min_interval_s``."""
    if last is not None and not last[1] and not status[1] and last[0] == status[0]:
        return max(min_interval_s, BUSY_STATUS_INTERVAL_S)
    return min_interval_s


def status_wait_s(due: float | None) -> float:
    """How long the async loop waits before it looks at its status again, ``due`` the seconds until a
    postponed report may go (:meth:`Worker._report`), or None: while one is postponed nothing but its
    ``urgent`` event wakes the loop, so at most :data:`STATUS_INTERVAL_S`, which a turn to idle must go
    out within (a busy report postponed for :data:`BUSY_STATUS_INTERVAL_S` left it asleep up to 0.1 s
    after its reactors went idle); else 0.1 s (a change of status wakes it sooner)."""
    return 0.1 if due is None else min(STATUS_INTERVAL_S, due)


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.group: str = spec["group"]
        self.stop = asyncio.Event()
        self.epoch = -1
        self.last_status: tuple[Any, ...] | None = None
        self.last_report_t = -float("inf")
        self.early: list[tuple[str, Any]] = []
        self.reported: BaseException | None = None  # the failure told to the coordinator (_report_failure)
        self._leaving: threading.Thread | None = None  # (_leave_by)
        self.sigterms = 0  # SIGTERMs heard (on_sigterm)
        self.term_taken = False  # a SIGTERM cancelled the main task: it stops
        self.term_held = False  # a SIGTERM came while it stopped already, or ran its shutdown reactions
        self.in_shutdown = False  # its shutdown reactions run (ReactorHost.run_shutdown)
        # Messages refused after the endpoint's schema check: a tag behind its sender's promise.
        self.refused_behind_promise = 0
        # Deterministic mode: the latest unconditional promise of each peer, as soon as it is taken
        # (the horizons catch up only at the next refresh, after the rest of the batch).
        self.promised_by: dict[str, Tag] = {}
        # Deterministic loop: rounds of work, promises sent, rounds that blocked waiting for peers.
        self.loop_stats = {"rounds": 0, "promises": 0, "waits": 0, "reports": 0}
        self.reconnects: set[asyncio.Task[None]] = set()
        self.down_at_start: list[str] = []
        self.retrying: dict[str, asyncio.Task[None]] = {}  # (_retry_link)
        self.forgot = [0, 0]  # messages sent to and received from peers' earlier lives (_forget)
        self.started = False  # (async: the startup's peer events are out)
        self.done_sent = False  # its shutdown reactions ran and its result went (exit_status)
        self.trace_sent = False  # (_send_trace)

    async def main(self) -> None:
        from ..transport import CurveKeys, Endpoint, link_key

        spec = self.spec
        if spec.get("dist_store"):  # data-parallel learners over hosts: the run's rendezvous
            os.environ["REACTOR_DIST_STORE"] = spec["dist_store"]
        graph = build_graph(spec["app"], spec["config"])
        graph.validate()
        owner_of: dict[str, str] = spec["owner_of"]
        local = [n for n, g in owner_of.items() if g == self.group]
        links = graph.links()
        out_peers = sorted({owner_of[lk.dst] for lk in links if lk.src in local and owner_of[lk.dst] != self.group})
        in_peers = sorted({owner_of[lk.src] for lk in links if lk.dst in local and owner_of[lk.src] != self.group})
        min_delay = {p: min(lk.delay_ns for lk in links if lk.src in local and owner_of[lk.dst] == p) for p in out_peers}

        curve = spec.get("curve")
        keys = CurveKeys(curve["public"].encode(), curve["secret"].encode()) if curve else None
        # Every message is checked against its kind's schema, its sender's right to send it and
        # its port's type where it enters this process (reactor/launch/_protocol.py); a bad one is dropped.
        port_types = {n: node.reactor_type._port_specs for node, _, n in graph.instances()}
        in_links = {lk.index: (owner_of[lk.src], port_types[lk.dst][lk.dst_port].type)
                    for lk in links if lk.dst in local and owner_of[lk.src] != self.group}
        # Over hosts the endpoint binds tcp for other hosts and, beside it, a plain ipc socket its
        # daemon's other workers are given instead (``local_bind``): links on a host skip CURVE.
        try:
            self.ep = ep = await Endpoint.open(self.group, spec["bind"], max_message_nbytes=spec["max_message_nbytes"],
                                               curve=keys, curve_local=False, local_bind=spec.get("local_bind"),
                                               accept=WorkerProtocol(in_links))
        except OSError as e:
            if e.errno not in _BIND_REFUSED or spec.get("restarts"):
                raise  # (a new life's: its last life's children, or a life on a lost host, may hold it yet)
            # The placement's address at a group's first start (a port another program or group holds, a
            # path too long for a socket): the user's to change, said in one line and never restarted.
            why = _BIND_REFUSED[e.errno]
            raise GraphError(f"group {self.group!r} cannot bind {spec['bind']!r}: {os.strerror(e.errno)} ({why})") from None
        try:
            await ep.connect(COORDINATOR, spec["coordinator"], server_public_key=link_key(keys, spec["coordinator"]))
            self.flow_limit = int(spec.get("flow_limit", FLOW_LIMIT))
            self.peak_inbox = 0
            restartable = frozenset(spec.get("restartable", ())) if not spec["deterministic"] else frozenset()
            self.outbox = outbox = Outbox(ep, self.flow_limit, restartable)
            self._watch_writes()
            self.keys, self.out_peers = keys, out_peers
            outbox.send(COORDINATOR, ("hello", ep.address, ep.local_address))
            peers = await self._wait_control("peers")
            # A peer being restarted as this one starts (restart policies) is not in the book yet:
            # it is down here until the coordinator says "restarted".
            self.down_at_start = [p for p in out_peers if p not in peers and p in restartable]
            missing = [p for p in out_peers if p not in peers and p not in restartable]
            if missing:
                raise PeerLostError(f"{self.group}: the coordinator's address book lacks {missing}")
            for p in out_peers:
                if p not in self.down_at_start:
                    try:
                        await ep.connect(p, peers[p], server_public_key=link_key(keys, peers[p]))
                        continue
                    except PeerLostError as e:
                        if p not in restartable:
                            raise
                        # It died since the coordinator's book was written (it comes back with "restarted"),
                        # or it lives, held in a reaction longer than the connect's timeout (a long update or
                        # rendezvous answers no welcome): asked again meanwhile (it stayed down here for the
                        # rest of the run, everything sent to it dropped).
                        log.warning("%s: restartable peer %r is not there (%s); it counts as down until it answers",
                                    self.group, p, e)
                        self.down_at_start.append(p)
                        self._retry_link(p, peers[p])
                outbox.mark_down(p)
            recorder = Recorder() if spec["record"] else None
            replayer = None
            if spec["replay"]:
                from .._trace import read_trace

                events = read_trace(spec["replay"])["events"]
                replayer = Replayer({k: v for k, v in events.items() if k in local})
            deterministic = spec["deterministic"]
            stop_ns = spec["stop_ns"]
            self.host = host = ReactorHost(
                graph, local, owner_of, seed=spec["seed"], deterministic=deterministic, remote=outbox,
                digest=_digest if spec["digest"] else None, stop_ns=stop_ns, recorder=recorder,
                replayer=replayer, process=self.group, link=ProcessLink(ep.address, keys),
                restarts=int(spec.get("restarts", 0)),
            )
            for p in in_peers:
                host.horizons[p] = Tag(0, 0)
            outbox.send(COORDINATOR, ("ready",))
            await self._wait_control("start")
            started = _cpu_stats()
            self.flusher = flusher = asyncio.ensure_future(outbox.flush_forever())
            failure: Exception | None = None
            try:
                if deterministic:
                    await self._run_deterministic(out_peers, min_delay)
                    if host.stop_reason is None:
                        await self._await_verdict(out_peers)
                else:
                    await self._run_async()
            except asyncio.CancelledError:
                host.stop_reason = host.stop_reason or "terminated"
                raise
            except Exception as e:
                host.stop_reason = "failure"
                failure = e
                await self._report_failure(e)  # (first: the others are told to stop while ours run)
            finally:
                if host.stop_reason is None:  # it ended on its own (the coordinator's "stop" names its reason)
                    host.stop_reason = "stop_time" if deterministic and _stop_pending(host) else "quiescence"
                if host.stop_reason == "failure" and failure is None:
                    self._send_trace()  # (the run failed elsewhere: its trace, before a shutdown that may outlast it)
                self.in_shutdown = True  # (a SIGTERM now is held until they end: on_sigterm)
                try:
                    await host.run_shutdown()
                finally:
                    self.in_shutdown = False
                # (stopped by the coordinator, SIGTERM'd meanwhile; not a failed worker's: its failure is still
                # to be reported below, and it leaves with its own status, its SIGTERM's bound running)
                if self.term_held and not self.term_taken and failure is None and host.shutdown_failure is None:
                    self.term_taken = True
                    asyncio.current_task().cancel()  # type: ignore[union-attr]
            if host.shutdown_failure is not None:
                if failure is None:  # (a learner's last checkpoint not saved: the run failed)
                    failure = host.shutdown_failure
                    await self._report_failure(failure)
                else:  # (said, not lost behind the run's first error)
                    log.error("%s: a shutdown reaction failed too", self.group, exc_info=host.shutdown_failure)
            if failure is not None:
                # Leave when the coordinator says (once the others were told why the run ends, or at once
                # for a restart), our shutdown reactions run meanwhile: gone first, every survivor and the
                # coordinator warned that they lost this worker.
                with contextlib.suppress(Exception):
                    await self._wait_control("exit", timeout_s=FAILED_EXIT_WAIT_S)
                raise failure
            incomplete = None
            if replayer is not None and not all(n in replayer.done for n in local):
                incomplete = str(replayer.stuck_error(local))
            result = {
                "replay_incomplete": incomplete,
                "stats": {
                    "peak_inbox": self.peak_inbox,
                    "peak_backlog": outbox.peak_backlog,
                    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    "curve": ep.curve_server,  # its ROUTER encrypts: a tcp bind in a run with keys
                    # Its links to the peers it sends to, by whether they encrypt (over hosts, those
                    # to its own host's workers go to their plain ipc sockets).
                    "links_curve": sum(ep.link_encrypted(p) for p in ep.peers if p != COORDINATOR),
                    "links_plain": sum(not ep.link_encrypted(p) for p in ep.peers if p != COORDINATOR),
                    "hellos_refused": ep.statistics().hellos_refused,  # a name live at another connection (its other socket's)
                    "sent": host.sent_count,
                    "received": host.received_count,
                    **self.loop_stats,
                    "coarse_promises": host.coarse_promises,
                    "dropped_to_lost": sum(outbox.dropped_to_lost.values()),
                    **_refusals(ep.statistics(), self.refused_behind_promise),
                    **{k: v - started[k] for k, v in _cpu_stats().items()},
                },
                "events": {n: s.events for n, s in host.stats.items()},
                "digests": host.digests() if spec["digest"] else {},
                "trace": {k: [list(e) for e in v] for k, v in recorder.events.items()} if recorder else {},
            }
            # Everything queued for peers must leave first (the last messages, e.g. a final promise,
            # may be waiting for credit); then we send peers nothing more and close those links, so
            # that peers exiting after the coordinator's "exit" are not reported as lost.
            await asyncio.wait_for(outbox.empty.wait(), timeout=30)
            for p in out_peers:
                ep.disconnect(p)
            outbox.send(COORDINATOR, ("done", result))
            self.done_sent = True
            await asyncio.wait_for(outbox.empty.wait(), timeout=30)
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            # Stay until the coordinator says so: peers may still need our credit grants.
            await self._wait_control("exit", timeout_s=60)
        finally:
            watch_writes(None)
            for group in list(self.retrying):
                self._stop_retrying(group)
            await ep.aclose()

    def exit_status(self, otherwise: int) -> int:
        """Its exit status once it has ended without a failure of its own: ``STOPPED_FOR_FAILURE_STATUS``
        when the run failed elsewhere (its coordinator's ``stop("failure")``) and its shutdown reactions
        ran (it ended on the coordinator's ``exit``, or the reaping's SIGTERM came after its result), else
        ``otherwise``."""
        host = getattr(self, "host", None)
        stopped = self.done_sent and host is not None and host.stop_reason == "failure"
        return STOPPED_FOR_FAILURE_STATUS if stopped else otherwise

    def dump_state(self) -> None:
        """SIGUSR1: write this worker's scheduling state and task stacks to stderr (debugging)."""
        import io

        buf = io.StringIO()
        h = getattr(self, "host", None)
        buf.write(f"--- reactor worker {self.group} state ---\n")
        if h is not None:
            buf.write(f"heap: {len(h.heap)} events, next {h.heap[0][:2] if h.heap else None}\n")
            buf.write(f"horizons: {dict(h.horizons)}\n")
            buf.write(f"sent {h.sent_count} received {h.received_count} stop_requested {h.stop_requested}\n")
        ob = getattr(self, "outbox", None)
        if ob is not None:
            buf.write(f"outbox backlog {ob.backlog} per peer {[(p, len(q)) for p, q in ob.queues.items()]}\n")
        ep = getattr(self, "ep", None)
        if ep is not None:
            buf.write(f"endpoint {ep.statistics()}\n")
        fl = getattr(self, "flusher", None)
        if fl is not None and fl.done():
            buf.write(f"outbox flusher ended: {fl.exception() if not fl.cancelled() else 'cancelled'}\n")
        for t in asyncio.all_tasks():
            coro = t.get_coro()
            frames = []
            while coro is not None:
                frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
                if frame is not None:
                    frames.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
            buf.write(f"task {t.get_name()}: {' -> '.join(frames)}\n")
        sys.stderr.write(buf.getvalue())
        sys.stderr.flush()

    # -- control ---------------------------------------------------------------------------------

    async def _await_verdict(self, out_peers: list[str]) -> None:
        """A deterministic run ended here on its own: whether the run as a whole ended at its stop
        time or with nothing left to happen is known only from every worker's end (a message
        tagged past the stop time counts at its sender), so ask the coordinator before the shutdown
        reactions run (``Reactor.stopped_by``). Nothing can happen here meanwhile, and nothing more
        goes to the peers (shutdown reactions' outputs are not delivered): the links to them close
        first, as when the worker is done (its peers need not keep them for the rest of the run)."""
        host = self.host
        await asyncio.wait_for(self.outbox.empty.wait(), timeout=30)
        for p in out_peers:
            self.ep.disconnect(p)
        # (with its final counts: the coordinator's counting leaves it out of its probes from now on)
        self.outbox.send(COORDINATOR, ("ending", _stop_pending(host), *self._counts()))
        why = await self._wait_control("stop", timeout_s=None)  # (however long the others run: the run is not over)
        self.ep.expect_departures()
        if host.stop_reason is None:
            host.stop_reason = why

    async def _report_failure(self, e: BaseException) -> None:
        """Tell the coordinator this worker failed (a refusal in one line, a graph's faults whole, else
        the traceback)."""
        self.ep.expect_departures()
        self.reported = e  # (its coordinator says it: main() prints no second traceback)
        self._send_trace()  # (first: the coordinator writes the run's trace up to this failure)
        refused = refusal_class(e)
        # (its coordinator's bound, in its spec: the coordinator ends a held one past it)
        self._leave_by(float(self.spec.get("failed_end_s", FAILED_END_S)), REFUSAL_EXIT_STATUS if refused is not None else 1)
        if refused is not None:  # (what it was given: one line, as under `single`; -v logs the traceback)
            log.info("%s refused the run", self.group, exc_info=e)
            line = str(e) if isinstance(e, GraphError) else refusal_line(e)  # (the command indents a graph's)
            self.outbox.send(COORDINATOR, ("refused", refused, line[: 1 << 20]))
        else:
            text = "".join(traceback.format_exception(e))
            self.outbox.send(COORDINATOR, ("error", f"{type(e).__name__}: {e}\n{text}"[-(1 << 20):]))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await self.outbox.empty.wait()

    def _watch_writes(self) -> None:
        """Tell the coordinator when this process begins and ends writing a checkpoint (``("writing", bool)``:
        :func:`~reactor._files.watch_writes`). After a failure it ends a worker that does not leave: one that
        writes is waited for (a failed one ``FAILED_SAVE_S`` past its bound, a survivor as long), and one that
        does not is held, its bound's thread unable to run (a C call holding the interpreter), and is killed
        (it waited out the whole bound and its save's leeway, 135 s). Said from the writing thread before the
        write begins: a write on this loop's thread holds the loop until it ends, so the word goes out at once
        (the endpoint's ``flush``); another thread's goes through the loop."""
        loop, here = asyncio.get_running_loop(), threading.get_ident()

        def say(now: bool) -> None:
            with contextlib.suppress(Exception):  # (a link going down as the run ends: nothing to tell)
                self.outbox.send(COORDINATOR, ("writing", now))
                self.ep.flush()

        def said(now: bool) -> None:
            if threading.get_ident() == here:
                say(now)
            else:
                loop.call_soon_threadsafe(say, now)

        watch_writes(said)

    def _send_trace(self) -> None:
        """A recording whose run failed (here, or elsewhere: the coordinator's ``stop("failure")``): this
        worker's events go to the coordinator now, which writes the run's trace up to the failure; its result,
        which carries them otherwise, comes only after its shutdown reactions (a final checkpoint may outlast
        the coordinator's wait), or never (this one failed)."""
        recorder = getattr(getattr(self, "host", None), "recorder", None)
        if recorder is None or self.trace_sent:
            return
        self.trace_sent = True
        try:
            self.outbox.send(COORDINATOR, ("trace", {k: [list(x) for x in v] for k, v in recorder.events.items()}))
        except FrameTooLargeError as e:  # (the coordinator then says that this one's events are missing)
            log.warning("%s: its recorded events do not fit in one message (%s)", self.group, e)

    def on_sigterm(self, task: asyncio.Task[Any]) -> None:
        """SIGTERM: stop now (``task``, the worker's main one, is cancelled; its shutdown reactions run as it
        stops: ``main``), and leave ``TERM_END_S`` later at the latest (``_leave_by``). A SIGTERM while it
        stops already, or while its shutdown reactions run, cancels nothing: heard once the shutdown
        reactions end. Slurm's ``scancel`` signals every process of a job at once, and a worker's parent (its
        daemon's fork server) that a SIGTERM ends, or its daemon ending the run, sent more: each cut the
        shutdown reactions where they awaited, and the shard's final checkpoint, Metrics' summary or the
        learner's last checkpoint after that point were not written. (Under ``single`` the first signal is
        a clean stop and the second stops at once; a worker's "at once" is its bound, or SIGKILL.)"""
        self.sigterms += 1
        if self.sigterms == 1:
            self._leave_by(TERM_END_S, 128 + signal.SIGTERM, since="the SIGTERM")
        if self.term_taken or self.in_shutdown:
            if not self.term_held:
                log.warning("%s: SIGTERM while it stops: its shutdown reactions (a final checkpoint, a summary) run on; "
                            "it leaves once they end, or %g s after the first SIGTERM at the latest", self.group,
                            TERM_END_S)
            self.term_held = True
            return
        self.term_taken = True
        task.cancel()

    def _leave_by(self, seconds: float, status: int, since: str = "its failure") -> None:
        """This worker failed (or took a SIGTERM: ``since`` says which): end the process with ``status``
        (main()'s for its failure) if it is still here ``seconds`` from now, or once the checkpoints it is writing then are written (at most
        ``FAILED_SAVE_S`` more: :func:`_leave_after`). A thread, as the event loop may be held by the
        reaction that holds it."""
        if self._leaving is not None:
            return
        self._leaving = threading.Thread(target=_leave_after, args=(self.group, seconds, FAILED_SAVE_S, status, since),
                                         name="leave-by", daemon=True)
        self._leaving.start()

    async def _wait_control(self, what: str, timeout_s: float | None = 120) -> Any:
        """Wait for control message ``what``; keep every other message (peers may start first)."""
        async with asyncio.timeout(timeout_s):
            while True:
                batch = await self.ep.recv_batch()
                for i, (peer, msg) in enumerate(batch):
                    if peer == COORDINATOR and msg[0] == what:
                        self.early.extend(batch[i + 1 :])
                        return msg[1] if len(msg) > 1 else None
                    if not (peer == COORDINATOR and msg[0] == "stop" and what == "exit"):
                        self.early.append((peer, msg))

    def _on_control(self, msg: Any) -> None:
        kind = msg[0]
        if kind == "stop":
            self.ep.expect_departures()
            if self.host.stop_reason is None:
                self.host.stop_reason = msg[1]
            self.stop.set()
            self.host.stop_requested = True
            self.host._kick()
            for event in (getattr(self, "changed", None), getattr(self, "urgent", None)):
                if event is not None:
                    event.set()
        elif kind == "probe":
            self.epoch = msg[1]
            self._report(force=True)
        elif kind == "lost":
            self._peer_lost(msg[1], msg[2], msg[3])
        elif kind == "restarted":
            task = asyncio.ensure_future(self._peer_restarted(msg[1], msg[2], msg[3]))
            self.reconnects.add(task)
            task.add_done_callback(self.reconnects.discard)
        else:
            log.warning("%s: unknown control message %r", self.group, kind)

    def _retry_link(self, group: str, address: str) -> None:
        """A restartable peer in the address book did not answer our connect at our start: ask it again
        every second until it answers, or until the coordinator says it was lost or restarted (then
        ``_peer_lost`` or ``_reconnect`` takes it over). Once it answers, it is up again here."""
        from ..transport import link_key

        async def retry() -> None:
            while True:
                await asyncio.sleep(1.0)
                try:
                    await self.ep.connect(group, address, server_public_key=link_key(self.keys, address))
                except PeerLostError:
                    continue
                break
            self.retrying.pop(group, None)
            self._forget(group, received=False)  # (what went to it meanwhile was dropped; it sent on)
            self.outbox.mark_up(group)
            log.warning("%s: restartable peer %r answers now; it is up again here", self.group, group)
            if not self.started:
                self.down_at_start.remove(group)
            else:
                self.host.peer_event("peer_restarted", group, "it answers now")

        self._stop_retrying(group)
        self.retrying[group] = asyncio.ensure_future(retry())

    def _stop_retrying(self, group: str) -> None:
        task = self.retrying.pop(group, None)
        if task is not None:
            task.cancel()

    def _peer_lost(self, group: str, reason: str, life: int) -> None:
        """The coordinator says ``group``'s process (its ``life``: 0 for its first, n after n restarts)
        died and will be started again (its restart policy): drop what goes to it meanwhile, and tell
        the reactors that care."""
        self._stop_retrying(group)
        if group not in self.outbox.restartable or self.host.deterministic:
            log.warning("%s: ignored 'lost' for %r, which has no restart policy here", self.group, group)
            return
        self.outbox.mark_down(group)
        if group in self.out_peers:
            self.ep.disconnect(group, linger_s=0)  # its old address is dead; the new one comes with "restarted"
        self.host.peer_event("peer_lost", group, reason, life)

    async def _peer_restarted(self, group: str, address: str, restarts: int) -> None:
        """``group``'s new process listens at ``address``: connect to it (if we send to it), then
        send to it again and tell the reactors that care."""
        try:
            await self._reconnect(group, address, restarts)
        finally:  # the restarted worker starts once every live worker has linked to it (or failed to)
            self.outbox.send(COORDINATOR, ("reconnected", group))

    async def _reconnect(self, group: str, address: str, restarts: int) -> None:
        from ..transport import link_key

        if group not in self.outbox.restartable or self.host.deterministic:
            log.warning("%s: ignored 'restarted' for %r, which has no restart policy here", self.group, group)
            return
        self._stop_retrying(group)
        self.outbox.mark_down(group)
        # A live link is to this life already: made at our own start, when its book entry was the
        # new life (past its hello; "lost" drops a link to an old one). Connecting again would offer
        # a second hello under our name while the first is live there: refused, and it stayed down.
        linked = self.ep.linked(group)
        if group in self.out_peers and not linked:
            self.ep.disconnect(group, linger_s=0)
            try:
                await self.ep.connect(group, address, server_public_key=link_key(self.keys, address))
            except PeerLostError as e:  # it died again: the coordinator says so next
                log.warning("%s: could not reach restarted %r at %s: %s", self.group, group, address, e)
                return
            except Exception:  # noqa: BLE001 - a task of its own: say it here, the run goes on without it
                log.exception("%s: connecting to restarted %r at %s failed; it stays down for this process",
                              self.group, group, address)
                return
        # (a new life sends nothing before its start, which waits for our "reconnected"; what went to a
        # life it links to already is its own)
        self._forget(group, sent=not linked)
        self.outbox.mark_up(group)
        self.host.peer_event("peer_restarted", group, f"restarted ({restarts} so far)", restarts)

    def _forget(self, group: str, sent: bool = True, received: bool = True) -> None:
        """Leave out of this worker's counts (:meth:`_counts`) the messages it sent to and received from
        ``group``'s earlier lives, or sent to it while it was down (dropped), as it links to a new life:
        what they sent and received left the coordinator's sums with them (it drops a dead worker's
        status), so the sums of the run's live workers meet again once nothing is in flight between
        them, and a difference after a restart says a message is lost or late (the coordinator's warning
        as the run goes quiet). Left in, they never met after a restart (a dead life's messages received,
        its count of them gone), and every such run ended on a warning of hundreds of messages."""
        h = self.host
        if sent:
            self.forgot[0] += h.sent_to.pop(group, 0)
        if received:
            self.forgot[1] += h.received_from.pop(group, 0)

    def _counts(self) -> tuple[int, int]:
        """Messages sent to and received from peers, for the coordinator's quiescence (those of the
        peers' earlier lives left out: :meth:`_forget`)."""
        h = self.host
        return h.sent_count - self.forgot[0], h.received_count - self.forgot[1]

    def _idle(self) -> bool:
        h = self.host
        if h.deterministic:
            return not h.heap
        return h.quiescent()

    def _report(self, force: bool = False, min_interval_s: float = 0.0) -> float | None:
        """Send our status to the coordinator if it changed (or ``force``), at most once per
        ``min_interval_s``; returns the seconds until a postponed report is due, else None."""
        status = (self.epoch, self._idle(), *self._counts())
        if not force and status == self.last_status:
            return None
        now = time.monotonic()
        interval = status_interval(self.last_status, status, min_interval_s)
        if not force and now - self.last_report_t < interval:
            return self.last_report_t + interval - now
        self.last_status = status
        self.last_report_t = now
        self.loop_stats["reports"] += 1
        self.outbox.send(COORDINATOR, ("status", *status))
        return None

    async def _restarts_heard_early(self) -> None:
        """Peers lost or started again while this worker was starting (the coordinator's word waits in
        ``early``): handled first, in the order heard, the links to new lives made, before any
        message of the peers is delivered: what the reactors answer to a restarted peer's early
        requests would otherwise go out while it still counted as down here, and be dropped."""
        rest = []
        for peer, msg in self.early:
            if peer == COORDINATOR and msg[0] == "lost":
                self._peer_lost(msg[1], msg[2], msg[3])
            elif peer == COORDINATOR and msg[0] == "restarted":
                await self._peer_restarted(msg[1], msg[2], msg[3])
            else:
                rest.append((peer, msg))
        self.early = rest

    def _take_early(self) -> None:
        """Deliver what peers sent before our "start" (after our startup events, which come first)."""
        early, self.early = self.early, []
        self._take(early)

    def _take(self, batch: list[tuple[str, Any]]) -> None:
        """Deliver checked messages (the endpoint applied the schemas: reactor/launch/_protocol.py)."""
        h = self.host
        horizons = h.horizons if h.deterministic else None
        promised_by = self.promised_by
        for peer, msg in batch:
            kind = msg[0]
            if kind == "m":
                tag = Tag(msg[3], msg[4])
                if horizons is not None:
                    bound = max(horizons.get(peer, tag), promised_by.get(peer, tag))
                    if tag < bound:
                        # Promises and messages share one FIFO pipe: a correct peer never sends this.
                        self.refused_behind_promise += 1
                        log.warning("%s: refused a message from %r on link %d at %s, behind its promise %s",
                                    self.group, peer, msg[1], tag, bound)
                        continue
                h.deliver_remote(msg[1], msg[2], tag, msg[5])
            elif kind == "p":
                bound = Tag(msg[1], msg[2])
                floor = promised_by.get(peer)
                if floor is not None and bound < floor:
                    # Below what this peer promised unconditionally before: a correct peer's promises
                    # only grow. Taken, it would replace the earlier one before the horizons are
                    # raised (a finished peer's NEVER lost, and this process waiting for it forever).
                    self.refused_behind_promise += 1
                    log.warning("%s: refused a promise from %r of %s, below its earlier promise %s",
                                self.group, peer, bound, floor)
                    continue
                if msg[3] < 0:  # unconditional: nothing from this peer before `bound`, ever
                    promised_by[peer] = bound
                h.receive_promise(peer, bound, None if msg[3] < 0 else (msg[3], msg[4]), msg[5])
            elif peer == COORDINATOR:
                self._on_control(msg)
            else:
                log.error("%s: dropped unknown message kind %r from %s", self.group, kind, peer)

    # -- deterministic mode ------------------------------------------------------------------------

    async def _run_deterministic(self, out_peers: list[str], min_delay: dict[str, int]) -> None:
        h, outbox = self.host, self.outbox
        h._seed_events()
        self._take_early()
        promised = dict.fromkeys(out_peers, Tag(0, 0))
        dists: dict[str, Any] = dict.fromkeys(out_peers)  # the D part of our last promise to each peer
        # A promise on links with delay D > 0 goes out only once it has grown by D / 4 (or is
        # NEVER): a peer that waits on us then wakes once per D / 4 of logical time, not once per
        # event of ours (an actor stepping on the learner's promises: ~10x fewer wake-ups). What is
        # held back is less than D, so every cycle of links keeps a positive lookahead and the
        # earliest pending event anywhere can still run: no deadlock.
        quantum = {p: min_delay[p] // _PROMISE_QUANTUM_DIV for p in out_peers}
        stats = self.loop_stats
        flush = getattr(self.ep, "flush", None)
        if h.stop_requested:
            return

        def send_promises(bounds: dict[str, Any] | None) -> None:
            for p in out_peers:
                # A conditional promise (U, D, n) (ReactorHost.refresh). What the peer makes of our
                # last one is min(U, a + D), a being the earliest of its messages it counts as in
                # flight: those we received since are among them. The new promise goes out when it
                # beats that by the quantum, so a peer never waits on our answer to a message we
                # have already handled (its new count n drops them), and otherwise no more often
                # than plain promises.
                if bounds is None:
                    promise, dist, n = NEVER, None, 0
                else:
                    promise, dist, n = bounds[p]
                old = h.peer_view(p, promised[p], dists[p])
                grew = promise > old and (promise == NEVER or promise.time_ns >= old.time_ns + quantum[p])
                # Finished: a last NEVER without the D part, even when U was NEVER already. The rule
                # above already sends one whenever the peer could still be waiting on our answer (a
                # message of its we received since), so this is a guard: the peer can then drop
                # what it keeps in flight for us, and no corner of the rule can leave it waiting.
                final = bounds is None and dists[p] is not None
                if grew or final:
                    promised[p] = promise
                    dists[p] = dist
                    h.promise_sent(p)
                    d_ns, d_micro = dist if dist is not None else (-1, 0)
                    outbox.send(p, ("p", promise.time_ns, promise.microstep, d_ns, d_micro, n))
                    stats["promises"] += 1

        if h.has_blocking:  # a blocking reaction may be the first event (a rendezvous at startup)
            send_promises(h.refresh(out_peers))
            if flush is not None:
                flush()
        while not self.stop.is_set():
            stats["rounds"] += 1
            early = None
            if h.cond_dirty:  # promises came in: raise the horizons before running
                early = h.refresh(out_peers)
            received = h.received_count
            ran = await h.run_ready(budget=1024)
            if outbox.failure is not None:
                raise outbox.failure
            finished = h.finished()
            if finished:
                bounds = None
            elif early is not None and ran == 0 and not h.cond_dirty and h.received_count == received:
                bounds = early  # nothing changed since: one refresh this round
            else:
                bounds = h.refresh(out_peers)
            send_promises(bounds)
            if flush is not None:
                flush()  # what the events and promises sent leaves before the next event runs
            if h.stop_requested and not self.stop.is_set():
                outbox.send(COORDINATOR, ("stop_request",))
                return
            if finished:
                return
            if outbox.congested:
                await outbox.wait_drained()
            if h.runnable():
                batch = await self.ep.recv_batch(timeout_s=0) if self._ready() else []
            else:
                # Status at most every STATUS_INTERVAL_S (a report per wait woke the coordinator
                # thousands of times a second); a postponed one goes out when its time comes.
                due = self._report(min_interval_s=STATUS_INTERVAL_S)
                stats["waits"] += 1
                batch = await self.ep.recv_batch(timeout_s=due)
            self._take(batch)

    def _ready(self) -> bool:
        poll = getattr(self.ep, "poll_ready", None)
        return bool(poll()) if poll is not None else True

    # -- async mode --------------------------------------------------------------------------------

    async def _run_async(self) -> None:
        h = self.host
        h._seed_events()
        self.started = True
        for p in self.down_at_start:  # after the startup events: reactors learn of it once started
            h.peer_event("peer_lost", p, f"worker {p!r} is being started again")
        await self._restarts_heard_early()
        self._take_early()
        h.start_async_timers()
        # The loop below wakes on `changed` (a reactor went idle, a batch came in: the status may
        # have changed) to report it, but at most once per STATUS_INTERVAL_S; while a report is
        # postponed it waits only for `urgent` (a stop, a task's end, the replay done), so a busy
        # worker does not wake it per event for nothing, and at most STATUS_INTERVAL_S (status_wait_s):
        # a turn to idle then wakes nothing else.
        self.changed = changed = asyncio.Event()
        self.urgent = urgent = asyncio.Event()
        room = asyncio.Event()
        replay_done = asyncio.Event()
        replayer = h.replayer

        def on_replay_done() -> None:
            if all(n in replayer.done for n in h.reactors):
                replay_done.set()
                urgent.set()

        if replayer is not None:
            replayer.on_done = on_replay_done

        def idle() -> None:
            changed.set()
            room.set()

        tasks = [asyncio.ensure_future(h.serve_reactor(n, idle)) for n in h.reactors]
        pump = asyncio.ensure_future(self._pump(room))
        for t in (*tasks, pump):
            t.add_done_callback(lambda _: urgent.set())
        asked = reported_done = False
        try:
            while not self.stop.is_set():
                for t in (*tasks, pump):
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if self.outbox.failure is not None:
                    raise self.outbox.failure
                if h.stop_requested and not asked:
                    asked = True
                    self.outbox.send(COORDINATOR, ("stop_request",))
                if replay_done.is_set() and not reported_done:
                    # The run ends when every process has replayed its whole schedule.
                    reported_done = True
                    self.outbox.send(COORDINATOR, ("replay_done",))
                due = self._report(min_interval_s=STATUS_INTERVAL_S)
                event = changed if due is None else urgent
                event.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(status_wait_s(due)):
                        await event.wait()
        finally:
            h.stop_requested = True
            for t in (*tasks, pump):
                t.cancel()
            await asyncio.gather(*tasks, pump, return_exceptions=True)

    async def _pump(self, room: asyncio.Event) -> None:
        """Async mode: move messages from the endpoint to inboxes, pausing while inboxes are full.

        While paused, credit is not returned to senders: that is the backpressure.
        """
        h = self.host
        while True:
            while (queued := sum(len(q) for q in h._inbox.values())) >= self.flow_limit:
                room.clear()
                await room.wait()
            batch = await self.ep.recv_batch(max_n=max(1, min(256, self.flow_limit - queued)))
            self._take(batch)
            self.peak_inbox = max(self.peak_inbox, sum(len(q) for q in h._inbox.values()))
            self.changed.set()


def _refusals(st: Any, behind_promise: int) -> dict[str, int]:
    """What this worker dropped from its peers (the run's statistics show them): in all, and
    undecodable, too large, over credit, refused by the protocol's schemas or behind a promise."""
    return {"dropped": st.dropped + behind_promise, "dropped_malformed": st.dropped_malformed,
            "dropped_too_large": st.dropped_too_large, "dropped_over_credit": st.dropped_over_credit,
            "dropped_unknown_peer": st.dropped_unknown_peer, "dropped_invalid": st.dropped_invalid + behind_promise}


def _stop_pending(host: ReactorHost) -> bool:
    """Events remain queued past the logical stop time (the run ended at its stop time)."""
    return host.stop_ns is not None and (host.sent_past_stop or bool(host.heap))


def _cpu_stats() -> dict[str, int]:
    """This process's CPU time (all threads, ms) and context switches (voluntary: it waited), so far."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_ms": round((u.ru_utime + u.ru_stime) * 1e3), "voluntary_switches": u.ru_nvcsw,
            "involuntary_switches": u.ru_nivcsw}


def _digest(value: Any) -> bytes:
    from ._runtime import payload_digest

    return payload_digest(value)


#: A worker's ``oom_score_adj`` (from 0, the default): when a host runs out of memory, the kernel's OOM
#: killer ends a worker, whose death its run sees and says (or its restart policy takes), rather than the
#: coordinator or the daemon that watch it and whose death ends every run they hold.
WORKER_OOM_SCORE_ADJ = 300


def _first_to_go_on_oom() -> None:
    """Raise this process's ``oom_score_adj`` to :data:`WORKER_OOM_SCORE_ADJ` (never lower it: one set
    higher by its user stays)."""
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            if int(f.read().strip() or 0) < WORKER_OOM_SCORE_ADJ:
                f.seek(0)
                f.write(str(WORKER_OOM_SCORE_ADJ))
    except (OSError, ValueError):  # (no procfs: nothing to say)
        pass


def main() -> int:
    _die_with_parent()
    _first_to_go_on_oom()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator owns Ctrl-C and tells us to stop
    spec = json.loads(sys.stdin.read())
    logging.basicConfig(level=spec.get("log_level", "WARNING"),
                        format=f"%(asctime)s {spec['group']} %(name)s %(levelname)s %(message)s")
    worker = Worker(spec)

    async def amain() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, worker.on_sigterm, task)
        loop.add_signal_handler(signal.SIGUSR1, worker.dump_state)
        await worker.main()

    from ._runtime import asyncio_run

    try:
        asyncio_run(amain())
    except asyncio.CancelledError:
        return worker.exit_status(128 + signal.SIGTERM)
    except PeerLostError as e:
        print(f"reactor worker {spec['group']}: {e}", file=sys.stderr)
        return 3
    except BaseException as e:
        if worker.reported is e:  # its coordinator says it (one line, or the traceback)
            return REFUSAL_EXIT_STATUS if refusal_class(e) is not None else 1
        if refusal_class(e) is not None:  # (before it could report: its rebuild of the app's graph refused)
            print(f"reactor worker {spec['group']}: {e}", file=sys.stderr)
            return REFUSAL_EXIT_STATUS
        traceback.print_exc()
        return 1
    return worker.exit_status(0)


if __name__ == "__main__":  # (a new interpreter: REACTOR_FORK_SERVER=0, or no fork server)
    from ._runtime import exit_without_teardown

    exit_without_teardown(main())  # (as a forked worker leaves: its server's os._exit)
