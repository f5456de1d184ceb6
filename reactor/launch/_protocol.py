"""The launch protocol's messages, one schema per kind, checked where they enter a process.

Every message between the processes of a multi-process run is a msgpack array whose first item
names its kind. This module is the one place that says, for each kind, which fields it has, their
types and ranges, and who may send it; :class:`WorkerProtocol` and :class:`CoordinatorProtocol`
give the transport's ``Endpoint.open(accept=...)`` check for the two sides. A message that fails
is dropped by the endpoint (counted in ``dropped_invalid``, logged with the sender and the reason)
and the process goes on: one bad frame from a peer never ends a run.

Kinds (see ``reactor/launch/_worker.py`` for what each does):

worker <- worker (only from a process that owns the link's source):
    ("m", link, seq, time_ns, microstep, value)    a reactor message on link ``link``
    ("p", time_ns, microstep, d_ns, d_micro, n)    a promise (d_ns -1: unconditional)
worker <- coordinator (only from the coordinator):
    ("peers", {group: address}), ("start",), ("probe", epoch), ("stop", why), ("exit",),
    ("lost", group, reason, life), ("restarted", group, address, restarts)   restart policies (async runs)
coordinator <- worker (only from the run's worker groups):
    ("hello", address, local_address), ("ready",), ("status", epoch, idle, sent, received), ("stop_request",),
    ("replay_done",), ("ending", stop_pending, sent, received), ("done", result), ("error", text),
    ("refused", class_name, line) (a refusal: _errors.REFUSALS), ("reconnected", group)  (it links to a restarted group),
    ("trace", events) (a recording worker that failed: its events, just before its "error" or "refused"),
    ("writing", bool) (it began writing a checkpoint, or its last write in progress ended: _files.watch_writes)

Stateful rules (a message behind its sender's promise) are checked where the state lives: in the
worker, when it delivers (``Worker._take``).
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Callable, Collection, Mapping
from typing import Any

from .._errors import REFUSAL_NAMES, GraphError
from .._reactor import kinds_name, port_kinds, value_fits
from .._reactor import show_value as _show
from .._tag import FOREVER_NS
from ._groups import restart_from_text

__all__ = ["COORDINATOR", "DAEMON_KINDS", "STOPPED_FOR_FAILURE_STATUS", "CoordinatorProtocol", "WorkerProtocol",
           "check_message", "check_request", "how_worker_ended", "is_plain", "nonfinite_at", "run_file_path",
           "worker_exit_words"]

COORDINATOR = "coordinator"

#: The exit status of a worker that its coordinator stopped because the run failed elsewhere
#: (``("stop", "failure")``), once its shutdown reactions ran. It exited 143 (the reaping's SIGTERM)
#: and read as if it had failed too, in ``reactor status`` and in its daemon's records.
STOPPED_FOR_FAILURE_STATUS = 4
# (In this module as both the worker and its coordinator use them.)
#: A failed worker ends at most this long after it told its coordinator: shutdown reactions that hold it
#: longer (blocked in a sleep, a hung save) are left unfinished (``_leave_by``). Without a restart its
#: coordinator reaps it about as soon (FAILURE_STOP_S, then SIGTERM, which a reaction blocked in Python
#: or C does not hear, and SIGKILL 5 s later); under a restart policy it is told "exit" at once, and
#: nothing ended it: the group's next life waited for its end for good, and so did the run's end.
FAILED_END_S = 10.0
#: ... unless it is writing a checkpoint then (``_files.writing``: a learner's ``learner.pt``, a shard's final
#: checkpoint): it waits for the write at most this long more. The write is whole or not at all either way
#: (a temporary file, then a rename: a kill mid-write leaves the earlier file, which a resume loads), but a
#: cut one threw away what the failed life learned since its last checkpoint, and under a restart policy its
#: next life resumed from that older one, to start a few seconds sooner; and it left its partial temporary
#: file (as large as the checkpoint) until the next save. A hung write still ends by this bound.
FAILED_SAVE_S = 120.0

#: What a worker's exit status other than 0 says, in the one place that says it: the coordinator's errors and
#: log (:func:`how_worker_ended`) and ``reactor status`` (:func:`worker_exit_words`). A worker's output is its
#: stderr: the terminal of ``reactor run``, a daemon's job log (``reactor logs``). 2 is
#: ``_errors.REFUSAL_EXIT_STATUS``.
_EXIT_WORDS = {1: "failed: its traceback is in its output",
               2: "refused the run: its line is in its output", 3: "lost a peer: its output names which",
               STOPPED_FOR_FAILURE_STATUS: "stopped because the run failed", 143: "ended by SIGTERM"}


def worker_exit_words(rc: int) -> str:
    """What worker exit status ``rc`` says; "" for 0, and for one a reactor worker does not give itself."""
    return _EXIT_WORDS.get(rc, "")


def how_worker_ended(rc: int | None, where: str = "") -> str:
    """How a worker ended, in words: ``"was killed by SIGKILL"``, ``"exited with status 3 (lost a peer: its
    output names which)"``; ``rc`` is its exit status (negative: the signal that killed it, as ``Popen`` says),
    or None for one that was lost (``where`` then says how), and ``where`` follows (a host: ``"on host 'h3'"``)."""
    if rc is None:
        return where
    if rc < 0:
        try:
            said = f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            said = f"was killed by signal {-rc}"
    else:
        words = worker_exit_words(rc)
        said = f"exited with status {rc}" + (f" ({words})" if words else "")
    return f"{said} {where}" if where else said


_I64_MAX = 2**63 - 1
_TEXT_MAX = 1 << 20  # an error report's traceback
_ADDRESS_MAX = 1024
_NAME_MAX = 255

Check = Callable[[Any], str | None]  # None: fine; else what is wrong


def _count(v: Any) -> str | None:
    if type(v) is not int or not 0 <= v <= _I64_MAX:
        return f"an int in [0, 2**63) expected, got {_show(v)}"
    return None


def _time(v: Any) -> str | None:
    """A message's logical time: before NEVER (a message at or past it could never be delivered)."""
    if type(v) is not int or not 0 <= v < FOREVER_NS:
        return f"an int in [0, 2**62) expected, got {_show(v)}"
    return None


