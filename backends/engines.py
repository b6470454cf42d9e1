"""The engines a classifier's stub can run, each a callable batch -> logits: torch, torchscript, onnxruntime,
openvino.

build-repo copies this file beside the classifier's model.py; perf.bench imports it to time the very
same engine in-process.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

try:  # in Triton: the version folder, which holds copies of these, is on sys.path
    from contract import IMAGE, LOGITS
    from cpu import cpu_bf16, cpuinfo  # noqa: F401 - cpuinfo: perf reads the CPU as the backend does
    from messages import first_line
    from precision import OPENVINO_HINTS, OPENVINO_RESOLVED, check, check_native
except ImportError:
    from common.contract import IMAGE, LOGITS
    from common.cpu import cpu_bf16, cpuinfo  # noqa: F401
    from common.messages import first_line
    from common.precision import OPENVINO_HINTS, OPENVINO_RESOLVED, check, check_native
# torch is imported where an engine needs it: OpenVINO and onnxruntime on the CPU run on NumPy alone (the
# classifier's host path), and a stub that imports no torch starts in ~2.3 s of CPU instead of ~5.5 s.

ENGINE_FILES = {"torch": "weights.pt", "torchscript": "model.pt", "onnxruntime": "model.onnx", "openvino": "model.onnx"}
# int8: the QDQ model build-repo quantized; its other layers run in OpenVINO's choice.
INT8_FILE = "model_int8.onnx"


def load_engine(version_dir: Path, params: dict, device: torch.device, memory_format, threads: int):
    """A callable batch -> logits for the configured engine: torch, torchscript, onnxruntime or openvino."""
    engine = params.get("engine", "torch")
    files = {**ENGINE_FILES, "torch": params.get("weights_file", "weights.pt")}
    if engine not in files:
        raise RuntimeError(f"unknown engine {engine!r}: choose {', '.join(files)}")
    path = version_dir / files[engine]
    try:
        if engine == "openvino":
            precision = params.get("precision", "auto")
            return OpenVino(version_dir / INT8_FILE if precision == "int8" else path, threads, precision)
        if engine == "onnxruntime":
            return _OnnxRuntime(path, device, threads, params.get("ort_allow_spinning", "0"))
        import torch

        if engine == "torchscript":
            return torch.jit.load(str(path), map_location=device).eval()
        if params.get("model_file"):  # the user's own model code, copied into the version folder
            try:
                from model_code import import_model_class
            except ImportError:
                from common.model_code import import_model_class
            model = import_model_class(version_dir / params["model_file"], params.get("model_class") or None)()
        else:
            import torchvision  # only here: it adds ~2 s to every stub's start

            model = torchvision.models.get_model(params["torchvision_model"], weights=None,
                                                 num_classes=int(params.get("num_classes", 1000)))
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.to(device, memory_format=memory_format).eval()
    except Exception as exc:  # say which engine and file, not just the loader's KeyError
        raise RuntimeError(f"cannot load the {engine} engine from {path}: {type(exc).__name__}: "
                           f"{first_line(exc)}") from exc


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

    def host(self, batch: np.ndarray) -> np.ndarray:
        """CPU logits of a CPU batch, NumPy in and out (the classifier's host path)."""
        return self.session.run([LOGITS], {IMAGE: np.ascontiguousarray(batch)})[0]

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        import torch

        batch = batch.contiguous()
        if self.device.type != "cuda":
            return torch.from_numpy(self.host(batch.numpy()))
        # IO binding over raw device pointers: the batch never leaves the GPU.
        logits = torch.empty((batch.shape[0], self.classes), device=self.device, dtype=torch.float32)
        binding = self.session.io_binding()
        binding.bind_input(IMAGE, "cuda", self.device.index or 0, np.float32, list(batch.shape), batch.data_ptr())
        binding.bind_output(LOGITS, "cuda", self.device.index or 0, np.float32, list(logits.shape),
                            logits.data_ptr())
        torch.cuda.current_stream(self.device).synchronize()  # the batch is complete before ORT reads it
        self.session.run_with_iobinding(binding)
        return logits


class OpenVino:
    """OpenVINO's CPU runtime behind the same call as a torch module; `precision` is what it actually runs."""

    def __init__(self, path: Path, threads: int = 0, precision: str = "auto"):
        import openvino as ov

        check(precision, "openvino", "cpu")
        core = ov.Core()
        check_native(precision, "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
        # One stream: Triton's dynamic batcher already hands over whole batches, one at a time per
        # instance; more streams would split the cores between batches that never come.
        config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1",
                  "INFERENCE_NUM_THREADS": str(threads or default_threads())}
        if OPENVINO_HINTS[precision]:
            config["INFERENCE_PRECISION_HINT"] = OPENVINO_HINTS[precision]
        self.compiled = core.compile_model(str(path), "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.output = self.compiled.output(0)
        resolved = self.compiled.get_property("INFERENCE_PRECISION_HINT")
        self.precision = "int8" if precision == "int8" else \
            OPENVINO_RESOLVED.get(str(resolved.get_type_name()), str(resolved))
        self.threads = int(self.compiled.get_property("INFERENCE_NUM_THREADS"))

    def host(self, batch: np.ndarray) -> np.ndarray:
        """Logits of a batch, NumPy in and out (the classifier's host path)."""
        result = self.request.infer({0: np.ascontiguousarray(batch)})
        # A copy: the request's output buffer is overwritten by the next batch.
        return result[self.output].copy()

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.host(batch.contiguous().numpy()))


def cpu_threads(requested: int, instances: int) -> int:
    """Engine threads for one of a model's `instances` CPU instances: the config's `num_threads` where set,
    else the cores shared among them, so that instances x threads never exceed the cores (a .mar with
    minWorkers 4 on 2 cores had run 4 instances of 2 threads each, every forward fighting for the cores)."""
    return requested if requested > 0 else max(1, default_threads() // max(1, instances))


def default_threads() -> int:
    """Every core on a small machine; one left for Triton's own threads and the stub's I/O from 4 cores on."""
    cores = len(os.sched_getaffinity(0))
    return cores - 1 if cores >= 4 else cores
