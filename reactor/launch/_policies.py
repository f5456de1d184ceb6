"""Distribution policies: named placement presets for RL graphs (the MSRL idea).

A policy maps the reactor instances of any graph to processes by each reactor class's
``placement_role`` (``"actor"``, ``"replay"``, ``"learner"``; None for everything else). The app is
the same under every policy; only where each instance runs changes.

* ``actors``: one process for the learner(s) and every role-less reactor (evaluator, metrics),
  one per actor instance, one per replay shard.
* ``colocated``: actor ``i`` shares a process with replay shard ``i`` (the shard is local to the
  actor that fills it); leftover actors or shards get their own processes.
* ``dp-learners``: like ``actors``, but every learner replica gets its own process (data-parallel
  learners all-reduce their gradients through ``torch.distributed``).
"""

from __future__ import annotations

from collections.abc import Callable

from .._graph import Graph
from ._groups import Group, group_name

POLICIES: dict[str, Callable[[Graph], list[Group]]] = {}


def _roles(graph: Graph) -> dict[str, list[str]]:
    by: dict[str, list[str]] = {"actor": [], "replay": [], "learner": [], "other": []}
    for node, _, name in graph.instances():
        role = getattr(node.reactor_type, "placement_role", None)
        by[role if role in by else "other"].append(name)
    return by


def _policy(name: str) -> Callable[[Callable[[Graph], list[Group]]], Callable[[Graph], list[Group]]]:
    def register(fn: Callable[[Graph], list[Group]]) -> Callable[[Graph], list[Group]]:
        POLICIES[name] = fn
        return fn

    return register


def _own(names: list[str]) -> list[Group]:
    return [Group(group_name(n), (n,)) for n in names]


@_policy("actors")
def _actors(graph: Graph) -> list[Group]:
    r = _roles(graph)
    head = tuple(r["learner"] + r["other"])
    return ([Group("learner", head)] if head else []) + _own(r["actor"]) + _own(r["replay"])


@_policy("colocated")
def _colocated(graph: Graph) -> list[Group]:
    r = _roles(graph)
    head = tuple(r["learner"] + r["other"])
    groups = [Group("learner", head)] if head else []
    actors, shards = r["actor"], r["replay"]
    for i in range(max(len(actors), len(shards))):
        members = tuple(x[i] for x in (actors, shards) if i < len(x))
        groups.append(Group(group_name(members[0]), members))
    return groups


@_policy("dp-learners")
def _dp_learners(graph: Graph) -> list[Group]:
    r = _roles(graph)
    groups = _own(r["learner"])
    if r["other"]:
        groups.append(Group("driver", tuple(r["other"])))
    return groups + _own(r["actor"]) + _own(r["replay"])