def _bound(v: Any) -> str | None:
    """A promise's time: at most NEVER."""
    if type(v) is not int or not 0 <= v <= FOREVER_NS:
        return f"an int in [0, 2**62] expected, got {_show(v)}"
    return None


def _dist(v: Any) -> str | None:
    if type(v) is not int or not -1 <= v <= _I64_MAX:
        return f"an int in [-1, 2**63) expected, got {_show(v)}"
    return None


def _epoch(v: Any) -> str | None:
    return _dist(v)  # -1 before the first probe


def _bool(v: Any) -> str | None:
    return None if type(v) is bool else f"a bool expected, got {_show(v)}"


def _any(v: Any) -> str | None:
    return None


def _text(v: Any) -> str | None:
    if type(v) is not str or len(v) > _TEXT_MAX:
        return f"a str of at most {_TEXT_MAX} characters expected, got {_show(v)}"
    return None


_TCP_RE = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+(%[A-Za-z0-9_.\-]+)?\]|[A-Za-z0-9_.\-]+):([0-9]{1,5})\Z")  # ([v6%scope])
_IPC_PATH_MAX = 107  # sun_path's 108 bytes, with the NUL


def tcp_address_error(v: Any) -> str | None:
    """None if ``v`` is a ``tcp://HOST:PORT`` address zmq can connect to (a port in 1..65535), else why not."""
    m = _TCP_RE.match(v) if type(v) is str and len(v) <= _ADDRESS_MAX else None
    if m is None or not 0 < int(m.group(3)) < 65536:
        return f"a tcp://HOST:PORT address expected, got {_show(v)}"
    return None


def _address(v: Any) -> str | None:
    """An endpoint a worker or the coordinator will connect to: checked here as far as ``connect``
    would refuse it (a refusal there would end the run, not drop the message)."""
    if type(v) is not str or len(v) > _ADDRESS_MAX:
        return f"a tcp:// or ipc:// address expected, got {_show(v)}"
    if v.startswith("tcp://"):
        return tcp_address_error(v)
    if v.startswith("ipc://"):
        path = v[len("ipc://"):]
        if not path or "\0" in path or len(path.encode()) > _IPC_PATH_MAX:
            return f"an ipc:// path of 1..{_IPC_PATH_MAX} bytes expected, got {_show(v)}"
        return None
    return f"a tcp:// or ipc:// address expected, got {_show(v)}"


