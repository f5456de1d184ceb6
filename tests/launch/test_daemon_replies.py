"""The command line against a daemon that answers with garbage: a stand-in daemon on loopback (a pyzmq
ROUTER with real CURVE) sends what no reactor daemon sends, and the real `reactor` command, in a
subprocess, must end in one line naming what was wrong with the answer, exit 1, within its timeout:
never a traceback, a loop, or memory and output without bound. (Session 75; a hostile probe found each.)"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from reactor.launch._daemon import DaemonClient, DaemonError, DaemonSilentError
from reactor.launch._daemonclient import DROPPED_WHY, MAX_ANSWER_NBYTES
from reactor.launch._hosting import LOG_CHUNK_NBYTES
from reactor.launch._keys import init_keys, load_keys

ROOT = Path(__file__).resolve().parents[2]
JOB_ID = "0123456789abcdef"
#: A job as ``Daemon.describe`` answers it, on one host.
JOB = {"id": JOB_ID, "app": "a.py", "placement": "single", "state": "finished", "pid": 12, "uptime_s": 1.0,
       "returncode": 0, "detail": "", "last_line": "ok", "daemon": "h1"}
TAIL = " (a daemon of another reactor version?)\n"

#: What the stand-in answers a request with: a message's frames after the client's identity, a list of
#: such messages, or None for none.
Reply = Callable[[int, str, list[Any]], Any]


def ok(rid: int, payload: Any) -> list[bytes]:
    return [b"", msgpack.packb([rid, True, payload], use_bin_type=True)]


def refused(rid: int, text: Any) -> list[bytes]:
    return [b"", msgpack.packb([rid, False, text], use_bin_type=True)]


class StandIn:
    """A stand-in daemon speaking the daemon's wire (CURVE, ``[id, ok, payload]``) from a thread: each
    request is answered with what ``reply`` gives (set by the test); ``cli`` runs `reactor` against it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.keys = init_keys(tmp / "dk")  # (as `reactor keys init` makes them)
        init_keys(tmp / "ck")
        self.reply: Reply = lambda rid, kind, fields: None
        self.stop, self.bound = threading.Event(), threading.Event()
        self.address = ""
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.bound.wait(10), "the stand-in daemon did not bind"

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = self.keys.secret, self.keys.public
        sock.bind("tcp://127.0.0.1:*")
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.bound.set()
        try:
            while not self.stop.is_set():
                if not sock.poll(50):
                    continue
                ident, _, body = sock.recv_multipart()
                rid, kind, *fields = msgpack.unpackb(body, raw=False)
                sent = self.reply(rid, kind, fields) or []
                for frames in sent if sent and type(sent[0]) is list else [sent]:
                    sock.send_multipart([ident, *frames])
        finally:
            sock.close(linger=0)
            ctx.term()

    def cli(self, *args: str, timeout_s: float = 3.0) -> subprocess.CompletedProcess[str]:
        """`reactor ARGS --daemon ... --timeout-s timeout_s`, in a subprocess (60 s at most: a command
        that loops for ever fails the test, not the session)."""
        return subprocess.run(
            [sys.executable, "-m", "reactor.cli", *args, "--daemon", self.address, "--daemon-key",
             str(self.tmp / "dk" / "key.pub"), "--keys", str(self.tmp / "ck"), "--timeout-s", str(timeout_s)],
            capture_output=True, text=True, timeout=60, cwd=ROOT)

    def client(self, timeout_s: float = 3.0) -> DaemonClient:
        return DaemonClient(self.address, self.keys.public, load_keys(self.tmp / "ck"), timeout_s=timeout_s)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[StandIn]:
    d = StandIn(tmp_path)
    yield d
    d.stop.set()
    d.thread.join(10)


def answering(status: Any, hosted: Any = ()) -> Reply:
    """Answers ``status`` (of all jobs or of one) with ``status``, ``hosted`` with ``hosted``."""
    return lambda rid, kind, fields: ok(rid, status if kind == "status" else list(hosted))


