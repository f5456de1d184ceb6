"""Metrics: CSV/TensorBoard logs, summary, stop on target, and the plot (real files, real runs)."""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest

from reactor import Action, Graph, Output, Reactor, reaction, run, startup
from reactor.nodes.metrics import Metrics
from reactor.nodes.train_messages import Report


class FakeTrainer(Reactor):
    """Reports env steps, episode returns and an evaluation climbing by 100 per round."""

    report = Output(Report)
    again = Action()

    def __init__(self, rounds: int = 10, evaluates: bool = True) -> None:
        self.rounds = rounds
        self.evaluates = evaluates
        self.k = 0

    @reaction(triggers=[startup, again], effects=[report, again])
    def tick(self) -> None:
        self.k += 1
        self.report.send(Report(self.name, {"env_steps": 1000 * self.k, "episodes": 10 * self.k,
                                            "episode_return": 20.0 * self.k}))
        if self.evaluates:
            self.report.send(Report("evaluator", {"eval_return": 100.0 * self.k}))
        if self.k < self.rounds:
            self.again.schedule(delay_s=0.001)


def _graph(run_dir, target=None, max_steps=None, actors=2):
    g = Graph()
    t = g.add(FakeTrainer(), name="actor", replicas=actors)
    m = g.add(Metrics(str(run_dir), target_return=target, max_env_steps=max_steps, live=False), name="metrics")
    g.connect(t.report, m.reports)
    return g


def test_metrics_logs_every_value_sums_counters_and_stops_at_the_target(tmp_path):
    res = run(_graph(tmp_path, target=450.0))
    assert res.stopped_by == "request"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reached_target"] is True
    assert summary["best_eval_return"] == 500.0  # the first evaluation >= 450
    assert summary["env_steps"] == 2 * 5000  # two actors' cumulative counters summed
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["name"] for r in rows} == {"env_steps", "episodes", "episode_return", "eval_return"}
    assert max(int(r["env_steps"]) for r in rows) == 10000
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
    assert (tmp_path / "curves.png").stat().st_size > 1000


class TailingTrainer(Reactor):
    """Reports its env steps each round and an evaluation in rounds 1 and 3, and reads metrics.csv from
    disk (as a user's ``tail -f`` would) at the start of each round after the first, while the run goes on."""

    report = Output(Report)
    again = Action()

    def __init__(self, csv_path: str, seen_path: str) -> None:
        self.csv_path, self.seen_path = csv_path, seen_path
        self.k = 0

    @reaction(triggers=[startup, again], effects=[report, again])
    def tick(self) -> None:
        if self.k:
            with open(self.csv_path, newline="") as f, open(self.seen_path, "a") as seen:
                seen.write(json.dumps([f"{r['name']}={r['value']}" for r in csv.DictReader(f)]) + "\n")
        self.k += 1
        if self.k <= 3:
            self.report.send(Report(self.name, {"env_steps": 1000 * self.k}))
            if self.k != 2:
                self.report.send(Report("evaluator", {"eval_return": 10.0 * self.k}))
            self.again.schedule(delay_s=0.001)


def test_metrics_csv_holds_each_evaluation_and_recent_rows_while_the_run_goes_on(tmp_path, monkeypatch):
    """A run's metrics.csv is read while it runs (a user tailing it, a test waiting for an
    evaluation): each evaluation is on disk once reported, and other rows within FLUSH_PERIOD_S."""
    import reactor.nodes.metrics as metrics_module

    def tailed(flush_period_s: float) -> list[list[str]]:
        monkeypatch.setattr(metrics_module, "FLUSH_PERIOD_S", flush_period_s)
        run_dir = tmp_path / f"run-{flush_period_s}"
        g = Graph()
        seen = tmp_path / f"seen-{flush_period_s}.jsonl"
        t = g.add(TailingTrainer(str(run_dir / "metrics.csv"), str(seen)), name="actor")
        g.connect(t.report, g.add(Metrics(str(run_dir), live=False), name="metrics").reports)
        run(g)
        return [json.loads(line) for line in seen.read_text().splitlines()]

    first = ["env_steps=1000", "eval_return=10.0"]
    third = [*first, "env_steps=2000", "env_steps=3000", "eval_return=30.0"]
    # Round 2 reports no evaluation: its row waits for the period (here, for round 3's evaluation).
    assert tailed(3600.0) == [first, first, third]
    assert tailed(0.0) == [first, [*first, "env_steps=2000"], third]


class _RestartedMetrics(Metrics):
    """Metrics as a restart policy starts it again: in a later life of its process (``restarts`` 1; a
    run() is a new run, so the directory is taken over as a resume: a later life of the same run joins it)."""

    @property
    def restarts(self) -> int:
        return 1

    @restarts.setter
    def restarts(self, value: int) -> None:
        pass


