"""Columnar step storage: a ring of steps that evicts whole oldest episodes (the GEAR layout).

The storage keeps one preallocated tensor per field, ``[capacity, *shape]``, and an episode index.
Steps are addressed by their *global step number* ``g`` (0, 1, 2, ... over the storage's whole life,
never reused, not reset by :meth:`Storage.reset`); step ``g`` lives in ring position ``g % capacity``.
An episode is a contiguous run of global steps, so it occupies at most two contiguous ring slices and
needs no padding: a 3-step episode takes 3 rows, a 3000-step episode 3000.

When an append needs room, the oldest *whole* episodes are evicted until it fits; a step is never
evicted on its own, so every stored episode is complete from its first step on. An episode still
being written (``episode_end=False``) that would have to evict itself raises instead.

All reads take an array of global steps and gather with no Python loop per item: single steps,
transitions with n-step returns and whole episodes with one row gather per field (``ndarray.take``
on byte rows on the host, ``index_select`` on CUDA); fixed-length windows with a validity mask by a
compiled kernel that copies each window's rows of a field as one contiguous run (host) or one
``index_select`` per field (CUDA). :meth:`Storage.plan_windows` and :meth:`Storage.plan_transitions`
give the same reads as ring slots, for readers that map the field memory from another process.

Memory is ``capacity * step_nbytes`` for the data (exactly the raw bytes of the stored steps when
full, nothing per episode) plus a fixed index of 24 bytes per step of capacity: see
:meth:`Storage.memory`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from .._native import host_empty, host_huge_zeros, numpy_twin
from ._storagekernels import (
    _PREFETCH_WINDOWS,
    _nb_append,
    _nb_index_append,
    _nb_plan_append,
    _nb_read_windows,
    _nb_reserve_rows,
    _nb_window_ranges,
    expand_window_spans,
)
from ._storagestate import StorageState

__all__ = ["AppendResult", "FieldSpec", "Storage", "StorageMemory", "TransitionPlan", "expand_window_spans",
           "n_step_return"]


#: The most steps a storage holds (an OverflowError past 2**63; a key's step fits far below it).
_MAX_CAPACITY = 1 << 40


def n_step_return(rewards: torch.Tensor, m: np.ndarray, gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An n-step transition's return, as :meth:`Storage.read_transitions` defines it (one place, so
    every reader of transitions sums alike, to the bit): ``rewards`` ``[B, n, ...]`` are each item's
    rewards from its anchor (those at and past ``m`` any stored value: they get coefficient 0), ``m``
    (int64 ``[B]``) the steps summed. Returns ``(reward, discount, valid)`` on the rewards' device:
    ``sum_{k<m} gamma^k r_k`` in the reward dtype (float32 if it is not floating), ``gamma^m``, ``m >= 1``."""
    n, dev = rewards.shape[1], rewards.device
    k = np.arange(n, dtype=np.int64)
    rdtype = rewards.dtype if rewards.dtype.is_floating_point else torch.float32
    gpow = torch.as_tensor(gamma ** k.astype(np.float64), dtype=rdtype, device=dev)
    coef = gpow[None, :] * torch.from_numpy(k[None, :] < m[:, None]).to(dev)
    coef = coef.reshape(*coef.shape, *([1] * (rewards.dim() - 2)))
    return ((rewards.to(rdtype) * coef).sum(dim=1),
            torch.as_tensor(gamma ** m.astype(np.float64), dtype=rdtype, device=dev),
            torch.from_numpy(m >= 1).to(dev))


