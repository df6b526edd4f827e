"""Provider implementations of the bucket ops, registered per provider (torch, triton, numba, cpu). Inputs
are validated and outputs allocated by the public ops (``api.py``); the Triton and Numba kernels are
imported on a provider's first launch (``triton.py``, ``numba.py``, ``cpu.py``), so importing the family
imports neither.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..common import VEC, Ranges, nonfinite_count, numba_span, on_device, ptr_table, spans
from ..registry import Op, tuned_meta
from .layout import REDUCE_CODE, check_unflatten_memory, flat_offsets
from .reference import compute_dtype
from .tables import Writable, by_dtype, copy_plan, launch_tables, numba_groups, readable, scale_bits

__all__ = [
    "GATHER_BLOCK",
    "NUMBA_TILE",
    "TORCH_IMPL",
    "TRITON_BLOCK",
    "TRITON_WARPS",
    "flatten_impl",
    "flatten_into",
    "reduce_impl",
    "reduce_into",
    "reduce_new",
    "reduce_torch",
    "unflatten_impl",
    "unflatten_into",
    "wire_impl",
]

flatten_impl = Op("flatten")
unflatten_impl = Op("unflatten")
reduce_impl = Op("bucket_reduce")
# wire cast: out = dtype(dtype(x) / divisor) (no division when divisor == 1); returns the NaN/Inf count
# written (0 unless count_bad). x is contiguous and 1-D, out contiguous, 1-D, of x's size.
wire_impl = Op("wire_cast")

# Kernel geometry. The autotuner (a later issue) searches these; the defaults suit memory-bound copies.
TRITON_BLOCK = 2048
TRITON_WARPS = 4
GATHER_BLOCK = 512  # the strided / unaligned pieces: 4 elements a thread keep the index math within 64 registers
NUMBA_TILE = 2048


def _as_1d(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.dim() == 1 else t.reshape(-1) for t in tensors]


def _split_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors`` (one split, then a view only where a shape needs it)."""
    parts = flat.split([t.numel() for t in tensors])
    return [p if t.dim() == 1 else p.view(t.shape) for p, t in zip(parts, tensors)]


@flatten_impl.register("torch")
def _flatten_torch(tensors: list[torch.Tensor], out: torch.Tensor, scale: float, one_d: bool | None = None) -> None:
    if one_d is not None:  # the direct path's plan: every tensor of out's dtype, 1-D if one_d, scale rounds once
        torch.cat(tensors if one_d else _as_1d(tensors), out=out)
        if scale != 1.0:
            out.mul_(scale)
        return
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:  # one group covering the whole bucket, in order: whole-buffer ops
        (dtype,) = dtypes
        c = compute_dtype(dtype, out.dtype)
        if dtype == out.dtype and (dtype == c or scale == 1.0):
            torch.cat(_as_1d(tensors), out=out)  # exact copy, then scale in place in the compute dtype
            if scale != 1.0:
                out.mul_(scale)
        elif scale == 1.0:  # one cast per element, no temporary (torch.cat with a casting out= is slow)
            torch._foreach_copy_(_split_like(out, tensors), tensors)
        elif len(tensors) == 1 and out.dtype == c:
            # an exact widening copy, then the product in c, rounded once (torch.mul(x16, scale, out=out32)
            # would compute in x's 16-bit dtype: the fuzz found -3 * 1.541 flattened as -4.625, not -4.623)
            out.copy_(tensors[0].reshape(-1))
            out.mul_(scale)
        else:
            cat = torch.cat(_as_1d(tensors))
            cat = cat.to(c) if cat.dtype != c else cat
            out.copy_(cat * scale if scale != 1.0 else cat)
        return
    for dtype, (ts, offs) in by_dtype(tensors, flat_offsets(tensors)):
        c = compute_dtype(dtype, out.dtype)
        cat = torch.cat(_as_1d(ts))
        cat = cat.to(c) if cat.dtype != c else cat
        if scale != 1.0:
            cat = cat * scale
        # Scatter each tensor's slice back to its offset (adjacent tensors form one run).
        pos = 0
        for t, off in zip(ts, offs):
            n = t.numel()
            out[off : off + n].copy_(cat[pos : pos + n])
            pos += n


