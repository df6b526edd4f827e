"""Gradient-bucket ops: flatten, unflatten, bucket_reduce, wire_cast.

- ``flatten(tensors)`` copies N tensors (any shapes, contiguous or not) into one flat buffer, optionally
  scaling and casting in the same pass, and returns the buffer with its :class:`BucketLayout`.
- ``unflatten(flat, layout, tensors)`` writes (or adds) the slices back into the tensors, casting to each
  tensor's dtype.
- ``bucket_reduce(buffers)`` reduces K same-size buffers elementwise (sum, avg, max) in fp32 (fp64 if
  any operand is fp64).
- ``wire_cast(x, dtype, divisor=)`` casts a bucket to its wire dtype and divides it there, in one pass:
  ``dtype(dtype(x) / divisor)``, two roundings, PyTorch's ``fp16_compress_hook`` arithmetic (so a hook
  built on it gives PyTorch's bits), counting the NaN/Inf it writes (an fp16 overflow above 65504).

The Triton kernels take all tensors of one dtype in at most three launches, each a constexpr variant chosen
on the host from a cached copy plan (``tables.copy_plan``): the 16-byte aligned contiguous segments
(128-bit accesses, alignment and extent stated with ``tl.multiple_of``), the segments of tensors whose
address and flat offset disagree modulo 16 bytes (128-bit on one side), and a gather of the rest (strided
tensors, the heads and tails of odd-sized ones) with the strided index math. Launches therefore grow with
the number of distinct dtypes, never with the number of tensors. bucket_reduce and wire_cast launch a bulk
whose end is divisible by 16 and a one-program tail (``common.spans``). The Numba kernels take a table in
device memory that holds, per tensor, its element offset from the lowest address, size, offset in the flat
buffer, first tile and (for non-contiguous tensors) up to four coalesced sizes and strides; a second table
maps each tile (program) to its tensor, in the manner of Triton's grouped-GEMM tutorial. Tables and plans
are cached per (device, stream, geometry, addresses), so steady-state training steps do not rebuild or
re-upload them (``tables.py``).

The family's modules:

- ``api.py``: the public ops, their ``torsh::`` custom ops and fake implementations, their tuning spaces;
- ``layout.py``: :class:`BucketLayout` and the input checks; ``plans.py``: the direct path's cached plans;
- ``reference.py``: the torch references (``*_ref``), the oracles of the tests;
- ``providers.py``: the implementations registered per provider; ``tables.py``: their launch tables and
  copy plans; the kernels, one module per provider, imported on its first launch: ``triton.py``,
  ``numba.py`` (CUDA), ``cpu.py`` (Numba's CPU target).
"""

from __future__ import annotations

from .api import bucket_reduce, flatten, unflatten, wire_cast
from .layout import FLOAT_DTYPES, REDUCE_OPS, WIRE_DTYPES, BucketLayout
from .providers import GATHER_BLOCK, NUMBA_TILE, TRITON_BLOCK, TRITON_WARPS
from .reference import bucket_reduce_ref, flatten_ref, unflatten_ref, wire_cast_ref

__all__ = [
    "FLOAT_DTYPES",
    "GATHER_BLOCK",
    "NUMBA_TILE",
    "REDUCE_OPS",
    "TRITON_BLOCK",
    "TRITON_WARPS",
    "WIRE_DTYPES",
    "BucketLayout",
    "bucket_reduce",
    "bucket_reduce_ref",
    "flatten",
    "flatten_ref",
    "unflatten",
    "unflatten_ref",
    "wire_cast",
    "wire_cast_ref",
]
