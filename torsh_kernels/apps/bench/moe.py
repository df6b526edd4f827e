"""Benchmark of the MoE routing path against a torch peer written like Hugging Face's Mixtral block.

Case: T tokens (default 16384), hidden H (default 4096), E experts (8 and 64), k=2, bf16 activations
and router logits. The experts are the identity, so what is timed is the routing plumbing alone:

- ``path``: ours = ``moe_route`` + ``moe_permute`` + ``moe_unpermute``; the peer = Mixtral's
  ``MixtralSparseMoeBlock.forward`` with identity experts: softmax in fp32, ``topk``, renormalise, one-hot
  expert mask, then per expert ``torch.where`` (a host sync), a gather of its tokens, the weight
  multiply and ``index_add_`` into the output;
- ``route``: ``moe_route`` against the peer's softmax/topk/renormalise/one-hot mask (which produces no
  permutation, so it does less);
- ``permute``: against ``x.index_select(0, token_index)``;
- ``unpermute``: against ``out.index_add_(0, token_index, y_perm * w_row)`` (Mixtral's combine).

GB/s counts the bytes the fused ops must move: permute reads [T, H] and writes [N, H]; unpermute reads
[N, H] and writes [T, H]; the path adds the logits. The baseline is a same-device copy of the [N, H]
permuted tensor; "of copy" is the ratio to its bandwidth.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from ... import _cli
from ...ops import moe_permute, moe_route, moe_unpermute
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

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mixtral_block(x: torch.Tensor, logits: torch.Tensor, k: int) -> torch.Tensor:
    """MixtralSparseMoeBlock.forward (transformers) with identity experts."""
    T, H = x.shape
    E = logits.shape[1]
    routing_weights = F.softmax(logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, k, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    routing_weights = routing_weights.to(x.dtype)
    final = torch.zeros((T, H), dtype=x.dtype, device=x.device)
    expert_mask = F.one_hot(selected_experts, num_classes=E).permute(2, 1, 0)
    for e in range(E):
        idx, top_x = torch.where(expert_mask[e])
        current_state = x[None, top_x].reshape(-1, H)
        current = current_state * routing_weights[top_x, idx, None]
        final.index_add_(0, top_x, current.to(x.dtype))
    return final


def mixtral_routing(logits: torch.Tensor, k: int) -> torch.Tensor:
    routing_weights = F.softmax(logits, dim=1, dtype=torch.float)
    routing_weights, selected_experts = torch.topk(routing_weights, k, dim=-1)
    routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
    return F.one_hot(selected_experts, num_classes=logits.shape[1]).permute(2, 1, 0)


def run_case(T: int, H: int, E: int, k: int, dtype: torch.dtype, device: torch.device, providers: list[str],
             reps: int) -> list[Result]:  # fmt: skip
    g = torch.Generator().manual_seed(E)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    logits = torch.randn(T, E, generator=g).to(dtype).to(device)
    b = x.element_size()
    r = moe_route(logits, k=k, provider="torch")
    N = r.num_rows
    y_perm = torch.randn(N, H, generator=g).to(dtype).to(device)
    w_row = torch.empty(N, dtype=torch.float32, device=device)
    w_row[r.row_map.reshape(-1)] = r.weights.reshape(-1)
    out = torch.empty(T, H, dtype=dtype, device=device)
    case = Case(f"T={T} H={H} E={E} k={k} {str(dtype).removeprefix('torch.')}", device)
    add = case.add
    src = torch.empty(N, H, dtype=dtype, device=device).copy_(y_perm)
    dst = torch.empty_like(src)
    add("copy", "dst.copy_(src) [N, H]", "copy", lambda: dst.copy_(src), 2 * N * H * b)
    idx_bytes = T * k * 8 * 2
    perm_bytes = (T + N) * H * b + idx_bytes
    unperm_bytes = (T + N) * H * b + idx_bytes + T * k * 4
    route_bytes = T * E * b + T * k * (8 * 3 + 4 * 2) + N * 8

    # correctness first: ours against the peer on the whole path
    want = mixtral_block(x, logits, k).float()
    for p in providers:
        rr = moe_route(logits, k=k, provider=p)
        got = moe_unpermute(moe_permute(x, rr, provider=p), rr, provider=p).float()
        err = (got - want).abs().max().item()
        tol = 4 * torch.finfo(dtype).eps * (want.abs().max().item() + 1)
        if err > tol:
            raise AssertionError(f"moe path[{p}] differs from the Mixtral peer by {err} (> {tol}); not timing it")

    def path(p: str) -> torch.Tensor:
        rr = moe_route(logits, k=k, provider=p)
        return moe_unpermute(moe_permute(x, rr, provider=p), rr, provider=p)

    for p in providers:
        add("path", f"torsh[{p}] route+permute+unpermute", "ours", lambda p=p: path(p),
            route_bytes + perm_bytes + unperm_bytes)  # fmt: skip
    add("path", "Mixtral block (identity experts)", "peer", lambda: mixtral_block(x, logits, k),
        route_bytes + perm_bytes + unperm_bytes)  # fmt: skip
    for p in providers:
        add("route", f"torsh[{p}]", "ours", lambda p=p: moe_route(logits, k=k, provider=p), route_bytes)
    add("route", "softmax/topk/renorm/one_hot", "peer", lambda: mixtral_routing(logits, k), route_bytes)
    for p in providers:
        add("permute", f"torsh[{p}]", "ours", lambda p=p: moe_permute(x, r, provider=p), perm_bytes)
    add("permute", "x.index_select(token_index)", "peer", lambda: x.index_select(0, r.token_index), perm_bytes)
    for p in providers:
        add("unpermute", f"torsh[{p}]", "ours", lambda p=p: moe_unpermute(y_perm, r, provider=p), unperm_bytes)

    def index_add() -> torch.Tensor:
        out.zero_()
        return out.index_add_(0, r.token_index, (y_perm * w_row[:, None]).to(dtype))

    add("unpermute", "index_add_(y_perm * w)", "peer", index_add, unperm_bytes)
    results = case.time(reps)
    for res in results:
        res.extra.update({"tokens": T, "hidden": H, "experts": E, "k": k, "rows": N})
    return results


def _counts(text: str) -> list[int]:
    try:
        out = [int(e) for e in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected expert counts like 8,64, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expert counts must be >= 1, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_device(p)
    add_providers(p)
    p.add_argument("--tokens", type=_cli.int_at_least(1), default=16384, help="T (default 16384)")
    p.add_argument("--hidden", type=_cli.int_at_least(1), default=4096, help="H (default 4096)")
    p.add_argument("--experts", default=[8, 64], type=_counts, help="comma-separated expert counts (default 8,64)")
    p.add_argument("--k", type=_cli.int_at_least(1), default=2, help="experts per token (default 2)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="activation and logit dtype")
    p.add_argument("--reps", type=_cli.int_at_least(1), default=None,
                   help="timed repetitions per measurement (default 20 GPU, 5 CPU)")  # fmt: skip
    _cli.add_json(p)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if args.k > min(args.experts):
        raise _cli.UsageError(f"--k {args.k} is more than the {min(args.experts)} expert(s) of --experts")
    providers = select_providers("torsh bench moe", args.providers, device)
    reps = args.reps or (20 if device.type == "cuda" else 5)
    env = environment(device)
    results: list[Result] = []
    for E in args.experts:
        results += run_case(args.tokens, args.hidden, E, args.k, DTYPES[args.dtype], device, providers, reps)
    print_tables(results, "torsh bench moe", env)
    config = {"providers": providers, "reps": reps, "tokens": args.tokens, "hidden": args.hidden,
              "experts": ",".join(map(str, args.experts)), "k": args.k, "dtype": args.dtype}  # fmt: skip
    emit(args, result_doc("moe", env, results, config))
    return 0
