"""Classifiers that are not a torchvision name: a state_dict (matched against torchvision's
architectures), a user's model file, labels files in TorchServe's shapes."""
from __future__ import annotations

import ast
import contextlib
import functools
import json
import re
import sys
import warnings
from pathlib import Path

import torch
import torchvision

from builder.options import Preprocessing, WeightsError
from builder.weights import Classifier, ModelCode, classification_models, torchvision_module
from common.archive import ArchiveError, label_mapping
from common.messages import first_line


def shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in state.items()}


def match_torchvision(state: dict[str, torch.Tensor], hint: str = "") -> tuple[str, int] | None:
    """(torchvision model, number of classes) whose state_dict has exactly these keys and shapes, if one
    does. Nothing from the weights' origin runs: each candidate is built empty from torchvision's code.
    `hint` (a model file's text): the candidates of the torchvision modules it names are tried first. No two
    torchvision classifiers have the same keys and shapes (tests/test_migrate.py), so the order changes only the
    time it takes, not the answer."""
    return _match(tuple(shapes(state).items()), hint)


@functools.lru_cache(maxsize=8)  # a TorchScript archive is matched twice in one build (sources.unmatched_torchscript)
def _match(items: tuple, hint: str) -> tuple[str, int] | None:
    wanted = dict(items)
    head = [shape[0] for shape in wanted.values() if len(shape) == 1]
    for name in hinted_first(classification_models(), hint):
        candidate = _empty_shapes(name, 1000)
        if candidate is None or candidate.keys() != wanted.keys():
            continue
        if candidate == wanted:
            return name, 1000
        # Only the classification head may differ: rebuild with the class count the weights have.
        if head and _empty_shapes(name, head[-1]) == wanted:
            return name, head[-1]
    return None


def hinted_first(names: list[str], hint: str) -> list[str]:
    """`names` with those whose torchvision module `hint` names (`torchvision.models.resnet`, `models.resnet`)
    first, each group in its own order."""
    named = set(re.findall(r"models\.(\w+)", hint))
    if not named:
        return names
    first = [n for n in names if torchvision.models.get_model_builder(n).__module__.rpartition(".")[2] in named]
    return first + [n for n in names if n not in first]


def added_behaviour(model_file: Path) -> str | None:
    """Why torchvision's code would not answer as the archive's classes do, read without running them; None
    where every class only configures its base (TorchServe's resnet-152-batch_v2: `class ImageClassifier(ResNet)`
    whose `__init__` is one `super().__init__(Bottleneck, [3, 8, 36, 3])` call). Any other method (`forward`
    above all), class attribute or statement makes the weights' shapes say nothing about the answers."""
    try:
        tree = ast.parse(model_file.read_text(), filename=str(model_file))
    except (OSError, SyntaxError, ValueError) as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.Expr) and isinstance(item.value, ast.Constant):
                continue  # a docstring
            if isinstance(item, ast.FunctionDef) and item.name == "__init__" and _only_super_init(item):
                continue
            what = f"method {item.name}()" if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                f"line {item.lineno}"
            return f"class {node.name} defines its own {what}"
    return None


