"""An algorithm of one's own (docs/guide.md section 4): what reactor says when its module does not import,
has the name of a shipped one, or breaks the fragment contract (reactor.algos' docstring). Regressions
of a newcomer's pass over the guide (sections 3-7): each was an error from inside reactor (an
AttributeError on a numpy array, "unknown algorithm" for a module that exists), or no error at all."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from reactor.nodes._registry import load_algorithm

ROOT = Path(__file__).resolve().parents[2]


def _guide_block(name: str) -> str:
    """The guide's python block that opens with ``# name`` (its A2C, its env)."""
    text = (ROOT / "docs" / "guide.md").read_text()
    m = re.search(rf"```python\n# {re.escape(name)}\n.*?```", text, re.S)
    assert m is not None, name
    return m.group(0)[len("```python\n"):-len("```")]


@pytest.fixture
def beside(tmp_path, monkeypatch):
    """Write modules into a directory on the import path (as beside an app file); forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, code: str) -> str:
        (tmp_path / f"{name}.py").write_text(code)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


# ------------------------------------------------------------------------------------- finding the module


def test_a_copy_of_a_shipped_algorithm_beside_the_app_says_its_relative_imports_fail(beside):
    """Regression: a copy of reactor/algos/dqn.py beside an app (the guide points to it) was "unknown
    algorithm 'odqn_ok': not one of dqn, ppo, ... (attempted relative import with no known parent
    package)"; any ImportError inside a module read as an unknown name."""
    beside("odqn_copy", (ROOT / "reactor" / "algos" / "dqn.py").read_text())
    with pytest.raises(ValueError, match=r"^algorithm module 'odqn_copy' failed to import: ImportError: attempted "
                                         r"relative import with no known parent package \(.*odqn_copy\.py line \d+\); "
                                         r"outside reactor's package a copied algorithm imports reactor's modules "
                                         r"absolutely: `from reactor\.algos import X` for `from \. import X`"):
        load_algorithm("odqn_copy")
    fixed = (ROOT / "reactor" / "algos" / "dqn.py").read_text().replace("from ..replay import", "from reactor.replay import") \
        .replace("from . import", "from reactor.algos import").replace("from ._common import", "from reactor.algos._common import")
    assert load_algorithm(beside("odqn_fixed", fixed)).KIND == "off_policy"  # (what the message says to do works)


def test_a_missing_import_inside_an_algorithm_module_is_its_error_not_an_unknown_name(beside):
    beside("algo_needs_dep", "import no_such_dependency_here\n")
    with pytest.raises(ValueError, match=r"^algorithm module 'algo_needs_dep' failed to import: ModuleNotFoundError: "
                                         r"No module named 'no_such_dependency_here' \(.*algo_needs_dep\.py line 1\)$"):
        load_algorithm("algo_needs_dep")
    beside("algo_unclosed", "x = (\n")  # (a SyntaxError's traceback ends in importlib: its own file and line)
    with pytest.raises(ValueError, match=r"^algorithm module 'algo_unclosed' failed to import: SyntaxError: '\(' was "
                                         r"never closed \(.*algo_unclosed\.py line 1\)$"):
        load_algorithm("algo_unclosed")
    for name in ("no_such_algo_module", "no_such_pkg.algo"):  # the module (or its package) itself: unknown
        with pytest.raises(ValueError, match=rf"^unknown algorithm '{name}': not one of dqn, ppo, sac, td3, ddpg, "
                                             r"transformer_dqn, and no module of that name imports here"):
            load_algorithm(name)


def test_an_algorithm_module_named_like_a_shipped_one_is_refused_naming_its_file(beside, tmp_path, monkeypatch):
    """Regression: a user's own ppo.py beside the app, with ALGO = "ppo", was silently ignored and the
    shipped PPO ran. (The app files' directories are searched, alike in every process of a run.)"""
    from reactor.launch import _app

    beside("ppo", _guide_block("my_a2c.py"))
    monkeypatch.setattr(_app, "APP_DIRS", [str(tmp_path)])  # (as loading an app file there does)
    with pytest.raises(ValueError, match=rf"^algorithm 'ppo' is reactor's own, but {re.escape(str(tmp_path / 'ppo.py'))} "
                                         r"on the import path defines an algorithm \(act and learn\) of that name too, "
                                         r"which reactor would ignore: rename it \(my_ppo\.py, with ALGO = 'my_ppo'\)"):
        load_algorithm("ppo")


