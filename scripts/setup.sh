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
# pip, its output shown but for one harmless warning; a failed pip (no network, a full disk) ends the
# setup there, naming what failed, before the stamp below would mark the venv as set up.
pip() {
  local out rc=0
  out=$(.venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1) || rc=$?
  printf '%s\n' "$out" | grep -v -e "^WARNING: Location" -e "^$" >&2 || true
  if [ "$rc" -ne 0 ]; then
    echo "setup failed: pip $* exited with status $rc (its output above says why); fix that and run scripts/setup.sh again" >&2
    exit "$rc"
  fi
}
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
