"""What the mappings of :mod:`torsh_kernels.config` share: :class:`Walk`, the record of what became of every key
(mapped, ignored, noted, refused), the value checks that record a refusal instead of raising, the bounds every
number is checked against, and the reasons several sources give for keys outside torsh's scope.

Every number that reaches a torsh object is checked at import: of the right type (``True`` is not a number),
finite, and inside a range (:data:`MAX_INT`, :data:`F32_MAX` unless a setting has a tighter one); a refusal
names the key and the range. Values are shown in messages by :func:`show_value`, which never fails and stays
short (a 5000-digit integer, a 100k-deep list, an object whose ``repr`` raises).
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ArgumentTypeError, ConfigMappingError
from .migration import Migration

__all__ = [
    "BAD",
    "CHECKPOINT_REASON",
    "F32_MAX",
    "LOGGING_REASON",
    "MAX_INT",
    "HugeInt",
    "Walk",
    "check_bool",
    "check_choice",
    "check_dict",
    "check_int",
    "check_num",
    "short_value",
    "show_value",
    "unknown_key",
]


BAD = object()
"""A value that failed its check (the reason is recorded)."""

MAX_INT = 2**63 - 1
"""The largest integer any setting may hold (int64's largest, what torch counts steps and sizes in); settings
with a meaning have tighter bounds (a ZeRO stage, a number of experts)."""
F32_MAX = 3.4028234663852886e38
"""The largest finite float32 (``torch.finfo(torch.float32).max``): a hyperparameter beyond it is inf once
torch holds it in an fp32 tensor (optimizer states, router weights), so no float setting may exceed it."""


class HugeInt:
    """An integer too long to convert, as a JSON file gave it (``json.loads`` would raise ``ValueError`` past
    Python's 4300-digit limit, and no setting needs more than 19 digits): only its number of digits is kept,
    and every check refuses it under its key."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


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


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict = 3, 6, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 60, 60, 40


def short_value(v: Any) -> str:
    """``repr(v)``, short and never raising: an int too long to print whole by its number of digits, nested or
    long containers and strings cut (``reprlib``), an object whose ``repr`` raises by its type."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 128:
        return f"<an integer of about {int(v.bit_length() * math.log10(2)) + 1} digits>"
    try:
        return _REPR.repr(v)
    except Exception:  # (a repr that raises, or an int inside a container past Python's digit limit)
        return f"<{type(v).__name__} object>"


def show_value(v: Any) -> str:
    return repr(v) if isinstance(v, HugeInt) else f"{type(v).__name__} {short_value(v)}"


def _auto(v: Any) -> str:
    return (
        " ('auto' is filled in by Hugging Face's Trainer: give the value itself)"
        if isinstance(v, str) and v == "auto"
        else ""
    )


def check_bool(w: Walk, key: str, v: Any) -> Any:
    return v if isinstance(v, bool) else w.bad(key, f"must be true or false, got {show_value(v)}" + _auto(v))


def check_int(w: Walk, key: str, v: Any, lo: int = 0, hi: int = MAX_INT, why: str = "") -> Any:
    """An int in [lo, hi] (``why``: the reason for the bound, added to the refusal), else BAD (recorded)."""
    if isinstance(v, HugeInt):
        return w.bad(key, f"must be at most {hi}, got {v!r}")
    if isinstance(v, bool) or not isinstance(v, int):
        return w.bad(key, f"must be an integer, got {show_value(v)}" + _auto(v))
    if lo <= v <= hi:
        return v
    bound = f">= {lo}" if v < lo else f"at most {hi}"
    return w.bad(key, f"must be {bound}, got {short_value(v)}" + (f" ({why})" if why else ""))


def check_num(
    w: Walk, key: str, v: Any, lo: float = 0.0, *, strict: bool = False, hi: float = F32_MAX, hi_open: bool = False,
    why: str = "",
) -> Any:  # fmt: skip
    """A finite number in [lo, hi] (``(lo, ...`` with ``strict``, ``..., hi)`` with ``hi_open``) as a float, else
    BAD (recorded); ``why``: the reason for the bounds, added to a refusal."""
    if isinstance(v, HugeInt):
        return w.bad(key, f"must be a number at most {hi:g}, got {v!r}")
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return w.bad(key, f"must be a finite number, got {show_value(v)}" + _auto(v))
    try:
        f = float(v)
    except OverflowError:  # an int beyond float's range
        f = math.inf if v > 0 else -math.inf
    if not math.isfinite(f):
        return w.bad(key, f"must be a finite number, got {short_value(v)}")
    if f < lo or (strict and f == lo) or f > hi or (hi_open and f == hi):
        bound = f"{'>' if strict else '>='} {lo:g}" if f <= lo else f"{'<' if hi_open else 'at most'} {hi:g}"
        return w.bad(key, f"must be {bound}, got {short_value(v)}" + (f" ({why})" if why else ""))
    return f


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
