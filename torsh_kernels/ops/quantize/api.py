"""The quantization family's public ops (quantize, dequantize, block_codes): each validates its inputs (typed
errors), allocates its outputs and runs its provider (``providers.py``) through a ``torsh::`` custom op with a
fake implementation, so it composes with ``torch.compile``; on plain CPU tensors the common cases take a fast
path straight to the cpu provider's kernels (or the torch provider's arithmetic). Also the int8 quantizer's
tuning space (``torsh tune``)."""

from __future__ import annotations

import math

import torch

from ...checks import check_int
from ...errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
)
from .. import eager
from ..common import (
    COMPRESS_DTYPES,
    check_alpha,
    check_tensor,
    decode_out,
    flat_input,
    no_overlap,
    raise_nonfinite,
)
from ..registry import check_provider
from ..tuning import TuneSpace, register_space
from .format import CODE_DTYPE, QMAX, code_count, round_codes, scale_count, seed_key
from .providers import CPU_SLICE, dequantize_impl, dequantize_into, quantize_impl, quantize_into
from .reference import quantize_ref

__all__ = [
    "block_codes",
    "cpu_kernels",
    "dequantize",
    "dequantize_op",
    "quantize",
    "quantize_op",
    "quantize_out_op",
]

_F32 = torch.float32
_I8 = torch.int8
_U8 = torch.uint8
_BITS = {_I8: 8, _U8: 4}  # the bit width a code tensor's dtype says
_BLOCKS = frozenset(1 << k for k in range(1, 17))  # the valid quantization blocks: powers of two in [2, 65536]


def block_codes(
    blocks: torch.Tensor, scales: torch.Tensor, qmax: float, stochastic: bool, key: int, offset: int = 0
) -> torch.Tensor:
    """fp32 integer codes of ``blocks`` [nb, block] on the grid of ``scales`` [nb], clamped to +-qmax:
    round half to even, or ``floor(y + u)`` with the (key, element index) noise, element indices starting
    at ``offset``; NaN codes become 0. The torch provider's quantization, and the shared-scale all-reduce's."""
    what = "torsh_kernels.block_codes"
    check_tensor(blocks, what, "blocks")
    check_tensor(scales, what, "scales")
    if blocks.dtype != torch.float32 or scales.dtype != torch.float32:
        raise DTypeError(f"{what}: blocks and scales must be float32, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 2 or tuple(scales.shape) != (blocks.shape[0],):
        raise ShapeError(f"{what}: blocks must be [nb, block] and scales [nb], got {tuple(blocks.shape)} and "
                         f"{tuple(scales.shape)}")  # fmt: skip
    if scales.device != blocks.device:
        raise DeviceMismatchError(f"{what}: scales are on {scales.device}, blocks on {blocks.device}")
    if isinstance(qmax, bool) or not isinstance(qmax, (int, float)) or not 0 < qmax < math.inf:
        raise InvalidArgumentError(f"{what}: qmax={qmax!r} must be a positive finite number")
    if stochastic:
        check_int(key, what, "key")
    check_int(offset, what, "offset", 0)
    return round_codes(blocks, scales, qmax, stochastic, key, offset)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


def _run_key(seed: torch.Tensor | None, key: int) -> int:
    """The noise key: ``key``, or a traced call's, derived here from the seed drawn in its graph."""
    return key if seed is None else seed_key(int(seed.item()))


@torch.library.custom_op("torsh::quantize", mutates_args=())
def quantize_op(x: torch.Tensor, bits: int, block: int, stochastic: bool, key: int, check_finite: bool,
                provider: str, seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``seed``: a traced call's seed, drawn in the graph (``key`` is then derived from it here)."""
    key = _run_key(seed, key)
    n = x.numel()
    q = torch.empty(code_count(n, bits), dtype=CODE_DTYPE[bits], device=x.device)
    scales = torch.empty(scale_count(n, block), dtype=torch.float32, device=x.device)
    quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider)
    return q, scales


@torch.library.custom_op("torsh::quantize_out", mutates_args=("q", "scales"))
def quantize_out_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, block: int, stochastic: bool,
                    key: int, check_finite: bool, provider: str,
                    seed: torch.Tensor | None = None) -> None:  # fmt: skip
    """``seed``: as for ``torsh::quantize``."""
    quantize_into(x, q, scales, bits, block, stochastic, _run_key(seed, key), check_finite, provider)


@quantize_out_op.register_fake
def _(x, q, scales, bits, block, stochastic, key, check_finite, provider, seed=None):
    return None


@quantize_op.register_fake
def _(x, bits, block, stochastic, key, check_finite, provider, seed=None):
    n = x.numel()
    return x.new_empty(code_count(n, bits), dtype=CODE_DTYPE[bits]), x.new_empty(scale_count(n, block), dtype=_F32)


@torch.library.custom_op("torsh::dequantize", mutates_args=("out",))
def dequantize_op(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, block: int, alpha: float,
                  accumulate: bool, provider: str) -> None:  # fmt: skip
    dequantize_into(q, scales, out, bits, block, alpha, accumulate, provider)


