"""Training from a script or a notebook with no app file: ``reactor.run(graph, placement="actors")`` on a
graph from a ``graph_builder`` (issue 19, "Python API"). The workers rebuild the graph from the recorded
builder and arguments, so the run is the same as in one process, bit for bit.
"""

from __future__ import annotations

import asyncio
import re

import pytest

import reactor
from reactor import Graph, Input, Output, Reactor, graph_builder, reaction, startup
from reactor.launch._app import builder_app
from reactor.nodes.training import off_policy_graph


class Source(Reactor):
    out = Output(int)

    @reaction(triggers=[startup], effects=[out])
    def emit(self) -> None:
        self.out.send(1)


class Sink(Reactor):
    inp = Input(int)

    @reaction(triggers=[inp])
    def take(self, inp: int) -> None:
        pass


def _brief(run_dir: str) -> Graph:
    return off_policy_graph(algo="dqn", env="CartPole-v1", run_dir=run_dir, algo_config={"hidden": 64},
                            actors=2, shards=2, max_env_steps=1200, min_size=300, live=False)


@pytest.mark.timeout(240)  # ~20-40 s on a 2-core machine
def test_a_builders_graph_runs_under_actors_with_the_same_weights_as_in_one_process(tmp_path):
    one = reactor.run(_brief(str(tmp_path / "single")))
    single = (tmp_path / "single" / "weights.sha256").read_text().strip()
    many = reactor.run(_brief(str(tmp_path / "actors")), placement="actors")
    assert many.placement == "actors" and one.placement == "single"
    assert (tmp_path / "actors" / "weights.sha256").read_text().strip() == single


def test_the_graph_records_its_builder_and_arguments(tmp_path):
    g = _brief(str(tmp_path))
    name, arguments = g.built_by
    assert name == "reactor.nodes.training:off_policy_graph"
    assert arguments["algo"] == "dqn" and arguments["max_env_steps"] == 1200 and arguments["algo_config"] == {"hidden": 64}
    app, config = builder_app(g)
    assert app.endswith("reactor/launch/_builder_app.py")
    assert config["builder"] == name and config["arguments"] == arguments and isinstance(config["path"], list)


def test_a_module_beside_the_callers_script_imports_in_every_worker(tmp_path):
    """`python path/to/script.py` from another directory: the script imported its builder's module from
    beside it, the workers could not (the script's directory is first on the caller's sys.path only),
    and the run ended in 180 lines of worker tracebacks (a newcomer's pass, session 55)."""
    import subprocess
    import sys

    here = tmp_path / "project"
    here.mkdir()
    (here / "my_builders.py").write_text(
        "from reactor import Graph, Input, Output, Reactor, graph_builder, reaction, startup\n\n\n"
        "class Source(Reactor):\n    out = Output(int)\n\n    @reaction(triggers=[startup], effects=[out])\n"
        "    def emit(self):\n        self.out.send(1)\n\n\n"
        "class Sink(Reactor):\n    inp = Input(int, required=True)\n\n    @reaction(triggers=[inp])\n"
        "    def take(self, inp):\n        print('sink took', inp, flush=True)\n\n\n"
        "@graph_builder\ndef pair() -> Graph:\n    g = Graph()\n    a = g.add(Source(), name='source')\n"
        "    b = g.add(Sink(), name='sink')\n    g.connect(a.out, b.inp)\n    return g\n")
    (here / "script.py").write_text("import reactor\nfrom my_builders import pair\n\n"
                                   "print(reactor.run(pair(), placement='processes').stopped_by)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = subprocess.run([sys.executable, str(here / "script.py")], capture_output=True, text=True, timeout=120,
                       cwd=elsewhere)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "sink took 1" in p.stdout and p.stdout.strip().endswith("quiescence"), p.stdout


@graph_builder
def _with_an_object(*, sink: object) -> Graph:
    g = Graph()
    g.connect(g.add(Source(), name="src").out, g.add(Sink(), name="sink").inp)
    return g


def test_a_builder_in_main_or_with_an_object_argument_or_a_hand_built_graph_is_refused():
    with pytest.raises(ValueError, match=r"^tests.nodes.test_python_api:_with_an_object: argument 'sink' \(object\) "
                                         r"cannot cross to the workers as data"):
        reactor.run(_with_an_object(sink=object()), placement="processes")
    g = Graph()
    g.connect(g.add(Source(), name="src").out, g.add(Sink(), name="sink").inp)
    with pytest.raises(ValueError, match="a multi-process placement needs the app file"):
        reactor.run(g, placement="processes")
    g.built_by = ("__main__:pipeline", {})
    with pytest.raises(ValueError, match=r"^the graph's builder pipeline is defined in __main__"):
        reactor.run(g, placement="processes")


