"""Compile the replay paths' cached kernels once, ahead of the first run (``scripts/setup.sh``).

numba compiles a kernel the first time a process calls it and keeps the machine code on disk
(``cache=True``). Without this, the first run after an install (or after an edit of a kernel's
module) pays the compiles in its processes: a learner's first one-sided sample blocks its loop for
seconds while it compiles the draw, a replay shard's first insert and sample likewise, and several
processes compile the same kernels at once on a small machine. Here every cached kernel of the
insert, sample and one-sided paths runs once on a tiny table of each read kind and sampler, with
the argument types the runtime passes, and so do the selectors' evictions (every sampler and remover
kind), a checkpoint's restore and the bulk path's gathers, so later processes load them from the
cache (every kernel a full test run compiles: compared by the cache's index files, session 37).

``python -m reactor.nodes._warm`` (prints what it compiled and how long it took). It lives with the
nodes because a replay shard's paths use both the engine (``reactor.replay``) and the bulk
transport's kernels (``reactor.transport``: the rows' versions).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..replay import (
    FieldSpec,
    Fifo,
    Lifo,
    MaxHeap,
    MinHeap,
    MinSize,
    Prioritized,
    SampleToInsertRatio,
    StepRead,
    Storage,
    Table,
    TransitionRead,
    Uniform,
    WindowRead,
    _budget,
    expand_window_spans,
)
from ..replay.shared import (
    SamplingPublisher,
    SharedArrays,
    SharedSampling,
    SharedShards,
    serve_sample,
    take_counts,
)
from ..transport import _gather
from ..transport import bulk as _bulk

__all__ = ["warm"]


def _shard(sampler: object, read: object) -> tuple[Table, SamplingPublisher, SharedSampling, dict[str, torch.Tensor]]:
    arrays = SharedArrays(lambda name, nbytes: np.zeros(nbytes, np.uint8))
    st = Storage([FieldSpec("obs", (4,), torch.float32), FieldSpec("reward", (), torch.float32),
                  FieldSpec("terminated", (), torch.bool)], 256, index_arrays=arrays)
    t = Table(st, sampler=sampler, remover=Fifo(), rate_limiter=SampleToInsertRatio(4.0, 1, (-1e9, 1e9)), read=read,
              arrays=arrays)
    pub = SamplingPublisher(t, arrays)
    for _ in range(3):
        n = 40
        ends = np.zeros(n, bool)
        ends[9::10] = True
        pub.begin()
        t.insert_nowait({"obs": torch.zeros(n, 4), "reward": torch.ones(n), "terminated": torch.from_numpy(ends)},
                        np.ones(n), episode_end=ends)
        pub.end()
    _, info = t.sample_nowait(8)
    t.update_priorities(info.keys.numpy(), np.full(8, 2.0))
    t.note_sampled(np.zeros(0, np.int64))
    versions = torch.full((256,), -1, dtype=torch.int64)  # a shard's rows' versions (the bulk path's seqlock)
    slots = np.arange(4, dtype=np.int64)
    _bulk.seqlock_begin(versions, slots)
    _bulk.seqlock_end(versions, slots, slots)
    _bulk.seqlock_end_steps(versions, 250, len(_bulk.seqlock_begin_steps(versions, 250, 10)))  # (wraps)
    ss = SharedSampling(pub.descriptor(), {n: arrays.get(n) for n in arrays.layout()})
    return t, pub, ss, st._fields


def _one_sided(shards: list[tuple[Table, SamplingPublisher, SharedSampling, dict[str, torch.Tensor]]]) -> None:
    """The client's draw over several shards (ReplayClient.sample_now's calls), a read server's, and
    the single-shard kernels."""
    n = 16
    ss0 = shards[0][2]
    w = max(ss0.window, 1)
    names = ["obs", "reward", "terminated"]
    parts = []
    for _t, _pub, ss, fields in shards:
        src = np.array([fields[f].data_ptr() for f in names], np.int64)
        rb = np.array([fields[f][0].numel() * fields[f].element_size() for f in names], np.int64)
        parts.append((ss, src, rb))
    group = SharedShards(parts)
    out = [np.zeros((n, w, *((4,) if f == "obs" else ())), np.float32 if f != "terminated" else np.bool_)
           for f in names]
    bases = np.array([o.ctypes.data for o in out], np.int64)
    item_nbytes = parts[0][2] * w
    m = len(parts)
    seqs, sizes, counts, where = np.zeros(m, np.int64), np.zeros(m, np.int64), np.zeros(m, np.int64), np.zeros(3, np.int64)
    masses, lows, shares, least = np.zeros(m), np.zeros(m), np.zeros(m), np.zeros(1)
    mask = np.empty((n, w), np.bool_)
    keys, q, times = np.empty(n, np.int64), np.empty(n), np.empty(n, np.int64)
    valid, weights = np.empty(n, np.bool_), np.empty(n, np.float32)
    rng = np.random.default_rng(0)
    tags = np.arange(m, dtype=np.int64) << 48
    if group.figures(rng.random(n), seqs, sizes, masses, lows, counts, shares, least) == 0 and group.take(counts) < 0:
        group.draw(rng.random(n), bases, item_nbytes, tags, 0.4, mask, keys, q, times, valid, weights, seqs, counts,
                   shares, least, where)
    ss, src, rb = parts[0]
    seq = ss.figures()[0]
    if seq >= 0:
        ss.sample_part(seq, rng.random(n), src, rb, bases, mask, keys, q, times, valid, 0, 1.0, 1.0, 0.4, weights)
        ss.sample_into(ss.figures()[0], rng.random(n), src, rb, bases, mask, keys, q, times, valid)
        status, plan = ss.draw(ss.figures()[0], rng.random(n))
        if status == 0:
            ss.copy_windows(plan, src, rb, bases, mask)
    take_counts([p[0] for p in parts], [1] * m)
    serve_sample(ss, {"n": 4, "seed": 1}, [(f, int(b), int(a)) for f, b, a in zip(names, rb, src)], 64)


def _evictions_and_restores() -> list[str]:
    """The selectors' eviction kernels (every sampler and remover kind over a full ring), a checkpoint's
    restore (the sum tree's rebuild, the storage's rewrite count) and the budget's give-back."""
    done = []
    for sampler, remover in ((Uniform(), Fifo()), (Prioritized(0.6), Lifo()), (MaxHeap(), MinHeap()),
                             (MinHeap(), MaxHeap())):
        st = Storage([FieldSpec("obs", (4,), torch.float32)], 64)
        t = Table(st, sampler=sampler, remover=remover, rate_limiter=MinSize(1), read=WindowRead(4, "tail"),
                  max_size=30)  # (the remover's turn: more items than this)
        for _ in range(3):  # past the capacity: every insert evicts
            t.insert_nowait({"obs": torch.zeros(20, 4)}, np.arange(1.0, 21.0), episode_end=np.arange(20) % 10 == 9)
        keys = t.sample_nowait(4)[1].keys.numpy()
        t.update_priorities(keys, np.full(len(keys), 3.0))
        t.delete(keys[:2])
        t2 = Table(Storage([FieldSpec("obs", (4,), torch.float32)], 64), sampler=type(sampler)(*(
            (0.6,) if isinstance(sampler, Prioritized) else ())), remover=type(remover)(), rate_limiter=MinSize(1),
            read=WindowRead(4, "tail"), max_size=30)
        t2.load_state_dict(t.state_dict())
        done.append(f"{type(sampler).__name__}+{type(remover).__name__}")
    budget = np.zeros(4, np.int64)
    _budget.set_count(budget, 0, 8)
    _budget.take(budget, 2)
    _budget.add(budget, -2)
    return done


