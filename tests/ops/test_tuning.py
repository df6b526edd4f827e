"""The tuning cache as provider selection reads it (ops.tuning): winners reaching selection and the kernel
launchers, change detection, the cache location, environments, and the search spaces the op modules
declare. The autotuner that writes the cache is tested in tests/profiling/test_autotune.py."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

import torsh_kernels as tk
from torsh_kernels.ops import registry, tuning
from torsh_kernels.ops.bucket.providers import flatten_impl

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """A fresh cache directory, and the registry reading it through the default reader."""
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "_tuned_lookup", tuning.lookup_provider)
    monkeypatch.setattr(registry, "_tuned_meta", tuning.lookup_meta)
    registry.reload()
    yield
    registry.reload()


def write_cache(entries: dict, device: torch.device = CPU, env_override: dict | None = None) -> None:
    """Write a cache holding ``entries`` for ``device``'s environment (as the tuner does: replace the file)."""
    key, env = tuning.environment_key(device)
    if env_override:
        env = {**env, **env_override}
        key = " | ".join(f"{a}={b}" for a, b in env.items())
    path = tuning.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    data = {"format": tuning.CACHE_FORMAT, "environments": {key: {"env": env, "entries": entries}}}
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    registry.reload()  # as the tuner does after writing: selection's cached choices see the new winners


def test_hand_written_winner_reaches_selection_and_the_launchers():
    """A winner in the cache: automatic selection takes its provider, the launchers its meta-parameters."""
    write_cache({"flatten | float32 | 2^12": {"provider": "triton", "meta": {"BLOCK": 1024, "num_warps": 2},
                                              "median_ms": 1.0}})  # fmt: skip
    assert flatten_impl.select(CPU, torch.float32, 3000, None) == "triton"
    assert registry.tuned_meta("flatten", CPU, torch.float32, 3000, "triton") == {"BLOCK": 1024, "num_warps": 2}
    assert registry.tuned_meta("flatten", CPU, torch.float32, 3000, "numba") == {}
    xs = [torch.randn(1500), torch.randn(1499)]
    assert torch.equal(tk.flatten(xs)[0], torch.cat(xs)), "the tuned provider and BLOCK give the right result"
    # another bucket, another dtype: no winner, the device default
    assert flatten_impl.select(CPU, torch.float32, 5000, None) == registry.default_provider(CPU)
    assert flatten_impl.select(CPU, torch.bfloat16, 3000, None) == registry.default_provider(CPU)


def test_a_replaced_cache_file_is_reread():
    """The tuner replaces the file: a new inode (here with the same size) is seen by the next lookup."""
    write_cache({"flatten | float32 | 2^12": {"provider": "torch", "meta": {}, "median_ms": 1.0}})
    assert tuning.lookup_provider("flatten", CPU, torch.float32, 3000) == "torch"
    write_cache({"flatten | float32 | 2^12": {"provider": "numba", "meta": {}, "median_ms": 1.0}})
    assert tuning.lookup_provider("flatten", CPU, torch.float32, 3000) == "numba"
    tuning.cache_path().unlink()
    assert tuning.lookup_provider("flatten", CPU, torch.float32, 3000) is None


def test_the_cache_location_follows_the_environment_variables(tmp_path, monkeypatch):
    write_cache({"quantize | bfloat16 | 2^20": {"provider": "numba", "meta": {}, "median_ms": 1.0}})
    assert tuning.lookup_provider("quantize", CPU, torch.bfloat16, 2**20) == "numba"
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path / "elsewhere"))
    assert tuning.cache_path() == tmp_path / "elsewhere" / "tuning.json"
    assert tuning.lookup_provider("quantize", CPU, torch.bfloat16, 2**20) is None
    monkeypatch.delenv(tuning.ENV_CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_path() == tmp_path / "xdg" / "torsh_kernels" / "tuning.json"
    write_cache({"quantize | bfloat16 | 2^20": {"provider": "triton", "meta": {"QTILE": 1024}, "median_ms": 1.0}})
    assert tuning.lookup_provider("quantize", CPU, torch.bfloat16, 2**20) == "triton"
    assert tuning.lookup_meta("quantize", CPU, torch.bfloat16, 2**20, "triton") == {"QTILE": 1024}


def test_winners_of_another_environment_do_not_apply():
    write_cache({"flatten | float32 | 2^12": {"provider": "numba", "meta": {}, "median_ms": 1.0}},
                env_override={"torch": "0.0.1"})  # fmt: skip
    assert tuning.lookup_provider("flatten", CPU, torch.float32, 3000) is None
    assert registry.tuned_meta("flatten", CPU, torch.float32, 3000, "numba") == {}


def test_an_unreadable_cache_is_ignored_with_a_warning(caplog):
    path = tuning.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="torsh_kernels"):
        assert tuning.lookup_provider("flatten", CPU, torch.float32, 3000) is None
    assert any("unreadable tuning cache" in r.getMessage() for r in caplog.records)
    path.write_text(json.dumps({"format": tuning.CACHE_FORMAT + 1, "environments": {"x": {}}}))
    assert tuning.load_cache()["environments"] == {}, "another format: read as empty"


