"""The routing contract of the MoE op family: :class:`Routing` and the capacity rule.

``moe_route`` returns a :class:`Routing`; ``moe_permute``, ``moe_unpermute``, the router losses and the
expert-parallel layers consume it. The capacity rule (``expert_capacity``, ``check_sequence_lengths`` and
:func:`plan_capacity`, which turns a :class:`~torsh_kernels.ops.moe.router.RouterSpec`'s capacity options and a
call's sequences into a :class:`CapacityPlan`) decides how many assignments each expert keeps, per call or per
sequence, and whether each expert's group of rows is padded to its capacity. See ``api.py`` for the ops.

**Layout.** The permuted rows are grouped by expert in ascending expert order, token order inside each
group. Without padding, expert e's group has ``tokens_per_expert[e]`` rows and N is their sum. With
``padded`` (``moe_route(pad_to_capacity=True)``), every group has ``capacity`` rows: the kept rows first
(token order), then zero rows up to ``capacity``; N = E * capacity is known without reading the device,
``token_index`` is -1 at the padding rows and no ``row_map`` entry points at them. ``tokens_per_expert``
stays the real kept counts (what losses and balancing read); :attr:`Routing.rows_per_expert` is the group
sizes of the permuted layout either way (what the expert GEMMs and the all-to-all splits read), and
:meth:`Routing.expert_offsets` their starts.

**Trust.** The kernels index memory with a routing's ``row_map``, ``token_index`` and ``indices``. A
``Routing`` that ``moe_route`` made is *sealed*: it remembers the tensors the ops read (``row_map``,
``token_index``, ``weights``, ``indices``) and their autograd version counters, and :func:`check_routing`
accepts it after a few identity and integer comparisons of the fields the calling op reads (well under a
microsecond). Any other ``Routing`` (built by hand, by ``dataclasses.replace``, unpickled, copied), and a
sealed one one of whose read tensors was edited in place (a version counter moved) or swapped, is validated in full
before any kernel reads it (types, dtypes, shapes, devices, contiguity, every index in range, and the fields
consistent with each other: the kept rows a permutation of ``[0, N)`` (padded: of the kept part of each
group, the other rows' ``token_index`` -1), ``token_index`` its inverse, ``dropped`` where ``row_map`` is -1,
rows grouped by expert with ``tokens_per_expert`` as the kept counts, none above the capacity of the call or
of a (sequence, expert) pair, and the sequences' lengths summing to T), then sealed. Writes that bypass the
version counter (through ``.data``, NumPy or DLPack) are not seen. The seal also remembers ``padded`` (the
permute and unpermute read it).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ...errors import ArgumentTypeError, DeviceMismatchError, DTypeError, InvalidArgumentError, ShapeError
from ..common import Sealable, device_bytes
from .router import RouterSpec

__all__ = [
    "CapacityPlan",
    "Routing",
    "check_routing",
    "check_sequence_lengths",
    "expert_capacity",
    "out_of_range",
    "plan_capacity",
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
    """[E] int64: kept assignments per expert (unpadded, the group sizes of the permuted rows; padded or not,
    :attr:`rows_per_expert` is)."""
    row_map: torch.Tensor
    """[T, K] int64: the row of the permuted tensor that assignment (t, j) occupies, -1 if dropped."""
    token_index: torch.Tensor
    """[N] int64: the token each permuted row came from (the inverse of ``row_map``); -1 at padding rows."""
    dropped: torch.Tensor
    """[T, K] bool: assignments dropped by the capacity limit."""
    num_experts: int
    """E."""
    num_rows: int
    """N: the number of permuted rows (T*K minus the dropped assignments; padded, E * capacity)."""
    capacity: int | None
    """The most assignments an expert keeps in this call, or None without a capacity limit: C in the call
    scope; in the sequence scope the sum of the sequences' capacities, ``sum(sequence_capacity)``. With
    ``padded``, also the number of rows of every expert's group."""
    score: str
    """The scoring function used: "softmax" or "sigmoid"."""
    sequence_lengths: tuple[int, ...] | None = None
    """Capacity per sequence (``capacity_scope="sequence"``): the tokens of each sequence, laid out one after
    the other (summing to T); None when the capacity applies to the whole call (or there is none)."""
    sequence_capacity: tuple[int, ...] | None = None
    """Capacity per sequence: C_s, the assignments each expert keeps at most from sequence s; None otherwise."""
    padded: bool = False
    """Each expert's group of permuted rows padded with zero rows to ``capacity`` rows (``pad_to_capacity``):
    ``num_rows`` is E * capacity and ``token_index`` is -1 at the padding rows."""
    selection_options: bool = False
    """A ``score_bias`` or grouped selection (``n_group``/``topk_group``) chose ``indices``: they may differ from
    the K highest scores, which :func:`moe_aux_loss` counts by default (``count="topk"``, Megatron-Core's rule)
    and recomputes when this is True. False: ``indices`` are the K highest scores."""

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
        """Assignments dropped by the capacity limit: T*K - N (padded: T*K minus the kept ones, which reads
        ``dropped`` from the device)."""
        if self.padded:
            return int(self.dropped.sum())
        return self.num_tokens * self.k - self.num_rows

    @property
    def capacity_scope(self) -> str:
        """Where the capacity applies: "sequence" (per sequence and expert) or "call"."""
        return "call" if self.sequence_lengths is None else "sequence"

    @property
    def rows_per_expert(self) -> torch.Tensor:
        """[E] int64: the group sizes of the permuted layout, what the expert GEMMs and the all-to-all splits
        read: ``tokens_per_expert`` itself, or with ``padded`` ``capacity`` for every expert (a new tensor; on
        the host that is ``[capacity] * E``, nothing to read from the device)."""
        if self.padded:
            return torch.full_like(self.tokens_per_expert, self.capacity)
        return self.tokens_per_expert

    def __repr__(self) -> str:
        """The sizes, not the [T, K] tensors (they are attributes)."""
        extra = ""
        if self.sequence_lengths is not None:
            extra += f", sequences={len(self.sequence_lengths)}"
        if self.padded:
            extra += ", padded"
        return (
            f"Routing(tokens={self.num_tokens}, experts={self.num_experts}, k={self.k}, rows={self.num_rows}, "
            f"dropped={self.num_dropped}, capacity={self.capacity}{extra}, score={self.score!r}, "
            f"device={self.indices.device})"
        )

    def expert_offsets(self) -> torch.Tensor:
        """[E + 1] int64: the first permuted row of each expert's group, then N (``rows_per_expert``'s
        exclusive prefix sums)."""
        c = self.rows_per_expert
        return torch.cat([c.new_zeros(1), torch.cumsum(c, 0)])


