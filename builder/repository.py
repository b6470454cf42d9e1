"""Write a classifier's model directories (classifier, preprocess, ensemble, exports) atomically."""
from __future__ import annotations

import compileall
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from builder import config as cfg
from builder import export
from builder.staging import (BuildError, InterruptedAfterSwap, check_writable, remove_stale_staging,  # noqa: F401
                             signals_deferred, staging_prefix, swap_in)
from builder.weights import Classifier
from common import names
from common.contract import IMAGE, IMAGE_BYTES, IMAGE_INPUTS, LOGITS

_ROOT = Path(__file__).resolve().parent.parent
# What each python model's version folder holds: model.py and the modules it imports from beside it.
CLASSIFIER_FILES = {"model.py": "backends/classifier.py", "batch_runner.py": "backends/batch_runner.py",
                    "engines.py": "backends/engines.py", "triton_io.py": "backends/triton_io.py",
                    "contract.py": "common/contract.py", "model_code.py": "common/model_code.py",
                    "cpu.py": "common/cpu.py", "messages.py": "common/messages.py",
                    "precision.py": "common/precision.py", "stage_clock.py": "backends/stage_clock.py"}
PREPROCESS_FILES = {"model.py": "backends/preprocess.py", "decoding.py": "common/decoding.py",
                    "triton_io.py": "backends/triton_io.py", "contract.py": "common/contract.py",
                    "messages.py": "common/messages.py", "stage_clock.py": "backends/stage_clock.py",
                    "transforms.py": "common/transforms.py"}
# NAME_image as one python model (--image-model fused): its model.py runs the two above, unchanged, in one stub.
FUSED_FILES = {**CLASSIFIER_FILES, **PREPROCESS_FILES, "model.py": "backends/fused.py",
               "classifier.py": "backends/classifier.py", "preprocess.py": "backends/preprocess.py"}
# A TorchServe archive's handler as a model (builder/handler_model.py): ts_worker imports only TorchServe's ts;
# model.py the tensor names from contract.py.
HANDLER_FILES = {"model.py": "backends/handler.py", "ts_worker.py": "backends/ts_worker.py",
                 "ts_engine.py": "backends/ts_engine.py", "contract.py": "common/contract.py"}
CODE_DIR = "model_code"  # the user's model file in the version folder (engine torch)
ENGINE_ARTIFACT = {"torchscript": "torchscript", "onnxruntime": "onnx", "openvino": "onnx"}  # engine -> its export


@dataclass(frozen=True)
class Options:
    batching: cfg.Batching
    kind: cfg.InstanceKind
    instances: int = 1
    num_threads: int = 0
    engine: str = "torch"
    formats: tuple[str, ...] = ("python",)
    verify: bool = False
    precision: str = "fp32"
    cuda_graphs: bool = False
    cudnn_benchmark: bool = True
    buckets: tuple[int, ...] = ()  # batch sizes a GPU instance pads to (and captures graphs for)
    decode_device: str = "cpu"  # gpu: NAME_preprocess on GPU instances decodes JPEGs there (experimental)
    calibration: Path | None = None  # precision int8: the images that calibrate and check the quantized model
    input_dtype: str = "fp32"  # NAME's one image input (contract.IMAGE_INPUTS), also the ensemble's hop
    image_model: str = "ensemble"  # fused: NAME_image decodes, preprocesses and classifies in one stub


def model_names(name: str, formats: tuple[str, ...], image_model: str = "ensemble") -> list[str]:
    """The models a build writes: only what serves (the fused image model needs no NAME_preprocess, whose
    stub would import torch and hold memory with nothing routed to it)."""
    written = [name, names.image_model(name)] + ([names.named(name, "preprocess")] if image_model == "ensemble" else [])
    return written + [names.named(name, fmt) for fmt in names.EXPORTS if fmt in formats]


def retired_names(name: str, formats: tuple[str, ...], image_model: str) -> list[str]:
    """Models of this name that an earlier build may have written and this one does not (--force)."""
    every = model_names(name, ("onnx", "torchscript"), "ensemble")
    return [n for n in every if n not in model_names(name, formats, image_model)]


