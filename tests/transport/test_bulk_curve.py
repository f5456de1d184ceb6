"""CURVE on the bulk layer's zmq read server: encrypted, and open only to the job's key pair.

Real owners and readers in this process over real tcp sockets (loopback and a routable bind).
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

from reactor._errors import PeerLostError
from reactor.transport import CurveKeys
from reactor.transport.bulk import BulkOwner, BulkReader
from tests.transport._bulk_peer import FIELDS, expected_rows, fill_pattern


def _run_id() -> str:
    return f"c{os.getpid()}-{uuid.uuid4().hex[:10]}"


async def _owner(keys: CurveKeys | None, bind: str = "tcp://127.0.0.1:*") -> BulkOwner:
    owner = await BulkOwner.open(_run_id(), backends=["zmq"], zmq_bind=bind, curve=keys)
    tensors = {name: owner.allocate("shard0", name, (100, *shape), dtype) for name, (shape, dtype) in FIELDS.items()}
    fill_pattern(tensors, 100)
    return owner


@pytest.mark.asyncio
async def test_a_curve_read_server_serves_the_job_s_key_pair_and_refuses_others():
    keys = CurveKeys.generate()
    owner = await _owner(keys)
    readers: list[BulkReader] = []
    try:
        desc = owner.descriptor("shard0")
        assert desc["zmq"]["server_key"] == keys.public.decode()
        good = await BulkReader.open(curve=keys, timeout_s=30.0)
        readers.append(good)
        await good.attach(desc)
        rows = np.array([3, 4, 5, 90])
        got = await good.read("shard0", rows, fields=["obs", "step"])
        want = expected_rows(rows)
        assert torch.equal(got["obs"], want["obs"]) and torch.equal(got["step"], want["step"])

        plain = await BulkReader.open(timeout_s=2.0)
        readers.append(plain)
        with pytest.raises(ValueError, match=r"requires CURVE: open the reader with curve=CurveKeys"):
            await plain.attach(desc)

        stranger = await BulkReader.open(curve=CurveKeys.generate(), timeout_s=2.0)
        readers.append(stranger)
        with pytest.raises(PeerLostError):  # the ZAP handler denies its key: no answer ever comes
            await stranger.attach(desc)
        assert (await good.read("shard0", rows, fields=["step"]))["step"].tolist() == rows.tolist()
    finally:
        for r in readers:
            await r.aclose()
        await owner.aclose()


@pytest.mark.asyncio
async def test_a_read_server_reachable_from_other_hosts_needs_curve():
    with pytest.raises(ValueError, match=r"^BulkOwner.open: the read server would listen on 'tcp://0.0.0.0:\*', "
                                         r"reachable from other hosts, without encryption; pass curve="):
        await BulkOwner.open(_run_id(), backends=["zmq"], zmq_bind="tcp://0.0.0.0:*")
    keys = CurveKeys.generate()
    owner = await _owner(keys, bind="tcp://0.0.0.0:*")
    try:
        desc = owner.descriptor("shard0")
        port = desc["zmq"]["address"].rsplit(":", 1)[1]
        desc["zmq"]["address"] = f"tcp://127.0.0.1:{port}"  # reach the wildcard bind through loopback
        reader = await BulkReader.open(curve=keys, timeout_s=30.0)
        try:
            await reader.attach(desc)
            assert (await reader.read("shard0", np.array([7]), fields=["step"]))["step"].tolist() == [7]
        finally:
            await reader.aclose()
    finally:
        await owner.aclose()


@pytest.mark.parametrize(("bind", "local"), [
    ("ipc:///tmp/x.sock", True), ("inproc://x", True), ("tcp://127.0.0.1:*", True), ("tcp://127.3.4.5:9", True),
    ("tcp://localhost:*", True), ("tcp://[::1]:5555", True), ("tcp://*:5555", False), ("tcp://0.0.0.0:*", False),
    ("tcp://10.1.2.3:*", False), ("tcp://eth0:*", False), ("tcp://127.evil.example:1", False),
    ("ws://127.0.0.1:1", False), ("tipc://{15560,0,0}", False),
])
def test_only_loopback_ipc_and_inproc_binds_count_as_local(bind, local):
    from reactor.transport._bulkowner import _local_only

    assert _local_only(bind) is local
