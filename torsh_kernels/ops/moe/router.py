"""How :func:`~torsh_kernels.ops.moe_route` routes: :class:`RouterSpec`, one validated value.

The options (the scores, the grouped selection, the scaling, the capacity and what an overfull expert
drops) are checked once, when the spec is made; what depends on the number of experts E (``k <= E``,
``n_group`` dividing E) once per (spec, E), by :meth:`RouterSpec.selection`. What varies per call stays an
argument of ``moe_route``: the logits, the expert bias (a tensor the balancer updates in place), the
sequences of this batch, the kernel provider::

    spec = RouterSpec(k=8, score="sigmoid", n_group=8, topk_group=4, scaling=2.5)   # DeepSeek-V3
    routing = moe_route(logits, spec, score_bias=bias)
    routing = moe_route(logits, k=2)                                                  # keywords build one
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ...checks import check_bool, check_choice, check_int, short
from ...errors import ArgumentTypeError, InvalidArgumentError
from ...specs import Spec, local

_F32_MAX = float(torch.finfo(torch.float32).max)

__all__ = [
    "CAPACITY_SCOPES",
    "DROP_POLICIES",
    "SCORES",
    "RouterSpec",
    "check_capacity",
    "check_capacity_factor",
]

SCORES = ("softmax", "sigmoid")
"""``RouterSpec.score``: a softmax over the experts, or a sigmoid per expert."""
DROP_POLICIES = ("probability", "position")
"""``RouterSpec.drop_policy``: which assignments an overfull expert keeps."""
CAPACITY_SCOPES = ("call", "sequence")
"""``RouterSpec.capacity_scope``: a capacity for all the call's tokens, or per sequence."""


def check_capacity_factor(capacity_factor: object, what: str) -> float | None:
    """None (no limit) or a positive finite float; a typed error otherwise."""
    if capacity_factor is None:
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
        raise ArgumentTypeError(f"{what}: capacity_factor must be a number or None, got {short(capacity_factor)}")
    try:
        f = float(capacity_factor)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f <= 0:
        raise InvalidArgumentError(
            f"{what}: capacity_factor={short(capacity_factor)} must be a positive finite number (or None for no limit)"
        )
    return f


def check_capacity(capacity: object, what: str) -> int | None:
    """None (no fixed capacity) or an int >= 0; a typed error otherwise."""
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral):
        raise ArgumentTypeError(f"{what}: capacity must be an int or None, got {type(capacity).__name__} {capacity!r}")
    if capacity < 0:
        raise InvalidArgumentError(f"{what}: capacity={capacity} must be >= 0 (0 drops every assignment)")
    return int(capacity)


