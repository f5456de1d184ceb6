"""A learner's state and its files: :class:`_LearnerBase`, what the online and offline learners share.

It makes the algorithm's state (the algorithm, the env's spaces, the device, the bank's seed) and checks
what the algorithm returns; resumes it from ``run_dir/learner.pt`` (``resume=True``, or a restart) with
the run's own optimizer settings; writes ``config.json``, what rebuilds the policy; saves ``learner.pt``
atomically every ``checkpoint_every`` updates (a save that fails mid-run is tried again at the next, one
at the run's end fails the run); and at shutdown saves the last checkpoint and the final weights' hash,
unless an error cut an update short once it had changed the networks, and its final update count for the
run's summary (``learner.json``: :mod:`reactor.nodes._learnerend`). The subclasses
(:class:`~reactor.nodes.learner.Learner`, :class:`~reactor.nodes.learner.RolloutLearner`,
:class:`~reactor.nodes.offline.OfflineLearner`) hold the ports and the reactions; the data-parallel
bank is :mod:`reactor.nodes._learnerbank`'s.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._files import os_error_in, refuse_file_links, replace_small, replacing
from .._runclaim import check_resumable, claim_run_dir, release_run_dir
from ._contract import check_policy_weights, check_state_dict
from ._device import LearnStep, resolve_device, takes_device
from ._learnerbank import _LearnerBank, _optimizers, _say
from ._learnerend import LearnerEnd
from ._registry import check_saved_weights, denormals_flushed, error_line, state_sha256, weights_sha256
from .train_messages import Weights


class _LearnerBase(_LearnerBank):
    placement_role = "learner"
    replicas_apart = "data-parallel replicas: each joins the bank's torch.distributed group"

    def _setup(self, algo: str, env: str, algo_config: dict[str, Any] | None) -> None:
        import torch

        from ._registry import configure_torch, load_algorithm, make_env

        if self.run_dir:  # (first: a learner refused here has no state, and saves nothing at shutdown)
            refuse_file_links(self.run_dir)
            ckpt = Path(self.run_dir) / "learner.pt"
            if (ckpt.exists() or ckpt.is_symlink()) and not ckpt.is_file():
                raise ValueError(f"{self.name}: {ckpt} is not a file: the learner's checkpoint goes there; remove it")
            self._run_claim = claim_run_dir(self.run_dir, self.run_id, resume=self.resume,
                                            who=self.name)
        configure_torch()
        self.algo = load_algorithm(algo)
        self.config = self.algo.Config.from_dict(dict(algo_config or {}))
        probe = make_env(env)
        self.obs_space, self.act_space = probe.observation_space, probe.action_space
        probe.close()
        # Every replica starts alike (the bank's seed), and --seed changes the initialisation.
        seed = int(np.random.default_rng([self.bank_seed, self.seed]).integers(2**31))
        self.torch_device = resolve_device(self.device, self.name, self.bank_index)
        on_device = {}
        if self.torch_device.type != "cpu":
            if not takes_device(self.algo.init):
                raise ValueError(f"{self.name}: device={self.device!r}, but algorithm {self.algo_name!r}'s init takes "
                                 f"no device argument (the fragment contract: init(obs_space, act_space, config, seed, "
                                 f"device)); use device='cpu' or add it")
            on_device = {"device": self.torch_device}
        with torch.random.fork_rng(devices=[self.torch_device] if self.torch_device.type == "cuda" else []):
            torch.manual_seed(seed)  # seeded, and no other stream in this process moves
            with denormals_flushed():
                self.state = self.algo.init(self.obs_space, self.act_space, self.config, seed, **on_device)
        # What policy_weights and state_dict return, checked once here: not in the weights' broadcast, and not
        # first at the run's end, in its last checkpoint.
        try:
            check_policy_weights(self.algo, self.algo.policy_weights(self.state))
            check_state_dict(self.algo, self.algo.state_dict(self.state))
        except ValueError:
            del self.state  # (nothing is saved at shutdown: _finish)
            raise
        self._learn_checked = False  # (what learn returns is checked on its first call)
        self._watch_steps()
        self.learn_step = LearnStep(self.algo.learn, self.compile, self.torch_device, self.name,
                                    replicas=self.bank_size)
        self.updates = 0
        self.ckpt = Path(self.run_dir) / "learner.pt" if self.run_dir else None
        self._failed_saves = 0  # checkpoints in a row that could not be written (a full disk)
        self._saved_at: int | None = None  # the update of the last learner.pt this life saved (or resumed from)
        if self.ckpt is not None and self.resume and self.restarts == 0:
            self._check_same_run()
        # A restarted learner (restart policies) resumes from its latest checkpoint, as resume=True. The
        # other replicas of a data-parallel bank then take replica 0's state when they join (_share_state),
        # so only replica 0 says what it lacks (over hosts the others' run directories hold no checkpoint).
        first = self.bank_index == 0
        if (self.resume or self.restarts > 0) and self.ckpt is not None and self.ckpt.is_file():
            self._resume(torch)
        elif first and self.restarts > 0:
            # (it started again from fresh weights without a word: a run's progress lost in silence)
            lost = self.restart_loses() or (f"its learning: no learner.pt written yet (checkpoint_every = "
                                            f"{self.checkpoint_every}), so it learns again from fresh weights")
            logging.getLogger("reactor.learner").warning(
                "%s: started again (restart %d) without %s; the replay and the actors go on from theirs",
                self.name, self.restarts, lost)
        elif first and self.resume and self.ckpt is not None and self.restarts == 0:
            logging.getLogger("reactor.learner").warning(
                "%s: resume=True, but %s holds no learner.pt (the earlier run was killed before it saved one: a run "
                "saves it at its end, and every checkpoint_every updates when set): the learner starts from fresh "
                "weights; the replay and the actors' schedules go on from theirs", self.name, self.run_dir)
        if self.ckpt is not None and self.bank_index == 0:
            self._write_config()
            # Its final count, for the run's summary (_learnerend): held from here, where its start can no
            # longer be refused (a refused start leaves the run directory as it was).
            self._end = LearnerEnd(self.ckpt.parent, self.name)

    #: An update under way (:meth:`_learning`): set as ``learn`` begins, cleared once it has returned and
    #: been counted; left set by one an error cut short.
    _cut = False
    _params: list[Any] = []  # (the parameters the state's optimizers step: _watch_steps)
    _versions = 0

    def _watch_steps(self) -> None:
        """The parameters the state's optimizers step, whose in-place versions (``Tensor._version``, which
        every in-place change counts) tell an update cut short before it changed any (an error before its first
        optimizer step) from one cut after (a critic stepped, an actor not; its counters out of step with
        them): :meth:`_finish_files`. Read outside ``learn``, which may be compiled: a step hook in it is
        a side effect the compiler has to break its graph for."""
        self._params = [p for opt in _optimizers(self.state) for g in opt.param_groups for p in g["params"]]

    def _parameter_versions(self) -> int:
        return sum(p._version for p in self._params)

    def _stepped(self) -> bool:
        """Whether the update under way changed a parameter (True when none is known: no optimizer found)."""
        return not self._params or self._parameter_versions() != self._versions

    @contextlib.contextmanager
    def _learning(self) -> Iterator[None]:
        """One update (the algorithm's ``learn``): what :meth:`_finish_files` reads to tell a state that holds
        whole updates from one an error cut short in the middle of one (left set when ``learn`` raises: an
        algorithm's bug, a device out of memory, a data-parallel all-reduce that another replica's death
        failed, a second Ctrl-C between its lines)."""
        self._cut, self._versions = True, self._parameter_versions()
        yield
        self._cut = False

    def restart_loses(self) -> str:
        if not self.run_dir:
            return "its learning: with no run_dir it writes no learner.pt to resume from, and learns again from fresh weights"
        if self.checkpoint_every <= 0:
            return ("its learning: checkpoint_every = 0 writes learner.pt only at the run's end, so it learns again from "
                    "fresh weights; set checkpoint_every=N to resume from every N updates")
        return ""

    def _check_same_run(self) -> None:
        assert self.ckpt is not None
        try:
            check_resumable(self.ckpt.parent, self.algo_name, self.env_name, self.name)
        except ValueError:
            del self.state  # (nothing is saved at shutdown: _finish)
            raise

    def _resume(self, torch: Any) -> None:
        """Load ``learner.pt`` into the fresh state. One that does not load (another network's shape:
        a --set that differs from the run's, a damaged file) ends the run with one line naming the file,
        and leaves the file, config.json and weights.sha256 as they were: the learner never saves over
        a checkpoint it could not resume from (it did, with its fresh weights, at its shutdown)."""
        assert self.ckpt is not None
        # This run's optimizer settings (lr, betas, eps, ...: the config, with its --set) outlive the load:
        # torch's Optimizer.load_state_dict puts the checkpoint's back, so a resume with a new lr trained
        # on at the old one while config.json said the new.
        chosen = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                  for opt in _optimizers(self.state)]
        try:
            saved = torch.load(self.ckpt, weights_only=True, map_location=self.torch_device)
            if not isinstance(saved, dict) or "algo" not in saved or type(saved.get("updates")) is not int \
                    or not 0 <= saved["updates"] < 2**53:  # (a count that crosses the wire as an int64, exactly)
                raise ValueError("it is not a learner checkpoint (a dict of 'algo' and a count of 'updates')")
            self.algo.load_state_dict(self.state, saved["algo"])
            check_saved_weights(saved, self.algo.policy_weights(self.state))
        except Exception as e:  # noqa: BLE001 - whatever the file held, the same answer
            del self.state  # (nothing is saved at shutdown: _finish)
            raise ValueError(f"{self.name}: cannot resume from {self.ckpt}: {error_line(e)} (the run's settings must be "
                             f"those it was trained with: config.json beside it has them); the checkpoint and the "
                             f"run's results were left as they were") from None
        self.updates = int(saved["updates"])
        self._saved_at = self.updates
        log = logging.getLogger("reactor.learner")
        _say(f"{self.name} resumed from its checkpoint {self.ckpt} at update {self.updates}")  # (asked for: no warning)
        for i, (opt, groups) in enumerate(zip(_optimizers(self.state), chosen, strict=True)):
            for g, settings in zip(opt.param_groups, groups, strict=True):
                changed = {k: (g[k], v) for k, v in settings.items() if k in g and not _same_setting(g[k], v)}
                g.update(settings)
                for k, (was, now) in changed.items():
                    log.warning("%s: optimizer %d's %s is %r now (the checkpoint's was %r)", self.name, i, k, now, was)

    def _write_config(self) -> None:
        """``run_dir/config.json``: what rebuilds the policy (``reactor.load_policy``) without the app."""
        import dataclasses
        import json

        assert self.ckpt is not None
        from ..launch._app import APP_DIRS, SCRIPT_DIRS

        record = {"format": 1, "algo": self.algo_name, "env": self.env_name,
                  "algo_config": dataclasses.asdict(self.config), "app_config": self.app_config,
                  "weights": self.ckpt.name,
                  # Where a custom env's or algorithm's module was found beside the app (load_policy
                  # imports from there too when the directory exists where the policy is loaded).
                  "app_dirs": list(dict.fromkeys([*APP_DIRS, *SCRIPT_DIRS]))}
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        replace_small(self.ckpt.with_name("config.json"), (json.dumps(record, indent=2, default=repr) + "\n").encode())

    def _maybe_checkpoint(self, force: bool = False) -> str | None:
        """Save ``learner.pt`` when due (or ``force``); returns the policy weights' sha256 saved with
        it, or None when nothing was saved."""
        import torch

        if self.ckpt is None or self.bank_index != 0:
            return None
        if not force and (self.checkpoint_every <= 0 or self.updates % self.checkpoint_every):
            return None
        self.ckpt.parent.mkdir(parents=True, exist_ok=True)
        # The policy's weights' hash travels with them: a loader that finds other weights knows the file
        # was damaged (bit flips in a tensor load silently otherwise).
        sha = weights_sha256(self.algo.policy_weights(self.state))
        state = self.algo.state_dict(self.state)
        try:
            with replacing(self.ckpt, sync=True) as f:
                torch.save({"algo": state, "updates": self.updates, "weights_sha256": sha,
                            "state_sha256": state_sha256(state)}, f)
        except (OSError, RuntimeError) as e:  # (torch's zip writer says a full disk as a RuntimeError)
            cause = os_error_in(e)
            if cause is None:
                raise
            self._checkpoint_failed(cause, force)
            return None
        if self._failed_saves:
            logging.getLogger("reactor.learner").warning("%s: saved %s again at update %d, after %d failed tries",
                                                         self.name, self.ckpt, self.updates, self._failed_saves)
        self._failed_saves, self._saved_at = 0, self.updates
        return sha

    def _checkpoint_failed(self, cause: OSError, at_end: bool) -> None:
        """A checkpoint that could not be written (a full disk, a read-only or vanished directory): the
        last one saved stays whole (:func:`replacing`). Mid-run the learner goes on and tries again at the
        next (said at the first failure and at every tenth after it): a long run is not ended by a disk
        that fills for a while. At the run's end it fails the run, naming the file and what is kept."""
        why = cause.strerror or str(cause)
        kept = (f"{self.ckpt.name} holds the last one saved, at update {self._saved_at}"  # type: ignore[union-attr]
                if self._saved_at is not None else "none was saved in this life")
        if at_end:
            err = OSError(f"{self.name}: cannot save {self.ckpt} at the run's end ({why}); {kept}")
            err.errno = cause.errno  # (kept for a caller that asks; not in its words: "[Errno 28] ...")
            raise err from cause
        self._failed_saves += 1
        if self._failed_saves % 10 == 1:
            logging.getLogger("reactor.learner").warning(
                "%s: cannot save %s at update %d (%s; %d failed tries so far); %s; learning goes on and tries again "
                "at the next checkpoint", self.name, self.ckpt, self.updates, why, self._failed_saves, kept)

    def _finish(self) -> None:
        """At shutdown: a last checkpoint, and the final weights' hash (printed, and in run_dir); then the
        final count for the run's summary (``learner.json``), and the run directory's claim goes."""
        try:
            self._finish_files()
        finally:
            end: LearnerEnd | None = getattr(self, "_end", None)
            if end is not None:
                try:
                    if hasattr(self, "state"):
                        end.write(self.run_id, self.name, self.updates)
                finally:
                    end.close()
            release_run_dir(self)

    def _finish_files(self) -> None:
        if not hasattr(self, "state"):
            self._leave_unmet_bank()
            return
        if self.bank_size > 1 and self.dp_members is None:
            # Data-parallel, its bank never met: nothing learned (its state is fresh, or the checkpoint's it
            # resumed from); it saved those as a checkpoint of no update over the run's at the reaping.
            self._leave_unmet_bank()
            return
        self._leave_bank()
        if self._cut and self._stepped():
            # An update an error cut short once it had changed a parameter (or where that cannot be told: no
            # optimizer found in the state): the state may hold part of it, its counters out of step with it.
            # Saved, it was resumed as is (a restart, resume=True); the last checkpoint stays instead.
            kept = ("its state is not saved" if self.ckpt is None or self.bank_index != 0 else
                    f"{self.ckpt} is left as saved at update {self._saved_at}" if self._saved_at is not None else
                    f"no {self.ckpt.name} is saved (none was in this life)")
            _say(f"{self.name}: update {self.updates + 1} was cut short by an error once it had changed the networks: "
                 f"the state may hold part of it, so {kept}; {self.updates} whole updates")
            return
        saved = self._maybe_checkpoint(force=True)  # replica 0 only (it hashed the weights: not twice)
        self.weights_sha256 = saved or weights_sha256(self.algo.policy_weights(self.state))
        if self.run_dir and self.bank_index == 0:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            replace_small(Path(self.run_dir) / "weights.sha256", (self.weights_sha256 + "\n").encode())
        cut = {"failure": "the run failed", "terminated": "this process was ended"}.get(self.stopped_by or "")
        if cut:  # (not read as a finished run's result: "0 updates; final weights" followed a failed start)
            _say(f"{self.name}: {cut} after {self.updates} updates, not a finished run; its weights then sha256 "
                 f"{self.weights_sha256}")
            return
        _say(f"{self.name}: {self.updates} updates; final weights sha256 {self.weights_sha256}")

    def _on_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        """``batch`` moved to the learner's device (as is on the CPU)."""
        if self.torch_device.type == "cpu":
            return batch
        return {k: v.to(self.torch_device, non_blocking=True) for k, v in batch.items()}

    def _weights(self) -> Weights:
        # A copy, always: in one process the message is handed over as is, and the optimizer changes
        # the live parameters in place; receivers must see the weights of version `updates`.
        return Weights(self.updates, {k: v.detach().to("cpu", copy=True).contiguous() for k, v in
                                      self.algo.policy_weights(self.state).items()})



def _same_setting(a: Any, b: Any) -> bool:
    """Whether two optimizer settings are equal (a tensor lr compares by value, not elementwise)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - settings that do not compare are reported as changed
        return False