def check_free(output: Path, name: str, formats: tuple[str, ...], force: bool,
               image_model: str = "ensemble") -> list[str]:
    """The model directories a build writes; refuse if one exists (or one it would retire) and `force` is off."""
    served = model_names(name, formats, image_model)
    existing = [output / n for n in served + retired_names(name, formats, image_model) if (output / n).exists()]
    if existing and not force:
        raise BuildError(f"{existing[0]} already exists; pass --force to replace it")
    return served


def build(classifier: Classifier, output: Path, options: Options, force: bool = False,
          report=print) -> list[Path]:
    """Write every model directory into a staging folder, verify, then move them into place."""
    served = check_free(output, classifier.name, options.formats, force, options.image_model)
    check_writable(output)
    remove_stale_staging(output)
    # The staging folder sits beside the repository (same filesystem: rename is atomic) but not
    # inside it, so a server watching the repository never sees a half-written model.
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(output), dir=output.resolve().parent))
    try:
        with signals_deferred():
            artifacts = _export(classifier, staging / "exports", options)
        if options.precision == "int8":
            artifacts["onnx_int8"] = _int8(classifier, artifacts["onnx"], staging / "exports", options.calibration,
                                           report)
        if options.verify:
            exact = {name: path for name, path in artifacts.items() if name in ("onnx", "torchscript")}
            serving = None  # the engine and precision that will serve, as they will run
            if options.engine == "openvino":
                serving = (options.precision, artifacts["onnx_int8" if options.precision == "int8" else "onnx"])
            errors = export.verify(classifier.module, exact, classifier.crop, openvino=serving)
            report(export.error_table(errors))
            bad = [f"{name} ({error:.1e} > {export.tolerance(name):g})" for name, error in errors.items()
                   if error > export.tolerance(name)]
            if bad:
                raise BuildError(f"{', '.join(bad)} differ from eager torch; nothing was written")
        _write_all(staging, classifier, options, artifacts)
        for name in served:
            # Bytecode written now, not by the stubs at the first load: Triton counts files newer than a load as
            # a modified version, and a later load of a modified version (serve-repo replacing a dead stub) is
            # a whole new copy of the model instead of an update of just the dead instance's group.
            compileall.compile_dir(staging / name, quiet=1)
        # Held from the first rename to the staging folder's last file: cut short, the swap leaves a repository
        # half old, half new, or a previous model renamed into the staging folder and removed with it.
        with signals_deferred(InterruptedAfterSwap):
            try:
                written = [swap_in(staging / name, output / name) / "config.pbtxt" for name in served]
                for name in retired_names(classifier.name, options.formats, options.image_model):
                    # Written by an earlier build, served by nothing now: a server loading it would start its stub.
                    if (output / name).exists():
                        (output / name).rename(staging / f"{name}.old")  # removed with the staging folder
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return written
    finally:
        if staging.exists():  # a failed or interrupted build's: finished even if another signal comes
            with signals_deferred():
                shutil.rmtree(staging, ignore_errors=True)


def _export(classifier: Classifier, folder: Path, options: Options) -> dict[str, Path]:
    """Each ONNX / TorchScript artifact the formats or the engine need, exported once."""
    wanted = {fmt for fmt in options.formats if fmt != "python"}
    if options.engine in ENGINE_ARTIFACT:
        wanted.add(ENGINE_ARTIFACT[options.engine])
    folder.mkdir()
    side = classifier.crop
    artifacts = {}
    try:
        if "onnx" in wanted:
            artifacts["onnx"] = export.export_onnx(classifier.module, folder / "model.onnx", side)
        if "torchscript" in wanted:
            artifacts["torchscript"] = export.export_torchscript(classifier.module, folder / "model.pt", side)
    except export.ExportError as exc:
        raise BuildError(str(exc)) from exc
    except Exception as exc:  # an exporter's own failure on an unusual architecture
        raise BuildError(f"export of {classifier.name} failed: {type(exc).__name__}: {exc}") from exc
    return artifacts


