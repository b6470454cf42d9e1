"""The archives of TorchServe's inference cases (test/postman/inference_data.json), made in a process of its own (the
examples' model files import sibling modules by bare name: fcn/ and deeplabv3/ each have their own
intermediate_layer_getter.py) as TorchServe's own tooling makes them: the eager ones as ts_scripts/mar_config.json
describes them, the `_scripted` ones as the examples' READMEs (torch.jit.script of the model, no model file). Weights:
seeded random (torch.manual_seed per archive), in place of the downloads.

    python -m tests.ts_inference_archives STORE TORCH_HOME [MODEL_NAME ...]

MODEL_NAMEs (mar_config.json's): the order to make them in (each eager archive, then its scripted one), the rest after.
Each archive is made in STORE/../staging and moved into STORE once whole: a test can register each as it comes.
TORCH_HOME gets seeded random checkpoints under the names torchvision downloads (hub/checkpoints/...): fast-rcnn's and
the segmenters' model files load pretrained backbones when they are constructed, by TorchServe's worker as by ours.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent / "torchserve_examples"
ARCHIVER = Path(sys.executable).with_name("torch-model-archiver")
# torch.jit.script of which torchvision model, for each `_scripted` archive (mnist's: the example's own Net)
SCRIPTED = {"squeezenet1_1": "squeezenet1_1", "alexnet": "alexnet", "resnet-18": "resnet18", "vgg16": "vgg16",
            "resnet-152-batch": "resnet152", "mnist": None, "fcn_resnet_101": "segmentation.fcn_resnet101",
            "deeplabv3_resnet_101_eager": "segmentation.deeplabv3_resnet101"}
# the archive file each row's URL names ({{mar_path_NAME}}: NAME.mar, as ts_scripts/marsgen.py names them)
EAGER_FILE = {"mnist": "mnist_v2"}
SCRIPTED_FILE = {"mnist": "mnist_scripted_v2", "deeplabv3_resnet_101_eager": "deeplabv3_resnet_101_scripted"}
# the backbones' checkpoints torchvision loads from TORCH_HOME (ResNet50/101 IMAGENET1K_V1)
CHECKPOINTS = {"resnet50-0676ba61.pth": "resnet50", "resnet101-63fe2227.pth": "resnet101"}
KITTEN = EXAMPLES / "kitten.jpg"
SEGMENTED = EXAMPLES / "image_segmenter" / "persons.jpg"


def local(path: str) -> Path:
    """A pytorch/serve path as copied here (examples/image_classifier/X at the top, other examples/X under X)."""
    path = path.removeprefix("../")
    for prefix in ("examples/image_classifier/", "examples/"):
        if path.startswith(prefix):
            return EXAMPLES / path.removeprefix(prefix)
    return EXAMPLES / path


def recipes() -> list[dict]:
    """mar_config.json's entries (SCRIPTED: the scripted archives made from them)."""
    return json.loads((EXAMPLES / "ts_scripts" / "mar_config.json").read_text())


def archive_names() -> list[str]:
    """The file names (without .mar) of the archives `build` makes."""
    names = []
    for recipe in recipes():
        name = recipe["model_name"]
        names.append(EAGER_FILE.get(name, name))
        if name in SCRIPTED:
            names.append(SCRIPTED_FILE.get(name, f"{name}_scripted"))
    return names


def _model_class(model_file: Path):
    """The one nn.Module class `model_file` defines, imported with its own folder's modules (not another's)."""
    for name in ("fcn", "deeplabv3", "intermediate_layer_getter", "model"):
        sys.modules.pop(name, None)
    sys.path.insert(0, str(model_file.parent))
    try:
        from common.model_code import import_model_class
        return import_model_class(model_file)
    finally:
        sys.path.remove(str(model_file.parent))


def _photo(path: Path, size: int):
    from PIL import Image
    from torchvision import transforms

    steps = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(size), transforms.ToTensor(),
                                transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    return steps(Image.open(path).convert("RGB")).unsqueeze(0)


def _spread(model, layer: str, photo: Path = KITTEN) -> None:
    """A random classifier's logits on the row's photo scaled (its last layer's weight and bias) to a standard deviation
    of 2: softmax's top 5 then neither one 1.0 and zeros nor five near-equal values (a tie's order is arithmetic noise);
    a segmenter's pixels then of several classes, their probabilities under 1."""
    import torch

    with torch.no_grad():
        logits = model.eval()(_photo(photo, 224))
        logits = logits["out"] if isinstance(logits, dict) else logits
        factor = 2.0 / float(logits.std())
        module = model.get_submodule(layer)
        module.weight.mul_(factor)
        module.bias.mul_(factor)


