"""Finding algorithms and environments by name (what app files and node arguments carry)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["check_saved_weights", "check_spaces", "configure_torch", "denormals_flushed", "error_line", "load_algorithm",
           "make_env", "make_vector_env", "weights_sha256"]


def configure_torch() -> None:
    """How every node that runs an algorithm's tensors sets up torch in its process: one CPU thread
    (processes are the parallelism, and two threads collapse on a shared 2-core box)."""
    import torch

    torch.set_num_threads(1)


#: The smallest float32 subnormal, made from its bits (a conversion would be flushed already).
_SUBNORMAL = np.array([1], dtype=np.uint32).view(np.float32)[0]


def _flushing() -> bool:
    """Whether this thread flushes denormals now (flush-to-zero / denormals-are-zero set)."""
    return bool(_SUBNORMAL * np.float32(1.0) == 0.0)


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Run an algorithm fragment with denormals flushed to zero, and restore this thread's setting after.

    Adam's second moments of small gradients go subnormal, which x86 computes ~100x slower.
    Measured in a DQN CartPole run: fused Adam 0.42 -> 0.17 ms a step, an update 2.04 -> 1.75 ms.
    Values below ~1e-38 become 0, which no RL loss here depends on. Every node wraps its fragment
    calls (init, act, learn, evaluation) in it, so the numbers do not depend on placement; scoped,
    because the setting is per-thread CPU state that would otherwise outlive a run in the caller's
    process (hypothesis, for one, refuses to run with it on).
    """
    import torch

    was = _flushing()
    if not was:
        torch.set_flush_denormal(True)
    try:
        yield
    finally:
        if not was:
            torch.set_flush_denormal(False)


def load_algorithm(name: str) -> ModuleType:
    """The fragment module of algorithm ``name``: a name registered in ``reactor.algos``
    (``"dqn"``) or an importable module following the same contract (``"my_a2c"`` beside the app
    file, ``"mypkg.my_algo"``).

    Raises:
        ValueError: no such algorithm (naming the registered ones); a module of that name that
            raised while it was imported (naming the error and where), or that lacks a part of the
            fragment contract (naming each: ``_contract.check_module``); or a module of a registered
            algorithm's name on the import path, which the registered one would silently replace.
    """
    from .. import algos
    from ._contract import check_module

    if name in algos.ALGORITHMS:
        shadow = _shadowing(name)
        if shadow is not None:
            raise ValueError(f"algorithm {name!r} is reactor's own, but {shadow} on the import path defines an "
                             f"algorithm (act and learn) of that name too, which reactor would ignore: rename it "
                             f"(my_{name}.py, with ALGO = 'my_{name}') to run it, or remove it to run reactor's")
        module = algos.get_algorithm(name)
        check_module(name, module)
        return module
    unknown = f"unknown algorithm {name!r}: not one of {', '.join(algos.ALGORITHMS)}, and no module of that name"
    if not isinstance(name, str) or not name or not all(part.isidentifier() for part in name.split(".")):
        raise ValueError(f"{unknown} can exist (a module name is dotted identifiers: 'my_algo', 'mypkg.my_algo')")
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - each said in one line
        # Only the module itself (or its package) not found is an unknown name: an import inside it that
        # fails is the module's own error, and was reported as "unknown algorithm" (a copy of dqn.py
        # beside an app, whose relative imports fail there, was "not one of dqn, ...").
        missing = getattr(e, "name", None) if isinstance(e, ModuleNotFoundError) else None
        if missing is not None and (name == missing or name.startswith(missing + ".")):
            raise ValueError(f"{unknown} imports here (beside the app file, installed, or on PYTHONPATH)") from e
        raise ValueError(_import_failure(name, e)) from e
    check_module(name, module)
    return module