def malformed(d: StandIn, kind: str, why: str) -> str:
    return f"reactor: the daemon at {d.address} sent a malformed answer to {kind!r}: {why}{TAIL}"


def one_line_error(p: subprocess.CompletedProcess[str]) -> str:
    """``p``'s stderr, asserted to be one line of `reactor`'s own and nothing on stdout, exit 1."""
    assert (p.returncode, p.stdout, p.stderr.count("\n")) == (1, "", 1), (p.returncode, p.stdout[:500],
                                                                       p.stderr[-3000:])
    assert p.stderr.startswith("reactor: "), p.stderr[-3000:]
    return p.stderr


@pytest.mark.parametrize("extra", [b"\x00\xff", msgpack.ExtType(5, b"x"), math.nan], ids=["bytes", "ext", "nan"])
@pytest.mark.parametrize("one", [False, True], ids=["all", "one"])
def test_status_json_prints_the_fields_it_knows_as_strict_json_whatever_else_a_job_holds(daemon, extra, one):
    """Regression (session 75, D2): ``status --json`` dumped a daemon's answer as it came, every field
    it did not know with it: bytes or a msgpack ext type ended the command in ``TypeError: Object of
    type bytes is not JSON serializable``, a NaN printed ``NaN`` (no JSON), exit 0. It prints the
    fields it knows (checked) alone, and only JSON."""
    job = {**JOB, "extra": extra, "groups": {"g": {"host": "h2", "address": "tcp://127.0.0.1:5555", "key": None,
                                                   "extra": extra}}, "run": "r1"}
    daemon.reply = answering(job if one else [job])
    p = daemon.cli("status", *([JOB_ID] if one else []), "--json")
    assert (p.returncode, p.stderr) == (0, ""), p.stderr[-3000:]
    got = json.loads(p.stdout, parse_constant=lambda c: pytest.fail(f"{c} is no JSON"))
    printed = got if one else got["jobs"][0]
    assert printed == {**JOB, "run": "r1", "groups": {"g": {"host": "h2", "address": "tcp://127.0.0.1:5555",
                                                            "key": None}}}


@pytest.mark.parametrize("command", [("status", JOB_ID), ("logs", JOB_ID, "g")], ids=["status", "logs"])
def test_a_job_with_groups_and_no_run_is_a_malformed_answer(daemon, command):
    """Regression (session 75, D3): a job with groups but no ``run`` passed the check of its answer,
    then ``reactor status JOB`` and ``reactor logs JOB GROUP`` ended in ``KeyError: 'run'``. Groups
    need the run their logs are asked for by: without one the answer is malformed, in one line."""
    daemon.reply = answering({**JOB, "groups": {"g": {"host": "h2", "address": "tcp://127.0.0.1:5555",
                                                      "key": None}}})
    p = daemon.cli(*command)
    assert one_line_error(p) == malformed(daemon, "status", "the job has groups but no run (what their logs are "
                                                            "asked for by)")


@pytest.mark.parametrize("where, why", [
    ({"address": "bogus://x", "key": None},
     "the job's group 'g' has a bad address (a tcp://HOST:PORT address expected, got str 'bogus://x')"),
    ({"address": "tcp://127.0.0.1:5555", "key": "short"},
     "the job's group 'g' has a bad key (str 'short', not a CURVE public key: 40 characters of Z85)"),
], ids=["address", "key"])
def test_logs_of_a_group_whose_address_or_key_zeromq_refuses_is_a_malformed_answer(daemon, where, why):
    """Regression (session 75, D4): ``reactor logs JOB GROUP`` connected to the address and key a job's
    groups gave, unchecked: ``bogus://x`` or a key ``"short"`` ended it in a ``zmq.ZMQError``
    traceback. They are checked as the rest of the answer is."""
    daemon.reply = answering({**JOB, "run": "r1", "groups": {"g": {"host": "h2", **where}}})
    assert one_line_error(daemon.cli("logs", JOB_ID, "g")) == malformed(daemon, "status", why)


