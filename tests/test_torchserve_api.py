"""TorchServe's API served by serve-repo on Triton: the seed's walkthrough run verbatim with curl, answers and errors
compared with TorchServe 0.12 itself on the same archive and photo, batching, scaling and unregistering under traffic,
bad bodies, tokens, config.properties."""
from __future__ import annotations

import io
import json
import os
import re
import signal
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
from PIL import Image

from perf import torchserve
from perf.serve import TorchServeFront
from server.procfs import stubs_of
from test_handler import BATCHING, JSON_HANDLER, _archive
from support import ROOT

PHOTO = ROOT / "clients" / "samples" / "chelsea.jpg"
NAME, VERSION = "resnet-18", "2.0"
SEED_REGISTRATION = "batch_size=8&max_batch_delay=10&initial_workers=1"  # the seed's, verbatim
ALLOWED = r"http://127\.0\.0\.1:[0-9]+/.*"  # both servers' allowed_urls: the test's web server is on loopback
# Issue 52, compared with TorchServe 0.12 byte for byte: a file:// archive from outside the store named as one of the
# store's is refused (TorchServe copies such an archive into its store, never over a file); a URL that allowed_urls
# refuses is refused at once when asynchronous too (F4: it was answered 202 "Processing worker updates...")
ISSUE_52 = {"outside same name": "url=file://{outside}/resnet-18.mar&model_name=m",
            "async refused": "url=http%3A%2F%2F%5B%3A%3A1%5D%2Fx.mar&synchronous=false"}


def call(method: str, url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    # urllib's default for a body is a form's content type, which TorchServe then tries to parse as a form
    headers = {"Content-Type": "application/octet-stream", **(headers or {})} if data is not None else headers or {}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=300) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def curl(*args: str) -> tuple[int, str]:
    """curl as a user runs it; (status, body)."""
    done = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", *args], capture_output=True, text=True,
                          timeout=600, check=True)
    body, _, code = done.stdout.rpartition("\n")
    return int(code), body


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """A model store with an image_classifier archive made by torch-model-archiver (resnet18, its last layer scaled
    so that the softmax is not one 1.0), no model-config.yaml: its batching comes from the registration."""
    folder = tmp_path_factory.mktemp("ts") / "model_store"
    torchserve.resnet_archive(folder, NAME, None, None, None, arch="resnet18", fc_scale=0.01, version=VERSION)
    (folder / "not-an-archive.mar").write_text("hello\n")
    (folder.parent / "outside").mkdir()  # issue 52 F1: a file named as the store's archive, outside it
    (folder.parent / "outside" / f"{NAME}.mar").write_bytes(b"PK not the store's archive")
    return folder


@pytest.fixture(scope="module")
def front(store):
    # allowed_urls named explicitly: the test's web server is on loopback, which the default refuses
    started = TorchServeFront(store.parent / "front", "--trust-model-code", model_store=str(store),
                              enable_model_api="true", disable_token_authorization="true",
                              max_request_size="3000000", max_workers_per_model="2", foo_bar="1",
                              allowed_urls=ALLOWED)
    yield started
    started.stop()