def test_an_app_file_named_like_its_algorithm_is_no_shadow(monkeypatch):
    from reactor.launch import _app

    monkeypatch.syspath_prepend(str(ROOT / "apps"))  # (apps/ppo.py: an app, on the path as every loaded app's dir)
    monkeypatch.setattr(_app, "APP_DIRS", [str(ROOT / "apps")])
    assert load_algorithm("ppo").__name__ == "reactor.algos.ppo"


# ------------------------------------------------------------------------------------- the fragment contract

CONTRACT = r" \(the fragment contract: docs/guide\.md section 4, reactor\.algos' docstring\)$"


@pytest.fixture
def a2c(beside):
    """The guide's A2C beside the test, and a way to write a variant of it (its fragments over the guide's)."""
    beside("guide_a2c", _guide_block("my_a2c.py"))

    def variant(name: str, code: str) -> str:
        return beside(name, "import torch\nimport guide_a2c\nfrom guide_a2c import *  # noqa: F403\n" + code)

    return variant


def _train_on_policy(algo: str, run_dir: Path) -> None:
    from reactor import run
    from reactor.nodes.training import on_policy_graph

    run(on_policy_graph(algo=algo, env="CartPole-v1", run_dir=str(run_dir), actors=1, envs_per_actor=2,
                        eval_episodes=2, max_env_steps=64, live=False))


