#!/usr/bin/env bash
# A Python for the python backend's stubs where the machine's own has NumPy 2 (python_backend r24.10's stub reads
# NumPy 1.x's ABI: with NumPy 2 every answer comes back empty). It is a venv of the machine's python3 ($PYTHON,
# default python3) whose own site-packages hold PACKAGES (tools/gpu_carry.sh's stub/: numpy 1.26 and ts) and then,
# through a .pth, every site-packages folder that python3 reads: numpy 1.x ahead of the machine's numpy 2, the
# machine's torch, torchvision and the rest after it. Prints TARGET/bin/python3 and its numpy's version: give that
# python3 to serve-repo as --stub-python or $SERVE_REPO_STUB_PYTHON.
# Usage: tools/stub_env.sh PACKAGES TARGET
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: tools/stub_env.sh PACKAGES TARGET" >&2
  exit 2
fi
python=${PYTHON:-python3}
rm -rf "$2"
# --without-pip: ensurepip may be missing (Debian, Ubuntu), nothing needs it. Without the venv module, the same by
# hand: a venv is its pyvenv.cfg, its bin/python3 and its site-packages.
if ! "$python" -m venv --without-pip "$2" 2>/dev/null; then
  base=$("$python" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')
  short=$("$python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')
  rm -rf "$2"
  mkdir -p "$2/bin" "$2/lib/$short/site-packages"
  ln -s "$base" "$2/bin/python3"
  printf 'home = %s\ninclude-system-site-packages = false\n' "$(dirname "$base")" > "$2/pyvenv.cfg"
fi
site=$("$2/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -r "$1"/. "$site"/
# addsitedir, not a plain path line: the machine's own .pth files are read too, after ours (-I: as the stub sees it).
"$python" -I -c 'import sys
for path in sys.path:
    if path.endswith(("site-packages", "dist-packages")):
        print(f"import site; site.addsitedir({path!r})")' > "$site/zz_machine_site_packages.pth"
"$2/bin/python3" -I -c 'import numpy, sys; print(sys.prefix + "/bin/python3", "numpy", numpy.__version__)'
