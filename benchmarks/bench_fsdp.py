"""FSDP2 step time and bytes on the wire, plain against quantized comms; same as `torsh bench fsdp`.

python benchmarks/bench_fsdp.py [--world-size 2] [--json benchmarks/results/fsdp-<net>.json]
sudo benchmarks/emulated_hosts.sh --rate 1gbit -- .venv/bin/python benchmarks/bench_fsdp.py ...
"""

from __future__ import annotations

import sys

from torsh_kernels.apps.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "fsdp", *sys.argv[1:]]))
