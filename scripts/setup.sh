#!/usr/bin/env bash
# Set up .venv with reactor and its dev tools. Idempotent: safe to run before every command.
# On a machine without an NVIDIA GPU, torch comes from the pinned CPU build (torch==2.13.0);
# nothing here pulls a CUDA build there. Says what it does, one line a step, on stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "setup: $*" >&2; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
VENV=.venv
. scripts/_pip.sh
stamp=.venv/.reactor-setup-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  start=$SECONDS
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    say "installing torch 2.13.0, the CPU build (no NVIDIA GPU here; the first time takes a few minutes)"
    pip install "torch==2.13.0"
  fi
  say "installing reactor (editable) with its dependencies and dev tools (pyproject.toml [dev])"
  pip install -e ".[dev]"
  say "checking that reactor, torch, zmq, msgpack, uvloop and numba import"
  .venv/bin/python -c "import reactor, reactor.replay, torch, zmq, msgpack, uvloop, numba" || { echo "setup failed: reactor does not import" >&2; exit 1; }
  rm -f .venv/.reactor-setup-*
  touch "$stamp"
  say "ready in $((SECONDS - start)) s"
else
  say ".venv is up to date (pyproject.toml unchanged since the last setup)"
fi
# numba compiles a kernel at its first call in a process and caches it on disk: compiled here once
# (seconds the first time, under one after), a run's processes load them instead of each compiling
# them at its start or at its first sample.
say "compiling the replay kernels (numba's cache)"
.venv/bin/python -m reactor.nodes._warm >&2
