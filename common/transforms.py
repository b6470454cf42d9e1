"""The preprocessing a model's config records, rebuilt as a torchvision transform (server and clients alike).

build-repo copies this file beside NAME_preprocess's model.py, so it must stay self-contained.
"""
from __future__ import annotations

import torch
import torchvision


def transform_from_parameters(params: dict[str, str]):
    """Resize(resize_size) -> CenterCrop(crop_size) -> [0, 1] -> Normalize(mean, std), as recorded in the
    config (torchvision's ImageClassification, the transforms() of its weights; TorchServe's
    image_classifier is resize 256, crop 224, ImageNet mean/std, bilinear). Repositories built before
    these fields were recorded name torchvision weights in `preprocess_weights` instead."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms._presets import ImageClassification

    if "crop_size" not in params:
        return torchvision.models.get_weight(params["preprocess_weights"]).transforms()
    numbers = lambda key: [float(x) for x in params[key].split(",")]  # noqa: E731
    return ImageClassification(crop_size=int(params["crop_size"]), resize_size=int(params["resize_size"]),
                               mean=numbers("mean"), std=numbers("std"),
                               interpolation=InterpolationMode(params.get("interpolation", "bilinear")))


def pixels_from_parameters(params: dict[str, str]):
    """The same resize and center crop, stopping at the uint8 pixels [3, crop, crop] that the classifier's
    IMAGE_UINT8 input takes (the server then does the [0, 1] scaling and Normalize on its device)."""
    from torchvision.transforms import functional as F

    full = transform_from_parameters(params)

    def pixels(image):
        image = F.resize(image, full.resize_size, interpolation=full.interpolation, antialias=full.antialias)
        image = F.center_crop(image, full.crop_size)
        return image if isinstance(image, torch.Tensor) else F.pil_to_tensor(image)

    return pixels
