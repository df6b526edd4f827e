#!/usr/bin/env bash
# The lean install, checked as a user gets it: build the wheel, install it with no extras in a fresh venv
# beside the CPU build of torch, run `torsh doctor` (no triton imported; it says how to get it) and `torsh demo`
# from a directory outside the source tree, and compare
# what the install brought with what torch, numba, numpy and rich bring on their own. Fails if the
# build, the install or the demo fails, or if the install brought any package beyond those five, their
# dependencies and the venv's own pip/setuptools. Prints the venv's size and each package's.
#
#   bash .ci/wheel_check.sh        (needs PyPI or the local indexes pip is set up with; a few minutes)
#
# TORCH_SPEC (default torch==2.13.0: the CPU build on disk; a looser spec pulls a multi-GB CUDA build) and
# PYTHON (default python3) may be set.
set -euo pipefail
cd "$(dirname "$0")/.."
src="$PWD"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PEERS=(numba numpy rich)  # no triton: an extra ([cuda], [dev]); it cannot run on a CPU

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
say() { printf '\n== wheel check: %s\n' "$*"; }
# pip, its warnings about this machine's index configuration (a listed local index without a page for
# a package) left out; its exit status is pip's
pip_() { "$1" -m pip "${@:2}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

say "building the wheel (pip wheel --no-deps, build isolation) from a copy of the tree"
mkdir "$tmp/src" "$tmp/dist" "$tmp/run"
# a copy, so that the build's build/ and *.egg-info do not land in the tree; the package, its data and
# what pyproject.toml names (README.md, LICENSE, NOTICE) are all the build reads
tar -C "$src" --exclude=./.git --exclude=./.venv --exclude=./build --exclude=./dist --exclude='*.egg-info' \
  --exclude=__pycache__ --exclude=./tests --exclude=./benchmarks --exclude=./docs -cf - . | tar -C "$tmp/src" -xf -
pip_ "$PY" wheel "$tmp/src" --no-deps -q -w "$tmp/dist"
whl=$(ls "$tmp"/dist/torsh_kernels-*.whl)
echo "built $(basename "$whl") ($(du -k "$whl" | cut -f1) KiB)"

say "a fresh venv: $TORCH_SPEC, then the wheel with no extras"
"$PY" -m venv "$tmp/venv"
V="$tmp/venv/bin/python"
pip_ "$V" list --format=freeze > "$tmp/base.txt"  # the venv's own (pip; setuptools before Python 3.12)
pip_ "$V" install -q "$TORCH_SPEC"
pip_ "$V" install -q "$whl"
# what a venv holding just torch, numba, numpy and rich would hold, resolved now (nothing installed)
pip_ "$V" install -q --dry-run --ignore-installed --report "$tmp/ref.json" "$TORCH_SPEC" "${PEERS[@]}"

say "what the install brought (sizes on disk, from each package's RECORD; before the demo runs)"
"$V" - "$tmp/base.txt" "$tmp/ref.json" "$tmp/venv" <<'EOF'
import importlib.metadata as md
import json
import os
import re
import sys
from pathlib import Path

base_txt, ref_json, venv = sys.argv[1:]


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def size(dist):
    total = 0
    for f in dist.files or ():
        p = Path(dist.locate_file(f))
        if p.is_file():
            total += p.stat().st_size
    return total


ref = {norm(i["metadata"]["name"]) for i in json.loads(Path(ref_json).read_text())["install"]}
base = {norm(line.split("==")[0]) for line in Path(base_txt).read_text().split() if "==" in line} - ref
dists = {norm(d.metadata["Name"]): d for d in md.distributions()}
sizes = {n: size(d) for n, d in dists.items()}
mb = lambda b: b / 2**20
rows = sorted(dists, key=lambda n: -sizes[n])
print(f"{'package':28} {'version':16} {'MB':>9}  set")
for n in rows:
    where = "torsh" if n == "torsh-kernels" else "peers" if n in ref else "venv" if n in base else "EXTRA"
    print(f"{n:28} {dists[n].version:16} {mb(sizes[n]):9.1f}  {where}")
du = sum(f.stat().st_size for f in Path(venv).rglob("*") if f.is_file() and not f.is_symlink())
peers = sum(sizes[n] for n in dists if n in ref)
print(f"\nvenv on disk: {mb(du):.0f} MB; torch + numba + numpy + rich and their dependencies "
      f"({len(ref & set(dists))} packages): {mb(peers):.0f} MB; torsh-kernels: {mb(sizes['torsh-kernels']):.2f} MB; "
      f"the venv's own ({', '.join(sorted(base & set(dists)))}): {mb(sum(sizes[n] for n in base & set(dists))):.0f} MB")
extra = sorted(set(dists) - ref - base - {"torsh-kernels"})
missing = sorted(ref - set(dists))
if missing:
    print(f"note: the reference resolution holds {missing}, which the install did not bring")
if extra:
    print(f"FAIL: the install brought packages beyond torch, numba, numpy, rich and their dependencies: {extra}")
    sys.exit(1)
print("ok: nothing beyond torch, numba, numpy, rich and their dependencies")
EOF

say "torsh demo from outside the source tree"
cd "$tmp/run"
"$V" -c "import torsh_kernels as t, importlib.metadata as m, sys; p = t.__file__
assert p.startswith(sys.prefix), p; assert t.__version__ == m.version('torsh-kernels'), t.__version__
print('torsh_kernels', t.__version__, 'from', p)"
"$V" -c "import sys, torsh_kernels as tk
from torsh_kernels.apps.cli import main
print(tk.providers()['triton'].cpu)
main(['doctor'])
assert 'triton' not in sys.modules, 'torsh doctor imported triton'" > doctor.txt
grep -qF "triton is not installed (pip install 'torsh-kernels[cuda]')" doctor.txt || { cat doctor.txt; echo "FAIL: torsh doctor does not say how to get triton" >&2; exit 1; }
echo "torsh doctor: runs without triton and says how to install it"
"$tmp/venv/bin/torsh" demo --steps 20 --compressors none,powersgd --no-progress --link none --json demo.json
"$V" -c "import json; rows = json.load(open('demo.json'))['rows']
assert [r['compressor'] for r in rows] == ['none', 'powersgd:4'], rows
assert all(0 <= r['accuracy'] <= 1 for r in rows), rows
print('demo rows:', ', '.join(f\"{r['compressor']} {r['accuracy']:.3f}\" for r in rows))"
say "passed"
