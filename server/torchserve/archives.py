"""A registered archive: its manifest, labels and settings, and its build by build-repo --from-mar, cached (where its
url points and how it enters the store: model_store.py)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

from common.archive import (MANIFEST, ArchiveError, ModelSettings, config_name, model_settings, read_labels,
                            read_manifest)
from common.build_request import BuildRequest
from common.build_result import BuildResult
from common.warm import Warm
from server.torchserve.refusals import Refusal

BUILD_RESULT = "build.json"  # build-repo --json's result, kept in its build in the cache
_ROOT = Path(__file__).resolve().parents[2]
# build-repo, forked from a process that has imported it (common/warm.py): a registration's build after the first
# skips torch's import (~85 % of a small model's build); that process stops after 5 idle minutes.
BUILD_REPO = Warm("builder.cli", env={**os.environ, "PYTHONPATH": os.pathsep.join(
    filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))})
MAX_CONFIG_BYTES = 1 << 20  # a model-config.yaml larger than this is not read for its minWorkers


@dataclass(frozen=True)
class ArchiveInfo:
    path: Path
    url: str  # as registered (TorchServe's modelUrl)
    name: str  # the manifest's modelName
    version: str  # the manifest's modelVersion
    handler: str
    labels: dict[str, str] | None  # index_to_name.json as TorchServe's handlers read it
    sha256: str
    min_workers: int | None = None  # model-config.yaml's minWorkers where TorchServe takes it (_archive_workers)
    # model-config.yaml's batchSize / maxBatchDelay where positive: a registration that names none takes them
    # (ModelManager.createModel), else 1 and 100 ms
    batch_size: int | None = None
    max_batch_delay: int | None = None


def inspect(path: Path, url: str) -> ArchiveInfo:
    """Manifest, handler and labels of the archive at `path` (nothing extracted but these two small files)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as source:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
        with zipfile.ZipFile(path) as archive:
            manifest = read_manifest(archive, named=False)
            model = (manifest.get("model") if isinstance(manifest, dict) else None) or {}
            names = set(archive.namelist())
            try:
                labels = read_labels(archive)
            except ArchiveError:  # TorchServe's handler would fail to load; build-repo says why
                labels = None
            config = config_name(model)
            small = config in names and archive.getinfo(config).file_size <= MAX_CONFIG_BYTES
            settings = model_settings(archive.read(config), strict=False) if small else ModelSettings()
    except (zipfile.BadZipFile, ArchiveError, KeyError, UnicodeDecodeError, OSError, AttributeError):
        raise Refusal(f"Model name is not defined: {url} is not a model archive (.mar)") from None
    if not isinstance(model, dict) or not model.get("modelName"):
        raise Refusal("Model name is not defined.")
    return ArchiveInfo(path, url, str(model["modelName"]), str(model.get("modelVersion") or "1.0"),
                       str(model.get("handler") or ""), labels, digest.hexdigest(),
                       _archive_workers(settings), _positive(settings.batch_size), _positive(settings.max_batch_delay))


def _positive(value: int | None) -> int | None:
    return value if value is not None and value > 0 else None


def _archive_workers(settings: ModelSettings) -> int | None:
    """minWorkers where TorchServe 0.12 registers with it (ApiUtils.handleRegister: over initial_workers): a positive
    minWorkers with a maxWorkers at least as large."""
    low, high = settings.min_workers, settings.max_workers
    return low if low is not None and high is not None and 0 < low <= high else None


def build_registered(info: ArchiveInfo, handler: str | None, request: BuildRequest, cache: Path,
                     log=print) -> tuple[Path, BuildResult]:
    """build() of a registration's archive: with `handler` (TorchServe's `handler` parameter) in place of the
    manifest's where given, from a copy of the archive that is removed once built."""
    made = with_handler(info, handler, cache / "handlers") if handler is not None else info
    try:
        return build(made, request, cache, log)
    finally:
        if made is not info:
            made.path.unlink(missing_ok=True)