def _local_address(v: Any) -> str | None:
    if v is not None and (type(v) is not str or not v.startswith("ipc://") or _address(v) is not None):
        return f"None or an ipc:// address expected, got {_show(v)}"
    return None


def _group(v: Any) -> str | None:
    if type(v) is not str or not 0 < len(v) <= _NAME_MAX:
        return f"a group name expected, got {_show(v)}"
    return None


def _address_book(v: Any) -> str | None:
    if type(v) is not dict or len(v) > 65536:
        return f"a dict of group -> address expected, got {_show(v)}"
    for k, a in v.items():
        if type(k) is not str or not 0 < len(k) <= _NAME_MAX:
            return f"a group name expected as key, got {_show(k)}"
        if (why := _address(a)) is not None:
            return f"peers[{k!r}]: {why}"
    return None


def _str_int_map(v: Any) -> str | None:
    if type(v) is not dict or not all(type(k) is str and type(x) is int for k, x in v.items()):
        return f"a dict of str -> int expected, got {_show(v)}"
    return None


def _str_str_map(v: Any) -> str | None:
    if type(v) is not dict or not all(type(k) is str and type(x) is str for k, x in v.items()):
        return f"a dict of str -> str expected, got {_show(v)}"
    return None


def _trace(v: Any) -> str | None:
    if type(v) is not dict or not all(type(k) is str and type(x) is list for k, x in v.items()):
        return f"a dict of reactor -> event list expected, got {_show(v)}"
    for events in v.values():
        for e in events:
            if type(e) is not list or len(e) != 3 or not all(type(x) is int for x in e):
                return f"trace events must be [kind, rank, seq] ints, got {_show(e)}"
    return None


def _stats(v: Any) -> str | None:
    if type(v) is not dict or not all(type(k) is str and type(x) in (int, float, bool) for k, x in v.items()):
        return f"a dict of str -> number expected, got {_show(v)}"
    if type(v.get("dropped")) is not int:
        return "the count 'dropped' (an int) is missing"
    return None


# A worker's final report: the fields the coordinator reads, each with its type.
_RESULT_FIELDS: dict[str, Check] = {
    "replay_incomplete": lambda v: None if v is None or type(v) is str else f"None or a str expected, got {_show(v)}",
    "stats": _stats,
    "events": _str_int_map,
    "digests": _str_str_map,
    "trace": _trace,
}


def _result(v: Any) -> str | None:
    if type(v) is not dict or set(v) != set(_RESULT_FIELDS):
        return f"a dict with exactly the fields {sorted(_RESULT_FIELDS)} expected, got {_show(v)}"
    for name, check in _RESULT_FIELDS.items():
        if (why := check(v[name])) is not None:
            return f"result[{name!r}]: {why}"
    return None


#: Why the coordinator stops a run (RunResult.stopped_by's words, and a worker's failure).
STOP_REASONS = frozenset({"stop_time", "quiescence", "request", "signal", "replay", "failure"})


def _stop_reason(v: Any) -> str | None:
    return None if type(v) is str and v in STOP_REASONS else f"one of {sorted(STOP_REASONS)} expected, got {_show(v)}"


def _refusal_name(v: Any) -> str | None:
    return None if type(v) is str and v in REFUSAL_NAMES else f"one of {sorted(REFUSAL_NAMES)} expected, got {_show(v)}"


#: kind -> the checks of the fields after the kind, in order.
PEER_KINDS: dict[str, tuple[Check, ...]] = {
    "m": (_count, _count, _time, _count, _any),
    "p": (_bound, _count, _dist, _count, _count),
}
COORDINATOR_KINDS: dict[str, tuple[Check, ...]] = {
    "peers": (_address_book,),
    "start": (),
    "probe": (_count,),
    "stop": (_stop_reason,),
    "exit": (),
    "lost": (_group, _text, _count),
    "restarted": (_group, _address, _count),
}
WORKER_KINDS: dict[str, tuple[Check, ...]] = {
    "hello": (_address, _local_address),
    "ready": (),
    "status": (_epoch, _bool, _count, _count),
    "stop_request": (),
    "replay_done": (),
    "ending": (_bool, _count, _count),
    "done": (_result,),
    "trace": (_trace,),
    "writing": (_bool,),
    "error": (_text,),
    "refused": (_refusal_name, _text),
    "reconnected": (_group,),
}


