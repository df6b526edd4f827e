"""The CPU fast paths of the public ops (fp32, contiguous, torch provider) against the general path.

A plain ``torch.Tensor`` argument takes an op's fast path where it has one; an ``nn.Parameter`` holding
the same values takes the general path (validation, flattening views, the provider through the direct
or registered op). Both must give the same bits, and the fast path must keep the typed errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torsh_kernels as tk
from torsh_kernels.ops import eager

K = tk.ops


def P(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.Parameter(t.clone(), requires_grad=False)


def same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
        assert torch.equal(a.nan_to_num(1234.5), b.nan_to_num(1234.5))
    else:
        assert a == b


def test_fast_path_is_taken_on_plain_cpu_tensors():
    assert eager.fast()


@pytest.mark.parametrize("scale_exp", [-44, -40, -20, 0, 20, 30])
def test_quantize_dequantize(scale_exp):
    g = torch.Generator().manual_seed(scale_exp + 100)
    x = torch.randn(1024, generator=g) * 10.0**scale_exp
    x[256:512] = 0
    x[512:520] = torch.tensor([1e-45, -3e-44, 2e-43, 0.0, -0.0, 5e-45, 1e-40, -1e-39])
    q, s = K.quantize(x)
    qp, sp = K.quantize(P(x))
    same(q, qp)
    same(s, sp)
    same(K.dequantize(q, s, numel=1024), K.dequantize(q, P(s), numel=1024))


def test_quantize_nonfinite_raises_and_passes_through():
    x = torch.randn(1024)
    x[3] = float("nan")
    with pytest.raises(tk.NonFiniteError):
        K.quantize(x)
    for a, b in zip(K.quantize(x, check_finite=False), K.quantize(P(x), check_finite=False)):
        same(a, b)


@pytest.mark.parametrize("n", [8, 1024, 4096])
def test_sign(n):
    for t in range(3):
        x = torch.randn(n) * 10.0**t
        x[::7] = 0
        x[::11] = -0.0
        b, s = K.sign_compress(x)
        bp, sp = K.sign_compress(P(x))
        same(b, bp)
        same(s, sp)
        same(K.sign_decompress(b, s, n), K.sign_decompress(b, P(s), n))
    x[5] = float("inf")
    with pytest.raises(tk.NonFiniteError):
        K.sign_compress(x)


@pytest.mark.parametrize("n", [37, 1024, 5000])
@pytest.mark.parametrize("ratio", [0.01, 0.5, 1.0])
@pytest.mark.parametrize("exact", [False, True])
def test_topk(n, ratio, exact):
    x = (torch.randn(n) * 4).round()  # ties
    a = K.topk_compress(x, ratio=ratio, exact=exact)
    b = K.topk_compress(P(x), ratio=ratio, exact=exact)
    for u, v in zip(a, b):
        same(u, v)
    same(K.topk_decompress(*a, n), K.topk_decompress(P(a[0]), a[1], n))
    x[2] = float("nan")
    with pytest.raises(tk.NonFiniteError):
        K.topk_compress(x, ratio=ratio, exact=exact)
    a = K.topk_compress(x, ratio=ratio, check_finite=False)
    b = K.topk_compress(P(x), ratio=ratio, check_finite=False)
    for u, v in zip(a, b):
        same(u, v)


def test_topk_decompress_bad_index():
    with pytest.raises(tk.ShapeError, match="outside"):
        K.topk_decompress(torch.ones(2), torch.tensor([1, 1024]), 1024)
    with pytest.raises(tk.ShapeError, match="outside"):
        K.topk_decompress(torch.ones(2), torch.tensor([-1, 3], dtype=torch.int32), 1024)


def test_residual_add_and_error_update():
    x, r, o = torch.randn(1024), torch.randn(1024), torch.empty(1024)
    op = torch.empty(1024)
    K.residual_add(x, r, out=o)
    K.residual_add(P(x), r, out=op)
    same(o, op)
    xg = torch.randn(1024, requires_grad=True)
    K.residual_add(xg, r, out=o)
    assert torch.equal(o, xg.detach() + r) and not o.requires_grad
    r2 = r.clone()
    K.residual_add(x, r2, out=r2)  # out may be the residual itself
    assert torch.equal(r2, x + r)
    buf = torch.randn(2048)
    with pytest.raises(tk.ShapeError, match="out overlaps x"):
        K.residual_add(buf[:1024], r, out=buf[1:1025])
    r[7] = float("inf")
    with pytest.raises(tk.NonFiniteError):
        K.residual_add(x, r, out=o)
    acc, approx = torch.randn(1024), torch.randn(1024)
    res, out, res2, out2 = (torch.empty(1024) for _ in range(4))
    K.error_update(acc, approx, res, out=out)
    K.error_update(P(acc), approx, res2, out=out2)
    same(res, res2)
    same(out, out2)
    with pytest.raises(tk.ShapeError):
        K.error_update(acc, approx, approx, out=out)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_bucket_reduce(op, k):
    bufs = [torch.randn(3, 7) for _ in range(k)]
    bufs[1][0, 0] = float("nan")  # "max" propagates NaN
    bufs[0][1, 1] = float("inf")
    same(K.bucket_reduce(bufs, op=op), K.bucket_reduce([P(b) for b in bufs], op=op))


@pytest.mark.parametrize("case", range(12))
def test_orthogonalize(case):
    m = torch.randn(64, 4) * 10.0 ** (case % 7 - 3)
    if case % 4 == 1:
        m[:, 2] = m[:, 0] * 2  # dependent: the general path's CholeskyQR
    if case % 4 == 2:
        m[:, 1] = 0
    a, b = m.clone(), P(m)
    K.orthogonalize(a)
    K.orthogonalize(b)
    assert torch.equal(a, b.data)
    m[3, 1] = float("nan")
    with pytest.raises(tk.NonFiniteError):
        K.orthogonalize(m)


@pytest.mark.parametrize("T,E,k", [(16, 8, 2), (5, 3, 1), (40, 16, 4), (1, 1, 1), (7, 4, 4)])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe(T, E, k, score, renormalize):
    logits = torch.randn(T, E).round()  # ties
    a = K.moe_route(logits, k=k, score=score, renormalize=renormalize)
    b = K.moe_route(P(logits), k=k, score=score, renormalize=renormalize)
    for f in dataclasses.fields(a):
        same(getattr(a, f.name), getattr(b, f.name))
    x = torch.randn(T, 32)
    same(K.moe_permute(x, a), K.moe_permute(P(x), a))
    y = torch.randn(T * k, 32)
    same(K.moe_unpermute(y, a), K.moe_unpermute(P(y), a))
    logits[0, 0] = float("nan")
    with pytest.raises(tk.NonFiniteError):
        K.moe_route(logits, k=k, score=score)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1024,), (4, 5, 6)])
def test_pack(dtype, shape):
    x = torch.randn(*shape).to(dtype)
    for fmt, cf in (("bf16", True), ("fp16", False)):
        a, b = K.pack(x, fmt, check_finite=cf), K.pack(P(x), fmt, check_finite=cf)
        same(a.data, b.data)
        assert (a.fmt, a.shape, a.dtype, a.block) == (b.fmt, b.shape, b.dtype, b.block)
        same(K.unpack(a), K.unpack(b))
    assert not K.pack(torch.randn(8, requires_grad=True)).data.requires_grad
