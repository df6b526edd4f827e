"""Compile every GPU kernel variant of the bucket ops for a real GPU target, with no GPU present.

Run in a fresh process without TRITON_INTERPRET / NUMBA_ENABLE_CUDASIM (test_gpu_compile.py does), so
the module defines real Triton JITFunctions and Numba CUDA dispatchers:

- Triton: each kernel variant goes through Triton's full pipeline (TTIR, TTGIR, LLVM IR, PTX, and a
  cubin from the bundled ptxas) for sm_90 (Hopper);
- Numba: each kernel variant is compiled to sm_90 PTX through NVVM (needs libnvvm from a CUDA toolkit).

This catches what the interpreter and the simulator cannot: type errors, unsupported operations and
casts in the compiled path. It does not run the kernels; that needs a GPU.
Prints one line per variant and a final JSON summary line.
"""

from __future__ import annotations

import json
import sys
import traceback

import torch

from torsh_kernels.ops import bucket

TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
DTYPES = list(TL)


def triton_variants():
    for src in DTYPES:
        for dst in DTYPES:
            f64 = torch.float64 in (src, dst)
            yield (
                f"flatten {TL[src]}->{TL[dst]}",
                bucket._flatten_kernel,
                {"table_ptr": "*i64", "tile_ptr": "*i32", "out_ptr": f"*{TL[dst]}", "ref_ptr": f"*{TL[src]}",
                 "scale_bits": "i64"},
                {"BLOCK": bucket.TRITON_BLOCK, "NCOL": bucket.NCOLS, "HAS_SCALE": True, "COMPUTE_F64": f64},
            )  # fmt: skip
            yield (
                f"unflatten {TL[src]}->{TL[dst]} accumulate",
                bucket._unflatten_kernel,
                {"table_ptr": "*i64", "tile_ptr": "*i32", "flat_ptr": f"*{TL[src]}", "ref_ptr": f"*{TL[dst]}",
                 "scale_bits": "i64"},
                {"BLOCK": bucket.TRITON_BLOCK, "NCOL": bucket.NCOLS, "HAS_SCALE": True, "ACCUMULATE": True,
                 "COMPUTE_F64": f64},
            )  # fmt: skip
        for op in (0, 1, 2):
            out = torch.float32 if src == torch.bfloat16 else src
            yield (
                f"bucket_reduce {TL[src]}->{TL[out]} op={op}",
                bucket._bucket_reduce_kernel,
                {"ptrs_ptr": "*i64", "out_ptr": f"*{TL[out]}", "ref_ptr": f"*{TL[src]}", "numel": "i64", "K": "i32"},
                {"BLOCK": bucket.TRITON_BLOCK, "OP": op, "COMPUTE_F64": src == torch.float64},
            )


def compile_triton(cap: int) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget

    results = []
    for name, fn, sig, consts in triton_variants():
        try:
            src = triton.compiler.ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                                            constexprs=consts)  # fmt: skip
            k = triton.compile(src, target=GPUTarget("cuda", cap, 32))
            ok = bool(k.asm.get("cubin"))
            results.append({"kernel": name, "ok": ok, "ptx_lines": k.asm["ptx"].count("\n")})
        except Exception as exc:
            results.append({"kernel": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        print(("ok   " if results[-1]["ok"] else "FAIL ") + "triton " + name, flush=True)
    return results


def compile_numba(cc: tuple[int, int]) -> list[dict]:
    # Numba's built-in target compiles the device functions a kernel calls for the *current* GPU, and
    # asks the driver which that is. With no GPU, name the target instead; everything else is unchanged.
    import numba.cuda.dispatcher as dispatcher
    from numba import boolean, cuda, float32, float64, int16, int32, int64
    from numba.types import float16

    from torsh_kernels.ops import _bucket_numba

    if not cuda.is_available():
        dispatcher.get_current_device = lambda: type("Target", (), {"compute_capability": cc})()

    nt = {torch.float32: float32, torch.float16: float16, torch.bfloat16: int16, torch.float64: float64}
    table, tiles = int64[:, ::1], int32[::1]
    results = []
    for src in DTYPES:
        for dst in DTYPES:
            variants = [
                (f"flatten {TL[src]}->{TL[dst]}", _bucket_numba.flatten_kernel(src, dst),
                 (table, tiles, nt[src][::1], nt[dst][::1], float64, int64)),
                (f"unflatten {TL[src]}->{TL[dst]}", _bucket_numba.unflatten_kernel(src, dst),
                 (table, tiles, nt[dst][::1], nt[src][::1], float64, boolean, int64)),
            ]  # fmt: skip
            if src == dst or dst == torch.float32:
                for op in (0, 1, 2):
                    variants.append(
                        (f"bucket_reduce {TL[src]}->{TL[dst]} op={op}", _bucket_numba.reduce_kernel(src, dst, op),
                         (int64[::1], nt[src][::1], nt[dst][::1], int64, int64))
                    )  # fmt: skip
            for name, kernel, sig in variants:
                try:
                    ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc)
                    results.append({"kernel": name, "ok": ".entry" in ptx, "ptx_lines": ptx.count("\n")})
                except Exception as exc:
                    results.append({"kernel": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                print(("ok   " if results[-1]["ok"] else "FAIL ") + "numba " + name, flush=True)
    return results


def main() -> int:
    which = sys.argv[1]
    try:
        res = compile_triton(90) if which == "triton" else compile_numba((9, 0))
    except Exception:
        traceback.print_exc()
        return 2
    print(json.dumps({"which": which, "results": res}))
    return 0 if all(r["ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
