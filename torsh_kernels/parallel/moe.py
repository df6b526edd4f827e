"""Mixture-of-experts layers: :class:`MoELayer` on one process, :class:`ExpertParallelMoE` across ranks.

Both route with the fused ops of :mod:`torsh_kernels.ops.moe` (``moe_route`` -> ``moe_permute`` ->
experts -> ``moe_unpermute``) and hold the same parameters:

- ``router``: an ``nn.Linear(hidden, num_experts, bias=False)``;
- ``w_in`` ``[experts, hidden, ffn_hidden * (2 if swiglu else 1)]`` and ``w_out``
  ``[experts, ffn_hidden, hidden]``: the experts' two projections, stacked. ``swiglu`` (Mixtral's expert:
  ``w2(silu(w1 x) * w3 x)``, with ``w1`` and ``w3`` side by side in ``w_in``, ``w1`` first), ``gelu`` or
  ``relu``;
- with ``shared_experts=n`` (DeepSeek's shared experts, Qwen2-MoE's shared expert): ``shared_w_in``
  ``[hidden, S * (2 if swiglu else 1)]`` and ``shared_w_out`` ``[S, hidden]``, one dense MLP of width
  ``S = shared_ffn_hidden`` (default ``ffn_hidden * n``: n experts side by side are one MLP n times as wide)
  with the experts' activation, run on every token and added to the routed output; with
  ``shared_gate=True`` (Qwen2-MoE) its output is first multiplied by ``sigmoid(shared_expert_gate(x))``,
  ``shared_expert_gate`` an ``nn.Linear(hidden, 1, bias=False)``;
- with ``expert_bias=True`` (DeepSeek-V3's aux-loss-free balancing): ``balancer``, a
  :class:`~torsh_kernels.parallel.BiasBalancer` holding the fp32 ``[E]`` bias that ``moe_route`` adds to the
  scores for the selection only (``score_bias``) and the counts it balances by. In training mode (and with
  gradients enabled, as Megatron-Core) every forward adds ``routing.tokens_per_expert`` to the counts; call
  ``layer.update_expert_bias()`` **once per optimizer step**: ``bias += bias_update_rate * sign(mean - load)``.

``forward(x [..., hidden], *, sequence_lengths=None) -> y [..., hidden]``. The tokens form sequences, which
``capacity_scope="sequence"`` and ``load_balancing="seq_aux_loss"`` read: an input of three or more
dimensions ``[B, S, hidden]`` is B sequences of S tokens, a ``[T, hidden]`` input one sequence of T tokens,
unless ``sequence_lengths`` (ints, or an integer tensor, summing to the T tokens, sequences laid out one after
the other) says otherwise. The routing options (``score``, ``renormalize``, ``n_group`` / ``topk_group``,
``scaling``, ``capacity`` / ``capacity_factor`` with ``capacity_scope`` and ``drop_policy``,
``pad_to_capacity``) are :func:`~torsh_kernels.ops.moe_route`'s and mean what they mean there; each is passed
to it only when set.

The router's auxiliary losses of the last forward are in ``layer.aux_loss`` (``aux_loss_coef`` times the
load-balancing loss plus ``z_loss_coef`` times the z-loss; differentiable, add it to the training loss) and
the routing itself in ``layer.last_routing``. The load-balancing loss (``load_balancing``, Megatron-Core's
names): ``"aux_loss"`` the Switch/GShard loss over the call's tokens (``moe_aux_loss``, 1.0 when balanced),
``"seq_aux_loss"`` its mean over the sequences (DeepSeek-V3's sequence-wise loss, Megatron-Core's
``seq_aux_loss``: ``moe_aux_loss(groups=sequence lengths)``; sequences of no tokens are left out), ``"none"``
no load-balancing loss whatever ``aux_loss_coef`` says. With an expert bias or groups the loss counts each
token's K highest unbiased scores, as Megatron-Core does (``aux_loss_count="topk"``, the default), or the
biased, group-limited experts the layer routed by (``aux_loss_count="routed"``); the bias's update counts the
routed ones either way.

The experts run as one grouped GEMM per projection where torch's ``grouped_mm`` runs on the device and dtype
(probed once), else a loop over the experts; ``expert_compute="grouped"`` / ``"loop"`` forces one (see
:mod:`torsh_kernels.parallel.moe_experts`).

Expert parallelism (:class:`ExpertParallelMoE`): rank r holds experts ``[r * E/W, (r + 1) * E/W)``;
the router, the shared expert (and its gate) and the expert bias are replicated (broadcast from rank 0 at
construction). Each rank routes its own tokens, then

1. exchanges its per-expert row counts with every rank (one ``all_to_all`` of E integers); with
   ``pad_to_capacity`` every expert's group has ``capacity`` rows on every rank, so the splits are known
   without this exchange (the ranks agree on the capacity once per value instead, see below);
2. sends its permuted rows, already grouped by expert and so by destination rank, with one
   ``all_to_all`` of uneven splits (the *dispatch*);
3. runs its local experts on the rows it received, grouped by local expert;
4. sends the outputs back with the reverse ``all_to_all`` (the *combine*) and unpermutes them, and adds the
   shared expert's output computed on its own tokens.

The rows travel in the layer's dtype unless ``wire`` (an :class:`ExpertWireSpec`, see
:mod:`torsh_kernels.parallel.moe_wire`) compresses them: ``wire="fp8"`` dispatches e4m3 rows with a scale per 128
channels, quantized in the permute's pass, and combines in bf16; the quantization is straight-through.

Before the broadcast at construction, the ranks agree on the layer's configuration (E, k, H, the experts'
width, activation, score, renormalisation, the selection options, the capacity rule and padding, the shared
experts, the expert bias and its rate, the load-balancing loss, the wire formats, dtype, world size) with one
small all-gather
(:func:`~torsh_kernels.collectives.agreement.agree`), again at the first forward with an input of another
dtype and, with ``pad_to_capacity``, at the first forward with another capacity (with ``capacity_factor`` it
follows each rank's token count: ranks with different token counts raise instead of sending splits that do
not match); ranks configured differently all raise :class:`~torsh_kernels.errors.CollectiveMismatchError`
naming the difference instead of sending mismatched all-to-alls (``check_signatures=False`` or
``TORSH_KERNELS_CHECK_SIGNATURES=0``: off).

Backward runs the two ``all_to_all`` in reverse. Capacity, when set, applies to each rank's own tokens
(as in DeepSpeed and GShard: capacity per local batch). After backward, ``reduce_gradients()`` sums the
replicated parameters' gradients (router, shared expert, its gate) over the ranks (and divides every
gradient by W with ``average=True``, the convention of a loss averaged over ranks); the expert gradients
already hold every rank's contribution. The expert bias's counts are summed over ``bias_comm`` (default: the
layer's communicator) at ``update_expert_bias()``, so every rank moves its bias alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import live
from ..checks import check_choice
from ..collectives.agreement import agree_on, enabled
from ..collectives.communicator import Communicator, as_communicator
from ..errors import ArgumentTypeError, DTypeError, InvalidArgumentError, NonFiniteError, ShapeError
from ..ops import count_nonfinite
from ..ops.moe import (
    Routing,
    check_sequence_lengths,
    moe_aux_loss,
    moe_permute,
    moe_route,
    moe_unpermute,
    moe_z_loss,
)
from ..ops.moe.router import RouterSpec
from ..ops.registry import check_provider
from .buckets import NONFINITE
from .moe_balance import BiasBalancer
from .moe_experts import EXPERT_COMPUTE, activation, run_experts
from .moe_spec import ACTIVATIONS, LOAD_BALANCING, MoESpec
from .moe_wire import ExpertWireSpec, exchange, publish_step
from .pipeline import grad_scaler_in_use

__all__ = [
    "ACTIVATIONS",
    "LOAD_BALANCING",
    "BiasBalancer",
    "ExpertParallelMoE",
    "ExpertWireSpec",
    "MoELayer",
    "MoESpec",
]

_LAYER_FIELDS = frozenset(f.name for f in dataclasses.fields(MoESpec)) - {"route"}
_ROUTE_FIELDS = frozenset(f.name for f in dataclasses.fields(RouterSpec))


class _MoEBase(nn.Module):
    """Router, stacked expert weights, shared expert and the forward pipeline shared by both layers."""

    def __init__(
        self,
        spec: MoESpec,
        local_experts: int,
        first_expert: int,
        *,
        provider: str | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        bias_comm: Communicator | None,
        expert_compute: str,
        what: str,
    ) -> None:
        super().__init__()
        check_choice(expert_compute, what, "expert_compute", EXPERT_COMPUTE)
        if bias_comm is not None and not spec.expert_bias:
            raise InvalidArgumentError(
                f"{what}: bias_comm without an expert bias (it is the balancer's communicator); pass "
                "expert_bias=True, or leave bias_comm out"
            )
        check_provider(provider)
        self.spec = spec
        """What this layer is (:class:`~torsh_kernels.parallel.MoESpec`); its fields (and its route's) read as
        the layer's attributes: ``layer.k``, ``layer.score``, ``layer.hidden``..."""
        self.expert_compute = expert_compute
        """"auto" (grouped GEMM where it runs, else the loop), "grouped" or "loop"; may be changed at any time."""
        self.provider = provider
        self.local_experts, self.first_expert = local_experts, first_expert
        H, F, fk = spec.hidden, spec.ffn_hidden, dict(device=device, dtype=dtype)
        self.router = nn.Linear(H, spec.num_experts, bias=False, **fk)
        gated = spec.activation == "swiglu"
        self.w_in = nn.Parameter(torch.empty(local_experts, H, F * (2 if gated else 1), **fk))
        self.w_out = nn.Parameter(torch.empty(local_experts, F, H, **fk))
        if spec.shared_experts:
            S = spec.shared_ffn_hidden
            self.shared_w_in = nn.Parameter(torch.empty(H, S * (2 if gated else 1), **fk))
            self.shared_w_out = nn.Parameter(torch.empty(S, H, **fk))
        else:
            self.register_parameter("shared_w_in", None)
            self.register_parameter("shared_w_out", None)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False, **fk) if spec.shared_gate else None
        with torch.no_grad():  # nn.Linear's default: uniform(+-1/sqrt(fan_in))
            self.w_in.uniform_(-1 / math.sqrt(H), 1 / math.sqrt(H))
            self.w_out.uniform_(-1 / math.sqrt(F), 1 / math.sqrt(F))
            if spec.shared_experts:
                self.shared_w_in.uniform_(-1 / math.sqrt(H), 1 / math.sqrt(H))
                bound = 1 / math.sqrt(spec.shared_ffn_hidden)
                self.shared_w_out.uniform_(-bound, bound)
        self.balancer = None
        if spec.expert_bias:
            self.balancer = BiasBalancer(spec.num_experts, rate=spec.bias_update_rate, comm=bias_comm, device=device)
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def extra_repr(self) -> str:
        s = (
            f"hidden={self.hidden}, ffn_hidden={self.ffn_hidden}, experts={self.num_experts} "
            f"(here {self.first_expert}..{self.first_expert + self.local_experts - 1}), k={self.k}, "
            f"score={self.score}, activation={self.activation}"
        )
        if self.n_group is not None:
            s += f", groups={self.topk_group} of {self.n_group}"
        if self.scaling != 1.0:
            s += f", scaling={self.scaling}"
        cap = self.capacity if self.capacity is not None else self.capacity_factor
        if cap is not None:
            name = "capacity" if self.capacity is not None else "capacity_factor"
            pad = ", padded" if self.pad_to_capacity else ""
            s += f", {name}={cap} per {self.capacity_scope} ({self.drop_policy}{pad})"
        if self.shared_experts:
            gate = ", gated" if self.shared_expert_gate is not None else ""
            s += f", shared={self.shared_experts} (width {self.shared_ffn_hidden}{gate})"
        if self.expert_bias:
            s += f", expert_bias (rate {self.bias_update_rate})"
        return s

    def _replicated(self) -> list[nn.Parameter]:
        """The parameters every rank holds whole: the router, the shared expert and its gate."""
        ps = [self.router.weight]
        if self.shared_experts:
            ps += [self.shared_w_in, self.shared_w_out]
        if self.shared_expert_gate is not None:
            ps.append(self.shared_expert_gate.weight)
        return ps

    def update_expert_bias(self) -> torch.Tensor:
        """DeepSeek-V3's bias update (:meth:`BiasBalancer.step`) from the counts of the forwards since the last
        call; call it once per optimizer step (a collective when the balancer has a communicator: every rank
        calls it). Returns the load it balanced by ([E] int64)."""
        if self.balancer is None:
            raise InvalidArgumentError(
                f"{type(self).__name__}.update_expert_bias: the layer has no expert bias; build it with "
                "expert_bias=True"
            )
        return self.balancer.step()

    # -- forward pieces -----------------------------------------------------------------------------------

    def _sequences(self, x: torch.Tensor, T: int, lengths: object, what: str) -> tuple[int, ...] | None:
        """The tokens of each sequence (module docstring), or None for one sequence of all T tokens."""
        if lengths is None:
            if x.dim() >= 3 and T:
                S = x.shape[-2]
                return (S,) * (T // S)
            return None
        return check_sequence_lengths(lengths, T, what)  # (moe_route's check: one home)

    def _route(self, x: torch.Tensor, what: str, sequence_lengths: object) -> tuple[torch.Tensor, Routing]:
        if not isinstance(x, torch.Tensor):
            raise ArgumentTypeError(f"{what}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.spec.hidden:
            raise ShapeError(f"{what}: input must be [..., hidden={self.spec.hidden}], got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise DTypeError(f"{what}: input must be floating point (the layer's dtype, {self.router.weight.dtype}), "
                             f"got {x.dtype}")  # fmt: skip
        x2 = x.reshape(-1, self.spec.hidden)
        T = x2.shape[0]
        seqs = self._sequences(x, T, sequence_lengths, what)
        if self.spec.router_fp32 and x2.dtype != torch.float32:  # as DeepSeek-V3 and Megatron's fp32 router
            logits = F.linear(x2.float(), self.router.weight.float())  # [T, E], fp32
        else:
            logits = self.router(x2)  # [T, E]
        route = self.spec.route
        seq_lens = None
        if route.capacity_scope == "sequence":
            seq_lens = list(seqs) if seqs is not None else [T]
        bias = self.balancer.bias if self.balancer is not None else None
        r = moe_route(logits, route, score_bias=bias, sequence_lengths=seq_lens, provider=self.provider)
        if self.balancer is not None and self.training and torch.is_grad_enabled():
            self.balancer.observe(r.tokens_per_expert)
        aux = None
        if self.spec.aux_loss_coef and self.spec.load_balancing != "none":
            groups = None
            if self.spec.load_balancing == "seq_aux_loss" and seqs is not None:
                groups = [n for n in seqs if n] or None
            lb = moe_aux_loss(logits, r, groups=groups, count=self.spec.aux_loss_count)
            aux = self.spec.aux_loss_coef * lb
        if self.spec.z_loss_coef:
            z = self.spec.z_loss_coef * moe_z_loss(logits)
            aux = z if aux is None else aux + z
        self.aux_loss = aux if aux is not None else logits.new_zeros((), dtype=torch.float32)
        self.last_routing = r
        return x2, r

    def _experts(self, x: torch.Tensor, counts: torch.Tensor, host_counts: Sequence[int] | None = None) -> torch.Tensor:
        """Rows of x grouped by local expert (``counts[e]`` rows for expert e) through their experts."""
        return run_experts(x, counts, self.w_in, self.w_out, self.spec.activation, self.expert_compute,
                           type(self).__name__, host_counts)  # fmt: skip

    def _add_shared(self, y: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """y plus the shared expert's output on the tokens x2 (times its sigmoid gate), or y itself."""
        if not self.spec.shared_experts:
            return y
        s = activation(x2 @ self.shared_w_in, self.spec.activation) @ self.shared_w_out
        if self.shared_expert_gate is not None:
            s = torch.sigmoid(self.shared_expert_gate(x2)) * s
        return y + s


def _spec_field(name: str, in_route: bool) -> property:
    """A read-only attribute of the layer that reads its spec's field ``name`` (its route's, ``in_route``)."""

    def get(self: _MoEBase) -> Any:
        return getattr(self.spec.route if in_route else self.spec, name)

    def refuse(self: _MoEBase, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__}.{name} is part of the layer's spec, which is frozen (the weights' shapes and the "
            "ranks' agreement depend on it); build a layer from layer.spec.replace(...)"
        )

    return property(get, refuse, doc=f"``spec{'.route' if in_route else ''}.{name}``")


for _name in sorted(_LAYER_FIELDS):  # every field of the specs, read as the layer's attribute (layer.k, layer.score)
    setattr(_MoEBase, _name, _spec_field(_name, False))
for _name in sorted(_ROUTE_FIELDS):
    setattr(_MoEBase, _name, _spec_field(_name, True))


_LAYER_ARGS = """
    Args:
        hidden, ffn_hidden, num_experts, k: the layer's shape: model width H, each expert's inner width, E, and
            experts per token (or all of it in ``spec``).
        spec: a :class:`~torsh_kernels.parallel.MoESpec`: the shape, the routing (a
            :class:`~torsh_kernels.ops.RouterSpec`), the activation, the losses, the shared expert, the expert
            bias (see their fields).
        **options: the fields of MoESpec and of RouterSpec as keywords (``score="sigmoid"``,
            ``capacity_factor=1.25``, ``shared_experts=2``, ``expert_bias=True``...), which build the spec or
            refine ``spec``.
        provider: provider of the routing ops (None: automatic).
        device, dtype: of the parameters.
        bias_comm: the communicator the balancer sums the counts over (module docstring); only with
            ``expert_bias=True``.
        expert_compute: "auto", "grouped" or "loop" (module docstring).
"""


class MoELayer(_MoEBase):
    __doc__ = "A mixture-of-experts feed-forward layer on one process (all experts local).\n" + _LAYER_ARGS

    def __init__(
        self,
        hidden: int | None = None,
        ffn_hidden: int | None = None,
        num_experts: int | None = None,
        k: int | None = None,
        *,
        spec: MoESpec | None = None,
        provider: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        bias_comm: Communicator | None = None,
        expert_compute: str = "auto",
        **options: Any,
    ) -> None:
        spec = MoESpec.of((hidden, ffn_hidden, num_experts, k), spec, options, "MoELayer")
        super().__init__(spec, spec.num_experts, 0, provider=provider, device=device, dtype=dtype, bias_comm=bias_comm,
                         expert_compute=expert_compute, what="MoELayer")  # fmt: skip

    def forward(self, x: torch.Tensor, *, sequence_lengths: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        x2, r = self._route(x, "MoELayer", sequence_lengths)
        xp = moe_permute(x2, r, provider=self.provider)
        yp = self._experts(xp, r.rows_per_expert)
        y = moe_unpermute(yp, r, provider=self.provider)
        return self._add_shared(y, x2).view(x.shape)

    @classmethod
    def from_hf(cls, block: nn.Module, **overrides: Any) -> MoELayer:
        """A layer with the weights and routing of a Hugging Face MoE block: ``MixtralSparseMoeBlock``,
        ``Qwen2MoeSparseMoeBlock`` (with its gated shared expert), ``OlmoeSparseMoeBlock`` or ``DeepseekV3MoE``
        (sigmoid scores, the ``e_score_correction_bias`` as the expert bias, groups, routed scaling, shared
        experts). See :mod:`torsh_kernels.parallel.moe_hf`; ``overrides`` replace constructor arguments."""
        from .moe_hf import layer_from_hf

        return layer_from_hf(cls, block, overrides)


class ExpertParallelMoE(_MoEBase):
    __doc__ = (
        ":class:`MoELayer` with its experts spread over the ranks of ``comm`` (E/W per rank), tokens dispatched "
        "and combined with ``all_to_all``.\n"
        + _LAYER_ARGS
        + """        comm: the :class:`~torsh_kernels.collectives.Communicator` of the expert-parallel group, or its
            ``ProcessGroup``, ``DeviceMesh`` (``mesh_dim``: the expert-parallel dimension; a 1-D mesh needs
            none) or ``(mesh, dim)``.
        broadcast_router: copy rank 0's replicated weights (router, shared expert and gate, expert bias) to
            every rank at construction.
        check_signatures: agree with the other ranks on the configuration first (see the module docstring;
            None: on unless ``TORSH_KERNELS_CHECK_SIGNATURES=0``).
        bias_comm: None: the balancer sums the counts over ``comm``.
        wire: the rows' formats on the wire: None (the layer's dtype), a preset name ("fp8", "int8"...: the
            dispatch compressed, the combine in bf16) or an :class:`~torsh_kernels.parallel.ExpertWireSpec`.

    Every rank must call ``forward`` (and backward) the same number of times, in the same order, even
    with no tokens: the dispatch is a collective.
"""
    )

    def __init__(
        self,
        hidden: int | None = None,
        ffn_hidden: int | None = None,
        num_experts: int | None = None,
        k: int | None = None,
        comm: Communicator | None = None,
        *,
        spec: MoESpec | None = None,
        provider: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        broadcast_router: bool = True,
        mesh_dim: str | int | None = None,
        check_signatures: bool | None = None,
        bias_comm: Communicator | None = None,
        expert_compute: str = "auto",
        wire: ExpertWireSpec | str | None = None,
        **options: Any,
    ) -> None:
        what = "ExpertParallelMoE"
        wire = ExpertWireSpec.of(wire, what)
        check = enabled(check_signatures, what)
        if comm is None:
            raise ArgumentTypeError(f"{what}: comm is required: the expert-parallel group's Communicator, "
                                    "ProcessGroup or DeviceMesh")  # fmt: skip
        comm = as_communicator(
            comm, what, dim=mesh_dim, needs=("rank", "world_size", "all_to_all", "broadcast", "all_reduce")
        )
        spec = MoESpec.of((hidden, ffn_hidden, num_experts, k), spec, options, what)
        W, E = comm.world_size, spec.num_experts
        if E % W:
            raise InvalidArgumentError(
                f"{what}: num_experts={E} is not divisible by the world size {W}; every rank holds E/W experts, so "
                f"choose E as a multiple of {W}"
            )
        El = E // W
        if bias_comm is None and spec.expert_bias:
            bias_comm = comm
        super().__init__(spec, El, comm.rank * El, provider=provider, device=device, dtype=dtype, bias_comm=bias_comm,
                         expert_compute=expert_compute, what=what)  # fmt: skip
        self.comm, self.wire = comm, wire
        self.last_dispatch: dict[str, object] = {}
        self.check_signatures = check
        self._agreed: set[object] = set()
        self._agree(self.w_in.dtype)
        self._nonfinite: str | None = None  # reduce_gradients(nonfinite="auto"), resolved at the first call
        if broadcast_router and W > 1:
            self._broadcast_replicated()

    @torch.no_grad()
    def _broadcast_replicated(self) -> None:
        """Rank 0's router, shared expert, gate and expert bias to every rank: one broadcast per dtype."""
        ts = [p.data for p in self._replicated()]
        if self.balancer is not None:
            ts.append(self.balancer.bias)
        for dtype in dict.fromkeys(t.dtype for t in ts):
            group = [t for t in ts if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for t in group])
            self.comm.broadcast(flat, 0)
            for t, v in zip(group, torch.split(flat, [t.numel() for t in group])):
                t.copy_(v.view_as(t))

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.wire.plain else f", wire=({self.wire})")

    @classmethod
    def from_layer(cls, layer: MoELayer, comm: Communicator, **kwargs: object) -> ExpertParallelMoE:
        """The expert-parallel layer holding ``layer``'s replicated weights (router, shared expert, gate, expert
        bias and its pending counts) and this rank's slice of its experts, with its options."""
        if not isinstance(layer, MoELayer):
            raise ArgumentTypeError(
                f"ExpertParallelMoE.from_layer: layer must be a MoELayer, got {type(layer).__name__}"
            )
        w = layer.w_in
        options = {"provider": layer.provider, "device": w.device, "dtype": w.dtype, "broadcast_router": False,
                   "expert_compute": layer.expert_compute, **kwargs}  # fmt: skip
        ep = cls(comm=comm, spec=layer.spec, **options)
        lo, hi = ep.first_expert, ep.first_expert + ep.local_experts
        with torch.no_grad():
            for mine, theirs in zip(ep._replicated(), layer._replicated()):
                mine.copy_(theirs)
            ep.w_in.copy_(layer.w_in[lo:hi])
            ep.w_out.copy_(layer.w_out[lo:hi])
            if ep.balancer is not None and layer.balancer is not None:
                ep.balancer.bias.copy_(layer.balancer.bias)
                ep.balancer.load.copy_(layer.balancer.load)
        return ep

    def _agree(self, dtype: torch.dtype) -> None:
        """The configuration and the dtype of the rows dispatched, agreed once per dtype (module docstring)."""
        if not self.check_signatures or dtype in self._agreed:
            return
        fix = "Construct the layer with the same arguments on every rank and give it inputs of one dtype."
        agree_on(
            self.comm,
            "an expert-parallel MoE layer",
            specs={"layer": self.spec, "wire": self.wire},
            extra=[("parameter dtype", self.w_in.dtype), ("dtype", dtype)],
            what="ExpertParallelMoE",
            fix=fix,
        )
        self._agreed.add(dtype)

    def _agree_capacity(self, capacity: int) -> None:
        """With padding the splits are every rank's capacity times E/W: agreed once per capacity value."""
        key = ("padded capacity", capacity)
        if not self.check_signatures or key in self._agreed:
            return
        fix = (
            "With pad_to_capacity every rank sends capacity rows per expert: give every rank the same number of "
            "tokens (capacity_factor scales with it) or a fixed capacity."
        )
        agree_on(self.comm, "an expert-parallel MoE layer's padded capacity", extra=[("padded capacity", capacity)],
              what="ExpertParallelMoE", fix=fix)  # fmt: skip
        self._agreed.add(key)

    def forward(self, x: torch.Tensor, *, sequence_lengths: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        if live.publisher is not None:
            publish_step(self, live.publisher)
        x2, r = self._route(x, "ExpertParallelMoE", sequence_lengths)
        if x2.dtype not in self._agreed:
            self._agree(x2.dtype)
        yp = exchange(self, x2, r)  # dispatch, local experts, combine (moe_wire)
        y = moe_unpermute(yp, r, provider=self.provider)
        return self._add_shared(y, x2).view(x.shape)

    @torch.no_grad()
    def reduce_gradients(self, *, average: bool = False, nonfinite: str = "auto") -> None:
        """Sum the replicated parameters' gradients (router, shared expert, its gate) over the ranks; with
        ``average``, divide every gradient by W.

        The all-reduce also carries whether any rank's gradients (replicated or experts) hold NaN/Inf (rows a
        rank sent in the dispatch or combine spread them to the experts and tokens of others), so every
        rank learns it at once. ``nonfinite="raise"``: every rank then raises ``NonFiniteError``, no
        gradient changed; ``"propagate"``: the replicated gradients are NaN on every rank, so that every rank's
        ``GradScaler`` skips the step alike; ``"auto"`` (default): "propagate" when the process holds an
        enabled ``torch.amp.GradScaler``, else "raise" (as the DDP hook's ``nonfinite``)."""
        what = "ExpertParallelMoE.reduce_gradients"
        if nonfinite not in NONFINITE:
            raise InvalidArgumentError(f"{what}: nonfinite must be one of {NONFINITE}, got {nonfinite!r}")
        W = self.comm.world_size
        if W > 1:  # every rank joins, also one whose replicated parameters got no gradient
            ps = self._replicated()
            for p in ps:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if nonfinite == "auto":
                if self._nonfinite is None:
                    self._nonfinite = "propagate" if grad_scaler_in_use() else "raise"
                nonfinite = self._nonfinite
            grads = [p.grad for p in ps]
            n = sum(g.numel() for g in grads)
            buf = torch.empty(n + 1, dtype=grads[0].dtype, device=grads[0].device)
            torch.cat([g.reshape(-1) for g in grads], out=buf[:-1])
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
            for g, v in zip(grads, torch.split(buf[:-1], [g.numel() for g in grads])):
                g.copy_(v.view_as(g))
        if average and W > 1:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.div_(W)
