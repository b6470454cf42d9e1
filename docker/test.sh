#!/usr/bin/env bash
# Run the test suite against NVIDIA's container instead of the embedded server: build the repository
# tests/conftest.py builds, build the image, start it (docker/run.sh), wait until ready, run pytest
# through TRITON_URL / TRITON_GRPC_URL, remove the container whatever happens. Extra args go to pytest.
# Written for a machine with a docker engine; ours have none (docker/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
kind=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=gpu; fi
work=$(mktemp -d)
repo=$work/model_repository
name=triton-classifier-test-$$
trap 'docker rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
# The two models of tests/conftest.py's `repository` fixture (same seed, so the same weights; fp32,
# so that served rows compare with eager torch within 1e-4).
.venv/bin/build-repo --model resnet18 --weights random --seed 0 --output "$repo" --kind "$kind" \
  --precision fp32 --max-batch-size 8 --max-queue-delay-us 2000
.venv/bin/build-repo --model resnet152 --weights random --seed 0 --output "$repo" --kind "$kind" \
  --precision fp32 --max-batch-size 8
docker build -t triton-classifier -f docker/Dockerfile .
docker/run.sh "$repo" -d --name "$name" >/dev/null
# Keep the log outside the container: run.sh uses --rm, so a server that dies takes its log with it.
docker logs -f "$name" >"$work/server.log" 2>&1 &
ready() { curl -sf localhost:8000/v2/health/ready >/dev/null; }
for _ in $(seq 300); do   # up to 10 minutes: ResNet-152 load (+ CUDA graph capture on a GPU)
  ready && break
  docker inspect "$name" >/dev/null 2>&1 || break   # the container exited: stop waiting
  sleep 2
done
ready || { echo "container not ready; server log:" >&2; tail -50 "$work/server.log" >&2; exit 1; }
TRITON_URL=localhost:8000 TRITON_GRPC_URL=localhost:8001 .venv/bin/python -m pytest -q "$@"
