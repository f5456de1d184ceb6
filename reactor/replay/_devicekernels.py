"""Triton kernels of :class:`reactor.replay.device.DeviceReplay`: one launch per sample's tree descent
(with its keys and importance weights) and one per field's window gather (with the mask).

The torch path of DeviceReplay does the same with ~150 small kernels for the descent of a 1M-leaf
tree (8-ary: 7 levels) and ~20 for the gather (measured on an H200: 391 us a 256x64 sample as one CUDA graph, against
8.4 us for a device copy of the same bytes). Triton is optional (it comes with CUDA builds of torch);
without it, or on the CPU, DeviceReplay uses its torch path. ``TRITON_INTERPRET=1`` runs these
kernels on CPU tensors (the tests compare them with the torch path there).
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch: no Triton
    triton = None
    tl = None

__all__ = ["available", "descend", "gather"]


def available(device: torch.device) -> bool:
    """Whether the kernels run on ``device``: Triton imports and the device is a GPU (or the
    interpreter runs them on the CPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _descend_kernel(tsums, offsets, level_live, minp, rand, step_of, out_rows, out_keys, out_weights, n, beta,
                        ARITY: tl.constexpr, DEPTH: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = i < n
        total = tl.load(tsums)
        # Stratified: draw j takes a uniform point in the j-th of n equal slices of the mass.
        u = (i.to(tl.float64) + tl.load(rand + i, mask=live, other=0.0)) * (total / n)
        node = tl.zeros([BLOCK], dtype=tl.int64)
        cols = tl.arange(0, ARITY)
        for level in tl.static_range(1, DEPTH + 1):
            off = tl.load(offsets + level)
            block = tl.load(tsums + off + node[:, None] * ARITY + cols[None, :], mask=live[:, None], other=0.0)
            csum = tl.cumsum(block, 1)
            chosen = tl.sum((csum <= u[:, None]).to(tl.int64), 1)
            over = chosen > ARITY - 1
            # Rounding pushed u past the block: take its last positive child (the last child if none).
            last_pos = tl.max(tl.where(block > 0, cols[None, :], -1), 1)
            last_pos = tl.where(last_pos < 0, ARITY - 1, last_pos).to(tl.int64)
            chosen = tl.where(over, last_pos, chosen)
            before = tl.sum(tl.where(cols[None, :] == chosen[:, None] - 1, csum, 0.0), 1)
            at = tl.sum(tl.where(cols[None, :] == chosen[:, None], block, 0.0), 1)
            u = tl.where(over, at, u - before)
            # (every priority 0: the descent would walk into a level's padding; stay on live nodes)
            node = tl.minimum(node * ARITY + chosen, tl.load(level_live + level) - 1)
        leaf = tl.load(tsums + tl.load(offsets + DEPTH) + node, mask=live, other=1.0)
        mn = tl.load(minp)
        # w = (N p)^-beta / max_j (N p_j)^-beta = (leaf / min)^-beta, in float32 (exp2 and log2 are
        # float32 functions in Triton; the weights are float32 anyway)
        ratio = tl.maximum((tl.maximum(leaf, 1e-300) / tl.maximum(mn, 1e-300)).to(tl.float32), 1e-30)
        w = tl.exp2(-beta * tl.log2(ratio))
        tl.store(out_rows + i, node, mask=live)
        tl.store(out_keys + i, tl.load(step_of + node, mask=live, other=0), mask=live)
        tl.store(out_weights + i, w.to(tl.float32), mask=live)

    @triton.jit
    def _gather_kernel(src, dst, rows, keys, step_of, episode_of, mask_out, cap, T,
                       D: tl.constexpr, WRITE_MASK: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
        w = tl.program_id(0)
        k = tl.program_id(1) * BT + tl.arange(0, BT)
        kin = k < T
        r = tl.load(rows + w)
        key = tl.load(keys + w)
        idx = (r + k) % cap
        ep0 = tl.load(episode_of + r)
        held = tl.load(step_of + idx, mask=kin, other=-2)
        ep = tl.load(episode_of + idx, mask=kin, other=-2)
        valid = kin & (held == key + k) & (ep == ep0)
        if WRITE_MASK:
            tl.store(mask_out + w * T + k, valid.to(tl.uint8), mask=kin)
        out_row = (w * T + k).to(tl.int64)
        for d0 in tl.static_range(0, D, BD):  # D, BD: per field, known when compiled
            d = d0 + tl.arange(0, BD)
            din = d < D
            x = tl.load(src + idx[:, None] * D + d[None, :], mask=valid[:, None] & din[None, :], other=0)
            tl.store(dst + out_row[:, None] * D + d[None, :], x, mask=kin[:, None] & din[None, :])


def descend(tsums: torch.Tensor, offsets: torch.Tensor, live: torch.Tensor, minp: torch.Tensor, rand: torch.Tensor,
            step_of: torch.Tensor, arity: int, depth: int, beta: float, block: int = 16) -> tuple[torch.Tensor, ...]:
    """Rows, keys and importance weights of ``len(rand)`` stratified draws from the tree's nodes,
    ``block`` draws a program. Small blocks pay: the descent is a chain of dependent loads, so more
    programs in flight hide more of its latency (H200, 1M leaves, 256 or 1024 draws: 4.0 us with
    blocks of 16 against 20.6 us with 128; docs/benchmarks.md)."""
    n = rand.shape[0]
    dev = tsums.device
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    keys = torch.empty(n, dtype=torch.int64, device=dev)
    weights = torch.empty(n, dtype=torch.float32, device=dev)
    _descend_kernel[(triton.cdiv(n, block),)](tsums, offsets, live, minp, rand, step_of, rows, keys, weights, n, float(beta),
                                              ARITY=arity, DEPTH=depth, BLOCK=block)
    return rows, keys, weights


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def gather(fields: dict[str, torch.Tensor], rows: torch.Tensor, keys: torch.Tensor, step_of: torch.Tensor,
           episode_of: torch.Tensor, window: int) -> dict[str, Any]:
    """The ``[n, window, ...]`` windows starting at ``rows`` of every field, zero where masked, and the
    mask (positions past the window's episode or not holding the step the window expects)."""
    n = rows.shape[0]
    dev = rows.device
    cap = step_of.shape[0]
    mask = torch.empty((n, window), dtype=torch.bool, device=dev)
    out: dict[str, Any] = {}
    bt = min(64, triton.next_power_of_2(window))
    for j, (name, f) in enumerate(fields.items()):
        d = f[0].numel() if f.ndim > 1 else 1
        o = torch.empty((n, window, *f.shape[1:]), dtype=f.dtype, device=dev)
        bd = min(128, triton.next_power_of_2(d))
        _gather_kernel[(n, triton.cdiv(window, bt))](_bytes_view(f), _bytes_view(o), rows, keys, step_of, episode_of,
                                                     mask.view(torch.uint8), cap, window, D=d, WRITE_MASK=j == 0,
                                                     BT=bt, BD=bd)
        out[name] = o
    out["mask"] = mask
    return out
