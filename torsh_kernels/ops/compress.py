"""Gradient compression ops: top-k with error feedback, blockwise quantization, 1-bit signs, PowerSGD pieces.

Every op works on the flattened elements of its input (any shape; fp32, fp16 or bf16) and computes in
fp32. Payloads are plain tensors, so the collectives layer can all-reduce or all-gather them.

- ``topk_compress(x, ratio=, residual=, exact=)`` -> ``(values, indices)``: the k = ceil(ratio * n)
  largest magnitudes of ``x + residual``, indices ascending (int32 when n < 2**31). With a residual, the
  residual is left holding exactly what was not sent: ``x + residual_old - scatter(values)``.
  *Approximate mode* (the default, as in Deep Gradient Compression): a threshold is estimated from a
  strided sample, one fused pass compacts the candidates ``|v| >= threshold`` into a buffer of
  ``CAP = k + ceil(TOPK_SLACK * k)`` slots, and the k largest candidates are kept. The estimate is
  *refined* (threshold re-estimated from the sample with the observed count) when the candidate count
  misses the band ``[k, CAP]``: below k (too few) or above ``(1 + TOPK_SLACK) * k`` (overflow), at most
  ``TOPK_REFINE`` times, then the exact path runs. Whenever the count lands in the band, every one of
  the true top k is a candidate, so the result equals the exact top-k (ties at the threshold may be
  broken differently); what is approximate is the threshold, and its cost is one pass plus a top-k
  over at most CAP elements instead of a top-k over n. ``exact=True`` selects with a top-k over all n.
- ``topk_decompress(values, indices, numel, out=, accumulate=, alpha=)``: scatter (or scatter-add, with
  duplicate indices summed: the all-gathered payloads of several ranks) ``alpha * values``.
- ``quantize(x, bits=8|4, block=256, stochastic=, seed=)`` -> ``(q, scales)``: symmetric blockwise absmax
  scaling, ``scale = absmax / qmax`` (qmax 127 or 7), codes ``round(x / scale)`` (to nearest even) or
  ``floor(x / scale + u)`` with ``u`` uniform in [0, 1) from a counter-based hash of (seed, element
  index): stochastic rounding that is unbiased and reproducible from the seed, bit-identical across
  providers. int8 codes one per byte; int4 codes two per byte (element 2i in the low nibble, 2i+1 in the
  high, two's complement). ``dequantize`` reverses it. Error bound per element: ``scale / 2`` (round to
  nearest) or ``scale`` (stochastic), i.e. ``absmax / (2 * qmax)`` resp. ``absmax / qmax`` of its block,
  plus fp32 rounding.
- ``sign_compress(x, residual=)`` -> ``(bits, scale)``: 8 signs per byte (element 8i + j in bit j; 1 for
  ``v >= 0``) and ``scale = mean(|v|)`` (summed in fp64), v = x + residual; with a residual, it is left
  holding ``v - scale * sign(v)`` (EF-SignSGD). ``sign_decompress`` gives ``+-scale``.
- ``orthogonalize(matrices)``: in-place orthonormalisation of the columns of tall thin matrices
  ([m, r], [B, m, r] or a list of [m_i, r]), the step between PowerSGD's two matmuls. The kernels run
  CholeskyQR2 with the Gram matrix accumulated in fp64: two passes over the data per iteration,
  independent of r, where Gram-Schmidt makes r. A column whose component orthogonal to the previous
  ones is below ``rtol`` of its own norm (a zero or linearly dependent column) becomes a zero column,
  never NaN.
- ``residual_add(x, residual, out=)`` and ``error_update(acc, approx, residual, out=)``: the fused
  error-feedback steps around a lossy compression (``acc = x + residual``; ``residual = acc - approx``,
  with ``approx`` optionally copied, cast, into the gradient).

Non-finite inputs are reported, not spread: compressing ops count NaN/Inf in their first pass and raise
:class:`NonFiniteError` before writing anything the caller owns (``check_finite=False`` skips the check
and its host synchronisation; a quantization block holding NaN/Inf then gets a NaN scale).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from ..errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from .bucket import _on, _ptr_table, _Ranges
from .registry import Op, _triton_state, tuned_meta

try:
    import triton
    import triton.language as tl

    _HAVE_TRITON = _triton_state()[2] is None
except Exception:
    _HAVE_TRITON = False

__all__ = [
    "dequantize",
    "dequantize_ref",
    "error_update",
    "error_update_ref",
    "orthogonalize",
    "orthogonalize_ref",
    "quantize",
    "quantize_ref",
    "residual_add",
    "residual_add_ref",
    "sign_compress",
    "sign_compress_ref",
    "sign_decompress",
    "sign_decompress_ref",
    "topk_compress",
    "topk_compress_ref",
    "topk_decompress",
    "topk_decompress_ref",
]

COMPRESS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ORTHO_DTYPES = (*COMPRESS_DTYPES, torch.float64)

# Top-k approximate mode: candidate buffer slack over k, and refinement rounds before the exact path.
TOPK_SLACK = 0.25
TOPK_REFINE = 4
TOPK_MIN_SAMPLE = 65536
TOPK_SAMPLE_PER_K = 1024  # the sample holds about this many expected top-k elements (when n allows)
_TOPK_TARGET = 1 + TOPK_SLACK / 2  # aim at the middle of the band

QMAX = {8: 127.0, 4: 7.0}
MAX_KERNEL_RANK = 32  # orthogonalize kernels keep an r x r Gram matrix in registers / local memory

# Kernel geometry (memory-bound passes).
BLOCK = 4096
WARPS = 8
QTILE = 4096  # elements per Triton quantize program (several quantization blocks)
SIGN_BYTES = 512  # packed bytes per Triton sign program
ORTHO_ELEMS = 4096  # elements of the [ROWS, RP, RP] product tile in the orthogonalize kernel

# --------------------------------------------------------------------------------------------------
# Validation


def _check_tensor(t: object, what: str, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _check_dtype(t: torch.Tensor, what: str, name: str, allowed=COMPRESS_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise DTypeError(f"{what}: {name} has dtype {t.dtype}; expected one of {names}")


def _flat_input(x: object, what: str, name: str = "x") -> torch.Tensor:
    """A floating input as a contiguous 1-D tensor (a view when it already is contiguous)."""
    x = _check_tensor(x, what, name)
    _check_dtype(x, what, name)
    return x.detach().reshape(-1).contiguous() if not x.is_contiguous() else x.detach().view(-1)


def _flat_inout(t: object, what: str, name: str, numel: int, device: torch.device) -> torch.Tensor:
    """A tensor the op writes: contiguous, ``numel`` elements, on ``device``; as a 1-D view."""
    t = _check_tensor(t, what, name)
    _check_dtype(t, what, name)
    if t.device != device:
        raise DeviceMismatchError(f"{what}: {name} is on {t.device}, the input on {device}")
    if t.numel() != numel:
        raise ShapeError(f"{what}: {name} has {t.numel()} elements, expected {numel} (one per input element)")
    if not t.is_contiguous():
        raise ShapeError(f"{what}: {name} must be contiguous (it is written in place)")
    return t.detach().view(-1)


def _no_overlap(a: torch.Tensor, b: torch.Tensor, what: str, na: str, nb: str, *, same_ok: bool = False) -> None:
    """Raise if ``a`` and ``b`` share memory (unless ``same_ok`` and they are the same elements)."""
    if not _Ranges.of([a]).overlapping(b)[0]:
        return
    if same_ok and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel():
        return
    raise ShapeError(f"{what}: {na} overlaps {nb}; pass separate buffers")


def _check_alpha(alpha: object, what: str) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ArgumentTypeError(f"{what}: alpha must be a real number, got {type(alpha).__name__}")
    if not math.isfinite(alpha):
        raise InvalidArgumentError(f"{what}: alpha must be finite, got {alpha}")
    return float(alpha)


def _check_int(v: object, what: str, name: str, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ArgumentTypeError(f"{what}: {name} must be an int, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise InvalidArgumentError(f"{what}: {name} must be >= {lo}, got {v}")
    return v


def _raise_nonfinite(bad: int, what: str, name: str) -> None:
    raise NonFiniteError(
        f"{what}: {name} holds {bad} non-finite element(s) (NaN or Inf); nothing was compressed and no "
        "residual was modified. Find the source (a loss scale too high, a diverging step) or skip the "
        "step; pass check_finite=False to compress anyway."
    )


def topk_count(numel: int, ratio: float) -> int:
    """k for a density ``ratio`` of ``numel`` elements: ceil(ratio * numel), at least 1."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


# --------------------------------------------------------------------------------------------------
# Stochastic rounding noise: a counter-based hash of (seed, element index), the same in every provider.

_M32 = 0xFFFFFFFF


def _lowbias32_int(h: int) -> int:
    h &= _M32
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & _M32
    h ^= h >> 16
    return h


def seed_key(seed: int) -> int:
    """The 32-bit key the kernels mix with element indices (any Python int seed, folded to 64 bits)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return _lowbias32_int((s & _M32) ^ _lowbias32_int((s >> 32) + 0x9E3779B9))


def _i32(c: int) -> int:
    """A 32-bit pattern as the signed int32 value with the same bits."""
    return c - (1 << 32) if c & 0x80000000 else c


def _lowbias32_t(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int32 tensors: two's-complement multiplication wraps modulo 2**32 (as on every
    platform PyTorch runs on), and the masks turn the arithmetic shifts into logical ones. The Triton
    and Numba kernels compute the same bits in uint32 / masked int64 (tested bit for bit)."""
    h = h ^ (h >> 16).bitwise_and_(0xFFFF)
    h.mul_(0x7FEB352D)
    h.bitwise_xor_((h >> 15).bitwise_and_(0x1FFFF))
    h.mul_(_i32(0x846CA68B))
    return h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))