def test_a_restarted_metrics_goes_on_with_its_runs_csv_and_evaluations(tmp_path):
    """A restarted life (its process killed and started again) appends to the run's metrics.csv: the
    earlier life's rows stay (a row its death cut short is cut off), its wall clock goes on from them, and
    the summary counts every life's evaluations. A new run is refused the directory."""
    run(_graph(tmp_path, actors=1))  # the first life: 10 rounds, evaluations 100..1000
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("0.02,5000,actor,env_ste")  # its death mid-write
    first = (tmp_path / "metrics.csv").read_text().splitlines()[:-1]
    g = Graph()
    t = g.add(FakeTrainer(rounds=2), name="actor")
    g.connect(t.report, g.add(_RestartedMetrics(str(tmp_path), live=False, resume=True), name="metrics").reports)
    run(g)
    lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert lines[:len(first)] == first and lines[0] == "wall_s,env_steps,source,name,value"
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert all(None not in r.values() and len(r) == 5 for r in rows)  # no row cut short, one header
    walls = [float(r["wall_s"]) for r in rows]
    assert walls == sorted(walls)
    evals = [float(r["value"]) for r in rows if r["name"] == "eval_return"]
    assert evals == [100.0 * k for k in range(1, 11)] + [100.0, 200.0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [e["eval_return"] for e in summary["evaluations"]] == evals and summary["best_eval_return"] == 1000.0
    kept = (tmp_path / "metrics.csv").read_bytes()
    with pytest.raises(ValueError, match="holds an earlier run"):  # a new run in this directory: refused
        run(_graph(tmp_path, actors=1))
    assert (tmp_path / "metrics.csv").read_bytes() == kept


def test_a_resumed_runs_metrics_csv_with_a_damaged_header_is_kept_aside_not_truncated(tmp_path, caplog):
    """One bad byte in the header erased the run's history on resume (the file was opened anew, "w")."""
    run(_graph(tmp_path, actors=1))
    damaged = bytearray((tmp_path / "metrics.csv").read_bytes())
    damaged[2] = 0xFF
    (tmp_path / "metrics.csv").write_bytes(bytes(damaged))
    g = Graph()
    t = g.add(FakeTrainer(rounds=2), name="actor")
    g.connect(t.report, g.add(Metrics(str(tmp_path), live=False, resume=True), name="metrics").reports)
    with caplog.at_level(logging.WARNING, logger="reactor.metrics"):
        run(g)
    [kept] = tmp_path.glob("metrics.unreadable-*.csv")
    assert kept.read_bytes() == bytes(damaged)
    assert any("kept as metrics.unreadable-" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "metrics.csv").read_text().startswith("wall_s,env_steps,source,name,value\n")


class CountingTrainer(Reactor):
    """Reports the counter ``key`` it is given, one value per round (a drop: the source's new life), and
    an evaluation in the rounds listed in ``evals``."""

    report = Output(Report)
    again = Action()

    def __init__(self, counts: list[int], key: str = "env_steps", evals: tuple[int, ...] = ()) -> None:
        self.counts, self.key, self.evals = counts, key, evals
        self.k = 0

    @reaction(triggers=[startup, again], effects=[report, again])
    def tick(self) -> None:
        self.report.send(Report(self.name, {self.key: self.counts[self.k]}))
        if self.k in self.evals:
            self.report.send(Report("evaluator", {"eval_return": float(self.k)}))
        self.k += 1
        if self.k < len(self.counts):
            self.again.schedule(delay_s=0.001)


class _RunA(Metrics):
    """Metrics in a run of the id ``run-a`` (each in-process ``run`` is a run of its own id)."""

    @property
    def run_id(self) -> str:
        return "run-a"


class _RunARestarted(_RestartedMetrics):
    """A later life of :class:`_RunA`'s Metrics, in the same run."""

    @property
    def run_id(self) -> str:
        return "run-a"


def _steps(path) -> list[int]:
    with open(path, newline="") as f:
        return [int(r["env_steps"]) for r in csv.DictReader(f)]


def _evals(path) -> list[float]:
    with open(path, newline="") as f:
        return [float(r["value"]) for r in csv.DictReader(f) if r["name"] == "eval_return"]


def _counting(metrics, **sources):
    g = Graph()
    m = g.add(metrics, name="metrics")
    for name, counts in sources.items():
        g.connect(g.add(counts if isinstance(counts, Reactor) else CountingTrainer(counts), name=name).report,
                  m.reports)
    return g


def test_env_steps_never_go_back_when_a_source_or_metrics_starts_again(tmp_path):
    """A restarted actor counts from 0 again, and a restarted Metrics summed the live sources' counters
    from 0: the run's env steps went back in metrics.csv, and max_env_steps let the run step past its
    budget. A counter that goes down is a source's new life, counted whole; a restarted Metrics goes on
    from the totals and counters its earlier life saved. The learner's updates, which go on from its
    checkpoint, count as the difference, as before (a drop there is an older checkpoint, not a new count)."""
    res = run(_counting(_RunA(str(tmp_path), max_env_steps=5400, live=False), a=[1000, 2000, 500, 1500],
                        b=[100, 200, 300, 400], learner=CountingTrainer([100, 200, 300], key="updates")))
    assert res.stopped_by == "quiescence"  # 1,900 steps short of the budget: not 3,700 short
    assert [s for s in _steps(tmp_path / "metrics.csv")] == [1000, 1100, 1100, 2100, 2200, 2200, 2700, 2800, 2800,
                                                             3800, 3900]
    saved = json.loads((tmp_path / "metrics.counters.json").read_text())
    assert saved["run_id"] == "run-a" and saved["totals"]["env_steps"] == 3900
    assert saved["sources"] == {"a": {"env_steps": 1500.0}, "b": {"env_steps": 400.0}, "learner": {"updates": 300.0}}
    # Metrics' own next life: `a` was started again with it (from 0), `b` went on, the learner went back to
    # its checkpoint of update 250. A row its earlier life wrote after its last save (its totals unsaved) is
    # cut off, so the rows never go back.
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("9.9,99999,b,env_steps,96500\n")
    res = run(_counting(_RunARestarted(str(tmp_path), max_env_steps=5400, live=False), a=[700, 1400], b=[500, 600],
                        learner=CountingTrainer([250, 350], key="updates")))
    steps = _steps(tmp_path / "metrics.csv")
    assert steps[11:14] == [4600, 4700, 4700] and 5400 in steps and steps == sorted(steps)  # (the budget, reached)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert res.stopped_by == "request" and summary["stop_reason"] == "5400 env steps >= max_env_steps 5400"
    assert summary["updates"] == 350  # the learner's own count: not 300 + 350
    # A resumed run (a new command) counts on from the earlier run's steps, with a budget of its own.
    resumed = tmp_path / "resumed"
    run(_counting(Metrics(str(resumed), live=False), a=[1000, 2000]))
    res = run(_counting(Metrics(str(resumed), max_env_steps=1000, live=False, resume=True), a=[400, 800, 1200, 1600]))
    assert _steps(resumed / "metrics.csv")[:5] == [1000, 2000, 2400, 2800, 3200]
    assert res.stopped_by == "request" and json.loads((resumed / "summary.json").read_text())["stop_reason"] == \
        "1200 env steps >= max_env_steps 1000 (on top of the earlier run's 2000, resumed from)"


@pytest.mark.parametrize("damage", ["negative", "huge_int", "nan", "past_float_ints", "another_run", "mid_row",
                                    "in_header", "older_than_an_evaluation"])
def test_a_counts_file_that_does_not_fit_is_logged_and_skipped_and_the_csv_kept_whole(tmp_path, caplog, damage):
    """A counts file of another shape, of another run, or whose length would cut the CSV anywhere but
    after whole rows that hold no evaluation: the restarted life logs it, counts from the live sources'
    counters, and cuts nothing (a length inside the header, or one saved before evaluations, had cut every
    evaluation of the run)."""
    run(_counting(_RunA(str(tmp_path), live=False), a=CountingTrainer([1000, 2000, 3000], evals=(0, 2))))
    saved = json.loads((tmp_path / "metrics.counters.json").read_text())
    text = (tmp_path / "metrics.csv").read_bytes()
    edits = {"negative": {"totals": {"env_steps": -5}}, "huge_int": {"totals": {"env_steps": 10 ** 400}},
             "nan": {"sources": {"a": {"env_steps": float("nan")}}}, "past_float_ints": {"totals": {"env_steps": 2 ** 63 - 1}},
             "another_run": {"run_id": "run-b"}, "mid_row": {"csv_nbytes": len(text) - 5},
             "in_header": {"csv_nbytes": 10},
             "older_than_an_evaluation": {"csv_nbytes": text.index(b"\n", text.index(b"env_steps,1000")) + 1}}
    (tmp_path / "metrics.counters.json").write_text(json.dumps({**saved, **edits[damage]}))
    run(_counting(_RunARestarted(str(tmp_path), live=False), a=[10]))
    assert (tmp_path / "metrics.csv").read_bytes().startswith(text)  # nothing cut
    assert _evals(tmp_path / "metrics.csv") == [0.0, 2.0]
    assert _steps(tmp_path / "metrics.csv")[-1] == 10  # from the live source's counter
    why = {"another_run": "was saved by run 'run-b', not by this one (run-a)",
           "mid_row": "do not end a row of it", "in_header": "do not end a row of it",
           "older_than_an_evaluation": "holds an evaluation past the"}.get(damage, "not a metrics.counters.json of the "
                                                                             "Metrics node")
    assert "totals count from the live sources' counters again" in caplog.text and why in caplog.text


def test_a_counts_file_that_cannot_be_saved_is_removed_said_once_and_the_run_goes_on(tmp_path, caplog, monkeypatch):
    """A save that fails (a full disk; here a directory where its temporary file goes) removes the earlier
    save, which a restart would have cut the CSV back to, losing the evaluations since; it is logged once,
    not at every flush, and the run goes on."""
    import reactor.nodes.metrics as metrics

    run(_counting(_RunA(str(tmp_path), live=False), a=[1000, 2000]))  # an earlier run's counts file is there
    monkeypatch.setattr(metrics, "FLUSH_PERIOD_S", 0.0)  # (a save at every report)
    (tmp_path / ".metrics.counters.json.tmp").mkdir()
    res = run(_counting(_RunA(str(tmp_path), live=False), a=CountingTrainer([10, 20, 30], evals=(0, 1, 2))))
    assert res.stopped_by == "quiescence" and json.loads((tmp_path / "summary.json").read_text())["env_steps"] == 30
    assert caplog.text.count("cannot save metrics.counters.json") == 1
    assert not (tmp_path / "metrics.counters.json").exists()
    run(_counting(_RunARestarted(str(tmp_path), live=False), a=[5]))
    assert _evals(tmp_path / "metrics.csv") == [0.0, 1.0, 2.0] and _steps(tmp_path / "metrics.csv")[-1] == 5


def test_an_earlier_lifes_rows_are_read_for_their_evaluations_and_last_time_only(tmp_path):
    """The restart reads only the rows naming eval_return (and the last rows) as CSV, for speed; a
    row whose name merely holds the text is no evaluation, and the wall clock goes on from the last
    row that parses, past a garbled one."""
    from reactor.nodes.metrics import CSV_HEADER, _earlier_rows

    path = tmp_path / "metrics.csv"
    path.write_text(",".join(CSV_HEADER) + "\n" + "1.0,10,evaluator,eval_return,7.0\n"
                    + '2.0,20,actor,"x,eval_return,y",5.0\n' + "3.0,30,eval_return,loss,0.5\n"
                    + "4.0,40,learner,loss,0.25\n" + "garbled row\n")
    assert _earlier_rows(path) == (4.0, [(1.0, 10.0, 7.0)], None)
    path.write_text("wall,steps\n1.0,2\n")  # not a metrics file: the new life starts it anew
    assert _earlier_rows(path) is None


def test_a_line_far_longer_than_any_row_is_passed_over_by_the_restart_never_read_whole(tmp_path):
    """An edited metrics.csv with a line of 64 MB (of "eval_return" text, so that the fast path looks at
    it): the restart keeps the evaluations before and after it, and reads it in 64 KiB pieces (its
    allocations peak far below the line's size)."""
    import tracemalloc

    from reactor.nodes.metrics import CSV_HEADER, _earlier_rows

    path = tmp_path / "metrics.csv"
    with open(path, "w") as f:
        f.write(",".join(CSV_HEADER) + "\n1.0,10,evaluator,eval_return,7.0\n")
        f.write("2.0,20,evaluator,eval_return," + "eval_return" * (64 * 2**20 // 11) + "\n")
        f.write("3.0,30,evaluator,eval_return,9.0\n" + "4.0,40,learner,loss,0.25\n")
    tracemalloc.start()
    try:
        assert _earlier_rows(path) == (4.0, [(1.0, 10.0, 7.0), (3.0, 30.0, 9.0)], None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, peak  # (read whole, the line alone was 64 MB)


def test_a_run_that_stops_before_its_first_evaluation_says_so_in_its_last_lines(tmp_path, capsys):
    """Regression (left alone in sessions 70-72): a run stopped before any evaluation (an early Ctrl-C, a
    small max_env_steps) ended "evaluation return -; stopped: ...", a dash that read as a return gone
    missing."""
    g = Graph()
    t = g.add(FakeTrainer(evaluates=False), name="actor")
    m = g.add(Metrics(str(tmp_path), max_env_steps=3000, live=False), name="metrics")
    g.connect(t.report, m.reports)
    run(g)
    out = capsys.readouterr().out
    assert ("evaluation return none (the run stopped before its first evaluation); stopped: 3000 env steps >= "
            "max_env_steps 3000\n") in out, out
    assert json.loads((tmp_path / "summary.json").read_text())["last_eval_return"] is None


def test_metrics_stops_at_max_env_steps_without_a_target(tmp_path, capsys):
    run(_graph(tmp_path, max_steps=6000, actors=1))
    out = capsys.readouterr().out  # live=False still ends with the result and where it is
    assert "evaluation return " in out and "stopped: " in out and f"run directory {tmp_path}" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["reached_target"] is False
    assert summary["env_steps"] == 6000
    assert "max_env_steps" in summary["stop_reason"]


@pytest.mark.parametrize("budget,reason", [
    (20_000, "the actors' env-step budget reached (20,000 env steps, max_env_steps 20,000), and the learner took "
             "what the replay allowed"),
    # (the actors stopped short of it: something else ended the run, and the runtime says what)
    (30_000, "nothing left to happen (every source of events had ended)"),
    (None, "nothing left to happen (every source of events had ended)"),
])
def test_a_run_that_ends_on_the_actors_own_budget_names_it_as_the_stop_reason(tmp_path, capsys, budget, reason):
    """Regression (a newcomer's pass, session 52): the training graphs' actors stop at their shares of
    max_env_steps and the run ends when quiescent (their deterministic end), and the result said
    "stopped: run ended". Metrics is told the budget (``env_step_budget``), never acts on it (the run
    ends as before: by quiescence, not a request), and names it."""
    g = Graph()
    t = g.add(FakeTrainer(), name="actor", replicas=2)
    m = g.add(Metrics(str(tmp_path), env_step_budget=budget, live=False), name="metrics")
    g.connect(t.report, m.reports)
    res = run(g)
    assert res.stopped_by == "quiescence"
    assert json.loads((tmp_path / "summary.json").read_text())["stop_reason"] == reason
    assert f"stopped: {reason}\n" in capsys.readouterr().out


def test_an_on_policy_run_ended_by_the_budget_says_what_its_learner_did_without_a_replay():
    """PPO's stop reason said "the learner took what the replay allowed"; PPO has no replay."""
    from pathlib import Path

    from reactor.launch._app import build_graph

    root = Path(__file__).resolve().parents[2]
    assert build_graph(root / "apps" / "ppo.py", {}).nodes["metrics"].prototype.budget_end == (
        "the learner learned on their last rollouts")
    assert build_graph(root / "apps" / "dqn.py", {}).nodes["metrics"].prototype.budget_end == (
        "the learner took what the replay allowed")


class SlowStart(Reactor):
    """A reactor whose startup takes a while (as building networks and optimizers does)."""

    @reaction(triggers=[startup])
    def build(self) -> None:
        time.sleep(0.4)


class FailsAtStartup(Reactor):
    report = Output(Report)

    @reaction(triggers=[startup], effects=[report])
    def boom(self) -> None:
        raise RuntimeError("boom at startup")


def test_a_run_that_fails_before_metrics_started_reports_only_its_own_error(tmp_path, caplog):
    g = Graph()
    a = g.add(FailsAtStartup(), name="a")  # starts before metrics (declaration order)
    m = g.add(Metrics(str(tmp_path), live=False), name="metrics")
    g.connect(a.report, m.reports)
    with pytest.raises(RuntimeError, match="boom at startup"):
        run(g)
    assert not [r for r in caplog.records if "close_logs" in r.getMessage()], caplog.text
    assert not (tmp_path / "summary.json").exists()  # no summary of a run that never started


def test_the_clock_starts_after_every_startup_reaction(tmp_path):
    """wall_s counts training time, as SB3's learn() does: startup work is reported apart."""
    g = _graph(tmp_path, target=450.0, actors=1)
    g.add(SlowStart(), name="zz_slow")  # its startup runs after Metrics' own
    run(g)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["startup_s"] >= 0.4
    assert summary["evaluations"] and all(e["wall_s"] < 0.4 for e in summary["evaluations"])


def test_reactor_plot_writes_a_png_and_refuses_a_directory_without_metrics(tmp_path):
    run(_graph(tmp_path / "run", actors=1))
    out = tmp_path / "c.png"
    ok = subprocess.run([sys.executable, "-m", "reactor.cli", "plot", str(tmp_path / "run"), "-o", str(out)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "reactor.cli", "plot", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.startswith("reactor: ") and "has no metrics.csv" in bad.stderr
    # Plotting a run loads no torch (reactor.nodes imports its modules on first use).
    code = ("import sys; from reactor.cli import main; rc = main(['plot', sys.argv[1], '-o', sys.argv[2]]); "
            "print(rc, 'torch' in sys.modules)")
    quiet = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), str(out)], capture_output=True,
                           text=True, timeout=60)
    assert quiet.stdout.split()[-2:] == ["0", "False"], quiet.stderr


def test_a_command_line_run_reports_the_whole_commands_time(tmp_path):
    """summary.json's command_startup_s and command_s count from the `reactor run` command's start
    (interpreter, imports, graph, processes), not only from the graph's startup."""
    from pathlib import Path


    root = Path(__file__).resolve().parents[2]
    app = tmp_path / "app.py"
    app.write_text("from dataclasses import dataclass\n"
                   "from tests.nodes.test_metrics import _graph\n\n"
                   "@dataclass\nclass Config:\n    run_dir: str = ''\n\n"
                   "def build(config):\n    return _graph(config.run_dir, actors=1)\n")
    before = time.time()
    got = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(app), "--set", f"run_dir='{tmp_path / 'r'}'"],
                         capture_output=True, text=True, timeout=120, cwd=root)
    took = time.time() - before
    assert got.returncode == 0, got.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["startup_s"] <= summary["command_startup_s"] <= summary["command_s"] <= took
    assert summary["command_s"] >= summary["command_startup_s"] + summary["wall_s"] - 0.01
    # The command's own start (Python, imports, the app) came before the graph's.
    assert summary["command_startup_s"] > summary["startup_s"] + 0.05


def test_each_actor_gets_its_own_tensorboard_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(_graph(tmp_path, actors=2))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"actor-0/episode_return", "actor-1/episode_return", "actor-0/env_steps", "evaluator/eval_return"} <= tags
    assert [e.value for e in acc.Scalars("actor-1/episode_return")][:3] == [20.0, 40.0, 60.0]


