"""The tests' own house rules: what test modules share lives in a helpers module or a
fixture (``tests/helpers.py``, a package's ``helpers.py`` or ``*_scenario.py``, its
``conftest.py``), never in another test module or imported from a conftest."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another_or_a_conftest() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            names = [node.module.rsplit(".", 1)[-1]] if node.module else []
            names += [alias.name for alias in node.names] if node.module is None else []
            if any(n.startswith("test_") or n == "conftest" for n in names):
                where = path.relative_to(TESTS.parent)
                offenders.append(f"{where}:{node.lineno}: from {'.' * node.level}{node.module}")
    assert not offenders, "\n".join(offenders)
