"""torsh-kernels: fused Triton / Numba CUDA kernels for distributed training with PyTorch."""

from __future__ import annotations

import os as _os

from .env import __version__
from .errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    LayoutMismatchError,
    NonFiniteError,
    ProviderError,
    ProviderUnavailableError,
    ShapeError,
    TorshKernelsError,
)
from .ops import (
    BucketLayout,
    ProviderInfo,
    ProviderReport,
    RouterSpec,
    Routing,
    bucket_reduce,
    dequantize,
    error_update,
    flatten,
    moe_aux_loss,
    moe_permute,
    moe_route,
    moe_unpermute,
    moe_z_loss,
    orthogonalize,
    providers,
    quantize,
    residual_add,
    sign_compress,
    sign_decompress,
    topk_compress,
    topk_decompress,
    unflatten,
    wire_cast,
)

if _os.environ.get("TORSH_TRACE", "").strip():
    # TORSH_TRACE=DIR: record this process's timeline into DIR/rank{R}.json. The profiling layer is loaded
    # only then; a plain import loads no profiling code, no Triton and no Numba.
    from .profiling.timeline import start_from_env as _start_trace_from_env

    _start_trace_from_env()

__all__ = [
    "ArgumentTypeError",
    "BucketLayout",
    "DTypeError",
    "DeviceMismatchError",
    "InvalidArgumentError",
    "LayoutMismatchError",
    "NonFiniteError",
    "ProviderError",
    "ProviderInfo",
    "ProviderReport",
    "ProviderUnavailableError",
    "RouterSpec",
    "Routing",
    "ShapeError",
    "TorshKernelsError",
    "__version__",
    "bucket_reduce",
    "dequantize",
    "error_update",
    "flatten",
    "moe_aux_loss",
    "moe_permute",
    "moe_route",
    "moe_unpermute",
    "moe_z_loss",
    "orthogonalize",
    "providers",
    "quantize",
    "residual_add",
    "sign_compress",
    "sign_decompress",
    "topk_compress",
    "topk_decompress",
    "unflatten",
    "wire_cast",
]
