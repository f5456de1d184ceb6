"""reactor.replay.device.DeviceReplay and the sum tree's sync-free calls, on the CPU device.

The code is device-generic torch; tests/gpu/ runs the same checks on a GPU where one exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reactor.replay import SumTree
from reactor.replay.device import DeviceReplay

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SPECS = [("obs", (3,), torch.float32), ("action", (), torch.int64)]


def _episodes(lengths: list[int], start_episode: int = 0, start_step: int = 0):
    """Steps of consecutive episodes: obs = [global step, episode, position], action = global step."""
    rows, eps = [], []
    g = start_step
    for e, n in enumerate(lengths, start_episode):
        for k in range(n):
            rows.append((g, e, k))
            eps.append(e)
            g += 1
    obs = torch.tensor(rows, dtype=torch.float32)
    return {"obs": obs, "action": obs[:, 0].long()}, torch.tensor(eps, dtype=torch.int64)


@pytest.mark.parametrize("device", DEVICES)
def test_windows_hold_the_steps_inserted_masked_at_episode_ends_and_the_ring_head(device):
    replay = DeviceReplay(SPECS, capacity=20, window=4, device=device)
    steps, eps = _episodes([7, 5, 9, 6])  # 27 steps: the ring wrapped, steps 0-6 are gone
    replay.insert({k: v[:10] for k, v in steps.items()}, eps[:10])
    replay.insert({k: v[10:] for k, v in steps.items()}, eps[10:])
    assert len(replay) == 20 and replay.inserted == 27
    episode_of = {int(g): int(e) for g, e, _ in steps["obs"].tolist()}
    s = replay.sample(512, torch.Generator(device).manual_seed(0))
    keys, mask, obs = s["keys"].cpu(), s["mask"].cpu(), s["obs"].cpu()
    assert set(keys.tolist()) <= set(range(7, 27)) and len(set(keys.tolist())) == 20  # every live step drawn
    for key, m, o in zip(keys.tolist(), mask, obs):
        want = [key + k < 27 and episode_of[key + k] == episode_of[key] for k in range(4)]
        assert m.tolist() == want
        n = sum(want)
        assert o[:n, 0].tolist() == [float(key + k) for k in range(n)]
        assert bool((o[n:] == 0).all())  # masked positions are zeroed
    assert bool((s["action"].cpu()[mask] == obs[..., 0][mask].long()).all())
    assert s["weights"].dtype == torch.float32 and bool((s["weights"] == 1).all())  # equal priorities


@pytest.mark.parametrize("device", DEVICES)
def test_priorities_steer_sampling_and_weights_correct_for_it(device):
    replay = DeviceReplay(SPECS, capacity=64, window=2, device=device, alpha=1.0, beta=1.0)
    steps, eps = _episodes([64])
    replay.insert(steps, eps)
    keys = torch.arange(64)
    prio = torch.ones(64)
    prio[10] = 64.0  # key 10 holds half of the mass of 127
    replay.update_priorities(keys, prio)
    s = replay.sample(4096, torch.Generator(device).manual_seed(1))
    share = float((s["keys"] == 10).float().mean())
    assert abs(share - 64 / 127) < 0.02
    w = s["weights"].cpu()
    assert torch.allclose(w[s["keys"].cpu() == 10], torch.tensor(1 / 64)) and bool((w[s["keys"].cpu() != 10] == 1).all())


@pytest.mark.parametrize("device", DEVICES)
def test_overwritten_keys_and_bad_priorities_are_not_written_and_check_names_the_refusals(device):
    replay = DeviceReplay(SPECS, capacity=8, window=2, device=device, alpha=1.0, check_every=1000)
    steps, eps = _episodes([8])
    replay.insert(steps, eps)
    replay.update_priorities(torch.tensor([0, 1]), torch.tensor([5.0, 5.0]))
    more, more_eps = _episodes([2], start_episode=1, start_step=8)
    replay.insert(more, more_eps)  # steps 8, 9 overwrite rows 0, 1 (keys 0, 1 are stale now)
    replay.update_priorities(torch.tensor([0, 1, 2, 3, 4]), torch.tensor([100.0, 100.0, float("nan"), -1.0, 3.0]))
    leaves = replay._tree.leaves_async(torch.arange(8)).cpu().tolist()
    # rows 0, 1: the new steps' insert priority (the max seen, 5), not the stale keys' 100;
    # rows 2, 3: NaN and -1 refused, the old 1 kept; row 4: written.
    assert leaves[:5] == [5.0, 5.0, 1.0, 1.0, 3.0]
    with pytest.raises(ValueError, match=r"^DeviceReplay: 2 priorities were not finite or were negative"):
        replay.check()
    replay.check()  # reported once


def test_bad_inputs_are_refused_naming_them():
    with pytest.raises(ValueError, match="capacity \\(3\\) must hold at least one window \\(4\\)"):
        DeviceReplay(SPECS, capacity=3, window=4)
    with pytest.raises(ValueError, match="distinct fields"):
        DeviceReplay(SPECS + SPECS[:1], capacity=8, window=2)
    replay = DeviceReplay(SPECS, capacity=8, window=2)
    with pytest.raises(ValueError, match="nothing inserted yet"):
        replay.sample(4)
    steps, eps = _episodes([3])
    with pytest.raises(ValueError, match=r"field 'obs' is \(3, 2\) torch.float32; expected \[3, 3\]"):
        replay.insert({"obs": steps["obs"][:, :2], "action": steps["action"]}, eps)
    with pytest.raises(ValueError, match=r"needs fields \['action', 'obs'\]"):
        replay.insert({"obs": steps["obs"]}, eps)


@pytest.mark.parametrize("device", DEVICES)
def test_the_sync_free_tree_calls_agree_with_the_checked_ones(device):
    rng = np.random.default_rng(3)
    for capacity, arity in ((1, 2), (37, 4), (1000, 16)):
        a = SumTree(capacity, arity, backend="torch", device=device)
        b = SumTree(capacity, arity, backend="torch", device=device)
        for _ in range(5):
            idx = torch.from_numpy(rng.choice(capacity, size=min(capacity, 50), replace=False))
            prio = torch.from_numpy(rng.random(len(idx)) * (rng.random(len(idx)) > 0.2))
            a.update(idx, prio)
            b.write_async(idx.to(device), prio.to(device))
        assert float(a.total) == pytest.approx(float(b.total_tensor()), rel=1e-12)
        assert float(a.min) == float(b.min_tensor()) or capacity == 1
        if float(a.total) > 0:
            ia, pa = a.sample(257, torch.Generator(device).manual_seed(5))
            ib, pb = b.sample_async(257, torch.Generator(device).manual_seed(5))
            assert torch.equal(ia, ib) and torch.allclose(pa, pb)


def _triton_interpreter() -> bool:
    import os

    from reactor.replay import _devicekernels

    return _devicekernels.triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_interpreter() and not torch.cuda.is_available(),
                    reason="needs Triton: a GPU, or TRITON_INTERPRET=1 with triton installed")
def test_the_triton_kernels_sample_and_gather_exactly_what_the_torch_path_does():
    from reactor.replay import _devicekernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not _devicekernels.available(torch.device(device)):
        pytest.skip("Triton does not run here")
    # Fields of every element size (8, 4, 2, 1 bytes) and a 2-d one.
    specs = SPECS + [("done", (), torch.bool), ("pair", (2,), torch.int16), ("bytes3", (3,), torch.uint8),
                     ("big", (2, 3), torch.float64)]
    replays = {k: DeviceReplay(specs, capacity=300, window=7, device=device, kernels=k, alpha=1.0, beta=0.5)
               for k in ("torch", "triton")}
    steps, eps = _episodes([40, 3, 90, 1, 120, 77, 9])  # 340 steps into 300: wrapped
    g = steps["action"]
    steps.update(done=g % 3 == 0, pair=torch.stack([g, -g], 1).to(torch.int16),
                 bytes3=torch.stack([g % 251, g % 7, 255 - g % 13], 1).to(torch.uint8),
                 big=(g[:, None, None] + torch.arange(6.0).view(2, 3)).double() / 3)
    rng = np.random.default_rng(0)
    keys = torch.arange(40, 340)
    prio = torch.from_numpy(rng.integers(1, 64, size=300).astype(np.float64) / 8)  # exact sums: same draws
    for r in replays.values():
        r.insert(steps, eps)
        r.update_priorities(keys.to(device), prio.to(device))
    a = replays["torch"].sample(500, torch.Generator(device).manual_seed(4))
    b = replays["triton"].sample(500, torch.Generator(device).manual_seed(4))
    assert torch.equal(a["keys"], b["keys"]) and torch.equal(a["mask"], b["mask"])
    for name, _, dtype in specs:
        assert b[name].shape == a[name].shape and b[name].dtype == dtype and torch.equal(a[name], b[name]), name
    assert torch.allclose(a["weights"], b["weights"], rtol=1e-5)
    assert not bool(a["mask"].all()) and bool(a["mask"][:, 0].all())  # some windows cut short, none empty


@pytest.mark.parametrize("device", DEVICES)
def test_every_priority_zero_still_samples_live_rows_and_never_past_the_ring(device):
    replay = DeviceReplay(SPECS, capacity=37, window=3, device=device, arity=4, alpha=1.0)  # leaves padded to 64
    steps, eps = _episodes([37])
    replay.insert(steps, eps)
    replay.update_priorities(torch.arange(37, device=device), torch.zeros(37, device=device))
    s = replay.sample(16, torch.Generator(device).manual_seed(0))
    assert bool((s["keys"] >= 0).all()) and bool((s["keys"] < 37).all())


def test_the_triton_kernels_are_refused_for_an_arity_they_cannot_load_naming_it():
    with pytest.raises(ValueError, match=r"power-of-two arity \(got 6\)"):
        DeviceReplay(SPECS, capacity=64, window=2, arity=6, kernels="triton")
    assert DeviceReplay(SPECS, capacity=64, window=2, arity=6).kernels == "torch"  # auto falls back
