"""Derive tests/slow_cases.txt, the fast tier's measured list, from a durations log (docs/testing.md).

The fast tier (``pytest -m "not slow"``) must stay a few minutes on a 2-core machine. Beside the explicit
``slow`` marks and conftest's interpreter rule, the cases that the fast tier's own run measures at
``--min`` seconds or more are listed here and marked ``slow`` at collection (tests/conftest.py)::

    pytest -m "not slow" -p no:cacheprovider --durations=0 --durations-min=0.3 > durations.log
    python scripts/slow_cases.py durations.log [--min 0.5]

A test's time is the sum of its setup, call and teardown. The new list replaces the old one's entries for
the tests the log measured and keeps the rest (cases the log did not run because they were already listed).
Entries that name no collected test are reported by the conftest hook's check (tests/test_slow_cases.py).
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

LIST = Path(__file__).resolve().parent.parent / "tests" / "slow_cases.txt"
HEADER = """\
# The fast tier's measured slow cases: marked `slow` at collection by tests/conftest.py (docs/testing.md).
# Derived by scripts/slow_cases.py from `pytest -m "not slow" --durations=0 --durations-min=0.3` on the
# 2-core VM: every case that took {min} s or more there (setup + call + teardown). Re-derive it when the
# fast tier grows past its budget; a name that no longer exists fails tests/test_slow_cases.py.
"""


def read(path: Path) -> dict[str, float]:
    times: dict[str, float] = collections.defaultdict(float)
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)", line)
        if m:
            times[m.group(2)] += float(m.group(1))
    return times


def listed() -> list[str]:
    if not LIST.exists():
        return []
    return [ln.strip() for ln in LIST.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--min", type=float, default=0.5, help="seconds at or above which a case is listed")
    a = ap.parse_args()
    times = read(a.log)
    if not times:
        raise SystemExit(f"{a.log}: no durations found (run pytest with --durations=0 --durations-min=0.3)")
    keep = {t for t in listed() if t not in times}
    new = {t for t, s in times.items() if s >= a.min}
    names = sorted(keep | new)
    LIST.write_text(HEADER.format(min=a.min) + "".join(f"{n}\n" for n in names))
    print(
        f"{LIST}: {len(names)} cases ({len(new)} measured at >= {a.min} s, {len(keep)} kept); "
        f"{sum(times[t] for t in new):.0f} s of {sum(times.values()):.0f} s measured"
    )


if __name__ == "__main__":
    main()
