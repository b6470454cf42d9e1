"""TorchServe's gRPC APIs (its own inference.proto and management.proto, in proto/) served by the REST front's own
calls: the same prediction path and registry, answered with TorchServe 0.12's gRPC status codes and messages."""
from __future__ import annotations

import json

import grpc
from google.protobuf import any_pb2, empty_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from server.torchserve.inference import Inference, no_worker
from server.torchserve.management import Management
from server.torchserve.proto import inference_pb2, management_pb2
from server.torchserve.registry import NotFound
from server.torchserve.replies import Tokens, dumps

INFERENCE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MANAGEMENT = "org.pytorch.serve.grpc.management.ManagementAPIsService"
TOKEN_FAILED = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"
RECEIVE_BYTES = 64 << 20  # read this much of an over-size message to answer it as TorchServe does, no more
INTERNAL_SERVER = "org.pytorch.serve.http.InternalServerException"
RESET = "Stream removed (RST_STREAM (Received RST_STREAM with error code 8))"
# StreamPredictions of a handler that does not stream: TorchServe's GRPCJob reads the answer's ts_stream_next header,
# which such a handler never sets (a NullPointerException): its worker is restarted and the stream ends so
WORKER_DIED = "Worker died.\n" + INTERNAL_SERVER
NO_DESCRIBE_WORKER = "InternalServerException.()\n" + INTERNAL_SERVER  # its message lost: sendException's
# TorchServe's description of an error is "MESSAGE\nCLASS", its exception's Java class (grpc-java's augmentDescription)
CLASSES = {"ModelNotFoundException": "org.pytorch.serve.archive.model.ModelNotFoundException",
           "ModelVersionNotFoundException": "org.pytorch.serve.archive.model.ModelVersionNotFoundException",
           "InvalidModelException": "org.pytorch.serve.archive.model.InvalidModelException",
           "DownloadArchiveException": "org.pytorch.serve.archive.DownloadArchiveException",
           "BadRequestException": "org.pytorch.serve.http.BadRequestException",
           "ConflictStatusException": "org.pytorch.serve.http.ConflictStatusException",
           "InvalidModelVersionException": "org.pytorch.serve.http.InvalidModelVersionException",
           "ServiceUnavailableException": "org.pytorch.serve.http.ServiceUnavailableException",
           "InternalServerException": INTERNAL_SERVER}
# GRPCUtils.getGRPCStatusCode: TorchServe's HTTP status of an answer as a gRPC code
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND, 409: grpc.StatusCode.ABORTED,
         413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
         416: grpc.StatusCode.OUT_OF_RANGE, 499: grpc.StatusCode.CANCELLED, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
         501: grpc.StatusCode.UNIMPLEMENTED, 503: grpc.StatusCode.UNAVAILABLE}
# Exceptions ManagementImpl does not catch (IllegalArgumentExceptions): grpc-java answers them UNKNOWN, no message
UNCAUGHT = {"ConflictStatusException", "InvalidModelVersionException"}


def code_of(status: int) -> grpc.StatusCode:
    if status in CODES:
        return CODES[status]
    if 400 <= status < 500:
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL if 500 <= status < 600 else grpc.StatusCode.UNKNOWN


class Refused(Exception):
    """A call's gRPC error: its code and description."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


def _refusal(response) -> Refused:
    """A REST answer's error (TorchServe's JSON body) as the gRPC error TorchServe's management gives for it."""
    body = json.loads(response.body)
    kind = body.get("type", "InternalServerException")
    if kind in UNCAUGHT:
        return Refused(grpc.StatusCode.UNKNOWN, "")
    return Refused(code_of(response.status_code), f"{body.get('message', '')}\n{CLASSES.get(kind, INTERNAL_SERVER)}")


