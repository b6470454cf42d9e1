"""The gRPC calls tests/test_torchserve_grpc.py replays in order, after its own, on TorchServe 0.12 and on serve-repo's
TorchServe front: every field of every request message of inference.proto and management.proto at its edges.

Both start with tokens on, the model API on, max_request_size MAX_REQUEST, no model registered, and the same store
(`add_archives`): resnet-18.mar (batch 8, 1 worker in its model-config.yaml), r18.mar and r18-v2.mar (r18 1.0 and
2.0, no model-config: 0 workers unless asked, nothing started), desc.mar (a handler with describe_handle), plain.mar
(a handler without), junk.mar (no archive).

A row: (call, fields, compare). call: a method of either proto, "Wait" (DescribeModel of fields' model_name polled
until its workers are READY; not compared) or "Raw" (fields' `bytes` sent to fields' `method`). fields: the message's
fields by name; an `input` value names one of BODIES (or "x*N": N bytes, "fill:N": the whole message N bytes);
`token`: the authorization sent ("none", "other": the other API's key, else a format of {key}); StreamPredictions2's
`requests`: such field dicts, each sent once the answer to the one before has come. compare: "bytes" (code and text
byte for byte), "described" (DescribeModel's JSON, pids, times and memory left out), "top5" (labels in order,
probabilities within 1e-5), or "differs: REASON" (REASON a phrase of docs/migrating.md)."""
from __future__ import annotations

import json
import queue
import time
import zipfile
from pathlib import Path

import grpc
import numpy as np
from google.protobuf import empty_pb2
from google.rpc import error_details_pb2

from server.torchserve.proto import inference_pb2, management_pb2

