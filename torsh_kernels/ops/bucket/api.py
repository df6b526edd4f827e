"""The bucket family's public ops (flatten, unflatten, bucket_reduce, wire_cast): each validates its inputs
(typed errors; validation cached per layout for flatten and unflatten, ``plans.py``), allocates its outputs
and runs its provider (``providers.py``), through a ``torsh::`` custom op with a fake implementation so it
composes with ``torch.compile``. Also the ops' tuning spaces (``torsh tune``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ...errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    LayoutMismatchError,
    NonFiniteError,
    ShapeError,
)
from .. import eager
from ..common import (
    Ranges,
    as_count,
    check_strided,
    device_bytes,
    flat_inout,
    flat_input,
    no_overlap,
    on_device,
    ptrs_of,
    tensor_guards,
)
from ..registry import check_provider
from ..tuning import TuneSpace, register_space
from .layout import (
    FLOAT_DTYPES,
    REDUCE_OPS,
    WIRE_DTYPES,
    BucketLayout,
    check_flat,
    check_float,
    check_floats,
    check_out_clear,
    check_reduce_out,
    check_same_device,
    check_scale,
    check_tensor_list,
    check_unflatten_memory,
    has_internal_overlap,
)
from .plans import (
    FLAT_PLANS,
    UNFLAT_PLANS,
    UnflatPlan,
    flat_provider,
    flatten_run,
    new_flat_plan,
    plain_all,
    unflatten_run,
)
from .providers import (
    TORCH_IMPL,
    flatten_into,
    reduce_impl,
    reduce_into,
    reduce_new,
    reduce_torch,
    unflatten_into,
    wire_impl,
)
from .reference import bucket_reduce_ref

__all__ = ["bucket_reduce", "flatten", "unflatten", "wire_cast"]

_T = torch.Tensor
_F32 = torch.float32
_CPU = torch.device("cpu")
_WIRE_SET = frozenset(WIRE_DTYPES)

# --------------------------------------------------------------------------------------------------
# Custom ops (torch.library): opaque to torch.compile, with fake implementations for tracing.


@torch.library.custom_op("torsh::flatten", mutates_args=())
def _flatten_op(tensors: list[torch.Tensor], dtype: torch.dtype, scale: float, provider: str) -> torch.Tensor:
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    flatten_into(tensors, out, scale, provider)
    return out


@_flatten_op.register_fake
def _(tensors, dtype, scale, provider):
    return tensors[0].new_empty(sum(t.numel() for t in tensors), dtype=dtype)


@torch.library.custom_op("torsh::flatten_out", mutates_args=("out",))
def _flatten_out_op(tensors: list[torch.Tensor], out: torch.Tensor, scale: float, provider: str,
                    traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced:
        check_out_clear(tensors, out)
    flatten_into(tensors, out, scale, provider)


@_flatten_out_op.register_fake
def _(tensors, out, scale, provider, traced=False):
    return None


_unflatten_op = torch.library.custom_op("torsh::unflatten", unflatten_into, mutates_args=("tensors",))


@_unflatten_op.register_fake
def _(flat, tensors, scale, accumulate, provider, traced=False):
    return None


_reduce_op = torch.library.custom_op("torsh::bucket_reduce", reduce_new, mutates_args=())


@_reduce_op.register_fake
def _(buffers, op, provider):
    return torch.empty_like(buffers[0], memory_format=torch.contiguous_format)


@torch.library.custom_op("torsh::bucket_reduce_out", mutates_args=("out",))
def _reduce_out_op(buffers: list[torch.Tensor], out: torch.Tensor, op: str, provider: str,
                   traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced:
        check_reduce_out(buffers, out)
    reduce_into(buffers, out, op, provider)


@_reduce_out_op.register_fake
def _(buffers, out, op, provider, traced=False):
    return None


@torch.library.custom_op("torsh::wire_cast", mutates_args=("out",))
def _wire_op(x: torch.Tensor, out: torch.Tensor, divisor: float, check_finite: bool, provider: str,
             traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory check to run here."""
    if traced:
        no_overlap(out, x, "torsh_kernels.wire_cast", "out", "x", same_ok=True)
    if out.numel():
        name = wire_impl.select(out.device, out.dtype, out.numel(), provider or None)
        with on_device(out.device):
            bad = wire_impl(name, x, out, divisor, check_finite)
        if check_finite and (b := as_count(bad)):
            _raise_wire_nonfinite(b, out.dtype)


