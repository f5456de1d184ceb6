"""A Table's state and checkpoints: :class:`TableState` gives ``Table`` its ``config``,
``state_dict`` / ``load_state_dict`` (checked before anything changes), ``save`` (also in the
background) and ``load`` / ``restore`` from checkpoint directories (``reactor.replay.checkpoint``'s
atomic, checksummed format)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import inspect
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import checkpoint as _ckpt
from .rate_limiters import limiter_from_config
from .reads import _READS
from .storage import FieldSpec, Storage

if TYPE_CHECKING:
    from .selectors import Selector
    from .table import Table

#: What an ``OSError`` reading a checkpoint says of the checkpoint itself: a file of it missing, or one of
#: another kind (a directory, a link loop) where a file belongs.
_DAMAGED = frozenset({errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ELOOP})


def _selector_config(sel: Any) -> dict[str, Any]:
    args = {}
    for p in inspect.signature(type(sel).__init__).parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if hasattr(sel, p.name):
            v = getattr(sel, p.name)
            if v is None or isinstance(v, (bool, int, float, str)):
                args[p.name] = v
    return {"type": type(sel).__name__, "args": args}


def _selector_from_config(cfg: Mapping[str, Any]) -> Selector:
    from . import selectors

    cls = getattr(selectors, str(cfg["type"]), None)
    if not (isinstance(cls, type) and issubclass(cls, selectors.Selector)):
        raise ValueError(f"checkpoint names an unknown selector {cfg['type']!r}")
    return cls(**cfg["args"])


def _split_state(prefix: str, state: Mapping[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Move numpy arrays of a selector state into ``arrays``; return the JSON-able rest."""
    scalars: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, np.ndarray):
            arrays[f"{prefix}.{k}"] = v
        elif isinstance(v, (np.integer, np.floating, np.bool_)):
            scalars[k] = v.item()
        elif v is None or isinstance(v, (bool, int, float, str)):
            scalars[k] = v
        else:
            raise TypeError(f"{prefix} state entry {k!r} has unsupported type {type(v).__name__}")
    return scalars


def _join_state(prefix: str, scalars: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    out = dict(scalars)
    for k, v in arrays.items():
        if k.startswith(prefix + "."):
            out[k[len(prefix) + 1 :]] = v
    return out


def _tensor_to_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"checkpoint names an unknown torch dtype {name!r}")
    return dt


