"""This library's version, read without importing torch (``torsh --version`` loads nothing else)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

__all__ = ["DIST", "UNKNOWN_VERSION", "__version__", "own_version"]

DIST = "torsh-kernels"
"""This library's distribution name (pyproject's ``name``)."""

UNKNOWN_VERSION = "0+unknown"
"""The version reported where neither package metadata nor a pyproject.toml says one."""


def own_version(dist: str = DIST, source_root: Path | None = None) -> str:
    """This library's version, whose one source is pyproject.toml's ``version``: read from the installed
    package's metadata (``importlib.metadata``), which pip writes from it. Where no metadata is found
    (the package imported from a source tree that was never installed), the ``version`` of the
    ``[project]`` table of the pyproject.toml in ``source_root`` (default: the directory above the
    package) if that table is this library's; where there is none either, :data:`UNKNOWN_VERSION`.
    An editable install's metadata is written at install time: after a version bump, reinstall."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    root = Path(__file__).resolve().parent.parent if source_root is None else source_root
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return UNKNOWN_VERSION
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    table = project.group(1) if project else ""
    name = re.search(r"""^name\s*=\s*["']([^"']+)["']""", table, re.M)
    version = re.search(r"""^version\s*=\s*["']([^"']+)["']""", table, re.M)
    if name and version and re.sub(r"[-_.]+", "-", name.group(1)).lower() == dist:  # this library's own
        return version.group(1)
    return UNKNOWN_VERSION


__version__ = own_version()
"""This library's version (re-exported as ``torsh_kernels.__version__``); see :func:`own_version`."""
