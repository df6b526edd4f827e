"""Kernel autotuner: search providers and meta-parameters per op, dtype and shape bucket; cache winners.

- **Search spaces.** Each tunable op registers a :class:`TuneSpace` (:func:`register_space`): how to
  build fresh random inputs of a given size, how to run the op with a given provider, how to check the
  output against the torch reference, and the meta-parameter choices per provider (Triton BLOCK sizes
  and ``num_warps``, ...). Later op families add theirs with ``register_space``; the tuner does not change.
- **Shape buckets.** Sizes fall into powers of two of the element count (``2^k`` holds sizes in
  (2^(k-1), 2^k]); one winner per (op, dtype, bucket).
- **Measuring.** Every candidate first runs once on fresh random inputs and is compared with the
  reference: one that fails to compile, raises or gives a wrong result is dropped, never chosen. The
  survivors are timed with warm-up and repetitions, interleaved, caches flushed between calls
  (:func:`torsh_kernels._env.time_interleaved`): median and 20/80 quantiles.
- **Strategies.** ``exhaustive`` (every candidate; after one quick repetition, candidates slower than
  ``prune_factor`` times the best are pruned before the full timing), ``random`` (candidates in random
  order until the budget runs out) and ``greedy`` (coordinate descent over each provider's
  meta-parameters from the defaults).
- **The cache** is JSON, ``$TORSH_KERNELS_CACHE_DIR/tuning.json`` (default ``~/.cache/torsh_kernels``,
  or under ``$XDG_CACHE_HOME``). Entries are grouped by environment: device name, compute capability,
  torch/triton/numba/torsh-kernels versions; a version change makes a new environment, so old winners
  are never applied to new code (``torsh tune --show`` lists them as stale). Each entry is written as
  soon as it is found (an interrupted tuning keeps what it found, and the next run resumes).
- **Use.** ``install()`` (done when torsh_kernels is imported) points the provider registry at the
  cache: automatic provider selection and the kernel launchers use the winners. ``sync_tuning(comm)``
  broadcasts rank 0's winners so every rank runs the same configuration (different ranks picking
  different configurations change numerics), and records in each rank's cache that they came from rank 0.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._env import package_version
from ..errors import InvalidArgumentError
from ..ops import registry

__all__ = [
    "Candidate",
    "TuneResult",
    "TuneSpace",
    "Tuner",
    "bucket_of",
    "cache_dir",
    "cache_path",
    "environment_key",
    "install",
    "load_cache",
    "register_space",
    "spaces",
    "sync_tuning",
]

log = logging.getLogger("torsh_kernels")

ENV_CACHE_DIR = "TORSH_KERNELS_CACHE_DIR"
CACHE_FORMAT = 1
STRATEGIES = ("exhaustive", "random", "greedy")


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
# Environment and cache


def _environment(device: torch.device) -> dict[str, str]:
    from .. import __version__

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        cc = f"{major}.{minor}"
    else:
        import platform

        name, cc = f"cpu:{platform.machine()}", "cpu"
    return {
        "device": name,
        "capability": cc,
        "torch": torch.__version__,
        "triton": package_version("triton") or "-",
        "numba": package_version("numba") or "-",
        "torsh_kernels": __version__,
    }


_ENV_CACHE: dict[tuple[str, int | None], tuple[str, dict[str, str]]] = {}


def environment_key(device: torch.device) -> tuple[str, dict[str, str]]:
    """(key, fields) of the environment tuning results belong to."""
    k = (device.type, device.index)
    if k not in _ENV_CACHE:
        env = _environment(device)
        _ENV_CACHE[k] = (" | ".join(f"{a}={b}" for a, b in env.items()), env)
    return _ENV_CACHE[k]


def _entry_key(op: str, dtype: torch.dtype, bucket: int) -> str:
    return f"{op} | {str(dtype).removeprefix('torch.')} | 2^{bucket}"


def load_cache(path: Path | None = None) -> dict[str, Any]:
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


def _save_cache(data: dict[str, Any], path: Path | None = None) -> None:
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: an interrupted write never leaves half a file


class _Store:
    """The cache as the dispatcher reads it: loaded once per process (reloaded when the file changes).

    Consulted on every automatic provider selection and kernel launch, so a lookup costs one ``stat``:
    the path is recomputed only when the environment variables it comes from change."""

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
        ek = _entry_key(op, dtype, bucket_of(size))
        e = self.entries(device).get(ek)
        if e is not None and ek not in self.used:
            self.used.add(ek)
            log.info("torsh_kernels: %s uses the tuned winner %s%s", ek, e["provider"], e.get("meta") or "")
        return e


_STORE = _Store()


def _lookup_provider(op: str, device: torch.device, dtype: torch.dtype, size: int) -> str | None:
    e = _STORE.winner(op, device, dtype, size)
    return e["provider"] if e else None


def _lookup_meta(op: str, device: torch.device, dtype: torch.dtype, size: int, provider: str) -> dict | None:
    e = _STORE.winner(op, device, dtype, size)
    return e.get("meta") if e and e["provider"] == provider else None


def install() -> None:
    """Point provider selection and the kernel launchers at the tuning cache."""
    registry.set_tuned_lookup(_lookup_provider)
    registry.set_tuned_meta(_lookup_meta)


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
    """Make an op tunable (later op families call this; the tuner itself does not change)."""
    _SPACES[space.op] = space


def spaces() -> dict[str, TuneSpace]:
    _builtin_spaces()
    return dict(_SPACES)


_BUILTINS: list[bool] = []


def _builtin_spaces() -> None:
    if _BUILTINS:
        return
    _BUILTINS.append(True)
    from ..ops import bucket_reduce, bucket_reduce_ref, flatten, quantize, quantize_ref, unflatten

    floats = (torch.float32, torch.float16, torch.bfloat16)
    triton_bucket = {"triton": {"BLOCK": (2048, 1024, 4096, 8192), "num_warps": (4, 2, 8)}}

    def pieces(device, dtype, size, gen):
        k = 7
        sizes = [max(1, size // k + (i * 37) % 101) for i in range(k)]
        return [torch.randn(s, generator=gen).to(dtype).to(device) for s in sizes]

    def make_flatten(device, dtype, size, gen):
        ts = pieces(device, dtype, size, gen)
        return ts, torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=device)

    register_space(TuneSpace(
        op="flatten", family="bucket", dtypes=floats, meta=triton_bucket, make=make_flatten,
        run=lambda s, p: flatten(s[0], out=s[1], provider=p)[0],
        check=lambda s, out: torch.equal(out, torch.cat([t.reshape(-1) for t in s[0]])),
    ))  # fmt: skip

    def make_unflatten(device, dtype, size, gen):
        ts = pieces(device, dtype, size, gen)
        flat, layout = flatten(ts, provider="torch")
        flat = torch.randn(flat.numel(), generator=gen).to(dtype).to(device)
        return flat, layout, [torch.empty_like(t) for t in ts]

    def run_unflatten(s, p):
        unflatten(s[0], s[1], s[2], provider=p)
        return torch.cat([t.reshape(-1) for t in s[2]])

    register_space(TuneSpace(
        op="unflatten", family="bucket", dtypes=floats, meta=triton_bucket, make=make_unflatten, run=run_unflatten,
        check=lambda s, out: torch.equal(out, s[0]),
    ))  # fmt: skip

    def make_reduce(device, dtype, size, gen):
        bufs = [torch.randn(size, generator=gen).to(dtype).to(device) for _ in range(4)]
        return bufs, torch.empty(size, dtype=dtype, device=device)

    def check_reduce(s, out):
        ref = bucket_reduce_ref(s[0], "sum", s[1].dtype)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[s[1].dtype]
        return bool(torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol))

    register_space(TuneSpace(
        op="bucket_reduce", family="bucket", dtypes=floats, meta=triton_bucket, make=make_reduce,
        run=lambda s, p: bucket_reduce(s[0], out=s[1], provider=p), check=check_reduce,
    ))  # fmt: skip

    def make_quantize(device, dtype, size, gen):
        return torch.randn(size, generator=gen).to(dtype).to(device)

    def check_quantize(x, out):
        q, s = quantize_ref(x, bits=8)
        return torch.equal(out[0], q) and torch.equal(out[1], s)

    register_space(TuneSpace(
        op="quantize", family="compression", dtypes=floats, make=make_quantize,
        meta={"triton": {"QTILE": (4096, 1024, 2048, 8192), "num_warps": (8, 4)}},
        run=lambda x, p: quantize(x, bits=8, provider=p), check=check_quantize,
    ))  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Tuning


@dataclass(kw_only=True)
class TuneResult:
    """The outcome for one (op, dtype, bucket)."""

    op: str
    dtype: torch.dtype
    bucket: int
    size: int
    winner: Candidate | None
    winner_ms: float | None
    default: Candidate
    default_ms: float | None
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    """Candidates that failed or gave wrong results, with why: never chosen."""
    pruned: dict[str, float] = field(default_factory=dict)
    """Candidates pruned after one quick repetition, with its time in ms."""
    cached: bool = False
    tuned_at: str = ""

    @property
    def speedup(self) -> float | None:
        if self.winner_ms and self.default_ms:
            return self.default_ms / self.winner_ms
        return None


def _native(provider: str, device: torch.device) -> bool:
    """Whether a provider runs compiled code on the device (not the interpreter or the simulator)."""
    if registry.can_run(provider, device) is not None:
        return False
    if provider == "triton" and registry._triton_state()[1]:
        return False
    return not (provider == "numba" and registry._numba_state()[1])


class Tuner:
    """Tunes ops on one device and writes the winners to the cache.

    Args:
        device: where to tune (default: CUDA when available).
        providers: providers to consider (default: those that run compiled code on the device; on a CPU
            that is torch alone, so pass e.g. ("torch", "triton", "numba") to include the interpreter
            and simulator, as the tests do).
        strategy: "exhaustive", "random" or "greedy".
        budget_s: seconds for the whole run; what is left untuned stays so (resumable).
        warmup, reps: calls before timing and timed calls per candidate.
        prune_factor: exhaustive: after one quick repetition, drop candidates slower than this times the best.
        seed: of the inputs and of the random strategy.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        providers: Sequence[str] | None = None,
        strategy: str = "exhaustive",
        budget_s: float = 60.0,
        warmup: int = 2,
        reps: int | None = None,
        prune_factor: float = 2.0,
        seed: int = 0,
        path: Path | None = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if strategy not in STRATEGIES:
            raise InvalidArgumentError(f"Tuner: strategy={strategy!r}; expected one of {STRATEGIES}")
        if not (isinstance(budget_s, (int, float)) and budget_s > 0):
            raise InvalidArgumentError(f"Tuner: budget_s={budget_s!r} must be a positive number of seconds")
        if providers is None:
            providers = [p for p in registry.PROVIDERS if _native(p, self.device)]
        for p in providers:
            if p not in registry.PROVIDERS:
                raise InvalidArgumentError(f"Tuner: unknown provider {p!r}; expected some of {registry.PROVIDERS}")
        self.providers = [p for p in providers if registry.can_run(p, self.device) is None]
        self.strategy, self.budget_s, self.warmup = strategy, float(budget_s), warmup
        self.reps = reps or (20 if self.device.type == "cuda" else 5)
        self.prune_factor, self.seed = prune_factor, seed
        self.path = path or cache_path()
        self.deadline = time.monotonic() + self.budget_s

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def _check(self, space: TuneSpace, c: Candidate, dtype: torch.dtype, size: int) -> str | None:
        """None if the candidate gives the right result on fresh random inputs, else why not."""
        gen = torch.Generator().manual_seed(self.seed + 1)
        state = space.make(self.device, dtype, size, gen)
        try:
            with registry.forced_meta(space.op, c.meta_dict):
                out = space.run(state, c.provider)
                ok = space.check(state, out)
        except Exception as e:  # a compile error, an unsupported configuration, ...
            return f"{type(e).__name__}: {str(e)[:200]}"
        return None if ok else "wrong result against the reference"

    def _time(self, space: TuneSpace, cands: list[Candidate], dtype: torch.dtype, size: int,
              reps: int) -> list[dict[str, float]]:  # fmt: skip
        from .._env import time_interleaved

        gen = torch.Generator().manual_seed(self.seed + 2)
        state = space.make(self.device, dtype, size, gen)

        def fn(c: Candidate):
            def call():
                with registry.forced_meta(space.op, c.meta_dict):
                    space.run(state, c.provider)

            return call

        ts = time_interleaved([fn(c) for c in cands], self.device, warmup=self.warmup, reps=reps)
        return [{"median_ms": t.median_ms, "p20_ms": t.p20_ms, "p80_ms": t.p80_ms} for t in ts]

    def tune_one(self, space: TuneSpace, dtype: torch.dtype, size: int, *, force: bool = False,
                 progress: Callable[[str], None] | None = None) -> TuneResult:  # fmt: skip
        """Tune (op, dtype, bucket of size) and write the winner to the cache; a cached result is returned
        as is unless ``force``."""
        bucket = bucket_of(size)
        size = 2**bucket  # the bucket's representative size
        env_key, env = environment_key(self.device)
        ekey = _entry_key(space.op, dtype, bucket)
        default = Candidate(registry.default_provider(self.device))
        if not force:
            e = load_cache(self.path)["environments"].get(env_key, {}).get("entries", {}).get(ekey)
            if e is not None:
                log.info("torsh_kernels: %s is cached (tuned %s): %s", ekey, e.get("tuned_at"), e["provider"])
                return TuneResult(op=space.op, dtype=dtype, bucket=bucket, size=size, cached=True,
                                  winner=Candidate(e["provider"], tuple(sorted((e.get("meta") or {}).items()))),
                                  winner_ms=e.get("median_ms"), default=default, default_ms=e.get("default_ms"),
                                  tuned_at=e.get("tuned_at", ""))  # fmt: skip
        res = TuneResult(op=space.op, dtype=dtype, bucket=bucket, size=size, winner=None, winner_ms=None,
                         default=default, default_ms=None)  # fmt: skip
        cands = space.candidates(self.providers)
        if default not in cands and default.provider in self.providers:
            cands.insert(0, default)
        rng = random.Random(self.seed)
        if self.strategy == "random":
            rng.shuffle(cands)
            cands.sort(key=lambda c: c != default)  # the default first: the speedup needs it
        timed: dict[Candidate, dict[str, float]] = {}

        def consider(batch: list[Candidate]) -> None:
            good = []
            for c in batch:
                if self.out_of_time() and timed:
                    return
                if progress:
                    progress(f"{ekey}: {c}")
                why = self._check(space, c, dtype, size)
                if why is None:
                    good.append(c)
                else:
                    res.dropped[str(c)] = why
            if not good:
                return
            if self.strategy == "exhaustive" and len(good) > 2:  # prune on one quick repetition
                quick = self._time(space, good, dtype, size, 1)
                best = min(q["median_ms"] for q in quick)
                keep = [q["median_ms"] <= self.prune_factor * best or c == default for c, q in zip(good, quick)]
                res.pruned.update({str(c): q["median_ms"] for c, q, k in zip(good, quick, keep) if not k})
                good = [c for c, k in zip(good, keep) if k]
            for c, t in zip(good, self._time(space, good, dtype, size, self.reps)):
                timed[c] = t

        if self.strategy == "greedy":
            consider([c for c in cands if c == default or not c.meta])  # each provider at its defaults
            for p in self.providers:
                grid = space.meta.get(p, {})
                cur = {k: v[0] for k, v in grid.items()}
                for name, values in grid.items():  # coordinate descent, one meta-parameter at a time
                    batch = [Candidate(p, tuple(sorted({**cur, name: v}.items()))) for v in values]
                    consider([c for c in batch if c not in timed])
                    inbatch = [c for c in batch if c in timed]
                    if inbatch:
                        cur = min(inbatch, key=lambda c: timed[c]["median_ms"]).meta_dict
        else:
            consider(cands)
        if timed:
            win = min(timed, key=lambda c: timed[c]["median_ms"])
            res.winner, res.winner_ms = win, timed[win]["median_ms"]
            dkey = next((c for c in timed if c.provider == default.provider and not c.meta), None)
            res.default_ms = timed[dkey]["median_ms"] if dkey else None
            res.timings = {str(c): t for c, t in timed.items()}
            res.tuned_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            self._store(env_key, env, ekey, res)
        return res

    def _store(self, env_key: str, env: dict[str, str], ekey: str, res: TuneResult) -> None:
        data = load_cache(self.path)  # re-read: another process may have added entries meanwhile
        envs = data["environments"].setdefault(env_key, {"env": env, "entries": {}})
        envs["entries"][ekey] = {
            "provider": res.winner.provider, "meta": res.winner.meta_dict, "median_ms": res.winner_ms,
            "default": str(res.default), "default_ms": res.default_ms, "candidates": res.timings,
            "dropped": res.dropped, "pruned": res.pruned, "strategy": self.strategy, "tuned_at": res.tuned_at,
            "synced_from_rank": None,
        }  # fmt: skip
        _save_cache(data, self.path)

    def tune(self, ops: Sequence[str], dtypes: Sequence[torch.dtype], sizes: Sequence[int], *, force: bool = False,
             progress: Callable[[str], None] | None = None) -> list[TuneResult]:  # fmt: skip
        """Tune every (op, dtype, size bucket), stopping when the budget is spent."""
        sp = spaces()
        unknown = [o for o in ops if o not in sp]
        if unknown:
            raise InvalidArgumentError(f"Tuner.tune: no search space for {unknown}; tunable ops: {sorted(sp)}")
        results = []
        for op in ops:
            for dt in dtypes:
                if dt not in sp[op].dtypes:
                    continue
                for n in sizes:
                    if self.out_of_time():
                        log.info("torsh_kernels: tuning budget spent; %s %s 2^%d left for a later run", op, dt,
                                 bucket_of(n))  # fmt: skip
                        continue
                    results.append(self.tune_one(sp[op], dt, n, force=force, progress=progress))
        return results


