"""The TorchServe seed's commands (docs: batch inference with ResNet-152) against serve-repo's TorchServe front in the
CPU image and on this machine outside it, with the same config.properties and archive: `curl localhost:8080/ping`,
`curl -X POST "localhost:8081/models?url=resnet-152-batch_v2.mar&batch_size=8&max_batch_delay=10&initial_workers=1"`,
`curl http://localhost:8080/predictions/resnet-152-batch_v2 -T kitten.jpg`. Used by tools/cpu_image.py.

The archive is built here as the example's README builds it (tests/torchserve_examples/resnet_152_batch: its model.py,
index_to_name.json, the image_classifier handler) with seeded random weights (the pretrained file cannot be downloaded
here), the last layer scaled down so that the top 5 are not one 1.0 and four 0.0 (random ResNet-152 logits are ~1e7).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tests" / "torchserve_examples" / "resnet_152_batch"
KITTEN = EXAMPLE / "images" / "kitten.jpg"
CONFIG = ROOT / "docker" / "torchserve" / "config.properties"
HOME = "/home/model-server"
# The seed's archive, and the same example with ResNet-18's layers (its model.py's one line changed): the test's, 10x
# cheaper to build and serve twice.
ARCHIVES = {"resnet152": "resnet-152-batch_v2", "resnet18": "resnet-18-batch"}
RESNET18 = "from torchvision.models.resnet import ResNet, BasicBlock\n\n\nclass ResNet18ImageClassifier(ResNet):\n" \
           "    def __init__(self):\n        super().__init__(BasicBlock, [2, 2, 2, 2])\n"


def register(name: str) -> str:
    return f"models?url={name}.mar&batch_size=8&max_batch_delay=10&initial_workers=1"


def make_archive(folder: Path, model: str = "resnet152") -> Path:
    """The example's archive by torch-model-archiver, with seeded weights, its last layer scaled by 1e-6."""
    import torch
    from common.model_code import import_model_class
    from examples.migrate_torchserve import run_archiver
    model_file = EXAMPLE / "model.py"
    if model == "resnet18":
        model_file = folder / "model.py"
        model_file.write_text(RESNET18)
    torch.manual_seed(0)
    network = import_model_class(model_file, None)()
    with torch.no_grad():
        network.fc.weight.mul_(1e-6)
        network.fc.bias.mul_(1e-6)
    torch.save(network.state_dict(), folder / "weights.pth")
    run_archiver("--model-name", ARCHIVES[model], "--version", "2.0", "--model-file", str(model_file),
                 "--serialized-file", str(folder / "weights.pth"), "--handler", "image_classifier",
                 "--extra-files", str(EXAMPLE / "index_to_name.json"), "--export-path", str(folder), timeout=600)
    return folder / f"{ARCHIVES[model]}.mar"


def config(store: str, ports: dict[str, int] | None) -> str:
    """docker/torchserve/config.properties as the seed's TorchServe runs: its model API on, no tokens (the seed's
    curls send none), nothing loaded at start (the seed registers it); outside, this machine's free ports on
    loopback instead of 8080-8082 and 7070/7071 on 0.0.0.0."""
    lines = []
    for line in CONFIG.read_text().splitlines():
        key = line.split("=")[0]
        if key in ("load_models", "disable_token_authorization", "model_store"):
            continue
        if ports and key.endswith("_address") and key.startswith(("inference", "management", "metrics")):
            line = f"{key}=http://127.0.0.1:{ports[key.split('_')[0]]}"
        elif ports and key.startswith("grpc_") and key.endswith("_address"):
            line = f"{key}=127.0.0.1"
        elif ports and key.startswith("grpc_") and key.endswith("_port"):
            line = f"{key}={ports[key]}"
        lines.append(line)
    return "\n".join([*lines, f"model_store={store}", "enable_model_api=true", "disable_token_authorization=true"]) + "\n"


def curl(*args: str, timeout: float = 900) -> tuple[int, str]:
    """curl as the seed runs it; (HTTP status, body)."""
    done = subprocess.run(["curl", "-s", "--max-time", str(int(timeout)), "-w", "\n%{http_code}", *args],
                          capture_output=True, text=True, timeout=timeout + 30)
    body, _, code = done.stdout.rpartition("\n")
    return int(code or 0), body