# ------------------------------------------------------------------------------ daemon requests

_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(/[A-Za-z0-9_][A-Za-z0-9_.\-]*)*\Z")  # (\Z: no "\n" after)
#: The most files, and bytes in all, a job or a worker spawned over hosts carries (its app, ``--with``
#: files, placement, hosts and key files, a trace to replay): what ``shipped_files`` refuses before they go.
FILES_MAX = 64
FILES_MAX_NBYTES = 32 * 2**20
_FILES_MAX, _FILES_MAX_NBYTES = FILES_MAX, FILES_MAX_NBYTES
_JOB_RE = re.compile(r"^[0-9a-f]{16}\Z")
_CONFIG_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,127}\Z")  # (what --set KEY=VALUE can carry)
_POLICY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-]{0,63}\Z")  # a policy's name (not a path: those are shipped files)


def is_plain(v: Any, depth: int = 0) -> bool:
    """A config value a `--set` can carry: None, bool, int, float, str, lists and str-keyed dicts."""
    if depth > 16:
        return False
    if v is None or type(v) in (bool, int, float, str):
        return True
    if type(v) in (list, tuple):
        return all(is_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(type(k) is str and is_plain(x, depth + 1) for k, x in v.items())
    return False


def nonfinite_at(v: Any, depth: int = 0) -> str | None:
    """Where a plain value holds a NaN or an infinity: ``""`` for ``v`` itself, ``"['lr']"`` or ``"[2]"``
    inside it; None when every float in it is finite. No config field of reactor's means anything by
    one (a NaN learning rate trains a NaN network, and a NaN bound is never reached), so the typed configs
    refuse them (an app's ``Config``, an algorithm's), and so does a daemon's ``submit``, whose config
    reaches the job as ``--set KEY=repr(VALUE)``, which cannot carry them. A builder's arguments may
    (a rate limiter's infinite bound): a worker's spec is not checked for them."""
    if isinstance(v, float):  # (numpy's float64 too)
        return None if math.isfinite(v) else ""
    if depth > 16:
        return None
    items = v.items() if type(v) is dict else enumerate(v) if type(v) in (list, tuple) else ()
    for k, x in items:
        if (at := nonfinite_at(x, depth + 1)) is not None:
            return f"[{k!r}]{at}"
    return None


_SPEC_FIELDS = ("app", "files", "sha256", "config", "placement", "hosts", "seed", "async", "restart")


def _files(files: Any, sums: Any, app: Any) -> str | None:
    """Shipped files: relative paths -> bytes, bounded in count and size, one sha256 each, the app among them."""
    if type(files) is not dict or not 0 < len(files) <= _FILES_MAX:
        return f"files: a dict of 1..{_FILES_MAX} path -> bytes expected, got {_show(files)}"
    total = 0
    for name, data in files.items():
        if type(name) is not str or len(name) > 255 or not _FILE_RE.match(name) or ".." in name.split("/"):
            return f"files: {_show(name)} is not a relative path of [A-Za-z0-9_.-] parts"
        if type(data) is not bytes:
            return f"files[{name!r}]: bytes expected, got {_show(data)}"
        total += len(data)
    if total > _FILES_MAX_NBYTES:
        return f"files: {total} bytes in all, more than {_FILES_MAX_NBYTES}"
    dirs = {"/".join(parts[:i]) for parts in (n.split("/") for n in files) for i in range(1, len(parts))}
    if both := sorted(dirs & set(files)):
        return f"files: {both[0]!r} is both a file and a directory"
    if type(sums) is not dict or set(sums) != set(files) or not all(
            type(h) is str and re.fullmatch(r"[0-9a-f]{64}", h) for h in sums.values()):
        return "sha256: one hex sha256 per file expected"
    if type(app) is not str or app not in files:
        return f"app: the name of one of the files expected, got {_show(app)}"
    return None


def _job_spec(v: Any) -> str | None:
    if type(v) is not dict or set(v) != set(_SPEC_FIELDS):
        return f"a job spec is a dict with exactly the fields {list(_SPEC_FIELDS)}, got {_show(v)}"
    if (why := _files(v["files"], v["sha256"], v["app"])) is not None:
        return why
    if type(v["config"]) is not dict or not is_plain(v["config"]):
        return f"config: a dict of plain values (None, bool, int, float, str, lists, dicts) expected, got {_show(v['config'])}"
    if bad := [k for k in v["config"] if not _CONFIG_KEY_RE.match(k)]:
        return f"config: {_show(bad[0])} is not a field name ([A-Za-z_][A-Za-z0-9_.-]*, at most 128)"
    if (at := nonfinite_at(v["config"])) is not None:
        return f"config{at} is not a finite number; config values must be finite"
    if type(v["placement"]) is not str or not (v["placement"] in v["files"] or _POLICY_RE.match(v["placement"])):
        return f"placement: a policy name or the name of one of the files expected, got {_show(v['placement'])}"
    if v["hosts"] is not None and (type(v["hosts"]) is not str or v["hosts"] not in v["files"]):
        return f"hosts: None or the name of one of the files expected, got {_show(v['hosts'])}"
    if type(v["seed"]) is not int or not 0 <= v["seed"] < 2**63:
        return f"seed: an int in [0, 2**63) expected, got {_show(v['seed'])}"
    if type(v["async"]) is not bool:
        return f"async: a bool expected, got {_show(v['async'])}"
    if v["restart"] is not None:
        if type(v["restart"]) is not str or len(v["restart"]) > 40:
            return f"restart: None or a policy (never, on-failure, on-failure:N) expected, got {_show(v['restart'])}"
        try:
            restart_from_text(v["restart"])
        except GraphError as e:
            return str(e)
    return None


def _job_id(v: Any) -> str | None:
    return None if type(v) is str and _JOB_RE.match(v) else f"a job id (16 hex digits) expected, got {_show(v)}"


def _job_or_none(v: Any) -> str | None:
    return None if v is None else _job_id(v)


_RUN_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,63}\Z")  # not "." nor "..": a directory's name
_GROUP_NAME_RE = re.compile(r"^[A-Za-z0-9_\-\[\]]{1,128}\Z")
_SPAWN_FIELDS = ("run", "group", "app", "files", "sha256", "worker", "lease_s")


