"""The RDMA backend of the bulk transport: RDMA READ of row runs through pyverbs.

Written against the pyverbs API of rdma-core (``pyverbs.device.Context``, ``pd.PD``, ``mr.MR``
with ``address=`` to register memory that already exists, ``cq.CQ``, ``qp.QP`` of type RC with
``to_rts``, ``wr.SendWR`` with ``IBV_WR_RDMA_READ`` and ``set_wr_rdma``, ``CQ.poll``). No RDMA
device exists where this was written: everything here is behind :func:`probe` and has never run;
what it shares with the other backends (descriptors, run coalescing, bounds, error paths, the
sequence-lock mask) is tested through them.

Protocol:

- Owner: one verbs context and PD; every CPU field of every region is registered as an MR with
  remote-read access (the shm segment or tensor itself: nothing is copied). ``describe`` gives each
  field's address and rkey. The owner's zmq server thread answers ``rdma_connect`` requests: the
  reader's QP number, LID, GID and PSN in; a fresh RC QP of the owner's, moved to RTS against the
  reader's, and its own QP number, LID, GID and PSN out.
- Reader: one context, PD, CQ and RC QP per attached region; a registered staging buffer (grown
  on demand) that RDMA READs land in; then one copy into the caller's buffers. A read posts one
  READ per (run, field), chained in batches of at most ``QUEUE_DEPTH`` work requests with only the
  last signaled, and polls the CQ (yielding to the event loop between polls).
- Sequence lock: versions READs, then the data READs, then versions READs again; the first data
  READ and the second versions READs carry ``IBV_SEND_FENCE`` (a fenced WR starts only after every
  earlier READ on the QP completed), so the three groups hit the owner's memory in that order.
- Failure: a READ completing with an error status (the owner's QP is gone: retries exhausted,
  remote access error) raises ``PeerLostError``; so does no completion within the reader's
  ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from typing import Any

import numpy as np

from reactor._errors import PeerLostError

__all__ = ["QUEUE_DEPTH", "RdmaOwner", "RdmaReader", "probe"]

#: Work requests posted before waiting for a completion (also the QPs' send queue depth).
QUEUE_DEPTH = 256
#: The most reader QPs one owner keeps (each holds NIC resources).
MAX_CONNECTIONS = 256
_PORT = int(os.environ.get("REACTOR_RDMA_PORT", "1"))
_GID_INDEX = int(os.environ.get("REACTOR_RDMA_GID_INDEX", "0"))


def probe() -> tuple[bool, str]:
    """Whether an RDMA device is usable here, found by trying; ``(ok, reason or device name)``.

    Not by import alone: Debian's ``python3-pyverbs`` imports with no device, and fails later.
    """
    try:
        import pyverbs.device as verbs_device  # type: ignore[import-not-found]
    except ImportError as exc:
        return False, f"pyverbs is not installed ({exc}); install the 'rdma' extra and rdma-core"
    try:
        devices = verbs_device.get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsRDMAError when no driver/device
        return False, f"pyverbs.device.get_device_list() failed: {exc}"
    if not devices:
        return False, "no RDMA device (pyverbs.device.get_device_list() is empty)"
    name = _device_name(devices[0])  # pragma: no cover - needs a device
    try:  # pragma: no cover - needs a device
        ctx = verbs_device.Context(name=name)
        ctx.close()
    except Exception as exc:  # pragma: no cover - needs a device
        return False, f"cannot open a verbs context on RDMA device {name!r}: {exc}"
    return True, name  # pragma: no cover - needs a device


def _device_name(dev: Any) -> str:  # pragma: no cover - needs a device
    name = dev.name
    return name.decode() if isinstance(name, bytes) else str(name)


class _Verbs:  # pragma: no cover - needs a device
    """A context, PD and port information on the first device (shared by owner and reader code)."""

    def __init__(self) -> None:
        import pyverbs.device as d  # type: ignore[import-not-found]
        import pyverbs.enums as e  # type: ignore[import-not-found]
        from pyverbs.pd import PD  # type: ignore[import-not-found]

        ok, name = probe()
        if not ok:
            raise RuntimeError(f"rdma backend unavailable: {name}")
        self.e = e
        self.name = name
        self.ctx = d.Context(name=name)
        self.pd = PD(self.ctx)
        port = self.ctx.query_port(_PORT)
        self.lid = int(port.lid)
        self.ethernet = int(port.link_layer) == int(getattr(e, "IBV_LINK_LAYER_ETHERNET", 2))
        self.gid = str(self.ctx.query_gid(_PORT, _GID_INDEX).gid) if self.ethernet else ""
        self.mtu = port.active_mtu

    def new_qp(self, cq: Any) -> Any:
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # type: ignore[import-not-found]

        e = self.e
        cap = QPCap(max_send_wr=QUEUE_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.port_num = _PORT
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        return QP(self.pd, init, attr)

    def info(self, qp: Any, psn: int) -> dict[str, Any]:
        return {"qp_num": int(qp.qp_num), "lid": self.lid, "gid": self.gid, "psn": psn}

    def connect(self, qp: Any, my_psn: int, peer: dict[str, Any]) -> None:
        """Move ``qp`` to RTS against the peer's QP (RC, READs both ways allowed)."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute  # type: ignore[import-not-found]
        from pyverbs.qp import QPAttr  # type: ignore[import-not-found]

        e = self.e
        attr = QPAttr(qp_state=e.IBV_QPS_RTR, cur_qp_state=qp.qp_state)
        attr.path_mtu = self.mtu
        attr.dest_qp_num = int(peer["qp_num"])
        attr.rq_psn = int(peer["psn"])
        attr.sq_psn = my_psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ
        if self.ethernet:
            gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=_GID_INDEX)
            attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=_PORT)
        else:
            attr.ah_attr = AHAttr(dlid=int(peer["lid"]), port_num=_PORT)
        qp.to_rts(attr)

    def close(self) -> None:
        self.pd.close()
        self.ctx.close()


