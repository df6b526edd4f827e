"""`torsh tune`: tune ops with a progress bar, then one table per op; `--show` prints the cache, `--clear`
removes it."""

from __future__ import annotations

import argparse
import sys

import torch

from ..profiling import autotune as A

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _sizes(text: str) -> list[int]:
    out = []
    for s in text.split(","):
        s = s.strip()
        out.append(2 ** int(s[2:]) if s.startswith("2^") else int(s))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default="bucket,compression",
                   help="comma-separated ops or families (bucket, compression; default: both)")  # fmt: skip
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated dtypes: fp32, fp16, bf16 (default fp32,bf16)")
    p.add_argument("--sizes", default=None,
                   help="element counts, e.g. 2^16,2^20 (default: 2^20,2^24,2^26 CUDA; 2^16,2^20 CPU)")  # fmt: skip
    p.add_argument("--budget", type=float, default=60.0, help="seconds for the whole run (default 60)")
    p.add_argument("--strategy", default="exhaustive", choices=A.STRATEGIES, help="search strategy")
    p.add_argument("--providers", default=None,
                   help="providers to consider (default: those running compiled code on the device)")  # fmt: skip
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per candidate")
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
            raise ValueError(
                f"unknown op or family {name!r}; ops: {', '.join(sorted(sp))}; families: {', '.join(families)}"
            )
    return list(dict.fromkeys(out))


def show(console) -> int:
    from rich.table import Table

    path = A.cache_path()
    data = A.load_cache(path)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    current, _ = A.environment_key(dev)
    console.print(f"tuning cache: {path}" + ("" if path.exists() else " (empty)"))
    for key, env in data["environments"].items():
        state = "current" if key == current else "stale (another device or versions)"
        t = Table(title=f"{key}  ({state})", title_justify="left")
        for col in ("op | dtype | bucket", "winner", "time", "default", "speedup", "tuned", "synced from"):
            t.add_column(col, no_wrap=col in ("op | dtype | bucket", "winner"))
        for ek, e in sorted(env["entries"].items()):
            meta = ", ".join(f"{k}={v}" for k, v in sorted((e.get("meta") or {}).items()))
            win = f"{e['provider']}({meta})" if meta else e["provider"]
            sp = f"{e['default_ms'] / e['median_ms']:.2f}x" if e.get("default_ms") and e.get("median_ms") else "-"
            src = "-" if e.get("synced_from_rank") is None else f"rank {e['synced_from_rank']}"
            t.add_row(ek, win, f"{e['median_ms']:.4f} ms", e.get("default", "-"), sp, e.get("tuned_at", ""), src)
        console.print(t)
    return 0


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .._env import wide_console

    console = wide_console(140)
    if args.clear:
        path = A.cache_path()
        existed = path.exists()
        path.unlink(missing_ok=True)
        console.print(f"{'removed' if existed else 'no cache at'} {path}")
        return 0
    if args.show:
        return show(console)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        ops = _ops(args.ops)
        dtypes = [DTYPES[d.strip()] for d in args.dtypes.split(",")]
        sizes = (
            _sizes(args.sizes) if args.sizes else ([2**20, 2**24, 2**26] if device.type == "cuda" else [2**16, 2**20])
        )
        providers = args.providers.split(",") if args.providers else None
        tuner = A.Tuner(device, providers=providers, strategy=args.strategy, budget_s=args.budget, reps=args.reps)
    except (ValueError, KeyError) as e:
        print(f"torsh tune: {e}", file=sys.stderr)
        return 2
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
        t = Table(title=op, title_justify="left")
        for col in ("dtype", "bucket", "winner", "time", "default", "speedup", "timed/pruned/dropped", "source"):
            t.add_column(col)
        for r in rows:
            sp = f"{r.speedup:.2f}x" if r.speedup else "-"
            t.add_row(str(r.dtype).removeprefix("torch."), f"2^{r.bucket}", str(r.winner),
                      f"{r.winner_ms:.4f} ms" if r.winner_ms else "-",
                      f"{r.default} {r.default_ms:.4f} ms" if r.default_ms else str(r.default), sp,
                      "-" if r.cached else f"{len(r.timings)}/{len(r.pruned)}/{len(r.dropped)}",
                      f"cache (tuned {r.tuned_at})" if r.cached else "tuned now")  # fmt: skip
        console.print(t)
    left = len(ops) * len(dtypes) * len(sizes) - len(results)
    if left > 0:
        console.print(f"budget spent: {left} (op, dtype, size) combinations left untuned; run again to resume")
    console.print(f"cache: {A.cache_path()}")
    return 0
