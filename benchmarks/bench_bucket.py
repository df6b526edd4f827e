"""flatten / unflatten / bucket_reduce against the torch peers; same as `torsh bench bucket`.

python benchmarks/bench_bucket.py [--device cuda] [--json benchmarks/results/bucket-<gpu>.json]
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "bucket", *sys.argv[1:]]))
