"""`build-repo`: export an image classifier into a Triton model repository, atomically.

The classifier: a torchvision model name (--model), a TorchServe archive (--from-mar), or a model file
with a state_dict (--model-file + --weights)."""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from builder.cliutil import OneLineParser
from builder import config as cfg
from builder.repository import ENGINES, BuildError, Options, build, check_free, check_writable
from builder import custom, mar
from builder.weights import (IMAGENET, WEIGHT_CHOICES, Classifier, ModelCode, Preprocessing, WeightsError,
                             classification_models, load_classifier, read_state_dict)

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


def _delay_ms(text: str) -> int:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return round(value * 1000)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="build-repo", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="torchvision classification model. Default: resnet152 (unless --from-mar or "
                                   "--model-file).")
    p.add_argument("--from-mar", type=Path, metavar="FILE.mar",
                   help="migrate a TorchServe model archive: its weights (served with torchvision's code when they "
                        "fit a torchvision architecture exactly), index_to_name.json, handler preprocessing "
                        "(image_classifier) and model-config.yaml batching (flags override).")
    p.add_argument("--model-file", type=Path, metavar="FILE.py",
                   help="your model code (TorchServe's convention: one nn.Module class, no-argument constructor); "
                        "needs --weights PATH and the preprocessing (--preprocess or --resize/--crop/--mean/--std).")
    p.add_argument("--model-class", help="the class in --model-file (or the archive's model file) when it "
                                         "defines several. Default: the only one.")
    p.add_argument("--trust-model-code", action="store_true",
                   help="allow running the archive's model file when its weights fit no torchvision model. It "
                        "executes code from the archive: only for archives you trust. Default: off.")
    p.add_argument("--name", help="served model name (NAME, NAME_preprocess, NAME_image). Default: the model, "
                                  "the archive's model name, or the model file's name.")
    p.add_argument("--weights", metavar="|".join(WEIGHT_CHOICES) + "|PATH",
                   help="auto: pretrained DEFAULT if downloadable or cached, else random with a warning; "
                        "random: torch.manual_seed(SEED) then no weights; PATH: a state_dict file (loaded with "
                        "weights_only=True). Default: auto (--model); required PATH with --model-file.")
    p.add_argument("--labels", type=Path, metavar="FILE",
                   help="class names: index_to_name.json (TorchServe's shapes) or one name per line. Default: "
                        "torchvision's (--model), the archive's index_to_name.json, else class indices.")
    pre = p.add_argument_group("preprocessing: Resize -> CenterCrop -> Normalize, as the server and clients run it")
    pre.add_argument("--preprocess", choices=("imagenet",),
                     help=f"imagenet: TorchServe's image_classifier, {IMAGENET}. Default: the torchvision "
                          "weights' transforms(), or the archive handler's.")
    pre.add_argument("--resize", type=_positive, help="shorter side after resizing, in pixels.")
    pre.add_argument("--crop", type=_positive, help="side of the center crop the model sees, in pixels.")
    pre.add_argument("--mean", type=float, nargs=3, metavar=("R", "G", "B"), help="per-channel mean on [0, 1].")
    pre.add_argument("--std", type=float, nargs=3, metavar=("R", "G", "B"), help="per-channel std on [0, 1].")
    pre.add_argument("--interpolation", choices=("bilinear", "bicubic", "nearest", "nearest-exact", "lanczos",
                                                  "box", "hamming"),
                     help="resize filter. Default: bilinear (or the torchvision weights').")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights. Default: 0.")
    p.add_argument("--output", type=Path, default=Path("model_repository"),
                   help="model repository directory. Default: model_repository.")
    cpu, gpu = cfg.DEFAULTS[cfg.InstanceKind.CPU], cfg.DEFAULTS[cfg.InstanceKind.GPU]
    p.add_argument("--max-batch-size", "--batch-size", dest="max_batch_size", type=_non_negative,
                   help=f"largest batch Triton forms; 0 disables batching (TorchServe: batch_size). "
                        f"Default: {cpu.max_batch_size} (cpu), {gpu.max_batch_size} (gpu).")
    delay = p.add_mutually_exclusive_group()
    delay.add_argument("--max-queue-delay-us", type=_non_negative,
                       help=f"longest a request waits for a batch to fill, in microseconds. "
                            f"Default: {cpu.max_queue_delay_us} (cpu), {gpu.max_queue_delay_us} (gpu).")
    delay.add_argument("--max-batch-delay-ms", dest="max_queue_delay_us", type=_delay_ms,
                       help="the same in milliseconds (TorchServe: max_batch_delay). Default: unset.")
    p.add_argument("--preferred-batch-size", type=_positive, nargs="+",
                   help="batch sizes the batcher prefers to send. Default: none (cpu), the batch buckets (gpu).")
    p.add_argument("--max-queue-size", type=_non_negative,
                   help="requests that may wait for a batch; more are rejected at once (UNAVAILABLE, "
                        f"'Exceeds maximum queue size'). 0 is unbounded. Default: {cpu.max_queue_size} (cpu), "
                        f"{gpu.max_queue_size} (gpu).")
    p.add_argument("--queue-timeout-ms", type=_delay_ms,
                   help="longest a request may wait in the queue before --timeout-action; 0: no timeout. "
                        f"Default: {cpu.queue_timeout_ms:g} (cpu), {gpu.queue_timeout_ms:g} (gpu).")
    p.add_argument("--timeout-action", choices=("reject", "delay"), default="reject",
                   help="what a timed-out request gets: reject (an error) or delay (served after the others). "
                        "Default: reject.")
    p.add_argument("--allow-timeout-override", action="store_true",
                   help="let requests carry a shorter timeout of their own. Default: off.")
    p.add_argument("--instances", type=_positive,
                   help=f"model instances (stub processes). Default: {cpu.instances} (cpu), {gpu.instances} (gpu).")
    p.add_argument("--kind", choices=("auto", "cpu", "gpu"), default="auto",
                   help="instance kind; auto: gpu if torch sees CUDA here, else cpu. Default: auto.")
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="weights and activations on a GPU instance (fp32 convolutions use TF32 tensor cores, "
                        "torch's default); CPU instances run fp32. Default: fp32.")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture one CUDA graph per batch bucket at load time (engine torch/torchscript). "
                        "Default: on for gpu.")
    p.add_argument("--cudnn-benchmark", action=argparse.BooleanOptionalAction, default=True,
                   help="let cuDNN time its algorithms per bucket at load time. Default: on.")
    p.add_argument("--batch-buckets", type=_positive, nargs="+",
                   help="batch sizes a GPU instance pads to and warms up (the max batch size is always one). "
                        "Default: powers of two up to the max batch size.")
    p.add_argument("--decode-device", choices=("cpu", "gpu"), default="cpu",
                   help="gpu (with --kind gpu): NAME_preprocess runs on GPU instances, decodes JPEGs with nvJPEG "
                        "and hands IMAGE over in GPU memory. EXPERIMENTAL: in our one served H100 run its stub "
                        "died (README, GPU). cpu: decode on CPU instances. Default: cpu.")
    p.add_argument("--num-threads", type=_non_negative, default=0,
                   help="torch threads per CPU instance; 0 keeps torch's default. Default: 0.")
    p.add_argument("--formats", type=_formats, default=("python",),
                   help="comma list of python,onnx,torchscript: onnx/torchscript add NAME_onnx and "
                        "NAME_torchscript for the NGC container's native backends. Default: python.")
    p.add_argument("--engine", choices=("auto", *ENGINES), default="auto",
                   help="what the python backend runs; auto: onnxruntime on CPU (fastest here, see README), "
                        "torch on GPU. Default: auto.")
    p.add_argument("--verify", action="store_true",
                   help="run every export in-process against eager torch; fail above 1e-4. Default: off.")
    p.add_argument("--force", action="store_true", help="replace existing model directories. Default: off.")
    return p


