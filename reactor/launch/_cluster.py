"""Runs over several hosts: the hosts a placement names, and the coordinator's side of the daemons
that start its workers there.

A placement file (or a ``--hosts`` file beside a distribution policy) names the daemons::

    [hosts]
    h1 = "tcp://10.0.0.1:7000"                              # its key: the cluster key (below)
    h2 = { address = "tcp://10.0.0.2:7000", key = "h2.pub" } # a key file beside this file, or Z85 text

    [cluster]
    heartbeat_timeout_s = 3.0                               # a host silent this long is lost

    [groups.learner]
    reactors = ["learner", "evaluator", "metrics"]
    host = "h1"                                             # or ["h1", "h2"]: candidates, in order

A host without a ``key`` runs with the same key pair as the client (one key directory shared by a
cluster, as ``reactor slurm`` makes per job). Groups without ``host`` go to the first host listed.

The coordinator asks each group's daemon to start its worker (``spawn``: the worker's spec and the
app's files by content and sha256, over the CURVE link to the daemon), then polls every daemon of
the run each ``HEARTBEAT_S`` (``workers``): the answer carries the exit status of each of the run's
workers there, and a daemon that does not answer for ``heartbeat_timeout_s`` is a lost host. A
daemon that hears nothing from a run's coordinator for its lease kills the run's workers there, so
a lost coordinator leaves nothing behind. At the end the coordinator sends ``end``: the daemon
stops what is left of the run on its host and removes its shared-memory segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import re
import socket
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._errors import DaemonError, GraphError
from .._reactor import show_value as _show
from ._app import files_to_ship, shipped_files
from ._groups import Group
from ._hosting import LOG_CHUNK_NBYTES, chunk_problem, raise_open_files
from ._jobrecord import PID_MAX, RC_RANGE
from ._version import build_id, python_version

__all__ = ["HEARTBEAT_S", "HEARTBEAT_TIMEOUT_S", "LAST_LINE_SAID", "Z85_KEY_RE", "Host", "MixedBuildsError", "NoHostAnsweredError",
           "RemoteWorkers", "assign_hosts", "parse_hosts"]

log = logging.getLogger("reactor.cluster")

HEARTBEAT_S = 0.5
#: The most of a failed worker's last line (from its host's log) that its run's error quotes, and the words
#: before it (``_session._describe_exits`` quotes a line once, for the first worker that wrote it).
LAST_LINE_MAX = 600
LAST_LINE_WAIT_S = 3.0  # each of the two requests for a failed remote worker's last line (_last_line)
LAST_LINE_SAID = " (its last line there: "
HEARTBEAT_TIMEOUT_S = 3.0
FETCH_MAX_NBYTES = 4 << 30  # the most of a run's files copied back from its hosts
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}\Z")
#: A CURVE public key written as its 40 characters of Z85 (a hosts file's ``key``, ``--daemon-key``).
Z85_KEY_RE = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}\Z")


class NoHostAnsweredError(DaemonError):
    """None of a group's candidate hosts answered (each may be coming back: see ``host_wait_s``)."""


class MixedBuildsError(NoHostAnsweredError):
    """Every candidate host of a group answered with another reactor build than the coordinator's (a
    restart waits for one, as for a host that does not answer: its operator may be installing it)."""


@dataclass(frozen=True)
class Host:
    """A daemon a run may place groups on.

    Attributes:
        name: its name in the placement (and the daemon's ``--name``).
        address: its ``tcp://HOST:PORT``.
        key: its public key (Z85); None: the client's own public key (a cluster key).
    """

    name: str
    address: str
    key: bytes | None = None


def parse_hosts(data: Any, where: str, base: Path, read_keys: bool = True) -> dict[str, Host]:
    """The ``[hosts]`` table of a placement or hosts file (``where`` names it in errors; key files
    are relative to ``base``). Without ``read_keys``, the hosts' keys are left unread (None): a
    submitted job's may exist only on the daemon's host.

    Raises:
        GraphError: a malformed entry, naming it.
    """
    if not isinstance(data, dict) or not data:
        raise GraphError(f"{where}: [hosts] must map host names to daemon addresses")
    hosts = {}
    for name, entry in data.items():
        if not _HOST_RE.match(name):
            raise GraphError(f"{where}: host name {name!r} must match {_HOST_RE.pattern}")
        key: bytes | None = None
        if isinstance(entry, dict):
            unknown = set(entry) - {"address", "key"}
            if unknown:
                raise GraphError(f"{where}: host {name!r} has unknown fields {sorted(unknown)} (address, key)")
            address, key_text = entry.get("address"), entry.get("key")
            if key_text is not None and read_keys:
                key = _read_key(key_text, where, name, base)
            elif isinstance(key_text, str) and (base / key_text).is_file():
                from ..transport import CurveKeys

                if CurveKeys.holds_secret(base / key_text):  # (unread here, it would still travel with a submit)
                    raise GraphError(f"{where}: host {name!r}: its key {base / key_text} holds a secret key (it is a "
                                     f"key pair): name its public half, the key.pub beside it")
        else:
            address = entry
        if not isinstance(address, str) or not re.fullmatch(r"tcp://[^\s:/]+:\d{1,5}", address):
            raise GraphError(f"{where}: host {name!r} needs a daemon address tcp://HOST:PORT, got {address!r}")
        if not 0 < int(address.rsplit(":", 1)[1]) < 65536:  # (70000 was taken, then "did not answer" at the run)
            raise GraphError(f"{where}: host {name!r}: port {address.rsplit(':', 1)[1]} of {address} is not a port "
                             f"(1..65535)")
        hosts[name] = Host(name, address, key)
    return hosts