def _import_failure(name: str, e: BaseException) -> str:
    """Why algorithm module ``name`` did not import, in one line: the error, where it was raised (the
    innermost frame of a file), and for a relative import, how a copied algorithm imports instead."""
    import os
    import traceback

    if isinstance(e, SyntaxError) and e.filename:  # (its traceback ends in importlib: the file is in the error)
        where, text = f" ({e.filename} line {e.lineno})", str(e.msg)
    else:  # the innermost frame of a file that is neither importlib's nor this one
        ours = ("<", os.path.dirname(importlib.__file__) + os.sep, os.path.abspath(__file__))
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(ours)]
        where = f" ({frames[-1].filename} line {frames[-1].lineno})" if frames else ""
        text = str(e).splitlines()[0] if str(e) else ""
    line = f"algorithm module {name!r} failed to import: {type(e).__name__}{': ' + text if text else ''}{where}"
    if isinstance(e, ImportError) and "relative import" in text:
        line += ("; outside reactor's package a copied algorithm imports reactor's modules absolutely: `from "
                 "reactor.algos import X` for `from . import X`, `from reactor.algos._common import X` for `from "
                 "._common import X`, `from reactor.replay import X` for `from ..replay import X`")
    return line


def _shadowing(name: str) -> str | None:
    """The file of a module named like reactor's algorithm ``name`` on the import path (a user's own
    ``ppo.py`` beside the app, with ``ALGO = "ppo"``), when it defines fragments (``act`` and ``learn``):
    the registered name wins, and the user's algorithm was silently not run. An app file of that name
    (``apps/ppo.py``) defines none, and is no shadow. Found without importing it."""
    import ast
    import importlib.machinery
    from pathlib import Path

    from ..launch._app import APP_DIRS

    # The app files' directories only: each process of a run has those alike (a worker's sys.path[0] is
    # its working directory, the `reactor` command's its bin directory: a check on sys.path passed under
    # `single` and refused in every worker under `actors`).
    spec = importlib.machinery.PathFinder.find_spec(name, list(APP_DIRS))
    origin = getattr(spec, "origin", None)
    if not isinstance(origin, str) or not origin.endswith(".py"):
        return None
    path = Path(origin)
    if path.resolve() == (Path(__file__).resolve().parents[1] / "algos" / f"{name}.py"):
        return None  # (reactor/algos itself on the path)
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return str(path) if {"act", "learn"} <= defined else None


def make_env(name: str) -> Any:
    """One environment by gymnasium id (``reactor.algos.envs`` registers the extra tasks), or
    ``"module:Id"``: gymnasium imports ``module`` (which registers ``Id``) first.

    Raises:
        ValueError: no such env, or its module does not import (naming the id and why).
    """
    from ..algos import envs

    if not isinstance(name, str) or not name:
        # (a lambda or an env object, natural in a notebook, was refused without a word of what to do instead)
        raise ValueError(f"env must be a gymnasium id such as 'CartPole-v1', or 'module:Id' for an env of your own "
                         f"that an importable module registers (every process makes its envs by id: an env object or "
                         f"a function that makes one cannot cross to them; docs/guide.md section 3), got {name!r:.200}")
    try:
        return envs.make_env(name)
    except ImportError as e:
        raise ValueError(f"env {name!r}: its module does not import here ({type(e).__name__}: {e}); a custom "
                         f"env's module must be importable in every process (installed, on PYTHONPATH, or "
                         f"beside the app file; on other hosts, and in a submitted job, ship it with --with "
                         f"FILE)") from e
    except Exception as e:
        import gymnasium

        if isinstance(e, gymnasium.error.Error):
            raise ValueError(f"env {name!r}: {e}") from e
        raise


#: What each action-space kind needs, for the error that names the algorithms that fit instead.
_FITS = {"discrete": "dqn, ppo or transformer_dqn", "continuous": "sac, td3 or ddpg"}


