"""Provider implementations of the row ops, registered per provider (torch, triton, numba, cpu), and the host
step both custom ops take (pick the provider, run it on the device). Inputs are validated and contiguous, the
index int64 or None, outputs allocated by the public ops (``api.py``); the kernels are imported on a
provider's first launch."""

from __future__ import annotations

from ..common import on_device, select_provider
from ..registry import Op
from .reference import dequantize_rows_ref, quantize_rows_ref

__all__ = ["dequantize_rows_impl", "dequantize_rows_into", "quantize_rows_impl", "quantize_rows_into"]

quantize_rows_impl = Op("quantize_rows")
# (x [T, H], index [N] int64 | None, packed uint8 [N, RB], fmt, block)
dequantize_rows_impl = Op("dequantize_rows")
# (packed uint8 [M, RB], index [N] int64 | None, out [N, H], fmt, block)


def quantize_rows_into(x, index, packed, fmt, block, provider) -> None:
    name = select_provider(quantize_rows_impl, x, provider)
    with on_device(x.device):
        quantize_rows_impl(name, x, index, packed, fmt, block)


def dequantize_rows_into(packed, index, out, fmt, block, provider) -> None:
    name = select_provider(dequantize_rows_impl, out, provider)
    with on_device(out.device):
        dequantize_rows_impl(name, packed, index, out, fmt, block)


@quantize_rows_impl.register("torch")
def _quantize_torch(x, index, packed, fmt, block):
    packed.copy_(quantize_rows_ref(x, fmt, block, index))


@dequantize_rows_impl.register("torch")
def _dequantize_torch(packed, index, out, fmt, block):
    out.copy_(dequantize_rows_ref(packed, fmt, block, out.shape[1], out.dtype, index))


@quantize_rows_impl.register("cpu")
def _quantize_cpu(x, index, packed, fmt, block):
    from . import cpu as K

    K.quantize_rows(x, index, packed, fmt, block)


@dequantize_rows_impl.register("cpu")
def _dequantize_cpu(packed, index, out, fmt, block):
    from . import cpu as K

    K.dequantize_rows(packed, index, out, fmt, block)


@quantize_rows_impl.register("triton")
def _quantize_triton(x, index, packed, fmt, block):
    from . import triton as K

    K.quantize_rows(x, index, packed, fmt, block)


@dequantize_rows_impl.register("triton")
def _dequantize_triton(packed, index, out, fmt, block):
    from . import triton as K

    K.dequantize_rows(packed, index, out, fmt, block)


@quantize_rows_impl.register("numba")
def _quantize_numba(x, index, packed, fmt, block):
    from . import numba as K

    K.quantize_rows(x, index, packed, fmt, block)


@dequantize_rows_impl.register("numba")
def _dequantize_numba(packed, index, out, fmt, block):
    from . import numba as K

    K.dequantize_rows(packed, index, out, fmt, block)
