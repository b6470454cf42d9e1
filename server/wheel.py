"""Find the tritonserver bundled in the nvidia-pytriton wheel (or the one $SERVE_REPO_TRITONSERVER names) and lay
out its python backend."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from server.errors import ServerError

# A Triton installation to run instead of the wheel's: NVIDIA's container sets it to /opt/tritonserver
# (docker/Dockerfile), whose python backend has its stub beside libtriton_python.so, built for the image's python3.
ENV = "SERVE_REPO_TRITONSERVER"


def pytriton_root() -> Path:
    """The folder holding bin/tritonserver and backends/python/: $SERVE_REPO_TRITONSERVER, else the wheel's."""
    if os.environ.get(ENV):
        root = Path(os.environ[ENV])
        if not (root / "bin" / "tritonserver").is_file():
            raise ServerError(f"${ENV}={root}: no tritonserver binary at {root / 'bin' / 'tritonserver'}")
        return root
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed: `pip install nvidia-pytriton==0.7.0` (make setup does)")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise ServerError(f"no tritonserver binary at {root / 'bin' / 'tritonserver'}")
    return root


def make_backend_dir(root: Path, into: Path) -> Path:
    """Assemble <into>/python/ from symlinks: the python backend wants its stub beside it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    # The wheel ships a stub per Python; an installation such as NVIDIA's one, beside the backend.
    stubs = [root / "python_backend_stubs" / version / "triton_python_backend_stub",
             root / "backends" / "python" / "triton_python_backend_stub"]
    stub = next((path for path in stubs if path.is_file()), None)
    if stub is None:
        raise ServerError(f"{root} has no python backend stub for Python {version}")
    python = into / "python"
    python.mkdir(parents=True)
    for source in (root / "backends/python/libtriton_python.so",
                   root / "backends/python/triton_python_backend_utils.py", stub):
        (python / source.name).symlink_to(source)
    return into
