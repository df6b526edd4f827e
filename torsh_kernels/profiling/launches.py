"""Kernel launches captured instead of run, and compiled for a named GPU target: how ``torsh inspect`` sees
each kernel exactly as a launcher specializes it, on a machine with no GPU.

- Triton: a stand-in driver names the target (``triton.runtime.driver.set_active``) and Triton's own
  ``jit_cache_hook`` receives each launch's specialization (argument types, 16-byte alignment and
  divisibility by 16 of every pointer and integer, constexprs, ``num_warps``/``num_stages``) from Triton's
  own binder, before anything would compile or run; the hook records it and stops the launch. The grid is
  read on the way in. The recorded specialization goes through ``triton.compile`` for the target, as the
  JIT would compile it.
- Numba: ``ops.numba_common.CAPTURE`` makes the one launch helper every Numba launcher uses record the kernel,
  grid and arguments; the argument types Numba would infer give the signature, compiled to PTX through
  NVVM for the target and assembled with ``ptxas``.

The launchers run on CPU tensors of the case's sizes and addresses (torch aligns CPU allocations to 64
bytes, CUDA ones to 256 or more, so both are 16-byte aligned); nothing is launched, so a launcher must not
read back what a kernel would have written (the cases in ``ops.launch_cases`` keep to such calls).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .sass import Arch

__all__ = ["Launch", "capture", "compile_launch"]


@dataclass(slots=True)
class Launch:
    """One captured launch."""

    provider: str
    """``triton`` or ``numba``."""
    kernel: str
    """The kernel function's name."""
    fn: Any
    """The Triton JITFunction or the Numba dispatcher."""
    grid: tuple[int, ...]
    warps: int
    spec: dict[str, Any] = field(default_factory=dict)
    """Triton: ``signature``, ``constants``, ``attrs``, ``options``; Numba: ``sig`` (Numba types)."""

    @property
    def programs(self) -> int:
        n = 1
        for g in self.grid:
            n *= int(g)
        return n

    def key(self) -> str:
        """What the compiled code depends on: two launches with one key compile to the same cubin."""
        if self.provider == "triton":
            s = self.spec
            opts = {k: s["options"].get(k) for k in ("num_warps", "num_stages", "enable_fp_fusion")}
            return f"triton:{self.kernel}:{s['signature']}:{s['constants']}:{s['attrs']}:{opts}"
        return f"numba:{self.kernel}:{id(self.fn)}:{self.spec['sig']}:{self.warps}"

    def describe(self) -> dict[str, Any]:
        """The specialization in JSON terms: constexprs, argument types (``D``: divisible by 16 / 16-byte
        aligned), launch configuration."""
        if self.provider == "triton":
            s = self.spec
            names = list(s["signature"])
            aligned = {names[k[0]] for k, v in s["attrs"].items() if any(a[0] == "tt.divisibility" for a in v)}
            args = {n: t + (" D" if n in aligned else "") for n, t in s["signature"].items() if t != "constexpr"}
            consts = {names[k[0]]: _plain(v) for k, v in s["constants"].items() if s["signature"][names[k[0]]] ==
                      "constexpr"}  # fmt: skip
            return {"constexprs": consts, "args": args, "num_warps": self.warps,
                    "num_stages": s["options"].get("num_stages")}  # fmt: skip
        return {"args": [str(t) for t in self.spec["sig"]], "threads": self.warps * 32}


def _plain(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)


class _Driver:
    """Triton's driver interface as far as the JIT's specialization needs it, for a GPU that is not here."""

    def __init__(self, arch: Arch) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch.capability, 32)
        self.device = 10_000 + arch.capability  # per target: the JIT caches its binder per device

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _triton_kernels() -> list[Any]:
    """Every JITFunction of the ops package's Triton modules and of the anchors (imported here: the launchers
    import them on first use, after which a wrapper could no longer be put in place)."""
    import importlib
    import importlib.util
    import pkgutil

    from triton.runtime.jit import JITFunction

    from .. import ops
    from . import anchors

    # each family is a package (ops/<family>/) that keeps its Triton kernels in its module triton.py
    names = [f"{m.name}.triton" for m in pkgutil.iter_modules(ops.__path__)
             if m.ispkg and importlib.util.find_spec(f"{ops.__name__}.{m.name}.triton")]  # fmt: skip
    mods = [anchors] + [importlib.import_module(f"{ops.__name__}.{n}") for n in names]
    return [v for mod in mods for v in vars(mod).values() if isinstance(v, JITFunction)]


