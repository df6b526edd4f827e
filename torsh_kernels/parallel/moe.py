"""Mixture-of-experts layers: :class:`MoELayer` on one process, :class:`ExpertParallelMoE` across ranks.

Both route with the fused ops of :mod:`torsh_kernels.ops.moe` (``moe_route`` -> ``moe_permute`` ->
experts -> ``moe_unpermute``) and hold the same parameters:

- ``router``: an ``nn.Linear(hidden, num_experts, bias=False)``;
- ``w_in`` ``[experts, hidden, ffn_hidden * (2 if swiglu else 1)]`` and ``w_out``
  ``[experts, ffn_hidden, hidden]``: the experts' two projections, stacked. ``swiglu`` (Mixtral's expert:
  ``w2(silu(w1 x) * w3 x)``, with ``w1`` and ``w3`` side by side in ``w_in``), ``gelu`` or ``relu``.

``forward(x [..., hidden]) -> y [..., hidden]``. The router's auxiliary losses of the last forward are in
``layer.aux_loss`` (``aux_loss_coef * load-balancing loss + z_loss_coef * z-loss``, differentiable; add it
to the training loss) and the routing itself in ``layer.last_routing``.

Expert parallelism (:class:`ExpertParallelMoE`): rank r holds experts ``[r * E/W, (r + 1) * E/W)``;
the router is replicated (broadcast from rank 0 at construction). Each rank routes its own tokens, then

1. exchanges its per-expert row counts with every rank (one ``all_to_all`` of E integers);
2. sends its permuted rows, already grouped by expert and so by destination rank, with one
   ``all_to_all`` of uneven splits (the *dispatch*);
3. runs its local experts on the rows it received, grouped by local expert;
4. sends the outputs back with the reverse ``all_to_all`` (the *combine*) and unpermutes them.

Backward runs the two ``all_to_all`` in reverse. Capacity, when set, applies to each rank's own tokens
(as in DeepSpeed and GShard: capacity per local batch). After backward, ``reduce_gradients()`` sums the
replicated router's gradients over the ranks (and divides every gradient by W with ``average=True``, the
convention of a loss averaged over ranks); the expert gradients already hold every rank's contribution.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..collectives.communicator import Communicator, as_communicator
from ..errors import ArgumentTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from ..ops import count_nonfinite
from ..ops.moe import (
    DROP_POLICIES,
    SCORES,
    Routing,
    _check_choice,
    check_capacity_factor,
    moe_aux_loss,
    moe_permute,
    moe_route,
    moe_unpermute,
    moe_z_loss,
)
from ._engine import NONFINITE, grad_scaler_in_use

__all__ = ["ACTIVATIONS", "ExpertParallelMoE", "MoELayer"]

ACTIVATIONS = ("swiglu", "gelu", "relu")


def _check_pos_int(v: object, what: str, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ArgumentTypeError(f"{what}: {name} must be an int, got {type(v).__name__} {v!r}")
    if v < 1:
        raise InvalidArgumentError(f"{what}: {name}={v} must be >= 1")
    return v


class _MoEBase(nn.Module):
    """Router, stacked expert weights and the forward pipeline shared by both layers."""

    def __init__(
        self,
        what: str,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        k: int,
        local_experts: int,
        first_expert: int,
        *,
        score: str,
        renormalize: bool,
        capacity_factor: float | None,
        drop_policy: str,
        activation: str,
        aux_loss_coef: float,
        z_loss_coef: float,
        provider: str | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.hidden = _check_pos_int(hidden, what, "hidden")
        self.ffn_hidden = _check_pos_int(ffn_hidden, what, "ffn_hidden")
        self.num_experts = _check_pos_int(num_experts, what, "num_experts")
        self.k = _check_pos_int(k, what, "k")
        if k > num_experts:
            raise InvalidArgumentError(f"{what}: k={k} exceeds num_experts={num_experts}")
        _check_choice(score, what, "score", SCORES)
        _check_choice(drop_policy, what, "drop_policy", DROP_POLICIES)
        _check_choice(activation, what, "activation", ACTIVATIONS)
        capacity_factor = check_capacity_factor(capacity_factor, what)
        for name, v in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise InvalidArgumentError(f"{what}: {name}={v!r} must be a finite number >= 0")
        self.score, self.renormalize = score, bool(renormalize)
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
        self.activation = activation
        self.aux_loss_coef, self.z_loss_coef = float(aux_loss_coef), float(z_loss_coef)
        self.provider = provider
        self.local_experts, self.first_expert = local_experts, first_expert
        fk = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden, num_experts, bias=False, **fk)
        width = ffn_hidden * (2 if activation == "swiglu" else 1)
        self.w_in = nn.Parameter(torch.empty(local_experts, hidden, width, **fk))
        self.w_out = nn.Parameter(torch.empty(local_experts, ffn_hidden, hidden, **fk))
        with torch.no_grad():  # nn.Linear's default: uniform(+-1/sqrt(fan_in))
            self.w_in.uniform_(-1 / math.sqrt(hidden), 1 / math.sqrt(hidden))
            self.w_out.uniform_(-1 / math.sqrt(ffn_hidden), 1 / math.sqrt(ffn_hidden))
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def extra_repr(self) -> str:
        cap = "" if self.capacity_factor is None else f", capacity_factor={self.capacity_factor} ({self.drop_policy})"
        return (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, experts={self.num_experts} "
            f"(here {self.first_expert}..{self.first_expert + self.local_experts - 1}), k={self.k}, "
            f"score={self.score}, activation={self.activation}{cap}"
        )

    def _experts(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Rows of x grouped by local expert (``counts[e]`` rows for expert e) through their experts."""
        outs = []
        for e, chunk in enumerate(torch.split(x, list(counts))):
            h = chunk @ self.w_in[e]
            if self.activation == "swiglu":
                gate, up = h.chunk(2, dim=-1)
                h = F.silu(gate) * up
            elif self.activation == "gelu":
                h = F.gelu(h)
            else:
                h = F.relu(h)
            outs.append(h @ self.w_out[e])
        return torch.cat(outs) if outs else x.new_empty(0, self.hidden)

    def _route(self, x: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor, Routing]:
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"{what}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden:
            raise ShapeError(f"{what}: input must be [..., hidden={self.hidden}], got shape {tuple(x.shape)}")
        x2 = x.reshape(-1, self.hidden)
        logits = self.router(x2)  # [T, E]
        r = moe_route(
            logits, k=self.k, score=self.score, renormalize=self.renormalize,
            capacity_factor=self.capacity_factor, drop_policy=self.drop_policy, provider=self.provider,
        )  # fmt: skip
        aux = None
        if self.aux_loss_coef:
            aux = self.aux_loss_coef * moe_aux_loss(logits, r)
        if self.z_loss_coef:
            z = self.z_loss_coef * moe_z_loss(logits)
            aux = z if aux is None else aux + z
        self.aux_loss = aux if aux is not None else logits.new_zeros((), dtype=torch.float32)
        self.last_routing = r
        return x2, logits, r


