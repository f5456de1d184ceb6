"""Where a learner computes, and how it calls its ``learn`` fragment: eager or compiled.

``device`` names where the learner's networks, optimizers and batches live (``"cpu"``, ``"cuda"``,
``"cuda:N"``); the actors and the evaluator act on the CPU with CPU copies of the weights the learner
broadcasts (``Learner._weights`` copies them to the host), the common case for small policies.

``compile`` chooses between the algorithm's ``learn`` as written and ``torch.compile`` of it:

- ``"off"``: eager, always.
- ``"on"``: ``torch.compile(learn)`` (inductor, default mode), no measurement.
- ``"auto"`` (default): on a CUDA device, :class:`LearnStep` measures eager against compiled (default
  mode, and ``"reduce-overhead"``: CUDA graphs for the fixed-shape parts) on the run's own batches and
  keeps the fastest; the candidates run on a copy of the learner's state, so a compiler error or a
  slow candidate never touches the training. On the CPU ``"auto"`` stays eager without measuring:
  inductor's C++ compile of these small networks costs tens of seconds, more than the CPU apps train
  (docs/benchmarks.md: DQN's update compiled on the CPU took 19 s to compile and ran no faster). With
  data-parallel learners ``"auto"`` is eager too: a trial update on a copy would still all-reduce.

The same algorithm code runs under every choice. A compiled update computes the same function with
other kernels, so its floats are not bit-identical to eager's: runs that must match bit for bit across
placements use ``compile="off"`` or a CPU device (where ``"auto"`` is eager).
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["COMPILE_MODES", "LearnStep", "check_compile", "check_device", "check_memory", "cuda_refusal",
           "resolve_device", "takes_device"]

log = logging.getLogger("reactor.learner")

COMPILE_MODES = ("auto", "on", "off")
#: Updates each candidate runs before its timed updates (the compiled ones compile in the first).
TRIAL_WARMUP = 3
#: Timed updates per candidate.
TRIAL_UPDATES = 20


def check_device(device: Any, who: str = "device") -> str:
    """``device`` if it is ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        ValueError: anything else, naming ``who`` and the value.
    """
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"{who} must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return device


def check_compile(mode: Any, who: str = "compile") -> str:
    """``mode`` if it is one of :data:`COMPILE_MODES`.

    Raises:
        ValueError: anything else, naming ``who`` and the value.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"{who} must be one of {', '.join(repr(m) for m in COMPILE_MODES)}, got {mode!r}")
    return mode


def resolve_device(device: str, who: str, replica: int = 0) -> torch.device:
    """The torch device of ``device`` in this process: ``"cuda"`` (no index) puts replica ``i`` of a
    data-parallel bank on GPU ``i mod count``.

    Raises:
        ValueError: a CUDA device where CUDA is not available, or an index this host lacks (a setting
            this host cannot honour: ``reactor run`` prints it as one line).
    """
    check_device(device, f"{who} device")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"{who}: device={device!r} needs CUDA, and torch.cuda.is_available() is False on this "
                         f"host; use device='cpu'")
    count = torch.cuda.device_count()
    if device == "cuda":
        return torch.device("cuda", replica % count)
    index = int(device.split(":")[1])
    if index >= count:
        raise ValueError(f"{who}: device={device!r} names a GPU this host does not have ({count} visible)")
    return torch.device("cuda", index)


