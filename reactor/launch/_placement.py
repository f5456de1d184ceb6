"""Placement: which process runs which reactor instance. Data chosen at launch, never in the app.

* ``single``: every reactor in one process (``_runtime.drive_single``).
* ``processes``: one process per reactor instance, linked by ZeroMQ over ipc.
* a distribution policy (``actors``, ``colocated``, ``dp-learners``; see ``reactor/launch/_policies.py``);
* a TOML placement file naming groups::

      [groups.learner]
      reactors = ["learner", "replay*"]     # node names, instance names ("actor[1]") or fnmatch patterns

      [groups.actors]
      reactors = ["actor*"]
      bind = "tcp://127.0.0.1:*"            # optional: tcp (with CURVE) instead of local ipc
      restart = "on-failure"                # optional (async runs): start it again if it dies,
      max_restarts = 3                      #   at most this often in a row,
      backoff_s = 1.0                       #   after this wait, doubled each time
      host_wait_s = 300.0                   #   over hosts: how long to wait for a candidate host
      reset_after_s = 600.0                 #   a life this long starts the count again (inf: never)

      [restart]                             # optional: the defaults of every group's policy
      restart = "never"

  Every reactor instance must fall in exactly one group. A file with ``[hosts]`` (daemon
  addresses) places its groups on those hosts (``host = "NAME"`` or a list of candidates per group;
  see ``reactor/launch/_cluster.py``); so does a distribution policy given a hosts file.
"""

from __future__ import annotations

import fnmatch
import re
import socket
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._errors import GraphError
from .._files import check_ipc_bind
from .._graph import Graph
from ._cluster import Host, assign_hosts, check_top_tables, cluster_settings, load_hosts_file, parse_hosts
from ._groups import NEVER_RESTART, RESTART_FIELDS, Group, Restart, group_name, parse_restart
from ._policies import POLICIES

_GROUP_RE = re.compile(r"^[A-Za-z0-9_\-\[\]]{1,64}\Z")  # (its socket's path: at most 107 bytes)


@dataclass
class Placement:
    """What a placement resolves to: its process groups and, for a run over several hosts, the
    hosts (daemons) they go to and the ``[cluster]`` settings."""

    groups: list[Group]
    hosts: dict[str, Host] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)


def resolve(graph: Graph, placement: str, hosts: str | None = None) -> list[Group]:
    """The process groups ``placement`` asks for (see :func:`resolve_placement`)."""
    return resolve_placement(graph, placement, hosts).groups


def resolve_placement(graph: Graph, placement: str, hosts: str | None = None,
                      restart: Restart | None = None) -> Placement:
    """The process groups ``placement`` asks for, on the hosts it (or the ``hosts`` file) names.

    ``restart`` (``reactor run --restart``) replaces every group's restart policy; otherwise a
    group's own fields apply over its file's ``[restart]`` table (a placement file's, or the hosts
    file's for a distribution policy), over ``restart = "never"``.

    Raises:
        GraphError: unknown placement, unreadable file, a pattern that matches nothing, a reactor
            placed twice or not at all, a malformed ``[hosts]`` or restart policy, a group naming
            an unknown host, or replicas that need a process each sharing one (:func:`check_replicas_apart`).
    """
    plan = _resolve(graph, placement, hosts)
    check_replicas_apart(graph, {n: g.name for g in plan.groups for n in g.reactors}, placement)
    if restart is not None:
        plan.groups = [replace(g, restart=restart) for g in plan.groups]
    return plan


def check_hosts_named(placement: str, hosts: str | None = None) -> None:
    """What :func:`resolve_placement` refuses of the hosts a placement names, checked without the graph
    (``reactor submit`` checks it before a job leaves, where the app may not import): the hosts file
    parses; a placement file's groups name only hosts its ``[hosts]`` (or ``hosts``) lists, and it does
    not have both. The errors are :func:`resolve_placement`'s.

    Raises:
        GraphError: a file that does not parse, a malformed ``[hosts]``, a group naming a host the
            hosts lack (or hosts where there are none), ``[hosts]`` and a hosts file both.
    """
    table = load_hosts_file(hosts, read_keys=False)[0] if hosts is not None else None  # (keys: the daemon's host's)
    if placement in POLICIES or placement in ("single", "processes") or not Path(placement).is_file():
        return
    data = _read_toml(placement, "placement file")
    where = f"placement file {placement}"
    if "hosts" in data:
        if hosts is not None:
            raise GraphError(f"{where} has its own [hosts]: give either it or --hosts {hosts}, not both")
        table = parse_hosts(data["hosts"], where, Path(placement).parent, read_keys=False)
    groups_raw = data.get("groups")
    for gname, spec in (groups_raw.items() if isinstance(groups_raw, dict) else ()):
        host = spec.get("host", []) if isinstance(spec, dict) else []
        host = [host] if isinstance(host, str) else host
        if not isinstance(host, list) or not host:
            continue  # (a malformed one is refused where the graph is built, with the group's other fields)
        if table is None:
            raise GraphError(f"{where}: group {gname!r} names a host, but there is no [hosts] table "
                             f"(or --hosts file) saying where the hosts' daemons are")
        assign_hosts([Group(gname, (), None, tuple(str(h) for h in host))], table, where, spread=False)


