"""The standard apps take any env by id, with per-env presets, algorithm fields set directly, and
custom envs from a module (issue 19, "environments and presets").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reactor.launch._app import AppError, load_app, make_config
from reactor.nodes.presets import PRESETS

ROOT = Path(__file__).resolve().parents[2]
APPS = ROOT / "apps"


def _cli(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reactor.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


@pytest.mark.parametrize("app", ["dqn", "ppo", "sac", "td3", "ddpg", "transformer_dqn"])
def test_each_app_resolves_its_default_envs_preset(app):
    config = make_config(load_app(APPS / f"{app}.py"), {})
    preset = PRESETS[app][config.env]
    fields = {f for f in vars(config)}
    assert {k: getattr(config, k) for k in preset if k in fields} == {k: v for k, v in preset.items() if k in fields}
    assert config.algo_config == {k: v for k, v in preset.items() if k not in fields}
    assert config.target_return is not None  # every preset sets the env's target


def test_an_env_without_a_preset_runs_on_the_defaults_with_no_target():
    config = make_config(load_app(APPS / "dqn.py"), {"env": "Acrobot-v1"})
    assert (config.env, config.target_return, config.algo_config) == ("Acrobot-v1", None, {})


def test_algorithm_fields_are_set_directly_over_the_preset_and_algo_config():
    app = load_app(APPS / "dqn.py")
    config = make_config(app, {"lr": 5e-4, "algo_config": {"lr": 1.0, "n_step": 2}, "actors": 3})
    assert config.actors == 3
    assert config.algo_config == {**{k: v for k, v in PRESETS["dqn"]["CartPole-v1"].items() if k != "target_return"},
                                  "lr": 5e-4, "n_step": 2}


def test_an_unknown_key_lists_the_apps_and_the_algorithms_fields():
    with pytest.raises(AppError, match=r"^unknown config key 'lrr' \(did you mean 'lr'\?\); Config has: actors, "
                                       r"algo_config, .*; the algorithm 'dqn' has: double, dueling, .*\blr\b.*tau$"):
        make_config(load_app(APPS / "dqn.py"), {"lrr": 1})


@pytest.mark.parametrize(("key", "meant"), [("lrr", "lr"), ("gama", "gamma"), ("devise", "device"),
                                            ("max_env_step", "max_env_steps"), ("nosuch", None)])
def test_a_misspelt_key_suggests_the_closest_of_the_apps_or_the_algorithms_fields(key, meant):
    """`--set lrr=1` listed 40 keys and left the user to spot `lr` among them."""
    with pytest.raises(AppError) as e:
        make_config(load_app(APPS / "dqn.py"), {key: 1})
    said = f"unknown config key {key!r} (did you mean {meant!r}?); " if meant else f"unknown config key {key!r}; "
    assert str(e.value).startswith(said), str(e.value)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"lr": float("inf")}, r"^config key 'lr' is inf; config values must be finite numbers$"),
    ({"target_return": float("-inf")}, r"^config key 'target_return' is -inf; "),
    ({"max_env_steps": float("nan")}, r"^config key 'max_env_steps' is nan; "),
    ({"algo_config": {"gamma": float("nan")}}, r"^config key 'algo_config' has a NaN or an infinity at \['gamma'\]; "),
])
def test_a_nan_or_an_infinity_in_a_config_is_refused_naming_its_key(overrides, message):
    """`--set lr=1e999` (inf) trained a NaN network to the run's end, its replay shards logging a refused
    priority update for every batch; `target_return=-1e999` stopped at the first evaluation."""
    with pytest.raises(AppError, match=message):
        make_config(load_app(APPS / "dqn.py"), overrides)


@pytest.mark.parametrize(("app", "overrides", "message"), [
    ("dqn", {"actors": 0}, r"^config key 'actors' must be >= 1, got 0$"),
    ("dqn", {"shards": 0}, r"^config key 'shards' must be >= 1, got 0$"),
    ("dqn", {"capacity": 10}, r"^config key 'capacity' must be >= 1000, got 10 \(min_size, the steps stored before "
                              r"learning starts, is 1000\)$"),
    ("dqn", {"min_size": -1}, r"^config key 'min_size' must be >= 0, got -1$"),
    ("dqn", {"max_env_steps": -10}, r"^config key 'max_env_steps' must be >= 1, got -10$"),
    ("dqn", {"checkpoint_every": -5}, r"^config key 'checkpoint_every' must be >= 0, got -5$"),
    ("ppo", {"actors": 0}, r"^config key 'actors' must be >= 1, got 0$"),
    ("transformer_offline", {"updates": 0}, r"^config key 'updates' must be >= 1, got 0$"),
])
def test_an_app_config_value_out_of_its_range_is_one_line_naming_the_key(app, overrides, message):
    """`--set actors=0` (or shards=0) was a ZeroDivisionError traceback; `capacity=10` under min_size=1000
    ran to its end with every insert refused and nothing learned."""
    with pytest.raises(ValueError, match=message):
        make_config(load_app(APPS / f"{app}.py"), overrides)


@pytest.mark.parametrize(("app", "overrides", "message"), [
    # Was "error_buffer must be >= max(1, samples_per_insert) = 1, got -134.0": a value made of it, not it.
    ("sac", {"samples_per_insert": -1}, r"^off_policy_graph: samples_per_insert must be a number > 0 and finite, "
                                        r"got -1\.0$"),
    # A negative max_grad_norm was taken as 0 ("no clipping") in silence by DQN; PPO refused it.
    ("dqn", {"max_grad_norm": -1}, r"^dqn Config\.max_grad_norm must be >= 0 and finite \(0: off\), got -1\.0$"),
    ("transformer_dqn", {"max_grad_norm": -1}, r"^transformer_dqn Config\.max_grad_norm must be >= 0 and finite"),
    # Was a traceback at the first update ("replay shard 0 refused a request: ... sample size n=51593959 is out of
    # range"), naming no setting (session 56).
    ("dqn", {"batch_size": 10**8}, r"^config key 'batch_size' is 100,000,000: a shard of 25,000 steps \(capacity "
                                   r"50,000 over 2 shard\(s\)\) serves at most 1,600,000 items a sample"),
    # Was a fresh run in a new directory, with nothing to resume and no word of it.
    ("dqn", {"resume": True}, r"^resume=True needs run_dir: the directory of the run to resume"),
    # Was "[Errno 17] File exists: 'README.md'", from deep in a reactor's startup.
    ("dqn", {"run_dir": str(ROOT / "README.md")}, r"^run_dir '.*README\.md' is a file, not a directory: give a new "
                                                  r"path, or an earlier run's directory to resume it$"),
])
def test_a_value_the_graph_builder_or_an_algorithm_refuses_is_named_as_given(app, overrides, message):
    from reactor.launch._app import build_graph

    with pytest.raises(ValueError, match=message):
        build_graph(APPS / f"{app}.py", overrides)


def test_a_capacity_too_small_for_an_actors_largest_insert_is_one_line_naming_the_bound():
    """`--set capacity=200 shards=2 min_size=50` ran, each shard (100 steps) refusing every message
    larger than itself, logged and dropped (an error line a few times a second). Now the graph is not
    built: the message names the per-shard steps, the largest insert (flush_steps, one episode chunk of
    256 anchors, their 3-step context and the final row per env) and the capacity that holds it; that
    capacity itself runs."""
    p = _cli("run", str(APPS / "dqn.py"), "--set", "capacity=200", "shards=2", "min_size=50")
    assert p.returncode == 2 and p.stderr == (
        "reactor: config key 'capacity' is 200 over 2 shard(s): 100 steps a shard, below the largest insert an "
        "actor sends (587 rows: up to flush_steps=64 pending, plus an episode chunk of up to 262 rows from each of "
        "its 2 env(s)), which a shard would refuse; set capacity >= 1174\n")
    from reactor.launch._app import build_graph

    assert build_graph(str(APPS / "dqn.py"), {"capacity": 1174, "shards": 2, "min_size": 50, "live": False})


def test_an_optional_config_value_of_another_type_is_refused():
    """`target_return='high'` (a float | None field) got through, and failed the run at its first
    evaluation with a TypeError traceback."""
    app = load_app(APPS / "dqn.py")
    with pytest.raises(AppError, match=r"^config key 'target_return' expects float or None, got 'high'$"):
        make_config(app, {"target_return": "high"})
    taken = make_config(app, {"target_return": 400}).target_return
    assert type(taken) is float and taken == 400.0  # (an int is taken as a float, as for a float field)
    assert make_config(app, {"target_return": None}).target_return is None


def test_a_config_without_a_dataclass_takes_what_its_app_takes():
    """An app whose config is a dict (a @graph_builder's arguments travel this way: a rate limiter's
    bound may be infinite) gets its values as given."""
    module = load_app(ROOT / "reactor" / "launch" / "_builder_app.py")
    config = {"builder": "m:f", "arguments": {"max_diff": float("inf")}}
    assert make_config(module, config) == config


def test_an_int_too_large_for_a_float_field_is_a_one_line_error():
    with pytest.raises(AppError, match=r"^config key 'samples_per_insert' expects float, got an int of 1329 bits, too large for one"):
        make_config(load_app(APPS / "dqn.py"), {"samples_per_insert": 10**400})
    from reactor.algos import dqn

    with pytest.raises(ValueError, match=r"^Config\.lr expects a float, got an int of 1329 bits, too large for one"):
        dqn.Config.from_dict({"lr": 10**400})


def test_an_algorithms_config_refuses_a_nan_or_an_infinity_naming_the_field():
    from reactor.algos import dqn, sac

    with pytest.raises(ValueError, match=r"^Config\.lr expects finite numbers, got nan$"):
        dqn.Config.from_dict({"lr": float("nan")})
    with pytest.raises(ValueError, match=r"^Config\.lr expects finite numbers, got np\.float64\(nan\)$"):
        dqn.Config.from_dict({"lr": np.float64("nan")})  # (a float's subclass)
    with pytest.raises(ValueError, match=r"^Config\.hidden expects finite numbers, got \(256, inf\)$"):
        sac.Config.from_dict({"hidden": (256, float("inf"))})
    assert dqn.Config.from_dict({"lr": 1e-3, "gamma": 1}).gamma == 1.0


@pytest.mark.parametrize(("app", "env", "message"), [
    ("dqn.py", "Pendulum-v1", "reactor: dqn needs a discrete action space, but env 'Pendulum-v1' has "
                              "Box(-2.0, 2.0, (1,), float32) (continuous); for continuous actions use sac, td3 or ddpg\n"),
    ("sac.py", "CartPole-v1", "reactor: sac needs a continuous action space, but env 'CartPole-v1' has Discrete(2) "
                              "(discrete); for discrete actions use dqn, ppo or transformer_dqn\n"),
    ("ppo.py", "MountainCarContinuous-v0", "reactor: ppo needs a discrete action space, but env "
                                           "'MountainCarContinuous-v0' has Box(-1.0, 1.0, (1,), float32) (continuous); "
                                           "for continuous actions use sac, td3 or ddpg\n"),
])
def test_an_env_of_the_wrong_kind_is_refused_naming_its_action_space(app, env, message):
    p = _cli("run", str(APPS / app), "--set", f"env={env}")
    assert (p.returncode, p.stderr) == (2, message)


def test_an_unknown_env_or_an_unimportable_module_is_one_line():
    p = _cli("run", str(APPS / "dqn.py"), "--set", "env=CartPol-v1")
    assert p.returncode == 2 and p.stderr.startswith("reactor: env 'CartPol-v1': Environment `CartPol` doesn't exist.")
    p = _cli("run", str(APPS / "dqn.py"), "--set", "env=no_such_module:X-v0")
    assert p.returncode == 2 and p.stderr.startswith("reactor: env 'no_such_module:X-v0': its module does not import")


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~10-30 s on a 2-core machine
def test_a_custom_env_from_a_module_beside_the_app_trains_under_actors(tmp_path):
    """The env is defined in a test module (tests/apps/chain_env.py) that sits beside the app file: every
    worker process imports it (gymnasium's ``module:Id``) from the app's directory."""
    shutil.copy(APPS / "dqn.py", tmp_path / "dqn.py")
    shutil.copy(ROOT / "tests" / "apps" / "chain_env.py", tmp_path / "chain_env.py")
    p = _cli("run", "dqn.py", "--placement", "actors", "--json", "--set", "env=chain_env:ReactorChain-v0",
             "max_env_steps=6000", "min_size=200", "eval_every_updates=50", "target_return=1.0", "eps_decay_steps=800",
             "live=False", "run_dir=run", cwd=tmp_path, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)
    assert result["stopped_by"] == "request"  # the evaluation reached 1.0: walking right every step
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["best_eval_return"] == 1.0
    assert json.loads((tmp_path / "run" / "config.json").read_text())["env"] == "chain_env:ReactorChain-v0"
    # In a fresh process elsewhere: config.json's app_dirs make chain_env importable for load_policy.
    code = "import sys, reactor; print(int(reactor.load_policy(sys.argv[1]).act([1, 0, 0, 0, 0, 0])))"
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "1"  # right, from the first cell


def test_an_apps_own_algo_config_default_stays_under_the_preset_and_the_users_keys(tmp_path):
    app = tmp_path / "tuned.py"
    app.write_text(
        "from dataclasses import dataclass, field\n"
        "from reactor.nodes.apps import OffPolicyAppConfig, off_policy_app_graph\n"
        "ALGO = 'dqn'\n"
        "PRESETS = {'CartPole-v1': {'lr': 1e-3, 'target_return': 400.0}}\n"
        "@dataclass(frozen=True)\n"
        "class Config(OffPolicyAppConfig):\n"
        "    env: str = 'CartPole-v1'\n"
        "    algo_config: dict = field(default_factory=lambda: {'hidden': 32, 'lr': 0.5})\n"
        "def build(config):\n"
        "    return off_policy_app_graph(config, algo=ALGO, name='tuned', title='T')\n")
    module = load_app(app)
    assert make_config(module, {}).algo_config == {"hidden": 32, "lr": 1e-3}  # the preset over the app's own
    assert make_config(module, {"n_step": 2}).algo_config == {"hidden": 32, "lr": 1e-3, "n_step": 2}
    assert make_config(module, {"env": "Acrobot-v1"}).algo_config == {"hidden": 32, "lr": 0.5}


@pytest.mark.parametrize(("item", "message"), [
    ("lr=nan", r"^config key 'lr' is nan; config values must be finite numbers$"),
    ("lr=-Infinity", r"^config key 'lr' is -inf; config values must be finite numbers$"),
    ("target_return=INF", r"^config key 'target_return' is inf; config values must be finite numbers$"),
    ("live=true", r"^config key 'live' expects bool, got 'true' \(write True: Python's spelling\)$"),
    ("target_return=none", r"^config key 'target_return' expects float or None, got 'none' \(write None: "
                           r"Python's spelling\)$"),
    ("seed=3", r"^'seed' is not a config key but an option of reactor run: --seed 3 \(from Python, "
               r"reactor\.run\(\.\.\., seed=\.\.\.\)\)$"),
])
def test_a_set_value_of_another_spelling_or_a_run_option_is_refused_saying_what_to_write(item, message):
    """Regression (a newcomer's pass over the guide): --set lr=nan said "expects float, got 'nan'" while
    lr=1e999 said it was not finite; live=true was refused with no hint; seed=3 listed the config's keys,
    not --seed."""
    from reactor.launch._app import parse_overrides

    with pytest.raises(AppError, match=message):
        make_config(load_app(APPS / "dqn.py"), parse_overrides([item]))


def test_an_algorithms_bool_given_as_true_says_to_write_true():
    from reactor.algos import dqn

    with pytest.raises(ValueError, match=r"^Config\.dueling expects bool, got 'false' \(write False: Python's "
                                         r"spelling\)$"):
        dqn.Config.from_dict({"dueling": "false"})


def test_an_app_tuple_field_takes_a_list_as_an_algorithms_config_does(tmp_path):
    """Regression: an app's tuple field given [3, 4] was refused ("expects tuple"), while an algorithm's
    Config takes a list for its tuples (JSON, which carries configs to the workers, has none)."""
    app = tmp_path / "tuples.py"
    app.write_text(
        "from dataclasses import dataclass\n"
        "@dataclass(frozen=True)\n"
        "class Config:\n"
        "    sizes: tuple[int, ...] = (1, 2)\n"
        "    pair: tuple = (0, 0)\n"
        "    maybe: tuple[int, int] | None = None\n"
        "def build(config):\n"
        "    raise AssertionError\n")
    module = load_app(app)
    config = make_config(module, {"sizes": [3, 4], "pair": [5, 6], "maybe": [7, 8]})
    assert (config.sizes, config.pair, config.maybe) == ((3, 4), (5, 6), (7, 8))
    with pytest.raises(AppError, match=r"^config key 'sizes' expects tuple, got 'x'$"):
        make_config(module, {"sizes": "x"})


@pytest.mark.parametrize("app", ["dqn", "sac", "transformer_dqn"])
def test_an_off_policy_apps_evaluations_take_eval_episodes(app):
    """`--set eval_episodes=N` was an unknown key for the off-policy apps (a newcomer's pass, session 56),
    though their graph builder takes it and the on-policy and offline apps had it."""
    from reactor.launch._app import build_graph

    assert build_graph(APPS / f"{app}.py", {}).nodes["evaluator"].prototype.episodes == 10
    assert build_graph(APPS / f"{app}.py", {"eval_episodes": 3}).nodes["evaluator"].prototype.episodes == 3
    with pytest.raises(ValueError, match=r"^config key 'eval_episodes' must be >= 1, got 0$"):
        make_config(load_app(APPS / f"{app}.py"), {"eval_episodes": 0})
