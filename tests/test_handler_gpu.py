"""A TorchServe handler on a GPU instance: its device is the instance's GPU, as TorchServe's gpu_id makes it.

Runs where a CUDA GPU is (perf.gpu.checks runs it in the GPU round); skipped elsewhere, saying why.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from builder import cli as build_repo

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA GPU here: the handler's GPU instance is checked where one is lent")

# TorchServe's BaseHandler picks cuda:gpu_id from the context; this handler says what it got and where it ran.
DEVICE_HANDLER = '''
import torch
from ts.torch_handler.base_handler import BaseHandler


class Device(BaseHandler):
    def initialize(self, context):
        gpu = context.system_properties.get("gpu_id")
        self.gpu_id = gpu
        self.device = torch.device(f"cuda:{gpu}" if torch.cuda.is_available() and gpu is not None else "cpu")
        self.model = torch.nn.Linear(4, 2).to(self.device).eval()
        self.initialized = True

    def handle(self, data, context):
        with torch.inference_mode():
            out = self.model(torch.ones(len(data), 4, device=self.device))
        return [{"device": str(out.device), "gpu_id": self.gpu_id} for _ in data]
'''


def test_handler_runs_on_the_instance_gpu_when_the_instance_kind_is_gpu(tmp_path, start_server):
    pytest.importorskip("ts", reason="torchserve (its ts package) is not installed here: the GPU round carries it")
    from examples.migrate_torchserve import ARCHIVER

    if not ARCHIVER.exists():
        pytest.skip("torch-model-archiver is not installed here: the GPU round carries it")
    from test_handler import _archive

    archive = _archive(tmp_path, "device", DEVICE_HANDLER)
    repo = tmp_path / "repo"
    assert build_repo.main(["--from-mar", str(archive), "--output", str(repo), "--kind", "gpu",
                            "--trust-model-code"]) == 0
    server = start_server(repo)
    client = httpclient.InferenceServerClient(server.http_url)
    data = httpclient.InferInput("BODY", [1, 1], "BYTES")
    data.set_data_from_numpy(np.array([[b"{}"]], dtype=np.object_))
    answer = json.loads(client.infer("device", [data]).as_numpy("RESPONSE")[0][0])
    assert answer == {"device": "cuda:0", "gpu_id": 0}
