"""`torsh bench [SUITE ...] [--json [PATH]] [--compare BASELINE.json --max-regression 10%]`: every suite
through one harness.

Runs the named suites (default: all of bucket, compression, collectives, ddp, fsdp, moe, offload, trace,
overhead), each with its own tables, then writes one JSON document: the environment (device, versions,
date, git commit), each suite's full results with the options it ran with, and a flat `measurements` map
per suite (case -> median time in ms and whether it is ours, a peer's or the copy baseline) that
`--compare` reads.

`--compare BASELINE.json` takes a document of this command or one suite's own JSON (`torsh bench SUITE
--json PATH`). It is checked before anything runs: it must be JSON of either form and hold every suite to
be run (default: the suites it holds). Each suite then runs with the options the baseline recorded for it,
so the same cases are measured (`--args` adds options), and every case in both is compared. One of ours
whose median is slower than the baseline's by more than `--max-regression` (default 10%) is a suspect; it is a
regression only when its p20-p80 interval lies wholly above the baseline's
(:func:`torsh_kernels.env.compare_spread`, the rule `torsh tune` judges winners by) and stays so when its
suite is run once more (the suite's own interleaved timing, each case's implementations alternating; the
baseline's code is not here to interleave with, so the re-run checks that the slowdown reproduces), and only
when it is slower than the machine: a suspect whose case's peers and copy baseline (timed interleaved with it)
slowed by as much, within `--max-regression`, shows the machine's slowdown. A suspect whose intervals overlap,
whose slowdown the re-run does not reproduce, or whose peers slowed as much, is reported as "too noisy to
judge", with which, and does not fail the run. Cases whose suite records no spread (the collectives suite) are
judged on their medians, and said so. Exit status: 1 when a regression is judged, 0 otherwise (cases too noisy
to judge included: re-run on a quiet machine to judge them); peers and copies are shown but never fail the run
(their change is the machine's, not ours). A run that compares nothing is an error (exit status 2).

`--ncu` adds hardware counters of the fused kernels (Nsight Compute through nsight-python, the `nsight`
extra): DRAM throughput and occupancy per kernel; where `ncu`, nsight-python or a GPU is missing it says
which and exits with status 2.

Sizes: on a GPU the suites' own defaults (and the moe suite's layer cases at their target size,
`--layer-full`); on a CPU, unless `--full`, reduced sizes (each suite a few seconds to a minute; the full
CPU run takes most of an hour). `--args SUITE="..."` passes options to a
suite.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import shlex
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ... import cli_common
from ...env import Timing, compare_spread
from ...errors import InvalidArgumentError
from ...files import read_capped
from . import add_device, environment, resolve_device

# Each suite (a module of this package with add_arguments and run) and its one-line help.
SUITES = {
    "bucket": "flatten / unflatten / bucket_reduce against the torch peers",
    "compression": "compression ops and compressors against the torch peers",
    "collectives": "collectives and compressed all-reduce over real processes",
    "ddp": "DDP step time: PyTorch's hooks against torsh's compression_hook",
    "fsdp": "FSDP2 step time and bytes on the wire: plain fully_shard against torsh's quantized comms",
    "moe": "MoE route + permute + unpermute against a Mixtral-style torch block",
    "offload": "pack/unpack to host against plain copies; AdamW against OffloadedOptimizer",
    "trace": "what the timeline instrumentation costs per call, with and without a recorder",
    "overhead": "host cost per call of every public op at tiny sizes against its plain-torch equivalent",
    "live": "live metrics: step time with and without publishing; (root) auto following a changing link",
}
SUITE_NAMES = tuple(SUITES)

# Reduced settings for CPU runs (each a few seconds to a minute on 2 cores).
QUICK: dict[str, list[str]] = {
    "bucket": ["--cases", "a,b", "--scale", "0.05", "--reps", "5"],
    "compression": ["--sizes", "1", "--ortho-batch", "64", "--ortho-rows", "2048", "--reps", "5"],
    "collectives": ["--sizes", "64K,1M", "--compress-sizes", "1M", "--reps", "3"],
    "ddp": ["--width", "256", "--layers", "2", "--steps", "4", "--no-torch-powersgd-buckets"],
    "fsdp": ["--width", "256", "--layers", "2", "--steps", "3"],
    "moe": ["--tokens", "2048", "--hidden", "512", "--reps", "5"],
    "offload": ["--sizes", "16", "--width", "512", "--layers", "4", "--steps", "3", "--reps", "5"],
    "trace": ["--calls", "50000", "--reps", "5"],
    "overhead": ["--calls", "100", "--reps", "7"],
    "live": ["--runs", "2", "--steps", "40"],
}
# Options a suite adds to its own defaults in the full runs (a GPU, or --full): the sizes its defaults keep small
# because a direct call of the suite runs them (the moe suite's layer cases: a smoke size unless --layer-full).
FULL: dict[str, list[str]] = {"moe": ["--layer-full"]}
HAS_DEVICE = ("bucket", "compression", "moe", "offload")


def suite_module(name: str):
    """The module of a suite: ``add_arguments(parser)`` and ``run(args)``."""
    return importlib.import_module(f"{__package__}.{name}")


KINDS = ("ours", "peer", "copy")
MAX_BASELINE_BYTES = 64 << 20
"""The largest ``--compare`` baseline read (a document of every suite is tens of KB)."""
OUTPUT_OPTIONS = frozenset({"json"})
"""The suites' options that say where to write (dests): never replayed from a baseline."""


