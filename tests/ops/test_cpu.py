"""The cpu provider (ops/cpu_common.py and the families' ops/<family>/cpu.py kernels) beyond what the per-op tests
check for every provider (each op against its torch reference, per dtype, odd sizes, poisoned outputs):
its fast paths stand aside under a mode and for a subclass, mark what they write as modified, check
indices before writing through memory, the losses' kernels against autograd of the references, and the
things it decides itself (top-k ties, the default provider on the CPU)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import torsh_kernels as tk
import torsh_kernels.ops.moe as M
from torsh_kernels.errors import NonFiniteError, ProviderUnavailableError, ShapeError
from torsh_kernels.ops import registry

quantize_mod = sys.modules["torsh_kernels.ops.quantize.api"]


def test_the_cpu_provider_is_what_runs_on_cpu_tensors_by_default():
    assert registry.untuned_default("quantize", torch.device("cpu")) == "cpu"
    assert registry.untuned_default("quantize", torch.device("cuda")) == "triton"
    x = torch.randn(1000)
    q, s = tk.quantize(x)
    q2, s2 = tk.quantize(x, provider="cpu")
    assert torch.equal(q, q2) and torch.equal(s, s2)
    assert "CPU tensors" in registry.can_run("cpu", torch.device("meta"))
    with pytest.raises(ProviderUnavailableError, match="CPU tensors"):
        registry._OPS["quantize"].select(torch.device("cuda"), torch.float32, 10, "cpu")


class _Count(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_fast_paths_stand_aside_under_a_mode_and_for_a_subclass(monkeypatch):
    """The fast path calls the kernel itself; the registered op reaches it through the provider's wrapper."""
    calls = []
    K = quantize_mod.cpu_kernels()
    real = K.quantize
    monkeypatch.setattr(K, "quantize", lambda *a: calls.append(a) or real(*a))
    x = torch.randn(512)
    q, s = tk.quantize(x)
    assert not calls, "a plain CPU tensor takes the fast path"
    with _Count() as mode:
        q2, s2 = tk.quantize(x)
    assert len(calls) == 1 and any("torsh" in str(f) for f in mode.seen), "a mode sees the registered op"
    tk.quantize(x.as_subclass(type("Sub", (torch.Tensor,), {})))
    assert len(calls) == 2, "so does a subclass"
    assert torch.equal(q, q2) and torch.equal(s, s2), "the same kernel either way"


def test_in_place_fast_paths_bump_the_version_counter():
    x, r, out = torch.randn(257), torch.randn(257), torch.empty(257)
    v = out._version
    tk.residual_add(x, r, out=out)
    assert out._version > v
    acc, approx, res = torch.randn(257), torch.randn(257), torch.empty(257)
    v = res._version
    tk.error_update(acc, approx, res)
    assert res._version > v
    m = torch.randn(40, 3)
    v = m._version
    tk.orthogonalize(m)
    assert m._version > v
    for compress in (lambda x, r: tk.sign_compress(x, r), lambda x, r: tk.topk_compress(x, ratio=0.1, residual=r)):
        res = torch.randn(100)
        v = res._version
        compress(torch.randn(100), res)
        assert res._version > v


def test_a_routing_that_points_outside_the_rows_is_refused_before_anything_is_written():
    logits = torch.randn(6, 4)
    r = tk.moe_route(logits, k=2)
    x = torch.randn(6, 5)
    y = tk.moe_permute(x, r)
    keep = {f: getattr(r, f) for f in r.__dataclass_fields__ if f not in ("row_map", "token_index")}
    bad = M.Routing(**keep, row_map=r.row_map.clone().fill_(r.num_rows), token_index=r.token_index.clone().fill_(6))
    with pytest.raises(ShapeError, match="outside the rows"):
        tk.moe_permute(x, bad)
    with pytest.raises(ShapeError, match="outside the rows"):
        tk.moe_unpermute(y, bad)
    idx = torch.tensor([0, 5, 1000])
    with pytest.raises(ShapeError, match="1000"):
        tk.topk_decompress(torch.ones(3), idx, 10)
    out = torch.full((10,), 7.0)
    with pytest.raises(ShapeError, match="1000"):
        tk.topk_decompress(torch.ones(3), idx, 10, out=out, accumulate=True)
    assert bool((out == 7.0).all()), "nothing was written"
    wrong = M.Routing(**{f: getattr(r, f) for f in r.__dataclass_fields__ if f != "indices"},
                      indices=r.indices.clone().fill_(9))  # fmt: skip
    for grad in (False, True):
        with pytest.raises(ShapeError, match="not an expert"):
            tk.moe_aux_loss(logits.clone().requires_grad_(grad), wrong)


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "probs"])
def test_aux_and_z_loss_kernels_match_autograd_of_the_references(score):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(37, 7, generator=g) * 3).requires_grad_()
    r = tk.moe_route(logits.detach(), k=2, score="sigmoid" if score == "sigmoid" else "softmax")
    grads = []
    for provider in ("cpu", "torch"):
        logits.grad = None
        inp = torch.softmax(logits, -1) if score == "probs" else logits
        loss = tk.moe_aux_loss(inp, r, from_probs=score == "probs", provider=provider) * 0.7
        loss = loss + tk.moe_z_loss(logits, provider=provider) * 1.3
        loss.backward()
        grads.append((loss.detach(), logits.grad.clone()))
    (a, ga), (b, gb) = grads
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)
    assert float(gb.abs().sum()) > 0


