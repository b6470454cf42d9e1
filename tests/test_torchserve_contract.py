"""Issue 44 items 5 and 6: the TorchServe front writes what build-repo writes and reads what it says, through
common/'s one contract: instance groups, the Python floor, the handler model's tensors and status, --json."""
from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format

from common.modelconfig import read_config, to_text
from server.torchserve.registry import Registry
from tritonclient.grpc import model_config_pb2 as mc


def _config(path: Path, kind: str, count: int) -> Path:
    config = mc.ModelConfig(name="m", backend="python", max_batch_size=8)
    json_format.ParseDict({"kind": kind, "count": count}, config.instance_group.add())
    path.write_text(to_text(config))
    return path


def _groups(path: Path) -> list[dict]:
    return [json_format.MessageToDict(g, preserving_proto_field_name=True) for g in read_config(path).instance_group]


def test_registered_and_scaled_models_get_n_groups_of_one_of_the_built_kind_as_build_repo_writes(tmp_path: Path):
    source = _config(tmp_path / "built.pbtxt", "KIND_GPU", 1)
    target = tmp_path / "served.pbtxt"
    Registry._write_config(source, target, 3)
    groups = _groups(target)
    assert [(g["kind"], g["count"]) for g in groups] == [("KIND_GPU", 1)] * 3
    assert sorted(g["rate_limiter"]["priority"] for g in groups) == [1, 2, 3]  # each its own signature
    Registry._write_config(target, target, 1)  # scale down, in place
    assert [(g["kind"], g["count"]) for g in _groups(target)] == [("KIND_GPU", 1)]


def test_a_decoder_built_with_more_instances_than_the_workers_is_clamped_to_groups_of_one(tmp_path: Path):
    source = _config(tmp_path / "built.pbtxt", "KIND_CPU", 4)
    target = tmp_path / "served.pbtxt"
    Registry._write_config(source, target, None, at_most=2)
    assert [(g["kind"], g["count"]) for g in _groups(target)] == [("KIND_CPU", 1)] * 2