class Service:
    """One gRPC API: its calls read raw bytes (the token, then the size, are checked before a message is parsed)."""

    def __init__(self, name: str, api: str, tokens: Tokens, max_request_size: int):
        self.name, self.api, self.tokens, self.max_request_size = name, api, tokens, max_request_size

    def _allowed(self, context) -> None:
        headers = {key.encode(): value.encode() for key, value in context.invocation_metadata() or ()
                   if key == "authorization" and isinstance(value, str)}
        if not self.tokens.allowed(headers, self.api):
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, TOKEN_FAILED)

    def _parsed(self, request: bytes, kind):
        if len(request) > self.max_request_size:
            # grpc-java (maxInboundMessageSize) resets the stream: what a Python client of TorchServe then reads
            raise Refused(grpc.StatusCode.CANCELLED, RESET)
        try:
            return kind.FromString(request)
        except DecodeError:  # grpc-java's parse failure reaches the client as UNKNOWN, no message
            raise Refused(grpc.StatusCode.UNKNOWN, "") from None

    def _checked(self, request: bytes, context, kind):
        self._allowed(context)
        return self._parsed(request, kind)

    def unary(self, call, kind):
        async def handle(request: bytes, context) -> bytes:
            try:
                return (await call(self._checked(request, context, kind))).SerializeToString()
            except Refused as exc:
                await context.abort(exc.code, exc.details)
        return grpc.unary_unary_rpc_method_handler(handle)

    def streamed(self, call, kind):
        """`call`: an async generator of the answers to one request."""
        async def handle(request: bytes, context):
            try:
                async for answer in call(self._checked(request, context, kind)):
                    yield answer.SerializeToString()
            except Refused as exc:
                await context.abort(exc.code, exc.details)
        return grpc.unary_stream_rpc_method_handler(handle)

    def bidi(self, call, kind):
        """Requests answered in turn: `call` gives each one's answer (or None) and whether the stream ends there
        (UNKNOWN, no message: TorchServe's NullPointerException); else it ends when the client's does."""
        async def handle(requests, context):
            try:
                self._allowed(context)
                async for request in requests:
                    answer, ended = await call(self._parsed(request, kind))
                    if answer is not None:
                        yield answer.SerializeToString()
                    if ended:
                        raise Refused(grpc.StatusCode.UNKNOWN, "")
            except Refused as exc:
                await context.abort(exc.code, exc.details)
        return grpc.stream_stream_rpc_method_handler(handle)


def _status(code: grpc.StatusCode, details: str) -> inference_pb2.PredictionResponse:
    """StreamPredictions2's error, an answer of the stream: TorchServe's google.rpc.Status, its exception (or the
    description it gives) as an ErrorInfo's reason."""
    message, _, reason = details.rpartition("\n")
    packed = any_pb2.Any()
    packed.Pack(error_details_pb2.ErrorInfo(reason=reason))
    return inference_pb2.PredictionResponse(status=status_pb2.Status(code=code.value[0], message=message,
                                                                     details=[packed]))


