"""What a run reports when it ends (single-process and multi-process runs alike)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["RunResult"]


@dataclass(frozen=True)
class RunResult:
    """What a run reports when it ends.

    Attributes:
        digests: per reactor instance, a sha256 of every message it received (with ``digest=True``).
        events: per reactor instance, how many events it handled.
        placement: the placement the run used.
        stopped_by: ``"stop_time"``, ``"quiescence"``, ``"request"``, ``"signal"`` or ``"replay"``.
        processes: multi-process runs: per worker process, flow statistics (``peak_inbox``,
            ``peak_backlog``: the most messages queued in and out; ``peak_rss_bytes``; ``sent``,
            ``received``: messages to and from other processes; deterministic mode: ``rounds`` of
            work, ``promises`` sent, ``waits`` for peers, ``coarse_promises`` computed from the
            earliest of a long queue) and, from the start of the run, ``cpu_ms`` (all threads) and
            ``voluntary_switches`` / ``involuntary_switches``. ``reactor run --json`` prints them.
        dropped: multi-process runs: per process (the workers and ``coordinator``), the messages
            from peers it dropped (undecodable, too large, over credit, from an unknown sender, or
            refused by the protocol's schemas: reactor/launch/_protocol.py). A correct run drops none.
        hosts: runs over hosts: per worker process, the host (daemon) it ran on (its last).
        restarts: async runs with restart policies: per worker process started again, each end it
            had, in order (how it ended, and where). Messages its peers dropped while it was down
            are in ``processes[...]['dropped_to_lost']``.
    """

    digests: Mapping[str, str] = field(default_factory=dict)
    events: Mapping[str, int] = field(default_factory=dict)
    placement: str = "single"
    stopped_by: str = "quiescence"
    processes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    dropped: Mapping[str, int] = field(default_factory=dict)
    hosts: Mapping[str, str] = field(default_factory=dict)
    restarts: Mapping[str, list[str]] = field(default_factory=dict)
