"""Typed Triton model configs: small dataclasses validated in one place, serialized via ModelConfig."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from common.modelconfig import instance_groups, to_text

# Shipped batching defaults. A zero queue delay means an idle server runs each request at once
# (no TorchServe-style batch-delay spike at low load), while a busy one still forms batches from
# whatever queued during the previous forward pass. perf/results/README.md has the measurements.
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_QUEUE_DELAY_US = 0

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class ConfigError(ValueError):
    """A model config field has a value Triton would reject or we cannot serve."""


class InstanceKind(str, Enum):
    CPU = "KIND_CPU"
    GPU = "KIND_GPU"


@dataclass(frozen=True)
class KindDefaults:
    max_batch_size: int
    max_queue_delay_us: int
    instances: int
    max_queue_size: int = 0      # requests waiting for a batch; beyond it rejected at once (0: unbounded)
    queue_timeout_ms: float = 0  # longest wait in that queue before the request is rejected (0: none)


# What `build-repo --kind K` ships when a flag is not given. A GPU wants big batches (ResNet-152 fp16
# on an H100: 2000 img/s at batch 8, 6200 at 64 with CUDA graphs), a short delay so a batch forms
# while another instance computes, and four instances: the python backend's per-request work in each stub,
# not the GPU, bounds a served model (ResNet-152 fp16 + CUDA graphs served at c=256 on an H100, 2026-11-27:
# 2 instances 2232 img/s, 4 instances 3673; perf/results/gpu-resnet152.json).
# No queue bounds by default (Triton's own default): any `default_queue_policy` turns Triton 2.51's
# prefetching off (core PR #237, scheduler_utils.cc), and then a request arriving while the instance is
# returning from its batch waits for the batcher's hard-coded 500 ms (dynamic_batch_scheduler.cc): measured
# with the earlier default bounds (128, 10 s), resnet18 on 2 cores, 8 runs of 2000 requests at c=1/2, up
# to ~2 % of requests over 500 ms; none without (perf/results/stalls-resnet18.json). --max-queue-size and
# --queue-timeout-ms still give Triton's bound, with that tail; a bound without it belongs in front of
# Triton (a reverse proxy's concurrency limit).
DEFAULTS = {
    InstanceKind.CPU: KindDefaults(DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE_DELAY_US, 1, 0, 0),
    InstanceKind.GPU: KindDefaults(64, 200, 4, 0, 0),
}


class Format(str, Enum):
    """Each export format and the Triton fields it implies."""

    PYTHON = "python"
    ONNX = "onnx"
    TORCHSCRIPT = "torchscript"
    ENSEMBLE = "ensemble"

    @property
    def backend(self) -> str:
        return _FORMATS[self][0]

    @property
    def platform(self) -> str:
        return _FORMATS[self][1]

    @property
    def artifact(self) -> str:
        return _FORMATS[self][2]


# format -> (backend, platform, artifact in the version directory)
_FORMATS = {
    Format.PYTHON: ("python", "", "model.py"),
    Format.ONNX: ("", "onnxruntime_onnx", "model.onnx"),
    Format.TORCHSCRIPT: ("", "pytorch_libtorch", "model.pt"),
    Format.ENSEMBLE: ("", "ensemble", ""),
}


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # a model_config_pb2.DataType name, e.g. "TYPE_FP32"
    dims: tuple[int, ...]
    label_filename: str = ""
    optional: bool = False  # an input a request may leave out (Triton's ModelInput.optional)


@dataclass(frozen=True)
class Batching:
    """`max_batch_size` 0 disables batching; otherwise Triton's dynamic batcher forms batches."""

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_queue_delay_us: int = DEFAULT_MAX_QUEUE_DELAY_US
    preferred_batch_sizes: tuple[int, ...] = ()
    queue: "QueuePolicy | None" = None  # Triton's default_queue_policy; None: unbounded, no timeout

    @property
    def dynamic(self) -> bool:
        return self.max_batch_size > 0

    def validate(self) -> None:
        if self.max_batch_size < 0:
            raise ConfigError(f"`max_batch_size` must be >= 0 (0 disables batching), got {self.max_batch_size}")
        if self.max_queue_delay_us < 0:
            raise ConfigError(f"`max_queue_delay_microseconds` must be >= 0, got {self.max_queue_delay_us}")
        if self.preferred_batch_sizes and not self.dynamic:
            raise ConfigError("`preferred_batch_size` needs dynamic batching: set `max_batch_size` >= 1")
        for size in self.preferred_batch_sizes:
            if not 1 <= size <= self.max_batch_size:
                raise ConfigError(f"`preferred_batch_size` {size} must be between 1 and "
                                  f"`max_batch_size` {self.max_batch_size}")
        if self.queue is not None:
            if not self.dynamic:
                raise ConfigError("`default_queue_policy` needs dynamic batching: set `max_batch_size` >= 1")
            self.queue.validate()


