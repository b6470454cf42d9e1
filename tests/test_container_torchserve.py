"""The container's TorchServe front (docker/compose.yaml's torchserve service, docker/k8s/torchserve.yaml): the files
agree with each other, with config.properties and with serve-repo's flags; and the container's command, mounts,
working directory and environment run here as the container runs them, in namespaces of their own (no docker engine
here): /ping through the health check, a prediction with the token, TorchServe's three ports and no other."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from server import cli
from server.errors import ServerError
from server.repo import GPU_FLAGS
from server.torchserve import flags
from server.torchserve.properties import settings
from server.wheel import ENV, make_backend_dir, pytriton_root
from support import ROOT
from test_container_files import DOCKER, TORCHSERVE_MANIFEST, _bytes, _kubernetes_errors, _stub_shm_bytes

CONFIG = DOCKER / "torchserve" / "config.properties"
PHOTO = ROOT / "clients" / "samples" / "chelsea.jpg"
NAME = "resnet-18"


def _service() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["torchserve"]


def _documents() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(TORCHSERVE_MANIFEST.read_text()) if doc}


def _pod() -> dict:
    return _documents()["Deployment"]["spec"]["template"]["spec"]


def _container() -> dict:
    (container,) = _pod()["containers"]
    return container


def _mounts() -> dict[str, tuple[str, bool]]:
    """compose's volumes: container path -> (host path, read-only)."""
    found = {}
    for volume in _service()["volumes"]:
        source, target, *mode = volume.rsplit(":", 2) if volume.endswith((":ro", ":rw")) else volume.rsplit(":", 1)
        found[target] = (source, mode == ["ro"])
    return found


def _dockerfile() -> tuple[dict[str, str], str]:
    """The Dockerfile's ENV values and its WORKDIR."""
    text = (DOCKER / "Dockerfile").read_text()
    env = dict(item.split("=", 1) for line in re.findall(r"^ENV (.+)$", text, re.M) for item in shlex.split(line))
    (workdir,) = re.findall(r"^WORKDIR (\S+)$", text, re.M)
    return env, workdir


def _option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_compose_and_k8s_run_one_torchserve_command_that_serve_repo_accepts_when_parsed():
    command = _service()["command"]
    assert command == _container()["args"]
    assert command[:3] == ["python3", "-m", "server.cli"]
    assert command[command.index("--") + 1:] == list(GPU_FLAGS)  # the triton service's pool and stub shm sizes
    argv = command[3:]
    args = cli.parser().parse_args(argv)
    assert args.torchserve_config and args.model_store  # TorchServe mode, and no flag it would refuse
    assert flags.refusal(cli.parser(), flags.given(cli.parser(), argv), args, True) is None


def test_torchserve_service_mounts_config_read_only_and_the_store_writable_when_parsed():
    command, mounts = _service()["command"], _mounts()
    config, store = _option(command, "--torchserve-config"), _option(command, "--model-store")
    assert mounts[config] == ("${TORCHSERVE_CONFIG:-./torchserve/config.properties}", True)
    assert mounts[store] == ("${MODEL_STORE:-../model_store}", False)  # the build cache is written in it
    assert (DOCKER / mounts[config][0].split(":-")[1].rstrip("}")).resolve() == CONFIG
    assert str(settings(CONFIG).model_store) == store
    # key_file.json is written in the working directory: the image's, the folder config.properties is mounted in
    assert str(Path(config).parent) == _dockerfile()[1]


