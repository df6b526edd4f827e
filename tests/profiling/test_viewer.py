"""`torsh timeline`: the viewer's output at a fixed width, checked for content against a trace whose
numbers are known (trace_fixtures), its filters, its keys, and its errors."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.profiling.trace_fixtures import EXPECTED, write_trace
from torsh_kernels.apps.cli import main as cli
from torsh_kernels.errors import InvalidArgumentError
from torsh_kernels.profiling import analysis as A
from torsh_kernels.profiling.traces import load
from torsh_kernels.profiling.viewer import LABEL, View, apply_key, parse_duration, parse_window

WIDTH = LABEL + 1 + 100  # 100 timeline cells


@pytest.fixture
def trace_dir(tmp_path):
    return write_trace(tmp_path / "tr")


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = cli(["timeline", *map(str, args), "--width", str(WIDTH)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _lane(out: str, label: str) -> str:
    """The 100 cells of the lane labelled ``label``."""
    for line in out.splitlines():
        if line[:LABEL].rstrip() == label:
            return line[LABEL + 1 : LABEL + 101].ljust(100)
    raise AssertionError(f"no lane {label!r} in:\n{out}")


def _row(out: str, first: str) -> list[str]:
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no table row starting {first!r} in:\n{out}")


def test_breakdown_of_the_known_trace(trace_dir):
    tr = load(trace_dir)
    for r in (0, 1):
        b = A.breakdown(tr, r, A.windows(tr, r)).as_dict()
        for k, v in EXPECTED.items():
            assert b[k] == pytest.approx(v, abs=1e-6), (r, k)
        assert b["steps"] == 2 and b["collectives"] == 2 and b["wire_bytes"] == 8192


def test_lanes_at_fixed_width(trace_dir, capsys):
    rc, out, _ = _run(capsys, trace_dir, "--window", "0:200ms")
    assert rc == 0
    assert "window 0.000 - 200.000 ms (200.000 ms)" in out
    main0 = _lane(out, "r0 main")  # 2 ms per cell
    assert set(main0[0:15]) == {"█"}  # forward [0, 30]
    assert set(main0[15:30]) == {"█"}  # backward before the wait
    assert set(main0[30:35]) == {"-"}  # the wait [60, 70] inside backward
    assert set(main0[35:40]) == {"█"}
    assert set(main0[40:45]) == {"▓"}  # compression [80, 90]
    assert main0[45:50] == "     "  # unrecorded [90, 100]
    comm0 = _lane(out, "r0 comm 0")
    assert set(comm0[20:37]) == {"▒"} and comm0[:20].strip() == ""  # all_reduce [40, 75]
    assert set(comm0[92:97]) == {"▒"}  # [185, 195]
    main1 = _lane(out, "r1 main")  # rank 1: 8 ms (4 cells) later
    assert main1[:4] == "    " and set(main1[4:19]) == {"█"} and set(main1[34:39]) == {"-"}
    steps0 = _lane(out, "r0 steps")
    assert steps0.startswith("[0") and steps0[50:52] == "[1"
    # the axis: a tick every 50 ms (25 cells), labelled in ms
    axis = next(line for line in out.splitlines() if re.match(r"^\s+0\s+50\s+100\b", line))[LABEL + 1 :]
    assert axis[0] == "0" and axis[25:27] == "50" and axis[50:53] == "100" and axis[75:78] == "150"
    assert "legend:" in out and "compute" in out and "communication" in out


def test_totals_and_top_table(trace_dir, capsys):
    rc, out, _ = _run(capsys, trace_dir)
    assert rc == 0
    assert "per-rank totals over its steps" in out
    for r in ("0", "1"):
        row = _row(out, r)
        # rank, time, compute, compress, memory, comm exp, unrecorded, in flight, comm share, overlap, colls, wire
        assert row[1:12] == ["200.000", "150.000", "20.000", "0.000", "15.000", "15.000", "45.000", "22.5%", "66.7%",
                             "2", "8 KiB"]  # fmt: skip
    assert _row(out, "backward")[1:7] == ["compute", "4", "200.000", "50.000", "50.000", "0,1"]
    assert _row(out, "all_reduce")[1:7] == ["communication", "4", "90.000", "22.500", "35.000", "0,1"]
    assert _row(out, "wait")[1:4] == ["wait", "2", "20.000"]


def test_step_window(trace_dir, capsys):
    rc, out, _ = _run(capsys, trace_dir, "--step", "1")
    assert rc == 0
    assert "window 100.000 - 208.000 ms (108.000 ms), step 1" in out
    row = _row(out, "0")
    assert row[1:3] == ["100.000", "80.000"]  # step 1 of rank 0: 100 ms, compute 80
    rc, _, err = _run(capsys, trace_dir, "--step", "7")
    assert rc == 2 and "no step 7" in err and "[0, 1]" in err


def test_filters(trace_dir, capsys):
    _, out, _ = _run(capsys, trace_dir, "--rank", "1")
    assert "r1 main" in out and "r0 main" not in out
    _, out, _ = _run(capsys, trace_dir, "--name", "all_reduc[e]", "--window", "0:200ms")  # a glob: the whole name
    assert "r0 comm 0" in out and "r0 main" not in out
    assert _row(out, "all_reduce")[2] == "4" and "backward" not in out
    _, out, _ = _run(capsys, trace_dir, "--cat", "compression", "--window", "0:200ms")
    main0 = _lane(out, "r0 main")
    assert set(main0) == {" ", "▓"} and set(main0[40:45]) == {"▓"}
    _, out, _ = _run(capsys, trace_dir, "--min-dur", "40ms", "--window", "0:200ms")
    main0 = _lane(out, "r0 main")
    assert "-" not in main0 and set(main0[15:40]) == {"█"}  # backward (50 ms) kept, the 10 ms wait dropped
    _, out, _ = _run(capsys, trace_dir, "--name", "all_red", "--window", "0:200ms")  # no glob character: a substring
    assert _row(out, "all_reduce")[2] == "4" and "backward" not in out
    # not a regular expression: '(a|a)*c' backtracked for ever on a long name; as text it matches nothing here
    rc, out, _ = _run(capsys, trace_dir, "--name", "(a|a)*c")
    assert rc == 0 and "backward" not in out
    rc, _, err = _run(capsys, trace_dir, "--width", str(10**7))
    assert rc == 2 and "--width" in err and "4096" in err
    rc, _, err = _run(capsys, trace_dir, "--window", "5ms:2ms")
    assert rc == 2 and "must come after" in err


def test_parse_times():
    assert parse_duration("120ms") == 120 and parse_duration("1.5s") == 1500 and parse_duration("300us") == 0.3
    assert parse_duration("7") == 7
    assert parse_window("120ms:180ms") == (120, 180) and parse_window(":2s") == (None, 2000)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        parse_duration("fast")
    with pytest.raises(InvalidArgumentError, match="START:END"):
        parse_window("120ms")


def test_keys(trace_dir):
    tr = load(trace_dir)
    v = View()
    v = apply_key(tr, v, "+")
    assert (v.start, v.end) == pytest.approx((52, 156))
    v = apply_key(tr, v, "l")
    assert (v.start, v.end) == pytest.approx((78, 182))
    v = apply_key(tr, v, "left")
    assert (v.start, v.end) == pytest.approx((52, 156))
    v = apply_key(tr, v, "-")
    assert (v.start, v.end) == pytest.approx((0, 208))
    v = apply_key(tr, View(), "n")
    assert v.step == 0
    v = apply_key(tr, v, "n")
    assert v.step == 1 and apply_key(tr, v, "p").step == 0
    v = apply_key(tr, View(), "r")
    assert v.ranks == [0]
    v = apply_key(tr, v, "r")
    assert v.ranks == [1]
    assert apply_key(tr, v, "r").ranks is None
    assert apply_key(tr, v, "0").start is None
    assert apply_key(tr, v, "q") is None


def test_interactive_needs_a_terminal(trace_dir):
    p = subprocess.run([sys.executable, "-m", "torsh_kernels.apps.cli", "timeline", str(trace_dir), "--interactive"],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "needs a terminal" in p.stderr


@pytest.mark.slow  # a real terminal session in a pseudo-terminal
def test_interactive_in_a_pty(trace_dir):
    from tests.helpers import Pty

    term = Pty([sys.executable, "-m", "torsh_kernels.apps.cli", "timeline", str(trace_dir), "--interactive",
                "--width", str(WIDTH)], env={"COLUMNS": str(WIDTH)})  # fmt: skip
    term.read_until(b"keys:")
    assert b"window 0.000 - 208.000" in term.out
    term.send(b"+")
    term.read_for(3)
    assert b"window 52.000 - 156.000" in term.out
    term.send(b"q")
    term.read_for(2)
    assert term.wait() == 0
