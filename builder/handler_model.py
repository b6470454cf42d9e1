"""A TorchServe archive's handler, unchanged, as one python model: NAME/config.pbtxt + 1/{model.py, archive/}."""
from __future__ import annotations

import compileall
import shutil
import tempfile
from pathlib import Path

from builder import config as cfg
from builder import mar
from common import precision as precisions
from common.archive import ModelSettings, config_name
from common.contract import BODY, HANDLER_OUTPUTS
from builder.plan import instance_kind, preprocessing_overrides
from builder.repository import HANDLER_FILES, model_names
from builder.staging import BuildError, check_writable, remove_stale_staging, signals_deferred, staging_prefix, swap_in

ARCHIVE_DIR = "archive"  # the unpacked archive in the version folder (backends/handler.py's ARCHIVE_DIR)


def takes(args, manifest: dict) -> bool:
    """Whether `--from-mar` serves the archive's own handler: asked for (--handler-path), or a handler that is not
    image_classifier with no preprocessing given (giving it keeps the image path, with that preprocessing)."""
    handler = str(manifest["model"].get("handler") or "")
    if args.handler_path:
        return True
    if handler.removesuffix(".py") in mar.IMAGE_CLASSIFIER:
        return False
    return not (args.preprocess or preprocessing_overrides(args))


def build(args, report=print) -> list[Path]:
    """Unpack the archive into a staging folder beside the repository, write NAME's config, swap it in."""
    path, output = args.from_mar, args.output
    model = mar.manifest(path)["model"]
    handler = str(model.get("handler") or "")
    if not args.trust_model_code:
        what = "" if args.handler_path else " is not TorchServe's image_classifier:"
        raise cfg.ConfigError(f"the archive's handler {handler!r}{what} serving it runs the archive's code; pass "
                              "--trust-model-code (only for archives you trust)")
    name = args.name or model["modelName"]
    retired = [n for n in model_names(name, ("onnx", "torchscript")) if n != name]
    existing = [output / n for n in [name, *retired] if (output / n).exists()]
    if existing and not args.force:
        raise BuildError(f"{existing[0]} already exists; pass --force to replace it")
    check_writable(output)
    remove_stale_staging(output)
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(output), dir=output.resolve().parent))
    try:
        with signals_deferred():
            version = staging / name / "1"
            (version / ARCHIVE_DIR).mkdir(parents=True)
            mar.unpack(path, version / ARCHIVE_DIR, int(args.max_archive_gb * (1 << 30)))
            settings = _model_config(version / ARCHIVE_DIR, model)
            spec = _spec(name, args, settings, handler)
            cfg.write_config(spec.to_proto(), staging / name)
            for target, source in HANDLER_FILES.items():
                shutil.copyfile(Path(__file__).resolve().parent.parent / source, version / target)
            compileall.compile_dir(staging / name, quiet=2)  # as repository.build does (Triton's modified check)
        engine = spec.parameters["handler_engine"]
        runs = "eager PyTorch, as TorchServe" if engine == "eager" else \
            f"OpenVINO ({spec.parameters['openvino_precision_hint'] or 'its choice'}) once it matched eager PyTorch on the first batch"
        report(f"serving {name}: TorchServe handler {handler!r} of {path.name}, max_batch_size "
               f"{spec.batching.max_batch_size}, max_queue_delay {spec.batching.max_queue_delay_us} us; its model "
               f"runs on {runs}")
        requirements = _requirements(version / ARCHIVE_DIR, model)
        if requirements:
            report(requirements)
        with signals_deferred():
            try:
                written = swap_in(staging / name, output / name) / "config.pbtxt"
                for old in retired:  # an earlier image-path build's: NAME_image would route to a NAME it no longer fits
                    if (output / old).exists():
                        (output / old).rename(staging / f"{old}.old")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return [written]
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _model_config(folder: Path, model: dict) -> ModelSettings:
    """The archive's model-config.yaml (its manifest's configFile), as TorchServe reads it."""
    return mar.read_settings(folder / config_name(model))