# --------------------------------------------------------------------------------------------------
# Distributed


def sync_tuning(comm: Any, device: torch.device | str | None = None) -> int:
    """Make every rank use rank 0's tuned winners (a collective: every rank calls it). Returns the number
    of entries received. Each rank writes them into its own cache, under its own environment, marked
    ``synced_from_rank: 0``."""
    device = torch.device(device or comm.device)
    env_key, env = environment_key(device)
    if comm.rank == 0:
        entries = load_cache()["environments"].get(env_key, {}).get("entries", {})
        payload = json.dumps({"env": env, "entries": entries}, sort_keys=True).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64, device=comm.device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=comm.device)
    comm.broadcast(size, 0)
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=comm.device)
    if comm.rank == 0:
        buf.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    comm.broadcast(buf, 0)
    got = json.loads(bytes(buf.cpu().numpy()).decode())
    data = load_cache()
    mine = data["environments"].setdefault(env_key, {"env": env, "entries": {}})
    for k, e in got["entries"].items():
        mine["entries"][k] = {**e, "synced_from_rank": 0, "source_env": got["env"]} if comm.rank else e
    if comm.rank:
        mine["entries"] = {k: v for k, v in mine["entries"].items() if k in got["entries"]}
    _save_cache(data)
    _STORE.data = None  # re-read on the next lookup
    return len(got["entries"])
