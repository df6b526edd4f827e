"""CPU kernel (Numba's CPU target) of the bucket family's wire cast (see ``providers.py``).

Imported on the cpu provider's first launch. (flatten, unflatten and bucket_reduce run torch's own
one-pass kernels under the cpu provider: see ``providers.py``.) The wire cast is one pass: fp32 -> fp16 by
LLVM's ``fptrunc`` to ``half`` (the CPU's F16C conversion where it has one: round to nearest even, as
PyTorch's), fp32 -> bf16 by integer round to nearest even (NaN -> 0x7FC0, as PyTorch), the division by
the world size in fp32 and the second rounding, the NaN/Inf count from the result's bits; the loop
vectorises.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ..cpu_common import bits_f32, carray, f32, f32_bits, jit, p_f32, p_i16

F16, BF16, F32 = 0, 1, 2  # the wire dtypes, as the kernel takes them


@intrinsic
def _f32_to_f16_bits(typingctx, v):
    sig = types.int16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _f16_bits_to_f32(typingctx, b):
    sig = types.float32(types.int16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@jit
def _to_bf16_bits(v):
    b = f32_bits(v)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return 0x7FC0 if (b & 0x7FFFFFFF) > 0x7F800000 else r


@jit
def wire_cast_ptr(xp, op, n, wire, divisor, divide):
    """out = wire(wire(x) / divisor) for fp32 x [n] (no division unless ``divide``); returns the number of
    NaN/Inf written. ``out`` is int16 bit patterns (fp16, bf16) or fp32."""
    x = carray(p_f32(xp), (n,))
    d = divisor
    bad = 0
    if wire == F32:
        o = carray(p_f32(op), (n,))
        for i in range(n):
            v = x[i] / d if divide else x[i]
            o[i] = v
            bad += (f32_bits(v) & 0x7FFFFFFF) >= 0x7F800000
        return bad
    o16 = carray(p_i16(op), (n,))
    if wire == F16:
        for i in range(n):
            h = _f32_to_f16_bits(x[i])
            if divide:
                h = _f32_to_f16_bits(_f16_bits_to_f32(h) / d)
            o16[i] = h
            bad += (h & 0x7C00) == 0x7C00
    else:
        for i in range(n):
            h = _to_bf16_bits(x[i])
            if divide:
                h = _to_bf16_bits(bits_f32(np.int32(h << 16)) / d)
            o16[i] = h
            bad += (h & 0x7F80) == 0x7F80
    return bad


WIRE = {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32}


def wire_cast(x: torch.Tensor, out: torch.Tensor, divisor: float, count_bad: bool) -> int:
    x = f32(x)
    bad = wire_cast_ptr(x.data_ptr(), out.data_ptr(), x.numel(), WIRE[out.dtype], np.float32(divisor), divisor != 1.0)
    return bad if count_bad else 0
