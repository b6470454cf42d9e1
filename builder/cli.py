"""`build-repo`: export an image classifier into a Triton model repository, atomically.

The classifier: a torchvision model name (--model), a TorchServe archive (--from-mar), or a model file
with a state_dict (--model-file + --weights)."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import tempfile
from pathlib import Path

from builder import config as cfg
from builder import mar
from builder.options import ENGINES, IMAGENET, WEIGHT_CHOICES, WeightsError
from builder.staging import BuildError, InterruptedAfterSwap, check_writable
from common import names
from common import precision as precisions
from common.build_result import BuiltModel, BuildResult
from common.cli import OneLineParser
from common.contract import IMAGE_INPUTS

FORMATS = ("python", "onnx", "torchscript")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _delay_ms(text: str) -> int:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return round(value * 1000)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="build-repo", description=__doc__)
    p.add_argument("--model", metavar="NAME", help="torchvision classification model. Default: resnet152 (unless --from-mar or "
                                   "--model-file).")
    p.add_argument("--from-mar", type=Path, metavar="FILE.mar",
                   help="migrate a TorchServe model archive: its weights (served with torchvision's code when they "
                        "fit a torchvision architecture exactly), index_to_name.json, handler preprocessing "
                        "(image_classifier) and model-config.yaml batching (flags override). Default: none.")
    p.add_argument("--max-archive-gb", metavar="GB", type=_positive_float, default=mar.DEFAULT_MAX_EXTRACTED_BYTES / (1 << 30),
                   help="with --from-mar: the most an archive may expand to when extracted, in GiB; refused before "
                        "extracting (declared sizes) and while extracting (bytes counted). Default: 8.")
    p.add_argument("--model-file", type=Path, metavar="FILE.py",
                   help="your model code (TorchServe's convention: one nn.Module class, no-argument constructor); "
                        "needs --weights PATH and the preprocessing (--preprocess or --resize/--crop/--mean/--std). Default: none.")
    p.add_argument("--model-class", metavar="CLASS", help="the class in --model-file (or the archive's model file) when it "
                                         "defines several. Default: the only one.")
    p.add_argument("--trust-model-code", action="store_true",
                   help="allow running the archive's model file when its weights fit no torchvision model. It "
                        "executes code from the archive: only for archives you trust. Default: off.")
    p.add_argument("--handler-path", action="store_true",
                   help="with --from-mar: serve the archive's own handler (TorchServe's handle() once per batch "
                        "Triton forms, BYTES in and out) even for an image_classifier archive, which otherwise "
                        "takes the image path. An archive whose handler is not image_classifier takes it unless "
                        "its preprocessing is given. Needs --trust-model-code. Default: off.")
    p.add_argument("--name", metavar="NAME", help="served model name (NAME, NAME_preprocess, NAME_image). Default: the model, "
                                  "the archive's model name, or the model file's name.")
    p.add_argument("--weights", metavar="|".join(WEIGHT_CHOICES) + "|PATH",
                   help="auto: the pretrained DEFAULT weights, from torch.hub's cache or downloaded; where they "
                        "cannot be had the build fails (random weights are never chosen for you); random: "
                        "torch.manual_seed(SEED) then no weights (meaningless predictions, for tests and benchmarks); "
                        "PATH: a state_dict file (loaded with weights_only=True). Default: auto (--model); required "
                        "PATH with --model-file.")
    p.add_argument("--labels", type=Path, metavar="FILE",
                   help="class names: index_to_name.json (TorchServe's shapes) or one name per line. Default: "
                        "torchvision's (--model), the archive's index_to_name.json, else class indices.")
    pre = p.add_argument_group("preprocessing: Resize -> CenterCrop -> Normalize, as the server and clients run it")
    pre.add_argument("--preprocess", choices=("imagenet",),
                     help=f"imagenet: TorchServe's image_classifier, {IMAGENET}. Default: the torchvision "
                          "weights' transforms(), or the archive handler's.")
    pre.add_argument("--resize", metavar="N", type=_positive, help="shorter side after resizing, in pixels. Default: the preset's (--preprocess, weights, archive).")
    pre.add_argument("--crop", metavar="N", type=_positive, help="side of the center crop the model sees, in pixels. Default: the preset's.")
    pre.add_argument("--mean", type=float, nargs=3, metavar=("R", "G", "B"), help="per-channel mean on [0, 1]. Default: the preset's.")
    pre.add_argument("--std", type=float, nargs=3, metavar=("R", "G", "B"), help="per-channel std on [0, 1]. Default: the preset's.")
    pre.add_argument("--interpolation", choices=("bilinear", "bicubic", "nearest", "nearest-exact", "lanczos",
                                                  "box", "hamming"),
                     help="resize filter. Default: bilinear (or the torchvision weights').")
    p.add_argument("--seed", metavar="N", type=int, default=0, help="seed for random weights. Default: 0.")
    p.add_argument("--output", metavar="DIR", type=Path, default=Path("model_repository"),
                   help="model repository directory. Default: model_repository.")
    cpu, gpu = cfg.DEFAULTS[cfg.InstanceKind.CPU], cfg.DEFAULTS[cfg.InstanceKind.GPU]
    p.add_argument("--max-batch-size", "--batch-size", metavar="N", dest="max_batch_size", type=_non_negative,
                   help=f"largest batch Triton forms; 0 disables batching (TorchServe: batch_size). "
                        f"Default: {cpu.max_batch_size} (cpu), {gpu.max_batch_size} (gpu).")
    delay = p.add_mutually_exclusive_group()
    delay.add_argument("--max-queue-delay-us", metavar="US", type=_non_negative,
                       help=f"longest a request waits for a batch to fill, in microseconds. "
                            f"Default: {cpu.max_queue_delay_us} (cpu), {gpu.max_queue_delay_us} (gpu).")
    delay.add_argument("--max-batch-delay-ms", metavar="MS", dest="max_queue_delay_us", type=_delay_ms,
                       help="the same in milliseconds (TorchServe: max_batch_delay). Default: unset.")
    p.add_argument("--preferred-batch-size", metavar="N", type=_positive, nargs="+",
                   help="batch sizes the batcher prefers to send. Default: none (cpu), the batch buckets (gpu).")
    p.add_argument("--max-queue-size", metavar="N", type=_non_negative,
                   help="requests that may wait for a batch; more are rejected at once (UNAVAILABLE, "
                        "'Exceeds maximum queue size'). 0 is unbounded. Any bound (or timeout) turns Triton 2.51's "
                        "prefetching off: at low load a request can then wait 500 ms (docs/performance.md). "
                        f"Default: {cpu.max_queue_size} (cpu), {gpu.max_queue_size} (gpu).")
    p.add_argument("--queue-timeout-ms", metavar="MS", dest="queue_timeout_us", type=_delay_ms,
                   help="longest a request may wait in the queue before --timeout-action; 0: no timeout. "
                        f"Default: {cpu.queue_timeout_ms:g} (cpu), {gpu.queue_timeout_ms:g} (gpu).")
    p.add_argument("--timeout-action", choices=("reject", "delay"), default="reject",
                   help="what a timed-out request gets: reject (an error) or delay (served after the others). "
                        "Default: reject.")
    p.add_argument("--allow-timeout-override", action="store_true",
                   help="let requests carry a shorter timeout of their own. Default: off.")
    p.add_argument("--instances", metavar="N", type=_positive,
                   help=f"model instances (stub processes). Default: {cpu.instances} (cpu), {gpu.instances} (gpu).")
    p.add_argument("--kind", choices=("auto", "cpu", "gpu"), default="auto",
                   help="instance kind; auto: gpu if torch sees CUDA here, else cpu. Default: auto.")
    p.add_argument("--precision", choices=precisions.CHOICES, default=None,
                   help="numbers the model computes in. The default, for every source, answers as the same model "
                        "in eager PyTorch: fp32 (on GPU with TF32 convolutions, as PyTorch does there). Faster, "
                        "asked for: auto (OpenVINO's choice on the CPU that serves: bf16 with AMX or AVX512-BF16, "
                        "logits within ~1e-2 of their range; fp32 elsewhere), bf16, fp16, int8 (the ONNX export "
                        "quantized on --calibration DIR and checked against fp32 on those images). Which engine "
                        f"runs which: {precisions.summary()}. Default: {precisions.DEFAULT}.")
    p.add_argument("--input-dtype", choices=tuple(IMAGE_INPUTS), default="fp32",
                   help="NAME's one image input, which NAME_preprocess also hands it in the ensemble. fp32: IMAGE, "
                        "normalized; fp16: IMAGE_FP16, normalized, half the bytes; uint8: IMAGE_UINT8, the resized "
                        "and cropped pixels, a quarter of the bytes (NAME normalizes them with the config's mean "
                        "and std: the same logits as fp32 to float rounding). Default: fp32.")
    p.add_argument("--calibration", type=Path, metavar="DIR",
                   help="images (jpg/png/webp, up to 64) that set int8's activation ranges and check its accuracy; "
                        "use photos like the ones you will serve. Required with --precision int8. Default: none.")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture one CUDA graph per batch bucket at load time (engine torch/torchscript). "
                        "Default: on for gpu.")
    p.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                   help="let cuDNN time its algorithms per bucket at load time. Default: on.")
    p.add_argument("--batch-buckets", metavar="N", type=_positive, nargs="+",
                   help="batch sizes a GPU instance pads to and warms up (the max batch size is always one). "
                        "Default: powers of two up to the max batch size.")
    p.add_argument("--image-model", choices=("auto", "ensemble", "fused"), default="auto",
                   help="what NAME_image is: ensemble (NAME_preprocess on CPU instances, then NAME) or fused (one "
                        "python model that decodes, preprocesses and classifies on NAME's device, nvJPEG on a GPU). "
                        "Default: auto = fused for --kind gpu, ensemble for cpu.")
    p.add_argument("--decode-device", choices=("cpu", "gpu"), default=None,
                   help="where JPEGs are decoded. With the ensemble, gpu (with --kind gpu) runs NAME_preprocess on "
                        "GPU instances and hands IMAGE over in GPU memory (EXPERIMENTAL: a GPU tensor handed between "
                        "stubs is not yet shown to work, docs/performance.md, GPU). With fused, cpu decodes with PIL only. "
                        "Default: gpu for a fused model on GPU, else cpu.")
    p.add_argument("--num-threads", metavar="N", type=_non_negative, default=0,
                   help="engine threads per CPU instance; 0: the engine's default (openvino: every core, one "
                        "left for Triton from 4 cores on). Default: 0.")
    p.add_argument("--formats", metavar="LIST", type=_formats, default=("python",),
                   help="comma list of python,onnx,torchscript: onnx/torchscript add NAME_onnx and "
                        "NAME_torchscript for the NGC container's native backends. Default: python.")
    p.add_argument("--engine", choices=("auto", *ENGINES), default="auto",
                   help="what the python backend runs; auto: openvino on CPU (the fastest measured on every CPU "
                        "we served on, docs/engines.md), torch on GPU. Default: auto.")
    p.add_argument("--verify", action="store_true",
                   help="run every export in-process against eager torch; fail above 1e-4. Default: off.")
    p.add_argument("--force", action="store_true", help="replace existing model directories. Default: off.")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object on stdout, its only output: the repository and the "
                        "models written, each with its role (classifier, preprocess, image, export, handler); on "
                        'failure {"error", "status"} and that exit status. The rest goes to stderr. Default: off.')
    return p


def _formats(text: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown format(s) {', '.join(unknown) or text!r}; "
                                         f"choose from {','.join(FORMATS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--json" not in argv:
        return _build(argv, {})
    # One JSON object on stdout and nothing else: everything else build-repo (or a library under it) writes to
    # stdout goes to stderr meanwhile, at the file descriptor (a C library's output too).
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    out: dict = {}
    try:
        status = _build(argv, out)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if not status and "models" not in out:  # --help
        return status
    result = BuildResult(error=out.get("error") or f"build-repo failed (exit status {status})", status=status) \
        if status else BuildResult(str(out["repository"]), tuple(out["models"]))
    print(result.to_json(), flush=True)
    return status


def _build(argv: list[str], out: dict) -> int:
    """build-repo itself; `out` gets what --json prints: the repository and the models written, or the error."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):  # argparse's one line, kept for the JSON error too
            args = parser().parse_args(argv)
    except SystemExit as exc:
        sys.stderr.write(errors.getvalue())
        out["error"] = errors.getvalue().strip().removeprefix("build-repo: error: ")
        return int(exc.code or 0)
    # SIGTERM ends the build like Ctrl-C: through build()'s cleanup, leaving no staging folder.
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="build-repo-") as workdir:
        try:
            return _main(args, Path(workdir), out)
        except InterruptedAfterSwap:
            return _failed(out, "interrupted; the new models were already in place", 130)
        except KeyboardInterrupt:
            return _failed(out, "interrupted; nothing was written", 130)