@pytest.mark.parametrize("address, key, why", [
    ("bogus://x", None, "its address 'bogus://x' is not one ZeroMQ connects to"),
    (None, b"short", "its key 'short' is not a CURVE public key (40 characters of Z85)"),
], ids=["address", "key"])
def test_a_client_given_an_address_or_key_zeromq_refuses_raises_daemon_error(daemon, address, key, why):
    """Regression (session 75, D4): ``DaemonClient`` let ZeroMQ's refusal of an address or key out as
    ``zmq.ZMQError``, which no caller takes for a daemon's trouble (a traceback). It is a DaemonError,
    naming which, and the client holds no socket or context after it."""
    address = address or daemon.address
    with pytest.raises(DaemonError, match=rf"^the daemon at {address} cannot be asked: {re.escape(why)} \([^()]+\)$"):
        DaemonClient(address, key or daemon.keys.public, load_keys(daemon.tmp / "ck"))


@pytest.mark.parametrize("offset, why", [
    (0, "the chunk of 5 bytes from offset 0 ends at offset 0, not 5"),
    (-5, "the chunk of 5 bytes from offset 0 ends at offset -5, not 5"),
], ids=["stays", "negative"])
def test_logs_refuses_a_chunk_whose_offset_does_not_follow_its_data(daemon, offset, why):
    """Regression (session 75, D5): ``reactor logs`` asked on from the offset each answer gave, as it
    came: one that did not move on (or went back) asked for the same chunk for ever, printing it each
    time. A chunk ends where its data does, or the answer is malformed. (The stand-in falls silent after
    50 answers: a command that loops ends, and its output is bounded.)"""
    daemon.reply = lambda rid, kind, fields: ok(rid, {"data": b"line\n", "offset": offset, "done": offset == 0}) \
        if rid <= 50 else None
    assert one_line_error(daemon.cli("logs", JOB_ID)) == malformed(daemon, "logs", why)


def test_logs_of_a_log_cut_shorter_goes_on_from_its_new_end(daemon):
    """The daemon reads a log from its end when asked past it (``read_chunk``): an empty chunk at an
    earlier offset is a log cut shorter (truncated, rotated), said and read on from there, not taken
    for a malformed answer (a review of D5's check)."""
    chunks = {0: (b"abcdef", 6, False), 6: (b"", 2, False), 2: (b"xy", 4, False), 4: (b"", 4, True)}
    daemon.reply = lambda rid, kind, fields: ok(rid, dict(zip(("data", "offset", "done"), chunks[fields[1]])))
    p = daemon.cli("logs", JOB_ID)
    assert p.returncode == 0 and p.stdout == "abcdefxy", (p.stdout, p.stderr)
    assert p.stderr == "reactor: the log was cut to 2 bytes; going on from there\n", p.stderr


def test_logs_refuses_a_chunk_larger_than_a_daemon_sends(daemon):
    """Regression (session 75, D5): a chunk of any size was printed; a daemon sends at most
    ``LOG_CHUNK_NBYTES`` (1 MiB) in one."""
    n = 2 * LOG_CHUNK_NBYTES
    daemon.reply = lambda rid, kind, fields: ok(rid, {"data": b"L" * n if fields[1] == 0 else b"",
                                                      "offset": n, "done": True})
    assert one_line_error(daemon.cli("logs", JOB_ID)) == malformed(
        daemon, "logs", f"the chunk holds {n:,} bytes, more than a daemon sends ({LOG_CHUNK_NBYTES:,})")


