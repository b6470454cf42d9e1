"""Read a config.pbtxt into Triton's own ModelConfig protobuf (builder/config.py writes them)."""
from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc


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
