"""Resolve `--model` / `--weights` into a torchvision classifier, its labels and its preprocessing."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torchvision.models import Weights, WeightsEnum
from builder.options import WEIGHT_CHOICES, Preprocessing, WeightsError
from common.messages import first_line


def preprocessing_of(weights: Weights) -> Preprocessing:
    t = weights.transforms()
    first = lambda v: int(v[0] if isinstance(v, (list, tuple)) else v)  # noqa: E731
    return Preprocessing(first(t.resize_size), first(t.crop_size), tuple(map(float, t.mean)),
                         tuple(map(float, t.std)), t.interpolation.value)


@dataclass(frozen=True)
class ModelCode:
    """A user's model file (TorchServe's convention: one nn.Module class, no-argument constructor)."""

    file: Path
    class_name: str
    extra_files: tuple[Path, ...] = ()  # .py files the model file may import (a .mar's extra files)
    imports: tuple[str, ...] = ()  # top-level modules the file imports, recorded in the config


@dataclass
class Classifier:
    name: str  # the served model's name
    module: torch.nn.Module
    weights: str  # what was loaded: a weights enum name, "random(seed=N)" or a file path
    preprocessing: Preprocessing
    categories: list[str]
    pretrained: bool
    architecture: str = ""  # the torchvision model whose code runs it; "" when `code` does
    code: ModelCode | None = None
    preprocess_weights: str = ""  # torchvision weights whose transforms() and labels it uses, if any
    source: str = ""  # where it came from, e.g. "archive resnet-18.mar"

    @property
    def crop(self) -> int:
        return self.preprocessing.crop


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
    """Build `name` with the requested weights. Random weights only when asked for (`random`): `auto` that
    cannot get the pretrained ones (offline, no cache) fails, naming the fix, so that a build without network
    never ships a meaningless model."""
    enum = _weights_enum(name)
    default = enum.DEFAULT
    if weights == "random":
        return _random(name, seed, default)
    if weights == "auto":
        try:
            state = _download(default)
        except Exception as exc:  # no network, proxy, corrupt cache: all mean "not available here"
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise WeightsError(f"pretrained weights {default} cannot be had here ({reason}); pass --weights PATH "
                               "(a state_dict file), or --weights random for seeded random weights "
                               "(their predictions are meaningless)") from None
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
    return _torchvision(name, module, f"random(seed={seed})", default, pretrained=False)


def _from_file(name: str, path: Path, default: Weights) -> Classifier:
    if not path.is_file():
        raise WeightsError(f"--weights {str(path)!r} is neither {'/'.join(WEIGHT_CHOICES)} nor a file")
    return _with_state(name, read_state_dict(path), str(path), default, pretrained=True)


def read_state_dict(path: Path, torchscript: bool = False) -> dict[str, torch.Tensor]:
    """A state_dict from `path` with weights_only=True (nothing in the file is executed), or WeightsError
    in one line saying what the file holds instead. `torchscript`: a TorchScript module's own parameters and
    buffers (a scripted or traced module keeps the names of the module it was made from; loading it compiles its
    TorchScript, which runs no Python)."""
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist")
    if _is_torchscript(path):
        if torchscript:
            return scripted_state_dict(path)
        raise WeightsError(f"{path} is a TorchScript module, not a state_dict; save model.state_dict() "
                           "with torch.save and build from that")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's unpickling errors run to a dozen lines: keep what names the cause
        text = str(exc).strip()
        culprit = next((line.strip() for line in text.splitlines() if "Unsupported global" in line), "")
        if "Weights only load failed" in text:
            raise WeightsError(f"{path} is not a plain state_dict: it pickles Python objects (a whole model?) "
                               f"that loading would have to run code for{' (' + culprit + ')' if culprit else ''}; "
                               "save model.state_dict() instead") from None
        first = (text.splitlines() or [""])[0]
        raise WeightsError(f"cannot read a state_dict from {path}: {type(exc).__name__}: {first}") from None
    if isinstance(state, dict) and not _all_tensors(state):  # a training checkpoint holding one
        nested = [state[key] for key in ("state_dict", "model_state_dict", "model") if isinstance(state.get(key), dict)]
        state = nested[0] if nested and _all_tensors(nested[0]) else state
    if not isinstance(state, dict) or not state or not _all_tensors(state):
        kind = type(state).__name__ if not isinstance(state, dict) else "dict that is not name -> tensor"
        raise WeightsError(f"{path} holds a {kind}, not a state_dict")
    return state


def scripted_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The parameters and buffers of the TorchScript module in `path`, by name, on the CPU."""
    try:
        module = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise WeightsError(f"{path} looks like a TorchScript module but does not load as one: "
                           f"{type(exc).__name__}: {first_line(exc)}") from None
    state = {name: value.detach().clone() for name, value in module.state_dict().items()}
    if not state:
        raise WeightsError(f"{path} is a TorchScript module with no parameters")
    return state


def is_torchscript(path: Path) -> bool:
    """Whether `path` is a TorchScript module's zip (torch.jit.save's), not a state_dict."""
    return path.is_file() and _is_torchscript(path)


def _all_tensors(state: dict) -> bool:
    return all(isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in state.items())


def _is_torchscript(path: Path) -> bool:
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/constants.pkl") or "/code/" in name for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _with_state(name: str, state: dict, label: str, preprocess: Weights, pretrained: bool) -> Classifier:
    module = torchvision_module(name, len(_categories(preprocess)), state, label)
    return _torchvision(name, module, label, preprocess, pretrained)


def torchvision_module(name: str, num_classes: int, state: dict, label: str) -> torch.nn.Module:
    """torchvision's `name` with `num_classes` outputs and these weights, or WeightsError in one line."""
    module = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        raise WeightsError(f"weights {label} do not fit {name}: {first_line(exc)}") from exc
    return module.eval()


def _torchvision(name: str, module: torch.nn.Module, label: str, weights: Weights, pretrained: bool) -> Classifier:
    return Classifier(name, module.eval(), label, preprocessing_of(weights), _categories(weights), pretrained,
                      architecture=name, preprocess_weights=str(weights))


def _categories(weights: Weights) -> list[str]:
    return list(weights.meta["categories"])
