"""Every public op traces under ``torch.compile(fullgraph=True)`` with no graph break, and the compiled call
gives what the eager call gives.

Each case calls one public op (or its torch reference) the way a user would, with the optional arguments
users hit (``residual=``, ``out=``, ``accumulate=``, a stochastic seed, lists, batches, a routing made
inside or outside the compiled function). Per case:

- ``torch._dynamo.explain`` counts no graph break;
- ``torch.compile(fullgraph=True, backend="aot_eager")`` runs it (aot_eager: dynamo, AOTAutograd and
  functionalization, whose handling of the custom ops' declared mutations is what this checks; the
  custom ops are opaque, so inductor would add nothing here but time), twice on fresh random inputs
  (odd sizes, never zeros), and its outputs and every argument (mutated ones included) equal the eager
  call's on clones of the same inputs;
- where the op is differentiable, the gradients equal too.

Checks that need host values (an index out of range, NaN/Inf) raise the eager error from inside the
custom op under compile: tested at the end.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable

import pytest
import torch

import torsh_kernels as tk
from tests.helpers import poison, rand
from torsh_kernels import ops

CPU = torch.device("cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def t(gen, *shape, dtype=F32) -> torch.Tensor:
    return rand(shape, dtype, gen, CPU)


def nan(*shape, dtype=F32) -> torch.Tensor:
    return poison(shape, dtype, CPU)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    make: Callable[[torch.Generator], tuple]
    """Fresh arguments from a generator."""
    fn: Callable
    grad: tuple[int, ...] = ()
    """Positions of arguments made to require grad (outputs are then differentiated)."""
    seeded: bool = False
    """The op draws from torch's global generator: both runs start from the same global seed."""
    op: bool = True
    """The traced graph holds a ``torsh`` custom op (the references, the losses and count_nonfinite are torch
    operations)."""
    tol: float = 0.0
    """Relative and absolute tolerance; 0: the same bits. (The MoE losses' default on CPU tensors is the cpu
    provider's fused kernels, and under torch.compile the torch formula, which inductor can fuse: the same
    value, rounded differently.)"""
    dynamic: bool = False
    """An output size depends on the data (the routing's N kept rows, under a capacity limit): fullgraph=True
    captures it by itself; explain (fullgraph=False) needs ``capture_dynamic_output_shape_ops``."""


def _stacked(g):
    return (t(g, 3, 5, 7),)


def _flat_layout(g):
    ts = [t(g, 7), t(g, 3, 5), t(g, 1)]
    layout = tk.flatten(ts)[1]
    return t(g, layout.total), layout, [nan(*x.shape) for x in ts]


def _flat_layout_mixed(g):
    ts = [t(g, 7), t(g, 3, 5, dtype=F16), t(g, 4, 3).t()]
    layout = tk.BucketLayout.for_tensors(ts, F32)
    return t(g, layout.total), layout, ts


def _quantized(g, bits=8, block=64, n=1001):
    q, s = tk.quantize(t(g, n), bits=bits, block=block)
    return q, s


def _topk_payload(g, n=1001, k=37):
    idx = torch.randperm(n, generator=g)[:k].sort().values.to(torch.int32)
    return t(g, k), idx


def _signs(g, n=1001):
    bits, scale = tk.sign_compress(t(g, n))
    return bits, scale


def _routing(g, T=13, E=6, k=2, **kw):
    logits = t(g, T, E)
    return logits, tk.moe_route(logits, k=k, **kw)


def _route_tensors(r) -> tuple:
    return (r.weights, r.indices, r.scores, r.tokens_per_expert, r.row_map, r.token_index, r.dropped)


def _moe_layer(logits, x, cf):
    r = tk.moe_route(logits, k=2, capacity_factor=cf)
    xp = tk.moe_permute(x, r)
    y = tk.moe_unpermute(xp * 2.0, r)
    # (the losses' torch formula, the one a traced call runs: comparable bit for bit)
    aux, z = tk.moe_aux_loss(logits, r, provider="torch"), tk.moe_z_loss(logits, provider="torch")
    return y, aux, z, r.row_map, r.tokens_per_expert


