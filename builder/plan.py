"""build-repo's flags (and a TorchServe archive's settings) checked and resolved into one Plan, args untouched.

Which classifier: exactly one source (--model, --from-mar, --model-file). Every unset batching flag takes
the archive's model-config.yaml value, else the default for the instance kind.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from builder import config as cfg
from builder.mar import Archive
from builder.repository import Options
from builder.options import IMAGENET, WEIGHT_CHOICES, Preprocessing
from builder.weights import classification_models
from common import precision as precisions
from common.contract import DECODE_DEVICE, IMAGE, buckets_for, parse_buckets


@dataclass(frozen=True)
class Plan:
    """What to build: where the classifier comes from, under which name, with which options."""

    source: str                        # "torchvision", "mar" or "model-file"
    name: str
    options: Options
    model: str | None = None           # torchvision architecture (source torchvision)
    weights: str | None = None         # auto | random | DEFAULT | ... | a state_dict path
    preprocessing: Preprocessing | None = None  # None: the torchvision weights' transforms() + overrides
    overrides: dict | None = None      # preprocessing flags given (resize, crop, mean, std, interpolation)
    model_file: Path | None = None     # source model-file: the user's code
    model_class: str | None = None     # the class in the model file (or the archive's) when it defines several
    labels: Path | None = None         # class names file, over the source's own
    seed: int = 0                      # for random weights
    trust_model_code: bool = False     # may the archive's model file run


def check_source(args) -> str:
    """Which source the flags name (exactly one), and that its companion flags fit it."""
    sources = [flag for flag, value in (("--model", args.model), ("--from-mar", args.from_mar),
                                        ("--model-file", args.model_file)) if value is not None]
    if len(sources) > 1:
        raise cfg.ConfigError(f"{' and '.join(sources)} both name the model: give one")
    if args.from_mar is not None:
        if args.weights is not None:
            raise cfg.ConfigError("--weights does not go with --from-mar: the archive holds the weights")
        return "mar"
    if args.model_file is not None:
        if not args.model_file.is_file():
            raise cfg.ConfigError(f"--model-file {str(args.model_file)!r} is not a file")
        if args.weights is None or args.weights in WEIGHT_CHOICES or not Path(args.weights).is_file():
            raise cfg.ConfigError("--model-file needs --weights PATH, an existing state_dict file")
        return "model-file"
    if args.model_class is not None:
        raise cfg.ConfigError("--model-class goes with --model-file or --from-mar")
    model, weights = args.model or "resnet152", args.weights or "auto"
    if model not in classification_models():
        raise cfg.ConfigError(f"unknown torchvision classification model {model!r} "
                              "(e.g. resnet18, resnet152, efficientnet_b0)")
    if weights not in WEIGHT_CHOICES and not Path(weights).is_file():
        raise cfg.ConfigError(f"--weights {weights!r} is neither one of {', '.join(WEIGHT_CHOICES)} "
                              "nor an existing state_dict file")
    return "torchvision"


def make_plan(args, archive: Archive | None = None) -> Plan:
    """The whole plan, or ConfigError naming the flag that is wrong. Nothing slow runs here."""
    source = check_source(args)
    name = args.name or (archive.name if archive is not None else
                         args.model_file.stem if args.model_file is not None else args.model or "resnet152")
    options = _options(args, instance_kind(args.kind), archive)
    cfg.ModelSpec(name, (_probe(),), (_probe(),), batching=options.batching, instances=options.instances).validate()
    overrides = preprocessing_overrides(args)
    common = dict(overrides=overrides, model_class=args.model_class, labels=args.labels, seed=args.seed,
                  trust_model_code=args.trust_model_code)
    if source == "torchvision":
        return Plan(source, name, options, args.model or "resnet152", args.weights or "auto",
                    _preset(args, archive, overrides), **common)
    preprocessing = _preset(args, archive, overrides) or _explicit(overrides, archive)
    return Plan(source, name, options, weights=args.weights, preprocessing=preprocessing,
                model_file=args.model_file, **common)


def instance_kind(kind: str) -> cfg.InstanceKind:
    if kind == "auto":
        import torch

        kind = "gpu" if torch.cuda.is_available() else "cpu"
    return cfg.InstanceKind.GPU if kind == "gpu" else cfg.InstanceKind.CPU


def preprocessing_overrides(args) -> dict:
    given = {"resize": args.resize, "crop": args.crop, "mean": tuple(args.mean) if args.mean else None,
             "std": tuple(args.std) if args.std else None, "interpolation": args.interpolation}
    return {key: value for key, value in given.items() if value is not None}


def _probe() -> cfg.Tensor:
    return cfg.Tensor(IMAGE, "TYPE_FP32", (3, 224, 224))


def _preset(args, archive: Archive | None, overrides: dict) -> Preprocessing | None:
    """TorchServe's image_classifier preprocessing (asked for, or the archive's handler) with the flags over it."""
    if args.preprocess == "imagenet" or (archive is not None and archive.image_classifier):
        return replace(IMAGENET, **overrides)
    return None


def _explicit(overrides: dict, archive: Archive | None) -> Preprocessing:
    """A model file's or a custom handler's preprocessing, which only the flags can give."""
    missing = [f"--{key}" for key in ("resize", "crop", "mean", "std") if key not in overrides]
    if missing:
        what = (f"the archive's handler {archive.handler!r} is not TorchServe's image_classifier, so its "
                "preprocessing is unknown" if archive is not None else "a model file's preprocessing is unknown")
        raise cfg.ConfigError(f"{what}: give it with --preprocess imagenet ({IMAGENET}) or "
                              f"--resize, --crop, --mean and --std (missing {', '.join(missing)})")
    return Preprocessing(**overrides)


def _options(args, kind: cfg.InstanceKind, archive: Archive | None) -> Options:
    """The flags, each unset one taken from the archive's model-config.yaml, else the kind's default."""
    gpu, default = kind == cfg.InstanceKind.GPU, cfg.DEFAULTS[kind]
    engine = args.engine if args.engine != "auto" else ("torch" if gpu else "openvino")
    precision = args.precision or precisions.DEFAULT
    try:
        precisions.check(precision, engine, "gpu" if gpu else "cpu")
    except precisions.PrecisionError as exc:
        raise cfg.ConfigError(str(exc)) from None
    if (precision == "int8") != (args.calibration is not None):
        raise cfg.ConfigError("--precision int8 needs --calibration DIR (images like the ones you will serve)"
                              if precision == "int8" else "--calibration goes with --precision int8")
    if args.calibration is not None and not args.calibration.is_dir():
        raise cfg.ConfigError(f"--calibration {str(args.calibration)!r} is not a folder")
    max_batch = _first_set(args.max_batch_size, archive and archive.batch_size, default.max_batch_size)
    buckets = tuple(buckets_for(max_batch)) if max_batch and gpu else ()
    if args.batch_buckets:
        if max(args.batch_buckets) > max(max_batch, 1):
            raise cfg.ConfigError(f"--batch-buckets {max(args.batch_buckets)} exceeds `max_batch_size` {max_batch}")
        buckets = tuple(parse_buckets(",".join(map(str, args.batch_buckets)), max(max_batch, 1)))
    preferred = args.preferred_batch_size
    if preferred is None:
        preferred = list(buckets) if gpu and max_batch else []
    archive_delay = (round(archive.max_batch_delay_ms * 1000)
                     if archive is not None and archive.max_batch_delay_ms is not None else None)
    delay = _first_set(args.max_queue_delay_us, archive_delay, default.max_queue_delay_us)
    if args.decode_device == "gpu" and not gpu:
        raise cfg.ConfigError("--decode-device gpu needs --kind gpu")
    image_model = args.image_model if args.image_model != "auto" else ("fused" if gpu else "ensemble")
    decode_device = args.decode_device or (DECODE_DEVICE[image_model] if gpu else "cpu")
    graphs = gpu and engine != "onnxruntime" if args.cuda_graphs is None else args.cuda_graphs
    if graphs and engine == "onnxruntime":
        raise cfg.ConfigError("--cuda-graphs needs --engine torch or torchscript")
    size = _first_set(args.max_queue_size, None, default.max_queue_size)
    timeout_us = _first_set(args.queue_timeout_us, None, int(default.queue_timeout_ms * 1000))
    queue = None
    if max_batch and (size or timeout_us or args.allow_timeout_override or args.timeout_action != "reject"):
        queue = cfg.QueuePolicy(size, timeout_us, args.timeout_action.upper(), args.allow_timeout_override)
    instances = args.instances or (archive.workers if archive is not None and archive.workers else None)
    return Options(batching=cfg.Batching(max_batch, delay if max_batch else 0, tuple(preferred), queue),
                   kind=kind, instances=instances or default.instances, num_threads=args.num_threads,
                   engine=engine, formats=args.formats, verify=args.verify, precision=precision,
                   cuda_graphs=bool(graphs and gpu), cudnn_benchmark=args.cudnn_benchmark, buckets=buckets,
                   decode_device=decode_device, calibration=args.calibration, image_model=image_model,
                   input_dtype=args.input_dtype)


def precision_note(options: Options) -> str:
    """build-repo's last words on precision: what will serve, how it compares with eager PyTorch, and the flag
    for the faster one (the README's figures: OpenVINO bf16 2.3-4x fp32 in-process on 2 cores)."""
    from common.cpu import cpu_bf16

    if options.kind == cfg.InstanceKind.GPU:
        if options.precision == "fp32":
            return ("precision fp32 (TF32 convolutions, as eager PyTorch on a GPU): answers as your PyTorch does. "
                    "Faster: --precision fp16 or bf16.")
        return f"precision {options.precision}: faster than fp32, logits differ from eager PyTorch's in the 3rd digit."
    here = "this CPU computes bf16 natively" if cpu_bf16() else "this CPU has no native bf16 (auto stays fp32 here)"
    if options.precision == "fp32":
        faster = ("--precision auto (bf16 on a CPU with AMX or AVX512-BF16; "
                  f"{here}) or --precision int8 --calibration DIR (checked against fp32 on DIR's images)"
                  if options.engine == "openvino" else "--engine openvino with --precision auto or int8")
        return f"precision fp32: answers as your PyTorch does (within 1e-5 of the logits' range). Faster: {faster}."
    if options.precision == "auto":
        return (f"precision auto: bf16 where the serving CPU has AMX or AVX512-BF16 ({here}); logits then move "
                "by up to ~1e-2 of their range and near-ties can swap. --precision fp32 answers as PyTorch does.")
    return (f"precision {options.precision}: faster; answers differ from eager PyTorch's (int8 was checked against "
            "fp32 above). --precision fp32 answers as PyTorch does.")


def _first_set(*values):
    return next(value for value in values if value is not None)
