"""What the mappings of :mod:`torsh_kernels.config` share: :class:`Walk`, the record of what became of every key
(mapped, ignored, noted, refused), the value checks that record a refusal instead of raising, and the reasons
several sources give for keys outside torsh's scope.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ArgumentTypeError, ConfigMappingError
from .migration import Migration

__all__ = [
    "BAD",
    "CHECKPOINT_REASON",
    "LOGGING_REASON",
    "Walk",
    "check_bool",
    "check_choice",
    "check_dict",
    "check_int",
    "check_num",
    "show_value",
    "unknown_key",
]


BAD = object()
"""A value that failed its check (the reason is recorded)."""


class Walk:
    """What one mapping found, by dotted key: mapped keys, ignored keys, notes, errors."""

    __slots__ = ("errors", "ignore", "ignored", "mapped", "notes", "what")

    def __init__(self, what: str, ignore: Iterable[str]) -> None:
        if isinstance(ignore, str) or not isinstance(ignore, Iterable):
            raise ArgumentTypeError(f"{what}: ignore must be a list of dotted keys, got {ignore!r}")
        self.what = what
        self.ignore: set[str] = set()
        for k in ignore:
            if not isinstance(k, str):
                raise ArgumentTypeError(f"{what}: ignore must hold dotted keys (str), got {k!r}")
            self.ignore.add(k)
        self.errors: dict[str, str] = {}
        self.mapped: dict[str, str] = {}
        self.ignored: dict[str, str] = {}
        self.notes: dict[str, str] = {}

    def take(self, d: Mapping, key: str, dotted: str | None = None) -> bool:
        """Whether ``key`` is in ``d`` and to be mapped (False, and listed as ignored, where the caller asked
        to leave it out with ``ignore=``)."""
        if key not in d:
            return False
        dotted = dotted or key
        if dotted in self.ignore:
            self.ignored[dotted] = "left out on request (ignore=)"
            return False
        return True

    def bad(self, key: str, reason: str) -> object:
        self.errors.setdefault(key, reason)
        return BAD

    def skip(self, key: str, reason: str) -> None:
        self.ignored[key] = reason

    def map(self, key: str, dest: str) -> None:
        self.mapped[key] = dest

    def note(self, key: str, text: str) -> None:
        self.notes[key] = f"{self.notes[key]}; {text}" if key in self.notes else text

    def finish(self, m: Migration) -> None:
        for k in sorted(self.ignore - set(self.ignored)):
            self.errors.setdefault(k, "named in ignore= but not in the settings")
        if self.errors:
            lines = "\n".join(f"  {k}: {r}" for k, r in self.errors.items())
            n = len(self.errors)
            raise ConfigMappingError(
                f"{self.what}: {n} setting{'s' if n > 1 else ''} cannot be mapped to torsh:\n{lines}",
                keys=self.errors,
            )
        m.mapped, m.ignored, m.notes = self.mapped, self.ignored, self.notes


def show_value(v: Any) -> str:
    return f"{type(v).__name__} {v!r}"


def _auto(v: Any) -> str:
    return (
        " ('auto' is filled in by Hugging Face's Trainer: give the value itself)"
        if isinstance(v, str) and v == "auto"
        else ""
    )


def check_bool(w: Walk, key: str, v: Any) -> Any:
    return v if isinstance(v, bool) else w.bad(key, f"must be true or false, got {show_value(v)}" + _auto(v))


def check_int(w: Walk, key: str, v: Any, lo: int = 0) -> Any:
    if isinstance(v, bool) or not isinstance(v, int):
        return w.bad(key, f"must be an integer, got {show_value(v)}" + _auto(v))
    return v if v >= lo else w.bad(key, f"must be >= {lo}, got {v}")


def check_num(w: Walk, key: str, v: Any, lo: float = 0.0, *, strict: bool = False) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return w.bad(key, f"must be a finite number, got {show_value(v)}" + _auto(v))
    if v < lo or (strict and v == lo):
        return w.bad(key, f"must be {'>' if strict else '>='} {lo:g}, got {v}")
    return float(v)


def check_choice(w: Walk, key: str, v: Any, options: tuple[str, ...], *, lower: bool = False) -> Any:
    s = v.lower() if lower and isinstance(v, str) else v
    if not isinstance(s, str) or s not in options:
        return w.bad(key, f"must be one of {', '.join(map(repr, options))}, got {show_value(v)}" + _auto(v))
    return s


def check_dict(w: Walk, key: str, v: Any) -> Any:
    return v if isinstance(v, Mapping) else w.bad(key, f"must be an object (a dict), got {show_value(v)}")


def unknown_key(key: str, where: str) -> str:
    return (
        f"not {where} torsh knows (a typo, or a newer key: leave it out with ignore=[{key!r}] if it does not "
        "change the result)"
    )


LOGGING_REASON = "logging and profiling: torsh's profiling layer (TORSH_TRACE, torsh timeline, torsh report)"
CHECKPOINT_REASON = (
    "checkpointing: torch.save or torch.distributed.checkpoint (CompressionHookState and OffloadedOptimizer "
    "have state_dict())"
)
