"""Time to solve (issue 5): reactor's DQN, PPO and SAC apps against Stable-Baselines3 with RL-Zoo settings.

    python benchmarks/bench_training.py                          # dqn,ppo,sac; seeds 0,1,2; scaling
    python benchmarks/bench_training.py --algos dqn --seeds 0,1,2,3,4 --budget-s 900
    python benchmarks/bench_training.py --quick                  # one seed, small budgets: plumbing check

**What is measured.** For each algorithm, seed and side (ours under ``--placement single``, ours
under ``--placement actors`` in deterministic mode (the default) and in async mode (``--async``:
the actor processes and the learner run free, side by side on the cores), SB3), one fresh run trains until the first greedy evaluation
(10 episodes side by side, deterministic actions) whose mean return reaches the threshold
(CartPole-v1 475, Pendulum-v1 -200). The figure is the wall clock from the start of training to
that evaluation, and the env steps taken by then. Both sides evaluate at the same cadence in env
steps (ours: every ``eval_every_updates`` learner updates of the app, converted to env steps; SB3:
a callback every that many env steps).

* **Evaluation time is included on both sides.** Ours evaluates inside the run (the Evaluator
  node, in the learner's process under ``actors``, in the only process under ``single``) and its
  summary gives no evaluation time to subtract; SB3's callback evaluates inline, so its clock runs
  through evaluations too. SB3's own evaluation share is printed (``sb3 eval share``) so the reader
  sees how much of its figure it is.
* **Start of the clock.** Ours: the Metrics node's startup (every node of the graph is built and
  started; process spawn and imports come before it). SB3: the first callback event of ``learn()``
  (model and envs built). ``process_s`` (interpreter start to exit) is printed for both.
* **Budgets.** Both sides get RL-Zoo's ``n_timesteps`` as the env-step budget (SB3's linear schedules
  run over it, as in the zoo) and ``--budget-s`` seconds of training wall clock. A run that has not
  reached the threshold within both is "not reached", printed as ``-``, and counts as +infinity in
  the median (a median is a number only when more than half the seeds reached).
* **Ours** is each app as it is (its own Config and algorithm defaults, not the zoo's); the
  benchmark sets only ``target_return``, ``max_env_steps``, ``run_dir`` and ``live``.
* **Env steps** at an evaluation: SB3's ``num_timesteps``; ours the actors' summed ``env_steps``
  reports (each actor reports every 250 vector steps, so ours lags by up to 250 x envs_per_actor
  per actor). After the step budget, ours' off-policy learner drains the updates its rate limiter
  still allows; only the first evaluation at the budget counts, as SB3 stops there.
* **Ratio** = median(ours) / median(SB3) of the wall clock to threshold, lower is better; issue-5
  targets: <= 0.5x for DQN and SAC, <= 1x for PPO.
* **Actor scaling.** Env steps/s of ours under ``--placement actors`` with 2 actor processes
  against 1 (target >= 1.6x), each actor stepping the app's ``envs_per_actor`` envs for the same
  number of env steps. ``--scaling acting`` (default) keeps the learner idle (``min_size`` above the
  step budget): the actors step, act with the policy and write to the replay shards, so the figure
  is the actors' throughput. ``--scaling training`` keeps learning on; the rate limiter then ties
  env steps to learner updates (``samples_per_insert``), so the ratio shows the learner's limit,
  not the actors'. The rate is the slope of the actors' ``env_steps`` reports in ``metrics.csv``
  (first to last report), which leaves out startup and shutdown. The runs use ``--async``
  (``--scaling-runtime deterministic`` for the other mode): in deterministic mode every actor step
  waits for its peers' promises of logical time, so the synchronisation, not the CPU, sets the rate
  (measured here: async 9.2k -> 16.4k env steps/s for 1 -> 2 actors, deterministic 4.4k -> 4.7k).
  ``--scaling-reps`` repetitions alternate the order of 1 and 2 actors; medians are reported.

**Peer settings** (rl-baselines3-zoo 2.9.2 ``hyperparams/*.yml``, checked in the wheel): DQN
CartPole-v1 and PPO CartPole-v1 as in the zoo (the PPO ``lin_`` lr and clip: SB3
``LinearSchedule(v, 0, 1)``, i.e. the zoo's ``progress_remaining * v``); SAC Pendulum-v1: the zoo
sets only ``n_timesteps 20000`` and ``learning_rate 1e-3``; everything else is SB3's SAC default
(``learning_starts 100``, batch 256, buffer 1e6, tau 0.005, net [256, 256], auto entropy).

Every process runs torch on one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``). Seeds
run side after side (ours single, ours actors, ours async, SB3) so that all see the same machine load.
Stable-Baselines3 is the ``bench`` extra: ``pip install 'stable-baselines3>=2.3'``; without it the
SB3 columns read ``n/a``.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import interruptible, names_of, positive_float, positive_int, stop_process  # noqa: E402

EVAL_EPISODES = 10
#: Seconds a run's process may take beyond --budget-s (spawning, imports, building, shutdown).
PROCESS_GRACE_S = 120.0


# ------------------------------------------------------------------------------ the algorithms


def _sb3_dqn(seed: int) -> Any:
    """RL-Zoo DQN CartPole-v1 (hyperparams/dqn.yml)."""
    from stable_baselines3 import DQN
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("CartPole-v1", n_envs=1, seed=seed)
    return DQN("MlpPolicy", env, learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1000,
               gamma=0.99, target_update_interval=10, train_freq=256, gradient_steps=128,
               exploration_fraction=0.16, exploration_final_eps=0.04, policy_kwargs={"net_arch": [256, 256]},
               seed=seed, device="cpu", verbose=0)


def _sb3_ppo(seed: int) -> Any:
    """RL-Zoo PPO CartPole-v1 (hyperparams/ppo.yml; ``lin_x``: x * progress_remaining)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.utils import LinearSchedule

    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    return PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0,
               learning_rate=LinearSchedule(1e-3, 0.0, 1.0), clip_range=LinearSchedule(0.2, 0.0, 1.0),
               seed=seed, device="cpu", verbose=0)


