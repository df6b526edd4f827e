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
from collections.abc import Iterator
from pathlib import Path

from ..checks import short
from ..errors import InvalidArgumentError, TraceFormatError
from ..files import open_regular

__all__ = [
    "ENV_MAX_BYTES",
    "ENV_MAX_DEPTH",
    "MAX_BYTES",
    "MAX_DEPTH",
    "JsonScan",
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
_CHUNK = 4 << 20  # bytes read (decompressed) and scanned at a time
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


def _pieces(p: Path, f, max_bytes: int, gz: bool) -> Iterator[bytes]:
    """The file's JSON bytes, ``_CHUNK`` at a time (decompressed from gzip when ``gz``); a
    :class:`TraceFormatError` as soon as they pass ``max_bytes`` (a small gzip may inflate a thousandfold)."""
    if not gz and os.fstat(f.fileno()).st_size > max_bytes:
        raise _too_big(p, max_bytes, False)
    src = gzip.GzipFile(fileobj=f, mode="rb") if gz else f
    total = 0
    with src:
        while piece := src.read(min(_CHUNK, max_bytes + 1 - total)):
            total += len(piece)
            if total > max_bytes:  # (a plain file that grew since the fstat)
                raise _too_big(p, max_bytes, gz)
            yield piece


_JSON_SPACE = b" \t\n\r"


class _Blank:
    """Whole chunks of JSON whitespace at the start of a file, not kept: how many bytes, newlines, and bytes
    after the last newline (to report an error's line and column in the whole file)."""

    def __init__(self) -> None:
        self.bytes = self.newlines = self.tail = 0

    def drop(self, piece: bytes) -> bool:
        """Count ``piece`` and return True when it is JSON whitespace only."""
        if piece[:1] not in _JSON_SPACE or piece[-1:] not in _JSON_SPACE or piece.translate(None, _JSON_SPACE):
            return False
        self.bytes += len(piece)
        n = piece.count(b"\n")
        self.newlines += n
        self.tail = len(piece) - 1 - piece.rfind(b"\n") if n else self.tail + len(piece)
        return True


def _read_checked(p: Path, max_bytes: int, max_depth: int) -> tuple[bytearray, JsonScan, _Blank]:
    """The JSON bytes of a trace file (plain, or gzip when it starts with gzip's magic), read ``_CHUNK`` at a
    time and scanned as they come: past ``max_bytes`` of text or ``max_depth`` levels of nesting, a
    :class:`TraceFormatError` before the next chunk is read. Beyond the text kept for the parse, memory
    holds a few chunks; leading chunks of whitespace only are counted, not kept."""
    try:
        f = open_regular(p, lambda why: TraceFormatError(f"{p}: {why}; expected a trace file"))
    except OSError as e:
        raise TraceFormatError(f"{p}: cannot be read ({e.strerror or e})") from e
    out, scan, blank = bytearray(), JsonScan(), _Blank()
    with f:
        try:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            for piece in _pieces(p, f, max_bytes, gz):
                if not out and blank.drop(piece):
                    continue
                if scan.feed(piece) > max_depth:
                    raise too_deep(p, max_depth)
                out += piece
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise TraceFormatError(f"{p}: the gzip stream is truncated or corrupt ({e}); re-export the trace") from e
        except OSError as e:
            raise TraceFormatError(f"{p}: cannot be read ({e.strerror or e})") from e
    return out, scan, blank


_ONLY_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')  # translate() deletes these
_BRACKET_STEP = bytes(1 if b in b"[{" else 255 if b in b"]}" else 0 for b in range(256))  # -> int8: +1 open, -1 close
_QUOTE = bytes(1 if b == ord('"') else 0 for b in range(256))


class JsonScan:
    """The nesting depth of a JSON text and whether some string in it may hold a control character, fed a
    chunk at a time (any sizes), at the speed of C: bytes operations and numpy on each chunk, a few integers
    carried from one to the next. ``peak`` is the deepest nesting so far (0 or more), ``depth`` the brackets
    still open, ``in_string`` whether the text so far ends inside a string, ``control`` whether a control
    character (raw or escaped) was seen in it.

    Escaped backslashes and escaped quotes are removed (a run of backslashes keeps its parity, and a quote
    after an odd run goes), as a JSON string is read: every quote left opens or closes a string. A run of
    backslashes at a chunk's end waits for the next chunk, and the last 5 bytes of the text so far are
    searched again with the next chunk's first 5, so an escape, an escaped quote or a UTF-8 control
    sequence split between chunks counts as in the whole text. For the depth, only quotes and brackets are
    kept, adjacent quotes dropped in pairs (which changes no bracket's inside-or-outside), and the brackets
    outside strings summed (+1 open, -1 close) from the depth carried in."""

    def __init__(self) -> None:
        self.peak = self.depth = 0
        self.in_string = self.control = False
        self._run = b""  # an odd run of backslashes at the end of the last chunk: one backslash, else empty
        self._tail = b""  # the last 5 bytes of the text so far, escaped backslashes and quotes removed

    def feed(self, chunk: bytes | bytearray) -> int:
        """Scan the next chunk; returns :attr:`peak`."""
        data = self._run + chunk if self._run else chunk
        self._run = b""
        if data.endswith(b"\\"):
            run = len(data) - len(data.rstrip(b"\\"))
            self._run, data = b"\\" * (run % 2), data[: len(data) - run]
        text = bytes(data).replace(b"\\\\", b"").replace(b'\\"', b"")
        if not self.control:
            self._find_control(text)
        self._count(text)
        return self.peak

    def _find_control(self, text: bytes) -> None:
        if self._tail and _CONTROL_IN_JSON.search(self._tail + text[:5]):  # one split between chunks
            self.control = True
        elif b"\\" in text or b"\x7f" in text or not text.isascii():
            self.control = _CONTROL_IN_JSON.search(text) is not None
        self._tail = (self._tail + text[-5:])[-5:]

    def _count(self, text: bytes) -> None:
        import numpy as np  # (not torch: its ops run on a thread pool, ms per call on a loaded machine)

        marks = text.translate(None, _ONLY_STRUCTURE).replace(b'""', b"")
        quotes = marks.count(b'"')
        if not marks or (self.in_string and not quotes):  # no brackets, or all inside one string
            self.in_string ^= quotes % 2 == 1
            return
        step = np.frombuffer(marks.translate(_BRACKET_STEP), dtype=np.int8)
        if quotes:  # brackets inside strings: those after an odd number of quotes (from the start) do not count
            q = np.frombuffer(marks.translate(_QUOTE), dtype=np.uint8)
            inside = (np.cumsum(q, dtype=np.int32) + self.in_string) & 1
            step = np.where(inside == 1, np.int8(0), step)
            self.in_string ^= quotes % 2 == 1
        depth = np.cumsum(step, dtype=np.int32)
        self.peak = max(self.peak, self.depth + int(depth.max()))
        self.depth += int(depth[-1])


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
# escaped backslashes and quotes (see JsonScan), a match means some string needs escaping
_CONTROL_IN_JSON = re.compile(
    rb"\\(?:[bfnrt]|u00[0189][0-9a-fA-F]|u007[fF]|u061[cC]|u200[eEfF]|u202[89a-eA-E]|u206[6-9])|"
    rb"\x7f|\xc2[\x80-\x9f]|\xd8\x9c|\xe2\x80[\x8e\x8f\xa8-\xae]|\xe2\x81[\xa6-\xa9]"
)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def parse(p: Path, max_bytes: int | None, max_depth: int | None) -> tuple[dict | list, bool]:
    """(the parsed file, whether some string in it holds a control character)."""
    max_bytes = resolve_limit(max_bytes, ENV_MAX_BYTES, MAX_BYTES, "max_bytes")
    max_depth = resolve_limit(max_depth, ENV_MAX_DEPTH, MAX_DEPTH, "max_depth")
    raw, scan, blank = _read_checked(p, max_bytes, max_depth)
    if not raw or raw.isspace():  # (strip() would copy the whole file)
        raise TraceFormatError(f"{p}: the file is empty")
    try:  # decoded here, as json.loads would, so that the bytes are freed before the parse peaks
        text = raw.decode(json.detect_encoding(raw) if not blank.bytes else "utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{p}: not UTF-8 JSON (byte {blank.bytes + e.start}); is it a trace file?") from e
    del raw
    try:
        data = json.loads(text)
    except RecursionError:  # deeper than the parser itself can go (about 1000 levels)
        raise too_deep(p, max_depth) from None
    except json.JSONDecodeError as e:
        line, col = e.lineno + blank.newlines, e.colno + (blank.tail if e.lineno == 1 else 0)
        cut = " (the file ends early: truncated while being written?)" if _truncated(scan, e.doc, e.pos) else ""
        raise TraceFormatError(f"{p}: invalid JSON at line {line}, column {col}: {e.msg}{cut}") from e
    except ValueError as e:  # an integer past Python's digit limit (sys.get_int_max_str_digits(), 4300)
        why = str(e).split(":")[0]
        raise TraceFormatError(f"{p}: a number in it cannot be read ({why}); is it a trace file?") from e
    return data, scan.control


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


def _truncated(scan: JsonScan, doc: str, pos: int) -> bool:
    """Whether a JSON document that failed to parse at ``pos`` looks cut off: brackets or a string are still
    open where it ends, or the error is at its last character (compared a piece at a time: no copy)."""
    if scan.depth > 0 or scan.in_string:
        return True
    return all(not doc[i : i + _CHUNK].strip() for i in range(pos + 1, len(doc), _CHUNK))
