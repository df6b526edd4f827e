"""Reading a configuration safely: a JSON file with bounded work (its size, its nesting, its integers), and the
nesting of settings given as Python objects.

- A file is read only if it is a regular file of at most :data:`MAX_FILE_BYTES` (``files.read_capped``: a FIFO
  does not block, ``/dev/zero`` is not read); its nesting is measured before it is parsed, so a file nested
  deeper than :data:`MAX_DEPTH` levels is a one-line error, not the parser's ``RecursionError``; an integer
  literal of more than :data:`MAX_DIGITS` digits is not converted (Python refuses past 4300 digits with a
  ``ValueError``) but kept as a :class:`~.common.HugeInt`, which the value checks then refuse under its key.
  Problems with the file as a whole are an :class:`~torsh_kernels.errors.InvalidArgumentError` naming it.
- Settings given as a dict (or read from a file) are refused past :data:`MAX_DEPTH` levels under the top-level
  key that holds the nesting: copying or printing them would recurse that deep.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import InvalidArgumentError
from ..files import read_capped
from .common import HugeInt

__all__ = ["MAX_DEPTH", "MAX_DIGITS", "MAX_FILE_BYTES", "deeper_than", "read_json_object"]

MAX_FILE_BYTES = 1 << 20
"""The largest configuration file read: 1 MiB (DeepSpeed's configs are a few KB)."""
MAX_DEPTH = 32
"""The deepest nesting accepted in the settings (DeepSpeed's nest 4 levels: zero_optimization.offload_param.
device under the top-level object)."""
MAX_DIGITS = 20
"""The longest integer literal converted (int64's largest has 19 digits; no setting needs more)."""

_STRUCTURE = bytes(b for b in range(256) if b not in b"[]{}")  # translate() deletes these


def _literal(text: str) -> int | HugeInt:
    digits = len(text) - text.startswith("-")
    return HugeInt(digits) if digits > MAX_DIGITS else int(text)


def _too_deep(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests deeper than ``limit``: its strings removed (escaped backslashes and
    quotes first, then everything between two quotes), only brackets kept, and counted until the limit."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    parts = text.split(b'"')
    outside = b"".join(parts[::2])  # (an odd count of quotes is malformed JSON, which the parser reports)
    depth = 0
    for b in outside.translate(None, _STRUCTURE):
        depth += 1 if b in b"[{" else -1
        if depth > limit:
            return True
    return False


def read_json_object(path: str | os.PathLike, what: str) -> dict:
    """The JSON object in the file ``path`` (see the module docstring); an InvalidArgumentError naming the file
    when it is missing, not a regular file, too large, nested too deep, not JSON or not an object."""
    p = Path(path)

    def fail(why: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"{what}: {str(p)!r}: {why}")

    rule = f"a configuration file is read only if it is a regular file of at most {MAX_FILE_BYTES} bytes"
    try:
        raw = read_capped(p, MAX_FILE_BYTES, lambda why: fail(f"{why} ({rule})"))
    except FileNotFoundError:
        raise InvalidArgumentError(f"{what}: no such file {str(p)!r} (a dict or a JSON file's path)") from None
    except OSError as e:
        raise fail(f"cannot be read ({e.strerror or e})") from None
    if _too_deep(raw, MAX_DEPTH):
        raise fail(f"nested deeper than {MAX_DEPTH} levels, the limit (DeepSpeed's configs nest about 4 deep)")
    try:
        cfg = json.loads(raw, parse_int=_literal)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"is not JSON: {e}") from None
    except (RecursionError, ValueError) as e:  # (not expected after the checks above: still one typed error)
        raise fail(f"cannot be parsed: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, dict):
        raise fail(f"holds a JSON {type(cfg).__name__}, not an object")
    return cfg


def deeper_than(v: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``v`` (dicts, lists and tuples, any mix) nests more than ``limit`` levels below itself; walked
    without recursion, and stopping at the limit (a structure that holds itself is deeper than any limit)."""
    stack = [(v, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, Mapping):
            children = x.values()
        elif isinstance(x, (list, tuple)):
            children = x
        else:
            continue
        if d >= limit:
            return True
        stack.extend((c, d + 1) for c in children)
    return False
