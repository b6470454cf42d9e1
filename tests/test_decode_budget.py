"""The tensor path decodes in chunks under a memory budget, and both models that decode take their bounds
from the same config parameters (shown on CPU with torchvision's decoder behind a recording fake)."""
import json

import pytest
import torch
import torchvision
from PIL import Image

from backends import classifier, preprocess
from common.decoding import DEFAULT_MAX_PIXELS, decode
from backends.fused import TritonPythonModel as Fused
from backends.preprocess import Preprocessor, decode_chunks, preprocessor_for
from backends.stage_clock import StageClock
from images import cat, encode

TRANSFORM = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
CPU = torch.device("cpu")


def _jpeg(side: int) -> bytes:
    return encode(cat().resize((side, side)), "JPEG", quality=90)


@pytest.fixture
def batches(monkeypatch):
    """The sizes of the lists decode_jpeg is given (1 for a single tensor); a blob ending in b"refuse" fails."""
    sizes, real = [], preprocess.decode_jpeg

    def fake(data, **kwargs):
        tensors = data if isinstance(data, list) else [data]
        sizes.append(len(tensors))
        if any(bytes(t[-6:].tolist()) == b"refuse" for t in tensors):
            raise RuntimeError("nvJPEG refused it")
        return real(data, **kwargs)

    monkeypatch.setattr(preprocess, "decode_jpeg", fake)
    return sizes


@pytest.mark.parametrize("pixels, budget, chunks", [
    ([10, 10, 10], 90, [[0, 1, 2]]),
    ([10, 10, 10, 10], 60, [[0, 1], [2, 3]]),
    ([10, 50, 10, 10], 60, [[0], [1], [2, 3]]),  # 50 x 3 B > 60 B: alone
    ([], 60, []),
])
def test_decode_chunks_keeps_each_chunk_within_budget_when_images_vary(pixels, budget, chunks):
    assert decode_chunks(pixels, budget) == chunks


def test_preprocessor_decodes_in_chunks_under_budget_when_batch_is_large(batches):
    small, big = _jpeg(100), _jpeg(200)  # 30,000 and 120,000 bytes of RGB
    elements = [small, small, big, small, small, small, small]
    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=True, decode_budget=100_000)
    results = pre(elements)
    assert batches == [2, 1, 3, 1]
    for data, result in zip(elements, results):
        assert torch.equal(result, Preprocessor(TRANSFORM, CPU, tensor_decode=True)([data])[0])


def test_preprocessor_decodes_a_failed_chunk_one_by_one_and_the_refused_one_with_pil_when_one_fails(batches):
    small = _jpeg(100)
    refused = small + b"refuse"  # after EOI: PIL and the end scan ignore it, the fake decoder does not
    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=True, decode_budget=100_000)
    results = pre([small, small, small, refused, small])
    assert batches == [3, 2, 1, 1]  # the first chunk in one call; the second failed, then one by one
    assert torch.equal(results[3], TRANSFORM(decode(refused)))
    assert all(isinstance(r, torch.Tensor) and r.shape == (3, 224, 224) for r in results)


def test_preprocessor_for_reads_budget_and_bound_when_parameters_set_them(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    pre = preprocessor_for({"max_pixels": "777", "gpu_decode_budget_mb": "2"}, TRANSFORM, CPU, tensor_decode=False)
    assert pre.decode_budget == 2 * 2**20 and Image.MAX_IMAGE_PIXELS == 777
    pre = preprocessor_for({}, TRANSFORM, CPU, tensor_decode=False)
    assert pre.decode_budget == preprocess.DEFAULT_GPU_DECODE_BUDGET_MB * 2**20
    assert Image.MAX_IMAGE_PIXELS == DEFAULT_MAX_PIXELS


@pytest.mark.parametrize("params, bound", [({}, DEFAULT_MAX_PIXELS), ({"max_pixels": "4321"}, 4321)])
def test_fused_initialize_sets_pil_pixel_bound_when_loaded(monkeypatch, params, bound):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1)  # restored after the test
    # The classifier's own initialize needs an engine and weights; its device and clock are all the fused model reads.
    monkeypatch.setattr(classifier.TritonPythonModel, "initialize",
                        lambda self, args: self.__dict__.update(device=CPU, clock=StageClock()))
    strings = {"crop_size": "224", "resize_size": "232", "mean": "0.485,0.456,0.406", "std": "0.229,0.224,0.225",
               **params}
    config = {"max_batch_size": 8, "parameters": {k: {"string_value": v} for k, v in strings.items()}}
    Fused().initialize({"model_config": json.dumps(config)})
    assert Image.MAX_IMAGE_PIXELS == bound


def test_preprocessor_transforms_each_group_of_same_size_images_in_one_call_when_sizes_repeat():
    """One transform call per size (one resize kernel for the group), each image's result what it gets alone."""
    calls = []

    def recording(batch):
        calls.append(tuple(batch.shape))
        return TRANSFORM(batch)

    small, big = _jpeg(100), _jpeg(200)
    elements = [small, big, small, b"not an image", small, big]
    results = Preprocessor(recording, CPU, tensor_decode=True)(elements)
    assert sorted(calls) == sorted([(3, 3, 100, 100), (2, 3, 200, 200)])
    alone = Preprocessor(TRANSFORM, CPU, tensor_decode=True)
    for data, result in zip(elements, results):
        if data == b"not an image":
            assert not isinstance(result, torch.Tensor)
        else:
            assert torch.equal(result, alone([data])[0])


def test_preprocessor_transforms_one_by_one_when_a_groups_batched_call_fails():
    def batch_refused(image):
        if image.dim() == 4:
            raise RuntimeError("this transform takes one image")
        return TRANSFORM(image)

    small = _jpeg(100)
    results = Preprocessor(batch_refused, CPU, tensor_decode=True)([small, small, small])
    expected = Preprocessor(TRANSFORM, CPU, tensor_decode=True)([small])[0]
    assert all(torch.equal(result, expected) for result in results)
