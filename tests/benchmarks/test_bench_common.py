"""What the benchmark scripts share (``benchmarks/_common.py``): argument types that refuse a bad value in
one line, and the end of a child process, also one that ignores SIGINT and has children of its own."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROOT = Path(__file__).resolve().parents[2]

from benchmarks._common import (  # noqa: E402
    names_of,
    non_negative_int,
    output_to,
    positive_float,
    positive_int,
    stop_process,
)
from tests.launch.hosts import wait_for  # noqa: E402


def test_counts_and_sizes_below_their_least_are_refused_naming_the_value():
    assert positive_int("3") == 3 and non_negative_int("0") == 0 and positive_float("0.5") == 0.5
    with pytest.raises(argparse.ArgumentTypeError, match=r"^expects an integer >= 1, got '0'$"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^expects an integer >= 0, got '-1'$"):
        non_negative_int("-1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^expects an integer >= 1, got '2.5'$"):
        positive_int("2.5")
    for text in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=rf"^expects a number > 0, got '{text}'$"):
            positive_float(text)


def test_section_names_are_checked_against_the_choices_in_the_order_given():
    parse = names_of(["transitions", "episodes", "drift"])
    assert parse("drift, transitions,") == ["drift", "transitions"]
    with pytest.raises(argparse.ArgumentTypeError,
                       match=r"^unknown 'lost', 'x'; choose from transitions,episodes,drift \(comma-separated\)$"):
        parse("drift,lost,x")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^no name in ','; choose from .*$"):
        parse(",")


CHILD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a child that does not stop when asked
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (its parent killed, not yet reaped by init) is gone too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_child_group_that_ignores_sigint_is_killed_with_its_own_children_and_reaped():
    """Regression: bench_training.py's runs lead process groups of their own, which a Ctrl-C at the terminal
    does not reach; interrupted, the benchmark left its run going on (and writing into its removed
    temporary directory). The benchmarks end their children with stop_process, SIGINT then SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(proc.stdout.readline())
    t0 = time.monotonic()
    stop_process(proc, group=True, grace_s=0.5)
    assert proc.returncode == -9 and time.monotonic() - t0 < 5
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_child_that_stops_on_sigint_is_given_the_time_and_its_last_output_returned():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time\ntry:\n    print('started', flush=True); time.sleep(60)\n"
                               "except KeyboardInterrupt:\n    print('stopped cleanly')"],
        stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "started\n"
    assert stop_process(proc, group=False, grace_s=30) == "stopped cleanly\n"
    assert proc.returncode == 0
    assert stop_process(proc, group=False) is None  # (already ended: nothing to do)


