"""torsh_kernels.config: DeepSpeed, Megatron-Core and PyTorch comm-hook settings mapped to torsh objects.

- every key of the input ends mapped, ignored (with a reason) or in the error, never nowhere;
- one ConfigMappingError names every key that cannot be mapped, after the whole input was examined;
- the mapping means the same thing: torsh's hook built from ``fp16_compress_hook`` averages bit for bit as
  PyTorch's (2 gloo ranks, real DDP), the one built from ``powerSGD_hook`` compresses the same matrices and
  trains as PyTorch's; an OffloadedOptimizer built from ZeRO-Offload settings steps as torch's AdamW; a
  MoELayer built from Megatron-Core settings routes, drops and weighs its losses as Megatron-Core's formulas
  (transcribed from megatron/core/transformer/moe/moe_utils.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.parallel.test_hooks import CAP_MB, batch, model
from torsh_kernels.collectives import run_local
from torsh_kernels.compression import BF16, FP16, PowerSGD, Sign
from torsh_kernels.config import Migration, from_deepspeed, from_megatron, from_torch_hook
from torsh_kernels.errors import ArgumentTypeError, ConfigMappingError, InvalidArgumentError, TorshKernelsError
from torsh_kernels.parallel import CompressionHookState, MoELayer, OffloadedOptimizer, compression_hook

ZERO_OFFLOAD = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.95], "eps": 1e-7, "weight_decay": 0.05}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "fp16": {"enabled": True, "loss_scale": 0},
    "gradient_clipping": 1.0,
    "communication_data_type": "fp16",
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4, "fast_init": False},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 500000000,
    },
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
}


def _leaves(d: dict, prefix: str = "", descend: tuple[str, ...] = ()) -> set[str]:
    """Dotted keys of ``d``, descending into the sections named in ``descend``."""
    out = set()
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key in descend:
            out |= _leaves(v, f"{key}.", descend)
        else:
            out.add(key)
    return out


def _accounted(m: Migration) -> set[str]:
    assert not set(m.mapped) & set(m.ignored), "a key both mapped and ignored"
    return set(m.mapped) | set(m.ignored)


# -- DeepSpeed ----------------------------------------------------------------------------------------


def test_zero_offload_config_maps_every_key():
    before = json.dumps(ZERO_OFFLOAD, sort_keys=True)
    m = from_deepspeed(ZERO_OFFLOAD)
    assert json.dumps(ZERO_OFFLOAD, sort_keys=True) == before, "the caller's dict was changed"
    assert isinstance(m.compressor, FP16)
    assert m.optimizer is torch.optim.AdamW
    assert m.optimizer_kwargs == {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.05}
    assert m.offload_optimizer == {"state_format": "fp32"}  # DeepSpeed keeps fp32 state; torsh's default is bf16
    assert m.offload_params is None and m.quantized_comm is None and m.moe is None and m.hook == {}
    sections = ("optimizer", "optimizer.params", "zero_optimization", "zero_optimization.offload_optimizer")
    assert _accounted(m) == _leaves(ZERO_OFFLOAD, descend=sections)
    assert m.mapped["communication_data_type"] == "compressor=FP16()"
    assert "zero_optimization.stage" in m.ignored and "FSDP2" in m.ignored["zero_optimization.stage"]
    assert "prescale" in m.notes["communication_data_type"]  # FP16 divides first, DeepSpeed after
    assert "fp32" in m.notes["zero_optimization.offload_optimizer.device"]
    text = m.summary()
    assert all(k in text for k in _accounted(m))
    assert isinstance(m.hook_state(), CompressionHookState)


@pytest.mark.parametrize(
    ("optimizer", "cls", "kwargs"),
    [
        ({"type": "Adam"}, torch.optim.AdamW, {"weight_decay": 0.0}),  # adam_w_mode defaults to true
        ({"type": "Adam", "params": {"adam_w_mode": False, "lr": 0.01}}, torch.optim.Adam,
         {"lr": 0.01, "weight_decay": 0.0}),
        ({"type": "AdamW", "params": {"torch_adam": True}}, torch.optim.AdamW, {}),  # torch's own defaults then
        ({"type": "Adagrad", "params": {"lr": 0.1}}, torch.optim.Adagrad, {"lr": 0.1}),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
    ids=["adam", "adam-l2", "torch-adamw", "adagrad", "torch-sgd"],
)  # fmt: skip
def test_optimizer_follows_deepspeeds_choice_and_defaults(optimizer, cls, kwargs):
    m = from_deepspeed({"optimizer": optimizer})
    assert m.optimizer is cls and m.optimizer_kwargs == kwargs
    assert _accounted(m) == _leaves({"optimizer": optimizer}, descend=("optimizer", "optimizer.params"))
    if kwargs.get("weight_decay") == 0.0 and "weight_decay" not in optimizer.get("params", {}):
        assert "0.01" in m.notes["optimizer.params.weight_decay"]  # said why 0 is passed
    assert m.offload_optimizer is None
    opt = m.build_optimizer([nn.Parameter(torch.randn(3))])
    assert type(opt) is cls


def test_onebit_adam_maps_to_sign_after_freeze_step():
    cfg = {"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 400, "weight_decay": 0.01,
                                                          "cuda_aware": False, "comm_backend_name": "nccl"}},
           "fp16": {"enabled": True}}  # fmt: skip
    m = from_deepspeed(cfg)
    assert isinstance(m.compressor, Sign) and m.compressor.error_feedback
    assert m.hook == {"start_iter": 400, "min_numel": 0}
    assert m.optimizer is torch.optim.AdamW and m.optimizer_kwargs == {"lr": 1e-4, "weight_decay": 0.01}
    assert "momentum" in m.notes["optimizer.type"]  # the difference is said
    assert {"optimizer.params.cuda_aware", "optimizer.params.comm_backend_name"} <= set(m.ignored)
    assert _accounted(m) == _leaves(cfg, descend=("optimizer", "optimizer.params"))
    state = m.hook_state()
    assert state.start_iter == 400 and state.min_numel == 0 and isinstance(state.compressor, Sign)
    default = from_deepspeed({"optimizer": {"type": "OneBitAdam"}})
    assert default.hook["start_iter"] == 100000 and "100000" in default.notes["optimizer.params.freeze_step"]
    with pytest.raises(ConfigMappingError) as e:  # DeepSpeed refuses 1-bit Adam under ZeRO, and so does this
        from_deepspeed({**cfg, "zero_optimization": {"stage": 1}})
    assert list(e.value.keys) == ["optimizer.type"]


@pytest.mark.parametrize(
    ("cfg", "compressor"),
    [
        ({"communication_data_type": "fp16"}, FP16),
        ({"communication_data_type": "BF16"}, BF16),  # DeepSpeed lower-cases it
        ({"communication_data_type": "fp32"}, None),
        ({"fp32_allreduce": True}, None),
        ({"communication_data_type": None}, None),
    ],
)
def test_communication_data_type(cfg, compressor):
    m = from_deepspeed(cfg)
    assert (m.compressor is None) if compressor is None else isinstance(m.compressor, compressor)
    assert _accounted(m) == set(cfg)


def test_fp16_training_without_a_wire_dtype_is_noted():
    m = from_deepspeed({"fp16": {"enabled": True}})
    assert m.compressor is None and "communication_data_type='fp16'" in m.notes["communication_data_type"]


def test_one_error_names_every_key_that_cannot_be_mapped():
    cfg = {
        "train_batch_size": 8,
        "bogus_key": 1,
        "communication_data_type": "int8",
        "gradient_allreduce_op": "sum",
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": "2",
            "offload_optimizer": {"device": "nvme", "ratio": 0.5, "nvme_path": "/nvme"},
            "offload_param": {"device": "cpu", "not_a_key": 1},
            "overlap_comm": True,
            "zenflow": {"topk_ratio": 0.1},
        },
    }
    with pytest.raises(ConfigMappingError) as e:
        from_deepspeed(cfg)
    bad = {
        "bogus_key", "communication_data_type", "gradient_allreduce_op", "optimizer.type", "zero_optimization.stage",
        "zero_optimization.offload_optimizer.device", "zero_optimization.offload_optimizer.ratio",
        "zero_optimization.offload_param.not_a_key", "zero_optimization.zenflow",
    }  # fmt: skip
    assert set(e.value.keys) == bad
    assert isinstance(e.value, ValueError) and isinstance(e.value, TorshKernelsError)
    for key in bad:
        assert f"  {key}: " in str(e.value)
    assert "'nvme'" in e.value.keys["zero_optimization.offload_optimizer.device"]
    assert "9 settings cannot be mapped" in str(e.value)


def test_wrong_types_are_named():
    cfg = {
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.999], "bias_correction": "yes",
                                                  "amsgrad": False, "foo": 1}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": "true"},
                              "offload_optimizer": "cpu", "zero_quantized_weights": 1},
        "fp32_allreduce": "no",
    }  # fmt: skip
    with pytest.raises(ConfigMappingError) as e:
        from_deepspeed(cfg)
    keys = e.value.keys
    assert set(keys) == {
        "optimizer.params.bias_correction", "optimizer.params.foo", "zero_optimization.offload_param.pin_memory",
        "zero_optimization.offload_optimizer", "zero_optimization.zero_quantized_weights", "fp32_allreduce",
        "optimizer.params.lr",
    }  # fmt: skip
    assert "AdamW takes no argument 'foo'" in keys["optimizer.params.foo"]
    # each value is checked under its own key, beside the unknown names
    assert keys["optimizer.params.lr"].startswith("must be a finite number, got str 'auto' ('auto' is filled in by")
    with pytest.raises(ConfigMappingError, match="Hugging Face") as e:
        from_deepspeed({"communication_data_type": "auto"})
    with pytest.raises(ArgumentTypeError):
        from_deepspeed(["not", "a", "config"])
    with pytest.raises(ArgumentTypeError):
        from_deepspeed({}, ignore="optimizer")  # a list of keys, not one string


def test_file_path_input(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO_OFFLOAD))
    from_dict = from_deepspeed(ZERO_OFFLOAD)
    for given in (path, str(path)):
        m = from_deepspeed(given)
        assert (m.optimizer_kwargs, m.offload_optimizer, m.mapped, m.ignored) == (
            from_dict.optimizer_kwargs, from_dict.offload_optimizer, from_dict.mapped, from_dict.ignored
        )  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="no such file"):
        from_deepspeed(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{'train_batch_size': 8,}")
    with pytest.raises(InvalidArgumentError, match="is not JSON"):
        from_deepspeed(tmp_path / "bad.json")


def test_ignore_leaves_keys_out_knowingly():
    cfg = {"a_newer_deepspeed_key": {"x": 1}, "zero_optimization": {"stage": 0, "new_zero_knob": 3}}
    with pytest.raises(ConfigMappingError) as e:
        from_deepspeed(cfg)
    assert set(e.value.keys) == {"a_newer_deepspeed_key", "zero_optimization.new_zero_knob"}
    m = from_deepspeed(cfg, ignore=["a_newer_deepspeed_key", "zero_optimization.new_zero_knob"])
    assert m.ignored["a_newer_deepspeed_key"] == "left out on request (ignore=)"
    assert m.ignored["zero_optimization.new_zero_knob"] == "left out on request (ignore=)"
    with pytest.raises(ConfigMappingError, match="not in the settings"):
        from_deepspeed({}, ignore=["optimizer"])


def test_offload_param_and_zeropp_under_stage_3():
    cfg = {
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 5},
            "offload_optimizer": {"device": "cpu", "ratio": 1.0},
            "zero_quantized_weights": True,
            "zero_quantized_gradients": True,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
    }
    m = from_deepspeed(cfg)
    assert m.offload_params == {"fmt": "bf16"}  # the training dtype, as DeepSpeed's fp16/bf16 parameters
    assert m.offload_optimizer == {"state_format": "fp32"}
    assert m.quantized_comm == {"weights": "int8", "grads": "int4", "error_feedback": False}
    sections = ("zero_optimization", "zero_optimization.offload_param", "zero_optimization.offload_optimizer")
    assert _accounted(m) == _leaves(cfg, descend=sections)
    loco = from_deepspeed({"zero_optimization": {**cfg["zero_optimization"], "zeropp_loco_param": {"err_beta": 0.8}}})
    assert loco.quantized_comm["error_feedback"] is True
    lower = from_deepspeed({"zero_optimization": {**cfg["zero_optimization"], "stage": 2}})
    assert lower.offload_params is None and lower.quantized_comm is None  # DeepSpeed reads them under stage 3 only
    assert "stage 3" in lower.ignored["zero_optimization.offload_param.device"]
    assert "stage 3" in lower.ignored["zero_optimization.zero_quantized_weights"]
    off = from_deepspeed({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert off.offload_optimizer is None and "stage 0" in off.ignored["zero_optimization.offload_optimizer.device"]
    both = from_deepspeed(
        {"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}}}
    )
    assert both.offload_optimizer is None and "also given" in both.ignored["zero_optimization.cpu_offload"]
    deprecated = from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert deprecated.offload_optimizer == {"state_format": "fp32"} and "zero_optimization.cpu_offload" in (
        deprecated.mapped
    )  # fmt: skip


def _train(opt_for: Callable, steps: int = 4, *, switch: Callable | None = None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3))
    opt = opt_for(net.parameters())
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if switch is not None and step == steps // 2:
            opt = switch(opt)
        x, y = torch.randn(16, 7, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()], opt


def test_offloaded_optimizer_from_zero_offload_steps_like_adamw():
    m = from_deepspeed(ZERO_OFFLOAD)
    ours, opt = _train(m.build_optimizer)
    assert isinstance(opt, OffloadedOptimizer) and opt.state_format == "fp32"
    theirs, _ = _train(lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05))
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))  # fp32 state: bit for bit
    # an optimizer the user built, offloaded half-way: its hyperparameters and state carry over
    switched, opt = _train(lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05),
                           switch=m.offload)  # fmt: skip
    assert isinstance(opt, OffloadedOptimizer)
    assert all(torch.equal(a, b) for a, b in zip(switched, theirs))
    with pytest.raises(InvalidArgumentError, match="do not offload"):
        from_deepspeed({}).offload(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    with pytest.raises(InvalidArgumentError, match="name no optimizer"):
        from_deepspeed({}).build_optimizer([nn.Parameter(torch.zeros(1))])


def test_parameter_offloader_and_quantized_comm_builders():
    cfg = {"fp16": {"enabled": True}, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}
    m = from_deepspeed(cfg)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    off = m.offload_parameters(net)
    assert off.fmt == "fp16" and net(torch.randn(3, 4)).shape == (3, 2)
    off.remove()
    with pytest.raises(InvalidArgumentError, match="quantize no FSDP communication"):
        m.apply_quantized_comm(net)
    with pytest.raises(InvalidArgumentError, match="do not offload parameters"):
        from_deepspeed({}).offload_parameters(net)


# -- Megatron-Core --------------------------------------------------------------------------------------


@dataclasses.dataclass
class _TransformerConfig:
    """Stands in for Megatron-Core's TransformerConfig (a dataclass; its field names)."""

    num_layers: int = 2
    hidden_size: int = 16
    ffn_hidden_size: int = 64
    num_attention_heads: int = 4
    add_bias_linear: bool = False
    gated_linear_unit: bool = True
    activation_func: Callable = F.silu
    num_moe_experts: int | None = 6
    moe_ffn_hidden_size: int | None = 24
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float | None = 1e-3
    moe_expert_capacity_factor: float | None = 1.25
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = True
    moe_token_dispatcher_type: str = "alltoall"
    moe_router_enable_expert_bias: bool = False
    moe_input_jitter_eps: float | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    moe_router_dtype: str | None = "fp32"
    expert_model_parallel_size: int = 2


