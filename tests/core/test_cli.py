"""The `reactor` command: real subprocesses, one-line errors for user mistakes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "apps" / "demo_pipeline.py")


def reactor(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "reactor.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=None if env is None else {**os.environ, **env})


def test_graph_prints_text_and_mermaid():
    p = reactor("graph", DEMO, "--set", "workers=3")
    assert p.returncode == 0, p.stderr
    assert "squarer x3 (Squarer)" in p.stdout
    assert "flowchart LR" in p.stdout


def test_run_prints_a_summary_and_digests():
    p = reactor("run", DEMO, "--digest", "--set", "stop_s=0.1")
    assert p.returncode == 0, p.stderr
    assert "run ended (stop_time)" in p.stdout
    assert "collector: " in p.stdout


@pytest.mark.parametrize("placement", ["single", "processes"])
def test_run_json_writes_only_json_on_stdout_and_the_apps_prints_on_stderr(placement):
    """Regression (issue 19): the app's own prints (here the collector's, in a worker process under
    `processes`) came before the JSON on stdout."""
    p = reactor("run", DEMO, "--json", "--digest", "--placement", placement, "--set", "stop_s=0.1")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert result["stopped_by"] == "stop_time" and result["placement"] == placement
    assert "collector[0]" not in result["digests"] and "collector" in result["digests"]
    assert "collector: " in p.stderr
    assert "run_dir" not in result and "summary" not in result  # (no training app: no Metrics node)


def test_run_json_of_a_training_app_holds_its_run_directory_and_its_result(tmp_path):
    """Regression (a newcomer's pass, session 52): a training run's --json had only the runtime's
    counts: no run directory, no evaluation return, no stop reason."""
    run_dir = tmp_path / "run"
    p = reactor("run", str(ROOT / "apps" / "dqn.py"), "--json", "--set", "max_env_steps=1000", "target_return=None",
                "live=False", f"run_dir={str(run_dir)!r}", "eval_every_updates=100", timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(p.stdout)
    assert result["run_dir"] == str(run_dir) and result["summary"]["env_steps"] == 1000, result
    assert result["summary"] == json.loads((run_dir / "summary.json").read_text())
    assert result["summary"]["stop_reason"].startswith("the actors' env-step budget reached (1,000 env steps")


def test_run_json_never_reports_a_summary_this_command_did_not_write(tmp_path):
    """An earlier run's summary.json in the same directory (this run failed before its own, or its
    Metrics ran on another host whose files did not come back) is not this run's result."""
    import time

    from reactor import Graph
    from reactor.cli import _training_result
    from reactor.nodes.metrics import Metrics

    g = Graph()
    g.add(Metrics(str(tmp_path)), name="metrics")
    (tmp_path / "summary.json").write_text('{"env_steps": 7}')
    os.utime(tmp_path / "summary.json", (1000.0, 1000.0))
    assert _training_result(g, started=time.time() - 60) == {}
    os.utime(tmp_path / "summary.json")
    assert _training_result(g, started=time.time() - 60) == {"run_dir": str(tmp_path), "summary": {"env_steps": 7}}


def test_wrong_app_path_is_a_one_line_error():
    p = reactor("run", "no/such/app.py")
    assert p.returncode == 2
    assert p.stderr == "reactor: no app file at 'no/such/app.py'\n"