def _flatten_unflatten(ts, dst):
    flat, layout = tk.flatten(ts, scale=0.5)
    tk.unflatten(flat * 3.0, layout, dst, accumulate=True)
    return flat


def _pack_unpack(x, fmt):
    p = ops.pack(x, fmt, block=64)
    return p.codes, p.scales, ops.unpack(p)  # (not p.data: the padding before int8 scales is never written)


def _unpack_int8(g):
    p = ops.pack(t(g, 3, 333), "int8", block=64)
    return p.data, nan(3, 333)


CASES = [
    # bucket
    Case("flatten", lambda g: ([t(g, 7), t(g, 3, 5), t(g, 1)],), lambda ts: tk.flatten(ts)),
    Case(
        "flatten-scale-dtype-mixed",
        lambda g: ([t(g, 7), t(g, 5, 3, dtype=F16).t(), t(g, 9, dtype=BF16)],),
        lambda ts: tk.flatten(ts, scale=0.25, dtype=BF16)[0],
    ),
    Case(
        "flatten-out",
        lambda g: ([t(g, 7), t(g, 3, 5), t(g, 1)], nan(23)),
        lambda ts, out: tk.flatten(ts, out=out, scale=0.5)[0],
    ),
    Case("unflatten", _flat_layout, lambda flat, layout, ts: tk.unflatten(flat, layout, ts)),
    Case(
        "unflatten-accumulate-scale-mixed",
        _flat_layout_mixed,
        lambda flat, layout, ts: tk.unflatten(flat, layout, ts, scale=0.5, accumulate=True),
    ),
    Case("flatten+unflatten-inside", lambda g: ([t(g, 7), t(g, 3, 5)], [t(g, 7), t(g, 3, 5)]), _flatten_unflatten),
    Case("bucket_reduce", lambda g: ([t(g, 101), t(g, 101), t(g, 101)],), lambda b: tk.bucket_reduce(b, op="avg")),
    Case("bucket_reduce-stacked-max", _stacked, lambda b: tk.bucket_reduce(b, op="max")),
    Case(
        "bucket_reduce-out-inplace",
        lambda g: ([t(g, 101), t(g, 101)],),
        lambda b: tk.bucket_reduce(b, op="sum", out=b[0]),
    ),
    Case(
        "bucket_reduce-fp16-out",
        lambda g: ([t(g, 7, 9, dtype=F16), t(g, 7, 9, dtype=F16)], nan(7, 9)),
        lambda b, out: tk.bucket_reduce(b, out=out),
    ),
    Case("wire_cast", lambda g: (t(g, 1001),), lambda x: tk.wire_cast(x, divisor=3.0)),
    Case(
        "wire_cast-out",
        lambda g: (t(g, 3, 333), nan(999, dtype=BF16)),
        lambda x, out: tk.wire_cast(x, divisor=2.0, out=out),
    ),
    # quantize
    Case("quantize", lambda g: (t(g, 1001),), lambda x: tk.quantize(x)),
    Case(
        "quantize-int4-stochastic-seed",
        lambda g: (t(g, 1001, dtype=BF16),),
        lambda x: tk.quantize(x, bits=4, block=32, stochastic=True, seed=12345),
    ),
    Case(
        "quantize-stochastic-no-seed", lambda g: (t(g, 1001),), lambda x: tk.quantize(x, stochastic=True), seeded=True
    ),
    Case(
        "quantize-out",
        lambda g: (t(g, 1001), torch.zeros(1001, dtype=torch.int8), nan(16)),
        lambda x, q, s: tk.quantize(x, block=64, out=(q, s)),
    ),
    Case("dequantize", lambda g: _quantized(g), lambda q, s: tk.dequantize(q, s, block=64, numel=1001)),
    Case(
        "dequantize-int4-out-accumulate",
        lambda g: (*_quantized(g, 4, 32), t(g, 1001, dtype=F16)),
        lambda q, s, out: tk.dequantize(q, s, block=32, numel=1001, out=out, accumulate=True, alpha=0.5),
    ),
    # top-k
    Case("topk_compress", lambda g: (t(g, 1001),), lambda x: tk.topk_compress(x, ratio=0.05)),
    Case(
        "topk_compress-residual",
        lambda g: (t(g, 1001), t(g, 1001)),
        lambda x, r: tk.topk_compress(x, ratio=0.05, residual=r),
    ),
    Case(
        "topk_compress-residual-exact-fp16",
        lambda g: (t(g, 7, 143, dtype=F16), t(g, 1001, dtype=BF16)),
        lambda x, r: tk.topk_compress(x, ratio=0.1, residual=r, exact=True),
    ),
    Case("topk_decompress", _topk_payload, lambda v, i: tk.topk_decompress(v, i, 1001)),
    Case(
        "topk_decompress-out-accumulate",
        lambda g: (*_topk_payload(g), t(g, 1001, dtype=BF16)),
        lambda v, i, out: tk.topk_decompress(v, i, 1001, out=out, accumulate=True, alpha=0.5),
    ),
    # sign
    Case("sign_compress", lambda g: (t(g, 1001),), lambda x: tk.sign_compress(x)),
    Case("sign_compress-residual", lambda g: (t(g, 1001), t(g, 1001)), lambda x, r: tk.sign_compress(x, r)),
    Case("sign_decompress", _signs, lambda b, s: tk.sign_decompress(b, s, 1001)),
    Case(
        "sign_decompress-out-accumulate",
        lambda g: (*_signs(g), t(g, 1001, dtype=F16)),
        lambda b, s, out: tk.sign_decompress(b, s, 1001, out=out, accumulate=True, alpha=0.5),
    ),
    Case("sign_decompress-float-scale", lambda g: (_signs(g)[0],), lambda b: tk.sign_decompress(b, 0.75, 1001)),
    # orthogonalize
    Case("orthogonalize", lambda g: (t(g, 67, 3),), lambda p: tk.orthogonalize(p)),
    Case("orthogonalize-batch", lambda g: (t(g, 3, 41, 4),), lambda p: tk.orthogonalize(p)),
    Case("orthogonalize-list", lambda g: ([t(g, 41, 2), t(g, 9, 2)],), lambda ps: tk.orthogonalize(ps, rtol=1e-5)),
    # error feedback
    Case("residual_add", lambda g: (t(g, 1001), t(g, 1001)), lambda x, r: tk.residual_add(x, r)),
    Case(
        "residual_add-out-residual",
        lambda g: (t(g, 7, 143, dtype=BF16), t(g, 1001)),
        lambda x, r: tk.residual_add(x, r, out=r),
    ),
    Case("error_update", lambda g: (t(g, 1001), t(g, 1001), nan(1001)), lambda a, p, r: tk.error_update(a, p, r)),
    Case(
        "error_update-out-residual-is-acc",
        lambda g: (t(g, 1001), t(g, 1001), nan(1001, dtype=F16)),
        lambda a, p, out: tk.error_update(a, p, a, out=out),
    ),
    # moe
    Case("moe_route", lambda g: (t(g, 13, 6),), lambda x: _route_tensors(tk.moe_route(x, k=2)), grad=(0,)),
    Case(
        "moe_route-sigmoid-capacity",
        lambda g: (t(g, 13, 6),),
        lambda x: _route_tensors(tk.moe_route(x, k=2, score="sigmoid", capacity_factor=0.75, drop_policy="position")),
        grad=(0,),
        dynamic=True,
    ),
    Case("moe_permute", lambda g: (t(g, 13, 5), _routing(g)[1]), lambda x, r: tk.moe_permute(x, r), grad=(0,)),
    Case("moe_unpermute", lambda g: (t(g, 26, 5), _routing(g)[1]), lambda y, r: tk.moe_unpermute(y, r), grad=(0,)),
    Case("moe_aux_loss", lambda g: _routing(g), lambda x, r: tk.moe_aux_loss(x, r), grad=(0,), op=False, tol=1e-5),
    Case("moe_z_loss", lambda g: (t(g, 13, 6),), lambda x: tk.moe_z_loss(x), grad=(0,), op=False, tol=1e-5),
    Case("moe-layer", lambda g: (t(g, 13, 6), t(g, 13, 5)), lambda lg, x: _moe_layer(lg, x, None), grad=(0, 1)),
    Case(
        "moe-layer-capacity",
        lambda g: (t(g, 13, 6), t(g, 13, 5)),
        lambda lg, x: _moe_layer(lg, x, 1.0),
        grad=(0, 1),
        dynamic=True,
    ),
    # shared
    Case("count_nonfinite", lambda g: (t(g, 1001),), lambda x: ops.count_nonfinite(x), op=False),
    # offload
    Case("pack-bf16", lambda g: (t(g, 3, 333),), lambda x: _pack_unpack(x, "bf16")),
    Case("pack-fp16", lambda g: (t(g, 3, 333),), lambda x: _pack_unpack(x, "fp16")),
    Case("pack-int8", lambda g: (t(g, 3, 333),), lambda x: _pack_unpack(x, "int8")),
    Case(
        "pack-int8-out",
        lambda g: (t(g, 1001), torch.zeros(ops.packed_nbytes(1001, "int8", 64), dtype=torch.uint8)),
        lambda x, out: ops.pack(x, "int8", block=64, out=out).data,
    ),
    Case(
        "unpack-bf16-out-accumulate",
        lambda g: (ops.pack(t(g, 3, 333), "bf16").data, t(g, 3, 333, dtype=F16)),
        lambda data, out: ops.unpack(
            ops.Packed(data=data, fmt="bf16", shape=(3, 333), dtype=F32, block=256), out=out, accumulate=True
        ),
    ),
    Case(
        "unpack-int8-out-accumulate",
        _unpack_int8,
        lambda data, out: ops.unpack(
            ops.Packed(data=data, fmt="int8", shape=(3, 333), dtype=F32, block=64),
            out=out.nan_to_num_(1.0),
            accumulate=True,
        ),
    ),
    # torch references
    Case("flatten_ref", lambda g: ([t(g, 7), t(g, 3, 5)],), lambda ts: ops.flatten_ref(ts, BF16, 0.5), op=False),
    Case("unflatten_ref", _flat_layout, lambda flat, layout, ts: ops.unflatten_ref(flat, layout, ts), op=False),
    Case(
        "bucket_reduce_ref",
        lambda g: ([t(g, 101), t(g, 101)],),
        lambda b: ops.bucket_reduce_ref(b, "avg", F32),
        op=False,
    ),
    Case("wire_cast_ref", lambda g: (t(g, 1001),), lambda x: ops.wire_cast_ref(x, F16, 3.0), op=False),
    Case("quantize_ref", lambda g: (t(g, 1001),), lambda x: ops.quantize_ref(x, bits=4, block=64), op=False),
    Case(
        "dequantize_ref", lambda g: _quantized(g), lambda q, s: ops.dequantize_ref(q, s, block=64, numel=1001), op=False
    ),
    Case(
        "topk_compress_ref",
        lambda g: (t(g, 1001), t(g, 1001)),
        lambda x, r: ops.topk_compress_ref(x, ratio=0.05, residual=r),
        op=False,
    ),
    Case("topk_decompress_ref", _topk_payload, lambda v, i: ops.topk_decompress_ref(v, i, 1001), op=False),
    Case("sign_compress_ref", lambda g: (t(g, 1001), t(g, 1001)), lambda x, r: ops.sign_compress_ref(x, r), op=False),
    Case("sign_decompress_ref", _signs, lambda b, s: ops.sign_decompress_ref(b, s, 1001), op=False),
    Case("orthogonalize_ref", lambda g: (t(g, 67, 3),), lambda p: ops.orthogonalize_ref(p), op=False),
    Case("residual_add_ref", lambda g: (t(g, 1001), t(g, 1001)), lambda x, r: ops.residual_add_ref(x, r), op=False),
    Case(
        "error_update_ref",
        lambda g: (t(g, 1001), t(g, 1001), nan(1001)),
        lambda a, p, r: ops.error_update_ref(a, p, r),
        op=False,
    ),
    Case(
        "moe_route_ref",
        lambda g: (t(g, 13, 6),),
        lambda x: _route_tensors(ops.moe_route_ref(x, k=2)),
        grad=(0,),
        op=False,
    ),
    Case(
        "moe_permute_ref",
        lambda g: (t(g, 13, 5), _routing(g)[1]),
        lambda x, r: ops.moe_permute_ref(x, r),
        grad=(0,),
        op=False,
    ),
    Case(
        "moe_unpermute_ref",
        lambda g: (t(g, 26, 5), _routing(g)[1]),
        lambda y, r: ops.moe_unpermute_ref(y, r),
        grad=(0,),
        op=False,
    ),
    Case("moe_aux_loss_ref", lambda g: _routing(g), lambda x, r: ops.moe_aux_loss_ref(x, r), grad=(0,), op=False),
    Case("moe_z_loss_ref", lambda g: (t(g, 13, 6),), lambda x: ops.moe_z_loss_ref(x), grad=(0,), op=False),
    Case("pack_ref", lambda g: (t(g, 3, 333),), lambda x: ops.pack_ref(x, "int8", block=64).data, op=False),
    Case(
        "unpack_ref",
        _unpack_int8,
        lambda data, out: ops.unpack_ref(ops.Packed(data=data, fmt="int8", shape=(3, 333), dtype=F32, block=64)),
        op=False,
    ),
]

