"""Metrics: progress of a training run — live display, CSV and TensorBoard logs, stop conditions.

Every node sends :class:`Report` messages (cumulative counters such as ``env_steps``, ``updates``,
and latest values such as ``loss`` or ``eval_return``). Metrics keeps the latest report of each
source, sums counters over sources, and

* appends one CSV row per reported value to ``RUN_DIR/metrics.csv`` (``wall_s, env_steps, source,
  name, value``; flushed at each evaluation and at least every second; a restarted life appends to
  its earlier lives' rows) and the same to TensorBoard (``RUN_DIR/tb``; each instance its own tags:
  ``actor-0/episode_return``, ``actor-1/...``, ``learner/loss``);
* keeps the totals whole across restarts: a source whose counter goes down started a new life (a
  restarted actor counts from 0 again), so its new value counts whole (but not ``updates``, which a
  learner takes back from its checkpoint: :data:`FROM_CHECKPOINT`); a restarted Metrics takes
  each source's last counters and the totals from ``RUN_DIR/metrics.counters.json``, which it
  rewrites with the CSV's flushes (a source's reports after that count as the difference, as before).
  So ``env_steps`` in the CSV never goes back, and ``max_env_steps`` bounds the run's steps over its
  restarts. A resumed run (``resume=True``) goes on from the same file: its env steps count on from
  the earlier run's (the CSV, TensorBoard and the plot continue), and its ``max_env_steps`` is a
  budget of its own on top of them (the earlier run's steps are ``budget_base`` there), as
  Stable-Baselines3's ``learn(..., reset_num_timesteps=False)`` counts.
* shows a live table (rich) when stdout is a terminal, or a progress line every few seconds;
* asks the run to stop when an evaluation reaches ``target_return`` or the actors' total env steps
  reach ``max_env_steps``;
* at shutdown writes ``RUN_DIR/summary.json`` and the learning-curve plot ``RUN_DIR/curves.png``; the
  summary's ``updates`` is the learner's own final count (``RUN_DIR/learner.json``, which it waits for while
  the learner's shutdown runs in another process: :mod:`reactor.nodes._learnerend`), not its last report's.

Wall-clock figures (``wall_s``, rates) are for people: no other node sees them, so deterministic
runs stay deterministic. ``wall_s`` counts from the end of this process's startup (every reactor's
startup reaction ran: networks and optimizers built, environments made, logs opened), which is
where a training loop such as Stable-Baselines3's ``learn`` starts its clock; ``startup_s`` in the
summary is what startup took, and under ``reactor run`` ``command_startup_s`` and ``command_s`` are the
time from the command's start to training and to the summary. (In async mode a startup reaction that awaits may still be running
then: the clock follows the ones that do not suspend.)
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import numbers
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._files import read_small_json, refuse_file_links, replace_small
from .._graph import plain_name
from .._reactor import Action, Input, Reactor, reaction, shutdown, startup
from .._runclaim import claim_run_dir, release_run_dir
from ._learnerend import learner_end
from .plot import MAX_LINE_CHARS  # (a longer line, of an edited file, is passed over, never read whole)
from .train_messages import Report

__all__ = ["Metrics"]

#: Values that are cumulative per source and summed over sources.
COUNTERS = ("env_steps", "episodes", "updates", "samples", "inserts")
#: Counters a source takes back from its checkpoint when it starts again (the learner's updates): one
#: that goes down went back to an older checkpoint, and counts as the difference, as the source does.
#: The others start from 0 in a source's new life (an actor's env steps), and a drop counts whole.
FROM_CHECKPOINT = ("updates",)
#: Counts past this are refused in a counts file (float64 holds every integer below it, TensorBoard's steps int64).
MAX_COUNT = 2**53
CSV_HEADER = ["wall_s", "env_steps", "source", "name", "value"]
FLUSH_PERIOD_S = 1.0  # metrics.csv is on disk to within this (and at each evaluation)
COUNTS_FILE = "metrics.counters.json"  # the counters a restarted life goes on from


class Metrics(Reactor):
    """Collects :class:`Report` messages; logs, displays and stops the run on its targets.

    Args:
        run_dir: directory for ``metrics.csv``, ``tb/``, ``summary.json`` and ``curves.png``.
        target_return: stop when a report carries ``eval_return >= target_return`` (None: never).
        max_env_steps: stop when the actors' total env steps reach this (None: never).
        live: show progress on stdout (a live table on a terminal, a progress line every few seconds
            otherwise).
        title: shown above the live table.
        console: a ``rich.console.Console`` to draw the live table on instead of stdout (a notebook's,
            a test's); in-process only.
        resume: the run goes on from its run directory's checkpoints (``resume=True``): its
            metrics.csv goes on too, as a restarted life's does.
        env_step_budget: the actors' own budget (they stop at their shares, and the run ends when
            nothing is left to do: the training graphs' deterministic end), named as the stop reason
            when the run ended with it reached and no other reason; never acted on here.
        budget_end: what the learner did after the actors' budget, in that stop reason (an on-policy
            learner has no replay: ``"the learner learned on their last rollouts"``).
        update_budget: the learner's own budget of updates (the offline app's ``updates``), named as
            the stop reason when the run ended with it reached and no other reason; never acted on here.
    """

    reports = Input(Report, required=True)
    started = Action()

    def __init__(
        self,
        run_dir: str,
        target_return: float | None = None,
        max_env_steps: int | None = None,
        live: bool = True,
        title: str = "",
        console: Any = None,
        resume: bool = False,
        env_step_budget: int | None = None,
        budget_end: str = "the learner took what the replay allowed",
        update_budget: int | None = None,
    ) -> None:
        # (a string's target, given to a builder from Python, failed the run at its first evaluation: a
        # TypeError comparing the return with it)
        if target_return is not None and (isinstance(target_return, bool) or not isinstance(target_return, numbers.Real)
                                          or math.isnan(target_return)):
            raise ValueError(f"Metrics target_return must be a number or None, got {target_return!r:.100}")
        self.run_dir = run_dir
        self.resume = resume
        self.console = console
        self.target_return = target_return
        self.max_env_steps = max_env_steps
        self.env_step_budget = env_step_budget
        self.budget_end = budget_end
        self.update_budget = update_budget
        self.live = live
        self.title = title
        self.latest: dict[str, dict[str, float]] = {}
        self.totals: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
        self.best_eval: float | None = None
        self.last_eval: float | None = None
        self.last_eval_updates: int | None = None  # the learner updates of the weights it evaluated (their version)
        self.evals: list[tuple[float, float, float]] = []  # (wall_s, env_steps, eval_return)
        self.stop_reason = ""
        self.recorded = False  # a report reached this life (a failed one without any leaves no summary)

    @reaction(triggers=[startup], effects=[started])
    def open_logs(self) -> None:
        """Claim the run directory and read what an earlier life or run left there; write nothing there
        yet (:meth:`_begin`, at the first report): a start that another node refuses (a resume whose
        checkpoint does not load) left a new TensorBoard file, a rewritten counts file and a CSV cut
        back to its counts in the run directory it refused."""
        self.dir = Path(self.run_dir)
        refuse_file_links(self.dir)
        self._run_claim = claim_run_dir(self.dir, self.run_id, resume=self.resume,
                                        who=self.name)
        self.t_start = self.t0 = time.monotonic()
        self.started.schedule()  # fires after every startup reaction of this tag (a later microstep)
        path = self.dir / "metrics.csv"
        # A restarted life (restart policies) goes on with its run's file: the earlier lives' rows stay, its
        # wall clock goes on from their last row, and their evaluations count in the summary. So does a
        # resumed run (it started the file anew, and a resume that failed had wiped the run's metrics).
        self.budget_base = 0.0  # the env steps before this run's (a resumed run's budget is on top of them)
        self._csv_cut: int | None = None  # the length metrics.csv is cut back to when the run begins
        if self.restarts > 0 or self.resume:
            self._take_counts(self.dir / COUNTS_FILE, path)
        earlier = _earlier_rows(path, self._csv_cut) if self.restarts > 0 or self.resume else None
        # Not a metrics.csv this node can go on with (a damaged header, a byte that is not UTF-8): kept
        # beside the new one when the run begins, never truncated (the run's whole history went, in silence).
        self._csv_unreadable = earlier is None and (self.restarts > 0 or self.resume) and path.exists()
        self._earlier = earlier is not None
        self.wall_offset = 0.0
        if earlier is not None:
            self.wall_offset, self.evals, keep = earlier
            if keep is not None:  # (a row cut short by the earlier life's death: cut off)
                self._csv_cut = keep
            returns = [r for _, _, r in self.evals]
            self.last_eval, self.best_eval = (returns[-1], max(returns)) if returns else (None, None)
        self._begun = False
        self.display = _Display(self.title or str(self.dir), enabled=self.live, console=self.console)
        self.last_shown = self.last_flushed = 0.0

    def _begin(self) -> None:
        """The run is under way (a report came, or it ended without failing): make this life's changes to
        the run directory (the CSV cut back to the counts its earlier life saved, or an unreadable one kept
        aside; the header of a new one; the counts; TensorBoard's file)."""
        if self._begun:
            return
        self._begun = True
        path = self.dir / "metrics.csv"
        if self._csv_unreadable:
            kept = path.with_name(f"metrics.unreadable-{int(time.time())}.csv")
            os.replace(path, kept)
            logging.getLogger("reactor.metrics").warning(
                "%s: %s is not a metrics file this run can go on with (its header or encoding is damaged): kept as "
                "%s, and a new metrics.csv starts", self.name, path, kept.name)
        elif self._csv_cut is not None:
            with open(path, "rb+") as f:  # (a regular file: refuse_file_links)
                if f.seek(0, os.SEEK_END) > self._csv_cut:
                    f.truncate(self._csv_cut)
        self.csv_file = open(path, "a" if self._earlier else "w", newline="", encoding="utf-8")  # noqa: SIM115 - closed at shutdown
        self.csv = csv.writer(self.csv_file)
        if not self._earlier:
            self.csv.writerow(CSV_HEADER)
        self.csv_file.flush()
        self._save_counts()  # (this run's, from the start: never an earlier run's in this directory)
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.dir / "tb"))

    @reaction(triggers=[started])
    def start_clock(self) -> None:
        self.t0 = time.monotonic()
        self.t0_epoch = time.time()
        # The plot at the end imports matplotlib (0.4 s on a 2-core machine): do it now, beside training
        # (not beside the startup reactions, which it held back), so the command ends that much sooner
        # after training does (benchmarks/bench_startstop.py).
        import threading

        threading.Thread(target=_import_plotting, name="metrics-plot-import", daemon=True).start()

    @reaction(triggers=[reports])
    def record(self, reports: Report) -> None:
        src, values = reports.source, _numbers(self.name, reports)
        self.recorded = True
        self._begin()
        before = self.latest.get(src, {})
        for k in COUNTERS:
            if k in values:
                now, was = float(values[k]), float(before.get(k, 0.0))
                # (down: the source's new life, from 0, unless it counts on from its checkpoint)
                self.totals[k] += now - was if now >= was or k in FROM_CHECKPOINT else now
        self.latest[src] = {**before, **values}
        wall = time.monotonic() - self.t0 + self.wall_offset
        steps = self.totals["env_steps"]
        for name, value in values.items():
            self.csv.writerow([f"{wall:.3f}", int(steps), src, name, value])
            self.tb.add_scalar(f"{plain_name(src)}/{name}", float(value), int(steps))
        if "eval_return" in values:
            ret = float(values["eval_return"])
            self.last_eval = ret
            version = values.get("version")  # (the Evaluator's: the learner updates of the weights evaluated)
            self.last_eval_updates = int(version) if isinstance(version, numbers.Real) and math.isfinite(version) else None
            self.best_eval = ret if self.best_eval is None else max(self.best_eval, ret)
            self.evals.append((wall, steps, ret))
            if self.target_return is not None and ret >= self.target_return and not self.stop_reason:
                self.stop_reason = f"evaluation return {format_return(ret)} >= target {self.target_return:g}"
                self.request_stop()
        if self.max_env_steps is not None and steps - self.budget_base >= self.max_env_steps and not self.stop_reason:
            self.stop_reason = f"{int(steps - self.budget_base)} env steps >= max_env_steps {self.max_env_steps}"
            if self.budget_base:
                self.stop_reason += f" (on top of the earlier run's {int(self.budget_base)}, resumed from)"
            self.request_stop()
        now = time.monotonic()
        # metrics.csv is current to an evaluation, and to the second otherwise (for whoever tails it: a
        # user, a plot, a test waiting for an evaluation); a write per report would cost a syscall each.
        if "eval_return" in values or now - self.last_flushed >= FLUSH_PERIOD_S:
            self.last_flushed = now
            self.csv_file.flush()
            self._save_counts()
        if now - self.last_shown >= 0.5:
            self.last_shown = now
            self.display.show(self._rows(now - self.t0 + self.wall_offset))

    def _rows(self, wall: float) -> list[tuple[str, str]]:
        t = self.totals
        rate = (lambda k: f"{t[k] / wall:,.0f}/s") if wall > 0 else (lambda k: "-")
        ep_returns = [v["episode_return"] for v in self.latest.values() if "episode_return" in v]
        rows = [
            ("wall", f"{wall:,.1f} s"),
            ("env steps", f"{int(t['env_steps']):,} ({rate('env_steps')})"),
            ("episodes", f"{int(t['episodes']):,}"),
            ("updates", f"{int(t['updates']):,} ({rate('updates')})"),
            ("samples", f"{int(t['samples']):,} ({rate('samples')})"),
        ]
        if ep_returns:
            rows.append(("train return", format_return(sum(ep_returns) / len(ep_returns))))
        if self.last_eval is not None:
            rows.append(("eval return", f"{format_return(self.last_eval)} (best {format_return(self.best_eval)})"))
        return rows

    def _save_counts(self) -> None:
        """Write the totals and each source's last counters for a restarted life (:meth:`_take_counts`),
        with the length of metrics.csv they go with (just flushed): a new file put in place by a rename,
        never written through a link planted at its name."""
        sources = {src: {k: v[k] for k in COUNTERS if k in v} for src, v in self.latest.items()}
        data = json.dumps({"format": 1, "run_id": self.run_id, "totals": self.totals, "sources": sources,
                           "csv_nbytes": self.csv_file.tell(), "budget_base": self.budget_base}).encode()
        try:
            replace_small(self.dir / COUNTS_FILE, data)
        except OSError as e:  # (a full disk: the CSV goes on)
            # The earlier save goes too: a restart must not cut the CSV back to it (rows written since,
            # evaluations among them, would go). A restart then counts from the live sources' counters.
            with contextlib.suppress(OSError):
                (self.dir / COUNTS_FILE).unlink()
            if not getattr(self, "_save_failed", False):  # (once: this is tried every second)
                self._save_failed = True
                logging.getLogger("reactor.metrics").warning("%s: cannot save %s (a restart of this run will count "
                                                             "its totals from the live sources' counters): %s",
                                                             self.name, COUNTS_FILE, e)

    def _take_counts(self, path: Path, csv_path: Path) -> None:
        """The totals and sources' counters an earlier life saved at ``path``, and ``csv_path``'s length
        to cut it back to when the run begins (:meth:`_begin`), the rows they went with: the rows its life wrote after its last save (under a second's, none an
        evaluation: each is saved at once) would otherwise hold totals the counters do not, and the new
        life's first rows would go back from them. A resumed run (a first life) takes the earlier run's
        totals as its ``budget_base``. A file that is not of that shape, one a restarted life finds saved
        by another run, or one whose length is not the end of a row of ``csv_path`` or would cut off an
        evaluation, is logged and skipped, and a missing one (a run directory of an earlier version)
        skipped: the totals then start from the live sources' counters, and the CSV is left whole."""
        if not os.path.lexists(path):
            return
        try:
            data = read_small_json(path)
            ok = (isinstance(data, dict) and data.get("format") == 1 and isinstance(data.get("totals"), dict)
                  and isinstance(data.get("sources"), dict) and type(data.get("csv_nbytes")) is int
                  and data["csv_nbytes"] >= 0 and _counts_ok({"env_steps": data.get("budget_base", 0)})
                  and all(_counts_ok(c) for c in (data["totals"], *data["sources"].values()))
                  and all(isinstance(src, str) for src in data["sources"]) and isinstance(data.get("run_id"), str))
            if not ok:
                raise ValueError(f"{path}: not a {COUNTS_FILE} of the Metrics node")
            if self.restarts > 0 and data["run_id"] != self.run_id:
                raise ValueError(f"{path} was saved by run {data['run_id'][:80]!r}, not by this one ({self.run_id})")
            self._csv_cut = _cut_back(csv_path, data["csv_nbytes"])  # (made when the run begins: _begin)
        except (OSError, ValueError) as e:
            logging.getLogger("reactor.metrics").warning("%s: env steps and other totals count from the live "
                                                         "sources' counters again: %s", self.name, e)
            return
        self.totals.update({k: float(v) for k, v in data["totals"].items()})
        self.latest = {src: {k: float(v) for k, v in c.items()} for src, c in data["sources"].items()}
        self.budget_base = float(data.get("budget_base", 0)) if self.restarts > 0 else self.totals["env_steps"]

    @reaction(triggers=[shutdown])
    async def close_logs(self) -> None:
        try:
            if hasattr(self, "dir"):
                await self._take_learner_end()
            self._close_logs()
        finally:
            release_run_dir(self)

    async def _take_learner_end(self) -> None:
        """The learner's final update count, from ``learner.json`` (:mod:`reactor.nodes._learnerend`), in the
        totals as its last report: its reports come every ``report_every`` updates and one sent at shutdown
        is not delivered, so the summary counted the last one's (300 of a stopped run's 353). Waited for
        (while its shutdown runs in another process) unless this run failed or this process was ended from
        outside: a failed life's survivors have seconds to end (a restart policy's next life of this node
        waits for them), and a SIGTERM holds a shutdown 10 s at most."""
        end = await learner_end(self.dir, self.run_id, wait=self.stopped_by not in ("failure", "terminated"),
                                who=self.name)
        if end is None:
            return
        src, updates = end
        before = self.latest.get(src, {})
        self.totals["updates"] += updates - float(before.get("updates", 0.0))  # (FROM_CHECKPOINT: the difference)
        self.latest[src] = {**before, "updates": float(updates)}

    def _close_logs(self) -> None:
        if not hasattr(self, "display") or (self.stopped_by == "failure" and not self.recorded):
            # The run failed before our startup finished, or before anything reached us (a node refused
            # what it was given: another process's startup, as under `single` where ours came after):
            # nothing to report, and the run directory's files stay as they were (an earlier life's
            # summary and plot, an earlier run's metrics and counts: nothing was written, _begin).
            live = getattr(getattr(self, "display", None), "live", None)
            if live is not None:
                live.stop()  # (the terminal back as it was)
            for f in (getattr(self, "csv_file", None), getattr(self, "tb", None)):
                if f is not None:
                    f.close()
            return
        self._begin()  # (a run that ended well before any report: its files all the same)
        wall = time.monotonic() - self.t0 + self.wall_offset
        steps = self.totals["env_steps"] - self.budget_base
        if not self.stop_reason and self.env_step_budget is not None and steps >= self.env_step_budget:
            self.stop_reason = (f"the actors' env-step budget reached ({int(steps):,} env steps, max_env_steps "
                                f"{self.env_step_budget:,}{' on top of the resumed run' if self.budget_base else ''}), "
                                f"and {self.budget_end}")
        if not self.stop_reason and self.update_budget is not None and self.totals["updates"] >= self.update_budget:
            # (an offline run that ran its updates said "nothing left to happen")
            self.stop_reason = (f"the learner's update budget reached ({int(self.totals['updates']):,} updates, "
                                f"updates {self.update_budget:,})")
        self.display.close(self._rows(wall))
        self.csv_file.flush()
        self._save_counts()
        self.csv_file.close()
        self.tb.close()
        summary = {
            "wall_s": wall,
            "startup_s": self.t0 - self.t_start,
            "env_steps": int(self.totals["env_steps"]),
            "updates": int(self.totals["updates"]),
            "episodes": int(self.totals["episodes"]),
            "last_eval_return": self.last_eval,
            # How old that figure is at the end (a run that stops on its budget stops between evaluations):
            # the updates of the weights it evaluated, and the env steps when it came.
            "last_eval_updates": self.last_eval_updates,
            "last_eval_env_steps": int(self.evals[-1][1]) if self.evals else None,
            "best_eval_return": self.best_eval,
            "target_return": self.target_return,
            "reached_target": self.best_eval is not None
            and self.target_return is not None
            and self.best_eval >= self.target_return,
            "stop_reason": self.stop_reason or _RUNTIME_STOPS.get(self.stopped_by or "", "run ended"),
            "evaluations": [{"wall_s": w, "env_steps": s, "eval_return": r} for w, s, r in self.evals],
        }
        # The whole command's time (`reactor run` sets REACTOR_COMMAND_T0 when it starts; its
        # processes inherit it): from the command's start to training, and to this summary.
        began = os.environ.get("REACTOR_COMMAND_T0")
        if began:
            with contextlib.suppress(ValueError):
                summary["command_startup_s"] = round(getattr(self, "t0_epoch", time.time()) - float(began), 3)
                summary["command_s"] = round(time.time() - float(began), 3)
        try:  # (whole or not at all: a full disk left a cut summary.json, and the earlier life's was gone)
            replace_small(self.dir / "summary.json", json.dumps(json_safe(summary), indent=2).encode())
        except OSError as e:
            logging.getLogger("reactor.metrics").warning("%s: cannot write %s: %s (the run's figures are in "
                                                         "metrics.csv)", self.name, self.dir / "summary.json",
                                                         e.strerror or e)
        plot = self._plot()
        # The result, also without live progress: a run that ends silently leaves its user guessing.
        print(result_lines(self.last_eval, summary["stop_reason"], self.dir, plot, eval_age(summary, self.dir)),
              flush=True)

    def _plot(self) -> Any:
        """Draw ``RUN_DIR/curves.png``; the path, or None when it cannot be drawn, said in one line
        naming the file and why: no return in metrics.csv (a run stopped before its first episode ended;
        ``reactor plot`` is not offered, as it has no more to draw), a metrics.csv of
        another shape, a full disk, matplotlib failing or missing. Never an error: the run's figures
        are in metrics.csv whatever becomes of a picture of them (a full disk failed the run at its
        very end; a ValueError was passed over in silence, and the run's user looked for the file)."""
        out = self.dir / "curves.png"
        from .plot import NoReturnsError

        try:
            from .plot import plot_run

            return plot_run(self.dir, out, target=self.target_return)
        except NoReturnsError:  # (an early Ctrl-C: `reactor plot` later has no more to draw, so it is not offered)
            logging.getLogger("reactor.metrics").warning("%s: no plot %s: the run ended before any episode or "
                                                         "evaluation ended (metrics.csv holds no return)", self.name,
                                                         out)
            return None
        except (OSError, ValueError) as e:  # (reactor's own one-line reasons, the file named in most)
            why = e.strerror if isinstance(e, OSError) and e.strerror and not e.filename else str(e)
        except Exception as e:  # noqa: BLE001 - a picture's library failing ends no run
            why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]:.300}"
        logging.getLogger("reactor.metrics").warning("%s: no plot %s: %s (`reactor plot %s` draws it later)", self.name,
                                                     out, why, self.dir)
        return None