def test_the_plot_marks_the_target_and_can_put_wall_time_on_the_x_axis(tmp_path):
    from reactor.nodes.plot import curves

    run(_graph(tmp_path, target=450.0, actors=1))
    fig = curves(tmp_path)  # the target from summary.json
    (ax,) = fig.axes
    assert ax.get_xlabel() == "env steps"
    target = [line for line in ax.get_lines() if line.get_label() == "target 450"]
    assert len(target) == 1 and list(target[0].get_ydata()) == [450.0, 450.0]
    evaluation = next(line for line in ax.get_lines() if line.get_label() == "evaluation")
    assert list(evaluation.get_xdata())[:2] == [1000.0, 2000.0]
    fig = curves(tmp_path, x="wall", target=None)
    (ax,) = fig.axes
    assert ax.get_xlabel() == "wall time (s)" and not [ln for ln in ax.get_lines() if ln.get_label().startswith("target")]
    walls = list(next(ln for ln in ax.get_lines() if ln.get_label() == "evaluation").get_xdata())
    assert walls == sorted(walls) and 0 <= walls[0] < 60
    with pytest.raises(ValueError, match="^x must be one of env_steps, wall, got 'time'$"):
        curves(tmp_path, x="time")
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "plot", str(tmp_path), "--x", "wall", "--target", "300",
                        "-o", str(tmp_path / "w.png")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG", p.stderr