CASES.append(
    Case(
        "moe_route_ref-capacity",
        lambda g: (t(g, 13, 6),),
        lambda x: _route_tensors(ops.moe_route_ref(x, k=2, capacity_factor=0.75)),
        grad=(0,),
        op=False,
        dynamic=True,
    )
)


# --------------------------------------------------------------------------------------------------- harness


def _clone(a):
    if isinstance(a, torch.Tensor):
        return a.detach().clone()
    if isinstance(a, (list, tuple)):
        return type(a)(_clone(x) for x in a)
    return a  # a BucketLayout, a Routing (read only)


def _leaves(o) -> list:
    """The tensors and plain values of an output (tuples, lists, dataclasses such as Routing, Packed)."""
    if isinstance(o, (list, tuple)):
        return [x for v in o for x in _leaves(v)]
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return [x for f in dataclasses.fields(o) for x in _leaves(getattr(o, f.name))]
    return [o]


def _same(got, want, where: str, tol: float = 0.0) -> None:
    assert len(got) == len(want), where
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{where}[{i}]"
            assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), f"{where}[{i}]"
            # the compiled call runs the same op implementations and aten ops: the same bits (unless tol)
            torch.testing.assert_close(
                a, b, rtol=tol, atol=tol, equal_nan=True, msg=lambda m, i=i: f"{where}[{i}]: {m}"
            )
        else:
            assert a == b, f"{where}[{i}]"


