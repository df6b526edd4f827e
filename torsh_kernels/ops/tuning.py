"""The tuning cache as provider selection reads it, and the search-space types op families declare.

- **The cache** is JSON, ``$TORSH_KERNELS_CACHE_DIR/tuning.json`` (default ``~/.cache/torsh_kernels``, or
  under ``$XDG_CACHE_HOME``), written by the autotuner (:mod:`torsh_kernels.profiling.autotune`,
  ``torsh tune``). Entries are grouped by environment: device name, compute capability,
  torch/triton/numba/torsh-kernels versions; a version change makes a new environment, so old winners
  are never applied to new code. Within an environment, one winner per (op, dtype, shape bucket):
  sizes fall into powers of two of the element count (``2^k`` holds sizes in (2^(k-1), 2^k]).
- **Use.** The provider registry consults :func:`lookup_provider` when it resolves an automatic
  selection and the kernel launchers :func:`lookup_meta` (through ``registry.tuned_meta``) by default;
  no install step. The registry caches what it resolved per (op, device, dtype, size bucket), so these
  readers run on a cache miss only, never per op call. The file is read once per process; a direct
  lookup here re-reads it when it changed (inode, size or mtime: one ``stat`` per lookup), but the
  registry's cached choices stay until :func:`reload` (the autotuner calls it after writing the file;
  call it yourself after changing the file from another process).
- **Search spaces.** Each tunable op declares a :class:`TuneSpace` next to its kernels and registers it
  with :func:`register_space`: how to build fresh random inputs of a given size, how to run the op with
  a provider, how to check the output against the torch reference, and the meta-parameter choices per
  provider. The autotuner searches them; this module only holds them.

Imports nothing beyond the standard library and torch: importing ops does not load the profiling layer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._env import versions

__all__ = [
    "CACHE_FORMAT",
    "ENV_CACHE_DIR",
    "Candidate",
    "TuneSpace",
    "bucket_of",
    "cache_dir",
    "cache_path",
    "entry_key",
    "environment_key",
    "load_cache",
    "lookup_meta",
    "lookup_provider",
    "on_reload",
    "register_space",
    "reload",
    "spaces",
]

log = logging.getLogger("torsh_kernels")

ENV_CACHE_DIR = "TORSH_KERNELS_CACHE_DIR"
CACHE_FORMAT = 1


def cache_dir() -> Path:
    """Where the tuning cache lives: $TORSH_KERNELS_CACHE_DIR, else $XDG_CACHE_HOME/torsh_kernels, else
    ~/.cache/torsh_kernels."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "torsh_kernels"


def cache_path() -> Path:
    return cache_dir() / "tuning.json"


def bucket_of(size: int) -> int:
    """The shape bucket k of a size: 2^(k-1) < size <= 2^k."""
    return max(0, math.ceil(math.log2(max(size, 1))))


# --------------------------------------------------------------------------------------------------
# Environment and entry keys


