"""The config importer (``torsh_kernels.config``): settings from DeepSpeed, Megatron-Core and PyTorch's comm hooks
with values no training can use (non-finite, absurdly large, the wrong length or kind, 5000-digit integers),
optimizers that build but cannot run, and files that are too deep, too large or not files. Each must end in a
typed error at import (a ConfigMappingError naming the key, or an InvalidArgumentError naming the file); a few
accepted configurations must build their objects and train (issue 41, item 9)."""

from __future__ import annotations

import functools
import math
import os
import tempfile
from pathlib import Path

import torch

from probe_cases import Case

CASES: list[Case] = []

_OFFLOADED = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
_MOE = {"num_moe_experts": 8, "moe_router_topk": 2, "add_bias_linear": False, "hidden_size": 16}


def _deep(levels: int) -> list:
    v: list = []
    for _ in range(levels):
        v = [v]
    return v


def _deepspeed(cfg: dict):
    from torsh_kernels.config import from_deepspeed

    return from_deepspeed(cfg)


def _megatron(extra: dict):
    from torsh_kernels.config import from_megatron

    return from_megatron({**_MOE, **extra})


def _powersgd(field: str, value: object):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from torsh_kernels.config import from_torch_hook

    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=2, warm_start=False)
    setattr(state, field, value)
    return from_torch_hook(powerSGD_hook.powerSGD_hook, state)


def _deepspeed_path(path: str):
    from torsh_kernels.config import from_deepspeed

    return from_deepspeed(path)


def _file(content: str | bytes | None, fifo: bool = False):
    from torsh_kernels.config import from_deepspeed

    with tempfile.TemporaryDirectory(prefix="torsh-probe-config-") as d:
        path = Path(d) / "ds_config.json"
        if fifo:
            os.mkfifo(path)
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return from_deepspeed(path)


def _adamw(**params) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}}}


# -- DeepSpeed: the optimizer section ---------------------------------------------------------------------------

for _name, _cfg in [
    ("lr_inf", _adamw(lr=math.inf)),
    ("lr_nan", _adamw(lr=math.nan)),
    ("lr_1e300", _adamw(lr=1e300)),
    ("lr_zero", _adamw(lr=0)),
    ("lr_string", _adamw(lr="3e-4")),
    ("lr_5000_digits", _adamw(lr=10**5000)),
    ("betas_three", _adamw(betas=[0.9, 0.99, 0.5])),
    ("betas_one", _adamw(betas=[0.9, 1.0])),
    ("betas_string", _adamw(betas="ab")),
    ("eps_inf", _adamw(eps=math.inf)),
    ("eps_zero", _adamw(eps=0)),
    ("weight_decay_nan", _adamw(weight_decay=math.nan)),
    ("weight_decay_negative", _adamw(weight_decay=-1)),
    ("amsgrad_string", _adamw(amsgrad="yes")),
    ("sgd_momentum_1e300", {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 1e300}}}),
    ("rmsprop_alpha_1e30", {"optimizer": {"type": "RMSprop", "params": {"alpha": 1e30}}}),
    ("rprop_etas_swapped", {"optimizer": {"type": "Rprop", "params": {"etas": [1.5, 0.5]}}}),
    ("lbfgs_line_search_bogus", {"optimizer": {"type": "LBFGS", "params": {"line_search_fn": "bogus"}}}),
    ("lbfgs_history_float", {"optimizer": {"type": "LBFGS", "params": {"history_size": 2.5}}}),
    ("lbfgs_offloaded", {**_OFFLOADED, "optimizer": {"type": "LBFGS", "params": {}}}),
    ("sparse_adam_offloaded", {**_OFFLOADED, "optimizer": {"type": "SparseAdam", "params": {}}}),
    ("base_optimizer_class", {"optimizer": {"type": "Optimizer", "params": {}}}),
    ("onebit_freeze_step_1e30", {"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10**30}}}),
    ("onebit_freeze_step_5000_digits", {"optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 10**5000}}}),
    ("zero_stage_5000_digits", {"zero_optimization": {"stage": 10**5000}}),
    ("zero_stage_negative_5000_digits", {"zero_optimization": {"stage": -(10**5000)}}),
    ("offload_ratio_huge_int", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                         "ratio": 10**400}}}),
    ("dict_100k_deep", {"optimizer": _deep(100_000)}),
    ("key_5000_digit_int", {10**5000: 1}),
]:  # fmt: skip
    CASES.append(Case(f"config/deepspeed/{_name}", functools.partial(_deepspeed, _cfg)))

# -- DeepSpeed: files ---------------------------------------------------------------------------------------------

for _name, _content in [
    ("file_100k_deep", "[" * 100_000 + "]" * 100_000),
    ("file_deep_object", '{"optimizer": ' + '{"a": ' * 60 + "1" + "}" * 61),
    ("file_5000_digit_int", '{"zero_optimization": {"stage": ' + "9" * 5000 + "}}"),
    ("file_lr_infinity", '{"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}'),
    ("file_lr_nan", '{"optimizer": {"type": "AdamW", "params": {"lr": NaN}}}'),
    ("file_over_1mib", " " * (1 << 20) + "{}"),
    ("file_not_json", "{'train_batch_size': 8,}"),
    ("file_a_list", "[1, 2]"),
    ("file_not_utf8", b'{"a": "\xff\xfe"}'),
]:
    CASES.append(Case(f"config/deepspeed/{_name}", functools.partial(_file, _content)))
