#!/usr/bin/env bash
# Probe the GPU machine: versions, the 3.12 stub's libpython, tritonserver on the GPU, raw speeds.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
which python3; python3 -V; nproc; free -g | head -2
python3 -c "import torch,torchvision,sys;print(torch.__version__, torchvision.__version__, torch.cuda.get_device_name(0), torch.version.cuda, torch.backends.cudnn.version(), sys.prefix, sys.base_prefix)"
python3 -c "import sysconfig;print(sysconfig.get_config_var('LIBDIR'), sysconfig.get_config_var('INSTSONAME'))"
ldconfig -p | grep -i libpython
S=/tmp/site/pytriton/tritonserver
ldd $S/python_backend_stubs/3.12/triton_python_backend_stub | grep -E "python|not found"
ldd $S/bin/tritonserver | grep "not found"
python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"
python3 -m pip list 2>/dev/null | grep -iE "grpc|protobuf|numpy|pillow|gevent|rapidjson|nvidia-nvjpeg|nvjpeg"
timeout 300 python3 bench/gpu/probe_speed.py
