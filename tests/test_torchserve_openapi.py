"""The TorchServe front's OpenAPI description (server/torchserve/openapi.py): a valid OpenAPI 3.0.1 document per
API whose paths and methods are exactly the routes each API serves, answered on OPTIONS / before the token check."""
from __future__ import annotations

import asyncio
import json

import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from server.torchserve import openapi
from server.torchserve.inference import Inference
from server.torchserve.management import Management
from server.torchserve.metrics import Metrics
from server.torchserve.replies import Tokens

# Served, not described: the trailing-slash default version (TorchServe's too); the metrics API's own description
# routes (TorchServe's metrics document lists /metrics alone).
UNDESCRIBED = {"inference": {"/predictions/{model_name}/", "/explanations/{model_name}/"},
               "management": set(), "metrics": {"/", "/api-description"}}


def _apps() -> dict:
    return {"inference": Inference(None, "127.0.0.1:1", 1 << 20, 100).app(),
            "management": Management(None, True, None).app(), "metrics": Metrics(None, "", "").app()}


def _served(app) -> dict[str, set[str]]:
    served: dict[str, set[str]] = {}
    for route in app.routes:
        assert isinstance(route, Route)
        served.setdefault(route.path, set()).update(method.lower() for method in route.methods or ())
    return served


@pytest.mark.parametrize("api", sorted(openapi.APIS))
def test_description_is_valid_openapi_3_0_1_when_validated(api):
    document = openapi.document(api)
    validate(document)  # raises where invalid (TorchServe 0.12's own is not: string defaults, a repeated id)
    assert document["openapi"] == "3.0.1" and set(document) == {"openapi", "info", "paths"}


@pytest.mark.parametrize("api", sorted(openapi.APIS))
def test_each_described_path_and_method_is_served_and_each_route_described_when_compared_with_the_app(api):
    served = _served(_apps()[api])
    described = {path: set(operations) for path, operations in openapi.document(api)["paths"].items()}
    for path, methods in described.items():
        assert path in served, f"{api}: {path} is described but not served"
        assert methods <= served[path], f"{api}: {path} {methods - served[path]} described but not served"
    assert set(served) - set(described) == UNDESCRIBED[api]


@pytest.mark.parametrize("api", sorted(openapi.APIS))
def test_each_path_parameter_is_a_routes_parameter_when_compared_with_the_app(api):
    for operation in openapi.APIS[api]:
        in_path = {param.name for param in operation.params if param.where == "path"}
        assert in_path == {piece.split("}")[0] for piece in operation.path.split("{")[1:]}, operation.path


@pytest.mark.parametrize("api", ["inference", "management"])
def test_a_models_description_is_valid_and_names_served_paths_when_validated(api):
    document = openapi.model_document(api, "m1")
    validate(document)
    served = _served(_apps()[api])
    for path, operations in document["paths"].items():
        route = path.replace("/m1", "/{model_name}", 1) if api == "inference" else path
        assert route in served and set(operations) <= served[route] and "options" in served[route], path
    assert document["info"]["title"].endswith("API for: m1")


def _call(app, method: str, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    """One request through the ASGI app, no server (no lifespan: the inference app's Triton client is not made)."""
    sent, scope = [], {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
                       "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
                       "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "root_path": ""}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_options_answers_the_description_without_a_token_and_other_methods_on_root_405_when_tokens_are_on(tmp_path,
                                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    tokens = Tokens(tmp_path / "key_file.json")
    app = tokens.guard(_apps()["management"], "management")
    status, body = _call(app, "OPTIONS", "/")
    assert status == 200 and json.loads(body) == openapi.document("management")
    assert _call(app, "GET", "/api-description")[0] == 200
    status, body = _call(app, "GET", "/")
    assert status == 405 and json.loads(body)["type"] == "MethodNotAllowedException"
    assert _call(app, "GET", "/models")[0] == 400  # the rest stays behind the token