def expert_capacity(num_tokens: int, k: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(T * K * capacity_factor / E): the assignments each expert keeps at most, clamped to [1, T * K]
    (an expert cannot receive more than T * K assignments, so a larger factor means no limit in effect)."""
    c = num_tokens * k * capacity_factor / num_experts - 1e-9
    return max(1, min(num_tokens * k, math.ceil(c) if c < 2.0**62 else 2**62))


def check_sequence_lengths(lengths: object, num_tokens: int, what: str) -> tuple[int, ...]:
    """``lengths`` (a list or tuple of ints, or a 1-D integer tensor, which is read: a device-to-host copy for a
    GPU tensor) as a tuple of ints >= 0 summing to ``num_tokens``; a typed error otherwise."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
            raise DTypeError(f"{what}: sequence_lengths has dtype {lengths.dtype}; expected an integer dtype")
        if lengths.dim() != 1:
            raise ShapeError(f"{what}: sequence_lengths must be 1-D (one length per sequence), got shape "
                             f"{tuple(lengths.shape)}")  # fmt: skip
        if lengths.is_meta:
            raise InvalidArgumentError(f"{what}: sequence_lengths is a meta tensor, which holds no lengths; pass "
                                       "them as a list of ints")  # fmt: skip
        vals = tuple(lengths.tolist())
    elif isinstance(lengths, (list, tuple)):
        for i, v in enumerate(lengths):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ArgumentTypeError(f"{what}: sequence_lengths[{i}] must be an int, got {type(v).__name__} {v!r}")
        vals = tuple(int(v) for v in lengths)
    else:
        raise ArgumentTypeError(
            f"{what}: sequence_lengths must be a list or tuple of ints or a 1-D integer tensor, got "
            f"{type(lengths).__name__}"
        )
    for i, v in enumerate(vals):
        if v < 0:
            raise InvalidArgumentError(f"{what}: sequence_lengths[{i}]={v} must be >= 0")
    if sum(vals) != num_tokens:
        raise ShapeError(
            f"{what}: sequence_lengths sum to {sum(vals)}, but the logits hold T={num_tokens} tokens; give the "
            "length of every sequence, the tokens laid out sequence after sequence"
        )
    return vals


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    """What ``moe_route``'s capacity options come to for one call: host integers, no tensor read."""

    capacity: int | None
    """Routing.capacity: the most assignments an expert keeps in the call (the sequence scope: sum of C_s)."""
    kernel_capacity: int
    """The call scope's C for the kernels, clamped to T * K (more cannot be kept); -1: no call-scope limit."""
    sequence_lengths: tuple[int, ...] | None
    """The sequence scope: L_s; None in the call scope."""
    sequence_capacity: tuple[int, ...] | None
    """The sequence scope: C_s; None in the call scope."""
    kernel_sequence_capacity: tuple[int, ...]
    """The sequence scope's C_s for the kernels, clamped to L_s * K; () in the call scope."""
    padded_capacity: int
    """Rows of every expert's group when padded (the capacity); -1 without padding."""

    @property
    def limited(self) -> bool:
        """Whether a capacity applies (some assignments may be dropped)."""
        return self.capacity is not None


NO_CAPACITY = CapacityPlan(None, -1, None, None, (), -1)


def plan_capacity(
    what: str,
    num_tokens: int,
    num_experts: int,
    spec: RouterSpec,
    sequence_lengths: object = None,
    device: torch.device | None = None,
) -> CapacityPlan:
    """What ``spec``'s capacity options (checked when it was made) come to for a call of ``num_tokens`` tokens
    with these ``sequence_lengths`` (typed errors, before anything is allocated):

    - ``capacity`` or ``capacity_factor`` (C = ``expert_capacity``);
    - ``capacity_scope="call"``: one C per expert for all T tokens; ``"sequence"`` (with ``sequence_lengths``,
      summing to T): C_s per (sequence, expert), ``capacity`` or ``expert_capacity(L_s, k, E, capacity_factor)``
      (0 for an empty sequence). ``sequence_lengths`` needs the sequence scope, and it needs them;
    - ``pad_to_capacity``: every expert's group padded to ``capacity`` rows (call scope: C; sequence scope: sum
      of C_s), whose token index must fit in ``device``'s memory."""
    if not spec.limited and sequence_lengths is None:
        return NO_CAPACITY
    T, K, E = num_tokens, spec.k, num_experts
    cap, cf = spec.capacity, spec.capacity_factor
    if spec.capacity_scope == "sequence":
        if sequence_lengths is None:
            raise InvalidArgumentError(
                f"{what}: capacity_scope='sequence' needs sequence_lengths (the tokens of each sequence, summing to "
                f"T={T})"
            )
        lens = check_sequence_lengths(sequence_lengths, T, what)
        caps = tuple(cap if cf is None else (expert_capacity(n, K, E, cf) if n else 0) for n in lens)
        kcaps = tuple(min(c, n * K) for c, n in zip(caps, lens))
        total = sum(caps)
        plan = CapacityPlan(total, -1, lens, caps, kcaps, total if spec.pad_to_capacity else -1)
    else:
        if sequence_lengths is not None:
            raise InvalidArgumentError(
                f"{what}: sequence_lengths given with capacity_scope='call', which would ignore them; pass "
                "capacity_scope='sequence' for a capacity per sequence"
            )
        c = cap if cf is None else expert_capacity(T, K, E, cf)
        plan = CapacityPlan(c, min(c, T * K), None, None, (), c if spec.pad_to_capacity else -1)
    if plan.padded_capacity > 0:
        rows = E * plan.padded_capacity
        dev = device if device is not None else torch.device("cpu")
        if rows * 8 > device_bytes(dev):
            raise InvalidArgumentError(
                f"{what}: pad_to_capacity pads every expert to capacity={plan.padded_capacity} rows: {rows} rows, "
                f"whose token index alone ({rows * 8 / 2**30:.4g} GiB) cannot fit in the {dev.type} memory; pass a "
                "smaller capacity"
            )
    return plan


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
                                    r.num_experts, r.padded))  # fmt: skip
    return r


