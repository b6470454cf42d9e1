"""TorchServe's config.properties: read as Java reads it, the keys serve-repo honours, the others named once."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from server.torchserve.snapshots import models_of

# TorchServe 0.12's defaults for the keys we honour (docs/configuration.md).
DEFAULTS = {
    "inference_address": "http://127.0.0.1:8080",
    "management_address": "http://127.0.0.1:8081",
    "metrics_address": "http://127.0.0.1:8082",
    "max_request_size": 6553500,
    "job_queue_size": 100,
}
HONOURED = {"inference_address", "management_address", "metrics_address", "model_store", "load_models", "models",
            "enable_model_api", "default_workers_per_model", "max_request_size", "job_queue_size",
            "disable_token_authorization", "default_response_timeout", "default_startup_timeout",
            "allowed_urls", "max_workers_per_model", "max_pixels", "model_snapshot",
            "grpc_inference_address", "grpc_inference_port", "grpc_management_address", "grpc_management_port",
            "enable_grpc_ssl"}
# what TorchServe writes into its own snapshots about itself: read back without a word
SNAPSHOT_ONLY = {"tsConfigFile", "version"}
# serve-repo's own key (TorchServe has no bound): the most workers (classifier stubs) one model version may run, and
# its decoder as many at most; an archive's minWorkers, models= and default_workers_per_model above it are clamped,
# initial_workers / min_worker above it refused (400). Default: the CPU count, TorchServe's default_workers_per_model.
DEFAULT_MAX_WORKERS = os.cpu_count() or 1


class PropertiesError(ValueError):
    """config.properties cannot be used as it is; the message is one line."""


def parse(text: str) -> dict[str, str]:
    """key -> value as java.util.Properties reads the file: '#'/'!' comments, '=' ':' or blanks between key and
    value, a line ending in an odd number of backslashes continued on the next (its leading blanks dropped)."""
    entries, logical, pending = {}, [], ""
    for raw in text.splitlines():
        line = raw.lstrip()
        if not pending and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:
            pending += line[:-1]
            continue
        logical.append(pending + line)
        pending = ""
    if pending:
        logical.append(pending)
    for line in logical:
        match = re.match(r"((?:\\.|[^=:\s\\])*)\s*[=:]?\s*(.*)$", line, re.S)
        key, value = (_unescape(part) for part in match.groups())
        entries[key] = value
    return entries


def _unescape(text: str) -> str:
    def one(match: re.Match) -> str:
        char = match.group(1)
        if char.startswith("u"):
            return chr(int(char[1:], 16))
        return {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}.get(char, char)
    return re.sub(r"\\(u[0-9a-fA-F]{4}|.)", one, text, flags=re.S)


def address(value: str, key: str) -> tuple[str, int]:
    """(host, port) of an http:// address such as TorchServe's 'http://127.0.0.1:8080'."""
    parts = urlsplit(value if "://" in value else f"http://{value}")
    if parts.scheme != "http":
        raise PropertiesError(f"{key}={value}: only http:// addresses are served here (TLS: put serve-repo's "
                              "proxy or your ingress in front)")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise PropertiesError(f"{key}={value}: give a host and a port, e.g. http://127.0.0.1:8080")
    return parts.hostname, port


@dataclass
class Settings:
    """What serve-repo's TorchServe front runs with: the file's keys, then the command line's flags over them."""
    inference: tuple[str, int] = ("127.0.0.1", 8080)
    management: tuple[str, int] = ("127.0.0.1", 8081)
    metrics: tuple[str, int] = ("127.0.0.1", 8082)
    # gRPC's (ConfigManager.getGRPCAddress / getGRPCPort: a bare host, 127.0.0.1 by default, and a port)
    grpc_inference: tuple[str, int] = ("127.0.0.1", 7070)
    grpc_management: tuple[str, int] = ("127.0.0.1", 7071)
    model_store: Path | None = None
    load_models: list[str] = field(default_factory=list)  # "all", "file.mar", "name=file.mar"
    models: dict = field(default_factory=dict)  # name -> version -> {marName, batchSize, ...}
    enable_model_api: bool = False
    default_workers: int | None = None
    max_workers: int = DEFAULT_MAX_WORKERS  # max_workers_per_model
    max_request_size: int = DEFAULTS["max_request_size"]
    job_queue_size: int = DEFAULTS["job_queue_size"]
    token_auth: bool = True
    response_timeout: int = 120
    startup_timeout: int = 120  # default_startup_timeout: seconds a model's workers may take to start
    unsupported: list[str] = field(default_factory=list)  # keys of the file we do not act on
    allowed_urls: tuple[str, ...] | None = None  # regexes a registration's URL must match (None: TorchServe's default)
    # serve-repo's own key: the most pixels an image may claim, on the image and the handler path (None: build-repo's
    # 50 M; TorchServe's handlers decode up to PIL's 2 x 89,478,485 = 178,956,970, which an operator may set here)
    max_pixels: int | None = None
    entries: dict[str, str] = field(default_factory=dict)  # the file as read (a snapshot's properties start from it)
    snapshot: dict | None = None  # model_snapshot's registrations: name -> version -> state (server/torchserve/snapshots.py)


