#!/usr/bin/env bash
# Install carried wheels into a folder without a package registry (the bare GPU machine): every *.whl in
# WHEEL_DIR, no dependencies resolved, no site-packages touched. Then put TARGET first on PYTHONPATH.
# Usage: tools/unpack_wheels.sh WHEEL_DIR TARGET      (PYTHON=python3.12 to pick the interpreter)
# e.g.   tools/unpack_wheels.sh .whl /tmp/site && PYTHONPATH=/tmp/site:$PWD python3 -m perf.gpu.round --out $OUT
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: tools/unpack_wheels.sh WHEEL_DIR TARGET" >&2
  exit 2
fi
wheels=("$1"/*.whl)
if [ ! -e "${wheels[0]}" ]; then
  echo "unpack_wheels: no *.whl in $1" >&2
  exit 1
fi
# --upgrade: a second run replaces what an earlier one put in TARGET; --no-compile: only seconds matter there.
"${PYTHON:-python3}" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$2" "${wheels[@]}"
echo "unpacked ${#wheels[@]} wheel(s) into $2 (put it first on PYTHONPATH)"
