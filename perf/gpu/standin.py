"""A stand-in, here, for the GPU machine's Python: python -m perf.gpu.standin DIR [--carry C] [--numpy-wheels W].

The GPU round's dry run must reproduce the machine it stands for, not this project's venv: the GPU image's Python
has NumPy 2 (2.5.2 on 2026-11-26) and torch preinstalled, and everything else the round needs travels in
tools/gpu_carry.sh's carry. The stand-in is a venv of this venv's base interpreter (no pip) holding NumPy 2
(from W, which make setup fills) and, through a .pth, a folder of links to the packages of this venv that the GPU
image also has (IMAGE_PACKAGES: torch, torchvision, pillow, pytest, ...) -- nothing else of this venv: no numpy 1,
no tritonclient, no nvidia-pytriton, no ts, not this project. What the CPU standing in needs besides
(CPU_ONLY: OpenVINO, build-repo's CPU engine) is linked too and named so.
Prints DIR/bin/python3. tools/gpu_round.sh with PYTHON=that and GPU_CARRY=C runs the round as the GPU machine does.
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARRY = ROOT / ".venv" / "gpu-carry"  # make setup: tools/gpu_carry.sh --no-pack for this Python
NUMPY_WHEELS = ROOT / ".venv" / "gpu-image"  # make setup: a NumPy 2 wheel for this Python
# The GPU image's packages that this project's round uses (/work/.library/device/KINDS.md, read 2026-11-17; its
# numpy 2.5.2, torch 2.11, torchvision 0.26 per a session's pip list of 2026-11), by distribution name; nvidia-*
# (torch's CUDA libraries) too, but not nvidia-pytriton (carried).
IMAGE_PACKAGES = {
    "torch", "torchvision", "triton", "numpy", "pillow", "psutil", "pyyaml", "onnx", "onnxruntime", "protobuf",
    "grpcio", "pytest", "pluggy", "iniconfig", "packaging", "scikit-image", "scipy", "imageio", "tifffile",
    "lazy-loader", "networkx", "sympy", "mpmath", "jinja2", "markupsafe", "filelock", "fsspec", "typing-extensions",
    "setuptools", "flatbuffers", "tqdm", "matplotlib", "contourpy", "cycler",
    "fonttools", "kiwisolver", "pyparsing", "python-dateutil", "six", "requests", "urllib3", "idna", "certifi",
    "charset-normalizer", "opencv-python-headless", "ml-dtypes", "uvloop", "pygments",
}
CPU_ONLY = {"openvino", "openvino-telemetry"}  # build-repo --kind cpu's engine: only the CPU standing in needs it


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _top_level(dist: metadata.Distribution) -> set[str]:
    """The names a distribution puts at the top of site-packages (packages, modules, its .dist-info, .libs)."""
    names = set()
    for file in dist.files or ():
        first = file.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            names.add(first)
    return names


def build(target: Path, carry: Path = CARRY, numpy_wheels: Path = NUMPY_WHEELS) -> Path:
    wheels = sorted(numpy_wheels.glob("numpy-2*.whl"))
    if not wheels or not (carry / "site").is_dir():
        raise SystemExit(f"perf.gpu.standin: run make setup first (no NumPy 2 wheel in {numpy_wheels} or no "
                         f"{carry}/site)")
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python3"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--disable-pip-version-check", "--target", str(site), str(wheels[-1])], check=True)
    venv_site = Path(sysconfig.get_paths()["purelib"])
    farm = target / "image-packages"
    farm.mkdir()
    for dist in metadata.distributions(path=[str(venv_site)]):
        name = _norm(dist.metadata["Name"])
        if name == "numpy" or not (name in IMAGE_PACKAGES or name in CPU_ONLY or name.startswith("nvidia-")) \
                or name == "nvidia-pytriton":
            continue
        for entry in _top_level(dist):
            if (venv_site / entry).exists() and not (farm / entry).exists():
                (farm / entry).symlink_to(venv_site / entry)
    (site / "zz_image_packages.pth").write_text(f"import site; site.addsitedir({str(farm)!r})\n")
    return python


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m perf.gpu.standin", description=__doc__.split("\n\n")[0])
    p.add_argument("target", type=Path, help="the stand-in's folder (replaced).")
    p.add_argument("--carry", type=Path, default=CARRY, help=f"tools/gpu_carry.sh --no-pack's folder. Default: {CARRY}.")
    p.add_argument("--numpy-wheels", type=Path, default=NUMPY_WHEELS,
                   help=f"folder holding a NumPy 2 wheel for this Python. Default: {NUMPY_WHEELS}.")
    args = p.parse_args(argv)
    print(build(args.target.resolve(), args.carry, args.numpy_wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
