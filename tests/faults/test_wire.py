"""Hostile peers on real endpoints: protocol messages that decode but are wrong, senders that say
hello and leave, identities taken over, peers that vanish mid-handshake.

Each test is a regression for the hardening issue: before the fix, a decodable but invalid message
reached the worker's or coordinator's handling and killed the process; hello-and-go peers grew the
sender table without bound; a connection under a live peer's name took its identity over.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import pytest_asyncio
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reactor.launch._protocol import (
    COORDINATOR_KINDS,
    PEER_KINDS,
    WORKER_KINDS,
    CoordinatorProtocol,
    WorkerProtocol,
    check_message,
    check_request,
)
from reactor.transport import Endpoint
from reactor.transport._zmqreceive import hello_message
from reactor.transport.codec import encode

WAIT_S = 5.0
ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------------------ fuzzed messages

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(allow_nan=True),
    st.text(max_size=12), st.binary(max_size=12),
)
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                       max_leaves=12)
ALL_KINDS = sorted({*PEER_KINDS, *COORDINATOR_KINDS, *WORKER_KINDS})


@st.composite
def protocol_messages(draw):
    """Any kind of the launch protocol (or a stranger one) with fuzzed fields and field counts."""
    kind = draw(st.one_of(st.sampled_from(ALL_KINDS), _scalars))
    n = draw(st.integers(0, 7))
    fields = draw(st.lists(_values, min_size=n, max_size=n))
    shape = draw(st.sampled_from(["list", "tuple", "bare"]))
    if shape == "bare":
        return draw(_values)
    msg = [kind, *fields]
    return tuple(msg) if shape == "tuple" else msg


def _conforms(kinds, msg) -> bool:
    """An independent reading of the schemas: kind known, field count right, ints in range."""
    if type(msg) not in (list, tuple) or not msg or type(msg[0]) is not str or msg[0] not in kinds:
        return False
    return len(msg) == 1 + len(kinds[msg[0]])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=protocol_messages(), sender=st.sampled_from(["coordinator", "actor-0", "learner", "intruder"]))
def test_the_schemas_never_raise_and_refuse_every_message_that_does_not_fit_its_kind(msg, sender):
    worker = WorkerProtocol({0: ("actor-0", int), 1: ("learner", object)})
    coordinator = CoordinatorProtocol(["actor-0", "learner"])
    for check, kinds in ((worker, COORDINATOR_KINDS if sender == "coordinator" else PEER_KINDS),
                         (coordinator, WORKER_KINDS)):
        why = check(sender, msg)  # never raises
        assert why is None or isinstance(why, str)
        if why is None:
            assert _conforms(kinds, msg), msg
            assert check_message(kinds, msg) is None
    if sender == "intruder":
        assert worker(sender, msg) is not None and coordinator(sender, msg) is not None


def test_each_kind_accepts_its_well_formed_message_and_names_what_is_wrong_otherwise():
    w = WorkerProtocol({3: ("actor-0", int), 4: ("actor-1", float)})
    assert w("actor-0", ("m", 3, 0, 10, 0, 7)) is None
    assert w("actor-1", ("m", 4, 0, 10, 0, 7)) is None  # an int is a float
    assert w("actor-0", ("p", 5, 0, -1, 0, 2)) is None
    assert w("coordinator", ("peers", {"learner": "ipc:///x/learner"})) is None
    assert w("coordinator", ("probe", 3)) is None
    assert w("actor-0", ("m", 4, 0, 10, 0, 7.0)) == "link 4 belongs to 'actor-1', not to the sender"
    assert w("actor-0", ("m", 9, 0, 10, 0, 7)) == "link 9 does not lead into this process"
    assert w("actor-0", ("m", 3, 0, 10, 0, "x")) == "link 3: the port takes int, got str 'x'"
    assert w("actor-0", ("m", -1, 0, 10, 0, 7)) == "'m' field 1: an int in [0, 2**63) expected, got int -1"
    assert w("actor-0", ("m", 3, 0)) == "'m' has 5 fields, got 2"
    assert w("actor-0", 5) == "a message is a non-empty array [kind, ...], got int 5"
    assert w("actor-0", [None] * 6).startswith("unknown message kind NoneType None")
    assert w("learner", ("m", 3, 0, 10, 0, 7)) == "'learner' sends on no link into this process"
    assert w("actor-0", ("stop",)).startswith("unknown message kind str 'stop'")  # control only from the coordinator
    c = CoordinatorProtocol(["actor-0"])
    assert c("actor-0", ("status", -1, True, 0, 0)) is None
    assert c("actor-0", ("hello", "ftp://x", None)) == "'hello' field 1: a tcp:// or ipc:// address expected, got str 'ftp://x'"
    assert c("actor-0", ("hello", "tcp://10.0.0.1:5", "ipc:///tmp/r/w0")) is None
    assert c("actor-0", ("hello", "tcp://10.0.0.1:5", "tcp://10.0.0.1:6")) == (
        "'hello' field 2: None or an ipc:// address expected, got str 'tcp://10.0.0.1:6'")
    assert c("actor-0", ("done", {})).startswith("'done' field 1: a dict with exactly the fields")
    assert c("mallory", ("stop_request",)) == "'mallory' is not a worker of this run"


def test_an_address_is_refused_where_connect_would_refuse_it():
    """A hello's address that passed the schema and then made ``connect`` raise ended the run (at its
    start) instead of being dropped: the schema now refuses what zmq would."""
    c = CoordinatorProtocol(["actor-0"])
    for good in ("tcp://127.0.0.1:5555", "tcp://[::1]:5555", "tcp://[fe80::fc:ff:fe00:1%eth0]:37269",
                 "tcp://h1.example.org:65535", "ipc:///run/r/w.sock"):
        assert c("actor-0", ("hello", good, None)) is None, good
    for bad in ("tcp://", "tcp://nohost", "tcp://1.2.3.4:99999", "tcp://1.2.3.4:0", "tcp://*:5", "tcp://h:5\x00",
                "tcp://h:5\n", "ipc://", "ipc://" + "x" * 200):
        why = c("actor-0", ("hello", bad, None))
        assert why is not None and why.startswith("'hello' field 1: a"), (bad, why)
    assert c("actor-0", ("hello", "tcp://h:5", "ipc://" + "x" * 200)).startswith("'hello' field 2: None or an ipc://")


def test_a_value_nested_a_thousand_deep_or_millions_long_is_named_briefly_not_fatally():
    """The checks name what they refuse; naming a list nested 1,000 deep (a 1 KB msgpack body) raised
    RecursionError in the daemon, which ended it."""
    deep = msgpack.unpackb(b"\x91" * 1000 + b"\xc0")
    assert check_request(deep) == "a request is [id, kind, ...] with an int id, got list [[[[...]]]]"
    assert check_request([7, "status", deep]) == (
        "'status' field 1: a job id (16 hex digits) expected, got list [[[[...]]]]")
    assert check_request([7, "status", list(range(10**6))]) == (
        "'status' field 1: a job id (16 hex digits) expected, got list of 1000000 items")
    assert check_request([7, "status", [1, [2, 3]]]) == (
        "'status' field 1: a job id (16 hex digits) expected, got list [1, [2, 3]]")


@pytest.mark.parametrize(("req", "why"), [
    (["workers", ".."], "'workers' field 1: a run id ([A-Za-z0-9_.-], 1..64, not starting with '.') expected"),
    (["run_files", "."], "'run_files' field 1: a run id"),
    (["run_file", "..", "daemon.json", 0], "'run_file' field 1: a run id"),
    (["end", "r1\n"], "'end' field 1: a run id"),
    (["status", "0123456789abcdef\n"], "'status' field 1: a job id"),
    (["worker_log", "r1", "g\n", 0], "'worker_log' field 2: a group name"),
])
def test_names_that_would_leave_the_runs_directory_or_end_in_a_newline_are_refused(req, why):
    """A run id of ".." made STATE/runs/.. (the daemon's state directory) a run's directory: its spawn
    wrote there and run_file read other jobs' files; a trailing newline passed every name's "$"."""
    got = check_request([1, *req])
    assert got is not None and got.startswith(why), got


def test_a_job_spec_names_its_placement_its_config_keys_and_its_files_plainly():
    from reactor.launch._daemon import job_spec

    good = job_spec(ROOT / "tests" / "apps" / "gated.py")
    assert check_request([1, "submit", good]) is None
    files = {"gated.py": good["files"]["gated.py"], "d": b"", "d/e.py": b""}
    sums = {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}
    for spec, why in [
        ({**good, "placement": "/etc/hostname"}, "placement: a policy name or the name of one of the files"),
        ({**good, "placement": "../p.toml"}, "placement: a policy name"),
        ({**good, "config": {"lr\x00": 1}}, "config: str 'lr\\x00' is not a field name"),
        ({**good, "config": {"a=b": 1}}, "config: str 'a=b' is not a field name"),
        ({**good, "files": files, "sha256": sums}, "files: 'd' is both a file and a directory"),
        ({**good, "config": {"target_return": float("inf")}}, "config['target_return'] is not a finite number"),
        ({**good, "config": {"a": {"b": (1.0, float("nan"))}}}, "config['a']['b'][1] is not a finite number"),
    ]:
        got = check_request([1, "submit", spec])
        assert got is not None and got.startswith(f"'submit' field 1: {why}"), got
    assert check_request([1, "submit", {**good, "placement": "dp-learners", "config": {"algo_config.lr": 1}}]) is None


# ------------------------------------------------------------------------------ on real endpoints


async def _readable(sock: zmq.Socket) -> None:
    """Wait (without blocking the loop the endpoints run on) until a raw socket has a message."""
    async with asyncio.timeout(WAIT_S):
        while not sock.poll(0):
            await asyncio.sleep(0.002)


@pytest_asyncio.fixture
async def endpoints():
    opened = []

    async def open_(name, **kw):
        ep = await Endpoint.open(name, "tcp://127.0.0.1:*", **kw)
        opened.append(ep)
        return ep

    yield open_
    for ep in opened:
        await ep.aclose()


@pytest.mark.asyncio
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.lists(protocol_messages(), min_size=1, max_size=40))
async def test_a_live_endpoint_drops_what_its_protocol_refuses_and_keeps_serving(bad):
    """Fuzzed messages from a legitimate peer name (one batch per tick, and one by one) interleaved
    with good ones: only the good ones arrive, in order; credit is returned for the dropped ones,
    so a sender can go on past its window; the refusals are counted."""
    proto = WorkerProtocol({0: ("actor-0", int)})
    rx = await Endpoint.open("rx", "tcp://127.0.0.1:*", accept=proto, credit_window=8)
    tx = await Endpoint.open("actor-0", "tcp://127.0.0.1:*")
    try:
        await tx.connect("rx", rx.address)
        good = [("m", 0, i, i, 0, i) for i in range(3)]
        expected_bad = sum(proto("actor-0", m) is not None for m in bad)

        async def send_all():  # beside the receiver: past the window, sends wait for its credit
            for i, m in enumerate(bad):
                await tx.send("rx", m)
                if i % 7 == 0:
                    await tx.send("rx", good[0])
            for m in good[1:]:
                await tx.send("rx", m)

        got = []
        want = sum(proto("actor-0", m) is None for m in bad) + len(bad[::7]) + 2
        async with asyncio.timeout(WAIT_S):
            sending = asyncio.ensure_future(send_all())
            while len(got) < want:
                got += await rx.recv_batch()
            await sending
        assert [m for _, m in got][-2:] == [good[1], good[2]]
        assert all(proto("actor-0", m) is None for _, m in got)
        assert rx.statistics().dropped_invalid == expected_bad
    finally:
        await tx.aclose()
        await rx.aclose()


@pytest.mark.asyncio
async def test_senders_that_say_hello_and_leave_are_forgotten(endpoints):
    """300 connections each say hello under a new name and close: the sender table stays within
    twice the live connections (it grew by one entry per name, forever, before)."""
    server = await endpoints("server")
    live = await endpoints("live")
    await live.connect("server", server.address)
    ctx = zmq.Context()
    try:
        for i in range(300):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.ROUTING_ID, f"ghost-{i}".encode())
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(server.address)
            s.send_multipart([b"", hello_message(f"ghost-{i}", os.urandom(8), 0)])
            await _readable(s)  # welcomed: the server has its entry
            s.recv_multipart()
            s.close()
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        last = []
        for i in range(3):  # a few more hellos: the sweep runs when the table has doubled
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(server.address)
            s.send_multipart([b"", hello_message(f"last-{i}", os.urandom(8), 0)])
            last.append(s)
            await asyncio.sleep(0.05)
        st_ = server.statistics()
        assert st_.senders <= 2 * 4 + 64, st_
        assert st_.senders_forgotten >= 300 - 64
        for s in last:
            s.close(linger=0)
        await live.send("server", "still here")  # the live sender was kept
        assert await server.recv_batch(timeout_s=WAIT_S) == [("live", "still here")]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_second_connection_under_a_live_peers_name_cannot_take_it_over(endpoints, caplog):
    """Connections under a live peer's name (one with zmq's routing id set to the name, as the name was
    the routing id before, and 40 more, some with the victim's own token and a later number) get no
    welcome; their messages are dropped as a stranger's; the refusals are counted, logged under the
    flood rule, and the victim's link and credit are untouched. (A hello with the victim's token and a
    later number could be its newer connection: it waits, at most 2 s, for the victim's to close, and
    is refused, or dropped as an earlier try of the one that waits.)"""
    server = await endpoints("server")
    victim = await endpoints("victim")
    await victim.connect("server", server.address)
    caplog.set_level(logging.WARNING, logger="reactor.transport")
    ctx = zmq.Context()
    try:
        thief = ctx.socket(zmq.DEALER)
        thief.setsockopt(zmq.ROUTING_ID, b"victim")
        thief.connect(server.address)
        thief.send_multipart([b"", hello_message("victim", os.urandom(8), 0)])
        thief.send_multipart(encode("forged"))
        thieves = [thief]
        for i in range(40):
            t = ctx.socket(zmq.DEALER)
            t.connect(server.address)
            token = victim._token if i % 2 else os.urandom(8)
            t.send_multipart([b"", hello_message("victim", token, 100 + i)])
            t.send_multipart(encode(("forged", i)))
            thieves.append(t)
        deadline = time.monotonic() + WAIT_S
        while (server.statistics().dropped_unknown_peer < 41 or server._held) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        assert not any(t.poll(0) for t in thieves)  # no welcome for a thief
        assert not server._held
        assert 21 <= server.statistics().hellos_refused <= 41  # (all 21 with a token of their own)
        assert server.statistics().dropped_unknown_peer == 41
        assert 1 <= sum("refused a hello from 'victim'" in r.getMessage() for r in caplog.records) <= 20
        async def send_all():  # past the window: the victim's credit and link are intact
            for i in range(100):
                await victim.send("server", i)

        got = []
        async with asyncio.timeout(WAIT_S):
            sending = asyncio.ensure_future(send_all())
            while len(got) < 100:
                got += await server.recv_batch()
            await sending
        assert got == [("victim", i) for i in range(100)]
        assert victim.lost_peers == frozenset()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_flood_of_earlier_hellos_under_a_live_name_is_logged_under_the_flood_rule(endpoints, caplog):
    """Regression: each hello dropped as an earlier connection's (the holder's token, a lower number) was
    logged: 60 connections made 60 lines."""
    server = await endpoints("server")
    caplog.set_level(logging.INFO, logger="reactor.transport")
    ctx = zmq.Context()
    try:
        token = os.urandom(8)
        holder = ctx.socket(zmq.DEALER)
        holder.setsockopt(zmq.LINGER, 0)
        holder.connect(server.address)
        holder.send_multipart([b"", hello_message("victim", token, 1000)])
        await _readable(holder)  # welcomed
        late = []
        for i in range(60):
            t = ctx.socket(zmq.DEALER)
            t.setsockopt(zmq.LINGER, 0)
            t.connect(server.address)
            t.send_multipart([b"", hello_message("victim", token, i)])
            t.send_multipart(encode(("late", i)))
            late.append(t)
        deadline = time.monotonic() + WAIT_S
        while server.statistics().dropped_unknown_peer < 60 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert server.statistics().dropped_unknown_peer == 60
        assert server.statistics().hellos_refused == 0
        assert 1 <= sum("dropped an earlier connection's hello" in r.getMessage() for r in caplog.records) <= 20
        for t in [holder, *late]:
            t.close()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_connection_that_says_hello_again_while_its_first_waits_keeps_the_name_it_was_welcomed_under(
        endpoints):
    """Regression: a hello that waited (behind the same token's older connection) was welcomed once that
    one closed even if its connection had said hello under another name meanwhile and been welcomed: the
    connection's messages then came under the first name, and the second stayed taken by no sender."""
    server = await endpoints("server")
    ctx = zmq.Context()
    try:
        token = os.urandom(8)
        older, sly = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (older, sly):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(server.address)
        older.send_multipart([b"", hello_message("x", token, 0)])
        await _readable(older)
        sly.send_multipart([b"", hello_message("x", token, 1)])  # waits: the older connection is open
        await asyncio.sleep(0.1)
        sly.send_multipart([b"", hello_message("y", os.urandom(8), 0)])
        await _readable(sly)  # welcomed as y
        older.close()
        await asyncio.sleep(0.3)  # the wait for x is over
        sly.send_multipart(encode("who"))
        assert await server.recv_batch(timeout_s=WAIT_S) == [("y", "who")]
        assert not server._held and "x" not in server._by_name
        assert server._by_name["y"] is server._routers[0].senders[server._by_name["y"].ident]
        sly.close()
    finally:
        ctx.destroy(linger=0)


@pytest.mark.asyncio
async def test_a_peer_killed_while_connected_is_reported_as_gone_not_as_a_security_failure(endpoints, tmp_path):
    """Regression: a killed peer was reported as a CURVE handshake failure on a link without CURVE."""
    bind = f"ipc://{tmp_path}/peer.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.transport._peer", "idle", json.dumps({"name": "peer", "bind": bind})],
        cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        address = json.loads(proc.stdout.readline())["address"]
        ep = await endpoints("watcher")
        await ep.connect("peer", address)
        os.kill(proc.pid, signal.SIGKILL)
        assert await ep.wait_peer_lost(timeout_s=WAIT_S) == "peer"
        with pytest.raises(Exception) as info:
            ep.send_nowait("peer", 1)
        text = str(info.value)
        assert "CURVE" not in text and "security" not in text, text
        assert "closed" in text or "vanished" in text, text
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


