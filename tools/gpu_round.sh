#!/usr/bin/env bash
# The GPU round as the GPU machine runs it -- the one command of docs/performance.md ("The GPU round"), and the
# suite's dry run in that machine's environment (tests/test_gpu_round.py: PYTHON = perf.gpu.standin's python3).
#   1. the carry (tools/gpu_carry.sh: carry.tar.xz, or its folders site/ and stub/) unpacked
#   2. the stubs' Python: tools/stub_env.sh -- numpy 1.26 and ts ahead of the machine's site-packages (its numpy 2
#      would make every served answer empty: python_backend r24.10), named by $SERVE_REPO_STUB_PYTHON
#   3. python -m perf.gpu.round --out OUT, with the carried site/ first on PYTHONPATH
# Usage: tools/gpu_round.sh OUT [perf.gpu.round's flags]
# Environment: PYTHON (the machine's python3; default python3), GPU_CARRY (default .gpucarry), GPU_ROUND_WORK
# (where the carry is unpacked and the stubs' Python made; default /tmp/gpu-round-env).
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: tools/gpu_round.sh OUT [perf.gpu.round's flags]" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
out=$1
shift
python=${PYTHON:-python3}
carry=${GPU_CARRY:-.gpucarry}
work=${GPU_ROUND_WORK:-/tmp/gpu-round-env}
mkdir -p "$work"
if [ -f "$carry/carry.tar.xz" ]; then
  rm -rf "$work/carry"
  mkdir "$work/carry"
  tar -C "$work/carry" -xJf "$carry/carry.tar.xz"
  carry=$work/carry
fi
if [ ! -d "$carry/site" ] || [ ! -d "$carry/stub" ]; then
  echo "gpu_round: no carry in $carry (tools/gpu_carry.sh makes it)" >&2
  exit 1
fi
carry=$(cd "$carry" && pwd)
PYTHON=$python tools/stub_env.sh "$carry/stub" "$work/stub-python"
export SERVE_REPO_STUB_PYTHON=$work/stub-python/bin/python3
export PYTHONPATH=$carry/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=$carry/site/bin:$PATH
export PYTHONUNBUFFERED=1
exec "$python" -m perf.gpu.round --out "$out" "$@"
