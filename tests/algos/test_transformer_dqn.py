"""Transformer DQN (``reactor.algos.transformer_dqn``): causality, masking, history, config, state, learning.

The unit tests drive the fragments directly on tensors; the learning tests run the real app
(``apps/transformer_dqn.py``: actors, replay shards, learner, evaluator) on the real
``CartPoleNoVel-v1``, seeded, under the single-process placement.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from reactor import run
from reactor.algos import transformer_dqn as tdqn
from reactor.algos.envs import make_env
from reactor.launch._app import build_graph
from reactor.nodes.writer import WindowPattern, Writer
from reactor.replay import FieldSpec, Storage, WindowRead
from tests.learning import every_seed_stays_below_target, first_seed_passing

APP = str(Path(__file__).resolve().parents[2] / "apps" / "transformer_dqn.py")
OBS = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
ACT = gym.spaces.Discrete(2)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread, as the nodes run (the machine is shared; threads only contend here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(config: tdqn.Config, b: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random windows ``[b, T + 1]``; window i holds ``T + 1 - i`` stored steps (tail padding)."""
    g = torch.Generator().manual_seed(seed)
    t = config.window + 1
    lengths = torch.clamp(t - torch.arange(b), min=2)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    batch = {
        "obs": torch.randn(b, t, 2, generator=g),
        "action": torch.randint(2, (b, t), generator=g),
        "reward": torch.rand(b, t, generator=g),
        "terminated": torch.zeros(b, t, dtype=torch.bool),
        "mask": mask,
        "weights": torch.rand(b, generator=g) + 0.5,
    }
    batch["terminated"][1, lengths[1] - 1] = True  # one window ends with a terminal row
    for k in ("obs", "action", "reward", "terminated"):  # padding holds zeros, as storage writes it
        batch[k][~mask] = 0
    return batch


def _params(state: tdqn.State) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.q.parameters()]


