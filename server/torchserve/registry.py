"""The registered models: TorchServe's (name, version) entries, each served by Triton as BASE, BASE_preprocess,
BASE_image built by build-repo (BASE: the name, else NAME_vVERSION, else with a hash: never another entry's);
registered, scaled (a live reload, up to max_workers) and unregistered through Triton's repository API, never a
restart. BASE_explain, the image path's explanations, is loaded on demand (explainers.py), unloaded with the rest."""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

from common.build_request import BuildRequest
from server import canary
from server.errors import ServerError
from server.torchserve.archives import KEEP_UNUSED_BUILDS, build_registered, inspect, link, prune
from server.torchserve.explainers import Explainers
from server.torchserve.loading import remove, wait_unloaded, write_config
from server.torchserve.model_store import adopted, copied, locate
from server.torchserve.naming import refusal, triton_base, triton_names
from server.torchserve.registration import Model
from server.torchserve.refusals import Refusal
from server.triton import TritonServer


class Registry:
    def __init__(self, server: TritonServer, store: Path, cache: Path, build_request: BuildRequest,
                 default_workers: int | None, job_queue_size: int, log=print, response_timeout: int = 120,
                 max_workers: int = 1, canary: bool = True, startup_timeout: int = 120,
                 allowed_urls: tuple[str, ...] | None = None, max_pixels: int | None = None):
        self.canary = canary  # one checked request before a registration or a scale answers (server/canary.py)
        self.server, self.store, self.cache, self.log = server, store, cache, log
        self.build_request, self.default_workers = build_request, default_workers  # serve-repo's flags
        self.job_queue_size = job_queue_size
        self.max_workers = max_workers  # max_workers_per_model: what any registration or scale may start
        self.response_timeout = response_timeout  # seconds, where a registration names none
        self.startup_timeout = startup_timeout  # default_startup_timeout, where a registration names none
        self.allowed_urls = allowed_urls  # config.properties' allowed_urls (None: TorchServe's default)
        # config.properties' max_pixels (None: build-repo's, 50 M) bounds both paths' decoding, where TorchServe's
        # handlers have PIL's own bound (an error past 2 x 89,478,485 pixels), as the plain front's (issue 42 B9)
        self.max_pixels = max_pixels
        self.models: dict[str, dict[str, Model]] = {}  # name -> version -> entry
        self.defaults: dict[str, str] = {}  # name -> default version
        self._lock = threading.RLock()  # one management change at a time (TorchServe serializes them too)
        self._claims = threading.Lock()  # models and defaults changed (never held through a build)
        self.changed = lambda: None  # after each change a client made: TorchServe's config snapshot (snapshots.py)
        self.explainers = Explainers(self)  # the image path's explanations: a handler-path model loaded on demand

    def on_change(self, save=None) -> None:
        """`save` called after each change a client made (TorchServe's config snapshot: snapshots.py), its failure
        (a ServerError) the caller's answer; None: nothing saved."""
        self.changed = save if save is not None else lambda: None

    # -- lookups (the inference API's, on every request: no lock, dict reads are atomic) --
    def find(self, name: str, version: str | None = None) -> Model:
        versions = self.models.get(name)
        if not versions:
            raise Refusal(f"Model not found: {name}", "ModelNotFoundException")
        version = version or self.defaults.get(name)
        if version not in versions:
            raise Refusal(f"Model version: {version} does not exist for model: {name}",
                          "ModelVersionNotFoundException")
        return versions[version]

    def all(self) -> list[Model]:
        return [m for name in sorted(self.models) for m in self.models[name].values()]

    # -- changes --
    def register(self, url: str, name: str | None = None, batch_size: int | None = None,
                 max_batch_delay: int | None = None, workers: int | None = None, response_timeout: int = 120,
                 loaded_at_startup: bool = False, **more) -> Model:
        model = self.claim(url, name, batch_size, max_batch_delay, workers, response_timeout, loaded_at_startup,
                           **more)
        self.complete(model)
        return model

    def claim(self, url: str, name: str | None = None, batch_size: int | None = None,
              max_batch_delay: int | None = None, workers: int | None = None, response_timeout: int = 120,
              loaded_at_startup: bool = False, startup_timeout: int | None = None, handler: str | None = None,
              restored: bool = False) -> Model:
        """A registration's first half, as TorchServe's: the archive found (or fetched) and read, the model known at
        once -- describe, list, scale and unregister find it -- and its workers to come with complete(). `workers`:
        the API's initial_workers (0: none until scaled, as TorchServe), None at startup (default_workers_per_model),
        exactly that many where `restored` (a snapshot's; not the archive's minWorkers, as TorchServe's setModelState)."""
        path = adopted(locate(url, self.store, allowed_urls=self.allowed_urls), url, self.store)
        try:
            info = inspect(path, url)
            name = name or info.name
            if (refused := refusal(name, info.version)) is not None:
                raise Refusal(refused, "InvalidModelException")
            with self._claims:
                if info.version in self.models.get(name, {}):
                    raise Refusal(f"Model version {info.version} is already registered for model {name}",
                                  "ConflictStatusException")
                # TorchServe's when the request names none: the archive's model-config.yaml, else 1 and 100 ms
                batch = batch_size or info.batch_size or 1
                delay = (info.max_batch_delay or 100) if max_batch_delay is None else max_batch_delay
                # TorchServe's order: the archive's minWorkers over initial_workers over default_workers_per_model
                wanted = workers if workers is not None else self.default_workers or 1
                count = self._bounded(wanted if restored else info.min_workers or wanted, name, info.version)
                taken = set().union(*(triton_names(m.triton) for m in self.all()))
                triton = triton_base(name, info.version, name not in self.models, taken)
                if triton is None:
                    raise Refusal(f"Model version {info.version} of model {name}: its Triton model names are taken",
                                  "ConflictStatusException")
                model = Model(name, info.version, info, triton, batch, delay, count, response_timeout,
                              loaded_at_startup, self.startup_timeout if startup_timeout is None else startup_timeout,
                              handler if handler != info.handler else None)
                self.models.setdefault(name, {})[info.version] = model
                self.defaults.setdefault(name, info.version)
                return model
        except BaseException:
            self._drop_download(url, path)
            raise

    def complete(self, model: Model, keep: bool = False) -> None:
        """A claimed model built and served (unless unregistered meanwhile); on failure it is forgotten, as TorchServe
        unregisters a model whose workers failed to start -- unless `keep` (a restore's): then it stays registered as
        recorded, its bounds kept and no worker running, so that no restart loses a registration (issue 52)."""
        try:
            with self._lock:
                if self.models.get(model.name, {}).get(model.version) is not model:
                    return  # unregistered meanwhile
                if model.workers:  # registered with 0 workers: none to start until scaled
                    self._start(model, model.version)
        except BaseException:
            if keep:
                model.bounds, model.workers = model.bounds or (model.workers, model.workers), 0
                raise
            with self._claims:
                self._forget(model)
            self._drop_download(model.info.url, model.info.path)
            self._changed_quietly()  # a claim answered before (synchronous=false) was recorded: it is gone now
            raise
        self.changed()

    def _start(self, model: Model, named: str | None) -> None:
        """Build `model` (cached) and serve it with its workers within its startup_timeout, else TorchServe's 500
        (`named`: the version its message names, as TorchServe's: the request's, else null; the reason is logged)."""
        failed = Refusal(f"Failed to start workers for model {model.name} version: {named or 'null'}",
                         "InternalServerException")
        if model.startup_timeout <= 0:  # TorchServe: no worker starts in 0 s
            self.log(f"{model.name} {model.version}: startup_timeout={model.startup_timeout}: no worker can start")
            raise failed
        # No --max-queue-size: a Triton queue policy brings back its batcher's 500 ms stall
        # (docs/performance.md); job_queue_size is bounded in the front instead (Model.pending).
        request = replace(self.build_request, name=model.triton, max_batch_size=model.batch_size,
                          max_batch_delay_ms=model.max_batch_delay)
        built, result = build_registered(model.info, model.handler_override, request, self.cache, self.log)
        in_use = {built} | {m.built for m in self.all() if m.built} | {m.explainer_built for m in self.all()}
        for removed in prune(self.cache, in_use - {None}):
            self.log(f"build cache: removed {removed.name} (unused; {KEEP_UNUSED_BUILDS} kept)")
        model.built, model.result = built, result
        began = time.monotonic()  # the build is serve-repo's own step; the workers' start is Triton's load
        try:
            self._serve(model, built)
        except Refusal as exc:
            self.log(f"{model.name} {model.version}: {exc}")
            raise failed from None
        if time.monotonic() - began > model.startup_timeout:
            self.log(f"{model.name} {model.version}: its workers took {time.monotonic() - began:.1f} s to start, over "
                     f"startup_timeout={model.startup_timeout}")
            self._stop(model)
            raise failed

    def _drop_download(self, url: str, path: Path) -> None:
        if copied(url, path, self.store):  # as TorchServe: a download or copy whose registration failed is removed
            path.unlink(missing_ok=True)

    def _forget(self, model: Model) -> None:
        versions = self.models.get(model.name, {})
        if versions.get(model.version) is not model:
            return
        versions.pop(model.version)
        if not versions:
            self.models.pop(model.name, None)
            self.defaults.pop(model.name, None)
        elif self.defaults.get(model.name) == model.version:
            self.defaults[model.name] = sorted(versions)[0]

    def _bounded(self, workers: int, name: str, version: str) -> int:
        """`workers` up to max_workers_per_model: the API refuses more (400); an archive's minWorkers, models= and
        default_workers_per_model are clamped, said once in the log."""
        if workers > self.max_workers:
            self.log(f"{name} {version}: {workers} workers asked for, {self.max_workers} started "
                     f"(max_workers_per_model={self.max_workers})")
        return min(workers, self.max_workers)

    def _serve(self, model: Model, built: Path) -> None:
        """Link the built models into the served repository and load them (the ensemble last)."""
        members = model.result.load_order()
        for member in members:
            target = link(built, member, self.server.repository)
            # The classifier runs `workers` instances; its decoder (NAME_preprocess) as built, but never more.
            write_config(built / member / "config.pbtxt", target / "config.pbtxt",
                         model.workers if member == model.triton else None,
                         wait=member == model.triton, at_most=model.workers, max_pixels=self.max_pixels)
        try:
            for member in members:
                self.server.load(member)
                self.server.loaded_anew(member)
        except ServerError as exc:
            remove(self.server, members)
            raise Refusal(f"Failed to load model {model.name}: {exc}", "InternalServerException") from None
        try:  # loaded is not answering: one checked request first (server/canary.py)
            report = canary.run(self.server, models=members) if self.canary else None
        except ServerError as exc:
            for member in reversed(members):  # the ensemble first, as unregister does
                try:
                    self.server.unload(member)
                except ServerError:
                    pass
            wait_unloaded(self.server, members, self.log)
            remove(self.server, members)
            raise Refusal(f"Failed to load model {model.name}: {exc}", "InternalServerException") from None
        if report is not None:
            self.log(f"{model.name} {model.version}: {report.line()}")
        self.server.watch(members)  # the supervisor watches their stubs from now on
        model.members = members  # served: predictions go to it from now on (503 before: workers to come)

    def scale(self, model: Model, low: int, high: int, named: str | None = None) -> None:
        """TorchServe's minWorkers `low`, maxWorkers `high`: the workers (Triton instances) brought within them as its
        WorkLoadManager does (0: unloaded, still registered; from 0: built, cached, and loaded as at registration);
        a change: config.pbtxt rewritten, a live reload (the old instances answer until the new ones are ready)."""
        try:
            with self._lock:
                self._scale(model, low, high, named)
        except BaseException:  # a failed start leaves it with 0 workers: that is the state to record
            self._changed_quietly()
            raise
        self.changed()

    def _changed_quietly(self) -> None:
        """changed() where a failure is already being raised: that one is what the caller is told (an unsaved snapshot
        is in the log)."""
        try:
            self.changed()
        except ServerError:
            pass

    def _scale(self, model: Model, low: int, high: int, named: str | None) -> None:
        if self.models.get(model.name, {}).get(model.version) is not model:
            return  # unregistered while the scale waited (e.g. for its build)
        model.bounds = (low, high)
        workers = low if not model.members or not low or model.workers < low else min(model.workers, high)
        if not model.members:
            if model.workers:  # claimed, its build to come (synchronous=false): that build serves this many
                model.workers = workers
            elif workers:  # registered or scaled to 0 workers: started now
                model.workers = workers
                try:
                    self._start(model, named)
                except BaseException:
                    model.workers = 0  # still registered, with none, as TorchServe after a failed scale
                    raise
            return
        if not workers:
            model.workers = 0
            self._stop(model)
            return
        if workers == model.workers:
            return  # within them already: TorchServe leaves its workers as they are
        config = self.server.repository / model.triton / "config.pbtxt"
        write_config(config, config, workers)
        self.server.load(model.triton)
        self.server.loaded_anew(model.triton)
        model.workers = workers
        if self.canary:
            canary.run(self.server, [model.triton], model.members)  # a wrong answer: 500, as a failed reload

    def unregister(self, model: Model) -> None:
        """Forget `model` at once (new requests: 404); Triton unloads it after what it holds is answered."""
        with self._lock:
            with self._claims:
                self._forget(model)
            self._stop(model)
            if copied(model.info.url, model.info.path, self.store):
                model.info.path.unlink(missing_ok=True)  # as TorchServe 0.12: a fetched archive leaves with its model
        self.changed()

    def _stop(self, model: Model) -> None:
        """`model`'s Triton models unloaded once what the front sent on is answered (new requests: 503 or 404)."""
        members, model.members = model.members, []
        self.server.watch(members, False)
        # What the front already sent on is answered first; then the entry (the ensemble, loaded last: requests enter
        # there), and once it is gone the models behind it together (~1 s a Python stub takes to end, once, not per
        # model): no request in flight in the ensemble finds one of them unloaded, and none can reach them after.
        deadline = time.monotonic() + model.response_timeout
        while model.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        for group in (members[-1:], members[:-1]):
            for member in group:
                try:
                    self.server.unload(member)
                except ServerError as exc:
                    self.log(f"unloading {model.name}: {exc}")
            if group:
                wait_unloaded(self.server, group, self.log)
        remove(self.server, members)
        self.explainers.unload(model)  # its explanations' model too, where one was loaded

    def set_default(self, model: Model) -> None:
        with self._lock:
            self.defaults[model.name] = model.version
        self.changed()

