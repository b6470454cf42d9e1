"""`serve-repo --model-store DIR` / `--torchserve-config FILE`: start as TorchServe starts (its inference, management
and metrics APIs on its ports) with tritonserver supervised underneath, batching every model's requests."""
from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path

import uvicorn

from common.build_request import BuildRequest
from common.procs import port_free
from server.errors import ServerError
from server.supervisor import Supervisor
from server.torchserve import snapshots
from server.torchserve import grpc_api
from server.torchserve.bounded_http import BoundedHttpToolsProtocol
from server.torchserve.inference import Inference
from server.torchserve.management import Management
from server.torchserve.metrics import Metrics
from server.torchserve.ping import KEY_FILE  # TorchServe writes it in the directory it was started from
from server.torchserve.properties import PropertiesError, Settings, settings as read_settings
from server.torchserve.refusals import Refusal
from server.torchserve.registry import Registry
from server.torchserve.replies import TorchServeHeaders
from server.torchserve.replies import Tokens
from server.triton import TritonServer


def configure(args, log=print) -> Settings:
    """config.properties (none given: the newest snapshot, as TorchServe's ConfigManager, unless --ncs), then the
    command line over it (as torchserve's flags go over its file). `entries`: the configuration snapshots record."""
    path = args.torchserve_config
    if path is None and not args.ncs:
        path, result = _readable_snapshot(getattr(args, "snapshot_fallback", "on") == "on", log)
    else:
        # a snapshot's relative model_store is the working directory's (as TorchServe's), a config file's its folder's
        result = read_settings(path, base=None if path is args.torchserve_config else Path.cwd())
    overrides = {}
    if args.model_store:
        result.model_store = args.model_store
    if args.models:
        result.load_models = [item for entry in args.models for item in entry.split(",") if item]
        overrides["load_models"] = ",".join(args.models)
    if args.enable_model_api:
        result.enable_model_api = True
        overrides["enable_model_api"] = "true"
    if args.disable_token_auth:
        result.token_auth = False
        overrides["disable_token_authorization"] = "true"
    if result.model_store is None:
        raise PropertiesError("no model store: give --model-store DIR or model_store= in config.properties")
    if not result.model_store.is_dir():
        raise PropertiesError(f"model store {result.model_store} is not a directory")
    result.entries = {**{k: v for k, v in result.entries.items() if k != "model_snapshot"}, **overrides,
                      "model_store": str(result.model_store.resolve()),
                      **({"tsConfigFile": str(path)} if path is not None else {})}
    return result


def _readable_snapshot(fallback: bool, log) -> tuple[Path | None, Settings]:
    """The newest snapshot that can be read and its settings; where the newest cannot be (cut short, not a snapshot),
    the newest one that can, said in one line (not `fallback`: refused, as TorchServe refuses it)."""
    unreadable = None
    for path in snapshots.newest_first(snapshots.folder()):
        try:
            result = read_settings(path, base=Path.cwd())
            if result.snapshot is None:  # every snapshot names its registrations, none included
                raise PropertiesError(f"{path}: no model_snapshot (cut short?)")
        except PropertiesError as exc:
            if not fallback:
                raise
            unreadable = unreadable or (path, exc)
            continue
        if unreadable:
            log(f"snapshot {unreadable[0].name} cannot be read ({unreadable[1]}): starting from the newest one that "
                f"can be, {path}")
        else:
            log(f"no config file given: starting from the last snapshot, {path}")
        return path, result
    if unreadable:
        raise PropertiesError(f"no snapshot in {snapshots.folder()} can be read: {unreadable[1]}")
    return None, read_settings(None, base=Path.cwd())


def startup_models(config: Settings, store: Path) -> list[tuple[str | None, str, dict]]:
    """(name or None, archive file, models= settings) for load_models: all, file.mar, name=file.mar; with a
    model_snapshot, its registrations instead (every version, its state), as TorchServe restores them."""
    if config.snapshot is not None:
        return [(name, state["marName"], state) for name, versions in config.snapshot.items()
                for state in versions.values()]
    wanted = []
    for item in config.load_models:
        if item == "all":
            wanted += [(None, path.name) for path in sorted(store.glob("*.mar"))]
        elif "=" in item:
            name, _, file = item.partition("=")
            wanted.append((name.strip(), file.strip()))
        else:
            wanted.append((None, item))
    result = []
    for name, file in wanted:
        key = name or Path(file).stem
        versions = config.models.get(key) or {}
        chosen = next((v for v in versions.values() if isinstance(v, dict) and v.get("defaultVersion")), None)
        chosen = chosen or next(iter(versions.values()), {})
        result.append((name, chosen.get("marName", file), chosen))
    return result


