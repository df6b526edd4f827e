"""torsh-kernels: fused Triton / Numba CUDA kernels for distributed training with PyTorch."""

from __future__ import annotations

import os as _os
import sys as _sys

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
from .version import __version__

# The fused ops (and with them torch) load with the package, so that ``import torsh_kernels`` registers
# ``torch.ops.torsh.*`` whatever was imported before (the way custom-op libraries are used: imported for their
# registrations, e.g. before loading an exported program). One process defers them: ``torsh --version`` (the
# console script with that lone argument), which imports no torch; there they load on first use of a name.
_OPS = (
    "BucketLayout",
    "ProviderInfo",
    "ProviderReport",
    "RouterSpec",
    "RowQuantSpec",
    "Routing",
    "bucket_reduce",
    "dequantize",
    "dequantize_rows",
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
    "quantize_rows",
    "residual_add",
    "sign_compress",
    "sign_decompress",
    "topk_compress",
    "topk_decompress",
    "unflatten",
    "wire_cast",
)


def __getattr__(name: str):
    if name in _OPS:
        from . import ops

        for n in _OPS:
            globals()[n] = getattr(ops, n)
        return globals()[name]
    if name in ("ops", "env"):  # submodules a plain import used to load: still reachable as attributes
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'torsh_kernels' has no attribute {name!r}")


def _version_only() -> bool:
    """This process is ``torsh --version``: the console script asked nothing else."""
    argv = getattr(_sys, "argv", None) or []
    return len(argv) == 2 and argv[1] == "--version" and _os.path.basename(argv[0]) == "torsh"


if "torch" in _sys.modules or not _version_only():
    __getattr__("flatten")  # loads every name of _OPS from .ops (and registers torch.ops.torsh.*)

if _os.environ.get("TORSH_TRACE", "").strip():
    # TORSH_TRACE=DIR: record this process's timeline into DIR/rank{R}.json. The profiling layer is loaded
    # only then; a plain import loads no profiling code, no Triton and no Numba.
    from .profiling.timeline import start_from_env as _start_trace_from_env

    _start_trace_from_env()

if any(_os.environ.get(v, "").strip() for v in ("TORSH_LIVE", "TORSH_LIVE_PROMETHEUS", "TORSH_LIVE_TENSORBOARD")):
    # TORSH_LIVE=DIR (and/or _PROMETHEUS=PORT, _TENSORBOARD=DIR): publish this process's live metrics (torsh top DIR)
    from .profiling.live import start_from_env as _start_live_from_env

    _start_live_from_env()

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
