"""torsh-kernels: fused Triton / Numba CUDA kernels for distributed training with PyTorch."""

from __future__ import annotations

from .errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    LayoutMismatchError,
    ProviderError,
    ProviderUnavailableError,
    ShapeError,
    TorshKernelsError,
)
from .ops import BucketLayout, ProviderInfo, ProviderReport, bucket_reduce, flatten, providers, unflatten

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "BucketLayout",
    "DTypeError",
    "DeviceMismatchError",
    "InvalidArgumentError",
    "LayoutMismatchError",
    "ProviderError",
    "ProviderInfo",
    "ProviderReport",
    "ProviderUnavailableError",
    "ShapeError",
    "TorshKernelsError",
    "__version__",
    "bucket_reduce",
    "flatten",
    "providers",
    "unflatten",
]
