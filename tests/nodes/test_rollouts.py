"""On-policy data path: EnvActor rollouts through the RolloutLearner, checked against CartPole's physics.

The app (``tests/apps/train_rollouts.py``) runs the standard on-policy graph with the rollout probe
(``tests/nodes/rollout_probe.py``), whose ``learn`` replays every row of every rollout through the
simulator, on real gymnasium envs truncated after 16 steps.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from reactor import run
from reactor.launch._app import build_graph

APP = str(Path(__file__).resolve().parents[1] / "apps" / "train_rollouts.py")


def _last_learner_values(run_dir: Path) -> dict[str, float]:
    values: dict[str, float] = {}
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row["source"] == "learner":
                values[row["name"]] = float(row["value"])
    return values


@pytest.mark.parametrize("placement", ["single", "actors"])
def test_rollouts_carry_each_ended_episodes_final_observation(tmp_path, placement):
    """Regression: a truncated episode must bootstrap from its final observation, so the rollout
    carries it (``final_obs``) where an episode ended; the row after it is the next episode's first.
    Every row, from 2 actors x 2 envs, matches the simulator: its successor is ``final_obs`` where
    the episode ended and the next row's ``obs`` where it did not; extras stay beside their rows."""
    config = {"run_dir": str(tmp_path), "max_env_steps": 640}
    run(build_graph(APP, config), app=APP, config=config, placement=placement)
    v = _last_learner_values(tmp_path)
    assert v["updates"] == 10  # 640 steps / (2 actors x 2 envs x 16 steps)
    assert v["rows"] == 640
    assert v["truncated"] >= 10 and v["terminated"] >= 5, v  # both kinds of ending occurred
    assert v["bad"] == 0
