"""Triton Python backend for a torchvision classifier: one batched forward pass per execute() call.

build-repo copies this file to <repository>/<model>/1/model.py and batch_runner.py beside it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torchvision
try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton, e.g. by clients.bench to run the very same engine in-process
    pb_utils = None
try:  # in Triton: batch_runner.py sits beside this file in the version folder, which is on sys.path
    from batch_runner import PRECISIONS, BatchRunner, parse_buckets
except ImportError:
    from backends.batch_runner import PRECISIONS, BatchRunner, parse_buckets

INPUT = "IMAGE"
OUTPUT = "LOGITS"


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.device = _instance_device(args)
        self.sample_shape = tuple(int(d) for d in config["input"][0]["dims"])
        max_batch = int(config.get("max_batch_size", 0))
        self.batched = max_batch > 0
        self.engine_name = params.get("engine", "torch")
        threads = int(params.get("num_threads", "0") or 0)
        if threads == 0 and self.device.type == "cuda":
            # The CPU only copies rows here; torch's default (one OpenMP thread per core in every stub)
            # competes with Triton's and the clients' threads. With this, numpy outputs and pageable
            # D2H, a served request on the H100 went from ~9 ms of overhead to ~1.5 ms (which of the
            # three mattered was not isolated).
            threads = 1
        if threads > 0:
            torch.set_num_threads(threads)
        self.runner = build_runner(Path(args["model_repository"]) / args["model_version"], params,
                                   self.device, max(max_batch, 1), self.sample_shape, threads)
        self.runner.warm_up()  # every bucket, before Triton reports the model READY
        pb_utils.Logger.log_info(
            f"{args['model_name']}: {params.get('torchvision_model') or params.get('model_class')} ({self.engine_name}, "
            f"{params.get('precision', 'fp32')}) on {self.device}, buckets {self.runner.buckets or '-'}, "
            f"cuda_graphs={self.runner.cuda_graphs}, {torch.get_num_threads()} threads, batched={self.batched}"
        )

    def execute(self, requests):
        responses = [None] * len(requests)
        images, owners = [], []
        for index, request in enumerate(requests):
            try:
                images.append(self._input(request))
                owners.append(index)
            except ValueError as exc:
                responses[index] = _error(str(exc), invalid=True)
        if images:
            for index, response in zip(owners, self._infer(images)):
                responses[index] = response
        return responses

    def finalize(self):
        self.runner = None

    def _input(self, request) -> torch.Tensor:
        tensor = pb_utils.get_input_tensor_by_name(request, INPUT)
        if tensor is None:
            raise ValueError(f"request has no input {INPUT!r}")
        # Shared, not copied, wherever it is: HTTP/gRPC inputs arrive in CPU memory even on a GPU
        # instance (python_backend hands over GPU memory only for CUDA shared memory or a GPU ensemble
        # step); the runner stages CPU rows once per batch.
        image = torch.from_numpy(tensor.as_numpy()) if tensor.is_cpu() else torch.from_dlpack(tensor.to_dlpack())
        if not self.batched:
            image = image.unsqueeze(0)
        if image.dim() != 1 + len(self.sample_shape) or tuple(image.shape[1:]) != self.sample_shape:
            raise ValueError(f"{INPUT} must have shape [N, {', '.join(map(str, self.sample_shape))}], "
                             f"got {list(image.shape)}")
        if image.dtype != torch.float32:
            raise ValueError(f"{INPUT} must be FP32, got {image.dtype}")
        return image

    def _infer(self, images: list[torch.Tensor]) -> list:
        """One forward for all requests; each request gets exactly its own rows back."""
        sizes = [image.shape[0] for image in images]
        try:
            logits = self.runner.run(images)
        except Exception as exc:
            device_fault = _is_device_fault(exc)
            if len(images) == 1 or device_fault:  # a CUDA fault poisons the whole batch (and the context)
                message = f"inference failed: {type(exc).__name__}: {_first_line(exc)}"
                return [_error(message) for _ in images]
            # Only a request that fails on its own should get an error: retry one by one.
            return [response for image in images for response in self._infer([image])]
        if logits.shape[0] != sum(sizes):
            message = f"model returned {logits.shape[0]} rows for {sum(sizes)} images"
            return [_error(message) for _ in images]
        return [_response(rows if self.batched else rows[0]) for rows in logits.split(sizes)]


def build_runner(version_dir: Path, params: dict, device: torch.device, max_batch: int,
                 sample_shape: tuple[int, ...], threads: int = 0) -> BatchRunner:
    """The engine the config names, wrapped in the batch runner with the config's speed options."""
    engine_name = params.get("engine", "torch")
    precision = params.get("precision", "fp32")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = params.get("cudnn_benchmark", "1") == "1"
    # channels_last lets cuDNN / oneDNN pick their fastest convolution kernels (~15% on CPU, tensor-core
    # layouts on GPU); onnxruntime wants plain NCHW and picks its own layouts.
    channels_last = engine_name != "onnxruntime"
    if engine_name == "onnxruntime" and precision != "fp32":
        raise RuntimeError(f"engine onnxruntime runs the fp32 export; precision {precision} needs engine torch")
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    engine = _load_engine(version_dir, params, device, memory_format, threads)
    if precision != "fp32" and isinstance(engine, torch.nn.Module):
        engine = engine.to(PRECISIONS[precision])
    buckets = parse_buckets(params.get("batch_buckets", ""), max_batch)
    return BatchRunner(engine, device, sample_shape, precision, params.get("cuda_graphs", "0") == "1",
                       buckets, channels_last, graph_ok=engine_name != "onnxruntime")


