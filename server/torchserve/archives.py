"""A model store's archives: where a registration's url points, its manifest and labels, its build, cached."""
from __future__ import annotations

import hashlib
import http.client
import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from common.archive import (MANIFEST, ArchiveError, ModelSettings, config_name, model_settings, read_labels,
                            read_manifest)
from common.build_request import BuildRequest
from common.build_result import BuildResult
from common.messages import first_line
from server.torchserve.refusals import Refusal

BUILD_RESULT = "build.json"  # build-repo --json's result, kept in its build in the cache
MAX_DOWNLOAD_BYTES = 4 << 30  # an http(s) url is fetched into the store up to this much
DOWNLOAD_DEADLINE_S = 600  # and within this (a byte per minute would hold a thread for ever)
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


# TorchServe's allowed_urls default (config.properties): what a registration's url may be, as whole-string regexes.
DEFAULT_ALLOWED_URLS = ("file://.*", "http(s)?://.*")


def locate(url: str, store: Path, max_bytes: int = MAX_DOWNLOAD_BYTES,
           allowed_urls: tuple[str, ...] | None = None, fetch: bool = True) -> Path | None:
    """The archive file `url` names, as TorchServe 0.12 resolves it: a path is a file in the model store (an absolute
    one only where it lies in the store; `..` is refused); a file:// or http(s):// URL must match `allowed_urls`
    (TorchServe's default where None), and an http(s) one is fetched into the store -- but not from a loopback,
    link-local or unspecified address unless allowed_urls was configured (a registration must not reach this
    machine's own services, Triton's private ports among them). Refusals say nothing of what exists there. Not
    `fetch`: an http(s) URL's refusals only (a registration answered before its download): None where admitted."""
    if ".." in url:
        raise Refusal(f"Relative path is not allowed in url: {url}", "ModelNotFoundException")
    patterns = allowed_urls or DEFAULT_ALLOWED_URLS
    if "://" in url and not re.match(r"(?i)(file?|https?)://", url) and \
            not any(re.fullmatch(pattern, url) for pattern in patterns):
        # another scheme, not allowed: TorchServe's ArchiveUtils takes the URL's file name as a name in the store
        path = store / PurePosixPath(urlsplit(url).path).name
    elif "://" in url:
        parts = urlsplit(url)
        if not any(re.fullmatch(pattern, url) for pattern in patterns) or parts.scheme not in ("file", "http", "https") \
                or (parts.scheme != "file" and allowed_urls is None and _own_machine(parts.hostname)):
            raise Refusal(f"Given URL {url} does not match any allowed URL(s)", "ModelNotFoundException")
        if parts.scheme != "file" and not fetch:
            if (target := downloaded(url, store)).exists():  # TorchServe's refusal, before any download
                raise _exists(target)
            return None
        if parts.scheme != "file":
            return _download(url, store, max_bytes)
        path = Path(parts.path)
    else:  # a path: the store's (an absolute one only where it lies in the store, links followed)
        path = store / url
        if not path.resolve().is_relative_to(store.resolve()):
            raise Refusal(f"Model not found at: {url}", "ModelNotFoundException")
    if not path.is_file():
        raise Refusal(f"Model not found at: {url}", "ModelNotFoundException")
    return path


def _own_machine(host: str | None) -> bool:
    """True where `host` is empty or resolves to a loopback, link-local or unspecified address; a host that does not
    resolve is not this machine (False): its download fails as TorchServe's does."""
    if not host:
        return True
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False  # no address: the download fails as TorchServe's does
    addresses = [ipaddress.ip_address(address.split("%")[0]) for address in found]
    return any(a.is_loopback or a.is_link_local or a.is_unspecified for a in addresses)


def downloaded(url: str, store: Path) -> Path | None:
    """Where an http(s) `url` is downloaded to in the store (TorchServe: the store, under the URL's file name), or
    None for a path or file:// URL (the operator's file: never removed by us)."""
    if urlsplit(url).scheme not in ("http", "https"):
        return None
    return store / (Path(urlsplit(url).path).name or "model.mar")


