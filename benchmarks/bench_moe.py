"""MoE route + permute + unpermute against a Mixtral-style torch block; same as `torsh bench moe`.

python benchmarks/bench_moe.py [--device cuda] [--json benchmarks/results/moe-<gpu>.json]
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe", *sys.argv[1:]]))
