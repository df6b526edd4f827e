"""The library's version has one source, pyproject.toml: read through the package metadata when installed,
from the source tree's pyproject.toml when not, and a marked unknown when neither is there."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import torsh_kernels
from torsh_kernels import env

ROOT = Path(__file__).resolve().parent.parent


def _pyproject_version() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"$', text, re.M).group(1)


def test_version_is_the_installed_metadata():
    assert torsh_kernels.__version__ == importlib.metadata.version("torsh-kernels")
    assert env.versions()["torsh_kernels"] == torsh_kernels.__version__


def test_version_fallbacks(tmp_path, monkeypatch):
    def absent(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", absent)  # as in a source tree never installed
    assert env.own_version(source_root=ROOT) == _pyproject_version()
    if Path(env.__file__).resolve().parents[1] == ROOT:  # the package imported from this tree
        assert env.own_version() == _pyproject_version()
    assert env.own_version(source_root=tmp_path) == env.UNKNOWN_VERSION  # no pyproject.toml
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9.9"\n')
    assert env.own_version(source_root=tmp_path) == env.UNKNOWN_VERSION  # another project's
    (tmp_path / "pyproject.toml").write_text('[tool.x]\nversion = "1"\n[project]\nname = "Torsh_Kernels"\n'
                                             'version = "2.0.1"\n[tool.y]\nversion = "3"\n')  # fmt: skip
    assert env.own_version(source_root=tmp_path) == "2.0.1"