def _environment(device: torch.device) -> dict[str, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        cc = f"{major}.{minor}"
    else:
        name, cc = f"cpu:{platform.machine()}", "cpu"
    v = versions()
    return {
        "device": name,
        "capability": cc,
        "torch": v["torch"],
        "triton": v["triton"] or "-",
        "numba": v["numba"] or "-",
        "torsh_kernels": v["torsh_kernels"],
    }


_ENV_CACHE: dict[tuple[str, int | None], tuple[str, dict[str, str]]] = {}


def environment_key(device: torch.device) -> tuple[str, dict[str, str]]:
    """(key, fields) of the environment tuning results belong to."""
    k = (device.type, device.index)
    if k not in _ENV_CACHE:
        env = _environment(device)
        _ENV_CACHE[k] = (" | ".join(f"{a}={b}" for a, b in env.items()), env)
    return _ENV_CACHE[k]


def entry_key(op: str, dtype: torch.dtype, bucket: int) -> str:
    """The key of one winner inside an environment: ``"op | dtype | 2^bucket"``."""
    return f"{op} | {str(dtype).removeprefix('torch.')} | 2^{bucket}"


# --------------------------------------------------------------------------------------------------
# Reading the cache


def load_cache(path: Path | None = None) -> dict[str, Any]:
    """The cache's contents (an empty cache when the file is missing, unreadable or of another format)."""
    path = path or cache_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {"format": CACHE_FORMAT, "environments": {}}
    except (OSError, ValueError) as e:
        log.warning("torsh_kernels: ignoring the unreadable tuning cache %s (%s)", path, e)
        return {"format": CACHE_FORMAT, "environments": {}}
    if data.get("format") != CACHE_FORMAT:
        return {"format": CACHE_FORMAT, "environments": {}}
    return data


class _Store:
    """The cache as the dispatcher reads it: loaded once per process (reloaded when the file changes).

    Consulted when the registry resolves a selection or meta-parameters it has not cached (never per op
    call); a lookup costs one ``stat``, and the path is recomputed only when the environment variables it
    comes from change."""

    def __init__(self) -> None:
        self.data: dict[str, Any] | None = None
        self.mtime: tuple[int, int, int] | None = None
        self.path: Path | None = None
        self.path_from: tuple[str | None, str | None] | None = None
        self.used: set[str] = set()

    def _cache_path(self) -> Path:
        src = (os.environ.get(ENV_CACHE_DIR), os.environ.get("XDG_CACHE_HOME"))
        if src != self.path_from:  # Path.home() and friends cost more than the stat
            self.path_from, self.data, self.path = src, None, cache_path()
        return self.path

    def entries(self, device: torch.device) -> dict[str, Any]:
        path = self._cache_path()
        try:  # writes replace the file, so a new inode (or size or mtime) means new contents, even within one tick
            st = os.stat(path)
            mtime = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            mtime = None
        if self.data is None or mtime != self.mtime:
            self.data, self.mtime = load_cache(path), mtime
        key, _ = environment_key(device)
        return self.data["environments"].get(key, {}).get("entries", {})

    def winner(self, op: str, device: torch.device, dtype: torch.dtype, size: int) -> dict[str, Any] | None:
        ek = entry_key(op, dtype, bucket_of(size))
        e = self.entries(device).get(ek)
        if e is not None and ek not in self.used:
            self.used.add(ek)
            log.info("torsh_kernels: %s uses the tuned winner %s%s", ek, e["provider"], e.get("meta") or "")
        return e


_STORE = _Store()
_RELOAD_HOOKS: list[Callable[[], None]] = []


def on_reload(fn: Callable[[], None]) -> None:
    """Have :func:`reload` call ``fn`` (the registry drops its cached selections through this)."""
    _RELOAD_HOOKS.append(fn)


def reload() -> None:
    """Re-read the cache file on the next lookup and drop every cached selection built from it."""
    _STORE.data = None
    for fn in _RELOAD_HOOKS:
        fn()


def lookup_provider(op: str, device: torch.device, dtype: torch.dtype, size: int) -> str | None:
    """The cached winner's provider for (op, device, dtype, size bucket), or None."""
    e = _STORE.winner(op, device, dtype, size)
    return e["provider"] if e else None


def lookup_meta(op: str, device: torch.device, dtype: torch.dtype, size: int, provider: str) -> dict | None:
    """The cached winner's meta-parameters when it is ``provider``, else None."""
    e = _STORE.winner(op, device, dtype, size)
    return e.get("meta") if e and e["provider"] == provider else None


# --------------------------------------------------------------------------------------------------
# Search spaces


@dataclass(frozen=True)
class Candidate:
    """One configuration: a provider and its meta-parameters ({} = the launcher's defaults)."""

    provider: str
    meta: tuple[tuple[str, int], ...] = ()

    @property
    def meta_dict(self) -> dict[str, int]:
        return dict(self.meta)

    def __str__(self) -> str:
        m = ", ".join(f"{k}={v}" for k, v in self.meta)
        return f"{self.provider}({m})" if m else self.provider


@dataclass(kw_only=True)
class TuneSpace:
    """How to tune one op (see the module docstring)."""

    op: str
    """The registry name of the op (what the kernel launchers look up)."""
    family: str
    """The op family, for ``torsh tune --ops FAMILY``."""
    dtypes: tuple[torch.dtype, ...]
    """dtypes it is tuned for."""
    make: Callable[[torch.device, torch.dtype, int, torch.Generator], Any]
    """Fresh random inputs of about ``size`` elements."""
    run: Callable[[Any, str], Any]
    """Run the op on the inputs with a provider; returns what ``check`` compares."""
    check: Callable[[Any, Any], bool]
    """Whether an output is right (against the torch reference)."""
    meta: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    """Per provider: meta-parameter name -> the values to try (the first is the default)."""

    def candidates(self, providers: Sequence[str]) -> list[Candidate]:
        out = []
        for p in providers:
            grid = self.meta.get(p, {})
            combos: list[dict[str, int]] = [{}]
            for name, values in grid.items():
                combos = [{**c, name: v} for c in combos for v in values]
            out += [Candidate(p, tuple(sorted(c.items()))) for c in combos]
        return out


_SPACES: dict[str, TuneSpace] = {}


def register_space(space: TuneSpace) -> None:
    """Make an op tunable (each op module registers its own; the tuner itself does not change)."""
    _SPACES[space.op] = space


def spaces() -> dict[str, TuneSpace]:
    """The registered search spaces, by op (each op module registers its own when ``torsh_kernels.ops``
    is imported, which importing this module does first)."""
    return dict(_SPACES)