def check_spaces(algo: str, module: ModuleType, env: str, obs_space: Any, act_space: Any, config: Any) -> None:
    """Refuse an env whose action space the algorithm does not act in (its optional ``ACTIONS``:
    ``"discrete"`` or ``"continuous"``), naming the env's space and the algorithms that fit it; or
    whose observations it does not take (a Box, of one dimension unless its optional ``OBSERVATIONS``
    is ``"box"``: every shipped algorithm's networks open with a linear layer over ``shape[0]``).

    Raises:
        ValueError: the kinds differ, the observation space is not a Box, or it is not flat for an
            algorithm that takes flat ones.
    """
    kind = getattr(module, "ACTIONS", None)
    space = type(act_space).__name__
    got = {"Discrete": "discrete", "Box": "continuous"}.get(space, space)
    if kind is not None and kind != got:
        fits = _FITS.get(got)
        raise ValueError(f"{algo} needs a {kind} action space, but env {env!r} has {act_space!r} ({got})"
                         + (f"; for {got} actions use {fits}" if fits else ""))
    if type(obs_space).__name__ != "Box":
        raise ValueError(f"{algo} needs array observations (a Box space), but env {env!r} has {obs_space!r}; "
                         f"wrap the env (e.g. gymnasium.wrappers.FlattenObservation) in a module that registers it")
    # A Box of images reached the first linear layer and failed there ("mat1 and mat2 shapes cannot be
    # multiplied"), in the actors, after the graph had started.
    if getattr(module, "OBSERVATIONS", "flat") == "flat" and len(obs_space.shape) != 1:
        own = not module.__name__.startswith("reactor.algos.")
        raise ValueError(f"{algo} needs flat observations (a Box of shape (n,)), but env {env!r} has {obs_space!r}; "
                         f"wrap the env (e.g. gymnasium.wrappers.FlattenObservation) in a module that registers it"
                         + ("; or, if the algorithm's networks take that shape (a CNN), set OBSERVATIONS = 'box' in "
                            "its module" if own else ""))


def make_vector_env(name: str, num_envs: int) -> Any:
    """``num_envs`` environments stepped side by side, with same-step autoreset (the final
    observation of an episode is in ``info["final_obs"]``, the returned one starts the next)."""
    from ..algos import envs

    return envs.make_vector_env(name, num_envs)


def error_line(e: BaseException, limit: int = 500) -> str:
    """An error in one line for a one-line refusal: its first two lines (torch's load_state_dict puts
    the mismatch on its second), at most ``limit`` characters, or its type's name."""
    if isinstance(e, KeyError) and len(e.args) == 1:  # (its text is the bare key: "'q'")
        return f"it holds no {e.args[0]!r} (a checkpoint of another algorithm?)"[:limit]
    text = " ".join(line.strip() for line in str(e).strip().splitlines()[:2]) or type(e).__name__
    return text[:limit]


def check_saved_weights(saved: dict[str, Any], weights: dict[str, Any]) -> None:
    """Compare a loaded checkpoint's policy ``weights`` with the hash saved beside them in the file
    (``learner.pt`` since this check; older files carry none and pass), and its whole state (target
    networks, optimizer moments: a NaN there trained on to nothing) with ``state_sha256`` where saved.

    Raises:
        ValueError: they differ: the file was damaged after it was written.
    """
    want = saved.get("weights_sha256")
    if isinstance(want, str) and (got := weights_sha256(weights)) != want:
        raise ValueError(f"its weights do not match the sha256 saved with them ({got[:12]}... against "
                         f"{want[:12]}...): the file was damaged")
    want = saved.get("state_sha256")
    if isinstance(want, str) and (got := state_sha256(saved.get("algo"))) != want:
        raise ValueError(f"its state (target networks, optimizer) does not match the sha256 saved with it "
                         f"({got[:12]}... against {want[:12]}...): the file was damaged")


def state_sha256(state: Any) -> str:
    """The hash of a whole saved state: nested dicts (keys in order of their text), lists, tensors'
    bytes, and the plain values' text."""
    import torch

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=str):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        elif hasattr(x, "detach"):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(x).encode())

    walk(state)
    return h.hexdigest()


def weights_sha256(weights: dict[str, Any]) -> str:
    """The hash of a policy's weights (``policy_weights``): names and bytes in name order. The learner
    prints and writes it at its end (``weights.sha256``); a loaded policy reports the same."""
    h = hashlib.sha256()
    for name, t in sorted(weights.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
