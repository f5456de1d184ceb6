"""Writer: an actor's client of the replay shards (pure logic: no ports, used inside a reaction).

An actor steps ``N`` environments side by side (a vector env) and hands the writer each step as a
dict of ``[N, ...]`` arrays. The writer keeps one row buffer per env stream, cuts the streams into
stored segments by a declared :class:`TransitionPattern` or :class:`WindowPattern`, and flushes
segments in batches: one :class:`~reactor.nodes.messages.Steps` message per flush, never one per
step, to the shard chosen for it.

**Storage convention** (``reactor.replay.Storage.read_transitions``). Row ``t`` of a segment holds
``o_t`` and the ``a_t``, ``r_t`` taken from it. The last row of an episode holds the final
observation (its other fields zero). The ``terminated`` field (if the table has one) is True only
on that final row, and only if the episode terminated: n-step targets then stop bootstrapping at
true terminals and do bootstrap at truncations.

**Chunks.** A shard keeps one open episode at a time and takes steps from many writers, so the
writer never leaves an episode open: long episodes go out as *chunks*. A chunk boundary is a
truncation whose next chunk starts with the same observation: the chunk's last row is the next
chunk's first anchor (stored twice), with ``terminated`` False. Consecutive chunks overlap by the
pattern's context so that every item (anchor) is read in full from one chunk:

* :class:`TransitionPattern` ``(n)``: ``n`` rows after each anchor (the n-step rewards and the
  bootstrap observation);
* :class:`WindowPattern` ``(length T, pad)``: ``T - 1`` rows after (``pad="tail"``: windows start
  at their anchor) or before (``pad="head"``: windows end at their anchor).

Each step becomes an item exactly once (in the chunk where it is an anchor); context rows and the
final-observation row are not items (``item_mask``).

Cost: one vectorized write per field per step; Python work per finished episode or chunk, never per
stream per step.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from .._native import numpy_twin
from ..replay._tablekernels import _nb_first_bad_priority, _nb_first_unfit
from .messages import Steps
from .replay import parse_fields

__all__ = ["TransitionPattern", "WindowPattern", "Writer"]


@dataclass(frozen=True)
class TransitionPattern:
    """Cut streams for n-step transition items.

    Attributes:
        n: the n of the table's ``TransitionRead`` (rows of context after each anchor).
        chunk_length: anchors per chunk of a long episode (shorter episodes go out whole).
    """

    n: int = 1
    chunk_length: int = 256

    def __post_init__(self) -> None:
        _check_int("TransitionPattern n", self.n, 1)
        _check_int("TransitionPattern chunk_length", self.chunk_length, 1)

    def context(self) -> tuple[int, int]:
        """Rows kept before and after the anchors of a chunk."""
        return 0, self.n


@dataclass(frozen=True)
class WindowPattern:
    """Cut streams for sequence-window items (the table reads ``WindowRead(length, pad)``).

    Attributes:
        length: the window length T.
        pad: ``"tail"`` (a window starts at its anchor) or ``"head"`` (it ends at its anchor).
        chunk_length: anchors per chunk of a long episode.
    """

    length: int
    pad: Literal["head", "tail"] = "tail"
    chunk_length: int = 256

    def __post_init__(self) -> None:
        _check_int("WindowPattern length", self.length, 1)
        _check_int("WindowPattern chunk_length", self.chunk_length, 1)
        if self.pad not in ("head", "tail"):
            raise ValueError(f"WindowPattern pad must be 'head' or 'tail', got {self.pad!r}")

    def context(self) -> tuple[int, int]:
        """Rows kept before and after the anchors of a chunk."""
        return (self.length - 1, 0) if self.pad == "head" else (0, self.length - 1)


def _check_int(what: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{what} must be an int >= {lo}, got {v!r}")


def _numpy(what: str, value: Any, name: str | None = None) -> np.ndarray:
    """``value`` as a numpy array; ``what`` (and ``name``) name it in the refusal (``field 'obs'``,
    ``priorities``: put together only then, as this runs for every field of every step)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    try:
        return np.asarray(value)
    except Exception as e:  # noqa: BLE001 - reported with what it was (a ragged list: numpy's ValueError)
        why = (str(e).splitlines() or [type(e).__name__])[0]
        what = what if name is None else f"{what} {name!r}"
        raise ValueError(f"Writer.append: {what} is a {type(value).__name__} numpy cannot make an array of ({why:.200}); "
                         f"pass an array or tensor [N, *shape]") from None


