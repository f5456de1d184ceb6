"""Messages of the distributed replay service (writers, shards, samplers); msgpack-registered, never pickled.

Who sends what (see :mod:`reactor.nodes.replay` for the protocol):

* a :class:`~reactor.nodes.writer.Writer` (inside an actor) sends :class:`Steps` to one shard;
* a :class:`~reactor.nodes.replay.ReplayClient` (inside a learner) sends :class:`MassRequest` and
  :class:`SampleRequest` (both :class:`ReplayRequest`) and gets :class:`ShardMass` and
  :class:`ShardSample` (both :class:`ReplayReply`) back, or :class:`Exhausted` once no sample can
  come any more; it sends :class:`PriorityUpdate` and
  :class:`Delete` (both :class:`ItemUpdate`) to the shards owning the keys, and :class:`SampledKeys`
  for items it drew one-sidedly from a shard's shared memory;
* anyone may send :class:`CheckpointRequest` or :class:`StatisticsRequest` (both
  :class:`ReplayControl`); a shard publishes :class:`ShardStatistics`.

Every message that goes to a shard carries ``shard`` (route it with :func:`shard_key` on a keyed
connection); every reply carries ``requester`` (route it back with :func:`requester_key`).
Arrays travel as numpy arrays or CPU tensors (zero-copy frames between processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..transport.codec import register_message

__all__ = [
    "CheckpointRequest",
    "Delete",
    "Exhausted",
    "InsertAck",
    "ItemUpdate",
    "MassRequest",
    "PriorityUpdate",
    "ReplayControl",
    "ReplayReply",
    "ReplayRequest",
    "SampleRequest",
    "SampledBatch",
    "SampledKeys",
    "ShardMass",
    "ShardSample",
    "ShardStatistics",
    "StatisticsRequest",
    "Steps",
    "requester_key",
    "shard_key",
]


def shard_key(message: Any) -> int:
    """Key function of keyed connections *to* a replay bank: the shard a message is for.

    Example:
        >>> graph.connect(learner.requests, replay.requests, key=shard_key)
    """
    return int(message.shard)


def requester_key(message: Any) -> int:
    """Key function of keyed connections *from* a replay bank back to a bank of requesters.

    Example:
        >>> graph.connect(replay.replies, learner.replies, key=requester_key)
    """
    return int(message.requester)


def writer_key(message: Any) -> int:
    """Key function of keyed connections from a replay bank back to a bank of writers (actors).

    Example:
        >>> graph.connect(replay.acks, actors.acks, key=writer_key)
    """
    return int(message.writer)


# ---------------------------------------------------------------------------------- writers


@register_message
@dataclass(frozen=True)
class Steps:
    """Whole episodes or episode chunks for one shard: one message per writer flush.

    Attributes:
        shard: destination shard (bank index of the Replay reactor).
        writer: the sending writer's id (for logs and statistics).
        seq: the writer's flush counter (0, 1, ...), for logs.
        fields: field name -> ``[L, *shape]`` array of the shard's dtype, every field of the table.
        episode_end: bool ``[L]``: True on the last stored step of each episode or chunk; the last
            entry must be True (a shard takes steps from many writers, so no episode stays open
            between messages).
        item_mask: bool ``[L]`` or None: which steps become items (None: every step).
        priorities: float64 ``[L]`` or None: initial priorities (None: 1.0); ignored where
            ``item_mask`` is False.
        last: the writer's end marker: it sends nothing more to this shard (its actor took its
            whole step budget). A marker carries no rows (``fields`` empty, ``episode_end`` of
            length 0); a shard that knows its bank's writers (``Replay(writers=...)``) answers a
            request its rate limiter holds with :class:`Exhausted` once every writer has ended.
        staged: None, or where the rows are instead of ``fields`` (then empty): ``(descriptor,
            first row, rows)`` of the writer's staging region on the shard's host
            (:mod:`reactor.nodes._staging`), rows it keeps until the shard's :class:`InsertAck`.
        ack: whether the writer asks for an :class:`InsertAck` of this message. False: a later
            message's ack covers it (an ack names the latest message the shard is done with, and the
            shard takes a writer's messages in order), so a writer asks every few messages instead
            of every one (:class:`~reactor.nodes.writer.Writer`'s ``ack_every``). Anything but False
            is acknowledged.
    """

    shard: int
    writer: int
    seq: int
    fields: dict[str, Any]
    episode_end: Any
    item_mask: Any = None
    priorities: Any = None
    last: bool = False
    staged: Any = None
    ack: bool = True


@register_message
@dataclass(frozen=True)
class InsertAck:
    """A shard is done with one :class:`Steps` message of a writer, and with every one that writer
    sent it before (a shard takes a writer's messages in order): inserted, or refused as malformed
    (then logged by the shard). Sent for the messages that ask for it (:attr:`Steps.ack`). Writers
    bound their unacknowledged messages with it, so a rate limiter that holds inserts back holds the
    actors back too, instead of parking their steps.

    Attributes:
        writer: the writer's id (its actor's bank index).
        shard: the shard that took it.
        seq: the message's flush counter (the latest of that writer's messages the shard is done with).
        host: the shard's host id when it reads rows its writers stage in shared memory on its
            host (:attr:`Steps.staged`), else "".
        pid: the shard's process id with ``host`` (a writer in the same process does not stage:
            its messages are handed over as they are).
    """

    writer: int
    shard: int
    seq: int
    host: str = ""
    pid: int = 0


# ---------------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ReplayRequest:
    """Base of the requests a shard answers on its ``replies`` port.

    Attributes:
        shard: the shard asked.
        requester: the asking reactor's bank index (replies are routed back by it).
        request: the requester's id for this sample (ties replies together).
    """

    shard: int
    requester: int
    request: int


@register_message
@dataclass(frozen=True)
class MassRequest(ReplayRequest):
    """Stage 1 of a sharded sample: "what is your priority mass?"

    The shard answers with :class:`ShardMass` as soon as it can sample at least one item (its rate
    limiter allows it); until then the request is parked (no polling).
    """


@register_message
@dataclass(frozen=True)
class SampleRequest(ReplayRequest):
    """Stage 2 (or the only stage: one shard, or a one-round sample from cached masses): draw ``n`` items.

    The shard answers with :class:`ShardSample` when its rate limiter allows a sample of ``n``
    items; until then the request is parked, and served when inserts arrive. ``n == 0`` (a
    one-round sample that drew nothing from this shard) is answered at once with :class:`ShardMass`:
    the shard's current figures, which the requester needs for the batch's weights.

    Attributes:
        n: items to draw (>= 0).
        host: the requester's host id (``reactor.transport.bulk.host_id``) if it can gather rows
            from a shard's shared memory itself, else "" (the reply then carries the data).
        generation: the bulk generation of the shard's region the requester has attached (0: none;
            the reply then carries the region's descriptor).
        remote: the one-sided read backend (``"rdma"`` or ``"zmq"``) the requester can use on a
            shard of another host, else "". A shard that offers it answers with a plan, not data.
    """

    n: int = 1
    host: str = ""
    generation: int = 0
    remote: str = ""


@dataclass(frozen=True)
class ReplayReply:
    """Base of what a shard sends on its ``replies`` port.

    Attributes:
        shard: the answering shard.
        requester: the requester's bank index (routing key back).
        request: the request id being answered.
        error: empty, or why the request was refused (the client raises it).
    """

    shard: int
    requester: int
    request: int
    error: str = ""


@register_message
@dataclass(frozen=True)
class ShardMass(ReplayReply):
    """A shard's sampling mass, for drawing per-shard counts in proportion to it.

    Attributes:
        mass: sum over items of the sampler's weight (``p_i^alpha`` for Prioritized, 1 per item for
            Uniform and the deterministic selectors).
        min_mass: smallest positive item weight (for importance weights), ``inf`` if none.
        size: items in the shard.
        beta: the shard table's importance-weight exponent.
    """

    mass: float = 0.0
    min_mass: float = float("inf")
    size: int = 0
    beta: float = 0.0


@register_message
@dataclass(frozen=True)
class Exhausted(ReplayReply):
    """The request can never be granted: every writer of the bank has sent its end marker
    (:attr:`Steps.last`), no insert is parked, and the shard's rate limiter holds the request (with
    no insert to come, what it holds now it holds for good). The client drops every sample in
    flight and says so (``ReplayClient.exhausted``); a bank of data-parallel learners ends there
    together instead of one replica waiting for a batch that cannot come.
    """


@register_message
@dataclass(frozen=True)
class ShardSample(ReplayReply):
    """Items drawn by one shard.

    Either ``data`` carries the items, or (a requester on the shard's host, asynchronous runs)
    ``rows`` tells the requester which rows of the shard's shared-memory storage to gather itself:
    the GEAR path, where the shard never copies the windows.

    Attributes:
        data: field -> ``[n, ...]`` tensors as the table's read kind gives them (None with ``rows``).
        keys: int64 ``[n]`` item keys, tagged with the shard (see :func:`reactor.nodes.replay.make_keys`).
        probabilities: float64 ``[n]``, each item's probability *within the shard*.
        times_sampled: int64 ``[n]``.
        mass, min_mass, size, beta: as :class:`ShardMass`, at the time of this draw.
        rows: int64 ``[n]`` (steps) or ``[n, T]`` (windows, full form) ring slots to gather, or None.
        mask: bool ``[n, T]`` window validity of the full form (False: padding, to be zeroed), or None.
        versions: int64, shaped like ``rows``: the global step each row must hold (a row the ring
            overwrote since has another version: the reader drops its item).
        windows: int64 ``[n, 3]``, the compact form of windows that shards send (``rows``, ``mask``
            and ``versions`` are then None): per window ``(base, lo, hi)`` as
            :meth:`reactor.replay.Storage.window_spans` gives them, which the reader expands
            (:func:`reactor.replay.expand_window_spans`): 24 B a window on the wire instead of
            17 B a window position.
        window_length: ``T`` of the compact form.
        descriptor: the shard region's bulk descriptor, when the requester lacks it.
        sampling: with ``descriptor``, when the shard offers one-sided sampling to requesters on its
            host: ``{"table": SamplingPublisher.descriptor(), "region": the bulk descriptor of the
            region holding its sampling state}`` (see :mod:`reactor.replay.shared`).
    """

    data: dict[str, Any] | None = None
    keys: Any = None
    probabilities: Any = None
    times_sampled: Any = None
    mass: float = 0.0
    min_mass: float = float("inf")
    size: int = 0
    beta: float = 0.0
    rows: Any = None
    mask: Any = None
    versions: Any = None
    descriptor: dict[str, Any] | None = None
    windows: Any = None
    window_length: int = 0
    sampling: dict[str, Any] | None = None


# ---------------------------------------------------------------------------------- updates


@dataclass(frozen=True)
class ItemUpdate:
    """Base of the messages that change existing items of one shard.

    Attributes:
        shard: the shard owning every key of the message.
        keys: int64 ``[k]`` item keys (shard-tagged, as sampled).
    """

    shard: int
    keys: Any


@register_message
@dataclass(frozen=True)
class PriorityUpdate(ItemUpdate):
    """Set the priorities of items. Keys no longer in the shard (evicted since sampled) are skipped.

    Attributes:
        priorities: float ``[k]``, finite and >= 0.
    """

    priorities: Any = None


@register_message
@dataclass(frozen=True)
class Delete(ItemUpdate):
    """Delete items. Keys no longer in the shard are skipped."""


@register_message
@dataclass(frozen=True)
class SampledKeys(ItemUpdate):
    """Items a requester drew one-sidedly from the shard's published state (no request reached the
    shard): the shard counts the draws (each key's times sampled, its statistics and rate
    limiter). Keys no longer in the shard count as draws and change nothing. A requester's client
    holds its draws and sends one message per shard every few one-sided samples
    (``ReplayClient(notice_every=...)``), on the connection priority updates take."""


# ---------------------------------------------------------------------------------- control


@dataclass(frozen=True)
class ReplayControl:
    """Base of the on-demand commands a shard takes on its ``control`` port.

    Attributes:
        shard: the shard meant, or -1 for every shard that receives it (broadcast connections).
    """

    shard: int = -1


@register_message
@dataclass(frozen=True)
class CheckpointRequest(ReplayControl):
    """Checkpoint now (in the background) into the shard's run directory."""


