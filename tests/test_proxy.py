"""The reverse proxy (HAProxy, proxy/haproxy.cfg + guard.lua) in front of a real tritonserver: what it refuses,
what it lets through (tritonclient HTTP and gRPC, the curl script, the image path), TLS, the token, holding
requests while Triton restarts, and serve-repo running it."""
from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from common.procs import free_port
from drills.faults import CRASHING_BODY, WRAPPING_BODY, running
from perf.serve import ServeRepo
from images import CAT
from server.proxy import Proxy, ProxySettings
from support import SMALL, build, inferences
from test_serve_repo import needs_ipv6

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "s3cret-token-for-the-proxy-tests"


def _proxy(server, tmp_path: Path, **settings) -> Proxy:
    workdir = tmp_path / f"proxy-{len(list(tmp_path.glob('proxy-*')))}"
    workdir.mkdir()
    options = ProxySettings("127.0.0.1", free_port(), free_port(), **settings)
    return Proxy(options, server.http_url, server.grpc_url, f"127.0.0.1:{server.ports['metrics']}", workdir).start()


@pytest.fixture(scope="module")
def proxy(server, tmp_path_factory):
    started = _proxy(server, tmp_path_factory.mktemp("proxy"), max_body_bytes=2 << 20)
    yield started
    started.stop()


