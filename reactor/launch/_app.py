"""Loading app files: a Python file that defines ``build(config) -> Graph``.

An app may define a frozen dataclass ``Config``; ``--set key=value`` overrides are then checked
against its fields and converted to their types. Without one, ``build`` receives a plain dict.
Two more module attributes, both optional, serve training apps:

- ``ALGO``: the algorithm; a ``--set`` key that is not a field of ``Config`` but one of the
  algorithm's Config (``lr=3e-4``) goes into the app's ``algo_config`` (over what it says there).
  ``Config.algorithm_fields(ALGO)`` names those fields (the standard apps' configs define it:
  ``reactor.nodes.apps``; this layer imports no algorithm).
- ``PRESETS``: ``{env_id: {key: value}}``; the entry of the chosen ``env`` (``--set env=...``, else
  ``Config``'s default) goes under the ``--set`` values (RL-Zoo's tuned settings per env).

The app file's directory is put on ``sys.path`` of every process that loads it (as ``python
app.py`` does), so modules beside it (a custom env's) import under every placement.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import hashlib
import importlib.util
import inspect
import os
import re
import reprlib
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from .._errors import AppError as AppError
from .._graph import Graph, plain_scalars
from ._protocol import FILES_MAX, FILES_MAX_NBYTES, is_plain, nonfinite_at

#: The directories of the app files this process loaded (on sys.path): the learner records them in
#: config.json, so ``load_policy`` can import a custom env's or algorithm's module from beside the app.
APP_DIRS: list[str] = []
#: The directories of a Python-API caller's script (``_builder_app``), on a worker's path: recorded with
#: APP_DIRS for ``load_policy``; not searched for a module shadowing a shipped algorithm (the caller's
#: own process does not search its script's directory either: both must decide alike).
SCRIPT_DIRS: list[str] = []


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
    where = str(p.resolve().parent)
    if where != str(Path(__file__).resolve().parent):  # not reactor/launch/ (the builder app's home)
        if where not in sys.path:
            sys.path.append(where)  # after the installed packages: a file beside the app never shadows one
        if where not in APP_DIRS:
            APP_DIRS.append(where)
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise AppError(f"cannot import {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        # What the loader's exec_module does, less the pyc: compiled under the module's own file name (its
        # spec's absolute path: tracebacks, inspect.getsource and graph errors name it wherever the process
        # is) and with none of this module's __future__ flags (`annotations` made every annotation of the
        # app a string: a dataclass field's type 'int', not int).
        exec(_compiled(p.read_bytes(), path, spec.origin), module.__dict__)
    except Exception:
        del sys.modules[name]
        raise
    if not callable(getattr(module, "build", None)):
        raise AppError(f"{path} defines no build(config) function; an app file must define build(config) -> Graph")
    return module


def _refuse_nul(source: bytes, path: str | Path) -> None:
    """Python's compile of source with a NUL byte names no file: the CLI showed its traceback, naming
    nothing of the app (a binary file given as one, say)."""
    if b"\0" in source:
        raise AppError(f"{path} is not Python source: it holds a NUL byte (a binary file?)")


def compile_app(path: str | Path) -> None:
    """Check that the app file at ``path`` compiles, without importing it (``reactor submit``, ``slurm``,
    ``k8s render``: its modules may be the cluster's only).

    Raises:
        AppError: it holds a NUL byte. SyntaxError: its own, naming its line.
    """
    _compiled(Path(path).read_bytes(), path)


def _compiled(source: bytes, path: str | Path, filename: str | None = None) -> Any:
    """``source`` compiled, as the import system compiles a module: ``dont_inherit``, so that the app gets
    no ``__future__`` flag of this module's (``annotations``), under ``filename`` (default ``path``). Python's
    parser fails on nesting too deep for it with a bare ``MemoryError`` or ``RecursionError`` naming no
    file: the CLI showed its traceback.

    Raises:
        AppError: a NUL byte, or nesting too deep. SyntaxError: its own, naming its line.
    """
    _refuse_nul(source, path)
    try:
        return compile(source, str(path) if filename is None else filename, "exec", dont_inherit=True)
    except (MemoryError, RecursionError) as e:
        raise AppError(f"{path} does not compile: it nests deeper than Python's parser takes "
                       f"({type(e).__name__})") from None


def shipped_files(entries: Sequence[tuple[str, str | os.PathLike[str], str | None]],
                  bounded: bool = True) -> dict[str, Path]:
    """The files a run over hosts or a submitted job ships, by the name each takes beside the app there.
    ``entries``: ``(what, path, name)``, the app first, then ``--with`` files, a placement or hosts file, a
    trace, key files; ``name`` None for the path's base name (a key file goes at the relative path its
    hosts file names, ``keys/h2.pub``). There, the app is loaded and every other file found by that name.
    The same file named twice goes once. With ``bounded`` (they go: a submit, a run over hosts), more than a
    job carries (``FILES_MAX`` files, ``FILES_MAX_NBYTES`` bytes) is refused too; a run on one host ships
    nothing, and its ``--with`` files may be as large as it likes.

    Raises:
        AppError: two different files would take one name (one would replace the other there: a
            ``--with ppo.py`` from the working directory ran in place of the app ``apps/ppo.py``), naming
            both and what each is.
    """
    out: dict[str, Path] = {}
    said: dict[str, str] = {}
    for what, path, name in entries:
        p = Path(path)
        name = name if name is not None else p.name
        have = out.get(name)
        if have is None:
            out[name], said[name] = p, what
        elif have.resolve() != p.resolve():
            instead = f"; the app is loaded by that name there, so {str(p)!r} would run in its place" \
                if said[name] == "the app" else ""
            raise AppError(f"{said[name]} {str(have)!r} and {what} {str(p)!r} would both go as {name!r} beside the "
                           f"app on the other hosts, where files are found by name{instead}: rename one of them")
    # (Past the daemon's bounds, the daemon refused them: a submit said "bad request: 'submit' field 1: files:
    # 41945872 bytes in all, more than 33554432", exit 1, after sending them; a run over hosts, at its spawns.)
    if not bounded:
        return out
    if len(out) > FILES_MAX:
        raise AppError(f"{len(out)} files would be shipped (the app, --with, placement, hosts, key and trace files), more "
                       f"than the {FILES_MAX} a job carries: ship fewer (an archive the app unpacks, say)")
    sizes = {}
    for name, p in out.items():
        with contextlib.suppress(OSError):  # (a missing one is said where it is read)
            sizes[name] = p.stat().st_size
    if sum(sizes.values()) > FILES_MAX_NBYTES:
        largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:2]
        raise AppError(f"the files that would be shipped come to {sum(sizes.values()) / 2**20:.1f} MiB, more "
                       f"than the {FILES_MAX_NBYTES // 2**20} MiB a job carries (largest: "
                       f"{', '.join(f'{str(out[n])!r} {sizes[n] / 2**20:.1f} MiB' for n in largest)}): put large data "
                       f"where every host reads it (a shared file system), and its path in the config")
    return out


def check_imports_shipped(app: str | os.PathLike[str], with_files: Sequence[str | os.PathLike[str]] = (),
                          what: str = "a submitted job", overrides: Mapping[str, Any] | None = None) -> str | None:
    """Refuse an app that imports a module from its own folder that would not go with it: a job or a run over
    hosts ships the app and its ``--with`` files, not the app's folder, so its workers there failed with
    ``No module named 'X'`` (``reactor submit`` took the job; it failed in its daemon's log). Read, not run:
    the imports of the app file, of its ``--with`` modules and of the modules found missing (one submit names
    them all), by ``ast``. A module counts as missing when its name is a ``.py`` file or a package folder
    beside the file that imports it (or beside the app, where every shipped file goes), no ``--with`` file
    (nor the app) goes under that name, and it is not found here elsewhere than in those folders (an
    installed package, the standard library: the same there). An app that is a symbolic link has two
    folders: the link's, and its file's, which is the one on ``sys.path`` where it runs here. Left aside:
    relative imports (the app is not loaded as a package: they fail alike here), imports under ``try`` that
    catch ``ImportError`` or ``with contextlib.suppress(ImportError)``, under ``if TYPE_CHECKING`` or ``if
    __name__ == "__main__"`` (they never run in a worker), and a file that does not parse (its syntax error
    is said where it compiles). Besides the import statements, the env module that ``overrides`` (the
    ``--set`` values) name: ``--set env=my_envs:MyChain-v0`` has gymnasium import ``my_envs`` in every process
    that makes the env (guide, section 3), with no import statement in the app (a copy of ``apps/dqn.py``),
    so that job was taken and failed in its daemon's log. (An ``env`` the app's ``Config`` names by default
    is not read here: that needs the app imported.)

    Returns:
        What to say of packages in the app's folder that it imports and that are not installed here (None:
        none): ``--with`` cannot ship them, and where the job runs they may be installed, so they are said,
        not refused.

    Raises:
        AppError: a module would be missing, naming each, the line importing it, and the ``--with`` to add.
    """
    app = Path(app)
    homes = [app.parent]  # the app's folder, and (an app that is a link) its file's, which load_app puts on sys.path
    with contextlib.suppress(OSError, RuntimeError):
        if app.resolve().parent.resolve() != app.parent.resolve():
            homes.append(app.resolve().parent)
    shipped = {app.stem} | {Path(f).stem for f in with_files if Path(f).suffix == ".py"}
    todo = [app, *(Path(f) for f in with_files if Path(f).suffix == ".py")]
    seen: set[Path] = set()
    missing: dict[str, tuple[Path, bool, str]] = {}  # name: (its path, a package, where it is imported)
    for name, where in env_modules(overrides or {}):
        beside = next(((p, p.is_dir()) for folder in homes for p in (folder / name, folder / f"{name}.py")
                       if _module_file(p)), None)
        if name in shipped or beside is None or _found_elsewhere(name, homes):
            continue
        missing[name] = (beside[0], beside[1], f"imported by gymnasium for {where}")
        if not beside[1]:
            todo.append(beside[0])
    while todo:
        source = todo.pop(0)
        with contextlib.suppress(OSError, RuntimeError):
            if source.resolve() in seen:
                continue
            seen.add(source.resolve())
        try:
            tree = ast.parse(source.read_bytes(), str(source))
        except (OSError, SyntaxError, ValueError, MemoryError, RecursionError):  # (too deep a nesting: the last two)
            continue
        folders = homes + ([source.parent] if source.parent not in homes else [])
        for name, line in _imports_run(tree):
            if name in shipped or name in missing:
                continue
            beside = next(((p, p.is_dir()) for folder in folders for p in (folder / name, folder / f"{name}.py")
                           if _module_file(p)), None)
            if beside is None or _found_elsewhere(name, folders):
                continue
            missing[name] = (beside[0], beside[1], f"imported at {source} line {line}")
            if not beside[1]:
                todo.append(beside[0])
    said = {name: f"{name} ({'the package ' if package else ''}{str(path)}{'/' if package else ''}, {where})"
            for name, (path, package, where) in missing.items()}
    packages = [name for name, (_, package, _) in missing.items() if package]
    one = len(packages) == 1
    note = (f"{'; '.join(said[n] for n in packages)} {'is a package' if one else 'are packages'} of the app's folder, "
            f"which --with cannot ship (it ships single files): its workers fail to import "
            f"{'it' if one else 'them'} unless {'it is' if one else 'they are'} installed where the job runs") \
        if packages else None
    modules = {name: path for name, (path, package, _) in missing.items() if not package}
    if not modules:
        return note
    raise AppError(f"{what} carries the app and its --with files, not the app's folder: its workers would fail with "
                   f"ModuleNotFoundError on {'this module' if len(modules) == 1 else 'these modules'} from there: "
                   f"{'; '.join(said[n] for n in modules)}. Add {' '.join(f'--with {p}' for p in modules.values())}"
                   f"{f'. Also, {note}' if note else ''}")


def env_modules(overrides: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The module a ``--set env=MODULE:ID`` names (gymnasium's spelling of an env whose registering module it
    imports first, in every process that makes the env), as ``(top-level name, "--set env=...")``; none for
    an env id without a module, or a value that is not one."""
    env = overrides.get("env")
    if not isinstance(env, str) or ":" not in env:
        return []
    module = env.partition(":")[0].strip()
    if not module or not all(part.isidentifier() for part in module.split(".")):
        return []
    return [(module.partition(".")[0], f"--set env={env}")]


