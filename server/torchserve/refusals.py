"""The TorchServe front's one error, Refusal, and the one table that says how each kind is answered, REST and gRPC."""
from __future__ import annotations

from typing import NamedTuple

HTTP, ARCHIVE, MODEL = "org.pytorch.serve.http.", "org.pytorch.serve.archive.", "org.pytorch.serve.archive.model."


class Kind(NamedTuple):
    """How TorchServe answers one exception of its own: the HTTP status, the Java class a gRPC description ends with
    (None: the description is the message alone), the gRPC code of its management API (UNKNOWN: grpc-java's answer
    to an exception TorchServe does not catch, with no description); `named`: TorchServe's frontend names a bare
    status so (a worker's answer: Kind.of)."""
    status: int | None
    java: str | None
    grpc: str
    named: bool = False


# Each kind is the name TorchServe gives it (its JSON error's "type"), in TorchServe's words and codes.
KINDS: dict[str, Kind] = {
    "BadRequestException": Kind(400, HTTP + "BadRequestException", "INVALID_ARGUMENT", named=True),
    "InvalidModelException": Kind(400, MODEL + "InvalidModelException", "INVALID_ARGUMENT"),
    "DownloadArchiveException": Kind(400, ARCHIVE + "DownloadArchiveException", "INVALID_ARGUMENT"),
    # the token check: REST's 400; gRPC's interceptor closes the call with no exception's class
    "InvalidKeyException": Kind(400, None, "PERMISSION_DENIED"),
    "TokenAuthorizationException": Kind(401, None, "UNAUTHENTICATED", named=True),
    "InvalidModelVersionException": Kind(403, HTTP + "InvalidModelVersionException", "UNKNOWN"),
    "ModelNotFoundException": Kind(404, MODEL + "ModelNotFoundException", "NOT_FOUND", named=True),
    "ModelVersionNotFoundException": Kind(404, MODEL + "ModelVersionNotFoundException", "NOT_FOUND"),
    "ResourceNotFoundException": Kind(404, HTTP + "ResourceNotFoundException", "NOT_FOUND"),
    "MethodNotAllowedException": Kind(405, HTTP + "MethodNotAllowedException", "FAILED_PRECONDITION", named=True),
    "ConflictStatusException": Kind(409, HTTP + "ConflictStatusException", "UNKNOWN", named=True),
    "RequestEntityTooLarge": Kind(413, None, "RESOURCE_EXHAUSTED", named=True),
    # Netty's refusal of an over-size body (before any handler): an empty 413
    "TooLongFrameException": Kind(413, None, "RESOURCE_EXHAUSTED"),
    "InternalServerException": Kind(500, HTTP + "InternalServerException", "INTERNAL", named=True),
    "ServiceUnavailableException": Kind(503, HTTP + "ServiceUnavailableException", "UNAVAILABLE", named=True),
    "InsufficientStorage": Kind(507, None, "INTERNAL", named=True),
    # gRPC's alone: the model API off, and what grpc-java itself answers (an over-size message resets the stream;
    # a message that does not parse and a NullPointerException are uncaught)
    "ModelException": Kind(None, MODEL + "ModelException", "PERMISSION_DENIED"),
    "StreamReset": Kind(None, None, "CANCELLED"),
    "InvalidProtocolBufferException": Kind(None, None, "UNKNOWN"),
    "NullPointerException": Kind(None, None, "UNKNOWN"),
}

# GRPCUtils.getGRPCStatusCode's statuses beyond the table's: a worker's answer with one of them (a handler may set any)
WORKER_CODES = {403: "PERMISSION_DENIED", 409: "ABORTED", 416: "OUT_OF_RANGE", 429: "RESOURCE_EXHAUSTED",
                499: "CANCELLED", 501: "UNIMPLEMENTED", 504: "DEADLINE_EXCEEDED"}

TOKEN_FAILED = "Token Authorization failed. Token either incorrect, expired, or not provided correctly"


def kind_of(status: int) -> str:
    """TorchServe's name for a bare status (a handler's 4xx), InternalServerException where it has none."""
    return next((name for name, kind in KINDS.items() if kind.named and kind.status == status),
                "InternalServerException")


def code_of(status: int) -> str:
    """GRPCUtils.getGRPCStatusCode: a worker's HTTP status as the gRPC code TorchServe answers a prediction with."""
    if status in WORKER_CODES:
        return WORKER_CODES[status]
    named = next((kind.grpc for kind in KINDS.values() if kind.named and kind.status == status), None)
    if named is not None:
        return named
    if 400 <= status < 500:
        return "FAILED_PRECONDITION"
    return "INTERNAL" if 500 <= status < 600 else "UNKNOWN"


class Refusal(Exception):
    """A call refused as TorchServe refuses it: `kind` (a KINDS name), its message (one line), the HTTP status
    (the kind's, but for a worker's answer), and a `reason` for the log, never for the client."""

    def __init__(self, message: str, kind: str = "InvalidModelException", status: int | None = None,
                 reason: str = "", grpc: tuple[str, str] | None = None):
        super().__init__(message)
        self.message, self.kind, self.reason = message, kind, reason
        self.status = KINDS[kind].status if status is None else status
        self._grpc = grpc  # (code, description) where TorchServe's gRPC answers it otherwise than by its kind

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        """TorchServe's JSON error."""
        return {"code": self.status, "type": self.kind, "message": self.message}

    def grpc(self) -> tuple[str, str]:
        """The gRPC code (its name) and description TorchServe answers this refusal with (by its kind: as its
        management API does)."""
        if self._grpc is not None:
            return self._grpc
        kind = KINDS[self.kind]
        if kind.grpc == "UNKNOWN":
            return "UNKNOWN", ""
        return kind.grpc, self.message if kind.java is None else f"{self.message}\n{kind.java}"


def worker(status: int, message: str) -> Refusal:
    """A worker's answer that is not a prediction (a handler's failure, Triton's): 4xx named by its status, the rest
    InternalServerException, as TorchServe's frontend relays it."""
    return Refusal(message, kind_of(status) if status < 500 else "InternalServerException", status)