class MoELayer(_MoEBase):
    """A mixture-of-experts feed-forward layer on one process (all experts local).

    Args:
        hidden: model width H.
        ffn_hidden: each expert's inner width.
        num_experts: E.
        k: experts per token.
        score, renormalize, capacity_factor, drop_policy: as :func:`~torsh_kernels.ops.moe_route`.
        activation: "swiglu" (default, Mixtral), "gelu" or "relu".
        aux_loss_coef: weight of the load-balancing loss in ``aux_loss`` (0.01 is common).
        z_loss_coef: weight of the router z-loss in ``aux_loss`` (ST-MoE uses 0.001).
        provider: provider of the routing ops (None: automatic).
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        k: int,
        *,
        score: str = "softmax",
        renormalize: bool = True,
        capacity_factor: float | None = None,
        drop_policy: str = "probability",
        activation: str = "swiglu",
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        provider: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            "MoELayer", hidden, ffn_hidden, num_experts, k, num_experts, 0, score=score, renormalize=renormalize,
            capacity_factor=capacity_factor, drop_policy=drop_policy, activation=activation,
            aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, provider=provider, device=device, dtype=dtype,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, _, r = self._route(x, "MoELayer")
        xp = moe_permute(x2, r, provider=self.provider)
        yp = self._experts(xp, r.tokens_per_expert.tolist())
        return moe_unpermute(yp, r, provider=self.provider).view(x.shape)


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks in ``in_splits`` order; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x, comm, out_splits, in_splits):
        ctx.comm, ctx.out_splits, ctx.in_splits = comm, out_splits, in_splits
        out = x.new_empty(sum(out_splits), x.shape[1])
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g):
        gi = g.new_empty(sum(ctx.in_splits), g.shape[1])
        ctx.comm.all_to_all(gi, g.contiguous(), ctx.in_splits, ctx.out_splits)
        return gi, None, None, None


class ExpertParallelMoE(_MoEBase):
    """:class:`MoELayer` with its experts spread over the ranks of ``comm`` (E/W per rank), tokens
    dispatched and combined with ``all_to_all``. Arguments as :class:`MoELayer`, plus:

    Args:
        comm: the :class:`~torsh_kernels.collectives.Communicator` of the expert-parallel group, or its
            ``ProcessGroup``, ``DeviceMesh`` (``mesh_dim``: the expert-parallel dimension; a 1-D mesh needs
            none) or ``(mesh, dim)``.
        broadcast_router: copy rank 0's router weights to every rank at construction.

    Every rank must call ``forward`` (and backward) the same number of times, in the same order, even
    with no tokens: the dispatch is a collective.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        k: int,
        comm: Communicator,
        *,
        score: str = "softmax",
        renormalize: bool = True,
        capacity_factor: float | None = None,
        drop_policy: str = "probability",
        activation: str = "swiglu",
        aux_loss_coef: float = 0.01,
        z_loss_coef: float = 0.0,
        provider: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        broadcast_router: bool = True,
        mesh_dim: str | int | None = None,
    ) -> None:
        what = "ExpertParallelMoE"
        comm = as_communicator(
            comm, what, dim=mesh_dim, needs=("rank", "world_size", "all_to_all", "broadcast", "all_reduce")
        )
        W = comm.world_size
        _check_pos_int(num_experts, what, "num_experts")
        if num_experts % W:
            raise InvalidArgumentError(
                f"{what}: num_experts={num_experts} is not divisible by the world size {W}; every rank holds "
                f"E/W experts, so choose E as a multiple of {W}"
            )
        El = num_experts // W
        super().__init__(
            what, hidden, ffn_hidden, num_experts, k, El, comm.rank * El, score=score, renormalize=renormalize,
            capacity_factor=capacity_factor, drop_policy=drop_policy, activation=activation,
            aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, provider=provider, device=device, dtype=dtype,
        )  # fmt: skip
        self.comm = comm
        self.last_dispatch: dict[str, object] = {}
        self._nonfinite: str | None = None  # reduce_gradients(nonfinite="auto"), resolved at the first call
        if broadcast_router and W > 1:
            with torch.no_grad():
                comm.broadcast(self.router.weight.data, 0)

    @classmethod
    def from_layer(cls, layer: MoELayer, comm: Communicator, **kwargs: object) -> ExpertParallelMoE:
        """The expert-parallel layer holding ``layer``'s router and this rank's slice of its experts."""
        if not isinstance(layer, MoELayer):
            raise ArgumentTypeError(
                f"ExpertParallelMoE.from_layer: layer must be a MoELayer, got {type(layer).__name__}"
            )
        w = layer.w_in
        ep = cls(
            layer.hidden, layer.ffn_hidden, layer.num_experts, layer.k, comm, score=layer.score,
            renormalize=layer.renormalize, capacity_factor=layer.capacity_factor, drop_policy=layer.drop_policy,
            activation=layer.activation, aux_loss_coef=layer.aux_loss_coef, z_loss_coef=layer.z_loss_coef,
            provider=layer.provider, device=w.device, dtype=w.dtype, broadcast_router=False, **kwargs,
        )  # fmt: skip
        lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
        with torch.no_grad():
            ep.router.weight.copy_(layer.router.weight)
            ep.w_in.copy_(layer.w_in[lo:hi])
            ep.w_out.copy_(layer.w_out[lo:hi])
        return ep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        W, El = self.comm.world_size, self.local_experts
        x2, _, r = self._route(x, "ExpertParallelMoE")
        xp = moe_permute(x2, r, provider=self.provider)  # [N, H], grouped by expert = by destination rank
        counts = r.tokens_per_expert  # [E]
        recv_counts = torch.empty_like(counts)
        self.comm.all_to_all(recv_counts, counts)  # recv_counts[src * El + e]: rows src sends my expert e
        send_splits = counts.view(W, El).sum(1).tolist()
        rc = recv_counts.view(W, El)
        recv_splits = rc.sum(1).tolist()
        xr = _AllToAll.apply(xp, self.comm, recv_splits, send_splits)  # [sum recv, H]: by source, then expert
        if W > 1 and El > 1:  # regroup by local expert: (expert 0: src 0, src 1, ...), (expert 1: ...), ...
            sizes = rc.reshape(-1).tolist()  # chunk (src, e) is sizes[src * El + e] rows of xr
            starts = [0, *itertools.accumulate(sizes)]
            chunks = [src * El + e for e in range(El) for src in range(W)]
            idx = torch.cat([torch.arange(starts[c], starts[c] + sizes[c]) for c in chunks]).to(xr.device)
            ye = self._experts(xr.index_select(0, idx), rc.sum(0).tolist())
            yr = ye.index_select(0, torch.argsort(idx))
        else:
            yr = self._experts(xr, rc.sum(0).tolist())
        yp = _AllToAll.apply(yr, self.comm, send_splits, recv_splits)
        self.last_dispatch = {
            "sent_rows": send_splits, "received_rows": recv_splits, "dropped": r.num_dropped,
            "bytes_sent": 2 * (sum(send_splits) - send_splits[self.comm.rank]) * self.hidden * x.element_size(),
        }  # fmt: skip
        return moe_unpermute(yp, r, provider=self.provider).view(x.shape)

    @torch.no_grad()
    def reduce_gradients(self, *, average: bool = False, nonfinite: str = "auto") -> None:
        """Sum the router's gradients over the ranks; with ``average``, divide every gradient by W.

        The all-reduce also carries whether any rank's gradients (router or experts) hold NaN/Inf (rows a
        rank sent in the dispatch or combine spread them to the experts and tokens of others), so every
        rank learns it at once. ``nonfinite="raise"``: every rank then raises ``NonFiniteError``, no
        gradient changed; ``"propagate"``: the router's gradient is NaN on every rank, so that every rank's
        ``GradScaler`` skips the step alike; ``"auto"`` (default): "propagate" when the process holds an
        enabled ``torch.amp.GradScaler``, else "raise" (as the DDP hook's ``nonfinite``)."""
        what = "ExpertParallelMoE.reduce_gradients"
        if nonfinite not in NONFINITE:
            raise InvalidArgumentError(f"{what}: nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        W = self.comm.world_size
        w = self.router.weight
        if W > 1:  # every rank joins, also one whose router got no gradient
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            if nonfinite == "auto":
                if self._nonfinite is None:
                    self._nonfinite = "propagate" if grad_scaler_in_use() else "raise"
                nonfinite = self._nonfinite
            g = w.grad
            buf = torch.empty(g.numel() + 1, dtype=g.dtype, device=g.device)
            buf[:-1] = g.reshape(-1)
            buf[-1] = float(any(int(count_nonfinite(p.grad)) for p in self.parameters() if p.grad is not None))
            self.comm.all_reduce(buf)
            if buf[-1].item() > 0 or int(count_nonfinite(buf)):  # the same sum on every rank
                if nonfinite == "raise":
                    raise NonFiniteError(
                        f"{what}: some rank's gradients (or its part of this all-reduce) hold NaN/Inf; every rank "
                        "raises this and no gradient was changed. Skip the step (zero_grad), or train with a "
                        "GradScaler and nonfinite='propagate'"
                    )
                buf[:-1] = float("nan")
            g.copy_(buf[:-1].view_as(g))
        if average and W > 1:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.div_(W)