@pytest.mark.timeout(120)
def test_a_ctrl_c_mid_measurement_is_one_line_and_status_130_and_the_benchmark_cleans_up(tmp_path):
    """Regression: a Ctrl-C printed KeyboardInterrupt's traceback from wherever the measurement was. It is one
    line now, exit status 130, and the benchmark's own cleanup still ran (bench_wal: its log and raw files)."""
    # (SIGINT as at a terminal: a suite started in the background, `.ci/run &`, hands its children SIGINT
    # ignored, and the benchmark then measured on through the signal)
    proc = subprocess.Popen([sys.executable, "benchmarks/bench_wal.py", "--dir", str(tmp_path), "--reps", "1000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None and "log in" in proc.stdout.readline()  # (measuring from here)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("wal-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(tmp_path.glob("wal-*")), "the benchmark never wrote its log"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdout, proc.stderr):  # (left open, they failed a later test of this worker at its gc)
            if pipe is not None:
                pipe.close()
    assert proc.returncode == 130 and err == "bench_wal.py: interrupted; what it printed above is partial\n", err
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


# A benchmark's figures, with a run inside output_to logging from this process and from a child process it
# started (a local run's workers inherit fd 2, and fd 1, where the Metrics node prints the run's result
# lines); then, with "fail" in argv, an error inside.
LOGGING = """
import logging, subprocess, sys
sys.path.insert(0, sys.argv[1])
from benchmarks._common import output_to
print("figure 1", flush=True)
with output_to(sys.argv[2]):
    logging.getLogger("reactor.launch").warning("a coordinator's warning")
    subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('a worker says so on its stderr\\\\n')"],
                   check=True)
    subprocess.run([sys.executable, "-c", "print('a worker prints its result lines')"], check=True)
    print("figure 2", flush=True)
    if "fail" in sys.argv:
        raise RuntimeError("the run failed: WorkerFailedError")
print("figure 3", flush=True)
logging.getLogger("reactor").warning("after the block")
"""


def test_what_the_runs_log_goes_to_the_file_and_only_the_figures_are_printed(tmp_path):
    """Regression: bench_cluster.py printed the runs' warnings and the local workers' log lines among its
    figures, and then its one-host runs' result lines (their workers' stdout). Inside output_to they go to
    the log file, the figures printed here to stdout still; outside it, stdout and stderr are the
    terminal's again."""
    log = tmp_path / "runs.log"
    proc = subprocess.run([sys.executable, "-c", LOGGING, str(ROOT), str(log)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "figure 1\nfigure 2\nfigure 3\n"
    assert proc.stderr == "after the block\n"  # (logging's last resort: no handler left on the root logger)
    text = log.read_text()
    assert "reactor.launch WARNING a coordinator's warning\n" in text
    assert "a worker says so on its stderr\n" in text
    assert "a worker prints its result lines\n" in text


def test_an_error_inside_is_printed_on_stderr_with_the_logs_path_and_last_lines(tmp_path):
    log = tmp_path / "runs.log"
    proc = subprocess.run([sys.executable, "-c", LOGGING, str(ROOT), str(log), "fail"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stdout == "figure 1\nfigure 2\n"
    err = proc.stderr.splitlines()
    assert err[0] == f"the runs' log: {log}; its last 3 lines:"
    assert err[1].endswith("reactor.launch WARNING a coordinator's warning")
    assert err[2] == "a worker says so on its stderr"
    assert err[3] == "a worker prints its result lines"
    assert err[-1] == "RuntimeError: the run failed: WorkerFailedError"
    assert "Traceback" not in log.read_text()


SWALLOWED = """
import ctypes, signal, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks._common import interruptible

def land_in_a_callback():
    signal.raise_signal(signal.SIGINT)  # a Ctrl-C, handled by Python while the callback runs
    for _ in range(1000):
        pass

def main():
    ctypes.CFUNCTYPE(None)(land_in_a_callback)()  # (as llvmlite calls back while numba compiles a kernel)
    time.sleep(3600)  # the measurement (a wait: the interrupt must end it, not only come after it)
    print("measured on", flush=True)

interruptible(main, "bench_x.py")
"""


@pytest.mark.timeout(120)
def test_a_ctrl_c_that_python_swallows_in_a_ctypes_callback_still_ends_the_benchmark():
    """Regression: a Ctrl-C that came while numba compiled a kernel (bench_wal's first inserts) raised
    KeyboardInterrupt inside llvmlite's ctypes callback, where Python prints "Exception ignored on calling
    ctypes callback function" and drops it: the benchmark measured on (the Ctrl-C test above, 1 run in 8
    beside two busy loops). interruptible sends such an interrupt again; it ends the run as any Ctrl-C, a
    wait it is in included (a flag for the interpreter's next check came only after the wait ended)."""
    p = subprocess.run([sys.executable, "-c", SWALLOWED, str(ROOT)], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert (p.returncode, p.stdout, p.stderr) == (130, "", "bench_x.py: interrupted; what it printed above is partial\n")


STUCK = """
import signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from benchmarks._common import interruptible

def terminate(signum, frame):  # (as the handler ray.init installs)
    raise SystemExit(signum)

def overdue():
    open(sys.argv[2], "w").write("ended what was left")

def main():
    signal.signal(signal.SIGTERM, terminate)
    try:
        print("measuring", flush=True)
        time.sleep(3600)
    finally:
        if sys.argv[3] == "stuck":
            threading.Event().wait()  # a peer's shutdown that never returns

interruptible(main, "bench_x.py", stop_s=2.0, overdue=overdue)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("cleanup", ["stuck", "prompt"])
def test_a_benchmark_whose_cleanup_hangs_after_a_signal_is_ended_with_its_stacks_and_leftovers(tmp_path, sig,
                                                                                               cleanup):
    """Regression: Ray's peer, sent SIGINT mid-run, did not end in 120 s and printed nothing (1 CI run in
    many; its ``ray.shutdown()``, or a C call the signal never left). With ``stop_s`` a benchmark still
    signalled after it is ended from a thread: where each thread was, the overdue cleanup, the one line,
    the signal's status. One whose cleanup ends in time is left alone: the one line, nothing else run."""
    mark = tmp_path / "overdue"
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(ROOT), str(mark), cleanup], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "measuring\n"
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    line = "bench_x.py: interrupted; what it printed above is partial\n"
    assert proc.returncode == (130 if sig == signal.SIGINT else 15), err
    if cleanup == "prompt":  # (SIGTERM's handler exits through SystemExit: no line, as Ray's)
        assert err == (line if sig == signal.SIGINT else "") and not mark.exists(), err
        return
    assert err.endswith(line), err
    assert took >= 2.0
    assert err.startswith(f"bench_x.py: not ended 2 s after signal {int(sig)}; where its threads were:\n"), err
    assert 'line 19 in main' in err, err  # (the main thread, in the finally that never returned)
    assert mark.read_text() == "ended what was left"


HELD = """
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from benchmarks._common import interruptible

def overdue():
    open(sys.argv[2], "w").write("ended what was left")

def main():
    print("measuring", flush=True)
    libc, mutex = ctypes.PyDLL(None), ctypes.create_string_buffer(64)  # (zeros: an unlocked default mutex)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # a C call that keeps the GIL and no signal ends: no handler, no thread runs

interruptible(main, "bench_x.py", stop_s=1.0, overdue=overdue)
"""


@pytest.mark.timeout(120)
def test_a_benchmark_whose_interpreter_is_held_after_a_signal_is_ended_by_its_guard(tmp_path):
    """Regression: Ray's peer, sent SIGINT as its raylet came up, printed nothing and did not end in 120 s
    although its overdue thread had been added for that (1 CI run in ~27 since): a main thread holding the
    GIL in a C call keeps that thread from running after its sleep. The guard process ends it: where its
    threads were (faulthandler, no GIL needed), the overdue cleanup, the one line, then SIGKILL."""
    mark = tmp_path / "overdue"
    proc = subprocess.Popen([sys.executable, "-c", HELD, str(ROOT), str(mark)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "measuring\n"
        wchan = Path(f"/proc/{proc.pid}/wchan")  # (in the lock: no bytecode left to run a handler)
        wait_for(lambda: "futex" in wchan.read_text(), 30, "the benchmark to block in its C call", 0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err
    assert err.startswith("bench_x.py: not ended 4 s after signal 2, its interpreter held"), err
    assert 'line 13 in main' in err, err  # (the main thread, in its C call)
    assert err.endswith("bench_x.py: interrupted; what it printed above is partial\n"), err
    assert mark.read_text() == "ended what was left"


def test_a_log_that_cannot_be_opened_leaves_stdout_and_the_descriptors_as_they_were(tmp_path):
    """Regression: ``output_to`` moved ``sys.stdout`` to a copy of fd 1 (and made two copies) before it opened
    its log: a ``--log`` in a missing directory raised there, leaving ``sys.stdout`` on the copy and both
    copies open for good."""
    fds = set(os.listdir("/proc/self/fd"))
    stdout = sys.stdout
    with pytest.raises(FileNotFoundError), output_to(tmp_path / "missing" / "runs.log"):
        pass
    assert sys.stdout is stdout
    assert set(os.listdir("/proc/self/fd")) == fds
