"""The trace reader's nesting and control-character scan, a chunk at a time: the same answer as a scan of
the whole text, whatever the chunk sizes; a file nested too deep refused at the first chunk that passes the
limit, without decompressing the rest; memory bounded by a few chunks beyond the text kept for the parse
(issue 41, item 4)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torsh_kernels.errors import TraceFormatError
from torsh_kernels.profiling.trace_files import JsonScan, read_json
from torsh_kernels.profiling.traces import load

# -- the reference: the whole-text scan the reader used before (trace_files._scan at 5b7166f) ------------

_CONTROL_IN_JSON = re.compile(
    rb"\\(?:[bfnrt]|u00[0189][0-9a-fA-F]|u007[fF]|u061[cC]|u200[eEfF]|u202[89a-eA-E]|u206[6-9])|"
    rb"\x7f|\xc2[\x80-\x9f]|\xd8\x9c|\xe2\x80[\x8e\x8f\xa8-\xae]|\xe2\x81[\xa6-\xa9]"
)
_ONLY_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_BRACKET_STEP = bytes(1 if b in b"[{" else 255 if b in b"]}" else 0 for b in range(256))
_QUOTE = bytes(1 if b == ord('"') else 0 for b in range(256))


def whole_text_scan(raw: bytes) -> tuple[int, bool]:
    """The old scan, verbatim but for its name; its depth is below 0 when a closing bracket comes first (the
    new one says 0: no depth check tells them apart)."""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    control = (b"\\" in text or b"\x7f" in text or not text.isascii()) and _CONTROL_IN_JSON.search(text) is not None
    marks = text.translate(None, _ONLY_STRUCTURE).replace(b'""', b"")
    del text
    if not marks:
        return 0, control
    step = torch.frombuffer(bytearray(marks.translate(_BRACKET_STEP)), dtype=torch.int8).to(torch.int32)
    if b'"' in marks:
        quotes = torch.frombuffer(bytearray(marks.translate(_QUOTE)), dtype=torch.uint8).to(torch.int32)
        step *= 1 - (torch.cumsum(quotes, 0, dtype=torch.int32) & 1)
    return int(torch.cumsum(step, 0, dtype=torch.int32).max()), control


def chunked_scan(raw: bytes, sizes: list[int]) -> JsonScan:
    """``raw`` fed to a JsonScan in chunks of the given sizes, cycled."""
    scan, i, n = JsonScan(), 0, 0
    while i < len(raw):
        size = sizes[n % len(sizes)]
        scan.feed(raw[i : i + size])
        i, n = i + size, n + 1
    return scan


# -- the same answer as the whole-text scan ----------------------------------------------------------------

# the bytes that matter (brackets, quotes, backslashes, escape letters, hex digits, UTF-8 pieces of C1 and
# bidi controls, DEL) and a few whole escapes and sequences, so that examples are JSON-ish
_TOKENS = [bytes([b]) for b in b'[]{}"\\ ,:a0189bfnrtuceEfF7\x7f\xc2\x80\x9b\xd8\x9c\xe2\x81\xa6\xae']
_TOKENS += [b"\\\\", b'\\"', b"\\u001b", b"\\u202e", b"\\u0041", b"\xc2\x9b", b"\xe2\x80\xae", b"\xd8\x9c", b'"a"']
JSONISH = st.lists(st.sampled_from(_TOKENS), max_size=80).map(b"".join)
SIZES = st.lists(st.sampled_from([1, 2, 3, 4, 5, 6, 7, 11, 64]), min_size=1, max_size=6)


@settings(max_examples=1000, deadline=None)
@given(raw=JSONISH, sizes=SIZES)
def test_chunked_scan_equals_the_whole_text_scan(raw, sizes):
    depth, control = whole_text_scan(raw)
    scan = chunked_scan(raw, sizes)
    assert (scan.peak, scan.control) == (max(depth, 0), control)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200), sizes=SIZES)
def test_chunked_scan_equals_the_whole_text_scan_on_any_bytes(raw, sizes):
    depth, control = whole_text_scan(raw)
    scan = chunked_scan(raw, sizes)
    assert (scan.peak, scan.control) == (max(depth, 0), control)


@pytest.mark.parametrize(
    ("raw", "depth", "control"),
    [
        (b'["a\\\\"]', 1, False),  # an escaped backslash, then the closing quote
        (b'["a\\"[", [[1]]]', 3, False),  # an escaped quote: the bracket after it is inside the string
        (b'["a\\\\\\"[", [[1]]]', 3, False),  # an escaped backslash and an escaped quote
        (b'[["\\\\\\\\"], [[]]]', 3, False),  # two escaped backslashes: the quote after them closes
        (b'["\\u001b"]', 1, True),  # ESC as an escape
        (b'["\\\\u001b"]', 1, False),  # an escaped backslash and the text u001b
        (b'["\\\\\\u001b"]', 1, True),  # an escaped backslash, then ESC
        (b'["\xe2\x80\xae"]', 1, True),  # a raw bidi override (3 UTF-8 bytes)
        (b'["\xc2\x9b[[["]', 1, True),  # a raw C1 CSI, brackets inside the string
        (b'{"a": "\xe2\x80\x94"}', 1, False),  # an em dash: not a control
        (b"[" * 70 + b"]" * 70, 70, False),
    ],
)  # fmt: skip
def test_every_split_point(raw, depth, control):
    """Each text split in two at every position, and in chunks of 1, 2 and 3 bytes: the same answer."""
    for cut in range(len(raw) + 1):
        scan = JsonScan()
        scan.feed(raw[:cut])
        scan.feed(raw[cut:])
        assert (scan.peak, scan.control, scan.depth, scan.in_string) == (depth, control, 0, False), cut
    for size in (1, 2, 3):
        scan = chunked_scan(raw, [size])
        assert (scan.peak, scan.control) == (depth, control), size


def test_the_state_at_the_end_says_what_is_still_open():
    scan = chunked_scan(b'{"a": [1, "x\\"]', [2])
    assert (scan.depth, scan.in_string, scan.peak) == (2, True, 2)
    scan.feed(b'"]}')
    assert (scan.depth, scan.in_string) == (0, False)


# -- too deep: refused at the first chunk that passes the limit ---------------------------------------------


def _members(piece: bytes, count: int) -> bytes:
    """A gzip file of ``count`` members, each ``piece`` compressed: ``count * len(piece)`` bytes of JSON text
    from a file of a few KB per 16 MiB (made in a moment)."""
    return gzip.compress(piece, 9) * count


def test_a_gzip_bomb_of_brackets_stops_at_the_first_chunk(tmp_path, monkeypatch):
    """64 MiB of ``[`` in a 64 KiB gzip: the depth error comes after one chunk (4 MiB) is decompressed,
    not after the whole file (before: all of it, then several copies of it)."""
    f = tmp_path / "deep.json.gz"
    f.write_bytes(_members(b"[" * (16 << 20), 4))
    out = []
    read = gzip.GzipFile.read

    def counted(self, n=-1):
        data = read(self, n)
        out.append(len(data))
        return data

    monkeypatch.setattr(gzip.GzipFile, "read", counted)
    with pytest.raises(TraceFormatError, match=f"{f}: JSON nested deeper than 64 levels"):
        load(f)
    assert sum(out) <= 4 << 20, out


def test_a_plain_file_of_brackets_is_not_read_whole(tmp_path):
    """64 MiB of ``[`` in a plain file: refused having read one chunk; Python's allocations (numpy's too) peak
    at about 40 MiB, the chunk and its scan's arrays (before: the whole file, and a 2 GiB read buffer)."""
    f = tmp_path / "deep.json"
    f.write_bytes(b"[" * (64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(TraceFormatError, match="nested deeper than 64 levels"):
            read_json(f)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB"


_CHILD = textwrap.dedent(
    """
    import json, re, sys, torch
    from torsh_kernels.errors import TraceFormatError
    from torsh_kernels.profiling.traces import load
    torch.cumsum(torch.ones(1 << 20, dtype=torch.int32), 0)  # torch's pools, before the measure
    # VmHWM: the peak RSS of this process image (ru_maxrss would count the parent's, from the fork), reset
    kib = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    try:
        load(sys.argv[1])
        error = None
    except TraceFormatError as e:
        error = str(e)
    print(json.dumps({"error": error, "above": kib("VmHWM") - before}))
    """
)


def _peak_above(path) -> dict:
    """Loads ``path`` in a new process: its error, and its peak RSS above what it held before the load."""
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a new process: torch's import
@pytest.mark.parametrize(
    ("piece", "message"), [(b"[", "nested deeper than 64 levels"), (b" ", "the file is empty")], ids=["[", "spaces"]
)
def test_gzip_bombs_end_typed_in_bounded_memory(tmp_path, piece, message):
    """256 MiB of ``[`` (a 255 KB gzip: 2.8 GB of RSS before) or of spaces, in a new process: the typed
    error, with the peak RSS less than 128 MiB above what the process held before the load."""
    f = tmp_path / "bomb.json.gz"
    f.write_bytes(_members(piece * (16 << 20), 16))
    got = _peak_above(f)
    assert got["error"] is not None and message in got["error"], got
    assert got["above"] < 128 << 20, f"{got['above'] / 2**20:.0f} MiB above"


# -- what the parse still reports --------------------------------------------------------------------------


def _json_error(text: bytes) -> str:
    """What json says of the whole text: line and column, or the byte that is not UTF-8."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return f"invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
    except UnicodeDecodeError as e:
        return f"not UTF-8 JSON (byte {e.start})"
    raise AssertionError("valid JSON")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (b"\n" * (5 << 20) + b"  \t x", f"invalid JSON at line {(5 << 20) + 1}, column 5: Expecting value"),
        (b" " * (5 << 20) + b'  {"a":  x}', f"invalid JSON at line 1, column {(5 << 20) + 10}: Expecting value"),
        (b" \r\n" * (2 << 20) + b'\n  {"a":  x}', f"invalid JSON at line {(2 << 20) + 2}, column 10: Expecting value"),
        (b" " * (5 << 20) + b'"\xc3\x28"', f"not UTF-8 JSON (byte {(5 << 20) + 1})"),
    ],
    ids=["newlines", "spaces", "crlf", "not-utf8"],
)  # fmt: skip
def test_leading_blank_chunks_keep_error_positions(tmp_path, text, expected):
    """Leading chunks of whitespace are not kept: the error's line, column or byte are still those of the
    whole file, as json reports them on the whole text."""
    assert _json_error(text) == expected
    f = tmp_path / "t.json"
    f.write_bytes(text)
    with pytest.raises(TraceFormatError, match=re.escape(expected)):
        read_json(f)


def test_leading_blank_chunks_before_a_valid_trace_or_nothing(tmp_path):
    f = tmp_path / "t.json"
    f.write_bytes(b"\r\n" * (3 << 20) + json.dumps({"traceEvents": []}).encode())
    assert read_json(f) == {"traceEvents": []}
    f.write_bytes(b" \n" * (3 << 20))
    with pytest.raises(TraceFormatError, match="the file is empty"):
        read_json(f)


@pytest.mark.parametrize(
    ("content", "cut"),
    [
        (b'{"traceEvents": [{"name": "abc', True),  # inside a string
        (b'{"traceEvents": [{"name": "a[b{"}, 1', True),  # brackets still open (those in strings ignored)
        (b'{"traceEvents": [1]}  x', True),  # the error at the last character
        (b'{"traceEvents": [1]], 5 ' + b" " * (5 << 20) + b"\n", False),  # in the middle, blank after
        (b'{"traceEvents": [x, "["]}', False),
    ],
)  # fmt: skip
def test_truncated_or_not(tmp_path, content, cut):
    f = tmp_path / "t.json"
    f.write_bytes(content)
    with pytest.raises(TraceFormatError, match="invalid JSON") as e:
        read_json(f)
    assert ("the file ends early" in str(e.value)) == cut


def test_a_valid_trace_parses_with_less_python_memory_than_before(tmp_path):
    """The parse of a valid file peaks lower than json.loads of its bytes while they are held, as the reader
    did before (tracemalloc: Python's allocations): the bytes are freed once decoded, so by about the size
    of the file; and within 1% of json.loads of bytes that nothing else holds."""
    ev = {"ph": "X", "name": "aten::add", "cat": "cpu_op", "ts": 1.5, "dur": 2.0, "pid": 1, "tid": 1}
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": [{**ev, "ts": float(i), "args": {"n": i}} for i in range(20_000)]}))
    size = f.stat().st_size

    def held():
        raw = f.read_bytes()
        return json.loads(raw)

    peaks = []
    for fn in (held, lambda: json.loads(f.read_bytes()), lambda: read_json(f)):
        tracemalloc.start()
        try:
            data = fn()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert len(data["traceEvents"]) == 20_000 and data["traceEvents"][7]["args"] == {"n": 7}
    assert peaks[2] <= peaks[0] - size // 2, (peaks, size)
    assert peaks[2] <= peaks[1] * 1.01, (peaks, size)