def _formats(text: str) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown format(s) {', '.join(unknown) or text!r}; "
                                         f"choose from {','.join(FORMATS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # SIGTERM ends the build like Ctrl-C: through build()'s cleanup, leaving no staging folder.
    signal.signal(signal.SIGTERM, _terminate)
    with tempfile.TemporaryDirectory(prefix="build-repo-") as workdir:
        try:
            return _main(args, Path(workdir))
        except KeyboardInterrupt:
            print("build-repo: interrupted; nothing was written", file=sys.stderr)
            return 130


def _main(args, workdir: Path) -> int:
    archive = None
    try:
        _check_source(args)
        if args.from_mar is not None:
            archive = mar.read(args.from_mar, workdir / "archive")
            _archive_batching(args, archive)
        name = _served_name(args, archive)
        kind = _instance_kind(args.kind)
        options = _options(args, kind)
        probe = cfg.Tensor("IMAGE", "TYPE_FP32", (3, 224, 224))
        cfg.ModelSpec(name, (probe,), (probe,), batching=options.batching, instances=options.instances).validate()
        preprocessing = _preprocessing(args, archive)
    except cfg.ConfigError as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 2
    except WeightsError as exc:  # an archive that cannot be read
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 1
    try:
        check_free(args.output, name, args.formats, args.force)  # before the slow part
        check_writable(args.output)
        classifier = _classifier(args, archive, name, preprocessing)
        print(f"serving {name}: {_describe(classifier)}; preprocessing {classifier.preprocessing}")
        for path in build(classifier, args.output, options, force=args.force):
            print(f"wrote {path}")
    except (BuildError, WeightsError, cfg.ConfigError) as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _check_source(args) -> None:
    sources = [flag for flag, value in (("--model", args.model), ("--from-mar", args.from_mar),
                                        ("--model-file", args.model_file)) if value is not None]
    if len(sources) > 1:
        raise cfg.ConfigError(f"{' and '.join(sources)} both name the model: give one")
    if args.from_mar is not None:
        for flag, value in (("--weights", args.weights),):
            if value is not None:
                raise cfg.ConfigError(f"{flag} does not go with --from-mar: the archive holds the weights")
        return
    if args.model_file is not None:
        if not args.model_file.is_file():
            raise cfg.ConfigError(f"--model-file {str(args.model_file)!r} is not a file")
        if args.weights is None or args.weights in WEIGHT_CHOICES or not Path(args.weights).is_file():
            raise cfg.ConfigError("--model-file needs --weights PATH, an existing state_dict file")
        return
    if args.model_class is not None:
        raise cfg.ConfigError("--model-class goes with --model-file or --from-mar")
    args.model = args.model or "resnet152"
    args.weights = args.weights or "auto"
    if args.model not in classification_models():
        raise cfg.ConfigError(f"unknown torchvision classification model {args.model!r} "
                              "(e.g. resnet18, resnet152, efficientnet_b0)")
    if args.weights not in WEIGHT_CHOICES and not Path(args.weights).is_file():
        raise cfg.ConfigError(f"--weights {args.weights!r} is neither one of {', '.join(WEIGHT_CHOICES)} "
                              "nor an existing state_dict file")


