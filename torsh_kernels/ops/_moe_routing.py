"""The routing contract of the MoE op family: :class:`Routing` and the capacity rule.

``moe_route`` returns a :class:`Routing`; ``moe_permute``, ``moe_unpermute``, the router losses and the
expert-parallel layers consume it. The capacity rule (``expert_capacity``, ``check_capacity_factor``)
decides how many assignments each expert keeps. See ``moe.py`` for the ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["Routing", "check_capacity_factor", "expert_capacity"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing:
    """Where each token goes: the result of :func:`moe_route`, the input of permute and unpermute."""

    indices: torch.Tensor
    """[T, K] int64: the chosen experts of each token, highest score first."""
    weights: torch.Tensor
    """[T, K] fp32: the combine weights (renormalised scores when ``renormalize``); differentiable."""
    scores: torch.Tensor
    """[T, K] fp32: the router scores of the chosen experts before renormalisation."""
    tokens_per_expert: torch.Tensor
    """[E] int64: kept assignments per expert, i.e. the group sizes of the permuted rows."""
    row_map: torch.Tensor
    """[T, K] int64: the row of the permuted tensor that assignment (t, j) occupies, -1 if dropped."""
    token_index: torch.Tensor
    """[N] int64: the token each permuted row came from (the inverse of ``row_map``)."""
    dropped: torch.Tensor
    """[T, K] bool: assignments dropped by the capacity limit."""
    num_experts: int
    """E."""
    num_rows: int
    """N: the number of permuted rows (T*K minus the dropped assignments)."""
    capacity: int | None
    """C, the per-expert capacity, or None without a capacity limit."""
    score: str
    """The scoring function used: "softmax" or "sigmoid"."""

    @property
    def num_tokens(self) -> int:
        """T."""
        return self.indices.shape[0]

    @property
    def k(self) -> int:
        """K."""
        return self.indices.shape[1]

    @property
    def num_dropped(self) -> int:
        """T*K - N: assignments dropped by the capacity limit."""
        return self.num_tokens * self.k - self.num_rows

    def __repr__(self) -> str:
        """The sizes, not the [T, K] tensors (they are attributes)."""
        return (
            f"Routing(tokens={self.num_tokens}, experts={self.num_experts}, k={self.k}, rows={self.num_rows}, "
            f"dropped={self.num_dropped}, capacity={self.capacity}, score={self.score!r}, device={self.indices.device})"
        )

    def expert_offsets(self) -> torch.Tensor:
        """[E + 1] int64: the first permuted row of each expert's group, then N."""
        c = self.tokens_per_expert
        return torch.cat([c.new_zeros(1), torch.cumsum(c, 0)])


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T * K * capacity_factor / E): the assignments each expert keeps at most."""
    return max(1, math.ceil(num_tokens * k * capacity_factor / num_experts - 1e-9))


def check_capacity_factor(capacity_factor: object, what: str) -> float | None:
    """None (no limit) or a positive finite float; a typed error otherwise."""
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise ArgumentTypeError(f"{what}: capacity_factor must be a number or None, got {capacity_factor!r}")
    if not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise InvalidArgumentError(
            f"{what}: capacity_factor={capacity_factor} must be a positive finite number (or None for no limit)"
        )
    return float(capacity_factor)
