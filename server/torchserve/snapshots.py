"""TorchServe 0.12's config snapshots (its docs/snapshot.md, SnapshotManager, FSSnapshotSerializer): after the start,
every registration, scale, unregistration and set-default, and at the stop, LOG_LOCATION/config/<yyyyMMddHHmmssSSS>-
startup|snapshot|shutdown.cfg holds the configuration the front started with plus `model_snapshot`, the registrations
as TorchServe writes them; a start given no config file starts from the newest one (unless --ncs)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit

from server.errors import ServerError

STAMP = "%Y%m%d%H%M%S"  # and the milliseconds: Java's yyyyMMddHHmmssSSS, in local time as TorchServe's
# Gson's default escaping (HTML-safe), which TorchServe's model_snapshot carries
_GSON = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "=": "\\u003d", "'": "\\u0027"}
# what Model.setModelState reads as integers (getAsInt: one missing fails TorchServe's restore)
REQUIRED = ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay")
OPTIONAL = ("responseTimeout", "startupTimeout")
UNSAVED = ("The change is made, but its config snapshot could not be written (the log says why): a restart "
           "would not have it")
KEEP = 10  # snapshots kept (serve-repo --keep-snapshots): the newest, by the time in their names


def folder(cwd: Path | None = None) -> Path:
    """Where TorchServe writes them: $LOG_LOCATION/config, else logs/config, from the working directory."""
    return (cwd or Path.cwd()) / (os.environ.get("LOG_LOCATION") or "logs") / "config"


def stamp_of(name: str) -> datetime | None:
    """The time a snapshot's file name starts with (before its first '-'), or None."""
    prefix = name.split("-")[0]
    if not re.fullmatch(r"\d{17}", prefix):
        return None
    try:
        return datetime.strptime(prefix[:14], STAMP).replace(microsecond=int(prefix[14:]) * 1000)
    except ValueError:
        return None


def newest_first(where: Path) -> list[Path]:
    """The snapshots in `where`, newest first by their names' time, as TorchServe picks them (a file whose name has
    none is skipped: TorchServe fails on it)."""
    if not where.is_dir():
        return []
    found = [(stamp, path.name, path) for path in where.iterdir() if path.is_file() and (stamp := stamp_of(path.name))]
    return [path for _, _, path in sorted(found, reverse=True)]


def latest(where: Path) -> Path | None:
    """The newest snapshot in `where`, or None."""
    return next(iter(newest_first(where)), None)


def models_of(text: str) -> dict[str, dict[str, dict]]:
    """model_snapshot's registrations, name -> version -> state, checked as TorchServe's restore reads them; a
    ValueError names what is wrong."""
    snapshot = json.loads(text)
    models = snapshot.get("models") if isinstance(snapshot, dict) else None
    if not isinstance(models, dict):
        raise ValueError('expected {"models": {"NAME": {"VERSION": {"marName": ..., ...}}}}')
    for name, versions in models.items():
        if not isinstance(versions, dict):
            raise ValueError(f"model {name}: expected its versions")
        for version, entry in versions.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("marName"), str):
                raise ValueError(f"model {name} version {version}: no marName")
            for key in REQUIRED + OPTIONAL:
                value = entry.get(key)
                if (value is not None or key in REQUIRED) and (type(value) is not int):
                    raise ValueError(f"model {name} version {version}: {key} is not an integer")
    return models


def missing(models: dict[str, dict[str, dict]], store: Path) -> str | None:
    """TorchServe's refusal of a snapshot naming an archive the model store lacks, or None."""
    for name, versions in models.items():
        for version, entry in versions.items():
            if not (store / entry["marName"]).exists():
                return f"Model archive file for model :{name}, version :{version} not found in model store"
    return None


def changed_archive(models: dict[str, dict[str, dict]], store: Path) -> str | None:
    """Why a snapshot's registration would restore another archive than the one registered (the store's file is not
    the one whose sha256 the snapshot recorded), or None: such a start is refused, never served under the name."""
    for name, versions in models.items():
        for version, entry in versions.items():
            recorded = entry.get("sha256")
            if isinstance(recorded, str) and _sha256(store / entry["marName"]) != recorded:
                return (f"the model store's {entry['marName']} is not the archive registered as model :{name}, "
                        f"version :{version} (its sha256 differs from the snapshot's)")
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def mar_name(url: str) -> str:
    """TorchServe's marName: the file name of the registration's url (ArchiveUtils.getFilenameFromUrl)."""
    return Path(urlsplit(url).path if "://" in url else url).name