def _post(url: str, path: str, body: bytes, headers: dict | None = None, context=None) -> tuple[int, str]:
    request = urllib.request.Request(f"{url}{path}", data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as reply:
            return reply.status, reply.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _tensor(module, batch: int = 1):
    data = np.random.default_rng(0).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    tensor = module.InferInput("IMAGE", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return tensor


def _image(module):
    data = np.array([[CAT.read_bytes()]], dtype=object)
    tensor = module.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(data)
    return tensor


def _dims(shape: str, datatype: str = "FP32", name: str = "IMAGE", data: str = "[1,2,3]") -> bytes:
    return b'{"inputs":[{"name":"%s","shape":%s,"datatype":"%s","data":%s}]}' % (
        name.encode(), shape.encode(), datatype.encode(), data.encode())




@pytest.mark.parametrize("body, status, rule", [
    (WRAPPING_BODY, 400, "shape"),
    (CRASHING_BODY, 400, "shape"),                                       # a batch over max_batch_size
    (_dims("[1,3,224,224]"), 400, "data-size"),                          # 150528 elements, 3 values
    (_dims("[1,3]"), 400, "shape"),                                      # not the model's dims
    (_dims("[2,3,224,225]"), 400, "shape"),
    (_dims("[1,3,224,224]", "FP16"), 400, "datatype"),
    (_dims("[1,3,224,224]", name="PIXELS"), 400, "inputs"),
    (b'{"inputs":[{"name":"IMAGE","shape":[1],"sh\\u0061pe":[99999999999],"datatype":"FP32"}]}', 400, "json"),
    (_dims("[1,3,224,224.0]"), 400, "shape"),                            # Triton reads dims as int64
    (_dims("[1,3,2e9]"), 400, "shape"),
    (_dims("[1,-3]"), 400, "shape"),
    (b'{"inputs":[{"name":"IMAGE","shape":{"0":1},"datatype":"FP32","data":[]}]}', 400, "shape"),
    (b'{"inputs":[{"name":"IMAGE","shape":[1,3,224,224],"datatype":"FP32","parameters":'
     b'{"shared_memory_region":"r","shared_memory_byte_size":602112}}]}', 400, "shared-memory"),
    (b'{"inputs":' + b"[" * 100 + b"]" * 100 + b"}", 400, "json"),       # nested beyond the parser's depth
    (b'{"inputs":[{"name":"IMAGE","shape":[1,3],"datatype":"FP32","data":[1,2,3]}],}', 400, "json"),
    (b'{"inputs":[{"name":"IMAGE","shape":[1,3],"datatype":"FP32","data":[1,2,3]}]} x', 400, "json"),
    # JSON beyond the 64 KB the guard inspects (the buffer holds 1 MB, for replays): binary data is the way.
    (b'{"inputs":[{"name":"IMAGE","shape":[1,50000],"datatype":"FP32","data":[' + b"1," * 49999 + b"1]}]}",
     413, "json-header"),
])
def test_proxy_refuses_inference_the_model_does_not_declare_naming_the_rule_when_posted_as_json(
        server, proxy, body, status, rule):
    pid = server.pid
    code, text = _post(f"http://{proxy.http_url}", f"/v2/models/{SMALL}/infer", body,
                       {"Content-Type": "application/json"})
    assert (code, json.loads(text)["error"].split(":")[0]) == (status, f"proxy rule {rule}")
    assert server.pid == pid and server.ready()  # never reached Triton, which never restarted


def _binary(shape: list, size: int, header_length: int | None = None) -> tuple[bytes, dict]:
    header = json.dumps({"inputs": [{"name": "IMAGE", "shape": shape, "datatype": "FP32",
                                     "parameters": {"binary_data_size": size}}]}).encode()
    length = len(header) if header_length is None else header_length
    return header + b"\0" * size, {"Inference-Header-Content-Length": str(length)}


@pytest.mark.parametrize("shape, size, header_length, rule", [
    ([1, 3, 224, 224], 602112 - 4, None, "data-size"),                   # a value short
    ([2, 3, 224, 224], 602112, None, "data-size"),                       # the shape needs twice the bytes
    ([0, 2 ** 64 - 1], 0, None, "shape"),
    ([1, 3, 224, 224], 602112, 9, "json"),                               # the JSON part cut short
    ([1, 3, 224, 224], 602112, 10 ** 9, "json-header"),
])
def test_proxy_refuses_binary_inference_whose_data_does_not_fit_the_declared_shape(server, proxy, shape, size,
                                                                                   header_length, rule):
    body, headers = _binary(shape, size, header_length)
    code, text = _post(f"http://{proxy.http_url}", f"/v2/models/{SMALL}/infer", body, headers)
    assert code in (400, 413) and json.loads(text)["error"].startswith(f"proxy rule {rule}:"), text


def test_proxy_answers_404_naming_the_rule_when_the_model_is_not_served(proxy):
    code, text = _post(f"http://{proxy.http_url}", "/v2/models/nosuch/infer", _dims("[1,3,224,224]"))
    assert code == 404 and json.loads(text)["error"].startswith("proxy rule model: no model nosuch")


def test_proxy_refuses_compressed_bodies_asking_for_them_uncompressed_when_tritonclient_sends_gzip(proxy):
    client = httpclient.InferenceServerClient(proxy.http_url)
    with pytest.raises(InferenceServerException, match="proxy rule compression:.*uncompressed") as refused:
        client.infer(SMALL, [_tensor(httpclient)], request_compression_algorithm="gzip")
    assert refused.value.status() == "415"
    grpc = grpcclient.InferenceServerClient(proxy.grpc_url)
    with pytest.raises(InferenceServerException, match="proxy rule compression") as refused:
        grpc.infer(SMALL, [_tensor(grpcclient)], compression_algorithm="gzip")
    assert refused.value.status() == "StatusCode.UNIMPLEMENTED"


def _grpc_unary(target: str, request) -> tuple[str, str]:
    return _grpc_call(target, "ModelInfer", request)


@pytest.mark.parametrize("mutate, rule", [
    (lambda r: r.inputs[0].shape.__setitem__(1, -1), "shape"),            # 2**64-1 as Triton's int64
    (lambda r: r.inputs[0].shape.__setitem__(0, 9), "shape"),             # over max_batch_size
    (lambda r: setattr(r.inputs[0], "datatype", "FP16"), "datatype"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 8), "data-size"),
    (lambda r: r.raw_input_contents.append(b"\0" * 8), "data-size"),
    (lambda r: setattr(r.inputs[0], "name", "PIXELS"), "inputs"),
    (lambda r: r.inputs[0].parameters["shared_memory_region"].__setattr__("string_param", "r"), "shared-memory"),
])
def test_proxy_refuses_grpc_inference_the_model_does_not_declare_naming_the_rule(server, proxy, mutate, rule):
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=SMALL)
    request.inputs.add(name="IMAGE", datatype="FP32", shape=[1, 3, 224, 224])
    request.raw_input_contents.append(b"\0" * 602112)
    start = _inferences(server)
    assert _grpc_unary(proxy.grpc_url, request) == ("OK", "")  # honest, as built
    before = _inferences(server, start + 1)  # Triton counts it just after it answers: wait for the count
    mutate(request)
    code, details = _grpc_unary(proxy.grpc_url, request)
    assert (code, details.split(":")[0]) == ("INVALID_ARGUMENT", f"proxy rule {rule}"), details
    assert _inferences(server) == before