# ---------------------------------------------------------------------------------------- owner


class RdmaOwner:  # pragma: no cover - needs a device
    """The owner's side: registered regions, and the QPs that readers connect."""

    def __init__(self) -> None:
        self.v = _Verbs()
        self.mrs: dict[tuple[str, str], tuple[Any, Any]] = {}  # (region, field) -> (MR, tensor kept alive)
        self.qps: list[tuple[Any, Any]] = []  # (QP, CQ) per connected reader

    def register(self, region: str, field: str, tensor: Any) -> None:
        from pyverbs.mr import MR  # type: ignore[import-not-found]

        e = self.v.e
        nbytes = tensor.numel() * tensor.element_size()
        mr = MR(self.v.pd, nbytes, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ, address=tensor.data_ptr())
        self.mrs[(region, field)] = (mr, tensor)

    def describe(self, region: str, connect: dict[str, Any]) -> dict[str, Any]:
        fields = {
            f: {"addr": int(mr.buf), "rkey": int(mr.rkey), "nbytes": int(mr.length)}
            for (r, f), (mr, _t) in self.mrs.items()
            if r == region
        }
        return {"device": self.v.name, "connect": connect, "fields": fields}

    def serve_connect(self, req: dict[str, Any], region: Any) -> dict[str, Any]:
        """The ``rdma_connect`` op (runs in the zmq server thread)."""
        from pyverbs.cq import CQ  # type: ignore[import-not-found]

        peer = req.get("qp")
        if not isinstance(peer, dict) or not all(k in peer for k in ("qp_num", "lid", "gid", "psn")):
            raise ValueError("rdma_connect: 'qp' must hold qp_num, lid, gid and psn")
        if len(self.qps) >= MAX_CONNECTIONS:
            raise ValueError(f"rdma_connect: this owner already serves {MAX_CONNECTIONS} RDMA readers")
        cq = CQ(self.v.ctx, 16)
        qp = self.v.new_qp(cq)
        psn = secrets.randbelow(1 << 24)
        self.v.connect(qp, psn, peer)
        self.qps.append((qp, cq))
        return {"qp": self.v.info(qp, psn)}

    def close(self) -> None:
        for qp, cq in self.qps:
            qp.close()
            cq.close()
        self.qps.clear()
        for mr, _t in self.mrs.values():
            mr.close()
        self.mrs.clear()
        self.v.close()


# ---------------------------------------------------------------------------------------- reader


