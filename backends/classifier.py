"""Triton Python backend for a torchvision classifier: one batched forward pass per execute() call.

build-repo copies this file to <repository>/<model>/1/model.py and its helpers beside it
(batch_runner, engines, triton_io, and common/contract.py, model_code.py, precision.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton, e.g. by perf.bench to run the very same engine in-process
    pb_utils = None
try:  # in Triton: the helpers sit beside this file in the version folder, which is on sys.path
    from contract import IMAGE_INPUTS, LOGITS, mean_std, parse_buckets
    from engines import cpu_bf16, cpu_threads, load_engine
    from precision import check, check_native, served
    from stage_clock import StageClock, StageFiles
    from triton_io import (device_fault, error_response, exit_soon, first_line, honor_faulthandler,
                           Host, LazyTorch, instance_device, model_parameters, on_host)
except ImportError:
    from backends.engines import cpu_bf16, cpu_threads, load_engine
    from backends.stage_clock import StageClock, StageFiles
    from backends.triton_io import (device_fault, error_response, exit_soon, first_line, honor_faulthandler,
                                    Host, LazyTorch, instance_device, model_parameters, on_host)
    from common.contract import IMAGE_INPUTS, LOGITS, mean_std, parse_buckets
    from common.precision import check, check_native, served

torch = LazyTorch()  # imported where a path needs it: the host path never does
DTYPES = {"FP32": "float32", "FP16": "float16", "UINT8": "uint8"}  # Triton's names -> NumPy's and torch's
# The engines that take NumPy batches on the CPU: there the stub never imports torch (the host path, HostRunner).
HOST_ENGINES = ("openvino", "onnxruntime")


class TritonPythonModel:
    HOST_ROWS = True  # this model's rows may be NumPy arrays (the fused model's are torch tensors it decoded)

    def initialize(self, args):
        honor_faulthandler()
        config = json.loads(args["model_config"])
        params = model_parameters(config)
        host = self.HOST_ROWS and on_host(args) and params.get("engine", "torch") in HOST_ENGINES
        self.device = Host() if host else instance_device(args)
        self.sample_shape = tuple(int(d) for d in config["input"][0]["dims"])
        # The image inputs this config declares (older repositories: IMAGE alone); a request sends one.
        declared = {tensor["name"] for tensor in config["input"]}
        self.inputs = {name: dtype for name, dtype in IMAGE_INPUTS.values() if name in declared}
        max_batch = int(config.get("max_batch_size", 0))
        self.batched = max_batch > 0
        self.engine_name = params.get("engine", "torch")
        threads = int(params.get("num_threads", "0") or 0)
        if self.device.type == "cuda":
            # The CPU only copies rows here; torch's default (one OpenMP thread per core in every stub)
            # competes with Triton's and the clients' threads.
            threads = threads or 1
        else:
            threads = cpu_threads(threads, cpu_instances(config))
        version = Path(args["model_repository"]) / args["model_version"]
        if host:
            self.runner = build_host_runner(version, params, self.sample_shape, threads)
        else:
            # OpenVINO runs its own threads; torch here only gathers the requests' rows.
            torch.set_num_threads(1 if self.engine_name == "openvino" else threads)
            self.runner = build_runner(version, params, self.device, max(max_batch, 1), self.sample_shape, threads)
        self.runner.warm_up()  # every bucket, before Triton reports the model READY
        # What runs here, which may differ from where the repository was built (precision auto).
        self.precision = getattr(self.runner.engine, "precision", params.get("precision", "fp32"))
        self.threads = getattr(self.runner.engine, "threads", threads)
        self._info_family, self._info = engine_info(args["model_name"], self.engine_name, self.precision,
                                                    self.threads)
        # Measurement mode (off unless the config's stage_timing names a folder): where each execute's time goes.
        folder = params.get("stage_timing", "")
        publish = StageFiles(folder, args["model_name"]) if folder else None
        self.clock = self.runner.clock = StageClock(bool(folder), self.device, publish)
        pb_utils.Logger.log_info(
            f"{args['model_name']}: {params.get('torchvision_model') or params.get('model_class')} ({self.engine_name}, "
            f"precision {self.precision} (asked: {params.get('precision', 'fp32')})) on {self.device}, "
            f"buckets {self.runner.buckets or '-'}, cuda_graphs={self.runner.cuda_graphs}, "
            f"{self.threads} threads, batched={self.batched}"
        )

    def execute(self, requests):
        self.clock.start()
        responses = [None] * len(requests)
        images, owners = [], []
        for index, request in enumerate(requests):
            try:
                images.append(self._input(request))
                owners.append(index)
            except ValueError as exc:
                responses[index] = error_response(str(exc), invalid=True)
        self.clock.lap("inputs")
        if images:
            for index, response in zip(owners, self._infer(images)):
                responses[index] = response
        self.clock.lap("responses")
        self.clock.finish()
        return responses

    def finalize(self):
        self.clock.close()  # what is pending, to its file
        self.runner = None
        self._info = self._info_family = None  # the metric before its family (python_backend's rule)

    def _input(self, request):
        """The request's one image input, in its own dtype: the runner normalizes it on its device."""
        sent = [(name, tensor) for name in self.inputs
                if (tensor := pb_utils.get_input_tensor_by_name(request, name)) is not None]
        if len(sent) != 1:
            raise ValueError(f"a request sends exactly one of the inputs {', '.join(self.inputs)}; "
                             f"this one sent {', '.join(name for name, _ in sent) or 'none'}")
        name, tensor = sent[0]
        # Shared, not copied, wherever it is: HTTP/gRPC inputs arrive in CPU memory even on a GPU
        # instance (python_backend hands over GPU memory only for CUDA shared memory or a GPU ensemble
        # step); the runner stages CPU rows once per batch.
        # The host path keeps NumPy's view (a GPU input, from CUDA shared memory, is copied to the host).
        if isinstance(self.device, Host):
            image = tensor.as_numpy() if tensor.is_cpu() else torch.from_dlpack(tensor.to_dlpack()).cpu().numpy()
        else:
            image = torch.from_numpy(tensor.as_numpy()) if tensor.is_cpu() else torch.from_dlpack(tensor.to_dlpack())
        if not self.batched:
            image = image[None]
        if image.ndim != 1 + len(self.sample_shape) or tuple(image.shape[1:]) != self.sample_shape:
            raise ValueError(f"{name} must have shape [N, {', '.join(map(str, self.sample_shape))}], "
                             f"got {list(image.shape)}")
        dtype = str(image.dtype).removeprefix("torch.")
        if dtype != DTYPES[self.inputs[name]]:
            raise ValueError(f"{name} must be {self.inputs[name]}, got {dtype}")
        if dtype == "uint8" and self.runner.mean_std is None:
            raise ValueError(f"{name} needs the config's mean and std parameters, which this model lacks")
        return image

    def _infer(self, images: list) -> list:
        """One forward for all requests; each request gets exactly its own rows back."""
        sizes = [image.shape[0] for image in images]
        try:
            logits = self.runner.run(images)
        except Exception as exc:
            faulted = device_fault(exc)
            if len(images) == 1 or faulted:  # a CUDA fault poisons the whole batch (and the context)
                message = f"inference failed: {type(exc).__name__}: {first_line(exc)}"
                if faulted:
                    exit_soon(message)
                return [error_response(message, invalid=False) for _ in images]
            # Only a request that fails on its own should get an error: retry one by one.
            return [response for image in images for response in self._infer([image])]
        if logits.shape[0] != sum(sizes):
            message = f"model returned {logits.shape[0]} rows for {sum(sizes)} images"
            return [error_response(message, invalid=False) for _ in images]
        offsets = np.cumsum([0, *sizes]).tolist()
        return [_response(logits[low:high] if self.batched else logits[low])
                for low, high in zip(offsets, offsets[1:])]