@dataclass(frozen=True)
class QueuePolicy:
    """How long and how many requests may wait in the batcher's queue (Triton's ModelQueuePolicy)."""

    max_queue_size: int = 0  # 0: unbounded
    timeout_us: int = 0  # 0: no timeout
    timeout_action: str = "REJECT"  # or DELAY: keep it, but behind every request that is on time
    allow_timeout_override: bool = False  # let a request ask for a shorter timeout of its own

    def validate(self) -> None:
        if self.max_queue_size < 0:
            raise ConfigError(f"`max_queue_size` must be >= 0 (0 is unbounded), got {self.max_queue_size}")
        if self.timeout_us < 0:
            raise ConfigError(f"`default_timeout_microseconds` must be >= 0, got {self.timeout_us}")
        if self.timeout_action not in ("REJECT", "DELAY"):
            raise ConfigError(f"`timeout_action` must be REJECT or DELAY, got {self.timeout_action!r}")


@dataclass(frozen=True)
class Step:
    """One ensemble step: tensor maps are {step model's tensor name: ensemble tensor name}."""

    model_name: str
    input_map: dict[str, str]
    output_map: dict[str, str]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    format: Format = Format.PYTHON
    batching: Batching = field(default_factory=Batching)
    kind: InstanceKind = InstanceKind.CPU
    instances: int = 1
    parameters: dict[str, str] = field(default_factory=dict)
    steps: tuple[Step, ...] = ()

    def validate(self) -> None:
        """Raise ConfigError naming the first field that is wrong."""
        if not _NAME.match(self.name):
            raise ConfigError(f"`name` {self.name!r} must match {_NAME.pattern}")
        if not self.inputs or not self.outputs:
            raise ConfigError("`input` and `output` must each list at least one tensor")
        for tensor in self.inputs + self.outputs:
            if tensor.data_type not in mc.DataType.keys():
                raise ConfigError(f"`data_type` {tensor.data_type!r} of {tensor.name} is not a Triton type")
            if not tensor.dims or any(d == 0 or d < -1 for d in tensor.dims):
                raise ConfigError(f"`dims` of {tensor.name} must be positive or -1, got {list(tensor.dims)}")
        self.batching.validate()
        if (self.format == Format.ENSEMBLE) != bool(self.steps):
            raise ConfigError("`ensemble_scheduling` steps are needed exactly when the platform is ensemble")
        if self.instances < 1:
            raise ConfigError(f"`instance_group.count` must be >= 1, got {self.instances}")

    def to_proto(self) -> mc.ModelConfig:
        self.validate()
        config = mc.ModelConfig(
            name=self.name,
            backend=self.format.backend,
            platform=self.format.platform,
            max_batch_size=self.batching.max_batch_size,
        )
        for tensor in self.inputs:
            config.input.add(name=tensor.name, data_type=tensor.data_type, dims=tensor.dims, optional=tensor.optional)
        for tensor in self.outputs:
            config.output.add(
                name=tensor.name, data_type=tensor.data_type, dims=tensor.dims, label_filename=tensor.label_filename
            )
        if self.batching.dynamic:
            config.dynamic_batching.max_queue_delay_microseconds = self.batching.max_queue_delay_us
            config.dynamic_batching.preferred_batch_size.extend(self.batching.preferred_batch_sizes)
            if self.batching.queue is not None:
                policy = config.dynamic_batching.default_queue_policy
                policy.max_queue_size = self.batching.queue.max_queue_size
                policy.default_timeout_microseconds = self.batching.queue.timeout_us
                policy.timeout_action = mc.ModelQueuePolicy.TimeoutAction.Value(self.batching.queue.timeout_action)
                policy.allow_timeout_override = self.batching.queue.allow_timeout_override
        if self.format == Format.ENSEMBLE:  # ensembles run no instances of their own
            for step in self.steps:
                config.ensemble_scheduling.step.add(model_name=step.model_name, model_version=-1,
                                                    input_map=step.input_map, output_map=step.output_map)
        else:
            config.instance_group.extend(instance_groups(self.kind.value, self.instances))  # one group per instance
        for key, value in sorted(self.parameters.items()):
            config.parameters[key].string_value = str(value)
        return config


def write_config(config: mc.ModelConfig, model_dir: Path) -> Path:
    path = Path(model_dir) / "config.pbtxt"
    path.write_text(to_text(config))
    return path