def _with_spread(m: dict, p20: object, p80: object) -> dict:
    """``m`` with ``p20``/``p80`` (ms) where both are recorded."""
    if isinstance(p20, int | float) and isinstance(p80, int | float):
        m["p20"], m["p80"] = p20, p80
    return m


def run_spread(values: Iterable[float | None]) -> dict | None:
    """The spread of per-run figures, ``{"median", "min", "max", "n"}`` (None values left out; None for none): the
    form the suites' summaries record and :func:`~torsh_kernels.apps.bench.ddp_report.fmt_spread` prints."""
    xs = [x for x in values if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def interleaved_summary(runs: Sequence[Mapping[str, float | Sequence[float] | None]], baseline: str) -> dict[str, dict]:
    """Interleaved runs (each times every case in turn), per case: ``figure``, the :func:`run_spread` over runs of
    its per-run figure (a number, or the median of the run's per-step times); ``runs``, those figures run by run
    (None where a run lacks the case); ``speedup_vs_baseline``, the spread of ``baseline``'s figure over the case's,
    paired within each run (a run lacking either is left out; None where none has both). Cases in the order they
    first appear. An :class:`~torsh_kernels.errors.InvalidArgumentError` for a baseline no run has, an empty list of
    times, or a figure that is not a finite number > 0."""
    figures: list[dict[str, float]] = []
    for i, run in enumerate(runs):
        figures.append({})
        for case, v in run.items():
            if v is not None and not isinstance(v, int | float):
                if not (v := list(v)):
                    raise InvalidArgumentError(f"interleaved_summary: run {i}: {case!r} has no step times")
                v = statistics.median(v)
            if v is not None and (isinstance(v, bool) or not (math.isfinite(v) and v > 0)):
                raise InvalidArgumentError(f"interleaved_summary: run {i}: {case!r}: {v!r} is not a figure > 0")
            if v is not None:
                figures[-1][case] = float(v)
    cases = list(dict.fromkeys(c for f in figures for c in f))
    if baseline not in cases:
        raise InvalidArgumentError(f"interleaved_summary: no run has the baseline {baseline!r} (cases: {cases})")
    return {c: {"figure": run_spread(f.get(c) for f in figures), "runs": [f.get(c) for f in figures],
                "speedup_vs_baseline": run_spread(f[baseline] / f[c] for f in figures if c in f and baseline in f)}
            for c in cases}  # fmt: skip


def measurements(suite: str, data: dict) -> dict[str, dict]:
    """One suite's JSON as {case: {"ms": median, "kind": "ours" | "peer" | "copy", "p20", "p80"}}: the one
    key form of a case, in a suite's own JSON and in the harness's alike; ``p20``/``p80`` (ms) where the
    suite records its spread (every suite but collectives)."""
    out: dict[str, dict] = {}
    if isinstance(data.get("results"), list):  # bucket, compression, moe, offload, trace, overhead
        for r in data["results"]:
            t = r["timing"]
            out[f"{r['case']} / {r['op']} / {r['impl']}"] = _with_spread(
                {"ms": t["median_ms"], "kind": r["kind"]}, t.get("p20_ms"), t.get("p80_ms"))  # fmt: skip
    if isinstance(data.get("rows"), list):  # ddp, fsdp
        for r in data["rows"]:
            if r.get("step_ms") is not None:
                if suite == "fsdp":
                    kind = "peer" if r["case"] == "plain" or r["case"].startswith("torchao") else "ours"
                else:
                    kind = "ours" if str(r["case"]).startswith("torsh") else "peer"
                out[f"{r['case']} / {r.get('buckets', '')}"] = _with_spread(
                    {"ms": r["step_ms"], "kind": kind}, r.get("p20_ms"), r.get("p80_ms"))  # fmt: skip
    for r in data.get("collectives") or []:  # collectives: the communicators' (ours); other transports named
        tr = r.get("transport", "torch")
        key = f"{'' if tr == 'torch' else tr + ' '}{r['op']} {r['size']} B {r.get('type', '')}".strip()
        out[key] = {"ms": r["time_us"] / 1e3, "kind": "ours"}
    for r in data.get("compressed") or []:
        out[f"compressed all-reduce {r['compressor']} {r['size']} B"] = {"ms": r["time_us"] / 1e3, "kind": "ours"}
    return out


@dataclass(kw_only=True, slots=True)
class Baseline:
    """A ``--compare`` baseline, checked: its measurements and the options each suite was run with."""

    path: str
    """Where it was read from."""
    measurements: dict[str, dict[str, dict]]
    """suite -> case -> {"ms", "kind"}."""
    options: dict[str, list[str] | None]
    """suite -> the options it ran with (None: not recorded, a file from before they were)."""


def load_baseline(path: str) -> Baseline:
    """Read and check a baseline (a document of ``torsh bench`` or one suite's JSON); every problem is a
    :class:`~torsh_kernels.cli_common.UsageError` that names the file and what is wrong."""

    def refused(why: str) -> cli_common.UsageError:
        return cli_common.UsageError(f"--compare: {path}: {why}; a baseline is a JSON file `torsh bench --json` wrote")

    try:  # a regular file of bounded size (no FIFO, device or endless stream), read once
        raw = read_capped(path, MAX_BASELINE_BYTES, refused)
    except OSError as e:
        raise cli_common.UsageError(f"--compare: cannot read {path}: {e.strerror or e}") from e
    try:
        data = json.loads(raw)
    except RecursionError:  # nested deeper than the parser goes: no benchmark document is
        raise refused("JSON nested thousands of levels deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise cli_common.UsageError(f"--compare: {path} is not JSON ({e})") from e
    if not isinstance(data, dict):
        raise cli_common.UsageError(f"--compare: {path} holds a JSON {type(data).__name__}, not a benchmark document")
    try:
        if "measurements" in data:  # a document of this command
            meas, docs = data["measurements"], data.get("suites") or {}
            if not isinstance(meas, dict) or not isinstance(docs, dict):
                raise TypeError("'measurements' and 'suites' must be objects")
            options = {s: (docs.get(s) or {}).get("options") for s in meas}
            for s, cases in meas.items():  # the spread, from the suite's results (documents from before
                try:  # measurements carried it too); a suite's results in another form: its medians only
                    full = measurements(s, docs[s]) if isinstance(cases, dict) and isinstance(docs.get(s), dict) else {}
                except (KeyError, TypeError, AttributeError):
                    full = {}
                if full:
                    for case, m in cases.items():
                        f = full.get(case)
                        if isinstance(m, dict) and "p20" not in m and f is not None and f["ms"] == m.get("ms"):
                            _with_spread(m, f.get("p20"), f.get("p80"))
        elif data.get("suite") in SUITE_NAMES:  # one suite's own JSON
            meas = {data["suite"]: measurements(data["suite"], data)}
            options = {data["suite"]: data.get("options")}
        else:
            raise cli_common.UsageError(
                f"--compare: {path} is neither a document of `torsh bench` (it has no 'measurements') nor one "
                f"suite's JSON (its 'suite' is {data.get('suite')!r}; suites: {', '.join(SUITE_NAMES)})"
            )
        for suite, cases in meas.items():
            if suite not in SUITE_NAMES:
                raise TypeError(f"unknown suite {suite!r}")
            for case, m in cases.items():
                ms = m.get("ms")
                if not isinstance(ms, int | float) or isinstance(ms, bool) or not math.isfinite(ms) or ms <= 0:
                    raise TypeError(f"{suite}: {case!r}: 'ms' must be a positive number, got {ms!r}")
                if m.get("kind") not in KINDS:
                    raise TypeError(f"{suite}: {case!r}: 'kind' must be one of {KINDS}, got {m.get('kind')!r}")
                if "p20" in m or "p80" in m:
                    lo, hi = m.get("p20"), m.get("p80")
                    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
                               for v in (lo, hi)) or not lo <= ms <= hi:  # fmt: skip
                        raise TypeError(f"{suite}: {case!r}: 'p20' <= 'ms' <= 'p80' must be times in ms, got "
                                        f"{lo!r}, {ms!r}, {hi!r}")  # fmt: skip
        for suite, opts in options.items():
            if opts is not None and not (isinstance(opts, list) and all(isinstance(o, str) for o in opts)):
                raise TypeError(f"{suite}: 'options' must be a list of strings, got {opts!r}")
    except (KeyError, TypeError, AttributeError) as e:
        raise cli_common.UsageError(f"--compare: {path} is not in the form `torsh bench` writes: {e}") from e
    return Baseline(path=path, measurements=meas, options=options)


class Comparison(NamedTuple):
    rows: list[tuple]
    """(suite, case, kind, baseline ms, current ms, ratio) of every case measured in both."""
    regressions: list[tuple]
    """The rows of ours judged slower than allowed: the median beyond ``max_regression`` and the p20-p80
    interval wholly above the baseline's (or, where either side recorded no spread, the median alone: those
    rows are also in ``unspread``)."""
    missing: list[tuple[str, str]]
    """(suite, case) of the baseline, of the suites run, not measured now."""
    new: list[tuple[str, str]]
    """(suite, case) measured now that the baseline does not have."""
    noisy: list[tuple]
    """The rows of ours whose median is slower than allowed but that cannot be judged a regression: their
    interval overlaps the baseline's, or the peers and copies of the same case slowed as much (``machine``)."""
    unspread: list[tuple]
    """The regressions judged on medians alone (no p20/p80 recorded on one side)."""
    machine: dict[tuple[str, str], float]
    """(suite, case) of the noisy rows whose case's peers and copies (timed interleaved with them) slowed by
    as much: their median slowdown."""


def _group(case: str) -> str | None:
    """The part of a case's key its peers share: ``case`` of ``case / op / impl`` (the timed suites, whose
    implementations of a case are timed interleaved); None for the other suites' keys."""
    parts = case.split(" / ")
    return parts[0] if len(parts) >= 3 else None


def machine_factor(rows: list[tuple], suite: str, case: str) -> float | None:
    """How much slower the machine ran ``case`` (of ``suite``) than the baseline's did, as the case's peers
    and copy baseline (timed interleaved with ours in the same run) show it: the median of their now/baseline
    ratios; None where the case has none."""
    g = _group(case)
    if g is None:
        return None
    ratios = [r[5] for r in rows if r[0] == suite and r[2] != "ours" and _group(r[1]) == g]
    return statistics.median(ratios) if ratios else None


def _timing(m: dict) -> Timing | None:
    if "p20" not in m or "p80" not in m:
        return None
    return Timing(median_ms=m["ms"], p20_ms=m["p20"], p80_ms=m["p80"], reps=0)


def compare(current: dict[str, dict], base: dict[str, dict], max_regression: float) -> Comparison:
    """Compare ``current`` with ``base`` (both suite -> case -> {"ms", "kind"} and, where recorded, "p20" and
    "p80"), suite by suite; the rule for a regression is :func:`~torsh_kernels.env.compare_spread`'s."""
    rows, bad, new, noisy, unspread = [], [], [], [], []
    for suite, cases in current.items():
        for case, m in cases.items():
            b = base.get(suite, {}).get(case)
            if b is None:
                new.append((suite, case))
                continue
            ratio = m["ms"] / b["ms"]
            row = (suite, case, m["kind"], b["ms"], m["ms"], ratio)
            rows.append(row)
            if m["kind"] != "ours" or not ratio > 1 + max_regression:
                continue
            now, then = _timing(m), _timing(b)
            if now is None or then is None:
                bad.append(row)
                unspread.append(row)
            elif compare_spread(now, then, margin=max_regression).verdict == "slower":
                bad.append(row)
            else:
                noisy.append(row)
    machine: dict[tuple[str, str], float] = {}
    for row in list(bad):  # a slowdown the peers of its case share is the machine's, not ours
        f = machine_factor(rows, row[0], row[1])
        if f is not None and f > 1 and row[5] / f <= 1 + max_regression:
            bad.remove(row)
            noisy.append(row)
            machine[(row[0], row[1])] = f
    missing = [(s, c) for s in current for c in base.get(s, {}) if c not in current[s]]
    return Comparison(rows, bad, missing, new, noisy, [r for r in unspread if r in bad], machine)


def _percent(text: str) -> float:
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a percentage like 10% (or a fraction like 0.1), got {text!r}"
        ) from None
    if not v >= 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def _suite_args(text: str) -> tuple[str, list[str]]:
    name, eq, opts = text.partition("=")
    if not eq or name.strip() not in SUITE_NAMES:
        raise argparse.ArgumentTypeError(f'expected SUITE="OPTIONS" with SUITE one of {", ".join(SUITE_NAMES)}, '
                                         f"got {text!r}")  # fmt: skip
    try:
        return name.strip(), shlex.split(opts)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="*", metavar="SUITE",
                   help=f"suites to run (default: all of {', '.join(SUITE_NAMES)}; with --compare, those of the "
                   "baseline)")  # fmt: skip
    cli_common.add_json(p, "the combined results")
    p.add_argument("--compare", default=None, metavar="BASELINE",
                   help="a JSON of this command or of one suite to compare with; a regression exits with "
                   "status 1")  # fmt: skip
    p.add_argument("--max-regression", default=0.1, type=_percent,
                   help="allowed slowdown of our cases (default 10%%)")  # fmt: skip
    add_device(p)
    p.add_argument("--full", action="store_true", help="the suites' full default sizes also on a CPU")
    p.add_argument("--ncu", action="store_true",
                   help="also profile the fused kernels under Nsight Compute (DRAM throughput, occupancy)")  # fmt: skip
    p.add_argument("--args", action="append", default=[], metavar='SUITE="OPTIONS"', type=_suite_args,
                   help='extra options for one suite, e.g. --args moe="--experts 8"')  # fmt: skip