def test_the_live_display_draws_a_table_of_the_runs_progress(tmp_path):
    """The rich live table, drawn on a captured terminal console: title, counters, returns."""
    from io import StringIO

    from rich.console import Console

    screen = StringIO()
    console = Console(file=screen, force_terminal=True, width=100, color_system=None)
    g = Graph()
    t = g.add(FakeTrainer(), name="actor", replicas=2)
    m = g.add(Metrics(str(tmp_path), target_return=None, live=True, title="Fake CartPole", console=console),
              name="metrics")
    g.connect(t.report, m.reports, delay_s=1e-6)
    run(g)
    text = screen.getvalue()
    assert "Fake CartPole" in text and "┌" in text and "│ env steps" in text  # a rich table with its title
    final = text[text.rindex("Fake CartPole"):]  # the last frame drawn: the run's end
    assert "env steps" in final and "20,000" in final  # 2 actors x 10 rounds x 1,000 steps
    assert "episodes" in final and "200" in final
    assert "eval return" in final and "1000.0 (best 1000.0)" in final
    assert "train return" in final and "200.0" in final


class SmallReturns(Reactor):
    """Reports the evaluations of an env whose returns are below 1 (docs/guide.md's Chain: its best
    return is 0.92), one a round."""

    report = Output(Report)
    again = Action()

    def __init__(self, evals: list[float]) -> None:
        self.evals = evals
        self.k = 0

    @reaction(triggers=[startup, again], effects=[report, again])
    def tick(self) -> None:
        self.k += 1
        self.report.send(Report(self.name, {"env_steps": 1000 * self.k, "episodes": 10 * self.k,
                                            "episode_return": -0.137}))
        self.report.send(Report("evaluator", {"eval_return": self.evals[self.k - 1]}))
        if self.k < len(self.evals):
            self.again.schedule(delay_s=0.001)


