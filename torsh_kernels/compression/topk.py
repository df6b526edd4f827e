"""Top-k sparsification with error feedback: each rank sends its ``ratio * n`` largest magnitudes
(values and int32 indices); the payloads are all-gathered and scattered-added into the result in one
fused pass."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch

from ..checks import check_bool, check_number
from ..errors import InvalidArgumentError
from ..ops import topk_compress, topk_count, topk_decompress
from .base import (
    Compressor,
    Payload,
    check_input,
    check_out,
    check_settings,
    itemsize,
    numel_of,
)

__all__ = ["TopK"]


@dataclass(slots=True)
class TopK(Compressor):
    """Send the ratio * n largest magnitudes (values and int32 indices), with error feedback."""

    ratio: float
    """Fraction of elements sent, in (0, 1]."""
    _: KW_ONLY
    exact: bool = False
    """Exact top-k selection instead of the sampled-threshold approximation (see topk_compress)."""
    error_feedback: bool = True
    """Keep what was not sent in the state and add it to the next step's input."""
    check_finite: bool = True
    """Raise NonFiniteError on NaN/Inf input (before the residual changes)."""
    provider: str | None = None
    """Kernel provider (None: automatic)."""

    is_linear = False
    carries_plain = True  # the base reduce: plain tensors ride in the all-gather
    passes = 6.0

    def __post_init__(self) -> None:
        check_number(self.ratio, "TopK", "ratio", lo=0.0, hi=1.0, lo_open=True)
        check_bool(self.exact, "TopK", "exact")
        check_settings(self, "TopK")

    def compress(self, tensor, state):
        x = check_input(tensor, "TopK.compress")
        r = state.residual(x) if self.error_feedback else None
        values, indices = topk_compress(
            x, ratio=self.ratio, residual=r, exact=self.exact, check_finite=self.check_finite, provider=self.provider
        )
        state.step += 1
        return Payload({"values": values, "indices": indices}, x.numel())

    def decompress(self, payload, state, out, *, alpha=1.0, accumulate=False):
        o = check_out(out, payload.numel, "TopK.decompress")
        t = payload.tensors
        topk_decompress(t["values"], t["indices"], payload.numel, out=o, accumulate=accumulate, alpha=alpha,
                        provider=self.provider)  # fmt: skip
        return out

    def decompress_sum(self, payloads, state, out, *, alpha=1.0):
        if not payloads:
            raise InvalidArgumentError("TopK.decompress_sum: no payloads")
        o = check_out(out, payloads[0].numel, "TopK.decompress_sum")
        values = torch.cat([p.tensors["values"] for p in payloads])
        indices = torch.cat([p.tensors["indices"] for p in payloads])
        o.zero_()
        topk_decompress(values, indices, payloads[0].numel, out=o, accumulate=True, alpha=alpha,
                        provider=self.provider)  # fmt: skip
        return out

    def payload_nbytes(self, shape, dtype=torch.float32):
        numel = numel_of(shape)
        k = topk_count(numel, self.ratio)
        return k * (itemsize(dtype) + (4 if numel < 2**31 else 8))