@pytest.mark.parametrize("answer, shown", [
    ({"not": "a job id"}, "dict {'not': 'a job id'}"),
    ("J" * 100_000, f"str '{'J' * 27}...{'J' * 28}'"),
    ("0123456789ABCDEF", "str '0123456789ABCDEF'"),
], ids=["dict", "long", "upper"])
def test_submit_refuses_an_answer_that_is_no_job_id(daemon, answer, shown):
    """Regression (session 75, D6): ``reactor submit`` printed whatever the daemon answered (a dict,
    100 MB of text) as the job's id, exit 0. The answer must be a job id, 16 hex digits."""
    app = daemon.tmp / "app.py"
    app.write_text("from reactor import Graph\n\n\ndef build(config):\n    return Graph()\n")
    daemon.reply = lambda rid, kind, fields: ok(rid, answer)
    p = daemon.cli("submit", str(app))
    assert one_line_error(p) == malformed(daemon, "submit", f"it is {shown}, not a job id (16 hex digits)")


def test_an_answer_past_the_largest_a_daemon_sends_ends_the_request_in_one_line(daemon):
    """Regression (session 75, D7): the client's socket took a frame of any size: 300 MB of junk took
    660 MB of memory before it was found to be junk. ZeroMQ refuses a frame past ``MAX_ANSWER_NBYTES``
    (``MAXMSGSIZE``) and ends the connection, which the request says at once, not after its timeout."""
    daemon.reply = lambda rid, kind, fields: [b"", b"\xc1" * (MAX_ANSWER_NBYTES + 1)]
    p = daemon.cli("status", timeout_s=20)
    assert one_line_error(p) == f"reactor: the daemon at {daemon.address} did not answer 'status': {DROPPED_WHY}\n"


def test_the_request_after_an_answer_past_the_bound_connects_again_and_is_answered(daemon):
    """ZeroMQ does not connect again after it ended a connection on a frame it refused: the client
    does, at its next request (every later one waited its timeout out)."""
    daemon.reply = lambda rid, kind, fields: (
        [b"", b"\xc1" * (MAX_ANSWER_NBYTES + 1)] if rid == 1 else ok(rid, {"pong": rid}))
    with daemon.client(timeout_s=20) as c:
        with pytest.raises(DaemonSilentError, match=r"ended the connection") as e:
            c.request("ping")
        assert e.value.reached == "handshake"
        assert c.request("ping") == {"pong": 2}


def test_an_answer_as_large_as_a_run_files_listing_can_be_is_taken(daemon):
    """The bound is past the largest answer a daemon sends: ``run_files`` lists up to 16 MiB of paths
    (``RUN_FILES_MAX_NBYTES``) of 100,000 files, ~19 MiB in all."""
    files = [{"path": f"{i:07d}".rjust(167, "p"), "size": 2**40 + i} for i in range(100_000)]
    listing = {"files": files, "more": False, "unfetchable": 0, "unfetchable_shown": []}
    daemon.reply = lambda rid, kind, fields: ok(rid, listing)
    with daemon.client(timeout_s=30) as c:
        assert c.request("run_files", "r1") == listing


@pytest.mark.parametrize("frames, times, flaw", [
    (lambda rid: [b"", b"\xc1\xc1\xc1garbage"], 1, "it is not msgpack (FormatError)"),
    (lambda rid: [b"", ok(rid, [JOB])[1][:-5]], 1, "it is not msgpack (ValueError: Unpack failed: incomplete input)"),
    (lambda rid: ok(rid + 1000, [JOB]), 1, "it has the request id int 1001, which this client never sent"),
    (lambda rid: [b"", b"x", b"y"], 1, "it came in 3 frames, not 2"),
    (lambda rid: [b"", msgpack.packb({"a": 1})], 3, "the first is dict {'a': 1}, not [request id, ok, payload]"),
], ids=["junk", "truncated", "wrong-id", "frames", "thrice"])
def test_replies_that_are_not_answers_are_counted_and_named_not_taken_for_a_late_answer(daemon, frames, times, flaw):
    """Regression (session 75, D8): a reply that was no answer (not msgpack, cut short, an id never
    sent) was dropped without a word, and the request ended after its timeout as "answered late: it is
    overloaded or stopped". They are counted, and the error names the first one's flaw."""
    daemon.reply = lambda rid, kind, fields: [frames(rid)] * times
    said = ("once with a reply that is not an answer: " if times == 1
            else f"{times} times with replies that are not answers: ")
    p = daemon.cli("status", timeout_s=2)
    assert one_line_error(p) == (f"reactor: the daemon at {daemon.address} did not answer 'status' within 2.0 s: it "
                                 f"answered {said}{flaw} (no reactor daemon of this version there?)\n")