def _module_file(p: Path) -> bool:
    """Whether ``p`` is what an import finds in its folder: a ``.py`` file, or a package folder (an
    ``__init__.py``, or ``.py`` files of a namespace package)."""
    try:
        if p.suffix == ".py":
            return p.is_file()
        return p.is_dir() and ((p / "__init__.py").is_file() or any(p.glob("*.py")))
    except OSError:
        return False


def _imports_run(tree: ast.AST) -> list[tuple[str, int]]:
    """The top-level names a module's absolute imports bring in, with their lines, but those that never run
    in a worker, or whose absence the code expects (see :func:`check_imports_shipped`)."""
    caught = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}

    def named(k: ast.expr | None, names: set[str]) -> bool:
        return (isinstance(k, ast.Name) and k.id in names) or (isinstance(k, ast.Attribute) and k.attr in names)

    def catches(handler: ast.ExceptHandler) -> bool:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        return any(k is None or named(k, caught) for k in kinds)

    def suppresses(item: ast.withitem) -> bool:
        """``with contextlib.suppress(ImportError):``, the try/except's other spelling."""
        call = item.context_expr
        return (isinstance(call, ast.Call) and named(call.func, {"suppress"})
                and any(named(a, caught) for a in call.args))

    def never_runs(test: ast.expr) -> bool:
        if isinstance(test, (ast.Name, ast.Attribute)):  # (if TYPE_CHECKING:, if typing.TYPE_CHECKING:)
            return (test.id if isinstance(test, ast.Name) else test.attr) == "TYPE_CHECKING"
        if not (isinstance(test, ast.Compare) and len(test.comparators) == 1 and isinstance(test.ops[0], ast.Eq)):
            return False
        sides = {test.left, test.comparators[0]}  # (either way round: "__main__" == __name__ too)
        # (a worker loads it under another name)
        return (any(isinstance(e, ast.Name) and e.id == "__name__" for e in sides)
                and any(isinstance(e, ast.Constant) and e.value == "__main__" for e in sides))

    out: list[tuple[str, int]] = []
    todo: list[ast.AST] = [tree]  # (a stack, not recursion: a file may nest deeper than Python's recursion limit)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Try, ast.TryStar)):
            body = [] if any(catches(h) for h in node.handlers) else node.body
            todo.extend(reversed([*body, *node.handlers, *node.orelse, *node.finalbody]))
            continue
        if isinstance(node, ast.If) and never_runs(node.test):
            todo.extend(reversed(node.orelse))
            continue
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(suppresses(i) for i in node.items):
            continue  # (its imports may fail: the code expects it)
        if isinstance(node, ast.Import):
            out.extend((a.name.partition(".")[0], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.partition(".")[0], node.lineno))
        todo.extend(reversed(list(ast.iter_child_nodes(node))))
    return out


