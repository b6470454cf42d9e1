"""Read a TorchServe model archive (.mar): its manifest, weights, model file, labels and batching."""
from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from builder.options import WeightsError
from common import archive as archives
from common.archive import MANIFEST

# TorchServe's built-in handler whose preprocessing we reproduce exactly (builder.options.IMAGENET).
IMAGE_CLASSIFIER = ("image_classifier", "ts.torch_handler.image_classifier")
# What a migration extracts, in all (the weights dominate: ResNet-152 is 0.24 GB, ViT-H/14 2.5 GB); more
# is refused before a byte is written. `build-repo --max-archive-gb` changes it.
DEFAULT_MAX_EXTRACTED_BYTES = 8 << 30
# Model weights barely compress (float32: ~1.1x in a zip); a member that claims more than this many times
# its compressed size, and more than RATIO_FLOOR_BYTES, is a zip bomb (4 GB of zeros: ~1000x).
MAX_RATIO = 100
RATIO_FLOOR_BYTES = 16 << 20


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
    settings: archives.ModelSettings = field(default_factory=archives.ModelSettings)  # its model-config.yaml's

    @property
    def image_classifier(self) -> bool:
        return self.handler.removesuffix(".py") in IMAGE_CLASSIFIER

    @property
    def batch_size(self) -> int | None:
        return self.settings.batch_size

    @property
    def max_batch_delay_ms(self) -> int | None:
        return self.settings.max_batch_delay

    @property
    def workers(self) -> int | None:
        return self.settings.min_workers


def manifest(path: Path) -> dict:
    """MAR-INF/MANIFEST.json of the archive, checked enough to tell what is missing."""
    if not path.is_file():
        raise ArchiveError(f"{path} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            return archives.read_manifest(archive)
    except zipfile.BadZipFile:
        raise ArchiveError(f"{path} is not a model archive (.mar files are zip files; this is not one)") from None
    except archives.ArchiveError as exc:
        raise ArchiveError(f"{path}: {exc}") from None


def read(path: Path, workdir: Path, max_bytes: int = DEFAULT_MAX_EXTRACTED_BYTES) -> Archive:
    """Extract what a migration needs into `workdir` (nothing outside it, nothing executed, at most
    `max_bytes` in all: checked on the sizes the archive declares before extracting, and counted while
    extracting, since a crafted archive can declare less than it holds)."""
    model = manifest(path)["model"]
    serialized = model.get("serializedFile")
    if not serialized:
        raise ArchiveError(f"{path}: the manifest names no serializedFile (weights)")
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: info for info in archive.infolist() if not info.is_dir()}
        for name, what in ((serialized, "serializedFile"), (model.get("modelFile"), "modelFile")):
            if name and name not in members:
                raise ArchiveError(f"{path}: the manifest's {what} {name!r} is not in the archive")
        wanted = [serialized, *([model["modelFile"]] if model.get("modelFile") else []),
                  *(name for name in members if name not in (serialized, model.get("modelFile"), MANIFEST)
                    and not name.startswith("MAR-INF/") and "/" not in name)]  # extra files sit at the root
        _check_sizes(path, [members[name] for name in wanted], max_bytes)
        written = [0]

        def extract(name: str) -> Path:
            return _extract(archive, members[name], path, workdir, written, max_bytes)

        try:
            weights = extract(serialized)
            model_file = extract(model["modelFile"]) if model.get("modelFile") else None
            extra = [extract(name) for name in wanted[1 + (model_file is not None):]]
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # e.g. a member longer than it declares
            raise ArchiveError(f"{path} is corrupt ({exc}); nothing was written") from None
    labels = next((p for p in extra if p.name == archives.LABELS), None)
    config_file = next((p for p in extra if p.name == archives.config_name(model)), None)
    return Archive(path, model["modelName"], str(model.get("handler") or ""), weights, model_file,
                   [p for p in extra if p.suffix == ".py"], labels, read_settings(config_file))


def unpack(path: Path, workdir: Path, max_bytes: int = DEFAULT_MAX_EXTRACTED_BYTES) -> dict:
    """Extract every member (MAR-INF/MANIFEST.json and folders included: a handler may read any of them) into
    `workdir`, under read()'s limits; nothing is executed. Returns the manifest."""
    data = manifest(path)
    with zipfile.ZipFile(path) as archive:
        infos = [info for info in archive.infolist() if not info.is_dir()]
        _check_sizes(path, infos, max_bytes)
        written = [0]
        try:
            for info in infos:
                _extract(archive, info, path, workdir, written, max_bytes)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise ArchiveError(f"{path} is corrupt ({exc}); nothing was written") from None
    return data


def _extract(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: Path, workdir: Path, written: list[int],
             max_bytes: int) -> Path:
    """One member into `workdir` (never outside it), its bytes counted into written[0] against `max_bytes`."""
    name = info.filename
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or ".." in parts:
        raise ArchiveError(f"{path}: member {name!r} points outside the archive")
    target = workdir.joinpath(*parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    with archive.open(info) as source, open(target, "wb") as sink:
        while chunk := source.read(1 << 20):
            written[0] += len(chunk)
            if written[0] > max_bytes:
                sink.close()
                target.unlink()
                raise ArchiveError(f"{path}: member {name!r} expands past the {_gb(max_bytes)} limit on "
                                   "what a migration extracts (the archive declares less than it holds); "
                                   "nothing was written")
            sink.write(chunk)
    return target


def _check_sizes(path: Path, infos: list[zipfile.ZipInfo], max_bytes: int) -> None:
    """Refuse, before extracting anything, a zip bomb's member or more than `max_bytes` in all."""
    for info in infos:
        if info.file_size > RATIO_FLOOR_BYTES and info.file_size > MAX_RATIO * max(info.compress_size, 1):
            raise ArchiveError(f"{path}: member {info.filename!r} claims {info.file_size:,} bytes from "
                               f"{info.compress_size:,} compressed (over {MAX_RATIO}x: model weights barely "
                               "compress); refusing to extract it")
    total = sum(info.file_size for info in infos)
    if total > max_bytes:
        raise ArchiveError(f"{path}: its members claim {total:,} bytes, over the {_gb(max_bytes)} limit on what a "
                           "migration extracts (--max-archive-gb raises it)")


def _gb(size: int) -> str:
    return f"{size / (1 << 30):g} GiB"


def read_settings(path: Path | None) -> archives.ModelSettings:
    """An extracted model-config.yaml by common/archive.py's one rule (none: no settings); not YAML: ArchiveError."""
    if path is None or not path.is_file():
        return archives.ModelSettings()
    try:
        return archives.model_settings(path.read_bytes(), name=path.name)
    except archives.ArchiveError as exc:
        raise ArchiveError(str(exc)) from None
