"""GPU options decided on any machine: build-repo's GPU defaults and checks, serve-repo's GPU flags, buckets."""
from pathlib import Path

import pytest
import torch
from tritonclient.grpc import model_config_pb2 as mc

from backends.batch_runner import BatchRunner, _rows
from common.contract import buckets_for, parse_buckets
from builder import cli as build_repo
from builder.config import ConfigError
from builder.plan import make_plan
from common import precision as precisions
from common.modelconfig import read_config
from server.repo import GPU_FLAGS, uses_gpu
from server.triton import TritonServer
from support import SMALL, build


def plan_of(args):
    return make_plan(build_repo.parser().parse_args(["--model", SMALL, "--weights", "random", "--output", "x", *args]))


def test_buckets_cover_every_batch_when_max_is_not_a_power_of_two():
    assert buckets_for(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_for(24) == [1, 2, 4, 8, 16, 24]
    assert parse_buckets("8,1,4", 12) == [1, 4, 8, 12]
    with pytest.raises(ValueError, match="positive"):
        parse_buckets("0,4", 8)


def test_rows_split_parts_when_a_batch_exceeds_the_largest_bucket():
    parts = [torch.arange(3), torch.arange(3, 8), torch.arange(8, 10)]
    chunks = [_rows(parts, start, 4) for start in (0, 4, 8)]
    assert [torch.cat(c).tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_runner_refuses_half_precision_when_instance_is_cpu():
    with pytest.raises(ValueError, match="needs --kind gpu"):
        BatchRunner(torch.nn.Identity(), torch.device("cpu"), (3, 4, 4), "fp16")


def test_runner_cpu_rows_equal_the_model_when_parts_are_concatenated():
    model = torch.nn.Conv2d(3, 2, 1).eval()
    runner = BatchRunner(model, torch.device("cpu"), (3, 4, 4))
    parts = [torch.randn(2, 3, 4, 4), torch.randn(1, 3, 4, 4)]
    with torch.inference_mode():
        expected = model(torch.cat(parts))
    assert torch.allclose(runner.run(parts), expected, atol=1e-6)


def test_build_repo_writes_gpu_defaults_when_kind_is_gpu(tmp_path):
    build(tmp_path, "--kind", "gpu")  # writing a GPU config needs no GPU
    config = read_config(tmp_path / SMALL)
    assert config.max_batch_size == 64
    assert list(config.dynamic_batching.preferred_batch_size) == [1, 2, 4, 8, 16, 32, 64]
    assert config.dynamic_batching.max_queue_delay_microseconds == 200
    # 4 instances: build-repo's GPU default since the H100 figures of 2026-11-27
    assert [(g.kind, g.count) for g in config.instance_group] == [(mc.ModelInstanceGroup.KIND_GPU, 1)] * 4
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["engine"] == "torch" and params["cuda_graphs"] == "1" and params["precision"] == "fp32"
    assert params["batch_buckets"] == "1,2,4,8,16,32,64"
    assert (tmp_path / SMALL / "1" / "batch_runner.py").is_file()
    # The GPU default image model is fused (nvJPEG in the classifier's stub): no preprocess model to serve.
    assert not (tmp_path / f"{SMALL}_preprocess").exists()
    assert read_config(tmp_path / f"{SMALL}_image").parameters["decode_device"].string_value == "gpu"
    assert uses_gpu(tmp_path)


def test_build_repo_puts_preprocess_on_gpu_when_the_ensemble_decodes_on_gpu(tmp_path):
    build(tmp_path, "--kind", "gpu", "--image-model", "ensemble", "--decode-device", "gpu")
    pre = read_config(tmp_path / f"{SMALL}_preprocess")
    assert pre.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    assert pre.parameters["decode_device"].string_value == "gpu"


def test_build_repo_keeps_cpu_defaults_when_kind_is_cpu(tmp_path):
    build(tmp_path)
    config = read_config(tmp_path / SMALL)
    assert (config.max_batch_size, config.instance_group[0].count) == (8, 1)
    assert config.parameters["cuda_graphs"].string_value == "0"
    assert not uses_gpu(tmp_path)


@pytest.mark.parametrize("args, message", [
    (["--kind", "cpu", "--engine", "torch", "--precision", "fp16"], "needs --kind gpu"),
    (["--kind", "cpu", "--engine", "onnxruntime", "--precision", "bf16"], "needs --engine torch"),
    (["--kind", "cpu", "--precision", "fp16"], "not one OpenVINO runs"),
    (["--kind", "gpu", "--engine", "openvino"], "runs on CPU instances"),
    (["--kind", "cpu", "--engine", "onnxruntime", "--precision", "auto"], "needs --engine openvino"),
    (["--kind", "gpu", "--engine", "onnxruntime", "--precision", "bf16"], "needs --engine torch"),
    (["--kind", "gpu", "--engine", "onnxruntime", "--cuda-graphs"], "--cuda-graphs needs"),
    (["--kind", "gpu", "--max-batch-size", "16", "--batch-buckets", "32"], "exceeds"),
    (["--kind", "cpu", "--decode-device", "gpu"], "needs --kind gpu"),
])
def test_build_repo_refuses_gpu_options_when_they_cannot_work(tmp_path, capsys, args, message):
    assert build_repo.main(["--model", SMALL, "--weights", "random", "--output", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_serve_repo_adds_gpu_flags_unless_passed_through_when_repository_has_gpu_models(tmp_path):
    build(tmp_path / "repo", "--kind", "gpu")
    mine = "--cuda-memory-pool-byte-size=0:1073741824"
    server = TritonServer(tmp_path / "repo", 1, 2, 3, extra_args=[mine, "--log-verbose=1"])
    server._workdir = tmp_path / "work"
    command = server.command()
    assert command[-2:] == [mine, "--log-verbose=1"]
    assert GPU_FLAGS[0] not in command and all(flag in command for flag in GPU_FLAGS[1:])


def test_serve_repo_gives_every_gpu_a_memory_pool_when_there_are_several(tmp_path):
    from server.repo import gpu_flags

    build(tmp_path / "repo", "--kind", "gpu", "--formats", "python")
    pools = [flag for flag in gpu_flags(tmp_path / "repo", [], gpus=3) if flag.startswith("--cuda-memory-pool")]
    assert pools == [f"--cuda-memory-pool-byte-size={i}:536870912" for i in range(3)]
    assert not [f for f in gpu_flags(tmp_path / "repo", ["--cuda-memory-pool-byte-size=1:1"], gpus=3)
                if f.startswith("--cuda-memory-pool")]  # the user's own pool flags replace ours
    small = "--backend-config=python,shm-default-byte-size=1048576"
    kept = gpu_flags(tmp_path / "repo", [small], gpus=1)  # a backend setting replaces ours for its key alone
    assert not [f for f in kept if "shm-default-byte-size" in f]
    assert "--backend-config=python,shm-growth-byte-size=67108864" in kept


@pytest.mark.parametrize("engine", sorted(precisions.RUNS))
@pytest.mark.parametrize("kind", ["cpu", "gpu"])
@pytest.mark.parametrize("precision", precisions.CHOICES)
def test_precision_rule_agrees_between_build_and_load_when_any_engine_kind_and_precision(engine, kind, precision):
    # One table decides: build-repo refuses exactly what the backend would refuse at load, and says the same.
    args = ["--kind", kind, "--engine", engine, "--precision", precision]
    if precision == "int8":
        args += ["--calibration", str(Path(__file__).parent)]
    try:
        precisions.check(precision, engine, kind)
        expected = None
    except precisions.PrecisionError as exc:
        expected = str(exc)
    try:
        plan_of(args)
        built = None
    except ConfigError as exc:
        built = str(exc)
    assert built == expected
    assert (expected is None) == (precision in precisions.RUNS[engine][kind])


def test_stub_library_path_puts_a_libcuda_link_first_only_where_the_driver_lacks_the_unversioned_name(
        tmp_path, monkeypatch):
    """python_backend r24.10 dlopens "libcuda.so" unchecked for a GPU output tensor; serve-repo gives the stubs a
    link to the driver's libcuda.so.1 where only that name exists (server/libcuda.py)."""
    from server import libcuda

    driver = tmp_path / "libcuda.so.580"
    driver.write_bytes(b"")

    def link(folder):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "libcuda.so").symlink_to(driver)
        return folder

    monkeypatch.setattr(libcuda, "_loads", lambda name: False)  # a driver with libcuda.so.1 only
    monkeypatch.setattr(libcuda, "unversioned_link_dir", link)
    path = libcuda.stub_library_path(tmp_path / "link", "/usr/local/nvidia/lib64")
    assert path == f"{tmp_path / 'link'}:/usr/local/nvidia/lib64"
    assert (tmp_path / "link" / "libcuda.so").resolve() == driver
    monkeypatch.setattr(libcuda, "_loads", lambda name: True)  # the driver has the unversioned name
    assert libcuda.stub_library_path(tmp_path / "other", "") is None and not (tmp_path / "other").exists()


def test_stub_library_path_is_none_when_there_is_no_driver(tmp_path):
    from server import libcuda

    if libcuda._loads("libcuda.so.1"):
        pytest.skip("a CUDA driver is here: the no-driver case is CI's")
    assert libcuda.stub_library_path(tmp_path / "link", "") is None
