"""scripts/probe.py, the bad-input probe: every outcome is told apart, in worker processes that survive
nothing but are replaced (a crash or a hang costs only its own case)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CATALOGUE = textwrap.dedent(
    """
    import os, time
    from probe_cases import Case
    from torsh_kernels.errors import InvalidArgumentError

    def typed():
        raise InvalidArgumentError("bad")

    def bare():
        raise IndexError("index 7 is out of bounds")

    def crash():
        os.abort()

    def hang():
        time.sleep(60)

    CASES = [
        Case("t/typed", typed),
        Case("t/bare", bare),
        Case("t/crash", crash),
        Case("t/after_crash", typed),
        Case("t/hang", hang, timeout=2),
        Case("t/accepted", lambda: 3),
        Case("t/correct", lambda: 3, expect="ok", check=lambda v: v == 3),
        Case("t/wrong", lambda: 4, expect="ok", check=lambda v: v == 3),
        Case("t/refused", typed, expect="ok"),
    ]
    """
)


@pytest.mark.slow  # scripts/probe.py over a catalogue, in a subprocess
def test_probe_tells_every_outcome_apart(tmp_path):
    (tmp_path / "toy.py").write_text(CATALOGUE)
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe.py"), "--cases", str(tmp_path),
                        "--json", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr  # defects were counted
    doc = json.loads(out.read_text())
    got = {c["name"]: c["outcome"] for c in doc["cases"]}
    assert got == {
        "t/typed": "typed_error",
        "t/bare": "other_exception",
        "t/crash": "crash",
        "t/after_crash": "typed_error",
        "t/hang": "hang",
        "t/accepted": "silent_acceptance",
        "t/correct": "correct",
        "t/wrong": "silent_acceptance",
        "t/refused": "refused_valid",
    }
    assert doc["counts"]["inputs"] == 9 and doc["counts"]["typed_error"] == 2
    assert "IndexError: index 7" in next(c["detail"] for c in doc["cases"] if c["name"] == "t/bare")
    assert "signal 6" in next(c["detail"] for c in doc["cases"] if c["name"] == "t/crash")


def test_probe_refuses_an_unknown_area(tmp_path):
    (tmp_path / "toy.py").write_text(CATALOGUE)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "probe.py"), "--cases", str(tmp_path),
                        "--area", "nope"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "unknown area(s) ['nope']" in r.stderr
