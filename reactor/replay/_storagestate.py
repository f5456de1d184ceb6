"""A Storage's state: :class:`StorageState` gives ``Storage`` its ``snapshot_buffers``, ``state_dict``
and ``load_state_dict`` (checked before anything changes), as ``_tablestate.py`` does for the Table."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._storagekernels import _nb_rewrite_begin, _nb_rewrite_end

if TYPE_CHECKING:
    from .storage import FieldSpec


class StorageState:
    """The state methods of :class:`reactor.replay.Storage` (its base class)."""

    _capacity: int
    _fields: dict[str, torch.Tensor]
    _specs: dict[str, FieldSpec]
    _step_ep: np.ndarray
    _ep_start: np.ndarray
    _ep_len: np.ndarray
    _row_horizon: np.ndarray
    _first_step: int
    _next_step: int
    _first_ep: int
    _next_ep: int
    _open: bool
    _device: torch.device
    _rewrite_depth: int = 0

    @contextlib.contextmanager
    def _rewriting(self) -> Iterator[None]:
        """Rows may be rewritten in place inside: the rewrite count is odd from entry to exit (outermost
        only), then the row horizon is the stored steps' end, whatever the rewrite left (a reader that
        copied rows without a lock meanwhile refuses what it copied: reactor.replay.shared)."""
        if self._rewrite_depth == 0:
            _nb_rewrite_begin(self._row_horizon)
        self._rewrite_depth += 1
        try:
            yield
        finally:
            self._rewrite_depth -= 1
            if self._rewrite_depth == 0:
                _nb_rewrite_end(self._row_horizon, self._next_step)

    def _slot_bytes(self, lo: int, hi: int) -> dict[str, list[memoryview]] | None:
        """Writable byte views, by field, of the ring slots global steps ``[lo, hi)`` take, in step
        order (one view, or two where the ring wraps): where a checkpoint's rows are read straight into
        place (``Table``'s restore) instead of into a second copy. None: the rows are not in host memory.
        The caller writes them inside :meth:`_rewriting`."""
        if self._device.type != "cpu" or not 0 <= lo <= hi or hi - lo > self._capacity:
            return None
        cap, n = self._capacity, hi - lo
        p0 = lo % cap
        n1 = min(n, cap - p0)
        out = {}
        for name, t in self._fields.items():
            parts = [t[p0 : p0 + n1], t[: n - n1]]
            out[name] = [memoryview(p.reshape(-1).view(torch.uint8).numpy()) for p in parts if p.shape[0]]
        return out

    def snapshot_buffers(self) -> dict[str, torch.Tensor]:
        """Host buffers, already paged in, that :meth:`state_dict` can copy the live steps into.

        Allocating and touching fresh memory costs several times the copy itself (page faults: ~1.5 s
        vs ~0.2 s per GB here), so a checkpoint allocates these *before* taking the table's lock and
        holds the lock only for the copy. Sized for the current steps plus room for a quarter of the
        capacity of growth; :meth:`state_dict` falls back to fresh memory if more arrived since.
        """
        n = min(self._capacity, self._next_step - self._first_step + self._capacity // 4 + 1)
        return {name: torch.zeros((n, *t.shape[1:]), dtype=t.dtype) for name, t in self._fields.items()}

    def state_dict(self, buffers: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """A copy of the stored steps (in global order, live region only) and the episode index.

        The copy is taken at call time, so the caller may write it out while the storage moves on.

        Args:
            buffers: optional :meth:`snapshot_buffers` to copy into (views of them are returned).

        Returns:
            ``{"fields": {name: tensor [num_steps, ...] on CPU}, "ep_start", "ep_len": int64 arrays of the
            live episodes, "first_step", "next_step", "first_ep", "next_ep": int, "open": bool}``.
        """
        cap = self._capacity
        lo, hi = self._first_step, self._next_step
        p0, n = lo % cap, hi - lo
        n1 = min(n, cap - p0)
        fields = {}
        for name, t in self._fields.items():
            buf = None if buffers is None else buffers.get(name)
            if buf is None or buf.shape[0] < n:
                buf = torch.empty((n, *t.shape[1:]), dtype=t.dtype)
            dst = buf[:n]
            dst[:n1].copy_(t[p0 : p0 + n1])
            if n1 < n:
                dst[n1:].copy_(t[: n - n1])
            fields[name] = dst
        ep_ids = np.arange(self._first_ep, self._next_ep, dtype=np.int64) % cap
        return {
            "fields": fields,
            "ep_start": self._ep_start[ep_ids].copy(),
            "ep_len": self._ep_len[ep_ids].copy(),
            "first_step": self._first_step,
            "next_step": self._next_step,
            "first_ep": self._first_ep,
            "next_ep": self._next_ep,
            "open": self._open,
        }

    def load_state_dict(self, state: Mapping[str, Any], *, _rows_in_place: bool = False) -> None:
        """Restore what :meth:`state_dict` returned (same specs and a capacity large enough). Rows are
        rewritten in place under the rewrite count, so a reader copying rows without a lock meanwhile
        refuses what it copied (reactor.replay.shared). (``_rows_in_place``: the caller wrote the rows
        into :meth:`_slot_bytes` of the state's step range already, inside :meth:`_rewriting`, and
        ``state`` has no ``fields``.)

        Raises:
            ValueError: the state does not fit this storage (fields, shapes, dtypes, capacity), or its
                episode index is inconsistent (see ``_check_episode_index``). The storage is unchanged.
        """
        cap = self._capacity
        lo, hi = int(state["first_step"]), int(state["next_step"])
        first_ep, next_ep = int(state["first_ep"]), int(state["next_ep"])
        n = hi - lo
        if not (0 <= lo <= hi and 0 <= first_ep <= next_ep):
            raise ValueError(f"state has step range [{lo}, {hi}) and episode range [{first_ep}, {next_ep}); "
                             "each must be a range of numbers >= 0")
        if n > cap or next_ep - first_ep > cap:
            raise ValueError(f"state holds {n} steps, more than this storage's capacity {cap}")
        fields = {} if _rows_in_place else state["fields"]
        if not _rows_in_place and set(fields) != set(self._specs):
            raise ValueError(f"state fields {sorted(fields)} differ from storage fields {sorted(self._specs)}")
        for name, t in fields.items():
            spec = self._specs[name]
            if t.dtype != spec.dtype or tuple(t.shape) != (n, *spec.shape):
                raise ValueError(
                    f"state field {name!r} has dtype {t.dtype} shape {tuple(t.shape)}, expected "
                    f"{spec.dtype} {(n, *spec.shape)}"
                )
        ep_start = np.asarray(state["ep_start"], dtype=np.int64)
        ep_len = np.asarray(state["ep_len"], dtype=np.int64)
        _check_episode_index(lo, hi, first_ep, next_ep, ep_start, ep_len, bool(state["open"]))
        with self._rewriting():  # (from here on the state changes; readers see the count move)
            p0 = lo % cap
            n1 = min(n, cap - p0)
            for name, t in fields.items():
                dst = self._fields[name]
                dst[p0 : p0 + n1].copy_(t[:n1])
                if n1 < n:
                    dst[: n - n1].copy_(t[n1:])
            ids = np.arange(first_ep, next_ep, dtype=np.int64)
            self._ep_start[ids % cap] = ep_start
            self._ep_len[ids % cap] = ep_len
            steps = np.arange(lo, hi, dtype=np.int64)
            self._step_ep[steps % cap] = np.repeat(ids, ep_len)
            self._first_step, self._next_step = lo, hi
            self._first_ep, self._next_ep = first_ep, next_ep
            self._open = bool(state["open"])


def _check_episode_index(
    lo: int, hi: int, first_ep: int, next_ep: int, ep_start: np.ndarray, ep_len: np.ndarray, open_: bool
) -> None:
    """Raise ValueError unless the episodes ``[first_ep, next_ep)`` tile the stored steps ``[lo, hi)``
    exactly: contiguous, in order, each at least one step, the last one open only if ``open_``."""
    m = next_ep - first_ep
    if ep_start.shape != (m,) or ep_len.shape != (m,):
        raise ValueError(f"state's episode index has shapes {ep_start.shape} and {ep_len.shape}, expected ({m},)")
    if m == 0:
        if hi != lo or open_:
            raise ValueError(f"state holds steps [{lo}, {hi}) but no episode")
        return
    ends = ep_start + ep_len
    if (
        int(ep_start[0]) != lo
        or int(ends[-1]) != hi
        or bool(np.any(ep_len < 1))
        or bool(np.any(ep_start[1:] != ends[:-1]))
    ):
        raise ValueError(
            f"state's episode index does not tile the stored steps [{lo}, {hi}): episodes must be contiguous, "
            "in order, at least one step each"
        )
