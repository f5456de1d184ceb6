"""Deterministic mode is reproducible; async runs recorded to a trace replay exactly (one process)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from reactor import Graph, Input, Output, Reactor, TraceMismatchError, reaction, run, startup
from reactor._scheduler import INPUT
from reactor._trace import describe, diff, read_trace, write_trace
from reactor.launch._app import build_graph

APP = str(Path(__file__).resolve().parents[1] / "apps" / "racing.py")


def test_deterministic_runs_with_one_seed_give_identical_digests_and_another_seed_differs():
    a = run(build_graph(APP, {}), seed=3, digest=True)
    b = run(build_graph(APP, {}), seed=3, digest=True)
    c = run(build_graph(APP, {}), seed=4, digest=True)
    assert a.digests == b.digests
    assert a.digests["sink"] != c.digests["sink"]
    assert a.events["sink"] == 1 + 120  # startup, then 40 from each of 2 fast and 1 slow producer


def test_async_recording_replays_to_the_same_digests(tmp_path):
    trace = tmp_path / "run.trace"
    rec = run(build_graph(APP, {}), deterministic=False, record=trace, digest=True, seed=1, stop_s=0.5)
    assert rec.stopped_by == "stop_time"
    assert rec.events["sink"] > 100  # the producers (0.2 s of ticks) were done long before
    for _ in range(2):
        rep = run(build_graph(APP, {}), deterministic=False, replay=trace, digest=True, seed=1)
        assert rep.stopped_by == "replay"
        assert rep.digests == rec.digests


@pytest.mark.parametrize("placement", ["single", "processes"])
def test_a_recorded_run_that_fails_writes_its_trace_and_its_replay_fails_alike(tmp_path, placement, caplog):
    """Regression: a recorded run that failed wrote no trace, and said nothing of it: the run a user most
    needs to replay. Its trace is now written up to the failure (the event that failed last in its
    reactor's schedule) and keeps the failure's line, and its replay runs the same events to the same
    failure: here one that follows from their order (racing producers; the consumer fails at its 70th
    input, naming its order-dependent hash so far)."""
    trace = tmp_path / "run.trace"
    config = {"fail_at": 70}
    kw = {"deterministic": False, "seed": 1, "placement": placement, "app": APP, "config": config}
    with caplog.at_level(logging.WARNING, logger="reactor"), pytest.raises(Exception) as rec:
        run(build_graph(APP, config), record=trace, **kw)
    failure = re.search(r"RuntimeError: folder broke at input 70, its hash \w{16}", f"{rec.type.__name__}: {rec.value}")
    assert failure is not None, rec.value
    assert f"the run failed; its trace up to the failure is in {trace}" in caplog.text
    recorded = read_trace(trace)
    assert recorded["failure"] == failure.group(0)
    assert [e[0] for e in recorded["events"]["folder"]].count(INPUT) == 70 and recorded["events"]["folder"][-1][0] == INPUT
    assert f"recorded from a run that failed: {failure.group(0)}" in describe(recorded)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reactor"), pytest.raises(rec.type, match=re.escape(
            failure.group(0).removeprefix("RuntimeError: "))):  # (under single: the RuntimeError itself)
        run(build_graph(APP, config), replay=trace, **kw)
    assert f"replaying {trace}, recorded from a run that failed ({failure.group(0)})" in caplog.text


def test_replay_against_a_tampered_schedule_fails_loudly(tmp_path):
    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.5)
    t = read_trace(trace)
    evs = t["events"]["folder"]
    # Swap two messages of the same link: the second can never come before the first.
    i = next(i for i in range(len(evs) - 1) if evs[i][0] == 3 and evs[i + 1][:2] == evs[i][:2])
    evs[i], evs[i + 1] = evs[i + 1], evs[i]
    bad = tmp_path / "bad.trace"
    write_trace(bad, t)
    assert diff(read_trace(trace), read_trace(bad)) == [
        f"folder: event {i} differs: input #{evs[i + 1][1]} seq {evs[i + 1][2]} vs input #{evs[i][1]} seq {evs[i][2]}"
    ]
    with pytest.raises(TraceMismatchError, match=r"^folder expected input #\d+ seq \d+ at event \d+, but seq \d+ of that link comes first"):
        run(build_graph(APP, {}), deterministic=False, replay=bad, seed=1)


def test_record_and_replay_need_async_mode(tmp_path):
    with pytest.raises(ValueError, match=r"record/replay apply to async mode"):
        run(build_graph(APP, {}), record=tmp_path / "x")


def test_replay_with_another_config_reports_who_waits_for_what(tmp_path):
    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.5)
    with pytest.raises(TraceMismatchError, match=r"^the run went quiet before the recorded schedule was complete .*folder waits for input #\d+ seq \d+"):
        run(build_graph(APP, {"count": 30}), deterministic=False, replay=trace, seed=1)


def test_a_stop_time_given_to_a_replay_is_refused(tmp_path):
    """It was ignored in silence: a replay ends where its recording did."""
    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.3)
    with pytest.raises(ValueError, match=r"^stop_s \(--stop-s\) does not apply to a replay: it ends where its "
                                         r"recording did$"):
        run(build_graph(APP, {}), deterministic=False, replay=trace, seed=1, stop_s=0.1)


@pytest.mark.parametrize("placement", ["single", "processes"])
def test_a_trace_replayed_with_another_seed_is_refused_naming_both(tmp_path, placement):
    """It ran silently, with other draws of the reactors' generators: another run, called a replay."""
    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.3)
    with pytest.raises(TraceMismatchError, match=r"^trace .*run\.trace was recorded with seed 1, and this run has "
                                                 r"seed 3: replay it with --seed 1 \(in Python, seed=1\)$"):
        run(build_graph(APP, {}), deterministic=False, replay=trace, seed=3, placement=placement, app=APP, config={})


