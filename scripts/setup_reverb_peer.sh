#!/usr/bin/env bash
# Set up .venv-reverb: DeepMind Reverb, for bench_replay_service.py's Reverb figures.
#
# Reverb's last release (dm-reverb 0.14.0, Python 3.9-3.11) is built against TensorFlow 2.15 (its
# [tensorflow] extra asks for tensorflow~=2.15.0) and so needs numpy < 2; reactor's .venv has
# neither. So the peer gets its own venv, without reactor: benchmarks/peers/reverb_peer.py runs
# there alone (no reactor import) and bench_replay_service.py starts it in a subprocess.
# tensorflow-cpu 2.15.1 stands in for the extra's tensorflow (the same build without the CUDA
# hooks, ~200 MB less); Reverb's own check at import accepts it.
#
# Then: .venv-reverb/bin/python benchmarks/peers/reverb_peer.py --quick
#       .venv/bin/python benchmarks/bench_replay_service.py --quick   (prints the Reverb rows)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
V=.venv-reverb
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
VENV=$V
. scripts/_pip.sh
pip install "dm-reverb==0.14.0" "tensorflow-cpu==2.15.1" "numpy==1.26.4" "dm-tree==0.1.8" "portpicker==1.6.0"
TF_CPP_MIN_LOG_LEVEL=2 "$V/bin/python" -c "import importlib.metadata as m, reverb, tensorflow, numpy; print('reverb peer ready: dm-reverb', m.version('dm-reverb'), 'tensorflow', tensorflow.__version__, 'numpy', numpy.__version__)"
