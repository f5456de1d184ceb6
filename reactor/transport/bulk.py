"""Bulk transport: one-sided regions that readers gather rows from without the owner's help.

The GEAR idea: a replay shard *owns* its trajectory memory, and a learner *pulls* the rows (steps
of sequence windows) it sampled straight out of it, instead of the shard copying them through its
message queue. Here that is two objects and three backends behind them:

- :class:`BulkOwner` (one per owning process) allocates *regions*: named groups of *fields*, each a
  contiguous ``[rows, *shape]`` tensor (``BulkOwner.allocator(region)`` plugs into
  ``reactor.replay.Storage(..., allocator=...)``). ``descriptor(region)`` returns a small msgpack-able
  dict that tells any reader how to reach it.
- :class:`BulkReader` attaches descriptors and reads rows: ``await reader.read(region, rows)``
  returns ``{field: tensor [*rows.shape, *shape]}``, into caller-provided buffers when given.
  ``read_runs`` takes ``(offset, length)`` runs instead; ``read_checked`` also returns which rows
  were stable under a concurrent writer (the sequence lock, :func:`seqlock_begin`).
- Backends (:func:`choose_backend` picks one from where owner and reader run; apps never name it):

  ========  ===================================================================================
  ``shm``   same host: every field lives in a POSIX shared-memory segment named from (run id,
            region, field); the reader maps it read-only and gathers itself. No socket, no copy
            but the gather into the reader's buffer.
  ``zmq``   between hosts: a server thread in the owner (its own zmq socket, never the owner's
            event loop) gathers the rows and replies with them as zero-copy frames.
  ``rdma``  between hosts with RDMA devices on both: RDMA READ through pyverbs of the row runs,
            region keys exchanged through the zmq server (``reactor/transport/_rdma.py``).
  ========  ===================================================================================

Failure: a reader never silently returns data of a dead owner. ``shm`` segments carry the owner's
pid and generation in a header; a read checks, after gathering, that the owner is alive and the
segment still live, and raises ``PeerLostError`` otherwise. Segments are unlinked on ``aclose()``,
at interpreter exit, and -- after a ``kill -9`` -- by the next owner of the same run or by
:func:`cleanup_stale_segments`. A ``zmq`` reader learns of a dead owner from its connection closing
(or heartbeats stopping) and raises ``PeerLostError`` within a bounded time, never hangs.

GPU: a region field on a CUDA device is served over ``zmq`` only (the server gathers on the device
and stages the rows through host memory); it has no ``shm`` segment, and RDMA registers host memory
only. A CPU field can be pinned (``pin_memory=True``, CUDA present): its shm pages are registered
with CUDA so host-to-device copies from it run at full speed. A CUDA ``out`` buffer given to a read
is filled through a host staging buffer. Only the CPU paths run on machines without CUDA.

The owner is in ``_bulkowner.py``, the reader in ``_bulkreader.py``, what both use (constants, host
ids, the sequence lock) in ``_bulkbase.py``; the zmq server and client in ``_bulkzmq.py``, the shm
segments in ``_shm.py``, RDMA in ``_rdma.py``, the gather kernels in ``_gather.py``.

Example::

    owner = await BulkOwner.open(run_id)
    storage = Storage(specs, capacity, allocator=owner.allocator("shard0"))
    desc = owner.descriptor("shard0")          # send it to learners over the control plane

    reader = await BulkReader.open()
    await reader.attach(desc)
    rows, mask = storage.plan_windows(keys, 32)  # (done where the index lives)
    batch = await reader.read("shard0", rows)     # {"obs": [B, 32, 64], ...}
"""


from __future__ import annotations

from ._bulkbase import (
    BACKENDS,
    VERSION_FIELD,
    Backend,
    BulkCapabilities,
    capabilities,
    choose_backend,
    cleanup_stale_segments,
    coalesce_runs,
    host_id,
    seqlock_begin,
    seqlock_begin_steps,
    seqlock_end,
    seqlock_end_steps,
)
from ._bulkowner import BulkOwner
from ._bulkreader import BulkReader

__all__ = [
    "BACKENDS",
    "VERSION_FIELD",
    "Backend",
    "BulkCapabilities",
    "BulkOwner",
    "BulkReader",
    "capabilities",
    "choose_backend",
    "cleanup_stale_segments",
    "coalesce_runs",
    "host_id",
    "seqlock_begin",
    "seqlock_begin_steps",
    "seqlock_end",
    "seqlock_end_steps",
]
