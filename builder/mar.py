"""Read a TorchServe model archive (.mar): its manifest, weights, model file, labels and batching."""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from builder.weights import WeightsError

MANIFEST = "MAR-INF/MANIFEST.json"
# TorchServe's built-in handler whose preprocessing we reproduce exactly (builder.weights.IMAGENET).
IMAGE_CLASSIFIER = ("image_classifier", "ts.torch_handler.image_classifier")
MAX_MEMBER_BYTES = 4 << 30  # a zip bomb's member claims more


class ArchiveError(WeightsError):
    """The archive cannot be migrated; the message is one line."""


@dataclass
class Archive:
    path: Path
    name: str  # the archive's model name
    handler: str
    serialized_file: Path  # extracted
    model_file: Path | None  # extracted; None for TorchScript archives
    extra_files: list[Path] = field(default_factory=list)  # extracted
    labels_file: Path | None = None
    config: dict = field(default_factory=dict)  # model-config.yaml, if the archive has one

    @property
    def image_classifier(self) -> bool:
        return self.handler.removesuffix(".py") in IMAGE_CLASSIFIER

    @property
    def batch_size(self) -> int | None:
        return _int(self.config, "batchSize")

    @property
    def max_batch_delay_ms(self) -> float | None:
        value = self.config.get("maxBatchDelay")
        return float(value) if isinstance(value, (int, float)) else None

    @property
    def workers(self) -> int | None:
        return _int(self.config, "minWorkers")


def manifest(path: Path) -> dict:
    """MAR-INF/MANIFEST.json of the archive, checked enough to tell what is missing."""
    if not path.is_file():
        raise ArchiveError(f"{path} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            try:
                data = json.loads(archive.read(MANIFEST))
            except KeyError:
                raise ArchiveError(f"{path} has no {MANIFEST}: not a model archive made by "
                                   "torch-model-archiver") from None
    except zipfile.BadZipFile:
        raise ArchiveError(f"{path} is not a model archive (.mar files are zip files; this is not one)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{path}: {MANIFEST} is not valid JSON: {exc}") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not model.get("modelName"):
        raise ArchiveError(f"{path}: {MANIFEST} has no model.modelName")
    return data


def read(path: Path, workdir: Path) -> Archive:
    """Extract what a migration needs into `workdir` (nothing outside it, nothing executed)."""
    model = manifest(path)["model"]
    serialized = model.get("serializedFile")
    if not serialized:
        raise ArchiveError(f"{path}: the manifest names no serializedFile (weights)")
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: info for info in archive.infolist() if not info.is_dir()}

        def extract(name: str, what: str) -> Path:
            if name not in members:
                raise ArchiveError(f"{path}: the manifest's {what} {name!r} is not in the archive")
            info = members[name]
            parts = PurePosixPath(name).parts
            if PurePosixPath(name).is_absolute() or ".." in parts:
                raise ArchiveError(f"{path}: member {name!r} points outside the archive")
            if info.file_size > MAX_MEMBER_BYTES:
                raise ArchiveError(f"{path}: member {name!r} claims {info.file_size:,} bytes")
            target = workdir.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, open(target, "wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
            return target

        weights = extract(serialized, "serializedFile")
        model_file = extract(model["modelFile"], "modelFile") if model.get("modelFile") else None
        extra = [extract(name, "extra file") for name in members
                 if name not in (serialized, model.get("modelFile"), MANIFEST) and not name.startswith("MAR-INF/")
                 and "/" not in name]  # extra files sit at the archive's root
    labels = next((p for p in extra if p.name == "index_to_name.json"), None)
    config_name = model.get("configFile") or "model-config.yaml"
    config_file = next((p for p in extra if p.name == config_name), None)
    return Archive(path, model["modelName"], str(model.get("handler") or ""), weights, model_file,
                   [p for p in extra if p.suffix == ".py"], labels, _yaml(config_file) if config_file else {})


def _yaml(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ArchiveError(f"{path.name} in the archive is not valid YAML: {str(exc).splitlines()[0]}") from None
    return data if isinstance(data, dict) else {}


def _int(config: dict, key: str) -> int | None:
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
