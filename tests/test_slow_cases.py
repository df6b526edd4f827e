"""tests/slow_cases.txt, the fast tier's measured list: every entry names a test that exists."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import SLOW_CASES, _measured_slow_cases

ROOT = SLOW_CASES.parent.parent


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_measured_slow_case_names_an_existing_test():
    cases = _measured_slow_cases()
    assert len(cases) > 100  # the list is read (a wrong path would leave the fast tier at twice its budget)
    missing = []
    cache: dict[Path, set[str]] = {}
    for case in sorted(cases):
        file, _, name = case.partition("::")
        path = ROOT / file
        if not path.is_file():
            missing.append(case)
            continue
        funcs = cache.setdefault(path, _functions(path))
        if name.split("[", 1)[0].split("::")[-1] not in funcs:
            missing.append(case)
    assert not missing, f"tests/slow_cases.txt names tests that no longer exist (re-derive it): {missing}"