def build_runner(version_dir: Path, params: dict, device: torch.device, max_batch: int,
                 sample_shape: tuple[int, ...], threads: int = 0) -> BatchRunner:
    """The engine the config names, wrapped in the batch runner with the config's speed options."""
    try:
        from batch_runner import PRECISIONS, BatchRunner
    except ImportError:
        from backends.batch_runner import PRECISIONS, BatchRunner

    engine_name = params.get("engine", "torch")
    precision = served(params.get("precision", "fp32"), engine_name)
    check(precision, engine_name, "gpu" if device.type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = params.get("cudnn_benchmark", "1") == "1"
    # channels_last lets cuDNN / oneDNN pick their fastest convolution kernels (~15% on CPU, tensor-core
    # layouts on GPU); onnxruntime and OpenVINO want plain NCHW and pick their own layouts.
    graph_engine = engine_name not in ("onnxruntime", "openvino")
    channels_last = graph_engine
    if device.type == "cpu" and graph_engine:  # OpenVINO checks its own CPU support as it compiles
        check_native(precision, cpu_bf16())
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    engine = load_engine(version_dir, params, device, memory_format, threads)
    if precision != "fp32" and isinstance(engine, torch.nn.Module):
        engine = engine.to(PRECISIONS[precision])
    buckets = parse_buckets(params.get("batch_buckets", ""), max_batch)
    # OpenVINO takes fp32 rows and runs them in the precision it resolved (engine.precision).
    runner_precision = precision if graph_engine else "fp32"
    return BatchRunner(engine, device, sample_shape, runner_precision, params.get("cuda_graphs", "0") == "1",
                       buckets, channels_last, graph_ok=graph_engine, mean_std=mean_std(params))


def build_host_runner(version_dir: Path, params: dict, sample_shape: tuple[int, ...], threads: int = 0) -> HostRunner:
    """An engine of HOST_ENGINES on the CPU behind HostRunner: what build_runner gives there, without torch."""
    engine_name = params.get("engine", "torch")
    precision = served(params.get("precision", "fp32"), engine_name)
    check(precision, engine_name, "cpu")
    engine = load_engine(version_dir, params, Host(), None, threads)
    return HostRunner(engine, sample_shape, mean_std(params))


class HostRunner:
    """BatchRunner's CPU path for an engine that reads NumPy (OpenVINO, onnxruntime): the requests' rows as one
    float32 batch, fp16 rows cast, uint8 pixels normalized as (x / 255 - mean) / std in float32 as BatchRunner does
    (tests/test_compact_inputs.py holds them equal), the engine's float32 logits back."""

    buckets, cuda_graphs = [], False

    def __init__(self, engine, sample_shape: tuple[int, ...], mean_std: tuple[list[float], list[float]] | None = None):
        self.engine, self.sample_shape, self.mean_std = engine, tuple(sample_shape), mean_std
        self._stats = None if mean_std is None else \
            tuple(np.asarray(values, dtype=np.float32).reshape(-1, 1, 1) for values in mean_std)
        self.clock = StageClock()  # the model's measurement mode replaces it (stage_timing=1); off: no-ops

    def warm_up(self) -> None:
        self.run([np.zeros((1, *self.sample_shape), dtype=np.float32)])

    def run(self, parts: list[np.ndarray]) -> np.ndarray:
        """Logits (float32) for the parts' rows in order."""
        if all(part.dtype == np.float32 for part in parts):
            batch = parts[0] if len(parts) == 1 else np.concatenate(parts)
        else:
            batch = np.empty((sum(part.shape[0] for part in parts), *self.sample_shape), dtype=np.float32)
            offset = 0
            for part in parts:
                self._convert(part, batch[offset:offset + part.shape[0]])
                offset += part.shape[0]
        self.clock.lap("staging")
        logits = np.asarray(self.engine.host(batch), dtype=np.float32)
        self.clock.lap("forward")
        return logits

    def _convert(self, part: np.ndarray, out: np.ndarray) -> None:
        if part.dtype != np.uint8:
            out[...] = part
            return
        if self._stats is None:
            raise ValueError("uint8 images need the config's mean and std, which this model records none of")
        mean, std = self._stats
        np.divide(part, np.float32(255), out=out, dtype=np.float32)
        out -= mean
        out /= std


def cpu_instances(config: dict) -> int:
    """How many CPU instances the config runs of this model (build-repo writes N groups of one)."""
    return sum(int(group.get("count", 1)) for group in config.get("instance_group", [])
               if group.get("kind", "KIND_CPU") in ("KIND_CPU", "KIND_AUTO")) or 1


def engine_info(model: str, engine: str, precision: str, threads: int):
    """classifier_engine_info{model, engine, precision, threads} = 1 on Triton's metrics endpoint: what a client
    can read of what was resolved here (python_backend cannot change a config's parameters at load)."""
    family = pb_utils.MetricFamily(name="classifier_engine_info", kind=pb_utils.MetricFamily.GAUGE,
                                   description="The engine and precision a classifier's instance runs (value 1)")
    metric = family.Metric(labels={"model": model, "engine": engine, "precision": precision,
                                   "threads": str(threads)})
    metric.set(1)
    return family, metric


def _response(logits):
    # Rows of the batch's CPU logits (NumPy, or torch off the host path): a view, copied once into the response by
    # python_backend.
    rows = np.ascontiguousarray(logits) if isinstance(logits, np.ndarray) else logits.contiguous().numpy()
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(LOGITS, rows)])
