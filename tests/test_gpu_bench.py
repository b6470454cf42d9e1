"""perf.gpu.bench, the GPU round's bench, smoke-run on CPU with the fused image model (the GPU default; the round's
dry run, tests/test_gpu_round.py, runs it with the CPU's ensemble) so that a GPU run does not fail on a typo."""
import json

import pytest

from perf.gpu import bench as gpu_bench


@pytest.mark.parametrize("image_model", ["fused"])
def test_gpu_bench_runs_the_tensor_and_jpeg_points_when_smoke_run_on_cpu(tmp_path, image_model):
    out = tmp_path / "gpu.json"
    status = gpu_bench.main(["--kind", "cpu", "--model", "resnet18", "--image-model", image_model, "--plan", "fp32:0",
                             "jpeg", "--concurrency", "2", "--seconds", "1", "--processes", "1", "--instances", "1",
                             "--output", str(out)])
    assert status == 0
    result = json.loads(out.read_text())
    assert result["jpeg_model"] == image_model and result["instances"] == 1
    assert [p["decode"] for p in result["jpeg"]] == ["gpu", "cpu"]
    for point in result["tensor"][0]["points"] + result["jpeg"]:
        assert point["requests"] > 0 and point["errors"] == 0
        assert point["avg_batch"] >= 1  # Triton's statistics of the model that ran the batches
