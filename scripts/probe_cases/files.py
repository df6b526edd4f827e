"""Files and the environment: the tuning cache (what it holds, where it is, writers at once, planted
symlinks), trace files (size and nesting limits, files that are not files, malformed gzip and JSON, terminal
escapes in names), TORSH_TRACE and the other environment variables, and checkpoints of the offloaded
optimizer (state dicts that do not fit, steps that fail half way).

Every case sets up its own temporary directory and environment and puts both back, so the cases share
one worker process safely."""

from __future__ import annotations

import contextlib
import functools
import gzip
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from probe_cases import Case, setenv

# -- helpers ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _tmp():
    with tempfile.TemporaryDirectory(prefix="torsh-probe-files-") as d:
        yield Path(d)


# -- the tuning cache -----------------------------------------------------------------------------------


def _flatten_is_right() -> bool:
    import torsh_kernels as tk

    xs = [torch.randn(1500), torch.randn(1499)]
    return all(torch.equal(tk.flatten(xs)[0], torch.cat(xs)) for _ in range(3))


def _env_key() -> str:
    from torsh_kernels.ops import tuning

    return tuning.environment_key(torch.device("cpu"))[0]


def _cache_case(content) -> bool:
    """The cache holds ``content`` (bytes, str, a callable making the file, or a JSON value): every op call
    still runs right (a bad cache is skipped with a warning, never raised from an op)."""
    from torsh_kernels.ops import registry, tuning

    with _tmp() as d, setenv(TORSH_KERNELS_CACHE_DIR=d / "cache", TORSH_KERNELS_PROVIDER=None):
        path = tuning.cache_path()
        path.parent.mkdir(parents=True)
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        registry.reload()
        try:
            return (
                _flatten_is_right()
                and tuning.lookup_provider("flatten", torch.device("cpu"), torch.float32, 3000) is None
            )
        finally:
            registry.reload()


def _entry_case(entry) -> bool:
    """The cache of this machine's environment holds ``entry`` for flatten at 3000 elements."""
    return _cache_case(
        {"format": 1, "environments": {_env_key(): {"env": {}, "entries": {"flatten | float32 | 2^12": entry}}}}
    )


def _cache_dir_is_a_file() -> bool:
    """TORSH_KERNELS_CACHE_DIR names a regular file: ops still run (nothing to read)."""
    from torsh_kernels.ops import registry

    with _tmp() as d, setenv(TORSH_KERNELS_CACHE_DIR=_a_file(d), TORSH_KERNELS_PROVIDER=None):
        registry.reload()
        try:
            return _flatten_is_right()
        finally:
            registry.reload()


BAD_ENTRIES = {
    "entry_a_number": 5,
    "entry_without_provider": {"meta": {}, "median_ms": 1.0},
    "provider_that_does_not_exist": {"provider": "cuda"},
    "provider_a_list": {"provider": ["triton"]},
    "absurd_block": {"provider": "triton", "meta": {"BLOCK": 2**40}},
    "block_not_a_power_of_two": {"provider": "triton", "meta": {"BLOCK": 3}},
    "absurd_num_warps": {"provider": "triton", "meta": {"num_warps": 1000}},
    "negative_num_warps": {"provider": "triton", "meta": {"num_warps": -4}},
    "unknown_meta_name": {"provider": "triton", "meta": {"TILE": 64}},
    "meta_a_list": {"provider": "triton", "meta": [1024]},
    "meta_value_a_string": {"provider": "triton", "meta": {"BLOCK": "1024"}},
    "meta_value_a_float": {"provider": "triton", "meta": {"BLOCK": 1024.0}},
    "median_a_string": {"provider": "torch", "median_ms": "fast"},
    "median_infinite": {"provider": "torch", "median_ms": float("inf")},
    "synced_rank_a_string": {"provider": "torch", "synced_from_rank": "0"},
}
BAD_FILES = {
    "empty_list": "[]",
    "null": "null",
    "a_number": "5",
    "empty_file": "",
    "not_json": "{not json",
    "not_utf8": b"\xff\xfe\x00",
    "no_environments": {"format": 1},
    "environments_a_list": {"format": 1, "environments": []},
    "environment_a_list": {"format": 1, "environments": {"k": []}},
    "entries_null": {"format": 1, "environments": {"k": {"entries": None}}},
    "another_format": {"format": 99, "environments": {}},
    "nested_100000_deep": "[" * 100_000,
    "a_fifo": lambda p: os.mkfifo(p),
    "a_directory": lambda p: p.mkdir(),
    "a_symlink_loop": lambda p: os.symlink(p, p),
    "a_sparse_1tb_file": lambda p: _sparse(1 << 40)(p),
}