@pytest.mark.parametrize("placement", ["single", "processes"])
def test_a_trace_replayed_on_another_graph_is_refused_naming_what_differs(tmp_path, placement):
    """Regression (issue 19): a trace replayed on a graph with other reactors or links ran silently
    and wrongly; the trace now records its graph, and a replay on another one is refused first."""
    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.3)
    assert read_trace(trace)["graph"]["reactors"] == ["fast[0]", "fast[1]", "folder", "relay[0]", "relay[1]", "sink",
                                                      "slow"]
    other = build_graph(APP, {"slow_delay_s": 0.001})
    with pytest.raises(TraceMismatchError, match=(
            r"^trace .*run\.trace was recorded from another graph \(links only in the trace: slow\.out -> folder\.inp "
            r"\(delay 500000 ns\); links only in this graph: slow\.out -> folder\.inp \(delay 1000000 ns\)\): a replay "
            r"needs the graph it was recorded from")):
        run(other, deterministic=False, replay=trace, seed=1, placement=placement, app=APP,
            config={"slow_delay_s": 0.001})
    demo = str(Path(__file__).resolve().parents[2] / "apps" / "demo_pipeline.py")
    with pytest.raises(TraceMismatchError, match=r"reactors only in the trace: fast\[0\], fast\[1\], folder, "
                                                 r"relay\[0\], relay\[1\] and 2 more; reactors only in this graph: "
                                                 r"collector, producer\[0\]"):
        run(build_graph(demo, {}), deterministic=False, replay=trace, seed=1)


