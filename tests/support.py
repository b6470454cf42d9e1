"""What the tests share besides fixtures: the models they build, in-process references, error measures."""
from __future__ import annotations

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
