"""The GPU half (issue 18): learners, replay shards and compiled updates on a CUDA device.

Every test here needs CUDA and is skipped without it (the CPU CI); they run on a lent GPU machine
(docs/benchmarks.md, "GPU"). The same code's CPU behaviour is tested in tests/nodes/test_device.py
and tests/replay/test_device_replay.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from reactor import run
from reactor.algos import get_algorithm
from reactor.launch._app import build_graph
from reactor.nodes._device import LearnStep, resolve_device
from reactor.replay import Storage, SumTree, WindowRead
from reactor.replay.device import DeviceReplay
from tests.algos.test_continuous import _batch as continuous_batch
from tests.algos.test_ppo import _rollout
from tests.algos.test_transformer_dqn import _batch as window_batch
from tests.learning import first_seed_passing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda", 0)
CARTPOLE, PENDULUM = gym.make("CartPole-v1"), gym.make("Pendulum-v1")


def _dqn_batch(b: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(b, 4, generator=g), "action": torch.randint(2, (b,), generator=g),
            "reward": torch.randn(b, generator=g), "discount": torch.full((b,), 0.97),
            "next_obs": torch.randn(b, 4, generator=g), "next_terminated": torch.rand(b, generator=g) < 0.1,
            "weights": torch.rand(b, generator=g) + 0.5}


class _Spaces:
    def __init__(self, obs_space, act_space):
        self.observation_space, self.action_space = obs_space, act_space

    def reset(self, seed=None):
        return self.observation_space.sample(), {}


def _cases():
    from reactor.algos import transformer_dqn as tdqn

    tcfg = tdqn.Config(window=4, bf16=False)
    masked = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)  # the windows' obs: CartPole without velocities
    return {
        "dqn": (CARTPOLE, {}, lambda s: _dqn_batch(seed=s)),
        "ddpg": (PENDULUM, {}, lambda s: continuous_batch(seed=s)),
        "td3": (PENDULUM, {}, lambda s: continuous_batch(seed=s)),
        "sac": (PENDULUM, {}, lambda s: continuous_batch(seed=s)),
        "transformer_dqn": (_Spaces(masked, CARTPOLE.action_space), {"window": 4, "bf16": False},
                            lambda s: window_batch(tcfg, seed=s)),
    }


@pytest.mark.parametrize("algo", ["dqn", "ddpg", "td3", "sac", "transformer_dqn", "ppo"])
def test_each_algorithm_learns_on_the_gpu_and_its_weights_act_on_the_cpu(algo):
    mod = get_algorithm(algo)
    if algo == "ppo":
        env, overrides = CARTPOLE, {}
    else:
        env, overrides, make = _cases()[algo]
    config = mod.Config.from_dict(overrides)
    torch.manual_seed(0)  # (ddpg, td3, sac: init is seeded by the caller's torch seed, as the learner does)
    cpu = mod.init(env.observation_space, env.action_space, config, 0)
    torch.manual_seed(0)
    gpu = mod.init(env.observation_space, env.action_space, config, 0, device=CUDA)
    assert all(p.is_cuda for opt in vars(gpu).values() if isinstance(opt, torch.optim.Optimizer)
               for g in opt.param_groups for p in g["params"])
    for i in range(3):
        batch = _rollout(mod.make_policy(env.observation_space, env.action_space, config), seed=i) if algo == "ppo" \
            else make(i)
        mc, _ = mod.learn(cpu, batch)
        mg, prio = mod.learn(gpu, {k: v.to(CUDA) for k, v in batch.items()})
        assert all(torch.isfinite(torch.tensor(v)) for v in mg.values())
        if prio is not None:
            assert prio.is_cuda and prio.shape[0] == len(batch["weights"])
        if i == 0 and algo in ("dqn", "ddpg", "transformer_dqn"):
            # No random draws in these learns: from the same weights, the same loss up to rounding.
            assert all(abs(mc[k] - mg[k]) <= 1e-4 * max(1.0, abs(mc[k])) for k in mc), (mc, mg)
    wc, wg = mod.policy_weights(cpu), mod.policy_weights(gpu)
    if algo in ("dqn", "ddpg", "transformer_dqn"):
        # Adam moves a weight by about lr per update whatever the gradient's size, so rounding can flip
        # tiny steps: after 3 updates the weights agree within a few lr.
        lr = getattr(config, "lr", None) or config.actor_lr
        for k in wc:
            assert float((wc[k] - wg[k].cpu()).abs().max()) <= 6 * lr, k
    policy = mod.make_policy(env.observation_space, env.action_space, config)
    mod.load_weights(policy, {k: v.cpu() for k, v in wg.items()})
    obs = torch.as_tensor(env.reset(seed=0)[0]).float()[None]
    action, _ = mod.act(policy, obs, 0, torch.Generator().manual_seed(0), greedy=True)
    assert not action.is_cuda


def test_a_gpu_learners_checkpoint_loads_for_acting_on_the_cpu(tmp_path):
    sac = get_algorithm("sac")
    state = sac.init(PENDULUM.observation_space, PENDULUM.action_space, sac.Config(), 0, device=CUDA)
    sac.learn(state, {k: v.to(CUDA) for k, v in continuous_batch().items()})
    torch.save({"algo": sac.state_dict(state), "updates": 1}, tmp_path / "learner.pt")
    saved = torch.load(tmp_path / "learner.pt", weights_only=True, map_location="cpu")
    cpu = sac.init(PENDULUM.observation_space, PENDULUM.action_space, sac.Config(), 1)
    sac.load_state_dict(cpu, saved["algo"])  # the CUDA generator's state does not fit the CPU one: kept
    for k, v in sac.policy_weights(cpu).items():
        assert torch.equal(v, sac.policy_weights(state)[k].cpu())


def test_compile_auto_measures_on_the_gpu_and_keeps_a_working_choice():
    dqn = get_algorithm("dqn")
    state = dqn.init(CARTPOLE.observation_space, CARTPOLE.action_space, dqn.Config(), 0, device=CUDA)
    step = LearnStep(dqn.learn, "auto", CUDA, "learner")
    before = [p.detach().clone() for p in state.q.parameters()]
    for i in range(40):
        metrics, prio = step(state, {k: v.to(CUDA) for k, v in _dqn_batch(seed=i).items()})
        assert prio.is_cuda and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert step.choice in ("eager", "compiled", "compiled-cudagraphs")
    assert "eager" in step.timings and len(step.timings) + len(step.errors) == 3, (step.timings, step.errors)
    assert any(not torch.equal(a, b) for a, b in zip(before, state.q.parameters()))
    print("compile auto:", step.choice, step.timings, step.errors)


def test_resolve_device_spreads_replicas_over_the_gpus_and_refuses_a_missing_one():
    n = torch.cuda.device_count()
    assert [resolve_device("cuda", "l", i).index for i in range(3)] == [i % n for i in range(3)]
    with pytest.raises(ValueError, match=rf"device='cuda:{n}' names a GPU this host does not have \({n} visible\)"):
        resolve_device(f"cuda:{n}", "l")


def test_gpu_storage_gathers_the_same_windows_as_host_storage():
    from reactor.replay import FieldSpec

    specs = [FieldSpec("obs", (3,), torch.float32), FieldSpec("terminated", (), torch.bool)]
    host, dev = Storage(specs, 64), Storage(specs, 64, device="cuda")
    g = torch.Generator().manual_seed(0)
    for st in (host, dev):
        g.manual_seed(0)
        for n in (10, 15, 20, 25, 30):  # 100 steps into 64: the oldest episodes are evicted
            obs = torch.randn(n, 3, generator=g)
            term = torch.zeros(n, dtype=torch.bool)
            term[-1] = True
            st.append({"obs": obs.to(st.device), "terminated": term.to(st.device)})
    assert host.step_range == dev.step_range
    keys = torch.arange(*host.step_range).numpy()
    a = host.read_windows(keys, 8, "tail")
    b = dev.read_windows(keys, 8, "tail")
    for k in a:
        assert b[k].is_cuda and torch.equal(a[k], b[k].cpu()), k
    assert WindowRead(8, "tail").length == 8


def test_the_sync_free_tree_on_the_gpu_draws_what_the_checked_cpu_tree_draws():

    rng = np.random.default_rng(0)
    prio = rng.random(5000)
    a, b = SumTree(5000, backend="torch"), SumTree(5000, backend="torch", device="cuda")
    a.update(np.arange(5000), prio)
    b.write_async(torch.arange(5000, device="cuda"), torch.from_numpy(prio).cuda())
    assert float(a.total) == pytest.approx(float(b.total_tensor()), rel=1e-12)
    u = torch.Generator("cuda").manual_seed(3)
    ib, _ = b.sample_async(4096, u)
    # Stratified: each of 50 buckets of 100 leaves gets its mass's share of the draws, give or take
    # the strata cut at its two ends.
    counts = torch.bincount(ib.cpu() // 100, minlength=50).double()
    expected = torch.from_numpy(prio.reshape(50, 100).sum(1) / prio.sum() * 4096)
    assert float((counts - expected).abs().max()) <= 2.0


def test_device_replay_on_the_gpu_graphed_sampler_sees_later_inserts_and_priorities():
    specs = [("obs", (2,), torch.float32)]
    replay = DeviceReplay(specs, capacity=256, window=4, device="cuda", alpha=1.0, beta=1.0)
    replay.insert({"obs": torch.zeros(128, 2)}, torch.zeros(128, dtype=torch.int64))
    sample = replay.sampler(64, graphed=True)
    first = sample()
    assert first["obs"].is_cuda and bool((first["obs"] == 0).all())
    replay.insert({"obs": torch.ones(128, 2)}, torch.ones(128, dtype=torch.int64))  # pinned staging
    keys = torch.arange(128, 256, device="cuda")
    replay.update_priorities(keys, torch.full((128,), 1e6, device="cuda"))  # nearly all mass on the new steps
    out = sample()
    assert float((out["keys"] >= 128).float().mean()) > 0.95
    assert bool((out["obs"][out["mask"]] == 1).float().mean() > 0.95)
    replay.check()


def _run(app: str, config: dict, **kw):
    return run(build_graph(app, config), app=app, config=config, **kw)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dqn_learns_cartpole_with_its_learner_and_replay_shards_on_the_gpu(tmp_path, capfd):
    """The DQN app with device=cuda, replay_memory=cuda and compile=auto (one process): it reaches the target; its
    learner.pt holds CUDA tensors that reactor eval's loader reads on the CPU."""
    from reactor.nodes._policy import load_policy

    app = str(ROOT / "apps" / "dqn.py")

    def train(seed: int) -> dict:
        run_dir = tmp_path / f"seed{seed}"
        cfg = {"device": "cuda", "replay_memory": "cuda", "compile": "auto", "live": False, "max_env_steps": 30_000,
               "run_dir": str(run_dir)}
        _run(app, cfg, seed=seed)
        return {**json.loads((run_dir / "summary.json").read_text()), "run_dir": run_dir}

    s = first_seed_passing(train, seeds=[0, 1, 2])
    assert s["best_eval_return"] >= 475
    saved = torch.load(s["run_dir"] / "learner.pt", weights_only=True)
    assert next(iter(saved["algo"]["q"].values())).is_cuda
    policy = load_policy(s["run_dir"])
    assert policy.updates > 0
    print("dqn on the gpu:", [(e["env_steps"], e["eval_return"]) for e in s["evaluations"]])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dp_learners_on_one_gpu_all_reduce_over_gloo_into_identical_replicas(tmp_path, capfd):
    app = str(ROOT / "apps" / "dqn.py")
    cfg = {"device": "cuda", "learners": 2, "max_env_steps": 2500, "target_return": None, "live": False,
           "run_dir": str(tmp_path)}
    _run(app, cfg, placement="dp-learners")
    out = capfd.readouterr().out
    backends = re.findall(r"^learner\[\d\]: data-parallel over (\w+), 2 replicas, this one on (cuda:\d)$", out, re.M)
    expected = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    assert len(backends) == 2 and {b for b, _ in backends} == {expected}, out[-2000:]
    hashes = dict(re.findall(r"^(learner\[\d\]): \d+ updates; final weights sha256 ([0-9a-f]{64})$", out, re.M))
    assert len(hashes) == 2 and len(set(hashes.values())) == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_transformer_app_runs_with_gpu_replay_windows_and_a_gpu_learner(tmp_path):
    app = str(ROOT / "apps" / "transformer_dqn.py")
    cfg = {"device": "cuda", "replay_memory": "cuda", "compile": "off", "live": False, "max_env_steps": 4000,
           "target_return": None, "run_dir": str(tmp_path)}
    r = _run(app, cfg)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["updates"] > 30 and r.stopped_by == "quiescence"


