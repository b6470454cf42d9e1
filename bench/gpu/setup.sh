# Source on the GPU machine: unpack the carried wheels (nvidia-pytriton, tritonclient, python-rapidjson).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
