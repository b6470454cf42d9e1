"""Issue 44 items 5 and 6: the TorchServe front writes what build-repo writes and reads what it says, through
common/'s one contract: instance groups, the Python floor, the handler model's tensors and status, --json."""
from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import json_format

from common.build_request import BuildRequest
from common.build_result import BuildResult, BuiltModel
from common.modelconfig import read_config, to_text
from server.torchserve.archives import ArchiveInfo, build
from server.torchserve.loading import write_config
from server.torchserve.refusals import Refusal
from server.torchserve.registry import Model
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
    write_config(source, target, 3)
    groups = _groups(target)
    assert [(g["kind"], g["count"]) for g in groups] == [("KIND_GPU", 1)] * 3
    assert sorted(g["rate_limiter"]["priority"] for g in groups) == [1, 2, 3]  # each its own signature
    write_config(target, target, 1)  # scale down, in place
    assert [(g["kind"], g["count"]) for g in _groups(target)] == [("KIND_GPU", 1)]


def test_a_decoder_built_with_more_instances_than_the_workers_is_clamped_to_groups_of_one(tmp_path: Path):
    source = _config(tmp_path / "built.pbtxt", "KIND_CPU", 4)
    target = tmp_path / "served.pbtxt"
    write_config(source, target, None, at_most=2)
    assert [(g["kind"], g["count"]) for g in _groups(target)] == [("KIND_CPU", 1)] * 2


def test_build_repo_result_round_trips_through_json_and_refuses_an_unknown_role_when_parsed():
    result = BuildResult("/r", (BuiltModel("m_image", "image"), BuiltModel("m", "classifier"),
                                BuiltModel("m_preprocess", "preprocess")))
    assert BuildResult.from_json(result.to_json()) == result
    assert (result.handler, result.entry(), result.load_order()) == (False, "m_image", ["m", "m_preprocess", "m_image"])
    handled = BuildResult("/r", (BuiltModel("h", "handler"),))
    assert (handled.handler, handled.entry(), handled.load_order()) == (True, "h", ["h"])
    failed = BuildResult.from_json('{"error": "no such file", "status": 2}')
    assert (failed.error, failed.status, failed.models) == ("no such file", 2, ())
    with pytest.raises(ValueError, match="`role` must be one of"):
        BuildResult("/r", (BuiltModel("m", "decoder"),))
    with pytest.raises(ValueError, match="not build-repo's JSON result"):
        BuildResult.from_json("wrote /r/m/config.pbtxt")


def test_the_front_takes_build_repos_error_from_its_json_and_a_model_its_role_from_the_result(tmp_path: Path):
    bogus = tmp_path / "bogus.mar"
    bogus.write_bytes(b"not a zip")
    info = ArchiveInfo(bogus, "bogus.mar", "bogus", "1.0", "", None, "0" * 64)
    logged = []
    with pytest.raises(Refusal) as failed:
        build(info, BuildRequest(name="bogus"), tmp_path / "cache", logged.append)
    assert str(failed.value).startswith("Failed to load model bogus: ") and "bogus.mar" in str(failed.value)
    assert not any(p.is_dir() for p in (tmp_path / "cache").iterdir())  # nothing left in the cache
    model = Model("h", "1.0", info, "h", 1, 100, 1, 120, False, result=BuildResult("/r", (BuiltModel("h", "handler"),)))
    assert model.handler and model.entry == "h"
    model = Model("m", "1.0", info, "m", 1, 100, 1, 120, False, result=BuildResult("/r", (
        BuiltModel("m", "classifier"), BuiltModel("m_image", "image"))))
    assert not model.handler and model.entry == "m_image"


LABEL_CASES = [{"0": ["n01440764", "tench"], "1": ["n01443537", "goldfish"]}, {"1": "goldfish", "0": "tench"},
               {"object_type_names": ["tench", "goldfish"]}, {"0": [5, "tench"], "1": "goldfish"},
               {"0": ["tench", 5]}, {"0": 3}, ["tench", "goldfish"]]