def _args(case: Case, seed: int) -> tuple:
    g = torch.Generator().manual_seed(zlib.crc32(case.id.encode()) + seed)
    args = case.make(g)
    for i in case.grad:
        args[i].requires_grad_(True)
    return args


def _run(fn, case: Case, args: tuple):
    """fn(*args) on clones: (outputs, the arguments after the call, gradients of the grad arguments)."""
    args = _clone(args)
    for i in case.grad:
        args[i].requires_grad_(True)
    if case.seeded:
        torch.manual_seed(1234)
    out = fn(*args)
    grads = []
    if case.grad:
        outs = [o for o in _leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        assert outs, "a differentiable output"
        g = torch.Generator().manual_seed(7)  # the same cotangents on both sides
        loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
        grads = list(torch.autograd.grad(loss, [args[i] for i in case.grad]))
    return _leaves(out), _leaves(args), grads


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _dynamic(case: Case):
    # What fullgraph=True turns on by itself (a data-dependent output size); explain runs without fullgraph.
    on = case.dynamic
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=on, capture_scalar_outputs=on)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_traces_without_graph_breaks(case):
    with _dynamic(case):
        e = torch._dynamo.explain(case.fn)(*_clone(_args(case, 0)))
    assert e.graph_break_count == 0, [f"{r.reason} @ {r.user_stack[-1:]}" for r in e.break_reasons]
    assert e.graph_count == 1
    targets = {str(n.target) for g in e.graphs for n in g.graph.nodes if n.op == "call_function"}
    if case.op:  # the registered custom op is in the graph (not a Python path run while tracing)
        assert any(x.startswith("torsh.") for x in targets), sorted(targets)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_compiled_call_gives_the_eager_result(case):
    compiled = torch.compile(case.fn, fullgraph=True, backend="aot_eager")
    for seed in (0, 1):  # twice, on fresh inputs: nothing of the first call's values is baked in
        args = _args(case, seed)
        want_out, want_args, want_grads = _run(case.fn, case, args)
        got_out, got_args, got_grads = _run(compiled, case, args)
        _same(got_out, want_out, "outputs", case.tol)
        _same(got_args, want_args, "arguments", case.tol)  # the mutated ones (residual=, out=, in place) too
        _same(got_grads, want_grads, "gradients", case.tol)


