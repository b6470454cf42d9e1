"""TorchServe's own examples (tests/torchserve_examples/, copied unchanged from pytorch/serve) served by Triton with
their handlers unchanged: archives made with torch-model-archiver as the examples' READMEs make them, answers
compared with the same archive run by TorchServe 0.12's own Python worker in-process (tests/ts_reference.py).

The examples' trained weights are not in the stored copy of pytorch/serve (mnist_cnn.pt) or need a download
(resnet152-394f9c45.pth): the weights here are random, seeded, saved as the examples' state dicts.
"""
from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from builder import cli as build_repo
from common.model_code import import_model_class
from examples.migrate_torchserve import run_archiver
from support import inferences

EXAMPLES = Path(__file__).resolve().parent / "torchserve_examples"
MNIST, RESNET = EXAMPLES / "mnist", EXAMPLES / "resnet_152_batch"
DIGITS = sorted((MNIST / "test_data").glob("*.png"))
PHOTOS = sorted((RESNET / "images").glob("*.jpg"))
ON_OPENVINO = "the handler's model runs on OpenVINO"


def _weights(model_file: Path, path: Path) -> Path:
    torch.manual_seed(0)
    torch.save(import_model_class(model_file, None)().state_dict(), path)
    return path


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    """mnist.mar and resnet-152-batch.mar, made as the examples' READMEs make them."""
    folder = tmp_path_factory.mktemp("ts-examples")
    run_archiver("--model-name", "mnist", "--version", "1.0", "--model-file", str(MNIST / "mnist.py"),
              "--serialized-file", str(_weights(MNIST / "mnist.py", folder / "mnist_cnn.pt")),
              "--handler", str(MNIST / "mnist_handler.py"), "--export-path", str(folder))
    run_archiver("--model-name", "resnet-152-batch", "--version", "1.0", "--model-file", str(RESNET / "model.py"),
              "--serialized-file", str(_weights(RESNET / "model.py", folder / "resnet152.pth")),
              "--handler", "image_classifier", "--extra-files", str(RESNET / "index_to_name.json"),
              "--export-path", str(folder), timeout=300)
    return {"mnist": folder / "mnist.mar", "resnet-152-batch": folder / "resnet-152-batch.mar"}