#: Why a run ended that none of this node's own reasons (a target, a budget) explains: the runtime's.
_RUNTIME_STOPS = {
    "signal": "a signal (Ctrl-C or SIGTERM)",
    "failure": "the run failed (its error names the worker or reaction)",
    "terminated": "this node's process was ended from outside (SIGTERM), or reactor.run was interrupted where a loop "
                  "runs (a notebook's stop button)",
    "stop_time": "the run's stop time (--stop-s)",
    "request": "a node asked the run to stop",
    "replay": "the replay reached the end of its recording",
    "quiescence": "nothing left to happen (every source of events had ended)",
}


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float as None: JSON has no such numbers (Python writes a bare
    NaN, which a strict parser refuses; a run with NaN rewards wrote its summary so)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _numbers(me: str, report: Report) -> dict[str, Any]:
    """``report``'s values, each a number (a one-element tensor, as a learner's metrics may be, as its float).

    Raises:
        ValueError: a value that is not a number, or a source or name that is not a string, naming the report's
            source and the value's name: a node's report (one of its user's own nodes: reactor's send numbers).
            Python's float() said it as "could not convert string to float: 'x'" (a refusal naming nothing), or
            as a TypeError traceback in this node (read as reactor's bug).
    """
    src, values = report.source, report.values
    if not isinstance(src, str) or not isinstance(values, dict):
        raise ValueError(f"{me}: a Report's source must be a node's name and its values a dict of numbers by name, got "
                         f"source {src!r:.80} and values {type(values).__name__}")
    out: dict[str, Any] = {}
    for k, v in values.items():
        if not isinstance(k, str):
            raise ValueError(f"{me}: the Report of {src!r:.80} names a value {k!r:.80}: names are strings")
        if isinstance(v, numbers.Real):
            out[k] = v
            continue
        try:
            out[k] = float(v)
        except (TypeError, ValueError, RuntimeError):  # (torch: a tensor of more than one element)
            raise ValueError(f"{me}: the Report of {src!r:.80} holds {k!r:.80} = {v!r:.80}, not a number: a Report's "
                             f"values are numbers by name (counters such as env_steps, latest values such as loss)"
                             ) from None
    return out


