"""A group whose address cannot be bound (a careless user's placement; a probe, session 75): a port
another program holds, one port written two ways, a socket path past 107 bytes, a group name no
socket path can hold. Real `reactor run` commands, real sockets."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_APP = """
from dataclasses import dataclass
from reactor import Graph, Input, Output, Reactor, Timer, reaction

@dataclass(frozen=True)
class Config:
    stop_s: float = 0.2

class Producer(Reactor):
    tick = Timer(period_s=0.01)
    number = Output(int)

    @reaction(triggers=[tick], effects=[number])
    def emit(self) -> None:
        self.number.send(1)

class Printer(Reactor):
    number = Input(int, required=True)

    @reaction(triggers=[number])
    def show(self, number: int) -> None:
        pass

def build(config) -> Graph:
    g = Graph(stop_s=config.stop_s)
    g.connect(g.add(Producer(), name="producer").number, g.add(Printer(), name="printer").number)
    return g
"""


def _run(tmp: Path, placement: str, *, restart: bool = False) -> subprocess.CompletedProcess[str]:
    (tmp / "app.py").write_text(_APP)
    (tmp / "place.toml").write_text(placement)
    return subprocess.run([sys.executable, "-m", "reactor.cli", "run", "app.py", "--placement", "place.toml",
                           *(["--async", "--restart", "on-failure"] if restart else [])], cwd=tmp, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("restart", [False, True], ids=["once", "restart-on-failure"])
def test_a_port_another_program_holds_is_the_groups_refusal_in_one_line_never_restarted(tmp_path, restart):
    """It was the worker's traceback and "worker 'a' exited with status 1 (failed ...)", started again
    under ``--restart on-failure``. Now the group refuses the run, naming its address and what to do;
    a refusal is not restarted."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        p = _run(tmp_path, f'[groups.a]\nreactors = ["producer"]\nbind = "tcp://127.0.0.1:{port}"\n'
                           f'[groups.b]\nreactors = ["printer"]\n', restart=restart)
    assert p.returncode == 1, p.stderr
    assert (f"reactor worker a: group 'a' cannot bind 'tcp://127.0.0.1:{port}': Address already in use (another program, or another "
            f"group of this run, holds it: give the group another address)") in p.stderr, p.stderr
    said = ("reactor: WorkerFailedError: worker 'a' exited with status 2 (refused the run: its line is in its output) "
            "before the run ended")
    if restart:
        said += "; group 'a' was not restarted: exit status 2 is a refusal of what the run was given, which a new " \
                "life is given again"
    assert p.stderr.endswith(said + "\n") and len(p.stderr.splitlines()) == 2, p.stderr


def test_a_socket_path_past_107_bytes_is_the_groups_refusal_in_one_line(tmp_path):
    """A placement's ipc address past what a socket's path holds was zmq's error in a worker's traceback."""
    path = tmp_path / ("s" * 120)
    p = _run(tmp_path, f'[groups.a]\nreactors = ["producer"]\nbind = "ipc://{path}"\n[groups.b]\nreactors = ["printer"]\n')
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 2, p.stderr
    assert (f"reactor worker a: group 'a' cannot bind 'ipc://{path}': File name too long (a socket's path holds at "
            f"most 107 bytes: a shorter group name, or a shorter REACTOR_RUNTIME_DIR)\n") in p.stderr, p.stderr


def test_a_group_name_no_socket_path_could_hold_is_refused_with_the_placement(tmp_path):
    p = _run(tmp_path, f'[groups.{"g" * 65}]\nreactors = ["producer"]\n[groups.b]\nreactors = ["printer"]\n')
    assert p.returncode == 2 and p.stderr == (f"reactor: placement file place.toml: group name '{'g' * 65}' must be 1 "
                                              f"to 64 letters, digits, '_', '-', '[' or ']'\n"), p.stderr