def _sb3_sac(seed: int) -> Any:
    """RL-Zoo SAC Pendulum-v1 (hyperparams/sac.yml sets only lr; SB3 defaults otherwise)."""
    from stable_baselines3 import SAC
    from stable_baselines3.common.env_util import make_vec_env

    env = make_vec_env("Pendulum-v1", n_envs=1, seed=seed)
    return SAC("MlpPolicy", env, learning_rate=1e-3, seed=seed, device="cpu", verbose=0)


def _off_policy_updates_per_step(cfg: Any) -> float:
    # The replay's rate limiter fixes sampled items per inserted step: samples_per_insert / batch_size
    # updates per env step once min_size steps are stored.
    return cfg.samples_per_insert / cfg.batch_size


def _ppo_updates_per_step(cfg: Any) -> float:
    rollout = cfg.algo_config["rollout_length"]  # the CartPole preset's (the resolved config)
    return 1.0 / (cfg.actors * cfg.envs_per_actor * rollout)


def _off_policy_acting_only(total_steps: int) -> dict[str, Any]:
    # min_size above what the actors will insert: the learner never samples, so no update (and no
    # rate limit) paces the actors; capacity holds every step so nothing is evicted either.
    room = 2 * total_steps + 10_000
    return {"min_size": room, "capacity": room}


