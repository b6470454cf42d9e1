"""perf.gpu_diagnose without a GPU (here, CI): it records the environment, skips the GPU steps with a
reason, survives a step that overruns; tools/unpack_wheels.sh, which the GPU machine runs first; and
the backends' faulthandler, which puts a crashed stub's stack into the log the diagnosis reads."""
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from perf.gpu_steps import STEPS

ROOT = Path(__file__).resolve().parent.parent
GPU_STEPS = [name for name, (_, _, needs_cuda) in STEPS.items() if needs_cuda]
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="with a GPU the steps run for real: the command's job, not a test's")


def _diagnose(out: Path, *args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "perf.gpu_diagnose", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, json.loads((out / "diagnose.json").read_text())


@no_gpu_only
def test_gpu_diagnose_records_environment_and_skips_gpu_steps_when_there_is_no_cuda(tmp_path):
    status, report = _diagnose(tmp_path / "out", "--steps", *STEPS)
    assert status == 0
    assert list(report["steps"]) == list(STEPS) and report["cuda"]["available"] is False
    environment = report["steps"]["environment"]
    assert environment["status"] == "ok", environment.get("reason")
    details = environment["details"]
    assert details["python"] == sys.version.split()[0] and details["torch"] == torch.__version__
    assert details["cuda_available"] is False and details["cpu"]
    assert set(details["libcuda"]["dlopen"]) == {"libcuda.so", "libcuda.so.1"}
    # The stub for this Python, resolved through the wheel, and what ldd says it links.
    assert details["stub"].endswith(f"{sys.version_info.major}.{sys.version_info.minor}/triton_python_backend_stub")
    assert any("libpython" in line and "=>" in line for line in details["stub_ldd"])
    for name in GPU_STEPS:
        assert report["steps"][name]["status"] == "skipped"
        assert report["steps"][name]["reason"].startswith("no CUDA")
    assert (tmp_path / "out" / "environment.log").is_file()
    assert not list((tmp_path / "out").glob("*.result.json"))  # collected into diagnose.json


@no_gpu_only
def test_gpu_diagnose_fails_that_step_and_runs_the_next_when_a_step_overruns(tmp_path):
    status, report = _diagnose(tmp_path / "out", "--steps", "environment", "parity", "--timeout-s", "1")
    assert status == 1
    environment = report["steps"]["environment"]
    assert environment["status"] == "failed" and environment["reason"] == "timed out after 1 s"
    assert environment["seconds"] < 15  # SIGTERM stopped it; the SIGKILL grace was not needed
    assert "python" in environment["details"]  # what it learned before the limit is kept
    assert report["steps"]["parity"]["status"] == "skipped"
    assert "TimeLimit" in (tmp_path / "out" / "environment.log").read_text()


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel holding one module, `name`."""
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}.py": "VALUE = 42\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
        archive.writestr(f"{info}/RECORD", "".join(f"{member},,\n" for member in [*files, f"{info}/RECORD"]))
    return path


def test_unpack_wheels_installs_every_wheel_into_target_when_given_a_folder(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("carried_one", "carried_two"):
        _wheel(wheels, name)
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([str(ROOT / "tools" / "unpack_wheels.sh"), str(wheels), str(tmp_path / "site")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check = subprocess.run([sys.executable, "-c", "import carried_one, carried_two; print(carried_one.VALUE)"],
                           env={"PYTHONPATH": str(tmp_path / "site")}, capture_output=True, text=True)
    assert check.stdout.strip() == "42", check.stderr


def test_unpack_wheels_exits_with_usage_when_arguments_are_missing(tmp_path):
    done = subprocess.run([str(ROOT / "tools" / "unpack_wheels.sh"), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "usage: tools/unpack_wheels.sh WHEEL_DIR TARGET" in done.stderr
    empty = subprocess.run([str(ROOT / "tools" / "unpack_wheels.sh"), str(tmp_path), str(tmp_path / "site")],
                           capture_output=True, text=True)
    assert empty.returncode == 1 and "no *.whl" in empty.stderr


@pytest.mark.parametrize("variable, enabled", [({"PYTHONFAULTHANDLER": "1"}, "True"), ({}, "False")])
def test_backend_enables_faulthandler_when_variable_is_set_for_an_isolated_stub(variable, enabled):
    """python_backend's stub embeds an isolated Python (-I: environment ignored), so without the helper a
    stub killed by a fatal signal leaves no stack in tritonserver's log for perf.gpu_diagnose to show."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import faulthandler; "
            "from backends.triton_io import honor_faulthandler; before = faulthandler.is_enabled(); "
            "honor_faulthandler(); print(before, faulthandler.is_enabled())")
    done = subprocess.run([sys.executable, "-I", "-c", code], env={**variable, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", enabled], done.stderr
