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

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import torsh_kernels as tk

from ... import cli_common
from . import (
    Case,
    Result,
    add_device,
    add_providers,
    emit,
    environment,
    print_tables,
    resolve_device,
    result_doc,
    select_providers,
)

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


CASES = ("a", "b")


def case_title(case: str, sizes: list[int]) -> str:
    """The case's name in tables and JSON (its key in a --compare baseline): one form at every --scale, so
    that a case measured twice with the same tensors has the same name."""
    if case == "a":
        return f"a: {len(sizes)} tensors of mixed sizes, {sum(sizes) * 4 / MIB:.3g} MiB"
    return f"b: {len(sizes)} tensors of 4 KiB ({sum(sizes) * 4 / MIB:.1f} MiB)"


def run_case(case: str, device: torch.device, providers: list[str], reps: int, scale: float) -> list[Result]:
    sizes = case_sizes(case, scale)
    title = case_title(case, sizes)
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


def _scale(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a factor in (0, 1], got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    add_providers(p)
    p.add_argument("--cases", default=list(CASES), type=cli_common.choice_list(CASES, "case"),
                   help="comma-separated cases: a, b (default: both)")  # fmt: skip
    p.add_argument("--reps", type=cli_common.int_at_least(1), default=None,
                   help="timed repetitions per measurement (default 20 GPU, 7 CPU)")  # fmt: skip
    p.add_argument("--scale", type=_scale, default=1.0, help="shrink case a's 100 MiB by this factor (quick runs)")
    cli_common.add_json(p)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    providers = select_providers("torsh bench bucket", args.providers, device)
    reps = args.reps or (20 if device.type == "cuda" else 7)
    env = environment(device)
    results: list[Result] = []
    for case in args.cases:
        results += run_case(case, device, providers, reps, args.scale)
    print_tables(results, "torsh bench bucket", env)
    config = {"providers": providers, "reps": reps, "scale": args.scale, "k_buffers": K_BUFFERS}
    emit(args, result_doc("bucket", env, results, config))
    return 0