@_wire_op.register_fake
def _(x, out, divisor, check_finite, provider, traced=False):
    return None


def _raise_wire_nonfinite(bad: int, dtype: torch.dtype) -> None:
    raise NonFiniteError(
        f"torsh_kernels.wire_cast: the {str(dtype).removeprefix('torch.')} result holds {bad} non-finite "
        "element(s) (NaN/Inf in the input, or an fp16 overflow above 65504; out was written); find the source "
        "(a loss scale too high, a diverging step) or pass check_finite=False to cast anyway"
    )


# --------------------------------------------------------------------------------------------------
# Public API


def flatten(
    tensors: Sequence[torch.Tensor],
    *,
    out: torch.Tensor | None = None,
    scale: float = 1.0,
    dtype: torch.dtype | None = None,
    provider: str | None = None,
) -> tuple[torch.Tensor, BucketLayout]:
    """Copy ``tensors`` into one flat buffer, times ``scale``, cast to ``dtype``, in one pass.

    Args:
        tensors: floating-point tensors on one device, any shapes, contiguous or not.
        out: a contiguous buffer of exactly the total element count to write into; its dtype is the
            flat dtype. Must not overlap any input.
        scale: multiplier applied in fp32 (fp64 if an operand is fp64) before the cast.
        dtype: dtype of the flat buffer (e.g. torch.bfloat16 for the wire); defaults to ``out``'s
            dtype, else the promoted dtype of the inputs.
        provider: "triton", "numba", "cpu" or "torch"; None selects automatically (see ``providers()``).

    Returns:
        ``(flat, layout)``: the 1-D buffer and the :class:`BucketLayout` that ``unflatten`` takes.
    """
    what = "torsh_kernels.flatten"
    key = None
    tt = type(tensors)
    if (tt is list or tt is tuple) and eager.unmoded() and (out is None or type(out) in eager.PLAIN_TYPES):
        key, res = _flatten_planned(tensors, out, scale, dtype, provider)
        if res is not None:  # (found by address: the list is new, likely a temporary; not stored)
            return res
    check_provider(provider)  # (a plan's call above selects its provider, which checks the name)
    tensors = check_tensor_list(tensors, what, "tensors")
    check_floats(tensors, what, "tensors")
    device = check_same_device(tensors, what, "tensors")
    scale = check_scale(scale, what)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise DTypeError(f"{what}: dtype={dtype} is not a floating-point dtype the kernels write")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ArgumentTypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
        check_float(out, what, "out")
        if dtype is not None and dtype != out.dtype:
            raise InvalidArgumentError(
                f"{what}: dtype={dtype} disagrees with out.dtype={out.dtype}; pass one or make them equal"
            )
        dtype = out.dtype
    layout = BucketLayout.for_tensors(tensors, dtype)
    if layout.nbytes > device_bytes(device):  # (expanded views can claim any size)
        raise InvalidArgumentError(
            f"{what}: the tensors hold {layout.total} elements ({layout.nbytes / 2**30:.4g} GiB as {layout.dtype}), "
            f"more than the {device.type} memory holds; flatten smaller buckets"
        )
    if out is None:
        plan = new_flat_plan(key, tensors, None, layout, device)
        if plan is not None:
            return flatten_run(plan, tensors, None, scale, flat_provider(plan, provider))
        flat = _flatten_op(tensors, layout.dtype, scale, provider or "")
        return flat, layout
    if out.device != device:
        raise DeviceMismatchError(f"{what}: out is on {out.device}, the tensors on {device}")
    if out.numel() != layout.total:
        raise ShapeError(
            f"{what}: out has {out.numel()} elements but the tensors hold {layout.total}; allocate "
            f"torch.empty({layout.total}, dtype={layout.dtype}) or slice your buffer to that size"
        )
    if not out.is_contiguous():
        raise ShapeError(f"{what}: out must be contiguous (it is written as one flat range)")
    if eager.deferred(out, *tensors):  # the memory check runs in the op, at run time (meta: nothing to check)
        _flatten_out_op(tensors, out, scale, provider or "", True)
        return out.view(-1) if out.dim() != 1 else out, layout
    check_out_clear(tensors, out)
    plan = new_flat_plan(key, tensors, out, layout, device)
    if plan is not None:
        return flatten_run(plan, tensors, out, scale, flat_provider(plan, provider))
    _flatten_out_op(tensors, out, scale, provider or "")
    return out.view(-1) if out.dim() != 1 else out, layout


