"""A replay shard that lives on one torch device: GEAR's sampling where the data lives.

:class:`DeviceReplay` keeps every field of ``capacity`` steps in a ring of tensors on ``device`` (a
GPU, or the CPU), the priorities of the windows that start at each step in a
:class:`~reactor.replay.sumtree.SumTree` (torch backend) on the same device, and each step's global
step number and episode id beside them. A learner on that device then inserts, samples windows by
priority, gathers them and writes back priorities with no host round trip and no host sync per
call: every step of it is a kernel launch on the device's stream, and the host runs ahead.

- **Inserts** take host tensors (an actor's batch) through pinned staging buffers with one
  asynchronous copy per field, or device tensors as they are. New windows get the largest priority
  seen so far (PER's rule), kept as a device tensor.
- **Samples** draw ``n`` window starts by stratified prioritized sampling and gather ``[n, T, ...]``
  windows: positions past the episode's end or not yet written are masked (``mask``, a prefix) and
  zeroed. Importance weights ``(N p)^-beta``, normalised by the largest possible.
- **Priority updates** for sampled keys (global step numbers) skip keys whose step has been
  overwritten since (the ring moved on). A priority that is not finite or is negative is not written
  (the window keeps its old priority) and is reported: the next :meth:`check` (every
  ``check_every`` updates, one host sync then) raises ``ValueError`` saying how many were refused.

Without syncs, errors surface late by design: :meth:`check` is where the host learns of them, and
``torch.cuda.synchronize`` is the caller's only other sync point. It is a building block for a
learner colocated with its shard in one process; the runtime's ``Replay`` node keeps its table on
the host (``Replay(memory="cuda")`` stores and gathers on the GPU, and samples with the host tree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _devicekernels as _kernels
from .sumtree import DEFAULT_ARITY, SumTree

__all__ = ["DeviceReplay", "DeviceSample"]


class DeviceSample(dict):
    """One sample: the fields ``[n, T, ...]``, ``mask`` bool ``[n, T]``, ``weights`` float32 ``[n]``
    (importance weights) and ``keys`` int64 ``[n]`` (the windows' first global steps, for
    :meth:`DeviceReplay.update_priorities`); every tensor on the replay's device."""


