"""NAME_preprocess's tensor path (nvJPEG on a GPU, torchvision's decoder on CPU here) vs its PIL path."""

import pytest
import torch
import torchvision
from PIL import Image

from common.decoding import ImageError, decode
from backends.preprocess import Preprocessor
from images import CAT, bad_images, good_images
from perf.samples import sample_jpegs
from support import reference_model

TRANSFORM = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
CPU = torch.device("cpu")
# Tensor path vs PIL path in normalized units (one uint8 level is 1/255/std ~= 0.0175). Measured on
# perf.samples' JPEGs with torchvision's CPU decoder: max 0.0175, mean 0.0015-0.0032 (both paths round the
# resized image to uint8 and differ by one level where their resizers round differently). nvJPEG's
# IDCT is not bit-exact with libjpeg-turbo: on the H100, nvJPEG vs PIL measured max 0.157, mean
# 0.0016-0.0069 on the same JPEGs (perf/results/gpu-preprocess-parity.json), top-1 unchanged.
MAX_ABS_DIFF, MEAN_ABS_DIFF = 0.02, 0.005
GPU_MAX_ABS_DIFF, GPU_MEAN_ABS_DIFF = 0.25, 0.02


def _pil_reference(data: bytes) -> torch.Tensor:
    return TRANSFORM(decode(data))


@pytest.mark.parametrize("name", list(sample_jpegs()))
def test_tensor_path_matches_pil_path_when_jpeg_is_plain(name):
    data = sample_jpegs()[name]
    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=True)
    assert pre.route(data) == "tensor"
    (tensor,) = pre([data])
    reference = _pil_reference(data)
    assert tensor.shape == reference.shape == (3, 224, 224) and tensor.dtype == torch.float32
    difference = (tensor - reference).abs()
    assert difference.max() <= MAX_ABS_DIFF and difference.mean() <= MEAN_ABS_DIFF


def test_tensor_path_keeps_top1_when_compared_with_pil_on_every_jpeg():
    model = reference_model("resnet18")
    jpegs = list(sample_jpegs().values())
    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=True)
    with torch.inference_mode():
        fast = model(torch.stack(pre(jpegs))).argmax(1)
        slow = model(torch.stack([_pil_reference(d) for d in jpegs])).argmax(1)
    assert fast.tolist() == slow.tolist()


@pytest.mark.parametrize("kind", ["grayscale-png", "rgba-png", "cmyk-jpeg", "exif-rotated-jpeg", "webp", "16bit-png"])
def test_preprocess_takes_pil_path_when_tensor_decode_would_differ(kind):
    data = good_images()[kind]
    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=True)
    assert pre.route(data) == "pil"
    assert torch.equal(pre([data])[0], _pil_reference(data))


def test_preprocess_gives_pil_path_error_when_jpeg_is_truncated():
    data = CAT.read_bytes()[: len(CAT.read_bytes()) // 3]
    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=True)
    assert pre.route(data) == "pil"
    (result,) = pre([data])
    assert isinstance(result, ImageError) and "truncated or corrupt" in str(result)


@pytest.mark.parametrize("tensor_decode", [False, True])
def test_refused_image_frees_its_half_decoded_pixels_at_once(tensor_decode):
    """An error kept with its traceback forms a cycle holding the decoding frames (and the partly
    decoded image) until a full garbage collection: the soak saw the stub grow 50 MB in 20 minutes."""
    import gc
    import weakref

    data = CAT.read_bytes()[: len(CAT.read_bytes()) // 3]
    opened = []
    original = Image.open

    def spying_open(*args, **kwargs):
        image = original(*args, **kwargs)
        opened.append(weakref.ref(image))
        return image

    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=tensor_decode)
    gc.disable()  # only reference counting may free them
    try:
        Image.open = spying_open
        (result,) = pre([data])
    finally:
        Image.open = original
        gc.enable()
    assert isinstance(result, ImageError) and result.__traceback__ is None and result.__context__ is None
    assert opened and all(ref() is None for ref in opened), "a refused image is still alive"


@pytest.mark.parametrize("kind", list(bad_images()))
def test_bad_element_gets_its_error_and_neighbours_their_images_when_mixed(kind):
    data, phrase = bad_images()[kind]
    good = CAT.read_bytes()
    pre = Preprocessor(TRANSFORM, CPU, tensor_decode=True)
    results = pre([good, data, good])
    assert isinstance(results[1], ImageError) and phrase in str(results[1])
    for result in (results[0], results[2]):
        assert torch.equal(result, pre([good])[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: nvJPEG needs one (CI has none)")
def test_gpu_decode_matches_cpu_tensor_path_when_device_is_cuda():
    device = torch.device("cuda", 0)
    jpegs = list(sample_jpegs().values()) + [good_images()["webp"]]
    on_gpu = Preprocessor(TRANSFORM, device, tensor_decode=True)(jpegs)
    on_cpu = Preprocessor(TRANSFORM, CPU, tensor_decode=True)(jpegs)
    for gpu, cpu in zip(on_gpu, on_cpu):
        assert gpu.device == device
        difference = (gpu.cpu() - cpu).abs()
        assert difference.max() <= GPU_MAX_ABS_DIFF and difference.mean() <= GPU_MEAN_ABS_DIFF
