"""``benchmarks/bench_onesided.py`` runs and prints each of its figures (a small table, a few calls).

What the figures are is the benchmark's business (docs/benchmarks.md); this checks the script still
runs against the code it measures and says what it claims to: both sides' batch times, their ratio,
the draws ahead, a sample's fixed cost on both sides, and the client's parts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_the_one_sided_benchmark_prints_every_figure_beside_the_in_process_tables():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_onesided.py"), "--capacity", "16384",
                          "--reps", "1", "--calls", "5"], capture_output=True, text=True, timeout=100, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    ours = re.search(r"ReplayClient\.sample_now\s+([0-9.]+) ms/batch", text)
    peer = re.search(r"Table\.sample_nowait\s+([0-9.]+) ms/batch", text)
    ratio = re.search(r"ours / in-process speed\s+([0-9.]+)x", text)
    assert ours and peer and ratio, text
    assert float(ours[1]) > 0 and float(peer[1]) > 0
    assert float(ratio[1]) == pytest.approx(float(peer[1]) / float(ours[1]), rel=0.05)  # (from the rounded ms)
    few = re.search(r"a sample of 4 items .*: ours ([0-9.]+) us, Table\.sample_nowait ([0-9.]+) us", text)
    assert few and float(few[1]) > 0 and float(few[2]) > 0, text
    assert re.search(r"drawn ahead, 4 at a time on \d+ threads: [0-9.]+ ms/batch", text), text
    assert re.search(r"the two compiled calls .* [0-9]+ us, owners' liveness checks [0-9]+ us, the rest -?[0-9]+ us",
                     text), text
