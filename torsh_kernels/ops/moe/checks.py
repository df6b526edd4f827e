"""The MoE family's input checks (typed errors) that its public ops and custom ops share: activations' dtypes, router
logits, the score bias (its values checked once per version of the tensor), a routing (a sealed one trusted after
identity checks, any other checked in full), permuted rows, and the error of NaN router scores."""

from __future__ import annotations

import weakref

import torch

from ...errors import DeviceMismatchError, DTypeError, NonFiniteError, ShapeError
from ..common import check_tensor
from .routing import SEALED, Routing, check_routing

__all__ = [
    "ACT_DTYPES",
    "check_act_dtype",
    "check_bias",
    "check_bias_finite",
    "check_logits",
    "check_routing_of",
    "check_rows",
    "raise_nan_scores",
]

ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_act_dtype(t: torch.Tensor, what: str, name: str) -> None:
    if t.dtype not in ACT_DTYPES:
        raise DTypeError(f"{what}: {name} has dtype {t.dtype}; expected float32, float16 or bfloat16")


def check_logits(logits: object, what: str) -> torch.Tensor:
    logits = check_tensor(logits, what, "logits")
    check_act_dtype(logits, what, "logits")
    if logits.dim() != 2:
        raise ShapeError(
            f"{what}: logits must be [T, E] (tokens x experts), got shape {tuple(logits.shape)}; "
            "flatten the batch dimensions first (logits.reshape(-1, E))"
        )
    if logits.shape[1] < 1:
        raise ShapeError(f"{what}: logits has no experts (shape {tuple(logits.shape)})")
    return logits


def check_routing_of(routing: object, what: str, reads: str) -> Routing:
    """A sealed Routing as it is (for the fields the caller ``reads``: see ``check_routing``); any other checked in
    full (values too, except while torch.compile traces)."""
    compiling = _is_compiling()
    if not compiling and type(routing) is Routing and SEALED[reads](routing):
        return routing
    return check_routing(routing, what, values=not compiling, reads=reads)


_is_compiling = torch.compiler.is_compiling


def check_rows(x: object, rows: int, routing: Routing, what: str, name: str, rows_name: str) -> torch.Tensor:
    x = check_tensor(x, what, name)
    check_act_dtype(x, what, name)
    if x.dim() != 2 or x.shape[0] != rows:
        raise ShapeError(f"{what}: {name} must be [{rows_name}={rows}, H] for this routing, got shape {tuple(x.shape)}")
    if x.device != routing.row_map.device:
        raise DeviceMismatchError(f"{what}: {name} is on {x.device}, the routing on {routing.row_map.device}")
    return x


def check_bias(score_bias: object, logits: torch.Tensor, what: str) -> torch.Tensor:
    """The score bias as the custom op takes it (contiguous); a typed error for a bad one. Its values are
    checked by the op (:func:`check_bias_finite`), at run time."""
    E = logits.shape[1]
    bias = check_tensor(score_bias, what, "score_bias")
    if bias.dtype != torch.float32:
        raise DTypeError(
            f"{what}: score_bias has dtype {bias.dtype}; expected float32 (one fp32 value per expert, added to the "
            "fp32 scores): pass bias.float()"
        )
    if tuple(bias.shape) != (E,):
        raise ShapeError(f"{what}: score_bias must be [E={E}] (one value per expert), got shape {tuple(bias.shape)}")
    if bias.device != logits.device:
        raise DeviceMismatchError(f"{what}: score_bias is on {bias.device}, the logits on {logits.device}")
    return bias if bias.is_contiguous() else bias.contiguous()


def raise_nan_scores(bad: int, T: int) -> None:
    raise NonFiniteError(
        f"torsh_kernels.moe_route: {bad} of {T} tokens have NaN router scores (NaN or +inf logits, or a "
        "softmax row of all -inf); fix the router's input, or pass check_finite=False to route them "
        "anyway (their NaN scores then rank below every real score)"
    )


def _raise_bad_bias(bias: torch.Tensor) -> None:
    n = int((~torch.isfinite(bias)).sum())
    raise NonFiniteError(
        f"torsh_kernels.moe_route: score_bias holds {n} non-finite value(s) (NaN or Inf) of {bias.numel()}; it must "
        "be finite (a bias that diverged: reset it, or lower the balancer's update rate)"
    )


# score_bias tensors whose values were found finite: id -> (a weak reference, the version counter then). A
# bias is read again only after it changed in place (its version counter moved): once per balancer update,
# not once per route (a host sync on a GPU). Writes that bypass the counter (.data, NumPy) are not seen.
_BIAS_FINITE: dict[int, tuple[weakref.ref, int]] = {}


def check_bias_finite(bias: torch.Tensor) -> None:
    """A NonFiniteError unless every value of ``bias`` is finite (checked once per version of the tensor)."""
    seen = _BIAS_FINITE.get(id(bias))
    if seen is not None and seen[0]() is bias and seen[1] == bias._version:
        return
    if not bool(torch.isfinite(bias).all()):
        _raise_bad_bias(bias)
    if len(_BIAS_FINITE) >= 256:
        _BIAS_FINITE.clear()
    _BIAS_FINITE[id(bias)] = (weakref.ref(bias), bias._version)