def inference_service(inference: Inference, tokens: Tokens, max_request_size: int):
    """InferenceAPIsService: Ping, Predictions, StreamPredictions (one answer: no handler here streams),
    StreamPredictions2 (as TorchServe 0.12 answers it for a model without sequences)."""
    service = Service(INFERENCE, "inference", tokens, max_request_size)

    async def ping(request) -> inference_pb2.TorchServeHealthResponse:
        # TorchServe answers OK either way, the health in the JSON
        healthy = await inference.healthy()
        return inference_pb2.TorchServeHealthResponse(health=dumps({"status": "Healthy" if healthy else "Unhealthy"}))

    async def predicted(request) -> bytes:
        if not request.model_name:
            raise Refused(grpc.StatusCode.INTERNAL, "Parameter model_name is required.\nBadRequestException.()")
        try:
            model = inference.registry.find(request.model_name, request.model_version or None)
        except NotFound as exc:  # INTERNAL, not NOT_FOUND: TorchServe's InferenceImpl
            raise Refused(grpc.StatusCode.INTERNAL, f"{exc}\n{CLASSES[exc.kind]}") from None
        inputs = dict(request.input)
        # the image path: the entry TorchServe's image_classifier reads (data, else body); a handler gets them all
        payload = inputs.get("data") or inputs.get("body") or b""
        model.pending += 1
        try:
            response = await inference.prediction(model, payload, {}, entries=inputs,
                                                  version=request.model_version or None)
        finally:
            model.pending -= 1
        if response.status_code == 200:
            return bytes(response.body)
        message = json.loads(response.body).get("message", "")
        if "has no worker to serve inference request" in message:  # its job queue refused it
            raise Refused(grpc.StatusCode.INTERNAL, f"{message}\nInternalServerException.()")
        raise Refused(code_of(response.status_code), f"{message}\n{INTERNAL_SERVER}")

    async def predictions(request) -> inference_pb2.PredictionResponse:
        return inference_pb2.PredictionResponse(prediction=await predicted(request))

    async def streamed(request):
        """TorchServe 0.12's StreamPredictions of a handler that does not stream: the answer, then WORKER_DIED."""
        yield inference_pb2.PredictionResponse(prediction=await predicted(request))
        raise Refused(grpc.StatusCode.INTERNAL, WORKER_DIED)

    async def sequenced(request) -> tuple[inference_pb2.PredictionResponse | None, bool]:
        """StreamPredictions2, one request, as TorchServe 0.12 answers it for a model that keeps no sequences (none
        here does): its answer, and whether the stream ends. No sequence_id: refused, the stream goes on (its
        ts_request_sequence_start entry is read through a ByteString's toString(): never "true"). Then TorchServe
        looks the model's sequence up, which fails but for an unknown version: the stream ends, after the error
        if there was one; a request it queued is answered to no one (so it is not predicted here)."""
        if not request.sequence_id:
            return _status(grpc.StatusCode.INTERNAL, "Parameter sequenceId is required.\nBadRequestException.()"), False
        if not request.model_name:
            return _status(grpc.StatusCode.INTERNAL, "Parameter model_name is required.\nBadRequestException.()"), True
        try:
            model = inference.registry.find(request.model_name, request.model_version or None)
        except NotFound as exc:
            known = exc.kind == "ModelVersionNotFoundException"  # TorchServe's getJobGroup catches it: the stream goes on
            return _status(grpc.StatusCode.INTERNAL, f"{exc}\n{CLASSES[exc.kind]}"), not known
        if not model.workers or not model.members:
            refusal = no_worker(model.name, request.model_version or None)
            return _status(grpc.StatusCode.INTERNAL, f"{refusal}\nInternalServerException.()"), True
        return None, True

    return grpc.method_handlers_generic_handler(INFERENCE, {
        "Ping": service.unary(ping, empty_pb2.Empty),
        "Predictions": service.unary(predictions, inference_pb2.PredictionsRequest),
        "StreamPredictions": service.streamed(streamed, inference_pb2.PredictionsRequest),
        "StreamPredictions2": service.bidi(sequenced, inference_pb2.PredictionsRequest)})


def _positive(value: int, key: str) -> dict:
    """GRPCUtils.getRegisterParam: a number above 0 is given, anything else is the default."""
    return {key: [str(value)]} if value > 0 else {}


