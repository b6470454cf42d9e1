"""The GPU path: KIND_GPU instances, inputs arriving on the device over DLPack, torch and ORT-CUDA engines."""
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
from tritonclient.grpc import model_config_pb2 as mc

from builder.config import read_config
from builder.serve import TritonServer, free_port
from conftest import SMALL, build, reference_logits, relative_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device here: the GPU path needs one (CI has none)")


@pytest.mark.parametrize("engine", ["torch", "onnxruntime"])
def test_gpu_instance_serves_eager_logits_when_kind_is_gpu(tmp_path, small_model, engine):
    repo = tmp_path / "repo"
    build(repo, "--max-batch-size", "8", "--engine", engine, "--kind", "gpu")  # the later --kind wins
    assert read_config(repo / SMALL).instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    images = np.random.default_rng(0).standard_normal((4, 3, 224, 224)).astype(np.float32)
    with TritonServer(repo, free_port(), free_port(), free_port()) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        tensor = httpclient.InferInput("IMAGE", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        served = client.infer(SMALL, [tensor]).as_numpy("LOGITS")
    assert relative_error(served, reference_logits(small_model, images)) <= 1e-3  # TF32/cuDNN tolerance
