"""The real tritonserver bundled in the nvidia-pytriton wheel, as one child process that dies with us."""
from __future__ import annotations

import collections
import ctypes
import importlib.util
import json
import os
import re
import shutil
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

# Triton logs: failed to load 'resnet18' version 1: Internal: KeyError: ...\n\nAt: ...
_LOAD_FAILURE = re.compile(r"failed to load '([^']+)' version \d+: (.*)")
# What a CPU-only machine always logs; never the reason for a failure.
_HARMLESS = ("CudaDriverHelper", "NVML", "DCGM", "CUDA driver version is insufficient")
# How a process says it crashed (C++ exceptions, fatal signals, the kernel's OOM answer): these come first.
_CRASH = re.compile(r"terminate called|what\(\)|std::bad_alloc|Signal \(\d+\) received|Segmentation fault|"
                    r"Aborted|core dumped|out of memory", re.IGNORECASE)
# Our names in /tmp and /dev/shm carry the owning process id, so that a later start can tell
# what a killed serve-repo left behind (its pid is gone) from what a running one still uses.
WORKDIR_PREFIX = "triton-serve-"
SHM_PREFIX = "tcls"
_OWNED = re.compile(r"^(?:triton-serve-|tcls)(\d+)[-_]")
_PR_SET_PDEATHSIG = 1


class ServerError(RuntimeError):
    """tritonserver could not be started or did not become ready; the message says why."""


def pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed: `pip install nvidia-pytriton==0.7.0` (see README)")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise ServerError(f"no tritonserver binary at {root / 'bin' / 'tritonserver'}")
    return root


def make_backend_dir(root: Path, into: Path) -> Path:
    """Assemble <into>/python/ from symlinks: the python backend wants its stub beside it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"nvidia-pytriton ships no python backend stub for Python {version}")
    python = into / "python"
    python.mkdir(parents=True)
    for source in (root / "backends/python/libtriton_python.so",
                   root / "backends/python/triton_python_backend_utils.py", stub):
        (python / source.name).symlink_to(source)
    return into


def servable_models(repository: Path) -> tuple[list[str], dict[str, str]]:
    """Models the bundled server can load (python backend, ensembles), and why the others cannot."""
    from builder.config import read_config

    loadable, skipped = [], {}
    for config_path in sorted(Path(repository).glob("*/config.pbtxt")):
        name = config_path.parent.name
        try:
            config = read_config(config_path)
        except Exception:  # let Triton itself report a config it cannot parse
            loadable.append(name)
            continue
        if config.backend == "python" or config.platform == "ensemble":
            loadable.append(name)
        else:
            skipped[name] = (f"{config.platform or config.backend} needs NVIDIA's Triton container "
                             "(docker/); the nvidia-pytriton server has only the python backend")
    return loadable, skipped


# Added when a repository has a KIND_GPU model, unless the same flag is passed through:
# - the CUDA memory pool carries GPU tensors between models (the ensemble's IMAGE: a 64-image batch is
#   38.5 MB as FP32); Triton's default 64 MB holds one such batch, and when it is exhausted
#   the python backend falls back to slower CUDA IPC allocations per tensor;
# - the python backend's shared memory starts at 1 MB per stub and grows 1 MB at a time; a batch of 64
#   images moves ~38 MB through it, so start big enough and grow in large steps.
GPU_FLAGS = ("--cuda-memory-pool-byte-size=0:536870912",
             "--backend-config=python,shm-default-byte-size=67108864",
             "--backend-config=python,shm-growth-byte-size=67108864")


def uses_gpu(repository: Path) -> bool:
    from builder.config import read_config

    for config_path in Path(repository).glob("*/config.pbtxt"):
        try:  # a config Triton cannot parse is reported by Triton itself
            groups = read_config(config_path).instance_group
        except Exception:
            continue
        if any(group.kind == group.KIND_GPU for group in groups):
            return True
    return False


def _flag_names(args: list[str]) -> set[str]:
    """`--name` of each flag, and `--backend-config=python,key` for backend settings."""
    names = set()
    for arg in args:
        name, _, value = arg.partition("=")
        names.add(name if name != "--backend-config" else f"{name}={value.split('=')[0]}")
    return names


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(tmp: Path | None = None, shm: Path = Path("/dev/shm")) -> list[str]:
    """Remove work directories and python-backend shared memory left by serve-repos that were killed."""
    removed = []
    for folder, is_dir in ((Path(tmp or tempfile.gettempdir()), True), (shm, False)):
        try:
            entries = list(folder.iterdir())
        except OSError:
            continue
        for entry in entries:
            owner = _OWNED.match(entry.name)
            if not owner or _pid_alive(int(owner.group(1))):
                continue
            try:
                shutil.rmtree(entry) if is_dir and entry.is_dir() else entry.unlink()
                removed.append(str(entry))
            except OSError:
                pass
    return removed


def _die_with_parent(parent: int) -> None:
    """In the child before exec: the kernel kills it when the process that started it ends, even by kill -9."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class Stub:
    """A python-backend stub process, read from /proc: its model, instance and whether it is still alive."""

    def __init__(self, pid: int, argv: list[str], zombie: bool):
        self.pid, self.zombie = pid, zombie
        # triton_python_backend_stub <repo>/<model>/<version>/model.py <shm region> <sizes> <parent pid>
        #   <backend dir> <ipc size> <instance name> <runtime>   (python_backend r24.10, stub_launcher.cc)
        self.model = Path(argv[1]).parent.parent.name if len(argv) > 1 else "?"
        self.instance = argv[8] if len(argv) > 8 else str(pid)

    @property
    def alive(self) -> bool:
        return not self.zombie

    @property
    def serves(self) -> bool:
        """An instance's stub (`<model>_<group>_<n>`), not the short-lived one a load starts for the model
        itself (named after the model), which exits once the model is loaded."""
        return self.instance != self.model and self.instance.startswith(self.model + "_")