@contextmanager
def _triton(arch: Arch, sink: list[Launch]) -> Iterator[None]:
    from triton import knobs
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    current: list[tuple[int, ...]] = [()]  # the grid of the launch being captured

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # Triton's JITHook signature
        spec = json.loads(compile["specialization_data"])
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
        jf = fn.jit_function
        sink.append(Launch("triton", jf.fn.__name__, jf, current[0], int(compile["num_warps"]),
                           {"signature": compile["signature"], "constants": compile["constants"],
                            "attrs": compile["configs"][0], "options": options}))  # fmt: skip
        return True  # handled: the JIT neither compiles nor launches

    def wrap(fn):
        def run(*args, grid: Any, warmup: bool, **kwargs):
            g = grid if isinstance(grid, tuple) else tuple(grid) if isinstance(grid, list) else (grid,)
            current[0] = tuple(int(x) for x in g)
            return JITFunction.run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        return run

    fns = _triton_kernels()
    saved_hook, saved_driver = knobs.runtime.jit_cache_hook, driver._active
    driver.set_active(_Driver(arch))
    knobs.runtime.jit_cache_hook = hook
    for f in fns:
        f.run = wrap(f)
    try:
        yield
    finally:
        for f in fns:
            vars(f).pop("run", None)
        knobs.runtime.jit_cache_hook = saved_hook
        driver._active = saved_driver


@contextmanager
def _numba(sink: list[Launch]) -> Iterator[None]:
    from ..ops import numba_common as nb

    class Recorder(list):
        def append(self, item) -> None:
            import numba

            kernel, blocks, threads, args = item
            blocks = blocks if isinstance(blocks, tuple) else (blocks,)
            sig = tuple(numba.typeof(a) for a in args)
            sink.append(Launch("numba", kernel.py_func.__name__, kernel, tuple(int(b) for b in blocks),
                               max(1, int(threads) // 32), {"sig": sig}))  # fmt: skip

    saved = nb.CAPTURE
    nb.CAPTURE = Recorder()
    try:
        yield
    finally:
        nb.CAPTURE = saved


def capture(provider: str, arch: Arch, fn: Callable[[], object]) -> list[Launch]:
    """The launches ``fn`` makes through ``provider``'s kernels, captured for ``arch`` (nothing runs)."""
    sink: list[Launch] = []
    ctx = _triton(arch, sink) if provider == "triton" else _numba(sink)
    with ctx:
        fn()
    return sink


@dataclass(slots=True)
class Compiled:
    cubin: bytes
    shared_bytes: int
    """Dynamic shared memory the launch asks for (Triton), bytes."""
    spill_bytes: int | None = None
    """Spill stores ``ptxas -v`` reported (Numba); None where every local byte is a spill (Triton)."""


def compile_launch(launch: Launch, arch: Arch) -> Compiled:
    """The cubin of a captured launch for ``arch``: Triton's pipeline, or Numba's PTX through ``ptxas``."""
    if launch.provider == "triton":
        import triton
        from triton.backends.compiler import GPUTarget

        s = launch.spec
        src = triton.compiler.ASTSource(fn=launch.fn, signature=s["signature"], constexprs=s["constants"],
                                        attrs=s["attrs"])  # fmt: skip
        k = triton.compile(src, target=GPUTarget("cuda", arch.capability, 32), options=s["options"])
        return Compiled(k.asm["cubin"], int(getattr(k.metadata, "shared", 0) or 0))
    from .sass import ptx_to_cubin

    cubin, spills = ptx_to_cubin(_numba_ptx(launch.fn, launch.spec["sig"], arch), arch)
    return Compiled(cubin, 0, spills)


def _numba_ptx(kernel: Any, sig: tuple, arch: Arch) -> str:
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    cc = divmod(arch.capability, 10)
    saved = dispatcher.get_current_device
    # Numba compiles the device functions a kernel calls for the *current* GPU, asking the driver which that
    # is; with no GPU (or another one), name the target instead.
    dispatcher.get_current_device = lambda: type("Target", (), {"compute_capability": cc})()
    try:
        opts = getattr(kernel, "targetoptions", {}) or {}
        ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=cc, fastmath=bool(opts.get("fastmath", False)))
    finally:
        dispatcher.get_current_device = saved
    return ptx
