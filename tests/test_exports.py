"""reactor/__init__.py is the public API: each public name is exported exactly once (trio)."""

from __future__ import annotations

import ast
from pathlib import Path

import reactor

INIT = Path(reactor.__file__)


def test_every_public_name_is_exported_exactly_once():
    tree = ast.parse(INIT.read_text())
    names = [a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names]
    dupes = {n for n in names if names.count(n) > 1}
    assert not dupes, f"exported more than once: {sorted(dupes)}"
    for n in names:
        assert getattr(reactor, n) is not None


def test_exports_are_explicit_reexports_of_private_modules():
    tree = ast.parse(INIT.read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            private = node.module.rsplit(".", 1)[-1].startswith("_")  # reactor._graph, reactor.launch._runtime
            assert node.level == 1 and private, f"line {node.lineno}: re-export from a private module"
            for a in node.names:
                assert a.asname == a.name, f"line {node.lineno}: use `from .{node.module} import {a.name} as {a.name}`"
