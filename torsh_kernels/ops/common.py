"""Helpers shared by the op families: validation, memory ranges, launch tables, scratch buffers, finite checks.

Private to ``torsh_kernels.ops``: the family modules import from here; nothing here imports Triton or Numba.

The compression families (``topk``, ``quantize``, ``sign``, ``orthogonalize``, ``error_feedback``) work
on the flattened elements of their input (any shape; fp32, fp16 or bf16) and compute in fp32. Their
payloads are plain tensors, so the collectives layer can all-reduce or all-gather them. Non-finite inputs
are reported, not spread: compressing ops count NaN/Inf in their first pass and raise
:class:`NonFiniteError` before writing anything the caller owns (``check_finite=False`` skips the check
and its host synchronisation).
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import (
    ArgumentTypeError,
    DeviceMismatchError,
    DTypeError,
    InvalidArgumentError,
    NonFiniteError,
    ShapeError,
)
from .registry import Op

COMPRESS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_is_compiling = torch.compiler.is_compiling

# Kernel geometry of the compression families' elementwise passes (memory-bound).
BLOCK = 4096
WARPS = 8


# --------------------------------------------------------------------------------------------------
# Validation


def check_tensor(t: object, what: str, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ArgumentTypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_dtype(t: torch.Tensor, what: str, name: str, allowed=COMPRESS_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise DTypeError(f"{what}: {name} has dtype {t.dtype}; expected one of {names}")


def flat_input(x: object, what: str, name: str = "x") -> torch.Tensor:
    """A floating input as a contiguous 1-D tensor (a view when it already is contiguous)."""
    x = check_tensor(x, what, name)
    check_dtype(x, what, name)
    if x.is_contiguous():
        return x.detach().view(-1)
    check_strided(x, what, name)
    return x.detach().reshape(-1).contiguous()


def check_strided(t: torch.Tensor, what: str, name: str) -> None:
    """A strided or expanded view the op copies into a contiguous tensor: its elements must fit in its
    device's memory (an ``expand()`` can claim any number of elements without memory behind them)."""
    if not t.is_contiguous() and t.numel() * t.element_size() > device_bytes(t.device):
        raise InvalidArgumentError(
            f"{what}: {name} is a strided view of {t.numel()} elements ({t.numel() * t.element_size() / 2**30:.4g} "
            f"GiB), more than the {t.device.type} memory holds ({device_bytes(t.device) / 2**30:.4g} GiB); the op "
            "needs its elements in memory: pass a smaller tensor"
        )


def flat_inout(t: object, what: str, name: str, numel: int, device: torch.device) -> torch.Tensor:
    """A tensor the op writes: contiguous, ``numel`` elements, on ``device``; as a 1-D view."""
    t = check_tensor(t, what, name)
    check_dtype(t, what, name)
    if t.device != device:
        raise DeviceMismatchError(f"{what}: {name} is on {t.device}, the input on {device}")
    if t.numel() != numel:
        raise ShapeError(f"{what}: {name} has {t.numel()} elements, expected {numel} (one per input element)")
    if not t.is_contiguous():
        raise ShapeError(f"{what}: {name} must be contiguous (it is written in place)")
    return t.detach().view(-1)


def no_overlap(a: torch.Tensor, b: torch.Tensor, what: str, na: str, nb: str, *, same_ok: bool = False) -> None:
    """Raise if ``a`` and ``b`` share memory (unless ``same_ok`` and they are the same elements)."""
    abytes, bbytes = _extent(a) * a.element_size(), _extent(b) * b.element_size()
    if not abytes or not bbytes:
        return
    alo, blo = a.data_ptr(), b.data_ptr()
    if not (alo < blo + bbytes and blo < alo + abytes):  # the byte ranges Ranges compares, without numpy
        return
    if same_ok and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel():
        return
    raise ShapeError(f"{what}: {na} overlaps {nb}; pass separate buffers")


def check_alpha(alpha: object, what: str) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ArgumentTypeError(f"{what}: alpha must be a real number, got {type(alpha).__name__}")
    if not math.isfinite(alpha):
        raise InvalidArgumentError(f"{what}: alpha must be finite, got {alpha}")
    return float(alpha)