def build(info: ArchiveInfo, request: BuildRequest, cache: Path, log=print) -> tuple[Path, BuildResult]:
    """A model repository holding `request.name` (+ _preprocess, _image) built by build-repo from the archive, and
    build-repo's result (--json: which model is what), cached by the archive's checksum and the build's options: a
    restart or a second registration reuses it."""
    triton_name = request.name
    key = hashlib.sha256(json.dumps([info.sha256, triton_name, request.options()]).encode()).hexdigest()[:24]
    built = cache / key
    try:
        result = BuildResult.from_json((built / BUILD_RESULT).read_text())
        os.utime(built)  # used now: the last a prune removes
        return built, result
    except (OSError, ValueError):  # not built yet (or by a serve-repo that kept no result): built now
        pass
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache))
    argv = replace(request, archive=info.path, output=staging / "repo").to_argv()
    log(f"building {triton_name} from {info.path.name}: build-repo {' '.join(argv)}")
    done = BUILD_REPO.run(argv)
    try:
        result = BuildResult.from_json(done.stdout)
    except ValueError:  # build-repo died before it could say (killed, a crash): its status, and stderr in the log
        log(f"build-repo for {triton_name} failed: {done.stderr.strip()[-2000:]}")
        result = BuildResult(error=f"build-repo failed (exit status {done.returncode})", status=done.returncode or 1)
    if done.returncode != 0 or result.error is not None:
        shutil.rmtree(staging, ignore_errors=True)
        raise Refusal(f"Failed to load model {info.name}: {result.error}", "InternalServerException")
    shutil.rmtree(built, ignore_errors=True)
    os.replace(staging / "repo", built)
    shutil.rmtree(staging, ignore_errors=True)
    result = replace(result, repository=str(built))
    (built / BUILD_RESULT).write_text(result.to_json())  # last: its presence marks a whole build
    return built, result


def link(built: Path, member: str, repository: Path) -> Path:
    """The built model `member` linked into the served `repository` (its folder there made anew), but for its
    config.pbtxt: the caller writes that one as served (workers, max_pixels). Returns the folder."""
    target = repository / member
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for item in (built / member).iterdir():
        if item.name != "config.pbtxt":
            (target / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    return target


KEEP_UNUSED_BUILDS = 8  # builds no registration serves that the cache keeps (the most recently used)


def prune(cache: Path, in_use: set[Path], keep: int = KEEP_UNUSED_BUILDS) -> list[Path]:
    """Remove the cache's builds that no registration serves but the `keep` most recently used: registering one
    archive with batch sizes 1..1000 would otherwise leave 1000 builds (each with its weights) on disk."""
    if not cache.is_dir():
        return []
    unused = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".") and p not in in_use]
    unused.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in unused[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return unused[keep:]


def with_handler(info: ArchiveInfo, handler: str, folder: Path) -> ArchiveInfo:
    """`info`'s archive with its manifest's handler replaced, as TorchServe 0.12 applies a registration's `handler`
    (ModelManager.createModelArchive: model.setHandler): a copy in `folder`, every other member unchanged."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".handler-", suffix=".mar", dir=folder)
    os.close(fd)
    with zipfile.ZipFile(info.path) as source, zipfile.ZipFile(name, "w", zipfile.ZIP_STORED) as copy:
        for member in source.infolist():
            if member.filename == MANIFEST:
                manifest = read_manifest(source, named=False)  # read as every reader of ours reads it
                manifest.setdefault("model", {})["handler"] = handler
                copy.writestr(member, json.dumps(manifest, indent=4))
            else:
                with source.open(member) as reading, copy.open(member, "w") as writing:
                    shutil.copyfileobj(reading, writing, 1 << 20)
    digest = hashlib.sha256(Path(name).read_bytes()).hexdigest()
    return replace(info, path=Path(name), handler=handler, sha256=digest)
