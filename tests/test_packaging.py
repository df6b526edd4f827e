"""What `pip install .` gets: the wheel and the sdist built from this tree hold the demo's data and its
provenance, the PEP 561 marker, LICENSE and NOTICE, and metadata with pyproject's version, the SPDX
licence and no scikit-learn or SciPy. Built without build isolation (no download) from a copy of the tree,
so the tree itself is left as it was. (.ci/wheel_check.sh installs the wheel in a fresh venv and runs
`torsh demo`.)"""

from __future__ import annotations

import email
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


pytestmark = pytest.mark.skipif(
    not _setuptools_77(), reason="building without isolation needs setuptools>=77 (in the dev extra)"
)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
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
    assert {re.match(r"[\w.-]+", r).group(0) for r in required} == {"torch", "triton", "numba", "numpy", "rich"}
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
