"""TorchServe 0.12 as its users run it: a ResNet-152 .mar (model file + state_dict), one torchserve started and stopped."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common.procs import free_port, pid_alive

# TorchServe's eager convention, as its resnet_152_batch example ships it: a module class whose
# constructor takes no argument; the archive's serialized file is that module's state_dict.
MODEL_CODE = {
    "resnet152": ("Bottleneck", [3, 8, 36, 3]),
    "resnet50": ("Bottleneck", [3, 4, 6, 3]),
    "resnet18": ("BasicBlock", [2, 2, 2, 2]),
}


def model_code(arch: str) -> str:
    block, layers = MODEL_CODE[arch]
    return (f'"""{arch} in TorchServe\'s eager convention (its resnet_152_batch example\'s model.py)."""\n'
            f"from torchvision.models.resnet import {block}, ResNet\n\n\n"
            f"class ImageClassifier(ResNet):\n    def __init__(self):\n"
            f"        super().__init__({block}, {layers})\n")


class TorchServeError(RuntimeError):
    """TorchServe or java is missing, the archive could not be made, or the model never became ready."""


def executables() -> dict[str, str]:
    """The torchserve, torch-model-archiver and java commands, or an error naming the one missing."""
    found = {}
    for name in ("torchserve", "torch-model-archiver"):
        beside = Path(sys.executable).with_name(name)  # the venv's own, even when the venv is not activated
        found[name] = str(beside) if beside.is_file() else shutil.which(name)
        if not found[name]:
            raise TorchServeError(f"{name} not found: pip install -e '.[torchserve]' (TorchServe 0.12)")
    # torchserve's launcher runs $JAVA_HOME/bin/java, else java on PATH: check the same one.
    java_home = os.environ.get("JAVA_HOME")
    found["java"] = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not found["java"] or not Path(found["java"]).is_file():
        raise TorchServeError("java not found (TorchServe's frontend needs Java 17+): install a JDK or set JAVA_HOME")
    return found


def imagenet_labels() -> dict[str, list[str]]:
    """index_to_name.json as TorchServe's ImageNet examples ship it: {"0": ["n00000000", "tench"], ...}."""
    import torchvision

    names = torchvision.models.ResNet152_Weights.IMAGENET1K_V2.meta["categories"]
    return {str(i): [f"n{i:08d}", name.replace(" ", "_")] for i, name in enumerate(names)}


def resnet_archive(store: Path, name: str, batch_size: int | None, delay_ms: int | None, workers: int | None,
                   seed: int = 0, arch: str = "resnet152", fc_scale: float = 1.0, version: str = "1.0",
                   scripted: bool = False) -> Path:
    """<store>/<name>.mar: the weights `build-repo --model ARCH --weights random --seed SEED` serves (the last layer
    scaled by `fc_scale`: a random ResNet's logits are so large that its softmax is one 1.0 and zeros); its
    model-config.yaml holds the batching and workers given (None: left to the registration). `scripted`: as
    TorchServe's `_scripted` examples, torch.jit.script of the model as the serialized file and no model file."""
    import torch
    import torchvision

    torch.manual_seed(seed)
    state = getattr(torchvision.models, arch)(weights=None).state_dict()
    state["fc.weight"] *= fc_scale
    state["fc.bias"] *= fc_scale
    src = store.parent / f"{name}-src"
    src.mkdir(parents=True, exist_ok=True)
    if scripted:
        model = getattr(torchvision.models, arch)(weights=None)
        model.load_state_dict(state)
        torch.jit.save(torch.jit.script(model.eval()), src / "model.pt")
    else:
        (src / "model.py").write_text(model_code(arch))
        torch.save(state, src / "weights.pth")
    (src / "index_to_name.json").write_text(json.dumps(imagenet_labels()))
    settings = {"minWorkers": workers, "maxWorkers": workers, "batchSize": batch_size, "maxBatchDelay": delay_ms}
    lines = "".join(f"{k}: {v}\n" for k, v in settings.items() if v is not None)
    (src / "model-config.yaml").write_text(lines)
    argv = [executables()["torch-model-archiver"], "--model-name", name, "--version", version,
            *([] if scripted else ["--model-file", str(src / "model.py")]),
            "--serialized-file", str(src / ("model.pt" if scripted else "weights.pth")),
            "--handler", "image_classifier", "--extra-files", str(src / "index_to_name.json"),
            *(["--config-file", str(src / "model-config.yaml")] if lines else []), "--export-path", str(store),
            "--force"]
    store.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise TorchServeError(f"torch-model-archiver failed: {(done.stderr or done.stdout).strip()[-300:]}")
    return store / f"{name}.mar"


def _get_json(url: str, timeout: float = 5, token: str | None = None):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


