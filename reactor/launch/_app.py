"""Loading app files: a Python file that defines ``build(config) -> Graph``.

An app may define a frozen dataclass ``Config``; ``--set key=value`` overrides are then checked
against its fields and converted to their types. Without one, ``build`` receives a plain dict.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from .._errors import ReactorError
from .._graph import Graph


class AppError(ReactorError):
    """The app file or its configuration is wrong (a one-line message for the command line)."""


def load_app(path: str | Path) -> ModuleType:
    """Import an app file by path.

    Raises:
        AppError: no such file, or it does not define ``build``.
    """
    p = Path(path)
    if not p.is_file():
        raise AppError(f"no app file at {str(path)!r}")
    name = "reactor_app_" + hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise AppError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        del sys.modules[name]
        raise
    if not callable(getattr(module, "build", None)):
        raise AppError(f"{path} defines no build(config) function; an app file must define build(config) -> Graph")
    return module


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["lr=0.1", "name=x"]`` -> ``{"lr": 0.1, "name": "x"}`` (Python literals, else strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise AppError(f"--set expects key=value, got {item!r}")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        out[key.strip()] = value
    return out


def make_config(module: ModuleType, overrides: Mapping[str, Any]) -> Any:
    """The config object handed to ``build``: the app's ``Config`` with overrides, or a dict."""
    cls = getattr(module, "Config", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return dict(overrides)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in overrides.items():
        if key not in fields:
            raise AppError(f"unknown config key {key!r}; {cls.__name__} has: {', '.join(sorted(fields))}")
        want = hints.get(key)
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(want, type) and not isinstance(value, want):
            raise AppError(f"config key {key!r} expects {want.__name__}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def build_graph(path: str | Path, overrides: Mapping[str, Any]) -> Graph:
    """Load the app at ``path`` and build its graph with ``overrides`` applied."""
    module = load_app(path)
    graph = module.build(make_config(module, overrides))
    if not isinstance(graph, Graph):
        raise AppError(f"{path}: build(config) returned {type(graph).__name__}, not a Graph")
    return graph