def restarting_in_files(placement: str, hosts: str | None = None) -> str | None:
    """Where the placement's files give a group a policy that restarts (``restart = "on-failure"``),
    or None: a placement file's group or its ``[restart]`` table; for ``processes`` or a distribution
    policy, the hosts file's ``[restart]``. Read without the graph (``reactor submit`` asks before a
    job leaves). ``run`` refuses such a file in a run that cannot restart (:func:`check_settings`).

    Raises:
        GraphError: a file that does not parse, or a malformed restart field (as :func:`resolve_placement`).
    """
    if placement in POLICIES or placement == "processes":
        if hosts is None:
            return None
        where = f"hosts file {hosts}"
        return f"{where}: [restart]" if _restart_defaults(_read_toml(hosts, "hosts file"), where).policy == \
            "on-failure" else None
    if placement == "single" or not Path(placement).is_file():
        return None
    where = f"placement file {placement}"
    data = _read_toml(placement, "placement file")
    defaults = _restart_defaults(data, where)
    groups_raw = data.get("groups")
    for gname, spec in (groups_raw.items() if isinstance(groups_raw, dict) else ()):
        if isinstance(spec, dict) and parse_restart(spec, f"{where}: group {gname!r}", defaults).policy == "on-failure":
            return f"{where}: group {gname!r}" if "restart" in spec else f"{where}: [restart]"
    return None


def _resolve(graph: Graph, placement: str, hosts: str | None) -> Placement:
    if placement in POLICIES or placement == "processes":
        groups = _groups(graph, placement)
        if hosts is None:
            return Placement(groups)
        table, settings = load_hosts_file(hosts)
        defaults = _restart_defaults(_read_toml(hosts, "hosts file"), f"hosts file {hosts}")
        groups = [replace(g, restart=defaults) for g in groups]
        return Placement(assign_hosts(groups, table, f"hosts file {hosts}", spread=True), table, settings)
    groups = _groups(graph, placement)
    data = tomllib.loads(Path(placement).read_text())  # _groups read it already
    where = f"placement file {placement}"
    if hosts is not None:
        if "hosts" in data:
            raise GraphError(f"{where} has its own [hosts]: give either it or --hosts {hosts}, not both")
        table, settings = load_hosts_file(hosts)
    elif "hosts" in data:
        table = parse_hosts(data["hosts"], where, Path(placement).parent)
        settings = cluster_settings(data, where)
    else:
        named = [g.name for g in groups if g.hosts]
        if named:
            raise GraphError(f"{where}: group {named[0]!r} names a host, but there is no [hosts] table "
                             f"(or --hosts file) saying where the hosts' daemons are")
        return Placement(groups)
    return Placement(assign_hosts(groups, table, where, spread=False), table, settings)