_TORCH_PROVIDER = {
    "flatten-out", "unflatten-accumulate-scale-mixed", "bucket_reduce-out-inplace", "wire_cast-out",
    "quantize-stochastic-no-seed", "topk_compress-residual", "topk_decompress-out-accumulate",
    "sign_compress-residual", "orthogonalize-list", "residual_add-out-residual", "error_update-out-residual-is-acc",
    "moe-layer", "moe-layer-capacity", "moe_aux_loss", "pack-fp16", "unpack-bf16-out-accumulate",
}  # fmt: skip


_TORCH_CASES = [c for c in CASES if c.id in _TORCH_PROVIDER]


@pytest.mark.parametrize("case", _TORCH_CASES, ids=[c.id for c in _TORCH_CASES])
def test_compiled_call_gives_the_eager_result_with_the_torch_provider(case, monkeypatch):
    """The same with the torch provider selected (TORSH_KERNELS_PROVIDER, read when the op runs): the eager
    calls take the torch provider's fast paths, the compiled ones its implementation inside the op."""
    monkeypatch.setenv("TORSH_KERNELS_PROVIDER", "torch")
    test_compiled_call_gives_the_eager_result(case)


# --------------------------------------------------------------------------------------------------- errors


def _nan_at(x: torch.Tensor, i: int = 3) -> torch.Tensor:
    x.view(-1)[i] = float("nan")
    return x