def _reference(archive: Path, files: list[Path]) -> list[dict]:
    """TorchServe 0.12's worker on each file, one request at a time (a process of its own: it imports the
    archive's modules by bare name, as the worker does)."""
    done = subprocess.run([sys.executable, "-m", "tests.ts_reference", str(archive), *map(str, files)],
                          check=True, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _send(url: str, model: str, bodies: list[bytes]) -> list[tuple[bytes, str]]:
    """All bodies at once, each its own request: Triton's batcher may put them in one handle() call."""
    def one(body: bytes):
        client = httpclient.InferenceServerClient(url)
        data = httpclient.InferInput("BODY", [1, 1], "BYTES")
        data.set_data_from_numpy(np.array([[body]], dtype=np.object_))
        result = client.infer(model, [data])
        return result.as_numpy("RESPONSE")[0][0], result.as_numpy("CONTENT_TYPE")[0][0].decode()

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def _wait_for(log: Path, text: str, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text(errors="replace") if log.exists() else ""
        if text in content:
            return content
        time.sleep(0.5)
    raise AssertionError(f"{text!r} not in the log after {timeout} s:\n{content[-3000:]}")


def _serve(archive: Path, tmp_path: Path, start_server, *flags: str):
    repo = tmp_path / "repo"
    assert build_repo.main(["--from-mar", str(archive), "--output", str(repo), "--kind", "cpu",
                            "--trust-model-code", *flags]) == 0
    log = tmp_path / "triton.log"
    return start_server(repo, log_file=log), log


def test_mnist_example_answers_as_torchserve_worker_on_its_digits_batched_and_on_openvino(archives, tmp_path,
                                                                                           start_server):
    server, log = _serve(archives["mnist"], tmp_path, start_server, "--max-batch-delay-ms", "500")
    bodies = [path.read_bytes() for path in DIGITS]
    first = _send(server.http_url, "mnist", bodies[:1])  # eager PyTorch; starts the conversion
    content = _wait_for(log, ON_OPENVINO)
    assert "[1, 1, 28, 28]" in content  # converted from the handler's own first batch: one 28x28 grey digit
    served = first + _send(server.http_url, "mnist", bodies[1:])
    expected = _reference(archives["mnist"], DIGITS)
    assert [ref["code"] for ref in expected] == [200] * len(DIGITS)
    assert [payload for payload, _ in served] == [base64.b64decode(ref["payload"]) for ref in expected]
    # no content type unless the handler set one: TorchServe's frontend then sends none (RestJob.responseInference)
    assert {content_type for _, content_type in served} == {""}
    # The nine digits sent together reached handle() in batches (Triton's batcher), yet each got its own answer.
    assert inferences(server.http_url, "mnist", len(DIGITS)) == len(DIGITS)  # once Triton has counted the last
    stats = httpclient.InferenceServerClient(server.http_url).get_inference_statistics("mnist")["model_stats"][0]
    assert stats["execution_count"] < len(DIGITS), stats


def test_resnet_152_batch_example_answers_as_torchserve_worker_with_eager_and_with_openvino(archives, tmp_path,
                                                                                            start_server):
    server, log = _serve(archives["resnet-152-batch"], tmp_path, start_server, "--handler-path")
    bodies = [path.read_bytes() for path in PHOTOS]
    eager = _send(server.http_url, "resnet-152-batch", bodies)  # the first batch: eager, starts the conversion
    _wait_for(log, ON_OPENVINO)
    converted = _send(server.http_url, "resnet-152-batch", bodies)
    expected = [json.loads(base64.b64decode(ref["payload"])) for ref in _reference(archives["resnet-152-batch"],
                                                                                    PHOTOS)]
    for answers in (eager, converted):
        got = [json.loads(payload) for payload, _ in answers]
        assert [list(g) for g in got] == [list(e) for e in expected]  # the same five labels, in the same order
        assert max(abs(g[k] - e[k]) for g, e in zip(got, expected) for k in e) < 1e-5, (got, expected)


SEGMENTER = '''import torch


class TinySegmenter(torch.nn.Module):  # torchvision's segmentation models answer {"out": N x K x H x W}
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x):
        return {"out": self.conv(x)}
'''
DETECTOR = '''import torch


class TinyDetector(torch.nn.Module):  # torchvision's detection models answer one dict per image
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 8)

    def forward(self, images):
        rows = []
        for image in images:
            out = self.fc(image.mean(dim=(1, 2)))
            boxes = out[:4].abs().cumsum(0).reshape(1, 4).repeat(2, 1) * 100
            rows.append({"boxes": boxes, "labels": torch.tensor([1, 2]), "scores": torch.sigmoid(out[4:6].abs() + 1)})
        return rows
'''


def _builtin_archive(folder: Path, name: str, handler: str, model_code: str, labels: bool) -> Path:
    (folder / f"{name}.py").write_text(model_code)
    argv = ["--model-name", name, "--version", "1.0", "--model-file", str(folder / f"{name}.py"),
            "--serialized-file", str(_weights(folder / f"{name}.py", folder / f"{name}.pth")),
            "--handler", handler, "--export-path", str(folder)]
    if labels:
        argv += ["--extra-files", str(RESNET / "index_to_name.json")]
    run_archiver(*argv)
    return folder / f"{name}.mar"


def _close(got, want) -> bool:
    """The same nested lists and dicts (keys, lengths, strings) with numbers within 1e-5."""
    if isinstance(want, dict):
        return isinstance(got, dict) and list(got) == list(want) and all(_close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and abs(got - want) <= 1e-5
    return got == want


def test_builtin_segmenter_and_detector_handlers_answer_as_torchserve_worker(tmp_path, start_server):
    """TorchServe's image_segmenter and object_detector handlers, their models answering dicts (OpenVINO does not
    take those: their own forward serves, as the log says)."""
    folder = tmp_path / "src"
    folder.mkdir()
    archives = {"segmenter": _builtin_archive(folder, "segmenter", "image_segmenter", SEGMENTER, False),
                "detector": _builtin_archive(folder, "detector", "object_detector", DETECTOR, True)}
    repo = tmp_path / "repo"
    for archive in archives.values():
        assert build_repo.main(["--from-mar", str(archive), "--output", str(repo), "--kind", "cpu",
                                "--trust-model-code"]) == 0
    server = start_server(repo, log_file=tmp_path / "triton.log")
    photos = PHOTOS[:2]
    for name, archive in archives.items():
        served = [json.loads(_send(server.http_url, name, [path.read_bytes()])[0][0]) for path in photos]
        expected = [json.loads(base64.b64decode(ref["payload"])) for ref in _reference(archive, photos)]
        assert _close(served, expected), name
    assert [sorted(key for key in box if key != "score") for box in served[0]] == [["goldfish"], ["great_white_shark"]]
    assert ON_OPENVINO not in (tmp_path / "triton.log").read_text()
