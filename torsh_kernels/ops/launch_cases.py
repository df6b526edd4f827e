"""The launch cases of every GPU kernel: for each op family, calls of its provider implementations (the
functions a public op runs once its inputs are validated and its outputs allocated) at benchmark sizes, on
the layouts that matter: aligned contiguous tensors of odd sizes, and where a kernel has another path,
unaligned or strided ones. ``torsh inspect`` runs each case with launches captured, not run
(:mod:`torsh_kernels.profiling.launches`), so every kernel variant is compiled exactly as its launcher
specializes it; the GPU compile check and the SASS gate of the test suite use the same cases.

A case allocates CPU tensors with ``torch.empty`` (no page is touched: sizes cost nothing) and records the
bytes the op moves through global memory (reads + writes of its data, the figure a bandwidth bound needs).
Case names are stable: the gate's thresholds and the committed reports refer to them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from .registry import implementation

__all__ = ["FAMILIES", "Case", "cases"]

FAMILIES = ("bucket", "quantize", "sign", "error_feedback", "topk", "orthogonalize", "moe", "rowquant")

N = (1 << 24) + 3
"""Elements of an elementwise case: 16 Mi + 3 (64 MiB of fp32), an odd size as most real ones are."""

_F = (torch.float32, torch.float16, torch.bfloat16)
_ALL = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_TL = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
       torch.int32: "i32", torch.int64: "i64"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Case:
    """One call of one provider implementation."""

    family: str
    name: str
    """Stable, unique: ``"flatten fp32->bf16 scale aligned"``."""
    op: str
    """The registry name of the op whose implementation runs."""
    call: Callable[[Callable[..., object]], object]
    """Given the implementation, makes the call (allocating its inputs)."""
    nbytes: int
    """Bytes the op reads and writes through global memory."""
    elements: int
    """Elements the op processes (instructions per element are counted against these)."""
    memory_bound: bool = True
    """False for kernels bound by arithmetic or by one program's sequential work (the SASS goals do not
    apply to them; they are reported all the same)."""
    layout: str = "aligned"
    """``aligned`` (16-byte aligned contiguous tensors), ``unaligned`` or ``strided``."""

    def run(self, provider: str) -> object:
        return self.call(implementation(self.op, provider))


def _sz(d: torch.dtype) -> int:
    return torch.empty((), dtype=d).element_size()


def _e(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


# A transformer layer's gradients at hidden 1024 (sizes multiples of 16: a dense bucket of them keeps every
# tensor 16-byte aligned relative to its source), 12.6 Mi elements; the unaligned bucket puts odd sizes first
# (53,265 elements: 1 more than a multiple of 16), so every later tensor's offset in the flat buffer disagrees
# with its address by one element.
_LAYER = [(1024, 1024)] * 4 + [(1024,)] * 4 + [(4096, 1024), (4096,), (1024, 4096), (1024,), (1024,), (1024,)]
_ODD = [(1000, 3), (7,), (50257,), (1,)]


def _bucket_tensors(layout: str, dtype: torch.dtype) -> list[torch.Tensor]:
    shapes = _ODD + _LAYER if layout == "unaligned" else _LAYER
    ts = [_e(*s, dtype=dtype) for s in shapes]
    if layout == "strided":  # the matrices transposed: one of every two tensors is not contiguous
        ts = [t.t() if t.dim() == 2 else t for t in ts]
    return ts


def _bucket() -> Iterator[Case]:
    def flatten(src, dst, scale, layout):
        n = sum(math.prod(s) for s in (_ODD + _LAYER if layout == "unaligned" else _LAYER))

        def call(impl):
            ts = _bucket_tensors(layout, src)
            impl(ts, _e(sum(t.numel() for t in ts), dtype=dst), scale)

        tag = "scale" if scale != 1.0 else "copy"
        return Case("bucket", f"flatten {_TL[src]}->{_TL[dst]} {tag} {layout}", "flatten", call,
                    n * (_sz(src) + _sz(dst)), n, layout=layout)  # fmt: skip

    def unflatten(src, dst, acc, layout):
        n = sum(math.prod(s) for s in (_ODD + _LAYER if layout == "unaligned" else _LAYER))

        def call(impl):
            ts = _bucket_tensors(layout, dst)
            impl(_e(sum(t.numel() for t in ts), dtype=src), ts, 0.5, acc)

        tag = "accumulate" if acc else "copy"
        return Case("bucket", f"unflatten {_TL[src]}->{_TL[dst]} {tag} {layout}", "unflatten", call,
                    n * (_sz(src) + _sz(dst) * (2 if acc else 1)), n, layout=layout)  # fmt: skip

    for src in _ALL:
        for dst in _ALL:
            yield flatten(src, dst, 0.125, "aligned")
            yield unflatten(src, dst, True, "aligned")
    for layout in ("unaligned", "strided"):
        for src, dst in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            yield flatten(src, dst, 1.0, layout)
            yield unflatten(dst, src, False, layout)
    yield flatten(torch.float32, torch.float32, 1.0, "aligned")
    yield unflatten(torch.float32, torch.float32, False, "aligned")

    for src in _ALL:
        out = torch.float32 if src == torch.bfloat16 else src
        for op in ("sum", "avg", "max"):
            yield Case("bucket", f"bucket_reduce {_TL[src]}->{_TL[out]} {op} K=4", "bucket_reduce",
                       lambda impl, s=src, o=out, op=op: impl([_e(N, dtype=s) for _ in range(4)], _e(N, dtype=o), op),
                       N * (4 * _sz(src) + _sz(out)), N)  # fmt: skip
    for src in _F:
        for wire in (torch.float16, torch.bfloat16, torch.float32):
            yield Case("bucket", f"wire_cast {_TL[src]}->{_TL[wire]} divide", "wire_cast",
                       lambda impl, s=src, w=wire: impl(_e(N, dtype=s), _e(N, dtype=w), 8.0, True),
                       N * (_sz(src) + _sz(wire)), N)  # fmt: skip


def _quantize() -> Iterator[Case]:
    block = 256
    nb = -(-N // block)
    for x in _F:
        for bits in (8, 4):
            qn, qd = (N, torch.int8) if bits == 8 else (-(-N // 2), torch.uint8)
            for st in (False, True):
                yield Case("quantize", f"quantize {_TL[x]} int{bits}{' stochastic' if st else ''}", "quantize",
                           lambda impl, x=x, bits=bits, st=st, qn=qn, qd=qd: impl(
                               _e(N, dtype=x), _e(qn, dtype=qd), _e(nb), bits, block, st, 12345),
                           N * _sz(x) + qn + 4 * nb, N)  # fmt: skip
            for acc in (False, True):
                yield Case("quantize", f"dequantize int{bits}->{_TL[x]}{' accumulate' if acc else ''}", "dequantize",
                           lambda impl, x=x, bits=bits, acc=acc, qn=qn, qd=qd: impl(
                               _e(qn, dtype=qd), _e(nb), _e(N, dtype=x), bits, block, 1.0, acc),
                           qn + 4 * nb + N * _sz(x) * (2 if acc else 1), N)  # fmt: skip


def _sign() -> Iterator[Case]:
    nbytes = -(-N // 8)
    for x in _F:
        for r in (False, True):
            tag = " residual" if r else ""
            yield Case("sign", f"abs_sum {_TL[x]}{tag}", "sign_compress",
                       lambda impl, x=x, r=r: impl(_e(N, dtype=x), _e(N) if r else None),
                       N * (_sz(x) + (4 if r else 0)), N)  # fmt: skip
            yield Case("sign", f"sign_pack {_TL[x]}{tag}", "sign_compress.pack",
                       lambda impl, x=x, r=r: impl(_e(N, dtype=x), _e(N) if r else None,
                                                   _e(nbytes, dtype=torch.uint8), _e(1)),
                       N * (_sz(x) + (8 if r else 0)) + nbytes, N)  # fmt: skip
        for acc in (False, True):
            yield Case("sign", f"sign_unpack ->{_TL[x]}{' accumulate' if acc else ''}", "sign_decompress",
                       lambda impl, x=x, acc=acc: impl(_e(nbytes, dtype=torch.uint8), _e(1), _e(N, dtype=x), 1.0,
                                                       acc),
                       nbytes + N * _sz(x) * (2 if acc else 1), N)  # fmt: skip


def _error_feedback() -> Iterator[Case]:
    for x in _F:
        for out in (torch.float32, torch.bfloat16):
            for bad in (False, True):
                yield Case("error_feedback", f"residual_add {_TL[x]}+fp32->{_TL[out]}{' count_bad' if bad else ''}",
                           "residual_add",
                           lambda impl, x=x, o=out, b=bad: impl(_e(N, dtype=x), _e(N), _e(N, dtype=o), 0.5, b),
                           N * (_sz(x) + 4 + _sz(out)), N)  # fmt: skip
        for has_out in (False, True):
            yield Case("error_feedback", f"error_update fp32->{_TL[x]}{' out' if has_out else ''}", "error_update",
                       lambda impl, x=x, h=has_out: impl(_e(N), _e(N), _e(N), _e(N, dtype=x) if h else None),
                       N * (12 + (_sz(x) if has_out else 0)), N)  # fmt: skip


def _topk() -> Iterator[Case]:
    cap = N // 50  # the candidates of a 1% top-k with its usual threshold slack
    k = N // 100
    for x in _F:
        for r in (False, True):
            for idx in (torch.int32, torch.int64):
                yield Case("topk", f"topk_candidates {_TL[x]}{' residual' if r else ''} idx={_TL[idx]}",
                           "topk_compress",
                           lambda impl, x=x, r=r, idx=idx: impl(_e(N, dtype=x), _e(N) if r else None, 0.5, cap, idx),
                           N * (_sz(x) + (4 if r else 0)) + cap * (4 + _sz(idx)), N)  # fmt: skip
        for acc, unique in ((False, True), (True, True), (True, False)):
            out = x if unique else torch.float32
            tag = ("accumulate" if acc else "write") + ("" if unique else " atomic")
            yield Case("topk", f"scatter {_TL[x]}->{_TL[out]} {tag}", "topk_decompress",
                       lambda impl, x=x, o=out, a=acc, u=unique: impl(
                           _e(k, dtype=x), torch.zeros(k, dtype=torch.int32), _e(N, dtype=o), 1.0, a, u),
                       k * (_sz(x) + 4 + _sz(out) * (2 if acc else 1)), k)  # fmt: skip


def _orthogonalize() -> Iterator[Case]:
    for d in (torch.float32, torch.float64, torch.bfloat16):
        for r in (2, 8, 32):
            rows = 4096
            yield Case("orthogonalize", f"orthogonalize {_TL[d]} rank={r}", "orthogonalize",
                       lambda impl, d=d, r=r: impl([_e(rows, r, dtype=d) for _ in range(8)], 1e-6, 2),
                       8 * rows * r * _sz(d) * 2, 8 * rows * r, memory_bound=False)  # fmt: skip


_T, _H = 4096, 4096  # tokens, hidden


def _moe() -> Iterator[Case]:
    i64 = torch.int64
    for x in _F:
        for score in ("softmax", "sigmoid"):
            for renorm in (False, True):
                yield Case("moe", f"moe_route {_TL[x]} {score} renorm={renorm} E=64 k=2", "moe_route",
                           lambda impl, x=x, s=score, r=renorm: impl(_e(_T, 64, dtype=x), 2, s, r, None, 0, 0, 1.0),
                           _T * 64 * _sz(x) + _T * 2 * 16, _T * 64, memory_bound=False)  # fmt: skip
    for bias, groups in ((True, 0), (False, 8), (True, 8)):  # DeepSeek-V3's selection options
        yield Case("moe", f"moe_route fp32 sigmoid bias={bias} groups={groups} E=256 k=8", "moe_route",
                   lambda impl, b=bias, g=groups: impl(_e(_T, 256), 8, "sigmoid", True, _e(256) if b else None, g,
                                                       4 if g else 0, 2.5),
                   _T * 256 * 4 + _T * 8 * 16, _T * 256, memory_bound=False)  # fmt: skip
    n = _T * 2
    for policy, name in ((0, "none"), (1, "position"), (2, "probability")):
        for seq in (None, ([_T // 4] * 4, [_T // 64] * 4)):
            pad = -1 if policy == 0 and seq is None else 128  # (a padded routing reads no count back)
            yield Case("moe", f"moe_route.assign capacity={name}{' per-sequence' if seq else ''}",
                       "moe_route.assign",
                       lambda impl, p=policy, s=seq, pad=pad: impl(torch.zeros(_T, 2, dtype=i64), _e(_T, 2), 64,
                                                                   128, p, s, pad),
                       n * (8 + 4 + 8 + 8), n, memory_bound=False)  # fmt: skip
    rows = torch.zeros(_T, 2, dtype=i64)
    for x in _F:
        s = _sz(x)
        for w in (False, True):
            tag = " weights" if w else ""
            yield Case("moe", f"moe_permute {_TL[x]}{tag} k=2", "moe_permute",
                       lambda impl, x=x, w=w: impl(_e(_T, _H, dtype=x), rows, torch.zeros(n, dtype=i64),
                                                   _e(_T, 2) if w else None, _e(n, _H, dtype=x)),
                       _T * _H * s + n * _H * s + n * 8, n * _H)  # fmt: skip
            yield Case("moe", f"moe_unpermute {_TL[x]}{tag} k=2", "moe_unpermute",
                       lambda impl, x=x, w=w: impl(_e(n, _H, dtype=x), rows, _e(_T, 2) if w else None,
                                                   _e(_T, _H, dtype=x)),
                       n * _H * s + _T * _H * s + n * 8, n * _H)  # fmt: skip
        yield Case("moe", f"moe_permute {_TL[x]} padded", "moe_permute",
                   lambda impl, x=x: impl(_e(_T, _H, dtype=x), rows, torch.zeros(64 * 160, dtype=i64), None,
                                          _e(64 * 160, _H, dtype=x), True),
                   2 * 64 * 160 * _H * s + 64 * 160 * 8, 64 * 160 * _H)  # fmt: skip
        yield Case("moe", f"moe_unpermute.backward {_TL[x]} k=2", "moe_unpermute.backward",
                   lambda impl, x=x: impl(_e(_T, _H, dtype=x), _e(n, _H, dtype=x), rows, _e(_T, 2),
                                          _e(n, _H, dtype=x)),
                   _T * _H * s + 2 * n * _H * s + n * 12, n * _H)  # fmt: skip


def _rowquant() -> Iterator[Case]:
    # the expert-parallel dispatch of 8192 tokens of H = 1024, k = 2: 16384 rows gathered and packed (fp8 or int8,
    # 128-channel tiles: 1056-byte rows), and decoded on arrival to bf16 (regrouped by an index, or in order)
    T, H, n, block = 8192, 1024, 16384, 128
    rb = H + 4 * (H // block)
    for x in (torch.float32, torch.bfloat16):
        for fmt in ("e4m3", "int8"):
            yield Case("rowquant", f"quantize_rows {_TL[x]} {fmt} index", "quantize_rows",
                       lambda impl, x=x, fmt=fmt: impl(_e(T, H, dtype=x), torch.zeros(n, dtype=torch.int64),
                                                      _e(n, rb, dtype=torch.uint8), fmt, block),
                       n * H * _sz(x) + n * rb + 8 * n, n * H)  # fmt: skip
    for fmt in ("e4m3", "e5m2", "int8"):
        for idx in (False, True):
            yield Case("rowquant", f"dequantize_rows {fmt}->bf16{' index' if idx else ''}", "dequantize_rows",
                       lambda impl, fmt=fmt, idx=idx: impl(_e(n, rb, dtype=torch.uint8),
                                                          torch.zeros(n, dtype=torch.int64) if idx else None,
                                                          _e(n, H, dtype=torch.bfloat16), fmt, block),
                       n * rb + n * H * 2 + (8 * n if idx else 0), n * H)  # fmt: skip


_BUILDERS = {"bucket": _bucket, "quantize": _quantize, "sign": _sign, "error_feedback": _error_feedback,
             "topk": _topk, "orthogonalize": _orthogonalize, "moe": _moe, "rowquant": _rowquant}  # fmt: skip


def cases(families: tuple[str, ...] | None = None) -> list[Case]:
    """Every case of ``families`` (default: all of :data:`FAMILIES`), in a stable order."""
    return [c for f in (families or FAMILIES) for c in _BUILDERS[f]()]
