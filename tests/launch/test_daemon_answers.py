"""A run's coordinator against a daemon of another host that answers with what is not an answer (a
broken or hostile peer: a probe, session 75): a real pyzmq ROUTER with CURVE, as a daemon listens,
answering the coordinator's own requests (spawn, the heartbeat's workers, a run's files) wrongly."""

from __future__ import annotations

import asyncio
import logging
import re

import pytest

from reactor._errors import DaemonError
from reactor.launch._cluster import DaemonLink, Host, RemoteWorkers

from .test_daemon_replies import StandIn, ok


@pytest.fixture
def stand_in(tmp_path):
    """A stand-in daemon (test_daemon_replies.py's): a pyzmq ROUTER with CURVE that answers as told."""
    d = StandIn(tmp_path)
    yield d
    d.stop.set()
    d.thread.join(10)


@pytest.mark.parametrize(("kind", "answer", "said"), [
    ("spawn", {"pid": "12"}, "it is dict"),
    ("spawn", [1, 2], "it is list"),
    ("spawn", {"pid": 2**40}, "not {pid: int, dir: str}"),
    ("workers", {"g": {"pid": 5, "returncode": "x"}}, "group 'g': returncode str 'x' is not an exit status"),
    ("workers", {"g": 7}, "is not {pid: int, returncode: int or None}"),
    ("worker_log", {"data": "text", "offset": 0}, "not a chunk {data: bytes, offset: int}"),
    ("run_file", {"data": b"x" * ((1 << 20) + 1), "offset": 0}, "a chunk of 1048577 bytes (at most 1048576)"),
    ("run_files", {"files": [{"path": 5, "size": 1}], "more": False, "unfetchable": 0, "unfetchable_shown": []},
     "is not {path: str, size: int >= 0}"),
])
def test_a_daemons_answer_of_the_wrong_shape_is_a_daemon_error_naming_it(stand_in, kind, answer, said):
    """The coordinator read ``got["pid"]``, ``w["returncode"]``, ``got["data"]`` of whatever came: a
    KeyError or TypeError in the coordinator (a spawn's ended the run with a traceback; the heartbeat's
    ended its task). Each kind's answer is checked where it comes in, and a wrong one is a DaemonError
    naming the host, the kind and what came, which the callers handle (the heartbeat loses the host)."""
    stand_in.reply = lambda rid, k, fields: ok(rid, answer)
    link = DaemonLink(Host("h9", stand_in.address, stand_in.keys.public), stand_in.keys)
    try:
        with pytest.raises(DaemonError, match=f"host 'h9' answered '{kind}' with what is not an answer: .*"
                                              f"{re.escape(said)}"):
            asyncio.run(link.request(kind, "r", timeout_s=10))
    finally:
        link.close()


def test_a_daemon_that_repeats_a_run_files_chunk_does_not_fill_the_disk(stand_in, tmp_path, caplog):
    """Copying a run's files back, the coordinator wrote each chunk and asked from the offset the daemon
    gave: one that answered the same chunk at offset 0 every time had it write for ever (the disk filled).
    A chunk whose next offset is not where it ends is refused: that file is not copied, said; the
    others are."""
    chunk = b"x" * 4096

    asked: list[str] = []

    def answer(rid, kind, fields):
        asked.append(kind)
        if kind == "run_files":
            return ok(rid, {"files": [{"path": "loop.bin", "size": 1 << 30}, {"path": "ok.txt", "size": 3}],
                            "more": False, "unfetchable": 0, "unfetchable_shown": []})
        if kind == "run_file" and fields[1] == "ok.txt":
            return ok(rid, {"data": b"abc", "offset": 3})
        return ok(rid, {"data": chunk, "offset": 0})  # (always the first chunk, "from 0")

    stand_in.reply = answer
    workers = RemoteWorkers("r", {"h9": Host("h9", stand_in.address, stand_in.keys.public)}, stand_in.keys)
    workers.host_of["g"] = "h9"
    dest = tmp_path / "out"
    dest.mkdir()
    try:
        with caplog.at_level(logging.WARNING, logger="reactor"):
            asyncio.run(asyncio.wait_for(workers.fetch_run_files(dest), 60))
    finally:
        asyncio.run(workers.close())
    assert (dest / "ok.txt").read_bytes() == b"abc"
    assert not (dest / "loop.bin").exists() and not list(dest.glob(".*.part"))
    assert asked.count("run_file") == 2  # (loop.bin's first chunk, refused; ok.txt's)
    assert any("did not copy loop.bin from host h9: host 'h9' answered run_file: the chunk of 4,096 bytes from offset "
               "0 ends at offset 0, not 4,096" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


_MANY_HOSTS = """
import asyncio, resource, sys, threading
import msgpack, zmq
from reactor.launch._cluster import Host, RemoteWorkers
from reactor.launch._keys import init_keys

keys = init_keys(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))  # (a machine's small soft limit)
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, keys.secret, keys.public
address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
stop = threading.Event()

def serve():
    while not stop.is_set():
        if sock.poll(50):
            frames = sock.recv_multipart()
            rid, kind, *_ = msgpack.unpackb(frames[-1], raw=False)
            sock.send_multipart([frames[0], b"", msgpack.packb([rid, True, {"name": "h"}])])

server = threading.Thread(target=serve, daemon=True)
server.start()
hosts = {f"h{i}": Host(f"h{i}", address, keys.public) for i in range(int(sys.argv[2]))}

async def main():
    workers = RemoteWorkers("r", hosts, keys)
    try:
        used = list(hosts)[:int(sys.argv[3])]
        answers = await asyncio.gather(*(workers.links[h].request("ping", timeout_s=60) for h in used))
        print(len(answers), len(workers.links), resource.getrlimit(resource.RLIMIT_NOFILE)[0] == min(hard, 1 << 20))
    finally:
        await workers.close()

asyncio.run(main())
stop.set()
server.join(5)
sock.close(0)
ctx.term()
"""


@pytest.mark.parametrize(("hosts", "used", "printed"), [(5000, 1, "1 1"), (300, 300, "300 300")])
def test_a_run_over_a_large_hosts_file_links_to_the_hosts_it_uses_within_the_descriptors_it_has(tmp_path, hosts, used,
                                                                                                printed):
    """A hosts file of 150 hosts (``reactor slurm`` on 150 nodes: every node's daemon), groups on one,
    under the common soft limit of 1,024 descriptors: a zmq context, socket and monitor for every host at
    the run's start, ``Too many open files`` in a traceback. Links are made as a host is first asked,
    share one context, and a run over many hosts raises its soft limit to its hard one."""
    import resource
    import subprocess
    import sys

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 2048:
        pytest.skip("this machine's hard limit of open files is below 2,048: 300 links do not fit")
    out = subprocess.run([sys.executable, "-c", _MANY_HOSTS, str(tmp_path / "keys"), str(hosts), str(used)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.split() == [*printed.split(), "True"], out.stderr[-3000:]
    assert out.stderr == "", out.stderr[-3000:]