def _spec(name: str, args, settings: ModelSettings, handler: str) -> cfg.ModelSpec:
    """max_batch_size: the flag, else the archive's batchSize, else 8; the delay: the flag, else maxBatchDelay,
    else the kind's default; instances: the flag, else minWorkers, else the kind's default."""
    kind = instance_kind(args.kind)
    default = cfg.DEFAULTS[kind]
    batch = _first(args.max_batch_size, settings.batch_size, cfg.DEFAULT_MAX_BATCH_SIZE)
    delay_ms = settings.max_batch_delay
    delay = _first(args.max_queue_delay_us, None if delay_ms is None else round(delay_ms * 1000),
                   default.max_queue_delay_us)
    instances = _first(args.instances, settings.min_workers, default.instances)
    body = cfg.Tensor(BODY, "TYPE_STRING", (1,))
    outputs = tuple(cfg.Tensor(name, "TYPE_STRING" if dtype == "BYTES" else f"TYPE_{dtype}", (1,))
                    for name, dtype in HANDLER_OUTPUTS)
    return cfg.ModelSpec(name, (body,), outputs, cfg.Format.PYTHON, cfg.Batching(batch, delay if batch else 0),
                         kind, max(instances, 1), {"torchserve_handler": handler, "archive_dir": ARCHIVE_DIR,
                                                   **_engine(args, kind)})


HANDLER_PRECISIONS = ("fp32", "auto", "bf16")  # what OpenVINO runs for the handler's model (fp32: PyTorch's answers)


def _engine(args, kind: cfg.InstanceKind) -> dict[str, str]:
    """What runs the handler's model: OpenVINO on CPU instances (--engine auto or openvino), from the first batch
    on, once its answers on that batch matched eager PyTorch's within the precision's tolerance; eager PyTorch as
    TorchServe runs it on GPU instances or with --engine torch."""
    cpu = kind == cfg.InstanceKind.CPU
    engine = args.engine if args.engine != "auto" else ("openvino" if cpu else "torch")
    precision = args.precision or precisions.DEFAULT
    if engine not in ("torch", "openvino"):
        raise cfg.ConfigError(f"--engine {engine} does not run a TorchServe handler's model: --engine openvino "
                              "(CPU, the default there) or torch (eager PyTorch, as TorchServe runs it)")
    if engine == "openvino" and not cpu:
        raise cfg.ConfigError("--engine openvino runs on CPU instances: use --kind cpu")
    if engine == "torch":
        if precision != precisions.DEFAULT:
            raise cfg.ConfigError(f"--precision {precision} with the handler path needs --engine openvino: eager "
                                  "PyTorch runs the handler's model as the handler made it")
        return {"handler_engine": "eager"}
    if precision not in HANDLER_PRECISIONS:
        raise cfg.ConfigError(f"--precision {precision} is not one the handler path runs: "
                              f"{', '.join(HANDLER_PRECISIONS)}")
    hint = precisions.OPENVINO_HINTS[precision] or ""  # none: OpenVINO's choice for the serving CPU
    return {"handler_engine": "openvino", "openvino_precision_hint": hint,
            "engine_tolerance": repr(precisions.TOLERANCE[precision])}


def _requirements(folder: Path, model: dict) -> str:
    """One line on the archive's requirements file: reported, never installed (it would run pip on our behalf)."""
    name = model.get("requirementsFile") or "requirements.txt"
    path = folder / name
    if not path.is_file():
        return ""
    listed = [line.strip() for line in path.read_text(errors="replace").splitlines()
              if line.strip() and not line.strip().startswith("#")]
    return (f"the archive's {name} lists {len(listed)} package(s) ({', '.join(listed[:8])}"
            f"{', ...' if len(listed) > 8 else ''}): not installed; install them where tritonserver runs")


def _first(*values):
    return next(value for value in values if value is not None)
