"""Numba CUDA plumbing shared by the op families.

Imported lazily (only when the numba provider runs), so ``import torsh_kernels`` does not import Numba.

- Tensors reach kernels zero-copy: CUDA tensors through ``__cuda_array_interface__`` on torch's current
  stream; under the simulator (``NUMBA_ENABLE_CUDASIM=1``) CPU tensors as host arrays wrapped in the
  simulator's device-array type, so the simulator does not copy them in and out.
- Numba has no pointer casts, so a kernel that reads or writes many tensors in one launch indexes one
  *span array* that starts at the lowest tensor address, with each tensor's element offset from it in a
  table: the same idea as a table of pointers.
- bfloat16 has no Numba type: bf16 tensors travel as int16 views and are converted bit-exactly
  (round to nearest even, NaN -> 0x7FC0, as PyTorch does). The two float<->bits intrinsics are libdevice
  calls on the GPU and ``struct`` in the simulator, whose libdevice functions are stubs; everything
  else is the same code on both.
- The compression families' kernels share the device helpers at the end: each CUDA block's tile of an
  elementwise pass, the non-finite test and the stochastic-rounding hash.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import numpy as np
import torch
from numba import config, cuda, float32, float64, int32, int64
from numba.types import float16

SIM = bool(config.ENABLE_CUDASIM)

# Kernels read and write these dtypes; bf16 as int16 bit patterns.
_NP_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: np.int16,
    torch.float64: np.float64,
}
KINDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}

if SIM:
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    def f32_bits(v):  # float32 -> its bit pattern, an int in [0, 2**32)
        return struct.unpack("<I", struct.pack("<f", v))[0]

    def _bits_f32(b):  # bit pattern -> float32
        return np.float32(struct.unpack("<f", struct.pack("<I", int(b) & 0xFFFFFFFF))[0])

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, inline=True)
    def f32_bits(v):
        return int64(libdevice.float_as_int(float32(v))) & 0xFFFFFFFF

    @cuda.jit(device=True, inline=True)
    def _bits_f32(b):
        return libdevice.int_as_float(int32(b))


def _bf16_bits_py(v):
    """float32 -> bf16 bits (round to nearest even; NaN -> 0x7FC0) as a signed 16-bit value."""
    b = f32_bits(v)
    if (b & 0x7FFFFFFF) > 0x7F800000:
        r = 0x7FC0
    else:
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
    return r - ((r & 0x8000) << 1)


_bf16_bits = cuda.jit(device=True, inline=True)(_bf16_bits_py)


@cuda.jit(device=True, inline=True)
def _ld_to_f32(a, i):
    return float32(a[i])


@cuda.jit(device=True, inline=True)
def _ld_to_f64(a, i):
    return float64(a[i])


@cuda.jit(device=True, inline=True)
def _ld_bf16_f32(a, i):
    return _bits_f32((int64(a[i]) & 0xFFFF) << 16)


@cuda.jit(device=True, inline=True)
def _ld_bf16_f64(a, i):
    return float64(_bits_f32((int64(a[i]) & 0xFFFF) << 16))


@cuda.jit(device=True, inline=True)
def _st_f32(a, i, v):
    a[i] = float32(v)


@cuda.jit(device=True, inline=True)
def _st_f16(a, i, v):
    a[i] = float16(v)


@cuda.jit(device=True, inline=True)
def _st_f64(a, i, v):
    a[i] = float64(v)


@cuda.jit(device=True, inline=True)
def _st_bf16(a, i, v):
    a[i] = _bf16_bits(float32(v))


def compute_kind(*dtypes: torch.dtype) -> str:
    """Arithmetic runs in fp64 if any operand is fp64, else in fp32."""
    return "f64" if torch.float64 in dtypes else "f32"


def loader(dtype: torch.dtype, compute: str) -> Callable:
    """Device function (array, index) -> value of the compute type."""
    kind = KINDS[dtype]
    if kind == "bf16":
        return _ld_bf16_f64 if compute == "f64" else _ld_bf16_f32
    return _ld_to_f64 if compute == "f64" else _ld_to_f32


def storer(dtype: torch.dtype) -> Callable:
    """Device function (array, index, value) storing a value converted to ``dtype``."""
    return {"f32": _st_f32, "f16": _st_f16, "bf16": _st_bf16, "f64": _st_f64}[KINDS[dtype]]


def compute_type(compute: str):
    return float64 if compute == "f64" else float32


def _as_int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


CAPTURE: list | None = None
"""While a list (``torsh inspect``, :mod:`torsh_kernels.profiling.launches`): each launch is appended to it as
``(kernel, blocks, threads, args)`` instead of running, and tensors (CPU ones) travel as NumPy arrays, which
Numba types as it types the device arrays of a real launch."""


def as_array(t: torch.Tensor):
    """A contiguous tensor as a Numba device array (or simulator array), sharing its memory."""
    t = _as_int_view(t.detach())
    if CAPTURE is not None:
        return t.numpy()
    if SIM:
        return FakeCUDAArray(t.numpy())
    return cuda.as_cuda_array(t, sync=False)


class _HostSpan:
    """Carries ``__array_interface__`` so NumPy wraps a host address range without copying it."""

    def __init__(self, ptr: int, n: int, np_dtype: np.dtype) -> None:
        self.__array_interface__ = {"shape": (n,), "typestr": np_dtype.str, "data": (ptr, False), "version": 3}


def span_array(ptr: int, n: int, dtype: torch.dtype):
    """A 1-D array of ``n`` elements of ``dtype`` starting at address ``ptr`` (kernels index only
    elements that belong to live tensors inside it)."""
    np_dtype = np.dtype(_NP_DTYPES[dtype])
    if CAPTURE is not None:
        return np.asarray(_HostSpan(ptr, n, np_dtype))
    if SIM:
        return FakeCUDAArray(np.asarray(_HostSpan(ptr, n, np_dtype)))
    desc = {"shape": (n,), "typestr": np_dtype.str, "data": (ptr, False), "version": 3, "strides": None}
    return cuda.from_cuda_array_interface(desc, owner=None, sync=False)


def launch(kernel, blocks: int, threads: int, device: torch.device, *args) -> None:
    """Launch on torch's current stream of ``device`` (the simulator has no streams)."""
    if CAPTURE is not None:
        CAPTURE.append((kernel, blocks, threads, args))
        return
    if SIM:
        kernel[blocks, threads](*args)
        return
    with cuda.gpus[device.index if device.index is not None else torch.cuda.current_device()]:
        stream = cuda.external_stream(torch.cuda.current_stream(device).cuda_stream)
        kernel[blocks, threads, stream](*args)