MOE_KWARGS = {"num_experts": 6, "k": 2, "score": "softmax", "renormalize": True, "aux_loss_coef": 0.01,
              "z_loss_coef": 1e-3, "capacity_factor": 1.25, "drop_policy": "probability", "hidden": 16,
              "ffn_hidden": 24, "activation": "swiglu", "router_fp32": True}  # fmt: skip


def test_megatron_config_namespace_dict_and_object_map_alike():
    cfg = _TransformerConfig()
    as_config = from_megatron(cfg)
    assert as_config.moe == MOE_KWARGS and as_config.expert_parallel_size == 2
    assert _accounted(as_config) == {f.name for f in dataclasses.fields(cfg)}
    assert "not a setting of the MoE layer" in as_config.ignored["num_attention_heads"]
    # Megatron's argparse names: --num-experts, --swiglu
    ns = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("num_moe_experts", "gated_linear_unit",
                                                                         "activation_func")}  # fmt: skip
    as_args = from_megatron(argparse.Namespace(num_experts=6, swiglu=True, **ns))
    as_dict = from_megatron({**dataclasses.asdict(cfg)})

    class Plain:  # any object with attributes
        def __init__(self):
            self.__dict__.update(dataclasses.asdict(cfg))

    as_object = from_megatron(Plain())
    assert as_args.moe == as_dict.moe == as_object.moe == MOE_KWARGS
    assert _accounted(as_args) == set(vars(argparse.Namespace(num_experts=6, swiglu=True, **ns)))
    assert as_args.mapped["swiglu"] == "moe['activation'] = 'swiglu'"
    layer = as_config.moe_layer(provider="torch")
    assert isinstance(layer, MoELayer) and (layer.num_experts, layer.k, layer.hidden) == (6, 2, 16)


