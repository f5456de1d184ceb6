"""The app file of a graph made by a ``graph_builder`` (``reactor.run(graph, placement=...)`` with no app).

Each worker loads this file like any app, and ``build`` calls the recorded builder with the recorded
arguments (``config = {"builder": "module:qualname", "arguments": {...}}``, plain data that crossed
as such), so every process holds the same graph the caller built.
"""

from __future__ import annotations

import importlib
from typing import Any


def build(config: dict[str, Any]) -> Any:
    module, _, qualname = str(config["builder"]).partition(":")
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    return fn(**config["arguments"])