def management_service(management: Management, inference: Inference, tokens: Tokens, max_request_size: int):
    """ManagementAPIsService: the REST management calls, each with the parameters TorchServe derives from the
    message; the answer's status (or its JSON) as msg. DescribeModel's customized metadata: the handler's
    describe_handle (through `inference`)."""
    service = Service(MANAGEMENT, "management", tokens, max_request_size)

    async def answered(handler, params: dict, path: dict, whole: bool = False) -> management_pb2.ManagementResponse:
        response = await management.call(handler, params, path)
        if not 200 <= response.status_code < 300:
            raise _refusal(response)
        text = bytes(response.body).decode()
        return management_pb2.ManagementResponse(msg=text.rstrip("\n") if whole else json.loads(text)["status"])

    def model_api() -> None:
        if not management.enable_model_api:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                          "Model API disabled\norg.pytorch.serve.archive.model.ModelException")

    async def register(request):
        model_api()
        params = {key: [value] for key, value in (("url", request.url), ("model_name", request.model_name),
                                                  ("runtime", request.runtime), ("handler", request.handler))
                  if value}
        for key in ("batch_size", "max_batch_delay", "initial_workers", "response_timeout", "startup_timeout"):
            params.update(_positive(getattr(request, key), key))
        params["synchronous"] = ["true" if request.synchronous else "false"]
        if request.s3_sse_kms:
            params["s3_sse_kms"] = ["true"]
        return await answered(management.register, params, {})

    async def scale(request):
        low = request.min_worker if request.min_worker > 0 else 1
        high = request.max_worker if request.max_worker > 0 else low
        if not request.model_name and high >= low:  # TorchServe looks a null name up: a NullPointerException
            raise Refused(grpc.StatusCode.UNKNOWN, "")
        params = {"min_worker": [str(low)], "max_worker": [str(high)],
                  "synchronous": ["true" if request.synchronous else "false"]}
        return await answered(management.scale, params, _path(request))

    async def describe(request):
        if not request.customized or request.model_version == "all":
            return await answered(management.describe, {}, _path(request), whole=True)
        # TorchServe asks a worker (a job, as a prediction's): its errors are InferenceImpl's, INTERNAL
        try:
            model = inference.registry.find(request.model_name, request.model_version or None)
        except NotFound as exc:
            raise Refused(grpc.StatusCode.INTERNAL, f"{exc}\n{CLASSES[exc.kind]}") from None
        if not model.workers:
            raise Refused(grpc.StatusCode.INTERNAL, NO_DESCRIBE_WORKER)
        answer = await inference.described(model)
        if answer.status_code != 200:
            message = json.loads(answer.body).get("message", "")
            raise Refused(code_of(answer.status_code), f"{message}\n{INTERNAL_SERVER}")
        described = await answered(management.describe, {}, _path(request), whole=True)
        models = json.loads(described.msg)
        if answer.body and len(models) == 1:  # as TorchServe reads it into a JsonObject: anything else (null too) {}
            try:
                metadata = json.loads(answer.body)
            except ValueError:
                metadata = {}
            models[0]["customizedMetadata"] = metadata if isinstance(metadata, dict) else {}
        return management_pb2.ManagementResponse(msg=dumps(models))

    async def listed(request):
        return await answered(management.list, {"limit": [str(request.limit)],
                                                "next_page_token": [str(request.next_page_token)]}, {}, whole=True)

    async def set_default(request):
        return await answered(management.set_default, {}, {"model_name": request.model_name,
                                                           "model_version": request.model_version})

    async def unregister(request):
        model_api()
        if not request.model_name:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          "Parameter url is required.\norg.pytorch.serve.http.BadRequestException")
        await answered(management.unregister, {}, _path(request))
        return management_pb2.ManagementResponse(msg=f'Model "{request.model_name}" unregistered')

    return grpc.method_handlers_generic_handler(MANAGEMENT, {
        "RegisterModel": service.unary(register, management_pb2.RegisterModelRequest),
        "ScaleWorker": service.unary(scale, management_pb2.ScaleWorkerRequest),
        "DescribeModel": service.unary(describe, management_pb2.DescribeModelRequest),
        "ListModels": service.unary(listed, management_pb2.ListModelsRequest),
        "SetDefault": service.unary(set_default, management_pb2.SetDefaultRequest),
        "UnregisterModel": service.unary(unregister, management_pb2.UnregisterModelRequest)})


def _path(request) -> dict:
    return {"model_name": request.model_name, **({"model_version": request.model_version} if request.model_version else {})}


def server(host: str, port: int, handler, max_request_size: int) -> grpc.aio.Server:
    """A grpc.aio server of `handler` on host:port, in the running loop (the front's); raises RuntimeError when the
    port cannot be bound."""
    made = grpc.aio.server(options=[("grpc.max_receive_message_length", max(RECEIVE_BYTES, 2 * max_request_size)),
                                    ("grpc.so_reuseport", 0)])
    made.add_generic_rpc_handlers((handler,))
    made.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return made
