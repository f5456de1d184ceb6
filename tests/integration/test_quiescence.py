"""The coordinator's quiescence protocol (counting + probe), decision by decision.

Regression: messages that moved between a probe and its answers left the sums equal but different
from the probed snapshot; the coordinator kept that stale snapshot and never probed again, so an
async multi-process run that had gone quiet never ended (seen as a hung test in
tests/nodes/test_replay_bulk.py). The race is hard to provoke with real processes, so this drives
the decision logic with the status reports workers send; the endpoint only records the probes.
"""

from __future__ import annotations

import asyncio
import time

from reactor.launch._session import _Session


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
    # The new probe goes out at once (epoch 2): the workers said they are idle and may say nothing more,
    # and the next look came with the coordinator's next batch, up to 0.2 s later (3 of 8 ping-pong runs
    # of two processes stopped 0.2 s after their last reaction, the others within 20 ms) ...
    assert [m for _, m in probes.sent[2:]] == [("probe", 2), ("probe", 2)]
    s.status = {"a": (2, True, 6, 4), "b": (2, True, 4, 6)}
    assert s._quiescent()  # ... and its answers end the run


def test_a_busy_worker_or_a_message_in_flight_is_not_quiescent():
    s, probes = _session()
    s.status = {"a": (0, False, 5, 3), "b": (0, True, 3, 5)}
    assert not s._quiescent() and not probes.sent
    s.status = {"a": (0, True, 6, 3), "b": (0, True, 3, 5)}  # sent 9, received 8
    assert not s._quiescent() and not probes.sent


def _after_a_restart(lost_quiet_s: float, quiet_probe_s: float = 0.0) -> tuple[_Session, _Probes]:
    s, probes = _session()
    s.restarts.lives["b"] = 1  # b was started again
    s.lost_quiet_s, s.quiet_probe_s = lost_quiet_s, quiet_probe_s
    return s, probes


def _answer(s: _Session, a: tuple[int, int], b: tuple[int, int], idle: bool = True) -> None:
    s.status = {"a": (s.epoch, idle, *a), "b": (s.epoch, True, *b)}


def test_after_a_restart_one_quiet_probe_round_is_not_quiescence_a_reply_in_flight_then_arrives():
    """Regression: after a restart the sums no longer meet, so they cannot show a message in flight.
    One probe round that found everyone idle ended a loaded run whose learner was waiting for a
    sample reply still in flight (seen: the Ray restart test under two test processes)."""
    s, probes = _after_a_restart(lost_quiet_s=60.0)
    _answer(s, (5, 3), (3, 9))  # sent 8, received 12: four came from b's first life
    assert not s._quiescent()  # probe
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()  # the round found everyone quiet: not enough, probe again
    assert not s._quiescent()
    assert ("probe", 2) in [m for _, m in probes.sent]
    _answer(s, (5, 4), (4, 9))  # the reply b sent meanwhile was received: the counts moved
    assert not s._quiescent()
    assert not s._quiescent()  # probe 3
    _answer(s, (5, 4), (4, 9))
    assert not s._quiescent()  # quiet again, with other sums: the quiet starts over from here
    assert s.quiet_since is not None and s.quiet_since[1] == (9, 13)


def test_after_a_restart_the_same_quiet_over_lost_quiet_s_of_probe_rounds_is_quiescence():
    s, probes = _after_a_restart(lost_quiet_s=0.2)
    start = time.monotonic()
    deadline = start + 5.0
    while time.monotonic() < deadline:
        _answer(s, (5, 3), (3, 9))
        if s._quiescent():
            break
        time.sleep(0.02)
    else:
        raise AssertionError("never quiescent")
    assert time.monotonic() - start >= 0.2  # not at the first quiet round: after 0.2 s of them
    assert len(probes.sent) >= 2 * 2  # (two workers, two rounds at least)


def test_after_a_restart_a_busy_worker_starts_the_quiet_over():
    s, probes = _after_a_restart(lost_quiet_s=0.15)
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()
    first = s.quiet_since
    assert first is not None
    time.sleep(0.1)
    _answer(s, (5, 3), (3, 9), idle=False)  # a worked (a timer), sending nothing
    assert not s._quiescent() and s.quiet_since is None
    time.sleep(0.1)  # past the first quiet's 0.15 s, not past a new one
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()
    assert s.quiet_since is not None and s.quiet_since[0] > first[0]


def test_a_restart_under_way_starts_the_quiet_over():
    s, probes = _after_a_restart(lost_quiet_s=60.0)
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent() and s.quiet_since is not None
    s.restarts.due["b"] = 0.0  # b died again: its restart is pending
    assert not s._quiescent() and s.quiet_since is None


def test_the_quiet_after_a_restart_is_probed_at_most_every_quiet_probe_s():
    s, probes = _after_a_restart(lost_quiet_s=60.0, quiet_probe_s=30.0)
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()  # probe 1
    _answer(s, (5, 3), (3, 9))
    assert not s._quiescent()  # quiet: the next round in 30 s
    assert s.next_probe_at - time.monotonic() > 25.0
    for _ in range(20):
        assert not s._quiescent()
    assert [m for _, m in probes.sent] == [("probe", 1)] * 2
    s.next_probe_at = time.monotonic()  # (as if the 30 s had passed)
    assert not s._quiescent()
    assert [m for _, m in probes.sent][-2:] == [("probe", 2)] * 2


def test_after_a_restart_equal_sums_are_no_proof_either():
    """The sums meet again after a restart (``Worker._forget``), but a dead life's message read after its
    new life linked can offset one in flight: equal sums after a restart need the same quiet over
    lost_quiet_s as unequal ones."""
    s, probes = _after_a_restart(lost_quiet_s=60.0)
    _answer(s, (5, 3), (3, 5))  # sent 8, received 8
    assert not s._quiescent()  # probe
    _answer(s, (5, 3), (3, 5))
    assert not s._quiescent() and s.quiet_since is not None