def test_buckets_and_entry_keys():
    assert [tuning.bucket_of(n) for n in (0, 1, 2, 3, 600, 1024, 1025)] == [0, 0, 1, 2, 10, 10, 11]
    assert tuning.entry_key("flatten", torch.bfloat16, 12) == "flatten | bfloat16 | 2^12"
    key, env = tuning.environment_key(CPU)
    assert env["torch"] == torch.__version__ and env["torsh_kernels"] == tk.__version__
    assert key == " | ".join(f"{a}={b}" for a, b in env.items())


def test_op_modules_register_their_search_spaces():
    """Each op module declares its space next to its kernels; every one is right for the torch provider."""
    sp = tuning.spaces()
    assert {op: s.family for op, s in sp.items() if s.family in ("bucket", "compression")} == {
        "flatten": "bucket", "unflatten": "bucket", "bucket_reduce": "bucket", "quantize": "compression"}  # fmt: skip
    flat = sp["flatten"].candidates(["torch", "triton"])
    assert flat[0] == tuning.Candidate("torch") and len(flat) == 1 + 4 * 3
    assert str(flat[1]) == "triton(BLOCK=2048, num_warps=4)", "the first values are the launchers' defaults"
    for op in ("flatten", "unflatten", "bucket_reduce", "quantize"):
        s = sp[op]
        for dtype in s.dtypes:
            state = s.make(CPU, dtype, 300, torch.Generator().manual_seed(1))
            assert s.check(state, s.run(state, "torch")), (op, dtype)


# -- the schema: a bad cache never makes an op raise ------------------------------------------------------

GOOD = {"provider": "torch", "meta": {}, "median_ms": 1.0}
_K = "flatten | float32 | 2^12"
BAD_ENTRIES = {
    "not-an-object": 5,
    "no-provider": {"meta": {}, "median_ms": 1.0},
    "unknown-provider": {"provider": "cuda", "meta": {}},
    "provider-not-a-string": {"provider": ["triton"]},
    "absurd-block": {"provider": "triton", "meta": {"BLOCK": 2**40}},
    "block-not-in-space": {"provider": "triton", "meta": {"BLOCK": 3}},
    "absurd-num-warps": {"provider": "triton", "meta": {"num_warps": 1000}},
    "unknown-meta-name": {"provider": "triton", "meta": {"TILE": 64}},
    "meta-on-a-provider-without-any": {"provider": "numba", "meta": {"BLOCK": 1024}},
    "meta-not-an-object": {"provider": "triton", "meta": [1024]},
    "meta-value-a-string": {"provider": "triton", "meta": {"BLOCK": "1024"}},
    "meta-value-a-bool": {"provider": "triton", "meta": {"num_warps": True}},
    "time-a-string": {"provider": "torch", "median_ms": "fast"},
    "time-negative": {"provider": "torch", "median_ms": -1},
    "rank-a-string": {"provider": "torch", "synced_from_rank": "0"},
    "tuned-at-a-number": {"provider": "torch", "tuned_at": 5},
}


def _write_raw(data) -> None:
    path = tuning.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    registry.reload()


def _ops_still_run() -> None:
    xs = [torch.randn(1500), torch.randn(1499)]
    for _ in range(3):  # every call, not only the first
        assert torch.equal(tk.flatten(xs)[0], torch.cat(xs))
    assert registry.tuned_meta("flatten", CPU, torch.float32, 3000, "triton") == {}