@pytest.mark.parametrize("score", ["softmax", "sigmoid", "probs"])
def test_loss_kernels_second_derivative_matches_the_references(score):
    """create_graph=True: the backward is differentiable again (a gradient penalty gets its full gradient)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 4, generator=g).requires_grad_()
    r = tk.moe_route(logits.detach(), k=2, score="sigmoid" if score == "sigmoid" else "softmax")
    out = []
    for provider in ("cpu", "torch"):
        inp = torch.softmax(logits, -1) if score == "probs" else logits
        loss = tk.moe_aux_loss(inp, r, from_probs=score == "probs", provider=provider) + tk.moe_z_loss(
            logits, provider=provider
        )
        (gr,) = torch.autograd.grad(loss, logits, create_graph=True)
        (hv,) = torch.autograd.grad(gr.square().sum(), logits)
        out.append((gr.detach(), hv))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_loss_kernels_take_16_bit_logits_through_fp32():
    half = torch.randn(5, 3, dtype=torch.bfloat16, requires_grad=True)
    z = tk.moe_z_loss(half)
    z.backward()
    assert z.dtype == torch.float32 and half.grad.dtype == torch.bfloat16
    assert math.isclose(z.item(), M.moe_z_loss_ref(half.detach()).item(), rel_tol=1e-5)


def test_topk_ties_go_to_the_lower_index():
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -3.0, 0.5, 3.0])  # |3| four times; k = 2 keeps the first two
    v, i = tk.topk_compress(x, ratio=2 / 7, exact=True, provider="cpu")
    assert i.tolist() == [1, 3] and v.tolist() == [-3.0, 3.0]
    r = torch.zeros(7)
    v, i = tk.topk_compress(x, ratio=2 / 7, residual=r)  # the fast path: the same rule
    assert i.tolist() == [1, 3] and r.tolist() == [1.0, 0.0, 2.0, 0.0, -3.0, 0.5, 3.0]


def test_nonfinite_input_raises_before_the_residual_is_touched():
    for compress in (lambda x, r: tk.sign_compress(x, r), lambda x, r: tk.topk_compress(x, ratio=0.5, residual=r)):
        x = torch.randn(64)
        x[5] = float("nan")
        r = torch.randn(64)
        before = r.clone()
        with pytest.raises(NonFiniteError, match="1 non-finite"):
            compress(x, r)
        assert torch.equal(r, before)


def test_pointer_casts_view_the_tensor_memory():
    """A kernel entry point sees the tensor's own memory through its address (no copy), in both directions."""
    x = torch.arange(10, dtype=torch.float32)
    out = torch.full((10,), float("nan"))
    K = sys.modules["torsh_kernels.ops.error_feedback.api"].cpu_kernels()
    assert K.axpby_ptr(x.data_ptr(), x.data_ptr(), out.data_ptr(), 10, 0.5, True) == 0
    assert torch.equal(out, x * 1.5)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("cf", [None, 0.8])
def test_route_of_many_tokens_scores_in_torch_and_matches_the_reference(score, cf):
    """From TORSH_SCORES_FROM scores on, the cpu route takes torch's scores: the same routing as the
    reference (and as its own kernel-scored path would give, to fp32 rounding)."""
    from torsh_kernels.ops.moe import cpu as M_cpu

    T = M_cpu.TORCH_SCORES_FROM // 8 + 3
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(T, 8, generator=g) * 2
    for grad in (False, True):
        lg = logits.clone().requires_grad_(grad)
        r = tk.moe_route(lg, k=2, score=score, capacity_factor=cf)
        ref = M.moe_route_ref(logits, k=2, score=score, capacity_factor=cf)
        assert torch.equal(r.indices, ref.indices) and torch.equal(r.row_map, ref.row_map)
        assert torch.equal(r.token_index, ref.token_index) and torch.equal(r.tokens_per_expert, ref.tokens_per_expert)
        torch.testing.assert_close(r.weights.detach(), ref.weights, atol=1e-6, rtol=1e-6)
