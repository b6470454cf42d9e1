"""`build-repo`: export a torchvision classifier into a Triton model repository, atomically."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from builder.cliutil import OneLineParser
from builder import config as cfg
from builder.repository import ENGINES, BuildError, Options, build, check_free
from builder.weights import WEIGHT_CHOICES, WeightsError, classification_models, load_classifier

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
    p = OneLineParser(prog="build-repo", description=__doc__)
    p.add_argument("--model", default="resnet152", help="torchvision classification model. Default: resnet152.")
    p.add_argument("--weights", default="auto", metavar="|".join(WEIGHT_CHOICES) + "|PATH",
                   help="auto: pretrained DEFAULT if downloadable or cached, else random with a warning; "
                        "random: torch.manual_seed(SEED) then no weights; PATH: a state_dict file. Default: auto.")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights. Default: 0.")
    p.add_argument("--output", type=Path, default=Path("model_repository"),
                   help="model repository directory. Default: model_repository.")
    p.add_argument("--max-batch-size", "--batch-size", dest="max_batch_size", type=_non_negative,
                   default=cfg.DEFAULT_MAX_BATCH_SIZE,
                   help=f"largest batch Triton forms; 0 disables batching (TorchServe: batch_size). "
                        f"Default: {cfg.DEFAULT_MAX_BATCH_SIZE}.")
    delay = p.add_mutually_exclusive_group()
    delay.add_argument("--max-queue-delay-us", type=_non_negative, default=cfg.DEFAULT_MAX_QUEUE_DELAY_US,
                       help=f"longest a request waits for a batch to fill, in microseconds. "
                            f"Default: {cfg.DEFAULT_MAX_QUEUE_DELAY_US}.")
    delay.add_argument("--max-batch-delay-ms", dest="max_queue_delay_us", type=_delay_ms,
                       help="the same in milliseconds (TorchServe: max_batch_delay). Default: unset.")
    p.add_argument("--preferred-batch-size", type=_positive, nargs="+", default=[],
                   help="batch sizes the batcher prefers to send. Default: none (send up to the max).")
    p.add_argument("--instances", type=_positive, default=1, help="model instances (stub processes). Default: 1.")
    p.add_argument("--kind", choices=("auto", "cpu", "gpu"), default="auto",
                   help="instance kind; auto: gpu if torch sees CUDA here, else cpu. Default: auto.")
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
    try:
        if args.model not in classification_models():
            raise cfg.ConfigError(f"unknown torchvision classification model {args.model!r} "
                                  "(e.g. resnet18, resnet152, efficientnet_b0)")
        if args.weights not in WEIGHT_CHOICES and not Path(args.weights).is_file():
            raise cfg.ConfigError(f"--weights {args.weights!r} is neither one of {', '.join(WEIGHT_CHOICES)} "
                                  "nor an existing state_dict file")
        batching = cfg.Batching(args.max_batch_size, args.max_queue_delay_us, tuple(args.preferred_batch_size))
        probe = cfg.Tensor("IMAGE", "TYPE_FP32", (3, 224, 224))
        cfg.ModelSpec(args.model, (probe,), (probe,), batching=batching, instances=args.instances).validate()
    except cfg.ConfigError as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 2
    try:
        kind = _instance_kind(args.kind)
        engine = args.engine if args.engine != "auto" else ("torch" if kind == cfg.InstanceKind.GPU else "onnxruntime")
        options = Options(batching, kind, args.instances, args.num_threads, engine, args.formats, args.verify)
        check_free(args.output, args.model, args.formats, args.force)  # before the slow part
        classifier = load_classifier(args.model, args.weights, args.seed)
        for path in build(classifier, args.output, options, force=args.force):
            print(f"wrote {path}")
    except (BuildError, WeightsError, cfg.ConfigError) as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _instance_kind(kind: str) -> cfg.InstanceKind:
    if kind == "auto":
        import torch

        kind = "gpu" if torch.cuda.is_available() else "cpu"
    return cfg.InstanceKind.GPU if kind == "gpu" else cfg.InstanceKind.CPU


if __name__ == "__main__":
    sys.exit(main())