@dataclass(frozen=True)
class Algo:
    """One row of the benchmark: our app and its SB3 peer.

    Args:
        app: our app file, relative to the repository root.
        env: gymnasium id (both sides).
        threshold: mean greedy evaluation return that counts as solved.
        max_env_steps: env-step budget of a run on both sides (RL-Zoo ``n_timesteps``).
        quick_env_steps: the budget under ``--quick``.
        updates_per_env_step: learner updates per env step of the app, from its Config (turns the
            app's ``eval_every_updates`` into env steps, SB3's evaluation period).
        sb3: builds the SB3 model for a seed (RL-Zoo hyper-parameters).
        acting_only: ``--set`` overrides that keep the learner idle for an actor-throughput run of
            this many env steps in all (None: the algorithm cannot act without learning, e.g.
            synchronous PPO, and gets no scaling figure).
    """

    app: str
    env: str
    threshold: float
    max_env_steps: int
    quick_env_steps: int
    updates_per_env_step: Callable[[Any], float]
    sb3: Callable[[int], Any]
    acting_only: Callable[[int], dict[str, Any]] | None = None


ALGOS: dict[str, Algo] = {
    "dqn": Algo("apps/dqn.py", "CartPole-v1", 475.0, 50_000, 6_000, _off_policy_updates_per_step,
                _sb3_dqn, _off_policy_acting_only),
    "ppo": Algo("apps/ppo.py", "CartPole-v1", 475.0, 100_000, 12_288, _ppo_updates_per_step, _sb3_ppo),
    "sac": Algo("apps/sac.py", "Pendulum-v1", -200.0, 20_000, 3_000, _off_policy_updates_per_step,
                _sb3_sac, _off_policy_acting_only),
}


def _app_config(path: str) -> Any:
    """The app's resolved default Config (its env's preset applied), as `reactor run` makes it."""
    from reactor.launch._app import load_app, make_config

    return make_config(load_app(ROOT / path), {})


def eval_every_env_steps(algo: Algo) -> int:
    """The app's evaluation period in env steps (its default Config), SB3's evaluation period."""
    cfg = _app_config(algo.app)
    return max(1, round(cfg.eval_every_updates / algo.updates_per_env_step(cfg)))


# ------------------------------------------------------------------------------ one run each


@dataclass
class Result:
    """One training run. ``wall_s``/``env_steps``: at the first evaluation reaching the threshold
    (None: not reached within the budgets). ``note``: why not, or what else to know."""

    wall_s: float | None
    env_steps: float | None
    process_s: float
    best: float | None
    note: str = ""
    eval_s: float | None = None  # SB3 only: evaluation time inside wall_s
    failed: bool = False  # the process failed: printed as "fail", a not-reached run in the medians


