"""TorchServe's REST answers: JSON as its frontend prints it, a Refusal as its error body, headers, token check."""
from __future__ import annotations

import hmac
import json
import os
import re
import secrets
import uuid
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response

from server.torchserve.refusals import TOKEN_FAILED, Refusal


def dumps(value) -> str:
    """JSON as TorchServe's frontend prints it (Gson, HTML escaping off): two-space indents, one key per line,
    characters beyond ASCII as they are but for the two line separators Gson escapes."""
    return json.dumps(value, indent=2, ensure_ascii=False).replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def reply(value, status: int = 200) -> Response:
    """The frontend's own answers end in a newline and say they are JSON (a handler's: predictions.Prediction)."""
    return Response(dumps(value) + "\n", status, media_type="application/json")


# What TorchServe's NettyUtils.sendHttpResponse adds to every answer of its three HTTP APIs (besides x-request-id, a
# new UUID per request); it sends no `server` or `date` header (uvicorn's are off: run.Front).
NO_CACHE = ((b"pragma", b"no-cache"), (b"cache-control", b"no-cache; no-store, must-revalidate, private"),
            (b"expires", b"Thu, 01 Jan 1970 00:00:00 UTC"))
_SET_HERE = {b"x-request-id"} | {name for name, _ in NO_CACHE}


class TorchServeHeaders:
    """ASGI middleware: every HTTP answer gets TorchServe's x-request-id (a UUID of its own, as TorchServe's Session
    makes one per request) and its three no-cache headers, whoever made the answer (a route, the token guard)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = str(uuid.uuid4()).encode()

        async def with_headers(message):
            if message["type"] == "http.response.start":
                kept = [(name, value) for name, value in message.get("headers", []) if name.lower() not in _SET_HERE]
                message = {**message, "headers": [*kept, (b"x-request-id", request_id), *NO_CACHE]}
            await send(message)

        return await self.app(scope, receive, with_headers)


def refused(refusal: Refusal) -> Response:
    """A refusal as TorchServe's REST answers it: its JSON error, but for an over-size body, which TorchServe's
    frontend (Netty) answers with an empty 413."""
    if refusal.kind == "TooLongFrameException":
        return Response(b"", refusal.status)
    return reply(refusal.body(), refusal.status)


# TorchServe's TokenAuthorization: "^Bearer\s+(\S+)$" matched whole (Java's \s: ASCII whitespace only)
BEARER = re.compile(r"Bearer[ \t\n\x0b\f\r]+([^ \t\n\x0b\f\r]+)")

# Answered before any token check, as TorchServe's ApiDescriptionRequestHandler comes first in its chain: the API
# description (OPTIONS /, /api-description) and the 405 for another method on /.
UNGUARDED = ("/", "/api-description")


class Tokens:
    """TorchServe >= 0.11's token authorization: key_file.json in the working directory holds an inference and a
    management key (and the API key TorchServe renews them with); every request to an API, /ping and unknown paths
    included, bears 'Authorization: Bearer KEY' of that API, else 400 InvalidKeyException, as TorchServe answers.
    Unlike TorchServe's, the keys do not expire: they last as long as the server. None: no tokens."""

    def __init__(self, path: Path | None):
        self.path = path
        self.keys = {}
        if path is not None:
            self.keys = {api: secrets.token_urlsafe(6) for api in ("management", "inference", "API")}
            # Readable by this user only from its first byte, and never written through a link someone put there:
            # a new file (0600) beside it, then renamed over it (a link at `path` is replaced, not followed).
            partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
            handle = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(handle, "w") as sink:
                sink.write(dumps({api: {"key": key} for api, key in self.keys.items()}))
            os.replace(partial, path)

    def allowed(self, headers: dict[bytes, bytes], api: str) -> bool:
        if self.path is None:
            return True
        found = BEARER.fullmatch(headers.get(b"authorization", b"").decode("latin-1"))
        return found is not None and hmac.compare_digest(found.group(1).encode(), self.keys[api].encode())

    def guard(self, app, api: str):
        """`app` behind the `api` key (an ASGI wrapper: nothing of the request is read before the check)."""
        async def guarded(scope, receive, send):
            if scope["type"] == "http" and scope["path"] not in UNGUARDED and \
                    not self.allowed(dict(scope["headers"]), api):
                response = refused(Refusal(TOKEN_FAILED, "InvalidKeyException"))
                return await response(scope, receive, send)
            return await app(scope, receive, send)
        return guarded if self.path is not None else app


async def _not_found(request: Request, exc) -> Response:
    return refused(Refusal("Requested resource is not found, please refer to API document.",
                           "ResourceNotFoundException"))


async def _not_allowed(request: Request, exc) -> Response:
    return refused(Refusal("Requested method is not allowed, please refer to API document.",
                           "MethodNotAllowedException"))


HANDLERS = {404: _not_found, 405: _not_allowed}  # Starlette's plain-text 404 / 405, in TorchServe's JSON
