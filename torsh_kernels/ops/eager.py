"""The direct path: when a public op may call its implementation without torch.library's dispatcher.

Every public op is a ``torch.library.custom_op`` so that ``torch.compile``, fake tensors, ``opcheck`` and
tensor subclasses see one opaque, well-described operation. In a plain eager call that dispatch only
leads back to the same Python implementation, through an autograd wrapper, ADInplaceOrView, a backend
redispatch and a dynamo-disable frame: 20-60 us a call. :func:`direct` says when that detour can be
skipped without changing what happens:

- nothing is tracing (``torch.compiler.is_compiling()``), no ``TorchDispatchMode`` (FakeTensorMode,
  FunctionalTensorMode, ...) and no ``TorchFunctionMode`` is active, no functorch transform (vmap, grad)
  is running;
- every tensor argument is a plain ``torch.Tensor`` (or ``nn.Parameter``, whose ``__torch_function__`` is
  disabled): no subclass, no fake or meta tensor.

Otherwise the public op calls the registered custom op, exactly as before. On the direct path an op
without registered autograd runs its implementation under no-grad (what the dispatcher gave it: its
outputs never require grad). An op with registered autograd (the MoE route, permute, unpermute) runs its
implementation directly when no gradient is needed, and when one is, through :class:`_Direct`, a
``torch.autograd.Function`` whose forward is the implementation and whose ``setup_context`` and backward
are the ones registered with ``torch.library.register_autograd``: the same graph node's arithmetic
without the dispatcher's chain (the field's practice: autograd in a Function outside the op). Tensors a
Triton, Numba or cpu kernel wrote are marked modified (their autograd version counter bumped, as
ADInplaceOrView does); the torch provider writes through in-place torch ops, which do that themselves.
"""

from __future__ import annotations

import importlib

import torch

PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode = torch._C._is_torch_function_mode_enabled
_functorch_level = torch._C._functorch.maybe_current_level
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled
_bump = torch._C._increment_version

compiling = _is_compiling
"""Whether dynamo is tracing (``torch.compiler.is_compiling``; a constant True while ``torch.compile`` traces).
A public op's validation then keeps to what the tensors' metadata says (shapes, dtypes, devices, strides)
and leaves the checks that read their memory (overlaps, addresses) or values (an index range, NaN/Inf)
to its custom op, which runs them at run time on the real tensors (the op's ``traced`` argument): the
same errors, raised by the compiled call. The eager path reads this flag once, on the general path only."""


def deferred(*tensors: torch.Tensor | None) -> bool:
    """Whether a public op must leave its checks of memory (overlaps, addresses) and values (index ranges,
    NaN/Inf) to its custom op: while ``torch.compile`` traces (they run at run time, on the real tensors),
    or when a tensor is on the meta device (there is nothing to read: the op's fake implementation runs and
    returns meta tensors of the result's shape). Shapes, dtypes, devices and strides are checked either way."""
    return _is_compiling() or any(t is not None and t.is_meta for t in tensors)


def unmoded() -> bool:
    """No tracing, no dispatch or function mode, no functorch transform active."""
    return not (_is_compiling() or _dispatch_modes() or _function_mode() or _functorch_level() is not None)


def plain(t: object) -> bool:
    """``t`` is None or a plain, real (not meta) tensor."""
    return t is None or (type(t) in PLAIN_TYPES and not t.is_meta)


def direct(*tensors: object) -> bool:
    """Whether an op over these tensor arguments may call its implementation directly."""
    if _is_compiling() or _dispatch_modes() or _function_mode() or _functorch_level() is not None:
        return False
    return all(t is None or (type(t) in PLAIN_TYPES and not t.is_meta) for t in tensors)


class no_grad:
    """``with no_grad():`` grad mode off for the block, as a custom op's implementation runs below autograd:
    ``torch.no_grad`` without its Python-level bookkeeping (a fraction of a microsecond, where the direct
    and fast paths count microseconds)."""

    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        self._prev = _grad_enabled()
        if self._prev:
            _set_grad(False)

    def __exit__(self, *exc) -> None:
        if self._prev:
            _set_grad(True)


