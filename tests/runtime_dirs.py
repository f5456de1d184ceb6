"""Short runtime directories for tests whose runs start in subprocesses (``REACTOR_RUNTIME_DIR``).

ipc socket paths are limited to 107 bytes and pytest's ``tmp_path`` is long, so a run's runtime
directory is made under /tmp, one per key path (a test's ``tmp_path``, or a folder in it), and
removed after the test by the autouse fixture in tests/conftest.py (``remove_made``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MADE: list[str] = []  # made during the running test


def runtime_dir(key: Path) -> Path:
    """The runtime directory of ``key`` (made on the first call, the same one after)."""
    link = key / "rt"
    if not link.exists():
        key.mkdir(parents=True, exist_ok=True)
        made = tempfile.mkdtemp(prefix="rxt-", dir="/tmp")
        _MADE.append(made)
        link.write_text(made)
    return Path(link.read_text())


def run_env(key: Path) -> dict[str, str]:
    """The environment of a ``reactor`` subprocess with the runtime directory of ``key``."""
    return {**os.environ, "REACTOR_RUNTIME_DIR": str(runtime_dir(key)), "PYTHONPATH": str(ROOT)}


def remove_made() -> None:
    """Remove every runtime directory made since the last call."""
    while _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)
