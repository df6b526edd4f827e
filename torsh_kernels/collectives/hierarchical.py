"""Hierarchical all-reduce: reduce-scatter inside each node, all-reduce across nodes, all-gather inside.

Ranks are numbered node-major, as torchrun numbers them (``rank = node * local_size + local_rank``):
node ``g`` holds ranks ``[g * local_size, (g + 1) * local_size)``. Each rank sends
``2 (L - 1) / L * n`` bytes over the fast intra-node links and only ``2 (N - 1) / N * n / L`` over the
slow inter-node ones (L ranks per node, N nodes), where a flat ring sends ``2 (p - 1) / p * n`` over
the slowest link it crosses.

The result equals a flat all-reduce's up to floating-point summation order (bit for bit where the sum
is exact, e.g. integers or integer-valued floats).
"""

from __future__ import annotations

import torch

from .. import recording
from ..errors import ArgumentTypeError, InvalidArgumentError, ShapeError
from .protocol import Communicator

__all__ = ["hierarchical_all_reduce", "node_groups"]

# (comm, local_size) -> (comm, intra, inter); the comm is kept so its id is not reused while cached
_GROUPS: dict[tuple[int, int], tuple[Communicator, Communicator, Communicator]] = {}


def node_groups(comm: Communicator, local_size: int) -> tuple[Communicator, Communicator]:
    """(intra-node, inter-node) communicators of this rank for ``local_size`` ranks per node, created
    once per communicator (every rank of ``comm`` must make the first call, in the same order)."""
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        raise InvalidArgumentError(f"hierarchical_all_reduce: local_size must be an int >= 1, got {local_size!r}")
    ws = comm.world_size
    if ws % local_size:
        raise InvalidArgumentError(
            f"hierarchical_all_reduce: world_size={ws} is not a multiple of local_size={local_size}; every node "
            "must hold the same number of ranks"
        )
    key = (id(comm), local_size)
    hit = _GROUPS.get(key)
    if hit is not None and hit[0] is comm:
        return hit[1], hit[2]
    nodes = ws // local_size
    intra = comm.split([list(range(g * local_size, (g + 1) * local_size)) for g in range(nodes)])
    inter = comm.split([list(range(i, ws, local_size)) for i in range(local_size)])
    _GROUPS[key] = (comm, intra, inter)
    return intra, inter


def hierarchical_all_reduce(
    tensor: torch.Tensor, comm: Communicator, local_size: int, *, op: str = "sum"
) -> torch.Tensor:
    """In-place all-reduce of ``tensor`` (``op`` "sum" or "avg") in three steps over node groups of
    ``local_size`` ranks; returns ``tensor``."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"hierarchical_all_reduce: expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in ("sum", "avg"):
        raise InvalidArgumentError(f"hierarchical_all_reduce: op must be 'sum' or 'avg', got {op!r}")
    if not tensor.is_contiguous():
        raise ShapeError("hierarchical_all_reduce: the tensor must be contiguous (the result is written in place)")
    if op == "avg" and not tensor.is_floating_point():
        raise InvalidArgumentError(
            f"hierarchical_all_reduce: op='avg' needs a floating-point tensor, got {tensor.dtype}"
        )
    intra, inter = node_groups(comm, local_size)
    with recording.span("hierarchical_all_reduce", "issue", {"algorithm": "hierarchical", "local_size": local_size}):
        return _hierarchical(tensor, comm, intra, inter, op)


def _hierarchical(tensor: torch.Tensor, comm: Communicator, intra: Communicator, inter: Communicator,
                  op: str) -> torch.Tensor:  # fmt: skip
    if intra.world_size == 1 or inter.world_size == 1:  # one rank per node, or one node: a flat all-reduce
        comm.all_reduce(tensor, op)
        return tensor
    flat = tensor.view(-1)
    n = flat.numel()
    L = intra.world_size
    shard = -(-n // L)
    if n % L:  # pad to L equal shards
        buf = torch.zeros(L * shard, dtype=tensor.dtype, device=tensor.device)
        buf[:n].copy_(flat)
    else:
        buf = flat
    part = torch.empty(shard, dtype=tensor.dtype, device=tensor.device)
    intra.reduce_scatter(part, buf)
    inter.all_reduce(part)
    if op == "avg":
        part.div_(comm.world_size)
    intra.all_gather(buf, part)
    if buf is not flat:
        flat.copy_(buf[:n])
    return tensor