@pytest.mark.parametrize("content", LABEL_CASES)
def test_build_repo_and_the_front_read_an_archives_labels_by_torchserves_one_rule_when_given(tmp_path: Path, content):
    import json
    import zipfile

    from ts.utils.util import load_label_mapping

    from builder.custom import load_labels
    from builder.options import WeightsError
    from common.archive import ArchiveError, label_mapping
    from server.torchserve.archives import inspect

    path = tmp_path / "index_to_name.json"
    path.write_text(json.dumps(content))
    try:
        expected = load_label_mapping(str(path))  # TorchServe 0.12's own
    except Exception:  # noqa: BLE001 - it raises a bare Exception
        expected = None
    if expected is None:
        with pytest.raises(ArchiveError):
            label_mapping(content)
    else:
        assert label_mapping(content) == {key: str(name) for key, name in expected.items()}
    archive = tmp_path / "m.mar"
    with zipfile.ZipFile(archive, "w") as mar:
        mar.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "m", "handler": "image_classifier"}}))
        mar.writestr("index_to_name.json", json.dumps(content))
    assert inspect(archive, "m.mar").labels == (None if expected is None else label_mapping(content))
    if isinstance(content, list):  # build-repo's --labels also takes a plain list of names
        assert load_labels(path) == content
    elif expected is None:
        with pytest.raises(WeightsError, match="index->name"):
            load_labels(path)
    else:  # the same names, in index order
        assert load_labels(path) == [expected[str(i)] for i in range(len(expected))]


def test_served_config_changes_only_what_it_is_given_and_refuses_an_undocumented_parameter(tmp_path: Path):
    from common.modelconfig import served

    config = read_config(_config(tmp_path / "c.pbtxt", "KIND_CPU", 2))
    config.dynamic_batching.max_queue_delay_microseconds = 5000
    changed = served(config, queue_delay_us=0, parameters={"max_pixels": "1000"})
    assert config.dynamic_batching.max_queue_delay_microseconds == 5000  # a copy: the built one unchanged
    assert changed.dynamic_batching.max_queue_delay_microseconds == 0
    assert changed.parameters["max_pixels"].string_value == "1000" and changed.instance_group == config.instance_group
    with pytest.raises(ValueError, match="max_pixel are not in"):
        served(config, parameters={"max_pixel": "1000"})


SETTINGS_CASES = ["batchSize: 4\nmaxBatchDelay: 20\nminWorkers: 2\nmaxWorkers: 3\n",
                  "batchSize: 2.5\nmaxBatchDelay: true\nminWorkers: '2'\n",  # not integers: TorchServe keeps defaults
                  "batchSize: 0\nmaxBatchDelay: 0\nminWorkers: 3\nmaxWorkers: 1\n", "- a list\n", "{not: yaml: [", ""]


@pytest.mark.parametrize("text", SETTINGS_CASES)
def test_build_repo_and_the_front_read_an_archives_model_config_by_one_rule_when_given(tmp_path: Path, text):
    """Issue 53: model-config.yaml was read three ways with three rules (the front, build-repo's image path, its
    handler path); one reader now (common/archive.model_settings), TorchServe's: integers only."""
    import json
    import zipfile

    import yaml

    from builder import mar
    from common.archive import model_settings
    from server.torchserve.archives import inspect

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    data = data if isinstance(data, dict) else {}
    wanted = [data.get(key) if type(data.get(key)) is int else None
              for key in ("batchSize", "maxBatchDelay", "minWorkers", "maxWorkers")]
    settings = model_settings(text, strict=False)
    assert [settings.batch_size, settings.max_batch_delay, settings.min_workers, settings.max_workers] == wanted
    archive = tmp_path / "m.mar"
    with zipfile.ZipFile(archive, "w") as made:
        made.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "m", "configFile": "c.yaml"}}))
        made.writestr("c.yaml", text)
    info = inspect(archive, "m.mar")  # the front: what TorchServe's registration takes of them
    assert (info.batch_size, info.max_batch_delay) == tuple(v if v and v > 0 else None for v in wanted[:2])
    assert info.min_workers == (wanted[2] if wanted[2] and wanted[3] is not None and 0 < wanted[2] <= wanted[3]
                                else None)
    (tmp_path / "c.yaml").write_text(text)
    if text.startswith("{not"):  # build-repo names the fault
        with pytest.raises(mar.ArchiveError, match="c.yaml in the archive is not valid YAML"):
            mar.read_settings(tmp_path / "c.yaml")
    else:
        assert mar.read_settings(tmp_path / "c.yaml") == settings
