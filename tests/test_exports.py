"""ONNX and TorchScript exports: valid, named, batch-dynamic, equal to eager; each engine served equal."""
import json
import shutil

import numpy as np
import onnx
import pytest
import tritonclient.http as httpclient

from builder import cli as build_repo
from builder import export
from common.modelconfig import read_config
from support import SMALL, build, reference_logits, relative_error


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    repo = tmp_path_factory.mktemp("exports") / "T"
    argv = ["--model", SMALL, "--weights", "random", "--output", str(repo), "--max-batch-size", "8",
            "--max-queue-delay-us", "2000", "--kind", "cpu", "--formats", "python,onnx,torchscript", "--verify",
            "--precision", "fp32"]  # served rows are compared with eager torch within 1e-4
    assert build_repo.main(argv) == 0
    return repo


def test_build_repo_writes_native_configs_when_formats_include_onnx_and_torchscript(exported):
    onnx_config = read_config(exported / f"{SMALL}_onnx")
    ts_config = read_config(exported / f"{SMALL}_torchscript")
    assert onnx_config.platform == "onnxruntime_onnx" and ts_config.platform == "pytorch_libtorch"
    for config in (onnx_config, ts_config):
        assert config.max_batch_size == 8 and config.dynamic_batching.max_queue_delay_microseconds == 2000
        assert [t.name for t in config.input] == ["IMAGE"]
    assert [t.name for t in onnx_config.output] == ["LOGITS"]
    assert [t.name for t in ts_config.output] == ["LOGITS__0"]  # LibTorch binds outputs as <name>__<index>
    assert read_config(exported / f"{SMALL}_image").platform == "ensemble"
    assert (exported / f"{SMALL}_torchscript" / "1" / "model.pt").is_file()


def test_onnx_export_passes_checker_with_named_dynamic_batch_when_built(exported):
    path = exported / f"{SMALL}_onnx" / "1" / "model.onnx"
    onnx.checker.check_model(str(path), full_check=True)
    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["IMAGE"] and [o.name for o in graph.output] == ["LOGITS"]
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"


@pytest.mark.parametrize("batch", [1, 5])
def test_exports_match_eager_within_1e4_when_run_in_process(exported, small_model, batch):
    images = np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)).astype(np.float32)
    expected = reference_logits(small_model, images)
    assert relative_error(export.run_onnx(exported / f"{SMALL}_onnx/1/model.onnx", images), expected) <= 1e-4
    assert relative_error(export.run_torchscript(exported / f"{SMALL}_torchscript/1/model.pt", images),
                          expected) <= 1e-4


def test_build_repo_prints_error_table_when_verifying(tmp_path, capsys):
    build(tmp_path, "--formats", "python,onnx", "--verify")
    out = capsys.readouterr().out
    assert "max rel. error vs eager" in out and "onnx" in out and "FAIL" not in out
    assert "openvino fp32" in out  # the engine and precision that will serve, as they will run


def test_verify_judges_the_serving_precision_by_its_own_tolerance_when_it_is_bf16(tmp_path, monkeypatch, capsys):
    """--verify runs what will serve: openvino bf16 gets bf16's tolerance, and fails beyond it."""
    real = export.run_openvino
    monkeypatch.setattr(export, "run_openvino", lambda path, batch, precision="auto":
                        real(path, batch, "fp32") * (1.05 if precision == "bf16" else 1.0))
    status = build_repo.main(["--model", SMALL, "--weights", "random", "--output", str(tmp_path / "T"),
                              "--kind", "cpu", "--precision", "bf16", "--verify"])
    captured = capsys.readouterr()
    assert status == 1 and "openvino bf16" in captured.out and "FAIL (> 0.03)" in captured.out, captured
    assert "openvino bf16" in captured.err and not any((tmp_path / "T").iterdir())


def test_build_repo_fails_and_writes_nothing_when_an_export_differs(tmp_path, monkeypatch, capsys):
    real = export.run_onnx
    monkeypatch.setattr(export, "run_onnx", lambda path, batch: real(path, batch) * 1.01)
    status = build_repo.main(["--model", SMALL, "--weights", "random", "--output", str(tmp_path / "T"),
                              "--kind", "cpu", "--formats", "python,onnx", "--verify"])
    captured = capsys.readouterr()
    assert status == 1 and "FAIL" in captured.out and "differ from eager" in captured.err
    assert not any((tmp_path / "T").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["T"]


def test_each_engine_serves_eager_logits_when_selected_by_config_parameter(exported, small_model, tmp_path, start_server):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(exported / SMALL, repo / SMALL)
    # The classifier's version folder gets every engine's artifact; the `engine` parameter picks one.
    shutil.copyfile(exported / f"{SMALL}_torchscript/1/model.pt", repo / SMALL / "1" / "model.pt")
    images = np.random.default_rng(3).standard_normal((3, 3, 224, 224)).astype(np.float32)
    expected = reference_logits(small_model, images)
    server = start_server(repo, model_control="explicit")
    client = httpclient.InferenceServerClient(server.http_url)
    base = client.get_model_config(SMALL)
    for engine in ("torch", "torchscript", "onnxruntime", "openvino"):  # fp32 (support.build)
        config = dict(base, parameters={**base["parameters"], "engine": {"string_value": engine}})
        client.load_model(SMALL, config=json.dumps(config))
        served_engine = client.get_model_config(SMALL)["parameters"]["engine"]["string_value"]
        assert served_engine == engine
        tensor = httpclient.InferInput("IMAGE", list(images.shape), "FP32")
        tensor.set_data_from_numpy(images)
        served = client.infer(SMALL, [tensor]).as_numpy("LOGITS")
        assert relative_error(served, expected) <= 1e-4, f"engine {engine}"