@pytest.fixture(scope="module")
def web(store):
    """A web server of the model store's files: a download of a file the store already has."""
    import functools
    import http.server

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(store))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def reference(store, web, tmp_path_factory):
    """TorchServe 0.12 itself serving the same archive: its answers to the requests these tests send."""
    folder = tmp_path_factory.mktemp("torchserve")
    with torchserve.started(folder, store / f"{NAME}.mar", workers=1,
                            properties={"enable_model_api": "true", "allowed_urls": ALLOWED}) as real:
        base = real.inference_url
        answers = {"photo": call("POST", f"{base}/predictions/{NAME}", PHOTO.read_bytes()),
                   "empty": call("POST", f"{base}/predictions/{NAME}", b""),
                   "text": call("POST", f"{base}/predictions/{NAME}", b"hello"),
                   "truncated": call("POST", f"{base}/predictions/{NAME}", PHOTO.read_bytes()[:1000]),
                   "unknown model": call("POST", f"{base}/predictions/nope", PHOTO.read_bytes()),
                   "unknown version": call("POST", f"{base}/predictions/{NAME}/9.9", PHOTO.read_bytes()),
                   "no url": call("POST", f"{real.management_url}/models"),
                   "twice": call("POST", f"{real.management_url}/models?url={NAME}.mar"),
                   "not an archive": call("POST", f"{real.management_url}/models?url=not-an-archive.mar"),
                   "missing archive": call("POST", f"{real.management_url}/models?url=missing.mar"),
                   "relative path": call("POST", f"{real.management_url}/models?url=../{NAME}.mar"),
                   "absolute path": call("POST", f"{real.management_url}/models?url={store}/{NAME}.mar"),
                   "etc passwd": call("POST", f"{real.management_url}/models?url=/etc/passwd"),
                   "download exists": call("POST", f"{real.management_url}/models?url={web}/{NAME}.mar"),
                   **{key: call("POST", f"{real.management_url}/models?"
                                       + query.format(outside=store.parent / "outside")) for key, query in ISSUE_52.items()},
                   "describe unknown": call("GET", f"{real.management_url}/models/nope"),
                   "ping": call("GET", f"{base}/ping"),
                   "list": call("GET", f"{real.management_url}/models?limit=1"),
                   "describe": call("GET", f"{real.management_url}/models/{NAME}"),
                   "min over max": call("PUT", f"{real.management_url}/models/{NAME}?min_worker=3&max_worker=2"),
                   "scale": call("PUT", f"{real.management_url}/models/{NAME}?min_worker=1&max_worker=1"
                                        "&synchronous=true")}
        # A custom handler's archive (registered last: the list above shows the first model only).
        _archive(store, "jsonsum", JSON_HANDLER, {"scale.json": '{"scale": 3}'}, BATCHING)
        status, body = call("POST", f"{real.management_url}/models?url=jsonsum.mar&initial_workers=1"
                                    "&synchronous=true")
        assert status == 200, body
        for key, sent in (("jsonsum", b'{"values": [1, 2, 3.5]}'), ("jsonsum fails", b'{"values": [1], "fail": true}')):
            answers[key] = call("POST", f"{base}/predictions/jsonsum", sent, {"Content-Type": "application/json"})
    with torchserve.started(folder / "off", store / f"{NAME}.mar", workers=1) as real:  # the model API off
        answers["model api off"] = call("POST", f"{real.management_url}/models?url={NAME}.mar")
        answers["scale, model api off"] = call("PUT", f"{real.management_url}/models/{NAME}?min_worker=1&max_worker=1"
                                                      "&synchronous=true")
    return answers


def _describe(front, name: str = NAME) -> dict:
    status, body = call("GET", f"{front.management_url}/models/{name}")
    assert status == 200, body
    return json.loads(body)[0]


def test_seed_walkthrough_runs_verbatim_and_answers_as_torchserve_when_run_with_curl(front, reference):
    code, body = curl(f"{front.inference_url.removeprefix('http://')}/ping")
    assert code == 200 and json.loads(body) == {"status": "Healthy"}
    code, body = curl("-X", "POST", f"{front.management_url}/models?url={NAME}.mar&{SEED_REGISTRATION}")
    assert code == 200 and json.loads(body) == {
        "status": f'Model "{NAME}" Version: {VERSION} registered with 1 initial workers'}
    described = _describe(front)
    assert (described["batchSize"], described["maxBatchDelay"], described["minWorkers"]) == (8, 10, 1)
    assert [w["status"] for w in described["workers"]] == ["READY"]
    code, body = curl(f"{front.inference_url}/predictions/{NAME}", "-T", str(PHOTO))
    ours, theirs = json.loads(body), json.loads(reference["photo"][1])
    assert code == 200 and list(ours) == list(theirs)  # the same five labels, in the same order
    assert np.allclose(list(ours.values()), list(theirs.values()), rtol=0, atol=1e-5)
    assert body.startswith("{\n  \"") and not body.endswith("\n")  # printed as TorchServe prints it


def test_predictions_answer_the_same_when_sent_as_put_multipart_or_with_the_version(front):
    photo = PHOTO.read_bytes()
    first = call("POST", f"{front.inference_url}/predictions/{NAME}", photo)
    assert first[0] == 200
    for args in ([f"{front.inference_url}/predictions/{NAME}", "-X", "PUT", "--data-binary", f"@{PHOTO}"],
                 [f"{front.inference_url}/predictions/{NAME}/{VERSION}", "--data-binary", f"@{PHOTO}"],
                 [f"{front.inference_url}/predictions/{NAME}", "-F", f"data=@{PHOTO}"]):
        code, body = curl(*args)
        assert code == 200 and json.loads(body) == json.loads(first[1]), args


