"""Trained policies from a run directory: ``reactor.load_policy(run_dir).act(obs)``, and ``reactor eval``.

A learner writes ``config.json`` (algorithm, env, the algorithm's resolved Config, the app's) when it
starts and ``learner.pt`` (the algorithm's ``state_dict``) at every checkpoint and at the end. That is
all a policy needs: it is rebuilt with the algorithm's own fragments (``init``, ``load_state_dict``,
``policy_weights``, ``make_policy``, ``load_weights``, ``act``), with no app file and no runtime.
``learner.pt`` is read with ``torch.load(weights_only=True)``: tensors and plain containers only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .._files import read_small_json

__all__ = ["Policy", "evaluate_policy", "load_policy"]

#: The large env-step count ``act(deterministic=False)`` passes: exploration schedules at their end.
_LATE_STEP = 10**12


class Policy:
    """A trained policy: ``act(obs)`` for one observation or a batch, numpy or torch.

    Attributes:
        algo: the algorithm's name; ``env``: the env id it was trained on.
        config: the algorithm's resolved Config; ``app_config``: the app's (a dict, or None).
        observation_space, action_space: the env's.
        updates: learner updates behind these weights.
        weights_sha256: the hash the learner printed and wrote to ``weights.sha256`` at its end.
    """

    def __init__(self, run_dir: Path, record: dict[str, Any], seed: int) -> None:
        import sys

        import torch

        from ._contract import check_policy_weights
        from ._registry import check_saved_weights, error_line, load_algorithm, make_env, weights_sha256

        # A custom env's or algorithm's module beside the app that trained it (run directory on this
        # machine): importable here too. Appended, so an installed package still wins.
        missing: list[str] = []
        for where in record.get("app_dirs") or []:
            if isinstance(where, str) and not Path(where).is_dir():
                missing.append(where)
            elif isinstance(where, str) and where not in sys.path:
                sys.path.append(where)
        self.run_dir = run_dir
        self.algo = str(record["algo"])
        self.env = str(record["env"])
        self.app_config = record.get("app_config")
        try:
            self.module = load_algorithm(self.algo)
            self.config = self.module.Config.from_dict(dict(record["algo_config"]))
            probe = make_env(self.env)
        except ValueError as e:
            if not missing:
                raise
            # (a run directory copied to another machine: "beside the app file" alone named no place)
            raise ValueError(f"{e}; the directory of the app that trained it, {', '.join(missing)} (config.json's "
                             f"app_dirs), is not on this machine: copy its modules there, install them, or put them "
                             f"on PYTHONPATH") from None
        self.observation_space, self.action_space = probe.observation_space, probe.action_space
        probe.close()
        weights_file = run_dir / str(record.get("weights", "learner.pt"))
        if not weights_file.is_file():
            raise FileNotFoundError(f"{run_dir}: no weights ({weights_file.name}): the learner writes them at its "
                                    f"checkpoints and at the end of the run")
        try:
            saved = torch.load(weights_file, weights_only=True, map_location="cpu")  # a GPU learner's too
            algo_state, updates = saved["algo"], int(saved["updates"])
        except Exception as e:  # a truncated or foreign file: say which, in one line
            raise ValueError(f"{weights_file}: not a learner checkpoint torch can load ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''})") from e
        with torch.random.fork_rng():
            state = self.module.init(self.observation_space, self.action_space, self.config, 0)
        try:
            self.module.load_state_dict(state, algo_state)
            weights = self.module.policy_weights(state)
        except Exception as e:  # another network's weights (config.json edited): one line
            raise ValueError(f"{weights_file}: {error_line(e)}") from None
        check_policy_weights(self.module, weights)  # (its own one line: not the file's fault)
        try:
            check_saved_weights(saved, weights)
        except Exception as e:  # damaged weights: one line
            raise ValueError(f"{weights_file}: {error_line(e)}") from None
        self.updates = updates
        self.weights_sha256 = weights_sha256(weights)
        self._weights = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        self.policy = self._fresh()
        self.generator = torch.Generator().manual_seed(seed)
        self._rows: int | None = None
        self._act_checked = False  # (what act returns is checked on its first call: _contract)

    def act(self, obs: Any, deterministic: bool = True) -> Any:
        """The action for ``obs``: one observation (the env's observation shape) or a batch of them.

        Returns the same kind as ``obs`` (a torch tensor for a tensor, else a numpy array), batched
        as ``obs`` is. ``deterministic=False`` acts as the actors did at the end of training
        (epsilon-greedy at its final epsilon, or a sampled stochastic action). Agents with memory
        (``transformer_dqn``) remember each row's history across calls: call :meth:`reset` when an
        episode ends (a batch of a new size starts afresh).

        Raises:
            ValueError: ``obs`` has neither the observation shape nor a leading batch dimension on it.
        """
        import torch

        from ._contract import check_act
        from ._registry import denormals_flushed

        is_tensor = isinstance(obs, torch.Tensor)
        x = obs.detach().cpu() if is_tensor else torch.as_tensor(np.asarray(obs))
        shape = tuple(self.observation_space.shape)
        if tuple(x.shape) == shape:
            single = True
            x = x.unsqueeze(0)
        elif tuple(x.shape[1:]) == shape and x.dim() == len(shape) + 1:
            single = False
        else:
            raise ValueError(f"{self.algo} policy for {self.env}: observation of shape {tuple(x.shape)}; expected "
                             f"{shape} or (batch, {', '.join(map(str, shape))})")
        x = x.to(torch.float32) if x.dtype == torch.float64 else x
        if self._rows != x.shape[0]:  # a batch of a new size: agents with memory start afresh
            if self._rows is not None and hasattr(self.module, "reset"):
                self.policy = self._fresh()
            self._rows = x.shape[0]
        with torch.no_grad(), denormals_flushed():
            acted = self.module.act(self.policy, x, _LATE_STEP, self.generator, greedy=deterministic)
        if not self._act_checked:
            check_act(self.module, acted, x.shape[0], self.action_space)
            self._act_checked = True
        action, _ = acted
        action = action[0] if single else action
        return action if is_tensor else action.numpy()

    def reset(self, ended: Any = None) -> None:
        """Agents with memory: forget the history of the rows whose episode ended (``ended``: bool
        per row; None: all). Memoryless agents ignore it."""
        if hasattr(self.module, "reset") and self._rows is not None:
            flags = np.ones(self._rows, dtype=bool) if ended is None else np.asarray(ended, dtype=bool)
            self.module.reset(self.policy, flags)

    def _fresh(self) -> Any:
        """A new policy object with these weights (and, for agents with memory, no history)."""
        import torch

        with torch.random.fork_rng():  # make_policy's initial weights draw from torch's stream
            policy = self.module.make_policy(self.observation_space, self.action_space, self.config)
        self.module.load_weights(policy, self._weights)
        return policy

    def __repr__(self) -> str:
        return f"Policy({self.algo} on {self.env}, {self.updates} updates, from {str(self.run_dir)!r})"


def load_policy(run_dir: str | Path, *, seed: int = 0) -> Policy:
    """The trained policy of a run: ``load_policy("runs/dqn-CartPole-v1-…").act(obs)``.

    Needs only the run directory (``config.json`` and ``learner.pt``, written by the learner) and
    reactor; no app file. A custom env's or algorithm's module must import here: from the app's
    directory when it exists on this machine (recorded in ``config.json``), else installed or on
    ``PYTHONPATH``. ``seed`` seeds the stochastic actions of ``act(deterministic=False)``.

    Raises:
        FileNotFoundError: no such directory, or no ``config.json`` or weights in it.
        ValueError: ``config.json`` is not one a learner wrote (naming what is wrong), or its env
            or algorithm is not available here.
    """
    d = Path(run_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"no run directory at {str(run_dir)!r}")
    path = d / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{d}: no config.json: a learner writes it when a run starts (a run directory "
                                f"of reactor run with a training app)")
    record = read_small_json(path)  # (bounded; a FIFO refused; JSON nested past parsing: one line)
    if not isinstance(record, dict) or record.get("format") != 1 or not isinstance(record.get("algo"), str) \
            or not isinstance(record.get("env"), str) or not isinstance(record.get("algo_config"), dict):
        raise ValueError(f"{path}: not a learner's config.json (expected format 1 with algo, env and algo_config)")
    return Policy(d, record, seed)


#: The most episodes :func:`evaluate_policy` plays (``reactor eval --episodes``): 10**20 was taken and played
#: for good (a careless user's pass); a million CartPole episodes are hours already.
MAX_EVAL_EPISODES = 1_000_000


def evaluate_policy(policy: Policy, episodes: int, seed: int = 0, video_dir: str | Path | None = None) -> np.ndarray:
    """Returns of ``episodes`` greedy episodes of ``policy`` on its env (side by side in a vector env, in rounds of at most ``EVAL_WIDTH``),
    or one after another with each recorded to ``video_dir`` (gymnasium's ``RecordVideo``; needs
    ``moviepy``: the ``video`` extra).

    Raises:
        ValueError: ``episodes`` not in [1, ``MAX_EVAL_EPISODES``]; for a video, moviepy or pygame is missing, or the env does not
            render frames (``"rgb_array"`` not among its ``metadata["render_modes"]``).
    """
    from ._registry import make_env, make_vector_env
    from .evaluator import EVAL_WIDTH, evaluate

    if not 1 <= episodes <= MAX_EVAL_EPISODES:
        raise ValueError(f"episodes must be in [1, {MAX_EVAL_EPISODES:,}], got {episodes}")
    if video_dir is None:
        env = make_vector_env(policy.env, min(episodes, EVAL_WIDTH))
        try:
            return evaluate(policy.module, policy._fresh(), env, episodes, seed)
        finally:
            env.close()
    import os

    import gymnasium as gym

    try:
        import moviepy  # noqa: F401  (RecordVideo writes with it)
        import pygame  # noqa: F401  (gymnasium's classic-control envs render with it)
    except ImportError as e:
        raise ValueError(f"--video needs moviepy and pygame ({e}): in reactor's checkout, pip install -e '.[video]' "
                         f"(or pip install moviepy pygame)") from e
    # An env that renders no frames (the guide's Chain) failed inside gymnasium with some 40 lines of
    # traceback ("Chain() takes no arguments ... render_mode='rgb_array'"): its metadata says so first.
    probe = make_env(policy.env)
    try:
        modes = list((getattr(probe, "metadata", None) or {}).get("render_modes") or [])
    finally:
        probe.close()
    if "rgb_array" not in modes:
        raise ValueError(f"env {policy.env!r} cannot record video: --video needs an env that renders frames, made "
                         f"with render_mode=\"rgb_array\" (its metadata[\"render_modes\"] lists it, and render() "
                         f"returns the frame); this one's render_modes are {modes}")
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # rendering off screen: no display, no audio
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    try:
        env = gym.wrappers.RecordVideo(gym.make(policy.env, render_mode="rgb_array"), str(video_dir),
                                       episode_trigger=lambda _: True,
                                       name_prefix=f"{policy.algo}-{policy.env.replace(':', '_').replace('/', '_')}",
                                       disable_logger=True)
    except gym.error.Error as e:
        raise ValueError(f"env {policy.env!r} cannot record video: {e}") from e
    vec = gym.vector.SyncVectorEnv([lambda: env])
    try:  # one episode after another: RecordVideo starts a file at every reset
        return np.asarray([float(evaluate(policy.module, policy._fresh(), vec, 1, seed + i)[0])
                           for i in range(episodes)])
    finally:
        vec.close()
