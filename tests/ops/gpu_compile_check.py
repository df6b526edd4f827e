"""Compile every GPU kernel variant of the bucket, compression and MoE ops for a real GPU target, with no GPU present.

Run in a fresh process without TRITON_INTERPRET / NUMBA_ENABLE_CUDASIM (test_gpu_compile.py does), so
the kernel modules (ops/_<family>_triton.py, ops/_<family>_numba.py) define real Triton JITFunctions and
Numba CUDA dispatchers:

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

from torsh_kernels.ops import _bucket_tables, bucket
from torsh_kernels.ops.quantize import QMAX, QTILE
from torsh_kernels.ops.sign import SIGN_BYTES

TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}
DTYPES = list(TL)


def triton_variants():
    from torsh_kernels.ops import _bucket_triton as B

    for src in DTYPES:
        for dst in DTYPES:
            f64 = torch.float64 in (src, dst)
            yield (
                f"flatten {TL[src]}->{TL[dst]}",
                B._flatten_kernel,
                {"table_ptr": "*i64", "tile_ptr": "*i32", "out_ptr": f"*{TL[dst]}", "ref_ptr": f"*{TL[src]}",
                 "scale_bits": "i64"},
                {"BLOCK": bucket.TRITON_BLOCK, "NCOL": _bucket_tables.NCOLS, "HAS_SCALE": True, "COMPUTE_F64": f64},
            )  # fmt: skip
            yield (
                f"unflatten {TL[src]}->{TL[dst]} accumulate",
                B._unflatten_kernel,
                {"table_ptr": "*i64", "tile_ptr": "*i32", "flat_ptr": f"*{TL[src]}", "ref_ptr": f"*{TL[dst]}",
                 "scale_bits": "i64"},
                {"BLOCK": bucket.TRITON_BLOCK, "NCOL": _bucket_tables.NCOLS, "HAS_SCALE": True, "ACCUMULATE": True,
                 "COMPUTE_F64": f64},
            )  # fmt: skip
        for op in (0, 1, 2):
            out = torch.float32 if src == torch.bfloat16 else src
            yield (
                f"bucket_reduce {TL[src]}->{TL[out]} op={op}",
                B._bucket_reduce_kernel,
                {"ptrs_ptr": "*i64", "out_ptr": f"*{TL[out]}", "ref_ptr": f"*{TL[src]}", "numel": "i64", "K": "i32"},
                {"BLOCK": bucket.TRITON_BLOCK, "OP": op, "COMPUTE_F64": src == torch.float64},
            )
        if src != torch.float64:
            for wire in bucket.WIRE_DTYPES:
                yield (
                    f"wire_cast {TL[src]}->{TL[wire]}",
                    B._wire_cast_kernel,
                    {"x_ptr": f"*{TL[src]}", "out_ptr": f"*{TL[wire]}", "bad_ptr": "*i64", "n": "i64",
                     "divisor": "fp32"},
                    {"BLOCK": bucket.TRITON_BLOCK, "DIVIDE": True, "COUNT_BAD": True},
                )  # fmt: skip


def compress_triton_variants():
    from torsh_kernels.ops import _error_feedback_triton as EF
    from torsh_kernels.ops import _orthogonalize_triton as O
    from torsh_kernels.ops import _quantize_triton as Q
    from torsh_kernels.ops import _sign_triton as S
    from torsh_kernels.ops import _topk_triton as TK
    from torsh_kernels.ops._common import BLOCK

    F = ("fp32", "fp16", "bf16")
    for x in F:
        for out in ("fp32", "bf16"):
            for bad in (False, True):
                yield (f"residual_add {x}+fp32->{out} count_bad={bad}", EF._axpby_kernel,
                       {"x_ptr": f"*{x}", "y_ptr": "*fp32", "out_ptr": f"*{out}", "bad_ptr": "*i64", "n": "i64",
                        "beta": "fp32"}, {"BLOCK": BLOCK, "COUNT_BAD": bad})  # fmt: skip
        for r in (False, True):
            for idx in ("i32", "i64"):
                yield (f"topk_candidates {x} residual={r} idx={idx}", TK._topk_candidates_kernel,
                       {"x_ptr": f"*{x}", "r_ptr": "*fp32", "cval_ptr": "*fp32", "cidx_ptr": f"*{idx}",
                        "cnt_ptr": "*i64", "n": "i64", "thr": "fp32", "cap": "i64"},
                       {"BLOCK": BLOCK, "HAS_R": r})  # fmt: skip
            yield (f"abs_sum {x} residual={r}", S._abs_sum_kernel,
                   {"x_ptr": f"*{x}", "r_ptr": "*fp32", "part_ptr": "*fp32", "bad_ptr": "*i64", "n": "i64"},
                   {"BLOCK": BLOCK, "HAS_R": r})  # fmt: skip
            yield (f"sign_pack {x} residual={r}", S._sign_pack_kernel,
                   {"x_ptr": f"*{x}", "r_ptr": "*fp32", "bits_ptr": "*u8", "scale_ptr": "*fp32", "n": "i64",
                    "nbytes": "i64"}, {"BYTES": SIGN_BYTES, "HAS_R": r})  # fmt: skip
        for bits in (8, 4):
            for st in (False, True):
                yield (f"quantize {x} int{bits} stochastic={st}", Q._quantize_kernel,
                       {"x_ptr": f"*{x}", "q_ptr": "*i8" if bits == 8 else "*u8", "s_ptr": "*fp32",
                        "bad_ptr": "*i64", "n": "i64", "nblocks": "i64", "key": "i64"},
                       {"QBLOCK": 256, "GROUP": QTILE // 256, "BITS": bits, "QMAXV": QMAX[bits],
                        "STOCHASTIC": st})  # fmt: skip
            for acc in (False, True):
                yield (f"dequantize int{bits}->{x} accumulate={acc}", Q._dequantize_kernel,
                       {"q_ptr": "*i8" if bits == 8 else "*u8", "s_ptr": "*fp32", "out_ptr": f"*{x}", "n": "i64",
                        "nblocks": "i64", "alpha": "fp32"},
                       {"QBLOCK": 256, "GROUP": QTILE // 256, "BITS": bits, "ACCUMULATE": acc})  # fmt: skip
        for acc in (False, True):
            yield (f"sign_unpack ->{x} accumulate={acc}", S._sign_unpack_kernel,
                   {"bits_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": f"*{x}", "n": "i64", "nbytes": "i64",
                    "alpha": "fp32"}, {"BYTES": SIGN_BYTES, "ACCUMULATE": acc})  # fmt: skip
            for atomic in (False, True) if acc else (False,):
                out = "fp32" if atomic else x
                yield (f"scatter {x}->{out} accumulate={acc} atomic={atomic}", TK._scatter_kernel,
                       {"val_ptr": f"*{x}", "idx_ptr": "*i32", "out_ptr": f"*{out}", "k": "i64", "numel": "i64",
                        "alpha": "fp32"}, {"BLOCK": BLOCK, "ACCUMULATE": acc, "ATOMIC": atomic})  # fmt: skip
        for has_out in (False, True):
            yield (f"error_update fp32->{x} out={has_out}", EF._error_update_kernel,
                   {"acc_ptr": "*fp32", "approx_ptr": "*fp32", "res_ptr": "*fp32", "out_ptr": f"*{x}", "n": "i64"},
                   {"BLOCK": BLOCK, "HAS_OUT": has_out})  # fmt: skip
    for dt in ("fp32", "fp64", "bf16"):
        for rp, rows in ((2, 256), (8, 64), (32, 4)):
            yield (f"orthogonalize {dt} RP={rp}", O._orthogonalize_kernel,
                   {"table_ptr": "*i64", "ref_ptr": f"*{dt}", "r": "i32", "rtol2": "fp64"},
                   {"ROWS": rows, "RP": rp, "ITERS": 2})  # fmt: skip


def moe_triton_variants():
    from torsh_kernels.ops import _moe_triton as M
    from torsh_kernels.ops.moe import _ASSIGN_BLOCK

    F = ("fp32", "fp16", "bf16")
    route = {"logits_ptr": None, "bias_ptr": "*fp32", "idx_ptr": "*i64", "w_ptr": "*fp32", "s_ptr": "*fp32",
             "bad_ptr": "*i32", "T": "i32", "E": "i32", "stride_t": "i32", "NG": "i32", "TG": "i32", "GS": "i32",
             "scale": "fp32"}  # fmt: skip
    plain = {"GP": 2, "HAS_BIAS": False, "GROUPED": False}
    for x in F:
        for score in (0, 1):
            for renorm in (False, True):
                yield (f"moe_route_topk {x} score={score} renorm={renorm} K=2 E<=8", M._route_topk_kernel,
                       {**route, "logits_ptr": f"*{x}"},
                       {"K": 2, "KP": 2, "EP": 8, "BLOCK_T": 64, "SCORE": score, "RENORM": renorm,
                        **plain})  # fmt: skip
    yield ("moe_route_topk bf16 K=6 E<=64", M._route_topk_kernel, {**route, "logits_ptr": "*bf16"},
           {"K": 6, "KP": 8, "EP": 64, "BLOCK_T": 64, "SCORE": 0, "RENORM": True, **plain})  # fmt: skip
    for bias, grouped in ((True, False), (False, True), (True, True)):  # DeepSeek-V3's selection options
        yield (f"moe_route_topk fp32 K=8 E<=256 bias={bias} grouped={grouped}", M._route_topk_kernel,
               {**route, "logits_ptr": "*fp32"},
               {"K": 8, "KP": 8, "EP": 256, "GP": 8, "BLOCK_T": 16, "SCORE": 1, "RENORM": True, "HAS_BIAS": bias,
                "GROUPED": grouped})  # fmt: skip
    for seq in (False, True):  # the capacity of the call, or per sequence
        for policy in (0, 1, 2):
            yield (f"moe_route_assign policy={policy} seq={seq}", M._route_assign_kernel,
                   {"idx_ptr": "*i64", "s_ptr": "*fp32", "pos_ptr": "*i64", "counts_ptr": "*i64", "seg_ptr": "*i64",
                    "cap_ptr": "*i64", "n": "i32", "cap": "i32", "E": "i32"},
                   {"BLOCK": _ASSIGN_BLOCK, "POLICY": policy, "SEQ": seq})  # fmt: skip
        yield (f"moe_route_rows seq={seq}", M._route_rows_kernel,
               {"idx_ptr": "*i64", "row_ptr": "*i64", "starts_ptr": "*i64", "tok_ptr": "*i64", "seg_ptr": "*i64",
                "n": "i32", "E": "i32"},
               {"K": 2, "BLOCK": 1024, "SEQ": seq})  # fmt: skip
    for x in F:
        for has_w in (False, True):
            w = "*fp32" if has_w else "*i64"
            yield (f"moe_permute {x} weights={has_w}", M._permute_kernel,
                   {"x_ptr": f"*{x}", "row_ptr": "*i64", "w_ptr": w, "out_ptr": f"*{x}", "H": "i32", "N": "i32"},
                   {"K": 2, "BLOCK_H": 1024, "HAS_W": has_w})  # fmt: skip
            yield (f"moe_unpermute {x} weights={has_w}", M._unpermute_kernel,
                   {"y_ptr": f"*{x}", "row_ptr": "*i64", "w_ptr": w, "out_ptr": f"*{x}", "H": "i32", "N": "i32"},
                   {"K": 2, "BLOCK_H": 1024, "HAS_W": has_w})  # fmt: skip
        yield (f"moe_permute_padded {x}", M._permute_padded_kernel,
               {"x_ptr": f"*{x}", "tok_ptr": "*i64", "out_ptr": f"*{x}", "H": "i32", "T": "i32"},
               {"BLOCK_H": 1024})  # fmt: skip
        yield (f"moe_unpermute_backward {x}", M._unpermute_bwd_kernel,
               {"gy_ptr": f"*{x}", "y_ptr": f"*{x}", "row_ptr": "*i64", "w_ptr": "*fp32", "gyp_ptr": f"*{x}",
                "gw_ptr": "*fp32", "H": "i32", "N": "i32"}, {"K": 2, "KP": 2, "BLOCK_H": 1024})  # fmt: skip


def compile_triton(cap: int) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget

    results = []
    for name, fn, sig, consts in [*triton_variants(), *compress_triton_variants(), *moe_triton_variants()]:
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


def compile_numba(cc: tuple[int, int], shard: int = 0, shards: int = 1) -> list[dict]:
    """Every Numba kernel variant to PTX for ``cc``; with ``shards`` > 1 only the variants whose index is
    ``shard`` modulo ``shards`` (the test runs the shards in parallel processes)."""
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
    todo = []
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
            if src != torch.float64 and dst in bucket.WIRE_DTYPES:
                variants.append(
                    (f"wire_cast {TL[src]}->{TL[dst]}", _bucket_numba.wire_cast_kernel(src, dst),
                     (nt[src][::1], nt[dst][::1], int64[::1], int64, float64, boolean))
                )  # fmt: skip
            todo += variants
    todo += [*compress_numba_variants(nt), *moe_numba_variants(nt)]
    mine = [v for i, v in enumerate(todo) if i % shards == shard]
    return [_compile_ptx(cuda, name, kernel, sig, cc) for name, kernel, sig in mine]


def _compile_ptx(cuda, name, kernel, sig, cc) -> dict:
    try:
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc)
        res = {"kernel": name, "ok": ".entry" in ptx, "ptx_lines": ptx.count("\n")}
    except Exception as exc:
        res = {"kernel": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    print(("ok   " if res["ok"] else "FAIL ") + "numba " + name, flush=True)
    return res


def compress_numba_variants(nt):
    from numba import float32, float64, int8, int32, int64, uint8

    from torsh_kernels.ops import _error_feedback_numba as EF
    from torsh_kernels.ops import _orthogonalize_numba as O
    from torsh_kernels.ops import _quantize_numba as Q
    from torsh_kernels.ops import _sign_numba as S
    from torsh_kernels.ops import _topk_numba as TK

    a = {d: nt[d][::1] for d in nt}
    f32, i64 = a[torch.float32], int64[::1]
    for x in (torch.float32, torch.float16, torch.bfloat16):
        n = TL[x]
        for bad in (False, True):
            yield (f"residual_add {n} count_bad={bad}", EF._axpby_kernel(x, torch.float32, torch.float32, bad),
                   (a[x], f32, f32, i64, int64, float64))  # fmt: skip
        yield (f"error_update ->{n}", EF._error_update_kernel(torch.float32, torch.float32, torch.float32, x, True),
               (f32, f32, f32, a[x], int64))  # fmt: skip
        for r in (False, True):
            yield (f"topk_candidates {n} residual={r}", TK._candidates_kernel(x, torch.float32, r),
                   (a[x], f32, f32, int32[::1], i64, int64, float64, int64))  # fmt: skip
            yield (f"abs_sum {n} residual={r}", S._abs_sum_kernel(x, torch.float32, r), (a[x], f32, f32, i64, int64))
            yield (f"sign_pack {n} residual={r}", S._sign_pack_kernel(x, torch.float32, r),
                   (a[x], f32, uint8[::1], f32, int64, int64))  # fmt: skip
        for acc, atomic in ((False, False), (True, False), (True, True)):
            out = torch.float32 if atomic else x
            yield (f"scatter {n}->{TL[out]} accumulate={acc} atomic={atomic}", TK._scatter_kernel(x, out, acc, atomic),
                   (a[x], int32[::1], a[out], int64, int64, float64))  # fmt: skip
        for bits in (8, 4):
            q = int8[::1] if bits == 8 else uint8[::1]
            for st in (False, True):
                yield (f"quantize {n} int{bits} stochastic={st}", Q._quantize_kernel(x, bits, st),
                       (a[x], q, f32, i64, int64, int64, int64, float64))  # fmt: skip
            for acc in (False, True):
                yield (f"dequantize int{bits}->{n} accumulate={acc}", Q._dequantize_kernel(x, bits, acc),
                       (q, f32, a[x], int64, int64, float64))  # fmt: skip
        for acc in (False, True):
            yield (f"sign_unpack ->{n} accumulate={acc}", S._sign_unpack_kernel(x, acc),
                   (uint8[::1], f32, a[x], int64, int64, float64))  # fmt: skip
    for d in (torch.float32, torch.float64, torch.bfloat16):
        for rp in (2, 8, 32):
            yield (f"orthogonalize {TL[d]} RP={rp}", O._ortho_kernel(d, rp),
                   (int64[::1], a[d], int64, float64, int64))  # fmt: skip
    _ = float32


def moe_numba_variants(nt):
    from numba import float32, int32, int64

    from torsh_kernels.ops import _moe_numba as K

    a = {d: nt[d][::1] for d in nt}
    f32, i64 = float32[::1], int64[::1]
    for x in (torch.float32, torch.float16, torch.bfloat16):
        n = TL[x]
        route = (a[x], f32, f32, int32[::1], i64, f32, f32, int32[::1], int64, int64, int64, int64, int64, float32)
        for softmax in (False, True):
            for renorm in (False, True):
                yield (f"moe_route_topk {n} softmax={softmax} renorm={renorm}",
                       K._topk_kernel(x, softmax, renorm, False, False), route)  # fmt: skip
        for bias, grouped in ((True, False), (False, True), (True, True)):  # DeepSeek-V3's: sigmoid, renormalised
            yield (f"moe_route_topk {n} bias={bias} grouped={grouped}", K._topk_kernel(x, False, True, bias, grouped),
                   route)  # fmt: skip
        for has_w in (False, True):
            yield (f"moe_permute {n} weights={has_w}", K._scatter_kernel(x, x, has_w),
                   (a[x], i64, f32, a[x], int64, int64))  # fmt: skip
            yield (f"moe_unpermute {n} weights={has_w}", K._gather_kernel(x, has_w),
                   (a[x], i64, f32, a[x], int64, int64))  # fmt: skip
        yield (f"moe_row_dots {n}", K._dots_kernel(x), (a[x], a[x], i64, f32, int64, int64, int64))
        yield (f"moe_permute_padded {n}", K._permute_padded_kernel(x), (a[x], i64, a[x], int64, int64))
    yield ("moe_route_assign", K._assign_kernel, (i64, f32, i64, i64, int64, int64, int64, int64, i64, i64, int64))
    yield ("moe_route_rows", K._rows_kernel, (i64, i64, i64, i64, int64, int64, i64, int64, int64))


def main() -> int:
    which = sys.argv[1]  # "triton", or "numba" [SHARD SHARDS]
    try:
        res = compile_triton(90) if which == "triton" else compile_numba((9, 0), *map(int, sys.argv[2:4]))
    except Exception:
        traceback.print_exc()
        return 2
    print(json.dumps({"which": which, "results": res}))
    return 0 if all(r["ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