def test_megatron_defaults_are_megatrons_and_said():
    m = from_megatron({"num_moe_experts": 4, "hidden_size": 8, "add_bias_linear": False})
    assert m.moe == {"num_experts": 4, "k": 2, "score": "softmax", "renormalize": True, "aux_loss_coef": 0.0,
                     "z_loss_coef": 0.0, "capacity_factor": None, "drop_policy": "probability", "hidden": 8,
                     "ffn_hidden": 32, "activation": "gelu"}  # fmt: skip
    for key in ("moe_router_topk", "moe_aux_loss_coeff", "moe_expert_capacity_factor", "activation_func",
                "ffn_hidden_size"):  # fmt: skip
        assert "not given" in m.notes[key], key
    none = from_megatron({"num_moe_experts": None, "moe_router_topk": 2, "hidden_size": 8, "lr": 1e-4})
    assert none.moe is None and "no MoE layer" in none.ignored["moe_router_topk"]
    with pytest.raises(InvalidArgumentError, match="hold no MoE layer"):
        none.moe_layer()
    with pytest.raises(InvalidArgumentError, match="give no hidden"):
        from_megatron({"num_moe_experts": 4, "add_bias_linear": False}).moe_layer()


class _OneRank:
    """A Communicator of one rank (the methods ExpertParallelMoE needs; none is called here)."""

    rank, world_size = 0, 1

    def all_to_all(self, *a, **k): ...

    def broadcast(self, *a, **k): ...

    def all_reduce(self, *a, **k): ...


