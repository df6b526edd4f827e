"""Provider selection: explicit > TORSH_KERNELS_PROVIDER > tuned winner > device default, with fallback."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import torsh_kernels as tk
from tests.helpers import DEVICE
from torsh_kernels.ops import registry
from torsh_kernels.ops.bucket import providers as bucket


@pytest.fixture
def calls(monkeypatch):
    """Record which provider implementation of flatten runs (the real implementations still run)."""
    seen: list[str] = []
    for name, fn in list(bucket.flatten_impl.impls.items()):
        monkeypatch.setitem(bucket.flatten_impl.impls, name, lambda *a, _n=name, _f=fn: (seen.append(_n), _f(*a)))
    return seen


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    installed = registry._tuned_lookup  # the tuning cache's reader by default: put it back afterwards
    registry.set_tuned_lookup(None)
    registry._logged.clear()
    yield
    registry.set_tuned_lookup(installed)


def run(provider=None):
    return tk.flatten([torch.randn(5, device=DEVICE), torch.randn(3, 2, device=DEVICE)], provider=provider)


@pytest.mark.parametrize("name", registry.PROVIDERS)
def test_explicit_provider_is_the_one_that_runs(calls, name):
    run(name)
    assert calls == [name]


def test_device_default(calls):
    run()
    assert calls == [registry.default_provider(DEVICE)]


def test_env_var_beats_tuned_and_default(calls, monkeypatch):
    registry.set_tuned_lookup(lambda op, dev, dtype, size: "triton")
    monkeypatch.setenv(registry.ENV_VAR, "numba")
    run()
    assert calls == ["numba"]


def test_explicit_beats_env_var(calls, monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "numba")
    run("torch")
    assert calls == ["torch"]


def test_tuned_winner_beats_default_and_sees_the_call(calls):
    seen = []
    registry.set_tuned_lookup(lambda op, dev, dtype, size: seen.append((op, dev.type, dtype, size)) or "numba")
    run()
    assert calls == ["numba"]
    assert seen == [("flatten", DEVICE.type, torch.float32, 11)]


def test_unknown_env_provider_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "cuda")
    with pytest.raises(tk.ProviderError, match="'cuda' from TORSH_KERNELS_PROVIDER"):
        run()


def test_automatic_choice_that_cannot_run_falls_back_with_one_debug_line(calls, monkeypatch, caplog):
    monkeypatch.setattr(registry, "numba_state", lambda: (None, False, "numba.cuda cannot be imported (test)"))
    monkeypatch.setenv(registry.ENV_VAR, "numba")
    with caplog.at_level(logging.DEBUG, logger="torsh_kernels"):
        run()
        run()
    assert calls == [registry.default_provider(DEVICE)] * 2
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "numba" in lines[0] and "cannot be imported" in lines[0]


def test_explicit_provider_that_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(registry, "numba_state", lambda: (None, False, "numba.cuda cannot be imported (test)"))
    with pytest.raises(tk.ProviderUnavailableError, match=r"'numba' was requested but cannot run.*cannot be imported"):
        run("numba")
    assert issubclass(tk.ProviderUnavailableError, RuntimeError)


def test_can_run_explains_device_limits():
    # In the test harness both slow modes are on (no GPU) or both compiled kernels are (GPU).
    if DEVICE.type == "cpu":
        assert registry.can_run("triton", torch.device("cpu")) is None
        assert registry.can_run("numba", torch.device("cpu")) is None
        assert "host arrays" in registry.can_run("numba", torch.device("cuda"))
    assert registry.can_run("torch", torch.device("meta")) is None
    with pytest.raises(tk.ProviderError):
        registry.can_run("opencl", torch.device("cpu"))


def test_providers_report_lists_every_provider_with_reasons():
    report = tk.providers()
    assert list(report) == ["triton", "numba", "cpu", "torch"]
    text = str(report)
    for name in ("triton", "numba", "cpu", "torch"):
        assert name in text and report[name].version
    assert "Numba's CPU target" in report["cpu"].mode and report["cpu"].cpu is None
    assert "CPU tensors" in report["cpu"].cuda
    if DEVICE.type == "cpu":
        assert "interpreter" in report["triton"].mode and report["triton"].cpu is None
        assert "simulator" in report["numba"].mode and report["numba"].cpu is None
        assert report["torch"].cuda == "torch reports no usable CUDA device"
    assert all(info.available for info in report.values())


def test_cpu_provider_is_the_cpu_default_and_ops_without_it_fall_back_to_torch(caplog):
    assert registry.default_provider(torch.device("cpu")) == "cpu"
    assert registry.default_provider(torch.device("cuda")) == "triton"
    assert registry.can_run("cpu", torch.device("cpu")) is None
    assert "CPU tensors" in registry.can_run("cpu", torch.device("cuda"))
    op = registry.Op("test_only_torch")
    op.register("torch")(lambda: None)
    with caplog.at_level(logging.DEBUG, logger="torsh_kernels"):
        assert op.select(torch.device("cpu"), torch.float32, 10, None) == "torch"
    assert any("no cpu implementation" in r.getMessage() for r in caplog.records)
    with pytest.raises(tk.ProviderUnavailableError, match="no cpu implementation"):
        op.select(torch.device("cpu"), torch.float32, 10, "cpu")
    # every op family has a cpu implementation (the bucket ops: torch's own, see docs/ops.md)
    # (getattr: some packages put objects without a __name__ into sys.modules, CuPy's cupy.fft.config one)
    ops_with_impls = [o for m in list(sys.modules.values())
                      if (getattr(m, "__name__", None) or "").startswith("torsh_kernels.ops.")
                      for o in vars(m).values() if isinstance(o, registry.Op)]  # fmt: skip
    assert len(ops_with_impls) >= 18 and all("cpu" in o.impls for o in ops_with_impls)


def test_providers_without_interpreter_or_simulator_explain_how_to_enable_them():
    """A fresh process with neither switch set, as a user without a GPU would see it."""
    code = "import torsh_kernels as tk; r = tk.providers(); print(r); print(r['triton'].cpu); print(r['numba'].cpu)"
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("TRITON_INTERPRET", "NUMBA_ENABLE_CUDASIM")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    # without the switches neither runs on CPU tensors, GPU or not (can_run: compiled Triton and Numba CUDA
    # kernels take CUDA tensors); the reason says which switch to set, and the table prints it on their rows
    *table, triton_cpu, numba_cpu = out.splitlines()
    assert triton_cpu.startswith("Triton compiles for GPUs and got cpu tensors; ")
    assert "set TRITON_INTERPRET=1 before importing torsh_kernels" in triton_cpu
    assert numba_cpu.startswith("Numba CUDA kernels need CUDA tensors and got cpu tensors; ")
    assert "set NUMBA_ENABLE_CUDASIM=1 before importing numba" in numba_cpu
    cpu_rows = [line.strip() for line in table if line.strip().startswith("cpu tensors:")]
    assert cpu_rows == [f"cpu tensors:   no: {triton_cpu}", f"cpu tensors:   no: {numba_cpu}", "cpu tensors:   yes",
                        "cpu tensors:   yes"]  # triton, numba, cpu, torch  # fmt: skip


def test_import_loads_no_triton_numba_or_profiling():
    """A fresh ``import torsh_kernels`` defines no kernels: Triton, Numba and the profiling layer load on
    first use (a provider's first launch, a provider query, a trace)."""
    code = (
        "import sys, torsh_kernels, torsh_kernels.ops; "
        "print([m for m in sys.modules if m.startswith(('triton', 'numba', 'torsh_kernels.profiling'))])"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORSH_TRACE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_default_tuned_lookup_is_the_tuning_cache_reader():
    """Provider selection reads the tuning cache without an install step (tests swap it per test only)."""
    code = (
        "from torsh_kernels.ops import registry, tuning; "
        "print(registry._tuned_lookup is tuning.lookup_provider, registry._tuned_meta is tuning.lookup_meta)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


# ------------------------------------------------------------------- selection resolved once, then cached


def test_selection_is_resolved_once_per_size_bucket_until_reload():
    seen = []
    registry.set_tuned_lookup(lambda op, dev, dtype, size: seen.append(size) or "numba")
    sel = bucket.flatten_impl.select
    assert [sel(DEVICE, torch.float32, n, None) for n in (1000, 1000, 600, 1024)] == ["numba"] * 4
    assert seen == [1000], "one lookup for the 2^10 bucket"
    assert sel(DEVICE, torch.float32, 1025, None) == "numba" and seen == [1000, 1025]
    assert sel(DEVICE, torch.float16, 1000, None) == "numba" and len(seen) == 3
    registry.reload()
    sel(DEVICE, torch.float32, 1000, None)
    assert len(seen) == 4, "reload() drops the cached choices"
    registry.set_tuned_lookup(lambda op, dev, dtype, size: "triton")
    assert sel(DEVICE, torch.float32, 1000, None) == "triton", "a new lookup is honoured at once"


def test_env_var_changes_are_honoured_at_once(calls, monkeypatch):
    run()
    monkeypatch.setenv(registry.ENV_VAR, "numba")
    run()
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    run()
    monkeypatch.delenv(registry.ENV_VAR)
    run()
    assert calls == [registry.default_provider(DEVICE), "numba", "torch", registry.default_provider(DEVICE)]


def test_tuned_meta_is_cached_until_reload():
    seen = []
    installed = registry._tuned_meta
    registry.set_tuned_meta(lambda op, dev, dtype, size, prov: seen.append(size) or {"BLOCK": 1024})
    try:
        assert registry.tuned_meta("flatten", DEVICE, torch.float32, 3000, "triton") == {"BLOCK": 1024}
        assert registry.tuned_meta("flatten", DEVICE, torch.float32, 4000, "triton") == {"BLOCK": 1024}
        assert seen == [3000]
        registry.reload()
        registry.tuned_meta("flatten", DEVICE, torch.float32, 4000, "triton")
        assert seen == [3000, 4000]
    finally:
        registry.set_tuned_meta(installed)


def test_no_file_system_access_per_call(monkeypatch, tmp_path):
    """With the tuning cache's reader installed, a call after the first stats no file."""
    import os

    from torsh_kernels.ops import tuning

    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path))
    registry.set_tuned_lookup(tuning.lookup_provider)
    registry.reload()
    run()
    stats = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (stats.append(p), real(p, *a, **k))[1])
    for _ in range(3):
        run()
    assert not [p for p in stats if "tuning" in str(p)]


def test_a_tuned_lookup_must_be_callable():
    from torsh_kernels.errors import ArgumentTypeError

    for setter in (registry.set_tuned_lookup, registry.set_tuned_meta):
        with pytest.raises(ArgumentTypeError, match="callable"):
            setter("cache.json")
    assert float(tk.flatten([torch.ones(3)])[0].sum()) == 3.0  # the ops still select as before
