"""TorchServe's inference API over REST: /ping, /predictions/NAME[/VERSION] and /explanations/NAME[/VERSION] (and
KServe's :predict / :explain paths), each the inference operation's (predictions.py), answered as TorchServe answers;
OPTIONS / its description."""
from __future__ import annotations

from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from server.torchserve import openapi
from server.torchserve.predictions import Predictions
from server.torchserve.refusals import Refusal
from server.torchserve.registry import Registry
from server.torchserve.replies import HANDLERS, refused, reply

DISCARD_BYTES = 64 << 20


async def body_of(request: Request, limit: int) -> bytes:
    """The request's payload: the raw body (curl -T, --data-binary), or a multipart form's 'data' / 'body' field
    (TorchServe's handlers read those two), else its first field; a Refusal (an empty 413) past `limit`
    bytes."""
    chunks, size, stream = [], 0, request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            await _discard(stream, size, limit)
            raise Refusal("", "TooLongFrameException")
        chunks.append(chunk)
    body = b"".join(chunks)
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        async def replayed() -> dict:  # the body once more, for Starlette's form parser: the stream is spent
            return {"type": "http.request", "body": body, "more_body": False}
        async with Request(request.scope, replayed).form(max_part_size=limit) as form:
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


class Inference:
    """The REST adapter of the inference operations (the gRPC one: grpc_api.py)."""

    def __init__(self, registry: Registry, triton_url: str, max_request_size: int, job_queue_size: int,
                 instances=dict, log=print):
        self.registry, self.max_request_size = registry, max_request_size
        self.predictions = Predictions(registry, triton_url, job_queue_size, instances, log)

    async def ping(self, request: Request) -> Response:
        """Healthy, else 500 Unhealthy."""
        if await self.predictions.healthy():
            return reply({"status": "Healthy"})
        return reply({"status": "Unhealthy"}, 500)

    async def predict(self, request: Request, explain: bool = False) -> Response:
        params = request.path_params
        try:
            model = self.registry.find(params["model_name"], params.get("model_version"))
        except Refusal as exc:
            return refused(exc)
        if request.method == "OPTIONS":  # TorchServe's per-model description, on any prediction or explanation path
            return openapi.model_reply("inference", model.name)

        async def read() -> bytes:
            try:
                return await body_of(request, self.max_request_size)
            except ClientDisconnect:  # gone, or cut by the front (a stalled body): no one reads an answer
                raise Refusal("the request's body did not arrive", "BadRequestException") from None
        return await self.prediction(model, read, request.headers, explain, version=params.get("model_version"))

    async def explanations(self, request: Request) -> Response:
        return await self.predict(request, explain=True)

    async def prediction(self, model, payload, headers, explain: bool = False, version: str | None = None) -> Response:
        """Predictions.predict's answer as TorchServe's REST gives it."""
        try:
            answer = await self.predictions.predict(model, payload, headers, explain, version=version)
        except Refusal as exc:
            return refused(exc)
        return Response(answer.body, 200, media_type=answer.content_type)

    @asynccontextmanager
    async def lifespan(self, app):
        await self.predictions.startup()
        yield
        await self.predictions.shutdown()

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
