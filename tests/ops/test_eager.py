"""The direct path (ops/eager.py): plain eager calls skip torch.library's dispatcher and, for the bucket
ops, reuse validation cached per layout. Each public op must give what the registered op gives (outputs
poisoned first, odd sizes, fp32/fp16/bf16), take the dispatcher whenever a mode, a subclass or a needed
gradient says so, and still reject every bad input it rejected before."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import torsh_kernels as tk
from tests.helpers import rand
from torsh_kernels import ops
from torsh_kernels.ops import eager

CPU = torch.device("cpu")


def poison(shape, dtype, device=CPU) -> torch.Tensor:
    return torch.full((shape,) if isinstance(shape, int) else shape, float("nan"), dtype=dtype, device=device)


bucket_api = sys.modules["torsh_kernels.ops.bucket.api"]
bucket_plans = sys.modules["torsh_kernels.ops.bucket.plans"]


@pytest.fixture
def dispatched(monkeypatch):
    """Within the test: every op goes through the registered custom op (as under a dispatch mode)."""

    def force():
        monkeypatch.setattr(eager, "_dispatch_modes", lambda: 1)

    return force


@pytest.fixture
def direct_calls(monkeypatch):
    """Count the implementations run directly (``eager.run``)."""
    seen = []
    real = eager.run
    monkeypatch.setattr(eager, "run", lambda fn, *a: (seen.append(fn), real(fn, *a))[1])
    return seen


def _cases(n: int, dtype: torch.dtype, gen: torch.Generator):
    """(name, function returning the outputs) for every public op, on fresh inputs each call."""
    x = rand(n, dtype, gen, CPU)
    r = rand(n, dtype, gen, CPU)
    ts = [rand(s, dtype, gen, CPU) for s in (n, 3, (5, 2))]
    logits = rand((n % 13 + 3, 6), dtype, gen, CPU)
    h = rand((logits.shape[0], 5), dtype, gen, CPU)
    out = {}

    def flatten_out():
        o = poison(sum(t.numel() for t in ts), dtype, CPU)
        tk.flatten(ts, out=o, scale=0.5, provider="torch")
        return [o]

    def unflatten():
        flat = rand(sum(t.numel() for t in ts), dtype, gen, CPU)
        layout = tk.BucketLayout.for_tensors(ts)
        dst = [poison(t.shape, dtype, CPU) for t in ts]
        tk.unflatten(flat, layout, dst, provider="torch")
        return dst

    def residual_add():
        o = poison(n, torch.float32, CPU)
        rr = r.clone()
        tk.residual_add(x, rr, out=o, provider="torch")
        return [o, rr]

    def error_update():
        res, o = poison(n, torch.float32, CPU), poison(n, dtype, CPU)
        tk.error_update(x.float(), r, res, out=o, provider="torch")
        return [res, o]

    def topk():
        rr = r.clone()
        return [*tk.topk_compress(x, ratio=0.3, residual=rr, provider="torch"), rr]

    def sign():
        rr = r.clone()
        bits, scale = tk.sign_compress(x, rr, provider="torch")
        o = poison(n, dtype, CPU)
        tk.sign_decompress(bits, scale, n, out=o, provider="torch")
        return [bits, scale, rr, o]

    def quant():
        q, s = tk.quantize(x, bits=4, block=64, stochastic=True, seed=7, provider="torch")
        o = poison(n, dtype, CPU)
        tk.dequantize(q, s, block=64, numel=n, out=o, provider="torch")
        return [q, s, o]

    def ortho():
        m = rand((max(n % 50, 4), 3), dtype, gen, CPU).float()
        tk.orthogonalize(m, provider="torch")
        return [m]

    def moe():
        rt = tk.moe_route(logits, k=2, capacity_factor=1.0, provider="torch")
        xp = tk.moe_permute(h, rt, provider="torch")
        y = tk.moe_unpermute(xp, rt, provider="torch")
        return [rt.weights, rt.indices, rt.row_map, rt.token_index, xp, y,
                tk.moe_aux_loss(logits, rt, provider="torch"), tk.moe_z_loss(logits, provider="torch")]  # fmt: skip

    def pack():
        p = ops.pack(x, "int8", block=64, provider="torch")
        return [p.codes, p.scales, ops.unpack(p, provider="torch")]  # (the padding between them is not written)

    out.update(flatten=lambda: [tk.flatten(ts, provider="torch")[0]], flatten_out=flatten_out, unflatten=unflatten,
               bucket_reduce=lambda: [tk.bucket_reduce([x, r], op="avg", provider="torch")], residual_add=residual_add,
               error_update=error_update, topk=topk, sign=sign, quantize=quant, orthogonalize=ortho, moe=moe,
               pack=pack)  # fmt: skip
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_direct_path_gives_what_the_registered_op_gives(n, dtype, dispatched, direct_calls):
    direct = {k: f() for k, f in _cases(n, dtype, torch.Generator().manual_seed(n)).items()}
    assert direct_calls, "the direct path ran"
    dispatched()
    direct_calls.clear()
    via_op = {k: f() for k, f in _cases(n, dtype, torch.Generator().manual_seed(n)).items()}
    assert not direct_calls, "the dispatcher ran"
    for name in direct:
        for a, b in zip(direct[name], via_op[name]):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b) or torch.allclose(a, b, equal_nan=True, atol=0, rtol=0), name
            assert not a.requires_grad


def test_modes_subclasses_and_gradients_take_the_dispatcher(direct_calls):
    x = torch.randn(100)

    class Passthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    # (the torch provider: the cpu provider's fast paths write through NumPy views and never reach
    # eager.run; they too stand aside under a mode or for a subclass, test_fast_paths)
    with Passthrough():
        tk.quantize(x, provider="torch")
        tk.quantize(x)
    assert not direct_calls
    tk.quantize(x.as_subclass(type("Sub", (torch.Tensor,), {})), provider="torch")
    assert not direct_calls
    tk.quantize(x, provider="torch")
    assert len(direct_calls) == 1
    # an op with registered autograd: the dispatcher when a gradient is needed, so the backward is its own
    logits = torch.randn(9, 4, requires_grad=True)
    direct_calls.clear()
    r = tk.moe_route(logits, k=2)
    assert not direct_calls and r.weights.requires_grad
    # each expert row scaled differently (an "expert"), else the routing weights, summing to 1 per token, get
    # no gradient; the same gradient as the torch provider's autograd (the reference) gives, and not zero
    tokens, scale = torch.randn(9, 3), torch.randn(9 * 2, 1)
    tk.moe_unpermute(tk.moe_permute(tokens, r) * scale, r).sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    rr = tk.moe_route(ref_logits, k=2, provider="torch")
    assert torch.equal(rr.row_map, r.row_map)  # the same rows in the same order, so the same scale per row
    tk.moe_unpermute(tk.moe_permute(tokens, rr, provider="torch") * scale, rr, provider="torch").sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert logits.grad.abs().sum() > 0.1
    with torch.no_grad():
        r2 = tk.moe_route(logits, k=2, provider="torch")
        r3 = tk.moe_route(logits, k=2)  # the cpu provider's fast path: the kernel r came from, bit for bit
    assert direct_calls and not r2.weights.requires_grad and not r3.weights.requires_grad
    assert torch.equal(r3.weights, r.weights.detach()) and torch.equal(r3.indices, r.indices)
    torch.testing.assert_close(r2.weights, r.weights.detach(), atol=1e-6, rtol=1e-6)
    assert torch.equal(r2.indices, r.indices)
    # an op without autograd on a tensor requiring grad: no graph, as the custom op gave
    q, s = tk.quantize(torch.randn(64, requires_grad=True))
    assert not q.requires_grad and not s.requires_grad


def test_compiled_callers_still_see_the_custom_ops():
    ts = [torch.randn(5), torch.randn(3)]
    f = torch.compile(lambda a, b: tk.flatten([a, b])[0] * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(*ts), torch.cat(ts) * 2)


def test_cached_validation_still_rejects_what_changed():
    ts = [torch.randn(6), torch.randn(4)]
    out = torch.empty(10)
    for _ in range(2):  # the second call is a cache hit
        tk.flatten(ts, out=out)
    with pytest.raises(tk.ShapeError, match="overlaps"):
        tk.flatten([ts[0], out[:4]], out=out)
    ts[1].as_strided_((2,), (2,))  # same address, now strided: the guard sees it, the layout is rebuilt
    flat, layout = tk.flatten(ts)
    assert layout.shapes == ((6,), (2,)) and torch.equal(flat[6:], ts[1])
    flat, layout = tk.flatten([torch.randn(6), torch.randn(4)])
    dst = [torch.empty(6), torch.empty(4)]
    tk.unflatten(flat, layout, dst)
    tk.unflatten(flat, layout, dst)
    dst[1].as_strided_((4,), (0,))
    with pytest.raises(tk.ShapeError, match="expanded"):
        tk.unflatten(flat, layout, dst)
    with pytest.raises(tk.LayoutMismatchError):
        tk.unflatten(flat, layout, [dst[0]])
    with pytest.raises(tk.ArgumentTypeError):
        tk.flatten([ts[0], "x"], out=out)
    d2 = [torch.empty(6), torch.empty(4, dtype=torch.int32)]
    with pytest.raises(tk.DTypeError):
        tk.unflatten(flat, layout, d2)


@pytest.mark.parametrize("provider", ["torch", "triton", "numba"])
def test_flatten_plan_found_by_the_list_rechecks_the_memory(provider):
    """A plan is found by the list object; a tensor whose storage was swapped in place (same object, same
    metadata) is read from its new memory, so is a list item replaced by another tensor, a replacement of
    another shape gets a new layout, and an out that now overlaps an input is still refused with the typed
    error (torch.cat's own check on the torch path, the address check on the kernels' paths)."""
    ts = [torch.randn(5), torch.randn(3)]
    out = poison(8, torch.float32)
    for _ in range(2):  # the second call is a cache hit
        tk.flatten(ts, out=out, provider=provider)
    assert torch.equal(out, torch.cat(ts))
    ts[1].set_(torch.randn(3))  # same object and metadata, new memory
    out.fill_(float("nan"))
    tk.flatten(ts, out=out, provider=provider)
    assert torch.equal(out, torch.cat(ts))
    ts[0] = torch.randn(5)  # the same list holding another tensor
    out.fill_(float("nan"))
    tk.flatten(ts, out=out, provider=provider)
    assert torch.equal(out, torch.cat(ts))
    ts[0] = torch.randn(1, 5)  # ... of another shape
    flat, layout = tk.flatten(ts, provider=provider)
    assert layout.shapes == ((1, 5), (3,)) and torch.equal(flat, torch.cat([ts[0].view(-1), ts[1]]))
    ts[0] = torch.randn(5)
    ts[1].set_(out.untyped_storage(), 2, (3,), (1,))  # now inside out
    with pytest.raises(tk.ShapeError, match="overlaps tensors\\[1\\]"):
        tk.flatten(ts, out=out, provider=provider)


def test_flatten_plan_found_by_address_for_fresh_views(monkeypatch):
    """New view objects over the same memory each call (as ``bucket.gradients()`` gives) reuse the plan."""
    base = torch.randn(12)
    out = torch.empty(12)
    tk.flatten([base[:7], base[7:].view(5, 1)], out=out)
    seen = []
    real = bucket_api.check_tensor_list
    monkeypatch.setattr(bucket_api, "check_tensor_list", lambda *a: (seen.append(1), real(*a))[1])
    for _ in range(3):
        out.zero_()
        tk.flatten([base[:7], base[7:].view(5, 1)], out=out)
        assert torch.equal(out, base)
    assert not seen  # no full validation


def test_fresh_lists_of_many_layouts_keep_their_plans(monkeypatch):
    """Fresh list objects each call, for 40 layouts in turn (a DDP job with 40 buckets): after the first
    round every call finds its plan by address, and storing nothing new, evicts none."""
    bases = [torch.randn(7 + i) for i in range(40)]
    outs = [torch.empty(7 + i) for i in range(40)]
    for b, o in zip(bases, outs):
        tk.flatten([b[:3], b[3:]], out=o)
    seen = []
    real = bucket_api.check_tensor_list
    monkeypatch.setattr(bucket_api, "check_tensor_list", lambda *a: (seen.append(1), real(*a))[1])
    for _ in range(4):
        for b, o in zip(bases, outs):
            tk.flatten([b[:3], b[3:]], out=o)
            assert torch.equal(o, b)
    assert not seen


def test_unflatten_cache_does_not_keep_the_bucket_alive():
    ts = [torch.randn(1000), torch.randn(24)]
    flat, layout = tk.flatten(ts)
    tk.unflatten(flat, layout, ts)
    tk.unflatten(flat, layout, ts)
    ref = weakref.ref(flat)
    del flat
    gc.collect()
    assert ref() is None
    assert not any(p.flat_ref is not None and p.flat_ref() is not None for p in bucket_plans.UNFLAT_PLANS.data.values()
                   if p.layout is layout)  # fmt: skip


def test_every_op_on_meta_tensors_answers_with_meta_results():
    """One rule for meta tensors (issue 24): shapes, dtypes and devices are checked as for real tensors and
    the op's fake implementation answers (orthogonalize failed in Tensor.item(), several ops saw every meta
    tensor at address 0 and refused a false overlap); only what meta tensors cannot say is refused (moe_route
    with a capacity: the row count depends on the values)."""

    def m(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    outs = [
        tk.flatten([m(5), m(2, 3)], out=m(11))[0],
        tk.bucket_reduce([m(7), m(7)], out=m(7)),
        tk.wire_cast(m(9)),
        tk.quantize(m(37), block=8)[0],
        tk.dequantize(m(37, dtype=torch.int8), m(5), block=8),
        tk.topk_compress(m(40), ratio=0.1, residual=m(40))[0],
        tk.topk_decompress(m(4), m(4, dtype=torch.int64), 10),
        tk.sign_compress(m(21), m(21))[0],
        tk.sign_decompress(m(2, dtype=torch.uint8), m(()), 10),
        tk.orthogonalize(m(9, 3)),
        tk.residual_add(m(13), m(13)),
        ops.count_nonfinite(m(5)),
        ops.pack(m(5), "fp16").data,
        ops.unpack(ops.pack(torch.randn(5)), device="meta"),
        tk.moe_z_loss(m(7, 5)),
    ]
    tk.unflatten(m(11), tk.flatten([torch.ones(5), torch.ones(2, 3)])[1], [m(5), m(2, 3)])
    tk.error_update(m(11), m(11), m(11), out=m(11))
    assert all(t.is_meta for t in outs)
    with pytest.raises(tk.InvalidArgumentError, match="meta"):
        tk.moe_route(m(7, 5), k=2, capacity_factor=1.0)
    with pytest.raises(tk.DeviceMismatchError):
        tk.residual_add(torch.ones(3), m(3))
