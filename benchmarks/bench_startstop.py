"""Start and stop of a training command, as a user at a terminal sees them: reactor against Stable-Baselines3.

Run: ``python benchmarks/bench_startstop.py [--reps 3] [--placement actors]``

reactor: ``reactor run apps/dqn.py --placement actors --set target_return=475`` (the README's main job)
in a pseudo-terminal, so the live table is drawn as a user sees it. From the command's start (the
moment before the process is spawned) to

- the first progress frame (the live table's title on the terminal);
- the start of training (``summary.json``'s ``command_startup_s``: imports, graph, processes, every
  startup reaction), and the training itself (its ``wall_s``);
- the result line (``evaluation return ...; stopped: ...``), and the process's exit.

Targets of issue 19 on a quiet machine: first frame <= 3 s; exit <= 1 s after the result; the whole
command <= 1.3x the run's own training time.

Stable-Baselines3, the way its users start a run: a Python process that imports it, builds
``DQN("MlpPolicy", "CartPole-v1")`` and calls ``learn`` (20k steps, which takes about as long as
reactor's run); the same clock from the command's start to ``learn``'s start, and from its return
to the process's exit. Printed side by side: start overhead and stop overhead, ours / SB3.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import interruptible, positive_int, stop_process  # noqa: E402

REACTOR = str(Path(sys.executable).with_name("reactor"))

SB3 = """
import sys, time
t0 = float(sys.argv[1])
from stable_baselines3 import DQN
import torch
torch.set_num_threads(1)
model = DQN("MlpPolicy", "CartPole-v1", seed=0, learning_starts=1000, verbose=0)
t1 = time.time()
model.learn(total_timesteps=int(sys.argv[2]))
t2 = time.time()
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {t2 - t0:.3f}", flush=True)
"""


def reactor_once(placement: str, tmp: Path) -> dict[str, float]:
    run_dir = tmp / f"run-{time.monotonic_ns()}"
    cmd = [REACTOR, "run", str(ROOT / "apps" / "dqn.py"), "--placement", placement, "--set", "target_return=475",
           f"run_dir={run_dir}"]
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "100", "LINES": "40", "TERM": "xterm-256color"}
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=tmp)
    os.close(slave)
    seen = b""
    first_frame = result = None
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 0.05)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    break
                now = time.time() - t0
                seen += chunk
                if first_frame is None and b"DQN CartPole-v1" in seen:
                    first_frame = now
                if result is None and b"evaluation return" in seen and b"stopped:" in seen:
                    result = now
            elif proc.poll() is not None:
                break
        proc.wait()
        exited = time.time() - t0
    finally:
        # On Ctrl-C (or an error here) the run is stopped and reaped before the caller removes its
        # directory: still stopping, it wrote its checkpoints there after the removal.
        stop_process(proc, group=False)
        os.close(master)
    if proc.returncode != 0 or first_frame is None or result is None:
        raise SystemExit(f"reactor run failed (exit {proc.returncode}):\n{seen.decode(errors='replace')[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"first_frame_s": first_frame, "training_starts_s": summary["command_startup_s"],
            "training_s": summary["wall_s"], "result_s": result, "exit_s": exited,
            "stop_s": exited - result, "command_over_training": exited / summary["wall_s"],
            "env_steps": summary["env_steps"]}


def sb3_once(steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-sb3-") as logdir:  # (SB3's log folder: removed after)
        t0 = time.time()
        out = subprocess.run([sys.executable, "-c", SB3, repr(t0), str(steps)], capture_output=True, text=True,
                             check=True, env={**os.environ, "SB3_LOGDIR": logdir}).stdout
        exited = time.time() - t0
    start, learn, done = map(float, out.split())
    return {"training_starts_s": start, "training_s": learn, "stop_s": exited - done, "exit_s": exited,
            "command_over_training": exited / learn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=positive_int, default=3,
                    help="repetitions, reactor and SB3 alternating (medians reported; default 3)")
    ap.add_argument("--placement", default="actors",
                    help="reactor run's --placement for apps/dqn.py (default actors, the README's main job)")
    ap.add_argument("--sb3-steps", type=positive_int, default=20_000,
                    help="env steps of SB3's DQN learn() (default 20000: about as long as reactor's run)")
    args = ap.parse_args()
    try:
        import stable_baselines3  # noqa: F401
        have_sb3 = True
    except ImportError:
        have_sb3 = False
        print("stable-baselines3 is not installed (pip install -e '.[bench]'): reactor alone", file=sys.stderr)
    ours, theirs = [], []
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.reps):  # alternate: a warm disk cache helps neither more than the other
            ours.append(reactor_once(args.placement, Path(d)))
            print(f"rep {rep}: reactor " + ", ".join(f"{k} {v:.2f}" for k, v in ours[-1].items()), flush=True)
            if have_sb3:
                theirs.append(sb3_once(args.sb3_steps))
                print(f"rep {rep}: SB3     " + ", ".join(f"{k} {v:.2f}" for k, v in theirs[-1].items()), flush=True)

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(f"\nmedians of {args.reps} (reactor run apps/dqn.py --placement {args.placement}; SB3 DQN CartPole-v1 "
          f"{args.sb3_steps} steps):")
    print(f"  reactor: first progress frame {med(ours, 'first_frame_s'):.2f} s (target <= 3), training starts at "
          f"{med(ours, 'training_starts_s'):.2f} s, trains {med(ours, 'training_s'):.1f} s, exits "
          f"{med(ours, 'stop_s'):.2f} s after its result (target <= 1), command / training "
          f"{med(ours, 'command_over_training'):.2f}x (target <= 1.3)")
    if theirs:
        print(f"  SB3:     learn() starts at {med(theirs, 'training_starts_s'):.2f} s, trains "
              f"{med(theirs, 'training_s'):.1f} s, exits {med(theirs, 'stop_s'):.2f} s after learn() returns, "
              f"command / training {med(theirs, 'command_over_training'):.2f}x")
        print(f"  ours / SB3: start {med(ours, 'training_starts_s') / med(theirs, 'training_starts_s'):.2f}x, "
              f"stop {med(ours, 'stop_s') / max(med(theirs, 'stop_s'), 1e-3):.2f}x")


if __name__ == "__main__":
    interruptible(main, "bench_startstop.py")
