"""The learner's device and compile settings (reactor.nodes._device) as far as they run on a CPU.

The CUDA half (networks, batches and replay on a GPU, compiled updates, data-parallel learners on one
GPU) is in tests/gpu/, which runs where a GPU is.
"""

from __future__ import annotations

import copy
import time

import gymnasium as gym
import pytest
import torch

from reactor.algos import dqn, get_algorithm, restore_generator
from reactor.nodes._device import LearnStep, check_compile, check_device, resolve_device, takes_device
from reactor.nodes.learner import Learner

CARTPOLE = gym.make("CartPole-v1")


def _batch(seed: int, n: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"obs": torch.randn(n, 4, generator=g), "action": torch.randint(2, (n,), generator=g),
            "reward": torch.randn(n, generator=g), "discount": torch.full((n,), 0.97),
            "next_obs": torch.randn(n, 4, generator=g), "next_terminated": torch.rand(n, generator=g) < 0.1,
            "weights": torch.rand(n, generator=g) + 0.5}


def _weights(state: dqn.State) -> list[torch.Tensor]:
    return [p.detach().clone() for p in state.q.parameters()]


@pytest.mark.parametrize("bad", ["gpu", "cuda:", "CPU", "cuda:x", 0, None, "cuda:1:2"])
def test_a_bad_device_or_compile_mode_is_refused_at_build_naming_the_value(bad):
    with pytest.raises(ValueError, match=r"^Learner device must be 'cpu', 'cuda' or 'cuda:N', got " + repr(bad).replace("(", r"\(")):
        Learner("dqn", "CartPole-v1", device=bad)
    with pytest.raises(ValueError, match=r"^Learner compile must be one of 'auto', 'on', 'off', got "):
        Learner("dqn", "CartPole-v1", compile=bad)
    assert check_device("cuda:3") == "cuda:3" and check_compile("on") == "on"


def test_an_app_refuses_a_bad_device_from_set_before_anything_starts(tmp_path):
    from reactor.launch._app import load_app, make_config

    app = load_app("apps/dqn.py")
    with pytest.raises(ValueError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        app.build(make_config(app, {"device": "gpu", "run_dir": str(tmp_path), "live": False}))
    with pytest.raises(ValueError, match=r"compile must be one of 'auto', 'on', 'off', got 'yes'"):
        app.build(make_config(app, {"compile": "yes", "run_dir": str(tmp_path), "live": False}))


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the refusal on a host without CUDA")
def test_a_cuda_device_without_cuda_fails_naming_the_learner_and_the_way_out():
    with pytest.raises(ValueError, match=r"^learner: device='cuda' needs CUDA, and torch.cuda.is_available\(\) is "
                                           r"False on this host; use device='cpu'$"):
        resolve_device("cuda", "learner")
    assert resolve_device("cpu", "learner") == torch.device("cpu")


def test_every_shipped_algorithm_takes_a_device_and_a_plain_function_without_one_is_told_apart():
    from reactor.algos import ALGORITHMS

    assert all(takes_device(get_algorithm(a).init) for a in ALGORITHMS)
    assert not takes_device(lambda obs_space, act_space, config, seed: None)
    assert takes_device(lambda obs_space, act_space, config, seed, **kw: None)


def test_an_explicit_cpu_device_gives_the_same_networks_and_updates_as_the_default():
    a = dqn.init(CARTPOLE.observation_space, CARTPOLE.action_space, dqn.Config(), 3)
    b = dqn.init(CARTPOLE.observation_space, CARTPOLE.action_space, dqn.Config(), 3, device="cpu")
    for i in range(3):
        dqn.learn(a, _batch(i))
        dqn.learn(b, _batch(i))
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b)))


def test_a_generator_state_of_another_kind_is_not_forced_into_the_generator():
    sac = get_algorithm("sac")
    pendulum = gym.make("Pendulum-v1")
    state = sac.init(pendulum.observation_space, pendulum.action_space, sac.Config(), 0)
    before = state.generator.get_state()
    cuda_like = torch.zeros(16, dtype=torch.uint8)  # a CUDA generator's state: seed and offset
    assert not restore_generator(state.generator, cuda_like)
    assert torch.equal(state.generator.get_state(), before)
    other = torch.Generator().manual_seed(9).get_state()
    assert restore_generator(state.generator, other) and torch.equal(state.generator.get_state(), other)


