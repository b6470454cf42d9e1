"""One registration: TorchServe's (name, version) entry, its batching and workers, and the Triton models that
serve it (registry.py registers, scales and unregisters them)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from common import names
from common.build_result import BuildResult
from server.torchserve.archives import ArchiveInfo


@dataclass
class Model:
    name: str
    version: str
    info: ArchiveInfo
    triton: str  # BASE of the Triton models (triton_base)
    batch_size: int
    max_batch_delay: int
    workers: int
    response_timeout: int
    loaded_at_startup: bool
    startup_timeout: int = 120  # seconds its workers may take to start (TorchServe's default_startup_timeout)
    handler_override: str | None = None  # the registration's `handler`, in place of the manifest's (TorchServe's)
    runtime: str = "python"  # the registration's runtime (TorchServe's RuntimeType), described
    start_time: str = field(default_factory=lambda: datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3]
                            + "Z")
    members: list[str] = field(default_factory=list)  # Triton model names, in load order
    pending: int = 0  # predictions this model was found for and not yet answered (counted by the event loop)
    queued: int = 0  # of those, the ones whose body is read: TorchServe's job queue (a slow body is not in it)
    bounds: tuple[int, int] | None = None  # TorchServe's minWorkers, maxWorkers as a scale set them (None: workers)
    built: Path | None = None  # its build in the cache (archives.build)
    result: BuildResult = field(default_factory=BuildResult)  # build-repo --json's: each model's role
    # The image path's explanations (explainers.py): its handler-path model, loaded on the first one, and its build
    explainer: str | None = None
    explainer_built: Path | None = None
    explainer_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def handler(self) -> bool:
        """Served by the archive's own handler (build-repo --from-mar of a custom handler's archive: one model,
        BODY in, contract.HANDLER_OUTPUTS out), not by the image path (NAME_image), as build-repo said."""
        return self.result.handler

    @property
    def image_model(self) -> str:
        return names.image_model(self.triton)

    @property
    def entry(self) -> str:
        """The Triton model a prediction goes to."""
        return self.triton if self.handler else self.image_model

    @property
    def explainer_name(self) -> str:
        """The Triton model of the image path's explanations (common/names.py reserves it)."""
        return names.named(self.triton, "explain")