def test_proxy_passes_an_honest_json_request_to_triton_when_its_shape_fits_the_model(proxy):
    # Triton itself answers (a batch of 0 holds no data, and Triton 2.51 wants some): the guard let it through.
    code, text = _post(f"http://{proxy.http_url}", f"/v2/models/{SMALL}/infer",
                       _dims("[0,3,224,224]", data="[]"))
    assert code == 400 and "proxy rule" not in text and "byte size" in text


def test_proxy_serves_tritonclient_http_grpc_image_path_and_curl_when_requests_are_honest(server, proxy):
    direct = httpclient.InferenceServerClient(server.http_url).infer(SMALL, [_tensor(httpclient, 2)])
    http = httpclient.InferenceServerClient(proxy.http_url).infer(SMALL, [_tensor(httpclient, 2)])
    grpc = grpcclient.InferenceServerClient(proxy.grpc_url).infer(SMALL, [_tensor(grpcclient, 2)])
    assert np.array_equal(http.as_numpy("LOGITS"), direct.as_numpy("LOGITS"))
    assert np.array_equal(grpc.as_numpy("LOGITS"), direct.as_numpy("LOGITS"))
    image = httpclient.InferenceServerClient(proxy.http_url).infer(f"{SMALL}_image", [_image(httpclient)])
    assert image.as_numpy("LOGITS").shape == (1, 1000)
    curl = subprocess.run([str(ROOT / "clients" / "curl_classify.sh"), str(CAT), proxy.http_url, SMALL, "3"],
                          capture_output=True, text=True, timeout=60)
    assert curl.returncode == 0 and len(json.loads(curl.stdout)["outputs"][0]["data"]) == 3
    metadata = httpclient.InferenceServerClient(proxy.http_url).get_model_metadata(SMALL)
    assert metadata["name"] == SMALL
    with urllib.request.urlopen(f"http://{proxy.http_url}/metrics", timeout=30) as reply:
        assert b"nv_inference_request_success" in reply.read()


@pytest.mark.parametrize("path", ["/v2/repository/index", f"/v2/repository/models/{SMALL}/unload",
                                  "/v2/systemsharedmemory/register", "/v2/logging", "/v2/trace/setting",
                                  f"/v2/models/{SMALL}/generate"])
def test_proxy_keeps_control_apis_private_when_posted_to(proxy, path):
    code, text = _post(f"http://{proxy.http_url}", path, b"{}")
    assert code == 403 and "proxy rule allowlist" in text


def test_proxy_keeps_the_repository_api_private_when_called_over_grpc(proxy):
    client = grpcclient.InferenceServerClient(proxy.grpc_url)
    with pytest.raises(InferenceServerException, match="PERMISSION_DENIED|403"):
        client.get_model_repository_index()
    with pytest.raises(InferenceServerException, match="PERMISSION_DENIED|403"):
        client.unload_model(SMALL)
    assert client.is_model_ready(SMALL)


def test_proxy_caps_the_body_when_it_is_larger_than_configured(proxy):
    big = _tensor(httpclient, 4)  # 2.4 MB of binary tensor > the fixture's 2 MiB
    with pytest.raises(InferenceServerException, match="body-limit"):
        httpclient.InferenceServerClient(proxy.http_url).infer(SMALL, [big])

def _inferences(server, at_least: int = 0) -> int:
    return inferences(server.http_url, SMALL, at_least)