@graph_builder
def _sized(*, sources: int, rate: float, extra: dict) -> Graph:
    g = Graph()
    sink = g.add(Sink(), name="sink")
    for i in range(sources):
        g.connect(g.add(Source(), name=f"src{i}").out, sink.inp)
    return g


def test_numpy_scalars_given_to_a_builder_cross_to_the_workers_as_python_values():
    """A sweep's values come from numpy (np.linspace, rng.integers): they go to the workers as the
    Python numbers they hold, and the workers rebuild the graph from them."""
    import numpy as np  # noqa: PLC0415

    g = _sized(sources=np.int64(2), rate=np.linspace(0.0, 1.0, 5)[1],
               extra={"seeds": [np.int32(3), np.float32(0.5)], "on": np.bool_(True), "name": np.str_("x")})
    _, config = builder_app(g)
    got = config["arguments"]
    assert got == {"sources": 2, "rate": 0.25, "extra": {"seeds": [3, 0.5], "on": True, "name": "x"}}
    assert [type(v) for v in (got["sources"], got["rate"], *got["extra"]["seeds"], got["extra"]["on"],
                              got["extra"]["name"])] == [int, float, int, float, bool, str]
    result = reactor.run(g, placement="processes")
    assert result.stopped_by == "quiescence" and result.events["sink"] == 2 + 1  # (as in one process: a lifecycle event)


class Sends(Reactor):
    out = Output(int)

    def __init__(self, value: object) -> None:
        self.value = value

    @reaction(triggers=[startup], effects=[out])
    def emit(self) -> None:
        self.out.send(self.value)


@graph_builder
def _sending(*, value: object) -> Graph:
    g = Graph()
    g.connect(g.add(Sends(value), name="src").out, g.add(Sink(), name="sink").inp)
    return g


@pytest.mark.timeout(120)
def test_a_value_not_of_its_ports_type_fails_the_run_alike_under_every_placement():
    """The sender refuses it (Output.send), where it used to be delivered as is in one process and
    dropped where it entered another (tests/core/test_reactor.py has the cases)."""
    words = "src.emit sent str '7' on output 'out', which takes int"
    with pytest.raises(reactor.PortError, match=re.escape(words)):
        reactor.run(_sending(value="7"))
    with pytest.raises(reactor.WorkerFailedError, match=re.escape(words)):
        reactor.run(_sending(value="7"), placement="processes")


@pytest.mark.timeout(240)
def test_run_works_where_an_event_loop_is_running_as_in_a_notebook(tmp_path):
    async def cell() -> reactor.RunResult:  # a notebook cell runs inside the kernel's running loop
        return reactor.run(_brief(str(tmp_path / "nb")), placement="actors")

    result = asyncio.run(cell())
    assert result.stopped_by == "quiescence" and (tmp_path / "nb" / "weights.sha256").is_file()


@graph_builder
def _with_args(*sizes: int) -> Graph:
    g = Graph()
    g.connect(g.add(Source(), name="src").out, g.add(Sink(), name="sink").inp)
    return g


def test_a_graph_changed_after_its_builder_or_from_a_builder_with_args_is_refused(tmp_path):
    g = _brief(str(tmp_path))
    g.add(Source(), name="extra")
    with pytest.raises(ValueError, match=r"^the graph was changed after reactor.nodes.training:off_policy_graph made "
                                         r"it \(reactors or links added\)"):
        reactor.run(g, placement="actors")
    with pytest.raises(ValueError, match=r"^the graph's builder takes \*args or positional-only arguments"):
        reactor.run(_with_args(1, 2), placement="processes")


_TICKING = """
import asyncio, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a shell's background job ignores it)
import reactor
from reactor import Graph, Reactor, Timer, reaction


class Ticker(Reactor):
    tick = Timer(period_s=0.05)

    @reaction(triggers=[tick])
    def on_tick(self):
        if not getattr(self, "said", False):
            self.said = True
            print("ticking", flush=True)


async def cell():  # a coroutine that calls the API, as asyncio.run (or a loop's runner) runs it
    g = Graph()
    g.add(Ticker(), name="ticker")
    return reactor.run(g, deterministic=False)

t0 = time.monotonic()
try:
    asyncio.run(cell())
except KeyboardInterrupt:
    print(f"interrupted after {time.monotonic() - t0:.1f} s", flush=True)
"""