def test_expert_parallel_size_is_checked_against_the_communicator():
    m = from_megatron(_TransformerConfig())  # expert_model_parallel_size=2
    with pytest.raises(InvalidArgumentError, match="has 1 rank; the megatron settings spread the experts over 2"):
        m.expert_parallel_moe(_OneRank())
    one = from_megatron(_TransformerConfig(expert_model_parallel_size=1))
    assert one.expert_parallel_moe(_OneRank(), provider="torch").local_experts == 6


def test_megatron_error_names_every_unmappable_key():
    cfg = {
        **dataclasses.asdict(_TransformerConfig()),
        "moe_router_topk": "2",
        "moe_router_load_balancing_type": "sinkhorn",
        "moe_router_enable_expert_bias": True,  # with softmax scores: Megatron-Core refuses it too
        "moe_router_group_topk": 1,  # Megatron's group score, the top k // 1 = 2 sum, is torsh's, but no groups given
        "add_bias_linear": True,
        "moe_router_topk_scaling_factor": -2.5,
        "moe_some_future_knob": 1,
        "activation_func": torch.tanh,
        "expert_model_parallel_size": 4,  # does not divide 6 experts
    }
    with pytest.raises(ConfigMappingError) as e:
        from_megatron(cfg)
    assert set(e.value.keys) == {
        "moe_router_topk", "moe_router_load_balancing_type", "moe_router_enable_expert_bias",
        "moe_router_num_groups", "add_bias_linear", "moe_router_topk_scaling_factor",
        "moe_some_future_knob", "activation_func", "expert_model_parallel_size",
    }  # fmt: skip
    assert "must be an integer, got str '2'" in e.value.keys["moe_router_topk"]
    with pytest.raises(ArgumentTypeError):
        from_megatron(42)


