"""Collectives and compressed all-reduce over real processes; same as `torsh bench collectives`.

python benchmarks/bench_collectives.py [--world-size 2] [--json benchmarks/results/collectives-<net>.json]
sudo benchmarks/emulated_hosts.sh --rate 1gbit -- .venv/bin/python benchmarks/bench_collectives.py ...
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "collectives", *sys.argv[1:]]))
