"""The I/O contract between build-repo, the backends and the clients: tensor names, parameter keys, buckets.

build-repo copies this file beside each backend's model.py (Triton puts the version folder on sys.path),
so it must stay self-contained: standard library only.
"""
from __future__ import annotations

# Tensor names, chosen once: the export, config.pbtxt, the backends and every client use these.
IMAGE = "IMAGE"              # FP32 [N, 3, H, W]: a preprocessed image batch (the classifier's input)
LOGITS = "LOGITS"            # FP32 [N, classes]: the classifier's output
IMAGE_BYTES = "IMAGE_BYTES"  # BYTES [N, 1]: encoded images (JPEG, PNG, ...), the image path's input
IMAGE_FP16 = "IMAGE_FP16"    # FP16 [N, 3, H, W]: IMAGE in half the bytes, cast to float on the device
IMAGE_UINT8 = "IMAGE_UINT8"  # UINT8 [N, 3, H, W]: pixels 0..255 after resize + center crop, not normalized:
                             # the classifier normalizes them on its device with the config's mean/std
# The handler model (build-repo --from-mar of an archive served with its own handler, backends/handler.py): one
# request body in, its answer out, as TorchServe's worker hands them over.
BODY = "BODY"                  # BYTES [N, 1]: one request's body (one TorchServe request item)
RESPONSE = "RESPONSE"          # BYTES [N, 1]: its answer as the handler serialized it; with STATUS != 200 the reason
CONTENT_TYPE = "CONTENT_TYPE"  # BYTES [N, 1]: the answer's content type ("" where the handler set none)
STATUS = "STATUS"              # INT32 [N, 1]: the HTTP status TorchServe answers this request with (200: answered)
HANDLER_OUTPUTS = ((RESPONSE, "BYTES"), (CONTENT_TYPE, "BYTES"), (STATUS, "INT32"))
# A request parameter: with it, a request the handler fails or refuses is answered with its STATUS (RESPONSE: the
# reason) instead of as a Triton error, which carries no output (the TorchServe front sends it; a plain Triton
# client, without it, gets the error, its message ending "(STATUS)").
STATUS_PARAMETER = "handler_status_output"
# A request parameter: BODY holds several named entries end to end (a gRPC PredictionsRequest's input map, which
# TorchServe hands a handler entry by entry): their names and lengths, JSON [[name, length], ...]. Without it BODY is
# one body, handed over as "data" and "body".
ENTRIES_PARAMETER = "handler_input_entries"

# The classifier NAME's one image input, by build-repo's --input-dtype: (name, Triton data type). Chosen when
# the repository is built, so the metadata is the whole contract (perf_analyzer, Model Analyzer and KServe-v2
# clients fill the one input they read); NAME_preprocess hands NAME the same tensor in the ensemble.
IMAGE_INPUTS = {"fp32": (IMAGE, "FP32"), "fp16": (IMAGE_FP16, "FP16"), "uint8": (IMAGE_UINT8, "UINT8")}

# Every model config parameter build-repo writes or a backend reads (string values), with what it means:
# tests/test_build_repo.py checks that each parameter a build writes is here.
PARAMETERS = {
    "FORCE_CPU_ONLY_INPUT_TENSORS": "python_backend's: no lets GPU tensors from an ensemble step stay on the GPU",
    "engine": "what the classifier's stub runs: torch, torchscript, onnxruntime or openvino",
    "weights_file": "the state_dict in the version folder (engine torch)",
    "model_file": "the user's model code in the version folder (engine torch, --model-file/.mar)",
    "model_class": "the nn.Module class in model_file",
    "model_imports": "modules the model file imports (provenance)",
    "torchvision_model": "the torchvision architecture the weights fit",
    "num_classes": "rows of LOGITS",
    "num_threads": "engine threads per instance; 0: the cores shared among the instances (preprocess: 1 on CPU)",
    "ort_allow_spinning": "onnxruntime's workers spin between batches: 1, or 0 (the default: they steal cores)",
    "precision": "fp32 (the default: eager PyTorch's answers), auto, fp16, bf16 or int8",
    "cuda_graphs": "1: one CUDA graph per batch bucket",
    "cuda_device": "N: a KIND_CPU instance that runs its model on cuda:N (perf.gpu.io_variants' ways of serving)",
    "cudnn_benchmark": "1: cuDNN picks its algorithms per bucket at load time",
    "batch_buckets": "comma list of batch sizes a GPU instance pads to",
    "stage_timing": "a folder: measurement mode, each instance's time per stage of its executes in "
                    "FOLDER/MODEL.PID.json (backends/stage_clock.py); empty, the default: off",
    "decode_device": "cpu or gpu: where JPEGs are decoded (nvJPEG on a GPU instance)",
    "decode_workers": "PIL threads of the fused model (default 4 on a GPU instance, 1 on CPU)",
    "output_device": "gpu (default) or cpu: where NAME_preprocess on a GPU instance hands IMAGE over",
    "max_pixels": "largest image (width x height, by its header) any model decodes; default 50,000,000",
    "gpu_decode_budget_mb": "decoded RGB bytes per batched GPU JPEG decode, MB (a larger image goes alone); "
                            "default 1024",
    "weights": "where the weights came from (provenance)",
    "source": "what the model was built from, e.g. a TorchServe archive (provenance)",
    "labels": "JSON list of class names, unless they are the torchvision weights' own",
    "preprocess_weights": "torchvision weights whose transforms() and categories apply",
    "resize_size": "preprocessing: shorter side after resizing, pixels",
    "crop_size": "preprocessing: side of the center crop, pixels (IMAGE is [3, crop, crop])",
    "mean": "preprocessing: per-channel mean, comma list",
    "std": "preprocessing: per-channel std, comma list",
    "interpolation": "preprocessing: the resize filter",
}


# Where JPEGs are decoded unless the config says (build-repo always writes `decode_device`): the fused model
# on a GPU instance decodes there (nvJPEG: no tensor crosses processes); the ensemble's preprocess decodes on
# CPU (its GPU hand-over to the classifier is experimental). On a CPU instance both decode on CPU.
DECODE_DEVICE = {"fused": "gpu", "ensemble": "cpu"}


def config_parameters(config: dict) -> dict[str, str]:
    """The `parameters` of a model config in Triton's JSON form (python_backend's args, the HTTP/gRPC clients'
    model config) as plain strings; a parameter without a value (JSON drops empty strings) is ""."""
    return {key: (value or {}).get("string_value", "") for key, value in config.get("parameters", {}).items()}


def buckets_for(max_batch: int) -> list[int]:
    """Powers of two up to max_batch, and max_batch itself: a GPU batch pads to the next bucket."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max(max_batch, 1)]


def parse_buckets(text: str, max_batch: int) -> list[int]:
    """The `batch_buckets` parameter as sorted sizes; empty text means buckets_for(max_batch)."""
    if not text.strip():
        return buckets_for(max_batch)
    sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch_buckets must be positive integers, got {text!r}")
    if sizes[-1] < max_batch:  # every batch Triton can form must fit a bucket
        sizes.append(max_batch)
    return sizes


def mean_std(params: dict[str, str]) -> tuple[list[float], list[float]] | None:
    """The `mean` and `std` parameters as floats; None where the config records none (older repositories)."""
    if not params.get("mean") or not params.get("std"):
        return None
    return [float(x) for x in params["mean"].split(",")], [float(x) for x in params["std"].split(",")]
