"""Promises across processes read from the reactions' declared effects (deterministic mode)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from reactor import ReactorError, run
from reactor._scheduler import _PROMISE_SCAN_MAX, ACTION, INPUT, STARTUP, TIMER, ReactorHost
from reactor._tag import NEVER, Tag
from reactor.launch._app import build_graph

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


# ---------------------------------------------------------------------------------- conditional promises


def _exchange(client: ReactorHost, server: ReactorHost, conditional: bool) -> None:
    """One round: each host computes its promise to the other, which the other receives."""
    if conditional:
        u, d, n = client.refresh(["s"])["s"]
        server.receive_promise("c", u, d, n)
        u, d, n = server.refresh(["c"])["c"]
        client.receive_promise("s", u, d, n)
        client.refresh(["s"])
    else:
        client.advance_horizon("s", server.promises(["c"])["c"])
        server.advance_horizon("c", client.promises(["s"])["s"])


@pytest.mark.parametrize("conditional", [True, False], ids=["conditional", "plain"])
def test_an_idle_client_and_its_server_need_no_promise_per_step_of_logical_time(conditional):
    """The learner/shard cycle with nothing to exchange: the client waits for a reply, the server
    has no request. Plain promises creep forward by the cycle's 1000 ns per exchange; a conditional
    promise ("nothing from me before your next message arrives + 500 ns") settles at once."""
    client, server = _host("client"), _host("server")
    client.horizons["s"] = server.horizons["c"] = Tag(0, 0)  # as a worker starts
    server.horizons.update({"p0": Tag(10**6, 0), "p1": Tag(10**6, 0)})  # items: no replies
    exchanges = 0
    while server.horizons.get("c", Tag(0, 0)) < Tag(10**6, 0) and exchanges < 5000:
        _exchange(client, server, conditional)
        exchanges += 1
    if conditional:
        assert exchanges == 1
        assert server.horizons["c"] == client.horizons["s"] == NEVER  # neither can ever send again
    else:
        assert exchanges >= 900  # 10^6 ns of logical time at ~1000 ns per exchange


def test_a_conditional_horizon_follows_this_process_own_next_message():
    server = _host("server")
    server.horizons.update({"p0": Tag(10**6, 0), "p1": Tag(10**6, 0)})
    server.receive_promise("c", NEVER, (500, 0), 0)  # the client answers a reply 500 ns later
    # A request pending at 1000: the reply arrives at 1500, so the next request at 2000 at the earliest.
    server._push("server", Tag(1000, 0), INPUT, 0, 0, ("requests", 1))
    promise = server.refresh(["c"])["c"]
    assert server.horizons["c"] == Tag(2000, 0)
    # Our promise to the client: the pending request's reply (1500); a request from the client is
    # answered 500 ns after it arrives here; no message from it received yet.
    assert promise == (Tag(1500, 0), (500, 0), 0)
    # Serving it sends the reply: in flight until the client says it has received it.
    assert asyncio.run(server.run_ready()) == 1
    assert server._inflight["c"] == deque([Tag(1500, 0)])
    server.refresh(["c"])
    assert server.horizons["c"] == Tag(2000, 0)
    with pytest.raises(ReactorError, match=r"at Tag\(1800ns, 0\) after promising nothing before Tag\(2000ns, 0\)"):
        server.deliver_remote(_link(server, "client", "server"), 0, Tag(1800, 0), 1)
    # The client got the reply, handled it and is done: the in-flight reply no longer counts.
    server.receive_promise("c", NEVER, (500, 0), 1)
    assert not server._inflight["c"]
    server.refresh(["c"])
    assert server.horizons["c"] == NEVER


def test_a_conditional_promise_leaves_out_only_the_receivers_own_cycle():
    """The client's promise to the server: the bound from a pending reply is kept (it came from
    the server, but it is already here); what the server's next reply can cause is the D part."""
    client = _host("client")
    client.receive_promise("s", Tag(3000, 0), (500, 0), 0)
    u, d, n = client.refresh(["s"])["s"]
    assert (u, d, n) == (NEVER, (500, 0), 0)  # nothing pending; a reply is answered 500 ns later
    assert client.horizons["s"] == Tag(3000, 0)  # the server's own bound (it has no message of ours)
    client.deliver_remote(_link(client, "server", "client"), 0, Tag(3000, 0), 7)
    u, d, n = client.refresh(["s"])["s"]
    assert (u, d, n) == (Tag(3500, 0), (500, 0), 1)  # the received reply is now a pending event


