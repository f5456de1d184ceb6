#!/usr/bin/env bash
# The GPU checks of issue 18 in one run on a CUDA machine (what docs/benchmarks.md's "GPU" section
# reports): the CUDA tests, then benchmarks/bench_gpu.py. Logs go to $OUT (default /tmp/gpu-check).
#
# On a machine without package access, Python packages missing there can come as wheels in .whl/
# (pyzmq, gymnasium, pytest-asyncio, ...; TorchRL builds in .whl/trl*/, one per torch release: the
# first whose compiled part loads is used for the TorchRL peer).
# The H200 image (Python 3.12, torch 2.11) lacks pyzmq, gymnasium (+ farama-notifications) and
# pytest-asyncio; carry pytest-asyncio >= 1.5 with pytest >= 8.4 (tests/conftest.py uses its
# pytest_asyncio_loop_factories hook, which 1.3 does not know: the session ends before any test).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi -L
  "$PY" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.log"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
for d in .whl/trl*/; do
  [ -d "$d" ] || continue
  t=/tmp/site-$(basename "$d")
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$t" "$d"*.whl >/dev/null 2>&1
  if PYTHONPATH=$t:$PYTHONPATH "$PY" -c "import torchrl._torchrl, torchrl.data" >/dev/null 2>&1; then
    export PYTHONPATH=$t:$PYTHONPATH
    echo "TorchRL peer: $("$PY" -c 'import torchrl; print(torchrl.__version__)' 2>/dev/null) from $d" | tee -a "$OUT/env.log"
    break
  fi
  echo "TorchRL from $d does not load against this torch" | tee -a "$OUT/env.log"
done
{
  echo "--- soft-RoCE probe (rdma_rxe)"
  uname -r
  modprobe rdma_rxe 2>&1 && echo "rdma_rxe loaded" || echo "modprobe rdma_rxe failed"
  command -v rdma >/dev/null && rdma link 2>&1 | head -5 || echo "no rdma tool"
  ls /sys/class/infiniband 2>&1 | head -5
  ls /lib/modules/"$(uname -r)" 2>&1 | head -3
  (ls /sys/module 2>/dev/null | grep -i -E "rdma|rxe|^ib_" | head -5) || echo "no rdma/ib modules loaded"
  "$PY" -c "import pyverbs" 2>&1 | tail -1 || true
} 2>&1 | tee -a "$OUT/env.log"

if [ "${TEST_S:-270}" != 0 ]; then  # TEST_S=0: no tests this time
echo "--- CUDA tests"
timeout "${TEST_S:-270}" "$PY" -m pytest -q -p no:cacheprovider -n 0 -W default --timeout 250 \
  tests/gpu tests/replay/test_device_replay.py tests/nodes/test_device.py \
  "tests/nodes/test_replay.py" "tests/replay/test_storage.py" -k "gpu or cuda or pinned or memory or device or Device or test_cuda" \
  -s 2>&1 | tee "$OUT/pytest.log" | grep -E "passed|failed|error|Error|compile auto|FAILED|SKIPPED|offline app" | tail -40
fi
echo "--- bench_gpu: ${BENCH1_PARTS:=replay,torchrl,replies,transformer}"
timeout "${BENCH1_S:-110}" "$PY" benchmarks/bench_gpu.py --parts "$BENCH1_PARTS" 2>&1 | tee "$OUT/bench.log" \
  | grep -v "^W[0-9]"
if [ "${BENCH2_S:-150}" != 0 ]; then  # BENCH2_S=0: no learner figures this time
  echo "--- bench_gpu: learners"
  timeout "${BENCH2_S:-150}" "$PY" benchmarks/bench_gpu.py --parts learners 2>&1 | tee -a "$OUT/bench.log" | grep -v "^W[0-9]"
fi
if [ "${OFFLINE_S:-0}" != 0 ]; then  # the offline app with the 57M model: a source run on the CPU, then
  # the app on the GPU without compile (its updates/s from metrics.csv, past the first 100 updates)
  echo "--- offline app, size=large, compile=off"
  rm -rf /tmp/src-gpu /tmp/off-gpu
  timeout "$OFFLINE_S" bash -c "\"$PY\" -m reactor.cli run apps/transformer_dqn.py --set max_env_steps=2000 \
      --set target_return=None --set live=False --set run_dir=/tmp/src-gpu > \"$OUT/offline-source.log\" 2>&1 &&
    \"$PY\" ${OFFLINE_PROFILE:+-m cProfile -o $OUT/offline.prof} -m reactor.cli run apps/transformer_offline.py --set source=/tmp/src-gpu --set size=large \
      --set device=cuda --set compile=off --set updates=400 --set eval_every_updates=400 --set eval_episodes=1 \
      --set live=False --set run_dir=/tmp/off-gpu > \"$OUT/offline.log\" 2>&1"
  echo "rc=$?"; grep -E "^learner:|evaluation return|run ended" "$OUT/offline.log" | head -5
  "$PY" - <<'EOF2'
import csv
rows = [(float(r["wall_s"]), float(r["value"])) for r in csv.DictReader(open("/tmp/off-gpu/metrics.csv"))
        if r["source"] == "learner" and r["name"] == "updates"]
(t0, u0), (t1, u1) = next(x for x in rows if x[1] >= 100), rows[-1]
rate = (u1 - u0) / (t1 - t0)
print(f"offline app on the GPU: updates {u0:.0f}->{u1:.0f} in {t1 - t0:.2f} s: {rate:.1f} updates/s, "
      f"{rate * 32 * 64:.0f} tokens/s (32 windows x 64 steps an update), {1e3 / rate:.1f} ms an update")
EOF2
  if [ -n "${OFFLINE_PROFILE:-}" ]; then  # where the app's time goes (cProfile of its one process)
    "$PY" -c "import pstats; s = pstats.Stats('$OUT/offline.prof'); s.sort_stats('tottime').print_stats(25); s.sort_stats('cumtime').print_stats(30)" 2>&1 | grep -v "^$" | cut -c1-160 | head -80
  fi
fi
echo "--- done"
