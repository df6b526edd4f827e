"""The import rule of docs/architecture.md, checked on the source: a layer imports only the layers below it
(function-level imports included), and importing torsh_kernels loads neither Triton, Numba nor profiling."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import torsh_kernels

PACKAGE = Path(torsh_kernels.__file__).parent
# floor of each part of the package; the neutral modules sit under every layer
# (config maps settings from elsewhere onto parallel's and compression's objects: above them, below profiling;
# integrations glues parallel's hooks and FSDP2 comms into Lightning, Accelerate, the Trainer, torchtitan: the same)
LAYERS = {"recording": 0, "live": 0, "errors": 0, "checks": 0, "specs": 0, "env": 0, "version": 0, "cli_common": 0,
          "files": 0, "ops": 1, "collectives": 2, "compression": 3,
          "parallel": 4, "config": 4.5, "integrations": 4.5, "profiling": 5, "apps": 6}  # fmt: skip


def _part(module: str) -> str | None:
    """'torsh_kernels.ops.bucket' -> 'ops'; the package facade itself -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in one file, relative ones resolved, `from X import name`
    resolved to X.name where that names a module of the package."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    pkg = list(rel.parts[:-1])  # the package a relative import starts from
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                full = f"{base}.{a.name}"
                known = (PACKAGE.parent / full.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / full.replace(".", "/") / "__init__.py").exists()  # fmt: skip
                out.append((node.lineno, full if known else base))
    return [(line, m) for line, m in out if m == "torsh_kernels" or m.startswith("torsh_kernels.")]


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.as_posix() == "__init__.py":
            continue  # the facade re-exports layer 1 and starts a TORSH_TRACE recorder: it sits on top
        here = LAYERS[rel.parts[0].removesuffix(".py")]
        for line, module in _imports(path):
            part = _part(module)
            if part is None and here < LAYERS["apps"]:
                # the facade re-exports layer 1 but may load profiling: only the applications use it
                wrong.append(f"{rel}:{line} imports the package facade (import the module instead)")
            elif part is not None and LAYERS[part] > here:
                wrong.append(f"{rel}:{line} ({rel.parts[0]}, floor {here}) imports {module} (floor {LAYERS[part]})")
    assert not wrong, "\n".join(wrong)


def test_every_part_of_the_package_has_a_floor():
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert parts - {"__init__"} == set(LAYERS)


def test_importing_the_package_loads_no_triton_numba_or_profiling():
    heavy = "('triton', 'numba', 'torsh_kernels.profiling')"
    code = ("import torsh_kernels, torsh_kernels.compression, torsh_kernels.parallel, torsh_kernels.config, sys; "
            f"print([m for m in sys.modules if m.startswith({heavy})])")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TORSH_TRACE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
