"""TorchServe's gRPC APIs (its own inference.proto and management.proto, in proto/) over the operations REST serves
(operations.py, predictions.py), answered with TorchServe 0.12's gRPC status codes and messages."""
from __future__ import annotations

import json

import grpc
from google.protobuf import any_pb2, empty_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from server.torchserve.operations import Operations, Status
from server.torchserve.predictions import Predictions, no_worker
from server.torchserve.proto import inference_pb2, management_pb2
from server.torchserve.refusals import KINDS, TOKEN_FAILED, Refusal, code_of
from server.torchserve.replies import Tokens, dumps

INFERENCE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MANAGEMENT = "org.pytorch.serve.grpc.management.ManagementAPIsService"
RECEIVE_BYTES = 64 << 20  # read this much of an over-size message to answer it as TorchServe does, no more
RESET = "Stream removed (RST_STREAM (Received RST_STREAM with error code 8))"


def _inference_impl(exc: Refusal, described: str | None = None) -> Refusal:
    """`exc` as TorchServe's InferenceImpl answers what it catches itself: INTERNAL, the message, then `described`
    (else the exception's Java class), not the code its management API gives."""
    return Refusal(exc.message, exc.kind, exc.status,
                   grpc=("INTERNAL", f"{exc.message}\n{described or KINDS[exc.kind].java}"))


def _worker(exc: Refusal) -> Refusal:
    """A worker's answer as TorchServe's GRPCJob relays it: the gRPC code of its HTTP status, its message,
    InternalServerException's class whatever the kind."""
    return Refusal(exc.message, exc.kind, exc.status,
                   grpc=(code_of(exc.status), f"{exc.message}\n{KINDS['InternalServerException'].java}"))


def _abort(context, exc: Refusal):
    code, details = exc.grpc()
    return context.abort(grpc.StatusCode[code], details)


class Service:
    """One gRPC API: its calls read raw bytes (the token, then the size, are checked before a message is parsed)."""

    def __init__(self, name: str, api: str, tokens: Tokens, max_request_size: int):
        self.name, self.api, self.tokens, self.max_request_size = name, api, tokens, max_request_size

    def _allowed(self, context) -> None:
        headers = {key.encode(): value.encode() for key, value in context.invocation_metadata() or ()
                   if key == "authorization" and isinstance(value, str)}
        if not self.tokens.allowed(headers, self.api):
            raise Refusal(TOKEN_FAILED, "InvalidKeyException")

    def _parsed(self, request: bytes, kind):
        if len(request) > self.max_request_size:
            # grpc-java (maxInboundMessageSize) resets the stream: what a Python client of TorchServe then reads
            raise Refusal(RESET, "StreamReset")
        try:
            return kind.FromString(request)
        except DecodeError:  # grpc-java's parse failure reaches the client as UNKNOWN, no message
            raise Refusal("", "InvalidProtocolBufferException") from None

    def _checked(self, request: bytes, context, kind):
        self._allowed(context)
        return self._parsed(request, kind)

    def unary(self, call, kind):
        async def handle(request: bytes, context) -> bytes:
            try:
                return (await call(self._checked(request, context, kind))).SerializeToString()
            except Refusal as exc:
                await _abort(context, exc)
        return grpc.unary_unary_rpc_method_handler(handle)

    def streamed(self, call, kind):
        """`call`: an async generator of the answers to one request."""
        async def handle(request: bytes, context):
            try:
                async for answer in call(self._checked(request, context, kind)):
                    yield answer.SerializeToString()
            except Refusal as exc:
                await _abort(context, exc)
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
                        raise Refusal("", "NullPointerException")
            except Refusal as exc:
                await _abort(context, exc)
        return grpc.stream_stream_rpc_method_handler(handle)


def _status(refusal: Refusal) -> inference_pb2.PredictionResponse:
    """StreamPredictions2's error, an answer of the stream: TorchServe's google.rpc.Status, its exception (or the
    description it gives) as an ErrorInfo's reason."""
    code, details = refusal.grpc()
    message, _, reason = details.rpartition("\n")
    packed = any_pb2.Any()
    packed.Pack(error_details_pb2.ErrorInfo(reason=reason))
    return inference_pb2.PredictionResponse(status=status_pb2.Status(code=grpc.StatusCode[code].value[0],
                                                                     message=message, details=[packed]))