def sealed(r: object) -> bool:
    """Whether the seal of ``r`` still holds for what the permute and unpermute read (``row_map``,
    ``token_index``, ``weights``, ``num_rows``, ``padded``): the hot path's check, no tensor is read."""
    try:
        s = r._seal  # type: ignore[attr-defined]
    except AttributeError:
        return False
    rm, ti, w = r.row_map, r.token_index, r.weights
    return (
        s[0] is rm and s[1] is ti and s[2] is w and s[4] == rm._version and s[5] == ti._version
        and s[6] == w._version and s[8] == r.num_rows and s[10] is r.padded
    )  # fmt: skip


def sealed_rows(r: object) -> bool:
    """Whether the seal of ``r`` still holds for what the permute reads (``row_map``, ``token_index``,
    ``num_rows``, ``padded``)."""
    try:
        s = r._seal  # type: ignore[attr-defined]
    except AttributeError:
        return False
    rm, ti = r.row_map, r.token_index
    return (
        s[0] is rm and s[1] is ti and s[4] == rm._version and s[5] == ti._version and s[8] == r.num_rows
        and s[10] is r.padded
    )  # fmt: skip


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
    if SEALED[reads](r):
        return r
    _check_kinds(r, what)
    _check_layout(r, what)
    if not r.row_map.is_meta:
        _check_values(r, what)
        seal(r)
    return r