def _run_process(cmd: list[str], timeout_s: float) -> tuple[int | None, str, float]:
    """Run ``cmd`` in its own process group; stop the group after ``timeout_s``, or when this process is
    interrupted (Ctrl-C does not reach a group of its own: without this the run went on, orphaned, and
    wrote its checkpoints into the benchmark's temporary directory after its removal).

    Returns:
        (exit status or None when it was stopped, stdout + stderr tail, seconds).
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        out, code = stop_process(proc, group=True), None
    finally:
        if proc.poll() is None:  # (interrupted: Ctrl-C, or an error in this process)
            print(f"stopping the run in progress (pid {proc.pid}) ...", file=sys.stderr, flush=True)
            stop_process(proc, group=True)
        if proc.stdout is not None:
            proc.stdout.close()
    return code, (out or "")[-3000:], time.perf_counter() - t0


def run_ours(algo: Algo, seed: int, placement: str, run_dir: Path, max_env_steps: int, budget_s: float,
             asynchronous: bool = False) -> Result:
    """One ``reactor run`` of the app in a fresh process (``--async`` if asked); reads ``RUN_DIR/summary.json``.

    Raises:
        RuntimeError: the run failed (exit status not 0), with its output's tail.
    """
    sets = {"live": False, "run_dir": str(run_dir), "target_return": algo.threshold, "max_env_steps": max_env_steps}
    cmd = [sys.executable, "-m", "reactor.cli", "run", algo.app, "--seed", str(seed), "--placement", placement]
    cmd += ["--async"] if asynchronous else []
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v!r}"]
    code, out, process_s = _run_process(cmd, budget_s + PROCESS_GRACE_S)
    summary_path = run_dir / "summary.json"
    if code not in (0, None):
        raise RuntimeError(f"{' '.join(cmd)} exited with {code}:\n{out}")
    if not summary_path.exists():
        return Result(None, None, process_s, None, f"killed after {budget_s + PROCESS_GRACE_S:.0f} s, no summary")
    summary = json.loads(summary_path.read_text())
    evals = summary["evaluations"]
    # Once the actors have taken max_env_steps, an off-policy learner still drains what the rate
    # limiter's error buffer allows (hundreds of updates) and the evaluator keeps evaluating, all at
    # env_steps == max_env_steps. SB3 stops at its budget, so only the first evaluation at the
    # budget counts here; and none past the time budget.
    at_budget = next((i for i, e in enumerate(evals) if e["env_steps"] >= max_env_steps), len(evals) - 1)
    counted = [e for e in evals[: at_budget + 1] if e["wall_s"] <= budget_s]
    solved = next((e for e in counted if e["eval_return"] >= algo.threshold), None)
    best = max((e["eval_return"] for e in counted), default=None)
    if solved is None:
        late = next((e for e in evals if e["eval_return"] >= algo.threshold), None)
        if late is not None:
            note = f"reached at {late['wall_s']:.0f} s, {late['env_steps']:.0f} steps: past a budget"
        else:
            note = f"{summary['env_steps']} steps in {summary['wall_s']:.0f} s, {summary['stop_reason']}"
        return Result(None, None, process_s, best, note)
    return Result(solved["wall_s"], solved["env_steps"], process_s, best)


def run_sb3(name: str, seed: int, max_env_steps: int, budget_s: float, eval_every: int) -> Result | None:
    """One SB3 run in a fresh process (this file with ``--sb3-child``); None: SB3 is not installed.

    Raises:
        RuntimeError: the run failed, with its output's tail.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), "--sb3-child", name, str(seed), str(max_env_steps),
           str(budget_s), str(eval_every)]
    code, out, process_s = _run_process(cmd, budget_s + PROCESS_GRACE_S)
    if code is None:
        return Result(None, None, process_s, None, f"killed after {budget_s + PROCESS_GRACE_S:.0f} s")
    if code != 0:
        if "No module named 'stable_baselines3'" in out:
            return None
        raise RuntimeError(f"the SB3 {name} run (seed {seed}) exited with {code}:\n{out}")
    r = json.loads(out.strip().splitlines()[-1])
    return Result(r["wall_s"], r["env_steps"], process_s, r["best"], r["note"], r["eval_s"])


