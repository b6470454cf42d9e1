"""Resolve `--model` / `--weights` into a torchvision classifier, its labels and its preprocessing."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torchvision.models import Weights, WeightsEnum

WEIGHT_CHOICES = ("auto", "random", "DEFAULT", "IMAGENET1K_V1", "IMAGENET1K_V2")


class WeightsError(RuntimeError):
    """The requested model or weights cannot be had."""


@dataclass
class Classifier:
    name: str
    module: torch.nn.Module
    weights: str  # what was loaded: a weights enum name, "random(seed=N)" or a file path
    preprocess: Weights  # whose transforms() the served model expects
    categories: list[str]
    pretrained: bool


def classification_models() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def _weights_enum(name: str) -> type[WeightsEnum]:
    if name not in classification_models():
        raise WeightsError(f"unknown torchvision classification model {name!r} (e.g. resnet18, resnet152, vit_b_16)")
    return torchvision.models.get_model_weights(name)


def _download(weights: Weights) -> dict:
    # Uses torch.hub's cache first, so a machine that downloaded once works offline afterwards.
    return weights.get_state_dict(progress=False, check_hash=True)


def load_classifier(name: str, weights: str = "auto", seed: int = 0) -> Classifier:
    """Build `name` with the requested weights; `auto` falls back to seeded random weights, loudly."""
    enum = _weights_enum(name)
    default = enum.DEFAULT
    if weights == "random":
        return _random(name, seed, default)
    if weights == "auto":
        try:
            state = _download(default)
        except Exception as exc:  # no network, proxy, corrupt cache: all mean "not available here"
            print(
                f"WARNING: pretrained weights {default} are not available ({type(exc).__name__}: {exc}).\n"
                f"WARNING: using RANDOM weights (seed {seed}) instead: predictions are MEANINGLESS.",
                file=sys.stderr,
            )
            return _random(name, seed, default)
        return _with_state(name, state, str(default), default, pretrained=True)
    if weights in WEIGHT_CHOICES:
        try:
            chosen = enum[weights]
        except KeyError:
            names = ", ".join(w.name for w in enum)
            raise WeightsError(f"{name} has no weights {weights!r}; it has: {names}") from None
        try:
            state = _download(chosen)
        except Exception as exc:
            raise WeightsError(f"cannot download {chosen}: {type(exc).__name__}: {exc}") from exc
        return _with_state(name, state, str(chosen), chosen, pretrained=True)
    return _from_file(name, Path(weights), default)


def _random(name: str, seed: int, default: Weights) -> Classifier:
    torch.manual_seed(seed)
    module = torchvision.models.get_model(name, weights=None)
    return Classifier(name, module.eval(), f"random(seed={seed})", default, _categories(default), False)


def _from_file(name: str, path: Path, default: Weights) -> Classifier:
    if not path.is_file():
        raise WeightsError(f"--weights {str(path)!r} is neither {'/'.join(WEIGHT_CHOICES)} nor a file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's unpickling errors run to a dozen lines: keep the first
        first = (str(exc).strip().splitlines() or [""])[0]
        raise WeightsError(f"cannot read a state_dict from {path}: {type(exc).__name__}: {first}") from exc
    if not isinstance(state, dict):
        raise WeightsError(f"{path} holds a {type(state).__name__}, not a state_dict")
    return _with_state(name, state, str(path), default, pretrained=True)


def _with_state(name: str, state: dict, label: str, preprocess: Weights, pretrained: bool) -> Classifier:
    num_classes = len(_categories(preprocess))
    module = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise WeightsError(f"weights {label} do not fit {name}: {first}") from exc
    return Classifier(name, module.eval(), label, preprocess, _categories(preprocess), pretrained)


def _categories(weights: Weights) -> list[str]:
    return list(weights.meta["categories"])


def crop_size(weights: Weights) -> int:
    """The square input side the weights' own transforms() produce."""
    size = weights.transforms().crop_size
    return int(size[0] if isinstance(size, (list, tuple)) else size)
