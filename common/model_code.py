"""Load a user's model class from its file by TorchServe's rule (used at build time and in the stub).

build-repo copies this file beside the classifier's model.py, so it must stay self-contained.
"""
from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import torch


def import_model_class(path: Path, class_name: str | None = None) -> type:
    """The nn.Module class a model file defines, by TorchServe's rule: the one class defined in the file
    (not imported into it) that subclasses nn.Module, or the one named. Runs the file: build-repo does
    so only for a file the user gave or trusted. Its folder goes on sys.path for the files it imports."""
    path = Path(path).resolve()
    module_name = f"_classifier_code_{abs(hash(str(path)))}"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    defined = {name: obj for name, obj in vars(module).items()
               if inspect.isclass(obj) and issubclass(obj, torch.nn.Module) and obj.__module__ == module_name}
    if class_name is not None:
        if class_name not in defined:
            raise ValueError(f"{path.name} defines no nn.Module class {class_name!r} "
                             f"(it defines: {', '.join(sorted(defined)) or 'none'})")
        return defined[class_name]
    if len(defined) != 1:
        raise ValueError(f"{path.name} must define exactly one nn.Module class (TorchServe's rule), it defines "
                         f"{len(defined)}: {', '.join(sorted(defined)) or 'none'}; name one with --model-class")
    return next(iter(defined.values()))
