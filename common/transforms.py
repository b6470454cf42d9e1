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
from PIL import Image

# torchvision's InterpolationMode values -> PIL's filters (torchvision.transforms.functional.pil_modes_mapping)
PIL_FILTERS = {"nearest": Image.NEAREST, "nearest-exact": Image.NEAREST, "bilinear": Image.BILINEAR,
               "bicubic": Image.BICUBIC, "box": Image.BOX, "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


class Classification:
    """Resize(resize_size) -> CenterCrop(crop_size) -> [0, 1] -> Normalize(mean, std): torchvision's
    ImageClassification; `normalize=False` stops at the uint8 pixels [3, crop, crop]. A torch tensor out, or with
    `tensors=False` the same values as a NumPy array (a CPU stub's host path, which imports no torch)."""

    def __init__(self, crop_size: int, resize_size: int, mean, std, interpolation: str = "bilinear",
                 normalize: bool = True, tensors: bool = True):
        self.crop_size, self.resize_size = [crop_size], [resize_size]
        self.mean, self.std = [float(x) for x in mean], [float(x) for x in std]
        self.interpolation, self.normalize, self.tensors = interpolation, normalize, tensors
        self._torchvision = None

    def __call__(self, image):
        result = self._steps(image)
        if isinstance(result, np.ndarray):
            return _torch().from_numpy(result) if self.tensors else result
        return result if self.tensors else result.numpy()

    def _steps(self, image):
        """The steps' result: NumPy where they ran here, a tensor where torchvision ran them."""
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
        pixels = np.array(image, copy=True).reshape(crop, crop, 3).transpose(2, 0, 1)
        if not self.normalize:
            return pixels
        # torchvision's float32 arithmetic, step for step: x / 255, - mean, / std (the same bits)
        scaled = pixels.astype(np.float32) / np.float32(255.0)
        scaled -= np.asarray(self.mean, dtype=np.float32).reshape(-1, 1, 1)
        scaled /= np.asarray(self.std, dtype=np.float32).reshape(-1, 1, 1)
        return scaled

    def torchvision(self):
        """The same steps by torchvision (imported here, once): for tensors and the cases not done above."""
        if self._torchvision is None:
            from torchvision.transforms import InterpolationMode
            from torchvision.transforms._presets import ImageClassification

            full = ImageClassification(crop_size=self.crop_size[0], resize_size=self.resize_size[0], mean=self.mean,
                                       std=self.std, interpolation=InterpolationMode(self.interpolation))
            self._torchvision = full if self.normalize else _torchvision_pixels(full)
        return self._torchvision


def transform_from_parameters(params: dict[str, str], tensors: bool = True):
    """Resize(resize_size) -> CenterCrop(crop_size) -> [0, 1] -> Normalize(mean, std), as recorded in the
    config (torchvision's ImageClassification, the transforms() of its weights; TorchServe's
    image_classifier is resize 256, crop 224, ImageNet mean/std, bilinear). Repositories built before
    these fields were recorded name torchvision weights in `preprocess_weights` instead."""
    if "crop_size" not in params:
        import torchvision

        return torchvision.models.get_weight(params["preprocess_weights"]).transforms()
    return _classification(params, normalize=True, tensors=tensors)


def pixels_from_parameters(params: dict[str, str], tensors: bool = True):
    """The same resize and center crop, stopping at the uint8 pixels [3, crop, crop] that the classifier's
    IMAGE_UINT8 input takes (the server then does the [0, 1] scaling and Normalize on its device)."""
    if "crop_size" not in params:
        return _torchvision_pixels(transform_from_parameters(params))
    return _classification(params, normalize=False, tensors=tensors)


def _torchvision_pixels(full):
    """torchvision's resize and center crop of the ImageClassification `full`, stopping at uint8 pixels."""
    import torch
    from torchvision.transforms import functional as F

    def pixels(image):
        image = F.resize(image, full.resize_size, interpolation=full.interpolation, antialias=full.antialias)
        image = F.center_crop(image, full.crop_size)
        return image if isinstance(image, torch.Tensor) else F.pil_to_tensor(image)

    return pixels


def _torch():
    import torch

    return torch


def _classification(params: dict[str, str], normalize: bool, tensors: bool = True) -> Classification:
    numbers = lambda key: [float(x) for x in params[key].split(",")]  # noqa: E731
    return Classification(int(params["crop_size"]), int(params["resize_size"]), numbers("mean"), numbers("std"),
                          params.get("interpolation", "bilinear"), normalize=normalize, tensors=tensors)
