"""What a client can make the TorchServe front spend before its request is read (issue 42 B1): the request line and
headers are bounded in size (431) and in time (408), before any token check, on every one of its three ports; an
honest request on the same front is answered meanwhile and afterwards."""
from __future__ import annotations

import json
import socket
import time
import urllib.request
import zipfile

import psutil
import pytest

from perf.serve import TorchServeFront
from server.torchserve.bounded_http import HEAD_TIMEOUT_S, MAX_HEAD_BYTES


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    folder = tmp_path_factory.mktemp("limits")
    (folder / "store").mkdir()
    started = TorchServeFront(folder / "front", model_store=str(folder / "store"))  # tokens on, TorchServe's default
    yield started
    started.stop()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _ping(front, headers: dict | None = None) -> int:
    """/ping with the inference key (token authorization is on, as TorchServe's default)."""
    key = json.loads((front.folder / "key_file.json").read_text())["inference"]["key"]
    request = urllib.request.Request(f"{front.inference_url}/ping",
                                     headers={"Authorization": f"Bearer {key}", **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.status


def _answer(sock: socket.socket, limit: float) -> bytes:
    """What the server sent before it closed the connection (or `limit` seconds passed)."""
    sock.settimeout(limit)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return received


@pytest.mark.parametrize("port", ["inference_url", "management_url", "metrics_url"])
def test_front_refuses_a_request_head_larger_than_the_bound_before_reading_the_rest(front, port):
    """1 GiB of header lines on one connection took serve-repo from 80 to 1,266 MB, then OOM: now 431 at 64 KiB."""
    rss = psutil.Process(front.process.pid).memory_info().rss
    sent = 0
    with socket.create_connection(_address(getattr(front, port)), timeout=60) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
        line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
        try:
            while sent < (64 << 20):  # the front closes long before 64 MiB
                sock.sendall(line * 64)
                sent += len(line) * 64
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _answer(sock, 30)
    assert sent < (32 << 20), sent  # refused long before 64 MiB (loopback's kernel buffers take a few MB more)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert psutil.Process(front.process.pid).memory_info().rss < rss + (100 << 20)
    assert _ping(front) == 200


def test_front_closes_a_connection_whose_request_head_does_not_arrive_in_time(front):
    """A half-sent request stayed open 268 s (a byte at a time it burned a core): the head has HEAD_TIMEOUT_S."""
    # A connection that sends nothing at all is closed as well (opened first, the two timed out side by side).
    with socket.create_connection(_address(front.management_url), timeout=60) as silent, \
            socket.create_connection(_address(front.inference_url), timeout=60) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        began = time.monotonic()
        answer = _answer(sock, HEAD_TIMEOUT_S + 50)
        waited = time.monotonic() - began
        assert _answer(silent, HEAD_TIMEOUT_S + 50).startswith(b"HTTP/1.1 408 ")
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert HEAD_TIMEOUT_S - 1 <= waited < HEAD_TIMEOUT_S + 50
    assert _ping(front) == 200


def test_front_reads_an_honest_request_whose_head_is_large_but_under_the_bound(front):
    headers = {f"X-Header-{i}": "v" * 1000 for i in range(40)}  # 40 KB of headers, under 64 KiB
    assert _ping(front, headers) == 200


def test_a_download_that_is_no_archive_or_is_cut_off_never_enters_the_model_store(tmp_path):
    """Issue 42 B7: a garbage or cut-off download stayed in the store under its file name, and a later registration
    of the same name from another host was served it."""
    import http.server
    import threading

    from server.torchserve.model_store import locate
    from server.torchserve.refusals import Refusal

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.endswith("/cut.mar"):  # says 1 MB, sends 10 bytes of a zip, closes
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 20))
                self.end_headers()
                self.wfile.write(b"PK\x03\x04" + b"\0" * 6)
                self.wfile.flush()
                self.connection.close()
                return
            body = b"not an archive at all"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    store = tmp_path / "store"
    store.mkdir()
    try:
        for name in ("dup.mar", "cut.mar"):
            with pytest.raises(Refusal) as refused:
                locate(f"http://127.0.0.1:{httpd.server_port}/a/{name}", store, allowed_urls=(r"http://127\.0\.0\.1:.*",))
            assert refused.value.kind == "DownloadArchiveException", refused.value
            assert sorted(path.name for path in store.iterdir()) == []  # nothing kept, not even a partial file
    finally:
        httpd.shutdown()


