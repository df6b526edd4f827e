"""DDP step time, PyTorch hooks against compression_hook; same as `torsh bench ddp`.

python benchmarks/bench_ddp.py [--world-size 2] [--json benchmarks/results/ddp-<net>.json]
sudo benchmarks/emulated_hosts.sh --rate 1gbit -- .venv/bin/python benchmarks/bench_ddp.py ...
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ddp", *sys.argv[1:]]))
