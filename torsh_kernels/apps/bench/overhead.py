"""What a public op call costs on the host: every public op at a tiny size, beside its plain-torch equivalent.

At tiny sizes the kernel is nothing and the call is everything: validation, provider selection, custom-op
dispatch, allocation. Each case times the public op (``torsh_kernels.<op>``, provider chosen
automatically unless ``--provider`` is given) and the plain PyTorch that computes the same thing, in
loops of ``--calls`` calls, ``--reps`` loops each, the two interleaved (rotating order) so that drift in
clock speed or load falls on both alike; no cache flushes (they would dwarf a call of a few
microseconds); one torch thread unless ``--threads`` says otherwise. Reported: microseconds per call
(median over the loops, p20-p80 spread) and the ratio ours / torch. The two bucket cases at
2000 x 4 KiB (flatten into ``out``, unflatten into the tensors) measure the per-tensor cost instead.

The torch equivalents are named in the table; they are what a user would write by hand (e.g. flatten:
``torch.cat(out=)``; unflatten: ``torch._foreach_copy_`` into the bucket's views; quantize: a blockwise
absmax int8 quantizer of five torch ops; topk_compress: ``torch.topk`` on ``abs`` and a gather), without
the op's validation, non-finite checks, residual handling or its exact rounding rules. The MoE ops also
run "with grad": logits and activations that require grad, as in a training step's forward (autograd's
graph is built on both sides; no backward runs).

Targets (issue 19): every tiny call <= 15 us and <= 5x its torch equivalent; the 2000 x 4 KiB flatten and
unflatten within 1.3x of theirs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from ... import cli_common, ops
from ...ops import registry
from . import Result, Timing, emit, environment, quantile, result_doc

TARGET_US = 15.0
TARGET_RATIO = 5.0
TARGET_BULK_RATIO = 1.3
BULK = "2000 x 4 KiB"
GRAD = "with grad"  # cases on a differentiable path: reported beside the others, without a target


def _loop_us(fn: Callable[[], object], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def _time_pair(fns: list[Callable[[], object]], calls: int, reps: int) -> list[list[float]]:
    """Per-call microseconds of each function: ``reps`` loops of ``calls`` calls, interleaved."""
    for fn in fns:  # warm up (first-call caches, allocator)
        _loop_us(fn, max(2, calls // 5))
    out: list[list[float]] = [[] for _ in fns]
    for rep in range(reps):
        for j in range(len(fns)):
            i = (rep + j) % len(fns)
            out[i].append(_loop_us(fns[i], calls))
    return out


_Case = tuple[str, str, Callable[[], object], str, Callable[[], object], str]


def cases(provider: str | None) -> list[tuple[str, str, Callable[[], object], str, Callable[[], object], str]]:
    """(op, case, ours, torch equivalent's name, torch equivalent, selection key op) for every public op."""
    p = provider
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    out = _bucket_cases(p, rnd)
    x = rnd(1024)  # drawn after the bucket ops' tensors, before the compression ops'
    out += _compression_cases(p, rnd, x)
    logits, xt = rnd(16, 8), rnd(16, 32)
    out += _moe_cases(p, logits, xt)
    out += _moe_grad_cases(p, logits, xt)
    out += _offload_cases(p, x)
    return out


def _bucket_cases(p: str | None, rnd: Callable[..., torch.Tensor]) -> list[_Case]:
    """The bucket ops at tiny sizes, then at 2000 x 4 KiB (the per-tensor cost)."""
    out: list = []
    one, one_out = rnd(1), torch.empty(1)
    out.append(("flatten", "1 tensor of 1 element, out=", lambda: ops.flatten([one], out=one_out, provider=p),
                "torch.cat(out=)", lambda: torch.cat([one], out=one_out), "flatten"))  # fmt: skip
    three = [rnd(7), rnd(5, 3), rnd(11)]
    out.append(("flatten", "3 small tensors, new buffer", lambda: ops.flatten(three, provider=p),
                "torch.cat of the reshaped tensors", lambda: torch.cat([t.reshape(-1) for t in three]),
                "flatten"))  # fmt: skip
    uflat, ulayout = ops.flatten([rnd(1)])
    udst = [torch.empty(1)]
    uviews = ulayout.views(uflat)
    out.append(("unflatten", "1 tensor of 1 element", lambda: ops.unflatten(uflat, ulayout, udst, provider=p),
                "torch._foreach_copy_ into the views", lambda: torch._foreach_copy_(udst, uviews),
                "unflatten"))  # fmt: skip
    wx = rnd(1024)
    out.append(("wire_cast", "1024 fp32 -> fp16, / 2", lambda: ops.wire_cast(wx, torch.float16, divisor=2, provider=p),
                "x.to(float16).div_(2)", lambda: wx.to(torch.float16).div_(2), "wire_cast"))  # fmt: skip
    b0, b1 = rnd(1024), rnd(1024)
    out.append(("bucket_reduce", "2 x 1024 fp32, sum", lambda: ops.bucket_reduce([b0, b1], provider=p),
                "torch.add", lambda: torch.add(b0, b1), "bucket_reduce"))  # fmt: skip

    # bulk bucket cases: the per-tensor cost
    many = [rnd(1024) for _ in range(2000)]
    bulk_out = torch.empty(2000 * 1024)
    out.append(("flatten", f"{BULK}, out=", lambda: ops.flatten(many, out=bulk_out, provider=p),
                "torch.cat(out=)", lambda: torch.cat(many, out=bulk_out), "flatten"))  # fmt: skip
    bflat, blayout = ops.flatten(many)
    bviews = blayout.views(bflat)
    bdst = [torch.empty(1024) for _ in range(2000)]
    out.append(("unflatten", BULK, lambda: ops.unflatten(bflat, blayout, bdst, provider=p),
                "torch._foreach_copy_ into the views", lambda: torch._foreach_copy_(bdst, bviews),
                "unflatten"))  # fmt: skip
    return out


def _compression_cases(p: str | None, rnd: Callable[..., torch.Tensor], x: torch.Tensor) -> list[_Case]:
    """The compression ops on 1024 elements."""
    out: list = []

    def q_torch():
        v = x.view(-1, 256)
        s = v.abs().amax(dim=1, keepdim=True) / 127
        return torch.round(v / s).to(torch.int8), s

    q, s = ops.quantize(x)
    out.append(("quantize", "1024 fp32, int8, block 256", lambda: ops.quantize(x, provider=p),
                "absmax / 127, round, to(int8) per block", q_torch, "quantize"))  # fmt: skip
    out.append(("dequantize", "1024 int8, block 256", lambda: ops.dequantize(q, s, numel=1024, provider=p),
                "q.float() * scale per block", lambda: (q.view(-1, 256).float() * s[:, None]).view(-1),
                "dequantize"))  # fmt: skip
    k = 11  # ceil(1% of 1024)

    def topk_torch():
        i = torch.topk(x.abs(), k, sorted=False).indices
        return x[i], i

    vals, idx = ops.topk_compress(x, ratio=0.01)
    out.append(("topk_compress", "1024 fp32, 1%", lambda: ops.topk_compress(x, ratio=0.01, provider=p),
                "torch.topk(abs) + gather", topk_torch, "topk_compress"))  # fmt: skip
    out.append(("topk_decompress", "11 of 1024", lambda: ops.topk_decompress(vals, idx, 1024, provider=p),
                "zeros + scatter_", lambda: torch.zeros(1024).scatter_(0, idx.long(), vals),
                "topk_decompress"))  # fmt: skip
    shifts = torch.arange(8, dtype=torch.uint8)

    def sign_torch():
        bits = ((x.view(-1, 8) >= 0).to(torch.uint8) << shifts).sum(dim=1, dtype=torch.uint8)
        return bits, x.abs().mean()

    bits, scale = ops.sign_compress(x)
    out.append(("sign_compress", "1024 fp32", lambda: ops.sign_compress(x, provider=p),
                "(x >= 0) << shifts, sum; abs().mean()", sign_torch, "sign_compress"))  # fmt: skip
    out.append(("sign_decompress", "1024 signs", lambda: ops.sign_decompress(bits, scale, 1024, provider=p),
                "bits >> shifts & 1, * 2 - 1, * scale",
                lambda: (((bits[:, None] >> shifts) & 1).view(-1).float() * 2 - 1) * scale,
                "sign_decompress"))  # fmt: skip
    m = rnd(64, 4)
    out.append(("orthogonalize", "one 64 x 4 matrix", lambda: ops.orthogonalize(m, provider=p),
                "m.copy_(torch.linalg.qr(m).Q)", lambda: m.copy_(torch.linalg.qr(m).Q), "orthogonalize"))  # fmt: skip
    r, ra_out = rnd(1024), torch.empty(1024)
    out.append(("residual_add", "1024 fp32, out=", lambda: ops.residual_add(x, r, out=ra_out, provider=p),
                "torch.add(out=)", lambda: torch.add(x, r, out=ra_out), "residual_add"))  # fmt: skip
    acc, approx, res, eu_out = rnd(1024), rnd(1024), torch.empty(1024), torch.empty(1024)

    def eu_torch():
        torch.sub(acc, approx, out=res)
        eu_out.copy_(approx)

    out.append(("error_update", "1024 fp32, out=", lambda: ops.error_update(acc, approx, res, out=eu_out, provider=p),
                "torch.sub(out=) + copy_", eu_torch, "error_update"))  # fmt: skip
    return out


def _moe_cases(p: str | None, logits: torch.Tensor, xt: torch.Tensor) -> list[_Case]:
    """MoE, T=16 tokens, E=8 experts, K=2, H=32 (no gradients)."""
    out: list = []

    def route_torch():
        probs = torch.softmax(logits, dim=-1)
        w, i = torch.topk(probs, 2, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), i

    rt = ops.moe_route(logits, k=2)
    xp = ops.moe_permute(xt, rt)
    out.append(("moe_route", "16 tokens, 8 experts, k=2", lambda: ops.moe_route(logits, k=2, provider=p),
                "softmax + topk + renormalise", route_torch, "moe_route"))  # fmt: skip
    out.append(("moe_permute", "16 x 32, k=2", lambda: ops.moe_permute(xt, rt, provider=p),
                "index_select by token", lambda: xt.index_select(0, rt.token_index), "moe_permute"))  # fmt: skip
    rows = rt.row_map.view(-1)
    out.append(("moe_unpermute", "32 x 32 rows, k=2", lambda: ops.moe_unpermute(xp, rt, provider=p),
                "gather rows * weights, sum over k",
                lambda: (xp[rows].view(16, 2, 32) * rt.weights[..., None]).sum(dim=1), "moe_unpermute"))  # fmt: skip

    def aux_torch():
        probs = torch.softmax(logits.float(), dim=-1)
        f = torch.bincount(rt.indices.view(-1), minlength=8).float() / rt.indices.numel()
        return 8 * (f * probs.mean(dim=0)).sum()

    out.append(("moe_aux_loss", "16 x 8", lambda: ops.moe_aux_loss(logits, rt, provider=p),
                "softmax, bincount, mean, sum", aux_torch, "moe_aux_loss"))  # fmt: skip
    out.append(("moe_z_loss", "16 x 8", lambda: ops.moe_z_loss(logits, provider=p), "logsumexp().square().mean()",
                lambda: torch.logsumexp(logits.float(), dim=-1).square().mean(), "moe_z_loss"))  # fmt: skip
    return out


def _moe_grad_cases(p: str | None, logits: torch.Tensor, xt: torch.Tensor) -> list[_Case]:
    """The MoE ops on a differentiable path, as a training step calls them: the forward calls with logits and
    activations that require grad (the graph is built; no backward is run)."""
    out: list = []
    glogits, gx = logits.clone().requires_grad_(), xt.clone().requires_grad_()
    grt = ops.moe_route(glogits, k=2)
    gxp = ops.moe_permute(gx, grt)

    def route_torch_grad():
        probs = torch.softmax(glogits, dim=-1)
        w, i = torch.topk(probs, 2, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), i

    out.append(("moe_route", "16 x 8, k=2, with grad", lambda: ops.moe_route(glogits, k=2, provider=p),
                "softmax + topk + renormalise", route_torch_grad, "moe_route"))  # fmt: skip
    grows = grt.row_map.view(-1)
    out.append(("moe_permute", "16 x 32, k=2, with grad", lambda: ops.moe_permute(gx, grt, provider=p),
                "index_select by token", lambda: gx.index_select(0, grt.token_index), "moe_permute"))  # fmt: skip
    out.append(("moe_unpermute", "32 x 32 rows, k=2, with grad", lambda: ops.moe_unpermute(gxp, grt, provider=p),
                "gather rows * weights, sum over k",
                lambda: (gxp[grows].view(16, 2, 32) * grt.weights[..., None]).sum(dim=1), "moe_unpermute"))  # fmt: skip

    def aux_torch_grad():
        probs = torch.softmax(glogits, dim=-1)
        f = torch.bincount(grt.indices.view(-1), minlength=8).float() / grt.indices.numel()
        return 8 * (f * probs.mean(dim=0)).sum()

    out.append(("moe_aux_loss", "16 x 8, with grad", lambda: ops.moe_aux_loss(glogits, grt, provider=p),
                "softmax, bincount, mean, sum", aux_torch_grad, "moe_aux_loss"))  # fmt: skip
    out.append(("moe_z_loss", "16 x 8, with grad", lambda: ops.moe_z_loss(glogits, provider=p),
                "logsumexp().square().mean()", lambda: torch.logsumexp(glogits, dim=-1).square().mean(),
                "moe_z_loss"))  # fmt: skip
    return out


def _offload_cases(p: str | None, x: torch.Tensor) -> list[_Case]:
    """Offload packing (ops.pack / ops.unpack)."""
    out: list = []
    pk = ops.pack(x, "bf16")
    xb = x.to(torch.bfloat16)
    out.append(("pack", "1024 fp32 -> bf16", lambda: ops.pack(x, "bf16", provider=p), "x.to(bfloat16)",
                lambda: x.to(torch.bfloat16), "flatten"))  # fmt: skip
    out.append(("unpack", "1024 bf16 -> fp32", lambda: ops.unpack(pk, provider=p), "x.to(float32)",
                lambda: xb.to(torch.float32), "flatten"))  # fmt: skip
    return out


def _selected(op: str, device: torch.device, requested: str | None) -> str:
    """The provider automatic selection gives ``op`` here (what the table notes)."""
    if requested:
        return requested
    probe = registry.Op(op)  # the selection order (env var, tuned winner, device default) under op's name
    for name in registry.PROVIDERS:
        probe.impls[name] = lambda *a: None
    return probe.select(device, torch.float32, 1024, None)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--calls", type=cli_common.int_at_least(1), default=200,
                    help="calls per timed loop of a tiny case (default 200)")  # fmt: skip
    ap.add_argument("--bulk-calls", type=cli_common.int_at_least(1), default=5,
                    help="calls per timed loop of a 2000-tensor case (default 5)")  # fmt: skip
    ap.add_argument(
        "--reps", type=cli_common.int_at_least(1), default=15, help="timed loops per implementation (default 15)"
    )
    ap.add_argument("--provider", default=None, choices=registry.PROVIDERS,
                    help="provider for our ops (default: automatic; torch on a CPU)")  # fmt: skip
    ap.add_argument("--ops", default=None, help="comma-separated op names to run (default: all)")
    ap.add_argument("--no-bulk", action="store_true", help="skip the 2000 x 4 KiB cases")
    ap.add_argument("--threads", type=cli_common.int_at_least(0), default=1,
                    help="torch intra-op threads while timing (default 1: tiny ops do not use more, and on a "
                         "loaded machine waking a thread pool costs milliseconds at random; 0: torch's)")  # fmt: skip
    ap.add_argument("--device", default="cpu", choices=("cpu",), help="only cpu: the suite measures host cost")
    cli_common.add_json(ap)


