"""What the TorchServe front asks build-repo to build from one archive, typed: every place that starts such a build
(serve-repo's flags, a registration, an explainer) fills one BuildRequest, and `to_argv()` is the one place that
spells build-repo's command line (tests/test_layout.py parses it back with build-repo's own parser)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BuildRequest:
    precision: str | None = None  # --precision (None: build-repo's default for the engine)
    engine: str | None = None  # --engine (None: auto)
    trust_model_code: bool = False  # TorchServe runs an archive's code: the front always sets it
    handler_path: bool = False  # serve through the archive's own handler
    max_batch_size: int | None = None  # TorchServe's batchSize
    max_batch_delay_ms: int | None = None  # TorchServe's maxBatchDelay
    archive: Path | None = None  # --from-mar
    name: str | None = None  # the Triton name
    output: Path | None = None

    def options(self) -> list[str]:
        """The build's options (what makes two builds of one archive differ): the build cache's key."""
        return [*(["--precision", self.precision] if self.precision else []),
                *(["--engine", self.engine] if self.engine else []),
                *(["--trust-model-code"] if self.trust_model_code else []),
                *(["--handler-path"] if self.handler_path else []),
                *(["--max-batch-size", str(self.max_batch_size)] if self.max_batch_size is not None else []),
                *(["--max-batch-delay-ms", str(self.max_batch_delay_ms)] if self.max_batch_delay_ms is not None
                  else [])]

    def to_argv(self) -> list[str]:
        """build-repo's arguments, --json included (its answer is read as a BuildResult)."""
        if self.archive is None or self.name is None or self.output is None:
            raise ValueError("a build needs its archive, its name and its output folder")
        return ["--from-mar", str(self.archive), "--name", self.name, "--output", str(self.output), *self.options(),
                "--json"]