def _err_cases():
    """(id, make(gen) -> args, fn, whether fn promises to write nothing before raising)."""
    return [
        ("topk_decompress-index", lambda g: (t(g, 5), torch.tensor([1, 4, 1001, 7, 9]), t(g, 1001)),
         lambda v, i, out: tk.topk_decompress(v, i, 1001, out=out, accumulate=True), True),
        ("topk_decompress-negative-index", lambda g: (t(g, 3), torch.tensor([2, -1, 5], dtype=torch.int32)),
         lambda v, i: tk.topk_decompress(v, i, 50), True),
        ("topk_compress-nan", lambda g: (_nan_at(t(g, 1001)), t(g, 1001)),
         lambda x, r: tk.topk_compress(x, ratio=0.05, residual=r), True),
        ("sign_compress-nan", lambda g: (_nan_at(t(g, 1001)), t(g, 1001)), lambda x, r: tk.sign_compress(x, r), True),
        ("quantize-nan", lambda g: (_nan_at(t(g, 1001)),), lambda x: tk.quantize(x), True),
        ("orthogonalize-nan", lambda g: (_nan_at(t(g, 67, 3)),), lambda p: tk.orthogonalize(p), True),
        ("orthogonalize-list-nan", lambda g: ([t(g, 9, 2), _nan_at(t(g, 41, 2), 50)],),
         lambda ps: tk.orthogonalize(ps), True),
        ("moe_route-nan", lambda g: (_nan_at(t(g, 13, 6)),), lambda x: tk.moe_route(x, k=2).weights, True),
        ("pack-fp16-range", lambda g: (t(g, 1001).mul_(1e5),), lambda x: ops.pack(x, "fp16").data, True),
        ("residual_add-nan", lambda g: (_nan_at(t(g, 1001)), t(g, 1001)), lambda x, r: tk.residual_add(x, r), False),
        ("wire_cast-overflow", lambda g: (t(g, 1001).mul_(1e5),), lambda x: tk.wire_cast(x), False),
    ]  # fmt: skip


