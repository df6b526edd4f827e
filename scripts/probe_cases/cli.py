"""Bad arguments to the ``torsh`` command line, each run as a real process (``python -m torsh_kernels.apps.cli``).

A bad argument must end the command with exit status 2 and exactly one line on stderr (``torsh CMD: error:
...``), no traceback and nothing on stdout; the case returns what the process did and its check says whether
that holds. Files the cases need (a truncated trace, a file that is not JSON, a path under a file) are made
in a fresh temporary directory, the command's working directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from probe_cases import Case, setenv

CASES: list[Case] = []

_FILES = {
    "trunc.json": '{"traceEvents": [',
    "garbage.json": "not json\n",
    "empty_list.json": "[]\n",
    "bad_ts.json": '{"traceEvents": [{"ph": "X", "name": "a", "ts": "x", "dur": 1, "pid": 0, "tid": 0}]}\n',
    "ok.json": '{"traceEvents": [{"ph": "X", "name": "a", "ts": 0, "dur": 5, "pid": 0, "tid": 0}]}\n',
}


def _torsh(*args: str, timeout: float = 120.0) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory(prefix="torsh-probe-cli-") as d:
        for name, text in _FILES.items():
            Path(d, name).write_text(text)
        Path(d, "bad.gz").write_bytes(b"\x1f\x8b\x08garbage")
        env = {**os.environ, "COLUMNS": "120"}
        env.pop("TORSH_TRACE", None)
        p = subprocess.run(
            [sys.executable, "-m", "torsh_kernels.apps.cli", *args],
            cwd=d,
            env=env,
            text=True,
            capture_output=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        return p.returncode, p.stdout, p.stderr


def _one_line_error(res: tuple[int, str, str], code: int = 2) -> bool:
    rc, out, err = res
    lines = err.strip().splitlines()
    return rc == code and len(lines) == 1 and ": error: " in lines[0] and "Traceback" not in err and not out.strip()


def bad(name: str, *args: str, code: int = 2) -> None:
    CASES.append(
        Case(f"cli/{name}", lambda: _torsh(*args), "ok", check=lambda r: _one_line_error(r, code), timeout=150)
    )


def good(name: str, *args: str, check) -> None:
    CASES.append(Case(f"cli/{name}", lambda: _torsh(*args), "ok", check=check, timeout=150))


# torsh itself
bad("torsh/no_command")
bad("torsh/unknown_command", "bogus")
bad("torsh/unknown_option", "--bogus")
bad("providers/unknown_option", "providers", "--bogus")
bad("providers/extra_argument", "providers", "extra")
good("torsh/version", "--version", check=lambda r: r[0] == 0 and r[1].startswith("torsh-kernels "))
good("providers/runs", "providers", check=lambda r: r[0] == 0 and "torch" in r[1] and not r[2].strip())


def bad_env(name: str, env: dict, *args: str) -> None:
    """A bad environment variable: the same one-line error as a bad argument (issue 41, item 8)."""

    def run():
        with setenv(**env):
            return _torsh(*args)

    CASES.append(Case(f"cli/env/{name}", run, "ok", check=_one_line_error, timeout=150))


# bench
_ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1"}  # as under torchrun: the suite reads TORSH_BENCH_THREADS
bad_env("TORSH_BENCH_THREADS=abc", {**_ONE_RANK, "TORSH_BENCH_THREADS": "abc"}, "bench", "collectives")
bad_env("TORSH_BENCH_THREADS=0", {**_ONE_RANK, "TORSH_BENCH_THREADS": "0"}, "bench", "collectives")
bad_env("TORSH_TRACE_MAX_BYTES=10**30", {"TORSH_TRACE_MAX_BYTES": "1" + "0" * 30}, "timeline", "ok.json")
bad("bench/unknown_suite", "bench", "nosuch")
bad("bench/json_suite_name", "bench", "--json", "overhead")
bad("bench/compare_missing_file", "bench", "--compare", "/nonexistent/baseline.json")
bad("bench/compare_not_json", "bench", "--compare", "garbage.json")
bad("bench/compare_truncated", "bench", "--compare", "trunc.json")
bad("bench/max_regression_word", "bench", "--max-regression", "abc", "overhead")
bad("bench/max_regression_nan", "bench", "--max-regression", "nan", "overhead")
bad("bench/max_regression_negative", "bench", "--max-regression", "-5%", "overhead")
bad("bench/args_bad_suite_option", "bench", "--args", 'overhead="--calls 0"', "overhead")
bad("bench/args_malformed", "bench", "--args", "overhead", "overhead")
bad("bench/device_bogus", "bench", "--device", "tpu", "overhead")
bad("bench/overhead_calls_zero", "bench", "overhead", "--calls", "0")
bad("bench/overhead_calls_word", "bench", "overhead", "--calls", "abc")
bad("bench/overhead_calls_negative", "bench", "overhead", "--calls", "-5")
bad("bench/overhead_reps_huge", "bench", "overhead", "--reps", "99999999999999999999")
bad("bench/overhead_reps_float", "bench", "overhead", "--reps", "2.5")
bad("bench/overhead_provider_bogus", "bench", "overhead", "--provider", "bogus")
bad("bench/overhead_ops_unknown", "bench", "overhead", "--ops", "nosuchop")
bad("bench/overhead_threads_negative", "bench", "overhead", "--threads", "-1")
bad("bench/overhead_device_cuda", "bench", "overhead", "--device", "cuda")
bad("bench/overhead_json_under_a_file", "bench", "overhead", "--ops", "flatten", "--json", "garbage.json/x.json")
bad("bench/moe_tokens_zero", "bench", "moe", "--tokens", "0")
bad("bench/collectives_world_size_zero", "bench", "collectives", "--world-size", "0")
bad("bench/trace_calls_below_floor", "bench", "trace", "--calls", "5")

# tune
bad("tune/ops_unknown", "tune", "--ops", "nosuch")
bad("tune/dtypes_unknown", "tune", "--dtypes", "fp8")
bad("tune/sizes_word", "tune", "--sizes", "abc")
bad("tune/sizes_zero", "tune", "--sizes", "0")
bad("tune/sizes_negative", "tune", "--sizes", "-5")
bad("tune/sizes_beyond_memory", "tune", "--sizes", "2^100")
bad("tune/budget_negative", "tune", "--budget", "-1")
bad("tune/budget_nan", "tune", "--budget", "nan")
bad("tune/budget_inf", "tune", "--budget", "inf")
bad("tune/providers_unknown", "tune", "--providers", "bogus")
bad("tune/device_unknown", "tune", "--device", "tpu")
bad("tune/reps_zero", "tune", "--reps", "0")
bad("tune/strategy_unknown", "tune", "--strategy", "bogus")

# timeline
bad("timeline/missing_file", "timeline", "/nonexistent/trace.json")
bad("timeline/truncated_json", "timeline", "trunc.json")
bad("timeline/not_json", "timeline", "garbage.json")
bad("timeline/no_events", "timeline", "empty_list.json")
bad("timeline/corrupt_gzip", "timeline", "bad.gz")
bad("timeline/ts_not_a_number", "timeline", "bad_ts.json")
bad("timeline/window_word", "timeline", "ok.json", "--window", "abc")
bad("timeline/window_reversed", "timeline", "ok.json", "--window", "5ms:1ms")
bad("timeline/rank_word", "timeline", "ok.json", "--rank", "x")
bad("timeline/width_too_small", "timeline", "ok.json", "--width", "-3")
bad("timeline/top_negative", "timeline", "ok.json", "--top", "-1")
bad("timeline/min_dur_word", "timeline", "ok.json", "--min-dur", "banana")
good(
    "timeline/name_is_not_a_regex",
    "timeline",
    "ok.json",
    "--name",
    "(a|a)*c" + "a" * 40,
    check=lambda r: r[0] == 0 and "Traceback" not in r[2],
)  # (as a regex it backtracked for ever)
bad("timeline/width_too_large", "timeline", "ok.json", "--width", str(10**7))
bad("timeline/cat_unknown", "timeline", "ok.json", "--cat", "nosuchclass")
bad("timeline/step_negative", "timeline", "ok.json", "--step", "-1")
good("timeline/ok_trace", "timeline", "ok.json", "--width", "80", check=lambda r: r[0] == 0 and "Traceback" not in r[2])

# report
bad("report/missing_dir", "report", "/nonexistent")
bad("report/truncated_json", "report", "trunc.json")
bad("report/not_json", "report", "garbage.json")
bad("report/step_negative", "report", "ok.json", "--step", "-1")
bad("report/window_reversed", "report", "ok.json", "--window", "5ms:1ms")
bad("report/json_under_a_file", "report", "ok.json", "--json", "garbage.json/x.json")

# demo (refused before any rank starts)
bad("demo/ranks_zero", "demo", "--ranks", "0")
bad("demo/ranks_word", "demo", "--ranks", "abc")
bad("demo/steps_zero", "demo", "--steps", "0")
bad("demo/steps_negative", "demo", "--steps", "-1")
bad("demo/hidden_zero", "demo", "--hidden", "0")
bad("demo/batch_negative", "demo", "--batch", "-1")
bad("demo/compressors_unknown", "demo", "--compressors", "bogus")
bad("demo/compressors_empty", "demo", "--compressors", ",")
bad("demo/delay_without_link", "demo", "--delay", "1ms")
bad("demo/threads_negative", "demo", "--threads", "-2")
bad("demo/trace_steps_word", "demo", "--trace-steps", "abc")
bad("demo/trace_with_fsdp", "demo", "--fsdp", "--trace", "tr")

# doctor
bad("doctor/json_under_a_file", "doctor", "--json", "garbage.json/x.json")
bad("doctor/unknown_option", "doctor", "--bogus")
