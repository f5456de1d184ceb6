"""Time to solve CartPole-v1 with PPO: reactor's app against Stable-Baselines3, same hyper-parameters.

    python benchmarks/bench_ppo_cartpole.py                          # seeds 0 1 2, single and actors
    python benchmarks/bench_ppo_cartpole.py --seeds 0 1 2 3 4 --placements single

Both sides use RL-Zoo's CartPole-v1 hyper-parameters (8 envs, 32 steps each per update, GAE 0.8,
gamma 0.98, lr 1e-3, 20 epochs of one 256-sample minibatch, clip 0.2, no entropy bonus) and stop at
the first greedy evaluation (10 episodes, 10 envs side by side, every 1,024 env steps) whose mean
return reaches 475. For each seed and side, one fresh process; the table gives

* ``steps``: env steps collected when the solving evaluation ran;
* ``solve_s``: wall-clock seconds from the start of training to that evaluation (reactor: from the
  Metrics node's start, after every node's startup; SB3: from ``learn()``);
* ``process_s``: the whole process, interpreter start and imports included.

Seeds are run alternately (reactor, then SB3) so both see the same load, and the medians are
compared as ratios reactor / SB3. Stable-Baselines3 is not a dependency of this project: without it
the SB3 columns are skipped (``pip install stable-baselines3`` to get them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "ppo_cartpole.py"
TARGET = 475.0


def run_reactor(seed: int, placement: str, run_dir: Path) -> dict[str, float]:
    """One ``reactor run`` of the PPO app in a fresh process."""
    cmd = [sys.executable, "-m", "reactor.cli", "run", str(APP), "--placement", placement, "--seed", str(seed),
           "--set", "live=False", "--set", f"run_dir='{run_dir}'"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    process_s = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    solved = next((e for e in summary["evaluations"] if e["eval_return"] >= TARGET), None)
    if solved is None:
        return {"steps": float("nan"), "solve_s": float("nan"), "process_s": process_s}
    return {"steps": solved["env_steps"], "solve_s": solved["wall_s"], "process_s": process_s}


SB3_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import EvalCallback, StopTrainingOnRewardThreshold
from stable_baselines3.common.env_util import make_vec_env
seed, target = int(sys.argv[1]), float(sys.argv[2])
env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
eval_env = make_vec_env("CartPole-v1", n_envs=10, seed=seed + 1000)
model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
            ent_coef=0.0, learning_rate=1e-3, clip_range=0.2, seed=seed, device="cpu", verbose=0)
stop = StopTrainingOnRewardThreshold(target, verbose=0)
cb = EvalCallback(eval_env, callback_on_new_best=stop, eval_freq=1024 // 8, n_eval_episodes=10,
                  deterministic=True, verbose=0)
t0 = time.perf_counter()
model.learn(100_000, callback=cb)
solve_s = time.perf_counter() - t0
ok = cb.best_mean_reward >= target
print(json.dumps({"steps": model.num_timesteps if ok else float("nan"), "solve_s": solve_s if ok else float("nan")}))
"""


def run_sb3(seed: int) -> dict[str, float] | None:
    """One Stable-Baselines3 run in a fresh process (None: SB3 is not installed)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", SB3_CHILD, str(seed), str(TARGET)], capture_output=True, text=True,
                         timeout=600)
    process_s = time.perf_counter() - t0
    if out.returncode != 0:
        if "No module named 'stable_baselines3'" in out.stderr:
            return None
        raise RuntimeError(f"the SB3 run failed:\n{out.stderr[-2000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_s": process_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--placements", nargs="+", default=["single", "actors"])
    p.add_argument("--no-sb3", action="store_true", help="skip the Stable-Baselines3 runs")
    args = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {pl: [] for pl in args.placements}
    rows["sb3"] = []
    sb3 = not args.no_sb3
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for pl in args.placements:
                r = run_reactor(seed, pl, Path(tmp) / f"{pl}-{seed}")
                rows[pl].append(r)
                print(f"reactor {pl:7s} seed {seed}: {r['steps']:>7.0f} steps  {r['solve_s']:6.2f} s to solve  "
                      f"{r['process_s']:6.2f} s process", flush=True)
            if sb3:
                r = run_sb3(seed)
                if r is None:
                    print("stable-baselines3 is not installed: SB3 runs skipped", flush=True)
                    sb3 = False
                    continue
                rows["sb3"].append(r)
                print(f"sb3             seed {seed}: {r['steps']:>7.0f} steps  {r['solve_s']:6.2f} s to solve  "
                      f"{r['process_s']:6.2f} s process", flush=True)
    print("\nmedians over seeds " + " ".join(map(str, args.seeds)))
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("steps", "solve_s", "process_s")}
           for k, v in rows.items() if v}
    for k, m in med.items():
        line = f"  {k:7s} {m['steps']:>7.0f} steps  {m['solve_s']:6.2f} s to solve  {m['process_s']:6.2f} s process"
        if k != "sb3" and "sb3" in med:
            line += (f"   ratio to SB3: steps {m['steps'] / med['sb3']['steps']:.2f}, solve "
                     f"{m['solve_s'] / med['sb3']['solve_s']:.2f}, process {m['process_s'] / med['sb3']['process_s']:.2f}")
        print(line)


if __name__ == "__main__":
    main()