SEALED = {"rows": sealed_rows, "weights": sealed, "experts": sealed_experts}


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
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise InvalidArgumentError(f"{what}: routing.capacity={cap!r} must be None or an int >= 0")
    if r.score not in _SCORES:
        raise InvalidArgumentError(f"{what}: routing.score={r.score!r}; expected 'softmax' or 'sigmoid'")
    for name in ("padded", "selection_options"):
        if not isinstance(getattr(r, name), bool):
            raise ArgumentTypeError(f"{what}: routing.{name} must be a bool, got {type(getattr(r, name)).__name__}")
    fix = "; pass the Routing that moe_route returned for these tokens"
    if r.indices.dim() != 2:
        raise ShapeError(f"{what}: routing.indices must be [T, K], got shape {tuple(r.indices.shape)}{fix}")
    T, K = r.indices.shape
    E, N = r.num_experts, r.num_rows
    if K < 1:
        raise ShapeError(f"{what}: routing.indices has K=0 choices per token{fix}")
    _check_sequences(r, T, what)
    if r.padded:
        if cap is None:
            raise InvalidArgumentError(f"{what}: routing.padded is True but routing.capacity is None{fix}")
        if E * cap != N:
            raise ShapeError(f"{what}: routing.num_rows={N}, but a padded routing has E*capacity={E * cap} rows{fix}")
    elif N > T * K:
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


def _check_sequences(r: Routing, T: int, what: str) -> None:
    """The sequence scope's fields: both None, or tuples of ints >= 0 of one length, the lengths summing to T
    and the capacities to ``capacity``."""
    lens, caps = r.sequence_lengths, r.sequence_capacity
    if lens is None and caps is None:
        return
    for name, v in (("sequence_lengths", lens), ("sequence_capacity", caps)):
        if type(v) is not tuple or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise ArgumentTypeError(f"{what}: routing.{name} must be a tuple of ints, got {type(v).__name__}")
        if any(x < 0 for x in v):
            raise InvalidArgumentError(f"{what}: routing.{name} holds a negative value")
    if len(lens) != len(caps):
        raise ShapeError(f"{what}: routing.sequence_lengths has {len(lens)} sequences, routing.sequence_capacity "
                         f"{len(caps)}")  # fmt: skip
    if sum(lens) != T:
        raise ShapeError(f"{what}: routing.sequence_lengths sum to {sum(lens)}, not the T={T} tokens")
    if r.capacity != sum(caps):
        raise InvalidArgumentError(
            f"{what}: routing.capacity={r.capacity!r} is not the sum of routing.sequence_capacity ({sum(caps)})"
        )


