"""`serve-repo`: run the real tritonserver bundled in the nvidia-pytriton wheel on a model repository."""
from __future__ import annotations

import argparse
import collections
import importlib.util
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
import urllib.request
from pathlib import Path

from builder.cliutil import OneLineParser


# Triton logs: failed to load 'resnet18' version 1: Internal: KeyError: ...\n\nAt: ...
_LOAD_FAILURE = re.compile(r"failed to load '([^']+)' version \d+: (.*)")
# What a CPU-only machine always logs; never the reason for a failure.
_HARMLESS = ("CudaDriverHelper", "NVML", "DCGM")


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


class TritonServer:
    """A tritonserver process: start() blocks until it is ready; stop() ends it and its stubs."""

    def __init__(self, repository, http_port=8000, grpc_port=8001, metrics_port=8002, host="127.0.0.1",
                 model_control="none", log_file=None, extra_args=()):
        self.repository = Path(repository).resolve()
        self.host = host
        self.ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
        self.model_control = model_control
        self.extra_args = list(extra_args)
        self._workdir: Path | None = None  # made by start(): backend symlinks and, by default, the log
        self._own_log = log_file is None
        self.log_file = Path(log_file) if log_file else None
        self._tail = collections.deque(maxlen=400)
        self._process: subprocess.Popen | None = None
        self.skipped: dict[str, str] = {}

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports['http']}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports['grpc']}"

    def command(self) -> list[str]:
        root = pytriton_root()
        backends = make_backend_dir(root, self._workdir / "backends")
        # Always explicit, loading what this server can run: the wheel has only the python backend,
        # so NAME_onnx / NAME_torchscript (for NVIDIA's container) would otherwise fail the start.
        cmd = [str(root / "bin" / "tritonserver"), f"--model-repository={self.repository}",
               f"--backend-directory={backends}", "--model-control-mode=explicit"]
        for api, port in self.ports.items():
            cmd += [f"--{api}-port={port}", f"--{api}-address={self.host}"]
        if self.model_control == "none":  # Triton's "none": no live (re)loading through the API
            key = secrets.token_hex(16)
            cmd += [f"--http-restricted-api=model-repository:triton-admin-key={key}",
                    f"--grpc-restricted-protocol=model-repository:triton-admin-key={key}"]
        loadable, self.skipped = servable_models(self.repository)
        cmd += [f"--load-model={name}" for name in loadable]
        if uses_gpu(self.repository):
            cmd += [flag for flag in GPU_FLAGS if flag.split("=")[0] not in _flag_names(self.extra_args)]
        return cmd + self.extra_args

    def start(self, timeout: float = 600) -> "TritonServer":
        if not self.repository.is_dir():
            raise ServerError(f"model repository {self.repository} does not exist (run build-repo first)")
        for api, port in self.ports.items():
            if not port_free(self.host, port):
                raise ServerError(f"{api} port {port} on {self.host} is busy; choose another with --{api}-port")
        self._workdir = Path(tempfile.mkdtemp(prefix="triton-serve-"))
        if self._own_log:
            self.log_file = self._workdir / "tritonserver.log"
        env = dict(os.environ)
        # The stub embeds the system libpython, which finds its prefix through the first `python3`
        # on PATH; putting this interpreter's bin/ first makes it see this venv's torch/torchvision.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        self._process = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        self._pump_thread = threading.Thread(target=self._pump, daemon=True)
        self._pump_thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                self._pump_thread.join(5)  # so reason() sees Triton's last words
                raise ServerError(f"tritonserver exited with status {self._process.returncode}: {self.reason()}")
            if self.ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"tritonserver not ready after {timeout:.0f}s: {self.reason()}")

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def reason(self) -> str:
        """Triton's own words for a failure: why each model failed to load, else its error lines."""
        lines = list(self._tail)
        failed = [m.group(1) + ": " + m.group(2).split("\\n")[0].strip()
                  for m in map(_LOAD_FAILURE.search, lines) if m]
        if failed:
            return "; ".join(dict.fromkeys(failed))
        errors = [line for line in lines if (line.startswith("E") or "error" in line.lower())
                  and not any(noise in line for noise in _HARMLESS)]
        return " | ".join(errors[-4:] or lines[-5:]) or "no output"

    def stop(self, timeout: float = 30) -> int | None:
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGINT)  # Triton's graceful shutdown unloads models, ends stubs
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # anything left in the server's session (a stuck stub) goes too
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()
        # Keep our temporary log only when something went wrong.
        clean = process.returncode == 0 and self._own_log
        shutil.rmtree(self._workdir if clean else self._workdir / "backends", ignore_errors=True)
        return process.returncode

    def _pump(self) -> None:
        process = self._process
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


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="serve-repo", description=__doc__)
    p.add_argument("--repository", type=Path, default=Path("model_repository"),
                   help="model repository to serve. Default: model_repository.")
    p.add_argument("--http-port", type=int, default=8000, help="Default: 8000.")
    p.add_argument("--grpc-port", type=int, default=8001, help="Default: 8001.")
    p.add_argument("--metrics-port", type=int, default=8002, help="Default: 8002.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind. Default: 127.0.0.1.")
    p.add_argument("--model-control", choices=("none", "explicit"), default="none",
                   help="explicit: models may be (re)loaded live through the repository API (clients.tune "
                        "uses it). The server always runs in Triton's explicit mode so that it can skip "
                        "models it has no backend for. Default: none.")
    p.add_argument("--log-file", type=Path, help="tritonserver's log. Default: a temporary file.")
    p.add_argument("--timeout", type=float, default=600, help="seconds to wait until ready. Default: 600.")
    p.add_argument("triton_args", nargs=argparse.REMAINDER, metavar="-- TRITONSERVER_FLAG ...",
                   help="flags passed to tritonserver unchanged, after `--` (e.g. -- --log-verbose=1 "
                        "--cuda-memory-pool-byte-size=0:1073741824). Default: none; a repository with GPU "
                        "models gets " + " ".join(GPU_FLAGS) + " unless the same flags are passed.")
    args = p.parse_args(argv)
    extra = args.triton_args[1:] if args.triton_args[:1] == ["--"] else args.triton_args
    server = TritonServer(args.repository, args.http_port, args.grpc_port, args.metrics_port, args.host,
                          args.model_control, args.log_file, extra)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start(args.timeout)
    except ServerError as exc:
        print(f"serve-repo: error: {exc}", file=sys.stderr)
        server.stop()
        return 1
    for name, why in server.skipped.items():
        print(f"skipped {name}: {why}", flush=True)
    print(f"tritonserver ready: HTTP {server.http_url}  gRPC {server.grpc_url}  "
          f"metrics http://{args.host}:{args.metrics_port}/metrics  log {server.log_file}", flush=True)
    while not stop.is_set() and server.running():
        stop.wait(1.0)
    died = not stop.is_set()
    status = server.stop()
    if died:
        print(f"serve-repo: error: tritonserver exited ({status}): {server.reason()}", file=sys.stderr)
        return 1
    print("tritonserver stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
