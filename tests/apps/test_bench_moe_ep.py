"""``torsh bench moe --ep`` and ``--ep-train`` at tiny sizes on 2 local ranks: every wire's row is there, with the
bytes the formats imply (a packed fp8/int8 dispatch row is ``row_wire_bytes``, a bf16 row 2 H bytes), errors 0 for
the plain layer and small but nonzero for the compressed ones; the training case runs each wire on the same
batches. Nothing is timed."""

from __future__ import annotations

import json

import pytest

from torsh_kernels.apps.cli import main
from torsh_kernels.ops import row_wire_bytes

pytestmark = pytest.mark.slow  # real ranks (spawned processes)


def test_bench_moe_ep_rows(tmp_path):
    out = tmp_path / "ep.json"
    rc = main(["bench", "moe", "--ep", "--experts", "4", "--ep-tokens", "24", "--ep-hidden", "40", "--ep-ffn", "8",
               "--ep-steps", "1", "--ep-warmup", "0", "--ep-dtype", "fp32", "--json", str(out)])  # fmt: skip
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {r["wire"]: r for r in doc["rows"]}
    assert list(rows) == ["none", "fp8", "int8", "fp8-all"]
    assert rows["none"]["output_rel_error"] == 0 and rows["none"]["dispatch_row_bytes"] == 4 * 40
    for w in ("fp8", "int8", "fp8-all"):
        assert rows[w]["dispatch_row_bytes"] == row_wire_bytes(40)
        assert 0 < rows[w]["output_rel_error"] < 0.1, rows[w]
        assert rows[w]["bytes_per_step"] < rows["none"]["bytes_per_step"]
    assert rows["fp8-all"]["bytes_per_step"] < rows["fp8"]["bytes_per_step"]
    # loopback: no interface is one rank's own, so none is read (emulated hosts: test_bench_wire.py)
    assert all(r["interface_sent_per_step"] is None for r in rows.values())


def test_bench_moe_ep_train(tmp_path):
    out = tmp_path / "train.json"
    rc = main(["bench", "moe", "--ep", "--ep-train", "3", "--experts", "4", "--ep-wires", "fp8", "--json", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["bf16", "fp8"]
    assert all(len(r["losses"]) == 3 and 0 < r["final_loss"] < 6 for r in runs.values())
    assert runs["bf16"]["losses"][0] == pytest.approx(runs["fp8"]["losses"][0], rel=0.01)  # same model, same batch
