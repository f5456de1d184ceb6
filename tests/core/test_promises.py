"""Promises across processes read from the reactions' declared effects (deterministic mode)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from reactor import ReactorError, run
from reactor._app import build_graph
from reactor._scheduler import _PROMISE_SCAN_MAX, ACTION, INPUT, STARTUP, TIMER, ReactorHost
from reactor._tag import NEVER, Tag

APP = str(Path(__file__).resolve().parents[1] / "apps" / "sample_loop.py")
MIX = str(Path(__file__).resolve().parents[1] / "apps" / "promise_mix.py")
OWNERS = {"producer[0]": "p0", "producer[1]": "p1", "server": "s", "client": "c"}
MIX_OWNERS = {"head": "h", "relay": "r", "tail": "t"}


class _Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Tag]] = []

    def send_message(self, process: str, link: int, seq: int, tag: Tag, value: Any) -> None:
        self.sent.append((process, link, tag))


def _host(local: str) -> ReactorHost:
    return ReactorHost(build_graph(APP, {}), [local], OWNERS, remote=_Sink(), process=OWNERS[local])


def _mix_host(local: str) -> ReactorHost:
    return ReactorHost(build_graph(MIX, {}), [local], MIX_OWNERS, remote=_Sink(), process=MIX_OWNERS[local])


def test_a_pending_update_holds_the_server_back_only_by_the_updates_delay():
    h = _host("client")
    h.horizons["s"] = Tag(3000, 0)
    # Nothing pending: the next request follows the next reply (>= 3000) through the 500 ns link.
    assert h.promises(["s"]) == {"s": Tag(3500, 0)}
    # The update action pending at (1000, 1) can only send on the 1000 ns updates link...
    h._push("client", Tag(1000, 1), ACTION, 0, 0, ("due", 7))
    assert h.promises(["s"]) == {"s": Tag(2000, 0)}
    # ... where the bound from the earliest event alone would be (1000, 1) + 500 ns.
    assert h.lower_bound().delayed(500) == Tag(1500, 0)
    # A reply pending at (1000, 0) can send a request through the 500 ns link.
    h._push("client", Tag(1000, 0), INPUT, 4, 0, ("replies", 1))
    assert h.promises(["s"]) == {"s": Tag(1500, 0)}


def test_inputs_without_effects_do_not_hold_back_the_server_promise():
    h = _host("server")
    h.horizons.update({"c": Tag(100, 0), "p0": Tag(5000, 0), "p1": Tag(5000, 0)})
    # Only a request from the client can make a reply: its horizon + the 500 ns replies link.
    assert h.promises(["c"]) == {"c": Tag(600, 0)}
    # An update (no effects) or an item (no effects) pending earlier changes nothing.
    h._push("server", Tag(50, 0), INPUT, 1, 0, ("updates", 3))
    h._push("server", Tag(60, 0), INPUT, 2, 0, ("items", 3))
    assert h.promises(["c"]) == {"c": Tag(600, 0)}
    # A pending request does.
    h._push("server", Tag(70, 1), INPUT, 0, 0, ("requests", 3))
    assert h.promises(["c"]) == {"c": Tag(570, 0)}


def test_a_process_that_can_never_send_again_promises_never():
    h = _host("server")
    h.horizons.update({"c": NEVER, "p0": Tag(10, 0), "p1": Tag(10, 0)})
    assert h.promises(["c"]) == {"c": NEVER}  # items cannot make replies; the client is done


def test_a_message_behind_its_senders_promise_is_refused_loudly():
    h = _host("client")
    h.advance_horizon("s", Tag(2000, 0))
    with pytest.raises(ReactorError, match="after promising nothing before"):
        h.deliver_remote(4, 0, Tag(1500, 0), 1)


def test_an_action_with_a_min_delay_counts_on_the_path_to_a_peer():
    h = _mix_host("head")
    h.horizons["t"] = NEVER
    # back -> got -> later (min_delay 300 ns) -> fire -> far (100 ns link) -> tail
    h._push("head", Tag(1000, 0), INPUT, 0, 0, ("back", 3))
    assert h.promises(["r", "t"]) == {"r": NEVER, "t": Tag(1400, 0)}
    # the timer: step -> out (zero delay) -> relay; step -> later -> fire -> far -> tail
    h._push("head", Tag(2000, 0), TIMER, 0, 0, type(h.reactors["head"]).tick)
    assert h.promises(["r", "t"]) == {"r": Tag(2000, 1), "t": Tag(1400, 0)}
    # startup sends on both ports at once
    h._push("head", Tag(0, 0), STARTUP, 0, 0, None)
    assert h.promises(["r", "t"]) == {"r": Tag(0, 1), "t": Tag(100, 0)}


def test_a_zero_delay_chain_adds_a_microstep_per_link():
    h = _mix_host("relay")
    h.horizons.update({"h": NEVER, "t": NEVER})
    h._push("relay", Tag(500, 2), INPUT, 0, 0, ("inp", 1))
    assert h.promises(["t"]) == {"t": Tag(500, 3)}
    h._push("relay", Tag(400, 0), INPUT, 1, 0, ("fb", 1))  # absorb has no effects
    assert h.promises(["t"]) == {"t": Tag(500, 3)}
    # upstream: head's horizon (300, 4) -> inp -> relay -> tail
    h.horizons["h"] = Tag(300, 4)
    assert h.promises(["t"]) == {"t": Tag(300, 5)}


def test_past_the_scan_limit_the_earliest_event_stands_for_all_and_the_bound_stays_below():
    h = _host("server")
    h.horizons.update({"c": NEVER, "p0": NEVER, "p1": NEVER})
    for i in range(_PROMISE_SCAN_MAX - 1):  # items: no effects, cannot hold the client back
        h._push("server", Tag(10 + i, 0), INPUT, 2, i, ("items", i))
    h._push("server", Tag(5000, 0), INPUT, 0, 0, ("requests", 1))
    exact = h.promises(["c"])["c"]
    assert exact == Tag(5500, 0)
    h._push("server", Tag(20000, 0), INPUT, 2, 999, ("items", 0))  # one more: the coarse bound
    coarse = h.promises(["c"])["c"]
    assert coarse == Tag(10 + 500, 0)  # the earliest event + the least delay to the client
    assert coarse <= exact
    assert h.coarse_promises == 1


@pytest.mark.parametrize("app,config", [(APP, {"samples": 150}), (MIX, {})], ids=["sample_loop", "promise_mix"])
def test_every_way_to_send_gives_the_same_digests_in_one_process_and_across_processes(app, config):
    single = run(build_graph(app, config), seed=3, digest=True)
    multi = run(build_graph(app, config), seed=3, digest=True, placement="processes", app=app, config=config)
    assert single.digests == multi.digests
    assert single.events == multi.events
    assert sum(single.events.values()) > 200  # the loops ran, not just startup


def test_across_processes_the_server_serves_the_next_request_before_the_clients_update_ends(tmp_path):
    """The point of the promises: the client's request sent before its long update is served before
    the update ends, not after it (without them the server waits for the update's promise)."""
    config = {"samples": 6, "learn_s": 0.2, "log_dir": str(tmp_path)}
    run(build_graph(APP, config), seed=1, placement="processes", app=APP, config=config)

    def rows(name: str) -> list[list[float]]:
        return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]

    served = {int(n): t for n, t in rows("serve")}
    learns = rows("learn")
    assert len(learns) == 6
    # learn k runs after take k sent request k (its n); that request is served before the update
    # ends (often before it starts), not after it
    before_end = [served[int(n)] < t1 for n, _, t1 in learns if int(n) in served]
    assert len(before_end) == 5 and all(before_end), (learns, served)


@pytest.mark.parametrize("placement", ["processes"])
def test_the_sampling_loop_gives_the_same_digests_in_one_process_and_across_processes(placement):
    config = {"samples": 150}
    single = run(build_graph(APP, config), seed=3, digest=True)
    multi = run(build_graph(APP, config), seed=3, digest=True, placement=placement, app=APP, config=config)
    assert single.digests == multi.digests
    assert single.events == multi.events
    assert single.events["client"] > 2 * 100  # replies and updates of the whole loop ran
    stats = multi.processes
    assert {"rounds", "promises", "waits", "cpu_ms"} <= set(stats["client"])