def run(fn, *args):
    """``fn(*args)`` with grad mode off, as a custom op's implementation runs below autograd."""
    if not _grad_enabled():
        return fn(*args)
    with no_grad():
        return fn(*args)


def written(provider: str, *tensors: torch.Tensor | None) -> None:
    """Mark tensors a non-torch provider wrote as modified (autograd's version counter)."""
    if provider != "torch":
        _bump(tuple(t for t in tensors if t is not None))


def lazy_module(name: str):
    """A loader for ``torsh_kernels.ops.<name>``: imported on the first call, the module itself after (a
    fast path's kernels: ``K = _cpu_kernels()``, with nothing imported until a fast path runs)."""
    mod = None

    def load():
        nonlocal mod
        if mod is None:
            mod = importlib.import_module(f"torsh_kernels.ops.{name}")
        return mod

    return load


def bump(*tensors: torch.Tensor | None) -> None:
    """Mark tensors a fast path wrote through their memory (not through a torch op) as modified."""
    _bump(tuple(t for t in tensors if t is not None))


def _direct_args(args: tuple) -> bool:
    """No mode or transform active, and every tensor argument (in lists too) plain and real."""
    if _is_compiling() or _dispatch_modes() or _function_mode() or _functorch_level() is not None:
        return False
    for a in args:
        ta = type(a)
        if ta in PLAIN_TYPES:
            if a.is_meta:
                return False
        elif ta is list or ta is tuple:
            for t in a:
                if type(t) not in PLAIN_TYPES or t.is_meta:
                    return False
        elif isinstance(a, torch.Tensor):  # a subclass
            return False
    return True


def call(op, mutated: tuple[int, ...], *args):
    """``op(*args)`` for a custom op ``op``: its implementation called directly when :func:`direct` allows
    (under no-grad; the tensors at positions ``mutated`` marked modified afterwards), else through the
    dispatcher."""
    fn = getattr(op, "_init_fn", None)
    if fn is None or not _direct_args(args):
        return op(*args)
    out = run(fn, *args)
    if mutated:
        _mark(args, mutated)
    return out


class _Direct(torch.autograd.Function):
    """An op with registered autograd, run directly while a gradient is needed: forward is the op's
    implementation, then its registered ``setup_context``; backward is its registered backward. One
    subclass per op (:func:`_direct_fn`) carries the op, so the Function's inputs are exactly the op's
    (``ctx.needs_input_grad`` lines up with the registered backward's view of them)."""

    op = None
    impl = None  # another implementation of the op's forward (a fast path's kernel), or None: the op's own

    @classmethod
    def forward(cls, ctx, *args):
        ctx.set_materialize_grads(False)  # None for an unused output, as the registered backward expects
        out = (cls.impl or cls.op._init_fn)(*args)
        cls.op._setup_context_fn(ctx, args, out)
        return out

    @classmethod
    def backward(cls, ctx, *grads):
        return cls.op._backward_fn(ctx, *grads)


_DIRECT: dict[tuple, type] = {}


def _direct_fn(op, impl=None) -> type:
    f = _DIRECT.get((op, impl))
    if f is None:
        name = f"_Direct_{getattr(op, '_name', 'op')}"
        f = _DIRECT[(op, impl)] = type(name, (_Direct,), {"op": op, "impl": staticmethod(impl) if impl else None})
    return f


def autograd_fast(op, impl, *args):
    """A fast path of an op with registered autograd while a gradient is needed: ``impl`` (the same
    outputs as the op's implementation, computed another way) as the forward of :class:`_Direct`, the op's
    registered ``setup_context`` and backward around it. The caller has checked that nothing traces and
    no mode is active (``fast()``) and that the tensors are plain."""
    return _direct_fn(op, impl).apply(*args)


