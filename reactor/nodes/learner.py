"""Learners: run an algorithm's ``learn`` fragment on replay samples or on-policy rollouts.

:class:`Learner` (off-policy) keeps ``prefetch`` samples in flight from the replay shards through a
:class:`~reactor.nodes.replay.ReplayClient` (N shards behave as one table), learns on each batch as
it arrives, sends the new priorities to the shards that own the keys, and broadcasts the policy
weights every ``weights_every`` updates. A sample's arrival (``take``) sends the next request at
once; the update runs one microstep later (``learn``, on the ``update_due`` action), so a shard in
another process can draw the next sample while this one is learned on (data-parallel replicas
update in rounds: see below). How many updates happen per env step is the replay rate
limiter's business (``SampleToInsertRatio``), so the learner never polls.

:class:`RolloutLearner` (on-policy, PPO) waits for one rollout from each of ``num_actors`` actors,
learns on them together, and broadcasts the weights that the actors wait for.

**Data-parallel learners** (the ``dp-learners`` policy): a bank of N learners, each sampling its
own batches, all-reduce (average) their gradients through ``torch.distributed`` (gloo; NCCL where
GPUs exist) before every optimizer step, so all replicas hold the same weights; replica 0 speaks for
them (weights, checkpoints). An update blocks its process in the all-reduce until every replica
reaches it. The rendezvous is a file in the run directory named by the run id (over hosts, the
coordinator's TCP store); replica 0's whole state goes to the others once they have joined.

**Restarts** (restart policies, async runs): a bank lives and restarts whole. A replica whose peer
replica died ends too (``replica_lost``; an all-reduce the dead one left fails at once), so each
replica's restart policy starts it again; the new processes agree on a new life of the bank in the
rendezvous store (:func:`_meet_bank`: the store outlives them, and a life's keys are its own) and
take replica 0's state, which it resumed from its checkpoint.

**Rounds.** A replica does not update when its batch arrives: it holds the batch and tells the
bank (:class:`~reactor.nodes.train_messages.BankReady` on ``ready``, broadcast to every replica's
``bank``, itself included), and each replica runs update k when it has heard of round k from every
replica. So no replica enters an all-reduce before every other has its batch: the collective never
waits on something that has not happened yet. (Entering it at once, as the replicas once did, made
a replica wait inside its reaction for a batch the other could only get from inserts later in
logical time; in deterministic runs those inserts needed that replica's own promises, and the run
stalled until the all-reduce timed out. The README's default ``dp-learners`` run met it at update
354.) In deterministic runs every replica hears the last word of a round at the same tag and
updates there. A replica whose sample can never come learns so from the shards
(:class:`~reactor.nodes.messages.Exhausted`: every actor took its step budget and a rate limiter
holds the request for good) and says so (``have=False``); the bank then ends before that round,
every replica at the same update, dropping the batches it holds, and the run ends (once, the
limiters shared out the last samples unevenly and a replica with one more batch waited in an
all-reduce nobody joined). A replica holds at most ``prefetch`` batches for rounds not yet run: one
that sampled on at every reply ran hundreds of rounds ahead of a slower one, its words used up the
link's credit while that one waited in an all-reduce, and its own blocking ``heard`` then waited to
send them.
A replica that does not join an all-reduce within ``DP_TIMEOUT_S`` (it died or stopped) makes the
others raise :class:`~reactor.PeerLostError` naming the step, instead of waiting on gloo's default
of 30 minutes.

**Checkpoints**: every ``checkpoint_every`` updates the learner writes the algorithm's
``state_dict`` (networks, optimizers, counters) atomically to ``run_dir/learner.pt``; with
``resume=True`` it starts from that file when it exists.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import PeerLostError, ReactorInternalError
from .._files import os_error_in, refuse_file_links, replace_small, replacing
from .._reactor import Action, Input, Output, Reactor, peer_lost, peer_restarted, reaction, shutdown, startup
from .._runclaim import check_resumable, claim_run_dir, release_run_dir
from ..launch._rundir import rendezvous_file
from ._contract import check_learn, check_policy_weights, check_state_dict
from ._device import LearnStep, check_compile, check_device, resolve_device, takes_device
from ._registry import check_saved_weights, denormals_flushed, error_line, state_sha256, weights_sha256
from .messages import ItemUpdate, ReplayReply, ReplayRequest, SampledBatch
from .replay import ReplayClient
from .replay_client import ONE_SIDED_ERRORS, REMOTE_READS
from .train_messages import BankReady, Report, Rollout, Weights

__all__ = ["DP_JOIN_TIMEOUT_S", "DP_TIMEOUT_S", "Learner", "RolloutLearner"]

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


class _LearnerBase(Reactor):
    placement_role = "learner"
    replicas_apart = "data-parallel replicas: each joins the bank's torch.distributed group"
    #: Data-parallel, once its bank met (``_join_bank``): the bank's life, and each replica's process life
    #: there (None before: a death heard meanwhile is no bank's it joined).
    dp_life = 0
    dp_members: dict[int, int] | None = None

    def _setup(self, algo: str, env: str, algo_config: dict[str, Any] | None) -> None:
        import torch

        from ._registry import configure_torch, load_algorithm, make_env

        if self.run_dir:  # (first: a learner refused here has no state, and saves nothing at shutdown)
            refuse_file_links(self.run_dir)
            ckpt = Path(self.run_dir) / "learner.pt"
            if (ckpt.exists() or ckpt.is_symlink()) and not ckpt.is_file():
                raise ValueError(f"{self.name}: {ckpt} is not a file: the learner's checkpoint goes there; remove it")
            self._run_claim = claim_run_dir(self.run_dir, self.run_id, resume=self.resume,
                                            who=self.name)
        configure_torch()
        self.algo = load_algorithm(algo)
        self.config = self.algo.Config.from_dict(dict(algo_config or {}))
        probe = make_env(env)
        self.obs_space, self.act_space = probe.observation_space, probe.action_space
        probe.close()
        # Every replica starts alike (the bank's seed), and --seed changes the initialisation.
        seed = int(np.random.default_rng([self.bank_seed, self.seed]).integers(2**31))
        self.torch_device = resolve_device(self.device, self.name, self.bank_index)
        on_device = {}
        if self.torch_device.type != "cpu":
            if not takes_device(self.algo.init):
                raise ValueError(f"{self.name}: device={self.device!r}, but algorithm {self.algo_name!r}'s init takes "
                                 f"no device argument (the fragment contract: init(obs_space, act_space, config, seed, "
                                 f"device)); use device='cpu' or add it")
            on_device = {"device": self.torch_device}
        with torch.random.fork_rng(devices=[self.torch_device] if self.torch_device.type == "cuda" else []):
            torch.manual_seed(seed)  # seeded, and no other stream in this process moves
            with denormals_flushed():
                self.state = self.algo.init(self.obs_space, self.act_space, self.config, seed, **on_device)
        # What policy_weights and state_dict return, checked once here: not in the weights' broadcast, and not
        # first at the run's end, in its last checkpoint.
        try:
            check_policy_weights(self.algo, self.algo.policy_weights(self.state))
            check_state_dict(self.algo, self.algo.state_dict(self.state))
        except ValueError:
            del self.state  # (nothing is saved at shutdown: _finish)
            raise
        self._learn_checked = False  # (what learn returns is checked on its first call)
        self._watch_steps()
        self.learn_step = LearnStep(self.algo.learn, self.compile, self.torch_device, self.name,
                                    replicas=self.bank_size)
        self.updates = 0
        self.ckpt = Path(self.run_dir) / "learner.pt" if self.run_dir else None
        self._failed_saves = 0  # checkpoints in a row that could not be written (a full disk)
        self._saved_at: int | None = None  # the update of the last learner.pt this life saved (or resumed from)
        if self.ckpt is not None and self.resume and self.restarts == 0:
            self._check_same_run()
        # A restarted learner (restart policies) resumes from its latest checkpoint, as resume=True. The
        # other replicas of a data-parallel bank then take replica 0's state when they join (_share_state),
        # so only replica 0 says what it lacks (over hosts the others' run directories hold no checkpoint).
        first = self.bank_index == 0
        if (self.resume or self.restarts > 0) and self.ckpt is not None and self.ckpt.is_file():
            self._resume(torch)
        elif first and self.restarts > 0:
            # (it started again from fresh weights without a word: a run's progress lost in silence)
            lost = self.restart_loses() or (f"its learning: no learner.pt written yet (checkpoint_every = "
                                            f"{self.checkpoint_every}), so it learns again from fresh weights")
            logging.getLogger("reactor.learner").warning(
                "%s: started again (restart %d) without %s; the replay and the actors go on from theirs",
                self.name, self.restarts, lost)
        elif first and self.resume and self.ckpt is not None and self.restarts == 0:
            logging.getLogger("reactor.learner").warning(
                "%s: resume=True, but %s holds no learner.pt (the earlier run was killed before it saved one: a run "
                "saves it at its end, and every checkpoint_every updates when set): the learner starts from fresh "
                "weights; the replay and the actors' schedules go on from theirs", self.name, self.run_dir)
        if self.ckpt is not None and self.bank_index == 0:
            self._write_config()

    #: An update under way (:meth:`_learning`): set as ``learn`` begins, cleared once it has returned and
    #: been counted; left set by one an error cut short.
    _cut = False
    _params: list[Any] = []  # (the parameters the state's optimizers step: _watch_steps)
    _versions = 0

    def _watch_steps(self) -> None:
        """The parameters the state's optimizers step, whose in-place versions (``Tensor._version``, which
        every in-place change counts) tell an update cut short before it changed any (an error before its first
        optimizer step) from one cut after (a critic stepped, an actor not; its counters out of step with
        them): :meth:`_finish_files`. Read outside ``learn``, which may be compiled: a step hook in it is
        a side effect the compiler has to break its graph for."""
        self._params = [p for opt in _optimizers(self.state) for g in opt.param_groups for p in g["params"]]

    def _parameter_versions(self) -> int:
        return sum(p._version for p in self._params)

    def _stepped(self) -> bool:
        """Whether the update under way changed a parameter (True when none is known: no optimizer found)."""
        return not self._params or self._parameter_versions() != self._versions

    @contextlib.contextmanager
    def _learning(self) -> Iterator[None]:
        """One update (the algorithm's ``learn``): what :meth:`_finish_files` reads to tell a state that holds
        whole updates from one an error cut short in the middle of one (left set when ``learn`` raises: an
        algorithm's bug, a device out of memory, a data-parallel all-reduce that another replica's death
        failed, a second Ctrl-C between its lines)."""
        self._cut, self._versions = True, self._parameter_versions()
        yield
        self._cut = False

    def restart_loses(self) -> str:
        if not self.run_dir:
            return "its learning: with no run_dir it writes no learner.pt to resume from, and learns again from fresh weights"
        if self.checkpoint_every <= 0:
            return ("its learning: checkpoint_every = 0 writes learner.pt only at the run's end, so it learns again from "
                    "fresh weights; set checkpoint_every=N to resume from every N updates")
        return ""

    def _check_same_run(self) -> None:
        assert self.ckpt is not None
        try:
            check_resumable(self.ckpt.parent, self.algo_name, self.env_name, self.name)
        except ValueError:
            del self.state  # (nothing is saved at shutdown: _finish)
            raise

    def _resume(self, torch: Any) -> None:
        """Load ``learner.pt`` into the fresh state. One that does not load (another network's shape:
        a --set that differs from the run's, a damaged file) ends the run with one line naming the file,
        and leaves the file, config.json and weights.sha256 as they were: the learner never saves over
        a checkpoint it could not resume from (it did, with its fresh weights, at its shutdown)."""
        assert self.ckpt is not None
        # This run's optimizer settings (lr, betas, eps, ...: the config, with its --set) outlive the load:
        # torch's Optimizer.load_state_dict puts the checkpoint's back, so a resume with a new lr trained
        # on at the old one while config.json said the new.
        chosen = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                  for opt in _optimizers(self.state)]
        try:
            saved = torch.load(self.ckpt, weights_only=True, map_location=self.torch_device)
            if not isinstance(saved, dict) or "algo" not in saved or type(saved.get("updates")) is not int \
                    or not 0 <= saved["updates"] < 2**53:  # (a count that crosses the wire as an int64, exactly)
                raise ValueError("it is not a learner checkpoint (a dict of 'algo' and a count of 'updates')")
            self.algo.load_state_dict(self.state, saved["algo"])
            check_saved_weights(saved, self.algo.policy_weights(self.state))
        except Exception as e:  # noqa: BLE001 - whatever the file held, the same answer
            del self.state  # (nothing is saved at shutdown: _finish)
            raise ValueError(f"{self.name}: cannot resume from {self.ckpt}: {error_line(e)} (the run's settings must be "
                             f"those it was trained with: config.json beside it has them); the checkpoint and the "
                             f"run's results were left as they were") from None
        self.updates = int(saved["updates"])
        self._saved_at = self.updates
        log = logging.getLogger("reactor.learner")
        _say(f"{self.name} resumed from its checkpoint {self.ckpt} at update {self.updates}")  # (asked for: no warning)
        for i, (opt, groups) in enumerate(zip(_optimizers(self.state), chosen, strict=True)):
            for g, settings in zip(opt.param_groups, groups, strict=True):
                changed = {k: (g[k], v) for k, v in settings.items() if k in g and not _same_setting(g[k], v)}
                g.update(settings)
                for k, (was, now) in changed.items():
                    log.warning("%s: optimizer %d's %s is %r now (the checkpoint's was %r)", self.name, i, k, now, was)

    async def _join_bank(self) -> bool:
        """Data-parallel, after :meth:`_setup`: meet the bank's other replicas in this life of the
        bank, make its ``torch.distributed`` group, and take replica 0's state (:meth:`_share_state`).
        The meeting awaits (polls), so this process answers its peers and the coordinator meanwhile: a
        replica started again whose loop a blocking wait held answered no connect of the bank's other
        new lives, which waited out the connect's 10 s timeout, and the coordinator another 10 s for it
        to link to them.

        Returns False when the bank cannot meet: the run is ending (its coordinator's stop, heard in
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
        try:
            bank = self._open_bank(self.bank_size)
            try:
                self.dp_life, self.dp_members = await _meet_bank(
                    bank, self.bank_index, self.bank_size, self.restarts, self.name, where,
                    lambda: self.stopped_by is not None, left_watch=self.deterministic)
            except _RunStopping as e:
                why = f"the run is ending ({self.stopped_by})" if self.stopped_by is not None else str(e)
                _say(f"{self.name}: {why} before all {self.bank_size} data-parallel learners joined: this one leaves "
                     f"without learning, and saves nothing")
                return False
            self._dp_store = dist.PrefixStore(f"group/{self.dp_life}", bank)
            # Every replica has come to this life: the group forms at once, unless one died since it came
            # (its new life makes the next: this one then fails after DP_TIMEOUT_S, and joins that one).
            dist.init_process_group(backend, store=self._dp_store, rank=self.bank_index, world_size=self.bank_size,
                                    timeout=datetime.timedelta(seconds=DP_TIMEOUT_S))
            # The updates' all-reduces get their own group with the short timeout.
            self._dp_group = dist.new_group(timeout=datetime.timedelta(seconds=DP_TIMEOUT_S))
        finally:
            waiting.stop.set()
        if self.dp_life:  # (said at once: a bank that started again says so)
            _say(f"{self.name}: all {self.bank_size} data-parallel learners joined the bank's life {self.dp_life}")
        else:
            waiting.done(f"{self.name}: all {self.bank_size} data-parallel learners joined")
        print(f"{self.name}: data-parallel over {backend}, {self.bank_size} replicas, this one on {self.torch_device}",
              flush=True)
        self._share_state()
        return True

    def _bank_where(self) -> str:
        """Where the bank's replicas meet, in words (the run's TCP store over hosts, else its file)."""
        served = os.environ.get("REACTOR_DIST_STORE")
        return f"tcp store {served}" if served else f"file {self._bank_file()}"

    def _bank_file(self) -> Path:
        return rendezvous_file(self.run_dir, self.run_id)  # (one host's: its coordinator removes it at the run's end)

    def _open_bank(self, users: int) -> Any:
        """The bank's rendezvous store, under its prefix: the TCP store the run's coordinator serves over
        hosts, else a file in the run directory (``users``: ``FileStore``'s count of the processes that
        use it, the last of which removes the file; -1: not counted)."""
        import torch.distributed as dist

        served = os.environ.get("REACTOR_DIST_STORE")
        if served:  # over hosts: the TCP store the run's coordinator serves
            host, port = served.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=DP_JOIN_TIMEOUT_S))
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
        dist.broadcast(count, src=0)
        if sizes is None:
            sizes = torch.empty(int(count.item()), dtype=torch.int64, device=on)
        dist.broadcast(sizes, src=0)
        lengths = sizes.cpu().tolist()
        if blob is None:
            blob = torch.empty(sum(lengths), dtype=torch.uint8, device=on)
        dist.broadcast(blob, src=0)
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
                or its connection broke.
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
                timed_out = "timed out" in str(e).lower()
                if not timed_out or time.monotonic() >= deadline:
                    raise PeerLostError(
                        f"{self.name}: the other data-parallel learners did not join the {what} all-reduce of "
                        f"update {self.updates + 1} within {DP_TIMEOUT_S:.0f}s (a replica died or hung): "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                    ) from e

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

    def _write_config(self) -> None:
        """``run_dir/config.json``: what rebuilds the policy (``reactor.load_policy``) without the app."""
        import dataclasses
        import json

        assert self.ckpt is not None
        from ..launch._app import APP_DIRS, SCRIPT_DIRS

        record = {"format": 1, "algo": self.algo_name, "env": self.env_name,
                  "algo_config": dataclasses.asdict(self.config), "app_config": self.app_config,
                  "weights": self.ckpt.name,
                  # Where a custom env's or algorithm's module was found beside the app (load_policy
                  # imports from there too when the directory exists where the policy is loaded).
                  "app_dirs": list(dict.fromkeys([*APP_DIRS, *SCRIPT_DIRS]))}
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        replace_small(self.ckpt.with_name("config.json"), (json.dumps(record, indent=2, default=repr) + "\n").encode())

    def _maybe_checkpoint(self, force: bool = False) -> str | None:
        """Save ``learner.pt`` when due (or ``force``); returns the policy weights' sha256 saved with
        it, or None when nothing was saved."""
        import torch

        if self.ckpt is None or self.bank_index != 0:
            return None
        if not force and (self.checkpoint_every <= 0 or self.updates % self.checkpoint_every):
            return None
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        # The policy's weights' hash travels with them: a loader that finds other weights knows the file
        # was damaged (bit flips in a tensor load silently otherwise).
        sha = weights_sha256(self.algo.policy_weights(self.state))
        state = self.algo.state_dict(self.state)
        try:
            with replacing(self.ckpt, sync=True) as f:
                torch.save({"algo": state, "updates": self.updates, "weights_sha256": sha,
                            "state_sha256": state_sha256(state)}, f)
        except (OSError, RuntimeError) as e:  # (torch's zip writer says a full disk as a RuntimeError)
            cause = os_error_in(e)
            if cause is None:
                raise
            self._checkpoint_failed(cause, force)
            return None
        if self._failed_saves:
            logging.getLogger("reactor.learner").warning("%s: saved %s again at update %d, after %d failed tries",
                                                         self.name, self.ckpt, self.updates, self._failed_saves)
        self._failed_saves, self._saved_at = 0, self.updates
        return sha

    def _checkpoint_failed(self, cause: OSError, at_end: bool) -> None:
        """A checkpoint that could not be written (a full disk, a read-only or vanished directory): the
        last one saved stays whole (:func:`replacing`). Mid-run the learner goes on and tries again at the
        next (said at the first failure and at every tenth after it): a long run is not ended by a disk
        that fills for a while. At the run's end it fails the run, naming the file and what is kept."""
        why = cause.strerror or str(cause)
        kept = (f"{self.ckpt.name} holds the last one saved, at update {self._saved_at}"  # type: ignore[union-attr]
                if self._saved_at is not None else "none was saved in this life")
        if at_end:
            err = OSError(f"{self.name}: cannot save {self.ckpt} at the run's end ({why}); {kept}")
            err.errno = cause.errno  # (kept for a caller that asks; not in its words: "[Errno 28] ...")
            raise err from cause
        self._failed_saves += 1
        if self._failed_saves % 10 == 1:
            logging.getLogger("reactor.learner").warning(
                "%s: cannot save %s at update %d (%s; %d failed tries so far); %s; learning goes on and tries again "
                "at the next checkpoint", self.name, self.ckpt, self.updates, why, self._failed_saves, kept)

    def _finish(self) -> None:
        """At shutdown: a last checkpoint, and the final weights' hash (printed, and in run_dir); then
        the run directory's claim goes."""
        try:
            self._finish_files()
        finally:
            release_run_dir(self)

    def _finish_files(self) -> None:
        if not hasattr(self, "state"):
            self._leave_unmet_bank()
            return
        if self.bank_size > 1 and self.dp_members is None:
            # Data-parallel, its bank never met: nothing learned (its state is fresh, or the checkpoint's it
            # resumed from); it saved those as a checkpoint of no update over the run's at the reaping.
            self._leave_unmet_bank()
            return
        self._leave_bank()
        if self._cut and self._stepped():
            # An update an error cut short once it had changed a parameter (or where that cannot be told: no
            # optimizer found in the state): the state may hold part of it, its counters out of step with it.
            # Saved, it was resumed as is (a restart, resume=True); the last checkpoint stays instead.
            kept = ("its state is not saved" if self.ckpt is None or self.bank_index != 0 else
                    f"{self.ckpt} is left as saved at update {self._saved_at}" if self._saved_at is not None else
                    f"no {self.ckpt.name} is saved (none was in this life)")
            _say(f"{self.name}: update {self.updates + 1} was cut short by an error once it had changed the networks: "
                 f"the state may hold part of it, so {kept}; {self.updates} whole updates")
            return
        saved = self._maybe_checkpoint(force=True)  # replica 0 only (it hashed the weights: not twice)
        self.weights_sha256 = saved or weights_sha256(self.algo.policy_weights(self.state))
        if self.run_dir and self.bank_index == 0:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            replace_small(Path(self.run_dir) / "weights.sha256", (self.weights_sha256 + "\n").encode())
        _say(f"{self.name}: {self.updates} updates; final weights sha256 {self.weights_sha256}")

    def _on_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` moved to the learner's device (as is on the CPU)."""
        if self.torch_device.type == "cpu":
            return batch
        return {k: v.to(self.torch_device, non_blocking=True) for k, v in batch.items()}

    def _weights(self) -> Weights:
        # A copy, always: in one process the message is handed over as is, and the optimizer changes
        # the live parameters in place; receivers must see the weights of version `updates`.
        return Weights(self.updates, {k: v.detach().to("cpu", copy=True).contiguous() for k, v in
                                      self.algo.policy_weights(self.state).items()})


def _bad_word(word: Any, bank_size: int, next_round: int, heard: dict[int, dict[int, bool]], me: int,
              announced: int) -> str:
    """Why a :class:`BankReady` cannot be taken ("" if it can): a malformed word, or one a replica
    never sends (a round already run or impossibly far ahead, a second word on a round, a word in
    this replica's name (``me``) on a round it has not announced: ``announced`` so far)."""
    if not isinstance(word, BankReady):
        return f"expected a BankReady, got {type(word).__name__}"
    r, i = word.round, word.replica
    if type(i) is not int or not 0 <= i < bank_size:
        return f"replica must be an int in [0, {bank_size}), got {i!r}"
    if type(r) is not int or not next_round <= r < next_round + _MAX_ROUNDS_AHEAD:
        return (f"round must be an int in [{next_round}, {next_round + _MAX_ROUNDS_AHEAD}) (the rounds not yet run), "
                f"got {r!r} from replica {i}")
    if type(word.have) is not bool:
        return f"have must be True or False, got {word.have!r}"
    if i in heard.get(r, ()):
        return f"replica {i} spoke twice on round {r}"
    if i == me and r >= announced:
        return f"a word in this replica's name ({i}) on round {r}, which it has not announced (it announced {announced})"
    return ""


def _on_cpu(obj: Any) -> Any:
    """``obj`` (a state dict: dicts, lists and tuples of tensors and plain values) with its tensors on
    the CPU, where the codec takes them."""
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj.detach().cpu() if hasattr(obj, "detach") else obj


async def _meet_bank(bank: Any, me: int, size: int, life_of_process: int, name: str, where: str,
                     stopping: Any = lambda: False, left_watch: bool = False) -> tuple[int, dict[int, int]]:
    """Agree with the other replicas of a data-parallel bank on the bank's life to join, once all
    ``size`` have come to it; returns it, and each replica's process life (its ``restarts``) there.

    ``bank`` is the bank's rendezvous store, which outlives the replicas' processes. It holds the
    bank's latest life (``life``), the life each replica last came to (``joined/<i>``) and who came
    to each (``came/<life>/<i>``: that process's ``restarts``). A replica comes to the store's life,
    or, if it came to that one before (a replica started again), to the next, which it makes the
    store's: a new life of any replica starts a new life of the bank, and the others' new lives
    follow it there. A replica waiting for the others follows the store's life when it moves on (one
    that had come died, and its new life moved it), so the replicas never wait in two lives.

    Raises:
        PeerLostError: not every replica came within ``DP_JOIN_TIMEOUT_S``.
        _RunStopping: ``stopping()`` became true meanwhile (the run is ending: checked at every poll), or,
            with ``left_watch``, a replica that has not come left (``gone/<i>``: a deterministic run, which
            restarts nothing).
    """
    import asyncio
    import time

    mine = f"joined/{me}"
    life = _raise_life(bank, int(bank.get(mine)) + 1 if bank.check([mine]) else 0)
    deadline = time.monotonic() + DP_JOIN_TIMEOUT_S
    while True:
        bank.set(mine, str(life))
        bank.set(f"came/{life}/{me}", str(life_of_process))
        came = [f"came/{life}/{i}" for i in range(size)]
        while not bank.check(came):
            now = int(bank.add("life", 0))
            if now > life:
                break
            if stopping():
                raise _RunStopping(name)
            missing = [i for i, key in enumerate(came) if not bank.check([key])]
            if left_watch and (gone := [i for i in missing if bank.check([f"gone/{i}"])]):
                raise _RunStopping(f"data-parallel learner(s) {gone} left (refused or failed at its start)")
            if time.monotonic() > deadline:
                raise PeerLostError(f"{name}: data-parallel learner(s) {missing} did not join within "
                                    f"{DP_JOIN_TIMEOUT_S:.0f} s (rendezvous: {where}, the bank's life {life})")
            await asyncio.sleep(DP_POLL_S)
        else:
            return life, {i: int(bank.get(key)) for i, key in enumerate(came)}
        life = now


def _raise_life(bank: Any, at_least: int) -> int:
    """The bank's life in ``bank`` once it is ``at_least`` (compare-and-set: replicas raise it at once)."""
    life = int(bank.add("life", 0))  # (made 0 by the first to ask)
    while life < at_least:
        life = int(bank.compare_set("life", str(life), str(at_least)))
    return life


#: Rounds a replica may announce ahead of the bank's (bounded by its samples in flight; the bound
#: only keeps a malformed word from growing what a replica holds).
_MAX_ROUNDS_AHEAD = 1 << 16


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


def _same_setting(a: Any, b: Any) -> bool:
    """Whether two optimizer settings are equal (a tensor lr compares by value, not elementwise)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - settings that do not compare are reported as changed
        return False


def _optimizers(state: Any) -> list[Any]:
    import torch

    values = state.values() if isinstance(state, dict) else vars(state).values()
    return [v for v in values if isinstance(v, torch.optim.Optimizer)]


class Learner(_LearnerBase):
    """Off-policy learner over N replay shards.

    Ports:
        replies: :class:`ReplayReply` from the shards (connected back with ``key=requester_key``).
        bank, ready: data-parallel rounds (:class:`BankReady`): a bank of N > 1 connects ``ready``
            to ``bank``, broadcast (every replica hears every word, its own included; see the module
            docstring). A single learner needs neither.
        requests: sample requests to the shards (``key=shard_key``).
        updates: priority updates to the shards owning the keys (``key=shard_key``).
        weights: :class:`Weights` every ``weights_every`` updates (and at start).
        report: :class:`Report` (``updates``, ``samples``, ``one_sided_batches``: batches drawn one-sidedly,
            ``drawn_ahead_batches``: those of them drawn on the client's thread during an update, the
            algorithm's metrics).

    Args:
        algo, env, algo_config: the algorithm, the environment (for its spaces) and Config overrides.
        num_shards: the replay bank's size.
        batch_size: items per sample.
        prefetch: samples kept in flight (sampling overlaps learning): requests through messages, or
            one-sided draws (``ReplayClient.draw_ahead``) running while the learner updates: on the
            client's threads for shards of this host, at the shards' read servers for shards of others.
        weights_every: updates between weight broadcasts.
        report_every: updates between reports.
        max_updates: stop learning after this many updates (None: never).
        seed: mixed with the run seed into the networks' initialisation (the same in every replica).
        run_dir: where checkpoints go (None: no checkpoints).
        checkpoint_every: updates between checkpoints (0: only at the end).
        resume: start from ``run_dir/learner.pt`` when it exists.
        sample_timeout_s: a shard that has not answered for this long is lost (``PeerLostError``).
        app_config: the app's resolved Config, recorded in ``run_dir/config.json``.
        device: where the networks, optimizers and batches live: ``"cpu"``, ``"cuda"`` (replica ``i`` of a
            bank on GPU ``i mod count``) or ``"cuda:N"``; the broadcast weights are host copies.
        compile: ``"auto"``, ``"on"`` or ``"off"``: how ``learn`` runs (:mod:`reactor.nodes._device`).
        remote_reads: how shards of other hosts are sampled (``ReplayClient(remote_reads=...)``, with
            the shards' ``Replay(remote_reads=...)``): ``"auto"`` (default) one-sidedly over RDMA where a
            device works here, else through messages; ``"zmq"`` one-sidedly through their bulk read
            servers (each draws its part and sends the rows; drawn ahead as ``prefetch`` says);
            ``"off"`` through messages.
    """

    replies = Input(ReplayReply, required=True)
    requests = Output(ReplayRequest)
    update_due = Action()
    """A sample to learn on, one microstep after it arrived: the requests the arrival sends (the
    next sample) go out, and are promised complete to the shards' processes, before the update
    starts, so a shard in another process draws the next sample while this one is learned on. Its
    reaction (``learn``) sends no request: if it could, the shards' processes could not serve the one
    sent before the update until the update ended (promises follow the declared effects)."""
    drawn_due = Action()
    """A batch drawn one-sidedly (async runs), learned on at the next microstep; its reaction
    (``learn_drawn``) samples again, one-sidedly or through messages."""
    priorities = Output(ItemUpdate)
    weights = Output(Weights)
    report = Output(Report)
    bank = Input(BankReady)
    ready = Output(BankReady)

    def __init__(
        self,
        algo: str,
        env: str,
        algo_config: dict[str, Any] | None = None,
        *,
        num_shards: int = 1,
        batch_size: int = 128,
        prefetch: int = 1,
        weights_every: int = 10,
        report_every: int = 100,
        max_updates: int | None = None,
        seed: int = 0,
        run_dir: str | None = None,
        checkpoint_every: int = 0,
        resume: bool = False,
        sample_timeout_s: float | None = 300.0,
        app_config: dict[str, Any] | None = None,
        device: str = "cpu",
        compile: str = "auto",
        remote_reads: str = "auto",
    ) -> None:
        self.device, self.compile = check_device(device, "Learner device"), check_compile(compile, "Learner compile")
        if remote_reads not in REMOTE_READS:
            raise ValueError(f"Learner remote_reads must be one of {list(REMOTE_READS)}, got {remote_reads!r:.80}")
        self.remote_reads = remote_reads
        for what, v in (("num_shards", num_shards), ("batch_size", batch_size), ("prefetch", prefetch),
                        ("weights_every", weights_every), ("report_every", report_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Learner {what} must be an int >= 1, got {v!r}")
        self.algo_name, self.env_name, self.algo_config = algo, env, dict(algo_config or {})
        self.num_shards = num_shards
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.drawn_ahead_batches = 0  # one-sided batches drawn while the update before them ran
        self.weights_every = weights_every
        self.report_every = report_every
        self.max_updates = max_updates
        self.seed = seed
        self.run_dir = run_dir
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.sample_timeout_s = sample_timeout_s
        self.app_config = app_config
        self.samples = 0
        self._reported = 0  # the updates of the last report sent
        self._metrics: dict[str, Any] = {}  # the last update's
        self._said_nonfinite = False  # a report's metric was NaN or infinite (said once)
        self._due = 0  # samples taken whose update is still to run (update_due scheduled)
        # Data-parallel rounds (bank_size > 1): batches held for their rounds, rounds announced and
        # run, and what this replica has heard of the rounds to come (round -> replica -> have).
        self._held: deque[SampledBatch] = deque()
        self._announced = 0
        self._rounds = 0
        self._heard: dict[int, dict[int, bool]] = {}
        self.bank_ended = False  # a round found a replica without a batch, or one left with the run (heard)

    @reaction(triggers=[startup], effects=[requests, weights], blocking=True)  # (the replicas' rendezvous)
    async def start(self) -> None:
        if self.bank_size > 1 and self.links_into("bank") != self.bank_size:
            raise ValueError(
                f"{self.name}: a bank of {self.bank_size} data-parallel learners updates in rounds, and every replica "
                f"must hear every replica: connect its `ready` output to its `bank` input, broadcast (graph.connect("
                f"learner.ready, learner.bank, delay_s=step_s), as off_policy_graph does); {self.links_into('bank')} "
                f"link(s) reach this replica's `bank`")
        self._setup(self.algo_name, self.env_name, self.algo_config)
        if self.bank_size > 1 and not await self._join_bank():
            return  # (the run stopped before the bank met: nothing to learn, nothing to save)
        self.client = ReplayClient(self.num_shards, requester=self.bank_index, rng=self.rng,
                                   timeout_s=self.sample_timeout_s, remote_reads=self.remote_reads,
                                   curve=self.process_link.curve, one_sided=not self.reproducible)
        if self.bank_index == 0:
            self.weights.send(self._weights())
        for _ in range(self.prefetch):
            for m in self.client.request(self.batch_size):
                self.requests.send(m)

    @reaction(triggers=[replies], effects=[requests, update_due, drawn_due, priorities, weights, report, ready])
    async def take(self, replies: ReplayReply) -> None:
        if self.bank_ended:
            return  # data-parallel: the bank has ended (heard); later replies are moot
        was_exhausted = self.client.exhausted
        msgs, batch = await self.client.areceive(replies)  # awaits only one-sided reads of other hosts' shards
        for m in msgs:
            self.requests.send(m)
        if batch is None:
            if self.client.exhausted and not was_exhausted and self.bank_size > 1:
                self._announce(None)  # no sample can come: the bank ends before this replica's next round
            self._report_if_done()
            return
        inline = self.bank_size > 1 or not self.deterministic
        # Updates done, to do (this batch, batches waiting on update_due or their round) and samples in flight.
        due = self.updates + 1 + self._due + len(self._held) + self.client.in_flight
        # A data-parallel replica holds at most `prefetch` batches for rounds the bank has not run (Learner.heard
        # samples again as they run): one that sampled on at every reply got hundreds of rounds ahead of a slower
        # replica, and its words to that one outran the link's credit (64 messages) while that one waited in an
        # all-reduce, so its last word waited there too, and the bank for DP_TIMEOUT_S (over hosts).
        ahead = self.bank_size > 1 and len(self._held) >= self.prefetch
        if (self.max_updates is None or due < self.max_updates) and not self.client.can_sample_one_sided and not ahead:
            for m in self.client.request(self.batch_size):  # the next sample overlaps this update
                self.requests.send(m)
        for m in self.client.check_timeouts():  # a shard that stopped answering is lost
            self.requests.send(m)
        if self.bank_size > 1:
            self._announce(batch)  # updated on when the whole bank has a batch for the round (heard)
        elif inline:
            # Async mode updates here: there are no promises to gain, and queued replies would run
            # ahead of the updates.
            self._update(batch)
            await self._sample_one_sided()
            self._report_if_done()
        else:
            self._due += 1
            self.update_due.schedule(batch)

    async def _sample_one_sided(self) -> None:
        """Once the shards offered one-sided sampling (async runs) and no sample is in flight or
        waiting: the next batch is taken from the draws ahead (ReplayClient.draw_ahead: from the
        shared memory of shards on this host on the client's threads, by one request to the read
        server of each shard on another; no message to a shard's loop), and learned on at the next
        microstep; ``prefetch`` more are drawn meanwhile. When that is not possible now, the next
        sample goes through messages again."""
        client = self.client
        remaining = None if self.max_updates is None else self.max_updates - self.updates
        if self._due or self._held:
            return  # a batch drawn waits for its update, which samples next
        if (client.in_flight or not client.live_shards or (remaining is not None and remaining <= 0)
                or self.bank_ended or client.exhausted):
            # A sample is coming through messages, or every shard is down (shards_changed samples when
            # one is back), or the learner is done: the one-sided draws' notices the client holds go now.
            for m in client.take_notices():
                self.priorities.send(m)
            return
        batch = None
        if client.can_sample_now or client.can_sample_one_sided or client.drawn_ahead:
            # The batch was drawn while this learner updated, and the next ones are drawn while it
            # updates on this one: on the client's threads from the memory of shards of this host, or
            # by the read servers of shards of other hosts (their requests sent before the update).
            ahead = client.drawn_ahead > 0  # the next draw ran during the update just made
            client.draw_ahead(self.batch_size, 1 + (self.prefetch if remaining is None else
                                                    min(self.prefetch, remaining - 1)))
            results: list[Any] = []
            if client.drawn_ahead:
                by_taker = client.taker_samples
                try:
                    results.append(await client.next_drawn())
                except ONE_SIDED_ERRORS as e:
                    results.append(e)
                else:  # (one the learner drew itself, none being done, did not run during the update)
                    self.drawn_ahead_batches += (ahead and results[0][0] is not None
                                                 and client.taker_samples == by_taker)
            if not results or isinstance(results[0], BaseException) or results[0][0] is None:
                results += await client.adrain_drawn()  # the draws ahead are the shards' state of now, too
            for r in results:
                if self._take_drawn(r):
                    batch = True
        if batch is not None:
            return
        for m in client.take_notices():  # back to messages: what the client still holds goes now
            self.priorities.send(m)
        for _ in range(self.prefetch if remaining is None else min(self.prefetch, remaining)):
            for r in client.request(self.batch_size):
                self.requests.send(r)

    def _take_drawn(self, result: Any) -> bool:
        """A draw ahead's result (``(batch, notices)`` or the error it raised): its notices go, its
        batch is scheduled for an update. Returns whether there was a batch."""
        if isinstance(result, BaseException):
            if not isinstance(result, ONE_SIDED_ERRORS):
                raise result
            # A shard died, its server refused or answered garbage: the other shards' draws are still
            # told (their notices ride on the error; peer_lost follows a death).
            logging.getLogger("reactor.learner").warning(
                "%s: a one-sided sample failed (%s); sampling through messages", self.name, result)
            for m in getattr(result, "notices", []):
                self.priorities.send(m)
            return False
        batch, notices = result
        for m in notices:
            self.priorities.send(m)
        if batch is None:
            return False
        self._due += 1
        self.drawn_due.schedule(batch)
        return True

    @reaction(triggers=[peer_lost, peer_restarted], effects=[requests])
    def shards_changed(self) -> None:
        """A shard's process died or came back (restart policies, async runs): sample from the
        live shards meanwhile; once one is back and nothing is in flight, sample again."""
        change = self.peer_change
        if change is None or not hasattr(self, "client"):
            return
        for shard in change.indices("requests"):
            if change.event == "peer_lost":
                msgs = self.client.shard_lost(shard, change.reason)
            else:
                self.client.shard_restarted(shard)
                msgs = []
            for m in msgs:
                self.requests.send(m)
        if self.client.live_shards and self.client.in_flight == 0 and self._due == 0 and not self.bank_ended and (
                not self.client.exhausted) and (self.max_updates is None or self.updates + self._due < self.max_updates):
            for _ in range(self.prefetch):
                for m in self.client.request(self.batch_size):
                    self.requests.send(m)

    @reaction(triggers=[peer_lost])
    def replica_lost(self) -> None:
        """Another data-parallel replica's process died (restart policies, async runs): this one's
        ``torch.distributed`` group and rounds cannot take that replica's new life, so it ends too
        (``PeerLostError``), and its own restart policy starts it again: the bank's new lives meet in
        a new life of the bank (:func:`_meet_bank`) and take replica 0's state. A death from before
        this replica joined (a process life older than the one that came to this bank's life: the
        death that started this life) is not this bank's, and is let be.

        (The survivor used to wait for the dead replica's rounds for good, while the new life waited
        in the rendezvous for the survivor: no update after the restart.)"""
        change = self.peer_change
        members = self.dp_members
        if change is None or members is None:
            return
        lost = [i for i in change.indices("bank") if i != self.bank_index and change.life >= members.get(i, 0)]
        if lost:
            raise PeerLostError(
                f"{self.name}: data-parallel learner(s) {lost} of the bank's life {self.dp_life} died "
                f"({change.reason}); a bank starts again whole, so this replica ends too, for its restart policy "
                f"to start it again")

    @reaction(triggers=[update_due], effects=[priorities, weights, report])
    def learn(self, update_due: Any) -> None:
        """A batch that came through messages, in a deterministic run of one learner (``take``)."""
        self._due -= 1
        self._update(update_due)
        self._report_if_done()

    @reaction(triggers=[drawn_due], effects=[requests, drawn_due, priorities, weights, report, ready])
    async def learn_drawn(self, drawn_due: Any) -> None:
        """A batch drawn one-sidedly (async runs); the next is taken from the draws ahead."""
        self._due -= 1
        if self.bank_size > 1:
            if not self.bank_ended:
                self._announce(drawn_due)  # (a data-parallel replica's: held for its round)
            self._report_if_done()
            return
        self._update(drawn_due)
        await self._sample_one_sided()
        self._report_if_done()

    def _announce(self, batch: SampledBatch | None) -> None:
        """Data-parallel: hold ``batch`` for this replica's next round and tell the bank (None: no
        batch will come, so the bank ends before that round)."""
        if batch is not None:
            self._held.append(batch)
        self.ready.send(BankReady(self.bank_index, self._announced, batch is not None))
        self._announced += 1

    @reaction(triggers=[bank], effects=[requests, drawn_due, priorities, weights, report], blocking=True)
    async def heard(self, bank: BankReady) -> None:
        """A replica's word on a round (data-parallel): once every replica has spoken on the next
        round, it runs: an update if all hold a batch, else the end of the bank (every replica
        decides alike, from the same words)."""
        why = _bad_word(bank, self.bank_size, self._rounds, self._heard, self.bank_index, self._announced)
        if why:
            logging.getLogger("reactor.learner").error("%s dropped a BankReady: %s", self.name, why)
            return
        self._heard.setdefault(bank.round, {})[bank.replica] = bank.have
        while not self.bank_ended and len(self._heard.get(self._rounds, ())) == self.bank_size:
            words = self._heard.pop(self._rounds)
            self._rounds += 1
            if not all(words.values()):
                self._end_bank(f"{sum(words.values())} of {self.bank_size} data-parallel learners had a batch for "
                               f"update {self.updates + 1}, and the replay has no more to give: the bank ends at "
                               f"{self.updates} updates")
                break
            try:
                self._update(self._held.popleft())
            except _BankLeft as e:  # the run stopped for the other replica(s) before this update
                self._end_bank(f"data-parallel learner(s) {sorted(e.left)} stopped with the run at update "
                               f"{max(e.left.values())}, before this update: this one stops there too, at "
                               f"{self.updates} updates (update {self.updates + 1} dropped)")
        if not self.bank_ended:
            await self._sample_one_sided()
        self._report_if_done()

    def _end_bank(self, why: str) -> None:
        """Data-parallel: no more rounds; the batches held are dropped."""
        self.bank_ended = True
        self._held.clear()
        _say(f"{self.name}: {why}")

    def _update(self, batch: Any) -> None:
        import torch

        data = dict(batch.data)
        data["weights"] = torch.as_tensor(batch.weights)
        with denormals_flushed(), self._learning():
            learned = self.learn_step(self.state, self._on_device(data))
            self.updates += 1  # (counted with it: a check of what it returned that fails leaves no count behind)
            self.samples += len(batch.keys)
        if not self._learn_checked:
            check_learn(self.algo, learned, len(batch.keys))
            self._learn_checked = True
        metrics, priorities = learned
        if priorities is not None:
            for m in self.client.update_priorities(batch.keys, priorities.detach().cpu().numpy()):
                self.priorities.send(m)
        if self.bank_index != 0:
            return
        if self.updates % self.weights_every == 0:
            self.weights.send(self._weights())
        self._metrics = metrics
        if self.updates % self.report_every == 0:
            self._send_report()
        self._maybe_checkpoint()
        if self.max_updates is not None and self.updates >= self.max_updates:
            self._maybe_checkpoint(force=True)
            self._send_report()  # the last: the run's summary counts every update

    def _send_report(self) -> None:
        """A :class:`Report` of the counts now and the last update's metrics (not twice for one count)."""
        if self.bank_index != 0 or self.updates == self._reported:
            return
        self._reported = self.updates
        metrics = {k: float(v) for k, v in self._metrics.items()}
        if not self._said_nonfinite and not all(math.isfinite(v) for v in metrics.values()):
            # (NaN rewards trained a NaN network to the end, exit 0, without a word; the writers refuse
            # them now, but a network can still diverge, or an offline source hold them)
            self._said_nonfinite = True
            logging.getLogger("reactor.learner").warning(
                "%s: update %d's %s: the network is diverging, or its data holds a NaN or an infinity; the run "
                "goes on", self.name, self.updates,
                ", ".join(f"{k} is {v}" for k, v in metrics.items() if not math.isfinite(v)))
        self.report.send(Report(self.name, {"updates": float(self.updates), "samples": float(self.samples),
                                            "one_sided_batches": float(self.client.one_sided_samples),
                                            "drawn_ahead_batches": float(self.drawn_ahead_batches), **metrics}))

    def _report_if_done(self) -> None:
        """The last report once no update can come (the replay answered Exhausted, or the bank ended)
        and none is due: reports go every ``report_every`` updates, and one sent at shutdown would not
        be delivered, so without it the run's summary would miss up to ``report_every - 1`` updates."""
        if (self.client.exhausted or self.bank_ended) and not self._due and not self._held:
            self._send_report()

    @reaction(triggers=[shutdown])
    def finish(self) -> None:
        try:
            self._finish()
        finally:
            if hasattr(self, "client"):
                self.client.close()  # shared-memory mappings and read connections


class RolloutLearner(_LearnerBase):
    """On-policy learner: one rollout from each of ``num_actors`` actors per update (synchronous PPO).

    Ports:
        rollouts: :class:`Rollout` from the actors.
        weights: :class:`Weights` after every update (the actors wait for them) and at start.
        report: :class:`Report` (``updates``, ``samples``, the algorithm's metrics).
    """

    rollouts = Input(Rollout, required=True)
    weights = Output(Weights)
    report = Output(Report)

    def __init__(self, algo: str, env: str, algo_config: dict[str, Any] | None = None, *, num_actors: int = 1,
                 seed: int = 0, run_dir: str | None = None, checkpoint_every: int = 0, resume: bool = False,
                 max_updates: int | None = None, app_config: dict[str, Any] | None = None, device: str = "cpu",
                 compile: str = "auto") -> None:
        self.device = check_device(device, "RolloutLearner device")
        self.compile = check_compile(compile, "RolloutLearner compile")
        if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1:
            raise ValueError(f"RolloutLearner num_actors must be an int >= 1, got {num_actors!r}")
        self.algo_name, self.env_name, self.algo_config = algo, env, dict(algo_config or {})
        self.num_actors = num_actors
        self.seed = seed
        self.run_dir = run_dir
        self.checkpoint_every = checkpoint_every
        self.resume = resume
        self.max_updates = max_updates
        self.app_config = app_config
        self.pending: dict[int, Rollout] = {}
        self.samples = 0

    @reaction(triggers=[startup], effects=[weights])
    async def start(self) -> None:
        self._setup(self.algo_name, self.env_name, self.algo_config)
        if self.bank_size > 1 and not await self._join_bank():
            return  # (the run stopped before the bank met)
        self.weights.send(self._weights())

    @reaction(triggers=[peer_restarted], effects=[weights])
    def actors_restarted(self) -> None:
        """An actor's process came back (restart policies, async runs): it waits for weights to collect
        its next rollout, and this learner updates only once every actor's rollout is in, so the weights
        go out again now (the others ignore a version they have). Without them the run stalled and ended
        as if done."""
        change = self.peer_change
        if change is not None and change.indices("weights") and hasattr(self, "state"):
            self.weights.send(self._weights())

    @reaction(triggers=[rollouts], effects=[weights, report])
    def learn(self, rollouts: Rollout) -> None:
        import torch

        if rollouts.version < self.updates:  # (collected by an actor's earlier life, or before its restart)
            logging.getLogger("reactor.learner").warning(
                "%s: dropped a rollout of actor %d collected with weights %d (now %d): an actor that was restarted",
                self.name, rollouts.actor, rollouts.version, self.updates)
            return
        if rollouts.version > self.updates and self.restarts > 0:
            # Weights of this learner's last life, past the checkpoint this life resumed from: an actor that
            # finished a rollout before it heard of the restart. (Raised, it ended the run as a refusal.)
            logging.getLogger("reactor.learner").warning(
                "%s: dropped a rollout of actor %d collected with weights %d of this learner's last life (it resumed "
                "at %d)", self.name, rollouts.actor, rollouts.version, self.updates)
            return
        if rollouts.version != self.updates:
            # (Weights this life never sent: no setting of its user's makes that, so not a refusal's one line
            # blaming what the run was given, a ValueError, as it was: reactor's own inconsistency.)
            raise ReactorInternalError(f"{self.name}: rollout from actor {rollouts.actor} was collected with weights "
                                       f"{rollouts.version}, which this learner (at update {self.updates}, restart "
                                       f"{self.restarts}) never sent (synchronous on-policy learning)")
        self.pending[rollouts.actor] = rollouts
        if len(self.pending) < self.num_actors:
            return
        parts = [self.pending[i].data for i in sorted(self.pending)]
        self.pending = {}
        dims = {k: (0 if k == "last_obs" else 1) for k in parts[0]}
        batch = {k: torch.cat([p[k] for p in parts], dim=dims[k]) for k in parts[0]}
        with denormals_flushed(), self._learning():
            learned = self.learn_step(self.state, self._on_device(batch))
            self.updates += 1
            self.samples += int(batch["reward"].numel())
        if not self._learn_checked:
            check_learn(self.algo, learned, None)
            self._learn_checked = True
        metrics, _ = learned
        if self.max_updates is not None and self.updates > self.max_updates:
            return
        self.weights.send(self._weights())
        self.report.send(Report(self.name, {"updates": float(self.updates), "samples": float(self.samples),
                                            **{k: float(v) for k, v in metrics.items()}}))
        self._maybe_checkpoint(force=self.max_updates is not None and self.updates >= self.max_updates)

    @reaction(triggers=[shutdown])
    def finish(self) -> None:
        self._finish()