@dequantize_op.register_fake
def _(q, scales, out, bits, block, alpha, accumulate, provider):
    return None


# --------------------------------------------------------------------------------------------------
# Public API

cpu_kernels = eager.lazy_module("quantize.cpu")
"""The cpu provider's kernels (``cpu.py``), for the fast paths: imported on the first call."""


def _check_quant_args(bits, block, what) -> tuple[int, int]:
    bits = check_int(bits, what, "bits")
    if bits not in QMAX:
        raise InvalidArgumentError(f"{what}: bits={bits}; expected 8 or 4")
    block = check_int(block, what, "block")
    if block not in _BLOCKS:
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
    if (
        out is None and eager.cpu_dense(x) and bits.__class__ is int and (bits == 8 or bits == 4)
        and type(block) is int and block in _BLOCKS and (n := x.numel())
    ):  # fmt: skip
        seeded = seed is None if not stochastic else seed.__class__ is int
        if seeded and eager.picks(quantize_impl, n, provider, "cpu"):
            # The common case on the CPU with the cpu provider: its kernel straight on the tensors' memory.
            K = cpu_kernels()
            q = torch.empty(n if bits == 8 else (n + 1) // 2, dtype=CODE_DTYPE[bits])  # (code_count, scale_count)
            scales = torch.empty((n + block - 1) // block)
            bad = K.quantize_ptr(x.data_ptr(), n, q.data_ptr(), scales.data_ptr(), bits, block, bool(stochastic),
                                 seed_key(seed) if stochastic else 0)  # fmt: skip
            if bad and check_finite:
                raise_nonfinite(bad, "torsh_kernels.quantize", "x")
            return q, scales
        if (
            bits == 8 and not stochastic and seed is None and not n % block and n <= CPU_SLICE
            and eager.picks(quantize_impl, n, provider, "torch")
        ):  # fmt: skip
            # The common case, fp32 on the CPU in whole blocks, one slice, deterministic int8: the torch
            # provider's arithmetic, minus what is a no-op when every block's maximum is finite (nan_to_num of
            # codes that cannot be NaN) and the copies into preallocated outputs. A non-finite block (or an
            # overflowing sum) is left to the general path, which computes and reports it.
            with eager.no_grad():
                blocks = x.view(n // block, block)
                amax = blocks.abs().amax(dim=1)
                if math.isfinite(amax.sum().item()):
                    sc = amax.div_(127.0)
                    c = torch.div(blocks, torch.where(sc > 0, sc, 1.0).unsqueeze(1)).round_().clamp_(-127.0, 127.0)
                    return c.to(torch.int8).view(-1), sc
    what = "torsh_kernels.quantize"
    check_provider(provider)
    xf = flat_input(x, what, "x")
    bits, block = _check_quant_args(bits, block, what)
    key, drawn = _stochastic_key(stochastic, seed, what)
    if out is None:
        if drawn is not None:
            return quantize_op(xf, bits, block, True, 0, bool(check_finite), provider or "", drawn)
        return eager.call(quantize_op, (), xf, bits, block, bool(stochastic), key, bool(check_finite), provider or "")
    q, scales = _quantize_out(out, xf, bits, block, what)
    if drawn is not None:
        quantize_out_op(xf, q, scales, bits, block, True, 0, bool(check_finite), provider or "", drawn)
        return out[0], out[1]
    eager.call(
        quantize_out_op, (1, 2), xf, q, scales, bits, block, bool(stochastic), key, bool(check_finite), provider or ""
    )
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
    if (
        out is None and dtype is _F32 and not accumulate and eager.cpu_dense(scales) and scales.dim() == 1
        and (bits := 8 if eager.cpu_dense(q, _I8) else 4 if eager.cpu_dense(q, _U8) else 0) and q.dim() == 1
        and type(block) is int and block in _BLOCKS and eager.finite_scalar(alpha)
        and (n := (q.numel() if bits == 8 else 2 * q.numel()) if numel is None else numel).__class__ is int
        and n > 0 and q.numel() == (n if bits == 8 else (n + 1) // 2) and scales.numel() == (n + block - 1) // block
    ):  # fmt: skip
        if eager.picks(dequantize_impl, n, provider, "cpu"):
            # The common case on the CPU with the cpu provider, into a new fp32 tensor: its kernel straight on
            # the tensors' memory.
            K = cpu_kernels()
            out = torch.empty(n)
            K.dequantize_ptr(q.data_ptr(), scales.data_ptr(), out.data_ptr(), n, bits, block, float(alpha), False)
            return out
        if (
            bits == 8 and alpha == 1.0 and not n % block and n <= CPU_SLICE
            and eager.picks(dequantize_impl, n, provider, "torch")
        ):  # fmt: skip
            # The common case, int8 codes on the CPU in whole blocks, one slice, into a new fp32 tensor: the
            # torch provider's product (int8 -> fp32 is exact, so the mixed-dtype multiply is the same fp32
            # product), returned instead of copied into a preallocated buffer.
            with eager.no_grad():
                return torch.mul(q.view(n // block, block), scales.unsqueeze(1)).view(-1)
    what = "torsh_kernels.dequantize"
    check_provider(provider)
    q, scales, bits, block, numel = _check_codes(q, scales, block, numel, what)
    alpha = check_alpha(alpha, what)
    out, of = decode_out(out, numel, dtype, q.device, what, bool(accumulate))
    if not eager.deferred(q, scales, of):
        no_overlap(of, q, what, "out", "q")
        no_overlap(of, scales, what, "out", "scales")
    eager.call(dequantize_op, (2,), q.reshape(-1).contiguous(), scales.reshape(-1).contiguous(), of, bits, block,
               alpha, bool(accumulate), provider or "")  # fmt: skip
    return out


def _stochastic_key(stochastic: bool, seed: object, what: str) -> tuple[int, torch.Tensor | None]:
    """(the noise key, 0 when not stochastic; a traced call's seed tensor, drawn in the graph from the same
    generator and read by the op at run time, else None). A seed left None is drawn from torch's global
    generator."""
    if stochastic:
        if seed is None and eager.compiling():
            return 0, torch.randint(0, 2**62, (1,))
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        return seed_key(check_int(seed, what, "seed")), None
    if seed is not None:
        check_int(seed, what, "seed")
    return 0, None


def _quantize_out(out: object, xf: torch.Tensor, bits: int, block: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize``'s ``out=(q, scales)``, checked (dtypes, sizes, contiguity, device, no overlap), as flat views."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise ArgumentTypeError(f"{what}: out must be a (q, scales) pair of tensors, got {type(out).__name__}")
    n = xf.numel()
    for t, name, dt, size in ((out[0], "out[0] (q)", CODE_DTYPE[bits], code_count(n, bits)),
                              (out[1], "out[1] (scales)", torch.float32, scale_count(n, block))):  # fmt: skip
        t = check_tensor(t, what, name)
        if t.dtype != dt or t.numel() != size or not t.is_contiguous():
            raise ShapeError(
                f"{what}: {name} must be a contiguous {dt} tensor of {size} elements for {n} elements in blocks "
                f"of {block}, got {t.dtype} with {t.numel()} elements{'' if t.is_contiguous() else ' (strided)'}"
            )
        if t.device != xf.device:
            raise DeviceMismatchError(f"{what}: {name} is on {t.device}, x on {xf.device}")
    q, scales = out[0].view(-1), out[1].view(-1)
    if not eager.deferred(xf, q, scales):  # (while torch.compile traces, or on meta tensors: no addresses)
        no_overlap(q, xf, what, "out[0] (q)", "x")
        no_overlap(scales, xf, what, "out[1] (scales)", "x")
        no_overlap(q, scales, what, "out[0] (q)", "out[1] (scales)")
    return q, scales


def _check_codes(q: object, scales: object, block: object, numel: object, what: str):
    """``dequantize``'s inputs checked: (q, scales, bits, block, numel)."""
    q = check_tensor(q, what, "q")
    scales = check_tensor(scales, what, "scales")
    if q.dtype not in _BITS:
        raise DTypeError(f"{what}: q has dtype {q.dtype}; expected int8 (8-bit codes) or uint8 (packed int4)")
    if scales.dtype != torch.float32:
        raise DTypeError(f"{what}: scales have dtype {scales.dtype}; expected float32")
    if q.device != scales.device:
        raise DeviceMismatchError(f"{what}: q is on {q.device}, scales on {scales.device}")
    bits, block = _check_quant_args(_BITS[q.dtype], block, what)
    if numel is None:
        numel = q.numel() if bits == 8 else 2 * q.numel()
    numel = check_int(numel, what, "numel", 0)
    want_q = code_count(numel, bits)
    if q.numel() != want_q:
        raise ShapeError(f"{what}: {numel} elements at {bits} bits need {want_q} code bytes, q has {q.numel()}")
    if scales.numel() != scale_count(numel, block):
        raise ShapeError(
            f"{what}: {numel} elements in blocks of {block} need {scale_count(numel, block)} scales, got "
            f"{scales.numel()}; pass the block size quantize used"
        )
    return q, scales, bits, block, numel


# --------------------------------------------------------------------------------------------------
# Tuning space (``torsh tune``): the Triton quantizer's elements per program and warps


def _tune_make(device, dtype, size, gen):
    return torch.randn(size, generator=gen).to(dtype).to(device)


def _tune_check(x, out):
    q, s = quantize_ref(x, bits=8)
    return torch.equal(out[0], q) and torch.equal(out[1], s)


register_space(TuneSpace(
    op="quantize", family="compression", dtypes=COMPRESS_DTYPES, make=_tune_make,
    meta={"triton": {"QTILE": (4096, 1024, 2048, 8192), "num_warps": (8, 4)}},
    run=lambda x, p: quantize(x, bits=8, provider=p), check=_tune_check,
))  # fmt: skip
