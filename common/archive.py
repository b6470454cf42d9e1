"""A TorchServe model archive (.mar) as TorchServe reads it: its manifest and its labels, by one rule, for build-repo
and the TorchServe front alike (backends/ts_worker.py leaves the unpacked archive to TorchServe's own loader)."""
from __future__ import annotations

import json
import zipfile

MANIFEST = "MAR-INF/MANIFEST.json"
LABELS = "index_to_name.json"  # where TorchServe's handlers find class names (BaseHandler: the archive's root)


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