def test_a_small_return_is_shown_with_the_digits_that_tell_it_from_its_target(tmp_path, capsys):
    """Regression (a newcomer's pass over the guide, section 3): the Chain run to target_return=0.92 ended
    "evaluation return 0.9; stopped: evaluation return 0.9 >= target 0.92", the live table showed 0.9 for
    0.874 and 0.92 alike, and `reactor eval` "return 0.9 ± 0.0": every return was cut to one decimal. A
    return keeps one decimal where that is the value (500.0, 34.4), and three significant digits where one
    decimal would show another."""
    from io import StringIO

    from rich.console import Console

    from reactor.nodes.metrics import format_return

    screen = StringIO()
    console = Console(file=screen, force_terminal=True, width=100, color_system=None)
    g = Graph()
    t = g.add(SmallReturns([0.35, 0.874, 0.92]), name="actor")
    m = g.add(Metrics(str(tmp_path), target_return=0.92, live=True, title="Chain", console=console), name="metrics")
    g.connect(t.report, m.reports, delay_s=1e-6)
    run(g)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["stop_reason"] == "evaluation return 0.92 >= target 0.92"
    out = capsys.readouterr().out
    assert "evaluation return 0.92; stopped: evaluation return 0.92 >= target 0.92\n" in out, out
    final = screen.getvalue()
    final = final[final.rindex("Chain"):]
    assert "0.92 (best 0.92)" in final and "-0.137" in final, final
    assert [format_return(v) for v in (500.0, -182.4, 34.4, 0.9, 0.874, -0.01, 1.2345, 12.345, 0.0)] == [
        "500.0", "-182.4", "34.4", "0.9", "0.874", "-0.01", "1.23", "12.3", "0.0"]