@pytest.mark.parametrize("make,fn,untouched", [c[1:] for c in _err_cases()], ids=[c[0] for c in _err_cases()])
def test_checks_on_values_raise_the_eager_error_from_the_compiled_call(make, fn, untouched):
    """Index ranges and NaN/Inf are known at run time only: the custom op checks them, so the compiled call
    raises what the eager call raises (type and message); where the eager op writes nothing before raising,
    neither does the compiled one."""
    args = make(torch.Generator().manual_seed(5))
    eager_args, compiled_args = _clone(args), _clone(args)
    with pytest.raises(tk.TorshKernelsError) as eager:
        fn(*eager_args)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(type(eager.value)) as got:
        compiled(*compiled_args)
    assert str(got.value) == str(eager.value)
    if untouched:
        _same(_leaves(compiled_args), _leaves(args), "arguments")
        _same(_leaves(eager_args), _leaves(args), "arguments (eager)")


def _overlap_cases():
    """(id, eager call, the registered op's call with traced=True) on the same overlapping tensors."""
    g = torch.Generator().manual_seed(9)
    x, r = t(g, 101), t(g, 101)
    buf = t(g, 200)
    two = t(g, 30)
    mats = t(g, 40)
    T = torch.ops.torsh
    idx = torch.tensor([1, 5, 9])
    return [
        ("topk_compress", lambda: tk.topk_compress(x, ratio=0.1, residual=x),
         lambda: T.topk_compress(x, x, 11, False, True, "", True)),
        ("sign_compress", lambda: tk.sign_compress(buf[:100], buf[50:150]),
         lambda: T.sign_compress(buf[:100], buf[50:150], True, "", True)),
        ("topk_decompress-overlap", lambda: tk.topk_decompress(buf[:3], idx, 200, out=buf),
         lambda: T.topk_decompress(buf[:3], idx, buf, False, 1.0, "", True)),
        ("topk_decompress-index", lambda: tk.topk_decompress(x[:3], idx, 9, provider="torch"),
         lambda: T.topk_decompress(x[:3], idx, torch.empty(9), False, 1.0, "torch", True)),
        ("residual_add", lambda: tk.residual_add(buf[:100], r[:100], out=buf[1:101]),
         lambda: T.residual_add(buf[:100], r[:100], buf[1:101], True, "", True)),
        ("error_update", lambda: tk.error_update(x, buf[:101], buf[50:151]),
         lambda: T.error_update(x, buf[:101], buf[50:151], None, "", True)),
        ("wire_cast", lambda: tk.wire_cast(buf[:100], torch.float32, out=buf[1:101]),
         lambda: T.wire_cast(buf[:100], buf[1:101], 1.0, True, "", True)),
        ("flatten_out", lambda: tk.flatten([x, buf[:50]], out=buf[40:191]),
         lambda: T.flatten_out([x, buf[:50]], buf[40:191], 1.0, "", True)),
        ("unflatten", lambda: tk.unflatten(x[:20], tk.BucketLayout.for_tensors([two[:10], two[5:15]]),
                                           [two[:10], two[5:15]]),
         lambda: T.unflatten(x[:20], [two[:10], two[5:15]], 1.0, False, "", True)),
        ("unflatten-flat", lambda: tk.unflatten(buf[:20], tk.BucketLayout.for_tensors([buf[1:21]]), [buf[1:21]]),
         lambda: T.unflatten(buf[:20], [buf[1:21]], 1.0, False, "", True)),
        ("bucket_reduce_out", lambda: tk.bucket_reduce([buf[:50], buf[100:150]], out=buf[1:51]),
         lambda: T.bucket_reduce_out([buf[:50], buf[100:150]], buf[1:51], "sum", "", True)),
        ("orthogonalize", lambda: tk.orthogonalize([mats[:20].view(10, 2), mats[10:30].view(10, 2)]),
         lambda: T.orthogonalize([mats[:20].view(10, 2), mats[10:30].view(10, 2)], 1e-4, 2, "", True, True)),
    ]  # fmt: skip


