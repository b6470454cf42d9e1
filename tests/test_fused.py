"""--image-model fused: NAME_image as one python model (decode + preprocess + classify in one stub), served on
CPU here; the same answers as the ensemble, each bad image refused alone, and the GPU defaults written."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from builder import cli as build_repo
from common.modelconfig import parameters, read_config
from images import CAT, bad_images, good_images
from perf.stats import counters
from server.triton import TritonServer
from support import SMALL, build, relative_error

IMAGE_MODEL = f"{SMALL}_image"


@pytest.fixture(scope="module")
def fused_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fused") / "repo"
    # A 300 ms delay so that concurrent requests surely meet in one batch.
    build(repo, "--image-model", "fused", "--max-batch-size", "8", "--max-queue-delay-us", "300000")
    server = TritonServer.local(repo)
    try:
        yield server.start()
    finally:
        server.stop()


def _logits(module, url: str, blobs: list[bytes], model: str = IMAGE_MODEL) -> np.ndarray:
    client = module.InferenceServerClient(url)
    array = np.array([[b] for b in blobs], dtype=object)
    tensor = module.InferInput("IMAGE_BYTES", list(array.shape), "BYTES")
    tensor.set_data_from_numpy(array)
    return client.infer(model, [tensor]).as_numpy("LOGITS")


def test_fused_model_answers_as_the_ensemble_when_given_the_same_images(fused_server, server):
    blobs = [good_images()[k] for k in ("jpeg", "grayscale-png", "tiny-1x1-png")] + [CAT.read_bytes()]
    expected = _logits(httpclient, server.http_url, blobs)  # the session's ensemble, same weights (seed 0)
    for module, url in ((httpclient, fused_server.http_url), (grpcclient, fused_server.grpc_url)):
        served = _logits(module, url, blobs)
        assert served.shape == (4, 1000)
        assert relative_error(served, expected) < 1e-4
        assert (served.argmax(1) == expected.argmax(1)).all()


@pytest.mark.parametrize("kind", ["truncated-jpeg", "text"])
def test_fused_model_refuses_a_bad_image_alone_when_batched_with_good_ones(fused_server, kind):
    data, phrase = bad_images()[kind]
    good = CAT.read_bytes()
    stats = httpclient.InferenceServerClient(fused_server.http_url)
    before = counters(stats, IMAGE_MODEL)
    with ThreadPoolExecutor(5) as pool:
        neighbours = [pool.submit(_logits, httpclient, fused_server.http_url, [good]) for _ in range(4)]
        bad = pool.submit(_logits, httpclient, fused_server.http_url, [data])
        with pytest.raises(InferenceServerException, match=phrase):
            bad.result()
        answers = [future.result() for future in neighbours]
    after = counters(stats, IMAGE_MODEL) - before
    assert after.executions < 5, "the five requests never met in a batch: the test proves nothing"
    for answer in answers:
        np.testing.assert_allclose(answer, answers[0], rtol=0, atol=1e-5)
    assert stats.is_server_ready() and stats.is_model_ready(IMAGE_MODEL)


def test_fused_model_refuses_a_request_without_image_bytes_when_sent(fused_server):
    client = httpclient.InferenceServerClient(fused_server.http_url)
    tensor = httpclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b""]], dtype=object))
    with pytest.raises(InferenceServerException, match="empty image"):
        client.infer(IMAGE_MODEL, [tensor])


def test_build_repo_writes_a_fused_gpu_image_model_and_a_cpu_ensemble_by_default(tmp_path):
    build(tmp_path / "gpu", "--kind", "gpu", "--formats", "python")
    config = read_config(tmp_path / "gpu" / IMAGE_MODEL)
    assert config.backend == "python" and not config.platform
    assert config.instance_group[0].kind == config.instance_group[0].KIND_GPU
    assert parameters(config)["decode_device"] == "gpu"
    assert (tmp_path / "gpu" / IMAGE_MODEL / "1" / "weights.pt").stat().st_nlink == 2  # linked, not copied
    assert not (tmp_path / "gpu" / f"{SMALL}_preprocess").exists()  # only what serves: nothing routes to it
    build(tmp_path / "cpu", "--formats", "python")
    assert read_config(tmp_path / "cpu" / IMAGE_MODEL).platform == "ensemble"
    assert (tmp_path / "cpu" / f"{SMALL}_preprocess" / "config.pbtxt").is_file()


def test_build_repo_retires_the_preprocess_model_when_rebuilt_fused_with_force(tmp_path):
    repo = tmp_path / "repo"
    build(repo, "--formats", "python,onnx")
    assert (repo / f"{SMALL}_preprocess").is_dir() and (repo / f"{SMALL}_onnx").is_dir()
    assert build_repo.main(["--model", SMALL, "--weights", "random", "--output", str(repo), "--kind", "cpu",
                            "--image-model", "fused"]) == 1  # the earlier build's models need --force
    build(repo, "--image-model", "fused", "--force")
    assert sorted(p.name for p in repo.iterdir()) == [SMALL, IMAGE_MODEL]  # nothing stale left to load
    assert not [p for p in repo.parent.iterdir() if p.name.startswith(".")]  # no staging or retired folder