def test_the_graphed_priority_updater_writes_what_plain_updates_write():
    specs = [("obs", (2,), torch.float32)]
    a, b = (DeviceReplay(specs, capacity=1000, window=4, device="cuda", alpha=0.7) for _ in range(2))
    for r in (a, b):
        r.insert({"obs": torch.randn(1000, 2)}, torch.arange(1000) // 37)
    update = b.updater(128)
    g = torch.Generator("cuda").manual_seed(0)
    for i in range(20):
        # Distinct keys: a key twice in one call keeps one of its values, which one is up to the GPU.
        keys = torch.randperm(1000, device="cuda", generator=g)[:128]
        prio = torch.rand(128, device="cuda", generator=g) * 5
        if i == 7:
            prio[3] = float("nan")  # refused in both, counted in both
        a.update_priorities(keys, prio)
        update(keys, prio)
    leaves = torch.arange(1000, device="cuda")
    assert torch.equal(a._tree.leaves_async(leaves), b._tree.leaves_async(leaves))
    assert float(a._tree.total_tensor()) == float(b._tree.total_tensor())
    for r in (a, b):
        with pytest.raises(ValueError, match="^DeviceReplay: 1 priorities were not finite"):
            r.check()


def test_a_gpu_learner_resumes_its_own_checkpoint_generator_included(tmp_path):
    sac = get_algorithm("sac")
    state = sac.init(PENDULUM.observation_space, PENDULUM.action_space, sac.Config(), 0, device=CUDA)
    sac.learn(state, {k: v.to(CUDA) for k, v in continuous_batch().items()})
    torch.save({"algo": sac.state_dict(state), "updates": 1}, tmp_path / "learner.pt")
    saved = torch.load(tmp_path / "learner.pt", weights_only=True, map_location=CUDA)  # as Learner loads it
    again = sac.init(PENDULUM.observation_space, PENDULUM.action_space, sac.Config(), 5, device=CUDA)
    sac.load_state_dict(again, saved["algo"])
    assert torch.equal(again.generator.get_state(), state.generator.get_state())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_offline_app_learns_on_the_gpu_from_a_source_runs_replay(tmp_path, capfd):
    source = tmp_path / "source"
    _run(str(ROOT / "apps" / "transformer_dqn.py"), {"max_env_steps": 2000, "target_return": None, "live": False,
                                                      "run_dir": str(source)})
    out_dir = tmp_path / "offline"
    # size=large: the 56.8M-parameter model, window 64, bf16 autocast (one greedy episode on the CPU at the end)
    _run(str(ROOT / "apps" / "transformer_offline.py"), {"source": str(source), "device": "cuda", "size": "large",
                                                         "updates": 100, "eval_every_updates": 100, "eval_episodes": 1,
                                                         "live": False, "run_dir": str(out_dir)})
    out = capfd.readouterr().out
    assert re.search(r"^learner: \d+ steps of \d+ episodes from 2 shard checkpoint\(s\) of .* on cuda:0 "
                     r"\((triton|torch) kernels\)$", out, re.M), out
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["updates"] == 100
    with capfd.disabled():
        print(f"offline app, size=large on the GPU: {summary}")
