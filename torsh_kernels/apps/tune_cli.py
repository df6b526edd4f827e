"""`torsh tune`: tune ops with a progress bar, then one table per op; `--show` prints the cache, `--clear`
removes it.

`--providers` names the providers to consider; one that cannot run on the device here is refused with the
reason and how to enable it (Triton without a GPU needs TRITON_INTERPRET=1, Numba without CUDA needs
NUMBA_ENABLE_CUDASIM=1: both slow, for checking rather than speed). By default the providers that run
compiled code on the device are tuned, and the others are named on one line.

The table's ``verdict`` says why the winner is what it is: ``faster`` (it beat the default beyond the
measured spread, twice), ``within noise: default kept`` (the fastest by median, named with its p20-p80
interval and the default's, did not), ``default`` (the default was the fastest).
"""

from __future__ import annotations

import argparse

import torch

from .. import cli_common
from ..profiling import autotune as A
from .bench import add_device, add_providers, resolve_device, select_providers

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _sizes(text: str) -> list[int]:
    out = []
    for s in text.split(","):
        s = s.strip()
        try:
            v = 2 ** int(s[2:]) if s.startswith("2^") else int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected element counts like 2^16,1000000, got {s!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"element counts must be >= 1, got {s!r}")
        out.append(v)
    return out


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default="bucket,compression",
                   help="comma-separated ops or families (bucket, compression; default: both)")  # fmt: skip
    p.add_argument("--dtypes", default=["fp32", "bf16"], type=cli_common.choice_list(DTYPES, "dtype"),
                   help="comma-separated dtypes: fp32, fp16, bf16 (default fp32,bf16)")  # fmt: skip
    p.add_argument("--sizes", default=None, type=_sizes,
                   help="element counts, e.g. 2^16,2^20 (default: 2^20,2^24,2^26 CUDA; 2^16,2^20 CPU)")  # fmt: skip
    p.add_argument("--budget", type=_seconds, default=60.0, help="seconds for the whole run (default 60)")
    p.add_argument("--strategy", default="exhaustive", choices=A.STRATEGIES, help="search strategy")
    add_providers(p, "consider")
    add_device(p)
    p.add_argument("--reps", type=cli_common.int_at_least(1), default=None, help="timed repetitions per candidate")
    p.add_argument("--force", action="store_true", help="re-tune entries already in the cache")
    p.add_argument("--show", action="store_true", help="print the cache and exit")
    p.add_argument("--clear", action="store_true", help="delete the cache and exit")


def _ops(text: str) -> list[str]:
    sp = A.spaces()
    out: list[str] = []
    for name in (s.strip() for s in text.split(",")):
        fam = [op for op, s in sp.items() if s.family == name]
        if name in sp:
            out.append(name)
        elif fam:
            out += fam
        else:
            families = sorted({s.family for s in sp.values()})
            raise cli_common.UsageError(
                f"--ops: unknown op or family {name!r}; ops: {', '.join(sorted(sp))}; families: {', '.join(families)}"
            )
    return list(dict.fromkeys(out))


def verdict_text(verdict: str | None, fastest: str | None, timings: dict | None, default: str | None) -> str:
    """The table's verdict cell: why the winner is what it is (see the module docstring)."""
    if verdict is None:
        return "-"  # an entry from before verdicts were recorded
    if verdict != "within noise":
        return verdict
    t = (timings or {}).get(fastest or "")
    d = (timings or {}).get(default or "")
    if not (t and d):
        return f"within noise: default kept ({fastest} not faster beyond the spread)"
    return (f"within noise: default kept ({fastest} {t['p20_ms']:.4g}-{t['p80_ms']:.4g} ms vs {default} "
            f"{d['p20_ms']:.4g}-{d['p80_ms']:.4g} ms, p20-p80)")  # fmt: skip