def test_k8s_torchserve_mounts_the_configmap_and_a_writable_store_when_parsed():
    command, container, pod = _container()["args"], _container(), _pod()
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    config = mounts[_option(command, "--torchserve-config")]
    assert config["readOnly"] and config["subPath"] == "config.properties"
    configmap = _documents()["ConfigMap"]
    assert volumes[config["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
    assert configmap["data"]["config.properties"] == CONFIG.read_text()  # one file, shipped twice
    store = mounts[_option(command, "--model-store")]
    assert not store.get("readOnly") and not volumes[store["name"]]["persistentVolumeClaim"].get("readOnly")
    assert _documents()["Deployment"]["spec"]["strategy"]["type"] == "Recreate"  # one pod holds the volume
    assert _bytes(volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["sizeLimit"]) >= _stub_shm_bytes(command)
    assert _bytes(_service()["shm_size"]) >= _stub_shm_bytes(command)


def test_torchserve_ports_are_config_properties_everywhere_when_parsed():
    config = settings(CONFIG)
    ports = [config.inference[1], config.management[1], config.metrics[1], config.grpc_inference[1],
             config.grpc_management[1]]
    assert ports == [8080, 8081, 8082, 7070, 7071]
    assert {config.inference[0], config.management[0], config.metrics[0], config.grpc_inference[0],
            config.grpc_management[0]} == {"0.0.0.0"}  # reachable from outside
    assert _service()["ports"] == [f"{p}:{p}" for p in ports]
    exposed = re.findall(r"^EXPOSE (.+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert [int(p) for p in exposed[1].split()] == ports
    named = {p["name"]: p["containerPort"] for p in _container()["ports"]}
    assert named == dict(zip(("inference", "management", "metrics", "grpc-inference", "grpc-management"), ports))
    service = _documents()["Service"]["spec"]
    assert [(p["port"], p["targetPort"]) for p in service["ports"]] == list(zip(ports, named))
    assert service["selector"].items() <= _documents()["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    annotations = _documents()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(config.metrics[1])


def test_torchserve_health_checks_are_one_ping_command_when_parsed():
    ping = ["python3", "-m", "server.torchserve.ping", _option(_service()["command"], "--torchserve-config")]
    assert _service()["healthcheck"]["test"] == ["CMD", *ping]
    assert _container()["readinessProbe"]["exec"]["command"] == ping == _container()["startupProbe"]["exec"]["command"]
    # not /ping: it answers 500 while serve-repo replaces a dead stub's worker, which must not restart the pod
    assert _container()["livenessProbe"]["tcpSocket"]["port"] == "inference"


def test_torchserve_service_and_pod_get_one_gpu_when_parsed():
    (device,) = _service()["deploy"]["resources"]["reservations"]["devices"]
    assert (device["driver"], device["count"], device["capabilities"]) == ("nvidia", 1, ["gpu"])
    assert _container()["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert _service()["profiles"] == ["torchserve"]  # `docker compose up` alone starts the plain front only


def test_k8s_torchserve_manifest_is_refused_when_a_field_is_misspelled(tmp_path):
    broken = tmp_path / "torchserve.yaml"
    broken.write_text(TORCHSERVE_MANIFEST.read_text().replace("volumeMounts:", "volumeMount:"))
    (error,) = _kubernetes_errors(broken)
    assert error.startswith("Deployment spec.template.spec.containers.0:") and "'volumeMount'" in error


def test_dockerfile_runs_the_copied_code_on_the_images_tritonserver_when_read():
    env, _ = _dockerfile()
    assert env[ENV] == "/opt/tritonserver"  # NVIDIA's installation (server/wheel.py)
    copies = re.findall(r"^COPY (\w+) (\S+)$", (DOCKER / "Dockerfile").read_text(), re.M)
    assert {source for source, _ in copies} == {"common", "builder", "server", "backends"}
    assert all(target == f"{env['PYTHONPATH']}/{source}" for source, target in copies)


def test_container_requirements_cover_the_fronts_imports_when_read():
    pinned = set()
    for name in ("requirements-container.txt", "requirements-torchserve.txt"):
        for line in (DOCKER / name).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line and not line.startswith("-"):
                assert re.fullmatch(r"[\w.-]+(\[[\w,]+\])?==\d+(\.\d+)+(\+\w+)?", line), f"not an exact pin: {line}"
                pinned.add(re.split(r"[\[=]", line)[0].lower())
    imported = set()
    for room in ("common", "builder", "server"):
        for path in (ROOT / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module] if (
                    isinstance(node, ast.ImportFrom) and node.level == 0 and node.module) else []
                imported |= {name.split(".")[0] for name in names}
    distributions = {"PIL": "pillow", "onnxruntime": "onnxruntime-gpu", "yaml": "pyyaml", "google": "protobuf",
                     "grpc": "grpcio"}
    third_party = imported - set(sys.stdlib_module_names) - {"__future__", "common", "builder", "server", "backends"}
    assert {distributions.get(name, name) for name in third_party} <= pinned
    assert {"torchserve", "captum"} <= pinned  # the handler path's stubs import ts (and its vision handlers captum)


def _nvidia_layout(into: Path) -> Path:
    """A Triton installation laid out as NVIDIA's /opt/tritonserver (the stub beside the backend), of the wheel's files."""
    wheel = pytriton_root()
    python = into / "backends" / "python"
    python.mkdir(parents=True)
    (into / "bin").mkdir()
    (into / "bin" / "tritonserver").symlink_to(wheel / "bin" / "tritonserver")
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        (python / name).symlink_to(wheel / "backends" / "python" / name)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    (python / "triton_python_backend_stub").symlink_to(wheel / "python_backend_stubs" / version /
                                                       "triton_python_backend_stub")
    return into


def test_serve_repo_runs_the_named_installation_and_its_stub_when_the_variable_is_set(tmp_path, monkeypatch):
    root = _nvidia_layout(tmp_path / "tritonserver")
    monkeypatch.setenv(ENV, str(root))
    assert pytriton_root() == root
    backends = make_backend_dir(pytriton_root(), tmp_path / "b")
    assert (backends / "python" / "triton_python_backend_stub").resolve() == (
        root / "backends" / "python" / "triton_python_backend_stub").resolve()
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(ServerError, match=rf"\${ENV}=.*no tritonserver binary"):
        pytriton_root()


# Inside the namespaces: lo up; each folder the container shows (its mounts' parents, /opt's) made a tmpfs that still
# shows what this machine has there; the compose mounts bound at their container paths; the working directory.
_GRAFT = r'''
set -euo pipefail
ip link set lo up
graft() {  # $1 becomes a writable tmpfs that still shows its entries (a checkout under /home stays visible)
  local dir=$1 keep=$2 entry
  mkdir -p "$dir" "$keep" && mount --bind "$dir" "$keep" && mount -t tmpfs tmpfs "$dir"
  for entry in "$keep"/* "$keep"/.[!.]*; do
    [ -e "$entry" ] || continue
    if [ -d "$entry" ]; then mkdir "$dir/${entry##*/}"; else touch "$dir/${entry##*/}"; fi
    mount --bind "$entry" "$dir/${entry##*/}"
  done
}
bind() {  # host path -> container path (ro: read-only)
  mkdir -p "$(dirname "$2")"
  if [ -d "$1" ]; then mkdir -p "$2"; else touch "$2"; fi
  mount --bind "$1" "$2"
  if [ "$3" = ro ]; then mount -o remount,bind,ro "$2"; fi
}
'''


def _inside(pid: int, *command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`command` in the namespaces of the container's process `pid` (its network, its mounts), in its working
    directory (as `docker exec` and a probe run)."""
    return subprocess.run(["nsenter", "-t", str(pid), "-U", "-n", "-m", "--preserve-credentials", "--wd", *command],
                          capture_output=True, text=True, timeout=60, env=env)


def _listening(pid: int) -> set[int]:
    """The TCP ports listened on in the container's network namespace (IPv4 and IPv6)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in _inside(pid, "cat", table).stdout.splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture(scope="module")
def namespaces_work():
    done = subprocess.run(["unshare", "-rnm", "true"], capture_output=True, text=True)
    if done.returncode != 0 or not shutil.which("nsenter"):
        pytest.skip(f"no user/network/mount namespaces here (unshare -rnm: {done.stderr.strip()[:200]})")


def test_container_command_serves_ping_and_a_prediction_with_the_token_when_run_as_the_container_runs_it(
        tmp_path, namespaces_work):
    from perf import torchserve

    store = tmp_path / "model_store"  # MODEL_STORE: the host folder compose mounts
    torchserve.resnet_archive(store, NAME, None, None, None, arch="resnet18", fc_scale=0.01)
    env, workdir = _dockerfile()
    mounts = _mounts()
    hosts = {target: store if source.startswith("${MODEL_STORE") else CONFIG for target, (source, _) in mounts.items()}
    # The image's own folders: this checkout where the Dockerfile copies the packages, NVIDIA's layout of Triton.
    binds = [(ROOT, env["PYTHONPATH"], False), (_nvidia_layout(tmp_path / "tritonserver"), env[ENV], False),
             *((hosts[target], target, read_only) for target, (_, read_only) in mounts.items())]
    grafts = sorted({"/" + Path(target).parts[1] for _, target, _ in binds} | {"/" + Path(workdir).parts[1]})
    script = _GRAFT + "".join(f"graft {g} {tmp_path / 'keep'}{g}\n" for g in grafts) + "".join(
        f"bind {shlex.quote(str(src))} {shlex.quote(dst)} {'ro' if ro else 'rw'}\n" for src, dst, ro in binds) + (
        f"mkdir -p {workdir} && cd {workdir}\nexec \"$@\"\n")
    # The image's ENV; python3 is this venv's (the image's python3 has the requirements installed).
    container_env = {**os.environ, **env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = (tmp_path / "container.log").open("w")
    process = subprocess.Popen(["unshare", "-rnm", "bash", "-c", script, "container", *_service()["command"]],
                               stdout=log, stderr=subprocess.STDOUT, env=container_env)
    try:
        health = _service()["healthcheck"]["test"][1:]
        deadline = time.monotonic() + 240
        while (checked := _inside(process.pid, *health, env=container_env)).returncode != 0:
            assert process.poll() is None, f"the container's command exited: {(tmp_path / 'container.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not healthy: {checked.stderr}"
            time.sleep(1)
        # TorchServe's ports (REST and gRPC); Triton on Unix sockets only
        assert _listening(process.pid) == {8080, 8081, 8082, 7070, 7071}
        keys = json.loads(_inside(process.pid, "cat", f"{workdir}/key_file.json").stdout)

        def curl(url: str, *options: str) -> tuple[int, str]:
            done = _inside(process.pid, "curl", "-sS", "-w", "\n%{http_code}", *options, url)
            body, _, code = done.stdout.rpartition("\n")
            return int(code or 0), body

        assert curl("http://127.0.0.1:8080/ping")[0] == 400  # tokens on: /ping needs the inference key too
        bearer = ["-H", f"Authorization: Bearer {keys['inference']['key']}"]
        code, body = curl(f"http://127.0.0.1:8080/predictions/{NAME}", *bearer, "-H",
                          "Content-Type: application/octet-stream", "--data-binary", f"@{PHOTO}")
        assert code == 200, body
        top5 = json.loads(body)
        assert len(top5) == 5 and all(0 <= p <= 1 for p in top5.values())
        assert curl(f"http://127.0.0.1:8080/predictions/{NAME}", "-H", "Content-Type: application/octet-stream",
                    "--data-binary", "@/dev/null")[0] == 400  # no key
        big = tmp_path / "big"  # max_request_size=6553500: one byte more is refused
        big.write_bytes(b"\0" * (settings(CONFIG).max_request_size + 1))
        assert curl(f"http://127.0.0.1:8080/predictions/{NAME}", *bearer, "--data-binary", f"@{big}")[0] == 413
        assert curl("http://127.0.0.1:8082/metrics")[0] == 200  # the metrics API has no token, as TorchServe's
        assert list((store / ".triton" / "cache").iterdir())  # the build was cached in the mounted store
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