def test_run_options_are_checked_before_the_app_and_torch_are_imported():
    """A typo in the placement, the restart policy or a file's path fails at once: no torch loaded."""
    code = "import sys; from reactor.cli import main; rc = main(sys.argv[1:]); print(rc, 'torch' in sys.modules)"
    for args, message in (
        (["--placement", "actorz"], "reactor: --placement 'actorz': neither one of single, processes, actors, "
                                    "colocated, dp-learners nor a placement file\n"),
        (["--async", "--restart", "sometimes"], "reactor: restart 'sometimes': use never, on-failure or "
                                                "on-failure:N (N: the most restarts per group), then ,backoff_s=S "
                                                ",host_wait_s=S ,reset_after_s=S if you want them\n"),
        (["--hosts", "no/hosts.toml"], "reactor: no hosts file at 'no/hosts.toml'\n"),
        (["--with", "no/file.py"], "reactor: no --with file at 'no/file.py'\n"),
        (["--with", "reactor/algos/dqn.py"], f"reactor: the app '{ROOT / 'apps' / 'dqn.py'}' and --with file "
         "'reactor/algos/dqn.py' would both go as 'dqn.py' beside the app on the other hosts, where files are found by "
         "name; the app is loaded by that name there, so 'reactor/algos/dqn.py' would run in its place: rename one of "
         "them\n"),  # (h3: on the hosts, the algorithm ran as the app)
    ):
        p = subprocess.run([sys.executable, "-c", code, "run", str(ROOT / "apps" / "dqn.py"), *args],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert (p.stdout.split(), p.stderr) == (["2", "False"], message), args


@pytest.mark.parametrize(("args", "message"), [
    (["--daemon", "garbage"], "argument --daemon: 'garbage': a daemon's address is tcp://HOST:PORT\n"),
    (["--daemon", "localhost:7999"], "argument --daemon: 'localhost:7999': a daemon's address is tcp://HOST:PORT "
                                     "(tcp://localhost:7999?)\n"),
    (["--daemon", "tcp://127.0.0.1:notaport"], "argument --daemon: 'tcp://127.0.0.1:notaport': a daemon's address is "
                                               "tcp://HOST:PORT\n"),
    (["nosuchjob"], "argument job: 'nosuchjob' is not a job id: a job id is the 16 hex digits `reactor submit` "
                    "printed (`reactor status` lists the daemon's jobs)\n"),
    (["--timeout-s", "inf"], "argument --timeout-s: seconds in (0, 86400] expected, got 'inf'"),
    (["--timeout-s", "nan"], "argument --timeout-s: seconds in (0, 86400] expected, got 'nan'"),
    (["--timeout-s", "-1"], "argument --timeout-s: seconds in (0, 86400] expected, got '-1'"),
])
def test_a_daemon_clients_bad_address_or_timeout_is_a_usage_error_not_a_traceback(args, message):
    """They were a ZMQError or OverflowError traceback, or a wait of "nan s"; a job id that is not one
    was the daemon protocol's "bad request: 'status' field 1: ... got str 'nosuchjob'"."""
    p = reactor("status", *args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("command", [["logs"], ["stop"]])
def test_every_command_that_takes_a_job_id_says_what_one_is(command):
    p = reactor(*command, "0123")
    assert p.returncode == 2 and p.stderr.endswith("argument job: '0123' is not a job id: a job id is the 16 hex "
                                                   "digits `reactor submit` printed (`reactor status` lists the "
                                                   "daemon's jobs)\n"), p.stderr


def test_a_placement_files_binds_and_a_file_that_is_not_text_are_refused_in_one_line_before_a_worker_starts(tmp_path):
    """Regression (a hostile pass): a group's ``bind`` with port 99999, an address of another host, or the
    same address as another group's was taken, and the worker died at its bind: its traceback, then
    "worker 'a' exited with status 1"; a placement or hosts file that is not UTF-8 was "reactor: 'utf-8'
    codec can't decode byte 0xff ...", naming no file. (Workers as new interpreters: a run's fork server
    imports torch, which the demo does not use. The first refusal keeps it: the command starts it before it
    reads the placement file, and closes it on the refusal, which stays one line.)"""
    quick = {"REACTOR_FORK_SERVER": "0"}

    def placement(name: str, *groups: tuple[str, str]) -> str:
        path = tmp_path / name
        path.write_text("".join(f'[groups.{g}]\nreactors = {pats}\nbind = "{bind}"\n'
                                for g, (pats, bind) in zip("abcd", groups)))
        return str(path)

    cases = [
        (placement("port.toml", ('["*"]', "tcp://127.0.0.1:99999")),
         "group 'a' bind 'tcp://127.0.0.1:99999': port '99999' is not a port (1..65535, or * or 0 for any free one)"),
        (placement("v6.toml", ('["*"]', "tcp://[::1]:*")),  # (the worker's bind said "No such device")
         "group 'a' bind 'tcp://[::1]:*': an IPv6 address: a run's sockets take an IPv4 one, an interface's name or *"),
        (placement("there.toml", ('["*"]', "tcp://192.0.2.1:5555")),  # (TEST-NET-1: no host's address)
         "group 'a' bind 'tcp://192.0.2.1:5555': '192.0.2.1' is not an address of this host ("),
        (placement("twice.toml", ('["producer*"]', "tcp://127.0.0.1:5599"),
                   ('["squarer*", "collector"]', "tcp://127.0.0.1:5599")),
         "groups 'a' and 'b' both bind 'tcp://127.0.0.1:5599': one process per address"),
    ]
    for i, (path, want) in enumerate(cases):
        p = reactor("run", DEMO, "--placement", path, "--set", "stop_s=0.05", env=quick if i else None)
        assert p.returncode == 2 and p.stderr.startswith(f"reactor: placement file {path}: {want}"), p.stderr
        assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[groups.a]\n")
    p = reactor("run", DEMO, "--placement", str(binary), env=quick)
    assert (p.returncode, p.stderr) == (2, f"reactor: placement file {binary}: 'utf-8' codec can't decode byte 0xff in "
                                           f"position 0: invalid start byte\n")
    p = reactor("run", DEMO, "--placement", "actors", "--hosts", str(binary), env=quick)
    assert (p.returncode, p.stderr) == (2, f"reactor: hosts file {binary}: 'utf-8' codec can't decode byte 0xff in "
                                           f"position 0: invalid start byte\n")
    # Any free port (* or 0, which groups may share: each gets its own) and an interface's name are taken:
    # one run, a group each.
    ok = placement("ok.toml", ('["producer*"]', "tcp://127.0.0.1:*"), ('["squarer[0]"]', "tcp://127.0.0.1:0"),
                   ('["squarer[1]"]', "tcp://127.0.0.1:0"), ('["collector"]', "tcp://lo:*"))
    p = reactor("run", DEMO, "--placement", ok, "--set", "stop_s=0.05", "-v", env=quick)
    assert p.returncode == 0, p.stderr
    assert "run started: 4 workers ready" in p.stderr, p.stderr


def test_a_run_on_one_host_takes_with_files_past_a_jobs_bounds_as_it_ships_nothing(tmp_path):
    """Regression: the bounds of what a job carries (32 MiB, 64 files: a submit's or a run over hosts' shipped
    files) refused a run on one host, which ships nothing, a 33 MiB ``--with`` file; a placement file with
    hosts of its own (no --hosts) still has them said before anything goes. (Workers as new interpreters: no
    fork server to import torch, which the demo does not use.)"""
    big = tmp_path / "weights.bin"
    with open(big, "wb") as f:  # (sparse: 33 MiB of nothing)
        f.truncate(33 * 2**20)
    for placement in ("single", "processes"):
        p = reactor("run", DEMO, "--placement", placement, "--with", str(big), "--set", "stop_s=0.05",
                    env={"REACTOR_FORK_SERVER": "0"})
        assert p.returncode == 0, (placement, p.stderr)
    over = tmp_path / "over.toml"  # (its daemon is never reached: the bound is said first)
    over.write_text('[hosts]\nh1 = "tcp://127.0.0.1:1"\n[groups.a]\nreactors = ["*"]\nhost = "h1"\n')
    p = reactor("run", DEMO, "--placement", str(over), "--with", str(big))
    assert p.returncode == 2 and "more than the 32 MiB a job carries" in p.stderr, p.stderr


def test_a_stop_time_past_every_tag_is_one_line_not_an_overflow_traceback():
    """Regression (a hostile pass): ``--stop-s 1e300`` (or ``--set stop_s=1e300``, or a timer's period) ended
    in an ``OverflowError`` traceback from the conversion to nanoseconds; a time of 2**62 ns or more is past
    every tag (``FOREVER_NS``)."""
    p = reactor("run", DEMO, "--stop-s", "1e300")
    assert (p.returncode, p.stderr) == (2, "reactor: stop_s must be below 4.612e+09 seconds (2**62 ns, about 146 "
                                           "years), got 1e+300\n")
    p = reactor("run", DEMO, "--set", "stop_s=1e300")
    assert (p.returncode, p.stderr) == (2, "reactor: Graph stop_s must be below 4.612e+09 seconds (2**62 ns, about "
                                           "146 years), got 1e+300\n")


def test_a_placement_file_that_is_not_there_is_named_as_a_missing_file(tmp_path):
    p = reactor("run", DEMO, "--placement", str(tmp_path / "nope.toml"))
    assert (p.returncode, p.stderr) == (2, f"reactor: --placement '{tmp_path / 'nope.toml'}': no placement file there "
                                           f"(or use one of single, processes, actors, colocated, dp-learners)\n")
    p = reactor("run", DEMO, "--placement", "actor")
    assert (p.returncode, p.stderr) == (2, "reactor: --placement 'actor': neither one of single, processes, actors, "
                                           "colocated, dp-learners nor a placement file\n")


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path):
    """Regression (a newcomer's pass, session 52): `reactor graph APP | head -1` ended in a
    BrokenPipeError traceback. Now it stops as other tools do (141: SIGPIPE's status), saying nothing.
    (A graph of 3,000 reactors: its description is far more than a pipe holds, so the writes meet the
    closed pipe however the output is buffered.)"""
    app = tmp_path / "wide.py"
    app.write_text("from reactor import Graph, Reactor\n\nclass R(Reactor):\n    pass\n\n"
                   "def build(config):\n    g = Graph()\n    for i in range(3000):\n"
                   "        g.add(R(), name=f'reactor_with_a_long_name_{i}')\n    return g\n")
    p = subprocess.run(f"set -o pipefail; {sys.executable} -m reactor.cli graph {app} | head -c 10", shell=True,
                       capture_output=True, text=True, timeout=120, cwd=ROOT, executable="/bin/bash")
    assert (p.returncode, p.stdout, p.stderr) == (141, "reactors:\n", ""), (p.returncode, p.stderr[-2000:])
    # The same when the app's own build is what writes (a review found it reported as the app's error).
    chatty = tmp_path / "chatty.py"
    chatty.write_text("from reactor import Graph\n\ndef build(config):\n    for i in range(20000):\n"
                      "        print('a line of the app, number', i)\n    return Graph()\n")
    p = subprocess.run(f"set -o pipefail; {sys.executable} -m reactor.cli graph {chatty} | head -c 10", shell=True,
                       capture_output=True, text=True, timeout=120, cwd=ROOT, executable="/bin/bash")
    assert (p.returncode, p.stdout, p.stderr) == (141, "a line of ", ""), (p.returncode, p.stderr[-2000:])


def test_restart_never_is_taken_in_a_deterministic_run():
    """`never` contradicts nothing (a wrapper may always pass --restart); a policy that restarts is refused
    there (tests/launch/test_restart.py). (Workers as new interpreters: no fork server to import torch.)"""
    p = reactor("run", DEMO, "--placement", "processes", "--restart", "never", "--set", "stop_s=0.05",
                env={"REACTOR_FORK_SERVER": "0"})
    assert p.returncode == 0 and "run ended (stop_time)" in p.stdout, p.stderr


@pytest.mark.parametrize("command", [["run", DEMO], ["eval", "runs/none"], ["submit", DEMO], ["slurm", DEMO]])
@pytest.mark.parametrize(("seed", "message"), [
    ("-5", "argument --seed: a seed in [0, 2**63) expected, got '-5'"),
    (str(2**70), f"argument --seed: a seed in [0, 2**63) expected, got '{2**70}'"),
    ("x", "argument --seed: a whole number expected, got 'x'"),
    ("9" * 5000, "argument --seed: a seed in [0, 2**63) expected, got '9999"),  # (past int()'s 4,300 digits)
])
def test_a_seed_outside_what_every_command_takes_is_a_usage_error(command, seed, message):
    """Regression: `reactor eval --seed -5` was gymnasium's traceback and `--seed 2**70` a msgpack
    "Overflow when unpacking long long"; `reactor run` took both, while a daemon refuses a job whose
    seed is not in [0, 2**63)."""
    p = reactor(*command, "--seed", seed)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr) < 1000, len(p.stderr)  # (the value is cut)


