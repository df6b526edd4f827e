"""`torsh bench [SUITE ...] [--json PATH] [--compare BASELINE.json --max-regression 10%]`: every suite
through one harness.

Runs the named suites (default: all of bucket, compression, collectives, ddp, fsdp, moe, offload, trace,
overhead), each with its own tables, then writes one JSON document: the environment (device, versions,
date, git commit), each suite's full results, and a flat ``measurements`` map per suite (case -> median time in ms and
whether it is ours or a peer's) that ``--compare`` reads. With ``--compare BASELINE.json`` (a document
from this command, or one suite's own JSON), every measurement of ours present in both is compared; one
slower than the baseline by more than ``--max-regression`` (default 10%) is a regression: the command
names each such case and exits with status 1. Peers are listed but never fail the run (their change is
the machine's, not ours).

``--ncu`` adds hardware counters of the fused kernels (Nsight Compute through nsight-python, the
``nsight`` extra): DRAM throughput and occupancy per kernel; where ``ncu``, nsight-python or a GPU is
missing it says which and exits with status 2.

Sizes: on a GPU the suites' own defaults; on a CPU, unless ``--full``, the reduced settings in
:data:`QUICK` (the full CPU run takes most of an hour). ``--args SUITE="..."`` passes options to a suite.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from . import environment, wide_console

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
}
SUITE_NAMES = tuple(SUITES)

# Reduced settings for CPU runs (each a few seconds to a minute on 2 cores).
QUICK: dict[str, list[str]] = {
    "bucket": ["--cases", "a,b", "--scale", "0.05", "--reps", "5"],
    "compression": ["--sizes", "1", "--ortho-batch", "8", "--ortho-rows", "256", "--reps", "5"],
    "collectives": ["--sizes", "64K,1M", "--compress-sizes", "1M", "--reps", "3"],
    "ddp": ["--width", "256", "--layers", "2", "--steps", "4", "--no-torch-powersgd-buckets"],
    "fsdp": ["--width", "256", "--layers", "2", "--steps", "3"],
    "moe": ["--tokens", "2048", "--hidden", "512", "--reps", "5"],
    "offload": ["--sizes", "16", "--width", "512", "--layers", "4", "--steps", "3", "--reps", "5"],
    "trace": ["--calls", "50000", "--reps", "5"],
    "overhead": ["--calls", "100", "--reps", "7"],
}
HAS_DEVICE = ("bucket", "compression", "moe", "offload")


def suite_module(name: str):
    """The module of a suite: ``add_arguments(parser)`` and ``run(args)``."""
    return importlib.import_module(f"{__package__}.{name}")


def measurements(suite: str, data: dict) -> dict[str, dict]:
    """One suite's JSON as {case: {"ms": median, "kind": "ours" | "peer" | "copy"}}."""
    out: dict[str, dict] = {}
    if isinstance(data.get("results"), list):  # bucket, compression, moe, offload
        for r in data["results"]:
            out[f"{r['case']} / {r['op']} / {r['impl']}"] = {"ms": r["timing"]["median_ms"], "kind": r["kind"]}
    if isinstance(data.get("rows"), list):  # ddp, fsdp
        for r in data["rows"]:
            if r.get("step_ms") is not None:
                if suite == "fsdp":
                    kind = "peer" if r["case"] == "plain" else "ours"
                else:
                    kind = "ours" if str(r["case"]).startswith("torsh") else "peer"
                out[f"{r['case']} / {r.get('buckets', '')}"] = {"ms": r["step_ms"], "kind": kind}
    for r in data.get("collectives") or []:  # collectives: the communicators' (ours); other transports named
        tr = r.get("transport", "torch")
        key = f"{'' if tr == 'torch' else tr + ' '}{r['op']} {r['size']} B {r.get('type', '')}".strip()
        out[key] = {"ms": r["time_us"] / 1e3, "kind": "ours"}
    for r in data.get("compressed") or []:
        out[f"compressed all-reduce {r['compressor']} {r['size']} B"] = {"ms": r["time_us"] / 1e3, "kind": "ours"}
    return out


def compare(current: dict, baseline: dict, max_regression: float) -> tuple[list[tuple], list[tuple]]:
    """(rows compared, regressions): rows are (suite, case, kind, baseline ms, current ms, ratio)."""
    if "measurements" in baseline:
        base = baseline["measurements"]
    elif "suite" in baseline:  # one suite's own JSON
        base = {baseline["suite"]: measurements(baseline["suite"], baseline)}
    else:
        raise ValueError("the baseline is neither a `torsh bench` document nor a suite's JSON")
    rows, bad = [], []
    for suite, cases in current["measurements"].items():
        for case, m in cases.items():
            b = base.get(suite, {}).get(case)
            if b is None or not b.get("ms") or m.get("kind") == "copy":
                continue
            ratio = m["ms"] / b["ms"]
            row = (suite, case, m["kind"], b["ms"], m["ms"], ratio)
            rows.append(row)
            if m["kind"] == "ours" and ratio > 1 + max_regression:
                bad.append(row)
    return rows, bad