def call_autograd(op, *args):
    """Like :func:`call` for an op with registered autograd and no mutations: its implementation directly
    when no argument needs a gradient, through :class:`_Direct` when one does (no mode, no subclass)."""
    fn = getattr(op, "_init_fn", None)
    if fn is None or not _direct_args(args):
        return op(*args)
    if not _needs_grad_args(args):
        return run(fn, *args)
    if getattr(op, "_backward_fn", None) is None or getattr(op, "_setup_context_fn", None) is None:
        return op(*args)
    return _direct_fn(op).apply(*args)


def _needs_grad_args(args: tuple) -> bool:
    if not _grad_enabled():
        return False
    for a in args:
        if type(a) in PLAIN_TYPES:
            if a.requires_grad:
                return True
        elif (type(a) is list or type(a) is tuple) and any(t.requires_grad for t in a):
            return True
    return False


def _mark(args: tuple, mutated: tuple[int, ...]) -> None:
    ts = []
    for i in mutated:
        a = args[i]
        if type(a) is list or type(a) is tuple:
            ts.extend(a)
        elif a is not None:
            ts.append(a)
    if ts:
        _bump(tuple(ts))


# --------------------------------------------------------------------------------------------------
# Fast paths. A public op may compute its common case (plain, contiguous CPU tensors of one shape, the
# torch provider selected) straight from its arguments, without flattening views or the custom op: the
# same torch calls on the same elements, so the same results. It falls back to the general path (which
# validates and raises the typed errors) whenever anything is unusual.

from .. import recording  # noqa: E402

_T = torch.Tensor


def fast() -> bool:
    """Nothing traces, no mode or transform is active and no op recorder listens: a fast path may run."""
    return (
        recording.recorder is None
        and not (_is_compiling() or _dispatch_modes() or _function_mode())
        and _functorch_level() is None
    )


def disjoint_or_same(a: torch.Tensor, b: torch.Tensor, nbytes: int) -> bool:
    """Two contiguous tensors of ``nbytes`` bytes each (one dtype) are the same elements or share no byte."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa == pb or not (pa < pb + nbytes and pb < pa + nbytes)


def disjoint(a: torch.Tensor, b: torch.Tensor, nbytes: int) -> bool:
    """Two contiguous tensors of ``nbytes`` bytes each share no byte."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return not (pa < pb + nbytes and pb < pa + nbytes)


# The tests every family's CPU fast path makes, one definition each (a fast path is a conjunction of these and
# its own size and option conditions; anything unusual falls through to the validated path).
_F32 = torch.float32
_CPU = torch.device("cpu")
_INF = float("inf")


def cpu_dense(t: object, dtype: torch.dtype = _F32) -> bool:
    """``t`` is exactly a ``torch.Tensor`` (no subclass, no Parameter) of ``dtype``, on the CPU, contiguous."""
    return type(t) is _T and t.dtype is dtype and t.is_cpu and t.is_contiguous()


def cpu_dense_or_none(t: object, n: int, dtype: torch.dtype = _F32) -> bool:
    """``t`` is None, or a :func:`cpu_dense` tensor of ``n`` elements (an optional residual or output)."""
    return t is None or (type(t) is _T and t.dtype is dtype and t.is_cpu and t.is_contiguous() and t.numel() == n)


def finite_scalar(a: object) -> bool:
    """``a`` is a finite Python float or int (not a bool, a NumPy scalar or a tensor)."""
    return (a.__class__ is float or a.__class__ is int) and -_INF < a < _INF


def picks(op, n: int, provider: str | None, name: str, dtype: torch.dtype = _F32) -> bool:
    """A fast path may run (:func:`fast`) and ``op`` chooses provider ``name`` for ``n`` CPU elements of ``dtype``
    (``provider`` as the caller gave it: None or "" for the tuned or default choice). Call it before anything
    reads an address: under torch.compile it is False before ``data_ptr`` would be traced."""
    return fast() and op.select(_CPU, dtype, n, provider or None) == name
