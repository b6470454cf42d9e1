"""perf.gpu's in-process steps: the environment, nvJPEG vs PIL parity, the GPU tests."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import sysconfig
from importlib import metadata

from server import libcuda
from perf.gpu.steps import ROOT, Context, StepFailed, run_bounded

PACKAGES = ("nvidia-pytriton", "tritonclient", "grpcio", "protobuf", "numpy", "pillow", "onnxruntime",
            "onnxruntime-gpu", "geventhttpclient", "python-rapidjson")
GPU_TESTS = ("tests/test_gpu.py", "tests/test_gpu_options.py", "tests/test_preprocess_gpu.py",
             "tests/test_handler_gpu.py")


def _run(cmd: list[str], timeout: float = 30) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{cmd[0]} failed: {exc}"
    return (done.stdout + done.stderr).strip()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(ctx: Context) -> None:
    """Versions, the GPU, how libcuda resolves, and whether the wheel's stub finds its libraries."""
    d = ctx.details
    d["python"] = sys.version.split()[0]
    # The stub embeds this Python's shared library; a missing one is the first thing ldd below shows.
    d["libpython"] = f"{sysconfig.get_config_var('LIBDIR')}/{sysconfig.get_config_var('INSTSONAME')}"
    d["cpu"], d["cores"] = _cpu_model(), os.cpu_count()
    d["kernel"] = platform.release()
    # python_backend's stubs and Triton share tensors through files here: its size and kind.
    d["dev_shm"] = [line for line in _run(["df", "-hT", "/dev/shm"]).splitlines()[1:]]
    d["packages"] = {name: _version(name) for name in PACKAGES}
    d["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    d["libcuda"] = libcuda.report()  # before torch: what a fresh process (the stub) finds

    import torch
    import torchvision

    d["torch"], d["torchvision"], d["torch_cuda"] = torch.__version__, torchvision.__version__, torch.version.cuda
    d["cuda_available"] = torch.cuda.is_available()
    if d["cuda_available"]:
        d["gpu"] = torch.cuda.get_device_name(0)
        d["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        d["gpu_count"] = torch.cuda.device_count()
        d["cudnn"] = torch.backends.cudnn.version()

    from server.wheel import pytriton_root

    root = pytriton_root()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    d["stub"] = str(stub.relative_to(root.parent.parent))
    d["stub_ldd"] = [line.strip() for line in _run(["ldd", str(stub)]).splitlines()]
    for name, binary in (("tritonserver", root / "bin" / "tritonserver"),
                         ("libtriton_python", root / "backends" / "python" / "libtriton_python.so")):
        d[f"{name}_missing_libs"] = [line.strip() for line in _run(["ldd", str(binary)]).splitlines()
                                     if "not found" in line]
    missing = [line for line in d["stub_ldd"] if "not found" in line]
    if missing or not stub.is_file():
        raise StepFailed(f"the python {version} stub cannot start: {'; '.join(missing) or 'no such file'}")
    # The stubs' own Python (serve-repo --stub-python / $SERVE_REPO_STUB_PYTHON) and its numpy, as serve-repo checks
    # it before every start: NumPy 2 there made every served answer empty on 2026-11-26.
    from server.errors import ServerError
    from server.stub_python import check_stub_python, resolve_stub_python, stub_path

    python = resolve_stub_python()
    d["stub_python"] = str(python)
    try:
        d["stub_numpy"] = check_stub_python(python, {**os.environ, "PATH": stub_path(python, os.environ["PATH"])})
    except ServerError as exc:
        raise StepFailed(str(exc)) from None


def parity(ctx: Context) -> None:
    """nvJPEG + transforms on the GPU vs PIL on the CPU, per sample JPEG: differences and top-1 of ResNet-152.
    Dry run: torchvision's CPU decoder stands in for nvJPEG, resnet18 for ResNet-152."""
    import torch
    import torchvision

    from common.decoding import decode
    from backends.preprocess import Preprocessor
    from perf.samples import sample_jpegs

    device = torch.device(ctx.device, 0)
    transform = torchvision.models.ResNet152_Weights.DEFAULT.transforms()
    jpegs = sample_jpegs()
    pre = Preprocessor(transform, device, tensor_decode=True)
    ctx.details["route"] = {name: pre.route(data) for name, data in jpegs.items()}
    fast = pre(list(jpegs.values()))
    refused = {name: str(image) for name, image in zip(jpegs, fast) if not isinstance(image, torch.Tensor)}
    if refused:
        raise StepFailed(f"the GPU path refused {refused}")
    slow = [transform(decode(data)) for data in jpegs.values()]
    torch.manual_seed(0)  # random weights: agreement is about the inputs, not about ImageNet accuracy
    model = torchvision.models.get_model("resnet18" if ctx.dry_run else "resnet152", weights=None).eval().to(device)
    with torch.inference_mode():
        top_fast = model(torch.stack(fast)).argmax(1).tolist()
        top_slow = model(torch.stack(slow).to(device)).argmax(1).tolist()
    diffs = {name: (f.cpu() - s).abs() for name, f, s in zip(jpegs, fast, slow)}
    name = "cpu" if ctx.dry_run else torch.cuda.get_device_name(0)
    ctx.details.update(device=name, transform="ResNet152_Weights.DEFAULT.transforms()",
                       max_abs_diff={n: round(float(d.max()), 4) for n, d in diffs.items()},
                       mean_abs_diff={n: round(float(d.mean()), 5) for n, d in diffs.items()},
                       top1_agreement=sum(a == b for a, b in zip(top_fast, top_slow)) / len(jpegs))


def gpu_tests(ctx: Context) -> None:
    """The GPU test files under pytest, output in OUTDIR/gpu_tests.txt (-rA: each test's outcome)."""
    output = ctx.out / "gpu_tests.txt"
    # Dry run: one small file proves the wiring (the suite runs all of GPU_TESTS itself, skipping the GPU parts).
    # $PERF_GPU_TESTS (space-separated files) narrows them, e.g. to re-run one file in a short device call.
    chosen = os.environ.get("PERF_GPU_TESTS", "").split() or GPU_TESTS
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           *(("tests/test_gpu_compile.py",) if ctx.dry_run else chosen)]
    ctx.details.update(command=" ".join(["python -m pytest", *cmd[3:]]), output=output.name)
    # Test servers inherit this environment: a stub that dies prints its Python stack into the output.
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    status = run_bounded(cmd, output, max(10.0, ctx.left() - 15), grace=10, cwd=ROOT, env=env)
    lines = output.read_text(errors="replace").splitlines() if output.exists() else []
    summary = next((line.strip("= ") for line in reversed(lines)
                    if re.search(r"\d+ (passed|failed|error|skipped|xfailed)", line)), "no summary line")
    ctx.details.update(exit_status=status, summary=summary)
    if status is None:
        raise StepFailed(f"pytest ran out of time; last summary: {summary}")
    if status != 0:
        raise StepFailed(f"pytest exited with status {status}: {summary}")
