"""PPO (``reactor.algos.ppo``): advantages, acting, config, state, and learning CartPole end to end.

The unit tests drive the fragments directly on tensors; the learning tests run the real app
(``apps/ppo.py``: 2 actors of 4 envs each, the rollout learner, the evaluator) on the real
``CartPole-v1``, seeded, under ``single`` and under ``actors`` (real actor processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from reactor import run
from reactor.algos import ppo
from reactor.launch._app import build_graph
from tests.learning import first_seed_passing

APP = str(Path(__file__).resolve().parents[2] / "apps" / "ppo.py")
OBS = gym.spaces.Box(-5.0, 5.0, (4,), dtype=np.float32)
ACT = gym.spaces.Discrete(2)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the nodes run (the machine is shared; threads only contend here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rollout(policy: ppo.Policy, t: int = 6, n: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """A ``[t, n]`` rollout acted by ``policy``, with a termination and a truncation in it."""
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(t, n, 4, generator=g)
    action, extras = ppo.act(policy, obs.reshape(-1, 4), 0, g)
    batch = {
        "obs": obs,
        "action": action.reshape(t, n),
        "reward": torch.ones(t, n),
        "terminated": torch.zeros(t, n, dtype=torch.bool),
        "truncated": torch.zeros(t, n, dtype=torch.bool),
        "logp": extras["logp"].reshape(t, n),
        "value": extras["value"].reshape(t, n),
        "final_obs": torch.zeros(t, n, 4),
        "last_obs": torch.randn(n, 4, generator=g),
    }
    batch["terminated"][2, 0] = True
    batch["truncated"][3, 1] = True
    batch["final_obs"][2, 0] = torch.randn(4, generator=g)
    batch["final_obs"][3, 1] = torch.randn(4, generator=g)
    return batch


# ------------------------------------------------------------------------------------------- advantages


def test_gae_matches_a_hand_computed_rollout_with_a_truncation_and_a_termination():
    """gamma = lambda = 0.5. Env 0 is truncated at t=1 and bootstraps from V(final obs) = 10; env 1
    terminates at t=0 (its V(final obs) = 7 must not count). By hand:

    env 0: delta = [1 + .5*2 - 1, 1 + .5*10 - 2, 1 + .5*4 - 3] = [1, 4, 0];
           A2 = 0, A1 = 4 (the episode ended: no A2 term), A0 = 1 + .25*4 = 2.
    env 1: delta = [1 - .5, 0 + .5*1 - 1, 2 + .5*2 - 1] = [.5, -.5, 2];
           A2 = 2, A1 = -.5 + .25*2 = 0, A0 = .5 (ended).
    """
    reward = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 2.0]])
    value = torch.tensor([[1.0, 0.5], [2.0, 1.0], [3.0, 1.0]])
    next_value = torch.tensor([[2.0, 7.0], [10.0, 1.0], [4.0, 2.0]])
    terminated = torch.tensor([[False, True], [False, False], [False, False]])
    truncated = torch.tensor([[False, False], [True, False], [False, False]])
    adv = ppo.gae(reward, value, next_value, terminated, terminated | truncated, 0.5, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[2.0, 0.5], [4.0, 0.0], [0.0, 2.0]]), rtol=0, atol=1e-6)


def test_gae_with_lambda_one_is_the_discounted_return_minus_the_value():
    g = torch.Generator().manual_seed(1)
    reward, value = torch.rand(5, 2, generator=g), torch.rand(5, 2, generator=g)
    never = torch.zeros(5, 2, dtype=torch.bool)
    next_value = torch.cat([value[1:], torch.zeros(1, 2)])
    adv = ppo.gae(reward, value, next_value, never, never, 0.9, 1.0)
    ret = torch.zeros(2)
    for t in range(4, -1, -1):
        ret = reward[t] + 0.9 * ret
        torch.testing.assert_close(adv[t] + value[t], ret)


def test_a_truncated_step_bootstraps_from_its_final_observation_and_a_terminated_one_does_not():
    policy = ppo.make_policy(OBS, ACT, ppo.Config())
    batch = _rollout(policy)
    config = ppo.Config(gamma=0.9, gae_lambda=0.8)
    adv, ret = ppo.advantages(policy, batch, config)
    torch.testing.assert_close(ret, adv + batch["value"])

    moved = dict(batch, final_obs=batch["final_obs"].clone())
    moved["final_obs"][3, 1] += 1.0  # the truncated step's final obs: its advantage follows V of it
    adv2, _ = ppo.advantages(policy, moved, config)
    with torch.no_grad():
        dv = policy.value(moved["final_obs"][3, 1]) - policy.value(batch["final_obs"][3, 1])
    torch.testing.assert_close(adv2[3, 1] - adv[3, 1], 0.9 * dv)
    torch.testing.assert_close(adv2[:3, 1] - adv[:3, 1], 0.9 * dv * (0.9 * 0.8) ** torch.arange(3, 0, -1.0))
    torch.testing.assert_close(adv2[4:, 1], adv[4:, 1])  # the next episode does not see it

    moved = dict(batch, final_obs=batch["final_obs"].clone())
    moved["final_obs"][2, 0] += 1.0  # the terminated step's: no bootstrap at all
    moved["final_obs"][0, 2] += 1.0  # a step where nothing ended: final_obs is not read
    torch.testing.assert_close(ppo.advantages(policy, moved, config)[0], adv, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ act


def test_act_samples_from_the_policy_and_reports_log_prob_and_value():
    policy = ppo.make_policy(OBS, ACT, ppo.Config())
    obs = torch.randn(2000, 4, generator=torch.Generator().manual_seed(0))
    action, extras = ppo.act(policy, obs, 0, torch.Generator().manual_seed(3))
    assert action.dtype == torch.int64 and action.shape == (2000,)
    assert set(extras) == {"logp", "value"}
    with torch.no_grad():
        logp_all = torch.log_softmax(policy.pi(obs), dim=1)
        torch.testing.assert_close(extras["logp"], logp_all.gather(1, action[:, None]).squeeze(1))
        torch.testing.assert_close(extras["value"], policy.value(obs))
    # The initial policy is near uniform (head gain 0.01): both actions are sampled about evenly.
    assert 0.45 < action.float().mean() < 0.55
    again, _ = ppo.act(policy, obs, 0, torch.Generator().manual_seed(3))
    assert torch.equal(action, again)  # all randomness comes from the generator


def test_greedy_act_takes_the_most_probable_action_and_no_extras():
    policy = ppo.make_policy(OBS, ACT, ppo.Config())
    obs = torch.randn(50, 4)
    action, extras = ppo.act(policy, obs, 0, torch.Generator(), greedy=True)
    with torch.no_grad():
        assert torch.equal(action, policy.pi(obs).argmax(1))
    assert extras == {}


def test_continuous_actions_are_refused_with_the_fix():
    box = gym.spaces.Box(-1.0, 1.0, (1,), dtype=np.float32)
    with pytest.raises(ValueError, match=r"^ppo supports discrete action spaces only, got Box.*use sac, td3 or ddpg"):
        ppo.make_policy(OBS, box, ppo.Config())


# --------------------------------------------------------------------------------------------- config


def test_an_unknown_config_key_raises_naming_it():
    with pytest.raises(ValueError, match=r"^reactor\.algos\.ppo\.Config has no field 'learning_rate'; fields: \["):
        ppo.Config.from_dict({"lr": 1e-3, "learning_rate": 1e-3})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"rollout_length": 0}, r"^ppo\.Config\.rollout_length must be an int >= 1, got 0$"),
        ({"gae_lambda": 1.5}, r"^ppo\.Config\.gae_lambda must be in \[0, 1\], got 1\.5$"),
        ({"clip": 0.0}, r"^ppo\.Config\.clip must be > 0 and finite, got 0\.0$"),
        ({"ent_coef": -0.01}, r"^ppo\.Config\.ent_coef must be >= 0, got -0\.01$"),
    ],
)
def test_a_bad_config_value_raises_naming_it(override, message):
    with pytest.raises(ValueError, match=message):
        ppo.Config.from_dict(override)


def test_the_app_refuses_a_bad_algorithm_key_before_anything_starts():
    with pytest.raises(ValueError, match=r"^reactor\.algos\.ppo\.Config has no field 'n_steps'"):
        build_graph(APP, {"algo_config": {"n_steps": 64}, "live": False, "run_dir": "/nonexistent"})


# ---------------------------------------------------------------------------------------------- state


def test_a_state_dict_round_trip_gives_identical_act_outputs_and_updates():
    config = ppo.Config(rollout_length=6, epochs=3, minibatch_size=4)
    a = ppo.init(OBS, ACT, config, seed=0)
    ppo.learn(a, _rollout(a.policy, seed=1))  # the optimizer has moments, the shuffler has moved
    b = ppo.init(OBS, ACT, config, seed=1)
    assert not torch.equal(a.policy.pi[0].weight, b.policy.pi[0].weight)
    ppo.load_state_dict(b, ppo.state_dict(a))
    assert b.updates == a.updates == 1

    obs = torch.randn(64, 4, generator=torch.Generator().manual_seed(2))
    outs = []
    for s in (a, b):
        policy = ppo.make_policy(OBS, ACT, config)
        ppo.load_weights(policy, ppo.policy_weights(s))
        outs.append(ppo.act(policy, obs, 0, torch.Generator().manual_seed(4)))
    assert torch.equal(outs[0][0], outs[1][0])
    for k in ("logp", "value"):
        assert torch.equal(outs[0][1][k], outs[1][1][k])

    batch = _rollout(a.policy, seed=5)
    metrics = [ppo.learn(s, batch)[0] for s in (a, b)]  # optimizer and shuffler state came along too
    for k, v in ppo.policy_weights(a).items():
        assert torch.equal(v, ppo.policy_weights(b)[k]), k
    assert metrics[0] == metrics[1]


def test_learn_moves_the_policy_towards_advantageous_actions():
    """All rewards equal but action 1 pays +1 more: after an update, action 1 is more probable."""
    config = ppo.Config(rollout_length=16, epochs=4, minibatch_size=32, lr=3e-3)
    state = ppo.init(OBS, ACT, config, seed=0)
    batch = _rollout(state.policy, t=16, n=4, seed=6)
    batch["reward"] = batch["action"].float()
    obs = batch["obs"].reshape(-1, 4)
    with torch.no_grad():
        before = torch.softmax(state.policy.pi(obs), 1)[:, 1].mean()
    metrics, priorities = ppo.learn(state, batch)
    with torch.no_grad():
        after = torch.softmax(state.policy.pi(obs), 1)[:, 1].mean()
    assert priorities is None
    assert after > before + 0.03  # the clip holds each ratio within 1.2: at most +0.1 here
    assert 0.0 <= metrics["clip_fraction"] <= 1.0 and metrics["approx_kl"] >= 0.0


def test_learn_names_the_missing_fields():
    state = ppo.init(OBS, ACT, ppo.Config(), seed=0)
    batch = _rollout(state.policy)
    del batch["final_obs"]
    with pytest.raises(ValueError, match=r"^ppo\.learn: the rollout lacks \['final_obs'\]"):
        ppo.learn(state, batch)


# ------------------------------------------------------------------------------------ learning (the app)


def _run(config: dict, **kw):
    return run(build_graph(APP, config), app=APP, config=config, **kw)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ppo_solves_cartpole(tmp_path):
    """The bar: PPO CartPole-v1 mean greedy evaluation return (10 episodes) >= 475, seeded, one
    process, within 25k env steps: half RL-Zoo's sample budget (SB3 solves in 10k-16k env steps). Here
    seeds 1, 3 and 0 get there at 11k, 5k and 12k; the next seed runs only if one falls short (another
    CPU model, another trajectory: tests/learning.py)."""

    def train(seed: int) -> dict:
        run_dir = tmp_path / f"seed{seed}"
        _run({"run_dir": str(run_dir), "live": False, "max_env_steps": 25_000}, seed=seed)
        return _summary(run_dir)

    s = first_seed_passing(train, seeds=[1, 3, 0])
    assert s["best_eval_return"] >= 475
    solved = next(e for e in s["evaluations"] if e["eval_return"] >= 475)
    assert solved["env_steps"] <= 25_000, solved


@pytest.mark.slow
def test_ppo_under_actors_learns_and_matches_single_bit_for_bit(tmp_path):
    """Two actor processes and the learner's process: the run completes, learns, and ends with the
    weights of the same seeded run in one process (synchronous PPO is placement independent)."""
    base = {"max_env_steps": 4096, "target_return": None, "live": False}
    a = _run({**base, "run_dir": str(tmp_path / "single")}, seed=2)
    b = _run({**base, "run_dir": str(tmp_path / "actors")}, seed=2, placement="actors")
    assert a.stopped_by == b.stopped_by == "quiescence"
    assert set(b.processes) == {"learner", "actor-0", "actor-1"}
    assert (tmp_path / "single" / "weights.sha256").read_text() == (tmp_path / "actors" / "weights.sha256").read_text()
    sa, sb = _summary(tmp_path / "single"), _summary(tmp_path / "actors")
    assert sa["env_steps"] == sb["env_steps"] == 4096
    assert sa["updates"] == sb["updates"] == 16  # 4096 steps / (8 envs x 32 steps)
    evals = [[(e["env_steps"], e["eval_return"]) for e in s["evaluations"]] for s in (sa, sb)]
    assert evals[0] == evals[1]
    first, best = evals[1][0][1], max(r for _, r in evals[1])
    assert first < 50 and best > 150, evals[1]  # a near-uniform start; learning well under way
