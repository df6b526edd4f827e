"""Error-feedback ops: the fused steps around a lossy compression.

- ``residual_add(x, residual, out=)``: ``acc = x + residual`` in fp32, in one pass (the input of an
  error-feedback compressor), counting NaN/Inf on the way.
- ``error_update(acc, approx, residual, out=)``: ``residual = acc - approx`` and, optionally, ``approx``
  copied, cast, into ``out`` (typically the gradient), in one pass.

See ``ops.common`` for what the compression families share (fp32 compute, the non-finite checks).

The family's modules:

- ``api.py``: the public ops, their ``torsh::`` custom ops and fake implementations, their CPU fast paths;
- ``reference.py``: the torch references (``*_ref``), the oracles of the tests;
- ``providers.py``: the implementations registered per provider (``axpby``, the residual_add op, is also
  the top-k family's first pass); the kernels, one module per provider, imported on its first launch:
  ``triton.py``, ``numba.py`` (CUDA), ``cpu.py`` (Numba's CPU target).
"""

from __future__ import annotations

from .api import error_update, residual_add
from .providers import axpby
from .reference import error_update_ref, residual_add_ref

__all__ = ["axpby", "error_update", "error_update_ref", "residual_add", "residual_add_ref"]
