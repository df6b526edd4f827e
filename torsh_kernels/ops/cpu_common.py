"""Plumbing of the cpu provider: fused CPU kernels compiled by Numba's CPU target.

Imported lazily (on the cpu provider's first launch), so ``import torsh_kernels`` does not import Numba.

- Tensors reach kernels zero-copy, as their data addresses and sizes (see the pointer entry points
  below), or as NumPy views (:func:`arr`) where a kernel takes a span of many. The kernels compute in fp32
  (fp64 where the op does): a 16-bit input is converted by torch first (:func:`f32`), as the torch
  provider does, and a 16-bit output is written by ``copy_`` from an fp32 result (:func:`store`), so the
  rounding is torch's own.
- Kernels are ``njit(cache=True, nogil=True)``: compiled for this CPU on the first call of each
  signature and cached on disk beside the module (or in Numba's user cache directory where that is not
  writable), so a later process loads machine code instead of compiling; they release the GIL, so DDP's
  communication threads and autograd's can run them concurrently.
- The first run on a machine compiles them (seconds): when one compile of a torsh kernel has lasted
  :data:`NOTICE_AFTER_S`, stderr says ``torsh: compiling kernels (first run only)...`` and, when it ends,
  how long it took; once per process, never on a cache hit (Numba reports a compile only on a cache miss),
  and never under ``TORSH_QUIET=1`` (:class:`CompileNotice`).
- Inner loops run from 0 over a slice, with branch-free selects: Numba then knows every index is
  non-negative, and LLVM vectorises them (a loop over ``range(a, b)`` with the wraparound check of a
  possibly negative index does not vectorise).
- Kernels are called through *pointer entry points* (``*_ptr``): they take the tensors' data addresses
  and sizes as integers and view the memory with ``numba.carray`` inside the kernel (the ``p_*`` casts
  below), which costs 0.1 us a tensor where a NumPy view costs 0.7 us. The caller has checked each
  tensor (CPU, contiguous, of the kernel's dtype and size) before passing its address, and holds a
  reference to it until the call returns.
- The helpers at the end are shared by the families' kernels: the fp32 <-> bits casts, the pointer
  casts, the stochastic rounding hash (the same bits as the torch reference's and the GPU kernels').
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import torch
from llvmlite import ir
from numba import carray, njit, types
from numba.core import event
from numba.extending import intrinsic

__all__ = ["NOTICE", "CompileNotice", "arr", "carray", "f32", "jit", "span", "store"]

QUIET_ENV = "TORSH_QUIET"
"""Set to 1 (true, yes, on) to silence the compile notice."""
NOTICE_AFTER_S = 0.5
"""How long a compile lasts before the notice is printed."""


class CompileNotice(event.Listener):
    """A listener of Numba's ``numba:compile`` event, which Numba fires only when it compiles (a signature not
    in the process and not in the on-disk cache): when one compile of a function from ``modules`` (nested
    compiles count as part of the outermost) has lasted ``after`` seconds, stderr says so, and when it ends,
    how long it took. Once per process; silent when ``TORSH_QUIET`` is set."""

    def __init__(self, after: float = NOTICE_AFTER_S, modules: tuple[str, ...] = ("torsh_kernels.",)) -> None:
        self.after, self.modules = after, modules
        self.done = False
        """The notice was given (or compiling was found quiet): nothing more is said in this process."""
        self._depth = 0
        self._t0: float | None = None  # the outermost compile being watched
        self._said = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def on_start(self, ev) -> None:
        self._depth += 1
        if self._depth != 1 or self.done:
            return
        fn = getattr(ev.data.get("dispatcher"), "py_func", None)
        if not (getattr(fn, "__module__", None) or "").startswith(self.modules):
            return
        self._t0 = time.perf_counter()
        if self.after > 0:
            self._timer = threading.Timer(self.after, self._announce)
            self._timer.daemon = True
            self._timer.start()
        else:
            self._announce()

    def on_end(self, ev) -> None:
        self._depth -= 1
        if self._depth or self._t0 is None:
            return
        took = time.perf_counter() - self._t0
        with self._lock:
            self._t0 = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._said:
                self._say(f"torsh: compiled in {took:.1f} s (cached on disk: later runs load it)")
                self.done = True
            elif took >= self.after and not self.done:  # the timer had no chance to run: say both at once
                self._say(f"torsh: compiling kernels (first run only) took {took:.1f} s")
                self.done = True

    def _announce(self) -> None:
        with self._lock:
            if self._t0 is not None and not self._said and not self.done:
                self._said = self._say("torsh: compiling kernels (first run only)...")

    def _say(self, text: str) -> bool:
        if os.environ.get(QUIET_ENV, "0").strip().lower() in ("1", "true", "yes", "on"):
            return False
        print(text, file=sys.stderr, flush=True)
        return True


NOTICE = CompileNotice()
"""The process's notice for the cpu provider's kernels (registered when this module is imported)."""
event.register("numba:compile", NOTICE)

_F32 = torch.float32


def jit(fn):
    """The cpu provider's compilation: machine code for this CPU, cached on disk, the GIL released."""
    return njit(cache=True, nogil=True)(fn)


