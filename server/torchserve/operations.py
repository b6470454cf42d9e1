"""TorchServe's management operations on Triton, for REST and gRPC alike: register (build-repo --from-mar, cached),
list, describe, scale (a live reload of the instance count), unregister and set-default, with TorchServe's
parameters; each returns its answer typed and raises a Refusal."""
from __future__ import annotations

import asyncio
import functools
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from server.errors import ServerError
from server.torchserve.refusals import Refusal
from server.torchserve.registry import Model, Registry

CHANGE_THREADS = 8  # management changes at once (the registry builds one at a time; downloads run side by side)
INT = re.compile(r"[+-]?[0-9]+")
RUNTIMES = ("python", "python3", "LSP")  # TorchServe 0.12's Manifest.RuntimeType

Params = dict[str, list[str]]  # a call's parameters as TorchServe reads them, REST's query or gRPC's message


@dataclass(frozen=True)
class Status:
    """A change's answer: TorchServe's {"status": message}; `accepted`: its 202, the workers to come."""
    message: str
    accepted: bool = False


def bad(message: str) -> Refusal:
    return Refusal(message, "BadRequestException")


def _param(params: Params, key: str) -> str | None:
    """The first of a repeated parameter, as TorchServe's NettyUtils.getParameter takes it."""
    values = params.get(key)
    return values[0] if values else None


def _int(params: Params, key: str, default: int | None = None, log=None) -> int | None:
    """TorchServe's getIntParameter: a Java int, else (absent, empty, not an integer, past 32 bits) the default;
    a value so ignored is named in the log."""
    value = _param(params, key)
    if value is None:
        return default
    if INT.fullmatch(value) and -2**31 <= int(value) < 2**31:
        return int(value)
    if log is not None:
        log(f"serve-repo: {key}={value[:80]!r} is not an integer: ignored, as TorchServe ignores it")
    return default


def _bool(params: Params, key: str, default: bool, log=None) -> bool:
    """Java's Boolean.parseBoolean: "true" in any case is true, anything else false (named in the log)."""
    value = _param(params, key)
    if value is None:
        return default
    if value.lower() not in ("true", "false") and log is not None:
        log(f"serve-repo: {key}={value[:80]!r} is not a boolean; taken as false, as TorchServe does")
    return value.lower() == "true"


def _least(key: str, number: int | None, least: int) -> int | None:
    if number is not None and number < least:
        raise bad(f"Invalid {key}: {number} must be >= {least}")
    return number


def _bounded(key: str, number: int | None, most: int) -> int | None:
    """A worker count asked for: refused (400) above max_workers_per_model, never clamped in silence."""
    if number is not None and number > most:
        raise bad(f"Invalid {key}: {number} is over max_workers_per_model={most}")
    return number


