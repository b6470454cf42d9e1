#!/usr/bin/env bash
# What the bare GPU machine lacks for `python -m perf.gpu.round` (it has torch, no package registry), made here:
#   .whl/      wheels for its Python 3.12: nvidia-pytriton (tritonserver), tritonclient and its HTTP client's
#              wheels, protobuf new enough for tritonclient's generated code, torch-model-archiver
#   .gpusite/  TorchServe's ts package from this venv without its Java frontend (0.3 MB instead of 45 MB)
# Both are git-ignored (.git/info/exclude) and travel only when a device call names them in `carry`
# (about 62 MB together, under the 64 MiB transfer). The call's command: docs/performance.md, "The GPU round".
# Usage: tools/gpu_carry.sh        (after make setup; needs the package registry)
set -euo pipefail
cd "$(dirname "$0")/.."
for path in /.whl/ /.gpusite/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
rm -rf .whl .gpusite
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
           manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --isolated --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  nvidia-pytriton==0.7.0 tritonclient==2.73.0 protobuf==6.33.6 torch-model-archiver==0.12.0 \
  geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 python-rapidjson==1.25 zope.event==6.2 zope.interface==8.7 \
  brotli==1.2.1
ts_dir=$(.venv/bin/python -c 'import os, ts; print(os.path.dirname(ts.__file__))')
mkdir .gpusite
cp -r "$ts_dir" .gpusite/ts
rm -rf .gpusite/ts/frontend
find .gpusite -name __pycache__ -prune -exec rm -rf {} +
du -sh .whl .gpusite
