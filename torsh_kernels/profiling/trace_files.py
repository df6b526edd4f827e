"""Reading trace files safely: the size and nesting limits (explicit, from the environment, or the
defaults), gzip decompressed a piece at a time, the JSON parsed with errors that name the problem, and the
strings a trace supplies made safe to print. :mod:`~torsh_kernels.profiling.traces` builds its model on
what this module reads.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from pathlib import Path

from ..checks import short
from ..errors import InvalidArgumentError, TraceFormatError
from ..files import open_regular

__all__ = [
    "ENV_MAX_BYTES",
    "ENV_MAX_DEPTH",
    "MAX_BYTES",
    "MAX_DEPTH",
    "parse",
    "printable",
    "printable_all",
    "read_json",
    "resolve_limit",
    "too_deep",
]

# -- reading files: limits -----------------------------------------------------------------------------

ENV_MAX_BYTES = "TORSH_TRACE_MAX_BYTES"
ENV_MAX_DEPTH = "TORSH_TRACE_MAX_DEPTH"
MAX_BYTES = 2 << 30
"""Default limit on a trace file's JSON text, after gzip decompression: 2 GiB (a trace that large already
takes tens of GB once parsed; Kineto's own traces of a few steps are tens to hundreds of MB)."""
MAX_DEPTH = 64
"""Default limit on JSON nesting: Chrome and Kineto traces nest 4 to 6 deep (top level, event list, event,
args, a list in args)."""
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}  # fmt: skip
_PIECE = 16 << 20  # bytes decompressed per read
MAX_LIMIT = 1 << 50
"""The largest size or depth limit accepted (a PiB): beyond it a value is a typo, and reads would overflow."""


def resolve_limit(value: object, env: str, default: int, what: str) -> int:
    """An explicit limit, else the environment variable's, else the default; a positive int."""
    src = what
    if value is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return default
        src = env
        m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", text)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if unit is None or (what == "max_depth" and unit != 1):
            example = "a number of levels, e.g. 100" if what == "max_depth" else "a number of bytes, e.g. 8GiB"
            raise InvalidArgumentError(f"{env}={text!r}: expected {example} (default {default})")
        value = int(m.group(1)) * unit
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{src}={value!r}: expected a positive integer (default {default})")
    if value > MAX_LIMIT:
        raise InvalidArgumentError(f"{src}={short(value)}: at most {MAX_LIMIT} (default {default})")
    return value


def _too_big(p: Path, limit: int, gz: bool) -> TraceFormatError:
    what = "decompresses to more than" if gz else "holds more than"
    return TraceFormatError(
        f"{p}: the trace {what} {limit} bytes of JSON, the limit (max_bytes; default 2 GiB); if it is a real trace "
        f"and this machine has the memory for it (parsed, it takes about 10x that), raise the limit: "
        f"{ENV_MAX_BYTES}=8GiB (or load(..., max_bytes=...))"
    )


def too_deep(p: Path, limit: int) -> TraceFormatError:
    """The error for a file nested deeper than ``limit`` levels."""
    return TraceFormatError(
        f"{p}: JSON nested deeper than {limit} levels, the limit (max_depth; traces nest about 5 deep): not a trace "
        f"this reader accepts; raise it with {ENV_MAX_DEPTH}=N (or load(..., max_depth=N)) if the file is one"
    )


def _read_text(p: Path, max_bytes: int) -> bytes | bytearray:
    """The JSON bytes of a trace file: read whole (at most ``max_bytes``), or decompressed from gzip a piece at
    a time, stopping as soon as the output passes ``max_bytes`` (a small file may inflate a thousandfold)."""
    try:
        f = open_regular(p, lambda why: TraceFormatError(f"{p}: {why}; expected a trace file"))
    except OSError as e:
        raise TraceFormatError(f"{p}: cannot be read ({e.strerror or e})") from e
    with f:
        try:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            if not gz:
                if os.fstat(f.fileno()).st_size > max_bytes:
                    raise _too_big(p, max_bytes, False)
                raw = f.read(max_bytes + 1)
                if len(raw) > max_bytes:  # it grew since the fstat
                    raise _too_big(p, max_bytes, False)
                return raw
            out = bytearray()
            with gzip.GzipFile(fileobj=f, mode="rb") as g:
                while piece := g.read(min(_PIECE, max_bytes + 1 - len(out))):
                    out += piece
                    if len(out) > max_bytes:
                        raise _too_big(p, max_bytes, True)
            return out
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise TraceFormatError(f"{p}: the gzip stream is truncated or corrupt ({e}); re-export the trace") from e
        except OSError as e:
            raise TraceFormatError(f"{p}: cannot be read ({e.strerror or e})") from e


_ONLY_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')  # translate() deletes these
_BRACKET_STEP = bytes(1 if b in b"[{" else 255 if b in b"]}" else 0 for b in range(256))  # -> int8: +1 open, -1 close
_QUOTE = bytes(1 if b == ord('"') else 0 for b in range(256))