@dataclasses.dataclass
class _NewerConfig(_TransformerConfig):
    moe_some_new_fusion: bool = True  # a Megatron-Core field torsh does not know
    glu_linear_offset: float = 0.0


def test_megatron_unknown_field_at_its_default_and_the_other_spelling():
    m = from_megatron(_NewerConfig())  # a newer TransformerConfig: its unknown field sits at its default
    assert "at its default" in m.ignored["moe_some_new_fusion"] and m.moe == MOE_KWARGS
    assert _accounted(m) == {f.name for f in dataclasses.fields(_NewerConfig)}
    with pytest.raises(ConfigMappingError) as e:  # changed from its default, or in a dict (defaults unknown)
        from_megatron(_NewerConfig(moe_some_new_fusion=False, glu_linear_offset=1.0))
    assert set(e.value.keys) == {"moe_some_new_fusion", "glu_linear_offset"}
    with pytest.raises(ConfigMappingError):
        from_megatron(dataclasses.asdict(_NewerConfig()))
    both = from_megatron({**dataclasses.asdict(_TransformerConfig()), "num_experts": None})
    assert both.moe == MOE_KWARGS and "other spelling" in both.ignored["num_experts"]


def _megatron_routing_probs(logits, topk, score, pre_softmax):
    """Megatron-Core's topk_routing_with_score_function (no groups, no bias, no scaling): [T, E] probabilities
    of the chosen experts, 0 elsewhere."""
    if score == "softmax":
        if pre_softmax:
            probs, idx = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k=topk, dim=1)
        else:
            s, idx = torch.topk(logits, k=topk, dim=1)
            probs = torch.softmax(s, dim=-1, dtype=torch.float32)
    else:
        s, idx = torch.topk(torch.sigmoid(logits.float()), k=topk, dim=1)
        probs = s / (s.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else s
    return torch.zeros_like(logits).scatter(1, idx, probs)


def _megatron_aux_and_z(logits, topk, score, aux_coeff, z_coeff):
    """switch_load_balancing_loss_func + z_loss_func, with the scores of compute_routing_scores_for_aux_loss."""
    T, E = logits.shape
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    _, idx = torch.topk(scores, k=topk, dim=1)
    tokens_per_expert = torch.zeros_like(logits).scatter(1, idx, 1).sum(0)
    aux = torch.sum(scores.sum(0) * tokens_per_expert) * (E * aux_coeff / (T * T * topk))
    return aux + torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * z_coeff


def _routed(layer: MoELayer, x: torch.Tensor):
    with torch.no_grad():
        layer(x)
        logits = layer.router(x)
    r = layer.last_routing
    dense = torch.zeros_like(logits).scatter(1, r.indices, r.weights)
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter(1, r.indices, ~r.dropped)
    return logits, r, dense, kept


@pytest.mark.parametrize(
    ("score", "pre_softmax", "k"),
    [("softmax", False, 2), ("softmax", True, 2), ("sigmoid", False, 2), ("sigmoid", False, 1)],
)
def test_megatron_layer_routes_as_megatron(score, pre_softmax, k):
    cfg = _TransformerConfig(moe_router_score_function=score, moe_router_pre_softmax=pre_softmax, moe_router_topk=k,
                             moe_expert_capacity_factor=None)  # fmt: skip
    m = from_megatron(cfg)
    torch.manual_seed(7)
    layer = m.moe_layer(provider="torch")  # the reference ops: no kernel compilation in this test
    x = torch.randn(40, 16)
    logits, r, dense, _ = _routed(layer, x)
    assert r.k == k and r.score == score and r.capacity is None and r.num_dropped == 0  # dropless
    torch.testing.assert_close(dense, _megatron_routing_probs(logits, k, score, pre_softmax), atol=1e-6, rtol=1e-5)
    ref = _megatron_aux_and_z(logits, k, score, 0.01, 1e-3)
    torch.testing.assert_close(layer.aux_loss, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_megatron_capacity_drops_as_megatron(policy):
    # T=24 tokens, k=2, E=6, factor 1.0: C = ceil(24 * 2 / 6 * 1.0) = 8 assignments per expert (get_capacity)
    cfg = _TransformerConfig(moe_expert_capacity_factor=1.0, moe_token_drop_policy=policy, moe_router_pre_softmax=True)
    m = from_megatron(cfg)
    torch.manual_seed(3)
    layer = m.moe_layer(provider="torch")  # the reference ops: no kernel compilation in this test
    with torch.no_grad():  # a skewed router, so that experts overflow
        layer.router.weight[0] += 0.5
    _, r, dense, kept = _routed(layer, torch.randn(24, 16))
    C = math.ceil((24 * 2 / 6) * 1.0)
    assert r.capacity == C and r.num_dropped > 0 and int(kept.sum(0).max()) == C
    chosen = dense > 0
    if policy == "probs":  # Megatron's apply_router_token_dropping: the top C probabilities per expert
        _, idx = torch.topk(dense, k=C, dim=0, sorted=False)
        expect = chosen & torch.zeros_like(dense).scatter(0, idx, 1).bool()
    else:  # the first C assignments of each expert in token order, what Megatron documents for 'position'
        expect = chosen & (torch.cumsum(chosen.int(), 0) <= C)
    assert torch.equal(kept, expect)


# -- PyTorch comm hooks -----------------------------------------------------------------------------------


def test_from_torch_hook_maps_the_default_hooks():
    assert from_torch_hook(default_hooks.allreduce_hook).compressor is None
    assert isinstance(from_torch_hook(default_hooks.fp16_compress_hook).compressor, FP16)
    bf = from_torch_hook(default_hooks.bf16_compress_hook)
    assert isinstance(bf.compressor, BF16) and "divides" in bf.notes["hook"]
    state = powerSGD_hook.PowerSGDState(
        None, matrix_approximation_rank=3, start_powerSGD_iter=7, min_compression_rate=1.5, warm_start=False,
        orthogonalization_epsilon=1e-8,
    )  # fmt: skip
    m = from_torch_hook(powerSGD_hook.powerSGD_hook, state)
    above = math.nextafter(1.5, math.inf)  # PyTorch compresses above the rate, torsh at it: see below
    assert m.compressor == PowerSGD(3, start_iter=7, warm_start=False, min_compression_rate=above)
    assert m.hook == {"min_numel": 0, "policy": "layerwise"}
    assert "epsilon" in m.notes["state.orthogonalization_epsilon"]
    hs = m.hook_state()
    assert (hs.start_iter, hs.min_compression_rate, hs.min_numel, hs.policy) == (7, above, 0, "layerwise")
    batched = from_torch_hook(powerSGD_hook.batched_powerSGD_hook, state)
    assert batched.hook["policy"] == "bucket" and "1-D" in batched.notes["hook"]


@pytest.mark.parametrize("rate", [1.0, 1.5, 2.0, 3.0, 4.0, 32 / 3])
def test_the_mapped_powersgd_compresses_the_matrices_pytorch_compresses(rate):
    """PyTorch compresses a matrix when rows * cols / ((rows + cols) * rank) exceeds min_compression_rate; torsh's
    PowerSGD when it reaches its own. Mapped, both decide alike on every shape, the boundary included (a [16, 16]
    matrix at rank 4 has a rate of exactly 2.0: PyTorch sends it uncompressed)."""
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=4, min_compression_rate=rate, warm_start=False)
    comp = from_torch_hook(powerSGD_hook.powerSGD_hook, state).compressor
    boundary = 0
    for rows in range(1, 40):
        for cols in range(1, 40):
            theirs = powerSGD_hook._should_compress(rows, cols, min(4, rows, cols), rate)[0]
            ours = comp._plan(torch.empty(rows, cols)) is not None
            assert ours == theirs, (rows, cols, rate)
            boundary += rows * cols == rate * (rows + cols) * min(4, rows, cols)
    assert boundary or rate not in (2.0, 4.0)  # [16, 16] and [32, 32] sit exactly at 2.0 and 4.0


def test_from_torch_hook_refuses_what_it_cannot_map():
    no_ef = powerSGD_hook.PowerSGDState(None, use_error_feedback=False, warm_start=False, start_powerSGD_iter=1)
    with pytest.raises(ConfigMappingError) as e:
        from_torch_hook(powerSGD_hook.powerSGD_hook, no_ef)
    assert list(e.value.keys) == ["state.use_error_feedback"]
    for hook, state, key in [
        (default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook), None, "hook"),
        (quantization_hooks.quantization_pertensor_hook, None, "hook"),
        (powerSGD_hook.powerSGD_hook, None, "state"),
        (default_hooks.fp16_compress_hook, "not a group", "state"),
        (compression_hook, None, "hook"),
    ]:
        with pytest.raises(ConfigMappingError) as e:
            from_torch_hook(hook, state)
        assert list(e.value.keys) == [key]
    with pytest.raises(ArgumentTypeError):
        from_torch_hook("fp16_compress_hook")


