"""The package's structure counts (issue 40's "Done when"), from its source: run from the repository root.

- modules over 600 lines;
- functions over 80 lines outside kernels (the kernel modules, ``ops/<family>/{triton,numba,cpu}.py`` and
  ``ops/*_common.py``, hold the kernels and the factories that build them);
- imports of another module's underscore name (``from .x import _y``, ``from . import _x``), and imports from
  a module whose dotted path has an underscore part;
- public functions and constructors with more than 12 parameters, outside the kernel modules; those that
  are not user-facing are listed with why (a ``torch.library`` custom op's schema is flat).

    python scripts/structure_counts.py [-v]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path("torsh_kernels")
KERNEL_FILES = {"triton.py", "numba.py", "cpu.py", "triton_common.py", "numba_common.py", "cpu_common.py"}
CUSTOM_OP = "torch.library.custom_op"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _kernel_module(p: Path) -> bool:
    return p.parts[:2] == ("torsh_kernels", "ops") and p.name in KERNEL_FILES


def main() -> None:
    verbose = "-v" in sys.argv
    big, long_fns, under, wide = [], [], [], []
    for p in sorted(ROOT.rglob("*.py")):
        src = p.read_text()
        n = src.count("\n")
        if n > 600:
            big.append((n, str(p)))
        tree = ast.parse(src)
        kernels = _kernel_module(p)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                decos = [ast.unparse(d) for d in node.decorator_list]
                jit = any("jit" in d for d in decos)
                if lines > 80 and not (kernels or jit):
                    long_fns.append((lines, f"{p}:{node.lineno} {node.name}"))
                a = node.args
                params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
                public = not _private(node.name) or node.name == "__init__"
                if public and not kernels and len(params) > 12:
                    op = any(CUSTOM_OP in d for d in decos)
                    why = " (a torch.library custom op: its schema is flat)" if op else ""
                    wide.append((len(params), f"{p}:{node.lineno} {node.name}{why}"))
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("torsh_kernels")):
                parts = (node.module or "").split(".")
                for a in node.names:
                    if _private(a.name) or any(_private(x) for x in parts):
                        under.append(f"{p}:{node.lineno} from {'.' * node.level}{node.module or ''} import {a.name}")
    print(f"modules over 600 lines: {len(big)}")
    for n, f in sorted(big, reverse=True):
        print(f"  {n} {f}")
    print(f"functions over 80 lines outside kernels: {len(long_fns)}")
    for n, f in sorted(long_fns, reverse=True):
        print(f"  {n} {f}")
    print(f"imports of an underscore name or from an underscore module: {len(under)}")
    for u in under if verbose else under[:20]:
        print(f"  {u}")
    print(f"public functions and constructors with more than 12 parameters: {len(wide)}")
    for n, f in sorted(wide, reverse=True):
        print(f"  {n} {f}")


if __name__ == "__main__":
    main()