@flatten_impl.register("triton")
def _flatten_triton(tensors: list[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    from . import triton as K

    tensors = [readable(t) for t in tensors]
    for dtype, (ts, offs) in by_dtype(tensors, flat_offsets(tensors)):
        f64 = compute_dtype(dtype, out.dtype) == torch.float64
        seg, gen, warps = _copy_geometry("flatten", out, f64, False)
        plan = copy_plan(ts, offs, out, True, ts[0].element_size() >= out.element_size(), seg, gen)
        K.copy(plan, out, ts[0], scale_bits(scale), scale != 1.0, False, f64, warps)


def _copy_geometry(op: str, flat: torch.Tensor, f64: bool, accumulate: bool) -> tuple[int, int, int]:
    """(segment kernel BLOCK, gather kernel BLOCK, warps): the tuned BLOCK for the segments, else 16 elements a
    thread (8 with fp64 compute or an accumulating read, to stay within 64 registers)."""
    m = tuned_meta(op, flat.device, flat.dtype, flat.numel(), "triton")
    warps = m.get("num_warps", TRITON_WARPS)
    seg = m.get("BLOCK") or (TRITON_BLOCK // 2 if f64 or accumulate else TRITON_BLOCK) * warps // TRITON_WARPS
    return seg, GATHER_BLOCK, warps


@flatten_impl.register("numba")
def _flatten_numba(tensors: list[torch.Tensor], out: torch.Tensor, scale: float) -> None:
    from .. import numba_common as nb
    from . import numba as kernels

    tensors = [readable(t) for t in tensors]
    out_arr = nb.as_array(out)
    for ts, offs in numba_groups(tensors, flat_offsets(tensors)):
        base, span, addrs = numba_span(ts)
        table, tile_map, n_tiles = launch_tables(ts, offs, addrs, NUMBA_TILE, out.device, "numba")
        kernel = kernels.flatten_kernel(ts[0].dtype, out.dtype)
        nb.launch(
            kernel, n_tiles, nb.THREADS, out.device,
            nb.as_array(table), nb.as_array(tile_map), nb.span_array(base, span, ts[0].dtype),
            out_arr, scale, NUMBA_TILE,
        )  # fmt: skip


@unflatten_impl.register("torch")
def _unflatten_torch(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool,
                     views: list[torch.Tensor] | None = None) -> None:  # fmt: skip
    if views is not None:  # the direct path's plan: views of flat, one per tensor, all of flat's dtype
        torch._foreach_copy_(tensors, views)
        return
    groups = by_dtype(tensors, flat_offsets(tensors))
    whole = len(groups) == 1 and len(groups[0][1][0]) == len(tensors)  # every tensor, in order, one dtype
    for dtype, (ts, toffs) in groups:
        c = compute_dtype(dtype, flat.dtype)
        if whole:
            views = _split_like(flat, ts)
        else:
            views = [flat[o : o + t.numel()].view(t.shape) for t, o in zip(ts, toffs)]
        if not accumulate and scale == 1.0:
            torch._foreach_copy_(ts, views)
            continue
        vals = [v.to(c) for v in views] if flat.dtype != c else views
        if scale != 1.0:
            vals = torch._foreach_mul(vals, scale)
        if accumulate:
            vals = torch._foreach_add([t.to(c) for t in ts] if dtype != c else ts, vals)
        torch._foreach_copy_(ts, vals)


@unflatten_impl.register("triton")
def _unflatten_triton(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool) -> None:
    from . import triton as K

    w = Writable(tensors, accumulate)
    for dtype, (ts, offs) in by_dtype(w.targets, flat_offsets(w.targets)):
        f64 = compute_dtype(dtype, flat.dtype) == torch.float64
        seg, gen, warps = _copy_geometry("unflatten", flat, f64, accumulate)
        prefer_tensor = ts[0].element_size() * (2 if accumulate else 1) > flat.element_size()  # ties: loads
        plan = copy_plan(ts, offs, flat, False, prefer_tensor, seg, gen)
        K.copy(plan, flat, ts[0], scale_bits(scale), scale != 1.0, accumulate, f64, warps)
    w.finish()


@unflatten_impl.register("numba")
def _unflatten_numba(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool) -> None:
    from .. import numba_common as nb
    from . import numba as kernels

    w = Writable(tensors, accumulate)
    flat_arr = nb.as_array(flat)
    for ts, offs in numba_groups(w.targets, flat_offsets(w.targets)):
        base, span, addrs = numba_span(ts)
        table, tile_map, n_tiles = launch_tables(ts, offs, addrs, NUMBA_TILE, flat.device, "numba")
        kernel = kernels.unflatten_kernel(flat.dtype, ts[0].dtype)
        nb.launch(
            kernel, n_tiles, nb.THREADS, flat.device,
            nb.as_array(table), nb.as_array(tile_map), nb.span_array(base, span, ts[0].dtype),
            flat_arr, scale, accumulate, NUMBA_TILE,
        )  # fmt: skip
    w.finish()


@reduce_impl.register("torch")
def reduce_torch(buffers: list[torch.Tensor], out: torch.Tensor | None, op: str) -> torch.Tensor:
    """Into ``out``; with ``out=None`` (fp32/fp64 buffers of one dtype, at least two), into a new tensor."""
    if out is None:  # the direct path's case: the first two combined into a new tensor, no copy
        acc = (torch.maximum if op == "max" else torch.add)(buffers[0], buffers[1])
        for b in buffers[2:]:
            torch.maximum(acc, b, out=acc) if op == "max" else acc.add_(b)
        return acc.div_(len(buffers)) if op == "avg" else acc
    c = compute_dtype(buffers[0].dtype, out.dtype)
    rest = buffers[1:]
    if out.dtype == c and not any(b.data_ptr() == out.data_ptr() for b in rest):
        acc = out  # accumulate in place: no temporary
        if rest and buffers[0].dtype == c and rest[0].dtype == c:  # the first two in one pass
            (torch.maximum if op == "max" else torch.add)(buffers[0], rest[0], out=acc)
            rest = rest[1:]
        else:
            acc.copy_(buffers[0])
    else:
        acc = buffers[0].to(c, copy=True)
    for b in rest:
        b = b.to(c) if b.dtype != c else b
        if op == "max":
            torch.maximum(acc, b, out=acc)
        else:
            acc.add_(b)
    if op == "avg":
        acc.div_(len(buffers))
    if acc is not out:
        out.copy_(acc)
    return out


def _spans(n: int, block: int, warps: int):
    """``common.spans`` with each launch's BLOCK: the one-program tail (< 16 elements, narrow accesses) at one
    element a thread, so its scalar addressing stays within the bulk's registers."""
    for grid, start, end in spans(n, block):
        yield grid, start, end, (block if end % VEC == 0 and end > start else 32 * warps)


@reduce_impl.register("triton")
def _reduce_triton(buffers: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
    from . import triton as K

    numel = out.numel()
    if numel == 0:
        return
    addrs = [b.data_ptr() for b in buffers]
    ptrs = ptr_table(addrs + [0] * (len(addrs) % 2), out.device, "triton-reduce")  # (read in pairs)
    m = tuned_meta("bucket_reduce", out.device, buffers[0].dtype, numel, "triton")
    f64 = compute_dtype(buffers[0].dtype, out.dtype) == torch.float64
    warps = m.get("num_warps", TRITON_WARPS)
    bulk = m.get("BLOCK") or (TRITON_BLOCK // 2 if f64 else TRITON_BLOCK) * warps // TRITON_WARPS
    aligned = all(a % 16 == 0 for a in addrs)
    K.bucket_reduce(
        ptrs, out, buffers[0], len(buffers), REDUCE_CODE[op], f64, aligned, warps, _spans(numel, bulk, warps)
    )


@reduce_impl.register("numba")
def _reduce_numba(buffers: list[torch.Tensor], out: torch.Tensor, op: str) -> None:
    from .. import numba_common as nb
    from . import numba as kernels

    numel = out.numel()
    if numel == 0:
        return
    isz = buffers[0].element_size()
    if len({b.data_ptr() % isz for b in buffers}) > 1:  # not a whole number of elements apart
        buffers = [buffers[0]] + [b.clone() if (b.data_ptr() - buffers[0].data_ptr()) % isz else b for b in buffers[1:]]
    base, span, offs = numba_span(buffers)
    kernel = kernels.reduce_kernel(buffers[0].dtype, out.dtype, REDUCE_CODE[op])
    table = ptr_table(offs, out.device, "numba-reduce")
    blocks = -(-numel // NUMBA_TILE)
    nb.launch(
        kernel, blocks, nb.THREADS, out.device,
        nb.as_array(table), nb.span_array(base, span, buffers[0].dtype), nb.as_array(out), numel, NUMBA_TILE,
    )  # fmt: skip


@wire_impl.register("torch")
def _wire_torch(x, out, divisor, count_bad):
    out.copy_(x)
    if divisor != 1.0:
        out.div_(divisor)
    return nonfinite_count(out) if count_bad else 0


@wire_impl.register("triton")
def _wire_triton(x, out, divisor, count_bad):
    from . import triton as K

    n = x.numel()
    bad = torch.zeros(1, dtype=torch.int32 if n < 2**31 else torch.int64, device=x.device)  # (holds at most n)
    K.wire_cast(x, out, bad, divisor, count_bad, TRITON_WARPS, _spans(n, TRITON_BLOCK, TRITON_WARPS))
    return bad


@wire_impl.register("numba")
def _wire_numba(x, out, divisor, count_bad):
    from .. import numba_common as nb
    from . import numba as kernels

    bad = torch.zeros(1, dtype=torch.int64, device=x.device)
    n = x.numel()
    kernel = kernels.wire_cast_kernel(x.dtype, out.dtype)
    nb.launch(kernel, max(1, -(-n // nb.TILE)), nb.THREADS, x.device, nb.as_array(x), nb.as_array(out),
              nb.as_array(bad), n, float(divisor), divisor != 1.0)  # fmt: skip
    return bad


@wire_impl.register("cpu")
def _wire_cpu(x, out, divisor, count_bad):
    from . import cpu as K

    return K.wire_cast(x, out, divisor, count_bad)


# The cpu provider's bucket ops are the torch provider's: on the CPU, torch.cat(out=), _foreach_copy_ and
# the in-place adds are already one vectorised pass per tensor; a Numba loop would add nothing.
for _op, _impl in ((flatten_impl, _flatten_torch), (unflatten_impl, _unflatten_torch), (reduce_impl, reduce_torch)):
    _op.register("cpu")(_impl)
TORCH_IMPL = ("torch", "cpu")  # provider names that run the torch implementations above


# --------------------------------------------------------------------------------------------------
# Running an op: its provider selected, on its device (the custom ops' bodies and the direct path's calls)


def flatten_into(tensors: list[torch.Tensor], out: torch.Tensor, scale: float, provider: str) -> None:
    """``tensors`` into ``out`` (of their total size) by ``provider`` ("" selects automatically)."""
    if out.numel() == 0:
        return
    name = flatten_impl.select(out.device, out.dtype, out.numel(), provider or None)
    with on_device(out.device):
        flatten_impl(name, tensors, out.view(-1), scale)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor], scale: float, accumulate: bool,
                   provider: str, traced: bool = False) -> None:  # fmt: skip
    """``traced``: the public function was traced (torch.compile) and left the memory checks to run here."""
    if traced:
        check_unflatten_memory(flat, tensors, Ranges.of(tensors))
    if flat.numel() == 0:
        return
    name = unflatten_impl.select(flat.device, flat.dtype, flat.numel(), provider or None)
    with on_device(flat.device):
        unflatten_impl(name, flat.reshape(-1).contiguous(), tensors, scale, accumulate)


def reduce_new(buffers: list[torch.Tensor], op: str, provider: str) -> torch.Tensor:
    """The reduction into a new contiguous tensor of the buffers' shape and dtype."""
    out = torch.empty_like(buffers[0], memory_format=torch.contiguous_format)
    reduce_into(buffers, out, op, provider)
    return out


def reduce_into(buffers: list[torch.Tensor], out: torch.Tensor, op: str, provider: str) -> None:
    if out.numel() == 0:
        return
    name = reduce_impl.select(out.device, buffers[0].dtype, out.numel(), provider or None)
    with on_device(out.device):
        reduce_impl(name, [b.contiguous().view(-1) for b in buffers], out.view(-1), op)
