"""Megatron-Core's settings as torsh objects (:func:`from_megatron`): which keys are the MoE layer's; the layer's
own settings are :mod:`.megatron_moe`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ArgumentTypeError
from .common import Walk, unknown_key
from .megatron_moe import MOE_HANDLED, MOE_OFF, map_moe, same_value
from .migration import Migration

__all__ = ["from_megatron"]


_M_PERF = "how Megatron-Core runs the layer (kernels, fusion, dispatch, memory), not what it computes"
_M_UPCYCLE = "initialising the experts from a dense checkpoint: copy its weights into w_in / w_out"
_M_IGNORED = {
    **dict.fromkeys(
        (
            "moe_grouped_gemm",
            "moe_use_legacy_grouped_gemm",
            "moe_single_grouped_weight",
            "moe_single_grouped_bias",
            "moe_enable_deepep",
            "moe_permute_fusion",
            "moe_router_fusion",
            "moe_router_padding_for_quantization",
            "moe_router_padding_for_fp8",
            "moe_extended_tp",
            "moe_permute_fusion_into_hybridep",
        ),
        _M_PERF,
    ),
    "moe_token_dispatcher_type": "how tokens travel: ExpertParallelMoE dispatches and combines with all_to_all",
    "moe_layer_recompute": "activation recomputation: torch.utils.checkpoint around the layer",
    "moe_per_layer_logging": "logging: the layer's aux_loss and last_routing hold what it computed",
    "moe_pad_experts_for_cuda_graph_inference": "inference with CUDA graphs, not training",
    "moe_mlp_glu_interleave_size": "the memory layout of the experts' GLU weights (convert a checkpoint's w_in "
    "accordingly), not what the layer computes",
    "moe_layer_freq": "which layers are MoE layers: the model's structure (put MoELayer where Megatron would)",
    "moe_use_upcycling": _M_UPCYCLE,
    "moe_upcycling_granularity": _M_UPCYCLE,
    "moe_shared_expert_overlap": "how Megatron-Core schedules the shared expert (beside the dispatch), not what "
    "it computes",
    "use_grouped_gemm_for_shared_expert": _M_PERF,
    "moe_shared_expert_glu_interleave_size": "the memory layout of the shared expert's GLU weights (convert a "
    "checkpoint's shared_w_in accordingly), not what the layer computes",
}
_M_PERF_PREFIXES = ("moe_hybridep_", "moe_ncclep_", "moe_deepep_", "moe_flex_dispatcher_")


def _attributes(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings of a dict, an argparse.Namespace, a dataclass (TransformerConfig) or any object, and the
    dataclass's field defaults (empty for the others: their defaults are not known here)."""
    if isinstance(args, Mapping):
        return dict(args), {}
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        fields = dataclasses.fields(args)
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        return {f.name: getattr(args, f.name) for f in fields}, defaults
    if hasattr(args, "__dict__") and not isinstance(args, type):
        return {k: v for k, v in vars(args).items() if not k.startswith("_")}, {}
    raise ArgumentTypeError(
        "from_megatron: args must be Megatron's argparse.Namespace, a TransformerConfig, a dict or an object with "
        f"attributes, got {type(args).__name__}"
    )


def from_megatron(args: Any, *, ignore: Iterable[str] = ()) -> Migration:
    """Map Megatron-Core's MoE settings to :class:`~torsh_kernels.parallel.MoELayer` arguments.

    ``args``: Megatron's ``argparse.Namespace`` (``num_experts``, ``swiglu``, ...), a ``TransformerConfig``
    (``num_moe_experts``, ``gated_linear_unit``, ``activation_func``, ...), a dict, or any object with those
    attributes; Megatron is not imported. Mapped: the number of experts, ``moe_router_topk``,
    ``moe_router_score_function`` with ``moe_router_pre_softmax`` (torsh's score and renormalisation),
    ``moe_router_topk_scaling_factor`` (``scaling``), ``moe_router_enable_expert_bias`` with
    ``moe_router_bias_update_rate`` (``expert_bias``, ``bias_update_rate``), ``moe_router_num_groups`` /
    ``moe_router_group_topk`` (``n_group`` / ``topk_group``, where Megatron's group score is the top-2 sum torsh
    uses), ``moe_shared_expert_intermediate_size`` with ``moe_shared_expert_gate`` (``shared_experts``,
    ``shared_ffn_hidden``, ``shared_gate``), ``moe_aux_loss_coeff`` with ``moe_router_load_balancing_type``
    ("aux_loss", "seq_aux_loss", "none"), ``moe_z_loss_coeff``, ``moe_expert_capacity_factor`` (None: dropless)
    with ``moe_pad_expert_input_to_capacity``, ``moe_token_drop_policy``, the sizes, the experts' activation and
    ``expert_model_parallel_size``. A MoE setting torsh has no equivalent for is an error
    unless it is off; kernel, fusion and dispatch settings are ignored with the reason, and so is every setting
    that is not the MoE layer's. A MoE setting the input leaves out takes Megatron-Core's default (noted)."""
    w = Walk("from_megatron", ignore)
    a, defaults = _attributes(args)
    m = Migration(source="megatron")
    for key, v in a.items():
        if not isinstance(key, str):
            w.bad(repr(key), "keys must be strings")
        elif not w.take(a, key) or key in MOE_HANDLED or key in MOE_OFF:
            continue  # (in map_moe, once the number of experts is known)
        elif key in _M_IGNORED:
            w.skip(key, _M_IGNORED[key])
        elif key.startswith(_M_PERF_PREFIXES):
            w.skip(key, _M_PERF)
        elif key.startswith("moe_") and key in defaults and same_value(v, defaults[key]):
            w.skip(
                key,
                "a MoE setting torsh does not know, at its default in this config (Megatron-Core's standard "
                "behaviour, which is what torsh maps)",
            )
        elif key.startswith("moe_"):
            w.bad(key, unknown_key(key, "a Megatron-Core MoE setting"))
        else:
            w.skip(key, "not a setting of the MoE layer")
    map_moe(w, a, m)
    w.finish(m)
    return m