def load_at_startup(registry: Registry, config: Settings, store: Path, log) -> None:
    restoring = config.snapshot is not None  # a snapshot's workers exactly (0 too), its default versions
    for name, file, extra in startup_models(config, store):
        try:
            model = registry.claim(file, name, extra.get("batchSize"), extra.get("maxBatchDelay"),
                                   extra.get("minWorkers"), extra.get("responseTimeout") or config.response_timeout,
                                   loaded_at_startup=not restoring, startup_timeout=extra.get("startupTimeout"),
                                   restored=restoring)
        except (Refusal, ServerError) as exc:  # as TorchServe: the others still load
            log(f"serve-repo: could not load {file}: {exc}")
            continue
        if restoring and extra.get("maxWorkers", model.workers) > model.workers:  # as TorchServe's setModelState
            model.bounds = (model.workers, extra["maxWorkers"])
        if restoring and extra.get("defaultVersion"):
            registry.set_default(model)
        try:
            registry.complete(model, keep=restoring)
        except (Refusal, ServerError) as exc:
            if restoring:  # still registered as recorded (not TorchServe's: it drops it, and its next snapshot too)
                log(f"serve-repo: restored {model.name} {model.version} with no worker running: its workers did not "
                    f"start ({exc}); scale it (PUT /models/{model.name}?min_worker=N) to start them")
            else:
                log(f"serve-repo: could not load {file}: {exc}")
            continue
        log(f'{"restored" if restoring else "loaded"} {model.name} {model.version} from {file}: batch_size '
            f'{model.batch_size}, max_batch_delay {model.max_batch_delay} ms, {model.workers} worker(s)')


def serve(args, extra: list[str], stop: threading.Event, log) -> int:
    try:
        config = configure(args, log)
        if config.snapshot is not None and (problem := snapshots.missing(config.snapshot, config.model_store) or
                                            snapshots.changed_archive(config.snapshot, config.model_store)):
            raise PropertiesError(f"model_snapshot: {problem}")  # TorchServe's InvalidSnapshotException: no start
    except PropertiesError as exc:
        log(f"serve-repo: error: {exc}", error=True)
        return 2
    for key in config.unsupported:
        log(f"config.properties: {key} is not supported by serve-repo; ignored")
    if args.trust_model_code:
        log("--trust-model-code: not needed in TorchServe mode, and changes nothing: as under TorchServe, the archives "
            "in the model store and those allowed_urls admits run their code")
    for api in ("inference", "management", "metrics", "grpc_inference", "grpc_management"):
        host, port = getattr(config, api)
        if not port_free(host, port):
            log(f"serve-repo: error: the {api} address {host}:{port} is busy (another server holds it)", error=True)
            return 1
    # This run's registrations (they last one run, as TorchServe's with --ncs) in a folder of its own; what they
    # build is cached in the store for every later run.
    repository = Path(tempfile.mkdtemp(prefix="triton-torchserve-repo-"))
    # Reachable only through this front: any local user could send a TCP port the request that aborts Triton 2.51.
    server = TritonServer.private(repository, log_file=args.log_file, extra_args=extra,
                                  drain_seconds=args.drain_seconds, stub_python=args.stub_python)
    try:
        server.start(args.timeout, abort=stop)
    except ServerError as exc:
        server.stop(keep_log=not stop.is_set())
        shutil.rmtree(repository, ignore_errors=True)
        log(f"serve-repo: error: {exc}", error=True)
        return 1
    # TorchServe's trust: the model store is the operator's, and allowed_urls says what else a registration may
    # fetch (model_store.locate); an archive admitted by them runs its code, as TorchServe runs it (docs/security.md).
    build = BuildRequest(precision=args.precision or None, engine=args.engine or None, trust_model_code=True,
                         handler_path=bool(args.handler_path))
    if (config.default_workers or 0) > config.max_workers:
        log(f"config.properties: default_workers_per_model={config.default_workers} is over max_workers_per_model="
            f"{config.max_workers}: {config.max_workers} per model")
    registry = Registry(server, config.model_store, config.model_store / ".triton" / "cache", build,
                        config.default_workers, config.job_queue_size, log, config.response_timeout,
                        config.max_workers, canary=args.canary == "on", startup_timeout=config.startup_timeout,
                        allowed_urls=config.allowed_urls, max_pixels=config.max_pixels)
    if config.snapshot is not None:
        log(f"restoring the {sum(map(len, config.snapshot.values()))} registration(s) of its model_snapshot")
    load_at_startup(registry, config, config.model_store, log)
    tokens = Tokens(Path.cwd() / KEY_FILE if config.token_auth else None)
    supervisor = Supervisor(server, max_restarts=args.max_restarts, start_timeout=args.timeout, log=log,
                            max_unfreed=args.max_unfreed_instances, unfreed_grace=args.unfreed_grace_s,
                            canary=args.canary == "on")

    def instances() -> dict[str, int]:
        """Live stubs per model; none for a model whose dead stub is being replaced: its new stub lives before
        Triton swapped it in, and requests meet the dead one until then."""
        live = Counter(stub.model for stub in server.stubs() if stub.alive)
        return {**live, **{model: 0 for model in supervisor.replacing}}
    inference = Inference(registry, server.http_url, config.max_request_size, config.job_queue_size, instances, log)
    management = Management(registry, config.enable_model_api, server)
    apps = {"inference": tokens.guard(inference.app(), "inference"),
            "management": tokens.guard(management.app(), "management"),
            "metrics": Metrics(registry, server.http_url, server.metrics_url).app()}
    services = {"grpc_inference": grpc_api.inference_service(inference.predictions, tokens, config.max_request_size),
                "grpc_management": grpc_api.management_service(management.operations, inference.predictions, tokens,
                                                                 config.max_request_size)}
    saved = None if args.ncs else snapshots.Snapshots(registry, config.entries, snapshots.folder(), log,
                                                      keep=args.keep_snapshots)
    if saved is not None:  # before the APIs listen: a change answered in the moment after is in a snapshot too
        registry.on_change(saved.changed)  # a change not saved is answered 500, not as if durable
    front = Front(apps, config, services)
    front.start()
    if not front.ready.wait(30) or front.failed:
        server.stop()
        shutil.rmtree(repository, ignore_errors=True)
        log(f"serve-repo: error: the TorchServe API could not start: {front.failed or 'timed out'}", error=True)
        return 1
    log("torchserve API ready: " + "  ".join(f"{api} http://{h}:{p}" for api, (h, p) in
                                            ((a, getattr(config, a)) for a in apps))
        + "  " + "  ".join(f"{api.replace('_', ' ')} {h}:{p}" for api, (h, p) in
                           ((a, getattr(config, a)) for a in services))
        + f"  model-api {'on' if config.enable_model_api else 'off'}  token "
        + (f"on ({tokens.path})" if config.token_auth else "off") + f"  (tritonserver on {server.http_url}, "
        f"metrics {server.metrics_url}, no TCP port, gRPC off, log {server.log_file})")
    if saved is not None:  # as TorchServe: once started, after each change a client makes, at the stop
        log(f"config snapshots: {saved.save('startup')}")
    status = supervisor.run(stop)
    front.stop()
    if saved is not None:
        registry.on_change(None)
        saved.save("shutdown")
    server.stop(keep_log=bool(status))
    shutil.rmtree(repository, ignore_errors=True)
    if status:
        log(f"serve-repo: error: {supervisor.failure}", error=True)
    return 1 if status else 0


