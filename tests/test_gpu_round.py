"""perf.gpu.round, the GPU round's one command, without a GPU (here, CI): its dry run runs every step, the CPU standing
in for the GPU and perf.gpu.standin for the GPU machine's Python (NumPy 2, the carry of tools/gpu_carry.sh, nothing
of this venv), through tools/gpu_round.sh as the GPU machine runs it, and writes the figures under their stable
keys; in that Python without the stubs' environment serve-repo refuses to start, in one line; without --dry-run
the round records the environment and skips the GPU steps with a reason, and survives a step that overruns; and
the backends' faulthandler, which puts a crashed stub's stack into the log it reads."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from perf.gpu.round import HEADLINE, RESULT
from perf.gpu.steps import DEFAULT_STEPS, STEPS

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


@pytest.fixture(scope="module")
def gpu_image_python(tmp_path_factory) -> Path:
    """The GPU machine's Python as perf.gpu.standin reproduces it: NumPy 2, the image's packages, none of this venv's."""
    from perf.gpu.standin import build

    python = build(tmp_path_factory.mktemp("gpu-image") / "python")
    found = subprocess.run([str(python), "-I", "-c", "import numpy, torch; print(numpy.__version__)"],
                           capture_output=True, text=True, timeout=300)
    assert found.stdout.startswith("2."), found.stderr
    for absent in ("tritonclient", "pytriton", "ts", "server"):  # carried, or this project: not from the venv
        missing = subprocess.run([str(python), "-I", "-c", f"import {absent}"], capture_output=True, text=True,
                                 cwd="/", timeout=120)
        assert missing.returncode != 0, absent
    return python


