"""What the proxy's connections cost: HAProxy's resident memory per idle connection, per connection sending a body,
and per HTTP/2 stream sending a gRPC message on one connection (proxy/haproxy.cfg as serve-repo runs it).

    python -m perf.proxy_memory --out perf/results/proxy-memory.json

No Triton is needed: every body is sent in part only, so nothing reaches the upstream (a closed port); the proxy
holds each partial body in its buffer until `timeout http-request` (10 s). Connections come from 127.0.0.2,
127.0.0.3, ... (all of 127.0.0.0/8 is loopback on Linux), each address up to the per-client cap."""
from __future__ import annotations

import platform
import resource
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

from common.cli import OneLineParser, write_result
from common.procs import free_port
from server.proxy import Proxy, ProxySettings

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, HEADERS, DATA, RST_STREAM, WINDOW_UPDATE, GOAWAY = 4, 1, 0, 3, 8, 7
SETTINGS_MAX_CONCURRENT_STREAMS = 3


def raise_open_files(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def connect_from(source: str, port: int, timeout: float = 5) -> socket.socket:
    """A connection to the proxy on 127.0.0.1:port from `source` (a loopback address: another client)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def sources(count: int, first: int = 2) -> list[str]:
    return [f"127.0.{(first + i) // 254}.{(first + i) % 254 + 1}" for i in range(count)]


# --- HTTP/2 as a client speaks it, the few frames needed (no HPACK table, no Huffman) ---

def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def grpc_headers(path: str = GRPC_INFER, authority: str = "proxy") -> bytes:
    fields = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
              ("content-type", "application/grpc"), ("te", "trailers")]
    return b"".join(_literal(name, value) for name, value in fields)


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes]:
    head = _read_exactly(sock, 9)
    length = int.from_bytes(head[:3], "big")
    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, _read_exactly(sock, length)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed by the proxy")
        data += chunk
    return data


def server_settings(sock: socket.socket) -> dict[int, int]:
    """Send the client preface; the server's first SETTINGS frame as {identifier: value}."""
    sock.sendall(H2_PREFACE + frame(SETTINGS, 0, 0))
    while True:
        kind, flags, _, payload = read_frame(sock)
        if kind == SETTINGS and not flags & 1:
            return {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                    for i in range(0, len(payload), 6)}


def open_partial_grpc_streams(sock: socket.socket, streams: int, declared: int, sent: int) -> None:
    """`streams` ModelInfer calls on one connection, each declaring a `declared`-byte message and sending `sent`
    bytes of it (within a stream's initial window), none finished: each holds a buffer in the proxy."""
    sock.sendall(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 30)))
    body = b"\x00" + struct.pack(">I", declared) + bytes(sent - 5)
    for n in range(streams):
        stream = 2 * n + 1
        sock.sendall(frame(HEADERS, 0x4, stream, grpc_headers()))  # END_HEADERS
        for at in range(0, len(body), 16384):  # the default SETTINGS_MAX_FRAME_SIZE
            sock.sendall(frame(DATA, 0, stream, body[at:at + 16384]))


def refused_streams(sock: socket.socket, wait: float = 1.0) -> tuple[int, bool]:
    """RST_STREAM frames the proxy sent within `wait` s, and whether it ended the connection (GOAWAY or close)."""
    refused, ended, deadline = 0, False, time.monotonic() + wait
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            kind, _, _, _ = read_frame(sock)
        except (TimeoutError, socket.timeout):
            continue
        except (ConnectionError, OSError):
            return refused, True
        refused += kind == RST_STREAM
        ended |= kind == GOAWAY
    return refused, ended


# --- the measurements ---

def start_proxy(workdir: Path, **settings) -> Proxy:
    workdir.mkdir(parents=True, exist_ok=True)
    options = ProxySettings("127.0.0.1", free_port(), free_port(), **settings)
    return Proxy(options, "127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:1", workdir).start()


def _settle(pid: int, seconds: float = 0.5) -> int:
    time.sleep(seconds)
    return rss_kb(pid)


def idle_and_body_cost(proxy: Proxy, count: int, per_client: int, body: int) -> dict:
    """KB of RSS per idle HTTP connection, then per connection with a partial `body`-byte inference POST."""
    port, pid = proxy.settings.http_port, proxy.pid
    addresses = [a for a in sources(-(-count // per_client)) for _ in range(per_client)][:count]
    before = _settle(pid)
    held = [connect_from(address, port) for address in addresses]
    idle = _settle(pid)
    head = (f"POST /v2/models/m/infer HTTP/1.1\r\nHost: p\r\nContent-Type: application/octet-stream\r\n"
            f"Content-Length: {body}\r\n\r\n").encode()
    for sock in held:
        sock.sendall(head + bytes(body - 4096))
    sending = _settle(pid, 1.0)
    for sock in held:
        sock.close()
    return {"connections": count, "rss_before_kb": before, "rss_idle_kb": idle, "rss_sending_kb": sending,
            "idle_kb_per_connection": round((idle - before) / count, 1),
            "sending_kb_per_connection": round((sending - before) / count, 1)}


def h2_stream_cost(proxy: Proxy, streams: int, message: int) -> dict:
    """One gRPC connection opening `streams` ModelInfer calls, each sending most of a `message`-byte message."""
    pid = proxy.pid
    before = _settle(pid)
    sock = connect_from("127.0.0.2", proxy.settings.grpc_port)
    limit = server_settings(sock).get(SETTINGS_MAX_CONCURRENT_STREAMS)
    open_partial_grpc_streams(sock, streams, message, message - 4096)
    peak, refused = before, 0
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        count, ended = refused_streams(sock, 0.25)
        refused += count
        peak = max(peak, rss_kb(pid))
        if ended:
            break
    sock.close()
    return {"streams_opened": streams, "server_max_concurrent_streams": limit, "rst_stream_frames": refused,
            "rss_before_kb": before, "rss_peak_kb": peak, "peak_mb_over_idle": round((peak - before) / 1024, 1),
            "kb_per_stream_opened": round((peak - before) / streams, 1)}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {platform.machine()}"
    return platform.machine()


def main(argv=None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--connections", type=int, default=400, help="HTTP connections held. Default: 400.")
    p.add_argument("--body", type=int, default=700_000, help="bytes each partial body declares. Default: 700000.")
    p.add_argument("--streams", type=int, default=100, help="gRPC streams on one connection. Default: 100.")
    p.add_argument("--out", type=Path, help="a JSON file for the result. Default: print only.")
    args = p.parse_args(argv)
    raise_open_files(4 * args.connections + 256)
    with tempfile.TemporaryDirectory() as folder:  # a fresh proxy each: HAProxy keeps freed buffers in its pools
        proxy = start_proxy(Path(folder) / "http")
        try:
            http = idle_and_body_cost(proxy, args.connections, proxy.settings.connections_per_client, args.body)
        finally:
            proxy.stop()
        proxy = start_proxy(Path(folder) / "grpc")
        try:
            grpc = h2_stream_cost(proxy, args.streams, args.body)
        finally:
            proxy.stop()
    settings = proxy.settings
    result = {"command": "python -m perf.proxy_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": _cpu(), "haproxy_settings":
              {"maxconn": settings.max_connections, "connections_per_client": settings.connections_per_client},
              "http": http, "grpc_one_connection": grpc}
    print(write_result(result, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