def test_answers_and_errors_are_torchserves_when_compared_with_torchserve(front, reference, store, web):
    photo = PHOTO.read_bytes()
    ours = {"empty": call("POST", f"{front.inference_url}/predictions/{NAME}", b""),
            "text": call("POST", f"{front.inference_url}/predictions/{NAME}", b"hello"),
            "truncated": call("POST", f"{front.inference_url}/predictions/{NAME}", photo[:1000]),
            "unknown model": call("POST", f"{front.inference_url}/predictions/nope", photo),
            "unknown version": call("POST", f"{front.inference_url}/predictions/{NAME}/9.9", photo),
            "no url": call("POST", f"{front.management_url}/models"),
            "twice": call("POST", f"{front.management_url}/models?url={NAME}.mar"),
            "not an archive": call("POST", f"{front.management_url}/models?url=not-an-archive.mar"),
            "missing archive": call("POST", f"{front.management_url}/models?url=missing.mar"),
            "relative path": call("POST", f"{front.management_url}/models?url=../{NAME}.mar"),
            "absolute path": call("POST", f"{front.management_url}/models?url={store}/{NAME}.mar"),
            "etc passwd": call("POST", f"{front.management_url}/models?url=/etc/passwd"),
            # issue 42 B7: a download is never reused (nor replaced) by its file name, whatever the host
            "download exists": call("POST", f"{front.management_url}/models?url={web}/{NAME}.mar"),
            **{key: call("POST", f"{front.management_url}/models?"
                                   + query.format(outside=store.parent / "outside")) for key, query in ISSUE_52.items()},
            "describe unknown": call("GET", f"{front.management_url}/models/nope"),
            "ping": call("GET", f"{front.inference_url}/ping"),
            "list": call("GET", f"{front.management_url}/models?limit=1"),
            "describe": call("GET", f"{front.management_url}/models/{NAME}"),
            "min over max": call("PUT", f"{front.management_url}/models/{NAME}?min_worker=3&max_worker=2"),
            "scale": call("PUT", f"{front.management_url}/models/{NAME}?min_worker=1&max_worker=1&synchronous=true")}
    assert list(json.loads(ours.pop("describe")[1])[0]) == list(json.loads(reference["describe"][1])[0])  # keys
    for case, (status, body) in ours.items():
        their_status, their_body = reference[case]
        mine, theirs = json.loads(body), json.loads(their_body)
        assert status == their_status, (case, body, their_body)
        assert set(mine) == set(theirs) and mine.get("type") == theirs.get("type"), (case, mine, theirs)
        if case not in ("not an archive", "unknown version"):
            assert body == their_body, case  # byte for byte


def test_bad_bodies_get_torchserves_codes_and_the_server_stays_ready_when_sent(front, tmp_path):
    big = tmp_path / "48mp.jpg"  # 48 megapixels: under max_pixels (50 M, the plain front's bound too)
    Image.new("RGB", (8000, 6000), (120, 90, 60)).save(big, quality=50)
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", big.read_bytes())[0] == 200
    over = tmp_path / "60mp.png"  # 60 megapixels: under PIL's bound (TorchServe decodes it), over ours (issue 42 B9)
    Image.new("1", (8000, 7500)).save(over)
    status, body = call("POST", f"{front.inference_url}/predictions/{NAME}", over.read_bytes())
    assert status == 503 and json.loads(body)["message"] == "Prediction failed"  # as any body it cannot decode
    status, body = call("POST", f"{front.inference_url}/predictions/{NAME}", b"\xff" * 3_000_001)
    assert (status, body) == (413, b"")  # max_request_size=3000000: TorchServe's empty 413
    assert call("GET", f"{front.inference_url}/ping") == (200, b'{\n  "status": "Healthy"\n}\n')
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", PHOTO.read_bytes())[0] == 200


def _triton_counts(front, model: str) -> tuple[float, float]:
    """(requests, executions) of `model` from Triton's own metrics, which the metrics port serves too."""
    text = call("GET", f"{front.metrics_url}/metrics")[1].decode()
    values = [float(re.search(rf'^{metric}{{model="{re.escape(model)}",version="1"}} (\S+)$', text, re.M).group(1))
              for metric in ("nv_inference_count", "nv_inference_exec_count")]
    return values[0], values[1]


def test_concurrent_predictions_are_batched_by_triton_and_counted_in_torchserves_metrics(front):
    before = _triton_counts(front, NAME)
    photo = PHOTO.read_bytes()
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):  # rounds of 8 at once, until Triton has run one as a batch
            statuses = list(pool.map(lambda _: call("POST", f"{front.inference_url}/predictions/{NAME}", photo)[0],
                                     range(8)))
            assert statuses == [200] * 8
            requests, executions = (a - b for a, b in zip(_triton_counts(front, NAME), before))
            if executions < requests:
                break
    assert executions < requests, "8 concurrent predictions never reached the model as one batch"
    text = call("GET", f"{front.metrics_url}/metrics")[1].decode()
    total = re.search(rf'^ts_inference_requests_total{{model_name="{NAME}",model_version="{VERSION}",hostname="[^"]*",}}'
                      r' (\S+)$', text, re.M)
    assert total and float(total.group(1)) >= requests
    assert "# TYPE ts_queue_latency_microseconds counter" in text and "ts_inference_latency_microseconds{" in text


def test_unsupported_config_key_is_named_once_and_not_fatal_when_started(front):
    assert [line for line in front.lines if "foo_bar" in line] == [
        "config.properties: foo_bar is not supported by serve-repo; ignored"]


