"""`build-repo`: export a torchvision classifier into a Triton model repository, atomically."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from builder.cliutil import OneLineParser
from builder import config as cfg
from builder.repository import ENGINES, BuildError, Options, build, check_free, check_writable
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
    try:
        if args.model not in classification_models():
            raise cfg.ConfigError(f"unknown torchvision classification model {args.model!r} "
                                  "(e.g. resnet18, resnet152, efficientnet_b0)")
        if args.weights not in WEIGHT_CHOICES and not Path(args.weights).is_file():
            raise cfg.ConfigError(f"--weights {args.weights!r} is neither one of {', '.join(WEIGHT_CHOICES)} "
                                  "nor an existing state_dict file")
        kind = _instance_kind(args.kind)
        options = _options(args, kind)
        probe = cfg.Tensor("IMAGE", "TYPE_FP32", (3, 224, 224))
        cfg.ModelSpec(args.model, (probe,), (probe,), batching=options.batching,
                      instances=options.instances).validate()
    except cfg.ConfigError as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 2
    # SIGTERM ends the build like Ctrl-C: through build()'s cleanup, leaving no staging folder.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        check_free(args.output, args.model, args.formats, args.force)  # before the slow part
        check_writable(args.output)
        classifier = load_classifier(args.model, args.weights, args.seed)
        for path in build(classifier, args.output, options, force=args.force):
            print(f"wrote {path}")
    except (BuildError, WeightsError, cfg.ConfigError) as exc:
        print(f"build-repo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("build-repo: interrupted; nothing was written", file=sys.stderr)
        return 130
    return 0


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