def _only_super_init(init: ast.FunctionDef) -> bool:
    """True for an __init__ whose body is one call of the base class's __init__ (its docstring aside)."""
    body = [s for s in init.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
        return False
    func = body[0].value.func
    return isinstance(func, ast.Attribute) and func.attr == "__init__" and isinstance(func.value, ast.Call) \
        and isinstance(func.value.func, ast.Name) and func.value.func.id == "super"


def _empty_shapes(name: str, num_classes: int) -> dict[str, tuple[int, ...]] | None:
    """Parameter and buffer shapes of `name`, built without memory (meta device) and without init: torch.nn.init on
    meta tensors still runs its Python reference code, half the time of matching torchvision's 80 models."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"), _no_init():
                model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
        except Exception:  # regnet computes its widths with tensors: build on CPU, skipping initialization
            try:
                with _no_init():
                    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
            except Exception:
                return None
    return shapes(model.state_dict())


@contextlib.contextmanager
def _no_init():
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, function in saved.items():
            setattr(torch.nn.init, n, function)


def torchvision_classifier(architecture: str, num_classes: int, state: dict, name: str, label: str,
                           preprocessing: Preprocessing, categories: list[str], source: str) -> Classifier:
    module = torchvision_module(architecture, num_classes, state, label)
    return Classifier(name, module, label, preprocessing, categories, True, architecture=architecture, source=source)


def code_classifier(code: ModelCode, state: dict, name: str, label: str, preprocessing: Preprocessing,
                    categories: list[str] | None, source: str) -> Classifier:
    """Runs the model file (the caller checked it may), builds its class with no arguments, loads the weights."""
    from common.model_code import import_model_class

    try:
        cls = import_model_class(code.file, code.class_name or None)
        module = cls()
    except ValueError as exc:
        raise WeightsError(str(exc)) from None
    except Exception as exc:  # the user's code failed: its first line, not our traceback
        raise WeightsError(f"model file {code.file.name} failed: {type(exc).__name__}: {first_line(exc)}") from None
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        raise WeightsError(f"weights {label} do not fit {cls.__name__} from {code.file.name}: {first_line(exc)}") from None
    module.eval()
    try:
        with torch.inference_mode():
            out = module(torch.zeros(1, 3, preprocessing.crop, preprocessing.crop))
    except Exception as exc:
        raise WeightsError(f"{cls.__name__} cannot classify a 3x{preprocessing.crop}x{preprocessing.crop} image: "
                           f"{type(exc).__name__}: {first_line(exc)}") from None
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise WeightsError(f"{cls.__name__} must return logits [N, classes], returned "
                           f"{type(out).__name__} {list(getattr(out, 'shape', []))}")
    classes = out.shape[1]
    code = ModelCode(code.file, cls.__name__, code.extra_files, module_imports(code.file))
    return Classifier(name, module, label, preprocessing, fit_labels(categories, classes, label), True,
                      code=code, source=source)


def fit_labels(categories: list[str] | None, classes: int, label: str) -> list[str]:
    if categories is None:
        print(f"WARNING: no labels given: classes are named by their index 0..{classes - 1}", file=sys.stderr)
        return [str(i) for i in range(classes)]
    if len(categories) != classes:
        raise WeightsError(f"{len(categories)} labels for {classes} classes (the weights {label} have {classes})")
    return categories


def load_labels(path: Path) -> list[str]:
    """Class names in index order from index_to_name.json ({"0": "tench"}, {"0": ["n01440764", "tench"]},
    ["tench", ...]) or a text file with one name per line. TorchServe shows the last name of a list."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise WeightsError(f"cannot read labels {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if path.suffix.lower() != ".json":
        names = [line.strip() for line in text.splitlines() if line.strip()]
        if not names:
            raise WeightsError(f"labels file {path} is empty")
        return names
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WeightsError(f"labels {path} is not valid JSON: {exc}") from None
    if isinstance(data, dict):  # TorchServe's rule for a name (common/archive.py), then the indices in order
        try:
            data = label_mapping(data)
        except ArchiveError as exc:
            raise WeightsError(f"labels {path}: {exc}") from None
        try:
            indexed = {int(key): value for key, value in data.items()}
        except ValueError:
            raise WeightsError(f"labels {path}: keys must be class indices \"0\", \"1\", ...") from None
        if sorted(indexed) != list(range(len(indexed))):
            raise WeightsError(f"labels {path}: indices must run 0..{len(indexed) - 1} without gaps")
        data = [indexed[i] for i in range(len(indexed))]
    if not isinstance(data, list) or not data:
        raise WeightsError(f"labels {path} must map indices to names or list names")
    names = []
    for index, value in enumerate(data):
        if isinstance(value, list) and value:  # a plain JSON list of names (not TorchServe's): the same rule
            value = value[-1]
        if not isinstance(value, str):
            raise WeightsError(f"labels {path}: class {index} is {value!r}, not a name")
        names.append(value)
    return names


def module_imports(path: Path) -> tuple[str, ...]:
    """Top-level modules a model file imports (what the serving environment must have)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return ()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module.split(".")[0])
    return tuple(dict.fromkeys(found))


