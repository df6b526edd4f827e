"""The routing contract of the MoE op family: :class:`Routing` and the capacity rule.

``moe_route`` returns a :class:`Routing`; ``moe_permute``, ``moe_unpermute``, the router losses and the
expert-parallel layers consume it. The capacity rule (``expert_capacity``, ``check_capacity_factor``)
decides how many assignments each expert keeps. See ``moe.py`` for the ops.

**Trust.** The kernels index memory with a routing's ``row_map``, ``token_index`` and ``indices``. A
``Routing`` that ``moe_route`` made is *sealed*: it remembers the tensors the ops read (``row_map``,
``token_index``, ``weights``, ``indices``) and their autograd version counters, and :func:`check_routing`
accepts it after a few identity and integer comparisons of the fields the calling op reads (well under a
microsecond). Any other ``Routing`` (built by hand, by ``dataclasses.replace``, unpickled, copied), and a
sealed one one of whose read tensors was edited in place (a version counter moved) or swapped, is validated in full
before any kernel reads it (types, dtypes, shapes, devices, contiguity, every index in range, and the fields
consistent with each other: the kept rows a permutation of ``[0, N)``, ``token_index`` its inverse,
``dropped`` where ``row_map`` is -1, rows grouped by expert with ``tokens_per_expert`` as group sizes), then
sealed. Writes that bypass the version counter (through ``.data``, NumPy or DLPack) are not seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, ShapeError
from ._common import Sealable

__all__ = [
    "Routing",
    "check_capacity_factor",
    "check_routing",
    "expert_capacity",
    "out_of_range",
    "seal",
    "sealed",
    "sealed_experts",
    "sealed_rows",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Routing(Sealable):
    """Where each token goes: the result of :func:`moe_route`, the input of permute and unpermute."""

    indices: torch.Tensor
    """[T, K] int64: the chosen experts of each token, highest score first."""
    weights: torch.Tensor
    """[T, K] fp32, differentiable: the scores, renormalised when ``renormalize``, times ``scaling``."""
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
    """C = ceil(T * K * capacity_factor / E): the assignments each expert keeps at most, clamped to [1, T * K]
    (an expert cannot receive more than T * K assignments, so a larger factor means no limit in effect)."""
    c = num_tokens * k * capacity_factor / num_experts - 1e-9
    return max(1, min(num_tokens * k, math.ceil(c) if c < 2.0**62 else 2**62))


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


# --------------------------------------------------------------------------------------------------
# Trust: sealed routings, and the full check of the others

_TENSORS = ("indices", "weights", "scores", "tokens_per_expert", "row_map", "token_index", "dropped")
_I64 = torch.int64
_F32 = torch.float32
_SCORES = ("softmax", "sigmoid")


def out_of_range(what: str) -> ShapeError:
    """The error of a provider that found a row or token index outside its buffers (nothing was written)."""
    return ShapeError(f"torsh_kernels.{what}: the routing's row map or token index points outside the rows "
                      "(nothing was written); pass the Routing that moe_route returned for these tokens")  # fmt: skip


def seal(r: Routing) -> Routing:
    """Mark ``r`` as checked: the tensors the ops read (by identity), their version counters and the sizes
    they are checked against, as they are now."""
    rm, ti, w, i = r.row_map, r.token_index, r.weights, r.indices
    object.__setattr__(r, "_seal", (rm, ti, w, i, rm._version, ti._version, w._version, i._version, r.num_rows,
                                    r.num_experts))  # fmt: skip
    return r


def sealed(r: object) -> bool:
    """Whether the seal of ``r`` still holds for what the permute and unpermute read (``row_map``,
    ``token_index``, ``weights``, ``num_rows``): the hot path's check, no tensor is read."""
    try:
        s = r._seal  # type: ignore[attr-defined]
    except AttributeError:
        return False
    rm, ti, w = r.row_map, r.token_index, r.weights
    return (
        s[0] is rm and s[1] is ti and s[2] is w and s[4] == rm._version and s[5] == ti._version
        and s[6] == w._version and s[8] == r.num_rows
    )  # fmt: skip


