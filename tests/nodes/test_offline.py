"""apps/transformer_offline.py: a learner on an earlier run's replay checkpoints (reactor.nodes.offline).

One real source run (the transformer app, 1,500 env steps, its shards checkpointing at the end) serves
every test of the module.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reactor import run
from reactor.launch._app import build_graph
from reactor.nodes.offline import load_source_steps
from reactor.replay import Table

ROOT = Path(__file__).resolve().parents[2]
SOURCE_APP = str(ROOT / "apps" / "transformer_dqn.py")
OFFLINE_APP = str(ROOT / "apps" / "transformer_offline.py")


def _run(app: str, config: dict, **kw):
    return run(build_graph(app, config), app=app, config=config, **kw)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reactor.cli", "run", OFFLINE_APP, *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("source")
    _run(SOURCE_APP, {"max_env_steps": 1500, "target_return": None, "live": False, "run_dir": str(d)})
    return d


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_source_steps_are_every_step_the_shards_checkpointed_with_distinct_episodes(source):
    steps, episodes, shards = load_source_steps(source, ("obs", "action", "reward", "terminated"))
    tables = [Table.restore(source / f"replay-{i}")[0] for i in range(2)]
    assert shards == 2 and all(t is not None for t in tables)
    counts = [t.storage.step_range[1] - t.storage.step_range[0] for t in tables]
    assert len(episodes) == sum(counts) >= 1500 and steps["obs"].shape == (len(episodes), 2)
    # Shard 0's steps come first, in order, and its episodes and shard 1's never share an id.
    first = tables[0].storage.read_steps(np.arange(*tables[0].storage.step_range))
    assert torch.equal(steps["obs"][: counts[0]], first["obs"])
    assert set(episodes[: counts[0]].tolist()).isdisjoint(episodes[counts[0]:].tolist())
    # An episode id changes only where an episode ends (terminated, or truncated at the shard's open end).
    change = np.flatnonzero(np.diff(episodes)) + 1
    assert len(change) >= 40


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_source_of_one_shard_is_read_from_its_replay_directory(source, tmp_path):
    """A run of one shard (``--set shards=1``, and the one-actor apps' defaults) writes ``replay/``, not
    ``replay-0/``; such a source was refused as having no replay checkpoint."""
    import shutil  # noqa: PLC0415

    shutil.copytree(source / "replay-0", tmp_path / "replay")
    steps, episodes, shards = load_source_steps(tmp_path, ("obs",))
    one = Table.restore(source / "replay-0")[0]
    assert shards == 1 and len(episodes) == one.storage.step_range[1] - one.storage.step_range[0] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_offline_app_learns_on_the_source_windows_and_its_policy_loads(source, tmp_path, capfd):
    from reactor.nodes._policy import load_policy

    n = len(load_source_steps(source, ("obs",))[1])
    out_dir = tmp_path / "offline"
    r = _run(OFFLINE_APP, {"source": str(source), "updates": 120, "eval_every_updates": 60, "live": False,
                           "run_dir": str(out_dir)})
    out = capfd.readouterr().out
    assert re.search(rf"^learner: {n} steps of \d+ episodes from 2 shard checkpoint\(s\) of {re.escape(str(source))} "
                     r"on cpu \(torch kernels\)$", out, re.M), out
    s = json.loads((out_dir / "summary.json").read_text())
    assert s["updates"] == 120 and len(s["evaluations"]) >= 2 and r.stopped_by == "quiescence"
    # (it said "nothing left to happen (every source of events had ended)")
    assert s["stop_reason"] == "the learner's update budget reached (120 updates, updates 120)", s["stop_reason"]
    metrics = (out_dir / "metrics.csv").read_text()
    losses = [float(x) for x in re.findall(r",learner,loss,([-0-9.e]+)", metrics)]
    assert losses and all(np.isfinite(losses))
    policy = load_policy(out_dir)
    assert policy.updates == 120
    assert (out_dir / "weights.sha256").read_text().strip() == policy.weights_sha256


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_bad_source_is_refused_in_one_line_naming_it(source, tmp_path):
    missing = tmp_path / "nowhere"
    r = _cli("--set", f"source='{missing}'", "--set", "live=False", "--set", f"run_dir='{tmp_path / 'a'}'")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"reactor: offline source '{missing}' is not a directory (give an earlier run's run_dir)"], r.stderr
    # (The graph is built without the source, which `reactor graph` and `submit --check` need: the source
    # may exist only on the daemon's host.) No untrained checkpoint is left for `reactor eval` to load.
    assert not (tmp_path / "a" / "learner.pt").exists() and not (tmp_path / "a" / "weights.sha256").exists()
    # The rest in this process (the same errors; the CLI prints each as the line above).
    empty = tmp_path / "empty"
    empty.mkdir()
    base = {"live": False, "updates": 5}
    with pytest.raises(FileNotFoundError, match=r"no replay checkpoint with steps under replay/ or replay-\*/"):
        _run(OFFLINE_APP, {**base, "source": str(empty), "run_dir": str(tmp_path / "b")})
    # No untrained checkpoint is left where `reactor eval` would load it as the run's policy.
    assert not (tmp_path / "b" / "learner.pt").exists() and not (tmp_path / "b" / "weights.sha256").exists()
    with pytest.raises(ValueError, match=r"^no source: set source to an earlier run's run_dir"):
        build_graph(OFFLINE_APP, {"live": False})
    # Another env's steps (the source's 2-d observations, where CartPole-v1 has 4) are refused naming the field
    # (a source of replay checkpoints alone: no config.json names its env).
    import shutil  # noqa: PLC0415

    bare = tmp_path / "bare"
    shutil.copytree(source / "replay-0", bare / "replay-0")
    with pytest.raises(ValueError, match=r"the source's field 'obs' is \(2,\) torch.float32; transformer_dqn on "
                                         r"CartPole-v1 stores \(4,\) torch.float32"):
        _run(OFFLINE_APP, {**base, "source": str(bare), "env": "CartPole-v1", "run_dir": str(tmp_path / "c")})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_source_of_another_env_is_refused_though_its_steps_have_this_ones_shape(source, tmp_path):
    """Regression (a newcomer's pass): CartPoleNoVel-v1's steps (2-d observations, actions 0 and 1) were
    learned as MountainCar-v0's (2-d observations, 3 actions) in silence. The source's config.json names
    its env."""
    r = _cli("--set", f"source='{source}'", "env=MountainCar-v0", "updates=5", "live=False",
             f"run_dir='{tmp_path / 'a'}'")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"reactor: learner: the offline source '{source}' holds steps of env 'CartPoleNoVel-v1' (its config.json), "
        f"and this run's env is 'MountainCar-v0': set env=CartPoleNoVel-v1"], r.stderr
    assert not (tmp_path / "a" / "learner.pt").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_shard_whose_every_checkpoint_is_damaged_is_refused_not_left_out(source, tmp_path):
    """Regression (a newcomer's pass): one flipped byte in a shard's only checkpoint was a warning, and
    the run learned from the other shard's steps alone (half the data, exit 0)."""
    import shutil  # noqa: PLC0415

    d = tmp_path / "src"
    for part in ("replay-0", "replay-1"):
        shutil.copytree(source / part, d / part)
    (obs,) = (d / "replay-1").glob("ckpt-*/field.obs.npy")
    data = bytearray(obs.read_bytes())
    data[-1] ^= 0xFF
    obs.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^offline source '{re.escape(str(d))}': no checkpoint of shard replay-1 "
                                         rf"verifies, so its steps would be left out \(checkpoint .*field.obs.npy has "
                                         rf"checksum .*\); restore that directory, or move it out of "):
        load_source_steps(d, ("obs",))
    shutil.move(d / "replay-1", tmp_path / "aside")  # (what the message says to do: the other shard is read)
    assert load_source_steps(d, ("obs",))[2] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_online_runs_directory_is_not_resumed_offline_nor_an_offline_one_online(source, tmp_path):
    """Regression (a newcomer's pass): the offline app with ``resume=True`` of the transformer app's run
    directory (the same algorithm and env) took the online learner's checkpoint, ran no update (its
    2,100 were past ``updates``) and wrote its summary and config over that run's; the online app
    resumed an offline run's directory alike."""
    import shutil  # noqa: PLC0415

    online = tmp_path / "online"
    shutil.copytree(source, online)
    with pytest.raises(ValueError, match=rf"^resume=True: cannot resume run directory {re.escape(str(online))}: it "
                                         rf"holds an online run of 'transformer_dqn' on 'CartPoleNoVel-v1' \(its "
                                         rf"config.json\), and this run learns offline; name another run_dir$"):
        build_graph(OFFLINE_APP, {"source": str(source), "resume": True, "run_dir": str(online), "live": False})
    offline = tmp_path / "offline"
    shutil.copytree(source, offline)
    record = json.loads((offline / "config.json").read_text())
    record["app_config"] = {**record["app_config"], "source": str(source)}  # (what an offline run's holds)
    (offline / "config.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"it holds an offline run \(it learned from an earlier run's replay\) of "
                                         r"'transformer_dqn' on 'CartPoleNoVel-v1' \(its config.json\), and this run "
                                         r"trains online; name another run_dir$"):
        build_graph(SOURCE_APP, {"resume": True, "run_dir": str(offline), "live": False})
    build_graph(OFFLINE_APP, {"source": str(source), "resume": True, "run_dir": str(offline), "live": False})


def test_a_size_the_app_has_not_is_refused_in_one_line():
    """Regression (a newcomer's pass): ``--set size=huge`` was refused in the app's build, so it showed as
    a bug of the app file, with its traceback. The field's type (a Literal) says the choices."""
    r = _cli("--set", "size=huge", "source=x", "live=False")
    assert r.returncode == 2 and r.stderr == "reactor: config key 'size' must be one of 'small', 'large', got 'huge'\n"
