"""Provider registry: which implementation of an op runs, and why.

Every op registers up to four implementations, one per provider:

- ``triton``: Triton kernels. Compiled on CUDA tensors; under ``TRITON_INTERPRET=1`` (set before
  torsh_kernels is imported) they run in Triton's interpreter, on CPU tensors too.
- ``numba``: Numba CUDA kernels. On CUDA tensors through ``__cuda_array_interface__``; under
  ``NUMBA_ENABLE_CUDASIM=1`` (set before numba is imported) in Numba's simulator, on CPU tensors.
- ``cpu``: fused CPU kernels compiled by Numba's CPU target (``numba.njit``, machine code for this CPU,
  cached on disk after the first compilation), on CPU tensors: one pass where the torch provider takes
  several, and a few microseconds of host cost where a chain of torch calls takes tens. An op family
  whose torch implementation is already one ATen kernel per pass (the bucket ops: ``torch.cat``,
  ``_foreach_copy_``) registers that implementation as its cpu one (docs/ops.md lists what runs).
- ``torch``: plain PyTorch, any device.

Selection, strongest first (docs/ops.md): the explicit ``provider=`` argument; the environment variable
``TORSH_KERNELS_PROVIDER``; the autotuner's cached winner for (op, device, dtype, size), read from the
tuning cache by :mod:`.tuning` (``set_tuned_lookup`` / ``set_tuned_meta`` override the source); the device
default (CUDA: triton; CPU: cpu); torch. An explicitly requested provider that cannot run raises
:class:`ProviderUnavailableError`. An automatically chosen one that cannot run is skipped for the next
candidate, with one debug log line per (op, provider, reason); ``torch`` runs everywhere and ends the chain.

**Caching.** The automatic choice is resolved once per (op, device, dtype, size bucket, value of
``TORSH_KERNELS_PROVIDER``) and kept; later calls cost one dict lookup and one ``os.environ.get`` (so a
change of the variable is honoured at once). Tuned meta-parameters (:func:`tuned_meta`) are cached per
(op, device, dtype, size bucket, provider) likewise. No call touches the file system after its first
resolution: the tuning cache's file is read on a miss only. Both caches are dropped by :func:`reload`
(which also makes :mod:`.tuning` re-read the file; the autotuner calls it after writing the cache), by
:func:`set_tuned_lookup` and by :func:`set_tuned_meta`. A tuning cache replaced by another process is
therefore seen after ``reload()`` or in a new process. Size buckets are the tuning cache's:
``2^(k-1) < size <= 2^k``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import recording
from ..env import package_version
from ..errors import ArgumentTypeError, ProviderError, ProviderUnavailableError
from . import tuning

__all__ = [
    "ENV_VAR",
    "PROVIDERS",
    "Op",
    "ProviderInfo",
    "ProviderReport",
    "can_run",
    "check_provider",
    "forced_meta",
    "implementation",
    "providers",
    "reload",
    "set_tuned_lookup",
    "set_tuned_meta",
    "tuned_meta",
]

log = logging.getLogger("torsh_kernels")

PROVIDERS: tuple[str, ...] = ("triton", "numba", "cpu", "torch")
ENV_VAR = "TORSH_KERNELS_PROVIDER"

_TRUE = ("1", "true", "on", "yes")

# Reading ENV_VAR on every call: os.environ.get encodes the key each time (about 1 us); the mapping
# behind os.environ (updated by every os.environ assignment, monkeypatch.setenv included) read with the
# key encoded once costs a dict lookup. Elsewhere (another platform's os.environ) the plain get.
_environ_data = getattr(os.environ, "_data", None)
_decode = getattr(os.environ, "decodevalue", None)
try:
    _env_key = os.environ.encodekey(ENV_VAR)  # type: ignore[attr-defined]
except Exception:  # pragma: no cover
    _environ_data = None


def _env_value() -> str | None:
    if _environ_data is None or _decode is None:
        return os.environ.get(ENV_VAR)
    v = _environ_data.get(_env_key)
    return None if v is None else _decode(v)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in _TRUE


TRITON_INSTALL = "pip install 'torsh-kernels[cuda]'"
"""How to get Triton where it is missing: an extra, not a dependency (it cannot run on a CPU)."""


@functools.cache
def triton_state() -> tuple[str | None, bool, str | None]:
    """(version, interpreted, import error). Read once, on the first triton launch or provider query (this
    imports Triton; ``import torsh_kernels`` does not): Triton fixes the mode when kernels are defined."""
    try:
        import triton  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name == "triton":  # absent (an optional dependency: torch's CUDA wheels bring it), or blocked
            how = "" if str(exc).startswith("No module named") else f": {exc}"  # e.g. sys.modules["triton"] = None
            return None, False, f"triton is not installed ({TRITON_INSTALL}){how}"
        return None, False, f"triton cannot be imported ({type(exc).__name__}: {exc})"
    except Exception as exc:  # a broken install raising anything at import
        return None, False, f"triton cannot be imported ({type(exc).__name__}: {exc})"
    return package_version("triton"), _env_flag("TRITON_INTERPRET"), None


@functools.cache
def numba_state() -> tuple[str | None, bool, str | None]:
    """(version, simulator, import error)."""
    try:
        from numba import (
            config,
            cuda,  # noqa: F401
        )
    except Exception as exc:
        return None, False, f"numba.cuda cannot be imported ({type(exc).__name__}: {exc})"
    return package_version("numba"), bool(config.ENABLE_CUDASIM), None


@functools.cache
def _numba_cpu_state() -> tuple[str | None, str | None]:
    """(version, import error) of Numba's CPU target (``numba.njit``; numba.cuda is not imported)."""
    try:
        import numba  # noqa: F401
    except Exception as exc:
        return None, f"numba cannot be imported ({type(exc).__name__}: {exc})"
    return package_version("numba"), None


