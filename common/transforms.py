"""The preprocessing a model's config records, rebuilt as torchvision's ImageClassification (server and clients alike).

On a PIL image (the CPU path) the steps are done here, exactly as torchvision does them, without importing
torchvision: its import costs ~3.5 s of CPU (torchvision.ops pulls in torch._dynamo) in every NAME_preprocess and
NAME_image stub that starts, and Triton starts one per instance, at every load and scale-up. A tensor (the GPU
path's nvJPEG output) and the rare cases below go to torchvision itself. tests/test_transforms.py holds the two
equal, bit for bit.

build-repo copies this file beside NAME_preprocess's model.py, so it must stay self-contained.
"""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

# torchvision's InterpolationMode values -> PIL's filters (torchvision.transforms.functional.pil_modes_mapping)
PIL_FILTERS = {"nearest": Image.NEAREST, "nearest-exact": Image.NEAREST, "bilinear": Image.BILINEAR,
               "bicubic": Image.BICUBIC, "box": Image.BOX, "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


class Classification:
    """Resize(resize_size) -> CenterCrop(crop_size) -> [0, 1] -> Normalize(mean, std): torchvision's
    ImageClassification; `normalize=False` stops at the uint8 pixels [3, crop, crop]."""

    def __init__(self, crop_size: int, resize_size: int, mean, std, interpolation: str = "bilinear",
                 normalize: bool = True):
        self.crop_size, self.resize_size = [crop_size], [resize_size]
        self.mean, self.std = [float(x) for x in mean], [float(x) for x in std]
        self.interpolation, self.normalize = interpolation, normalize
        self._torchvision = None

    def __call__(self, image):
        if not isinstance(image, Image.Image) or image.mode != "RGB":
            return self.torchvision()(image)
        width, height = image.size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.resize_size[0], int(self.resize_size[0] * long / short)
        size = (new_short, new_long) if width <= height else (new_long, new_short)  # (w, h)
        crop = self.crop_size[0]
        if crop > size[0] or crop > size[1]:  # torchvision pads before it crops: left to it
            return self.torchvision()(image)
        if size != image.size:
            image = image.resize(size, PIL_FILTERS[self.interpolation])
        top, left = int(round((size[1] - crop) / 2.0)), int(round((size[0] - crop) / 2.0))
        image = image.crop((left, top, left + crop, top + crop))
        pixels = torch.as_tensor(np.array(image, copy=True)).view(crop, crop, 3).permute(2, 0, 1)
        if not self.normalize:
            return pixels
        scaled = pixels.to(torch.float) / 255.0
        mean = torch.as_tensor(self.mean, dtype=scaled.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=scaled.dtype).view(-1, 1, 1)
        return scaled.sub_(mean).div_(std)

    def torchvision(self):
        """The same steps by torchvision (imported here, once): for tensors and the cases not done above."""
        if self._torchvision is None:
            from torchvision.transforms import InterpolationMode
            from torchvision.transforms._presets import ImageClassification

            full = ImageClassification(crop_size=self.crop_size[0], resize_size=self.resize_size[0], mean=self.mean,
                                       std=self.std, interpolation=InterpolationMode(self.interpolation))
            self._torchvision = full if self.normalize else _torchvision_pixels(full)
        return self._torchvision


def transform_from_parameters(params: dict[str, str]):
    """Resize(resize_size) -> CenterCrop(crop_size) -> [0, 1] -> Normalize(mean, std), as recorded in the
    config (torchvision's ImageClassification, the transforms() of its weights; TorchServe's
    image_classifier is resize 256, crop 224, ImageNet mean/std, bilinear). Repositories built before
    these fields were recorded name torchvision weights in `preprocess_weights` instead."""
    if "crop_size" not in params:
        import torchvision

        return torchvision.models.get_weight(params["preprocess_weights"]).transforms()
    return _classification(params, normalize=True)


def pixels_from_parameters(params: dict[str, str]):
    """The same resize and center crop, stopping at the uint8 pixels [3, crop, crop] that the classifier's
    IMAGE_UINT8 input takes (the server then does the [0, 1] scaling and Normalize on its device)."""
    if "crop_size" not in params:
        return _torchvision_pixels(transform_from_parameters(params))
    return _classification(params, normalize=False)


def _torchvision_pixels(full):
    """torchvision's resize and center crop of the ImageClassification `full`, stopping at uint8 pixels."""
    from torchvision.transforms import functional as F

    def pixels(image):
        image = F.resize(image, full.resize_size, interpolation=full.interpolation, antialias=full.antialias)
        image = F.center_crop(image, full.crop_size)
        return image if isinstance(image, torch.Tensor) else F.pil_to_tensor(image)

    return pixels


def _classification(params: dict[str, str], normalize: bool) -> Classification:
    numbers = lambda key: [float(x) for x in params[key].split(",")]  # noqa: E731
    return Classification(int(params["crop_size"]), int(params["resize_size"]), numbers("mean"), numbers("std"),
                          params.get("interpolation", "bilinear"), normalize=normalize)