def test_a_custom_handler_archive_is_served_by_its_own_handler_when_registered(front, reference):
    # The archive: made in the store by `reference`, which registered it with TorchServe 0.12 too.
    status, body = call("POST", f"{front.management_url}/models?url=jsonsum.mar&initial_workers=1")
    assert status == 200, body
    url = f"{front.inference_url}/predictions/jsonsum"
    status, body = call("POST", url, b'{"values": [1, 2, 3.5]}', {"Content-Type": "application/json"})
    assert status == 200 and json.loads(body) == {"sum": 19.5, "batch": 1}
    assert (status, body) == reference["jsonsum"]  # TorchServe's bytes: its worker's json.dumps(indent=2)
    with ThreadPoolExecutor(8) as pool:  # one handle() call per batch Triton formed
        answers = list(pool.map(lambda i: call("POST", url, json.dumps({"values": [i]}).encode(),
                                                {"Content-Type": "application/json"}), range(8)))
    assert [json.loads(b)["sum"] for _, b in answers] == [3 * i for i in range(8)]
    failed = call("POST", url, b'{"values": [1], "fail": true}', {"Content-Type": "application/json"})
    assert failed[0] == 503 and json.loads(failed[1])["message"] == "Prediction failed"
    assert failed == reference["jsonsum fails"]
    # Issue 42 B9: refused by the stub before the handler, this request alone, with a 4xx that says why
    deep = call("POST", url, b"[" * 5000 + b"]" * 5000, {"Content-Type": "application/json"})
    assert deep[0] == 400 and json.loads(deep[1]) == {"code": 400, "type": "BadRequestException",
                                                      "message": "JSON nested too deeply to parse"}, deep
    buffer = io.BytesIO()
    Image.new("1", (8000, 7500)).save(buffer, format="PNG")  # 60 M pixels: over max_pixels (50 M)
    bomb = call("POST", url, buffer.getvalue())
    assert bomb[0] == 413 and json.loads(bomb[1])["message"] == (
        "decompression bomb refused: the header claims 60,000,000 pixels, more than max_pixels 50,000,000"), bomb
    assert call("GET", f"{front.inference_url}/ping")[0] == 200


class Traffic:
    """Predictions sent back to back from 4 threads until stopped; every answer kept with when it was sent."""

    def __init__(self, url: str):
        self.url, self.answers, self._stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._run) for _ in range(4)]
        for thread in self.threads:
            thread.start()

    def _run(self):
        photo = PHOTO.read_bytes()
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                status = call("POST", self.url, photo)[0]
            except OSError as exc:
                status = repr(exc)
            self.answers.append((sent, status))

    def stop(self) -> list:
        self._stop.set()
        for thread in self.threads:
            thread.join(120)
        return self.answers


def test_scaling_1_2_1_under_traffic_loses_nothing_when_done_by_live_reload(front):
    traffic = Traffic(f"{front.inference_url}/predictions/{NAME}")
    try:
        for workers in (2, 1):
            status, body = call("PUT", f"{front.management_url}/models/{NAME}?min_worker={workers}"
                                       f"&max_worker={workers}&synchronous=true")
            assert status == 200, body
            assert len(_describe(front)["workers"]) == workers
            time.sleep(1)
    finally:
        answers = traffic.stop()
    assert len(answers) > 8 and {status for _, status in answers} == {200}


def _stubs(front) -> Counter:
    """The live python-backend stubs serving an instance under the front's tritonserver, by Triton model."""
    triton = next(p for p in psutil.Process(front.process.pid).children(recursive=True)
                  if p.name().startswith("tritonserver"))
    return Counter(stub.model for stub in stubs_of(triton.pid) if stub.alive and stub.serves)


def test_workers_over_max_workers_per_model_are_refused_with_400_and_nothing_starts_when_asked_for(front):
    """`front` runs with max_workers_per_model=2: a scale or a registration asking for 3 is refused at once."""
    before = _stubs(front)
    status, body = call("PUT", f"{front.management_url}/models/{NAME}?min_worker=3&max_worker=3&synchronous=true")
    assert (status, json.loads(body)["type"]) == (400, "BadRequestException"), body
    assert json.loads(body)["message"] == "Invalid min_worker: 3 is over max_workers_per_model=2"
    status, body = call("POST", f"{front.management_url}/models?url={NAME}.mar&model_name=many&initial_workers=3")
    assert (status, json.loads(body)["message"]) == (400, "Invalid initial_workers: 3 is over max_workers_per_model=2")
    assert call("GET", f"{front.management_url}/models/many")[0] == 404
    described = _describe(front)
    assert described["minWorkers"] == len(described["workers"]) == 1 and _stubs(front) == before