def test_a_trace_with_an_impossible_event_is_refused_at_once_naming_it(tmp_path):
    """An event of an unknown kind, or with a float, a negative or another type where the numbers go, replayed
    to a "successful" end with a third of the run missing (`run ended (quiescence)`, exit 0); a timer index
    past the reactor's timers raised IndexError; a header without a seed raised KeyError in `trace show`; a
    FIFO given as the trace hung."""
    import os

    from reactor._errors import MalformedFrameError

    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.3)
    good = read_trace(trace)
    for event, shown in (([99, 0, 0], r"\[99, 0, 0\]"), ([1.5, 0.5, 0.5], r"\[1\.5, 0\.5, 0\.5\]"),
                         ([1, 0, -5], r"\[1, 0, -5\]"), (["x", 0, 0], r"\['x', 0, 0\]"),
                         ([[1], 0, 0], r"\[\[1\], 0, 0\]"), ([True, 0, 0], r"\[True, 0, 0\]")):
        t = {**good, "events": {**good["events"], "sink": [event, *good["events"]["sink"][1:]]}}
        write_trace(tmp_path / "bad.trace", t)
        with pytest.raises(MalformedFrameError, match=rf"bad\.trace: the events table is damaged \(event 0 of 'sink' "
                                                       rf"is {shown}\)$"):
            read_trace(tmp_path / "bad.trace")
    write_trace(tmp_path / "bad.trace", {**good, "seed": "x"})
    with pytest.raises(MalformedFrameError, match=r"the header is damaged \(its seed or placement\)$"):
        read_trace(tmp_path / "bad.trace")
    slow = good["events"]["slow"]
    i = next(i for i, e in enumerate(slow) if e[0] == 1)  # a timer event of the slow producer
    t = {**good, "events": {**good["events"], "slow": [*slow[:i], (1, 999, slow[i][2]), *slow[i + 1:]]}}
    write_trace(tmp_path / "bad.trace", t)
    with pytest.raises(TraceMismatchError, match=r"^slow's trace names its timer #999, and it has 1: the trace is damaged"):
        run(build_graph(APP, {}), deterministic=False, replay=tmp_path / "bad.trace", seed=1)
    os.mkfifo(tmp_path / "fifo.trace")
    with pytest.raises(MalformedFrameError, match=r"fifo\.trace is not a regular file$"):
        read_trace(tmp_path / "fifo.trace")