HEADER = "wall_s,env_steps,source,name,value\n"


@pytest.mark.parametrize(("text", "message"), [
    ("a,b,c\n1,2,3\n", r"metrics\.csv: its header \['a', 'b', 'c'\] lacks the column\(s\) \['name', 'source', 'value', "
                       r"'env_steps'\]: not a metrics\.csv of the Metrics node$"),
    (HEADER + "1.0,10,evaluator,eval_return,9\nx,y,evaluator,eval_return,z\n",
     r"metrics\.csv, line 3: env_steps 'y' and value 'z' are not both numbers$"),
    (HEADER + "1.0,10,evaluator,eval_return\n", r"metrics\.csv, line 2: env_steps '10' and value None are not both numbers$"),
    ("\x00\xff\xfe garbage", r"metrics\.csv is not UTF-8 text: not a metrics\.csv of the Metrics node$"),
    ("", r"metrics\.csv is empty: no values to plot$"),
    # A line is read whole before the csv module's field limit applies: one of 300 MB took 625 MB.
    (HEADER + "1.0,10,evaluator,eval_return," + "9" * 2**20 + "\n",
     r"metrics\.csv, line 2: longer than 65536 characters: not a metrics\.csv of the Metrics node$"),
])
def test_a_metrics_csv_of_another_shape_is_one_line_naming_the_file_and_line(tmp_path, text, message):
    """An edited or foreign metrics.csv gave `reactor plot` a KeyError traceback, or a ValueError that
    named neither the file nor the line."""
    (tmp_path / "metrics.csv").write_bytes(text.encode("latin-1"))
    os.mkfifo(tmp_path / "summary.json")  # (read as a regular file only: a FIFO here hung the plot)
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "plot", str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert re.match(rf"^reactor: {re.escape(str(tmp_path))}/{message}", p.stderr.strip()), p.stderr
    assert not (tmp_path / "curves.png").exists()