def sealed_rows(r: object) -> bool:
    """Whether the seal of ``r`` still holds for what the permute reads (``row_map``, ``token_index``,
    ``num_rows``)."""
    try:
        s = r._seal  # type: ignore[attr-defined]
    except AttributeError:
        return False
    rm, ti = r.row_map, r.token_index
    return s[0] is rm and s[1] is ti and s[4] == rm._version and s[5] == ti._version and s[8] == r.num_rows


def sealed_experts(r: object) -> bool:
    """Whether the seal of ``r`` still holds for what the router losses read (``indices``, ``num_experts``)."""
    try:
        s = r._seal  # type: ignore[attr-defined]
    except AttributeError:
        return False
    i = r.indices
    return s[3] is i and s[7] == i._version and s[9] == r.num_experts


def check_routing(r: object, what: str, *, values: bool = True, reads: str = "weights") -> Routing:
    """``r`` if it is a sealed :class:`Routing`; else checked in full (see the module docstring) and sealed.

    ``values=False`` (while ``torch.compile`` traces): the fields' types, dtypes and device only (sizes may be
    symbolic there); nothing is read from the tensors and nothing is sealed. Meta tensors get the checks of
    sizes and strides but have no values to check, and are not sealed. Raises ``ArgumentTypeError``,
    ``DTypeError``, ``ShapeError``, ``DeviceMismatchError`` or ``InvalidArgumentError`` naming the field.
    ``reads``: which of the seal's fields the caller reads, "rows" (the permute: ``row_map``, ``token_index``),
    "weights" (the unpermute: those and ``weights``) or "experts" (the aux loss: ``indices``); those must
    still be as sealed."""
    if not isinstance(r, Routing):
        raise ArgumentTypeError(f"{what}: routing must be a Routing (from moe_route), got {type(r).__name__}")
    if not values:  # (torch.compile traces: sizes may be symbolic, version counters are not traced)
        _check_kinds(r, what)
        return r
    if _SEALED[reads](r):
        return r
    _check_kinds(r, what)
    _check_layout(r, what)
    if not r.row_map.is_meta:
        _check_values(r, what)
        seal(r)
    return r


_SEALED = {"rows": sealed_rows, "weights": sealed, "experts": sealed_experts}


def _check_kinds(r: Routing, what: str) -> None:
    """Every tensor field a tensor of its dtype, all on one device (nothing that depends on a size)."""
    for name in _TENSORS:
        t = getattr(r, name)
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{what}: routing.{name} must be a torch.Tensor, got {type(t).__name__}")
    fix = "; pass the Routing that moe_route returned for these tokens"
    for name, dt in (("indices", _I64), ("row_map", _I64), ("token_index", _I64), ("tokens_per_expert", _I64),
                     ("weights", _F32), ("scores", _F32), ("dropped", torch.bool)):  # fmt: skip
        t = getattr(r, name)
        if t.dtype != dt:
            raise DTypeError(f"{what}: routing.{name} has dtype {t.dtype}; expected {dt}{fix}")
    dev = r.indices.device
    for name in _TENSORS:
        t = getattr(r, name)
        if t.device != dev:
            raise DeviceMismatchError(f"{what}: routing.{name} is on {t.device}, routing.indices on {dev}")


