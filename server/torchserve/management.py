"""TorchServe's management API over REST: /models and its paths, each call the management operation's
(operations.py), answered with TorchServe's JSON, its statuses and its errors."""
from __future__ import annotations

import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.torchserve import openapi
from server.torchserve.operations import Operations, Params, Status, bad
from server.torchserve.refusals import Refusal
from server.torchserve.registry import Registry
from server.torchserve.replies import HANDLERS, refused, reply


async def _params(request: Request, body: bool = False) -> Params:
    """The query's parameters, or with `body` a JSON body's (TorchServe reads a registration's from an
    application/json body, and only a registration's)."""
    if body and request.headers.get("content-type", "").split(";")[0].strip().lower() == "application/json":
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            raise bad("Invalid JSON body") from None
        if not isinstance(body, dict):
            raise bad("Invalid JSON body")
        return {key: [json.dumps(value) if isinstance(value, bool) else str(value)] for key, value in body.items()
                if value is not None}
    params: Params = {}
    for key, value in request.query_params.multi_items():
        params.setdefault(key, []).append(value)
    return params


class Management:
    """The REST adapter of the management operations (the gRPC one: grpc_api.py)."""

    def __init__(self, registry: Registry, enable_model_api: bool, server):
        self.operations = Operations(registry, enable_model_api, server)

    async def model_api(self, params: Params, path: dict) -> Response:
        """OPTIONS /models/NAME[/VERSION]: the model's management calls, described as TorchServe describes them."""
        model = self.operations.registry.find(path["model_name"], path.get("model_version"))
        return openapi.model_reply("management", model.name)

    async def answer(self, operation, params: Params, path: dict) -> Response:
        """`operation`'s answer as TorchServe's REST gives it; a refusal as its JSON error."""
        operations = self.operations
        try:
            if operation in (operations.register, operations.unregister) and not operations.enable_model_api:
                # TorchServe's answer, word for word (enable_model_api=true or serve-repo --enable-model-api: on)
                raise Refusal("Requested method is not allowed, please refer to API document.",
                              "MethodNotAllowedException")
            if operation == self.model_api:
                return await operation(params, path)
            result = await operations.call(operation, params, path)
        except Refusal as exc:
            return refused(exc)
        if isinstance(result, Status):
            return reply({"status": result.message}, 202 if result.accepted else 200)
        return reply(result)

    def app(self) -> Starlette:
        ops = self.operations

        def guarded(operation):
            async def endpoint(request: Request) -> Response:
                try:  # a registration's parameters may come in a JSON body; the others' in the query only
                    params = await _params(request, body=operation == ops.register)
                except Refusal as exc:
                    return refused(exc)
                return await self.answer(operation, params, dict(request.path_params))
            return endpoint

        return Starlette(routes=[
            Route("/models", guarded(ops.register), methods=["POST"]),
            Route("/models", guarded(ops.list), methods=["GET"]),
            Route("/models/{model_name}", guarded(ops.describe), methods=["GET"]),
            Route("/models/{model_name}", guarded(ops.scale), methods=["PUT"]),
            Route("/models/{model_name}", guarded(ops.unregister), methods=["DELETE"]),
            Route("/models/{model_name}/{model_version}", guarded(ops.describe), methods=["GET"]),
            Route("/models/{model_name}/{model_version}", guarded(ops.scale), methods=["PUT"]),
            Route("/models/{model_name}/{model_version}", guarded(ops.unregister), methods=["DELETE"]),
            Route("/models/{model_name}/{model_version}/set-default", guarded(ops.set_default), methods=["PUT"]),
            # TorchServe reads no further than the version for the other methods
            Route("/models/{model_name}/{model_version}/set-default", guarded(ops.describe), methods=["GET"]),
            Route("/models/{model_name}/{model_version}/set-default", guarded(ops.unregister), methods=["DELETE"]),
            *(Route(path, guarded(self.model_api), methods=["OPTIONS"]) for path in openapi.MODEL_MANAGEMENT),
            *openapi.routes("management"),
        ], exception_handlers=HANDLERS)
