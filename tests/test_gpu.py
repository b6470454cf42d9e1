"""The GPU path on a real GPU: staging, precisions, CUDA graphs per bucket, served through tritonserver.

Skipped where torch sees no CUDA device (CI has none). gRPC client: the GPU machine has no
geventhttpclient for tritonclient.http.
"""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2 as mc

from backends.batch_runner import PRECISIONS, BatchRunner
from common.modelconfig import read_config
from server.triton import TritonServer
from perf.stats import counters
from support import SMALL, build, reference_logits, reference_model, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the GPU path needs one (CI has none)")
# fp32 convolutions run on TF32 tensor cores (torch's default); fp16/bf16 keep ~3/2 significant digits.
TOLERANCE = {"fp32": 1e-2, "fp16": 2e-2, "bf16": 8e-2}


def _infer(url: str, model: str, images: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("IMAGE", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    return client.infer(model, [tensor]).as_numpy("LOGITS")


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_gpu_runner_graph_rows_equal_eager_when_batch_pads_to_a_bucket(precision):
    device = torch.device("cuda", 0)
    model = reference_model(SMALL).to(device, memory_format=torch.channels_last)
    model = model.to(PRECISIONS[precision])
    runner = BatchRunner(model, device, (3, 224, 224), precision, cuda_graphs=True, buckets=[1, 2, 4, 8])
    runner.warm_up()
    images = torch.from_numpy(np.random.default_rng(1).standard_normal((5, 3, 224, 224)).astype(np.float32))
    # Mixed: two requests in CPU memory, one already on the GPU (as from the ensemble's preprocess).
    parts = [images[:2], images[2:3].to(device), images[3:]]
    graphed = runner.run(parts)
    eager = BatchRunner(model, device, (3, 224, 224), precision, cuda_graphs=False, buckets=[5])
    eager.warm_up()
    unpadded = eager.run([images])
    assert graphed.device.type == "cpu" and graphed.dtype == torch.float32 and graphed.shape == (5, 1000)
    assert runner.cuda_graphs and set(runner._graphs) == {1, 2, 4, 8}
    # Padding rows do not leak into real rows: graphed (padded to 8) equals eager (batch of 5).
    assert relative_error(graphed.numpy(), unpadded.numpy()) <= 1e-3
    reference = reference_logits(reference_model(SMALL), images.numpy())
    assert relative_error(graphed.numpy(), reference) <= TOLERANCE[precision]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_gpu_server_returns_each_request_its_rows_when_batches_pad(tmp_path, small_model, precision, start_server):
    repo = tmp_path / "repo"
    build(repo, "--kind", "gpu", "--max-batch-size", "16", "--precision", precision)  # the later --kind wins
    config = read_config(repo / SMALL)
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert config.parameters["cuda_graphs"].string_value == "1"
    rng = np.random.default_rng(0)
    requests = [rng.standard_normal((n, 3, 224, 224)).astype(np.float32) for n in (1, 3, 2, 5, 1, 4, 7, 1)]
    server = start_server(repo)
    with ThreadPoolExecutor(len(requests)) as pool:
        served = list(pool.map(lambda x: _infer(server.grpc_url, SMALL, x), requests))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    stats = counters(client, SMALL)
    assert client.is_server_ready()
    for images, logits in zip(requests, served):
        assert logits.shape == (images.shape[0], 1000)
        assert relative_error(logits, reference_logits(small_model, images)) <= TOLERANCE[precision]
    assert stats.inferences == sum(len(r) for r in requests)


def test_gpu_onnxruntime_engine_loads_only_with_a_real_cuda_provider(tmp_path, small_model):
    import onnxruntime

    repo = tmp_path / "repo"
    build(repo, "--kind", "gpu", "--engine", "onnxruntime", "--max-batch-size", "8")
    server = TritonServer.local(repo)
    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        # The CPU wheel must not quietly serve a GPU config from a CPU session.
        with pytest.raises(Exception, match="CUDA execution provider"):
            server.start()
        server.stop()
        return
    images = np.random.default_rng(0).standard_normal((4, 3, 224, 224)).astype(np.float32)
    with server:
        served = _infer(server.grpc_url, SMALL, images)
    assert relative_error(served, reference_logits(small_model, images)) <= TOLERANCE["fp32"]


@pytest.mark.parametrize("image_model, decode", [
    ("fused", "gpu"),  # the GPU default: nvJPEG and the forward in one stub, no GPU tensor between processes
    ("ensemble", "cpu"),
    # The GPU preprocess stub died on its first request on the H100 of 2026-11-22 and on 2026-11-26: NumPy 2 in
    # the stubs' Python (server.stub_python). With NumPy 1.x there it passed on an H100 (2026-11-27).
    ("ensemble", "gpu"),
])
def test_gpu_image_model_isolates_bad_bytes_when_served(tmp_path, small_model, image_model, decode, start_server):
    import torchvision

    from common.decoding import decode as pil_decode
    from images import CAT, bad_images, good_images

    repo = tmp_path / "repo"
    build(repo, "--kind", "gpu", "--max-batch-size", "8", "--image-model", image_model, "--decode-device", decode)
    if image_model == "ensemble":  # the fused model has no preprocess step
        kind = mc.ModelInstanceGroup.KIND_GPU if decode == "gpu" else mc.ModelInstanceGroup.KIND_CPU
        assert read_config(repo / f"{SMALL}_preprocess").instance_group[0].kind == kind
    blobs = {"jpeg": CAT.read_bytes(), "webp": good_images()["webp"], "truncated": bad_images()["truncated-jpeg"][0]}

    def send(url, data):
        client = grpcclient.InferenceServerClient(url)
        tensor = grpcclient.InferInput("IMAGE_BYTES", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[data]], dtype=object))
        return client.infer(f"{SMALL}_image", [tensor]).as_numpy("LOGITS")[0]

    server = start_server(repo)
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(send, server.grpc_url, data) for name, data in blobs.items()}
        with pytest.raises(Exception, match="truncated or corrupt"):
            futures["truncated"].result()
        served = {name: futures[name].result() for name in ("jpeg", "webp")}
    assert grpcclient.InferenceServerClient(server.grpc_url).is_server_ready()
    weights_transform = torchvision.models.ResNet18_Weights.DEFAULT.transforms()
    for name in ("jpeg", "webp"):  # with decode gpu: webp takes the PIL path, jpeg nvJPEG
        expected = reference_logits(small_model, weights_transform(pil_decode(blobs[name])).unsqueeze(0).numpy())[0]
        assert int(np.argmax(served[name])) == int(np.argmax(expected))
        assert relative_error(served[name], expected) <= 5e-2  # TF32 + nvJPEG's IDCT vs libjpeg-turbo


def test_runner_reads_gpu_inputs_only_after_their_producer_stream_wrote_them():
    """The fused model stacks its decoded images on the current stream; the runner computes on its own. A
    producer held back (torch.cuda._sleep) then filling the input must be waited for, not raced."""
    device = torch.device("cuda", 0)
    runner = BatchRunner(torch.nn.Flatten(), device, (3, 4, 4), buckets=[1, 2, 4])
    for _ in range(5):
        part = torch.zeros((2, 3, 4, 4), device=device)
        torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time on the current stream before the fill
        part.fill_(7.0)
        rows = runner.run([part])
        assert torch.equal(rows, torch.full((2, 48), 7.0)), "the runner read the input before it was written"
