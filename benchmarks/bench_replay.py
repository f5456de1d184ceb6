"""Replay engine benchmarks (issue 3): prioritized transitions against cpprb and TorchRL, sum-tree arity, drift.

Sections (each a function; ``main`` runs the ones asked for, all by default):

- ``transitions``: capacity 2^20 transitions (obs float32[8], action int64, reward float32,
  next_obs float32[8], done bool), alpha 0.6, beta 0.4. Insert batches of 256; sample 256 and 1024
  with importance weights (indices + weights + every field gathered); priority update 256 and 1024;
  learner step = sample 256 + update 256 of the sampled keys. Every call gets fresh random indices
  and priorities (cpprb skips propagation of unchanged values). Medians over repetitions, ours and
  the peers interleaved in the same run.
- ``episodes``: insert 256 into a full ring (every insert evicts) with episodes of 1, 32, 256 and
  4096 steps, the Table against cpprb (issue 21: "at least as fast as cpprb at any episode length").
- ``arity``: SumTree sample/update cost for K in {2, 4, 8, 16, 32, 64}, numba and torch backends.
- ``drift``: 10^8 random updates on a 2^20-leaf tree, then an exact recompute (the issue's bar).

Run: ``python benchmarks/bench_replay.py [--only transitions,episodes,arity,drift] [--reps 7]``
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import interruptible, names_of, peer_missing, positive_int  # noqa: E402
from reactor.replay.selectors import Prioritized  # noqa: E402
from reactor.replay.sumtree import SumTree  # noqa: E402

CAPACITY = 1 << 20
CPPRB_FIX = "pip install -e '.[bench]' adds it."
TORCHRL_FIX = ("Its compiled part needs the torch it was built for: bash scripts/setup_torchrl_peer.sh makes "
               ".venv-torchrl; run this benchmark with its python.")
ALPHA = 0.6
BETA = 0.4
OBS_DIM = 8


# ------------------------------------------------------------------------------------------ timing


def time_per_call(fn: Callable[[int], Any], calls: int) -> float:
    """Seconds per call of ``fn(i)`` over ``calls`` consecutive calls."""
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls


def interleaved_medians(fns: dict[str, Callable[[int], Any]], calls: int, reps: int) -> dict[str, float]:
    """Median seconds per call for each function; repetitions alternate between the functions."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    counters = dict.fromkeys(fns, 0)
    for fn in fns.values():  # warm up (jit, caches)
        fn(0)
    for _ in range(reps):
        for name, fn in fns.items():
            base = counters[name]
            samples[name].append(time_per_call(lambda i, fn=fn, base=base: fn(base + i), calls))
            counters[name] += calls
    return {name: statistics.median(v) for name, v in samples.items()}


# ------------------------------------------------------------------------------------------ data


class FreshData:
    """Pregenerated random batches, cycled with a period longer than any timed run (never reused)."""

    def __init__(self, rng: np.random.Generator, period: int, batch: int) -> None:
        self.period = period
        self.indices = rng.integers(0, CAPACITY, size=(period, batch))
        self.priorities = rng.random((period, batch)) + 1e-3
        self.obs = rng.standard_normal((period, batch, OBS_DIM)).astype(np.float32)
        self.action = rng.integers(0, 4, size=(period, batch))
        self.reward = rng.standard_normal((period, batch)).astype(np.float32)
        self.done = rng.random((period, batch)) < 0.01
        # TorchRL takes tensors and keeps float32 trees: its inputs are made ahead too, so no
        # conversion is timed against it.
        self.t_indices = torch.from_numpy(self.indices)
        self.t_priorities32 = torch.from_numpy(self.priorities.astype(np.float32))

    def __getitem__(self, i: int) -> int:
        return i % self.period


# ------------------------------------------------------------------------------------------ ours


