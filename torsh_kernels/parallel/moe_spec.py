"""What an MoE layer is: :class:`MoESpec`, one validated value that :class:`~torsh_kernels.parallel.MoELayer` and
:class:`~torsh_kernels.parallel.ExpertParallelMoE` are built from, and that expert-parallel ranks agree on.

It holds the layer's shape (hidden, ffn_hidden, num_experts), its routing (a
:class:`~torsh_kernels.ops.RouterSpec`: k, scores, groups, scaling, capacity, padding), its experts'
activation, the shared expert, the balancing (losses or DeepSeek-V3's expert bias). What is not the layer's
definition stays a constructor argument: the kernel provider, device and dtype, the balancer's communicator,
how the experts are computed (grouped GEMM or a loop)::

    spec = MoESpec(hidden=1024, ffn_hidden=512, num_experts=64, route=RouterSpec(k=6, score="sigmoid"),
                   shared_experts=2, expert_bias=True)
    layer = MoELayer(spec=spec)
    layer = MoELayer(1024, 512, 64, 6, score="sigmoid", shared_experts=2, expert_bias=True)   # the same
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..checks import check_bool, check_choice, check_int, check_number
from ..errors import ArgumentTypeError, InvalidArgumentError
from ..ops.moe.reference import AUX_COUNTS
from ..ops.moe.router import RouterSpec
from ..specs import Spec
from .moe_balance import check_rate

__all__ = ["ACTIVATIONS", "LOAD_BALANCING", "MAX_EXPERTS", "MAX_EXPERT_ELEMENTS", "MAX_WIDTH", "MoESpec"]

ACTIVATIONS = ("swiglu", "gelu", "relu")
"""``MoESpec.activation``: the experts' (and the shared expert's) activation."""
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
"""``MoESpec.load_balancing``: the balancing loss in ``aux_loss`` (per call or per sequence), or none."""


MAX_EXPERTS = 1 << 20
"""The most experts a layer takes (the config importer's bound too). The largest MoE layers in use have a few
hundred (DeepSeek-V3: 256); the router's scores are [tokens, E] and every step keeps per-expert counts and
offsets, so 2**40 experts (a typo) would fail at the first forward with an allocation of terabytes. 2**20 leaves a
factor of 4096 of room."""
MAX_WIDTH = (1 << 31) - 1
"""The widest hidden or expert layer (an int32 count of columns)."""
MAX_EXPERT_ELEMENTS = 1 << 50
"""The most elements the experts' weights may hold (past this a size product overflows before allocation)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MoESpec(Spec):
    """A mixture-of-experts feed-forward layer (see the module docstring)."""

    hidden: int
    """Model width H."""
    ffn_hidden: int
    """Each expert's inner width."""
    num_experts: int
    """E."""
    route: RouterSpec
    """How tokens are routed (``k`` among them): :func:`~torsh_kernels.ops.moe_route`'s spec."""
    activation: str = "swiglu"
    """"swiglu" (Mixtral), "gelu" or "relu"; the shared expert's too."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in ``aux_loss``."""
    z_loss_coef: float = 0.0
    """Weight of the router z-loss in ``aux_loss`` (ST-MoE uses 0.001)."""
    load_balancing: str = "aux_loss"
    """"aux_loss", "seq_aux_loss" (per sequence) or "none"."""
    aux_loss_count: str = "topk"
    """Which selection the load-balancing loss counts with an expert bias or groups (``moe_aux_loss``'s
    ``count``): "topk" (Megatron-Core's rule: each token's K highest unbiased scores) or "routed" (the biased,
    group-limited choices the layer routed by)."""
    shared_experts: int = 0
    """Shared experts (DeepSeek; 0: none): one MLP of width ``shared_ffn_hidden`` run on every token."""
    shared_ffn_hidden: int | None = None
    """The shared MLP's width; None: ``ffn_hidden * shared_experts`` (stored resolved)."""
    shared_gate: bool = False
    """Multiply the shared output by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE)."""
    expert_bias: bool = False
    """DeepSeek-V3's aux-loss-free balancing: a ``BiasBalancer`` whose bias is ``moe_route``'s ``score_bias``."""
    bias_update_rate: float = 1e-3
    """The balancer's step."""
    router_fp32: bool = False
    """Compute the router's logits in fp32 (the input and the router weight cast up), as Hugging Face's
    DeepSeek-V3 and Megatron-Core's ``moe_router_dtype="fp32"`` do; False: in the layer's dtype (the scores and
    weights are fp32 either way). In bf16 a few tokens in ten thousand otherwise choose other experts."""

    def __post_init__(self) -> None:
        what = "MoESpec"
        for name, hi in (("hidden", MAX_WIDTH), ("ffn_hidden", MAX_WIDTH), ("num_experts", MAX_EXPERTS)):
            self.normalize(name, check_int(getattr(self, name), what, name, 1, hi))
        if (n := 3 * self.num_experts * self.hidden * self.ffn_hidden) > MAX_EXPERT_ELEMENTS:
            raise InvalidArgumentError(
                f"{what}: the experts' weights would hold {n:.3g} elements (3 x num_experts x hidden x ffn_hidden), "
                f"more than {MAX_EXPERT_ELEMENTS:.3g} (8 PiB in fp64); check the sizes"
            )
        if not isinstance(self.route, RouterSpec):
            raise ArgumentTypeError(f"{what}: route must be a RouterSpec, got {type(self.route).__name__}")
        if self.route.k > self.num_experts:
            raise InvalidArgumentError(f"{what}: k={self.route.k} exceeds num_experts={self.num_experts}")
        self.route.selection(self.num_experts, what)  # the routing options that depend on E
        check_choice(self.activation, what, "activation", ACTIVATIONS)
        for name in ("aux_loss_coef", "z_loss_coef"):
            self.normalize(name, check_number(getattr(self, name), what, name, lo=0.0))
        check_choice(self.load_balancing, what, "load_balancing", LOAD_BALANCING)
        check_choice(self.aux_loss_count, what, "aux_loss_count", AUX_COUNTS)
        self.normalize("shared_experts", check_int(self.shared_experts, what, "shared_experts", 0))
        check_bool(self.shared_gate, what, "shared_gate")
        check_bool(self.expert_bias, what, "expert_bias")
        check_bool(self.router_fp32, what, "router_fp32")
        if self.shared_ffn_hidden is not None:
            self.normalize("shared_ffn_hidden", check_int(self.shared_ffn_hidden, what, "shared_ffn_hidden", 1))
        if not self.shared_experts and (self.shared_ffn_hidden is not None or self.shared_gate):
            given = "shared_ffn_hidden" if self.shared_ffn_hidden is not None else "shared_gate=True"
            raise InvalidArgumentError(
                f"{what}: {given} without shared experts; pass shared_experts=1 (or more) to add a shared expert"
            )
        if self.shared_experts and self.shared_ffn_hidden is None:
            self.normalize("shared_ffn_hidden", self.ffn_hidden * self.shared_experts)
        self.normalize("bias_update_rate", check_rate(self.bias_update_rate, what, "bias_update_rate"))

    @classmethod
    def of(
        cls, shape: tuple[object, object, object, object], spec: object, options: Mapping[str, Any], what: str
    ) -> MoESpec:
        """The spec a layer is built from: ``spec`` (or, when None, the positional ``shape`` (hidden,
        ffn_hidden, num_experts, k)) refined by ``options``, keywords naming fields of this class or of its
        :class:`RouterSpec`. A typed error names ``what`` (the layer) and an unknown keyword."""
        layer_names = {f.name for f in dataclasses.fields(cls)} - {"route"}
        route_names = {f.name for f in dataclasses.fields(RouterSpec)}
        unknown = sorted(set(options) - layer_names - route_names)
        if unknown:
            raise ArgumentTypeError(
                f"{what}: unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the options are the fields "
                f"of MoESpec ({', '.join(sorted(layer_names))}) and of RouterSpec ({', '.join(sorted(route_names))})"
            )
        layer = {n: v for n, v in options.items() if n in layer_names}
        route = {n: v for n, v in options.items() if n in route_names}
        if spec is None:
            hidden, ffn_hidden, num_experts, k = shape
            return cls.make(what, hidden=hidden, ffn_hidden=ffn_hidden, num_experts=num_experts,
                            route=RouterSpec.build(None, {"k": k, **route}, what), **layer)  # fmt: skip
        if not isinstance(spec, cls):
            raise ArgumentTypeError(f"{what}: spec must be a MoESpec or None, got {type(spec).__name__}")
        if any(v is not None for v in shape):
            raise InvalidArgumentError(
                f"{what}: pass the layer's shape either as hidden, ffn_hidden, num_experts, k or in spec, not both"
            )
        if route:
            layer["route"] = RouterSpec.build(spec.route, route, what)
        return cls.build(spec, layer, what) if layer else spec
