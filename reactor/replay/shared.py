"""One-sided sampling: a table's sampling state in memory that readers in other processes map.

GEAR's promise is that a learner samples where the data lives without the owner's help. A
:class:`~reactor.replay.Table` whose sampler is :class:`~reactor.replay.Uniform` or
:class:`~reactor.replay.Prioritized` keeps everything a draw needs in a few flat arrays: the sum and
min trees (or the dense list of present slots), the storage's episode index, the times-sampled
column, and a header of six integers (a sequence count, first and next stored step, first episode,
size, a count of changes). Given
memory that other processes can map (:class:`SharedArrays`, over any allocator: the replay shard
uses its bulk owner's shared-memory segments), the table keeps those arrays *there*, and a reader
draws items, plans windows and copies rows by itself.

**Owner side** (:class:`SamplingPublisher`). Every change of the table happens between
:meth:`~SamplingPublisher.begin` and :meth:`~SamplingPublisher.end` (a sequence count: odd while
writing); ``end`` first applies the sampler's buffered writes (the tree's lazy batch), then
publishes the storage's step range and the table's size. Rows need no lock of their own: the ring
is written in step order, and the storage stores each append's end step (its *row horizon*, an
array beside the episode index) before it writes a row, so the rows of steps at or above
``horizon - capacity`` are the ones no append begun so far can overwrite.

**Reader side** (:class:`SharedSampling`). :meth:`~SharedSampling.figures` reads a consistent
``(mass, min, size)``; :meth:`~SharedSampling.draw` descends the tree (or draws from the dense list)
for ``n`` uniforms and plans each item's window (or step), and answers ``MOVED`` when the sequence
count changed under it (the caller draws again: never a torn draw);
:meth:`~SharedSampling.copy_windows` gathers the rows, then reads the row horizon: an item whose
oldest row is below ``horizon - capacity`` may have been overwritten during the copy and is
reported invalid. A restore (``Storage.load_state_dict``), which rewrites rows in place and may lower
the horizon, keeps a rewrite count beside it odd while it runs; a copy during which the count moved
(read before the draw and after the copy) is refused whole. Every row it accepts was complete before
the copy (its step is below the published next step) and no append had reached it by the end, so it
is never torn; one read of one number per shard replaces a check of every row's version before and
after the copy (90 us of a 256 x 32 batch).

Rate limiting. The table's rate limiter keeps its sample count in the region too (the *budget*,
:mod:`reactor.replay._budget`: the count, the most it may reach, the owner's parked inserts), and
every draw takes its items from it first, by compare-and-swap: a reader's (:meth:`SharedSampling.take`,
:meth:`SharedShards.take` for all shards of a batch at once, or none), a read server's for a reader
on another host, and the owner's own (``RateLimiter.take``). So a ``SampleToInsertRatio`` holds
exactly over all of them; a reader whose take fails samples through the owner's messages, which
wait for inserts as before. A reader maps that one array writable; everything else read-only.

n-step transitions (``TransitionRead``) are offered as the tail-padded windows of ``n + 1`` steps
from each anchor, with the read's parameters in the descriptor: a reader copies the windows and
sums the returns itself (:func:`transitions_from_windows`, the storage's own arithmetic).

What a reader may see stale. The state it reads is the owner's as of the owner's last completed
change: a write the owner has not applied yet (a priority update still in a message queue, an
insert in flight) is not seen, and nothing older than the last completed change is ever seen. The
owner's times-sampled bookkeeping of one-sided draws arrives later in a message
(:meth:`Table.note_sampled`): a reader's ``times_sampled`` is the owner's count as of its last
completed change, plus one. (The rate limiter's count is not late: it was taken at the draw.)

Safety against the memory itself. A reader maps the arrays read-only and trusts nothing it reads:
every index taken from shared memory is range-checked in the kernels before it is used (a slot, an
episode's start and length, a window's valid range), and so is every item's probability (in (0, 1])
and times-sampled count, so a torn or corrupt state gives ``MOVED``, never an out-of-bounds access
nor a NaN or negative probability (whose importance weight would be NaN).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch

from .._errors import MalformedFrameError
from .._native import acquire_fence, drop_stale_cache, prefetch, release_fence, void_pointer
from ._budget import BUDGET_WORDS, PARKED, take, take_all
from ._storagekernels import _PREFETCH_WINDOWS, _nb_copy_windows, _ring_slot
from .storage import n_step_return
from .sumtree import _layout, _nb_descend

__all__ = [
    "BELOW", "BUSY", "EMPTY", "MOVED", "MOVED_AT", "OK", "SamplingPublisher", "SharedArrays", "SharedSampling",
    "SharedShards", "importance_weights", "least_probability", "parse_transition", "plan_shards", "serve_sample",
    "shareable", "take_counts",
    "transitions_from_windows",
    "why_not_shared",
]

#: Header slots (int64): the sequence count, then what the owner publishes at the end of a change.
_H_SEQ, _H_FIRST_STEP, _H_NEXT_STEP, _H_FIRST_EP, _H_SIZE, _H_CHANGES = range(6)
HEADER_LEN = 8
#: :meth:`SharedSampling.draw` results.
OK, MOVED, EMPTY = 0, 1, 2
#: :class:`SharedShards` results besides OK: a shard was mid-change when its figures were read; a
#: shard holds fewer items than its min size; every mass is 0 (figures); a shard's draw did not return
#: OK (draw).
BUSY, BELOW, ZERO, MOVED_AT = 3, 4, 5, 6
#: A times-sampled count read from the region at or above this is garbage (no item is drawn 2**62 times).
_TIMES_MAX = 1 << 62

ArrayAllocator = Callable[[str, tuple[int, ...], np.dtype[Any]], np.ndarray]


class SharedArrays:
    """Named arrays that keep their memory: ``arrays(name, shape, dtype)`` returns the array of that
    name, allocated by ``allocate`` on the first call (zeroed) and the *same memory* on every later
    call (the caller fills it as it needs). So a selector or storage that re-initialises its arrays
    (``clear``, ``load_state_dict``) keeps writing where readers look.

    Args:
        allocate: ``(name, nbytes) -> uint8 array`` of zeroed memory, 64-byte aligned, that lives as
            long as this object (e.g. a shared-memory segment's mapping).

    Raises:
        ValueError: a name asked for again with another shape or dtype.
    """

    def __init__(self, allocate: Callable[[str, int], np.ndarray]) -> None:
        self._allocate = allocate
        self._arrays: dict[str, np.ndarray] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        have = self._arrays.get(name)
        if have is not None:
            if have.shape != tuple(shape) or have.dtype != dt:
                raise ValueError(
                    f"shared array {name!r} is {have.dtype}{have.shape}; asked for again as {dt}{tuple(shape)}"
                )
            return have
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        raw = self._allocate(name, nbytes)
        if raw.dtype != np.uint8 or raw.shape != (nbytes,):
            raise ValueError(f"shared array {name!r}: the allocator gave {raw.dtype}{raw.shape}, not uint8[{nbytes}]")
        arr = raw.view(dt).reshape(shape)
        self._arrays[name] = arr
        return arr

    def layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every array allocated so far: name -> (shape, numpy dtype name)."""
        return {n: (a.shape, a.dtype.name) for n, a in self._arrays.items()}

    def get(self, name: str) -> np.ndarray:
        """The array of ``name``. Raises KeyError if it was never allocated."""
        return self._arrays[name]


def shareable(table: Any) -> str:
    """Why ``table`` cannot be sampled one-sidedly, or ``""`` if it can (see :func:`why_not_shared`)."""
    return why_not_shared(table._sampler, table._read, table._max_times_sampled, table._storage.device.type)


def why_not_shared(sampler: Any, read: Any, max_times_sampled: int, device: str = "cpu",
                   capacity: int | None = None) -> str:
    """Why a table of these parts cannot be sampled one-sidedly, or ``""`` if it can.

    A one-sided draw is the table's own draw only if the sampler's state is all in the published
    arrays (Uniform, Prioritized), the items are windows, n-step transitions (a reader copies the
    ``n + 1`` steps from the anchor and sums the return itself: :func:`transitions_from_windows`) or
    steps read from host memory, and no item expires after a number of samples (the owner would
    have to drop it at the draw). Any rate limiter will do: its sample count is shared with the
    readers (the budget, :mod:`reactor.replay._budget`).
    """
    from .selectors import Prioritized, Uniform
    from .table import StepRead, TransitionRead, WindowRead

    if type(sampler) not in (Prioritized, Uniform):
        return f"its sampler is {type(sampler).__name__} (one-sided: Uniform or Prioritized)"
    if not isinstance(read, (WindowRead, StepRead, TransitionRead)):
        return f"it reads {type(read).__name__} items (one-sided: WindowRead, TransitionRead or StepRead)"
    read = _as_window(read)
    if max_times_sampled:
        return f"max_times_sampled={max_times_sampled} (the owner drops items at the draw)"
    if device != "cpu":
        return f"its storage is on {device}"
    if capacity is not None and isinstance(read, WindowRead) and read.length > capacity:
        return f"its windows ({read.length} steps) are longer than its storage ({capacity} steps)"
    return ""


def _as_window(read: Any) -> Any:
    """What a reader copies for ``read``: an n-step transition is the tail-padded window of the
    ``n + 1`` steps from its anchor (the last valid one is its bootstrap step); other reads as they are."""
    from .table import TransitionRead, WindowRead

    return WindowRead(read.n + 1, "tail") if isinstance(read, TransitionRead) else read


def parse_transition(spec: Any, window: int) -> Any:
    """A descriptor's ``transition`` entry as a TransitionRead (None if absent), checked: it comes
    from another process."""
    from .table import TransitionRead

    if spec is None:
        return None
    if not isinstance(spec, dict) or set(spec) != {"n", "gamma", "reward_field", "next_fields"}:
        raise ValueError(f"one-sided sampling descriptor: a malformed transition entry {spec!r:.120}")
    n, gamma, reward, nxt = spec["n"], spec["gamma"], spec["reward_field"], spec["next_fields"]
    if (type(n) is not int or n + 1 != window or type(gamma) is not float or not isinstance(reward, str)
            or not isinstance(nxt, list) or not all(isinstance(f, str) for f in nxt)):
        raise ValueError(f"one-sided sampling descriptor: a transition entry that does not fit its window "
                         f"{window}: {spec!r:.120}")
    return TransitionRead(n, gamma, reward, tuple(nxt))


def transitions_from_windows(data: dict[str, torch.Tensor], read: Any) -> dict[str, torch.Tensor]:
    """The n-step transitions of ``read`` (a TransitionRead) from the tail-padded windows of its
    ``n + 1`` steps (``data``: every field ``[B, n + 1, ...]`` and ``mask`` ``[B, n + 1]``): what
    :meth:`Storage.read_transitions` returns for the windows' anchors, to the bit. An item's
    valid steps ``L`` end at its episode's last stored step or at ``n + 1``, so ``m = L - 1``:
    ``reward = sum_{k<m} gamma^k r_k`` (the rewards summed as the storage sums them: the same
    ``n`` terms, those past ``m`` times 0), ``discount = gamma^m``, ``valid = m >= 1``,
    ``next_<f> = f[m]``, every field else at the anchor.

    Raises:
        KeyError: the reward field or a next field is not in ``data``.
    """
    n = read.n
    m = data["mask"].sum(dim=1).numpy().astype(np.int64) - 1
    b = m.shape[0]
    out = {f: t[:, 0].contiguous() for f, t in data.items() if f != "mask"}  # (not views of the windows)
    r = data[read.reward_field][:, :n]
    at = np.minimum(np.arange(n)[None, :], np.maximum(m[:, None] - 1, 0))  # the storage's own reward rows
    at = torch.from_numpy(at).reshape(b, n, *([1] * (r.dim() - 2))).expand(b, n, *r.shape[2:])
    out[read.reward_field], out["discount"], out["valid"] = n_step_return(torch.gather(r, 1, at), m, read.gamma)
    rows, last = torch.arange(b), torch.from_numpy(np.maximum(m, 0))
    for f in read.next_fields:
        out[f"next_{f}"] = data[f][rows, last]
    return out


# -------------------------------------------------------------------------------------- owner side


@numba.njit(cache=True, nogil=True)
def _nb_seq_begin(header: np.ndarray) -> None:  # pragma: no cover - jit
    header[0] += 1  # odd: being written
    release_fence()  # the count is visible before any store of the change


@numba.njit(cache=True, nogil=True)
def _nb_seq_end(header: np.ndarray, first_step: int, next_step: int, first_ep: int, size: int) -> None:  # pragma: no cover
    header[1] = first_step
    header[2] = next_step
    header[3] = first_ep
    header[4] = size
    header[5] += 1
    release_fence()  # every store of the change is visible before the count
    header[0] += 1


class SamplingPublisher:
    """The owner's side: brackets every change of ``table`` with the sequence count.

    ``table`` must have been built over ``arrays`` (``Storage(..., index_arrays=arrays)``,
    ``Table(..., arrays=arrays)``) and be :func:`shareable`.

    Args:
        table: the table whose state readers map.
        arrays: the memory it was built over.
        read: what readers read per item, if not the table's own read kind (a replay shard's
            table reads only anchor steps and applies its read kind itself).

    Raises:
        ValueError: the table cannot be sampled one-sidedly (the reason), or was not built over
            ``arrays``.
    """

    def __init__(self, table: Any, arrays: SharedArrays, *, read: Any = None) -> None:
        self.read = table._read if read is None else read
        why = why_not_shared(table._sampler, self.read, table._max_times_sampled, table._storage.device.type,
                             table._storage.capacity)
        if why:
            raise ValueError(f"table {table.name!r} cannot be sampled one-sidedly: {why}")
        self.table = table
        self.arrays = arrays
        self.header = arrays("header", (HEADER_LEN,), np.int64)
        self.budget = arrays("budget", (BUDGET_WORDS,), np.int64)
        table._limiter.share(self.budget)  # every draw, the owner's and the readers', takes from it
        names = set(arrays.layout())
        need = {"times", "step_ep", "ep_start", "ep_len"} | (
            {"sums", "mins"} if self.uniform is False else {"dense"})
        if not need <= names:
            raise ValueError(f"table {table.name!r} was not built over these arrays (missing {sorted(need - names)})")
        self._depth = 0
        self.end_change()  # publish the state as it is

    @property
    def uniform(self) -> bool:
        from .selectors import Uniform

        return type(self.table._sampler) is Uniform

    def begin(self) -> None:
        """A change starts (nested calls count: only the outermost bracket publishes)."""
        self._depth += 1
        if self._depth == 1:
            _nb_seq_begin(self.header)

    def end(self) -> None:
        """The change is complete: apply the sampler's buffered writes and publish."""
        self._depth -= 1
        if self._depth == 0:
            self.end_change()

    def end_change(self) -> None:
        t = self.table
        t.flush()
        lo, hi = t._storage.step_range
        if self.header[0] % 2 == 0:  # not inside begin(): open a bracket for the publication itself
            _nb_seq_begin(self.header)
        _nb_seq_end(self.header, lo, hi, t._storage.episode_range[0], len(t))

    def descriptor(self) -> dict[str, Any]:
        """What a reader needs besides the arrays' memory: plain msgpack-able data."""
        t = self.table
        from .table import TransitionRead, WindowRead

        read = _as_window(self.read)
        tr = self.read if isinstance(self.read, TransitionRead) else None
        return {
            "kind": "reactor.replay.shared",
            "version": 2,
            "sampler": "uniform" if self.uniform else "prioritized",
            "capacity": t._storage.capacity,
            "arity": 0 if self.uniform else int(t._sampler.arity),
            "window": int(read.length) if isinstance(read, WindowRead) else 0,
            "pad": read.pad if isinstance(read, WindowRead) else "",
            "transition": None if tr is None else {"n": tr.n, "gamma": float(tr.gamma), "reward_field": tr.reward_field,
                                                   "next_fields": list(tr.next_fields)},
            "min_size": int(t._limiter.min_size_to_sample),
            "beta": float(t._beta),
            "arrays": {n: [list(s), d] for n, (s, d) in self.arrays.layout().items()},
        }


# -------------------------------------------------------------------------------------- reader side


# The reader kernels are cached on disk (compiling them costs ~2 s a process, paid at the first one-sided
# sample of every learner and read server), but they compile in the sum tree's descent and the storage's
# window copy: a cached copy would keep running an old descent after sumtree.py changed (the reason
# Table's one-call sample is not cached). So the cache goes when one of those files is newer.
_HERE = Path(__file__)
drop_stale_cache(__file__, _HERE.with_name("sumtree.py"), _HERE.with_name("_storagekernels.py"),
                 _HERE.parent.parent / "_native.py")


@numba.njit(cache=True, nogil=True)
def _nb_figures(header: np.ndarray, uniform: bool, sums: np.ndarray, mins: np.ndarray) -> tuple[int, float, float, int]:  # pragma: no cover
    """``(seq, mass, min_weight, size)`` read under the sequence count; seq is -1 if it moved."""
    s1 = header[0]
    if s1 & 1:
        return -1, 0.0, 0.0, 0
    acquire_fence()
    size = header[4]
    if uniform:
        mass = float(size)
        low = 1.0 if size > 0 else np.inf
    else:
        mass = sums[0]
        low = mins[0]
    acquire_fence()
    if header[0] != s1:
        return -1, 0.0, 0.0, 0
    return s1, mass, low, size


@numba.njit(cache=True, nogil=True)
def _nb_draw(
    header: np.ndarray,
    seq: int,
    uniform: bool,
    sums: np.ndarray,
    offsets: np.ndarray,
    arity: int,
    dense: np.ndarray,
    times: np.ndarray,
    uniforms: np.ndarray,
    step_ep: np.ndarray,
    ep_start: np.ndarray,
    ep_len: np.ndarray,
    length: int,
    head: bool,
    slots: np.ndarray,
    probs: np.ndarray,
    keys: np.ndarray,
    out_times: np.ndarray,
    pos: np.ndarray,
    lo: np.ndarray,
    hi: np.ndarray,
) -> int:  # pragma: no cover - jit
    """Draw ``len(uniforms)`` items and plan their windows, all under sequence count ``seq``.

    Returns OK, MOVED (the count is not ``seq`` any more, or a value read is impossible: a torn or
    corrupt state) or EMPTY (nothing to draw). ``length == 0``: steps (``pos`` is the ring slot).
    """
    if header[0] != seq or seq & 1:
        return 1
    acquire_fence()
    first_step = header[1]
    next_step = header[2]
    first_ep = header[3]
    size = header[4]
    cap = step_ep.shape[0]
    n = uniforms.shape[0]
    if first_step < 0 or next_step < first_step or next_step - first_step > cap:
        return 1
    if uniform:
        if size <= 0:
            return 2
        if size > cap:
            return 1
        for j in range(n):
            i = int(uniforms[j] * size)
            i = size - 1 if i >= size else i
            s = dense[i]
            if s < 0 or s >= cap:
                return 1
            slots[j] = s
            probs[j] = 1.0 / size
    else:
        if not sums[0] > 0.0:
            return 2
        _nb_descend(sums, offsets, arity, uniforms, True, slots, probs)
        for j in range(n):  # (a probability outside (0, 1], NaN too: an inf, NaN or negative sum)
            if slots[j] < 0 or slots[j] >= cap or not 0.0 < probs[j] <= 1.0:
                return 1
    f0 = first_step % cap
    off = first_step - f0
    for j in range(n):
        s = slots[j]
        k = s + off + (cap if s < f0 else 0)
        if k < first_step or k >= next_step:
            return 1
        keys[j] = k
        t = times[s]
        if t < 0 or t >= _TIMES_MAX:  # (a count below 0, or one that would overflow: checked before the + 1,
            return 1  # whose overflow the compiler may assume away)
        out_times[j] = t + 1
        prefetch(step_ep.ctypes.data + s * 8)
    if length == 0:
        for j in range(n):
            pos[j] = slots[j]
            lo[j] = 0
            hi[j] = 1
    else:
        e0 = first_ep % cap
        for j in range(n):
            e = _ring_slot(step_ep[slots[j]], first_ep, e0, cap)
            lo[j] = e
            prefetch(ep_start.ctypes.data + e * 8)
            prefetch(ep_len.ctypes.data + e * 8)
        for j in range(n):
            s = keys[j]
            e = lo[j]
            start = ep_start[e]
            elen = ep_len[e]
            if start > s or start + elen <= s or start < first_step or start + elen > next_step:
                return 1
            if head:
                base = s - (length - 1)
                a = max(0, start - base)
                z = length
            else:
                base = s
                a = 0
                z = min(length, start + elen - s)
            if a < 0 or z <= a or z > length:
                return 1
            lo[j] = a
            hi[j] = z
            pos[j] = _ring_slot(base, first_step, f0, cap)
    acquire_fence()
    if header[0] != seq:
        return 1
    return 0


@numba.njit(cache=True, nogil=True)
def _nb_rewrites(horizon: np.ndarray) -> int:  # pragma: no cover - jit
    """The storage's rewrite count, loaded before a draw (an acquire fence after the load)."""
    count = horizon[1]
    acquire_fence()
    return count


@numba.njit(cache=True, nogil=True)
def _nb_check_horizon(horizon: np.ndarray, cap: int, lo: np.ndarray, base: np.ndarray, valid: np.ndarray,
                      rewrites: int) -> None:  # pragma: no cover - jit
    """After a copy: ``valid[j] = False`` where window j's oldest row (step ``base[j] + lo[j]``) may
    have been overwritten during it, i.e. is below the storage's row horizon minus the capacity, and
    for every window if a restore rewrote rows since the draw began (the rewrite count, ``rewrites``
    before the draw, moved or was odd). An acquire fence first: both are read after every row."""
    acquire_fence()
    floor = horizon[0] - cap
    if horizon[1] != rewrites or rewrites & 1:
        for j in range(lo.shape[0]):
            valid[j] = False
        return
    for j in range(lo.shape[0]):
        if base[j] + lo[j] < floor:
            valid[j] = False


class SharedSampling:
    """The reader's side: draws and copies from a table's published state (see the module docstring).

    Args:
        descriptor: :meth:`SamplingPublisher.descriptor`.
        arrays: name -> the mapped array, for every name the descriptor lists: read-only is enough,
            but for ``budget`` (the rate limiter's sample count, which a reader takes from).

    Raises:
        ValueError: the descriptor or the arrays do not match (kind, shapes, dtypes, sizes).
    """

    def __init__(self, descriptor: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        d = descriptor
        if not isinstance(d, dict) or d.get("kind") != "reactor.replay.shared" or d.get("version") != 2:
            raise ValueError(f"not a one-sided sampling descriptor: {d!r:.200}")
        for key, typ in (("capacity", int), ("arity", int), ("window", int), ("min_size", int), ("beta", float),
                         ("sampler", str), ("pad", str), ("arrays", dict)):
            if not isinstance(d.get(key), typ) or isinstance(d.get(key), bool):
                raise ValueError(f"one-sided sampling descriptor: {key!r} must be of type {typ.__name__}, got {d.get(key)!r:.80}")
        if d["sampler"] not in ("uniform", "prioritized") or d["capacity"] < 1 or d["window"] < 0:
            raise ValueError(f"one-sided sampling descriptor: bad sampler, capacity or window: {d!r:.200}")
        if d["sampler"] == "prioritized" and d["arity"] < 2:
            raise ValueError(f"one-sided sampling descriptor: arity {d['arity']} < 2")
        if d["window"] > d["capacity"]:
            raise ValueError(f"one-sided sampling descriptor: window {d['window']} > capacity {d['capacity']}")
        if not 0.0 <= d["beta"] < math.inf:  # (NaN too: every importance weight would be NaN)
            raise ValueError(f"one-sided sampling descriptor: beta {d['beta']!r} is not a finite number >= 0")
        self.uniform = d["sampler"] == "uniform"
        self.capacity = cap = d["capacity"]
        self.window = d["window"]
        self.head = d["pad"] == "head"
        #: The TransitionRead a reader makes of the copied windows (transitions_from_windows), or None.
        self.transition = parse_transition(d.get("transition"), self.window)
        if self.transition is not None and self.head:
            raise ValueError("one-sided sampling descriptor: transitions are read from tail-padded windows")
        self.min_size = d["min_size"]
        self.beta = d["beta"]
        self.arity = max(2, d["arity"])
        self.offsets, _ = _layout(cap, self.arity)
        size = int(self.offsets[-1])
        leaf0 = int(self.offsets[-2])
        want: dict[str, tuple[tuple[int, ...], Any]] = {
            "header": ((HEADER_LEN,), np.int64), "times": ((cap,), np.int64), "step_ep": ((cap,), np.int64),
            "ep_start": ((cap,), np.int64), "ep_len": ((cap,), np.int64), "row_horizon": ((2,), np.int64),
            "budget": ((BUDGET_WORDS,), np.int64),
        }
        if self.uniform:
            want["dense"] = ((cap,), np.int64)
        else:
            want["sums"] = ((size,), np.float64)
            want["mins"] = ((leaf0,), np.float64)
        got: dict[str, np.ndarray] = {}
        for name, (shape, dtype) in want.items():
            a = arrays.get(name)
            if not isinstance(a, np.ndarray) or a.shape != shape or a.dtype != np.dtype(dtype) or not a.flags.c_contiguous:
                have = f"{a.dtype}{a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ValueError(f"one-sided sampling: array {name!r} is {have}, expected {np.dtype(dtype)}{shape}")
            got[name] = a
        if not got["budget"].flags.writeable:
            raise ValueError("one-sided sampling: array 'budget' must be mapped writable (a reader takes its "
                             "samples from it)")
        self.header = got["header"]
        self.budget = got["budget"]
        self.times = got["times"]
        self.step_ep, self.ep_start, self.ep_len = got["step_ep"], got["ep_start"], got["ep_len"]
        self.horizon = got["row_horizon"]
        self.dense = got.get("dense", np.zeros(1, np.int64))
        self.sums = got.get("sums", np.zeros(1, np.float64))
        self.mins = got.get("mins", np.zeros(1, np.float64))

    def take(self, n: int) -> bool:
        """Take ``n`` samples from the owner's rate limiter (its shared budget), if it allows them now;
        False (nothing taken) if not: then sample through the owner's messages, which wait. A draw
        that fails after its take keeps the count (:mod:`reactor.replay._budget`)."""
        return take(self.budget, n)

    @property
    def parked(self) -> bool:
        """Whether the owner holds inserts back for want of samples (tell it of draws at once)."""
        return bool(self.budget[PARKED] > 0)

    def figures(self) -> tuple[int, float, float, int]:
        """``(seq, mass, min_weight, size)`` at one moment: the sampler's total weight (the item count
        for Uniform), its smallest positive weight, the item count; ``seq`` is -1 if the owner was
        writing (try again)."""
        return _nb_figures(self.header, self.uniform, self.sums, self.mins)

    def draw(self, seq: int, uniforms: np.ndarray) -> tuple[int, dict[str, np.ndarray]]:
        """Draw one item per uniform (stratified over the mass for Prioritized, as
        ``Table.sample_nowait``) and plan each item's rows, if the state is still ``seq``.

        Returns:
            ``(status, plan)``: status OK, MOVED or EMPTY; plan ``slots``, ``probabilities`` (within
            this table), ``keys`` (global steps), ``times_sampled``, and ``pos``, ``lo``, ``hi`` (ring
            slot of each window's position 0 and its valid range; steps: the slot and ``[0, 1)``), and
            ``rewrites`` (the storage's rewrite count before the draw, for :meth:`copy_windows`).
        """
        n = uniforms.shape[0]
        plan = {k: np.empty(n, np.int64) for k in ("slots", "keys", "times_sampled", "pos", "lo", "hi")}
        plan["probabilities"] = np.empty(n, np.float64)
        plan["rewrites"] = np.array([_nb_rewrites(self.horizon)], np.int64)  # (copy_windows checks it)
        status = _nb_draw(
            self.header, seq, self.uniform, self.sums, self.offsets, self.arity, self.dense, self.times,
            np.ascontiguousarray(uniforms, dtype=np.float64), self.step_ep, self.ep_start, self.ep_len,
            self.window, self.head, plan["slots"], plan["probabilities"], plan["keys"], plan["times_sampled"],
            plan["pos"], plan["lo"], plan["hi"],
        )
        return status, plan

    def copy_windows(self, plan: dict[str, np.ndarray], src_addrs: np.ndarray, row_nbytes: np.ndarray,
                     dst_addrs: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Copy the planned items' rows (every field: ``src_addrs``/``row_nbytes`` of the mapped
        ring, ``dst_addrs`` of ``[n, length, ...]`` outputs, or ``[n, ...]`` for steps) without a
        lock; fill ``mask`` (``[n, length]``: False at padding) and zero the padding.

        Returns:
            bool ``[n]``: the items none of whose rows an insert can have overwritten during the copy
            (the storage's row horizon, read after it; the others' data is whatever the copy saw:
            drop them).
        """
        pos, lo, hi = plan["pos"], plan["lo"], plan["hi"]
        base = plan["keys"] - (self.window - 1 if self.head and self.window else 0)
        valid = np.ones(pos.shape[0], dtype=np.bool_)
        _nb_copy_windows(src_addrs, row_nbytes, dst_addrs, self.capacity, pos, lo, hi, max(self.window, 1), mask,
                         _PREFETCH_WINDOWS)
        _nb_check_horizon(self.horizon, self.capacity, lo, base, valid, int(plan["rewrites"][0]))
        return valid

    def sample_into(self, seq: int, uniforms: np.ndarray, src_addrs: np.ndarray,
                    row_nbytes: np.ndarray, dst_addrs: np.ndarray, mask: np.ndarray, keys: np.ndarray,
                    probs: np.ndarray, times: np.ndarray, valid: np.ndarray) -> int:
        """:meth:`draw` then :meth:`copy_windows` in one compiled call, into the caller's arrays
        (``keys``, ``probs``, ``times``, ``valid``: one entry per uniform). Returns OK, MOVED or
        EMPTY; only OK fills the outputs."""
        return int(_nb_sample_into(
            self.header, seq, self.uniform, self.sums, self.offsets, self.arity, self.dense, self.times,
            uniforms, self.step_ep, self.ep_start, self.ep_len, self.window, self.head, self.horizon, src_addrs,
            row_nbytes, dst_addrs, mask, keys, probs, times, valid, _PREFETCH_WINDOWS))

    def sample_part(self, seq: int, uniforms: np.ndarray, src_addrs: np.ndarray,
                    row_nbytes: np.ndarray, dst_addrs: np.ndarray, mask: np.ndarray, keys: np.ndarray,
                    probs: np.ndarray, times: np.ndarray, valid: np.ndarray, tag: int, share: float, min_p: float,
                    beta: float, weights: np.ndarray) -> int:
        """:meth:`sample_into` for one shard's part of a batch drawn over several, finished in the same
        compiled call: each item's key tagged (``tag | key``), its probability in the batch
        (``share * q``) and its importance weight ``min((p / min_p)^-beta, 1)`` as float32 (1 when
        ``beta`` is 0 or ``min_p`` is not positive and finite). Returns OK, MOVED or EMPTY; only OK
        fills the outputs."""
        return int(_nb_sample_part(
            self.header, seq, self.uniform, self.sums, self.offsets, self.arity, self.dense, self.times,
            uniforms, self.step_ep, self.ep_start, self.ep_len, self.window, self.head, self.horizon, src_addrs,
            row_nbytes, dst_addrs, mask, keys, probs, times, valid, _PREFETCH_WINDOWS, tag, share, min_p, beta,
            weights))


@numba.njit(cache=True, nogil=True)
def _nb_sample_part(header: np.ndarray, seq: int, uniform: bool, sums: np.ndarray, offsets: np.ndarray, arity: int,
                    dense: np.ndarray, times: np.ndarray, uniforms: np.ndarray, step_ep: np.ndarray,
                    ep_start: np.ndarray, ep_len: np.ndarray, length: int, head: bool, horizon: np.ndarray,
                    src_addrs: np.ndarray, row_nbytes: np.ndarray, dst_addrs: np.ndarray, mask: np.ndarray,
                    keys: np.ndarray, probs: np.ndarray, out_times: np.ndarray, valid: np.ndarray, ahead: int,
                    tag: int, share: float, min_p: float, beta: float,
                    weights: np.ndarray) -> int:  # pragma: no cover - jit
    """``_nb_sample_into``, then the items' batch keys, probabilities and weights (see sample_part)."""
    status = _nb_sample_into(header, seq, uniform, sums, offsets, arity, dense, times, uniforms, step_ep, ep_start,
                             ep_len, length, head, horizon, src_addrs, row_nbytes, dst_addrs, mask, keys, probs,
                             out_times, valid, ahead)
    if status != 0:
        return status
    plain = beta == 0.0 or not (0.0 < min_p < np.inf)
    for j in range(uniforms.shape[0]):
        p = probs[j] * share
        if not 0.0 < p <= 1.0:  # (a share of a mass read as inf or NaN)
            return 1
    for j in range(uniforms.shape[0]):
        keys[j] = keys[j] | tag
        p = probs[j] * share
        probs[j] = p
        weights[j] = 1.0 if plain else min((p / min_p) ** (-beta), 1.0)
    return 0


@numba.njit(cache=True, nogil=True)
def _nb_sample_into(header: np.ndarray, seq: int, uniform: bool, sums: np.ndarray, offsets: np.ndarray, arity: int,
                    dense: np.ndarray, times: np.ndarray, uniforms: np.ndarray, step_ep: np.ndarray,
                    ep_start: np.ndarray, ep_len: np.ndarray, length: int, head: bool, horizon: np.ndarray,
                    src_addrs: np.ndarray, row_nbytes: np.ndarray, dst_addrs: np.ndarray, mask: np.ndarray,
                    keys: np.ndarray, probs: np.ndarray, out_times: np.ndarray, valid: np.ndarray,
                    ahead: int) -> int:  # pragma: no cover - jit
    """``_nb_draw``, then the copy and the row horizon (see SharedSampling.copy_windows)."""
    n = uniforms.shape[0]
    rewrites = _nb_rewrites(horizon)
    slots = np.empty(n, np.int64)
    pos = np.empty(n, np.int64)
    lo = np.empty(n, np.int64)
    hi = np.empty(n, np.int64)
    status = _nb_draw(header, seq, uniform, sums, offsets, arity, dense, times, uniforms, step_ep, ep_start, ep_len,
                      length, head, slots, probs, keys, out_times, pos, lo, hi)
    if status != 0:
        return status
    shift = length - 1 if head and length > 0 else 0
    base = np.empty(n, np.int64)
    for j in range(n):
        base[j] = keys[j] - shift
        valid[j] = True
    _nb_copy_windows(src_addrs, row_nbytes, dst_addrs, step_ep.shape[0], pos, lo, hi, max(length, 1), mask, ahead)
    _nb_check_horizon(horizon, step_ep.shape[0], lo, base, valid, rewrites)
    return 0


#: The arrays :class:`SharedShards` reaches by address, per shard (int64 unless listed in _F64).
_SHARD_ARRAYS = ("header", "sums", "mins", "offsets", "dense", "times", "step_ep", "ep_start", "ep_len", "row_horizon",
                 "src_addrs", "row_nbytes")
_F64 = ("sums", "mins")


class SharedShards:
    """Several shards' published states (a replay bank's, mapped on this host), drawn from as one batch
    in two compiled calls: every shard's figures and the per-shard counts (:meth:`figures`), then
    each shard's :meth:`SharedSampling.sample_part` into its slice of the batch (:meth:`draw`).

    Args:
        parts: per shard, ``(state, src_addrs, row_nbytes)``: its :class:`SharedSampling` and its
            fields' addresses and row sizes (as ``sample_part`` takes them). The object keeps them
            (the compiled call reaches them by address).

    Raises:
        ValueError: no parts, or the shards differ in window or padding.
    """

    def __init__(self, parts: list[tuple[SharedSampling, np.ndarray, np.ndarray]]) -> None:
        if not parts or len({(ss.window, ss.head, ss.transition) for ss, *_ in parts}) != 1:
            raise ValueError("SharedShards: at least one shard, all with the same window, padding and transitions")
        if any(not np.array_equal(rb, parts[0][2]) or len(src) != len(parts[0][1]) for _ss, src, rb in parts):
            raise ValueError("SharedShards: every shard must have the same fields and row sizes (one batch layout)")
        self.parts = parts
        self.window, self.head = parts[0][0].window, parts[0][0].head
        self.table = np.zeros((len(parts), 2 * len(_SHARD_ARRAYS)), np.int64)  # (address, length) per array
        self.budgets = np.array([ss.budget.ctypes.data for ss, *_ in parts], np.int64)
        self.scalars = np.zeros((len(parts), 3), np.int64)  # uniform, arity, min size
        for i, (ss, src_addrs, row_nbytes) in enumerate(parts):
            arrays = {"header": ss.header, "sums": ss.sums, "mins": ss.mins, "offsets": ss.offsets, "dense": ss.dense,
                      "times": ss.times, "step_ep": ss.step_ep, "ep_start": ss.ep_start, "ep_len": ss.ep_len,
                      "row_horizon": ss.horizon, "src_addrs": src_addrs, "row_nbytes": row_nbytes}
            for j, name in enumerate(_SHARD_ARRAYS):
                a = arrays[name]
                want = np.float64 if name in _F64 else np.int64
                if a.dtype != want or a.ndim != 1 or not a.flags.c_contiguous:
                    raise ValueError(f"SharedShards: shard {i}'s {name} is {a.dtype}{a.shape}, expected 1-D {np.dtype(want)}")
                self.table[i, 2 * j], self.table[i, 2 * j + 1] = a.ctypes.data, a.shape[0]
            self.scalars[i] = (int(ss.uniform), ss.arity, ss.min_size)

    def figures(self, count_uniforms: np.ndarray, seqs: np.ndarray, sizes: np.ndarray, masses: np.ndarray,
                lows: np.ndarray, counts: np.ndarray, shares: np.ndarray, least: np.ndarray) -> int:
        """Every shard's figures (into ``seqs``, ``sizes``, ``masses``, ``lows``), then
        :func:`plan_shards`: the per-shard counts of ``n = len(count_uniforms)`` items, the shares
        ``mass / total`` and the least likely item's probability (``least[0]``). Returns OK, or BUSY (a
        shard was mid-change), BELOW (a shard holds fewer items than its min size) or ZERO (every
        mass is 0), with the outputs partly filled."""
        return int(_nb_shards_figures(self.table, self.scalars, count_uniforms, seqs, sizes, masses, lows, counts,
                                      shares, least))

    def take(self, counts: np.ndarray) -> int:
        """Take ``counts[s]`` samples from shard ``s``'s rate limiter, for every shard, or none: -1
        when all were taken (-2: and a shard has inserts waiting for samples: tell it soon), else the
        first shard whose limiter does not allow its count now (nothing stays taken)."""
        return take_all(self.budgets, counts)

    def draw(self, draw_uniforms: np.ndarray, dst_addrs: np.ndarray, item_nbytes: np.ndarray, tags: np.ndarray,
             beta: float, mask: np.ndarray, keys: np.ndarray, probs: np.ndarray, times: np.ndarray, valid: np.ndarray,
             weights: np.ndarray, seqs: np.ndarray, counts: np.ndarray, shares: np.ndarray, least: np.ndarray,
             where: np.ndarray) -> int:
        """After :meth:`figures`: shard by shard, its :meth:`SharedSampling.sample_part` on the state of
        its figures into items ``[a, a + count)`` (``dst_addrs`` of item 0 of each field,
        ``item_nbytes`` per item; ``tags`` each shard's key tag). Returns OK, or MOVED_AT with
        ``where = (shard, a, its status)``: the shards before it drew their items, the rest did not."""
        return int(_nb_shards_draw(self.table, self.scalars, self.window, self.head, draw_uniforms, dst_addrs,
                                   item_nbytes, tags, beta, _PREFETCH_WINDOWS, mask, keys, probs, times, valid, weights,
                                   seqs, counts, shares, least, where))


def take_counts(tables: list[SharedSampling], counts: list[int]) -> int:
    """:meth:`SharedShards.take` for tables not drawn as one group (a sample that mixes shards of this
    host with shards read by their servers): ``counts[i]`` from ``tables[i]``'s rate limiter, all
    or none. Returns -1, -2 (taken, and one has inserts parked) or the index of the first short one."""
    return take_all(np.array([t.budget.ctypes.data for t in tables], np.int64), np.array(counts, np.int64))


@numba.njit(cache=True, nogil=True)
def plan_shards(count_uniforms: np.ndarray, masses: np.ndarray, lows: np.ndarray, counts: np.ndarray,
                shares: np.ndarray, least: np.ndarray) -> int:  # pragma: no cover - jit
    """From the shards' masses and least weights: ``counts[s]``, how many of the uniforms fall in shard
    ``s``'s part of the total mass (one categorical draw per uniform, so the counts are a multinomial
    sample over the shares); ``shares[s] = mass / total``; ``least[0]``, the least likely item's
    probability over the shards (``share * min / mass``, inf when none has a positive, finite one).
    Returns OK, or ZERO when every mass is 0 (nothing else filled)."""
    total = 0.0
    last = -1
    for s in range(masses.shape[0]):
        counts[s] = 0
        total += masses[s]
        if masses[s] > 0:
            last = s
    if not total > 0.0:
        return ZERO
    for i in range(count_uniforms.shape[0]):
        u = count_uniforms[i] * total
        acc = 0.0
        pick = last  # (u at the very top of the range: rounding)
        for s in range(masses.shape[0]):
            acc += masses[s]
            if u < acc and masses[s] > 0:
                pick = s
                break
        counts[pick] += 1
    for s in range(masses.shape[0]):
        shares[s] = masses[s] / total
    least[0] = least_probability(shares, masses, lows)
    return OK


def importance_weights(probs: np.ndarray, min_p: float, beta: float) -> np.ndarray:
    """PER's importance weights of items drawn with probabilities ``probs``: ``min((P / min_p)^-beta, 1)``
    as float32, against the least likely item's ``min_p`` (1 where beta is 0 or ``min_p`` is not
    positive and finite)."""
    if beta == 0.0 or not (0 < min_p < math.inf):
        return np.ones(len(probs), dtype=np.float32)
    return np.minimum((probs / min_p) ** (-beta), 1.0).astype(np.float32)


@numba.njit(cache=True, nogil=True)
def least_probability(shares: np.ndarray, masses: np.ndarray, lows: np.ndarray) -> float:  # pragma: no cover - jit
    """The least likely item's probability in a batch over shards whose counts follow ``shares``:
    ``share * min / mass`` over the shards with a positive share and mass and a positive, finite least
    weight (inf when none has): what importance weights are taken against."""
    min_p = np.inf
    for s in range(masses.shape[0]):
        if shares[s] > 0 and masses[s] > 0 and 0 < lows[s] < np.inf:
            p = shares[s] * lows[s] / masses[s]
            if p < min_p:
                min_p = p
    return min_p


@numba.njit(cache=True, nogil=True)
def _nb_i64(table: np.ndarray, s: int, j: int) -> np.ndarray:  # pragma: no cover - jit
    return numba.carray(void_pointer(table[s, 2 * j]), table[s, 2 * j + 1], np.int64)


@numba.njit(cache=True, nogil=True)
def _nb_f64(table: np.ndarray, s: int, j: int) -> np.ndarray:  # pragma: no cover - jit
    return numba.carray(void_pointer(table[s, 2 * j]), table[s, 2 * j + 1], np.float64)


@numba.njit(cache=True, nogil=True)
def _nb_shards_figures(table: np.ndarray, scalars: np.ndarray, count_uniforms: np.ndarray, seqs: np.ndarray,
                       sizes: np.ndarray, masses: np.ndarray, lows: np.ndarray, counts: np.ndarray, shares: np.ndarray,
                       least: np.ndarray) -> int:  # pragma: no cover - jit
    """SharedShards.figures (the array order of _SHARD_ARRAYS)."""
    n_shards = table.shape[0]
    for s in range(n_shards):
        seq, mass, low, size = _nb_figures(_nb_i64(table, s, 0), scalars[s, 0] != 0, _nb_f64(table, s, 1),
                                           _nb_f64(table, s, 2))
        if seq < 0:
            return BUSY
        seqs[s], masses[s], lows[s], sizes[s] = seq, mass, low, size
        if size < scalars[s, 2]:
            return BELOW
    return plan_shards(count_uniforms, masses, lows, counts, shares, least)


@numba.njit(cache=True, nogil=True)
def _nb_shards_draw(table: np.ndarray, scalars: np.ndarray, length: int, head: bool, draw_uniforms: np.ndarray,
                    dst_addrs: np.ndarray, item_nbytes: np.ndarray, tags: np.ndarray, beta: float, ahead: int,
                    mask: np.ndarray, keys: np.ndarray, probs: np.ndarray, out_times: np.ndarray, valid: np.ndarray,
                    weights: np.ndarray, seqs: np.ndarray, counts: np.ndarray, shares: np.ndarray, least: np.ndarray,
                    where: np.ndarray) -> int:  # pragma: no cover - jit
    """SharedShards.draw (the array order of _SHARD_ARRAYS)."""
    a = 0
    for s in range(table.shape[0]):
        c = counts[s]
        if c == 0:
            continue
        b = a + c
        status = _nb_sample_part(
            _nb_i64(table, s, 0), seqs[s], scalars[s, 0] != 0, _nb_f64(table, s, 1), _nb_i64(table, s, 3),
            scalars[s, 1], _nb_i64(table, s, 4), _nb_i64(table, s, 5), draw_uniforms[a:b], _nb_i64(table, s, 6),
            _nb_i64(table, s, 7), _nb_i64(table, s, 8), length, head, _nb_i64(table, s, 9), _nb_i64(table, s, 10),
            _nb_i64(table, s, 11), dst_addrs + a * item_nbytes, mask[a:b], keys[a:b], probs[a:b], out_times[a:b],
            valid[a:b], ahead, tags[s], shares[s], least[0], beta, weights[a:b])
        if status != OK:
            where[0], where[1], where[2] = s, a, status
            return MOVED_AT
        a = b
    return OK


def _corrupt(why: str) -> MalformedFrameError:
    """:func:`serve_sample`'s answer to a corrupt published state (``why`` follows "is inconsistent")."""
    return MalformedFrameError(f"its published sampling state is inconsistent{why}: corrupt shared memory; sample "
                               f"through messages")


def serve_sample(ss: SharedSampling, request: Any, fields: list[tuple[str, int, int]],
                 max_items: int, patience_s: float = 0.005) -> dict[str, Any]:
    """A one-sided sample drawn where the memory is, for a reader on another host (a replay shard's
    bulk read server runs this on its own thread, never on the shard's loop).

    ``request``: ``{"n": items (0: the figures only), "seed": the uniforms' seed}``, from the network:
    validated here. ``fields``: ``(name, row_nbytes, address)`` of the mapped ring's fields. The
    reply carries the shard's figures (``mass``, ``min``, ``size``, ``beta``) and, if it drew,
    ``keys`` (global steps), ``probabilities`` (within the table), ``times_sampled``, ``valid``,
    ``mask`` (windows) and ``data`` (one uint8 array per field, ``[n, window, ...]`` or ``[n, ...]``
    rows), and ``parked`` (the shard holds inserts back until it hears of samples); ``n`` is 0 when
    it drew nothing (below the min size, every priority 0, the rate limiter allows no ``n`` samples
    now (``"limited": True``), or the table kept changing for ``patience_s``). The draws are taken
    from the rate limiter's shared budget, as a reader's on this host are.

    Raises:
        ValueError, TypeError: a malformed request, or ``n`` above ``max_items``.
        MalformedFrameError: the published state is corrupt under a settled sequence count (a mass
            that is not a finite number >= 0, or a draw refused on a state that did not change: an
            index or a probability out of range), as a reader on this host finds it
            (``ReplayClient.sample_now``): every draw would meet it again, and an answer of "nothing
            drawn" would be taken for an empty table at every sample. The count taken stays taken.
    """
    import time

    if not isinstance(request, dict):
        raise TypeError(f"a sample request must be a dict, got {type(request).__name__}")
    n, seed = request.get("n"), request.get("seed")
    if type(n) is not int or not 0 <= n <= max_items:
        raise ValueError(f"sample request: n must be an int in [0, {max_items}], got {n!r:.40}")
    if type(seed) is not int or not 0 <= seed < 2**64:
        raise ValueError(f"sample request: seed must be an int in [0, 2**64), got {seed!r:.40}")
    uniforms = np.random.default_rng(seed).random(n)
    w = max(ss.window, 1)
    deadline = time.perf_counter() + patience_s
    taken = False
    while True:
        seq, mass, low, size = ss.figures()
        if seq >= 0:
            if not 0.0 <= mass < math.inf:  # (a sound tree's root never is: read under a settled count)
                raise _corrupt(f": its mass {mass!r} is not a finite number >= 0")
            reply: dict[str, Any] = {"mass": mass, "min": low, "size": size, "beta": ss.beta, "n": 0}
            if n == 0 or size < ss.min_size or not mass > 0:
                return reply
            if not taken:  # (a draw that fails after this keeps the count: _budget's docstring)
                if not ss.take(n):
                    reply["limited"] = True
                    return reply
                taken = True
            data = [np.empty(n * w * rb, np.uint8) for _, rb, _ in fields]
            mask = np.empty((n, w), np.bool_)
            keys, probs = np.empty(n, np.int64), np.empty(n, np.float64)
            times, valid = np.empty(n, np.int64), np.empty(n, np.bool_)
            status = ss.sample_into(
                seq, uniforms, np.array([a for _, _, a in fields], np.int64),
                np.array([rb for _, rb, _ in fields], np.int64), np.array([d.ctypes.data for d in data], np.int64),
                mask, keys, probs, times, valid)
            if status == OK:
                reply.update(n=n, keys=keys, probabilities=probs, times_sampled=times, valid=valid, data=data,
                             mask=mask if ss.window else None, parked=ss.parked)
                return reply
            if status == EMPTY:
                return reply
            if ss.figures()[0] == seq:  # refused on a state that did not change (the count moves at every change)
                raise _corrupt(f" under a settled sequence count {seq} (an index or a probability out of range)")
        if time.perf_counter() > deadline:  # (no figures: the reader keeps what it knew)
            return {"n": 0, "moved": True}
        time.sleep(0)