def test_ping_says_unhealthy_while_a_worker_is_dead_and_healthy_once_replaced_when_its_stub_is_killed(front):
    pid = _describe(front)["workers"][0]["pid"]
    os.kill(pid, signal.SIGKILL)
    seen, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline and not (500 in seen and seen[-1] == 200):
        seen.append(call("GET", f"{front.inference_url}/ping")[0])
        time.sleep(0.02)
    assert 500 in seen and seen[-1] == 200, seen[-20:]  # a new stub serves (serve-repo replaced the dead one)
    assert _describe(front)["workers"][0]["pid"] != pid
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", PHOTO.read_bytes())[0] == 200


def test_unregistering_under_traffic_answers_every_request_in_flight_when_deleted(front):
    traffic = Traffic(f"{front.inference_url}/predictions/{NAME}")
    time.sleep(2)
    deleted = time.monotonic()
    status, body = call("DELETE", f"{front.management_url}/models/{NAME}/{VERSION}")
    answers = traffic.stop()
    assert status == 200, body
    before = [code for sent, code in answers if sent < deleted]
    assert before and set(before) <= {200, 404}  # sent before the DELETE: answered (404 once the name is gone)
    assert {code for sent, code in answers if sent >= deleted} <= {200, 404}
    assert call("GET", f"{front.management_url}/models/{NAME}")[0] == 404
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", PHOTO.read_bytes())[0] == 404


def test_an_http_url_is_fetched_into_the_store_and_served_when_registered(front, store, tmp_path):
    """After the unregister above: the same archive under another file name, from a web server."""
    import functools
    import http.server

    (tmp_path / "fetched.mar").write_bytes((store / f"{NAME}.mar").read_bytes())
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{web.server_address[1]}/fetched.mar"
        status, body = call("POST", f"{front.management_url}/models?url={url}&{SEED_REGISTRATION}")
    finally:
        web.shutdown()
    assert status == 200, body
    assert (store / "fetched.mar").read_bytes() == (tmp_path / "fetched.mar").read_bytes()
    assert _describe(front)["modelUrl"] == url
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", PHOTO.read_bytes())[0] == 200


def test_a_second_version_is_served_beside_the_first_and_set_default_as_torchserve_when_registered(front, store):
    """After the url test: resnet-18 2.0 is registered; its 3.0 comes from another file of the store."""
    other = torchserve.resnet_archive(store.parent / "v3", NAME, None, None, None, arch="resnet18", fc_scale=0.01,
                                      seed=1, version="3.0")
    shutil.copy(other, store / "resnet-18-v3.mar")
    status, body = call("POST", f"{front.management_url}/models?url=resnet-18-v3.mar&initial_workers=1")
    assert (status, json.loads(body)) == (200, {"status": f'Model "{NAME}" Version: 3.0 registered with 1 initial '
                                                          "workers"})
    versions = json.loads(call("GET", f"{front.management_url}/models/{NAME}/all")[1])
    assert sorted(v["modelVersion"] for v in versions) == ["2.0", "3.0"]
    photo = PHOTO.read_bytes()
    two, three = (call("POST", f"{front.inference_url}/predictions/{NAME}/{v}", photo) for v in ("2.0", "3.0"))
    assert two[0] == three[0] == 200 and json.loads(two[1]) != json.loads(three[1])  # other weights, other answer
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", photo)[1] == two[1]  # the first is the default
    # TorchServe's own answers (recorded from TorchServe 0.12 on the same sequence)
    assert call("DELETE", f"{front.management_url}/models/{NAME}/2.0") == (403, (
        b'{\n  "code": 403,\n  "type": "InvalidModelVersionException",\n  "message": "Cannot remove default version '
        b'for model resnet-18"\n}\n'))
    assert call("PUT", f"{front.management_url}/models/{NAME}/3.0/set-default") == (200, (
        b'{\n  "status": "Default version successfully updated for model \\"resnet-18\\" to \\"3.0\\""\n}\n'))
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", photo)[1] == three[1]
    assert call("DELETE", f"{front.management_url}/models/{NAME}/2.0")[0] == 200
    assert call("POST", f"{front.inference_url}/predictions/{NAME}", photo)[1] == three[1]
    assert not (store / "fetched.mar").exists()  # as TorchServe 0.12: a downloaded archive leaves with its model


def test_an_archives_min_workers_are_capped_and_described_as_run_when_over_max_workers_per_model(front, store):
    """After the second-version test (resnet-18 3.0 alone): version 3_0's model-config.yaml asks for minWorkers 10;
    max_workers_per_model=2 gives it 2 classifier and at most 2 decoding stubs, and describe says 2."""
    other = torchserve.resnet_archive(store.parent / "v3_0", NAME, None, None, 10, arch="resnet18", fc_scale=0.01,
                                      seed=2, version="3_0")
    shutil.copy(other, store / "resnet-18-v3_0.mar")
    before = _stubs(front)
    status, body = call("POST", f"{front.management_url}/models?url=resnet-18-v3_0.mar")
    assert status == 200, body
    described = _describe(front, f"{NAME}/3_0")
    assert described["minWorkers"] == described["maxWorkers"] == len(described["workers"]) == 2
    assert sorted((_stubs(front) - before).values()) == [2, 2]  # its classifier's and its decoder's stubs


