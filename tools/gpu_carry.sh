#!/usr/bin/env bash
# What the bare GPU machine lacks for `tools/gpu_round.sh` (it has torch and numpy 2, no package registry), made
# here from the package registry, for its Python (3.12 by default):
#   DIR/site/   for the round's own processes (PYTHONPATH): nvidia-pytriton (tritonserver; only the stub of this
#               Python is kept), tritonclient and its HTTP client (geventhttpclient, gevent, greenlet,
#               python-rapidjson, zope.event, zope.interface, brotli), protobuf new enough for tritonclient's
#               generated code, torch-model-archiver, TorchServe's ts (as in stub/)
#   DIR/stub/   for the python backend's stubs (tools/stub_env.sh puts it ahead of the machine's site-packages):
#               numpy 1.26 (python_backend r24.10's stub reads NumPy 1.x's ABI: with NumPy 2 every answer is
#               empty), TorchServe's ts package from this venv without its Java frontend (handler models)
# By default packed as DIR/carry.tar.xz (about 40 MB: a device call carries 64 MiB with the tree) and the folders
# removed; --no-pack keeps the folders (the suite's stand-in for the GPU machine: tests/gpu_image.py).
# Usage: tools/gpu_carry.sh [--python-version 3.12] [--out .gpucarry] [--no-pack]      (after make setup)
set -euo pipefail
cd "$(dirname "$0")/.."
version=3.12
out=.gpucarry
pack=1
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) version=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-pack) pack=0; shift ;;
    *) echo "usage: tools/gpu_carry.sh [--python-version X.Y] [--out DIR] [--no-pack]" >&2; exit 2 ;;
  esac
done
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
           manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
pip=(python3 -m pip --isolated --disable-pip-version-check)
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
  "${platforms[@]}" -d "$wheels" \
  nvidia-pytriton==0.7.0 tritonclient==2.73.0 protobuf==6.33.6 torch-model-archiver==0.12.0 \
  geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 python-rapidjson==1.25 zope.event==6.2 zope.interface==8.7 \
  brotli==1.2.1 numpy==1.26.4
rm -rf "$out/site" "$out/stub" "$out/carry.tar.xz"
mkdir -p "$out"
install=("${pip[@]}" install --root-user-action=ignore --quiet --no-deps --no-compile --only-binary=:all: --python-version "$version"
         --implementation cp "${platforms[@]}")
"${install[@]}" --target "$out/site" $(ls "$wheels"/*.whl | grep -v /numpy-)
"${install[@]}" --target "$out/stub" "$wheels"/numpy-*.whl
# Only this Python's stub: the others (and 3.13's bundled libpython, 14 MB) are of no use there.
stubs="$out/site/pytriton/tritonserver/python_backend_stubs"
find "$stubs" -mindepth 1 -maxdepth 1 ! -name "$version" -exec rm -rf {} +
[ "$version" = 3.13 ] || rm -f "$out"/site/nvidia_pytriton.libs/libpython3-*.13.so.*
rm -rf "$out/site/include" "$out/stub/bin" "$out/stub/numpy/tests" "$out"/stub/numpy/*/tests
ts_dir=$(.venv/bin/python -c 'import os, ts; print(os.path.dirname(ts.__file__))')
for part in site stub; do  # ts for the round's own processes too (tests compare handlers in-process)
  cp -r "$ts_dir" "$out/$part/ts"
  rm -rf "$out/$part/ts/frontend"
done
# Console scripts name the Python that installed them (this machine's): there, the first python3 on PATH.
sed -i '1s|^#!.*python.*$|#!/usr/bin/env python3|' "$out"/site/bin/*
find "$out" -name __pycache__ -prune -exec rm -rf {} +
if [ "$pack" = 1 ]; then
  tar -C "$out" -cJf "$out/carry.tar.xz" site stub
  rm -rf "$out/site" "$out/stub"
fi
du -sh "$out"
