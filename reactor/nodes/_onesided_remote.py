"""One-sided sampling of shards on other hosts for :class:`~reactor.nodes.replay_client.ReplayClient`
(issue 21): a sample asks each such shard's bulk read server once to draw its count from the state the
shard publishes (the server's thread runs the kernel a reader on that host would; the shard's loop takes
no part), and assembles the replies. Shards of this host in the same sample are drawn from their memory.

A mixin below :class:`~reactor.nodes._onesided.OneSidedSampling`, which holds the state these methods use
(declared here), the host path, the held notices and the draws ahead; see that module's docstring.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import MalformedFrameError, PeerLostError
from .._native import host_empty
from ..replay.shared import EMPTY as _EMPTY
from ..replay.shared import OK as _OK
from ..replay.shared import importance_weights, least_probability, take_counts, transitions_from_windows
from ..transport._bulkzmq import mark_seen
from ._replycheck import figures_problem, items_problem
from ._shardkeys import make_keys
from .messages import SampledBatch, SampledKeys, ShardMass

__all__ = ["ONE_SIDED_PATIENCE_S", "REMOTE_SAMPLE_OP", "RemoteSampling"]

#: The bulk read server's op through which requesters on other hosts sample a shard one-sidedly.
REMOTE_SAMPLE_OP = "replay_sample"
#: How long a one-sided draw waits out a shard's changes before it leaves the sample to messages.
ONE_SIDED_PATIENCE_S = 0.005


def _first_bad_mass(masses: list[float]) -> int | None:
    """The index of the first mass that is not a finite number >= 0 (NaN, inf, below 0: read from corrupt
    memory; a sound sum tree's root never is), or None."""
    return next((j for j, u in enumerate(masses) if not 0.0 <= u < math.inf), None)


def _corrupt(shard: int, sh: Any, why: str, notices: list[SampledKeys]) -> MalformedFrameError:
    """The error of a draw refused by shard ``shard``'s corrupt published state (``why`` follows "is
    inconsistent"): its ``shard``, its ``offer`` (``sh``: what :meth:`OneSidedSampling.drop_one_sided`
    drops, and only while it is the shard's offer) and the ``notices`` of the draws made."""
    err = MalformedFrameError(f"replay shard {shard}: its published sampling state (region {sh.region!r}) is "
                              f"inconsistent{why}: corrupt shared memory; sample through messages")
    err.shard, err.offer, err.notices = shard, sh, notices  # type: ignore[attr-defined]
    return err


@dataclass
class _RemoteShard:
    """A shard of another host that samples for this client on its bulk read server."""

    data_region: str
    window: int
    beta: float
    max_items: int  # the most items its server draws in one reply
    transition: Any = None  # the TransitionRead made of its windows, or None


@dataclass
class _RemoteDraw:
    """A sample over shards of other hosts whose requests are out (:meth:`OneSidedSampling._start_remote`):
    what its finish needs, and the shards lost or restarted since it began (their parts go)."""

    n: int
    live: list[int]
    share: np.ndarray
    local: list[tuple[int, int]]  # (shard of this host, its count): drawn at the finish
    remote: list[tuple[int, int]]  # (shard of another host, its count)
    sent: list[Any]  # per remote shard: the request sent (BulkReader.send_call), or the error sending it raised
    dropped: set[int]
    # The offers of the shards of other hosts as the draw began: their replies are read by these, an
    # offer dropped meanwhile (drop_one_sided) too (the shard is alive: its part and its notices stand)
    servers: dict[int, _RemoteShard]
    task: asyncio.Task[Any] | None = None  # its finish, once a take awaits it (a cancelled take leaves it running)


class RemoteSampling:
    """The methods of one-sided samples over shards of other hosts (:meth:`OneSidedSampling.asample_now`,
    the draws ahead of :meth:`OneSidedSampling.draw_ahead`); the state and the methods of the host
    path they use are :class:`~reactor.nodes._onesided.OneSidedSampling`'s."""

    _shared: dict[int, Any]
    _remote_shared: dict[int, _RemoteShard]
    _remote_ahead: Any  # deque[_RemoteDraw]
    _figures: dict[int, Any]
    _layouts: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]
    _reader: Any
    rng: np.random.Generator
    beta: float | None
    live_shards: list[int]
    _tally: Callable[..., None]
    _hold_keys: Callable[..., list[SampledKeys]]
    take_notices: Callable[..., list[SampledKeys]]
    _stable_figures: Callable[..., tuple[int, float, float, int] | None]

    def _start_remote(self, n: int) -> _RemoteDraw | None:
        """:meth:`asample_now`'s first half: the per-shard counts from the cached figures, and the
        requests to the read servers of the shards of other hosts, sent now. None when no draw can
        start (nothing to draw, or a count above what a server sends in one reply)."""
        assert self._reader is not None
        live = self.live_shards
        figs = {k: self._figures[k] for k in live}
        masses = np.array([figs[k].mass for k in live], dtype=np.float64)  # type: ignore[attr-defined]
        sizes = np.array([figs[k].size for k in live], dtype=np.float64)  # type: ignore[attr-defined]
        share = masses if masses.sum() > 0 else sizes
        if not share.sum() > 0:
            return None
        share = share / share.sum()
        counts = self.rng.multinomial(n, share).tolist()
        seeds = self.rng.integers(0, 2**63, size=len(live)).tolist()
        local = [(k, c) for k, c in zip(live, counts) if k in self._shared and c]
        remote = [(k, c, sd) for k, c, sd in zip(live, counts, seeds) if k in self._remote_shared]
        if any(c > self._remote_shared[k].max_items for k, c, _sd in remote):
            return None  # more than a server sends in one reply (big windows): messages
        sent: list[Any] = []
        for k, c, sd in remote:
            try:
                sent.append(self._reader.send_call(self._remote_shared[k].data_region, REMOTE_SAMPLE_OP,
                                                   {"n": c, "seed": sd}))
            except Exception as e:  # (a lost connection: that part fails, the others are waited for)
                sent.append(e)
        return _RemoteDraw(n, live, share, local, [(k, c) for k, c, _sd in remote], sent, set(),
                           {k: self._remote_shared[k] for k, _c, _sd in remote})

    async def _finish_remote(self, draw: _RemoteDraw) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """:meth:`asample_now`'s second half: the read servers' replies awaited and checked, the parts of
        shards of this host drawn, the batch assembled (raises as :meth:`asample_now`)."""
        assert self._reader is not None
        n, live, share, local, remote = draw.n, draw.live, draw.share, draw.local, draw.remote

        # Each reply awaited in turn (the servers answer at once, side by side: by the time the first is
        # in, the others mostly are too, and are taken without a wait; no task per shard).
        replies: list[Any] = []
        deadline = asyncio.get_running_loop().time() + self._reader.timeout_s  # (one for all: a hung server costs it once)
        for (k, _c), sent in zip(remote, draw.sent):
            if isinstance(sent, BaseException):
                replies.append(sent)
                continue
            if k in draw.dropped:  # lost or restarted meanwhile: its reply is not waited for (dropped if it comes)
                self._reader.forget(sent)
                replies.append(None)
                continue
            try:
                replies.append(await self._reader.reply(sent, deadline=deadline))
            except Exception as e:  # (each part's error, as it was for that shard)
                replies.append(e)
        parts: dict[int, dict[str, Any]] = {}
        failed: BaseException | None = None
        for (k, c), rep in zip(remote, replies):
            if k in draw.dropped:  # lost or restarted while this waited: its part goes, told to no one
                continue
            try:
                if isinstance(rep, PeerLostError):
                    lost = PeerLostError(f"replay shard {k}: its read server is gone ({rep})")
                    lost.shard = k  # type: ignore[attr-defined]
                    raise lost from rep
                if isinstance(rep, MalformedFrameError):  # (its server's answer: its published state is corrupt;
                    # or a reply the reader could not decode)
                    raise MalformedFrameError(f"replay shard {k}'s read server: {rep}") from rep
                if isinstance(rep, BaseException):
                    raise rep
                part = self._check_remote_part(k, c, rep, draw.servers[k])
            except Exception as e:  # the other servers drew theirs: those draws still count (below)
                if isinstance(e, MalformedFrameError) and not hasattr(e, "shard"):
                    e.shard = k  # type: ignore[attr-defined]  # (drop_one_sided: that server's offer goes)
                    e.offer = draw.servers[k]  # type: ignore[attr-defined]  # (that offer, not a later life's)
                failed = failed or e
                continue
            if part is not None:
                parts[k] = part
        if failed is not None:
            # The batch is dropped; the shards that did draw are still told (times sampled, the rate
            # limiter's count), as when a shard draws nothing: the notices ride on the error.
            failed.notices = self.take_notices(  # type: ignore[attr-defined]
                [SampledKeys(k, make_keys(k, p["keys"])) for k, p in parts.items()])
            raise failed
        hurry = any(p.get("parked") for p in parts.values())
        local = [(k, c) for k, c in local if k in self._shared]  # (one forgotten meanwhile: a part short)
        if local and not draw.dropped and len(parts) == sum(1 for _k, c in remote if c):
            # Shards of this host in the same sample: their counts taken all or none (only now: a
            # remote part that came back empty would have wasted them), then drawn here, from their memory.
            took = take_counts([self._shared[k].table for k, _c in local], [c for _k, c in local])
            if took < 0:
                hurry = hurry or took == -2
                for k, c in local:
                    try:
                        part = self._draw_local_part(k, c)
                    except (MalformedFrameError, PeerLostError) as e:  # (corrupt, or its owner died: ``shard`` set)
                        # The batch goes; the parts drawn still count, as when a server fails (above).
                        e.notices = self.take_notices(  # type: ignore[attr-defined]
                            [SampledKeys(j, make_keys(j, p["keys"])) for j, p in parts.items()])
                        raise
                    if part is not None:
                        parts[k] = part
        notices = [SampledKeys(k, make_keys(k, p["keys"])) for k, p in parts.items()]
        if draw.dropped or sum(int(p["n"]) for p in parts.values()) != n:
            # A shard drew nothing, or one the shares stand on was lost meanwhile: no batch, and the
            # draws made still count.
            return None, self.take_notices(notices)
        return (self._assemble_remote(n, live, share, parts),
                self._hold_keys([(m.shard, m.keys) for m in notices], hurry))

    def _check_remote_part(self, shard: int, count: int, rep: Any, rs: _RemoteShard) -> dict[str, Any] | None:
        """A read server's sample reply, checked (it comes from the network) against the offer ``rs``
        it was asked under; its figures cached."""
        bad = MalformedFrameError(f"replay shard {shard}'s read server sent a malformed sample reply")

        def malformed(why: str) -> MalformedFrameError:
            return MalformedFrameError(f"replay shard {shard}'s read server sent a malformed sample reply: {why}")

        if not isinstance(rep, dict) or type(rep.get("n")) is not int:
            raise bad
        if any(x in rep for x in ("mass", "min", "size")):  # (none: the server kept none, nor does the client)
            why = figures_problem(rep.get("mass"), rep.get("min"), rep.get("size"), rs.beta, drew=rep["n"] > 0)
            if why:  # (cached, they would make the next samples' counts: never a bad one)
                raise malformed(why)
            self._figures[shard] = ShardMass(shard, 0, 0, "", float(rep["mass"]), float(rep["min"]), rep["size"],
                                             rs.beta)
        if rep["n"] == 0:
            return None
        if rep["n"] != count:
            raise bad
        why = items_problem(rep.get("keys"), rep.get("probabilities"), rep.get("times_sampled"), asked=count,
                            shard=None)
        if why:
            raise malformed(why)
        w = max(rs.window, 1)
        layout = self._layouts[rs.data_region]
        names = rep.get("fields")
        data = rep.get("data")
        arrays = [(rep.get(x), dt) for x, dt in (("keys", np.int64), ("probabilities", np.float64),
                                                 ("times_sampled", np.int64), ("valid", np.bool_))]
        if (not all(isinstance(a, np.ndarray) and a.dtype == dt and a.shape == (count,) for a, dt in arrays)
                or not isinstance(names, list) or sorted(names) != sorted(layout) or not isinstance(data, list)
                or len(data) != len(names)):
            raise bad
        mask = rep.get("mask")
        if rs.window and not (isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.shape == (count, w)):
            raise bad
        out = {}
        for name, d in zip(names, data):
            dtype, shape = layout[name]
            nbytes = count * w * math.prod(shape) * dtype.itemsize
            if not (isinstance(d, np.ndarray) and d.dtype == np.uint8 and d.shape == (nbytes,)):
                raise bad
            out[name] = d  # the frame's bytes: copied once, into the batch (_assemble_remote)
        return {"n": count, "keys": rep["keys"], "q": rep["probabilities"], "times": rep["times_sampled"],
                "valid": rep["valid"], "mask": mask, "data": out, "window": rs.window,
                "parked": rep.get("parked") is True, "region": rs.data_region, "transition": rs.transition}

    def _draw_local_part(self, shard: int, count: int) -> dict[str, Any] | None:
        """One shard's part of a mixed sample, drawn from its mapped memory (its figures refreshed); None
        when it draws nothing (below its min size, no mass, changing for too long).

        Raises:
            MalformedFrameError: its published state is corrupt under a settled count (a mass that is not
                a finite number >= 0, a draw refused on a state that did not change), as the host path
                finds it (``shard``, ``offer``; the caller adds the notices).
            PeerLostError: its owner died, found after the draw or in the middle of a change, its
                count odd for good (``shard``; the caller adds the notices)."""
        sh = self._shared[shard]
        deadline = time.perf_counter() + ONE_SIDED_PATIENCE_S
        w = max(sh.table.window, 1)
        layout = self._layouts[sh.data_region]
        out = {f: host_empty((count, w, *layout[f][1]) if sh.table.window else (count, *layout[f][1]), layout[f][0])
               for f in sh.names}
        mask = np.empty((count, w), np.bool_)
        keys, q = np.empty(count, np.int64), np.empty(count, np.float64)
        times, valid = np.empty(count, np.int64), np.empty(count, np.bool_)
        uniforms = self.rng.random(count)
        while True:  # (its count was taken from its rate limiter: asample_now)
            f = self._stable_figures(sh, deadline)
            if f is None:  # it kept changing: or its owner died mid-change, its count odd for good (say so)
                self._check_local_owner(shard, sh)
                return None
            seq, mass, low, size = f
            if _first_bad_mass([mass]) is not None:  # (read under a settled count: the same at every draw)
                raise _corrupt(shard, sh, f": its mass {mass!r} is not a finite number >= 0", [])
            self._figures[shard] = ShardMass(shard, 0, 0, "", mass, low, size, sh.table.beta)
            if size < sh.table.min_size or not mass > 0:
                return None
            status = sh.table.sample_into(seq, uniforms, sh.src_addrs, sh.row_nbytes,
                                          np.array([out[f].data_ptr() for f in sh.names], np.int64), mask, keys, q,
                                          times, valid)
            if status == _OK:
                self._check_local_owner(shard, sh)  # (a dead shard's data is never returned)
                return {"n": count, "keys": keys, "q": q, "times": times, "valid": valid,
                        "mask": mask if sh.table.window else None, "data": out, "window": sh.table.window,
                        "region": sh.data_region, "transition": sh.table.transition}
            self._tally(retries=1)
            if status != _EMPTY and sh.table.figures()[0] == seq:
                # Refused on a state that did not change (the count moves at every change): corrupt
                # memory, which a draw again meets again (the host path's rule, OneSidedSampling._sample_on;
                # this returned no batch, without a word, at every sample).
                raise _corrupt(shard, sh, f" under a settled sequence count {seq} (an index or a probability out of "
                                          f"range)", [])
            if time.perf_counter() > deadline:
                return None

    def _check_local_owner(self, shard: int, sh: Any) -> None:
        """Raise PeerLostError naming shard ``shard`` of this host (``shard``) if its owner is gone."""
        try:
            self._reader.check_alive(sh.data_region)  # type: ignore[union-attr]
        except PeerLostError as e:
            lost = PeerLostError(f"replay shard {shard}: its shared memory is gone ({e})")
            lost.shard = shard  # type: ignore[attr-defined]
            raise lost from e

    def _assemble_remote(self, n: int, live: list[int], share: np.ndarray,
                         parts: dict[int, dict[str, Any]]) -> SampledBatch:
        """One batch from the shards' parts, in shard order; weights as the one-round message sample."""
        order = sorted(parts)
        shares = dict(zip(live, share.tolist()))
        keys = np.concatenate([make_keys(k, parts[k]["keys"]) for k in order])
        probs = np.concatenate([shares[k] * parts[k]["q"] for k in order])
        times = np.concatenate([parts[k]["times"] for k in order])
        valid = np.concatenate([parts[k]["valid"] for k in order])
        figs = [self._figures[k] for k in live]
        beta = self.beta if self.beta is not None else max(f.beta for f in figs)  # type: ignore[attr-defined]
        min_p = least_probability(share, np.array([f.mass for f in figs]), np.array([f.min_mass for f in figs]))  # type: ignore[attr-defined]
        weights = importance_weights(probs, min_p, beta)
        first = parts[order[0]]
        w = max(first["window"], 1)
        data: dict[str, torch.Tensor] = {}
        for name in first["data"]:
            dtype, shape = self._layouts[first["region"]][name]
            t = host_empty((n, w, *shape) if first["window"] else (n, *shape), dtype)
            flat = t.view(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, np.uint8)
            a = 0
            for k in order:  # each part's bytes, straight from its reply frame (local parts: their tensor)
                part = parts[k]["data"][name]
                src = part if isinstance(part, np.ndarray) else part.reshape(-1).view(torch.uint8).numpy()
                flat[a:a + src.shape[0]] = src
                a += src.shape[0]
            data[name] = t
        if first["window"]:
            data["mask"] = torch.from_numpy(np.concatenate([parts[k]["mask"] for k in order]))
        whole = bool(valid.all())
        self._tally(gathered=n, samples=1, dropped=0 if whole else int((~valid).sum()))
        if not whole:
            idx = np.flatnonzero(valid)
            data = {k: v.index_select(0, torch.from_numpy(idx)) for k, v in data.items()}
            keys, times, probs, weights = keys[idx], times[idx], probs[idx], weights[idx]
        transition = first["transition"]  # (the TransitionRead its windows are turned into, or None: its offer's)
        if transition is not None:
            data = transitions_from_windows(data, transition)
        return SampledBatch(data=data, keys=torch.from_numpy(keys), weights=torch.from_numpy(weights),
                            probabilities=torch.from_numpy(probs),
                            table_size=int(sum(f.size for f in figs)),  # type: ignore[attr-defined]
                            times_sampled=torch.from_numpy(times))

    async def _remote_result(self, draw: _RemoteDraw) -> tuple[SampledBatch | None, list[SampledKeys]]:
        """The oldest remote draw ahead finished (its replies awaited), taken off the queue once done,
        lost-shard rule applied (:meth:`_drop_drawn_of`); a caller cancelled while it waits leaves
        the draw, still finishing, to the next take."""
        if draw.task is None:
            draw.task = asyncio.ensure_future(self._finish_remote(draw))
            draw.task.add_done_callback(mark_seen)
        await asyncio.wait((draw.task,))  # (a cancelled caller leaves the task running, and the draw queued)
        if not (self._remote_ahead and self._remote_ahead[0] is draw):
            return None, []  # dropped meanwhile (a shard lost or restarted), taken by another take, or closed
        self._remote_ahead.popleft()
        return draw.task.result()
