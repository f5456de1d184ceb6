"""What a host runs: reactor's version and a digest of its code, compared before a run uses a host.

The hosts of one run exchange messages whose schemas are this package's code: a daemon running another
reactor (an older install, a checkout edited on one host) would answer with frames the other side drops
as malformed, and the run would stall or fail far from the cause. A daemon says its ``build_id`` in its
``ping``; a coordinator refuses a host whose id differs from its own, naming both.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import platform
from pathlib import Path

__all__ = ["build_id", "python_version"]

_PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def build_id() -> str:
    """``"<version>+<12 hex digits>"``: the package's version and a digest of every ``.py`` file in it
    (names and contents), so two installs of the same code agree wherever they live, and any edit differs."""
    try:  # (the installed distribution's; launch may not import the package's top)
        version = importlib.metadata.version("reactor")
    except importlib.metadata.PackageNotFoundError:  # (its source on PYTHONPATH, not installed)
        version = "0+uninstalled"
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        rel = path.relative_to(_PACKAGE).as_posix()
        if "__pycache__" in rel:
            continue
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{version}+{digest.hexdigest()[:12]}"


def python_version() -> str:
    return platform.python_version()
