"""Compile every GPU kernel variant for sm_90 with no GPU present, read its machine code, and hold it to the
goals (test_gpu_compile.py runs this in fresh processes, without TRITON_INTERPRET / NUMBA_ENABLE_CUDASIM).

The variants are those the launchers make for the launch cases of ``torsh_kernels.ops.launch_cases`` (every
op family, benchmark sizes, aligned/unaligned/strided layouts), captured and compiled by ``torsh inspect``
(``torsh_kernels.profiling.inspection``): Triton through its full pipeline to a cubin, Numba to PTX through
NVVM and then ``ptxas``; each cubin is read (registers, spills, occupancy, access widths) and checked against
the goals. This catches what the interpreter and the simulator cannot: type errors, unsupported operations
and casts in the compiled path, and code that compiles but is far from what the hardware needs.

    python gpu_compile_check.py triton|numba [--gate] [SHARD SHARDS]

``--gate``: only the :data:`GATE` cases, plus the canary. Prints one line per case and a final JSON line.
"""

from __future__ import annotations

import json
import sys
import traceback

GATE = (
    # bucket: each kernel, fp32 / 16-bit / fp64 compute, and the unaligned and strided variants
    "flatten fp32->fp32 scale aligned", "flatten fp32->bf16 scale aligned", "flatten bf16->fp32 scale aligned",
    "flatten fp64->fp64 scale aligned", "flatten fp32->fp32 copy unaligned", "flatten fp32->fp32 copy strided",
    "unflatten fp32->fp32 accumulate aligned", "unflatten bf16->fp32 accumulate aligned",
    "unflatten fp32->fp32 copy strided", "bucket_reduce fp32->fp32 sum K=4", "bucket_reduce bf16->fp32 avg K=4",
    "bucket_reduce fp64->fp64 max K=4", "wire_cast fp32->bf16 divide", "wire_cast fp16->fp16 divide",
    # compression
    "quantize fp32 int8", "quantize bf16 int4 stochastic", "dequantize int8->fp32 accumulate", "dequantize int4->bf16",
    "abs_sum fp32 residual", "sign_pack bf16 residual", "sign_unpack ->fp16 accumulate",
    "residual_add bf16+fp32->bf16 count_bad", "error_update fp32->bf16 out",
    "topk_candidates fp32 residual idx=i32", "topk_candidates bf16 idx=i64", "scatter fp32->fp32 accumulate atomic",
    "scatter bf16->bf16 write", "orthogonalize fp32 rank=8", "orthogonalize bf16 rank=32",
    # MoE
    "moe_route bf16 softmax renorm=True E=64 k=2", "moe_route fp32 sigmoid bias=True groups=8 E=256 k=8",
    "moe_route.assign capacity=probability per-sequence", "moe_permute bf16 weights k=2", "moe_unpermute fp16 k=2",
    "moe_permute fp32 padded", "moe_unpermute.backward bf16 k=2",
    # expert-parallel wire rows
    "quantize_rows bf16 e4m3 index", "quantize_rows fp32 int8 index", "dequantize_rows e4m3->bf16 index",
    "dequantize_rows int8->bf16",
)  # fmt: skip


def canary() -> list[str]:
    """What the gate says of a deliberately de-vectorized kernel: the copy anchor launched at an odd size
    (Triton cannot prove its mask constant over a vector, so every access is 32-bit). A gate that found
    nothing to say here could not fail."""
    import torch

    from torsh_kernels.profiling import anchors
    from torsh_kernels.profiling.inspection import KernelReader, check, summarize
    from torsh_kernels.profiling.launches import capture
    from torsh_kernels.profiling.sass import ARCHS

    n = (1 << 20) + 3
    launches = capture("triton", ARCHS["sm_90"], lambda: anchors.copy(torch.empty(n), torch.empty(n)))
    entry = summarize(KernelReader(ARCHS["sm_90"]), launches, 8 * n, n)
    return check({**entry, "name": "canary: copy at an odd size", "provider": "triton", "layout": "aligned",
                  "memory_bound": True})  # fmt: skip


def main() -> int:
    args = sys.argv[1:]
    which = args.pop(0)
    gate = "--gate" in args
    args = [a for a in args if a != "--gate"]
    shard = (int(args[0]), int(args[1])) if args else None
    try:
        from torsh_kernels.profiling.inspection import inspect_kernels

        # the full check reads Numba's resource usage only (its goals: registers, occupancy, spills); the gate
        # disassembles everything
        rep = inspect_kernels("sm_90", providers=(which,), names=GATE if gate else None, shard=shard,
                              disassemble=("triton", "numba") if gate else ("triton",),
                              progress=lambda s: print(s, flush=True))  # fmt: skip
        out = {"which": which, "cases": [{k: c[k] for k in ("name", "provider", "layout", "registers", "occupancy",
                                                            "share_128", "spill_bytes", "misses")}
                                         | {"kernels": sorted({ln["kernel"] for ln in c["launches"]})}
                                         for c in rep["cases"]],
               "errors": rep["errors"], "kernels": len(rep["kernels"])}  # fmt: skip
        if gate and which == "triton" and (shard is None or shard[0] == 0):  # (once, in the first shard)
            out["canary"] = canary()
    except Exception:
        traceback.print_exc()
        return 2
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