def _flatten_planned(tensors, out, scale, dtype, provider) -> tuple[tuple, tuple | None]:
    """flatten's direct path: (the key its plan is stored under, its result, or None without a valid plan).

    A validated layout skips the per-tensor checks and the dispatcher. The plan is looked up by the list
    object (the same list passed each step), else by the tensors' addresses (fresh views over validated
    memory, as GradBucket.gradients() gives); either way confirmed by the guards."""
    tail = (None, dtype) if out is None else (out.data_ptr(), None)
    key = (id(tensors), len(tensors), *tail)
    plan = FLAT_PLANS.get(key)
    ptrs = None
    if plan is None:
        ptrs = ptrs_of(tensors)
        plan = FLAT_PLANS.get((ptrs, *tail)) if ptrs else None
    ok = plan is not None and (out is None or dtype is None or dtype == out.dtype)
    if not (ok and (plan.guards.check(*tensors) if out is None else plan.guards.check(*tensors, out))):
        return key, None
    scale = check_scale(scale, "torsh_kernels.flatten")
    name = flat_provider(plan, provider)
    if plan.device.type == "cpu" and name in TORCH_IMPL and plan.cat and (scale == 1.0 or plan.cat_scaled):
        # torch.cat(out=) reads the addresses itself and refuses an out overlapping an input (a
        # RuntimeError before it writes): the full validation then says which one
        try:
            return key, flatten_run(plan, tensors, out, scale, name)
        except RuntimeError:
            return key, None
    if (ptrs or ptrs_of(tensors)) == plan.ptrs:  # the memory the validation checked
        return key, flatten_run(plan, tensors, out, scale, name)
    return key, None


def unflatten(
    flat: torch.Tensor,
    layout: BucketLayout,
    tensors: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    accumulate: bool = False,
    provider: str | None = None,
) -> None:
    """Write ``flat * scale`` back into ``tensors`` in place (or add it to them), in one launch per dtype.

    Each value is computed in fp32 (fp64 if an operand is fp64) and cast to its tensor's dtype.
    ``tensors`` must have the layout's shapes; they may be non-contiguous, but not expanded (stride 0),
    not sharing memory with each other, and not overlapping ``flat`` unless they are exactly its slices
    (as with DDP's bucket views).
    """
    what = "torsh_kernels.unflatten"
    key = None
    if eager.unmoded() and type(flat) in eager.PLAIN_TYPES:  # a validated layout: skip the checks and the dispatcher
        ptrs = ptrs_of(tensors)
        if ptrs:
            key = (flat.data_ptr(), id(layout), ptrs)
            plan = UNFLAT_PLANS.get(key)
            if plan is not None and plan.layout is layout and plan.guards.check(flat, *tensors):
                return unflatten_run(plan, key, flat, tensors, check_scale(scale, what), bool(accumulate), provider)
    check_provider(provider)  # (a plan's call above selects its provider, which checks the name)
    if not isinstance(layout, BucketLayout):
        raise ArgumentTypeError(f"{what}: layout must be a BucketLayout (from flatten), got {type(layout).__name__}")
    flat = check_flat(flat, layout, what)
    tensors = check_tensor_list(tensors, what, "tensors")
    if len(tensors) != len(layout):
        raise LayoutMismatchError(f"{what}: the layout describes {len(layout)} tensors, got {len(tensors)}")
    if tuple(t.shape for t in tensors) != layout.shapes:
        i = next(i for i, (t, s) in enumerate(zip(tensors, layout.shapes)) if tuple(t.shape) != s)
        raise LayoutMismatchError(
            f"{what}: tensors[{i}] has shape {tuple(tensors[i].shape)}, the layout says {layout.shapes[i]}"
        )
    check_floats(tensors, what, "tensors")
    if eager.deferred(flat, *tensors):  # strides only (no addresses); memory checks in the op, at run time
        for i, t in enumerate(tensors):
            if has_internal_overlap(t):
                raise ShapeError(f"{what}: tensors[{i}] is expanded (a stride-0 dimension); it cannot be written")
        if tensors[0].device != flat.device:
            raise DeviceMismatchError(f"{what}: flat is on {flat.device} but tensors[0] is on {tensors[0].device}")
        check_same_device(tensors, what, "tensors")
        _unflatten_op(flat, tensors, check_scale(scale, what), bool(accumulate), provider or "", True)
        return
    ranges = Ranges.of(tensors)
    for i in np.flatnonzero(~ranges.contig).tolist():  # a contiguous tensor cannot be expanded
        if has_internal_overlap(tensors[i]):
            raise ShapeError(f"{what}: tensors[{i}] is expanded (a stride-0 dimension); it cannot be written")
    if tensors[0].device != flat.device:
        raise DeviceMismatchError(f"{what}: flat is on {flat.device} but tensors[0] is on {tensors[0].device}")
    check_same_device(tensors, what, "tensors")
    scale = check_scale(scale, what)
    check_unflatten_memory(flat, tensors, ranges)
    if key is not None and plain_all(tensors) and not flat.is_meta:
        guards = tensor_guards([flat, *tensors])
        if guards is not None:
            same = flat.is_contiguous() and all(t.dtype == flat.dtype for t in tensors)
            grad = flat.requires_grad or any(t.requires_grad for t in tensors)
            plan = UnflatPlan(guards=guards, layout=layout, device=flat.device, same=same, grad=grad)
            UNFLAT_PLANS.put(key, plan)
            return unflatten_run(plan, key, flat, tensors, scale, bool(accumulate), provider)
    _unflatten_op(flat, tensors, scale, bool(accumulate), provider or "")