def _scan(raw: bytes | bytearray) -> tuple[int, bool]:
    """(the nesting depth of a JSON text, whether some string in it may hold a control character), from its
    bytes at the speed of C. Escaped backslashes and escaped quotes are removed (left to right, as a JSON
    string is read): every quote left opens or closes a string. The text then holds a control character only
    if it still holds a backslash (an escape such as \\n or \\u001b), a DEL or a non-ASCII byte (a UTF-8 C1
    or bidi control), and only then is it searched for one. For the depth, only quotes and brackets are
    kept, adjacent quotes dropped in pairs (which changes no bracket's inside-or-outside: strings without
    brackets vanish), and the brackets outside strings summed (+1 open, -1 close): the depth is the peak."""
    import torch

    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    control = (b"\\" in text or b"\x7f" in text or not text.isascii()) and _CONTROL_IN_JSON.search(text) is not None
    marks = text.translate(None, _ONLY_STRUCTURE).replace(b'""', b"")
    del text
    if not marks:
        return 0, control
    step = torch.frombuffer(bytearray(marks.translate(_BRACKET_STEP)), dtype=torch.int8).to(torch.int32)
    if b'"' in marks:  # brackets inside strings: those after an odd number of quotes do not count
        quotes = torch.frombuffer(bytearray(marks.translate(_QUOTE)), dtype=torch.uint8).to(torch.int32)
        step *= 1 - (torch.cumsum(quotes, 0, dtype=torch.int32) & 1)
    return int(torch.cumsum(step, 0, dtype=torch.int32).max()), control


def read_json(path: str | Path, *, max_bytes: int | None = None, max_depth: int | None = None) -> dict | list:
    """Parse one trace file (gzip when it starts with gzip's magic), with errors that name the problem.

    ``max_bytes``: the most JSON text read, after decompression (default ``$TORSH_TRACE_MAX_BYTES``, else
    2 GiB; the environment variable takes a number with an optional unit, e.g. 8GiB); ``max_depth``: the
    deepest JSON nesting accepted (default ``$TORSH_TRACE_MAX_DEPTH``, else 64). Past either, a
    :class:`TraceFormatError` names the file, the limit and how to raise it, having read no more than the
    limit. Strings are returned as the file holds them (``load`` makes them safe to print)."""
    return parse(Path(path), max_bytes, max_depth)[0]


# control characters (C0, DEL, C1), line/paragraph separators and bidirectional-text controls: in a JSON file
# they appear raw (UTF-8) or as \u escapes (C0 also as \b \f \n \r \t); searched for in the text without its
# escaped backslashes and quotes (see _scan), a match means some string needs escaping
_CONTROL_IN_JSON = re.compile(
    rb"\\(?:[bfnrt]|u00[0189][0-9a-fA-F]|u007[fF]|u061[cC]|u200[eEfF]|u202[89a-eA-E]|u206[6-9])|"
    rb"\x7f|\xc2[\x80-\x9f]|\xd8\x9c|\xe2\x80[\x8e\x8f\xa8-\xae]|\xe2\x81[\xa6-\xa9]"
)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def parse(p: Path, max_bytes: int | None, max_depth: int | None) -> tuple[dict | list, bool]:
    """(the parsed file, whether some string in it holds a control character)."""
    max_bytes = resolve_limit(max_bytes, ENV_MAX_BYTES, MAX_BYTES, "max_bytes")
    max_depth = resolve_limit(max_depth, ENV_MAX_DEPTH, MAX_DEPTH, "max_depth")
    raw = _read_text(p, max_bytes)
    if not raw or raw.isspace():  # (strip() would copy the whole file)
        raise TraceFormatError(f"{p}: the file is empty")
    depth, control = _scan(raw)  # before parsing: the scan's copies are gone by the time the parse peaks
    try:
        data = json.loads(raw)
    except RecursionError:  # deeper than the parser itself can go (about 1000 levels)
        raise too_deep(p, max_depth) from None
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{p}: not UTF-8 JSON (byte {e.start}); is it a trace file?") from e
    except json.JSONDecodeError as e:
        cut = " (the file ends early: truncated while being written?)" if _truncated(e.doc, e.pos) else ""
        raise TraceFormatError(f"{p}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}{cut}") from e
    if depth > max_depth:
        raise too_deep(p, max_depth)
    return data, control


def _escape_char(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable(text: str) -> str:
    """``text`` with control characters (C0, DEL, C1: terminal escape sequences start with them), line and
    paragraph separators and bidirectional-text controls written as ``\\xNN`` / ``\\uNNNN``: safe to print
    on a terminal. The viewer and the report print only such strings from traces (rich markup in them is
    printed as text: they go to the console as plain ``Text``)."""
    return _CONTROL.sub(_escape_char, text)


def printable_all(v: object) -> object:
    """A parsed JSON value with every string (keys too) made :func:`printable`."""
    if isinstance(v, str):
        return printable(v)
    if isinstance(v, dict):
        return {printable(k): printable_all(x) for k, x in v.items()}
    if isinstance(v, list):
        return [printable_all(x) for x in v]
    return v


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _truncated(doc: str, pos: int) -> bool:
    """Whether a JSON document that failed to parse at ``pos`` looks cut off: the error is at its end,
    or brackets are still open when it ends (strings ignored)."""
    if pos >= len(doc.rstrip()) - 1:
        return True
    bare = _STRING.sub('""', doc)
    if bare.count('"') % 2:  # an unterminated string runs to the end
        bare = bare[: bare.rfind('"')]
    return bare.count("{") + bare.count("[") > bare.count("}") + bare.count("]")
