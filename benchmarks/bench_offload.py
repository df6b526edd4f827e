"""Offload packing against plain host copies, and AdamW against OffloadedOptimizer; same as `torsh bench offload`.

python benchmarks/bench_offload.py [--device cuda] [--json benchmarks/results/offload-<gpu>.json]
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "offload", *sys.argv[1:]]))