def bucket_reduce(
    buffers: Sequence[torch.Tensor] | torch.Tensor,
    *,
    op: str = "sum",
    out: torch.Tensor | None = None,
    provider: str | None = None,
) -> torch.Tensor:
    """Reduce K same-shape buffers elementwise (``op`` = "sum", "avg" or "max") in one launch.

    ``buffers`` is a list of tensors or one tensor stacked along dim 0. Accumulation is in fp32 (fp64 if
    an operand is fp64); "max" propagates NaN. ``out`` (any floating dtype, the buffers' shape,
    contiguous) may be one of the buffers itself, for an in-place reduction.
    """
    if out is None and type(buffers) is list and len(buffers) >= 2 and (op == "sum" or op == "avg" or op == "max"):
        b0 = buffers[0]
        if (
            type(b0) is _T and b0.dtype is _F32 and b0.is_cpu and b0.is_contiguous()
            and all(type(b) is _T and b.dtype is _F32 and b.is_cpu and b.is_contiguous() for b in buffers)
            and all(b.shape == b0.shape for b in buffers)
            and (n := b0.numel())
            and eager.fast()
            and reduce_impl.select(_CPU, _F32, n, provider or None) in TORCH_IMPL
        ):  # fmt: skip
            # The common case, fp32 buffers on the CPU: the torch provider itself into a new tensor, without
            # the flattening views and the custom op.
            return eager.run(reduce_torch, buffers, None, op)
    what = "torsh_kernels.bucket_reduce"
    check_provider(provider)
    if isinstance(buffers, torch.Tensor):
        if buffers.dim() == 0:
            raise ShapeError(f"{what}: a stacked buffers tensor needs a leading K dimension, got a scalar")
        buffers = list(buffers.unbind(0))
        if not buffers:
            raise InvalidArgumentError(f"{what}: the stacked buffers tensor has K=0 rows")
    buffers = check_tensor_list(buffers, what, "buffers")
    names = [f"buffers[{i}]" for i in range(len(buffers))]  # K is small (a world size, a few buffers)
    if op not in REDUCE_OPS:
        raise InvalidArgumentError(f"{what}: op={op!r}; expected one of {', '.join(map(repr, REDUCE_OPS))}")
    b0 = buffers[0]
    for b, n in zip(buffers, names):
        check_float(b, what, n)
        if b.shape != b0.shape:
            raise ShapeError(f"{what}: {n} has shape {tuple(b.shape)}, buffers[0] has {tuple(b0.shape)}")
        if b.dtype != b0.dtype:
            raise DTypeError(f"{what}: {n} is {b.dtype}, buffers[0] is {b0.dtype}; reduce buffers of one dtype")
    device = check_same_device(buffers, what, "buffers")
    for b, n in zip(buffers, names):
        check_strided(b, what, n)
    if out is None:
        if eager.direct(*buffers):
            return eager.run(reduce_new, buffers, op, provider or "")
        return _reduce_op(buffers, op, provider or "")
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"{what}: out must be a torch.Tensor, got {type(out).__name__}")
    check_float(out, what, "out")
    if out.device != device:
        raise DeviceMismatchError(f"{what}: out is on {out.device}, the buffers on {device}")
    if out.shape != b0.shape:
        raise ShapeError(f"{what}: out has shape {tuple(out.shape)}, the buffers {tuple(b0.shape)}")
    if not out.is_contiguous():
        raise ShapeError(f"{what}: out must be contiguous")
    if eager.deferred(out, *buffers):  # the memory check runs in the op, at run time
        _reduce_out_op(buffers, out, op, provider or "", True)
        return out
    check_reduce_out(buffers, out)
    if eager.direct(*buffers, out):
        eager.run(reduce_into, buffers, out, op, provider or "")
        if out.numel():
            eager.written(reduce_impl.select(device, b0.dtype, out.numel(), provider or None), out)
        return out
    _reduce_out_op(buffers, out, op, provider or "")
    return out