def test_reactor_plot_says_in_one_line_what_is_wrong_with_its_out_path_and_prints_the_file_it_wrote(tmp_path):
    """A newcomer's pass (h3): `-o missing/dir/c.png` was PIL's FileNotFoundError traceback and "reactor: the
    run failed"; `-o somewhere` (no suffix, or a directory: the run's own) wrote somewhere.png and printed
    `somewhere`; `-o c.txt` was matplotlib's traceback."""
    run(_graph(tmp_path / "run", actors=1))

    def plot(out: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "reactor.cli", "plot", str(tmp_path / "run"), "-o", out],
                              capture_output=True, text=True, timeout=60)

    for out, words in ((tmp_path / "no" / "c.png", f"reactor: {tmp_path / 'no' / 'c.png'}: its directory "),
                       (tmp_path / "run", f"reactor: {tmp_path / 'run'} is a directory: name the image file"),
                       (tmp_path / "c.txt", f"reactor: {tmp_path / 'c.txt'}: matplotlib writes no '.txt' files")):
        p = plot(str(out))
        assert p.returncode == 2 and p.stderr.startswith(words) and len(p.stderr.splitlines()) == 1, p.stderr
    assert not (tmp_path / "run.png").exists()
    p = plot(str(tmp_path / "curves"))
    assert p.returncode == 0 and p.stdout.strip() == str(tmp_path / "curves.png"), p.stderr
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_reactor_plot_of_a_run_that_is_starting_says_it_has_no_metrics_yet(tmp_path):
    """A run's directory holds run.json before its metrics.csv: plotting it then asked "is it a run directory
    written by a training app?" (a newcomer's pass, h3)."""
    from reactor._runclaim import claim_run_dir
    from reactor.nodes.plot import curves

    claim = claim_run_dir(tmp_path / "run", "a-run-id", resume=False, who="metrics")  # what a starting run holds
    try:
        with pytest.raises(FileNotFoundError, match=r"has no metrics\.csv yet: its run \(run\.json\) has not started"):
            curves(tmp_path / "run")
    finally:
        claim.release()


