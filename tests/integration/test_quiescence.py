"""The coordinator's quiescence protocol (counting + probe), decision by decision.

Regression: messages that moved between a probe and its answers left the sums equal but different
from the probed snapshot; the coordinator kept that stale snapshot and never probed again, so an
async multi-process run that had gone quiet never ended (seen as a hung test in
tests/nodes/test_replay_bulk.py). The race is hard to provoke with real processes, so this drives
the decision logic with the status reports workers send; the endpoint only records the probes.
"""

from __future__ import annotations

import asyncio

from reactor.launch._coordinator import _Session


class _Probes:
    def __init__(self) -> None:
        self.sent: list[tuple[str, tuple]] = []

    def send_nowait(self, peer: str, msg: tuple) -> None:
        self.sent.append((peer, msg))


def _session() -> tuple[_Session, _Probes]:
    probes = _Probes()
    return _Session(probes, None, ["a", "b"], asyncio.Event()), probes  # type: ignore[arg-type]


def test_quiet_and_balanced_workers_are_probed_then_the_run_is_quiescent():
    s, probes = _session()
    s.status = {"a": (0, True, 5, 3), "b": (0, True, 3, 5)}
    assert not s._quiescent()  # first: probe
    assert [m for _, m in probes.sent] == [("probe", 1), ("probe", 1)]
    s.status = {"a": (1, True, 5, 3), "b": (1, True, 3, 5)}  # both answered, nothing moved
    assert s._quiescent()


def test_messages_moved_between_probe_and_answers_lead_to_a_new_probe_not_a_hang():
    s, probes = _session()
    s.status = {"a": (0, True, 5, 3), "b": (0, True, 3, 5)}
    assert not s._quiescent()
    # A message in flight at the probe was delivered and answered: sums equal, but not the snapshot.
    s.status = {"a": (1, True, 6, 4), "b": (1, True, 4, 6)}
    assert not s._quiescent()
    assert not s._quiescent()  # the new probe goes out (epoch 2) ...
    assert ("probe", 2) in [m for _, m in probes.sent]
    s.status = {"a": (2, True, 6, 4), "b": (2, True, 4, 6)}
    assert s._quiescent()  # ... and its answers end the run


def test_a_busy_worker_or_a_message_in_flight_is_not_quiescent():
    s, probes = _session()
    s.status = {"a": (0, False, 5, 3), "b": (0, True, 3, 5)}
    assert not s._quiescent() and not probes.sent
    s.status = {"a": (0, True, 6, 3), "b": (0, True, 3, 5)}  # sent 9, received 8
    assert not s._quiescent() and not probes.sent