def state(registry) -> dict[str, dict[str, dict]]:
    """The registry's registrations as Model.getModelState writes them."""
    models = {}
    for name, versions in list(registry.models.items()):
        default = registry.defaults.get(name)
        models[name] = {version: {
            "defaultVersion": version == default, "marName": mar_name(model.info.url),
            **dict(zip(("minWorkers", "maxWorkers"), model.bounds or (model.workers, model.workers))), "batchSize": model.batch_size, "maxBatchDelay": model.max_batch_delay,
            "responseTimeout": model.response_timeout, "startupTimeout": model.startup_timeout,
            "runtimeType": "python",
            # not TorchServe's (its restore ignores it): the archive registered, checked at a restore (issue 52)
            "sha256": model.info.sha256} for version, model in list(versions.items())}
    return models


def _escape(text: str, key: bool) -> str:
    """java.util.Properties.store's escaping (a Writer: no \\uXXXX)."""
    out = []
    for i, char in enumerate(text):
        if char == " ":
            out.append("\\ " if key or i == 0 else " ")
        elif char in "\t\n\r\f":
            out.append({"\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f"}[char])
        elif char in "\\=:#!":
            out.append("\\" + char)
        else:
            out.append(char)
    return "".join(out)


def properties_text(entries: dict[str, str], when: float) -> str:
    """`entries` as Properties.store(writer, "Saving snapshot") writes them."""
    header = f"#Saving snapshot\n#{time.strftime('%a %b %d %H:%M:%S %Z %Y', time.localtime(when))}\n"
    return header + "".join(f"{_escape(key, True)}={_escape(value, False)}\n" for key, value in entries.items())


class Snapshots:
    """One run's snapshots: `properties` (the configuration it started with) and the registry's state."""

    def __init__(self, registry, properties: dict[str, str], where: Path, log=print, keep: int = KEEP):
        self.registry, self.properties, self.where, self.log = registry, properties, where, log
        self.keep = keep  # the newest this many are kept (0: all, as TorchServe)
        self._lock = threading.Lock()
        self._last = 0  # milliseconds of the last name written: each is later (TorchServe drops one whose name exists)

    def save(self, kind: str) -> Path | None:
        """LOG_LOCATION/config/<time>-KIND.cfg written whole and durable (a temporary file written and fsynced, renamed
        into place, the folder fsynced: a crash at any instant leaves the previous or the new one whole), the older
        ones beyond `keep` removed; or None (logged, as TorchServe logs a snapshot it could not save)."""
        with self._lock:
            now = max(int(time.time() * 1000), self._last + 1)
            while True:
                name = f"{datetime.fromtimestamp(now / 1000).strftime(STAMP)}{now % 1000:03d}-{kind}.cfg"
                if not (self.where / name).exists():
                    break
                now += 1
            self._last = now
            models = state(self.registry)
            snapshot = {"name": name, "modelCount": sum(len(v) for v in models.values()), "created": now,
                        "models": models}
            text = json.dumps(snapshot, indent=2, ensure_ascii=False)
            for char, escaped in _GSON.items():  # only inside strings: JSON has these nowhere else
                text = text.replace(char, escaped)
            try:
                self.where.mkdir(parents=True, exist_ok=True)
                # beside the folder, not in it: TorchServe reads every file there as a snapshot
                fd, temporary = tempfile.mkstemp(prefix=".snapshot-", dir=self.where.parent)
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    out.write(properties_text({**self.properties, "model_snapshot": text}, now / 1000))
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(temporary, self.where / name)
                _fsync_folder(self.where)
            except OSError as exc:
                self.log(f"snapshot {name} not saved: {exc}")
                return None
            self._prune()
            return self.where / name

    def changed(self) -> None:
        """After a client's change: its snapshot on disk, else ServerError -- the change is made, but a restart would
        not have it, and its caller is told so rather than answered as if it were durable (issue 52)."""
        if self.save("snapshot") is None:
            raise ServerError(UNSAVED)

    def _prune(self) -> None:
        """The snapshots beyond the newest `keep` removed (by the time in their names)."""
        if self.keep <= 0:
            return
        found = sorted((stamp, path.name, path) for path in self.where.iterdir()
                       if path.is_file() and (stamp := stamp_of(path.name)))
        for _, _, old in found[:-self.keep]:
            try:
                old.unlink()
            except OSError as exc:
                self.log(f"snapshot {old.name} not removed: {exc}")


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