LAST_LAYER = {"squeezenet1_1": "classifier.1", "densenet161": "classifier", "alexnet": "classifier.6",
              "resnet-18": "fc", "vgg16": "classifier.6", "resnet-152-batch": "fc"}
# A random detector's class scores are ~1/91, under the handler's 0.5 threshold: its box predictor's class layer
# scaled so some boxes pass it and the answer has boxes, labels and scores to compare.
DETECTOR_SCALE = 40.0


def _archive(store: Path, name: str, serialized: Path, handler: str, model_file: Path | None,
             extra: list[Path]) -> None:
    """torch-model-archiver's NAME.mar, its entries stored (zip-store, a .mar as TorchServe reads it, made without
    deflating hundreds of MB of random weights that do not compress), moved into `store` once made."""
    staging = store.parent / "staging"
    staging.mkdir(exist_ok=True)
    argv = [str(ARCHIVER), "--model-name", name, "--version", "1.0", "--serialized-file", str(serialized),
            "--handler", handler, "--export-path", str(staging), "--archive-format", "zip-store", "--force"]
    if model_file is not None:
        argv += ["--model-file", str(model_file)]
    if extra:
        argv += ["--extra-files", ",".join(map(str, extra))]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    os.replace(staging / f"{name}.mar", store / f"{name}.mar")


def _checkpoints(torch_home: Path) -> None:
    import torch
    import torchvision

    checkpoints = torch_home / "hub" / "checkpoints"
    staging = torch_home / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    for file, arch in CHECKPOINTS.items():
        torch.manual_seed(0)
        torch.save(getattr(torchvision.models, arch)(weights=None).state_dict(), staging / file)
    checkpoints.parent.mkdir()
    staging.rename(checkpoints)


def build(store: Path, torch_home: Path, order: list[str] = ()) -> None:
    import torch
    import torchvision

    os.environ["TORCH_HOME"] = str(torch_home)  # before torchvision reads it (torch.hub.get_dir, at each load)
    src = store.parent / "src"
    src.mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)
    first = {name: index for index, name in enumerate(order)}
    for recipe in sorted(recipes(), key=lambda recipe: first.get(recipe["model_name"], len(first))):
        name = recipe["model_name"]
        model_file = local(recipe["model_file"])
        handler = recipe["handler"]
        handler = str(local(handler)) if handler.endswith(".py") else handler
        extra = [local(path) for path in recipe.get("extra_files", "").split(",") if path]
        if handler in ("object_detector", "image_segmenter") and not (torch_home / "hub").exists():
            _checkpoints(torch_home)  # before the first model file that loads one (the servers' too)
        torch.manual_seed(0)
        model = _model_class(model_file)().eval()
        if name in LAST_LAYER:
            _spread(model, LAST_LAYER[name])
        if handler == "image_segmenter":  # FCNHead's and DeepLabHead's last layer: a 1x1 convolution to the classes
            _spread(model, "classifier.4", SEGMENTED)
        if handler == "object_detector":
            with torch.no_grad():
                model.roi_heads.box_predictor.cls_score.weight.mul_(DETECTOR_SCALE)
        state = model.state_dict()
        weights = src / f"{name}.pth"
        torch.save(state, weights)
        _archive(store, EAGER_FILE.get(name, name), weights, handler, model_file, extra)
        del model
        if name not in SCRIPTED:
            continue
        arch = SCRIPTED[name]
        if arch is None:
            scripted = _model_class(model_file)()
        else:
            module = torchvision.models
            for part in arch.split("."):
                module = getattr(module, part)
            options = {"aux_loss": True} if arch.startswith("segmentation.") else {}
            scripted = module(weights=None, weights_backbone=None, **options) if options else module(weights=None)
        scripted.load_state_dict(state)
        serialized = src / f"{name}_scripted.pt"
        torch.jit.save(torch.jit.script(scripted.eval()), serialized)
        del scripted, state
        # vgg16's README archives its scripted model with its own handler; the others name image_classifier, or the
        # handler their eager archive has (mnist's, the segmenters')
        _archive(store, SCRIPTED_FILE.get(name, f"{name}_scripted"), serialized, handler, None,
                 [path for path in extra if path.name == "index_to_name.json"])
        serialized.unlink()
        weights.unlink()
    for leftover in src.glob("*.pth"):
        leftover.unlink()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
