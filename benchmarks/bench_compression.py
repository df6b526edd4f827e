"""Compression ops and compressors against the torch peers; same as `torsh bench compression`.

python benchmarks/bench_compression.py [--device cuda] [--json benchmarks/results/compression-<gpu>.json]
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "compression", *sys.argv[1:]]))
