"""The proxy's connection bounds against real HAProxy: a few client addresses at their per-client caps cannot lock
everyone else out, and one gRPC connection is told the stream limit that bounds its 1 MB stream buffers (the memory
itself is measured by perf/proxy_memory.py, perf/results/proxy-memory.json: an allocator's peak is no test's to assert)."""
from __future__ import annotations

import socket
import time

import pytest

from perf.proxy_memory import (SETTINGS_MAX_CONCURRENT_STREAMS, connect_from, raise_open_files, server_settings,
                               sources, start_proxy)
from server.proxy import ProxySettings
from test_proxy import _proxy
from test_proxy_limits import _accepted_connections

DEFAULTS = ProxySettings("127.0.0.1", 0, 0)
# docs/security.md: this many client addresses, each at its cap, still leave room for another client.
HOSTILE_ADDRESSES = 15
STREAMS = 100  # proxy/haproxy.cfg's tune.h2.max-concurrent-streams
READY = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n\r\n"


def _answer(source: str, port: int, timeout: float = 5) -> bytes:
    try:
        with connect_from(source, port, timeout) as sock:
            sock.sendall(READY)
            return sock.recv(4096)
    except OSError:
        return b""


def test_proxy_serves_a_client_when_15_other_addresses_hold_every_connection_they_may(server, tmp_path):
    # The defaults' ratio of all connections to one client's, at a small scale (each cap 8, not 256).
    per_client = 8
    ratio = DEFAULTS.max_connections // DEFAULTS.connections_per_client
    raise_open_files(4 * HOSTILE_ADDRESSES * per_client + 256)
    proxy = _proxy(server, tmp_path, connections_per_client=per_client, max_connections=per_client * ratio)
    port = proxy.settings.http_port
    held: list[socket.socket] = []
    try:
        assert _answer("127.0.0.9", port)[:12] == b"HTTP/1.1 200"  # the listener takes 127.0.0.0/8 sources
        for address in sources(HOSTILE_ADDRESSES, first=20):
            for _ in range(per_client):
                try:  # beyond maxconn the kernel still completes the connect; HAProxy never reads it
                    held.append(connect_from(address, port))
                except OSError:
                    pass
        time.sleep(0.5)
        assert _answer("127.0.0.1", port)[:12] == b"HTTP/1.1 200"
        assert _answer("127.0.0.9", port)[:12] == b"HTTP/1.1 200"
        # Each hostile address does hold its cap, and one more of its connections is refused.
        assert _accepted_connections(port) >= HOSTILE_ADDRESSES * per_client
        assert _answer(sources(1, first=20)[0], port) == b""
    finally:
        for sock in held:
            sock.close()
        proxy.stop()


def test_proxy_defaults_let_16_addresses_at_their_caps_fill_it_and_no_fewer():
    assert DEFAULTS.max_connections >= (HOSTILE_ADDRESSES + 1) * DEFAULTS.connections_per_client
    # an honest client's pool: a connection per request the proxy lets through at once, both ports, and room over
    assert DEFAULTS.connections_per_client >= 4 * DEFAULTS.max_in_flight


@pytest.fixture
def bare_proxy(tmp_path):
    """serve-repo's proxy in front of a closed port: partial bodies never reach an upstream."""
    proxy = start_proxy(tmp_path / "proxy")
    yield proxy
    proxy.stop()


def test_proxy_tells_a_grpc_client_its_stream_limit_when_it_opens_a_connection(bare_proxy):
    with connect_from("127.0.0.2", bare_proxy.settings.grpc_port) as sock:
        assert server_settings(sock).get(SETTINGS_MAX_CONCURRENT_STREAMS) == STREAMS


def test_proxy_answers_every_call_when_one_grpc_channel_sends_more_than_its_stream_limit_at_once(server, tmp_path):
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    proxy = _proxy(server, tmp_path)
    try:
        with grpc.insecure_channel(proxy.grpc_url) as channel:
            ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady",
                                        request_serializer=pb.ServerReadyRequest.SerializeToString,
                                        response_deserializer=pb.ServerReadyResponse.FromString)
            calls = [ready.future(pb.ServerReadyRequest(), timeout=60) for _ in range(STREAMS + 28)]
            assert all(call.result().ready for call in calls)  # the calls over the limit wait for a free stream
    finally:
        proxy.stop()