def wire_cast(
    x: torch.Tensor,
    dtype: torch.dtype | None = None,
    *,
    divisor: float = 1.0,
    out: torch.Tensor | None = None,
    check_finite: bool = True,
    provider: str | None = None,
) -> torch.Tensor:
    """``x``'s elements cast to the wire dtype and divided there: ``dtype(dtype(x) / divisor)`` (the
    division in fp32, then rounded again), in one pass: PyTorch's ``fp16_compress_hook`` arithmetic, bit
    for bit.

    ``dtype``: fp16 (default), bf16 or fp32; with ``out`` it defaults to ``out.dtype``. ``out``: a
    contiguous tensor of x's element count on x's device (x itself when the dtypes match: in place);
    returned, else a new 1-D tensor. ``divisor``: a finite, non-zero number (the world size, for a
    pre-divided all-reduce). With ``check_finite``, NaN/Inf in the result (in the input, or an fp16
    overflow above 65504) raise :class:`NonFiniteError` after ``out`` was written.
    """
    if (
        type(x) is _T and x.dtype is _F32 and x.is_cpu and x.is_contiguous() and (n := x.numel())
        and (divisor.__class__ is float or divisor.__class__ is int) and divisor != 0 and -math.inf < divisor < math.inf
        and (out is None or (type(out) is _T and out.is_cpu and out.is_contiguous() and out.numel() == n
                             and (dtype is None or dtype is out.dtype)))
        and ((wire := out.dtype if out is not None else dtype or torch.float16) in _WIRE_SET)
        and eager.fast()
        and wire_impl.select(_CPU, wire, n, provider or None) == "cpu"
        and (out is None or _wire_out_ok(x, out, n))
    ):  # fmt: skip
        # The common case on the CPU with the cpu provider: its kernel straight on the tensors' memory.
        K = _cpu_kernels()
        if out is None:
            out = torch.empty(n, dtype=wire)
        bad = K.wire_cast_ptr(x.data_ptr(), out.data_ptr(), n, K.WIRE[wire], np.float32(divisor), divisor != 1)
        eager.bump(out)
        if bad and check_finite:
            _raise_wire_nonfinite(bad, wire)
        return out
    what = "torsh_kernels.wire_cast"
    check_provider(provider)
    xf = flat_input(x, what, "x")
    if out is not None:
        if dtype is not None and dtype != getattr(out, "dtype", dtype):
            raise DTypeError(f"{what}: dtype={dtype} but out is {out.dtype}; pass one of them, or matching ones")
        dtype = out.dtype if isinstance(out, torch.Tensor) else dtype
    dtype = dtype or torch.float16
    if dtype not in _WIRE_SET:
        raise DTypeError(f"{what}: dtype={dtype}; expected float16, bfloat16 or float32")
    if isinstance(divisor, bool) or not isinstance(divisor, (int, float)):
        raise ArgumentTypeError(f"{what}: divisor must be a real number, got {type(divisor).__name__}")
    if not math.isfinite(divisor) or divisor == 0:
        raise InvalidArgumentError(f"{what}: divisor={divisor}; expected a finite, non-zero number")
    if out is None:
        out = torch.empty(xf.numel(), dtype=dtype, device=xf.device)
    of = flat_inout(out, what, "out", xf.numel(), xf.device)
    traced = eager.deferred(xf, of)  # the memory check then runs in the op, at run time
    if not traced:
        no_overlap(of, xf, what, "out", "x", same_ok=True)
    if xf.numel():
        eager.call(_wire_op, (1,), xf, of, float(divisor), bool(check_finite), provider or "", traced)
    return out