def seed_commands(inference: str, management: str, name: str, ready: float = 600) -> dict:
    """The seed's three commands (ping polled until the front is up, the prediction until its workers are);
    each answer with its status, and the seconds each took."""
    deadline = time.monotonic() + ready
    while (ping := curl(f"{inference}/ping", timeout=10))[0] != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{inference}/ping never answered 200: {ping}")
        time.sleep(2)
    start = time.monotonic()
    registered = curl("-X", "POST", f"{management}/{register(name)}")
    register_s = time.monotonic() - start
    while (predict := curl(f"{inference}/predictions/{name}", "-T", str(KITTEN)))[0] == 503:
        if time.monotonic() > deadline + ready:
            break
        time.sleep(2)
    return {"ping": ping, "register": registered, "register_s": round(register_s, 1), "predict": predict}


def _same(inside: dict, outside: dict, tolerance: float = 1e-6) -> bool:
    if inside["ping"] != outside["ping"] or inside["register"] != outside["register"]:
        return False
    if inside["predict"][0] != 200 or outside["predict"][0] != 200:
        return False
    a, b = json.loads(inside["predict"][1]), json.loads(outside["predict"][1])
    return list(a) == list(b) and all(abs(a[key] - b[key]) <= tolerance for key in a)


def _free_ports(count: int) -> list[int]:
    from common.procs import free_port
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        ports += [port] if port not in ports else []
    return ports


def inside(image: str, podman, limits: list[str], folder: Path, archive: Path) -> dict:
    """The image's TorchServe front (compose's torchserve command and mounts), its 8080/8081 published on loopback."""
    store = folder / "store-inside"
    store.mkdir()
    shutil.copy(archive, store)
    (folder / "inside.properties").write_text(config(f"{HOME}/model-store", None))
    name = f"cpu-image-torchserve-{os.getpid()}"
    # compose's health check for this service (the image's is Triton's); run once below with `podman healthcheck run`
    health = f"python3 -m server.torchserve.ping {HOME}/config.properties"
    subprocess.run(podman("run", "-d", "--name", name, *limits, "--health-cmd", health,
                          "-p", "127.0.0.1::8080", "-p", "127.0.0.1::8081",
                          "-v", f"{folder / 'inside.properties'}:{HOME}/config.properties:ro",
                          "-v", f"{store}:{HOME}/model-store", image, "python3", "-m", "server.cli",
                          "--torchserve-config", f"{HOME}/config.properties", "--model-store", f"{HOME}/model-store"),
                   check=True, stdout=subprocess.DEVNULL)
    try:
        def published(port: int) -> str:
            out = subprocess.run(podman("port", name, f"{port}/tcp"), capture_output=True, text=True, check=True)
            return "http://" + out.stdout.split()[0]
        answers = seed_commands(published(8080), published(8081), archive.stem)
        answers["healthcheck_rc"] = subprocess.run(podman("healthcheck", "run", name), capture_output=True).returncode
        return answers
    finally:
        logs = subprocess.run(podman("logs", "--tail", "15", name), capture_output=True, text=True)
        print("container log (last lines):", logs.stdout[-2500:], logs.stderr[-2500:], sep="\n", flush=True)
        subprocess.run(podman("rm", "-f", "-t", "10", name), capture_output=True)


def outside(folder: Path, archive: Path) -> dict:
    """serve-repo's TorchServe front on this machine, the same config.properties on free loopback ports."""
    store = folder / "store-outside"
    store.mkdir()
    shutil.copy(archive, store)
    inference, management, metrics, grpc_inference, grpc_management = _free_ports(5)
    (folder / "outside.properties").write_text(config(str(store), {
        "inference": inference, "management": management, "metrics": metrics,
        "grpc_inference_port": grpc_inference, "grpc_management_port": grpc_management}))
    work = folder / "outside-work"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(folder / "outside.log", "w") as log:
        front = subprocess.Popen([sys.executable, "-m", "server.cli", "--torchserve-config",
                                  str(folder / "outside.properties"), "--model-store", str(store)],
                                 cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        return seed_commands(f"http://127.0.0.1:{inference}", f"http://127.0.0.1:{management}", archive.stem)
    finally:
        front.terminate()
        try:
            front.wait(60)
        except subprocess.TimeoutExpired:
            front.kill()
            front.wait()


def compare(image: str, podman, limits: list[str], model: str = "resnet152") -> dict:
    with tempfile.TemporaryDirectory(prefix="cpu-image-torchserve-", dir="/var/tmp") as tmp:
        folder = Path(tmp)
        archive = make_archive(folder, model)
        found = {"inside": inside(image, podman, limits, folder, archive), "outside": outside(folder, archive)}
    found.update(archive=archive.name, same=_same(found["inside"], found["outside"]))
    for where in ("inside", "outside"):
        print(f"{where}:", json.dumps(found[where]), flush=True)
    return found