@functools.cache
def _numba_cuda_error() -> str | None:
    """Why Numba cannot launch real CUDA kernels here, or None if it can (initialises the driver once)."""
    from numba import cuda

    try:
        if cuda.is_available():
            return None
        return "Numba finds no usable CUDA driver or GPU"
    except Exception as exc:
        return f"Numba's CUDA driver failed to initialise ({type(exc).__name__}: {exc})"


def can_run(provider: str, device: torch.device) -> str | None:
    """None if ``provider`` can run an op on tensors of ``device`` here, else the reason it cannot."""
    if provider == "torch":
        return None
    if provider == "cpu":
        err = _numba_cpu_state()[1]
        if err:
            return err
        if device.type != "cpu":
            return f"the cpu provider's kernels run on CPU tensors and got {device.type} tensors"
        return None
    if provider == "triton":
        _, interpreted, err = triton_state()
        if err:
            return err
        if interpreted:
            return None  # the interpreter runs on host memory and copies CUDA tensors through it
        if device.type != "cuda":
            return (
                f"Triton compiles for GPUs and got {device.type} tensors; set TRITON_INTERPRET=1 before "
                "importing torsh_kernels to run the kernels in Triton's interpreter (slow)"
            )
        if not torch.cuda.is_available():
            return "torch reports no usable CUDA device"
        return None
    if provider == "numba":
        _, simulator, err = numba_state()
        if err:
            return err
        if simulator:
            if device.type != "cpu":
                return "Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) runs on host arrays: pass CPU tensors"
            return None
        if device.type != "cuda":
            return (
                f"Numba CUDA kernels need CUDA tensors and got {device.type} tensors; set "
                "NUMBA_ENABLE_CUDASIM=1 before importing numba to run them in the simulator (slow)"
            )
        return _numba_cuda_error()
    raise ProviderError(f"unknown provider {provider!r}; expected one of {', '.join(PROVIDERS)}")