def _measurement_options(parser: argparse.ArgumentParser, recorded: list[str], suite: str) -> list[str]:
    """The options a baseline recorded for ``suite``, re-derived from what the suite's parser makes of them with
    every output left out: a baseline says how to measure, never where to write (``--json`` and any other output
    option it holds is dropped, and said so), so a crafted baseline cannot overwrite a file."""
    ns = parser.parse_args(recorded)  # (a bad one: the suite's parser says so in one line, exit status 2)
    dropped = sorted(d for d in OUTPUT_OPTIONS if getattr(ns, d, None) is not None)
    if dropped:
        names = ", ".join("--" + d.replace("_", "-") for d in dropped)
        print(f"torsh bench: --compare: ignored the baseline's output option(s) for {suite}: {names} (a baseline "
              "sets how to measure, not where to write)", file=sys.stderr)  # fmt: skip
    return cli_common.argv_of(parser, ns, skip=OUTPUT_OPTIONS)


def _plan(args: argparse.Namespace, baseline: Baseline | None) -> list[tuple[str, object, argparse.Namespace]]:
    """Each suite to run with its parsed options; a bad option stops here, before anything runs."""
    suites = list(dict.fromkeys(args.suites))
    if args.json in SUITE_NAMES and not Path(args.json).exists():
        # `torsh bench --json ddp` reads ddp as --json's PATH: say so rather than run every suite into ./ddp
        name = args.json
        raise cli_common.UsageError(f"--json {name}: {name} is a suite; to run it with JSON on stdout write "
                              f"`torsh bench {name} --json` (--json=./{name} for a file of that name)")  # fmt: skip
    unknown = [s for s in suites if s not in SUITE_NAMES]
    if unknown:
        raise cli_common.UsageError(f"unknown suite(s) {', '.join(unknown)}; suites: {', '.join(SUITE_NAMES)}")
    if baseline is not None:
        suites = suites or [s for s in SUITE_NAMES if s in baseline.measurements]
        missing = [s for s in suites if not baseline.measurements.get(s)]
        if missing:
            held = ", ".join(s for s in SUITE_NAMES if baseline.measurements.get(s)) or "none"
            raise cli_common.UsageError(f"--compare: the baseline {baseline.path} holds no measurement of "
                                  f"{', '.join(missing)} (it holds: {held}); name only suites it holds, or make a "
                                  "baseline with them")  # fmt: skip
        replayed = [s for s in suites if baseline.options.get(s) is not None]
        if args.full and replayed:
            raise cli_common.UsageError(f"--full: {', '.join(replayed)} run with the options the baseline recorded; "
                                        "drop --full (--args adds options)")  # fmt: skip
    suites = suites or list(SUITE_NAMES)
    extra: dict[str, list[str]] = {}
    for name, opts in args.args:
        extra.setdefault(name, []).extend(opts)
    device = resolve_device(args.device)
    quick = device.type == "cpu" and not args.full
    plan = []
    for name in suites:
        mod = suite_module(name)
        parser = cli_common.Parser(prog=f"torsh bench {name}")
        mod.add_arguments(parser)
        recorded = baseline.options.get(name) if baseline is not None else None
        if recorded is not None:
            argv = _measurement_options(parser, recorded, name)
            argv += ["--device", str(device)] if args.device and name in HAS_DEVICE else []
        else:
            argv = QUICK[name] if quick else FULL.get(name, [])
            argv = argv + (["--device", str(device)] if name in HAS_DEVICE else [])
        ns = parser.parse_args(argv + extra.get(name, []))
        ns.options = cli_common.argv_of(parser, ns, skip={"json"})
        plan.append((name, mod, ns))
    return plan


