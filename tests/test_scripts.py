"""The scripts under scripts/ that need a GPU to run for real: what can be checked without one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=60)  # fmt: skip


def test_gpu_check_dry_run_prints_the_plan_within_the_device_budget():
    r = _sh("--dry-run")
    assert r.returncode == 0, r.stderr
    steps = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("[part")]
    assert [s.split()[2] for s in steps] == ["env", "torch", "install", "tests", "bench", "inspect", "table"]
    bounds = {p: sum(int(s.split()[5].rstrip("s:")) for s in steps if s.split()[1] == f"{p}]") for p in "12"}
    assert all(b <= 570 for b in bounds.values()), bounds  # each part fits one 10-minute call, with room to start
    assert "plan ok" in r.stdout and "nothing was run" in r.stdout
    assert "[part 1]" not in _sh("--dry-run", "--part", "2").stdout


def test_gpu_check_refuses_bad_arguments():
    for args in (("--part", "3"), ("--bogus",), ("--part",), ("--out", "")):
        r = _sh(*args, "--dry-run")
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "gpu_check.sh:" in r.stderr


def test_gpu_table_puts_the_estimate_beside_the_measurement(tmp_path):
    bench = {"device": "NVIDIA H100", "suites": {"bucket": {"results": [
        {"op": "flatten", "case": "a", "impl": "torsh[triton]", "kind": "ours", "gbps": 2400.0, "ratio_to_copy": 0.8},
        {"op": "flatten", "case": "a", "impl": "torch.cat(out=)", "kind": "peer", "gbps": 2000.0},
    ]}}}  # fmt: skip
    est = {"us": 50.0, "copy_us": 45.0}
    sass = {"arch": "sm_90", "cases": [
        {"name": "flatten fp32->fp32 copy aligned", "provider": "triton", "estimate": {"H100-SXM5-80GB": est}},
        {"name": "unflatten fp32->fp32 copy aligned", "provider": "triton", "estimate": {"H100-SXM5-80GB": est}},
    ]}  # fmt: skip
    (tmp_path / "b.json").write_text(json.dumps(bench))
    (tmp_path / "s.json").write_text(json.dumps(sass))
    out = tmp_path / "t.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_table.py"), str(tmp_path / "b.json"),
                        str(tmp_path / "s.json"), "--json", str(out)], capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and rows[0]["impl"] == "torsh[triton]"  # the peer is not ours
    assert abs(rows[0]["estimated_share_of_copy"] - 0.9) < 1e-9
    assert "| bucket | flatten | a | torsh[triton] | 2400 | 80% | 90% |" in r.stdout
