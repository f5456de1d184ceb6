#!/usr/bin/env bash
# Set up .venv-torchrl: reactor beside TorchRL, for the replay benchmarks' TorchRL figures.
#
# TorchRL's wheels carry a compiled part built against one torch release; torchrl 0.14.1's does not
# load against the torch==2.13.0 the main .venv uses (undefined symbols), and without it TorchRL's
# prioritized samplers refuse to run. So the peer gets its own venv with torch 2.14.1, where it
# loads, and reactor is installed there without its dependency pins (reactor runs on 2.14.1 too).
# torch 2.14.1 for Linux x86_64 is a CUDA build of ~5.5 GB in the venv (it runs on the CPU); on the
# workplace machines pip takes it from the local disk, elsewhere it is downloaded.
#
# Then: .venv-torchrl/bin/python benchmarks/bench_replay.py
#       .venv-torchrl/bin/python benchmarks/bench_replay_windows.py
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
V=.venv-torchrl
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
# pip, its output shown but for one harmless warning; a failed pip (no network, no such version) ends the
# setup there, naming what failed (it went on to the next install, then ended in an import traceback).
pip() {
  local out rc=0
  out=$("$V/bin/python" -m pip --disable-pip-version-check -q "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -e "^WARNING: Location" -e "^$" >&2 || true
  if [ "$rc" -ne 0 ]; then
    echo "setup failed: pip $* exited with status $rc (its output above says why); fix that and run $0 again" >&2
    exit "$rc"
  fi
}
pip install "torch==2.14.1" "torchrl==0.14.1" "cpprb>=11"
pip install numpy numba pyzmq msgpack uvloop gymnasium rich matplotlib tensorboard
pip install --no-deps -e .
"$V/bin/python" -c "import torchrl._torchrl, reactor.replay, cpprb, torch; print('torchrl peer ready: torch', torch.__version__)"