def _flags(what: str, value: Any, n: int) -> np.ndarray:
    """``terminated``, ``truncated`` or ``active`` as a bool ``[n]`` array: bools, or numbers 0 and 1.
    (``np.asarray(x, dtype=bool)`` made the string "False" True, and NaN and 0.5 True: an episode cut
    where none ended.)"""
    v = _numpy(what, value).reshape(-1)
    if v.shape != (n,):
        raise ValueError(f"Writer.append: {what} must be bool [{n}], got shape {v.shape}")
    if v.dtype == np.bool_:
        return v
    if v.dtype.kind not in "iuf":
        raise ValueError(f"Writer.append: {what} must be bool [{n}] (or 0 and 1), got an array of dtype {v.dtype}")
    bad = (v != 0) & (v != 1)  # (NaN too)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"Writer.append: {what} of stream {i} is {v[i].item()!r}; it must be a bool (or 0 or 1)")
    return v.astype(bool)


@functools.cache
def _cast(src: np.dtype[Any], dst: np.dtype[Any]) -> str:
    """How values of dtype ``src`` go into a ``dst`` step buffer: ``"exact"`` (every value: a safe
    cast, or a number rounded to a float field's precision; whether it stays finite there is
    :func:`_check_finite`'s), ``"values"`` (only some: each is checked, e.g. a float into an int field)
    or ``"refused"`` (not real numbers: strings, objects, complex)."""
    if src.kind not in "biufc" or (src.kind == "c" and dst.kind != "c"):
        return "refused"
    if np.can_cast(src, dst, "safe") or dst.kind in "fc":
        return "exact"
    return "values"


def _first_unfit_f16(value: np.ndarray, limit: float) -> int:
    """``_nb_first_unfit`` of float16 values, which numba does not take: looked at as float32 (exact:
    every float16, inf and NaN included, is a float32)."""
    return int(_nb_first_unfit(value.astype(np.float32), limit))


def _first_unfit(value: np.ndarray, limit: float) -> int:
    """``_nb_first_unfit`` for any float or int dtype (:func:`_unfit_check` picks it once per dtype)."""
    return int(_unfit_check(value.dtype)(value, limit))


def _unfit_check(src: np.dtype[Any]) -> Callable[[np.ndarray, float], int]:
    """The kernel that finds the first unfit value of ``src`` values."""
    return _first_unfit_f16 if src.char == "e" else _nb_first_unfit


@functools.cache
def _unfit_limit(src: np.dtype[Any], dst: np.dtype[Any]) -> float | None:
    """The least magnitude of a ``src`` value that a float field of dtype ``dst`` cannot hold finite (it
    rounds to infinity there, or is NaN or infinite already), or None when no ``src`` value can be such
    (ints and bools into float32 or float64). Round to nearest even: a value at or past the midpoint
    between the dtype's largest finite and the next power of two becomes inf."""
    if src.kind not in "iuf" or dst.kind != "f":  # (bools are 0 and 1; what is not a number is refused before)
        return None
    if dst.itemsize >= 8 or (src.kind == "f" and src.itemsize <= dst.itemsize):
        return math.inf if src.kind == "f" else None  # (only a NaN or an infinity already there)
    big = float(np.finfo(dst).max)
    limit = big + (big - float(np.nextafter(dst.type(big), dst.type(0)))) / 2
    return limit if src.kind == "f" or float(np.iinfo(src).max) >= limit else None


def _say_unfit(what: str, value: np.ndarray, dst: np.dtype[Any], streams: np.ndarray | None) -> None:
    """Raise naming the first value of ``value`` (``[n, *shape]``, row ``i`` of stream ``streams[i]``;
    None: stream ``i``) that a float field of dtype ``dst`` would not hold finite: a NaN or an infinity
    given, or a number too large for ``dst`` (numpy's setitem casts 1e39 into float32 as inf, in silence).
    Either would be sampled into every update that draws it."""
    i = _first_unfit(value, _unfit_limit(value.dtype, dst))
    flat = value.reshape(-1)
    per_row = max(1, math.prod(value.shape[1:]))
    stream = i // per_row if streams is None else int(streams[i // per_row])
    x = flat[i].item()
    if math.isfinite(x):
        raise ValueError(f"Writer.append: {what} of stream {stream} is {x!r}, which the field's {dst} cannot hold (it "
                         f"would be {'-' if x < 0 else ''}inf there); scale it down, or declare the field float64")
    raise ValueError(f"Writer.append: {what} of stream {stream} is {x!r}; replay keeps finite numbers only (every "
                     f"update that samples a NaN or an infinity learns from it: its loss goes NaN): fix it in the env, "
                     f"or wrap the env to clip or replace such values")