def _int8(c: Classifier, onnx_path: Path, folder: Path, calibration: Path, report) -> Path:
    """The ONNX export quantized on the calibration images, then checked against fp32 the way it will run
    (OpenVINO) on every 4th of them, held out of the calibration (all of them when there are fewer than 4);
    a quantized model that fails builder.accuracy's gate is never written."""
    from builder import accuracy, quantize

    try:
        files = quantize.calibration_files(calibration)
        held = files[::4] if len(files) >= 4 else files
        used = [path for path in files if path not in held] or files
        batches = quantize.batched([quantize.load_image(path) for path in used], c.preprocessing)
        quantized = quantize.quantize_int8(onnx_path, folder / "model_int8.onnx", batches)
        check = quantize.preprocess([quantize.load_image(path) for path in held], c.preprocessing)
        result = accuracy.check(export.run_onnx(onnx_path, check), export.run_openvino(quantized, check),
                                [path.name for path in held], label="int8")
    except (quantize.QuantizeError, accuracy.AccuracyError) as exc:
        raise BuildError(f"int8: {exc}; nothing was written") from None
    report(f"int8: calibrated on {len(used)} images, checked on {len(held)} against fp32: same top-1 on all, "
           f"largest probability difference {max(result['max_prob_diff']):.3f} (allowed {accuracy.MAX_PROB_DIFF:g})")
    return quantized


def _write_all(staging: Path, c: Classifier, options: Options, artifacts: dict[str, Path]) -> None:
    side = c.crop
    labels = "\n".join(c.categories) + "\n"
    image, logits = _image(side), cfg.Tensor(LOGITS, "TYPE_FP32", (len(c.categories),), "labels.txt")
    common, named = _provenance(c), _labels_parameter(c)

    version = _model_dir(staging / c.name, labels)
    torch.save(c.module.state_dict(), version / "weights.pt")
    _copy_backend(CLASSIFIER_FILES, version)
    code = {}
    if c.code is not None and options.engine == "torch":  # the only engine that runs the model's Python code
        (version / CODE_DIR).mkdir()
        for source in (c.code.file, *c.code.extra_files):
            shutil.copyfile(source, version / CODE_DIR / source.name)
        code = {"model_file": f"{CODE_DIR}/{c.code.file.name}"}
    if options.engine in ENGINE_ARTIFACT:
        artifact = artifacts[ENGINE_ARTIFACT[options.engine]]
        shutil.copyfile(artifact, version / artifact.name)
    if "onnx_int8" in artifacts:
        shutil.copyfile(artifacts["onnx_int8"], version / artifacts["onnx_int8"].name)
    classifier_parameters = {
        # GPU tensors from the ensemble's preprocess step stay on the GPU (no round trip through the
        # host); HTTP/gRPC inputs still arrive in CPU memory and the runner stages them once per batch.
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no", "weights_file": "weights.pt", "engine": options.engine,
        "num_threads": str(options.num_threads), "precision": options.precision,
        "cuda_graphs": "1" if options.cuda_graphs else "0", "cudnn_benchmark": "1" if options.cudnn_benchmark else "0",
        "batch_buckets": ",".join(map(str, options.buckets)), **code, **named, **common}
    # NAME's one input is IMAGE, IMAGE_FP16 or IMAGE_UINT8 as built; the exports keep IMAGE (FP32).
    hop = _image_input(side, options.input_dtype)
    _config(staging / c.name, hop, logits, cfg.Format.PYTHON, options, classifier_parameters)

    pre = names.named(c.name, "preprocess")
    _copy_backend(PREPROCESS_FILES, _model_dir(staging / pre, None))
    # decode_device gpu: JPEGs are decoded on the GPU and IMAGE stays in GPU memory between the two
    # steps of the ensemble (Triton's CUDA memory pool). Otherwise decoding runs on CPU instances and
    # the classifier stages the CPU tensors once per batch.
    ensemble_gpu_decode = options.decode_device == "gpu" and options.image_model == "ensemble"
    pre_options = replace(options, kind=options.kind if ensemble_gpu_decode else cfg.InstanceKind.CPU)
    _config(staging / pre, _image_bytes(), hop, cfg.Format.PYTHON, pre_options,
            {"num_threads": str(options.num_threads), "decode_device": "gpu" if ensemble_gpu_decode else "cpu",
             **common})

    image_model = names.image_model(c.name)
    fused = _model_dir(staging / image_model, labels)
    if options.image_model == "fused":  # the classifier's artifacts, linked (not copied) where possible
        _copy_backend(FUSED_FILES, fused)
        for entry in version.iterdir():
            if entry.name not in CLASSIFIER_FILES:
                _link_tree(entry, fused / entry.name)
        _config(staging / image_model, _image_bytes(), logits, cfg.Format.PYTHON, options,
                {**classifier_parameters, "decode_device": options.decode_device})
    else:
        # The hop carries NAME's input as built: uint8 pixels are a quarter of IMAGE's bytes.
        steps = (cfg.Step(pre, {IMAGE_BYTES: IMAGE_BYTES}, {hop.name: "image"}),
                 cfg.Step(c.name, {hop.name: "image"}, {LOGITS: LOGITS}))
        _config(staging / image_model, _image_bytes(), logits, cfg.Format.ENSEMBLE, options,
                {**named, **common}, steps)

    for fmt, output_name in (("onnx", LOGITS), ("torchscript", export.TORCHSCRIPT_OUTPUT)):
        if fmt in options.formats:
            name = f"{c.name}_{fmt}"
            version = _model_dir(staging / name, labels)
            shutil.copyfile(artifacts[fmt], version / artifacts[fmt].name)
            out = cfg.Tensor(output_name, "TYPE_FP32", logits.dims, "labels.txt")
            _config(staging / name, image, out, cfg.Format(fmt), options, common)


