"""Triton's JSON model config and ModelConfig are one typed object: read from JSON (unknown fields dropped), written
back as Triton writes it (snake_case names, int64 as numbers), with nothing lost either way."""
from __future__ import annotations

import json

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from common.modelconfig import from_json, read_config, to_json
from support import SMALL


def _json_trip(config: mc.ModelConfig) -> mc.ModelConfig:
    return from_json(json.loads(json.dumps(to_json(config))))  # through the text a load request carries


def _within(written, answered, where="config") -> None:
    """Every field `written` holds, `answered` holds with the same value and JSON type (it may hold more)."""
    if isinstance(written, dict):
        for key, value in written.items():
            assert key in answered, f"{where}.{key} missing from Triton's answer"
            _within(value, answered[key], f"{where}.{key}")
    elif isinstance(written, list):
        assert len(written) == len(answered), where
        for index, (ours, theirs) in enumerate(zip(written, answered)):
            _within(ours, theirs, f"{where}[{index}]")
    else:
        assert (written, type(written)) == (answered, type(answered)), where


def test_from_json_drops_unknown_fields_when_a_newer_triton_sends_them():
    config = from_json({"name": "m", "max_batch_size": 8, "field_from_the_future": {"x": 1},
                        "instance_group": [{"kind": "KIND_CPU", "count": 2, "new_group_field": True}],
                        "dynamic_batching": {"max_queue_delay_microseconds": "100", "new_knob": 3}})
    assert config.name == "m" and config.max_batch_size == 8
    assert config.instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU and config.instance_group[0].count == 2
    assert config.dynamic_batching.max_queue_delay_microseconds == 100  # int64 read from a string too
    with pytest.raises(ValueError, match="max_batch_size"):
        from_json({"max_batch_size": "eight"})


def test_to_json_writes_triton_field_names_and_int64_as_numbers_when_a_config_is_sent_back():
    config = from_json({"name": "m", "max_batch_size": 4, "input": [{"name": "IMAGE", "data_type": "TYPE_FP32",
                                                                     "dims": [3, 224, 224]}],
                        "dynamic_batching": {"max_queue_delay_microseconds": 2000, "default_queue_policy": {
                            "max_queue_size": 16, "default_timeout_microseconds": 500000}},
                        "parameters": {"engine": {"string_value": "torch"}}})
    written = to_json(config)
    assert written["input"] == [{"name": "IMAGE", "data_type": "TYPE_FP32", "dims": [3, 224, 224]}]
    assert written["dynamic_batching"] == {"max_queue_delay_microseconds": 2000, "default_queue_policy": {
        "max_queue_size": 16, "default_timeout_microseconds": 500000}}
    assert written["parameters"] == {"engine": {"string_value": "torch"}}


@pytest.mark.parametrize("model", [SMALL, f"{SMALL}_preprocess", f"{SMALL}_image"])
def test_built_config_round_trips_through_json_when_written_by_build_repo(repository, model):
    built = read_config(repository / model)
    assert _json_trip(built) == built
    written = to_json(built)
    if model == f"{SMALL}_image":  # the ensemble: its steps, each step's version -1 a number
        assert [step["model_name"] for step in written["ensemble_scheduling"]["step"]] == [f"{SMALL}_preprocess", SMALL]
        assert {step["model_version"] for step in written["ensemble_scheduling"]["step"]} == {-1}
    else:
        assert written["instance_group"] == [{"kind": "KIND_CPU", "count": 1}]
        assert written["dynamic_batching"]["max_queue_delay_microseconds"] == 2000  # conftest builds it so


def test_config_of_several_instances_and_a_queue_policy_round_trips_through_json_when_written(tmp_path):
    from builder import config as cfg

    image, logits = cfg.Tensor("IMAGE", "TYPE_FP32", (3, -1, -1)), cfg.Tensor("LOGITS", "TYPE_FP32", (10,))
    spec = cfg.ModelSpec("m", (image,), (logits,),
                         batching=cfg.Batching(8, 500, (4,), cfg.QueuePolicy(16, 1000, "DELAY")), instances=3)
    built = read_config(cfg.write_config(spec.to_proto(), tmp_path))
    assert _json_trip(built) == built
    written = to_json(built)
    assert written["instance_group"] == [{"kind": "KIND_CPU", "count": 1, "rate_limiter": {"priority": p}}
                                         for p in (1, 2, 3)]
    assert written["input"][0]["dims"] == [3, -1, -1]
    assert written["dynamic_batching"] == {"max_queue_delay_microseconds": 500, "preferred_batch_size": [4],
                                           "default_queue_policy": {"max_queue_size": 16, "timeout_action": "DELAY",
                                                                    "default_timeout_microseconds": 1000}}


@pytest.mark.parametrize("model", [SMALL, f"{SMALL}_image"])
def test_served_config_reads_as_built_and_writes_as_triton_answers_when_read_from_a_real_triton(
        repository, server, model):
    import tritonclient.http as httpclient

    answered = httpclient.InferenceServerClient(server.http_url).get_model_config(model)
    served, built = from_json(answered), read_config(repository / model)
    for group in served.instance_group:
        group.ClearField("name")  # Triton names each group (NAME_0, ...): all else is as built
    assert list(served.instance_group) == list(built.instance_group) or not built.instance_group
    if built.HasField("dynamic_batching"):  # (not touched otherwise: it is in a oneof with ensemble_scheduling)
        served.dynamic_batching.ClearField("preferred_batch_size")  # Triton fills it in (max_batch_size) where none
        assert served.dynamic_batching == built.dynamic_batching
    assert served.ensemble_scheduling == built.ensemble_scheduling
    assert list(served.input) == list(built.input) and list(served.output) == list(built.output)
    assert _json_trip(served) == served
    _within(to_json(served), answered)  # what a load request sends back is Triton's own JSON, less its defaults
