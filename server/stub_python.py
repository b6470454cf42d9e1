"""The Python that the python backend's stubs run in, checked before tritonserver starts.

The stub (python_backend r24.10, in nvidia-pytriton 0.7.0) embeds libpython and finds its prefix, so its
site-packages, through the first `python3` on the PATH that tritonserver gets; its interpreter is isolated
(PYTHONPATH is not read). It is built with pybind11 < 2.12, which reads NumPy 1.x's array ABI: with NumPy 2
there every FP32 output reaches the client empty and a BYTES input reaches the stub as garbage, while Triton
says ready. Upstream fixed it after r24.10 (python_backend PR #384). So serve-repo refuses to start where the
stubs' Python has NumPy >= 2 or none, in one line that names the interpreter, the version and the fix.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from server.errors import ServerError

ENV = "SERVE_REPO_STUB_PYTHON"  # serve-repo --stub-python's default: the GPU machine's recipe sets it
# What the stub reads: its isolated interpreter (-I: no PYTHONPATH, no user site, no script folder on sys.path).
_PROBE = "import numpy; print(numpy.__version__)"
_checked: dict[tuple, str] = {}  # (interpreter, its mtime) -> numpy version: restarts do not ask again
# Where the stub's libpythonX.Y.so.1.0 lives: the stub links it by name, so the loader must find it.
_LIBPYTHON = "import sysconfig as s; print(s.get_config_var('LIBDIR')); print(s.get_config_var('INSTSONAME'))"
_SYSTEM_LIBS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64")  # the loader's own folders (ld.so.cache)
_libdirs: dict[str, dict] = {}


def resolve_stub_python(given: str | os.PathLike | None = None) -> Path:
    """The `python3` the stubs will find first on PATH: `given`, else $SERVE_REPO_STUB_PYTHON, else this
    interpreter's (a venv's bin/ holds one)."""
    chosen = given or os.environ.get(ENV)
    if chosen:
        return Path(os.path.abspath(chosen))  # not resolved: a venv's python3 is a link out of the venv
    return Path(sys.executable).parent / "python3"


def stub_path(python: Path, path: str) -> str:
    """PATH for tritonserver: `python`'s folder first, where the stub looks for `python3`."""
    return os.pathsep.join([str(python.parent), path])


def check_stub_python(python: Path, env: dict) -> str:
    """NumPy's version in the stubs' Python, or a ServerError in one line saying why the stubs cannot run there."""
    found = shutil.which("python3", path=env.get("PATH", ""))
    if python.name != "python3" or found is None or Path(found) != python:
        raise ServerError(f"the python backend's stubs take the first `python3` on PATH, which would be {found}, "
                          f"not {python}: name a python3 (e.g. VENV/bin/python3) with --stub-python or ${ENV}")
    key = (str(python), python.stat().st_mtime if python.exists() else None)
    if key in _checked:
        return _checked[key]
    try:
        done = subprocess.run([str(python), "-I", "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServerError(f"the stubs' Python {python} did not run: {exc}") from None
    version = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
    fix = (f"give the stubs a Python with numpy<2 (`{python} -m pip install 'numpy<2'`, or a venv of its own "
           f"named by --stub-python / ${ENV}; tools/stub_env.sh makes one)")
    if version is None:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise ServerError(f"the python backend's stubs would run {python} without numpy ({why}); {fix}")
    if int(version.split(".")[0]) >= 2:
        raise ServerError(f"the python backend's stubs would run {python} with numpy {version}: python_backend "
                          "r24.10's stub (nvidia-pytriton 0.7.0) reads NumPy 1.x's ABI, so every answer would come "
                          f"back empty (fixed upstream after r24.10, python_backend PR #384); {fix}")
    _checked[key] = version
    return version


def libpython_env(python: Path, env: dict) -> dict:
    """{"LD_LIBRARY_PATH": ...} with the stubs' Python's shared libpython folder added where the loader would not
    find it (pyenv, a --prefix build: the stub exits "libpython3.10.so.1.0: cannot open shared object file" and
    the model never loads); {} for a system Python, or one with no shared libpython (nothing to point at)."""
    if str(python) not in _libdirs:
        try:
            done = subprocess.run([str(python), "-I", "-c", _LIBPYTHON], env=env, capture_output=True, text=True,
                                  timeout=120)
            libdir, soname = done.stdout.split()[:2] if done.returncode == 0 else ("", "")
        except (OSError, subprocess.TimeoutExpired, ValueError):
            libdir, soname = "", ""
        found = libdir and soname != "None" and (Path(libdir) / soname).is_file()
        system = not found or any(libdir == d or libdir.startswith(d + "/") for d in _SYSTEM_LIBS)
        _libdirs[str(python)] = {} if system else {"LD_LIBRARY_PATH": libdir}
    added = _libdirs[str(python)].get("LD_LIBRARY_PATH")
    if not added or added in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        return {}
    return {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [env.get("LD_LIBRARY_PATH", ""), added]))}
