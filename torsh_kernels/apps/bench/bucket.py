"""Benchmark of the bucket ops against the PyTorch code they replace.

Cases (fp32 gradients):
  (a) 200 tensors of mixed sizes (log-uniform, fixed seed) totalling 100 MiB;
  (b) 2000 tensors of 4 KiB each.
Peers, measured in the same run:
  flatten:       torch._utils._flatten_dense_tensors (allocates, as DDP/apex use it); torch.cat into a
                 preallocated buffer; a per-tensor copy_ loop into the buffer's slices;
  unflatten:     torch._utils._unflatten_dense_tensors + per-tensor copy_; torch._foreach_copy_;
  bucket_reduce: torch.stack(...).sum(0); a loop of add_ into the output (K = 4 buffers).
Baseline: a plain same-device copy of the bucket's bytes; every figure is also given as a fraction of
that copy's bandwidth (bytes read + written per second).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import torsh_kernels as tk

from ...ops.registry import PROVIDERS, _numba_state, _triton_state, can_run
from . import Case, Result, check_providers, environment, print_tables, write_json

MIB = 1 << 20
K_BUFFERS = 4


def case_sizes(case: str, scale: float = 1.0) -> list[int]:
    """Element counts of the case's fp32 tensors (``scale`` shrinks case a's total, for quick runs)."""
    if case == "a":
        total = int(100 * MIB * scale) // 4
        g = torch.Generator().manual_seed(0)
        w = torch.exp(torch.empty(200, dtype=torch.float64).uniform_(math.log(1e3), math.log(1e7), generator=g))
        sizes = [max(1, int(x)) for x in (w / w.sum() * total).tolist()]
        sizes[-1] += total - sum(sizes)
        return sizes
    if case == "b":
        return [1024] * 2000
    raise ValueError(f"unknown case {case!r}")


CASE_TITLES = {"a": "a: 200 tensors of mixed sizes, 100 MiB", "b": "b: 2000 tensors of 4 KiB (7.8 MiB)"}


def native_providers(device: torch.device) -> list[str]:
    """Providers that run compiled code on ``device`` (not the interpreter or the simulator)."""
    out = []
    for p in PROVIDERS:
        if can_run(p, device) is not None:
            continue
        if p == "triton" and _triton_state()[1]:
            continue
        if p == "numba" and _numba_state()[1]:
            continue
        out.append(p)
    return out


def run_case(case: str, device: torch.device, providers: list[str], reps: int, scale: float) -> list[Result]:
    sizes = case_sizes(case, scale)
    title = CASE_TITLES[case] if scale == 1.0 else f"{case}: {len(sizes)} tensors, {sum(sizes) * 4 / MIB:.1f} MiB"
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=g).to(device) for n in sizes]
    total = sum(sizes)
    nbytes = total * 4
    flat = torch.empty(total, device=device)
    case = Case(title, device)
    add = case.add
    src = torch.randn(total, generator=g).to(device)
    dst = torch.empty_like(src)
    add("copy", "dst.copy_(src)", "copy", lambda: dst.copy_(src), 2 * nbytes)

    # flatten ----------------------------------------------------------------------------------------
    expected = torch.cat(tensors)
    for p in providers:
        tk.flatten(tensors, out=flat, provider=p)
        if not torch.equal(flat, expected):
            raise AssertionError(f"flatten[{p}] gave a wrong result; not timing it")
        add("flatten", f"torsh[{p}]", "ours", lambda p=p: tk.flatten(tensors, out=flat, provider=p), 2 * nbytes)
    add("flatten", "_flatten_dense_tensors", "peer", lambda: _flatten_dense_tensors(tensors), 2 * nbytes)
    add("flatten", "torch.cat(out=)", "peer", lambda: torch.cat(tensors, out=flat), 2 * nbytes)
    slices = flat.split(sizes)

    def copy_loop_in() -> None:
        for s, t in zip(slices, tensors):
            s.copy_(t)

    add("flatten", "per-tensor copy_", "peer", copy_loop_in, 2 * nbytes)

    # unflatten --------------------------------------------------------------------------------------
    _, layout = tk.flatten(tensors, out=flat)
    bucket = torch.randn(total, generator=g).to(device)
    outs = [torch.empty_like(t) for t in tensors]
    for p in providers:
        tk.unflatten(bucket, layout, outs, provider=p)
        if not torch.equal(torch.cat(outs), bucket):
            raise AssertionError(f"unflatten[{p}] gave a wrong result; not timing it")
        add("unflatten", f"torsh[{p}]", "ours", lambda p=p: tk.unflatten(bucket, layout, outs, provider=p), 2 * nbytes)

    def unflatten_dense_copy() -> None:
        for o, v in zip(outs, _unflatten_dense_tensors(bucket, outs)):
            o.copy_(v)

    views = list(bucket.split(sizes))
    add("unflatten", "_unflatten_dense_tensors + copy_", "peer", unflatten_dense_copy, 2 * nbytes)
    add("unflatten", "torch._foreach_copy_", "peer", lambda: torch._foreach_copy_(outs, views), 2 * nbytes)

    # bucket_reduce ----------------------------------------------------------------------------------
    bufs = [torch.randn(total, generator=g).to(device) for _ in range(K_BUFFERS)]
    red = torch.empty(total, device=device)
    moved = (K_BUFFERS + 1) * nbytes
    ref = tk.ops.bucket_reduce_ref(bufs, "sum", torch.float32)
    for p in providers:
        tk.bucket_reduce(bufs, out=red, provider=p)
        torch.testing.assert_close(red, ref, atol=1e-5, rtol=1e-5)
        add("bucket_reduce", f"torsh[{p}] K={K_BUFFERS}", "ours",
            lambda p=p: tk.bucket_reduce(bufs, out=red, provider=p), moved)  # fmt: skip
    add("bucket_reduce", "torch.stack().sum(0)", "peer", lambda: torch.stack(bufs).sum(0), moved)

    def add_loop() -> None:
        red.copy_(bufs[0])
        for b in bufs[1:]:
            red.add_(b)

    add("bucket_reduce", "copy_ + add_ loop", "peer", add_loop, moved)
    results = case.time(reps)
    for r in results:
        r.extra = {"tensors": len(sizes), "bucket_bytes": nbytes}
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--providers", default=None,
                   help="comma-separated providers to time (default: those running compiled code here)")  # fmt: skip
    p.add_argument("--cases", default="a,b", help="comma-separated cases: a, b (default: both)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (default 20 GPU, 7 CPU)")
    p.add_argument("--scale", type=float, default=1.0, help="shrink case a's 100 MiB by this factor (quick runs)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    providers = check_providers("bucket", args.providers, device)
    if providers is None:
        return 2
    if not 0 < args.scale <= 1:
        print(f"torsh bench bucket: --scale must be in (0, 1], got {args.scale}", file=sys.stderr)
        return 2
    reps = args.reps or (20 if device.type == "cuda" else 7)
    env = environment(device)
    results: list[Result] = []
    for case in args.cases.split(","):
        results += run_case(case.strip(), device, providers, reps, args.scale)
    print_tables(results, "torsh bench bucket", env)
    if args.json_path:
        config = {"providers": providers, "reps": reps, "scale": args.scale, "k_buffers": K_BUFFERS}
        write_json(args.json_path, "bucket", env, results, config)
        print(f"wrote {args.json_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_bucket", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(parser)
    return run(parser.parse_args(argv))
