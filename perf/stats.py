"""Triton's statistics API and the backends' own stage split, read once: snapshots and their differences."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# The stages of a request's time in Triton's statistics (ns totals over successful requests).
STAGES = ("queue", "compute_input", "compute_infer", "compute_output")


@dataclass(frozen=True)
class Counters:
    """A model's cumulative counters at one moment, or (after `-`) over an interval."""

    inferences: int = 0   # images (batch rows) inferred
    executions: int = 0   # batches the model ran
    successes: int = 0    # requests that succeeded
    ns: dict[str, int] = field(default_factory=dict)  # stage -> total nanoseconds

    def __sub__(self, earlier: "Counters") -> "Counters":
        return Counters(self.inferences - earlier.inferences, self.executions - earlier.executions,
                        self.successes - earlier.successes,
                        {stage: self.ns.get(stage, 0) - earlier.ns.get(stage, 0) for stage in STAGES})

    @property
    def avg_batch(self) -> float:
        """Inferences per execution: above 1 means Triton formed batches."""
        return self.inferences / self.executions if self.executions else float("nan")

    def ms_per_request(self, stage: str) -> float:
        """Average milliseconds a successful request spent in `stage`."""
        return self.ns.get(stage, 0) / max(self.successes, 1) / 1e6

    def compute_ms(self) -> float:
        return sum(self.ms_per_request(stage) for stage in STAGES if stage != "queue")


def counters(client, model: str) -> Counters:
    """The model's counters now, from an HTTP or a gRPC tritonclient (JSON numbers or int64 strings)."""
    grpc = type(client).__module__.startswith("tritonclient.grpc")
    reply = client.get_inference_statistics(model, as_json=True) if grpc else client.get_inference_statistics(model)
    stats = next(s for s in reply["model_stats"] if s["name"] == model)
    stages = stats.get("inference_stats", {})
    return Counters(int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0)),
                    int(stages.get("success", {}).get("count", 0)),
                    {stage: int(stages.get(stage, {}).get("ns", 0)) for stage in STAGES})


def settled_counters(client, model: str, wait_s: float = 2.0) -> Counters:
    """The counters once the last requests' updates have landed: two reads 50 ms apart that agree (at most
    `wait_s`). Triton counts an execution when its batch ends but each inference when its response is released,
    after the client already has it: read at once, the end of a load can show one execution ahead of its
    inferences (CI read 14 inferences over 15 executions)."""
    now = counters(client, model)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        again = counters(client, model)
        if again == now:
            break
        now = again
    return now


# The backends' measurement mode (config parameter stage_timing=FOLDER, backends/stage_clock.py): per-stage totals.
@dataclass(frozen=True)
class StageSplit:
    """A model's per-stage seconds and the executes they cover, at one moment or (after `-`) over an interval."""

    executions: float = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def __sub__(self, earlier: "StageSplit") -> "StageSplit":
        return StageSplit(self.executions - earlier.executions,
                          {stage: value - earlier.seconds.get(stage, 0.0) for stage, value in self.seconds.items()})

    def ms_per_execute(self) -> dict[str, float]:
        """Milliseconds per execute in each stage (empty when no execute was counted)."""
        if self.executions <= 0:
            return {}
        return {stage: round(value / self.executions * 1000, 3) for stage, value in sorted(self.seconds.items())}


def stage_split(folder, model: str) -> StageSplit:
    """`model`'s totals now, summed over its instances' files in `folder` (zeros where there are none)."""
    import json
    from pathlib import Path

    executions, seconds = 0, {}
    for path in sorted(Path(folder).glob(f"{model}.*.json")):
        try:
            found = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced between the listing and the read: the next file has its totals
            continue
        if found.get("model") != model:  # NAME.* also matches NAME.x's files where a name holds a dot
            continue
        executions += found["executions"]
        for stage, value in found["seconds"].items():
            seconds[stage] = seconds.get(stage, 0.0) + value
    return StageSplit(executions, seconds)