@pytest.mark.parametrize("what", list(BAD_ENTRIES))
def test_a_bad_entry_is_skipped_with_one_warning(what, caplog):
    key, env = tuning.environment_key(CPU)
    entries = {_K: BAD_ENTRIES[what], "quantize | float32 | 2^20": GOOD}
    _write_raw({"format": tuning.CACHE_FORMAT, "environments": {key: {"env": env, "entries": entries}}})
    with caplog.at_level(logging.WARNING, logger="torsh_kernels"):
        _ops_still_run()
        assert tuning.lookup_provider("flatten", CPU, torch.float32, 3000) is None
        assert tuning.lookup_provider("quantize", CPU, torch.float32, 2**20) == "torch", "the good entry is used"
        registry.reload()  # read again: still one warning for this file
        assert tuning.load_cache()["environments"][key]["entries"] == {"quantize | float32 | 2^20": GOOD}
    warned = [r.getMessage() for r in caplog.records if "tuning cache" in r.getMessage()]
    assert len(warned) == 1 and _K in warned[0], warned


@pytest.mark.parametrize(
    "content",
    ["[]", "null", "5", '"x"', '{"format": 1}', '{"format": 1, "environments": []}',
     '{"format": 1, "environments": {"k": []}}', '{"format": 1, "environments": {"k": {"entries": null}}}',
     "[" * 100_000, "\xff\xfe"],
    ids=["list", "null", "number", "string", "no-environments", "environments-a-list", "environment-a-list",
         "entries-null", "nested-100000-deep", "not-utf8"],
)  # fmt: skip
def test_a_cache_of_the_wrong_shape_is_read_as_empty(content, caplog):
    _write_raw(content)
    with caplog.at_level(logging.WARNING, logger="torsh_kernels"):
        _ops_still_run()
        assert tuning.lookup_provider("flatten", CPU, torch.float32, 3000) is None
    assert sum("tuning cache" in r.getMessage() for r in caplog.records) == 1


def test_a_cache_path_that_is_not_a_regular_file_is_not_read(caplog):
    path = tuning.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)  # opening a FIFO for reading would block every op call on this machine
    with caplog.at_level(logging.WARNING, logger="torsh_kernels"):
        _ops_still_run()
    assert any("not a regular file" in r.getMessage() for r in caplog.records)


def _writer(n: int, start, path: str) -> None:
    start.wait()
    for i in range(40):
        key = f"flatten | float32 | 2^{i}"

        def add(data, key=key, n=n):
            data["environments"].setdefault(f"writer {n}", {"env": {}, "entries": {}})["entries"][key] = dict(GOOD)

        tuning.update_cache(add, tuning.Path(path))


def test_concurrent_writers_lose_no_entry(tmp_path):
    """Four processes adding 40 entries each at once: all 160 are in the file (read-merge-write under the
    cache's lock)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")  # the writers need no torch state: fork starts them at once
    path = tmp_path / "shared" / "tuning.json"
    start = ctx.Event()
    procs = [ctx.Process(target=_writer, args=(n, start, str(path))) for n in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 4
    envs = tuning.load_cache(path)["environments"]
    assert sorted(envs) == [f"writer {n}" for n in range(4)]
    assert sum(len(e["entries"]) for e in envs.values()) == 160
    assert sorted(os.listdir(path.parent)) == ["tuning.json", "tuning.json.lock"], "no temporary file left"


def test_a_planted_symlink_redirects_no_write(tmp_path):
    """Symlinks at the cache's name, at the old predictable temporary name and at the lock's name: the
    file they point at is never written."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = tuning.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(victim, path.with_suffix(f".tmp{os.getpid()}"))  # what the writer used to create
    os.symlink(victim, path)
    tuning.update_cache(lambda d: d["environments"].setdefault("e", {"env": {}, "entries": {}}))
    assert victim.read_text() == "precious"
    assert not path.is_symlink() and tuning.load_cache()["environments"] == {"e": {"env": {}, "entries": {}}}
    lock = path.with_name(path.name + ".lock")
    lock.unlink()
    os.symlink(victim, lock)
    with pytest.raises(tk.errors.FileAccessError, match="symlink"):
        tuning.update_cache(lambda d: None)
    assert victim.read_text() == "precious"
