"""The engine alone, batch already on the device: the reference of the served path (perf.gpu.bench) and the round's
engine step, the same backend runner per precision, eager and CUDA graphs, at batch 64 / 128 / 256.

    python -m perf.gpu.steps engine OUTDIR          # as perf.gpu.round runs it (OUTDIR/engine.json)

The runner is backends.batch_runner's (build_runner: the torch engine, channels_last, the precision's dtype, a graph
per bucket captured as a GPU instance captures them) on build-repo's calibrated random weights; forward_on_device
runs it with no copy in or out, which is what a served batch could reach if serving cost nothing.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from perf.gpu.steps import StepFailed
from perf.load import in_process

PRECISIONS = ("fp16", "bf16", "fp32")
BATCHES = (64, 128, 256)


def sample(shape, dtype: str, seed: int) -> np.ndarray:
    """Random images as the input of `dtype` takes them: normalized floats or 0..255 pixels."""
    rng = np.random.default_rng(seed)
    if dtype == "uint8":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return rng.standard_normal(shape).astype(np.float16 if dtype == "fp16" else np.float32)


class InProcess:
    """The backend's own runner (same engine, precision, graphs, buckets) in this process: the engine alone with the
    batch already on the device (the served path's reference), or the runner fed CPU tensors as a server hands them
    over (the reference of earlier rounds, kept as runner_from_host)."""

    def __init__(self, model_dir: Path, params: dict, max_batch: int, device: str = "cuda"):
        import torch

        from backends.classifier import build_runner

        self.runner = build_runner(model_dir / "1", params, torch.device(device), max_batch, (3, 224, 224))
        self.runner.warm_up()

    def measure(self, batch: int, seconds: float = 3.0, dtype: str = "fp32") -> float:
        import torch

        images = torch.from_numpy(sample((batch, 3, 224, 224), dtype, 0))
        parts = list(images.split(1))  # one tensor per request, as the server hands them over
        return in_process(lambda: self.runner.run(parts), batch, seconds)

    def on_device(self, rows: int, seconds: float = 2.0) -> float:
        """img/s of the engine alone at the batch a `rows`-row forward runs (its bucket, full), the batch already on
        the device, graphs as configured: what the served path would reach if serving cost nothing."""
        return engine_on_device(self.runner, rows, seconds)

    def close(self) -> None:
        import torch

        self.runner = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine_on_device(runner, rows: int, seconds: float) -> float:
    """img/s of runner.forward_on_device at `rows`' bucket (every row counted), synchronizing every few batches so
    that the host's queue of launches stays short; timed after the last batch is done."""
    import torch

    bucket = runner.bucket_for(rows)
    return in_process(lambda: runner.forward_on_device(bucket), bucket, seconds,
                      sync=torch.cuda.synchronize if runner.gpu else (lambda: None), sync_every=4)


def engine_table(model: str, weights: Path, device: str, precisions, graphs, batches, seconds: float) -> list[dict]:
    """img/s of the engine alone for each precision x graphs x batch, the batch already on `device`."""
    import torch

    from backends.classifier import build_runner

    version = Path(tempfile.mkdtemp(prefix="engine-"))
    shutil.copyfile(weights, version / "weights.pt")
    points = []
    try:
        for precision in precisions:
            for graph in graphs:
                params = {"engine": "torch", "torchvision_model": model, "precision": precision,
                          "cuda_graphs": "1" if graph else "0", "batch_buckets": ",".join(map(str, batches))}
                runner = build_runner(version, params, torch.device(device), max(batches), (3, 224, 224))
                runner.warm_up()
                for batch in batches:
                    points.append({"precision": precision, "cuda_graphs": runner.cuda_graphs, "batch": batch,
                                   "images_per_s": round(engine_on_device(runner, batch, seconds), 1)})
                    print(json.dumps(points[-1]), flush=True)
                del runner
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(version, ignore_errors=True)
    return points


def round_step(ctx) -> None:
    """perf.gpu.round's engine step: ResNet-152 alone on the GPU per precision, eager and graphs, b64/b128/b256
    (dry run: resnet18 on the CPU, fp32 eager, b1/b2); OUTDIR/engine.json, gpu-resnet152.json's `engine`."""
    from perf.gpu.weights import calibrated_weights

    model, precisions, graphs, batches, seconds = (
        ("resnet18", ("fp32",), (False,), (1, 2), 0.3) if ctx.dry_run else
        ("resnet152", PRECISIONS, (False, True), BATCHES, 1.0))
    folder = Path(tempfile.mkdtemp(prefix="engine-weights-"))
    try:
        weights = calibrated_weights(model, folder, ctx.device)
        ctx.details.update(model=model, seconds_per_point=seconds)
        points = ctx.details["points"] = engine_table(model, weights, ctx.device, precisions, graphs, batches, seconds)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    (ctx.out / "engine.json").write_text(json.dumps({"model": model, "points": points}, indent=2) + "\n")
    if not points or any(not p["images_per_s"] > 0 for p in points):
        raise StepFailed("an engine point measured nothing")
