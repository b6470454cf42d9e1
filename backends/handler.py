"""-> NAME/1/model.py for a TorchServe archive's handler: its handle() once per batch Triton formed (its
explanations, requests whose "explain" header is "True", and describe requests, "describe" "True", in handle() calls
of their own).

The archive is unpacked in archive/ beside this file (its own model.py cannot clash with this one). Each
request's BODY (one BYTES element) is one TorchServe request item; RESPONSE and CONTENT_TYPE carry its answer,
STATUS its HTTP status (contract.py's handler tensors).
"""
from __future__ import annotations

import atexit
import gc
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils

import ts_engine
import ts_worker
from contract import BODY, CONTENT_TYPE, ENTRIES_PARAMETER, RESPONSE, STATUS, STATUS_PARAMETER

ARCHIVE_DIR = "archive"
EXPLAIN = "explain"  # the header TorchServe's frontend sets: "True" for an explanation
DESCRIBE = "describe"  # "True": the handler's describe_handle answers (DescribeModel with customized metadata)

atexit.register(gc.freeze)  # the stub's exit: no last collection of torch's objects (backends/triton_io.py)


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
        self.name = name = f"{args['model_name']} (instance {args.get('model_instance_name', '')})"

        def report(message: str, warning: bool) -> None:
            (pb_utils.Logger.log_warn if warning else pb_utils.Logger.log_info)(f"{name}: {message}")

        engine = params.get("handler_engine", ts_engine.EAGER) if gpu is None else ts_engine.EAGER
        why_not = ts_engine.accelerate(self.service, engine, params.get("openvino_precision_hint", "f32"),
                                       float(params.get("engine_tolerance", "1e-4")), report)
        if why_not:
            report(f"the handler's model runs on eager PyTorch: {why_not}", False)

    def execute(self, requests):
        responses, as_status = [None] * len(requests), [False] * len(requests)
        groups: dict[tuple, tuple[list, list[int]]] = {}  # (explanation, describe): (request items, indexes)
        for index, request in enumerate(requests):
            body = pb_utils.get_input_tensor_by_name(request, BODY).as_numpy().reshape(-1)
            if body.size != 1:
                responses[index] = _error(f"{BODY} must hold one element per request (one body, as TorchServe "
                                          f"takes), got {body.size}", invalid=True)
                continue
            value = body[0] if isinstance(body[0], bytes) else bytes(body[0])
            headers = _headers(request)
            as_status[index] = headers.pop(STATUS_PARAMETER, None) is not None
            describe, layout = headers.get(DESCRIBE) == "True", headers.pop(ENTRIES_PARAMETER, None)
            try:  # a describe request has no input, as TorchServe's frontend sends it
                item = ({}, headers) if describe else ts_worker.request_entries(value, layout, headers) if layout \
                    else ts_worker.request_item(value, headers)
            except ts_worker.Refused as exc:  # this request alone: its neighbours go to handle() without it
                failed = ts_worker.Answer(error=exc.reason, status=exc.status)
                responses[index] = _answer(failed, as_status[index], invalid=True)
                continue
            # Explanations and describe requests apart from predictions: BaseHandler reads the first request's
            # headers for all (under TorchServe a prediction batched behind an explanation gets an explanation).
            group = groups.setdefault((headers.get(EXPLAIN) == "True", describe), ([], []))
            group[0].append(item)
            group[1].append(index)
        for items, owners in groups.values():
            answers = ts_worker.predict(self.service, items)
            for failure in sorted({answer.failure() for answer in answers if answer.error is not None}):
                pb_utils.Logger.log_warn(f"{self.name}: {failure}")  # the reason, which TorchServe's answer omits
            for index, answer in zip(owners, answers):
                responses[index] = _answer(answer, as_status[index])
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


def _answer(answer, as_status: bool, invalid: bool = False):
    """`answer` (ts_worker.Answer) as RESPONSE, CONTENT_TYPE and STATUS; a failure the same way where the request
    asked for it (STATUS_PARAMETER: the TorchServe front, RESPONSE its message), else as a Triton error (no outputs)
    whose message says the status in words."""
    if answer.error is not None and not as_status:
        return _error(answer.failure(), invalid=invalid)
    payload, content_type = (answer.payload, answer.content_type) if answer.error is None else \
        (answer.error.encode("utf-8", "replace"), "")
    return pb_utils.InferenceResponse(output_tensors=[
        _bytes(RESPONSE, payload), _bytes(CONTENT_TYPE, content_type.encode()),
        pb_utils.Tensor(STATUS, np.array([[answer.status]], dtype=np.int32))])


def _error(message: str, *, invalid: bool):
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if invalid else None
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
