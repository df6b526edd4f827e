"""Bad and edge inputs for the ops layer: every public op of ``torsh_kernels.ops`` on every provider.

Each case is a real call through the public API. The matrix, per op and provider: wrong Python types (None,
str, list, NumPy array, bool for int), wrong dtypes (int, bool, complex, fp64 where not accepted), wrong
devices (meta beside CPU), meta tensors (the op's fake implementation answers with meta results), strided and
expanded views, zero-size inputs, NaN/Inf/huge/negative numbers, mismatched shapes, ``out=`` buffers of the
wrong size, dtype, device or overlapping an input, ``requires_grad`` inputs, and hand-made ``Routing`` and
``Packed`` objects. The issue's findings are here by name (``moe_permute/triton/row_map_out_of_range``, ...).

Refusals must be typed (a ``TorshKernelsError``) and must leave every tensor the caller passed as it was
(checked here: a case whose input changed before the error raises ``AssertionError``). Accepted inputs are
compared with the torch reference, and their inputs must be unchanged unless the op documents a write.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pickle

import numpy as np
import torch

import torsh_kernels as tk
from probe_cases import Case
from torsh_kernels import ops
from torsh_kernels.errors import TorshKernelsError
from torsh_kernels.ops import moe as M

PROVIDERS = ("triton", "numba", "cpu", "torch")
_GPU = torch.cuda.is_available()
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
I64, I32 = torch.int64, torch.int32
META = torch.device("meta")
CASES: list[Case] = []


def _dev(p: str) -> torch.device:
    """Where provider ``p``'s tensors live: the GPU when there is one (the cpu provider: always the host)."""
    return torch.device("cuda") if _GPU and p != "cpu" else torch.device("cpu")


def rnd(*shape: int, dtype=F32, seed: int = 0, p: str = "cpu", scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(_dev(p))


class L:
    """A value made when the case runs (tensors are not made at import)."""

    def __init__(self, f) -> None:
        self.f = f


def _val(v, p: str):
    if isinstance(v, L):
        return v.f(p)
    return v


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    if isinstance(obj, (tk.Routing, ops.Packed)):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)]
    return []


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s whole storage (a write anywhere in it shows; an expanded view costs its storage)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()


def _snap(kw: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t, _bytes(t)) for t in _tensors(kw) if not t.is_meta]


def _unchanged(snap) -> bool:
    return all(torch.equal(_bytes(t), c) for t, c in snap)


def _refused(fn, kw: dict, keep: bool = True):
    """``fn(**kw)``; a typed error must leave every tensor in ``kw`` as it was (``keep``)."""
    snap = _snap(kw) if keep else []
    try:
        return fn(**kw)
    except TorshKernelsError:
        if keep and not _unchanged(snap):
            raise AssertionError("a tensor the caller passed was changed before the typed error") from None
        raise


def _err(name: str, fn, base, mut: dict, p: str | None, keep: bool = True, timeout: float = 30.0) -> None:
    def run():
        kw = {k: _val(v, p) for k, v in base(p).items()}
        kw.update({k: _val(v, p) for k, v in mut.items()})
        if p is not None:
            kw["provider"] = p
        return _refused(fn, kw, keep)

    CASES.append(Case(name, run, "error", timeout=timeout))


def _ok(name: str, fn, base, mut: dict, p: str | None, verify, writes: tuple[str, ...] = (), timeout: float = 60.0):
    """An accepted input: ``verify(result, kw, before)`` must hold (``before``: clones of the inputs) and every
    tensor not named in ``writes`` must be unchanged."""

    def run():
        kw = {k: _val(v, p) for k, v in base(p).items()}
        kw.update({k: _val(v, p) for k, v in mut.items()})
        if p is not None:
            kw["provider"] = p
        before = {
            k: (
                v.detach().clone()
                if isinstance(v, torch.Tensor)
                else [t.detach().clone() for t in v]
                if isinstance(v, list) and all(isinstance(t, torch.Tensor) for t in v)
                else v
            )
            for k, v in kw.items()
        }
        snap = _snap({k: v for k, v in kw.items() if k not in writes})
        res = fn(**kw)
        if not _unchanged(snap):
            return "an input the op does not write was changed"
        return bool(verify(res, kw, before)) or "wrong result"

    CASES.append(Case(name, run, "ok", check=lambda v: v is True, timeout=timeout))


def close(a, b, atol=1e-5, rtol=1e-5) -> bool:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.is_meta or b.is_meta:
        return a.shape == b.shape and a.dtype == b.dtype
    return a.shape == b.shape and torch.allclose(
        a.detach().double().cpu(), b.detach().double().cpu(), atol=atol, rtol=rtol, equal_nan=True
    )


def is_meta_like(res, shape, dtype=None) -> bool:
    t = res[0] if isinstance(res, tuple) else res
    return t.is_meta and tuple(t.shape) == tuple(shape) and (dtype is None or t.dtype == dtype)


# Bad values shared by the ops' arguments
NOT_TENSORS = {"none": None, "str": "x", "list": [1.0, 2.0, 3.0], "ndarray": np.ones(5, np.float32), "float": 3.0}
BAD_FLOAT_DTYPES = {"int32": I32, "int64": I64, "bool": torch.bool, "complex64": torch.complex64, "uint8": torch.uint8}
BAD_REALS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "str": "1", "none": None, "bool": True}
BAD_INTS = {"bool": True, "float": 2.0, "str": "3", "none": None, "negative": -1, "huge": 2**70}


def _as(dtype):
    return lambda p: rnd(5, p=p).to(dtype) if dtype is not torch.bool else rnd(5, p=p) > 0


def _meta(*shape, dtype=F32):
    return L(lambda p: torch.empty(*shape, dtype=dtype, device=META))


def each(*providers):
    return providers or PROVIDERS


# ==================================================================================================
# bucket: flatten, unflatten, bucket_reduce, wire_cast, BucketLayout


def _flat_base(p):
    return {"tensors": [rnd(5, p=p), rnd(2, 3, seed=1, p=p)]}


def _flatten_ref(kw):
    dt = kw.get("dtype") or (kw["out"].dtype if kw.get("out") is not None else None)
    ts = kw["tensors"]
    if dt is None:
        dt = functools.reduce(torch.promote_types, [t.dtype for t in ts])
    cd = F64 if F64 in (dt, *[t.dtype for t in ts]) else F32
    return torch.cat([t.detach().reshape(-1).to(cd) * kw.get("scale", 1.0) for t in ts]).to(dt)