def _writers_lose_nothing() -> int:
    """4 processes x 40 entries through update_cache at once: how many are in the file. (Forked by hand: the
    probe's worker is a daemonic multiprocessing process, which may not start children of its own.)"""
    import time

    from torsh_kernels.ops import tuning

    with _tmp() as d:
        path, go = d / "tuning.json", d / "go"
        pids = []
        for n in range(4):
            pid = os.fork()
            if pid == 0:  # a writer
                code = 1
                try:
                    while not go.exists():
                        time.sleep(0.001)
                    for i in range(40):
                        tuning.update_cache(
                            lambda data, i=i, n=n: (
                                data["environments"]
                                .setdefault(f"w{n}", {"env": {}, "entries": {}})["entries"]
                                .__setitem__(f"flatten | float32 | 2^{i}", {"provider": "torch"})
                            ),
                            path,
                        )
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        go.touch()
        if any(os.waitpid(pid, 0)[1] != 0 for pid in pids):
            return -1
        return sum(len(e["entries"]) for e in tuning.load_cache(path)["environments"].values())


def _cache_write_through_symlinks() -> bool:
    """Symlinks at the cache's name and at the old temporary name: the files they point at are untouched."""
    from torsh_kernels.ops import tuning

    with _tmp() as d:
        victim = d / "victim"
        victim.write_text("precious")
        path = d / "c" / "tuning.json"
        path.parent.mkdir()
        os.symlink(victim, path)
        os.symlink(victim, path.with_suffix(f".tmp{os.getpid()}"))
        tuning.update_cache(lambda data: data["environments"].setdefault("e", {"env": {}, "entries": {}}), path)
        return victim.read_text() == "precious" and not path.is_symlink()


def _cache_write(setup) -> None:
    from torsh_kernels.ops import tuning

    with _tmp() as d:
        path = setup(d)
        tuning.update_cache(lambda data: None, path)


def _lock_is_a_symlink(d: Path) -> Path:
    (d / "victim").write_text("x")
    os.symlink(d / "victim", d / "tuning.json.lock")
    return d / "tuning.json"


def _dir_is_a_file(d: Path) -> Path:
    (d / "f").write_text("x")
    return d / "f" / "tuning.json"


def _lock_is_a_fifo(d: Path) -> Path:
    os.mkfifo(d / "tuning.json.lock")
    return d / "tuning.json"


# -- trace files ------------------------------------------------------------------------------------------


def _good_trace() -> dict:
    return {"traceEvents": [{"ph": "X", "name": "a", "cat": "cpu_op", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}]}


def _load_file(make, env: dict | None = None, **kw):
    from torsh_kernels.profiling.traces import load

    with _tmp() as d, setenv(**(env or {})):
        f = d / "rank0.json"
        target = make(f)
        return load(target or f, **kw)


def _write(content):
    def make(f: Path):
        f.write_bytes(content if isinstance(content, bytes) else content.encode())

    return make


def _bomb(f: Path) -> None:
    f.write_bytes(gzip.compress(b"[" + b" " * (64 << 20) + b"]", 9))


def _sparse(size: int):
    def make(f: Path):
        with f.open("wb") as fh:
            fh.truncate(size)

    return make


def _fifo(f: Path) -> None:
    os.mkfifo(f)