def show(console) -> int:
    path = A.cache_path()
    data = A.load_cache(path)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    current, _ = A.environment_key(dev)
    console.print(f"tuning cache: {path}" + ("" if path.exists() else " (empty)"))
    for key, env in data["environments"].items():
        state = "current" if key == current else "stale (another device or versions)"
        t = cli_common.table(f"{key}  ({state})",
                       ["op | dtype | bucket", "winner", "time", "default", "speedup", "verdict", "tuned",
                        "synced from"], text=("winner", "default", "verdict", "tuned", "synced from"))  # fmt: skip
        for ek, e in sorted(env["entries"].items()):
            meta = ", ".join(f"{k}={v}" for k, v in sorted((e.get("meta") or {}).items()))
            win = f"{e['provider']}({meta})" if meta else e["provider"]
            sp = f"{e['default_ms'] / e['median_ms']:.2f}x" if e.get("default_ms") and e.get("median_ms") else "-"
            verdict = verdict_text(e.get("verdict"), e.get("fastest"), e.get("candidates"), e.get("default"))
            src = "-" if e.get("synced_from_rank") is None else f"rank {e['synced_from_rank']}"
            ms = "-" if e.get("median_ms") is None else f"{e['median_ms']:.4f} ms"  # hand-written: may be absent
            t.add_row(ek, win, ms, e.get("default", "-"), sp, verdict, e.get("tuned_at", ""), src)
        console.print(t)
    return 0


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = cli_common.console()
    if args.clear:
        path = A.cache_path()
        existed = path.exists()
        path.unlink(missing_ok=True)
        console.print(f"{'removed' if existed else 'no cache at'} {path}")
        return 0
    if args.show:
        return show(console)
    device = resolve_device(args.device)
    ops = _ops(args.ops)
    dtypes = [DTYPES[d] for d in args.dtypes]
    sizes = args.sizes or ([2**20, 2**24, 2**26] if device.type == "cuda" else [2**16, 2**20])
    from ..ops.common import device_bytes

    if max(sizes) * 8 > device_bytes(device):  # (an fp32 input and its output, at least)
        raise cli_common.UsageError(f"--sizes: {max(sizes)} elements do not fit in the {device.type} memory "
                              f"({device_bytes(device) / 2**30:.4g} GiB)")  # fmt: skip
    providers = select_providers("torsh tune", args.providers, device, verb="tuning")
    tuner = A.Tuner(device, providers=providers, strategy=args.strategy, budget_s=args.budget, reps=args.reps)
    console.print(f"tuning {', '.join(ops)} on {A.environment_key(device)[1]['device']} with providers "
                  f"{', '.join(tuner.providers)}, strategy {args.strategy}, budget {args.budget:g} s; "
                  f"cache {A.cache_path()}")  # fmt: skip
    total = sum(len(A.spaces()[op].candidates(tuner.providers)) for op in ops) * len(dtypes) * len(sizes)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:  # fmt: skip
        task = bar.add_task("tuning", total=total)
        results = tuner.tune(ops, dtypes, sizes, force=args.force,
                             progress=lambda what: bar.update(task, advance=1, description=what[:60]))  # fmt: skip
    for op in ops:
        rows = [r for r in results if r.op == op]
        if not rows:
            continue
        cols = ["dtype", "bucket", "winner", "time", "default", "speedup", "verdict", "timed/pruned/dropped", "source"]
        t = cli_common.table(op, cols, text=("dtype", "winner", "default", "verdict", "source"))
        for r in rows:
            sp = f"{r.speedup:.2f}x" if r.speedup else "-"
            t.add_row(str(r.dtype).removeprefix("torch."), f"2^{r.bucket}", str(r.winner),
                      f"{r.winner_ms:.4f} ms" if r.winner_ms else "-",
                      f"{r.default} {r.default_ms:.4f} ms" if r.default_ms else str(r.default), sp,
                      verdict_text(r.verdict, r.fastest, r.timings, str(r.default)),
                      "-" if r.cached else f"{len(r.timings)}/{len(r.pruned)}/{len(r.dropped)}",
                      f"cache (tuned {r.tuned_at})" if r.cached else "tuned now")  # fmt: skip
        console.print(t)
    left = len(ops) * len(dtypes) * len(sizes) - len(results)
    if left > 0:
        console.print(f"budget spent: {left} (op, dtype, size) combinations left untuned; run again to resume")
    console.print(f"cache: {A.cache_path()}")
    return 0