class Operations:
    """The management calls, REST's and gRPC's; `enable_model_api` each transport checks, as TorchServe's do."""

    def __init__(self, registry: Registry, enable_model_api: bool, server):
        self.registry, self.enable_model_api, self.server = registry, enable_model_api, server
        self._tasks: set[asyncio.Task] = set()
        # Registrations, scaling and unregistering (downloads, builds) in threads of their own: slow ones never take
        # the threads /ping, describe and /metrics need (asyncio's default pool, 6 threads on 2 cores).
        self._changes = ThreadPoolExecutor(max_workers=CHANGE_THREADS, thread_name_prefix="torchserve-change")

    async def _change(self, call, *args, **kwargs):
        """`call` in a change thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._changes, functools.partial(call, *args, **kwargs))

    async def call(self, operation, params: Params, path: dict):
        """One management call, REST's or gRPC's: `operation` (register, list, ...) with the call's parameters and
        the path's model_name / version; its answer, or a Refusal (a reason it holds is logged: the client is not
        told it, e.g. why a download failed)."""
        try:
            return await operation(params, path)
        except Refusal as exc:
            if exc.reason:
                self.registry.log(f"serve-repo: {exc} ({exc.reason})")
            raise
        except ServerError as exc:
            raise Refusal(str(exc), "InternalServerException") from None

    def _background(self, call, *args, **kwargs) -> None:
        """`call` off the event loop, answered already (synchronous=false): its failure goes to the log."""
        task = asyncio.create_task(self._change(call, *args, **kwargs))
        self._tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            self._tasks.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                self.registry.log(f"serve-repo: {call.__name__} failed: {finished.exception()}")
        task.add_done_callback(done)

    # -- the calls --
    async def register(self, params: Params, path: dict) -> Status:
        log = self.registry.log
        url = _param(params, "url")
        if url is None:
            raise bad("Parameter url is required.")
        runtime = _param(params, "runtime")
        if runtime is not None and runtime not in RUNTIMES:
            raise bad(f"Invalid RuntimeType value: {runtime}")
        if url == "":
            raise Refusal("empty url", "ModelNotFoundException")
        if _param(params, "s3_sse_kms") is not None:  # TorchServe's, of no use on Triton
            log(f"serve-repo: s3_sse_kms={_param(params, 's3_sse_kms')[:80]!r} ignored (no S3 here)")
        # TorchServe's: initial_workers, else default_workers_per_model as configured (0 when not); 0 or less: none
        # until scaled (an archive's minWorkers still wins, in the registry)
        workers = max(0, _int(params, "initial_workers", self.registry.default_workers or 0, log))
        timeout = _int(params, "response_timeout", -1, log)
        startup = _int(params, "startup_timeout", -1, log)
        args = dict(url=url, name=_param(params, "model_name") or None,
                    batch_size=_least("batch_size", _int(params, "batch_size", None, log), 1),
                    max_batch_delay=_least("max_batch_delay", _int(params, "max_batch_delay", None, log), 0),
                    # with startup_timeout=0 nothing starts: TorchServe's 500, whatever the count
                    workers=workers if startup == 0 else
                    _bounded("initial_workers", workers, self.registry.max_workers),
                    response_timeout=self.registry.response_timeout if timeout == -1 else
                    _least("response_timeout", timeout, 1),
                    startup_timeout=self.registry.startup_timeout if startup == -1 else startup,
                    handler=_param(params, "handler") or None)
        if not _bool(params, "synchronous", True, log):
            # as TorchServe: the archive found (an http(s) URL's fetched, or refused) and read, the model known and in
            # a snapshot now, its workers to come (issue 52: a change is durable before it is answered)
            model = await self._change(self.registry.claim, **args)
            model.runtime = runtime or model.runtime  # described as registered
            await self._change(self.registry.changed)  # in a snapshot before it is answered (issue 52 F2)
            if model.workers:
                self._background(self.registry.complete, model)
                return Status("Processing worker updates...", accepted=True)
        else:
            model = await self._change(self.registry.register, **args)
            model.runtime = runtime or model.runtime
        if not model.workers:
            return Status(f'Model "{model.name}" Version: {model.version} registered with 0 initial workers. '
                          "Use scale workers API to add workers for the model.")
        return Status(f'Model "{model.name}" Version: {model.version} registered with {model.workers} initial workers')

    async def list(self, params: Params, path: dict) -> dict:
        """TorchServe's paging: models by name; nextPageToken (the next index, a string) first, whenever the page
        does not run past the end; a limit past 0..100 is 100, a negative token 0."""
        limit = _int(params, "limit", 100, self.registry.log)
        limit = 100 if limit < 0 or limit > 100 else limit
        start = max(0, _int(params, "next_page_token", 0, self.registry.log))
        names = sorted(self.registry.models)
        last = (start + limit + 2**31) % 2**32 - 2**31  # a Java int: past 2^31-1 it wraps, as TorchServe's
        page = [{"modelName": name, "modelUrl": self.registry.find(name).info.url} for name in names[start:last]]
        body = {"models": page}
        if last <= len(names):
            body = {"nextPageToken": str(last), **body}
        return body

    def _selected(self, path: dict) -> list[Model]:
        name, version = path["model_name"], path.get("model_version")
        if version == "all":
            self.registry.find(name)
            return list(self.registry.models[name].values())
        return [self.registry.find(name, version)]

    async def describe(self, params: Params, path: dict) -> list[dict]:
        models = self._selected(path)

        def described() -> list[dict]:  # asks Triton and /proc: off the event loop
            stubs = self.server.stubs()
            return [self._describe(model, stubs) for model in models]
        return await asyncio.to_thread(described)

    def _describe(self, model: Model, stubs) -> dict:
        mine = sorted((s for s in stubs if s.model == model.triton and s.alive), key=lambda s: s.pid)
        ready = bool(model.members) and self.server.model_ready(model.triton)  # no members: building
        workers = [{"id": str(9000 + i), "startTime": model.start_time, "status": "READY" if ready else "UNLOADING",
                    "memoryUsage": 0, "pid": stub.pid, "gpu": False, "gpuUsage": "N/A"}
                   for i, stub in enumerate(mine[:model.workers])]
        queued = max(0, model.queued - model.batch_size * model.workers)  # beyond what the instances hold
        low, high = model.bounds or (model.workers, model.workers)
        # TorchServe 0.12's 26 keys, in its order; those for features Triton's batching replaces keep its defaults
        return {"modelName": model.name, "modelVersion": model.version, "modelUrl": model.info.url,
                "runtime": model.runtime, "minWorkers": low, "maxWorkers": high,
                "batchSize": model.batch_size, "maxBatchDelay": model.max_batch_delay,
                "responseTimeout": model.response_timeout, "startupTimeout": model.startup_timeout,
                "maxRetryTimeoutInSec": 300,
                "clientTimeoutInMills": 0, "parallelType": "", "parallelLevel": 0, "deviceType": "cpu",
                "continuousBatching": False, "useJobTicket": False, "useVenv": False, "stateful": False,
                "sequenceMaxIdleMSec": 0, "sequenceTimeoutMSec": 0, "maxNumSequence": 0,
                "maxSequenceJobQueueSize": 0, "loadedAtStartup": model.loaded_at_startup, "workers": workers,
                "jobQueueStatus": {"remainingCapacity": self.registry.job_queue_size - queued,
                                   "pendingRequests": queued}}

    async def scale(self, params: Params, path: dict) -> Status:
        log = self.registry.log
        # As TorchServe 0.12, with the model API off too (it refuses registering and unregistering only); what runs
        # is within min_worker..max_worker (Registry.scale); what max_workers_per_model bounds is min_worker.
        low = _int(params, "min_worker", 1, log)
        high = _int(params, "max_worker", low, log)
        if low > high:  # before the model is looked up, as TorchServe's ApiUtils.updateModelWorkers
            raise bad("max_worker cannot be less than min_worker.")
        model = self.registry.find(path["model_name"], path.get("model_version"))
        if low < 0:  # TorchServe 0.12 fails it (500, an IndexOutOfBoundsException of its own)
            raise Refusal(f"Invalid min_worker: {low}: a worker count is 0 or more", "InternalServerException")
        _bounded("min_worker", low, self.registry.max_workers)
        version = path.get("model_version")
        if not _bool(params, "synchronous", False, log):
            model.bounds = (low, high)  # what a restart starts, in a snapshot before it is answered (issue 52)
            await self._change(self.registry.changed)
            self._background(self.registry.scale, model, low, high, version)
            return Status("Processing worker updates...", accepted=True)
        await self._change(self.registry.scale, model, low, high, version)
        named = f", version: {model.version}" if version else ""
        return Status(f"Workers scaled to {low} for model: {model.name}{named}")

    async def unregister(self, params: Params, path: dict) -> Status:
        model = self.registry.find(path["model_name"], path.get("model_version"))
        versions = self.registry.models.get(model.name, {})
        if path.get("model_version") and len(versions) > 1 and \
                self.registry.defaults.get(model.name) == model.version:
            raise Refusal(f"Cannot remove default version for model {model.name}", "InvalidModelVersionException")
        await self._change(self.registry.unregister, model)
        return Status(f'Model "{model.name}" unregistered')

    async def set_default(self, params: Params, path: dict) -> Status:
        name, version = path["model_name"], path["model_version"]
        self.registry.find(name)
        if version not in self.registry.models.get(name, {}):  # TorchServe's words here: no colons
            raise Refusal(f"Model version {version} does not exist for model {name}", "ModelVersionNotFoundException")
        model = self.registry.find(name, version)
        self.registry.set_default(model)
        return Status(f'Default version successfully updated for model "{model.name}" to "{model.version}"')
