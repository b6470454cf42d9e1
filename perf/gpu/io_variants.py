"""perf.gpu.round's instance_io step: the answers of one GPU build served in each way of IO_VARIANTS (how tensors
cross between Triton and the stubs), and the changes each way makes to a repository (the bench uses them too)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from common import names
from common.contract import IMAGE, IMAGE_BYTES
from common.modelconfig import read_config, to_text
from perf.gpu.served import MODEL, health, infer, reference, served, verdict
from perf.gpu.steps import Context, StepFailed, first_line
from perf.samples import CAT


# How a GPU model's tensors cross between Triton and its stub: each variant changes the same GPU build (KIND_GPU
# instances) and/or the flags serve-repo adds for GPU repositories (server.repo.GPU_FLAGS). Seen on an H200
# (Firecracker, 2026-11-26): every variant where the stub itself used CUDA answered wrong (BYTES inputs read as
# garbage, FP32 outputs empty); the first two, stubs without CUDA, were not run there yet.
IO_VARIANTS = ("cpu_instances", "cpu_instances_gpu_flags", "gpu_instances", "gpu_instances_unpinned",
               "gpu_instances_no_pinned_pool", "gpu_instances_small_shm", "gpu_instances_no_cuda_pool",
               "cpu_instances_on_gpu", "gpu_hidden_from_triton")
_SMALL_SHM = ["--backend-config=python,shm-default-byte-size=1048576",  # python_backend's own defaults
              "--backend-config=python,shm-growth-byte-size=1048576"]


def apply_io_variant(repo: Path, variant: str) -> list[str]:
    """Change a --kind gpu repository to `variant`; the tritonserver flags it needs."""
    from server.repo import GPU_FLAGS

    for model_dir in sorted(p.parent for p in repo.glob("*/config.pbtxt")):
        config = read_config(model_dir)
        if config.platform == "ensemble":
            continue
        if variant == "gpu_instances_unpinned":
            config.optimization.input_pinned_memory.enable = False
            config.optimization.output_pinned_memory.enable = False
        elif variant.startswith("cpu_instances") or variant == "gpu_hidden_from_triton":
            for group in config.instance_group:  # no CUDA in the stubs, unless the model is told its GPU
                group.kind = group.KIND_CPU
                del group.gpus[:]
            if variant in ("cpu_instances_on_gpu", "gpu_hidden_from_triton"):
                config.parameters["cuda_device"].string_value = "0"
        (model_dir / "config.pbtxt").write_text(to_text(config))
    flags = {"gpu_instances_no_pinned_pool": ["--pinned-memory-pool-byte-size=0"],
             "gpu_instances_small_shm": _SMALL_SHM, "cpu_instances_gpu_flags": list(GPU_FLAGS),
             "gpu_instances_no_cuda_pool": ["--cuda-memory-pool-byte-size=0:0"]}
    return flags.get(variant, [])


def io_variant_env(variant: str) -> dict:
    """tritonserver's environment for `variant`: gpu_hidden_from_triton hides the GPU from Triton's core and
    shows it to the stubs again (backends/triton_io.py STUB_VISIBLE_DEVICES)."""
    if variant != "gpu_hidden_from_triton":
        return {}
    return {"CUDA_VISIBLE_DEVICES": "", "CLASSIFIER_STUB_CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}


def _io_variant(ctx: Context, repo: Path, variant: str, jpeg: bytes, images: np.ndarray, expected: dict) -> dict:
    result = {"log": f"instance_io-{variant}.tritonserver.log"}
    try:
        flags, env = apply_io_variant(repo, variant), io_variant_env(variant)
        with served(ctx, repo, f"instance_io-{variant}", env, flags) as server:
            try:
                logits = infer(server.grpc_url, MODEL, IMAGE, images)
                result["tensor_relative_error"] = float(np.abs(logits - expected["tensor"]).max()
                                                        / np.abs(expected["tensor"]).max())
            except Exception as exc:
                result["tensor_error"] = first_line(exc)
            try:
                logits = infer(server.grpc_url, names.image_model(MODEL), IMAGE_BYTES, np.array([[jpeg]], dtype=object))[0]
                result["jpeg_top1"] = int(np.argmax(logits))
                result["jpeg_relative_error"] = float(np.abs(logits - expected["jpeg"]).max()
                                                      / np.abs(expected["jpeg"]).max())
            except Exception as exc:
                result["jpeg_error"] = first_line(exc)
            result.update(health(server, [MODEL, names.image_model(MODEL)]))
    except Exception as exc:
        result["tensor_error"] = f"tritonserver: {first_line(exc)}"
    problems = [result[k] for k in ("tensor_error", "jpeg_error") if k in result]
    if result.get("tensor_relative_error", 0) > 1e-2:
        problems.append(f"tensor answers differ from in-process by {result['tensor_relative_error']:.3g}")
    if "jpeg_top1" in result and result["jpeg_top1"] != int(np.argmax(expected["jpeg"])):
        problems.append(f"JPEG top-1 {result['jpeg_top1']}, in-process {int(np.argmax(expected['jpeg']))}")
    return verdict(result, problems)


def instance_io(ctx: Context) -> None:
    """The answers themselves (not only that requests succeed) of a GPU build of resnet18 served in each of
    IO_VARIANTS: GPU instances as built, without pinned-memory staging (per model; for the server), with
    python_backend's own 1 MB shared memory, without the CUDA memory pool, CPU instances (no CUDA in the stubs:
    the control), and CPU instances whose model runs on the GPU.
    OUTDIR/io_variant.json lists the ways that answer right (the bench picks from them: perf.gpu.bench_steps)."""
    import torch
    import torchvision

    from builder import cli as build_repo

    jpeg = CAT.read_bytes()
    images = np.random.default_rng(0).standard_normal((3, 3, 224, 224)).astype(np.float32)
    torch.manual_seed(0)
    model = torchvision.models.get_model(MODEL, weights=None).eval()
    with torch.inference_mode():
        expected = {"tensor": model(torch.from_numpy(images)).numpy(), "jpeg": reference(jpeg)}
    variants = ctx.details["variants"] = {}
    work = Path(tempfile.mkdtemp(prefix="diagnose-io-"))
    try:
        for variant in (IO_VARIANTS[1:2] if ctx.dry_run else IO_VARIANTS):  # the CPU has no cuda:0 to stand in
            repo = work / variant
            argv = ["--model", MODEL, "--weights", "random", "--seed", "0", "--kind", ctx.kind, "--max-batch-size",
                    "8", "--instances", "1", "--image-model", "fused", "--no-cuda-graphs", "--output", str(repo)]
            if build_repo.main(argv) != 0:
                raise StepFailed("build-repo failed (its error is in instance_io.log)")
            variants[variant] = _io_variant(ctx, repo, variant, jpeg, images, expected)
            print(variant, variants[variant]["status"], variants[variant].get("reason", ""), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    good = [name for name, v in variants.items() if v["status"] == "ok"]
    ctx.details["answers_right"] = good
    (ctx.out / "io_variant.json").write_text(json.dumps({"right": good}) + "\n")
    if not good:
        raise StepFailed("no way of serving answered right: " + " | ".join(
            f"{name}: {v['reason']}" for name, v in variants.items()))
