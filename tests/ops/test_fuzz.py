"""Property-based fuzz of every public op on every provider (issue 24).

For each op, hypothesis draws a call: sizes (small and odd), dtypes, layouts (contiguous, strided, expanded,
zero-size), flags, and, for about a third of the draws, one bad argument from the op's list (a wrong Python
type, dtype, size or device, a NaN where it is refused, an ``out=`` buffer overlapping an input, a hand-made
``Routing`` or ``Packed`` that lies). The property:

- a bad argument raises a ``TorshKernelsError`` subclass, and every tensor the caller passed (outputs
  included) is byte for byte what it was (nothing touched before the refusal);
- a good call returns what the torch reference computes (within the dtype's tolerance), and the tensors the
  op does not document writing are unchanged;
- nothing else: any other exception, a crash, or a result that differs fails the test.

Budget: ``derandomize=True`` (the same draws on every run, so CI is reproducible), a few examples per op and
provider (the interpreters are slow), the whole file well under a minute. ``TORSH_FUZZ_EXAMPLES=N`` sets the
examples per op and provider for a long local run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torsh_kernels as tk
from tests.helpers import DEVICE, GPU, PROVIDERS
from torsh_kernels import ops
from torsh_kernels.errors import NonFiniteError, TorshKernelsError
from torsh_kernels.ops import moe as M

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FLOATS = (F32, F16, BF16)
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2, F64: 1e-9}
_ENV = os.environ.get("TORSH_FUZZ_EXAMPLES")
SIZES = (1, 3, 7, 13, 37, 130)


def examples(provider: str) -> int:
    if _ENV:
        return int(_ENV)
    return 12 if provider in ("triton", "numba") else 20


def dev(provider: str) -> torch.device:
    return torch.device("cpu") if provider == "cpu" else DEVICE


@dataclass
class Call:
    """One drawn call: ``run()`` performs it; ``verify(result)`` says whether a result is right."""

    run: Callable[[], object]
    verify: Callable[[object], bool]
    tensors: dict[str, object]
    writes: tuple[str, ...] = ()
    bad: str | None = None  # the bad argument drawn (None: a good call, which must succeed)
    late: bool = False  # the op documents writing outputs before this refusal (NaN found in its result)
    notes: list[str] = field(default_factory=list)


def _all_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _all_tensors(o)]
    if isinstance(obj, (tk.Routing, ops.Packed)):
        return [v for v in (getattr(obj, f.name) for f in dataclasses.fields(obj)) if isinstance(v, torch.Tensor)]
    return []


def _storage(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def check(c: Call) -> None:
    snaps = {k: [(t, _storage(t)) for t in _all_tensors(v) if not t.is_meta] for k, v in c.tensors.items()}
    try:
        res = c.run()
    except TorshKernelsError as e:
        if c.bad is None and not isinstance(e, NonFiniteError):
            raise AssertionError(f"a good call was refused: {type(e).__name__}: {e}") from e
        if c.bad is None:  # NaN/Inf a good draw can make (an fp16 overflow): refused, typed
            return
        touched = [k for k, ts in snaps.items() if any(not torch.equal(_storage(t), s) for t, s in ts)]
        assert c.late or not touched, f"{c.bad}: refused after writing {touched}"
        return
    assert c.bad is None, f"bad argument {c.bad!r} was accepted (returned {type(res).__name__})"
    changed = [
        k for k, ts in snaps.items() if k not in c.writes and any(not torch.equal(_storage(t), s) for t, s in ts)
    ]
    assert not changed, f"the op changed {changed}, which it does not write"
    assert c.verify(res), "the result differs from the torch reference"


def close(a, b, dtype=F32, scale: float = 1.0) -> bool:
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    if a.is_meta or b.is_meta:
        return a.shape == b.shape
    tol = TOL[dtype] * scale
    return a.shape == b.shape and torch.allclose(a.double().cpu(), b.double().cpu(), atol=tol, rtol=tol, equal_nan=True)


# --------------------------------------------------------------------------------------------------
# Drawing inputs


def tensor(data, shape, dtype, provider, *, layout: str | None = None, scale: float = 1.0) -> torch.Tensor:
    """A random tensor of ``shape`` in a drawn layout: contiguous, strided (every other element of a
    bigger one), transposed (2-D), or expanded (one row repeated)."""
    seed = data.draw(st.integers(0, 2**16), label="seed")
    layout = layout or data.draw(st.sampled_from(("contiguous", "contiguous", "strided", "transposed", "expanded")))
    g = torch.Generator().manual_seed(seed)
    d = dev(provider)
    if layout == "strided" and len(shape) >= 1:
        big = torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * scale
        return big.to(dtype).to(d)[..., ::2]
    if layout == "transposed" and len(shape) == 2:
        return (torch.randn(shape[1], shape[0], generator=g) * scale).to(dtype).to(d).t()
    if layout == "expanded" and len(shape) >= 1 and shape[0] > 0:
        return (torch.randn(1, *shape[1:], generator=g) * scale).to(dtype).to(d).expand(*shape)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(d)


def contiguous(data, shape, dtype, provider, scale=1.0) -> torch.Tensor:
    return tensor(data, shape, dtype, provider, layout="contiguous", scale=scale)


def maybe_bad(data, table: dict[str, Callable[[], object]]) -> tuple[str | None, object]:
    """With probability ~1/3, one entry of ``table`` (name -> a maker of the bad value)."""
    if not table or data.draw(st.integers(0, 2), label="bad?") != 0:
        return None, None
    name = data.draw(st.sampled_from(sorted(table)), label="bad")
    return name, table[name]()


NOT_TENSORS = {"none": None, "str": "x", "list": [1.0, 2.0], "float": 2.5}


def _nt(name):
    return lambda: NOT_TENSORS[name]


# --------------------------------------------------------------------------------------------------
# One drawer per op: (data, provider) -> Call


def draw_flatten(data, p):
    n = data.draw(st.integers(1, 3))
    dts = [data.draw(st.sampled_from((*FLOATS, F64))) for _ in range(n)]
    ts = [tensor(data, (data.draw(st.sampled_from(SIZES)),), dt, p) for dt in dts]
    dtype = data.draw(st.sampled_from((None, F32, BF16)))
    scale = data.draw(st.sampled_from((1.0, 0.5, -3.0)))
    kw = {"tensors": ts, "dtype": dtype, "scale": scale}
    total = sum(t.numel() for t in ts)
    bad, val = maybe_bad(
        data,
        {"tensors_" + k: _nt(k) for k in NOT_TENSORS}
        | {
            "int_tensor": lambda: [*ts, torch.ones(3, dtype=torch.int32, device=dev(p))],
            "meta_tensor": lambda: [*ts, torch.empty(3, device="meta")],
            "empty_list": lambda: [],
            "scale_nan": lambda: math.nan,
            "out_short": lambda: torch.empty(total + 1, device=dev(p)),
            "out_overlaps": lambda: (
                ts[0].detach() if ts[0].is_contiguous() and ts[0].dtype == F32 and total == ts[0].numel() else None
            ),
        },
    )
    if bad is not None and val is None and bad == "out_overlaps":
        bad = None
    if bad is not None:
        key = (
            "tensors"
            if bad.startswith(("tensors", "int", "meta", "empty"))
            else "scale"
            if bad == "scale_nan"
            else "out"
        )
        kw[key] = val
        if key == "out":
            kw["dtype"] = None

    def verify(res):
        flat, layout = res
        dt = dtype or functools.reduce(torch.promote_types, dts)
        cd = F64 if F64 in (*dts, dt) else F32
        want = torch.cat([t.reshape(-1).to(cd) * scale for t in ts]).to(dt)
        return layout.total == total and close(flat, want, dt)

    return Call(lambda: tk.flatten(**kw, provider=p), verify, {"tensors": ts, "out": kw.get("out")}, bad=bad)


def draw_unflatten(data, p):
    shapes = [(data.draw(st.sampled_from(SIZES)),) for _ in range(data.draw(st.integers(1, 3)))]
    dt = data.draw(st.sampled_from(FLOATS))
    src = [contiguous(data, s, dt, p) for s in shapes]
    flat, layout = tk.flatten(src, provider="torch")
    dsts = [
        tensor(
            data, s, data.draw(st.sampled_from(FLOATS)), p, layout=data.draw(st.sampled_from(("contiguous", "strided")))
        )
        for s in shapes
    ]
    acc = data.draw(st.booleans())
    kw = {"flat": flat, "layout": layout, "tensors": dsts, "accumulate": acc}
    bad, val = maybe_bad(
        data,
        {"flat_" + k: _nt(k) for k in ("none", "str")}
        | {
            "layout_none": lambda: None,
            "wrong_layout": lambda: tk.flatten([torch.ones(flat.numel() + 1)], provider="torch")[1],
            "expanded_dst": lambda: [torch.zeros(1, device=dev(p)).expand(max(2, shapes[0][0])), *dsts[1:]],
            "same_dst_twice": lambda: [dsts[0]] * len(dsts) if len(dsts) > 1 and dsts[0].is_contiguous() else None,
            "int_dst": lambda: [torch.zeros(shapes[0], dtype=torch.int32, device=dev(p)), *dsts[1:]],
            "scale_inf": lambda: math.inf,
        },
    )
    if bad == "same_dst_twice" and val is None:
        bad = None
    if bad is not None:
        key = {"layout_none": "layout", "wrong_layout": "layout", "scale_inf": "scale"}.get(
            bad, "flat" if bad.startswith("flat") else "tensors"
        )
        kw[key] = val
    before = [d.clone() for d in dsts]

    def verify(res):
        return res is None and all(
            close(d, ((b.float() if acc else 0) + f.float()).to(d.dtype), d.dtype, 2)
            for d, b, f in zip(dsts, before, layout.views(flat))
        )

    return Call(
        lambda: tk.unflatten(**kw, provider=p),
        verify,
        {"flat": flat, "tensors": kw["tensors"] if isinstance(kw["tensors"], list) else dsts},
        writes=("tensors",),
        bad=bad,
    )


def draw_bucket_reduce(data, p):
    n = data.draw(st.sampled_from(SIZES))
    dt = data.draw(st.sampled_from((*FLOATS, F64)))
    k = data.draw(st.integers(1, 3))
    bufs = [tensor(data, (n,), dt, p) for _ in range(k)]
    op = data.draw(st.sampled_from(("sum", "avg", "max")))
    kw = {"buffers": bufs, "op": op}
    bad, val = maybe_bad(
        data,
        {
            "op_bogus": lambda: "mean",
            "shapes_differ": lambda: [*bufs, torch.ones(n + 1, dtype=dt, device=dev(p))],
            "dtypes_differ": lambda: [*bufs, torch.ones(n, dtype=F64 if dt != F64 else F32, device=dev(p))],
            "int_buffers": lambda: [b.to(torch.int32) for b in bufs],
            "out_wrong_shape": lambda: torch.empty(n + 1, device=dev(p)),
            "out_strided": lambda: (
                torch.empty(2 * n, device=dev(p))[::2] if n > 1 else torch.empty(n, 2, device=dev(p)).t()
            ),
            "buffers_none": lambda: None,
        },
    )
    if bad is not None:
        kw[{"op_bogus": "op", "out_wrong_shape": "out", "out_strided": "out"}.get(bad, "buffers")] = val
    return Call(
        lambda: tk.bucket_reduce(**kw, provider=p),
        lambda r: close(r, ops.bucket_reduce_ref(bufs, op, r.dtype), dt),
        {"buffers": bufs, "out": kw.get("out")},
        bad=bad,
    )


def draw_wire_cast(data, p):
    n = data.draw(st.sampled_from(SIZES))
    x = tensor(data, (n,), data.draw(st.sampled_from(FLOATS)), p)
    dtype = data.draw(st.sampled_from((F16, BF16, F32)))
    divisor = data.draw(st.sampled_from((1, 2.0, -3.0, 1e-3)))
    kw = {"x": x, "dtype": dtype, "divisor": divisor}
    late = False
    bad, val = maybe_bad(
        data,
        {"x_" + k: _nt(k) for k in NOT_TENSORS}
        | {
            "x_int": lambda: x.to(torch.int32),
            "x_fp64": lambda: x.to(F64),
            "divisor_zero": lambda: 0.0,
            "divisor_nan": lambda: math.nan,
            "dtype_int": lambda: torch.int16,
            "out_short": lambda: torch.empty(n + 1, dtype=dtype, device=dev(p)),
            "x_nan": lambda: torch.full((n,), math.nan, device=dev(p)),
        },
    )
    if bad is not None:
        kw[
            {"divisor_zero": "divisor", "divisor_nan": "divisor", "dtype_int": "dtype", "out_short": "out"}.get(
                bad, "x"
            )
        ] = val
        late = bad == "x_nan"
    return Call(
        lambda: tk.wire_cast(**kw, provider=p),
        lambda r: close(r, ops.wire_cast_ref(x, dtype, divisor), dtype, 2),
        {"x": kw["x"]},
        bad=bad,
        late=late,
    )


def draw_quantize(data, p):
    n = data.draw(st.sampled_from(SIZES))
    x = tensor(data, (n,), data.draw(st.sampled_from(FLOATS)), p)
    bits = data.draw(st.sampled_from((8, 4)))
    block = data.draw(st.sampled_from((2, 8, 256)))
    stoch = data.draw(st.booleans())
    seed = data.draw(st.integers(-(2**70), 2**70)) if stoch else None
    kw = {"x": x, "bits": bits, "block": block, "stochastic": stoch, "seed": seed}
    bad, val = maybe_bad(
        data,
        {"x_" + k: _nt(k) for k in NOT_TENSORS}
        | {
            "x_complex": lambda: x.to(torch.complex64),
            "bits_3": lambda: 3,
            "bits_bool": lambda: True,
            "block_6": lambda: 6,
            "block_huge": lambda: 2**20,
            "block_float": lambda: 8.0,
            "x_nan": lambda: torch.full((n,), math.nan, device=dev(p)),
            "out_wrong": lambda: (torch.empty(n, device=dev(p)), torch.empty(1, device=dev(p))),  # (fp32 codes)
        },
    )
    if bad is not None:
        key = bad.split("_")[0] if bad.split("_")[0] in ("bits", "block", "out") else "x"
        kw[key] = val

    def verify(r):
        q, s = r
        rq, rs = ops.quantize_ref(x.reshape(-1), bits=bits, block=block, stochastic=stoch, seed=seed)
        return torch.equal(q.cpu(), rq.cpu()) and close(s, rs)

    return Call(lambda: tk.quantize(**kw, provider=p), verify, {"x": kw["x"], "out": kw.get("out")}, bad=bad)


def draw_dequantize(data, p):
    n = data.draw(st.sampled_from(SIZES))
    bits, block = data.draw(st.sampled_from((8, 4))), data.draw(st.sampled_from((2, 8, 256)))
    q, s = ops.quantize_ref(contiguous(data, (n,), F32, p), bits=bits, block=block)
    alpha = data.draw(st.sampled_from((1.0, -0.5)))
    acc = data.draw(st.booleans())
    out = contiguous(data, (n,), F32, p) if acc else None
    kw = {"q": q, "scales": s, "block": block, "numel": n, "alpha": alpha, "accumulate": acc, "out": out}
    bad, val = maybe_bad(
        data,
        {
            "q_float": lambda: q.float(),
            "q_none": lambda: None,
            "scales_short": lambda: s[:-1] if s.numel() > 1 else s[:0],
            "numel_more": lambda: n + 2,
            "numel_negative": lambda: -1,
            "alpha_nan": lambda: math.nan,
            "block_wrong": lambda: block * 4 if n > block else 2 if block != 2 else 4,
            "accumulate_without_out": lambda: None,
        },
    )
    if bad == "block_wrong" and -(-n // val) == s.numel():
        bad = None
    if bad is not None:
        key = {
            "q_float": "q",
            "q_none": "q",
            "scales_short": "scales",
            "numel_more": "numel",
            "numel_negative": "numel",
            "alpha_nan": "alpha",
            "block_wrong": "block",
        }.get(bad)
        if bad == "accumulate_without_out":
            kw.update(accumulate=True, out=None)
        else:
            kw[key] = val
    before = out.clone() if out is not None else None

    def verify(r):
        want = ops.dequantize_ref(q, s, block=block, numel=n) * alpha
        return close(r, want + (before if acc else 0))

    return Call(
        lambda: tk.dequantize(**kw, provider=p),
        verify,
        {"q": q, "scales": s, "out": kw.get("out")},
        writes=("out",),
        bad=bad,
    )


def draw_topk_compress(data, p):
    n = data.draw(st.sampled_from(SIZES))
    dt = data.draw(st.sampled_from(FLOATS))
    x = tensor(data, (n,), dt, p)
    ratio = data.draw(st.sampled_from((1e-9, 0.1, 0.5, 1.0)))
    r = contiguous(data, (n,), data.draw(st.sampled_from(FLOATS)), p) if data.draw(st.booleans()) else None
    kw = {"x": x, "ratio": ratio, "residual": r, "exact": data.draw(st.booleans())}
    bad, val = maybe_bad(
        data,
        {"x_" + k: _nt(k) for k in NOT_TENSORS}
        | {
            "x_empty": lambda: torch.empty(0, device=dev(p)),
            "ratio_zero": lambda: 0.0,
            "ratio_nan": lambda: math.nan,
            "ratio_two": lambda: 2.0,
            "ratio_str": lambda: "0.1",
            "residual_short": lambda: torch.zeros(n + 1, device=dev(p)),
            "residual_is_x": lambda: (
                x if x.is_contiguous() and x.dtype in FLOATS else torch.zeros(n, dtype=torch.int32, device=dev(p))
            ),
            "x_nan": lambda: torch.full((n,), math.nan, device=dev(p)),
        },
    )
    if bad is not None:
        kw["ratio" if bad.startswith("ratio") else "residual" if bad.startswith("residual") else "x"] = val
    before = r.clone() if r is not None else None

    def verify(res):
        vals, idx = res
        acc = x.reshape(-1).float() + (before.float() if before is not None else 0)
        k = ops.topk_count(n, ratio)
        ok = vals.numel() == idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
        ok = ok and close(vals, acc[idx.long()].to(dt), dt)
        top = torch.topk(acc.abs(), k).values.sort().values
        ok = ok and close(acc[idx.long()].abs().sort().values, top)
        if before is not None:
            left = acc.clone()
            left[idx.long()] -= vals.float()
            ok = ok and close(r, left.to(r.dtype), r.dtype, 2)
        return ok

    return Call(
        lambda: tk.topk_compress(**kw, provider=p),
        verify,
        {"x": kw["x"], "residual": kw["residual"]},
        writes=("residual",),
        bad=bad,
    )


def draw_topk_decompress(data, p):
    numel = data.draw(st.sampled_from(SIZES))
    k = data.draw(st.integers(0, 2 * numel))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    idx = (
        torch.randint(0, numel, (k,), generator=g).to(data.draw(st.sampled_from((torch.int32, torch.int64)))).to(dev(p))
    )
    vals = tensor(data, (k,), data.draw(st.sampled_from(FLOATS)), p) if k else torch.empty(0, device=dev(p))
    acc = data.draw(st.booleans()) or k > numel  # (without accumulate, a repeated index keeps either value)
    acc = acc and bool(k)
    out = contiguous(data, (numel,), F32, p) if acc else None
    alpha = data.draw(st.sampled_from((1.0, 2, -0.5)))
    kw = {"values": vals, "indices": idx, "numel": numel, "out": out, "accumulate": acc, "alpha": alpha}
    if not acc and k and len(set(idx.tolist())) != k:
        kw["indices"] = idx = torch.randperm(numel, generator=g)[: min(k, numel)].to(idx.dtype).to(dev(p))
        kw["values"] = vals = vals[: idx.numel()]
    bad, val = maybe_bad(
        data,
        {
            "index_numel": lambda: torch.tensor([numel], device=dev(p)),
            "index_negative": lambda: torch.tensor([-1], device=dev(p)),
            "numel_huge": lambda: 10**13,
            "numel_bool": lambda: True,
            "indices_float": lambda: idx.float(),
            "alpha_inf": lambda: math.inf,
            "accumulate_without_out": lambda: None,
        },
    )
    if bad is not None:
        if bad.startswith("index"):
            kw["indices"], kw["values"] = val, torch.ones(1, device=dev(p))
        elif bad == "accumulate_without_out":
            kw.update(accumulate=True, out=None)
        else:
            kw[
                {"numel_huge": "numel", "numel_bool": "numel", "indices_float": "indices", "alpha_inf": "alpha"}[bad]
            ] = val
    before = out.clone() if out is not None else None

    def verify(r):
        return close(
            r,
            ops.topk_decompress_ref(
                vals, idx, numel, out=before.clone() if before is not None else None, accumulate=acc, alpha=alpha
            ),
            r.dtype,
            4,
        )

    return Call(
        lambda: tk.topk_decompress(**kw, provider=p),
        verify,
        {"values": kw["values"], "indices": kw["indices"], "out": kw.get("out")},
        writes=("out",),
        bad=bad,
    )


def draw_sign_compress(data, p):
    n = data.draw(st.sampled_from((0, *SIZES)))
    x = tensor(data, (n,), data.draw(st.sampled_from(FLOATS)), p) if n else torch.empty(0, device=dev(p))
    r = contiguous(data, (n,), F32, p) if n and data.draw(st.booleans()) else None
    kw = {"x": x, "residual": r}
    bad, val = maybe_bad(
        data,
        {"x_" + k: _nt(k) for k in NOT_TENSORS}
        | {
            "x_int": lambda: torch.ones(max(n, 1), dtype=torch.int64, device=dev(p)),
            "residual_short": lambda: torch.zeros(n + 1, device=dev(p)),
            "residual_expanded": lambda: (
                torch.zeros(1, device=dev(p)).expand(max(n, 2)) if n >= 2 else torch.zeros(n + 3, device=dev(p))
            ),
            "x_nan": lambda: torch.full((max(n, 1),), math.nan, device=dev(p)),
        },
    )
    if bad is not None:
        kw["residual" if bad.startswith("residual") else "x"] = val
    before = r.clone() if r is not None else None

    def verify(res):
        bits, scale = res
        if n == 0:
            return bits.numel() == 0 and float(scale) == 0.0
        rb, rs = ops.sign_compress_ref(x, residual=before.clone() if before is not None else None)
        ok = torch.equal(bits.cpu(), rb.cpu()) and close(scale, rs)
        if before is not None:
            v = x.reshape(-1).float() + before
            ok = ok and close(r, v - torch.where(v >= 0, 1.0, -1.0) * rs.float(), F32, 10)
        return ok

    return Call(
        lambda: tk.sign_compress(**kw, provider=p),
        verify,
        {"x": kw["x"], "residual": kw["residual"]},
        writes=("residual",),
        bad=bad,
    )


def draw_sign_decompress(data, p):
    numel = data.draw(st.sampled_from(SIZES))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    bits = torch.randint(0, 256, (-(-numel // 8),), generator=g, dtype=torch.uint8).to(dev(p))
    scale = data.draw(st.sampled_from((0.5, torch.tensor(1.5, device=dev(p)), torch.tensor([2.0], device=dev(p)))))
    acc = data.draw(st.booleans())
    out = contiguous(data, (numel,), data.draw(st.sampled_from(FLOATS)), p) if acc else None
    kw = {
        "bits": bits,
        "scale": scale,
        "numel": numel,
        "out": out,
        "accumulate": acc,
        "dtype": F32 if out is None else out.dtype,
    }
    bad, val = maybe_bad(
        data,
        {
            "bits_int8": lambda: bits.to(torch.int8),
            "bits_none": lambda: None,
            "numel_more": lambda: numel + 8,
            "numel_negative": lambda: -3,
            "scale_two": lambda: torch.ones(2, device=dev(p)),
            "scale_str": lambda: "1",
            "alpha_nan": lambda: math.nan,
        },
    )
    if bad is not None:
        kw[bad.split("_")[0]] = val
    before = out.clone() if out is not None else None
    s = torch.as_tensor(scale).reshape(()).float().cpu()

    def verify(r):
        want = ops.sign_decompress_ref(bits.cpu(), s, numel)
        return close(r, want + (before.float().cpu() if acc else 0), r.dtype, 2)

    return Call(
        lambda: tk.sign_decompress(**kw, provider=p),
        verify,
        {"bits": bits, "out": kw.get("out")},
        writes=("out",),
        bad=bad,
    )


def draw_orthogonalize(data, p):
    r = data.draw(st.integers(1, 4))
    m = data.draw(st.sampled_from((r, r + 2, 13, 37)))
    dt = data.draw(st.sampled_from((F32, F64)))
    form = data.draw(st.sampled_from(("matrix", "batch", "list")))
    mats = (
        contiguous(data, (m, r), dt, p)
        if form == "matrix"
        else contiguous(data, (2, m, r), dt, p)
        if form == "batch"
        else [contiguous(data, (m, r), dt, p), contiguous(data, (m + 1, r), dt, p)]
    )
    iters = data.draw(st.integers(1, 3))
    kw = {"matrices": mats, "iters": iters}
    bad, val = maybe_bad(
        data,
        {"matrices_" + k: _nt(k) for k in ("none", "str", "float")}
        | {
            "matrix_1d": lambda: torch.ones(m, device=dev(p)),
            "matrix_int": lambda: torch.ones(m, r, dtype=torch.int32, device=dev(p)),
            "noncontiguous": lambda: torch.ones(2 * (m + 1), r, device=dev(p))[::2],
            "iters_zero": lambda: 0,
            "iters_huge": lambda: 10**9,
            "iters_float": lambda: 2.0,
            "rtol_one": lambda: 1.0,
            "rtol_nan": lambda: math.nan,
            "nan_element": lambda: torch.full((m, r), math.nan, device=dev(p)),
        },
    )
    if bad is not None:
        kw[bad.split("_")[0] if bad.startswith(("iters", "rtol")) else "matrices"] = val
    before = [t.clone() for t in (mats if isinstance(mats, list) else [mats])]

    def verify(res):
        got = res if isinstance(res, list) else [res]
        return all(close(g, ops.orthogonalize_ref(b.clone()), F32, 50) for g, b in zip(got, before))

    return Call(
        lambda: tk.orthogonalize(**kw, provider=p), verify, {"matrices": kw["matrices"]}, writes=("matrices",), bad=bad
    )


def draw_residual_add(data, p):
    n = data.draw(st.sampled_from(SIZES))
    x = tensor(data, (n,), data.draw(st.sampled_from(FLOATS)), p)
    r = contiguous(data, (n,), data.draw(st.sampled_from(FLOATS)), p)
    where = data.draw(st.sampled_from(("new", "residual", "x", "other")))
    out = {
        "new": None,
        "residual": r,
        "x": x if x.is_contiguous() else None,
        "other": torch.empty(n, dtype=data.draw(st.sampled_from(FLOATS)), device=dev(p)),
    }[where]
    kw = {"x": x, "residual": r, "out": out}
    bad, val = maybe_bad(
        data,
        {"x_" + k: _nt(k) for k in ("none", "list")}
        | {
            "residual_short": lambda: torch.zeros(n + 1, device=dev(p)),
            "residual_int": lambda: torch.zeros(n, dtype=torch.int32, device=dev(p)),
            "out_strided": lambda: torch.zeros(2 * n, device=dev(p))[::2] if n > 1 else None,
            "out_meta": lambda: torch.empty(n, device="meta"),
        },
    )
    if bad == "out_strided" and n <= 1:
        bad = None
    if bad is not None:
        kw["residual" if bad.startswith("residual") else "out" if bad.startswith("out") else "x"] = val
    xb, rb = x.clone(), r.clone()

    def verify(res):
        want = xb.float() + rb.float()
        return close(res, want.to(res.dtype), res.dtype, 2)

    writes = ("out", "residual") if where == "residual" else ("out", "x") if where == "x" else ("out",)
    return Call(
        lambda: tk.residual_add(**kw, provider=p),
        verify,
        {"x": kw["x"], "residual": kw["residual"], "out": kw["out"]},
        writes=writes,
        bad=bad,
    )


def draw_error_update(data, p):
    n = data.draw(st.sampled_from(SIZES))
    acc = contiguous(data, (n,), data.draw(st.sampled_from(FLOATS)), p)
    approx = tensor(data, (n,), data.draw(st.sampled_from(FLOATS)), p)
    same = data.draw(st.booleans()) and acc.dtype == F32
    r = acc if same else torch.empty(n, dtype=data.draw(st.sampled_from(FLOATS)), device=dev(p))
    out = torch.empty(n, dtype=data.draw(st.sampled_from(FLOATS)), device=dev(p)) if data.draw(st.booleans()) else None
    kw = {"acc": acc, "approx": approx, "residual": r, "out": out}
    bad, val = maybe_bad(
        data,
        {
            "approx_short": lambda: torch.zeros(n + 1, device=dev(p)),
            "residual_is_approx": lambda: approx if approx.is_contiguous() else torch.zeros(n + 2, device=dev(p)),
            "out_is_residual": lambda: r,
            "acc_int": lambda: torch.ones(n, dtype=torch.int32, device=dev(p)),
            "residual_none": lambda: None,
        },
    )
    if bad is not None:
        kw[
            {
                "approx_short": "approx",
                "residual_is_approx": "residual",
                "out_is_residual": "out",
                "acc_int": "acc",
                "residual_none": "residual",
            }[bad]
        ] = val
    ab, pb = acc.clone(), approx.clone()

    def verify(res):
        ok = res is None and close(r, (ab.float() - pb.float()).to(r.dtype), r.dtype, 2)
        return ok and (out is None or close(out, pb.to(out.dtype), out.dtype))

    return Call(
        lambda: tk.error_update(**kw, provider=p),
        verify,
        {"acc": kw["acc"], "approx": kw["approx"], "residual": kw["residual"], "out": kw["out"]},
        writes=("residual", "out") + (("acc",) if same else ()),
        bad=bad,
    )


def draw_pack(data, p):
    n = data.draw(st.sampled_from((0, *SIZES)))
    x = tensor(data, (n,), data.draw(st.sampled_from(FLOATS)), p) if n else torch.empty(0, device=dev(p))
    fmt = data.draw(st.sampled_from(ops.FORMATS))
    block = data.draw(st.sampled_from((2, 8, 256)))
    into = data.draw(st.booleans())
    out = torch.zeros(ops.packed_nbytes(n, fmt, block) + 8, dtype=torch.uint8, device=dev(p)) if into else None
    kw = {"x": x, "fmt": fmt, "block": block, "out": out}
    bad, val = maybe_bad(
        data,
        {
            "fmt_bogus": lambda: "int4",
            "block_3": lambda: 3,
            "block_str": lambda: "8",
            "out_small": lambda: (
                torch.zeros(1, dtype=torch.uint8, device=dev(p))
                if n
                else torch.zeros(0, dtype=torch.uint8, device=dev(p))
            ),
            "out_over_x": lambda: x.view(torch.uint8) if n >= 4 and x.is_contiguous() and x.dtype == F32 else None,
            "x_int": lambda: torch.ones(3, dtype=torch.int64, device=dev(p)),
        },
    )
    if (bad in ("out_over_x", "out_small") and val is None) or (bad == "out_small" and n == 0):
        bad = None
    if bad is not None:
        kw[bad.split("_")[0]] = val
    xb = x.clone()
    return Call(
        lambda: ops.unpack(ops.pack(**kw, provider=p), provider=p),
        lambda r: close(r, ops.unpack_ref(ops.pack_ref(xb, fmt, block=block)), xb.dtype),
        {"x": kw["x"], "out": kw["out"]},
        writes=("out",),
        bad=bad,
    )


def draw_unpack(data, p):
    n = data.draw(st.sampled_from(SIZES))
    fmt = data.draw(st.sampled_from(ops.FORMATS))
    pk = ops.pack_ref(contiguous(data, (n,), F32, p), fmt, block=8)
    acc = data.draw(st.booleans())
    out = contiguous(data, (n,), data.draw(st.sampled_from(FLOATS)), p) if acc else None
    kw = {"packed": pk, "out": out, "accumulate": acc}
    bad, val = maybe_bad(
        data,
        {
            "packed_none": lambda: None,
            "data_short": lambda: dataclasses.replace(pk, data=pk.data[:-1]),
            "shape_bigger": lambda: dataclasses.replace(pk, shape=(n * 1000,)),
            "shape_negative": lambda: dataclasses.replace(pk, shape=(-n,)),
            "block_odd": lambda: dataclasses.replace(pk, block=7),
            "device_bogus": lambda: "gpu9",
            "out_wrong_shape": lambda: torch.zeros(n + 1, device=dev(p)),
        },
    )
    if bad is not None:
        kw["device" if bad == "device_bogus" else "out" if bad.startswith("out") else "packed"] = val
    before = out.clone() if out is not None else None

    def verify(r):
        want = ops.unpack_ref(pk).float() + (before.float() if acc else 0)
        return close(r, want.to(r.dtype), r.dtype, 2)

    return Call(
        lambda: ops.unpack(**kw, provider=p), verify, {"packed": pk, "out": kw.get("out")}, writes=("out",), bad=bad
    )


def draw_moe_route(data, p):
    T, E = data.draw(st.sampled_from((0, 1, 7, 13))), data.draw(st.integers(1, 9))
    k = data.draw(st.integers(1, E))
    lg = (
        tensor(data, (T, E), data.draw(st.sampled_from(FLOATS)), p, scale=2.0)
        if T
        else torch.empty(0, E, device=dev(p))
    )
    cf = data.draw(st.sampled_from((None, 0.5, 1.0, 1e300)))
    kw = {
        "logits": lg,
        "k": k,
        "score": data.draw(st.sampled_from(M.SCORES)),
        "capacity_factor": cf,
        "drop_policy": data.draw(st.sampled_from(M.DROP_POLICIES)),
        "renormalize": data.draw(st.booleans()),
    }
    bad, val = maybe_bad(
        data,
        {"logits_" + k: _nt(k) for k in NOT_TENSORS}
        | {
            "logits_1d": lambda: torch.randn(E, device=dev(p)),
            "logits_int": lambda: torch.ones(max(T, 1), E, dtype=torch.int64, device=dev(p)),
            "k_zero": lambda: 0,
            "k_above": lambda: E + 1,
            "k_float": lambda: 1.0,
            "capacity_inf": lambda: math.inf,
            "capacity_nan": lambda: math.nan,
            "capacity_negative": lambda: -1.0,
            "score_bogus": lambda: "relu",
            "logits_nan": lambda: torch.full((max(T, 1), E), math.nan, device=dev(p)),
        },
    )
    if bad is not None:
        key = bad.split("_")[0]
        kw["capacity_factor" if key == "capacity" else key] = val

    def verify(r):
        ref = M.moe_route_ref(lg, **{a: kw[a] for a in ("k", "score", "capacity_factor", "drop_policy", "renormalize")})
        return (
            torch.equal(r.indices.cpu(), ref.indices.cpu())
            and torch.equal(r.row_map.cpu(), ref.row_map.cpu())
            and torch.equal(r.token_index.cpu(), ref.token_index.cpu())
            and r.num_rows == ref.num_rows
            and close(r.weights, ref.weights, F32, 5)
        )

    opts = ("k", "score", "capacity_factor", "drop_policy", "renormalize")
    if bad is None and data.draw(st.booleans()):  # the same options as one RouterSpec
        spec = M.RouterSpec(**{a: kw[a] for a in opts})
        return Call(lambda: tk.moe_route(lg, spec, provider=p), verify, {"logits": lg}, bad=bad)
    return Call(lambda: tk.moe_route(**kw, provider=p), verify, {"logits": kw["logits"]}, bad=bad)


def _lying(data, r: tk.Routing, p) -> tuple[str | None, tk.Routing]:
    """A routing that lies, about a third of the time (as the drawers' bad arguments)."""
    T, K = r.indices.shape

    def edit(f, i, v):
        t = getattr(r, f).clone()
        t.view(-1)[i % max(t.numel(), 1)] = v
        return dataclasses.replace(r, **{f: t})

    table = {
        "row_map_high": lambda: edit(
            "row_map", data.draw(st.integers(0, 99)), r.num_rows + data.draw(st.integers(0, 10**6))
        ),
        "row_map_below": lambda: edit("row_map", data.draw(st.integers(0, 99)), -data.draw(st.integers(2, 10**6))),
        "token_index_high": lambda: edit(
            "token_index", data.draw(st.integers(0, 99)), T + data.draw(st.integers(0, 10**6))
        ),
        "indices_high": lambda: edit("indices", 0, r.num_experts + 3),
        "weights_fp16": lambda: dataclasses.replace(r, weights=r.weights.half()),
        "num_rows_more": lambda: dataclasses.replace(r, num_rows=r.num_rows + 1),
        "not_a_routing": lambda: r.row_map,
    }
    if T * K == 0 or r.num_rows == 0:
        table = {k: v for k, v in table.items() if k in ("weights_fp16", "num_rows_more", "not_a_routing")}
    return maybe_bad(data, table)


def _routing(data, p):
    T, E = data.draw(st.sampled_from((1, 7, 13))), data.draw(st.integers(2, 6))
    k = data.draw(st.integers(1, E))
    lg = contiguous(data, (T, E), F32, p, scale=2.0)
    return tk.moe_route(lg, k=k, capacity_factor=data.draw(st.sampled_from((None, 0.6, 1.0))), provider="torch"), lg


def draw_moe_permute(data, p):
    r, _ = _routing(data, p)
    if data.draw(st.booleans()):
        r = dataclasses.replace(r)  # an honest copy: checked once, then trusted
    x = tensor(data, (r.num_tokens, data.draw(st.sampled_from((1, 3, 5)))), data.draw(st.sampled_from(FLOATS)), p)
    bad, rr = _lying(data, r, p)
    kw = {"x": x, "routing": rr if bad else r}
    return Call(
        lambda: tk.moe_permute(**kw, provider=p),
        lambda out: close(out, M.moe_permute_ref(x, r), x.dtype),
        {"x": x, "routing": kw["routing"]},
        bad=bad,
    )


def draw_moe_unpermute(data, p):
    r, _ = _routing(data, p)
    y = tensor(data, (r.num_rows, data.draw(st.sampled_from((1, 3, 5)))), data.draw(st.sampled_from(FLOATS)), p)
    weights = data.draw(st.booleans())
    bad, rr = _lying(data, r, p)
    kw = {"y_perm": y, "routing": rr if bad else r, "weights": weights}
    return Call(
        lambda: tk.moe_unpermute(**kw, provider=p),
        lambda out: close(out, M.moe_unpermute_ref(y, r, weights=weights), y.dtype, 4),
        {"y_perm": y, "routing": kw["routing"]},
        bad=bad,
    )


def draw_moe_losses(data, p):
    r, lg = _routing(data, p)
    which = data.draw(st.sampled_from(("aux", "z")))
    bad, rr = _lying(data, r, p) if which == "aux" else (None, None)
    rr = rr if bad else r  # (the aux loss checks the whole routing: any lie is refused)
    if which == "aux":
        return Call(
            lambda: tk.moe_aux_loss(lg, rr, provider=p),
            lambda v: close(v, M.moe_aux_loss_ref(lg, r), F32, 5),
            {"logits": lg, "routing": rr},
            bad=bad,
        )
    bad, val = maybe_bad(
        data, {"logits_1d": lambda: lg[0], "logits_int": lambda: lg.long(), "logits_none": lambda: None}
    )
    x = val if bad else lg
    return Call(
        lambda: tk.moe_z_loss(x, provider=p), lambda v: close(v, M.moe_z_loss_ref(lg), F32, 5), {"logits": lg}, bad=bad
    )


def draw_count_nonfinite(data, p):
    n = data.draw(st.sampled_from((0, *SIZES)))
    dt = data.draw(st.sampled_from((*FLOATS, F64)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    v = torch.randn(n, generator=g).to(dt)
    special = torch.tensor([math.nan, math.inf, -math.inf, 3e38], dtype=F32).to(dt)
    for _ in range(data.draw(st.integers(0, 3))):
        if n:
            v[data.draw(st.integers(0, n - 1))] = special[data.draw(st.integers(0, 3))]
    bad, val = maybe_bad(
        data, {"v_int": lambda: v.to(torch.int32), "v_list": lambda: v.tolist(), "v_none": lambda: None}
    )
    x = val if bad else v.to(DEVICE)
    return Call(lambda: ops.count_nonfinite(x), lambda c: int(c) == int((~torch.isfinite(v)).sum()), {"v": x}, bad=bad)


def _same(a, b) -> bool:
    a, b = a.detach().cpu(), b.detach().cpu()
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(), b.nan_to_num())
    )


def _index(data, rows: int, p) -> torch.Tensor | None:
    if not data.draw(st.booleans()):
        return None
    vals = data.draw(st.lists(st.integers(-1, max(rows - 1, -1)), min_size=0, max_size=9))
    return torch.tensor(vals, dtype=torch.int64, device=dev(p))


def draw_quantize_rows(data, p):
    T, H = data.draw(st.sampled_from((1, 3, 7))), data.draw(st.sampled_from(SIZES))
    x = tensor(data, (T, H), data.draw(st.sampled_from(FLOATS)), p)
    fmt, block = data.draw(st.sampled_from(("e4m3", "e5m2", "int8"))), data.draw(st.sampled_from((2, 8, 128)))
    idx = _index(data, T, p)
    kw = {"x": x, "fmt": fmt, "block": block, "index": idx}
    bad, val = maybe_bad(
        data,
        {"x_" + k: _nt(k) for k in NOT_TENSORS}
        | {
            "x_int": lambda: x.to(torch.int32),
            "x_flat": lambda: x.reshape(-1),
            "fmt_fp4": lambda: "fp4",
            "block_3": lambda: 3,
            "block_float": lambda: 8.0,
            "index_range": lambda: torch.tensor([T], device=dev(p)),
            "index_float": lambda: torch.zeros(1, device=dev(p)),
            "out_short": lambda: torch.empty(1, 2, dtype=torch.uint8, device=dev(p)),
        },
    )
    if bad is not None:
        kw[bad.split("_")[0]] = val
    return Call(
        lambda: tk.quantize_rows(**kw, provider=p),
        lambda r: _same(r, ops.quantize_rows_ref(x, fmt, block, idx)),
        {"x": kw["x"], "index": kw["index"], "out": kw.get("out")},
        bad=bad,
    )


def draw_dequantize_rows(data, p):
    M, H = data.draw(st.sampled_from((1, 3, 7))), data.draw(st.sampled_from(SIZES))
    fmt, block = data.draw(st.sampled_from(("e4m3", "e5m2", "int8"))), data.draw(st.sampled_from((2, 8, 128)))
    packed = ops.quantize_rows_ref(contiguous(data, (M, H), F32, p), fmt, block)
    dtype = data.draw(st.sampled_from(FLOATS))
    idx = _index(data, M, p)
    kw = {"packed": packed, "fmt": fmt, "block": block, "hidden": H, "dtype": dtype, "index": idx}
    bad, val = maybe_bad(
        data,
        {
            "packed_float": lambda: packed.float(),
            "packed_none": lambda: None,
            "hidden_wide": lambda: H + 64,
            "hidden_zero": lambda: 0,
            "dtype_int": lambda: torch.int8,
            "index_range": lambda: torch.tensor([M], device=dev(p)),
            "fmt_fp4": lambda: "fp4",
        },
    )
    if bad is not None:
        kw[bad.split("_")[0]] = val
    return Call(
        lambda: tk.dequantize_rows(**kw, provider=p),
        lambda r: _same(r, ops.dequantize_rows_ref(packed, fmt, block, H, dtype, idx)),
        {"packed": packed, "index": kw["index"]},
        bad=bad,
    )


DRAWERS: dict[str, Callable] = {
    "flatten": draw_flatten,
    "unflatten": draw_unflatten,
    "bucket_reduce": draw_bucket_reduce,
    "wire_cast": draw_wire_cast,
    "quantize": draw_quantize,
    "dequantize": draw_dequantize,
    "quantize_rows": draw_quantize_rows,
    "dequantize_rows": draw_dequantize_rows,
    "topk_compress": draw_topk_compress,
    "topk_decompress": draw_topk_decompress,
    "sign_compress": draw_sign_compress,
    "sign_decompress": draw_sign_decompress,
    "orthogonalize": draw_orthogonalize,
    "residual_add": draw_residual_add,
    "error_update": draw_error_update,
    "pack": draw_pack,
    "unpack": draw_unpack,
    "moe_route": draw_moe_route,
    "moe_permute": draw_moe_permute,
    "moe_unpermute": draw_moe_unpermute,
    "moe_losses": draw_moe_losses,
    "count_nonfinite": draw_count_nonfinite,
}
_ONLY = {"moe_losses": ("cpu", "torch"), "count_nonfinite": ("torch",)}  # the losses have no triton/numba kernels
PAIRS = [(op, p) for op in DRAWERS for p in PROVIDERS if p in _ONLY.get(op, PROVIDERS)]


_SLOW_PAIRS = {("quantize", "numba")}  # over 10 s in Numba's simulator; the other pairs take a second or less
PARAMS = [pytest.param(o, p, id=f"{o}-{p}", marks=pytest.mark.slow if (o, p) in _SLOW_PAIRS else ()) for o, p in PAIRS]


@pytest.mark.parametrize(("op", "provider"), PARAMS)
def test_fuzz(op, provider):
    drawer = DRAWERS[op]

    @settings(
        max_examples=examples(provider),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def run(data):
        check(drawer(data, provider))

    run()


def test_the_fuzz_covers_every_public_op():
    """A new public op gets a drawer here (or a reason it has none)."""
    covered = set(DRAWERS) | {"moe_aux_loss", "moe_z_loss"} - {"moe_losses"}
    helpers = {
        "BucketLayout",
        "Packed",
        "ProviderInfo",
        "ProviderReport",
        "Routing",
        "RouterSpec",  # moe_route's options: drawn by its drawer, as keywords and as a spec
        "RowQuantSpec",  # quantize_rows's options: drawn as keywords
        "row_wire_bytes",  # the packed row's size: checked by the rowquant tests
        "providers",
        "set_tuned_lookup",
        "block_codes",
        "seed_key",
        "topk_count",
        "packed_nbytes",
        "COMPRESS_DTYPES",
        "FORMATS",
        "PROVIDERS",
        "QMAX",
    }
    public = {n for n in ops.__all__ if not n.endswith("_ref")} - helpers
    assert public <= covered, f"no fuzz drawer for {sorted(public - covered)}"
    assert GPU or DEVICE.type == "cpu"
