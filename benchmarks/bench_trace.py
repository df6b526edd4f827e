"""What the timeline instrumentation costs per call; same as `torsh bench trace`.

python benchmarks/bench_trace.py [--json benchmarks/results/trace-cpu.json]
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "trace", *sys.argv[1:]]))
