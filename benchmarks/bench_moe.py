"""MoE route + permute + unpermute against a Mixtral-style torch block, and the full MoELayer against Hugging Face's
Mixtral and DeepSeek-V3 blocks as transformers builds them (grouped_mm experts, its default; the eager experts in a
secondary column); same as `torsh bench moe`.

python benchmarks/bench_moe.py [--device cuda] [--layer-full] [--json benchmarks/results/moe-<gpu>.json]
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "moe", *sys.argv[1:]]))