def test_a_late_answer_is_dropped_without_a_word_and_a_second_answer_to_a_request_is_no_answer(daemon):
    """An answer that comes after its request ended (a daemon that was slow) is dropped by the next
    request, as it always was; a second answer to the same request (its id answered already) is a reply
    that is no answer, counted and named."""
    daemon.reply = lambda rid, kind, fields: {1: None, 2: [ok(1, "late"), ok(2, "now")], 3: [ok(1, "again")]}[rid]
    with daemon.client(timeout_s=1) as c:
        with pytest.raises(DaemonSilentError, match=r"answered late"):
            c.request("ping")
        assert c.request("ping") == "now"
        with pytest.raises(DaemonSilentError, match=r"answered once with a reply that is not an answer: it has the "
                                                    r"request id int 1, whose answer came already"):
            c.request("ping")


def test_a_refusals_control_characters_are_escaped_and_its_length_bounded(daemon):
    """Regression (session 75, D9): a refusal's text went to the terminal as it came: escape sequences
    set the window's title and cleared the screen (``ESC ]0;pwned BEL ESC [2J``), and 5 MB of text was
    printed whole. Its control characters are escaped, and it is cut to ~2,000 characters."""
    daemon.reply = lambda rid, kind, fields: refused(rid, "\x1b]0;pwned\x07\x1b[2J\x1b[31mRED\x9b")
    p = daemon.cli("status")
    assert one_line_error(p) == "reactor: \\x1b]0;pwned\\x07\\x1b[2J\\x1b[31mRED\\x9b\n"
    daemon.reply = lambda rid, kind, fields: refused(rid, "E" * 5_000_000)
    said = one_line_error(daemon.cli("status"))
    assert len(said) < 2_100 and "characters cut" in said, len(said)


def test_status_escapes_the_control_characters_of_what_a_daemon_says_of_a_job(daemon):
    """Regression (session 75, D9): the lines of ``reactor status`` held a job's fields as the daemon
    sent them: a last line of escape sequences and a carriage return rewrote the terminal. They are
    escaped (a newline too: a job is one line)."""
    daemon.reply = answering([{**JOB, "last_line": "\x1b]0;pwned\x07\x1b[2J\rfake\nline"}])
    p = daemon.cli("status")
    assert (p.returncode, p.stderr) == (0, ""), p.stderr[-3000:]
    assert p.stdout.endswith("| \\x1b]0;pwned\\x07\\x1b[2J\\x0dfake\\x0aline\n"), p.stdout
    assert p.stdout.startswith(f"{JOB_ID}  finished exit 0  a.py") and p.stdout.count("\n") == 1, p.stdout


@pytest.mark.parametrize("field, value, why", [
    ("pid", 2**64 - 1, "job 0's pid is 18446744073709551615, out of its range (1 to 2147483647)"),
    ("returncode", -(2**63), "job 0's returncode is -9223372036854775808, out of its range (-255 to 255)"),
    ("id", "\x1b[31m", "job 0's id is str '\\x1b[31m', not a job id (16 hex digits)"),
], ids=["pid", "returncode", "id"])
def test_status_refuses_a_job_whose_numbers_or_id_are_out_of_range(daemon, field, value, why):
    """Regression (session 75, D9): a pid of 2**64 - 1 or an exit status of -2**63 was printed as it
    came. They are in the ranges a daemon's own records hold, and a job's id is a job id."""
    daemon.reply = answering([{**JOB, field: value}])
    assert one_line_error(daemon.cli("status")) == malformed(daemon, "status", why)