def _groups(graph: Graph, placement: str) -> list[Group]:
    instances = [name for _, _, name in graph.instances()]
    if placement == "processes":
        return [Group(group_name(n), (n,)) for n in instances]
    if placement in POLICIES:
        return [g for g in POLICIES[placement](graph) if g.reactors]
    path = Path(placement)
    if not path.is_file():
        raise GraphError(
            f"unknown placement {placement!r}: use 'single', 'processes', a distribution policy "
            f"({', '.join(sorted(POLICIES))}) or the path of a placement file"
        )
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:  # (not UTF-8: the codec's words alone)
        raise GraphError(f"placement file {placement}: {e}") from e
    check_top_tables(data, "placement file", f"placement file {placement}")
    defaults = _restart_defaults(data, f"placement file {placement}")
    groups_raw = data.get("groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise GraphError(f"placement file {placement} has no [groups.NAME] tables")
    node_of = {name: node.name for node, _, name in graph.instances()}
    owner: dict[str, str] = {}
    binds: dict[str, str] = {}
    groups = []
    for gname, spec in groups_raw.items():
        if not _GROUP_RE.match(gname):
            raise GraphError(f"placement file {placement}: group name {gname!r:.100} must be 1 to 64 letters, digits, "
                             f"'_', '-', '[' or ']'")
        pats = spec.get("reactors") if isinstance(spec, dict) else None
        if not isinstance(pats, list) or not all(isinstance(p, str) for p in pats):
            raise GraphError(f"placement file {placement}: group {gname!r} needs reactors = [\"name\", ...]")
        bind = spec.get("bind")
        if bind is not None and not (isinstance(bind, str) and bind.startswith(("tcp://", "ipc://"))):
            raise GraphError(f"placement file {placement}: group {gname!r} bind must be a tcp:// or ipc:// address")
        if bind is not None:
            try:
                check_ipc_bind(bind)
            except FileExistsError as e:
                raise GraphError(f"placement file {placement}: group {gname!r}: {e}") from None
            if why := tcp_bind_error(bind):
                raise GraphError(f"placement file {placement}: group {gname!r} bind {bind!r}: {why}")
            if bind in binds and not _any_port(bind):
                raise GraphError(f"placement file {placement}: groups {binds[bind]!r} and {gname!r} both bind {bind!r}: "
                                 f"one process per address (a port of its own each, or tcp://HOST:*)")
            binds[bind] = gname
        unknown = set(spec) - {"reactors", "bind", "host", *RESTART_FIELDS}
        if unknown:
            raise GraphError(f"placement file {placement}: group {gname!r} has unknown fields {sorted(unknown)} "
                             f"(reactors, bind, host, {', '.join(RESTART_FIELDS)})")
        restart = parse_restart(spec, f"placement file {placement}: group {gname!r}", defaults)
        host = spec.get("host", [])
        host = [host] if isinstance(host, str) else host
        if not isinstance(host, list) or not all(isinstance(h, str) for h in host):
            raise GraphError(f"placement file {placement}: group {gname!r} host must be a host name or a list of them")
        if host and bind is not None:
            raise GraphError(f"placement file {placement}: group {gname!r} has both host and bind: on a host, "
                             f"its daemon picks the address")
        members = []
        for pat in pats:
            # (An instance's own name first: "actor[0]" as a pattern is "actor0", its brackets a class.)
            hit = [n for n in instances if pat in (n, node_of[n])] or \
                  [n for n in instances if fnmatch.fnmatchcase(n, pat) or fnmatch.fnmatchcase(node_of[n], pat)]
            if not hit:
                raise GraphError(f"placement file {placement}: pattern {pat!r} of group {gname!r} matches no reactor")
            for n in hit:
                if n in owner and owner[n] != gname:
                    raise GraphError(f"placement file {placement}: reactor {n!r} is in groups {owner[n]!r} and {gname!r}")
                if n not in owner:
                    owner[n] = gname
                    members.append(n)
        groups.append(Group(gname, tuple(members), bind, tuple(host), restart))
    missing = [n for n in instances if n not in owner]
    if missing:
        raise GraphError(f"placement file {placement}: no group holds {', '.join(missing)}")
    return [g for g in groups if g.reactors]


def check_replicas_apart(graph: Graph, owner: dict[str, str], placement: str) -> None:
    """Refuse a placement that puts two replicas of a bank whose reactor has ``replicas_apart`` (each
    needs a process of its own: data-parallel learners) in one process. ``owner``: instance -> its
    process (group). Without this check such a run starts and waits, silently for minutes, for a
    replica that its own process cannot start (the first holds the loop in its rendezvous).

    Raises:
        GraphError: naming the bank, the two replicas, their process and the placement to use.
    """
    for node in graph.nodes.values():
        why = node.reactor_type.replicas_apart
        if why is None or node.replicas < 2:
            continue
        seen: dict[str, str] = {}
        for name in node.instance_names():
            group = owner.get(name)
            if group is None:
                continue
            if group in seen:
                raise GraphError(
                    f"{node.name}: its {node.replicas} replicas each need a process of their own ({why}), but "
                    f"placement {placement!r} puts {seen[group]} and {name} in process {group!r}: use --placement "
                    f"dp-learners (in Python, run(graph, placement='dp-learners')), or a placement file with each "
                    f"replica in a group of its own ({node.site})"
                )
            seen[group] = name


def _read_toml(path: str, what: str) -> dict[str, Any]:
    """A hosts or placement file (``what``), parsed, its top-level tables checked."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise GraphError(f"{what} {path}: {e}") from e
    check_top_tables(data, what, f"{what} {path}")
    return data


def _any_port(bind: str) -> bool:
    """Whether a tcp ``bind`` takes any free port (``*`` or 0): groups may share such an address."""
    port = bind.rpartition(":")[2]
    return bind.startswith("tcp://") and (port == "*" or (port.isdigit() and int(port) == 0))


def tcp_bind_error(bind: str, here: bool = False) -> str | None:
    """Why a group's ``bind = "tcp://HOST:PORT"`` cannot be bound, or None (an ipc address: None). A port
    past 65535, or an address of another host, was taken, and the group's worker died at its bind with a
    traceback, the run failing as "worker 'G' exited with status 1". ``PORT`` is ``*`` or 0..65535 (0: any);
    ``HOST`` is no IPv6 address (the run's sockets are IPv4 only); with ``here`` (the run's coordinator, whose
    host the workers bind on: not ``reactor submit --check``, whose job runs on its daemon's), ``HOST`` is
    ``*``, an interface's name or an IPv4 address of this host.
    (A port another program holds is said by the worker when it binds.)"""
    if not bind.startswith("tcp://"):
        return None
    host, sep, port = bind[len("tcp://"):].rpartition(":")
    if not sep or not host:
        return "a tcp://HOST:PORT address expected"
    if port != "*" and not (port.isdigit() and int(port) < 65536):
        return f"port {port!r} is not a port (1..65535, or * or 0 for any free one)"
    if host.startswith("["):  # (zmq's sockets here are IPv4 only: it failed at the worker's bind, "No such device")
        return "an IPv6 address: a run's sockets take an IPv4 one, an interface's name or *"
    if not here or host == "*" or host in {name for _, name in socket.if_nameindex()}:
        return None
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, family=socket.AF_INET, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(sockaddr[:1] + (0,) + tuple(sockaddr[2:]))
    except (socket.gaierror, UnicodeError) as e:
        return f"{host!r} does not resolve here ({getattr(e, 'strerror', None) or e})"
    except OSError as e:
        return f"{host!r} is not an address of this host ({e.strerror or e})"
    return None


def _restart_defaults(data: dict[str, Any], where: str) -> Restart:
    """A file's ``[restart]`` table: the restart policy of its groups that set none."""
    raw = data.get("restart", {})
    if not isinstance(raw, dict) or set(raw) - set(RESTART_FIELDS):
        raise GraphError(f"{where}: [restart] takes {', '.join(RESTART_FIELDS)} only")
    return parse_restart(raw, f"{where}: [restart]", NEVER_RESTART)


def check_lookahead(graph: Graph, groups: list[Group], placement: str) -> None:
    """Deterministic mode across processes: every cycle between processes needs a link with a delay.

    A process may run tag t only once its upstream processes promised nothing earlier will come;
    around a cycle of zero-delay links between processes each waits for the other's promise, and
    none can advance (conservative synchronization has no lookahead there).

    Raises:
        GraphError: naming the processes and the zero-delay links of one such cycle.
    """
    owner = {n: g.name for g in groups for n in g.reactors}
    edges: dict[str, dict[str, str]] = {}
    for lk in graph.links():
        a, b = owner[lk.src], owner[lk.dst]
        if a != b and lk.delay_ns == 0:
            edges.setdefault(a, {}).setdefault(b, f"{lk.src}.{lk.src_port} -> {lk.dst}.{lk.dst_port}")
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges.get(v, {})):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state and (cycle := visit(w)) is not None:
                return cycle
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (cycle := visit(v)) is not None:
            hops = "; ".join(edges[a][b] for a, b in zip(cycle, cycle[1:]))
            raise GraphError(
                f"placement {placement!r}: processes {' -> '.join(cycle)} form a cycle of zero-delay links "
                f"({hops}); deterministic mode cannot advance around it. Give one of these connections "
                f"delay_s > 0, place those reactors in one process, or run with --async"
            )
