"""docker/ and docker/k8s/ files, checked here (no docker engine, no GPU, no cluster on our machines)."""
import re
import subprocess

import pytest
import yaml

from conftest import ROOT

DOCKER = ROOT / "docker"


def _manifests() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DOCKER / "k8s" / "triton.yaml").read_text()) if d]
    return {doc["kind"]: doc for doc in docs}


def test_compose_reserves_a_gpu_and_mounts_the_repository_when_parsed():
    service = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["triton"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert sorted(p.split(":")[1] for p in service["ports"]) == ["8000", "8001", "8002"]
    assert "../model_repository:/models:ro" in service["volumes"]
    assert re.fullmatch(r"\d+[gm]b", service["shm_size"])
    assert "--model-repository=/models" in service["command"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"


def test_dockerfile_installs_the_pinned_requirements_when_built():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    tag = re.search(r"ARG TRITON_VERSION=(\d+\.\d+)", dockerfile).group(1)
    assert tag == "24.10"  # Triton 2.51: the server in nvidia-pytriton 0.7.0 that serve-repo runs
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3" in dockerfile
    assert "pip install --no-cache-dir -r /opt/triton-classifier/requirements.txt" in dockerfile
    assert "COPY docker/requirements-container.txt" in dockerfile


def test_container_requirements_are_pinned_for_cuda_12_when_read():
    lines = [line.split("#")[0].strip() for line in (DOCKER / "requirements-container.txt").read_text().splitlines()]
    pins = dict(line.split("==") for line in lines if line)
    assert set(pins) == {"torch", "torchvision", "onnxruntime-gpu", "numpy", "pillow"}
    assert all(re.fullmatch(r"\d+(\.\d+)+", version) for version in pins.values())
    # torchvision's minor is torch's minor + 15 (0.22 <-> 2.7): a mismatched pair cannot import.
    torch_minor, vision_minor = int(pins["torch"].split(".")[1]), int(pins["torchvision"].split(".")[1])
    assert vision_minor == torch_minor + 15
    assert int(pins["numpy"].split(".")[0]) < 2  # onnxruntime-gpu 1.20 is built against numpy 1.x


def test_k8s_manifests_agree_with_each_other_when_parsed():
    m = _manifests()
    assert set(m) == {"Deployment", "Service", "HorizontalPodAutoscaler"}
    for doc in m.values():
        assert doc["apiVersion"] and doc["metadata"]["name"] == "triton-classifier"
    pod_labels = m["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert m["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert m["Service"]["spec"]["selector"].items() <= pod_labels.items()
    container = m["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in m["Service"]["spec"]["ports"]} == ports == {8000, 8001, 8002}
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    target = m["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", m["Deployment"]["metadata"]["name"])


@pytest.mark.parametrize("script", ["test.sh", "run.sh"])
def test_docker_scripts_parse_when_checked_with_bash_n(script):
    result = subprocess.run(["bash", "-n", str(DOCKER / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