def check_memory(memory: str, who: str) -> None:
    """A replay shard's ``memory`` other than ``"host"`` (``"pinned"``, ``"cuda"``, ``"cuda:N"``) where this
    host can give it.

    Raises:
        ValueError: CUDA is not available, or the index names a GPU this host lacks (one line, naming ``who``).
    """
    if memory != "host" and not torch.cuda.is_available():
        raise ValueError(f"{who}: memory={memory!r} needs CUDA, and torch.cuda.is_available() is False on this host; "
                         f"use memory='host' (the apps' --set replay_memory=host, or leave it out)")
    if memory.startswith("cuda:") and int(memory.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(f"{who}: memory={memory!r} names a GPU this host does not have "
                         f"({torch.cuda.device_count()} visible)")


def cuda_refusal(graph: Any) -> tuple[str, str] | None:
    """For a run whose processes are all on this host, before it starts: the first learner ``device`` or
    replay ``memory`` that this host cannot give (what the node's startup would refuse, once the run's
    workers had started and its run directory was made), as (the refusal's line, the value); None when
    every one can be given."""
    from .learner import Learner, RolloutLearner
    from .offline import OfflineLearner
    from .replay import Replay

    for name, node in graph.nodes.items():
        p = node.prototype
        learner = isinstance(p, (Learner, RolloutLearner, OfflineLearner))
        if not learner and not isinstance(p, Replay):
            continue
        value = p.device if learner else p.memory
        try:
            if learner:
                resolve_device(value, name)
            else:
                check_memory(value, f"Replay {name!r}")
        except ValueError as e:
            return str(e), value
    return None


def takes_device(init: Callable[..., Any]) -> bool:
    """Whether an algorithm's ``init`` accepts ``device=`` (the fragment contract's optional argument)."""
    try:
        params = inspect.signature(init).parameters
    except (TypeError, ValueError):
        return False
    return "device" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LearnStep:
    """``learn(state, batch)`` as the learner calls it: eager, compiled, or (``"auto"`` on CUDA) the
    faster of the two as measured on the first batches.

    Args:
        learn: the algorithm's ``learn`` fragment.
        mode: ``"auto"``, ``"on"`` or ``"off"`` (module docstring).
        device: the learner's device.
        who: the learner's name, for the log.
        candidates: ``{name: fn}`` to measure against eager under ``"auto"`` instead of the two compiled
            versions, on any device (tests).
        replicas: the data-parallel bank's size; above 1, ``"auto"`` is eager (no trial).

    Attributes:
        choice: ``"eager"``, ``"compiled"``, ``"compiled-cudagraphs"``, or ``"measuring"`` while the
            auto trial runs.
        timings: seconds per update each candidate took in the trial (``{}`` without one).
    """

    def __init__(self, learn: Callable[..., Any], mode: str, device: torch.device, who: str,
                 candidates: dict[str, Callable[..., Any]] | None = None, replicas: int = 1) -> None:
        check_compile(mode)
        self._learn = learn
        self._device = device
        self._who = who
        self.timings: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        # Data-parallel replicas: a candidate's update on a copy of the state would still all-reduce
        # (the optimizers' steps are the bank's collectives), and each replica's trial could choose
        # differently: "auto" is eager there, "on" compiles every replica alike.
        if mode == "off" or (mode == "auto" and (replicas > 1 or (device.type != "cuda" and candidates is None))):
            self.choice, self._fn = "eager", learn
        elif mode == "on":
            self.choice, self._fn = "compiled", torch.compile(learn)
        else:
            self.choice, self._fn = "measuring", learn
            # (candidates: other versions of learn to measure against eager, on any device: the tests')
            self._candidates: dict[str, Callable[..., Any]] = dict(candidates) if candidates is not None else {
                "compiled": torch.compile(learn), "compiled-cudagraphs": torch.compile(learn, mode="reduce-overhead")}
            self._copies: dict[str, Any] = {}  # candidate -> the copy of the state it learns on
            self._seconds: dict[str, float] = {"eager": 0.0}  # timed seconds, past the warm-up
            self._runs = 0  # trial updates so far (every candidate runs once per real update)

    def __call__(self, state: Any, batch: dict[str, torch.Tensor]) -> Any:
        if self.choice != "measuring":
            return self._fn(state, batch)
        return self._measure(state, batch)

    def _measure(self, state: Any, batch: dict[str, torch.Tensor]) -> Any:
        """One real (eager) update, timed, and one update of each candidate on its own copy of the
        state; after ``TRIAL_WARMUP + TRIAL_UPDATES`` the fastest is kept."""
        timed = self._runs >= TRIAL_WARMUP
        out = self._timed("eager", self._learn, state, batch, timed)
        for name, fn in list(self._candidates.items()):
            try:
                if name not in self._copies:  # (a state that cannot be copied, or no memory for a copy: no trial)
                    self._copies[name] = copy.deepcopy(state)
                self._timed(name, fn, self._copies[name], {k: v.clone() for k, v in batch.items()}, timed)
            except Exception as e:  # a compiler error: this candidate is out, the training never saw it
                self.errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("%s: compile candidate %s failed (%s); not used", self._who, name, self.errors[name])
                del self._candidates[name]
                self._copies.pop(name, None)
                self._seconds.pop(name, None)
        self._runs += 1
        if self._runs >= TRIAL_WARMUP + TRIAL_UPDATES:
            self._decide()
        return out

    def _timed(self, name: str, fn: Callable[..., Any], state: Any, batch: dict[str, torch.Tensor],
               timed: bool) -> Any:
        _sync(self._device)
        t0 = time.perf_counter()
        out = fn(state, batch)
        _sync(self._device)
        if timed:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - t0
        return out

    def _decide(self) -> None:
        self.timings = {name: seconds / TRIAL_UPDATES for name, seconds in self._seconds.items()}
        best = min(self.timings, key=self.timings.__getitem__)
        self.choice = best
        self._fn = self._learn if best == "eager" else self._candidates[best]
        # The copies and the losers go (a CUDA-graph candidate holds its graphs' memory pool). The winner
        # was compiled against a copy of the state: its first call on the real one compiles again.
        self._copies.clear()
        self._candidates = {}
        log.warning("%s: compile='auto' on %s chose %s (ms per update: %s)%s", self._who, self._device, best,
                    ", ".join(f"{k} {v * 1e3:.3f}" for k, v in self.timings.items()),
                    "" if best == "eager" else "; its first update on the learner's own state compiles again")
