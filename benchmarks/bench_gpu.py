"""GEAR on the GPU (issue 18): replay where the data lives, learner updates, a large sequence model.

Part 1, replay: a :class:`reactor.replay.device.DeviceReplay` of 1M steps (obs float32[128], action
int64, reward float32, terminated bool: 525 bytes a step; episodes of 50-500 steps) on the GPU.
Inserts from the host through pinned staging (GB/s beside a plain pinned host-to-device copy of the
same bytes); prioritized window samples of B x 64 steps, gathered on the device, as one CUDA-graph
replay and as plain calls (GB/s of gathered output beside a device-to-device copy of the same bytes:
the target is >= 50%); and TorchRL's LazyTensorStorage on CUDA with its PrioritizedSliceSampler on the
same data (windows/s, ratio).

Part 1b, replies: what a Replay shard in GPU memory pays to answer a requester in another process (the
window gather on the GPU, then the host copy the reply carries: pageable against pinned), beside a shard
in host memory.

Part 2, learners: updates/s of the DQN (CartPole, batch 128) and SAC (Pendulum, batch 256) learn
fragments on the GPU, eager against torch.compile (default and "reduce-overhead": CUDA graphs), and
what ``compile="auto"`` (reactor.nodes._device.LearnStep) chooses; batches already on the device.

Part 3, a large sequence model: transformer_dqn's decoder-only Q-transformer at 57M parameters
(d_model 768, 8 layers, window 64), bf16 autocast, learning on B windows of 65 steps sampled by
priority from a DeviceReplay on the GPU (priorities written back) against the same updates on one
pre-made batch already on the device: tokens/s both, and the replay's share of the step (target <= 10%).

Run on a GPU:   python benchmarks/bench_gpu.py [--parts replay,torchrl,replies,learners,transformer]
Smoke run here: python benchmarks/bench_gpu.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._common import interruptible, names_of  # noqa: E402
from reactor.replay.device import DeviceReplay  # noqa: E402

OBS = 128
SPECS = [("obs", (OBS,), torch.float32), ("action", (), torch.int64), ("reward", (), torch.float32),
         ("terminated", (), torch.bool)]
ROW_BYTES = OBS * 4 + 8 + 4 + 1


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], dev: torch.device, iters: int, reps: int = 5) -> float:
    """Median over ``reps`` of the seconds per call of ``iters`` calls (device events on CUDA)."""
    fn()
    sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t) / iters)
    return statistics.median(out)


def episodes(n: int, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(50, 501, size=n // 50 + 1)
    ep = np.repeat(np.arange(len(lengths)), lengths)[:n]
    steps = {"obs": torch.randn(n, OBS), "action": torch.randint(0, 4, (n,)), "reward": torch.randn(n),
             "terminated": torch.from_numpy(np.r_[ep[1:] != ep[:-1], True])}
    return steps, torch.from_numpy(ep)


def part_replay(dev: torch.device, quick: bool, batches: list[int], t_len: int) -> dict[str, float]:
    from reactor.replay import _devicekernels

    out: dict[str, float] = {}
    kinds = ["torch"] + (["triton"] if _devicekernels.available(dev) else [])
    for kernels in kinds:
        out.update(_replay_figures(dev, quick, batches, t_len, kernels))
    return out


def _replay_figures(dev: torch.device, quick: bool, batches: list[int], t_len: int, kernels: str) -> dict[str, float]:
    cap = (1 << 14) if quick else (1 << 20)
    steps, ep = episodes(cap, 0)
    replay = DeviceReplay(SPECS, cap, t_len, device=dev, staging_rows=65536, kernels=kernels)
    print(f"-- DeviceReplay kernels={kernels}")
    chunk = 65536
    sync(dev)
    t0 = time.perf_counter()
    for lo in range(0, cap, chunk):
        replay.insert({k: v[lo:lo + chunk] for k, v in steps.items()}, ep[lo:lo + chunk])
    sync(dev)
    ins = time.perf_counter() - t0
    gbps_ins = cap * ROW_BYTES / ins / 1e9
    line = f"insert {cap} steps from the host, chunks of {chunk}: {cap / ins / 1e6:.2f} M steps/s, {gbps_ins:.2f} GB/s"
    if dev.type == "cuda":
        pinned = torch.empty(chunk * ROW_BYTES, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty_like(pinned, device=dev)
        s = timed(lambda: dst.copy_(pinned, non_blocking=True), dev, 20)
        pageable = torch.empty(chunk * ROW_BYTES, dtype=torch.uint8)
        s2 = timed(lambda: dst.copy_(pageable), dev, 20)
        line += (f"; H2D copy of the same bytes: from pinned memory {chunk * ROW_BYTES / s / 1e9:.2f} GB/s, "
                 f"from pageable memory {chunk * ROW_BYTES / s2 / 1e9:.2f} GB/s")
    print(line)
    # Priorities spread over two decades, as after some learning.
    keys = torch.arange(cap, device=dev)
    replay.update_priorities(keys, torch.from_numpy(np.random.default_rng(1).uniform(0.01, 10, cap)).to(dev))
    replay.check()
    out = {}
    for b in batches:
        nbytes = b * t_len * ROW_BYTES  # gathered fields (mask, weights, keys beside: < 1%)
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        s_copy = timed(lambda dst=dst, src=src: dst.copy_(src), dev, 50)
        plain = replay.sampler(b, graphed=False)
        s_plain = timed(plain, dev, 20 if quick else 50)
        graphed = replay.sampler(b, graphed=True)
        s_graph = timed(graphed, dev, 20 if quick else 200)
        best = min(s_plain, s_graph)
        upd_keys = graphed()["keys"].clone()
        prio = torch.rand(b, device=dev) + 0.01
        s_upd = timed(lambda k=upd_keys, p=prio: replay.update_priorities(k, p), dev, 20 if quick else 100)
        upd = replay.updater(b)
        s_upd_g = timed(lambda k=upd_keys, p=prio, upd=upd: upd(k, p), dev, 20 if quick else 100)
        print(f"sample {b}x{t_len} windows ({nbytes / 1e6:.1f} MB): graphed {s_graph * 1e6:8.1f} us "
              f"({nbytes / s_graph / 1e9:7.1f} GB/s), plain {s_plain * 1e6:8.1f} us ({nbytes / s_plain / 1e9:7.1f} GB/s); "
              f"device copy of the same bytes {s_copy * 1e6:7.1f} us ({nbytes / s_copy / 1e9:7.1f} GB/s): "
              f"ours/copy = {s_copy / best:.2f} (target >= 0.50); priority update {s_upd * 1e6:.1f} us plain, "
              f"{s_upd_g * 1e6:.1f} us graphed")
        key = f"windows_per_s_{b}"
        out[key] = max(out.get(key, 0.0), b / best)
        if kernels != "torch" and dev.type == "cuda":
            try:
                _breakdown(replay, b, s_copy)
            except Exception as e:  # a diagnostic: never the bench's end
                print(f"  breakdown failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return out


def _graph_time(work: Callable[[], Any], dev: torch.device, inner: int = 20) -> float:
    """Device seconds a call of ``work``, captured ``inner`` times in one CUDA graph (no launch gaps)."""
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(2):
            work()
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            work()
    return timed(g.replay, dev, 10) / inner


def _breakdown(replay: DeviceReplay, b: int, s_copy: float) -> None:
    """Where a Triton sample's time goes: each kernel alone, in graphs of 20 back-to-back calls."""
    from reactor.replay import _devicekernels as k

    dev = replay.device
    sums = replay._tree.device_layout()[0]
    rand = torch.rand(b, dtype=torch.float64, device=dev)
    parts = {"torch.rand": lambda: torch.rand(b, dtype=torch.float64, device=dev)}
    for block in (8, 16, 32, 128):
        parts[f"descend block={block}"] = lambda block=block: k.descend(
            sums, replay._level_offsets, replay._level_live, replay._tree.min_tensor(), rand, replay._step_of,
            replay._arity, replay._depth, replay.beta, block)
    rows, keys, _ = k.descend(sums, replay._level_offsets, replay._level_live, replay._tree.min_tensor(), rand,
                              replay._step_of, replay._arity, replay._depth, replay.beta)
    parts["gather, one launch per field"] = lambda: k.gather(replay.fields, rows, keys, replay._step_of,
                                                            replay._episode_of, replay.window)
    line = []
    for label, work in parts.items():
        try:
            line.append(f"{label} {_graph_time(work, dev) * 1e6:.1f} us")
        except Exception as e:
            line.append(f"{label} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    print(f"  breakdown {b}x{replay.window} (graphs of 20 back-to-back calls; device copy {s_copy * 1e6:.1f} us): "
          + "; ".join(line))


