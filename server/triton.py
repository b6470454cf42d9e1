"""The real tritonserver bundled in the nvidia-pytriton wheel, as one child process that dies with us."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from itertools import count
from pathlib import Path

from tritonclient.utils import InferenceServerException

from common.messages import first_line
from common.modelconfig import from_json, mc, to_json
from common.procs import free_port, port_free
from server.errors import ServerError
from server.libcuda import stub_library_path
from server.log import TritonLog
from server.procfs import SHM_PREFIX, WORKDIR_PREFIX, Stub, remove_stale, stubs_of, with_parent_death
from server.stub_python import check_stub_python, libpython_env, resolve_stub_python, stub_path
from server.repo import compile_bytecode, fingerprint, flag_names, gpu_flags, servable_models, uses_gpu
from server.unix_http import SOCKETS, UNIX, connect, listen_flags, release_thread_hub, sync_client, unlink_socket
from server.wheel import make_backend_dir, pytriton_root

__all__ = ["ServerError", "TritonServer", "release_thread_hub"]
_PRIVATE = count(1)  # tells apart the shared memory of private servers (no port) one process starts


class TritonServer:
    """A tritonserver process: start() blocks until it is ready; stop() drains, ends it and its stubs.

    The server dies with the process that started it (PR_SET_PDEATHSIG), its stubs die with the server
    (they watch their parent), and what they leave in /dev/shm carries our pid so that the next start
    can remove it (remove_stale). A port of None: none (TritonServer.private)."""

    def __init__(self, repository, http_port=8000, grpc_port=8001, metrics_port=8002, host="127.0.0.1",
                 model_control="none", log_file=None, extra_args=(), drain_seconds: float = 5, env=None,
                 libcuda_link: bool = True, stub_python: str | os.PathLike | None = None):
        self.repository = Path(repository).resolve()
        self.host = host
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self._tag = http_port if http_port is not None else f"u{next(_PRIVATE)}"
        self.model_control = model_control
        self.extra_args = list(extra_args)
        self.drain_seconds = drain_seconds
        self.env = dict(env or {})  # added to our environment for tritonserver (its stubs inherit it)
        # GPU models: where the driver has only libcuda.so.1, a libcuda.so link first on the stubs' library path.
        self.libcuda_link = libcuda_link
        self.stub_python = resolve_stub_python(stub_python)  # the `python3` the stubs run in (server.stub_python)
        self.stub_numpy: str | None = None  # its NumPy, checked (1.x) by start()
        self._workdir: Path | None = None  # made by the first start(): backend symlinks and, by default, the log
        self._own_log = log_file is None
        self.log = TritonLog(Path(log_file) if log_file else None)
        self._process: subprocess.Popen | None = None
        self._pump_thread: threading.Thread | None = None
        self.returncode: int | None = None
        self.skipped: dict[str, str] = {}
        self.loaded: list[str] = []
        self.served_files: dict[str, tuple] = {}  # model -> fingerprint of the folder Triton loaded
        self.cleaned: list[str] = []  # what the first start removed (or kept: "kept log PATH") of dead runs
        # In Triton's "none" mode the repository API is closed to clients; we keep a key for ourselves
        # (the supervisor reloads a model whose stub died).
        self.admin_key = secrets.token_hex(16) if model_control == "none" else None
        self.abandoned: set[int] = set()  # live stubs of a copy whose unload never ends: counted as never freed

    @classmethod
    def local(cls, repository, **options) -> "TritonServer":
        """A server on 127.0.0.1 with free HTTP, gRPC and metrics ports (not started)."""
        return cls(repository, free_port(), free_port(), free_port(), **options)

    @classmethod
    def private(cls, repository, **options) -> "TritonServer":
        """A server that listens on no TCP port (a local user could send it a request that aborts Triton 2.51):
        HTTP and metrics on Unix sockets in its private folder (0700, made by start), gRPC off (not started)."""
        return cls(repository, None, None, None, **options)

    @property
    def log_file(self) -> Path | None:
        return self.log.path

    @property
    def workdir(self) -> Path | None:
        """This run's private folder (made by the first start, removed by stop)."""
        return self._workdir

    def _url(self, api: str) -> str:
        """Where `api` listens: "HOST:PORT", or "unix:PATH" (server.unix_http's clients take both)."""
        if self.ports[api] is not None:
            return f"{self.host}:{self.ports[api]}"
        if api not in SOCKETS or self._workdir is None:
            raise ServerError(f"tritonserver's {api} is off" if api not in SOCKETS else "tritonserver not started")
        return f"{UNIX}{self._workdir / SOCKETS[api]}"

    @property
    def http_url(self) -> str:
        return self._url("http")

    @property
    def grpc_url(self) -> str:
        return self._url("grpc")

    @property
    def metrics_url(self) -> str:
        return self._url("metrics")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def shm_prefix(self) -> str:
        return f"{SHM_PREFIX}{os.getpid()}_{self._tag}_"

    def command(self) -> list[str]:
        root = pytriton_root()
        backends = self._workdir / "backends"
        if not backends.exists():
            make_backend_dir(root, backends)
        # Always explicit, loading what this server can run: the wheel has only the python backend,
        # so NAME_onnx / NAME_torchscript (for NVIDIA's container) would otherwise fail the start.
        cmd = [str(root / "bin" / "tritonserver"), f"--model-repository={self.repository}",
               f"--backend-directory={backends}", "--model-control-mode=explicit",
               f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}"]
        for api, port in self.ports.items():
            cmd += listen_flags(api, self.host, port, self._workdir)
        if self.admin_key:  # Triton's "none": no live (re)loading through the API
            cmd.append(f"--http-restricted-api=model-repository:triton-admin-key={self.admin_key}")
            if self.ports["grpc"] is not None:
                cmd.append(f"--grpc-restricted-protocol=model-repository:triton-admin-key={self.admin_key}")
        self.loaded, self.skipped = servable_models(self.repository)
        cmd += [f"--load-model={name}" for name in self.loaded]
        if "--exit-timeout-secs" not in flag_names(self.extra_args):  # how long a stop waits for in-flight requests
            cmd.append(f"--exit-timeout-secs={max(0, int(round(self.drain_seconds)))}")
        if not {"--disable-auto-complete-config", "--strict-model-config"} & set(flag_names(self.extra_args)):
            # build-repo writes complete configs. Otherwise the python backend starts one more stub per model
            # at every load, only to ask model.py to complete its config: measured, a start of resnet18's
            # repository 9.5 s -> 3.6 s on 2 cores, and so every restart after a crash.
            cmd.append("--disable-auto-complete-config")
        return cmd + gpu_flags(self.repository, self.extra_args) + self.extra_args

    def start(self, timeout: float = 600, abort: threading.Event | None = None) -> "TritonServer":
        """Start tritonserver and wait until it is ready (or `abort` is set: then stop and raise)."""
        if not self.repository.is_dir():
            raise ServerError(f"model repository {self.repository} does not exist (run build-repo first)")
        for api, port in self.ports.items():
            if port is not None and not port_free(self.host, port):
                raise ServerError(f"{api} port {port} on {self.host} is busy; choose another with --{api}-port")
        if self._workdir is None:
            self.cleaned = remove_stale()
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))  # 0700
            if self._own_log:
                self.log.path = self._workdir / "tritonserver.log"
        for api in SOCKETS:  # a dead server's socket file makes the next one's bind fail ("already in use")
            if self.ports[api] is None and not unlink_socket(self._workdir / SOCKETS[api]):
                raise ServerError(f"{self._workdir / SOCKETS[api]} is too long for a socket: set TMPDIR shorter")
        env = {**os.environ, **self.env}
        # The stub embeds the system libpython, which finds its prefix through the first `python3`
        # on PATH; putting this interpreter's bin/ first makes it see this venv's torch/torchvision
        # (or --stub-python's). Its NumPy must be 1.x: checked before Triton starts (server.stub_python).
        env["PATH"] = stub_path(self.stub_python, env.get("PATH", ""))
        self.stub_numpy = check_stub_python(self.stub_python, env)
        env.update(libpython_env(self.stub_python, env))
        if self.libcuda_link and uses_gpu(self.repository):
            library_path = stub_library_path(self._workdir / "libcuda", env.get("LD_LIBRARY_PATH", ""))
            if library_path is not None:
                env["LD_LIBRARY_PATH"] = library_path
        self.log.clear()
        self.returncode = None
        compile_bytecode(self.repository)  # for the stub's interpreter, before Triton sees the files
        command = self.command()
        self._process = subprocess.Popen(with_parent_death(command, os.getpid()), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.served_files = {name: fingerprint(self.repository / name) for name in self.loaded}
        self._pump_thread = threading.Thread(target=self.log.pump, args=(self._process,), daemon=True)
        self._pump_thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._pump_thread.join(5)  # so reason() sees Triton's last words
                status = self._process.returncode
                self._reap()
                raise ServerError(f"tritonserver exited with status {status}: {self.log.reason(command)}")
            if self.ready() and self._metrics_listening():
                return self
            if abort is None:
                time.sleep(0.2)
            elif abort.wait(0.2):
                self.stop()
                raise ServerError("stopped while starting")
        self.stop(keep_log=True)  # Triton drains and exits 0 on our SIGTERM: its log is still a failure's
        raise ServerError(f"tritonserver not ready after {timeout:.0f}s: {self.reason()}")

    def restart(self, timeout: float = 600, abort: threading.Event | None = None) -> "TritonServer":
        """Start again after the server died: same ports, log and shared-memory prefix."""
        self._reap()
        deadline = time.monotonic() + 10  # a dead server's listening sockets take a moment to go
        while time.monotonic() < deadline and not all(port_free(self.host, p) for p in self.ports.values() if p):
            time.sleep(0.1)
        return self.start(timeout, abort)

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @contextmanager
    def _client(self, timeout: float):
        """tritonclient's HTTP client for one call: it is not thread-safe, and serve-repo calls from several threads."""
        client = sync_client(self.http_url, connection_timeout=min(timeout, 5.0), network_timeout=timeout)
        try:
            yield client
        finally:
            client.close()

    def _asks(self, question, timeout: float = 2) -> bool:
        """A health question's answer; False where the server does not answer (starting, dead)."""
        try:
            with self._client(timeout) as client:
                return bool(question(client))
        except (InferenceServerException, OSError):
            return False

    def ready(self) -> bool:
        return self._asks(lambda client: client.is_server_ready())

    def _metrics_listening(self) -> bool:
        """Triton opens its metrics port just after HTTP reports ready: a start is done when that port takes
        connections too (a test reading /metrics right after start was refused on a busy machine)."""
        if any(arg.replace(" ", "=") in ("--allow-metrics=false", "--allow-metrics=0") for arg in self.extra_args):
            return True
        try:
            connect(self.metrics_url, timeout=1).close()
            return True
        except OSError:
            return False

    def rebuilt(self, name: str) -> bool:
        """True when `name`'s folder no longer holds what Triton loaded (build-repo --force into a served one)."""
        return name in self.served_files and fingerprint(self.repository / name) != self.served_files[name]

    def loaded_anew(self, name: str) -> None:
        """Record that Triton now serves what `name`'s folder holds."""
        self.served_files[name] = fingerprint(self.repository / name)

    def watch(self, names: list[str], watched: bool = True) -> None:
        """`names` loaded (else unloaded) live: the supervisor replaces their dead stubs (else no longer)."""
        self.loaded = [*self.loaded, *names] if watched else [m for m in self.loaded if m not in names]

    def abandon(self, pids=(), alive: set[int] | None = None) -> set[int]:
        """Live stubs of a copy whose unload never ends, counted as never freed (supervisor); `alive`: forget others."""
        self.abandoned.update(pids)
        self.abandoned &= self.abandoned if alive is None else alive
        return set(self.abandoned)

    def model_ready(self, name: str) -> bool:
        return self._asks(lambda client: client.is_model_ready(name))

    def _call(self, what: str, call, timeout: float):
        """A call of tritonclient's HTTP client; ServerError naming `what` where it fails."""
        try:
            with self._client(timeout) as client:
                return call(client)
        except InferenceServerException as error:
            raise ServerError(f"{what}: {first_line(error)[:300]}") from None
        except (OSError, ValueError) as error:
            raise ServerError(f"{what}: {first_line(error)}") from None

    def model_config(self, name: str) -> mc.ModelConfig:
        """The configuration Triton serves `name` with (read from its JSON form)."""
        return self._call(f"config of {name}", lambda client: from_json(client.get_model_config(name)), 10)

    @property
    def _admin(self) -> dict | None:
        """The header the repository API asks for where serve-repo restricted it (--model-control none)."""
        return {"triton-admin-key": self.admin_key} if self.admin_key else None

    def index(self, timeout: float = 5) -> list[dict]:
        """The repository index: every model Triton knows of, with its state (READY, UNLOADING, ...)."""
        return self._call("index", lambda client: client.get_model_repository_index(headers=self._admin), timeout)

    def load(self, model: str, config: mc.ModelConfig | None = None, timeout: float = 600) -> None:
        """Load (or update) `model`; with `config`, under that config instead of its config.pbtxt."""
        self._call(f"load {model}", lambda client: client.load_model(
            model, headers=self._admin, config=json.dumps(to_json(config)) if config is not None else None), timeout)

    def unload(self, model: str, timeout: float = 60) -> None:
        self._call(f"unload {model}", lambda client: client.unload_model(model, headers=self._admin), timeout)

    def stubs(self) -> list[Stub]:
        return stubs_of(self._process.pid) if self.running() else []

    def reason(self) -> str:
        return self.log.reason()

    def last_words(self) -> str:
        return self.log.last_words()

    def stop(self, timeout: float | None = None, keep_log: bool = False) -> int | None:
        """Stop: Triton refuses new work and finishes what it holds for up to drain_seconds
        (--exit-timeout-secs); whatever is left after that (a stuck stub) is killed. Then cleanup, which
        keeps our temporary log when the run failed: `keep_log`, or tritonserver's own exit was not 0."""
        if self._process is not None:
            self.terminate(timeout)
            self._reap()
        if self._workdir is not None:
            # A tritonserver that someone else SIGTERMed exits 0 like one we stopped: only the caller knows
            # that the run failed (serve-repo gave up), and its message names this log.
            clean = not keep_log and self.returncode in (0, None) and self._own_log
            shutil.rmtree(self._workdir if clean else self._workdir / "backends", ignore_errors=True)
            self._workdir = None
        return self.returncode

    def terminate(self, timeout: float | None = None) -> None:
        """SIGTERM and wait for the exit (Triton drains up to drain_seconds); the caller restarts or reaps it."""
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout if timeout is not None else self.drain_seconds + 5)
            except subprocess.TimeoutExpired:
                pass  # restart() / _reap() kills what is left

    def _reap(self) -> None:
        """After the server ended (or to end it): kill its process group, reap it, remove its shm."""
        process, self._process = self._process, None
        if process is None:
            return
        try:  # anything left in the server's session (a stuck stub) goes too
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        self.returncode = process.returncode
        if self._pump_thread is not None:
            self._pump_thread.join(5)
        for region in Path("/dev/shm").glob(f"{self.shm_prefix}*"):
            try:
                region.unlink()
            except OSError:
                pass

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