@register_message
@dataclass(frozen=True)
class StatisticsRequest(ReplayControl):
    """Publish :class:`ShardStatistics` now."""


@register_message
@dataclass(frozen=True)
class ShardStatistics:
    """A shard's state and counters (items unless named otherwise).

    Attributes:
        shard: the shard's bank index.
        size: items now.
        num_steps: steps stored now.
        num_episodes: episodes (and chunks) stored now.
        inserted, sampled, evicted, removed, expired, deleted: the table's counters.
        rejected_steps: steps refused because their message was malformed (logged with the writer).
        parked_requests: sample requests waiting for the rate limiter now.
        parked_steps: steps waiting for the rate limiter to allow their insert now.
        checkpoints: checkpoints completed by this shard since it started.
        restored_from: the checkpoint directory the shard restored from at start, or "".
        lost_steps: after a restart (restart policies): steps its previous life had inserted that
            the restore did not bring back (inserted after its last checkpoint); -1 when that is
            unknown (no run directory, or the shard moved to another host); 0 otherwise.
        staged_steps: steps this shard read from its writers' staging regions (rows a writer of its
            host staged in shared memory, :mod:`reactor.nodes._staging`) since it started.
    """

    shard: int
    size: int
    num_steps: int
    num_episodes: int
    inserted: int
    sampled: int
    evicted: int
    removed: int
    expired: int
    deleted: int
    rejected_steps: int
    parked_requests: int
    parked_steps: int
    checkpoints: int
    restored_from: str
    lost_steps: int = 0
    staged_steps: int = 0


# ---------------------------------------------------------------------------------- learner side


@register_message
@dataclass(frozen=True)
class SampledBatch:
    """What a learner gets from :class:`~reactor.nodes.replay.ReplayClient`: one batch over all shards.

    Items are grouped by shard (shard 0's first). Importance weights use the global total and
    size: ``w_i = (P(i) / min_j P(j))^-beta`` with ``P`` over all shards (PER eq. 2, normalized by
    the largest weight).

    Attributes:
        data: field -> ``[B, ...]`` tensor (the table's read kind).
        keys: int64 ``[B]`` shard-tagged keys, for :meth:`ReplayClient.update_priorities`.
        weights: float32 ``[B]`` importance weights in (0, 1].
        probabilities: float64 ``[B]`` global sampling probabilities.
        table_size: items over all shards asked, when the batch was drawn.
        times_sampled: int64 ``[B]``.
    """

    data: dict[str, Any]
    keys: Any
    weights: Any
    probabilities: Any
    table_size: int
    times_sampled: Any