MAX_REQUEST = 2_000_000
NAMES = "differs: model name beyond letters, digits"  # refused here, taken by TorchServe (docs/migrating.md)
TIMEOUT = 300  # seconds a call may take (a registration starts workers)
NAME = "resnet-18"
UNICODE = "résnet-ü 模型"
# desc.mar's handler: its describe_handle answers a dict (beyond ASCII too); its predictions name each input entry
# and its length (what TorchServe's worker hands a handler); plain.mar's has BaseHandler's describe_handle (None).
DESCRIBED_HANDLER = '''
from ts.torch_handler.base_handler import BaseHandler


class Described(BaseHandler):
    def initialize(self, context):
        self.initialized = True

    def preprocess(self, data):
        return [{str(key): len(value) for key, value in sorted(row.items())} for row in data]

    def inference(self, rows):
        return rows

    def postprocess(self, rows):
        return rows
'''
DESCRIBE = '''
    def describe_handle(self):
        return {"labels": ["cat", "dog"], "version": 3, "name": "dé"}
'''
ROWS: list[tuple[str, dict, str]] = [
    # -- tokens (the model API's calls checked first, then the message) --
    ("ListModels", {"token": "none"}, "bytes"),
    ("ListModels", {"token": "Bearer  {key}"}, "bytes"),
    ("ListModels", {"token": "Bearer\t{key}"}, "bytes"),
    ("ListModels", {"token": "bearer {key}"}, "bytes"),
    ("ListModels", {"token": "{key}"}, "bytes"),
    ("ListModels", {"token": "Bearer {key}x"}, "bytes"),
    ("ListModels", {"token": "Bearer "}, "bytes"),
    ("ListModels", {"token": "other"}, "bytes"),
    ("Predictions", {"model_name": NAME, "input": {"data": "photo"}, "token": "other"}, "bytes"),
    ("Predictions", {"model_name": NAME, "input": {"data": "photo"}, "token": "none"}, "bytes"),
    ("StreamPredictions", {"model_name": NAME, "token": "none"}, "bytes"),
    ("StreamPredictions2", {"requests": [{"model_name": NAME, "sequence_id": "s"}], "token": "none"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "token": "other"}, "bytes"),
    ("Ping", {"token": "other"}, "bytes"),
    # -- register: url --
    ("RegisterModel", {}, "bytes"),
    ("RegisterModel", {"url": ""}, "bytes"),
    ("RegisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "missing.mar"}, "bytes"),
    ("RegisterModel", {"url": "R18.MAR"}, "bytes"),
    ("RegisterModel", {"url": "../r18.mar"}, "bytes"),
    ("RegisterModel", {"url": "/etc/passwd"}, "bytes"),
    ("RegisterModel", {"url": "ftp://example.com/nothere.mar"}, "bytes"),
    ("RegisterModel", {"url": "ftp://example.com/r18.mar"}, "bytes"),  # TorchServe: the store's file of that name
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "résnet.mar"}, "bytes"),
    ("RegisterModel", {"url": "junk.mar"}, "differs: says which file is not an archive"),
    ("RegisterModel", {"url": "r18.mar", "runtime": "foo"}, "bytes"),
    ("RegisterModel", {"url": "missing.mar", "runtime": "foo"}, "bytes"),
    # -- register: each number at 0, negative, past what it means; nothing starts (0 workers) --
    ("RegisterModel", {"url": "r18.mar"}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("RegisterModel", {"url": "r18.mar"}, "bytes"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "batch_size": -1, "max_batch_delay": -5, "initial_workers": -1,
                       "response_timeout": -1, "startup_timeout": -1}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "batch_size": 2147483647, "max_batch_delay": 2147483647,
                       "response_timeout": 2147483647, "startup_timeout": 2147483647}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "batch_size": 4, "max_batch_delay": 7, "response_timeout": 9,
                       "startup_timeout": 11, "synchronous": True, "initial_workers": 0}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("ListModels", {}, "bytes"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    # -- register: names, runtime, handler, s3_sse_kms --
    ("RegisterModel", {"url": "r18.mar", "model_name": UNICODE}, NAMES),
    ("DescribeModel", {"model_name": UNICODE}, NAMES),
    ("ListModels", {}, NAMES),
    ("Predictions", {"model_name": UNICODE, "input": {"data": "photo"}}, NAMES),
    ("UnregisterModel", {"model_name": UNICODE}, NAMES),
    ("RegisterModel", {"url": "r18.mar", "model_name": "a b"}, NAMES),
    ("DescribeModel", {"model_name": "a b"}, NAMES),
    ("UnregisterModel", {"model_name": "a b"}, NAMES),
    ("RegisterModel", {"url": "r18.mar", "model_name": "a_b-1.0"}, "bytes"),
    ("DescribeModel", {"model_name": "a_b-1.0"}, "described"),
    ("UnregisterModel", {"model_name": "a_b-1.0"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "runtime": "python"}, "bytes"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "runtime": "python3"}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "handler": "foo"}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "s3_sse_kms": True}, "bytes"),
    ("UnregisterModel", {"model_name": "r18"}, "bytes"),
    # -- versions: describe, set-default, unregister, predictions, scale (0 workers) --
    ("RegisterModel", {"url": "r18.mar"}, "bytes"),
    ("RegisterModel", {"url": "r18-v2.mar"}, "bytes"),
    ("DescribeModel", {"model_name": "r18", "model_version": "all"}, "described"),
    ("DescribeModel", {"model_name": "r18", "model_version": "2.0"}, "described"),
    ("DescribeModel", {"model_name": "r18", "model_version": "9.9"}, "bytes"),
    ("DescribeModel", {"model_name": "r18", "model_version": ""}, "described"),
    ("DescribeModel", {"model_name": ""}, "bytes"),
    ("DescribeModel", {"model_name": "nope", "model_version": "all"}, "bytes"),
    ("SetDefault", {"model_name": "r18", "model_version": "2.0"}, "bytes"),
    ("SetDefault", {"model_name": "r18", "model_version": "9.9"}, "bytes"),
    ("SetDefault", {"model_name": "r18", "model_version": ""}, "bytes"),
    ("SetDefault", {"model_name": "", "model_version": "1.0"}, "bytes"),
    ("SetDefault", {"model_name": "nope", "model_version": ""}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "described"),
    ("ListModels", {}, "bytes"),
    ("Predictions", {"model_name": "r18", "model_version": "1.0", "input": {"data": "photo"}}, "bytes"),
    ("Predictions", {"model_name": "r18", "input": {"data": "photo"}}, "bytes"),
    ("Predictions", {"model_name": "r18", "model_version": "9.9", "input": {"data": "photo"}}, "bytes"),
    ("StreamPredictions", {"model_name": "r18", "model_version": "1.0", "input": {"data": "photo"}}, "bytes"),
    ("StreamPredictions2", {"requests": [{"model_name": "r18", "sequence_id": "z", "input": {"data": "photo"}}]},
     "bytes"),
    ("ScaleWorker", {"model_name": "r18", "model_version": "9.9", "min_worker": 1}, "bytes"),
    ("ScaleWorker", {"model_name": "r18", "min_worker": 3, "max_worker": 2, "synchronous": True}, "bytes"),
    ("ScaleWorker", {"model_name": "nope", "min_worker": 3, "max_worker": 2}, "bytes"),
    ("UnregisterModel", {"model_name": "r18", "model_version": "2.0"}, "bytes"),
    ("UnregisterModel", {"model_name": "r18", "model_version": "9.9"}, "bytes"),
    ("UnregisterModel", {"model_name": "nope", "model_version": "1.0"}, "bytes"),
    ("UnregisterModel", {"model_name": "r18", "model_version": "1.0"}, "bytes"),
    ("DescribeModel", {"model_name": "r18", "model_version": "all"}, "described"),
    ("UnregisterModel", {"model_name": "r18", "model_version": ""}, "bytes"),
    ("DescribeModel", {"model_name": "r18"}, "bytes"),
    # -- list: limit and next_page_token at their edges (models a, b, c) --
    ("RegisterModel", {"url": "r18.mar", "model_name": "c"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "model_name": "a"}, "bytes"),
    ("RegisterModel", {"url": "r18.mar", "model_name": "b"}, "bytes"),
    ("ListModels", {}, "bytes"),
    ("ListModels", {"limit": 1}, "bytes"),
    ("ListModels", {"limit": 2}, "bytes"),
    ("ListModels", {"limit": 3}, "bytes"),
    ("ListModels", {"limit": -1}, "bytes"),
    ("ListModels", {"limit": 100}, "bytes"),
    ("ListModels", {"limit": 101}, "bytes"),
    ("ListModels", {"limit": 2147483647}, "bytes"),
    ("ListModels", {"limit": -2147483648}, "bytes"),
    ("ListModels", {"next_page_token": 1}, "bytes"),
    ("ListModels", {"next_page_token": -1}, "bytes"),
    ("ListModels", {"next_page_token": 3}, "bytes"),
    ("ListModels", {"next_page_token": 99}, "bytes"),
    ("ListModels", {"limit": 1, "next_page_token": 2}, "bytes"),
    ("ListModels", {"limit": 2, "next_page_token": 2147483647}, "bytes"),
    ("ListModels", {"limit": 100, "next_page_token": 2147483600}, "bytes"),
    ("UnregisterModel", {"model_name": "a"}, "bytes"),
    ("UnregisterModel", {"model_name": "b"}, "bytes"),
    ("UnregisterModel", {"model_name": "c"}, "bytes"),
    # -- predictions on a worker: the input map's entries, versions, sizes --
    ("RegisterModel", {"url": f"{NAME}.mar", "synchronous": True}, "bytes"),
    ("Predictions", {"model_name": NAME, "input": {"data": "photo"}}, "top5"),
    ("Predictions", {"model_name": NAME, "input": {"body": "photo"}}, "top5"),
    ("Predictions", {"model_name": NAME, "input": {"data": "empty", "body": "photo"}}, "top5"),
    ("Predictions", {"model_name": NAME, "input": {"data": "photo", "other": "text"}}, "top5"),
    ("Predictions", {"model_name": NAME, "input": {"other": "photo"}}, "bytes"),
    ("Predictions", {"model_name": NAME, "input": {"data": "empty"}}, "bytes"),
    ("Predictions", {"model_name": NAME, "input": {"data": "text", "body": "photo"}}, "bytes"),
    ("Predictions", {"model_name": NAME, "model_version": "1.0", "input": {"data": "photo"}}, "top5"),
    ("Predictions", {"model_name": NAME, "sequence_id": "s0", "input": {"data": "photo"}}, "top5"),
    ("Predictions", {"model_name": UNICODE, "input": {"data": "photo"}}, "bytes"),
    ("Predictions", {"model_name": NAME, "input": {"data": f"fill:{MAX_REQUEST}"}}, "bytes"),
    ("Predictions", {"model_name": NAME, "input": {"data": f"fill:{MAX_REQUEST + 1}"}}, "bytes"),
    ("DescribeModel", {"model_name": "x" * (MAX_REQUEST + 10)}, "bytes"),
    ("Raw", {"method": "Ping", "bytes": b"\x0a\xff\xff"}, "bytes"),
    ("Raw", {"method": "Predictions", "bytes": b"\x0a\x09resnet-18\xf8\x06\x01"}, "bytes"),  # + unknown field 111
    # -- scale: min_worker / max_worker at their edges (0 or less: 1, max absent: min) --
    ("ScaleWorker", {"model_name": NAME, "synchronous": True}, "bytes"),
    ("ScaleWorker", {"model_name": NAME, "min_worker": -1, "max_worker": -1, "synchronous": True}, "bytes"),
    ("ScaleWorker", {"model_name": NAME, "max_worker": 1, "synchronous": True}, "bytes"),
    ("ScaleWorker", {"model_name": NAME, "min_worker": 1, "max_worker": 1, "number_gpu": 3, "timeout": -1,
                     "synchronous": True}, "bytes"),
    ("ScaleWorker", {"model_name": NAME, "model_version": "1.0", "min_worker": 1, "synchronous": True}, "bytes"),
    ("ScaleWorker", {"model_name": NAME, "min_worker": 2, "max_worker": 1}, "bytes"),
    ("ScaleWorker", {"model_name": NAME, "min_worker": 1}, "bytes"),
    ("Wait", {"model_name": NAME}, "wait"),
    ("ScaleWorker", {"model_name": NAME, "min_worker": 2, "synchronous": True}, "bytes"),
    ("DescribeModel", {"model_name": NAME}, "described"),
    ("ScaleWorker", {"model_name": NAME, "min_worker": 1, "max_worker": 1, "synchronous": True}, "bytes"),
    ("Wait", {"model_name": NAME}, "wait"),
    ("DescribeModel", {"model_name": NAME}, "described"),
    # (TorchServe keeps the workers it has between min_worker and max_worker: here 1)
    ("ScaleWorker", {"model_name": NAME, "min_worker": 1, "max_worker": 3, "synchronous": True}, "bytes"),
    ("DescribeModel", {"model_name": NAME}, "described"),
    ("ScaleWorker", {"model_name": "", "min_worker": 1}, "bytes"),
    # -- customized metadata of an archive whose handler has none (TorchServe's image_classifier) --
    ("DescribeModel", {"model_name": NAME, "customized": True}, "described"),
    ("DescribeModel", {"model_name": NAME, "customized": True, "model_version": "1.0"}, "described"),
    ("DescribeModel", {"model_name": NAME, "customized": True, "model_version": "all"}, "described"),
    ("DescribeModel", {"model_name": NAME, "customized": True, "model_version": "9.9"}, "bytes"),
    ("DescribeModel", {"model_name": "nope", "customized": True}, "bytes"),
    ("DescribeModel", {"model_name": "", "customized": True}, "bytes"),
    # -- StreamPredictions2 (no model here keeps sequences): a sequence id is required; errors are answers; TorchServe
    # 0.12 then looks up the model's sequence (getJobGroup): an unknown model, or none named, or a request it queued
    # ends the stream UNKNOWN; its queued request's answer never comes --
    ("StreamPredictions2", {"requests": []}, "bytes"),
    ("StreamPredictions2", {"requests": [{"model_name": NAME, "input": {"data": "photo"}},
                                         {"model_name": NAME, "input": {"data": "text"}}]}, "bytes"),
    ("StreamPredictions2", {"requests": [{"model_name": NAME, "sequence_id": "", "input": {
        "data": "photo", "ts_request_sequence_start": "true"}}]}, "bytes"),
    ("StreamPredictions2", {"requests": [
        {"model_name": NAME, "model_version": "9.9", "sequence_id": "s2"},
        {"model_name": NAME, "model_version": "9.9", "sequence_id": "s2", "input": {"data": "text"}},
        {"model_name": "nope", "sequence_id": "s2", "input": {"data": "photo"}},
        {"model_name": NAME, "model_version": "9.9", "sequence_id": "s2"}]}, "bytes"),
    ("StreamPredictions2", {"requests": [{"model_name": "", "sequence_id": "s7"},
                                         {"model_name": NAME, "model_version": "9.9", "sequence_id": "s7"}]}, "bytes"),
    # -- StreamPredictions: errors as Predictions', then an answer and the end of a handler that does not stream --
    ("StreamPredictions", {"model_name": "nope", "input": {"data": "photo"}}, "bytes"),
    ("StreamPredictions", {"model_name": "", "input": {"data": "photo"}}, "bytes"),
    ("StreamPredictions", {"model_name": NAME, "model_version": "9.9", "input": {"data": "photo"}}, "bytes"),
    ("StreamPredictions", {"model_name": NAME, "input": {"data": "text"}}, "bytes"),
    ("StreamPredictions", {"model_name": NAME, "sequence_id": "s5", "input": {"data": "photo"}}, "top5"),
    ("Wait", {"model_name": NAME}, "wait"),
    ("Predictions", {"model_name": NAME, "input": {"data": "photo"}}, "top5"),
    # (last on this model: TorchServe's batch of such a queued request and a failing one kills its worker for good)
    ("StreamPredictions2", {"requests": [{"model_name": NAME, "sequence_id": "s1", "input": {"data": "photo"}}]},
     "bytes"),
    ("UnregisterModel", {"model_name": NAME}, "bytes"),
    # -- a handler's archives: customized metadata, the input map handed whole --
    ("RegisterModel", {"url": "desc.mar", "initial_workers": 1, "synchronous": True}, "bytes"),
    ("RegisterModel", {"url": "plain.mar", "initial_workers": 1, "synchronous": True}, "bytes"),
    ("RegisterModel", {"url": "desc.mar", "model_name": "desc0"}, "bytes"),
    ("DescribeModel", {"model_name": "desc", "customized": True}, "described"),
    ("DescribeModel", {"model_name": "desc", "customized": True, "model_version": "1.0"}, "described"),
    ("DescribeModel", {"model_name": "desc", "customized": True, "model_version": "all"}, "described"),
    ("DescribeModel", {"model_name": "desc", "customized": False}, "described"),
    ("DescribeModel", {"model_name": "plain", "customized": True}, "described"),
    ("DescribeModel", {"model_name": "desc0", "customized": True}, "bytes"),
    ("Predictions", {"model_name": "desc", "input": {"data": "text"}}, "bytes"),
    ("Predictions", {"model_name": "desc", "input": {"body": "text"}}, "bytes"),
    ("Predictions", {"model_name": "desc", "input": {"other": "text", "data": "photo", "x": "empty"}}, "bytes"),
    ("Predictions", {"model_name": "desc", "input": {}}, "bytes"),
    ("Predictions", {"model_name": "desc", "input": {"data": "empty"}}, "bytes"),
    ("Predictions", {"model_name": "desc", "input": {"ü": "x*70000"}}, "bytes"),
    ("StreamPredictions2", {"requests": [{"model_name": "desc", "sequence_id": "s4", "input": {"data": "text"}},
                                         {"model_name": "plain", "sequence_id": "s4", "input": {"a": "text"}}]},
     "bytes"),
    ("UnregisterModel", {"model_name": "desc0"}, "bytes"),
    ("UnregisterModel", {"model_name": "plain"}, "bytes"),
    ("UnregisterModel", {"model_name": "desc"}, "bytes"),
    ("ListModels", {}, "bytes"),
    ("Ping", {}, "bytes"),
]