def test_a_daemon_key_that_is_a_directory_is_a_one_line_error(tmp_path):
    from reactor.launch._keys import init_keys

    init_keys(tmp_path / "keys")
    p = reactor("status", "--daemon", "tcp://127.0.0.1:1", "--daemon-key", str(tmp_path), "--keys", str(tmp_path / "keys"))
    assert p.returncode == 2 and p.stderr == f"reactor: --daemon-key {tmp_path}: Is a directory\n", p.stderr
    missing = tmp_path / "nosuch.pub"
    p = reactor("status", "--daemon", "tcp://127.0.0.1:1", "--daemon-key", str(missing), "--keys", str(tmp_path / "keys"))
    assert p.returncode == 2 and p.stderr == (f"reactor: --daemon-key {missing}: no such file, and not a key's "
                                              f"40-character Z85 text either (give the daemon's key.pub, or the text "
                                              f"in it)\n"), p.stderr


def test_a_daemon_address_where_nothing_listens_is_said_at_once_not_after_the_timeout(tmp_path):
    """Regression (left alone in sessions 70-72): `reactor status --daemon tcp://HOST:WRONGPORT` waited its
    whole --timeout-s out (10 s by default) to say that nothing had accepted a TCP connection. Connects
    refused again and again for 2 s are that answer; an address that accepts the connection and does
    not answer still waits the timeout out (a busy daemon answers late, not never)."""
    import socket
    import time

    import zmq

    from reactor.launch._keys import init_keys

    keys = init_keys(tmp_path / "keys")
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as sock:  # a port that nothing listens on (freed)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    for command in (["status"], ["stop", "0123456789abcdef"]):  # (logs and submit: the same client, the same check)
        started = time.monotonic()
        p = reactor(*command, "--daemon", f"tcp://127.0.0.1:{port}", "--daemon-key", keys.public.decode(), "--keys",
                    str(tmp_path / "keys"), "--timeout-s", "60")
        took = time.monotonic() - started
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        assert (f"the daemon at tcp://127.0.0.1:{port} did not answer '{command[0]}': every TCP connect failed at "
                f"once (refused: nothing listens on that port; or the host is unknown or unreachable): check the "
                f"address and port, and that the daemon runs there") in p.stderr, p.stderr
        assert took < 45, took  # (not the 60 s timeout waited out)
    with socket.socket() as mute:  # a TCP listener that never speaks ZMTP: the timeout is waited out
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        started = time.monotonic()
        p = reactor("status", "--daemon", f"tcp://127.0.0.1:{mute.getsockname()[1]}", "--daemon-key",
                    keys.public.decode(), "--keys", str(tmp_path / "keys"), "--timeout-s", "2")
    assert p.returncode != 0 and "did not answer 'status' within 2.0 s: it accepted a TCP connection" in p.stderr, p.stderr
    assert time.monotonic() - started >= 2


def test_keys_init_inside_a_key_directorys_authorized_folder_is_refused_and_makes_nothing(tmp_path):
    """``reactor keys init KEYS/authorized/alice`` put a secret key among the public keys a daemon admits."""
    from reactor.launch._keys import init_keys

    init_keys(tmp_path / "keys")
    inside = tmp_path / "keys" / "authorized" / "alice"
    p = reactor("keys", "init", str(inside))
    assert p.returncode == 2 and p.stderr == (
        f"reactor: {inside} is inside {tmp_path / 'keys' / 'authorized'}, the authorized keys of key directory "
        f"{tmp_path / 'keys'}: make the key pair elsewhere, and copy its key.pub there\n"), p.stderr
    assert not inside.exists()
    assert reactor("keys", "init", str(tmp_path / "alice")).returncode == 0  # (elsewhere, as ever)