def _percent(text: str) -> float:
    t = text.strip()
    v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    if v < 0:
        raise ValueError(f"--max-regression must be >= 0, got {text}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="*", help=f"suites to run (default: all of {', '.join(SUITE_NAMES)})")
    p.add_argument("--json", dest="json_path", default=None, help="write the combined results here")
    p.add_argument("--compare", default=None, help="baseline JSON to compare with; regressions exit with status 1")
    p.add_argument("--max-regression", default="10%", help="allowed slowdown of our cases (default 10%%)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--full", action="store_true", help="the suites' full default sizes also on a CPU")
    p.add_argument("--ncu", action="store_true",
                   help="also profile the fused kernels under Nsight Compute (DRAM throughput, occupancy)")  # fmt: skip
    p.add_argument("--args", action="append", default=[], metavar='SUITE="OPTIONS"',
                   help='extra options for one suite, e.g. --args moe="--experts 8"')  # fmt: skip


def run(args: argparse.Namespace) -> int:
    suites = args.suites or list(SUITE_NAMES)
    unknown = [s for s in suites if s not in SUITE_NAMES]
    if unknown:
        print(f"torsh bench: unknown suite(s) {unknown}; suites: {', '.join(SUITE_NAMES)}", file=sys.stderr)
        return 2
    try:
        max_reg = _percent(args.max_regression)
        extra = {}
        for a in args.args:
            name, _, opts = a.partition("=")
            extra[name.strip()] = shlex.split(opts)
        baseline = json.loads(Path(args.compare).read_text()) if args.compare else None
    except (ValueError, OSError) as e:
        print(f"torsh bench: {e}", file=sys.stderr)
        return 2
    if args.ncu:
        from . import ncu

        why = ncu.unavailable_reason()
        if why is not None:
            print(f"torsh bench --ncu cannot run here: {why}", file=sys.stderr)
            return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = device.type == "cpu" and not args.full
    doc = {"suite": "all", **environment(device), "mode": "quick" if quick else "full", "suites": {},
           "measurements": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="torsh-bench-") as tmp:
        for name in suites:
            mod = suite_module(name)
            parser = argparse.ArgumentParser(prog=f"torsh bench {name}")
            mod.add_arguments(parser)
            argv = (QUICK[name] if quick else []) + extra.get(name, []) + ["--json", str(Path(tmp) / f"{name}.json")]
            if name in HAS_DEVICE:
                argv += ["--device", device.type]
            rc = mod.run(parser.parse_args(argv))
            if rc != 0:
                print(f"torsh bench: suite {name} failed (exit status {rc})", file=sys.stderr)
                return rc
            data = json.loads((Path(tmp) / f"{name}.json").read_text())
            doc["suites"][name] = data
            doc["measurements"][name] = measurements(name, data)
    if args.ncu:
        from rich.table import Table

        from . import ncu

        doc["ncu"] = ncu.profile()
        t = Table(title="Nsight Compute: fused kernels (triton provider)", title_justify="left")
        cols = list(dict.fromkeys(k for r in doc["ncu"] for k in r))
        for c in cols:
            t.add_column(c)
        for r in doc["ncu"]:
            t.add_row(*(str(r.get(c, "")) for c in cols))
        wide_console(140).print(t)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json_path}")
    if baseline is None:
        return 0
    try:
        rows, bad = compare(doc, baseline, max_reg)
    except ValueError as e:
        print(f"torsh bench: {e}", file=sys.stderr)
        return 2
    from rich.table import Table

    t = Table(title=f"compared with {args.compare} (ours may be at most {100 * max_reg:.0f}% slower)",
              title_justify="left")  # fmt: skip
    for col in ("suite", "case", "kind", "baseline", "now", "ratio"):
        t.add_column(col, justify="right" if col in ("baseline", "now", "ratio") else "left")
    for suite, case, kind, b, n, ratio in sorted(rows, key=lambda r: -r[5])[:40]:
        style = "bold red" if (kind == "ours" and ratio > 1 + max_reg) else None
        t.add_row(suite, case, kind, f"{b:.4g} ms", f"{n:.4g} ms", f"{ratio:.2f}x", style=style)
    wide_console(140).print(t)
    if not rows:
        print("torsh bench: no case of the baseline was measured in this run; nothing compared", file=sys.stderr)
        return 2
    if bad:
        for suite, case, _, b, n, ratio in bad:
            print(f"REGRESSION {suite}: {case}: {b:.4g} ms -> {n:.4g} ms ({100 * (ratio - 1):.0f}% slower)")
        return 1
    print(f"no regression beyond {100 * max_reg:.0f}% in {sum(1 for r in rows if r[2] == 'ours')} cases of ours")
    return 0
