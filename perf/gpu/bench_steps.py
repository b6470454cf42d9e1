"""The bench as perf.gpu.round runs it: its bench and instances steps (perf.gpu.bench does the measuring)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from perf.gpu.bench import main
from perf.gpu.steps import StepFailed


def _round_argv(ctx, output: Path, plan: list[str], instances: int | None = None,
                concurrency: tuple[str, ...] = ("1", "256")) -> list[str]:
    """The bench as perf.gpu.round runs it: ResNet-152 on the GPU, or resnet18 on the CPU in a dry run."""
    argv = ["--plan", *plan, "--output", str(output), "--timeout-s", f"{ctx.left():.0f}"]
    found = ctx.out / "io_variant.json"  # perf.gpu.io_variants.instance_io's finding, when it ran
    right = json.loads(found.read_text())["right"] if found.exists() else []
    on_gpu = [v for v in right if v not in ("cpu_instances", "cpu_instances_gpu_flags")]  # the others use the GPU
    if on_gpu and "gpu_instances" not in on_gpu:  # the repository as built answered wrong, another way right
        argv += ["--io-variant", on_gpu[0]]
    if ctx.dry_run:
        argv += ["--kind", "cpu", "--model", "resnet18", "--concurrency", "2", "--seconds", "0.5", "--warmup-s", "0.3",
                 "--processes", "1", "--image-model", "fused"]  # fused: the GPU default, also served on CPU
        instances = instances or 1
    else:
        argv += ["--concurrency", *concurrency, "--seconds", "3"]
    return argv + (["--instances", str(instances)] if instances else [])


def round_step(ctx) -> None:
    """perf.gpu.round's bench: the tensor path per precision with CUDA graphs, then the JPEG path (the fused
    model, GPU and CPU decode) with the best of them; OUTDIR/bench.json (gpu-resnet152.json's record)."""
    # $PERF_GPU_BENCH_PLAN (space-separated items) narrows it, e.g. for a short device call.
    plan = ["fp32:0", "jpeg"] if ctx.dry_run else (os.environ.get("PERF_GPU_BENCH_PLAN", "").split()
                                                   or ["bf16:1", "jpeg", "fp16:1", "fp32:1"])
    output = ctx.out / "bench.json"
    ctx.details.update(plan=plan, output=output.name)
    status = main(_round_argv(ctx, output, plan))
    result = json.loads(output.read_text()) if output.exists() else {}
    for key in ("served_images_per_s", "served_over_inprocess", "jpeg_images_per_s", "jpeg_over_tensor", "best"):
        ctx.details[key] = result.get(key)
    errors = [p["first_error"] for e in result.get("tensor", []) for p in e["points"] if p["errors"]]
    errors += [p["first_error"] for p in result.get("jpeg", []) if p["errors"]]
    if status != 0 or errors:
        raise StepFailed(f"bench exited with {status}" + (f"; requests failed: {errors[0]}" if errors else ""))


def instances_step(ctx) -> None:
    """The bench's best precision and graphs again with 1 and 2 classifier instances (build-repo's GPU default
    is 4, which the bench ran), at c=256 only (the bench has c=1): the tensor path's img/s and p50/p99 per count."""
    bench = ctx.out / "bench.json"
    best = json.loads(bench.read_text()).get("best") if bench.exists() else None
    item = f"{best['precision']}:{best['cuda_graphs']}" if best else ("fp32:0" if ctx.dry_run else "fp16:1")
    points = ctx.details["points"] = []
    counts = [int(n) for n in os.environ.get("PERF_GPU_INSTANCES", "").split()] or [1, 2]  # narrows a short call
    for count in ((2,) if ctx.dry_run else counts):
        output = ctx.out / f"bench-instances-{count}.json"
        status = main(_round_argv(ctx, output, [item], count, concurrency=("256",)))
        if status != 0 or not output.exists():
            raise StepFailed(f"bench with {count} instance(s) exited with {status}")
        for point in json.loads(output.read_text())["tensor"][0]["points"]:
            points.append({"instances": count, "variant": item, **{k: point[k] for k in (
                "concurrency", "images_per_s", "p50_ms", "p99_ms", "avg_batch", "served_over_inprocess")}})