def import_model_class(path: Path, class_name: str | None = None) -> type:
    """The nn.Module class a model file defines, by TorchServe's rule: the one class defined in the file
    (not imported into it) that subclasses nn.Module, or the one named. Runs the file: build-repo does
    so only for a file the user gave or trusted. Its folder goes on sys.path for the files it imports."""
    import importlib.util
    import inspect
    import sys

    path = Path(path).resolve()
    module_name = f"_classifier_code_{abs(hash(str(path)))}"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    defined = {name: obj for name, obj in vars(module).items()
               if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and obj.__module__ == module_name}
    if class_name is not None:
        if class_name not in defined:
            raise ValueError(f"{path.name} defines no nn.Module class {class_name!r} "
                             f"(it defines: {', '.join(sorted(defined)) or 'none'})")
        return defined[class_name]
    if len(defined) != 1:
        raise ValueError(f"{path.name} must define exactly one nn.Module class (TorchServe's rule), it defines "
                         f"{len(defined)}: {', '.join(sorted(defined)) or 'none'}; name one with --model-class")
    return next(iter(defined.values()))


def _instance_device(args) -> torch.device:
    if args.get("model_instance_kind") == "GPU":
        if not torch.cuda.is_available():
            raise RuntimeError("instance group asks for a GPU but torch sees no CUDA device")
        device = torch.device("cuda", int(args.get("model_instance_device_id", 0)))
        # Without this every instance also creates a context on GPU 0, and DLPack refuses tensors
        # that live on a device other than the current one.
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _is_device_fault(exc: Exception) -> bool:
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(exc, accelerator_error) or "CUDA error" in str(exc) or "cuDNN error" in str(exc)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _load_engine(version_dir: Path, params: dict, device: torch.device, memory_format, threads: int):
    """A callable batch -> logits for the configured engine: torch, torchscript or onnxruntime."""
    engine = params.get("engine", "torch")
    files = {"torch": params.get("weights_file", "weights.pt"), "torchscript": "model.pt",
             "onnxruntime": "model.onnx"}
    if engine not in files:
        raise RuntimeError(f"unknown engine {engine!r}: choose torch, torchscript or onnxruntime")
    path = version_dir / files[engine]
    try:
        if engine == "torchscript":
            return torch.jit.load(str(path), map_location=device).eval()
        if engine == "onnxruntime":
            return _OnnxRuntime(path, device, threads, params.get("ort_allow_spinning", "0"))
        if params.get("model_file"):  # the user's own model code, copied into the version folder
            model = import_model_class(version_dir / params["model_file"], params.get("model_class") or None)()
        else:
            model = torchvision.models.get_model(params["torchvision_model"], weights=None,
                                                 num_classes=int(params.get("num_classes", 1000)))
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.to(device, memory_format=memory_format).eval()
    except Exception as exc:  # say which engine and file, not just the loader's KeyError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RuntimeError(f"cannot load the {engine} engine from {path}: {type(exc).__name__}: {first}") from exc


class _OnnxRuntime:
    """onnxruntime behind the same call as a torch module; on GPU it reads and writes torch memory."""

    def __init__(self, path: Path, device: torch.device, threads: int, spinning: str = "0"):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # Idle ORT workers spin by default; on a small CPU they then steal the cores that Triton's
        # HTTP threads and the next forward need (measured here: resnet18 in-process 31 -> 56 img/s,
        # served p99 at c=1 80 -> 41 ms without spinning).
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        if device.type == "cuda":
            providers = [("CUDAExecutionProvider", {"device_id": device.index or 0})]
        else:
            providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise RuntimeError("this onnxruntime has no CUDA execution provider (the CPU wheel?): install "
                               "onnxruntime-gpu matching torch's CUDA major, or use engine torch on GPU")
        self.session = ort.InferenceSession(str(path), options, providers=providers)
        if device.type == "cuda" and self.session.get_providers()[0] != "CUDAExecutionProvider":
            # ORT falls back to a CPU session silently when the CUDA provider cannot start.
            raise RuntimeError(f"onnxruntime could not start its CUDA provider (session runs on "
                               f"{self.session.get_providers()}): check onnxruntime-gpu against CUDA/cuDNN")
        self.device = device
        self.classes = self.session.get_outputs()[0].shape[-1]

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.contiguous()
        if self.device.type != "cuda":
            return torch.from_numpy(self.session.run([OUTPUT], {INPUT: batch.numpy()})[0])
        # IO binding over raw device pointers: the batch never leaves the GPU.
        logits = torch.empty((batch.shape[0], self.classes), device=self.device, dtype=torch.float32)
        binding = self.session.io_binding()
        binding.bind_input(INPUT, "cuda", self.device.index or 0, np.float32, list(batch.shape), batch.data_ptr())
        binding.bind_output(OUTPUT, "cuda", self.device.index or 0, np.float32, list(logits.shape),
                            logits.data_ptr())
        torch.cuda.current_stream(self.device).synchronize()  # the batch is complete before ORT reads it
        self.session.run_with_iobinding(binding)
        return logits


def _response(logits: torch.Tensor):
    # Rows of the batch's CPU logits: a view, copied once into the response by python_backend.
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT, logits.contiguous().numpy())])


def _error(message: str, invalid: bool = False):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