def _bulk_gathers() -> None:
    """The bulk path's gathers (a requester copying planned rows out of a shard's memory, the rows'
    sequence lock) and the window padding's zeroing."""
    rows, dst = np.arange(16, dtype=np.int64).reshape(16, 1).astype(np.uint8), np.zeros((8, 1), np.uint8)
    src_addrs, dst_addrs, rb = (np.array([rows.ctypes.data], np.int64), np.array([dst.ctypes.data], np.int64),
                                np.ones(1, np.int64))
    starts, lengths, _bad = _gather.runs_of(np.array([1, 2, 3, 7], np.int64), 16)
    _gather.copy_runs(src_addrs, 16, dst_addrs, 8, rb, starts, lengths)
    versions = np.arange(16, dtype=np.int64)
    _gather.fence_load_versions(versions, _gather.load_versions_fence(versions, np.arange(4, dtype=np.int64)))
    _gather.zero_rows(dst_addrs, 8, rb, np.array([0, 5], np.int64))
    expand_window_spans(np.array([[0, 0, 4], [8, 1, 4]], np.int64), 4, 16)


def warm() -> list[str]:
    """Run every cached kernel of the replay paths once; returns what ran, for the log."""
    done = []
    for sampler in (Prioritized, Uniform):
        for read in (WindowRead(4, "tail"), WindowRead(4, "head"), TransitionRead(3, 0.99), StepRead()):
            shards = [_shard(sampler() if sampler is Uniform else sampler(0.6), read) for _ in range(2)]
            _one_sided(shards)
            done.append(f"{sampler.__name__}/{type(read).__name__}")
    done += _evictions_and_restores()
    _bulk_gathers()
    return done


if __name__ == "__main__":
    t0 = time.perf_counter()
    ran = warm()
    print(f"reactor: replay kernels compiled and cached ({len(ran)} table kinds) in {time.perf_counter() - t0:.1f} s")