def test_a_download_is_never_reused_or_replaced_by_its_file_name_when_another_host_serves_that_name(tmp_path):
    """Issue 42 B7: host A's dup.mar was served for host B's registration of the same file name. Now, as TorchServe
    0.12 answers (500 InternalServerException "Model file already exists dup.mar"), the second is refused whatever
    the host, and the store keeps A's bytes."""
    import functools
    import http.server
    import threading

    from server.torchserve.model_store import locate
    from server.torchserve.refusals import Refusal

    hosts = []
    for label in ("a", "b"):
        folder = tmp_path / label
        folder.mkdir()
        with zipfile.ZipFile(folder / "dup.mar", "w") as archive:
            archive.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": label}}))
        server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        hosts.append(server)
    store = tmp_path / "store"
    store.mkdir()
    allowed = (r"http://127\.0\.0\.1:.*",)
    try:
        first = locate(f"http://127.0.0.1:{hosts[0].server_port}/dup.mar", store, allowed_urls=allowed)
        assert first == store / "dup.mar" and first.read_bytes() == (tmp_path / "a" / "dup.mar").read_bytes()
        for host in hosts:
            with pytest.raises(Refusal) as refused:
                locate(f"http://127.0.0.1:{host.server_port}/dup.mar", store, allowed_urls=allowed)
            assert (refused.value.status, refused.value.kind, str(refused.value)) == (
                500, "InternalServerException", "Model file already exists dup.mar")
        assert first.read_bytes() == (tmp_path / "a" / "dup.mar").read_bytes()
        assert sorted(path.name for path in store.iterdir()) == ["dup.mar"]
    finally:
        for server in hosts:
            server.shutdown()


def test_a_registration_url_stays_in_the_store_and_allowed_urls_and_off_this_machine_by_default(tmp_path):
    """Issue 42 B8, with TorchServe 0.12's rules (checked against it in tests/test_torchserve_api.py): a path is a
    file in the model store (`..` refused, an absolute path outside it not found), a URL must match allowed_urls, and an http(s)
    URL to this machine (loopback, link-local, unspecified) is refused unless allowed_urls was configured."""
    from server.torchserve.model_store import locate
    from server.torchserve.refusals import Refusal

    store = tmp_path / "store"
    (store / "sub").mkdir(parents=True)
    (store / "sub" / "m.mar").write_bytes(b"PK")
    (tmp_path / "outside.mar").write_bytes(b"PK")
    assert locate("sub/m.mar", store) == store / "sub" / "m.mar"
    assert locate(f"{store}/sub/m.mar", store) == store / "sub" / "m.mar"  # an absolute path in the store
    (store / "link.mar").symlink_to(tmp_path / "outside.mar")
    assert locate(f"file://{tmp_path}/outside.mar", store) == tmp_path / "outside.mar"  # TorchServe's default allows
    refused = {
        "../outside.mar": "Relative path is not allowed in url: ../outside.mar",
        f"{tmp_path}/outside.mar": f"Model not found at: {tmp_path}/outside.mar",
        "/sub/m.mar": "Model not found at: /sub/m.mar",
        "link.mar": "Model not found at: link.mar",  # a link out of the store
        "/etc/passwd": "Model not found at: /etc/passwd",  # as for a file that does not exist: nothing told
        "http://127.0.0.1:8000/v2/models/m/config": "Given URL http://127.0.0.1:8000/v2/models/m/config does not "
                                                    "match any allowed URL(s)",
        "http://localhost/x.mar": "Given URL http://localhost/x.mar does not match any allowed URL(s)",
        "http://169.254.169.254/latest/x.mar": "Given URL http://169.254.169.254/latest/x.mar does not match any "
                                               "allowed URL(s)",
        "http://[::1]/x.mar": "Given URL http://[::1]/x.mar does not match any allowed URL(s)",
        # another scheme: the store's file of that name, as TorchServe 0.12 (tests/grpc_table.py compares it)
        "ftp://example.com/x.mar": "Model not found at: ftp://example.com/x.mar",
    }
    for url, message in refused.items():
        with pytest.raises(Refusal) as problem:
            locate(url, store)
        assert (problem.value.status, str(problem.value), problem.value.kind) == (404, message, "ModelNotFoundException")
    with pytest.raises(Refusal, match="does not match any allowed URL"):  # configured: only what it names
        locate(f"file://{tmp_path}/outside.mar", store, allowed_urls=(r"https://models\.example\.com/.*",))


def test_key_file_is_private_from_its_first_byte_and_replaces_a_link_put_in_its_place(tmp_path):
    """Issue 42 (suspected, confirmed): key_file.json was written before its chmod 600, and through a symlink."""
    import os
    import stat

    from server.torchserve.replies import Tokens

    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep me\n")
    key_file = tmp_path / "key_file.json"
    key_file.symlink_to(elsewhere)
    tokens = Tokens(key_file)
    assert elsewhere.read_text() == "keep me\n"  # not written through the link
    assert not key_file.is_symlink() and stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert json.loads(key_file.read_text())["inference"]["key"] == tokens.keys["inference"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "key_file.json"]
