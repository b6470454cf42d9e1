"""Triton's ModelConfig protobuf, the one typed model config: read from a config.pbtxt (builder/config.py writes them)
or from Triton's JSON (GET /v2/models/NAME/config), written back as that JSON (a load's config override); instances."""
from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor
from tritonclient.grpc import model_config_pb2 as mc

from common.contract import PARAMETERS

_INT64 = {FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64}


def to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def read_config(path: Path) -> mc.ModelConfig:
    """Parse a config.pbtxt (or a model directory holding one) into ModelConfig."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.pbtxt"
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def from_json(config: dict) -> mc.ModelConfig:
    """Triton's JSON form of a model config (its HTTP config API's answer) as ModelConfig. A field this
    tritonclient's model_config.proto does not know (a newer Triton's) is dropped, not an error; so is an enum value
    it does not know (the field reads as unset). ValueError naming the field where a value does not parse."""
    try:
        return json_format.ParseDict(config, mc.ModelConfig(), ignore_unknown_fields=True)
    except json_format.ParseError as error:
        raise ValueError(f"model config: {error}") from None


def to_json(config: mc.ModelConfig) -> dict:
    """`config` in Triton's JSON form, as its load API takes a config override: the proto's own (snake_case) field
    names and int64 fields (dims, max_queue_delay_microseconds...) as numbers, as Triton writes them itself
    (MessageToDict writes int64 as strings, which protobuf's JSON parser accepts too). Fields at their default
    value are left out: Triton's parser reads them as that default."""
    return _int64_as_numbers(config, json_format.MessageToDict(config, preserving_proto_field_name=True))


def _int64_as_numbers(message, data: dict) -> dict:
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                if entry.message_type is not None:
                    _int64_as_numbers(item, data[field.name][str(key)])
                elif entry.cpp_type in _INT64:
                    data[field.name][str(key)] = int(item)
        elif field.message_type is not None:
            items = list(value) if isinstance(data[field.name], list) else [value]
            parts = data[field.name] if isinstance(data[field.name], list) else [data[field.name]]
            for item, part in zip(items, parts):
                _int64_as_numbers(item, part)
        elif field.cpp_type in _INT64:
            data[field.name] = [int(v) for v in value] if isinstance(data[field.name], list) else int(value)
    return data


def parameters(config: mc.ModelConfig) -> dict[str, str]:
    """The config's parameters as plain strings."""
    return {key: value.string_value for key, value in config.parameters.items()}


def instance_groups(kind: str | int, count: int, like: mc.ModelInstanceGroup | None = None
                    ) -> list[mc.ModelInstanceGroup]:
    """`count` instances as `count` groups of one, each with its own rate_limiter priority 1..count when there are
    several. Triton tells instance groups apart by everything but their name and count, so each instance then has
    a signature of its own and serve-repo can replace a dead one alone (server/supervisor.py). The priority weighs
    nothing unless tritonserver runs with --rate-limit (off by default). `kind`: "KIND_CPU" or its number;
    `like`: a group whose other fields (gpus, host_policy...) are kept."""
    kind = mc.ModelInstanceGroup.Kind.Value(kind) if isinstance(kind, str) else kind
    groups = []
    for index in range(count):
        group = mc.ModelInstanceGroup()
        if like is not None:
            group.CopyFrom(like)
            for name in ("name", "count", "rate_limiter"):
                group.ClearField(name)
        group.kind, group.count = kind, 1
        if count > 1:
            group.rate_limiter.priority = index + 1
        groups.append(group)
    return groups


def instance_count(config: mc.ModelConfig) -> int:
    """Instances per device in `config`: the counts of its groups added up (a group's count unset: 1; no group: 1)."""
    return sum(group.count or 1 for group in config.instance_group) or 1


def set_instances(config: mc.ModelConfig, count: int) -> None:
    """`config` serving `count` instances of its first group's kind (KIND_CPU where it has none, or KIND_AUTO), as
    `count` groups of one (instance_groups), the first group's other fields kept."""
    first = mc.ModelInstanceGroup()
    if config.instance_group:
        first.CopyFrom(config.instance_group[0])
    groups = instance_groups(first.kind or mc.ModelInstanceGroup.KIND_CPU, count, first)
    del config.instance_group[:]
    config.instance_group.extend(groups)


def served(config: mc.ModelConfig, instances: int | None = None, at_most: int | None = None,
           queue_delay_us: int | None = None, parameters: dict[str, str] | None = None) -> mc.ModelConfig:
    """A copy of `config` served otherwise than built (serve-repo's TorchServe front): `instances` (else as built, but
    no more than `at_most`) as groups of one (set_instances); the dynamic batcher's queue delay where it has one;
    `parameters`, each a key contract.PARAMETERS documents (ValueError naming any other)."""
    config = mc.ModelConfig.FromString(config.SerializeToString())
    unknown = sorted(set(parameters or {}) - set(PARAMETERS))
    if unknown:
        raise ValueError(f"parameter(s) {', '.join(unknown)} are not in common/contract.py's PARAMETERS")
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = value
    if queue_delay_us is not None and config.HasField("dynamic_batching"):
        config.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    built = sum(group.count or 1 for group in config.instance_group)
    if instances is None and at_most is not None and built > at_most:
        instances = at_most
    if instances is not None:
        set_instances(config, instances)
    return config