class Sealable:
    """A base for the ops' result objects a later op trusts (:class:`Routing`, :class:`Packed`): a ``_seal``
    slot that is not a dataclass field, so it is no argument of ``__init__`` and ``dataclasses.replace``,
    ``copy`` and pickling leave it out (their results are checked in full on first use). The producing op
    fills it; the consuming op compares it with the object as it is now."""

    __slots__ = ("_seal",)


# --------------------------------------------------------------------------------------------------
# Sizes a caller states (a numel, a shape) that the op would allocate: refused when no device could hold them


def _host_bytes() -> int:
    """Physical memory of this machine in bytes (2**62 where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 2**62


HOST_BYTES = _host_bytes()
"""The machine's physical memory: no host tensor a call allocates may be larger."""
_DEVICE_BYTES: dict[torch.device, int] = {}


def device_bytes(device: torch.device) -> int:
    """The memory of ``device`` in bytes: the host's for CPU tensors, the GPU's total for CUDA ones, 2**62
    for a device without memory (meta) or one torch does not report."""
    b = _DEVICE_BYTES.get(device)
    if b is None:
        if device.type == "cpu":
            b = HOST_BYTES
        elif device.type == "cuda":
            try:
                b = int(torch.cuda.get_device_properties(device).total_memory)
            except Exception:  # pragma: no cover - no driver
                b = 2**62
        else:
            b = 2**62
        _DEVICE_BYTES[device] = b
    return b


def _check_alloc(numel: int, itemsize: int, device: torch.device, what: str, name: str) -> None:
    """InvalidArgumentError when ``numel`` elements of ``itemsize`` bytes cannot fit in ``device``'s memory
    (a size the caller stated, checked before anything is allocated)."""
    if numel * itemsize > device_bytes(device):
        raise InvalidArgumentError(
            f"{what}: {name}={numel} elements of {itemsize} bytes ({numel * itemsize / 2**30:.4g} GiB) cannot fit "
            f"in the {device.type} memory ({device_bytes(device) / 2**30:.4g} GiB); pass the element count of the "
            "tensor that was compressed"
        )


def as_count(bad) -> int:
    """A provider's count (a host int from the cpu provider, an int64 tensor from the others) as an int."""
    return bad if type(bad) is int else int(bad.item())


class LazyNonFiniteCount:
    """A non-finite count a provider returns instead of a device counter its kernels would keep with atomics,
    worked out when read (``as_count`` calls ``item()``; nobody does with ``check_finite=False``). ``summary`` is a
    tensor whose sum is NaN or Inf only when ``values()`` holds NaN/Inf (the quantizer's block scales: NaN for a
    block holding one; the sign compressor's sum of ``|x + r|``): one read answers 0 in the common case; else the
    elements are counted (a finite sum that overflowed counts 0, rightly)."""

    __slots__ = ("_summary", "_values")

    def __init__(self, summary: torch.Tensor, values: Callable[[], torch.Tensor]) -> None:
        self._summary, self._values = summary, values

    def item(self) -> int:
        if math.isfinite(self._summary.sum().item()):
            return 0
        return int((~torch.isfinite(self._values())).sum())


def raise_nonfinite(bad: int, what: str, name: str) -> None:
    raise NonFiniteError(
        f"{what}: {name} holds {bad} non-finite element(s) (NaN or Inf); nothing was compressed and no "
        "residual was modified. Find the source (a loss scale too high, a diverging step) or skip the "
        "step; pass check_finite=False to compress anyway."
    )


def decode_out(out, numel, dtype, device, what, accumulate=False) -> tuple[torch.Tensor, torch.Tensor]:
    """A decompressing op's output and its 1-D view: ``out`` checked, or a new ``dtype`` tensor (not with
    ``accumulate``: there would be nothing to add to)."""
    if out is None:
        if accumulate:
            raise InvalidArgumentError(f"{what}: accumulate=True needs out= (the tensor to add to)")
        if dtype not in COMPRESS_DTYPES:
            raise DTypeError(f"{what}: dtype={dtype}; expected float32, float16 or bfloat16")
        _check_alloc(numel, dtype.itemsize, device, what, "numel")
        out = torch.empty(numel, dtype=dtype, device=device)
    return out, flat_inout(out, what, "out", numel, device)


