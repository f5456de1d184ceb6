#!/usr/bin/env bash
# Set up .venv with reactor and its dev tools. Idempotent: safe to run before every command.
# On a machine without an NVIDIA GPU, torch comes from the pinned CPU build (torch==2.13.0);
# nothing here pulls a CUDA build there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
stamp=.venv/.reactor-setup-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    pip install "torch==2.13.0"
  fi
  pip install -e ".[dev]"
  .venv/bin/python -c "import reactor, torch, zmq, msgpack, uvloop" || { echo "setup failed: reactor does not import" >&2; exit 1; }
  rm -f .venv/.reactor-setup-*
  touch "$stamp"
fi
