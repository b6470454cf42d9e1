#!/usr/bin/env bash
# One call on the GPU machine: preprocess parity, the ResNet-152 bench, the GPU tests, a python-backend probe.
source bench/gpu/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 40 python3 bench/gpu/preprocess_parity.py 2>&1 | tail -30 | tee $OUT/parity.txt
timeout 410 python3 -m perf.gpu_bench --concurrency 1 256 --seconds 5 --output $OUT/gpu-resnet152.json 2>&1 \
  | grep -v "^I1\|^W1" | tee $OUT/bench.log | tail -12
pkill -9 -f tritonserver; sleep 1
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_preprocess_gpu.py -k "gpu_image or gpu_decode or pads" 2>&1 | tail -15 | tee $OUT/tests.txt
timeout 50 python3 bench/gpu/diagnose.py gpu 2>&1 | grep -v "^I1\|^W1\|^wrote" | tee $OUT/diagnose.txt