class OursTransitions:
    """Our side without the Table: Prioritized selector + SumTree + a numpy columnar ring.

    An honest full sample: slots, importance weights and every field gathered.
    """

    label = "reactor (Prioritized + SumTree + numpy columns)"

    def __init__(self, capacity: int, seed: int = 0) -> None:
        self.capacity = capacity
        self.sel = Prioritized(alpha=ALPHA)
        self.sel.bind(capacity)
        self.rng = np.random.default_rng(seed)
        self.obs = np.zeros((capacity, OBS_DIM), np.float32)
        self.action = np.zeros(capacity, np.int64)
        self.reward = np.zeros(capacity, np.float32)
        self.next_obs = np.zeros((capacity, OBS_DIM), np.float32)
        self.done = np.zeros(capacity, np.bool_)
        self.cursor = 0
        self.size = 0

    def insert(
        self,
        obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        next_obs: np.ndarray,
        done: np.ndarray,
        priorities: np.ndarray,
    ) -> None:
        n = obs.shape[0]
        slots = (self.cursor + np.arange(n)) % self.capacity
        self.obs[slots] = obs
        self.action[slots] = action
        self.reward[slots] = reward
        self.next_obs[slots] = next_obs
        self.done[slots] = done
        self.sel.insert(slots, priorities)  # overwriting a slot replaces its priority
        self.cursor = (self.cursor + n) % self.capacity
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        slots, probs = self.sel.select(n, self.rng)
        # w_i = (N P(i))^-beta / max_j w_j  with  max_j w_j = (N min P)^-beta  =>  (P(i) / min P)^-beta
        weights = np.power(probs / self.sel.min_probability(), -BETA)
        # take(): numpy's fancy indexing of 2-D rows is ~6x slower than take along axis 0 (measured).
        batch = {
            "obs": self.obs.take(slots, axis=0),
            "action": self.action.take(slots),
            "reward": self.reward.take(slots),
            "next_obs": self.next_obs.take(slots, axis=0),
            "done": self.done.take(slots),
        }
        return batch, slots, weights

    def update(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self.sel.update(slots, priorities)


class TableTransitions:
    """Our side through the real ``reactor.replay.Table`` (Storage + Prioritized sampler + Fifo remover).

    Sample returns the gathered batch and ``SampleInfo`` (keys, probabilities, weights, times sampled).
    """

    label = "reactor.replay.Table (Storage + Prioritized + Fifo remover + MinSize)"

    def __init__(self, capacity: int, seed: int = 0) -> None:
        from reactor.replay import FieldSpec, Fifo, MinSize, Storage, Table

        storage = Storage(
            [
                FieldSpec("obs", (OBS_DIM,), torch.float32),
                FieldSpec("action", (), torch.int64),
                FieldSpec("reward", (), torch.float32),
                FieldSpec("next_obs", (OBS_DIM,), torch.float32),
                FieldSpec("done", (), torch.bool),
            ],
            capacity,
        )
        self.table = Table(
            storage,
            sampler=Prioritized(alpha=ALPHA),
            remover=Fifo(),
            rate_limiter=MinSize(1),
            beta=BETA,
            seed=seed,
        )

    def insert(
        self,
        obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        next_obs: np.ndarray,
        done: np.ndarray,
        priorities: np.ndarray,
    ) -> None:
        steps = {
            "obs": torch.from_numpy(obs),
            "action": torch.from_numpy(action),
            "reward": torch.from_numpy(reward),
            "next_obs": torch.from_numpy(next_obs),
            "done": torch.from_numpy(done),
        }
        self.table.insert_nowait(steps, priorities)

    def sample(self, n: int) -> tuple[dict[str, Any], Any, Any]:
        batch, info = self.table.sample_nowait(n)
        return batch, info.keys, info.weights

    def update(self, keys: Any, priorities: np.ndarray) -> None:
        self.table.update_priorities(keys, priorities)

    def random_keys(self, rng: np.random.Generator, period: int, n: int) -> np.ndarray:
        """Fresh random keys of present items (keys are not slots in a table)."""
        keys = self.table._keys  # noqa: SLF001 - the benchmark needs the live key set to draw from
        live = keys[keys >= 0]
        return live[rng.integers(0, live.size, size=(period, n))]


def make_ours(kind: str) -> Any:
    """The "ours" side: the real Table when asked (or "auto" and it works), else the selector path."""
    if kind in ("table", "auto"):
        try:
            ours = TableTransitions(CAPACITY)
            return ours
        except Exception as exc:  # noqa: BLE001
            if kind == "table":
                raise
            print(
                f"reactor.replay.Table not usable ({type(exc).__name__}: {exc}); measuring the selector path"
            )
    return OursTransitions(CAPACITY)


# ------------------------------------------------------------------------------------------ peers


def make_cpprb(capacity: int) -> Any:
    import cpprb

    env = {
        "obs": {"shape": OBS_DIM, "dtype": np.float32},
        "action": {"dtype": np.int64},
        "reward": {"dtype": np.float32},
        "next_obs": {"shape": OBS_DIM, "dtype": np.float32},
        "done": {"dtype": np.bool_},
    }
    return cpprb.PrioritizedReplayBuffer(capacity, env, alpha=ALPHA)


def make_torchrl(capacity: int) -> tuple[Any, str]:
    """TorchRL's PrioritizedReplayBuffer, or (None, why it failed)."""
    import warnings

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from tensordict import TensorDict
            from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

            # Probe on a small buffer first: TorchRL builds its C++ sum trees lazily, so a broken
            # compiled extension shows only when a buffer is filled and sampled.
            probe = PrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, storage=LazyTensorStorage(8), batch_size=2)
            probe.extend(TensorDict({"obs": torch.zeros(4, OBS_DIM)}, batch_size=[4]))
            probe.sample(2, return_info=True)
            rb = PrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, storage=LazyTensorStorage(capacity))
        return rb, ""
    except ModuleNotFoundError as exc:  # (torchrl or tensordict: the peer is not installed here)
        return None, peer_missing("TorchRL", exc, TORCHRL_FIX)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        notes = "; ".join(sorted({str(w.message).splitlines()[0][:160] for w in caught}))
        why = f"{type(exc).__name__}: {exc}" + (f" (warnings: {notes})" if notes else "")
        try:  # the root cause: TorchRL's compiled extension (its C++ sum trees) failing to load
            import torchrl._torchrl  # noqa: F401
        except Exception as root:  # noqa: BLE001 - reported
            why += f"; its compiled extension does not load: {type(root).__name__}: {str(root)[:160]}"
        return None, why


