"""`torsh timeline`'s display (issue 42 item 5): lanes named by what ran on them, step labels that never
overlap, time in us/ms/s/min by magnitude, and the interactive frame cut to the terminal's height."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.profiling.trace_fixtures import BASE_US, write_trace
from torsh_kernels.apps.cli import main as cli
from torsh_kernels.profiling.traces import load
from torsh_kernels.profiling.viewer import LABEL, View, fmt_time, frame, make_console, parse_duration, time_unit


def _x(name, cat, a_ms, b_ms, tid, **args):
    ev = {"ph": "X", "name": name, "cat": cat, "ts": BASE_US + a_ms * 1e3, "dur": (b_ms - a_ms) * 1e3, "pid": 0,
          "tid": tid}  # fmt: skip
    if args:
        ev["args"] = args
    return ev


def _write(path, events, threads):
    meta = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "rank 0"}}]
    meta += [{"ph": "M", "name": "thread_name", "pid": 0, "tid": t, "args": {"name": n}} for t, n in threads.items()]
    other = {"schema": "torsh-trace/1", "rank": 0, "world_size": 1, "device": "test", "versions": {},
             "clock": {"base_unix_us": 1_700_000_000_000_000}}  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "rank0.json").write_text(json.dumps({"traceEvents": meta + events, "otherData": other}))
    return path


def _timeline(capsys, *args, width=LABEL + 1 + 100):
    rc = cli(["timeline", *map(str, args), "--width", str(width)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out


def _labels(out):
    return [line[:LABEL].rstrip() for line in out.splitlines() if line.startswith("r0 ")]


def test_anonymous_threads_are_named_by_what_ran_on_them(tmp_path, capsys):
    threads = {1: "main", 2: "thread Dummy-1", 3: "thread Dummy-2", 4: "thread Thread-3 (worker)",
               5: "thread loader", 6: "thread Thread-4", 7: "thread 4711 (pt_gloo_1)"}  # fmt: skip
    ev = [
        _x("forward", "user", 0, 10, 1),
        _x("backward", "module", 10, 30, 2, module="Net"),  # the autograd engine's thread
        _x("issue all_reduce", "issue", 12, 14, 2),
        _x("issue all_reduce", "issue", 15, 17, 3),  # a DDP comm hook run from a gloo callback thread
        _x("offload grads to host", "offload", 20, 25, 4),
        _x("in thread", "user", 5, 8, 5),  # a named thread keeps its name
        _x("prefetch", "user", 1, 2, 6),
        _x("gloo:all_reduce", "op", 13, 16, 7),  # Kineto's id with the OS's name: the name stays, the id dims
    ]
    out = _timeline(capsys, _write(tmp_path / "t", ev, threads))
    assert sorted(_labels(out)) == sorted(["r0 main", "r0 autograd (Dummy-1)", "r0 comm hook (Dummy-2)",
                            "r0 offload copy (Threa…)", "r0 thread loader", "r0 prefetch (Thread-4)",
                            "r0 pt_gloo_1 (4711)"])  # fmt: skip
    assert "thread Dummy" not in out


def test_step_labels_never_overlap_at_a_narrow_width(tmp_path, capsys):
    # 12 steps of 1 ms in 40 cells: 3.3 cells a step, too few for "[10" after "[9"
    ev = [_x(f"step {k}", "step", k, k + 1, 1, step=k) for k in range(12)] + [_x("work", "user", 0, 12, 1)]
    out = _timeline(capsys, _write(tmp_path / "s", ev, {1: "main"}), width=LABEL + 1 + 40)
    row = next(line for line in out.splitlines() if line.startswith("r0 steps"))[LABEL + 1 :]
    assert len(row) == 40  # no cell inserted or lost
    labels = re.findall(r"\[(\d*)", row)
    numbers = [int(n) for n in labels if n]
    assert numbers == sorted(numbers) and numbers[0] == 0 and len(numbers) >= 5  # whole numbers, in order
    # every label is whole and separated from the next by at least one cell: no "[1[2", no "[1" cut from "[10"
    for m in re.finditer(r"\[\d+", row):
        assert row[m.end() : m.end() + 1] in ("", "─", " ")
    # each number shown sits where its step starts (cell k * 40 / 12)
    for m in re.finditer(r"\[(\d+)", row):
        assert m.start() == int(int(m.group(1)) * 40 / 12)


def test_long_spans_read_in_seconds_and_minutes(tmp_path, capsys):
    minutes = 1000 * 60 * 25  # a 25-minute run
    ev = [_x("train", "user", 0, minutes, 1)]
    out = _timeline(capsys, _write(tmp_path / "m", ev, {1: "main"}))
    assert "25.000 min recorded" in out and "window 0.000 - 25.000 min (25.000 min)" in out
    axis = next(line for line in out.splitlines() if re.match(r"^\s+0\s+5\s+10\b", line))[LABEL + 1 :]
    assert axis.split() == ["0", "5", "10", "15", "20"]  # (25 would run past the edge)
    assert any(line[:LABEL].strip() == "min" for line in out.splitlines())  # the axis says its unit
    out = _timeline(capsys, _write(tmp_path / "m", ev, {1: "main"}), "--window", "90s:100s")
    assert "window 90.000 - 100.000 s (10.000 s)" in out
    assert any(line[:LABEL].strip() == "s" for line in out.splitlines())
    out = _timeline(capsys, _write(tmp_path / "m", ev, {1: "main"}), "--window", "1ms:1.2ms")
    assert "window 1.0000 - 1.2000 ms (200.000 us)" in out
    assert any(line[:LABEL].strip() == "us" for line in out.splitlines())


def test_time_units():
    assert [time_unit(x)[0] for x in (0.2, 5, 999, 1000, 599_000, 600_000)] == ["us", "ms", "ms", "s", "s", "min"]
    assert fmt_time(0.25) == "250.000 us" and fmt_time(1500) == "1.500 s" and fmt_time(90 * 60e3) == "90.000 min"
    assert parse_duration("2min") == 120_000


def test_the_interactive_frame_fits_the_terminal(tmp_path):
    threads = {t: f"thread Dummy-{t}" for t in range(1, 30)}
    ev = [_x("op", "op", t, t + 1, t) for t in threads]
    tr = load(_write(tmp_path / "tall", ev, threads))
    con = make_console(120)
    lines = frame(tr, View(), con, "tall", height=15)
    assert len(lines) == 15
    assert "more lines" in lines[-2] and lines[-1].startswith("keys:")
    whole = frame(tr, View(), con, "tall", height=200)  # room for all: nothing cut
    assert len(whole) < 200 and not any("more lines" in line for line in whole) and whole[-1].startswith("keys:")


@pytest.mark.slow  # a real terminal session
def test_interactive_uses_the_alternate_screen(tmp_path):
    from tests.helpers import Pty

    d = write_trace(tmp_path / "tr")
    term = Pty([sys.executable, "-m", "torsh_kernels.apps.cli", "timeline", str(d), "--interactive"],
               env={"COLUMNS": "100", "LINES": "12"})  # fmt: skip
    term.read_until(b"keys:")
    term.send(b"q")
    term.read_for(2)
    assert term.wait() == 0
    assert b"\x1b[?1049h" in term.out and b"\x1b[?1049l" in term.out  # entered and left
    first = term.out.split(b"\x1b[2J", 1)[1].split(b"keys:", 1)[0]
    assert first.count(b"\n") == 11  # 11 lines, then the keys line: 12, the terminal's height


def test_dense_steps_still_show_numbers(tmp_path, capsys):
    # 100 steps in 40 cells: more steps than cells; numbers every few cells, each whole, a gap after each
    ev = [_x(f"step {k}", "step", k, k + 1, 1, step=k) for k in range(100)]
    out = _timeline(capsys, _write(tmp_path / "d", ev, {1: "main"}), width=LABEL + 1 + 40)
    row = next(line for line in out.splitlines() if line.startswith("r0 steps"))[LABEL + 1 :]
    assert len(row) == 40
    numbers = [int(n) for n in re.findall(r"\[(\d+)", row)]
    assert len(numbers) >= 5 and numbers == sorted(numbers) and numbers[0] == 0
    for m in re.finditer(r"\[(\d+)", row):
        assert m.start() == int(int(m.group(1)) * 40 / 100) and row[m.end() : m.end() + 1] in ("", " ")
