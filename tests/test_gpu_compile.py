"""perf.gpu.compile, the in-process script for a GPU session, smoke-run on CPU: folding keeps the logits."""
import json

import pytest
import torch

from perf.gpu import compile as gpu_compile


def test_gpu_compile_measures_eager_and_folded_and_keeps_the_logits_when_run_on_cpu(tmp_path):
    out = tmp_path / "compile.json"
    status = gpu_compile.main(["--device", "cpu", "--model", "resnet18", "--precisions", "fp32", "--batches", "2",
                               "--seconds", "0.2", "--output", str(out)])
    assert status == 0
    points = json.loads(out.read_text())["points"]
    assert [p["variant"] for p in points] == ["eager", "folded"]  # graph and compile need a GPU
    for point in points:
        assert "error" not in point and point["images_per_s"] > 0
        assert point["max_rel_diff_vs_eager_fp32"] < 1e-4  # BN folded into the conv is the same function


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_compile_refuses_cuda_when_there_is_none(tmp_path, capsys):
    assert gpu_compile.main(["--output", str(tmp_path / "x.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
