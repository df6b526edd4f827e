"""``torsh doctor``'s fuller report (issue 42, item 8): system, install, packages, the variables set, the
caches, a self-test per provider, the compressors' names, plain narrow text when piped, ``--bug-report``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import torsh_kernels
from torsh_kernels.apps.cli import main
from torsh_kernels.apps.doctor import PLAIN_WIDTH, self_test
from torsh_kernels.ops.registry import ProviderInfo

ROOT = Path(__file__).resolve().parents[2]
BORDERS = re.compile("[\u2500-\u257f]")  # box drawing: rich's table borders
ANSI = "\x1b["


def test_the_report_has_every_section_and_the_json_has_them_as_data(capsys, monkeypatch):
    monkeypatch.setenv("TORSH_DOCTOR_PROBE", "on")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("NOT_A_TORSH_VAR", "x")
    assert main(["doctor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"system", "install", "packages", "environment", "caches", "self_test", "compressors"} <= set(d)
    assert d["system"]["os"] and d["system"]["cpu"] and d["system"]["cpus"] >= 1
    assert d["install"]["path"] == str(Path(torsh_kernels.__file__).resolve().parent)
    mode = d["install"]["mode"]
    assert mode.startswith(("editable (pip install -e", "installed (", "not installed: imported from a source tree"))
    assert d["install"]["editable"] == mode.startswith("editable")
    assert {"numpy", "rich"} <= set(d["packages"]) and any(k.startswith("cupy") for k in d["packages"])
    assert d["environment"]["TORSH_DOCTOR_PROBE"] == "on" and d["environment"]["NCCL_DEBUG"] == "WARN"
    assert "NOT_A_TORSH_VAR" not in d["environment"]
    assert all(k.startswith(("TORSH_", "TRITON_", "NUMBA_", "NCCL_")) for k in d["environment"])
    assert d["caches"]["tuning"].endswith("tuning.json") and d["caches"]["numba"]
    forms = [n["form"] for n in d["compressors"]["names"]]
    assert [f.split("[")[0].split(":")[0] for f in forms] == ["none", "fp16", "bf16", "int8", "int4", "fp8", "sign",
                                                               "topk", "powersgd"]  # fmt: skip
    assert "topk:0.01" in d["compressors"]["auto_candidates"]


def test_the_self_test_runs_one_op_per_provider_against_the_reference(capsys):
    assert main(["doctor", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["self_test"]
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"triton", "numba", "cpu", "torch"}
    for r in rows:
        assert r["status"] in ("pass", "skipped"), r  # nothing fails on a healthy install
        if r["status"] == "pass":
            assert r["detail"] == "matches the torch reference" and r["ms"] >= 0 and r["first_ms"] >= 0
        else:
            assert r["detail"] and r["ms"] is None
    assert by["torch"]["status"] == "pass"  # the torch provider runs everywhere
    # what runs here: the providers that say they can run on the self-test's device
    dev = by["torch"]["device"]
    import torsh_kernels as tk

    for name, p in tk.providers().items():
        can = (p.cuda if dev == "cuda" else p.cpu) is None
        assert (by[name]["status"] == "pass") == can, (name, by[name])


def test_a_provider_that_fails_is_reported_as_failing_with_its_error():
    rows = self_test({"nosuch": ProviderInfo("nosuch", None, "-", None, None)})
    assert [(r["provider"], r["status"]) for r in rows] == [("nosuch", "fail")]
    assert "ProviderError" in rows[0]["detail"] and rows[0]["ms"] is None


def test_piped_output_is_plain_narrow_text(capsys):
    assert main(["doctor"]) == 0  # capsys: stdout is not a terminal
    text = capsys.readouterr().out
    assert not BORDERS.search(text) and ANSI not in text
    long = [ln for ln in text.splitlines() if len(ln) > PLAIN_WIDTH and " " in ln.strip()]
    assert not long, long
    for needle in ("== system", "OS", "CPU", "imported from", "install", "numpy", "rich", "cupy", "tuning cache",
                   "Numba cache", "== kernel providers", "== self-test", "== transports", "cupy-nccl", "rdma",
                   "network namespaces", "== compressors", "topk:RATIO", "powersgd[:RANK]", "int8"):  # fmt: skip
        assert needle in text, needle
    assert "torch: device" in text and "result pass" in text


def test_bug_report_is_a_compact_plain_block(capsys, monkeypatch):
    monkeypatch.setenv("TORSH_KERNELS_PROVIDER_PROBE", "1")
    assert main(["doctor", "--bug-report"]) == 0
    text = capsys.readouterr().out
    lines = text.strip().splitlines()
    assert lines[0] == "```text" and lines[-1] == "```" and len(lines) <= 14
    assert not BORDERS.search(text) and ANSI not in text
    body = "\n".join(lines)
    for needle in ("torsh-kernels ", "imported from", "python ", "torch ", "packages: numpy ", "rich ",
                   "providers: triton", "self-test: ", "torch pass", "env: ", "TORSH_KERNELS_PROVIDER_PROBE=1",
                   "transports: torch", "caches: tuning"):  # fmt: skip
        assert needle in body, needle
    assert main(["doctor", "--bug-report", "--no-self-test"]) == 0
    assert "self-test" not in capsys.readouterr().out


_NO_TRITON = """
import sys
class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, _NoTriton())
from torsh_kernels.apps.cli import main
assert main(["doctor", "--bug-report"]) == 0
assert "triton" not in sys.modules
print("OK")
"""


@pytest.mark.slow  # a fresh interpreter that imports torch: ~8 s on a loaded 2-core machine
def test_doctor_works_where_triton_cannot_be_imported(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORSH_KERNELS_PROVIDER")}
    env["TORSH_KERNELS_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", _NO_TRITON], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "triton skipped" in out and "(cuda no, cpu no)" in out and "torch pass" in out
    assert out.rstrip().endswith("OK")