class DeviceReplay:
    """Prioritized sequence replay resident on one device (module docstring).

    Args:
        specs: ``[(name, shape, dtype)]`` of one step.
        capacity: steps kept (a ring: the oldest is overwritten).
        window: ``T``, steps per sampled window.
        device: where everything lives (``"cuda"``, ``"cuda:N"``, ``"cpu"``).
        alpha: priority exponent (0: uniform).
        beta: importance-weight exponent.
        arity: the sum tree's fan-in.
        staging_rows: rows of each pinned staging buffer for host inserts (CUDA only); larger host
            batches are split.
        check_every: priority updates between checks of refused priorities (each check syncs once).
        kernels: ``"triton"`` (one launch for the tree's descent, one per field's gather:
            :mod:`reactor.replay._devicekernels`), ``"torch"`` (plain torch ops), or ``"auto"``: Triton
            where it runs (a GPU with Triton installed), else torch.

    Raises:
        ValueError: empty or duplicate specs, capacity < window, window < 1, or a bad device.
    """

    def __init__(self, specs: Sequence[tuple[str, Sequence[int], torch.dtype]], capacity: int, window: int, *,
                 device: str | torch.device = "cpu", alpha: float = 0.6, beta: float = 0.4,
                 arity: int = DEFAULT_ARITY, staging_rows: int = 4096, check_every: int = 64,
                 kernels: str = "auto") -> None:
        names = [s[0] for s in specs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"DeviceReplay specs must name distinct fields, got {names!r}")
        for what, v in (("capacity", capacity), ("window", window), ("staging_rows", staging_rows),
                        ("check_every", check_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DeviceReplay {what} must be an int >= 1, got {v!r}")
        if capacity < window:
            raise ValueError(f"DeviceReplay capacity ({capacity}) must hold at least one window ({window})")
        if not (alpha >= 0 and beta >= 0):
            raise ValueError(f"DeviceReplay alpha and beta must be >= 0, got {alpha!r} and {beta!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"DeviceReplay device {str(self.device)!r} needs CUDA, and torch.cuda.is_available() "
                             f"is False here; use device='cpu'")
        self.capacity, self.window, self.alpha, self.beta = capacity, window, float(alpha), float(beta)
        dev = self.device
        # One row more than capacity: row `capacity` stays zero, what a masked window position reads.
        self._rows = {name: torch.zeros((capacity + 1, *shape), dtype=dtype, device=dev) for name, shape, dtype in specs}
        self.fields = {name: t[:capacity] for name, t in self._rows.items()}
        self._step_of = torch.full((capacity,), -1, dtype=torch.int64, device=dev)  # global step held per row
        self._episode_of = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
        self._tree = SumTree(capacity, arity, backend="torch", device=dev)
        if kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"DeviceReplay kernels must be 'auto', 'triton' or 'torch', got {kernels!r}")
        pow2 = arity & (arity - 1) == 0  # the kernels load a node's children as one power-of-two block
        if kernels == "triton" and not (_kernels.available(dev) and pow2):
            raise ValueError(f"DeviceReplay kernels='triton' needs Triton, a GPU (device {str(dev)!r}; triton "
                             f"{'not installed' if _kernels.triton is None else 'installed'}) and a power-of-two "
                             f"arity (got {arity})")
        self.kernels = "triton" if kernels == "triton" or (kernels == "auto" and pow2 and _kernels.available(dev)) \
            else "torch"
        sums, offsets, self._arity, self._depth, live = self._tree.device_layout()
        self._level_offsets = torch.tensor(offsets, dtype=torch.int64, device=dev)
        self._level_live = torch.tensor(live, dtype=torch.int64, device=dev)
        self._max_priority = torch.ones((), dtype=torch.float64, device=dev)  # already raised to alpha
        self._offsets = torch.arange(window, device=dev)
        self._refused = torch.zeros((), dtype=torch.int64, device=dev)
        self._updates = 0
        self.check_every = check_every
        self.inserted = 0  # steps inserted so far (host count: the ring's head is known without a sync)
        self._staging: list[dict[str, torch.Tensor]] = []
        self._staged: list[Any] = []  # per staging buffer: the event after its copies (reuse waits on it)
        self._next_stage = 0
        self.staging_rows = staging_rows
        if dev.type == "cuda":
            for _ in range(2):  # double-buffered: one fills while the other's copy is in flight
                buf = {name: torch.empty((staging_rows, *shape), dtype=dtype, pin_memory=True) for name, shape, dtype in specs}
                buf[" episode"] = torch.empty(staging_rows, dtype=torch.int64, pin_memory=True)  # (no field's name)
                self._staging.append(buf)
                self._staged.append(None)

    def __len__(self) -> int:
        return min(self.inserted, self.capacity)

    # ---------------------------------------------------------------- inserts

    def insert(self, steps: dict[str, torch.Tensor], episode: torch.Tensor) -> None:
        """Append ``n`` consecutive steps (every field ``[n, ...]``) with their episode ids ``[n]``
        (int64; steps of one episode are consecutive and share its id).

        Raises:
            ValueError: a missing or extra field, or lengths or shapes that differ from the specs.
        """
        if set(steps) != set(self.fields):
            raise ValueError(f"DeviceReplay.insert needs fields {sorted(self.fields)}, got {sorted(steps)}")
        n = int(episode.shape[0]) if episode.ndim == 1 else -1
        for name, t in steps.items():
            want = self.fields[name]
            if t.ndim < 1 or t.shape[0] != n or tuple(t.shape[1:]) != tuple(want.shape[1:]) or t.dtype != want.dtype:
                raise ValueError(f"DeviceReplay.insert: field {name!r} is {tuple(t.shape)} {t.dtype}; expected "
                                 f"[{n}, {', '.join(map(str, want.shape[1:]))}] {want.dtype} (n from episode)")
        if n <= 0:
            return
        if self.device.type == "cuda" and episode.device.type == "cpu":
            for lo in range(0, n, self.staging_rows):
                hi = min(n, lo + self.staging_rows)
                part = self._stage({k: v[lo:hi] for k, v in steps.items()}, episode[lo:hi])
                self._write(*part)
            return
        self._write({k: v.to(self.device) for k, v in steps.items()}, episode.to(self.device))

    def _stage(self, steps: dict[str, torch.Tensor], episode: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                                       torch.Tensor]:
        """Host rows -> a pinned staging buffer -> one asynchronous copy per field."""
        i = self._next_stage
        self._next_stage = 1 - i
        if self._staged[i] is not None:
            self._staged[i].synchronize()  # its previous copy has left the buffer
        buf, n = self._staging[i], int(episode.shape[0])
        out = {}
        for name, t in steps.items():
            buf[name][:n].copy_(t)
            out[name] = buf[name][:n].to(self.device, non_blocking=True)
        buf[" episode"][:n].copy_(episode)
        ep = buf[" episode"][:n].to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the stream the copies went on, on any GPU index
        self._staged[i] = event
        return out, ep

    def _write(self, steps: dict[str, torch.Tensor], episode: torch.Tensor) -> None:
        n = int(episode.shape[0])
        if n > self.capacity:  # only the last capacity steps survive anyway
            steps = {k: v[-self.capacity:] for k, v in steps.items()}
            episode = episode[-self.capacity:]
            self.inserted += n - self.capacity
            n = self.capacity
        g = self.inserted + torch.arange(n, device=self.device)
        rows = g % self.capacity
        for name, t in steps.items():
            self.fields[name].index_copy_(0, rows, t)
        self._step_of.index_copy_(0, rows, g)
        self._episode_of.index_copy_(0, rows, episode.to(torch.int64))
        self._tree.write_async(rows, self._max_priority.expand(n))
        self.inserted += n

    # ---------------------------------------------------------------- sampling

    def sample(self, n: int, generator: torch.Generator | None = None) -> DeviceSample:
        """``n`` windows drawn by priority and gathered on the device (no host sync).

        Raises:
            ValueError: ``n`` < 1, or nothing inserted yet.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"DeviceReplay.sample: n must be an int >= 1, got {n!r}")
        if self.inserted == 0:
            raise ValueError("DeviceReplay.sample: nothing inserted yet")
        if self.kernels == "triton":
            sums = self._tree.device_layout()[0]
            rand = torch.rand(n, dtype=torch.float64, device=self.device, generator=generator)
            rows, keys, weights = _kernels.descend(sums, self._level_offsets, self._level_live, self._tree.min_tensor(),
                                                   rand, self._step_of, self._arity, self._depth, self.beta)
            out = DeviceSample(_kernels.gather(self.fields, rows, keys, self._step_of, self._episode_of, self.window))
            out["weights"], out["keys"] = weights, keys
            return out
        rows, prob = self._tree.sample_async(n, generator)
        keys = self._step_of[rows]
        idx = (rows[:, None] + self._offsets) % self.capacity  # [n, T]
        mask = (self._step_of[idx] == keys[:, None] + self._offsets) & (
            self._episode_of[idx] == self._episode_of[rows][:, None])
        idx = torch.where(mask, idx, self.capacity)  # masked positions read the zero row: one gather
        out = DeviceSample()
        for name, f in self._rows.items():
            out[name] = f[idx]
        # w_i = (N p_i)^-beta / max_j (N p_j)^-beta; the max is at the smallest priority.
        min_prob = self._tree.min_tensor() / self._tree.total_tensor().clamp_min(1e-300)
        out["weights"] = ((prob / min_prob.clamp_min(1e-300)) ** -self.beta).to(torch.float32)
        out["mask"], out["keys"] = mask, keys
        return out

    def sampler(self, n: int, graphed: bool = True) -> Callable[[], DeviceSample]:
        """A function drawing ``n`` windows per call with the device's default generator.

        On CUDA with ``graphed`` (default), the whole sample (the tree's descent, the gathers, the
        weights: about 40 kernels) is captured once as a CUDA graph and each call replays it, one
        launch. Its tensors are the graph's fixed outputs: the next call overwrites them, so clone what
        must outlive it. Inserts and priority updates write the same tensors in place, so the graph
        always samples the current contents.

        Raises:
            ValueError: as :meth:`sample` (checked once, here).
        """
        if not graphed or self.device.type != "cuda":
            return lambda: self.sample(n)
        self.sample(n)  # the checks, once
        graph, out = self._capture(lambda: self.sample(n))

        def replay() -> DeviceSample:
            graph.replay()
            return out

        return replay

    def updater(self, n: int, graphed: bool = True) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """:meth:`update_priorities` for batches of ``n`` keys, on CUDA (``graphed``) as one CUDA graph
        replay (the tree's ancestors, level by level, are ~50 small kernels): the keys and priorities
        are copied into the graph's input buffers, then it replays."""
        if not graphed or self.device.type != "cuda":
            return self.update_priorities
        keys_in = torch.zeros(n, dtype=torch.int64, device=self.device)
        prio_in = torch.ones(n, dtype=torch.float64, device=self.device)
        keys_in.fill_(-2)  # warm-up keys no row holds (unwritten rows hold -1): nothing changes
        graph, _ = self._capture(lambda: self._update_device(keys_in, prio_in))

        def update(keys: torch.Tensor, priorities: torch.Tensor) -> None:
            keys_in.copy_(keys, non_blocking=True)
            prio_in.copy_(priorities, non_blocking=True)
            graph.replay()
            self._count_update()

        return update

    def _capture(self, work: Callable[[], Any]) -> tuple[Any, Any]:
        """``work`` warmed up three times on a side stream (allocator, lazy inits), then captured as a
        CUDA graph, all on this replay's GPU whichever is current: ``(graph, work's result)``."""
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(3):
                    work()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = work()
        return graph, out

    def update_priorities(self, keys: torch.Tensor, priorities: torch.Tensor) -> None:
        """New priorities (before ``alpha``) for sampled ``keys``; keys whose step was overwritten
        since are skipped, refused values counted for :meth:`check` (module docstring)."""
        self._update_device(keys, priorities)
        self._count_update()

    def _count_update(self) -> None:
        self._updates += 1
        if self._updates % self.check_every == 0:
            self.check()

    def _update_device(self, keys: torch.Tensor, priorities: torch.Tensor) -> None:
        """The device work of a priority update, in place only (CUDA-graph capturable)."""
        keys = keys.to(self.device)
        p = priorities.to(self.device, torch.float64)
        rows = keys % self.capacity
        ok = torch.isfinite(p) & (p >= 0)
        self._refused += (~ok).sum()
        raised = torch.where(ok, p, torch.zeros_like(p)) ** self.alpha
        leaves = self._tree.leaves_async(rows)
        live = self._step_of[rows] == keys
        new = torch.where(ok & live, raised, leaves)
        self._tree.write_async(rows, new)
        self._max_priority.copy_(torch.maximum(self._max_priority, torch.where(ok & live, raised, 0.0).max()))

    def check(self) -> None:
        """Raise ``ValueError`` if priorities were refused since the last check (one host sync)."""
        refused = int(self._refused)
        if refused:
            self._refused.zero_()
            raise ValueError(f"DeviceReplay: {refused} priorities were not finite or were negative in the last "
                             f"updates; those windows kept their earlier priorities")