@dataclass(frozen=True)
class FieldSpec:
    """One column of the storage: every step holds a tensor of ``shape`` and ``dtype`` under ``name``.

    Args:
        name: a Python identifier, unique within a storage.
        shape: per-step shape, ``()`` for a scalar.
        dtype: a ``torch.dtype``.

    Example:
        >>> FieldSpec("obs", (8,), torch.float32)
    """

    name: str
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"FieldSpec name must be a Python identifier, got {self.name!r}")
        shape = tuple(self.shape) if isinstance(self.shape, Iterable) else self.shape
        if not isinstance(shape, tuple) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(
                f"FieldSpec {self.name!r}: shape must be a tuple of non-negative ints, got {self.shape!r}"
            )
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"FieldSpec {self.name!r}: dtype must be a torch.dtype (e.g. torch.float32), got {self.dtype!r}"
            )

    @property
    def step_nbytes(self) -> int:
        """Bytes one step of this field takes."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StorageMemory:
    """What a storage's memory holds.

    Attributes:
        data_nbytes: bytes of the preallocated field tensors (``capacity * step_nbytes``).
        index_nbytes: bytes of the episode index (fixed, 24 bytes per step of capacity).
        stored_nbytes: raw bytes of the steps stored now (``num_steps * step_nbytes``).
    """

    data_nbytes: int
    index_nbytes: int
    stored_nbytes: int

    @property
    def total_nbytes(self) -> int:
        """``data_nbytes + index_nbytes``."""
        return self.data_nbytes + self.index_nbytes


@dataclass(frozen=True)
class TransitionPlan:
    """Where :meth:`Storage.read_transitions` reads from, as ring slots (see :meth:`Storage.plan_transitions`).

    Attributes:
        rows: int64 ``[B]``, slot of each item's step (every field except rewards and next_*).
        next_rows: int64 ``[B]``, slot of the step whose fields become ``next_<f>``.
        reward_rows: int64 ``[B, n]``, slots of the rewards summed into the n-step return.
        reward_coef: float64 ``[B, n]``, ``gamma^k`` for live reward steps, 0 past the episode's end.
        discount: float64 ``[B]``, ``gamma^m``.
        valid: bool ``[B]``, False for an item on its episode's last step.
    """

    rows: np.ndarray
    next_rows: np.ndarray
    reward_rows: np.ndarray
    reward_coef: np.ndarray
    discount: np.ndarray
    valid: np.ndarray


class AppendResult(NamedTuple):
    """What :meth:`Storage.append` did (immutable; a named tuple: a frozen dataclass cost ~1 us of
    an insert's ~60 to build).

    Attributes:
        first_step: global step number of the first appended step (the rest follow contiguously).
        num_steps: how many steps were appended.
        evicted_steps: half-open range ``(lo, hi)`` of global steps evicted to make room (empty: lo == hi).
        evicted_episodes: half-open range of episode ids evicted.
    """

    first_step: int
    num_steps: int
    evicted_steps: tuple[int, int]
    evicted_episodes: tuple[int, int]


def _check_device(device: str | torch.device, pin_memory: bool) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"Storage device {str(dev)!r} needs CUDA, but torch.cuda.is_available() is False here; "
            "use device='cpu'"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"Storage device must be 'cpu' or 'cuda[:N]', got {str(dev)!r}")
    if pin_memory:
        if dev.type != "cpu":
            raise ValueError(f"pin_memory=True applies to host storage only, got device {str(dev)!r}")
        if not torch.cuda.is_available():
            raise RuntimeError(
                "pin_memory=True needs CUDA (pinned host memory is for fast host-to-GPU copies), but "
                "torch.cuda.is_available() is False here; use pin_memory=False"
            )
    return dev


class Storage(StorageState):
    """Preallocated columnar ring of steps with an episode index.

    Ownership and concurrency: a storage is owned by one writer (normally a :class:`~reactor.replay.Table`,
    which serialises access under its lock); it does no locking of its own.

    Memory: plain host fields (no ``pin_memory``, no ``allocator``) of 2 MiB and more sit on
    transparent huge pages where the kernel offers them (``reactor._native.host_huge_zeros``): random
    window and step gathers then rarely miss the TLB. Pinned and CUDA fields come from torch.

    Args:
        specs: the fields, one :class:`FieldSpec` each (unique names).
        capacity: number of steps the ring holds.
        device: ``"cpu"`` or a CUDA device (raises ``RuntimeError`` if CUDA is not available).
        pin_memory: allocate host memory pinned (page-locked); only with CUDA present.
        allocator: ``allocator(field, shape, dtype) -> tensor`` provides each field's memory
            instead of the default (e.g. shared memory that readers in other processes map);
            the tensor must have exactly that shape and dtype, on ``device``, and be contiguous.
        index_arrays: where the episode index lives (``"step_ep"``, ``"ep_start"``, ``"ep_len"``):
            ``arrays(name, shape, dtype) -> ndarray``, e.g. memory that readers in other processes
            map to plan windows themselves (:mod:`reactor.replay.shared`). None: memory of its own.

    Raises:
        ValueError: empty or duplicate specs, capacity < 1, a bad device string.
        RuntimeError: CUDA or pinned memory asked for on a machine without CUDA.

    Example:
        >>> s = Storage([FieldSpec("obs", (8,)), FieldSpec("reward")], capacity=1024)
        >>> s.append({"obs": torch.zeros(3, 8), "reward": torch.ones(3)}).first_step
        0
    """

    # Per step of capacity: episode id of the step (8), and the episode ring's start and length (8 + 8).
    INDEX_BYTES_PER_STEP = 24

    def __init__(
        self,
        specs: Sequence[FieldSpec],
        capacity: int,
        *,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        allocator: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
        index_arrays: Callable[[str, tuple[int, ...], Any], np.ndarray] | None = None,
    ) -> None:
        specs = tuple(specs)
        if not specs:
            raise ValueError("Storage needs at least one FieldSpec")
        for spec in specs:
            if not isinstance(spec, FieldSpec):
                raise TypeError(f"Storage specs must be FieldSpec instances, got {spec!r}")
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Storage field names must be unique; duplicated: {dupes}")
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or not 1 <= capacity <= _MAX_CAPACITY:
            raise ValueError(f"Storage capacity must be an int in [1, 2**40] (steps), got {capacity!r}")
        self._device = _check_device(device, pin_memory)
        self._pin_memory = bool(pin_memory)
        self._specs = {s.name: s for s in specs}
        self._on_host = self._device.type == "cpu"  # (torch.device.type costs ~0.5 us an insert)
        # What validate_steps checks of each field: (name, spec, dtype, dims with the step dimension,
        # the shape after it or None where a dims check says it all), and whether a contiguous source's
        # bytes are its rows as the ring stores them (every dtype but complex ones; none for rows of 0
        # bytes): the append's byte copy.
        self._checks = [(s.name, s, s.dtype, 1 + len(s.shape), tuple(s.shape) or None,
                         not s.dtype.is_complex and s.step_nbytes > 0) for s in specs]
        self._capacity = int(capacity)
        if allocator is None:
            # Host rings on transparent huge pages: a window gather touches every field of a few
            # hundred random episodes, and with 4 KiB pages nearly every row missed the TLB
            # (reactor/_native.py: host_huge_zeros; docs/benchmarks.md).
            plain_host = self._device.type == "cpu" and not self._pin_memory
            self._fields: dict[str, torch.Tensor] = {
                s.name: host_huge_zeros((self._capacity, *s.shape), s.dtype)
                if plain_host
                else torch.empty(
                    (self._capacity, *s.shape), dtype=s.dtype, device=self._device, pin_memory=self._pin_memory
                )
                for s in specs
            }
        else:
            self._fields = {}
            for s in specs:
                shape = (self._capacity, *s.shape)
                t = allocator(s.name, shape, s.dtype)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != s.dtype:
                    got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ValueError(f"Storage allocator gave field {s.name!r} {got}; expected {shape} {s.dtype}")
                if t.device != self._device or not t.is_contiguous():
                    raise ValueError(
                        f"Storage allocator gave field {s.name!r} a tensor on {t.device} "
                        f"(contiguous={t.is_contiguous()}); expected a contiguous tensor on {self._device}"
                    )
                self._fields[s.name] = t
        cap = self._capacity

        def index(name: str) -> np.ndarray:
            if index_arrays is None:
                return np.zeros(cap, dtype=np.int64)
            a = index_arrays(name, (cap,), np.int64)
            a.fill(0)
            return a

        self._step_ep = index("step_ep")  # episode id of ring position
        self._ep_start = index("ep_start")  # indexed by episode id % capacity
        self._ep_len = index("ep_len")
        # The row horizon and the rewrite count: every append stores its end step in [0] before it
        # writes a row, so a reader that copied rows without a lock knows afterwards which steps' rows
        # may have been overwritten meanwhile: those below (horizon after the copy) - capacity; a
        # restore, which rewrites rows in place, makes [1] odd while it does (reactor.replay.shared).
        self._row_horizon = np.zeros(2, dtype=np.int64) if index_arrays is None else \
            index_arrays("row_horizon", (2,), np.int64)
        self._row_horizon[:] = 0
        self._plan_out = np.zeros(2, dtype=np.int64)  # (plan_append's kernel writes its plan here)
        self._first_step = 0
        self._next_step = 0
        self._first_ep = 0
        self._next_ep = 0
        self._open = False  # episode next_ep - 1 still takes appends
        self._row_views: dict[str, np.ndarray] = {}
        self._append_plan_cache: tuple[np.ndarray, np.ndarray] | None = None
        self._typed_views: dict[str, np.ndarray | None] = {}
        self._gather_plan: list[tuple[str, np.ndarray, np.dtype[Any] | None, tuple[int, ...], torch.dtype]] | None = (
            None
        )
        self._src_addrs: np.ndarray | None = None  # host field addresses, for the window kernel
        self._row_nbytes_arr = np.zeros(0, dtype=np.int64)
        self._row_nbytes = {s.name: s.step_nbytes for s in specs}
        self._np_dtypes: dict[str, np.dtype[Any] | None] = {s.name: numpy_twin(s.dtype) for s in specs}

    # ------------------------------------------------------------------ properties

    @property
    def specs(self) -> tuple[FieldSpec, ...]:
        """The field specs, in construction order."""
        return tuple(self._specs.values())

    @property
    def capacity(self) -> int:
        """Number of steps the ring holds."""
        return self._capacity

    @property
    def device(self) -> torch.device:
        """Where the field tensors live."""
        return self._device

    @property
    def pin_memory(self) -> bool:
        """Whether host memory is pinned."""
        return self._pin_memory

    @property
    def step_nbytes(self) -> int:
        """Raw bytes of one step over all fields."""
        return sum(self._row_nbytes.values())

    @property
    def num_steps(self) -> int:
        """Steps stored now."""
        return self._next_step - self._first_step

    @property
    def num_episodes(self) -> int:
        """Episodes stored now, the open one included."""
        return self._next_ep - self._first_ep

    @property
    def step_range(self) -> tuple[int, int]:
        """Half-open range of global step numbers stored now."""
        return (self._first_step, self._next_step)

    @property
    def episode_range(self) -> tuple[int, int]:
        """Half-open range of episode ids stored now."""
        return (self._first_ep, self._next_ep)

    @property
    def open_episode(self) -> int | None:
        """Id of the episode still taking appends, or None."""
        return self._next_ep - 1 if self._open else None

    def memory(self) -> StorageMemory:
        """Report the bytes held: data, index, and the raw bytes of the stored steps."""
        return StorageMemory(
            data_nbytes=sum(t.numel() * t.element_size() for t in self._fields.values()),
            index_nbytes=self._step_ep.nbytes + self._ep_start.nbytes + self._ep_len.nbytes,
            stored_nbytes=self.num_steps * self.step_nbytes,
        )

    # ------------------------------------------------------------------ writing

    def validate_steps(self, steps: Mapping[str, Any]) -> tuple[int, dict[str, torch.Tensor]]:
        """Check a batch of steps against the specs without storing anything.

        Args:
            steps: field name -> tensor or numpy array of shape ``[L, *spec.shape]`` and the spec's dtype.

        Returns:
            ``(L, tensors)`` with every value as a torch tensor.

        Raises:
            KeyError: a field is missing or unknown.
            ValueError: a wrong shape, mismatched lengths L between fields, or L == 0.
            TypeError: a wrong dtype, or a value that is not a tensor/array.
        """
        length, out, _ = self._validate(steps, False)
        return length, out

    def _validate(self, steps: Mapping[str, Any], sources: bool) -> tuple[int, dict[str, torch.Tensor], list[int]]:
        """:meth:`validate_steps`, and with ``sources`` (a host storage) each field's source address in
        field order where the append's kernel may copy its bytes (a contiguous CPU tensor without the
        negative bit, of a field whose bytes are its values), else 0: taken in the same pass over the
        fields, for :meth:`append` and the Table's one-kernel insert."""
        if type(steps) is not dict and not isinstance(steps, Mapping):  # (an ABC's isinstance: ~0.4 us)
            raise TypeError(f"steps must be a mapping of field name -> tensor, got {type(steps).__name__}")
        if steps.keys() != self._specs.keys():  # (a set comparison for dicts; any other keys() looks here)
            unknown = sorted(set(steps) - set(self._specs))
            if unknown:
                raise KeyError(
                    f"unknown field(s) {unknown}; this storage has fields {sorted(self._specs)}"
                )
            missing = sorted(set(self._specs) - set(steps))
            if missing:
                raise KeyError(f"missing field(s) {missing}; every append must carry all of {sorted(self._specs)}")
        out: dict[str, torch.Tensor] = {}
        src: list[int] = []
        length: int | None = None
        first_name = ""
        # (per insert, per field: a handful of attribute reads, no call that builds an object)
        for name, spec, dtype, dims, tail, by_bytes in self._checks:
            value = steps[name]
            if type(value) is not torch.Tensor:
                if isinstance(value, np.ndarray):
                    if any(st < 0 for st in value.strides):  # (a reversed view: torch takes no negative strides)
                        value = np.ascontiguousarray(value)
                    try:
                        value = torch.from_numpy(value)
                    except TypeError as e:
                        raise TypeError(f"field {name!r}: numpy dtype {value.dtype} has no torch equivalent") from e
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"field {name!r} must be a torch.Tensor or numpy array, got {type(value).__name__}")
            if value.dtype != dtype:
                raise TypeError(f"field {name!r} has dtype {value.dtype}, expected {spec.dtype}; cast it first")
            if value.layout is not torch.strided or value.is_nested or value.is_meta:
                # (checked before any field is written: the copy failed midway, over the oldest live rows)
                kind = "nested" if value.is_nested else "meta (data-less)" if value.is_meta else value.layout
                raise TypeError(f"field {name!r} is a {kind} tensor: a dense (strided) tensor with data is expected")
            shape = value.shape
            if len(shape) != dims or (dims > 1 and (shape[1] != tail[0] if dims == 2 else shape[1:] != tail)):
                raise ValueError(
                    f"field {name!r} has shape {tuple(shape)}, expected [L, *{spec.shape}] "
                    f"(a leading step dimension, then the spec shape)"
                )
            n = shape[0]
            if length is None:
                length, first_name = n, name
            elif n != length:
                raise ValueError(
                    f"field {name!r} has {n} steps but field {first_name!r} has {length}; "
                    "all fields of one append need the same number of steps"
                )
            out[name] = value
            if sources:  # (the byte copy's source address, or 0: copied field by field)
                src.append(value.data_ptr() if by_bytes and value.is_cpu and value.is_contiguous() and not value.is_neg()
                           else 0)
        assert length is not None
        if length == 0:
            raise ValueError("append of 0 steps: every field has an empty leading dimension")
        if length > self._capacity:
            raise ValueError(f"append of {length} steps exceeds the storage capacity {self._capacity}")
        return length, out, src

    def _episode_ends(self, length: int, episode_end: bool | np.ndarray | Sequence[bool]) -> np.ndarray:
        if isinstance(episode_end, (bool, np.bool_)):
            ends = np.zeros(length, dtype=bool)
            ends[-1] = bool(episode_end)
            return ends
        ends = np.asarray(episode_end)
        if ends.dtype != np.bool_ or ends.shape != (length,):
            raise ValueError(
                f"episode_end must be a bool or a bool array of shape ({length},), got "
                f"dtype {ends.dtype} shape {ends.shape}"
            )
        return ends

    def plan_append(
        self, length: int, episode_end: bool | np.ndarray | Sequence[bool] = True
    ) -> tuple[int, np.ndarray, int, int]:
        """Work out where an append of ``length`` steps goes, without changing anything.

        Returns:
            ``(first_episode, ends, new_first_step, new_first_ep)``: the episode of the first new step
            (each end starts the next), the episode-end flags, and the storage's first step and first
            episode after evictions.

        Raises:
            ValueError: ``length`` not in [1, capacity], ``episode_end`` malformed, or the open episode
                would have to evict itself.
        """
        if not 0 < length <= self._capacity:  # (the kernel reads the last end flag unchecked: at 0, out of bounds)
            raise ValueError(f"an append of {length} steps: a storage of capacity {self._capacity} takes 1 to "
                             f"{self._capacity}")
        ends = self._episode_ends(length, episode_end)
        first_eid = self._next_ep - 1 if self._open else self._next_ep
        out = self._plan_out
        why = _nb_plan_append(ends, self._next_step, self._next_ep, self._first_step, self._first_ep, self._open,
                              self._step_ep, self._ep_start, self._ep_len, self._capacity, out)
        if not why:
            return first_eid, ends, int(out[0]), int(out[1])
        cap = self._capacity
        if why == 1:  # (then every later append was refused, and nothing but reset() could go on)
            closed = np.flatnonzero(ends)
            tail = length - 1 - int(closed[-1]) if len(closed) else length + (
                int(self._ep_len[(self._next_ep - 1) % cap]) if self._open else 0)
            raise ValueError(
                f"this append would leave an open episode of {tail} steps, the storage's whole capacity {cap}: "
                f"no step could end it (it would have to evict the episode's own start); end episodes sooner "
                f"(episode_end=True) or raise capacity")
        o = self._next_ep - 1
        raise ValueError(
            f"open episode {o} ({self._ep_len[o % cap]} steps + {length} appended) would no longer fit "
            f"in the storage capacity {cap}: end episodes sooner (episode_end=True) or raise capacity"
        )

    def append(
        self,
        steps: Mapping[str, Any],
        episode_end: bool | np.ndarray | Sequence[bool] = True,
        *,
        _validated: tuple[int, dict[str, torch.Tensor], list[int]] | None = None,  # (_validate's, sources on the host)
        _plan: tuple[int, np.ndarray, int, int] | None = None,
    ) -> AppendResult:
        """Append ``L`` steps, evicting whole oldest episodes if the ring is full.

        The first step continues the open episode if there is one, else starts a new episode.

        Args:
            steps: field name -> ``[L, *shape]`` tensor/array for every field.
            episode_end: ``True`` (the default) ends the episode at the last step, ``False`` leaves it
                open for the next append; a bool array of shape ``[L]`` marks each step that ends one.

        Returns:
            An :class:`AppendResult` with the new steps' first global step and what was evicted.

        Raises:
            KeyError, TypeError, ValueError: as :meth:`validate_steps` and :meth:`plan_append`; the
                storage is unchanged when they do.
        """
        length, tensors, src = _validated if _validated is not None else self._validate(steps, self._on_host)
        first_eid, ends, new_first_step, new_first_ep = (
            _plan if _plan is not None else self.plan_append(length, episode_end)
        )
        cap = self._capacity
        evicted_steps = (self._first_step, new_first_step)
        evicted_eps = (self._first_ep, new_first_ep)
        first = self._next_step
        # Data: at most two contiguous slices of the ring.
        pos0 = first % cap
        n1 = min(length, cap - pos0)
        if self._on_host:
            # Contiguous CPU sources are copied by address in the one kernel that also reserves the rows
            # and writes the episode index; the rest (strided, on a GPU, complex or with the negative
            # bit: a conjugate or negative view's bytes are not its values) first, field by field,
            # after the reservation.
            dst, row_nbytes = self._append_plan()
            if 0 in src:
                self._copy_rows_where(tensors, src, False, first, length)
            next_ep = int(_nb_append(self._row_horizon, dst, np.array(src, dtype=np.int64), row_nbytes, pos0, n1,
                                     length, self._step_ep, self._ep_start, self._ep_len, ends, first, first_eid,
                                     self._open, cap))
            if next_ep < 0:  # a source is a view of its own ring: numpy copies overlapping memory right
                self._copy_rows_where(tensors, src, True, first, length)
        else:
            self._copy_rows_where(tensors, None, False, first, length)
            next_ep = -1
        if next_ep < 0:
            next_ep = int(_nb_index_append(self._step_ep, self._ep_start, self._ep_len, ends, first, first_eid,
                                           self._open, cap))
        self._appended(first + length, next_ep, bool(ends[-1]), new_first_step, new_first_ep)
        return AppendResult(first, length, evicted_steps, evicted_eps)

    def _appended(self, next_step: int, next_ep: int, closed: bool, first_step: int, first_ep: int) -> None:
        """The bookkeeping of an append whose rows and episode index are written."""
        self._next_step = next_step
        self._next_ep = next_ep
        self._open = not closed
        self._first_step, self._first_ep = first_step, first_ep

    def _kernel_append_args(self, length: int, plan: tuple[int, np.ndarray, int, int], src: np.ndarray) -> tuple:
        """``_nb_append``'s arguments for an append of ``length`` steps planned as ``plan``, from the
        addresses ``src`` (:meth:`_validate`'s, none of them 0); after the kernel, :meth:`_appended` with
        the episode id it returned (as :meth:`append` does)."""
        dst, row_nbytes = self._append_plan()
        cap = self._capacity
        first = self._next_step
        pos0 = first % cap
        return (self._row_horizon, dst, src, row_nbytes, pos0, min(length, cap - pos0), length, self._step_ep,
                self._ep_start, self._ep_len, plan[1], plan[0], self._open)

    def _append_plan(self) -> tuple[np.ndarray, np.ndarray]:
        """Per host field, in field order: the ring's base address and its row bytes."""
        plan = self._append_plan_cache
        if plan is None:
            plan = self._append_plan_cache = (
                np.array([t.data_ptr() for t in self._fields.values()], dtype=np.int64),
                np.array([self._row_nbytes[n] for n in self._fields], dtype=np.int64),
            )
        return plan

    def _copy_rows_where(self, tensors: Mapping[str, torch.Tensor], src: list[int] | None, by_bytes: bool,
                         first: int, length: int) -> None:
        """Reserve the rows of an append of ``length`` steps from global step ``first``, then copy by
        numpy or torch the fields whose ``src`` entry (in field order) is nonzero (``by_bytes``) or
        zero; every field when ``src`` is None."""
        _nb_reserve_rows(self._row_horizon, first + length)  # before any row of the ring changes
        pos0 = first % self._capacity
        n1 = min(length, self._capacity - pos0)
        for i, name in enumerate(self._fields):
            if src is None or bool(src[i]) == by_bytes:
                self._copy_rows(name, tensors[name], pos0, n1, length)

    def _copy_rows(self, name: str, src: torch.Tensor, pos0: int, n1: int, length: int) -> None:
        """One field's rows into the ring by numpy or torch (a source the byte copy does not take).
        A source that requires grad is detached: a ``copy_`` of it would make the ring a node of its
        graph (keeping the graph alive, every snapshot requiring grad)."""
        dst_np = self._typed_view(name)
        if src.requires_grad:
            src = src.detach()
        if dst_np is None or not src.is_cpu or src.is_conj() or src.is_neg():
            dst = self._fields[name]
            dst[pos0 : pos0 + n1].copy_(src[:n1])
            if n1 < length:
                dst[: length - n1].copy_(src[n1:])
            return
        src_np = src.numpy()
        dst_np[pos0 : pos0 + n1] = src_np[:n1]
        if n1 < length:
            dst_np[: length - n1] = src_np[n1:]

    def reset(self) -> None:
        """Drop every stored step and episode. Global step numbers and episode ids keep counting up."""
        self._first_step = self._next_step
        self._first_ep = self._next_ep
        self._open = False

    # ------------------------------------------------------------------ reading

    def _check_stored(self, steps: np.ndarray) -> None:
        if len(steps) == 0 or (steps.min() >= self._first_step and steps.max() < self._next_step):
            return
        bad = (steps < self._first_step) | (steps >= self._next_step)
        if bad.any():
            s = int(steps[np.argmax(bad)])
            raise KeyError(f"global step {s} is not stored (stored range {self.step_range})")

    def _typed_view(self, name: str) -> np.ndarray | None:
        """A zero-copy numpy view ``[capacity, *shape]`` of a host field (None on CUDA or without a numpy dtype)."""
        view = self._typed_views.get(name, False)
        if view is False:
            view = None
            if self._device.type == "cpu" and self._np_dtypes[name] is not None:
                view = self._fields[name].numpy()
            self._typed_views[name] = view
        return view  # type: ignore[return-value]

    def _rows(self, name: str) -> np.ndarray | None:
        """A zero-copy ``uint8 [capacity, row_nbytes]`` numpy view of a host field (None on CUDA)."""
        rows = self._row_views.get(name)
        if rows is None and self._device.type == "cpu":
            t = self._fields[name]
            nb = self._row_nbytes[name]
            rows = t.view(self._capacity, -1).view(torch.uint8).numpy() if nb else np.empty((self._capacity, 0), np.uint8)
            self._row_views[name] = rows
        return rows

    def _host_gather_plan(self) -> list[tuple[str, np.ndarray, np.dtype[Any] | None, tuple[int, ...], torch.dtype]]:
        """Per host field, what a row gather needs: (name, byte-row view, numpy dtype, shape, torch dtype)."""
        plan = self._gather_plan
        if plan is None:
            plan = [
                (n, self._rows(n), self._np_dtypes[n], self._specs[n].shape, self._specs[n].dtype)  # type: ignore[misc]
                for n in self._fields
            ]
            self._gather_plan = plan
        return plan

    def _gather(self, flat_steps: np.ndarray, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        # Host: ndarray.take of byte rows (one memcpy per row, no per-element dtype dispatch; 5-6x
        # faster than torch or numpy fancy indexing of 2-D rows here); CUDA: index_select.
        pos = flat_steps % self._capacity
        if self._on_host:
            b = len(pos)
            out: dict[str, torch.Tensor] = {}
            wanted = None if names is None else set(names)
            for n, rows, npdt, shape, dtype in self._host_gather_plan():
                if wanted is not None and n not in wanted:
                    continue
                if rows.shape[1] == 0:
                    out[n] = torch.empty((b, *shape), dtype=dtype)
                elif npdt is not None:  # reinterpret on the numpy side: one torch call
                    out[n] = torch.from_numpy(rows.take(pos, axis=0).view(npdt).reshape(b, *shape))
                else:
                    out[n] = torch.from_numpy(rows.take(pos, axis=0)).view(dtype).view(b, *shape)
            if wanted is not None and len(out) != len(wanted):
                raise KeyError(f"unknown field(s) {sorted(wanted - set(out))}; fields: {sorted(self._specs)}")
            return out
        idx = torch.from_numpy(pos).to(self._device, non_blocking=True)
        return {n: self._fields[n].index_select(0, idx) for n in (names if names is not None else self._fields)}

    @staticmethod
    def _window_args(steps: np.ndarray, length: int, pad: str) -> np.ndarray:
        """Validate a window read's length and pad; the steps as a contiguous int64 1-D array."""
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"window length must be an int >= 1, got {length!r}")
        if pad not in ("head", "tail"):
            raise ValueError(f"pad must be 'head' or 'tail', got {pad!r}")
        steps = np.ascontiguousarray(steps, dtype=np.int64)
        if steps.ndim != 1:
            raise ValueError(f"steps must be a 1-D array of global steps, got shape {steps.shape}")
        return steps

    def _window_ranges(
        self, steps: np.ndarray, length: int, pad: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Validate a window read; ``(steps, pos, lo, hi)``: ring position of each window's first
        step and the valid range ``[lo, hi)`` of its positions (see ``_nb_window_ranges``)."""
        steps = self._window_args(steps, length, pad)
        b = steps.shape[0]
        pos = np.empty(b, dtype=np.int64)
        lo = np.empty(b, dtype=np.int64)
        hi = np.empty(b, dtype=np.int64)
        bad = _nb_window_ranges(
            steps, int(length), pad == "head", self._step_ep, self._ep_start, self._ep_len,
            self._first_step, self._next_step, self._first_ep, pos, lo, hi,
        )
        if bad >= 0:
            raise KeyError(f"global step {int(steps[bad])} is not stored (stored range {self.step_range})")
        return steps, pos, lo, hi

    def _read_windows_host(self, steps: np.ndarray, length: int, head: bool) -> dict[str, torch.Tensor]:
        """Host windows: one compiled call (ranges, then every field into its own fresh tensor)."""
        out, dst_addrs, mask = self._window_outputs(steps.shape[0], length)
        bad = _nb_read_windows(steps, int(length), head, self._window_kernel_args(), dst_addrs, mask, _PREFETCH_WINDOWS)
        if bad >= 0:
            raise KeyError(f"global step {int(steps[bad])} is not stored (stored range {self.step_range})")
        out["mask"] = torch.from_numpy(mask)
        return out

    def _window_outputs(self, b: int, length: int) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
        """Fresh host outputs for ``b`` windows: field -> ``[b, length, ...]``, their addresses, and
        the ``[b, length]`` mask array (not yet in the dict).

        From ``host_empty`` (malloc): the same addresses as the batch the caller just dropped, so the
        copy writes into lines still in L2 (reactor/_native.py; docs/benchmarks.md).
        """
        plan = self._host_gather_plan()
        out: dict[str, torch.Tensor] = {n: host_empty((b, length, *shape), dtype) for n, _, _, shape, dtype in plan}
        dst_addrs = np.array([t.data_ptr() for t in out.values()], dtype=np.int64)
        return out, dst_addrs, np.empty((b, length), dtype=np.bool_)

    def _window_kernel_args(self) -> tuple[Any, ...]:
        """The host ring as ``_nb_read_windows`` takes it (one tuple argument; the table's compiled
        sample passes it on, as it reads windows in the same call)."""
        if self._src_addrs is None:
            plan = self._host_gather_plan()
            self._src_addrs = np.array([rows.ctypes.data for _, rows, *_ in plan], dtype=np.int64)
            self._row_nbytes_arr = np.array([rows.shape[1] for _, rows, *_ in plan], dtype=np.int64)
        return (
            self._step_ep, self._ep_start, self._ep_len, self._first_step, self._next_step, self._first_ep,
            self._src_addrs, self._row_nbytes_arr,
        )

    def episode_bounds(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Episode id, first global step and end (exclusive, as written so far) of each given step.

        Raises:
            KeyError: a step is not stored.
        """
        steps = np.asarray(steps, dtype=np.int64)
        self._check_stored(steps)
        cap = self._capacity
        eps = self._step_ep[steps % cap]
        start = self._ep_start[eps % cap]
        return eps, start, start + self._ep_len[eps % cap]

    def read_steps(self, steps: np.ndarray) -> dict[str, torch.Tensor]:
        """Gather the given global steps: field -> ``[B, *shape]``.

        Raises:
            KeyError: a step is not stored.
        """
        steps = np.asarray(steps, dtype=np.int64)
        self._check_stored(steps)
        return self._gather(steps)

    def read_transitions(
        self,
        steps: np.ndarray,
        *,
        n: int = 1,
        gamma: float = 0.99,
        reward_field: str = "reward",
        next_fields: Sequence[str] = ("obs",),
    ) -> dict[str, torch.Tensor]:
        """Gather n-step transitions starting at the given steps.

        Convention: step ``t`` holds ``o_t`` and the ``a_t``, ``r_t`` taken from it; an episode's last
        stored step holds its final observation (its action and reward are not read). For a step ``s``
        whose episode has stored steps up to ``last``, ``m = min(n, last - s)`` and::

            reward   = sum_{k<m} gamma^k r_{s+k}        (the n-step return)
            discount = gamma^m
            next_<f> = f[s + m]                          for f in next_fields
            valid    = m >= 1                            (False only for an item on an episode's last step)

        Every other field is read at ``s``.

        Returns:
            field -> ``[B, ...]`` with ``reward`` replaced by the n-step return, plus ``discount``
            (reward dtype), ``valid`` (bool) and ``next_<f>``.

        Raises:
            KeyError: a step is not stored, or a field name is unknown.
        """
        for f in (reward_field, *next_fields):
            if f not in self._specs:
                raise KeyError(f"transition field {f!r} is not a storage field; fields: {sorted(self._specs)}")
        steps = np.asarray(steps, dtype=np.int64)
        _, _, end = self.episode_bounds(steps)
        m = np.minimum(n, end - 1 - steps)
        out = self._gather(steps)
        k = np.arange(n, dtype=np.int64)
        win = steps[:, None] + np.minimum(k[None, :], np.maximum(m[:, None] - 1, 0))
        rewards = self._gather(win.ravel(), [reward_field])[reward_field]
        rewards = rewards.reshape(len(steps), n, *rewards.shape[1:])
        out[reward_field], out["discount"], out["valid"] = n_step_return(rewards, m, gamma)
        nxt = self._gather(steps + m, next_fields)
        for f in next_fields:
            out[f"next_{f}"] = nxt[f]
        return out

    def plan_transitions(
        self, steps: np.ndarray, *, n: int = 1, gamma: float = 0.99
    ) -> TransitionPlan:
        """Plan :meth:`read_transitions` without gathering: the ring slots and coefficients it uses.

        A reader that maps the field memory (e.g. another process over shared memory) gathers the
        rows itself. For a field ``f`` of tensor ``F`` (``[capacity, *shape]``) and
        ``rdt = reward dtype if floating else float32``, :meth:`read_transitions` equals::

            f           = F[plan.rows]
            reward      = (R[plan.reward_rows].to(rdt) * plan.reward_coef.to(rdt)[..., None...]).sum(1)
            discount    = plan.discount.to(rdt)
            valid       = plan.valid
            next_<f>    = F[plan.next_rows]

        Every slot in the plan holds a stored step of the item's own episode (rewards past the
        n-step horizon point at a real step and get coefficient 0), so a reader that checks the
        rows were not overwritten (a version column) need check nothing else.

        Args:
            steps: global step numbers (the item keys), shape ``[B]``.
            n: the number of reward steps (n-step return), ``>= 1``.
            gamma: the discount.

        Returns:
            A :class:`TransitionPlan`.

        Raises:
            KeyError: a step is not stored.
            ValueError: ``n < 1``.

        Example:
            >>> plan = storage.plan_transitions(np.array([3, 7]), n=3, gamma=0.99)
            >>> obs = storage_obs_tensor[torch.from_numpy(plan.rows)]
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n (n-step return) must be an int >= 1, got {n!r}")
        steps = np.asarray(steps, dtype=np.int64)
        _, _, end = self.episode_bounds(steps)
        m = np.minimum(n, end - 1 - steps)
        k = np.arange(n, dtype=np.int64)
        cap = self._capacity
        reward_steps = steps[:, None] + np.minimum(k[None, :], np.maximum(m[:, None] - 1, 0))
        coef = (gamma ** k.astype(np.float64))[None, :] * (k[None, :] < m[:, None])
        return TransitionPlan(
            rows=steps % cap,
            next_rows=(steps + m) % cap,
            reward_rows=reward_steps % cap,
            reward_coef=coef,
            discount=gamma ** m.astype(np.float64),
            valid=m >= 1,
        )

    def window_spans(self, steps: np.ndarray, length: int, pad: Literal["head", "tail"] = "tail") -> np.ndarray:
        """The compact form of :meth:`plan_windows`: int64 ``[B, 3]``, per window ``(base, lo, hi)``.

        ``base`` is the global step at window position 0 (``step`` for tail padding, ``step - T + 1``
        for head padding), ``[lo, hi)`` the valid positions. Position ``j`` holds global step
        ``base + clip(j, lo, hi - 1)`` (padding repeats the nearest valid step) in ring slot
        ``that % capacity``; :func:`expand_window_spans` gives the full plan. Three numbers a window
        instead of ``3 * T`` are what a shard sends a reader that gathers the rows itself.

        Raises:
            KeyError, ValueError: as :meth:`plan_windows`.
        """
        steps, _, lo, hi = self._window_ranges(steps, length, pad)
        base = steps - (int(length) - 1) if pad == "head" else steps
        return np.stack([base, lo, hi], axis=1)

    def plan_windows(
        self, steps: np.ndarray, length: int, pad: Literal["head", "tail"] = "tail"
    ) -> tuple[np.ndarray, np.ndarray]:
        """Plan :meth:`read_windows` without gathering: the ring slot of every window position.

        A reader that maps the field memory (e.g. another process over shared memory) gathers the
        windows itself: for every field tensor ``F`` (``[capacity, *shape]``)::

            w = F[rows]            # [B, length, *shape]
            w[~mask] = 0           # equals read_windows(steps, length, pad)[field]

        Padding positions point at a stored step of the window's own episode (the nearest one), never
        at another episode's or a free slot, so a reader that checks the rows were not overwritten
        (a version column) need check nothing else.

        Args:
            steps: global step numbers (the item keys), shape ``[B]``.
            length: window length ``T >= 1``.
            pad: ``"tail"`` (window starts at the step) or ``"head"`` (window ends at the step).

        Returns:
            ``(rows, mask)``: ``rows`` int64 ``[B, T]`` ring slots in ``[0, capacity)``, ``mask``
            bool ``[B, T]`` (False at padding positions).

        Raises:
            KeyError: a step is not stored.
            ValueError: ``length < 1`` or ``pad`` not "head"/"tail".

        Example:
            >>> rows, mask = storage.plan_windows(np.array([5, 40]), 8, "tail")
            >>> obs = obs_tensor[torch.from_numpy(rows)] * torch.from_numpy(mask)[..., None]
        """
        _, pos, lo, hi = self._window_ranges(steps, length, pad)
        offs = np.arange(length, dtype=np.int64)[None, :]
        mask = (offs >= lo[:, None]) & (offs < hi[:, None])
        rows = pos[:, None] + np.clip(offs, lo[:, None], (hi - 1)[:, None])
        rows %= self._capacity
        return rows, mask

    def read_windows(
        self, steps: np.ndarray, length: int, pad: Literal["head", "tail"] = "tail"
    ) -> dict[str, torch.Tensor]:
        """Gather fixed-length windows ``[B, length, ...]`` with a validity mask.

        ``pad="tail"``: the window starts at the step and runs forward; positions past the episode's
        stored end are padding, at the tail. ``pad="head"``: the window ends at the step; positions
        before the episode's first step are padding, at the head. Windows never cross episodes.
        Padding positions hold zeros and ``mask`` is False there.

        Returns:
            field -> ``[B, length, *shape]``, plus ``mask``: bool ``[B, length]``.

        Raises:
            KeyError: a step is not stored.
            ValueError: ``length < 1`` or ``pad`` not "head"/"tail".
        """
        if self._on_host:
            return self._read_windows_host(self._window_args(steps, length, pad), int(length), pad == "head")
        _, pos, lo, hi = self._window_ranges(steps, length, pad)
        offs = np.arange(length, dtype=np.int64)[None, :]
        mask = (offs >= lo[:, None]) & (offs < hi[:, None])
        idx = torch.from_numpy(((pos[:, None] + offs) % self._capacity).ravel()).to(self._device)
        zero_rows = None if mask.all() else torch.from_numpy(np.flatnonzero(~mask.ravel())).to(self._device)
        out: dict[str, torch.Tensor] = {}
        for n, t in self._fields.items():
            g = t.index_select(0, idx)
            if zero_rows is not None:
                g.index_fill_(0, zero_rows, 0)
            out[n] = g.view(len(pos), length, *t.shape[1:])
        out["mask"] = torch.from_numpy(mask).to(self._device)
        return out

    def read_episodes(self, episode_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """Gather whole episodes, concatenated without padding.

        Returns:
            field -> ``[sum(lengths), *shape]`` (episode after episode), plus ``lengths``: int64 ``[B]``.

        Raises:
            KeyError: an episode id is not stored.
        """
        eids = np.asarray(episode_ids, dtype=np.int64)
        bad = (eids < self._first_ep) | (eids >= self._next_ep)
        if bad.any():
            e = int(eids[np.argmax(bad)])
            raise KeyError(f"episode {e} is not stored (stored episodes {self.episode_range})")
        cap = self._capacity
        start = self._ep_start[eids % cap]
        lens = self._ep_len[eids % cap]
        total = int(lens.sum())
        offsets = np.cumsum(lens) - lens
        flat = np.repeat(start - offsets, lens) + np.arange(total, dtype=np.int64)
        out = self._gather(flat)
        out["lengths"] = torch.from_numpy(lens.copy()).to(self._device)
        return out