class _NotThisTable(ValueError):
    """A verified checkpoint's state (at ``path``) that does not fit the table it was read into."""

    def __init__(self, path: Path, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.path = path
        self.cause = cause


def _check_format(path: Path, manifest: Mapping[str, Any]) -> None:
    """A foreign checkpoint is refused as a damaged one is (a restore passes over it to an older one)."""
    if manifest.get("format") != "reactor.replay.Table/1":
        raise _ckpt.CheckpointCorruptError(f"{str(path)!r} holds no reactor.replay.Table checkpoint")


def _inconsistent(path: Path, e: BaseException) -> _ckpt.CheckpointCorruptError:
    return _ckpt.CheckpointCorruptError(
        f"checkpoint {str(path)!r}: its content is inconsistent ({type(e).__name__}: {e}); the checkpoint is refused")


def _shape_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """What of a table's configuration its checkpoint's state depends on: fields, capacity,
    selectors and the item bounds (not its name, seed, limiter or read)."""
    return {
        "specs": [(str(s["name"]), [int(d) for d in s["shape"]], str(s["dtype"])) for s in config["specs"]],
        "capacity": int(config["capacity"]),
        "sampler": config["sampler"],
        "remover": config["remover"],
        "max_size": int(config["max_size"]),
        "max_times_sampled": int(config["max_times_sampled"]),
    }


class TableState:
    """The state and checkpoint half of :class:`~reactor.replay.Table` (its base class)."""

    def config(self) -> dict[str, Any]:
        """JSON-able description of the table's construction (what :meth:`load` rebuilds from)."""
        st = self._storage
        return {
            "name": self._name,
            "capacity": st.capacity,
            "specs": [{"name": s.name, "shape": list(s.shape), "dtype": str(s.dtype)} for s in st.specs],
            "sampler": _selector_config(self._sampler),
            "remover": _selector_config(self._remover),
            "rate_limiter": self._limiter.config(),
            "max_size": self._max_size,
            "max_times_sampled": self._max_times_sampled,
            "read": {"type": type(self._read).__name__, **asdict(self._read)},
            "beta": self._beta,
            "seed": self._seed,
        }

    def state_dict(self, *, _buffers: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """Everything needed to continue exactly: storage, items, selectors, limiter, generator.

        The storage part is a copy, so the result stays valid while the table moves on.
        """
        with self._lock:
            live = np.flatnonzero(self._keys >= 0)
            order = np.argsort(self._keys[live], kind="stable")
            live = live[order]
            return {
                "config": self.config(),
                "storage": self._storage.state_dict(_buffers),
                "keys": self._keys[live].copy(),
                "times_sampled": self._times[live].copy(),
                "counts": dict(self._counts),
                "sampler": self._sampler.state_dict(),
                "remover": self._remover.state_dict(),
                "rate_limiter": self._limiter.state_dict(),
                "rng": self._rng.bit_generator.state,
            }

    def _check_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError unless ``state`` is one this table could have reached: the items are
        distinct stored steps in key order, the counters add up to the item count, and every
        selector holds exactly the items' slots (checked on scratch selectors). Changes nothing."""
        st = state["storage"]
        lo, hi = int(st["first_step"]), int(st["next_step"])
        keys, times = np.asarray(state["keys"]), np.asarray(state["times_sampled"])
        if keys.ndim != 1 or keys.dtype.kind not in "iu" or times.shape != keys.shape or times.dtype.kind not in "iu":
            raise ValueError(f"state keys and times_sampled must be integer arrays of one length, got "
                             f"{keys.dtype} {keys.shape} and {times.dtype} {times.shape}")
        keys = keys.astype(np.int64)
        if len(keys) and (keys[0] < lo or keys[-1] >= hi or bool(np.any(np.diff(keys) <= 0))):
            raise ValueError(f"state keys must be distinct stored steps in [{lo}, {hi}), in increasing order")
        if len(keys) > self._max_size:
            raise ValueError(f"state holds {len(keys)} items, more than max_size {self._max_size}")
        if len(times) and (int(times.min()) < 0 or (self._max_times_sampled and int(times.max()) >= self._max_times_sampled)):
            raise ValueError(f"state times_sampled must be in [0, max_times_sampled={self._max_times_sampled}) "
                             "(0: unbounded)")
        counts = state["counts"]
        if set(counts) != set(self._counts) or any(
            isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0 for v in counts.values()
        ):
            raise ValueError(f"state counts must be ints >= 0 for {sorted(self._counts)}, got {dict(counts)!r}")
        gone = sum(int(counts[k]) for k in ("evicted", "removed", "expired", "deleted"))
        if int(counts["inserted"]) - gone != len(keys):
            raise ValueError(f"state counts say {int(counts['inserted'])} inserted and {gone} gone, but it holds "
                             f"{len(keys)} items")
        slots = np.sort(keys % self._storage.capacity)
        for what, sel, fed in (("sampler", self._sampler, True), ("remover", self._remover, self._feed_remover)):
            scratch = _selector_from_config(_selector_config(sel))
            scratch.bind(self._storage.capacity)
            scratch.load_state_dict(dict(state[what]))
            want = slots if fed else slots[:0]
            if not np.array_equal(scratch.present_slots(), want):
                raise ValueError(f"state's {what} holds {len(scratch)} items, not exactly the table's {len(want)}")
        limiter = limiter_from_config(self._limiter.config())
        limiter.load_state_dict(dict(state["rate_limiter"]), warn=False)
        np.random.Generator(np.random.PCG64()).bit_generator.state = state["rng"]

    def load_state_dict(self, state: Mapping[str, Any], *, _rows_in_place: bool = False) -> None:
        """Restore :meth:`state_dict` output into a table built with the same configuration.

        The state is checked before anything changes (its episode index, items, counters and
        selectors must agree: see ``_check_state``), so a state no table could have reached is
        refused and the table stays as it was. (``_rows_in_place``: the storage's rows are written
        already, ``Storage.load_state_dict``'s.)

        Raises:
            ValueError: the state does not fit (storage fields or capacity) or is inconsistent.
        """
        with self._lock:
            try:
                self._check_state(state)
            except (KeyError, TypeError) as e:
                raise ValueError(f"table {self._name!r}: malformed state ({type(e).__name__}: {e})") from e
            self._storage.load_state_dict(state["storage"], _rows_in_place=_rows_in_place)
            cap = self._storage.capacity
            keys = np.asarray(state["keys"], dtype=np.int64)
            self._keys.fill(-1)
            self._times.fill(0)
            self._keys[keys % cap] = keys
            self._times[keys % cap] = np.asarray(state["times_sampled"], dtype=np.int64)
            self._size = len(keys)
            self._counts = {k: int(v) for k, v in state["counts"].items()}
            self._sampler.load_state_dict(dict(state["sampler"]))
            self._remover.load_state_dict(dict(state["remover"]))
            self._rng.bit_generator.state = state["rng"]
            self._limiter.load_state_dict(dict(state["rate_limiter"]))
            self._generation += 1

    @staticmethod
    def _pack(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        arrays: dict[str, np.ndarray] = {}
        st = dict(state["storage"])
        for name, t in st.pop("fields").items():
            arrays[f"field.{name}"] = _tensor_to_bytes(t)
        arrays["storage.ep_start"] = st.pop("ep_start")
        arrays["storage.ep_len"] = st.pop("ep_len")
        arrays["table.keys"] = state["keys"]
        arrays["table.times_sampled"] = state["times_sampled"]
        manifest = {
            "format": "reactor.replay.Table/1",
            "config": state["config"],
            "storage": st,
            "counts": state["counts"],
            "sampler": _split_state("sampler", state["sampler"], arrays),
            "remover": _split_state("remover", state["remover"], arrays),
            "rate_limiter": state["rate_limiter"],
            "rng": state["rng"],
        }
        return manifest, arrays

    def save(self, directory: str | os.PathLike[str], *, keep: int = 3) -> Path:
        """Checkpoint the table into ``directory`` atomically; keep the latest ``keep`` checkpoints.

        How it avoids stopping the world: snapshot buffers are allocated and paged in first, without
        the lock (:meth:`Storage.snapshot_buffers`); the lock is then held only while the live steps,
        the index and the selector states are copied into them (a memory copy, ~0.2 s per GB here);
        writing the files, fsync and renames happen after the lock is released, so other threads keep
        inserting and sampling during the write. See :mod:`reactor.replay.checkpoint` for the
        atomicity protocol. ``save`` itself returns when the checkpoint is complete; use
        :meth:`save_in_background` to return right after the snapshot.

        Returns:
            The new checkpoint directory.
        """
        buffers = self._storage.snapshot_buffers()
        return self._write(self.state_dict(_buffers=buffers), directory, keep)

    def save_in_background(
        self, directory: str | os.PathLike[str], *, keep: int = 3, cancel: threading.Event | None = None
    ) -> concurrent.futures.Future[Path]:
        """Snapshot now (short, under the lock), write in a background thread.

        Args:
            cancel: setting it stops the write within one chunk (16 MiB); the future then raises
                :class:`~reactor.replay.checkpoint.CheckpointCancelled` and nothing is published.

        Returns:
            A future resolving to the checkpoint directory (or raising the write's error).
        """
        state = self.state_dict(_buffers=self._storage.snapshot_buffers())
        fut: concurrent.futures.Future[Path] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(self._write(state, directory, keep, cancel))
            except BaseException as e:  # delivered to the owner through the future
                fut.set_exception(e)

        threading.Thread(target=run, name=f"save-{self._name}", daemon=True).start()
        return fut

    def _write(
        self, state: Mapping[str, Any], directory: str | os.PathLike[str], keep: int,
        cancel: threading.Event | None = None,
    ) -> Path:
        manifest, arrays = self._pack(state)
        return _ckpt.write_checkpoint(directory, manifest, arrays, keep=keep, cancel=cancel)

    @classmethod
    def load(cls, directory: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> Table:
        """Rebuild a table from its newest complete checkpoint under ``directory`` (or a ``ckpt-N`` dir).

        The restored table continues the identical sample sequence: same items, priorities, times
        sampled, selector state and generator state. Its rows are read straight into its storage
        (host memory; a CUDA table's go through one host copy): a load holds the table once, not twice.

        Everything is verified before the table is returned: every file's checksum
        (:func:`~reactor.replay.checkpoint.read_checkpoint`), then the arrays' shapes and the state's
        invariants (:meth:`load_state_dict`). It returns the saved state or raises; never a
        different state.

        Raises:
            FileNotFoundError: no complete checkpoint.
            CheckpointCorruptError: a checksum mismatch, a missing, truncated or foreign file, content
                that is inconsistent, or a checkpoint that is not a table's (the message names the
                checkpoint directory and what).
        """
        def build(path: Path, manifest: dict[str, Any]) -> Table:
            _check_format(path, manifest)
            try:
                return cls._from_config(manifest["config"], device)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise _inconsistent(path, e) from e

        try:
            return cls._read_checkpoint(directory, build)[0]
        except _NotThisTable as e:  # (a table of its own configuration: the content is at fault)
            raise _inconsistent(e.path, e.cause) from e.cause

    def restore_from(self, root: str | os.PathLike[str]) -> tuple[Path | None, list[str]]:
        """Fill this empty table from the newest complete checkpoint under ``root`` that verifies,
        falling back to older ones, as :meth:`restore` does; the rows are read straight into this
        table's storage (where it is in host memory, shared memory included), so a restore holds the
        table once, not two or three times.

        A checkpoint of another configuration (fields, capacity, selectors, ``max_size`` or
        ``max_times_sampled``) that this table cannot take is not the checkpoint's fault: it raises,
        naming what differs, and is not passed over.

        Returns:
            ``(its checkpoint directory, refusals)``; ``(None, refusals)`` when none verifies (the
            table stays empty).

        Raises:
            ValueError: the table is not empty, or a checkpoint's state does not fit it.
            MemoryError, OSError: as :meth:`restore`.
        """
        lo, hi = self._storage.step_range
        if len(self) or lo != hi:
            raise ValueError(f"table {self._name!r}: restore_from fills an empty table; this one holds {hi - lo} steps")
        mine = _shape_of(self.config())
        same: dict[Path, bool] = {}  # checkpoint -> its configuration is this table's

        def onto(path: Path, manifest: dict[str, Any]) -> Table:
            _check_format(path, manifest)
            try:
                theirs = _shape_of(manifest["config"])
            except (KeyError, TypeError, ValueError) as e:
                raise _inconsistent(path, e) from e
            if theirs["specs"] != mine["specs"]:
                raise ValueError(f"checkpoint {str(path)!r} holds fields {theirs['specs']}, this table "
                                 f"{mine['specs']}")
            same[path] = theirs == mine
            return self

        def attempt(path: Path) -> Path:
            try:
                return self._read_checkpoint(path, onto)[1]
            except _NotThisTable as e:
                if same.get(e.path):  # (same configuration: the checkpoint's content is at fault)
                    raise _inconsistent(e.path, e.cause) from e.cause
                raise ValueError(f"checkpoint {str(e.path)!r} does not fit this table: {e}") from None

        return self._restore_loop(root, attempt)

    @classmethod
    def restore(
        cls, root: str | os.PathLike[str], *, device: str | torch.device = "cpu"
    ) -> tuple[Table | None, Path | None, list[str]]:
        """Load the newest complete checkpoint under ``root`` that verifies, falling back to older ones.

        A checkpoint that fails verification (:meth:`load`), or lacks a file, is skipped, never
        half-loaded; the caller logs the refusals. Running out of memory is a ``MemoryError``, and
        another ``OSError`` (a file that cannot be read now) is raised: neither is the checkpoint's fault.

        Returns:
            ``(table, its checkpoint directory, refusals)``: ``(None, None, refusals)`` when no
            checkpoint verifies (or there is none), so the caller starts empty.
        """
        tables: list[Table] = []

        def attempt(path: Path) -> Path:
            tables.append(cls.load(path, device=device))
            return path

        path, refusals = cls._restore_loop(root, attempt)
        return (tables[-1] if path is not None else None), path, refusals

    @staticmethod
    def _restore_loop(root: str | os.PathLike[str], attempt: Any) -> tuple[Path | None, list[str]]:
        """``attempt(path)`` for each complete checkpoint under ``root``, newest first, until one
        returns; a refused or damaged one is a refusal (see :meth:`restore`)."""
        refusals = []
        for path in _ckpt.complete_checkpoints(root):
            try:
                return attempt(path), refusals
            except _ckpt.CheckpointCorruptError as e:
                refusals.append(str(e))
            except OSError as e:
                # A file of it missing is a damaged checkpoint; no memory, or a file that cannot be read
                # now, is not: taken for one, the shard started empty and its next saves pruned the good
                # checkpoints (a probe under a memory limit, session 55).
                if e.errno == errno.ENOMEM:
                    raise MemoryError(f"reading {path}: {e}") from e
                if e.errno not in _DAMAGED:
                    raise
                refusals.append(str(e))
        return None, refusals

    @staticmethod
    def _read_checkpoint(directory: str | os.PathLike[str], target: Any) -> tuple[Table, Path]:
        """Read the checkpoint at ``directory`` into ``target(path, manifest)``'s table (empty), its
        rows straight into the storage where that is in host memory.

        Raises:
            CheckpointCorruptError: verification failed.
            _NotThisTable: the verified state does not load into the table (the caller says whose fault).
        """
        got: list[tuple[Table, Path, bool]] = []
        with contextlib.ExitStack() as rewriting:
            def into(path: Path, manifest: dict[str, Any]) -> dict[str, list[memoryview]]:
                table = target(path, manifest)
                try:
                    st = manifest["storage"]
                    lo, hi = int(st["first_step"]), int(st["next_step"])
                except (KeyError, TypeError, ValueError) as e:
                    raise _inconsistent(path, e) from e
                views = table._storage._slot_bytes(lo, hi)
                got.append((table, path, views is not None))
                if views is None:
                    return {}
                rewriting.enter_context(table._storage._rewriting())  # (rows change from here on)
                return {f"field.{name}": v for name, v in views.items()}

            manifest, arrays = _ckpt.read_checkpoint(directory, into)
            table, path, in_place = got[0]
            try:
                table._fill(manifest, arrays, in_place)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise _NotThisTable(path, e) from e
        return table, path

    def _fill(self, manifest: dict[str, Any], arrays: dict[str, np.ndarray], rows_in_place: bool) -> None:
        """Load a verified checkpoint's state (its arrays read; the rows in place, or in ``arrays``)."""
        st = dict(manifest["storage"])
        n = int(st["next_step"]) - int(st["first_step"])
        if not rows_in_place:
            fields = {}
            for s in self._storage.specs:
                raw = arrays[f"field.{s.name}"]
                want = n * int(math.prod(s.shape)) * s.dtype.itemsize
                if raw.dtype != np.uint8 or raw.shape != (want,):
                    raise ValueError(f"array field.{s.name} has {raw.dtype} {raw.shape}, expected uint8 ({want},)")
                # (an empty table's: numpy gives an empty array stride 0, which torch cannot view as another dtype)
                fields[s.name] = torch.from_numpy(raw).view(s.dtype).reshape(n, *s.shape) if n else \
                    torch.empty((0, *s.shape), dtype=s.dtype)
            st["fields"] = fields
        st["ep_start"] = arrays["storage.ep_start"]
        st["ep_len"] = arrays["storage.ep_len"]
        self.load_state_dict(
            {
                "storage": st,
                "keys": arrays["table.keys"],
                "times_sampled": arrays["table.times_sampled"],
                "counts": manifest["counts"],
                "sampler": _join_state("sampler", manifest["sampler"], arrays),
                "remover": _join_state("remover", manifest["remover"], arrays),
                "rate_limiter": manifest["rate_limiter"],
                "rng": manifest["rng"],
            },
            _rows_in_place=rows_in_place,
        )

    @classmethod
    def _from_config(cls, cfg: Mapping[str, Any], device: str | torch.device) -> Table:
        """An empty table of a checkpoint's configuration."""
        specs = [FieldSpec(s["name"], tuple(s["shape"]), _dtype_from_name(s["dtype"])) for s in cfg["specs"]]
        storage = Storage(specs, int(cfg["capacity"]), device=device)
        rd = dict(cfg["read"])
        read_cls = _READS.get(rd.pop("type"))
        if read_cls is None:
            raise ValueError(f"checkpoint names an unknown read kind {cfg['read']!r}")
        if "next_fields" in rd:
            rd["next_fields"] = tuple(rd["next_fields"])
        return cls(
            storage,
            sampler=_selector_from_config(cfg["sampler"]),
            remover=_selector_from_config(cfg["remover"]),
            rate_limiter=limiter_from_config(cfg["rate_limiter"]),
            max_size=int(cfg["max_size"]),
            max_times_sampled=int(cfg["max_times_sampled"]),
            read=read_cls(**rd),
            beta=float(cfg["beta"]),
            seed=int(cfg["seed"]),
            name=str(cfg["name"]),
        )