def stubs_of(pid: int) -> list[Stub]:
    """The python-backend stubs tritonserver `pid` started (zombies included: they died)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry.name}/stat").read_text()
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) != pid:
                continue
            argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if stat[stat.find("(") + 1:].startswith("triton_python"):  # comm, also of a zombie (no cmdline)
            found.append(Stub(int(entry.name), argv, fields[0] == "Z"))
    return found


class TritonServer:
    """A tritonserver process: start() blocks until it is ready; stop() drains, ends it and its stubs.

    The server dies with the process that started it (PR_SET_PDEATHSIG), its stubs die with the server
    (they watch their parent), and what they leave in /dev/shm carries our pid so that the next start
    can remove it (remove_stale)."""

    def __init__(self, repository, http_port=8000, grpc_port=8001, metrics_port=8002, host="127.0.0.1",
                 model_control="none", log_file=None, extra_args=(), drain_seconds: float = 5):
        self.repository = Path(repository).resolve()
        self.host = host
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.model_control = model_control
        self.extra_args = list(extra_args)
        self.drain_seconds = drain_seconds
        self._workdir: Path | None = None  # made by the first start(): backend symlinks and, by default, the log
        self._own_log = log_file is None
        self.log_file = Path(log_file) if log_file else None
        self._tail = collections.deque(maxlen=400)
        self._process: subprocess.Popen | None = None
        self._pump_thread: threading.Thread | None = None
        self.returncode: int | None = None
        self.skipped: dict[str, str] = {}
        self.loaded: list[str] = []
        # In Triton's "none" mode the repository API is closed to clients; we keep a key for ourselves
        # (the supervisor reloads a model whose stub died).
        self.admin_key = secrets.token_hex(16) if model_control == "none" else None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def shm_prefix(self) -> str:
        return f"{SHM_PREFIX}{os.getpid()}_{self.ports['http']}_"

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
            cmd += [f"--{api}-port={port}", f"--{api}-address={self.host}"]
        if self.admin_key:  # Triton's "none": no live (re)loading through the API
            cmd += [f"--http-restricted-api=model-repository:triton-admin-key={self.admin_key}",
                    f"--grpc-restricted-protocol=model-repository:triton-admin-key={self.admin_key}"]
        self.loaded, self.skipped = servable_models(self.repository)
        cmd += [f"--load-model={name}" for name in self.loaded]
        ours = _flag_names(self.extra_args)
        if "--exit-timeout-secs" not in ours:  # how long a stop waits for in-flight requests
            cmd.append(f"--exit-timeout-secs={max(0, int(round(self.drain_seconds)))}")
        if uses_gpu(self.repository):
            cmd += [flag for flag in GPU_FLAGS if flag.split("=")[0] not in ours]
        return cmd + self.extra_args

    def start(self, timeout: float = 600, abort: threading.Event | None = None) -> "TritonServer":
        """Start tritonserver and wait until it is ready (or `abort` is set: then stop and raise)."""
        if not self.repository.is_dir():
            raise ServerError(f"model repository {self.repository} does not exist (run build-repo first)")
        for api, port in self.ports.items():
            if not port_free(self.host, port):
                raise ServerError(f"{api} port {port} on {self.host} is busy; choose another with --{api}-port")
        if self._workdir is None:
            remove_stale()
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))
            if self._own_log:
                self.log_file = self._workdir / "tritonserver.log"
        env = dict(os.environ)
        # The stub embeds the system libpython, which finds its prefix through the first `python3`
        # on PATH; putting this interpreter's bin/ first makes it see this venv's torch/torchvision.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        self._tail.clear()
        self.returncode = None
        parent = os.getpid()
        self._process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True,
                                         preexec_fn=lambda: _die_with_parent(parent))
        self._pump_thread = threading.Thread(target=self._pump, args=(self._process,), daemon=True)
        self._pump_thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._pump_thread.join(5)  # so reason() sees Triton's last words
                status = self._process.returncode
                self._reap()
                raise ServerError(f"tritonserver exited with status {status}: {self.reason()}")
            if self.ready():
                return self
            if abort is None:
                time.sleep(0.2)
            elif abort.wait(0.2):
                self.stop()
                raise ServerError("stopped while starting")
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout:.0f}s: {self.reason()}")

    def restart(self, timeout: float = 600, abort: threading.Event | None = None) -> "TritonServer":
        """Start again after the server died: same ports, log and shared-memory prefix."""
        self._reap()
        deadline = time.monotonic() + 10  # a dead server's listening sockets take a moment to go
        while not all(port_free(self.host, port) for port in self.ports.values()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        return self.start(timeout, abort)

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _get(self, path: str, timeout: float = 2) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as reply:
                return reply.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return 0

    def ready(self) -> bool:
        return self._get("/v2/health/ready") == 200

    def model_ready(self, name: str) -> bool:
        return self._get(f"/v2/models/{name}/ready") == 200

    def repository_api(self, action: str, model: str | None = None, timeout: float = 600) -> dict | list:
        """POST to Triton's repository API (index, load, unload), with our admin key when it is restricted."""
        path = f"/v2/repository/models/{model}/{action}" if model else f"/v2/repository/{action}"
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=b"{}", method="POST")
        if self.admin_key:
            request.add_header("triton-admin-key", self.admin_key)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                body = reply.read()
        except urllib.error.HTTPError as error:
            raise ServerError(f"{action} {model or ''}: HTTP {error.code}: "
                              f"{error.read().decode(errors='replace')[:300]}") from None
        except OSError as error:
            raise ServerError(f"{action} {model or ''}: {error}") from None
        return json.loads(body) if body else {}

    def stubs(self) -> list[Stub]:
        return stubs_of(self._process.pid) if self.running() else []

    def reason(self) -> str:
        """Triton's own words for a failure: a crash's last words, why each model failed to load, or its
        error lines."""
        lines = list(self._tail)
        crash = [line.strip() for line in lines if _CRASH.search(line)]
        if crash:
            return " | ".join(dict.fromkeys(crash[-4:]))
        failed = [m.group(1) + ": " + m.group(2).split("\\n")[0].strip()
                  for m in map(_LOAD_FAILURE.search, lines) if m]
        if failed:
            return "; ".join(dict.fromkeys(failed))
        errors = [line for line in lines if (line.startswith("E") or "error" in line.lower())
                  and not any(noise in line for noise in _HARMLESS)]
        return " | ".join(errors[-4:] or lines[-5:]) or "no output"

    def last_words(self) -> str:
        """What a server that died said last: its crash lines, else its last log line."""
        crash = [line.strip() for line in self._tail if _CRASH.search(line)]
        if crash:
            return " | ".join(dict.fromkeys(crash[-4:]))
        said = [line.strip() for line in self._tail if line.strip()]
        return "nothing in its log says why (last line: " + (said[-1][:200] if said else "none") + ")"

    def stop(self, timeout: float | None = None) -> int | None:
        """Stop: Triton refuses new work and finishes what it holds for up to drain_seconds
        (--exit-timeout-secs); whatever is left after that (a stuck stub) is killed. Then cleanup."""
        process = self._process
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout if timeout is not None else self.drain_seconds + 5)
                except subprocess.TimeoutExpired:
                    pass
            self._reap()
        if self._workdir is not None:
            # Keep our temporary log only when something went wrong.
            clean = self.returncode in (0, None) and self._own_log
            shutil.rmtree(self._workdir if clean else self._workdir / "backends", ignore_errors=True)
            self._workdir = None
        return self.returncode

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

    def _pump(self, process: subprocess.Popen) -> None:
        with open(self.log_file, "a", encoding="utf-8", errors="replace") as log:
            for raw in process.stdout:
                line = raw.decode("utf-8", "replace").rstrip()
                self._tail.append(line)
                log.write(line + "\n")
                log.flush()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
