"""Read a config.pbtxt into Triton's own ModelConfig protobuf (builder/config.py writes them); instance groups."""
from __future__ import annotations

import json
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from common.contract import PARAMETERS


def to_text(config: mc.ModelConfig) -> str:
    return text_format.MessageToString(config)


def read_config(path: Path) -> mc.ModelConfig:
    """Parse a config.pbtxt (or a model directory holding one) into ModelConfig."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.pbtxt"
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def parameters(config: mc.ModelConfig) -> dict[str, str]:
    """The config's parameters as plain strings."""
    return {key: value.string_value for key, value in config.parameters.items()}


def instance_groups(kind: str, count: int, like: dict | None = None) -> list[dict]:
    """`count` instances as `count` groups of one (Triton's JSON form), each with its own
    rate_limiter priority 1..count when there are several. Triton tells instance groups apart by everything
    but their name and count, so each instance then has a signature of its own and serve-repo can replace a
    dead one alone (server/supervisor.py). The priority weighs nothing unless tritonserver runs with
    --rate-limit (off by default). `like`: a group whose other fields (gpus, host_policy...) are kept."""
    base = {k: v for k, v in (like or {}).items() if k not in ("name", "count", "rate_limiter")}
    base["kind"] = kind
    groups = []
    for index in range(count):
        group = {**json.loads(json.dumps(base)), "count": 1}
        if count > 1:
            group["rate_limiter"] = {"priority": index + 1}
        groups.append(group)
    return groups


def with_instances(config: dict, count: int) -> dict:
    """A copy of `config` (Triton's JSON form) serving `count` instances of its first group's kind."""
    config = json.loads(json.dumps(config))
    groups = config.get("instance_group") or [{"kind": "KIND_CPU"}]
    config["instance_group"] = instance_groups(groups[0].get("kind", "KIND_CPU"), count, groups[0])
    return config


def instance_count(config: dict) -> int:
    """Instances per device in `config` (Triton's JSON form): the counts of its groups added up."""
    return sum(int(group.get("count", 1)) for group in config.get("instance_group") or [{}])


def set_instances(config: mc.ModelConfig, count: int) -> None:
    """`config` (the protobuf) serving `count` instances of its first group's kind (KIND_CPU where it has none),
    as `count` groups of one (instance_groups), the first group's other fields kept."""
    first = (json_format.MessageToDict(config.instance_group[0], preserving_proto_field_name=True)
             if config.instance_group else {"kind": "KIND_CPU"})
    del config.instance_group[:]
    for group in instance_groups(first.get("kind", "KIND_CPU"), count, first):
        json_format.ParseDict(group, config.instance_group.add())


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
