"""Settings from elsewhere as torsh objects: a DeepSpeed config (:func:`from_deepspeed`), Megatron-Core's MoE
settings (:func:`from_megatron`) and PyTorch's DDP comm hooks (:func:`from_torch_hook`).

Each returns a :class:`Migration`: the gradient compressor and the hook's arguments, the torch optimizer and
the :class:`~torsh_kernels.parallel.OffloadedOptimizer` settings, the
:class:`~torsh_kernels.parallel.ParameterOffloader` settings, FSDP2's quantized comms, the MoE layer's
arguments, and helpers that build each. Every key of the input ends in one of three places:

- **mapped**: it became part of a torsh object or argument; where torsh's meaning differs from the source's,
  ``notes[key]`` says how (e.g. 1-bit Adam compresses the momentum, torsh's :class:`~torsh_kernels.compression.Sign`
  the gradient);
- ``ignored[key]``: outside torsh's scope (batch sizes, learning-rate schedules, logging, sharding, which is
  torch's FSDP2), with the reason and where that concern lives instead;
- the error: :class:`~torsh_kernels.errors.ConfigMappingError`, raised once the whole input was examined,
  with ``keys`` naming every key that cannot be mapped (unknown keys, values torsh has no equivalent for,
  such as an NVMe offload device, and wrong types) and why.

A key the caller knows to be irrelevant can be left out with ``ignore=[dotted keys]``; it is then listed in
``ignored`` as left out on request. Nothing is dropped silently.

This module builds objects of :mod:`torsh_kernels.parallel` and :mod:`torsh_kernels.compression` and sits
above them; it imports neither DeepSpeed nor Megatron (their objects are read by attribute).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..collectives.communicator import as_communicator
from ..compression import BF16, FP16, Compressor, PowerSGD, Sign
from ..errors import ArgumentTypeError, ConfigMappingError, InvalidArgumentError
from ..parallel import CompressionHookState, ExpertParallelMoE, MoELayer, OffloadedOptimizer, ParameterOffloader

__all__ = ["Migration", "from_deepspeed", "from_megatron", "from_torch_hook"]


@dataclass(kw_only=True, slots=True)
class Migration:
    """What a configuration from elsewhere becomes in torsh (see the module docstring)."""

    source: str
    """Where the settings came from: "deepspeed", "megatron" or "torch_hook"."""
    compressor: Compressor | None = None
    """The gradient compressor for :func:`~torsh_kernels.parallel.compression_hook` (None: plain averaging)."""
    hook: dict[str, Any] = field(default_factory=dict)
    """Further :class:`~torsh_kernels.parallel.CompressionHookState` arguments (``start_iter``, ``min_numel``,
    ``policy``, ``process_group``)."""
    optimizer: type[torch.optim.Optimizer] | None = None
    """The torch optimizer class the source names (None: it names none)."""
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Its arguments (lr, betas, eps, weight_decay, ...), the source's defaults made explicit."""
    offload_optimizer: dict[str, Any] | None = None
    """:class:`~torsh_kernels.parallel.OffloadedOptimizer` arguments besides the optimizer (``state_format``),
    or None: the optimizer stays where the parameters are."""
    offload_params: dict[str, Any] | None = None
    """:class:`~torsh_kernels.parallel.ParameterOffloader` arguments (``fmt``), or None: no parameter offload."""
    quantized_comm: dict[str, Any] | None = None
    """:func:`~torsh_kernels.parallel.apply_quantized_comm` arguments for an FSDP2 model (``weights``, ``grads``,
    ``error_feedback``), or None."""
    moe: dict[str, Any] | None = None
    """:class:`~torsh_kernels.parallel.MoELayer` / :class:`~torsh_kernels.parallel.ExpertParallelMoE` arguments,
    or None: no MoE layer. ``hidden`` and ``ffn_hidden`` are absent when the source does not give them."""
    expert_parallel_size: int | None = None
    """Ranks the experts are spread over (Megatron's ``expert_model_parallel_size``), or None."""
    mapped: dict[str, str] = field(default_factory=dict)
    """Each mapped key of the input and the torsh argument it became."""
    ignored: dict[str, str] = field(default_factory=dict)
    """Keys outside torsh's scope, each with the reason and where that concern lives instead."""
    notes: dict[str, str] = field(default_factory=dict)
    """Mapped keys whose torsh meaning differs from the source's, or defaults the source implied: how."""

    def __post_init__(self) -> None:
        if self.source not in ("deepspeed", "megatron", "torch_hook"):
            raise InvalidArgumentError(
                f"Migration: source={self.source!r}; expected 'deepspeed', 'megatron' or 'torch_hook'"
            )
        if self.compressor is not None and not isinstance(self.compressor, Compressor):
            raise ArgumentTypeError(
                f"Migration: compressor must be a torsh Compressor or None, got {type(self.compressor).__name__}"
            )

    def summary(self) -> str:
        """What became of every key, one line each: mapped (and to what), ignored (and why), then the notes."""
        lines = [f"from {self.source}:"]
        lines += [f"  mapped   {k}: {v}" for k, v in self.mapped.items()]
        lines += [f"  ignored  {k}: {v}" for k, v in self.ignored.items()]
        lines += [f"  note     {k}: {v}" for k, v in self.notes.items()]
        return "\n".join(lines)

    # -- builders ---------------------------------------------------------------------------------------

    def hook_state(self, **overrides: Any) -> CompressionHookState:
        """The DDP hook's state: ``ddp.register_comm_hook(m.hook_state(), compression_hook)``. ``overrides``
        replace or add :class:`~torsh_kernels.parallel.CompressionHookState` arguments (``process_group``, ...)."""
        kwargs = {"compressor": self.compressor, **self.hook, **overrides}
        return CompressionHookState(**kwargs)

    def build_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        """The source's optimizer over ``params``: an :class:`~torsh_kernels.parallel.OffloadedOptimizer`
        wrapping it where the source offloads the optimizer, else the torch optimizer itself."""
        if self.optimizer is None:
            raise InvalidArgumentError(
                f"Migration.build_optimizer: the {self.source} settings name no optimizer; build your torch "
                "optimizer and pass it to offload(optimizer) if the settings offload it"
            )
        if self.offload_optimizer is not None:
            return OffloadedOptimizer(params, self.optimizer, **self.offload_optimizer, **self.optimizer_kwargs)
        return self.optimizer(params, **self.optimizer_kwargs)

    def offload(self, optimizer: torch.optim.Optimizer) -> OffloadedOptimizer:
        """An :class:`~torsh_kernels.parallel.OffloadedOptimizer` with the offload settings, wrapping an
        optimizer you built: its class, parameter groups and hyperparameters as they are (its state too,
        if it has stepped)."""
        what = "Migration.offload"
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentTypeError(
                f"{what}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, OffloadedOptimizer):
            raise ArgumentTypeError(f"{what}: this optimizer is offloaded already")
        if self.offload_optimizer is None:
            raise InvalidArgumentError(f"{what}: the {self.source} settings do not offload the optimizer")
        cls = type(optimizer)
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        groups = [dict(g) for g in optimizer.param_groups]
        off = OffloadedOptimizer(groups, cls, **self.offload_optimizer, **defaults)
        if optimizer.state:
            off.load_state_dict(optimizer.state_dict())
        return off

    def offload_parameters(self, module: torch.nn.Module, **overrides: Any) -> ParameterOffloader:
        """A :class:`~torsh_kernels.parallel.ParameterOffloader` over ``module`` with the offload settings."""
        if self.offload_params is None:
            raise InvalidArgumentError(
                f"Migration.offload_parameters: the {self.source} settings do not offload parameters"
            )
        return ParameterOffloader(module, **{**self.offload_params, **overrides})

    def apply_quantized_comm(self, module: torch.nn.Module, **overrides: Any) -> list:
        """:func:`~torsh_kernels.parallel.apply_quantized_comm` on an FSDP2 model (after ``fully_shard``)."""
        if self.quantized_comm is None:
            raise InvalidArgumentError(
                f"Migration.apply_quantized_comm: the {self.source} settings quantize no FSDP communication"
            )
        from ..parallel import apply_quantized_comm

        return apply_quantized_comm(module, **{**self.quantized_comm, **overrides})

    def moe_layer(self, **overrides: Any) -> MoELayer:
        """A :class:`~torsh_kernels.parallel.MoELayer` with the MoE settings; ``overrides`` give what the
        source did not (``hidden``, ``ffn_hidden``) or replace arguments (``device``, ``dtype``, ...)."""
        return MoELayer(**self._moe_kwargs("Migration.moe_layer", overrides))

    def expert_parallel_moe(self, comm: Any, **overrides: Any) -> ExpertParallelMoE:
        """An :class:`~torsh_kernels.parallel.ExpertParallelMoE` over ``comm`` (a Communicator, ProcessGroup or
        DeviceMesh) with the MoE settings; its world size must be the source's expert-parallel size."""
        what = "Migration.expert_parallel_moe"
        kwargs = self._moe_kwargs(what, overrides)
        comm = as_communicator(
            comm,
            what,
            dim=kwargs.pop("mesh_dim", None),
            needs=("rank", "world_size", "all_to_all", "broadcast", "all_reduce"),
        )
        if self.expert_parallel_size is not None and comm.world_size != self.expert_parallel_size:
            raise InvalidArgumentError(
                f"{what}: the communicator has {comm.world_size} rank{'s' if comm.world_size != 1 else ''}; the "
                f"{self.source} settings spread the experts over {self.expert_parallel_size} "
                "(expert_model_parallel_size)"
            )
        return ExpertParallelMoE(comm=comm, **kwargs)

    def _moe_kwargs(self, what: str, overrides: dict[str, Any]) -> dict[str, Any]:
        if self.moe is None:
            raise InvalidArgumentError(f"{what}: the {self.source} settings hold no MoE layer (no number of experts)")
        kwargs = {**self.moe, **overrides}
        missing = [k for k in ("hidden", "ffn_hidden") if k not in kwargs]
        if missing:
            raise InvalidArgumentError(
                f"{what}: the {self.source} settings give no {' and no '.join(missing)}; pass "
                + ", ".join(f"{k}=..." for k in missing)
            )
        return kwargs


# -- shared plumbing -----------------------------------------------------------------------------------

_BAD = object()
"""A value that failed its check (the reason is recorded)."""


class _Walk:
    """What one mapping found, by dotted key: mapped keys, ignored keys, notes, errors."""

    __slots__ = ("errors", "ignore", "ignored", "mapped", "notes", "what")

    def __init__(self, what: str, ignore: Iterable[str]) -> None:
        if isinstance(ignore, str) or not isinstance(ignore, Iterable):
            raise ArgumentTypeError(f"{what}: ignore must be a list of dotted keys, got {ignore!r}")
        self.what = what
        self.ignore: set[str] = set()
        for k in ignore:
            if not isinstance(k, str):
                raise ArgumentTypeError(f"{what}: ignore must hold dotted keys (str), got {k!r}")
            self.ignore.add(k)
        self.errors: dict[str, str] = {}
        self.mapped: dict[str, str] = {}
        self.ignored: dict[str, str] = {}
        self.notes: dict[str, str] = {}

    def take(self, d: Mapping, key: str, dotted: str | None = None) -> bool:
        """Whether ``key`` is in ``d`` and to be mapped (False, and listed as ignored, where the caller asked
        to leave it out with ``ignore=``)."""
        if key not in d:
            return False
        dotted = dotted or key
        if dotted in self.ignore:
            self.ignored[dotted] = "left out on request (ignore=)"
            return False
        return True

    def bad(self, key: str, reason: str) -> object:
        self.errors.setdefault(key, reason)
        return _BAD

    def skip(self, key: str, reason: str) -> None:
        self.ignored[key] = reason

    def map(self, key: str, dest: str) -> None:
        self.mapped[key] = dest

    def note(self, key: str, text: str) -> None:
        self.notes[key] = f"{self.notes[key]}; {text}" if key in self.notes else text

    def finish(self, m: Migration) -> None:
        for k in sorted(self.ignore - set(self.ignored)):
            self.errors.setdefault(k, "named in ignore= but not in the settings")
        if self.errors:
            lines = "\n".join(f"  {k}: {r}" for k, r in self.errors.items())
            n = len(self.errors)
            raise ConfigMappingError(
                f"{self.what}: {n} setting{'s' if n > 1 else ''} cannot be mapped to torsh:\n{lines}",
                keys=self.errors,
            )
        m.mapped, m.ignored, m.notes = self.mapped, self.ignored, self.notes


def _show(v: Any) -> str:
    return f"{type(v).__name__} {v!r}"


def _auto(v: Any) -> str:
    return (
        " ('auto' is filled in by Hugging Face's Trainer: give the value itself)"
        if isinstance(v, str) and v == "auto"
        else ""
    )


def _bool(w: _Walk, key: str, v: Any) -> Any:
    return v if isinstance(v, bool) else w.bad(key, f"must be true or false, got {_show(v)}" + _auto(v))


def _int(w: _Walk, key: str, v: Any, lo: int = 0) -> Any:
    if isinstance(v, bool) or not isinstance(v, int):
        return w.bad(key, f"must be an integer, got {_show(v)}" + _auto(v))
    return v if v >= lo else w.bad(key, f"must be >= {lo}, got {v}")


def _num(w: _Walk, key: str, v: Any, lo: float = 0.0, *, strict: bool = False) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return w.bad(key, f"must be a finite number, got {_show(v)}" + _auto(v))
    if v < lo or (strict and v == lo):
        return w.bad(key, f"must be {'>' if strict else '>='} {lo:g}, got {v}")
    return float(v)


def _choice(w: _Walk, key: str, v: Any, options: tuple[str, ...], *, lower: bool = False) -> Any:
    s = v.lower() if lower and isinstance(v, str) else v
    if not isinstance(s, str) or s not in options:
        return w.bad(key, f"must be one of {', '.join(map(repr, options))}, got {_show(v)}" + _auto(v))
    return s


def _dict(w: _Walk, key: str, v: Any) -> Any:
    return v if isinstance(v, Mapping) else w.bad(key, f"must be an object (a dict), got {_show(v)}")


def _validate_optimizer(w: _Walk, key: str, cls: type, kwargs: dict[str, Any]) -> bool:
    """Every argument is one ``cls`` takes (an error per unknown one), and ``cls`` accepts the values."""
    accepted = inspect.signature(cls.__init__).parameters
    unknown = [k for k in kwargs if k not in accepted]
    for k in unknown:
        w.bad(f"{key}.{k}", f"torch.optim.{cls.__name__} takes no argument {k!r}")
    if unknown:
        return False
    try:
        cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except (TypeError, ValueError) as e:
        w.bad(key, f"torch.optim.{cls.__name__} refuses these values: {e}")
        return False
    return True


def _unknown(key: str, where: str) -> str:
    return (
        f"not {where} torsh knows (a typo, or a newer key: leave it out with ignore=[{key!r}] if it does not "
        "change the result)"
    )


# -- DeepSpeed ----------------------------------------------------------------------------------------

_BATCH = "batch sizing: your data loader and training loop (accumulate with ddp.no_sync())"
_PRECISION = (
    "mixed precision: torch.autocast and torch.amp.GradScaler (the hook lets NaN/Inf through to the scaler, "
    "nonfinite='auto')"
)
_LOGGING = "logging and profiling: torsh's profiling layer (TORSH_TRACE, torsh timeline, torsh report)"
_CKPT = (
    "checkpointing: torch.save or torch.distributed.checkpoint (CompressionHookState and OffloadedOptimizer "
    "have state_dict())"
)
_ELSEWHERE = "a DeepSpeed feature outside gradient communication, offload and MoE routing"
_NVME = "NVMe offload (ZeRO-Infinity), which torsh does not do; DeepSpeed reads it only with device 'nvme'"
_SCALING = (
    "when the 1/world_size scaling happens (rounding and overflow, not the average): torsh's FP16 divides "
    "before the sum, as PyTorch's fp16_compress_hook; BF16 and uncompressed averaging divide after"
)
_PIN = (
    "pinned host memory: torsh pins its host buffers whenever CUDA exists and has no switch for it (speed and "
    "locked memory, not results)"
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
    "steps_per_print": _LOGGING,
    "wall_clock_breakdown": _LOGGING,
    "memory_breakdown": _LOGGING,
    "dump_state": _LOGGING,
    "tensorboard": _LOGGING,
    "wandb": _LOGGING,
    "csv_monitor": _LOGGING,
    "comet": _LOGGING,
    "comms_logger": _LOGGING,
    "flops_profiler": _LOGGING,
    "timers": _LOGGING,
    "log_level": _LOGGING,
    "activation_checkpointing": "activation checkpointing: torch.utils.checkpoint",
    "zero_allow_untested_optimizer": "DeepSpeed's optimizer whitelist: OffloadedOptimizer wraps any torch optimizer",
    "zero_force_ds_cpu_optimizer": "DeepSpeed's choice of CPU optimizer: OffloadedOptimizer runs the torch optimizer "
    "on the host",
    "checkpoint": _CKPT,
    "nebula": _CKPT,
    "datastates": _CKPT,
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

_ZERO_PERF = "how DeepSpeed's ZeRO schedules its collectives and buffers (speed and memory, not results)"
_ZERO_SHARD = (
    "ZeRO-3 parameter sharding: torch's FSDP2 (fully_shard) shards the parameters, with knobs of its own "
    "(reshard_after_forward, prefetching)"
)
_ZERO_BUCKET = "bucket sizes: DDP's bucket_cap_mb (megabytes; DeepSpeed counts elements)"
_ZERO_IGNORED = {
    **dict.fromkeys(
        (
            "contiguous_gradients",
            "overlap_comm",
            "reduce_scatter",
            "use_multi_rank_bucket_allreduce",
            "allgather_partitions",
            "sub_group_size",
            "round_robin_gradients",
            "memory_efficient_linear",
            "override_module_apply",
            "legacy_stage1",
        ),
        _ZERO_PERF,
    ),
    "reduce_bucket_size": _ZERO_BUCKET,
    "allgather_bucket_size": _ZERO_BUCKET,
    "load_from_fp32_weights": _CKPT,
    "elastic_checkpoint": _CKPT,
    "pipeline_loading_checkpoint": _CKPT,
    "save_muon_momentum_buffer_in_memory": _NVME,
    "ignore_unused_parameters": "unused parameters: DDP's find_unused_parameters",
    "zero_hpz_partition_size": "hpZ (a second weight partition within a node): FSDP2's "
    "fully_shard(reshard_after_forward=N), which torsh's QuantizedAllGather follows",
    "mics_shard_size": "MiCS (sharding within subgroups): FSDP2's HSDP on a 2-D DeviceMesh",
    "mics_hierarchical_params_gather": "MiCS (sharding within subgroups): FSDP2's HSDP on a 2-D DeviceMesh",
    "log_trace_cache_warnings": _LOGGING,
    "enable_sanity_checks": _LOGGING,
    "leaf_module": _ZERO_SHARD,
    "stage3_gather_fp16_weights_on_model_save": _ZERO_SHARD,
    **{
        f"{p}{k}": _ZERO_SHARD
        for p in ("", "stage3_")
        for k in (
            "prefetch_bucket_size",
            "param_persistence_threshold",
            "model_persistence_threshold",
            "max_live_parameters",
            "max_reuse_distance",
            "gather_16bit_weights_on_model_save",
            "module_granularity_threshold",
            "use_all_reduce_for_fetch_params",
            "allgather_sequential",
            "partition_stream_chunk_size",
        )
    },
}
_OFFLOAD_NVME = (
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "pipeline_read",
    "pipeline_write",
    "fast_init",
)
_OFFLOAD_CPU_ADAM = ("super_offload", "convert_grad_on_cpu", "cpuadam_cores_perc")

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


def _load_deepspeed(ds_config: Any) -> dict:
    what = "from_deepspeed"
    if isinstance(ds_config, Mapping):
        return copy.deepcopy(dict(ds_config))
    if not isinstance(ds_config, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"{what}: ds_config must be a dict or the path of a DeepSpeed JSON file, got {type(ds_config).__name__}"
        )
    path = Path(ds_config)
    if not path.is_file():
        raise InvalidArgumentError(f"{what}: no such file {str(path)!r} (ds_config: a dict or a JSON file's path)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"{what}: {str(path)!r} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise InvalidArgumentError(f"{what}: {str(path)!r} holds a JSON {type(cfg).__name__}, not an object")
    return cfg


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
    w = _Walk("from_deepspeed", ignore)
    cfg = _load_deepspeed(ds_config)
    m = Migration(source="deepspeed")
    for key in cfg:
        if not isinstance(key, str):
            w.bad(repr(key), "keys must be strings")
        elif not w.take(cfg, key) or key in _DS_HANDLED:
            continue
        elif key in _DS_IGNORED:
            w.skip(key, _DS_IGNORED[key])
        else:
            w.bad(key, _unknown(key, "a DeepSpeed setting"))
    fp16 = _enabled(cfg, "fp16")
    bf16 = _enabled(cfg, "bf16") or _enabled(cfg, "bfloat16")
    stage = _ds_zero(w, cfg, m, fp16, bf16)
    onebit = _ds_optimizer(w, cfg, m, stage)
    _ds_communication(w, cfg, m, onebit, fp16, bf16)
    w.finish(m)
    return m


def _enabled(cfg: dict, key: str) -> bool:
    sec = cfg.get(key)
    return isinstance(sec, Mapping) and sec.get("enabled") is True


def _ds_communication(w: _Walk, cfg: dict, m: Migration, onebit: bool, fp16: bool, bf16: bool) -> None:
    key = "communication_data_type"
    wire = None  # not given: the gradients' own dtype
    given = w.take(cfg, key)
    if given and cfg[key] is None:
        w.skip(key, "null: the gradients' own dtype")
        given = False
    elif given:
        wire = _choice(w, key, cfg[key], ("fp16", "bf16", "fp32"), lower=True)
    if w.take(cfg, "fp32_allreduce"):
        on = _bool(w, "fp32_allreduce", cfg["fp32_allreduce"])
        if on is True and wire in ("fp16", "bf16"):
            w.bad("fp32_allreduce", f"true contradicts communication_data_type={cfg[key]!r}")
        elif on is True:
            w.map("fp32_allreduce", "compressor=None: fp32 averaging")
            wire = wire or "fp32"
        elif on is False:
            w.skip("fp32_allreduce", "false: the gradients' own dtype")
    if w.take(cfg, "gradient_allreduce_op"):
        op = _choice(w, "gradient_allreduce_op", cfg["gradient_allreduce_op"], ("mean", "sum"), lower=True)
        if op == "sum":
            w.bad(
                "gradient_allreduce_op",
                "'sum' leaves the gradients summed over the ranks; torsh's hook averages "
                "them (scale the loss or the learning rate by the world size instead)",
            )
        elif op == "mean":
            w.map("gradient_allreduce_op", "the average, which the hook computes")
    if wire is _BAD:
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


def _ds_zero(w: _Walk, cfg: dict, m: Migration, fp16: bool, bf16: bool) -> int:
    """The ZeRO section: offload and ZeRO++; returns the stage (0 when absent or invalid)."""
    key = "zero_optimization"
    if not w.take(cfg, key):
        return 0
    z = cfg[key]
    if isinstance(z, bool):  # DeepSpeed's deprecated form: true means stage 1
        w.skip(key, f"the deprecated boolean form ({str(z).lower()}: stage {int(z)}); " + _stage_reason(int(z)))
        return int(z)
    if _dict(w, key, z) is _BAD:
        return 0
    stage = 0
    if w.take(z, "stage", f"{key}.stage"):
        s = _int(w, f"{key}.stage", z["stage"])
        if s is not _BAD and s > 3:
            s = w.bad(f"{key}.stage", f"must be 0, 1, 2 or 3, got {s}")
        if s is not _BAD:
            stage = s
            w.skip(f"{key}.stage", _stage_reason(s))
    sections: dict[str, tuple[str, Any]] = {}  # offload_optimizer / offload_param -> (dotted key, section)
    deprecated: dict[str, str] = {}
    for k, v in z.items():
        dk = f"{key}.{k}"
        if k == "stage" or not w.take(z, k, dk):
            continue
        if k in ("offload_optimizer", "offload_param"):
            sections[k] = (dk, v)
        elif k in ("cpu_offload", "cpu_offload_param"):  # deprecated spellings of {device: "cpu"}
            on = _bool(w, dk, v)
            if on is True:
                deprecated["offload_optimizer" if k == "cpu_offload" else "offload_param"] = dk
            elif on is False:
                w.skip(dk, "false: no offload")
        elif k == "cpu_offload_use_pin_memory":
            if _bool(w, dk, v) is not _BAD:
                w.skip(dk, _PIN)
        elif k in ("zero_quantized_weights", "zero_quantized_gradients", "zeropp_loco_param"):
            continue  # _ds_zeropp, once the stage is known
        elif k == "zero_quantized_nontrainable_weights":
            if _bool(w, dk, v) is True:
                w.bad(dk, "true: frozen weights stored quantized (for LoRA), which torsh does not do")
            elif v is False:
                w.skip(dk, "false: frozen weights stay as they are")
        elif k == "zenflow":
            if v is None:
                w.skip(dk, "null: no ZenFlow")
            else:
                w.bad(
                    dk,
                    "ZenFlow defers the update of less important gradients; OffloadedOptimizer updates every "
                    "parameter every step",
                )
        elif k in _ZERO_IGNORED:
            w.skip(dk, _ZERO_IGNORED[k])
        else:
            w.bad(dk, _unknown(dk, "a ZeRO setting"))
    for new_key, dk in deprecated.items():
        if new_key in sections:
            w.skip(dk, f"the deprecated spelling of {new_key}, which is also given and used")
        else:
            sections[new_key] = (dk, {"device": "cpu"})
    if "offload_optimizer" in sections:
        _ds_offload_optimizer(w, *sections["offload_optimizer"], stage, m)
    if "offload_param" in sections:
        _ds_offload_param(w, *sections["offload_param"], stage, m, fp16, bf16)
    _ds_zeropp(w, key, z, stage, m)
    return stage


def _stage_reason(stage: int) -> str:
    if stage == 0:
        return "stage 0: no sharding, plain data parallelism (DDP and the hook)"
    what = ("optimizer state", "optimizer state and gradients", "optimizer state, gradients and parameters")[stage - 1]
    return (
        f"stage {stage} shards the {what} over the data-parallel ranks: that is torch's FSDP2 (fully_shard), "
        "not a torsh setting; OffloadedOptimizer and apply_quantized_comm work on its shards"
    )


def _offload_device(w: _Walk, key: str, sec: Mapping) -> Any:
    dk = f"{key}.device"
    if not w.take(sec, "device", dk):
        return "none"  # DeepSpeed's default (or left out with ignore=)
    dev = _choice(w, dk, sec["device"], ("none", "cpu", "nvme"), lower=True)
    if dev == "nvme":
        return w.bad(dk, "'nvme': torsh offloads to host memory ('cpu') only")
    return dev


def _device_key(w: _Walk, key: str, sec: Mapping) -> str:
    """The key an offload section's device is reported under: its own ``device`` where the input gave one,
    else the section itself (or the deprecated boolean ``cpu_offload`` / ``cpu_offload_param`` that stands
    for a section ``{"device": "cpu"}``)."""
    deprecated = key.rsplit(".", 1)[-1] in ("cpu_offload", "cpu_offload_param")
    return f"{key}.device" if "device" in sec and f"{key}.device" not in w.ignored and not deprecated else key


def _ds_offload_optimizer(w: _Walk, key: str, sec: Any, stage: int, m: Migration) -> None:
    if _dict(w, key, sec) is _BAD:
        return
    dev = _offload_device(w, key, sec)
    for k, v in sec.items():
        dk = f"{key}.{k}"
        if k == "device" or not w.take(sec, k, dk):
            continue
        if k == "pin_memory":
            if _bool(w, dk, v) is not _BAD:
                w.skip(dk, _PIN)
        elif k == "ratio":
            r = _num(w, dk, v)
            if r is not _BAD and r != 1.0:
                w.bad(
                    dk,
                    f"{v}: updating part of the optimizer state on the GPU (ZeRO-Offload++) has no torsh "
                    "equivalent; OffloadedOptimizer updates all of it on the host (ratio 1.0)",
                )
            elif r == 1.0:
                w.skip(dk, "1.0: all of the optimizer state on the host, as OffloadedOptimizer")
        elif k in _OFFLOAD_CPU_ADAM:
            w.skip(dk, "how DeepSpeed's CPU optimizer runs (speed, not results)")
        elif k in _OFFLOAD_NVME:
            w.skip(dk, _NVME)
        else:
            w.bad(dk, _unknown(dk, "an offload_optimizer setting"))
    if dev is _BAD:
        return
    dk = _device_key(w, key, sec)
    if dev == "none":
        w.skip(dk, "'none': no optimizer offload")
    elif stage == 0:
        w.skip(dk, "DeepSpeed offloads the optimizer only under ZeRO stages 1-3, and this config has stage 0")
    else:
        m.offload_optimizer = {"state_format": "fp32"}
        w.map(dk, "offload_optimizer={'state_format': 'fp32'}: OffloadedOptimizer")
        w.note(
            dk,
            "OffloadedOptimizer keeps fp32 master weights in host memory and runs the torch optimizer there, "
            "as ZeRO-Offload; state_format='fp32' keeps the optimizer state in fp32 as DeepSpeed does "
            "(torsh's default would pack it to bf16). DeepSpeed offloads this rank's ZeRO partition, "
            "OffloadedOptimizer the parameters it is given (FSDP2's local shards under fully_shard)",
        )


def _ds_offload_param(w: _Walk, key: str, sec: Any, stage: int, m: Migration, fp16: bool, bf16: bool) -> None:
    if _dict(w, key, sec) is _BAD:
        return
    dev = _offload_device(w, key, sec)
    for k, v in sec.items():
        dk = f"{key}.{k}"
        if k == "device" or not w.take(sec, k, dk):
            continue
        if k == "pin_memory":
            if _bool(w, dk, v) is not _BAD:
                w.skip(dk, _PIN)
        elif k in _OFFLOAD_NVME:
            w.skip(dk, _NVME)
        else:
            w.bad(dk, _unknown(dk, "an offload_param setting"))
    if dev is _BAD:
        return
    dk = _device_key(w, key, sec)
    if dev == "none":
        w.skip(dk, "'none': no parameter offload")
    elif stage != 3:
        w.skip(dk, f"DeepSpeed offloads parameters only under ZeRO stage 3, and this config has stage {stage}")
    else:
        fmt = "fp16" if fp16 else "bf16" if bf16 else "fp32"
        m.offload_params = {"fmt": fmt}
        w.map(dk, f"offload_params={{'fmt': {fmt!r}}}: ParameterOffloader")
        w.note(
            dk,
            f"ParameterOffloader keeps the parameters in host memory in the training dtype ({fmt}) and "
            "brings each submodule's to the device before its forward and its backward. It takes a module "
            "that is not sharded; ZeRO-3 also shards the parameters: under FSDP2, "
            "fully_shard(..., offload_policy=CPUOffloadPolicy()) does that",
        )


def _ds_zeropp(w: _Walk, key: str, z: Mapping, stage: int, m: Migration) -> None:
    """ZeRO++ (stage 3): qwZ (zero_quantized_weights), qgZ (zero_quantized_gradients), LoCo."""
    on = {}
    for k in ("zero_quantized_weights", "zero_quantized_gradients"):
        dk = f"{key}.{k}"
        if not w.take(z, k, dk):
            continue
        v = _bool(w, dk, z[k])
        if v is False:
            w.skip(dk, "false")
        elif v is True and stage != 3:
            w.skip(
                dk,
                f"DeepSpeed quantizes ZeRO-3's all-gathers and reduce-scatters only under stage 3, and "
                f"this config has stage {stage}",
            )
        elif v is True:
            on[k] = dk
    loco = None
    dk = f"{key}.zeropp_loco_param"
    if w.take(z, "zeropp_loco_param", dk):
        if z["zeropp_loco_param"] is None:
            w.skip(dk, "null: no LoCo")
        elif _dict(w, dk, z["zeropp_loco_param"]) is not _BAD:
            loco = dk
    if loco and "zero_quantized_gradients" not in on:
        w.skip(loco, "LoCo applies to quantized gradients, which this config does not use")
        loco = None
    if not on:
        return
    weights = "int8" if "zero_quantized_weights" in on else None
    grads = "int4" if "zero_quantized_gradients" in on else None
    m.quantized_comm = {"weights": weights, "grads": grads, "error_feedback": loco is not None}
    if weights:
        dk = on["zero_quantized_weights"]
        w.map(dk, "quantized_comm weights='int8': QuantizedAllGather")
        w.note(
            dk,
            "qwZ: int8 weights in FSDP2's all-gather, blocks of 256 elements with one fp32 scale each "
            "(DeepSpeed sizes its quantization groups itself)",
        )
    if grads:
        dk = on["zero_quantized_gradients"]
        w.map(dk, "quantized_comm grads='int4': QuantizedReduceScatter")
        w.note(
            dk,
            "qgZ: int4 gradient chunks through an all-to-all, summed in fp32; DeepSpeed's all-to-all is "
            "hierarchical (within, then across nodes), torsh's one all-to-all over the shard group"
            + ("" if loco else "; no error feedback, as DeepSpeed without LoCo"),
        )
    if loco:
        w.map(loco, "quantized_comm error_feedback=True")
        w.note(
            loco,
            "LoCo's moving average of the quantization error (err_beta, reset_T) becomes torsh's plain "
            "error-feedback residual, kept for good",
        )


def _ds_optimizer(w: _Walk, cfg: dict, m: Migration, stage: int) -> bool:
    """The optimizer section; returns whether it is OneBitAdam (which also sets the compressor)."""
    key = "optimizer"
    if not w.take(cfg, key):
        return False
    sec = _dict(w, key, cfg[key])
    if sec is _BAD:
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
        w.bad(f"{key}.type", f"must be a string, got {_show(name)}")
        return False
    pk = f"{key}.params"
    params: dict[str, Any] = {}
    if w.take(sec, "params", pk) and sec["params"] is None:
        w.skip(pk, "null: the optimizer's defaults")
    elif pk not in w.ignored and "params" in sec:
        if _dict(w, pk, sec["params"]) is _BAD:
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
    if isinstance(kwargs.get("betas"), list):
        kwargs["betas"] = tuple(kwargs["betas"])
    if _validate_optimizer(w, pk, cls, kwargs):
        m.optimizer, m.optimizer_kwargs = cls, kwargs
        w.map(f"{key}.type", f"optimizer=torch.optim.{cls.__name__}")
        for k in kwargs:
            if k in params:  # (a default made explicit is in the notes, not an input key)
                w.map(f"{pk}.{k}", f"optimizer_kwargs[{k!r}]")
    return onebit


def _ds_adam(w: _Walk, pk: str, low: str, params: dict) -> tuple[type | None, dict]:
    """DeepSpeed's Adam/AdamW (runtime/engine.py, _configure_basic_optimizer): AdamW's decoupled weight decay
    unless adam_w_mode is false for "Adam"; FusedAdam / DeepSpeedCPUAdam unless torch_adam, with their
    defaults (weight_decay 0)."""
    params = dict(params)
    ok = True
    flags = {"torch_adam": False, "adam_w_mode": True}  # DeepSpeed's defaults
    for k in flags:
        if k in params:
            v = _bool(w, f"{pk}.{k}", params.pop(k))
            if v is _BAD:
                ok = False
            else:
                flags[k] = v
                w.map(f"{pk}.{k}", "which torch optimizer (Adam or AdamW) and whose defaults")
    decoupled = low == "adamw" or flags["adam_w_mode"]
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    if "bias_correction" in params:
        bc = _bool(w, f"{pk}.bias_correction", params.pop("bias_correction"))
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


def _ds_onebit_adam(w: _Walk, pk: str, params: dict, m: Migration, stage: int) -> tuple[type | None, dict]:
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
    freeze = _int(w, f"{pk}.freeze_step", params.pop("freeze_step")) if given else 100000  # OnebitAdam's default
    if freeze is _BAD:
        ok = False
    if "amsgrad" in params:
        v = _bool(w, f"{pk}.amsgrad", params.pop("amsgrad"))
        if v is True:
            w.bad(f"{pk}.amsgrad", "1-bit Adam has no AMSGrad variant (DeepSpeed refuses it)")
            ok = False
        elif v is False:
            w.skip(f"{pk}.amsgrad", "false")
    if "eps_inside_sqrt" in params:
        v = _bool(w, f"{pk}.eps_inside_sqrt", params.pop("eps_inside_sqrt"))
        if v is True:
            w.bad(f"{pk}.eps_inside_sqrt", "true: torch's Adam adds eps outside the square root")
            ok = False
        elif v is False:
            w.skip(f"{pk}.eps_inside_sqrt", "false: eps outside the square root, as torch's Adam")
    if "bias_correction" in params and _bool(w, f"{pk}.bias_correction", params.pop("bias_correction")) is not _BAD:
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


# -- Megatron-Core -------------------------------------------------------------------------------------

_MEGATRON_DEFAULTS = {  # TransformerConfig's defaults (megatron/core/transformer/transformer_config.py)
    "moe_router_topk": 2,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_aux_loss_coeff": 0.0,
    "moe_z_loss_coeff": None,
    "moe_expert_capacity_factor": None,
    "moe_token_drop_policy": "probs",
    "add_bias_linear": True,
}
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
_M_OFF = {  # MoE settings torsh has no equivalent for: the value that turns them off maps
    "moe_input_jitter_eps": (None, "input jitter (noise on the router's input)"),
    "moe_router_topk_limited_devices": (None, "device-limited routing (deprecated: moe_router_num_groups maps)"),
    "moe_apply_probs_on_input": (
        False,
        "scaling the experts' input by the router probability (torsh scales their output)",
    ),
    "moe_latent_size": (None, "latent projections around the experts"),
    "moe_expert_rank_capacity_factor": (None, "a capacity per expert rank"),
    "moe_token_dropping": (False, "the deprecated token-dropping switch (moe_expert_capacity_factor maps)"),
    "moe_n_hash_layers": (0, "hash routing"),
    "moe_router_force_load_balancing": (False, "benchmark-only random routing"),
    "moe_router_force_biased": (None, "benchmark-only random routing bias"),
    "moe_enable_routing_replay": (False, "routing replay"),
    # the experts' activation, beyond its name
    "glu_linear_offset": (0.0, "an offset in the gated unit, act(x W1) * (x W3 + offset)"),
    "activation_func_clamp_value": (None, "clamping the experts' first projection"),
}
_M_HANDLED = frozenset(
    (
        "num_moe_experts",
        "num_experts",
        "moe_router_topk",
        "moe_router_score_function",
        "moe_router_pre_softmax",
        "moe_router_topk_scaling_factor",
        "moe_router_load_balancing_type",
        "moe_aux_loss_coeff",
        "moe_z_loss_coeff",
        "moe_expert_capacity_factor",
        "moe_token_drop_policy",
        "moe_pad_expert_input_to_capacity",
        "moe_ffn_hidden_size",
        "ffn_hidden_size",
        "hidden_size",
        "gated_linear_unit",
        "activation_func",
        "swiglu",
        "squared_relu",
        "add_bias_linear",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "moe_router_dtype",
        "moe_router_enable_expert_bias",
        "moe_router_bias_update_rate",
        "moe_router_num_groups",
        "moe_router_group_topk",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
    )
)


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
    w = _Walk("from_megatron", ignore)
    a, defaults = _attributes(args)
    m = Migration(source="megatron")
    for key, v in a.items():
        if not isinstance(key, str):
            w.bad(repr(key), "keys must be strings")
        elif not w.take(a, key) or key in _M_HANDLED or key in _M_OFF:
            continue  # (in _m_moe, once the number of experts is known)
        elif key in _M_IGNORED:
            w.skip(key, _M_IGNORED[key])
        elif key.startswith(_M_PERF_PREFIXES):
            w.skip(key, _M_PERF)
        elif key.startswith("moe_") and key in defaults and _same(v, defaults[key]):
            w.skip(
                key,
                "a MoE setting torsh does not know, at its default in this config (Megatron-Core's standard "
                "behaviour, which is what torsh maps)",
            )
        elif key.startswith("moe_"):
            w.bad(key, _unknown(key, "a Megatron-Core MoE setting"))
        else:
            w.skip(key, "not a setting of the MoE layer")
    _m_moe(w, a, m)
    w.finish(m)
    return m


def _same(v: Any, default: Any) -> bool:
    try:
        return type(v) is type(default) and bool(v == default)
    except Exception:  # a value whose == is not a bool (a tensor)
        return False


def _get(w: _Walk, a: dict, key: str) -> Any:
    """The input's value for ``key``, else Megatron-Core's default (noted)."""
    if w.take(a, key):
        return a[key]
    v = _MEGATRON_DEFAULTS[key]
    w.note(key, f"{'left out' if key in a else 'not given'}: Megatron-Core's default, {v!r}")
    return v


def _m_moe(w: _Walk, a: dict, m: Migration) -> None:
    experts = None
    unset = []
    for key in ("num_moe_experts", "num_experts"):
        if not w.take(a, key):
            continue
        if a[key] is None:
            unset.append(key)
            continue
        e = _int(w, key, a[key], 1)
        if e is not _BAD and experts is not None and e != experts:
            w.bad(key, f"{e} contradicts the other number of experts, {experts}")
        elif e is not _BAD:
            experts = e
            w.map(key, "moe['num_experts']")
    if experts is not None:
        for key in unset:
            w.skip(key, "None; the number of experts is the other spelling's")
    else:
        why = "no MoE layer: the number of experts (num_moe_experts, or num_experts) is not set"
        for key in sorted((_M_HANDLED | set(_M_OFF)) & set(a)):
            if key not in w.ignored and key not in w.errors:
                w.skip(key, why)
        return
    for key, (off, what) in _M_OFF.items():
        if w.take(a, key):
            v = a[key]
            if _same(v, off) or (isinstance(off, float) and _same(v, int(off))):
                w.skip(key, f"{v!r}: {what} is off")
            else:
                w.bad(key, f"{_show(v)}: {what} has no torsh equivalent (only {off!r} maps)")
    kw: dict[str, Any] = {"num_experts": experts}
    k = _int(w, "moe_router_topk", _get(w, a, "moe_router_topk"), 1)
    if k is not _BAD and k > experts:
        k = w.bad("moe_router_topk", f"{k} exceeds the number of experts, {experts}")
    kw["k"] = k
    score = _choice(w, "moe_router_score_function", _get(w, a, "moe_router_score_function"), ("softmax", "sigmoid"))
    kw["score"] = score
    pre = _bool(w, "moe_router_pre_softmax", _get(w, a, "moe_router_pre_softmax"))
    if score == "softmax" and pre is not _BAD:
        # pre-softmax: a softmax over all experts, then the top k, not renormalised; otherwise the top k of the
        # logits, then a softmax over those k, which is the renormalised full softmax
        kw["renormalize"] = not pre
        w.map("moe_router_pre_softmax", f"moe['renormalize'] = {not pre}")
    elif score == "sigmoid" and k is not _BAD:
        kw["renormalize"] = k > 1  # Megatron divides the k sigmoid scores by their sum only when k > 1
        w.map(
            "moe_router_pre_softmax",
            "no effect with sigmoid scores (Megatron-Core takes the sigmoid before the top k either way)",
        )
        w.note(
            "moe_router_score_function",
            f"'sigmoid' with k={k}: renormalize={k > 1}, as Megatron-Core divides "
            "the k scores by their sum only when k > 1",
        )
    if k is not _BAD:
        w.map("moe_router_topk", "moe['k']")
    if score is not _BAD:
        w.map("moe_router_score_function", "moe['score']")
    key = "moe_router_topk_scaling_factor"
    if w.take(a, key):
        f = a[key]
        if f is None:
            w.skip(key, "None: no scaling")
        elif (f := _num(w, key, f, 0.0, strict=True)) is not _BAD:
            if f != 1.0:
                kw["scaling"] = f
            w.map(key, f"moe['scaling'] = {f}" if f != 1.0 else "1.0: no scaling (moe['scaling'] stays 1.0)")
            if f != 1.0:
                w.note(
                    key,
                    "the combine weights are multiplied by it after any renormalisation, as Megatron-Core's "
                    "topk_routing_with_score_function does (for every score function, whatever "
                    "moe_router_pre_softmax: its docstring's 'only with pre-softmax' is not what its code does)",
                )
    _m_bias(w, a, kw, score)
    _m_groups(w, a, kw, experts, k)
    _m_shared(w, a, kw)
    _m_losses(w, a, kw)
    _m_capacity(w, a, kw)
    _m_sizes(w, a, kw)
    _m_activation(w, a, kw)
    bias = _bool(w, "add_bias_linear", _get(w, a, "add_bias_linear"))
    if bias is True:
        w.bad(
            "add_bias_linear",
            "true: Megatron's experts then have bias terms, torsh's have none (train with "
            "--disable-bias-linear, add_bias_linear=False)",
        )
    elif bias is False:
        w.map("add_bias_linear", "false: experts without bias terms, as torsh's")
    key = "moe_router_dtype"
    if w.take(a, key):
        d = a[key]
        if d is None or d in ("fp32", "fp64"):
            w.map(key, "torsh computes the scores and combine weights in fp32, whatever the logits' dtype")
            if d != "fp32":
                w.note(
                    key, f"{d!r}: Megatron then routes in " + ("fp64" if d else "the logits' dtype") + "; torsh in fp32"
                )
        else:
            w.bad(key, f"must be None, 'fp32' or 'fp64', got {_show(d)}")
    _m_expert_parallel(w, a, m, experts)
    if all(v is not _BAD for v in kw.values()):
        m.moe = kw


def _m_losses(w: _Walk, a: dict, kw: dict) -> None:
    key, ckey = "moe_router_load_balancing_type", "moe_aux_loss_coeff"
    kind, coeff = _get(w, a, key), _get(w, a, ckey)
    kinds = kind if isinstance(kind, list) else [kind]
    coeffs = coeff if isinstance(coeff, list) else [coeff]
    kw["aux_loss_coef"] = _BAD
    if len(kinds) != len(coeffs):
        w.bad(key, f"{len(kinds)} load-balancing types and {len(coeffs)} coefficients ({ckey})")
        return
    active: dict[str, float] = {}  # the losses with a coefficient, each kind's coefficients summed
    for t, c in zip(kinds, coeffs):
        c = _num(w, ckey, c)
        t = _choice(w, key, t, ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
        if c is _BAD or t is _BAD:
            return
        if t == "sinkhorn":
            w.bad(key, "'sinkhorn' routes by Sinkhorn balancing, which torsh does not do")
            return
        if t == "global_aux_loss" and c:
            w.bad(
                key,
                f"'global_aux_loss' with coefficient {c}: torsh's load-balancing losses are the micro-batch one "
                "('aux_loss', Switch/GShard) and the per-sequence one ('seq_aux_loss'), not one over the global batch",
            )
            return
        if t in ("aux_loss", "seq_aux_loss") and c:
            active[t] = active.get(t, 0.0) + c
        elif t == "none" and c:
            w.note(key, f"'none': no load-balancing loss, so {ckey}={c} has no effect")
    if len(active) > 1:
        w.bad(
            key, "'aux_loss' and 'seq_aux_loss' both with a coefficient: torsh's layer weighs one load-balancing loss"
        )
        return
    kind = next(iter(active), "aux_loss")
    kw["aux_loss_coef"] = active.get(kind, 0.0)
    if kind == "seq_aux_loss":
        kw["load_balancing"] = "seq_aux_loss"
    w.map(key, "which loss moe['aux_loss_coef'] weighs" + (" (moe['load_balancing'] = 'seq_aux_loss')" if active
                                                           and kind == "seq_aux_loss" else ""))  # fmt: skip
    w.map(ckey, "moe['aux_loss_coef']")
    if kind == "aux_loss" and active:
        w.note(
            ckey,
            "the Switch/GShard loss coeff * E * sum_e f_e * P_e over the tokens of one forward call, f_e "
            "counted before capacity drops, as Megatron's switch_load_balancing_loss_func (which counts "
            "the micro-batch's tokens of its tensor- and context-parallel group); in layer.aux_loss, to "
            "add to the training loss",
        )
    elif active:
        w.note(
            ckey,
            "'seq_aux_loss': the mean over the forward's sequences of the Switch/GShard loss of each sequence "
            "(DeepSeek-V3's sequence-wise loss, Megatron-Core's seq_aux_loss); torsh's sequences are consecutive "
            "rows: pass [batch, seq, hidden] inputs or sequence_lengths (Megatron's [seq, batch] layout "
            "interleaves them)",
        )
    z = _get(w, a, "moe_z_loss_coeff")
    kw["z_loss_coef"] = 0.0 if z is None else _num(w, "moe_z_loss_coeff", z)
    if kw["z_loss_coef"] is not _BAD:
        w.map("moe_z_loss_coeff", "moe['z_loss_coef'] (ST-MoE's mean logsumexp^2, as Megatron's z_loss_func)")


def _m_capacity(w: _Walk, a: dict, kw: dict) -> None:
    key, pkey = "moe_expert_capacity_factor", "moe_token_drop_policy"
    cap = _get(w, a, key)
    if cap is not None:
        cap = _num(w, key, cap, 0.0, strict=True)
    kw["capacity_factor"] = cap
    policy = _choice(w, pkey, _get(w, a, pkey), ("probs", "position"))
    kw["drop_policy"] = {"probs": "probability", "position": "position"}.get(policy, policy)
    if cap is not _BAD:
        w.map(key, "moe['capacity_factor']" + (" (None: dropless)" if cap is None else ""))
    if policy is not _BAD:
        w.map(pkey, f"moe['drop_policy'] = {kw['drop_policy']!r}")
    if cap is not None and cap is not _BAD:
        w.note(
            key,
            "C = ceil(T * k * factor / E) assignments per expert, T the tokens of one forward call "
            "(Megatron: of the micro-batch on this rank), as Megatron's get_capacity",
        )
        if policy == "probs" and kw.get("renormalize"):
            w.note(
                pkey,
                "'probs': an overfull expert keeps its highest-scoring assignments; torsh ranks them by the "
                "router score before renormalisation (the full softmax or the sigmoid), Megatron by the "
                "renormalised probability, so with k > 1 the dropped assignments can differ",
            )
        elif policy == "position":
            w.note(
                pkey,
                "'position': torsh keeps each expert's first C assignments in token order, what Megatron "
                "documents (its top-k over equal values promises no order)",
            )
    key = "moe_pad_expert_input_to_capacity"
    if w.take(a, key):
        pad = _bool(w, key, a[key])
        if pad is True and cap is None:
            w.skip(key, "true, but without moe_expert_capacity_factor it has no effect (as in Megatron-Core)")
        elif pad is True and cap is not _BAD:
            kw["pad_to_capacity"] = True
            w.map(
                key,
                "moe['pad_to_capacity'] = True: every expert's rows padded with zero rows to its capacity (the "
                "padding carries no weight: the output is the same; in ExpertParallelMoE the all-to-all splits "
                "are then static)",
            )
        elif pad is False:
            w.skip(key, "false: no padding")


def _m_bias(w: _Walk, a: dict, kw: dict, score: Any) -> None:
    key, rkey = "moe_router_enable_expert_bias", "moe_router_bias_update_rate"
    on = _bool(w, key, a[key]) if w.take(a, key) else None
    if on is True and score == "softmax":
        on = w.bad(
            key,
            "true with softmax scores: Megatron-Core refuses an expert bias with softmax (the bias is added to sigmoid "
            "scores); set moe_router_score_function='sigmoid'",
        )
    if on is True:
        kw["expert_bias"] = True
        w.map(
            key,
            "moe['expert_bias'] = True: a BiasBalancer (layer.balancer) whose bias is added to the scores for the "
            "selection only; call layer.update_expert_bias() once per optimizer step (Megatron-Core updates it "
            "in finalize_model_grads)",
        )
        w.note(
            key,
            "bias += rate * sign(mean load - load), the load summed over the training forwards since the last "
            "update and over the balancer's communicator: ExpertParallelMoE's group by default, or bias_comm= "
            "(Megatron-Core sums over the tensor-, context- and data-parallel group)",
        )
    elif on is False:
        w.skip(key, "false: no expert bias")
    if w.take(a, rkey):
        if on is True:
            rate = _num(w, rkey, a[rkey])
            if rate is not _BAD:
                kw["bias_update_rate"] = rate
                w.map(rkey, "moe['bias_update_rate']")
        else:
            w.skip(rkey, "read only with moe_router_enable_expert_bias")
    elif on is True:
        kw["bias_update_rate"] = 1e-3
        w.note(rkey, "not given: Megatron-Core's default, 0.001")


def _m_groups(w: _Walk, a: dict, kw: dict, experts: int, k: Any) -> None:
    nkey, gkey = "moe_router_num_groups", "moe_router_group_topk"
    n = a[nkey] if w.take(a, nkey) else None
    g = a[gkey] if w.take(a, gkey) else None
    if not g:  # Megatron-Core groups only when moe_router_group_topk is set
        for key in (nkey, gkey):
            if key in a and key not in w.ignored:
                w.skip(key, f"{a[key]!r}: no group-limited routing (it needs moe_router_group_topk)")
        return
    g = _int(w, gkey, g, 1)
    n = _int(w, nkey, n, 1) if n is not None else w.bad(nkey, "not set, but moe_router_group_topk is")
    if g is _BAD or n is _BAD or k is _BAD:
        return
    if experts % n:
        w.bad(nkey, f"{n} groups do not divide the {experts} experts")
        return
    if g > n:
        w.bad(gkey, f"{g} exceeds the {n} groups (moe_router_num_groups)")
        return
    t, size = k // g, experts // n
    if t != min(2, size):
        w.bad(
            gkey,
            f"Megatron-Core scores a group by the sum of its top moe_router_topk // moe_router_group_topk = {t} "
            f"scores, torsh (DeepSeek-V3, Hugging Face) by its top {min(2, size)}: only settings where the two agree "
            "map (moe_router_topk = 2 * moe_router_group_topk, as DeepSeek-V3's 8 experts from 4 groups)",
        )
        return
    kw["n_group"], kw["topk_group"] = n, g
    w.map(nkey, "moe['n_group']")
    w.map(gkey, "moe['topk_group']: the best groups by the sum of their top-2 (biased) scores, then the top k in them")


def _m_shared(w: _Walk, a: dict, kw: dict) -> None:
    skey, gkey = "moe_shared_expert_intermediate_size", "moe_shared_expert_gate"
    size = a[skey] if w.take(a, skey) else None
    gate = _bool(w, gkey, a[gkey]) if w.take(a, gkey) else None
    if size is None:
        if skey in a and skey not in w.ignored:
            w.skip(skey, "None: no shared experts")
        if gate is not None and gate is not _BAD:
            w.skip(gkey, f"{gate}: no shared expert to gate (Megatron-Core reads it only with shared experts)")
        return
    if _int(w, skey, size, 1) is _BAD:
        return
    kw["shared_experts"], kw["shared_ffn_hidden"] = 1, size
    w.map(
        skey,
        "moe['shared_experts'] = 1 with moe['shared_ffn_hidden']: one dense MLP of that total width (Megatron's "
        "num_shared_experts * width), the experts' activation, on every token, added to the routed output",
    )
    if gate is True:
        kw["shared_gate"] = True
        w.map(gkey, "moe['shared_gate'] = True: the shared output times sigmoid(x w_gate), as SharedExpertMLP's gate")
    elif gate is False:
        w.skip(gkey, "false: no gate on the shared expert")


def _m_sizes(w: _Walk, a: dict, kw: dict) -> None:
    if w.take(a, "hidden_size"):
        h = a["hidden_size"]
        if h in (None, 0):  # TransformerConfig's default is 0: not given
            w.skip("hidden_size", f"{h!r}: not given; pass moe_layer(hidden=...)")
        elif _int(w, "hidden_size", h, 1) is not _BAD:
            kw["hidden"] = h
            w.map("hidden_size", "moe['hidden']")
    ffn = None
    for key in ("moe_ffn_hidden_size", "ffn_hidden_size"):
        if not w.take(a, key):
            continue
        if a[key] is None:
            w.skip(key, "None: not given")
        elif _int(w, key, a[key], 1) is not _BAD:
            if ffn is None:
                ffn = a[key]
                w.map(key, "moe['ffn_hidden']")
            else:
                w.skip(key, "the dense layers' width; the experts' is moe_ffn_hidden_size")
    if ffn is None and "hidden" in kw:
        ffn = 4 * kw["hidden"]
        w.note("ffn_hidden_size", f"not given: Megatron-Core's default, 4 * hidden_size = {ffn}")
    if ffn is not None:
        kw["ffn_hidden"] = ffn


def _m_activation(w: _Walk, a: dict, kw: dict) -> None:
    """Megatron's experts compute fc2(act(fc1 x)), gated: fc2(act(x W1) * (x W3)). TransformerConfig says it
    with gated_linear_unit and activation_func, Megatron's arguments with --swiglu / --squared-relu."""
    keys = [k for k in ("gated_linear_unit", "activation_func", "swiglu", "squared_relu") if w.take(a, k)]
    gated, act, ok = False, "gelu", True
    for key in keys:
        v = a[key]
        if key == "activation_func":
            name = getattr(v, "__name__", None)
            if name in ("gelu", "silu", "relu"):
                act = name
            else:
                w.bad(key, f"{v!r}: torsh's experts use silu (gated: SwiGLU), gelu or relu")
                ok = False
        elif _bool(w, key, v) is _BAD:
            ok = False
        elif key == "squared_relu" and v:
            w.bad(key, "true: torsh's experts have no squared ReLU")
            ok = False
        elif v:
            gated = True
            if key == "swiglu":
                act = "silu"
    if not ok:
        kw["activation"] = _BAD
        return
    if not keys:
        w.note("activation_func", "not given: Megatron-Core's default, gelu without a gate")
    if gated and act == "silu":
        kw["activation"] = "swiglu"
    elif gated:
        kw["activation"] = w.bad("gated_linear_unit", f"a gated {act}: torsh's only gated expert is SwiGLU (silu)")
        return
    elif act == "silu":
        kw["activation"] = w.bad("activation_func", "silu without a gate: torsh's experts use silu only in SwiGLU")
        return
    else:
        kw["activation"] = act
    for key in keys:
        w.map(key, f"moe['activation'] = {kw['activation']!r}")


def _m_expert_parallel(w: _Walk, a: dict, m: Migration, experts: int) -> None:
    for key in ("expert_model_parallel_size", "expert_tensor_parallel_size"):
        if not w.take(a, key):
            continue
        if a[key] is None:
            w.skip(key, "None: not set")
            continue
        n = _int(w, key, a[key], 1)
        if n is _BAD:
            continue
        if key == "expert_tensor_parallel_size":
            if n == 1:
                w.skip(key, "1: the experts are not split by tensor parallelism")
            else:
                w.bad(key, f"{n}: torsh's experts are not split by tensor parallelism (1 maps)")
        elif experts % n:
            w.bad(key, f"{n} does not divide the number of experts, {experts}")
        else:
            m.expert_parallel_size = n
            w.map(key, f"expert_parallel_size: ExpertParallelMoE over {n} ranks, {experts // n} experts each")


# -- PyTorch comm hooks --------------------------------------------------------------------------------


def from_torch_hook(hook: Any, state: Any = None) -> Migration:
    """Map a PyTorch DDP comm hook and its state (what ``ddp.register_comm_hook(state, hook)`` takes) to
    torsh's :func:`~torsh_kernels.parallel.compression_hook`.

    ``allreduce_hook``: no compressor; ``fp16_compress_hook``: :class:`~torsh_kernels.compression.FP16` (the
    same averages, bit for bit); ``bf16_compress_hook``: :class:`~torsh_kernels.compression.BF16`;
    ``powerSGD_hook`` / ``batched_powerSGD_hook`` with their ``PowerSGDState``:
    :class:`~torsh_kernels.compression.PowerSGD` with its rank, warm-up, size rule and warm start, per matrix
    (``policy="layerwise"``) or per bucket (``"bucket"``). The state's process group becomes the hook state's."""
    w = _Walk("from_torch_hook", ())
    m = Migration(source="torch_hook")
    name = getattr(hook, "__qualname__", None)
    module = getattr(hook, "__module__", None) or ""
    if not callable(hook) or not isinstance(name, str):
        raise ArgumentTypeError(f"from_torch_hook: hook must be a DDP comm hook function, got {type(hook).__name__}")
    ours = module.startswith("torch.distributed.algorithms.ddp_comm_hooks")
    if ours and name.endswith("_compress_wrapper_hook"):
        w.bad(
            "hook",
            f"{name.split('.')[0]}(...) casts the bucket before another hook; torsh runs one compressor "
            "per hook (map the inner hook, or use FP16 / BF16 alone)",
        )
    elif ours and name in ("allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"):
        if state is not None and not _is_group(state):
            w.bad("state", f"{name} takes a process group (or None) as its state, got {type(state).__name__}")
        elif state is not None:
            m.hook["process_group"] = state
            w.map("state", "hook['process_group']")
        m.compressor = {"fp16_compress_hook": FP16(), "bf16_compress_hook": BF16()}.get(name)
        w.map("hook", f"compressor={m.compressor!r}")
        if name == "bf16_compress_hook":
            w.note(
                "hook",
                "PyTorch's bf16_compress_hook divides by the world size before the bf16 sum; torsh's BF16 "
                "sums, then divides (bf16 has fp32's range, the sum cannot overflow): the same average up "
                "to bf16 rounding",
            )
    elif ours and name in ("powerSGD_hook", "batched_powerSGD_hook"):
        _powersgd(w, m, name, state)
    else:
        w.bad(
            "hook",
            f"{module}.{name}: no torsh mapping (allreduce_hook, fp16_compress_hook, bf16_compress_hook, "
            "powerSGD_hook and batched_powerSGD_hook map); build a torsh compressor by hand",
        )
    w.finish(m)
    return m


def _is_group(x: Any) -> bool:
    import torch.distributed as dist

    return isinstance(x, dist.ProcessGroup)


_PSGD_FIELDS = (
    "process_group",
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "orthogonalization_epsilon",
    "use_error_feedback",
    "warm_start",
)


def _powersgd(w: _Walk, m: Migration, name: str, state: Any) -> None:
    if type(state).__name__ != "PowerSGDState" or not all(hasattr(state, f) for f in _PSGD_FIELDS):
        w.bad("state", f"{name} needs its PowerSGDState, got {type(state).__name__}")
        return
    rank = _int(w, "state.matrix_approximation_rank", state.matrix_approximation_rank, 1)
    start = _int(w, "state.start_powerSGD_iter", state.start_powerSGD_iter)
    rate = _num(w, "state.min_compression_rate", state.min_compression_rate)
    warm = _bool(w, "state.warm_start", state.warm_start)
    if state.use_error_feedback is not True:
        w.bad(
            "state.use_error_feedback",
            f"{state.use_error_feedback!r}: torsh's PowerSGD always keeps the error-feedback residual",
        )
    eps = state.orthogonalization_epsilon
    if eps:
        w.map("state.orthogonalization_epsilon", "no epsilon: zero columns of P are set aside instead")
        w.note(
            "state.orthogonalization_epsilon",
            f"{eps}: torsh adds no epsilon; it sets zero columns of P aside "
            "before orthogonalising (they stay zero), what the epsilon guards "
            "against",
        )
    else:
        w.skip("state.orthogonalization_epsilon", "0: none, as torsh")
    w.skip(
        "state.random_seed",
        "torsh draws Q from its own seeds (rank 0's, broadcast to all); PyTorch's numpy "
        "draws differ, so the approximations agree in distribution, not bit for bit",
    )
    w.skip("state.compression_stats_logging_frequency", "logging: the hook state's stats (bytes before and after)")
    w.skip("state.batch_tensors_with_same_shape", "batching same-shaped matrices is a speed choice, not a result")
    if getattr(state, "iter", 0) or getattr(state, "error_dict", None):
        w.note(
            "state",
            f"this PowerSGDState has run {state.iter} iterations; torsh's state starts fresh (the "
            "residuals and Q are not carried over): map the state before training",
        )
    if state.process_group is not None:
        m.hook["process_group"] = state.process_group
        w.map("state.process_group", "hook['process_group']")
    if _BAD in (rank, start, rate, warm):
        return
    m.compressor = PowerSGD(rank, start_iter=start, warm_start=warm, min_compression_rate=rate)
    m.hook["min_numel"] = 0
    m.hook["policy"] = "bucket" if name == "batched_powerSGD_hook" else "layerwise"
    w.map("hook", f"compression_hook, policy={m.hook['policy']!r}, min_numel=0")
    for f, dest in (
        ("matrix_approximation_rank", "rank"),
        ("start_powerSGD_iter", "start_iter"),
        ("min_compression_rate", "min_compression_rate"),
        ("warm_start", "warm_start"),
        ("use_error_feedback", "error feedback, always on"),
    ):
        w.map(f"state.{f}", f"PowerSGD {dest}")
    w.note(
        "state.min_compression_rate",
        "a matrix is compressed when rows * cols / ((rows + cols) * rank) reaches "
        "it (PyTorch: exceeds it), counted in bytes: fp32 P and Q against the "
        "gradient's bytes, PyTorch's element count for fp32 gradients; no size "
        "floor beyond it (min_numel=0), as PyTorch",
    )
    if name == "batched_powerSGD_hook":
        w.note(
            "hook",
            "batched_powerSGD_hook compresses the whole bucket as one square matrix, 1-D tensors "
            "included; torsh's policy='bucket' compresses the bucket's matrices (2+ dims) as one and "
            "averages the 1-D tensors uncompressed",
        )