def _check_values(r: Routing, what: str) -> None:
    """Ranges and consistency, in a few passes over the [T, K] tensors (host reads: not the hot path)."""
    T, K = r.indices.shape
    E, N = r.num_experts, r.num_rows
    fix = "; pass the Routing that moe_route returned for these tokens"
    padded, ti = r.padded, r.token_index
    if T * K == 0:
        if padded and N and not bool((ti == -1).all()):
            raise ShapeError(f"{what}: routing.token_index names a token, but there are none (padding is -1){fix}")
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
    n_kept = kr.numel()
    if not padded and n_kept != N:
        raise ShapeError(f"{what}: routing.row_map keeps {n_kept} assignments but routing.num_rows is {N}{fix}")
    if N:
        first = -1 if padded else 0
        lo, hi = (int(v) for v in torch.aminmax(ti))
        if lo < first or hi >= T:
            raise ShapeError(f"{what}: routing.token_index holds {lo if lo < first else hi}, outside the rows: not a "
                             f"token of [0, {T}){' (or -1 for a padding row)' if padded else ''}{fix}")  # fmt: skip
    order = torch.sort(kr).values
    if padded:
        if n_kept > 1 and not bool((order[1:] > order[:-1]).all()):
            raise ShapeError(f"{what}: routing.row_map repeats a row (its kept entries must be distinct){fix}")
        if int((ti >= 0).sum()) != n_kept:
            raise ShapeError(f"{what}: routing.token_index names a token at a row no assignment occupies (a padding "
                             f"row holds -1){fix}")  # fmt: skip
    elif not torch.equal(order, torch.arange(N, device=rows.device)):
        raise ShapeError(
            f"{what}: routing.row_map repeats a row (its kept entries must be a permutation of [0, {N})){fix}"
        )
    tok = torch.arange(T, device=rows.device).unsqueeze(1).expand(T, K)[kept]
    if not torch.equal(ti[kr], tok):
        raise ShapeError(f"{what}: routing.token_index is not the inverse of routing.row_map{fix}")
    ke = idx[kept]
    counts = torch.bincount(ke, minlength=E)
    if not torch.equal(counts, r.tokens_per_expert):
        raise ShapeError(
            f"{what}: routing.tokens_per_expert disagrees with the kept assignments per expert of routing.indices{fix}"
        )
    if padded:  # each group: capacity rows, the kept ones first
        start = torch.arange(E, device=rows.device) * r.capacity
    else:
        start = torch.cumsum(counts, 0) - counts
    if n_kept and not bool(((kr >= start[ke]) & (kr < start[ke] + counts[ke])).all()):
        raise ShapeError(f"{what}: routing.row_map does not group the rows by expert in ascending order{fix}")
    if r.capacity is not None and n_kept and int(counts.max()) > r.capacity:
        raise ShapeError(f"{what}: an expert keeps {int(counts.max())} rows, above routing.capacity={r.capacity}{fix}")
    lens = r.sequence_lengths
    if lens is not None and n_kept:
        S = len(lens)
        dev = rows.device
        seq = torch.repeat_interleave(torch.arange(S, device=dev), torch.tensor(lens, device=dev))  # [T]
        per = torch.bincount(ke * S + seq.unsqueeze(1).expand(T, K)[kept], minlength=E * S).view(E, S)
        caps = torch.tensor([min(c, 2**62) for c in r.sequence_capacity], dtype=torch.int64, device=dev)
        over = per > caps
        if bool(over.any()):
            e, q = (int(v) for v in over.nonzero()[0])
            raise ShapeError(f"{what}: expert {e} keeps {int(per[e, q])} assignments of sequence {q}, above "
                             f"routing.sequence_capacity[{q}]={r.sequence_capacity[q]}{fix}")  # fmt: skip