def _read_key(text: Any, where: str, name: str, base: Path) -> bytes:
    if not isinstance(text, str):
        raise GraphError(f"{where}: host {name!r}: key must be a key file's path or a Z85 public key")
    if Z85_KEY_RE.match(text) and not (base / text).is_file():
        return text.encode()
    from ..transport import CurveKeys

    path = base / text
    try:
        return CurveKeys.load_public(path)
    except (OSError, ValueError) as e:
        raise GraphError(f"{where}: host {name!r}: cannot read its key {path}: {e}") from e


#: The tables a file may have at its top level: a misspelt or misplaced one (``[grups.b]``, a hosts
#: file's ``[groups.x]``) was ignored, and the run went on without what it said.
TOP_TABLES = {"hosts file": ("hosts", "cluster", "restart"), "placement file": ("groups", "hosts", "cluster", "restart")}


def check_top_tables(data: dict[str, Any], what: str, where: str) -> None:
    """Refuse a table (or key) at the top of a ``what`` (:data:`TOP_TABLES`) that it does not take.

    Raises:
        GraphError: naming it, the closest table it takes, and every table it takes.
    """
    import difflib

    allowed = TOP_TABLES[what]
    for name in data:
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            raise GraphError(f"{where}: a {what} has no [{name[:100]}]{f' (did you mean [{near[0]}]?)' if near else ''}: "
                             f"it takes {', '.join(f'[{t}]' for t in allowed)}")


def load_hosts_file(path: str | Path, read_keys: bool = True) -> tuple[dict[str, Host], dict[str, Any]]:
    """A ``--hosts`` file: its hosts and its ``[cluster]`` settings.

    Raises:
        GraphError: unreadable, or without a valid ``[hosts]``.
    """
    import tomllib

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise GraphError(f"hosts file {path}: {e}") from e
    check_top_tables(data, "hosts file", f"hosts file {path}")
    return (parse_hosts(data.get("hosts"), f"hosts file {path}", p.parent, read_keys),
            cluster_settings(data, f"hosts file {path}"))


def head_host(path: str | Path) -> Host:
    """The host a job over hosts is submitted to (its coordinator runs there): in a placement file,
    its first group's first ``host``, else the first host listed; in a hosts file, the first host
    (where a distribution policy puts its first group).

    Raises:
        GraphError: the file names no hosts.
    """
    import tomllib

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise GraphError(f"{path}: {e}") from e
    hosts = parse_hosts(data.get("hosts"), str(path), p.parent)
    groups = data.get("groups")
    first = next(iter(groups.values()), None) if isinstance(groups, dict) else None
    name = first.get("host") if isinstance(first, dict) else None
    name = name[0] if isinstance(name, list) and name else name
    return hosts[name] if isinstance(name, str) and name in hosts else next(iter(hosts.values()))


