"""Find the tritonserver bundled in the nvidia-pytriton wheel and lay out its python backend."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from server.errors import ServerError


def pytriton_root() -> Path:
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
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton ships no python backend stub for Python {version}")
    python = into / "python"
    python.mkdir(parents=True)
    for source in (root / "backends/python/libtriton_python.so",
                   root / "backends/python/triton_python_backend_utils.py", stub):
        (python / source.name).symlink_to(source)
    return into
