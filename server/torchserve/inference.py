"""TorchServe's inference API on Triton: /ping, and /predictions/NAME[/VERSION] answered as TorchServe's
image_classifier handler answers (its top 5 as one JSON object), the image sent to Triton's NAME_image as bytes;
/explanations/NAME[/VERSION] (and KServe's :explain) by a handler's explain_handle (the image path's: its
explainer, explainers.py); OPTIONS / its description."""
from __future__ import annotations

import asyncio
import json
import re
from contextlib import asynccontextmanager

import numpy as np
import tritonclient.http.aio as aioclient
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from tritonclient.utils import InferenceServerException

from common.contract import (BODY, CONTENT_TYPE, ENTRIES_PARAMETER, IMAGE_BYTES, LOGITS, RESPONSE, STATUS,
                             STATUS_PARAMETER)
from common.messages import first_line
from server.torchserve import openapi
from server.torchserve.explainers import Unavailable
from server.torchserve.registry import NotFound, Registry
from server.torchserve.replies import HANDLERS, error, reply, too_large
from server.unix_http import aio_client

# Triton not answering at all (its socket closed while serve-repo restarts it: aiohttp's connection errors are
# OSErrors), or not within the response timeout.
UNREACHABLE = (OSError, asyncio.TimeoutError)
TOP_K = 5  # ImageClassifier.topk
PREDICTION_FAILED = "Prediction failed"
# python_backend's error for the requests of a batch its stub held when it died (as in an ensemble's step too)
DEAD_STUB = re.compile(r"Stub process '[^']*' is not healthy")
DISCARD_BYTES = 64 << 20
# Headers not handed to a handler (TorchServe hands it the rest): the token, and what only the connection means.
EXPLAIN = "explain"  # the request header TorchServe's BaseHandler reads: "True" for an explanation
DESCRIBE = "describe"  # and "True" here: its describe_handle answers
NOT_FORWARDED = {"authorization", "host", "connection", "content-length", "transfer-encoding", "expect",
                 "keep-alive", "upgrade"}


class TooLarge(Exception):
    pass


async def body_of(request: Request, limit: int) -> bytes:
    """The request's payload: the raw body (curl -T, --data-binary), or a multipart form's 'data' / 'body' field
    (TorchServe's handlers read those two), else its first field; TooLarge past `limit` bytes."""
    chunks, size, stream = [], 0, request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            await _discard(stream, size, limit)
            raise TooLarge
        chunks.append(chunk)
    body = b"".join(chunks)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        request._body = body  # noqa: SLF001 - Starlette's form() reads the body it cached, the stream is spent
        async with request.form(max_part_size=limit) as form:
            fields = [form.get("data"), form.get("body"), *(value for _, value in form.multi_items())]
            value = next((v for v in fields if v is not None), b"")
            return await value.read() if hasattr(value, "read") else str(value).encode()
    return body


async def _discard(stream, size: int, limit: int) -> None:
    """Read on past the limit (up to DISCARD_BYTES) before answering 413, as TorchServe's frontend does: a client
    still sending when the answer comes sees its connection reset instead of the 413."""
    async for chunk in stream:
        size += len(chunk)
        if size > max(DISCARD_BYTES, 2 * limit):
            return


def no_worker(name: str, version: str | None) -> str:
    """TorchServe's refusal of a prediction no worker can take (ApiUtils.getStreamingInferenceErrorResponseMessage:
    the version where the request named one)."""
    named = f'" Version {version}' if version else ""
    return (f'Model "{name}{named}" has no worker to serve inference request. Please use scale workers API to add '
            "workers. If this is a sequence inference, please check if it is closed, or expired; or exceeds "
            "maxSequenceJobQueueSize")


def top5(logits: np.ndarray, labels: dict[str, str] | None) -> dict:
    """ImageClassifier.postprocess: softmax, top 5, each class named by index_to_name.json (else its index)."""
    row = logits.astype(np.float32).reshape(-1)
    exp = np.exp(row - row.max())
    probs = exp / exp.sum(dtype=np.float32)
    order = np.argsort(-probs, kind="stable")[:TOP_K]
    return {(labels[str(i)] if labels is not None else str(i)): float(probs[i]) for i in order}