class RdmaReader:  # pragma: no cover - needs a device
    """A reader's RC connection to one region's owner."""

    def __init__(self, v: _Verbs, qp: Any, cq: Any, fields: dict[str, dict[str, int]], timeout_s: float) -> None:
        self.v = v
        self.qp = qp
        self.cq = cq
        self.fields = fields
        self.timeout_s = timeout_s
        self.staging: Any = None  # registered MR the READs land in
        self.staging_nbytes = 0

    @classmethod
    async def connect(cls, spec: dict[str, Any], att: Any, client: Any, *, timeout_s: float) -> RdmaReader:
        from pyverbs.cq import CQ  # type: ignore[import-not-found]

        fields = spec.get("fields")
        if not isinstance(fields, dict) or set(fields) != set(att.fields) - {
            n for n in att.fields if att.fields[n].row_nbytes == 0
        }:
            raise ValueError("bulk descriptor: rdma fields do not match the region's")
        v = _Verbs()
        cq = CQ(v.ctx, QUEUE_DEPTH)
        qp = v.new_qp(cq)
        psn = secrets.randbelow(1 << 24)
        reply = await client.call(
            {"op": "rdma_connect", "region": att.name, "generation": att.generation, "qp": v.info(qp, psn)},
            timeout_s=timeout_s,
            what="rdma_connect",
        )
        v.connect(qp, psn, reply["qp"])
        return cls(v, qp, cq, fields, timeout_s)

    def _ensure_staging(self, nbytes: int) -> Any:
        from pyverbs.mr import MR  # type: ignore[import-not-found]

        if nbytes > self.staging_nbytes:
            if self.staging is not None:
                self.staging.close()
            size = max(nbytes, 2 * self.staging_nbytes, 1 << 20)
            self.staging = MR(self.v.pd, size, self.v.e.IBV_ACCESS_LOCAL_WRITE)
            self.staging_nbytes = size
        return self.staging

    async def _post_reads(self, reads: list[tuple[int, int, int, int, bool]]) -> None:
        """Post ``(local addr, nbytes, remote addr, rkey, fence)`` READs; wait for all of them."""
        from pyverbs.wr import SGE, SendWR  # type: ignore[import-not-found]

        e = self.v.e
        lkey = self.staging.lkey
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        for b0 in range(0, len(reads), QUEUE_DEPTH):
            batch = reads[b0 : b0 + QUEUE_DEPTH]
            head = None
            for i in range(len(batch) - 1, -1, -1):  # build the chain back to front
                local, nbytes, remote, rkey, fence = batch[i]
                flags = (e.IBV_SEND_SIGNALED if i == len(batch) - 1 else 0) | (e.IBV_SEND_FENCE if fence else 0)
                wr = SendWR(
                    wr_id=b0 + i, opcode=e.IBV_WR_RDMA_READ, num_sge=1,
                    sg=[SGE(local, nbytes, lkey)], send_flags=flags, next_wr=head,
                )
                wr.set_wr_rdma(rkey, remote)
                head = wr
            self.qp.post_send(head)
            while True:
                n, wcs = self.cq.poll()
                if n:
                    for wc in wcs:
                        if wc.status != e.IBV_WC_SUCCESS:
                            raise PeerLostError(
                                f"RDMA READ from the bulk owner failed with work completion status {wc.status} "
                                f"(the owner's process or QP is gone)"
                            )
                    break
                if loop.time() > deadline:
                    raise PeerLostError(f"RDMA READs from the bulk owner did not complete within {self.timeout_s} s")
                await asyncio.sleep(0)

    async def gather(
        self, att: Any, flat: np.ndarray, starts: np.ndarray, lengths: np.ndarray, names: list[str],
        dsts: dict[str, int], check: bool, exp: np.ndarray | None,
    ) -> np.ndarray | None:
        from reactor.transport._bulkzmq import seqlock_mask

        k = int(lengths.sum())
        live = [n for n in names if att.fields[n].row_nbytes]
        vf = att.version_field if check else None
        layout: list[tuple[str, int]] = []  # (field, staging offset)
        off = 0
        for n in ([vf] if vf else []) + live + ([vf] if vf else []):
            layout.append((n, off))
            off += k * att.fields[n].row_nbytes
        staging = self._ensure_staging(off)
        base = int(staging.buf)
        reads: list[tuple[int, int, int, int, bool]] = []
        for gi, (n, o) in enumerate(layout):
            rb = att.fields[n].row_nbytes
            spec = self.fields[n]
            out_row = 0
            first_of_group = check and (gi == 1 or gi == len(layout) - 1)
            for j in range(starts.shape[0]):  # one READ per run: a window batch is B runs
                s, m = int(starts[j]), int(lengths[j])
                reads.append((base + o + out_row * rb, m * rb, spec["addr"] + s * rb, spec["rkey"], first_of_group and j == 0))
                out_row += m
        await self._post_reads(reads)
        view = _address_view(base, off)
        for n, o in layout[1:-1] if vf else layout:
            nb = k * att.fields[n].row_nbytes
            np.copyto(_address_view(dsts[n], nb), view[o : o + nb])
        if not vf:
            return None
        v1 = view[: k * 8].view(np.int64)
        v2 = view[layout[-1][1] : layout[-1][1] + k * 8].view(np.int64)
        return seqlock_mask(v1.copy(), v2.copy(), exp)

    def close(self) -> None:
        if self.staging is not None:
            self.staging.close()
        self.qp.close()
        self.cq.close()
        self.v.close()


def _address_view(addr: int, nbytes: int) -> np.ndarray:  # pragma: no cover - needs a device
    """A uint8 array over ``nbytes`` at ``addr`` (memory the caller keeps alive)."""
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
