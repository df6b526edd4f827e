"""Kernel autotuner: search providers and meta-parameters per op, dtype and shape bucket; cache winners.

- **Search spaces.** Each tunable op declares a :class:`TuneSpace` next to its kernels and registers it
  (:func:`register_space`; both live in :mod:`torsh_kernels.ops.tuning` and are re-exported here): how
  to build fresh random inputs of a given size, how to run the op with a given provider, how to check the
  output against the torch reference, and the meta-parameter choices per provider (Triton BLOCK sizes
  and ``num_warps``, ...). New op families add theirs with ``register_space``; the tuner does not change.
- **Shape buckets.** Sizes fall into powers of two of the element count (``2^k`` holds sizes in
  (2^(k-1), 2^k]); one winner per (op, dtype, bucket).
- **Measuring.** Every candidate first runs once on fresh random inputs and is compared with the
  reference: one that fails to compile, raises or gives a wrong result is dropped, never chosen. The
  survivors are timed with warm-up and repetitions, interleaved, caches flushed between calls
  (:func:`torsh_kernels.env.time_interleaved`): median and 20/80 quantiles.
- **Winning beyond the noise.** The fastest candidate by median replaces the default only when it is faster
  beyond the measured spread (:func:`torsh_kernels.env.compare_spread`: its p20-p80 interval wholly below
  the default's), and again in a second interleaved timing of the two alone: one slow repetition or a
  busy machine can move a median, rarely two whole intervals. Otherwise the entry keeps the device default
  (the provider the registry picks with no entry), with ``verdict`` "within noise" and the candidate that
  was fastest by median in ``fastest``; ``torsh tune`` says so in its table. An entry with ``verdict``
  "faster" is a winner; one written before verdicts were recorded has none.
- **Strategies.** ``exhaustive`` (every candidate; after one quick repetition, candidates slower than
  ``prune_factor`` times the best are pruned before the full timing), ``random`` (candidates in random
  order until the budget runs out) and ``greedy`` (coordinate descent over each provider's
  meta-parameters from the defaults).
- **The cache**: its location, environment keys, schema, reading and writing are
  :mod:`torsh_kernels.ops.tuning`'s (winners are never applied across a version change; ``torsh tune
  --show`` lists such entries as stale). The tuner writes each entry as soon as it is found, through
  ``update_cache`` (under the cache's file lock, merged with what other processes wrote meanwhile): an
  interrupted tuning keeps what it found, and the next run resumes.
- **Use.** Automatic provider selection and the kernel launchers use the winners through the cache
  reader of :mod:`torsh_kernels.ops.tuning`, by default (no install step; ``install()`` points the
  registry back at that reader after ``registry.set_tuned_lookup`` installed another). ``sync_tuning(comm)``
  broadcasts rank 0's winners so every rank runs the same configuration (different ranks picking
  different configurations change numerics), and records in each rank's cache that they came from rank 0.
"""

from __future__ import annotations

import datetime
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..ops import registry
from ..ops.tuning import (
    CACHE_FORMAT,
    ENV_CACHE_DIR,
    Candidate,
    TuneSpace,
    bucket_of,
    cache_dir,
    cache_path,
    entry_key,
    environment_key,
    load_cache,
    lookup_meta,
    lookup_provider,
    register_space,
    spaces,
    update_cache,
)

