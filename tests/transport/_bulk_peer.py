"""An owner process for the bulk transport tests: ``python -m tests.transport._bulk_peer ROLE CONFIG_JSON``,
or forked by :mod:`tests.transport._forker` (what the tests do: :func:`run`).

It opens a :class:`BulkOwner` for ``cfg["run_id"]`` with ``cfg["backends"]``, allocates region
``cfg["region"]`` (:func:`fill_pattern`'s fields, ``cfg["rows"]`` rows), prints one JSON line
``{"descriptor": ..., "pid": ...}``, then follows commands, one per stdin line:

- ``close``: ``await owner.aclose()``, print ``{"closed": true}``, exit 0;
- ``exit``: exit 0 without closing (the atexit hook must unlink the segments).

Roles:

- ``serve``: fill every row with :func:`expected_rows`'s pattern, then wait for commands.
- ``writer``: a version column; keep overwriting random batches of rows under the sequence lock
  (row data = its new version, in every element) until stdin closes or says a command; then print
  ``{"writes": n}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import numpy as np
import torch

from reactor.transport.bulk import BulkOwner, seqlock_begin, seqlock_end

FIELDS = {
    "obs": ((8,), torch.float32),
    "step": ((), torch.int64),
    "flag": ((), torch.uint8),
    "half": ((3,), torch.bfloat16),
    "odd": ((3,), torch.uint8),  # a 3-byte row: gathered byte by byte
}


def expected_rows(rows: np.ndarray) -> dict[str, torch.Tensor]:
    """The pattern :func:`fill_pattern` writes, for the given rows (any shape)."""
    r = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    return {
        "obs": (r % 65536).to(torch.float32)[..., None] + torch.arange(8, dtype=torch.float32) / 16,
        "step": r.clone(),
        "flag": (r % 251).to(torch.uint8),
        "half": ((r % 128)[..., None] + torch.arange(3)).to(torch.bfloat16),
        "odd": ((r[..., None] * 3 + torch.arange(3)) % 256).to(torch.uint8),
    }


def fill_pattern(tensors: dict[str, torch.Tensor], rows: int) -> None:
    for name, value in expected_rows(np.arange(rows)).items():
        tensors[name].copy_(value)


def emit(obj: object) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(role: str, cfg: dict) -> None:
    owner = await BulkOwner.open(
        cfg["run_id"],
        backends=cfg.get("backends"),
        max_reply_nbytes=cfg.get("max_reply_nbytes", 256 * 2**20),
        heartbeat_ivl_s=cfg.get("heartbeat_ivl_s", 1.0),
        heartbeat_timeout_s=cfg.get("heartbeat_timeout_s", 5.0),
    )
    rows, region = cfg["rows"], cfg["region"]
    stop = threading.Event()
    commands: list[str] = []

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.append(line.strip())
            stop.set()
        stop.set()

    if role == "serve":
        tensors = {name: owner.allocate(region, name, (rows, *shape), dtype) for name, (shape, dtype) in FIELDS.items()}
        fill_pattern(tensors, rows)
        emit({"descriptor": owner.descriptor(region)})
        threading.Thread(target=read_stdin, daemon=True).start()
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    elif role == "writer":
        width = cfg.get("width", 512)
        data = owner.allocate(region, "data", (rows, width), torch.int64)
        versions = owner.allocate_versions(region)
        data.zero_()
        seqlock_begin(versions, np.arange(rows))
        seqlock_end(versions, np.arange(rows), np.zeros(rows, np.int64))
        emit({"descriptor": owner.descriptor(region)})
        threading.Thread(target=read_stdin, daemon=True).start()
        rng = np.random.default_rng(cfg.get("seed", 0))
        next_version = 1
        writes = 0
        batch = cfg.get("batch", 64)
        while not stop.is_set():
            slots = rng.choice(rows, size=batch, replace=False)
            new = np.arange(next_version, next_version + batch, dtype=np.int64)
            next_version += batch
            seqlock_begin(versions, slots)
            # Element by element along the row (a chunked loop), so that a reader overlapping this
            # write sees a row half old, half new unless the sequence lock catches it.
            idx = torch.from_numpy(slots)
            for c in range(0, width, 64):
                data[idx, c : c + 64] = torch.from_numpy(new)[:, None]
            seqlock_end(versions, slots, new)
            writes += 1
            if writes % 16 == 0:
                await asyncio.sleep(0)
        emit({"writes": writes})
    else:
        raise SystemExit(f"unknown role {role!r}")
    cmd = commands[0] if commands else "close"
    if cmd == "close":
        await owner.aclose()
        emit({"closed": True})
    elif cmd == "exit":
        return


def run(role: str, cfg: dict) -> None:
    """:func:`main` on the event loop ``cfg["loop"]`` names (``uvloop`` or ``asyncio``)."""
    if cfg.get("loop") == "uvloop":
        import uvloop

        uvloop.run(main(role, cfg))
    else:
        asyncio.run(main(role, cfg))


if __name__ == "__main__":
    run(sys.argv[1], json.loads(sys.argv[2]))
