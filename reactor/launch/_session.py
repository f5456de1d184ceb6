"""The coordinator's session with a run's workers (:class:`_Session`): it gathers their words at the
run's start, supervises the run to its end, restarts groups by their policies (the bookkeeping is
:class:`~._restarts._Restarts`') and gives the survivors of a failure their time to stop.

It ends the run when every worker has finished (stop time reached), when one asks to stop, on
SIGINT/SIGTERM, or on quiescence, detected by counting: when every worker reports idle and the
messages sent and received add up, it probes all of them once more, and stops only if the
counts are unchanged (a message in flight would show as a difference). After a restart the sums meet
again (a dead worker's counts leave them with it, and each live worker leaves out of its own what it sent
to and received from a peer's earlier lives as it links to the new one: ``Worker._forget``), but a dead
life's message read late can offset one in flight: it stops once every worker has stayed idle with
unchanged counts over probe rounds for :data:`LOST_QUIET_S`, and says by how many the sums missed if
they do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Mapping
from typing import Any

from .._errors import (
    REFUSAL_EXIT_STATUS,
    REFUSAL_NAMES,
    REFUSALS,
    PeerLostError,
    ReactorError,
    WorkerFailedError,
    WouldBlock,
)
from ..transport._zmq import HEARTBEAT_IVL_S, HEARTBEAT_TIMEOUT_S, link_key
from ._cluster import LAST_LINE_SAID, NoHostAnsweredError, RemoteWorkers
from ._daemonclient import DaemonFullError
from ._localworkers import TERM_GRACE_S, _LocalWorkers
from ._protocol import FAILED_END_S, FAILED_SAVE_S, how_worker_ended
from ._restarts import _no_start, _Restarts
from ._signals import received

log = logging.getLogger("reactor.coordinator")
RECONNECT_TIMEOUT_S = 10.0  # a restarted worker starts at the latest this long after it is ready
FAILURE_STOP_S = 3.0  # after a worker failed, how long the others get to run their shutdown reactions
#: A failed worker still there this long past its bound (``FAILED_END_S`` after its failure), writing no
#: checkpoint (its ``("writing", ...)`` words), is held where its bound's thread cannot run (a C call holding
#: the interpreter): it is killed. (Its thread ends it within milliseconds of the bound otherwise.)
HELD_GRACE_S = 2.0
STOPPING_REPORT_S = 5.0  # after a Ctrl-C, how often the workers not yet ended are named
#: After a restart the sums of messages sent and received meet again (the live workers leave their peers'
#: earlier lives out: ``Worker._forget``), but a dead life's message read late can offset one in flight,
#: so they prove nothing. Then the run is quiescent only once every worker has stayed idle, with no count
#: moving, over probe rounds this long: one round alone once ended a loaded run whose learner was waiting
#: for a reply still in flight.
LOST_QUIET_S = 2.0
#: ... with a probe round at most this often meanwhile (a round takes a millisecond: not hundreds of them)
QUIET_PROBE_S = 0.2


#: What a worker does before each message the coordinator gathers at a run's start (its error, when late).
_STARTING = {
    "hello": "starting: its imports, building the app's graph and opening its endpoint",
    "ready": "building its reactors and connecting to its peers",
}


_HELD = "(by the coordinator: held past its bound)"  # how a failed worker _end_held killed ended
_ABANDONED = {"replay_incomplete": None, "stats": {"dropped": 0}, "events": {},
              "digests": {}, "trace": {}}  # a restart the run's end overtook; a worker the run's SIGTERM ended
#: How a worker ends when a SIGTERM reaches it: its own clean exit (128 + 15), killed by it, or of a peer
#: lost to it (3).
_ENDED_BY_SIGTERM = (128 + signal.SIGTERM, -signal.SIGTERM, 3)
#: How long a worker's end by a SIGTERM (:data:`_ENDED_BY_SIGTERM`) waits before it fails the run, for the
#: coordinator's own SIGTERM: a stop of the whole process group or of a Slurm job (``scancel`` signals every
#: process of the job's steps, each node's in its own order) may reach a worker, and the coordinator see its
#: end, before the signal reaches the coordinator. Within this, that worker stopped as asked; past it, alone,
#: it failed.
SIGTERM_GRACE_S = 2.0


def stopping_report(waiting: list[str], received: list[int]) -> str:
    """What a run stopping cleanly after a signal says of the workers it still waits for, naming the
    signal that would stop it at once (``received``: the signals so far; a daemon stops its jobs with
    SIGTERM, a terminal with Ctrl-C)."""
    again = "Ctrl-C" if not received or received[0] == signal.SIGINT else signal.Signals(received[0]).name
    return (f"still stopping: waiting for worker{'s' if len(waiting) > 1 else ''} {', '.join(map(repr, waiting))} "
            f"to end cleanly ({again} again stops at once)")


class _Session:
    def __init__(self, ep: Any, workers: _LocalWorkers | RemoteWorkers, names: list[str],
                 signalled: asyncio.Event, restarts: _Restarts | None = None) -> None:
        self.ep = ep
        self.workers = workers
        self.procs = names
        self.signalled = signalled
        self.restarts = restarts if restarts is not None else _Restarts({}, (), {}, _no_start, None)
        self.status: dict[str, tuple[int, bool, int, int]] = {}
        self.results: dict[str, Any] = {}
        self.epoch = 0
        self.probe_snapshot: tuple[int, int] | None = None
        # (after a restart) when the probe rounds first found everyone idle with these sums, unmoved since
        self.quiet_since: tuple[float, tuple[int, int]] | None = None
        self.lost_quiet_s = LOST_QUIET_S
        self.quiet_probe_s = QUIET_PROBE_S
        self.next_probe_at = 0.0  # (the quiet after a restart: its next probe round, not before)
        self.replay_done: set[str] = set()
        self.ending: dict[str, bool] = {}  # deterministic: worker ended on its own -> events left past the stop
        self.stopped_by: str | None = None
        self.failed: str | None = None  # the worker whose error or refusal ends the run (it waits for "exit")
        self.failed_at = 0.0  # (loop time: when its word came)
        self.failure: str | None = None  # its line (a recorded run's trace keeps it)
        self.traces: dict[str, Any] = {}  # a recording's failed workers: their events ("trace", before their error)
        # Workers' checkpoint writes ("writing" words): those writing now, and when each last stopped.
        self.writing: set[str] = set()
        self.wrote_at: dict[str, float] = {}
        self.failed_lives: dict[str, float] = {}  # failed workers not yet gone -> when their failure came (_held)
        self.killed_held: set[str] = set()
        self.sigterm_ends: dict[str, float] = {}  # workers ended by a SIGTERM, held for SIGTERM_GRACE_S -> since

    @property
    def host_of(self) -> Mapping[str, str]:
        """Each group's host over hosts (its daemon's name, the latest life's); empty on one host."""
        return self.workers.host_of if isinstance(self.workers, RemoteWorkers) else {}

    def _check_children(self) -> None:
        r = self.restarts
        # A restart not started yet is still dead; one started and dead again has ended once more.
        dead = {name: (how[0], how[1] or _HELD) if name in self.killed_held else how
                for name, how in self.workers.dead().items() if name not in self.results and name not in r.down}
        if not dead:
            return
        self.killed_held -= set(dead)  # (its next life is another process)
        for name in dead:
            r.starting.pop(name, None)
            r.awaiting.pop(name, None)
            r.life_ended(name)
        if self.stopped_by == "signal" and signal.SIGTERM in received:
            # The SIGTERM that stops the run reached its workers too (a service manager's stop of the
            # whole group, `kill -- -PGID`; Slurm's scancel, its hosts' daemons with them): a worker it
            # ended, or that lost a peer it ended, stopped as asked, and a host lost meanwhile (rc None:
            # its daemon stopped by it, once its wait for us was over) went as asked: the run ends
            # stopped, not failed.
            for name in [n for n in dead if dead[n][0] in _ENDED_BY_SIGTERM or dead[n][0] is None]:
                log.warning("worker %r %s, as the run stopped on SIGTERM, which reached it too (a stop of the whole "
                            "process group or job): its shutdown reactions may not have run", name,
                            how_worker_ended(*dead.pop(name)))
                self.results[name] = _ABANDONED
            if not dead:
                return
        if self.stopped_by is not None:
            # The run is ending: a restartable group that ends now (say, a new life that never got
            # going) is not started again, and does not fail a run that reached its end.
            for name in [n for n in dead if n in r.restartable]:
                log.warning("worker %r %s while the run was ending; its last life's results are not in the run's",
                            name, how_worker_ended(*dead.pop(name)))
                self.results[name] = _ABANDONED
            if not dead:
                return
        # A refusal's exit status is never restarted (its "refused" message ends the run first; this is for
        # one whose message did not come).
        fatal = {n: how for n, how in dead.items()
                 if self.stopped_by is not None or not r.can_restart(n) or how[0] == REFUSAL_EXIT_STATUS}
        if fatal and self.stopped_by is None and all(how[0] in _ENDED_BY_SIGTERM for how in fatal.values()):
            # Ended by a SIGTERM that may be on its way here too (SIGTERM_GRACE_S): not a failure yet.
            now = time.monotonic()
            if any(now - self.sigterm_ends.setdefault(n, now) < SIGTERM_GRACE_S for n in fatal):
                return
        if fatal:
            notes = "".join(r.why_not(n, refused=fatal[n][0] == REFUSAL_EXIT_STATUS) for n in sorted(fatal))
            raise WorkerFailedError(_describe_exits(fatal) + notes)
        for name, how in sorted(dead.items()):
            self._begin_restart(name, how)

    def _begin_restart(self, name: str, how: tuple[int | None, str], announce: bool = True) -> None:
        """``name`` ended and its policy allows another life: tell the others (unless they know it is
        down already: ``announce``), start it after its backoff."""
        r = self.restarts
        policy = r.groups[name].restart
        k = r.count.get(name, 0)
        ended = how_worker_ended(*how)
        r.ends.setdefault(name, []).append(ended)
        del r.ends[name][:-16]  # (the latest: a run of weeks ends a few hundred times)
        life = r.lives.get(name, 0)  # (the life that ended: its number over the run)
        r.count[name] = k + 1
        r.lives[name] = life + 1
        delay = policy.delay_s(k)
        host = self.workers.host_of.get(name, "") if isinstance(self.workers, RemoteWorkers) else ""
        if how[0] is None and isinstance(self.workers, RemoteWorkers) and host in self.workers.silent_hosts:
            # Lost with a silent host (cut off: its processes may run on): its peers hold its old
            # connections, and so its name, until their heartbeats time out; a new life before that
            # would be refused its name and fail.
            seen = self.workers.last_ok.get(host)
            if seen is not None:
                # (the daemon's last answer may precede the cut by a heartbeat period; zmq checks
                # its timeout once an interval)
                delay = max(delay, seen + HEARTBEAT_TIMEOUT_S + HEARTBEAT_IVL_S + 1.0 - time.monotonic())
        r.due[name] = asyncio.get_running_loop().time() + delay
        self.status.pop(name, None)
        self.probe_snapshot = None
        log.warning("worker %r %s; starting it again in %.1f s (restart %d of at most %d in a row)", name, ended,
                    delay, k + 1, policy.max_restarts)
        if announce:
            self.ep.disconnect(name, linger_s=0)
            self._broadcast(("lost", name, f"worker {name!r} {ended}", life))

    def _advance_restarts(self) -> None:
        """Start the restarts whose backoff is over (each in a task of its own), and take the
        outcomes of the starts that have ended."""
        r = self.restarts
        now = asyncio.get_running_loop().time()
        for name, t in sorted(r.due.items()):
            if self.stopped_by is not None:  # the run ends: this life is not needed
                del r.due[name]
                self.results[name] = _ABANDONED
            elif now >= t:
                del r.due[name]
                r.trying[name] = asyncio.ensure_future(r.start(r.groups[name],
                                                               dict(r.specs[name], restarts=r.lives[name])))
        for name, task in sorted(r.trying.items()):
            if not task.done():
                continue
            del r.trying[name]
            e = task.exception()
            if not isinstance(e, (NoHostAnsweredError, DaemonFullError)):  # (a wait for a host is over)
                r.host_wait.pop(name, None)
            if e is None:
                r.starting[name] = "spawned"  # (a hello kept in r.early is answered by _supervise this round)
                continue
            r.early.pop(name, None)  # (a hello of a start that failed is no one's)
            if not isinstance(e, ReactorError):
                raise e
            elif self.stopped_by is not None:  # the run ends: this life is not needed
                self.results[name] = _ABANDONED
            elif isinstance(e, (NoHostAnsweredError, DaemonFullError)):
                # Its host's daemon may be coming back (a supervisor such as Ray, Kubernetes or
                # systemd starts it again), or a full host's memory be freed (other runs' workers
                # end): ask again, up to host_wait_s; not a restart used.
                self._wait_for_host(name, e)
            else:
                # A host answered but the start failed: a failed life; try again after the next backoff.
                if not r.can_restart(name):
                    raise WorkerFailedError(f"worker {name!r} could not be started again: {e}; its earlier "
                                            f"ends: {'; '.join(r.ends[name])}") from e
                self._begin_restart(name, (None, f"could not be started again: {e}"), announce=False)

    def _wait_for_host(self, name: str, e: NoHostAnsweredError | DaemonFullError) -> None:
        """A restart of ``name`` found none of its candidate hosts answering, or none with the memory
        to start it: ask them again after its policy's retry wait, or end the run once it has waited
        ``host_wait_s``."""
        r = self.restarts
        policy = r.groups[name].restart
        now = asyncio.get_running_loop().time()
        since, tries = r.host_wait.get(name, (now, 0))
        waited = now - since
        if waited >= policy.host_wait_s:
            raise WorkerFailedError(
                f"worker {name!r} could not be started again: no candidate host "
                f"{'answered' if isinstance(e, NoHostAnsweredError) else 'could start it'} within host_wait_s = "
                f"{policy.host_wait_s:g} s ({tries + 1} tries): {e}; its earlier ends: {'; '.join(r.ends[name])}") from e
        delay = min(policy.host_retry_s(tries), policy.host_wait_s - waited)
        r.host_wait[name] = (since, tries + 1)
        if isinstance(self.workers, RemoteWorkers):  # (a job's groups.json: `reactor status JOB` shows it)
            self.workers.waiting[name] = (f"waiting for a host: {waited:.0f} s of at most {policy.host_wait_s:g} s, "
                                          f"{tries + 1} tries")
            self.workers.record_groups()
        r.due[name] = now + delay
        log.warning("worker %r waits for a host: %s; asking again in %.1f s (%.0f s of at most %g s waited; "
                    "restart %d of at most %d in a row)", name, e, delay, waited, policy.host_wait_s, r.count[name],
                    policy.max_restarts)

    def _check_awaiting(self) -> None:
        for group in list(self.restarts.awaiting):
            self._release_if_linked(group)

    async def _restart_message(self, peer: str, msg: Any) -> bool:
        """A restarting worker's ``hello`` or ``ready``; True when ``msg`` was one."""
        r = self.restarts
        step = r.starting.get(peer)
        if step == "spawned" and msg[0] == "hello":
            keys = r.keys
            try:
                await self.ep.connect(peer, msg[1], server_public_key=link_key(keys, msg[1]))
            except PeerLostError as e:  # the new life died at once: _check_children sees its end
                log.warning("could not reach the new life of %r: %s", peer, e)
                return True
            r.book[peer], r.local[peer] = msg[1], msg[2]
            # Groups being restarted themselves are left out: it treats them as down until they
            # are back (it hears "restarted" then).
            self.ep.send_nowait(peer, ("peers", {g: a for g, a in r.book_for(peer, self.host_of).items()
                                                 if g == peer or g not in r.down and r.starting.get(g) != "spawned"}))
            r.starting[peer] = "hello"
            return True
        if step == "hello" and msg[0] == "ready":
            if self.stopped_by is not None:
                self._release(peer)
                return True
            # The others link to it first: what it sends at its start must not find them still
            # treating it as down (a restarted learner's first sample requests were answered into
            # the void that way, and the run stalled).
            r.starting[peer] = "reconnecting"
            r.awaiting[peer] = ({n for n in self.procs if n not in self.results and n not in r.pending},
                                asyncio.get_running_loop().time() + RECONNECT_TIMEOUT_S)
            self._broadcast(lambda n: ("restarted", peer, r.address_for(peer, n, self.host_of), r.lives[peer]),
                            skip=peer, starting=True)
            self._release_if_linked(peer)
            return True
        return False

    def _reconnected(self, peer: str, group: str) -> None:
        waiting = self.restarts.awaiting.get(group)
        if waiting is not None:
            waiting[0].discard(peer)
            self._release_if_linked(group)

    def _release_if_linked(self, group: str) -> None:
        waiting, deadline = self.restarts.awaiting[group]
        waiting &= {n for n in self.procs if n not in self.results and n not in self.restarts.pending}
        if not waiting:
            self._release(group)
        elif asyncio.get_running_loop().time() > deadline:
            log.warning("workers %s did not link to restarted %r within %.0f s; starting it anyway",
                        sorted(waiting), group, RECONNECT_TIMEOUT_S)
            self._release(group)

    def _release(self, group: str) -> None:
        """A restarted worker runs: ``start`` (and ``stop`` when the run is ending)."""
        r = self.restarts
        r.starting.pop(group, None)
        r.awaiting.pop(group, None)
        self.ep.send_nowait(group, ("start",))
        if self.stopped_by is not None:
            self.ep.send_nowait(group, ("stop", self.stopped_by))
        else:
            r.began[group] = time.monotonic()
            log.warning("worker %r is running again (restart %d)", group, r.lives[group])

    def _note(self, peer: str, msg: Any) -> None:
        """What a worker says beside its lifecycle: its events (``trace``, a recording's failed worker or a
        survivor, before its error or shutdown) and its checkpoint writes (``writing``)."""
        if msg[0] == "trace":
            self.traces[peer] = msg[1]
        elif msg[0] == "writing":
            if msg[1]:
                self.writing.add(peer)
            else:
                self.writing.discard(peer)
                self.wrote_at[peer] = asyncio.get_running_loop().time()

    def _end_held(self) -> list[str]:
        """Failed workers held past their bound: their bound's thread (``FAILED_END_S`` after the failure,
        ``_leaving._leave_after``) ends them within milliseconds, or waits while they write a checkpoint (they
        say so: ``writing``); one still there ``HELD_GRACE_S`` later, writing nothing (or ``HELD_GRACE_S``
        after its last write ended), is held where that thread cannot run (a C call holding the interpreter):
        it is killed, and said, here (it was reaped only ``FAILED_SAVE_S`` and more later, 135 s; under a
        restart policy its group's next life waited for it). Over hosts, where no single worker is killed, it
        is named and the run's reaping ends it. Returns those found held now."""
        now = asyncio.get_running_loop().time()
        dead = self.workers.dead()
        held = []
        for name, at in list(self.failed_lives.items()):
            if name in dead:
                del self.failed_lives[name]
                continue
            if name in self.writing or now < max(at + FAILED_END_S, self.wrote_at.get(name, 0.0)) + HELD_GRACE_S:
                continue
            del self.failed_lives[name]
            held.append(name)
            killed = self.workers.kill(name)
            if killed:
                self.killed_held.add(name)
            log.warning("worker %r did not leave by its bound (%g s after its failure, %g s ago) and writes no "
                        "checkpoint: it is held where its bound cannot end it (a call in C that holds the "
                        "interpreter); %s", name, FAILED_END_S, now - at - FAILED_END_S,
                        "killed (SIGKILL)" if killed else "the run's reaping ends it")
        return held

    async def _batch(self) -> list[tuple[str, Any]]:
        batch = await self.ep.recv_batch(timeout_s=0.2)
        for peer, msg in batch:
            self._note(peer, msg)
        self._end_held()
        for peer, msg in batch:
            if msg[0] in ("refused", "error"):
                # (a result in the same batch is kept: the others' stop waited FAILURE_STOP_S for it)
                self.results.update((p, m[1]) for p, m in batch if m[0] == "done")
                # It waits for our "exit" to leave: at once for a restart, else once the others were told.
                self.failed = peer
                self.failed_at = self.failed_lives[peer] = asyncio.get_running_loop().time()
                if self.stopped_by is None and self.restarts.can_restart(peer):
                    if msg[0] == "refused":
                        # Not restarted (docs/reliability.md, "Refusals are not restarted"): a new life is given
                        # the same settings and files, and refuses again (a refusal from data at run time
                        # after a life past reset_after_s restarted for good, the cause only in this log).
                        log.warning("worker %r refused the run: not started again (a restart policy covers "
                                    "failures; a refusal is what the run was given, and comes again)", peer)
                    else:
                        log.warning("worker %r failed (it will be started again):\n%s", peer, msg[1])
                        self.failed = None
                        with contextlib.suppress(Exception):
                            self.ep.send_nowait(peer, ("exit",))
                        continue
                for other, m in batch:  # (the run's error is this one's: the others' are said)
                    if other != peer and m[0] in ("refused", "error"):
                        self._also_failed(other, m)
            if msg[0] == "refused":  # what the run was given: the same class and line as under `single`
                self.failure = f"{msg[1]}: {msg[2].splitlines()[0] if msg[2] else ''}"
                raise REFUSAL_NAMES[msg[1]](msg[2])
            if msg[0] == "error":
                self.failure = msg[1].splitlines()[0] if msg[1] else "an error"
                if msg[1].startswith("PeerLostError"):
                    # It lost a peer: name the peer's end first when it shows within the time
                    # its death takes to be seen (a remote one's, a heartbeat or two).
                    end = asyncio.get_running_loop().time() + self.workers.settle_s
                    while asyncio.get_running_loop().time() < end:
                        dead = {n: how for n, how in self.workers.dead().items() if n not in self.results and n != peer}
                        if dead:
                            first = msg[1].splitlines()[0]
                            raise WorkerFailedError(f"{_describe_exits(dead)}; then worker {peer!r} failed: {first}")
                        await asyncio.sleep(0.02)
                raise WorkerFailedError(f"worker {peer!r} failed:\n{msg[1]}")
        return batch

    async def gather(self, what: str, timeout_s: float) -> dict[str, Any]:
        """Every worker's ``what`` message (``"hello"``, ``"ready"``): peer -> its fields.

        Raises:
            WorkerFailedError: a worker died first, or some did not send it within ``timeout_s``
                (named, with what they were doing).
        """
        got: dict[str, Any] = {}
        try:
            async with asyncio.timeout(timeout_s):
                while len(got) < len(self.procs):
                    if self.signalled.is_set():
                        raise KeyboardInterrupt
                    self._check_children()
                    if self.restarts.pending:  # a worker died before the run started: no restart then
                        name = sorted(self.restarts.pending)[0]
                        raise WorkerFailedError(f"worker {name!r} {self.restarts.ends[name][-1]} before the run "
                                                f"started (restart policies start again only what had started)")
                    for peer, msg in await self._batch():
                        if msg[0] == what:
                            got[peer] = msg[1:]
        except TimeoutError:
            late = sorted(set(self.procs) - set(got))
            doing = _STARTING.get(what, f"sending {what!r}")
            raise WorkerFailedError(
                f"worker{'s' if len(late) > 1 else ''} {', '.join(map(repr, late))} did not finish {doing} within "
                f"{timeout_s:g} s of being asked; the run was stopped before it started"
            ) from None
        return got

    async def supervise(self, deadline: float | None) -> tuple[str, dict[str, Any]]:
        """Run the run to its end (see the module docstring); a worker lost meanwhile ends it with
        ``WorkerFailedError`` naming the worker and how it ended, unless its restart policy starts
        it again."""
        try:
            try:
                return await self._supervise(deadline)
            except PeerLostError as e:
                # Our link to a worker went down (a probe or a stop found it gone): its process has
                # died or is dying. Name it by its exit, the first to die first, not by the link.
                loop = asyncio.get_running_loop()
                end = loop.time() + 5.0
                while loop.time() < end:
                    self._check_children()
                    await asyncio.sleep(0.02)
                raise WorkerFailedError(f"lost a worker: {e}") from e
        except (WorkerFailedError, *REFUSALS):  # (a refusal: a worker's, raised as its class)
            await self._stop_survivors()
            raise
        finally:
            await self.restarts.end_tries()

    async def _stop_survivors(self) -> None:
        """A worker failed and the run ends: the others are told why and given ``FAILURE_STOP_S`` to
        run their shutdown reactions (a node's last checkpoint and summary, saying that the run
        failed) before the reaping's SIGTERM ends any that have not."""
        self.stopped_by = self.stopped_by or "failure"  # (a stop under way keeps its reason)
        self.ep.expect_departures()
        self._broadcast(("stop", "failure"))
        dead = self.workers.dead()
        live = {n for n in self.procs if n not in self.results and n not in dead and n not in self.restarts.down
                and n != self.failed}
        told: set[str] = set()  # done, then told "exit": waited for (briefly) before the reaping
        loop = asyncio.get_running_loop()
        end = loop.time() + FAILURE_STOP_S
        # A survivor writing a checkpoint (its final one: what the run learned since the last) is waited for, up
        # to FAILED_SAVE_S more, as a failed worker's is (it got FAILURE_STOP_S, then the reaping's TERM_GRACE_S,
        # and a slower write was cut); one that writes nothing by FAILURE_STOP_S is reaped as before.
        save_end = end + FAILED_SAVE_S

        def waited_for(now: float) -> bool:
            """A survivor still writing is, and one whose write ended: FAILURE_STOP_S more from its end, for the
            rest of its shutdown (it was cut between its write's end and its result)."""
            return any(p in self.writing or now < self.wrote_at.get(p, -math.inf) + FAILURE_STOP_S for p in live)

        while live and (loop.time() < end or (waited_for(loop.time()) and loop.time() < save_end)):
            try:
                batch = await self.ep.recv_batch(timeout_s=0.1)
            except Exception:  # noqa: BLE001 - a link going down as the run ends changes nothing here
                break
            for peer, msg in batch:
                self._note(peer, msg)
                if msg[0] == "done":
                    self.results[peer] = msg[1]  # (a recorded run's trace up to the failure takes its events)
                    live.discard(peer)
                    told.add(peer)
                elif msg[0] in ("refused", "error"):  # another failure (in its shutdown, say): said, let go
                    self._also_failed(peer, msg)
                    live.discard(peer)
            live -= set(self.workers.dead())
        # Those that ended cleanly leave now, on their own (STOPPED_FOR_FAILURE_STATUS), not at the reaping's
        # SIGTERM (143: it read as if they had failed too); all at once, once none is still stopping: one told
        # as soon as it was done left while a slower one still sent it its last words, which then failed too.
        for peer in sorted(told):
            with contextlib.suppress(Exception):
                self.ep.send_nowait(peer, ("exit",))
        if self.failed is not None:  # (last: the others have heard why first)
            with contextlib.suppress(Exception):
                self.ep.send_nowait(self.failed, ("exit",))
            told.add(self.failed)
        # The failed worker's own shutdown reactions ran meanwhile; it leaves once they end, and by its own
        # bound at the latest (FAILED_END_S after its failure; while it writes a checkpoint then, FAILED_SAVE_S
        # more: _leaving._leave_after), which it is given: the reaping's SIGKILL came 5 s past FAILURE_STOP_S and
        # cut a slow final checkpoint (what the failed life learned since its last one). Those told "exit"
        # are given a moment to be gone before the reaping.

        # One held where its bound's thread cannot run is killed HELD_GRACE_S past its bound (_end_held).
        until = max(end, loop.time() + 1.0)  # (once: a bound re-read each round never came)
        failed_until = until if self.failed is None else max(
            until, self.failed_at + FAILED_END_S + FAILED_SAVE_S + TERM_GRACE_S)  # (the last: its thread's leeway)
        while True:
            left, now = told - set(self.workers.dead()), loop.time()
            if not left or now >= failed_until or (now >= until and self.failed not in left):
                break
            if self.failed in self._end_held() and self.failed not in self.killed_held:
                break  # (over hosts: the reaping ends it)
            try:
                for peer, msg in await self.ep.recv_batch(timeout_s=0.02):
                    self._note(peer, msg)  # (the failed worker's writes)
            except Exception:  # noqa: BLE001 - a link going down as the run ends changes nothing here
                await asyncio.sleep(0.02)
        ended = self.workers.dead()
        for name in sorted(self.procs):  # (-v: how each ended, or that the reaping ends it)
            log.info("worker %r %s%s", name, how_worker_ended(*ended[name]) if name in ended else
                     "has not ended: the reaping stops it",
                     f" {_HELD}" if name in self.killed_held else "")

    def _also_failed(self, peer: str, msg: Any) -> None:
        """A worker's failure after the one that ends the run: logged (it was lost), and let go."""
        log.error("worker %r failed too: %s", peer, msg[2] if msg[0] == "refused" else msg[1])
        with contextlib.suppress(Exception):
            self.ep.send_nowait(peer, ("exit",))

    def _stop(self, why: str) -> None:
        self.stopped_by = why
        self.ep.expect_departures()
        self._broadcast(("stop", why))

    async def _supervise(self, deadline: float | None) -> tuple[str, dict[str, Any]]:
        loop = asyncio.get_running_loop()
        told_at = None  # (a stop by a signal: when the user was last told what it waits for)
        while len(self.results) < len(self.procs):
            if self.signalled.is_set() and self.stopped_by is None:
                self._stop("signal")
                told_at = loop.time()
            if self.stopped_by == "signal" and told_at is not None and loop.time() - told_at >= STOPPING_REPORT_S:
                # A worker may not hear the stop for a while (a reaction blocked in C: a rendezvous,
                # a long update): say which, rather than sit silent after "stopping the run cleanly".
                told_at = loop.time()
                waiting = sorted(n for n in self.procs if n not in self.results)
                log.warning("%s", stopping_report(waiting, received))
            if deadline is not None and self.stopped_by is None and loop.time() >= deadline:
                self._stop("stop_time")
            self._check_children()
            self._advance_restarts()
            for peer in [p for p in self.restarts.early if self.restarts.starting.get(p) == "spawned"]:
                await self._restart_message(peer, self.restarts.early.pop(peer))
            self._check_awaiting()
            for peer, msg in await self._batch():
                kind = msg[0]
                if peer in self.restarts.trying and kind == "hello":
                    # The new life's hello beat its start's task being taken: kept until it is (it was
                    # dropped, no address book was ever sent, and the restarted worker waited forever).
                    self.restarts.early[peer] = msg
                    continue
                if peer in self.restarts.starting and await self._restart_message(peer, msg):
                    continue
                if kind == "reconnected":
                    self._reconnected(peer, msg[1])
                elif kind == "done":
                    self.results[peer] = msg[1]
                elif kind == "status":
                    if peer not in self.restarts.pending:
                        self.status[peer] = (msg[1], msg[2], msg[3], msg[4])
                elif kind == "stop_request" and self.stopped_by is None:
                    self._stop("request")
                elif kind == "ending":
                    self.ending[peer] = msg[1]
                    self.status[peer] = (self.epoch, True, msg[2], msg[3])  # (final: it is not probed again)
                    if self.stopped_by is None and all(n in self.ending or n in self.results for n in self.procs):
                        self._stop("stop_time" if any(self.ending.values()) else "quiescence")
                elif kind == "replay_done":
                    self.replay_done.add(peer)
                    if len(self.replay_done) == len(self.procs) and self.stopped_by is None:
                        self._stop("replay")
            if self.stopped_by is None and self._quiescent():
                self._stop("quiescence")
        # (Set by now on every path: a worker that ended on its own waited for the coordinator's verdict,
        # the union of every worker's "ending", before it sent its result.)
        return self.stopped_by or "quiescence", self.results

    def _quiescent(self) -> bool:
        if self.restarts.pending:
            self.quiet_since = None  # (a restart under way: the quiet after it starts when it is done)
            return False
        # (A deterministic worker that ended on its own waits for the run's reason: idle for good, its
        # final counts in its status, it answers no probe.)
        live = [n for n in self.procs if n not in self.results and n not in self.ending]
        if self.results and len(self.results) == len(self.procs):
            return False
        st = self.status
        if len(st) < len(self.procs) or not all(st[n][1] for n in live):
            self.probe_snapshot = self.quiet_since = None
            return False
        sent = sum(s[2] for s in st.values())
        received = sum(s[3] for s in st.values())
        # After a restart the sums meet again (a dead life's counts left with its status, and each
        # worker leaves its peers' earlier lives out of its own: Worker._forget), but they are no proof:
        # a dead life's message read after its new life linked (a peer's queue deep, its loop held) is
        # one received that no live count sent, and it can offset one in flight. So after a restart
        # every worker idle and the counts unchanged over probe rounds for lost_quiet_s is quiescence.
        if sent != received and not self.restarts.lives:
            self.probe_snapshot = None
            return False
        if self.probe_snapshot is None or not all(st[n][0] == self.epoch for n in live):
            if self.probe_snapshot is None:
                if self.quiet_since is not None and time.monotonic() < self.next_probe_at:
                    return False
                self.epoch += 1
                self.probe_snapshot = (sent, received)
                for n in live:
                    try:
                        self.ep.send_nowait(n, ("probe", self.epoch))
                    except (PeerLostError, WouldBlock):
                        # It died (_check_children says how), or it has not taken what we sent it
                        # (a host cut off, not yet declared lost): not quiet; probe again later.
                        self.probe_snapshot = None
                        return False
            return False
        if self.probe_snapshot == (sent, received):
            if self.restarts.lives:
                # The sums cannot prove that no message is in flight now (above): the same quiet over
                # probe rounds for lost_quiet_s, not one round, ends the run.
                now = time.monotonic()
                if self.quiet_since is None or self.quiet_since[1] != (sent, received):
                    self.quiet_since = (now, (sent, received))
                if now - self.quiet_since[0] < self.lost_quiet_s:
                    self.probe_snapshot = None  # probe again, in a while
                    self.next_probe_at = now + self.quiet_probe_s
                    return False
                if sent > received:  # (equal sums, the rule since Worker._forget, say nothing)
                    log.warning("the run went quiet with %d messages sent and never received (after a restart: "
                                "a peer may wait on one of them)", sent - received)
                elif received > sent:
                    log.warning("the run went quiet; %d more messages were received than counted as sent (after a "
                                "restart: a dead life's, delivered once its new life was linked)", received - sent)
            return True
        # Messages moved between the probe and its answers (sums equal again, but not the ones
        # probed): probe again. Keeping the stale snapshot here hung the run forever; and at once: every
        # worker said it is idle, so none may say more, and the next look waited out a batch's 0.2 s.
        self.probe_snapshot = None
        return self._quiescent()

    def _broadcast(self, msg: Any, skip: str | None = None, starting: bool = False) -> None:
        """Send ``msg`` to every live worker but ``skip``; with ``starting``, also to restarting
        ones that have their address book (they take it once started). A callable ``msg`` is
        called with each recipient's name for its message."""
        r = self.restarts
        pending = r.down | {g for g, step in r.starting.items() if not starting or step == "spawned"}
        for n in self.procs:
            if n not in self.results and n not in pending and n != skip:
                with contextlib.suppress(Exception):
                    self.ep.send_nowait(n, msg(n) if callable(msg) else msg)


def _describe_exits(dead: dict[str, tuple[int | None, str]]) -> str:
    """Say which workers ended early and how, the first cause first: a worker lost with its host,
    then one killed by a signal (its peers then exit because they lost it), before one that exited
    with a status of its own. Each ``(exit status or None, where)``; a lost one's ``where`` says how."""
    def rank(n: str) -> tuple[bool, bool, bool, str]:
        rc = dead[n][0]
        return (rc is not None, rc is not None and rc >= 0, rc == 3, n)

    quoted: set[str] = set()

    def how(n: str) -> str:  # (a worker's last line on its host, quoted once: every worker of a run may fail alike)
        rc, where = dead[n]
        head, said, line = where.partition(LAST_LINE_SAID)
        if said and line in quoted:
            where = f"{head} (the same last line)"
        elif said:
            quoted.add(line)
        return how_worker_ended(rc, where)

    order = sorted(dead, key=rank)
    first, rest = order[0], order[1:]
    text = f"worker {first!r} {how(first)} before the run ended"
    if rest:
        text += "; then " + ", ".join(f"worker {n!r} {how(n)}" for n in rest)
    return text
