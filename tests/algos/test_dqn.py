"""DQN's fragments (``reactor.algos.dqn``) driven directly on tensors."""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import pytest
import torch

from reactor.algos import dqn

OBS = gym.spaces.Box(-1.0, 1.0, (4,), dtype=np.float32)
ACT = gym.spaces.Discrete(2)


def _batch(b: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"obs": torch.randn(b, 4, generator=g) * 5, "action": torch.randint(2, (b,), generator=g),
            "reward": torch.rand(b, generator=g) * 100, "next_obs": torch.randn(b, 4, generator=g),
            "next_terminated": torch.zeros(b, dtype=torch.bool), "discount": torch.full((b,), 0.97),
            "weights": torch.ones(b)}


def test_max_grad_norm_zero_turns_clipping_off_and_still_reports_the_norm():
    """An infinite max_grad_norm was the only way to turn DQN's clipping off, and configs now refuse
    infinities: 0 turns it off, as in PPO and the transformer agent."""
    after = {}
    for norm in (0.0, 1e30, 1e-3):
        state = dqn.init(OBS, ACT, dqn.Config.from_dict({"max_grad_norm": norm}), seed=0)
        metrics, _ = dqn.learn(state, _batch())
        after[norm] = ([p.detach().clone() for p in state.q.parameters()], metrics["grad_norm"])
    for a, b in zip(after[0.0][0], after[1e30][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert after[0.0][1] == after[1e30][1] == after[1e-3][1] > 1e-3  # the norm before clipping, each time
    assert any(not torch.equal(a, b) for a, b in zip(after[0.0][0], after[1e-3][0]))


@pytest.mark.parametrize(("field", "value", "rule"), [
    ("hidden", -3, "an int >= 1"), ("hidden", 0, "an int >= 1"), ("n_step", 0, "an int >= 1"),
    ("target_every", 0, "an int >= 1"), ("eps_decay_steps", -1, "an int >= 0"), ("gamma", 1.5, "in [0, 1]"),
    ("eps_end", -0.1, "in [0, 1]"), ("tau", 0.0, "in (0, 1]"), ("lr", 0.0, "> 0 and finite"),
    ("priority_eps", -1e-3, "> 0 and finite"),
])
def test_a_config_value_out_of_its_range_is_refused_naming_the_field(field, value, rule):
    """`--set hidden=-3` printed torch's traceback from inside the network's constructor, and `lr=0` or
    `target_every=0` (a ZeroDivisionError at the first update) got as far as the learner."""
    with pytest.raises(ValueError, match=rf"^dqn Config\.{field} must be {re.escape(rule)}, got {re.escape(repr(value))}$"):
        dqn.Config.from_dict({field: value})
    with pytest.raises(ValueError, match=rf"^dqn Config\.{field} must be"):
        dqn.Config(**{field: value})  # built directly too
    assert dqn.Config.from_dict({}) == dqn.Config()  # the defaults pass


def test_an_infinite_rate_built_directly_is_refused():
    """from_dict refuses every infinity; a Config built directly took lr=inf (every loss then NaN)."""
    with pytest.raises(ValueError, match=r"^dqn Config\.lr must be > 0 and finite, got inf$"):
        dqn.Config(lr=float("inf"))


@pytest.mark.parametrize("dueling", [True, False])
def test_the_q_network_computes_what_its_layer_modules_compute_to_the_bit(dueling):
    """QNetwork.forward calls its layers' functions on their parameters (no submodule __call__): the
    values must be the modules' own, bit for bit, or runs would no longer repeat the runs before it."""
    net = dqn._network(OBS, ACT, dqn.Config(hidden=32, dueling=dueling))
    for b in (1, 2, 10, 128):
        x = torch.randn(b, 4, generator=torch.Generator().manual_seed(b))
        h = net.torso(x)
        a = net.advantage(h)
        want = a if net.value is None else net.value(h) + a - a.mean(dim=-1, keepdim=True)
        assert torch.equal(net(x), want)
