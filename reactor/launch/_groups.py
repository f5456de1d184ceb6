"""Process groups: what a placement resolves to (one group, one process). Shared by the placement
parser and the distribution policies, so neither imports the other's module for it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Group", "group_name"]


@dataclass(frozen=True)
class Group:
    """One process of a multi-process run."""

    name: str
    reactors: tuple[str, ...]
    bind: str | None = None  # None: ipc in a private directory
    hosts: tuple[str, ...] = ()  # candidate hosts (a placement's [hosts] names), in order; () local


def group_name(instance: str) -> str:
    """A process group name for one reactor instance (``actor[3]`` -> ``actor-3``)."""
    return instance.replace("[", "-").replace("]", "")