def run(args: argparse.Namespace) -> int:
    baseline = load_baseline(args.compare) if args.compare else None
    plan = _plan(args, baseline)
    if args.ncu:
        from . import ncu

        why = ncu.unavailable_reason()
        if why is not None:
            raise cli_common.UsageError(f"--ncu cannot run here: {why}")
    device = resolve_device(args.device)
    replayed = baseline is not None and any(baseline.options.get(n) is not None for n, _, _ in plan)
    mode = "baseline's options" if replayed else ("quick" if device.type == "cpu" and not args.full else "full")
    doc = {"suite": "all", **environment(device), "mode": mode, "suites": {}, "measurements": {}}
    for name, mod, ns in plan:
        rc = _run_suite(name, mod, ns, doc)
        if rc != 0:
            return rc
    if args.ncu:
        from . import ncu

        doc["ncu"] = ncu.profile()
        cols = list(dict.fromkeys(k for r in doc["ncu"] for k in r))
        text = [c for c in cols if not all(isinstance(r.get(c), int | float) for r in doc["ncu"])]
        t = cli_common.table("Nsight Compute: fused kernels (triton provider)", cols, text=text)
        for r in doc["ncu"]:
            t.add_row(*(str(r.get(c, "")) for c in cols))
        cli_common.console().print(t)
    if baseline is None:
        cli_common.write_json(args.json, doc)
        return 0

    def remeasure(suites: list[str]) -> dict[str, dict]:
        """Run ``suites`` once more; their measurements (also in the JSON, as ``remeasured``)."""
        again: dict = {"suites": {}, "measurements": {}}
        for name, mod, ns in plan:
            if name in suites:
                print(f"torsh bench: --compare: re-measuring suite {name} (suspect slowdowns must reproduce)",
                      file=sys.stderr)  # fmt: skip
                if _run_suite(name, mod, ns, again) != 0:
                    again["measurements"].pop(name, None)
        doc["remeasured"] = again["measurements"]
        return again["measurements"]

    try:
        rc = report_comparison(doc["measurements"], baseline, args.max_regression, remeasure=remeasure)
    finally:  # the run's results are written even when the comparison fails (nothing matched) or is interrupted
        cli_common.write_json(args.json, doc)
    return rc


