"""A run directory belongs to one run: a new run never writes over an earlier one's files, two live
runs never share one, and a resume finds the run it names (a hostile probe of files on disk, session 54).

Real files, real locks held by a real second process, real training runs of the DQN app.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reactor import _runclaim
from reactor._runclaim import claim_run_dir
from reactor.launch._app import build_graph

ROOT = Path(__file__).resolve().parents[2]
DQN = str(ROOT / "apps" / "dqn.py")
PPO = str(ROOT / "apps" / "ppo.py")


def _files(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` but the lock, by its content's hash."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "run.lock"}


def test_a_claim_names_its_run_and_refuses_another_run_unless_it_resumes(tmp_path):
    d = tmp_path / "run"
    first = claim_run_dir(d, "run-a", resume=False, who="metrics")
    also = claim_run_dir(d, "run-a", resume=False, who="learner")  # another node of the same run
    assert json.loads((d / "run.json").read_text()) == {"run_id": "run-a", "resumed_from": None}
    first.release()
    also.release()
    also.release()  # (idempotent)
    with pytest.raises(ValueError, match=r"holds an earlier run \(run-a\).*--set resume=True"):
        claim_run_dir(d, "run-b", resume=False, who="learner")
    assert json.loads((d / "run.json").read_text())["run_id"] == "run-a"  # refused: nothing written
    claim_run_dir(d, "run-b", resume=True, who="learner").release()
    assert json.loads((d / "run.json").read_text()) == {"run_id": "run-b", "resumed_from": "run-a"}


def test_a_directory_with_an_earlier_runs_files_and_no_record_is_an_earlier_run(tmp_path):
    (tmp_path / "metrics.csv").write_text("wall_s\n")
    with pytest.raises(ValueError, match="holds an earlier run"):
        claim_run_dir(tmp_path, "run-a", resume=False, who="metrics")
    (tmp_path / "run.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="names no run_id"):
        claim_run_dir(tmp_path, "run-a", resume=True, who="metrics")


def test_a_resume_of_a_missing_or_empty_directory_is_refused_and_makes_nothing(tmp_path):
    with pytest.raises(ValueError, match="does not exist: is the path right"):
        claim_run_dir(tmp_path / "typo", "run-a", resume=True, who="learner")
    assert not (tmp_path / "typo").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no earlier run"):
        claim_run_dir(tmp_path / "empty", "run-a", resume=True, who="learner")
    assert not (tmp_path / "empty" / "run.json").exists()
    # ... and at graph build, before any worker starts: under a multi-process placement each node refused it
    # in its own worker, with a traceback each (a newcomer's pass, session 54).
    for where, why in (("typo", "does not exist: is the path right"), ("empty", "holds no earlier run")):
        with pytest.raises(ValueError, match=why):
            build_graph(PPO, {"run_dir": str(tmp_path / where), "resume": True})
    assert not (tmp_path / "typo").exists()


@pytest.mark.timeout(60)
def test_a_directory_a_live_run_holds_is_refused_to_another_even_with_resume(tmp_path, monkeypatch):
    """Another process of run-a holds its claim; run-b waits for it (CLAIM_WAIT_S), then is refused;
    once that process has ended, run-b may resume the directory."""
    d = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from reactor._runclaim import claim_run_dir
            claim_run_dir({str(d)!r}, "run-a", resume=False, who="metrics")
            print("held", flush=True)
            sys.stdin.readline()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        monkeypatch.setattr(_runclaim, "CLAIM_WAIT_S", 0.5)
        with pytest.raises(ValueError, match=r"is in use by a live run \(run-a\)"):
            claim_run_dir(d, "run-b", resume=True, who="learner")
        claim_run_dir(d, "run-a", resume=False, who="actor").release()  # the same run's other process
    finally:
        holder.communicate("\n", timeout=20)
    claim_run_dir(d, "run-b", resume=True, who="learner").release()
    assert json.loads((d / "run.json").read_text())["resumed_from"] == "run-a"


@pytest.mark.timeout(300)
def test_a_dqn_run_never_writes_over_an_earlier_run_or_another_apps(tmp_path):
    """A new run into an earlier run's directory, a DQN resume of a PPO run's directory, and a resume
    of a copy made with hard links are each refused with the files untouched; the offline app is
    refused its own source as its run directory."""
    run_dir = tmp_path / "dqn"
    config = {"max_env_steps": 600, "target_return": None, "live": False, "run_dir": str(run_dir)}
    cmd = [sys.executable, "-m", "reactor.cli", "run", DQN, "--set", *(f"{k}={v!r}" for k, v in config.items())]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _files(run_dir)
    assert {"learner.pt", "metrics.csv", "summary.json", "run.json"} <= set(before)
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert again.returncode != 0 and "holds an earlier run" in again.stderr, again.stderr[-3000:]
    assert _files(run_dir) == before
    # Another app's directory (PPO's config.json), refused at graph build: nothing starts.
    (tmp_path / "ppo").mkdir()
    (tmp_path / "ppo" / "config.json").write_text(json.dumps({"algo": "ppo", "env": "CartPole-v1"}))
    with pytest.raises(ValueError, match="it holds a run of 'ppo' on 'CartPole-v1'"):
        build_graph(DQN, {"run_dir": str(tmp_path / "ppo"), "resume": True})
    # The same app with other shards: each shard restores its own checkpoints (none was, in silence).
    with pytest.raises(ValueError, match=r"with shards=1: its run had shards=2, .* --set shards=2$"):
        build_graph(DQN, {"run_dir": str(run_dir), "resume": True, "shards": 1})
    with pytest.raises(ValueError, match="is the offline source"):
        build_graph(str(ROOT / "apps" / "transformer_offline.py"), {"source": str(run_dir), "run_dir": str(run_dir)})
    # A copy that shares its files (cp -al): resuming it would change the original.
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-al", str(run_dir), str(copy)], check=True)
    resumed = subprocess.run([*cmd, "--set", f"run_dir={str(copy)!r}", "resume=True"], capture_output=True, text=True,
                             cwd=tmp_path, timeout=240)
    assert resumed.returncode != 0 and "hard links" in resumed.stderr, resumed.stderr[-3000:]
    assert _files(run_dir) == before


def test_what_a_run_left_claimed_in_its_process_is_released_at_its_end(tmp_path):
    """A shutdown cut short (a second Ctrl-C, a notebook's stop button) skipped the nodes' releases: the
    kernel kept the lock, and every later run there was refused."""
    d = tmp_path / "run"
    claim_run_dir(d, "run-a", resume=False, who="metrics")
    claim_run_dir(d, "run-a", resume=False, who="learner")  # (never released by their nodes)
    with pytest.raises(ValueError, match="is in use by run run-a in this process"):
        claim_run_dir(d, "run-b", resume=True, who="learner")
    _runclaim.release_run_claims("run-a")
    claim_run_dir(d, "run-b", resume=True, who="learner").release()


def test_a_restarted_life_joins_its_own_runs_directory_and_never_takes_another_runs_over(tmp_path):
    """Under a restart policy, a new run's nodes refused an earlier run's directory, died, and their next
    lives (restarts 1) claimed it as a resume: the new run went on with the earlier one's weights and
    metrics (a review, session 54). A later life may only join its own run's directory."""
    from reactor import Graph, run
    from reactor.nodes.metrics import Metrics

    from .test_metrics import FakeTrainer

    class Restarted(Metrics):
        restarts = property(lambda self: 1, lambda self, value: None)

    claim_run_dir(tmp_path, "earlier-run", resume=False, who="metrics").release()
    g = Graph()
    g.connect(g.add(FakeTrainer(), name="actor").report, g.add(Restarted(str(tmp_path), live=False), name="metrics").reports)
    with pytest.raises(ValueError, match=r"holds an earlier run \(earlier-run\)"):
        run(g)
    assert json.loads((tmp_path / "run.json").read_text())["run_id"] == "earlier-run"


def test_a_python_api_graph_is_refused_an_earlier_runs_directory_and_another_apps_resume_at_build(tmp_path):
    """The checks ran only for the apps: off_policy_graph into an earlier run's directory, or resuming
    another algorithm's, started, and its Metrics wrote into that run's files before the learner refused."""
    from reactor.nodes.training import off_policy_graph, on_policy_graph

    claim_run_dir(tmp_path, "earlier-run", resume=False, who="metrics").release()
    (tmp_path / "config.json").write_text(json.dumps({"algo": "ppo", "env": "CartPole-v1"}))
    with pytest.raises(ValueError, match=r"holds an earlier run \(earlier-run\)"):
        off_policy_graph(algo="dqn", env="CartPole-v1", run_dir=str(tmp_path))
    with pytest.raises(ValueError, match="it holds a run of 'ppo' on 'CartPole-v1'"):
        off_policy_graph(algo="dqn", env="CartPole-v1", run_dir=str(tmp_path), resume=True)
    on_policy_graph(algo="ppo", env="CartPole-v1", run_dir=str(tmp_path), resume=True)  # its own: built
