"""The data-parallel side of the learners (``--placement dp-learners``): how a bank of replicas meets,
starts alike and averages its gradients.

:class:`_LearnerBank` (the base of :class:`~reactor.nodes._learnerstate._LearnerBase`) meets the bank's
other replicas in a life of the bank (:func:`_meet_bank`: the rendezvous store outlives their processes,
so each life has keys of its own), forms the ``torch.distributed`` group (gloo; NCCL with a GPU per
replica) and gives every replica replica 0's whole state (:meth:`_LearnerBank._share_state`, as codec
frames: nothing unpickled), averages every optimizer step's gradients
over the bank in an all-reduce (which a replica missing for ``DP_TIMEOUT_S`` fails, and one gone with
the run ends at once), and tells the bank when this replica leaves. The rounds in which the replicas update, and why, are the
:class:`~reactor.nodes.learner.Learner`'s (its module docstring tells the whole).

Every wait on the rendezvous store and on the other replicas until the bank has met and formed (the
store's connect, the meeting's polls, the group's forming, the watch on the bank's life) runs on threads of
its own that the run's loop awaits (:func:`_await_threads`): a store that is slow or gone, or a replica
that hangs, held the loop in C, and every reaction of the process with it (its coordinator's stop, its
peers' connects).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import PeerLostError
from .._reactor import Reactor
from ..launch._rundir import rendezvous_file

#: Seconds a data-parallel learner waits for the other replicas in one gradient all-reduce (gloo;
#: with NCCL its watchdog enforces it by aborting the process).
DP_TIMEOUT_S = 60.0
#: Seconds the replicas may start apart (rendezvous and the initial weight broadcast).
DP_JOIN_TIMEOUT_S = 600.0
#: Seconds between a waiting replica's "still waiting for the others to join" lines.
DP_WAIT_REPORT_S = 10.0
#: Seconds between a waiting all-reduce's checks for a replica that left with the run.
DP_POLL_S = 0.1


class _RunStopping(Exception):
    """The run stopped (a replica refused or failed at its start, a Ctrl-C) while this replica waited for
    the others to meet its bank (``_meet_bank``)."""


class _BankLeft(Exception):
    """Another data-parallel replica left the bank with the run (``left``: index -> its updates)."""

    def __init__(self, left: dict[int, int]) -> None:
        super().__init__(f"replica(s) {sorted(left)} left the bank with the run")
        self.left = left


def _say(line: str) -> None:
    """``line`` on stdout in one write: the replicas of a bank share a terminal, and print's two
    writes (text, then the newline) let their lines run into each other."""
    import sys

    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class _LearnerBank(Reactor):
    """A learner's data-parallel bank (``bank_size > 1``). Its methods read what the learner's base
    holds (:class:`~reactor.nodes._learnerstate._LearnerBase`): ``state``, ``algo``, ``updates``,
    ``device``, ``torch_device`` and ``run_dir``."""

    #: Data-parallel, once its bank met (``_join_bank``): the bank's life, and each replica's process life
    #: there (None before: a death heard meanwhile is no bank's it joined).
    dp_life = 0
    dp_members: dict[int, int] | None = None

    async def _join_bank(self) -> bool:
        """Data-parallel, after :meth:`_setup`: meet the bank's other replicas in this life of the
        bank, make its ``torch.distributed`` group, and take replica 0's state (:meth:`_share_state`).
        The store's connect and the meeting run on a thread the loop awaits (polls), so this process
        answers its peers and the coordinator meanwhile: a replica started again whose loop a blocking wait
        held answered no connect of the bank's other new lives, which waited out the connect's 10 s
        timeout, and the coordinator another 10 s for it to link to them; a store that did not answer held
        it up to the store's timeout (a TCP connect taken and never answered: for good; the connect's wait
        is bounded by ``DP_TIMEOUT_S`` where it is awaited). The group's forming and the state's
        broadcast, which wait in C, run on a thread the loop awaits too (:meth:`_await_bank_thread`), so a
        stop is heard while any of them waits.

        Returns False when the bank cannot meet or form: the run is ending (its coordinator's stop, heard in
        async runs), or, in a deterministic run (whose worker takes no message while a reaction runs, and
        which restarts nothing), a replica that has not come left (it refused or failed at its start:
        :meth:`_leave_unmet_bank`). The others used to wait ``DP_JOIN_TIMEOUT_S`` for it, held past the
        run's end until the reaping's SIGTERM, and then saved a checkpoint of no update over the run's.
        A replica that never met its bank saves nothing at its shutdown (:meth:`_finish_files`).

        The rendezvous store (a file in the run directory, or the TCP store the run's coordinator
        serves over hosts) outlives the replicas' processes, so every life of the bank gets keys of its
        own: the replicas first agree on a life number (:func:`_meet_bank`), then make their group in
        that life's prefix. (One prefix for all lives had a restarted replica's gloo connect to the
        address a killed replica had published in the life before, and the bank never met again.)
        """
        import torch
        import torch.distributed as dist

        params = [p for opt in _optimizers(self.state) for g in opt.param_groups for p in g["params"]]
        # NCCL when every replica holds CUDA tensors on a GPU of its own; gloo otherwise (CPU learners,
        # a CPU learner on a GPU machine, or replicas sharing a GPU, which NCCL refuses: gloo reduces
        # CUDA tensors through the host).
        own_gpu = self.device == "cuda" and torch.cuda.device_count() >= self.bank_size  # (cuda:N: all on one)
        backend = "nccl" if own_gpu and any(p.is_cuda for p in params) else "gloo"
        self.dp_backend = backend
        where = self._bank_where()
        # Until every replica has joined, nothing trains and the actors wait for the first weights:
        # say so, and keep saying so, rather than sit silent at 0 env steps.
        waiting = _Waiting(f"{self.name}: waiting for the other {self.bank_size - 1} data-parallel learner(s) to join "
                           f"(rendezvous: {where}; no env steps until they do; a learner that has not joined in "
                           f"{DP_JOIN_TIMEOUT_S:.0f} s ends the run)")

        def stopping() -> bool:
            return self.stopped_by is not None

        try:
            try:
                bank = await _await_threads([lambda over: self._open_bank(self.bank_size)], self.name, stopping,
                                            DP_TIMEOUT_S, f"{self.name}: the run's rendezvous store ({where}) did "
                                                          f"not answer within {DP_TIMEOUT_S:.0f} s")
                life, members = await _meet_bank(bank, self.bank_index, self.bank_size, self.restarts, self.name,
                                                 where, stopping, left_watch=self.deterministic)
                self.dp_life = life
                self._dp_store = dist.PrefixStore(f"group/{life}", bank)
                # Every replica has come to this life: the group forms at once, unless one died since it came
                # (its new life makes the next, which _await_bank_thread sees) or hangs. Its forming and replica
                # 0's state wait on the others in C, up to DP_TIMEOUT_S: on a thread of their own, so that this
                # process's loop answers its coordinator and its peers meanwhile, and a stop is heard.
                await self._await_bank_thread(lambda: self._form_group(backend, waiting), life)
            except _RunStopping as e:
                why = f"the run is ending ({self.stopped_by})" if self.stopped_by is not None else str(e)
                _say(f"{self.name}: {why} before all {self.bank_size} data-parallel learners joined: this one leaves "
                     f"without learning, and saves nothing")
                return False
            self.dp_members = members  # (only now: a replica whose group never formed saves nothing)
        finally:
            waiting.stop.set()
        return True

    def _form_group(self, backend: str, waiting: _Waiting) -> None:
        """On the bank's thread (:meth:`_await_bank_thread`): make this life's ``torch.distributed`` group, and
        take replica 0's state (:meth:`_share_state`). The group's process-wide state is torch's own, so the
        learner's updates all-reduce in it from the loop's thread (gloo's and NCCL's work runs on threads of
        their own; NCCL's communicators are keyed by the tensors' device, set here for this thread).

        Raises:
            PeerLostError: the group did not form (naming the replicas that never began to form it), or the
                state did not arrive: a replica died or hung (torch's error after ``DP_TIMEOUT_S``, or a
                closed connection)."""
        import torch
        import torch.distributed as dist

        if self.torch_device.type == "cuda":
            torch.cuda.set_device(self.torch_device)
        store, life = self._dp_store, self.dp_life
        store.set(f"forming/{self.bank_index}", "1")
        try:
            dist.init_process_group(backend, store=store, rank=self.bank_index, world_size=self.bank_size,
                                    timeout=datetime.timedelta(seconds=DP_TIMEOUT_S))
            # The updates' all-reduces get their own group with the short timeout.
            self._dp_group = dist.new_group(timeout=datetime.timedelta(seconds=DP_TIMEOUT_S))
        except RuntimeError as e:  # (torch's DistError and gloo's timeouts are RuntimeErrors)
            others = [j for j in range(self.bank_size) if j != self.bank_index]
            absent = [j for j in others if not store.check([f"forming/{j}"])]
            who = (f"data-parallel learner(s) {absent} met the bank and never began to form it" if absent else
                   f"a data-parallel learner of {others} died or hung while it formed")
            raise PeerLostError(f"{self.name}: the torch.distributed group of the bank's life {life} did not form "
                                f"({who}): {_first_line(e)}") from e
        if life:  # (said at once: a bank that started again says so)
            waiting.stop.set()
            _say(f"{self.name}: all {self.bank_size} data-parallel learners joined the bank's life {life}")
        else:
            waiting.done(f"{self.name}: all {self.bank_size} data-parallel learners joined")
        print(f"{self.name}: data-parallel over {backend}, {self.bank_size} replicas, this one on {self.torch_device}",
              flush=True)
        self._share_state()

    async def _await_bank_thread(self, work: Any, life: int) -> None:
        """Run ``work`` (the group's forming, which waits on the other replicas in C) on a daemon thread,
        and await it here (:func:`_await_threads`), with a second thread watching, every ``DP_POLL_S``,
        what the forming cannot hear:

        * the run is ending (its coordinator's stop, heard in async runs; the loop checks it):
          :class:`_RunStopping`;
        * a replica that came to ``life`` started again (it died, and its new life moved the bank's life
          on: the group waits for it in vain until ``DP_TIMEOUT_S``): :class:`PeerLostError` naming it, at
          once, so this replica's restart policy starts it again in the bank's new life;
        * in deterministic runs (whose worker hears no stop while a reaction runs), another replica said it
          left without joining (``gone/<i>``: :meth:`_leave_unmet_bank`): :class:`_RunStopping`.

        A cancellation (the worker's SIGTERM) ends the wait too. The forming's thread cannot be stopped: it
        is left to end with the process (a daemon, waited for by nothing; what it ends with is dropped),
        and this replica saves nothing (:meth:`_finish_files`: its ``dp_members`` stays None). The watch
        uses a store client of its own (the forming's waits hold theirs: a TCP store's client takes one
        request at a time), on its thread: its connect and its requests wait on the store too.

        Raises:
            _RunStopping, PeerLostError: as above; and whatever ``work`` raised.
        """

        def watch(over: threading.Event) -> None:
            store = self._open_bank(-1)  # (-1: not one of the file's users)
            while not over.wait(DP_POLL_S):
                if int(store.add("life", 0)) > life:
                    again = [j for j in range(self.bank_size) if j != self.bank_index
                             and store.check([f"joined/{j}"]) and int(store.get(f"joined/{j}")) > life]
                    raise PeerLostError(
                        f"{self.name}: data-parallel learner(s) {again or '?'} of the bank's life {life} started again "
                        f"while its torch.distributed group formed (its process died); a bank starts again whole, so "
                        f"this replica ends too, for its restart policy to start it again")
                if self.deterministic and (gone := [j for j in range(self.bank_size) if j != self.bank_index
                                                    and store.check([f"gone/{j}"])]):
                    raise _RunStopping(f"data-parallel learner(s) {gone} left while the bank's group formed")

        await _await_threads([lambda over: work(), watch], self.name, lambda: self.stopped_by is not None)

    def _bank_where(self) -> str:
        """Where the bank's replicas meet, in words (the run's TCP store over hosts, else its file)."""
        served = os.environ.get("REACTOR_DIST_STORE")
        return f"tcp store {served}" if served else f"file {self._bank_file()}"

    def _bank_file(self) -> Path:
        return rendezvous_file(self.run_dir, self.run_id)  # (one host's: its coordinator removes it at the run's end)

    def _open_bank(self, users: int) -> Any:
        """The bank's rendezvous store, under its prefix: the TCP store the run's coordinator serves over
        hosts, else a file in the run directory (``users``: ``FileStore``'s count of the processes that
        use it, the last of which removes the file; -1: not counted). Blocks while a TCP store does not
        answer, up to ``DP_JOIN_TIMEOUT_S``: called on a thread (:func:`_await_threads`), but at shutdown.

        Raises:
            PeerLostError: the TCP store did not answer (naming this replica and the store's address)."""
        import torch.distributed as dist

        served = os.environ.get("REACTOR_DIST_STORE")
        if served:  # over hosts: the TCP store the run's coordinator serves
            host, port = served.rsplit(":", 1)
            try:
                store = dist.TCPStore(host, int(port), is_master=False,
                                      timeout=datetime.timedelta(seconds=DP_JOIN_TIMEOUT_S))
            except RuntimeError as e:  # (torch's DistNetworkError and timeouts are RuntimeErrors)
                raise PeerLostError(f"{self.name}: the run's rendezvous store (tcp store {served}, served by its "
                                    f"coordinator) did not answer: {_first_line(e)}") from e
        else:  # one host: a file in the run directory
            if not self.run_dir:
                raise ValueError("data-parallel learners need run_dir (the rendezvous file lives there)")
            path = self._bank_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            # The store itself, not a file:// URL: a relative run_dir ("runs/...", the apps' default)
            # made "file://runs/..." name "/..." (the URL's host swallowed the first part) and every
            # replica waited there for the join timeout.
            store = dist.FileStore(str(path), users)
        return dist.PrefixStore(f"{self.run_id}/{self.name.split('[')[0]}", store)

    def _leave_unmet_bank(self) -> None:
        """At shutdown (data-parallel), a replica that never met its bank (it refused or failed at its
        start, or the run ended first) says so in the rendezvous store (``gone/<i>``), where a deterministic
        run's replicas waiting for it look (:func:`_meet_bank`): their worker hears no stop while they wait."""
        if not self.deterministic or self.bank_size < 2 or self.dp_members is not None:
            return
        try:
            self._open_bank(-1).set(f"gone/{self.bank_index}", str(self.restarts))  # (-1: not one of its users)
        except (RuntimeError, OSError, ValueError) as e:  # (no run_dir, the store's host gone: they time out)
            logging.getLogger("reactor.learner").warning("%s could not tell the bank it left: %s", self.name, e)

    def _share_state(self) -> None:
        """Data-parallel, once joined: replica 0's whole state (what ``learner.pt`` holds: networks,
        optimizers, the algorithm's counters, and its update count) goes to the other replicas, which
        take it over theirs; then every optimizer step averages the gradients over the bank.

        So the replicas start every life alike, whatever each resumed from: over hosts only replica 0's
        run directory holds ``learner.pt``, and on one host a replica started again may read the file
        before the one replica 0's last life saves at its end replaces it. (Sharing the parameters only,
        as the bank did before, left each replica's optimizer moments, target networks and update count
        its own after a restart: the replicas drifted apart.)

        The state travels as reactor's codec frames (msgpack and raw tensor bytes), never pickled: the
        gloo link between hosts is plain TCP (docs/cluster.md), and what crosses a socket is decoded, with
        its types and sizes checked, not unpickled."""
        import torch
        import torch.distributed as dist

        from ..transport.codec import decode, encode

        # (NCCL moves CUDA tensors only; gloo takes the host's)
        on = self.torch_device if self.dp_backend == "nccl" else torch.device("cpu")
        count = torch.zeros(1, dtype=torch.int64, device=on)
        sizes = blob = None
        if self.bank_index == 0:
            frames = [bytes(f) for f in encode(_on_cpu({"algo": self.algo.state_dict(self.state),
                                                         "updates": self.updates}))]
            count[0] = len(frames)
            sizes = torch.tensor([len(f) for f in frames], dtype=torch.int64, device=on)
            blob = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8).to(on)

        def broadcast(tensor: Any) -> None:
            try:
                dist.broadcast(tensor, src=0)
            except RuntimeError as e:  # (a replica died or hung: torch's error after DP_TIMEOUT_S, or a closed link)
                raise PeerLostError(f"{self.name}: replica 0's state did not reach the bank's life {self.dp_life} (a "
                                    f"replica died or hung): {_first_line(e)}") from e

        broadcast(count)
        if sizes is None:
            sizes = torch.empty(int(count.item()), dtype=torch.int64, device=on)
        broadcast(sizes)
        lengths = sizes.cpu().tolist()
        if blob is None:
            blob = torch.empty(sum(lengths), dtype=torch.uint8, device=on)
        broadcast(blob)
        if self.bank_index != 0:
            data = blob.cpu().numpy().tobytes()
            ends = np.cumsum([0, *lengths])
            saved = decode([data[ends[i]:ends[i + 1]] for i in range(len(lengths))], max_nbytes=len(data) + 1)
            self.algo.load_state_dict(self.state, saved["algo"])
            self.updates = int(saved["updates"])
            if self.updates:
                _say(f"{self.name} took {self.name.split('[')[0]}[0]'s state at update {self.updates}")
        world = float(self.bank_size)
        for opt in _optimizers(self.state):
            step = opt.step

            def averaged_step(*args: Any, _opt: Any = opt, _step: Any = step, **kwargs: Any) -> Any:
                grads = [p.grad for g in _opt.param_groups for p in g["params"] if p.grad is not None]
                if grads:
                    flat = torch.cat([t.reshape(-1) for t in grads])
                    self._all_reduce(flat, "gradient")
                    flat /= world
                    offset = 0
                    for t in grads:
                        t.copy_(flat[offset : offset + t.numel()].view_as(t))
                        offset += t.numel()
                return _step(*args, **kwargs)

            opt.step = averaged_step  # type: ignore[method-assign]

    def _all_reduce(self, tensor: Any, what: str) -> None:
        """Sum ``tensor`` over the replicas in place (data-parallel).

        Waits in slices of ``DP_POLL_S``: between them, a replica that left the bank with the run
        (``_leave_bank``: the run stopped, on an evaluation target say, before it reached this
        update) raises :class:`_BankLeft` at once.

        Raises:
            _BankLeft: another replica left with the run.
            PeerLostError: another replica did not join within ``DP_TIMEOUT_S`` (it died or hung),
                or its connection broke (at once: said so, not as a timeout).
        """
        import time

        import torch.distributed as dist

        if self.dp_backend != "gloo":  # NCCL's wait orders the GPU's stream; a slice's timeout is not the CPU's
            try:
                dist.all_reduce(tensor, group=self._dp_group)
            except RuntimeError as e:
                raise PeerLostError(f"{self.name}: the {what} all-reduce of update {self.updates + 1} failed "
                                    f"(a replica died, hung or stopped): {str(e).splitlines()[0] if str(e) else e!r}"
                                    ) from e
            return
        work = dist.all_reduce(tensor, group=self._dp_group, async_op=True)
        deadline = time.monotonic() + DP_TIMEOUT_S
        slice_ = datetime.timedelta(seconds=DP_POLL_S)
        while True:
            try:
                work.wait(timeout=slice_)
                return
            except RuntimeError as e:  # this slice's timeout, gloo's own, or a peer's closed connection
                left = self._bank_left()
                if left:
                    raise _BankLeft(left) from None
                if "timed out" not in str(e).lower():  # (a peer's closed connection: at once, not after a timeout)
                    raise PeerLostError(
                        f"{self.name}: the {what} all-reduce of update {self.updates + 1} failed: a data-parallel "
                        f"learner's link to this one broke (it died): {_first_line(e)}") from e
                if time.monotonic() >= deadline:
                    raise PeerLostError(
                        f"{self.name}: the other data-parallel learners did not join the {what} all-reduce of "
                        f"update {self.updates + 1} within {DP_TIMEOUT_S:.0f}s (a replica died or hung): "
                        f"{_first_line(e)}") from e

    def _bank_left(self) -> dict[int, int]:
        """The replicas that left the bank with the run: bank index -> its updates then."""
        store = getattr(self, "_dp_store", None)
        if store is None:
            return {}
        keys = {j: f"left/{j}" for j in range(self.bank_size) if j != self.bank_index}
        return {j: int(store.get(k)) for j, k in keys.items() if store.check([k])}

    def _leave_bank(self) -> None:
        """At shutdown (data-parallel): tell the other replicas this one is gone with the run, and at
        which update, so one waiting in an all-reduce this one will never join stops waiting."""
        store = getattr(self, "_dp_store", None)
        if store is not None:
            try:
                store.set(f"left/{self.bank_index}", str(self.updates))
            except (RuntimeError, OSError) as e:  # the store's host is gone: the others time out instead
                logging.getLogger("reactor.learner").warning("%s could not tell the bank it left: %s", self.name, e)


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _on_cpu(obj: Any) -> Any:
    """``obj`` (a state dict: dicts, lists and tuples of tensors and plain values) with its tensors on
    the CPU, where the codec takes them."""
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj.detach().cpu() if hasattr(obj, "detach") else obj


async def _meet_bank(bank: Any, me: int, size: int, life_of_process: int, name: str, where: str,
                     stopping: Callable[[], bool] = lambda: False,
                     left_watch: bool = False) -> tuple[int, dict[int, int]]:
    """Agree with the other replicas of a data-parallel bank on the bank's life to join, once all
    ``size`` have come to it; returns it, and each replica's process life (its ``restarts``) there.

    ``bank`` is the bank's rendezvous store, which outlives the replicas' processes. It holds the
    bank's latest life (``life``), the life each replica last came to (``joined/<i>``) and who came
    to each (``came/<life>/<i>``: that process's ``restarts``). A replica comes to the store's life,
    or, if it came to that one before (a replica started again), to the next, which it makes the
    store's: a new life of any replica starts a new life of the bank, and the others' new lives
    follow it there. A replica waiting for the others follows the store's life when it moves on (one
    that had come died, and its new life moved it), so the replicas never wait in two lives.

    The store's requests and the polls between them run on a thread (:func:`_await_threads`): a store that
    is slow to answer holds the meeting, not the caller's loop.

    Raises:
        PeerLostError: not every replica came within ``DP_JOIN_TIMEOUT_S``, or the store failed (naming
            ``where``).
        _RunStopping: ``stopping()`` became true meanwhile (the run is ending: checked at every poll), or,
            with ``left_watch``, a replica that has not come left (``gone/<i>``: a deterministic run, which
            restarts nothing).
    """

    def meet(over: threading.Event) -> tuple[int, dict[int, int]]:
        try:
            return _meet(bank, me, size, life_of_process, name, where, over, left_watch)
        except RuntimeError as e:  # (torch's store errors and timeouts are RuntimeErrors)
            raise PeerLostError(f"{name}: the bank's rendezvous store ({where}) failed while the data-parallel "
                                f"learners met: {_first_line(e)}") from e

    return await _await_threads([meet], name, stopping, DP_JOIN_TIMEOUT_S + DP_TIMEOUT_S,
                                f"{name}: the bank's rendezvous store ({where}) did not answer while the "
                                f"data-parallel learners met (within {DP_JOIN_TIMEOUT_S + DP_TIMEOUT_S:.0f} s)")


def _meet(bank: Any, me: int, size: int, life_of_process: int, name: str, where: str, over: threading.Event,
          left_watch: bool) -> tuple[int, dict[int, int]]:
    """:func:`_meet_bank`'s meeting, on its thread: polls every ``DP_POLL_S`` until ``over`` is set (its
    awaiter left: the run is ending)."""
    import time

    mine = f"joined/{me}"
    life = _raise_life(bank, int(bank.get(mine)) + 1 if bank.check([mine]) else 0)
    deadline = time.monotonic() + DP_JOIN_TIMEOUT_S
    while True:
        if over.is_set():  # (its awaiter left: no word of this process in a new life)
            raise _RunStopping(name)
        bank.set(mine, str(life))
        bank.set(f"came/{life}/{me}", str(life_of_process))
        came = [f"came/{life}/{i}" for i in range(size)]
        while not bank.check(came):
            now = int(bank.add("life", 0))
            if now > life:
                break
            missing = [i for i, key in enumerate(came) if not bank.check([key])]
            if left_watch and (gone := [i for i in missing if bank.check([f"gone/{i}"])]):
                raise _RunStopping(f"data-parallel learner(s) {gone} left (refused or failed at its start)")
            if time.monotonic() > deadline:
                raise PeerLostError(f"{name}: data-parallel learner(s) {missing} did not join within "
                                    f"{DP_JOIN_TIMEOUT_S:.0f} s (rendezvous: {where}, the bank's life {life})")
            if over.wait(DP_POLL_S):
                raise _RunStopping(name)
        else:
            return life, {i: int(bank.get(key)) for i, key in enumerate(came)}
        life = now


async def _await_threads(works: list[Callable[[threading.Event], Any]], name: str,
                         stopping: Callable[[], bool], timeout_s: float | None = None, late: str = "") -> Any:
    """Run each of ``works`` on a daemon thread of its own, and await here the first to end: what it
    returned, or what it raised. Every ``DP_POLL_S`` meanwhile, ``stopping()`` (what the loop alone hears:
    the run is ending) raises :class:`_RunStopping` naming ``name``, and past ``timeout_s`` (None: no
    bound) :class:`PeerLostError` says ``late``; a cancellation (the worker's SIGTERM) ends the wait too.
    However the wait ends, the event each work is given is set (a polling work ends at its next poll); a
    work that waits in C (a store's request, a group's forming) cannot be stopped: it is
    left to end with the process (a daemon, waited for by nothing; what it ends with is dropped).

    The store's requests and the other replicas are waited on this way, never on the loop: a store that
    does not answer held the loop, and every reaction of the process, up to the store's timeout (and a TCP
    store's connect to a server that takes the connection and never answers, for good: its timeout does
    not bound that wait, which is why the bound is kept here).
    """
    import asyncio
    import contextlib
    import time

    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()
    over = threading.Event()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(result)
            else:
                done.set_exception(error)

    def run(work: Callable[[threading.Event], Any]) -> None:
        result, error = None, None
        try:
            result = work(over)
        except BaseException as e:  # noqa: BLE001 - handed to the loop
            error = e
        if not over.is_set():  # (one that ends after the wait did, its work asked to stop: dropped)
            with contextlib.suppress(RuntimeError):  # (the loop closed: this replica left without it)
                loop.call_soon_threadsafe(settle, result, error)

    for work in works:
        threading.Thread(target=run, args=(work,), name=f"dp-bank-{name}", daemon=True).start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            await asyncio.wait([done], timeout=DP_POLL_S)
            if done.done():
                return done.result()
            if stopping():
                raise _RunStopping(name)
            if deadline is not None and time.monotonic() > deadline:
                raise PeerLostError(late)
    finally:
        over.set()
        done.cancel()  # (left: what a thread ends with is dropped, not an exception nobody retrieved)


def _raise_life(bank: Any, at_least: int) -> int:
    """The bank's life in ``bank`` once it is ``at_least`` (compare-and-set: replicas raise it at once)."""
    life = int(bank.add("life", 0))  # (made 0 by the first to ask)
    while life < at_least:
        life = int(bank.compare_set("life", str(life), str(at_least)))
    return life



class _Waiting:
    """Prints ``message`` (with the seconds waited) every ``DP_WAIT_REPORT_S`` until ``done``."""

    def __init__(self, message: str) -> None:
        import threading
        import time

        self.message, self.t0 = message, time.monotonic()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._report, name="dp-join-wait", daemon=True)
        self.thread.start()

    def _report(self) -> None:
        import time

        while not self.stop.wait(DP_WAIT_REPORT_S):
            print(f"{self.message}: {time.monotonic() - self.t0:.0f} s so far", flush=True)

    def done(self, message: str) -> None:
        import time

        self.stop.set()
        waited = time.monotonic() - self.t0
        if waited >= DP_WAIT_REPORT_S:
            print(f"{message} after {waited:.0f} s", flush=True)



def _optimizers(state: Any) -> list[Any]:
    import torch

    values = state.values() if isinstance(state, dict) else vars(state).values()
    return [v for v in values if isinstance(v, torch.optim.Optimizer)]
