"""The MoE family's input checks (typed errors) that its public ops share: activations' dtypes, router logits,
a routing (a sealed one trusted after identity checks, any other checked in full) and permuted rows."""

from __future__ import annotations

import torch

from ..errors import DeviceMismatchError, DTypeError, ShapeError
from ._moe_routing import SEALED, Routing, check_routing
from .common import check_tensor

__all__ = ["ACT_DTYPES", "check_act_dtype", "check_logits", "check_routing_of", "check_rows"]

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