def _wire_out_ok(x: torch.Tensor, out: torch.Tensor, n: int) -> bool:
    """``out`` shares no byte with fp32 ``x`` [n], or is x itself (fp32, in place)."""
    px, po = x.data_ptr(), out.data_ptr()
    if po == px and out.dtype is _F32:
        return True
    return po + out.element_size() * n <= px or px + 4 * n <= po


_cpu_kernels = eager.lazy_module("bucket.cpu")  # the cpu provider's kernels, for the fast paths

# --------------------------------------------------------------------------------------------------
# Tuning spaces (``torsh tune``): the Triton kernels' elements per program and warps

_TUNE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TUNE_META = {"triton": {"BLOCK": (2048, 1024, 4096, 8192), "num_warps": (4, 2, 8)}}


def _tune_pieces(device, dtype, size, gen):
    k = 7
    sizes = [max(1, size // k + (i * 37) % 101) for i in range(k)]
    return [torch.randn(s, generator=gen).to(dtype).to(device) for s in sizes]


def _tune_make_flatten(device, dtype, size, gen):
    ts = _tune_pieces(device, dtype, size, gen)
    return ts, torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=device)


def _tune_make_unflatten(device, dtype, size, gen):
    ts = _tune_pieces(device, dtype, size, gen)
    flat, layout = flatten(ts, provider="torch")
    flat = torch.randn(flat.numel(), generator=gen).to(dtype).to(device)
    return flat, layout, [torch.empty_like(t) for t in ts]


def _tune_run_unflatten(s, p):
    unflatten(s[0], s[1], s[2], provider=p)
    return torch.cat([t.reshape(-1) for t in s[2]])


def _tune_make_reduce(device, dtype, size, gen):
    bufs = [torch.randn(size, generator=gen).to(dtype).to(device) for _ in range(4)]
    return bufs, torch.empty(size, dtype=dtype, device=device)


def _tune_check_reduce(s, out):
    ref = bucket_reduce_ref(s[0], "sum", s[1].dtype)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[s[1].dtype]
    return bool(torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol))


register_space(TuneSpace(
    op="flatten", family="bucket", dtypes=_TUNE_DTYPES, meta=_TUNE_META, make=_tune_make_flatten,
    run=lambda s, p: flatten(s[0], out=s[1], provider=p)[0],
    check=lambda s, out: torch.equal(out, torch.cat([t.reshape(-1) for t in s[0]])),
))  # fmt: skip
register_space(TuneSpace(
    op="unflatten", family="bucket", dtypes=_TUNE_DTYPES, meta=_TUNE_META, make=_tune_make_unflatten,
    run=_tune_run_unflatten, check=lambda s, out: torch.equal(out, s[0]),
))  # fmt: skip
register_space(TuneSpace(
    op="bucket_reduce", family="bucket", dtypes=_TUNE_DTYPES, meta=_TUNE_META, make=_tune_make_reduce,
    run=lambda s, p: bucket_reduce(s[0], out=s[1], provider=p), check=_tune_check_reduce,
))  # fmt: skip