def _hooks_worker(comm):
    """On each of 2 ranks: PyTorch's hook against torsh's hook mapped from it, on real DDP."""
    out = {}

    def grads(hook, state):
        net = model()
        ddp = DDP(net, bucket_cap_mb=CAP_MB)
        ddp.register_comm_hook(state, hook)
        for step in range(2):  # the second step runs on DDP's rebuilt buckets
            x, y = batch(step, comm.rank)
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
        return [p.grad.clone() for p in net.parameters()]

    # (PyTorch's bf16_compress_hook refuses gloo: "required CUDA 11+ and NCCL 2.10+", so only fp16 here)
    theirs = grads(default_hooks.fp16_compress_hook, None)
    ours = grads(compression_hook, from_torch_hook(default_hooks.fp16_compress_hook).hook_state())
    out["fp16"] = all(torch.equal(a, b) for a, b in zip(ours, theirs))

    # PowerSGD, rank 1, no size rule, on [n, 1] and [1, n] weights, where a rank-1 approximation is exact: both
    # hooks then train as plain DDP, and torsh's compresses the same two matrices (min_numel=0, as PyTorch)
    def net():
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(1, 96, bias=False), nn.Tanh(), nn.Linear(96, 1, bias=False))

    def train(hook, state):
        m = net()
        ddp = DDP(m)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(5):
            x = torch.randn(32, 1, generator=torch.Generator().manual_seed(step * 13 + comm.rank))
            opt.zero_grad()
            ((ddp(x) - torch.sin(3 * x)) ** 2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    def psgd_state():
        return powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                           min_compression_rate=0)  # fmt: skip

    theirs = train(powerSGD_hook.powerSGD_hook, psgd_state())
    state = from_torch_hook(powerSGD_hook.powerSGD_hook, psgd_state()).hook_state()
    ours = train(compression_hook, state)
    out["powersgd"] = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    out["powersgd_q"] = sorted(tuple(s["tensors"]["q"].shape) for s in state.state_dict()["states"].values())

    # an expert-parallel layer from Megatron settings: 2 ranks hold 3 experts each
    mig = from_megatron(_TransformerConfig())
    ep = mig.expert_parallel_moe(comm, provider="torch")
    y = ep(torch.randn(10, 16, generator=torch.Generator().manual_seed(comm.rank)))
    out["ep"] = (ep.local_experts, ep.first_expert, tuple(y.shape))
    return out