def test_ctrl_c_stops_a_run_called_from_a_coroutine_under_asyncio_run(tmp_path):
    """asyncio.run's Ctrl-C cancels its main task instead of raising KeyboardInterrupt; that task was
    blocked in reactor.run waiting for the run's thread, so the cancellation could only land when the run
    ended on its own: a run with no end went on for good (found by a newcomer's pass, h3)."""
    import signal
    import subprocess
    import sys

    (tmp_path / "cell.py").write_text(_TICKING)
    p = subprocess.Popen([sys.executable, str(tmp_path / "cell.py")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ticking"
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and "interrupted after" in out, out[-2000:]


@pytest.mark.timeout(120)
def test_a_graph_run_again_into_its_own_earlier_runs_directory_is_refused_in_one_error_under_actors(tmp_path):
    """A notebook's cell that runs the same graph again: under "single" its run directory (now holding the
    first run) is refused with a ValueError; under "actors" every worker refused it while rebuilding the
    graph, printed its traceback and exited, and the caller got WorkerFailedError (a newcomer's pass, h3)."""
    g = off_policy_graph(algo="dqn", env="CartPole-v1", run_dir=str(tmp_path / "nb"), algo_config={"hidden": 16},
                         actors=1, shards=1, max_env_steps=100, min_size=64, eval_episodes=1, live=False)
    reactor.run(g)
    assert (tmp_path / "nb" / "run.json").is_file()
    with pytest.raises(ValueError, match=r"^run directory .*nb holds an earlier run"):
        reactor.run(g, placement="actors")


def test_a_pathlib_run_dir_crosses_to_the_workers_as_its_string(tmp_path):
    """off_policy_graph(run_dir=Path(...)) ran under "single" and was refused under "actors" ("argument
    'run_dir' (PosixPath) cannot cross to the workers as data"): a newcomer's pass (h3)."""
    g = _brief(tmp_path / "nb")  # (a Path, not str(...))
    _, config = builder_app(g)
    assert config["arguments"]["run_dir"] == str(tmp_path / "nb")


_CHAIN = """import gymnasium as gym
import numpy as np


class Chain(gym.Env):
    observation_space = gym.spaces.Box(0.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cell = 0
        return np.eye(4, dtype=np.float32)[0], {}

    def step(self, action):
        self.cell = max(0, min(3, self.cell + (1 if action == 1 else -1)))
        return np.eye(4, dtype=np.float32)[self.cell], float(self.cell == 3), self.cell == 3, False, {}


gym.register("Chain4-v0", entry_point="my_envs:Chain", max_episode_steps=10)
"""


@pytest.mark.timeout(120)
def test_a_scripts_run_in_one_process_records_the_scripts_directory_for_load_policy(tmp_path):
    """config.json's app_dirs (where load_policy, reactor eval, import a custom env's module from) held the
    script's directory when the script ran its graph under "actors" (the workers note it) and not under
    "single": `reactor eval` of the same run elsewhere failed, "No module named 'my_envs'" (h3)."""
    import json
    import subprocess
    import sys

    here = tmp_path / "project"
    here.mkdir()
    (here / "my_envs.py").write_text(_CHAIN)
    (here / "script.py").write_text(
        "import sys\nimport reactor\nfrom reactor.nodes.training import off_policy_graph\n\n"
        "g = off_policy_graph(algo='dqn', env='my_envs:Chain4-v0', run_dir=sys.argv[1], algo_config={'hidden': 16},\n"
        "                     actors=1, shards=1, max_env_steps=100, min_size=64, eval_episodes=1, live=False)\n"
        "print(reactor.run(g).stopped_by)\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    p = subprocess.run([sys.executable, str(here / "script.py"), str(tmp_path / "run")], capture_output=True,
                       text=True, timeout=100, cwd=elsewhere)
    assert p.returncode == 0 and p.stdout.strip().endswith("quiescence"), p.stderr[-3000:]
    assert str(here) in json.loads((tmp_path / "run" / "config.json").read_text())["app_dirs"]


def test_run_refuses_a_placement_mode_or_seed_of_the_wrong_type_before_anything_starts():
    """From Python there is no command line to type them: deterministic="no" ran a deterministic run,
    placement=None was a TypeError from pathlib, seed=3.0 or True ran as another seed than 3 or 1 (h3). A
    sweep's numpy seed is its int."""
    import numpy as np

    g = _sending(value=1)
    for kw, words in (({"deterministic": "no"}, "deterministic must be True or False, got 'no'"),
                      ({"placement": None}, "placement must be 'single', 'processes', a distribution policy"),
                      ({"seed": 3.0}, "seed must be an int in [0, 2**63), got 3.0"),
                      ({"seed": True}, "seed must be an int in [0, 2**63), got True"),
                      ({"seed": -1}, "seed must be an int in [0, 2**63), got -1")):
        with pytest.raises(ValueError, match=f"^{re.escape(words)}"):
            reactor.run(g, **kw)
    assert reactor.run(g, seed=np.int64(3), deterministic=np.True_).stopped_by == "quiescence"
