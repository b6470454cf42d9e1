#!/usr/bin/env bash
# Serve ./model_repository (or $1) with NVIDIA's Triton container; GPUs are used when present.
set -euo pipefail
repo=$(realpath "${1:-model_repository}")
image=${IMAGE:-triton-classifier}
gpus=()
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpus=(--gpus all); fi
exec docker run --rm "${gpus[@]}" --shm-size=2g -p 8000:8000 -p 8001:8001 -p 8002:8002 \
  -v "$repo":/models:ro "$image" tritonserver --model-repository=/models \
  --cuda-memory-pool-byte-size=0:536870912 --backend-config=python,shm-default-byte-size=67108864
