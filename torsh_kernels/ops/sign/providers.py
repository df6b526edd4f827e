"""Provider implementations of the sign ops, registered per provider (torch, triton, numba, cpu). Inputs are
validated, contiguous and 1-D, on one device (the public ops check them, ``api.py``); the kernels are imported
on a provider's first launch (``triton.py``, ``numba.py``, ``cpu.py``), so importing the family imports none.

sign_compress is two passes: ``abs_sum_impl`` -> (sum |v| as an fp64 0-dim tensor or a host float, the
non-finite count), then ``pack_impl`` packs the signs (and updates the residual). sign_decompress is one:
``unpack_impl``.
"""

from __future__ import annotations

import math

import torch

from ..common import WARPS, LazyNonFiniteCount, acc_torch, whole_programs
from ..registry import Op

__all__ = [
    "SIGN_BYTES",
    "SIGN_TAIL",
    "SUM_BLOCK",
    "UNPACK_BYTES",
    "abs_sum_impl",
    "pack_impl",
    "pack_signs",
    "signs",
    "unpack_impl",
]

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

abs_sum_impl = Op("sign_compress")
pack_impl = Op("sign_compress.pack")
unpack_impl = Op("sign_decompress")


# --------------------------------------------------------------------------------------------------
# The torch provider's constants and packing (the public ops' torch fast paths use them too)

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


def pack_signs(pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Bytes of 8 signs (bit j of byte i: element 8i + j of the bool tensor ``pos``), into ``out`` or a
    new tensor of ``ceil(n / 8)`` bytes."""
    p8 = pos.view(torch.uint8)
    if pos.numel() % 8:
        p8 = torch.nn.functional.pad(p8, (0, -pos.numel() % 8))
    return torch.sum(p8.view(-1, 8) << _consts(pos.device)[0], dim=1, dtype=torch.uint8, out=out)


def signs(bits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``+-s`` (fp32) for every packed sign, ``8 * bits.numel()`` of them: one gather of the table of +-1
    by byte, times ``s`` (exactly ``s`` or ``-s``)."""
    return torch.index_select(_consts(bits.device)[1], 0, bits.int()).view(-1).mul_(s)


# --------------------------------------------------------------------------------------------------
# sign_compress, pass 1: (sum |v|, non-finite count), v = x + r


@abs_sum_impl.register("torch")
def _abs_sum_torch(x, r):
    v = acc_torch(x, r)
    total = v.abs().sum(dtype=torch.float64)  # finite unless an element is NaN/Inf (no fp64 overflow)
    if math.isfinite(total.item()):
        return total, 0
    return total, int((~torch.isfinite(v)).sum())


@abs_sum_impl.register("triton")
def _abs_sum_triton(x, r):
    from . import triton as K

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


@abs_sum_impl.register("numba")
def _abs_sum_numba(x, r):
    from . import numba as K

    return K.abs_sum(x, r)


@abs_sum_impl.register("cpu")
def _abs_sum_cpu(x, r):
    from . import cpu as K

    return K.abs_sum(x, r)


# --------------------------------------------------------------------------------------------------
# sign_compress, pass 2: the signs packed 8 to a byte; with r, r = v - scale * sign(v)


@pack_impl.register("torch")
def _sign_pack_torch(x, r, bits, scale):
    v = acc_torch(x, r)
    pos = v >= 0
    pack_signs(pos, bits)
    if r is not None:
        r.copy_(v - torch.where(pos, scale, -scale))


@pack_impl.register("triton")
def _sign_pack_triton(x, r, bits, scale):
    from . import triton as K

    n = x.numel()
    for grid, start, even in whole_programs(n, 8 * SIGN_BYTES, SIGN_TAIL):
        K._sign_pack_kernel[grid](x, r if r is not None else x, bits, scale, start, n,
                                  BYTES=SIGN_BYTES if even else SIGN_TAIL // 8, HAS_R=r is not None, EVEN=even,
                                  num_warps=WARPS)  # fmt: skip


@pack_impl.register("numba")
def _sign_pack_numba(x, r, bits, scale):
    from . import numba as K

    K.sign_pack(x, r, bits, scale)


@pack_impl.register("cpu")
def _sign_pack_cpu(x, r, bits, scale):
    from . import cpu as K

    K.sign_pack(x, r, bits, scale)


# --------------------------------------------------------------------------------------------------
# sign_decompress: +-alpha * scale per packed sign (plus out with accumulate)


@unpack_impl.register("torch")
def _sign_unpack_torch(bits, scale, out, alpha, accumulate):
    n = out.numel()
    v = signs(bits, scale * alpha if alpha != 1.0 else scale)
    if n != v.numel():
        v = v[:n]
    if accumulate:
        v = out.float() + v
    out.copy_(v)


@unpack_impl.register("triton")
def _sign_unpack_triton(bits, scale, out, alpha, accumulate):
    from . import triton as K

    n = out.numel()
    nb = UNPACK_BYTES * (2 if out.element_size() == 2 and not accumulate else 1)
    for grid, start, even in whole_programs(n, 8 * nb, SIGN_TAIL):
        K._sign_unpack_kernel[grid](bits, scale, out, start, n, alpha, BYTES=nb if even else SIGN_TAIL // 8,
                                    ACCUMULATE=accumulate, EVEN=even, num_warps=WARPS,
                                    enable_fp_fusion=False)  # fmt: skip


@unpack_impl.register("numba")
def _sign_unpack_numba(bits, scale, out, alpha, accumulate):
    from . import numba as K

    K.sign_unpack(bits, scale, out, alpha, accumulate)


@unpack_impl.register("cpu")
def _sign_unpack_cpu(bits, scale, out, alpha, accumulate):
    from . import cpu as K

    K.sign_unpack(bits, scale, out, alpha, accumulate)
