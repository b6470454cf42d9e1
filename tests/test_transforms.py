"""common/transforms.py's own resize, crop and normalize on PIL images equal torchvision's ImageClassification bit for
bit (every interpolation, portrait, landscape, square, images smaller than the crop, odd sizes), and the stubs that
run it start without importing torchvision."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F
from torchvision.transforms._presets import ImageClassification

from common.transforms import PIL_FILTERS, pixels_from_parameters, transform_from_parameters
from images import CAT
from support import ROOT

SIZES = [(500, 375), (375, 500), (256, 256), (300, 301), (257, 999), (1000, 229), (224, 224), (100, 80), (230, 3000),
         (3, 7)]


def _photo(size: tuple[int, int]) -> Image.Image:
    return Image.open(CAT).convert("RGB").resize(size)


def _params(interpolation: str, crop: int = 224, resize: int = 256) -> dict[str, str]:
    return {"crop_size": str(crop), "resize_size": str(resize), "mean": "0.485,0.456,0.406",
            "std": "0.229,0.224,0.225", "interpolation": interpolation}


def _torchvision(params: dict[str, str]) -> ImageClassification:
    return ImageClassification(crop_size=int(params["crop_size"]), resize_size=int(params["resize_size"]),
                               mean=[float(x) for x in params["mean"].split(",")],
                               std=[float(x) for x in params["std"].split(",")],
                               interpolation=InterpolationMode(params["interpolation"]))


@pytest.mark.parametrize("interpolation", sorted(PIL_FILTERS))
@pytest.mark.parametrize("crop, resize", [(224, 256), (224, 232), (518, 518), (299, 342), (224, 200)])
def test_normalized_and_pixels_equal_torchvisions_bit_for_bit_when_given_a_pil_image(interpolation, crop, resize):
    params = _params(interpolation, crop, resize)
    reference = _torchvision(params)
    mine, pixels = transform_from_parameters(params), pixels_from_parameters(params)
    for size in SIZES:
        image = _photo(size)
        expected = reference(image)
        assert torch.equal(mine(image), expected), (size, interpolation)
        resized = F.center_crop(F.resize(image, reference.resize_size, interpolation=reference.interpolation),
                                reference.crop_size)
        assert torch.equal(pixels(image), F.pil_to_tensor(resized)), (size, interpolation)
    assert (mine._torchvision is not None) == (resize < crop)  # padded: by torchvision itself


def test_tensors_and_other_modes_go_to_torchvision_and_answer_as_it_does():
    params = _params("bilinear")
    reference, mine = _torchvision(params), transform_from_parameters(params)
    gray = _photo((300, 400)).convert("L")  # one channel, three means: torchvision's own error, here as there
    with pytest.raises(RuntimeError, match="broadcast shape"):
        reference(gray)
    with pytest.raises(RuntimeError, match="broadcast shape"):
        mine(gray)
    batch = torch.from_numpy(np.asarray(_photo((320, 240)))).permute(2, 0, 1)[None].repeat(2, 1, 1, 1)
    assert torch.equal(mine(batch), reference(batch))


def test_the_preprocessing_stubs_start_without_importing_torchvision_when_on_cpu():
    code = ("import sys; import backends.preprocess, backends.fused; "
            "from common.transforms import transform_from_parameters as t; "
            "from PIL import Image; "
            "t({'crop_size': '224', 'resize_size': '256', 'mean': '0,0,0', 'std': '1,1,1'})(Image.new('RGB', (300, 300)));"
            "print('torchvision' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


@pytest.mark.parametrize("normalize", [True, False])
def test_host_transform_gives_the_tensor_transforms_values_as_numpy_without_importing_torch(normalize):
    """A CPU NAME_preprocess stub's host path: the same steps on NumPy (tensors=False), the same bits as the tensors
    the fused model and the clients get, and its modules import no torch at all."""
    params = {"crop_size": "224", "resize_size": "256", "mean": "0.485,0.456,0.406", "std": "0.229,0.224,0.225"}
    made = transform_from_parameters if normalize else pixels_from_parameters
    for size in ((320, 240), (240, 320), (257, 256)):
        image = _photo(size)
        host, tensor = made(params, tensors=False)(image), made(params)(image)
        assert isinstance(host, np.ndarray) and isinstance(tensor, torch.Tensor)
        assert host.dtype == (np.float32 if normalize else np.uint8) and np.array_equal(host, tensor.numpy())
    code = ("import sys; import backends.preprocess; "
            "from common.transforms import transform_from_parameters as t; from PIL import Image; "
            f"t({params!r}, tensors=False)(Image.new('RGB', (300, 300))); "
            "print('torch' in sys.modules, 'torchvision' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "False"], done.stderr
