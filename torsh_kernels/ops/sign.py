"""1-bit sign compression ops: sign_compress (with error feedback) and sign_decompress.

- ``sign_compress(x, residual=)`` -> ``(bits, scale)``: 8 signs per byte (element 8i + j in bit j; 1 for
  ``v >= 0``) and ``scale = mean(|v|)`` (summed in fp64), v = x + residual; with a residual, it is left
  holding ``v - scale * sign(v)`` (EF-SignSGD). ``sign_decompress`` gives ``+-scale``.

See ``common`` for what the compression families share (fp32 compute, the non-finite checks).
"""

from __future__ import annotations

import math

import torch

from ..checks import check_int
from ..errors import DeviceMismatchError, DTypeError, ShapeError
from . import eager
from .common import (
    WARPS,
    LazyNonFiniteCount,
    acc_ref,
    acc_torch,
    as_count,
    check_alpha,
    check_tensor,
    decode_out,
    flat_inout,
    flat_input,
    no_overlap,
    on_device,
    raise_nonfinite,
    select_provider,
    store_ref,
    whole_programs,
)
from .registry import Op, check_provider

__all__ = ["sign_compress", "sign_compress_ref", "sign_decompress", "sign_decompress_ref"]

SUM_BLOCK = 4096
"""Elements per Triton abs_sum program of the bulk (32 a thread at 4 warps, 16 with a residual at 8)."""
SIGN_BYTES = 512
"""Packed bytes per Triton sign_pack program of the bulk (16 elements a thread at 8 warps)."""
UNPACK_BYTES = 1024
"""Packed bytes per Triton sign_unpack program of the bulk (32 elements a thread at 8 warps); twice as many into
16-bit outputs without accumulate (64 a thread: 8 bytes of signs a thread, a 64-bit load, beside 128 output
bytes)."""
SIGN_TAIL = 256
"""Elements per Triton program of the tail (what the bulk's whole programs leave; small: few registers)."""


# --------------------------------------------------------------------------------------------------
# Torch references (the oracles for the tests; plain PyTorch, any device)