def _check_name(name: str, source: str) -> str:
    if name not in PROVIDERS:
        raise ProviderError(
            f"unknown provider {name!r} from {source}; expected one of {', '.join(PROVIDERS)} "
            f"(or leave {'it' if source != ENV_VAR else ENV_VAR} unset for automatic selection)"
        )
    return name


def check_provider(provider: object) -> None:
    """A public op's ``provider`` argument: None (or '') or a known provider name, else ProviderError. Checked
    up front, so a call that selects nothing (meta tensors, a traced call) refuses an unknown name too."""
    if provider is not None and provider != "" and provider not in PROVIDERS:
        _check_name(provider, "the provider argument")


def default_provider(device: torch.device) -> str:
    """The device's default: triton on CUDA, cpu on the CPU (an op without that provider, or where it
    cannot run, falls back to torch)."""
    if device.type == "cuda":
        return "triton"
    return "cpu" if device.type == "cpu" else "torch"


# The source of tuned winners: (op, device, dtype, size) -> provider name or None. By default the tuning
# cache's reader; tests and tools may install another (or None for no tuned winners).
TunedLookup = Callable[[str, torch.device, torch.dtype, int], "str | None"]
_tuned_lookup: TunedLookup | None = tuning.lookup_provider


def _check_callable(fn: object, what: str) -> None:
    if fn is not None and not callable(fn):
        raise ArgumentTypeError(f"torsh_kernels.{what}: fn must be a callable or None, got {type(fn).__name__}")


def set_tuned_lookup(fn: TunedLookup | None) -> None:
    """Install (or remove, with None) the source of tuned winners consulted by automatic selection
    (drops the cached selections)."""
    global _tuned_lookup
    _check_callable(fn, "set_tuned_lookup")
    _tuned_lookup = fn
    _clear_caches()


# ... and a source of tuned meta-parameters: (op, device, dtype, size, provider) -> {"BLOCK": ..., ...} or None.
TunedMeta = Callable[[str, torch.device, torch.dtype, int, str], "dict[str, int] | None"]
_tuned_meta: TunedMeta | None = tuning.lookup_meta
_forced = threading.local()


def set_tuned_meta(fn: TunedMeta | None) -> None:
    """Install (or remove, with None) the source of tuned meta-parameters that kernel launchers consult
    (drops the cached ones)."""
    global _tuned_meta
    _check_callable(fn, "set_tuned_meta")
    _tuned_meta = fn
    _clear_caches()


# Resolved choices: (op, device, dtype, size bucket, env value) -> provider, and
# (op, device, dtype, size bucket, provider) -> meta. Plain dicts: a lookup is atomic under the GIL and a
# racing miss only resolves the same answer twice.
_SELECTED: dict[tuple, str] = {}
_META: dict[tuple, dict[str, int]] = {}


def _clear_caches() -> None:
    _SELECTED.clear()
    _META.clear()


def reload() -> None:
    """Forget every resolved provider choice and tuned meta-parameter, and make the tuning cache's file be
    re-read on the next miss. Call it after changing the tuning cache from outside this process (the
    autotuner calls it itself after writing)."""
    tuning.reload()  # also calls _clear_caches (registered below)


tuning.on_reload(_clear_caches)
tuning.set_providers(PROVIDERS)


def _bucket(size: int) -> int:
    """tuning.bucket_of without floating point: 2^(k-1) < size <= 2^k."""
    return (size - 1).bit_length() if size > 1 else 0


@contextmanager
def forced_meta(op: str, meta: dict[str, int]):
    """Within the block, launches of ``op`` on this thread use ``meta`` (the autotuner timing a candidate)."""
    prev = getattr(_forced, "meta", None)
    _forced.meta = {**(prev or {}), op: dict(meta)}
    try:
        yield
    finally:
        _forced.meta = prev