def test_proxy_caps_a_grpc_message_by_the_length_it_declares_when_larger_than_configured(server, proxy, tmp_path):
    # HTTP/2 has no Content-Length: the guard reads the gRPC message's own length and answers as gRPC does.
    capped = _proxy(server, tmp_path, max_body_bytes=300_000)  # under one 602 KB image, which the buffer holds
    try:
        grpc = grpcclient.InferenceServerClient(capped.grpc_url)
        with pytest.raises(InferenceServerException) as refused:
            grpc.infer(SMALL, [_tensor(grpcclient)])
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
        assert "proxy rule body-limit: a gRPC message of 602" in str(refused.value)
        assert grpc.infer(f"{SMALL}_image", [_image(grpcclient)]).as_numpy("LOGITS").shape == (1, 1000)
    finally:
        capped.stop()
    # Beyond the buffer the refusal may reach the client while it still sends (then gRPC says CANCELLED):
    # either way Triton never sees the request.
    before = _inferences(server)
    grpc = grpcclient.InferenceServerClient(proxy.grpc_url)
    with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED|CANCELLED"):
        grpc.infer(SMALL, [_tensor(grpcclient, 4)])  # 2.4 MB > the fixture's 2 MiB
    assert _inferences(server) == before
    assert grpc.infer(SMALL, [_tensor(grpcclient, 3)]).as_numpy("LOGITS").shape == (3, 1000)  # 1.8 MB passes


def _grpc_call(target: str, method: str, request, compression=None) -> tuple[str, str]:
    """One unary call of `method` (GRPCInferenceService) through `target`: its status code's name and details."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda data: data)
        try:
            call(request, timeout=60, compression=compression)
            return "OK", ""
        except grpc.RpcError as error:
            return error.code().name, error.details()


def test_proxy_bounds_every_grpc_method_not_only_inference_when_its_message_is_big_or_compressed(server, proxy):
    """Issue 42 A1: a gzip ModelConfig request whose model name was 768 MiB (760 KiB on the wire) took tritonserver
    from 472 MB to 5.5 GB, and an uncompressed 64 MiB one passed the body cap: only ModelInfer was checked."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    honest = pb.ModelConfigRequest(name=SMALL)
    assert _grpc_call(proxy.grpc_url, "ModelConfig", honest) == ("OK", "")
    rss = psutil.Process(server.pid).memory_info().rss
    # 8 MiB of name, about 8 KiB on the wire once compressed: refused before Triton inflates it.
    code, details = _grpc_call(proxy.grpc_url, "ModelConfig", pb.ModelConfigRequest(name="m" * (8 << 20)),
                               compression=grpc.Compression.Gzip)
    assert (code, details.split(":")[0]) == ("UNIMPLEMENTED", "proxy rule compression"), details
    # Uncompressed: over the fixture's 2 MiB body cap, and over the small cap of a request that is no inference.
    for size in (3 << 20, 64 << 10):
        code, details = _grpc_call(proxy.grpc_url, "ModelMetadata", pb.ModelMetadataRequest(name="m" * size))
        refused = code == "RESOURCE_EXHAUSTED" and details.startswith("proxy rule body-limit")
        # Beyond the buffer the refusal may reach the client while it still sends: then gRPC says CANCELLED.
        assert refused or size > (1 << 20) and code == "CANCELLED", (size, code, details)
    assert psutil.Process(server.pid).memory_info().rss < rss + (100 << 20)
    assert _grpc_call(proxy.grpc_url, "ModelMetadata", pb.ModelMetadataRequest(name=SMALL)) == ("OK", "")
    assert _grpc_call(proxy.grpc_url, "ServerLive", pb.ServerLiveRequest()) == ("OK", "")


def test_proxy_refuses_a_version_no_model_can_have_before_asking_triton_about_it(server, proxy):
    """Issue 42 A3: 4,000-digit versions were each cached for good and fetched again every 250 ms for 15 s."""
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=SMALL, model_version="9" * 4000)
    request.inputs.add(name="IMAGE", datatype="FP32", shape=[1, 3, 224, 224])
    request.raw_input_contents.append(b"\0" * 602112)
    began = time.monotonic()
    code, details = _grpc_call(proxy.grpc_url, "ModelInfer", request)
    assert (code, details.split(":")[0]) == ("INVALID_ARGUMENT", "proxy rule model"), details
    assert time.monotonic() - began < 10  # not held while the guard asks Triton again and again
    request.model_name, request.model_version = "m" * 4000, ""
    code, details = _grpc_call(proxy.grpc_url, "ModelInfer", request)
    assert (code, details.split(":")[0]) == ("INVALID_ARGUMENT", "proxy rule model"), details
    code, text = _post(f"http://{proxy.http_url}", f"/v2/models/{SMALL}/versions/{'9' * 4000}/infer",
                       _dims("[1,3]"))
    assert code in (400, 403) and "proxy rule" in text
    request.model_name, request.model_version = SMALL, "1"
    assert _grpc_call(proxy.grpc_url, "ModelInfer", request) == ("OK", "")


