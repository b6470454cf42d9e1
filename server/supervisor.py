"""Watch a running tritonserver: restart it when it dies, replace the instances of a model whose stub died.

Why replacing in place: Triton 2.51 keeps a model READY when one of its python stubs dies and routes batches
to the dead instance, which fail; a `load` of the unchanged model does nothing, and an `unload` never ends
when a batch was in flight (python_backend 24.10 keeps that batch's response factories, which hold the
model). A `load` whose config differs only in the dead instance's group signature makes Triton replace that
group's instances while the others keep answering. That holds while the version folder is unmodified since
its load (a modified one loads as a whole new copy), hence the bytecode is written before the first load;
where dead copies are never freed anyway, past `max_unfreed` of them tritonserver is restarted, drained.
"""
from __future__ import annotations

import signal
import threading
import time
from typing import Callable

from common.modelconfig import mc
from server import canary
from server.triton import ServerError, TritonServer, release_thread_hub


def describe_exit(status: int | None) -> str:
    if status is None:
        return "unknown status"
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


class Supervisor:
    """One loop, in the thread that started the server (its PR_SET_PDEATHSIG is tied to that thread).

    - tritonserver died: log its last words, restart at once, then with backoff (0.5 s, 1 s, 2 s, ... 30 s);
      give up after `max_restarts` restarts that each lived less than `stable_seconds`. The same for the proxy.
    - a stub died while its model is READY: its instances are replaced in place (reload).
    - more than `max_unfreed` dead stubs left unreaped for `unfreed_grace` s (instances Triton never freed), the
      live stubs of a copy whose unload never ends (server.abandoned: the TorchServe front's) counted with them:
      tritonserver is stopped (drained) and started again; 0: never.
    """

    def __init__(self, server: TritonServer, max_restarts: int = 5, poll_seconds: float = 0.25,
                 stable_seconds: float = 60, log: Callable[[str], None] = print, start_timeout: float = 600,
                 max_unfreed: int = 4, unfreed_grace: float = 30, proxy=None, canary: bool = True):
        self.canary = canary  # a restart or a replacement counts once its models answered a checked request
        self.server = server
        self.proxy = proxy  # server.proxy.Proxy in front of the server, restarted when it dies
        self.max_restarts = max_restarts
        self.poll_seconds = poll_seconds
        self.stable_seconds = stable_seconds
        self.log = log
        self.start_timeout = start_timeout
        self.restarts = 0            # in a row (reset once the server stayed up stable_seconds)
        self.total_restarts = 0
        self.reloads = 0
        self.failed_reloads = 0      # replacements that loaded but answered their canary wrong (or not at all)
        self._wrong: str | None = None  # why the last restart's canary failed: that restart counts as failed
        # Models whose dead stubs are being replaced: their new stub may be alive before Triton swapped it in (a
        # frozenset, rebound whole, for readers in other threads: the TorchServe API's /ping).
        self.replacing: frozenset[str] = frozenset()
        self._started = time.monotonic()
        self._known: dict[int, tuple[str, str]] = {}   # live stub pid -> (model, instance)
        self._suspects: dict[tuple[str, str], float] = {}  # dead (model, instance) -> when first seen dead
        self.failure: str | None = None
        self._stop = threading.Event()
        self.max_unfreed, self.unfreed_grace = max_unfreed, unfreed_grace
        self._zombies: dict[int, float] = {}  # dead, unreaped stub pid -> when first seen
        self._planned: str | None = None      # why we stopped tritonserver ourselves
        self.proxy_restarts = 0               # in a row, as self.restarts, with the same backoff and limit
        self._proxy_started = time.monotonic()
        self._proxy_retry_at: float | None = None  # when the dead proxy is started again
        self._proxy_error: str | None = None       # why its last start failed

    def run(self, stop: threading.Event) -> int:
        """Until `stop` is set: 0. Gave up restarting: 1 (self.failure says why)."""
        self._stop = stop
        while not stop.is_set():
            if not self.server.running():
                if not self._restart(stop):
                    return 1 if not stop.is_set() else 0
                continue
            stubs = self.server.stubs()  # one look at /proc per poll, for both checks
            self.check_stubs(stubs)
            self.check_unfreed(stubs)
            self.check_proxy()
            if self.failure:  # the proxy kept dying
                return 1
            stop.wait(self.poll_seconds)
        return 0

    def _restart(self, stop: threading.Event) -> bool:
        self.server._reap()
        why = f"tritonserver died ({describe_exit(self.server.returncode)}): {self.server.last_words()}"
        if self._wrong:
            why, self._wrong = f"tritonserver restarted but {self._wrong}", None
        if time.monotonic() - self._started >= self.stable_seconds or self._planned:
            self.restarts = 0
        if self._planned:
            why, self._planned = f"tritonserver stopped to free {self._planned}", None
        if self.restarts >= self.max_restarts:
            self.failure = f"{why}; not restarted: {self.restarts} restarts in a row failed or died again"
            self.log(f"serve-repo: error: {self.failure}")
            return False
        self.restarts += 1
        delay = 0.0 if self.restarts == 1 else min(30.0, 0.5 * 2 ** (self.restarts - 2))  # 0, 0.5 s, 1 s ...
        self.log(f"serve-repo: {why}; restarting ({self.restarts}/{self.max_restarts}) in {delay:g}s")
        died = time.monotonic()
        if stop.wait(delay):
            return False
        self._known.clear()
        self._suspects.clear()
        try:
            self.server.restart(self.start_timeout, abort=stop)
        except ServerError as error:
            if stop.is_set():
                return False
            self.log(f"serve-repo: restart failed: {error}")
            return True  # the loop sees it not running and tries again (or gives up)
        try:
            if self.canary:
                self._interruptible(lambda: canary.run(self.server))
        except ServerError as error:
            if stop.is_set():
                return False
            self._wrong = str(error)
            self.log(f"serve-repo: restart failed: {error}")
            self.server.terminate()  # the loop sees it stopped and tries again (or gives up), as after a crash
            return True
        self._started = time.monotonic()
        self.total_restarts += 1
        self.log(f"serve-repo: tritonserver ready again after {self._started - died:.1f}s "
                 f"(restart {self.total_restarts})")
        return True

    def check_proxy(self) -> bool:
        """Start the proxy again if it died (it holds no state: clients reconnect), at once, then with tritonserver's
        backoff; after `max_restarts` restarts in a row that each lived less than `stable_seconds`, give up
        (self.failure names its last words). True if it was restarted."""
        if self.proxy is None or self.proxy.running():
            return False
        now = time.monotonic()
        if self._proxy_retry_at is None:  # just found dead
            self.proxy._reap()
            why = self._proxy_error or (f"the proxy died ({describe_exit(self.proxy.returncode)}): "
                                        f"{self.proxy.last_words()}")
            if now - self._proxy_started >= self.stable_seconds:
                self.proxy_restarts = 0
            if self.proxy_restarts >= self.max_restarts:
                self.failure = f"{why}; not restarted: {self.proxy_restarts} restarts in a row failed or died again"
                self.log(f"serve-repo: error: {self.failure}")
                return False
            self.proxy_restarts += 1
            delay = 0.0 if self.proxy_restarts == 1 else min(30.0, 0.5 * 2 ** (self.proxy_restarts - 2))
            self.log(f"serve-repo: {why}; restarting it ({self.proxy_restarts}/{self.max_restarts}) in {delay:g}s")
            self._proxy_retry_at = now + delay
        if now < self._proxy_retry_at:
            return False  # tritonserver is still watched meanwhile
        self._proxy_retry_at, self._proxy_started, self._proxy_error = None, now, None
        try:
            self.proxy.start()
        except (ServerError, OSError) as error:
            self._proxy_error = f"the proxy did not start again: {error}"
            self.log(f"serve-repo: {self._proxy_error}")
            return False
        self.log("serve-repo: the proxy is listening again")
        return True

    def check_stubs(self, stubs: list | None = None) -> list[str]:
        """Find stubs that died under a READY model (`stubs`: server.stubs(), read now where None); reload those
        models. Returns the models reloaded."""
        stubs = [s for s in (self.server.stubs() if stubs is None else stubs)
                 if (s.zombie or s.serves) and s.pid not in self.server.abandoned]  # not a stuck copy's (its name's)
        alive = {(s.model, s.instance) for s in stubs if s.alive}
        by_pid = {s.pid: s for s in stubs}
        for pid, key in list(self._known.items()):
            stub = by_pid.get(pid)
            if stub is None or stub.zombie:
                del self._known[pid]
                if key not in alive:
                    self._suspects.setdefault(key, time.monotonic())
        for stub in stubs:
            if stub.alive:
                self._known[stub.pid] = (stub.model, stub.instance)
        # A python model with no live stub at all, even one that died before we first looked.
        live_models = {model for model, _ in alive}
        for model in self.server.loaded:
            if model not in live_models and any((self.server.repository / model).glob("*/model.py")):
                if not any(key[0] == model for key in self._suspects):
                    self._suspects[(model, "all")] = time.monotonic()
        reloaded = []
        for key in list(self._suspects):
            model, instance = key
            if key in alive or (instance == "all" and any(k[0] == model for k in alive)):  # replaced
                del self._suspects[key]
                continue
            if not self.server.model_ready(model):  # being unloaded or loaded on purpose
                del self._suspects[key]
                continue
            if time.monotonic() - self._suspects[key] < self.poll_seconds:
                continue  # seen dead once: a deliberate unload flips READY first; look again next poll
            for other in [k for k in self._suspects if k[0] == model]:
                del self._suspects[other]
            self.reload(model, "its stubs died" if instance == "all" else f"its stub {instance} died", instance)
            reloaded.append(model)
        return reloaded

    def check_unfreed(self, stubs: list | None = None) -> bool:
        """Restart tritonserver (drained) once it holds more than max_unfreed instances it never freed."""
        now = time.monotonic()
        stubs = self.server.stubs() if stubs is None else stubs
        dead = {s.pid for s in stubs if s.zombie} | self.server.abandon(alive={s.pid for s in stubs if s.alive})
        self._zombies = {pid: self._zombies.get(pid, now) for pid in dead}
        kept = [pid for pid, since in self._zombies.items() if now - since >= self.unfreed_grace]
        if not self.max_unfreed or len(kept) <= self.max_unfreed:
            return False
        self._planned = (f"{len(kept)} instances it never freed (stubs that died with a batch in flight, or of a "
                         "model whose unload never ended; python_backend 24.10 keeps their threads and shared memory)")
        self.log(f"serve-repo: stopping tritonserver to free {self._planned}; draining for up to "
                 f"{self.server.drain_seconds:g}s")
        self.server.terminate()
        self._zombies.clear()
        return True

    def _interruptible(self, call) -> None:
        """Run a blocking call (a model load takes seconds) without holding up a stop."""
        failure: list[ServerError] = []

        def run():
            try:
                call()
            except ServerError as error:
                failure.append(error)
            finally:
                release_thread_hub()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        while worker.is_alive() and not self._stop.is_set():
            worker.join(0.1)
        if failure:
            raise failure[0]
        if worker.is_alive():
            raise ServerError("stopped while loading")

    def _state(self, model: str) -> str:
        for entry in self.server.index():
            if entry.get("name") == model:
                return entry.get("state", "")
        return ""

    def _wait_unloaded(self, model: str, limit: float = 30) -> None:
        """Until the index no longer says READY/UNLOADING (or `limit` s), returning at once on a stop."""
        deadline = time.monotonic() + limit
        while self._state(model) in ("READY", "UNLOADING") and time.monotonic() < deadline:
            if self._stop.wait(0.05):
                raise ServerError("stopped while unloading")

    def reload(self, model: str, why: str, instance: str = "all") -> None:
        """Bring `model` back after a stub died: its instances replaced in place (the model stays loaded and
        its other instances keep serving); if Triton refuses that, unloaded and loaded again."""
        self.replacing = self.replacing | {model}
        try:
            self._reload(model, why, instance)
        finally:
            self.replacing = self.replacing - {model}

    def _reload(self, model: str, why: str, instance: str) -> None:
        started = time.monotonic()
        if self.server.rebuilt(model):
            # The served config with the new files would be neither build: load the new one whole.
            # A plain load of a modified folder is a whole new copy, swapped in when ready (no unload first:
            # an unload waits forever for a batch that was in flight in the dead stub).
            self.log(f"serve-repo: {model}: {why}; the repository holds a new build of it: loading that whole")
            try:
                self._interruptible(lambda: self.server.load(model))
            except ServerError as error:
                self.log(f"serve-repo: {model}: loading the new build failed ({error}); unloading first")
                self.reload_whole(model, started)
                return
            self.server.loaded_anew(model)
            self._answered(model, started)
            return
        self.log(f"serve-repo: {model}: {why}; replacing its instances (the model stays loaded)")
        try:
            config = self.server.model_config(model)
            self._interruptible(lambda: self.server.load(model, renewed(config, instance)))
        except ServerError as error:
            if self._stop.is_set():
                self.log(f"serve-repo: {model}: reload failed: {error}")
                return
            self.log(f"serve-repo: {model}: replacing in place failed ({error}); reloading")
        else:
            self._answered(model, started)
            return
        self.reload_whole(model, started)

    def reload_whole(self, model: str, started: float) -> None:
        """unload + load: the model is not ready until it is back."""
        try:
            self.server.unload(model)
            # Triton answers the unload at once and unloads in the background (~1 s with a dead stub);
            # a load issued before that finished is a version swap during which the broken model
            # stays READY. So: wait until the index says it is unloaded, then load.
            self._wait_unloaded(model)
            self._interruptible(lambda: self.server.load(model))
        except ServerError as error:
            self.log(f"serve-repo: {model}: reload failed: {error}")
            return
        self.server.loaded_anew(model)
        self._answered(model, started)

    def _answered(self, model: str, started: float) -> bool:
        """After `model` was loaded again: its canary (and its ensembles'). A wrong answer is a failed replacement,
        logged as one (never "ready again"); the model stays loaded as it is, as after a failed reload."""
        reports: list[canary.Report] = []
        try:
            if self.canary:
                self._interruptible(lambda: reports.append(canary.run(self.server, [model])))
        except ServerError as error:
            if self._stop.is_set():
                return False
            self.failed_reloads += 1
            self.log(f"serve-repo: {model}: replacement failed after {time.monotonic() - started:.1f}s: {error}")
            return False
        self.reloads += 1
        checked = f"; {reports[0].line()}" if reports else ""
        self.log(f"serve-repo: {model}: ready again after {time.monotonic() - started:.1f}s{checked}")
        return True


def renewed(config: mc.ModelConfig, instance: str = "all") -> mc.ModelConfig:
    """A copy of `config` with a new signature for the instance group that holds `instance` (all groups for "all"
    or an instance no group names): its rate_limiter priority set to the lowest one no group has.
    Triton compares groups by everything but name and count, so it replaces exactly that group's instances
    (build-repo writes one group per instance, each its own priority: one dead instance is replaced alone);
    the priority weighs nothing unless tritonserver runs with --rate-limit (off by default)."""
    config = mc.ModelConfig.FromString(config.SerializeToString())
    groups = config.instance_group
    named = [g for g in groups if instance.startswith(f"{g.name}_") and instance[len(g.name) + 1:].isdigit()]
    for group in named or groups:
        taken = {g.rate_limiter.priority for g in groups}
        group.rate_limiter.priority = min(set(range(1, len(groups) + 2)) - taken)
    return config