def format_return(value: float) -> str:
    """An episode return as a run's lines and ``reactor eval`` show it: one decimal (``500.0``,
    ``-182.4``), or three significant digits where one decimal would round a small return to another
    (``0.92``, not ``0.9``: the guide's Chain, run to ``target_return=0.92``, ended "evaluation return
    0.9 >= target 0.92")."""
    one = f"{value:.1f}"
    if abs(value) >= 10 or not math.isfinite(value) or float(one) == value:
        return one
    return f"{value:.3g}"


def result_lines(last_eval: float | None, stop_reason: str, run_dir: Any, plot: Any = None, age: str = "") -> str:
    """The two lines a training run ends with: its last evaluation (``age``: how old it is, :func:`eval_age`)
    and why it stopped, then where its files are (Metrics prints them on its host; ``reactor run --hosts``
    again at the terminal, from the summary)."""
    # (none: the run stopped before its first evaluation, e.g. at an early Ctrl-C; a bare "-" read as a
    # return that had gone missing)
    ev = "none (the run stopped before its first evaluation)" if last_eval is None else format_return(last_eval)
    host = f" (on the daemon's host, {socket.gethostname()})" if os.environ.get("REACTOR_JOB_DIR") else ""
    return (f"evaluation return {ev}{f' ({age})' if age else ''}; stopped: {stop_reason}\nrun directory "
            f"{job_path(run_dir)}{host}" + (f"; plot {job_path(plot)}" if plot else ""))


