"""Blockwise quantization ops: quantize and dequantize, with round-to-nearest or stochastic rounding.

- ``quantize(x, bits=8|4, block=256, stochastic=, seed=)`` -> ``(q, scales)``: symmetric blockwise absmax
  scaling, ``scale = absmax / qmax`` (qmax 127 or 7), codes ``round(x / scale)`` (to nearest even) or
  ``floor(x / scale + u)`` with ``u`` uniform in [0, 1) from a counter-based hash of (seed, element
  index): stochastic rounding that is unbiased and reproducible from the seed, bit-identical across
  providers. int8 codes one per byte; int4 codes two per byte (element 2i in the low nibble, 2i+1 in the
  high, two's complement). ``dequantize`` reverses it. Error bound per element: ``scale / 2`` (round to
  nearest) or ``scale`` (stochastic), i.e. ``absmax / (2 * qmax)`` resp. ``absmax / qmax`` of its block,
  plus fp32 rounding. A block holding NaN/Inf gets a NaN scale (with ``check_finite=False``; otherwise
  the input raises :class:`NonFiniteError`).

See ``common`` for what the compression families share (fp32 compute, the non-finite checks).
"""

from __future__ import annotations

import math

import torch

from ..checks import check_int
from ..errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    ShapeError,
)
from . import eager
from .common import (
    COMPRESS_DTYPES,
    LazyNonFiniteCount,
    as_count,
    check_alpha,
    check_tensor,
    decode_out,
    flat_input,
    no_overlap,
    on_device,
    raise_nonfinite,
    select_provider,
    whole_programs,
)
from .quantize_format import QMAX, dequantize_ref, quantize_ref, seed_key, uniform_noise
from .registry import Op, check_provider, tuned_meta
from .tuning import TuneSpace, register_space

__all__ = [
    "QMAX",
    "block_codes",
    "dequantize",
    "dequantize_ref",
    "quantize",
    "quantize_ref",
    "seed_key",
    "uniform_noise",
]

QTILE = 4096
"""Elements per Triton program of the bulk (several quantization blocks; int8 quantize tunes it per shape
bucket, with num_warps)."""
QWARPS = {8: 8, 4: 4}
"""Warps per Triton program of the bulk by bit width: 16 elements a thread for int8 (16 code bytes: a 128-bit
store or load), 32 for int4 (16 packed bytes). Quantizing fp32 to int4 runs 1 warp and QTILE / 4 elements a
program instead: at 4 warps a block's 256 elements (4 a chunk) span two warps, and the reduction across them
and the 8 blocks a thread then touches take 70 registers (80 stochastic), at 1 warp 56 (63)."""
QTAIL = 256
"""Elements per Triton program of the tail (the last partial program's blocks; small: few registers)."""


# On the CPU the torch providers work through the elements in slices of about this many, so that their
# fp32 temporaries stay in cache instead of each costing a full pass of fresh pages (10x at 64 MiB).
CPU_SLICE = 1 << 17


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated, contiguous and 1-D, on one device.

_quantize = Op("quantize")
_dequantize = Op("dequantize")
_T = torch.Tensor
_F32 = torch.float32
_CPU = torch.device("cpu")
_INF = math.inf


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
    return _block_codes(blocks, scales, qmax, stochastic, key, offset)


def _block_codes(blocks, scales, qmax, stochastic, key, offset=0) -> torch.Tensor:
    """:func:`block_codes` on checked arguments (the torch provider's per-slice call)."""
    nb, block = blocks.shape
    y = blocks / torch.where(scales > 0, scales, 1.0)[:, None]  # an all-zero block has s == 0 and y == 0
    if stochastic:
        end = offset + nb * block
        idx = torch.arange(offset, end, device=y.device, dtype=torch.int32 if end < 2**31 else torch.int64)
        c = torch.floor_(y.view(-1).add_(uniform_noise(idx, key))).view(nb, block)
    else:
        c = torch.round(y)
    return c.nan_to_num_(nan=0.0).clamp_(-qmax, qmax)


