"""What the tests share besides fixtures: the models they build, in-process references, error measures."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
import torchvision

from builder import cli as build_repo

ROOT = Path(__file__).resolve().parent.parent
SMALL = "resnet18"   # any model will do: ~10x cheaper than ResNet-152
LARGE = "resnet152"  # the model our users serve, kept in one end-to-end test
SEED = 0


def build(output: Path, *args: str, model: str = SMALL) -> None:
    """build-repo with seeded random weights on CPU instances, every other flag at its default (precision
    fp32: served rows are compared with eager torch within 1e-4; tests/test_openvino.py covers precision
    auto). Later args override these."""
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


def inferences(http_url: str, model: str, at_least: int = 0, timeout: float = 30.0) -> int:
    """Triton's `inference_count` of `model` once it has settled. Triton reports a request's statistics after
    its response has gone out (python_backend: when execute returns), so a count read just after an answer may
    still lack it: wait until the count is at least `at_least` and reads the same twice, 0.2 s apart."""
    import tritonclient.http as httpclient

    client, last, deadline = httpclient.InferenceServerClient(http_url), None, time.monotonic() + timeout
    while True:
        stats = client.get_inference_statistics(model)["model_stats"][0]
        count = int(stats.get("inference_count", 0))
        if (count >= at_least and count == last) or time.monotonic() > deadline:
            return count
        last = count
        time.sleep(0.2)
