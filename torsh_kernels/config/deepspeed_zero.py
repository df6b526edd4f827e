"""A DeepSpeed config's ``zero_optimization`` section: the stage, optimizer and parameter offload, ZeRO++."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .common import (
    BAD,
    CHECKPOINT_REASON,
    LOGGING_REASON,
    Walk,
    check_bool,
    check_choice,
    check_dict,
    check_int,
    check_num,
    unknown_key,
)
from .migration import Migration

__all__ = ["map_zero"]


_NVME = "NVMe offload (ZeRO-Infinity), which torsh does not do; DeepSpeed reads it only with device 'nvme'"
_PIN = (
    "pinned host memory: torsh pins its host buffers whenever CUDA exists and has no switch for it (speed and "
    "locked memory, not results)"
)

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
    "load_from_fp32_weights": CHECKPOINT_REASON,
    "elastic_checkpoint": CHECKPOINT_REASON,
    "pipeline_loading_checkpoint": CHECKPOINT_REASON,
    "save_muon_momentum_buffer_in_memory": _NVME,
    "ignore_unused_parameters": "unused parameters: DDP's find_unused_parameters",
    "zero_hpz_partition_size": "hpZ (a second weight partition within a node): FSDP2's "
    "fully_shard(reshard_after_forward=N), which torsh's QuantizedAllGather follows",
    "mics_shard_size": "MiCS (sharding within subgroups): FSDP2's HSDP on a 2-D DeviceMesh",
    "mics_hierarchical_params_gather": "MiCS (sharding within subgroups): FSDP2's HSDP on a 2-D DeviceMesh",
    "log_trace_cache_warnings": LOGGING_REASON,
    "enable_sanity_checks": LOGGING_REASON,
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


def map_zero(w: Walk, cfg: dict, m: Migration, fp16: bool, bf16: bool) -> int:
    """The ZeRO section: offload and ZeRO++; returns the stage (0 when absent or invalid)."""
    key = "zero_optimization"
    if not w.take(cfg, key):
        return 0
    z = cfg[key]
    if isinstance(z, bool):  # DeepSpeed's deprecated form: true means stage 1
        w.skip(key, f"the deprecated boolean form ({str(z).lower()}: stage {int(z)}); " + _stage_reason(int(z)))
        return int(z)
    if check_dict(w, key, z) is BAD:
        return 0
    stage = 0
    if w.take(z, "stage", f"{key}.stage"):
        s = check_int(w, f"{key}.stage", z["stage"], 0, 3, "ZeRO's stages are 0, 1, 2 and 3")
        if s is not BAD:
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
            on = check_bool(w, dk, v)
            if on is True:
                deprecated["offload_optimizer" if k == "cpu_offload" else "offload_param"] = dk
            elif on is False:
                w.skip(dk, "false: no offload")
        elif k == "cpu_offload_use_pin_memory":
            if check_bool(w, dk, v) is not BAD:
                w.skip(dk, _PIN)
        elif k in ("zero_quantized_weights", "zero_quantized_gradients", "zeropp_loco_param"):
            continue  # _ds_zeropp, once the stage is known
        elif k == "zero_quantized_nontrainable_weights":
            if check_bool(w, dk, v) is True:
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
            w.bad(dk, unknown_key(dk, "a ZeRO setting"))
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


def _offload_device(w: Walk, key: str, sec: Mapping) -> Any:
    dk = f"{key}.device"
    if not w.take(sec, "device", dk):
        return "none"  # DeepSpeed's default (or left out with ignore=)
    dev = check_choice(w, dk, sec["device"], ("none", "cpu", "nvme"), lower=True)
    if dev == "nvme":
        return w.bad(dk, "'nvme': torsh offloads to host memory ('cpu') only")
    return dev


def _device_key(w: Walk, key: str, sec: Mapping) -> str:
    """The key an offload section's device is reported under: its own ``device`` where the input gave one,
    else the section itself (or the deprecated boolean ``cpu_offload`` / ``cpu_offload_param`` that stands
    for a section ``{"device": "cpu"}``)."""
    deprecated = key.rsplit(".", 1)[-1] in ("cpu_offload", "cpu_offload_param")
    return f"{key}.device" if "device" in sec and f"{key}.device" not in w.ignored and not deprecated else key


def _ds_offload_optimizer(w: Walk, key: str, sec: Any, stage: int, m: Migration) -> None:
    if check_dict(w, key, sec) is BAD:
        return
    dev = _offload_device(w, key, sec)
    for k, v in sec.items():
        dk = f"{key}.{k}"
        if k == "device" or not w.take(sec, k, dk):
            continue
        if k == "pin_memory":
            if check_bool(w, dk, v) is not BAD:
                w.skip(dk, _PIN)
        elif k == "ratio":
            r = check_num(w, dk, v, 0.0, hi=1.0, why="the fraction of the optimizer state updated on the host")
            if r is not BAD and r != 1.0:
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
            w.bad(dk, unknown_key(dk, "an offload_optimizer setting"))
    if dev is BAD:
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


def _ds_offload_param(w: Walk, key: str, sec: Any, stage: int, m: Migration, fp16: bool, bf16: bool) -> None:
    if check_dict(w, key, sec) is BAD:
        return
    dev = _offload_device(w, key, sec)
    for k, v in sec.items():
        dk = f"{key}.{k}"
        if k == "device" or not w.take(sec, k, dk):
            continue
        if k == "pin_memory":
            if check_bool(w, dk, v) is not BAD:
                w.skip(dk, _PIN)
        elif k in _OFFLOAD_NVME:
            w.skip(dk, _NVME)
        else:
            w.bad(dk, unknown_key(dk, "an offload_param setting"))
    if dev is BAD:
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


def _ds_zeropp(w: Walk, key: str, z: Mapping, stage: int, m: Migration) -> None:
    """ZeRO++ (stage 3): qwZ (zero_quantized_weights), qgZ (zero_quantized_gradients), LoCo."""
    on = {}
    for k in ("zero_quantized_weights", "zero_quantized_gradients"):
        dk = f"{key}.{k}"
        if not w.take(z, k, dk):
            continue
        v = check_bool(w, dk, z[k])
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
        elif check_dict(w, dk, z["zeropp_loco_param"]) is not BAD:
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
