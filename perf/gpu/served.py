"""perf.gpu's served steps: a GPU output tensor alone, the JPEG image path, the python backend's ceiling.

Every tritonserver here logs to OUTDIR/<label>.tritonserver.log (its stubs' stderr included) and is
stopped through its own object.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from common import names
from common.contract import IMAGE, IMAGE_BYTES, LOGITS
from common.modelconfig import read_config, to_text
from server import libcuda
from perf.gpu.steps import Context, StepFailed, first_line
from perf.samples import CAT

ECHO = Path(__file__).with_name("echo_model.py")
# A stub killed by a fatal signal then writes its Python stack into tritonserver's log. The stub's Python is
# isolated and ignores the variable itself: the backends and the echo model read it (honor_faulthandler).
SERVER_ENV = {"PYTHONFAULTHANDLER": "1"}
# Lines of a server log worth reading first when a stub dies, its Python stack included (faulthandler's
# "File ..." lines); NVML and DCGM complain on every machine without a GPU and say nothing here.
_NOTABLE = re.compile(r"Stub process|not healthy|Fatal Python|Segmentation|Signal \(\d+\)|terminate called|"
                      r"libcuda|CUDA error|Traceback|Error:|^\s+File \"|^(Current thread|Thread) 0x", re.IGNORECASE)
_HARMLESS = ("NVML", "DCGM")
MODEL = "resnet18"  # the cheapest classifier: these steps ask whether a path works, not how fast


def write_echo(repo: Path, name: str, kind: str, output_device: str = "cpu", max_batch: int = 64) -> None:
    """perf/echo_model.py as a model: IMAGE [3, 224, 224] -> LOGITS [1000], a classifier's shapes."""
    from tritonclient.grpc import model_config_pb2 as mc

    config = mc.ModelConfig(name=name, backend="python", max_batch_size=max_batch)
    config.input.add(name=IMAGE, data_type=mc.TYPE_FP32, dims=[3, 224, 224])
    config.output.add(name=LOGITS, data_type=mc.TYPE_FP32, dims=[1000])
    config.dynamic_batching.SetInParent()
    config.instance_group.add(kind=mc.ModelInstanceGroup.Kind.Value(kind), count=1)
    config.parameters["output_device"].string_value = output_device
    (repo / name / "1").mkdir(parents=True)
    shutil.copy(ECHO, repo / name / "1" / "model.py")
    (repo / name / "config.pbtxt").write_text(to_text(config))


@contextmanager
def served(ctx: Context, repo: Path, label: str, env: dict | None = None, extra_args=(), libcuda_link=True):
    """A ready tritonserver for `repo` on free local ports, logging to OUTDIR/<label>.tritonserver.log; as
    serve-repo starts it unless libcuda_link=False (then without its libcuda.so link for the stubs)."""
    from server.triton import TritonServer

    server = TritonServer.local(repo, log_file=ctx.out / f"{label}.tritonserver.log",
                                env={**SERVER_ENV, **(env or {})}, extra_args=extra_args, libcuda_link=libcuda_link)
    try:
        yield server.start(timeout=ctx.left())
    finally:
        server.stop()


def health(server, models: list[str]) -> dict:
    """After the requests: is each model still ready, did a stub die, what did the log say about it."""
    time.sleep(1)  # a stub that crashed on the request takes a moment to be seen dead
    lines = server.log_file.read_text(errors="replace").splitlines()
    return {"server_ready": server.ready(), "models_ready": {m: server.model_ready(m) for m in models},
            "dead_stubs": [stub.instance for stub in server.stubs() if not stub.alive],
            "log_notable": [line[:300] for line in lines
                            if _NOTABLE.search(line) and not any(h in line for h in _HARMLESS)][-40:]}


def infer(url: str, model: str, name: str, array: np.ndarray) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, list(array.shape), "BYTES" if array.dtype == object else "FP32")
    tensor.set_data_from_numpy(array)
    client = grpcclient.InferenceServerClient(url)
    return client.infer(model, [tensor], client_timeout=60).as_numpy(LOGITS)


def verdict(result: dict, problems: list[str]) -> dict:
    return {"status": "failed" if problems else "ok", "reason": "; ".join(problems), **result}


