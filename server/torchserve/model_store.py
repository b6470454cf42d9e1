"""The model store: where a registration's url points, as TorchServe 0.12 resolves it (allowed_urls, paths in the
store), and how an archive enters the store (downloaded, or a file:// url's archive copied) and leaves it."""
from __future__ import annotations

import http.client
import ipaddress
import os
import re
import shutil
import socket
import tempfile
import time
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from common.messages import first_line
from server.torchserve.refusals import Refusal

MAX_DOWNLOAD_BYTES = 4 << 30  # an http(s) url is fetched into the store up to this much
DOWNLOAD_DEADLINE_S = 600  # and within this (a byte per minute would hold a thread for ever)

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