# --------------------------------------------------------------------------------------------------
# Memory ranges


def _extent(t: torch.Tensor) -> int:
    """Elements spanned in memory from the first element to the last (0 for an empty tensor)."""
    if t.is_contiguous():
        return t.numel()
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


@dataclass(frozen=True, slots=True)
class Ranges:
    """Byte ranges of a list of tensors: [lo, lo + nbytes), and which tensors are contiguous."""

    lo: np.ndarray
    nbytes: np.ndarray
    contig: np.ndarray

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> Ranges:
        n = len(tensors)
        contig = np.fromiter((t.is_contiguous() for t in tensors), dtype=bool, count=n)
        lo = np.fromiter((t.data_ptr() for t in tensors), dtype=np.int64, count=n)
        nbytes = np.fromiter((t.numel() if c else _extent(t) for t, c in zip(tensors, contig)), np.int64, n)
        if len({t.dtype for t in tensors}) == 1:
            nbytes *= tensors[0].element_size()
        else:
            nbytes *= np.fromiter((t.element_size() for t in tensors), dtype=np.int64, count=n)
        return cls(lo, nbytes, contig)

    def overlapping(self, other: torch.Tensor) -> np.ndarray:
        """Boolean mask: which tensors share at least one byte of memory range with ``other``."""
        if other.numel() == 0:
            return np.zeros(len(self.lo), dtype=bool)
        o_lo = other.data_ptr()
        o_hi = o_lo + _extent(other) * other.element_size()
        return (self.nbytes > 0) & (self.lo < o_hi) & (self.lo + self.nbytes > o_lo)

    def contiguous_clash(self) -> tuple[int, int] | None:
        """Indices of two contiguous, non-empty tensors sharing memory, or None. (Strided views are left
        out: interleaved views of one storage share a byte range without sharing elements.)"""
        idx = np.flatnonzero(self.contig & (self.nbytes > 0))
        if idx.size < 2:
            return None
        order = idx[np.argsort(self.lo[idx], kind="stable")]
        lo, hi = self.lo[order], self.lo[order] + self.nbytes[order]
        clash = np.flatnonzero(lo[1:] < np.maximum.accumulate(hi)[:-1])
        if not clash.size:
            return None
        k = int(clash[0]) + 1
        earlier = next(int(j) for j in range(k) if hi[j] > lo[k])
        return tuple(sorted((int(order[earlier]), int(order[k]))))


# --------------------------------------------------------------------------------------------------
# Validation cached per layout: an entry is found by the tensors' addresses (flatten: first by the list
# object) and confirmed by a C-level check of everything else the validation read (dynamo's TensorGuards:
# Python type, dtype, device, shape, strides, requires_grad, dispatch keys), so a hit costs one or two
# passes over the tensors in C and no Python per tensor. Where TensorGuards is missing (another torch),
# nothing is cached and every call validates.

try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - torch without dynamo's C guards
    _TensorGuards = None

_data_ptr = torch.Tensor.data_ptr


def tensor_guards(tensors: Sequence[torch.Tensor]):
    """A check that ``tensors`` still have the metadata they have now (``.check(*tensors) -> bool``), or None."""
    if _TensorGuards is None:
        return None
    try:
        return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])  # fmt: skip
    except Exception:
        return None


def ptrs_of(tensors: object) -> tuple[int, ...] | None:
    """The addresses of a list or tuple of tensors (one C-level pass), or None when it is not one."""
    if type(tensors) is not list and type(tensors) is not tuple:
        return None
    try:
        return tuple(map(_data_ptr, tensors))
    except (TypeError, RuntimeError):  # not tensors, or tensors without storage: the full check says which
        return None


