"""A TorchServe model archive (.mar) as TorchServe reads it: its manifest and its labels, by one rule, for build-repo
and the TorchServe front alike (backends/ts_worker.py leaves the unpacked archive to TorchServe's own loader)."""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field

from common.messages import first_line

MANIFEST = "MAR-INF/MANIFEST.json"
LABELS = "index_to_name.json"  # where TorchServe's handlers find class names (BaseHandler: the archive's root)
MODEL_CONFIG = "model-config.yaml"  # the manifest's configFile when it names none


class ArchiveError(ValueError):
    """Not an archive TorchServe could serve; the message is one line naming the fault."""


def read_manifest(archive: zipfile.ZipFile, named: bool = True) -> dict:
    """MAR-INF/MANIFEST.json, with a `model` mapping naming `modelName` (all TorchServe needs to register it; not
    checked where not `named`)."""
    try:
        data = json.loads(archive.read(MANIFEST))
    except KeyError:
        raise ArchiveError(f"has no {MANIFEST}: not a model archive made by torch-model-archiver") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{MANIFEST} is not valid JSON: {exc}") from None
    model = data.get("model") if isinstance(data, dict) else None
    if named and (not isinstance(model, dict) or not model.get("modelName")):
        raise ArchiveError(f"{MANIFEST} has no model.modelName")
    return data


@dataclass(frozen=True)
class ModelSettings:
    """An archive's model-config.yaml as TorchServe 0.12's ModelConfig.build reads it: each of these an integer where
    the file gives one, else None (TorchServe logs "should be integer" and keeps its default); what each reader makes
    of them (TorchServe's registration, build-repo's flags) is its own. `raw`: the whole mapping."""
    batch_size: int | None = None
    max_batch_delay: int | None = None  # ms
    min_workers: int | None = None
    max_workers: int | None = None
    raw: dict = field(default_factory=dict)


def config_name(model: dict) -> str:
    """The archive member that holds the model's settings: the manifest's configFile, else model-config.yaml."""
    return str(model.get("configFile") or MODEL_CONFIG) if isinstance(model, dict) else MODEL_CONFIG


def model_settings(text: bytes | str, strict: bool = True, name: str = MODEL_CONFIG) -> ModelSettings:
    """`text` (a model-config.yaml) read; not YAML: ArchiveError naming `name` where `strict` (build-repo names the
    fault), else no settings (the TorchServe front registers the archive as TorchServe does)."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        if strict:
            raise ArchiveError(f"{name} in the archive is not valid YAML: {first_line(exc)}") from None
        data = {}
    data = data if isinstance(data, dict) else {}

    def integer(key: str) -> int | None:
        value = data.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return ModelSettings(integer("batchSize"), integer("maxBatchDelay"), integer("minWorkers"), integer("maxWorkers"),
                         data)


def label_mapping(mapping) -> dict[str, str]:
    """index_to_name.json's content as ts.utils.util.load_label_mapping reads it (TorchServe 0.12): a mapping of
    class index to a name, or to a list whose last item is the name; or {"object_type_names": [...]}, names in index
    order. ArchiveError, with TorchServe's words, where it would raise."""
    if not isinstance(mapping, dict):
        raise ArchiveError(f'{LABELS}: index->name JSON mapping should be in "class": "label" format.')
    if isinstance(mapping.get("object_type_names"), list):
        return {str(index): str(name) for index, name in enumerate(mapping["object_type_names"])}
    names = {}
    for key, value in mapping.items():
        name = value[-1] if isinstance(value, list) and value else value
        if not isinstance(name, str):
            raise ArchiveError(f"{LABELS}: labels in index->name mapping must be either str or List[str] "
                               f"(class {key}: {value!r})")
        names[str(key)] = name
    return names


def read_labels(archive: zipfile.ZipFile) -> dict[str, str] | None:
    """The archive's index_to_name.json by label_mapping's rule; None where it has none."""
    if LABELS not in archive.namelist():
        return None
    try:
        return label_mapping(json.loads(archive.read(LABELS)))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{LABELS} is not valid JSON: {exc}") from None
