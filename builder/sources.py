"""The slow part of a build: the classifier a Plan names, loaded from its source, never running code unasked.

Sources: a torchvision model (weights auto/random/pretrained/a file), a TorchServe .mar, a model file.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from builder import custom, mar
from builder.plan import Plan
from builder.options import WeightsError
from builder.weights import Classifier, ModelCode, is_torchscript, load_classifier, read_state_dict


def load(plan: Plan, archive: mar.Archive | None = None) -> Classifier:
    """The classifier `plan` names, with its name, preprocessing and class names set."""
    labels = custom.load_labels(plan.labels) if plan.labels else None
    if plan.source == "torchvision":
        classifier = load_classifier(plan.model, plan.weights, plan.seed)
        classifier.name = plan.name
        classifier.preprocessing = plan.preprocessing or replace(classifier.preprocessing, **plan.overrides)
        if labels is not None:
            classifier.categories = custom.fit_labels(labels, len(classifier.categories), classifier.weights)
        return classifier
    if plan.source == "mar":
        return _from_archive(plan, archive, labels)
    code = ModelCode(plan.model_file.resolve(), plan.model_class or "")
    state = read_state_dict(Path(plan.weights))
    return custom.code_classifier(code, state, plan.name, plan.weights, plan.preprocessing, labels,
                                  source=f"model file {plan.model_file.name}")


def archive_state(archive: mar.Archive) -> dict:
    """The archive's weights: its state_dict, or a TorchScript module's own parameters (TorchServe's scripted
    archives: no model file); an error names the archive and its member, never the folder it was extracted to."""
    try:
        return read_state_dict(archive.serialized_file, torchscript=archive.model_file is None)
    except WeightsError as exc:
        label = f"{archive.path.name}:{archive.serialized_file.name}"
        raise mar.ArchiveError(str(exc).replace(str(archive.serialized_file), label)) from None


def unmatched_torchscript(archive: mar.Archive) -> bool:
    """A TorchScript archive whose module is no torchvision classifier: only its own handler can serve it."""
    if archive.model_file is not None or not is_torchscript(archive.serialized_file):
        return False
    return custom.match_torchvision(archive_state(archive)) is None


def _from_archive(plan: Plan, archive: mar.Archive, labels) -> Classifier:
    state = archive_state(archive)
    if labels is None and archive.labels_file is not None:
        labels = custom.load_labels(archive.labels_file)
    label = f"{archive.path.name}:{archive.serialized_file.name}"
    source = f"TorchServe archive {archive.path.name} (handler {archive.handler})"
    match = None if plan.model_class else custom.match_torchvision(state, _text(archive.model_file))
    behaviour = custom.added_behaviour(archive.model_file) if match and archive.model_file else None
    if match is not None and behaviour is None:
        architecture, classes = match
        return custom.torchvision_classifier(architecture, classes, state, plan.name, label, plan.preprocessing,
                                             custom.fit_labels(labels, classes, label), source)
    if archive.model_file is None:
        what = "TorchScript module" if is_torchscript(archive.serialized_file) else "weights"
        raise mar.ArchiveError(f"the {what} in {archive.path.name} fit{'s' if what != 'weights' else ''} no torchvision "
                               "classification model and the archive has no model file to build them with: serve it "
                               "with its own handler (--handler-path --trust-model-code; serve-repo's TorchServe "
                               "mode chooses that itself)")
    if not plan.trust_model_code:
        why = (f"fit torchvision's {match[0]}, but in {archive.model_file.name} {behaviour}, so torchvision's code "
               "would answer differently" if match else "fit no torchvision classification model")
        raise mar.ArchiveError(f"the weights in {archive.path.name} {why}; serving them means running the archive's "
                               f"{archive.model_file.name}: pass --trust-model-code if you trust its code (nothing "
                               "from it was run)")
    code = ModelCode(archive.model_file, plan.model_class or "", tuple(archive.extra_files))
    return custom.code_classifier(code, state, plan.name, label, plan.preprocessing, labels, source)


def _text(path: Path | None) -> str:
    try:
        return path.read_text(errors="replace") if path is not None else ""
    except OSError:
        return ""


def describe(c: Classifier) -> str:
    if c.code is not None:
        return f"{c.code.class_name} from {c.code.file.name}, weights {c.weights}, {len(c.categories)} classes"
    origin = f" ({c.source}: the weights fit torchvision's {c.architecture}, whose code serves them)" if c.source else ""
    return f"torchvision {c.architecture}, weights {c.weights}, {len(c.categories)} classes{origin}"
