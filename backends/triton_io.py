"""What the backends need from python_backend: the instance's device, the config's parameters, errors, inputs.

build-repo copies this file beside each model.py; it must stay self-contained.
"""
from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import os
import sys
import threading
import time

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton (tests, perf): only the helpers that need no Triton work
    pb_utils = None
else:  # a stub's exit: what is alive is left to the OS, no last collection of torch's objects (~0.6 s of CPU, and
    # Triton waits for the stub to end: a Python model's unload 2.2 -> 1.6 s, resnet18 on the 2-core EPYC)
    atexit.register(gc.freeze)
try:  # in Triton: the version folder, which holds copies of these, is on sys.path
    from contract import config_parameters
    from messages import first_line  # noqa: F401 - the backends' one home for it
except ImportError:
    from common.contract import config_parameters
    from common.messages import first_line  # noqa: F401


def model_parameters(config: dict) -> dict[str, str]:
    """The `parameters` of a model config as python_backend hands it over (contract.config_parameters)."""
    return config_parameters(config)


def honor_faulthandler() -> None:
    """PYTHONFAULTHANDLER for the stub: its embedded Python runs isolated and ignores the variable, so a
    stub killed by a fatal signal (a fault in CUDA) would die without a word; with it, its Python stack
    goes to stderr, which is tritonserver's log."""
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()


# Where tritonserver runs with CUDA_VISIBLE_DEVICES="" (its core then makes no CUDA pools or copies), a CPU instance
# with `cuda_device` sees the GPUs this variable names (a way of serving perf.gpu.io_variants.instance_io tries).
STUB_VISIBLE_DEVICES = "CLASSIFIER_STUB_CUDA_VISIBLE_DEVICES"


class Host:
    """torch.device("cpu") as the host paths read it (its type; "cpu" in words), without importing torch."""

    type, index = "cpu", None

    def __str__(self) -> str:
        return "cpu"


class LazyTorch:
    """The torch module, imported at the first attribute read: a stub on a host path never reads one."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch, name)


def on_host(args: dict) -> bool:
    """This instance runs on the CPU (instance_device would say cpu), told without importing torch."""
    return args.get("model_instance_kind") != "GPU" and \
        not model_parameters(json.loads(args.get("model_config") or "{}")).get("cuda_device", "")


def instance_device(args: dict) -> torch.device:
    """The device of this instance (model_instance_kind / _device_id), never a bare "cuda". A KIND_CPU
    instance whose config names `cuda_device` N runs on cuda:N: Triton hands it CPU tensors as to any CPU
    instance, and the model moves them to the GPU itself (a way of serving perf.gpu.io_variants.instance_io tries)."""
    import torch

    on_host = model_parameters(json.loads(args.get("model_config") or "{}")).get("cuda_device", "")
    if args.get("model_instance_kind") != "GPU" and not on_host:
        return torch.device("cpu")
    if on_host and STUB_VISIBLE_DEVICES in os.environ:  # tritonserver ran with the GPU hidden from it (CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ[STUB_VISIBLE_DEVICES]  # not yet used in this stub)
    if not torch.cuda.is_available():
        raise RuntimeError("instance group asks for a GPU but torch sees no CUDA device")
    index = int(args.get("model_instance_device_id", 0)) if args.get("model_instance_kind") == "GPU" else int(on_host)
    device = torch.device("cuda", index)
    # Without this every instance also creates a context on GPU 0, and DLPack refuses tensors
    # that live on a device other than the current one.
    torch.cuda.set_device(device)
    return device


def error_response(message: str, *, invalid: bool):
    """A response carrying only an error. invalid: the request's own fault (INVALID_ARG, HTTP 400);
    otherwise the server's (INTERNAL, HTTP 500), e.g. a forward pass that failed."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def encoded_elements(requests, name: str) -> tuple[list[bytes], list[int], list]:
    """Every element of each request's BYTES input `name`, in order, with the index of the request it came
    from; and a response list holding an error for each request without that input (None elsewhere)."""
    elements, owners, responses = [], [], [None] * len(requests)
    for index, request in enumerate(requests):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            responses[index] = error_response(f"request has no input {name!r}", invalid=True)
            continue
        for element in tensor.as_numpy().reshape(-1):
            elements.append(element if isinstance(element, bytes) else bytes(element))
            owners.append(index)
    return elements, owners, responses


def device_fault(exc: BaseException) -> bool:
    """A CUDA / cuDNN error: the instance's context is gone, every later batch on it would fail too."""
    torch = sys.modules.get("torch")  # a stub that never imported torch raised none of its errors
    accelerator_error = getattr(torch, "AcceleratorError", ()) if torch is not None else ()
    return isinstance(exc, accelerator_error) or "CUDA error" in str(exc) or "cuDNN error" in str(exc)


def exit_soon(reason: str, delay: float = 0.5, exit=os._exit) -> threading.Thread:
    """End this stub `delay` seconds from now, once execute() has handed its error responses back: a CUDA
    fault is sticky (every later batch would answer 500, and a live stub is never replaced), while a dead
    stub is replaced in place by serve-repo's supervisor, with a new context."""
    if pb_utils is not None:
        pb_utils.Logger.log_error(f"{reason}: this stub exits so that its instance is replaced")

    def later():
        time.sleep(delay)
        exit(70)  # EX_SOFTWARE
    thread = threading.Thread(target=later, name="exit-after-device-fault", daemon=True)
    thread.start()
    return thread