# Not serial: a bench point that has measured no answer by its end is stretched to its first (perf.load), so the
# round's figures are there beside another worker (2 workers, next to test_migrate: 244 s, 216 s alone).
def test_dry_run_in_the_gpu_machines_python_runs_every_step_with_the_stubs_on_numpy_1(tmp_path, gpu_image_python):
    """tools/gpu_round.sh as the GPU machine runs it, that machine's Python standing in: every served answer right."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(gpu_image_python), "GPU_CARRY": str(ROOT / ".venv" / "gpu-carry"),
           "GPU_ROUND_WORK": str(tmp_path / "work")}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "SERVE_REPO_STUB_PYTHON"):
        env.pop(name, None)
    done = subprocess.run([str(ROOT / "tools" / "gpu_round.sh"), str(out), "--dry-run", "--diagnose", "always"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert (out / "round.json").is_file(), done.stdout + done.stderr
    report = json.loads((out / "round.json").read_text())
    assert done.returncode == 0, {name: outcome.get("reason") for name, outcome in report["steps"].items()}
    assert list(report["steps"]) == list(DEFAULT_STEPS) and report["dry_run"] is True
    assert "compile" not in DEFAULT_STEPS and "engine" in DEFAULT_STEPS  # compile only on demand (minutes)
    assert all(outcome["status"] == "ok" for outcome in report["steps"].values())
    environment = report["steps"]["environment"]["details"]
    assert environment["packages"]["numpy"].startswith("2.")  # the round's own Python: the image's NumPy 2
    assert environment["stub_numpy"].startswith("1.")  # the stubs': tools/stub_env.sh's
    assert environment["stub_python"] == str(tmp_path / "work" / "stub-python" / "bin" / "python3")
    assert environment["packages"]["nvidia-pytriton"] == "0.7.0"  # from the carry
    # DIR stays a handful of files (a device call returns 8): the logs are packed.
    assert sorted(path.name for path in out.iterdir()) == sorted([*HEADLINE, "logs.tar.gz"])
    with tarfile.open(out / "logs.tar.gz") as archive:
        packed = set(archive.getnames())
    assert {f"logs/{step}.log" for step in DEFAULT_STEPS} <= packed and "logs/bench.json" in packed
    figures = json.loads((out / RESULT).read_text())
    assert figures["dry_run"] is True and figures["device"] == "cpu"
    for key in KEYS[1:5]:
        assert figures[key] > 0, key
    # The tests ran under pytest and were counted (a dry run runs one small file of them).
    assert figures["gpu_tests_failed"] == 0 and figures["gpu_tests_passed"] > 0
    assert "passed" in (out / "gpu_tests.txt").read_text()
    # Every served point's answers were read and checked (perf.gpu.bench counts a wrong one as an error).
    bench = figures["bench"]
    assert bench["jpeg_model"] == "fused" and [p["decode"] for p in bench["jpeg"]] == ["gpu", "cpu"]
    for point in bench["tensor"][0]["points"] + bench["jpeg"]:
        assert point["requests"] > 0 and point["errors"] == 0, point["first_error"]
        assert point["avg_batch"] >= 1  # Triton's statistics of the model that ran the batches
    io = report["steps"]["instance_io"]["details"]
    assert io["answers_right"] == list(io["variants"])
    assert [p["instances"] for p in figures["instances"]] == [2]
    # The reference is the engine alone with the batch on the device, at the served batch's bucket; the runner fed
    # from host memory (earlier rounds' reference) stays beside it under its own name.
    best = max(bench["tensor"][0]["points"], key=lambda p: p["images_per_s"])
    assert figures["served_over_inprocess"] == pytest.approx(best["images_per_s"] / best["inprocess_images_per_s"])
    assert figures["inprocess_images_per_s"] > 0 and figures["served_over_runner_from_host"] > 0
    assert best["engine_batch"] >= 1
    # Where each execute's time went (measurement mode), beside Triton's split of each request's time.
    assert {"inputs", "staging", "forward", "responses"} <= set(figures["execute_split_ms"])
    assert figures["execute_split_ms"]["forward"] > 0 and figures["triton_split_ms"]["compute_infer"] > 0
    # The JPEG path's tensor decode (nvJPEG on a GPU; torchvision's CPU decoder standing in) with a transform per
    # group of same-size images ran, and the PIL decode beside it.
    by_decode = {p["decode"]: p["execute_split_ms"] for p in bench["jpeg"]}
    assert by_decode["gpu"]["decode"] > 0 and by_decode["gpu"]["transform"] > 0
    assert by_decode["cpu"]["pil"] > 0
    # The engine alone per precision and graphs (the CPU: fp32 eager, b1 and b2).
    assert [(p["precision"], p["batch"]) for p in figures["engine"]] == [("fp32", 1), ("fp32", 2)]
    assert all(p["images_per_s"] > 0 for p in figures["engine"])


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
def test_round_fails_that_step_and_runs_the_next_when_a_step_overruns(tmp_path, monkeypatch):
    # An nvidia-smi that hangs: the environment step is still running at its 1 s limit however fast this machine is
    # (it had finished its work just past 1 s on a loaded one and logged no TimeLimit).
    hanging = tmp_path / "bin"
    hanging.mkdir()
    (hanging / "nvidia-smi").write_text("#!/bin/sh\nsleep 60\n")
    (hanging / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{hanging}:{os.environ['PATH']}")
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


def test_serve_repo_refuses_in_one_line_when_the_stubs_python_has_numpy_2(tmp_path, gpu_image_python):
    """python_backend r24.10's stub reads NumPy 1.x's ABI: in a Python with NumPy 2 every answer would be empty while
    Triton says ready. serve-repo started from that Python (as the GPU machine's) refuses before Triton starts."""
    (tmp_path / "repo").mkdir()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{ROOT / '.venv' / 'gpu-carry' / 'site'}:{ROOT}"}
    done = subprocess.run([str(gpu_image_python), "-m", "server.cli", "--repository", str(tmp_path / "repo"),
                           "--timeout", "60"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1 and "ready" not in done.stdout, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    version = subprocess.run([str(gpu_image_python), "-I", "-c", "import numpy; print(numpy.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    assert f"would run {gpu_image_python} with numpy {version}" in lines[0]  # the interpreter and the version
    assert "numpy<2" in lines[0] and "--stub-python" in lines[0] and "PR #384" in lines[0]  # the fix, the cause


def test_stub_python_check_names_what_the_stubs_would_find_when_it_is_not_the_python3_given(tmp_path):
    from server.errors import ServerError
    from server.stub_python import check_stub_python, resolve_stub_python, stub_path

    python = resolve_stub_python()
    assert python == Path(sys.executable).parent / "python3"
    assert check_stub_python(python, {"PATH": stub_path(python, "/usr/bin:/bin")}).startswith("1.")
    # A path whose first python3 is another interpreter, or a name that is not python3: the stubs would not get it.
    with pytest.raises(ServerError, match="the python backend's stubs take the first `python3` on PATH"):
        check_stub_python(python, {"PATH": "/usr/bin:/bin"})
    with pytest.raises(ServerError, match="name a python3"):
        check_stub_python(Path(sys.executable).parent / "python", {"PATH": stub_path(python, "")})


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
