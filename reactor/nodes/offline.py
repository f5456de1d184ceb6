"""Offline learning on trajectories another run wrote: GEAR's workload in one reactor.

:class:`OfflineLearner` reads the replay shards' checkpoints of an earlier run (``source/replay-<i>/``,
what every off-policy app writes), puts every stored step with its episode id into a
:class:`~reactor.replay.device.DeviceReplay` on the learner's device, and trains a window algorithm
(``transformer_dqn``: offline double-DQN over sequence windows) on prioritized windows sampled and
gathered there, writing the priorities back; no step crosses to the host once loaded. It broadcasts
weights to an :class:`~reactor.nodes.evaluator.Evaluator` and reports to
:class:`~reactor.nodes.metrics.Metrics` like the online learners, and checkpoints the same way
(``learner.pt``, ``config.json``: ``reactor eval`` plays the result).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from .._reactor import Action, Output, reaction, shutdown, startup
from ._learnerstate import _LearnerBase
from .train_messages import Report, Weights

__all__ = ["OfflineLearner", "load_source_steps"]

log = logging.getLogger("reactor.learner")


def load_source_steps(source: str | Path, fields: tuple[str, ...]) -> tuple[dict[str, Any], np.ndarray, int]:
    """Every step stored in the replay checkpoints under ``source`` (``replay-<i>/``, the latest
    verified checkpoint of each shard), the shards one after another.

    Returns:
        ``(steps {field: tensor[N, ...]}, episode ids int64[N] (distinct across shards), shards read)``.

    Raises:
        FileNotFoundError: no such directory, or no shard checkpoint in it (naming what was looked for).
        ValueError: a checkpoint without one of ``fields`` (naming the fields it has), or a shard whose
            every checkpoint is refused (damaged: naming the shard and why), whose steps would be left out.
    """
    import torch

    from ..replay import Table

    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"offline source {str(source)!r} is not a directory (give an earlier run's run_dir)")
    # A bank of shards writes replay-0/, replay-1/, ...; a run of one shard (shards=1) writes replay/
    # (read only where there is no replay-*/: a directory reused with another shard count has both).
    shards = sorted((p for p in root.glob("replay-*") if p.is_dir()), key=lambda p: p.name) or [
        p for p in [root / "replay"] if p.is_dir()]
    parts: dict[str, list[Any]] = {f: [] for f in fields}
    episodes: list[np.ndarray] = []
    offset = 0
    read = 0
    for shard in shards:
        table, _path, refusals = Table.restore(shard)
        if table is None and refusals:  # (learning on without it left the shard's steps out, said in a warning)
            raise ValueError(f"offline source {str(source)!r}: no checkpoint of shard {shard.name} verifies, so its "
                             f"steps would be left out ({refusals[0]}); restore that directory, or move it out of "
                             f"{str(source)!r} to learn from the other shards")
        for why in refusals:
            log.warning("offline source %s: a checkpoint was refused (an older one was read): %s", shard, why)
        if table is None:
            continue
        st = table.storage
        have = [s.name for s in st.specs]
        missing = [f for f in fields if f not in have]
        if missing:
            raise ValueError(f"offline source {shard}: its steps have no field {missing[0]!r}; they have {have}")
        steps = np.arange(*st.step_range, dtype=np.int64)
        if len(steps) == 0:
            continue
        data = st.read_steps(steps)
        eid = st.episode_bounds(steps)[0].astype(np.int64)
        for f in fields:
            parts[f].append(data[f].cpu())
        episodes.append(eid - eid.min() + offset)  # ids distinct across shards
        offset = int(episodes[-1].max()) + 1
        read += 1
    if not read:
        raise FileNotFoundError(f"offline source {str(source)!r}: no replay checkpoint with steps under replay/ or "
                                f"replay-*/ (found {[p.name for p in shards] or 'no replay directory'}); run an off-policy app "
                                f"with run_dir there first")
    return {f: torch.cat(parts[f]) for f in fields}, np.concatenate(episodes), read


class OfflineLearner(_LearnerBase):
    """Learns a window algorithm on an earlier run's trajectories, sampled on its own device.

    Ports:
        weights: :class:`Weights` every ``weights_every`` updates (and at start).
        report: :class:`Report` every ``report_every`` updates (``updates``, ``samples``, ``source_steps``,
            the algorithm's metrics).

    Args:
        algo, env, algo_config: the algorithm (its ``store`` must read windows), the env (its spaces).
        source: the earlier run's run directory (its ``replay-<i>/`` checkpoints).
        batch_size: windows per update.
        max_updates: updates to run.
        weights_every, report_every: updates between weight broadcasts, between reports.
        seed, run_dir, checkpoint_every, resume, app_config, device, compile: as :class:`Learner`.
        alpha, beta: prioritized sampling's exponents.
        step_s: logical time between updates.
    """

    tick = Action()
    weights = Output(Weights)
    report = Output(Report)

    def __init__(self, algo: str, env: str, algo_config: dict[str, Any] | None = None, *, source: str,
                 batch_size: int = 32, max_updates: int = 1000, weights_every: int = 50, report_every: int = 50,
                 seed: int = 0, run_dir: str | None = None, checkpoint_every: int = 0, resume: bool = False,
                 app_config: dict[str, Any] | None = None, device: str = "cpu", compile: str = "auto",
                 alpha: float = 0.6, beta: float = 0.4, step_s: float = 1e-6) -> None:
        from ._device import check_compile, check_device

        for what, v in (("batch_size", batch_size), ("max_updates", max_updates), ("weights_every", weights_every),
                        ("report_every", report_every)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"OfflineLearner {what} must be an int >= 1, got {v!r}")
        if not isinstance(source, str) or not source:
            raise ValueError(f"OfflineLearner source must name an earlier run's run_dir, got {source!r}")
        self.device = check_device(device, "OfflineLearner device")
        self.compile = check_compile(compile, "OfflineLearner compile")
        self.algo_name, self.env_name, self.algo_config = algo, env, dict(algo_config or {})
        self.source, self.batch_size, self.max_updates = source, batch_size, max_updates
        self.weights_every, self.report_every = weights_every, report_every
        self.seed, self.run_dir, self.checkpoint_every, self.resume = seed, run_dir, checkpoint_every, resume
        self.app_config, self.alpha, self.beta, self.step_s = app_config, alpha, beta, step_s

    @reaction(triggers=[startup], effects=[tick, weights])
    def start(self) -> None:


        self._setup(self.algo_name, self.env_name, self.algo_config)
        try:
            self._load_source()
        except BaseException:
            del self.state  # (its shutdown then saves no untrained checkpoint that `reactor eval` would load)
            raise
        self.weights.send(self._weights())
        if self.updates < self.max_updates:
            self.tick.schedule(delay_s=self.step_s)

    def _load_source(self) -> None:
        """The source's steps into this learner's replay (``start``), checked against its algorithm."""
        import torch

        from ..replay import WindowRead
        from ..replay.device import DeviceReplay

        self._check_source_env()
        spec = self.algo.store(self.obs_space, self.act_space, self.config)
        if not isinstance(spec.read, WindowRead):
            raise ValueError(f"{self.name}: offline learning samples windows; algorithm {self.algo_name!r} reads "
                             f"{type(spec.read).__name__} (use a window algorithm such as transformer_dqn)")
        names = tuple(name for name, _shape, _dtype in spec.fields)
        steps, episodes, shards = load_source_steps(self.source, names)
        n = len(episodes)
        if n < spec.read.length:
            raise ValueError(f"{self.name}: the source holds {n} steps, fewer than one window ({spec.read.length})")
        specs = [(name, tuple(shape), dtype) for name, shape, dtype in spec.fields]
        for name, shape, dtype in specs:  # the source's steps must be this env's and algorithm's
            got = steps[name]
            if tuple(got.shape[1:]) != shape or got.dtype != dtype:
                raise ValueError(f"{self.name}: the source's field {name!r} is {tuple(got.shape[1:])} {got.dtype}; "
                                 f"{self.algo_name} on {self.env_name} stores {shape} {dtype}")
        self.replay = DeviceReplay(specs, n, spec.read.length, device=self.torch_device, alpha=self.alpha,
                                   beta=self.beta)
        self.replay.insert(steps, torch.from_numpy(episodes))
        self.generator = torch.Generator(self.torch_device).manual_seed(int(self.rng.integers(2**62)))
        self.source_steps = n
        print(f"{self.name}: {n} steps of {int(episodes.max()) + 1} episodes from {shards} shard checkpoint(s) of "
              f"{self.source} on {self.torch_device} ({self.replay.kernels} kernels)", flush=True)

    def _check_source_env(self) -> None:
        """Refuse a source recorded on another env than this learner's (its ``config.json``, where the
        source's learner wrote one): steps of the same shape were learned in silence (CartPoleNoVel-v1's as
        MountainCar-v0's)."""
        from .._files import read_small_json

        path = Path(self.source) / "config.json"
        if not path.is_file():
            return  # (replay checkpoints alone: nothing says their env)
        record = read_small_json(path)
        env = record.get("env") if isinstance(record, dict) else None
        if isinstance(env, str) and env != self.env_name:
            raise ValueError(f"{self.name}: the offline source {self.source!r} holds steps of env {env!r} (its "
                             f"config.json), and this run's env is {self.env_name!r}: set env={env}")

    @reaction(triggers=[tick], effects=[tick, weights, report])
    def learn(self) -> None:
        batch = self.replay.sample(self.batch_size, self.generator)
        with self._learning():  # (one that an error cuts short is not saved as the final checkpoint: _finish)
            metrics, priorities = self.learn_step(self.state, batch)
            self.updates += 1
        if priorities is not None:
            self.replay.update_priorities(batch["keys"], priorities.detach())
        if self.updates % self.weights_every == 0:
            self.weights.send(self._weights())
        if self.updates % self.report_every == 0 or self.updates == self.max_updates:
            self.report.send(Report(self.name, {"updates": float(self.updates),
                                                "samples": float(self.updates * self.batch_size),
                                                "source_steps": float(self.source_steps),
                                                **{k: float(v) for k, v in metrics.items()}}))
        self._maybe_checkpoint()  # (the last one at shutdown: _finish)
        if self.updates < self.max_updates:
            self.tick.schedule(delay_s=self.step_s)
        else:
            self.replay.check()
            if self.updates % self.weights_every:
                self.weights.send(self._weights())

    @reaction(triggers=[shutdown])
    def finish(self) -> None:
        self._finish()