class Inference:
    def __init__(self, registry: Registry, triton_url: str, max_request_size: int, job_queue_size: int,
                 instances=dict, log=print):
        self.registry, self.triton_url, self.job_queue_size, self.log = registry, triton_url, job_queue_size, log
        self.instances = instances  # () -> {Triton model: its live instances}
        self.max_request_size = max_request_size
        self.client: aioclient.InferenceServerClient | None = None  # made in the front's loop (startup)

    async def startup(self) -> None:
        # One client, reused: its aiohttp session keeps connections to Triton open across requests.
        self.client = await aio_client(self.triton_url, conn_limit=512)

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def healthy(self) -> bool:
        """Every model ready in Triton with as many live instances as its workers (a dead stub counts until
        serve-repo has replaced it): /ping's and gRPC Ping's answer."""
        alive = await asyncio.to_thread(self.instances)
        for model in self.registry.all():
            if not model.members:  # registered with synchronous=false, still building: its workers are to come
                continue
            try:
                ready = await self.client.is_model_ready(model.entry)
            except (InferenceServerException, OSError):
                ready = False
            if not ready or alive.get(model.triton, 0) < model.workers:
                return False
        return True

    async def ping(self, request: Request) -> Response:
        """Healthy, else 500 Unhealthy."""
        if await self.healthy():
            return reply({"status": "Healthy"})
        return reply({"status": "Unhealthy"}, 500)

    async def predict(self, request: Request, explain: bool = False) -> Response:
        params = request.path_params
        try:
            model = self.registry.find(params["model_name"], params.get("model_version"))
        except NotFound as exc:
            return error(404, str(exc), exc.kind)
        if request.method == "OPTIONS":  # TorchServe's per-model description, on any prediction or explanation path
            return openapi.model_reply("inference", model.name)
        # Counted from here, so that an unregistering waits for this request (Registry.unregister).
        model.pending += 1
        try:
            try:
                payload = await body_of(request, self.max_request_size)
            except TooLarge:
                return too_large()
            except ClientDisconnect:  # gone, or cut by the front (a stalled body): no one reads an answer
                return error(400, "the request's body did not arrive", "BadRequestException")
            return await self.prediction(model, payload, request.headers, explain, version=params.get("model_version"))
        finally:
            model.pending -= 1

    async def explanations(self, request: Request) -> Response:
        return await self.predict(request, explain=True)

    async def prediction(self, model, payload: bytes, headers, explain: bool = False,
                         entries: dict[str, bytes] | None = None, version: str | None = None) -> Response:
        """`payload` predicted by `model` (found, and counted in its pending by the caller), REST's or gRPC's:
        TorchServe's answer as REST gives it; `headers` those a handler is handed; `explain`: an explanation.
        `entries`: a gRPC input map, which a handler's archive is handed whole (the image path reads `payload`);
        `version`: the version the request named (TorchServe's refusals name it)."""
        if model.handler and entries is not None:  # the handler judges them, empty ones too
            payload, headers = b"".join(entries.values()), {
                **headers, ENTRIES_PARAMETER: json.dumps([[name, len(value)] for name, value in entries.items()])}
        elif not payload:  # TorchServe's handler fails on it: the same answer as for any undecodable body
            return error(503, PREDICTION_FAILED, "InternalServerException")
        model.queued += 1
        try:
            return await self._queued(model, payload, headers, explain, version)
        finally:
            model.queued -= 1

    async def described(self, model) -> Response:
        """The handler's describe_handle() answer (gRPC DescribeModel with `customized`), as TorchServe's worker
        answers it: its JSON (`null` where the handler has none: TorchServe's image_classifier has none, so the image
        path answers that without asking Triton); 503 where the model has no worker."""
        if not model.workers or not model.members:
            return error(503, "no worker", "ServiceUnavailableException")
        if not model.handler:
            return Response(b"null", 200, media_type="application/json")
        model.pending += 1
        try:
            return await self._handled(model, b"", {DESCRIBE: "True"}, False)
        finally:
            model.pending -= 1

    async def _queued(self, model, payload: bytes, headers, explain: bool, version: str | None) -> Response:
        # TorchServe's job queue: job_queue_size requests may wait beyond those its workers hold (a batch each);
        # past that, 503 at once. Counted here, once a request's body is read (as TorchServe queues a request it
        # has received whole: slow bodies do not fill it), not by a Triton queue policy, which would bring back its
        # batcher's 500 ms stall.
        if not model.members or model.queued > self.job_queue_size + model.batch_size * model.workers:
            return error(503, no_worker(model.name, version), "ServiceUnavailableException")
        if model.handler:
            return await self._handled(model, payload, headers, explain)
        if explain:  # the image path runs no handler: the archive's own, loaded for explanations (explainers.py)
            try:
                explainer = await self.registry.explainers.entry(model)
            except Unavailable as exc:  # TorchServe's answer where a handler fails; the reason in the log
                self.log(f"explanation failed for {model.name}: its explainer could not be loaded: {exc}")
                return error(503, PREDICTION_FAILED, "InternalServerException")
            return await self._handled(model, payload, headers, explain, explainer)
        return await self._infer(model, payload)

    async def _handled(self, model, payload: bytes, headers, explain: bool, entry: str | None = None) -> Response:
        """The archive's own handler (a custom handler's archive; `entry`: the image path's explainer): the body to
        its BODY, its answer as it made it, the request's headers as TorchServe hands them to a handler (with its
        "explain" header: the handler's explain_handle answers where "True"); its failure as TorchServe's worker
        reports it."""
        tensor = aioclient.InferInput(BODY, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[payload]], dtype=np.object_))
        forwarded = {key: value for key, value in headers.items() if key not in NOT_FORWARDED}
        forwarded.update({"url_path": "", EXPLAIN: str(explain)})  # TorchServe's frontend sets both over the client's
        try:  # with STATUS_PARAMETER the handler's failures come back as STATUS, never as a Triton error
            result = await self.client.infer(entry or model.entry, [tensor],
                                             parameters={**forwarded, STATUS_PARAMETER: "1"},
                                             outputs=[aioclient.InferRequestedOutput(name)
                                                      for name in (RESPONSE, CONTENT_TYPE, STATUS)],
                                             timeout=model.response_timeout * 1_000_000)
        except (InferenceServerException, *UNREACHABLE) as exc:  # Triton down (restarting), the stub dead
            return self._failed(model, exc)
        body = bytes(result.as_numpy(RESPONSE).reshape(-1)[0])
        status = int(result.as_numpy(STATUS).reshape(-1)[0])
        if status != 200:  # a 4xx: the stub refused this request alone (ts_worker.Refused), its type as TorchServe's
            message = body.decode("utf-8", "replace")
            self.log(f"prediction failed for {model.name}: {message[:300]} ({status})")
            return error(status, PREDICTION_FAILED if status == 503 else message,
                         None if status < 500 else "InternalServerException")
        content_type = result.as_numpy(CONTENT_TYPE).reshape(-1)[0].decode("utf-8", "replace")
        return Response(body, 200, media_type=content_type or None)

    def _failed(self, model, exc: Exception) -> Response:
        """Triton's failure of a prediction as TorchServe answers it (its answer names no reason; its log does, as
        serve-repo's does): 507 "Worker died." for a request in the batch of a stub that died (TorchServe 0.12's
        for a worker killed inside its batch), else 503 "Prediction failed"."""
        said = first_line(exc)
        self.log(f"prediction failed for {model.name}: {said[:300]}")
        if DEAD_STUB.search(said):
            return error(507, "Worker died.", "InternalServerException")
        return error(503, PREDICTION_FAILED, "InternalServerException")

    async def _infer(self, model, payload: bytes) -> Response:
        tensor = aioclient.InferInput(IMAGE_BYTES, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[payload]], dtype=np.object_))
        try:
            result = await self.client.infer(model.entry, [tensor],
                                             outputs=[aioclient.InferRequestedOutput(LOGITS)],
                                             timeout=model.response_timeout * 1_000_000)
        except (InferenceServerException, *UNREACHABLE) as exc:
            return self._failed(model, exc)
        try:
            answer = top5(result.as_numpy(LOGITS), model.info.labels)
        except (KeyError, ValueError) as exc:  # e.g. a class index_to_name.json lacks: TorchServe's handler fails too
            self.log(f"prediction failed for {model.name}: {first_line(exc)}")
            return error(503, PREDICTION_FAILED, "InternalServerException")
        return reply(answer, end="", handler=True)

    @asynccontextmanager
    async def lifespan(self, app):
        await self.startup()
        yield
        await self.shutdown()

    def app(self) -> Starlette:
        # TorchServe answers /ping and predictions whatever the method (a GET is a prediction with no body: 503)
        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]  # OPTIONS: a model's description
        routes = [Route("/ping", self.ping, methods=methods)]
        for kind, answer in (("predictions", self.predict), ("explanations", self.explanations)):
            routes += [Route(f"/{kind}/{{model_name}}", answer, methods=methods),
                       Route(f"/{kind}/{{model_name}}/", answer, methods=methods),  # the default version
                       Route(f"/{kind}/{{model_name}}/{{model_version}}", answer, methods=methods)]
        # KServe's paths, which TorchServe 0.12's inference API answers as predictions and explanations
        routes += [Route("/v1/models/{model_name}:predict", self.predict, methods=methods),
                   Route("/v1/models/{model_name}:explain", self.explanations, methods=methods),
                   Route("/v2/models/{model_name}/infer", self.predict, methods=methods),
                   Route("/v2/models/{model_name}/explain", self.explanations, methods=methods)]
        return Starlette(routes=[*routes, *openapi.routes("inference")], lifespan=self.lifespan,
                         exception_handlers=HANDLERS)
