"""One step of the GPU round, run in this process: python -m perf.gpu.steps STEP OUTDIR [--timeout-s S] [--dry-run].

perf.gpu.round starts this once per step, so that a step which crashes (a fault in CUDA) or hangs
ends only itself. The outcome goes to OUTDIR/STEP.result.json for perf.gpu.round to collect.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from common.cli import OneLineParser
from common import messages

ROOT = Path(__file__).resolve().parents[2]
# name -> (module, function, needs CUDA), in the order perf.gpu.round runs them: the bench first (alone on the GPU:
# the figures, and whether served answers are right), the engine alone (the served path's reference), the GPU tests, instance_io (which way of serving answers right:
# only when the bench's answers were wrong, unless asked), then the narrower checks and the extras. Without CUDA a
# step that needs it is skipped, unless the round is a dry run: then the CPU stands in.
STEPS = {
    "environment": ("perf.gpu.checks", "environment", False),
    "bench": ("perf.gpu.bench_steps", "round_step", True),
    "engine": ("perf.gpu.engine", "round_step", True),
    "gpu_tests": ("perf.gpu.checks", "gpu_tests", True),
    "instance_io": ("perf.gpu.io_variants", "instance_io", True),
    "gpu_output": ("perf.gpu.served", "gpu_output", True),
    "image_path": ("perf.gpu.served", "image_path", True),
    "parity": ("perf.gpu.checks", "parity", True),
    "instances": ("perf.gpu.bench_steps", "instances_step", True),
    "compile": ("perf.gpu.compile", "round_step", True),
    "python_backend_probe": ("perf.gpu.served", "python_backend_probe", True),
}
# What perf.gpu.round runs unless --steps names others: compile (torch.compile's warm-up takes minutes) only on demand.
DEFAULT_STEPS = tuple(step for step in STEPS if step != "compile")


class StepFailed(Exception):
    """The step ran and found a fault; the message is the reason."""


class StepSkipped(Exception):
    """The step cannot run here; the message is the reason."""


class TimeLimit(BaseException):
    """SIGTERM from perf.gpu: the step's time is up (a BaseException, so no step swallows it)."""


@dataclass
class Context:
    """What a step gets: the folder for its logs, its deadline, and `details` to fill as it learns (kept
    even when the step fails or is stopped halfway)."""

    out: Path
    deadline: float
    details: dict = field(default_factory=dict)
    dry_run: bool = False  # the CPU stands in for the GPU, with a small model and short points

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    @property
    def kind(self) -> str:
        """build-repo --kind for this round."""
        return "cpu" if self.dry_run else "gpu"

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"


def result_path(out: Path, step: str) -> Path:
    return out / f"{step}.result.json"


def first_line(exc: BaseException) -> str:
    return messages.first_line(exc, type(exc).__name__)[:500]


def run(step: str, out: Path, timeout_s: float, dry_run: bool = False) -> dict:
    """Run one step; whatever happens, an outcome: ok, failed with a reason, or skipped with a reason."""
    module, function, _ = STEPS[step]
    ctx = Context(out, time.monotonic() + timeout_s, dry_run=dry_run)
    try:
        getattr(importlib.import_module(module), function)(ctx)
        outcome = {"status": "ok"}
    except StepSkipped as exc:
        outcome = {"status": "skipped", "reason": str(exc)}
    except StepFailed as exc:
        outcome = {"status": "failed", "reason": str(exc)}
    except BaseException as exc:  # an unexpected error, or the time limit: this step's log gets the stack
        traceback.print_exc()
        outcome = {"status": "failed", "reason": f"{type(exc).__name__}: {first_line(exc)}"}
    outcome["details"] = ctx.details
    return outcome


def _time_limit(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
    raise TimeLimit("stopped at the step's time limit (SIGTERM)")


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m perf.gpu.steps", description=__doc__)
    p.add_argument("step", choices=list(STEPS), help="the step to run. Default: none (required).")
    p.add_argument("outdir", type=Path, help="folder for STEP.result.json and the step's logs. Default: none "
                                             "(required).")
    p.add_argument("--timeout-s", type=float, default=240,
                   help="the step's own deadline (server starts, requests); perf.gpu also stops it "
                        "then. Default: 240.")
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU stands in for the GPU (small model, short points). Default: off.")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _time_limit)
    args.outdir.mkdir(parents=True, exist_ok=True)
    outcome = run(args.step, args.outdir, args.timeout_s, args.dry_run)
    result_path(args.outdir, args.step).write_text(json.dumps(outcome, indent=2, default=str) + "\n")
    print(f"{args.step}: {outcome['status']} {outcome.get('reason', '')}".rstrip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def run_bounded(cmd: list[str], log: Path, timeout: float, grace: float = 20, **popen) -> int | None:
    """Run `cmd` in a session of its own, its stdout and stderr appended to `log`; past `timeout` seconds
    SIGTERM its process group, `grace` seconds later SIGKILL it. The exit status, or None if it ran out
    of time. Only that group is signalled, while its leader is unreaped (its pid cannot have been reused)."""
    with open(log, "ab") as sink:
        process = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, **popen)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(process.pid, signal.SIGTERM)  # lets the child stop its servers and write what it has
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not _exited(process.pid):
            time.sleep(0.2)
        _signal_group(process.pid, signal.SIGKILL)  # whatever is left in the group (a stuck grandchild)
        process.wait()
        return None


def _exited(pid: int) -> bool:
    """True once `pid` (our child) has exited, without reaping it: a zombie keeps its pid and group ours."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