def part_torchrl(dev: torch.device, quick: bool, batches: list[int], t_len: int, ours: dict[str, float]) -> None:
    try:
        import torchrl
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedSliceSampler, TensorDictReplayBuffer
    except Exception as e:  # the peer is optional
        print(f"peer TorchRL: did not load: {type(e).__name__}: {str(e)[:300]}")
        return
    cap = (1 << 14) if quick else (1 << 20)
    steps, ep = episodes(cap, 0)
    data = TensorDict({**steps, "episode": ep}, batch_size=[cap])
    prio = torch.from_numpy(np.random.default_rng(1).uniform(0.01, 10, cap).astype(np.float32))
    for b in batches:
        try:
            rb = TensorDictReplayBuffer(
                storage=LazyTensorStorage(cap, device=dev),
                sampler=PrioritizedSliceSampler(max_capacity=cap, alpha=0.6, beta=0.4, slice_len=t_len,
                                                traj_key="episode", strict_length=False),
                batch_size=b * t_len)
            rb.extend(data)
            rb.update_priority(torch.arange(cap), prio)

            def sample(rb: Any = rb) -> None:
                rb.sample()
                sync(dev)

            s = timed(sample, torch.device("cpu"), 3 if quick else 10, reps=3)
            mine = ours.get(f"windows_per_s_{b}")
            ratio = f"; ours/peer = {mine / (b / s):.0f}x" if mine else ""
            print(f"peer TorchRL {torchrl.__version__} LazyTensorStorage({dev}) + PrioritizedSliceSampler {b}x{t_len}: "
                  f"{s * 1e3:.2f} ms a sample, {b / s:.0f} windows/s{ratio}")
        except Exception as e:
            print(f"peer TorchRL {b}x{t_len}: failed to run: {type(e).__name__}: {str(e)[:300]}")