def _check_finite(what: str, value: np.ndarray, dst: np.dtype[Any], streams: np.ndarray | None) -> None:
    """:func:`_say_unfit` if a value of ``value`` would not be finite in the float field's ``dst``."""
    limit = _unfit_limit(value.dtype, dst)
    if limit is not None and _first_unfit(value, limit) >= 0:
        _say_unfit(what, value, dst, streams)


@functools.cache
def _iinfo(dst: np.dtype[Any]) -> np.iinfo[Any]:
    return np.iinfo(dst)  # (made anew, it costs more than the check it serves)


def _check_exact(what: str, value: np.ndarray, dst: np.dtype[Any], streams: np.ndarray | None) -> None:
    """Raise unless every value converts to ``dst`` exactly (numpy's setitem would cast silently:
    NaN into int64 is -2**63, 2.7 is 2, "1.5" is 1.5). ``value``: ``[n, *shape]``, row ``i`` of stream
    ``streams[i]`` (None: stream ``i``). Called only when the dtypes differ (not per step otherwise)."""
    how = _cast(value.dtype, dst)
    if how == "exact":
        return
    per_row = max(1, math.prod(value.shape[1:]))
    if how == "refused":  # (the first value that is not a number: the stream to name)
        items = value.reshape(-1).tolist()
        i = next((j for j, x in enumerate(items) if not isinstance(x, numbers.Real)), 0)
        stream = i // per_row if streams is None else int(streams[i // per_row])
        x = items[i] if items else None
        raise ValueError(f"Writer.append: {what} of stream {stream} is {x!r:.40}, in an array of dtype {value.dtype}, "
                         f"not of numbers; the field is {dst}: pass numbers")
    if value.size == 0:
        return
    # A few whole-array reductions when all is well (NaN fails every comparison); where, only when not.
    if dst.kind == "b":
        if ((value == 0) | (value == 1)).all():
            return
        bad = (value != 0) & (value != 1)
        allowed = "0 or 1 (or bools)"
    else:
        info = _iinfo(dst)
        if value.dtype.kind == "f":  # (its bounds, -2**k and 2**k, are exact as floats)
            lo, end = float(info.min), float(info.max + 1)
            if value.min() >= lo and value.max() < end and (np.trunc(value) == value).all():
                return
            bad = ~((value >= lo) & (value < end) & (np.trunc(value) == value))
        else:
            if value.min() >= info.min and value.max() <= info.max:
                return
            bad = (value < info.min) | (value > info.max)
        allowed = f"whole numbers in [{info.min}, {info.max}]"
    i = int(np.argmax(bad.reshape(-1)))
    stream = i // per_row if streams is None else int(streams[i // per_row])
    raise ValueError(f"Writer.append: {what} of stream {stream} is {value.reshape(-1)[i].item()!r}, which the "
                     f"field's {dst} cannot hold exactly; pass {allowed}")


