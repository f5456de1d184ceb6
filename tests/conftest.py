"""Shared test configuration.

Every ``@pytest.mark.asyncio`` test runs once per event loop implementation: the default asyncio
loop and uvloop (when installed), via pytest-asyncio's ``pytest_asyncio_loop_factories`` hook. The
test ids carry the loop name (``[asyncio]``, ``[uvloop]``).

A test past its timeout fails alone: see "timeouts" below and pyproject.toml's addopts.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
    uvloop = None

_DUMPS = pytest.StashKey[Path]()


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


# ------------------------------------------------------------------------------------------------ timeouts
# pyproject.toml runs the session in pytest-xdist workers (-n 2) with pytest-timeout's thread method:
# a test past its timeout ends the worker process (os._exit), not the session; xdist reports that test as
# failed, starts a new worker and goes on with the next test. Inside a worker, pytest-timeout's stack dump
# would go to the worker's stdout, which execnet points at /dev/null, so the hooks below take over the
# thread method there: the timer thread writes why and where the test hung (its captured output and every
# thread's stack) to a file, and the session adds that file to the crash report xdist makes for the test.
# Without xdist (-n 0, e.g. for --pdb) pytest-timeout runs as configured: a timeout ends the session.


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.stash[_DUMPS] = Path(tempfile.mkdtemp(prefix="pytest-timeouts-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _DUMPS in config.stash:
        shutil.rmtree(config.stash[_DUMPS], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # the session, before it starts a worker
    node.workerinput["timeout_dumps"] = str(node.config.stash[_DUMPS])


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    workerinput = getattr(item.config, "workerinput", None)
    if settings.method != "thread" or workerinput is None or "timeout_dumps" not in workerinput:
        return None  # pytest-timeout's own timer
    dump = Path(workerinput["timeout_dumps"]) / f"{workerinput['workerid']}.txt"
    timer = threading.Timer(settings.timeout, _end_worker, (item, settings.timeout, dump))
    timer.name = f"timeout {item.nodeid}"
    timer.daemon = True

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # pytest-timeout's pytest_timeout_cancel_timer calls it
    timer.start()
    return True


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    dump = Path(report.node.config.stash[_DUMPS]) / f"{report.node.gateway.id}.txt"
    if dump.is_file():  # the worker ended on a timeout (otherwise it crashed on its own)
        report.longrepr = f"{dump.read_text()}\n{report.longrepr}"
        dump.unlink()


def _end_worker(item: pytest.Item, timeout_s: float, dump: Path) -> None:
    """The timer thread's work at the timeout: record the test's output and every thread's stack, then end
    this worker process (no exception can stop a thread blocked in C, e.g. inside uvloop's loop)."""
    try:
        parts = [f"Timeout: ran past its {timeout_s:g} s limit; the worker process running it was ended.\n"]
        capman = item.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(item)
            out, err = capman.read_global_capture()
            parts += [f"--- captured stdout\n{out}" if out else "", f"--- captured stderr\n{err}" if err else ""]
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            frames = [f for f in traceback.extract_stack(frame) if not _HARNESS.search(f.filename)]
            if not frames:  # a thread of the harness alone (execnet's receiver)
                continue
            parts.append(f"--- stack of thread {names.get(ident, '?')} ({ident}), harness frames left out\n")
            parts.append("".join(traceback.format_list(frames)))
        dump.write_text("".join(parts))
    except BaseException:
        traceback.print_exc()  # to the worker's stderr: the session's terminal
    finally:
        os._exit(1)


# pytest's, pluggy's, xdist's and execnet's own frames (the runner around every test)
_HARNESS = re.compile(r"[/\\](_pytest|pluggy|xdist|execnet)[/\\]|^<string>$")


@pytest.fixture(autouse=True)
def _remove_runtime_dirs():
    """The short runtime directories a test made under /tmp (tests/runtime_dirs.py), removed after it.
    (Looked up, not imported: this file is also copied alone into the sessions of test_suite_timeouts.)"""
    yield
    helper = sys.modules.get("tests.runtime_dirs")
    if helper is not None:
        helper.remove_made()


# ------------------------------------------------------------------------------------------- a local Slurm
# tests/launch/test_slurm.py's fixture starts a Slurm cluster on this machine (scripts/slurm_local.sh, as
# root) in whichever worker needs it first. The script records the daemons it starts with this session's
# token (REACTOR_TEST_SESSION, set here in the controller before the workers start, which inherit it);
# the session stops them at its end (in the controller, after every worker is done) only if it started
# them itself: the suite leaves no daemon behind, and a Slurm that ran before it, or that another session
# started, stays.

_SLURM_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_local.sh"
_SLURM_MARK = Path("/run/reactor-slurm-local")  # what the script started (see it)


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        os.environ["REACTOR_TEST_SESSION"] = f"{os.getpid()}-{secrets.token_hex(4)}"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return
    try:
        started = f"slurm {os.environ.get('REACTOR_TEST_SESSION')}" in _SLURM_MARK.read_text().splitlines()
    except OSError:
        return
    if started:
        subprocess.run(["bash", str(_SLURM_SCRIPT), "stop"], capture_output=True, timeout=120, check=False)
