#!/usr/bin/env python3
"""Probe the public surface with bad and edge inputs, the way a careful user and an unlucky operator would.

    python scripts/probe.py                      # every catalogue in scripts/probe_cases/
    python scripts/probe.py --area ops,cli       # some of them
    python scripts/probe.py -k moe_permute       # cases whose name contains a substring
    python scripts/probe.py --json probe.json    # the counts and every case's outcome, as JSON

Each catalogue (``scripts/probe_cases/<area>.py``) lists :class:`probe_cases.Case` objects. A case runs
in a worker process (one worker runs many cases; a crash or a hang costs only that worker, which is then
replaced), and ends in exactly one of:

- ``typed_error``: a ``TorshKernelsError`` subclass was raised where one was expected;
- ``correct``: the case was expected to succeed, returned, and its check held;
- ``refused_valid``: a ``TorshKernelsError`` was raised for an input that should have worked;
- ``other_exception``: any other exception (a bare ``IndexError``, a ``RecursionError``...);
- ``crash``: the worker died (signal, abort, ``os._exit``) while running the case;
- ``hang``: the case ran past its timeout (the worker is killed);
- ``silent_acceptance``: an input that must be refused was accepted, or a result's check failed.

Everything but ``typed_error`` and ``correct`` is a defect; the exit status is 1 when any is counted.
Without a GPU the workers run Triton's interpreter and Numba's simulator, as the tests do.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUTCOMES = ("typed_error", "correct", "refused_valid", "other_exception", "crash", "hang", "silent_acceptance")
GOOD = ("typed_error", "correct")
READY_TIMEOUT = 300.0
"""Seconds a new worker may take to import torch, torsh_kernels and the catalogues."""


CASES_DIR = HERE / "probe_cases"


def areas(where: Path = CASES_DIR) -> list[str]:
    """Every catalogue module in ``where`` (default scripts/probe_cases/), by name."""
    return sorted(p.stem for p in Path(where).glob("*.py") if not p.stem.startswith("_"))


def _gpu_modes() -> None:
    # As tests/conftest.py: without a GPU, the Triton interpreter and the Numba simulator, set before
    # anything imports Triton or Numba.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def _load(where: Path, names: list[str]) -> dict:
    """The cases of the named catalogues, by case name (a duplicate name is an error in the catalogue)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))  # the catalogues import probe_cases.Case
    cases = {}
    for area in names:
        spec = importlib.util.spec_from_file_location(f"_probe_catalogue_{area}", Path(where) / f"{area}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for c in mod.CASES:
            if c.name in cases:
                raise SystemExit(f"probe: duplicate case name {c.name!r} (in {area})")
            cases[c.name] = c
    return cases


def _classify(case) -> tuple[str, str]:
    from torsh_kernels.errors import TorshKernelsError

    try:
        value = case.run()
    except TorshKernelsError as e:
        first = (str(e).splitlines() or [""])[0]
        return ("typed_error" if case.expect == "error" else "refused_valid"), f"{type(e).__name__}: {first}"
    except BaseException as e:  # any other exception is what is being counted
        first = (str(e).splitlines() or [""])[0]
        return "other_exception", f"{type(e).__name__}: {first[:300]}"
    if case.expect == "error":
        return "silent_acceptance", f"returned {type(value).__name__}"
    if case.check is not None:
        try:
            ok = bool(case.check(value))
        except BaseException as e:
            return "silent_acceptance", f"check raised {type(e).__name__}: {e}"
        if not ok:
            return "silent_acceptance", "returned a wrong result"
    return "correct", ""


def _worker(conn, where: Path, names: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    _gpu_modes()
    cases = _load(where, names)
    import torsh_kernels  # noqa: F401 - imported before the first case is timed

    conn.send("ready")
    while True:
        name = conn.recv()
        if name is None:
            return
        print(f"--- {name}", flush=True)
        t0 = time.perf_counter()
        outcome, detail = _classify(cases[name])
        conn.send((outcome, detail, time.perf_counter() - t0))


class _Pool:
    """One worker process at a time, replaced after a crash or a hang."""

    def __init__(self, where: Path, names: list[str], log: str) -> None:
        self.where, self.names, self.log = where, names, log
        self.ctx = mp.get_context("spawn")
        self.proc = None

    def _start(self) -> None:
        parent, child = self.ctx.Pipe()
        # not daemonic: a case may start processes of its own (run_local's ranks); close() and the kill on a
        # hang or at exit stop the worker
        self.proc = self.ctx.Process(target=_worker, args=(child, self.where, self.names, self.log))
        self.proc.start()
        child.close()
        self.conn = parent
        if not parent.poll(READY_TIMEOUT) or parent.recv() != "ready":
            raise SystemExit(f"probe: a worker did not start; see {self.log}")

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
            self.proc = None

    def run(self, case) -> tuple[str, str, float]:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        t0 = time.perf_counter()
        self.conn.send(case.name)
        try:
            if self.conn.poll(case.timeout):
                return self.conn.recv()
        except (EOFError, ConnectionError):
            pass
        elapsed = time.perf_counter() - t0
        self.proc.join(0.5)
        if self.proc.exitcode is None:
            self._kill()
            return "hang", f"no result after {case.timeout:g} s", elapsed
        code = self.proc.exitcode
        self.proc = None
        return "crash", (f"signal {-code}" if code < 0 else f"exit status {code}"), elapsed

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        self._kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--area", help=f"comma-separated catalogues (default: all of {', '.join(areas())})")
    p.add_argument("--cases", type=Path, default=CASES_DIR, help="the catalogues' directory (default: %(default)s)")
    p.add_argument("-k", dest="substr", help="only cases whose name contains this substring")
    p.add_argument("--json", dest="json_path", help="write the counts and every case's outcome here")
    p.add_argument("--list", action="store_true", help="list the case names and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print every case, not only the defects")
    a = p.parse_args(argv)
    names = areas(a.cases) if not a.area else [s.strip() for s in a.area.split(",") if s.strip()]
    unknown = sorted(set(names) - set(areas(a.cases)))
    if unknown or not names:
        p.error(f"unknown area(s) {unknown}; the catalogues in {a.cases} are {areas(a.cases)}")
    _gpu_modes()
    cases = _load(a.cases, names)  # in this process too, to list and filter (and to fail early on a bad catalogue)
    chosen = [c for n, c in cases.items() if not a.substr or a.substr in n]
    if a.list:
        print("\n".join(c.name for c in chosen))
        return 0
    if not chosen:
        p.error("no case matches")

    log = os.path.join(tempfile.mkdtemp(prefix="torsh-probe-"), "workers.log")
    pool = _Pool(a.cases, names, log)
    rows, counts, t0 = [], Counter(), time.perf_counter()
    try:
        for i, c in enumerate(chosen, 1):
            outcome, detail, secs = pool.run(c)
            counts[outcome] += 1
            rows.append({"name": c.name, "expect": c.expect, "outcome": outcome, "detail": detail,
                         "seconds": round(secs, 4)})  # fmt: skip
            if a.verbose or outcome not in GOOD:
                print(f"[{i}/{len(chosen)}] {outcome:17} {c.name}  {detail}", flush=True)
    finally:
        pool.close()
    wall = time.perf_counter() - t0

    by_area: dict[str, Counter] = {}
    for r in rows:
        by_area.setdefault(r["name"].split("/", 1)[0], Counter())[r["outcome"]] += 1
    width = max([len(x) for x in by_area] + [5])
    print(f"\n{'area':{width}}  {'inputs':>6}  " + "  ".join(OUTCOMES))
    for area, cnt in [*sorted(by_area.items()), ("total", counts)]:
        print(f"{area:{width}}  {sum(cnt.values()):>6}  " + "  ".join(f"{cnt[o]:>{len(o)}}" for o in OUTCOMES))
    bad = sum(counts[o] for o in OUTCOMES if o not in GOOD)
    print(f"\n{len(rows)} inputs in {wall:.0f} s; {bad} defect(s). Worker output: {log}")

    if a.json_path:
        import torch

        import torsh_kernels

        doc = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "machine": platform.node(),
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torsh_kernels": torsh_kernels.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "areas": names,
            "seconds": round(wall, 1),
            "counts": {o: counts[o] for o in OUTCOMES} | {"inputs": len(rows)},
            "by_area": {k: {o: v[o] for o in OUTCOMES} for k, v in sorted(by_area.items())},
            "cases": rows,
        }
        Path(a.json_path).write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
