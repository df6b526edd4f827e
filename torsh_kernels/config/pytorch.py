"""PyTorch's DDP comm hooks as torsh's (:func:`from_torch_hook`): allreduce, fp16 / bf16 compression, PowerSGD."""

from __future__ import annotations

import math
from typing import Any

from ..compression import BF16, FP16, PowerSGD
from ..errors import ArgumentTypeError
from .common import BAD, Walk, check_bool, check_int, check_num, short_value
from .migration import Migration

__all__ = ["MAX_RANK", "from_torch_hook"]

MAX_RANK = 2**20
"""The largest PowerSGD rank accepted: a rank at or above a matrix's smaller side compresses nothing (P and Q
then hold more than the matrix), and no layer has a side of 2**20."""
_RANK_WHY = "a rank at or above a matrix's smaller side compresses nothing; see config.pytorch.MAX_RANK"


def from_torch_hook(hook: Any, state: Any = None) -> Migration:
    """Map a PyTorch DDP comm hook and its state (what ``ddp.register_comm_hook(state, hook)`` takes) to
    torsh's :func:`~torsh_kernels.parallel.compression_hook`.

    ``allreduce_hook``: no compressor; ``fp16_compress_hook``: :class:`~torsh_kernels.compression.FP16` (the
    same averages, bit for bit); ``bf16_compress_hook``: :class:`~torsh_kernels.compression.BF16`;
    ``powerSGD_hook`` / ``batched_powerSGD_hook`` with their ``PowerSGDState``:
    :class:`~torsh_kernels.compression.PowerSGD` with its rank, warm-up, size rule and warm start, per matrix
    (``policy="layerwise"``) or per bucket (``"bucket"``). The state's process group becomes the hook state's."""
    w = Walk("from_torch_hook", ())
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


def _powersgd(w: Walk, m: Migration, name: str, state: Any) -> None:
    if type(state).__name__ != "PowerSGDState" or not all(hasattr(state, f) for f in _PSGD_FIELDS):
        w.bad("state", f"{name} needs its PowerSGDState, got {type(state).__name__}")
        return
    rank = check_int(w, "state.matrix_approximation_rank", state.matrix_approximation_rank, 1, MAX_RANK, _RANK_WHY)
    start = check_int(w, "state.start_powerSGD_iter", state.start_powerSGD_iter)
    rate = check_num(w, "state.min_compression_rate", state.min_compression_rate)
    warm = check_bool(w, "state.warm_start", state.warm_start)
    if state.use_error_feedback is not True:
        w.bad(
            "state.use_error_feedback",
            f"{short_value(state.use_error_feedback)}: torsh's PowerSGD always keeps the error-feedback residual",
        )
    eps = check_num(w, "state.orthogonalization_epsilon", state.orthogonalization_epsilon)
    if eps is not BAD and eps:
        w.map("state.orthogonalization_epsilon", "no epsilon: zero columns of P are set aside instead")
        w.note(
            "state.orthogonalization_epsilon",
            f"{eps}: torsh adds no epsilon; it sets zero columns of P aside "
            "before orthogonalising (they stay zero), what the epsilon guards "
            "against",
        )
    elif eps is not BAD:
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
            f"this PowerSGDState has run {short_value(state.iter)} iterations; torsh's state starts fresh (the "
            "residuals and Q are not carried over): map the state before training",
        )
    if state.process_group is not None:
        m.hook["process_group"] = state.process_group
        w.map("state.process_group", "hook['process_group']")
    if BAD in (rank, start, rate, warm):
        return
    # PyTorch compresses a matrix when its rate exceeds min_compression_rate, torsh when it reaches it: the next
    # float above PyTorch's value makes torsh decide alike (a [16, 16] matrix at rank 4 has a rate of exactly 2.0)
    m.compressor = PowerSGD(
        rank, start_iter=start, warm_start=warm, min_compression_rate=math.nextafter(rate, math.inf)
    )
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
        "a matrix is compressed when rows * cols / ((rows + cols) * rank) exceeds "
        "it, as PyTorch decides (torsh's own rule is 'reaches': it is given the next float above), counted in "
        "bytes: fp32 P and Q against the "
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