def test_proxy_limits_one_clients_rate_when_it_sends_more_than_allowed(server, tmp_path):
    limited = _proxy(server, tmp_path, rate_per_10s=5)
    try:
        codes = []
        for _ in range(8):
            try:
                with urllib.request.urlopen(f"http://{limited.http_url}/v2/health/ready", timeout=10) as reply:
                    codes.append(reply.status)
            except urllib.error.HTTPError as error:
                codes.append(error.code)
        assert codes[:5] == [200] * 5 and codes[-1] == 429
    finally:
        limited.stop()


def test_proxy_answers_401_without_the_token_and_serves_with_it_when_a_token_is_configured(server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    guarded = _proxy(server, tmp_path, token_file=token_file)
    try:
        code, text = _post(f"http://{guarded.http_url}", f"/v2/models/{SMALL}/infer", CRASHING_BODY)
        assert code == 401 and "proxy rule token" in text
        with pytest.raises(InferenceServerException, match="token"):
            httpclient.InferenceServerClient(guarded.http_url).infer(SMALL, [_tensor(httpclient)])
        def bearer():  # a new dict each call: tritonclient.http adds its own headers to the one it is given
            return {"authorization": f"Bearer {TOKEN}"}
        answer = httpclient.InferenceServerClient(guarded.http_url).infer(SMALL, [_tensor(httpclient)],
                                                                          headers=bearer())
        assert answer.as_numpy("LOGITS").shape == (1, 1000)
        grpc = grpcclient.InferenceServerClient(guarded.grpc_url)
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED.*proxy rule token"):
            grpc.infer(SMALL, [_tensor(grpcclient)])
        assert grpc.infer(SMALL, [_tensor(grpcclient)], headers=bearer()).as_numpy("LOGITS").shape == (1, 1000)
    finally:
        guarded.stop()


def test_proxy_speaks_only_tls_and_tritonclient_works_over_it_when_a_certificate_is_configured(server, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    secure = _proxy(server, tmp_path, tls_cert=cert, tls_key=key)
    try:
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://{secure.http_url}/v2/health/ready", timeout=10).read()
        context = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"https://{secure.http_url}/v2/health/ready", timeout=10, context=context) as r:
            assert r.status == 200
        http = httpclient.InferenceServerClient(secure.http_url, ssl=True, ssl_context_factory=lambda: context)
        assert http.infer(SMALL, [_tensor(httpclient)]).as_numpy("LOGITS").shape == (1, 1000)
        grpc = grpcclient.InferenceServerClient(secure.grpc_url, ssl=True, root_certificates=str(cert))
        assert grpc.infer(SMALL, [_tensor(grpcclient)]).as_numpy("LOGITS").shape == (1, 1000)
    finally:
        secure.stop()
    assert not (secure.workdir / "proxy.pem").exists()  # our copy of the key goes with the proxy


def test_proxy_holds_requests_sent_while_triton_restarts_and_answers_them_when_it_is_back(repository, start_server,
                                                                                         tmp_path):
    triton = start_server(repository)
    # Held for PROXY_RETRIES tries, ~1 a second, while Triton restarts: room for a restart as slow as a loaded machine
    # makes it (the default 15 were too few once, beside three other test runs), so that this proves the hold.
    proxy = _proxy(triton, tmp_path, retries=120)
    try:
        os.kill(triton.pid, signal.SIGKILL)
        triton._process.wait()
        outcomes = []

        def send():
            try:
                client = httpclient.InferenceServerClient(proxy.http_url, network_timeout=300)
                outcomes.append(client.infer(SMALL, [_tensor(httpclient)]).as_numpy("LOGITS").shape)
            except Exception as exc:  # noqa: BLE001 - the outcome is the assertion
                outcomes.append(exc)
        senders = [threading.Thread(target=send) for _ in range(3)]
        for sender in senders:
            sender.start()
        time.sleep(1)  # sent, and held by the proxy while nothing listens on Triton's port
        triton.restart()
        for sender in senders:
            sender.join(120)
        assert outcomes == [(1, 1000)] * 3
    finally:
        proxy.stop()


def test_proxy_sends_again_requests_triton_took_but_never_answered_when_it_dies(small_repo, start_server, tmp_path):
    triton = start_server(small_repo)
    # The proxy holds requests (and the guard waits for the model's config) for PROXY_RETRIES tries, ~1 a second,
    # while Triton restarts: room for a restart as slow as a loaded CI machine makes it, so that this proves the
    # replay, not how fast the machine restarts Triton (15 tries were once too few there).
    proxy = _proxy(triton, tmp_path, retries=120)
    try:
        clients = {httpclient: lambda: httpclient.InferenceServerClient(proxy.http_url, network_timeout=120),
                   grpcclient: lambda: grpcclient.InferenceServerClient(proxy.grpc_url)}
        for module, client in clients.items():
            assert client().infer(SMALL, [_tensor(module)]).as_numpy("LOGITS").shape == (1, 1000)
        # Stopped, Triton is alive to the kernel: its connections take the requests and nothing answers them,
        # as in the last milliseconds of a crash (or a request in flight when it dies).
        os.kill(triton.pid, signal.SIGSTOP)
        outcomes = []

        def send(module):
            try:  # a client per thread: tritonclient.http's (gevent) cannot change threads
                outcomes.append(clients[module]().infer(SMALL, [_tensor(module)]).as_numpy("LOGITS").shape)
            except Exception as exc:  # noqa: BLE001 - the outcome is the assertion
                outcomes.append(f"{module.__name__}: {exc}")
        senders = [threading.Thread(target=send, args=(module,)) for module in clients]
        for sender in senders:
            sender.start()
        time.sleep(1)  # both sent to Triton, unanswered
        os.kill(triton.pid, signal.SIGKILL)
        triton._process.wait()
        triton.restart()
        for sender in senders:
            sender.join(120)
        assert outcomes == [(1, 1000)] * 2, outcomes
        log = proxy.log_file.read_text()  # each failed on the dead connection, then went to the holding layer
        assert "replay_http/triton is DOWN" in log and "replay_grpc/triton is DOWN" in log
    finally:
        proxy.stop()


def test_serve_repo_exposed_keeps_triton_private_behind_the_proxy_and_leaves_no_orphan_when_killed(repository,
                                                                                                   tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in (SMALL, f"{SMALL}_preprocess", f"{SMALL}_image"):
        os.symlink(repository / name, repo / name)
    serve = ServeRepo(repo, "--host", "0.0.0.0")  # beyond loopback: the proxy is on by default
    try:
        http, grpc = serve.private_ports
        listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
        for port in (http, grpc):  # loopback only (gRPC shows as [::ffff:127.0.0.1])
            bound = [line.split()[3] for line in listening.splitlines() if line.split()[3].endswith(f":{port}")]
            assert bound and all(address.removeprefix("[::ffff:").startswith("127.0.0.1") for address in bound)
        assert f"0.0.0.0:{serve.ports[0]} " in listening and f"0.0.0.0:{serve.ports[1]} " in listening
        pid = serve.triton_pid
        code, text = _post(f"http://127.0.0.1:{serve.ports[0]}", f"/v2/models/{SMALL}/infer", CRASHING_BODY)
        assert code == 400 and "proxy rule shape" in text
        assert serve.triton_pid == pid
        children = {child.name(): child.pid for child in psutil.Process(serve.process.pid).children()}
        assert set(children) == {"tritonserver", "haproxy"}
        serve.process.kill()
        serve.process.wait(10)
        deadline = time.monotonic() + 10
        while any(map(running, children.values())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(running, children.values()))
    finally:
        serve.stop()


def test_serve_repo_refuses_proxy_flags_when_the_proxy_is_off(tmp_path):
    result = subprocess.run([sys.executable, "-m", "server.cli", "--repository", str(tmp_path), "--proxy", "off",
                             "--token-file", str(tmp_path / "token")], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "proxy" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory) -> Path:
    """SMALL alone, for serve-repo runs of these tests (the session's `repository` builds ResNet-152 too)."""
    repo = tmp_path_factory.mktemp("small") / "repo"
    build(repo, "--max-batch-size", "8")
    return repo


@needs_ipv6
def test_serve_repo_serves_tritonclient_over_ipv6_when_the_host_is_an_ipv6_address(small_repo):
    serve = ServeRepo(small_repo, "--host", "::1", "--proxy", "on", timeout=300)
    try:
        assert f"HTTP http://[::1]:{serve.ports[0]} " in serve.ready_line, serve.ready_line
        http = httpclient.InferenceServerClient(f"[::1]:{serve.ports[0]}")
        assert http.infer(SMALL, [_tensor(httpclient)]).as_numpy("LOGITS").shape == (1, 1000)
        grpc = grpcclient.InferenceServerClient(f"[::1]:{serve.ports[1]}")
        assert grpc.infer(SMALL, [_tensor(grpcclient)]).as_numpy("LOGITS").shape == (1, 1000)
    finally:
        serve.stop()
    assert serve.process.returncode == 0


@pytest.mark.parametrize("log_file", [False, True], ids=["default", "log-file"])
def test_serve_repo_keeps_the_proxy_log_it_names_when_it_has_stopped(small_repo, tmp_path, log_file):
    flags = ["--log-file", str(tmp_path / "triton.log")] if log_file else []
    serve = ServeRepo(small_repo, "--proxy", "on", *flags, timeout=300)
    try:
        named = Path(serve.ready_line.rpartition("  log ")[2])
        assert serve.http.is_server_ready()
    finally:
        serve.stop()
    assert serve.process.returncode == 0
    if log_file:
        assert named == tmp_path / "triton.log.haproxy.log"
    assert named.is_file() and named.read_text().strip(), f"{named} is gone or empty"


def test_second_serve_repo_on_the_same_ports_exits_at_once_naming_the_port_and_the_first_keeps_serving(small_repo):
    first = ServeRepo(small_repo, "--host", "0.0.0.0", timeout=300)
    try:
        started = time.monotonic()
        try:
            second = subprocess.run(
                [sys.executable, "-m", "server.cli", "--repository", str(small_repo), "--host", "0.0.0.0",
                 "--http-port", str(first.ports[0]), "--grpc-port", str(first.ports[1]),
                 "--metrics-port", str(free_port())], capture_output=True, text=True, cwd=ROOT, timeout=60)
        except subprocess.TimeoutExpired as running:
            pytest.fail(f"the second serve-repo still ran after 60 s: {(running.stdout or b'')[-2000:]!r}")
        took = time.monotonic() - started
        assert second.returncode == 1, second.stdout + second.stderr
        assert f"port {first.ports[0]} on 0.0.0.0 is busy" in second.stderr, second.stderr
        assert "ready" not in second.stdout and took < 20, (took, second.stdout)  # refused before Triton starts
        for module, url in ((httpclient, f"127.0.0.1:{first.ports[0]}"), (grpcclient, f"127.0.0.1:{first.ports[1]}")):
            for _ in range(4):  # a second proxy sharing the port (SO_REUSEPORT) would take about half of these
                client = module.InferenceServerClient(url)
                assert client.infer(SMALL, [_tensor(module)]).as_numpy("LOGITS").shape == (1, 1000)
        assert not first.seen("the proxy died"), first.lines[-10:]
    finally:
        first.stop()


def test_a_second_haproxy_cannot_share_the_proxys_port_when_it_binds_it_too(tmp_path):
    http = free_port()
    upstream = ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")  # nothing there: HAProxy starts all the same
    first = Proxy(ProxySettings("127.0.0.1", http, free_port()), *upstream, tmp_path).start()
    try:
        (tmp_path / "second").mkdir()
        second = Proxy(ProxySettings("0.0.0.0", http, free_port()), *upstream, tmp_path / "second")
        try:
            result = subprocess.run(second.command(), env={**os.environ, **second.environment()},
                                    capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a second HAProxy runs on port {http} beside the first (SO_REUSEPORT)")
        assert result.returncode != 0 and "cannot bind socket" in result.stdout + result.stderr
        assert first.running()
    finally:
        first.stop()
