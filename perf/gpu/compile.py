"""In-process: what conv-BN folding, CUDA graphs and torch.compile gain over eager at large batches.

    python -m perf.gpu.compile --output perf/results/gpu-compile-resnet152.json      # on a GPU, ~5-8 min
    python -m perf.gpu.compile --device cpu --model resnet18 --batches 2 --variants eager folded

Per precision × batch × variant: img/s with the input already on the device, the warm-up (compile)
seconds, and the largest difference of the logits from eager fp32 relative to their range. Variants:
eager; folded (each BatchNorm folded into the convolution before it, torch.fx); graph (folded, one CUDA
graph per batch size); compile (folded, torch.compile mode max-autotune, which captures CUDA graphs
itself). The JSON is rewritten after every point, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torchvision

from backends.batch_runner import PRECISIONS
from common.cli import OneLineParser
from common.messages import first_line
from perf.load import in_process

VARIANTS = ("eager", "folded", "graph", "compile")


def parser():
    p = OneLineParser(prog="python -m perf.gpu.compile", description=__doc__)
    p.add_argument("--model", default="resnet152", help="torchvision model (random weights). Default: resnet152.")
    p.add_argument("--device", default="cuda", help="cuda or cpu (a smoke run). Default: cuda.")
    p.add_argument("--precisions", nargs="+", choices=tuple(PRECISIONS), default=["fp16"],
                   help="Default: fp16.")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256], help="Default: 64 128 256.")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="Default: all.")
    p.add_argument("--seconds", type=float, default=3.0, help="timed run per point. Default: 3.")
    p.add_argument("--compile-mode", default="max-autotune",
                   choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
                   help="torch.compile's mode for the compile variant. Default: max-autotune.")
    p.add_argument("--output", type=Path, default=Path("perf/results/gpu-compile-resnet152.json"),
                   help="JSON written. Default: perf/results/gpu-compile-resnet152.json.")
    return p


def folded(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every Conv -> BatchNorm pair fused into one convolution (eval mode only)."""
    from torch.fx.experimental.optimization import fuse

    return fuse(model.eval(), inplace=False)


def runner(model: torch.nn.Module, variant: str, example: torch.Tensor, compile_mode: str = "max-autotune"):
    """A callable batch -> logits for the variant, warmed up on `example` (compiled / captured)."""
    if variant == "eager":
        return model
    model = folded(model)
    if variant == "folded":
        return model
    if variant == "compile":
        compiled = torch.compile(model, mode=compile_mode)
        for _ in range(3):
            compiled(example)
        return compiled
    static_in = example.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_in)

    def replay(batch):
        static_in.copy_(batch)
        graph.replay()
        return static_out
    return replay


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("perf.gpu.compile: no CUDA device here (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    variants = [v for v in args.variants if device.type == "cuda" or v in ("eager", "folded")]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    base = torchvision.models.get_model(args.model, weights=None).eval().to(device)
    result = {"model": args.model, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "command": " ".join(["python -m perf.gpu.compile", *(argv or sys.argv[1:])]),
              "points": []}
    with torch.inference_mode():
        for batch_size in args.batches:
            batch = torch.randn(batch_size, 3, 224, 224, device=device)
            reference = base(batch).float()
            for precision in args.precisions:
                model = base.to(PRECISIONS[precision]).to(memory_format=torch.channels_last)
                typed = batch.to(PRECISIONS[precision]).contiguous(memory_format=torch.channels_last)
                for variant in variants:
                    point = {"precision": precision, "batch": batch_size, "variant": variant}
                    try:
                        start = time.perf_counter()
                        run = runner(model, variant, typed, args.compile_mode)
                        sync()
                        point["warmup_s"] = time.perf_counter() - start
                        diff = (run(typed).float() - reference).abs().max() / reference.abs().max()
                        point["max_rel_diff_vs_eager_fp32"] = float(diff)
                        point["images_per_s"] = in_process(lambda: run(typed), typed.shape[0], args.seconds, min_runs=3,
                                                             sync=sync)
                    except Exception as exc:  # one variant failing (e.g. compile) must not end the run
                        point["error"] = f"{type(exc).__name__}: {first_line(exc)}"
                    print(json.dumps(point), flush=True)
                    result["points"].append(point)
                    args.output.parent.mkdir(parents=True, exist_ok=True)
                    args.output.write_text(json.dumps(result, indent=2) + "\n")
                base = base.float()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def round_step(ctx) -> None:
    """perf.gpu.round's compile step (not in the default round: --steps compile): eager, folded and graphed fp16 at
    batch 128, then torch.compile at 128 in reduce-overhead mode (inductor's kernels in its own CUDA graphs; max-autotune
    took past the step's budget on an H200) and what it gives over graphs (compile_over_graph); OUTDIR/compile.json.
    Dry run: resnet18 on the CPU."""
    from perf.gpu.steps import StepFailed

    output = ctx.out / "compile.json"
    if ctx.dry_run:
        runs = [["--device", "cpu", "--model", "resnet18", "--batches", "2", "--variants", "eager", "folded"]]
    else:
        runs = [["--batches", "128", "--variants", "eager", "folded", "graph"],
                ["--batches", "128", "--variants", "compile", "--compile-mode", "reduce-overhead"]]
    points = []
    for argv in runs:
        part = ctx.out / f"compile-{len(points)}.json"
        if main([*argv, "--seconds", "0.5" if ctx.dry_run else "2", "--output", str(part)]) != 0:
            raise StepFailed(f"perf.gpu.compile {' '.join(argv)} failed")
        points += json.loads(part.read_text())["points"]
        part.unlink()
        output.write_text(json.dumps({"points": points}, indent=2) + "\n")
        ctx.details["points"] = points
    rates = {p["variant"]: p.get("images_per_s") for p in points if p["batch"] == 128}
    if rates.get("compile") and rates.get("graph"):
        ctx.details["compile_over_graph"] = round(rates["compile"] / rates["graph"], 3)
