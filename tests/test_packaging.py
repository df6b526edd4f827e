"""What `pip install .` gets: the wheel and the sdist built from this tree hold the demo's data and its
provenance, the PEP 561 marker, LICENSE and NOTICE, and metadata with pyproject's version, the SPDX
licence and no scikit-learn or SciPy. Built without build isolation (no download) from a copy of the tree,
so the tree itself is left as it was. (.ci/wheel_check.sh installs the wheel in a fresh venv and runs
`torsh demo`.)"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ("torsh_kernels/py.typed", "torsh_kernels/apps/data/digits.npz", "torsh_kernels/apps/data/README.md")


def _setuptools_77() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:1]) >= (77,)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    if not _setuptools_77():
        pytest.skip("building without isolation needs setuptools>=77 (in the dev extra)")
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    skip = (".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "tests", "benchmarks", "docs", ".*cache")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*skip))
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "--disable-pip-version-check", "-w", str(dist)], check=True, cwd=tmp)  # fmt: skip
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta as b; b.build_sdist({str(dist)!r})"],
                   check=True, cwd=src, capture_output=True)  # fmt: skip
    (whl,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    return whl, sdist


def _pyproject_version() -> str:
    return re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def test_wheel_holds_data_license_and_metadata(built):
    whl, _ = built
    version = _pyproject_version()
    assert whl.name == f"torsh_kernels-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        info = f"torsh_kernels-{version}.dist-info"
        assert set(DATA) <= names
        assert z.read(DATA[1]) == (ROOT / DATA[1]).read_bytes()
        assert z.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        words = {n: " ".join(z.read(n).decode().split()) for n in (DATA[2], f"{info}/licenses/NOTICE")}
        assert all("Attribution 4.0 International" in w and "10.24432/C50P49" in w for w in words.values())
        assert not [n for n in names if n.endswith((".pyc", ".nbi", ".nbc")) or n.startswith("tests/")]
        meta = email.message_from_bytes(z.read(f"{info}/METADATA"))
        entry = z.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == "torsh-kernels" and meta["Version"] == version
    assert meta["License-Expression"] == "Apache-2.0" and meta.get_all("License-File") == ["LICENSE", "NOTICE"]
    assert "Typing :: Typed" in meta.get_all("Classifier")
    required = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    # a CPU install is torch + numba + numpy + rich: Triton (about 1 GB) cannot run on a CPU, so it is an extra
    assert {re.match(r"[\w.-]+", r).group(0) for r in required} == {"torch", "numba", "numpy", "rich"}
    for extra in ("cuda", "dev"):
        assert [r for r in meta.get_all("Requires-Dist") if r.startswith("triton") and f'extra == "{extra}"' in r], (
            f"the {extra} extra brings triton"
        )
    assert "torsh = torsh_kernels.apps.cli:main" in entry
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "Copyright 2026 The torsh-kernels authors" in text and "[yyyy]" not in text


def test_sdist_holds_data_and_license(built):
    _, sdist = built
    top = f"torsh_kernels-{_pyproject_version()}"
    with tarfile.open(sdist) as t:
        names = set(t.getnames())
    assert {f"{top}/{n}" for n in (*DATA, "LICENSE", "NOTICE", "pyproject.toml", "README.md")} <= names


def test_triton_is_an_extra_not_a_dependency():
    """pyproject itself (the wheel's metadata is checked above, in the slow tier): triton is in no unconditional
    dependency, and the cuda extra (GPU installs) and the dev extra (the interpreter tests) bring it."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda r: re.match(r"[\w.-]+", r).group(0).lower()
    assert {name(r) for r in project["dependencies"]} == {"torch", "numba", "numpy", "rich"}
    for extra in ("cuda", "dev"):
        assert "triton" in {name(r) for r in project["optional-dependencies"][extra]}, extra


# Triton made unimportable in a fresh interpreter, as on a CPU install without the cuda/dev extras: a meta path
# finder that answers every `import triton...` with ModuleNotFoundError, as an absent package does.
_NO_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTriton())
"""


def _without_triton(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORSH_KERNELS_PROVIDER")}
    env["TORSH_KERNELS_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-c", _NO_TRITON + code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )


def test_everything_but_the_triton_provider_works_without_triton(tmp_path):
    proc = _without_triton(
        """
import torch
import torsh_kernels as tk
from torsh_kernels.errors import ProviderUnavailableError
from torsh_kernels.apps.cli import main

info = tk.providers()
print("TRITON-CPU", info["triton"].cpu)
grads = [torch.randn(10), torch.randn(3, 4)]
for provider in (None, "cpu", "torch"):
    flat, layout = tk.flatten(grads, provider=provider)
    out = [torch.empty_like(g) for g in grads]
    tk.unflatten(flat, layout, out)
    assert all(torch.equal(a, b) for a, b in zip(out, grads)), provider
try:
    tk.flatten(grads, provider="triton")
except ProviderUnavailableError as e:
    print("RAISED", e)
main(["doctor"])
assert "triton" not in sys.modules
print("OK")
""",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    hint = "triton is not installed (pip install 'torsh-kernels[cuda]')"
    assert f"TRITON-CPU {hint}" in " ".join(proc.stdout.split()), proc.stdout
    assert "RAISED torsh.flatten: provider 'triton' was requested but cannot run" in out and hint in out
    assert out.endswith("OK")


@pytest.mark.slow  # a fresh venv: about 35 s to install torch (the CPU build on disk) and the wheel, then the demo
def test_the_wheel_installs_and_runs_without_triton(built, tmp_path):
    """What a CPU user gets: a fresh venv (not --system-site-packages) with the CPU build of torch and the wheel,
    no extras; triton is not there, and `import torsh_kernels`, `torsh doctor` and `torsh demo` work."""
    if os.environ.get("TORSH_WHEEL_CHECK_FOLLOWS") == "1":
        pytest.skip(".ci/run checks the same wheel the same way after pytest (.ci/wheel_check.sh)")
    whl, _ = built
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    py = tmp_path / "venv" / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    torch = subprocess.run([*pip, "torch==2.13.0"], capture_output=True, text=True)
    if torch.returncode:
        pytest.skip(f"torch==2.13.0 (the CPU build) cannot be installed here: {torch.stderr[-500:]}")
    subprocess.run([*pip, str(whl)], check=True, capture_output=True)
    listed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
                            text=True).stdout  # fmt: skip
    assert "torsh-kernels==" in listed and not re.search(r"^triton==", listed, re.M), listed
    run = tmp_path / "run"
    run.mkdir()
    check = subprocess.run(
        [str(py), "-c", "import sys, torsh_kernels as tk\nfrom torsh_kernels.apps.cli import main\n"
         "print(tk.providers()['triton'].cpu)\nmain(['doctor'])\nassert 'triton' not in sys.modules"],
        cwd=run, capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    assert "triton is not installed (pip install 'torsh-kernels[cuda]')" in check.stdout, check.stdout
    demo = subprocess.run(
        [str(tmp_path / "venv" / "bin" / "torsh"), "demo", "--steps", "20", "--compressors", "none,powersgd",
         "--no-progress", "--link", "none", "--json", "demo.json"], cwd=run, capture_output=True, text=True,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stderr[-3000:]
    rows = json.loads((run / "demo.json").read_text())["rows"]
    assert [r["compressor"] for r in rows] == ["none", "powersgd:4"], rows