def sign_compress_ref(x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    acc = acc_ref(x, residual)
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
    return store_ref(torch.where(pos, s, -s), out, dtype, accumulate)


# --------------------------------------------------------------------------------------------------
# Provider implementations. Inputs are validated, contiguous and 1-D, on one device.

_abs_sum = Op("sign_compress")
_sign_pack = Op("sign_compress.pack")
_sign_unpack = Op("sign_decompress")
_T = torch.Tensor
_F32 = torch.float32
_CPU = torch.device("cpu")
_ZERO = torch.zeros(())  # the CPU fast path's 0 (a tensor operand: no scalar wrapped per call)
_EXACT_INT = 1 << 53


# sign: pass 1 -> (sum |v| as fp64 0-dim, non-finite count); pass 2 packs (and updates the residual)
@_abs_sum.register("torch")
def _abs_sum_torch(x, r):
    v = acc_torch(x, r)
    total = v.abs().sum(dtype=torch.float64)  # finite unless an element is NaN/Inf (no fp64 overflow)
    if math.isfinite(total.item()):
        return total, 0
    return total, int((~torch.isfinite(v)).sum())


@_abs_sum.register("triton")
def _abs_sum_triton(x, r):
    from . import _sign_triton as K

    n = x.numel()
    parts = whole_programs(n, SUM_BLOCK, SIGN_TAIL)
    part = torch.empty(sum(g[0] for g, _, _ in parts), dtype=torch.float32, device=x.device)
    p0 = 0
    for grid, start, even in parts:
        K._abs_sum_kernel[grid](x, r if r is not None else x, part, p0, start, n,
                                BLOCK=SUM_BLOCK if even else SIGN_TAIL, HAS_R=r is not None, EVEN=even,
                                num_warps=WARPS if r is not None else 4)  # fmt: skip
        p0 += grid[0]
    total = part.sum(dtype=torch.float64)
    return total, LazyNonFiniteCount(total, lambda: acc_torch(x, r))  # sum |x + r| is finite unless x + r is not


@_abs_sum.register("numba")
def _abs_sum_numba(x, r):
    from . import _sign_numba as K

    return K.abs_sum(x, r)


@_abs_sum.register("cpu")
def _abs_sum_cpu(x, r):
    from . import _sign_cpu as K

    return K.abs_sum(x, r)


@_sign_pack.register("torch")
def _sign_pack_torch(x, r, bits, scale):
    v = acc_torch(x, r)
    pos = v >= 0
    _pack_signs(pos, bits)
    if r is not None:
        r.copy_(v - torch.where(pos, scale, -scale))


@_sign_pack.register("triton")
def _sign_pack_triton(x, r, bits, scale):
    from . import _sign_triton as K

    n = x.numel()
    for grid, start, even in whole_programs(n, 8 * SIGN_BYTES, SIGN_TAIL):
        K._sign_pack_kernel[grid](x, r if r is not None else x, bits, scale, start, n,
                                  BYTES=SIGN_BYTES if even else SIGN_TAIL // 8, HAS_R=r is not None, EVEN=even,
                                  num_warps=WARPS)  # fmt: skip


@_sign_pack.register("numba")
def _sign_pack_numba(x, r, bits, scale):
    from . import _sign_numba as K

    K.sign_pack(x, r, bits, scale)


@_sign_pack.register("cpu")
def _sign_pack_cpu(x, r, bits, scale):
    from . import _sign_cpu as K

    K.sign_pack(x, r, bits, scale)


_CONSTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # per device, never written: see _consts


def _consts(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch provider's constants on ``device``: the bit positions 0..7 (uint8) and a 256 x 8 fp32
    table whose row b holds +-1.0 for the 8 bits of byte b."""
    c = _CONSTS.get(device)
    if c is None:
        shifts = torch.arange(8, dtype=torch.uint8, device=device)
        b = torch.arange(256, device=device).unsqueeze(1)
        c = _CONSTS[device] = (shifts, torch.where((b >> shifts) & 1 == 1, 1.0, -1.0))
    return c


def _pack_signs(pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bytes of 8 signs (bit j of byte i: element 8i + j of the bool tensor ``pos``), into ``out`` or a
    new tensor of ``ceil(n / 8)`` bytes."""
    p8 = pos.view(torch.uint8)
    if pos.numel() % 8:
        p8 = torch.nn.functional.pad(p8, (0, -pos.numel() % 8))
    return torch.sum(p8.view(-1, 8) << _consts(pos.device)[0], dim=1, dtype=torch.uint8, out=out)


def _signs(bits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``+-s`` (fp32) for every packed sign, ``8 * bits.numel()`` of them: one gather of the table of +-1
    by byte, times ``s`` (exactly ``s`` or ``-s``)."""
    return torch.index_select(_consts(bits.device)[1], 0, bits.int()).view(-1).mul_(s)


@_sign_unpack.register("torch")
def _sign_unpack_torch(bits, scale, out, alpha, accumulate):
    n = out.numel()
    v = _signs(bits, scale * alpha if alpha != 1.0 else scale)
    if n != v.numel():
        v = v[:n]
    if accumulate:
        v = out.float() + v
    out.copy_(v)


@_sign_unpack.register("triton")
def _sign_unpack_triton(bits, scale, out, alpha, accumulate):
    from . import _sign_triton as K

    n = out.numel()
    nb = UNPACK_BYTES * (2 if out.element_size() == 2 and not accumulate else 1)
    for grid, start, even in whole_programs(n, 8 * nb, SIGN_TAIL):
        K._sign_unpack_kernel[grid](bits, scale, out, start, n, alpha, BYTES=nb if even else SIGN_TAIL // 8,
                                    ACCUMULATE=accumulate, EVEN=even, num_warps=WARPS,
                                    enable_fp_fusion=False)  # fmt: skip


@_sign_unpack.register("numba")
def _sign_unpack_numba(bits, scale, out, alpha, accumulate):
    from . import _sign_numba as K

    K.sign_unpack(bits, scale, out, alpha, accumulate)


@_sign_unpack.register("cpu")
def _sign_unpack_cpu(bits, scale, out, alpha, accumulate):
    from . import _sign_cpu as K

    K.sign_unpack(bits, scale, out, alpha, accumulate)


# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations.


@torch.library.custom_op("torsh::sign_compress", mutates_args=("residual",))
def _sign_op(x: torch.Tensor, residual: torch.Tensor | None, check_finite: bool,
             provider: str, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced and residual is not None:
        no_overlap(residual.view(-1), x.view(-1), "torsh_kernels.sign_compress", "residual", "x")
    n = x.numel()
    bits = torch.empty(-(-n // 8), dtype=torch.uint8, device=x.device)
    if n == 0:
        return bits, torch.zeros((), dtype=torch.float32, device=x.device)
    name = select_provider(_abs_sum, x, provider)
    r = residual.view(-1) if residual is not None else None
    with on_device(x.device):
        total, bad = _abs_sum(name, x.view(-1), r)
        if check_finite and (b := as_count(bad)):
            raise_nonfinite(b, "torsh_kernels.sign_compress", "x + residual" if r is not None else "x")
        # mean |v|: the fp64 sum divided by n in fp64, rounded once to fp32 (a host float from the cpu provider)
        scale = torch.scalar_tensor(total / n, dtype=_F32) if type(total) is float else (total / n).to(torch.float32)
        _sign_pack(name, x.view(-1), r, bits, scale)
    return bits, scale


@_sign_op.register_fake
def _(x, residual, check_finite, provider, traced=False):
    return x.new_empty(-(-x.numel() // 8), dtype=torch.uint8), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("torsh::sign_decompress", mutates_args=("out",))
def _sign_decompress_op(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, alpha: float, accumulate: bool,
                        provider: str) -> None:  # fmt: skip
    if out.numel():
        name = select_provider(_sign_unpack, out, provider)
        with on_device(out.device):
            _sign_unpack(name, bits, scale.reshape(()).float(), out.view(-1), alpha, accumulate)


@_sign_decompress_op.register_fake
def _(bits, scale, out, alpha, accumulate, provider):
    return None


# --------------------------------------------------------------------------------------------------
# Public API

_cpu_kernels = eager.lazy_module("_sign_cpu")  # the cpu provider's kernels, for the fast paths


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
    if (
        type(x) is _T and x.dtype is _F32 and x.is_cpu and x.is_contiguous() and (n := x.numel()) and n < _EXACT_INT
        and (residual is None or (type(residual) is _T and residual.dtype is _F32 and residual.is_cpu
                                  and residual.is_contiguous() and residual.numel() == n))
        and eager.fast()  # (before anything reads addresses: false while torch.compile traces)
        and (residual is None or eager.disjoint(x, residual, 4 * n))
        and _abs_sum.select(_CPU, _F32, n, provider or None) == "cpu"
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider: its two passes straight on the tensors' memory.
        K = _cpu_kernels()
        bits = torch.empty((n + 7) // 8, dtype=torch.uint8)
        scale, bad = K.compress_ptr(x.data_ptr(), residual.data_ptr() if residual is not None else 0,
                                    residual is not None, n, bits.data_ptr(), bool(check_finite))  # fmt: skip
        if bad and check_finite:
            raise_nonfinite(bad, "torsh_kernels.sign_compress", "x + residual" if residual is not None else "x")
        if residual is not None:
            eager.bump(residual)
        return bits, torch.scalar_tensor(scale, dtype=_F32)
    if (
        residual is None and type(x) is _T and x.dtype is _F32 and x.is_cpu and x.is_contiguous()
        and (n := x.numel()) and not n % 8 and n < _EXACT_INT
        and eager.fast()
        and _abs_sum.select(_CPU, _F32, n, provider or None) == "torch"
    ):  # fmt: skip
        # The common case, fp32 on the CPU without a residual, whole bytes: the torch provider's two passes
        # with its constants cached. mean |x| is the fp64 sum (read once for the finite check anyway)
        # divided by n in fp64 and rounded to fp32, here in Python: the same IEEE operations.
        with eager.no_grad():
            total = x.abs().sum(dtype=torch.float64).item()
            if math.isfinite(total):
                return _pack_signs(x.ge(_ZERO).view(-1)), torch.scalar_tensor(total / n, dtype=_F32)
    what = "torsh_kernels.sign_compress"
    check_provider(provider)
    xf = flat_input(x, what, "x")
    rf, traced = None, False
    if residual is not None:
        rf = flat_inout(residual, what, "residual", xf.numel(), xf.device)
        traced = eager.deferred(xf, rf)  # the memory check then runs in the op, at run time
        if not traced:
            no_overlap(rf, xf, what, "residual", "x")
    return eager.call(_sign_op, (1,), xf, rf, bool(check_finite), provider or "", traced)


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
    if (
        out is None and dtype is _F32 and not accumulate and (alpha.__class__ is float or alpha.__class__ is int)
        and -math.inf < alpha < math.inf and type(bits) is _T and type(scale) is _T and bits.dtype is torch.uint8
        and scale.dtype is _F32 and scale.numel() == 1 and bits.is_cpu and scale.is_cpu and bits.dim() == 1
        and bits.is_contiguous() and type(numel) is int and numel > 0 and bits.numel() == (numel + 7) // 8
        and eager.fast()
        and _sign_unpack.select(_CPU, _F32, numel, provider or None) == "cpu"
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider, into a new fp32 tensor: its kernel.
        K = _cpu_kernels()
        out = torch.empty(numel)
        s = K.np.float32(scale.item())
        K.unpack_ptr(bits.data_ptr(), s * K.np.float32(alpha) if alpha != 1.0 else s, out.data_ptr(), numel)
        return out
    if (
        out is None and dtype is _F32 and not accumulate and (alpha.__class__ is float or alpha.__class__ is int)
        and alpha == 1.0 and type(bits) is _T and type(scale) is _T and bits.dtype is torch.uint8
        and scale.dtype is _F32 and scale.dim() == 0 and bits.is_cpu and scale.is_cpu and bits.dim() == 1
        and type(numel) is int and numel > 0 and not numel % 8 and bits.numel() * 8 == numel
        and eager.fast()
        and _sign_unpack.select(_CPU, _F32, numel, provider or None) == "torch"
    ):  # fmt: skip
        # The common case, whole bytes on the CPU into a new fp32 tensor: the torch provider's unpacking,
        # its +-scale returned instead of copied into a new buffer.
        with eager.no_grad():
            return _signs(bits, scale)
    what = "torsh_kernels.sign_decompress"
    check_provider(provider)
    bits = check_tensor(bits, what, "bits")
    if bits.dtype != torch.uint8:
        raise DTypeError(f"{what}: bits have dtype {bits.dtype}; expected uint8")
    numel = check_int(numel, what, "numel", 0)
    if bits.numel() != -(-numel // 8):
        raise ShapeError(f"{what}: {numel} signs need {-(-numel // 8)} bytes, bits has {bits.numel()}")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        scale = torch.tensor(float(scale), device=bits.device)
    scale = check_tensor(scale, what, "scale")
    if not scale.is_floating_point():
        raise DTypeError(f"{what}: scale has dtype {scale.dtype}; expected a floating-point scale (from sign_compress)")
    if scale.numel() != 1:
        raise ShapeError(f"{what}: scale must be one element, got {scale.numel()}")
    if scale.device != bits.device:
        raise DeviceMismatchError(f"{what}: scale is on {scale.device}, bits on {bits.device}")
    alpha = check_alpha(alpha, what)
    out, of = decode_out(out, numel, dtype, bits.device, what, bool(accumulate))
    if not eager.deferred(bits, scale, of):
        no_overlap(of, bits, what, "out", "bits")
        no_overlap(of, scale, what, "out", "scale")
    eager.call(
        _sign_decompress_op, (2,), bits.reshape(-1).contiguous(), scale, of, alpha, bool(accumulate), provider or ""
    )
    return out