def _cpu_slices(n: int, block: int, device: torch.device) -> list[tuple[int, int]]:
    """[a, b) element ranges, whole blocks each (block is even, so int4 bytes never straddle two)."""
    step = max(block, CPU_SLICE // block * block) if device.type == "cpu" else n
    return [(a, min(a + step, n)) for a in range(0, n, max(step, 1))]


@_quantize.register("torch")
def _quantize_torch(x, q, scales, bits, block, stochastic, key):
    bad = 0
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
    finite = math.isfinite(amax.sum().item())  # all >= 0: finite iff every block is (an overflow rechecks)
    bad_blocks = None if finite else ~torch.isfinite(amax)
    s = amax.div_(qmax) if finite else torch.where(bad_blocks, float("nan"), amax / qmax)
    scales.copy_(s)
    c = _block_codes(blocks, s, qmax, stochastic, key, offset).to(torch.int8).view(-1)[:n]
    if bits == 8:
        q.copy_(c)
    else:
        c = torch.nn.functional.pad(c, (0, n % 2)).view(-1, 2) & 15
        q.copy_(c[:, 0] | (c[:, 1] << 4))
    if bad_blocks is None or not bool(bad_blocks.any()):
        return 0
    return int((~torch.isfinite(blocks[bad_blocks])).sum())  # rare: count the elements for the message


def _tiles(n: int, block: int, group: int, bulk: bool = True) -> list[tuple[tuple[int], int, int, bool]]:
    """:func:`common.whole_programs` in quantization blocks of ``block``, as ``(grid, group, start, even)``: the
    bulk in programs of ``group`` blocks, the rest in programs of about QTAIL elements (whole blocks: a block
    never spans two launches)."""
    tail = max(1, min(group, QTAIL // block))
    return [(grid, group if even else tail, start, even)
            for grid, start, even in whole_programs(n, group * block, tail * block, bulk)]  # fmt: skip


@_quantize.register("triton")
def _quantize_triton(x, q, scales, bits, block, stochastic, key):
    from . import _quantize_triton as K

    n = x.numel()
    if bits == 8:  # the tuned configuration (``torsh tune`` runs int8)
        m = tuned_meta("quantize", x.device, x.dtype, n, "triton")
        tile, warps = m.get("QTILE", QTILE), m.get("num_warps", QWARPS[8])
    else:
        tile, warps = (QTILE // 4, 1) if x.dtype == torch.float32 else (QTILE, QWARPS[4])
    # the int4 bulk stores 16-bit words of packed codes: a code buffer at an odd address takes the byte path
    for grid, g, start, even in _tiles(n, block, max(1, tile // block), bulk=bits == 8 or q.data_ptr() % 2 == 0):
        K._quantize_kernel[grid](
            x, q, scales, start, n, key,
            QBLOCK=block, GROUP=g, BITS=bits, QMAXV=QMAX[bits], STOCHASTIC=stochastic, EVEN=even, num_warps=warps,
        )  # fmt: skip
    return LazyNonFiniteCount(scales, lambda: x)  # a block holding NaN/Inf has a NaN scale


@_quantize.register("numba")
def _quantize_numba(x, q, scales, bits, block, stochastic, key):
    from . import _quantize_numba as K

    return K.quantize(x, q, scales, bits, block, stochastic, key)


@_quantize.register("cpu")
def _quantize_cpu(x, q, scales, bits, block, stochastic, key):
    from . import _quantize_cpu as K

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
    from . import _quantize_triton as K

    n = out.numel()
    for grid, g, start, even in _tiles(n, block, max(1, QTILE // block)):
        K._dequantize_kernel[grid](
            q, scales, out, start, n, alpha,
            QBLOCK=block, GROUP=g, BITS=bits, ACCUMULATE=accumulate, EVEN=even, num_warps=QWARPS[bits],
            enable_fp_fusion=False,
        )  # fmt: skip


@_dequantize.register("numba")
def _dequantize_numba(q, scales, out, bits, block, alpha, accumulate):
    from . import _quantize_numba as K

    K.dequantize(q, scales, out, bits, block, alpha, accumulate)


@_dequantize.register("cpu")
def _dequantize_cpu(q, scales, out, bits, block, alpha, accumulate):
    from . import _quantize_cpu as K

    K.dequantize(q, scales, out, bits, block, alpha, accumulate)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


def _quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider) -> None:
    if x.numel():
        name = select_provider(_quantize, x, provider)
        with on_device(x.device):
            bad = _quantize(name, x.view(-1), q, scales, bits, block, stochastic, key)
        if check_finite and (b := as_count(bad)):
            raise_nonfinite(b, "torsh_kernels.quantize", "x")


@torch.library.custom_op("torsh::quantize", mutates_args=())
def _quantize_op(x: torch.Tensor, bits: int, block: int, stochastic: bool, key: int, check_finite: bool,
                 provider: str, seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``seed``: a traced call's seed, drawn in the graph (``key`` is then derived from it here)."""
    if seed is not None:
        key = seed_key(int(seed.item()))
    n = x.numel()
    q = torch.empty(n if bits == 8 else -(-n // 2), dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(-(-n // block), dtype=torch.float32, device=x.device)
    _quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider)
    return q, scales


@torch.library.custom_op("torsh::quantize_out", mutates_args=("q", "scales"))
def _quantize_out_op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, block: int, stochastic: bool,
                     key: int, check_finite: bool, provider: str,
                     seed: torch.Tensor | None = None) -> None:  # fmt: skip
    """``seed``: as for ``torsh::quantize``."""
    if seed is not None:
        key = seed_key(int(seed.item()))
    _quantize_into(x, q, scales, bits, block, stochastic, key, check_finite, provider)


@_quantize_out_op.register_fake
def _(x, q, scales, bits, block, stochastic, key, check_finite, provider, seed=None):
    return None


@_quantize_op.register_fake
def _(x, bits, block, stochastic, key, check_finite, provider, seed=None):
    n = x.numel()
    q = x.new_empty(n if bits == 8 else -(-n // 2), dtype=torch.int8 if bits == 8 else torch.uint8)
    return q, x.new_empty(-(-n // block), dtype=torch.float32)


@torch.library.custom_op("torsh::dequantize", mutates_args=("out",))
def _dequantize_op(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, block: int, alpha: float,
                   accumulate: bool, provider: str) -> None:  # fmt: skip
    if out.numel():
        name = select_provider(_dequantize, out, provider)
        with on_device(out.device):
            _dequantize(name, q, scales, out.view(-1), bits, block, alpha, accumulate)


@_dequantize_op.register_fake
def _(q, scales, out, bits, block, alpha, accumulate, provider):
    return None


# --------------------------------------------------------------------------------------------------
# Public API

_cpu_kernels = eager.lazy_module("_quantize_cpu")  # the cpu provider's kernels, for the fast paths


def _check_quant_args(bits, block, what) -> tuple[int, int]:
    bits = check_int(bits, what, "bits")
    if bits not in QMAX:
        raise InvalidArgumentError(f"{what}: bits={bits}; expected 8 or 4")
    block = check_int(block, what, "block")
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
    if (
        out is None and type(x) is _T and x.dtype is _F32 and x.is_cpu and x.is_contiguous()
        and bits.__class__ is int and (bits == 8 or bits == 4) and type(block) is int and 2 <= block <= 65536
        and not block & (block - 1) and (n := x.numel())
        and (seed is None if not stochastic else seed.__class__ is int)
        and eager.fast()
        and _quantize.select(_CPU, _F32, n, provider or None) == "cpu"
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider: its kernel straight on the tensors' memory.
        K = _cpu_kernels()
        q = torch.empty(n if bits == 8 else (n + 1) // 2, dtype=torch.int8 if bits == 8 else torch.uint8)
        scales = torch.empty((n + block - 1) // block)
        bad = K.quantize_ptr(x.data_ptr(), n, q.data_ptr(), scales.data_ptr(), bits, block, bool(stochastic),
                             seed_key(seed) if stochastic else 0)  # fmt: skip
        if bad and check_finite:
            raise_nonfinite(bad, "torsh_kernels.quantize", "x")
        return q, scales
    if (
        out is None and bits.__class__ is int and bits == 8 and not stochastic and seed is None and type(x) is _T
        and x.dtype is _F32
        and x.is_cpu and x.is_contiguous() and type(block) is int and 2 <= block <= 65536 and not block & (block - 1)
        and (n := x.numel()) and not n % block and n <= CPU_SLICE
        and eager.fast()
        and _quantize.select(_CPU, _F32, n, provider or None) == "torch"
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
            return _quantize_op(xf, bits, block, True, 0, bool(check_finite), provider or "", drawn)
        return eager.call(_quantize_op, (), xf, bits, block, bool(stochastic), key, bool(check_finite), provider or "")
    q, scales = _quantize_out(out, xf, bits, block, what)
    if drawn is not None:
        _quantize_out_op(xf, q, scales, bits, block, True, 0, bool(check_finite), provider or "", drawn)
        return out[0], out[1]
    eager.call(
        _quantize_out_op, (1, 2), xf, q, scales, bits, block, bool(stochastic), key, bool(check_finite), provider or ""
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
        out is None and dtype is _F32 and not accumulate and type(q) is _T and type(scales) is _T
        and ((bits := 8) if q.dtype is torch.int8 else (bits := 4) if q.dtype is torch.uint8 else 0)
        and scales.dtype is _F32 and q.is_cpu and scales.is_cpu and q.dim() == 1 and scales.dim() == 1
        and q.is_contiguous() and scales.is_contiguous()
        and type(block) is int and 2 <= block <= 65536 and not block & (block - 1)
        and (n := (q.numel() if bits == 8 else 2 * q.numel()) if numel is None else numel).__class__ is int
        and n > 0 and q.numel() == (n if bits == 8 else (n + 1) // 2) and scales.numel() == (n + block - 1) // block
        and (alpha.__class__ is float or alpha.__class__ is int) and -_INF < alpha < _INF
        and eager.fast()
        and _dequantize.select(_CPU, _F32, n, provider or None) == "cpu"
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider, into a new fp32 tensor: its kernel straight on
        # the tensors' memory.
        K = _cpu_kernels()
        out = torch.empty(n)
        K.dequantize_ptr(q.data_ptr(), scales.data_ptr(), out.data_ptr(), n, bits, block, float(alpha), False)
        return out
    if (
        out is None and dtype is _F32 and not accumulate and (alpha.__class__ is float or alpha.__class__ is int)
        and alpha == 1.0 and type(q) is _T and type(scales) is _T and q.dtype is torch.int8
        and scales.dtype is _F32 and q.is_cpu and scales.is_cpu and q.dim() == 1 and scales.dim() == 1
        and q.is_contiguous() and scales.is_contiguous()
        and type(block) is int and 2 <= block <= 65536 and not block & (block - 1)
        and (n := q.numel()) and (numel is None or (type(numel) is int and numel == n))
        and not n % block and n <= CPU_SLICE and scales.numel() == n // block
        and eager.fast()
        and _dequantize.select(_CPU, _F32, n, provider or None) == "torch"
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
    eager.call(_dequantize_op, (2,), q.reshape(-1).contiguous(), scales.reshape(-1).contiguous(), of, bits, block,
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
    qdt = torch.int8 if bits == 8 else torch.uint8
    for t, name, dt, size in ((out[0], "out[0] (q)", qdt, n if bits == 8 else -(-n // 2)),
                              (out[1], "out[1] (scales)", torch.float32, -(-n // block))):  # fmt: skip
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
    if q.dtype not in (torch.int8, torch.uint8):
        raise DTypeError(f"{what}: q has dtype {q.dtype}; expected int8 (8-bit codes) or uint8 (packed int4)")
    if scales.dtype != torch.float32:
        raise DTypeError(f"{what}: scales have dtype {scales.dtype}; expected float32")
    if q.device != scales.device:
        raise DeviceMismatchError(f"{what}: q is on {q.device}, scales on {scales.device}")
    bits, block = _check_quant_args(8 if q.dtype == torch.int8 else 4, block, what)
    if numel is None:
        numel = q.numel() if bits == 8 else 2 * q.numel()
    numel = check_int(numel, what, "numel", 0)
    want_q = numel if bits == 8 else -(-numel // 2)
    if q.numel() != want_q:
        raise ShapeError(f"{what}: {numel} elements at {bits} bits need {want_q} code bytes, q has {q.numel()}")
    if scales.numel() != -(-numel // block):
        raise ShapeError(
            f"{what}: {numel} elements in blocks of {block} need {-(-numel // block)} scales, got "
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