def _truncated_gzip(f: Path) -> None:
    z = gzip.compress(json.dumps(_good_trace()).encode() * 50)
    f.write_bytes(z[: len(z) // 2])


def _corrupt_gzip(f: Path) -> None:
    z = bytearray(gzip.compress(json.dumps(_good_trace()).encode() * 50))
    z[20:40] = b"\xff" * 20
    f.write_bytes(bytes(z))


def _gzip_trailing_garbage(f: Path) -> None:
    f.write_bytes(gzip.compress(json.dumps(_good_trace()).encode()) + b"garbage!")


def _event(**kw) -> bytes:
    return json.dumps({"traceEvents": [{**_good_trace()["traceEvents"][0], **kw}]}).encode()


ESCAPES = "[bold red]x[/bold red]\x1b[2J\x1b]0;owned\x07\u009b31m\n\u202e"  # markup first: tables cut names


def _no_control(text: str) -> bool:
    return not any((ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F or c == "\u202e" for c in text)


def _escapes_in_names() -> bool:
    """Names, categories, lane names and args with escape sequences: the loaded trace holds them escaped,
    and `torsh timeline` / `torsh report` print no control character."""
    from torsh_kernels.apps.cli import main

    ev = [
        {"ph": "M", "name": "thread_name", "pid": ESCAPES, "tid": 1, "args": {"name": ESCAPES}},
        {
            "ph": "X",
            "name": ESCAPES,
            "cat": ESCAPES,
            "ts": 1.0,
            "dur": 2.0,
            "pid": ESCAPES,
            "tid": 1,
            "args": {ESCAPES: ESCAPES},
        },
        {"ph": "X", "name": "ProfilerStep#1", "cat": "cpu_op", "ts": 0.0, "dur": 5.0, "pid": ESCAPES, "tid": 1},
    ]
    with _tmp() as d:
        f = d / "rank0.json"
        f.write_text(json.dumps({"traceEvents": ev, "distributedInfo": {"backend": ESCAPES}}))
        from torsh_kernels.profiling.traces import load

        tr = load(f)
        strings = [s.name for s in tr.spans] + [s.cat for s in tr.spans] + [ln.name for ln in tr.lanes]
        strings += [k for s in tr.spans for k in s.args] + [str(m) for m in tr.ranks.values()]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["timeline", str(f), "--width", "160"]) + main(["report", str(f), "--width", "160"])
        return (
            rc == 0
            and all(_no_control(s) for s in strings)
            and _no_control(out.getvalue())
            and ("[bold red]x[/bold red]" in out.getvalue())
        )


# a new process loads a gzip bomb with its address space capped at what it holds plus 256 MiB
# (RLIMIT_AS): the typed error must come within it; it prints the error and its peak RSS above the start
_BOUNDED_LOAD = """
import json, re, resource, sys
import numpy as np
from torsh_kernels.errors import TraceFormatError
from torsh_kernels.profiling.traces import load
np.cumsum(np.ones(1 << 20, dtype=np.int8), dtype=np.int32)
kib = lambda key: int(re.search(key + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) << 10
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = kib("VmRSS")
resource.setrlimit(resource.RLIMIT_AS, (kib("VmSize") + (256 << 20),) * 2)
try:
    load(sys.argv[1])
    error = None
except TraceFormatError as e:
    error = str(e)
print(json.dumps({"error": error, "above": kib("VmHWM") - before}))
"""


def _bomb_in_bounded_memory(piece: bytes, mib: int, message: str) -> bool:
    """``mib`` MiB of ``piece`` as gzip members of 16 MiB (a 255 KB file per 256 MiB of ``[``)."""
    with _tmp() as d:
        f = d / "rank0.json.gz"
        f.write_bytes(gzip.compress(piece * (16 << 20), 9) * (mib // 16))
        p = subprocess.run([sys.executable, "-c", _BOUNDED_LOAD, str(f)], capture_output=True, text=True, timeout=240)
    if p.returncode != 0:
        raise RuntimeError(f"the child failed: {(p.stderr.strip().splitlines() or [''])[-1][:300]}")
    got = json.loads(p.stdout.strip().splitlines()[-1])
    return got["error"] is not None and message in got["error"] and got["above"] < 256 << 20


def _across_the_chunk_edge(middle: str, name_check) -> bool:
    """A valid trace whose event name puts ``middle`` (JSON text inside the string) across the 4 MiB edge
    where the reader's scan goes from one chunk to the next: it loads, and its name is what it should be."""
    from torsh_kernels.profiling.traces import load

    head = '{"traceEvents": [{"ph": "X", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1, "name": "'
    pad = (4 << 20) - len(head) - 1  # the middle's first character ends the first chunk
    text = head + "x" * pad + middle + '"}]}'
    with _tmp() as d:
        f = d / "rank0.json"
        f.write_text(text)
        return name_check(load(f).spans[0].name[pad:])


# -- TORSH_TRACE and the recorder ---------------------------------------------------------------------------


def _start_from_env(make) -> None:
    from torsh_kernels import recording
    from torsh_kernels.profiling import timeline

    with _tmp() as d, setenv(TORSH_TRACE=make(d)):
        try:
            timeline.start_from_env()
        finally:
            r = recording.recorder
            if r is not None and not isinstance(r, recording.Bridge):
                r.stop()


def _a_file(d: Path) -> Path:
    (d / "f").write_text("x")
    return d / "f"


def _under_a_file(d: Path) -> Path:
    return _a_file(d) / "traces"


def _recorder_start(make) -> None:
    from torsh_kernels.profiling import timeline

    with _tmp() as d:
        r = timeline.Recorder(make(d), rank=0, world_size=1)
        try:
            r.start()
        finally:
            r.stop()


def _import_with(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORSH_TRACE": value}
    return subprocess.run(
        [sys.executable, "-c", "import torsh_kernels"], env=env, capture_output=True, text=True, timeout=240
    )


def _import_with_unwritable_trace() -> bool:
    with _tmp() as d:
        p = _import_with(str(_under_a_file(d)))
    return p.returncode != 0 and "FileAccessError: TORSH_TRACE" in p.stderr and "unset it" in p.stderr


def _trace_write_through_symlinks() -> bool:
    from torsh_kernels.profiling import timeline

    with _tmp() as d:
        victim = d / "victim"
        victim.write_text("precious")
        out = d / "traces"
        out.mkdir()
        os.symlink(victim, out / "rank0.json")
        os.symlink(victim, out / f"rank0.json.tmp{os.getpid()}")
        with timeline.Recorder(out, rank=0, world_size=1), timeline.record("x"):
            pass
        return victim.read_text() == "precious" and not (out / "rank0.json").is_symlink()


def _bad_limit_env(name: str, value: str) -> None:
    _load_file(_write(json.dumps(_good_trace())), env={name: value})


# -- checkpoints of the offloaded optimizer -----------------------------------------------------------------


def _snapshot(opt, ps) -> list:
    snap = [[p.detach().clone() for p in ps], [None if p.grad is None else p.grad.clone() for p in ps], dict(opt.stats)]
    for c in opt._chunks:
        snap.append(c.master_flat.clone())
        for m in c.masters:
            snap.append(
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.inner.state.get(m, {}).items()}
            )
            snap.append({k: pk.data.clone() for k, pk in opt._packed.get(id(m), {}).items()})
    return snap


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.layout) != (b.dtype, b.layout):
            return False
        return torch.equal(a.to_dense(), b.to_dense()) if a.is_sparse else torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _trained(fmt: str = "bf16"):
    from torsh_kernels.parallel import OffloadedOptimizer

    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((5, 8), (40,), (3, 7))]
    opt = OffloadedOptimizer(ps, state_format=fmt, chunk_mb=40 * 4 / 2**20, lr=1e-3)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt, ps


def _all_or_nothing(act, prepare=None, fmt: str = "bf16"):
    """After ``prepare(opt, ps)``, run ``act(opt, ps)``, which must raise a typed error; re-raise it only if
    nothing changed (else return 'torn', which the probe counts as a silent acceptance)."""
    from torsh_kernels.errors import TorshKernelsError

    opt, ps = _trained(fmt)
    if prepare is not None:
        prepare(opt, ps)
    before = _snapshot(opt, ps)
    try:
        act(opt, ps)
    except TorshKernelsError:
        if _same(_snapshot(opt, ps), before):
            raise
        return "torn"
    return "accepted"


def _load_bad(change):
    def act(opt, ps):
        sd = opt.state_dict()
        sd = {
            "state": {i: dict(s) for i, s in sd["state"].items()},
            "param_groups": [dict(g) for g in sd["param_groups"]],
        }
        opt.load_state_dict(change(sd))

    return act


def _set(path: tuple, value):
    def change(sd):
        d = sd
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
        return sd

    return change


def _drop(path: tuple):
    def change(sd):
        d = sd
        for k in path[:-1]:
            d = d[k]
        del d[path[-1]]
        return sd

    return change


BAD_STATE_DICTS = {
    "shape_of_a_state": _set(("state", 2, "exp_avg"), torch.zeros(21)),
    "shape_of_a_master": _set(("state", 1, "master"), torch.zeros(4, 10)),
    "master_a_list": _set(("state", 0, "master"), [0.0] * 40),
    "integer_state": _set(("state", 2, "exp_avg_sq"), torch.zeros(3, 7, dtype=torch.int32)),
    "complex_state": _set(("state", 2, "exp_avg_sq"), torch.zeros(3, 7, dtype=torch.complex64)),
    "missing_key": _drop(("state", 2, "exp_avg_sq")),
    "another_optimizers_state": _set(("state", 2), {"momentum_buffer": torch.zeros(3, 7)}),
    "step_a_string": _set(("state", 1, "step"), "12"),
    "step_nan": _set(("state", 1, "step"), float("nan")),
    "state_an_int": _set(("state", 1), 5),
    "unknown_parameter_id": _set(("state", 7), {}),
    "repeated_parameter_id": _set(("param_groups", 0, "params"), [0, 0, 2]),
    "parameter_id_a_string": _set(("param_groups", 0, "params"), ["0", 1, 2]),
    "too_few_parameters": _set(("param_groups", 0, "params"), [0, 1]),
    "two_groups": lambda sd: {**sd, "param_groups": sd["param_groups"] * 2},
    "lr_a_string": _set(("param_groups", 0, "lr"), "fast"),
    "betas_of_one": _set(("param_groups", 0, "betas"), (0.9,)),
    "state_a_list": _set(("state",), []),
    "no_param_groups": _drop(("param_groups",)),
    "not_a_dict": lambda sd: [sd],
}


def _grads_for_a_step(opt, ps):
    for p in ps:
        p.grad = torch.ones(p.shape)


def _huge_last_gradient(opt, ps):
    _grads_for_a_step(opt, ps)
    ps[2].grad.fill_(1e9)  # Adam's moments pass fp16's range in the last chunk


def _reshape_last_parameter(opt, ps):
    _grads_for_a_step(opt, ps)
    ps[2].data = torch.randn(7, 3)


def _sparse_last_gradient(opt, ps):
    _grads_for_a_step(opt, ps)
    ps[2].grad = torch.sparse_coo_tensor([[0], [1]], [1.0], (3, 7), check_invariants=True)


def _step(opt, ps):
    opt.step()


def _load_fp16_overflow(opt, ps):
    sd = opt.state_dict()
    sd["state"][2]["exp_avg"] = torch.full((3, 7), 1e6)
    opt.load_state_dict(sd)


def _resume_through_torch_save() -> bool:
    """A state dict through torch.save / torch.load(weights_only=True): the resumed step equals the straight one."""
    a, pa = _trained()
    b, pb = _trained()
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=True))
    for pa_, pb_ in zip(pa, pb):
        pa_.grad = torch.full(pa_.shape, 0.5)
        pb_.grad = torch.full(pb_.shape, 0.5)
    a.step()
    b.step()
    return all(torch.equal(x, y) for x, y in zip(pa, pb))


