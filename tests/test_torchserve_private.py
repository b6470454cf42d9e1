"""Issue 42 B10: in TorchServe mode tritonserver is reachable only through serve-repo's front. It listens on no TCP
port (a local user could send it the request that aborts Triton 2.51, docs/security.md), only on Unix sockets in
serve-repo's private folder (0700), gRPC off; the front's /ping and /metrics still reach it."""
import os
import stat
import urllib.request
from pathlib import Path

import psutil
import pytest

from perf.serve import TorchServeFront
from server.unix_http import socket_path, sync_client


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    store = tmp_path_factory.mktemp("private") / "model_store"
    store.mkdir()
    started = TorchServeFront(store.parent / "front", model_store=str(store), disable_token_authorization="true")
    yield started
    started.stop()


def test_tritonserver_listens_on_no_tcp_port_when_served_behind_the_torchserve_front(front):
    triton = psutil.Process(front.triton_pid)
    listening = [c for c in triton.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening == [], f"tritonserver listens on TCP: {[c.laddr for c in listening]}"


def test_tritonserver_sockets_are_in_a_folder_only_serve_repos_user_reads_when_served_behind_the_front(front):
    sockets = sorted({c.laddr for c in psutil.Process(front.triton_pid).net_connections(kind="unix") if c.laddr})
    assert sockets, "tritonserver listens on no Unix socket"
    for path in map(Path, sockets):
        folder = path.parent.stat()
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.getuid(), (path, oct(folder.st_mode))
    assert Path(socket_path(front.triton_url)) in map(Path, sockets)


def test_triton_answers_through_the_socket_and_the_fronts_ping_and_metrics_when_served_behind_the_front(front):
    client = sync_client(front.triton_url)
    try:
        assert client.is_server_ready()
    finally:
        client.close()
    with urllib.request.urlopen(f"{front.inference_url}/ping", timeout=10) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"{front.metrics_url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert "# TYPE ts_inference_requests_total counter" in text and "\nnv_" in text  # Triton's own metrics follow


def test_command_puts_a_private_server_on_sockets_and_a_local_one_on_its_ports_when_built(tmp_path):
    from server.triton import TritonServer

    (tmp_path / "repo").mkdir()
    private = TritonServer.private(tmp_path / "repo")
    private._workdir = tmp_path / "work"
    command = private.command()
    assert {f"--http-address=unix:{tmp_path}/work/triton.sock", "--http-port=0", "--allow-grpc=false",
            f"--metrics-address=unix:{tmp_path}/work/metrics.sock", "--metrics-port=0"} <= set(command)
    assert not [arg for arg in command if arg.startswith("--grpc")]
    plain = TritonServer(tmp_path / "repo", 1, 2, 3)
    plain._workdir = tmp_path / "work2"
    assert {"--http-port=1", "--grpc-port=2", "--metrics-port=3", "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"} <= set(plain.command())
    assert not [arg for arg in plain.command() if "unix:" in arg or arg.startswith("--allow-grpc")]
