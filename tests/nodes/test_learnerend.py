"""The learner's final count for the summary (``run_dir/learner.json``): real processes holding real locks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from reactor.nodes._learnerend import END_FILE, LearnerEnd, learner_end

# A learner's life in another process: it holds the file, says so, and on a line of stdin writes its
# count and lets the file go (or is killed holding it).
LEARNER = """
import sys
from reactor.nodes._learnerend import LearnerEnd
end = LearnerEnd(sys.argv[1], 'learner')
print("held", flush=True)
if sys.stdin.readline():
    end.write("run-a", "learner", 353)
    end.close()
    print("ended", flush=True)
"""


def _learner(run_dir) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", LEARNER, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline() == "held\n"
    return p


def _reap(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.communicate(timeout=30)  # (its pipes closed)


def test_metrics_waits_for_a_learner_whose_shutdown_runs_in_another_process_and_takes_its_count(tmp_path):
    """Regression (a newcomer's walk): the summary counted the updates of the learner's last report (every
    100; one sent at shutdown is not delivered): "the run ended at update 300" where the learner made 353."""
    p = _learner(tmp_path)
    try:
        async def main() -> tuple[str, int] | None:
            reading = asyncio.ensure_future(learner_end(tmp_path, "run-a", wait=True, who="metrics"))
            for _ in range(20):  # (it cannot end while the learner holds the file)
                await asyncio.sleep(0.01)
            assert not reading.done()
            assert p.stdin is not None
            p.stdin.write("end\n")
            p.stdin.flush()
            return await asyncio.wait_for(reading, 30)

        assert asyncio.run(main()) == ("learner", 353)
    finally:
        _reap(p)
    assert asyncio.run(learner_end(tmp_path, "run-b", wait=True, who="metrics")) is None  # (another run's count)


@pytest.mark.timeout(120)
def test_metrics_never_waits_for_a_learner_that_is_gone(tmp_path, monkeypatch):
    """A learner killed holding the file (its count never written) lets it go with its process: the summary
    keeps the reported count at once, with no wait for a peer that is gone (a wait would outlast the test's
    timeout)."""
    monkeypatch.setattr("reactor.nodes._learnerend.END_WAIT_S", 3600.0)
    p = _learner(tmp_path)
    _reap(p)
    assert asyncio.run(learner_end(tmp_path, "run-a", wait=True, who="metrics")) is None


def test_a_learner_of_this_process_is_not_waited_for_and_its_new_life_empties_the_file(tmp_path):
    end = LearnerEnd(tmp_path, 'learner')
    end.write("run-a", "learner", 7)
    end.close()
    assert asyncio.run(learner_end(tmp_path, "run-a", wait=False, who="metrics")) == ("learner", 7)
    again = LearnerEnd(tmp_path, 'learner')  # (a restarted life: the count of the one before is not its own)
    try:
        assert (tmp_path / END_FILE).read_bytes() == b""
        # Its shutdown comes after the reader's here (shutdown reactions run in graph order): no wait.
        assert asyncio.run(learner_end(tmp_path, "run-a", wait=True, who="metrics")) is None
    finally:
        again.close()


@pytest.mark.parametrize("text", ["", "{", json.dumps({"run_id": "run-a", "source": "learner", "updates": -1}),
                                  json.dumps({"run_id": "run-a", "source": 3, "updates": 5}),
                                  json.dumps({"run_id": "run-a", "source": "learner", "updates": 5.0})])
def test_a_learner_json_not_of_its_shape_is_passed_over(tmp_path, text):
    (tmp_path / END_FILE).write_text(text)
    assert asyncio.run(learner_end(tmp_path, "run-a", wait=True, who="metrics")) is None