BODIES = {"text": b"hello", "empty": b"", "true": b"true"}


def variant(archive: Path, to: Path, name: str, version: str) -> Path:
    """A copy of `archive` named `name` at `version`, its model-config.yaml left out (registered with 0 workers unless
    asked, as TorchServe's default_workers_per_model is 0 here)."""
    with zipfile.ZipFile(archive) as source, zipfile.ZipFile(to, "w", zipfile.ZIP_STORED) as made:
        for entry in source.infolist():
            if entry.filename == "model-config.yaml":
                continue
            data = source.read(entry)
            if entry.filename == "MAR-INF/MANIFEST.json":
                manifest = json.loads(data)
                manifest["model"].pop("configFile", None)
                manifest["model"].update(modelName=name, modelVersion=version)
                data = json.dumps(manifest, indent=2).encode()
            made.writestr(entry, data)
    return to


def add_archives(store: Path, make_archive) -> None:
    """r18.mar, r18-v2.mar (from the store's resnet-18.mar), desc.mar, plain.mar (`make_archive(folder, name,
    handler code)`: tests/test_handler.py's), junk.mar."""
    variant(store / f"{NAME}.mar", store / "r18.mar", "r18", "1.0")
    variant(store / f"{NAME}.mar", store / "r18-v2.mar", "r18", "2.0")
    for name, code in (("desc", DESCRIBED_HANDLER + DESCRIBE), ("plain", DESCRIBED_HANDLER)):
        make_archive(store.parent / f"{name}-archive", name, code).rename(store / f"{name}.mar")
    (store / "junk.mar").write_text("hello\n")


