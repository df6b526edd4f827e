"""Convergence on the bundled digits data set: DDP with each compressor (error feedback where the compressor
has it; compressor="auto" with whatever it chooses) ends within 2 accuracy points of uncompressed DDP.
This is ``torsh demo``'s training run, on 2 real gloo ranks, with its default settings but 800 steps
instead of 600: sign (EF-SignSGD, one scale per bucket chunk) converges more slowly than the others, and
after 600 steps it ended 3 points behind on seeds 0, 1 and 4 of 0-5 on an Intel Xeon VM (level on the
others; seed 0 passed at 600 steps on the AMD EPYC VM). After 800 steps sign was within 2 points on seeds
0-7 there (its worst: -1.4), and every compressor on seeds 0 and 1."""

from __future__ import annotations

import pytest

from torsh_kernels.apps.demo import COMPRESSORS, DemoConfig, run_rank
from torsh_kernels.collectives import run_local

pytestmark = pytest.mark.slow  # a system test: whole training runs (docs/testing.md)


def test_every_compressor_ends_within_two_points_of_uncompressed():
    cfg = DemoConfig(progress=False, steps=800)
    rows = run_local(run_rank, 2, cfg, threads=1, timeout=900, op_timeout=120)[0]
    acc = {r["compressor"]: r["accuracy"] for r in rows}
    assert list(acc) == list(COMPRESSORS)
    assert acc["none"] > 0.93, acc  # the baseline itself learned the task
    for name, a in acc.items():
        assert a >= acc["none"] - 0.02, f"{name}: {a:.3f} vs uncompressed {acc['none']:.3f}"
    for r in rows:
        if r["compressor"] != "none" and r.get("chose") != "none":
            assert r["bytes_per_step"] < r["gradient_bytes"], r  # compression did happen
    auto = next(r for r in rows if r["compressor"] == "auto")
    assert auto["auto"]["choice"] == auto["chose"]  # what auto measured, and its choice, reach the table