def _found_elsewhere(name: str, folders: Sequence[Path]) -> bool:
    """Whether ``import name`` finds a module here other than through ``folders`` (the standard library, an
    installed package, an editable install's finder), which the job's host is taken to have alike; True when
    unsure (a finder that fails), so that a check never refuses what may import."""
    import importlib.machinery

    if name in sys.builtin_module_names or name in sys.stdlib_module_names or name == "reactor":
        return True  # (reactor: every daemon runs it; a checkout beside the app is not the app's module)
    mine = set()
    for folder in folders:
        with contextlib.suppress(OSError, RuntimeError):
            mine.add(folder.resolve())

    def in_mine(entry: str) -> bool:
        try:
            return Path(entry or ".").resolve() in mine
        except (OSError, RuntimeError):
            return False

    loaded = sys.modules.get(name)
    if loaded is not None:  # (imported already: where from)
        spec = getattr(loaded, "__spec__", None)
        if spec is None or not spec.has_location or not spec.origin:
            return True
        return not any(p in mine for p in Path(spec.origin).resolve().parents)
    path = [p for p in sys.path if isinstance(p, str) and not in_mine(p)]
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(name, path) if finder is importlib.machinery.PathFinder else find(name, None)
        except Exception:  # noqa: BLE001 - a finder of some package's that fails: unsure, not refused
            return True
        if spec is not None:
            return True
    return False


