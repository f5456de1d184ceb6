"""Trained policies: every algorithm's app trains briefly, and its run directory alone rebuilds the policy.

``reactor.load_policy(run_dir)`` in a fresh process must hold the learner's final weights (the hash the
learner wrote at its end) and act as the algorithm's own fragments do with those weights; ``reactor
eval`` plays it and records videos. Issue 19 ("trained policies").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import reactor
from reactor import run
from reactor.launch._app import build_graph
from reactor.nodes._registry import load_algorithm, make_env

ROOT = Path(__file__).resolve().parents[2]

#: Each app with a budget that trains a few hundred updates (no target: the budget ends the run).
BRIEF = {
    "dqn.py": {"max_env_steps": 800, "min_size": 200},
    "ppo.py": {"max_env_steps": 512},
    "sac.py": {"max_env_steps": 700},
    "td3.py": {"max_env_steps": 700},
    "ddpg.py": {"max_env_steps": 700},
    # (samples_per_insert 16, the app's default, trained 1,173 updates in 300 steps: 23 s against 3 s)
    "transformer_dqn.py": {"max_env_steps": 300, "min_size": 200, "samples_per_insert": 2.0},
}

#: In a fresh process: load the policy, act greedily on the observations, print hash and actions.
FRESH = """
import json, sys, numpy as np, reactor
p = reactor.load_policy(sys.argv[1])
obs = np.load(sys.argv[2])
print(json.dumps({"sha": p.weights_sha256, "updates": p.updates, "actions": p.act(obs).tolist(),
                  "single": np.asarray(p.act(obs[0])).tolist()}))
