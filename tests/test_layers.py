"""Imports point only downwards (docs/architecture.md, "Layers"): a test fails on any upward import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "reactor"
CORE = {"_errors", "_tag", "_reactor", "_graph", "_scheduler", "_trace", "_native", "_files", "_floodlog", "_runclaim", "_hostmemory"}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    head = parts[1]
    if head in ("replay", "transport", "nodes", "algos", "launch"):
        return head
    if head in CORE:
        return "core"
    if head == "cli":
        return "cli"
    return "other:" + head


# What each layer may import from reactor.* (besides itself).
ALLOWED = {
    "core": {"core"},
    "transport": {"core"},
    "replay": {"core"},
    "launch": {"core", "transport", "launch"},
    "algos": {"replay"},  # read-kind descriptions only: no runtime, no transport
    "nodes": {"core", "transport", "replay", "launch", "algos", "api"},
    "cli": {"core", "launch", "transport", "nodes"},
    # The public API re-exports load_policy from nodes/_policy.py, which imports no torch at import time
    # (nodes' own `from .. import algos` counts as "api" here but is the algos layer).
    "api": {"core", "launch", "nodes"},
}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def _imports(module: str, path: Path):
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    for a in node.names:
                        yield f"{target}.{a.name}", node.lineno
                    continue
            else:
                target = node.module or ""
            yield target, node.lineno


@pytest.mark.parametrize("module,path", list(_modules()), ids=lambda x: str(x))
def test_module_imports_only_downwards(module, path):
    me = _layer(module)
    if me.startswith("other:"):
        pytest.fail(f"{module} is in no layer; add it to tests/test_layers.py and docs/architecture.md")
    for target, line in _imports(module, path):
        if not (target == "reactor" or target.startswith("reactor.")):
            continue
        if target == "reactor":
            other = "api"
        else:
            other = _layer(target)
        if other == me:
            continue
        assert other in ALLOWED[me], f"{path.relative_to(ROOT.parent)}:{line} imports {target} ({other}) from layer {me}"


def test_algorithms_import_nothing_of_the_runtime():
    """Algorithms are plain functions over tensors: besides torch and numpy they may use their own
    package's helpers and the replay engine's read-kind descriptions, nothing of the runtime, the
    transport or the nodes."""
    for path in (ROOT / "algos").rglob("*.py"):
        module = "reactor.algos" if path.stem == "__init__" else "reactor.algos." + path.stem
        for target, line in _imports(module, path):
            if target.startswith("reactor"):
                assert target.startswith(("reactor.algos", "reactor.replay")), f"{path}:{line} imports {target}"


def test_launch_modules_import_no_circle():
    """Within reactor/launch/ no module imports (at any depth, lazily or not) one that imports it back."""
    launch = ROOT / "launch"
    edges: dict[str, set[str]] = {}
    for path in launch.glob("*.py"):
        module = "reactor.launch" if path.stem == "__init__" else f"reactor.launch.{path.stem}"
        edges[module] = {t for t, _ in _imports(module, path) if t.startswith("reactor.launch.")}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for t in edges.get(todo.pop(), ()):
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return seen

    circles = sorted(m for m in edges if m in reach(m))
    assert not circles, f"import circles through {circles}"
