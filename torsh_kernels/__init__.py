"""torsh-kernels: fused Triton / Numba CUDA kernels for distributed training with PyTorch."""

from __future__ import annotations

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
    bucket_reduce,
    dequantize,
    error_update,
    flatten,
    orthogonalize,
    providers,
    quantize,
    residual_add,
    sign_compress,
    sign_decompress,
    topk_compress,
    topk_decompress,
    unflatten,
)

__version__ = "0.1.0"

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
    "ShapeError",
    "TorshKernelsError",
    "__version__",
    "bucket_reduce",
    "dequantize",
    "error_update",
    "flatten",
    "orthogonalize",
    "providers",
    "quantize",
    "residual_add",
    "sign_compress",
    "sign_decompress",
    "topk_compress",
    "topk_decompress",
    "unflatten",
]
