"""Shared fixtures: a repository built by build-repo and a real tritonserver serving it."""
from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision

from builder import cli as build_repo
from server.triton import TritonServer

ROOT = Path(__file__).resolve().parent.parent
SMALL = "resnet18"   # any model will do: ~10x cheaper than ResNet-152
LARGE = "resnet152"  # the model our users serve, kept in one end-to-end test
SEED = 0


def build(output: Path, *args: str, model: str = SMALL) -> None:
    argv = ["--model", model, "--weights", "random", "--seed", str(SEED), "--output", str(output),
            "--kind", "cpu", *args]
    assert build_repo.main(argv) == 0, f"build-repo {' '.join(argv)} failed"


def reference_model(name: str = SMALL, seed: int = SEED) -> torch.nn.Module:
    """What `--weights random --seed SEED` promises: manual_seed, then get_model(weights=None)."""
    torch.manual_seed(seed)
    return torchvision.models.get_model(name, weights=None).eval()


def reference_logits(model: torch.nn.Module, images: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(images)).numpy()


def relative_error(served: np.ndarray, expected: np.ndarray) -> float:
    """Largest deviation relative to the output's scale (elementwise ratios explode near zero)."""
    return float(np.abs(served - expected).max() / np.abs(expected).max())


@pytest.fixture(scope="session")
def repository(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("repo") / "model_repository"
    build(repo, "--max-batch-size", "8", "--max-queue-delay-us", "2000")
    build(repo, "--max-batch-size", "8", model=LARGE)
    return repo


@pytest.fixture(scope="session")
def server(repository):
    """A real tritonserver on free local ports, or the external one named by TRITON_URL."""
    external = os.environ.get("TRITON_URL")
    if external:
        yield SimpleNamespace(http_url=external, grpc_url=os.environ.get("TRITON_GRPC_URL", ""))
        return
    with TritonServer.local(repository) as running:
        yield running


@pytest.fixture
def start_server():
    """start_server(repository, **options): a real tritonserver on free local ports, ready; every server
    a test starts this way is stopped when the test ends, whatever happens in it."""
    started = []

    def start(repository, **options) -> TritonServer:
        server = TritonServer.local(repository, **options)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def small_model() -> torch.nn.Module:
    return reference_model(SMALL)