@pytest.mark.parametrize("target", ["nan", "inf", "1e999"])
def test_reactor_plot_refuses_a_target_that_is_not_a_finite_number(tmp_path, target):
    """`--target nan` was taken and drew no line, in silence (a newcomer's pass, session 56)."""
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "plot", str(tmp_path), "--target", target],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and f"argument --target: a finite number expected, got '{target}'" in p.stderr, p.stderr


class OddReporter(Reactor):
    """Reports a loss as a one-element tensor (as a learner's metrics may be), then a value that is not a number."""

    report = Output(Report)
    again = Action()

    @reaction(triggers=[startup], effects=[report, again])
    def first(self) -> None:
        import torch

        self.report.send(Report(self.name, {"loss": torch.tensor(0.5)}))
        self.again.schedule(delay_s=0.001)

    @reaction(triggers=[again], effects=[report])
    def second(self) -> None:
        self.report.send(Report(self.name, {"note": "warming up"}))


def test_a_report_value_that_is_not_a_number_is_refused_naming_its_source_and_name(tmp_path):
    """Regression (the audit of the ValueErrors raised at run time in reactor/nodes): a Report from a node of
    the user's own holding a value that is not a number ended the run in Python's words, naming no node and no
    value ("could not convert string to float: 'warming up'"; None was a TypeError traceback in Metrics, read
    as reactor's bug), and a one-element tensor was written to metrics.csv as "tensor(0.5000)". The refusal
    names the source and the value; a tensor counts as its float."""
    g = Graph()
    r = g.add(OddReporter(), name="mine")
    m = g.add(Metrics(str(tmp_path), live=False), name="metrics")
    g.connect(r.report, m.reports)
    with pytest.raises(ValueError, match=r"^metrics: the Report of 'mine' holds 'note' = 'warming up', not a number: a "
                                         r"Report's values are numbers by name \(counters such as env_steps"):
        run(g)
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [(r["source"], r["name"], r["value"]) for r in csv.DictReader(f)] == [("mine", "loss", "0.5")]


class StepsOnly(Reactor):
    """Reports env steps and nothing to plot (a run too short for an episode's end)."""

    report = Output(Report)

    @reaction(triggers=[startup], effects=[report])
    def tick(self) -> None:
        self.report.send(Report(self.name, {"env_steps": 64}))


@pytest.mark.parametrize("case", ["no-returns", "out-is-a-directory"])
def test_a_plot_that_cannot_be_drawn_is_one_line_naming_the_file_and_why_and_the_run_goes_on(tmp_path, caplog, case):
    """Regression: Metrics passed over every ValueError of its end-of-run plot in silence (no return in
    metrics.csv yet, a metrics.csv of another shape): no curves.png, and nothing said why. It is one warning
    naming the image and why, and the run ends as it would (its summary written, no error). A run with no
    return (one stopped by a Ctrl-C before its first episode ended, h30) is not told that ``reactor plot``
    draws it later: that says the same, having no more to draw."""
    g = Graph()
    if case == "no-returns":
        src = g.add(StepsOnly(), name="actor")
        why = "the run ended before any episode or evaluation ended \\(metrics.csv holds no return\\)"
    else:
        src = g.add(FakeTrainer(rounds=2), name="actor")
        (tmp_path / "curves.png").mkdir()
        why = f"{tmp_path / 'curves.png'} is a directory: name the image file to write \\(e.g. .*\\)"
    m = g.add(Metrics(str(tmp_path), live=False), name="metrics")
    g.connect(src.report, m.reports)
    with caplog.at_level(logging.WARNING, logger="reactor.metrics"):
        res = run(g)
    assert res.stopped_by == "quiescence"
    said = [r.getMessage() for r in caplog.records if "plot" in r.getMessage()]
    later = "" if case == "no-returns" else rf" \(`reactor plot {re.escape(str(tmp_path))}` draws it later\)"
    assert len(said) == 1 and re.fullmatch(
        rf"metrics: no plot {re.escape(str(tmp_path / 'curves.png'))}: {why}{later}", said[0]), said
    assert json.loads((tmp_path / "summary.json").read_text())["env_steps"] > 0
    assert not (tmp_path / "curves.png").is_file()


def test_a_run_over_hosts_prints_its_last_lines_only_from_a_summary_that_holds_a_return_or_none(tmp_path, capsys):
    """The result lines of a run over hosts come from the summary that came back with its files: a
    ``last_eval_return`` that is not a number (not a summary Metrics wrote) prints no line, where it was
    printed as if the run had stopped before its first evaluation."""
    from reactor.cli._run import _print_training_result

    for last, expected in ((12.5, "evaluation return 12.5; stopped: y\n"),
                           (None, "evaluation return none (the run stopped before its first evaluation); stopped: y\n"),
                           ("12.5", None), (True, None), ([1], None)):
        _print_training_result({"summary": {"last_eval_return": last, "stop_reason": "y"}, "run_dir": str(tmp_path)})
        out = capsys.readouterr().out
        assert out.startswith(expected) if expected else out == "", (last, out)