def _link(h: ReactorHost, src: str, dst: str) -> int:
    return next(lk.index for lk in h.links if lk.src == src and lk.dst == dst)


def test_a_run_without_stop_time_ends_when_the_cycle_goes_idle_across_processes():
    """The client stops asking after 40 samples; nothing else can happen. Each process must learn
    that the other can never send again: the last promises of a finished process are unconditional
    (a conditional one would leave its peer waiting on the answer to a reply it already handled)."""
    config = {"samples": 40, "producers": 0, "stop_s": None}
    single = run(build_graph(APP, config), seed=5, digest=True)
    multi = run(build_graph(APP, config), seed=5, digest=True, placement="processes", app=APP, config=config)
    assert single.digests == multi.digests and single.events == multi.events
    assert single.events["client"] >= 2 * 40  # every reply and update ran
    assert single.stopped_by == multi.stopped_by == "quiescence"


def test_across_processes_the_run_reports_why_it_stopped_as_one_process_does():
    """The client/server loop cut by the stop time, no timers: what is left past the stop time is
    messages only. One process finds them in its queue ("stop_time"); across processes a message
    tagged past the stop time counts at its sender, arrived or not, so the answer does not depend on
    which messages were still in flight when the workers ended."""
    config = {"samples": 10**6, "producers": 0, "stop_s": 1e-4}
    single = run(build_graph(APP, config), seed=2)
    assert single.stopped_by == "stop_time"
    for _ in range(3):
        multi = run(build_graph(APP, config), seed=2, placement="processes", app=APP, config=config)
        assert multi.stopped_by == "stop_time"


def _mix_hr() -> ReactorHost:
    owners = {"head": "hr", "relay": "hr", "tail": "t"}
    return ReactorHost(build_graph(MIX, {}), ["head", "relay"], owners, remote=_Sink(), process="hr")


def test_the_in_flight_bound_is_the_earliest_arrival_not_the_first_sent():
    """Head sends to tail through a 100 ns link, then relay (same process) through a zero-delay one:
    the second message arrives first. Tail's conditional promise holds us to its answer to the
    earliest of them."""
    h = _mix_hr()
    h._seed_events()
    while h.heap and h.heap[0][0] == 0:  # startup, then the relay's zero-delay hop
        asyncio.run(h.run_ready(budget=1))
    sent = list(h._inflight["t"])
    assert sent[0] == Tag(100, 0) and min(sent) < sent[0]  # out of order
    h.receive_promise("t", NEVER, (200, 0), 0)  # tail answers 200 ns after a message arrives
    h.refresh(["t"])
    assert h.horizons["t"] == _after_tag(min(sent), 200)


def _after_tag(t: Tag, ns: int) -> Tag:
    return Tag(t.time_ns + ns, 0)


def test_in_flight_tags_are_kept_only_for_peers_that_can_acknowledge_them():
    # A producer's items go to the server, which never sends back: nothing to remember.
    p = _host("producer[0]")
    p._seed_events()
    asyncio.run(p.run_ready(budget=4))
    assert p.sent_count > 0 and "s" not in p._inflight
    # The server's replies go to the client, which promises back; once a promise without a D part
    # arrives (the client can never answer), the list goes and stays gone.
    s = _host("server")
    s.horizons.update({"p0": NEVER, "p1": NEVER, "c": Tag(0, 0)})
    s.deliver_remote(_link(s, "client", "server"), 0, Tag(1000, 0), 1)
    s.advance_horizon("c", Tag(1000, 1))
    s.refresh(["c"])
    asyncio.run(s.run_ready())
    assert list(s._inflight["c"]) == [Tag(1500, 0)]
    s.receive_promise("c", Tag(10**6, 0), None, 0)
    assert "c" not in s._inflight
    s.deliver_remote(_link(s, "client", "server"), 1, Tag(2000, 0), 2)
    s.refresh(["c"])
    asyncio.run(s.run_ready())
    assert "c" not in s._inflight


