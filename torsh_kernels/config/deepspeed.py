"""A DeepSpeed config as torsh objects (:func:`from_deepspeed`): the top-level keys and the gradient
communication; the ZeRO section is :mod:`.deepspeed_zero`'s, the optimizer section :mod:`.deepspeed_optimizer`'s.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ..compression import BF16, FP16
from ..errors import ArgumentTypeError
from .common import BAD, CHECKPOINT_REASON, LOGGING_REASON, Walk, check_bool, check_choice, short_value, unknown_key
from .deepspeed_optimizer import map_optimizer
from .deepspeed_zero import map_zero
from .migration import Migration
from .reading import MAX_DEPTH, deeper_than, read_json_object

__all__ = ["from_deepspeed"]


_BATCH = "batch sizing: your data loader and training loop (accumulate with ddp.no_sync())"
_PRECISION = (
    "mixed precision: torch.autocast and torch.amp.GradScaler (the hook lets NaN/Inf through to the scaler, "
    "nonfinite='auto')"
)
_ELSEWHERE = "a DeepSpeed feature outside gradient communication, offload and MoE routing"
_SCALING = (
    "when the 1/world_size scaling happens (rounding and overflow, not the average): torsh's FP16 divides "
    "before the sum, as PyTorch's fp16_compress_hook; BF16 and uncompressed averaging divide after"
)

_DS_IGNORED = {
    "train_batch_size": _BATCH,
    "train_micro_batch_size_per_gpu": _BATCH,
    "gradient_accumulation_steps": _BATCH,
    "dataloader_drop_last": _BATCH,
    "elasticity": _BATCH,
    "scheduler": "learning-rate schedule: torch.optim.lr_scheduler on the optimizer (OffloadedOptimizer keeps its "
    "hyperparameters in param_groups, so schedulers work)",
    "fp16": _PRECISION,
    "bf16": _PRECISION,
    "bfloat16": _PRECISION,
    "amp": _PRECISION,
    "torch_autocast": _PRECISION,
    "data_types": _PRECISION,
    "gradient_clipping": "torch.nn.utils.clip_grad_norm_ before optimizer.step()",
    "prescale_gradients": _SCALING,
    "gradient_predivide_factor": _SCALING,
    "sparse_gradients": "the hook averages sparse gradients (nn.Embedding(sparse=True)) uncompressed, as DDP does",
    "steps_per_print": LOGGING_REASON,
    "wall_clock_breakdown": LOGGING_REASON,
    "memory_breakdown": LOGGING_REASON,
    "dump_state": LOGGING_REASON,
    "tensorboard": LOGGING_REASON,
    "wandb": LOGGING_REASON,
    "csv_monitor": LOGGING_REASON,
    "comet": LOGGING_REASON,
    "comms_logger": LOGGING_REASON,
    "flops_profiler": LOGGING_REASON,
    "timers": LOGGING_REASON,
    "log_level": LOGGING_REASON,
    "activation_checkpointing": "activation checkpointing: torch.utils.checkpoint",
    "zero_allow_untested_optimizer": "DeepSpeed's optimizer whitelist: OffloadedOptimizer wraps any torch optimizer",
    "zero_force_ds_cpu_optimizer": "DeepSpeed's choice of CPU optimizer: OffloadedOptimizer runs the torch optimizer "
    "on the host",
    "checkpoint": CHECKPOINT_REASON,
    "nebula": CHECKPOINT_REASON,
    "datastates": CHECKPOINT_REASON,
    "aio": "NVMe I/O (ZeRO-Infinity), which torsh does not do",
    "expert_parallel": "DeepSpeed's automatic expert parallelism: put torsh's ExpertParallelMoE in the model",
    "autotuning": "DeepSpeed's configuration autotuner (torsh's autotuner tunes kernels: torsh tune)",
    "compression_training": "model compression (quantization-aware training, pruning), not gradient compression",
    **dict.fromkeys(
        (
            "sparse_attention",
            "pipeline",
            "tensor_parallel",
            "sequence_parallel_size",
            "seq_parallel_communication_data_type",
            "use_data_before_expert_parallelism",
            "hybrid_engine",
            "compile",
            "graph_harvesting",
            "progressive_layer_drop",
            "eigenvalue",
            "quantize_training",
            "weight_quantization",
            "data_efficiency",
            "curriculum_learning",
            "vocabulary_size",
            "disable_allgather",
        ),
        _ELSEWHERE,
    ),
}
_DS_HANDLED = ("optimizer", "zero_optimization", "communication_data_type", "fp32_allreduce", "gradient_allreduce_op")


_TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels, the limit (DeepSpeed's settings nest about 4 deep)"


def _load_deepspeed(w: Walk, ds_config: Any) -> dict:
    """The settings as a dict of their own: a copy of the dict given (a top-level key nested deeper than
    MAX_DEPTH is refused and left out: copying it would recurse that deep), or the JSON file's object."""
    if isinstance(ds_config, Mapping):
        cfg = dict(ds_config)
        for key in [k for k, v in cfg.items() if deeper_than(v, MAX_DEPTH - 1)]:
            if not isinstance(key, str) or w.take(cfg, key):  # (else left out with ignore=, and so listed)
                w.bad(key if isinstance(key, str) else short_value(key), _TOO_DEEP)
            del cfg[key]
        return copy.deepcopy(cfg)
    if not isinstance(ds_config, (str, os.PathLike)):
        raise ArgumentTypeError(
            "from_deepspeed: ds_config must be a dict or the path of a DeepSpeed JSON file, got "
            f"{type(ds_config).__name__}"
        )
    return read_json_object(ds_config, "from_deepspeed")