def test_mapped_hooks_average_as_pytorchs_on_two_ranks():
    outs = run_local(_hooks_worker, 2, op_timeout=60)
    for rank, out in enumerate(outs):
        assert out["fp16"]  # bit for bit: fp16(fp16(g) / 2), one all-reduce per bucket
        assert out["powersgd"] < 1e-5
        assert out["powersgd_q"] == [(1, 1), (96, 1)]  # both matrices compressed, as PyTorch compresses them
        assert out["ep"] == (3, 3 * rank, (10, 16))


# -- every value checked at import, typed (issue 41, item 9) ------------------------------------------------------

_OFFLOADED = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _adamw(**params) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


def _deep(levels: int) -> list:
    v: list = []
    for _ in range(levels):
        v = [v]
    return v


@pytest.mark.parametrize(
    "cfg, key, text",
    [
        (_adamw(lr=math.inf), "optimizer.params.lr", "must be a finite number, got inf"),  # NaN after one step
        (_adamw(lr=1e300), "optimizer.params.lr", "must be at most 65504"),
        (_adamw(lr=0), "optimizer.params.lr", "must be > 0"),
        (_adamw(betas=[0.9, 0.99, 0.5]), "optimizer.params.betas", "exactly 2 numbers, got 3"),
        (_adamw(betas=[0.9, 1.0]), "optimizer.params.betas", "entry 1: must be < 1"),
        (_adamw(eps=math.inf), "optimizer.params.eps", "must be a finite number"),
        (_adamw(weight_decay=-0.1), "optimizer.params.weight_decay", "must be >= 0"),
        ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 1e300}}}, "optimizer.params.momentum",
         "must be < 1"),
        ({"optimizer": {"type": "Adam", "params": {"torch_adam": True, "amsgrad": "yes"}}},
         "optimizer.params.amsgrad", "must be true or false"),
        ({"optimizer": {"type": "RMSprop", "params": {"lr": 1e-2, "alpha": 1e30}}}, "optimizer.params",
         "NaN or inf in two steps"),
        ({"optimizer": {"type": "LBFGS", "params": {"line_search_fn": "bogus"}}}, "optimizer.params",
         "fails a step on a throwaway parameter"),
        ({**_OFFLOADED, "optimizer": {"type": "LBFGS", "params": {}}}, "optimizer.type", "needs a closure"),
        ({**_OFFLOADED, "optimizer": {"type": "SparseAdam", "params": {}}}, "optimizer.type", "sparse gradients"),
        ({"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10**30}}}, "optimizer.params.freeze_step",
         "must be at most 9223372036854775807"),
        ({"zero_optimization": {"stage": 10**5000}}, "zero_optimization.stage", "an integer of about 5001 digits"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 10**400}}},
         "zero_optimization.offload_optimizer.ratio", "must be a finite number"),
        ({"optimizer": _deep(100_000)}, "optimizer", "nested deeper than 32 levels"),
    ],
)  # fmt: skip
def test_deepspeed_values_are_checked_at_import(cfg, key, text):
    with pytest.raises(ConfigMappingError) as e:
        from_deepspeed(cfg)
    assert key in e.value.keys, e.value.keys
    assert text in e.value.keys[key], e.value.keys[key]


_MOE = {"num_moe_experts": 8, "moe_router_topk": 2, "add_bias_linear": False, "hidden_size": 16}


