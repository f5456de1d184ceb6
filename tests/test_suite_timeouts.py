"""The suite's timeout contract (pyproject.toml's pytest options, tests/conftest.py): a test that runs past
its timeout fails alone, with the stack it hung in, and the session goes on to the next test and reaches
its summary line.

pytest-timeout's thread method ends the process it runs in; the session runs its tests in pytest-xdist
workers, so that process is a worker: xdist reports the test as failed and starts a new worker. The
inner session here uses the suite's own options (its scheduler included: one that deadlocks after a
worker crash hangs this test, which then fails at its own timeout).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HANGS = '''\
import signal
import threading

import pytest
import uvloop


def test_before():
    assert sum(range(4)) == 6


@pytest.mark.timeout(2)
def test_hangs_inside_uvloop():
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(loop.create_future())  # never done: blocks in uvloop's C loop
    finally:
        loop.close()


def test_after_in_a_new_worker():
    assert threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # only the main thread may set handlers
    signal.signal(signal.SIGUSR1, previous)
'''


def test_a_test_hanging_inside_uvloop_past_its_timeout_fails_alone_and_the_session_reaches_its_summary(tmp_path):
    """Regression: with pytest-timeout's thread method in the session's own process, one test past its
    timeout ended the whole run: no summary, and none of the tests after it ran."""
    (tmp_path / "test_hangs.py").write_text(HANGS)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path)  # the suite's hooks, beside the generated test
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this session's worker's
    env["COLUMNS"] = "200"  # short summary lines whole
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-rA", "test_hangs.py"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text  # tests failed; not 2-4 (interrupted, internal error, usage)
    assert re.search(r"^=+ 1 failed, 2 passed in ", out.stdout, re.M), text
    assert re.search(r"^PASSED test_hangs\.py::test_before$", out.stdout, re.M), text
    assert re.search(r"^PASSED test_hangs\.py::test_after_in_a_new_worker$", out.stdout, re.M), text
    assert re.search(r"^FAILED test_hangs\.py::test_hangs_inside_uvloop - Timeout: ran past its 2 s limit",
                     out.stdout, re.M), text
    assert "replacing crashed worker" in out.stdout, text
    # the report shows where it hung: the test's own line, in the main thread's stack
    assert re.search(r'test_hangs\.py", line \d+, in test_hangs_inside_uvloop\n +loop\.run_until_complete',
                     out.stdout), text
