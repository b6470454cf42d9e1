"""How the CUDA driver library resolves here, and a folder that makes its unversioned name resolve."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

NAMES = ("libcuda.so", "libcuda.so.1")


def _ldconfig_lines() -> list[str]:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"  # /sbin is often not on a user's PATH
    try:
        listing = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"ldconfig -p failed: {exc}"]
    return [line.strip() for line in listing.splitlines() if "libcuda.so" in line]


def _mapped() -> list[str]:
    """Files named libcuda* mapped into this process (where dlopen really found them)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps if "/libcuda" in line.split()[-1]})


def report() -> dict:
    """`ldconfig -p` lines for libcuda, whether each name dlopens, and the file it maps.

    python_backend r24.10 dlopens the unversioned "libcuda.so" for GPU output tensors and does not check
    the result (src/pb_utils.cc); a driver install may provide only libcuda.so.1 (what CUDA's runtime uses)."""
    loads = {}
    for name in NAMES:
        try:
            ctypes.CDLL(name)
            loads[name] = "loads"
        except OSError as exc:
            loads[name] = f"does not load: {exc}"
    return {"ldconfig": _ldconfig_lines(), "dlopen": loads, "mapped": _mapped(),
            "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH", "")}


def unversioned_link_dir(folder: Path | None = None) -> Path:
    """`folder` (default: a new temporary one) holding `libcuda.so -> <the libcuda.so.1 this process loads>`,
    for LD_LIBRARY_PATH.

    Raises OSError when libcuda.so.1 cannot be loaded here (no driver)."""
    ctypes.CDLL("libcuda.so.1")
    target = next((path for path in _mapped() if Path(path).name.startswith("libcuda.so")), None)
    if target is None:
        raise OSError("libcuda.so.1 loaded but /proc/self/maps does not name its file")
    folder = Path(folder) if folder else Path(tempfile.mkdtemp(prefix="libcuda-link-"))
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "libcuda.so"
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return folder


def _loads(name: str) -> bool:
    try:
        ctypes.CDLL(name)
        return True
    except OSError:
        return False


def stub_library_path(folder: Path, library_path: str) -> str | None:
    """LD_LIBRARY_PATH for tritonserver's python stubs where the driver lacks the unversioned libcuda.so, with
    `folder` (made here, holding that link) first; None where libcuda.so loads already or there is no driver.

    python_backend r24.10 dlopens "libcuda.so" for the first GPU output tensor and does not check that it
    loaded (src/pb_utils.cc): a driver install with only libcuda.so.1 would crash the stub there."""
    if _loads("libcuda.so"):
        return None
    try:
        unversioned_link_dir(folder)
    except OSError:
        return None  # no driver: nothing on the GPU to hand over
    return os.pathsep.join(filter(None, [str(folder), library_path]))
