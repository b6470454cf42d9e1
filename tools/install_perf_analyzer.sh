#!/usr/bin/env bash
# Install Triton's perf_analyzer into a virtualenv, without apt and without touching site-packages:
# the binary ships only in tritonclient 2.41.0's manylinux1 wheel (newer wheels are pure Python);
# its libb64 and libcudart come from the nvidia-pytriton wheel's bundled libraries, via symlinks.
# Usage: tools/install_perf_analyzer.sh [VENV]   (default .venv) → VENV/bin/perf_analyzer
set -euo pipefail
venv=$(realpath "${1:-.venv}")
python="$venv/bin/python"
home="$venv/opt/perf_analyzer"
rm -rf "$home" && mkdir -p "$home/lib"
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --isolated --quiet --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
  --python-version 3.11 tritonclient==2.41.0 -d "$tmp"
"$python" - "$tmp" "$home" <<'PY'
import sys, zipfile, glob, os
wheel = glob.glob(f"{sys.argv[1]}/tritonclient-2.41.0-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    data = z.read("tritonclient-2.41.0.data/data/bin/perf_analyzer")
target = os.path.join(sys.argv[2], "perf_analyzer")
with open(target, "wb") as f:
    f.write(data)
os.chmod(target, 0o755)
PY
libs=$("$python" -c "import importlib.util, pathlib; s = importlib.util.find_spec('pytriton'); print(pathlib.Path(list(s.submodule_search_locations)[0]).parent / 'nvidia_pytriton.libs')")
ln -s "$(ls "$libs"/libb64-*.so.0d)" "$home/lib/libb64.so.0d"
ln -s "$(ls "$libs"/libcudart-*.so.12*)" "$home/lib/libcudart.so.12"
cat > "$venv/bin/perf_analyzer" <<SH
#!/usr/bin/env bash
LD_LIBRARY_PATH="$home/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$home/perf_analyzer" "\$@"
SH
chmod +x "$venv/bin/perf_analyzer"
echo "installed $venv/bin/perf_analyzer"