def tuned_meta(op: str, device: torch.device, dtype: torch.dtype, size: int, provider: str) -> dict[str, int]:
    """Meta-parameters for this launch: forced by the tuner, else the cached winner's, else {} (the defaults)."""
    f = getattr(_forced, "meta", None)
    if f and op in f:
        return f[op]
    key = (op, device, dtype, _bucket(size), provider)
    m = _META.get(key)
    if m is None:
        m = (_tuned_meta(op, device, dtype, size, provider) if _tuned_meta is not None else None) or {}
        _META[key] = m
    return m


_logged: set[tuple[str, str, str]] = set()


def _log_skip(op: str, name: str, source: str, reason: str) -> None:
    key = (op, name, reason)
    if key not in _logged:
        _logged.add(key)
        log.debug("torsh.%s: %s provider %r skipped: %s", op, source, name, reason)


_OPS: dict[str, Op] = {}  # every Op by name


class Op:
    """One op's implementations per provider, and the selection between them."""

    __slots__ = ("impls", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.impls: dict[str, Callable[..., object]] = {}
        _OPS[name] = self

    def register(self, provider: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
        _check_name(provider, "a registration")

        def deco(fn: Callable[..., object]) -> Callable[..., object]:
            self.impls[provider] = fn
            return fn

        return deco

    def _reason(self, name: str, device: torch.device) -> str | None:
        if name not in self.impls:
            return f"torsh.{self.name} has no {name} implementation"
        return can_run(name, device)

    def select(self, device: torch.device, dtype: torch.dtype, size: int, requested: str | None) -> str:
        """The provider that runs this call (see the module docstring for the order)."""
        if requested:
            _check_name(requested, "the provider argument")
            reason = self._reason(requested, device)
            if reason is not None:
                self._unavailable(requested, device, reason)
            return requested
        env = _env_value()
        key = (self.name, device, dtype, (size - 1).bit_length() if size > 1 else 0, env)
        name = _SELECTED.get(key)
        if name is None:
            name = _SELECTED[key] = self._resolve(device, dtype, size, env)
        return name

    def _unavailable(self, requested: str, device: torch.device, reason: str) -> None:
        raise ProviderUnavailableError(
            f"torsh.{self.name}: provider {requested!r} was requested but cannot run on "
            f"{device.type} tensors here: {reason}. Pass provider=None for automatic selection."
        )

    def check_traced(self, device: torch.device, requested: str | None) -> None:
        """While torch.compile traces a call that runs the torch implementation whatever was asked (the MoE
        losses): an explicit provider must still be a known name this op has (the errors :meth:`select`
        raises for those); the selection state (caches, environment, tuning cache) is not read."""
        if requested:
            _check_name(requested, "the provider argument")
            if requested not in self.impls:
                self._unavailable(requested, device, f"torsh.{self.name} has no {requested} implementation")

    def _resolve(self, device: torch.device, dtype: torch.dtype, size: int, env: str | None) -> str:
        candidates: list[tuple[str, str]] = []
        env = (env or "").strip()
        if env:
            candidates.append((_check_name(env, ENV_VAR), ENV_VAR))
        if _tuned_lookup is not None:
            tuned = _tuned_lookup(self.name, device, dtype, size)
            if tuned:
                candidates.append((_check_name(tuned, "the tuning cache"), "tuned"))
        candidates.append((default_provider(device), "default"))
        for name, source in candidates:
            reason = self._reason(name, device)
            if reason is None:
                return name
            _log_skip(self.name, name, source, reason)
        return "torch"

    def __call__(self, provider: str, *args: object, **kwargs: object) -> object:
        rec = recording.recorder
        if rec is None:
            return self.impls[provider](*args, **kwargs)
        with rec.op(self.name, provider, args):
            return self.impls[provider](*args, **kwargs)


def implementation(op: str, provider: str) -> Callable[..., object]:
    """The implementation ``provider`` registered for ``op`` (an :class:`Op`'s name): the function a call runs
    once its inputs are validated and its outputs allocated. ``torsh inspect`` drives it to see the launches a
    provider makes. Raises :class:`ProviderUnavailableError` for an op or provider with none."""
    o = _OPS.get(op)
    if o is None or provider not in o.impls:
        have = sorted(_OPS) if o is None else sorted(o.impls)
        what = f"no op named {op!r}" if o is None else f"torsh.{op} has no {provider!r} implementation"
        raise ProviderUnavailableError(f"{what}; there are {', '.join(have)}")
    return o.impls[provider]


def untuned_default(op: str, device: torch.device) -> str:
    """The provider ``op`` runs on ``device`` by default (no provider argument, no environment variable, no
    tuned winner): the device's default where the op has it and it can run here, else torch. For a name no
    :class:`Op` carries, the device's default."""
    o = _OPS.get(op)
    name = default_provider(device)
    if o is None:
        return name
    return name if o._reason(name, device) is None else "torch"


@dataclass(frozen=True, slots=True)
class ProviderInfo:
    """What one provider can do on this machine."""

    name: str
    """The provider's name: triton, numba, cpu or torch."""
    version: str | None
    """Version of the package behind it, None when it is not installed."""
    mode: str
    """How it runs here (compiled, interpreter, simulator, eager), or why it does not."""
    cuda: str | None
    """None if it can run on CUDA tensors here, else the reason it cannot."""
    cpu: str | None
    """None if it can run on CPU tensors here, else the reason it cannot."""

    @property
    def available(self) -> bool:
        """True if it can run on at least one device here."""
        return self.cuda is None or self.cpu is None


class ProviderReport(Mapping[str, ProviderInfo]):
    """Provider name -> :class:`ProviderInfo`; prints as a readable table."""

    def __init__(self, infos: list[ProviderInfo]) -> None:
        self._infos = {i.name: i for i in infos}

    def __getitem__(self, key: str) -> ProviderInfo:
        return self._infos[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def __str__(self) -> str:
        lines = []
        for i in self._infos.values():
            lines.append(f"{i.name:<7} {i.version or 'not installed':<14} {i.mode}")
            for dev, why in (("cuda", i.cuda), ("cpu", i.cpu)):
                lines.append(f"{'':<7}   {dev + ' tensors:':<14} {'yes' if why is None else 'no: ' + why}")
        return "\n".join(lines)

    __repr__ = __str__


def providers() -> ProviderReport:
    """What each provider can run here, and why not where it cannot."""
    cuda_dev, cpu_dev = torch.device("cuda"), torch.device("cpu")
    no_cuda = None if torch.cuda.is_available() else "torch reports no usable CUDA device"

    tv, interpreted, terr = triton_state()
    if terr:
        tmode = terr
    elif interpreted:
        tmode = "interpreter (TRITON_INTERPRET=1): kernels run in Python on host memory, slowly"
    else:
        tmode = "compiled kernels on CUDA devices"

    nv, simulator, nerr = numba_state()
    if nerr:
        nmode = nerr
    elif simulator:
        nmode = "CUDA simulator (NUMBA_ENABLE_CUDASIM=1): kernels run in Python on host arrays, slowly"
    else:
        nmode = "CUDA kernels through __cuda_array_interface__"

    cv, cerr = _numba_cpu_state()
    cmode = cerr or "fused kernels compiled for this CPU by Numba's CPU target (numba.njit), on CPU tensors"
    return ProviderReport(
        [
            ProviderInfo("triton", tv, tmode, no_cuda or can_run("triton", cuda_dev), can_run("triton", cpu_dev)),
            ProviderInfo("numba", nv, nmode, no_cuda or can_run("numba", cuda_dev), can_run("numba", cpu_dev)),
            ProviderInfo("cpu", cv, cmode, can_run("cpu", cuda_dev), can_run("cpu", cpu_dev)),
            ProviderInfo("torch", package_version("torch"), "eager PyTorch ops (the reference path)", no_cuda, None),
        ]
    )