class Memo:
    """A bounded map for validated layouts (oldest dropped first); lookups and stores are single dict
    operations, safe under the GIL from several threads."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.data: dict = {}

    def get(self, key):
        return self.data.get(key)

    def put(self, key, value) -> None:
        d = self.data
        d[key] = value
        while len(d) > self.size:
            try:
                d.pop(next(iter(d)), None)
            except (StopIteration, RuntimeError):
                break

    def pop(self, key) -> None:
        self.data.pop(key, None)

    def clear(self) -> None:
        self.data.clear()


# --------------------------------------------------------------------------------------------------
# Launch tables, cached per (device, stream, contents)

_TABLES: OrderedDict[tuple, object] = OrderedDict()  # launch tables: ptr_table, bucket/tables.py's launch_tables
_TABLES_MAX = 64


def stream_key(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


_TABLES_LOCK = threading.Lock()  # DDP comm hooks and autograd hooks may call from several threads


def cached_table(key: tuple, build):
    with _TABLES_LOCK:
        hit = _TABLES.get(key)
        if hit is not None:
            _TABLES.move_to_end(key)
            return hit
    value = build()
    with _TABLES_LOCK:
        _TABLES[key] = value
        if len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
    return value


def ptr_table(ptrs: list[int], device: torch.device, tag: str) -> torch.Tensor:
    """A cached int64 tensor of addresses (or offsets) on ``device``."""

    def build() -> torch.Tensor:
        table = torch.tensor(ptrs, dtype=torch.int64)
        return table.to(device) if device.type == "cuda" else table

    return cached_table((tag, device, stream_key(device), tuple(ptrs)), build)


def numba_span(tensors: Sequence[torch.Tensor]) -> tuple[int, int, list[int]]:
    """(lowest address, elements spanned, each tensor's element offset from it) for one dtype group."""
    isz = tensors[0].element_size()
    base = min(t.data_ptr() for t in tensors)
    offs = [(t.data_ptr() - base) // isz for t in tensors]
    span = max(o + _extent(t) for o, t in zip(offs, tensors))
    return base, span, offs


# --------------------------------------------------------------------------------------------------
# Launching


_NO_DEVICE = nullcontext()  # reusable


def on_device(device: torch.device):
    """Launch on the tensors' GPU (Triton launches on the current device), not on whatever is current."""
    return torch.cuda.device(device) if device.type == "cuda" else _NO_DEVICE


VEC = 16
"""Elements the bulk of an elementwise launch is a multiple of (see :func:`spans`)."""


def spans(n: int, block: int) -> list[tuple[tuple[int], int, int]]:
    """The Triton launches of an elementwise pass over ``n`` elements, as ``(grid, start, end)``; the kernel
    covers ``start + pid * block + arange(block)``, masked to ``< end``.

    Triton turns a masked access of 16-byte aligned data into 128-bit instructions only when it can prove the
    mask constant over each vector, i.e. ``end`` divisible by the vector width: its JIT proves that for an
    integer argument divisible by 16, and for nothing else. So the bulk ``[0, n - n % 16)`` is one launch whose
    ``end`` is divisible by 16 (128-bit accesses, whatever ``n``), and the last ``n % 16`` elements, when there
    are any, a second launch of one program (narrow accesses; its ``start`` is divisible by 16 too). With
    ``n == 0``, one launch of one program with nothing to do (kernels that write per-launch results still do)."""
    bulk = n - n % VEC
    out = [((-(-bulk // block),), 0, bulk)] if bulk else []
    if n % VEC or not bulk:
        out.append(((1,), bulk, n))
    return out


def whole_programs(n: int, tile: int, tail: int, bulk: bool = True) -> list[tuple[tuple[int], int, bool]]:
    """The Triton launches of a pass over ``n`` elements in units that must not span two launches (quantization
    blocks, sign bytes), as ``(grid, start, even)``: the bulk, whole programs of ``tile`` elements from element 0,
    unmasked (``even``: with 16-byte aligned tensors every access is as wide as the layout allows, whatever
    ``n``); then, if anything is left, programs of ``tail`` elements from ``start``, the bulk's end, masked to
    ``< n``. ``tile`` and ``tail`` are multiples of the unit. With ``bulk=False``, only the latter, from 0."""
    full = n // tile if bulk else 0
    out = [((full,), 0, True)] if full else []
    if n > full * tile:
        out.append(((-(-(n - full * tile) // tail),), full * tile, False))
    return out


def select_provider(op: Op, t: torch.Tensor, provider: str) -> str:
    return op.select(t.device, t.dtype, t.numel(), provider or None)


# --------------------------------------------------------------------------------------------------
# Error-feedback inputs, scratch buffers and the finite check


def acc_ref(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    acc = x.reshape(-1).float()
    return acc + residual.reshape(-1).float() if residual is not None else acc.clone()


def store_ref(v: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype, accumulate: bool) -> torch.Tensor:
    """Write decoded fp32 values ``v`` into ``out`` (a new ``dtype`` tensor if None), or add them to it."""
    if out is None:
        out = torch.empty(v.numel(), dtype=dtype, device=v.device)
    if accumulate:
        v = out.reshape(-1).float() + v
    out.view(-1).copy_(v)
    return out


def acc_torch(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x + r in fp32 (x alone without a residual): the torch providers' error-feedback input."""
    return x.float() + r.float() if r is not None else x.float()


def new_counter(device: torch.device, n: int = 1) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=device)


_SCRATCH = threading.local()


def scratch_buffer(device: torch.device, n: int) -> torch.Tensor:
    """A float32 work buffer of n elements, reused by later calls on this thread and device (its content
    is garbage; never returned to callers). Saves the allocation and first-touch page faults that a
    fresh tensor costs on the CPU for every call."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    b = bufs.get(device)
    if b is None or b.numel() < n:
        b = bufs[device] = torch.empty(n, dtype=torch.float32, device=device)
    return b[:n]


_HALF_FLOATS = (torch.float16, torch.bfloat16)


def finite_sum(v: torch.Tensor) -> bool:
    """The cheap check that every element of v is finite: True whenever every element is (a False may be
    a false alarm; the caller then counts exactly). One pass, one or two host reads: the fp32 sum (an
    overflowing sum is such a false alarm), or for 16-bit tensors the extremes (NaN and +-Inf show there),
    which ``aminmax`` finds twice as fast as an upcasting sum on the CPU."""
    if v.dtype in _HALF_FLOATS:
        lo, hi = torch.aminmax(v)
        return math.isfinite(lo.item()) and math.isfinite(hi.item())
    return math.isfinite((v.sum() if v.dtype is torch.float32 else v.sum(dtype=torch.float32)).item())


def nonfinite_count(v: torch.Tensor) -> torch.Tensor:
    """Number of NaN/Inf elements of v, as an int64 [1] tensor. The exact count (a bool pass and a sum over
    it, several times slower) only runs when the cheap check (:func:`finite_sum`) fails: NaN/Inf present,
    or a sum that overflowed. (The providers' count; they run on real tensors, never while dynamo traces.)"""
    if v.numel() == 0 or finite_sum(v):
        return new_counter(v.device)
    return (~torch.isfinite(v)).sum().view(1)


_COUNT_DTYPES = frozenset((*COMPRESS_DTYPES, torch.float64))


def count_nonfinite(v: torch.Tensor) -> torch.Tensor:
    """Number of NaN/Inf elements of v (fp32, fp16, bf16 or fp64, any shape), as an int64 [1] tensor (see
    :func:`nonfinite_count`). While ``torch.compile`` traces, and for a meta tensor, the exact count as
    graph operations (the cheap check reads a host value)."""
    if not isinstance(v, torch.Tensor):
        raise ArgumentTypeError(f"torsh_kernels.count_nonfinite: v must be a torch.Tensor, got {type(v).__name__}")
    if v.dtype not in _COUNT_DTYPES:
        raise DTypeError(
            f"torsh_kernels.count_nonfinite: v has dtype {v.dtype}; expected float32, float16, bfloat16 or float64"
        )
    if _is_compiling() or v.is_meta:  # (meta: a meta result of the right shape)
        return (~torch.isfinite(v)).sum().view(1)
    return nonfinite_count(v)