def sb3_child(name: str, seed: int, max_env_steps: int, budget_s: float, eval_every: int) -> None:
    """Train SB3 until an evaluation reaches the threshold or a budget runs out; print one JSON line."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.evaluation import evaluate_policy

    algo = ALGOS[name]
    model = algo.sb3(seed)
    # 10 envs, one episode each, side by side: how our Evaluator runs its 10 episodes.
    eval_env = make_vec_env(algo.env, n_envs=EVAL_EPISODES, seed=seed + 10_000)

    class ThresholdEval(BaseCallback):
        """Greedy evaluation every ``eval_every`` env steps; stops at the threshold or a budget."""

        def _on_training_start(self) -> None:
            self.t0 = time.perf_counter()
            self.next_eval = eval_every
            self.eval_s = 0.0
            self.best: float | None = None
            self.solved: tuple[float, int, float] | None = None  # (wall_s, env_steps, eval_s so far)
            self.note = ""

        def _on_step(self) -> bool:
            if self.num_timesteps >= self.next_eval:
                self.next_eval += eval_every * (1 + (self.num_timesteps - self.next_eval) // eval_every)
                t = time.perf_counter()
                returns, _ = evaluate_policy(self.model, eval_env, n_eval_episodes=EVAL_EPISODES, deterministic=True,
                                             return_episode_rewards=True)
                self.eval_s += time.perf_counter() - t
                mean = float(np.mean(returns))
                self.best = mean if self.best is None else max(self.best, mean)
                if mean >= algo.threshold:
                    self.solved = (time.perf_counter() - self.t0, self.num_timesteps, self.eval_s)
                    return False
            if time.perf_counter() - self.t0 > budget_s:
                self.note = f"{self.num_timesteps} steps, time budget {budget_s:g} s"
                return False
            if self.num_timesteps >= max_env_steps:
                self.note = (f"{self.num_timesteps} steps in {time.perf_counter() - self.t0:.0f} s, "
                             f"step budget {max_env_steps}")
                return False
            return True

    cb = ThresholdEval()
    # The zoo's n_timesteps, whatever the step budget: SB3's schedules (epsilon, lr, clip) run over it.
    # (SB3 makes an empty log folder per learn(), in /tmp unless SB3_LOGDIR names one: here, a folder
    # removed after the run, so the benchmark leaves none behind.)
    with tempfile.TemporaryDirectory(prefix="bench-sb3-") as logdir:
        os.environ["SB3_LOGDIR"] = logdir
        model.learn(total_timesteps=algo.max_env_steps, callback=cb)
    if cb.solved is None:
        note = cb.note or f"{model.num_timesteps} steps, zoo n_timesteps done"
        res = {"wall_s": None, "env_steps": None, "eval_s": cb.eval_s, "best": cb.best, "note": note}
    else:
        wall_s, steps, eval_s = cb.solved
        res = {"wall_s": wall_s, "env_steps": steps, "eval_s": eval_s, "best": cb.best, "note": ""}
    print(json.dumps(res), flush=True)


# ------------------------------------------------------------------------------ actor scaling


def actor_rate(algo: Algo, seed: int, actors: int, steps_per_actor: int, mode: str, run_dir: Path,
               budget_s: float, asynchronous: bool = True) -> float | None:
    """Env steps/s of the app under ``--placement actors`` with ``actors`` actor processes.

    ``asynchronous``: run with ``--async`` (actors step as fast as they can, held back only by the
    writers' flow control); else in deterministic mode, where conservative synchronisation across
    processes (each actor step waits for its peers' promises) bounds the rate, not the CPU.

    Returns:
        The slope of the actors' summed ``env_steps`` reports over wall clock in ``metrics.csv``
        (None: fewer than two reports, i.e. the run was too short to measure).

    Raises:
        RuntimeError: the run failed or was killed, with its output's tail.
    """
    total = steps_per_actor * actors
    # An unreachable target, so the step budget ends the run (not every app's Config takes None).
    sets: dict[str, Any] = {"live": False, "run_dir": str(run_dir), "actors": actors, "target_return": 1e9,
                            "max_env_steps": total}
    if mode == "acting":
        assert algo.acting_only is not None
        sets.update(algo.acting_only(total))
    cmd = [sys.executable, "-m", "reactor.cli", "run", algo.app, "--seed", str(seed), "--placement", "actors"]
    if asynchronous:
        cmd.append("--async")
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v!r}"]
    code, out, _ = _run_process(cmd, budget_s + PROCESS_GRACE_S)
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} {'was killed' if code is None else f'exited with {code}'}:\n{out}")
    with open(run_dir / "metrics.csv", newline="") as f:
        points = [(float(r["wall_s"]), float(r["env_steps"])) for r in csv.DictReader(f) if r["name"] == "env_steps"]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    (w0, s0), (w1, s1) = points[0], points[-1]
    return (s1 - s0) / (w1 - w0)


# ------------------------------------------------------------------------------ report


def _median(values: list[float | None]) -> float | None:
    """Median with "not reached" (None) as +infinity; None when the median itself is not reached."""
    m = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(m) else m


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _fmt_steps(v: float | None) -> str:
    return "-" if v is None else f"{v / 1000:.1f}k"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    return f"{a / b:.2f}x"


SIDES = ("ours single", "ours actors", "ours async", "sb3")
#: How each of our sides runs: (placement, async mode).
OUR_SIDES = {"ours single": ("single", False), "ours actors": ("actors", False), "ours async": ("actors", True)}
TARGETS = {"dqn": 0.5, "ppo": 1.0, "sac": 0.5}


def print_algo(name: str, seeds: list[int], rows: dict[str, list[Result | None]]) -> None:
    """Per-seed figures and medians of one algorithm."""
    algo = ALGOS[name]
    print(f"\n{name.upper()} {algo.env}: wall s to mean eval return >= {algo.threshold:g} / env steps then "
          "('-': not reached)")
    head = f"  {'side':12s}" + "".join(f"  {'seed ' + str(s):>16s}" for s in seeds) + f"  {'median':>16s}"
    print(head + "   process_s (median)")
    for side in SIDES:
        rs = rows[side]
        if not rs or any(r is None for r in rs):
            print(f"  {side:12s}  n/a (--no-sb3, or stable-baselines3 not installed)")
            continue
        cells = ["fail" if r.failed else f"{_fmt_s(r.wall_s)} / {_fmt_steps(r.env_steps)}" for r in rs
                 if r is not None]
        med = f"{_fmt_s(_median([r.wall_s for r in rs]))} / {_fmt_steps(_median([r.env_steps for r in rs]))}"
        proc = statistics.median(r.process_s for r in rs if r is not None and not r.failed) \
            if any(r is not None and not r.failed for r in rs) else math.nan
        print(f"  {side:12s}" + "".join(f"  {c:>16s}" for c in cells) + f"  {med:>16s}   {proc:.1f}")
    for side in SIDES:
        for seed, r in zip(seeds, rows[side]):
            if r is not None and r.wall_s is None and not r.failed:
                best = "none" if r.best is None else f"{r.best:.1f}"
                print(f"    {side} seed {seed} not reached: best eval {best}; {r.note}")
    sb3 = [r for r in rows["sb3"] if r is not None and r.wall_s is not None and r.eval_s is not None]
    if sb3:
        share = statistics.median(r.eval_s / r.wall_s for r in sb3)  # type: ignore[operator]
        print(f"    sb3 eval share of its wall clock to threshold (median): {share:.0%}")


def print_summary(results: dict[str, dict[str, list[Result | None]]]) -> None:
    """The issue-5 table: medians and ratios ours/SB3 of the wall clock to threshold."""
    print("\nSummary: median wall clock to threshold, s (env steps); ratio = ours / SB3, lower is better")
    print(f"  {'algo':5s} {'env':12s} {'ours single':>16s} {'ours actors':>16s} {'ours async':>16s} {'SB3':>16s} "
          f"{'single/SB3':>10s} {'actors/SB3':>10s} {'async/SB3':>10s}  target")
    for name, rows in results.items():
        med: dict[str, tuple[float | None, float | None]] = {}
        for side in SIDES:
            rs = rows[side]
            if rs and all(r is not None for r in rs):
                med[side] = (_median([r.wall_s for r in rs]), _median([r.env_steps for r in rs]))  # type: ignore[union-attr]
        cell = {s: (f"{_fmt_s(m[0])} ({_fmt_steps(m[1])})" if s in med else "n/a") for s, m in
                ((s, med.get(s, (None, None))) for s in SIDES)}
        sb3_s = med.get("sb3", (None, None))[0]
        print(f"  {name:5s} {ALGOS[name].env:12s} {cell['ours single']:>16s} {cell['ours actors']:>16s} "
              f"{cell['ours async']:>16s} {cell['sb3']:>16s} {_ratio(med.get('ours single', (None,))[0], sb3_s):>10s} "
              f"{_ratio(med.get('ours actors', (None,))[0], sb3_s):>10s} "
              f"{_ratio(med.get('ours async', (None,))[0], sb3_s):>10s}  <= {TARGETS[name]:g}x")


# ------------------------------------------------------------------------------ main


def _csv_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algos", default="dqn,ppo,sac", type=names_of(ALGOS), help="comma-separated, from: " + ",".join(ALGOS))
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--budget-s", type=positive_float, default=600.0,
                   help="training wall clock per run after which it counts as not reached (default 600)")
    p.add_argument("--quick", action="store_true",
                   help="seed 0 only, small env-step and time budgets, short scaling runs: proves the script")
    p.add_argument("--scaling", choices=("acting", "training", "none"), default="acting",
                   help="actor-scaling runs: learner idle (acting, default), learning on (training), or none")
    p.add_argument("--scaling-algo", default="dqn", help="off-policy algorithm whose app the scaling runs use")
    p.add_argument("--scaling-steps", type=positive_int, default=30_000, help="env steps per actor in a scaling run")
    p.add_argument("--scaling-runtime", choices=("async", "deterministic"), default="async",
                   help="scaling runs in async mode (default: actors run free) or deterministic mode")
    p.add_argument("--scaling-reps", type=positive_int, default=3,
                   help="scaling repetitions, 1 and 2 actors alternating; medians and the median ratio reported")
    p.add_argument("--no-sb3", action="store_true", help="skip the Stable-Baselines3 runs")
    p.add_argument("--json", metavar="PATH", help="also write every figure to this JSON file")
    p.add_argument("--sb3-child", nargs=5, metavar=("ALGO", "SEED", "STEPS", "BUDGET_S", "EVAL_EVERY"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.sb3_child:
        name, seed, steps, budget, every = args.sb3_child
        sb3_child(name, int(seed), int(steps), float(budget), int(every))
        return

    names = args.algos
    try:
        seeds = [int(s) for s in _csv_list(args.seeds)]
    except ValueError:
        p.error(f"--seeds expects comma-separated integers, got {args.seeds!r}")
    if not seeds:
        p.error("--seeds: give at least one seed")
    budget_s, scaling_steps = args.budget_s, args.scaling_steps
    if args.quick:
        seeds, budget_s, scaling_steps = seeds[:1], min(budget_s, 90.0), min(scaling_steps, 10_000)
    if args.scaling != "none":
        sa = ALGOS.get(args.scaling_algo)
        if sa is None or (args.scaling == "acting" and sa.acting_only is None):
            ok = [n for n, a in ALGOS.items() if a.acting_only is not None]
            p.error(f"--scaling-algo {args.scaling_algo!r}: needs an off-policy algorithm, one of {', '.join(ok)}")

    import torch  # only for the version line; each run is its own process

    import reactor

    sb3_version = "skipped (--no-sb3)" if args.no_sb3 else "not installed"
    if not args.no_sb3:
        try:
            from importlib.metadata import version

            sb3_version = version("stable-baselines3")
        except Exception:  # noqa: BLE001 - any metadata failure means: not usable
            pass
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (1 thread), reactor {reactor.__version__}, "
          f"stable-baselines3 {sb3_version}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"seeds {seeds}; time budget {budget_s:g} s per run{' (--quick)' if args.quick else ''}; "
          "evaluation time included on both sides")

    results: dict[str, dict[str, list[Result | None]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_training-") as tmp:
        for name in names:
            algo = ALGOS[name]
            steps = algo.quick_env_steps if args.quick else algo.max_env_steps
            every = eval_every_env_steps(algo)
            print(f"\n{name}: {algo.app} vs SB3, {algo.env}, threshold {algo.threshold:g}, budget {steps} env steps, "
                  f"evaluation every {every} env steps", flush=True)
            rows: dict[str, list[Result | None]] = {s: [] for s in SIDES}
            for seed in seeds:
                for side, (placement, asynchronous) in OUR_SIDES.items():
                    run_dir = Path(tmp) / f"{name}-{side.replace(' ', '-')}-{seed}"
                    r: Result | None = _guard(run_ours, algo, seed, placement, run_dir, steps, budget_s, asynchronous)
                    rows[side].append(r)
                    _print_run(side, seed, r)
                r = None if args.no_sb3 else _guard(run_sb3, name, seed, steps, budget_s, every)
                rows["sb3"].append(r)
                _print_run("sb3", seed, r)
            results[name] = rows
            print_algo(name, seeds, rows)

        scaling: dict[str, Any] = {}
        if args.scaling != "none":
            sa = ALGOS[args.scaling_algo]
            print(f"\nactor scaling: {sa.app} --placement actors ({args.scaling_runtime} mode), {scaling_steps} env "
                  f"steps per actor, learner {'idle' if args.scaling == 'acting' else 'learning'}", flush=True)
            reps = 1 if args.quick else args.scaling_reps
            runs: dict[int, list[float]] = {1: [], 2: []}
            ratios: list[float] = []
            for rep in range(reps):
                # Alternate the order every repetition, so a load change hits both sides alike.
                rep_rates: dict[int, float | None] = {}
                for actors in ((1, 2) if rep % 2 == 0 else (2, 1)):
                    rep_rates[actors] = actor_rate(sa, seeds[0], actors, scaling_steps, args.scaling,
                                                   Path(tmp) / f"scaling-{actors}-{rep}", budget_s,
                                                   asynchronous=args.scaling_runtime == "async")
                    if rep_rates[actors] is not None:
                        runs[actors].append(rep_rates[actors])  # type: ignore[arg-type]
                a, b = rep_rates[1], rep_rates[2]
                if a and b:
                    ratios.append(b / a)
                print(f"  rep {rep + 1}: 1 actor {'-' if a is None else f'{a:,.0f}'}, 2 actors "
                      f"{'-' if b is None else f'{b:,.0f}'} env steps/s"
                      f"{f', ratio {b / a:.2f}x' if a and b else ''}", flush=True)
            r1 = statistics.median(runs[1]) if runs[1] else None
            r2 = statistics.median(runs[2]) if runs[2] else None
            ratio = statistics.median(ratios) if ratios else None
            print(f"  median: 1 actor {'-' if r1 is None else f'{r1:,.0f}'}, 2 actors {'-' if r2 is None else f'{r2:,.0f}'} "
                  f"env steps/s; median ratio 2 / 1 actors: {'-' if ratio is None else f'{ratio:.2f}x'} "
                  f"(target >= 1.6x; ratios {', '.join(f'{x:.2f}' for x in ratios)})")
            scaling = {"algo": args.scaling_algo, "mode": args.scaling, "runtime": args.scaling_runtime,
                       "steps_per_actor": scaling_steps,
                       "rate_1": r1, "rate_2": r2, "ratio": ratio, "ratios": ratios, "reps": reps}

    print_summary(results)
    if args.json:
        out = {"seeds": seeds, "budget_s": budget_s, "quick": args.quick, "scaling": scaling,
               "runs": {n: {s: [None if r is None else r.__dict__ for r in rs] for s, rs in rows.items()}
                        for n, rows in results.items()}}
        Path(args.json).write_text(json.dumps(out, indent=2))


def _guard(run: Callable[..., Result | None], *args: Any) -> Result | None:
    """``run(*args)``; a failed run (an app or algorithm under construction) is reported, not fatal."""
    try:
        return run(*args)
    except RuntimeError as e:
        print("  " + str(e).replace("\n", "\n    "), flush=True)
        return Result(None, None, math.nan, None, str(e).splitlines()[0][-200:], failed=True)


def _print_run(side: str, seed: int, r: Result | None) -> None:
    if r is None:
        print(f"  {side:12s} seed {seed}: n/a (--no-sb3, or stable-baselines3 not installed)", flush=True)
        return
    if r.failed:
        print(f"  {side:12s} seed {seed}: FAILED", flush=True)
        return
    if r.wall_s is None:
        best = "none" if r.best is None else f"{r.best:.1f}"
        print(f"  {side:12s} seed {seed}: not reached (best eval {best}; {r.note}); process {r.process_s:.1f} s",
              flush=True)
        return
    extra = "" if r.eval_s is None else f" ({r.eval_s:.1f} s of it evaluating)"
    print(f"  {side:12s} seed {seed}: {r.wall_s:7.1f} s{extra}, {r.env_steps:>7.0f} env steps; "
          f"process {r.process_s:.1f} s", flush=True)


if __name__ == "__main__":
    interruptible(main, "bench_training.py")