def test_app_without_build_is_a_one_line_error(tmp_path):
    app = tmp_path / "app.py"
    app.write_text("x = 1\n")
    p = reactor("graph", str(app))
    assert p.returncode == 2
    assert p.stderr == f"reactor: {app} defines no build(config) function; an app file must define build(config) -> Graph\n"


def test_an_app_file_that_is_not_python_source_or_whose_build_takes_other_arguments_is_one_line(tmp_path):
    """Regression (a hostile pass): a binary file given as the app (a NUL byte in it) was Python's
    "SyntaxError: source code string cannot contain null bytes" with reactor's whole traceback, naming no
    file (``run``, ``graph``, ``submit``, ``k8s render``); a ``build(config, extra)`` was "TypeError:
    build() missing 1 required positional argument" at reactor's call, its traceback and exit 1."""
    binary = tmp_path / "model.py"
    binary.write_bytes(b"def build(config):\n    pass\n\0\x01\x02")
    for args in (("run", str(binary)), ("graph", str(binary)), ("submit", str(binary)), ("k8s", "render", str(binary))):
        p = reactor(*args)
        assert (p.returncode, p.stderr) == (2, f"reactor: {binary} is not Python source: it holds a NUL byte (a binary "
                                               f"file?)\n"), (args, p.stderr)
    app = tmp_path / "app.py"
    app.write_text("def build(config, extra):\n    pass\n")
    for command in ("run", "graph"):
        p = reactor(command, str(app))
        assert (p.returncode, p.stderr) == (2, f"reactor: {app}: build must take one argument, the config (missing a "
                                               f"required argument: 'extra')\n"), p.stderr


_BROKEN_APPS = {
    "syntax": ("from reactor import Graph\ndef build(config)\n    return Graph()\n",
               "line 2: SyntaxError: expected ':'", ["    def build(config)"]),
    "import": ("import no_such_module_here\ndef build(config):\n    pass\n",
               "line 1, in <module>: ModuleNotFoundError: No module named 'no_such_module_here'",
               ["line 1, in <module>", "    import no_such_module_here"]),
    "value": ("from reactor import Graph\n\ndef helper(c):\n    raise ValueError('boom')\n\ndef build(config):\n"
              "    helper(config)\n    return Graph()\n", "line 4, in helper: ValueError: boom",
              ["line 7, in build", "    helper(config)", "line 4, in helper"]),
    "key": ("def build(config):\n    return {}['k']\n", "line 2, in build: KeyError: 'k'", ["line 2, in build"]),
}


@pytest.mark.parametrize("kind", sorted(_BROKEN_APPS))
def test_an_error_in_the_apps_own_code_shows_the_apps_frames_and_one_line_naming_its_line(kind, tmp_path):
    """Regression (a newcomer's pass, session 52): a syntax error, a missing import or a KeyError in an
    app file was a full traceback through reactor's command and launcher, and a ValueError raised by
    the app's build was ``reactor: boom``, with no type, file or line. Now every error of the app's own
    code shows the app's frames (none of reactor's) and ends with one line naming the file and line."""
    text, last, shown = _BROKEN_APPS[kind]
    app = tmp_path / "app.py"
    app.write_text(text)
    for command in ("run", "graph"):
        p = reactor(command, str(app))
        assert p.returncode == 2, p.stderr
        assert p.stderr.endswith(f"reactor: {app} {last}\n"), p.stderr
        assert all(line in p.stderr for line in shown), p.stderr
        assert "reactor/cli/" not in p.stderr and "reactor/launch" not in p.stderr, p.stderr


def test_reactors_own_errors_raised_for_the_apps_build_stay_one_line(tmp_path):
    """A GraphError raised by the Graph API in the app's build keeps its one line (naming the app line)."""
    app = tmp_path / "app.py"
    app.write_text("from reactor import Graph\ndef build(config):\n    g = Graph()\n    g.add(3)\n    return g\n")
    p = reactor("run", str(app))
    assert (p.returncode, p.stderr) == (2, f"reactor: Graph.add expects a Reactor instance, got int ({app}:4)\n")


def test_an_app_is_compiled_as_an_import_compiles_it_whatever_reactors_own_future_flags(tmp_path):
    """Regression (a review of load_app's own compile, session 70): the app was compiled by a ``compile``
    in reactor/launch/_app.py, which inherits that module's ``from __future__ import annotations``, and
    under the path as given: every annotation of the app became a string (a ``Config`` field's type
    ``'int'``, not ``int``), and a graph error named ``app.py:13``, relative to a directory a process may
    not be in. The import system compiles with ``dont_inherit`` under the file's absolute path; so again."""
    (tmp_path / "app.py").write_text(
        "import dataclasses\n\nfrom reactor import Graph\n\n\n@dataclasses.dataclass(frozen=True)\nclass Config:\n"
        "    n: int = 1\n\n\ndef build(config):\n    if dataclasses.fields(Config)[0].type is not int:\n"
        "        raise ValueError(f'its type is {dataclasses.fields(Config)[0].type!r}')\n    g = Graph()\n"
        "    g.add(3)\n    return g\n")
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "graph", "app.py"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert (p.returncode, p.stderr) == (2, f"reactor: Graph.add expects a Reactor instance, got int "
                                           f"({tmp_path / 'app.py'}:15)\n"), p.stderr