def _served_name(args, archive) -> str:
    if args.name:
        return args.name
    if archive is not None:
        return archive.name
    return args.model_file.stem if args.model_file is not None else args.model


def _archive_batching(args, archive) -> None:
    """model-config.yaml's batchSize / maxBatchDelay (ms) / minWorkers, where no flag says otherwise."""
    if args.max_batch_size is None and archive.batch_size is not None:
        args.max_batch_size = archive.batch_size
    if args.max_queue_delay_us is None and archive.max_batch_delay_ms is not None:
        args.max_queue_delay_us = round(archive.max_batch_delay_ms * 1000)
    if args.instances is None and archive.workers:
        args.instances = archive.workers


def _preprocessing_flags(args) -> dict:
    given = {"resize": args.resize, "crop": args.crop, "mean": tuple(args.mean) if args.mean else None,
             "std": tuple(args.std) if args.std else None, "interpolation": args.interpolation}
    return {key: value for key, value in given.items() if value is not None}


def _preprocessing(args, archive) -> Preprocessing | None:
    """The flags over their base (the preset, or the archive handler's). None: the torchvision weights'
    transforms(), known once they load, with the flags applied then."""
    given = _preprocessing_flags(args)
    if args.preprocess == "imagenet" or (archive is not None and archive.image_classifier):
        return replace(IMAGENET, **given)
    if args.model is not None:
        return None
    missing = [f"--{key}" for key in ("resize", "crop", "mean", "std") if key not in given]
    if missing:
        what = (f"the archive's handler {archive.handler!r} is not TorchServe's image_classifier, so its "
                "preprocessing is unknown" if archive is not None else "a model file's preprocessing is unknown")
        raise cfg.ConfigError(f"{what}: give it with --preprocess imagenet ({IMAGENET}) or "
                              f"--resize, --crop, --mean and --std (missing {', '.join(missing)})")
    return Preprocessing(**given)


def _classifier(args, archive, name: str, preprocessing: Preprocessing | None) -> Classifier:
    """The slow part: load the weights (never executing code unless asked) and build the module."""
    labels = custom.load_labels(args.labels) if args.labels else None
    if args.model is not None:
        classifier = load_classifier(args.model, args.weights, args.seed)
        classifier.name = name
        classifier.preprocessing = preprocessing or replace(classifier.preprocessing, **_preprocessing_flags(args))
        if labels is not None:
            classifier.categories = custom.fit_labels(labels, len(classifier.categories), classifier.weights)
        return classifier
    if archive is not None:
        return _from_archive(args, archive, name, preprocessing, labels)
    code = ModelCode(args.model_file.resolve(), args.model_class or "")
    state = read_state_dict(Path(args.weights))
    return custom.code_classifier(code, state, name, args.weights, preprocessing, labels,
                                  source=f"model file {args.model_file.name}")


