"""The app file of a graph made by a ``graph_builder`` (``reactor.run(graph, placement=...)`` with no app).

Each worker loads this file like any app, and ``build`` calls the recorded builder with the recorded
arguments (``config = {"builder": "module:qualname", "arguments": {...}, "path": [...]}``, plain data
that crossed as such), so every process holds the same graph the caller built. ``path``: the directory of
the caller's script (``python path/to/sweep.py`` from elsewhere), put on ``sys.path`` as an app file's
is, so a custom algorithm's or env's module beside the script imports in every worker.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


def build(config: dict[str, Any]) -> Any:
    from reactor.launch._app import SCRIPT_DIRS  # (this file loads as an app file: not a package module)

    for where in config.get("path", ()):  # the caller's script directory: modules beside it import here too
        if where not in sys.path:
            sys.path.append(where)
        if where not in SCRIPT_DIRS:
            SCRIPT_DIRS.append(where)
    module, _, qualname = str(config["builder"]).partition(":")
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn(**config["arguments"])