# ------------------------------------------------------------------------------ promises, in the worker


def _gate_worker():
    """A real Worker for the gate of tests/apps/gated.py (one process per reactor), with its host."""
    from reactor._scheduler import ReactorHost
    from reactor._tag import Tag
    from reactor.launch._app import build_graph
    from reactor.launch._worker import Worker

    graph = build_graph(str(ROOT / "tests" / "apps" / "gated.py"), {})
    owner_of = {"source[0]": "source-0", "source[1]": "source-1", "gate": "gate", "sink": "sink"}
    w = Worker({"group": "gate"})
    w.host = ReactorHost(graph, ["gate"], owner_of, deterministic=True, stop_ns=10**8, process="gate",
                         remote=object())
    for p in ("source-0", "source-1"):
        w.host.horizons[p] = Tag(0, 0)
    link = next(lk.index for lk in graph.links() if lk.src == "source[1]")
    return w, link


def test_a_promise_below_a_peers_earlier_unconditional_promise_is_refused():
    """Regression: a forged promise taken after a finished peer's NEVER, in the same batch, replaced
    it before the horizons were raised, and the process waited for that peer forever (a live run
    under attack hung)."""
    from reactor._tag import FOREVER_NS, NEVER

    w, link = _gate_worker()
    w._take([("source-1", ("p", FOREVER_NS, 0, -1, 0, 0)), ("source-1", ("p", 5, 0, -1, 0, 0)),
             ("source-1", ("p", 7, 0, 3, 0, 0)), ("source-1", ("m", link, 0, 10, 0, 1))])
    w.host.refresh([])
    assert w.host.horizons["source-1"] == NEVER
    assert w.refused_behind_promise == 3  # two promises below NEVER, and a message behind it
    assert w.host.received_count == 0
    w._take([("source-0", ("p", 50, 0, -1, 0, 0)), ("source-0", ("m", link - 1, 0, 60, 0, 1)),
             ("source-0", ("m", link - 1, 1, 40, 0, 1))])  # the second is behind the promise of 50
    assert w.host.received_count == 1 and w.refused_behind_promise == 4