@dataclass
class TorchServe:
    """A running torchserve: its addresses, the frontend's pid, and its own folder (logs, sockets, pid file)."""

    folder: Path
    model: str
    inference_url: str
    management_url: str
    pid: int | None = None
    token_auth: bool = False
    grpc_inference: str = ""  # host:port of its gRPC inference API

    def key(self, api: str) -> str | None:
        """The token of `api` (inference, management) from the key_file.json it wrote; None with tokens off."""
        if not self.token_auth:
            return None
        return json.loads((self.folder / "key_file.json").read_text())[api]["key"]

    def env(self) -> dict[str, str]:
        # The launcher keeps its pid file in tempfile's folder and the frontend its worker sockets in
        # java.io.tmpdir (from TEMP): both go to our folder, so another torchserve on this machine is
        # neither seen as "already running" nor stopped by our --stop. Logs go there too.
        tmp = str(self.folder / "tmp")
        return {**os.environ, "TMPDIR": tmp, "TEMP": tmp, "LOG_LOCATION": str(self.folder / "logs"),
                "METRICS_LOCATION": str(self.folder / "logs")}

    def describe(self) -> dict:
        """The management API's view of the model (batchSize, maxBatchDelay, workers)."""
        return _get_json(f"{self.management_url}/models/{self.model}", token=self.key("management"))[0]

    def log_tail(self, chars: int = 600) -> str:
        log = self.folder / "logs" / "ts_log.log"
        return log.read_text(errors="replace")[-chars:] if log.is_file() else "(no ts_log.log)"

    def worker_error(self) -> str | None:
        """The worker's last error line once it has died twice: TorchServe would restart it forever."""
        ts_log, model_log = self.folder / "logs" / "ts_log.log", self.folder / "logs" / "model_log.log"
        if not ts_log.is_file() or ts_log.read_text(errors="replace").count("Load model failed") < 2:
            return None
        lines = model_log.read_text(errors="replace").splitlines() if model_log.is_file() else []
        errors = [line.split("MODEL_LOG -", 1)[-1].strip() for line in lines if "Error" in line]
        return errors[-1] if errors else "see ts_log.log"

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pid is not None and not pid_alive(self.pid):
                raise TorchServeError(f"torchserve exited while loading the model: {self.log_tail()}")
            if error := self.worker_error():
                raise TorchServeError(f"TorchServe's worker for {self.model} fails to load it: {error}")
            try:
                described = self.describe()
                if any(w.get("status") == "READY" for w in described.get("workers", [])):
                    return described
            except (urllib.error.URLError, OSError, ValueError, IndexError):
                pass  # the frontend is not listening yet, or the model is not registered yet
            time.sleep(1)
        raise TorchServeError(f"no READY worker for {self.model} after {timeout:.0f} s: {self.log_tail()}")

    def wait_pinged(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                _get_json(f"{self.inference_url}/ping", token=self.key("inference"))
                return
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                time.sleep(0.5)
        raise TorchServeError(f"torchserve did not answer /ping after {timeout:.0f} s: {self.log_tail()}")

    def _pids(self) -> list[int]:
        """The frontend and its python workers, read now, to end by pid whatever --stop leaves."""
        try:
            import psutil  # a torchserve dependency

            frontend = psutil.Process(self.pid)
            return [self.pid] + [child.pid for child in frontend.children(recursive=True)]
        except Exception:
            return [self.pid] if self.pid else []

    def stop(self, commands: dict[str, str]) -> None:
        pids = self._pids()
        subprocess.run([commands["torchserve"], "--stop"], env=self.env(), cwd=self.folder,
                       capture_output=True, timeout=120)
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            alive = [pid for pid in pids if pid_alive(pid)]
            for pid in alive:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while alive and time.monotonic() < deadline and any(pid_alive(pid) for pid in alive):
                time.sleep(0.2)


@contextmanager
def started(folder: Path, archive: Path | None, workers: int | None, timeout: float = 600, properties: dict | None = None,
            store: Path | None = None, snapshots: bool = False, token_auth: bool = False):
    """torchserve --start with `archive` registered, ready; stopped (and its pids ended) on exit. `properties`: more
    config.properties lines (enable_model_api=true, ...). archive None: no model, `store` the model store, ready
    once /ping answers. `snapshots`: without --ncs, its config snapshots written to FOLDER/logs/config. token_auth:
    its tokens on (key_file.json in `folder`, server.key(api))."""
    commands = executables()
    ports = [free_port() for _ in range(5)]
    server = TorchServe(folder, archive.stem if archive else "", f"http://127.0.0.1:{ports[0]}",
                        f"http://127.0.0.1:{ports[1]}", token_auth=token_auth, grpc_inference=f"127.0.0.1:{ports[3]}")
    for sub in ("tmp", "logs"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    config = folder / "config.properties"
    config.write_text("\n".join([
        f"inference_address={server.inference_url}", f"management_address={server.management_url}",
        f"metrics_address=http://127.0.0.1:{ports[2]}",
        *([f"default_workers_per_model={workers}"] if workers is not None else []),
        # its gRPC ports too (7070/7071 by default): a second torchserve on the machine would stop this one
        f"grpc_inference_port={ports[3]}", f"grpc_management_port={ports[4]}",
        "install_py_dep_per_model=false", f"disable_token_authorization={str(not token_auth).lower()}",
        *(f"{key}={value}" for key, value in (properties or {}).items()), ""]))
    launch = [commands["torchserve"], "--start", *([] if snapshots else ["--ncs"]),
              *([] if token_auth else ["--disable-token-auth"]), "--ts-config", str(config),
              "--model-store", str(archive.parent if archive else store),
              *(["--models", f"{archive.stem}={archive.name}"] if archive else [])]
    with open(folder / "logs" / "launcher.log", "ab") as sink:
        # The launcher starts the java frontend and returns; the frontend's pid is in its pid file.
        subprocess.run(launch, env=server.env(), cwd=folder, stdout=sink, stderr=subprocess.STDOUT, timeout=120)
    pid_file = folder / "tmp" / ".model_server.pid"
    server.pid = int(pid_file.read_text().strip()) if pid_file.is_file() else None
    try:
        if server.pid is None:
            raise TorchServeError(f"torchserve did not start: {(folder / 'logs' / 'launcher.log').read_text()[-300:]}")
        server.wait_ready(timeout) if archive else server.wait_pinged(timeout)
        yield server
    finally:
        server.stop(commands)