def uniform_noise(idx: torch.Tensor, key: int) -> torch.Tensor:
    """u in [0, 1) (fp32, 24 random bits) for integer element indices ``idx`` (used modulo 2**32) and a
    seed key."""
    if idx.dtype != torch.int32:
        idx = ((idx & _M32) ^ 0x80000000).to(torch.int32) ^ _i32(0x80000000)  # low 32 bits, no overflow
    h = _lowbias32_t(_lowbias32_t(idx).bitwise_xor_(_i32(key)))
    return h.__irshift__(8).bitwise_and_(0xFFFFFF).to(torch.float32).mul_(1.0 / 16777216.0)


# --------------------------------------------------------------------------------------------------
# Torch references (the oracles for the tests; plain PyTorch, any device)


def _acc_ref(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    acc = x.reshape(-1).float()
    return acc + residual.reshape(-1).float() if residual is not None else acc.clone()


def topk_compress_ref(
    x: torch.Tensor, *, ratio: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of |x + residual| by torch.topk, indices ascending; residual keeps what was not sent."""
    acc = _acc_ref(x, residual)
    if not torch.isfinite(acc).all():
        raise NonFiniteError("topk_compress_ref: non-finite input")
    k = topk_count(acc.numel(), ratio)
    idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
    values = acc[idx].to(x.dtype)
    if residual is not None:
        acc[idx] -= values.float()
        residual.view(-1).copy_(acc)
    return values, idx.to(index_dtype(acc.numel()))


def topk_decompress_ref(values, indices, numel, *, out=None, accumulate=False, alpha=1.0) -> torch.Tensor:
    if out is None:
        out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    acc = out.reshape(-1).float() if accumulate else torch.zeros(numel, device=values.device)
    acc.index_add_(0, indices.long(), values.float() * alpha)
    out.view(-1).copy_(acc)
    return out


def quantize_ref(
    x: torch.Tensor, *, bits: int = 8, block: int = 256, stochastic: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    v = x.reshape(-1).float()
    n = v.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, device=v.device)
    padded[:n] = v
    blocks = padded.view(nb, block)
    qmax = QMAX[bits]
    scales = blocks.abs().amax(dim=1) / qmax
    bad = ~torch.isfinite(blocks).all(dim=1)
    scales = torch.where(bad, torch.full_like(scales, float("nan")), scales)
    y = torch.where(scales[:, None] > 0, blocks / scales[:, None], torch.zeros_like(blocks)).view(-1)[:n]
    if stochastic:
        u = uniform_noise(torch.arange(n, device=v.device), seed_key(seed))
        q = torch.floor(y + u)
    else:
        q = torch.round(y)  # half to even
    q = torch.nan_to_num(q, nan=0.0).clamp(-qmax, qmax).to(torch.int8)
    if bits == 4:
        if n % 2:
            q = torch.cat([q, q.new_zeros(1)])
        pair = q.view(-1, 2).to(torch.int32) & 15
        q = (pair[:, 0] | (pair[:, 1] << 4)).to(torch.uint8)
    return q, scales


def dequantize_ref(
    q: torch.Tensor, scales: torch.Tensor, *, numel: int, block: int = 256, dtype=torch.float32,
    out=None, accumulate=False, alpha=1.0,
) -> torch.Tensor:  # fmt: skip
    if q.dtype == torch.uint8:
        b = q.to(torch.int32)
        codes = torch.stack([b & 15, (b >> 4) & 15], dim=1).view(-1)
        codes = torch.where(codes >= 8, codes - 16, codes)[:numel]
    else:
        codes = q[:numel].to(torch.int32)
    s = scales.repeat_interleave(block)[:numel]
    return _store_ref(codes.float() * s * alpha, out, dtype, accumulate)


def _store_ref(v: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype, accumulate: bool) -> torch.Tensor:
    """Write decoded fp32 values ``v`` into ``out`` (a new ``dtype`` tensor if None), or add them to it."""
    if out is None:
        out = torch.empty(v.numel(), dtype=dtype, device=v.device)
    if accumulate:
        v = out.reshape(-1).float() + v
    out.view(-1).copy_(v)
    return out


def sign_compress_ref(x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _acc_ref(x, residual)
    n = acc.numel()
    scale = (acc.abs().sum(dtype=torch.float64) / n).float() if n else torch.zeros((), device=acc.device)
    pos = acc >= 0
    nbytes = -(-n // 8)
    padded = torch.zeros(nbytes * 8, dtype=torch.int32, device=acc.device)
    padded[:n] = pos.to(torch.int32)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.int32, device=acc.device)
    bits = (padded.view(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)
    if residual is not None:
        residual.view(-1).copy_(acc - torch.where(pos, scale, -scale))
    return bits, scale


def sign_decompress_ref(bits, scale, numel, *, dtype=torch.float32, out=None, accumulate=False, alpha=1.0):
    b = bits.to(torch.int32)
    pos = ((b[:, None] >> torch.arange(8, device=bits.device)) & 1).view(-1)[:numel] != 0
    s = scale.float() * alpha
    return _store_ref(torch.where(pos, s, -s), out, dtype, accumulate)


def residual_add_ref(x: torch.Tensor, residual: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    acc = x.reshape(-1).float() + residual.reshape(-1).float()
    if out is None:
        return acc.view(x.shape)
    out.view(-1).copy_(acc)
    return out


def error_update_ref(acc, approx, residual, *, out=None) -> None:
    a = approx.reshape(-1).float()
    residual.view(-1).copy_(acc.reshape(-1).float() - a)
    if out is not None:
        out.view(-1).copy_(a)


def default_rtol(dtype: torch.dtype) -> float:
    """Relative norm below which a projected column counts as dependent (zeroed), per input dtype."""
    return {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]


def orthogonalize_ref(matrices, *, rtol: float | None = None):
    """Modified Gram-Schmidt, twice per column, in fp64; dependent/zero columns become zero columns."""
    mats = _matrix_list(matrices, "orthogonalize_ref")
    for m in mats:
        a = m.double()
        q = torch.zeros_like(a)
        tol = default_rtol(m.dtype) if rtol is None else rtol
        for j in range(a.shape[1]):
            v = a[:, j].clone()
            n0 = torch.linalg.vector_norm(v)
            for _ in range(2):
                for i in range(j):
                    v -= (q[:, i] @ v) * q[:, i]
            nv = torch.linalg.vector_norm(v)
            if n0 > 0 and nv > tol * n0:
                q[:, j] = v / nv
        m.copy_(q)
    return matrices


# --------------------------------------------------------------------------------------------------
# Triton kernels

if _HAVE_TRITON:
    from .bucket import _cast

    @triton.jit
    def _nonfinite(v):
        return (v != v) | (tl.abs(v) == float("inf"))

    @triton.jit
    def _lowbias32(h):
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x846CA68B
        return h ^ (h >> 16)

    @triton.jit
    def _uniform(idx, key):
        h = _lowbias32(_lowbias32(idx.to(tl.uint32)) ^ key)
        return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def _load_acc(x_ptr, r_ptr, offs, mask, HAS_R: tl.constexpr):
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_R:
            v = v + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return v

    @triton.jit
    def _axpby_kernel(x_ptr, y_ptr, out_ptr, bad_ptr, n, beta, BLOCK: tl.constexpr, COUNT_BAD: tl.constexpr):
        """out = x + beta * y in fp32; optionally count non-finite results."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        v = v + beta * tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if COUNT_BAD:
            tl.atomic_add(bad_ptr, tl.sum((_nonfinite(v) & m).to(tl.int64)))
        tl.store(out_ptr + offs, _cast(v, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _error_update_kernel(acc_ptr, approx_ptr, res_ptr, out_ptr, n, BLOCK: tl.constexpr, HAS_OUT: tl.constexpr):
        """residual = acc - approx; out = approx (cast)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        a = tl.load(approx_ptr + offs, mask=m, other=0.0).to(tl.float32)
        v = tl.load(acc_ptr + offs, mask=m, other=0.0).to(tl.float32) - a
        tl.store(res_ptr + offs, _cast(v, res_ptr.dtype.element_ty), mask=m)
        if HAS_OUT:
            tl.store(out_ptr + offs, _cast(a, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _topk_candidates_kernel(
        x_ptr, r_ptr, cval_ptr, cidx_ptr, cnt_ptr, n, thr, cap, BLOCK: tl.constexpr, HAS_R: tl.constexpr
    ):
        """Compact the elements with |x + r| >= thr (their fp32 value and index) into slots reserved with
        one atomic per program; cnt[0] counts all candidates (also those past cap), cnt[1] non-finite."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        v = _load_acc(x_ptr, r_ptr, offs, m, HAS_R)
        bad = _nonfinite(v) & m
        sel = m & (tl.abs(v) >= thr) & (~bad)
        s = sel.to(tl.int64)
        base = tl.atomic_add(cnt_ptr, tl.sum(s))
        pos = base + tl.cumsum(s, 0) - 1
        w = sel & (pos < cap)
        tl.store(cval_ptr + pos, v, mask=w)
        tl.store(cidx_ptr + pos, offs.to(cidx_ptr.dtype.element_ty), mask=w)
        tl.atomic_add(cnt_ptr + 1, tl.sum(bad.to(tl.int64)))

    @triton.jit
    def _scatter_kernel(
        val_ptr, idx_ptr, out_ptr, k, numel, alpha, BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr,
        ATOMIC: tl.constexpr,
    ):  # fmt: skip
        """out[idx] = alpha * val (or +=; atomically when indices may repeat)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < k
        i = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
        m = m & (i >= 0) & (i < numel)  # validated before the launch; this keeps memory safe regardless
        v = tl.load(val_ptr + offs, mask=m, other=0.0).to(tl.float32) * alpha
        if ACCUMULATE:
            if ATOMIC:
                tl.atomic_add(out_ptr + i, v, mask=m)
            else:
                v = tl.load(out_ptr + i, mask=m, other=0.0).to(tl.float32) + v
                tl.store(out_ptr + i, _cast(v, out_ptr.dtype.element_ty), mask=m)
        else:
            tl.store(out_ptr + i, _cast(v, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _codes(v, s, e, key, QMAXV: tl.constexpr, STOCHASTIC: tl.constexpr):
        """Integer codes (as fp32) of values v with block scales s."""
        y = tl.where(s > 0, tl.math.div_rn(v, tl.where(s > 0, s, 1.0)), 0.0)
        if STOCHASTIC:
            q = tl.floor(y + _uniform(e, key))
        else:
            q = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds fp32 |y| < 2**22 to nearest even
        q = tl.where(q == q, q, 0.0)
        return tl.minimum(tl.maximum(q, -QMAXV), QMAXV)

    @triton.jit(do_not_specialize=["key"])
    def _quantize_kernel(
        x_ptr, q_ptr, s_ptr, bad_ptr, n, nblocks, key, QBLOCK: tl.constexpr, GROUP: tl.constexpr,
        BITS: tl.constexpr, QMAXV: tl.constexpr, STOCHASTIC: tl.constexpr,
    ):  # fmt: skip
        blk = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)  # [G] quantization blocks
        key = key.to(tl.uint32)
        if BITS == 8:
            e = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]  # [G, QBLOCK]
            m = e < n
            v = tl.load(x_ptr + e, mask=m, other=0.0).to(tl.float32)
            nbad = tl.sum((_nonfinite(v) & m).to(tl.int32), axis=1)
            s = tl.math.div_rn(tl.max(tl.where(m, tl.abs(v), 0.0), axis=1), QMAXV)
            s = tl.where(nbad > 0, float("nan"), s)
            q = _codes(v, s[:, None], e, key, QMAXV, STOCHASTIC)
            tl.store(q_ptr + e, q.to(tl.int8), mask=m)
        else:
            HALF: tl.constexpr = QBLOCK // 2
            j = tl.arange(0, HALF)[None, :]
            e0 = blk[:, None] * QBLOCK + 2 * j  # [G, HALF] even elements; e0 + 1 the odd ones
            m0 = e0 < n
            m1 = (e0 + 1) < n
            v0 = tl.load(x_ptr + e0, mask=m0, other=0.0).to(tl.float32)
            v1 = tl.load(x_ptr + e0 + 1, mask=m1, other=0.0).to(tl.float32)
            nbad = tl.sum((_nonfinite(v0) & m0).to(tl.int32), axis=1)
            nbad += tl.sum((_nonfinite(v1) & m1).to(tl.int32), axis=1)
            amax = tl.max(tl.where(m0, tl.abs(v0), 0.0), axis=1)
            amax = tl.maximum(amax, tl.max(tl.where(m1, tl.abs(v1), 0.0), axis=1))
            s = tl.where(nbad > 0, float("nan"), tl.math.div_rn(amax, QMAXV))
            q0 = _codes(v0, s[:, None], e0, key, QMAXV, STOCHASTIC).to(tl.int32)
            q1 = _codes(v1, s[:, None], e0 + 1, key, QMAXV, STOCHASTIC).to(tl.int32)
            q1 = tl.where(m1, q1, 0)
            byte = (q0 & 15) | ((q1 & 15) << 4)
            tl.store(q_ptr + blk[:, None] * HALF + j, byte.to(tl.uint8), mask=m0)
        tl.store(s_ptr + blk, s, mask=blk < nblocks)
        tl.atomic_add(bad_ptr, tl.sum(nbad).to(tl.int64))

    @triton.jit
    def _dequantize_kernel(
        q_ptr, s_ptr, out_ptr, n, nblocks, alpha, QBLOCK: tl.constexpr, GROUP: tl.constexpr,
        BITS: tl.constexpr, ACCUMULATE: tl.constexpr,
    ):  # fmt: skip
        blk = tl.program_id(0).to(tl.int64) * GROUP + tl.arange(0, GROUP)
        s = tl.load(s_ptr + blk, mask=blk < nblocks, other=0.0)[:, None]
        if BITS == 8:
            e = blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
            m = e < n
            v = tl.load(q_ptr + e, mask=m, other=0).to(tl.float32) * s * alpha
            if ACCUMULATE:
                v = tl.load(out_ptr + e, mask=m, other=0.0).to(tl.float32) + v
            tl.store(out_ptr + e, _cast(v, out_ptr.dtype.element_ty), mask=m)
        else:
            HALF: tl.constexpr = QBLOCK // 2
            j = tl.arange(0, HALF)[None, :]
            e0 = blk[:, None] * QBLOCK + 2 * j
            m0 = e0 < n
            m1 = (e0 + 1) < n
            byte = tl.load(q_ptr + blk[:, None] * HALF + j, mask=m0, other=0).to(tl.int32)
            lo = byte & 15
            hi = (byte >> 4) & 15
            v0 = tl.where(lo >= 8, lo - 16, lo).to(tl.float32) * s * alpha
            v1 = tl.where(hi >= 8, hi - 16, hi).to(tl.float32) * s * alpha
            if ACCUMULATE:
                v0 = tl.load(out_ptr + e0, mask=m0, other=0.0).to(tl.float32) + v0
                v1 = tl.load(out_ptr + e0 + 1, mask=m1, other=0.0).to(tl.float32) + v1
            tl.store(out_ptr + e0, _cast(v0, out_ptr.dtype.element_ty), mask=m0)
            tl.store(out_ptr + e0 + 1, _cast(v1, out_ptr.dtype.element_ty), mask=m1)

    @triton.jit
    def _abs_sum_kernel(x_ptr, r_ptr, part_ptr, bad_ptr, n, BLOCK: tl.constexpr, HAS_R: tl.constexpr):
        """part[pid] = sum |x + r| over this program's elements; bad += non-finite count."""
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        v = _load_acc(x_ptr, r_ptr, offs, m, HAS_R)
        tl.store(part_ptr + pid, tl.sum(tl.abs(v), axis=0))
        tl.atomic_add(bad_ptr, tl.sum((_nonfinite(v) & m).to(tl.int64)))

    @triton.jit
    def _sign_pack_kernel(x_ptr, r_ptr, bits_ptr, scale_ptr, n, nbytes, BYTES: tl.constexpr, HAS_R: tl.constexpr):
        b = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
        j = tl.arange(0, 8)
        e = b[:, None] * 8 + j[None, :]  # [BYTES, 8]
        m = e < n
        v = _load_acc(x_ptr, r_ptr, e, m, HAS_R)
        pos = v >= 0
        byte = tl.sum(tl.where(pos & m, 1 << j[None, :], 0), axis=1)
        tl.store(bits_ptr + b, byte.to(tl.uint8), mask=b < nbytes)
        if HAS_R:
            s = tl.load(scale_ptr)
            tl.store(r_ptr + e, _cast(v - tl.where(pos, s, -s), r_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _sign_unpack_kernel(
        bits_ptr, scale_ptr, out_ptr, n, nbytes, alpha, BYTES: tl.constexpr, ACCUMULATE: tl.constexpr
    ):
        b = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
        j = tl.arange(0, 8)
        e = b[:, None] * 8 + j[None, :]
        m = e < n
        byte = tl.load(bits_ptr + b, mask=b < nbytes, other=0).to(tl.int32)
        s = tl.load(scale_ptr) * alpha
        v = tl.where(((byte[:, None] >> j[None, :]) & 1) != 0, s, -s)
        if ACCUMULATE:
            v = tl.load(out_ptr + e, mask=m, other=0.0).to(tl.float32) + v
        tl.store(out_ptr + e, _cast(v, out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gram_factor(G, r, rtol2, RP: tl.constexpr):
        """Upper-triangular T with T^T G T = I on the independent columns (Gram-Schmidt in the G inner
        product, twice); dependent or zero columns get a zero column in T."""
        cols = tl.arange(0, RP)
        T = tl.zeros((RP, RP), dtype=tl.float64)
        for j in range(0, r):  # a runtime loop: unrolling RP=32 columns made 200k-line PTX
            ej = (cols == j).to(tl.float64)
            t = ej
            for _ in tl.static_range(2):
                gt = tl.sum(G * t[None, :], axis=1)
                c = tl.sum(T * gt[:, None], axis=0)
                t = t - tl.sum(T * c[None, :], axis=1)
            nrm2 = tl.sum(t * tl.sum(G * t[None, :], axis=1), axis=0)
            gjj = tl.sum(tl.sum(G * (ej[:, None] * ej[None, :]), axis=1), axis=0)
            ok = (nrm2 > rtol2 * gjj) & (gjj > 0)
            inv = tl.where(ok, 1.0 / tl.sqrt(tl.where(ok, nrm2, 1.0)), 0.0)
            T = T + (t * inv)[:, None] * ej[None, :]
        return T

    @triton.jit
    def _orthogonalize_kernel(table_ptr, ref_ptr, r, rtol2, ROWS: tl.constexpr, RP: tl.constexpr, ITERS: tl.constexpr):
        """One program per matrix: CholeskyQR, ITERS times, with an fp64 Gram matrix."""
        pid = tl.program_id(0).to(tl.int64)
        base = tl.load(table_ptr + 2 * pid).to(ref_ptr.dtype)
        rows = tl.load(table_ptr + 2 * pid + 1)
        cols = tl.arange(0, RP)
        cm = cols < r
        ri = tl.arange(0, ROWS).to(tl.int64)
        for _ in tl.static_range(ITERS):
            G = tl.zeros((RP, RP), dtype=tl.float64)
            for r0 in range(0, rows, ROWS):
                rr = r0 + ri
                msk = (rr < rows)[:, None] & cm[None, :]
                a = tl.load(base + rr[:, None] * r + cols[None, :], mask=msk, other=0.0).to(tl.float64)
                G += tl.sum(a[:, :, None] * a[:, None, :], axis=0)
            T = _gram_factor(G, r, rtol2, RP)
            for r0 in range(0, rows, ROWS):
                rr = r0 + ri
                msk = (rr < rows)[:, None] & cm[None, :]
                ptrs = base + rr[:, None] * r + cols[None, :]
                a = tl.load(ptrs, mask=msk, other=0.0).to(tl.float64)
                o = tl.sum(a[:, :, None] * T[None, :, :], axis=1)
                tl.store(ptrs, _cast(o, ref_ptr.dtype.element_ty), mask=msk)


def _grid(n: int, block: int) -> tuple[int]:
    return (max(1, -(-n // block)),)


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated, contiguous and 1-D (matrices: 2-D), on one device.

_axpby = Op("residual_add")
_err_update = Op("error_update")
_candidates = Op("topk_compress")
_scatter = Op("topk_decompress")
_quantize = Op("quantize")
_dequantize = Op("dequantize")
_abs_sum = Op("sign_compress")
_sign_pack = Op("sign_compress.pack")
_sign_unpack = Op("sign_decompress")
_ortho = Op("orthogonalize")


def _acc_torch(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x + r in fp32 (x alone without a residual): the torch providers' error-feedback input."""
    return x.float() + r.float() if r is not None else x.float()


def _counter(device: torch.device, n: int = 1) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=device)


_SCRATCH = threading.local()


def _scratch(device: torch.device, n: int) -> torch.Tensor:
    """A float32 work buffer of n elements, reused by later calls on this thread and device (its content
    is garbage; never returned to callers). Saves the allocation and first-touch page faults that a
    fresh tensor costs on the CPU for every call."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    b = bufs.get(device)
    if b is None or b.numel() < n:
        b = bufs[device] = torch.empty(n, dtype=torch.float32, device=device)
    return b[:n]


def _count_nonfinite(v: torch.Tensor) -> torch.Tensor:
    """Number of NaN/Inf elements of v, as an int64 [1] tensor. A plain sum (one vectorised pass, no
    temporary) is finite whenever every element is, so the exact count (a bool pass and a sum over it,
    several times slower) only runs when the sum is not: NaN/Inf present, or a sum that overflowed."""
    if v.numel() == 0 or bool(torch.isfinite(v.sum(dtype=torch.float32))):
        return _counter(v.device)
    return (~torch.isfinite(v)).sum().view(1)


# out = x + beta * y; returns the non-finite count tensor (or None)
@_axpby.register("torch")
def _axpby_torch(x, y, out, beta, count_bad):
    if beta == 1.0 and out.dtype == x.dtype == y.dtype == torch.float32:
        torch.add(x, y, alpha=beta, out=out)  # one pass, no temporary
        v = out
    else:
        v = x.float() + y.float() * beta if beta != 1.0 else x.float() + y.float()
        out.copy_(v)
    return _count_nonfinite(v) if count_bad else None


@_axpby.register("triton")
def _axpby_triton(x, y, out, beta, count_bad):
    bad = _counter(x.device)
    _axpby_kernel[_grid(x.numel(), BLOCK)](x, y, out, bad, x.numel(), beta, BLOCK=BLOCK, COUNT_BAD=count_bad,
                                           num_warps=WARPS, enable_fp_fusion=False)  # fmt: skip
    return bad if count_bad else None


@_axpby.register("numba")
def _axpby_numba(x, y, out, beta, count_bad):
    from . import _compress_numba as K

    return K.axpby(x, y, out, beta, count_bad)


@_err_update.register("torch")
def _err_update_torch(acc, approx, res, out):
    a = approx.float()
    if res.dtype == acc.dtype == torch.float32:
        torch.sub(acc, a, out=res)  # one pass, no temporary
    else:
        res.copy_(acc.float() - a)
    if out is not None:
        out.copy_(a)


@_err_update.register("triton")
def _err_update_triton(acc, approx, res, out):
    n = acc.numel()
    _error_update_kernel[_grid(n, BLOCK)](acc, approx, res, out if out is not None else res, n, BLOCK=BLOCK,
                                          HAS_OUT=out is not None, num_warps=WARPS)  # fmt: skip


@_err_update.register("numba")
def _err_update_numba(acc, approx, res, out):
    from . import _compress_numba as K

    K.error_update(acc, approx, res, out)


# candidates: (cval fp32 [cap], cidx [cap], cnt int64 [2] = (count, non-finite))
@_candidates.register("torch")
def _cand_torch(x, r, thr, cap, idx_dtype):
    # |x + r| in a per-thread scratch buffer (no 4-byte-per-element allocation and first touch per call);
    # the candidates' signed values are re-read from x and r, k elements instead of n
    a = _scratch(x.device, x.numel())
    if r is None:
        a.copy_(x)
    elif x.dtype == r.dtype == torch.float32:
        torch.add(x, r, out=a)
    else:
        a.copy_(_acc_torch(x, r))
    bad = _count_nonfinite(a)
    a.abs_()
    sel = a >= thr  # NaN compares false
    if bool(bad):
        sel &= torch.isfinite(a)
    idx = sel.nonzero().view(-1)
    cnt = torch.cat([idx.new_tensor([idx.numel()]), bad.to(idx.dtype)])
    idx = idx[:cap]
    return _acc_torch(x[idx], r[idx] if r is not None else None), idx.to(idx_dtype), cnt


@_candidates.register("triton")
def _cand_triton(x, r, thr, cap, idx_dtype):
    cval = torch.empty(cap, dtype=torch.float32, device=x.device)
    cidx = torch.empty(cap, dtype=idx_dtype, device=x.device)
    cnt = _counter(x.device, 2)
    _topk_candidates_kernel[_grid(x.numel(), BLOCK)](
        x, r if r is not None else x, cval, cidx, cnt, x.numel(), thr, cap,
        BLOCK=BLOCK, HAS_R=r is not None, num_warps=WARPS,
    )  # fmt: skip
    return cval, cidx, cnt


@_candidates.register("numba")
def _cand_numba(x, r, thr, cap, idx_dtype):
    from . import _compress_numba as K

    return K.candidates(x, r, thr, cap, idx_dtype)


# out[idx] (+)= alpha * values; ``unique`` promises no repeated index (no atomics needed)
@_scatter.register("torch")
def _scatter_torch(values, indices, out, alpha, accumulate, unique):
    v = values.float() * alpha if alpha != 1.0 else values.float()
    idx = indices.long()
    if accumulate:
        if out.dtype == torch.float32:
            out.index_add_(0, idx, v)
        else:
            acc = out.float()
            acc.index_add_(0, idx, v)
            out.copy_(acc)
    else:
        out[idx] = v.to(out.dtype)


def _scatter_with(launch, values, indices, out, alpha, accumulate, unique):
    """Repeated indices with a 16-bit destination accumulate in an fp32 copy (no 16-bit atomics)."""
    if accumulate and not unique and out.dtype != torch.float32:
        acc = out.float()
        launch(values, indices, acc, alpha, True, True)
        out.copy_(acc)
    else:
        launch(values, indices, out, alpha, accumulate, accumulate and not unique)


@_scatter.register("triton")
def _scatter_triton(values, indices, out, alpha, accumulate, unique):
    def launch(values, indices, out, alpha, accumulate, atomic):
        k = values.numel()
        _scatter_kernel[_grid(k, BLOCK)](values, indices, out, k, out.numel(), alpha, BLOCK=BLOCK,
                                         ACCUMULATE=accumulate, ATOMIC=atomic, num_warps=WARPS)  # fmt: skip

    _scatter_with(launch, values, indices, out, alpha, accumulate, unique)


@_scatter.register("numba")
def _scatter_numba(values, indices, out, alpha, accumulate, unique):
    from . import _compress_numba as K

    _scatter_with(K.scatter, values, indices, out, alpha, accumulate, unique)


def block_codes(
    blocks: torch.Tensor, scales: torch.Tensor, qmax: float, stochastic: bool, key: int, offset: int = 0
) -> torch.Tensor:
    """fp32 integer codes of ``blocks`` [nb, block] on the grid of ``scales`` [nb], clamped to +-qmax:
    round half to even, or ``floor(y + u)`` with the (key, element index) noise, element indices starting
    at ``offset``; NaN codes become 0. The torch provider's quantization, and the shared-scale all-reduce's."""
    nb, block = blocks.shape
    y = blocks / torch.where(scales > 0, scales, 1.0)[:, None]  # an all-zero block has s == 0 and y == 0
    if stochastic:
        end = offset + nb * block
        idx = torch.arange(offset, end, device=y.device, dtype=torch.int32 if end < 2**31 else torch.int64)
        c = torch.floor_(y.view(-1).add_(uniform_noise(idx, key))).view(nb, block)
    else:
        c = torch.round(y)
    return c.nan_to_num_(nan=0.0).clamp_(-qmax, qmax)


# On the CPU the torch providers work through the elements in slices of about this many, so that their
# fp32 temporaries stay in cache instead of each costing a full pass of fresh pages (10x at 64 MiB).
CPU_SLICE = 1 << 17


def _cpu_slices(n: int, block: int, device: torch.device) -> list[tuple[int, int]]:
    """[a, b) element ranges, whole blocks each (block is even, so int4 bytes never straddle two)."""
    step = max(block, CPU_SLICE // block * block) if device.type == "cpu" else n
    return [(a, min(a + step, n)) for a in range(0, n, max(step, 1))]


@_quantize.register("torch")
def _quantize_torch(x, q, scales, bits, block, stochastic, key):
    bad = torch.zeros(1, dtype=torch.int64, device=x.device)
    for a, b in _cpu_slices(x.numel(), block, x.device):
        qa, qb = (a, b) if bits == 8 else (a // 2, -(-b // 2))
        bad += _quantize_torch_range(x[a:b], q[qa:qb], scales[a // block : -(-b // block)], bits, block, stochastic,
                                     key, a)  # fmt: skip
    return bad


def _quantize_torch_range(x, q, scales, bits, block, stochastic, key, offset):
    n = x.numel()
    nb = scales.numel()
    qmax = QMAX[bits]
    v = x.float()
    blocks = (torch.nn.functional.pad(v, (0, nb * block - n)) if n % block else v).view(nb, block)
    amax = blocks.abs().amax(dim=1)  # NaN/Inf propagate into the block's maximum
    bad_blocks = ~torch.isfinite(amax)
    s = torch.where(bad_blocks, float("nan"), amax / qmax)
    scales.copy_(s)
    c = block_codes(blocks, s, qmax, stochastic, key, offset).to(torch.int8).view(-1)[:n]
    if bits == 8:
        q.copy_(c)
    else:
        c = torch.nn.functional.pad(c, (0, n % 2)).view(-1, 2) & 15
        q.copy_(c[:, 0] | (c[:, 1] << 4))
    bad = torch.zeros(1, dtype=torch.int64, device=v.device)
    if bool(bad_blocks.any()):  # rare: count the elements for the message
        bad += (~torch.isfinite(blocks[bad_blocks])).sum()
    return bad


@_quantize.register("triton")
def _quantize_triton(x, q, scales, bits, block, stochastic, key):
    bad = _counter(x.device)
    m = tuned_meta("quantize", x.device, x.dtype, x.numel(), "triton")
    group = max(1, m.get("QTILE", QTILE) // block)
    nb = scales.numel()
    _quantize_kernel[_grid(nb, group)](
        x, q, scales, bad, x.numel(), nb, key,
        QBLOCK=block, GROUP=group, BITS=bits, QMAXV=QMAX[bits], STOCHASTIC=stochastic,
        num_warps=m.get("num_warps", WARPS),
    )  # fmt: skip
    return bad


@_quantize.register("numba")
def _quantize_numba(x, q, scales, bits, block, stochastic, key):
    from . import _compress_numba as K

    return K.quantize(x, q, scales, bits, block, stochastic, key)


@_dequantize.register("torch")
def _dequantize_torch(q, scales, out, bits, block, alpha, accumulate):
    for a, b in _cpu_slices(out.numel(), block, out.device):
        qa, qb = (a, b) if bits == 8 else (a // 2, -(-b // 2))
        _dequantize_torch_range(q[qa:qb], scales[a // block : -(-b // block)], out[a:b], bits, block, alpha,
                                accumulate)  # fmt: skip


def _dequantize_torch_range(q, scales, out, bits, block, alpha, accumulate):
    n = out.numel()
    if bits == 4:
        b = q.view(torch.int8)
        codes = torch.stack([(b << 4) >> 4, b >> 4], dim=1).view(-1)[:n]  # arithmetic shifts sign-extend
    else:
        codes = q
    v = codes.float().view(-1, block) if n % block == 0 else None
    if v is not None:
        v = (v * scales[:, None]).view(-1)
    else:
        v = codes.float() * scales.repeat_interleave(block)[:n]
    if alpha != 1.0:
        v = v * alpha
    if accumulate:
        v = out.float() + v
    out.copy_(v)


@_dequantize.register("triton")
def _dequantize_triton(q, scales, out, bits, block, alpha, accumulate):
    group = max(1, QTILE // block)
    nb = scales.numel()
    _dequantize_kernel[_grid(nb, group)](
        q, scales, out, out.numel(), nb, alpha,
        QBLOCK=block, GROUP=group, BITS=bits, ACCUMULATE=accumulate, num_warps=WARPS, enable_fp_fusion=False,
    )  # fmt: skip


@_dequantize.register("numba")
def _dequantize_numba(q, scales, out, bits, block, alpha, accumulate):
    from . import _compress_numba as K

    K.dequantize(q, scales, out, bits, block, alpha, accumulate)


# sign: pass 1 -> (sum |v| as fp64 0-dim, non-finite count); pass 2 packs (and updates the residual)
@_abs_sum.register("torch")
def _abs_sum_torch(x, r):
    v = _acc_torch(x, r)
    total = v.abs().sum(dtype=torch.float64)  # finite unless an element is NaN/Inf (no fp64 overflow)
    bad = torch.zeros(1, dtype=torch.int64, device=v.device)
    if not bool(torch.isfinite(total)):
        bad += (~torch.isfinite(v)).sum()
    return total, bad


@_abs_sum.register("triton")
def _abs_sum_triton(x, r):
    grid = _grid(x.numel(), BLOCK)
    part = torch.empty(grid[0], dtype=torch.float32, device=x.device)
    bad = _counter(x.device)
    _abs_sum_kernel[grid](x, r if r is not None else x, part, bad, x.numel(), BLOCK=BLOCK, HAS_R=r is not None,
                          num_warps=WARPS)  # fmt: skip
    return part.sum(dtype=torch.float64), bad


@_abs_sum.register("numba")
def _abs_sum_numba(x, r):
    from . import _compress_numba as K

    return K.abs_sum(x, r)


@_sign_pack.register("torch")
def _sign_pack_torch(x, r, bits, scale):
    v = _acc_torch(x, r)
    pos = v >= 0
    n = v.numel()
    p8 = pos.view(torch.uint8)
    if n % 8:
        p8 = torch.nn.functional.pad(p8, (0, bits.numel() * 8 - n))
    shifts = torch.arange(8, dtype=torch.uint8, device=v.device)
    torch.sum(p8.view(-1, 8) << shifts, dim=1, dtype=torch.uint8, out=bits)
    if r is not None:
        r.copy_(v - torch.where(pos, scale, -scale))


@_sign_pack.register("triton")
def _sign_pack_triton(x, r, bits, scale):
    _sign_pack_kernel[_grid(bits.numel(), SIGN_BYTES)](
        x, r if r is not None else x, bits, scale, x.numel(), bits.numel(),
        BYTES=SIGN_BYTES, HAS_R=r is not None, num_warps=WARPS,
    )  # fmt: skip


@_sign_pack.register("numba")
def _sign_pack_numba(x, r, bits, scale):
    from . import _compress_numba as K

    K.sign_pack(x, r, bits, scale)


@_sign_unpack.register("torch")
def _sign_unpack_torch(bits, scale, out, alpha, accumulate):
    n = out.numel()
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    pos = ((bits[:, None] >> shifts) & 1).view(-1)[:n].view(torch.bool)
    s = scale * alpha if alpha != 1.0 else scale
    v = torch.where(pos, s, -s)
    if accumulate:
        v = out.float() + v
    out.copy_(v)


@_sign_unpack.register("triton")
def _sign_unpack_triton(bits, scale, out, alpha, accumulate):
    _sign_unpack_kernel[_grid(bits.numel(), SIGN_BYTES)](
        bits, scale, out, out.numel(), bits.numel(), alpha,
        BYTES=SIGN_BYTES, ACCUMULATE=accumulate, num_warps=WARPS, enable_fp_fusion=False,
    )  # fmt: skip


@_sign_unpack.register("numba")
def _sign_unpack_numba(bits, scale, out, alpha, accumulate):
    from . import _compress_numba as K

    K.sign_unpack(bits, scale, out, alpha, accumulate)


def _gram_factor_torch(G: torch.Tensor, rtol2: float) -> torch.Tensor:
    """Batched [B, r, r] fp64 version of the kernels' _gram_factor."""
    B, r, _ = G.shape
    T = torch.zeros_like(G)
    eye = torch.eye(r, dtype=G.dtype, device=G.device)
    for j in range(r):
        t = eye[j].expand(B, r).clone()
        for _ in range(2):
            gt = torch.einsum("bij,bj->bi", G, t)
            c = torch.einsum("bai,ba->bi", T, gt)
            t = t - torch.einsum("bai,bi->ba", T, c)
        nrm2 = torch.einsum("bi,bi->b", t, torch.einsum("bij,bj->bi", G, t))
        gjj = G[:, j, j]
        ok = (nrm2 > rtol2 * gjj) & (gjj > 0)
        inv = torch.where(ok, torch.rsqrt(torch.where(ok, nrm2, 1.0)), 0.0)
        T[:, :, j] = t * inv[:, None]
    return T


@_ortho.register("torch")
def _ortho_torch(mats, rtol, iters):
    """Householder QR (torch.linalg.qr, batched per shape) with the signs fixed to a positive diagonal of
    R: the same Q as Gram-Schmidt. A matrix with a dependent or zero column (|R_jj| below rtol of the
    column's norm) takes the CholeskyQR path instead, because Householder fills such a column with an
    arbitrary direction that the later columns are then made orthogonal to."""
    groups: dict[tuple[int, ...], list[torch.Tensor]] = {}
    batches = [m for m in mats if m.dim() == 3]
    for m in mats:
        if m.dim() == 2:
            groups.setdefault(tuple(m.shape), []).append(m)
    work = [(b.shape[1], b.shape[2], list(b.unbind(0)), b) for b in batches]
    work += [(rows, cols, ms, _as_batch(ms)) for (rows, cols), ms in groups.items()]
    for rows, cols, ms, view in work:  # view: the [B, m, r] tensor holding ms, when there is one
        cdt = torch.float64 if ms[0].dtype == torch.float64 else torch.float32
        a = view.to(cdt) if view is not None else torch.stack([m.to(cdt) for m in ms])  # [B, m, r]
        ok = torch.zeros(len(ms), dtype=torch.bool, device=a.device)
        if rows >= cols:
            q, r = torch.linalg.qr(a)
            d = torch.diagonal(r, dim1=-2, dim2=-1)  # [B, r]
            norms = torch.linalg.vector_norm(a, dim=1)
            ok = ((d.abs() > rtol * norms) & (norms > 0)).all(dim=1)
            q = q * torch.where(d < 0, -1.0, 1.0).to(cdt)[:, None, :]
        slow = (~ok).nonzero().view(-1).tolist()
        if slow:  # rank-deficient (or wider than tall): Gram-Schmidt in the Gram-matrix metric, in fp64
            b = a[slow].double()
            for _ in range(iters):
                b = b @ _gram_factor_torch(b.transpose(1, 2) @ b, rtol * rtol)
        if rows >= cols and view is not None:
            if slow:
                q[slow] = b.to(cdt)
            view.copy_(q)
            continue
        for i, m in enumerate(ms):
            m.copy_(b[slow.index(i)] if i in slow else q[i])


def _as_batch(ms: list[torch.Tensor]) -> torch.Tensor | None:
    """One [B, m, r] view over matrices that lie back to back in memory, else None."""
    m0 = ms[0]
    step = m0.numel() * m0.element_size()
    if all(m.data_ptr() == m0.data_ptr() + i * step for i, m in enumerate(ms)):
        return m0.as_strided((len(ms), *m0.shape), (m0.numel(), m0.shape[1], 1))
    return None


@_ortho.register("triton")
def _ortho_triton(mats, rtol, iters):
    r = mats[0].shape[1]
    rp = max(2, triton.next_power_of_2(r))
    rows = max(1, min(256, triton.next_power_of_2(max(1, ORTHO_ELEMS // (rp * rp)))))
    table = _ptr_table([v for m in mats for v in (m.data_ptr(), m.shape[0])], mats[0].device, "ortho")
    _orthogonalize_kernel[(len(mats),)](table, mats[0], r, rtol * rtol, ROWS=rows, RP=rp, ITERS=iters,
                                        num_warps=4)  # fmt: skip


@_ortho.register("numba")
def _ortho_numba(mats, rtol, iters):
    from . import _compress_numba as K

    K.orthogonalize(mats, rtol, iters)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


def _select(op: Op, t: torch.Tensor, provider: str) -> str:
    return op.select(t.device, t.dtype, t.numel(), provider or None)


@torch.library.custom_op("torsh::residual_add", mutates_args=("out",))
def _residual_add_op(x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor, check_finite: bool,
                     provider: str) -> None:  # fmt: skip
    name = _select(_axpby, x, provider)
    with _on(x.device):
        bad = _axpby(name, x.view(-1), residual.view(-1), out.view(-1), 1.0, check_finite)
    if check_finite and (b := int(bad.item())):
        _raise_nonfinite(b, "torsh_kernels.residual_add", "x + residual")


@_residual_add_op.register_fake
def _(x, residual, out, check_finite, provider):
    return None


@torch.library.custom_op("torsh::error_update", mutates_args=("residual", "out"))
def _error_update_op(acc: torch.Tensor, approx: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None,
                     provider: str) -> None:  # fmt: skip
    name = _select(_err_update, acc, provider)
    with _on(acc.device):
        _err_update(name, acc.view(-1), approx.view(-1), residual.view(-1), out.view(-1) if out is not None else None)


@_error_update_op.register_fake
def _(acc, approx, residual, out, provider):
    return None


@torch.library.custom_op("torsh::topk_compress", mutates_args=("residual",))
def _topk_op(x: torch.Tensor, residual: torch.Tensor | None, k: int, exact: bool, check_finite: bool,
             provider: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    name = _select(_candidates, x, provider)
    with _on(x.device):
        return _topk_run(name, x.view(-1), residual.view(-1) if residual is not None else None, k, exact, check_finite)


@_topk_op.register_fake
def _(x, residual, k, exact, check_finite, provider):
    return x.new_empty(k), x.new_empty(k, dtype=index_dtype(x.numel()))


def _sample_threshold(x: torch.Tensor, r: torch.Tensor | None, stride: int, target: int) -> float:
    """The ``target``-th largest |x + r| over the strided sample x[::stride] (a host scalar)."""
    s = x[::stride].float()
    if r is not None:
        s = s + r[::stride].float()
    s = s.abs().nan_to_num_(nan=0.0, posinf=0.0)
    target = min(max(target, 1), s.numel())
    return float(torch.topk(s, target, sorted=False).values.min().item())


def _topk_run(name: str, x, r, k: int, exact: bool, check_finite: bool):
    n = x.numel()
    idt = index_dtype(n)
    what = "torsh_kernels.topk_compress"
    chosen = None
    if not exact:
        cap = min(n, k + math.ceil(TOPK_SLACK * k))
        sample = min(n, max(TOPK_MIN_SAMPLE, math.ceil(TOPK_SAMPLE_PER_K * n / k)))
        stride = max(1, n // sample)
        ns = -(-n // stride)
        target = _TOPK_TARGET * k * ns / n
        for _ in range(TOPK_REFINE):
            thr = _sample_threshold(x, r, stride, math.ceil(target))
            cval, cidx, cnt = _candidates(name, x, r, thr, cap, idt)
            count, bad = cnt.tolist()
            if bad and check_finite:
                _raise_nonfinite(bad, what, "x + residual" if r is not None else "x")
            if k <= count <= cap:
                sel = torch.topk(cval[:count].abs(), k, sorted=False).indices
                chosen = cidx[sel], cval[sel]
                break
            # re-aim: the sample rank that should give k * _TOPK_TARGET candidates, given what this gave
            new = target * (_TOPK_TARGET * k) / max(count, 1)
            if math.ceil(new) == math.ceil(target):
                new = target + (1 if count < k else -1)
            if new < 1 or new > ns:
                break
            target = new
    if chosen is None:  # exact path (also the fallback)
        acc = torch.empty(n, dtype=torch.float32, device=x.device)
        bad = _axpby(name, x, r if r is not None else torch.zeros_like(x), acc, 1.0, check_finite)
        if check_finite and (b := int(bad.item())):
            _raise_nonfinite(b, what, "x + residual" if r is not None else "x")
        sel = torch.topk(acc.abs(), k, sorted=False).indices
        chosen = sel.to(idt), acc[sel]
    idx, order = torch.sort(chosen[0])
    acc = chosen[1][order]  # fp32 x + residual at the chosen indices
    values = acc.to(x.dtype)
    if r is not None:  # error feedback: residual = x + residual, then what the sent values leave of it
        _axpby(name, x, r, r, 1.0, False)
        _scatter(name, acc - values.float(), idx, r, 1.0, False, True)  # rounded once into r's dtype
    return values, idx


@torch.library.custom_op("torsh::topk_decompress", mutates_args=("out",))
def _topk_decompress_op(values: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, accumulate: bool,
                        alpha: float, provider: str) -> None:  # fmt: skip
    name = _select(_scatter, out, provider)
    with _on(out.device):
        if not accumulate:
            out.zero_()
        if values.numel():
            _scatter(name, values, indices, out.view(-1), alpha, accumulate, False)


@_topk_decompress_op.register_fake
def _(values, indices, out, accumulate, alpha, provider):
    return None


def _quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider) -> None:
    if x.numel():
        name = _select(_quantize, x, provider)
        with _on(x.device):
            bad = _quantize(name, x.view(-1), q, scales, bits, block, stochastic, key)
        if check_finite and (b := int(bad.item())):
            _raise_nonfinite(b, "torsh_kernels.quantize", "x")


@torch.library.custom_op("torsh::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, bits: int, block: int, stochastic: bool, key: int, check_finite: bool,
                 provider: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    n = x.numel()
    q = torch.empty(n if bits == 8 else -(-n // 2), dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(-(-n // block), dtype=torch.float32, device=x.device)
    _quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider)
    return q, scales


@torch.library.custom_op("torsh::quantize_out", mutates_args=("q", "scales"))
def _quantize_out_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, block: int, stochastic: bool,
                     key: int, check_finite: bool, provider: str) -> None:  # fmt: skip
    _quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider)


@_quantize_out_op.register_fake
def _(x, q, scales, bits, block, stochastic, key, check_finite, provider):
    return None


@_quantize_op.register_fake
def _(x, bits, block, stochastic, key, check_finite, provider):
    n = x.numel()
    q = x.new_empty(n if bits == 8 else -(-n // 2), dtype=torch.int8 if bits == 8 else torch.uint8)
    return q, x.new_empty(-(-n // block), dtype=torch.float32)


@torch.library.custom_op("torsh::dequantize", mutates_args=("out",))
def _dequantize_op(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, block: int, alpha: float,
                   accumulate: bool, provider: str) -> None:  # fmt: skip
    if out.numel():
        name = _select(_dequantize, out, provider)
        with _on(out.device):
            _dequantize(name, q, scales, out.view(-1), bits, block, alpha, accumulate)


@_dequantize_op.register_fake
def _(q, scales, out, bits, block, alpha, accumulate, provider):
    return None


@torch.library.custom_op("torsh::sign_compress", mutates_args=("residual",))
def _sign_op(x: torch.Tensor, residual: torch.Tensor | None, check_finite: bool,
             provider: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    n = x.numel()
    bits = torch.empty(-(-n // 8), dtype=torch.uint8, device=x.device)
    if n == 0:
        return bits, torch.zeros((), dtype=torch.float32, device=x.device)
    name = _select(_abs_sum, x, provider)
    r = residual.view(-1) if residual is not None else None
    with _on(x.device):
        total, bad = _abs_sum(name, x.view(-1), r)
        if check_finite and (b := int(bad.item())):
            _raise_nonfinite(b, "torsh_kernels.sign_compress", "x + residual" if r is not None else "x")
        scale = (total / n).to(torch.float32)
        _sign_pack(name, x.view(-1), r, bits, scale)
    return bits, scale


@_sign_op.register_fake
def _(x, residual, check_finite, provider):
    return x.new_empty(-(-x.numel() // 8), dtype=torch.uint8), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("torsh::sign_decompress", mutates_args=("out",))
def _sign_decompress_op(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, alpha: float, accumulate: bool,
                        provider: str) -> None:  # fmt: skip
    if out.numel():
        name = _select(_sign_unpack, out, provider)
        with _on(out.device):
            _sign_unpack(name, bits, scale.reshape(()).float(), out.view(-1), alpha, accumulate)


@_sign_decompress_op.register_fake
def _(bits, scale, out, alpha, accumulate, provider):
    return None


@torch.library.custom_op("torsh::orthogonalize", mutates_args=("matrices",))
def _ortho_op(matrices: list[torch.Tensor], rtol: float, iters: int, provider: str) -> None:
    """``matrices``: [m, r] matrices and/or [B, m, r] batches, one r."""
    m0 = matrices[0]
    requested = provider or None
    if m0.shape[-1] > MAX_KERNEL_RANK and requested is None:
        name = "torch"  # the kernels keep r x r in registers; wider matrices take the batched torch path
    else:
        name = _ortho.select(m0.device, m0.dtype, m0.numel(), requested)
        if name != "torch" and m0.shape[-1] > MAX_KERNEL_RANK:
            raise ShapeError(
                f"torsh_kernels.orthogonalize: the {name} kernel handles up to {MAX_KERNEL_RANK} columns, got "
                f"{m0.shape[-1]}; use provider='torch' (or None) for wider matrices"
            )
    with _on(m0.device):
        if name == "torch":
            _ortho(name, matrices, rtol, iters)
        else:  # the kernels take one table row per matrix
            _ortho(name, [v for m in matrices for v in (m.unbind(0) if m.dim() == 3 else (m,))], rtol, iters)


@_ortho_op.register_fake
def _(matrices, rtol, iters, provider):
    return None


# --------------------------------------------------------------------------------------------------
# Public API


def residual_add(
    x: torch.Tensor,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_finite: bool = True,
    provider: str | None = None,
) -> torch.Tensor:
    """``x + residual`` in fp32, in one pass: the error-feedback input of a lossy compressor.

    ``out`` (any of fp32/fp16/bf16, x's element count, contiguous) defaults to a new fp32 tensor of x's
    shape; it may be ``residual`` or ``x`` itself. With ``check_finite``, NaN/Inf in the sum raise
    :class:`NonFiniteError` (after the pass: an ``out`` that aliases an input has been written).
    """
    what = "torsh_kernels.residual_add"
    xf = _flat_input(x, what, "x")
    rf = _flat_inout(residual, what, "residual", xf.numel(), xf.device)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=xf.device)
    of = _flat_inout(out, what, "out", xf.numel(), xf.device)
    for t, nm in ((xf, "x"), (rf, "residual")):
        _no_overlap(of, t, what, "out", nm, same_ok=True)
    if xf.numel():
        _residual_add_op(xf, rf, of, bool(check_finite), provider or "")
    return out


def error_update(
    acc: torch.Tensor,
    approx: torch.Tensor,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    provider: str | None = None,
) -> None:
    """``residual = acc - approx`` and, if ``out`` is given, ``out = approx`` (cast), in one pass.

    The error-feedback step after decompression: ``acc`` is what was compressed (gradient + old
    residual), ``approx`` what the compressed payload decodes to (for PowerSGD, ``P @ Q.T``), ``out``
    typically the gradient tensor that receives the approximation. ``residual`` may be ``acc`` itself.
    """
    what = "torsh_kernels.error_update"
    af = _flat_input(acc, what, "acc")
    n, dev = af.numel(), af.device
    pf = _flat_input(approx, what, "approx")
    if pf.numel() != n:
        raise ShapeError(f"{what}: approx has {pf.numel()} elements, acc has {n}")
    if pf.device != dev:
        raise DeviceMismatchError(f"{what}: approx is on {pf.device}, acc on {dev}")
    rf = _flat_inout(residual, what, "residual", n, dev)
    of = _flat_inout(out, what, "out", n, dev) if out is not None else None
    _no_overlap(rf, pf, what, "residual", "approx")
    _no_overlap(rf, af, what, "residual", "acc", same_ok=True)
    if of is not None:
        _no_overlap(of, rf, what, "out", "residual")
        _no_overlap(of, af, what, "out", "acc")
        _no_overlap(of, pf, what, "out", "approx", same_ok=True)
    if n:
        _error_update_op(af, pf, rf, of, provider or "")


def _check_ratio(ratio: object, what: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ArgumentTypeError(f"{what}: ratio must be a number in (0, 1], got {type(ratio).__name__}")
    if not (0.0 < ratio <= 1.0):
        raise InvalidArgumentError(f"{what}: ratio must be in (0, 1] (the fraction of elements sent), got {ratio}")
    return float(ratio)


def topk_compress(
    x: torch.Tensor,
    *,
    ratio: float,
    residual: torch.Tensor | None = None,
    exact: bool = False,
    check_finite: bool = True,
    provider: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k = ceil(ratio * x.numel()) largest magnitudes of ``x + residual``, with error feedback.

    Returns ``(values, indices)``: values in x's dtype, indices ascending, int32 when x has fewer than
    2**31 elements (else int64), both of length k. With ``residual`` (fp32/fp16/bf16, x's element count,
    contiguous), it is updated in place to ``x + residual - decompress(values, indices)``: exactly what
    was not sent (for each element, computed in fp32 and rounded once into the residual's dtype). See the
    module docstring for the approximate mode and ``exact``.
    """
    what = "torsh_kernels.topk_compress"
    xf = _flat_input(x, what, "x")
    ratio = _check_ratio(ratio, what)
    if xf.numel() == 0:
        raise ShapeError(f"{what}: x is empty; there is nothing to select")
    rf = None
    if residual is not None:
        rf = _flat_inout(residual, what, "residual", xf.numel(), xf.device)
        _no_overlap(rf, xf, what, "residual", "x")
    k = topk_count(xf.numel(), ratio)
    return _topk_op(xf, rf, k, bool(exact), bool(check_finite), provider or "")


def _decode_out(out, numel, dtype, device, what) -> tuple[torch.Tensor, torch.Tensor]:
    if out is None:
        if dtype not in COMPRESS_DTYPES:
            raise DTypeError(f"{what}: dtype={dtype}; expected float32, float16 or bfloat16")
        out = torch.empty(numel, dtype=dtype, device=device)
    return out, _flat_inout(out, what, "out", numel, device)


def topk_decompress(
    values: torch.Tensor,
    indices: torch.Tensor,
    numel: int,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    alpha: float = 1.0,
    dtype: torch.dtype | None = None,
    provider: str | None = None,
) -> torch.Tensor:
    """Scatter ``alpha * values`` to ``indices`` of a zero tensor of ``numel`` elements (or of ``out``).

    With ``accumulate`` the values are added to ``out`` (repeated indices add up, e.g. the concatenated
    payloads of several ranks); without, ``out`` is zeroed first and a repeated index keeps one of its
    values (unspecified which). Indices outside [0, numel) raise ``ShapeError`` before anything is written.
    """
    what = "torsh_kernels.topk_decompress"
    values = _check_tensor(values, what, "values")
    indices = _check_tensor(indices, what, "indices")
    _check_dtype(values, what, "values")
    if indices.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"{what}: indices have dtype {indices.dtype}; expected int32 or int64")
    if values.dim() != 1 or indices.dim() != 1 or values.numel() != indices.numel():
        raise ShapeError(
            f"{what}: values and indices must be 1-D of one length, got {tuple(values.shape)} and "
            f"{tuple(indices.shape)}"
        )
    if values.device != indices.device:
        raise DeviceMismatchError(f"{what}: values are on {values.device}, indices on {indices.device}")
    numel = _check_int(numel, what, "numel", 0)
    alpha = _check_alpha(alpha, what)
    out, of = _decode_out(out, numel, dtype or values.dtype, values.device, what)
    if indices.numel():
        lo, hi = torch.aminmax(indices)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= numel:
            bad = lo if lo < 0 else hi
            raise ShapeError(f"{what}: index {bad} is outside [0, {numel}); nothing was written")
    _no_overlap(of, values, what, "out", "values")
    _no_overlap(of, indices, what, "out", "indices")
    _topk_decompress_op(values.contiguous(), indices.contiguous(), of, bool(accumulate), alpha, provider or "")
    return out


def _check_quant_args(bits, block, what) -> tuple[int, int]:
    bits = _check_int(bits, what, "bits")
    if bits not in QMAX:
        raise InvalidArgumentError(f"{what}: bits={bits}; expected 8 or 4")
    block = _check_int(block, what, "block")
    if block < 2 or block > 65536 or block & (block - 1):
        raise InvalidArgumentError(f"{what}: block={block}; expected a power of two in [2, 65536]")
    return bits, block


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block: int = 256,
    stochastic: bool = False,
    seed: int | None = None,
    check_finite: bool = True,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    provider: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization of ``x``'s elements to int8 or packed int4.

    Returns ``(q, scales)``: ``q`` int8 [n] (bits=8) or uint8 [ceil(n/2)] (bits=4, two codes per byte),
    ``scales`` fp32 [ceil(n/block)]. ``stochastic`` rounds up with probability equal to the fractional
    part, from noise determined by ``seed`` (default: drawn from torch's global generator, so
    ``torch.manual_seed`` makes it reproducible) and the element index. ``out=(q, scales)``: write into
    these contiguous tensors of exactly those dtypes and sizes on x's device (with ``check_finite``, a
    non-finite input raises after they were written).
    """
    what = "torsh_kernels.quantize"
    xf = _flat_input(x, what, "x")
    bits, block = _check_quant_args(bits, block, what)
    key = 0
    if stochastic:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        seed = _check_int(seed, what, "seed")
        key = seed_key(seed)
    elif seed is not None:
        _check_int(seed, what, "seed")
    if out is None:
        return _quantize_op(xf, bits, block, bool(stochastic), key, bool(check_finite), provider or "")
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ArgumentTypeError(f"{what}: out must be a (q, scales) pair of tensors, got {type(out).__name__}")
    n = xf.numel()
    qdt = torch.int8 if bits == 8 else torch.uint8
    for t, name, dt, size in ((out[0], "out[0] (q)", qdt, n if bits == 8 else -(-n // 2)),
                              (out[1], "out[1] (scales)", torch.float32, -(-n // block))):  # fmt: skip
        t = _check_tensor(t, what, name)
        if t.dtype != dt or t.numel() != size or not t.is_contiguous():
            raise ShapeError(
                f"{what}: {name} must be a contiguous {dt} tensor of {size} elements for {n} elements in blocks "
                f"of {block}, got {t.dtype} with {t.numel()} elements{'' if t.is_contiguous() else ' (strided)'}"
            )
        if t.device != xf.device:
            raise DeviceMismatchError(f"{what}: {name} is on {t.device}, x on {xf.device}")
    q, scales = out[0].view(-1), out[1].view(-1)
    _quantize_out_op(xf, q, scales, bits, block, bool(stochastic), key, bool(check_finite), provider or "")
    return out[0], out[1]


def dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    block: int = 256,
    numel: int | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    accumulate: bool = False,
    alpha: float = 1.0,
    provider: str | None = None,
) -> torch.Tensor:
    """``alpha * codes * scale`` for each element (plus ``out`` with ``accumulate``).

    The bit width follows ``q``'s dtype (int8: 8 bits, uint8: packed int4). ``numel`` defaults to
    ``q.numel()`` (int8) or ``2 * q.numel()`` (int4: pass the true count when it is odd); ``block`` must
    be the one ``quantize`` used (checked against the number of scales).
    """
    what = "torsh_kernels.dequantize"
    q = _check_tensor(q, what, "q")
    scales = _check_tensor(scales, what, "scales")
    if q.dtype not in (torch.int8, torch.uint8):
        raise DTypeError(f"{what}: q has dtype {q.dtype}; expected int8 (8-bit codes) or uint8 (packed int4)")
    if scales.dtype != torch.float32:
        raise DTypeError(f"{what}: scales have dtype {scales.dtype}; expected float32")
    if q.device != scales.device:
        raise DeviceMismatchError(f"{what}: q is on {q.device}, scales on {scales.device}")
    bits = 8 if q.dtype == torch.int8 else 4
    bits, block = _check_quant_args(bits, block, what)
    if numel is None:
        numel = q.numel() if bits == 8 else 2 * q.numel()
    numel = _check_int(numel, what, "numel", 0)
    want_q = numel if bits == 8 else -(-numel // 2)
    if q.numel() != want_q:
        raise ShapeError(f"{what}: {numel} elements at {bits} bits need {want_q} code bytes, q has {q.numel()}")
    if scales.numel() != -(-numel // block):
        raise ShapeError(
            f"{what}: {numel} elements in blocks of {block} need {-(-numel // block)} scales, got "
            f"{scales.numel()}; pass the block size quantize used"
        )
    alpha = _check_alpha(alpha, what)
    out, of = _decode_out(out, numel, dtype, q.device, what)
    _dequantize_op(q.reshape(-1).contiguous(), scales.reshape(-1).contiguous(), of, bits, block, alpha,
                   bool(accumulate), provider or "")  # fmt: skip
    return out


def sign_compress(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    check_finite: bool = True,
    provider: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """1-bit compression of ``v = x + residual``: ``(bits, scale)``, bits uint8 [ceil(n/8)] (bit j of byte
    i is 1 where element 8i+j is >= 0), scale = mean |v| (fp32, 0-dim). With ``residual`` (updated in
    place): ``residual = v - scale * sign(v)``."""
    what = "torsh_kernels.sign_compress"
    xf = _flat_input(x, what, "x")
    rf = None
    if residual is not None:
        rf = _flat_inout(residual, what, "residual", xf.numel(), xf.device)
        _no_overlap(rf, xf, what, "residual", "x")
    return _sign_op(xf, rf, bool(check_finite), provider or "")


def sign_decompress(
    bits: torch.Tensor,
    scale: torch.Tensor | float,
    numel: int,
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    accumulate: bool = False,
    alpha: float = 1.0,
    provider: str | None = None,
) -> torch.Tensor:
    """``+-alpha * scale`` per element from packed signs (plus ``out`` with ``accumulate``)."""
    what = "torsh_kernels.sign_decompress"
    bits = _check_tensor(bits, what, "bits")
    if bits.dtype != torch.uint8:
        raise DTypeError(f"{what}: bits have dtype {bits.dtype}; expected uint8")
    numel = _check_int(numel, what, "numel", 0)
    if bits.numel() != -(-numel // 8):
        raise ShapeError(f"{what}: {numel} signs need {-(-numel // 8)} bytes, bits has {bits.numel()}")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = torch.tensor(float(scale), device=bits.device)
    scale = _check_tensor(scale, what, "scale")
    if scale.numel() != 1 or not scale.is_floating_point():
        raise ShapeError(f"{what}: scale must be one floating-point element, got {scale.numel()} of {scale.dtype}")
    if scale.device != bits.device:
        raise DeviceMismatchError(f"{what}: scale is on {scale.device}, bits on {bits.device}")
    alpha = _check_alpha(alpha, what)
    out, of = _decode_out(out, numel, dtype, bits.device, what)
    _sign_decompress_op(bits.reshape(-1).contiguous(), scale, of, alpha, bool(accumulate), provider or "")
    return out


def _matrix_list(matrices: object, what: str) -> list[torch.Tensor]:
    if isinstance(matrices, torch.Tensor):
        if matrices.dim() == 2:
            return [matrices]
        if matrices.dim() == 3:
            return list(matrices.unbind(0))
        raise ShapeError(f"{what}: expected a [m, r] or [B, m, r] tensor, got shape {tuple(matrices.shape)}")
    if not isinstance(matrices, (list, tuple)):
        raise ArgumentTypeError(
            f"{what}: matrices must be a tensor or a list of 2-D tensors, got {type(matrices).__name__}"
        )
    for i, m in enumerate(matrices):
        _check_tensor(m, what, f"matrices[{i}]")
        if m.dim() != 2:
            raise ShapeError(f"{what}: matrices[{i}] has shape {tuple(m.shape)}; expected [m, r]")
    return list(matrices)


def orthogonalize(
    matrices: torch.Tensor | Sequence[torch.Tensor],
    *,
    rtol: float | None = None,
    iters: int = 2,
    check_finite: bool = True,
    provider: str | None = None,
) -> torch.Tensor | Sequence[torch.Tensor]:
    """Orthonormalise the columns of each tall thin matrix in place (the PowerSGD step) and return it.

    ``matrices``: a contiguous [m, r] or [B, m, r] tensor, or a list of contiguous [m_i, r] tensors
    (one r, one dtype, one device), fp32/fp64/fp16/bf16. Column j becomes the normalised part of column j
    orthogonal to columns < j (the Q of a thin QR with a positive diagonal); if that part is below
    ``rtol`` (default per dtype: fp32 1e-4, fp16 1e-2, bf16 5e-2, fp64 1e-10) of the column's norm, the
    column is zero or dependent on the previous ones and becomes zero. ``iters`` CholeskyQR iterations
    (2 is CholeskyQR2: orthogonal to fp32 rounding for condition numbers up to ~1e7). NaN/Inf raise
    :class:`NonFiniteError` before anything is written (``check_finite``).
    """
    what = "torsh_kernels.orthogonalize"
    if isinstance(matrices, torch.Tensor) and matrices.dim() == 3:  # one batch: validated and passed whole
        _check_dtype(matrices, what, "matrices", ORTHO_DTYPES)
        if not matrices.is_contiguous():
            raise ShapeError(f"{what}: matrices must be contiguous (they are orthogonalised in place)")
        mats = [matrices]
    else:
        mats = _matrix_list(matrices, what)
    if not mats:
        return matrices
    m0 = mats[0]
    for i, m in enumerate(mats):
        _check_dtype(m, what, f"matrices[{i}]", ORTHO_DTYPES)
        if m.dtype != m0.dtype:
            raise DTypeError(f"{what}: matrices[{i}] is {m.dtype}, matrices[0] is {m0.dtype}")
        if m.device != m0.device:
            raise DeviceMismatchError(f"{what}: matrices[{i}] is on {m.device}, matrices[0] on {m0.device}")
        if m.shape[-1] != m0.shape[-1]:
            raise ShapeError(f"{what}: matrices[{i}] has {m.shape[-1]} columns, matrices[0] has {m0.shape[-1]}")
        if not m.is_contiguous():
            raise ShapeError(f"{what}: matrices[{i}] must be contiguous (it is orthogonalised in place)")
    if len(mats) > 1:
        clash = _Ranges.of(mats).contiguous_clash()
        if clash is not None:
            raise ShapeError(f"{what}: matrices[{clash[0]}] and matrices[{clash[1]}] share memory")
    iters = _check_int(iters, what, "iters", 1)
    tol = default_rtol(m0.dtype) if rtol is None else rtol
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not (0.0 <= tol < 1.0):
        raise InvalidArgumentError(f"{what}: rtol must be a number in [0, 1), got {rtol!r}")
    mats = [m for m in mats if m.numel()]
    if not mats or m0.shape[-1] == 0:
        return matrices
    if check_finite:
        whole = matrices if isinstance(matrices, torch.Tensor) else None
        total = sum(m.sum(dtype=torch.float64) for m in mats) if whole is None else whole.sum(dtype=torch.float64)
        bad = 0
        if not bool(torch.isfinite(total)):  # a NaN/Inf element (finite inputs cannot overflow fp64)
            bad = sum(int((~torch.isfinite(m)).sum()) for m in mats)
        if bad:
            raise NonFiniteError(f"{what}: the matrices hold {bad} non-finite element(s); nothing was written")
    _ortho_op([m.detach() for m in mats], float(tol), iters, provider or "")
    return matrices
