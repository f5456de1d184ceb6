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
VENV=$V
. scripts/_pip.sh
pip install "torch==2.14.1" "torchrl==0.14.1" "cpprb>=11"
pip install numpy numba pyzmq msgpack uvloop gymnasium rich matplotlib tensorboard
pip install --no-deps -e .
"$V/bin/python" -c "import torchrl._torchrl, reactor.replay, cpprb, torch; print('torchrl peer ready: torch', torch.__version__)"
