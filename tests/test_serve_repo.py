"""serve-repo starts the bundled tritonserver, explains failures, and stops everything on a signal."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.procs import free_port, port_free
from server import cli, wheel
from server.proxy import _listening
from server.triton import ServerError, TritonServer
from support import SMALL

ROOT = Path(__file__).resolve().parent.parent


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1) to bind")


def _stubs_for(repository: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-af", "triton_python_backend_stub"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if str(repository) in line]


def test_serve_repo_stops_server_and_stubs_when_sent_sigterm(repository, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(repository / SMALL, repo / SMALL)
    ports = [str(free_port()) for _ in range(3)]
    process = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "--repository", str(repo), "--http-port", ports[0],
         "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ready, before = process.stdout.readline(), []
        # what an earlier killed run left, and the canary's line (server/canary.py) come before the ready line
        while ready.startswith(("serve-repo: the log of a dead earlier run", "canary: ")):
            before.append(ready)
            ready = process.stdout.readline()
        assert f"HTTP 127.0.0.1:{ports[0]}" in ready and f"gRPC 127.0.0.1:{ports[1]}" in ready
        assert f"canary: {SMALL} answered right (" in before[-1], before
        assert _stubs_for(repo), "a python backend stub should be running"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        process.kill()
    assert "stopped" in process.stdout.read()
    deadline = time.monotonic() + 10
    while _stubs_for(repo) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _stubs_for(repo)


def test_serve_repo_names_busy_port_when_http_port_is_taken(repository, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        status = cli.main(["--repository", str(repository), "--http-port", str(busy),
                             "--grpc-port", str(free_port()), "--metrics-port", str(free_port())])
    assert status == 1
    assert f"http port {busy} on 127.0.0.1 is busy" in capsys.readouterr().err


@needs_ipv6
@pytest.mark.parametrize("host", ["::1", "::"])
def test_port_checks_see_free_and_taken_ports_when_the_host_is_an_ipv6_address(host):
    port = free_port(host)
    assert port_free(host, port) and not _listening(host, port)
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", port))
        taken.listen()
        assert not port_free(host, port) and _listening(host, port)


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_port_checks_see_free_and_taken_ports_when_the_host_is_an_ipv4_address(host):
    port = free_port(host)
    assert port_free(host, port) and not _listening(host, port)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        assert not port_free(host, port) and _listening(host, port)


def test_serve_repo_refuses_an_ipv6_host_without_the_proxy_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--host", "::1", "--proxy", "off"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "cannot listen on ::1 (IPv6)" in error and error.count("\n") == 0


def test_serve_repo_shows_tritons_reason_when_a_model_fails_to_load(repository, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(repository / SMALL, repo / SMALL)
    (repo / SMALL / "1" / "model.onnx").write_bytes(b"this is not an ONNX model")
    server = TritonServer.local(repo)
    try:
        with pytest.raises(ServerError) as failure:
            server.start(timeout=300)
    finally:
        server.stop()  # were it to start anyway, leave no server behind
    message = str(failure.value)
    assert f"resnet18: Internal: RuntimeError: cannot load the openvino engine from {repo}" in message
    assert "model.onnx" in message


def test_serve_repo_says_what_is_missing_when_pytriton_is_not_installed(monkeypatch):
    monkeypatch.setattr(wheel.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ServerError, match="nvidia-pytriton is not installed"):
        wheel.pytriton_root()


def test_serve_repo_refuses_when_repository_is_missing(tmp_path):
    with pytest.raises(ServerError, match="does not exist"):
        TritonServer.local(tmp_path / "nowhere").start()


def test_serve_repo_refuses_a_negative_drain_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--drain-seconds", "-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_tritonserver_gets_the_drain_as_its_exit_timeout_and_a_shm_prefix_of_ours(tmp_path):
    (tmp_path / "repo").mkdir()
    server = TritonServer(tmp_path / "repo", 1, 2, 3, drain_seconds=7)
    server._workdir = tmp_path / "work"
    command = server.command()
    assert "--exit-timeout-secs=7" in command
    assert f"--backend-config=python,shm-region-prefix-name=tcls{os.getpid()}_1_" in command
    mine = TritonServer(tmp_path / "repo", 1, 2, 3, extra_args=["--exit-timeout-secs=1"])
    mine._workdir = tmp_path / "work2"
    assert [a for a in mine.command() if a.startswith("--exit-timeout-secs")] == ["--exit-timeout-secs=1"]


def test_serve_repo_writes_bytecode_for_its_interpreter_when_the_repository_lacks_it(tmp_path, start_server):
    """A repository built by another Python (or copied without __pycache__) gets this interpreter's bytecode
    before Triton loads it, so that no stub writes it later (a 'modified' version: whole-model reloads)."""
    import shutil
    import sys

    from server.repo import compile_bytecode
    from support import SMALL, build

    build(tmp_path / "repo", "--max-batch-size", "8")
    for cache in (tmp_path / "repo").glob("*/1/__pycache__"):
        shutil.rmtree(cache)
    server = start_server(tmp_path / "repo")
    for model in (SMALL, f"{SMALL}_preprocess"):
        pyc = tmp_path / "repo" / model / "1" / "__pycache__" / f"model.{sys.implementation.cache_tag}.pyc"
        assert pyc.is_file(), model
    assert server.model_ready(SMALL)
    assert compile_bytecode(tmp_path / "repo") == []  # nothing left to write