# ------------------------------------------------------------------------------------------ sections


def section_transitions(args: argparse.Namespace) -> None:
    print(
        f"\n## transitions: capacity 2^20, alpha {ALPHA}, beta {BETA}, fields obs f32[8], action i64, "
        f"reward f32, next_obs f32[8], done bool; medians of {args.reps} reps x {args.calls} calls"
    )
    rng = np.random.default_rng(0)
    ours = make_ours(args.ours)
    peers: dict[str, Any] = {}
    try:
        peers["cpprb"] = make_cpprb(CAPACITY)
    except Exception as exc:  # noqa: BLE001
        print(peer_missing("cpprb", exc, CPPRB_FIX))
    torchrl_rb, why = make_torchrl(CAPACITY)
    if torchrl_rb is None:
        print(why if why.startswith("TorchRL: not installed") else
              f"TorchRL: PrioritizedReplayBuffer failed to load, not compared: {why}. {TORCHRL_FIX}")
    else:
        peers["torchrl"] = torchrl_rb
    print(f"ours: {ours.label}")

    # Fill every buffer to capacity with random priorities.
    fill = FreshData(rng, 64, 4096)
    for start in range(0, CAPACITY, 4096):
        k = fill[start // 4096]
        args_ = (fill.obs[k], fill.action[k], fill.reward[k], fill.obs[k], fill.done[k], fill.priorities[k])
        ours.insert(*args_)
        if "cpprb" in peers:
            peers["cpprb"].add(
                obs=args_[0],
                action=args_[1],
                reward=args_[2],
                next_obs=args_[3],
                done=args_[4],
                priorities=args_[5],
            )
        if "torchrl" in peers:
            _torchrl_insert(peers["torchrl"], *args_)

    period = args.calls * (args.reps + 1) + 8
    results: list[tuple[str, dict[str, float]]] = []

    d256 = FreshData(rng, period, 256)

    def ours_insert(i: int) -> None:
        k = d256[i]
        ours.insert(
            d256.obs[k], d256.action[k], d256.reward[k], d256.obs[k], d256.done[k], d256.priorities[k]
        )

    def cpprb_insert(i: int) -> None:
        k = d256[i]
        peers["cpprb"].add(
            obs=d256.obs[k],
            action=d256.action[k],
            reward=d256.reward[k],
            next_obs=d256.obs[k],
            done=d256.done[k],
            priorities=d256.priorities[k],
        )

    fns = {"ours": ours_insert}
    if "cpprb" in peers:
        fns["cpprb"] = cpprb_insert
    if "torchrl" in peers:
        fns["torchrl"] = lambda i: _torchrl_insert(
            peers["torchrl"],
            d256.obs[d256[i]],
            d256.action[d256[i]],
            d256.reward[d256[i]],
            d256.obs[d256[i]],
            d256.done[d256[i]],
            d256.priorities[d256[i]],
        )
    results.append(("insert 256", interleaved_medians(fns, args.calls, args.reps)))

    for n in (256, 1024):
        dn = FreshData(rng, period, n) if n != 256 else d256
        fns = {"ours": lambda i, n=n: ours.sample(n)}
        if "cpprb" in peers:
            fns["cpprb"] = lambda i, n=n: peers["cpprb"].sample(n, beta=BETA)
        if "torchrl" in peers:
            fns["torchrl"] = lambda i, n=n: peers["torchrl"].sample(n, return_info=True)
        results.append((f"sample {n}", interleaved_medians(fns, args.calls, args.reps)))

        ours_idx = ours.random_keys(rng, period, n) if isinstance(ours, TableTransitions) else dn.indices
        fns = {"ours": lambda i, dn=dn, oi=ours_idx: ours.update(oi[dn[i]], dn.priorities[dn[i]])}
        if "cpprb" in peers:
            fns["cpprb"] = lambda i, dn=dn: peers["cpprb"].update_priorities(
                dn.indices[dn[i]], dn.priorities[dn[i]]
            )
        if "torchrl" in peers:  # TorchRL's trees are float32
            fns["torchrl"] = lambda i, dn=dn: peers["torchrl"].update_priority(
                dn.t_indices[dn[i]], dn.t_priorities32[dn[i]]
            )
        results.append((f"update {n}", interleaved_medians(fns, args.calls, args.reps)))

    def ours_learner(i: int) -> None:
        _, slots, _ = ours.sample(256)
        ours.update(slots, d256.priorities[d256[i]])

    def cpprb_learner(i: int) -> None:
        batch = peers["cpprb"].sample(256, beta=BETA)
        peers["cpprb"].update_priorities(batch["indexes"], d256.priorities[d256[i]])

    def torchrl_learner(i: int) -> None:
        _, info = peers["torchrl"].sample(256, return_info=True)
        peers["torchrl"].update_priority(info["index"], d256.t_priorities32[d256[i]])

    fns = {"ours": ours_learner}
    if "cpprb" in peers:
        fns["cpprb"] = cpprb_learner
    if "torchrl" in peers:
        fns["torchrl"] = torchrl_learner
    results.append(("learner step 256", interleaved_medians(fns, args.calls, args.reps)))

    targets = {"insert": 0.5, "sample": 1.5, "update": 1.5, "learner": 2.0}
    print(
        f"{'operation':<18}{'ours us':>10}"
        + "".join(f"{p + ' us':>12}" for p in peers)
        + f"{'ratio vs best peer':>20}{'target':>8}"
    )
    for op, med in results:
        best = min((med[p] for p in peers if p in med), default=math.nan)
        ratio = best / med["ours"]
        line = f"{op:<18}{med['ours'] * 1e6:>10.1f}" + "".join(
            f"{med[p] * 1e6:>12.1f}" if p in med else f"{'-':>12}" for p in peers
        )
        target = targets[op.split()[0]]
        if math.isnan(ratio):  # (no peer loaded: nothing to hold the target against)
            print(line + f"{'-':>20}{target:>7.1f}x no peer")
            continue
        ok = "ok" if ratio >= target else "MISS"
        print(line + f"{ratio:>19.2f}x{target:>7.1f}x {ok}")


def _torchrl_insert(
    rb: Any,
    obs: np.ndarray,
    action: np.ndarray,
    reward: np.ndarray,
    next_obs: np.ndarray,
    done: np.ndarray,
    priorities: np.ndarray,
) -> None:
    from tensordict import TensorDict

    td = TensorDict(
        {
            "obs": torch.from_numpy(obs),
            "action": torch.from_numpy(action),
            "reward": torch.from_numpy(reward),
            "next_obs": torch.from_numpy(next_obs),
            "done": torch.from_numpy(done),
        },
        batch_size=[obs.shape[0]],
    )
    idx = rb.extend(td)
    rb.update_priority(idx, torch.from_numpy(priorities).float())


def section_arity(args: argparse.Namespace) -> None:
    print(f"\n## SumTree arity, 2^20 leaves: us per call (medians of {args.reps} reps), fresh random indices")
    rng = np.random.default_rng(1)
    leaves = rng.random(CAPACITY)
    calls = max(20, args.calls // 2)
    period = calls * (args.reps + 1) + 8
    d256 = FreshData(rng, period, 256)
    d1024 = FreshData(rng, period, 1024)
    print(
        f"{'backend':<8}{'K':>4}{'depth':>7}{'sample256':>11}{'sample1024':>12}{'update256':>11}{'update1024':>12}"
    )
    for backend in ("numba", "torch"):
        for arity in (2, 4, 8, 16, 32, 64):
            tree = SumTree(CAPACITY, arity, backend=backend)
            tree.update(np.arange(CAPACITY), leaves)
            srng = np.random.default_rng(2)
            reps = args.reps if backend == "numba" else max(3, args.reps // 2)
            c = calls if backend == "numba" else max(5, calls // 10)
            med = interleaved_medians(
                {
                    "s256": lambda i, t=tree, r=srng: t.sample(256, r),
                    "s1024": lambda i, t=tree, r=srng: t.sample(1024, r),
                    "u256": lambda i, t=tree: t.update(d256.indices[d256[i]], d256.priorities[d256[i]]),
                    "u1024": lambda i, t=tree: t.update(d1024.indices[d1024[i]], d1024.priorities[d1024[i]]),
                },
                c,
                reps,
            )
            print(
                f"{backend:<8}{arity:>4}{tree.depth:>7}"
                + "".join(
                    f"{med[k] * 1e6:>{w}.1f}"
                    for k, w in (("s256", 11), ("s1024", 12), ("u256", 11), ("u1024", 12))
                )
            )


def section_drift(args: argparse.Namespace) -> None:
    updates = args.drift_updates
    print(f"\n## drift: {updates:.3g} random updates on a 2^20-leaf tree (K=16), then an exact recompute")
    rng = np.random.default_rng(3)
    tree = SumTree(CAPACITY, 16)
    batch = 1 << 20
    t0 = time.perf_counter()
    for _ in range(-(-updates // batch)):
        idx = rng.integers(0, CAPACITY, batch)
        tree.update(idx, rng.random(batch) * 10.0 ** rng.integers(-6, 7, batch))
    elapsed = time.perf_counter() - t0
    tree.check_invariants()  # every internal node bit-identical to a rebuild from the leaves
    leaves = tree.state_dict()["leaves"]
    exact = math.fsum(leaves.tolist())
    err = abs(tree.total - exact) / exact
    bound = tree.depth * (tree.arity - 1) * 2.0**-52
    print(
        f"{elapsed:.1f} s; every node equals a fresh rebuild; |total - fsum| / fsum = {err:.3e} "
        f"(bound {bound:.3e}) -> {'ok' if err <= bound else 'FAIL'}"
    )


def section_episodes(args: argparse.Namespace) -> None:
    """Insert 256 steps into a full ring (every insert evicts), episodes of 1, 32, 256 and 4096 steps
    (issue 21): the Table (whole oldest episodes evicted, their items dropped from the sampler)
    against cpprb's PrioritizedReplayBuffer (a ring of transitions: its "done" is data), same data."""
    from reactor.replay import FieldSpec, Fifo, MinSize, Storage, Table

    cap = 1 << 18  # full rings of 2^18 steps: from the fill on, every insert needs room
    print(f"\n## insert 256 into a full ring (capacity 2^18, every insert evicts), by episode length; "
          f"medians of {args.reps} reps x {args.calls} calls")
    rng = np.random.default_rng(1)
    period = args.calls * (args.reps + 1) + 8 + cap // 256 + 16
    d = FreshData(rng, period, 256)
    steps = [{"obs": torch.from_numpy(d.obs[k]), "action": torch.from_numpy(d.action[k]),
              "reward": torch.from_numpy(d.reward[k]), "next_obs": torch.from_numpy(d.obs[k]),
              "done": torch.from_numpy(d.done[k])} for k in range(period)]
    try:
        make_cpprb(8)
        have_cpprb = True
    except Exception as exc:  # noqa: BLE001 - reported; ours still measured
        print(peer_missing("cpprb", exc, CPPRB_FIX))
        have_cpprb = False
    print(f"{'episode':>8} {'ours us':>9} {'cpprb us':>9} {'ours/cpprb':>11}")
    for length in (1, 32, 256, 4096):
        storage = Storage([FieldSpec("obs", (OBS_DIM,), torch.float32), FieldSpec("action", (), torch.int64),
                           FieldSpec("reward", (), torch.float32), FieldSpec("next_obs", (OBS_DIM,), torch.float32),
                           FieldSpec("done", (), torch.bool)], cap)
        table = Table(storage, sampler=Prioritized(alpha=ALPHA), remover=Fifo(), rate_limiter=MinSize(1), beta=BETA)
        # episode_end of the k-th insert: episodes of `length` steps, aligned on global step 0.
        phases = max(1, length // 256)
        ends = [((np.arange(p * 256, (p + 1) * 256) + 1) % length) == 0 for p in range(phases)]
        ends = [e if length != 256 else True for e in ends]

        def ours(k: int, table: Any = table, ends: list[Any] = ends, phases: int = phases) -> None:
            table.insert_nowait(steps[k % period], d.priorities[k % period], episode_end=ends[k % phases])

        rb = make_cpprb(cap) if have_cpprb else None

        def theirs(k: int, rb: Any = rb) -> None:
            k %= period
            rb.add(obs=d.obs[k], action=d.action[k], reward=d.reward[k], next_obs=d.obs[k], done=d.done[k],
                   priorities=d.priorities[k])

        fill = cap // 256 + 16  # both full: from here on every insert evicts
        for k in range(fill):
            ours(k)
            if rb is not None:
                theirs(k)
        # Later calls continue the episode pattern where the fill left it (a multiple of `phases`).
        fns = {"ours": lambda i, f=fill: ours(f + i)}
        if rb is not None:
            fns["cpprb"] = lambda i, f=fill: theirs(f + i)
        got = interleaved_medians(fns, args.calls, args.reps)
        if rb is None:
            print(f"{length:>8} {got['ours'] * 1e6:>9.1f} {'-':>9} {'-':>11}", flush=True)
            continue
        print(f"{length:>8} {got['ours'] * 1e6:>9.1f} {got['cpprb'] * 1e6:>9.1f} "
              f"{got['cpprb'] / got['ours']:>10.2f}x", flush=True)


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "transitions": section_transitions,
    "episodes": section_episodes,
    "arity": section_arity,
    "drift": section_drift,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", default=",".join(SECTIONS), type=names_of(SECTIONS),
        help=f"comma-separated sections, from {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument("--reps", type=positive_int, default=7, help="repetitions (median taken; default 7)")
    parser.add_argument("--calls", type=positive_int, default=200, help="calls per repetition (default 200)")
    parser.add_argument("--drift-updates", type=positive_int, default=100_000_000,
                        help="random priority updates of the drift section (default 1e8, ~a minute; 1000000 for a "
                             "quick check)")
    parser.add_argument(
        "--ours",
        choices=("auto", "table", "selector"),
        default="auto",
        help="our side: the real Table (auto: when it works) or Prioritized + numpy columns",
    )
    args = parser.parse_args(argv)
    print(
        f"python {sys.version.split()[0]}, numpy {np.__version__}, torch {torch.__version__} "
        f"(1 thread), {os.cpu_count()} cpus"
    )
    for name in args.only:
        SECTIONS[name](args)


if __name__ == "__main__":
    interruptible(main, "bench_replay.py")