# Threads per block. The simulator runs every thread as a Python thread, so it gets fewer.
THREADS = 8 if SIM else 256


# --------------------------------------------------------------------------------------------------
# Device helpers of the compression families' kernels

TILE = 2048  # elements per CUDA block in the elementwise passes
_M32 = 0xFFFFFFFF
_INV24 = 1.0 / 16777216.0


def block_count(n: int, per_block: int) -> int:
    return max(1, -(-n // per_block))


@cuda.jit(device=True, inline=True)
def nonfinite(v):
    return math.isnan(v) or math.isinf(v)


@cuda.jit(device=True, inline=True)
def _mul32(h, c):
    return ((h * (c & 0xFFFF)) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


@cuda.jit(device=True, inline=True)
def _lowbias32(h):
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


@cuda.jit(device=True, inline=True)
def uniform(i, key):
    h = _lowbias32(_lowbias32(int64(i) & _M32) ^ key)
    return float32(h >> 8) * float32(_INV24)


@cuda.jit(device=True, inline=True)
def tile_range(n):
    start = cuda.blockIdx.x * TILE
    end = start + TILE
    if end > n:
        end = n
    return start + cuda.threadIdx.x, end


@cuda.jit(device=True, inline=True)
def fp8_bits(y, e4m3):
    """The fp8 code (0..255) of an fp32 value already saturated and not NaN: ``ops/quantize/fp8.py``'s
    ``fp8_bits_py`` on the fp32 bits (shared by the fp8 kernels)."""
    b = f32_bits(y)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    if e4m3:
        if a < (121 << 23):
            r = f32_bits(float32(abs(y)) + float32(16384.0)) - (141 << 23)
        else:
            r = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    else:
        if a < (113 << 23):
            r = f32_bits(float32(abs(y)) + float32(128.0)) - (134 << 23)
        else:
            r = (a - (112 << 23) + 0xFFFFF + ((a >> 21) & 1)) >> 21
    return r | sign


@cuda.jit(device=True, inline=True)
def fp8_value(c, e4m3):
    """The fp32 value of fp8 code ``c`` (0..255): ``fp8_value_py``."""
    m = c & 0x7F
    if e4m3:
        if m < 8:
            v = float32(m) * float32(0.001953125)
        elif m == 0x7F:
            v = float32(math.nan)
        else:
            v = _bits_f32((m << 20) + (120 << 23))
    else:
        if m < 4:
            v = float32(m) * float32(1.52587890625e-05)
        elif m >= 0x7C:
            v = _bits_f32(0x7F800000 | ((m & 3) << 21))
        else:
            v = _bits_f32((m << 21) + (112 << 23))
    if c & 0x80:
        v = -v
    return v