def job_path(path: Any) -> str:
    """A path as a run's last lines name it: as given, or in a job a daemon runs (``REACTOR_JOB_DIR`` set)
    absolute: the job's working directory is its own, on the daemon's host, and ``runs/...`` meant nothing to
    whoever submitted it."""
    if os.environ.get("REACTOR_JOB_DIR"):
        with contextlib.suppress(OSError, RuntimeError):
            return str(Path(path).resolve())
    return str(path)


def eval_age(summary: dict[str, Any], run_dir: Any) -> str:
    """How old a run's last evaluation is at its end, in words for its result line; "" when it is the end's
    (no update or env step came after it) or it stopped the run (its target reached), or there is none.

    A run that stops on its budget (or a signal, a stop time) stops between evaluations: its line gave the
    last periodic figure as the run's, up to ``eval_every_updates`` old, without a word. It says the weights'
    update and the env steps of that evaluation, the run's at its end, and that ``reactor eval`` evaluates the
    final weights (an evaluation at every stop would cost each run its episodes, and the on-policy learner
    does not know its last update)."""
    if summary.get("last_eval_return") is None or summary.get("reached_target"):
        return ""
    updates, steps = summary.get("updates"), summary.get("env_steps")
    at_updates, at_steps = summary.get("last_eval_updates"), summary.get("last_eval_env_steps")
    # (by the updates where they are known: the final weights are those evaluated when no update came after,
    # however many env steps did)
    if isinstance(at_updates, int) and isinstance(updates, int):
        if at_updates >= updates:
            return ""
    elif not (isinstance(at_steps, int) and isinstance(steps, int) and at_steps < steps):
        return ""
    of = f"of the weights at update {at_updates:,}, " if isinstance(at_updates, int) else ""
    when = f"at {at_steps:,} env steps" if isinstance(at_steps, int) else ""
    end = " and ".join(x for x in (f"update {updates:,}" if isinstance(updates, int) else "",
                                   f"{steps:,} env steps" if isinstance(steps, int) else "") if x)
    return (f"the last evaluation, {of}{when}; the run ended at {end}: reactor eval {job_path(run_dir)} evaluates its "
            f"final weights")