# ---------------------------------------------------------------------------- network


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_q_at_position_t_does_not_change_when_later_observations_change(positions):
    torch.manual_seed(0)
    net = tdqn.QTransformer(2, 2, tdqn.Config(window=6, positions=positions))
    obs = torch.randn(3, 6, 2)
    q = net(obs)
    for t in range(5):
        later = obs.clone()
        later[:, t + 1 :] = torch.randn(3, 5 - t, 2) * 10
        q2 = net(later)
        torch.testing.assert_close(q2[:, : t + 1], q[:, : t + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(q2[:, t + 1 :], q[:, t + 1 :])  # the later positions do see them


def test_q_network_rejects_a_context_longer_than_the_window():
    net = tdqn.QTransformer(2, 2, tdqn.Config(window=4))
    with pytest.raises(ValueError, match=r"^QTransformer got 5 positions, more than its window 4$"):
        net(torch.zeros(1, 5, 2))


# ---------------------------------------------------------------------------- store


def test_store_reads_tail_padded_windows_one_step_longer_than_the_context():
    spec = tdqn.store(OBS, ACT, tdqn.Config(window=5))
    assert spec.read == WindowRead(6, pad="tail")
    assert [name for name, _, _ in spec.fields] == ["obs", "action", "reward", "terminated"]


def test_store_rejects_a_continuous_action_space():
    with pytest.raises(ValueError, match=r"needs a discrete action space"):
        tdqn.store(OBS, gym.spaces.Box(-1.0, 1.0, (1,)), tdqn.Config())


# ---------------------------------------------------------------------------- learning


def test_padded_positions_and_the_windows_last_action_and_reward_do_not_affect_the_loss():
    """Regression: padding (mask False) and the last position's action/reward (it has no next step
    inside the window) must change neither the loss, the priorities nor the update."""
    config = tdqn.Config(window=5)
    batch = _batch(config)
    garbage = {k: v.clone() for k, v in batch.items()}
    pad = ~batch["mask"]
    g = torch.Generator().manual_seed(1)
    garbage["obs"][pad] = torch.randn(int(pad.sum()), 2, generator=g) * 100
    garbage["action"][pad] = 1 - batch["action"][pad]
    garbage["reward"][pad] = 50.0
    garbage["terminated"][pad] = True
    garbage["action"][:, -1] = 1 - batch["action"][:, -1]
    garbage["reward"][:, -1] = -50.0
    a, b = (tdqn.init(OBS, ACT, config, seed=3) for _ in range(2))
    metrics_a, prio_a = tdqn.learn(a, batch)
    metrics_b, prio_b = tdqn.learn(b, garbage)
    assert metrics_a == metrics_b
    torch.testing.assert_close(prio_a, prio_b, rtol=0, atol=0)
    for pa, pb in zip(_params(a), _params(b)):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    # ... while a valid position's reward does change them.
    changed = {k: v.clone() for k, v in batch.items()}
    changed["reward"][0, 0] += 5.0
    c = tdqn.init(OBS, ACT, config, seed=3)
    metrics_c, prio_c = tdqn.learn(c, changed)
    assert metrics_c["loss"] != metrics_a["loss"] and prio_c[0] != prio_a[0]


def test_terminated_next_step_stops_bootstrapping():
    """A window whose second row is a terminal final row: y_0 = r_0 exactly, so the priority is |r_0 - Q_0|."""
    config = tdqn.Config(window=4, priority_eta=0.9)
    state = tdqn.init(OBS, ACT, config, seed=0)
    batch = _batch(config, b=2)
    batch["mask"][:] = False
    batch["mask"][:, :2] = True  # two stored rows: the last step and the final observation
    batch["terminated"][:] = False
    batch["terminated"][0, 1] = True  # window 0: terminated; window 1: truncated (bootstraps)
    with torch.no_grad():
        q0 = state.q(batch["obs"][:, :4])[:, 0].gather(1, batch["action"][:, :1]).squeeze(1)
        boot = state.target(batch["obs"][:, 1:])[:, 0]
        a_star = state.q(batch["obs"][:, 1:])[:, 0].argmax(1)
        v1 = boot[1, a_star[1]]
    _, prio = tdqn.learn(state, batch)
    r = batch["reward"][:, 0]
    torch.testing.assert_close(prio[0], (r[0] - q0[0]).abs() + 1e-3)
    torch.testing.assert_close(prio[1], (r[1] + config.gamma * v1 - q0[1]).abs() + 1e-3)


def test_n_step_targets_stop_at_the_terminal_and_at_the_windows_end():
    config = tdqn.Config(window=4, n_step=3, gamma=0.9)
    state = tdqn.init(OBS, ACT, config, seed=0)
    batch = _batch(config, b=2)
    batch["mask"][:] = True
    batch["mask"][0, 4] = False  # window 0: 4 stored steps, the last a terminal final row
    batch["terminated"][:] = False
    batch["terminated"][0, 3] = True
    r, g = batch["reward"], config.gamma
    with torch.no_grad():
        nxt = batch["obs"][:, 1:]
        v = state.target(nxt).gather(2, state.q(nxt).argmax(2, keepdim=True)).squeeze(2)  # step j at j - 1
    y, valid = tdqn.targets(state, batch)
    assert valid.tolist() == [[True, True, True, False], [True, True, True, True]]
    want0 = [r[0, 0] + g * r[0, 1] + g**2 * r[0, 2], r[0, 1] + g * r[0, 2], r[0, 2]]
    want1 = [r[1, 0] + g * r[1, 1] + g**2 * r[1, 2] + g**3 * v[1, 2],
             r[1, 1] + g * r[1, 2] + g**2 * r[1, 3] + g**3 * v[1, 3],
             r[1, 2] + g * r[1, 3] + g**2 * v[1, 3],
             r[1, 3] + g * v[1, 3]]
    torch.testing.assert_close(y[0, :3], torch.stack(want0))
    torch.testing.assert_close(y[1], torch.stack(want1))


def test_windows_from_the_real_writer_and_storage_keep_the_terminal_step():
    """Regression (why tail padding): an episode's final-observation row is stored but is no anchor,
    so it must reach the learner as the *next* step of windows anchored before it."""
    config = tdqn.Config(window=3, n_step=3, gamma=0.9)
    spec = tdqn.store(OBS, ACT, config)
    writer = Writer(spec.fields, 1, WindowPattern(spec.read.length, spec.read.pad), flush_steps=1000)
    obs = torch.randn(4, 1, 2)  # o0..o2, and o3 the final observation
    for t in range(3):
        writer.append({"obs": obs[t], "action": np.array([t % 2]), "reward": np.array([1.0], np.float32)},
                      terminated=np.array([t == 2]), truncated=np.array([False]), final={"obs": obs[3]})
    (msg,) = writer.flush()
    storage = Storage([FieldSpec(n, s, d) for n, s, d in spec.fields], capacity=16)
    storage.append(msg.fields, episode_end=msg.episode_end)
    anchors = np.flatnonzero(msg.item_mask)
    assert anchors.tolist() == [0, 1, 2]  # the final row is not an item
    batch = storage.read_windows(anchors, spec.read.length, spec.read.pad)
    torch.testing.assert_close(batch["obs"][2, :2], obs[2:, 0])  # the last step's window: it, then o3
    y, valid = tdqn.targets(tdqn.init(OBS, ACT, config, seed=0), batch)
    g = config.gamma
    assert valid.tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    torch.testing.assert_close(y[valid], torch.tensor([1 + g + g**2, 1 + g, 1.0, 1 + g, 1.0, 1.0]))


def test_learning_reduces_the_td_error_on_a_fixed_batch():
    config = tdqn.Config(window=4, target_update_every=1000, lr=1e-3)
    state = tdqn.init(OBS, ACT, config, seed=0)
    batch = _batch(config, b=16)
    first, _ = tdqn.learn(state, batch)
    for _ in range(60):
        last, _ = tdqn.learn(state, batch)
    assert last["loss"] < 0.2 * first["loss"]
    assert state.updates == 61


def test_learn_rejects_windows_of_the_wrong_length():
    config = tdqn.Config(window=4)
    state = tdqn.init(OBS, ACT, config, seed=0)
    with pytest.raises(ValueError, match=r"^transformer_dqn.learn expects windows of window \+ 1 = 5 steps, got 4"):
        tdqn.learn(state, _batch(tdqn.Config(window=3)))


# ---------------------------------------------------------------------------- acting


def _policy(config: tdqn.Config, seed: int = 0) -> tdqn.Policy:
    policy = tdqn.make_policy(OBS, ACT, config)
    tdqn.load_weights(policy, tdqn.policy_weights(tdqn.init(OBS, ACT, config, seed)))
    return policy


def test_acting_uses_the_episodes_last_window_observations_as_learning_does():
    """Q at act time equals the network's Q at the last position of the last ``window`` observations."""
    config = tdqn.Config(window=3)
    policy = _policy(config)
    gen = torch.Generator().manual_seed(0)
    seen = torch.randn(6, 2, 2)  # 6 steps of 2 envs
    for t in range(6):
        tdqn.act(policy, seen[t], t, gen, greedy=True)
        ctx = seen[max(0, t - 2) : t + 1].transpose(0, 1)  # [2 envs, <= 3, 2]
        with torch.no_grad():
            want = policy.net(ctx)[:, -1]
        torch.testing.assert_close(policy.q, want)


def test_reset_clears_the_history_of_ended_envs_only():
    config = tdqn.Config(window=4)
    policy = _policy(config)
    gen = torch.Generator().manual_seed(0)
    seen = torch.randn(3, 2, 2)
    for t in range(3):
        tdqn.act(policy, seen[t], t, gen, greedy=True)
    tdqn.reset(policy, np.array([True, False]))
    x = torch.randn(2, 2)
    tdqn.act(policy, x, 3, gen, greedy=True)
    assert policy.length.tolist() == [1, 4]
    with torch.no_grad():
        fresh = policy.net(x[:1, None])[0, 0]  # env 0: a new episode, one observation
        going_on = policy.net(torch.cat([seen[:, 1], x[1:]])[None])[0, -1]  # env 1: four
    torch.testing.assert_close(policy.q[0], fresh)
    torch.testing.assert_close(policy.q[1], going_on)


def test_exploration_draws_from_the_generator_and_greedy_does_not():
    config = tdqn.Config(window=2, eps_start=0.5, eps_end=0.5)
    obs = torch.randn(64, 2)
    runs = []
    for _ in range(2):
        policy = _policy(config)
        gen = torch.Generator().manual_seed(7)
        runs.append(tdqn.act(policy, obs, 0, gen)[0])
        state = gen.get_state()
        greedy, extras = tdqn.act(_policy(config), obs, 0, gen, greedy=True)
        assert torch.equal(gen.get_state(), state) and extras == {}
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], greedy)  # with eps 0.5, some of 64 actions were random


