#!/usr/bin/env bash
# The GPU check: everything a lent GPU is for, prepared on the CPU, run as one script in at most two calls.
#
#   scripts/gpu_check.sh [--part 1|2|all] [--out DIR] [--dry-run]
#
# Part 1 (at most 8 minutes; about 5 where torch is already a CUDA build): the machine (nvidia-smi, torch, triton), a CUDA build of torch that matches
# the driver (the one installed when it runs on this GPU; else pip's, for the driver's CUDA version, where the
# network allows), this checkout installed (pip install -e '.[dev,cuda]'; offline, with --no-deps), and the
# kernel tests on the GPU (tests/ops, compiled kernels on CUDA tensors: no interpreter, no simulator; in 8
# processes where pytest-xdist is installed).
# Part 2 (at most 6.5 minutes): `torsh bench` at GPU sizes (bucket, compression, moe, offload: each with its
# device-copy anchor), `torsh inspect` for this GPU's architecture, and the table that puts the measured
# bandwidth (as a share of the same run's copy) beside the estimate (scripts/gpu_table.py).
#
# Every step is bounded by `timeout` and logs to $OUT (default ./gpu-out; the device tool sets OUT), so what it
# got to comes back even when a step runs out of time; a failed step is recorded and the script goes on with the
# next (the exit status says whether any failed). The device tool allows 10 minutes a call and 15 minutes in all:
# run `--part 1` and `--part 2` as two calls, or `--part all` where one call may take 15 minutes.
#
# --dry-run: check the arguments and this script's own syntax (bash -n), print the plan (each step, its bound
# and its command) and exit; runs nothing. tests/test_scripts.py runs it.
set -uo pipefail

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }

part=all
dry=0
out="${OUT:-$PWD/gpu-out}"
while [ $# -gt 0 ]; do
  case "$1" in
    --part) [ $# -ge 2 ] || { echo "gpu_check.sh: --part needs 1, 2 or all" >&2; exit 2; }; part="$2"; shift 2 ;;
    --part=*) part="${1#--part=}"; shift ;;
    --out) [ $# -ge 2 ] || { echo "gpu_check.sh: --out needs a directory" >&2; exit 2; }; out="$2"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (expected --part 1|2|all, --out DIR, --dry-run)" >&2; exit 2 ;;
  esac
done
case "$part" in 1|2|all) ;; *) echo "gpu_check.sh: --part must be 1, 2 or all, got '$part'" >&2; exit 2 ;; esac
[ -n "$out" ] || { echo "gpu_check.sh: --out must not be empty" >&2; exit 2; }
bash -n "$0" || { echo "gpu_check.sh: syntax error in the script itself" >&2; exit 2; }

cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET NUMBA_ENABLE_CUDASIM TORSH_TEST_INTERPRET

# The steps: name | part | bound in seconds | command (run with bash -c, $OUT and $PY set)
STEPS=(
  "env|1|20|nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee \$OUT/env.txt; nvidia-smi | head -n 15 >> \$OUT/env.txt; \$PY -c 'import sys, torch, triton; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available()); print(\"triton\", triton.__version__)' | tee -a \$OUT/env.txt"
  "torch|1|120|if \$PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)'; then echo 'the installed torch runs on this GPU:' \$(\$PY -c 'import torch; print(torch.__version__)'); else cu=\$(nvidia-smi | sed -n 's/.*CUDA Version: \\([0-9]*\\)\\.\\([0-9]*\\).*/cu\\1\\2/p' | head -n 1); echo \"no CUDA torch here: installing the build for the driver's CUDA (\$cu)\"; \$PY -m pip install -q torch --index-url https://download.pytorch.org/whl/\$cu; fi"
  "install|1|60|\$PY -m pip install -q --retries 0 --timeout 5 -e '.[dev,cuda]' || { echo 'the extras cannot be fetched here (offline): installing this checkout alone'; \$PY -m pip install -q --no-deps --no-build-isolation -e .; }; \$PY -c 'import torsh_kernels, sys; print(torsh_kernels.__file__); print(torsh_kernels.providers())'"
  "tests|1|270|xdist=\$(\$PY -c 'import xdist' 2>/dev/null && echo '-n 8'); \$PY -m pytest -x -q -p no:cacheprovider \$xdist tests/ops --junitxml=\$OUT/pytest-ops.xml 2>&1 | tee \$OUT/pytest-ops.log"
  "bench|2|210|\$PY -m torsh_kernels.apps.cli bench bucket compression moe offload --json \$OUT/bench-gpu.json 2>&1 | tee \$OUT/bench-gpu.log"
  "inspect|2|150|\$PY -m torsh_kernels.apps.cli inspect --arch \$(\$PY -c 'import torch; m, n = torch.cuda.get_device_capability(); print(f\"sm_{m}{n}\")') --provider triton --json \$OUT/sass.json > \$OUT/inspect.log 2>&1; tail -n 3 \$OUT/inspect.log"
  "table|2|20|\$PY scripts/gpu_table.py \$OUT/bench-gpu.json \$OUT/sass.json --json \$OUT/gpu-table.json | tee \$OUT/gpu-table.md"
)

echo "gpu_check.sh: part $part, results under $out"
failed=0
total=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name p bound cmd <<<"$step"
  [ "$part" = all ] || [ "$part" = "$p" ] || continue
  total=$((total + bound))
  if [ "$dry" = 1 ]; then
    printf '  [part %s] %-8s at most %4ss: %s\n' "$p" "$name" "$bound" "$cmd"
    bash -n <(printf '%s\n' "$cmd") || { echo "gpu_check.sh: step $name does not parse" >&2; failed=1; }
    continue
  fi
  mkdir -p "$out"
  echo "== $name (at most ${bound}s)"
  start=$(date +%s)
  OUT="$out" PY="$PY" timeout --kill-after=10 "$bound" bash -c "$cmd"
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$out/steps.txt"
  [ "$rc" -eq 0 ] || failed=1
done
if [ "$dry" = 1 ]; then
  "$PY" -m py_compile scripts/gpu_table.py || { echo "gpu_check.sh: scripts/gpu_table.py does not compile" >&2; exit 2; }
  [ "$failed" = 0 ] || exit 2
  echo "gpu_check.sh: plan ok, $total s at most for part $part (dry run: nothing was run)"
fi
exit "$failed"