def arr(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a CPU tensor's elements (no copy; the tensor must be contiguous)."""
    return (t.detach() if t.requires_grad else t).numpy()


def f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as fp32 (itself when it is: no copy)."""
    return t if t.dtype is _F32 else t.float()


def store(out: torch.Tensor, compute):
    """Run ``compute(address)`` on fp32 memory holding ``out``'s values: ``out``'s own when it is fp32,
    else an fp32 copy that is then written back with torch's rounding (``compute`` may read it:
    accumulation). Returns what ``compute`` returns."""
    if out.dtype is _F32:
        return compute(out.data_ptr())
    tmp = out.float()
    r = compute(tmp.data_ptr())
    out.copy_(tmp)
    return r


class _HostSpan:
    """Carries ``__array_interface__`` so NumPy wraps a host address range without copying it."""

    def __init__(self, ptr: int, n: int, dtype: np.dtype) -> None:
        self.__array_interface__ = {"shape": (n,), "typestr": dtype.str, "data": (ptr, False), "version": 3}


def span(tensors: list[torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """One 1-D array over the memory from the lowest tensor's first element to the end of the highest, and
    each tensor's element offset into it (contiguous tensors of one dtype, whole elements apart): a
    kernel then reaches any number of tensors through one argument."""
    t0 = tensors[0]
    isz = t0.element_size()
    base = min(t.data_ptr() for t in tensors)
    offs = np.array([(t.data_ptr() - base) // isz for t in tensors], dtype=np.int64)
    n = max(int(o) + t.numel() for o, t in zip(offs, tensors))
    dtype = np.dtype({torch.float32: np.float32, torch.float64: np.float64}[t0.dtype])
    return np.asarray(_HostSpan(base, n, dtype)), offs


# --------------------------------------------------------------------------------------------------
# Shared kernel helpers


@intrinsic
def bits_f32(typingctx, bits):
    """An int32 bit pattern as the float32 with those bits."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def f32_bits(typingctx, v):
    """A float32's bit pattern as an int32."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


def _pointer_cast(nbtype):
    @intrinsic
    def cast(typingctx, addr):
        sig = types.CPointer(nbtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.CPointer(nbtype)))

        return sig, codegen

    return cast


# An integer address as a typed pointer, for ``carray(p_f32(address), shape)`` in a pointer entry point.
p_f32 = _pointer_cast(types.float32)
p_f64 = _pointer_cast(types.float64)
p_i64 = _pointer_cast(types.int64)
p_i32 = _pointer_cast(types.int32)
p_i16 = _pointer_cast(types.int16)
p_i8 = _pointer_cast(types.int8)
p_u8 = _pointer_cast(types.uint8)
p_b = _pointer_cast(types.boolean)

_M32 = np.uint64(0xFFFFFFFF)


@njit(inline="always", cache=True)
def _lowbias32(h):
    """lowbias32 on a uint64 holding 32 bits (products taken modulo 2**32)."""
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & _M32
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & _M32
    return h ^ (h >> np.uint64(16))


@njit(inline="always", cache=True)
def uniform(i, key):
    """u in [0, 1) for element index ``i`` (used modulo 2**32) and a 32-bit seed key: the torch
    reference's ``uniform_noise``, bit for bit."""
    h = _lowbias32(_lowbias32(np.uint64(i) & _M32) ^ np.uint64(key))
    return np.float32(h >> np.uint64(8)) * np.float32(1.0 / 16777216.0)