def test_a_submitted_hosts_file_takes_the_key_files_it_names_beside_it(tmp_path):
    """A hosts file's ``key = "h2.pub"`` (read beside the file) was not shipped with the job: it failed
    on the daemon, "cannot read its key .../jobs/JOB/app/h2.pub" (a newcomer's pass, session 54). The
    key files named by relative paths go along at the same paths; an absolute path and a Z85 key stay."""
    from reactor.launch._daemon import job_spec
    from reactor.transport import CurveKeys

    (tmp_path / "k").mkdir()
    h2, h3 = CurveKeys.generate(), CurveKeys.generate()
    (tmp_path / "k" / "h2.pub").write_bytes(h2.public + b"\n")
    (tmp_path / "h3.pub").write_bytes(h3.public + b"\n")
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[hosts]\nh1 = "tcp://10.0.0.1:7000"\n'
                     'h2 = { address = "tcp://10.0.0.2:7000", key = "k/h2.pub" }\n'
                     f'h3 = {{ address = "tcp://10.0.0.3:7000", key = "{tmp_path / "h3.pub"}" }}\n'
                     f'h4 = {{ address = "tcp://10.0.0.4:7000", key = "{h3.public.decode()}" }}\n')
    spec = job_spec(ROOT / "tests" / "apps" / "gated.py", placement="processes", hosts=hosts)
    assert set(spec["files"]) == {"gated.py", "hosts.toml", "k/h2.pub"}
    assert spec["files"]["k/h2.pub"] == h2.public + b"\n"
    assert check_request([1, "submit", spec]) is None