def files_to_ship(app: str | os.PathLike[str], with_files: Sequence[str | os.PathLike[str]] = (),
                  trace: str | os.PathLike[str] | None = None) -> list[tuple[str, str | os.PathLike[str], str | None]]:
    """:func:`shipped_files`' entries for a run over hosts: the app, its ``--with`` files, a trace to replay."""
    return [("the app", app, None), *(("--with file", f, None) for f in with_files),
            *([("the trace to replay", trace, None)] if trace is not None else [])]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["lr=0.1", "name=x"]`` -> ``{"lr": 0.1, "name": "x"}`` (Python literals, else strings).

    ``nan`` and ``inf`` (any case, signed) are the floats they spell, as ``1e999`` is: ``make_config``
    then refuses them as not finite (``lr=nan`` was the string 'nan', refused as "expects float, got
    'nan'" while ``lr=1e999`` was "must be finite"). A string that spells a number is quoted:
    ``title="'inf'"``, as ``title="'12'"``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise AppError(f"--set expects key=value, got {item!r}")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            # (the spellings only: float() of 5,000 digits, which literal_eval refuses, is inf too)
            value = float(raw) if re.fullmatch(r"\s*[+-]?(nan|inf|infinity)\s*", raw, re.IGNORECASE) else raw
        out[key.strip()] = value
    return out


def blamed_setting(e: BaseException, message: str, app: str | os.PathLike[str] | None,
                   items: Sequence[str]) -> str | None:
    """The ``--set`` item (of ``items``, as given: ``["producers=0"]``; cut to ~80 characters) that a
    refusal of the app's graph comes from, for its message to name: ``replicas must be an int >= 1, got 0
    (apps/demo.py:83)`` named the app line alone, and the user had to find which ``--set`` fed it. An
    item is the one when the refusal is at an app line (cited in ``message``, or where ``e``'s traceback
    last passed through the app), shows its value (beside the app lines it cites) and does not name its
    key already (nor any other given item's key: that one is told), and that line reads its key (``config.KEY``, ``config["KEY"]``) or reads none of the
    items' keys (``build(config)`` handing the whole config to a graph builder); and when it is the only
    such item (two of one value, say, are not told apart: None). None too when ``e`` is at no app line.
    """
    if app is None or not items:
        return None
    try:
        path = Path(app).resolve()
        source = path.read_text()
    except (OSError, RuntimeError, UnicodeDecodeError):
        return None
    lines = set()
    for where, line in re.findall(r"([^\s(),]+\.py):(\d+)", message):
        with contextlib.suppress(OSError, RuntimeError):
            if Path(where).resolve() == path:
                lines.add(int(line))
    tb = e.__traceback__
    at = None
    while tb is not None:
        with contextlib.suppress(OSError, RuntimeError):
            if Path(tb.tb_frame.f_code.co_filename).resolve() == path:
                at = tb.tb_lineno
        tb = tb.tb_next
    if at is not None:
        lines.add(at)
    if not lines:
        return None
    shown = re.sub(r"[^\s(),]+\.py:\d+", " ", message)  # (a line number is no value)
    given = {}
    for item in items:
        key, _, _ = item.partition("=")
        given[key.strip()] = item
    values = parse_overrides(list(given.values()))
    if any(re.search(rf"(?<![\w.-]){re.escape(k)}(?![\w.-])", shown) for k in values):
        return None  # (it names a setting given already: "config key 'capacity' is 200 over 2 shard(s)" is not shards=2's)
    named = [k for k, v in values.items() if re.search(rf"(?<![\w.]){re.escape(repr(v))}(?![\w.])", shown)]
    if not named:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        tree = ast.Module(body=[], type_ignores=[])
    reads: set[str] = set()
    for line in lines:
        stmts = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno <= line <= (n.end_lineno or n.lineno)]
        if not stmts:
            continue
        stmt = min(stmts, key=lambda n: (n.end_lineno or n.lineno) - n.lineno)  # (the innermost)
        for n in ast.walk(stmt):
            if isinstance(n, ast.Attribute) and n.attr in given:
                reads.add(n.attr)
            elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in given:
                reads.add(str(n.slice.value))
    if reads:
        named = [k for k in named if k in reads]
    return _brief_item(given[named[0]]) if len(named) == 1 else None


