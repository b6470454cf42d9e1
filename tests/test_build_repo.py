"""build-repo writes a loadable repository layout, refuses to clobber, and fails cleanly."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from tritonclient.grpc import model_config_pb2 as mc

from builder import cli as build_repo
from common.modelconfig import read_config
from support import SMALL, build, reference_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("built") / "T"
    build(repo, "--max-batch-size", "8", "--max-queue-delay-us", "2000")
    return repo


def test_build_repo_writes_config_with_requested_batching_when_given_issue_arguments(built):
    config = read_config(built / SMALL / "config.pbtxt")
    assert config.name == SMALL and config.backend == "python"
    assert config.max_batch_size == 8
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    # One required input (--input-dtype fp32 by default): what perf_analyzer and KServe-v2 clients read.
    assert [(t.name, t.data_type, list(t.dims), t.optional) for t in config.input] == [
        ("IMAGE", mc.TYPE_FP32, [3, 224, 224], False)]
    assert config.parameters["precision"].string_value == "fp32"
    ensemble = read_config(built / f"{SMALL}_image")
    assert [t.name for t in ensemble.input] == ["IMAGE_BYTES"] and not ensemble.input[0].optional
    assert dict(ensemble.ensemble_scheduling.step[1].input_map) == {"IMAGE": "image"}
    assert [t.name for t in config.output] == ["LOGITS"] and list(config.output[0].dims) == [1000]
    assert config.output[0].label_filename == "labels.txt"
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU
    assert config.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"


def test_build_repo_writes_backend_weights_and_labels_when_building(built):
    model_dir = built / SMALL
    assert (model_dir / "1" / "model.py").read_text() == (ROOT / "backends" / "classifier.py").read_text()
    labels = (model_dir / "labels.txt").read_text().splitlines()
    assert labels == torchvision.models.ResNet18_Weights.DEFAULT.meta["categories"]
    state = torch.load(model_dir / "1" / "weights.pt", weights_only=True)
    expected = reference_model().state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    # The classifier, its preprocess model and the image ensemble; nothing else in or beside the repository.
    assert sorted(p.name for p in built.iterdir()) == [SMALL, f"{SMALL}_image", f"{SMALL}_preprocess"]
    assert (model_dir / "1" / "model.onnx").is_file()  # engine auto on CPU: openvino, over the ONNX export
    assert sorted(p.name for p in built.parent.iterdir()) == ["T"]


def test_build_repo_refuses_with_one_line_when_model_exists_without_force(built, capsys):
    before = (built / SMALL / "1" / "weights.pt").stat().st_mtime_ns
    assert build_repo.main(["--model", SMALL, "--weights", "random", "--output", str(built)]) == 1
    err = capsys.readouterr().err.strip()
    assert "already exists" in err and "--force" in err and len(err.splitlines()) == 1
    assert (built / SMALL / "1" / "weights.pt").stat().st_mtime_ns == before


def test_build_repo_replaces_model_when_forced(tmp_path):
    build(tmp_path, "--max-batch-size", "8")
    build(tmp_path, "--max-batch-size", "4", "--force")
    assert read_config(tmp_path / SMALL).max_batch_size == 4
    assert read_config(tmp_path / f"{SMALL}_image").max_batch_size == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == [SMALL, f"{SMALL}_image", f"{SMALL}_preprocess"]


def test_build_repo_keeps_previous_repository_when_forced_build_fails(tmp_path, capsys):
    build(tmp_path / "repo", "--max-batch-size", "8")
    before = (tmp_path / "repo" / SMALL / "config.pbtxt").read_text()
    torch.save({"not": torch.zeros(1)}, tmp_path / "wrong.pt")  # a state_dict for some other model
    status = build_repo.main(["--model", SMALL, "--weights", str(tmp_path / "wrong.pt"),
                              "--output", str(tmp_path / "repo"), "--force", "--max-batch-size", "2"])
    assert status == 1
    assert "do not fit resnet18" in capsys.readouterr().err
    assert (tmp_path / "repo" / SMALL / "config.pbtxt").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "wrong.pt"]


def test_build_repo_loads_state_dict_when_weights_is_a_path(tmp_path):
    other = reference_model(seed=7).state_dict()
    torch.save(other, tmp_path / "mine.pt")
    assert build_repo.main(["--model", SMALL, "--weights", str(tmp_path / "mine.pt"),
                            "--output", str(tmp_path / "repo"), "--kind", "cpu"]) == 0
    served = torch.load(tmp_path / "repo" / SMALL / "1" / "weights.pt", weights_only=True)
    assert torch.equal(served["fc.weight"], other["fc.weight"])


def test_build_repo_accepts_torchserve_names_when_given_batch_size_and_delay_ms(tmp_path):
    build(tmp_path, "--batch-size", "4", "--max-batch-delay-ms", "50", "--preferred-batch-size", "2", "4")
    config = read_config(tmp_path / SMALL)
    assert config.max_batch_size == 4
    assert config.dynamic_batching.max_queue_delay_microseconds == 50_000
    assert list(config.dynamic_batching.preferred_batch_size) == [2, 4]


def test_build_repo_disables_batching_when_max_batch_size_is_zero(tmp_path):
    build(tmp_path, "--max-batch-size", "0")
    config = read_config(tmp_path / SMALL)
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "not_a_model"], "unknown torchvision classification model"),
        (["--max-batch-size", "-1"], "must be >= 0"),
        (["--max-batch-size", "8", "--preferred-batch-size", "16"], "`preferred_batch_size` 16"),
        (["--kind", "tpu"], "invalid choice"),
        (["--weights", "/no/such/file.pt"], "neither one of"),
        (["--max-queue-delay-us", "10", "--max-batch-delay-ms", "5"], "not allowed with"),
        (["--instances", "0"], "must be >= 1"),
    ],
)
def test_build_repo_exits_2_with_one_line_when_arguments_are_bad(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "builder.cli", "--output", str(tmp_path / "r"), *args],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "r").exists()


def test_every_parameter_a_build_writes_is_documented_in_the_contract_when_built(built, tmp_path):
    from common.contract import PARAMETERS

    build(tmp_path / "fused", "--image-model", "fused", "--formats", "python,onnx")
    written = {key for repo in (built, tmp_path / "fused") for path in repo.glob("*/config.pbtxt")
               for key in read_config(path).parameters}
    assert written and not written - set(PARAMETERS), sorted(written - set(PARAMETERS))


def test_build_repo_json_prints_one_object_naming_each_model_and_its_role_when_asked(tmp_path):
    from common.build_result import BuildResult

    command = [sys.executable, "-m", "builder.cli", "--model", SMALL, "--weights", "random", "--kind", "cpu",
               "--output", str(tmp_path / "r"), "--formats", "python,onnx", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1 and "wrote" in done.stderr  # stdout: the JSON alone
    result = BuildResult.from_json(done.stdout)
    assert result.repository == str((tmp_path / "r").resolve()) and not result.handler
    assert sorted((m.name, m.role) for m in result.models) == [
        (SMALL, "classifier"), (f"{SMALL}_image", "image"), (f"{SMALL}_onnx", "export"),
        (f"{SMALL}_preprocess", "preprocess")]
    assert result.load_order()[-1] == f"{SMALL}_image"
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)  # exists, no --force
    assert again.returncode == 1 and "already exists" in BuildResult.from_json(again.stdout).error
    bad = subprocess.run([*command, "--instances", "0"], capture_output=True, text=True, cwd=ROOT)
    assert (bad.returncode, BuildResult.from_json(bad.stdout).status) == (2, 2)
    assert "must be >= 1" in BuildResult.from_json(bad.stdout).error and "must be >= 1" in bad.stderr
