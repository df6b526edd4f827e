"""Hardware counters for the fused kernels through nsight-python (``pip install 'torsh-kernels[nsight]'``)
where NVIDIA Nsight Compute's ``ncu`` is present: per kernel, the duration, the achieved DRAM throughput
(% of peak) and the achieved occupancy (% of peak warps), added to ``torsh bench --ncu``'s table and JSON.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import Any

import torch

METRICS = (
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)


def unavailable_reason() -> str | None:
    """None if kernels can be profiled here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU: hardware counters need one"
    if shutil.which(os.environ.get("NCU", "ncu")) is None:
        return "NVIDIA Nsight Compute's `ncu` is not on PATH (install Nsight Compute or set NCU=/path/to/ncu)"
    if importlib.util.find_spec("nsight") is None:
        return "nsight-python is not installed (pip install 'torsh-kernels[nsight]')"
    return None


def _cases(n: int) -> dict[str, Any]:
    """name -> a callable launching one fused kernel (the triton provider) on n elements."""
    from ...ops import bucket_reduce, flatten, moe_permute, moe_route, moe_unpermute, quantize, unflatten

    dev = torch.device("cuda")
    ts = [torch.randn(n // 8, device=dev) for _ in range(8)]
    flat, layout = flatten(ts, provider="triton")
    bufs = [torch.randn(n, device=dev) for _ in range(4)]
    x = torch.randn(n, device=dev)
    T, H = max(1, n // 4096), 4096
    xa = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    r = moe_route(torch.randn(T, 8, device=dev), k=2, provider="triton")
    yp = torch.randn(r.num_rows, H, device=dev, dtype=torch.bfloat16)
    return {
        "flatten": lambda: flatten(ts, out=flat, provider="triton"),
        "unflatten": lambda: unflatten(flat, layout, ts, provider="triton"),
        "bucket_reduce": lambda: bucket_reduce(bufs, provider="triton"),
        "quantize int8": lambda: quantize(x, bits=8, provider="triton"),
        "moe_permute": lambda: moe_permute(xa, r, provider="triton"),
        "moe_unpermute": lambda: moe_unpermute(yp, r, provider="triton"),
    }


def profile(n: int = 1 << 26) -> list[dict[str, Any]]:
    """Profile each fused kernel once under ncu; rows as nsight-python reports them."""
    import nsight

    cases = _cases(n)
    rows: list[dict[str, Any]] = []
    for name, fn in cases.items():

        @nsight.analyze.kernel(configs=[(n,)], runs=3, metrics=list(METRICS), output="quiet", replay_mode="range",
                               combine_kernel_metrics=lambda a, b: a + b)  # fmt: skip
        def bench(size, fn=fn, name=name):
            with nsight.annotate(name):
                fn()

        df = bench().to_dataframe()
        for rec in df.to_dict(orient="records"):
            rows.append({"kernel": name, **{str(k): (v if isinstance(v, (int, float, str)) else str(v))
                                            for k, v in rec.items()}})  # fmt: skip
    return rows