def _brief_item(item: str) -> str:
    """A ``--set`` item as an error shows it: cut to ~80 characters (a value may be 100,000)."""
    return item if len(item) <= 80 else f"{item[:60]}...{item[-16:]}"


#: The options of ``reactor run`` that are not config keys (``--set seed=3`` named neither).
_RUN_OPTIONS = {"seed": "--seed", "placement": "--placement", "hosts": "--hosts", "restart": "--restart"}

#: What a value of the command line spelled in another language means in Python's.
_SPELLINGS = {"true": "True", "false": "False", "none": "None", "null": "None"}


def make_config(module: ModuleType, overrides: Mapping[str, Any]) -> Any:
    """The config object handed to ``build``: the app's ``Config`` with its ``env``'s preset and
    the overrides (algorithm fields routed into ``algo_config``), or a dict.

    Raises:
        AppError: a key that is neither the app's nor the algorithm's (listing both), a value of
            the wrong type, or a NaN or an infinity anywhere in a value (of an app with a ``Config``).
    """
    cls = getattr(module, "Config", None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return dict(overrides)  # (the app's own dict: what it accepts is its business)
    for key, value in overrides.items():
        if (at := nonfinite_at(value)) is not None:
            what = f"is {_brief(value)}" if not at else f"has a NaN or an infinity at {at}"
            raise AppError(f"config key {_brief(key)} {what}; config values must be finite numbers")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    algo_fields = _algo_fields(module, cls)
    env = overrides.get("env", fields["env"].default if "env" in fields else None)
    presets = getattr(module, "PRESETS", None) or {}
    preset = presets.get(env, {}) if isinstance(env, str) else {}
    # The algorithm's keys: the app's own algo_config default, the preset's, then algo_config={...},
    # then the flat ones (lr=...).
    own = fields["algo_config"].default_factory() if "algo_config" in fields and callable(
        fields["algo_config"].default_factory) else {}
    algo: dict[str, Any] = {**own, **{k: v for k, v in preset.items() if k not in fields}}
    given = overrides.get("algo_config", {})
    if not isinstance(given, dict):
        raise AppError(f"config key 'algo_config' expects dict, got {_brief(given)}")
    algo.update(given)
    kwargs: dict[str, Any] = {k: v for k, v in preset.items() if k in fields}
    for key, value in overrides.items():
        if key == "algo_config":
            continue
        if key not in fields:
            if key in algo_fields:
                algo[key] = value
                continue
            if key in _RUN_OPTIONS:
                raise AppError(f"{_brief(key)} is not a config key but an option of reactor run: "
                               f"{_RUN_OPTIONS[key]} {_brief(value)} (from Python, reactor.run(..., {key}=...))")
            theirs = f"; the algorithm {module.ALGO!r} has: {', '.join(sorted(algo_fields))}" if algo_fields else ""
            close = difflib.get_close_matches(key, [*fields, *algo_fields], n=1)  # (`lrr`: lr)
            meant = f" (did you mean {close[0]!r}?)" if close else ""
            raise AppError(f"unknown config key {_brief(key)}{meant}; {cls.__name__} has: {', '.join(sorted(fields))}"
                           f"{theirs}")
        kwargs[key] = value
    if algo != own or "algo_config" in overrides:
        if "algo_config" not in fields:
            raise AppError(f"{cls.__name__} has no algo_config field for the algorithm's keys {sorted(algo)}")
        kwargs["algo_config"] = algo
    for key, value in list(kwargs.items()):
        want = hints.get(key)
        if typing.get_origin(want) is typing.Literal:  # (one of the values it names: size="small" | "large")
            if not any(type(value) is type(a) and value == a for a in typing.get_args(want)):
                raise AppError(f"config key {_brief(key)} must be one of "
                               f"{', '.join(map(repr, typing.get_args(want)))}, got {_brief(value)}")
            continue
        # One type, or a union of types (float | None: target_return='high' got through, and failed the
        # run at its first evaluation with a TypeError traceback).
        union = typing.get_origin(want) in (typing.Union, types.UnionType)
        # (tuple[int, ...] is a tuple: it went unchecked, and a list given for it stayed a list)
        kinds = [tuple if typing.get_origin(a) is tuple else a for a in (typing.get_args(want) if union else (want,))]
        kinds = [a for a in kinds if isinstance(a, type)]
        if float in kinds and int not in kinds and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                raise AppError(f"config key {_brief(key)} expects float, got an int of {value.bit_length()} bits, too large for one") from None
        if tuple in kinds and type(value) is list:  # (as an algorithm's Config takes one: JSON has no tuples)
            value = tuple(value)
        if kinds and len(kinds) == (len(typing.get_args(want)) if union else 1) and not isinstance(value, tuple(kinds)):
            meant = _SPELLINGS.get(value.lower()) if isinstance(value, str) else None
            raise AppError(f"config key {_brief(key)} expects "
                           f"{' or '.join(k.__name__.replace('NoneType', 'None') for k in kinds)}, got {_brief(value)}"
                           + (f" (write {meant}: Python's spelling)" if meant else ""))
        kwargs[key] = value
    return cls(**kwargs)


_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80


def _brief(value: Any) -> str:
    """A key or value of the command line, shown in an error: its repr, cut to ~80 characters (an
    unknown key of 100,000 characters was echoed whole)."""
    return _BRIEF.repr(value)


def _algo_fields(module: ModuleType, cls: Any) -> set[str]:
    """The field names of the app's algorithm's Config: ``Config.algorithm_fields(ALGO)`` (the
    standard apps' configs define it, ``reactor.nodes.apps``), or none."""
    algo = getattr(module, "ALGO", None)
    fields_of = getattr(cls, "algorithm_fields", None)
    if algo is None or fields_of is None:
        return set()
    try:
        return set(fields_of(algo))
    except ValueError as e:
        raise AppError(f"{module.__file__}: ALGO = {algo!r}: {e}") from e


def build_graph(path: str | Path, overrides: Mapping[str, Any]) -> Graph:
    """Load the app at ``path`` and build its graph with ``overrides`` applied."""
    module = load_app(path)
    config = make_config(module, overrides)
    try:
        inspect.signature(module.build).bind(config)
    except TypeError as e:  # (a build(config, extra): Python's TypeError at reactor's call, its traceback)
        raise AppError(f"{path}: build must take one argument, the config ({e})") from None
    except ValueError:  # (no signature to read: a builtin; called as it is)
        pass
    graph = module.build(config)
    if not isinstance(graph, Graph):
        raise AppError(f"{path}: build(config) returned {type(graph).__name__}, not a Graph")
    return graph


#: The app file every worker of a run without one loads (``builder_app``).
BUILDER_APP = Path(__file__).with_name("_builder_app.py")


def app_label(app: str | os.PathLike[str] | None, graph: Graph) -> str | None:
    """What a trace records of the app a graph came from: the app file's name, or for a graph of a
    ``graph_builder`` run without one, the builder's ``module:qualname`` (None when neither is known)."""
    if graph.built_by is not None and (app is None or Path(app) == BUILDER_APP):
        return graph.built_by[0]
    return Path(app).name if app is not None else None


def builder_app(graph: Graph) -> tuple[str, dict[str, Any]]:
    """The app file and config that rebuild ``graph`` from its ``graph_builder`` in another process.

    Raises:
        ValueError: the graph was not made by a builder, was changed after, the builder lives in
            ``__main__`` or takes ``*args``, or an argument is not plain data (naming it).
    """
    if graph.built_by is None and graph.built_shape is not None:
        raise ValueError("the graph's builder takes *args or positional-only arguments: workers rebuild a graph "
                         "from keyword arguments only; give the builder named parameters")
    if graph.built_by is None:
        raise ValueError("a multi-process placement needs the app file the workers rebuild the graph from: "
                         "run(graph, app=PATH, config=...), or a graph made by a @graph_builder function "
                         "(reactor.nodes.training.off_policy_graph, say)")
    name, arguments = graph.built_by
    if graph.built_shape is not None and graph.built_shape != (len(graph.nodes), len(graph.connections)):
        raise ValueError(f"the graph was changed after {name} made it (reactors or links added): workers would "
                         f"rebuild the builder's graph, not this one; add them inside a @graph_builder function")
    if name.startswith("__main__:"):
        raise ValueError(f"the graph's builder {name.split(':', 1)[1]} is defined in __main__ (a script or a "
                         f"notebook): workers cannot import it; define it in a module they can import")
    arguments = {key: plain_scalars(value) for key, value in arguments.items()}  # (a graph_builder's are already)
    for key, value in arguments.items():
        if not is_plain(value):  # the launch protocol's own check of a config (_protocol.py)
            raise ValueError(f"{name}: argument {key!r} ({type(value).__name__}) cannot cross to the workers as data "
                             f"(plain numbers, strings, booleans, None, lists, tuples and dicts with string keys)")
    # (Python put the script's directory first on this process's path, not on the workers': a module
    # beside the script that this process imports failed to import there, behind 180 lines of tracebacks.)
    here = script_dir()
    path = [here, *APP_DIRS] if here is not None else list(APP_DIRS)
    return str(BUILDER_APP), {"builder": name, "arguments": arguments, "path": path}


def script_dir() -> str | None:
    """The directory of the script this process runs, where Python put it first on ``sys.path`` (an
    absolute directory), else None (``python -c``, a notebook's kernel)."""
    here = sys.path[0] if sys.path and sys.path[0] and os.path.isabs(sys.path[0]) else None
    return here if here is not None and os.path.isdir(here) else None


def note_script_dir() -> None:
    """A run of a script's graph in this process (no app file, placement ``single``): its directory joins
    :data:`SCRIPT_DIRS`, as in the workers of a multi-process run (``_builder_app``), so the learner's
    config.json records it alike and ``load_policy`` elsewhere imports a custom env's module from there."""
    here = script_dir()
    if here is not None and here not in SCRIPT_DIRS:
        SCRIPT_DIRS.append(here)

