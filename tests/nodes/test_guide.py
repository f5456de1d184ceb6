"""docs/guide.md's example algorithm (A2C in the fragment contract) and its app, run as the guide shows
them: extracted from the guide, beside each other in a directory, under --placement actors (issue 19)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.learning import first_seed_passing

ROOT = Path(__file__).resolve().parents[2]


def _blocks() -> dict[str, str]:
    """The guide's python blocks that open with a file name comment (``# my_a2c.py``)."""
    text = (ROOT / "docs" / "guide.md").read_text()
    return {m.group(1): m.group(0)[len("```python\n"):-len("```")]
            for m in re.finditer(r"```python\n# (\w+\.py)\n.*?```", text, re.S)}


def test_the_guides_algorithm_is_about_forty_lines():
    code = _blocks()["my_a2c.py"]
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(lines) <= 60, len(lines)


@pytest.mark.slow
@pytest.mark.timeout(400)  # ~15-25 s a seed on a 2-core machine
def test_the_guides_a2c_learns_cartpole_under_actors_and_its_policy_loads(tmp_path):
    blocks = _blocks()
    assert set(blocks) >= {"my_a2c.py", "a2c_app.py"}, sorted(blocks)
    for name in ("my_a2c.py", "a2c_app.py"):
        (tmp_path / name).write_text(blocks[name])

    def train(seed: int) -> dict:
        run_dir = tmp_path / f"seed{seed}"
        p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", "a2c_app.py", "--placement", "actors",
                            "--seed", str(seed), "--set", "live=False", "target_return=300.0", "max_env_steps=80000",
                            "eval_every_updates=10", f"run_dir={run_dir}"],
                           capture_output=True, text=True, timeout=180, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads((run_dir / "summary.json").read_text())

    summary = first_seed_passing(train, seeds=[0, 1, 2])
    run_dir = next(d for d in sorted(tmp_path.glob("seed*")) if json.loads((d / "summary.json").read_text()) == summary)
    assert json.loads((run_dir / "config.json").read_text())["algo"] == "my_a2c"
    # From another directory, in a fresh process, with nothing on its path: config.json's app_dirs
    # make the guide's module importable, and the trained policy plays well above a random one.
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "eval", str(run_dir), "--episodes", "10", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout)
    assert got["algo"] == "my_a2c" and got["mean"] >= 60, got  # a memoryless random policy averages about 22


@pytest.mark.timeout(300)
def test_the_guides_own_environment_trains_with_a_copy_of_the_dqn_app_under_actors(tmp_path):
    """Section 3 as a user follows it (a newcomer's pass, session 52, found its env missing from the
    guide): the guide's ``my_envs.py`` beside a copy of ``apps/dqn.py``, ``--set env=my_envs:MyChain-v0``
    under ``--placement actors``; DQN learns to walk the chain (greedy return 0.92: 8 steps of -0.01,
    then +1; a policy that never reaches the end gets -0.30)."""
    (tmp_path / "my_envs.py").write_text(_blocks()["my_envs.py"])
    (tmp_path / "my_dqn.py").write_text((ROOT / "apps" / "dqn.py").read_text())

    def train(seed: int) -> dict:
        run_dir = tmp_path / f"seed{seed}"
        p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", "my_dqn.py", "--placement", "actors",
                            "--seed", str(seed), "--set", "env=my_envs:MyChain-v0", "live=False",
                            "target_return=0.9", "max_env_steps=6000", f"run_dir={run_dir}"],
                           capture_output=True, text=True, timeout=200, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads((run_dir / "summary.json").read_text())

    summary = first_seed_passing(train, seeds=[0, 1, 2])
    assert summary["best_eval_return"] == pytest.approx(0.92, abs=1e-6)