INFERENCE_CALLS = {"Ping", "Predictions", "StreamPredictions", "StreamPredictions2", "Raw"}
MESSAGES = {"Ping": empty_pb2.Empty, "Predictions": inference_pb2.PredictionsRequest,
            "StreamPredictions": inference_pb2.PredictionsRequest,
            "DescribeModel": management_pb2.DescribeModelRequest, "ListModels": management_pb2.ListModelsRequest,
            "RegisterModel": management_pb2.RegisterModelRequest, "ScaleWorker": management_pb2.ScaleWorkerRequest,
            "SetDefault": management_pb2.SetDefaultRequest, "UnregisterModel": management_pb2.UnregisterModelRequest}
VOLATILE = {"pid", "startTime", "memoryUsage", "id", "gpuUsage"}  # a worker's, different on every start


def body(spec: str, photo: bytes) -> bytes:
    if spec == "photo":
        return photo
    if spec.startswith("x*"):
        return b"x" * int(spec[2:])
    return BODIES[spec]


def message(call: str, fields: dict, photo: bytes):
    """The row's request message: `input` values made from their names; "fill:N" sized so that the whole message
    is N bytes."""
    fields = {key: value for key, value in fields.items() if key not in ("token", "requests")}
    kind = MESSAGES.get(call, inference_pb2.PredictionsRequest)
    if "input" not in fields:
        return kind(**fields)
    fill = {key: int(value[5:]) for key, value in fields["input"].items() if value.startswith("fill:")}
    made = kind(**{**fields, "input": {key: b"" if key in fill else body(value, photo)
                                       for key, value in fields["input"].items()}})
    for key, size in fill.items():  # the entry's length changes its length prefix: settle in a few steps
        while made.ByteSize() != size:
            made.input[key] = b"x" * (len(made.input[key]) + size - made.ByteSize())
    return made