def _echo_variant(ctx: Context, repo: Path, label: str, libcuda_link: bool) -> dict:
    images = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    result, models = {"log": f"{label}.tritonserver.log"}, ["echo_gpu_numpy", "echo_gpu_dlpack"]
    try:
        with served(ctx, repo, label, None, ["--log-verbose=1"], libcuda_link) as server:
            link = server.workdir / "libcuda" / "libcuda.so"
            result["stub_libcuda_link"] = f"libcuda.so -> {os.readlink(link)}" if link.is_symlink() else None
            for model in models:  # numpy first: a GPU instance alone, then one handing over a GPU tensor
                try:
                    echoed = infer(server.grpc_url, model, IMAGE, images)
                    result[model] = "ok" if np.array_equal(echoed, images.reshape(1, -1)[:, :1000]) else "wrong values"
                except Exception as exc:
                    result[model] = f"failed: {first_line(exc)}"
            result.update(health(server, models))
    except Exception as exc:
        return verdict(result, [f"tritonserver: {first_line(exc)}"])
    return verdict(result, [f"{m} {result[m]}" for m in models if result[m] != "ok"])


def gpu_output(ctx: Context) -> None:
    """One request to an echo on a GPU instance answering with a torch CUDA tensor: without serve-repo's
    libcuda.so link, then as serve-repo starts tritonserver (the lead: python_backend r24.10 dlopens that
    unversioned name unchecked; serve-repo links it to the driver's libcuda.so.1 where it is missing).
    Dry run: CPU instances answering with numpy."""
    repo = Path(tempfile.mkdtemp(prefix="diagnose-echo-")) / "repo"
    kind, device = ("KIND_CPU", "cpu") if ctx.dry_run else ("KIND_GPU", "gpu")
    write_echo(repo, "echo_gpu_numpy", kind, "cpu", max_batch=8)
    write_echo(repo, "echo_gpu_dlpack", kind, device, max_batch=8)
    variants = ctx.details["variants"] = {}
    ctx.details["libcuda"] = libcuda.report()
    try:
        if not ctx.dry_run:  # the CPU has no driver: with or without the link is one server there
            variants["without_link"] = _echo_variant(ctx, repo, "gpu_output-without_link", False)
        variants["serve_repo"] = _echo_variant(ctx, repo, "gpu_output-serve_repo", True)
    finally:
        shutil.rmtree(repo.parent, ignore_errors=True)
    problems = [f"{name}: {v['reason']}" for name, v in variants.items() if v["status"] != "ok"]
    if problems:
        raise StepFailed(" | ".join(problems))


def reference(jpeg: bytes) -> np.ndarray:
    """What the served logits should be: `--weights random --seed 0` in-process on the CPU, PIL preprocessing."""
    import torch
    import torchvision

    from common.decoding import decode

    torch.manual_seed(0)
    model = torchvision.models.get_model(MODEL, weights=None).eval()
    transform = torchvision.models.get_model_weights(MODEL).DEFAULT.transforms()
    with torch.inference_mode():
        return model(transform(decode(jpeg)).unsqueeze(0))[0].numpy()


def _image_variant(ctx: Context, repo: Path, label: str, jpeg: bytes, expected: np.ndarray) -> dict:
    result = {"log": f"{label}.tritonserver.log"}
    request = np.array([[jpeg]], dtype=object)
    models = [m for m in (MODEL, names.named(MODEL, "preprocess"), names.image_model(MODEL)) if (repo / m).is_dir()]  # fused: no preprocess
    try:
        with served(ctx, repo, label) as server:
            try:
                logits = infer(server.grpc_url, names.image_model(MODEL), IMAGE_BYTES, request)[0]
                result["top1"] = int(np.argmax(logits))
                result["relative_error"] = float(np.abs(logits - expected).max() / np.abs(expected).max())
                times = []
                for _ in range(20):  # one client, one request at a time: the path's own latency
                    begin = time.perf_counter()
                    infer(server.grpc_url, names.image_model(MODEL), IMAGE_BYTES, request)
                    times.append(time.perf_counter() - begin)
                result["latency_ms_p50"] = round(float(np.median(times)) * 1000, 2)
            except Exception as exc:
                result["error"] = first_line(exc)
            result.update(health(server, models))
    except Exception as exc:
        result["error"] = f"tritonserver: {first_line(exc)}"
    if "error" in result:
        return verdict(result, [result["error"]])
    top1 = int(np.argmax(expected))
    return verdict(result, [] if result["top1"] == top1 else [f"top-1 {result['top1']}, in-process {top1}"])