def _bool(value: str) -> bool:
    return value.strip().lower() == "true"


def _int(value: str, key: str, least: int = 0) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise PropertiesError(f"{key}={value}: not an integer") from None
    if number < least:
        raise PropertiesError(f"{key}={value}: must be >= {least}")
    return number


def settings(path: Path | None, base: Path | None = None) -> Settings:
    """Settings from a config.properties file (None: TorchServe's defaults); a relative model_store from `base`, else
    from the file's folder."""
    result = Settings()
    if path is None:
        return result
    try:
        entries = parse(Path(path).read_text(encoding="utf-8", errors="replace"))
    except OSError as exc:
        raise PropertiesError(f"cannot read {path}: {exc.strerror}") from None
    for key in ("inference", "management", "metrics"):
        if f"{key}_address" in entries:
            setattr(result, key, address(entries[f"{key}_address"], f"{key}_address"))
    for key in ("inference", "management"):
        host = entries.get(f"grpc_{key}_address", "127.0.0.1").strip() or "127.0.0.1"
        port = _int(entries.get(f"grpc_{key}_port", str(getattr(result, f"grpc_{key}")[1])), f"grpc_{key}_port")
        if port > 65535:
            raise PropertiesError(f"grpc_{key}_port={port}: not a port")
        setattr(result, f"grpc_{key}", (host, port))
    if _bool(entries.get("enable_grpc_ssl", "false")):
        raise PropertiesError("enable_grpc_ssl=true: only plaintext gRPC is served here (TLS: put your ingress or "
                              "a TLS proxy in front)")
    if entries.get("model_store"):
        result.model_store = Path(entries["model_store"]).expanduser()
        if not result.model_store.is_absolute():
            result.model_store = (base or Path(path).resolve().parent) / result.model_store
    load = entries.get("load_models", "").strip()
    if load and load != "standalone":
        result.load_models = [item.strip() for item in load.split(",") if item.strip()]
    if entries.get("models"):
        try:
            result.models = json.loads(entries["models"])
        except json.JSONDecodeError as exc:
            raise PropertiesError(f"models=: not JSON ({exc.msg} at character {exc.pos})") from None
        if not isinstance(result.models, dict) or not all(isinstance(v, dict) for v in result.models.values()):
            raise PropertiesError('models=: expected {"name": {"version": {"marName": ..., ...}}}')
    result.enable_model_api = _bool(entries.get("enable_model_api", "false"))
    result.token_auth = not _bool(entries.get("disable_token_authorization", "false"))
    if "default_workers_per_model" in entries:
        result.default_workers = _int(entries["default_workers_per_model"], "default_workers_per_model", 1)
    if "max_workers_per_model" in entries:
        result.max_workers = _int(entries["max_workers_per_model"], "max_workers_per_model", 1)
    if "max_pixels" in entries:
        result.max_pixels = _int(entries["max_pixels"], "max_pixels", 1)
    for key in ("max_request_size", "job_queue_size"):
        if key in entries:
            setattr(result, key, _int(entries[key], key, 1))
    if "default_response_timeout" in entries:
        result.response_timeout = _int(entries["default_response_timeout"], "default_response_timeout", 1)
    if "default_startup_timeout" in entries:
        result.startup_timeout = _int(entries["default_startup_timeout"], "default_startup_timeout", 0)
    if entries.get("allowed_urls", "").strip():  # TorchServe: comma-separated regexes, each matching a whole URL
        result.allowed_urls = tuple(item.strip() for item in entries["allowed_urls"].split(",") if item.strip())
        for pattern in result.allowed_urls:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise PropertiesError(f"allowed_urls={pattern}: not a regular expression ({exc})") from None
    if entries.get("model_snapshot"):  # TorchServe restores these registrations and ignores load_models
        try:
            result.snapshot = models_of(entries["model_snapshot"])
        except ValueError as exc:
            raise PropertiesError(f"model_snapshot=: {exc}") from None
    result.entries = entries
    result.unsupported = sorted(set(entries) - HONOURED - SNAPSHOT_ONLY)
    return result