def _run_suite(name: str, mod, ns: argparse.Namespace, doc: dict) -> int:
    """Run one suite into ``doc`` (its results and measurements); its exit status."""
    ns.sink = []
    rc = mod.run(ns)
    if rc != 0:
        print(f"torsh bench: suite {name} failed (exit status {rc})", file=sys.stderr)
        return rc
    doc["suites"][name] = ns.sink[-1]
    doc["measurements"][name] = measurements(name, ns.sink[-1])
    return 0


Remeasure = Callable[[list[str]], dict[str, dict]]
"""Runs the named suites again and returns their measurements (suite -> case -> measurement)."""


def judge(current: dict[str, dict], baseline: Baseline, max_reg: float,
          remeasure: Remeasure | None = None) -> tuple[Comparison, list[tuple]]:  # fmt: skip
    """The comparison, with each regression judged on the spread re-measured: where ``remeasure`` is given
    and the comparison finds regressions, it is called with their suites, and a regression stands only if
    the re-measured case is judged slower too (the others join ``noisy``). Also returns the rows whose
    slowdown the re-measurement did not reproduce."""
    c = compare(current, baseline.measurements, max_reg)
    if not c.regressions or remeasure is None:
        return c, []
    again = remeasure(list(dict.fromkeys(r[0] for r in c.regressions)))
    c2 = compare({s: again.get(s, {}) for s in again}, baseline.measurements, max_reg)
    confirmed = {(r[0], r[1]) for r in c2.regressions}
    stands = [r for r in c.regressions if (r[0], r[1]) in confirmed or r[0] not in again]
    gone = [r for r in c.regressions if r not in stands]
    c = c._replace(regressions=stands, noisy=c.noisy + gone, unspread=[r for r in c.unspread if r in stands],
                   machine={**c2.machine, **c.machine})  # fmt: skip
    return c, gone