def inference_service(predictions: Predictions, tokens: Tokens, max_request_size: int):
    """InferenceAPIsService: Ping, Predictions, StreamPredictions (one answer: no handler here streams),
    StreamPredictions2 (as TorchServe 0.12 answers it for a model without sequences)."""
    service = Service(INFERENCE, "inference", tokens, max_request_size)

    async def ping(request) -> inference_pb2.TorchServeHealthResponse:
        # TorchServe answers OK either way, the health in the JSON
        healthy = await predictions.healthy()
        return inference_pb2.TorchServeHealthResponse(health=dumps({"status": "Healthy" if healthy else "Unhealthy"}))

    def required(parameter: str) -> Refusal:
        return _inference_impl(Refusal(f"Parameter {parameter} is required.", "BadRequestException"),
                               "BadRequestException.()")

    def found(request):
        """The request's model; a lookup's refusal is InferenceImpl's (INTERNAL, not NOT_FOUND)."""
        try:
            return predictions.registry.find(request.model_name, request.model_version or None)
        except Refusal as exc:
            raise _inference_impl(exc) from None

    async def predicted(request) -> bytes:
        if not request.model_name:
            raise required("model_name")
        model = found(request)
        inputs = dict(request.input)
        # the image path: the entry TorchServe's image_classifier reads (data, else body); a handler gets them all
        payload = inputs.get("data") or inputs.get("body") or b""
        try:
            answer = await predictions.predict(model, payload, {}, entries=inputs,
                                               version=request.model_version or None)
        except Refusal as exc:
            if exc.kind == "ServiceUnavailableException":  # its job queue refused it
                raise _inference_impl(exc, "InternalServerException.()") from None
            raise _worker(exc) from None
        return answer.body

    async def answered(request) -> inference_pb2.PredictionResponse:
        return inference_pb2.PredictionResponse(prediction=await predicted(request))

    async def streamed(request):
        """TorchServe 0.12's StreamPredictions of a handler that does not stream: the answer, then the worker's
        NullPointerException (its ts_stream_next header, which such a handler never sets): the worker restarted,
        the stream ended so."""
        yield inference_pb2.PredictionResponse(prediction=await predicted(request))
        raise Refusal("Worker died.", "InternalServerException")

    async def sequenced(request) -> tuple[inference_pb2.PredictionResponse | None, bool]:
        """StreamPredictions2, one request, as TorchServe 0.12 answers it for a model that keeps no sequences (none
        here does): its answer, and whether the stream ends. No sequence_id: refused, the stream goes on (its
        ts_request_sequence_start entry is read through a ByteString's toString(): never "true"). Then TorchServe
        looks the model's sequence up, which fails but for an unknown version: the stream ends, after the error
        if there was one; a request it queued is answered to no one (so it is not predicted here)."""
        if not request.sequence_id:
            return _status(required("sequenceId")), False
        if not request.model_name:
            return _status(required("model_name")), True
        try:
            model = found(request)
        except Refusal as exc:
            known = exc.kind == "ModelVersionNotFoundException"  # TorchServe's getJobGroup catches it: the stream goes on
            return _status(exc), not known
        if not model.workers or not model.members:
            refusal = Refusal(no_worker(model.name, request.model_version or None), "ServiceUnavailableException")
            return _status(_inference_impl(refusal, "InternalServerException.()")), True
        return None, True

    return grpc.method_handlers_generic_handler(INFERENCE, {
        "Ping": service.unary(ping, empty_pb2.Empty),
        "Predictions": service.unary(answered, inference_pb2.PredictionsRequest),
        "StreamPredictions": service.streamed(streamed, inference_pb2.PredictionsRequest),
        "StreamPredictions2": service.bidi(sequenced, inference_pb2.PredictionsRequest)})


def _positive(value: int, key: str) -> dict:
    """GRPCUtils.getRegisterParam: a number above 0 is given, anything else is the default."""
    return {key: [str(value)]} if value > 0 else {}


def management_service(operations: Operations, predictions: Predictions, tokens: Tokens, max_request_size: int):
    """ManagementAPIsService: the management operations, each with the parameters TorchServe derives from the
    message; a change's status (or the JSON described) as msg. DescribeModel's customized metadata: the handler's
    describe_handle (through `predictions`)."""
    service = Service(MANAGEMENT, "management", tokens, max_request_size)

    async def answered(operation, params: dict, path: dict) -> management_pb2.ManagementResponse:
        result = await operations.call(operation, params, path)
        return management_pb2.ManagementResponse(msg=result.message if isinstance(result, Status) else dumps(result))

    def model_api() -> None:
        if not operations.enable_model_api:
            raise Refusal("Model API disabled", "ModelException")

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
        return await answered(operations.register, params, {})

    async def scale(request):
        low = request.min_worker if request.min_worker > 0 else 1
        high = request.max_worker if request.max_worker > 0 else low
        if not request.model_name and high >= low:  # TorchServe looks a null name up: a NullPointerException
            raise Refusal("", "NullPointerException")
        params = {"min_worker": [str(low)], "max_worker": [str(high)],
                  "synchronous": ["true" if request.synchronous else "false"]}
        return await answered(operations.scale, params, _path(request))

    async def describe(request):
        if not request.customized or request.model_version == "all":
            return await answered(operations.describe, {}, _path(request))
        # TorchServe asks a worker (a job, as a prediction's): its errors are InferenceImpl's, INTERNAL
        try:
            model = predictions.registry.find(request.model_name, request.model_version or None)
        except Refusal as exc:
            raise _inference_impl(exc) from None
        if not model.workers:  # its message lost: sendException's
            raise Refusal("InternalServerException.()", "InternalServerException")
        try:
            answer = await predictions.described(model)
        except Refusal as exc:
            raise _worker(exc) from None
        models = await operations.call(operations.describe, {}, _path(request))
        if answer.body and len(models) == 1:  # as TorchServe reads it into a JsonObject: anything else (null too) {}
            try:
                metadata = json.loads(answer.body)
            except ValueError:
                metadata = {}
            models[0]["customizedMetadata"] = metadata if isinstance(metadata, dict) else {}
        return management_pb2.ManagementResponse(msg=dumps(models))

    async def listed(request):
        return await answered(operations.list, {"limit": [str(request.limit)],
                                                "next_page_token": [str(request.next_page_token)]}, {})

    async def set_default(request):
        return await answered(operations.set_default, {}, {"model_name": request.model_name,
                                                           "model_version": request.model_version})

    async def unregister(request):
        model_api()
        if not request.model_name:
            raise Refusal("Parameter url is required.", "BadRequestException")
        await answered(operations.unregister, {}, _path(request))
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
