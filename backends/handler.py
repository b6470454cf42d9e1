"""-> NAME/1/model.py for a TorchServe archive's handler: its handle() once per batch Triton formed.

The archive is unpacked in archive/ beside this file (its own model.py cannot clash with this one). Each
request's BODY (one BYTES element) is one TorchServe request item; RESPONSE and CONTENT_TYPE carry its answer.
"""
from __future__ import annotations

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

import ts_engine
import ts_worker

BODY, RESPONSE, CONTENT_TYPE = "BODY", "RESPONSE", "CONTENT_TYPE"
ARCHIVE_DIR = "archive"


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        # A GPU instance's device; a CPU instance made to run on a GPU (config parameter cuda_device) names it.
        on_host = (config.get("parameters", {}).get("cuda_device") or {}).get("string_value", "")
        gpu = int(args.get("model_instance_device_id", 0)) if args.get("model_instance_kind") == "GPU" else \
            (int(on_host) if on_host else None)
        if gpu is not None:
            import torch

            if torch.cuda.is_available():  # else the handler falls back to CPU, as under TorchServe
                torch.cuda.set_device(gpu)  # so that the stub makes no context on GPU 0 besides its own
        params = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}
        # Before the handler's own code runs: any image it decodes itself is bounded too.
        ts_worker.bound_images(int(params.get("max_pixels", "") or ts_worker.DEFAULT_MAX_PIXELS))
        folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), ARCHIVE_DIR)
        # A handler failing here fails the load: Triton reports the reason (ts_worker.HandlerError's message).
        self.service = ts_worker.load(folder, args["model_name"], gpu, max(int(config.get("max_batch_size", 1)), 1))
        name = f"{args['model_name']} (instance {args.get('model_instance_name', '')})"

        def report(message: str, warning: bool) -> None:
            (pb_utils.Logger.log_warn if warning else pb_utils.Logger.log_info)(f"{name}: {message}")

        engine = params.get("handler_engine", ts_engine.EAGER) if gpu is None else ts_engine.EAGER
        why_not = ts_engine.accelerate(self.service, engine, params.get("openvino_precision_hint", "f32"),
                                       float(params.get("engine_tolerance", "1e-4")), report)
        if why_not:
            report(f"the handler's model runs on eager PyTorch: {why_not}", False)

    def execute(self, requests):
        responses, items, owners = [None] * len(requests), [], []
        for index, request in enumerate(requests):
            body = pb_utils.get_input_tensor_by_name(request, BODY).as_numpy().reshape(-1)
            if body.size != 1:
                responses[index] = _error(f"{BODY} must hold one element per request (one body, as TorchServe "
                                          f"takes), got {body.size}", invalid=True)
                continue
            value = body[0] if isinstance(body[0], bytes) else bytes(body[0])
            try:
                items.append(ts_worker.request_item(value, _headers(request)))
            except ts_worker.Refused as exc:  # this request alone: its neighbours go to handle() without it
                responses[index] = _error(str(exc), invalid=True)
                continue
            owners.append(index)
        if items:
            for index, answer in zip(owners, ts_worker.predict(self.service, items)):
                responses[index] = _error(answer.error, invalid=False) if answer.error is not None else \
                    pb_utils.InferenceResponse(output_tensors=[_bytes(RESPONSE, answer.payload),
                                                               _bytes(CONTENT_TYPE, answer.content_type.encode())])
        return responses


def _headers(request) -> dict[str, str]:
    """The request's parameters (and HTTP headers Triton forwards as parameters) as TorchServe's headers."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError):
        return {}
    return {str(key): str(value) for key, value in parameters.items()}


def _bytes(name: str, value: bytes):
    return pb_utils.Tensor(name, np.array([[value]], dtype=np.object_))


def _error(message: str, *, invalid: bool):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