def report_comparison(current: dict[str, dict], baseline: Baseline, max_reg: float,
                      remeasure: Remeasure | None = None) -> int:  # fmt: skip
    """Print the comparison; the exit status: 0 (no regression judged; cases too noisy to judge are
    named), 1 (a regression of ours, judged beyond the spread and reproduced) or 2 (nothing compared)."""
    c, gone = judge(current, baseline, max_reg, remeasure)
    n_base = sum(len(baseline.measurements.get(s, {})) for s in current)
    if not c.rows:
        have = next((f"{s}: {k!r}" for s in current for k in baseline.measurements.get(s, {})), "none")
        now = next((f"{s}: {k!r}" for s in current for k in current[s]), "none")
        raise cli_common.UsageError(f"--compare: nothing compared: none of the {n_base} cases of {baseline.path} was "
                              f"measured in this run (the baseline has e.g. {have}; this run measured e.g. {now}); "
                              "run the suites with the options the baseline was measured with")  # fmt: skip
    bad = {(r[0], r[1]) for r in c.regressions}
    noisy = {(r[0], r[1]) for r in c.noisy}
    t = cli_common.table(f"compared with {baseline.path} (ours may be at most {100 * max_reg:.0f}% slower, beyond "
                         "the p20-p80 spread)", ["suite", "case", "kind", "baseline", "now", "ratio", "verdict"],
                         text=("suite", "case", "kind", "verdict"))  # fmt: skip
    for suite, case, kind, _, _, ratio in sorted(c.rows, key=lambda r: -r[5])[:40]:
        key = (suite, case)
        verdict = "REGRESSION" if key in bad else ("too noisy to judge" if key in noisy else "")
        style = "bold red" if key in bad else ("yellow" if key in noisy else None)
        t.add_row(suite, case, kind, _cell(baseline.measurements[suite][case]), _cell(current[suite][case]),
                  f"{ratio:.2f}x", verdict, style=style)  # fmt: skip
    cli_common.console().print(t)
    kinds = {k: sum(1 for r in c.rows if r[2] == k) for k in KINDS}
    print(f"compared {len(c.rows)} of the {n_base} cases of the baseline ({kinds['ours']} ours, {kinds['peer']} "
          f"peers, {kinds['copy']} copy baselines)")  # fmt: skip
    if c.missing:
        s, k = c.missing[0]
        print(f"torsh bench: {len(c.missing)} case(s) of the baseline were not measured in this run, e.g. {s}: {k!r}",
              file=sys.stderr)  # fmt: skip
    if c.new:
        s, k = c.new[0]
        print(f"torsh bench: {len(c.new)} case(s) measured now are not in the baseline, e.g. {s}: {k!r}",
              file=sys.stderr)  # fmt: skip
    gone_keys = {(r[0], r[1]) for r in gone}
    for suite, case, _, _, _, ratio in c.noisy:
        f = c.machine.get((suite, case))
        again = (suite, case) in gone_keys
        why = (f"run again, it was slower still, but so were its peers and copy baseline ({f:.2f}x): the machine's "
               "slowdown" if again and f is not None else
               "the slowdown did not reproduce when the suite ran again" if again else
               f"the peers and copy baseline of the same case, timed interleaved with it, slowed by {f:.2f}x: the "
               "machine's slowdown" if f is not None else "the p20-p80 intervals overlap")  # fmt: skip
        print(f"TOO NOISY TO JUDGE {suite}: {case}: {_cell(baseline.measurements[suite][case])} -> "
              f"{_cell(current[suite][case])} (median {100 * (ratio - 1):.0f}% slower, but {why})")  # fmt: skip
    if c.noisy:
        print(f"the machine was too noisy to judge {len(c.noisy)} case(s) of ours: not counted as regressions; "
              "re-run on a quiet machine to judge them")  # fmt: skip
    if c.regressions:
        unspread = {(r[0], r[1]) for r in c.unspread}
        for suite, case, _, b, n, ratio in c.regressions:
            how = ("; no spread recorded: judged on medians" if (suite, case) in unspread else
                   f"; p20-p80 {_cell(baseline.measurements[suite][case], True)} -> "
                   f"{_cell(current[suite][case], True)}")  # fmt: skip
            print(f"REGRESSION {suite}: {case}: {b:.4g} ms -> {n:.4g} ms ({100 * (ratio - 1):.0f}% slower{how})")
        return 1
    print(f"no regression beyond {100 * max_reg:.0f}% (and the spread) in {kinds['ours']} cases of ours")
    return 0


def _cell(m: dict, interval_only: bool = False) -> str:
    """A measurement for the table: its median and, where recorded, its p20-p80 interval."""
    iv = f"{m['p20']:.4g}-{m['p80']:.4g} ms" if "p20" in m and "p80" in m else None
    if interval_only:
        return iv or "-"
    return f"{m['ms']:.4g} ms" + (f" ({iv})" if iv else "")