def _counts_ok(counts: Any) -> bool:
    """Whether ``counts`` maps names of :data:`COUNTERS` to numbers in ``[0, MAX_COUNT)``."""
    return isinstance(counts, dict) and all(
        k in COUNTERS and type(v) in (int, float) and 0 <= v < MAX_COUNT for k, v in counts.items())


def _cut_back(csv_path: Path, nbytes: int) -> int | None:
    """Where ``csv_path`` is to be cut back to its first ``nbytes`` (the rows a counts file goes with):
    ``nbytes``, when that is the end of a row past the header and what would go holds no evaluation;
    None for a file no longer than that (or none). Reads only: the cut is made when the run begins.

    Raises:
        ValueError: ``nbytes`` is not the end of a row past the header, or an evaluation lies past it
            (the counts file is older than the rows: its save failed since, or it is not this file's).
    """
    try:
        f = open(csv_path, "rb")  # noqa: SIM115 - (a regular file: refuse_file_links)
    except FileNotFoundError:
        return None
    with f:
        size = f.seek(0, os.SEEK_END)
        if size <= nbytes:
            return None
        header = len(",".join(CSV_HEADER)) + 1  # (the header line with its end, \r\n or \n)
        f.seek(max(0, nbytes - 2))
        end = f.read(2)
        if nbytes < header or not end.endswith(b"\n"):
            raise ValueError(f"{csv_path}: the {nbytes} bytes its counts went with do not end a row of it")
        f.seek(nbytes)
        while chunk := f.read(1 << 20):
            if b"eval_return" in chunk:  # (a chunk's end may split the name: read overlapping)
                raise ValueError(f"{csv_path} holds an evaluation past the {nbytes} bytes its counts went with")
            if len(chunk) == 1 << 20:
                f.seek(-len(b"eval_return"), os.SEEK_CUR)
    return nbytes