def _set_parameter(model_dir: Path, key: str, value: str) -> None:
    config = read_config(model_dir)
    config.parameters[key].string_value = value
    (model_dir / "config.pbtxt").write_text(to_text(config))


def image_path(ctx: Context) -> None:
    """A JPEG to NAME_image over gRPC: the fused model (the GPU default: nvJPEG + classify in one stub), the
    ensemble with CPU preprocess -> GPU classifier, then the ensemble with --decode-device gpu (if that fails: again with a CPU output from the GPU preprocess).
    Each server starts as serve-repo starts it. Dry run: the CPU decodes, no GPU-decode ensemble."""
    from builder import cli as build_repo

    jpeg, expected = CAT.read_bytes(), reference(CAT.read_bytes())
    ctx.details.update(jpeg=f"{CAT.name} ({len(jpeg)} bytes)", top1_in_process=int(np.argmax(expected)))
    variants = ctx.details["variants"] = {}
    work = Path(tempfile.mkdtemp(prefix="diagnose-image-"))
    try:
        plan = (("gpu", "fused"), ("cpu", "ensemble"), ("gpu", "ensemble"))
        for decode, image_model in (plan[:1] if ctx.dry_run else plan):  # the CPU has no nvJPEG to stand in
            name = f"decode_{decode}" if image_model == "ensemble" else "fused"
            repo = work / name
            if ctx.dry_run:
                decode = "cpu"
            argv = ["--model", MODEL, "--weights", "random", "--seed", "0", "--kind", ctx.kind, "--max-batch-size", "8",
                    "--instances", "1", "--image-model", image_model, "--decode-device", decode, "--output", str(repo)]
            ctx.details[f"build_{name}"] = "build-repo " + " ".join(argv[:-2])
            if build_repo.main(argv) != 0:
                variants[name] = {"status": "failed", "reason": "build-repo failed (its error is in image_path.log)"}
                continue
            variants[name] = _image_variant(ctx, repo, f"image_path-{name}", jpeg, expected)
        repo = work / "decode_gpu"
        if variants.get("decode_gpu", {}).get("status") == "failed" and repo.is_dir():
            # Which part dies: nvJPEG on a GPU instance, or handing its GPU tensor over to the classifier.
            _set_parameter(repo / names.named(MODEL, "preprocess"), "output_device", "cpu")
            variants["decode_gpu_output_cpu"] = _image_variant(ctx, repo, "image_path-decode_gpu_output_cpu",
                                                               jpeg, expected)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    problems = [f"{name}: {v['reason']}" for name, v in variants.items() if v["status"] != "ok"]
    if problems:
        raise StepFailed(" | ".join(problems))


def python_backend_probe(ctx: Context) -> None:
    """Served img/s of echo models (CPU and GPU instances) vs the classifier (fp16), same client: the
    python backend's own ceiling on this machine."""
    from builder import cli as build_repo
    from perf.gpu.load import run_load

    work = Path(tempfile.mkdtemp(prefix="diagnose-probe-"))
    repo = work / "repo"
    try:
        precision, seconds, processes = ("fp32", 0.5, 1) if ctx.dry_run else ("fp16", 2.0, 8)
        if build_repo.main(["--model", MODEL, "--weights", "random", "--kind", ctx.kind, "--precision", precision,
                            "--output", str(repo)]) != 0:
            raise StepFailed("build-repo failed (its error is in python_backend_probe.log)")
        write_echo(repo, "echo_cpu", "KIND_CPU")
        write_echo(repo, "echo_gpu", "KIND_CPU" if ctx.dry_run else "KIND_GPU")
        points = ctx.details["points"] = []
        ctx.details["client"] = (f"perf.gpu.load.run_load: {processes} processes, gRPC, 1 image per request, "
                                 f"system shm, {seconds:g} s")
        with served(ctx, repo, "python_backend_probe") as server:
            for model in (("echo_cpu", MODEL) if ctx.dry_run else ("echo_cpu", "echo_gpu", MODEL)):
                for concurrency in ((2,) if ctx.dry_run else (1, 64)):
                    payload = {"shape": [1, 3, 224, 224], "dtype": "fp32"}
                    point = run_load(server.grpc_url, model, "tensor", payload, concurrency, seconds, processes,
                                     0.3 if ctx.dry_run else 1.0)
                    points.append({"model": model, **{k: round(v, 3) if isinstance(v, float) else v
                                                      for k, v in point.items()}})
    finally:
        shutil.rmtree(work, ignore_errors=True)
