"""config.pbtxt is Triton's own ModelConfig: typed specs validate, serialize and parse back."""
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from builder import config as cfg
from common.modelconfig import read_config


def _spec(**changes) -> cfg.ModelSpec:
    fields = dict(
        name="m",
        inputs=(cfg.Tensor("IMAGE", "TYPE_FP32", (3, 224, 224)),),
        outputs=(cfg.Tensor("LOGITS", "TYPE_FP32", (1000,), "labels.txt"),),
        batching=cfg.Batching(8, 2000, (4, 8)),
        instances=2,
        parameters={"FORCE_CPU_ONLY_INPUT_TENSORS": "no"},
    )
    fields.update(changes)
    return cfg.ModelSpec(**fields)


def test_config_round_trips_through_model_config_when_written_and_parsed(tmp_path):
    written = _spec().to_proto()
    cfg.write_config(written, tmp_path)
    parsed = read_config(tmp_path / "config.pbtxt")
    assert parsed == written
    assert parsed.backend == "python" and parsed.max_batch_size == 8
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 2000
    assert list(parsed.dynamic_batching.preferred_batch_size) == [4, 8]
    assert parsed.input[0].data_type == mc.TYPE_FP32 and list(parsed.input[0].dims) == [3, 224, 224]
    assert parsed.output[0].label_filename == "labels.txt"
    # Two instances as two groups of one, told apart by their rate_limiter priority (server/supervisor.py
    # can then replace a dead one alone): kinds, counts and priorities as written.
    assert [(g.kind, g.count, g.rate_limiter.priority) for g in parsed.instance_group] == [
        (mc.ModelInstanceGroup.KIND_CPU, 1, 1), (mc.ModelInstanceGroup.KIND_CPU, 1, 2)]
    assert parsed.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"


def test_config_marks_input_optional_only_when_the_tensor_says_so():
    inputs = (cfg.Tensor("IMAGE", "TYPE_FP32", (3, 224, 224), optional=True),
              cfg.Tensor("IMAGE_UINT8", "TYPE_UINT8", (3, 224, 224), optional=True))
    assert [t.optional for t in _spec(inputs=inputs).to_proto().input] == [True, True]
    assert [t.optional for t in _spec().to_proto().input] == [False]


def test_config_has_no_dynamic_batching_when_max_batch_size_is_zero():
    config = _spec(batching=cfg.Batching(0, 0, ())).to_proto()
    assert config.max_batch_size == 0
    assert not config.HasField("dynamic_batching")


@pytest.mark.parametrize("platform_format", [cfg.Format.ONNX, cfg.Format.TORCHSCRIPT])
def test_config_sets_platform_not_backend_when_format_is_native(platform_format):
    config = _spec(format=platform_format).to_proto()
    assert config.platform == platform_format.platform and config.backend == ""


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"batching": cfg.Batching(-1, 0, ())}, "`max_batch_size`"),
        ({"batching": cfg.Batching(8, -5, ())}, "`max_queue_delay_microseconds`"),
        ({"batching": cfg.Batching(4, 0, (8,))}, "`preferred_batch_size` 8"),
        ({"batching": cfg.Batching(0, 0, (1,))}, "`preferred_batch_size` needs dynamic batching"),
        ({"instances": 0}, "`instance_group.count`"),
        ({"name": "bad name"}, "`name`"),
        ({"inputs": (cfg.Tensor("IMAGE", "TYPE_FP99", (3,)),)}, "`data_type`"),
        ({"inputs": (cfg.Tensor("IMAGE", "TYPE_FP32", (3, 0)),)}, "`dims`"),
    ],
)
def test_config_validate_names_the_field_when_a_value_is_invalid(changes, field):
    with pytest.raises(cfg.ConfigError, match=field.replace("(", r"\(")):
        _spec(**changes).validate()


def test_queue_policy_round_trips_through_config_pbtxt_when_set(tmp_path):
    queue = cfg.QueuePolicy(max_queue_size=64, timeout_us=250_000, timeout_action="DELAY", allow_timeout_override=True)
    config = _spec(batching=cfg.Batching(8, 0, (), queue)).to_proto()
    path = cfg.write_config(config, tmp_path)
    policy = read_config(path).dynamic_batching.default_queue_policy
    assert (policy.max_queue_size, policy.default_timeout_microseconds, policy.allow_timeout_override) == (64, 250_000, True)
    assert policy.timeout_action == mc.ModelQueuePolicy.DELAY


@pytest.mark.parametrize("batching, message", [
    (cfg.Batching(0, 0, (), cfg.QueuePolicy(max_queue_size=4)), "`default_queue_policy` needs dynamic batching"),
    (cfg.Batching(8, 0, (), cfg.QueuePolicy(max_queue_size=-1)), "`max_queue_size`"),
    (cfg.Batching(8, 0, (), cfg.QueuePolicy(timeout_action="DROP")), "`timeout_action`"),
])
def test_queue_policy_is_refused_with_the_field_named_when_invalid(batching, message):
    with pytest.raises(cfg.ConfigError, match=message):
        _spec(batching=batching).to_proto()


def test_set_instances_keeps_the_group_and_counts_instances_across_groups():
    from common.modelconfig import from_json, instance_count, served, to_json

    config = from_json({"name": "m", "instance_group": [{"name": "m_0", "kind": "KIND_GPU", "count": 2, "gpus": [0, 1],
                                                         "rate_limiter": {"priority": 0}}]})
    assert instance_count(config) == 2 and instance_count(mc.ModelConfig()) == 1
    three = served(config, 3)
    assert to_json(three)["instance_group"] == [{"kind": "KIND_GPU", "gpus": [0, 1], "count": 1,
                                                 "rate_limiter": {"priority": p}} for p in (1, 2, 3)]
    assert instance_count(three) == 3 and config.instance_group[0].count == 2  # a copy
    assert to_json(served(config, 1))["instance_group"] == [{"kind": "KIND_GPU", "gpus": [0, 1], "count": 1}]
