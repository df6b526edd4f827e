"""Layer 1: fused kernels, one module per op family, each with triton, numba, cpu and torch providers.

Families: ``bucket`` (flatten, unflatten, bucket_reduce, wire_cast), ``topk``, ``quantize``, ``sign``,
``orthogonalize``, ``error_feedback`` (the compression ops), ``moe`` (routing, permute, unpermute, router
losses), ``rowquant`` (the expert-parallel all-to-all's packed rows) and ``offload``
(pack, unpack). Helpers they share live in ``common``; provider selection in
``registry``; the tuning cache it reads in ``tuning``. Importing this package imports no Triton, no Numba
and no profiling code: each provider's kernels load on its first launch.
"""

from __future__ import annotations

from .bucket import (
    BucketLayout,
    bucket_reduce,
    bucket_reduce_ref,
    flatten,
    flatten_ref,
    unflatten,
    unflatten_ref,
    wire_cast,
    wire_cast_ref,
)
from .common import COMPRESS_DTYPES, count_nonfinite
from .error_feedback import error_update, error_update_ref, residual_add, residual_add_ref
from .moe import (
    RouterSpec,
    Routing,
    moe_aux_loss,
    moe_aux_loss_ref,
    moe_permute,
    moe_permute_ref,
    moe_route,
    moe_route_ref,
    moe_unpermute,
    moe_unpermute_ref,
    moe_z_loss,
    moe_z_loss_ref,
)
from .offload import FORMATS, Packed, pack, pack_ref, packed_nbytes, unpack, unpack_ref
from .orthogonalize import orthogonalize, orthogonalize_ref
from .quantize import QMAX, block_codes, dequantize, dequantize_ref, quantize, quantize_ref, seed_key
from .registry import PROVIDERS, ProviderInfo, ProviderReport, providers, set_tuned_lookup
from .rowquant import (
    RowQuantSpec,
    dequantize_rows,
    dequantize_rows_ref,
    quantize_rows,
    quantize_rows_ref,
    row_wire_bytes,
)
from .sign import sign_compress, sign_compress_ref, sign_decompress, sign_decompress_ref
from .topk import topk_compress, topk_compress_ref, topk_count, topk_decompress, topk_decompress_ref

__all__ = [
    "COMPRESS_DTYPES",
    "FORMATS",
    "PROVIDERS",
    "QMAX",
    "BucketLayout",
    "Packed",
    "ProviderInfo",
    "ProviderReport",
    "RouterSpec",
    "Routing",
    "RowQuantSpec",
    "block_codes",
    "bucket_reduce",
    "bucket_reduce_ref",
    "count_nonfinite",
    "dequantize",
    "dequantize_ref",
    "dequantize_rows",
    "dequantize_rows_ref",
    "error_update",
    "error_update_ref",
    "flatten",
    "flatten_ref",
    "moe_aux_loss",
    "moe_aux_loss_ref",
    "moe_permute",
    "moe_permute_ref",
    "moe_route",
    "moe_route_ref",
    "moe_unpermute",
    "moe_unpermute_ref",
    "moe_z_loss",
    "moe_z_loss_ref",
    "orthogonalize",
    "orthogonalize_ref",
    "pack",
    "pack_ref",
    "packed_nbytes",
    "providers",
    "quantize",
    "quantize_ref",
    "quantize_rows",
    "quantize_rows_ref",
    "residual_add",
    "residual_add_ref",
    "row_wire_bytes",
    "seed_key",
    "set_tuned_lookup",
    "sign_compress",
    "sign_compress_ref",
    "sign_decompress",
    "sign_decompress_ref",
    "topk_compress",
    "topk_compress_ref",
    "topk_count",
    "topk_decompress",
    "topk_decompress_ref",
    "unflatten",
    "unflatten_ref",
    "unpack",
    "unpack_ref",
    "wire_cast",
    "wire_cast_ref",
]
