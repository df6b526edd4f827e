#!/usr/bin/env bash
# Two emulated hosts on one machine (network namespaces, a veth pair, tbf on each end): runs COMMAND as
# rank 0 and rank 1 with torchrun's environment. The logic lives in torsh_kernels/apps/bench/emulated.py.
#
#   sudo benchmarks/emulated_hosts.sh [--rate 1gbit] [--delay 0ms] [--burst 512kb] -- COMMAND [ARGS...]
#   sudo benchmarks/emulated_hosts.sh -- .venv/bin/python benchmarks/bench_collectives.py --json out.json
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"; else py=python3; fi
fi
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m torsh_kernels.apps.bench.emulated "$@"
