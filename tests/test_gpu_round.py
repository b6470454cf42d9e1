"""perf.gpu.round, the GPU round's one command, without a GPU (here, CI): its dry run (the CPU standing in) runs
every step and writes the figures under their stable keys; without --dry-run it records the environment and
skips the GPU steps with a reason, and survives a step that overruns; tools/unpack_wheels.sh, which the GPU
machine runs first; and the backends' faulthandler, which puts a crashed stub's stack into the log it reads."""
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from perf.gpu.round import HEADLINE, RESULT
from perf.gpu.steps import STEPS

ROOT = Path(__file__).resolve().parent.parent
GPU_STEPS = [name for name, (_, _, needs_cuda) in STEPS.items() if needs_cuda]
KEYS = ("device", "served_images_per_s", "served_over_inprocess", "jpeg_images_per_s", "jpeg_over_tensor",
        "gpu_tests_passed", "gpu_tests_failed")
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="with a GPU the steps run for real: the command's job, not a test's")


def _round(out: Path, *args: str, timeout: float = 120) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "perf.gpu.round", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert (out / "round.json").is_file(), done.stdout + done.stderr
    return done.returncode, json.loads((out / "round.json").read_text())


def test_dry_run_runs_every_step_and_writes_the_figures_when_the_cpu_stands_in(tmp_path):
    status, report = _round(tmp_path / "out", "--dry-run", timeout=600)
    assert status == 0, {name: outcome.get("reason") for name, outcome in report["steps"].items()}
    assert list(report["steps"]) == list(STEPS) and report["dry_run"] is True
    assert all(outcome["status"] == "ok" for outcome in report["steps"].values())
    # DIR stays a handful of files (a device call returns 8): the logs are packed.
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == sorted([*HEADLINE, "logs.tar.gz"])
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as archive:
        packed = set(archive.getnames())
    assert {f"logs/{step}.log" for step in STEPS} <= packed and "logs/bench.json" in packed
    figures = json.loads((tmp_path / "out" / RESULT).read_text())
    assert figures["dry_run"] is True and figures["device"] == "cpu"
    for key in KEYS[1:5]:
        assert figures[key] > 0, key
    # The tests ran under pytest and were counted (a dry run runs one small file of them).
    assert figures["gpu_tests_failed"] == 0 and figures["gpu_tests_passed"] > 0
    assert "passed" in (tmp_path / "out" / "gpu_tests.txt").read_text()
    # Every served point's answers were read and checked (perf.gpu.bench counts a wrong one as an error).
    bench = figures["bench"]
    assert bench["jpeg_model"] == "fused" and [p["decode"] for p in bench["jpeg"]] == ["gpu", "cpu"]
    for point in bench["tensor"][0]["points"] + bench["jpeg"]:
        assert point["requests"] > 0 and point["errors"] == 0, point["first_error"]
        assert point["avg_batch"] >= 1  # Triton's statistics of the model that ran the batches
    io = report["steps"]["instance_io"]["details"]
    assert io["answers_right"] == list(io["variants"])
    assert [p["instances"] for p in figures["instances"]] == [2]
    assert report["steps"]["compile"]["details"]["points"]


@no_gpu_only
def test_round_records_environment_and_skips_gpu_steps_when_there_is_no_cuda(tmp_path):
    status, report = _round(tmp_path / "out", "--steps", "environment", *GPU_STEPS)
    assert status == 0
    assert list(report["steps"]) == ["environment", *GPU_STEPS] and report["cuda"]["available"] is False
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
    figures = json.loads((tmp_path / "out" / RESULT).read_text())
    assert all(key in figures for key in KEYS) and figures["served_images_per_s"] is None  # not measured


@no_gpu_only
def test_round_fails_that_step_and_runs_the_next_when_a_step_overruns(tmp_path):
    status, report = _round(tmp_path / "out", "--steps", "environment", "parity", "--timeout-s", "1")
    assert status == 1
    environment = report["steps"]["environment"]
    assert environment["status"] == "failed" and environment["reason"] == "timed out after 1 s"
    assert environment["seconds"] < 15  # SIGTERM stopped it; the SIGKILL grace was not needed
    assert "python" in environment["details"]  # what it learned before the limit is kept
    assert report["steps"]["parity"]["status"] == "skipped"
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as archive:
        log = archive.extractfile("logs/environment.log").read().decode()
    assert "TimeLimit" in log


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
    stub killed by a fatal signal leaves no stack in tritonserver's log for perf.gpu.round to show."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import faulthandler; "
            "from backends.triton_io import honor_faulthandler; before = faulthandler.is_enabled(); "
            "honor_faulthandler(); print(before, faulthandler.is_enabled())")
    done = subprocess.run([sys.executable, "-I", "-c", code], env={**variable, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", enabled], done.stderr