def _provenance(c: Classifier) -> dict[str, str]:
    """What the model is and how images must be prepared for it: NAME_preprocess and the clients rebuild
    the preprocessing from these fields, and a reader sees where the model came from."""
    fields = {"weights": c.weights, "num_classes": str(len(c.categories)), **c.preprocessing.parameters()}
    if c.architecture:
        fields["torchvision_model"] = c.architecture
    if c.preprocess_weights:
        fields["preprocess_weights"] = c.preprocess_weights
    if c.code is not None:
        fields.update(model_class=c.code.class_name, model_imports=",".join(c.code.imports))
    if c.source:
        fields["source"] = c.source
    return fields


def _labels_parameter(c: Classifier) -> dict[str, str]:
    """The class names, for clients, unless they are the torchvision weights' own (read from its meta)."""
    if c.preprocess_weights:
        from torchvision.models import get_weight

        if list(get_weight(c.preprocess_weights).meta["categories"]) == list(c.categories):
            return {}
    return {"labels": json.dumps(list(c.categories))}


def _copy_backend(files: dict[str, str], version: Path) -> None:
    for name, source in files.items():
        shutil.copyfile(_ROOT / source, version / name)


def _link_tree(source: Path, target: Path) -> None:
    """A hard link of a file (or of each file of a folder); a copy where links are not possible."""
    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    if source.is_dir():
        shutil.copytree(source, target, copy_function=link)
    else:
        link(source, target)


def _model_dir(model_dir: Path, labels: str | None) -> Path:
    version = model_dir / "1"
    version.mkdir(parents=True)
    if labels is not None:
        (model_dir / "labels.txt").write_text(labels)
    return version


def _config(model_dir: Path, inp: cfg.Tensor | tuple[cfg.Tensor, ...], out: cfg.Tensor, fmt: cfg.Format,
            options: Options, parameters: dict[str, str], steps: tuple[cfg.Step, ...] = ()) -> None:
    inputs = inp if isinstance(inp, tuple) else (inp,)
    spec = cfg.ModelSpec(name=model_dir.name, inputs=inputs, outputs=(out,), format=fmt, batching=options.batching,
                         kind=options.kind, instances=options.instances, parameters=parameters, steps=steps)
    cfg.write_config(spec.to_proto(), model_dir)


def _image(side: int) -> cfg.Tensor:
    return cfg.Tensor(IMAGE, "TYPE_FP32", (3, side, side))


def _image_input(side: int, dtype: str) -> cfg.Tensor:
    """The python classifier's one image input, as --input-dtype chose it (contract.IMAGE_INPUTS)."""
    name, datatype = IMAGE_INPUTS[dtype]
    return cfg.Tensor(name, f"TYPE_{datatype}", (3, side, side))


def _image_bytes() -> cfg.Tensor:
    return cfg.Tensor(IMAGE_BYTES, "TYPE_STRING", (1,))