def from_deepspeed(ds_config: Mapping[str, Any] | str | os.PathLike, *, ignore: Iterable[str] = ()) -> Migration:
    """Map a DeepSpeed config (a dict, or the path of its JSON file) to torsh.

    Mapped: ``communication_data_type`` (and the older ``fp32_allreduce``) to the compressor; ``optimizer``
    (Adam / AdamW with DeepSpeed's ``adam_w_mode`` and defaults, OneBitAdam, Adagrad, any ``torch.optim`` name)
    to the optimizer class and arguments, OneBitAdam also to :class:`~torsh_kernels.compression.Sign` after
    ``freeze_step`` plain iterations; ``zero_optimization.offload_optimizer`` (device "cpu", stages 1-3) to
    :class:`~torsh_kernels.parallel.OffloadedOptimizer` with fp32 state, as DeepSpeed keeps it;
    ``offload_param`` (device "cpu", stage 3) to :class:`~torsh_kernels.parallel.ParameterOffloader` in the
    training dtype; ZeRO++'s ``zero_quantized_weights`` / ``zero_quantized_gradients`` (stage 3) to FSDP2's
    quantized comms. The rest is in ``ignored`` with its reason, or named in the error. ``ignore``: dotted keys
    to leave out knowingly (a newer DeepSpeed key, say)."""
    w = Walk("from_deepspeed", ignore)
    cfg = _load_deepspeed(w, ds_config)
    m = Migration(source="deepspeed")
    for key in cfg:
        if not isinstance(key, str):
            w.bad(short_value(key), "keys must be strings")
        elif not w.take(cfg, key) or key in _DS_HANDLED:
            continue
        elif key in _DS_IGNORED:
            w.skip(key, _DS_IGNORED[key])
        else:
            w.bad(key, unknown_key(key, "a DeepSpeed setting"))
    fp16 = _enabled(cfg, "fp16")
    bf16 = _enabled(cfg, "bf16") or _enabled(cfg, "bfloat16")
    stage = map_zero(w, cfg, m, fp16, bf16)
    onebit = map_optimizer(w, cfg, m, stage)
    _ds_communication(w, cfg, m, onebit, fp16, bf16)
    w.finish(m)
    return m


def _enabled(cfg: dict, key: str) -> bool:
    sec = cfg.get(key)
    return isinstance(sec, Mapping) and sec.get("enabled") is True


def _ds_communication(w: Walk, cfg: dict, m: Migration, onebit: bool, fp16: bool, bf16: bool) -> None:
    key = "communication_data_type"
    wire = None  # not given: the gradients' own dtype
    given = w.take(cfg, key)
    if given and cfg[key] is None:
        w.skip(key, "null: the gradients' own dtype")
        given = False
    elif given:
        wire = check_choice(w, key, cfg[key], ("fp16", "bf16", "fp32"), lower=True)
    if w.take(cfg, "fp32_allreduce"):
        on = check_bool(w, "fp32_allreduce", cfg["fp32_allreduce"])
        if on is True and wire in ("fp16", "bf16"):
            w.bad("fp32_allreduce", f"true contradicts communication_data_type={cfg[key]!r}")
        elif on is True:
            w.map("fp32_allreduce", "compressor=None: fp32 averaging")
            wire = wire or "fp32"
        elif on is False:
            w.skip("fp32_allreduce", "false: the gradients' own dtype")
    if w.take(cfg, "gradient_allreduce_op"):
        op = check_choice(w, "gradient_allreduce_op", cfg["gradient_allreduce_op"], ("mean", "sum"), lower=True)
        if op == "sum":
            w.bad(
                "gradient_allreduce_op",
                "'sum' leaves the gradients summed over the ranks; torsh's hook averages "
                "them (scale the loss or the learning rate by the world size instead)",
            )
        elif op == "mean":
            w.map("gradient_allreduce_op", "the average, which the hook computes")
    if wire is BAD:
        return
    if onebit:
        if wire in ("fp16", "bf16"):
            w.bad(
                key,
                f"{cfg[key]!r} together with OneBitAdam: torsh's hook runs one compressor (Sign, for "
                "OneBitAdam); drop one of them",
            )
        elif given:
            w.map(key, "the warm-up's plain all-reduces, which send the fp32 gradients as they are")
        return
    if wire == "fp16":
        m.compressor = FP16()
        w.map(key, "compressor=FP16()")
        w.note(
            key,
            "torsh's FP16 divides by the world size before the fp16 sum (as PyTorch's fp16_compress_hook), "
            "so the sum cannot overflow; DeepSpeed sums, then divides (unless prescale_gradients): the same "
            "average up to fp16 rounding",
        )
    elif wire == "bf16":
        m.compressor = BF16()
        w.map(key, "compressor=BF16()")
    elif wire == "fp32":
        if given:
            w.map(key, "compressor=None: fp32 averaging, as DDP without a hook")
    elif fp16 or bf16:
        dt = "fp16" if fp16 else "bf16"
        w.note(
            key,
            f"not given: under {dt} training DeepSpeed all-reduces the {dt} gradients it holds; with "
            f"torch.autocast the gradients are fp32 and the hook sends them so (give "
            f"communication_data_type={dt!r} for a {dt} wire)",
        )