__all__ = [
    "CACHE_FORMAT",
    "ENV_CACHE_DIR",
    "STRATEGIES",
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

STRATEGIES = ("exhaustive", "random", "greedy")


def install() -> None:
    """Point provider selection and the kernel launchers at the tuning cache's reader.

    They use it by default (:mod:`torsh_kernels.ops.tuning`); this puts it back after
    ``registry.set_tuned_lookup`` / ``set_tuned_meta`` installed another source."""
    registry.set_tuned_lookup(lookup_provider)
    registry.set_tuned_meta(lookup_meta)


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
    verdict: str | None = None
    """"faster" (the winner beat the default beyond the spread, twice), "within noise" (the default kept),
    "default" (the default was the fastest), "default not timed" (the providers tuned exclude the default
    and torch, so the fastest of them is the winner, with nothing to judge it against), or None
    (a cached entry from before verdicts were recorded)."""
    fastest: str | None = None
    """The candidate fastest by median (where the default was kept, the one that did not win beyond noise)."""
    fastest_ms: float | None = None
    """Its median, in ms."""
    confirm: dict[str, dict[str, float]] = field(default_factory=dict)
    """The second interleaved timing of the fastest candidate and the default (candidate -> median, p20, p80)."""

    @property
    def speedup(self) -> float | None:
        if self.winner_ms and self.default_ms and self.verdict != "within noise":
            return self.default_ms / self.winner_ms
        return None


def _native(provider: str, device: torch.device) -> bool:
    """Whether a provider runs compiled code on the device (not the interpreter or the simulator)."""
    if registry.can_run(provider, device) is not None:
        return False
    if provider == "triton" and registry.triton_state()[1]:
        return False
    return not (provider == "numba" and registry.numba_state()[1])


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
        from ..env import time_interleaved

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
        ekey = entry_key(space.op, dtype, bucket)
        default = Candidate(registry.untuned_default(space.op, self.device))
        if default.provider not in self.providers:  # not among the providers tuned: torch is the baseline
            default = Candidate("torch")
        if not force:
            e = load_cache(self.path)["environments"].get(env_key, {}).get("entries", {}).get(ekey)
            if e is not None:
                log.info("torsh_kernels: %s is cached (tuned %s): %s", ekey, e.get("tuned_at"), e["provider"])
                return TuneResult(op=space.op, dtype=dtype, bucket=bucket, size=size, cached=True,
                                  winner=Candidate(e["provider"], tuple(sorted((e.get("meta") or {}).items()))),
                                  winner_ms=e.get("median_ms"), default=default, default_ms=e.get("default_ms"),
                                  tuned_at=e.get("tuned_at", ""), verdict=e.get("verdict"),
                                  timings=e.get("candidates") or {},
                                  fastest=e.get("fastest"), fastest_ms=e.get("fastest_ms"))  # fmt: skip
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
            best = min(timed, key=lambda c: timed[c]["median_ms"])
            dkey = next((c for c in timed if c.provider == default.provider and not c.meta), None)
            res.default_ms = timed[dkey]["median_ms"] if dkey else None
            res.fastest, res.fastest_ms = str(best), timed[best]["median_ms"]
            res.verdict = self._judge(space, best, dkey, timed, dtype, size, res)
            if res.verdict in ("faster", "default", "default not timed"):  # (not timed: the providers asked for)
                res.winner, res.winner_ms = best, timed[best]["median_ms"]
            else:  # the device default stays: what the registry picks with no entry
                res.winner = Candidate(registry.untuned_default(space.op, self.device))
                res.winner_ms = res.default_ms if res.winner.provider == default.provider else None
            res.timings = {str(c): t for c, t in timed.items()}
            res.tuned_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            self._store(env_key, env, ekey, res)
        return res

    def _judge(self, space: TuneSpace, best: Candidate, dkey: Candidate | None, timed: dict[Candidate, dict],
               dtype: torch.dtype, size: int, res: TuneResult) -> str:  # fmt: skip
        """Whether ``best`` replaces the default (see the module docstring): "faster" only when its interval
        lies below the default's in the search's timing and again in a second interleaved timing of the two."""
        from ..env import Timing, compare_spread

        if dkey is None:
            return "default not timed"
        if best == dkey:
            return "default"

        def timing(t: dict[str, float]) -> Timing:
            return Timing(median_ms=t["median_ms"], p20_ms=t["p20_ms"], p80_ms=t["p80_ms"], reps=self.reps)

        if compare_spread(timing(timed[best]), timing(timed[dkey])).verdict != "faster":
            return "within noise"
        again = self._time(space, [best, dkey], dtype, size, self.reps)
        res.confirm = {str(best): again[0], str(dkey): again[1]}
        return "faster" if compare_spread(timing(again[0]), timing(again[1])).verdict == "faster" else "within noise"

    def _store(self, env_key: str, env: dict[str, str], ekey: str, res: TuneResult) -> None:
        entry = {
            "provider": res.winner.provider, "meta": res.winner.meta_dict, "median_ms": res.winner_ms,
            "default": str(res.default), "default_ms": res.default_ms, "candidates": res.timings,
            "dropped": res.dropped, "pruned": res.pruned, "strategy": self.strategy, "tuned_at": res.tuned_at,
            "synced_from_rank": None, "verdict": res.verdict, "fastest": res.fastest, "fastest_ms": res.fastest_ms,
            "confirm": res.confirm,
        }  # fmt: skip

        def add(data: dict[str, Any]) -> None:  # merged into what the file holds now (other writers' entries)
            data["environments"].setdefault(env_key, {"env": env, "entries": {}})["entries"][ekey] = entry

        update_cache(add, self.path)

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

    def merge(data: dict[str, Any]) -> None:
        mine = data["environments"].setdefault(env_key, {"env": env, "entries": {}})
        for k, e in got["entries"].items():
            mine["entries"][k] = {**e, "synced_from_rank": 0, "source_env": got["env"]} if comm.rank else e
        if comm.rank:
            mine["entries"] = {k: v for k, v in mine["entries"].items() if k in got["entries"]}

    update_cache(merge)
    return len(got["entries"])
