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
- ``block_codes(blocks, scales, qmax, stochastic, key)``: the codes of fp32 blocks on a given grid of scales
  (the shared-scale all-reduce's quantization).

See ``ops.common`` for what the compression families share (fp32 compute, the non-finite checks).

The family's modules:

- ``api.py``: the public ops, their ``torsh::`` custom ops and fake implementations, the CPU fast paths, the
  int8 quantizer's tuning space;
- ``format.py``: the format itself: the code range ``QMAX``, the codes' and scales' sizes, the stochastic
  rounding noise (``seed_key``, ``uniform_noise``), the codes on a grid of scales;
- ``reference.py``: the torch references (``quantize_ref``, ``dequantize_ref``), the oracles of the tests;
- ``providers.py``: the implementations registered per provider and the Triton launch geometry; the kernels,
  one module per provider, imported on its first launch: ``triton.py``, ``numba.py`` (CUDA), ``cpu.py``
  (Numba's CPU target).

The package re-exports the function ``quantize``, so ``torsh_kernels.ops.quantize`` as an attribute of
``torsh_kernels.ops`` is that function; ``from torsh_kernels.ops.quantize import ...`` imports from this package.
"""

from __future__ import annotations

from .api import block_codes, dequantize, quantize
from .format import QMAX, seed_key, uniform_noise
from .providers import CPU_SLICE, QTAIL, QTILE, QWARPS
from .reference import dequantize_ref, quantize_ref

__all__ = [
    "CPU_SLICE",
    "QMAX",
    "QTAIL",
    "QTILE",
    "QWARPS",
    "block_codes",
    "dequantize",
    "dequantize_ref",
    "quantize",
    "quantize_ref",
    "seed_key",
    "uniform_noise",
]
