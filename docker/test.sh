#!/usr/bin/env bash
# Run the test suite against NVIDIA's container: build the test repository, build and start the image,
# wait until ready, run pytest through TRITON_URL, stop the container whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
repo=$(mktemp -d)/model_repository
kind=cpu
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=gpu; fi
# The two models tests/conftest.py builds for its own server.
.venv/bin/build-repo --model resnet18 --weights random --seed 0 --output "$repo" --kind "$kind" \
  --max-batch-size 8 --max-queue-delay-us 2000
.venv/bin/build-repo --model resnet152 --weights random --seed 0 --output "$repo" --kind "$kind" --max-batch-size 8
docker build -t triton-classifier -f docker/Dockerfile .
name=triton-classifier-test-$$
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
docker run -d --name "$name" $([ "$kind" = gpu ] && echo --gpus all) --shm-size=2g \
  -p 8000:8000 -p 8001:8001 -p 8002:8002 -v "$repo":/models:ro triton-classifier \
  tritonserver --model-repository=/models
for _ in $(seq 300); do
  curl -sf localhost:8000/v2/health/ready && break
  sleep 2
done
curl -sf localhost:8000/v2/health/ready || { docker logs "$name" | tail -50; exit 1; }
TRITON_URL=localhost:8000 TRITON_GRPC_URL=localhost:8001 .venv/bin/python -m pytest -q "$@"