@dataclass(frozen=True, kw_only=True, slots=True)
class RouterSpec(Spec):
    """Route each token to ``k`` of E experts (see :func:`~torsh_kernels.ops.moe_route`)."""

    k: int
    """Experts per token, 1 <= k <= E."""
    score: str = "softmax"
    """"softmax" over the experts, or "sigmoid" per expert (scores computed in fp32)."""
    renormalize: bool = True
    """Divide each token's K chosen scores by their sum."""
    n_group: int | None = None
    """Grouped selection (with ``topk_group``; both or neither): E splits into ``n_group`` equal groups."""
    topk_group: int | None = None
    """The K experts come from the ``topk_group`` groups whose two highest biased scores sum highest."""
    scaling: float = 1.0
    """Finite and > 0; the weights are multiplied by it after the renormalisation (DeepSeek-V3's
    ``routed_scaling_factor``)."""
    capacity_factor: float | None = None
    """None for no limit, else each expert keeps at most ``ceil(T * k * capacity_factor / E)`` assignments
    (per sequence: ``ceil(L_s * k * capacity_factor / E)``)."""
    capacity: int | None = None
    """A fixed capacity per expert (an int >= 0; per sequence and expert in the sequence scope); not together
    with ``capacity_factor``."""
    capacity_scope: str = "call"
    """"call" (the capacity applies to all T tokens) or "sequence" (to each sequence of the call's
    ``sequence_lengths`` and expert, as Switch Transformers does per group)."""
    drop_policy: str = "probability"
    """Which assignments an overfull expert keeps: "probability" (highest scores) or "position" (earliest)."""
    pad_to_capacity: bool = False
    """Pad each expert's group of permuted rows with zero rows to the capacity (needs one): ``num_rows = E *
    capacity`` without reading the device (Megatron's ``moe_pad_expert_input_to_capacity``)."""
    check_finite: bool = local(True)
    """Raise ``NonFiniteError`` when a token's scores are NaN (one host sync); changes nothing on the wire."""

    def __post_init__(self) -> None:
        what = "RouterSpec"
        self.normalize("k", check_int(self.k, what, "k", 1))
        check_choice(self.score, what, "score", SCORES)
        check_bool(self.renormalize, what, "renormalize")
        if (self.n_group is None) != (self.topk_group is None):
            raise InvalidArgumentError(
                f"{what}: n_group={self.n_group!r} and topk_group={self.topk_group!r}; give both (grouped "
                "selection) or neither"
            )
        if self.n_group is not None:
            self.normalize("n_group", check_int(self.n_group, what, "n_group", 1))
            self.normalize("topk_group", check_int(self.topk_group, what, "topk_group", 1, self.n_group))
        if isinstance(self.scaling, bool) or not isinstance(self.scaling, numbers.Real):
            raise ArgumentTypeError(f"{what}: scaling must be a number, got {type(self.scaling).__name__} "
                                    f"{short(self.scaling)}")  # fmt: skip
        try:
            c = float(self.scaling)
        except OverflowError:
            c = math.inf
        if not (math.isfinite(c) and 0 < c <= _F32_MAX):  # (weights are fp32 and at most 1 before the scaling)
            raise InvalidArgumentError(f"{what}: scaling={short(self.scaling)} must be a finite number in (0, "
                                       f"{_F32_MAX:.4g}], the fp32 range of the weights (1.0: no scaling)")  # fmt: skip
        self.normalize("scaling", c)
        self.normalize("capacity_factor", check_capacity_factor(self.capacity_factor, what))
        self.normalize("capacity", check_capacity(self.capacity, what))
        self._check_capacity(what)
        check_choice(self.drop_policy, what, "drop_policy", DROP_POLICIES)
        check_bool(self.check_finite, what, "check_finite")

    def _check_capacity(self, what: str) -> None:
        if self.capacity is not None and self.capacity_factor is not None:
            raise InvalidArgumentError(
                f"{what}: capacity={self.capacity} and capacity_factor={self.capacity_factor} both given; pass one "
                "(a fixed capacity per expert, or a factor of the balanced load)"
            )
        if not isinstance(self.capacity_scope, str) or self.capacity_scope not in CAPACITY_SCOPES:
            raise InvalidArgumentError(f"{what}: capacity_scope={self.capacity_scope!r}; expected 'call' or 'sequence'")
        if not isinstance(self.pad_to_capacity, bool):
            raise ArgumentTypeError(
                f"{what}: pad_to_capacity must be a bool, got {type(self.pad_to_capacity).__name__}"
            )
        if self.pad_to_capacity and not self.limited:
            raise InvalidArgumentError(
                f"{what}: pad_to_capacity=True needs a capacity to pad to; pass capacity= or capacity_factor="
            )
        if self.capacity_scope == "sequence" and not self.limited:
            raise InvalidArgumentError(
                f"{what}: capacity_scope='sequence' without a capacity has nothing to apply per sequence; pass "
                "capacity= or capacity_factor=, or leave capacity_scope and sequence_lengths out"
            )

    @property
    def limited(self) -> bool:
        """Whether a capacity applies (some assignments may be dropped)."""
        return self.capacity is not None or self.capacity_factor is not None

    @property
    def grouped(self) -> bool:
        """Grouped selection (``n_group`` / ``topk_group``)."""
        return self.n_group is not None

    def selection(self, num_experts: int, what: str) -> tuple[int, int]:
        """(n_group, topk_group) as the kernels take them (0, 0 without groups) for E = ``num_experts``, after
        the checks that need E (``k <= E``; ``n_group`` divides E and its kept groups hold k experts); cached
        per (spec, E, what)."""
        if torch.compiler.is_compiling():  # (dynamo traces the checks; it would break the graph on the cache)
            return _selection(self, num_experts, what)
        key = (self, num_experts, what)
        hit = _SELECTIONS.get(key)
        if hit is None:
            hit = _selection(self, num_experts, what)
            if len(_SELECTIONS) >= 4096:
                _SELECTIONS.clear()
            _SELECTIONS[key] = hit
        return hit


_SELECTIONS: dict[tuple[RouterSpec, int, str], tuple[int, int]] = {}  # (a dict: torch.compile traces it)


def _selection(spec: RouterSpec, E: int, what: str) -> tuple[int, int]:
    check_int(spec.k, what, "k", 1, E)
    if spec.n_group is None:
        return 0, 0
    G, TG = spec.n_group, spec.topk_group
    check_int(G, what, "n_group", 1, E)
    if E % G:
        raise InvalidArgumentError(
            f"{what}: n_group={G} does not split the E={E} experts into equal groups; pass a divisor of {E}"
        )
    if spec.k > TG * (E // G):
        raise InvalidArgumentError(
            f"{what}: k={spec.k} is more than the {TG * (E // G)} experts of the topk_group={TG} kept groups of "
            f"{E // G}; raise topk_group or lower k"
        )
    return G, TG