def _earlier_rows(path: Path, end: int | None = None) -> tuple[float, list[tuple[float, float, float]], int | None] | None:
    """An earlier life's metrics.csv at ``path`` (its first ``end`` bytes, where it is to be cut back to
    them): the last row's ``wall_s``, its evaluations ``(wall_s, env_steps, eval_return)``, and the length
    to cut it back to when a row was cut short by the earlier life's death (a kill mid-write: the new
    life's rows then start on a line of their own), else None; None where there is no such file (or it is
    not one: its header differs), and the new life starts the file anew. Only the evaluation rows and the
    last rows are parsed as CSV: a long run's file holds millions of rows, and a restart waits for this.
    Reads only: the cut is made when the run begins."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if end is not None:
                size = min(size, end)
            f.seek(max(0, size - 65536))
            tail = f.read(size - max(0, size - 65536))
            keep = None
            if tail and not tail.endswith(b"\n"):
                keep = size - len(tail) + tail.rfind(b"\n") + 1
                tail = tail[:tail.rfind(b"\n") + 1]
            limit = keep if keep is not None else size
            f.seek(0)
            header = f.readline(MAX_LINE_CHARS)
            if next(csv.reader([header.decode()]), None) != CSV_HEADER:
                return None
            last_wall, evals = 0.0, []
            for line in _rows_of(f, limit):
                if b"eval_return" in line and (row := _parsed(line)) is not None and row[2] == "eval_return":
                    wall, steps, _, value = row
                    evals.append((wall, steps, value))
                    last_wall = max(last_wall, wall)
        # The wall time goes on from the last row that parses (a life's rows are in time order, and each
        # life starts from the one before: the last row holds the largest).
        for line in reversed(tail.splitlines()[1:]):  # (the first: the header, or a line cut by the seek)
            if (row := _parsed(line)) is not None:
                last_wall = max(last_wall, row[0])
                break
    except (OSError, csv.Error, UnicodeDecodeError):
        return None
    return last_wall, evals, keep


def _rows_of(f: Any, limit: int | None = None) -> Iterator[bytes]:
    """The lines of binary file ``f`` from where it is (to byte ``limit``, a line's end), each at most
    :data:`MAX_LINE_CHARS` long: longer ones are read through in pieces and left out."""
    while (limit is None or f.tell() < limit) and (line := f.readline(MAX_LINE_CHARS)):
        if len(line) < MAX_LINE_CHARS or line.endswith(b"\n"):
            yield line
            continue
        while (rest := f.readline(MAX_LINE_CHARS)) and not rest.endswith(b"\n"):
            pass


def _parsed(line: bytes) -> tuple[float, float, str, float] | None:
    """A metrics row's ``(wall_s, env_steps, name, value)``; None for a row that does not parse."""
    try:
        row = next(csv.reader([line.decode()]), None)
        if row is None or len(row) != 5:
            return None
        return float(row[0]), float(row[1]), row[3], float(row[4])
    except (ValueError, csv.Error):  # (UnicodeDecodeError is a ValueError)
        return None


def _import_plotting() -> None:
    with contextlib.suppress(Exception):  # the plot at the end reports its own failure
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401



class _Display:
    """A rich live table on a terminal; a plain progress line every few seconds otherwise."""

    def __init__(self, title: str, enabled: bool, console: Any = None) -> None:
        self.enabled = enabled
        self.title = title
        self.live: Any = None
        self.last_plain = -math.inf
        if enabled and (console is not None or sys.stdout.isatty()):
            from rich.live import Live

            self.live = Live(self._table([("wall", "starting")]), console=console, refresh_per_second=4,
                             transient=False)
            self.live.start(refresh=True)  # the first frame now, not at the first refresh tick

    def _table(self, rows: list[tuple[str, str]]) -> Any:
        from rich.table import Table

        t = Table(title=self.title, show_header=False)
        for k, v in rows:
            t.add_row(k, v)
        return t

    def show(self, rows: list[tuple[str, str]]) -> None:
        if not self.enabled:
            return
        if self.live is not None:
            self.live.update(self._table(rows))
            return
        now = time.monotonic()
        if now - self.last_plain >= 5.0:
            self.last_plain = now
            print("  ".join(f"{k}: {v}" for k, v in rows), flush=True)

    def close(self, rows: list[tuple[str, str]]) -> None:
        if self.live is not None:
            self.live.update(self._table(rows))
            self.live.stop()
        elif self.enabled:
            print("  ".join(f"{k}: {v}" for k, v in rows), flush=True)