def test_a_trace_cut_short_or_edited_outside_the_writer_is_refused_before_it_replays(tmp_path):
    """A reactor's schedule halved, or gone, or every schedule gone, replayed to a "successful" end
    (the run did less, exit 0): the trace's events carry their sha256, and a trace without it, or
    without its graph, is refused (hostile probe of files on disk, session 54)."""
    import msgpack

    from reactor._errors import MalformedFrameError

    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.3)
    raw = msgpack.unpackb(trace.read_bytes())
    sink = raw["events"]["sink"]
    edits = {
        "halved": {**raw, "events": {**raw["events"], "sink": sink[: len(sink) // 2]}},
        "gone": {**raw, "events": {k: v for k, v in raw["events"].items() if k != "sink"}},
        "empty": {**raw, "events": {}},
    }
    for name, body in edits.items():
        (tmp_path / f"{name}.trace").write_bytes(msgpack.packb(body))
        with pytest.raises(MalformedFrameError, match=r"its events are not those it was written with \(cut short"):
            run(build_graph(APP, {}), deterministic=False, replay=tmp_path / f"{name}.trace", seed=1)
    for key, why in (("events_sha256", "holds no digest of its events"), ("graph", "does not record its graph")):
        (tmp_path / "old.trace").write_bytes(msgpack.packb({k: v for k, v in raw.items() if k != key}))
        with pytest.raises(MalformedFrameError, match=why):
            read_trace(tmp_path / "old.trace")
    stranger = {**raw["events"], "mallory": [[0, 0, 0]]}
    write_trace(tmp_path / "stranger.trace", {**raw, "events": stranger})
    with pytest.raises(MalformedFrameError, match=r"its events name reactors its graph lacks: mallory$"):
        read_trace(tmp_path / "stranger.trace")
    assert run(build_graph(APP, {}), deterministic=False, replay=trace, seed=1).stopped_by == "replay"


def test_a_record_path_that_cannot_take_the_trace_is_refused_before_the_run_and_a_link_is_not_written_through(
        tmp_path):
    """It failed after the whole run (the recording left at NAME.tmp, unsaid); a link planted at the
    temporary name had the trace written through it, over the file it named."""
    (tmp_path / "adir").mkdir()
    with pytest.raises(ValueError, match=r"is a directory: name the trace file to write"):
        run(build_graph(APP, {}), deterministic=False, record=tmp_path / "adir", seed=1, stop_s=0.1)
    with pytest.raises(ValueError, match=r"its directory .*no-such' does not exist"):
        run(build_graph(APP, {}), deterministic=False, record=tmp_path / "no-such" / "x.trace", seed=1, stop_s=0.1)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for planted in (".run.trace.tmp", "run.trace.tmp"):
        (tmp_path / planted).symlink_to(victim)
    run(build_graph(APP, {}), deterministic=False, record=tmp_path / "run.trace", seed=1, stop_s=0.1)
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "run.trace").is_symlink() and read_trace(tmp_path / "run.trace")["seed"] == 1


class _Split(Reactor):
    """Sends ``to_c`` numbers to ``c`` and ``to_d`` to ``d`` at its startup."""

    c = Output(int)
    d = Output(int)

    def __init__(self, to_c: int, to_d: int) -> None:
        self.to_c, self.to_d = to_c, to_d

    @reaction(triggers=[startup], effects=[c, d])
    def go(self) -> None:
        for i in range(self.to_c):
            self.c.send(i)
        for i in range(self.to_d):
            self.d.send(i)


class _Take(Reactor):
    inp = Input(int)

    @reaction(triggers=[inp])
    def got(self, inp: int) -> None:
        pass


def _split(to_c: int, to_d: int) -> Graph:
    g = Graph()
    p = g.add(_Split(to_c, to_d), name="p")
    g.connect(p.c, g.add(_Take(), name="c").inp)
    g.connect(p.d, g.add(_Take(), name="d").inp)
    return g


@pytest.mark.timeout(60)
def test_a_replay_that_diverges_with_a_message_to_a_reactor_done_with_its_schedule_fails_naming_who_waits(tmp_path):
    """A message to a reactor at the end of its recorded schedule stayed in its inbox, so the run never
    counted as quiet: the replay hung, where it should name the reactor still waiting."""
    trace = tmp_path / "run.trace"
    rec = run(_split(3, 0), deterministic=False, record=trace, seed=1)
    assert rec.events == {"p": 1, "c": 4, "d": 1}  # (each one's startup too)
    with pytest.raises(TraceMismatchError, match=r"^the run went quiet before the recorded schedule was complete .*"
                                                 r"c waits for input #0 seq 2"):
        run(_split(2, 1), deterministic=False, replay=trace, seed=1)


def test_a_replay_with_other_set_values_than_its_recording_says_so_before_it_starts(tmp_path, caplog):
    """A replay with another lr ran to its end, wrote a normal-looking run directory, and only then ended
    with TraceMismatchError (a newcomer's pass, session 55). The trace keeps the run's --set values; a
    replay with others names them at its start."""
    import logging

    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.2, config={"lr": 0.001, "n": 3})
    assert read_trace(trace)["config"] == {"lr": "0.001", "n": "3"}
    with caplog.at_level(logging.WARNING, logger="reactor"):
        run(build_graph(APP, {}), deterministic=False, replay=trace, seed=1, config={"lr": 0.001, "n": 3})
    assert not [m for m in caplog.messages if "other --set values" in m]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reactor"):
        run(build_graph(APP, {}), deterministic=False, replay=trace, seed=1, config={"lr": 0.0005, "n": 3, "x": 1})
    said = [m for m in caplog.messages if "other --set values" in m]
    assert len(said) == 1 and "lr=0.0005 (recorded: 0.001), x=1 (recorded: (not set))" in said[0], said


def test_a_replay_on_another_app_than_its_recording_says_so_before_it_starts(tmp_path, caplog):
    """Regression (a newcomer's pass): a DQN trace replayed on the transformer app (the same reactors and
    links, so the graph check passed) ran its whole length and then ended with TraceMismatchError,
    leaving a failed run's directory. The trace keeps its app's file name; a replay on another names both
    at its start. Said, not refused: a copy of the app under another name replays (as here)."""
    import logging
    import shutil

    trace = tmp_path / "run.trace"
    run(build_graph(APP, {}), deterministic=False, record=trace, seed=1, stop_s=0.2, app=APP)
    assert read_trace(trace)["app"] == "racing.py"
    with caplog.at_level(logging.WARNING, logger="reactor"):
        run(build_graph(APP, {}), deterministic=False, replay=trace, seed=1, app=APP)
    assert not [m for m in caplog.messages if "recorded from app" in m]
    other = tmp_path / "other_app.py"
    shutil.copy(APP, other)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reactor"):
        rep = run(build_graph(str(other), {}), deterministic=False, replay=trace, seed=1, app=str(other))
    said = [m for m in caplog.messages if "recorded from app" in m]
    assert said == [f"replaying {trace}, recorded from app 'racing.py', on app 'other_app.py': another app's run goes "
                    f"elsewhere, and the replay then ends with TraceMismatchError (replay a trace on the app it was "
                    f"recorded from)"], said
    assert rep.stopped_by == "replay"