def test_epsilon_falls_linearly_then_stays():
    config = tdqn.Config(eps_start=1.0, eps_end=0.1, eps_decay_steps=100)
    assert [tdqn.epsilon(config, s) for s in (0, 50, 100, 10_000)] == pytest.approx([1.0, 0.55, 0.1, 0.1])


# ---------------------------------------------------------------------------- config and state


def test_bad_config_key_raises_naming_it():
    with pytest.raises(ValueError, match=r"^reactor\.algos\.transformer_dqn\.Config has no field 'windw'; fields: \["):
        tdqn.Config.from_dict({"windw": 4})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"window": 0}, r"^transformer_dqn Config\.window must be an int >= 1, got 0$"),
    ({"d_model": 30, "n_heads": 4}, r"^transformer_dqn Config\.d_model=30 is not divisible by n_heads=4"),
    ({"positions": "rotary"}, r"^transformer_dqn Config\.positions must be 'learned' or 'sinusoidal', got 'rotary'$"),
])
def test_bad_config_values_raise_naming_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        tdqn.Config.from_dict(overrides)


def test_state_dict_round_trip_continues_identically():
    config = tdqn.Config(window=3, target_update_every=2)
    a = tdqn.init(OBS, ACT, config, seed=0)
    for i in range(3):
        tdqn.learn(a, _batch(config, seed=i))
    buf = io.BytesIO()
    torch.save(tdqn.state_dict(a), buf)  # as the Learner checkpoints: torch.save / weights_only load
    buf.seek(0)
    b = tdqn.init(OBS, ACT, config, seed=1)
    tdqn.load_state_dict(b, torch.load(buf, weights_only=True))
    assert b.updates == 3
    for _ in range(3):
        batch = _batch(config, seed=10)
        ma, pa = tdqn.learn(a, batch)
        mb, pb = tdqn.learn(b, batch)
        assert ma == mb
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    for x, y in zip(_params(a), _params(b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for x, y in zip(a.target.parameters(), b.target.parameters()):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_fragments_run_on_the_real_env_spaces():
    env = make_env("CartPoleNoVel-v1")
    config = tdqn.Config(window=2)
    assert env.observation_space.shape == (2,)
    policy = tdqn.make_policy(env.observation_space, env.action_space, config)
    obs, _ = env.reset(seed=0)
    action, _ = tdqn.act(policy, torch.as_tensor(obs)[None], 0, torch.Generator().manual_seed(0))
    assert action.shape == (1,) and env.action_space.contains(int(action[0]))


# ---------------------------------------------------------------------------- learning through the app


def _train(tmp_path: Path, seed: int, **overrides) -> dict:
    run_dir = tmp_path / f"seed{seed}"
    config = {"live": False, "run_dir": str(run_dir), **overrides}
    run(build_graph(APP, config), seed=seed)
    return json.loads((run_dir / "summary.json").read_text())


# Seeds in order; a learning test passes at the first that reaches its target (tests/learning.py). Here
# seeds 1, 0 and 4 reach 200 at 9k, 11k and 11k env steps (3 and 5 at 12k-12.5k, 2 at 15.5k); the budget
# leaves margin for another CPU model, where each seed follows another trajectory.
SEEDS = [1, 0, 4]
BUDGET = 16_000
CONTROL_BUDGET = 10_000  # past the 9k at which seed 1 reaches 200 (the control below)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_app_learns_far_beyond_a_memoryless_policy_quickly(tmp_path):
    """Seeded run of the real app (2 actors x 2 envs, 2 replay shards, learner, evaluator, one
    process): a greedy evaluation return (10 episodes) of 200 on CartPoleNoVel-v1 within 16k env
    steps, four times what memoryless agents plateau at (~50; the control below: the same first seed
    stays below 100 for 10k steps). Seed 1 gets there at 9k."""
    summary = first_seed_passing(lambda seed: _train(tmp_path, seed, target_return=200.0, max_env_steps=BUDGET),
                                 SEEDS)
    assert summary["best_eval_return"] >= 200.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_without_history_the_same_runs_stay_below_100(tmp_path):
    """The control: window=1 (one observation, no memory), the first seed above, never evaluates
    above 100 within 10k env steps, past the 9k at which that seed reaches 200 with its history
    (memoryless agents plateau near 50 on CartPoleNoVel-v1: here seeds 0-3 peak at 45-49 within 16k
    env steps, and by 5k). One seed and not the whole 16k budget: a memoryless agent cannot infer
    the velocities at all, so no seed is a better control than another, and the plateau comes long
    before (each extra seed or 6k steps cost the suite 20-60 s).

    The full solve (400 within 40k env steps, all five seeds) is measured by the benchmark, not here
    (docs/benchmarks.md, "Transformer agent"): it cost the suite three minutes."""
    summaries = every_seed_stays_below_target(
        lambda seed: _train(tmp_path, seed, target_return=100.0, max_env_steps=CONTROL_BUDGET,
                            algo_config={"window": 1}),
        SEEDS[:1],
    )
    assert [s["env_steps"] for s in summaries] == [CONTROL_BUDGET]