def adopted(path: Path, url: str, store: Path) -> Path:
    """A file:// url's archive copied into the store under its file name, as TorchServe 0.12 copies it (a restart
    finds it there, and the snapshot names that copy); refused where the store has a file of that name (TorchServe's
    "Model file already exists NAME.mar"), but for the store's own file. `path` itself for any other url."""
    if urlsplit(url).scheme.lower() != "file":
        return path
    target = store / path.name
    if target.exists() and target.resolve() == path.resolve():
        return path
    if target.exists():
        raise _exists(target)
    fd, partial = tempfile.mkstemp(prefix=".adopt-", dir=store)
    try:
        with os.fdopen(fd, "wb") as sink, open(path, "rb") as source:
            shutil.copyfileobj(source, sink, 1 << 20)
            sink.flush()
            os.fsync(sink.fileno())  # whole on disk before a snapshot names it
        try:
            os.link(partial, target)  # never replaces a file another registration took meanwhile
        except FileExistsError:
            raise _exists(target) from None
    except OSError as exc:
        raise Refusal(f"Model not found at: {url}", "ModelNotFoundException", reason=first_line(exc)) \
            from None
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def copied(url: str, path: Path, store: Path) -> bool:
    """Whether `path` is the store's copy of `url` made for its registration (downloaded, or a file:// url's archive
    adopted): removed with the registration, as TorchServe 0.12 removes it; never the operator's own file."""
    if urlsplit(url).scheme.lower() == "file":
        return path.parent == store and Path(urlsplit(url).path).resolve() != path.resolve()
    return path == downloaded(url, store)


def _exists(target: Path) -> Refusal:
    return Refusal(f"Model file already exists {target.name}", "InternalServerException")


def _download(url: str, store: Path, max_bytes: int) -> Path:
    target = downloaded(url, store)
    if target.exists():  # as TorchServe 0.12: never reused (it may be another host's file of that name), never replaced
        raise _exists(target)
    partial = Path(tempfile.mkstemp(prefix=".download-", dir=store)[1])
    try:
        deadline = time.monotonic() + DOWNLOAD_DEADLINE_S
        with urllib.request.urlopen(url, timeout=60) as reply, open(partial, "wb") as sink:
            total = 0
            # read1: what has arrived, so that the deadline is checked between reads even when bytes drip in (a body
            # cut short of its Content-Length is caught below, or raises IncompleteRead)
            while chunk := reply.read1(1 << 20):
                if time.monotonic() > deadline:
                    raise Refusal(f"Failed to download archive from: {url}", kind="DownloadArchiveException",
                                  reason=f"not done within {DOWNLOAD_DEADLINE_S} s")
                total += len(chunk)
                if total > max_bytes:
                    raise Refusal(f"Failed to download archive from: {url}", kind="DownloadArchiveException",
                                  reason=f"over {max_bytes:,} bytes")
                sink.write(chunk)
            declared = reply.headers.get("Content-Length")
        # Only a whole archive enters the store (a later registration of the same file name would be served it).
        if declared and declared.isdigit() and int(declared) != total or not zipfile.is_zipfile(partial):
            raise Refusal(f"Failed to download archive from: {url}", kind="DownloadArchiveException",
                          reason="not a model archive, or cut off")
        try:
            os.link(partial, target)  # not os.replace: a registration that took this name meanwhile keeps its file
        except FileExistsError:
            raise _exists(target) from None
    except Refusal:
        raise
    except (OSError, ValueError, http.client.HTTPException) as exc:
        # TorchServe's message, without the reason (it would tell open ports from closed ones); the log has it.
        raise Refusal(f"Failed to download archive from: {url}", kind="DownloadArchiveException",
                      reason=first_line(exc)) from None
    finally:
        partial.unlink(missing_ok=True)
    return target


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
    command = [sys.executable, "-m", "builder.cli", *replace(request, archive=info.path, output=staging / "repo").to_argv()]
    log(f"building {triton_name} from {info.path.name}: build-repo {' '.join(command[3:])}")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
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