def metadata(end, api: str, token: str | None) -> tuple:
    if token is None:
        return end.metadata(api)
    if token == "none":
        return ()
    other = "management" if api == "inference" else "inference"
    return (("authorization", f"Bearer {end.keys[other]}" if token == "other" else token.format(key=end.keys[api])),)


def _error(exc: grpc.RpcError) -> tuple[str, str]:
    return exc.code().name, exc.details() or ""


def _answer(response: inference_pb2.PredictionResponse) -> tuple:
    """A stream's answer: its prediction, or its status (code, message, ErrorInfo reasons), and its sequence id."""
    if response.HasField("status"):
        reasons = []
        for detail in response.status.details:
            info = error_details_pb2.ErrorInfo()
            reasons.append(info.reason if detail.Unpack(info) else detail.type_url)
        return ("status", response.status.code, response.status.message, tuple(reasons),
                response.prediction.decode("utf-8", "replace"), response.sequence_id)
    return ("prediction", response.prediction.decode("utf-8", "replace"), response.sequence_id)


def _lockstep(call, requests: list, meta: tuple) -> tuple:
    """StreamPredictions2: each request sent once the answer to the one before has come."""
    pending: queue.Queue = queue.Queue()

    def sent():
        for request in requests:
            yield request
            if pending.get(timeout=TIMEOUT) == "ended":  # the call ended before answering it
                return
    answers = []
    try:
        for response in call(sent(), metadata=meta, timeout=TIMEOUT):
            answers.append(_answer(response))
            pending.put("answered")
    except grpc.RpcError as exc:
        return tuple(answers), *_error(exc)
    finally:
        pending.put("ended")
    return tuple(answers), "OK", ""