def test_versions_and_names_alike_once_sanitized_are_served_and_unregistered_apart_when_registered(front, reference):
    """After the minWorkers test: 3.0 and 3_0 (other weights) are both registered; then the custom handler's archive
    (made by `reference`) as resnet-18_v3_0_image, the name 3.0's image model had when '.' and '_' were both '_'."""
    photo, url = PHOTO.read_bytes(), f"{front.inference_url}/predictions/{NAME}"
    three, three_ = (call("POST", f"{url}/{version}", photo) for version in ("3.0", "3_0"))
    assert three[0] == three_[0] == 200 and json.loads(three[1]) != json.loads(three_[1])
    other = f"{NAME}_v3_0_image"
    status, body = call("POST", f"{front.management_url}/models?url=jsonsum.mar&model_name={other}&initial_workers=1")
    assert status == 200, body
    summed = call("POST", f"{front.inference_url}/predictions/{other}", b'{"values": [1]}',
                  {"Content-Type": "application/json"})
    assert summed[0] == 200 and json.loads(summed[1])["sum"] == 3
    assert call("POST", f"{url}/3.0", photo) == three and call("POST", f"{url}/3_0", photo) == three_
    assert call("DELETE", f"{front.management_url}/models/{NAME}/3_0")[0] == 200
    assert call("DELETE", f"{front.management_url}/models/{other}")[0] == 200
    assert call("POST", f"{url}/3.0", photo) == three and call("POST", url, photo) == three
    assert call("GET", f"{front.inference_url}/ping")[0] == 200
    versions = json.loads(call("GET", f"{front.management_url}/models/{NAME}/all")[1])
    assert [v["modelVersion"] for v in versions] == ["3.0"]


def test_handler_path_serves_torchserves_own_image_classifier_with_torchserves_answer_when_asked(store, reference):
    """serve-repo --handler-path: the archive's image_classifier handler itself, in Triton's stub, batched by Triton."""
    handled = TorchServeFront(store.parent / "handler-path", "--handler-path", "--trust-model-code",
                              model_store=str(store), load_models=f"{NAME}.mar", disable_token_authorization="true")
    try:
        status, body = call("POST", f"{handled.inference_url}/predictions/{NAME}", PHOTO.read_bytes())
        ours, theirs = json.loads(body), json.loads(reference["photo"][1])
        assert status == 200 and list(ours) == list(theirs)
        assert np.allclose(list(ours.values()), list(theirs.values()), rtol=0, atol=1e-5)
    finally:
        handled.stop()


@pytest.fixture(scope="module")
def configured(store, front):
    """A second serve-repo on the same store, configured as TorchServe users do: tokens on, the archive loaded at start
    with models= settings, the model API off, job_queue_size 1. Started after `front` built the archive."""
    models = json.dumps({NAME: {VERSION: {"marName": f"{NAME}.mar", "batchSize": 8, "maxBatchDelay": 10,
                                          "minWorkers": 1, "defaultVersion": True}}})
    started = TorchServeFront(store.parent / "configured", "--trust-model-code", model_store=str(store),
                              load_models=f"{NAME}.mar",
                              models=models, job_queue_size="1")
    keys = json.loads((started.folder / "key_file.json").read_text())
    started.keys = {api: {"Authorization": f"Bearer {keys[api]['key']}"} for api in ("inference", "management")}
    yield started
    started.stop()


def test_load_models_uses_the_models_settings_and_the_build_cache_when_started(configured):
    assert not configured.seen("building ")  # `front` built it with the same options: the cache serves it
    status, body = call("GET", f"{configured.management_url}/models/{NAME}", headers=configured.keys["management"])
    described = json.loads(body)[0]
    assert status == 200 and described["loadedAtStartup"] is True
    assert (described["batchSize"], described["maxBatchDelay"]) == (8, 10)


def test_tokens_guard_each_api_as_torchserves_when_on(configured):
    url, photo = f"{configured.inference_url}/predictions/{NAME}", PHOTO.read_bytes()
    refused = call("POST", url, photo)  # as TorchServe: 400 InvalidKeyException, on /ping too
    assert refused[0] == 400 and json.loads(refused[1])["type"] == "InvalidKeyException"
    assert call("POST", url, photo, configured.keys["management"])[0] == 400
    assert call("GET", f"{configured.inference_url}/ping")[0] == 400
    assert call("GET", f"{configured.inference_url}/ping", headers=configured.keys["inference"])[0] == 200
    assert call("POST", url, photo, configured.keys["inference"])[0] == 200
    assert call("GET", f"{configured.management_url}/models", headers=configured.keys["inference"])[0] == 400


