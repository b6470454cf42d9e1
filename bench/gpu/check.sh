#!/usr/bin/env bash
# GPU machine, one call: the GPU tests, then a short bench on resnet18 to check the bench end to end.
source bench/gpu/setup.sh
df -h /dev/shm | tail -1
timeout 280 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_gpu_options.py $EXTRA_TESTS 2>&1 | tail -30
timeout 250 python3 -m clients.gpu_bench --model resnet18 --variants fp16:1 fp32:0 --concurrency 1 64 \
  --seconds 3 --output $OUT/check-resnet18.json 2>&1 | grep -v "^I1\|^W1" | tail -30