def test_a_peer_counts_what_we_received_since_our_last_promise_as_in_flight():
    """peer_view: the bound a peer holds us to after our last promise (U, D, n) is lowered by the
    messages of its we received since, which is what decides whether a new promise is worth sending."""
    s = _host("server")
    s.horizons.update({"p0": NEVER, "p1": NEVER})
    assert s.peer_view("c", NEVER, (500, 0)) == NEVER
    s.deliver_remote(_link(s, "client", "server"), 0, Tag(1000, 0), 1)
    s.deliver_remote(_link(s, "client", "server"), 1, Tag(900, 0), 2)
    assert s.peer_view("c", NEVER, (500, 0)) == Tag(1400, 0)
    assert s.peer_view("c", Tag(1200, 0), (500, 0)) == Tag(1200, 0)
    assert s.peer_view("c", NEVER, None) == NEVER  # an unconditional promise ignores them
    s.promise_sent("c")
    assert s.peer_view("c", NEVER, (500, 0)) == NEVER


def test_the_plain_promise_is_the_conditional_one_with_its_condition_spelled_out():
    s = _host("server")
    s.horizons.update({"p0": Tag(9000, 0), "p1": Tag(8000, 0)})
    s.receive_promise("c", Tag(5000, 0), (500, 0), 0)
    s._push("server", Tag(7000, 0), INPUT, 0, 0, ("requests", 1))
    u, d, _ = s.refresh(["c"])["c"]
    assert d == (500, 0)
    assert s.promises(["c"])["c"] == min(u, Tag(s.horizons["c"].time_ns + d[0], 0)) == Tag(5500, 0)


# ---------------------------------------------------------------------------------- blocking reactions

BARRIER = str(Path(__file__).resolve().parents[1] / "apps" / "barrier.py")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", [{}, {"early": False, "meet_s": 0.0005}], ids=["early-event", "meet-soon"])
def test_blocking_reactions_promise_first_so_processes_meet_at_a_barrier_outside_the_graph(tmp_path, case):
    """reaction(blocking=True), as data-parallel learners' rendezvous and all-reduces: a process
    promises its peers before it runs one. Without that, `left` ran its 1 ms event and its 5 ms
    barrier in one go with its promise still at 2 ms, so `right` could never reach 5 ms to join
    (and at startup, a process that had promised nothing yet could block its peer's start)."""
    config = {"dir": str(tmp_path), "wait_s": 20.0, **case}
    t0 = time.monotonic()
    run(build_graph(BARRIER, config), placement="processes", app=BARRIER, config=config)
    met = {side: json.loads((tmp_path / f"{side}.json").read_text()) for side in ("left", "right")}
    assert met == {"left": {"start": True, "meet": True}, "right": {"start": True, "meet": True}}
    assert time.monotonic() - t0 < 60  # no side sat out a barrier's 20 s wait


def test_the_dqn_learners_pending_update_holds_the_shards_back_only_by_the_priorities_step():
    """Under `actors`, the update of the batch that just arrived can send the shards only priorities
    (a whole step_s later), not a request (half a step): so the shards' processes serve the request
    sent before the update while the update runs. From session 26 to 53 `learn` also declared
    `requests` (for one-sided batches, now `learn_drawn`), and the shards waited out every update."""
    from reactor.launch._placement import resolve_placement  # noqa: PLC0415

    g = build_graph(str(Path(__file__).resolve().parents[2] / "apps" / "dqn.py"), {})
    owner = {n: gr.name for gr in resolve_placement(g, "actors").groups for n in gr.reactors}
    h = ReactorHost(g, [n for n, p in owner.items() if p == "learner"], owner, remote=_Sink(), process="learner")
    step_ns, request_ns = 1000, 500  # (the training graph's defaults: step_s 1 us, requests half of it)
    for shard in ("replay-0", "replay-1"):
        assert h._reach[("learner", "replies")][shard] == (request_ns, 0)  # take sends the next request
        assert h._reach[("learner", "update_due")][shard] == (step_ns, 0)  # learn: priorities only
        assert h._reach[("learner", "drawn_due")][shard] == (request_ns, 0)  # async: may sample again
