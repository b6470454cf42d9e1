"""`build-repo`: export a torchvision classifier into a Triton model repository, atomically."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from builder import config as cfg
from builder.weights import WEIGHT_CHOICES, WeightsError, classification_models, crop_size, load_classifier

BACKENDS = Path(__file__).resolve().parent.parent / "backends"


class BuildError(RuntimeError):
    """The build cannot go on; the message is one line for the user."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, instead of argparse's usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


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
    p = _Parser(prog="build-repo", description=__doc__)
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
    p.add_argument("--force", action="store_true", help="replace existing model directories. Default: off.")
    return p


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
        cfg.ModelSpec(args.model, (_image(224),), (_logits(1000),), batching=batching).validate()
    except cfg.ConfigError as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 2
    try:
        for path in build(args, batching):
            print(f"wrote {path}")
    except (BuildError, WeightsError, cfg.ConfigError) as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 1
    return 0


def build(args: argparse.Namespace, batching: cfg.Batching) -> list[Path]:
    """Write every model directory into a temporary folder, then move them into place."""
    output: Path = args.output
    names = [args.model]
    existing = [output / name for name in names if (output / name).exists()]
    if existing and not args.force:
        raise BuildError(f"{existing[0]} already exists; pass --force to replace it")
    classifier = load_classifier(args.model, args.weights, args.seed)
    kind = _instance_kind(args.kind)
    output.mkdir(parents=True, exist_ok=True)
    # The staging folder sits beside the repository (same filesystem: rename is atomic) but not
    # inside it, so a server watching the repository never sees a half-written model.
    staging = Path(tempfile.mkdtemp(prefix=f".{output.resolve().name}-build-", dir=output.resolve().parent))
    try:
        _write_classifier(staging / args.model, classifier, batching, kind, args)
        return [_swap_in(staging / name, output / name) / "config.pbtxt" for name in names]
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_classifier(model_dir: Path, classifier, batching, kind, args) -> None:
    import torch

    version = model_dir / "1"
    version.mkdir(parents=True)
    side = crop_size(classifier.preprocess)
    spec = cfg.ModelSpec(
        name=classifier.name,
        inputs=(_image(side),),
        outputs=(_logits(len(classifier.categories), "labels.txt"),),
        format=cfg.Format.PYTHON,
        batching=batching,
        kind=kind,
        instances=args.instances,
        parameters={
            # Inputs stay where they arrive (GPU memory on a GPU instance): DLPack, no copy.
            "FORCE_CPU_ONLY_INPUT_TENSORS": "no",
            "torchvision_model": classifier.name,
            "weights": classifier.weights,
            "weights_file": "weights.pt",
            "num_classes": str(len(classifier.categories)),
            "num_threads": str(args.num_threads),
            # Clients and the preprocess model rebuild the exact transforms() from this.
            "preprocess_weights": str(classifier.preprocess),
        },
    )
    config = spec.to_proto()
    torch.save(classifier.module.state_dict(), version / "weights.pt")
    shutil.copyfile(BACKENDS / "classifier.py", version / "model.py")
    (model_dir / "labels.txt").write_text("\n".join(classifier.categories) + "\n")
    cfg.write_config(config, model_dir)


def _swap_in(built: Path, target: Path) -> Path:
    if target.exists():
        retired = built.with_name(built.name + ".old")
        target.rename(retired)  # kept until the new one is in place, so a failure loses nothing
        built.rename(target)
    else:
        built.rename(target)
    return target


def _instance_kind(kind: str) -> cfg.InstanceKind:
    if kind == "auto":
        import torch

        kind = "gpu" if torch.cuda.is_available() else "cpu"
    return cfg.InstanceKind.GPU if kind == "gpu" else cfg.InstanceKind.CPU


def _image(side: int) -> cfg.Tensor:
    return cfg.Tensor("IMAGE", "TYPE_FP32", (3, side, side))


def _logits(classes: int, labels: str = "") -> cfg.Tensor:
    return cfg.Tensor("LOGITS", "TYPE_FP32", (classes,), label_filename=labels)


if __name__ == "__main__":
    sys.exit(main())
