"""The argument checks every layer shares: one typed error per kind of mistake, one wording.

Each check takes the value, ``what`` (the function or class that was called, as the user wrote it) and
``name`` (the argument), and returns the value as the caller uses it (an ``int`` for a NumPy integer, a
``float`` for an int given where a real number goes). A value of the wrong type is an
:class:`~torsh_kernels.errors.ArgumentTypeError` (``True`` is not an int here, and ``1`` is not a bool); a
value of the right type out of range is an :class:`~torsh_kernels.errors.InvalidArgumentError`. A message
says what was given and what was expected::

    MoELayer: top_k=9 must be an int in [1, 8]
    Quantize: stochastic must be True or False, got int 1

Specs (:mod:`torsh_kernels.specs`) call these in ``__post_init__``, once per spec: a layer that holds a
spec validates nothing more per call.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence

import torch

from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "MAX_TIMEOUT", "check_bool", "check_choice", "check_int", "check_number", "check_optional_int", "check_timeout",
    "env_flag", "env_int", "short",
]  # fmt: skip


def short(v: object) -> str:
    """``repr(v)``, cut to a readable length (a huge int or a long list in a message); a tensor by its shape; an
    int too long for ``repr`` (Python refuses past 4300 digits) by its size."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 14000:  # about 4200 digits
        return f"<an int of about {int(v.bit_length() * 0.30103) + 1} digits>"
    r = repr(v) if not isinstance(v, torch.Tensor) else f"tensor{tuple(v.shape)}"
    return r if len(r) <= 60 else r[:57] + "..."


def check_bool(v: object, what: str, name: str) -> bool:
    """True or False; anything else (0 and 1 included) is an ArgumentTypeError."""
    if not isinstance(v, bool):
        raise ArgumentTypeError(f"{what}: {name} must be True or False, got {type(v).__name__} {short(v)}")
    return v


def _range(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    if hi is None or hi == math.inf:
        return f"{'>' if lo_open else '>='} {lo:g}" if isinstance(lo, float) else f"{'>' if lo_open else '>='} {lo}"
    if lo is None or lo == -math.inf:
        return f"{'<' if hi_open else '<='} {hi:g}" if isinstance(hi, float) else f"{'<' if hi_open else '<='} {hi}"
    a, b = (f"{x:g}" if isinstance(x, float) else str(x) for x in (lo, hi))
    return f"in {'(' if lo_open else '['}{a}, {b}{')' if hi_open else ']'}"


def check_int(v: object, what: str, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """An int in [lo, hi] (either bound optional); a bool, float, str, tensor... is an ArgumentTypeError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ArgumentTypeError(f"{what}: {name} must be an int, got {type(v).__name__} {short(v)}")
    i = int(v)
    if (lo is not None and i < lo) or (hi is not None and i > hi):
        raise InvalidArgumentError(f"{what}: {name}={short(v)} must be an int {_range(lo, hi)}")
    return i


def check_optional_int(v: object, what: str, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    """None, or :func:`check_int`."""
    return None if v is None else check_int(v, what, name, lo, hi)


def check_number(
    v: object, what: str, name: str, *, lo: float = -math.inf, hi: float = math.inf, lo_open: bool = False,
    hi_open: bool = False,
) -> float:  # fmt: skip
    """A finite real number in [lo, hi] (an open end with ``lo_open`` / ``hi_open``), as a float; a bool, str,
    tensor... is an ArgumentTypeError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ArgumentTypeError(f"{what}: {name} must be a number, got {type(v).__name__} {short(v)}")
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        f = math.inf if v > 0 else -math.inf
    if not math.isfinite(f) or f < lo or f > hi or (lo_open and f == lo) or (hi_open and f == hi):
        rng = _range(float(lo), float(hi), lo_open, hi_open)
        raise InvalidArgumentError(f"{what}: {name}={short(v)} must be a finite number {rng}")
    return f


def check_choice(v: object, what: str, name: str, choices: Sequence[str]) -> str:
    """One of ``choices`` (strings); anything else, of any type, is an InvalidArgumentError (a choice is a
    value among names, as PyTorch's own ``reduction="mean"`` arguments are checked)."""
    if not isinstance(v, str) or v not in choices:
        raise InvalidArgumentError(f"{what}: {name}={short(v)}; expected one of {', '.join(map(repr, choices))}")
    return v


MAX_TIMEOUT = 365 * 24 * 3600.0
"""The longest timeout accepted, in seconds (a year): longer is a typo (``1e300``), and it must stay a valid
``datetime.timedelta`` and thread wait; for no limit at all, leave the timeout at its default."""


def check_timeout(v: object, what: str, name: str = "timeout") -> float:
    """A timeout: a finite number of seconds in (0, :data:`MAX_TIMEOUT`] (not NaN, inf or a bool), as a float."""
    return check_number(v, what, name, lo=0.0, hi=MAX_TIMEOUT, lo_open=True)


_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def env_flag(name: str, default: bool, what: str) -> bool:
    """A boolean environment variable: unset or empty gives ``default``; ``1/true/yes/on`` and ``0/false/no/off``
    (any case, blanks around) give True and False; anything else is an InvalidArgumentError naming it."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if not v:
        return default
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise InvalidArgumentError(f"{what}: {name}={raw!r}; expected 1 or 0 (true/false, yes/no, on/off)")


def env_int(name: str, default: int, what: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer environment variable in [lo, hi]: unset or empty gives ``default``; anything that is not such an
    integer is an InvalidArgumentError naming the variable and what it takes."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip()
    if len(text) > 30 or not text.lstrip("+-").isdigit():  # (int() of 5000 digits is slow and raises ValueError)
        raise InvalidArgumentError(f"{what}: {name}={short(raw)}; expected an integer {_range(lo, hi)}")
    v = int(text)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgumentError(f"{what}: {name}={text} must be an integer {_range(lo, hi)}")
    return v
