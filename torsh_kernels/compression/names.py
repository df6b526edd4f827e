"""One name per compressor: the registry that maps a compressor's name to its constructor, and back.

A name is ``family`` or ``family:arg[,key=value...]``::

    none  fp16  bf16  int8  int4  fp8  fp8:e5m2  sign  topk:0.01  powersgd  powersgd:4
    int8:stochastic=true,scheme=shared_scale   topk:0.01,exact=true   powersgd:4,start_iter=10

``arg`` is the family's main setting (top-k's ``ratio``, required; PowerSGD's ``rank``, default 1); the
keys are the compressor's other constructor settings (its dataclass fields: ``block``, ``stochastic``,
``scheme``, ``error_feedback``, ``check_finite``, ``provider``, ...). :func:`compressor_from_name` builds
the compressor (typed errors: an unknown family lists the known ones, a bad argument or key says which and
what it takes); every compressor's ``name`` is its canonical name, the one string that builds an equal
compressor (``compressor_from_name(c.name) == c``): the family, the main setting when the family has one,
then every setting that differs from its default, in field order.

This module is the one home of these names: the DDP hook, the synchronizer, ``compressed_all_reduce``,
``compressor="auto"``'s candidates, the planner's default candidates, FSDP2's comm formats (``"int8"``,
``"int4"``) and ``torsh doctor`` all read them here. ``"auto"`` is not a compressor: the hook and the
synchronizer accept it beside these names (:data:`AUTO`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ArgumentTypeError, InvalidArgumentError
from .base import Compressor
from .cast import BF16, FP16, NoCompression
from .fp8 import FP8
from .powersgd import PowerSGD
from .quantize import Quantize
from .sign import Sign
from .topk import TopK

__all__ = [
    "AUTO",
    "COMPRESSOR_NAMES",
    "DEFAULT_CANDIDATE_NAMES",
    "QUANTIZED_FORMATS",
    "Family",
    "as_compressor",
    "compressor_from_name",
    "compressor_name",
    "describe_names",
]

AUTO = "auto"
"""Not a compressor's name: the hook and the synchronizer's ``compressor="auto"`` (measure, then choose)."""


@dataclass(frozen=True, slots=True)
class Family:
    """One family of names: the class it builds, the settings its name fixes, its main argument."""

    name: str
    cls: type[Compressor]
    fixed: tuple[tuple[str, object], ...] = ()
    """Settings the family's name fixes (``int8``: bits=8); not keys of the name."""
    arg: str | None = None
    """The field the name's positional argument sets (None: the family takes none)."""
    arg_required: bool = False
    summary: str = ""

    def fields(self) -> list[dataclasses.Field]:
        """The settings a name may give: the class's init fields but the fixed and the private ones."""
        fixed = {k for k, _ in self.fixed}
        fs = dataclasses.fields(self.cls)
        return [f for f in fs if f.init and not f.name.startswith("_") and f.name not in fixed]

    def keys(self) -> list[str]:
        return [f.name for f in self.fields() if f.name != self.arg]

    def form(self) -> str:
        """``topk:RATIO[,key=value...]``, for help and errors."""
        if self.arg is None:
            return self.name + ("[:key=value,...]" if self.keys() else "")
        head = f"{self.name}:{self.arg.upper()}" if self.arg_required else f"{self.name}[:{self.arg.upper()}]"
        return head + ("[,key=value,...]" if self.keys() else "")


_FAMILIES: tuple[Family, ...] = (
    Family("none", NoCompression, summary="uncompressed (the tensor's own dtype)"),
    Family("fp16", FP16, summary="cast to fp16, 2 bytes per element (PyTorch's fp16_compress_hook)"),
    Family("bf16", BF16, summary="cast to bf16, 2 bytes per element"),
    Family("int8", Quantize, (("bits", 8),), summary="blockwise absmax int8, error feedback"),
    Family("int4", Quantize, (("bits", 4),), summary="blockwise absmax int4 (two per byte), error feedback"),
    Family("fp8", FP8, arg="fmt", summary="blockwise absmax fp8 (FMT e4m3, the default, or e5m2), error feedback"),
    Family("sign", Sign, summary="1 bit per element plus a scale (EF-SignSGD), error feedback"),
    Family("topk", TopK, arg="ratio", arg_required=True, summary="the RATIO largest magnitudes, error feedback"),
    Family("powersgd", PowerSGD, arg="rank", summary="rank-RANK PowerSGD (default 1), error feedback"),
)

FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}
"""Every family, by name."""

COMPRESSOR_NAMES: tuple[str, ...] = tuple(FAMILIES)
"""The families' names, in the order ``torsh doctor`` lists them."""

DEFAULT_CANDIDATE_NAMES: tuple[str, ...] = (
    "none", "fp16", "bf16", "topk:0.01", "int8", "fp8:e4m3", "int4", "sign", "powersgd:4",
)  # fmt: skip
"""What ``compressor="auto"`` and the planner choose among unless told otherwise (the list a demo shows)."""

QUANTIZED_FORMATS: dict[str, int] = {f.name: dict(f.fixed)["bits"] for f in _FAMILIES if f.cls is Quantize}
"""The quantized formats by name, bits per element: FSDP2's ``apply_quantized_comm(weights=, grads=)``."""


def _family_of(c: Compressor) -> Family | None:
    for f in _FAMILIES:
        if type(c) is f.cls and all(getattr(c, k) == v for k, v in f.fixed):
            return f
    return None


def _kind(f: dataclasses.Field) -> str:
    """The field's value type as its annotation says: 'bool', 'int', 'float', 'str' or 'str?' (str | None)."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    t = t.replace(" ", "")
    return {"bool": "bool", "int": "int", "float": "float", "str": "str", "str|None": "str?"}.get(t, "str")


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _format(v: object, f: dataclasses.Field) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) or (_kind(f) == "float" and isinstance(v, int)):
        return repr(float(v))  # the shortest text that reads back as the same float; 1 and 1.0 alike
    return str(v)


def compressor_name(c: Compressor) -> str:
    """The canonical name of ``c``: the string that builds an equal compressor (see the module docstring).
    A compressor of a class outside the registry (a user's own) is named by its class, lower case, as its
    label was before these names (no name builds it)."""
    fam = _family_of(c)
    if fam is None:
        return type(c).__name__.lower()
    head, keys = fam.name, []
    for f in fam.fields():
        v = getattr(c, f.name)
        if f.name == fam.arg:
            head += f":{_format(v, f)}"
        elif v != _default(f):
            keys.append(f"{f.name}={_format(v, f)}")
    return head + ("," if keys and fam.arg is not None else ":" if keys else "") + ",".join(keys)


def _bad(text: str, msg: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"compressor name {text!r}: {msg}")


def _parse_value(text: str, fam: Family, f: dataclasses.Field, raw: str) -> object:
    kind = _kind(f)
    what = f"{fam.name}'s {f.name}"
    if kind == "bool":
        low = raw.lower()
        if low not in ("true", "false"):
            raise _bad(text, f"{what} must be true or false, got {raw!r}")
        return low == "true"
    if kind == "int":
        try:
            return int(raw, 10)
        except ValueError:
            raise _bad(text, f"{what} must be an integer, got {raw!r}") from None
    if kind == "float":
        try:
            v = float(raw)
        except ValueError:
            raise _bad(text, f"{what} must be a number, got {raw!r}") from None
        if not math.isfinite(v):
            raise _bad(text, f"{what} must be a finite number, got {raw!r}")
        return v
    if not raw:
        raise _bad(text, f"{what} is empty")
    return raw


def compressor_from_name(text: object) -> Compressor:
    """The compressor a name stands for (``"int8"``, ``"topk:0.01"``, ``"powersgd:4,start_iter=10"``).

    Raises ArgumentTypeError for a non-string, InvalidArgumentError for an unknown family (listing the
    known ones), a missing, extra or malformed argument, an unknown or repeated key (listing the family's
    keys), or a value the compressor refuses (its own message)."""
    if not isinstance(text, str):
        raise ArgumentTypeError(f"compressor name: expected a string, got {type(text).__name__}")
    family, sep, rest = text.strip().partition(":")
    fam = FAMILIES.get(family.strip())
    if fam is None:
        extra = "; 'auto' is accepted where a compressor is chosen per job (the hook, the synchronizer)"
        raise _bad(text, f"unknown compressor; known: {', '.join(COMPRESSOR_NAMES)}"
                   + (extra if family.strip() == AUTO else ""))  # fmt: skip
    fields = {f.name: f for f in fam.fields()}
    kwargs: dict[str, object] = {}
    parts = [p.strip() for p in rest.split(",")] if sep else []
    if sep and not rest.strip():
        raise _bad(text, f"nothing after ':'; the form is {fam.form()}")
    for i, part in enumerate(parts):
        if not part:
            raise _bad(text, f"an empty setting; the form is {fam.form()}")
        key, eq, raw = part.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq:
            if i != 0 or fam.arg is None:
                hint = f"{fam.name} takes no positional argument" if fam.arg is None else \
                    f"only the first setting may be positional ({fam.arg})"  # fmt: skip
                keys = ", ".join(fam.keys())
                raise _bad(text, f"{hint}; give settings as key=value (keys: {keys or 'none'})")
            key, raw = fam.arg, part
        if key not in fields:
            keys = ", ".join(([fam.arg] if fam.arg else []) + fam.keys())
            raise _bad(text, f"{fam.name} has no setting {key!r}; its settings: {keys or 'none'}")
        if key in kwargs:
            raise _bad(text, f"{key} is given twice")
        kwargs[key] = _parse_value(text, fam, fields[key], raw)
    if fam.arg_required and fam.arg not in kwargs:
        raise _bad(text, f"{fam.name} needs its {fam.arg}: {fam.form()}, e.g. {fam.name}:0.01")
    try:
        return fam.cls(**dict(fam.fixed), **kwargs)
    except InvalidArgumentError as e:
        raise _bad(text, str(e)) from None
    except ArgumentTypeError as e:
        raise ArgumentTypeError(f"compressor name {text!r}: {e}") from None


def as_compressor(value: object, what: str, *, allow_auto: bool = False) -> object:
    """``value`` as an entry point takes it: a name becomes its compressor (``"auto"`` stays as it is where
    ``allow_auto``); anything else is returned unchanged for the caller's own checks. Errors name ``what``."""
    if not isinstance(value, str):
        return value
    if allow_auto and value == AUTO:
        return value
    try:
        return compressor_from_name(value)
    except InvalidArgumentError as e:
        also = " (or 'auto': measure this job's candidates and choose one)" if allow_auto else ""
        raise InvalidArgumentError(f"{what}: {e}{also}") from None


def former_label(c: Compressor | None) -> str:
    """The short label compressors had before these names (``topk(0.01)``, ``powersgd(rank=4)``,
    ``int8-stochastic-shared_scale``), so that a checkpoint's ``auto`` choice recorded under it still loads."""
    if c is None:
        return "none"
    if isinstance(c, TopK):
        return f"topk({c.ratio:g})"
    if isinstance(c, PowerSGD):
        return f"powersgd(rank={c.rank})"
    if isinstance(c, Quantize):
        return f"int{c.bits}" + ("-stochastic" if c.stochastic else "") + ("" if c.scheme == "auto" else f"-{c.scheme}")
    return type(c).__name__.lower() if not isinstance(c, NoCompression) else "nocompression"


def describe_names() -> list[tuple[str, str]]:
    """(form, what it is) per family, for ``torsh doctor`` and help texts."""
    return [(f.form(), f.summary + (f"; keys: {', '.join(f.keys())}" if f.keys() else "")) for f in _FAMILIES]
