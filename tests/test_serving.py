"""A real tritonserver serves build-repo's models: parity, real batching, isolation of bad requests."""
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from perf.stats import counters
from support import SMALL, reference_logits, relative_error

RNG = np.random.default_rng(0)


def _images(n: int, side: int = 224) -> np.ndarray:
    # Normalized-looking inputs, as the weights' transforms() would produce.
    return RNG.standard_normal((n, 3, side, side)).astype(np.float32)


def _infer(url: str, images: np.ndarray, model: str = SMALL, dtype: str = "FP32", name: str = "IMAGE"):
    client = httpclient.InferenceServerClient(url)
    tensor = httpclient.InferInput(name, list(images.shape), dtype)
    tensor.set_data_from_numpy(images)
    return client.infer(model, [tensor]).as_numpy("LOGITS")


def _stats(url: str, model: str = SMALL) -> tuple[int, int]:
    now = counters(httpclient.InferenceServerClient(url), model)
    return now.inferences, now.executions


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_logits_equal_in_process_torchvision_when_model_is_random_resnet18(server, small_model, protocol):
    images = _images(4)
    if protocol == "http":
        served = _infer(server.http_url, images)
    else:
        if not server.grpc_url:
            pytest.skip("TRITON_GRPC_URL not set for the external server")
        client = grpcclient.InferenceServerClient(server.grpc_url)
        tensor = grpcclient.InferInput("IMAGE", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        served = client.infer(SMALL, [tensor]).as_numpy("LOGITS")
    assert served.shape == (4, 1000)
    assert relative_error(served, reference_logits(small_model, images)) <= 1e-4


def test_dynamic_batching_forms_batches_when_16_requests_arrive_concurrently(server, small_model):
    images = _images(16)
    inferences_before, executions_before = _stats(server.http_url)
    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(lambda i: _infer(server.http_url, images[i:i + 1]), range(16)))
    # Triton counts a batch in its statistics as it releases the requests, which can be after their responses
    # reached us: on a loaded machine the last batch was once not counted yet (11 of 16). Read until it is.
    deadline = time.monotonic() + 30
    while True:
        inferences, executions = (a - b for a, b in zip(_stats(server.http_url), (inferences_before, executions_before)))
        if inferences >= 16 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert inferences == 16
    assert executions < inferences, f"{executions} executions for {inferences} inferences: no batch formed"
    expected = reference_logits(small_model, images)
    for i, rows in enumerate(served):
        assert rows.shape == (1, 1000)
        assert relative_error(rows, expected[i:i + 1]) <= 1e-4, f"request {i} got another request's rows"


def test_each_request_gets_exactly_its_own_rows_when_requests_carry_several_images(server, small_model):
    sizes = [3, 1, 2, 5]
    batches = [_images(n) for n in sizes]
    with ThreadPoolExecutor(len(sizes)) as pool:
        served = list(pool.map(lambda b: _infer(server.http_url, b), batches))
    for batch, rows in zip(batches, served):
        assert rows.shape == (len(batch), 1000)
        assert relative_error(rows, reference_logits(small_model, batch)) <= 1e-4


@pytest.mark.parametrize(
    ("images", "dtype", "name", "message"),
    [
        (np.zeros((1, 3, 100, 100), np.float32), "FP32", "IMAGE", "unexpected shape"),
        (np.zeros((1, 3, 224, 224), np.float64), "FP64", "IMAGE", "FP64"),
        (np.zeros((1, 3, 224, 224), np.float32), "FP32", "PIXELS", "PIXELS"),
        (np.zeros((9, 3, 224, 224), np.float32), "FP32", "IMAGE", "batch-size must be <= 8"),
    ],
    ids=["small-image", "fp64", "wrong-name", "batch-over-max"],
)
def test_bad_request_gets_error_and_neighbours_succeed_when_sent_concurrently(
        server, small_model, images, dtype, name, message):
    good = _images(6)
    with ThreadPoolExecutor(7) as pool:
        bad = pool.submit(_infer, server.http_url, images, SMALL, dtype, name)
        neighbours = [pool.submit(_infer, server.http_url, good[i:i + 1]) for i in range(6)]
        with pytest.raises(InferenceServerException, match=message):
            bad.result()
        served = np.concatenate([f.result() for f in neighbours])
    assert relative_error(served, reference_logits(small_model, good)) <= 1e-4
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_server_ready() and client.is_model_ready(SMALL)
