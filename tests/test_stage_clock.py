"""The backends' measurement mode: StageClock's split of each execute, its files, and perf's reading of them; the
batch runner's engine-alone forward (the GPU round's reference) on the CPU."""
import json

import pytest
import torch

from backends.batch_runner import BatchRunner
from backends.stage_clock import StageClock, StageFiles
from perf.stats import stage_split


def test_stage_clock_records_nothing_and_publishes_nothing_when_off():
    published = []
    clock = StageClock(False, publish=lambda totals, count: published.append((totals, count)))
    clock.start()
    clock.lap("inputs")
    assert clock.event() is None
    clock.finish()
    clock.flush()
    assert clock.totals == {} and clock.executions == 0 and published == []


def test_stage_clock_splits_host_time_by_lap_and_publishes_totals_when_on(tmp_path):
    clock = StageClock(True, publish=StageFiles(str(tmp_path), "m"))
    for _ in range(3):
        clock.start()
        clock.lap("inputs")
        sum(range(20000))
        clock.lap("forward")
        clock.finish()
    clock.close()
    assert clock.executions == 3 and clock.totals["forward"] > clock.totals["inputs"] >= 0
    (written,) = tmp_path.glob("m.*.json")
    assert json.loads(written.read_text())["executions"] == 3
    split = stage_split(tmp_path, "m")
    assert split.executions == 3 and split.seconds == pytest.approx(clock.totals)
    later = StageClock(True, publish=StageFiles(str(tmp_path), "m.x"))  # another model whose name extends m's
    later.start()
    later.lap("inputs")
    later.finish()
    later.close()
    assert stage_split(tmp_path, "m").executions == 3  # not m.x's
    assert (stage_split(tmp_path, "m") - split).ms_per_execute() == {}


def test_batch_runner_times_staging_and_forward_when_its_clock_is_on():
    engine = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5)).eval()
    runner = BatchRunner(engine, torch.device("cpu"), (3, 2, 2), channels_last=False)
    runner.clock = StageClock(True)
    runner.clock.start()
    logits = runner.run([torch.randn(2, 3, 2, 2), torch.randn(1, 3, 2, 2)])
    runner.clock.finish()
    assert logits.shape == (3, 5)
    assert set(runner.clock.totals) == {"staging", "forward"}


def test_forward_on_device_runs_the_engine_alone_on_the_resident_batch_at_its_bucket():
    engine = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 5)).eval()
    runner = BatchRunner(engine, torch.device("cpu"), (3, 2, 2), channels_last=False)
    out = runner.forward_on_device(4)
    assert out.shape == (4, 5) and runner.bucket_for(4) == 4  # no buckets off the GPU
    assert torch.equal(out, runner.run([torch.zeros(4, 3, 2, 2)]))