def ask(end, call: str, fields: dict, photo: bytes):
    """One row's call on `end` (tests/test_torchserve_grpc.py's Endpoint): its answer, comparable."""
    api = "inference" if call in INFERENCE_CALLS else "management"
    if call == "Raw":
        return end.raw(fields["method"], fields["bytes"])
    stub, meta = end.inference if api == "inference" else end.management, metadata(end, api, fields.get("token"))
    try:
        if call == "StreamPredictions2":
            return _lockstep(stub.StreamPredictions2, [message(call, one, photo) for one in fields["requests"]], meta)
        return _called(getattr(stub, call), call, message(call, fields, photo), meta)
    except ValueError as exc:  # refused by grpc's client itself (e.g. a metadata value it will not send)
        return "CLIENT", type(exc).__name__


def _called(method, call: str, request, meta: tuple):
    answers = []
    try:
        if call == "StreamPredictions":
            for response in method(request, metadata=meta, timeout=TIMEOUT):
                answers.append(_answer(response))
            return tuple(answers), "OK", ""
        reply = method(request, metadata=meta, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        return (tuple(answers), *_error(exc)) if call == "StreamPredictions" else _error(exc)
    if call == "Ping":
        return "OK", reply.health
    return "OK", reply.prediction.decode("utf-8", "replace") if call == "Predictions" else reply.msg


def wait_ready(end, name: str) -> None:
    """The model's workers all READY and as many as it may have (after a scale, or a worker restarted)."""
    deadline, text = time.monotonic() + TIMEOUT, ""
    while time.monotonic() < deadline:
        code, text = ask(end, "DescribeModel", {"model_name": name}, b"")
        if code == "OK":
            described = json.loads(text)[0]
            workers = described["workers"]
            if described["minWorkers"] <= len(workers) <= described["maxWorkers"] and \
                    all(w["status"] == "READY" for w in workers):
                return
        time.sleep(0.5)
    raise AssertionError(f"{name}: workers not READY after {TIMEOUT} s: {text[-600:]}")


def replay(end, photo: bytes, rows: list | None = None) -> list:
    answers = []
    for call, fields, _ in ROWS if rows is None else rows:
        if call == "Wait":
            wait_ready(end, fields["model_name"])
            answers.append(None)
        else:
            answers.append(ask(end, call, fields, photo))
    return answers


def _described(text: str):
    models = json.loads(text)
    for model in models:
        model["workers"] = [{k: v for k, v in w.items() if k not in VOLATILE} for w in model["workers"]]
    return models


def _top5(text: str) -> tuple[list, list]:
    answer = json.loads(text)
    return list(answer), list(answer.values())


def _close(mine: str, theirs: str) -> bool:
    (labels, values), (their_labels, their_values) = _top5(mine), _top5(theirs)
    return labels == their_labels and np.allclose(values, their_values, rtol=0, atol=1e-5)


def different(compare: str, ours, theirs) -> str | None:
    """Why `ours` is not `theirs` under `compare`; None: the same (or not compared)."""
    if compare == "wait" or compare.startswith("differs: "):
        return None
    if compare == "bytes":
        return None if ours == theirs else "answer"
    if len(ours) == 2:  # a unary call: (code, text)
        if ours[0] != theirs[0]:
            return "code"
        if ours[0] != "OK":
            return None if ours == theirs else "details"
        if compare == "described":
            return None if _described(ours[1]) == _described(theirs[1]) else "description"
        return None if _close(ours[1], theirs[1]) else "prediction"
    # a stream: (answers, code, details); its predictions compared as top 5s
    if ours[1:] != theirs[1:] or len(ours[0]) != len(theirs[0]):
        return "end or count"
    for mine, reference in zip(ours[0], theirs[0]):
        if mine[0] != reference[0] or (mine[0] == "status" and mine != reference):
            return "answers"
        if mine[0] == "prediction" and (mine[2] != reference[2] or not _close(mine[1], reference[1])):
            return "prediction"
    return None