def test_auto_stays_eager_on_the_cpu_and_off_is_eager_anywhere():
    for mode in ("auto", "off"):
        step = LearnStep(dqn.learn, mode, torch.device("cpu"), "learner")
        assert step.choice == "eager" and step.timings == {}


def _slow(seconds: float):
    def learn(state, batch):
        time.sleep(seconds)
        return dqn.learn(state, batch)
    return learn


def test_the_auto_trial_keeps_the_fastest_candidate_and_never_lets_a_candidate_touch_the_training():
    from reactor.nodes import _device

    def broken(state, batch):
        dqn.learn(state, batch)  # half an update on the candidate's copy, then the "compiler" fails
        raise RuntimeError("inductor: cannot lower this op")

    def fast(state, batch):
        for p in state.q.parameters():  # wrecks the copy it runs on: must never reach the real state
            p.data.fill_(7.0)
        return {}, None

    ref = dqn.init(CARTPOLE.observation_space, CARTPOLE.action_space, dqn.Config(), 0)
    state = copy.deepcopy(ref)
    step = LearnStep(_slow(0.002), "auto", torch.device("cpu"), "learner",
                     candidates={"broken": broken, "fast": fast, "slower": _slow(0.01)})
    n = _device.TRIAL_WARMUP + _device.TRIAL_UPDATES
    for i in range(n):
        assert step.choice == "measuring"
        step(state, _batch(i))
        dqn.learn(ref, _batch(i))
    # Eager updates of the real state only, bit for bit; the broken candidate is out, named.
    assert all(torch.equal(x, y) for x, y in zip(_weights(state), _weights(ref)))
    assert set(step.errors) == {"broken"} and "cannot lower this op" in step.errors["broken"]
    assert step.choice == "fast" and set(step.timings) == {"eager", "fast", "slower"}
    # (fast does nothing, the others sleep 2 and 10 ms an update: how eager and slower compare is the
    # scheduler's on a loaded machine: eager, 2 ms of sleep and an update, took 41 ms an update in CI)
    assert step.timings["fast"] < min(step.timings["eager"], step.timings["slower"])
    step(state, _batch(n))  # from now on the chosen one runs on the real state
    assert all(bool((p == 7.0).all()) for p in state.q.parameters())


def test_auto_keeps_eager_when_every_candidate_is_slower():
    state = dqn.init(CARTPOLE.observation_space, CARTPOLE.action_space, dqn.Config(), 0)
    step = LearnStep(dqn.learn, "auto", torch.device("cpu"), "learner", candidates={"slow": _slow(0.003)})
    from reactor.nodes import _device

    for i in range(_device.TRIAL_WARMUP + _device.TRIAL_UPDATES):
        step(state, _batch(i))
    assert step.choice == "eager" and step.timings["slow"] > step.timings["eager"]


def test_a_state_that_cannot_be_copied_drops_the_trial_not_the_learner():
    import threading

    from reactor.nodes import _device

    state = dqn.init(CARTPOLE.observation_space, CARTPOLE.action_space, dqn.Config(), 0)
    state.lock = threading.Lock()  # a custom algorithm's state may hold one: deepcopy refuses it
    ref = dqn.init(CARTPOLE.observation_space, CARTPOLE.action_space, dqn.Config(), 0)
    step = LearnStep(dqn.learn, "auto", torch.device("cpu"), "learner", candidates={"fast": _slow(0.0)})
    for i in range(_device.TRIAL_WARMUP + _device.TRIAL_UPDATES):
        step(state, _batch(i))
        dqn.learn(ref, _batch(i))
    assert "fast" in step.errors and "TypeError" in step.errors["fast"] and step.choice == "eager"
    assert all(torch.equal(x, y) for x, y in zip(_weights(state), _weights(ref)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the refusal on a host without CUDA")
def test_reactor_run_with_device_cuda_on_a_host_without_cuda_says_so_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(root / "apps" / "dqn.py"), "--set", "device=cuda",
                          "--set", "live=False", "--set", f"run_dir='{tmp_path}'"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "reactor: --set device=cuda: learner: device='cuda' needs CUDA, and torch.cuda.is_available() is False on this host; "
        "use device='cpu'"], out.stderr
