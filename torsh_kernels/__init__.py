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
)

__version__ = "0.1.0"

from .profiling.autotune import install as _install_tuning

_install_tuning()  # automatic provider selection and the kernel launchers use the tuning cache's winners

from .profiling.timeline import start_from_env as _start_trace_from_env  # noqa: E402

_start_trace_from_env()  # TORSH_TRACE=DIR: record this process's timeline into DIR/rank{R}.json

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
]