BROKEN = {
    "act_numpy": (
        "def act(policy, obs, step, generator, greedy=False):\n"
        "    action, extras = guide_a2c.act(policy, obs, step, generator, greedy)\n"
        "    return action.numpy(), extras\n",
        r"act must return its actions as a torch\.Tensor \[N, \.\.\.\], got a numpy\.ndarray of shape \(2,\) "
        r"\(torch\.as_tensor makes one\)"),
    "act_column": (
        "def act(policy, obs, step, generator, greedy=False):\n"
        "    action, extras = guide_a2c.act(policy, obs, step, generator, greedy)\n"
        "    return action.unsqueeze(-1), extras\n",
        r"act returned actions of shape \(2, 1\) for 2 observation\(s\) of an env whose action space is "
        r"Discrete\(2\): expected \(2,\), one action per observation \(a Discrete action is a scalar\)"),
    "act_action_only": (
        "def act(policy, obs, step, generator, greedy=False):\n"
        "    return guide_a2c.act(policy, obs, step, generator, greedy)[0]\n",
        r"act must return \(actions, extras\), a tensor of actions \[N, \.\.\.\] and a dict of tensors; it returned "
        r"a torch\.Tensor of shape \(2,\)"),
    "weights_nested": (
        "def policy_weights(state):\n"
        "    return {'net': state['net'].state_dict()}\n",
        r"policy_weights must return a flat dict of torch\.Tensors by name \(a module's state_dict\(\); several merged "
        r"under prefixed names\), got a dict with 'net': a collections\.OrderedDict"),
    "weights_numpy": (
        "def policy_weights(state):\n"
        "    return {k: v.numpy() for k, v in state['net'].state_dict().items()}\n",
        r"policy_weights must return a flat dict of torch\.Tensors by name \(a module's state_dict\(\); several merged "
        r"under prefixed names\), got a dict with '0\.weight': a numpy\.ndarray of shape \(64, 4\)"),
    "learn_metrics_only": (
        "def learn(state, batch):\n"
        "    return guide_a2c.learn(state, batch)[0]\n",
        r"learn must return \(metrics, priorities\), a dict of numbers by name and a tensor \[B\] or None; it returned "
        r"a dict \(its metrics alone\? return \(metrics, None\)\)"),
    "learn_tensor_metric": (
        "def learn(state, batch):\n"
        "    metrics, _ = guide_a2c.learn(state, batch)\n"
        "    return {**metrics, 'values': torch.zeros(3)}, None\n",
        r"learn's metrics must be a dict of numbers by name \(each logged; a one-element tensor will do\), got a dict "
        r"with 'values': a torch\.Tensor of shape \(3,\)"),
    "state_not_a_dict": (
        "def state_dict(state):\n"
        "    return [state['net'].state_dict()]\n",
        r"state_dict must return a dict of tensors and plain containers \(a checkpoint is loaded with "
        r"weights_only=True\), got a list of 1: \(collections\.OrderedDict\)"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_fragment_that_returns_what_the_contract_does_not_is_refused_naming_it(a2c, tmp_path, broken):
    """Regression: act returning numpy was "'numpy.ndarray' object has no attribute 'numpy'" (the actor, the
    evaluator), actions [N, 1] an assertion inside CartPole, a nested or numpy policy_weights "'OrderedDict'
    object has no attribute 'detach'" (the learner), learn returning its metrics alone "'str' object has no
    attribute 'items'"."""
    from reactor._errors import raised_by_reactor

    code, message = BROKEN[broken]
    name = a2c(f"a2c_{broken}", code)
    with pytest.raises(ValueError, match=rf"^algorithm '{name}': {message}{CONTRACT}") as got:
        _train_on_policy(name, tmp_path / "run")
    assert raised_by_reactor(got.value)  # (a refusal: one line on the command line)


def test_an_off_policy_learns_priorities_must_be_one_tensor_per_item(beside, tmp_path):
    from reactor import run
    from reactor.nodes.training import off_policy_graph

    name = beside("linear_q_numpy_priorities", "from tests.nodes.linear_q import *  # noqa: F403\n"
                  "from tests.nodes import linear_q\n"
                  "def learn(state, batch):\n"
                  "    metrics, priorities = linear_q.learn(state, batch)\n"
                  "    return metrics, priorities.numpy()\n")
    with pytest.raises(ValueError, match=rf"^algorithm '{name}': learn's priorities must be None or a torch\.Tensor "
                                         rf"\[B\], one per item of the batch \(B = 32\), got a numpy\.ndarray of shape "
                                         rf"\(32,\){CONTRACT}"):
        run(off_policy_graph(algo=name, env="CartPole-v1", run_dir=str(tmp_path / "run"), actors=1, shards=1,
                             capacity=2000, min_size=64, batch_size=32, max_env_steps=400, live=False))


def test_a_trained_policys_act_is_checked_on_its_first_call(a2c, tmp_path, monkeypatch):
    import reactor

    name = a2c("a2c_for_policy", "")
    _train_on_policy(name, tmp_path / "run")
    module = sys.modules[name]
    good = module.act
    monkeypatch.setattr(module, "act", lambda *a, **k: (good(*a, **k)[0].numpy(), {}))
    policy = reactor.load_policy(tmp_path / "run")
    with pytest.raises(ValueError, match=rf"^algorithm '{name}': act must return its actions as a torch\.Tensor"):
        policy.act(np.zeros(4, np.float32))


LACKING = {
    "no_from_dict": (
        "class Config:\n"
        "    rollout_length = 16\n",
        r"its Config must be a class with a from_dict\(d\) classmethod \(reactor makes the Config from a dict of "
        r"settings\): add `@classmethod def from_dict\(cls, d\): return config_from_dict\(cls, d\)`, with `from "
        r"reactor\.algos import config_from_dict`"),
    "missing": (
        "del policy_weights, state_dict\n",
        r"lacks policy_weights, state_dict: every algorithm module defines KIND, Config, init, policy_weights, "
        r"make_policy, load_weights, act, learn, state_dict, load_state_dict \(and store, off-policy\)"),
    "kind": ("KIND = 'on-policy'\n", r"KIND must be 'off_policy' or 'on_policy', got 'on-policy'"),
    "actions": ("ACTIONS = 'Discrete'\n", r"ACTIONS must be 'discrete' or 'continuous' \(or left out\), got 'Discrete'"),
}


@pytest.mark.parametrize("key", sorted(LACKING))
def test_a_module_that_lacks_a_part_of_the_contract_is_refused_when_loaded(a2c, tmp_path, key):
    """Regression: a Config without from_dict was a bare AttributeError traceback when the graph was built."""
    code, message = LACKING[key]
    name = a2c(f"a2c_{key}", code)
    with pytest.raises(ValueError, match=rf"^algorithm '{name}' \({re.escape(str(tmp_path))}/{name}\.py\):? {message}"
                                         rf"{CONTRACT}"):
        load_algorithm(name)


def test_every_shipped_algorithm_keeps_the_contract():
    from reactor.algos import ALGORITHMS

    for name in ALGORITHMS:
        load_algorithm(name)


@pytest.mark.parametrize("length", [0, -5])
def test_an_on_policy_rollout_length_below_one_is_refused_naming_the_key(a2c, tmp_path, length):
    """Regression: rollout_length=0 or -5 in a custom on-policy algorithm's Config ran as 1 step a rollout,
    silently (the shipped PPO's Config refuses its own)."""
    from reactor.nodes.training import on_policy_graph

    name = a2c("a2c_rollouts", "")
    with pytest.raises(ValueError, match=rf"^algorithm '{name}': Config\.rollout_length must be an int >= 1 \(env "
                                         rf"steps per actor env per update\), got {re.escape(repr(length))}$"):
        on_policy_graph(algo=name, env="CartPole-v1", run_dir=str(tmp_path / "run"),
                        algo_config={"rollout_length": length})


def test_an_on_policy_config_without_rollout_length_and_a_builder_of_the_other_kind_are_refused(a2c, tmp_path):
    from reactor.nodes.training import off_policy_graph, on_policy_graph

    name = a2c("a2c_no_rollouts", "from dataclasses import dataclass\n"
                                  "from reactor.algos import config_from_dict\n"
                                  "@dataclass(frozen=True)\n"
                                  "class Config:\n"
                                  "    lr: float = 3e-3\n"
                                  "    from_dict = classmethod(config_from_dict)\n")
    with pytest.raises(ValueError, match=rf"^algorithm '{name}': an on-policy algorithm's Config has rollout_length"):
        on_policy_graph(algo=name, env="CartPole-v1", run_dir=str(tmp_path / "on"))
    with pytest.raises(ValueError, match=r"^off_policy_graph needs an off-policy algorithm; 'ppo' is 'on_policy' "
                                         r"\(use on_policy_graph\)$"):
        off_policy_graph(algo="ppo", env="CartPole-v1", run_dir=str(tmp_path / "off"))


# ------------------------------------------------------------------------------------- the env's spaces


class ImageEnv(gym.Env):
    """(8, 8, 3) image observations and two actions (never stepped here)."""

    observation_space = gym.spaces.Box(0, 255, (8, 8, 3), np.uint8)
    action_space = gym.spaces.Discrete(2)


@pytest.fixture
def image_env():
    gym.register("ReactorTestImages-v0", entry_point=ImageEnv)
    yield "ReactorTestImages-v0"
    gym.registry.pop("ReactorTestImages-v0")


def test_an_env_of_image_observations_is_refused_for_an_algorithm_of_flat_ones(image_env, a2c, tmp_path):
    """Regression: a Box of shape (8, 8, 3) was not refused although the guide says the observation must be
    a flat Box, and the run failed in the actors with "mat1 and mat2 shapes cannot be multiplied". An
    algorithm whose networks take that shape says so (OBSERVATIONS = "box") and is let through."""
    from reactor.nodes._registry import check_spaces
    from reactor.nodes.training import off_policy_graph, on_policy_graph

    with pytest.raises(ValueError, match=r"^dqn needs flat observations \(a Box of shape \(n,\)\), but env "
                                         r"'ReactorTestImages-v0' has Box\(0, 255, \(8, 8, 3\), uint8\); wrap the env "
                                         r"\(e\.g\. gymnasium\.wrappers\.FlattenObservation\) in a module that "
                                         r"registers it$"):
        off_policy_graph(algo="dqn", env=image_env, run_dir=str(tmp_path / "dqn"))
    name = a2c("a2c_flat", "")
    with pytest.raises(ValueError, match=rf"^{name} needs flat observations .* registers it; or, if the algorithm's "
                                         r"networks take that shape \(a CNN\), set OBSERVATIONS = 'box' in its module$"):
        on_policy_graph(algo=name, env=image_env, run_dir=str(tmp_path / "a2c"))
    cnn = load_algorithm(a2c("a2c_cnn", "OBSERVATIONS = 'box'\n"))
    env = ImageEnv()
    check_spaces("a2c_cnn", cnn, image_env, env.observation_space, env.action_space, cnn.Config())
