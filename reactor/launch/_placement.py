"""Placement: which process runs which reactor instance. Data chosen at launch, never in the app.

* ``single``: every reactor in one process (``_runtime.drive_single``).
* ``processes``: one process per reactor instance, linked by ZeroMQ over ipc.
* a distribution policy (``actors``, ``colocated``, ``dp-learners``; see ``reactor/launch/_policies.py``);
* a TOML placement file naming groups::

      [groups.learner]
      reactors = ["learner", "replay*"]     # node names, instance names or fnmatch patterns

      [groups.actors]
      reactors = ["actor*"]
      bind = "tcp://127.0.0.1:*"            # optional: tcp (with CURVE) instead of local ipc

  Every reactor instance must fall in exactly one group.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

from .._errors import GraphError
from .._graph import Graph
from ._groups import Group, group_name
from ._policies import POLICIES

_GROUP_RE = re.compile(r"^[A-Za-z0-9_\-\[\]]+$")


def resolve(graph: Graph, placement: str) -> list[Group]:
    """The process groups ``placement`` asks for.

    Raises:
        GraphError: unknown placement, unreadable file, a pattern that matches nothing, or a reactor
            placed twice or not at all.
    """
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
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise GraphError(f"placement file {placement}: {e}") from e
    groups_raw = data.get("groups")
    if not isinstance(groups_raw, dict) or not groups_raw:
        raise GraphError(f"placement file {placement} has no [groups.NAME] tables")
    node_of = {name: node.name for node, _, name in graph.instances()}
    owner: dict[str, str] = {}
    groups = []
    for gname, spec in groups_raw.items():
        if not _GROUP_RE.match(gname):
            raise GraphError(f"placement file {placement}: group name {gname!r} must match {_GROUP_RE.pattern}")
        pats = spec.get("reactors") if isinstance(spec, dict) else None
        if not isinstance(pats, list) or not all(isinstance(p, str) for p in pats):
            raise GraphError(f"placement file {placement}: group {gname!r} needs reactors = [\"name\", ...]")
        bind = spec.get("bind")
        if bind is not None and not (isinstance(bind, str) and bind.startswith(("tcp://", "ipc://"))):
            raise GraphError(f"placement file {placement}: group {gname!r} bind must be a tcp:// or ipc:// address")
        members = []
        for pat in pats:
            hit = [n for n in instances if fnmatch.fnmatchcase(n, pat) or fnmatch.fnmatchcase(node_of[n], pat)]
            if not hit:
                raise GraphError(f"placement file {placement}: pattern {pat!r} of group {gname!r} matches no reactor")
            for n in hit:
                if n in owner and owner[n] != gname:
                    raise GraphError(f"placement file {placement}: reactor {n!r} is in groups {owner[n]!r} and {gname!r}")
                if n not in owner:
                    owner[n] = gname
                    members.append(n)
        groups.append(Group(gname, tuple(members), bind))
    missing = [n for n in instances if n not in owner]
    if missing:
        raise GraphError(f"placement file {placement}: no group holds {', '.join(missing)}")
    return [g for g in groups if g.reactors]


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
