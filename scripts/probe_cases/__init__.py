"""Catalogues of bad and edge inputs for ``scripts/probe.py``: one module per area, each exposing
``CASES: list[Case]``. A case is a real call through the public API; the runner executes it in a child
process and classifies what happened (see ``scripts/probe.py``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

EXPECT = ("error", "ok")


@dataclass
class Case:
    """One input tried on the public surface."""

    name: str
    """Unique, ``area/subject/what``, e.g. ``ops/moe_permute/triton/row_map_out_of_range``."""
    run: Callable[[], object]
    """Performs the input: returns a value or raises. Runs in a child process."""
    expect: str = "error"
    """``"error"``: a TorshKernelsError must be raised; ``"ok"``: must return and ``check`` must hold."""
    check: Callable[[object], bool] | None = None
    """For ``expect="ok"``: True when the returned value is correct (None: returning is enough)."""
    timeout: float = 30.0
    """Seconds before the case counts as a hang."""

    def __post_init__(self) -> None:
        if self.expect not in EXPECT:
            raise ValueError(f"Case {self.name!r}: expect must be one of {EXPECT}, got {self.expect!r}")


@contextlib.contextmanager
def setenv(**values):
    """Environment variables set (None: unset) for the block, then put back."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