def test_the_unshipped_import_check_takes_suppressed_and_main_only_imports_and_an_app_that_is_a_link(tmp_path):
    """Regression (a review of check_imports_shipped, session 70): ``with contextlib.suppress(ImportError):
    import x``, the spelling of a guarded import that try/except has, and ``if "__main__" == __name__:`` were
    refused as unshipped imports (a false refusal: their absence is expected, or they never run in a
    worker); and an app that is a symbolic link was checked against the link's folder only, so a module
    beside its file, on sys.path where it runs here, was not refused and failed on the job's host."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").mkdir()
    for name in ("fast_beside", "main_beside", "mysib"):
        (tmp_path / "real" / f"{name}.py").write_text("")
    demo = (ROOT / "apps" / "demo_pipeline.py").read_text()
    app = tmp_path / "real" / "guarded.py"
    app.write_text(demo + "\nimport contextlib\n\nwith contextlib.suppress(ModuleNotFoundError):\n    import fast_beside\n"
                   "if '__main__' == __name__:\n    import main_beside\n")
    p = reactor("k8s", "render", str(app), "--image", "img")
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    (tmp_path / "real" / "uses_mysib.py").write_text(demo + "\nimport mysib\n")
    (tmp_path / "link" / "uses_mysib.py").symlink_to(tmp_path / "real" / "uses_mysib.py")
    p = reactor("k8s", "render", str(tmp_path / "link" / "uses_mysib.py"), "--image", "img")
    assert p.returncode == 2 and p.stderr.startswith(
        f"reactor: a k8s job carries the app and its --with files, not the app's folder: its workers would fail "
        f"with ModuleNotFoundError on this module from there: mysib ({tmp_path / 'real' / 'mysib.py'}, "), p.stderr


def test_an_env_module_beside_the_app_that_a_set_env_names_and_no_with_ships_is_refused_before_the_job_leaves(tmp_path):
    """Regression (a newcomer's pass over docs/guide.md, section 3, h30): ``reactor submit my_dqn.py --set
    env=my_envs:MyChain-v0``, with ``my_envs.py`` beside a copy of ``apps/dqn.py`` (which has no import of
    it: gymnasium imports the module the env id names), was taken: the job failed at once in its daemon's
    log, "its module does not import here", though the guide says submit refuses it naming the ``--with``
    to add. It is refused at the terminal as an unshipped import statement is; ``--with`` ships it."""
    demo = (ROOT / "apps" / "demo_pipeline.py").read_text()
    app = tmp_path / "envs_app.py"  # (the demo with an env field: the graph builds without making the env)
    app.write_text(demo + "\n\n@dataclass(frozen=True)\nclass Config(Config):\n    env: str = 'CartPole-v1'\n")
    module = tmp_path / "beside_envs.py"  # (a name no folder on the test's sys.path has)
    module.write_text("")
    refused = (f"reactor: a submitted job carries the app and its --with files, not the app's folder: its workers "
               f"would fail with ModuleNotFoundError on this module from there: beside_envs ({module}, imported by "
               f"gymnasium for --set env=beside_envs.sub:MyChain-v0). Add --with {module}\n")
    p = reactor("submit", str(app), "--set", "env=beside_envs.sub:MyChain-v0", "--daemon", "tcp://127.0.0.1:9")
    assert (p.returncode, p.stderr) == (2, refused), p.stderr
    p = reactor("k8s", "render", str(app), "--image", "img", "--set", "env=beside_envs:MyChain-v0")
    assert (p.returncode, p.stderr.replace("k8s job", "submitted job").replace("beside_envs:", "beside_envs.sub:")) \
        == (2, refused), p.stderr
    p = reactor("k8s", "render", str(app), "--image", "img", "--set", "env=beside_envs:MyChain-v0", "--with",
                str(module))
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    p = reactor("k8s", "render", str(app), "--image", "img", "--set", "env=CartPole-v1")  # (no module named)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr


def test_an_option_the_command_does_not_take_is_that_commands_error_naming_the_option_it_is_close_to():
    """Regression (a newcomer's typo, h30): ``reactor run app.py --sett lr=1`` was the top parser's error
    under its usage, which lists the commands (``{run,graph,trace,...}``), not the options of ``run``; the
    option meant was the user's to find. It is now the command's own error, with its usage, naming the
    option it is close to (and nothing of the app is loaded)."""
    p = reactor("run", DEMO, "--sett", "stop_s=0.1")
    assert p.returncode == 2 and p.stderr.startswith("usage: reactor run "), p.stderr
    assert p.stderr.endswith("reactor run: error: unrecognized arguments: --sett stop_s=0.1 (did you mean --set?)\n")
    p = reactor("trace", "show", "x.trace", "--bogus")  # (a command of a command: its own parser)
    assert p.returncode == 2 and p.stderr.startswith("usage: reactor trace show "), p.stderr
    assert p.stderr.endswith("reactor trace show: error: unrecognized arguments: --bogus\n"), p.stderr


def test_bad_set_values_are_one_line_errors():
    p = reactor("run", DEMO, "--set", "nokey")
    assert (p.returncode, p.stderr) == (2, "reactor: --set expects key=value, got 'nokey'\n")
    p = reactor("run", DEMO, "--set", "speed=3")
    assert p.returncode == 2
    assert p.stderr.startswith("reactor: unknown config key 'speed'; Config has: producers, stop_s, workers")
    p = reactor("run", DEMO, "--set", "workerz=3")  # (a close name is suggested)
    assert p.returncode == 2
    assert p.stderr.startswith("reactor: unknown config key 'workerz' (did you mean 'workers'?); Config has: ")
    p = reactor("run", DEMO, "--set", "workers=many")
    assert (p.returncode, p.stderr) == (2, "reactor: config key 'workers' expects int, got 'many'\n")


def test_a_set_value_the_apps_graph_refuses_is_named_with_its_key_and_value():
    """Regression: ``--set producers=0`` on the demo was "replicas must be an int >= 1, got 0 (apps/...:83)",
    the app's line alone: which of the command line's values fed it was the user's to find. The refusal
    now names the --set item whose value it shows and which that app line reads (not another item's)."""
    p = reactor("run", DEMO, "--set", "producers=0", "stop_s=0.1")
    assert (p.returncode, p.stderr) == (2, f"reactor: --set producers=0: replicas must be an int >= 1, got 0 "
                                           f"({DEMO}:83)\n")
    p = reactor("graph", DEMO, "--set", "producers=0", "workers=0")
    assert p.stderr == f"reactor: --set producers=0: replicas must be an int >= 1, got 0 ({DEMO}:83)\n", p.stderr
    p = reactor("graph", DEMO, "--set", "producers=2", "workers=-1")
    assert p.stderr == f"reactor: --set workers=-1: replicas must be an int >= 1, got -1 ({DEMO}:84)\n", p.stderr
    # (a zero or twelve too many: before the bound, a list of 10**23 names filled the host's memory)
    p = reactor("graph", DEMO, "--set", "producers=100000000000000000000000", timeout=60)
    assert (p.returncode, p.stderr) == (2, f"reactor: --set producers=100000000000000000000000: replicas must be at "
                                           f"most 65,536, got 100000000000000000000000 ({DEMO}:83)\n")


def test_data_parallel_learners_sharing_a_process_are_a_one_line_error_before_anything_starts(tmp_path,
                                                                                               placement="single"):
    """Regression (a newcomer's run, session 52): ``reactor run apps/dqn.py --set learners=2`` (no
    ``dp-learners``) sat 600 s at 0 env steps, its first replica waiting for a second its process
    could not start, and two Ctrl-C did not stop it. (The refusal names the --set item it comes from.)"""
    p = reactor("run", str(ROOT / "apps" / "dqn.py"), "--placement", placement, "--set", "learners=2",
                f"run_dir={tmp_path / 'run'}", timeout=300)
    process = "main" if placement == "single" else "learner"
    assert p.returncode == 2 and p.stderr.startswith(
        f"reactor: --set learners=2: learner: its 2 replicas each need a process of their own (data-parallel "
        f"replicas: each joins the "
        f"bank's torch.distributed group), but placement '{placement}' puts learner[0] and learner[1] in process "
        f"'{process}': use --placement dp-learners"), p.stderr
    assert p.stderr.count("\n") == 1 and not (tmp_path / "run").exists()


def test_data_parallel_learners_sharing_a_process_are_refused_before_a_job_leaves(tmp_path):
    """Regression (a newcomer's pass, h30): ``reactor submit apps/dqn.py --set learners=2`` (placement
    ``single``, or ``actors``) was taken, though submit checks the --set values against the app's graph:
    the job failed at once in its daemon's log with the refusal ``reactor run`` says at the terminal. The
    graph built for that check is now placed too, and a placement refusal a --set value feeds is refused
    (``k8s render``, ``slurm`` and ``ray`` alike); under ``dp-learners`` it goes."""
    dqn = str(ROOT / "apps" / "dqn.py")
    said = ("reactor: --set learners=2: learner: its 2 replicas each need a process of their own (data-parallel "
            "replicas: each joins the bank's torch.distributed group), but placement '{}' puts learner[0] and "
            "learner[1] in process '{}': use --placement dp-learners")
    p = reactor("submit", dqn, "--set", "learners=2", "--daemon", "tcp://127.0.0.1:9", timeout=300)
    assert p.returncode == 2 and p.stderr.startswith(said.format("single", "main")), p.stderr
    assert p.stderr.count("\n") == 1, p.stderr
    p = reactor("k8s", "render", dqn, "--image", "img", "--placement", "actors", "--set", "learners=2", timeout=300)
    assert p.returncode == 2 and p.stderr.startswith(said.format("actors", "learner")), p.stderr
    p = reactor("k8s", "render", dqn, "--image", "img", "--placement", "dp-learners", "--set", "learners=2",
                timeout=300)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr


def test_an_app_path_too_long_for_the_file_system_is_a_one_line_error():
    """Regression: a name of 300 characters was an OSError (ENAMETOOLONG) traceback from Path.is_file."""
    p = reactor("run", "a" * 300 + ".py")
    assert p.returncode == 2 and p.stderr.startswith("reactor: [Errno 36] File name too long: 'aaa"), p.stderr[:300]
    assert p.stderr.count("\n") == 1


def test_a_huge_key_or_value_on_the_command_line_is_cut_in_its_error():
    """Regression: an unknown --set key of 100,000 characters was echoed whole, and so was an env name
    that gymnasium's error quoted again."""
    key = "k" * 100_000
    p = reactor("run", DEMO, "--set", f"{key}=1")
    assert p.returncode == 2 and p.stderr.startswith("reactor: unknown config key 'kkkk") and len(p.stderr) < 300, \
        p.stderr[:400]
    assert "...kkk" in p.stderr and "Config has: producers, stop_s, workers" in p.stderr
    p = reactor("run", DEMO, "--set", f"workers={key}")
    assert p.returncode == 2 and p.stderr.startswith("reactor: config key 'workers' expects int, got 'kkk")
    assert len(p.stderr) < 200, p.stderr[:400]
    p = reactor("run", str(ROOT / "apps" / "dqn.py"), "--set", f"env={'e' * 3000}")
    assert p.returncode == 2 and p.stderr.startswith("reactor: env 'eee") and len(p.stderr) < 2100, len(p.stderr)
    assert "characters cut] ..." in p.stderr and p.stderr.count("\n") == 1


def test_invalid_graph_reports_every_problem_without_a_traceback(tmp_path):
    app = tmp_path / "bad.py"
    app.write_text(
        "from reactor import Graph, Input, Reactor\n"
        "class Need(Reactor):\n"
        "    inp = Input(int, required=True)\n"
        "def build(config):\n"
        "    g = Graph()\n"
        "    g.add(Need(), name='need')\n"
        "    return g\n"
    )
    p = reactor("run", str(app))
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert f"need.inp is a required input of Need but nothing is connected to it ({app}:6)" in p.stderr


def test_help_for_each_command():
    for cmd in (["--help"], ["run", "--help"], ["graph", "--help"], ["trace", "--help"], ["trace", "diff", "--help"]):
        p = reactor(*cmd)
        assert p.returncode == 0 and "usage: reactor" in p.stdout


def test_every_command_help_has_a_description():
    """Regression (a newcomer's walk): `reactor status`, `logs`, `stop` and `keys` --help showed the usage and
    the options with no line of what the command does, and --timeout-s did not say its default."""
    import argparse

    from reactor.cli._args import _parser

    def commands(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield [*path, name], sub
                    yield from commands(sub, [*path, name])

    found = dict((" ".join(path), sub) for path, sub in commands(_parser(), []))
    assert {"status", "logs", "stop", "keys", "keys init", "trace show"} <= found.keys()
    assert [name for name, sub in found.items() if not sub.description] == []
    p = reactor("stop", "--help")  # (the command itself prints it)
    text = " ".join(p.stdout.split())
    assert p.returncode == 0 and found["stop"].description in text, text
    assert "how long to wait for each answer (default 10)" in text


def test_the_job_commands_help_finds_the_daemon_only_where_the_command_can():
    """Regression (a newcomer's pass, session 54): the --daemon help of status, logs and stop said "default:
    the head host of --placement/--hosts", options those commands do not have."""
    for cmd in ("status", "logs", "stop"):
        p = reactor(cmd, "--help")
        text = " ".join(p.stdout.split())
        assert p.returncode == 0 and "--placement" not in text and "--hosts" not in text and "hosts file says" not in text
        assert "--daemon DAEMON the tcp://HOST:PORT of the daemon the job was submitted to" in text, text
    p = reactor("submit", "--help")
    assert "default: the head host of --placement/--hosts" in " ".join(p.stdout.split())


def test_trace_show_and_diff(tmp_path):
    racing = str(ROOT / "tests" / "apps" / "racing.py")
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    for t in (a, b):
        p = reactor("run", racing, "--async", "--record", str(t), "--stop-s", "0.4")
        assert p.returncode == 0, p.stderr
    p = reactor("trace", "show", str(a), "--limit", "2")
    assert p.returncode == 0
    assert "folder: " in p.stdout and "input" in p.stdout
    p = reactor("trace", "diff", str(a), str(a))
    assert (p.returncode, p.stdout) == (0, "traces are identical\n")
    junk = tmp_path / "junk.trace"
    junk.write_bytes(b"\x00garbage")
    p = reactor("trace", "show", str(junk))
    assert p.returncode == 2 and p.stderr.startswith(f"reactor: {junk} is not a")


def test_a_trace_that_is_not_there_or_a_directory_and_a_negative_limit_are_one_line_naming_them(tmp_path):
    """Regression (a newcomer's pass): ``--replay`` or ``trace show`` of a missing file said "[Errno 2] No
    such file or directory: 'x'", of a directory "[Errno 21] Is a directory", neither naming a trace; and
    ``trace show --limit -1`` listed all events but one and then said "... 231 more" of 230."""
    missing = tmp_path / "missing.trace"
    for args in (["trace", "show", str(missing)], ["run", DEMO, "--async", "--replay", str(missing)]):
        p = reactor(*args)
        assert p.returncode == 2 and p.stderr == (f"reactor: no trace file at '{missing}' (reactor run --async "
                                                  f"--record writes one)\n"), p.stderr
    p = reactor("trace", "show", str(tmp_path))
    assert p.returncode == 2 and p.stderr == f"reactor: {tmp_path} is a directory, not a trace file\n", p.stderr
    p = reactor("trace", "show", str(tmp_path), "--limit", "-1")
    assert p.returncode == 2 and p.stderr.endswith("argument --limit: a number >= 0 expected, got '-1'\n"), p.stderr


@pytest.mark.parametrize("app", sorted(p.name for p in (ROOT / "apps").glob("*.py") if "\nALGO = " in p.read_text()))
def test_every_training_app_takes_target_return_none(app):
    """Regression (issue 19): the transformer app refused `--set target_return=None`, which every
    other app took (None: run to max_env_steps)."""
    required = {"transformer_offline.py": ["--set", "source=runs/src"]}.get(app, [])  # (its data: refused without)
    p = reactor("graph", str(ROOT / "apps" / app), "--set", "target_return=None", *required, "--format", "text")
    assert p.returncode == 0, p.stderr


def test_a_hosts_file_naming_a_host_that_does_not_resolve_is_one_line_and_leaves_no_run_directory(tmp_path):
    """Regression (a newcomer's pass over docs/cluster.md, session 52): a typo in the head host's name was
    a socket.gaierror traceback, and left the run's directory behind (the next run warned of "a dead
    coordinator"). So did a run over hosts without a key pair."""
    from reactor.launch._keys import init_keys

    init_keys(tmp_path / "keys")
    (tmp_path / "hosts.toml").write_text('[hosts]\nh1 = "tcp://no-such-host.invalid:7000"\n')
    env = {**os.environ, "REACTOR_KEYS": str(tmp_path / "keys"), "REACTOR_RUNTIME_DIR": str(tmp_path / "rt")}
    for keys, message in [(tmp_path / "keys", "reactor: host address tcp://no-such-host.invalid:7000: "
                                              "'no-such-host.invalid' cannot be resolved ("),
                          (tmp_path / "none", f"reactor: no key pair at {tmp_path / 'none' / 'key'}")]:
        p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", DEMO, "--placement", "processes", "--hosts",
                            str(tmp_path / "hosts.toml")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env={**env, "REACTOR_KEYS": str(keys)})
        assert p.returncode == 2 and p.stderr.startswith(message) and p.stderr.count("\n") == 1, p.stderr
        assert not list((tmp_path / "rt").glob("reactor-*")), "a run directory was left behind"


def test_a_host_whose_name_does_not_resolve_is_named_so_among_the_hosts_that_did_not_answer():
    """A typo in a host that is not the run's head (its name is looked up only when a group goes
    there) was reported as a silent host, with a hint about keys (a review, session 52)."""
    import asyncio

    from reactor.launch._cluster import _unresolved

    why = asyncio.run(_unresolved("tcp://no-such-host.invalid:7000"))
    assert why is not None and why.startswith("its address tcp://no-such-host.invalid:7000: 'no-such-host.invalid' "
                                              "cannot be resolved ("), why
    assert asyncio.run(_unresolved("tcp://127.0.0.1:7000")) is None
    assert asyncio.run(_unresolved("tcp://[::1]:7000")) is None



_WRONG_SHAPE_ENV = '''
import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import register


class WrongShape(gym.Env):
    observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(4, np.float32), {}

    def step(self, action):
        return np.zeros(5, np.float32), 1.0, False, False, {}


register("WrongShape-v0", entry_point=WrongShape, max_episode_steps=50)
'''


@pytest.mark.parametrize("placement", ["single", "actors"])
def test_an_error_raised_in_an_envs_or_a_librarys_code_keeps_its_traceback(tmp_path, placement):
    """An env whose step returns a wrong observation shape ended with `reactor: Output array is the wrong
    shape` under `single` (numpy's ValueError, taken for a refusal of a setting: no file, no line), while
    `actors` showed the traceback (a newcomer's pass, session 55). Only what reactor raises itself is one line."""
    (tmp_path / "bad_envs.py").write_text(_WRONG_SHAPE_ENV)
    p = subprocess.run(
        [sys.executable, "-m", "reactor.cli", "run", str(ROOT / "apps" / "dqn.py"), "--placement", placement, "--set",
         "env=bad_envs:WrongShape-v0", "max_env_steps=500", "live=False", "target_return=None",
         f"run_dir='{tmp_path / 'run'}'"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback (most recent call last)" in p.stderr and "gymnasium" in p.stderr, p.stderr[-3000:]
    assert "ValueError: Output array is the wrong shape" in p.stderr


_NAN_REWARD_ENV = _WRONG_SHAPE_ENV.replace("np.zeros(5, np.float32), 1.0", "np.zeros(4, np.float32), float('nan')")


def test_nan_rewards_are_refused_where_they_enter_replay_in_one_line_naming_the_field(tmp_path):
    """NaN rewards trained a NaN network to the end (exit 0) without a word, and summary.json held a bare
    NaN, which a strict JSON parser refuses (a newcomer's pass, session 55: then said once, at the first NaN
    loss, and written as null). The actor's writer refuses them now (h3), naming the field, before any
    reaches replay; a summary still writes what is not a number as null (json_safe)."""
    from reactor.nodes.metrics import json_safe

    (tmp_path / "bad_envs.py").write_text(_NAN_REWARD_ENV)
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "reactor.cli", "run", str(ROOT / "apps" / "dqn.py"), "--set", "env=bad_envs:WrongShape-v0",
         "max_env_steps=600", "min_size=100", "live=False", "target_return=None", "eval_every_updates=50",
         f"run_dir='{run_dir}'"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.splitlines()[-1] == (
        "reactor: Writer.append: field 'reward' of stream 0 is nan; replay keeps finite numbers only (every update "
        "that samples a NaN or an infinity learns from it: its loss goes NaN): fix it in the env, or wrap the env to "
        "clip or replace such values"), p.stderr[-3000:]
    assert json.dumps(json_safe({"eval_return": float("nan"), "curve": [1.0, float("inf")]})) == \
        '{"eval_return": null, "curve": [1.0, null]}'


def test_a_failed_json_run_says_its_error_as_json_on_stdout():
    """`reactor run --json` printed nothing on stdout when the run failed: a script reading it had no
    error to show (a newcomer's pass, session 55)."""
    p = reactor("run", str(ROOT / "apps" / "dqn.py"), "--json", "--set", "lrr=1")
    assert p.returncode == 2
    out = json.loads(p.stdout)
    assert out["exit_status"] == 2 and out["error"].startswith("unknown config key 'lrr'"), out
    assert p.stderr.startswith("reactor: unknown config key 'lrr'")


_TEARDOWN_APP = '''
import atexit
import os
from pathlib import Path

from reactor import Graph, Reactor, reaction, startup

MARKS = Path(os.environ["MARKS"])


class Once(Reactor):
    @reaction(triggers=[startup])
    def go(self) -> None:
        pass


class _Kept:  # freed by the interpreter's teardown, if it runs
    def __del__(self) -> None:
        (MARKS / f"teardown-{os.getpid()}").touch()


_kept = _Kept()
atexit.register(lambda: (MARKS / f"atexit-{os.getpid()}").touch())


def build(config: dict) -> Graph:
    g = Graph()
    g.add(Once(), name="once")
    return g
'''


def test_a_multi_process_run_command_leaves_without_the_interpreters_teardown_but_runs_its_atexit_handlers(tmp_path):
    """Measured after a failed run (async DQN under actors, a worker's env raising): its coordinator was done
    ~1.5 s after the failure, the command ~1.2-4.8 s later, freeing the modules of a process that imported
    torch. The command of a multi-process run (whose reactors ran in its workers) now leaves once its atexit
    handlers ran and its output is flushed, without that teardown (a ``single`` run keeps it: its reactors ran
    there, and an object of theirs may flush a file only then)."""
    app, marks = tmp_path / "once.py", tmp_path / "marks"
    app.write_text(_TEARDOWN_APP)
    marks.mkdir()
    env = {**os.environ, "MARKS": str(marks), "REACTOR_FORK_SERVER": "0"}  # (no torch to preload: a quick run)
    p = subprocess.Popen([sys.executable, "-m", "reactor.cli", "run", str(app), "--placement", "processes"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    assert out == "run ended (quiescence): 1 events in 1 reactors, placement processes\n", out
    assert {m.name for m in marks.iterdir() if m.name.endswith(f"-{p.pid}")} == {f"atexit-{p.pid}"}  # (no teardown-)


def test_a_missing_key_pair_in_the_default_key_directory_says_how_to_name_another(tmp_path):
    """Regression (a newcomer's pass over docs/cluster.md): after `reactor keys init /shared/keys`, a command
    without REACTOR_KEYS said only "no key pair at ~/.reactor/keys/key: make one with `reactor keys init
    ~/.reactor/keys`", a second pair that no daemon admits. It now says the directory is the default and
    how to name the one made."""
    env = {k: v for k, v in os.environ.items() if k != "REACTOR_KEYS"}
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "status", "--daemon", "tcp://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "HOME": str(tmp_path)})
    default = tmp_path / ".reactor" / "keys"
    assert p.returncode == 2 and p.stderr == (
        f"reactor: no key pair at {default / 'key'} (the default key directory: name the one you made with --keys "
        f"DIR or REACTOR_KEYS=DIR): make one with `reactor keys init {default}`\n"), p.stderr
    assert not default.exists()


def test_a_placement_with_more_workers_than_this_hosts_memory_holds_is_refused_before_any_starts(tmp_path):
    """``--set actors=20000 --placement actors`` was taken: the coordinator began starting 20,003 worker
    processes (each takes ~120-150 MB here) until the host's OOM killer ended what it picked. It is now
    one line at the terminal, before any worker starts, naming the count and the memory; no run
    directory is left."""
    env = {**os.environ, "REACTOR_RUNTIME_DIR": str(tmp_path / "rt")}
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(ROOT / "apps" / "dqn.py"), "--placement", "actors",
                        "--set", "actors=20000"], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert p.stderr.startswith("reactor: placement 'actors': 20003 worker processes on this host need at least "
                               "1250.2 GiB at 64 MiB each, and this host has "), p.stderr
    assert "available (MemAvailable and free swap, or its memory cgroup's limit): run fewer replicas" in p.stderr
    assert not list((tmp_path / "rt").glob("reactor-*")), "a run directory was left behind"


_OOM_APP = '''
import os
from pathlib import Path

from reactor import Graph, Reactor, reaction, startup


class Say(Reactor):
    @reaction(triggers=[startup])
    def go(self) -> None:
        Path(os.environ["MARKS"], f"{self.name}-{os.getpid()}").write_text(open("/proc/self/oom_score_adj").read())


def build(config: dict) -> Graph:
    g = Graph()
    g.add(Say(), name="say", replicas=2)
    return g
'''


@pytest.mark.parametrize("fork_server", ["0", "1"])
def test_a_runs_workers_go_first_when_the_host_runs_out_of_memory(tmp_path, fork_server):
    """Each worker raises its ``oom_score_adj`` to 300: the kernel's OOM killer then ends a worker (its run
    says which, or restarts it) before the coordinator or a daemon, whose death ends every run they hold."""
    app, marks = tmp_path / "say.py", tmp_path / "marks"
    app.write_text(_OOM_APP)
    marks.mkdir()
    env = {**os.environ, "MARKS": str(marks), "REACTOR_FORK_SERVER": fork_server}
    p = subprocess.run([sys.executable, "-m", "reactor.cli", "run", str(app), "--placement", "processes"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    said = {m.name.rsplit("-", 1)[0]: m.read_text().strip() for m in marks.iterdir()}
    assert said == {"say[0]": "300", "say[1]": "300"}, said
