"""The FP8 formats, e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, no infinity, largest 448)
and e5m2 (``torch.float8_e5m2``: 5 and 2, largest 57344): what a code is, and the one conversion every provider
computes.

A block of values is stored as fp8 codes ``c = fp8(clamp(x / s, -max, max))`` with an fp32 scale
``s = amax(|x|) / max`` per block (DeepSeek-V3's activation and weight tiles; torchao's float8 scale at block
granularity): *saturating* (the clamp: a value never becomes Inf or NaN because of rounding) and rounded to
nearest even, bit for bit what torch's own cast of the clamped value gives (:func:`fp8_codes`, the oracle). A
block whose scale is 0 (all zeros) has codes 0; a block holding NaN/Inf has scale NaN and codes 0, as the int8
format's.

The kernels cannot rely on a hardware cast (Numba has no fp8 type, Triton's interpreter none that rounds to
nearest even, sm_80 no fp8 instruction), so they all compute the same integer arithmetic on the fp32 bit pattern
(:func:`fp8_bits_py`, the scalar form that the Numba CUDA, Numba CPU and Triton kernels transcribe; tested bit
for bit against torch over every fp32 exponent): normal values add the rounding bias plus the odd bit of the
kept mantissa and shift; subnormal ones (below the format's smallest normal) are rounded by the fp32 adder
itself, adding a power of two whose last mantissa bit is worth the format's smallest subnormal.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

__all__ = ["FP8", "FP8_DTYPES", "Fp8Format", "fp8_bits_py", "fp8_codes", "fp8_format", "fp8_value_py"]


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """One FP8 format's constants (the kernels' arithmetic is written from these)."""

    name: str
    dtype: torch.dtype
    max: float
    """The largest finite value (the clamp)."""
    mantissa: int
    """Mantissa bits (3 or 2)."""
    bias: int
    """Exponent bias (7 or 15)."""

    @property
    def e4m3(self) -> bool:
        return self.mantissa == 3

    @property
    def shift(self) -> int:
        """fp32 mantissa bits dropped: 20 or 21."""
        return 23 - self.mantissa

    @property
    def min_normal_bits(self) -> int:
        """The fp32 bits of the smallest normal value (2**-6 or 2**-14): below it a value is subnormal."""
        return (127 + 1 - self.bias) << 23

    @property
    def magic(self) -> float:
        """The power of two whose fp32 ulp is the smallest subnormal (2**14 for e4m3, 2**7 for e5m2)."""
        return 2.0 ** (23 + 1 - self.bias - self.mantissa)


FP8 = {
    "e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 7),
    "e5m2": Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 15),
}
"""The formats by name."""
FP8_DTYPES = {f.dtype: f for f in FP8.values()}
"""The formats by the torch dtype of their codes."""


def fp8_format(name: str, what: str) -> Fp8Format:
    """The format called ``name`` ("e4m3" or "e5m2"), else an InvalidArgumentError naming ``what``."""
    from ...errors import InvalidArgumentError

    f = FP8.get(name) if isinstance(name, str) else None
    if f is None:
        raise InvalidArgumentError(f"{what}: fmt={name!r}; expected one of {', '.join(map(repr, FP8))}")
    return f


def fp8_codes(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """The codes of scaled fp32 values ``y``: saturated to +-max, NaN -> 0, rounded by torch's own cast (the
    oracle every provider is tested against, bit for bit)."""
    return y.nan_to_num(nan=0.0).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _float(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b & 0xFFFFFFFF))[0]


def fp8_bits_py(y: float, e4m3: bool) -> int:
    """The fp8 code (0..255) of an fp32 value already saturated (|y| <= max) and not NaN: the kernels'
    arithmetic, step for step (their transcriptions are tested against torch; this one documents them)."""
    b = _bits(y)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    m = 3 if e4m3 else 2
    bias = 7 if e4m3 else 15
    shift = 23 - m
    if a < (128 - bias) << 23:  # subnormal in fp8: the fp32 adder rounds |y| to a multiple of 2**(1-bias-m)
        magic = (127 + 24 - bias - m) << 23
        r = _bits(_float(a) + _float(magic)) - magic
    else:  # round to nearest even: add half an ulp less one, plus the kept mantissa's odd bit, and shift
        r = (a - ((127 - bias) << 23) + (1 << (shift - 1)) - 1 + ((a >> shift) & 1)) >> shift
    return r | sign


def fp8_value_py(c: int, e4m3: bool) -> float:
    """The fp32 value of fp8 code ``c`` (0..255): the kernels' decoding, step for step."""
    sign = c & 0x80
    m = c & 0x7F
    mb = 3 if e4m3 else 2
    bias = 7 if e4m3 else 15
    if m >> mb == 0:  # subnormal: mantissa * smallest subnormal (exact in fp32)
        v = float(m) * 2.0 ** (1 - bias - mb)
    elif e4m3 and m == 0x7F:  # e4m3 has no infinity: S.1111.111 is NaN
        v = float("nan")
    elif not e4m3 and m >> 2 == 31:  # e5m2's all-ones exponent: Inf (mantissa 0) or NaN
        v = _float(0x7F800000 | (m & 3) << 21)
    else:  # normal: the mantissa moved up, the exponent rebiased
        v = _float((m << (23 - mb)) + ((127 - bias) << 23))
    return -v if sign else v