class Writer:
    """Appends steps of ``num_streams`` parallel env streams and flushes them to replay shards.

    Args:
        fields: the shard table's fields (FieldSpecs, ``(name, shape, dtype)`` tuples or dicts, as
            :class:`~reactor.nodes.replay.Replay` takes them).
        num_streams: N, the envs stepped side by side.
        pattern: :class:`TransitionPattern` or :class:`WindowPattern` (how items are cut).
        num_shards: the replay bank's size.
        writer_id: this writer's id (e.g. the actor's bank index), in messages and for the shard choice.
        shard: send every flush to this shard (e.g. the co-located one); None: round-robin over the
            shards, starting at ``writer_id % num_shards``, skipping shards that hold ``max_unacked``
            unacknowledged messages (:meth:`acknowledged`): a shard whose rate limiter parks inserts
            gets no more until it catches up, so a writer held back by flow control is never stuck on
            one shard while another waits for its steps.
        max_unacked: the flow-control limit per shard (None: no limit, plain round-robin).
        ack_every: ask a shard for an ack (:attr:`Steps.ack`) on every this many messages to it, and
            on the one that brings it to ``max_unacked`` (and on end markers); an ack counts for every
            message before it. Each ack costs both processes a wake-up. None: ``max_unacked // 2``
            (at least 1; 1 without ``max_unacked``), so that the shard still holds half the messages
            in flight when an ack reaches the writer.
        flush_steps: flush when at least this many rows are ready (one message per flush).
        obs_fields: fields that take the final observation on an episode's last row.
        terminated_field: the per-step terminal flag the writer fills (skipped if not a field).
        first_seq: the first message's ``seq``. A restarted actor's writer starts past its last
            life's (``restarts << 32``): a shard's ack of one of that life's messages, which it still
            held (parked), then matches none of this life's and counts for nothing.

    Raises:
        ValueError: a bad argument, or ``obs_fields`` not among the fields.

    Example:
        >>> w = Writer([("obs", (4,), "float32"), ("action", (), "int64"), ("reward", (), "float32"),
        ...             ("terminated", (), "bool")], num_streams=8, pattern=TransitionPattern(n=3),
        ...            num_shards=2, writer_id=self.bank_index)
        >>> obs2, reward, term, trunc, _ = env.step(action)
        >>> msgs = w.append({"obs": obs, "action": action, "reward": reward}, terminated=term,
        ...                 truncated=trunc, final={"obs": obs2})   # gymnasium NEXT_STEP autoreset
        >>> for m in msgs: self.steps.send(m)
    """

    def __init__(
        self,
        fields: Sequence[Any],
        num_streams: int,
        pattern: TransitionPattern | WindowPattern,
        *,
        num_shards: int = 1,
        writer_id: int = 0,
        shard: int | None = None,
        max_unacked: int | None = None,
        flush_steps: int = 1024,
        obs_fields: Sequence[str] = ("obs",),
        terminated_field: str = "terminated",
        first_seq: int = 0,
        ack_every: int | None = None,
    ) -> None:
        self.specs = parse_fields(fields)
        _check_int("Writer num_streams", num_streams, 1)
        _check_int("Writer num_shards", num_shards, 1)
        _check_int("Writer flush_steps", flush_steps, 1)
        if max_unacked is not None:
            _check_int("Writer max_unacked", max_unacked, 1)
        if ack_every is not None:
            _check_int("Writer ack_every", ack_every, 1)
        if not isinstance(pattern, (TransitionPattern, WindowPattern)):
            raise ValueError(f"Writer pattern must be a TransitionPattern or WindowPattern, got {pattern!r:.100}")
        if shard is not None and not (isinstance(shard, int) and 0 <= shard < num_shards):
            raise ValueError(f"Writer shard must be None or in [0, {num_shards}), got {shard!r}")
        names = [s.name for s in self.specs]
        missing = [f for f in obs_fields if f not in names]
        if missing:
            raise ValueError(f"Writer obs_fields {missing} are not fields of the table {names}")
        self.num_streams = num_streams
        self.pattern = pattern
        self.num_shards = num_shards
        self.writer_id = writer_id
        self.fixed_shard = shard
        self._next_shard = writer_id % num_shards
        self.unacked = np.zeros(num_shards, dtype=np.int64)  # messages sent per shard, not yet acknowledged
        # Per shard, those messages in order: (seq, whether it asked for an ack); an ack counts for every
        # one up to the seq it names. And how many were sent since the last one that asked.
        self._sent: list[deque[tuple[int, bool]]] = [deque() for _ in range(num_shards)]
        self._unasked = np.zeros(num_shards, dtype=np.int64)
        if ack_every is None:
            ack_every = max(1, max_unacked // 2) if max_unacked is not None else 1
        self.ack_every = ack_every
        self.down = np.zeros(num_shards, dtype=bool)  # shards whose process died and is being restarted
        self.n_down = 0
        self.lost_messages = 0  # sent to a shard that died before acknowledging them
        self.max_unacked = max_unacked
        self.flush_steps = flush_steps
        self.obs_fields = tuple(obs_fields)
        self.terminated_field = terminated_field if terminated_field in names else None
        # The fields an actor gives per step: all but the terminal flag, which the writer fills.
        self.step_fields = [s.name for s in self.specs if s.name != self.terminated_field]
        self.before, self.after = pattern.context()
        self.chunk = pattern.chunk_length
        rows = self.before + self.chunk + self.after + 1
        twins = {s.name: numpy_twin(s.dtype) for s in self.specs}
        for spec in self.specs:
            if twins[spec.name] is None:  # numpy's own error here names neither the field nor the fix
                raise ValueError(
                    f"Writer field {spec.name!r} has dtype {spec.dtype}, which numpy (the writer's step buffers) "
                    "cannot hold; declare the field float16 or float32, in the table and in the writer alike"
                )
        self._np_dtypes: dict[str, np.dtype[Any]] = twins  # type: ignore[assignment]
        # Per float field, the dtype its values last came in and the magnitude from which they are not
        # finite in the field (_unfit_limit; None: none can be), and the kernel that looks (_unfit_check).
        self._unfit: dict[str, tuple[np.dtype[Any] | None, float | None, Any]] = dict.fromkeys(
            (n for n, dt in twins.items() if dt is not None and dt.kind == "f"), (None, None, None))
        # numba's first kernel in a process sets up its compiler context before it loads the cached code
        # (~0.5 s: its registries' imports): paid here, as the writer is made (an actor's startup), not at
        # the first step, inside the run's clock, holding every reaction of the process back. (float64: the
        # kernel takes no float16.)
        _nb_first_unfit(np.zeros(1), math.inf)
        self._shapes = {s.name: s.shape for s in self.specs}
        self._buf = {
            n: np.zeros((num_streams, rows, *self._shapes[n]), dtype=self._np_dtypes[n]) for n in self.step_fields
        }
        self._prio = np.ones((num_streams, rows), dtype=np.float64)
        # The same memory as [stream * rows + row]: one step's rows of all streams are written through a
        # single flat index (a 2-D fancy index costs numpy ~2x more per field).
        self._rows = rows
        self._flat = {n: b.reshape(num_streams * rows, *b.shape[2:]) for n, b in self._buf.items()}
        self._prio_flat = self._prio.reshape(-1)
        self._has_prio = False
        self._len = np.zeros(num_streams, dtype=np.int64)  # rows buffered per stream
        self._a0 = np.zeros(num_streams, dtype=np.int64)  # first row not yet made an item
        self._streams = np.arange(num_streams)
        self._pending: list[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, bool]] = []
        self._pending_rows = 0
        if isinstance(first_seq, bool) or not isinstance(first_seq, int) or not 0 <= first_seq < 2**62:
            raise ValueError(f"Writer first_seq must be an int in [0, 2**62), got {first_seq!r}")
        self.first_seq = first_seq
        self.seq = first_seq
        self.ended = False  # end() was called: the end markers went out
        self.steps_appended = 0
        self.items_sent = 0
        self.steps_sent = 0
        self._staging: Any = None  # a _staging.Staging: flushes for shards of this host go through it
        self.staging_refused = False  # no staging region could be had in this process (said once)

    def use_staging(self, staging: Any) -> None:
        """Stage flushes for the shards of this host in ``staging`` (a
        :class:`reactor.nodes._staging.Staging` with a ring per shard): their rows go through shared
        memory, the message says where. At any time: the messages already out hold no staged rows."""
        if staging.num_shards != self.num_shards:
            raise ValueError(f"Writer.use_staging: staging for {staging.num_shards} shards, the writer has {self.num_shards}")
        staging.start([len(sent) for sent in self._sent])
        self._staging = staging

    @property
    def staging(self) -> Any:
        """The writer's :class:`reactor.nodes._staging.Staging`, or None."""
        return self._staging

    # ---------------------------------------------------------------- appending

    def append(
        self,
        step: Mapping[str, Any],
        *,
        terminated: Any,
        truncated: Any,
        final: Mapping[str, Any] | None = None,
        priorities: Any = None,
        active: Any = None,
    ) -> list[Steps]:
        """Append one step of every stream; returns the messages ready to send (usually none).

        Args:
            step: field -> ``[N, *shape]`` (every table field but the terminal flag): ``o_t`` and
                what was done from it (``a_t``, ``r_t``, extras).
            terminated, truncated: bool ``[N]``: the episode ended after this step (true terminal
                / time limit).
            final: field -> ``[N, *shape]`` final observations (``obs_fields``), read only for
                streams whose episode ended (with gymnasium's default autoreset, the observation
                ``env.step`` returned).
            priorities: ``[N]`` initial priorities of this step's items (None: the shard's default).
            active: bool ``[N]`` or None (all): streams whose step is real. With gymnasium's default
                (NEXT_STEP) autoreset, the step after an episode ended only resets that env: pass
                ``active=~ended_last_step`` so it is not stored.

        Returns:
            :class:`Steps` messages for the shards (one per flush).

        Raises:
            ValueError: every refusal of what it was given (a refusal, as the other nodes' are: one
                line from ``reactor run``): a field missing or unknown, a wrong shape, ``final``
                missing for a stream that ended, a value or priority that is not a number (a string,
                an object, a complex number), a priority that is not finite and >= 0, a value its
                field's dtype cannot hold exactly (NaN, inf or a fraction for an int field, one out of
                its range, other than 0 or 1 for a bool field), a value a float field would not hold
                finite (NaN, an infinity, or a number too large for its dtype: float64's 1e39 for a
                float32 field; a float field takes any other number, rounded to its precision), or a
                ``terminated``, ``truncated`` or ``active`` flag that is not a bool, 0 or 1 (the
                string "False" and NaN were True).
            A bad value or priority names its stream (and field). Nothing is appended when these raise.
        """
        n = self.num_streams
        unknown = sorted(set(step) - set(self.step_fields))
        if unknown:
            raise ValueError(f"Writer.append: unknown field(s) {unknown}; the table's step fields are {self.step_fields}")
        missing = sorted(set(self.step_fields) - set(step))
        if missing:
            raise ValueError(f"Writer.append: missing field(s) {missing}; every step needs {self.step_fields}")
        values = {}
        for name in self.step_fields:
            v = _numpy("field", step[name], name)
            want = (n, *self._shapes[name])
            if v.shape != want:
                raise ValueError(f"Writer.append: field {name!r} has shape {v.shape}, expected {want} ([N, *shape])")
            values[name] = v
        term = _flags("terminated", terminated, n)
        trunc = _flags("truncated", truncated, n)
        if active is None:
            idx = self._streams
            ended = term | trunc
        else:
            act = _flags("active", active, n)
            idx = np.flatnonzero(act)
            ended = (term | trunc) & act
        # What the streams give is written as it is (the step buffers would cast silently): a value
        # its field cannot hold exactly is refused (only where the dtypes differ), and so is one a float
        # field would not hold finite (NaN, an infinity, or too large for its dtype: one compiled pass).
        streams = None if active is None else idx
        for name, v in values.items():
            dt = self._np_dtypes[name]
            if v.dtype != dt:
                if active is not None:
                    values[name] = v = v[idx]  # (the rows written: inactive streams' are never read)
                _check_exact(f"field {name!r}", v, dt, streams)
            elif active is not None:
                values[name] = v = v[idx]
            unfit = self._unfit.get(name)  # (a float field; inline, its limit cached: every such field every step)
            if unfit is not None:
                src, limit, first_unfit = unfit
                if src is not v.dtype:
                    limit, first_unfit = _unfit_limit(v.dtype, dt), _unfit_check(v.dtype)
                    self._unfit[name] = (v.dtype, limit, first_unfit)
                if limit is not None and first_unfit(v, limit) >= 0:
                    _say_unfit(f"field {name!r}", v, dt, streams)
        finals: dict[str, np.ndarray] = {}
        if ended.any():
            if final is None:
                raise ValueError("Writer.append: an episode ended but final=None; pass the final observations")
            for name in self.obs_fields:
                if name not in final:
                    raise ValueError(f"Writer.append: final lacks {name!r} (obs_fields={list(self.obs_fields)})")
                v = _numpy("final", final[name], name)
                if v.shape != (n, *self._shapes[name]):
                    raise ValueError(f"Writer.append: final {name!r} has shape {v.shape}, expected {(n, *self._shapes[name])}")
                dt = self._np_dtypes[name]
                if v.dtype != dt or dt.kind == "f":
                    done = np.flatnonzero(ended)
                    if v.dtype != dt:
                        _check_exact(f"final {name!r}", v[done], dt, done)
                    if dt.kind == "f":
                        _check_finite(f"final {name!r}", v[done], dt, done)
                finals[name] = v
        if priorities is not None:
            raw = _numpy("priorities", priorities)
            if raw.dtype.kind not in "biuf":
                raise ValueError(f"Writer.append: priorities must be numbers, got dtype {raw.dtype}")
            prio = raw.astype(np.float64, copy=False).reshape(-1)
            if prio.shape != (n,):
                raise ValueError(f"Writer.append: priorities must have shape ({n},), got {prio.shape}")
            # (checked here: the shard would refuse the whole message, every other stream's items with it)
            written = prio if active is None else prio[idx]
            bad = int(_nb_first_bad_priority(written))
            if bad >= 0:
                stream = bad if active is None else int(idx[bad])
                raise ValueError(f"Writer.append: stream {stream}'s priority is {float(written[bad])!r}; priorities "
                                 f"must be finite and >= 0")
        pos = self._len[idx]
        at = idx * self._rows + pos  # each stream's next row, as a flat index
        if priorities is not None:
            self._prio_flat[at] = written
            self._has_prio = True
        # One vectorized write per field for all streams (numpy casts to the field's dtype: exactly, checked above).
        for name, v in values.items():
            self._flat[name][at] = v
        self._len[idx] += 1
        self.steps_appended += len(idx)
        for i in np.flatnonzero(ended):  # per finished episode
            self._end_episode(int(i), bool(term[i]), finals)
        full = np.flatnonzero(self._len - self._a0 >= self.chunk + self.after)
        for i in full:  # per chunk
            self._cut_chunk(int(i))
        if self._pending_rows >= self.flush_steps:
            return self.flush()
        return []

    def _segment(self, i: int, lo: int, hi: int, a_lo: int, a_hi: int, *, terminated: bool = False,
                 final_row: bool = False) -> None:
        """Queue rows [lo, hi) of stream i as one stored segment; rows [a_lo, a_hi) are its items."""
        rows = hi - lo
        data = {name: buf[i, lo:hi].copy() for name, buf in self._buf.items()}
        if self.terminated_field is not None:
            t = np.zeros(rows, dtype=self._np_dtypes[self.terminated_field])
            if final_row and terminated:
                t[-1] = True
            data[self.terminated_field] = t
        mask = np.zeros(rows, dtype=bool)
        mask[a_lo - lo : a_hi - lo] = True
        prio = self._prio[i, lo:hi].copy()
        self._pending.append((data, mask, prio, True))
        self._pending_rows += rows

    def _end_episode(self, i: int, terminated: bool, finals: Mapping[str, np.ndarray]) -> None:
        last = int(self._len[i])  # the final-observation row goes here
        for name, buf in self._buf.items():
            buf[i, last] = finals[name][i] if name in finals else 0
        self._prio[i, last] = 1.0
        hi = last + 1
        a0 = int(self._a0[i])
        if last > a0:  # anchors [a0, last): every step not yet an item (the final row is not one)
            self._segment(i, max(0, a0 - self.before), hi, a0, last, terminated=terminated, final_row=True)
        self._len[i] = 0
        self._a0[i] = 0

    def _cut_chunk(self, i: int) -> None:
        a0 = int(self._a0[i])
        a_hi = a0 + self.chunk
        lo = max(0, a0 - self.before)
        self._segment(i, lo, a_hi + self.after, a0, a_hi)
        keep = max(0, a_hi - self.before)  # rows before this are no longer needed (next chunk's context)
        n_keep = int(self._len[i]) - keep
        if keep:
            for buf in self._buf.values():
                buf[i, :n_keep] = buf[i, keep : keep + n_keep]
            self._prio[i, :n_keep] = self._prio[i, keep : keep + n_keep]
        self._len[i] = n_keep
        self._a0[i] = a_hi - keep

    # ---------------------------------------------------------------- flushing

    @property
    def pending_steps(self) -> int:
        """Rows in segments ready to flush."""
        return self._pending_rows

    def acknowledged(self, shard: int, host: str = "", pid: int = 0, seq: Any = None) -> int:
        """A shard acknowledged this writer's messages up to ``seq`` (an ``InsertAck``; ``host`` and
        ``pid``: its own, the shard's host id and process when it can read rows staged on its host).
        It counts for every message in flight to that shard up to the one ``seq`` names (the shard
        takes them in order, and acks only those that ask: :attr:`Steps.ack`); an int ``seq`` of no
        message in flight counts for none (a stray ack, or one in transit when the shard died); no
        ``seq`` (None) counts for the oldest message that asked for an ack and those before it. With
        staging, what those messages staged is freed (counted by an ack without a seq: with the next
        one that names a message in flight). Returns how many messages in flight it counted for."""
        if not (isinstance(shard, int) and 0 <= shard < self.num_shards):
            raise ValueError(f"Writer.acknowledged: shard must be in [0, {self.num_shards}), got {shard!r}")
        if type(seq) is int and seq < self.first_seq:
            return 0  # (of an earlier life's message: neither in this life's count nor in its rings)
        sent = self._sent[shard]
        n = 0
        if type(seq) is not int:
            asked = False
            while sent and not asked:  # (at most ack_every, or max_unacked, messages)
                asked = sent.popleft()[1]
                n += 1
        else:
            n = next((i + 1 for i, (s, _) in enumerate(sent) if s == seq), 0)  # (at most max_unacked)
            for _ in range(n):
                sent.popleft()
        # (no seq and none in flight: still one message counted, of those a user's actor counts itself)
        self.unacked[shard] = max(0, int(self.unacked[shard]) - (n if type(seq) is int else max(n, 1)))
        if self._staging is not None:
            self._staging.acked(shard, n, host, pid, named=type(seq) is int)
        return n

    def shard_lost(self, shard: int) -> None:
        """``shard``'s process died (restart policies): send nothing to it until
        :meth:`shard_restarted`; what it had not acknowledged is lost (``lost_messages``)."""
        self.down[shard] = True
        self.n_down = int(self.down.sum())
        self.lost_messages += int(self.unacked[shard])
        self.unacked[shard] = 0
        self._sent[shard].clear()
        self._unasked[shard] = 0
        if self._staging is not None:
            self._staging.lost(shard)

    def shard_restarted(self, shard: int) -> list[Steps]:
        """``shard`` takes messages again (restored from its checkpoint, if it has one). Returns the
        messages to send it: this writer's end marker again once it has ended (the shard's previous
        life counted it; its new one has not)."""
        self.down[shard] = False
        self.n_down = int(self.down.sum())
        return [self._end_marker(shard)] if self.ended else []

    def full(self) -> bool:
        """Every shard this writer may send to holds ``max_unacked`` unacknowledged messages, or is down."""
        if self.fixed_shard is not None:
            s = self.fixed_shard
            return bool(self.down[s]) or (self.max_unacked is not None and int(self.unacked[s]) >= self.max_unacked)
        if self.n_down == 0:  # the common case, once per env step: no mask to build
            return self.max_unacked is not None and int(self.unacked.min()) >= self.max_unacked
        if self.n_down == self.num_shards:
            return True
        return self.max_unacked is not None and int(self.unacked[~self.down].min()) >= self.max_unacked

    def end(self) -> list[Steps]:
        """The writer's last messages: what is ready (as :meth:`flush`; open episodes stay
        incomplete and are never sent), then an end marker (:attr:`Steps.last`) for every shard that
        is up, whatever their unacknowledged counts: it tells a shard that no insert will come from
        this writer (``Replay(writers=...)``). A second call returns nothing."""
        if self.ended:
            return []
        self.ended = True
        return [*self.flush(), *(self._end_marker(k) for k in range(self.num_shards) if not self.down[k])]

    def _end_marker(self, shard: int) -> Steps:
        self.unacked[shard] += 1  # acknowledged as any message (always asked for: nothing may follow it)
        self._sent[shard].append((self.seq, True))
        self._unasked[shard] = 0
        if self._staging is not None:
            self._staging.sent(shard, 0)
        msg = Steps(shard, self.writer_id, self.seq, {}, np.zeros(0, dtype=bool), last=True)
        self.seq += 1
        return msg

    def flush(self) -> list[Steps]:
        """One message with every ready segment (none if nothing is ready). Open episodes stay buffered."""
        if not self._pending:
            return []
        segs, self._pending = self._pending, []
        self._pending_rows = 0
        names = list(segs[0][0])
        mask = np.concatenate([s[1] for s in segs])
        ends = np.zeros(len(mask), dtype=bool)
        ends[np.cumsum([len(s[1]) for s in segs]) - 1] = True
        prio = np.concatenate([s[2] for s in segs]) if self._has_prio else None
        if self.fixed_shard is not None:
            shard = self.fixed_shard
        else:
            shard = self._next_shard
            if self.down[shard] or (self.max_unacked is not None and self.unacked[shard] >= self.max_unacked):
                order = (shard + np.arange(self.num_shards)) % self.num_shards
                load = np.where(self.down[order], np.iinfo(np.int64).max, self.unacked[order])
                shard = int(order[np.argmin(load)])  # skip full and down shards: the least loaded
            self._next_shard = (shard + 1) % self.num_shards
        self.unacked[shard] += 1
        self._unasked[shard] += 1
        # Ask for an ack every ack_every messages, and on one that fills the shard's flow-control limit
        # (the writer may send it nothing more until that ack: it must be asked for).
        ask = bool(self._unasked[shard] >= self.ack_every
                   or (self.max_unacked is not None and self.unacked[shard] >= self.max_unacked))
        if ask:
            self._unasked[shard] = 0
        self._sent[shard].append((self.seq, ask))
        staged = None
        if self._staging is not None:
            staged = self._staging.put(shard, names, [s[0] for s in segs], len(mask))
        if staged is not None:
            fields: dict[str, Any] = {}
        else:
            fields = {n: np.concatenate([s[0][n] for s in segs]) if len(segs) > 1 else segs[0][0][n] for n in names}
        msg = Steps(shard, self.writer_id, self.seq, fields, ends, None if mask.all() else mask, prio, staged=staged,
                    ack=ask)
        self.seq += 1
        self.items_sent += int(mask.sum())
        self.steps_sent += len(mask)
        return [msg]
