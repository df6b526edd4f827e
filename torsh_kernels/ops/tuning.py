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
- **Validation.** :func:`load_cache` checks the file against the cache's schema: a file that is not a
  regular file, larger than :data:`MAX_CACHE_BYTES`, not JSON or not an object of this format is read as
  empty; an environment or entry of the wrong shape (an entry without ``provider``, a provider name that
  does not exist, ``meta`` names or values outside the op's search space, such as an absurd ``BLOCK`` or
  ``num_warps``, fields of the wrong type) is skipped. Either way one warning per version of the file
  names what was skipped (never one per call), and no op call ever raises because of the cache.
- **Writing.** :func:`update_cache` is the one writer: under the cache's file lock (an ``flock`` on
  ``tuning.json.lock`` beside it) it re-reads the file, applies the change and replaces the file through
  an exclusive, symlink-safe temporary file (:mod:`torsh_kernels.files`), so concurrent writers (ranks
  tuning at once) lose no entry and a planted symlink redirects nothing.
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

from ..env import versions
from ..files import locked, read_capped, write_atomic

__all__ = [
    "CACHE_FORMAT",
    "ENV_CACHE_DIR",
    "MAX_CACHE_BYTES",
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
    "update_cache",
]

log = logging.getLogger("torsh_kernels")

ENV_CACHE_DIR = "TORSH_KERNELS_CACHE_DIR"
CACHE_FORMAT = 1
MAX_CACHE_BYTES = 64 << 20
"""A cache file larger than this is not read (thousands of entries take a few MB)."""


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


def _empty() -> dict[str, Any]:
    return {"format": CACHE_FORMAT, "environments": {}}


class _Unusable(Exception):
    """The cache file cannot be used at all (raised and caught inside :func:`load_cache`)."""


_WARNED: set[tuple[str, int]] = set()


def _warn_once(path: Path, key: object, message: str) -> None:
    """Log ``message`` once per (file, contents): a cache read again and again warns once."""
    k = (str(path), hash(key))
    if k not in _WARNED:
        _WARNED.add(k)
        log.warning("torsh_kernels: %s", message)


def load_cache(path: Path | None = None) -> dict[str, Any]:
    """The cache's valid contents: ``{"format": 1, "environments": {key: {"env": {...}, "entries": {...}}}}``
    holding only what passes the schema (see the module docstring); an empty cache when the file is missing
    or unusable. What is skipped is logged once per version of the file."""
    path = path or cache_path()
    try:
        raw = read_capped(path, MAX_CACHE_BYTES, _Unusable)
        data = json.loads(raw)
    except FileNotFoundError:
        return _empty()
    except (OSError, ValueError, RecursionError, _Unusable) as e:
        _warn_once(path, f"{type(e).__name__}{e}", f"ignoring the unreadable tuning cache {path} ({e}); "
                   "`torsh tune --clear` removes it")  # fmt: skip
        return _empty()
    clean, problems = _validated(data)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        _warn_once(path, raw, f"the tuning cache {path}: skipped {'; '.join(problems[:5])}{more}; the rest is used "
                   "(`torsh tune --force` rewrites entries, `torsh tune --clear` removes the file)")  # fmt: skip
    return clean


def _validated(data: Any) -> tuple[dict[str, Any], list[str]]:
    """(the valid part of a parsed cache, what was skipped and why)."""
    out = _empty()
    if not isinstance(data, dict):
        return out, [f"everything: the top level is {_kind(data)}, expected an object"]
    if data.get("format") != CACHE_FORMAT:
        return out, [f"everything: format {data.get('format')!r}, this version reads format {CACHE_FORMAT}"]
    envs = data.get("environments")
    if not isinstance(envs, dict):
        return out, [f"everything: 'environments' is {_kind(envs)}, expected an object"]
    problems = []
    for key, env in envs.items():
        if not isinstance(env, dict) or not isinstance(env.get("entries"), dict):
            problems.append(f"environment {key[:60]!r} (expected an object with an 'entries' object)")
            continue
        info = env.get("env")
        if not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
            info = {}  # only shown; the key says which environment it is
        entries = {}
        for ek, e in env["entries"].items():
            why = _entry_problem(ek, e)
            if why is None:
                entries[ek] = e
            else:
                problems.append(f"entry {ek[:60]!r} ({why})")
        out["environments"][key] = {"env": info, "entries": entries}
    return out, problems


def _kind(v: Any) -> str:
    return "null" if v is None else f"a {type(v).__name__}"


_GENERIC_META_MAX = 1 << 20  # an op without a search space: positive ints up to this


def _entry_problem(key: str, e: Any) -> str | None:
    """Why an entry cannot be used, or None."""
    if not isinstance(e, dict):
        return f"{_kind(e)}, expected an object"
    prov = e.get("provider")
    if not isinstance(prov, str) or prov not in _PROVIDERS:
        return f"provider {prov!r} is not one of {', '.join(_PROVIDERS)}" if "provider" in e else "no provider"
    meta = e.get("meta")
    if meta is not None:
        if not isinstance(meta, dict):
            return f"meta is {_kind(meta)}, expected an object"
        space = _SPACES.get(key.split(" | ", 1)[0])
        grid = space.meta.get(prov, {}) if space is not None else None
        for name, v in meta.items():
            if isinstance(v, bool) or not isinstance(v, int):
                return f"meta {name}={v!r} is not an integer"
            if grid is None:
                if not 1 <= v <= _GENERIC_META_MAX:
                    return f"meta {name}={v} is outside 1..{_GENERIC_META_MAX}"
            elif v not in grid.get(name, ()):
                choices = grid.get(name)
                return (f"meta {name}={v} is not among the {prov} search space's {name} values {list(choices)}"
                        if choices else f"the {prov} provider of this op has no meta-parameter {name!r}")  # fmt: skip
    for name in ("median_ms", "default_ms"):
        v = e.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf):
            return f"{name}={v!r} is not a time in ms"
    for name in ("default", "tuned_at", "strategy"):
        if not isinstance(e.get(name, ""), str):
            return f"{name} is {_kind(e[name])}, expected a string"
    for name in ("candidates", "dropped", "pruned", "source_env"):
        if not isinstance(e.get(name, {}), dict):
            return f"{name} is {_kind(e[name])}, expected an object"
    r = e.get("synced_from_rank")
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
        return f"synced_from_rank={r!r} is not a rank"
    return None


def update_cache(update: Callable[[dict[str, Any]], None], path: Path | None = None) -> dict[str, Any]:
    """Change the cache file: under its lock, read it afresh (:func:`load_cache`), call ``update(data)``
    to change ``data`` in place, and replace the file with the result (an exclusive, symlink-safe temporary
    file, then ``os.replace``). Then :func:`reload`. Returns what was written. Raises
    :class:`~torsh_kernels.errors.FileAccessError` when the cache's directory cannot be written."""
    path = path or cache_path()
    with locked(path, what="tuning cache"):
        data = load_cache(path)
        update(data)
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n", what="tuning cache")
    reload()
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


_PROVIDERS: tuple[str, ...] = ()
"""The provider names an entry may hold: the registry's ``PROVIDERS``, handed over by :func:`set_providers`
when the registry is imported (it imports this module, so this module cannot import it)."""


def set_providers(names: Sequence[str]) -> None:
    """The provider names a cache entry may name (the registry calls this once, with its ``PROVIDERS``)."""
    global _PROVIDERS
    _PROVIDERS = tuple(names)


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