for p in PROVIDERS:
    P = f"ops/flatten/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/tensors_{k}", tk.flatten, _flat_base, {"tensors": v}, p)
    _err(f"{P}/tensors_one_tensor_not_a_list", tk.flatten, _flat_base, {"tensors": L(lambda p: rnd(5, p=p))}, p)
    _err(f"{P}/tensors_empty_list", tk.flatten, _flat_base, {"tensors": []}, p)
    _err(f"{P}/tensors_item_none", tk.flatten, _flat_base, {"tensors": L(lambda p: [rnd(5, p=p), None])}, p)
    for k, dt in BAD_FLOAT_DTYPES.items():
        _err(f"{P}/tensors_{k}", tk.flatten, _flat_base, {"tensors": L(lambda p, dt=dt: [rnd(5, p=p), _as(dt)(p)])}, p)
    _err(
        f"{P}/tensors_meta_beside_cpu",
        tk.flatten,
        _flat_base,
        {"tensors": L(lambda p: [rnd(5, p=p), torch.empty(3, device=META)])},
        p,
    )
    for k, v in BAD_REALS.items():
        _err(f"{P}/scale_{k}", tk.flatten, _flat_base, {"scale": v}, p)
    for k, v in {"int32": I32, "str": "float32", "complex": torch.complex64}.items():
        _err(f"{P}/dtype_{k}", tk.flatten, _flat_base, {"dtype": v}, p)
    _err(f"{P}/out_too_small", tk.flatten, _flat_base, {"out": L(lambda p: torch.empty(10, device=_dev(p)))}, p)
    _err(f"{P}/out_int", tk.flatten, _flat_base, {"out": L(lambda p: torch.empty(11, dtype=I32, device=_dev(p)))}, p)
    _err(f"{P}/out_strided", tk.flatten, _flat_base, {"out": L(lambda p: torch.empty(22, device=_dev(p))[::2])}, p)
    _err(f"{P}/out_str", tk.flatten, _flat_base, {"out": "buffer"}, p)
    _err(
        f"{P}/out_dtype_disagrees",
        tk.flatten,
        _flat_base,
        {"out": L(lambda p: torch.empty(11, device=_dev(p))), "dtype": F16},
        p,
    )

    def _overlap(p):
        buf = rnd(16, p=p)
        return {"tensors": [buf[:5], buf[5:11]], "out": buf[3:14]}

    _err(f"{P}/out_overlaps_input", tk.flatten, _overlap, {}, p)
    _err(f"{P}/out_meta_inputs_cpu", tk.flatten, _flat_base, {"out": _meta(11)}, p)
    _ok(
        f"{P}/noncontiguous_and_expanded_inputs",
        tk.flatten,
        lambda p: {"tensors": [rnd(3, 4, p=p).t(), rnd(1, 3, seed=2, p=p).expand(4, 3), rnd(7, seed=3, p=p)[::2]]},
        {},
        p,
        lambda r, kw, b: close(r[0], _flatten_ref(b)),
    )
    _ok(
        f"{P}/zero_size_tensors",
        tk.flatten,
        lambda p: {"tensors": [torch.empty(0, device=_dev(p)), rnd(3, p=p)]},
        {},
        p,
        lambda r, kw, b: close(r[0], _flatten_ref(b)),
    )
    _ok(
        f"{P}/requires_grad_inputs_scaled_to_bf16",
        tk.flatten,
        lambda p: {"tensors": [rnd(5, p=p).requires_grad_(), rnd(4, seed=1, p=p)], "scale": 0.5, "dtype": BF16},
        {},
        p,
        lambda r, kw, b: close(r[0], _flatten_ref(b), 1e-2, 1e-2) and not r[0].requires_grad,
    )
    _ok(
        f"{P}/fp64_and_fp16_mixed",
        tk.flatten,
        lambda p: {"tensors": [rnd(5, dtype=F64, p=p), rnd(3, dtype=F16, p=p)]},
        {},
        p,
        lambda r, kw, b: close(r[0], _flatten_ref(b)) and r[0].dtype == F64,
    )
    _ok(
        f"{P}/meta_tensors",
        tk.flatten,
        lambda p: {"tensors": [torch.empty(5, device=META), torch.empty(2, 3, device=META)]},
        {},
        p,
        lambda r, kw, b: is_meta_like(r[0], (11,)),
    )
    _ok(
        f"{P}/out_given",
        tk.flatten,
        lambda p: {**_flat_base(p), "out": torch.full((11,), math.nan, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: close(r[0], _flatten_ref(b)),
        writes=("out",),
    )


def _unflat_base(p):
    ts = [rnd(5, p=p), rnd(2, 3, seed=1, p=p)]
    flat, layout = tk.flatten(ts, provider="torch")
    return {
        "flat": flat * 2,
        "layout": layout,
        "tensors": [torch.zeros(5, device=_dev(p)), torch.zeros(2, 3, device=_dev(p))],
    }


for p in PROVIDERS:
    P = f"ops/unflatten/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/flat_{k}", tk.unflatten, _unflat_base, {"flat": v}, p)
    for k in ("none", "str"):
        _err(f"{P}/layout_{k}", tk.unflatten, _unflat_base, {"layout": NOT_TENSORS[k]}, p)
        _err(f"{P}/tensors_{k}", tk.unflatten, _unflat_base, {"tensors": NOT_TENSORS[k]}, p)
    _err(
        f"{P}/layout_of_other_tensors",
        tk.unflatten,
        _unflat_base,
        {"layout": L(lambda p: tk.flatten([torch.ones(4)], provider="torch")[1])},
        p,
    )
    _err(f"{P}/flat_too_long", tk.unflatten, _unflat_base, {"flat": L(lambda p: rnd(12, p=p))}, p)
    _err(
        f"{P}/flat_int", tk.unflatten, _unflat_base, {"flat": L(lambda p: torch.ones(11, dtype=I32, device=_dev(p)))}, p
    )
    _err(
        f"{P}/tensors_one_missing",
        tk.unflatten,
        _unflat_base,
        {"tensors": L(lambda p: [torch.zeros(5, device=_dev(p))])},
        p,
    )
    _err(
        f"{P}/tensors_wrong_shape",
        tk.unflatten,
        _unflat_base,
        {"tensors": L(lambda p: [torch.zeros(5, device=_dev(p)), torch.zeros(3, 2, device=_dev(p))])},
        p,
    )
    _err(
        f"{P}/tensors_int_destination",
        tk.unflatten,
        _unflat_base,
        {"tensors": L(lambda p: [torch.zeros(5, dtype=I32, device=_dev(p)), torch.zeros(2, 3, device=_dev(p))])},
        p,
    )
    _err(
        f"{P}/tensors_expanded_destination",
        tk.unflatten,
        _unflat_base,
        {"tensors": L(lambda p: [torch.zeros(1, device=_dev(p)).expand(5), torch.zeros(2, 3, device=_dev(p))])},
        p,
    )

    def _same_twice(p):
        b = _unflat_base(p)
        d = torch.zeros(6, device=_dev(p))
        b["tensors"] = [d[:5], d.view(2, 3)]
        return b

    _err(f"{P}/tensors_share_memory", tk.unflatten, _same_twice, {}, p)

    def _into_flat(p):
        b = _unflat_base(p)
        b["tensors"] = [b["flat"][2:7], torch.zeros(2, 3, device=_dev(p))]
        return b

    _err(f"{P}/tensor_overlaps_flat_not_as_its_slice", tk.unflatten, _into_flat, {}, p)
    _err(
        f"{P}/tensors_on_meta_flat_on_cpu",
        tk.unflatten,
        _unflat_base,
        {"tensors": L(lambda p: [torch.empty(5, device=META), torch.empty(2, 3, device=META)])},
        p,
    )
    for k in ("nan", "inf", "str"):
        _err(f"{P}/scale_{k}", tk.unflatten, _unflat_base, {"scale": BAD_REALS[k]}, p)
    _ok(
        f"{P}/strided_destinations_accumulate",
        tk.unflatten,
        lambda p: {
            **_unflat_base(p),
            "tensors": [torch.ones(10, device=_dev(p))[::2], torch.ones(3, 2, device=_dev(p)).t()],
            "accumulate": True,
        },
        {},
        p,
        lambda r, kw, b: (
            close(kw["tensors"][0], 1 + b["flat"][:5]) and close(kw["tensors"][1], 1 + b["flat"][5:].view(2, 3))
        ),
        writes=("tensors",),
    )
    _ok(
        f"{P}/into_own_slices_of_flat",
        tk.unflatten,
        lambda p: (lambda b: {**b, "tensors": [b["flat"][:5], b["flat"][5:].view(2, 3)]})(_unflat_base(p)),
        {},
        p,
        lambda r, kw, b: close(kw["flat"], b["flat"]),
        writes=("tensors", "flat"),
    )


def _layout_err(name, **kw):
    def run():
        base = {"shapes": ((2,), (3,)), "dtypes": (F32, F32), "offsets": (0, 2), "total": 5, "dtype": F32}
        return ops.BucketLayout(**{**base, **kw})

    CASES.append(Case(f"ops/BucketLayout/any/{name}", run))


_layout_err("offsets_not_running_sum", offsets=(0, 3))
_layout_err("total_wrong", total=6)
_layout_err("lengths_disagree", dtypes=(F32,))
_layout_err("negative_dim", shapes=((-2,), (3,)), total=1, offsets=(0, -2))
_layout_err("shape_not_tuple", shapes=("ab", (3,)))
_layout_err("shapes_list", shapes=[(2,), (3,)])
_layout_err("dtype_int", dtype=torch.int32)
_layout_err("dtypes_str", dtypes=("float32", F32))
_layout_err("total_float", total=5.0)
_layout_err("offset_float", offsets=(0.0, 2))
CASES.append(
    Case(
        "ops/BucketLayout/any/views_wrong_flat",
        lambda: tk.flatten([torch.ones(3)], provider="torch")[1].views(torch.ones(4)),
    )
)
CASES.append(
    Case(
        "ops/BucketLayout/any/views_not_tensor",
        lambda: tk.flatten([torch.ones(3)], provider="torch")[1].views([1, 2, 3]),
    )
)


def _red_base(p):
    return {"buffers": [rnd(7, p=p), rnd(7, seed=1, p=p), rnd(7, seed=2, p=p)]}


for p in PROVIDERS:
    P = f"ops/bucket_reduce/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/buffers_{k}", tk.bucket_reduce, _red_base, {"buffers": v}, p)
    _err(f"{P}/buffers_empty", tk.bucket_reduce, _red_base, {"buffers": []}, p)
    _err(
        f"{P}/stacked_scalar",
        tk.bucket_reduce,
        _red_base,
        {"buffers": L(lambda p: torch.tensor(1.0, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/stacked_zero_rows",
        tk.bucket_reduce,
        _red_base,
        {"buffers": L(lambda p: torch.empty(0, 4, device=_dev(p)))},
        p,
    )
    _err(f"{P}/shapes_differ", tk.bucket_reduce, _red_base, {"buffers": L(lambda p: [rnd(7, p=p), rnd(6, p=p)])}, p)
    _err(
        f"{P}/dtypes_differ",
        tk.bucket_reduce,
        _red_base,
        {"buffers": L(lambda p: [rnd(7, p=p), rnd(7, dtype=F16, p=p)])},
        p,
    )
    for k, dt in BAD_FLOAT_DTYPES.items():
        _err(
            f"{P}/buffers_{k}",
            tk.bucket_reduce,
            _red_base,
            {"buffers": L(lambda p, dt=dt: [_as(dt)(p), _as(dt)(p)])},
            p,
        )
    _err(
        f"{P}/buffer_on_meta",
        tk.bucket_reduce,
        _red_base,
        {"buffers": L(lambda p: [rnd(7, p=p), torch.empty(7, device=META)])},
        p,
    )
    for k, v in {"bogus": "mean", "none": None, "int": 0}.items():
        _err(f"{P}/op_{k}", tk.bucket_reduce, _red_base, {"op": v}, p)
    _err(f"{P}/out_wrong_shape", tk.bucket_reduce, _red_base, {"out": L(lambda p: torch.empty(8, device=_dev(p)))}, p)
    _err(
        f"{P}/out_int", tk.bucket_reduce, _red_base, {"out": L(lambda p: torch.empty(7, dtype=I64, device=_dev(p)))}, p
    )
    _err(f"{P}/out_strided", tk.bucket_reduce, _red_base, {"out": L(lambda p: torch.empty(14, device=_dev(p))[::2])}, p)
    _err(f"{P}/out_list", tk.bucket_reduce, _red_base, {"out": [0.0] * 7}, p)

    def _part(p):
        buf = rnd(10, p=p)
        return {"buffers": [buf[:7], rnd(7, seed=1, p=p)], "out": buf[3:10]}

    _err(f"{P}/out_overlaps_a_buffer_partly", tk.bucket_reduce, _part, {}, p)
    for op in ("sum", "avg", "max"):
        _ok(
            f"{P}/{op}_noncontiguous_and_expanded",
            tk.bucket_reduce,
            lambda p: {"buffers": [rnd(2, 7, p=p)[1], rnd(7, 2, seed=1, p=p)[:, 0], rnd(1, seed=2, p=p).expand(7)]},
            {"op": op},
            p,
            lambda r, kw, b, op=op: close(r, ops.bucket_reduce_ref(b["buffers"], op, F32)),
        )
    _ok(
        f"{P}/in_place_into_buffer0",
        tk.bucket_reduce,
        lambda p: (lambda b: {**b, "out": b["buffers"][0]})(_red_base(p)),
        {},
        p,
        lambda r, kw, b: close(r, ops.bucket_reduce_ref(b["buffers"], "sum", F32)),
        writes=("buffers", "out"),
    )
    _ok(
        f"{P}/stacked_fp64_with_nan_max",
        tk.bucket_reduce,
        lambda p: {
            "buffers": torch.tensor([[1.0, math.nan, 3.0], [2.0, 0.0, -1.0]], dtype=F64, device=_dev(p)),
            "op": "max",
        },
        {},
        p,
        lambda r, kw, b: close(r, torch.tensor([2.0, math.nan, 3.0], dtype=F64)),
    )
    _ok(
        f"{P}/zero_size_buffers",
        tk.bucket_reduce,
        lambda p: {"buffers": [torch.empty(0, device=_dev(p))] * 2},
        {},
        p,
        lambda r, kw, b: r.shape == (0,),
    )
    _ok(
        f"{P}/meta_buffers",
        tk.bucket_reduce,
        lambda p: {"buffers": [torch.empty(7, device=META)] * 2},
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (7,)),
    )


def _wire_base(p):
    return {"x": rnd(9, p=p), "dtype": F16}


for p in PROVIDERS:
    P = f"ops/wire_cast/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/x_{k}", tk.wire_cast, _wire_base, {"x": v}, p)
    for k, dt in {**BAD_FLOAT_DTYPES, "fp64": F64}.items():
        _err(f"{P}/x_{k}", tk.wire_cast, _wire_base, {"x": L(_as(dt))}, p)
    for k, v in {"int32": I32, "str": "fp16", "fp64": F64}.items():
        _err(f"{P}/dtype_{k}", tk.wire_cast, _wire_base, {"dtype": v}, p)
    for k, v in {**BAD_REALS, "zero": 0.0}.items():
        _err(f"{P}/divisor_{k}", tk.wire_cast, _wire_base, {"divisor": v}, p)
    _err(
        f"{P}/out_wrong_size",
        tk.wire_cast,
        _wire_base,
        {"out": L(lambda p: torch.empty(8, dtype=F16, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/out_strided",
        tk.wire_cast,
        _wire_base,
        {"out": L(lambda p: torch.empty(18, dtype=F16, device=_dev(p))[::2])},
        p,
    )
    _err(
        f"{P}/out_dtype_disagrees",
        tk.wire_cast,
        _wire_base,
        {"out": L(lambda p: torch.empty(9, dtype=BF16, device=_dev(p)))},
        p,
    )

    def _wov(p):
        x = rnd(9, p=p)
        return {"x": x, "dtype": None, "out": x.view(F16)[1:10]}

    _err(f"{P}/out_overlaps_x_partly", tk.wire_cast, _wov, {}, p)
    _err(
        f"{P}/nan_input",
        tk.wire_cast,
        _wire_base,
        {"x": L(lambda p: torch.tensor([1.0, math.nan, 2.0], device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/fp16_overflow", tk.wire_cast, _wire_base, {"x": L(lambda p: torch.tensor([1.0, 1e6], device=_dev(p)))}, p
    )
    _ok(
        f"{P}/in_place_fp32",
        tk.wire_cast,
        lambda p: (lambda x: {"x": x, "out": x, "divisor": 4})(rnd(9, p=p)),
        {},
        p,
        lambda r, kw, b: close(r, b["x"] / 4),
        writes=("x", "out"),
    )
    _ok(
        f"{P}/noncontiguous_requires_grad_bf16",
        tk.wire_cast,
        lambda p: {"x": rnd(3, 6, p=p).t().requires_grad_(), "dtype": BF16, "divisor": 3.0},
        {},
        p,
        lambda r, kw, b: close(r, ops.wire_cast_ref(b["x"], BF16, 3.0), 1e-2, 1e-2),
    )
    _ok(
        f"{P}/zero_size",
        tk.wire_cast,
        lambda p: {"x": torch.empty(0, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: r.numel() == 0,
    )
    _ok(
        f"{P}/meta",
        tk.wire_cast,
        lambda p: {"x": torch.empty(9, device=META)},
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (9,), F16),
    )


# ==================================================================================================
# quantize, dequantize


def _q_base(p):
    return {"x": rnd(37, p=p), "bits": 8, "block": 8}


for p in PROVIDERS:
    P = f"ops/quantize/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/x_{k}", tk.quantize, _q_base, {"x": v}, p)
    for k, dt in {**BAD_FLOAT_DTYPES, "fp64": F64}.items():
        _err(f"{P}/x_{k}", tk.quantize, _q_base, {"x": L(_as(dt))}, p)
    for k, v in {**BAD_INTS, "three": 3, "sixteen": 16}.items():
        _err(f"{P}/bits_{k}", tk.quantize, _q_base, {"bits": v}, p)
    for k, v in {**BAD_INTS, "not_pow2": 24, "one": 1, "too_big": 2**17}.items():
        _err(f"{P}/block_{k}", tk.quantize, _q_base, {"block": v}, p)
    for k, v in {"str": "7", "float": 1.5, "list": [1]}.items():
        _err(f"{P}/seed_{k}", tk.quantize, _q_base, {"seed": v, "stochastic": True}, p)
    _err(
        f"{P}/out_not_pair",
        tk.quantize,
        _q_base,
        {"out": L(lambda p: torch.empty(37, dtype=torch.int8, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/out_q_wrong_dtype",
        tk.quantize,
        _q_base,
        {"out": L(lambda p: (torch.empty(37, dtype=torch.uint8, device=_dev(p)), torch.empty(5, device=_dev(p))))},
        p,
    )
    _err(
        f"{P}/out_scales_wrong_size",
        tk.quantize,
        _q_base,
        {"out": L(lambda p: (torch.empty(37, dtype=torch.int8, device=_dev(p)), torch.empty(4, device=_dev(p))))},
        p,
    )

    def _q_overlap(p):
        x = rnd(40, p=p)
        return {
            "x": x[:37],
            "bits": 8,
            "block": 8,
            "out": (x.view(torch.int8)[100:137], torch.empty(5, device=_dev(p))),
        }

    _err(f"{P}/out_q_overlaps_x", tk.quantize, _q_overlap, {}, p)

    def _qs_overlap(p):
        buf = torch.zeros(64, dtype=torch.uint8, device=_dev(p))
        return {"x": rnd(37, p=p), "bits": 8, "block": 8, "out": (buf[:37].view(torch.int8), buf[32:52].view(F32))}

    _err(f"{P}/out_q_overlaps_scales", tk.quantize, _qs_overlap, {}, p)
    _err(
        f"{P}/nan_input", tk.quantize, _q_base, {"x": L(lambda p: torch.tensor([1.0, math.nan] * 4, device=_dev(p)))}, p
    )
    _err(
        f"{P}/inf_input_int4",
        tk.quantize,
        _q_base,
        {"x": L(lambda p: torch.tensor([1.0, math.inf] * 4, device=_dev(p))), "bits": 4},
        p,
    )

    def _qv(bits, block, stochastic=False, seed=None):
        def verify(r, kw, b):
            q, s = r
            rq, rs = ops.quantize_ref(b["x"].reshape(-1), bits=bits, block=block, stochastic=stochastic, seed=seed)
            return torch.equal(q.cpu(), rq.cpu()) and close(s, rs)

        return verify

    _ok(
        f"{P}/int8_strided_input",
        tk.quantize,
        lambda p: {"x": rnd(37, 2, p=p)[:, 1], "bits": 8, "block": 8},
        {},
        p,
        _qv(8, 8),
    )
    _ok(
        f"{P}/int4_odd_count_expanded",
        tk.quantize,
        lambda p: {"x": rnd(1, 5, p=p).expand(3, 5), "bits": 4, "block": 4},
        {},
        p,
        _qv(4, 4),
    )
    _ok(
        f"{P}/stochastic_huge_seed",
        tk.quantize,
        lambda p: {**_q_base(p), "stochastic": True, "seed": 2**80 + 5},
        {},
        p,
        _qv(8, 8, True, 2**80 + 5),
    )
    _ok(
        f"{P}/stochastic_negative_seed",
        tk.quantize,
        lambda p: {**_q_base(p), "stochastic": True, "seed": -3},
        {},
        p,
        _qv(8, 8, True, -3),
    )
    _ok(
        f"{P}/requires_grad_fp16",
        tk.quantize,
        lambda p: {"x": rnd(37, dtype=F16, p=p).requires_grad_(), "bits": 8, "block": 8},
        {},
        p,
        _qv(8, 8),
    )
    _ok(
        f"{P}/zero_size",
        tk.quantize,
        lambda p: {"x": torch.empty(0, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: r[0].numel() == 0 and r[1].numel() == 0,
    )
    _ok(
        f"{P}/meta",
        tk.quantize,
        lambda p: {"x": torch.empty(37, device=META), "block": 8},
        {},
        p,
        lambda r, kw, b: is_meta_like(r[0], (37,), torch.int8) and is_meta_like(r[1], (5,), F32),
    )


def _dq_base(p):
    q, s = ops.quantize_ref(rnd(37, p=p), bits=8, block=8)
    return {"q": q, "scales": s, "block": 8}


for p in PROVIDERS:
    P = f"ops/dequantize/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/q_{k}", tk.dequantize, _dq_base, {"q": v}, p)
    _err(f"{P}/scales_none", tk.dequantize, _dq_base, {"scales": None}, p)
    _err(f"{P}/q_float32", tk.dequantize, _dq_base, {"q": L(lambda p: rnd(37, p=p))}, p)
    _err(f"{P}/q_int32", tk.dequantize, _dq_base, {"q": L(lambda p: torch.zeros(37, dtype=I32, device=_dev(p)))}, p)
    _err(
        f"{P}/scales_fp16",
        tk.dequantize,
        _dq_base,
        {"scales": L(lambda p: torch.ones(5, dtype=F16, device=_dev(p)))},
        p,
    )
    _err(f"{P}/scales_wrong_count", tk.dequantize, _dq_base, {"scales": L(lambda p: torch.ones(4, device=_dev(p)))}, p)
    _err(f"{P}/block_disagrees_with_scales", tk.dequantize, _dq_base, {"block": 16}, p)
    for k, v in {**BAD_INTS, "too_many": 38}.items():
        if k != "none":
            _err(f"{P}/numel_{k}", tk.dequantize, _dq_base, {"numel": v}, p)
    for k in ("nan", "inf", "str", "bool"):
        _err(f"{P}/alpha_{k}", tk.dequantize, _dq_base, {"alpha": BAD_REALS[k]}, p)
    _err(f"{P}/dtype_int", tk.dequantize, _dq_base, {"dtype": I32}, p)
    _err(f"{P}/accumulate_without_out", tk.dequantize, _dq_base, {"accumulate": True}, p)
    _err(f"{P}/out_wrong_size", tk.dequantize, _dq_base, {"out": L(lambda p: torch.empty(36, device=_dev(p)))}, p)
    _err(f"{P}/scales_on_meta", tk.dequantize, _dq_base, {"scales": _meta(5)}, p)

    def _dq_overlap(p):
        b = _dq_base(p)
        store = torch.zeros(64, device=_dev(p))
        b["q"] = store.view(torch.int8)[:37]
        return {**b, "out": store[:37]}

    _err(f"{P}/out_overlaps_q", tk.dequantize, _dq_overlap, {}, p)
    _ok(
        f"{P}/accumulate_alpha",
        tk.dequantize,
        lambda p: {**_dq_base(p), "out": torch.ones(37, device=_dev(p)), "accumulate": True, "alpha": -0.5},
        {},
        p,
        lambda r, kw, b: close(r, 1 - 0.5 * ops.dequantize_ref(b["q"], b["scales"], block=8, numel=37)),
        writes=("out",),
    )
    _ok(
        f"{P}/int4_odd_numel",
        tk.dequantize,
        lambda p: dict(zip(("q", "scales"), ops.quantize_ref(rnd(9, p=p), bits=4, block=4)), block=4, numel=9),
        {},
        p,
        lambda r, kw, b: close(r, ops.dequantize_ref(b["q"], b["scales"], block=4, numel=9)),
    )
    _ok(
        f"{P}/meta",
        tk.dequantize,
        lambda p: {
            "q": torch.empty(37, dtype=torch.int8, device=META),
            "scales": torch.empty(5, device=META),
            "block": 8,
        },
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (37,)),
    )


# ==================================================================================================
# topk, sign


def _tk_base(p):
    return {"x": rnd(40, p=p), "ratio": 0.1}


for p in PROVIDERS:
    P = f"ops/topk_compress/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/x_{k}", tk.topk_compress, _tk_base, {"x": v}, p)
    for k, dt in {**BAD_FLOAT_DTYPES, "fp64": F64}.items():
        _err(f"{P}/x_{k}", tk.topk_compress, _tk_base, {"x": L(_as(dt))}, p)
    _err(f"{P}/x_empty", tk.topk_compress, _tk_base, {"x": L(lambda p: torch.empty(0, device=_dev(p)))}, p)
    for k, v in {**BAD_REALS, "zero": 0.0, "negative": -0.1, "above_one": 1.5}.items():
        _err(f"{P}/ratio_{k}", tk.topk_compress, _tk_base, {"ratio": v}, p)
    _err(
        f"{P}/residual_wrong_size",
        tk.topk_compress,
        _tk_base,
        {"residual": L(lambda p: torch.zeros(39, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/residual_int",
        tk.topk_compress,
        _tk_base,
        {"residual": L(lambda p: torch.zeros(40, dtype=I32, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/residual_expanded",
        tk.topk_compress,
        _tk_base,
        {"residual": L(lambda p: torch.zeros(1, device=_dev(p)).expand(40))},
        p,
    )
    _err(
        f"{P}/residual_is_x",
        tk.topk_compress,
        lambda p: (lambda x: {"x": x, "ratio": 0.1, "residual": x})(rnd(40, p=p)),
        {},
        p,
    )
    _err(f"{P}/residual_on_meta", tk.topk_compress, _tk_base, {"residual": _meta(40)}, p)
    _err(
        f"{P}/nan_input",
        tk.topk_compress,
        _tk_base,
        {"x": L(lambda p: torch.tensor([1.0, math.nan, 3.0] * 5, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/inf_in_residual",
        tk.topk_compress,
        _tk_base,
        {"residual": L(lambda p: torch.tensor([0.0] * 39 + [math.inf], device=_dev(p)))},
        p,
    )

    def _tkv(r, kw, b):
        v, i = r
        rv, ri = ops.topk_compress_ref(b["x"], ratio=b["ratio"], residual=b.get("residual"))
        return (
            torch.equal(i.long().cpu(), ri.long().cpu())
            and close(v, rv)
            and (kw.get("residual") is None or close(kw["residual"], b["residual"]))
        )

    _ok(
        f"{P}/exact_strided_fp16",
        tk.topk_compress,
        lambda p: {"x": rnd(40, 2, dtype=F16, p=p)[:, 0], "ratio": 0.2, "exact": True},
        {},
        p,
        _tkv,
    )
    _ok(
        f"{P}/with_residual",
        tk.topk_compress,
        lambda p: {**_tk_base(p), "residual": rnd(40, seed=4, p=p)},
        {},
        p,
        _tkv,
        writes=("residual",),
    )
    _ok(
        f"{P}/ratio_one_requires_grad",
        tk.topk_compress,
        lambda p: {"x": rnd(9, p=p).requires_grad_(), "ratio": 1},
        {},
        p,
        _tkv,
    )
    _ok(
        f"{P}/meta",
        tk.topk_compress,
        lambda p: {"x": torch.empty(40, device=META), "ratio": 0.1},
        {},
        p,
        lambda r, kw, b: is_meta_like(r[0], (4,)),
    )


def _td_base(p):
    return {"values": rnd(4, p=p), "indices": torch.tensor([0, 3, 7, 9], device=_dev(p)), "numel": 10}


for p in PROVIDERS:
    P = f"ops/topk_decompress/{p}"
    for k in ("none", "str", "list"):
        _err(f"{P}/values_{k}", tk.topk_decompress, _td_base, {"values": NOT_TENSORS[k]}, p)
        _err(f"{P}/indices_{k}", tk.topk_decompress, _td_base, {"indices": NOT_TENSORS[k]}, p)
    _err(
        f"{P}/indices_float",
        tk.topk_decompress,
        _td_base,
        {"indices": L(lambda p: torch.tensor([0.0, 3, 7, 9], device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/values_int",
        tk.topk_decompress,
        _td_base,
        {"values": L(lambda p: torch.ones(4, dtype=I32, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/index_equal_numel",
        tk.topk_decompress,
        _td_base,
        {"indices": L(lambda p: torch.tensor([0, 3, 7, 10], device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/index_negative",
        tk.topk_decompress,
        _td_base,
        {"indices": L(lambda p: torch.tensor([0, -1, 7, 9], device=_dev(p)))},
        p,
    )
    _err(f"{P}/numel_10e12", tk.topk_decompress, _td_base, {"numel": 10**12}, p)
    _err(
        f"{P}/numel_huge_int32_indices",
        tk.topk_decompress,
        _td_base,
        {"numel": 2**62, "indices": L(lambda p: torch.tensor([0, 3, 7, 9], dtype=I32, device=_dev(p)))},
        p,
    )
    for k, v in BAD_INTS.items():
        _err(f"{P}/numel_{k}", tk.topk_decompress, _td_base, {"numel": v}, p)
    _err(f"{P}/lengths_differ", tk.topk_decompress, _td_base, {"values": L(lambda p: rnd(3, p=p))}, p)
    _err(f"{P}/values_2d", tk.topk_decompress, _td_base, {"values": L(lambda p: rnd(2, 2, p=p))}, p)
    for k in ("nan", "inf", "str", "bool"):
        _err(f"{P}/alpha_{k}", tk.topk_decompress, _td_base, {"alpha": BAD_REALS[k]}, p)
    _err(f"{P}/dtype_int", tk.topk_decompress, _td_base, {"dtype": I32}, p)
    _err(f"{P}/accumulate_without_out", tk.topk_decompress, _td_base, {"accumulate": True}, p)
    _err(f"{P}/out_wrong_size", tk.topk_decompress, _td_base, {"out": L(lambda p: torch.zeros(11, device=_dev(p)))}, p)
    _err(f"{P}/values_meta_indices_cpu", tk.topk_decompress, _td_base, {"values": _meta(4)}, p)

    def _td_overlap(p):
        store = torch.zeros(14, device=_dev(p))
        store[:4] = rnd(4, p=p)
        return {
            "values": store[:4],
            "indices": torch.tensor([0, 3, 7, 9], device=_dev(p)),
            "numel": 10,
            "out": store[2:12],
        }

    _err(f"{P}/out_overlaps_values", tk.topk_decompress, _td_overlap, {}, p)
    _ok(
        f"{P}/accumulate_duplicates_int32",
        tk.topk_decompress,
        lambda p: {
            "values": rnd(5, p=p),
            "indices": torch.tensor([1, 1, 4, 9, 1], dtype=I32, device=_dev(p)),
            "numel": 10,
            "out": torch.ones(10, device=_dev(p)),
            "accumulate": True,
            "alpha": 2.0,
        },
        {},
        p,
        lambda r, kw, b: close(
            r, ops.topk_decompress_ref(b["values"], b["indices"], 10, out=b["out"].clone(), accumulate=True, alpha=2.0)
        ),
        writes=("out",),
    )
    _ok(
        f"{P}/strided_values_fp16_out",
        tk.topk_decompress,
        lambda p: {**_td_base(p), "values": rnd(4, 2, p=p)[:, 1], "dtype": F16},
        {},
        p,
        lambda r, kw, b: (
            r.dtype == F16 and close(r, ops.topk_decompress_ref(b["values"], b["indices"], 10), 1e-3, 1e-3)
        ),
    )
    _ok(
        f"{P}/empty_payload",
        tk.topk_decompress,
        lambda p: {
            "values": torch.empty(0, device=_dev(p)),
            "indices": torch.empty(0, dtype=I64, device=_dev(p)),
            "numel": 6,
        },
        {},
        p,
        lambda r, kw, b: torch.equal(r.cpu(), torch.zeros(6)),
    )
    _ok(
        f"{P}/meta",
        tk.topk_decompress,
        lambda p: {
            "values": torch.empty(4, device=META),
            "indices": torch.empty(4, dtype=I64, device=META),
            "numel": 10,
        },
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (10,)),
    )


def _sc_base(p):
    return {"x": rnd(21, p=p)}


for p in PROVIDERS:
    P = f"ops/sign_compress/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/x_{k}", tk.sign_compress, _sc_base, {"x": v}, p)
    for k, dt in {**BAD_FLOAT_DTYPES, "fp64": F64}.items():
        _err(f"{P}/x_{k}", tk.sign_compress, _sc_base, {"x": L(_as(dt))}, p)
    _err(
        f"{P}/residual_wrong_size",
        tk.sign_compress,
        _sc_base,
        {"residual": L(lambda p: torch.zeros(20, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/residual_strided",
        tk.sign_compress,
        _sc_base,
        {"residual": L(lambda p: torch.zeros(42, device=_dev(p))[::2])},
        p,
    )
    _err(
        f"{P}/residual_bool",
        tk.sign_compress,
        _sc_base,
        {"residual": L(lambda p: torch.zeros(21, dtype=torch.bool, device=_dev(p)))},
        p,
    )

    def _sc_ov(p):
        buf = rnd(30, p=p)
        return {"x": buf[:21], "residual": buf[9:30]}

    _err(f"{P}/residual_overlaps_x", tk.sign_compress, _sc_ov, {}, p)
    _err(
        f"{P}/nan_input",
        tk.sign_compress,
        _sc_base,
        {"x": L(lambda p: torch.tensor([1.0, math.nan] * 5, device=_dev(p)))},
        p,
    )

    def _scv(r, kw, b):
        bits, s = r
        rb, rs = ops.sign_compress_ref(b["x"], residual=b.get("residual"))
        return (
            torch.equal(bits.cpu(), rb.cpu())
            and close(s, rs)
            and (kw.get("residual") is None or close(kw["residual"], b["residual"]))
        )

    _ok(f"{P}/strided_bf16", tk.sign_compress, lambda p: {"x": rnd(21, 2, dtype=BF16, p=p)[:, 1]}, {}, p, _scv)
    _ok(
        f"{P}/with_residual_requires_grad",
        tk.sign_compress,
        lambda p: {"x": rnd(21, p=p).requires_grad_(), "residual": rnd(21, seed=1, p=p)},
        {},
        p,
        _scv,
        writes=("residual",),
    )
    _ok(
        f"{P}/zero_size",
        tk.sign_compress,
        lambda p: {"x": torch.empty(0, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: r[0].numel() == 0 and float(r[1]) == 0.0,
    )
    _ok(
        f"{P}/meta",
        tk.sign_compress,
        lambda p: {"x": torch.empty(21, device=META)},
        {},
        p,
        lambda r, kw, b: is_meta_like(r[0], (3,), torch.uint8),
    )


def _sd_base(p):
    return {
        "bits": torch.tensor([0b10110011, 0b01], dtype=torch.uint8, device=_dev(p)),
        "scale": torch.tensor(0.5, device=_dev(p)),
        "numel": 10,
    }


for p in PROVIDERS:
    P = f"ops/sign_decompress/{p}"
    for k in ("none", "list", "ndarray"):
        _err(f"{P}/bits_{k}", tk.sign_decompress, _sd_base, {"bits": NOT_TENSORS[k]}, p)
    for k in ("none", "str", "list"):
        _err(f"{P}/scale_{k}", tk.sign_decompress, _sd_base, {"scale": NOT_TENSORS[k]}, p)
    _err(
        f"{P}/bits_int8",
        tk.sign_decompress,
        _sd_base,
        {"bits": L(lambda p: torch.zeros(2, dtype=torch.int8, device=_dev(p)))},
        p,
    )
    _err(f"{P}/bits_too_few", tk.sign_decompress, _sd_base, {"numel": 17}, p)
    _err(
        f"{P}/scale_two_elements",
        tk.sign_decompress,
        _sd_base,
        {"scale": L(lambda p: torch.ones(2, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/scale_int_tensor",
        tk.sign_decompress,
        _sd_base,
        {"scale": L(lambda p: torch.tensor(1, device=_dev(p)))},
        p,
    )
    _err(f"{P}/scale_bool", tk.sign_decompress, _sd_base, {"scale": True}, p)
    _err(f"{P}/scale_on_meta", tk.sign_decompress, _sd_base, {"scale": L(lambda p: torch.empty((), device=META))}, p)
    for k, v in BAD_INTS.items():
        _err(f"{P}/numel_{k}", tk.sign_decompress, _sd_base, {"numel": v}, p)
    for k in ("nan", "inf", "str"):
        _err(f"{P}/alpha_{k}", tk.sign_decompress, _sd_base, {"alpha": BAD_REALS[k]}, p)
    _err(f"{P}/accumulate_without_out", tk.sign_decompress, _sd_base, {"accumulate": True}, p)
    _err(f"{P}/dtype_fp64", tk.sign_decompress, _sd_base, {"dtype": F64}, p)

    def _sd_ov(p):
        store = torch.zeros(32, dtype=torch.uint8, device=_dev(p))
        store[:2] = _sd_base(p)["bits"]
        return {**_sd_base(p), "bits": store[:2], "out": store.view(BF16)[:10], "dtype": BF16}

    _err(f"{P}/out_overlaps_bits", tk.sign_decompress, _sd_ov, {}, p)
    _ok(
        f"{P}/python_scale_alpha_accumulate",
        tk.sign_decompress,
        lambda p: {
            **_sd_base(p),
            "scale": 2.0,
            "alpha": -1.0,
            "out": torch.ones(10, device=_dev(p)),
            "accumulate": True,
        },
        {},
        p,
        lambda r, kw, b: close(r, 1 - ops.sign_decompress_ref(b["bits"], torch.tensor(2.0), 10)),
        writes=("out",),
    )
    _ok(
        f"{P}/meta",
        tk.sign_decompress,
        lambda p: {
            "bits": torch.empty(2, dtype=torch.uint8, device=META),
            "scale": torch.empty((), device=META),
            "numel": 10,
        },
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (10,)),
    )


# ==================================================================================================
# orthogonalize, error feedback, count_nonfinite


def _or_base(p):
    return {"matrices": rnd(9, 3, p=p)}


def _orv(r, kw, b, atol=1e-4):
    ref = ops.orthogonalize_ref(
        [m.clone() for m in (b["matrices"] if isinstance(b["matrices"], list) else [b["matrices"]])]
    )
    got = r if isinstance(r, list) else [r]
    return all(close(g, e, atol, 1e-3) for g, e in zip(got, ref))


for p in PROVIDERS:
    P = f"ops/orthogonalize/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/matrices_{k}", tk.orthogonalize, _or_base, {"matrices": v}, p)
    _err(f"{P}/matrices_list_of_none", tk.orthogonalize, _or_base, {"matrices": [None]}, p)
    _err(f"{P}/matrix_1d", tk.orthogonalize, _or_base, {"matrices": L(lambda p: rnd(9, p=p))}, p)
    _err(f"{P}/matrix_4d", tk.orthogonalize, _or_base, {"matrices": L(lambda p: rnd(1, 2, 9, 3, p=p))}, p)
    for k, dt in BAD_FLOAT_DTYPES.items():
        _err(f"{P}/matrix_{k}", tk.orthogonalize, _or_base, {"matrices": L(lambda p, dt=dt: rnd(9, 3, p=p).to(dt))}, p)
    _err(
        f"{P}/list_mixed_dtypes",
        tk.orthogonalize,
        _or_base,
        {"matrices": L(lambda p: [rnd(9, 3, p=p), rnd(9, 3, dtype=F64, p=p)])},
        p,
    )
    _err(
        f"{P}/list_mixed_columns",
        tk.orthogonalize,
        _or_base,
        {"matrices": L(lambda p: [rnd(9, 3, p=p), rnd(9, 2, p=p)])},
        p,
    )
    _err(
        f"{P}/list_meta_and_cpu",
        tk.orthogonalize,
        _or_base,
        {"matrices": L(lambda p: [rnd(9, 3, p=p), torch.empty(9, 3, device=META)])},
        p,
    )
    _err(f"{P}/noncontiguous", tk.orthogonalize, _or_base, {"matrices": L(lambda p: rnd(3, 9, p=p).t())}, p)
    _err(
        f"{P}/same_matrix_twice",
        tk.orthogonalize,
        _or_base,
        {"matrices": L(lambda p: (lambda m: [m, m])(rnd(9, 3, p=p)))},
        p,
    )
    _err(
        f"{P}/nan_element",
        tk.orthogonalize,
        _or_base,
        {"matrices": L(lambda p: torch.tensor([[1.0, 2.0], [math.nan, 1.0], [0.0, 3.0]], device=_dev(p)))},
        p,
    )
    for k, v in {"nan": math.nan, "one": 1.0, "negative": -0.1, "str": "1e-4", "bool": True}.items():
        _err(f"{P}/rtol_{k}", tk.orthogonalize, _or_base, {"rtol": v}, p)
    for k, v in {**BAD_INTS, "zero": 0, "billion": 10**9}.items():
        _err(f"{P}/iters_{k}", tk.orthogonalize, _or_base, {"iters": v}, p, timeout=20.0)
    _ok(
        f"{P}/batch",
        tk.orthogonalize,
        lambda p: {"matrices": rnd(2, 9, 3, p=p)},
        {},
        p,
        lambda r, kw, b: all(
            close(r[i], ops.orthogonalize_ref(b["matrices"][i].clone()), 1e-4, 1e-3) for i in range(2)
        ),
        writes=("matrices",),
    )
    _ok(
        f"{P}/list_fp64_rank_deficient",
        tk.orthogonalize,
        lambda p: {
            "matrices": [
                torch.tensor([[1.0, 2.0], [2.0, 4.0], [0.0, 0.0]], dtype=F64, device=_dev(p)),
                rnd(3, 2, dtype=F64, p=p),
            ]
        },
        {},
        p,
        _orv,
        writes=("matrices",),
    )
    _ok(
        f"{P}/max_iters",
        tk.orthogonalize,
        lambda p: {**_or_base(p), "iters": ops.orthogonalize.__globals__["MAX_ITERS"]},
        {},
        p,
        _orv,
        writes=("matrices",),
    )
    _ok(
        f"{P}/batch_rank_deficient",  # issue 41 item 16: the cpu kernel's batch path, zero and dependent columns
        tk.orthogonalize,
        lambda p: {"matrices": (lambda m: (m.__setitem__((..., 1), 0), m.__setitem__((..., 3), m[..., 0] * 2))
                                and m)(rnd(3, 40, 5, p=p))},
        {},
        p,
        lambda r, kw, b: close(r, ops.orthogonalize_ref(b["matrices"].clone()), 1e-4, 1e-3),
        writes=("matrices",),
    )  # fmt: skip
    _ok(
        f"{P}/batch_zero_matrices",
        tk.orthogonalize,
        lambda p: {"matrices": torch.zeros(4, 30, 8, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: bool((r == 0).all()),
        writes=("matrices",),
    )
    _ok(
        f"{P}/list_mixed_heights",
        tk.orthogonalize,
        lambda p: {"matrices": [rnd(16, 4, p=p), rnd(700, 4, seed=1, p=p), rnd(3, 4, seed=2, p=p)]},
        {},
        p,
        _orv,
        writes=("matrices",),
    )
    _ok(
        f"{P}/list_views_odd_offset",
        tk.orthogonalize,
        lambda p: {"matrices": (lambda b: [b[1:121].view(40, 3), b[121:241].view(40, 3)])(rnd(241, p=p))},
        {},
        p,
        _orv,
        writes=("matrices",),
    )
    _ok(
        f"{P}/zero_columns",
        tk.orthogonalize,
        lambda p: {"matrices": torch.empty(5, 0, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: r.shape == (5, 0),
    )
    _ok(
        f"{P}/meta",
        tk.orthogonalize,
        lambda p: {"matrices": torch.empty(9, 3, device=META)},
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (9, 3)),
    )
    _ok(
        f"{P}/meta_with_iters_ok",
        tk.orthogonalize,
        lambda p: {"matrices": torch.empty(2, 9, 3, device=META), "iters": 3},
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (2, 9, 3)),
    )
CASES.append(
    Case(
        "ops/orthogonalize/triton/meta_iters_billion",
        lambda: tk.orthogonalize(torch.empty(9, 3, device=META), iters=10**9, provider="triton"),
    )
)


def _ra_base(p):
    return {"x": rnd(13, p=p), "residual": rnd(13, seed=1, p=p)}


for p in PROVIDERS:
    P = f"ops/residual_add/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/x_{k}", tk.residual_add, _ra_base, {"x": v}, p)
        _err(f"{P}/residual_{k}", tk.residual_add, _ra_base, {"residual": v}, p)
    for k, dt in {"int32": I32, "bool": torch.bool, "complex64": torch.complex64, "fp64": F64}.items():
        _err(f"{P}/x_{k}", tk.residual_add, _ra_base, {"x": L(lambda p, dt=dt: _as(dt)(p).repeat(3)[:13])}, p)
    _err(f"{P}/residual_wrong_size", tk.residual_add, _ra_base, {"residual": L(lambda p: rnd(12, p=p))}, p)
    _err(f"{P}/residual_expanded", tk.residual_add, _ra_base, {"residual": L(lambda p: rnd(1, p=p).expand(13))}, p)
    _err(f"{P}/residual_on_meta", tk.residual_add, _ra_base, {"residual": _meta(13)}, p)
    _err(f"{P}/out_wrong_size", tk.residual_add, _ra_base, {"out": L(lambda p: torch.empty(14, device=_dev(p)))}, p)
    _err(f"{P}/out_int", tk.residual_add, _ra_base, {"out": L(lambda p: torch.empty(13, dtype=I32, device=_dev(p)))}, p)

    def _ra_ov(p):
        buf = rnd(20, p=p)
        return {"x": buf[:13], "residual": rnd(13, seed=1, p=p), "out": buf[5:18]}

    _err(f"{P}/out_overlaps_x_partly", tk.residual_add, _ra_ov, {}, p)
    _err(
        f"{P}/nan_sum",
        tk.residual_add,
        _ra_base,
        {"x": L(lambda p: torch.tensor([math.nan] + [0.0] * 12, device=_dev(p)))},
        p,
    )
    _ok(
        f"{P}/into_residual_fp16_noncontig_x",
        tk.residual_add,
        lambda p: (lambda r: {"x": rnd(13, 2, p=p)[:, 0], "residual": r, "out": r})(rnd(13, seed=1, dtype=F16, p=p)),
        {},
        p,
        lambda r, kw, b: close(r, (b["x"].float() + b["residual"].float()).half(), 1e-3, 1e-3),
        writes=("residual", "out"),
    )
    _ok(
        f"{P}/default_out_requires_grad",
        tk.residual_add,
        lambda p: {**_ra_base(p), "x": rnd(13, p=p).requires_grad_()},
        {},
        p,
        lambda r, kw, b: close(r, b["x"] + b["residual"]) and r.dtype == F32,
    )
    _ok(
        f"{P}/meta",
        tk.residual_add,
        lambda p: {"x": torch.empty(13, device=META), "residual": torch.empty(13, device=META)},
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (13,)),
    )


def _eu_base(p):
    return {"acc": rnd(11, p=p), "approx": rnd(11, seed=1, p=p), "residual": torch.zeros(11, device=_dev(p))}


for p in PROVIDERS:
    P = f"ops/error_update/{p}"
    for name in ("acc", "approx", "residual"):
        for k in ("none", "str", "ndarray"):
            _err(f"{P}/{name}_{k}", tk.error_update, _eu_base, {name: NOT_TENSORS[k]}, p)
        _err(
            f"{P}/{name}_int",
            tk.error_update,
            _eu_base,
            {name: L(lambda p: torch.zeros(11, dtype=I32, device=_dev(p)))},
            p,
        )
        _err(
            f"{P}/{name}_wrong_size", tk.error_update, _eu_base, {name: L(lambda p: torch.zeros(10, device=_dev(p)))}, p
        )
    _err(f"{P}/approx_on_meta", tk.error_update, _eu_base, {"approx": _meta(11)}, p)
    _err(
        f"{P}/residual_strided",
        tk.error_update,
        _eu_base,
        {"residual": L(lambda p: torch.zeros(22, device=_dev(p))[::2])},
        p,
    )
    _err(
        f"{P}/residual_is_approx",
        tk.error_update,
        lambda p: (lambda b: {**b, "residual": b["approx"]})(_eu_base(p)),
        {},
        p,
    )
    _err(f"{P}/out_is_residual", tk.error_update, lambda p: (lambda b: {**b, "out": b["residual"]})(_eu_base(p)), {}, p)
    _err(
        f"{P}/out_overlaps_acc",
        tk.error_update,
        lambda p: (
            lambda buf: {
                "acc": buf[:11],
                "approx": rnd(11, p=p),
                "residual": torch.zeros(11, device=_dev(p)),
                "out": buf[4:15],
            }
        )(rnd(16, p=p)),
        {},
        p,
    )
    _ok(
        f"{P}/residual_is_acc_out_fp16",
        tk.error_update,
        lambda p: (
            lambda a: {
                "acc": a,
                "approx": rnd(11, seed=1, p=p),
                "residual": a,
                "out": torch.empty(11, dtype=F16, device=_dev(p)),
            }
        )(rnd(11, p=p)),
        {},
        p,
        lambda r, kw, b: (
            close(kw["residual"], b["acc"] - b["approx"]) and close(kw["out"], b["approx"].half(), 1e-3, 1e-3)
        ),
        writes=("acc", "residual", "out"),
    )
    _ok(
        f"{P}/strided_inputs",
        tk.error_update,
        lambda p: {
            "acc": rnd(11, 2, p=p)[:, 0],
            "approx": rnd(1, p=p).expand(11),
            "residual": torch.zeros(11, device=_dev(p)),
        },
        {},
        p,
        lambda r, kw, b: r is None and close(kw["residual"], b["acc"] - b["approx"]),
        writes=("residual",),
    )
    _ok(
        f"{P}/meta",
        tk.error_update,
        lambda p: {
            "acc": torch.empty(11, device=META),
            "approx": torch.empty(11, device=META),
            "residual": torch.empty(11, device=META),
        },
        {},
        p,
        lambda r, kw, b: r is None,
    )

for k, v in {
    **NOT_TENSORS,
    "int": L(lambda p: torch.ones(3, dtype=I32)),
    "complex": L(lambda p: torch.ones(3, dtype=torch.complex64)),
}.items():
    _err(f"ops/count_nonfinite/any/v_{k}", ops.count_nonfinite, lambda p: {}, {"v": v}, None)
for dt in (F32, F16, BF16, F64):
    _ok(
        f"ops/count_nonfinite/any/{str(dt)[6:]}_with_nan_inf",
        ops.count_nonfinite,
        lambda p, dt=dt: {"v": torch.tensor([1.0, math.nan, math.inf, -math.inf, 0.0], dtype=dt)[::1]},
        {},
        None,
        lambda r, kw, b: int(r) == 3,
    )
_ok(
    "ops/count_nonfinite/any/meta",
    ops.count_nonfinite,
    lambda p: {"v": torch.empty(5, device=META)},
    {},
    None,
    lambda r, kw, b: is_meta_like(r, (1,), I64),
)
_ok(
    "ops/count_nonfinite/any/huge_finite_sum_overflows",
    ops.count_nonfinite,
    lambda p: {"v": torch.full((4,), 3e38)},
    {},
    None,
    lambda r, kw, b: int(r) == 0,
)


# ==================================================================================================
# offload: pack, unpack, packed_nbytes


def _pk_base(p):
    return {"x": rnd(37, p=p), "fmt": "int8", "block": 8}


for p in PROVIDERS:
    P = f"ops/pack/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/x_{k}", ops.pack, _pk_base, {"x": v}, p)
    for k, dt in {**BAD_FLOAT_DTYPES, "fp64": F64}.items():
        _err(f"{P}/x_{k}", ops.pack, _pk_base, {"x": L(_as(dt))}, p)
    for k, v in {"int4": "int4", "none": None, "upper": "BF16", "dtype": torch.bfloat16}.items():
        _err(f"{P}/fmt_{k}", ops.pack, _pk_base, {"fmt": v}, p)
    for k, v in {**BAD_INTS, "three": 3, "too_big": 2**20}.items():
        _err(f"{P}/block_{k}", ops.pack, _pk_base, {"block": v}, p)
    _err(
        f"{P}/out_too_small",
        ops.pack,
        _pk_base,
        {"out": L(lambda p: torch.empty(40, dtype=torch.uint8, device=_dev(p)))},
        p,
    )
    _err(f"{P}/out_float", ops.pack, _pk_base, {"out": L(lambda p: torch.empty(100, device=_dev(p)))}, p)
    _err(
        f"{P}/out_2d",
        ops.pack,
        _pk_base,
        {"out": L(lambda p: torch.empty(2, 100, dtype=torch.uint8, device=_dev(p)))},
        p,
    )
    _err(
        f"{P}/out_unaligned",
        ops.pack,
        _pk_base,
        {"out": L(lambda p: torch.empty(101, dtype=torch.uint8, device=_dev(p))[1:])},
        p,
    )
    _err(f"{P}/out_str", ops.pack, _pk_base, {"out": "buffer"}, p)
    for fmt in ("bf16", "fp16", "int8"):

        def _pk_ov(p, fmt=fmt):
            x = rnd(64, p=p)
            return {"x": x, "fmt": fmt, "out": x.view(torch.uint8)}

        _err(f"{P}/out_overlaps_input_{fmt}", ops.pack, _pk_ov, {}, p)
    _err(f"{P}/stream_str", ops.pack, _pk_base, {"stream": "s"}, p)
    _err(
        f"{P}/fp16_overflow",
        ops.pack,
        _pk_base,
        {"x": L(lambda p: torch.tensor([1.0, 1e5], device=_dev(p))), "fmt": "fp16"},
        p,
    )
    _err(f"{P}/int8_nan", ops.pack, _pk_base, {"x": L(lambda p: torch.tensor([1.0, math.nan], device=_dev(p)))}, p)
    for fmt in ("bf16", "fp16", "int8"):
        _ok(
            f"{P}/{fmt}_strided_roundtrip",
            lambda **kw: ops.unpack(ops.pack(**kw), provider=kw["provider"]),
            lambda p, fmt=fmt: {"x": rnd(37, 2, p=p)[:, 1], "fmt": fmt, "block": 8},
            {},
            p,
            lambda r, kw, b: close(r, ops.unpack_ref(ops.pack_ref(b["x"], b["fmt"], block=8)), 1e-6, 1e-6),
        )
    _ok(
        f"{P}/zero_size",
        ops.pack,
        lambda p: {"x": torch.empty(0, 3, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: r.shape == (0, 3),
    )
    _ok(
        f"{P}/meta_fp16",
        ops.pack,
        lambda p: {"x": torch.empty(5, device=META), "fmt": "fp16"},
        {},
        p,
        lambda r, kw, b: r.data.is_meta and r.shape == (5,),
    )


def _up_base(p):
    return {"packed": ops.pack_ref(rnd(37, p=p), "int8", block=8)}


def _bad_packed(**changes):
    return L(lambda p: dataclasses.replace(ops.pack_ref(rnd(37, p=p), "int8", block=8), **changes))


for p in PROVIDERS:
    P = f"ops/unpack/{p}"
    for k, v in {**NOT_TENSORS, "tensor": L(lambda p: torch.zeros(60, dtype=torch.uint8))}.items():
        _err(f"{P}/packed_{k}", ops.unpack, _up_base, {"packed": v}, p)
    _err(
        f"{P}/packed_data_too_small",
        ops.unpack,
        _up_base,
        {"packed": _bad_packed(data=torch.zeros(10, dtype=torch.uint8))},
        p,
    )
    _err(f"{P}/packed_shape_larger_than_data", ops.unpack, _up_base, {"packed": _bad_packed(shape=(10**6,))}, p)
    _err(f"{P}/packed_shape_huge", ops.unpack, _up_base, {"packed": _bad_packed(shape=(2**40, 2**40))}, p)
    _err(f"{P}/packed_shape_negative", ops.unpack, _up_base, {"packed": _bad_packed(shape=(-37,))}, p)
    _err(f"{P}/packed_shape_list", ops.unpack, _up_base, {"packed": _bad_packed(shape=[37])}, p)
    _err(f"{P}/packed_fmt_bogus", ops.unpack, _up_base, {"packed": _bad_packed(fmt="int3")}, p)
    _err(f"{P}/packed_block_odd", ops.unpack, _up_base, {"packed": _bad_packed(block=7)}, p)
    _err(f"{P}/packed_dtype_int", ops.unpack, _up_base, {"packed": _bad_packed(dtype=torch.int32)}, p)
    _err(f"{P}/packed_data_float", ops.unpack, _up_base, {"packed": _bad_packed(data=torch.zeros(100))}, p)
    _err(f"{P}/packed_data_list", ops.unpack, _up_base, {"packed": _bad_packed(data=[0] * 100)}, p)
    _err(f"{P}/out_wrong_shape", ops.unpack, _up_base, {"out": L(lambda p: torch.empty(36, device=_dev(p)))}, p)
    _err(f"{P}/out_int", ops.unpack, _up_base, {"out": L(lambda p: torch.empty(37, dtype=I32, device=_dev(p)))}, p)
    _err(f"{P}/out_strided", ops.unpack, _up_base, {"out": L(lambda p: torch.empty(74, device=_dev(p))[::2])}, p)
    _err(f"{P}/accumulate_without_out", ops.unpack, _up_base, {"accumulate": True}, p)
    _err(f"{P}/device_bogus", ops.unpack, _up_base, {"device": "gpu7"}, p)
    _err(f"{P}/device_int_list", ops.unpack, _up_base, {"device": [0]}, p)
    _err(f"{P}/dtype_int", ops.unpack, _up_base, {"dtype": I32}, p)
    _err(
        f"{P}/dtype_disagrees_with_out",
        ops.unpack,
        _up_base,
        {"out": L(lambda p: torch.empty(37, device=_dev(p))), "dtype": F16},
        p,
    )

    def _up_ov2(p):
        pk = ops.pack_ref(rnd(40, p=p), "bf16")
        store = torch.zeros(80, dtype=torch.uint8, device=_dev(p))
        store[:80] = pk.data
        pk = dataclasses.replace(pk, data=store[:80], shape=(20,))
        return {"packed": pk, "out": store[20:60].view(torch.bfloat16), "accumulate": True}

    _err(f"{P}/out_overlaps_packed_data", ops.unpack, _up_ov2, {}, p)
    _ok(
        f"{P}/to_fp16_and_accumulate",
        lambda **kw: ops.unpack(kw["packed"], out=kw["out"], accumulate=True, provider=kw["provider"]),
        lambda p: {**_up_base(p), "out": torch.ones(37, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: close(r, 1 + ops.unpack_ref(b["packed"])),
        writes=("out",),
    )
    _ok(
        f"{P}/data_longer_than_needed",
        ops.unpack,
        lambda p: (
            lambda pk: {"packed": dataclasses.replace(pk, data=torch.cat([pk.data, torch.zeros(9, dtype=torch.uint8)]))}
        )(ops.pack_ref(rnd(37, p=p), "int8", block=8)),
        {},
        p,
        lambda r, kw, b: close(r, ops.unpack_ref(kw["packed"])),
    )

for k, v in {"negative": -1, "str": "3", "bool": True, "float": 2.5}.items():
    CASES.append(Case(f"ops/packed_nbytes/any/numel_{k}", functools.partial(ops.packed_nbytes, v, "int8")))
for k, v in {
    "fmt_bogus": ("int2", 256),
    "block_three": ("int8", 3),
    "block_str": ("int8", "256"),
    "block_huge": ("int8", 2**20),
}.items():
    CASES.append(Case(f"ops/packed_nbytes/any/{k}", functools.partial(ops.packed_nbytes, 100, *v)))
CASES.append(
    Case(
        "ops/packed_nbytes/any/int8_exact",
        functools.partial(ops.packed_nbytes, 100, "int8", 8),
        "ok",
        check=lambda v: v == 112 + 4 * 13,
    )
)


# ==================================================================================================
# MoE: moe_route, moe_permute, moe_unpermute, moe_aux_loss, moe_z_loss, Routing


def _rt_base(p):
    return {"logits": rnd(7, 5, p=p), "k": 2}


for p in PROVIDERS:
    P = f"ops/moe_route/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/logits_{k}", tk.moe_route, _rt_base, {"logits": v}, p)
    for k, dt in {**BAD_FLOAT_DTYPES, "fp64": F64}.items():
        _err(f"{P}/logits_{k}", tk.moe_route, _rt_base, {"logits": L(lambda p, dt=dt: rnd(7, 5, p=p).to(dt))}, p)
    _err(f"{P}/logits_1d", tk.moe_route, _rt_base, {"logits": L(lambda p: rnd(5, p=p))}, p)
    _err(f"{P}/logits_3d", tk.moe_route, _rt_base, {"logits": L(lambda p: rnd(2, 7, 5, p=p))}, p)
    _err(f"{P}/no_experts", tk.moe_route, _rt_base, {"logits": L(lambda p: rnd(7, 0, p=p)), "k": 1}, p)
    for kk, v in {**BAD_INTS, "zero": 0, "above_E": 6}.items():
        _err(f"{P}/k_{kk}", tk.moe_route, _rt_base, {"k": v}, p)
    for kk, v in {"bogus": "relu", "none": None, "upper": "SOFTMAX"}.items():
        _err(f"{P}/score_{kk}", tk.moe_route, _rt_base, {"score": v}, p)
        _err(f"{P}/drop_policy_{kk}", tk.moe_route, _rt_base, {"drop_policy": v, "capacity_factor": 1.0}, p)
    for kk, v in {
        "inf": math.inf,
        "nan": math.nan,
        "negative": -1.0,
        "zero": 0.0,
        "bool": True,
        "str": "1.0",
        "list": [1.0],
    }.items():
        _err(f"{P}/capacity_factor_{kk}", tk.moe_route, _rt_base, {"capacity_factor": v}, p)
    _err(
        f"{P}/nan_logits",
        tk.moe_route,
        _rt_base,
        {"logits": L(lambda p: rnd(7, 5, p=p).index_fill_(0, torch.tensor([3], device=_dev(p)), math.nan))},
        p,
    )
    _err(f"{P}/meta_with_capacity", tk.moe_route, _rt_base, {"logits": _meta(7, 5), "capacity_factor": 1.0}, p)

    def _rtv(cf_ref=None):
        def verify(r, kw, b):
            ref = M.moe_route_ref(
                b["logits"],
                k=kw["k"],
                score=kw.get("score", "softmax"),
                capacity_factor=cf_ref if cf_ref is not None else kw.get("capacity_factor"),
                drop_policy=kw.get("drop_policy", "probability"),
            )
            return (
                torch.equal(r.indices.cpu(), ref.indices.cpu())
                and torch.equal(r.row_map.cpu(), ref.row_map.cpu())
                and torch.equal(r.token_index.cpu(), ref.token_index.cpu())
                and close(r.weights, ref.weights, 1e-5, 1e-5)
                and r.num_rows == ref.num_rows
            )

        return verify

    _ok(
        f"{P}/capacity_factor_1e300_clamps",
        tk.moe_route,
        _rt_base,
        {"capacity_factor": 1e300},
        p,
        lambda r, kw, b: r.capacity == 7 * 2 and r.num_rows == 14 and _rtv()(r, kw, b),
    )
    _ok(
        f"{P}/capacity_factor_tiny",
        tk.moe_route,
        _rt_base,
        {"capacity_factor": 1e-300, "drop_policy": "position"},
        p,
        lambda r, kw, b: r.capacity == 1 and _rtv()(r, kw, b),
    )
    _ok(f"{P}/capacity_factor_int", tk.moe_route, _rt_base, {"capacity_factor": 1}, p, _rtv())
    _ok(
        f"{P}/k_equals_E_sigmoid_fp16",
        tk.moe_route,
        lambda p: {"logits": rnd(7, 5, dtype=F16, p=p), "k": 5, "score": "sigmoid"},
        {},
        p,
        _rtv(),
    )
    _ok(
        f"{P}/noncontiguous_requires_grad",
        tk.moe_route,
        lambda p: {"logits": rnd(5, 7, p=p).t().requires_grad_(), "k": 2},
        {},
        p,
        lambda r, kw, b: _rtv()(r, kw, b) and r.weights.requires_grad,
    )
    _ok(
        f"{P}/zero_tokens",
        tk.moe_route,
        lambda p: {"logits": torch.empty(0, 5, device=_dev(p)), "k": 2},
        {},
        p,
        lambda r, kw, b: r.num_rows == 0 and r.indices.shape == (0, 2),
    )
    _ok(
        f"{P}/meta",
        tk.moe_route,
        lambda p: {"logits": torch.empty(7, 5, device=META), "k": 2},
        {},
        p,
        lambda r, kw, b: r.row_map.is_meta and r.num_rows == 14,
    )


def _routing(p, T=7, E=5, k=2, cf=None):
    return tk.moe_route(rnd(T, E, seed=9, p=p), k=k, capacity_factor=cf, provider="torch")


def _edit(field, fn):
    """A routing from moe_route whose ``field`` was changed (a new tensor: the Routing is rebuilt)."""

    def make(p):
        r = _routing(p, cf=1.0)
        return dataclasses.replace(r, **{field: fn(getattr(r, field).clone(), r)})

    return L(make)


def _inplace(field, fn):
    """A routing from moe_route whose ``field`` was edited in place after it was made (and used once)."""

    def make(p):
        r = _routing(p, cf=1.0)
        tk.moe_permute(rnd(7, 3, p=p), r, provider="torch")
        with torch.no_grad():
            fn(getattr(r, field), r)
        return r

    return L(make)


def _swapped(field, fn):
    def make(p):
        r = _routing(p, cf=1.0)
        tk.moe_permute(rnd(7, 3, p=p), r, provider="torch")
        object.__setattr__(r, field, fn(getattr(r, field).clone(), r))
        return r

    return L(make)


def _set(i, v):
    def f(t, r):
        t.view(-1)[i] = v
        return t

    return f


BAD_ROUTINGS = {
    "row_map_out_of_range": _edit("row_map", _set(0, 10**6)),
    "row_map_below_minus_one": _edit("row_map", _set(1, -5)),
    "row_map_repeats_a_row": _edit("row_map", lambda t, r: t.masked_fill_(t == t.max(), 0)),
    "row_map_int32": _edit("row_map", lambda t, r: t.int()),
    "row_map_wrong_shape": _edit("row_map", lambda t, r: t.reshape(-1)),
    "row_map_noncontiguous": _edit("row_map", lambda t, r: t.t().contiguous().t()),
    "row_map_on_meta": _edit("row_map", lambda t, r: t.to(META)),
    "token_index_out_of_range": _edit("token_index", _set(0, 10**6)),
    "token_index_negative": _edit("token_index", _set(2, -1)),
    "token_index_not_inverse": _edit("token_index", lambda t, r: t.flip(0)),
    "token_index_float": _edit("token_index", lambda t, r: t.float()),
    "indices_out_of_range": _edit("indices", _set(0, 99)),
    "indices_not_matching_groups": _edit("indices", lambda t, r: (t + 1) % r.num_experts),
    "weights_fp16": _edit("weights", lambda t, r: t.half()),
    "weights_list": _edit("weights", lambda t, r: t.tolist()),
    "dropped_disagrees": _edit("dropped", lambda t, r: ~t),
    "tokens_per_expert_wrong": _edit("tokens_per_expert", lambda t, r: t.flip(0) + 1),
    "num_rows_too_big": L(lambda p: dataclasses.replace(_routing(p), num_rows=10**9)),
    "num_rows_str": L(lambda p: dataclasses.replace(_routing(p), num_rows="14")),
    "num_experts_zero": L(lambda p: dataclasses.replace(_routing(p), num_experts=0)),
    "score_bogus": L(lambda p: dataclasses.replace(_routing(p), score="relu")),
    "capacity_negative": L(lambda p: dataclasses.replace(_routing(p), capacity=-1)),
    "row_map_edited_in_place": _inplace("row_map", lambda t, r: t.view(-1).__setitem__(0, 10**6)),
    "token_index_edited_in_place": _inplace("token_index", lambda t, r: t.__setitem__(0, 10**6)),
    "indices_edited_in_place": _inplace("indices", lambda t, r: t.view(-1).__setitem__(0, 99)),
    "indices_swapped_after_use": _swapped("indices", lambda t, r: t.fill_(99)),
    "row_map_swapped_after_use": _swapped("row_map", lambda t, r: t.fill_(10**6)),
    "token_index_swapped_after_use": _swapped("token_index", lambda t, r: t.fill_(10**6)),
    "not_a_routing_tuple": L(lambda p: tuple(dataclasses.astuple(_routing(p))[:7])),
    "not_a_routing_none": None,
    "not_a_routing_indices": L(lambda p: _routing(p).indices),
}


_EXPERT_EDITS = ("indices_edited_in_place", "indices_swapped_after_use")


def _pm_base(p):
    return {"x": rnd(7, 3, p=p), "routing": _routing(p, cf=1.0)}


def _um_base(p):
    r = _routing(p, cf=1.0)
    return {"y_perm": rnd(r.num_rows, 3, p=p), "routing": r}


for p in PROVIDERS:
    for op, fn, base in (("moe_permute", tk.moe_permute, _pm_base), ("moe_unpermute", tk.moe_unpermute, _um_base)):
        P = f"ops/{op}/{p}"
        xname = "x" if op == "moe_permute" else "y_perm"
        for k, v in BAD_ROUTINGS.items():
            if k in _EXPERT_EDITS:  # (the permute and unpermute do not read indices: a sealed routing stays trusted)
                continue
            _err(f"{P}/{k}", fn, base, {"routing": v}, p)
        for k, v in NOT_TENSORS.items():
            _err(f"{P}/{xname}_{k}", fn, base, {xname: v}, p)
        _err(f"{P}/{xname}_wrong_rows", fn, base, {xname: L(lambda p: rnd(6, 3, p=p))}, p)
        _err(f"{P}/{xname}_1d", fn, base, {xname: L(lambda p: rnd(7, p=p))}, p)
        _err(f"{P}/{xname}_int", fn, base, {xname: L(lambda p, b=base, n=xname: b(p)[n].long())}, p)
        _err(
            f"{P}/{xname}_on_meta",
            fn,
            base,
            {xname: L(lambda p, b=base, n=xname: torch.empty(b(p)[n].shape, device=META))},
            p,
        )

    def _pmv(r, kw, b):
        return close(r, M.moe_permute_ref(b["x"], kw["routing"]))

    def _umv(weights=True):
        return lambda r, kw, b: close(r, M.moe_unpermute_ref(b["y_perm"], kw["routing"], weights=weights), 1e-5, 1e-5)

    _ok(
        f"ops/moe_permute/{p}/rebuilt_equal_routing",
        tk.moe_permute,
        lambda p: {"x": rnd(7, 3, p=p), "routing": dataclasses.replace(_routing(p, cf=1.0))},
        {},
        p,
        _pmv,
    )
    _ok(
        f"ops/moe_permute/{p}/unpickled_routing",
        tk.moe_permute,
        lambda p: {"x": rnd(7, 3, p=p), "routing": pickle.loads(pickle.dumps(_routing(p, cf=0.6)))},
        {},
        p,
        _pmv,
    )
    _ok(
        f"ops/moe_permute/{p}/noncontiguous_x_requires_grad",
        tk.moe_permute,
        lambda p: {"x": rnd(3, 7, p=p).t().requires_grad_(), "routing": _routing(p)},
        {},
        p,
        lambda r, kw, b: _pmv(r, kw, b) and r.requires_grad,
    )
    _ok(
        f"ops/moe_permute/{p}/ref_routing",
        tk.moe_permute,
        lambda p: {"x": rnd(7, 3, p=p), "routing": M.moe_route_ref(rnd(7, 5, p=p), k=2, capacity_factor=0.8)},
        {},
        p,
        _pmv,
    )
    _ok(
        f"ops/moe_permute/{p}/meta",
        tk.moe_permute,
        lambda p: {"x": torch.empty(7, 3, device=META), "routing": tk.moe_route(torch.empty(7, 5, device=META), k=2)},
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (14, 3)),
    )
    _ok(
        f"ops/moe_unpermute/{p}/rebuilt_equal_routing_no_weights",
        tk.moe_unpermute,
        lambda p: (lambda r: {"y_perm": rnd(r.num_rows, 3, p=p), "routing": dataclasses.replace(r), "weights": False})(
            _routing(p, cf=1.0)
        ),
        {},
        p,
        _umv(False),
    )
    _ok(
        f"ops/moe_unpermute/{p}/fp16_rows_with_drops",
        tk.moe_unpermute,
        lambda p: (lambda r: {"y_perm": rnd(r.num_rows, 3, dtype=F16, p=p), "routing": r})(_routing(p, cf=0.5)),
        {},
        p,
        lambda r, kw, b: close(r, M.moe_unpermute_ref(b["y_perm"], kw["routing"]), 2e-3, 2e-3),
    )
    _ok(
        f"ops/moe_unpermute/{p}/meta",
        tk.moe_unpermute,
        lambda p: {
            "y_perm": torch.empty(14, 3, device=META),
            "routing": tk.moe_route(torch.empty(7, 5, device=META), k=2),
        },
        {},
        p,
        lambda r, kw, b: is_meta_like(r, (7, 3)),
    )


def _al_base(p):
    lg = rnd(7, 5, seed=9, p=p)
    return {"logits_or_probs": lg, "routing": tk.moe_route(lg, k=2, provider="torch")}


for p in PROVIDERS:
    P = f"ops/moe_aux_loss/{p}"
    for k in ("none", "str", "list"):
        _err(f"{P}/logits_{k}", tk.moe_aux_loss, _al_base, {"logits_or_probs": NOT_TENSORS[k]}, p)
    _err(f"{P}/logits_wrong_shape", tk.moe_aux_loss, _al_base, {"logits_or_probs": L(lambda p: rnd(7, 4, p=p))}, p)
    _err(
        f"{P}/logits_int",
        tk.moe_aux_loss,
        _al_base,
        {"logits_or_probs": L(lambda p: torch.zeros(7, 5, dtype=I64, device=_dev(p)))},
        p,
    )
    _err(f"{P}/logits_on_meta", tk.moe_aux_loss, _al_base, {"logits_or_probs": _meta(7, 5)}, p)
    for k in ("indices_out_of_range", "row_map_out_of_range", "not_a_routing_none", "weights_fp16", "score_bogus",
              *_EXPERT_EDITS):  # fmt: skip
        _err(f"{P}/{k}", tk.moe_aux_loss, _al_base, {"routing": BAD_ROUTINGS[k]}, p)
    P = f"ops/moe_z_loss/{p}"
    for k, v in NOT_TENSORS.items():
        _err(f"{P}/logits_{k}", tk.moe_z_loss, lambda p: {}, {"logits": v}, p)
    _err(f"{P}/logits_1d", tk.moe_z_loss, lambda p: {}, {"logits": L(lambda p: rnd(5, p=p))}, p)
    _err(f"{P}/logits_int", tk.moe_z_loss, lambda p: {}, {"logits": L(lambda p: torch.ones(3, 5, dtype=I32))}, p)
    if p in ("triton", "numba"):  # the losses run on the cpu and torch providers only (docs/ops.md)
        _err(f"ops/moe_aux_loss/{p}/provider_without_a_loss_kernel", tk.moe_aux_loss, _al_base, {}, p)
        _err(
            f"ops/moe_z_loss/{p}/provider_without_a_loss_kernel",
            tk.moe_z_loss,
            lambda p: {"logits": rnd(7, 5, p=p)},
            {},
            p,
        )
        continue
    _ok(
        f"ops/moe_aux_loss/{p}/matches_reference",
        tk.moe_aux_loss,
        _al_base,
        {},
        p,
        lambda r, kw, b: close(r, M.moe_aux_loss_ref(b["logits_or_probs"], kw["routing"]), 1e-5, 1e-5),
    )
    _ok(
        f"ops/moe_aux_loss/{p}/zero_tokens_is_zero",
        tk.moe_aux_loss,
        lambda p: (lambda lg: {"logits_or_probs": lg, "routing": tk.moe_route(lg, k=2)})(
            torch.empty(0, 5, device=_dev(p))
        ),
        {},
        p,
        lambda r, kw, b: float(r) == 0.0,
    )
    _ok(
        f"ops/moe_aux_loss/{p}/meta",
        tk.moe_aux_loss,
        lambda p: (lambda lg: {"logits_or_probs": lg, "routing": tk.moe_route(lg, k=2)})(
            torch.empty(7, 5, device=META)
        ),
        {},
        p,
        lambda r, kw, b: is_meta_like(r, ()),
    )
    P = f"ops/moe_z_loss/{p}"
    _ok(
        f"{P}/requires_grad",
        tk.moe_z_loss,
        lambda p: {"logits": rnd(7, 5, p=p).requires_grad_()},
        {},
        p,
        lambda r, kw, b: close(r, M.moe_z_loss_ref(b["logits"]), 1e-5, 1e-5) and r.requires_grad,
    )
    _ok(
        f"{P}/zero_tokens_is_zero",
        tk.moe_z_loss,
        lambda p: {"logits": torch.empty(0, 5, device=_dev(p))},
        {},
        p,
        lambda r, kw, b: float(r) == 0.0,
    )
    _ok(
        f"{P}/meta",
        tk.moe_z_loss,
        lambda p: {"logits": torch.empty(7, 5, device=META)},
        {},
        p,
        lambda r, kw, b: is_meta_like(r, ()),
    )


# ==================================================================================================
# MoE routing options (issue 25): moe_route's score_bias, n_group / topk_group, scaling, capacity,
# capacity_scope / sequence_lengths and pad_to_capacity; padded permute and unpermute; moe_aux_loss's scale
# and groups. Accepted inputs are compared field by field with moe_route_ref (and, where an option has an
# equivalent plain form, with that: one sequence as the call scope, capacity_factor as its integer capacity,
# one group of all tokens as no groups, a group's loss as the loss of its tokens routed alone).

_ROUTE_ARGS = ("k", "score", "renormalize", "score_bias", "n_group", "topk_group", "scaling", "capacity_factor",
               "drop_policy", "capacity", "capacity_scope", "sequence_lengths", "pad_to_capacity")  # fmt: skip
_ROUTING_INTS = ("indices", "row_map", "token_index", "tokens_per_expert", "dropped", "rows_per_expert")


def _same_routing(r, ref, atol: float = 1e-5) -> bool:
    """Every field of two routings equal (the weights and scores within ``atol``)."""
    return (
        all(torch.equal(getattr(r, f).cpu(), getattr(ref, f).cpu()) for f in _ROUTING_INTS)
        and close(r.weights, ref.weights, atol, atol)
        and close(r.scores, ref.scores, atol, atol)
        and (r.num_rows, r.capacity, r.sequence_lengths, r.sequence_capacity, r.padded, r.num_experts, r.score)
        == (ref.num_rows, ref.capacity, ref.sequence_lengths, ref.sequence_capacity, ref.padded, ref.num_experts,
            ref.score)
    )  # fmt: skip


def _route_ref_of(b: dict):
    return M.moe_route_ref(b["logits"], **{n: b[n] for n in _ROUTE_ARGS if n in b})


def _rt_ref(extra=lambda r, kw, b: True, atol: float = 1e-5):
    """verify: the routing equals moe_route_ref's of the same arguments, and ``extra`` holds."""
    return lambda r, kw, b: _same_routing(r, _route_ref_of(b), atol) and bool(extra(r, kw, b))


def _rt_same_as(**other):
    """verify: the routing equals moe_route's (torch provider) of the same logits with ``other`` arguments
    replacing the case's (the option's plain equivalent)."""

    def verify(r, kw, b):
        args = {n: b[n] for n in _ROUTE_ARGS if n in b and n not in other}
        args.update({n: v for n, v in other.items() if v is not None})
        return _same_routing(r, tk.moe_route(b["logits"], **args, provider="torch"))

    return verify


def _in_kept_groups(r, kw, b) -> bool:
    """Each token's K experts lie in at most topk_group of the n_group groups."""
    size = r.num_experts // kw["n_group"]
    g = (r.indices // size).cpu()
    return all(len(set(row.tolist())) <= kw["topk_group"] for row in g)


def _grouped(r, kw, b) -> bool:
    """The chosen experts lie in the kept groups, and the groups changed some token's choice (the data tests
    the grouped selection: without groups the route differs)."""
    plain = {n: b[n] for n in _ROUTE_ARGS if n in b and n not in ("n_group", "topk_group")}
    return _in_kept_groups(r, kw, b) and not torch.equal(
        r.indices.cpu(), M.moe_route_ref(b["logits"], **plain).indices.cpu()
    )


def _grp_base(p):
    return {"logits": rnd(9, 8, seed=5, p=p), "k": 2, "n_group": 4, "topk_group": 2}


def _seq_base(p):
    return {"logits": rnd(7, 5, seed=5, p=p), "k": 2, "capacity_factor": 1.0, "capacity_scope": "sequence",
            "sequence_lengths": [3, 0, 4]}  # fmt: skip


def _bias(E: int = 5, seed: int = 3, dtype=F32):
    return L(lambda p: rnd(E, seed=seed, p=p, scale=0.3).to(dtype))


def _bias_with(v):
    return L(lambda p: rnd(5, seed=3, p=p, scale=0.3).index_fill_(0, torch.tensor([2], device=_dev(p)), v))


def _route_bias_nan_after_update(p: str):
    """A bias that routed once (found finite), then set to NaN in place: the next route must see it."""
    bias = rnd(5, seed=3, p=p, scale=0.3)
    tk.moe_route(rnd(7, 5, p=p), k=2, score_bias=bias, provider=p)
    bias[1] = math.nan
    return tk.moe_route(rnd(7, 5, p=p), k=2, score_bias=bias, provider=p)


def _route_bias_requires_grad(p: str):
    """A bias that requires grad: the weights' gradient reaches the logits as moe_route_ref's does and none
    reaches the bias (the bias is for the selection only)."""
    logits = rnd(7, 5, p=p).requires_grad_()
    bias = rnd(5, seed=3, p=p, scale=0.3).requires_grad_()
    r = tk.moe_route(logits, k=2, score_bias=bias, scaling=2.0, provider=p)
    g = rnd(7, 2, seed=8, p=p)
    (r.weights * g).sum().backward()
    lr = logits.detach().clone().requires_grad_()
    ref = M.moe_route_ref(lr, k=2, score_bias=bias.detach(), scaling=2.0)
    (ref.weights * g).sum().backward()
    return (
        _same_routing(r, ref)
        and (bias.grad is None or not bool(bias.grad.any()))
        and close(logits.grad, lr.grad, 1e-5, 1e-5)
    )


def _seq_bad(v):
    return {"sequence_lengths": v}


for p in PROVIDERS:
    P = f"ops/moe_route/{p}"
    # -- score_bias
    for k, v in NOT_TENSORS.items():
        if k != "none":  # (None: no bias, the default)
            _err(f"{P}/score_bias_{k}", tk.moe_route, _rt_base, {"score_bias": v}, p)
    for k, dt in {"fp16": F16, "bf16": BF16, "fp64": F64, "int64": I64, "int32": I32}.items():
        _err(f"{P}/score_bias_{k}", tk.moe_route, _rt_base, {"score_bias": _bias(dtype=dt)}, p)
    _err(f"{P}/score_bias_bool", tk.moe_route, _rt_base, {"score_bias": L(lambda p: rnd(5, p=p) > 0)}, p)
    for k, shape in {"short": (4,), "long": (6,), "row": (1, 5), "column": (5, 1)}.items():
        _err(f"{P}/score_bias_{k}", tk.moe_route, _rt_base, {"score_bias": L(lambda p, s=shape: rnd(*s, p=p))}, p)
    _err(f"{P}/score_bias_scalar", tk.moe_route, _rt_base, {"score_bias": L(lambda p: torch.tensor(0.1))}, p)
    _err(f"{P}/score_bias_on_meta", tk.moe_route, _rt_base, {"score_bias": _meta(5)}, p)
    _err(f"{P}/score_bias_host_beside_meta_logits", tk.moe_route, _rt_base,
         {"logits": _meta(7, 5), "score_bias": _bias()}, p)  # fmt: skip
    for k, v in {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.items():
        _err(f"{P}/score_bias_{k}", tk.moe_route, _rt_base, {"score_bias": _bias_with(v)}, p)
    CASES.append(Case(f"{P}/score_bias_nan_after_an_inplace_update",
                      functools.partial(_route_bias_nan_after_update, p)))  # fmt: skip
    # -- n_group / topk_group
    for kk, v in {**BAD_INTS, "zero": 0, "not_dividing_E": 3, "above_E": 16}.items():
        if kk == "none":
            continue  # (n_group=None: only topk_group given, below)
        _err(f"{P}/n_group_{kk}", tk.moe_route, _grp_base, {"n_group": v}, p)
    for kk, v in {**BAD_INTS, "zero": 0, "above_n_group": 5}.items():
        if kk == "none":
            continue
        _err(f"{P}/topk_group_{kk}", tk.moe_route, _grp_base, {"topk_group": v}, p)
    _err(f"{P}/n_group_without_topk_group", tk.moe_route, _grp_base, {"topk_group": None}, p)
    _err(f"{P}/topk_group_without_n_group", tk.moe_route, _grp_base, {"n_group": None}, p)
    _err(f"{P}/k_above_the_kept_groups", tk.moe_route, _grp_base, {"k": 5}, p)
    _err(f"{P}/k_above_one_expert_groups", tk.moe_route, _grp_base, {"n_group": 8, "topk_group": 1}, p)
    _err(f"{P}/n_group_of_a_meta_call", tk.moe_route, _grp_base, {"logits": _meta(9, 8), "n_group": 3}, p)
    # -- scaling
    for kk, v in {"zero": 0.0, "int_zero": 0, "negative": -1.0, "nan": math.nan, "inf": math.inf,
                  "-inf": -math.inf, "bool": True, "str": "2.0", "none": None, "list": [2.0], "complex": 2j,
                  "huge_int": 10**400, "tensor": L(lambda p: torch.tensor(2.0))}.items():  # fmt: skip
        _err(f"{P}/scaling_{kk}", tk.moe_route, _rt_base, {"scaling": v}, p)
    # -- capacity
    for kk, v in {"negative": -1, "bool": True, "float": 2.0, "str": "2", "list": [2], "np_float": np.float64(2.0),
                  "tensor": L(lambda p: torch.tensor(2))}.items():  # fmt: skip
        _err(f"{P}/capacity_{kk}", tk.moe_route, _rt_base, {"capacity": v}, p)
    _err(f"{P}/capacity_with_capacity_factor", tk.moe_route, _rt_base, {"capacity": 2, "capacity_factor": 1.0}, p)
    _err(f"{P}/capacity_0_with_capacity_factor", tk.moe_route, _rt_base, {"capacity": 0, "capacity_factor": 1.0}, p)
    _err(f"{P}/meta_with_fixed_capacity", tk.moe_route, _rt_base, {"logits": _meta(7, 5), "capacity": 2}, p)
    # -- capacity_scope and sequence_lengths
    for kk, v in {"unknown": "batch", "upper": "SEQUENCE", "none": None, "int": 1, "list": ["call"]}.items():
        _err(f"{P}/capacity_scope_{kk}", tk.moe_route, _rt_base, {"capacity_scope": v, "capacity": 2}, p)
        _err(f"{P}/capacity_scope_{kk}_without_capacity", tk.moe_route, _rt_base, {"capacity_scope": v}, p)
    _err(f"{P}/sequence_scope_without_sequence_lengths", tk.moe_route, _seq_base, {"sequence_lengths": None}, p)
    _err(f"{P}/sequence_scope_without_capacity", tk.moe_route, _seq_base, {"capacity_factor": None}, p)
    _err(f"{P}/sequence_lengths_with_call_scope", tk.moe_route, _seq_base, {"capacity_scope": "call"}, p)
    _err(f"{P}/sequence_lengths_alone", tk.moe_route, _rt_base, {"sequence_lengths": [7]}, p)
    _err(f"{P}/sequence_scope_with_capacity_and_factor", tk.moe_route, _seq_base, {"capacity": 1}, p)
    for kk, v in {
        "sum_below_T": [3, 3],
        "sum_above_T": [3, 5],
        "empty": [],
        "negative": [8, -1],
        "float_entry": [3.0, 4],
        "bool_entry": [True, 6],
        "none_entry": [None, 7],
        "str": "34",
        "int": 7,
        "set": {3, 4},
        "ndarray": np.array([3, 4]),
        "nested": [[3, 4]],
        "tensor_fp32": L(lambda p: torch.tensor([3.0, 4.0])),
        "tensor_bool": L(lambda p: torch.tensor([True, True])),
        "tensor_2d": L(lambda p: torch.tensor([[3, 4]])),
        "tensor_0d": L(lambda p: torch.tensor(7)),
        "tensor_meta": L(lambda p: torch.empty(2, dtype=I64, device=META)),
        "tensor_negative": L(lambda p: torch.tensor([8, -1])),
        "tensor_sum_wrong": L(lambda p: torch.tensor([3, 3], dtype=I32)),
    }.items():
        _err(f"{P}/sequence_lengths_{kk}", tk.moe_route, _seq_base, _seq_bad(v), p)
    # -- pad_to_capacity
    for kk, v in {"int": 1, "str": "yes", "none": None, "np_bool": np.bool_(True),
                  "tensor": L(lambda p: torch.tensor(True))}.items():  # fmt: skip
        _err(f"{P}/pad_to_capacity_{kk}", tk.moe_route, _rt_base, {"pad_to_capacity": v, "capacity": 2}, p)
    _err(f"{P}/pad_to_capacity_without_capacity", tk.moe_route, _rt_base, {"pad_to_capacity": True}, p)
    _err(f"{P}/pad_to_capacity_sequence_scope_without_capacity", tk.moe_route, _seq_base,
         {"pad_to_capacity": True, "capacity_factor": None}, p)  # fmt: skip
    _err(f"{P}/pad_to_capacity_larger_than_memory", tk.moe_route, _rt_base,
         {"pad_to_capacity": True, "capacity": 2**60}, p)  # fmt: skip

    # -- accepted: each option against the reference
    _ok(f"{P}/score_bias_matches_reference", tk.moe_route, _rt_base, {"score_bias": _bias()}, p, _rt_ref())
    _ok(f"{P}/score_bias_changes_the_selection_not_the_weights", tk.moe_route, _rt_base,
        {"score_bias": L(lambda p: torch.tensor([0.0, 0.0, 0.0, 0.0, 9.0], device=_dev(p)))}, p,
        _rt_ref(lambda r, kw, b: bool((r.indices[:, 0] == 4).all())
                and close(r.scores[:, 0], torch.softmax(b["logits"].float(), -1)[:, 4])))  # fmt: skip
    _ok(f"{P}/score_bias_sigmoid_unnormalised", tk.moe_route, _rt_base,
        {"score_bias": _bias(), "score": "sigmoid", "renormalize": False}, p, _rt_ref())  # fmt: skip
    # sigmoid scores that underflow to 0 (a collapsed router, logits below about -88; issue 41, item 3): the
    # rule on every provider is weights 0 (ZeroDivisionError on cpu, NaN on torch before), the reference's
    for nm, extra in (("", {}), ("_with_bias", {"score_bias": _bias()}), ("_unnormalised", {"renormalize": False})):
        _ok(f"{P}/sigmoid_scores_underflow{nm}", tk.moe_route, _rt_base,
            {"logits": L(lambda p: torch.full((7, 5), -100.0, device=_dev(p))), "score": "sigmoid", **extra}, p,
            _rt_ref(lambda r, kw, b: bool((r.weights == 0).all())))  # fmt: skip
    _ok(f"{P}/score_bias_strided_view", tk.moe_route, _rt_base,
        {"score_bias": L(lambda p: rnd(10, seed=3, p=p, scale=0.3)[::2])}, p, _rt_ref())  # fmt: skip
    _ok(f"{P}/score_bias_zero_equals_no_bias", tk.moe_route, _rt_base,
        {"score_bias": L(lambda p: torch.zeros(5, device=_dev(p)))}, p, _rt_same_as(score_bias=None))  # fmt: skip
    for name, dt, tol in (("fp16", F16, 2e-3), ("bf16", BF16, 1e-2)):
        _ok(f"{P}/score_bias_{name}_logits", tk.moe_route,
            lambda p, dt=dt: {"logits": rnd(7, 5, dtype=dt, p=p), "k": 2, "score_bias": _bias().f(p)}, {}, p,
            _rt_ref(atol=tol))  # fmt: skip
    _ok(f"{P}/score_bias_zero_tokens", tk.moe_route,
        lambda p: {"logits": torch.empty(0, 5, device=_dev(p)), "k": 2, "score_bias": _bias().f(p)}, {}, p,
        lambda r, kw, b: r.num_rows == 0 and r.indices.shape == (0, 2))  # fmt: skip
    _ok(f"{P}/score_bias_meta", tk.moe_route,
        lambda p: {"logits": _m(7, 5), "k": 2, "score_bias": _m(5)}, {}, p,
        lambda r, kw, b: r.row_map.is_meta and r.num_rows == 14)  # fmt: skip
    CASES.append(Case(f"{P}/score_bias_requires_grad", functools.partial(_route_bias_requires_grad, p), "ok",
                      check=lambda v: v is True, timeout=60.0))  # fmt: skip
    _ok(f"{P}/groups_match_reference", tk.moe_route, _grp_base, {}, p, _rt_ref(_grouped))
    _ok(f"{P}/groups_deepseek_v3_like", tk.moe_route, _grp_base,
        {"score": "sigmoid", "score_bias": _bias(8), "scaling": 2.5, "k": 3}, p, _rt_ref(_grouped))  # fmt: skip
    _ok(f"{P}/groups_k_equals_the_kept_experts", tk.moe_route, _grp_base, {"k": 4}, p, _rt_ref(_grouped))
    _ok(f"{P}/groups_of_one_expert_equal_no_groups", tk.moe_route, _grp_base,
        {"n_group": 8, "topk_group": 3, "k": 3}, p, _rt_same_as(n_group=None, topk_group=None))  # fmt: skip
    _ok(f"{P}/groups_one_group_equals_no_groups", tk.moe_route, _grp_base, {"n_group": 1, "topk_group": 1}, p,
        _rt_same_as(n_group=None, topk_group=None))  # fmt: skip
    _ok(f"{P}/groups_all_kept_equals_no_groups", tk.moe_route, _grp_base, {"n_group": 4, "topk_group": 4}, p,
        _rt_same_as(n_group=None, topk_group=None))  # fmt: skip
    _ok(f"{P}/groups_bf16_with_capacity", tk.moe_route,
        lambda p: {**_grp_base(p), "logits": rnd(9, 8, seed=5, dtype=BF16, p=p), "capacity": 2}, {}, p,
        _rt_ref(_grouped, atol=1e-2))  # fmt: skip
    _ok(f"{P}/scaling_matches_reference", tk.moe_route, _rt_base, {"scaling": 2.5}, p, _rt_ref())
    _ok(f"{P}/scaling_int", tk.moe_route, _rt_base, {"scaling": 3}, p,
        _rt_ref(lambda r, kw, b: close(r.weights.sum(1), torch.full((7,), 3.0))))  # fmt: skip
    _ok(f"{P}/scaling_sigmoid_unnormalised", tk.moe_route, _rt_base,
        {"scaling": 0.5, "score": "sigmoid", "renormalize": False}, p, _rt_ref())  # fmt: skip
    for pol in M.DROP_POLICIES:
        _ok(f"{P}/capacity_2_{pol}", tk.moe_route, _rt_base, {"capacity": 2, "drop_policy": pol}, p,
            _rt_ref(lambda r, kw, b: int(r.tokens_per_expert.max()) <= 2 and r.num_dropped > 0))  # fmt: skip
        _ok(f"{P}/capacity_equals_its_factor_{pol}", tk.moe_route, _rt_base,
            {"capacity": M.expert_capacity(7, 2, 5, 0.8), "drop_policy": pol}, p,
            _rt_same_as(capacity=None, capacity_factor=0.8))  # fmt: skip
        _ok(f"{P}/sequence_factor_{pol}", tk.moe_route, _seq_base, {"drop_policy": pol}, p,
            _rt_ref(lambda r, kw, b: r.sequence_capacity == (2, 0, 2) and r.num_dropped > 0))  # fmt: skip
        _ok(f"{P}/sequence_one_equals_call_{pol}", tk.moe_route, _seq_base,
            {"sequence_lengths": [7], "capacity_factor": None, "capacity": 2, "drop_policy": pol}, p,
            lambda r, kw, b: _same_routing(dataclasses.replace(r, sequence_lengths=None, sequence_capacity=None),
                                           tk.moe_route(b["logits"], k=2, capacity=2, drop_policy=kw["drop_policy"],
                                                        provider="torch")))  # fmt: skip
    _ok(f"{P}/capacity_0_drops_everything", tk.moe_route, _rt_base, {"capacity": 0}, p,
        _rt_ref(lambda r, kw, b: r.num_rows == 0 and bool(r.dropped.all())))  # fmt: skip
    _ok(f"{P}/capacity_huge_limits_nothing", tk.moe_route, _rt_base, {"capacity": 2**70}, p,
        _rt_ref(lambda r, kw, b: r.num_rows == 14 and r.capacity == 2**70 and r.num_dropped == 0))  # fmt: skip
    _ok(f"{P}/capacity_numpy_int", tk.moe_route, _rt_base, {"capacity": np.int64(2)}, p,
        _rt_same_as(capacity=2))  # fmt: skip
    _ok(f"{P}/sequence_capacity_tensor_lengths_int32", tk.moe_route, _seq_base,
        {"capacity_factor": None, "capacity": 1, "sequence_lengths": L(lambda p: torch.tensor([3, 0, 4], dtype=I32))},
        p, _rt_same_as(sequence_lengths=[3, 0, 4]))  # fmt: skip
    _ok(f"{P}/sequence_lengths_numpy_ints", tk.moe_route, _seq_base,
        {"sequence_lengths": (np.int64(3), np.int32(0), np.int16(4))}, p,
        _rt_same_as(sequence_lengths=[3, 0, 4]))  # fmt: skip
    _ok(f"{P}/sequence_capacity_0", tk.moe_route, _seq_base, {"capacity_factor": None, "capacity": 0}, p,
        _rt_ref(lambda r, kw, b: r.num_rows == 0))  # fmt: skip
    _ok(f"{P}/sequence_zero_tokens", tk.moe_route,
        lambda p: {**_seq_base(p), "logits": torch.empty(0, 5, device=_dev(p)), "sequence_lengths": [0, 0]}, {}, p,
        lambda r, kw, b: r.num_rows == 0 and r.sequence_capacity == (0, 0))  # fmt: skip
    for name, mut in (("capacity", {"capacity": 2}), ("factor", {"capacity_factor": 0.6}),
                      ("sequence", {"capacity_scope": "sequence", "sequence_lengths": [3, 0, 4], "capacity": 1}),
                      ("everything", {"capacity": 1, "capacity_scope": "sequence", "sequence_lengths": [3, 0, 4],
                                      "score_bias": _bias(), "n_group": 5, "topk_group": 3, "scaling": 2.0,
                                      "score": "sigmoid", "drop_policy": "position"})):  # fmt: skip
        _ok(f"{P}/pad_to_capacity_{name}", tk.moe_route, _rt_base, {"pad_to_capacity": True, **mut}, p,
            _rt_ref(lambda r, kw, b: r.padded and r.num_rows == 5 * r.capacity
                    and torch.equal(r.rows_per_expert.cpu(), torch.full((5,), r.capacity))))  # fmt: skip
    _ok(f"{P}/pad_to_capacity_0", tk.moe_route, _rt_base, {"pad_to_capacity": True, "capacity": 0}, p,
        _rt_ref(lambda r, kw, b: r.num_rows == 0))  # fmt: skip
    _ok(f"{P}/pad_to_capacity_false_with_capacity", tk.moe_route, _rt_base,
        {"pad_to_capacity": False, "capacity": 2}, p, _rt_ref(lambda r, kw, b: not r.padded))  # fmt: skip
    _ok(f"{P}/pad_to_capacity_zero_tokens", tk.moe_route,
        lambda p: {"logits": torch.empty(0, 5, device=_dev(p)), "k": 2, "capacity": 2, "pad_to_capacity": True}, {},
        p, lambda r, kw, b: r.num_rows == 10 and bool((r.token_index == -1).all()))  # fmt: skip
    _ok(f"{P}/pad_to_capacity_meta", tk.moe_route,
        lambda p: {"logits": _m(7, 5), "k": 2, "capacity": 3, "pad_to_capacity": True}, {}, p,
        lambda r, kw, b: r.row_map.is_meta and r.num_rows == 15 and tuple(r.token_index.shape) == (15,))  # fmt: skip


def _padded_routing(p, T=7, E=5, k=2):
    return tk.moe_route(rnd(T, E, seed=9, p=p), k=k, capacity=2, pad_to_capacity=True, provider="torch")


for p in PROVIDERS:
    _ok(f"ops/moe_permute/{p}/padded_routing", tk.moe_permute,
        lambda p: {"x": rnd(7, 3, p=p), "routing": _padded_routing(p)}, {}, p,
        lambda r, kw, b: close(r, M.moe_permute_ref(b["x"], kw["routing"])) and r.shape == (10, 3)
        and bool((r[kw["routing"].token_index < 0] == 0).all()))  # fmt: skip
    _ok(f"ops/moe_unpermute/{p}/padded_routing", tk.moe_unpermute,
        lambda p: {"y_perm": rnd(10, 3, p=p), "routing": _padded_routing(p)}, {}, p,
        lambda r, kw, b: close(r, M.moe_unpermute_ref(b["y_perm"], kw["routing"]), 1e-5, 1e-5))  # fmt: skip
    _err(f"ops/moe_unpermute/{p}/padded_routing_unpadded_rows", tk.moe_unpermute,
         lambda p: {"y_perm": rnd(_padded_routing(p).tokens_per_expert.sum().item(), 3, p=p),
                    "routing": _padded_routing(p)}, {}, p)  # fmt: skip


# moe_aux_loss: scale= and groups=


def _al8_base(p):
    lg = rnd(8, 5, seed=10, p=p)
    return {"logits_or_probs": lg, "routing": tk.moe_route(lg, k=2, provider="torch")}


def _al_seq_base(p):
    """A routing with a capacity per sequence (one empty), its sequence lengths as the groups."""
    lg = rnd(7, 5, seed=9, p=p)
    r = tk.moe_route(lg, k=2, capacity=1, capacity_scope="sequence", sequence_lengths=[3, 0, 4], provider="torch")
    return {"logits_or_probs": lg, "routing": r, "groups": r.sequence_lengths}


def _aux_alone(x, lengths, k=2, scale="balanced-one"):
    """The mean over the non-empty groups of consecutive rows of the loss of each group's rows routed alone."""
    losses, start = [], 0
    for n in lengths:
        if n:
            sl = x[start : start + n]
            losses.append(M.moe_aux_loss_ref(sl, tk.moe_route(sl, k=k, provider="torch"), scale=scale))
        start += n
    return torch.stack(losses).mean()


def _aux_grad_matches(p: str) -> bool:
    """The gradient in the logits of the loss with scale="hf" and groups, against the reference's."""
    lg = rnd(7, 5, seed=9, p=p)
    r = tk.moe_route(lg, k=2, provider="torch")
    a, b = lg.clone().requires_grad_(), lg.clone().requires_grad_()
    tk.moe_aux_loss(a, r, scale="hf", groups=[3, 0, 4], provider=p).backward()
    M.moe_aux_loss_ref(b, r, scale="hf", groups=[3, 0, 4]).backward()
    return close(a.grad, b.grad, 1e-6, 1e-5)


for p in PROVIDERS:
    P = f"ops/moe_aux_loss/{p}"
    for kk, v in {"unknown": "mean", "upper": "HF", "empty": "", "none": None, "int": 1, "list": ["hf"]}.items():
        _err(f"{P}/scale_{kk}", tk.moe_aux_loss, _al_base, {"scale": v}, p)
    for kk, v in {
        "zero": 0,
        "negative": -7,
        "bool": True,
        "float": 7.0,
        "str": "7",
        "not_dividing_T": 2,
        "above_T": 14,
        "sum_below_T": [3, 3],
        "sum_above_T": [3, 5],
        "empty_list": [],
        "negative_length": [8, -1],
        "float_entry": [3.0, 4],
        "bool_entry": [True, 6],
        "none_entry": [None, 7],
        "nested": [[3, 4]],
        "tensor": L(lambda p: torch.tensor([3, 4])),
        "ndarray": np.array([3, 4]),
        "dict": {0: 7},
    }.items():
        _err(f"{P}/groups_{kk}", tk.moe_aux_loss, _al_base, {"groups": v}, p)
    if p in ("triton", "numba"):  # (no loss kernels: checked above)
        continue
    _ok(f"{P}/scale_hf_matches_reference", tk.moe_aux_loss, _al_base, {"scale": "hf"}, p,
        lambda r, kw, b: close(r, M.moe_aux_loss_ref(b["logits_or_probs"], kw["routing"], scale="hf"), 1e-5, 1e-5)
        and close(r, 2 * M.moe_aux_loss_ref(b["logits_or_probs"], kw["routing"]), 1e-5, 1e-5))  # fmt: skip
    _ok(f"{P}/scale_hf_sigmoid_from_probs", tk.moe_aux_loss,
        lambda p: (lambda lg: {"logits_or_probs": torch.sigmoid(lg), "routing": tk.moe_route(lg, k=2, score="sigmoid"),
                               "from_probs": True, "scale": "hf"})(rnd(7, 5, seed=2, p=p)), {}, p,
        lambda r, kw, b: close(r, M.moe_aux_loss_ref(b["logits_or_probs"], kw["routing"], from_probs=True,
                                                     scale="hf"), 1e-5, 1e-5))  # fmt: skip
    _ok(f"{P}/groups_lengths_match_reference_and_groups_alone", tk.moe_aux_loss, _al_base, {"groups": [3, 0, 4]}, p,
        lambda r, kw, b: close(r, M.moe_aux_loss_ref(b["logits_or_probs"], kw["routing"], groups=[3, 0, 4]))
        and close(r, _aux_alone(b["logits_or_probs"], [3, 0, 4]), 1e-5, 1e-5))  # fmt: skip
    _ok(f"{P}/groups_tuple_with_scale_hf", tk.moe_aux_loss, _al_base, {"groups": (1, 6), "scale": "hf"}, p,
        lambda r, kw, b: close(r, _aux_alone(b["logits_or_probs"], [1, 6], scale="hf"), 1e-5, 1e-5))  # fmt: skip
    _ok(f"{P}/groups_size_matches_groups_alone", tk.moe_aux_loss, _al8_base, {"groups": 4}, p,
        lambda r, kw, b: close(r, M.moe_aux_loss_ref(b["logits_or_probs"], kw["routing"], groups=4))
        and close(r, _aux_alone(b["logits_or_probs"], [4, 4]), 1e-5, 1e-5))  # fmt: skip
    _ok(f"{P}/groups_one_group_equals_no_groups", tk.moe_aux_loss, _al_base, {"groups": 7}, p,
        lambda r, kw, b: close(r, M.moe_aux_loss_ref(b["logits_or_probs"], kw["routing"]), 1e-6, 1e-6))  # fmt: skip
    _ok(f"{P}/groups_size_1", tk.moe_aux_loss, _al_base, {"groups": 1, "scale": "hf"}, p,
        lambda r, kw, b: close(r, _aux_alone(b["logits_or_probs"], [1] * 7, scale="hf"), 1e-5, 1e-5))  # fmt: skip
    _ok(f"{P}/groups_of_a_sequence_routing", tk.moe_aux_loss,
        _al_seq_base,
        {}, p,
        lambda r, kw, b: close(r, _aux_alone(b["logits_or_probs"], [3, 0, 4]), 1e-5, 1e-5),
    )  # fmt: skip
    _ok(f"{P}/groups_empty_list_of_zero_tokens", tk.moe_aux_loss,
        lambda p: (lambda lg: {"logits_or_probs": lg, "routing": tk.moe_route(lg, k=2), "groups": []})(
            torch.empty(0, 5, device=_dev(p))), {}, p,
        lambda r, kw, b: float(r) == 0.0)  # fmt: skip
    CASES.append(Case(f"{P}/groups_scale_hf_gradient", functools.partial(_aux_grad_matches, p), "ok",
                      check=lambda v: v is True))  # fmt: skip


# ==================================================================================================
# registry and helpers


CASES += [
    Case("ops/providers/any/report", lambda: str(tk.providers()), "ok", check=lambda s: "torch" in s and "triton" in s),
    Case("ops/set_tuned_lookup/any/not_callable", functools.partial(ops.set_tuned_lookup, "cache.json")),
    Case("ops/set_tuned_meta/any/not_callable", functools.partial(ops.registry.set_tuned_meta, 42)),
    Case("ops/seed_key/any/str", functools.partial(ops.seed_key, "7")),
    Case("ops/seed_key/any/float", functools.partial(ops.seed_key, 7.5)),
    Case("ops/seed_key/any/huge_int", functools.partial(ops.seed_key, 2**100), "ok", check=lambda v: 0 <= v < 2**32),
    Case("ops/topk_count/any/ratio_nan", functools.partial(ops.topk_count, 10, math.nan)),
    Case("ops/topk_count/any/ratio_zero", functools.partial(ops.topk_count, 10, 0.0)),
    Case("ops/topk_count/any/numel_str", functools.partial(ops.topk_count, "10", 0.5)),
    Case("ops/topk_count/any/numel_negative", functools.partial(ops.topk_count, -10, 0.5)),
    Case("ops/topk_count/any/ratio_int_one", functools.partial(ops.topk_count, 10, 1), "ok", check=lambda v: v == 10),
    Case("ops/block_codes/any/blocks_1d", lambda: ops.block_codes(torch.ones(8), torch.ones(1), 127.0, False, 0)),
    Case(
        "ops/block_codes/any/scales_wrong_count",
        lambda: ops.block_codes(torch.ones(2, 4), torch.ones(3), 127.0, False, 0),
    ),
    Case("ops/block_codes/any/qmax_nan", lambda: ops.block_codes(torch.ones(2, 4), torch.ones(2), math.nan, False, 0)),
    Case(
        "ops/block_codes/any/blocks_int",
        lambda: ops.block_codes(torch.ones(2, 4, dtype=I32), torch.ones(2), 127.0, False, 0),
    ),
    Case("ops/block_codes/any/key_str", lambda: ops.block_codes(torch.ones(2, 4), torch.ones(2), 127.0, True, "k")),
    Case(
        "ops/Routing/any/repr_of_hand_made",
        lambda: repr(dataclasses.replace(_routing("torch"))),
        "ok",
        check=lambda s: s.startswith("Routing(tokens=7"),
    ),
]


# ==================================================================================================
# Expanded views claiming more elements than memory holds (an expand() has no memory behind it)


def _huge(*shape):
    return L(lambda p: torch.zeros([1] * len(shape), device=_dev(p)).expand(*shape))


_HUGE = {
    "flatten": (tk.flatten, lambda p: {}, {"tensors": L(lambda p: [_huge(2**38).f(p)])}),
    "wire_cast": (tk.wire_cast, lambda p: {}, {"x": _huge(2**38)}),
    "quantize": (tk.quantize, lambda p: {}, {"x": _huge(2**38)}),
    "topk_compress": (tk.topk_compress, lambda p: {"ratio": 0.01}, {"x": _huge(2**38)}),
    "sign_compress": (tk.sign_compress, lambda p: {}, {"x": _huge(2**38)}),
    "residual_add": (tk.residual_add, lambda p: {"residual": torch.zeros(2, device=_dev(p))}, {"x": _huge(2**38)}),
    "bucket_reduce": (tk.bucket_reduce, lambda p: {}, {"buffers": L(lambda p: [_huge(2**38).f(p)] * 2)}),
    "pack": (ops.pack, lambda p: {}, {"x": _huge(2**38)}),
    "moe_route": (tk.moe_route, lambda p: {"k": 2}, {"logits": _huge(2**36, 4)}),
    "moe_permute": (tk.moe_permute, lambda p: {"routing": _routing(p)}, {"x": _huge(7, 2**36)}),
    "moe_z_loss": (tk.moe_z_loss, lambda p: {}, {"logits": _huge(2**36, 4)}),
}
for p in PROVIDERS:
    for op, (fn, base, mut) in _HUGE.items():
        if op == "moe_z_loss" and p in ("triton", "numba"):
            continue
        _err(f"ops/{op}/{p}/expanded_view_larger_than_memory", fn, base, mut, p)


# ==================================================================================================
# The provider argument: an unknown name or a non-str is refused, on real and on meta tensors (a call on
# meta tensors selects no provider, so the name is checked up front)


def _m(*shape, dtype=F32):
    return torch.empty(*shape, dtype=dtype, device=META)


_PROVIDER_CALLS = {
    "flatten": lambda t, p: tk.flatten([t(5)], provider=p),
    "bucket_reduce": lambda t, p: tk.bucket_reduce([t(5), t(5)], provider=p),
    "wire_cast": lambda t, p: tk.wire_cast(t(5), provider=p),
    "quantize": lambda t, p: tk.quantize(t(5), provider=p),
    "dequantize": lambda t, p: tk.dequantize(t(5, dtype=torch.int8), t(1), provider=p),
    "topk_compress": lambda t, p: tk.topk_compress(t(50), ratio=0.1, provider=p),
    "topk_decompress": lambda t, p: tk.topk_decompress(t(2), t(2, dtype=I64), 9, provider=p),
    "sign_compress": lambda t, p: tk.sign_compress(t(9), provider=p),
    "sign_decompress": lambda t, p: tk.sign_decompress(t(2, dtype=torch.uint8), t(()), 9, provider=p),
    "orthogonalize": lambda t, p: tk.orthogonalize(t(6, 3), provider=p),
    "residual_add": lambda t, p: tk.residual_add(t(5), t(5), provider=p),
    "error_update": lambda t, p: tk.error_update(t(5), t(5), t(5), provider=p),
    "pack": lambda t, p: ops.pack(t(5), "fp16", provider=p),
    "moe_route": lambda t, p: tk.moe_route(t(5, 4), k=2, provider=p),
    "moe_z_loss": lambda t, p: tk.moe_z_loss(t(5, 4), provider=p),
}


def _real(*shape, dtype=F32):
    return torch.zeros(*shape, dtype=dtype)


for op, call in _PROVIDER_CALLS.items():
    for k, v in {"bogus": "bogus", "int": 3, "upper": "TRITON"}.items():
        CASES.append(Case(f"ops/{op}/any/provider_{k}_on_meta", functools.partial(call, _m, v)))
        CASES.append(Case(f"ops/{op}/any/provider_{k}", functools.partial(call, _real, v)))