def _batch_for(algo: str, dev: torch.device, b: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if algo == "dqn":
        obs_dim, action = 4, torch.randint(0, 2, (b,), generator=g)
    else:
        obs_dim, action = 3, torch.rand(b, 1, generator=g) * 4 - 2
    batch = {"obs": torch.randn(b, obs_dim, generator=g), "action": action, "reward": torch.randn(b, generator=g),
             "discount": torch.full((b,), 0.97), "next_obs": torch.randn(b, obs_dim, generator=g),
             "next_terminated": torch.rand(b, generator=g) < 0.05, "weights": torch.rand(b, generator=g) + 0.5}
    return {k: v.to(dev) for k, v in batch.items()}


def part_replies(dev: torch.device, quick: bool) -> None:
    """What a Replay shard with memory="cuda" pays to answer a requester in another process: the
    window gather on the GPU, then the copy to host memory the reply carries, pageable (one
    ``.to("cpu")`` per field, as before) against pinned (``reactor.nodes.replay._to_pinned_host``); beside
    it, the same reply from a shard in host memory (``Storage.read_windows`` on the CPU)."""
    from reactor.nodes.replay import _to_pinned_host
    from reactor.replay import FieldSpec, Storage

    if dev.type != "cuda":
        print("replies: a GPU shard's replies need a GPU; skipped")
        return

    cap = (1 << 14) if quick else (1 << 20)
    specs = [FieldSpec("obs", (64,), torch.float32), FieldSpec("action", (), torch.int64),
             FieldSpec("reward", (), torch.float32), FieldSpec("terminated", (), torch.bool)]
    rng = np.random.default_rng(3)
    stores = {"host": Storage(specs, cap), "cuda": Storage(specs, cap, device=str(dev))}
    lengths = rng.integers(20, 400, size=cap // 20 + 1)
    ends = np.zeros(cap, bool)
    ends[np.cumsum(lengths)[np.cumsum(lengths) < cap] - 1] = True
    ends[-1] = True
    for st in stores.values():
        for lo in range(0, cap, 65536):
            hi = min(cap, lo + 65536)
            st.append({"obs": torch.randn(hi - lo, 64), "action": torch.zeros(hi - lo, dtype=torch.int64),
                       "reward": torch.zeros(hi - lo), "terminated": torch.from_numpy(ends[lo:hi].copy())},
                      episode_end=ends[lo:hi].copy())
    for b in ([64] if quick else [256, 1024]):
        keys = rng.integers(0, cap, size=b)
        nbytes = b * 32 * 269

        def host(keys: np.ndarray = keys) -> Any:
            return stores["host"].read_windows(keys, 32)

        def pageable(keys: np.ndarray = keys) -> Any:
            return {k: v.to("cpu") for k, v in stores["cuda"].read_windows(keys, 32).items()}

        def pinned(keys: np.ndarray = keys) -> Any:
            return _to_pinned_host(stores["cuda"].read_windows(keys, 32))

        got = {label: timed(fn, torch.device("cpu"), 10 if quick else 50) for label, fn in
               (("host shard", host), ("GPU shard, pageable copies", pageable), ("GPU shard, pinned copies", pinned))}
        a, bb = pageable(), pinned()
        assert all(torch.equal(a[k], bb[k]) for k in a)
        print(f"reply of {b}x32 windows ({nbytes / 1e6:.1f} MB): " + "; ".join(
            f"{k} {v * 1e6:.0f} us ({nbytes / v / 1e9:.1f} GB/s)" for k, v in got.items())
            + f"; pinned/pageable speed {got['GPU shard, pageable copies'] / got['GPU shard, pinned copies']:.2f}x, "
              f"pinned GPU shard / host shard {got['host shard'] / got['GPU shard, pinned copies']:.2f}x")


def part_learners(dev: torch.device, quick: bool) -> None:
    import gymnasium as gym

    from reactor.algos import get_algorithm
    from reactor.nodes._device import LearnStep

    torch._dynamo.config.cache_size_limit = 64
    for algo, env_id, b in (("dqn", "CartPole-v1", 128), ("sac", "Pendulum-v1", 256)):
        mod = get_algorithm(algo)
        env = gym.make(env_id)
        batch = _batch_for(algo, dev, b)
        results = {}
        modes: list[tuple[str, Any]] = [("eager", None)]
        if dev.type == "cuda" or not quick:
            modes += [("compiled", "default"), ("compiled-cudagraphs", "reduce-overhead")]
        for label, mode in modes:
            state = mod.init(env.observation_space, env.action_space, mod.Config(), 0, device=dev)
            fn = mod.learn if mode is None else torch.compile(mod.learn, mode=mode)
            try:
                t0 = time.perf_counter()
                for _ in range(3):
                    fn(state, batch)
                sync(dev)
                first = time.perf_counter() - t0
                s = timed(lambda fn=fn, state=state, batch=batch: fn(state, batch), dev, 20 if quick else 200, reps=3)
                results[label] = s
                print(f"{algo} learn on {dev} batch {b}: {label:20s} {1 / s:9.0f} updates/s ({s * 1e3:.3f} ms; "
                      f"first 3 calls {first:.1f} s)")
            except Exception as e:
                print(f"{algo} learn {label}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        if "eager" in results and len(results) > 1:
            best = min(results, key=results.__getitem__)
            print(f"{algo}: fastest {best}, {results['eager'] / results[best]:.2f}x eager")
        state = mod.init(env.observation_space, env.action_space, mod.Config(), 0, device=dev)
        step = LearnStep(mod.learn, "auto", dev, f"{algo}-learner")
        for _ in range(30):
            step(state, batch)
        print(f"{algo}: compile='auto' chose {step.choice} "
              f"({', '.join(f'{k} {v * 1e3:.3f} ms' for k, v in step.timings.items()) or 'no trial on this device'})")


def part_transformer(dev: torch.device, quick: bool) -> None:
    import gymnasium as gym

    from reactor.algos import transformer_dqn as tdqn

    window = 16 if quick else 64
    cfg = tdqn.Config(window=window, d_model=64 if quick else 768, n_heads=4 if quick else 12,
                      n_layers=2 if quick else 8, d_ff=128 if quick else 3072, bf16=True)
    obs_space = gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    act_space = gym.spaces.Discrete(2)
    b = 8 if quick else 32
    specs = [("obs", (4,), torch.float32), ("action", (), torch.int64), ("reward", (), torch.float32),
             ("terminated", (), torch.bool)]
    cap = (1 << 14) if quick else (1 << 20)
    rng = np.random.default_rng(2)
    lengths = rng.integers(20, 501, size=cap // 20 + 1)
    ep = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)[:cap])
    steps = {"obs": torch.randn(cap, 4), "action": torch.randint(0, 2, (cap,)), "reward": torch.rand(cap),
             "terminated": torch.cat([ep[1:] != ep[:-1], torch.ones(1, dtype=torch.bool)])}
    replay = DeviceReplay(specs, cap, window + 1, device=dev, staging_rows=65536)
    for lo in range(0, cap, 65536):
        replay.insert({k: v[lo:lo + 65536] for k, v in steps.items()}, ep[lo:lo + 65536])
    sampler = replay.sampler(b)
    updater = replay.updater(b)
    fixed = {k: v.clone() for k, v in sampler().items()}
    runs: dict[str, Callable[[], None]] = {}
    params = 0
    for label in ("pre-made batch", "sampled from the GPU shard"):
        torch.manual_seed(0)
        state = tdqn.init(obs_space, act_space, cfg, 0, device=dev)
        params = sum(p.numel() for p in state.q.parameters())

        def step(label: str = label, state: Any = state) -> None:
            if label == "pre-made batch":
                tdqn.learn(state, fixed)
            else:
                s = sampler()
                _, prio = tdqn.learn(state, s)
                updater(s["keys"], prio)

        runs[label] = step
    # The two interleaved rep by rep, so a drift of the machine during the run lands on both.
    per: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(2 if quick else 5):
        for label, step in runs.items():
            per[label].append(timed(step, dev, 3 if quick else 10, reps=1))
    results = {label: statistics.median(v) for label, v in per.items()}
    prio = torch.rand(b, device=dev) + 0.01

    def replay_only() -> None:
        updater(sampler()["keys"], prio)

    s_alone = timed(replay_only, dev, 20 if quick else 200)
    tokens = b * window
    s_fixed, s_replay = results["pre-made batch"], results["sampled from the GPU shard"]
    print(f"transformer_dqn {params / 1e6:.1f}M parameters, window {window}, batch {b} ({tokens} tokens), bf16 autocast "
          f"on {dev}: pre-made {tokens / s_fixed:9.0f} tokens/s ({s_fixed * 1e3:.1f} ms), from replay "
          f"{tokens / s_replay:9.0f} tokens/s ({s_replay * 1e3:.1f} ms): replay share of the step "
          f"{max(0.0, 1 - s_fixed / s_replay) * 100:.1f}% (target <= 10%); sample + priority update alone "
          f"{s_alone * 1e3:.3f} ms (kernels={replay.kernels})")


PARTS = ("replay", "torchrl", "replies", "learners", "transformer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --quick: a smoke run)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--parts", default=",".join(PARTS), type=names_of(PARTS),
                    help=f"comma-separated, from {','.join(PARTS)} (default: all)")
    a = ap.parse_args()
    try:
        dev = torch.device(a.device)
    except RuntimeError as e:
        ap.error(f"--device {a.device!r}: {e}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA device here (torch {torch.__version__}"
                 f"{', built without CUDA' if torch.version.cuda is None else ''}); run it on a GPU, or "
                 f"--device cpu --quick for a smoke run of the script")
    if dev.type not in ("cuda", "cpu"):
        ap.error(f"--device {a.device}: cuda or cpu")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device {dev}: {name}; torch {torch.__version__}"
          + ("; --quick: small sizes (a smoke run), not the settings of docs/benchmarks.md" if a.quick else ""))
    parts = set(a.parts)
    batches = [64] if a.quick else [256, 1024]
    t_len = 16 if a.quick else 64
    ours: dict[str, float] = {}
    if "replay" in parts:
        ours = part_replay(dev, a.quick, batches, t_len)
    if "torchrl" in parts:
        part_torchrl(dev, a.quick, batches, t_len, ours)
    if "replies" in parts:
        part_replies(dev, a.quick)
    if "learners" in parts:
        part_learners(dev, a.quick)
    if "transformer" in parts:
        part_transformer(dev, a.quick)


if __name__ == "__main__":
    interruptible(main, "bench_gpu.py")