def test_model_api_is_off_unless_enabled_and_answers_as_torchserve_when_off(configured, reference):
    off = call("POST", f"{configured.management_url}/models?url={NAME}.mar", headers=configured.keys["management"])
    assert off == reference["model api off"]


def test_scaling_with_the_model_api_off_answers_as_torchserve_within_max_workers_per_model_when_asked(configured,
                                                                                                   reference):
    """TorchServe 0.12 scales with the model API off (only registering and unregistering are refused); so does
    serve-repo, up to max_workers_per_model (default: the CPU count)."""
    scale = f"{configured.management_url}/models/{NAME}?synchronous=true&"
    headers = configured.keys["management"]
    assert call("PUT", scale + "min_worker=1&max_worker=1", headers=headers) == reference["scale, model api off"]
    cap = os.cpu_count() or 1
    status, body = call("PUT", scale + f"min_worker={cap + 1}", headers=headers)
    assert (status, json.loads(body)["message"]) == (
        400, f"Invalid min_worker: {cap + 1} is over max_workers_per_model={cap}"), body
    described = json.loads(call("GET", f"{configured.management_url}/models/{NAME}", headers=headers)[1])[0]
    assert described["minWorkers"] == len(described["workers"]) == 1


def test_a_full_job_queue_answers_503_at_once_and_the_rest_are_served_when_bursting(configured):
    """job_queue_size 1 beyond the 8 the instance holds: of 64 sent at once, those over 9 pending are refused."""
    url, photo = f"{configured.inference_url}/predictions/{NAME}", PHOTO.read_bytes()
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda _: call("POST", url, photo, configured.keys["inference"]), range(64)))
    statuses = [status for status, _ in answers]
    refused = [json.loads(body) for status, body in answers if status == 503]
    assert set(statuses) == {200, 503} and statuses.count(200) >= 9
    assert {(r["type"], r["message"].split(" has no worker")[0]) for r in refused} == {
        ("ServiceUnavailableException", f'Model "{NAME}"')}
    assert call("POST", url, photo, configured.keys["inference"])[0] == 200  # and it serves on


def test_slow_bodies_do_not_fill_the_job_queue_and_are_cut_when_they_stall(configured):
    """Issue 42 B2: connections holding a partial body were counted in the job queue before their body was read:
    a few of them made every honest prediction 503. A request joins the queue once its body is read, as TorchServe's
    (its frontend queues a request it has received whole); a body that stalls for the head's timeout is cut."""
    import socket

    from server.torchserve.bounded_http import HEAD_TIMEOUT_S

    url, photo = f"{configured.inference_url}/predictions/{NAME}", PHOTO.read_bytes()
    host, port = configured.inference_url.removeprefix("http://").split(":")
    key = configured.keys["inference"]["Authorization"]
    slow = []
    for _ in range(12):  # more than job_queue_size 1 + the 8 one instance holds
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.sendall(f"POST /predictions/{NAME} HTTP/1.1\r\nHost: x\r\nAuthorization: {key}\r\n"
                     "Content-Type: application/octet-stream\r\nContent-Length: 100000\r\n\r\n".encode() + b"0" * 10)
        slow.append(sock)
    try:
        time.sleep(1)  # their heads are read (were they counted, the honest request below would be refused)
        for _ in range(3):
            assert call("POST", url, photo, configured.keys["inference"])[0] == 200
        began = time.monotonic()
        for sock in slow:  # each is closed once its body has stalled HEAD_TIMEOUT_S
            sock.settimeout(HEAD_TIMEOUT_S + 50)
            try:
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass
        assert time.monotonic() - began < HEAD_TIMEOUT_S + 50
    finally:
        for sock in slow:
            sock.close()
    assert call("POST", url, photo, configured.keys["inference"])[0] == 200


def test_predictions_get_torchserves_503_not_a_traceback_while_triton_restarts(configured):
    """Issue 42 B10: while Triton was down, predictions got Starlette's 500 (aiohttp's connection error uncaught)."""
    import psutil

    url, photo = f"{configured.inference_url}/predictions/{NAME}", PHOTO.read_bytes()
    triton = [p for p in psutil.Process(configured.process.pid).children(recursive=True) if p.name() == "tritonserver"]
    assert len(triton) == 1
    triton[0].kill()
    triton[0].wait(30)
    statuses = [call("POST", url, photo, configured.keys["inference"])[0] for _ in range(5)]
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses  # the first ones meet Triton down
    deadline = time.monotonic() + 300
    while call("POST", url, photo, configured.keys["inference"])[0] != 200:  # serve-repo restarts Triton
        assert time.monotonic() < deadline
        time.sleep(1)