def _failed(out: dict, message, status: int) -> int:
    print(f"build-repo: {'' if status == 130 else 'error: '}{message}", file=sys.stderr)
    out["error"] = str(message)
    return status


def _written(out: dict, output: Path, configs: list[Path], roles: dict[str, str]) -> None:
    for path in configs:
        print(f"wrote {path}")
    out["repository"] = str(output.resolve())
    out["models"] = [BuiltModel(path.parent.name, roles[path.parent.name]) for path in configs]


def _roles(name: str) -> dict[str, str]:
    """What each model an image-path build may write is (common/build_result.py's ROLES)."""
    return names.build_roles(name)


def warm() -> None:
    """Import what a build imports lazily (torch, torchvision, the exporters): common/warm.py's warm process calls
    this once, so that each build it forks starts with them imported (the TorchServe front's builds)."""
    from builder import handler_model, plan, repository, sources  # noqa: F401


def _main(args, workdir: Path, out: dict) -> int:
    # Imported once the arguments are read: torch and torchvision (~7 s of CPU), which a bad argument never needs.
    from builder import handler_model, sources
    from builder.plan import check_source, make_plan, precision_note
    from builder.repository import build, check_free

    archive = None
    try:
        check_source(args)  # before reading an archive
        if args.from_mar is not None and handler_model.takes(args, mar.manifest(args.from_mar)):
            return _handler_model(args, out)
        if args.from_mar is not None:
            archive = mar.read(args.from_mar, workdir / "archive", int(args.max_archive_gb * (1 << 30)))
            if args.trust_model_code and sources.unmatched_torchscript(archive):
                # A TorchScript module no torchvision architecture holds: TorchServe's answer is its handler's
                print(f"{args.from_mar.name}: its TorchScript module is no torchvision classifier; serving it with "
                      "its own handler (--handler-path)")
                args.handler_path = True
                return _handler_model(args, out)
        plan = make_plan(args, archive)
    except cfg.ConfigError as exc:
        return _failed(out, exc, 2)
    except WeightsError as exc:  # an archive that cannot be read
        return _failed(out, exc, 1)
    try:
        check_free(args.output, plan.name, plan.options.formats, args.force, plan.options.image_model)  # early
        check_writable(args.output)
        classifier = sources.load(plan, archive)
        print(f"serving {plan.name}: {sources.describe(classifier)}; preprocessing {classifier.preprocessing}")
        _written(out, args.output, build(classifier, args.output, plan.options, force=args.force), _roles(plan.name))
        print(precision_note(plan.options))
    except (BuildError, WeightsError, cfg.ConfigError) as exc:
        return _failed(out, exc, 1)
    return 0


def _handler_model(args, out: dict) -> int:
    """--from-mar for an archive served with its own handler (builder/handler_model.py)."""
    from builder import handler_model

    try:
        configs = handler_model.build(args)
        _written(out, args.output, configs, {path.parent.name: "handler" for path in configs})
    except cfg.ConfigError as exc:
        return _failed(out, exc, 2)
    except (BuildError, WeightsError) as exc:
        return _failed(out, exc, 1)
    return 0


def _terminate(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":  # python -m builder.cli (serve-repo's builds): no last collection at exit (~0.6 s)
    import atexit
    import gc

    atexit.register(gc.freeze)
    sys.exit(main())
