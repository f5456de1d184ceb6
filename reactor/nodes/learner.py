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

Where the rest lives: the learners' shared base (the algorithm's state, resuming, checkpoints, what a run
leaves in ``run_dir``) is :mod:`reactor.nodes._learnerstate`; the data-parallel bank's meeting, shared
state and gradient all-reduce are :mod:`reactor.nodes._learnerbank`. This module holds the learner nodes:
their ports, their reactions and the rounds.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from .._errors import MalformedFrameError, PeerLostError, ReactorInternalError
from .._reactor import Action, Input, Output, peer_lost, peer_restarted, reaction, shutdown, startup
from ._contract import check_learn
from ._device import check_compile, check_device
from ._learnerbank import DP_JOIN_TIMEOUT_S, DP_TIMEOUT_S, _BankLeft, _say
from ._learnerstate import _LearnerBase
from ._registry import denormals_flushed
from .messages import ItemUpdate, ReplayReply, ReplayRequest, SampledBatch
from .replay import ReplayClient
from .replay_client import ONE_SIDED_ERRORS, REMOTE_READS
from .train_messages import BankReady, Report, Rollout, Weights

__all__ = ["DP_JOIN_TIMEOUT_S", "DP_TIMEOUT_S", "Learner", "RolloutLearner"]

#: Rounds a replica may announce ahead of the bank's (bounded by its samples in flight; the bound
#: only keeps a malformed word from growing what a replica holds).
_MAX_ROUNDS_AHEAD = 1 << 16


def _items(batch: SampledBatch | None) -> int:
    """The items in a sampled batch (0 for none)."""
    return 0 if batch is None else len(batch.keys)


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
            ``drawn_ahead_batches``: those of them drawn on the client's thread during an update,
            ``empty_batches``: batches sampled with no item left (every one overwritten while it was
            read), which are not learned on, the algorithm's metrics). In a data-parallel bank only
            replica 0 reports, and these counts are its own (``updates`` is every replica's; the
            others' samples and empty batches are not in them).

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
        self.empty_batches = 0  # batches that held no item (every one dropped as overwritten): not learned on
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
        empty = self._empty(batch)
        inline = self.bank_size > 1 or not self.deterministic
        # Updates done, to do (this batch, batches waiting on update_due or their round) and samples in flight.
        due = self.updates + (not empty) + self._due + len(self._held) + self.client.in_flight
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
        if empty:  # nothing to learn on: the sample requested above stands in for it (or a one-sided draw)
            await self._sample_one_sided()
            self._report_if_done()
            return
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
                    self.drawn_ahead_batches += (ahead and _items(results[0][0]) > 0
                                                 and client.taker_samples == by_taker)
            if not results or isinstance(results[0], BaseException) or not _items(results[0][0]):
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
            shard = getattr(result, "shard", None)
            if isinstance(result, MalformedFrameError) and type(shard) is int:
                self.client.drop_one_sided(shard, getattr(result, "offer", None))  # (it fails so at every draw)
            for m in getattr(result, "notices", []):
                self.priorities.send(m)
            return False
        batch, notices = result
        for m in notices:  # (those of a batch with no item left too: its items were drawn)
            self.priorities.send(m)
        if batch is None or self._empty(batch):
            return False
        self._due += 1
        self.drawn_due.schedule(batch)
        return True

    def _empty(self, batch: SampledBatch) -> bool:
        """Whether ``batch`` holds no item: every one was dropped, its rows overwritten in the ring while
        they were read (a gather's version check, a one-sided copy's row horizon). Such a batch is not
        learned on: no update, no priority update (there is nothing to give one to; the draws' notices go
        as any draw's), counted in ``empty_batches``. Handed to ``learn``, it was an update on nothing
        (its mean loss NaN, the report's metrics with it), counted as one, and a data-parallel round on
        it all-reduced the gradients of no item."""
        if len(batch.keys):
            return False
        self.empty_batches += 1
        n = self.empty_batches
        # Said again at the 10th, the 100th, ...: reports go with updates, so a learner whose every batch
        # is empty (it samples on, and no update comes) said it once and then nothing, for good.
        if str(n).rstrip("0") == "1":
            logging.getLogger("reactor.learner").warning(
                "%s: %s held no item (every item's rows were overwritten in the replay's ring while they were "
                "read: the writers lap the ring faster than the learner reads it; a larger capacity keeps items "
                "longer); not learned on (counted in its reports' empty_batches; updates so far: %d)", self.name,
                "a sampled batch" if n == 1 else f"{n} sampled batches", self.updates)
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
                                            "drawn_ahead_batches": float(self.drawn_ahead_batches),
                                            "empty_batches": float(self.empty_batches), **metrics}))

    def _report_if_done(self) -> None:
        """The last report once no update can come (the replay answered Exhausted, or the bank ended)
        and none is due: reports go every ``report_every`` updates, and one sent at shutdown would not
        be delivered, so without it the live figures and metrics.csv would miss up to ``report_every - 1`` updates (the
        summary takes the learner's own count: :mod:`reactor.nodes._learnerend`)."""
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
