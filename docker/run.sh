#!/usr/bin/env bash
# Serve a model repository with the NGC Triton image (docker build -t triton-classifier -f docker/Dockerfile .):
#   docker/run.sh [REPOSITORY [DOCKER_RUN_OPTION ...]]      e.g. docker/run.sh model_repository -d --name t
# Like serve-repo: a GPU and the GPU flags only when nvidia-smi sees a GPU, so CPU repositories work too
# (docker/compose.yaml always reserves a GPU). docker/test.sh starts its container through this script.
# --http-max-input-size: = docker/Dockerfile's CMD, which says why.
set -euo pipefail
repo=$(realpath "${1:-model_repository}")
shift $(($# > 0 ? 1 : 0))
gpu=()
flags=()
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu=(--gpus all)
  # = server/triton.py GPU_FLAGS and compose.yaml's command (tests/test_container_files.py checks).
  flags=(--cuda-memory-pool-byte-size=0:536870912
         --backend-config=python,shm-default-byte-size=67108864
         --backend-config=python,shm-growth-byte-size=67108864)
  # The pool is per GPU: every GPU the container sees gets one, not only GPU 0.
  for ((i = 1; i < $(nvidia-smi -L | wc -l); i++)); do flags+=(--cuda-memory-pool-byte-size=$i:536870912); done
fi
# --shm-size: the python backend's stubs exchange tensors through /dev/shm (Docker's default is 64 MB).
# ${a[@]+"${a[@]}"}: an empty array under `set -u` on bash < 4.4 (macOS) would be an error.
exec docker run --rm ${gpu[@]+"${gpu[@]}"} --shm-size=2g --ulimit memlock=-1 \
  -p 8000:8000 -p 8001:8001 -p 8002:8002 -v "$repo":/models:ro "$@" "${IMAGE:-triton-classifier}" \
  tritonserver --model-repository=/models --http-max-input-size=16777216 ${flags[@]+"${flags[@]}"}
