"""What build-repo's command line names before any model is loaded: the weight choices, the engines, the preprocessing
presets, and the error a model or its weights raise -- importing no torch, so that `build-repo --help` and a bad
argument answer at once (torch and torchvision take ~7 s of CPU to import here)."""
from __future__ import annotations

from dataclasses import dataclass

WEIGHT_CHOICES = ("auto", "random", "DEFAULT", "IMAGENET1K_V1", "IMAGENET1K_V2")
ENGINES = ("torch", "torchscript", "onnxruntime", "openvino")


class WeightsError(RuntimeError):
    """The requested model or weights cannot be had."""


@dataclass(frozen=True)
class Preprocessing:
    """What the served model expects an image to go through: Resize(resize) with `interpolation` ->
    CenterCrop(crop) -> [0, 1] -> Normalize(mean, std) (torchvision's ImageClassification)."""

    resize: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = "bilinear"

    def parameters(self) -> dict[str, str]:
        """The config fields NAME_preprocess and the clients rebuild it from."""
        return {"resize_size": str(self.resize), "crop_size": str(self.crop),
                "mean": ",".join(map(repr, self.mean)), "std": ",".join(map(repr, self.std)),
                "interpolation": self.interpolation}

    def __str__(self) -> str:
        return (f"Resize({self.resize}, {self.interpolation}) -> CenterCrop({self.crop}) -> "
                f"Normalize(mean={list(self.mean)}, std={list(self.std)})")


# TorchServe's image_classifier handler: Resize(256) -> CenterCrop(224) -> ToTensor -> Normalize(ImageNet).
IMAGENET = Preprocessing(256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
