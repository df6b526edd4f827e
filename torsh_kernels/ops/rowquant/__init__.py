"""The row ops of the compressed expert-parallel all-to-all (``api.py``): quantize_rows (the fused permute +
quantize pass), dequantize_rows (decode on arrival), RowQuantSpec and row_wire_bytes; torch references in
``reference.py``; kernels per provider in ``triton.py``, ``numba.py``, ``cpu.py``."""

from __future__ import annotations

from .api import FORMATS, RowQuantSpec, dequantize_rows, quantize_rows, row_wire_bytes
from .reference import dequantize_rows_ref, quantize_rows_ref

__all__ = [
    "FORMATS",
    "RowQuantSpec",
    "dequantize_rows",
    "dequantize_rows_ref",
    "quantize_rows",
    "quantize_rows_ref",
    "row_wire_bytes",
]