class Front:
    """The three uvicorn servers and the two gRPC servers (grpc.aio), in one thread with its own event loop (the
    supervisor keeps the main one): gRPC's calls run the REST apps' own coroutines, in the same loop."""

    def __init__(self, apps: dict, config: Settings, services: dict | None = None):
        self.config, self.services = config, services or {}
        self.grpc: list = []
        self.servers = []
        for api, app in apps.items():
            host, port = getattr(config, api)
            # TorchServe's headers on every answer, and none of uvicorn's own (server, date): TorchServe sends neither
            self.servers.append(uvicorn.Server(uvicorn.Config(TorchServeHeaders(app), host=host, port=port,
                                                              log_level="warning", access_log=False,
                                                              http=BoundedHttpToolsProtocol, lifespan="on",
                                                              timeout_keep_alive=120, server_header=False,
                                                              date_header=False)))
        self.ready = threading.Event()
        self.failed: str | None = None
        self._thread = threading.Thread(target=self._run, name="torchserve-api", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:  # a loop of its own, run as Python 3.10 can (its Runner class came in 3.11)
            import uvloop
            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    async def _serve(self) -> None:
        tasks = [asyncio.create_task(server.serve()) for server in self.servers]
        while not all(server.started for server in self.servers):
            done = [task for task in tasks if task.done()]
            if done:
                self.failed = "a port could not be bound"
                self.ready.set()
                break
            await asyncio.sleep(0.05)
        if not self.failed:  # after uvicorn's lifespans: the inference client the gRPC calls share is made
            try:
                for api, handler in self.services.items():
                    self.grpc.append(grpc_api.server(*getattr(self.config, api), handler, self.config.max_request_size))
                    await self.grpc[-1].start()
            except RuntimeError as exc:
                self.failed = f"a gRPC port could not be bound ({exc})"
                for server in self.servers:
                    server.should_exit = True
        self.ready.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self.grpc:
            await server.stop(5)

    def stop(self) -> None:
        for server in self.servers:
            server.should_exit = True
        self._thread.join(10)
