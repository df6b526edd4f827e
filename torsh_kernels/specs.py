"""Specs: one validated value per configuration that travels between layers and ranks.

A spec is a frozen, slotted, keyword-only dataclass that derives from :class:`Spec`::

    @dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
    class RouterSpec(Spec):
        k: int
        \"\"\"Experts per token.\"\"\"
        score: str = "softmax"
        \"\"\"...\"\"\"

        def __post_init__(self) -> None:
            check_int(self.k, "RouterSpec", "k", 1)   # torsh_kernels.checks; typed errors
            ...

It is validated once, at construction (``__post_init__``, with :mod:`torsh_kernels.checks`); it is
hashable, so what a layer derives from it (a kernel's arguments, a cost) is cached by the spec and a call
that holds one validates nothing again. ``replace(**changes)`` makes a changed copy, validated again.

``signature()`` is what cross-rank agreement exchanges (:func:`~torsh_kernels.collectives.agreement.agree`):
the spec's class, then every field as (name, plain value), except the fields marked :func:`local` (a kernel
provider, a flag that only changes what this rank checks: nothing another rank sends depends on them).
Nothing lists a spec's fields by hand a second time.

A layer takes the spec, and the spec's fields as convenience keywords where its users expect them
(``moe_route(logits, k=2)``): :meth:`Spec.build` turns (spec, keywords) into one spec, once per distinct set
of keywords.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from .errors import ArgumentTypeError, TorshKernelsError

__all__ = ["LOCAL", "Spec", "local", "plain"]

S = TypeVar("S", bound="Spec")

LOCAL = {"agree": False}
"""Field metadata of a setting that ranks need not share (see :func:`local`)."""

_PLAIN = (int, float, str, bool, type(None), torch.dtype)


def plain(value: object) -> object:
    """``value`` if it is plain (a number, a string, None, a dtype, a tuple of them), else its type's name:
    what a field may hold so that its ``repr`` is the same on every rank (no memory addresses)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Spec):
        return value.signature()
    if isinstance(value, (tuple, list, torch.Size)):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def local(default: Any) -> Any:
    """A spec field with this default that :meth:`Spec.signature` leaves out: a setting that changes nothing
    another rank sends or expects (a kernel provider, a local check)."""
    return dataclasses.field(default=default, metadata=LOCAL)


_AGREED: dict[type, tuple[str, ...]] = {}
_BUILT: dict[tuple, Spec] = {}  # (class, keywords) -> the spec Spec.build made of them


class Spec:
    """The base of every spec (see the module docstring)."""

    __slots__ = ()

    @classmethod
    def agreed_fields(cls) -> tuple[str, ...]:
        """The names of the fields that :meth:`signature` carries, in declaration order."""
        names = _AGREED.get(cls)
        if names is None:
            names = tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("agree", True))
            _AGREED[cls] = names
        return names

    def signature(self) -> tuple[tuple[str, object], ...]:
        """What ranks must share: ("spec", the class's name), then (field, plain value) for every field that is
        not :func:`local`; a nested spec stands as its own signature."""
        return (("spec", type(self).__qualname__), *((n, plain(getattr(self, n))) for n in self.agreed_fields()))

    def signature_fields(self, prefix: str) -> list[tuple[str, object]]:
        """The signature as fields of an exchange, each named ``prefix.field``; a nested spec's fields
        flattened (``layer.route.k``), so that a mismatch message names the one field that differs."""
        out: list[tuple[str, object]] = []
        for n in self.agreed_fields():
            v = getattr(self, n)
            if isinstance(v, Spec):
                out += v.signature_fields(f"{prefix}.{n}")
            else:
                out.append((f"{prefix}.{n}", plain(v)))
        return out

    @classmethod
    def make(cls: type[S], what: str, **fields: Any) -> S:
        """``cls(**fields)``, a missing required field an ArgumentTypeError that names ``what``."""
        try:
            return cls(**fields)
        except TorshKernelsError as e:  # a field's check: named after who was called
            if what == cls.__name__:
                raise
            msg = str(e).removeprefix(f"{cls.__name__}: ")
            raise type(e)(f"{what}: {msg}") from None
        except TypeError as e:  # a required field missing (the dataclass's own message)
            raise ArgumentTypeError(f"{what}: {e}") from None

    def normalize(self, name: str, value: object) -> None:
        """Store a field's checked value (an ``int`` for a NumPy integer...) from ``__post_init__``, which a
        frozen dataclass cannot assign."""
        object.__setattr__(self, name, value)

    def fields(self) -> dict[str, Any]:
        """The fields by name (not a deep copy)."""
        return {n: getattr(self, n) for n in type(self).__dataclass_fields__}

    def replace(self: S, **changes: Any) -> S:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    @classmethod
    def build(cls: type[S], spec: object, options: Mapping[str, Any], what: str, name: str = "spec") -> S:
        """The spec a layer runs with: ``spec`` (an instance of this class, or None for the defaults) with
        ``options`` (fields given as keywords) applied. An unknown keyword or a spec of another class is an
        ArgumentTypeError naming the fields; the spec made of a set of keywords is kept (per class), so a
        call repeated with the same keywords builds and validates it once."""
        if spec is not None and not isinstance(spec, cls):
            raise ArgumentTypeError(f"{what}: {name} must be a {cls.__name__} or None, got {type(spec).__name__}")
        if not options:
            return spec if spec is not None else cls.make(what)
        key = None
        if not torch.compiler.is_compiling():  # (while dynamo traces: built in the graph's prologue, uncached)
            try:
                key = (cls, spec, tuple((n, type(v), v) for n, v in options.items()))  # 2.0 == 2 == True: not alike
                hash(key)
            except TypeError:  # an unhashable value (a list): build it, uncached
                key = None
        if key is not None and (hit := _BUILT.get(key)) is not None:
            return hit  # type: ignore[return-value]
        fields = cls.__dataclass_fields__  # (dataclasses.fields(cls) breaks a dynamo graph)
        unknown = [k for k in options if k not in fields]
        if unknown:
            raise ArgumentTypeError(
                f"{what}: unexpected keyword argument(s) {', '.join(map(repr, unknown))}; the {cls.__name__} "
                f"fields are {', '.join(sorted(fields))}"
            )
        made = cls.make(what, **{**spec.fields(), **options}) if spec is not None else cls.make(what, **options)
        if key is not None:
            if len(_BUILT) >= 4096:
                _BUILT.clear()
            _BUILT[key] = made
        return made
