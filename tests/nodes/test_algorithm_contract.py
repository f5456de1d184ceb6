"""An algorithm of one's own (docs/guide.md section 4): what reactor says when its module does not import,
has the name of a shipped one, or breaks the fragment contract (reactor.algos' docstring). Regressions
of a newcomer's pass over the guide (sections 3-7): each was an error from inside reactor (an
AttributeError on a numpy array, "unknown algorithm" for a module that exists), or no error at all."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from reactor.nodes._registry import load_algorithm

ROOT = Path(__file__).resolve().parents[2]


def _guide_block(name: str) -> str:
    """The guide's python block that opens with ``# name`` (its A2C, its env)."""
    text = (ROOT / "docs" / "guide.md").read_text()
    m = re.search(rf"```python\n# {re.escape(name)}\n.*?```", text, re.S)
    assert m is not None, name
    return m.group(0)[len("```python\n"):-len("```")]


@pytest.fixture
def beside(tmp_path, monkeypatch):
    """Write modules into a directory on the import path (as beside an app file); forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(name: str, code: str) -> str:
        (tmp_path / f"{name}.py").write_text(code)
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


# ------------------------------------------------------------------------------------- finding the module


def test_a_copy_of_a_shipped_algorithm_beside_the_app_says_its_relative_imports_fail(beside):
    """Regression: a copy of reactor/algos/dqn.py beside an app (the guide points to it) was "unknown
    algorithm 'odqn_ok': not one of dqn, ppo, ... (attempted relative import with no known parent
    package)"; any ImportError inside a module read as an unknown name."""
    beside("odqn_copy", (ROOT / "reactor" / "algos" / "dqn.py").read_text())
    with pytest.raises(ValueError, match=r"^algorithm module 'odqn_copy' failed to import: ImportError: attempted "
                                         r"relative import with no known parent package \(.*odqn_copy\.py line \d+\); "
                                         r"outside reactor's package a copied algorithm imports reactor's modules "
                                         r"absolutely: `from reactor\.algos import X` for `from \. import X`"):
        load_algorithm("odqn_copy")
    fixed = (ROOT / "reactor" / "algos" / "dqn.py").read_text().replace("from ..replay import", "from reactor.replay import") \
        .replace("from . import", "from reactor.algos import").replace("from ._common import", "from reactor.algos._common import")
    assert load_algorithm(beside("odqn_fixed", fixed)).KIND == "off_policy"  # (what the message says to do works)


def test_a_missing_import_inside_an_algorithm_module_is_its_error_not_an_unknown_name(beside):
    beside("algo_needs_dep", "import no_such_dependency_here\n")
    with pytest.raises(ValueError, match=r"^algorithm module 'algo_needs_dep' failed to import: ModuleNotFoundError: "
                                         r"No module named 'no_such_dependency_here' \(.*algo_needs_dep\.py line 1\)$"):
        load_algorithm("algo_needs_dep")
    beside("algo_unclosed", "x = (\n")  # (a SyntaxError's traceback ends in importlib: its own file and line)
    with pytest.raises(ValueError, match=r"^algorithm module 'algo_unclosed' failed to import: SyntaxError: '\(' was "
                                         r"never closed \(.*algo_unclosed\.py line 1\)$"):
        load_algorithm("algo_unclosed")
    for name in ("no_such_algo_module", "no_such_pkg.algo"):  # the module (or its package) itself: unknown
        with pytest.raises(ValueError, match=rf"^unknown algorithm '{name}': not one of dqn, ppo, sac, td3, ddpg, "
                                             r"transformer_dqn, and no module of that name imports here"):
            load_algorithm(name)


def test_an_algorithm_module_named_like_a_shipped_one_is_refused_naming_its_file(beside, tmp_path):
    """Regression: a user's own ppo.py beside the app, with ALGO = "ppo", was silently ignored and the
    shipped PPO ran."""
    beside("ppo", _guide_block("my_a2c.py"))
    with pytest.raises(ValueError, match=rf"^algorithm 'ppo' is reactor's own, but {re.escape(str(tmp_path / 'ppo.py'))} "
                                         r"on the import path defines an algorithm \(act and learn\) of that name too, "
                                         r"which reactor would ignore: rename it \(my_ppo\.py, with ALGO = 'my_ppo'\)"):
        load_algorithm("ppo")


def test_an_app_file_named_like_its_algorithm_is_no_shadow(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "apps"))  # (apps/ppo.py: an app, on the path as every loaded app's dir)
    assert load_algorithm("ppo").__name__ == "reactor.algos.ppo"
