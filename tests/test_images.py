"""Raw image bytes → NAME_image ensemble → top-k labels, equal to in-process torchvision; bad bytes isolated."""
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torchvision
import tritonclient.http as httpclient
from PIL import Image, ImageOps
from tritonclient.utils import InferenceServerException

from clients import classify
from support import SMALL, relative_error
from images import CAT, bad_images, good_images

WEIGHTS = torchvision.models.ResNet18_Weights.DEFAULT
IMAGE_MODEL = f"{SMALL}_image"


def _top(url: str, blobs: list[bytes], k: int = 5) -> list[list[tuple[float, int, str]]]:
    client = httpclient.InferenceServerClient(url)
    array = np.array([[b] for b in blobs], dtype=object)
    tensor = httpclient.InferInput("IMAGE_BYTES", list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    reply = client.infer(IMAGE_MODEL, [tensor], outputs=[httpclient.InferRequestedOutput("LOGITS", class_count=k)])
    rows = []
    for row in reply.as_numpy("LOGITS"):
        parsed = [item.decode().split(":", 2) for item in row]
        rows.append([(float(score), int(index), label) for score, index, label in parsed])
    return rows


def _expected_logits(model, image: Image.Image) -> np.ndarray:
    with torch.inference_mode():
        return model(WEIGHTS.transforms()(image).unsqueeze(0)).numpy()[0]


def _assert_matches(row, logits: np.ndarray) -> None:
    order = np.argsort(-logits)[:5]
    assert [index for _, index, _ in row] == order.tolist()
    assert [label for _, _, label in row] == [WEIGHTS.meta["categories"][i] for i in order]
    assert relative_error(np.array([score for score, _, _ in row]), logits[order]) <= 1e-4


def test_image_ensemble_returns_in_process_top5_when_sent_a_jpeg(server, small_model):
    row = _top(server.http_url, [CAT.read_bytes()])[0]
    _assert_matches(row, _expected_logits(small_model, Image.open(CAT).convert("RGB")))


@pytest.mark.parametrize("kind", list(good_images()))
def test_image_ensemble_serves_any_mode_when_image_is_unusual(server, small_model, kind):
    data = good_images()[kind]
    if kind == "16bit-png":  # built as 8-bit gray * 257: scaled back, it is that gray image exactly
        reference = Image.open(CAT).convert("L").convert("RGB")
    else:
        reference = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    _assert_matches(_top(server.http_url, [data])[0], _expected_logits(small_model, reference))
    if kind == "exif-rotated-jpeg":  # the orientation must have mattered for this check to mean anything
        unrotated = Image.open(io.BytesIO(data)).convert("RGB")
        assert not np.allclose(_expected_logits(small_model, unrotated), _expected_logits(small_model, reference))


def test_image_ensemble_answers_each_image_when_one_request_carries_several(server, small_model):
    blobs = [good_images()[k] for k in ("jpeg", "grayscale-png", "tiny-1x1-png")]
    rows = _top(server.http_url, blobs)
    assert len(rows) == 3
    for blob, row in zip(blobs, rows):
        _assert_matches(row, _expected_logits(small_model, Image.open(io.BytesIO(blob)).convert("RGB")))


@pytest.mark.parametrize("kind", list(bad_images()))
def test_bad_image_gets_its_own_error_when_batched_with_good_ones(server, small_model, kind):
    data, phrase = bad_images()[kind]
    good = CAT.read_bytes()
    expected = _expected_logits(small_model, Image.open(CAT).convert("RGB"))
    with ThreadPoolExecutor(5) as pool:
        neighbours = [pool.submit(_top, server.http_url, [good]) for _ in range(4)]
        bad = pool.submit(_top, server.http_url, [data])
        with pytest.raises(InferenceServerException, match=phrase):
            bad.result()
        for future in neighbours:
            _assert_matches(future.result()[0], expected)
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_server_ready() and client.is_model_ready(IMAGE_MODEL) and client.is_model_ready(SMALL)


def test_classify_raw_prints_top5_probabilities_like_torchserve_when_given_a_file(server, small_model, capsys):
    assert classify.main([str(CAT), "--raw", "--url", server.http_url, "--model", SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = _expected_logits(small_model, Image.open(CAT).convert("RGB"))
    probabilities = np.exp(expected - expected.max()) / np.exp(expected - expected.max()).sum()
    top = np.argsort(-expected)[:5]
    assert lines[0] == f"{CAT}:"
    assert [line.split('"')[1] for line in lines[1:]] == [WEIGHTS.meta["categories"][i] for i in top]
    served = [float(line.split(":")[1]) for line in lines[1:]]
    np.testing.assert_allclose(served, probabilities[top], atol=1e-5)


def test_curl_script_returns_top5_strings_when_posting_a_file(server, small_model):
    import json
    import subprocess

    from support import ROOT

    result = subprocess.run([str(ROOT / "clients" / "curl_classify.sh"), str(CAT), server.http_url, SMALL, "5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    strings = json.loads(result.stdout)["outputs"][0]["data"]
    row = [(float(s.split(":", 2)[0]), int(s.split(":", 2)[1]), s.split(":", 2)[2]) for s in strings]
    _assert_matches(row, _expected_logits(small_model, Image.open(CAT).convert("RGB")))
