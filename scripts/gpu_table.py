"""The GPU table: measured bandwidth per kernel family as a share of the same run's device-copy bandwidth
(`torsh bench ... --json`), beside the bound `torsh inspect --json` estimates for the same family (the copy
anchor's bound over the kernel's, so 100% is "as fast as a copy of the same bytes").

    python scripts/gpu_table.py BENCH.json SASS.json [--json OUT.json]

Prints a Markdown table (the one docs/ops.md carries). Rows are the benchmark's own cases of the triton and
numba providers; the estimate is the median over the inspect cases of the matching family and provider (the
matching is by name, below: a benchmark op with no inspect counterpart gets none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# benchmark op (as `torsh bench` names it) -> the prefixes of the inspect cases that run the same kernels
FAMILY = {
    "flatten": ("flatten ",),
    "unflatten": ("unflatten ",),
    "bucket_reduce": ("bucket_reduce ",),
    "fp16 compress": ("wire_cast fp32->fp16",),
    "bf16 compress": ("wire_cast fp32->bf16",),
    "fp16 decompress": ("unflatten fp16->fp32",),
    "bf16 decompress": ("unflatten bf16->fp32",),
    "int8 quantize": ("quantize fp32 int8",),
    "int8 stochastic quantize": ("quantize fp32 int8 stochastic",),
    "int4 quantize": ("quantize fp32 int4",),
    "int8 dequantize": ("dequantize int8->fp32",),
    "int4 dequantize": ("dequantize int4->fp32",),
    "sign + error feedback": ("abs_sum fp32 residual", "sign_pack fp32 residual"),
    "sign decompress": ("sign_unpack ->fp32",),
    "top-k 1%": ("topk_candidates fp32 idx",),
    "top-k 1% + error feedback": ("topk_candidates fp32 residual",),
    "top-k decompress": ("scatter fp32->fp32",),
    "permute": ("moe_permute ",),
    "unpermute": ("moe_unpermute ",),
    "to host": ("flatten fp32->bf16", "quantize fp32 int8"),
    "from host": ("unflatten bf16->fp32", "dequantize int8->fp32"),
}


def _rows(bench: dict) -> list[dict]:
    suites = bench.get("suites", {"single": bench})
    out = []
    for suite, doc in suites.items():
        for r in doc.get("results", []) if isinstance(doc, dict) else []:
            impl = str(r.get("impl", ""))
            if r.get("kind") == "ours" and ("triton" in impl or "numba" in impl):
                out.append({"suite": suite, "op": r.get("op"), "case": r.get("case"), "impl": impl,
                            "gbps": r.get("gbps"), "share_of_copy": r.get("ratio_to_copy")})  # fmt: skip
    return out


def _estimate(sass: dict, op: str, provider: str) -> float | None:
    shares = []
    for c in sass.get("cases", []):
        if c["provider"] == provider and c["name"].startswith(FAMILY.get(op, ("\0",))):
            e = next(iter(c["estimate"].values()))
            if e.get("us"):
                shares.append(e["copy_us"] / e["us"])
    return statistics.median(shares) if shares else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench")
    ap.add_argument("sass")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    try:
        bench = json.loads(Path(a.bench).read_text())
        sass = json.loads(Path(a.sass).read_text())
    except (OSError, ValueError) as e:
        print(f"gpu_table.py: {e}", file=sys.stderr)
        return 2
    rows = _rows(bench)
    for r in rows:
        provider = "numba" if "numba" in r["impl"] else "triton"
        r["estimated_share_of_copy"] = _estimate(sass, r["op"], provider)
    print("| suite | op | case | impl | GB/s | share of copy (measured) | share of copy (inspect bound) |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: |")
    pct = lambda v: "" if v is None else f"{v:.0%}"
    for r in rows:
        gbps = "" if r["gbps"] is None else f"{r['gbps']:.0f}"
        print(f"| {r['suite']} | {r['op']} | {r['case']} | {r['impl']} | {gbps} | {pct(r['share_of_copy'])} | "
              f"{pct(r['estimated_share_of_copy'])} |")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({"device": bench.get("device") or bench.get("environment"),
                                            "arch": sass.get("arch"), "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
