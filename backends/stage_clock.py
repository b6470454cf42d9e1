"""Where an execute() spends its time, per stage: the backends' measurement mode (config parameter stage_timing=1).

build-repo copies this file beside the classifier's and the fused model's model.py; it must stay self-contained.
Off (the default) every call is a no-op. On, host stages are timed with perf_counter as they run (their sum is
the execute's wall time), device stages with CUDA events on the runner's stream, read after the one wait per
batch the runner already makes (no extra synchronization). stage_timing names a folder: each instance keeps its
totals in FOLDER/<model>.<pid>.json, {"executions": N, "seconds": {stage: s}}, rewritten at most every FLUSH_S,
so that a bench reads them before and after a point, beside Triton's own queue / compute figures
(perf.stats.stage_split).

Host stages: inputs (reading the requests' tensors), decode / transform / pil (the image models' JPEGs),
staging (rows into pinned or batch memory), launch (queueing copies and the forward), forward (CPU: the forward
itself), wait (the host blocked on the device), responses. Device stages (GPU only): device_h2d (copies and
normalizing on the device), device_forward, device_d2h.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

FLUSH_S = 0.25  # the totals file is rewritten at most this often (executions and seconds together)


class StageClock:
    """Accumulates one model instance's per-stage seconds; `enabled=False` makes every method a no-op."""

    def __init__(self, enabled: bool = False, device: torch.device | None = None, publish=None):
        self.enabled = enabled
        self.gpu = bool(device is not None and device.type == "cuda")
        self._publish = publish  # (seconds per stage, executions) -> None; None keeps the totals here only
        self.totals: dict[str, float] = {}
        self.executions = 0
        self._pending: dict[str, float] = {}
        self._pending_executions = 0
        self._last = 0.0
        self._flushed = time.monotonic()
        self._events: list[tuple[str, object, object]] = []

    def start(self) -> None:
        """An execute begins: host laps are measured from now."""
        if self.enabled:
            self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        """The host time since the last lap (or start) was spent in `stage`."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self._add(stage, now - self._last)
        self._last = now

    def event(self, stream=None):
        """A CUDA event recorded now on `stream` (None off the GPU or when off)."""
        if not (self.enabled and self.gpu):
            return None
        import torch  # only on a GPU: the host path's stubs import no torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def span(self, stage: str, begin, end) -> None:
        """Device time between two events of `event()`, read at `finish()` (after the batch's own wait)."""
        if begin is not None and end is not None:
            self._events.append((stage, begin, end))

    def finish(self) -> None:
        """The execute is done: read the device spans (their work is complete), count it, publish now and then."""
        if not self.enabled:
            return
        for stage, begin, end in self._events:
            end.synchronize()  # already complete: the runner waited for its stream
            self._add(stage, begin.elapsed_time(end) / 1000)
        self._events.clear()
        self.executions += 1
        self._pending_executions += 1
        if self._publish is not None and time.monotonic() - self._flushed >= FLUSH_S:
            self.flush()

    def close(self) -> None:
        """Publish what is pending and let go of the publisher (the model's finalize)."""
        self.flush()
        self._publish = None

    def flush(self) -> None:
        if self._publish is None or not self._pending_executions:
            return
        self._publish(dict(self._pending), self._pending_executions)
        self._pending.clear()
        self._pending_executions = 0
        self._flushed = time.monotonic()

    def _add(self, stage: str, seconds: float) -> None:
        self.totals[stage] = self.totals.get(stage, 0.0) + seconds
        self._pending[stage] = self._pending.get(stage, 0.0) + seconds


class StageFiles:
    """StageClock's publisher: this instance's cumulative totals in FOLDER/<model>.<pid>.json (written whole to a
    temporary name, then renamed: a reader sees the previous or the new totals). Files, not Triton's custom metrics:
    in python_backend r24.10 a counter that two stubs share by name and labels is freed with the first stub's family,
    and the next increment from another corrupts tritonserver's heap (seen here on a reload; server issue #8663)."""

    def __init__(self, folder: str, model: str):
        self.path = Path(folder) / f"{model}.{os.getpid()}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.executions = 0
        self.seconds: dict[str, float] = {}

    def __call__(self, totals: dict[str, float], count: int) -> None:
        for stage, value in totals.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + value
        self.executions += count
        partial = self.path.with_suffix(".part")
        partial.write_text(json.dumps({"model": self.model, "pid": os.getpid(), "executions": self.executions,
                                       "seconds": self.seconds}))
        partial.replace(self.path)
