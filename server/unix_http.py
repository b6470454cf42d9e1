"""Connections to Triton's HTTP servers at "HOST:PORT" or at a Unix socket "unix:/PATH" (serve-repo's TorchServe mode
serves Triton on sockets in its private folder only), made in one place: tritonclient's sync and aio clients, a GET."""
from __future__ import annotations

import http.client
import os
import socket
from pathlib import Path

from geventhttpclient.connectionpool import ConnectionPool

UNIX = "unix:"  # libevhtp's prefix, as tritonserver's --http-address / --metrics-address take it
SOCKETS = {"http": "triton.sock", "metrics": "metrics.sock"}  # a private server's, in its private folder


def listen_flags(api: str, host: str, port: int | None, folder: Path) -> list[str]:
    """tritonserver's flags that put `api` (http, grpc, metrics) on host:port, or where `port` is None on its socket
    in `folder` (libevhtp binds "unix:PATH"; port 0: none); gRPC then off, Triton's gRPC server binds no socket."""
    if port is not None:
        return [f"--{api}-port={port}", f"--{api}-address={host}"]
    if api not in SOCKETS:
        return [f"--allow-{api}=false"]
    return [f"--{api}-address={UNIX}{folder / SOCKETS[api]}", f"--{api}-port=0"]


def release_thread_hub() -> None:
    """tritonclient.http's transport (geventhttpclient) gives each thread that calls it a gevent hub with its own
    event loop, which outlives the thread (2 file descriptors each): a short-lived thread releases it as it ends."""
    import gevent

    gevent.get_hub().destroy(destroy_loop=True)


def unlink_socket(path) -> bool:
    """Remove what a dead server left at `path` before a server binds it there; False where the path is too long to
    bind (108 bytes with its NUL, sockaddr_un)."""
    if len(os.fsencode(path)) > 107:
        return False
    Path(path).unlink(missing_ok=True)
    return True


def socket_path(url: str) -> str | None:
    """The socket's path of a "unix:/PATH" address; None for "HOST:PORT"."""
    return url[len(UNIX):] if url.startswith(UNIX) else None


class _UnixPool(ConnectionPool):
    """geventhttpclient's connection pool, its every connection to one Unix socket (what it "resolves" is the path)."""

    def __init__(self, path: str, **options):
        super().__init__("localhost", 80, "localhost", 80, **options)
        self.path = path

    def _resolve(self):
        return [(socket.AF_UNIX, socket.SOCK_STREAM, 0, "", self.path)]


def sync_client(url: str, **options):
    """tritonclient.http's client of Triton at `url` (its options: concurrency, connection_timeout, ...)."""
    import tritonclient.http as httpclient

    path = socket_path(url)
    client = httpclient.InferenceServerClient("localhost" if path else url, **options)
    if path:  # the pool connects lazily: swapped before its first connection
        stub = client._client_stub  # noqa: SLF001 - tritonclient takes no socket of its own
        tcp = stub._connection_pool  # noqa: SLF001
        stub._connection_pool = _UnixPool(path, size=tcp.size, connection_timeout=tcp.connection_timeout,
                                          network_timeout=tcp.network_timeout)
        tcp.close()
    return client


async def aio_client(url: str, **options):
    """tritonclient.http.aio's client of Triton at `url` (its options: conn_limit, conn_timeout); in a running loop."""
    import aiohttp
    import tritonclient.http.aio as aioclient

    path = socket_path(url)
    client = aioclient.InferenceServerClient("localhost" if path else url, **options)
    if path:  # its aiohttp session, unused yet, replaced by one whose connector is the socket's
        tcp = client._stub  # noqa: SLF001
        client._conn = aiohttp.UnixConnector(path=path, limit=tcp.connector.limit)  # noqa: SLF001
        client._stub = aiohttp.ClientSession(connector=client._conn, timeout=tcp.timeout,  # noqa: SLF001
                                             auto_decompress=False)
        await tcp.close()
    return client


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = connect(f"{UNIX}{self.path}", self.timeout)


def connect(url: str, timeout: float) -> socket.socket:
    """A connected socket to `url`; OSError where nothing listens there."""
    path = socket_path(url)
    if path is None:
        host, _, port = url.rpartition(":")
        return socket.create_connection((host, int(port)), timeout=timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def get(url: str, target: str, timeout: float) -> bytes:
    """The body of a GET of `target` (e.g. /metrics) at `url`; OSError where it fails or does not answer 200."""
    path = socket_path(url)
    if path is None:
        host, _, port = url.rpartition(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    else:
        connection = _UnixConnection(path, timeout)
    try:
        connection.request("GET", target)
        reply = connection.getresponse()
        body = reply.read()
    except http.client.HTTPException as exc:
        raise OSError(f"GET {target}: {exc!r}") from None
    finally:
        connection.close()
    if reply.status != 200:
        raise OSError(f"GET {target}: HTTP {reply.status}")
    return body