def _run_id(v: Any) -> str | None:
    return None if type(v) is str and _RUN_RE.match(v) else \
        f"a run id ([A-Za-z0-9_.-], 1..64, not starting with '.') expected, got {_show(v)}"


def _group_name(v: Any) -> str | None:
    if type(v) is not str or not _GROUP_NAME_RE.match(v):
        return f"a group name ([A-Za-z0-9_-[]], 1..128) expected, got {_show(v)}"
    return None


def _rel_path(v: Any) -> str | None:
    if type(v) is not str or len(v) > 4096 or not _FILE_RE.match(v):
        return f"a relative path of [A-Za-z0-9_.-] parts expected, got {_show(v)}"
    return None


def run_file_path(path: str) -> bool:
    """Whether ``path`` (relative to a hosted run's directory) is one a ``run_file`` request can name: a
    ``run_files`` listing offers no other (its coordinator's request for it would be refused)."""
    return _rel_path(path) is None


def _spawn(v: Any) -> str | None:
    """A coordinator's request to start one group's worker here (``reactor/launch/_hosting.py``)."""
    if type(v) is not dict or set(v) != set(_SPAWN_FIELDS):
        return f"a spawn request is a dict with exactly the fields {list(_SPAWN_FIELDS)}, got {_show(v)}"
    if (why := _run_id(v["run"])) is not None:
        return f"run: {why}"
    if (why := _group_name(v["group"])) is not None:
        return f"group: {why}"
    if (why := _files(v["files"], v["sha256"], v["app"])) is not None:
        return why
    if type(v["worker"]) is not dict or not is_plain(v["worker"]):
        return f"worker: a worker spec (a dict of plain values) expected, got {_show(v['worker'])}"
    if type(v["lease_s"]) not in (int, float) or not 0 < v["lease_s"] <= 3600:
        return f"lease_s: seconds in (0, 3600] expected, got {_show(v['lease_s'])}"
    return None