def cluster_settings(data: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``[cluster]`` table, checked: ``heartbeat_timeout_s`` (seconds, > HEARTBEAT_S)."""
    raw = data.get("cluster", {})
    if not isinstance(raw, dict) or set(raw) - {"heartbeat_timeout_s"}:
        raise GraphError(f"{where}: [cluster] takes heartbeat_timeout_s only")
    t = raw.get("heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S)
    if type(t) not in (int, float) or not 2 * HEARTBEAT_S <= t <= 3600:
        raise GraphError(f"{where}: heartbeat_timeout_s must be a number of seconds in [{2 * HEARTBEAT_S}, 3600]")
    return {"heartbeat_timeout_s": float(t)}


def assign_hosts(groups: list[Group], hosts: dict[str, Host], where: str, *, spread: bool) -> list[Group]:
    """Give each group its candidate hosts: its own ``host`` (checked against ``hosts``), else the
    groups of a distribution policy spread round-robin over the hosts in order (the first group,
    the learner's, on the first host); a group of a placement file without ``host`` on the first.

    Raises:
        GraphError: a group names a host that ``[hosts]`` lacks.
    """
    names = list(hosts)
    out = []
    turn = itertools.cycle(names)
    for g in groups:
        if g.hosts:
            unknown = [h for h in g.hosts if h not in hosts]
            if unknown:
                raise GraphError(f"{where}: group {g.name!r} names host {unknown[0]!r}, which [hosts] lacks "
                                 f"(it has {', '.join(names)})")
            out.append(g)
        elif spread:
            out.append(replace(g, hosts=(next(turn),)))
        else:
            out.append(replace(g, hosts=(names[0],)))
    return out


def place_on_hosts(groups: Sequence[Group], room: Mapping[str, int | None]) -> tuple[list[tuple[Group, str]], list[Group]]:
    """Each group on one of its candidate hosts, no host holding more groups than its ``room`` (None: no
    bound): a placement whenever one exists, as a bipartite matching with capacities (augmenting paths:
    a group left without room moves placed ones to other hosts of theirs). Groups are first placed on
    their first candidate host with room, those with fewer candidates first (so that a group with a
    choice does not take the room of one without), and a group moves only to make room. Returns the
    ``(group, host)`` pairs and the groups no placement can hold (in their order)."""
    on: dict[str, list[Group]] = {h: [] for h in room}

    def fits(h: str) -> bool:
        limit = room[h]
        return limit is None or len(on[h]) < limit

    def augment(g: Group, seen: set[str]) -> bool:
        """Place ``g`` (not placed now), moving placed groups off the hosts it needs; False if there is
        no way through hosts not in ``seen`` (those this search has asked already). A breadth-first
        search over hosts, kept in a queue (a recursive one went a level deeper per host on the path:
        past ~1,000 hosts, Python's recursion limit); the path found moves each group on it one host on,
        the last onto the host with room, and ``g`` onto the first."""
        came: dict[str, tuple[str, Group] | None] = {}  # host -> (host before it, the group moved from there)
        todo: deque[str] = deque()
        for h in g.hosts:
            if h in seen:
                continue
            if fits(h):
                on[h].append(g)
                return True
            seen.add(h)
            came[h] = None
            todo.append(h)
        while todo:
            h = todo.popleft()
            for o in on[h]:
                for h2 in o.hosts:
                    if h2 in seen:
                        continue
                    seen.add(h2)
                    came[h2] = (h, o)
                    if not fits(h2):
                        todo.append(h2)
                        continue
                    at = h2
                    while (step := came[at]) is not None:
                        before, moved = step
                        del on[before][next(i for i, x in enumerate(on[before]) if x is moved)]
                        on[at].append(moved)
                        at = before
                    on[at].append(g)
                    return True
        return False

    order = sorted(range(len(groups)), key=lambda k: len(groups[k].hosts))  # (stable: in order among equals)
    unplaced: list[int] = []
    for k in order:
        host = next((h for h in groups[k].hosts if fits(h)), None)
        if host is None:
            unplaced.append(k)
        else:
            on[host].append(groups[k])
    # A search that fails went only through full hosts whose groups have no candidate host outside them:
    # no later path can pass there (one from any group of theirs ends on a full host of theirs), so the
    # searches after it skip them (each repeated them all: 20,000 groups on 16 hosts' room for 4,000,
    # each with every host, took 42 s to refuse; 0.04 s now).
    dead: set[str] = set()
    left: list[int] = []
    for k in unplaced:
        seen = set(dead)
        if not augment(groups[k], seen):
            dead |= seen
            left.append(k)
    left.sort()
    return [(g, h) for h, gs in on.items() for g in gs], [groups[k] for k in left]


def _host_port(address: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (``[v6]`` too) -> ``(HOST, PORT)``, the brackets off."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    return host.strip("[]"), int(port)


async def _unresolved(address: str) -> str | None:
    """Why ``tcp://HOST:PORT``'s host name does not resolve now, or None (it does, or is an address)."""
    host = _host_port(address)[0]
    try:
        await asyncio.get_running_loop().getaddrinfo(host, None)
    except socket.gaierror as e:
        return f"its address {address}: {host!r} cannot be resolved ({e.strerror})"
    return None


def address_towards(address: str) -> str:
    """The local interface address this host reaches ``tcp://HOST:PORT`` from (what a daemon there
    can dial back): the source address the kernel routes a datagram to it from (nothing is sent)."""
    host, port = _host_port(address)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:  # (a typo in a hosts file: a name no resolver knows)
        raise GraphError(f"host address {address}: {host!r} cannot be resolved ({e.strerror}): check the "
                         f"hosts file") from None
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        local = s.getsockname()[0]
    return f"[{local}]" if ":" in local else local


def _chunk_problem(got: Any) -> str | None:
    if type(got) is not dict or type(got.get("data")) is not bytes or type(got.get("offset")) is not int:
        return f"it is {_show(got)}, not a chunk {{data: bytes, offset: int}}"
    if len(got["data"]) > LOG_CHUNK_NBYTES or not 0 <= got["offset"] < 2**63:
        return f"a chunk of {len(got['data'])} bytes (at most {LOG_CHUNK_NBYTES}) at offset {got['offset']}"
    return None


def _workers_problem(got: Any) -> str | None:
    if type(got) is not dict:
        return f"it is {_show(got)}, not a map of groups to their workers"
    for g, w in got.items():
        if type(g) is not str or type(w) is not dict or type(w.get("pid")) is not int or not 0 < w["pid"] <= PID_MAX:
            return f"group {_show(g)}: {_show(w)} is not {{pid: int, returncode: int or None}}"
        rc = w.get("returncode")
        if rc is not None and (type(rc) is not int or not RC_RANGE[0] <= rc <= RC_RANGE[1]):
            return f"group {g!r:.100}: returncode {_show(rc)} is not an exit status"
    return None


def _files_problem(got: Any) -> str | None:
    if type(got) is not dict or type(got.get("files")) is not list or type(got.get("more")) is not bool \
            or type(got.get("unfetchable")) is not int or got["unfetchable"] < 0 \
            or type(got.get("unfetchable_shown")) is not list:
        return f"it is {_show(got)}, not a listing {{files, more, unfetchable, unfetchable_shown}}"
    for f in got["files"]:
        if type(f) is not dict or type(f.get("path")) is not str or type(f.get("size")) is not int or f["size"] < 0:
            return f"file {_show(f)} is not {{path: str, size: int >= 0}}"
    if not all(type(x) is str for x in got["unfetchable_shown"]):
        return "unfetchable_shown holds what is not a path"
    return None


#: What the coordinator reads of a daemon's answer, by kind: a daemon (another host: a peer, maybe
#: broken or hostile) whose answer is not one is a ``DaemonError`` naming it, never a KeyError or a
#: TypeError in the coordinator. (``ping`` is read field by field where it is used.)
_ANSWERS = {
    "spawn": lambda g: None if type(g) is dict and type(g.get("pid")) is int and 0 < g["pid"] <= PID_MAX else
    f"it is {_show(g)}, not {{pid: int, dir: str}}",
    "workers": _workers_problem,
    "end": _workers_problem,
    "worker_log": _chunk_problem,
    "run_file": _chunk_problem,
    "run_files": _files_problem,
}


class DaemonLink:
    """Requests to one daemon from the event loop: the command line's blocking ``DaemonClient``,
    driven in a worker thread, one request at a time (a request never ties up the loop)."""

    def __init__(self, host: Host, keys: Any, ctx: Any = None) -> None:
        from ._daemon import DaemonClient

        self.host = host
        self.client = DaemonClient(host.address, host.key or keys.public, keys,
                                   who=f"host {host.name!r} ({host.address})", ctx=ctx)
        self.lock = asyncio.Lock()

    async def request(self, kind: str, *fields: Any, timeout_s: float) -> Any:
        """The answer's payload, of the shape its kind's answer has (:data:`_ANSWERS`).

        Raises:
            DaemonError: the daemon refused (its reason, naming the host), or answered with what is not
                an answer of that kind (naming what);
                DaemonSilentError: it did not answer within ``timeout_s`` (how far the connection got);
                DaemonKeyError: the CURVE handshake failed (which key, and why).
        """
        from ._daemon import DaemonSilentError

        async with self.lock:
            try:
                got = await asyncio.to_thread(self.client.request, kind, *fields, timeout_s=timeout_s)
            except DaemonSilentError:
                raise  # (it names the host)
            except DaemonError as e:  # (its type kept: a DaemonFullError sends a group to its next host)
                raise type(e)(f"host {self.host.name!r} refused {kind!r}: {e}") from e
        check = _ANSWERS.get(kind)
        why = check(got) if check is not None else None
        if why is not None:
            raise DaemonError(f"host {self.host.name!r} answered {kind!r} with what is not an answer: {why}")
        return got

    def close(self) -> None:
        self.client.close()


class _Links(dict[str, DaemonLink]):
    """A run's links to its hosts' daemons, each made when first asked for (``links[host]``): a hosts file of
    a cluster (``reactor slurm``'s, every node) names many hosts the run's groups may never use."""

    def __init__(self, hosts: dict[str, Host], keys: Any) -> None:
        super().__init__()
        self._hosts, self._keys = hosts, keys
        self._ctx: Any = None  # (one for every link, made with the first: a context's threads and descriptors
        # each were EMFILE; none for a run that asks no host, which may never be closed)

    def __missing__(self, name: str) -> DaemonLink:
        import zmq

        host = self._hosts[name]  # (KeyError: no such host)
        if self._ctx is None:
            self._ctx = zmq.Context()
        link = self[name] = DaemonLink(host, self._keys, self._ctx)
        return link

    def close(self) -> None:
        """Close every link, then their context."""
        for link in self.values():
            link.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None


#: How long :meth:`RemoteWorkers.check_memory` waits for a host's answer (a silent one is waited for
#: by ``choose`` as a group starts there, not twice).
CHECK_PING_S = 2.0


class RemoteWorkers:
    """The workers of one run, each started by its group's daemon; watched by heartbeat.

    Args:
        run_id: the run's id (names its files and shared memory on every host).
        hosts: the placement's hosts.
        keys: this side's key pair (each daemon must authorize its public half).
        heartbeat_timeout_s: a daemon silent this long is a lost host, its workers lost with it.
    """

    def __init__(self, run_id: str, hosts: dict[str, Host], keys: Any,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S) -> None:
        self.run_id = run_id
        self.hosts = hosts
        self.timeout_s = heartbeat_timeout_s
        raise_open_files(256 + 8 * len(hosts))  # (each link a TCP connection and its monitor; the workers' beside)
        self.links = _Links(hosts, keys)  # (made as a host is first asked: a hosts file names many)
        self.misnamed: set[str] = set()  # hosts whose daemon answers under another --name (warned once each)
        self.host_of: dict[str, str] = {}  # group -> host
        self.pid: dict[str, int] = {}
        self.ended: dict[str, tuple[int | None, str]] = {}  # group -> (exit status or None, where)
        self.last_ok: dict[str, float] = {}
        self.lost_hosts: dict[str, str] = {}
        self.silent_hosts: set[str] = set()  # lost by silence (cut off, or down), not by a daemon's answer
        self.waiting: dict[str, str] = {}  # group -> how long its restart has waited for a host (the coordinator's)
        self.files: dict[str, bytes] = {}
        self.planned: dict[str, str] = {}  # group -> the host check_memory counted it on (its start asks it first)
        self.run_dir_of: dict[str, str] = {}  # host -> the run's directory there (its daemon's spawn says it)
        self.settle_s = heartbeat_timeout_s + 2 * HEARTBEAT_S  # how long a worker's death may take to show in dead()
        self._beat: asyncio.Task[None] | None = None

    # -- starting

    def ship(self, app: str | Path, extra: Sequence[str | os.PathLike[str]] = (),
             trace: str | os.PathLike[str] | None = None) -> str:
        """Take the app file and the files it needs along (``--with``, and a trace to replay); return the
        app's name among them.

        Raises:
            AppError: two different files would go under one name there (``shipped_files``).
        """
        for name, path in shipped_files(files_to_ship(app, extra, trace)).items():
            self.files[name] = path.read_bytes()
        return Path(app).name

    async def check_memory(self, groups: Sequence[Group]) -> None:
        """Refuse a run whose workers its hosts' memory cannot hold, before any starts: refused only
        where no placement of the groups on their candidate hosts fits (:func:`place_on_hosts`), each
        host holding as many workers as its available memory over the least a worker takes there (each
        daemon's ``ping`` says both). The group's first start asks the host it was counted on first
        (:attr:`planned`): a daemon refuses
        a spawn only once its host's memory is short, which the workers started a moment before have
        not taken yet (a host with room for one took every group that named it first).
        A host that does not answer within :data:`CHECK_PING_S`, or whose daemon does not say, is not
        judged here (its daemon refuses each spawn past its memory, and ``choose`` passes over a
        silent one).

        Raises:
            GraphError: naming the host, the count and the memory.
        """
        from ._localworkers import WORKER_MEMORY_FLOOR, worker_memory_error

        candidates = list(dict.fromkeys(h for g in groups for h in g.hosts))

        async def available(host: str) -> tuple[int | None, int]:
            """What the host has available, and the least a worker takes there (its daemon's
            --worker-memory-mb; 0: it checks none)."""
            try:
                pong = await self.links[host].request("ping", timeout_s=min(self.timeout_s, CHECK_PING_S))
            except DaemonError:  # (not judged: choose() waits for it, or passes it over)
                return None, 0
            got = [pong.get(k) if isinstance(pong, dict) else None for k in ("memory", "worker_memory")]
            mem, floor = (v if type(v) is int and v >= 0 else None for v in got)  # (a peer's words)
            return mem, WORKER_MEMORY_FLOOR if floor is None else floor

        said = dict(zip(candidates, await asyncio.gather(*(available(h) for h in candidates))))
        room = {h: mem // floor if floor and mem is not None else None for h, (mem, floor) in said.items()}
        placed, left = place_on_hosts(groups, room)  # (left: the groups no placement has room for)
        if not left:
            self.planned.update((g.name, h) for g, h in placed)
        else:  # (said of the first one's first host: what it holds, and those of them it cannot take)
            h = left[0].hosts[0]
            mem, floor = said[h]
            n = sum(on == h for _, on in placed) + sum(g.hosts[0] == h for g in left)
            others = ", ".join(left[0].hosts[1:])
            raise GraphError(f"{worker_memory_error(n, mem, f'host {h}', floor)}"
                             f"{f' (the other candidate hosts of group {left[0].name!r}, {others}, are full as well)' if others else ''}")

    async def choose(self, group: Group, full: Mapping[str, str] | None = None, first: str | None = None) -> str:
        """The first of the group's candidate hosts whose daemon answers: those not lost first, in
        order (``first`` before the others); then the lost ones, asked again (a daemon that a
        supervisor such as Ray, Kubernetes or systemd started again at its address is a host again).
        Hosts in ``full`` (host -> its daemon's refusal) refused to start the group for want of
        memory: passed over.

        Raises:
            NoHostAnsweredError: none answers, naming each and why.
            DaemonFullError: none answers but those in ``full``, naming each and why.
        """
        full = full or {}
        why = [f"{h}: {w}" for h, w in full.items()]
        hosts = sorted((h for h in group.hosts if h not in full), key=lambda h: h != first)  # (stable)
        for h in [h for h in hosts if h not in self.lost_hosts] + [h for h in hosts if h in self.lost_hosts]:
            was_lost = self.lost_hosts.get(h)
            try:
                pong = await self._ping(h)
            except DaemonError as e:
                self.lost_hosts[h] = str(e)
                unresolved = await _unresolved(self.hosts[h].address)  # (a typo, or a name not up yet)
                why.append(f"{h}: {unresolved or e}" + (f" (lost earlier: {was_lost})" if was_lost else ""))
                continue
            self.last_ok[h] = time.monotonic()
            theirs = pong.get("reactor") if isinstance(pong, dict) else None
            if theirs != build_id():
                # (it answers: not lost; a run on it would speak schemas the others do not)
                py = pong.get("python") if isinstance(pong, dict) else None
                why.append(f"{h}: its daemon runs reactor {str(theirs)[:40] if theirs else '(an earlier one, unnamed)'}"
                           f"{f' on Python {str(py)[:20]}' if py else ''}, and this coordinator reactor {build_id()} "
                           f"on Python {python_version()}: every host of a run needs the same reactor (install this "
                           f"one there, and start its daemon again)")
                continue
            name = pong.get("name") if isinstance(pong, dict) else None
            if isinstance(name, str) and name != h and h not in self.misnamed:  # (a copied line, a swapped address)
                self.misnamed.add(h)
                log.warning("host %s at %s answers as daemon %r (its --name): the hosts file may give %s the address "
                            "of another host; its groups run on daemon %r", h, self.hosts[h].address,
                            name[:100], h, name[:100])
            # (another group's choice may have heard it answer during our ping, and said so)
            if was_lost is not None and self.lost_hosts.pop(h, None) is not None:
                self.silent_hosts.discard(h)
                log.warning("host %s answers again (it was lost: %s)", h, was_lost)
            return h
        if why and all(": its daemon runs reactor " in w for w in why):
            raise MixedBuildsError(f"group {group.name!r}: no candidate host can run it: {'; '.join(why)}")
        if full:
            from ._daemon import DaemonFullError

            what = ("has the memory to start it" if len(why) == len(full) else  # (others silent, or of another build)
                    f"can start it ({', '.join(full)} for want of memory)")
            raise DaemonFullError(f"group {group.name!r}: no candidate host {what}: {'; '.join(why)}")
        keys = (" (a submitted job's coordinator has its head daemon's key pair)"
                if any("its authorized/ does not hold our key.pub" in w for w in why) else "")
        raise NoHostAnsweredError(f"group {group.name!r}: no candidate host answered: {'; '.join(why)}{keys}")

    async def _ping(self, host: str) -> Any:
        """``ping`` ``host``, waiting ``heartbeat_timeout_s``; a host that took the connection (TCP, or the
        handshake too) and was slow to answer gets ``2 * heartbeat_timeout_s`` more (a daemon or a
        coordinator starved of CPU by a burst of jobs took longer than the heartbeat timeout to
        connect and answer, and a live host was passed over: the run failed to start). One that
        accepts no connection, or refuses our key, is passed over at once.

        Raises:
            DaemonError: as ``DaemonLink.request``; a slow host's error says it was asked twice.
        """
        from ._daemon import DaemonSilentError

        try:
            return await self.links[host].request("ping", timeout_s=self.timeout_s)
        except DaemonSilentError as e:
            if e.reached not in ("tcp", "handshake"):
                raise
            log.warning("host %s is slow: %s; waiting %.1f s more", host, e.why, 2 * self.timeout_s)
        try:
            return await self.links[host].request("ping", timeout_s=2 * self.timeout_s)
        except DaemonSilentError as e:
            raise type(e)(f"{e} (asked twice, {3 * self.timeout_s:.1f} s in all)", e.reached, e.why) from e

    async def start(self, group: Group, spec: dict[str, Any], app_name: str) -> None:
        """Start ``group``'s worker on its first live candidate host with ``spec`` (its ``app`` and
        ``bind`` are set by the daemon: its copy of the app, its own interface); at its first start,
        the host :meth:`check_memory` counted it on is asked first. A host whose daemon refuses it
        for want of memory (``--worker-memory-mb``) is passed over for the next candidate, at a start
        as at a restart.

        Raises:
            NoHostAnsweredError, DaemonFullError: as :meth:`choose`; DaemonError: a daemon refused
                the spawn otherwise."""
        from ._daemon import DaemonFullError

        files = self.files
        request = {"run": self.run_id, "group": group.name, "app": app_name, "files": files,
                   "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
                   "worker": spec, "lease_s": 2 * self.timeout_s}
        full: dict[str, str] = {}
        first = self.planned.pop(group.name, None)
        while True:
            host = await self.choose(group, full, first)
            try:
                got = await self.links[host].request("spawn", request, timeout_s=max(30.0, self.timeout_s))
                break
            except DaemonFullError as e:
                full[host] = str(e)
                log.warning("group %s: %s; trying its next candidate host", group.name, e)
        self.host_of[group.name] = host
        self.pid[group.name] = int(got["pid"])
        if type(got.get("dir")) is str:  # (a daemon of an earlier version says none)
            self.run_dir_of[host] = got["dir"]
        self.ended.pop(group.name, None)  # a restart: the group lives again
        self.waiting.pop(group.name, None)
        if self._beat is not None:
            self.record_groups()  # a restart may have moved it
        log.info("group %s started on host %s (pid %d)", group.name, host, got["pid"])

    def record_groups(self) -> None:
        """A job's coordinator (``REACTOR_JOB_DIR`` set by its daemon) writes where each group runs
        into the job's directory, so ``reactor status`` and ``reactor logs JOB GROUP`` can find
        them; a run started by ``reactor run`` writes nothing."""
        jdir = os.environ.get("REACTOR_JOB_DIR")
        if not jdir:
            return
        groups = {g: {"host": h, "address": self.hosts[h].address,
                      "key": self.hosts[h].key.decode() if self.hosts[h].key else None,
                      **({"waiting": self.waiting[g]} if g in self.waiting else {})}
                  for g, h in self.host_of.items()}
        tmp = Path(jdir) / ".groups.json.tmp"
        tmp.write_text(json.dumps({"run": self.run_id, "groups": groups}))
        os.replace(tmp, Path(jdir) / "groups.json")

    def start_heartbeat(self) -> None:
        now = time.monotonic()
        for h in set(self.host_of.values()):
            self.last_ok.setdefault(h, now)
        self._beat = asyncio.ensure_future(self._heartbeat_forever())

    # -- watching

    async def _heartbeat_forever(self) -> None:
        while True:
            await asyncio.gather(*(self._beat_one(h) for h in sorted(set(self.host_of.values()))))
            await asyncio.sleep(HEARTBEAT_S)

    async def _beat_one(self, host: str) -> None:
        if host in self.lost_hosts:
            return
        from ._daemon import DaemonSilentError

        try:
            got = await self.links[host].request("workers", self.run_id, timeout_s=HEARTBEAT_S * 2)
        except DaemonSilentError as e:
            silent = time.monotonic() - self.last_ok[host]
            if silent > self.timeout_s:
                self.silent_hosts.add(host)
                self._lose(host, f"its daemon at {self.hosts[host].address} has not answered for {silent:.1f} s "
                                 f"({e.why})")
            return
        except DaemonError as e:  # it answers, but no longer knows the run (a restarted daemon)
            self._lose(host, str(e))
            return
        self.last_ok[host] = time.monotonic()
        for g, w in got.items():
            if (self.host_of.get(g) == host and g not in self.ended and w["returncode"] is not None
                    and w["pid"] == self.pid.get(g)):  # not a previous life's end
                rc, where = int(w["returncode"]), f"on host {host!r}"
                if rc in (1, 2):  # its traceback's or refusal's line is in its log there, which no one here sees
                    last = await self._last_line(host, g)
                    where += f"{LAST_LINE_SAID}{last})" if last else ""
                if g not in self.ended:
                    self.ended[g] = (rc, where)

    async def _last_line(self, host: str, group: str) -> str:
        """The last line a worker hosted on ``host`` wrote (``STATE/runs/RUN/GROUP.log`` there), cut at
        ``LAST_LINE_MAX`` characters; "" where its daemon does not give it within ``LAST_LINE_WAIT_S`` a
        request. (Asked in the heartbeat's round, which it holds meanwhile: once for a worker that failed, as
        the run ends or restarts it; 1 s lost the line on a loaded host.)"""
        link = self.links[host]
        try:
            end = (await link.request("worker_log", self.run_id, group, 2**63 - 1, timeout_s=LAST_LINE_WAIT_S))["offset"]
            got = await link.request("worker_log", self.run_id, group, max(0, int(end) - 4096),
                                     timeout_s=LAST_LINE_WAIT_S)
            lines = [line.strip() for line in bytes(got["data"]).decode(errors="replace").splitlines() if line.strip()]
        except (DaemonError, KeyError, TypeError, ValueError):  # (a silent daemon's error is a DaemonError)
            return ""
        if not lines:
            return ""
        return lines[-1] if len(lines[-1]) <= LAST_LINE_MAX else lines[-1][:LAST_LINE_MAX] + "..."

    def _lose(self, host: str, why: str) -> None:
        self.lost_hosts[host] = why
        for g, h in self.host_of.items():
            if h == host and g not in self.ended:
                self.ended[g] = (None, f"was lost with host {host!r}: {why}")
        log.warning("host %s is lost: %s", host, why)

    def dead(self) -> dict[str, tuple[int | None, str]]:
        """The groups whose workers have ended (exit status, or None for a lost host; and where)."""
        return dict(self.ended)

    def alive(self) -> list[str]:
        return [g for g in self.host_of if g not in self.ended]

    def kill(self, group: str) -> bool:
        """A daemon ends a run's workers together (``end``), not one: False, and the run's reaping ends it."""
        return False

    # -- ending

    async def reap(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the workers to exit; then every daemon of the run stops what
        is left of it (SIGTERM, SIGKILL after a grace) and removes its shared memory; wait for that."""
        loop = asyncio.get_running_loop()
        if self._beat is None and self.host_of:
            self.start_heartbeat()
        deadline = loop.time() + timeout_s
        while self.alive() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        hosts = sorted({h for h in self.host_of.values()} - set(self.lost_hosts))
        for h in hosts:
            with contextlib.suppress(DaemonError):
                await self.links[h].request("end", self.run_id, timeout_s=5.0)
        deadline = loop.time() + 15.0
        while self.alive() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = self.alive()
        if left:
            log.warning("workers %s did not confirm their end; their daemons kill them at the lease's end", left)

    async def fetch_run_files(self, dest: Path, max_nbytes: int = FETCH_MAX_NBYTES) -> None:
        """Copy what the workers wrote in their directories on the hosts (relative run
        directories: metrics, checkpoints, plots) into ``dest``, the coordinator's working
        directory, at the same relative paths: a run over hosts leaves its files where it was
        started from. An absolute ``run_dir`` (a shared file system) is written in place and copied
        by nobody. Lost hosts are skipped, and so is everything past ``max_nbytes``, each logged (a
        lost host with where its files stay). A host's listing is bounded (``_hosting.list_run_files``): what
        it leaves out is said, with where it stays; a file that cannot be read there is said and the others
        still come."""
        from ._daemonclient import DaemonSilentError

        total = files = 0
        for host in sorted(set(self.host_of.values()) & set(self.lost_hosts)):
            log.warning("did not copy the run's files from host %s, which is lost (%s): they stay there, in %s",
                        host, self.lost_hosts[host],
                        self.run_dir_of.get(host, f"its daemon's state directory, runs/{self.run_id}/"))
        for host in sorted(set(self.host_of.values()) - set(self.lost_hosts)):
            link = self.links[host]
            where = self.run_dir_of.get(host, f"its daemon's state directory, runs/{self.run_id}/")
            try:
                listing = await link.request("run_files", self.run_id, timeout_s=10.0)
            except DaemonError as e:
                log.warning("did not copy the run's files from host %s: %s", host, e)
                continue
            if listing["more"]:  # (the daemon lists RUN_FILES_MAX files at most, and so many bytes of paths)
                log.warning("host %s holds more of the run's files than one listing carries: the %d listed are copied, "
                            "the rest stay there, in %s", host, len(listing["files"]), where)
            if listing["unfetchable"]:
                log.warning("%d of the run's files on host %s have names that cannot be asked for (%s%s: a part "
                            "starting with '.', or a character past [A-Za-z0-9_.-]): they stay there, in %s",
                            listing["unfetchable"], host, ", ".join(listing["unfetchable_shown"]),
                            ", ..." if listing["unfetchable"] > len(listing["unfetchable_shown"]) else "", where)
            for f in listing["files"]:
                target = dest / f["path"]
                if target.resolve().parent != target.parent.resolve() or dest.resolve() not in target.resolve().parents:
                    log.warning("host %s offered %r, outside the run: skipped", host, f["path"])
                    continue
                if total + f["size"] > max_nbytes:
                    log.warning("the run's files on its hosts exceed %d bytes: %s and what follows stay on host %s "
                                "(give an absolute run_dir on a shared file system instead)", max_nbytes, f["path"], host)
                    return
                if target.exists() and Path(f["path"]).name != "run.json":  # (every host's names the same run)
                    log.warning("%s was written on more than one host; the copy from %s is kept", f["path"], host)
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.part")
                offset = 0
                try:
                    with open(tmp, "wb") as out:
                        while offset < f["size"]:
                            got = await link.request("run_file", self.run_id, f["path"], offset, timeout_s=30.0)
                            if not got["data"]:
                                break
                            if (why := chunk_problem(offset, got["data"], got["offset"])) is not None:
                                raise DaemonError(f"host {host!r} answered run_file: {why}")
                            out.write(got["data"])
                            offset = got["offset"]
                except DaemonError as e:  # (one file refused, removed meanwhile, say: the others still come)
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                    log.warning("did not copy %s from host %s: %s", f["path"], host, e)
                    if isinstance(e, DaemonSilentError):  # (the host went quiet: its other files would wait as long)
                        log.warning("did not copy the rest of the run's files from host %s: they stay there, in %s",
                                    host, where)
                        break
                    continue
                os.replace(tmp, target)
                total += offset
                files += 1
        if files:
            log.info("copied %d files (%.1f MB) of the run from its hosts into %s", files, total / 1e6, dest)

    async def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._beat
        self.links.close()
