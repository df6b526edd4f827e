"""``torsh bench moe --profile-layer``: where a torsh ``MoELayer``'s training step goes, each phase of its forward
and backward timed on its own (no profiler runs: a profiler turns the ops' fast paths off)."""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["fwd_bwd", "profile_layer", "timed"]


def fwd_bwd(module, x: torch.Tensor, gy: torch.Tensor):
    """One training step of ``module`` on ``x`` (requiring a gradient, as inside a model): forward, then
    backward of ``<y, gy>``; the parameters' gradients dropped after, so none accumulates."""

    def step():
        xx = x.detach().requires_grad_()
        module(xx).backward(gy)
        for p in module.parameters():
            p.grad = None
        return xx.grad

    return step


def timed(fn, reps: int) -> float:
    """Median wall time of ``fn`` in ms (one warm-up call)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def profile_layer(layer, x: torch.Tensor, gy: torch.Tensor, reps: int) -> dict[str, float]:
    """Where a torsh MoELayer's step goes (median ms): each phase of its forward run and timed on its own, as
    in training (grad mode on, the weights requiring gradients), then each phase's backward alone (its graph
    built once and backpropagated with retain_graph); the experts' GEMMs also alone (the same matmuls
    without the rest); and the whole step. No profiler runs: a profiler turns the ops' fast paths off."""
    from ...ops import moe_permute, moe_route, moe_unpermute

    H, w = layer.hidden, layer.ffn_hidden
    x2 = x.detach().reshape(-1, H)
    route = dict(spec=layer.spec.route, provider=layer.provider)
    if layer.balancer is not None:
        route["score_bias"] = layer.balancer.bias
    gen = torch.Generator().manual_seed(7)

    def like(t):
        return torch.randn(t.shape, generator=gen).to(t)

    xr = x2.clone().requires_grad_()
    logits = layer.router(xr)
    lg = logits.detach().requires_grad_()
    r = moe_route(lg, **route)
    counts = r.tokens_per_expert.tolist()
    xp = moe_permute(xr, r)
    xpr = xp.detach().requires_grad_()
    yp = layer._experts(xpr, r.rows_per_expert, counts)
    ypr = yp.detach().requires_grad_()
    y = moe_unpermute(ypr, r)
    out: dict[str, float] = {}
    out["fwd router matmul"] = timed(lambda: layer.router(xr), reps)
    out["fwd moe_route"] = timed(lambda: moe_route(lg, **route), reps)
    out["fwd moe_permute"] = timed(lambda: moe_permute(xr, r), reps)
    out["fwd experts"] = timed(lambda: layer._experts(xpr, r.rows_per_expert, counts), reps)
    out["fwd moe_unpermute"] = timed(lambda: moe_unpermute(ypr, r), reps)
    yr = y.detach().requires_grad_()
    ys = layer._add_shared(yr, xr)
    if ys is not yr:
        out["fwd shared experts"] = timed(lambda: layer._add_shared(yr, xr), reps)
    bwd = {
        "router matmul": (logits, [xr, layer.router.weight]),
        "moe_route": (r.weights, [lg]),
        "moe_permute": (xp, [xr]),
        "experts": (yp, [xpr, layer.w_in, layer.w_out]),
        "moe_unpermute": (y, [ypr, r.weights]),
    }
    if ys is not yr:
        bwd["shared experts"] = (ys, [xr, *(p for p in (layer.shared_w_in, layer.shared_w_out) if p is not None)])
    for name, (o, inputs) in bwd.items():
        g = like(o)
        out[f"bwd {name}"] = timed(lambda o=o, i=inputs, g=g: torch.autograd.grad(o, i, g, retain_graph=True), reps)
    # the experts' GEMMs alone: per expert, forward x @ w_in, h @ w_out; backward the four products
    chunks = torch.split(xp.detach(), counts)
    hs = [c @ layer.w_in[e].detach() for e, c in enumerate(chunks)]
    acts = [h[:, :w] for h in hs]  # (the activation's shape)
    gys = torch.split(like(yp), counts)
    ghs = [like(h) for h in hs]
    with torch.no_grad():

        def fwd_gemms():
            for e, c in enumerate(chunks):
                (c @ layer.w_in[e])[:, :w] @ layer.w_out[e]

        def bwd_gemms():
            for e, c in enumerate(chunks):
                gys[e] @ layer.w_out[e].T  # d act
                acts[e].T @ gys[e]  # d w_out
                ghs[e] @ layer.w_in[e].T  # d x
                c.T @ ghs[e]  # d w_in

        out["fwd experts: GEMMs alone"] = timed(fwd_gemms, reps)
        out["bwd experts: GEMMs alone"] = timed(bwd_gemms, reps)
    out["whole step (fwd+bwd)"] = timed(fwd_bwd(layer, x, gy), reps)
    return out
