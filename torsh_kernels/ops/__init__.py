"""Layer 1: fused kernels, one module per op family, each with triton, numba and torch providers."""

from __future__ import annotations

from .bucket import (
    BucketLayout,
    bucket_reduce,
    bucket_reduce_ref,
    flatten,
    flatten_ref,
    unflatten,
    unflatten_ref,
)
from .registry import PROVIDERS, ProviderInfo, ProviderReport, providers, set_tuned_lookup

__all__ = [
    "PROVIDERS",
    "BucketLayout",
    "ProviderInfo",
    "ProviderReport",
    "bucket_reduce",
    "bucket_reduce_ref",
    "flatten",
    "flatten_ref",
    "providers",
    "set_tuned_lookup",
    "unflatten",
    "unflatten_ref",
]
