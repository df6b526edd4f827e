"""A DeepSpeed config's ``optimizer`` section: the torch optimizer and its arguments, OneBitAdam as Sign
compression before AdamW.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compression import Sign
from .common import BAD, Walk, check_bool, check_dict, check_int, show_value
from .migration import Migration
from .optimizer_checks import check_optimizer

__all__ = ["map_optimizer"]


# DeepSpeed's own optimizers (runtime/config.py DEEPSPEED_OPTIMIZERS) without a torch equivalent
_DS_NO_TORCH = {
    "lamb": "LAMB: torch has no LAMB optimizer",
    "onebitlamb": "1-bit LAMB: torch has no LAMB optimizer (OneBitAdam maps, to Sign compression and AdamW)",
    "zerooneadam": "0/1 Adam skips communication on local steps, which torsh's hook never does (OneBitAdam maps, "
    "to Sign compression and AdamW)",
    "muadam": "MuAdam (the mup package): not a torch optimizer",
    "muadamw": "MuAdamW (the mup package): not a torch optimizer",
    "musgd": "MuSGD (the mup package): not a torch optimizer",
    "lion": "Lion: DeepSpeed's own optimizer; torch has none",
    "muon": "Muon: DeepSpeed's own implementation, whose update is not torch.optim.Muon's",
}
_ONEBIT_NOTE = (
    "1-bit Adam compresses Adam's momentum after freeze_step, then freezes the variance, applies no bias "
    "correction and skips the parameter update of its very first step; torsh compresses the gradient with Sign "
    "(1-bit signs with worker and server error feedback, the two-phase all-to-all + all-gather of DeepSpeed's "
    "compressed all-reduce) after the same number of plain steps, and runs an ordinary AdamW: the same bytes on "
    "the wire, a different optimizer trajectory. 1-D tensors (biases, norms) travel uncompressed in torsh"
)


def map_optimizer(w: Walk, cfg: dict, m: Migration, stage: int) -> bool:
    """The optimizer section; returns whether it is OneBitAdam (which also sets the compressor)."""
    key = "optimizer"
    if not w.take(cfg, key):
        return False
    sec = check_dict(w, key, cfg[key])
    if sec is BAD:
        return False
    for k in sec:
        dk = f"{key}.{k}"
        if k in ("type", "params") or not w.take(sec, k, dk):
            continue
        if k == "legacy_fusion":
            w.skip(dk, "DeepSpeed's fused fp16 optimizer variant (speed, not results)")
        else:
            w.bad(dk, "an optimizer section holds 'type' and 'params'")
    if not w.take(sec, "type", f"{key}.type"):
        if "type" not in sec:
            w.bad(f"{key}.type", "missing: the optimizer's name")
        return False
    name = sec["type"]
    if not isinstance(name, str):
        w.bad(f"{key}.type", f"must be a string, got {show_value(name)}")
        return False
    pk = f"{key}.params"
    params: dict[str, Any] = {}
    if w.take(sec, "params", pk) and sec["params"] is None:
        w.skip(pk, "null: the optimizer's defaults")
    elif pk not in w.ignored and "params" in sec:
        if check_dict(w, pk, sec["params"]) is BAD:
            return False
        params = {k: v for k, v in sec["params"].items() if w.take(sec["params"], k, f"{pk}.{k}")}
    if "max_grad_norm" in params:
        w.bad(
            f"{pk}.max_grad_norm",
            "DeepSpeed refuses it too: clip with torch.nn.utils.clip_grad_norm_ (DeepSpeed's gradient_clipping)",
        )
        del params["max_grad_norm"]
    low = name.lower()
    onebit = low == "onebitadam"
    if low in ("adam", "adamw"):
        cls, kwargs = _ds_adam(w, pk, low, params)
    elif onebit:
        cls, kwargs = _ds_onebit_adam(w, pk, params, m, stage)
    elif low == "adagrad":
        cls, kwargs = torch.optim.Adagrad, params
    elif low in _DS_NO_TORCH:
        w.bad(f"{key}.type", f"{name!r}: {_DS_NO_TORCH[low]}")
        return False
    else:
        cls = getattr(torch.optim, name, None)  # DeepSpeed's fallback: torch.optim.<type>
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            w.bad(
                f"{key}.type",
                f"{name!r} is neither a DeepSpeed optimizer torsh maps (Adam, AdamW, OneBitAdam, "
                "Adagrad) nor a torch.optim class",
            )
            return False
        kwargs = params
    if cls is None:
        return onebit
    for k in ("betas", "etas", "step_sizes", "eps"):
        if isinstance(kwargs.get(k), list):
            kwargs[k] = tuple(kwargs[k])
    if check_optimizer(w, pk, cls, kwargs, offloaded=m.offload_optimizer is not None):
        m.optimizer, m.optimizer_kwargs = cls, kwargs
        w.map(f"{key}.type", f"optimizer=torch.optim.{cls.__name__}")
        for k in kwargs:
            if k in params:  # (a default made explicit is in the notes, not an input key)
                w.map(f"{pk}.{k}", f"optimizer_kwargs[{k!r}]")
    return onebit


def _ds_adam(w: Walk, pk: str, low: str, params: dict) -> tuple[type | None, dict]:
    """DeepSpeed's Adam/AdamW (runtime/engine.py, _configure_basic_optimizer): AdamW's decoupled weight decay
    unless adam_w_mode is false for "Adam"; FusedAdam / DeepSpeedCPUAdam unless torch_adam, with their
    defaults (weight_decay 0)."""
    params = dict(params)
    ok = True
    flags = {"torch_adam": False, "adam_w_mode": True}  # DeepSpeed's defaults
    for k in flags:
        if k in params:
            v = check_bool(w, f"{pk}.{k}", params.pop(k))
            if v is BAD:
                ok = False
            else:
                flags[k] = v
                w.map(f"{pk}.{k}", "which torch optimizer (Adam or AdamW) and whose defaults")
    decoupled = low == "adamw" or flags["adam_w_mode"]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if "bias_correction" in params:
        bc = check_bool(w, f"{pk}.bias_correction", params.pop("bias_correction"))
        if bc is False:
            w.bad(f"{pk}.bias_correction", "false: torch's Adam always corrects the moments' bias")
            ok = False
        elif bc is True:
            w.skip(f"{pk}.bias_correction", "true: torch's Adam always corrects the moments' bias")
    for k, why in (
        ("set_grad_none", "how DeepSpeed's FusedAdam frees gradients (zero_grad(set_to_none=True))"),
        ("fp32_optimizer_states", "DeepSpeedCPUAdam's state dtype: OffloadedOptimizer's state_format"),
    ):
        if k in params:
            params.pop(k)
            w.skip(f"{pk}.{k}", why)
    if not flags["torch_adam"] and "weight_decay" not in params:
        params["weight_decay"] = 0.0
        w.note(
            f"{pk}.weight_decay",
            "not given: DeepSpeed's FusedAdam and DeepSpeedCPUAdam default to 0, passed "
            "explicitly (torch's AdamW would default to 0.01)",
        )
    return (cls if ok else None), params


def _ds_onebit_adam(w: Walk, pk: str, params: dict, m: Migration, stage: int) -> tuple[type | None, dict]:
    """OneBitAdam (runtime/fp16/onebit/adam.py): Sign after freeze_step plain iterations, then AdamW."""
    params = dict(params)
    ok = True
    if stage > 0:
        w.bad(
            "optimizer.type",
            f"OneBitAdam under ZeRO stage {stage}: DeepSpeed refuses it too (1-bit Adam is not compatible with ZeRO)",
        )
        ok = False
    given = "freeze_step" in params
    freeze = check_int(w, f"{pk}.freeze_step", params.pop("freeze_step")) if given else 100000  # OnebitAdam's default
    if freeze is BAD:
        ok = False
    if "amsgrad" in params:
        v = check_bool(w, f"{pk}.amsgrad", params.pop("amsgrad"))
        if v is True:
            w.bad(f"{pk}.amsgrad", "1-bit Adam has no AMSGrad variant (DeepSpeed refuses it)")
            ok = False
        elif v is False:
            w.skip(f"{pk}.amsgrad", "false")
    if "eps_inside_sqrt" in params:
        v = check_bool(w, f"{pk}.eps_inside_sqrt", params.pop("eps_inside_sqrt"))
        if v is True:
            w.bad(f"{pk}.eps_inside_sqrt", "true: torch's Adam adds eps outside the square root")
            ok = False
        elif v is False:
            w.skip(f"{pk}.eps_inside_sqrt", "false: eps outside the square root, as torch's Adam")
    if "bias_correction" in params and check_bool(w, f"{pk}.bias_correction", params.pop("bias_correction")) is not BAD:
        w.skip(
            f"{pk}.bias_correction",
            "1-bit Adam reads it but corrects no bias; torch's AdamW always does (see the note on optimizer.type)",
        )
    for k in ("cuda_aware", "comm_backend_name"):
        if k in params:
            params.pop(k)
            w.skip(
                f"{pk}.{k}", "transport: the hook runs over DDP's process group (NCCL, gloo) or any torsh Communicator"
            )
    params.setdefault("weight_decay", 0.0)  # OnebitAdam's default; decoupled, as AdamW's
    if ok:
        m.compressor = Sign()
        m.hook = {"start_iter": freeze, "min_numel": 0}
        w.note("optimizer.type", _ONEBIT_NOTE)
        if given:
            w.map(f"{pk}.freeze_step", "compressor=Sign() after hook['start_iter'] plain iterations")
        else:
            w.note(f"{pk}.freeze_step", "not given: OnebitAdam's default, 100000 (hook['start_iter'])")
    return (torch.optim.AdamW if ok else None), params