"""


def _train(run_dir: Path, app: str) -> None:
    config = {**BRIEF[app], "run_dir": str(run_dir), "target_return": None, "live": False, "eval_every_updates": 10**6}
    run(build_graph(str(ROOT / "apps" / app), config))


def _fragments_act(run_dir: Path, obs: np.ndarray) -> np.ndarray:
    """Greedy actions from the algorithm's fragments with learner.pt's weights (not through load_policy)."""
    record = json.loads((run_dir / "config.json").read_text())
    algo = load_algorithm(record["algo"])
    config = algo.Config.from_dict(record["algo_config"])  # JSON's lists become the Config's tuples
    env = make_env(record["env"])
    state = algo.init(env.observation_space, env.action_space, config, 0)
    algo.load_state_dict(state, torch.load(run_dir / "learner.pt", weights_only=True)["algo"])
    policy = algo.make_policy(env.observation_space, env.action_space, config)
    algo.load_weights(policy, {k: v.detach().clone() for k, v in algo.policy_weights(state).items()})
    with torch.no_grad():
        action, _ = algo.act(policy, torch.as_tensor(obs), 10**12, torch.Generator().manual_seed(0), greedy=True)
    return action.numpy()


@pytest.mark.timeout(240)  # ~10-25 s each on a 2-core machine
@pytest.mark.parametrize("app", sorted(BRIEF))
def test_a_fresh_process_loads_the_learners_final_policy(tmp_path, app):
    run_dir = tmp_path / "run"
    _train(run_dir, app)
    record = json.loads((run_dir / "config.json").read_text())
    assert record["algo"] == app.removesuffix(".py") and record["app_config"]["max_env_steps"] == BRIEF[app]["max_env_steps"]
    space = make_env(record["env"]).observation_space
    space.seed(7)
    obs = np.stack([space.sample() for _ in range(16)]).astype(np.float32)
    np.save(tmp_path / "obs.npy", obs)
    p = subprocess.run([sys.executable, "-c", FRESH, str(run_dir), str(tmp_path / "obs.npy")], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["sha"] == (run_dir / "weights.sha256").read_text().strip()  # the learner's final weights
    assert got["updates"] > 0
    expected = _fragments_act(run_dir, obs)
    np.testing.assert_array_equal(np.asarray(got["actions"], dtype=expected.dtype), expected)
    if app != "transformer_dqn.py":  # memoryless: a single observation acts as its row of the batch
        single = np.asarray(got["single"], dtype=expected.dtype)
        if expected.dtype.kind == "f":  # a batch of 1 and a row of 16 may take different BLAS kernels:
            np.testing.assert_allclose(single, expected[0], rtol=1e-5, atol=1e-6)  # last bits (seen: 1 ulp)
        else:
            np.testing.assert_array_equal(single, expected[0])


@pytest.fixture(scope="module")
def dqn_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("policy") / "dqn"
    _train(run_dir, "dqn.py")
    return run_dir


def test_act_takes_single_or_batched_numpy_or_torch_and_returns_the_same_kind(dqn_run):
    p = reactor.load_policy(dqn_run)
    obs = np.zeros((3, 4), dtype=np.float64)
    batched = p.act(obs)
    assert isinstance(batched, np.ndarray) and batched.shape == (3,)
    assert isinstance(p.act(torch.zeros(2, 4)), torch.Tensor)
    assert np.asarray(p.act(obs[0])).shape == ()
    assert np.asarray(p.act([0.0, 0.0, 0.0, 0.0], deterministic=False)).shape == ()
    with pytest.raises(ValueError, match=r"^dqn policy for CartPole-v1: observation of shape \(5,\); expected \(4,\)"):
        p.act(np.zeros(5))


def test_load_policy_names_what_is_missing_or_wrong(tmp_path, dqn_run):
    with pytest.raises(FileNotFoundError, match="no run directory at"):
        reactor.load_policy(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        reactor.load_policy(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not a JSON document"):
        reactor.load_policy(bad)
    (bad / "config.json").write_text(json.dumps({"format": 1, "algo": "dqn"}))
    with pytest.raises(ValueError, match="not a learner's config.json"):
        reactor.load_policy(bad)
    (bad / "config.json").write_text((dqn_run / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no weights \(learner.pt\)"):
        reactor.load_policy(bad)
    # Weights changed after they were saved (bit flips in a tensor loaded silently, and acted) ...
    saved = torch.load(dqn_run / "learner.pt", weights_only=True)
    assert isinstance(saved["weights_sha256"], str)
    q = saved["algo"]["q"]
    name = next(iter(q))
    q[name] = q[name].clone()
    q[name].view(-1)[0] += 1.0
    torch.save(saved, bad / "learner.pt")
    with pytest.raises(ValueError, match=rf"^{bad / 'learner.pt'}: its weights do not match the sha256 saved with "
                                         rf"them \(.*\): the file was damaged$"):
        reactor.load_policy(bad)
    # ... and so did the rest of its state: a NaN in the target network trained on to nothing.
    saved = torch.load(dqn_run / "learner.pt", weights_only=True)
    assert isinstance(saved["state_sha256"], str)
    target = saved["algo"]["target"]
    name = next(iter(target))
    target[name] = target[name].clone()
    target[name].view(-1)[0] = float("nan")
    torch.save(saved, bad / "learner.pt")
    with pytest.raises(ValueError, match=r"its state \(target networks, optimizer\) does not match the sha256 saved "
                                         r"with it \(.*\): the file was damaged$"):
        reactor.load_policy(bad)
    # Another algorithm's checkpoint: the error was the bare key ("'q'").
    saved = torch.load(dqn_run / "learner.pt", weights_only=True)
    saved["algo"] = {("actor" if k == "q" else k): v for k, v in saved["algo"].items()}
    torch.save(saved, bad / "learner.pt")
    with pytest.raises(ValueError, match=r"learner\.pt: it holds no 'q' \(a checkpoint of another algorithm\?\)$"):
        reactor.load_policy(bad)
    # ... and a config.json that describes another network: one line, not a traceback
    shutil.copy(dqn_run / "learner.pt", bad / "learner.pt")
    config = json.loads((dqn_run / "config.json").read_text())
    config["algo_config"]["hidden"] = 32
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{bad / 'learner.pt'}: Error\(s\) in loading state_dict .* size mismatch"):
        reactor.load_policy(bad)


def test_a_custom_module_from_an_app_directory_not_on_this_machine_is_named_where_it_was(tmp_path, dqn_run):
    """Regression (a newcomer's pass over the guide, section 5): a run of a custom algorithm or env,
    loaded where the directory of the app that trained it is not (the run directory copied to another
    machine), was refused "no module of that name imports here (beside the app file, installed, or on
    PYTHONPATH)", naming no place; config.json records the directory, and the refusal now names it."""
    gone = tmp_path / "my-project"
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(dqn_run / "learner.pt", moved / "learner.pt")
    config = json.loads((dqn_run / "config.json").read_text())
    for algo, env, first in (("h25_my_a2c", config["env"], "unknown algorithm 'h25_my_a2c'"),
                             (config["algo"], "h25_my_envs:MyChain-v0", "env 'h25_my_envs:MyChain-v0'")):
        (moved / "config.json").write_text(json.dumps({**config, "algo": algo, "env": env, "app_dirs": [str(gone)]}))
        with pytest.raises(ValueError) as e:
            reactor.load_policy(moved)
        message = str(e.value)
        assert message.startswith(first) and message.endswith(
            f"; the directory of the app that trained it, {gone} (config.json's app_dirs), is not on this machine: "
            f"copy its modules there, install them, or put them on PYTHONPATH"), message