def _plain_adamw_state_loads() -> bool:
    from torsh_kernels.parallel import OffloadedOptimizer

    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    plain = torch.optim.AdamW(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.ones(p.shape)
    plain.step()
    opt = OffloadedOptimizer(ps, state_format="fp32", lr=1e-3)
    opt.load_state_dict(plain.state_dict())
    return torch.equal(opt.state_dict()["state"][0]["exp_avg"], plain.state[ps[0]]["exp_avg"])


# -- the catalogue ----------------------------------------------------------------------------------------

P = functools.partial
CASES: list[Case] = []
for what, entry in BAD_ENTRIES.items():
    CASES.append(Case(f"files/tuning_cache/{what}", P(_entry_case, entry), expect="ok", check=bool))
for what, content in BAD_FILES.items():
    CASES.append(Case(f"files/tuning_cache/{what}", P(_cache_case, content), expect="ok", check=bool))
CASES += [
    Case(
        "files/tuning_cache/four_writers_at_once",
        _writers_lose_nothing,
        expect="ok",
        check=lambda n: n == 160,
        timeout=120,
    ),
    Case(
        "files/tuning_cache/symlinks_at_the_cache_and_temporary_names",
        _cache_write_through_symlinks,
        expect="ok",
        check=bool,
    ),
    Case("files/tuning_cache/symlink_at_the_lock", P(_cache_write, _lock_is_a_symlink)),
    Case("files/tuning_cache/fifo_at_the_lock", P(_cache_write, _lock_is_a_fifo)),
    Case("files/tuning_cache/directory_is_a_file", P(_cache_write, _dir_is_a_file)),
    # traces
    Case("files/trace/gzip_bomb_64mib_with_a_4mib_limit", P(_load_file, _bomb, max_bytes=4 << 20)),
    Case(
        "files/trace/gzip_bomb_limit_from_the_environment", P(_load_file, _bomb, env={"TORSH_TRACE_MAX_BYTES": "4MiB"})
    ),
    Case("files/trace/sparse_3gib_file", P(_load_file, _sparse(3 << 30))),
    Case("files/trace/nested_200000_deep", P(_load_file, _write("[" * 200_000 + "]" * 200_000))),
    Case("files/trace/nested_65_deep", P(_load_file, _write("[" * 65 + "]" * 65))),
    Case(
        "files/trace/depth_limit_from_the_environment",
        P(_load_file, _write(json.dumps({"traceEvents": [[[[]]]]})), env={"TORSH_TRACE_MAX_DEPTH": "3"}),
    ),
    Case("files/trace/max_bytes_env_not_a_number", P(_bad_limit_env, "TORSH_TRACE_MAX_BYTES", "lots")),
    Case("files/trace/max_bytes_env_zero", P(_bad_limit_env, "TORSH_TRACE_MAX_BYTES", "0")),
    Case("files/trace/max_depth_env_with_a_unit", P(_bad_limit_env, "TORSH_TRACE_MAX_DEPTH", "3GiB")),
    Case("files/trace/max_depth_argument_negative", P(_load_file, _write(json.dumps(_good_trace())), max_depth=-1)),
    Case("files/trace/max_bytes_argument_a_float", P(_load_file, _write(json.dumps(_good_trace())), max_bytes=1e9)),
    Case("files/trace/a_fifo", P(_load_file, _fifo)),
    Case("files/trace/dev_zero", P(_load_file, lambda f: Path("/dev/zero"))),
    Case("files/trace/empty_directory", P(_load_file, lambda f: f.parent)),
    Case("files/trace/missing", P(_load_file, lambda f: f.parent / "nope.json")),
    Case("files/trace/empty_file", P(_load_file, _write(b""))),
    Case("files/trace/only_whitespace", P(_load_file, _write(b" \n\t "))),
    Case("files/trace/truncated_gzip", P(_load_file, _truncated_gzip)),
    Case("files/trace/corrupt_gzip", P(_load_file, _corrupt_gzip)),
    Case("files/trace/gzip_with_trailing_garbage", P(_load_file, _gzip_trailing_garbage)),
    Case("files/trace/gzip_magic_only", P(_load_file, _write(b"\x1f\x8b"))),
    Case("files/trace/not_utf8", P(_load_file, _write(b'{"traceEvents": "\xc3\x28"}'))),
    Case("files/trace/integer_of_5000_digits", P(_load_file, _write('{"traceEvents": [' + "1" * 5000 + "]}"))),
    Case("files/trace/truncated_json", P(_load_file, _write(json.dumps(_good_trace())[:-9]))),
    Case("files/trace/top_level_null", P(_load_file, _write("null"))),
    Case("files/trace/events_not_a_list", P(_load_file, _write('{"traceEvents": {"a": 1}}'))),
    Case("files/trace/event_a_string", P(_load_file, _write('{"traceEvents": ["x"]}'))),
    Case("files/trace/timestamp_nan", P(_load_file, _write(_event(ts=float("nan"))))),
    Case("files/trace/timestamp_a_string", P(_load_file, _write(_event(ts="1")))),
    Case("files/trace/duration_negative", P(_load_file, _write(_event(dur=-3)))),
    Case("files/trace/name_a_number", P(_load_file, _write(_event(name=5)))),
    Case(
        "files/trace/no_pid",
        P(_load_file, _write(json.dumps({"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1, "tid": 1}]}))),
    ),
    Case(
        "files/trace/torsh_metadata_rank_out_of_range",
        P(
            _load_file,
            _write(
                json.dumps(
                    {
                        **_good_trace(),
                        "otherData": {
                            "schema": "torsh-trace/1",
                            "rank": 5,
                            "world_size": 2,
                            "device": "x",
                            "versions": {},
                            "clock": {"base_unix_us": 0},
                        },
                    }
                )
            ),
        ),
    ),
    Case("files/trace/escape_sequences_in_every_string", _escapes_in_names, expect="ok", check=bool),
    # too deep or blank, decompressed a chunk at a time: typed, and within 256 MiB of address space
    Case(
        "files/trace/gzip_bomb_of_brackets_255kb_in_bounded_memory",
        P(_bomb_in_bounded_memory, b"[", 256, "nested deeper than 64 levels"),
        expect="ok",
        check=bool,
        timeout=240,
    ),
    Case(
        "files/trace/gzip_bomb_of_brackets_2mb_in_bounded_memory",
        P(_bomb_in_bounded_memory, b"[", 2032, "nested deeper than 64 levels"),
        expect="ok",
        check=bool,
        timeout=240,
    ),
    Case(
        "files/trace/gzip_of_1gib_of_spaces_in_bounded_memory",
        P(_bomb_in_bounded_memory, b" ", 1024, "the file is empty"),
        expect="ok",
        check=bool,
        timeout=240,
    ),
    # a string's escapes across the edge between two chunks of the scan: brackets after them stay inside it
    Case(
        "files/trace/escaped_quote_across_the_chunk_edge",
        P(_across_the_chunk_edge, '\\"' + "[" * 100, lambda n: n == '"' + "[" * 100),
        expect="ok",
        check=bool,
    ),
    Case(
        "files/trace/escaped_backslash_across_the_chunk_edge",
        P(_across_the_chunk_edge, "\\\\" + "[" * 100, lambda n: n == "\\" + "[" * 100),
        expect="ok",
        check=bool,
    ),
    Case(
        "files/trace/escaped_esc_across_the_chunk_edge",
        P(_across_the_chunk_edge, "\\u001b[2J", lambda n: n == "\\x1b[2J"),
        expect="ok",
        check=bool,
    ),
    Case(
        "files/trace/utf8_bidi_override_across_the_chunk_edge",
        P(_across_the_chunk_edge, "\u202e[", lambda n: n == "\\u202e["),
        expect="ok",
        check=bool,
    ),
    # TORSH_TRACE and the recorder's directory
    Case("files/env/torsh_trace_is_a_file", P(_start_from_env, _a_file)),
    Case("files/env/torsh_trace_under_a_file", P(_start_from_env, _under_a_file)),
    Case("files/env/torsh_trace_in_proc", P(_start_from_env, lambda d: "/proc/torsh-probe/traces")),
    Case(
        "files/env/torsh_trace_unwritable_at_import",
        _import_with_unwritable_trace,
        expect="ok",
        check=bool,
        timeout=240,
    ),
    Case("files/env/recorder_directory_is_a_file", P(_recorder_start, _a_file)),
    Case("files/env/recorder_directory_under_a_file", P(_recorder_start, _under_a_file)),
    Case("files/env/trace_write_through_planted_symlinks", _trace_write_through_symlinks, expect="ok", check=bool),
    Case("files/env/cache_dir_is_a_file_ops_still_run", _cache_dir_is_a_file, expect="ok", check=bool),
    # checkpoints of the offloaded optimizer
    Case(
        "files/checkpoint/step_fp16_overflow_in_the_last_chunk", P(_all_or_nothing, _step, _huge_last_gradient, "fp16")
    ),
    Case("files/checkpoint/step_parameter_reshaped", P(_all_or_nothing, _step, _reshape_last_parameter)),
    Case("files/checkpoint/step_sparse_gradient", P(_all_or_nothing, _step, _sparse_last_gradient)),
    Case("files/checkpoint/load_fp16_overflow", P(_all_or_nothing, _load_fp16_overflow, None, "fp16")),
    Case("files/checkpoint/resume_through_torch_save", _resume_through_torch_save, expect="ok", check=bool),
    Case("files/checkpoint/plain_adamw_state_dict", _plain_adamw_state_loads, expect="ok", check=bool),
]
for what, change in BAD_STATE_DICTS.items():
    CASES.append(Case(f"files/checkpoint/load_{what}", P(_all_or_nothing, _load_bad(change))))
