"""A supervised serve-repo (`python -m server.cli`) started as a user starts it, on free ports, for the drills
and tests: its output collected line by line, waited on, its tritonserver found, stopped with SIGTERM."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from common.procs import free_port

ROOT = Path(__file__).resolve().parent.parent


class ServeRepo:
    """`python -m server.cli` as a user runs it, on free ports, its output collected line by line."""

    def __init__(self, repository: Path, *flags: str, timeout: float = 600, ports: list[int] | None = None):
        import tritonclient.http as httpclient

        # `ports`: those of a serve-repo that just stopped, as a process manager restarts it.
        self.ports = list(ports) if ports else [free_port() for _ in range(3)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "--repository", str(repository),
             "--http-port", str(self.ports[0]), "--grpc-port", str(self.ports[1]),
             "--metrics-port", str(self.ports[2]), *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        # "tritonserver ready: HTTP ..." or, with the proxy in front, "proxy ready: HTTP ...".
        self.ready_line = self.wait_for(" ready: HTTP", timeout)
        self.proxied = self.ready_line.startswith("proxy ready")
        self.http = httpclient.InferenceServerClient(f"127.0.0.1:{self.ports[0]}")

    def _pump(self):
        for line in self.process.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout: float, after: int = 0) -> str:
        """The newest output line containing `text` (among lines[after:]), waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.lines[after:] if text in line]
            if found:
                return found[-1]
            if self.process.poll() is not None:
                time.sleep(0.5)  # let the pump collect the last words
                raise AssertionError(f"serve-repo exited ({self.process.returncode}): {self.lines[-10:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} from serve-repo within {timeout}s: {self.lines[-10:]}")

    def seen(self, text: str, after: int = 0) -> bool:
        return any(text in line for line in self.lines[after:])

    @property
    def triton_pid(self) -> int:
        try:
            pids = [child.pid for child in psutil.Process(self.process.pid).children() if child.name() == "tritonserver"]
        except psutil.Error:
            pids = []
        if len(pids) != 1:
            raise AssertionError(f"serve-repo should have one tritonserver child: {pids}")
        return pids[0]

    @property
    def private_ports(self) -> tuple[int, int]:
        """Triton's own HTTP and gRPC ports behind the proxy, as serve-repo's ready line names them."""
        found = re.search(r"tritonserver on 127\.0\.0\.1:(\d+)/(\d+)", self.ready_line)
        if not found:
            raise AssertionError(f"no private ports in {self.ready_line!r}")
        return int(found.group(1)), int(found.group(2))

    @property
    def triton_url(self) -> str:
        """tritonserver's HTTP address behind the TorchServe API ("unix:PATH", what server.unix_http's clients take),
        as its ready line names it."""
        found = re.search(r"tritonserver on (\S+),", self.ready_line)
        if not found:
            raise AssertionError(f"no tritonserver address in {self.ready_line!r}")
        return found.group(1)

    @property
    def triton_log(self) -> Path:
        """tritonserver's log file, as the TorchServe API's ready line names it."""
        found = re.search(r"log (\S+)\)", self.ready_line)
        if not found:
            raise AssertionError(f"no tritonserver log in {self.ready_line!r}")
        return Path(found.group(1))

    @property
    def overload_limits(self) -> dict:
        """The proxy's overload bounds as serve-repo's ready line names them: {"max_in_flight": N, "queue_ms": MS}."""
        found = re.search(r"max-in-flight (\d+)  queue-ms (\d+)", self.ready_line)
        if not found:
            raise AssertionError(f"no overload limits in {self.ready_line!r}")
        return {"max_in_flight": int(found.group(1)), "queue_ms": int(found.group(2))}

    def stop(self):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


class TorchServeFront(ServeRepo):
    """`python -m server.cli --torchserve-config FILE` as a TorchServe user starts it: FILE is written with free
    inference, management, metrics and gRPC ports (grpc_ports) and `properties` (model_store=..., load_models=...).
    `config=False`: no config file (TorchServe's rule: the newest snapshot in FOLDER/logs/config is the
    configuration), `ports` those it names (a stopped front's)."""

    def __init__(self, folder: Path, *flags: str, timeout: float = 600, config: bool = True,
                 ports: list[int] | None = None, **properties: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.ports = list(ports) if ports else [free_port() for _ in range(3)]
        self.inference_url, self.management_url, self.metrics_url = (f"http://127.0.0.1:{p}" for p in self.ports)
        addresses = {"inference_address": self.inference_url, "management_address": self.management_url,
                     "metrics_address": self.metrics_url}
        # its gRPC ports too (7070/7071 by default, as TorchServe's): free ones, unless `properties` names them
        self.grpc_ports = [int(properties.get(f"grpc_{api}_port") or free_port())
                           for api in ("inference", "management")]
        addresses.update(grpc_inference_port=str(self.grpc_ports[0]), grpc_management_port=str(self.grpc_ports[1]))
        self.config = folder / "config.properties"
        if config:
            self.config.write_text("".join(f"{k}={v}\n" for k, v in {**addresses, **properties}.items()))
        self.started = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-m", "server.cli",
                                         *(["--torchserve-config", str(self.config)] if config else []), *flags],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        cwd=folder, env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.lines = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready_line = self.wait_for("torchserve API ready", timeout)
        self.took = time.monotonic() - self.started  # seconds to ready: its start, restoring its models included