CASES.append(Case("config/deepspeed/file_fifo", functools.partial(_file, None, True), timeout=20))
CASES.append(Case("config/deepspeed/file_dev_zero", functools.partial(_deepspeed_path, "/dev/zero"), timeout=20))
CASES.append(Case("config/deepspeed/file_a_directory", functools.partial(_deepspeed_path, "/tmp"), timeout=20))

# -- Megatron-Core ------------------------------------------------------------------------------------------------

for _name, _extra in [
    ("experts_2_pow_40", {"num_moe_experts": 2**40}),
    ("experts_5000_digits", {"num_moe_experts": 10**5000}),
    ("hidden_2_pow_40", {"hidden_size": 2**40}),
    ("ffn_5000_digits", {"moe_ffn_hidden_size": 10**5000}),
    ("topk_5000_digits", {"moe_router_topk": 10**5000}),
    ("scaling_1e300", {"moe_router_topk_scaling_factor": 1e300}),
    ("scaling_inf", {"moe_router_topk_scaling_factor": math.inf}),
    ("aux_coeff_1e300", {"moe_aux_loss_coeff": 1e300}),
    ("aux_coeffs_sum_over_fp32", {"moe_router_load_balancing_type": ["aux_loss", "aux_loss"],
                                  "moe_aux_loss_coeff": [3e38, 3e38]}),
    ("z_coeff_huge_int", {"moe_z_loss_coeff": 10**400}),
    ("capacity_1e300", {"moe_expert_capacity_factor": 1e300}),
    ("bias_rate_1e308", {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                         "moe_router_bias_update_rate": 1e308}),
    ("groups_5000_digits", {"moe_router_group_topk": 1, "moe_router_num_groups": 10**5000}),
    ("expert_tp_5000_digits", {"expert_tensor_parallel_size": 10**5000}),
    ("expert_parallel_2_pow_40", {"expert_model_parallel_size": 2**40}),
    ("shared_width_2_pow_40", {"moe_shared_expert_intermediate_size": 2**40}),
    ("topk_deep_list", {"moe_router_topk": _deep(100_000)}),
]:  # fmt: skip
    CASES.append(Case(f"config/megatron/{_name}", functools.partial(_megatron, _extra)))

# -- PyTorch's PowerSGD hook state --------------------------------------------------------------------------------

for _field, _value in [
    ("matrix_approximation_rank", 2**40),
    ("orthogonalization_epsilon", math.nan),
    ("orthogonalization_epsilon", -1.0),
    ("start_powerSGD_iter", 10**30),
    ("min_compression_rate", 10**400),
    ("min_compression_rate", math.inf),
]:
    CASES.append(Case(f"config/torch_hook/{_field}_{_value!s:.12}", functools.partial(_powersgd, _field, _value)))


# -- accepted configurations build their objects -----------------------------------------------------------------


def _trains(make_opt) -> bool:
    p = torch.nn.Parameter(torch.ones(4, 3))
    opt = make_opt([p])
    for _ in range(3):
        opt.zero_grad()
        ((p - 2) ** 2).sum().backward()
        opt.step()
    return bool(torch.isfinite(p).all()) and float((p - 2).abs().max()) < 1.0


def _zero_offload_builds() -> bool:
    from torsh_kernels.parallel import OffloadedOptimizer

    m = _deepspeed({
        **_OFFLOADED,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0}},
        "communication_data_type": "bf16",
    })  # fmt: skip
    return isinstance(m.build_optimizer([torch.nn.Parameter(torch.ones(1))]), OffloadedOptimizer) and _trains(
        m.build_optimizer
    )


def _sgd_at_the_bounds_builds() -> bool:
    m = _deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.0, "dampening": 1.0}}})
    return _trains(m.build_optimizer)


def _megatron_builds() -> bool:
    m = _megatron({"moe_ffn_hidden_size": 8, "moe_expert_capacity_factor": 1.25, "moe_aux_loss_coeff": 1e-2})
    layer = m.moe_layer(provider="torch")
    y = layer(torch.randn(6, 16))
    return tuple(y.shape) == (6, 16) and bool(torch.isfinite(y).all())


def _powersgd_builds() -> bool:
    from torsh_kernels.compression import PowerSGD

    m = _powersgd("orthogonalization_epsilon", 0.0)
    return isinstance(m.compressor, PowerSGD) and m.compressor.rank == 2 and m.hook_state() is not None


def _file_builds() -> bool:
    m = _file('{"optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": true, "adam_w_mode": false}}}')
    return m.optimizer is torch.optim.Adam and _trains(m.build_optimizer)


for _name, _fn in [
    ("zero_offload_adamw", _zero_offload_builds),
    ("sgd_at_the_bounds", _sgd_at_the_bounds_builds),
    ("megatron_layer", _megatron_builds),
    ("powersgd_state", _powersgd_builds),
    ("json_file", _file_builds),
]:
    CASES.append(Case(f"config/accepted/{_name}", _fn, "ok", check=bool, timeout=60))