def _check_layout(r: Routing, what: str) -> None:
    for name, lo in (("num_experts", 1), ("num_rows", 0)):
        v = getattr(r, name)
        if isinstance(v, bool) or not isinstance(v, int):
            raise ArgumentTypeError(f"{what}: routing.{name} must be an int, got {type(v).__name__}")
        if v < lo:
            raise InvalidArgumentError(f"{what}: routing.{name}={v} must be >= {lo}")
    cap = r.capacity
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise InvalidArgumentError(f"{what}: routing.capacity={cap!r} must be None or an int >= 1")
    if r.score not in _SCORES:
        raise InvalidArgumentError(f"{what}: routing.score={r.score!r}; expected 'softmax' or 'sigmoid'")
    fix = "; pass the Routing that moe_route returned for these tokens"
    if r.indices.dim() != 2:
        raise ShapeError(f"{what}: routing.indices must be [T, K], got shape {tuple(r.indices.shape)}{fix}")
    T, K = r.indices.shape
    E, N = r.num_experts, r.num_rows
    if K < 1:
        raise ShapeError(f"{what}: routing.indices has K=0 choices per token{fix}")
    if N > T * K:
        raise ShapeError(f"{what}: routing.num_rows={N} is more than T*K={T * K} assignments{fix}")
    for name, shape in (("weights", (T, K)), ("scores", (T, K)), ("row_map", (T, K)), ("dropped", (T, K)),
                        ("tokens_per_expert", (E,)), ("token_index", (N,))):  # fmt: skip
        t = getattr(r, name)
        if tuple(t.shape) != shape:
            raise ShapeError(f"{what}: routing.{name} has shape {tuple(t.shape)}; expected {shape}{fix}")
    for name in _TENSORS:
        t = getattr(r, name)
        if not t.is_contiguous():
            raise ShapeError(f"{what}: routing.{name} must be contiguous (the kernels index it as a dense array)")


def _check_values(r: Routing, what: str) -> None:
    """Ranges and consistency, in a few passes over the [T, K] tensors (host reads: not the hot path)."""
    T, K = r.indices.shape
    E, N = r.num_experts, r.num_rows
    fix = "; pass the Routing that moe_route returned for these tokens"
    if T * K == 0:
        return
    idx, rows = r.indices, r.row_map
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo < 0 or hi >= E:
        raise ShapeError(f"{what}: routing.indices holds {lo if lo < 0 else hi}, not an expert of [0, {E}){fix}")
    lo, hi = (int(v) for v in torch.aminmax(rows))
    if lo < -1 or hi >= N:
        raise ShapeError(
            f"{what}: routing.row_map holds {lo if lo < -1 else hi}, outside the rows [0, {N}) (or -1 for a dropped "
            f"assignment){fix}"
        )
    kept = rows >= 0
    if not torch.equal(r.dropped, ~kept):
        raise ShapeError(
            f"{what}: routing.dropped disagrees with routing.row_map (dropped exactly where it is -1){fix}"
        )
    kr = rows[kept]
    if kr.numel() != N:
        raise ShapeError(f"{what}: routing.row_map keeps {kr.numel()} assignments but routing.num_rows is {N}{fix}")
    if N:
        lo, hi = (int(v) for v in torch.aminmax(r.token_index))
        if lo < 0 or hi >= T:
            raise ShapeError(f"{what}: routing.token_index holds {lo if lo < 0 else hi}, outside the rows: not a token "
                             f"of [0, {T}){fix}")  # fmt: skip
    order = torch.sort(kr).values
    if not torch.equal(order, torch.arange(N, device=rows.device)):
        raise ShapeError(
            f"{what}: routing.row_map repeats a row (its kept entries must be a permutation of [0, {N})){fix}"
        )
    tok = torch.arange(T, device=rows.device).unsqueeze(1).expand(T, K)[kept]
    if not torch.equal(r.token_index[kr], tok):
        raise ShapeError(f"{what}: routing.token_index is not the inverse of routing.row_map{fix}")
    ke = idx[kept]
    counts = torch.bincount(ke, minlength=E)
    if not torch.equal(counts, r.tokens_per_expert):
        raise ShapeError(
            f"{what}: routing.tokens_per_expert disagrees with the kept assignments per expert of routing.indices{fix}"
        )
    start = torch.cumsum(counts, 0) - counts
    if N and not bool(((kr >= start[ke]) & (kr < start[ke] + counts[ke])).all()):
        raise ShapeError(f"{what}: routing.row_map does not group the rows by expert in ascending order{fix}")
    if r.capacity is not None and N and int(counts.max()) > r.capacity:
        raise ShapeError(f"{what}: an expert keeps {int(counts.max())} rows, above routing.capacity={r.capacity}{fix}")