def test_reactor_eval_prints_mean_and_std_and_records_videos(tmp_path, dqn_run):
    cmd = [sys.executable, "-m", "reactor.cli", "eval", str(dqn_run), "--episodes", "2", "--video", str(tmp_path / "v"),
           "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    assert got["episodes"] == 2 and len(got["returns"]) == 2 and got["mean"] == pytest.approx(np.mean(got["returns"]))
    videos = sorted((tmp_path / "v").glob("*.mp4"))
    assert [v.name for v in videos] == ["dqn-CartPole-v1-episode-0.mp4", "dqn-CartPole-v1-episode-1.mp4"]
    assert all(v.stat().st_size > 1000 for v in videos)
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "eval", str(dqn_run), "--episodes", "3"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("dqn on CartPole-v1 (") and " ± " in p.stdout and "over 3 episodes" in p.stdout
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "eval", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.startswith(f"reactor: {tmp_path}: no config.json")


def test_an_evaluation_of_more_episodes_than_its_bound_is_refused_naming_it(dqn_run):
    """A careless user's pass: ``reactor eval RUN --episodes 100000000000000000000`` was taken and played
    for good. The command refuses it in one line, and so does the API (``evaluate_policy``)."""
    for n in ("100000000000000000000", "1000001", "0", "-3"):
        p = subprocess.run([sys.executable, "-m", "reactor.cli", "eval", str(dqn_run), "--episodes", n],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 2, p.stderr[-2000:]
        assert p.stderr.splitlines()[-1] == (f"reactor eval: error: argument --episodes: a number of episodes in "
                                             f"[1, 1,000,000] expected, got {n!r}"), p.stderr
    from reactor.nodes._policy import evaluate_policy

    with pytest.raises(ValueError, match=r"^episodes must be in \[1, 1,000,000\], got 10000000000$"):
        evaluate_policy(reactor.load_policy(dqn_run), 10**10)


def test_an_evaluation_episode_that_never_ends_is_cut_and_said(caplog):
    """An env with no terminal state and no max_episode_steps held the evaluator for good (a newcomer's
    pass, session 55): an evaluation episode is cut after max_steps, its return so far counted."""
    import logging

    import gymnasium as gym
    import numpy as np

    from reactor.algos import dqn
    from reactor.nodes.evaluator import evaluate

    class NoEnd(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            return np.zeros(4, np.float32), {}

        def step(self, action):
            return np.zeros(4, np.float32), 1.0, False, False, {}

    env = gym.vector.SyncVectorEnv([NoEnd, NoEnd])
    policy = dqn.make_policy(env.single_observation_space, env.single_action_space, dqn.Config())
    with caplog.at_level(logging.WARNING, logger="reactor.evaluator"):
        returns = evaluate(dqn, policy, env, 2, seed=0, max_steps=50)
    assert returns.tolist() == [50.0, 50.0]
    assert any("2 of 2 evaluation episode(s) ran 50 steps without ending" in m for m in caplog.messages)


def test_more_episodes_than_envs_run_in_rounds_each_with_its_own_seed():
    """Regression (a newcomer's pass): ``reactor eval RUN --episodes 100000`` made 100,000 envs side by
    side (2.8 GB and climbing, no step in minutes, for CartPoleNoVel). An evaluation now steps at most
    ``EVAL_WIDTH`` envs, in rounds; episode i is reset with seed + i as before."""
    import gymnasium as gym

    from reactor.algos import dqn
    from reactor.nodes.evaluator import evaluate

    class SeedReward(gym.Env):  # one step, whose reward is the seed the episode was reset with
        observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            self.seed_given = seed
            return np.zeros(4, np.float32), {}

        def step(self, action):
            return np.zeros(4, np.float32), float(self.seed_given), True, False, {}

    env = gym.vector.SyncVectorEnv([SeedReward, SeedReward])
    policy = dqn.make_policy(env.single_observation_space, env.single_action_space, dqn.Config())
    assert evaluate(dqn, policy, env, 5, seed=10).tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert evaluate(dqn, policy, env, 2, seed=3).tolist() == [3.0, 4.0]


def test_reactor_eval_of_more_episodes_than_one_round_steps_at_most_eval_width_envs(dqn_run, monkeypatch):
    """The same regression, through load_policy: 70 episodes are two rounds of a 64-env vector env (the
    real one, its width noted on the way), and their first 64 returns are those of a 64-episode evaluation."""
    from reactor.nodes import _registry
    from reactor.nodes._policy import evaluate_policy
    from reactor.nodes.evaluator import EVAL_WIDTH

    widths, real = [], _registry.make_vector_env
    monkeypatch.setattr(_registry, "make_vector_env", lambda name, n: widths.append(n) or real(name, n))
    policy = reactor.load_policy(dqn_run)
    many = evaluate_policy(policy, EVAL_WIDTH + 6)
    assert widths == [EVAL_WIDTH] and many.shape == (EVAL_WIDTH + 6,)
    np.testing.assert_array_equal(many[:EVAL_WIDTH], evaluate_policy(policy, EVAL_WIDTH))


def test_a_state_learner_pt_could_not_give_back_is_refused_at_the_learners_start():
    """An algorithm whose state_dict held a Config saved learner.pt without complaint; eval, load_policy
    and a resume then failed in torch's cut-off words (a newcomer's pass, session 55)."""
    import types

    import pytest
    import torch

    from reactor.algos import dqn
    from reactor.nodes._contract import check_state_dict

    mine = types.ModuleType("mine")
    with pytest.raises(ValueError, match=r"^algorithm 'mine': state_dict holds a reactor\.algos\.dqn\.Config at "
                                         r"\['cfg'\]: learner\.pt holds tensors, numbers, strings"):
        check_state_dict(mine, {"q": {"w": torch.zeros(2)}, "cfg": dqn.Config()})
    with pytest.raises(ValueError, match=r"^algorithm 'mine': state_dict holds the key \(1, 2\) \(tuple\) at \['q'\]"):
        check_state_dict(mine, {"q": {(1, 2): torch.zeros(2)}})
    check_state_dict(mine, {"a": [1, 2.0, "x", None, (torch.ones(1),)], 3: True})


def test_a_video_without_moviepy_says_how_to_install_it_from_the_checkout(tmp_path, dqn_run, monkeypatch):
    """Regression (a newcomer's walk): the hint said ``pip install 'reactor[video]'``, which asks PyPI for
    a project named reactor (not this one, which is installed from its checkout)."""
    from reactor.nodes._policy import evaluate_policy

    monkeypatch.setitem(sys.modules, "moviepy", None)  # (its import raises ImportError)
    with pytest.raises(ValueError, match=r"^--video needs moviepy and pygame \(.*\): in reactor's checkout, "
                                         r"pip install -e '\.\[video\]' \(or pip install moviepy pygame\)$"):
        evaluate_policy(reactor.load_policy(dqn_run), 1, video_dir=tmp_path / "v")
    assert not (tmp_path / "v").exists()


def test_reactor_eval_video_of_an_env_that_renders_no_frames_is_one_line(tmp_path, monkeypatch):
    """Regression (a newcomer's pass over the guide, section 5): ``reactor eval RUN --video DIR`` on the
    guide's own kind of env (a Chain with no render support) ended in ~40 lines of traceback ending
    "TypeError: Chain() takes no arguments ... render_mode='rgb_array'"."""
    import os
    import re

    from reactor.nodes.training import on_policy_graph

    guide = (ROOT / "docs" / "guide.md").read_text()
    a2c = re.search(r"```python\n# my_a2c\.py\n(.*?)```", guide, re.S)
    assert a2c is not None
    (tmp_path / "video_a2c.py").write_text(a2c.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = "tests.apps.chain_env:ReactorChain-v0"
    run_dir = tmp_path / "run"
    run(on_policy_graph(algo="video_a2c", env=env, run_dir=str(run_dir), actors=1, envs_per_actor=2,
                        eval_episodes=2, max_env_steps=64, live=False))
    sys.modules.pop("video_a2c", None)
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "eval", str(run_dir), "--episodes", "1", "--video",
                        str(tmp_path / "v")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert (p.returncode, p.stderr) == (2, f"reactor: env {env!r} cannot record video: --video needs an env that "
                                           f"renders frames, made with render_mode=\"rgb_array\" (its "
                                           f"metadata[\"render_modes\"] lists it, and render() returns the frame); "
                                           f"this one's render_modes are []\n")
    assert not (tmp_path / "v").exists()