def run(a: argparse.Namespace) -> int:
    device = torch.device("cpu")
    if a.provider:
        why = registry.can_run(a.provider, device)
        if why is not None:
            raise cli_common.UsageError(f"--provider: {a.provider} cannot run here: {why}")
    threads = torch.get_num_threads()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    try:
        return _run(a, device)
    finally:
        torch.set_num_threads(threads)


def _run(a: argparse.Namespace, device: torch.device) -> int:
    env = environment(device)
    wanted = {o.strip() for o in a.ops.split(",") if o.strip()} if a.ops else None
    all_cases = cases(a.provider)
    known = sorted({c[0] for c in all_cases})
    if wanted and wanted - set(known):
        raise cli_common.UsageError(
            f"--ops: unknown op(s) {', '.join(sorted(wanted - set(known)))}; ops: {', '.join(known)}"
        )
    results: list[Result] = []
    summary_rows = []
    for op, case, ours, peer_name, peer, sel_op in all_cases:
        bulk = case.startswith(BULK)
        if (wanted and op not in wanted) or (bulk and a.no_bulk):
            continue
        calls = a.bulk_calls if bulk else a.calls
        ours_us, peer_us = _time_pair([ours, peer], calls, a.reps)
        prov = _selected(sel_op, device, a.provider)
        med_o, med_p = statistics.median(ours_us), statistics.median(peer_us)
        ratio = med_o / med_p
        if bulk:
            met = ratio <= TARGET_BULK_RATIO
            target = f"<= {TARGET_BULK_RATIO}x torch"
        elif case.endswith(GRAD):
            met, target = None, "reported (no target)"
        else:
            met = med_o <= TARGET_US and ratio <= TARGET_RATIO
            target = f"<= {TARGET_US:g} us and <= {TARGET_RATIO:g}x torch"
        for impl, kind, us in ((f"torsh_kernels.{op} [{prov}]", "ours", ours_us), (peer_name, "peer", peer_us)):
            t = Timing(median_ms=statistics.median(us) / 1e3, p20_ms=quantile(us, 0.2) / 1e3,
                       p80_ms=quantile(us, 0.8) / 1e3, reps=len(us))  # fmt: skip
            extra = {"us_per_call": statistics.median(us), "calls_per_loop": calls, "provider": prov}
            if kind == "ours":
                extra.update(ratio_to_torch=ratio, target=target, met=met)
            results.append(Result(case=f"{op}: {case}", op=op, impl=impl, kind=kind, bytes_moved=0, timing=t,
                                  speedup_vs_best_peer=med_p / med_o if kind == "ours" else None,
                                  extra=extra))  # fmt: skip
        summary_rows.append((op, case, prov, ours_us, peer_name, peer_us, ratio, target, met))

    console = cli_common.console()
    console.print(f"[bold]host overhead per call[/bold] on {env['device']} (torch {env['versions']['torch']}), "
                  f"{a.reps} interleaved loops of {a.calls} calls ({a.bulk_calls} for {BULK}), "
                  f"{torch.get_num_threads()} torch thread(s)")  # fmt: skip
    cols = ["op", "case", "provider", "ours us", "p20-p80", "torch us", "p20-p80", "ours/torch", "target",
            "torch equivalent"]  # fmt: skip
    t = cli_common.table(None, cols, text=("op", "case", "provider", "target", "torch equivalent"))
    for op, case, prov, o, pn, pu, ratio, _target, met in summary_rows:
        t.add_row(op, case, prov, f"{statistics.median(o):.1f}", f"{quantile(o, 0.2):.1f}-{quantile(o, 0.8):.1f}",
                  f"{statistics.median(pu):.1f}", f"{quantile(pu, 0.2):.1f}-{quantile(pu, 0.8):.1f}",
                  f"{ratio:.2f}x", "-" if met is None else "met" if met else "not met", pn,
                  style=None if met is not False else "bold")  # fmt: skip
    console.print(t)
    console.print(f"targets: a tiny call <= {TARGET_US:g} us and <= {TARGET_RATIO:g}x its torch equivalent; "
                  f"the {BULK} cases <= {TARGET_BULK_RATIO}x")  # fmt: skip
    targeted = [r for r in summary_rows if r[-1] is not None]
    n_met = sum(r[-1] for r in targeted)
    console.print(f"targets met: {n_met} of {len(targeted)} cases (the {len(summary_rows) - len(targeted)} "
                  f"'{GRAD}' cases are reported without a target)")  # fmt: skip
    config = {"calls": a.calls, "bulk_calls": a.bulk_calls, "reps": a.reps, "provider": a.provider,
              "threads": torch.get_num_threads(),
              "targets": {"us": TARGET_US, "ratio": TARGET_RATIO, "bulk_ratio": TARGET_BULK_RATIO},
              "met": n_met, "cases": len(targeted),
              "reported_without_target": len(summary_rows) - len(targeted)}  # fmt: skip
    emit(a, result_doc("overhead", env, results, config))
    return 0