def test_registrations_from_a_dripping_server_leave_ping_describe_and_metrics_answering(front):
    """Issue 42 B6: six registrations (synchronous=false) from a server sending a byte a second took every thread of
    the pool /ping, describe and /metrics share: they stopped answering. Registrations run in threads of their own
    now, and a download has an overall deadline. Issue 52: a registration is answered once its archive is fetched and
    the model is in a snapshot, synchronous or not (as TorchServe, whose download comes before its 202): these wait."""
    import http.server
    import urllib.parse

    stop = threading.Event()

    class Drip(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(10 << 20))
            self.end_headers()
            while not stop.wait(0.5):
                self.wfile.write(b"P")
                self.wfile.flush()

        def log_message(self, *args):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    web.daemon_threads = True
    threading.Thread(target=web.serve_forever, daemon=True).start()
    answers: list = []

    def register(i: int) -> None:
        url = urllib.parse.quote(f"http://127.0.0.1:{web.server_address[1]}/drip{i}.mar", safe="")
        answers.append(call("POST", f"{front.management_url}/models?url={url}&synchronous=false"))
    clients = [threading.Thread(target=register, args=(i,), daemon=True) for i in range(10)]
    try:
        for client in clients:
            client.start()
        time.sleep(2)  # the downloads have begun
        assert answers == []  # not answered before the archive is there
        for url in (f"{front.inference_url}/ping", f"{front.management_url}/models", f"{front.metrics_url}/metrics"):
            with urllib.request.urlopen(url, timeout=30) as reply:  # timed out before: no thread left for them
                assert reply.status == 200
    finally:
        stop.set()
        web.shutdown()
        web.server_close()  # the two registrations still queued (8 change threads) are refused at once, not after
        # their connection's 60 s timeout on a listening socket nobody accepts from
    for client in clients:  # the drip cut short: each registration refused, none registered
        client.join(120)
    assert len(answers) == 10 and all(status >= 400 for status, _ in answers), answers
    listed = json.loads(call("GET", f"{front.management_url}/models")[1])["models"]
    assert not [entry for entry in listed if entry["modelName"].startswith("drip")], listed


def test_loopback_urls_are_refused_at_once_whether_synchronous_or_not_when_registered(front):
    """Issue 52 F4: with synchronous=false these five were answered 202 "Processing worker updates...", the refusal
    only in the log; now each is refused at once, as synchronously (TorchServe's answer for [::1]: the test above)."""
    for url in ("http://127.0.0.1/x.mar", "http://[::1]/x.mar", "http://0x7f000001/x.mar", "http://localhost/x.mar",
                "http://127.1/x.mar"):
        for synchronous in ("false", "true"):
            status, body = call("POST", f"{front.management_url}/models?url={urllib.parse.quote(url, safe='')}"
                                        f"&synchronous={synchronous}")
            assert (status, json.loads(body)["message"]) == (404, f"Given URL {url} does not match any allowed URL(s)")


def test_a_name_past_128_characters_is_refused_naming_the_model_and_128_registered_when_asked(front):
    """Issue 52 F3: names had no bound (1 MiB names were taken; 300 characters failed at the first worker with
    "File name too long", naming the archive)."""
    status, body = call("POST", f"{front.management_url}/models?url={NAME}.mar&model_name={'n' * 129}"
                                "&initial_workers=0")
    assert (status, json.loads(body)["message"]) == (400, f"Invalid model name: {'n' * 80}... (129 characters): at "
                                                          "most 128 characters")
    status, body = call("POST", f"{front.management_url}/models?url={NAME}.mar&model_name={'n' * 128}"
                                "&initial_workers=0")
    assert status == 200, body
    assert call("DELETE", f"{front.management_url}/models/{'n' * 128}")[0] == 200


def test_a_change_whose_snapshot_cannot_be_written_is_answered_500_not_as_durable(front):
    """Issue 52: a snapshot that could not be written was only logged, the change answered as if a restart would
    have it. Now the caller is told (the change is made: the model is registered, and unregistered after)."""
    from server.torchserve.snapshots import UNSAVED

    config = front.folder / "logs" / "config"
    aside = config.with_name("config-aside")
    config.rename(aside)
    config.write_text("not a folder")  # every snapshot's rename into it fails
    try:
        status, body = call("POST", f"{front.management_url}/models?url={NAME}.mar&model_name=unsaved"
                                    "&initial_workers=0")
        assert (status, json.loads(body)["message"]) == (500, UNSAVED)
        assert call("GET", f"{front.management_url}/models/unsaved")[0] == 200
        assert front.seen("not saved: ")
    finally:
        config.unlink()
        aside.rename(config)
    assert call("DELETE", f"{front.management_url}/models/unsaved")[0] == 200
    newest = max(config.iterdir(), key=lambda path: path.name)
    assert "unsaved" not in newest.read_text() and newest.name.endswith("-snapshot.cfg")