#: A client's requests to a daemon (``reactor/launch/_daemon.py``), after the request id.
DAEMON_KINDS: dict[str, tuple[Check, ...]] = {
    "ping": (),
    "submit": (_job_spec,),
    "status": (_job_or_none,),
    "logs": (_job_id, _count),
    "stop": (_job_id,),
    "hosted": (),
    "spawn": (_spawn,),
    "workers": (_run_id,),
    "end": (_run_id,),
    "worker_log": (_run_id, _group_name, _count),
    "run_files": (_run_id,),
    "run_file": (_run_id, _rel_path, _count),
}


def check_request(msg: Any) -> str | None:
    """A daemon request is ``[request id, kind, ...fields]``; None if it conforms, else why not."""
    if type(msg) is not list or len(msg) < 2 or type(msg[0]) is not int or not 0 <= msg[0] < 2**63:
        return f"a request is [id, kind, ...] with an int id, got {_show(msg)}"
    return check_message(DAEMON_KINDS, msg[1:])


def check_message(kinds: Mapping[str, tuple[Check, ...]], msg: Any) -> str | None:
    """Check ``msg`` against the schema of its kind in ``kinds``; None if it conforms, else why not."""
    if type(msg) not in (list, tuple) or not msg:
        return f"a message is a non-empty array [kind, ...], got {_show(msg)}"
    kind = msg[0]
    checks = kinds.get(kind) if type(kind) is str else None
    if checks is None:
        return f"unknown message kind {_show(kind)} (expected one of {sorted(kinds)})"
    if len(msg) != 1 + len(checks):
        return f"{kind!r} has {len(checks)} fields, got {len(msg) - 1}"
    for i, check in enumerate(checks, 1):
        if (why := check(msg[i])) is not None:
            return f"{kind!r} field {i}: {why}"
    return None


class WorkerProtocol:
    """What a worker accepts: peer kinds from the processes that own each link's source, control
    kinds from the coordinator, each conforming to its schema, and on each link only values of the
    type its destination port declares.

    Args:
        in_links: link index -> (the group that owns the link's source, the destination port's
            declared type) for every link into this worker from another process.
        coordinator: the coordinator's endpoint name.
    """

    def __init__(self, in_links: Mapping[int, tuple[str, Any]], coordinator: str = COORDINATOR) -> None:
        self.in_links = dict(in_links)
        self.senders = frozenset(g for g, _ in self.in_links.values())
        self._kinds = {i: port_kinds(t) for i, (_, t) in self.in_links.items()}  # (per link, not per message)
        self.coordinator = coordinator

    def __call__(self, sender: str, msg: Any) -> str | None:
        if sender == self.coordinator:
            return check_message(COORDINATOR_KINDS, msg)
        if sender not in self.senders:
            return f"{sender!r} sends on no link into this process"
        if (why := check_message(PEER_KINDS, msg)) is not None:
            return why
        if msg[0] == "m":
            entry = self.in_links.get(msg[1])
            if entry is None:
                return f"link {msg[1]} does not lead into this process"
            owner, port_type = entry
            if owner != sender:
                return f"link {msg[1]} belongs to {owner!r}, not to the sender"
            kinds = self._kinds[msg[1]]
            if kinds is not None and not value_fits(kinds, msg[5]):
                return f"link {msg[1]}: the port takes {kinds_name(port_type)}, got {_show(msg[5])}"
        return None


class CoordinatorProtocol:
    """What the coordinator accepts: worker kinds from the run's worker groups only."""

    def __init__(self, groups: Collection[str]) -> None:
        self.groups = frozenset(groups)

    def __call__(self, sender: str, msg: Any) -> str | None:
        if sender not in self.groups:
            return f"{sender!r} is not a worker of this run"
        return check_message(WORKER_KINDS, msg)
