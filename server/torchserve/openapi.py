"""The TorchServe front's OpenAPI description (OPTIONS / on each API): TorchServe 0.12's document's shape (openapi
3.0.1, its paths, operation ids, parameters and error schema), listing only the routes and parameters served here."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from server.torchserve.replies import dumps

OPENAPI = "3.0.1"  # TorchServe 0.12's OpenApi.openapi
VERSION = "0.12.0"  # the TorchServe API this front answers as
JSON = "application/json"
ANY = "*/*"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def _object(required: list[str], **properties: tuple[str, str]) -> dict:
    return {"type": "object", "required": required,
            "properties": {key: {"type": kind, "description": text} for key, (kind, text) in properties.items()}}


ERROR = _object(["code", "type", "message"], code=("integer", "Error code."), type=("string", "Error type."),
                message=("string", "Error message."))
STATUS = _object(["status"], status=("string", "What was done."))
DESCRIPTION = {"type": "object", "required": ["openapi", "info", "paths"],
               "properties": {"openapi": {"type": "string"}, "info": {"type": "object"}, "paths": {"type": "object"}}}
BINARY = {"type": "string", "format": "binary"}
DESCRIBED = {"type": "array", "items": _object(
    ["modelName", "modelVersion", "modelUrl", "minWorkers", "maxWorkers", "workers", "jobQueueStatus"],
    modelName=("string", "Name of the model."), modelVersion=("string", "Version of the model."),
    modelUrl=("string", "URL of the model."), minWorkers=("integer", "Workers (Triton instances) at least."),
    maxWorkers=("integer", "Workers (Triton instances) at most."),
    batchSize=("integer", "Triton's max_batch_size."), maxBatchDelay=("integer", "Triton's queue delay in ms."),
    workers=("array", "Its live workers."), jobQueueStatus=("object", "Requests queued beyond its instances."))}
LISTED = {"type": "object", "required": ["models"], "properties": {
    "nextPageToken": {"type": "string", "description": "Where the next page starts, when there is one."},
    "models": {"type": "array", "description": "The registered models.", "items": _object(
        ["modelName", "modelUrl"], modelName=("string", "Name of the model."),
        modelUrl=("string", "URL of the model."))}}}


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "path" or "query"
    description: str
    kind: str = "string"
    required: bool = False
    default: object = None

    def openapi(self) -> dict:
        schema = {"type": self.kind, **({"default": self.default} if self.default is not None else {})}
        return {"in": self.where, "name": self.name, "description": self.description,
                "required": self.required or self.where == "path", "schema": schema}


@dataclass(frozen=True)
class Operation:
    path: str
    method: str
    operation_id: str
    description: str
    responses: tuple[tuple[str, str, str, dict], ...]  # (status, description, media type, schema)
    params: tuple[Param, ...] = ()
    body: bool = False  # a model's input: any media type, as the model defines it
    deprecated: bool = False

    def openapi(self) -> dict:
        result = {"description": self.description, "operationId": self.operation_id,
                  "parameters": [param.openapi() for param in self.params]}
        if self.body:
            result["requestBody"] = {"description": "Input data format is defined by each model.",
                                     "content": {ANY: {"schema": BINARY}}, "required": True}
        result["responses"] = {status: {"description": text, "content": {media: {"schema": schema}}}
                               for status, text, media, schema in self.responses}
        if self.deprecated:
            result["deprecated"] = True
        return result


NAME = Param("model_name", "path", "Name of model.")
VERSION_PARAM = Param("model_version", "path", "Version of model.")
FAILED = ("500", "Internal Server Error", JSON, ERROR)
NOT_FOUND = ("404", "Model not found or Model version not found", JSON, ERROR)
BAD = ("400", "Bad request", JSON, ERROR)
DESCRIBE_ME = (("200", "A openapi 3.0.1 descriptor", JSON, DESCRIPTION), FAILED)
ANSWERED = (("200", "Output data format is defined by each model (its handler).", ANY, BINARY), NOT_FOUND, FAILED,
            ("503", "No worker is available to serve request, or the prediction failed", JSON, ERROR))
SYNCHRONOUS = Param("synchronous", "query", "Answer once done (true) or at once, 202 (false).", "boolean",
                    default=False)


def _description_ops() -> list[Operation]:
    return [Operation("/", "options", "apiDescription", "Get openapi description.", DESCRIBE_ME),
            Operation("/api-description", "get", "api-description", "Get openapi description.", DESCRIBE_ME,
                      deprecated=True)]


def _predicting(path: str, operation_id: str, what: str, versioned: bool = False) -> Operation:
    which = "specific model version" if versioned else "default model version"
    return Operation(path, "post", operation_id, f"{what} entry point using {which}.", ANSWERED,
                     (NAME, VERSION_PARAM) if versioned else (NAME,), body=True)


INFERENCE = [
    *_description_ops(),
    Operation("/ping", "get", "ping", "Get TorchServe status.",
              (("200", "TorchServe status", JSON, _object(["status"], status=("string", "Healthy or Unhealthy."))),
               ("500", "Unhealthy: a model is not ready in Triton", JSON, STATUS))),
    _predicting("/predictions/{model_name}", "predictions", "Predictions"),
    _predicting("/predictions/{model_name}/{model_version}", "version_predictions", "Predictions", True),
    _predicting("/explanations/{model_name}", "explanations", "Explanations (the handler's explain_handle)"),
    _predicting("/explanations/{model_name}/{model_version}", "version_explanations",
                "Explanations (the handler's explain_handle)", True),
    _predicting("/v1/models/{model_name}:predict", "kserve_v1_predictions", "KServe v1 predictions"),
    _predicting("/v1/models/{model_name}:explain", "kserve_v1_explanations", "KServe v1 explanations"),
    _predicting("/v2/models/{model_name}/infer", "kserve_v2_predictions", "KServe v2 predictions"),
    _predicting("/v2/models/{model_name}/explain", "kserve_v2_explanations", "KServe v2 explanations"),
]

REGISTER_PARAMS = (
    Param("url", "query", "Model archive: a file in the model store, or a URL allowed_urls admits.", required=True),
    Param("model_name", "query", "Name of model. This value will override modelName in MANIFEST.json if present."),
    Param("handler", "query", "Inference handler entry-point. This value will override handler in MANIFEST.json."),
    Param("runtime", "query", "python, python3 or LSP: checked, as TorchServe checks it."),
    Param("batch_size", "query", "Triton's max_batch_size. Default: 1.", "integer", default=1),
    Param("max_batch_delay", "query", "Triton's queue delay, in ms. Default: 100.", "integer", default=100),
    Param("response_timeout", "query", "Seconds a prediction may take. Default: default_response_timeout.", "integer"),
    Param("startup_timeout", "query", "Seconds the workers may take to start. Default: 120.", "integer", default=120),
    Param("initial_workers", "query", "Workers (Triton instances). Default: default_workers_per_model, else 0.",
          "integer"),
    SYNCHRONOUS)
SCALE_PARAMS = (Param("min_worker", "query", "Workers (Triton instances) at least. Default: 1.", "integer", default=1),
                Param("max_worker", "query", "Workers at most, min_worker or more. Default: min_worker.", "integer"),
                SYNCHRONOUS)
UPDATED = (("200", "Model workers updated", JSON, STATUS), ("202", "Accepted", JSON, STATUS), BAD, NOT_FOUND, FAILED)
UNREGISTERED = (("200", "Model unregistered", JSON, STATUS), NOT_FOUND, FAILED)
DESCRIBED_OK = (("200", "OK", JSON, DESCRIBED), NOT_FOUND, FAILED)

MANAGEMENT = [
    *_description_ops(),
    Operation("/models", "get", "listModels", "List registered models.", (("200", "OK", JSON, LISTED), FAILED), (
        Param("limit", "query", "Models per page, 0 to 100. Default: 100.", "integer", default=100),
        Param("next_page_token", "query", "Where the page starts (nextPageToken of the previous page).")),),
    Operation("/models", "post", "registerModel", "Register a new model (built by build-repo, served by Triton).", (
        ("200", "Model registered", JSON, STATUS), ("202", "Accepted", JSON, STATUS), BAD,
        ("404", "Model archive not found", JSON, ERROR), ("409", "Model already registered", JSON, ERROR), FAILED),
        REGISTER_PARAMS),
    Operation("/models/{model_name}", "get", "describeModel",
              "Provides detailed information about the default version of a model.", DESCRIBED_OK, (NAME,)),
    Operation("/models/{model_name}", "put", "setAutoScale",
              "Configure number of workers for a default version of a model.", UPDATED, (NAME, *SCALE_PARAMS)),
    Operation("/models/{model_name}", "delete", "unregisterModel",
              "Unregister the default version of a model if it is the only version.", UNREGISTERED, (NAME,)),
    Operation("/models/{model_name}/{model_version}", "get", "version_describeModel",
              'Provides detailed information about the specified version of a model ("all": every version).',
              DESCRIBED_OK, (NAME, VERSION_PARAM)),
    Operation("/models/{model_name}/{model_version}", "put", "version_setAutoScale",
              "Configure number of workers for a specified version of a model.", UPDATED,
              (NAME, VERSION_PARAM, *SCALE_PARAMS)),
    Operation("/models/{model_name}/{model_version}", "delete", "version_unregisterModel",
              "Unregister the specified version of a model.",
              (*UNREGISTERED, ("403", "Cannot remove the default version while others remain", JSON, ERROR)),
              (NAME, VERSION_PARAM)),
    Operation("/models/{model_name}/{model_version}/set-default", "put", "setDefault",
              "Set default version of a model", (("200", "Default version successfully updated for model", JSON,
                                                  STATUS), NOT_FOUND, FAILED), (NAME, VERSION_PARAM)),
]

METRICS = [Operation("/metrics", "get", "metrics", "ts_* counters from Triton's statistics, then Triton's own metrics.",
                     (("200", "Metrics in Prometheus' text format", PROMETHEUS,
                       _object(["# HELP", "# TYPE", "metric"], **{"# HELP": ("string", "Help text of a metric."),
                                                                   "# TYPE": ("string", "Type of a metric."),
                                                                   "metric": ("string", "A metric.")})), FAILED))]

APIS = {"inference": INFERENCE, "management": MANAGEMENT, "metrics": METRICS}


def document(api: str) -> dict:
    """The OpenAPI document of one API's routes (as TorchServe's, the metrics API lists /metrics alone)."""
    paths: dict[str, dict] = {}
    for operation in APIS[api]:
        paths.setdefault(operation.path, {})[operation.method] = operation.openapi()
    return {"openapi": OPENAPI, "info": {"title": "TorchServe APIs", "description": "TorchServe's API served by "
                                         "serve-repo, on Triton", "version": VERSION}, "paths": paths}


MODEL_MANAGEMENT = ("/models/{model_name}", "/models/{model_name}/{model_version}",
                    "/models/{model_name}/{model_version}/set-default")


def model_document(api: str, model_name: str) -> dict:
    """One model's description, as TorchServe's OPTIONS on /predictions/NAME (its entry points) or on /models/NAME
    (the management calls on it) answers it, but valid: its paths name the model (TorchServe's: /prediction/NAME,
    which it does not serve, and KServe's with an undeclared {model_name}) and its operation ids are unique."""
    if api == "inference":
        paths = {path: {"post": {"description": f"A predict entry point for model: {model_name}.", "operationId": name,
                                 "responses": {"200": {"description": "OK"},
                                               "500": {"description": "Internal Server Error",
                                                       "content": {JSON: {"schema": ERROR}}}}}}
                 for path, name in ((f"/predictions/{model_name}", model_name),  # TorchServe's ids: the name, thrice
                                    (f"/v1/models/{model_name}:predict", f"{model_name}_kserve_v1"),
                                    (f"/v2/models/{model_name}/infer", f"{model_name}_kserve_v2"))}
        info = {"title": f"RESTful API for: {model_name}", "version": "1.0.0"}
    else:
        paths = {}
        for operation in MANAGEMENT:
            if operation.path in MODEL_MANAGEMENT:
                paths.setdefault(operation.path, {})[operation.method] = operation.openapi()
        info = {"title": f"RESTful Management API for: {model_name}", "version": VERSION}  # its config's version
    return {"openapi": OPENAPI, "info": info, "paths": paths}


def model_reply(api: str, model_name: str) -> Response:
    return Response(dumps(model_document(api, model_name)) + "\n", 200, media_type=JSON)


def endpoint(api: str):
    """A Starlette endpoint answering `api`'s document, as TorchServe prints its JSON."""
    text = dumps(document(api)) + "\n"

    async def described(request: Request) -> Response:
        return Response(text, 200, media_type=JSON)
    return described


def routes(api: str) -> list[Route]:
    """OPTIONS / and (any method) /api-description answer the document, as TorchServe's ApiDescriptionRequestHandler
    does, before its token check (replies.Tokens lets UNGUARDED pass); another method on / is 405."""
    described = endpoint(api)
    return [Route("/", described, methods=["OPTIONS"]),
            Route("/api-description", described, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])]