@pytest.mark.parametrize(
    "bad, key, text",
    [
        ({"num_moe_experts": 2**40}, "num_moe_experts", "must be at most 1048576"),
        ({"hidden_size": 2**40}, "hidden_size", "must be at most 1048576"),
        ({"moe_ffn_hidden_size": 10**5000}, "moe_ffn_hidden_size", "about 5001 digits"),
        ({"moe_router_topk": 10**5000}, "moe_router_topk", "must be at most 8"),
        ({"moe_router_topk_scaling_factor": 1e300}, "moe_router_topk_scaling_factor", "at most 3.40282e+38"),
        ({"moe_aux_loss_coeff": 1e300}, "moe_aux_loss_coeff", "at most 3.40282e+38"),
        ({"moe_z_loss_coeff": 10**400}, "moe_z_loss_coeff", "must be a finite number"),
        ({"moe_expert_capacity_factor": 1e300}, "moe_expert_capacity_factor", "at most 1.04858e+06"),
        ({"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
          "moe_router_bias_update_rate": 1e308}, "moe_router_bias_update_rate", "must be at most 1"),
        ({"moe_router_group_topk": 1, "moe_router_num_groups": 10**5000}, "moe_router_num_groups", "at most 8"),
        ({"expert_tensor_parallel_size": 10**5000}, "expert_tensor_parallel_size", "at most 8"),
    ],
)  # fmt: skip
def test_megatron_values_are_checked_at_import(bad, key, text):
    with pytest.raises(ConfigMappingError) as e:
        from_megatron({**_MOE, **bad})
    assert key in e.value.keys, e.value.keys
    assert text in e.value.keys[key], e.value.keys[key]


@pytest.mark.parametrize(
    "field, value, text",
    [
        ("matrix_approximation_rank", 2**40, "must be at most 1048576"),
        ("orthogonalization_epsilon", math.nan, "must be a finite number"),
        ("start_powerSGD_iter", 10**30, "must be at most 9223372036854775807"),
        ("min_compression_rate", 10**400, "must be a finite number"),
    ],
    ids=["rank", "epsilon", "start_iter", "rate"],
)
def test_powersgd_state_values_are_checked_at_import(field, value, text):
    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, warm_start=False)
    setattr(state, field, value)
    with pytest.raises(ConfigMappingError) as e:
        from_torch_hook(powerSGD_hook.powerSGD_hook, state)
    assert list(e.value.keys) == [f"state.{field}"]
    assert text in e.value.keys[f"state.{field}"]


@pytest.mark.parametrize(
    "content, error, text",
    [
        ("[" * 100_000 + "]" * 100_000, InvalidArgumentError, "nested deeper than 32 levels"),  # was RecursionError
        ('{"optimizer": {"type": "AdamW", "params": ' + '{"a": ' * 40 + "1" + "}" * 42, InvalidArgumentError,
         "nested deeper than 32 levels"),
        ('{"zero_optimization": {"stage": ' + "9" * 5000 + "}}", ConfigMappingError,
         "zero_optimization.stage: must be at most 3, got <an integer of 5000 digits>"),  # was ValueError
        ('{"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}', ConfigMappingError,
         "optimizer.params.lr: must be a finite number, got inf"),  # was mapped
        (" " * (1 << 20) + "{}", InvalidArgumentError, "over the limit of 1048576"),  # was read whole
    ],
)  # fmt: skip
def test_deepspeed_files_are_read_with_bounds(tmp_path, content, error, text):
    path = tmp_path / "ds_config.json"
    path.write_text(content)
    with pytest.raises(error) as e:
        from_deepspeed(path)
    assert text in str(e.value)
    if error is InvalidArgumentError:
        assert str(path) in str(e.value)  # the file is named


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "ds_config.json"
    os.mkfifo(fifo)
    with pytest.raises(InvalidArgumentError, match="not a regular file"):
        from_deepspeed(fifo)


@pytest.mark.parametrize(
    "optimizer, offloaded",
    [
        ({"type": "AdamW", "params": {"lr": 65504.0, "betas": [0.0, 0.999], "eps": 1e-30, "weight_decay": 0}}, True),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0}}, True),
        ({"type": "Adam", "params": {"torch_adam": True, "capturable": True, "fused": None, "foreach": True}}, False),
        ({"type": "Rprop", "params": {"etas": [0.5, 1.2], "step_sizes": [1e-6, 50]}}, True),
        ({"type": "Adafactor", "params": {"eps": [None, 1e-3], "beta2_decay": -0.8}}, True),
        ({"type": "LBFGS", "params": {"max_iter": 10**9, "line_search_fn": "strong_wolfe"}}, False),
        ({"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 2**63 - 1}}, False),
    ],
)  # fmt: skip
def test_accepted_optimizers_build_and_step(optimizer, offloaded):
    cfg = {"optimizer": optimizer, **(_OFFLOADED if offloaded else {})}
    m = from_deepspeed(cfg)
    p = nn.Parameter(torch.ones(3, 2))
    opt = m.build_optimizer([p])
    assert isinstance(opt, OffloadedOptimizer) == offloaded
    if "capturable" in optimizer["params"]:  # (capturable steps on a GPU only)
        return

    def closure():  # a quadratic: LBFGS (at most 10**9 iterations) stops once the gradient vanishes
        opt.zero_grad()
        loss = ((p - 2) ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    assert bool(torch.isfinite(p).all()) and not torch.equal(p.detach(), torch.ones(3, 2))
