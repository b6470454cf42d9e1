"""The openvino engine (the CPU default): precision auto resolves where the model is served and says so."""
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from backends.engines import OpenVino
from common.modelconfig import read_config
from common.precision import TOLERANCE
from images import CAT
from support import SMALL, build, reference_logits, relative_error

# bf16 keeps 8 bits of mantissa: ResNet-18's logits move by ~4e-3 of their range (measured), fp32 by 1e-6.
BF16_TOLERANCE = TOLERANCE["bf16"]


def _cpu_has_bf16() -> bool:
    import openvino as ov

    return "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@pytest.fixture(scope="module")
def auto_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("openvino") / "repo"
    build(repo, "--precision", "auto", "--max-batch-size", "8", "--max-queue-delay-us", "20000")
    return repo


def _metric_labels(server) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.ports['metrics']}/metrics", timeout=10).read().decode()
    found = re.search(r'classifier_engine_info\{([^}]*)\} 1', text)
    assert found, "no classifier_engine_info on the metrics endpoint"
    return dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))


def test_openvino_precision_auto_resolves_where_served_and_is_reported_when_loaded(auto_repo, start_server,
                                                                                   small_model):
    config = read_config(auto_repo / SMALL)
    assert (config.parameters["engine"].string_value, config.parameters["precision"].string_value) == \
        ("openvino", "auto")
    server = start_server(auto_repo)
    expected = "bf16" if _cpu_has_bf16() else "fp32"
    labels = _metric_labels(server)
    assert {k: v for k, v in labels.items() if k != "threads"} == \
        {"model": SMALL, "engine": "openvino", "precision": expected}, labels
    images = np.random.default_rng(5).standard_normal((3, 3, 224, 224)).astype(np.float32)
    tensor = httpclient.InferInput("IMAGE", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    served = httpclient.InferenceServerClient(server.http_url).infer(SMALL, [tensor]).as_numpy("LOGITS")
    reference = reference_logits(small_model, images)
    assert relative_error(served, reference) <= TOLERANCE[expected]
    assert (served.argmax(1) == reference.argmax(1)).all()


def test_openvino_batch_refuses_a_bad_request_alone_when_served_over_grpc(auto_repo, start_server, small_model):
    server = start_server(auto_repo)
    rng = np.random.default_rng(6)
    good = [rng.standard_normal((1, 3, 224, 224)).astype(np.float32) for _ in range(5)]
    bad = np.zeros((1, 3, 100, 100), np.float32)

    def send(images):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        tensor = grpcclient.InferInput("IMAGE", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        try:
            return client.infer(SMALL, [tensor]).as_numpy("LOGITS")
        except Exception as exc:  # noqa: BLE001 - the refusal is what we check
            return str(exc)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(send, [*good[:3], bad, *good[3:]]))
    assert "unexpected shape" in answers[3] or "must have shape" in answers[3]
    for images, answer in zip(good, answers[:3] + answers[4:]):
        assert not isinstance(answer, str), answer
        assert relative_error(answer, reference_logits(small_model, images)) <= BF16_TOLERANCE


def test_openvino_image_path_answers_the_cat_photo_when_served(auto_repo, start_server, small_model):
    server = start_server(auto_repo)
    blob = np.array([[CAT.read_bytes()]], dtype=object)
    tensor = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(blob)
    client = httpclient.InferenceServerClient(server.http_url)
    served = client.infer(f"{SMALL}_image", [tensor]).as_numpy("LOGITS")
    assert served.shape == (1, 1000) and np.isfinite(served).all()
    assert client.is_server_ready()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_openvino_runs_or_refuses_a_precision_by_what_the_cpu_has_when_loaded(repository, precision):
    model = repository / SMALL / "1" / "model.onnx"
    if precision == "bf16" and not _cpu_has_bf16():
        with pytest.raises(ValueError, match="needs a CPU with AMX or AVX512-BF16"):
            OpenVino(model, precision="bf16")
        return
    engine = OpenVino(model, precision=precision)
    assert engine.precision == precision


def test_openvino_refuses_a_precision_it_does_not_run_when_asked():
    with pytest.raises(ValueError, match="not one OpenVINO runs here"):
        OpenVino(Path("unused.onnx"), precision="fp16")


def test_cpu_threads_share_the_cores_among_instances_when_not_given(monkeypatch):
    from backends import engines

    monkeypatch.setattr(engines, "default_threads", lambda: 2)
    assert [engines.cpu_threads(0, n) for n in (1, 2, 4)] == [2, 1, 1]
    assert engines.cpu_threads(3, 4) == 3  # asked for: honoured
    from backends.classifier import cpu_instances

    groups = {"instance_group": [{"kind": "KIND_CPU", "count": 1}] * 4}
    assert cpu_instances(groups) == 4 and cpu_instances({}) == 1


def test_served_instances_times_threads_stay_within_the_cores_when_an_archive_asks_for_many(tmp_path,
                                                                                              start_server):
    """4 instances on this machine (a .mar's minWorkers: 4): each runs cores // 4 threads, at least one."""
    from backends.engines import default_threads

    build(tmp_path / "repo", "--instances", "4", "--max-batch-size", "8")
    server = start_server(tmp_path / "repo")
    labels = _metric_labels(server)
    assert labels["threads"] == str(max(1, default_threads() // 4)), labels