@pytest.mark.parametrize("eager,op", [c[1:] for c in _overlap_cases()], ids=[c[0] for c in _overlap_cases()])
def test_checks_on_memory_run_in_the_op_when_traced(eager, op):
    """The checks on addresses (overlaps) and indices a traced public function leaves to its custom op
    (``traced=True``) raise there what the eager function raises. (Under torch.compile with aot_eager the
    op sees functionalized copies of what it writes, which never overlap; a backend that runs the op in
    place on the caller's tensors (inductor's reinplacing) gives it the real ones.)"""
    with pytest.raises(tk.ShapeError) as want:
        eager()
    with pytest.raises(tk.ShapeError) as got:
        op()
    assert str(got.value) == str(want.value)


def test_arguments_rejected_while_tracing_name_the_eager_error():
    """Arguments wrong by their type, value, shape or dtype are rejected while dynamo traces: with
    fullgraph=True dynamo reports the eager error inside its own (torch._dynamo.exc.Unsupported); without,
    it runs the call eagerly, which raises it."""
    x = torch.randn(100)
    bad = [
        lambda: tk.topk_compress(x, ratio=2.0),
        lambda: tk.quantize(x, bits=3),
        lambda: tk.residual_add(x, torch.randn(99)),
        lambda: tk.moe_aux_loss(torch.randn(13, 6), tk.moe_route(torch.randn(13, 6), k=2), provider="nope"),
    ]
    for fn in bad:
        with pytest.raises(tk.TorshKernelsError) as want:
            fn()
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported) as got:
            torch.compile(fn, fullgraph=True, backend="aot_eager")()
        assert str(want.value) in str(got.value)
        torch._dynamo.reset()
        with pytest.raises(type(want.value), match=re.escape(str(want.value))):
            torch.compile(fn, backend="aot_eager")()


def test_custom_ops_pass_opcheck_with_the_traced_arguments():
    """The schemas, fake implementations and declared mutations of the arguments a traced call passes
    (traced=True, an in-graph seed, check_finite in the op) and of torsh::pack_cast (torch.library.opcheck)."""
    g = torch.Generator().manual_seed(3)
    x, r, y = t(g, 101), t(g, 101), t(g, 101, dtype=BF16)
    T = torch.ops.torsh
    q, s = tk.quantize(x, block=32)
    cases = [
        (T.quantize.default, (x, 4, 32, True, 0, True, "", torch.tensor([12345]))),
        (T.quantize_out.default, (x, torch.empty(101, dtype=torch.int8), torch.empty(4), 8, 32, True, 0, True, "",
                                  torch.tensor([7]))),
        (T.topk_compress.default, (x, r, 11, False, True, "", True)),
        (T.topk_decompress.default, (y[:11], torch.arange(0, 101, 10), t(g, 101), True, 0.5, "", True)),
        (T.sign_compress.default, (y, r, True, "", True)),
        (T.residual_add.default, (y, r, t(g, 101), True, "", True)),
        (T.error_update.default, (x, r, t(g, 101), t(g, 101, dtype=F16), "", True)),
        (T.wire_cast.default, (x, t(g, 101, dtype=F16), 2.0, True, "", True)),
        (T.flatten_out.default, ([x, y], t(g, 202), 0.5, "", True)),
        (T.unflatten.default, (t(g, 202), [t(g, 101), t(g, 101, dtype=F16)], 1.0, True, "", True)),
        (T.bucket_reduce_out.default, ([x, r], x, "avg", "", True)),
        (T.orthogonalize.default, ([t(g, 41, 2), t(g, 9, 2)], 1e-4, 2, "", True, True)),
        (T.pack_cast.default, (x, torch.empty(101, dtype=F16), True, "")),
        (T.dequantize.default, (q, s, t(g, 101), 8, 32, 1.0, True, "")),
    ]  # fmt: skip
    for op, args in cases:
        torch.library.opcheck(op, args)