def _from_archive(args, archive, name: str, preprocessing: Preprocessing, labels) -> Classifier:
    state = read_state_dict(archive.serialized_file)
    if labels is None and archive.labels_file is not None:
        labels = custom.load_labels(archive.labels_file)
    label = f"{archive.path.name}:{archive.serialized_file.name}"
    source = f"TorchServe archive {archive.path.name} (handler {archive.handler})"
    match = None if args.model_class else custom.match_torchvision(state)
    if match is not None:
        architecture, classes = match
        return custom.torchvision_classifier(architecture, classes, state, name, label, preprocessing,
                                             custom.fit_labels(labels, classes, label), source)
    if archive.model_file is None:
        raise mar.ArchiveError(f"the weights in {archive.path.name} fit no torchvision classification model and "
                               "the archive has no model file to build them with")
    if not args.trust_model_code:
        raise mar.ArchiveError(f"the weights in {archive.path.name} fit no torchvision classification model, so "
                               f"serving them means running the archive's {archive.model_file.name}; pass "
                               "--trust-model-code if you trust its code (nothing from it was run)")
    code = ModelCode(archive.model_file, args.model_class or "", tuple(archive.extra_files))
    return custom.code_classifier(code, state, name, label, preprocessing, labels, source)


def _describe(c: Classifier) -> str:
    if c.code is not None:
        return f"{c.code.class_name} from {c.code.file.name}, weights {c.weights}, {len(c.categories)} classes"
    origin = f" ({c.source}: the weights fit torchvision's {c.architecture}, whose code serves them)" if c.source else ""
    return f"torchvision {c.architecture}, weights {c.weights}, {len(c.categories)} classes{origin}"


def _terminate(signum, frame):
    raise KeyboardInterrupt


def _options(args, kind: cfg.InstanceKind) -> Options:
    """The flags, with each unset one taken from the defaults for the instance kind."""
    from backends.batch_runner import buckets_for

    gpu, default = kind == cfg.InstanceKind.GPU, cfg.DEFAULTS[kind]
    engine = args.engine if args.engine != "auto" else ("torch" if gpu else "onnxruntime")
    if args.precision != "fp32" and not gpu:
        raise cfg.ConfigError(f"--precision {args.precision} needs --kind gpu; CPU instances run fp32")
    if args.precision != "fp32" and engine == "onnxruntime":
        raise cfg.ConfigError(f"--precision {args.precision} needs --engine torch or torchscript "
                              "(onnxruntime runs the fp32 export)")
    max_batch = default.max_batch_size if args.max_batch_size is None else args.max_batch_size
    buckets = tuple(buckets_for(max_batch)) if max_batch and gpu else ()
    if args.batch_buckets:
        if max(args.batch_buckets) > max(max_batch, 1):
            raise cfg.ConfigError(f"--batch-buckets {max(args.batch_buckets)} exceeds `max_batch_size` {max_batch}")
        buckets = tuple(sorted(set(args.batch_buckets) | {max(max_batch, 1)}))
    preferred = args.preferred_batch_size
    if preferred is None:
        preferred = list(buckets) if gpu and max_batch else []
    delay = default.max_queue_delay_us if args.max_queue_delay_us is None else args.max_queue_delay_us
    if args.decode_device == "gpu" and not gpu:
        raise cfg.ConfigError("--decode-device gpu needs --kind gpu")
    graphs = gpu and engine != "onnxruntime" if args.cuda_graphs is None else args.cuda_graphs
    if graphs and engine == "onnxruntime":
        raise cfg.ConfigError("--cuda-graphs needs --engine torch or torchscript")
    size = default.max_queue_size if args.max_queue_size is None else args.max_queue_size
    timeout = int(default.queue_timeout_ms * 1000) if args.queue_timeout_ms is None else args.queue_timeout_ms  # µs
    queue = None
    if max_batch and (size or timeout or args.allow_timeout_override or args.timeout_action != "reject"):
        queue = cfg.QueuePolicy(size, timeout, args.timeout_action.upper(), args.allow_timeout_override)
    return Options(cfg.Batching(max_batch, delay if max_batch else 0, tuple(preferred), queue), kind,
                   args.instances or default.instances, args.num_threads, engine, args.formats, args.verify,
                   args.precision, bool(graphs and gpu), args.cudnn_benchmark, buckets, args.decode_device)


def _instance_kind(kind: str) -> cfg.InstanceKind:
    if kind == "auto":
        import torch

        kind = "gpu" if torch.cuda.is_available() else "cpu"
    return cfg.InstanceKind.GPU if kind == "gpu" else cfg.InstanceKind.CPU


if __name__ == "__main__":
    sys.exit(main())
